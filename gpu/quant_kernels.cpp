#include "gpu/quant_kernels.h"

#include <string>

#include "common/bnb4_blob.h"
#include "common/bnb4bit.h"
#include "common/check.h"
#include "gpu/detail/backend_kernels.h"
#include "gpu/host_device.h"

namespace zo::gpu {

namespace detail {

Status check_dequantize_packed_args(const Accounting& acct, const DequantizePackedArgs& args) {
  if (static_cast<unsigned>(args.out_dtype) > static_cast<unsigned>(DType::kF16))
    return invalid_argument("dequantize_packed: unknown out_dtype value " +
                            std::to_string(static_cast<unsigned>(args.out_dtype)));
  if (args.n_elems == 0) return Status::ok();
  if (args.n_elems > (uint64_t{1} << 48))
    return invalid_argument("dequantize_packed: n_elems = " + std::to_string(args.n_elems) + " is too large");
  // The smallest blob of n_elems weights (4-bit); the header's kind and shape, read where the kernel
  // runs, are trusted to agree with blob_bytes (the store wrote them; read_packed checks them).
  if (args.blob_bytes < bnb4::blob_bytes(0, args.n_elems, 1))
    return invalid_argument("dequantize_packed: blob_bytes = " + std::to_string(args.blob_bytes) +
                            " is smaller than any blob of " + std::to_string(args.n_elems) + " weights");
  const uint64_t blob = args.blob_bytes, out = args.n_elems * dtype_size_bytes(args.out_dtype);
  const auto b = reinterpret_cast<uintptr_t>(args.blob.addr), o = reinterpret_cast<uintptr_t>(args.out.addr);
  if (o % dtype_size_bytes(args.out_dtype) != 0)
    return invalid_argument("dequantize_packed: out is not " + std::to_string(dtype_size_bytes(args.out_dtype)) +
                            "-byte aligned (address " + std::to_string(o) + ")");
  ZO_RETURN_IF_ERROR(acct.check_range(args.blob.addr, blob, "dequantize_packed blob"));
  ZO_RETURN_IF_ERROR(acct.check_range(args.out.addr, out, "dequantize_packed out"));
  if (b < o + out && o < b + blob) return invalid_argument("dequantize_packed: blob and out overlap");
  return Status::ok();
}

namespace {

Status host_dequantize_packed(Device& device, const DequantizePackedArgs& args, Stream stream) {
  auto& host = static_cast<HostDevice&>(device);
  ZO_RETURN_IF_ERROR(check_dequantize_packed_args(host.accounting(), args));
  if (args.n_elems == 0) return Status::ok();
  host.enqueue(stream, [blob = static_cast<const uint8_t*>(args.blob.addr), out = args.out.addr, dtype = args.out_dtype,
                        n = args.n_elems] {
    static const bnb4::CodeTables tables = bnb4::code_tables();
    const bnb4::BlobHeader h = bnb4::blob_header_unchecked(blob);
    const uint8_t* codes = blob + bnb4::blob_codes_offset();
    const uint8_t* scales = blob + bnb4::blob_scales_offset(h.type, n);
    for (uint64_t i = 0; i < n; ++i)
      bnb4::store_element(dtype, bnb4::blob_element(tables, h.type, h.round, h.cols, codes, 0, scales, 0, i), out, i);
  });
  return Status::ok();
}

}  // namespace
}  // namespace detail

Status dequantize_packed(Device& device, const DequantizePackedArgs& args, Stream stream) {
  switch (device.kind()) {
    case DeviceKind::kHost: return detail::host_dequantize_packed(device, args, stream);
    case DeviceKind::kCuda: return detail::cuda_dequantize_packed(device, args, stream);
    case DeviceKind::kAuto: break;
  }
  ZO_CHECK(false) << "dequantize_packed: a device of kind " << device_kind_name(device.kind());
  return Status::ok();
}

}  // namespace zo::gpu

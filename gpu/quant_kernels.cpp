#include "gpu/quant_kernels.h"

#include <string>

#include "common/bnb4_blob.h"
#include "common/bnb4bit.h"
#include "common/check.h"
#include "gpu/detail/backend_kernels.h"
#include "gpu/host_device.h"

namespace zo::gpu {

namespace detail {

Status check_dequantize_4bit_args(const Accounting& acct, const Dequantize4bitArgs& args) {
  if (static_cast<unsigned>(args.out_dtype) > static_cast<unsigned>(DType::kF16))
    return invalid_argument("dequantize_4bit: unknown out_dtype value " +
                            std::to_string(static_cast<unsigned>(args.out_dtype)));
  if (args.n_elems == 0) return Status::ok();
  if (args.n_elems > (uint64_t{1} << 48))
    return invalid_argument("dequantize_4bit: n_elems = " + std::to_string(args.n_elems) + " is too large");
  const uint64_t blob = bnb4::blob_bytes(args.n_elems), out = args.n_elems * dtype_size_bytes(args.out_dtype);
  const auto b = reinterpret_cast<uintptr_t>(args.blob.addr), o = reinterpret_cast<uintptr_t>(args.out.addr);
  if (o % dtype_size_bytes(args.out_dtype) != 0)
    return invalid_argument("dequantize_4bit: out is not " + std::to_string(dtype_size_bytes(args.out_dtype)) +
                            "-byte aligned (address " + std::to_string(o) + ")");
  ZO_RETURN_IF_ERROR(acct.check_range(args.blob.addr, blob, "dequantize_4bit blob"));
  ZO_RETURN_IF_ERROR(acct.check_range(args.out.addr, out, "dequantize_4bit out"));
  if (b < o + out && o < b + blob) return invalid_argument("dequantize_4bit: blob and out overlap");
  return Status::ok();
}

namespace {

Status host_dequantize_4bit(Device& device, const Dequantize4bitArgs& args, Stream stream) {
  auto& host = static_cast<HostDevice&>(device);
  ZO_RETURN_IF_ERROR(check_dequantize_4bit_args(host.accounting(), args));
  if (args.n_elems == 0) return Status::ok();
  host.enqueue(stream, [blob = static_cast<const uint8_t*>(args.blob.addr), out = args.out.addr, dtype = args.out_dtype,
                        n = args.n_elems] {
    static const bnb4::CodeTables tables = bnb4::code_tables();
    const uint8_t type = blob[4];
    const auto round = static_cast<DType>(blob[5]);
    const uint8_t* codes = blob + bnb4::blob_codes_offset();
    const uint8_t* absmax = blob + bnb4::blob_absmax_offset(n);
    for (uint64_t i = 0; i < n; ++i)
      bnb4::store_element(dtype, bnb4::blob_element(tables, type, round, codes, 0, absmax, 0, i), out, i);
  });
  return Status::ok();
}

}  // namespace
}  // namespace detail

Status dequantize_4bit(Device& device, const Dequantize4bitArgs& args, Stream stream) {
  switch (device.kind()) {
    case DeviceKind::kHost: return detail::host_dequantize_4bit(device, args, stream);
    case DeviceKind::kCuda: return detail::cuda_dequantize_4bit(device, args, stream);
    case DeviceKind::kAuto: break;
  }
  ZO_CHECK(false) << "dequantize_4bit: a device of kind " << device_kind_name(device.kind());
  return Status::ok();
}

}  // namespace zo::gpu

// CudaDevice's dequantize_packed (gpu/quant_kernels.h): one CUDA thread per element through the
// element read HostDevice's loop runs (bnb4::blob_element, common/bnb4_blob.h), queued on the
// device's own stream. At most two multiplies and two roundings an element, no contraction to fuse
// (gpu/meson.build builds the .cu files with -fmad=false), so the bits are the host's.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "common/bnb4_blob.h"
#include "common/bnb4bit.h"
#include "gpu/cuda/cuda_device.h"
#include "gpu/cuda/cuda_error.cuh"
#include "gpu/detail/backend_kernels.h"

namespace zo::gpu::detail {
namespace {

__global__ void dequantize_packed_kernel(bnb4::CodeTables tables, const uint8_t* blob, void* out, DType dtype,
                                         uint64_t n) {
  const bnb4::BlobHeader h = bnb4::blob_header_unchecked(blob);
  const uint8_t* codes = blob + bnb4::blob_codes_offset();
  const uint8_t* scales = blob + bnb4::blob_scales_offset(h.type, n);
  const uint64_t stride = uint64_t{gridDim.x} * blockDim.x;
  for (uint64_t i = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n; i += stride)
    bnb4::store_element(dtype, bnb4::blob_element(tables, h.type, h.round, h.cols, codes, 0, scales, 0, i), out, i);
}

}  // namespace

Status cuda_dequantize_packed(Device& device, const DequantizePackedArgs& args, Stream stream) {
  ZO_CHECK(device.kind() == DeviceKind::kCuda) << "CudaDevice's kernels on " << device.name();
  auto& dev = static_cast<CudaDevice&>(device);
  ZO_ASSIGN_OR_RETURN(void* native, dev.kernel_stream(stream));
  ZO_RETURN_IF_ERROR(check_dequantize_packed_args(dev.accounting(), args));
  if (args.n_elems == 0) return Status::ok();
  constexpr unsigned kThreads = 256;
  const uint64_t blocks = std::min<uint64_t>((args.n_elems + kThreads - 1) / kThreads, 65535);
  dequantize_packed_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, static_cast<cudaStream_t>(native)>>>(
      bnb4::code_tables(), static_cast<const uint8_t*>(args.blob.addr), args.out.addr, args.out_dtype, args.n_elems);
  ZO_CUDA_RETURN_IF_ERROR(cudaGetLastError(), "launching the dequantize_packed kernel");
  return Status::ok();
}

}  // namespace zo::gpu::detail

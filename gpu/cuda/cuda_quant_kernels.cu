// CudaDevice's dequantize_4bit (gpu/quant_kernels.h): one CUDA thread per element through the
// element read HostDevice's loop runs (bnb4::blob_element, common/bnb4_blob.h), queued on the
// device's own stream. One multiply and two roundings a element, no contraction to fuse
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

__global__ void dequantize_4bit_kernel(bnb4::CodeTables tables, const uint8_t* blob, void* out, DType dtype,
                                       uint64_t n) {
  const uint8_t type = blob[4];
  const auto round = static_cast<DType>(blob[5]);
  const uint8_t* codes = blob + bnb4::blob_codes_offset();
  const uint8_t* absmax = blob + bnb4::blob_absmax_offset(n);
  const uint64_t stride = uint64_t{gridDim.x} * blockDim.x;
  for (uint64_t i = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n; i += stride)
    bnb4::store_element(dtype, bnb4::blob_element(tables, type, round, codes, 0, absmax, 0, i), out, i);
}

}  // namespace

Status cuda_dequantize_4bit(Device& device, const Dequantize4bitArgs& args, Stream stream) {
  ZO_CHECK(device.kind() == DeviceKind::kCuda) << "CudaDevice's kernels on " << device.name();
  auto& dev = static_cast<CudaDevice&>(device);
  ZO_ASSIGN_OR_RETURN(void* native, dev.kernel_stream(stream));
  ZO_RETURN_IF_ERROR(check_dequantize_4bit_args(dev.accounting(), args));
  if (args.n_elems == 0) return Status::ok();
  constexpr unsigned kThreads = 256;
  const uint64_t blocks = std::min<uint64_t>((args.n_elems + kThreads - 1) / kThreads, 65535);
  dequantize_4bit_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, static_cast<cudaStream_t>(native)>>>(
      bnb4::code_tables(), static_cast<const uint8_t*>(args.blob.addr), args.out.addr, args.out_dtype, args.n_elems);
  ZO_CUDA_RETURN_IF_ERROR(cudaGetLastError(), "launching the dequantize_4bit kernel");
  return Status::ok();
}

}  // namespace zo::gpu::detail

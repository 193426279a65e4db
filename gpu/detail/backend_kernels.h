// Each backend's table of optimizer kernels, which optim_kernels() picks by the device's kind, and
// its 4-bit dequantization.
// Constant tables; thread-safe. Internal to gpu/.
#pragma once

#include "gpu/detail/accounting.h"
#include "gpu/optim_kernels.h"
#include "gpu/quant_kernels.h"

namespace zo::gpu::detail {

extern const OptimKernels kHostOptimKernels;  // gpu/host_optim_kernels.cpp
// gpu/cuda/cuda_optim_kernels.cu; in a build without CUDA, whose devices are never CUDA ones,
// gpu/cuda/cuda_device_stub.cpp's kernels return kUnavailable.
extern const OptimKernels kCudaOptimKernels;

// dequantize_packed (gpu/quant_kernels.h): its argument checks, which both backends run, and
// CudaDevice's kernel (gpu/cuda/cuda_quant_kernels.cu; kUnavailable from the stub without CUDA).
Status check_dequantize_packed_args(const Accounting& acct, const DequantizePackedArgs& args);
Status cuda_dequantize_packed(Device& device, const DequantizePackedArgs& args, Stream stream);

}  // namespace zo::gpu::detail

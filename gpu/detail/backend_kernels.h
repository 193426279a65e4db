// Each backend's table of optimizer kernels, which optim_kernels() picks by the device's kind.
// Constant tables; thread-safe. Internal to gpu/.
#pragma once

#include "gpu/optim_kernels.h"

namespace zo::gpu::detail {

extern const OptimKernels kHostOptimKernels;  // gpu/host_optim_kernels.cpp
// gpu/cuda/cuda_optim_kernels.cu; in a build without CUDA, whose devices are never CUDA ones,
// gpu/cuda/cuda_device_stub.cpp's kernels return kUnavailable.
extern const OptimKernels kCudaOptimKernels;

}  // namespace zo::gpu::detail

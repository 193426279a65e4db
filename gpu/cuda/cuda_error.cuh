// CUDA runtime errors as Status values (cuda_error, ZO_CUDA_RETURN_IF_ERROR) and as aborts
// (ZO_CUDA_CHECK), for the .cu files of gpu/cuda/. A CUDA header: include from .cu files only.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "common/check.h"
#include "common/status.h"

namespace zo::gpu::detail {

// kOutOfMemory for cudaErrorMemoryAllocation, kInternal otherwise; "<what>: <name> (<text>)".
inline Status cuda_error(cudaError_t err, const std::string& what) {
  std::string msg = what + ": " + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")";
  if (err == cudaErrorMemoryAllocation) return out_of_memory(std::move(msg));
  return internal_error(std::move(msg));
}

}  // namespace zo::gpu::detail

#define ZO_CUDA_RETURN_IF_ERROR(call, what)                                          \
  do {                                                                               \
    const cudaError_t zo_err_ = (call);                                              \
    if (zo_err_ != cudaSuccess) return ::zo::gpu::detail::cuda_error(zo_err_, what); \
  } while (0)

#define ZO_CUDA_CHECK(call)                                                                \
  do {                                                                                     \
    const cudaError_t zo_err_ = (call);                                                    \
    ZO_CHECK(zo_err_ == cudaSuccess) << #call << ": " << cudaGetErrorName(zo_err_) << " (" \
                                     << cudaGetErrorString(zo_err_) << ")";                \
  } while (0)

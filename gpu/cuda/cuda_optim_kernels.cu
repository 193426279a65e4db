// CudaDevice's optimizer kernels (OptimKernels): one CUDA thread per element through the element
// bodies HostDevice's loops run (gpu/detail/adam_element.h), queued on the device's own streams.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "common/adam_math.h"
#include "common/dynamic_maps.h"
#include "gpu/cuda/cuda_device.h"
#include "gpu/cuda/cuda_error.cuh"
#include "gpu/detail/adam_args.h"
#include "gpu/detail/adam_element.h"
#include "gpu/detail/backend_kernels.h"

namespace zo::gpu::detail {
namespace {

// One thread per element (grid-stride) through the same adam_element / zo::adam_update HostDevice
// runs. Bit-identical to the CPU because adam_update spells every operation as a correctly rounded
// _rn intrinsic and gpu/meson.build builds the .cu files with -fmad=false -prec-div=true
// -prec-sqrt=true -ftz=false (see docs/gpu.md, "Adam on the device").
__global__ void adam_kernel(AdamConstants k, AdamElementArgs a, uint64_t n) {
  const uint64_t stride = uint64_t{gridDim.x} * blockDim.x;
  for (uint64_t i = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n; i += stride) { adam_element(k, a, i); }
}

// The two dynamic maps, passed by value (2 KiB of kernel parameters) and copied to shared memory.
struct DynamicMaps {
  float m[256];  // signed
  float v[256];  // unsigned
};

// One thread block of kQuantBlockElems threads per quantization block (grid-stride over blocks):
// each thread updates one element through adam8bit_element, the block's absmax is a shared-memory
// max over absmax_term (exact in any order), and each thread re-quantizes its own moments. The
// arithmetic is HostDevice's and cpu_optim's, operation for operation (Note [Bit-exact device Adam]),
// so the bytes are theirs but for NaN payloads: a NaN computed here is the canonical 0x7FFFFFFF, on
// x86 0xFFC00000. Blocks whose exp_avg_sq overflowed to inf make them (entry 0 × inf at the next
// dequantization); tests/gpu/device_nan_test.cpp emulates this kernel with them on the CPU.
__global__ void adam8bit_kernel(Adam8bitConstants k, Adam8bitElementArgs a, DynamicMaps maps, uint64_t n) {
  constexpr unsigned kBlock = static_cast<unsigned>(kQuantBlockElems);
  __shared__ float m_map[256], v_map[256], m_red[kBlock], v_red[kBlock];
  m_map[threadIdx.x] = maps.m[threadIdx.x];
  v_map[threadIdx.x] = maps.v[threadIdx.x];
  __syncthreads();
  const uint64_t n_blocks = (n + kBlock - 1) / kBlock;
  for (uint64_t b = blockIdx.x; b < n_blocks; b += gridDim.x) {
    const uint64_t i = b * kBlock + threadIdx.x;
    float m = 0.0f, v = 0.0f;
    if (i < n) adam8bit_element(k, a, m_map, v_map, i, m, v);
    m_red[threadIdx.x] = absmax_term(m);
    v_red[threadIdx.x] = absmax_term(v);
    __syncthreads();
    for (unsigned half = kBlock / 2; half > 0; half /= 2) {
      if (threadIdx.x < half) {
        m_red[threadIdx.x] = fmaxf(m_red[threadIdx.x], m_red[threadIdx.x + half]);
        v_red[threadIdx.x] = fmaxf(v_red[threadIdx.x], v_red[threadIdx.x + half]);
      }
      __syncthreads();
    }
    const float m_amax = m_red[0], v_amax = v_red[0];
    if (i < n) {
      a.m_codes[i] = requantize(m_map, m, m_amax);
      a.v_codes[i] = requantize(v_map, v, v_amax);
    }
    if (threadIdx.x == 0) {
      a.m_absmax[b] = m_amax;
      a.v_absmax[b] = v_amax;
    }
    __syncthreads();  // m_red[0] is read by every thread before the next block overwrites it
  }
}

CudaDevice& cuda(Device& device) {
  ZO_CHECK(device.kind() == DeviceKind::kCuda) << "CudaDevice's kernels on " << device.name();
  return static_cast<CudaDevice&>(device);
}

Status adam_step(Device& device, const DeviceAdamArgs& args, Stream stream) {
  CudaDevice& dev = cuda(device);
  ZO_ASSIGN_OR_RETURN(void* native, dev.kernel_stream(stream));
  ZO_RETURN_IF_ERROR(check_adam_args(dev.accounting(), args));
  if (args.n_elems == 0) return Status::ok();
  const auto st = static_cast<cudaStream_t>(native);
  const AdamConstants k = adam_constants(args.config, args.step, args.grad_scale);
  constexpr unsigned kThreads = 256;
  const uint64_t blocks = std::min<uint64_t>((args.n_elems + kThreads - 1) / kThreads, 65535);
  adam_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, st>>>(k, element_args(args), args.n_elems);
  ZO_CUDA_RETURN_IF_ERROR(cudaGetLastError(), "launching the adam kernel");
  return Status::ok();
}

Status adam8bit_step(Device& device, const DeviceAdam8bitArgs& args, Stream stream) {
  CudaDevice& dev = cuda(device);
  ZO_ASSIGN_OR_RETURN(void* native, dev.kernel_stream(stream));
  ZO_RETURN_IF_ERROR(check_adam8bit_args(dev.accounting(), args));
  if (args.n_elems == 0) return Status::ok();
  const auto st = static_cast<cudaStream_t>(native);
  const Adam8bitConstants k = adam8bit_constants(args.config, args.step, args.grad_scale);
  DynamicMaps maps;
  std::copy(kSignedDynamicMap.begin(), kSignedDynamicMap.end(), maps.m);
  std::copy(kUnsignedDynamicMap.begin(), kUnsignedDynamicMap.end(), maps.v);
  constexpr unsigned kThreads = static_cast<unsigned>(kQuantBlockElems);
  const uint64_t blocks = std::min<uint64_t>((args.n_elems + kThreads - 1) / kThreads, 65535);
  adam8bit_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, st>>>(k, element_args(args), maps, args.n_elems);
  ZO_CUDA_RETURN_IF_ERROR(cudaGetLastError(), "launching the adam8bit kernel");
  return Status::ok();
}

}  // namespace

const OptimKernels kCudaOptimKernels{.adam_step = &adam_step, .adam8bit_step = &adam8bit_step};

}  // namespace zo::gpu::detail

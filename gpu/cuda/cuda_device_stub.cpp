// Built instead of cuda_device.cu when meson decides there is no CUDA (gpu/meson.build).
#include "gpu/cuda/cuda_device.h"

namespace zo::gpu {

Result<std::unique_ptr<Device>> CudaDevice::create(int device_index, uint64_t budget_bytes) {
  (void)device_index;
  (void)budget_bytes;
  return unavailable(
      "CudaDevice: zoffload was built without CUDA (meson -Dcuda=enabled needs nvcc and the CUDA toolkit)");
}

}  // namespace zo::gpu

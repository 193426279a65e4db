#include "gpu/optim_kernels.h"

#include "common/check.h"
#include "gpu/detail/backend_kernels.h"

namespace zo::gpu {

const OptimKernels& optim_kernels(const Device& device) {
  switch (device.kind()) {
    case DeviceKind::kHost: return detail::kHostOptimKernels;
    case DeviceKind::kCuda: return detail::kCudaOptimKernels;
    case DeviceKind::kAuto: break;
  }
  ZO_CHECK(false) << "optim_kernels: a device of kind " << device_kind_name(device.kind());
  return detail::kHostOptimKernels;
}

}  // namespace zo::gpu

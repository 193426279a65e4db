#include "gpu/test_hooks.h"

#include "common/check.h"
#include "gpu/cuda/cuda_device.h"
#include "gpu/host_device.h"

namespace zo::gpu {

Status test_delay(Device& device, Stream stream, uint32_t duration_us) {
  switch (device.kind()) {
    case DeviceKind::kHost: return static_cast<HostDevice&>(device).delay(stream, duration_us);
    case DeviceKind::kCuda: return static_cast<CudaDevice&>(device).delay(stream, duration_us);
    case DeviceKind::kAuto: break;
  }
  ZO_CHECK(false) << "test_delay: a device of kind " << device_kind_name(device.kind());
  return Status::ok();
}

}  // namespace zo::gpu

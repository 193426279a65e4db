#include "gpu/foreign_streams.h"

#include "common/check.h"
#include "gpu/cuda/cuda_device.h"
#include "gpu/host_device.h"

namespace zo::gpu {
namespace {

// Calls `fn` with the backend behind `device`, found by its kind.
template <class Fn>
Status with_backend(Device& device, const char* what, Fn&& fn) {
  switch (device.kind()) {
    case DeviceKind::kHost: return fn(static_cast<HostDevice&>(device));
    case DeviceKind::kCuda: return fn(static_cast<CudaDevice&>(device));
    case DeviceKind::kAuto: break;
  }
  ZO_CHECK(false) << what << ": a device of kind " << device_kind_name(device.kind());
  return Status::ok();
}

}  // namespace

Status record_foreign(Device& device, Event event, void* native_stream) {
  return with_backend(device, "record_foreign",
                      [&](auto& backend) { return backend.record_foreign(event, native_stream); });
}

Status wait_foreign(Device& device, void* native_stream, Event event) {
  return with_backend(device, "wait_foreign",
                      [&](auto& backend) { return backend.wait_foreign(native_stream, event); });
}

Status foreign_work(Device& device, DeviceWork kind, uint64_t size_bytes, void* native_stream, const std::string& name,
                    const std::function<Status()>& queue) {
  return with_backend(device, "foreign_work", [&](auto& backend) {
    return backend.foreign_work(kind, size_bytes, native_stream, name, queue);
  });
}

}  // namespace zo::gpu

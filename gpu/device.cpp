#include "gpu/device.h"

#include "common/bytes.h"
#include "common/log.h"
#include "gpu/cuda/cuda_device.h"
#include "gpu/device_info.h"
#include "gpu/host_device.h"

namespace zo::gpu {

std::string_view device_kind_name(DeviceKind kind) {
  switch (kind) {
    case DeviceKind::kAuto: return "auto";
    case DeviceKind::kCuda: return "cuda";
    case DeviceKind::kHost: return "host";
  }
  return "?";
}

Result<DeviceKind> parse_device_kind(std::string_view text) {
  for (DeviceKind k : {DeviceKind::kAuto, DeviceKind::kCuda, DeviceKind::kHost}) {
    if (text == device_kind_name(k)) return k;
  }
  return invalid_argument("unknown device kind \"" + std::string(text) + "\" (expected auto, cuda or host)");
}

Result<DeviceChoice> choose_device(DeviceKind kind, const GpuProbe& probe) {
  if (kind == DeviceKind::kHost) return DeviceChoice{DeviceKind::kHost, false, "device: host (emulated GPU)"};
  if (!probe.gpus.empty())
    return DeviceChoice{
        DeviceKind::kCuda, false,
        "device: " + probe.gpus.front().name + ", " + std::to_string(probe.gpus.size()) + " GPU(s) visible"};
  if (kind == DeviceKind::kCuda) return unavailable("device cuda requested but no GPU is usable: " + probe.reason);
  if (probe.gpu_present)
    return DeviceChoice{DeviceKind::kHost, true,
                        "device auto: an NVIDIA GPU is present but unusable (" + probe.reason +
                            "); training runs on the CPU with an emulated device, far slower. Fix the cause, or set "
                            "zoffload.device to \"host\" to choose this"};
  // No GPU at all: the runtime's reason ("driver version is insufficient" when there is no driver)
  // reads like a version problem, so the finding comes first.
  return DeviceChoice{DeviceKind::kHost, false,
                      "device: host (emulated GPU): no NVIDIA GPU on this machine (CUDA: " + probe.reason + ")"};
}

Result<std::unique_ptr<Device>> make_device(DeviceKind kind, uint64_t budget_bytes) {
  if (kind == DeviceKind::kHost) return make_device(kind, budget_bytes, GpuProbe{});
  return make_device(kind, budget_bytes, probe_gpus());
}

Result<std::unique_ptr<Device>> make_device(DeviceKind kind, uint64_t budget_bytes, const GpuProbe& probe) {
  if (budget_bytes == 0) return invalid_argument("make_device: the device memory budget must be > 0 bytes");
  ZO_ASSIGN_OR_RETURN(DeviceChoice choice, choose_device(kind, probe));
  if (choice.kind == DeviceKind::kHost) {
    if (kind != DeviceKind::kHost) {
      if (choice.warn) ZO_LOG(kWarn) << choice.message;
      else ZO_LOG(kInfo) << choice.message << " (budget " << format_bytes(budget_bytes) << ")";
    }
    ZO_ASSIGN_OR_RETURN(auto host, HostDevice::create(budget_bytes));
    return std::unique_ptr<Device>(std::move(host));
  }
  Result<std::unique_ptr<Device>> cuda = CudaDevice::create(probe.gpus.front().index, budget_bytes);
  if (!cuda.is_ok()) {
    // A listed GPU that cannot be opened is an error even for auto: falling back would hide it.
    Status status = cuda.status();
    return status.with_context("device " + std::string(device_kind_name(kind)));
  }
  if (kind == DeviceKind::kAuto) ZO_LOG(kInfo) << choice.message << " (budget " << format_bytes(budget_bytes) << ")";
  return cuda;
}

}  // namespace zo::gpu

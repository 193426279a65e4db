#include "gpu/device_info.h"

#include <cctype>
#include <filesystem>
#include <system_error>

#include "zo_build_config.h"

#if ZO_HAVE_CUDA
#include "gpu/cuda/cuda_probe.h"
#endif

namespace zo::gpu {

bool nvidia_gpu_present(const std::string& root) {
  namespace fs = std::filesystem;
  std::error_code ec;
  for (fs::directory_iterator it(root + "/proc/driver/nvidia/gpus", ec), end; !ec && it != end; it.increment(ec))
    return true;
  ec.clear();
  for (fs::directory_iterator it(root + "/dev", ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    // nvidia0, nvidia1, ...; not nvidiactl, nvidia-uvm or nvidia-caps.
    if (name.size() > 6 && name.compare(0, 6, "nvidia") == 0 && std::isdigit(static_cast<unsigned char>(name[6])))
      return true;
  }
  return false;
}

GpuProbe probe_gpus() {
#if ZO_HAVE_CUDA
  GpuProbe probe = cuda::probe();
#else
  GpuProbe probe;
  probe.reason = "zoffload was built without CUDA (meson -Dcuda=enabled needs nvcc and the CUDA toolkit)";
#endif
  probe.gpu_present = !probe.gpus.empty() || nvidia_gpu_present();
  return probe;
}

}  // namespace zo::gpu

// Discovery of the GPUs this process can use, for `zoffload info`, planning and clear errors.
// Thread-safe; calls into the CUDA runtime when built with CUDA (ZO_HAVE_CUDA), nothing otherwise.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace zo::gpu {

struct GpuInfo {
  int index = 0;
  std::string name;
  uint64_t total_bytes = 0;
  uint64_t free_bytes = 0;
  int compute_major = 0;
  int compute_minor = 0;
};

struct GpuProbe {
  bool built_with_cuda = false;
  bool gpu_present = false;   // the kernel shows an NVIDIA GPU (nvidia_gpu_present), usable or not
  std::vector<GpuInfo> gpus;  // empty when none is usable
  std::string reason;         // why `gpus` is empty ("built without CUDA", the CUDA runtime's error)
};

// Lists the CUDA devices visible to this process (honours CUDA_VISIBLE_DEVICES), and whether the
// kernel shows an NVIDIA GPU at all, so that "no GPU" and "a GPU we cannot use" read differently.
GpuProbe probe_gpus();

// Whether the NVIDIA driver shows a GPU under `root` ("" = /; tests pass a fake tree): an entry in
// root/proc/driver/nvidia/gpus/ or a device file root/dev/nvidia<N>. Makes no CUDA call, so it
// answers even when the CUDA runtime cannot start (driver too old, runtime mismatch).
bool nvidia_gpu_present(const std::string& root = "");

}  // namespace zo::gpu

// What the LibTorch zoffload is linked with can do: its version, whether its CUDA backend is
// linked, the CUDA version it was built with and the GPUs it sees (`zoffload info`, the trainer's
// device checks). Thread-safe. This header includes no LibTorch header; torch_runtime.cpp does.
#pragma once

#include <string>

namespace zo::engine {

struct LibTorchInfo {
  std::string version;       // TORCH_VERSION, e.g. "2.11.0"
  bool cuda_linked = false;  // libtorch_cuda is loaded and registered LibTorch's CUDA backend
  std::string cuda_version;  // the CUDA LibTorch was built with, "13.0"; empty when !cuda_linked
  int cuda_devices = 0;      // GPUs LibTorch can use: 0 without a GPU, a driver or cuda_linked
};

LibTorchInfo libtorch_info();

}  // namespace zo::engine

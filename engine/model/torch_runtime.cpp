#include "engine/model/torch_runtime.h"

// The few LibTorch headers this needs, not torch/torch.h: this file compiles in seconds.
#include <ATen/detail/CUDAHooksInterface.h>
#include <torch/version.h>

namespace zo::engine {

LibTorchInfo libtorch_info() {
  LibTorchInfo info;
  info.version = TORCH_VERSION;
  // The CUDA hooks are registered by libtorch_cuda's static initialisers: when the library is not
  // loaded (Note [Linking CUDA LibTorch] in meson.build) the default hooks answer isBuilt() false.
  const at::CUDAHooksInterface& hooks = at::detail::getCUDAHooks();
  info.cuda_linked = hooks.isBuilt();
  if (info.cuda_linked) {
    const long v = hooks.versionCUDART();  // CUDART_VERSION: 1000 * major + 10 * minor
    info.cuda_version = std::to_string(v / 1000) + "." + std::to_string((v % 1000) / 10);
    info.cuda_devices = static_cast<int>(hooks.deviceCount());
  }
  return info;
}

}  // namespace zo::engine

// The torch baseline of `zoffload-bench pcie`, defined in bench_pcie_torch.cpp (built only with
// LibTorch; this header includes none): the copies a PyTorch user makes, between tensors torch
// allocated itself. Not thread-safe.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>

#include "common/status.h"

namespace zo::tools::detail {

// Host and device tensors of `size_bytes` allocated by torch: the host one pinned
// (`Tensor::pin_memory()`, torch's caching host allocator) or pageable (`torch::empty`), the device
// one on cuda:0 when `cuda`, else on the CPU (the emulated device). Filled with a byte pattern.
class TorchCopies {
 public:
  static Result<std::unique_ptr<TorchCopies>> create(uint64_t size_bytes, bool pinned, bool cuda);
  virtual ~TorchCopies() = default;
  // `copies` copies of the buffers' first `bytes` (≤ size_bytes) host→device (h2d) or device→host,
  // each `copy_(src, non_blocking=true)` on torch's current stream, then a wait for them all (the
  // device's synchronize when cuda).
  virtual Status run(bool h2d, uint64_t bytes, int copies) = 0;
  // After one copy each way of the first `bytes` (≤ size_bytes) through a poisoned device buffer,
  // the host buffer holds its pattern.
  virtual Status check(uint64_t bytes) = 0;
};

}  // namespace zo::tools::detail

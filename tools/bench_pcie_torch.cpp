// The torch baseline of `zoffload-bench pcie`; built only when LibTorch is found. What a PyTorch user
// would run instead: `dst.copy_(src, non_blocking=True)` between a host tensor (pinned by torch's
// caching host allocator, or pageable) and a cuda tensor, then torch.cuda.synchronize().
#include "tools/bench_pcie_torch.h"

// LibTorch's headers are not clean under -Wextra; silence them here, not project-wide.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-parameter"
#include <torch/cuda.h>
#include <torch/types.h>
#pragma GCC diagnostic pop

#include <cstdint>
#include <exception>
#include <memory>
#include <string>
#include <utility>

#include "common/status.h"

namespace zo::tools::detail {

namespace {

Status torch_failure(const char* what, const std::exception& e) {
  const auto* c10 = dynamic_cast<const c10::Error*>(&e);
  return internal_error(std::string(what) + ": " + (c10 ? c10->what_without_backtrace() : e.what()));
}

class TorchCopiesImpl final : public TorchCopies {
 public:
  TorchCopiesImpl(torch::Tensor host, torch::Tensor dev, bool cuda)
      : host_(std::move(host)), dev_(std::move(dev)), cuda_(cuda) {}

  Status run(bool h2d, uint64_t bytes, int copies) override {
    try {
      const auto n = static_cast<int64_t>(bytes);
      torch::Tensor host = host_.narrow(0, 0, n), dev = dev_.narrow(0, 0, n);
      for (int i = 0; i < copies; ++i) {
        if (h2d) {
          dev.copy_(host, /*non_blocking=*/true);
        } else {
          host.copy_(dev, /*non_blocking=*/true);
        }
      }
      if (cuda_) torch::cuda::synchronize();
    } catch (const std::exception& e) {
      return torch_failure(h2d ? "torch copy_ host to device" : "torch copy_ device to host", e);
    }
    return Status::ok();
  }

  Status check(uint64_t bytes) override {
    try {
      const auto n = static_cast<int64_t>(bytes);
      torch::Tensor host = host_.narrow(0, 0, n);
      const torch::Tensor pattern = host.clone();
      dev_.narrow(0, 0, n).fill_(0x5A);
      ZO_RETURN_IF_ERROR(run(/*h2d=*/true, bytes, 1));
      host.fill_(0xA5);
      ZO_RETURN_IF_ERROR(run(/*h2d=*/false, bytes, 1));
      if (!torch::equal(host, pattern))
        return internal_error("torch's round trip host -> device -> host changed bytes");
    } catch (const std::exception& e) { return torch_failure("torch round-trip check", e); }
    return Status::ok();
  }

 private:
  torch::Tensor host_, dev_;
  bool cuda_;
};

}  // namespace

Result<std::unique_ptr<TorchCopies>> TorchCopies::create(uint64_t size_bytes, bool pinned, bool cuda) {
  try {
    const auto n = static_cast<int64_t>(size_bytes);
    torch::Tensor host = torch::empty({n}, torch::TensorOptions().dtype(torch::kUInt8).pinned_memory(pinned && cuda));
    auto* bytes = host.data_ptr<uint8_t>();
    for (int64_t i = 0; i < n; ++i) bytes[i] = static_cast<uint8_t>((i * 131) % 251);
    torch::Tensor dev =
        torch::empty({n}, torch::TensorOptions()
                              .dtype(torch::kUInt8)
                              .device(cuda ? torch::Device(torch::kCUDA, 0) : torch::Device(torch::kCPU)));
    return std::unique_ptr<TorchCopies>(new TorchCopiesImpl(std::move(host), std::move(dev), cuda));
  } catch (const std::exception& e) { return torch_failure("torch buffers for the baseline", e); }
}

}  // namespace zo::tools::detail

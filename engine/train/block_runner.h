// BlockRunner: LibTorch and the device around each block — acquiring a block's compute copies for
// LibTorch's stream, running its forward or backward as the device's compute, ordering LibTorch's
// copy stream after it, releasing the block behind its kernels. Owns the two device events this
// takes and the RoPE tables. Private to engine/train; includes LibTorch. The training thread only.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "engine/model/decoder.h"
#include "engine/model/torch_runtime.h"
#include "engine/train/micro_batch.h"
#include "engine/train/run_setup.h"

namespace zo::engine {

class BlockRunner {
 public:
  // `setup` (its device, coordinator and model) outlives the runner.
  static Result<std::unique_ptr<BlockRunner>> create(const RunSetup& setup);
  ~BlockRunner();
  BlockRunner(const BlockRunner&) = delete;
  BlockRunner& operator=(const BlockRunner&) = delete;

  // The RoPE tables for the run's sequence length, on the device (once, before the first block).
  Status build_rope();
  torch::Device torch_device() const { return torch_device_; }
  bool cuda() const { return torch_device_.is_cuda(); }

  // LibTorch's current stream, where the blocks compute (nullptr on the CPU).
  Result<void*> compute_stream();
  // A block's forward or backward, as a span of the compute track and the device's busy time.
  Status compute_call(const std::string& what, const std::function<void()>& fn);
  // Makes LibTorch's copy stream current in *copies, ordered after the kernels queued so far on the
  // compute stream (an event recorded there and waited for by the copy stream at once).
  Status begin_copies(std::optional<TorchCopyStreamScope>* copies, const std::string& where);
  // Block b's addresses for LibTorch's stream, which waits on the device for their copies.
  Result<std::vector<gpu::DevicePtr>> acquire(uint32_t block);
  // Releases a block with an event after every kernel LibTorch has queued that reads it: on CUDA
  // LibTorch queues its kernels asynchronously, and the coordinator refills the freed arena space
  // only behind that event (no host sync).
  Status release(uint32_t block);
  // The block's compute copies as tensors; leaves that collect gradients when `grad`.
  std::vector<torch::Tensor> wrap(uint32_t block, const std::vector<gpu::DevicePtr>& ptrs, bool grad) const;
  // Block b's forward of `x` with `params` (wrap's); inside compute_call.
  torch::Tensor forward(uint32_t block, const std::vector<torch::Tensor>& params, const torch::Tensor& x) const;
  // Host time acquire() spent waiting for copies (HostDevice computes on the host), over the run.
  double ready_wait_s() const { return ready_wait_s_; }

 private:
  BlockRunner(const RunSetup& setup, torch::Device torch_device);

  gpu::Device& device_;
  ParamCoordinator& coord_;
  const RunModel& model_;
  torch::Device torch_device_;
  RopeTables rope_;
  double ready_wait_s_ = 0;
  gpu::Event released_;      // re-recorded by every release()
  gpu::Event copies_after_;  // re-recorded on the compute stream by begin_copies
};

}  // namespace zo::engine

// ActivationStore: the decoder layers' activation checkpoints (each block's input, kept from
// forward to backward) in pinned host memory between forward and backward (Note [Checkpoints on
// the CPU] in activation_store.cpp), when the plan puts them there. Owns the pinned slab and its
// events. Not training checkpoints (run_outputs.h). Private to engine/train; includes LibTorch.
// The training thread only.
#pragma once

#include <cstdint>
#include <memory>

#include "engine/train/block_runner.h"
#include "engine/train/micro_batch.h"
#include "engine/train/run_setup.h"

namespace zo::engine {

class ActivationStore {
 public:
  // The slab and its events, from the plan (RunPlan::checkpoints_on_host); none when the plan keeps
  // the activations on the device. `setup` and `runner` outlive the store.
  static Result<std::unique_ptr<ActivationStore>> create(const RunSetup& setup, BlockRunner& runner);
  // Waits for copies still in flight (a failed step's), then frees the slab.
  ~ActivationStore();
  ActivationStore(const ActivationStore&) = delete;
  ActivationStore& operator=(const ActivationStore&) = delete;

  // Whether block b's inputs wait here between forward and backward (decoder layers only: the
  // embedding's token ids and the head's input stay on the device).
  bool holds(uint32_t block) const { return slab_ != nullptr && block >= 1 && block + 1 < n_blocks_; }
  // Copies block b's inputs (every micro-batch of f) to their slots and drops the device copies.
  Status move_out(uint32_t block, Forward& f);
  // Queues block b's inputs back to the device; wait_back makes LibTorch's stream wait for them.
  Status move_back(uint32_t block, Forward& f);
  Status wait_back(uint32_t block);

 private:
  ActivationStore(const RunSetup& setup, BlockRunner& runner);
  // The host slot of block b's input (1 ≤ b ≤ num_hidden_layers) of held micro-batch k.
  torch::Tensor slot(uint32_t block, size_t k, const torch::Tensor& like) const;

  gpu::Device& device_;
  MemoryAccounting& accounting_;
  BlockRunner& runner_;
  const RunModel& model_;
  uint32_t n_blocks_;
  void* slab_ = nullptr;     // pinned; one slot per held micro-batch and decoder layer
  uint64_t slab_bytes_ = 0;  // RunPlan::checkpoint_host_bytes
  uint64_t slot_bytes_ = 0;  // one micro-batch's input of one layer
  gpu::Event back_[2];       // on the copy stream, behind the copies back of layer b (b % 2)
  gpu::Event copied_;        // on the copy stream, behind the latest copy either way
};

}  // namespace zo::engine

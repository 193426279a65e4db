// GradientPath: the gradients from LibTorch to the accumulators — each block's gradients copied
// off the device into the gradient worker's landing ring (pinned, from the store's pool), added
// into the GradAccumulator on the worker's thread behind the next block's backward (Note [Gradient
// landing ring]). Owns the accumulator, its worker and the copies' event. Private to engine/train;
// includes LibTorch. The training thread calls it; the worker runs on its own.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "engine/coord/grad_accumulator.h"
#include "engine/coord/grad_worker.h"
#include "engine/train/block_runner.h"
#include "engine/train/run_setup.h"

namespace zo::engine {

class GradientPath {
 public:
  // The accumulator (reducing to the owners with partitioned gradients, stepping each final
  // sub-group without accumulators: Note [No accumulator]), the ring and the worker. `setup` and
  // `runner` outlive the path.
  static Result<std::unique_ptr<GradientPath>> create(const RunSetup& setup, BlockRunner& runner);
  // Waits for copies still in flight (a failed step's) before the worker stops.
  ~GradientPath();
  GradientPath(const GradientPath&) = delete;
  GradientPath& operator=(const GradientPath&) = delete;

  // A micro-step's window (GradAccumulator::begin_micro_step).
  Status begin_micro_step(bool first, bool last) { return grads_->begin_micro_step(first, last); }
  // Hands a block's gradients (one per trainable param, in block order) to the accumulator, the
  // first element of the first one replaced by +inf when `inject_overflow` (TrainOptions::
  // inject_overflow_steps).
  Status offload(uint32_t block, const std::vector<torch::Tensor>& grads, bool inject_overflow);
  // Waits until the worker has added every gradient handed to it; its first error since the last.
  Status drain() { return worker_->drain(); }
  // Closes the micro-step once drained: the boundary's norm report at the last one.
  Result<GradNormReport> end_micro_step() { return grads_->end_micro_step(); }
  // Closes a failed micro-step's window (the worker drained first), so that the next can start.
  void abandon_micro_step();
  // The sub-groups in the order their gradients become final (OptimizerSwapper::begin_direct).
  const std::vector<uint32_t>& completion_order() const { return grads_->completion_order(); }

 private:
  GradientPath(const RunSetup& setup, BlockRunner& runner);

  const RunSetup& setup_;
  BlockRunner& runner_;
  std::unique_ptr<GradAccumulator> grads_;
  std::unique_ptr<GradWorker> worker_;  // feeds grads_ behind backward; destroyed before it
  gpu::Event landed_;                   // re-recorded behind every gradient copy, waited on by the worker
};

}  // namespace zo::engine

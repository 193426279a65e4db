// Evaluator: the held-out data (TrainOptions::eval_data_path) evaluated after a step's update, all
// ranks together (Note [Evaluation] in evaluator.cpp). Owns the held-out dataset; borrows the
// setup's coordinator and the block runner. Private to engine/train; includes LibTorch. The
// training thread only.
#pragma once

#include <array>
#include <cstdint>
#include <memory>

#include "engine/data/dataset.h"
#include "engine/train/block_runner.h"
#include "engine/train/run_setup.h"
#include "engine/train/step_metrics.h"

namespace zo::engine {

class Evaluator {
 public:
  // The held-out data with the training data's options (`train`) but file order, its rows checked
  // against the vocabulary; errors name --eval-data. `setup` and `runner` outlive the evaluator.
  static Result<std::unique_ptr<Evaluator>> open(const RunSetup& setup, BlockRunner& runner, const DataOptions& train);

  // Whether the held-out data is evaluated after step `step`.
  bool due(uint64_t step) const {
    const TrainOptions& opt = setup_.options();
    return (opt.eval_every > 0 && step % opt.eval_every == 0) || step == opt.last_step;
  }
  // One evaluation (collective: every rank calls it, and learns whether any failed).
  Result<EvalMetrics> evaluate();

 private:
  Evaluator(const RunSetup& setup, BlockRunner& runner) : setup_(setup), runner_(runner) {}
  // This rank's part: the loss over its counted batches, those batches, their labelled targets.
  Result<std::array<double, 3>> evaluate_here();

  const RunSetup& setup_;
  BlockRunner& runner_;
  std::unique_ptr<Dataset> data_;
  uint64_t batches_per_rank_ = 0;
};

}  // namespace zo::engine

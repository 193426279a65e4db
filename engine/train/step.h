// StepLoop: the run's optimizer steps — the micro-steps forward and backward with their gradients
// sent down the gradient path, the accumulation boundary (the sums over the ranks, the norm, the
// loss scale, clipping) and the optimizer on its own thread beside the next step's first forward
// (Note [Overlapped optimizer]). Owns the training data, the loss scaler, the lr schedule, the step
// counters and the optimizer thread; borrows the setup's objects, the block runner, the activation
// store and the gradient path. Private to engine/train; includes LibTorch. The training thread
// drives it.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "engine/ckpt/checkpoint.h"
#include "engine/data/dataset.h"
#include "engine/optim/loss_scaler.h"
#include "engine/optim/lr_schedule.h"
#include "engine/train/activation_store.h"
#include "engine/train/block_runner.h"
#include "engine/train/gradient_path.h"
#include "engine/train/micro_batch.h"
#include "engine/train/run_setup.h"
#include "engine/train/step_metrics.h"

namespace zo::engine {

class StepLoop {
 public:
  // The loss scaler and lr schedule from the config, then the training data with `seed` (the run's,
  // or a resumed run's from its checkpoint). The borrowed parts outlive the loop.
  static Result<std::unique_ptr<StepLoop>> create(const RunSetup& setup, BlockRunner& runner,
                                                  ActivationStore& activations, GradientPath& gradients, uint64_t seed);
  // Joins an optimizer step still in flight.
  ~StepLoop();
  StepLoop(const StepLoop&) = delete;
  StepLoop& operator=(const StepLoop&) = delete;

  // Trainer::step without the step number in its errors and without the evaluation and the record,
  // which the trainer adds. `evaluated_after`: the held-out data is evaluated after this step, so
  // the next step's first forward does not run ahead (Note [Evaluation] in evaluator.cpp).
  Result<StepMetrics> step(bool evaluated_after);

  uint64_t steps_done() const { return steps_done_; }  // optimizer steps attempted (skipped ones too)
  const DataOptions& data_options() const { return data_->options(); }
  // The loop's part of a checkpoint's TrainingState: counters, loss scale, data position, seed,
  // sequence length.
  void fill_state(TrainingState* state) const;
  // A resumed run's: its checkpoint's counters, loss scale and data position; errors in `context`.
  Status restore(const TrainingState& state, const std::string& context);

 private:
  StepLoop(const RunSetup& setup, BlockRunner& runner, ActivationStore& activations, GradientPath& gradients);

  // ---- One micro-step: forward, backward, gradients ----
  struct MicroResult {
    double loss = 0;
    double grad_offload_s = 0;  // gradients off the device and into the accumulators
    GradNormReport grads;
  };
  // Moves the gradients the last backward left in `params` into `sums` (the first micro-batch's are
  // copied, in grad_accum_dtype; later ones added), leaving the params without gradients.
  void fold_grads(std::vector<torch::Tensor>& params, std::vector<torch::Tensor>& sums, bool first) const;
  // Reads the next `count` batches and runs them forward through blocks 0..n-2, block by block
  // (begins the coordinator's micro-step: each block is fetched once for all of them).
  Result<Forward> forward(uint64_t count);
  // The rest: the head's forward and loss, then backward block by block, each block's gradients
  // (summed over f's micro-batches) handed to the gradient path. `loss` is the sum over them.
  Result<MicroResult> finish_micro_step(Forward& f, bool first, bool last, bool inject_overflow);

  // ---- One optimizer step, phase by phase ----
  // The step's micro-batches, forward and backward, their gradients in the accumulators: the loss
  // summed over them and the boundary's norm report; tokens, data_s, grad_offload_s and
  // grad_worker_s into `out`.
  struct Accumulated {
    double loss_sum = 0;
    GradNormReport boundary;
  };
  // `first`, when given, runs once the step's first forward is done, before its backward.
  Result<Accumulated> accumulate(bool inject_overflow, StepMetrics* out,
                                 const std::function<Status(const Forward&)>& first = {});
  // With no accumulators (Note [No accumulator]): the micro-steps as accumulate() runs them, with the
  // optimizer stepping each sub-group from backward as its gradient is final; its report or error
  // in `stepped`, the states' failure before backward's.
  Result<Accumulated> accumulate_and_update(bool inject_overflow, StepMetrics* out,
                                            std::optional<Result<OptimizerStepReport>>* stepped);
  // This step's optimizer arguments: hyperparameters, step, seed, and grad_scale = clip ·
  // token_factor / loss scale.
  OptimizerStepArgs step_args(const StepMetrics& out, double clip) const;
  // Note [Loss normalisation]: zoffload.loss_normalization "tokens"; then backward differentiates
  // each micro-batch's summed token losses / target_slots(), and token_factor = target_slots() / the
  // step's labelled tokens finishes the division at the boundary (1 otherwise).
  bool by_tokens() const { return setup_.config().zoffload.loss_normalization == "tokens"; }
  uint64_t target_slots() const {
    const Config& c = setup_.config();
    return c.gradient_accumulation_steps * setup_.world_size() * c.train_micro_batch_size_per_gpu * model_.seq_len;
  }
  // Data parallel: the loss and token count summed over the ranks, the gradients summed (into their
  // owners, partitioned) and the norm of the sums, the same on every rank.
  Status sum_over_ranks(const StepCounters& before_step, Accumulated* acc, StepMetrics* out);
  // The optimizer step at the boundary: started on update_thread_ beside the next forward (Note
  // [Overlapped optimizer]) or, without zoffload.overlap_optimizer, run here (its time in *join_s).
  // `stepped` receives its outcome.
  Status start_update(const StepMetrics& out, std::optional<Result<OptimizerStepReport>>* stepped, double* join_s);
  // Joins the update; its report into `out`, or its error (the run ends there).
  Status finish_update(std::optional<Result<OptimizerStepReport>>& stepped, double* join_s, StepMetrics* out);
  // The counters a step's metrics are differences of.
  StepCounters counters() const;

  const RunSetup& setup_;
  const RunModel& model_;
  BlockRunner& runner_;
  ActivationStore& activations_;
  GradientPath& gradients_;
  std::optional<LossScaler> scaler_;
  std::optional<LrSchedule> schedule_;
  std::unique_ptr<Dataset> data_;
  Batch batch_;
  uint64_t steps_done_ = 0;       // optimizer steps attempted (skipped ones too)
  uint64_t optimizer_steps_ = 0;  // optimizer steps taken (Adam's step count, the lr index)
  double token_factor_ = 1.0;     // this step's
  // Note [Overlapped optimizer]: the next step's first forward, run by step() while its optimizer
  // ran, or that forward's failure (returned by the next step()).
  std::optional<Forward> ahead_;
  Status ahead_error_;
  std::thread update_thread_;  // the optimizer step in flight, joined before step() returns
};

}  // namespace zo::engine

// The held-out data's evaluation (evaluator.h).
#include "engine/train/evaluator.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <vector>

#include "common/log.h"
#include "common/timer.h"
#include "common/trace.h"
#include "engine/train/micro_batch.h"

namespace zo::engine {

// Note [Evaluation]
// With --eval-data the held-out file is evaluated after every eval_every-th step and after the
// run's last step, once that step's update is complete (the step does not run the next forward
// ahead then, so the evaluation sees the updated weights, as transformers' Trainer evaluates after
// its optimizer step). Each evaluation reads the same batches: the first eval_batches micro-batches
// of the file in file order (fewer when the file has fewer; rounded down to a multiple of the
// ranks, each rank taking every world_size-th). They run forward only, without autograd, through
// the same coordinator as training: the schedule begins a micro-step and acquires blocks 0..n−1,
// prefetch included, and the micro-step is left there (the next begin_micro_step treats it as
// abandoned). A pass takes as many micro-batches as a training forward holds (GAS with the vertical
// schedule, else 1), so each block is fetched once per pass and the activations never exceed the
// training forward's; no activation checkpoint is kept. The loss is transformers' eval_loss: the
// mean over the batches of each batch's mean token loss (a batch with no labelled target is left
// out, where transformers would average in its NaN), summed over the ranks; the perplexity is its
// exponential. Nothing the step depends on changes: the training data's position, the RNG (there is
// none) and the weights are untouched, so a run trains bit-identically with and without evaluation;
// its time is reported apart (EvalMetrics::eval_s) and is not in step_s.
// An evaluation never costs the step before it: the rows it reads are fixed, so their tokens and
// labels are checked against the vocabulary when the run starts (Evaluator::open); a failure found
// later (an I/O error, a file changed under the run) is the step's StepMetrics::eval_error, not the
// step's failure, so the step is recorded and `zoffload train` saves it before it stops. Across
// ranks every one learns whether any failed before the losses are summed (first_failed_rank), so
// all of them stop there together and none waits in a collective the others never reach.
Result<std::unique_ptr<Evaluator>> Evaluator::open(const RunSetup& setup, BlockRunner& runner,
                                                   const DataOptions& train) {
  const TrainOptions& opt = setup.options();
  const uint32_t world_size = setup.world_size();
  if (opt.eval_batches == 0) return invalid_argument("--eval-batches must be at least 1");
  if (opt.eval_every == 0 && opt.last_step == 0)
    return invalid_argument("--eval-data " + opt.eval_data_path +
                            " would never be evaluated: it is evaluated every --eval-every steps and after the "
                            "last step, and neither is set");
  std::unique_ptr<Evaluator> evaluator(new Evaluator(setup, runner));
  DataOptions d = train;
  d.path = opt.eval_data_path;
  d.shuffle = false;  // Note [Evaluation]: the same batches every time, in file order
  Result<std::unique_ptr<Dataset>> opened = Dataset::open(d);
  if (!opened.is_ok()) return Status(opened.status()).with_context("--eval-data");
  evaluator->data_ = std::move(*opened);
  const uint64_t batches = std::min(opt.eval_batches, evaluator->data_->batches_per_epoch());
  evaluator->batches_per_rank_ = batches / world_size;
  if (evaluator->batches_per_rank_ == 0)
    return invalid_argument("--eval-batches " + std::to_string(opt.eval_batches) + " gives " +
                            std::to_string(world_size) + " ranks no batch each: ask for at least " +
                            std::to_string(world_size));
  if (batches < opt.eval_batches)
    ZO_LOG(kInfo) << "--eval-data " << opt.eval_data_path << " holds " << batches << " micro-batches of "
                  << train.micro_batch << " x " << train.seq_len << " tokens: each evaluation reads those ("
                  << "--eval-batches asked for " << opt.eval_batches << ")";
  // Note [Evaluation]: every evaluation reads the same rows, the file's first windows (every rank's
  // batches together, in file order), so their tokens and labels are checked now: an id outside the
  // vocabulary found at the first evaluation would stop the run after a step it then could not save.
  const ModelConfig& model = setup.model().config;
  const uint64_t tokens = evaluator->batches_per_rank_ * world_size * train.micro_batch * train.seq_len;
  const TokenSource& source = evaluator->data_->source();
  constexpr uint64_t kChunk = uint64_t{1} << 20;
  std::vector<int32_t> ids, labels;
  for (uint64_t begin = 0; begin <= tokens; begin += kChunk) {
    const uint64_t n = std::min(kChunk, tokens + 1 - begin);  // tokens [0, T·windows] with the last target
    ids.resize(n);
    labels.resize(n);
    ZO_RETURN_IF_ERROR(source.read(begin, n, ids.data(), labels.data()).with_context("--eval-data"));
    for (uint64_t i = 0; i < n; ++i) {
      const uint64_t at = begin + i;
      // Position `at` is an input when it is below `tokens`, and a target from position 1 on.
      const bool bad_input = at < tokens && outside_vocab(model, ids[i], false);
      const bool bad_label = at > 0 && outside_vocab(model, labels[i], true);
      if (bad_input || bad_label)
        return invalid_argument("--eval-data " + opt.eval_data_path + ": " + (bad_input ? "token " : "label ") +
                                std::to_string(bad_input ? ids[i] : labels[i]) + " at token " + std::to_string(at) +
                                " (window " + std::to_string((at - (bad_input ? 0 : 1)) / train.seq_len) +
                                ", read by every evaluation) is outside the model's vocabulary of " +
                                std::to_string(model.vocab_size));
    }
  }
  return evaluator;
}

Result<EvalMetrics> Evaluator::evaluate() {
  dist::ProcessGroup* group = setup_.group();
  const Stopwatch wall;
  Result<std::array<double, 3>> local = evaluate_here();
  if (group != nullptr) {
    ZO_ASSIGN_OR_RETURN(const std::optional<uint32_t> failed,
                        dist::first_failed_rank(*group, !local.is_ok(), "agreeing on the evaluation"));
    if (failed && local.is_ok())
      return Status(StatusCode::kAborted,
                    "rank " + std::to_string(*failed) + " could not evaluate (its error says why)");
  }
  if (!local.is_ok()) return local.status();
  std::array<double, 3> sums = *local;
  if (group != nullptr) {
    trace::Span span(trace::Track::kCollective, "all-reduce the evaluation");
    ZO_RETURN_IF_ERROR(group->all_reduce_sum(sums, "all-reducing the evaluation loss"));
  }
  EvalMetrics out;
  out.batches = batches_per_rank_ * setup_.world_size();
  out.tokens = static_cast<uint64_t>(sums[2]);
  // No batch with a labelled target: no loss (null in metrics.jsonl, left out of the monitors).
  out.loss = sums[1] > 0 ? sums[0] / sums[1] : std::numeric_limits<double>::quiet_NaN();
  out.perplexity = std::exp(out.loss);
  out.eval_s = wall.elapsed_s();
  return out;
}

Result<std::array<double, 3>> Evaluator::evaluate_here() {
  ZO_RETURN_IF_ERROR(data_->set_position({}));
  const RunModel& model = setup_.model();
  const uint32_t n = model.n_blocks();
  const uint64_t per_pass = vertical_micro_batches(setup_.config());
  std::array<double, 3> sums{};  // loss over the counted batches, those batches, labelled targets
  Batch read;
  std::vector<MicroBatch> micro;
  for (uint64_t done = 0; done < batches_per_rank_; done += per_pass) {
    micro.resize(std::min(per_pass, batches_per_rank_ - done));
    for (MicroBatch& mb : micro) {
      ZO_RETURN_IF_ERROR(data_->next_batch(&read));
      ZO_RETURN_IF_ERROR(
          load_micro_batch(read, setup_.options().eval_data_path, model.config, n, runner_.torch_device(), &mb));
      sums[2] += static_cast<double>(mb.tokens);
    }
    setup_.coord().begin_micro_step();
    for (uint32_t b = 0; b < n; ++b) {
      ZO_ASSIGN_OR_RETURN(std::vector<gpu::DevicePtr> ptrs, runner_.acquire(b));
      ZO_RETURN_IF_ERROR(runner_.compute_call("evaluating " + model.layout.blocks[b].name, [&] {
        torch::NoGradGuard no_grad;
        const std::vector<torch::Tensor> params = runner_.wrap(b, ptrs, false);
        for (MicroBatch& mb : micro) {
          torch::Tensor y = runner_.forward(b, params, mb.block_inputs[b]);
          mb.block_inputs[b] = torch::Tensor();
          if (b + 1 < n) {
            mb.block_inputs[b + 1] = std::move(y);
          } else if (mb.tokens > 0) {
            sums[0] += lm_loss(y, mb.targets).item<double>();
            sums[1] += 1;
          }
        }
      }));
      ZO_RETURN_IF_ERROR(runner_.release(b));
    }
  }
  return sums;
}

}  // namespace zo::engine

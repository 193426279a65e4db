// One optimizer step of the trainer (step.h): the micro-steps forward and backward with their
// gradients sent down the gradient path, the accumulation boundary, and the optimizer on its own
// thread beside the next step's first forward.
#include "engine/train/step.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <system_error>
#include <utility>

#include "common/host_info.h"
#include "common/log.h"
#include "common/timer.h"
#include "common/trace.h"
#include "engine/model/torch_runtime.h"
#include "engine/optim/grad_clip.h"

namespace zo::engine {

Result<std::unique_ptr<StepLoop>> StepLoop::create(const RunSetup& setup, BlockRunner& runner,
                                                   ActivationStore& activations, GradientPath& gradients,
                                                   uint64_t seed) {
  std::unique_ptr<StepLoop> loop(new StepLoop(setup, runner, activations, gradients));
  const TrainOptions& opt = setup.options();
  ZO_ASSIGN_OR_RETURN(LossScaler s, LossScaler::for_config(opt.config));
  loop->scaler_.emplace(s);
  ZO_ASSIGN_OR_RETURN(LrSchedule sched, LrSchedule::create(opt.config.scheduler, opt.config.optimizer.lr));
  loop->schedule_.emplace(sched);
  DataOptions d;
  d.path = opt.data_path;
  d.source.format = opt.data_format;
  d.source.env = setup.env();
  d.seq_len = setup.model().seq_len;
  d.micro_batch = opt.config.train_micro_batch_size_per_gpu;
  d.seed = seed;
  d.shuffle = opt.config.zoffload.data.shuffle;
  d.rank = setup.rank();
  d.world_size = setup.world_size();
  ZO_ASSIGN_OR_RETURN(loop->data_, Dataset::open(d));
  return loop;
}

StepLoop::StepLoop(const RunSetup& setup, BlockRunner& runner, ActivationStore& activations, GradientPath& gradients)
    : setup_(setup), model_(setup.model()), runner_(runner), activations_(activations), gradients_(gradients) {}

StepLoop::~StepLoop() {
  if (update_thread_.joinable()) update_thread_.join();
}

void StepLoop::fill_state(TrainingState* st) const {
  st->steps_done = steps_done_;
  st->optimizer_steps = optimizer_steps_;
  st->loss_scaler = scaler_->state();
  // A batch already read for the next step's forward (Note [Overlapped optimizer]) is read again
  // by a run resumed from here.
  st->data_position = ahead_ ? ahead_->micro.front().position : data_->position();
  st->seed = data_->options().seed;
  st->seq_len = data_->options().seq_len;
}

Status StepLoop::restore(const TrainingState& st, const std::string& context) {
  ZO_RETURN_IF_ERROR(scaler_->restore(st.loss_scaler).with_context(context));
  ZO_RETURN_IF_ERROR(data_->set_position(st.data_position).with_context(context));
  steps_done_ = st.steps_done;
  optimizer_steps_ = st.optimizer_steps;
  return Status::ok();
}

void StepLoop::fold_grads(std::vector<torch::Tensor>& params, std::vector<torch::Tensor>& sums, bool first) const {
  // Called inside torch_call. The sum is over micro-batches in order, each added once in
  // grad_accum_dtype: the additions the accumulator makes on the host with the horizontal schedule.
  const torch::ScalarType accum = to_torch_dtype(setup_.config().grad_accum_dtype);
  sums.resize(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    torch::Tensor& g = params[i].mutable_grad();
    if (first) {
      sums[i] = g.to(accum, /*non_blocking=*/false, /*copy=*/true);
    } else {
      sums[i].add_(g);
    }
    g.reset();
  }
}

// One micro-step: forward block by block keeping only block inputs, then the head's loss and
// backward, then each block in reverse: re-fetch, recompute with autograd, backpropagate, hand its
// gradients to the accumulators, release (docs/design.md, "One training step").
//
// Note [Vertical schedule]
// With gradient accumulation the horizontal schedule runs each micro-batch through every block, so
// a step fetches every block 2·GAS times and sends every gradient to the host GAS times. The
// vertical one (zoffload.schedule "vertical", GreedySnake's order) runs all GAS micro-batches
// through block b before block b+1, forward and backward: one fetch of each block per direction
// and step, and one gradient transfer per parameter, at the price of holding every micro-batch's
// activation checkpoints at once (the planner counts GAS times the checkpoints, and the summed
// gradients of the largest block, in grad_accum_dtype).
// The gradients of a block are summed on the device in grad_accum_dtype, micro-batch by
// micro-batch in order (fold_grads), then sent once; the host accumulator sees one contribution.
// These are the same additions, in the same order and dtype, that the accumulator makes with the
// horizontal schedule, so the two agree to the bit where both sides round alike (fp32 sums: IEEE
// additions; the test compares them); the per-micro-batch forward and backward are unchanged.
Result<Forward> StepLoop::forward(uint64_t count) {
  Forward f;
  f.micro.resize(count);
  const uint32_t n = model_.n_blocks();
  for (MicroBatch& mb : f.micro) {
    const Stopwatch reading;
    ZO_RETURN_IF_ERROR(data_->next_batch(&batch_));
    ZO_RETURN_IF_ERROR(
        load_micro_batch(batch_, setup_.options().data_path, model_.config, n, runner_.torch_device(), &mb));
    f.data_s += reading.elapsed_s();
  }

  setup_.coord().begin_micro_step();
  for (uint32_t b = 0; b + 1 < n; ++b) {
    ZO_ASSIGN_OR_RETURN(std::vector<gpu::DevicePtr> ptrs, runner_.acquire(b));
    ZO_RETURN_IF_ERROR(runner_.compute_call("forward of " + model_.layout.blocks[b].name, [&] {
      torch::NoGradGuard no_grad;
      const std::vector<torch::Tensor> params = runner_.wrap(b, ptrs, false);
      for (MicroBatch& mb : f.micro) mb.block_inputs[b + 1] = runner_.forward(b, params, mb.block_inputs[b]);
    }));
    ZO_RETURN_IF_ERROR(runner_.release(b));
    if (activations_.holds(b)) ZO_RETURN_IF_ERROR(activations_.move_out(b, f));
  }
  return f;
}

Result<StepLoop::MicroResult> StepLoop::finish_micro_step(Forward& f, bool first, bool last, bool inject_overflow) {
  MicroResult result;
  ZO_RETURN_IF_ERROR(gradients_.begin_micro_step(first, last));
  // A failure below leaves the accumulator's window open; close it so the next step can start
  // (blocks still held are treated as released by the next begin_micro_step).
  struct Abandon {
    GradientPath& gradients;
    bool armed = true;
    ~Abandon() {
      if (armed) gradients.abandon_micro_step();
    }
  } abandon{gradients_};
  const uint32_t n = model_.n_blocks();
  // What backward differentiates (Note [Loss normalisation]): each micro-batch's mean over GAS and
  // the ranks (data parallel: each rank's share of the mean, so that the all-reduced sum is the
  // mean), or its summed token losses over every target the step could have.
  const double loss_factor =
      scaler_->scale() / (by_tokens()
                              ? static_cast<double>(target_slots())
                              : static_cast<double>(setup_.config().gradient_accumulation_steps * setup_.world_size()));
  const size_t count = f.micro.size();
  // With several micro-batches (the vertical schedule) each block's gradients are summed on the
  // device and leave it once (Note [Vertical schedule]).
  const bool fold = count > 1;
  // The block's gradients to send: its trainable params' own, or their sums.
  auto block_grads = [&](const std::vector<torch::Tensor>& params, std::vector<torch::Tensor>& sums) {
    if (fold) return sums;
    std::vector<torch::Tensor> g;
    for (const torch::Tensor& p : params) g.push_back(p.grad());
    return g;
  };
  // The block's trainable params, of BlockRunner::wrap's tensors (trainable_slots).
  auto trainable = [&](uint32_t block, const std::vector<torch::Tensor>& params) {
    std::vector<torch::Tensor> out;
    for (uint32_t slot : model_.trainable_slots[block]) out.push_back(params[slot]);
    return out;
  };
  // Note [Frozen sub-groups]: below the lowest block with a trainable param no gradient is wanted,
  // and that block's input needs none.
  auto input_needs_grad = [&](uint32_t block) { return block > model_.lowest_trainable_block; };

  // The head: its forward and backward follow each other in the schedule, so it runs once with
  // autograd and its backward entry only acquires and releases it.
  std::vector<torch::Tensor> grad_out(count);
  {
    const uint32_t h = n - 1;
    ZO_ASSIGN_OR_RETURN(std::vector<gpu::DevicePtr> ptrs, runner_.acquire(h));
    std::vector<torch::Tensor> params, sums, grads_h;
    ZO_RETURN_IF_ERROR(runner_.compute_call("forward and backward of " + model_.layout.blocks[h].name, [&] {
      params = runner_.wrap(h, ptrs, true);
      std::vector<torch::Tensor> learned = trainable(h, params);
      for (size_t k = 0; k < count; ++k) {
        MicroBatch& mb = f.micro[k];
        torch::Tensor x = mb.block_inputs[h].detach().set_requires_grad(input_needs_grad(h));
        torch::Tensor logits = runner_.forward(h, params, x);
        torch::Tensor loss = by_tokens() ? lm_loss_sum(logits, mb.targets) : lm_loss(logits, mb.targets);
        logits.reset();
        result.loss += loss.item<double>();
        (loss * loss_factor).backward();
        grad_out[k] = x.grad();
        if (fold) fold_grads(learned, sums, k == 0);
      }
      grads_h = block_grads(learned, sums);
    }));
    const Stopwatch sending;
    ZO_RETURN_IF_ERROR(gradients_.offload(h, grads_h, false));
    result.grad_offload_s += sending.elapsed_s();
    ZO_RETURN_IF_ERROR(runner_.release(h));
    ZO_RETURN_IF_ERROR(runner_.acquire(h).status());
    ZO_RETURN_IF_ERROR(runner_.release(h));
  }

  for (uint32_t b = n - 1; b-- > 0;) {
    // Note [Checkpoints on the CPU]: block b's inputs were queued back with block b+1 (or now, for
    // the last layer), and block b-1's are queued before b computes.
    if (activations_.holds(b) && b + 2 == n) ZO_RETURN_IF_ERROR(activations_.move_back(b, f));
    if (b > 0 && activations_.holds(b - 1)) ZO_RETURN_IF_ERROR(activations_.move_back(b - 1, f));
    if (activations_.holds(b)) ZO_RETURN_IF_ERROR(activations_.wait_back(b));
    ZO_ASSIGN_OR_RETURN(std::vector<gpu::DevicePtr> ptrs, runner_.acquire(b));
    std::vector<torch::Tensor> params, sums, grads_b;
    ZO_RETURN_IF_ERROR(runner_.compute_call("backward of " + model_.layout.blocks[b].name, [&] {
      params = runner_.wrap(b, ptrs, true);
      std::vector<torch::Tensor> learned = trainable(b, params);
      for (size_t k = 0; k < count; ++k) {
        MicroBatch& mb = f.micro[k];
        if (b < model_.lowest_trainable_block) {  // frozen below: the schedule's acquire and release only
          mb.block_inputs[b] = torch::Tensor();
          continue;
        }
        torch::Tensor x =
            b == 0 ? mb.block_inputs[0] : mb.block_inputs[b].detach().set_requires_grad(input_needs_grad(b));
        torch::Tensor out = runner_.forward(b, params, x);
        torch::autograd::backward({out}, {grad_out[k]});
        grad_out[k] = input_needs_grad(b) ? x.grad() : torch::Tensor();
        mb.block_inputs[b] = torch::Tensor();
        if (fold) fold_grads(learned, sums, k == 0);
      }
      grads_b = block_grads(learned, sums);
    }));
    const Stopwatch sending;
    ZO_RETURN_IF_ERROR(gradients_.offload(b, grads_b, b == 0 && inject_overflow));
    result.grad_offload_s += sending.elapsed_s();
    ZO_RETURN_IF_ERROR(runner_.release(b));
  }
  {
    trace::Span span(trace::Track::kGradOffload, "wait for the gradient worker");
    const Stopwatch draining;
    Status drained = gradients_.drain();
    result.grad_offload_s += draining.elapsed_s();
    ZO_RETURN_IF_ERROR(drained.with_context("accumulating gradients"));
  }
  ZO_ASSIGN_OR_RETURN(result.grads, gradients_.end_micro_step());
  abandon.armed = false;
  return result;
}

// Note [Loss normalisation]
// With masked labels the micro-batches of a step carry different numbers of labelled tokens, and
// two conventions average them differently. zoffload.loss_normalization "micro_batch" (DeepSpeed's
// engine, and zoffload's default): the step's loss is the mean over its GAS · world micro-batches of
// each one's mean token loss, so a token of a sparsely labelled micro-batch weighs more.
// "tokens" (transformers' Trainer since 4.46, num_items_in_batch; average_tokens_across_devices,
// its default, counts every rank's): the summed token losses of every micro-batch and rank divided
// by the step's labelled tokens N, so every token weighs the same.
// N is known only once the step's last batch is read (and, data parallel, summed over the ranks),
// after the first backward has run. So backward differentiates each micro-batch's summed token
// losses over S = GAS · world · micro_batch · seq_len, the most targets a step can have (a constant:
// the gradients keep the scale they have under "micro_batch" when nothing is masked), and the
// boundary multiplies by S / N (token_factor): in the norm, and so in the clipping coefficient, and
// in the optimizer's grad_scale beside 1/loss_scale. The rank all-reduce that sums the loss already
// sums N. Without accumulators (Note [No accumulator]) the update starts during backward, so N must
// be known before it: the whole step is then one forward (GAS 1 or the vertical schedule), whose
// batches give N, and the config refuses "tokens" there with more than one rank (N would need a
// collective before backward, beside the gatherer's). The same S and S / N in both paths keep
// them, and the two schedules, bit-identical. A step with no labelled token has N = 0: its
// gradients are zero, and its loss is 0 as an all-masked micro-batch's is.
Result<StepMetrics> StepLoop::step(bool evaluated_after) {
  const Stopwatch wall;
  if (!ahead_error_.is_ok()) return std::exchange(ahead_error_, Status::ok());  // this step's first forward failed
  StepMetrics out;
  out.step = steps_done_ + 1;
  out.loss_scale = scaler_->scale();
  out.lr = schedule_->lr_at(optimizer_steps_);
  const auto& inject = setup_.options().inject_overflow_steps;
  const bool overflow_here = std::find(inject.begin(), inject.end(), out.step) != inject.end();
  const StepCounters before = counters();
  const bool cuda = runner_.cuda();
  token_factor_ = 1.0;
  reset_torch_memory_peak(cuda);

  // The micro-steps, then (data parallel) the sums over the ranks. Without accumulators the
  // optimizer has stepped every sub-group by the end of backward (Note [No accumulator]).
  const bool direct = setup_.plan().placement.no_accumulator;
  // States on NVMe: the optimizer's first reads run under this step's forward and backward (Note
  // [Reading the states ahead]); the last step's optimizer has finished writing.
  if (!direct)
    ZO_RETURN_IF_ERROR(setup_.optimizer().read_states_ahead().with_context("step " + std::to_string(out.step)));
  std::optional<Result<OptimizerStepReport>> stepped;
  ZO_ASSIGN_OR_RETURN(Accumulated acc,
                      direct ? accumulate_and_update(overflow_here, &out, &stepped) : accumulate(overflow_here, &out));
  if (setup_.group() != nullptr) ZO_RETURN_IF_ERROR(sum_over_ranks(before, &acc, &out));
  if (by_tokens()) {
    // Note [Loss normalisation]: the gradients hold the summed token losses over target_slots(); the
    // step's labelled tokens (every rank's: out.tokens is all-reduced) finish the division.
    const double labelled = static_cast<double>(std::max<uint64_t>(out.tokens, 1));
    out.loss = acc.loss_sum / labelled;
    if (!direct) token_factor_ = static_cast<double>(target_slots()) / labelled;
  } else {
    out.loss = acc.loss_sum / static_cast<double>(setup_.config().gradient_accumulation_steps * setup_.world_size());
  }
  out.torch_peak_bytes = torch_memory(cuda).peak_bytes;

  // The accumulation boundary: overflow check, loss-scale update, clipping, then the optimizer on
  // its own thread while this one runs the next step's first forward (Note [Overlapped optimizer]).
  out.grad_norm = std::sqrt(acc.boundary.sum_sq) / out.loss_scale * token_factor_;
  out.skipped = scaler_->update(acc.boundary.nonfinite || !is_finite_norm(out.grad_norm));
  double join_s = 0;  // waiting for the optimizer (all of it when it does not overlap)
  if (direct) {
    // The config allows no accumulators only where no overflow skips a step.
    if (out.skipped) return internal_error("a step without accumulators was skipped after its update");
    if (!is_finite_norm(out.grad_norm))
      ZO_LOG(kWarn) << "step " << out.step << ": the gradient norm is not finite (" << out.grad_norm
                    << ") and this precision does not skip such steps: updated as the gradients came";
    setup_.coord().invalidate();                         // the compute copies changed under the device's cached copies
    if (setup_.data_parallel() != nullptr && stepped) {  // each rank stepped its own partition: the others' copies now
      Status sent = setup_.data_parallel()->send_direct_update(stepped->is_ok());
      if (!sent.is_ok() && stepped->is_ok()) stepped.emplace(std::move(sent));
    }
  } else if (!out.skipped) {
    ZO_RETURN_IF_ERROR(start_update(out, &stepped, &join_s));
  }
  // The next forward runs ahead unless this is the run's last step, or the held-out data is
  // evaluated first (Note [Evaluation]).
  const uint64_t last_step = setup_.options().last_step;
  if (setup_.config().zoffload.overlap_optimizer && (last_step == 0 || out.step < last_step) && !evaluated_after) {
    Result<Forward> next = forward(vertical_micro_batches(setup_.config()));
    if (next.is_ok()) {
      out.data_s += next->data_s;
      ahead_ = std::move(*next);
    } else {
      ahead_error_ = next.status();
    }
  }
  ZO_RETURN_IF_ERROR(finish_update(stepped, &join_s, &out));
  ++steps_done_;

  out.step_s = wall.elapsed_s();
  out.optimizer_wait_s = join_s;
  if (setup_.data_parallel() != nullptr && stepped && stepped->is_ok())
    out.gather_s = setup_.data_parallel()->gather_s();
  add_counter_deltas(before, counters(), &out);
  out.memory = setup_.accounting().snapshot();
  const gpu::DeviceStats ds = setup_.device().stats();
  out.device_peak_bytes = ds.peak_allocated_bytes;
  out.device_budget_bytes = ds.budget_bytes;
  out.device_pinned_bytes = ds.pinned_bytes;
  out.process_peak_rss_bytes = process_rss().peak;
  return out;
}

Result<StepLoop::Accumulated> StepLoop::accumulate(bool inject_overflow, StepMetrics* out,
                                                   const std::function<Status(const Forward&)>& first) {
  Accumulated acc;
  const uint64_t gas = setup_.config().gradient_accumulation_steps;
  const uint64_t per_forward = vertical_micro_batches(setup_.config());  // micro-batches per forward
  for (uint64_t micro = 0; micro < gas; micro += per_forward) {
    const bool last = micro + per_forward == gas;
    Forward f;
    if (micro == 0 && ahead_) {  // run behind the last step's optimizer (its data time is that step's)
      f = std::move(*ahead_);
      ahead_.reset();
    } else {
      ZO_ASSIGN_OR_RETURN(f, forward(per_forward));
      out->data_s += f.data_s;
    }
    if (micro == 0 && first) ZO_RETURN_IF_ERROR(first(f));
    ZO_ASSIGN_OR_RETURN(MicroResult r, finish_micro_step(f, micro == 0, last, inject_overflow && last));
    acc.loss_sum += r.loss;
    for (const MicroBatch& mb : f.micro) out->tokens += mb.tokens;
    out->grad_offload_s += r.grad_offload_s;
    out->grad_worker_s += r.grads.offload_s;
    if (last) acc.boundary = std::move(r.grads);
  }
  return acc;
}

Result<StepLoop::Accumulated> StepLoop::accumulate_and_update(bool inject_overflow, StepMetrics* out,
                                                              std::optional<Result<OptimizerStepReport>>* stepped) {
  // Without clipping the coefficient is 1, and nothing skips: the update needs no norm. Its
  // arguments are fixed once the step's batches are read: with no accumulators those are all in
  // the first forward (GAS 1, or the vertical schedule), and with loss_normalization "tokens" their
  // labelled tokens give the division (one rank: the config refuses more, Note [Loss normalisation]).
  bool begun = false;
  auto begin = [&](const Forward& f) -> Status {
    if (f.micro.size() != setup_.config().gradient_accumulation_steps)
      return internal_error("without accumulators a step's micro-batches must be one forward's");
    if (by_tokens()) {
      uint64_t labelled = 0;
      for (const MicroBatch& mb : f.micro) labelled += mb.tokens;
      token_factor_ = static_cast<double>(target_slots()) / static_cast<double>(std::max<uint64_t>(labelled, 1));
    }
    ZO_RETURN_IF_ERROR(setup_.optimizer().begin_direct(step_args(*out, 1.0), gradients_.completion_order()));
    begun = true;
    return Status::ok();
  };
  Result<Accumulated> acc = accumulate(inject_overflow, out, begin);
  if (!begun) return acc.status();  // nothing was stepped
  // Closed whatever happened: a failed backward after some sub-groups were stepped leaves the
  // states torn (end_direct marks them), as a failed optimizer step does.
  Result<OptimizerStepReport> report = setup_.optimizer().end_direct();
  if (!acc.is_ok()) return acc.status();
  stepped->emplace(std::move(report));
  return acc;
}

OptimizerStepArgs StepLoop::step_args(const StepMetrics& out, double clip) const {
  const OptimizerConfig& oc = setup_.config().optimizer;
  OptimizerStepArgs args;
  args.hyperparameters = optimizer_hyperparameters(oc, out.lr);
  args.step = static_cast<int64_t>(optimizer_steps_ + 1);
  args.rounding_seed = data_->options().seed;  // the run's seed, a resumed run's from its checkpoint
  args.grad_scale = static_cast<float>(clip / out.loss_scale * token_factor_);
  return args;
}

Status StepLoop::sum_over_ranks(const StepCounters& before_step, Accumulated* acc, StepMetrics* out) {
  // The micro-steps' collectives (partitioned gradients) ran on the gradient worker's thread.
  out->grad_reduce_s = setup_.group()->seconds() - before_step.collective_s;
  const double before = setup_.group()->seconds();
  // Note [Replicated data parallel]: the step's facts, then its gradients, summed over the ranks.
  std::array<double, 2> sums{acc->loss_sum, static_cast<double>(out->tokens)};
  {
    trace::Span span(trace::Track::kCollective, "all-reduce the loss");
    ZO_RETURN_IF_ERROR(setup_.group()->all_reduce_sum(sums, "all-reducing the loss"));
    out->rank_wait_s = setup_.group()->seconds() - before;
  }
  acc->loss_sum = sums[0];
  out->tokens = static_cast<uint64_t>(sums[1]);
  if (setup_.plan().partition_grads) {
    // Already reduced to their owners during backward: only the owners' chunk norms remain.
    trace::Span span(trace::Track::kCollective, "all-reduce the gradient norm");
    ZO_ASSIGN_OR_RETURN(acc->boundary, setup_.data_parallel()->owners_norm(std::move(acc->boundary.chunk_sq)));
  } else {
    ZO_ASSIGN_OR_RETURN(acc->boundary, setup_.data_parallel()->reduce_gradients());
  }
  out->collective_s = setup_.group()->seconds() - before;
  return Status::ok();
}

Status StepLoop::start_update(const StepMetrics& out, std::optional<Result<OptimizerStepReport>>* stepped,
                              double* join_s) {
  const Config& config = setup_.config();
  // A non-finite norm that does not skip (fp32, or bf16 without check_grad_overflow, as in
  // DeepSpeed) cannot be clipped by: the gradients go in unclipped, and the log says so.
  double clip = 1.0;
  if (is_finite_norm(out.grad_norm)) {
    clip = clip_coefficient(out.grad_norm, config.gradient_clipping);
  } else {
    ZO_LOG(kWarn) << "step " << out.step << ": the gradient norm is not finite (" << out.grad_norm
                  << ") and this precision does not skip such steps: updating without clipping";
  }
  OptimizerStepArgs args = step_args(out, clip);
  // Every device copy is dropped before the update writes (even a failed one may have changed
  // some: a torn store); from here the forward reads the compute copies from their homes, gated.
  setup_.coord().invalidate();
  auto update = [this](const OptimizerStepArgs& a, const std::function<void(uint32_t)>& publish) {
    dist::DataParallel* dp = setup_.data_parallel();
    return dp != nullptr ? dp->update(setup_.optimizer(), a, publish) : setup_.optimizer().step(a);
  };
  if (!config.zoffload.overlap_optimizer) {
    const Stopwatch updating;
    stepped->emplace(update(args, {}));
    *join_s = updating.elapsed_s();
    return Status::ok();
  }
  UpdateGate* g = &setup_.gate();
  auto publish = [g](uint32_t sub_group) { g->publish(sub_group); };
  args.on_compute_ready = publish;
  g->open();
  try {
    update_thread_ = std::thread([stepped, g, args, publish, update] {
      Result<OptimizerStepReport> r = update(args, publish);
      g->close(r.is_ok() ? Status::ok() : r.status());
      stepped->emplace(std::move(r));
    });
  } catch (const std::system_error& e) {
    g->close(Status::ok());  // nothing was written
    return errno_status("step " + std::to_string(out.step) + ": starting the optimizer thread", e.code().value());
  }
  return Status::ok();
}

Status StepLoop::finish_update(std::optional<Result<OptimizerStepReport>>& stepped, double* join_s, StepMetrics* out) {
  if (update_thread_.joinable()) {
    const Stopwatch joining;
    update_thread_.join();
    *join_s = joining.elapsed_s();
  }
  if (!stepped) return Status::ok();  // skipped
  if (!stepped->is_ok()) {
    // The run ends here (the states may be torn); what the forward run ahead did or hit is moot.
    // The gate stops failing forwards: as in the sequential step, the next optimizer step is
    // what refuses the torn states (OptimizerSwapper::step).
    ahead_.reset();
    ahead_error_ = Status::ok();
    setup_.gate().close(Status::ok());
    return stepped->status();
  }
  const OptimizerStepReport& report = **stepped;
  ++optimizer_steps_;
  out->optimizer_s = report.total_s;
  out->nvme_read_wait_s = report.read_wait_s;
  out->nvme_write_wait_s = report.write_wait_s;
  return Status::ok();
}

StepCounters StepLoop::counters() const {
  StepCounters c;
  c.coord = setup_.coord().stats();
  c.ready_wait_s = runner_.ready_wait_s();
  c.io_busy_s = setup_.io().stats().busy_s;
  c.device = setup_.device().busy();
  if (setup_.group() != nullptr) {
    c.collective_bytes = setup_.group()->bytes();
    c.collective_s = setup_.group()->seconds();
  }
  if (setup_.gatherer() != nullptr) c.gathered = setup_.gatherer()->stats();
  return c;
}

}  // namespace zo::engine

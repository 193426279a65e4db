// One optimizer step of the trainer: LibTorch and the device around each block, the micro-steps
// forward and backward with their gradients sent to the accumulators, the accumulation boundary,
// and the optimizer on its own thread beside the next step's first forward (trainer_impl.h).
#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <system_error>
#include <thread>
#include <utility>

#include <nlohmann/json.hpp>

#include "common/host_info.h"
#include "common/log.h"
#include "common/timer.h"
#include "common/trace.h"
#include "engine/optim/grad_clip.h"
#include "engine/train/trainer_impl.h"

namespace zo::engine {

std::vector<torch::Tensor> Trainer::Impl::wrap(uint32_t block, const std::vector<gpu::DevicePtr>& ptrs,
                                               bool grad) const {
  const BlockSpec& spec = layout.blocks[block];
  std::vector<torch::Tensor> out;
  out.reserve(ptrs.size());
  for (size_t i = 0; i < ptrs.size(); ++i) {
    const ParamSpec& param = layout.params[spec.params[i]];
    torch::Tensor t = param_tensor(ptrs[i].addr, param, compute_dtype, torch_device);
    if (grad && param.trainable) t.set_requires_grad(true);  // a frozen one gets no gradient
    out.push_back(std::move(t));
  }
  return out;
}

// LibTorch's current stream, where the blocks compute (nullptr on the CPU).
Result<void*> Trainer::Impl::compute_stream() {
  void* stream = nullptr;
  ZO_RETURN_IF_ERROR(
      torch_call("reading LibTorch's stream", [&] { stream = torch_compute_stream(torch_device.is_cuda()); }));
  return stream;
}

// A block's forward or backward: a LibTorch call that is a span of the compute track when tracing,
// timed by the device as it runs it (its busy time, and the trace's device compute track).
Status Trainer::Impl::compute_call(const std::string& what, const std::function<void()>& fn) {
  trace::Span span(trace::Track::kCompute, [&] { return what; });
  ZO_ASSIGN_OR_RETURN(void* stream, compute_stream());
  return device->foreign_work(gpu::DeviceWork::kCompute, 0, stream, what, [&] { return torch_call(what, fn); });
}

Result<std::vector<gpu::DevicePtr>> Trainer::Impl::acquire(uint32_t block) {
  trace::Span span(trace::Track::kFetch, [&] { return "fetch " + layout.blocks[block].name; });
  // No host wait on CUDA: LibTorch's stream waits on the device for the block's ready event, so the
  // host queues the block's kernels while its copies are still landing.
  ZO_ASSIGN_OR_RETURN(ParamCoordinator::Acquired a, coord->acquire_async(block));
  if (!a.ready) return std::move(a.ptrs);  // nothing in transfer
  ZO_ASSIGN_OR_RETURN(void* stream, compute_stream());
  const Stopwatch waited;
  Status st = device->wait_foreign(stream, a.ready);
  ready_wait_s += waited.elapsed_s();
  ZO_RETURN_IF_ERROR(st.with_context("waiting for the parameters of " + layout.blocks[block].name));
  return std::move(a.ptrs);
}

Status Trainer::Impl::release(uint32_t block) {
  // No host sync: the coordinator's copy stream waits for this event, recorded after the kernels
  // LibTorch has queued so far (all that read the block), before it refills the block's space.
  ZO_ASSIGN_OR_RETURN(void* stream, compute_stream());
  ZO_RETURN_IF_ERROR(device->record_foreign(released, stream).with_context("releasing " + layout.blocks[block].name));
  return coord->release(block, released);
}

Status Trainer::Impl::offload_grads(uint32_t block, const std::vector<torch::Tensor>& grads, bool inject_overflow) {
  // Each gradient is copied into the gradient worker's landing ring (pinned) and accumulated there
  // behind the next block's backward (Note [Gradient landing ring]). On CUDA the copies are D2H
  // on LibTorch's copy stream, ordered after the backward kernels queued so far by an event on the
  // compute stream, so they overlap the next block's kernels instead of queueing between them; the
  // worker waits for the copy's event, and the host for neither.
  const BlockSpec& spec = layout.blocks[block];
  trace::Span span(trace::Track::kGradOffload, [&] { return "offload " + spec.name; });
  // The compute dtype, or grad_accum_dtype for the vertical schedule's device-side sums.
  const DType dtype = grad_transfer_dtype(opt.config);
  const bool cuda = torch_device.is_cuda();
  const std::vector<uint32_t>& slots = trainable_slots[block];
  ZO_CHECK_EQ(grads.size(), slots.size()) << "one gradient per trainable param of " << spec.name;
  if (grads.empty()) return Status::ok();  // a frozen block (Note [Frozen sub-groups])
  std::optional<TorchCopyStreamScope> copies;
  ZO_RETURN_IF_ERROR(begin_copies(&copies, "sending the gradients of " + spec.name));
  for (size_t i = 0; i < grads.size(); ++i) {
    const uint32_t id = spec.params[slots[i]];
    const std::string& name = layout.params[id].name;
    const torch::Tensor& g = grads[i];
    if (!g.defined()) return internal_error("no gradient reached " + name);
    ZO_CHECK(g.scalar_type() == to_torch_dtype(dtype)) << "the gradient of " << name << " is not " << dtype_name(dtype);
    const uint64_t bytes = static_cast<uint64_t>(g.numel()) * g.element_size();
    ZO_RETURN_IF_ERROR(grad_worker->submit(
        id, dtype, bytes,
        // Into a ring slot, or into the runs of the sums' buffers where it lands in place (Note
        // [Gradients that land where they are summed] in engine/coord/grad_accumulator.cpp).
        [&](std::span<std::byte> dest, uint64_t from) {
          ZO_RETURN_IF_ERROR(device->foreign_work(gpu::DeviceWork::kD2H, dest.size(), copies->native_stream(), {}, [&] {
            return torch_call("copying the gradient of " + name, [&] {
              torch::Tensor src = g;
              if (inject_overflow && i == 0 && from == 0) {  // on the source: the copy may still be in flight
                src = g.clone();
                src.view(-1)[0] = std::numeric_limits<float>::infinity();
              }
              copies->record_use(src);  // its memory is not reused before the copy stream has read it
              if (dest.size() == bytes) {
                torch::Tensor landed = torch::from_blob(dest.data(), g.sizes(), g.options().device(torch::kCPU));
                landed.copy_(src, /*non_blocking=*/true);
              } else {  // one run of a param that straddles two sub-groups (a view: nothing to free early)
                const int64_t eb = g.element_size(), n = static_cast<int64_t>(dest.size()) / eb;
                torch::Tensor landed = torch::from_blob(dest.data(), {n}, g.options().device(torch::kCPU));
                landed.copy_(src.view(-1).narrow(0, static_cast<int64_t>(from) / eb, n), /*non_blocking=*/true);
              }
            });
          }));
          return device->record_foreign(landed, copies->native_stream());
        },
        landed));
    if (cuda) accounting.add_moved(Move::kDeviceToHost, bytes);
  }
  return Status::ok();
}

Status Trainer::Impl::begin_copies(std::optional<TorchCopyStreamScope>* copies, const std::string& where) {
  const bool cuda = torch_device.is_cuda();
  void* compute = nullptr;
  ZO_RETURN_IF_ERROR(torch_call(where, [&] { compute = torch_compute_stream(cuda); }));
  ZO_RETURN_IF_ERROR(device->record_foreign(copies_after, compute).with_context(where));
  ZO_RETURN_IF_ERROR(torch_call(where, [&] { copies->emplace(cuda); }));
  return device->wait_foreign((*copies)->native_stream(), copies_after).with_context(where);
}

void Trainer::Impl::fold_grads(std::vector<torch::Tensor>& params, std::vector<torch::Tensor>& sums, bool first) const {
  // Called inside torch_call. The sum is over micro-batches in order, each added once in
  // grad_accum_dtype: the additions the accumulator makes on the host with the horizontal schedule.
  const torch::ScalarType accum = to_torch_dtype(opt.config.grad_accum_dtype);
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
Status Trainer::Impl::load_micro(const Batch& batch, const std::string& path, Micro* mb) {
  mb->position = batch.position;
  for (size_t i = 0; i < batch.inputs.size(); ++i) {
    const bool bad_input = outside_vocab(batch.inputs[i], false);
    if (bad_input || outside_vocab(batch.targets[i], true))
      return invalid_argument(path + ": " + (bad_input ? "token " : "label ") +
                              std::to_string(bad_input ? batch.inputs[i] : batch.targets[i]) + " (window " +
                              std::to_string(batch.windows[i / batch.seq_len]) +
                              ") is outside the model's vocabulary of " + std::to_string(model.vocab_size));
  }
  mb->tokens = 0;
  for (int32_t t : batch.targets) mb->tokens += t != kIgnoreLabel;
  mb->inputs.assign(layout.blocks.size(), torch::Tensor());
  return torch_call("preparing the batch", [&] {
    const int64_t b = static_cast<int64_t>(batch.batch), t = static_cast<int64_t>(batch.seq_len);
    // from_blob does not copy: the copies to the device's int64 are made before `batch` is reused.
    mb->inputs[0] = torch::from_blob(const_cast<int32_t*>(batch.inputs.data()), {b, t}, torch::kInt32)
                        .to(torch_device, torch::kInt64);
    mb->targets = torch::from_blob(const_cast<int32_t*>(batch.targets.data()), {b, t}, torch::kInt32)
                      .to(torch_device, torch::kInt64);
  });
}

Result<Trainer::Impl::Forward> Trainer::Impl::forward(uint64_t count) {
  Forward f;
  f.micro.resize(count);
  const uint32_t n = static_cast<uint32_t>(layout.blocks.size());
  for (Micro& mb : f.micro) {
    const Stopwatch reading;
    ZO_RETURN_IF_ERROR(data->next_batch(&batch));
    ZO_RETURN_IF_ERROR(load_micro(batch, opt.data_path, &mb));
    f.data_s += reading.elapsed_s();
  }

  coord->begin_micro_step();
  for (uint32_t b = 0; b + 1 < n; ++b) {
    ZO_ASSIGN_OR_RETURN(std::vector<gpu::DevicePtr> ptrs, acquire(b));
    ZO_RETURN_IF_ERROR(compute_call("forward of " + layout.blocks[b].name, [&] {
      torch::NoGradGuard no_grad;
      const std::vector<torch::Tensor> params = wrap(b, ptrs, false);
      for (Micro& mb : f.micro) mb.inputs[b + 1] = block_forward(model, layout.blocks[b], params, mb.inputs[b], rope);
    }));
    ZO_RETURN_IF_ERROR(release(b));
    if (host_checkpoint(b)) ZO_RETURN_IF_ERROR(checkpoints_out(b, f));
  }
  return f;
}

Result<Trainer::Impl::MicroResult> Trainer::Impl::finish_micro_step(Forward& f, bool first, bool last,
                                                                    bool inject_overflow) {
  MicroResult result;
  ZO_RETURN_IF_ERROR(grads->begin_micro_step(first, last));
  // A failure below leaves the accumulator's window open; close it so the next step can start
  // (blocks still held are treated as released by the next begin_micro_step).
  struct Abandon {
    GradWorker* worker;
    GradAccumulator* grads;
    bool armed = true;
    ~Abandon() {
      if (!armed) return;
      (void)worker->drain();  // the worker must be idle before the window closes; the step's error is reported
      grads->abandon_micro_step();
    }
  } abandon{grad_worker.get(), grads.get()};
  const uint32_t n = static_cast<uint32_t>(layout.blocks.size());
  // What backward differentiates (Note [Loss normalisation]): each micro-batch's mean over GAS and
  // the ranks (data parallel: each rank's share of the mean, so that the all-reduced sum is the
  // mean), or its summed token losses over every target the step could have.
  const double loss_factor =
      scaler->scale() / (by_tokens() ? static_cast<double>(target_slots())
                                     : static_cast<double>(opt.config.gradient_accumulation_steps * world_size()));
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
  // The block's trainable params, of wrap()'s tensors (trainable_slots).
  auto trainable = [&](uint32_t block, const std::vector<torch::Tensor>& params) {
    std::vector<torch::Tensor> out;
    for (uint32_t slot : trainable_slots[block]) out.push_back(params[slot]);
    return out;
  };
  // Note [Frozen sub-groups]: below the lowest block with a trainable param no gradient is wanted,
  // and that block's input needs none.
  auto input_needs_grad = [&](uint32_t block) { return block > lowest_trainable_block; };

  // The head: its forward and backward follow each other in the schedule, so it runs once with
  // autograd and its backward entry only acquires and releases it.
  std::vector<torch::Tensor> grad_out(count);
  {
    const uint32_t h = n - 1;
    ZO_ASSIGN_OR_RETURN(std::vector<gpu::DevicePtr> ptrs, acquire(h));
    std::vector<torch::Tensor> params, sums, grads_h;
    ZO_RETURN_IF_ERROR(compute_call("forward and backward of " + layout.blocks[h].name, [&] {
      params = wrap(h, ptrs, true);
      std::vector<torch::Tensor> learned = trainable(h, params);
      for (size_t k = 0; k < count; ++k) {
        Micro& mb = f.micro[k];
        torch::Tensor x = mb.inputs[h].detach().set_requires_grad(input_needs_grad(h));
        torch::Tensor logits = block_forward(model, layout.blocks[h], params, x, rope);
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
    ZO_RETURN_IF_ERROR(offload_grads(h, grads_h, false));
    result.grad_offload_s += sending.elapsed_s();
    ZO_RETURN_IF_ERROR(release(h));
    ZO_RETURN_IF_ERROR(acquire(h).status());
    ZO_RETURN_IF_ERROR(release(h));
  }

  for (uint32_t b = n - 1; b-- > 0;) {
    // Note [Checkpoints on the CPU]: block b's inputs were queued back with block b+1 (or now, for
    // the last layer), and block b-1's are queued before b computes.
    if (host_checkpoint(b) && b + 2 == n) ZO_RETURN_IF_ERROR(checkpoints_back(b, f));
    if (b > 0 && host_checkpoint(b - 1)) ZO_RETURN_IF_ERROR(checkpoints_back(b - 1, f));
    if (host_checkpoint(b)) ZO_RETURN_IF_ERROR(wait_checkpoints(b));
    ZO_ASSIGN_OR_RETURN(std::vector<gpu::DevicePtr> ptrs, acquire(b));
    std::vector<torch::Tensor> params, sums, grads_b;
    ZO_RETURN_IF_ERROR(compute_call("backward of " + layout.blocks[b].name, [&] {
      params = wrap(b, ptrs, true);
      std::vector<torch::Tensor> learned = trainable(b, params);
      for (size_t k = 0; k < count; ++k) {
        Micro& mb = f.micro[k];
        if (b < lowest_trainable_block) {  // frozen below: the schedule's acquire and release only
          mb.inputs[b] = torch::Tensor();
          continue;
        }
        torch::Tensor x = b == 0 ? mb.inputs[0] : mb.inputs[b].detach().set_requires_grad(input_needs_grad(b));
        torch::Tensor out = block_forward(model, layout.blocks[b], params, x, rope);
        torch::autograd::backward({out}, {grad_out[k]});
        grad_out[k] = input_needs_grad(b) ? x.grad() : torch::Tensor();
        mb.inputs[b] = torch::Tensor();
        if (fold) fold_grads(learned, sums, k == 0);
      }
      grads_b = block_grads(learned, sums);
    }));
    const Stopwatch sending;
    ZO_RETURN_IF_ERROR(offload_grads(b, grads_b, b == 0 && inject_overflow));
    result.grad_offload_s += sending.elapsed_s();
    ZO_RETURN_IF_ERROR(release(b));
  }
  {
    trace::Span span(trace::Track::kGradOffload, "wait for the gradient worker");
    const Stopwatch draining;
    Status drained = grad_worker->drain();
    result.grad_offload_s += draining.elapsed_s();
    ZO_RETURN_IF_ERROR(drained.with_context("accumulating gradients"));
  }
  ZO_ASSIGN_OR_RETURN(result.grads, grads->end_micro_step());
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
Result<StepMetrics> Trainer::Impl::step_once() {
  const Stopwatch wall;
  if (!ahead_error.is_ok()) return std::exchange(ahead_error, Status::ok());  // this step's first forward failed
  StepMetrics out;
  out.step = steps_done + 1;
  out.loss_scale = scaler->scale();
  out.lr = schedule->lr_at(optimizer_steps);
  const auto& inject = opt.inject_overflow_steps;
  const bool overflow_here = std::find(inject.begin(), inject.end(), out.step) != inject.end();
  const StepCounters before = counters();
  const bool cuda = torch_device.is_cuda();
  token_factor = 1.0;
  reset_torch_memory_peak(cuda);

  // The micro-steps, then (data parallel) the sums over the ranks. Without accumulators the
  // optimizer has stepped every sub-group by the end of backward (Note [No accumulator]).
  const bool direct = plan.placement.no_accumulator;
  // States on NVMe: the optimizer's first reads run under this step's forward and backward (Note
  // [Reading the states ahead]); the last step's optimizer has finished writing.
  if (!direct) ZO_RETURN_IF_ERROR(optimizer->read_states_ahead().with_context("step " + std::to_string(out.step)));
  std::optional<Result<OptimizerStepReport>> stepped;
  ZO_ASSIGN_OR_RETURN(Accumulated acc,
                      direct ? accumulate_and_update(overflow_here, &out, &stepped) : accumulate(overflow_here, &out));
  if (opt.group != nullptr) ZO_RETURN_IF_ERROR(sum_over_ranks(before, &acc, &out));
  if (by_tokens()) {
    // Note [Loss normalisation]: the gradients hold the summed token losses over target_slots(); the
    // step's labelled tokens (every rank's: out.tokens is all-reduced) finish the division.
    const double labelled = static_cast<double>(std::max<uint64_t>(out.tokens, 1));
    out.loss = acc.loss_sum / labelled;
    if (!direct) token_factor = static_cast<double>(target_slots()) / labelled;
  } else {
    out.loss = acc.loss_sum / static_cast<double>(opt.config.gradient_accumulation_steps * world_size());
  }
  out.torch_peak_bytes = torch_memory(cuda).peak_bytes;

  // The accumulation boundary: overflow check, loss-scale update, clipping, then the optimizer on
  // its own thread while this one runs the next step's first forward (Note [Overlapped optimizer]).
  out.grad_norm = std::sqrt(acc.boundary.sum_sq) / out.loss_scale * token_factor;
  out.skipped = scaler->update(acc.boundary.nonfinite || !is_finite_norm(out.grad_norm));
  double join_s = 0;  // waiting for the optimizer (all of it when it does not overlap)
  if (direct) {
    // The config allows no accumulators only where no overflow skips a step.
    if (out.skipped) return internal_error("a step without accumulators was skipped after its update");
    if (!is_finite_norm(out.grad_norm))
      ZO_LOG(kWarn) << "step " << out.step << ": the gradient norm is not finite (" << out.grad_norm
                    << ") and this precision does not skip such steps: updated as the gradients came";
    coord->invalidate();             // the compute copies changed under the device's cached copies
    if (data_parallel && stepped) {  // each rank stepped its own partition: the others' copies now
      Status sent = data_parallel->send_direct_update(stepped->is_ok());
      if (!sent.is_ok() && stepped->is_ok()) stepped.emplace(std::move(sent));
    }
  } else if (!out.skipped) {
    ZO_RETURN_IF_ERROR(start_update(out, &stepped, &join_s));
  }
  // The next forward runs ahead unless this is the run's last step, or the held-out data is
  // evaluated first (Note [Evaluation]).
  const bool evaluating = eval_due(out.step);
  if (opt.config.zoffload.overlap_optimizer && (opt.last_step == 0 || out.step < opt.last_step) && !evaluating) {
    Result<Forward> next = forward(vertical_micro_batches(opt.config));
    if (next.is_ok()) {
      out.data_s += next->data_s;
      ahead = std::move(*next);
    } else {
      ahead_error = next.status();
    }
  }
  ZO_RETURN_IF_ERROR(finish_update(stepped, &join_s, &out));
  ++steps_done;

  out.step_s = wall.elapsed_s();
  out.optimizer_wait_s = join_s;
  if (data_parallel && stepped && stepped->is_ok()) out.gather_s = data_parallel->gather_s();
  add_counter_deltas(before, counters(), &out);
  out.memory = accounting.snapshot();
  const gpu::DeviceStats ds = device->stats();
  out.device_peak_bytes = ds.peak_allocated_bytes;
  out.device_budget_bytes = ds.budget_bytes;
  out.device_pinned_bytes = ds.pinned_bytes;
  out.process_peak_rss_bytes = process_rss().peak;
  if (evaluating) {
    trace::Span span(trace::Track::kStep, "evaluate");
    Result<EvalMetrics> eval = evaluate();
    if (eval.is_ok()) out.eval = *eval;
    else out.eval_error = Status(eval.status()).with_context("evaluating --eval-data " + opt.eval_data_path);
  }
  ZO_RETURN_IF_ERROR(record(out));
  return out;
}

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
// labels are checked against the vocabulary when the run starts (open_eval_data); a failure found
// later (an I/O error, a file changed under the run) is the step's StepMetrics::eval_error, not the
// step's failure, so the step is recorded and `zoffload train` saves it before it stops. Across
// ranks every one learns whether any failed before the losses are summed (first_failed_rank), so
// all of them stop there together and none waits in a collective the others never reach.
Result<EvalMetrics> Trainer::Impl::evaluate() {
  const Stopwatch wall;
  Result<std::array<double, 3>> local = evaluate_here();
  if (opt.group != nullptr) {
    ZO_ASSIGN_OR_RETURN(const std::optional<uint32_t> failed,
                        dist::first_failed_rank(*opt.group, !local.is_ok(), "agreeing on the evaluation"));
    if (failed && local.is_ok())
      return Status(StatusCode::kAborted, "rank " + std::to_string(*failed) + " could not evaluate (its error says why)");
  }
  if (!local.is_ok()) return local.status();
  std::array<double, 3> sums = *local;
  if (opt.group != nullptr) {
    trace::Span span(trace::Track::kCollective, "all-reduce the evaluation");
    ZO_RETURN_IF_ERROR(opt.group->all_reduce_sum(sums, "all-reducing the evaluation loss"));
  }
  EvalMetrics out;
  out.batches = eval_batches_per_rank * world_size();
  out.tokens = static_cast<uint64_t>(sums[2]);
  // No batch with a labelled target: no loss (null in metrics.jsonl, left out of the monitors).
  out.loss = sums[1] > 0 ? sums[0] / sums[1] : std::numeric_limits<double>::quiet_NaN();
  out.perplexity = std::exp(out.loss);
  out.eval_s = wall.elapsed_s();
  return out;
}

Result<std::array<double, 3>> Trainer::Impl::evaluate_here() {
  ZO_RETURN_IF_ERROR(eval_data->set_position({}));
  const uint32_t n = static_cast<uint32_t>(layout.blocks.size());
  const uint64_t per_pass = vertical_micro_batches(opt.config);
  std::array<double, 3> sums{};  // loss over the counted batches, those batches, labelled targets
  Batch read;
  std::vector<Micro> micro;
  for (uint64_t done = 0; done < eval_batches_per_rank; done += per_pass) {
    micro.resize(std::min(per_pass, eval_batches_per_rank - done));
    for (Micro& mb : micro) {
      ZO_RETURN_IF_ERROR(eval_data->next_batch(&read));
      ZO_RETURN_IF_ERROR(load_micro(read, opt.eval_data_path, &mb));
      sums[2] += static_cast<double>(mb.tokens);
    }
    coord->begin_micro_step();
    for (uint32_t b = 0; b < n; ++b) {
      ZO_ASSIGN_OR_RETURN(std::vector<gpu::DevicePtr> ptrs, acquire(b));
      ZO_RETURN_IF_ERROR(compute_call("evaluating " + layout.blocks[b].name, [&] {
        torch::NoGradGuard no_grad;
        const std::vector<torch::Tensor> params = wrap(b, ptrs, false);
        for (Micro& mb : micro) {
          torch::Tensor y = block_forward(model, layout.blocks[b], params, mb.inputs[b], rope);
          mb.inputs[b] = torch::Tensor();
          if (b + 1 < n) {
            mb.inputs[b + 1] = std::move(y);
          } else if (mb.tokens > 0) {
            sums[0] += lm_loss(y, mb.targets).item<double>();
            sums[1] += 1;
          }
        }
      }));
      ZO_RETURN_IF_ERROR(release(b));
    }
  }
  return sums;
}

Result<Trainer::Impl::Accumulated> Trainer::Impl::accumulate(bool inject_overflow, StepMetrics* out,
                                                             const std::function<Status(const Forward&)>& first) {
  Accumulated acc;
  const uint64_t gas = opt.config.gradient_accumulation_steps;
  const uint64_t per_forward = vertical_micro_batches(opt.config);  // micro-batches per forward
  for (uint64_t micro = 0; micro < gas; micro += per_forward) {
    const bool last = micro + per_forward == gas;
    Forward f;
    if (micro == 0 && ahead) {  // run behind the last step's optimizer (its data time is that step's)
      f = std::move(*ahead);
      ahead.reset();
    } else {
      ZO_ASSIGN_OR_RETURN(f, forward(per_forward));
      out->data_s += f.data_s;
    }
    if (micro == 0 && first) ZO_RETURN_IF_ERROR(first(f));
    ZO_ASSIGN_OR_RETURN(MicroResult r, finish_micro_step(f, micro == 0, last, inject_overflow && last));
    acc.loss_sum += r.loss;
    for (const Micro& mb : f.micro) out->tokens += mb.tokens;
    out->grad_offload_s += r.grad_offload_s;
    out->grad_worker_s += r.grads.offload_s;
    if (last) acc.boundary = std::move(r.grads);
  }
  return acc;
}

Result<Trainer::Impl::Accumulated> Trainer::Impl::accumulate_and_update(
    bool inject_overflow, StepMetrics* out, std::optional<Result<OptimizerStepReport>>* stepped) {
  // Without clipping the coefficient is 1, and nothing skips: the update needs no norm. Its
  // arguments are fixed once the step's batches are read: with no accumulators those are all in
  // the first forward (GAS 1, or the vertical schedule), and with loss_normalization "tokens" their
  // labelled tokens give the division (one rank: the config refuses more, Note [Loss normalisation]).
  bool begun = false;
  auto begin = [&](const Forward& f) -> Status {
    if (f.micro.size() != opt.config.gradient_accumulation_steps)
      return internal_error("without accumulators a step's micro-batches must be one forward's");
    if (by_tokens()) {
      uint64_t labelled = 0;
      for (const Micro& mb : f.micro) labelled += mb.tokens;
      token_factor = static_cast<double>(target_slots()) / static_cast<double>(std::max<uint64_t>(labelled, 1));
    }
    ZO_RETURN_IF_ERROR(optimizer->begin_direct(step_args(*out, 1.0), grads->completion_order()));
    begun = true;
    return Status::ok();
  };
  Result<Accumulated> acc = accumulate(inject_overflow, out, begin);
  if (!begun) return acc.status();  // nothing was stepped
  // Closed whatever happened: a failed backward after some sub-groups were stepped leaves the
  // states torn (end_direct marks them), as a failed optimizer step does.
  Result<OptimizerStepReport> report = optimizer->end_direct();
  if (!acc.is_ok()) return acc.status();
  stepped->emplace(std::move(report));
  return acc;
}

OptimizerStepArgs Trainer::Impl::step_args(const StepMetrics& out, double clip) const {
  const OptimizerConfig& oc = opt.config.optimizer;
  OptimizerStepArgs args;
  args.hyperparameters = optimizer_hyperparameters(oc, out.lr);
  args.step = static_cast<int64_t>(optimizer_steps + 1);
  args.rounding_seed = data->options().seed;  // the run's seed, a resumed run's from its checkpoint
  args.grad_scale = static_cast<float>(clip / out.loss_scale * token_factor);
  return args;
}

Status Trainer::Impl::sum_over_ranks(const StepCounters& before_step, Accumulated* acc, StepMetrics* out) {
  // The micro-steps' collectives (partitioned gradients) ran on the gradient worker's thread.
  out->grad_reduce_s = opt.group->seconds() - before_step.collective_s;
  const double before = opt.group->seconds();
  // Note [Replicated data parallel]: the step's facts, then its gradients, summed over the ranks.
  std::array<double, 2> sums{acc->loss_sum, static_cast<double>(out->tokens)};
  {
    trace::Span span(trace::Track::kCollective, "all-reduce the loss");
    ZO_RETURN_IF_ERROR(opt.group->all_reduce_sum(sums, "all-reducing the loss"));
    out->rank_wait_s = opt.group->seconds() - before;
  }
  acc->loss_sum = sums[0];
  out->tokens = static_cast<uint64_t>(sums[1]);
  if (plan.partition_grads) {
    // Already reduced to their owners during backward: only the owners' chunk norms remain.
    trace::Span span(trace::Track::kCollective, "all-reduce the gradient norm");
    ZO_ASSIGN_OR_RETURN(acc->boundary, data_parallel->owners_norm(std::move(acc->boundary.chunk_sq)));
  } else {
    ZO_ASSIGN_OR_RETURN(acc->boundary, data_parallel->reduce_gradients());
  }
  out->collective_s = opt.group->seconds() - before;
  return Status::ok();
}

Status Trainer::Impl::start_update(const StepMetrics& out, std::optional<Result<OptimizerStepReport>>* stepped,
                                   double* join_s) {
  const Config& config = opt.config;
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
  coord->invalidate();
  auto update = [this](const OptimizerStepArgs& a, const std::function<void(uint32_t)>& publish) {
    return data_parallel ? data_parallel->update(*optimizer, a, publish) : optimizer->step(a);
  };
  if (!config.zoffload.overlap_optimizer) {
    const Stopwatch updating;
    stepped->emplace(update(args, {}));
    *join_s = updating.elapsed_s();
    return Status::ok();
  }
  UpdateGate* g = gate.get();
  auto publish = [g](uint32_t sub_group) { g->publish(sub_group); };
  args.on_compute_ready = publish;
  g->open();
  try {
    update_thread = std::thread([stepped, g, args, publish, update] {
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

Status Trainer::Impl::finish_update(std::optional<Result<OptimizerStepReport>>& stepped, double* join_s,
                                    StepMetrics* out) {
  if (update_thread.joinable()) {
    const Stopwatch joining;
    update_thread.join();
    *join_s = joining.elapsed_s();
  }
  if (!stepped) return Status::ok();  // skipped
  if (!stepped->is_ok()) {
    // The run ends here (the states may be torn); what the forward run ahead did or hit is moot.
    // The gate stops failing forwards: as in the sequential step, the next optimizer step is
    // what refuses the torn states (OptimizerSwapper::step).
    ahead.reset();
    ahead_error = Status::ok();
    gate->close(Status::ok());
    return stepped->status();
  }
  const OptimizerStepReport& report = **stepped;
  ++optimizer_steps;
  out->optimizer_s = report.total_s;
  out->nvme_read_wait_s = report.read_wait_s;
  out->nvme_write_wait_s = report.write_wait_s;
  return Status::ok();
}

StepCounters Trainer::Impl::counters() const {
  StepCounters c;
  c.coord = coord->stats();
  c.ready_wait_s = ready_wait_s;
  c.io_busy_s = io->stats().busy_s;
  c.device = device->busy();
  if (opt.group != nullptr) {
    c.collective_bytes = opt.group->bytes();
    c.collective_s = opt.group->seconds();
  }
  if (gatherer) c.gathered = gatherer->stats();
  return c;
}

Status Trainer::Impl::record(const StepMetrics& out) {
  if (metrics == nullptr) return Status::ok();  // not rank 0
  const nlohmann::json line = out.record();
  ZO_RETURN_IF_ERROR(metrics->append(line.dump() + "\n"));
  if (tensorboard || csv_monitor) {
    // The same record, as DeepSpeed's monitors write it (Note [Monitor tags] in engine/monitor).
    const std::vector<monitor::Scalar> scalars = monitor::scalars_of_metrics_record(line);
    const uint64_t samples = out.step * opt.config.train_batch_size;
    if (tensorboard) ZO_RETURN_IF_ERROR(tensorboard->write(samples, scalars).with_context("tensorboard"));
    if (csv_monitor) ZO_RETURN_IF_ERROR(csv_monitor->write(samples, scalars).with_context("csv_monitor"));
  }
  return Status::ok();
}

}  // namespace zo::engine

#include "engine/memory/optimizer_swapper.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "common/aligned_buffer.h"
#include "common/bytes.h"
#include "common/log.h"
#include "common/timer.h"
#include "common/trace.h"
#include "engine/memory/optimizer_swapper_impl.h"

namespace zo::engine {

// Note [Reading the states ahead]
// With clipping, a loss scale that may skip the step, or several windows per step, the optimizer
// needs the step's global norm before it updates anything, so it runs only after the backward (and,
// overlapped, beside the next forward: Note [Overlapped optimizer]). With the states on NVMe its
// reads need nothing of this step, only that the last step's writes are done: read_states_ahead()
// issues the reads of the first sub-groups step() will update (plan().stepped order), one per swap
// buffer, when the step begins, so they run under its forward and backward while the drive is
// otherwise idle, and step() finds them in their buffers. The buffers are the pipeline's own (1 +
// pipeline_read + pipeline_write) and zoffload.optimizer_read_ahead more, pinned memory the plan
// counts (Note [Pinned pool sizing]); each is one sub-group's record. The bytes are those step()
// would read, so nothing else changes: what is read is what the step would have read, the states
// are written only by step(), and a step that is skipped or fails before the optimizer leaves the
// buffers for the next one. It does not apply where the record holds the gradient (accumulators on
// NVMe: the backward is still writing it) or to a direct step (Note [No accumulator]), which reads
// as the gradients become final.

// Note [Where the gradients wait]
// The gradient accumulators need not live with the optimizer states (zoffload.gradient_accumulators).
// With the states on NVMe and the accumulators in RAM, a sub-group's record in the swap file is
// [master|exp_avg|exp_avg_sq] and Adam reads the gradient where it was accumulated: the step moves
// 4 bytes per element less each way through the drive. With the states in RAM and the accumulators
// on NVMe (a host too small for 16 bytes per parameter), the step reads sub-group i+1's accumulator
// into one of two read buffers while it updates i, so the drive read runs beside Adam. Either way
// the same kernel sees the same values: the weights are bit-identical to every other placement.

PipelineOptions PipelineOptions::from_config(const Config& config) {
  PipelineOptions options;
  options.pipeline_read = config.zero.offload_optimizer.pipeline_read;
  options.pipeline_write = config.zero.offload_optimizer.pipeline_write;
  options.optimizer = config.optimizer.type;
  return options;
}

Status OptimizerSwapper::Impl::update(uint32_t g, std::byte* p, std::byte* m, std::byte* v, const void* grad,
                                      void* copy_out) {
  trace::Span span(trace::Track::kOptimizer, [&] { return "sub-group " + std::to_string(g); });
  Stopwatch sw;
  Status st = update_step->update_host(
      store->registry(), g, update_args,
      {p, m, v, static_cast<const std::byte*>(grad), static_cast<std::byte*>(copy_out)}, *executor, fused_norm);
  report.update_s += sw.elapsed_s();
  return st;
}

Status OptimizerSwapper::Impl::step_device() {
  gpu::Device& device = store->device();
  Status first;
  const std::vector<uint32_t>& order = store->plan().stepped;  // as step_cpu's
  size_t i = 0;
  Stopwatch sw;
  for (; i < order.size(); ++i) {
    first = device_group(order[i]);
    if (!first.is_ok()) break;
    written = true;
  }
  // Kernels already queued run whatever happened to a later one: wait for them before returning.
  Status sync = device.synchronize(stream);
  report.update_s += sw.elapsed_s();
  if (!first.is_ok()) return first.with_context("sub-group " + std::to_string(order[i]));
  if (!sync.is_ok()) return sync.with_context("device Adam");
  report.sub_groups = static_cast<uint32_t>(order.size());
  for (uint32_t done : order) compute_ready(done);
  return Status::ok();
}
// Queues sub-group g's update on the device, as update() steps it on the CPU (SubGroupStep: the same
// kernels' arithmetic as cpu_optim's, so the states are bit-identical to the CPU tier's).
Status OptimizerSwapper::Impl::device_group(uint32_t g) {
  const DeviceStates states{loc(g, StateKind::kMaster).device, loc(g, StateKind::kExpAvg).device,
                            loc(g, StateKind::kExpAvgSq).device, loc(g, StateKind::kGradAccum).device,
                            loc(g, StateKind::kCompute).device};
  return update_step->update_device(store->registry(), g, update_args, states, store->device(), stream);
}

Status OptimizerSwapper::Impl::step_cpu() {
  // This rank's trainable sub-groups (all of them unless data parallel partitions them: Note
  // [Partitions]; never a frozen one: Note [Frozen sub-groups]).
  const std::vector<uint32_t>& order = store->plan().stepped;
  if (grads_on_nvme() && !order.empty()) {
    Status st = issue_grad_read(order[0], 0);
    if (!st.is_ok()) return st.with_context("sub-group " + std::to_string(order[0]));
  }
  for (size_t i = 0; i < order.size(); ++i) {
    const uint32_t g = order[i];
    const bool more = i + 1 < order.size();
    const std::byte* grad = loc(g, StateKind::kGradAccum).host;
    if (grads_on_nvme()) {
      Status st = wait_grad_read(i);
      if (st.is_ok() && more && grad_bufs.size() > 1) st = issue_grad_read(order[i + 1], i + 1);
      if (!st.is_ok()) return st.with_context("sub-group " + std::to_string(g));
      grad = grad_bufs[i % grad_bufs.size()].data();
    }
    ZO_RETURN_IF_ERROR(cpu_group(g, grad, [&]() -> Status {
      if (grads_on_nvme() && more && grad_bufs.size() == 1) {
        Status st = issue_grad_read(order[i + 1], i + 1);
        if (!st.is_ok()) return st.with_context("sub-group " + std::to_string(order[i + 1]));
      }
      return Status::ok();
    }));
  }
  return wait_busy_slots();
}

Status OptimizerSwapper::Impl::cpu_group(uint32_t g, const std::byte* grad,
                                         const std::function<Status()>& after_update) {
  const StateLocation& home = loc(g, StateKind::kCompute);
  std::byte* copy_out = home.host;
  Slot* slot = nullptr;
  int index = -1;
  if (home.tier != Tier::kCpu) {
    index = static_cast<int>(g % slots.size());
    slot = &slots[index];
    if (slot->state == Slot::State::kBusy) {
      Status st = wait_writes(*slot);
      if (!st.is_ok()) return st.with_context("sub-group " + std::to_string(slot->group));
    }
    copy_out = slot->buf.data();
  }
  Status st = update(g, loc(g, StateKind::kMaster).host, loc(g, StateKind::kExpAvg).host,
                     loc(g, StateKind::kExpAvgSq).host, grad, copy_out);
  if (!st.is_ok()) return st.with_context("sub-group " + std::to_string(g));
  written = true;
  if (after_update) ZO_RETURN_IF_ERROR(after_update());
  if (slot == nullptr) compute_ready(g);
  if (slot != nullptr) {
    slot->group = g;
    slot->state = Slot::State::kBusy;
    st = deliver_compute(*slot, g, copy_out, index);
    if (!st.is_ok()) return st.with_context("sub-group " + std::to_string(g));
    if (slots.size() == 1) {
      st = wait_writes(*slot);
      if (!st.is_ok()) return st.with_context("sub-group " + std::to_string(g));
    }
  }
  ++report.sub_groups;
  return Status::ok();
}

OptimizerSwapper::OptimizerSwapper(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
OptimizerSwapper::~OptimizerSwapper() = default;

Result<std::unique_ptr<OptimizerSwapper>> OptimizerSwapper::create(StateStore& store,
                                                                   const cpu_optim::Executor& executor,
                                                                   const PipelineOptions& options) {
  const MemoryPlan& plan = store.plan();
  const Placement& pl = plan.placement;
  if (options.norm_run_elems == 0 || options.norm_run_elems % cpu_optim::kTileElems != 0)
    return invalid_argument("optimizer: norm_run_elems " + std::to_string(options.norm_run_elems) +
                            " is not a positive multiple of " + std::to_string(cpu_optim::kTileElems));
  // The kernels (Note [One table of optimizer kernels]): Lion and Adagrad have none on the device.
  ZO_ASSIGN_OR_RETURN(
      SubGroupStep update_step,
      SubGroupStep::create(options.optimizer, pl, pl.optimizer == Tier::kDevice, options.norm_run_elems));
  if (pl.master_dtype != DType::kF32) {
    if (pl.master_dtype != DType::kBF16 || pl.compute_dtype != DType::kBF16)
      return unavailable("zoffload.master_dtype \"" + std::string(dtype_name(pl.master_dtype)) +
                         "\": bf16 masters with bf16 compute copies only (the compute dtype is " +
                         std::string(dtype_name(pl.compute_dtype)) + ")");
  }
  if (pl.grad != pl.optimizer && (pl.grad == Tier::kDevice || pl.optimizer == Tier::kDevice)) {
    return invalid_argument("optimizer swapper: gradients on " + std::string(tier_name(pl.grad)) +
                            " but optimizer states on " + std::string(tier_name(pl.optimizer)) +
                            " (the device's optimizer reads its accumulators on the device)");
  }
  auto impl = std::make_unique<Impl>();
  impl->store = &store;
  impl->executor = &executor;
  impl->options = options;
  impl->update_step = update_step;
  const uint32_t n_groups = plan.n_sub_groups;
  auto sec = [&](StateKind kind) {
    return align_up(max_group_state_bytes(pl, store.registry(), kind), kSwapAlignment);
  };
  bool device_compute = false, offloaded_compute = false;
  for (uint32_t g = 0; g < n_groups; ++g) {
    device_compute |= pl.compute[g] == Tier::kDevice;
    offloaded_compute |= pl.compute[g] != Tier::kCpu;
  }
  std::span<const std::span<std::byte>> buffers;
  if (pl.optimizer == Tier::kDevice) {
    for (uint32_t g = 0; g < n_groups; ++g) {
      if (pl.compute[g] != Tier::kDevice) {
        return invalid_argument(
            "zero_optimization.offload_param.device: compute copies off the device need the "
            "optimizer offloaded too (offload_optimizer.device cpu or nvme)");
      }
    }
  } else if (pl.optimizer == Tier::kNvme) {
    const uint32_t want = static_cast<uint32_t>(
        std::min<uint64_t>(1 + options.pipeline_read + options.pipeline_write, plan.stepped.size()));
    const uint64_t need = sec(StateKind::kMaster) + sec(StateKind::kExpAvg) + sec(StateKind::kExpAvgSq) +
                          (pl.grad == Tier::kNvme ? sec(StateKind::kGradAccum) : 0) + sec(StateKind::kCompute);
    buffers = store.optimizer_swap_buffers();
    if (buffers.size() < want) {
      return invalid_argument("zero_optimization.offload_optimizer: pipeline_read " +
                              std::to_string(options.pipeline_read) + " and pipeline_write " +
                              std::to_string(options.pipeline_write) + " need " + std::to_string(want) +
                              " optimizer swap buffers, the plan has " + std::to_string(buffers.size()));
    }
    for (auto b : buffers) {
      if (b.size() < need) {
        return invalid_argument("optimizer swap buffer of " + std::to_string(b.size()) + " bytes is smaller than the " +
                                std::to_string(need) + " bytes of the largest sub-group's sections");
      }
    }
  } else if (offloaded_compute) {
    buffers = store.compute_staging_buffers();
    if (buffers.empty()) return invalid_argument("optimizer swapper: the plan has no compute staging buffer");
    for (auto b : buffers) {
      if (b.size() < sec(StateKind::kCompute)) {
        return invalid_argument("compute staging buffer of " + std::to_string(b.size()) + " bytes is smaller than " +
                                std::to_string(sec(StateKind::kCompute)) + " bytes of the largest sub-group");
      }
    }
  }
  if (pl.optimizer == Tier::kCpu && pl.grad == Tier::kNvme) {
    if (plan.grad_read_buffers == 0 || plan.grad_read_buffer_bytes < sec(StateKind::kGradAccum)) {
      return invalid_argument("optimizer swapper: the plan's " + std::to_string(plan.grad_read_buffers) +
                              " gradient read buffer(s) of " + std::to_string(plan.grad_read_buffer_bytes) +
                              " bytes cannot hold the largest sub-group's " +
                              std::to_string(sec(StateKind::kGradAccum)) + " bytes");
    }
    for (uint32_t i = 0; i < plan.grad_read_buffers; ++i) {
      auto buf = AlignedBuffer::allocate(plan.grad_read_buffer_bytes);
      if (!buf.is_ok()) {
        return out_of_memory("gradient read buffer of " + format_bytes(plan.grad_read_buffer_bytes) + ": " +
                             buf.status().message());
      }
      impl->grad_bufs.push_back(std::move(buf).value());
    }
    impl->grad_reads.resize(impl->grad_bufs.size());
  }
  for (auto b : buffers) {
    Impl::Slot slot;
    slot.buf = b;
    impl->slots.push_back(std::move(slot));
  }
  gpu::Device& device = store.device();
  if (pl.optimizer == Tier::kDevice || device_compute) {
    ZO_ASSIGN_OR_RETURN(impl->stream, device.create_stream());
    for (size_t i = 0; i < impl->slots.size(); ++i) {
      ZO_ASSIGN_OR_RETURN(auto e, device.create_event());
      impl->events.push_back(e);
    }
  }
  return std::unique_ptr<OptimizerSwapper>(new OptimizerSwapper(std::move(impl)));
}

Result<OptimizerStepReport> OptimizerSwapper::step(const OptimizerStepArgs& args) {
  Impl& s = *impl_;
  const std::string step_name = "optimizer step " + std::to_string(args.step);
  if (!s.store->torn_reason().empty()) {
    return failed_precondition(step_name + ": the optimizer states are torn (" + s.store->torn_reason() +
                               "); restore them from a checkpoint first");
  }
  if (s.store->plan().placement.no_accumulator)
    return failed_precondition(step_name +
                               ": the plan has no gradient accumulators to step from (a direct step: "
                               "begin_direct, step_direct, end_direct)");
  // Checked before any sub-group is touched, so bad hyperparameters never tear the states.
  const UpdateArgs update_args{args.hyperparameters, args.step, args.grad_scale, args.rounding_seed};
  ZO_RETURN_IF_ERROR(check_update_args(step_name, s.options.optimizer, update_args));
  s.args = args;
  s.update_args = update_args;
  s.report = {};
  s.report.bytes_read = std::exchange(s.ahead_bytes_read, 0);
  s.written = false;
  Stopwatch total;
  Status st;
  switch (s.store->plan().placement.optimizer) {
    case Tier::kDevice: st = s.step_device(); break;
    case Tier::kCpu: st = s.step_cpu(); break;
    case Tier::kNvme: st = s.step_nvme(); break;
  }
  if (!st.is_ok()) return s.fail(std::move(st), step_name);
  s.report.total_s = total.elapsed_s();
  return s.report;
}

Status OptimizerSwapper::read_states_ahead() { return impl_->read_states_ahead(); }

Status OptimizerSwapper::begin_direct(const OptimizerStepArgs& args, std::vector<uint32_t> expected_order) {
  Impl& s = *impl_;
  const std::string step_name = "optimizer step " + std::to_string(args.step);
  if (s.direct_open) return failed_precondition(step_name + ": begin_direct while a direct step is open");
  const MemoryPlan& plan = s.store->plan();
  if (!plan.placement.no_accumulator || plan.placement.optimizer == Tier::kDevice ||
      (plan.partitioned() && !plan.partition_grads))
    return failed_precondition(step_name +
                               ": a direct step needs a plan with no accumulators, the optimizer states offloaded "
                               "(cpu or nvme) and, with several ranks, partitioned gradients "
                               "(zoffload.gradient_accumulators \"none\")");
  const uint32_t n_groups = plan.n_sub_groups;
  std::vector<char> listed(n_groups, 0);
  for (uint32_t g : expected_order) {
    if (g >= n_groups || listed[g])
      return invalid_argument(step_name + ": the expected order of sub-groups names " + std::to_string(g) +
                              (g >= n_groups ? " of " + std::to_string(n_groups) : " twice"));
    listed[g] = 1;
  }
  // A data-parallel rank steps its own partition only (Note [Partitions]), and nobody a frozen
  // sub-group (Note [Frozen sub-groups]).
  std::erase_if(expected_order, [&](uint32_t g) { return !plan.steps(g); });
  if (!s.store->torn_reason().empty()) {
    return failed_precondition(step_name + ": the optimizer states are torn (" + s.store->torn_reason() +
                               "); restore them from a checkpoint first");
  }
  const UpdateArgs update_args{args.hyperparameters, args.step, args.grad_scale, args.rounding_seed};
  ZO_RETURN_IF_ERROR(check_update_args(step_name, s.options.optimizer, update_args));
  s.args = args;
  s.update_args = update_args;
  s.report = {};
  s.written = false;
  s.direct_open = true;
  s.direct_failure = Status::ok();
  s.direct_name = step_name;
  s.direct_stepped.assign(n_groups, 0);
  s.direct_order = std::move(expected_order);
  s.direct_next = 0;
  s.direct_ahead = -1;
  if (s.store->plan().placement.optimizer == Tier::kNvme) {
    Status st = s.read_ahead();
    if (!st.is_ok()) {
      s.direct_open = false;
      s.drain();
      return st.with_context(step_name);
    }
  }
  return Status::ok();
}

Status OptimizerSwapper::step_direct(uint32_t sub_group, std::byte* grad, double* sum_sq) {
  Impl& s = *impl_;
  if (sum_sq == nullptr) return step_direct(sub_group, static_cast<const std::byte*>(grad));
  if (s.store->plan().placement.grad_dtype != DType::kF32)
    return invalid_argument("optimizer: step_direct with the gradient's norm needs fp32 gradients, not " +
                            std::string(dtype_name(s.store->plan().placement.grad_dtype)));
  s.fused_norm = sum_sq;
  Status st = step_direct(sub_group, grad);
  s.fused_norm = nullptr;
  return st;
}

Status OptimizerSwapper::step_direct(uint32_t sub_group, const std::byte* grad) {
  Impl& s = *impl_;
  if (!s.direct_open) return failed_precondition("optimizer: step_direct outside a direct step");
  if (!s.direct_failure.is_ok()) return s.direct_failure;
  if (sub_group >= s.store->plan().n_sub_groups)
    return invalid_argument(s.direct_name + ": sub-group " + std::to_string(sub_group) + " of " +
                            std::to_string(s.store->plan().n_sub_groups));
  if (s.direct_stepped[sub_group])
    return invalid_argument(s.direct_name + ": sub-group " + std::to_string(sub_group) + " was stepped already");
  if (!s.store->plan().owns(sub_group))
    return invalid_argument(s.direct_name + ": sub-group " + std::to_string(sub_group) +
                            " belongs to another rank's partition");
  if (s.store->plan().is_frozen(sub_group))
    return invalid_argument(s.direct_name + ": sub-group " + std::to_string(sub_group) +
                            " is frozen (it has no optimizer state)");
  Stopwatch sw;
  Status st;
  if (s.store->plan().placement.optimizer == Tier::kNvme) {
    st = s.nvme_group(sub_group, grad);
  } else {
    s.direct_stepped[sub_group] = 1;
    st = s.cpu_group(sub_group, grad, {});
  }
  s.report.total_s += sw.elapsed_s();
  if (!st.is_ok()) s.direct_failure = s.fail(std::move(st), s.direct_name);
  return s.direct_failure;
}

Result<OptimizerStepReport> OptimizerSwapper::end_direct() {
  Impl& s = *impl_;
  if (!s.direct_open) return failed_precondition("optimizer: end_direct without begin_direct");
  s.direct_open = false;
  if (!s.direct_failure.is_ok()) return s.direct_failure;
  Stopwatch sw;
  if (s.direct_ahead >= 0) {  // read ahead for a sub-group that never came (an incomplete step)
    Impl::Slot& ahead = s.slots[std::exchange(s.direct_ahead, -1)];
    (void)s.wait_reads(ahead);
    ahead.state = Impl::Slot::State::kFree;
  }
  Status st = s.wait_busy_slots();  // every busy buffer's writes, whatever the tier
  s.report.total_s += sw.elapsed_s();
  if (!st.is_ok()) return s.fail(std::move(st), s.direct_name);
  const auto owned = static_cast<uint32_t>(s.store->plan().stepped.size());
  if (s.report.sub_groups != owned) {
    // A sub-group never stepped: the step is incomplete (an abandoned backward); the others are new.
    Status incomplete = failed_precondition(std::to_string(s.report.sub_groups) + " of " + std::to_string(owned) +
                                            " sub-groups were stepped before the step ended");
    return s.fail(std::move(incomplete), s.direct_name);
  }
  return s.report;
}

}  // namespace zo::engine

// The NVMe side of OptimizerSwapper: the pipeline of swap buffers (reads, write-backs, the reads
// ahead), the delivery of compute copies to a device or NVMe home, and the gradient reads.
#include <algorithm>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "common/timer.h"
#include "engine/memory/optimizer_swapper_impl.h"

namespace zo::engine {

// Note [Optimizer pipeline buffer rotation]
// With the optimizer states on NVMe a step runs over the plan's swap buffers (1 + pipeline_read +
// pipeline_write of them, fewer only when there are fewer sub-groups). A buffer is free, reading
// sub-group j, holding j ready for its update, or busy: its write-back (master|exp_avg|exp_avg_sq in
// one request, plus the compute copy to the parameter file or the device) is in flight. Iteration i:
//   1. wait for the read of i (issued by iteration i−1 with pipeline_read, else issued now);
//   2. with pipeline_read, take a buffer for i+1 and issue its read, so it runs during 3;
//   3. Adam on i in its buffer (compute copy out into the buffer, or straight into a CPU home);
//   4. issue i's write-back; without pipeline_write wait for it here.
// "Take a buffer" picks a free one, else waits for the busy one whose write-back was issued first:
// a buffer is reused only after every write from it has completed. With both options and three
// buffers the write of i−1 is still in flight during the update of i, and it is waited for when
// iteration i+1 needs its buffer back — never earlier. Without the options the same loop degrades
// to read, update, write, one sub-group at a time. The CPU path double-buffers its compute staging
// the same way: buffer i mod 2 is reused only after the H2D copy or file write from it completed.

namespace {

std::string group_what(uint32_t g) { return "sub-group " + std::to_string(g) + " optimizer states"; }
std::string compute_what(uint32_t g) { return "sub-group " + std::to_string(g) + " compute copy"; }

}  // namespace

Status OptimizerSwapper::Impl::deliver_compute(Slot& slot, uint32_t g, std::byte* compute, int slot_index) {
  const StateLocation& home = loc(g, StateKind::kCompute);
  const uint64_t bytes = n_elems(g) * elem_bytes(StateKind::kCompute);
  if (home.tier == Tier::kDevice) {
    ZO_RETURN_IF_ERROR(store->device().copy_h2d(home.device, compute, bytes, stream));
    store->accounting().add_moved(Move::kHostToDevice, bytes);
    ZO_RETURN_IF_ERROR(store->device().record(events[slot_index], stream));
    slot.h2d_pending = true;
  } else if (home.tier == Tier::kNvme) {
    // The region is rounded up to kSwapAlignment; the padding after the copy is written as zeros.
    std::memset(compute + bytes, 0, home.region.size_bytes - bytes);
    SwapFile* file = store->param_file();
    ZO_ASSIGN_OR_RETURN(auto t, file->write_async(home.region, 0, {compute, home.region.size_bytes}, compute_what(g)));
    slot.writes.push_back({file, t, StateKind::kCompute, StateKind::kCompute});
    report.bytes_written += home.region.size_bytes;
  }
  return Status::ok();
}

Status OptimizerSwapper::Impl::wait_writes(Slot& slot) {
  Status first;
  Stopwatch sw;
  for (const auto& w : slot.writes) {
    Status st = w.file->wait(w.ticket);
    if (st.is_ok()) {
      for (int k = static_cast<int>(w.first); k <= static_cast<int>(w.last); ++k) {
        const auto kind = static_cast<StateKind>(k);
        store->mark_nvme_written(slot.group, kind, 0, loc(slot.group, kind).region.size_bytes);
      }
    } else if (first.is_ok()) {
      first = std::move(st);
    }
  }
  slot.writes.clear();
  report.write_wait_s += sw.elapsed_s();
  if (slot.h2d_pending) {
    Stopwatch tw;
    const size_t index = static_cast<size_t>(&slot - slots.data());
    Status st = store->device().synchronize(events[index]);
    if (!st.is_ok() && first.is_ok())
      first = st.with_context("H2D copy of sub-group " + std::to_string(slot.group) + " compute copy");
    slot.h2d_pending = false;
    report.transfer_s += tw.elapsed_s();
  }
  slot.state = Slot::State::kFree;
  if (first.is_ok() && loc(slot.group, StateKind::kCompute).tier != Tier::kCpu) compute_ready(slot.group);
  return first;
}

Status OptimizerSwapper::Impl::issue_grad_read(uint32_t g, size_t buf) {
  // The region is whole pages; bytes beyond what was written are zeros, as in issue_read.
  const SwapRegion r = loc(g, StateKind::kGradAccum).region;
  std::byte* dst = grad_bufs[buf % grad_bufs.size()].data();
  const uint64_t valid = std::min(store->nvme_written_bytes(g, StateKind::kGradAccum), r.size_bytes);
  std::memset(dst + valid, 0, r.size_bytes - valid);
  if (valid == 0) return Status::ok();
  ZO_ASSIGN_OR_RETURN(auto t, store->optimizer_file()->read_async(r, 0, {dst, valid}, group_what(g) + " (gradient)"));
  grad_reads[buf % grad_bufs.size()].push_back(t);
  report.bytes_read += valid;
  return Status::ok();
}

Status OptimizerSwapper::Impl::wait_grad_read(size_t buf) {
  Status first;
  Stopwatch sw;
  for (io::Ticket t : grad_reads[buf % grad_bufs.size()]) {
    Status st = store->optimizer_file()->wait(t);
    if (!st.is_ok() && first.is_ok()) first = std::move(st);
  }
  grad_reads[buf % grad_bufs.size()].clear();
  report.read_wait_s += sw.elapsed_s();
  return first;
}
Status OptimizerSwapper::Impl::read_ahead() {
  if (!options.pipeline_read || direct_ahead >= 0) return Status::ok();
  while (direct_next < direct_order.size() && direct_stepped[direct_order[direct_next]]) ++direct_next;
  if (direct_next == direct_order.size()) return Status::ok();
  const uint32_t next = direct_order[direct_next];
  ZO_ASSIGN_OR_RETURN(int index, take_slot());
  Status st = issue_read(slots[index], next);
  if (!st.is_ok()) return st.with_context("sub-group " + std::to_string(next));
  direct_ahead = index;
  return Status::ok();
}

Status OptimizerSwapper::Impl::nvme_group(uint32_t g, const std::byte* grad) {
  // Its record read ahead, or read now; a read ahead for another sub-group stays (it comes later).
  int current = -1;
  if (direct_ahead >= 0 && slots[direct_ahead].group == g) {
    current = std::exchange(direct_ahead, -1);
  } else {
    ZO_ASSIGN_OR_RETURN(current, take_slot());
    Status st = issue_read(slots[current], g);
    if (!st.is_ok()) return st.with_context("sub-group " + std::to_string(g));
  }
  Slot& slot = slots[current];
  if (slot.state == Slot::State::kReading) {
    Status st = wait_reads(slot);
    if (!st.is_ok()) return st.with_context("sub-group " + std::to_string(g));
  }
  direct_stepped[g] = 1;
  // The next one's read runs beside this update (a slot is free or writing: at most one reads ahead).
  ZO_RETURN_IF_ERROR(read_ahead());
  return update_in_slot(current, g, grad);
}

Status OptimizerSwapper::Impl::update_in_slot(int current, uint32_t g, const std::byte* grad) {
  Slot& slot = slots[current];
  const SwapRegion master = loc(g, StateKind::kMaster).region;
  auto section = [&](StateKind kind) {
    return slot.buf.data() + (loc(g, kind).region.offset_bytes - master.offset_bytes);
  };
  const StateKind last = grads_on_nvme() ? StateKind::kGradAccum : StateKind::kExpAvgSq;
  std::byte* compute_section = section(last) + loc(g, last).region.size_bytes;
  if (grad == nullptr) grad = grads_on_nvme() ? section(StateKind::kGradAccum) : loc(g, StateKind::kGradAccum).host;
  const StateLocation& home = loc(g, StateKind::kCompute);
  std::byte* copy_out = home.tier == Tier::kCpu ? home.host : compute_section;
  Status st = update(g, section(StateKind::kMaster), section(StateKind::kExpAvg), section(StateKind::kExpAvgSq), grad,
                     copy_out);
  if (!st.is_ok()) return st.with_context("sub-group " + std::to_string(g));
  written = true;
  if (home.tier == Tier::kCpu) compute_ready(g);
  st = issue_writes(slot, g);
  if (st.is_ok()) st = deliver_compute(slot, g, compute_section, current);
  if (st.is_ok() && !options.pipeline_write) st = wait_writes(slot);
  if (!st.is_ok()) return st.with_context("sub-group " + std::to_string(g));
  ++report.sub_groups;
  return Status::ok();
}

Status OptimizerSwapper::Impl::wait_busy_slots() {
  for (auto& slot : slots) {
    if (slot.state != Slot::State::kBusy) continue;
    Status st = wait_writes(slot);
    if (!st.is_ok()) return st.with_context("sub-group " + std::to_string(slot.group));
  }
  return Status::ok();
}

Status OptimizerSwapper::Impl::issue_read(Slot& slot, uint32_t g) {
  // The buffer mirrors the sub-group's record: [master|exp_avg|exp_avg_sq|grad] at the offsets they
  // have in the file, so the whole record is one read when it has been written before. Sections (or
  // their tails) beyond the zero watermark are zeroed in the buffer instead of read.
  // With the accumulators in RAM the record ends at exp_avg_sq (Note [Where the gradients wait]).
  const SwapRegion master = loc(g, StateKind::kMaster).region;
  const SwapRegion last = loc(g, grads_on_nvme() ? StateKind::kGradAccum : StateKind::kExpAvgSq).region;
  const SwapRegion record{master.offset_bytes, last.offset_bytes + last.size_bytes - master.offset_bytes};
  SwapFile* file = store->optimizer_file();
  slot.group = g;
  slot.state = Slot::State::kReading;
  uint64_t run_begin = 0, run_end = 0;  // a pending run of bytes to read, relative to the record
  auto flush = [&]() -> Status {
    if (run_end > run_begin) {
      ZO_ASSIGN_OR_RETURN(
          auto t, file->read_async(record, run_begin, slot.buf.subspan(run_begin, run_end - run_begin), group_what(g)));
      slot.reads.push_back(t);
      report.bytes_read += run_end - run_begin;
    }
    run_begin = run_end = 0;
    return Status::ok();
  };
  for (StateKind kind : {StateKind::kMaster, StateKind::kExpAvg, StateKind::kExpAvgSq, StateKind::kGradAccum}) {
    if (kind == StateKind::kGradAccum && !grads_on_nvme()) break;
    const SwapRegion r = loc(g, kind).region;
    const uint64_t rel = r.offset_bytes - record.offset_bytes;
    const uint64_t valid = std::min(store->nvme_written_bytes(g, kind), r.size_bytes);
    if (valid > 0) {
      if (run_end != rel) ZO_RETURN_IF_ERROR(flush());
      if (run_end == run_begin) run_begin = rel;
      run_end = rel + valid;
    }
    std::memset(slot.buf.data() + rel + valid, 0, r.size_bytes - valid);
  }
  return flush();
}

Status OptimizerSwapper::Impl::wait_reads(Slot& slot) {
  Status first;
  Stopwatch sw;
  for (io::Ticket t : slot.reads) {
    Status st = store->optimizer_file()->wait(t);
    if (!st.is_ok() && first.is_ok()) first = std::move(st);
  }
  slot.reads.clear();
  report.read_wait_s += sw.elapsed_s();
  slot.state = first.is_ok() ? Slot::State::kReady : Slot::State::kFree;
  return first;
}

Status OptimizerSwapper::Impl::issue_writes(Slot& slot, uint32_t g) {
  const SwapRegion master = loc(g, StateKind::kMaster).region;
  const SwapRegion v = loc(g, StateKind::kExpAvgSq).region;
  const SwapRegion states{master.offset_bytes, v.offset_bytes + v.size_bytes - master.offset_bytes};
  SwapFile* file = store->optimizer_file();
  slot.state = Slot::State::kBusy;
  slot.order = ++order;
  // The gradient section is not written back: the step leaves the accumulator unchanged.
  ZO_ASSIGN_OR_RETURN(auto t, file->write_async(states, 0, slot.buf.first(states.size_bytes), group_what(g)));
  slot.writes.push_back({file, t, StateKind::kMaster, StateKind::kExpAvgSq});
  report.bytes_written += states.size_bytes;
  return Status::ok();
}

Result<int> OptimizerSwapper::Impl::take_slot() {
  int oldest = -1;
  for (size_t i = 0; i < slots.size(); ++i) {
    if (slots[i].state == Slot::State::kFree) return static_cast<int>(i);
    if (slots[i].state == Slot::State::kBusy && (oldest < 0 || slots[i].order < slots[oldest].order)) {
      oldest = static_cast<int>(i);
    }
  }
  ZO_CHECK(oldest >= 0) << "optimizer pipeline: no buffer is free or writing (" << slots.size() << " buffers)";
  Status st = wait_writes(slots[oldest]);
  if (!st.is_ok()) return st.with_context("sub-group " + std::to_string(slots[oldest].group));
  return oldest;
}

Status OptimizerSwapper::Impl::step_nvme() {
  const std::vector<uint32_t>& order = store->plan().stepped;  // as step_cpu's
  if (order.empty()) return Status::ok();
  ZO_ASSIGN_OR_RETURN(int current, slot_for(order[0]));
  for (size_t i = 0; i < order.size(); ++i) {
    const uint32_t g = order[i];
    const bool more = i + 1 < order.size();
    Slot& slot = slots[current];
    Status st = wait_reads(slot);
    if (!st.is_ok()) return st.with_context("sub-group " + std::to_string(g));
    int next = -1;
    if (options.pipeline_read && more) { ZO_ASSIGN_OR_RETURN(next, slot_for(order[i + 1])); }
    ZO_RETURN_IF_ERROR(update_in_slot(current, g, nullptr));
    if (next < 0 && more) { ZO_ASSIGN_OR_RETURN(next, slot_for(order[i + 1])); }
    current = next;
  }
  return wait_busy_slots();
}

Result<int> OptimizerSwapper::Impl::slot_for(uint32_t g) {
  for (size_t i = 0; i < slots.size(); ++i) {
    if (slots[i].ahead && slots[i].group == g) {
      slots[i].ahead = false;
      return static_cast<int>(i);
    }
  }
  ZO_ASSIGN_OR_RETURN(int index, take_slot());
  Status st = issue_read(slots[index], g);
  if (!st.is_ok()) return st.with_context("sub-group " + std::to_string(g));
  return index;
}

Status OptimizerSwapper::Impl::read_states_ahead() {
  const MemoryPlan& plan = store->plan();
  if (plan.placement.optimizer != Tier::kNvme || plan.placement.no_accumulator || grads_on_nvme() ||
      !store->torn_reason().empty())
    return Status::ok();
  for (const Slot& slot : slots) {
    if (slot.ahead) return Status::ok();  // read already, for a step that has not run (skipped)
  }
  const std::vector<uint32_t>& order = plan.stepped;
  const uint64_t before = report.bytes_read;
  size_t j = 0;
  for (Slot& slot : slots) {
    if (j == order.size()) break;
    if (slot.state != Slot::State::kFree) continue;  // step() leaves none busy; be safe anyway
    Status st = issue_read(slot, order[j]);
    if (!st.is_ok()) {
      drain();
      return st.with_context("reading the optimizer states of sub-group " + std::to_string(order[j]) + " ahead");
    }
    slot.ahead = true;
    ++j;
  }
  ahead_bytes_read += report.bytes_read - before;
  return Status::ok();
}

void OptimizerSwapper::Impl::drain() {
  // After a failure: nothing may still be reading into or writing from a buffer, nor copying from
  // one, when step() returns. Errors of the drained requests add nothing to the first one.
  for (auto& slot : slots) {
    for (io::Ticket t : slot.reads) (void)store->optimizer_file()->wait(t);
    slot.reads.clear();
    for (const auto& w : slot.writes) (void)w.file->wait(w.ticket);
    slot.writes.clear();
    slot.h2d_pending = false;
    slot.ahead = false;
    slot.state = Slot::State::kFree;
  }
  ahead_bytes_read = 0;
  for (auto& reads : grad_reads) {
    for (io::Ticket t : reads) (void)store->optimizer_file()->wait(t);
    reads.clear();
  }
  if (stream) (void)store->device().synchronize(stream);
}

}  // namespace zo::engine

// The state of an OptimizerSwapper, shared by optimizer_swapper.cpp (construction, the step's
// paths, the direct step) and optimizer_swapper_io.cpp (the NVMe pipeline and the transfers of
// compute copies and gradients). Private to those two files; not thread-safe, as the swapper.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "common/aligned_buffer.h"
#include "common/status.h"
#include "engine/memory/optimizer_swapper.h"
#include "engine/memory/sub_group_step.h"

namespace zo::engine {

struct OptimizerSwapper::Impl {
  StateStore* store = nullptr;
  const cpu_optim::Executor* executor = nullptr;
  PipelineOptions options;
  std::optional<SubGroupStep> update_step;  // the arithmetic: every sub-group's update
  gpu::Stream stream;                       // the device's optimizer kernels and H2D copies of compute copies
  std::vector<gpu::Event> events;           // per swap / staging buffer: its H2D copy completed

  // One buffer of the NVMe pipeline or of the CPU path's compute staging.
  struct Slot {
    std::span<std::byte> buf;
    enum class State : uint8_t { kFree, kReading, kReady, kBusy } state = State::kFree;
    uint32_t group = 0;
    uint64_t order = 0;  // when its write-back was issued (oldest busy buffer is reused first)
    std::vector<io::Ticket> reads;
    struct Write {
      SwapFile* file;
      io::Ticket ticket;
      StateKind first, last;  // states it completes, for the zero watermark
    };
    std::vector<Write> writes;
    bool h2d_pending = false;
    bool ahead = false;  // read (kReading or kReady) by read_states_ahead for the next step()
  };
  std::vector<Slot> slots;
  uint64_t order = 0;
  // Gradient read buffers (accumulators on NVMe, states on the CPU; Note [Where the gradients wait]).
  std::vector<AlignedBuffer> grad_bufs;
  std::vector<std::vector<io::Ticket>> grad_reads;  // per buffer: its reads in flight

  // The step in progress: its arguments, and what every sub-group's update reads of them.
  OptimizerStepArgs args;
  UpdateArgs update_args;
  OptimizerStepReport report;
  bool written = false;  // some sub-group's home state has been modified

  uint64_t ahead_bytes_read = 0;  // by read_states_ahead, reported by the step() that uses them

  ~Impl() {
    // Reads ahead that no step() took are still landing in the store's buffers.
    for (auto& slot : slots) {
      for (io::Ticket t : slot.reads) (void)store->optimizer_file()->wait(t);
    }
    if (stream) store->device().destroy_stream(stream);
    for (auto e : events) store->device().destroy_event(e);
  }

  const StateLocation& loc(uint32_t g, StateKind kind) const { return store->location(g, kind); }
  uint64_t n_elems(uint32_t g) const { return store->registry().sub_groups()[g].n_elems; }
  uint64_t elem_bytes(StateKind kind) const { return state_elem_bytes(store->plan().placement, kind); }

  Status step_device();
  Status device_group(uint32_t g);
  Status step_cpu();
  Status step_nvme();
  // One sub-group of the CPU path from `grad` (its gradient in grad_dtype); after_update (may be
  // empty) runs once the kernels are done, before the compute copy is delivered.
  Status cpu_group(uint32_t g, const std::byte* grad, const std::function<Status()>& after_update);
  // Waits for every buffer's writes still in flight (the CPU path's compute copies, the NVMe
  // path's states and compute copies).
  Status wait_busy_slots();
  // The NVMe step's buffer for sub-group g: the one read_states_ahead filled for it, else a buffer
  // taken now with g's read issued.
  Result<int> slot_for(uint32_t g);
  Status read_states_ahead();
  // After a failure: drains, and marks the store torn when a sub-group was written.
  Status fail(Status st, const std::string& step_name) {
    drain();
    st.with_context(step_name);
    if (written) store->mark_torn(st.to_string());
    return st;
  }

  // A direct step in progress (Note [No accumulator]): begun, its first failure, the sub-groups
  // stepped, and with the states on NVMe the expected order and the one sub-group read ahead.
  bool direct_open = false;
  Status direct_failure;
  std::string direct_name;
  std::vector<char> direct_stepped;
  std::vector<uint32_t> direct_order;
  size_t direct_next = 0;  // direct_order[direct_next..]: not stepped yet, in expected order
  int direct_ahead = -1;   // the slot reading (or holding) a sub-group ahead, -1: none
  // Set by step_direct(g, grad, sum_sq) for its one sub-group: update() takes the gradient's
  // canonical squared norm as it reads it (Note [Gradients that land where they are summed]).
  double* fused_norm = nullptr;
  // One sub-group of a direct step with the states on NVMe (Note [No accumulator]).
  Status nvme_group(uint32_t g, const std::byte* grad);
  // The NVMe path's update of sub-group g, whose record is read into slots[current], and its
  // write-back: from `grad`, or (nullptr) from its accumulator (the record's section or RAM).
  Status update_in_slot(int current, uint32_t g, const std::byte* grad);
  // Reads the next expected sub-group ahead into a slot, when pipeline_read allows and none is.
  Status read_ahead();

  // One optimizer step of sub-group g on host spans (update_step's), timed into update_s. p holds
  // the masters (fp32 or bf16), m and v the moments, as group_state_bytes lays them out.
  Status update(uint32_t g, std::byte* p, std::byte* m, std::byte* v, const void* grad, void* copy_out);
  bool grads_on_nvme() const { return store->plan().placement.grad == Tier::kNvme; }
  Status issue_read(Slot& slot, uint32_t g);
  // Sub-group g's accumulator into gradient read buffer `buf` (the position of g in the order it is
  // stepped, modulo the buffers), and the wait for it.
  Status issue_grad_read(uint32_t g, size_t buf);
  Status wait_grad_read(size_t buf);
  Status wait_reads(Slot& slot);
  Status issue_writes(Slot& slot, uint32_t g);
  Status deliver_compute(Slot& slot, uint32_t g, std::byte* compute, int slot_index);
  Status wait_writes(Slot& slot);
  Result<int> take_slot();
  void compute_ready(uint32_t g) {
    if (args.on_compute_ready) args.on_compute_ready(g);
  }
  void drain();
};

}  // namespace zo::engine

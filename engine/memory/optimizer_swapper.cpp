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
#include "cpu_optim/adagrad.h"
#include "cpu_optim/adam8bit.h"
#include "cpu_optim/executor.h"
#include "cpu_optim/lion.h"
#include "cpu_optim/vector_ops.h"
#include "engine/memory/moment_layout.h"
#include "gpu/optim_kernels.h"

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

namespace {

std::string group_what(uint32_t g) { return "sub-group " + std::to_string(g) + " optimizer states"; }
std::string compute_what(uint32_t g) { return "sub-group " + std::to_string(g) + " compute copy"; }

}  // namespace

PipelineOptions PipelineOptions::from_config(const Config& config) {
  PipelineOptions options;
  options.pipeline_read = config.zero.offload_optimizer.pipeline_read;
  options.pipeline_write = config.zero.offload_optimizer.pipeline_write;
  options.optimizer = config.optimizer.type;
  return options;
}

struct OptimizerSwapper::Impl {
  StateStore* store = nullptr;
  const cpu_optim::Executor* executor = nullptr;
  PipelineOptions options;
  gpu::Stream stream;              // device Adam and H2D copies of compute copies
  std::vector<gpu::Event> events;  // per swap / staging buffer: its H2D copy completed

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

  // The step in progress.
  OptimizerStepArgs args;
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

  // One optimizer step of sub-group g on host spans (Adam, AdamW, Adagrad or Lion), timed into update_s.
  // p holds the masters (fp32 or bf16), m and v the moments, as group_state_bytes lays them out.
  Status update(uint32_t g, std::byte* p, std::byte* m, std::byte* v, const void* grad, void* copy_out);
  // fp32 or bf16 moments with bf16 masters, parameter piece by piece.
  Status update_bf16_master(uint32_t g, std::byte* p, std::byte* m, std::byte* v, const void* grad, void* copy_out);
  // Adam with 8-bit moments and either masters, piece by piece (Note [8-bit moment layout]).
  Status update_8bit(uint32_t g, std::byte* p, std::byte* m, std::byte* v, const void* grad, void* copy_out);
  // Piece `piece` of sub-group g's bf16 masters at p, its rounding keyed by the run's seed, the step
  // and its parameter and indexed by its offset in the parameter, so that a sub-group size or a
  // partition changes no bit (Note [Stochastic rounding to bf16]).
  cpu_optim::Bf16Master bf16_master(std::byte* p, const ParamPiece& piece) const {
    return {{reinterpret_cast<uint16_t*>(p) + piece.group_offset, piece.n_elems},
            sr_key(args.rounding_seed, static_cast<uint64_t>(args.step), piece.param),
            static_cast<uint32_t>(piece.param_offset)};
  }
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

namespace {

cpu_optim::AdagradConfig adagrad_config(const cpu_optim::AdamConfig& h) {
  return {.lr = h.lr, .eps = h.eps, .weight_decay = h.weight_decay};
}

cpu_optim::LionConfig lion_config(const cpu_optim::AdamConfig& h) {
  return {.lr = h.lr, .beta1 = h.beta1, .beta2 = h.beta2, .weight_decay = h.weight_decay};
}

}  // namespace

Status OptimizerSwapper::Impl::update_8bit(uint32_t g, std::byte* p_bytes, std::byte* m, std::byte* v, const void* grad,
                                           void* copy_out) {
  const Placement& pl = store->plan().placement;
  const bool bf16_masters = pl.master_dtype == DType::kBF16;
  auto* p = reinterpret_cast<float*>(p_bytes);  // fp32 masters
  const uint64_t gb = dtype_size_bytes(pl.grad_dtype), cb = dtype_size_bytes(pl.compute_dtype);
  const MomentLayout layout = moment_layout(store->registry(), g);
  // Lion's momentum is exp_avg, Adagrad's sum of squares exp_avg_sq (Note [One moment for Adagrad
  // and Lion]), each in the 8-bit layout; the other region stays the zero state.
  const bool lion = options.optimizer == OptimizerType::kLion, adagrad = options.optimizer == OptimizerType::kAdagrad;
  std::byte* one = lion ? m : v;
  for (const MomentPiece& mp : layout.pieces) {
    const uint64_t off = mp.piece->group_offset, n = mp.piece->n_elems;
    const cpu_optim::ConstElemSpan g_span{static_cast<const std::byte*>(grad) + off * gb, pl.grad_dtype};
    const cpu_optim::ElemSpan out_span{copy_out == nullptr ? nullptr : static_cast<std::byte*>(copy_out) + off * cb,
                                       pl.compute_dtype};
    const std::span<float> fp32{p + off, n};
    Status st;
    if (mp.quantized) {
      auto state = [&](std::byte* base) {
        return cpu_optim::BlockwiseState{{reinterpret_cast<uint8_t*>(base + mp.codes_offset_bytes), n},
                                         {reinterpret_cast<float*>(base + mp.aux_offset_bytes), mp.aux_bytes / 4}};
      };
      if (lion) {
        const cpu_optim::LionConfig c = lion_config(args.adam);
        st = bf16_masters ? cpu_optim::lion8bit_step_bf16_master(c, bf16_master(p_bytes, *mp.piece), state(one), g_span,
                                                                 args.grad_scale, out_span, *executor)
                          : cpu_optim::lion8bit_step(c, fp32, state(one), g_span, args.grad_scale, out_span, *executor);
      } else if (adagrad) {
        const cpu_optim::AdagradConfig c = adagrad_config(args.adam);
        st = bf16_masters
                 ? cpu_optim::adagrad8bit_step_bf16_master(c, bf16_master(p_bytes, *mp.piece), state(one), g_span,
                                                           args.grad_scale, out_span, *executor)
                 : cpu_optim::adagrad8bit_step(c, fp32, state(one), g_span, args.grad_scale, out_span, *executor);
      } else {
        st = bf16_masters
                 ? cpu_optim::adam8bit_step_bf16_master(args.adam, args.step, bf16_master(p_bytes, *mp.piece), state(m),
                                                        state(v), g_span, args.grad_scale, out_span, *executor)
                 : cpu_optim::adam8bit_step(args.adam, args.step, fp32, state(m), state(v), g_span, args.grad_scale,
                                            out_span, *executor);
      }
    } else {
      // bitsandbytes keeps a small parameter's state in fp32 and steps it with its 32-bit optimizer;
      // here it is the fp32 state's own step (torch's AdamW order, DeepSpeed's Adagrad and Lion), as
      // for every fp32 state (docs/cpu_optim.md).
      auto f32_state = [&](std::byte* base) { return reinterpret_cast<float*>(base + mp.aux_offset_bytes); };
      const cpu_optim::ElemSpan m_span{f32_state(m), DType::kF32}, v_span{f32_state(v), DType::kF32};
      if (lion) {
        const cpu_optim::LionConfig c = lion_config(args.adam);
        st = bf16_masters
                 ? cpu_optim::lion_step_bf16_master(c, bf16_master(p_bytes, *mp.piece), m_span, g_span, args.grad_scale,
                                                    out_span, *executor)
                 : cpu_optim::lion_step(c, fp32, {f32_state(m), n}, g_span, args.grad_scale, out_span, *executor);
      } else if (adagrad) {
        const cpu_optim::AdagradConfig c = adagrad_config(args.adam);
        st = bf16_masters
                 ? cpu_optim::adagrad_step_bf16_master(c, bf16_master(p_bytes, *mp.piece), v_span, g_span,
                                                       args.grad_scale, out_span, *executor)
                 : cpu_optim::adagrad_step(c, fp32, {f32_state(v), n}, g_span, args.grad_scale, out_span, *executor);
      } else if (bf16_masters) {
        st = cpu_optim::adam_step_bf16_master(args.adam, args.step, bf16_master(p_bytes, *mp.piece), m_span, v_span,
                                              g_span, args.grad_scale, out_span, *executor);
      } else {
        st = cpu_optim::adam_step(args.adam, args.step, fp32, {f32_state(m), n}, {f32_state(v), n}, g_span,
                                  args.grad_scale, out_span, *executor);
      }
    }
    if (!st.is_ok()) return st.with_context(store->registry().params()[mp.piece->param].name);
  }
  return Status::ok();
}

Status OptimizerSwapper::Impl::update_bf16_master(uint32_t g, std::byte* p, std::byte* m, std::byte* v,
                                                  const void* grad, void* copy_out) {
  const Placement& pl = store->plan().placement;
  const uint64_t gb = dtype_size_bytes(pl.grad_dtype), cb = dtype_size_bytes(pl.compute_dtype);
  const DType md = moment_elem_dtype(pl.moments);
  const uint64_t mb = dtype_size_bytes(md);
  for (const ParamPiece& piece : store->registry().pieces_of_group(g)) {
    const uint64_t off = piece.group_offset;
    const cpu_optim::ElemSpan ms{m + off * mb, md}, vs{v + off * mb, md};
    const cpu_optim::ConstElemSpan g_span{static_cast<const std::byte*>(grad) + off * gb, pl.grad_dtype};
    const cpu_optim::ElemSpan out_span{copy_out == nullptr ? nullptr : static_cast<std::byte*>(copy_out) + off * cb,
                                       pl.compute_dtype};
    const cpu_optim::Bf16Master master = bf16_master(p, piece);
    Status st;
    switch (options.optimizer) {
      case OptimizerType::kAdam:
      case OptimizerType::kAdamW:
        st = cpu_optim::adam_step_bf16_master(args.adam, args.step, master, ms, vs, g_span, args.grad_scale, out_span,
                                              *executor);
        break;
      case OptimizerType::kAdagrad:
        st = cpu_optim::adagrad_step_bf16_master(adagrad_config(args.adam), master, vs, g_span, args.grad_scale,
                                                 out_span, *executor);
        break;
      case OptimizerType::kLion:
        st = cpu_optim::lion_step_bf16_master(lion_config(args.adam), master, ms, g_span, args.grad_scale, out_span,
                                              *executor);
        break;
    }
    if (!st.is_ok()) return st.with_context(store->registry().params()[piece.param].name);
  }
  return Status::ok();
}

Status OptimizerSwapper::Impl::update(uint32_t g, std::byte* p_bytes, std::byte* m_bytes, std::byte* v_bytes,
                                      const void* grad, void* copy_out) {
  const uint64_t n = n_elems(g);
  trace::Span span(trace::Track::kOptimizer, [&] { return "sub-group " + std::to_string(g); });
  const Placement& pl = store->plan().placement;
  Stopwatch sw;
  if (copy_out == p_bytes) copy_out = nullptr;  // Note [A bf16 master is its compute copy]: updated in place
  // Only step_direct(g, grad, sum_sq) sets fused_norm, and its gradient is the caller's writable buffer.
  std::byte* canonical = fused_norm != nullptr ? const_cast<std::byte*>(static_cast<const std::byte*>(grad)) : nullptr;
  if (pl.moments == MomentDtype::k8bit || pl.master_dtype == DType::kBF16) {
    if (canonical != nullptr) {  // stepped piece by piece: the norm's pass comes first
      Result<double> sq = cpu_optim::squared_norm_canonical({canonical, pl.grad_dtype}, n, *executor);
      if (!sq.is_ok()) return sq.status();
      *fused_norm = *sq;
    }
    Status st = pl.moments == MomentDtype::k8bit ? update_8bit(g, p_bytes, m_bytes, v_bytes, grad, copy_out)
                                                 : update_bf16_master(g, p_bytes, m_bytes, v_bytes, grad, copy_out);
    report.update_s += sw.elapsed_s();
    return st;
  }
  const cpu_optim::AdamConfig& h = args.adam;
  const uint64_t gb = dtype_size_bytes(pl.grad_dtype), cb = dtype_size_bytes(pl.compute_dtype);
  // Elements [at, at + count) of the sub-group: every optimizer here is elementwise, so steps over
  // runs of it are bit-identical to one step over all of it.
  auto step_run = [&](uint64_t at, uint64_t count) -> Status {
    float* p = reinterpret_cast<float*>(p_bytes) + at;
    float* m = reinterpret_cast<float*>(m_bytes) + at;
    float* v = reinterpret_cast<float*>(v_bytes) + at;
    uint16_t* m16 = reinterpret_cast<uint16_t*>(m_bytes) + at;
    uint16_t* v16 = reinterpret_cast<uint16_t*>(v_bytes) + at;
    const cpu_optim::ConstElemSpan g_span{static_cast<const std::byte*>(grad) + at * gb, pl.grad_dtype};
    const cpu_optim::ElemSpan out_span{copy_out == nullptr ? nullptr : static_cast<std::byte*>(copy_out) + at * cb,
                                       pl.compute_dtype};
    const bool bf16 = pl.moments == MomentDtype::kBF16;
    // Note [One moment for Adagrad and Lion]: the store keeps both moment regions whatever the
    // optimizer; Adagrad's sum of squares lives in exp_avg_sq and Lion's momentum in exp_avg, the
    // other region stays zeros (written and checkpointed like any state).
    switch (options.optimizer) {
      case OptimizerType::kAdam:
      case OptimizerType::kAdamW:
        return bf16 ? cpu_optim::adam_step_bf16_moments(h, args.step, {p, count}, {m16, count}, {v16, count}, g_span,
                                                        args.grad_scale, out_span, *executor)
                    : cpu_optim::adam_step(h, args.step, {p, count}, {m, count}, {v, count}, g_span, args.grad_scale,
                                           out_span, *executor);
      case OptimizerType::kAdagrad: {
        const cpu_optim::AdagradConfig c = adagrad_config(h);
        return bf16 ? cpu_optim::adagrad_step_bf16_moments(c, {p, count}, {v16, count}, g_span, args.grad_scale,
                                                           out_span, *executor)
                    : cpu_optim::adagrad_step(c, {p, count}, {v, count}, g_span, args.grad_scale, out_span, *executor);
      }
      case OptimizerType::kLion: {
        const cpu_optim::LionConfig c = lion_config(h);
        return bf16 ? cpu_optim::lion_step_bf16_moments(c, {p, count}, {m16, count}, g_span, args.grad_scale, out_span,
                                                        *executor)
                    : cpu_optim::lion_step(c, {p, count}, {m, count}, g_span, args.grad_scale, out_span, *executor);
      }
    }
    return internal_error("optimizer: unknown optimizer type");
  };
  Status st;
  if (canonical == nullptr) {
    st = step_run(0, n);
  } else {
    // Note [Gradients that land where they are summed]: a run of tiles at a time, the norm's pass
    // (which rewrites −0 and signalling NaNs) then the update, which finds the run in cache. The
    // runs start at multiples of kTileElems, so the tile sums are squared_norm's, added in order.
    std::vector<double> tile_sums((n + cpu_optim::kTileElems - 1) / cpu_optim::kTileElems);
    for (uint64_t at = 0; at < n && st.is_ok(); at += options.norm_run_elems) {
      const uint64_t count = std::min(options.norm_run_elems, n - at);
      st = cpu_optim::squared_norm_canonical_tiles({canonical + at * gb, pl.grad_dtype}, count,
                                                   std::span<double>(tile_sums).subspan(at / cpu_optim::kTileElems),
                                                   *executor);
      if (st.is_ok()) st = step_run(at, count);
    }
    double sum = 0.0;
    for (double t : tile_sums) sum += t;
    *fused_norm = sum;
  }
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

// Queues sub-group g's update on the device, as update() steps it on the CPU: the whole group in one
// kernel with fp32 masters and fp32 or bf16 moments; per parameter piece with bf16 masters (each
// piece draws its parameter's rounding bits) or 8-bit moments (each piece's blocks are its own, or
// a small parameter's moments are fp32: Note [8-bit moment layout]). The same kernels' arithmetic
// as cpu_optim's, so the states are bit-identical to the CPU tier's.
Status OptimizerSwapper::Impl::device_group(uint32_t g) {
  gpu::Device& device = store->device();
  const Placement& pl = store->plan().placement;
  const bool bf16_masters = pl.master_dtype == DType::kBF16;
  gpu::DevicePtr params = loc(g, StateKind::kMaster).device;
  gpu::DevicePtr m = loc(g, StateKind::kExpAvg).device, v = loc(g, StateKind::kExpAvgSq).device;
  gpu::DevicePtr grad = loc(g, StateKind::kGradAccum).device;
  gpu::DevicePtr copy = loc(g, StateKind::kCompute).device;
  if (copy.addr == params.addr) copy = {};  // Note [A bf16 master is its compute copy]: updated in place
  const uint64_t pb = dtype_size_bytes(pl.master_dtype), gb = dtype_size_bytes(pl.grad_dtype),
                 cb = dtype_size_bytes(pl.compute_dtype);
  auto at = [](gpu::DevicePtr base, uint64_t offset) { return base ? base + offset : base; };
  auto adam_args = [&](uint64_t off, uint64_t n) {
    gpu::DeviceAdamArgs a;
    a.params = at(params, off * pb);
    a.param_dtype = pl.master_dtype;
    a.grad = at(grad, off * gb);
    a.grad_dtype = pl.grad_dtype;
    a.grad_scale = args.grad_scale;
    a.copy_out = at(copy, off * cb);
    a.copy_dtype = pl.compute_dtype;
    a.n_elems = n;
    a.config = args.adam;
    a.step = args.step;
    return a;
  };
  auto sr = [&](const ParamPiece& piece, uint32_t& key, uint32_t& first) {
    key = sr_key(args.rounding_seed, static_cast<uint64_t>(args.step), piece.param);
    first = static_cast<uint32_t>(piece.param_offset);
  };
  if (pl.moments == MomentDtype::k8bit) {
    for (const MomentPiece& mp : moment_layout(store->registry(), g).pieces) {
      const uint64_t off = mp.piece->group_offset, n = mp.piece->n_elems;
      Status st;
      if (mp.quantized) {
        gpu::DeviceAdam8bitArgs a{.params = at(params, off * pb),
                                  .param_dtype = pl.master_dtype,
                                  .m_codes = at(m, mp.codes_offset_bytes),
                                  .m_absmax = at(m, mp.aux_offset_bytes),
                                  .v_codes = at(v, mp.codes_offset_bytes),
                                  .v_absmax = at(v, mp.aux_offset_bytes),
                                  .grad = at(grad, off * gb),
                                  .grad_dtype = pl.grad_dtype,
                                  .grad_scale = args.grad_scale,
                                  .copy_out = at(copy, off * cb),
                                  .copy_dtype = pl.compute_dtype,
                                  .n_elems = n,
                                  .config = args.adam,
                                  .step = args.step};
        if (bf16_masters) sr(*mp.piece, a.sr_key, a.sr_first);
        st = gpu::optim_kernels(device).adam8bit_step(device, a, stream);
      } else {
        gpu::DeviceAdamArgs a = adam_args(off, n);
        if (bf16_masters) sr(*mp.piece, a.sr_key, a.sr_first);
        a.exp_avg = at(m, mp.aux_offset_bytes);
        a.exp_avg_sq = at(v, mp.aux_offset_bytes);
        st = gpu::optim_kernels(device).adam_step(device, a, stream);
      }
      if (!st.is_ok()) return st.with_context(store->registry().params()[mp.piece->param].name);
    }
    return Status::ok();
  }
  const uint64_t mb = dtype_size_bytes(moment_elem_dtype(pl.moments));
  if (!bf16_masters) {
    gpu::DeviceAdamArgs a = adam_args(0, n_elems(g));
    a.exp_avg = m;
    a.exp_avg_sq = v;
    a.moment_dtype = moment_elem_dtype(pl.moments);
    return gpu::optim_kernels(device).adam_step(device, a, stream);
  }
  for (const ParamPiece& piece : store->registry().pieces_of_group(g)) {
    gpu::DeviceAdamArgs a = adam_args(piece.group_offset, piece.n_elems);
    sr(piece, a.sr_key, a.sr_first);
    a.exp_avg = at(m, piece.group_offset * mb);
    a.exp_avg_sq = at(v, piece.group_offset * mb);
    a.moment_dtype = moment_elem_dtype(pl.moments);
    Status st = gpu::optim_kernels(device).adam_step(device, a, stream);
    if (!st.is_ok()) return st.with_context(store->registry().params()[piece.param].name);
  }
  return Status::ok();
}

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
  if (options.optimizer != OptimizerType::kAdam && options.optimizer != OptimizerType::kAdamW &&
      pl.optimizer == Tier::kDevice) {
    return unavailable("optimizer.type " + std::string(to_string(options.optimizer)) +
                       ": runs on the CPU only (the device's optimizer kernel is Adam's); set "
                       "zero_optimization.offload_optimizer.device to cpu or nvme");
  }
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
  ZO_RETURN_IF_ERROR(check_adam_hyperparameters(step_name, args.adam, args.step, args.grad_scale));
  s.args = args;
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
  ZO_RETURN_IF_ERROR(check_adam_hyperparameters(step_name, args.adam, args.step, args.grad_scale));
  s.args = args;
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

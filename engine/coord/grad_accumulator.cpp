#include "engine/coord/grad_accumulator.h"

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <optional>
#include <string>
#include <utility>

#include "common/aligned_buffer.h"
#include "common/bytes.h"
#include "common/timer.h"
#include "cpu_optim/vector_ops.h"
#include "engine/memory/pinned_pool.h"
#include "engine/memory/swap_file.h"

// Note [Accumulation arithmetic]
//
// Every element is updated as acc = round_to_grad_dtype(float(acc) + float(g)), one contribution
// at a time in arrival order, with acc read as +0 on the first contribution of a window
// (cpu_optim::accumulate, the same bits on every ISA and thread count). The CPU tier applies this in
// place; device and NVMe tiers apply it to a host buffer that holds the sub-group's accumulator in
// the grad dtype (read from its home except on the first micro-step, when every element is written
// by its param's first contribution, so the buffer needs neither reading nor zeroing) and write it
// back when the sub-group's last contribution arrived. Both paths run the same kernel calls on the
// same values. The norm is cpu_optim::squared_norm of each sub-group (its fixed tile order), added
// in the order sub-groups complete, so the report is bit-identical whatever the tier.

// Note [Gradients stored in 16 bits]
//
// With zoffload.gradient_store_dtype "bf16" and fp32 sums (data_types.grad_accum_dtype fp32) the
// accumulators are stored in bf16, two bytes per element instead of four, and the sums are still
// fp32 until they are final. The config allows it only where the host sees one window per step
// (GAS 1, or the vertical schedule, whose device sums the micro-batches in fp32), so every window
// is first and last. Each sub-group's contributions are then summed in an fp32 host buffer, on
// every tier (a tied param's two uses are one fp32 addition, as with fp32 accumulators); when the
// sub-group is complete its squared norm is taken from the fp32 values and only then are they
// rounded to bf16 (cpu_optim::convert, nearest even) into the accumulator's home: directly into
// CPU memory, or in place in the buffer, a chunk at a time through a small scratch, before the
// device or NVMe write. So the global norm, clipping coefficient and overflow check are exactly
// those of the fp32 gradient, and the optimizer reads round_to_bf16(fp32 sum): the gradient rounds
// once. Partitioned gradients (ZeRO stage 2, 3) are reduced over the ranks in fp32, in the buffer,
// and rounded by their owner after its chunk norms; at stage 1 the stored accumulators would be
// summed over the ranks, so the config refuses it with several ranks.

// Note [No accumulator]
//
// With zoffload.gradient_accumulators "none" (Placement::no_accumulator) the host keeps no gradient
// between backward and the optimizer. The config allows it only where nothing global is needed
// before an update — gradient_clipping 0, no step that an overflow would skip (fp32, or bf16 with
// check_grad_overflow false), one window per step (GAS 1 or the vertical schedule), and with several
// ranks partitioned gradients (ZeRO stage 2 or 3) — so a sub-group's gradient is final when its last
// contribution lands (and, with ranks, once it is reduced to its owner, which alone steps it). Each
// sub-group's contributions are then summed in a host buffer exactly as for an NVMe-resident
// accumulator (the same cpu_optim::accumulate calls from zero, in arrival order), its squared norm
// is taken for the report, it is rounded in place when stored gradients are 16-bit, and the buffer
// goes to the sink:
// the trainer's, which runs the optimizer on that sub-group (OptimizerSwapper::step_direct) on this
// thread while backward goes on, and the buffer is free again when it returns. The optimizer reads
// the values the stored path would have stored, with grad_scale 1/loss_scale either way (the clip
// coefficient is 1 without clipping), so the weights are bit-identical to it. What the host saves is
// every accumulator byte (4 per parameter in fp32); what it holds instead is the buffers of the
// sub-groups open at once (plan_buffers), the same as for NVMe-resident accumulators less the write
// behind. A buffer is not the landing ring itself: a sub-group spans parameters (and parts of them)
// that arrive in several ring items, and a tied parameter's two uses are one sum. With the
// optimizer states on NVMe the optimizer reads each sub-group's record when its gradient is final,
// and the next one's ahead in completion_order() (the order this simulates from the contribution
// order) while it updates, as the stored step's pipeline does in index order. With ranks, the reduce
// to the owner (Note [Partitioned gradients]) comes first, on this thread as for stored gradients;
// the owner takes its chunks' norms from the reduced fp32 sums, as flush_partitioned does, and the
// trainer sends the updated compute copies to the other ranks after backward (stage 2) or lets the
// next forward gather them from their owners (stage 3).

// Note [Gradients that land where they are summed]
//
// Without accumulators each sub-group is summed in a host buffer and stepped from it. Through the
// landing ring that costs a pass the optimizer could do without: the gradient is written into the
// ring by its copy from the device, then read from the ring and written into the buffer (acc =
// 0 + g), 12 bytes of host memory traffic per fp32 element (the buffer's write-allocate read
// included) on top of the optimizer's ~30. When the sums are fp32, the gradient arrives in fp32
// (the vertical schedule's device-side sums, or an fp32 model), the run is unpartitioned, and the
// contribution is its param's only one in the micro-step (not a tied matrix's two uses, which must
// be added), the copy from the device writes it where it is summed instead: GradWorker::submit asks
// reserve() for the runs of the sub-groups' buffers the param's pieces occupy and fills those, and
// the worker only counts the contribution (add_in_place). The buffers then come from the pinned
// pool, so the copy is DMA (MemoryPlan::landing_buffers), and the ring carries only the other
// contributions (sized for them by the planner).
//
// The buffers must then be claimed on the producer's thread, in submission order, for every
// contribution, in the ring or not: reserve() opens the param's sub-groups, waiting while every
// buffer is held. The count is the simulation's most sub-groups open at once (plan_buffers), so a
// wait always ends: the sub-groups holding buffers then include one whose contributions were all
// submitted, which the worker will flush. If the worker fails, it cancels the reservations so
// that a waiting producer returns its error.
//
// The bits stay those of the ring: accumulate from zero writes 0 + g, which differs from g only for
// −0 (0 + −0 = +0) and a signalling NaN (quieted). The squared norm every sub-group's sums get
// (cpu_optim::squared_norm_canonical) rewrites those elements as 0 + g in the tile it reads, before
// the tile's norm, so the optimizer and the norm see the ring's values. And the norm needs no pass
// of its own: the sink takes it (OptimizerSwapper::step_direct with sum_sq) in the update's pass,
// a run of 64 tiles at a time, the norm's scan of the run and then the update, which finds the
// run in cache; the runs start at multiples of kTileElems, so the tile sums and their order are
// squared_norm's. Where the sub-group is stepped piece by piece (8-bit moments, bf16 masters) the
// norm's pass comes before the update, and where the sums are rounded to a 16-bit store the
// accumulator takes it before rounding, as it does for sums that did not land in place.

// Note [Direct accumulator I/O]
//
// NVMe-resident accumulators are read and written with read_state_range/write_state_range: the
// buffers are 4 KiB-aligned, so their whole blocks go between the buffer and the swap file in one
// O_DIRECT transfer at the engine's queue depth, and only a tail shorter than a block goes through
// the store's 4 MiB scratch. read_state/write_state copied every byte through that scratch, one
// synchronous 4 MiB transfer after another: on an H200 machine's disk the gradient worker's writes
// kept it busy 68% of backward (llama3-8b, 29.9 GiB of accumulators per step in 17 s), while the
// optimizer's direct reads kept it busy throughout.
//
// Note [Asynchronous accumulator writes]
//
// Even direct, a synchronous write leaves the disk idle while the worker accumulates the next
// sub-group and the worker idle while the disk writes: on this project's 2-core VM (tinyllama-1.1b,
// accumulators on NVMe, seq 16) the disk wrote 1.66 s of the worker's 2.81 s in backward, and
// backward waited 0.9 s for the ring. So a completed NVMe-resident sub-group is queued with
// StateStore::write_state_async (its buffer padded to the region's whole blocks) and the worker goes
// on; the buffer returns to the free list when the write is finished, which happens when a sub-group
// needs a buffer and none is free (the oldest write first), and for all of them in finish_writes()
// (GradWorker::drain) and end_micro_step(), before anyone reads the accumulators. plan_buffers adds
// one buffer to the most sub-groups open at once, so that one write is always behind the
// accumulation. A failed write is reported where it is waited for, naming the sub-group, file and
// offset; the step fails as a failed synchronous write did. Device-resident and partitioned
// accumulators are still written synchronously.

namespace zo::engine {

struct GradAccumulator::Impl {
  StateStore* store = nullptr;
  const cpu_optim::Executor* executor = nullptr;
  DType grad_dtype = DType::kF32;  // the accumulators as stored
  uint64_t gb = 4;
  DType sum_dtype = DType::kF32;  // the additions (and the host buffers)
  uint64_t sb = 4;
  bool rounded = false;                    // Note [Gradients stored in 16 bits]
  std::optional<AlignedBuffer> narrowing;  // rounded, not CPU-resident: narrow_in_place's scratch
  bool in_place = false;                   // CPU-resident accumulators summed where they live: no buffers
  FinalGradSink sink;                      // Note [No accumulator]: set when there are no accumulators
  std::vector<uint32_t> uses;              // per param, per micro-step
  std::vector<uint32_t> group_total;       // per sub-group: contributions (over its params) per micro-step
  std::vector<uint32_t> completion;        // the sub-groups as they complete in the contribution order
  std::vector<AlignedBuffer> buffers;
  std::vector<std::span<std::byte>> pool_buffers;  // landing in place: the buffers, from the pinned pool
  ~Impl() {
    for (std::span<std::byte> b : pool_buffers) store->pool().free(b);
  }
  // Note [Gradients that land where they are summed]: group_buffer and free_buffers are shared by
  // the producer (reserve) and the worker (flush); claim_mu guards both.
  bool lands_in_place = false;
  std::mutex claim_mu;
  std::condition_variable freed;
  bool claims_cancelled = false;
  std::vector<uint32_t> reserved;  // per param: contributions reserved this micro-step (producer only)
  std::vector<int32_t> free_buffers;
  uint64_t buffer_bytes = 0;
  // Note [Partitioned gradients]
  ReducerOptions reducer;
  bool partitioned = false;
  std::optional<AlignedBuffer> home;  // an owned accumulator not in host memory, read to be added to
  std::vector<uint64_t> first_chunk;  // per sub-group: the index of its first norm chunk
  uint64_t n_chunks = 0;

  // The open micro-step.
  bool open = false;
  bool first = false;
  bool last = false;
  std::vector<uint32_t> received;       // per param
  std::vector<uint32_t> group_pending;  // per sub-group: contributions still to come
  std::vector<int32_t> group_buffer;    // per sub-group: buffer index while open, -1 otherwise
  GradNormReport report;
  // Note [Asynchronous accumulator writes]: queued writes, oldest first, with the buffer each holds.
  struct Writing {
    StateStore::PendingWrite write;
    int32_t buffer = -1;
  };
  std::deque<Writing> writing;

  // A failed write of sub-group g's accumulator, queued or synchronous (the store's status names the
  // file and offset).
  static Status write_failed(Status st, uint32_t g) {
    return st.with_context("gradient accumulator: writing sub-group " + std::to_string(g));
  }

  // Waits for the oldest queued write and frees its buffer.
  Status finish_oldest_write() {
    const Writing w = writing.front();
    writing.pop_front();
    Status st = store->finish_write(w.write);
    free_buffers.push_back(w.buffer);
    if (!st.is_ok()) return write_failed(std::move(st), w.write.sub_group);
    return Status::ok();
  }
  // Waits for every queued write (all of them, whatever fails); the first failure.
  Status finish_writes() {
    Status first_error;
    while (!writing.empty()) {
      Status st = finish_oldest_write();
      if (!st.is_ok() && first_error.is_ok()) first_error = st;
    }
    return first_error;
  }

  std::byte* buffer_data(int32_t b) { return pool_buffers.empty() ? buffers[b].data() : pool_buffers[b].data(); }
  std::span<std::byte> buffer_span(int32_t b) { return pool_buffers.empty() ? buffers[b].bytes() : pool_buffers[b]; }

  std::byte* group_bytes(uint32_t g) {
    if (in_place) return store->location(g, StateKind::kGradAccum).host;
    return buffer_data(group_buffer[g]);
  }

  void free_buffer(int32_t b) {
    {
      std::lock_guard<std::mutex> lock(claim_mu);
      free_buffers.push_back(b);
    }
    freed.notify_all();
  }

  Status narrow_in_place(std::byte* data, uint64_t n) {
    return engine::narrow_in_place(data, n, sum_dtype, grad_dtype, narrowing->bytes(), *executor);
  }

  // A contribution of `param` (`what`: "add of" or "reserve for"): a param of the registry, inside a
  // micro-step, size_bytes of a gradient dtype, and within its uses once `so_far` have come.
  Status check_contribution(const char* what, uint32_t param, uint64_t size_bytes, DType dtype, uint32_t so_far) {
    if (param >= uses.size())
      return invalid_argument(std::string("gradient accumulator: ") + what + " param id " + std::to_string(param) +
                              " (" + std::to_string(uses.size()) + " params)");
    const ParamInfo& info = store->registry().params()[param];
    const std::string where = std::string("gradient accumulator: ") + what + " " + info.name;
    if (!open) return failed_precondition(where + " outside a micro-step");
    if (dtype != DType::kF32 && dtype != DType::kBF16 && dtype != DType::kF16)
      return invalid_argument(where + ": unknown gradient dtype");
    const uint64_t eb = dtype_size_bytes(dtype);
    if (size_bytes != info.n_elems * eb)
      return invalid_argument(where + ": " + std::to_string(size_bytes) + " bytes, expected " +
                              std::to_string(info.n_elems) + " elements of " + std::string(dtype_name(dtype)) + " = " +
                              std::to_string(info.n_elems * eb) + " bytes");
    if (so_far >= uses[param])
      return invalid_argument("gradient accumulator: contribution " + std::to_string(so_far + 1) + " of " + info.name +
                              " beyond its " + std::to_string(uses[param]) + " use(s) per micro-step");
    return Status::ok();
  }

  // Whether a param's first contribution of this micro-step starts its elements from zero.
  bool starts_from_zero() const { return first || partitioned; }

  Status open_group(uint32_t g) {
    if (in_place) return Status::ok();
    std::unique_lock<std::mutex> lock(claim_mu);
    if (group_buffer[g] >= 0) return Status::ok();
    if (free_buffers.empty() && !writing.empty()) {
      lock.unlock();  // only without a sink, where no other thread claims
      ZO_RETURN_IF_ERROR(finish_oldest_write());
      lock.lock();
    }
    if (free_buffers.empty()) {
      return failed_precondition("gradient accumulator: all " + std::to_string(buffers.size() + pool_buffers.size()) +
                                 " host buffers are held by open sub-groups when sub-group " + std::to_string(g) +
                                 " opens; gradients must arrive in the contribution order given at create");
    }
    const int32_t b = free_buffers.back();
    free_buffers.pop_back();
    group_buffer[g] = b;
    lock.unlock();
    std::span<std::byte> bytes = buffer_span(b).first(store->state_bytes(g, StateKind::kGradAccum));
    if (starts_from_zero()) return Status::ok();  // every element is written by a first contribution
    Status st = store->read_state_range(g, StateKind::kGradAccum, 0, bytes);  // Note [Direct accumulator I/O]
    if (!st.is_ok()) {
      group_buffer[g] = -1;
      free_buffer(b);
      return st.with_context("gradient accumulator: reading sub-group " + std::to_string(g));
    }
    report.bytes_read += bytes.size();
    return Status::ok();
  }

  // Reduces the buffer to the owner (Note [Partitioned gradients]), which adds it to its
  // accumulator.
  Status flush_partitioned(uint32_t g) {
    const uint64_t bytes = store->state_bytes(g, StateKind::kGradAccum);
    const uint64_t n = bytes / gb;
    const int32_t b = group_buffer[g];
    std::byte* sums = buffers[b].data();  // in the sum dtype
    auto release = [&] {
      group_buffer[g] = -1;
      free_buffers.push_back(b);
    };
    Status st = reducer.reduce(g, sums, n);
    if (!st.is_ok()) {
      release();
      return st.with_context("gradient accumulator: reducing sub-group " + std::to_string(g));
    }
    if (!store->plan().owns(g)) {
      release();
      return Status::ok();
    }
    const StateLocation& loc = store->location(g, StateKind::kGradAccum);
    if (rounded) {
      st = flush_rounded(g, sums, n, loc);
      release();
      return st;
    }
    std::byte* acc = sums;  // the accumulator's new value, once combined
    if (loc.tier == Tier::kCpu) {
      acc = loc.host;
      st = cpu_optim::accumulate({acc, grad_dtype}, {sums, grad_dtype}, n, first, *executor);
    } else if (!first) {
      acc = home->data();
      st = store->read_state_range(g, StateKind::kGradAccum, 0, home->bytes().first(bytes));
      if (st.is_ok()) report.bytes_read += bytes;
      if (st.is_ok()) st = cpu_optim::accumulate({acc, grad_dtype}, {sums, grad_dtype}, n, false, *executor);
    }
    // (On the first micro-step the sums are the accumulator: round(0 + x) is x.)
    if (st.is_ok() && last) {
      for (uint64_t c = 0; c * reducer.chunk_elems < n; ++c) {
        const uint64_t at = c * reducer.chunk_elems, count = std::min(reducer.chunk_elems, n - at);
        Result<double> sq = cpu_optim::squared_norm({acc + at * gb, grad_dtype}, count, *executor);
        if (!sq.is_ok()) {
          st = sq.status();
          break;
        }
        report.chunk_sq[first_chunk[g] + c] = *sq;
      }
    }
    if (st.is_ok() && loc.tier != Tier::kCpu) {
      st = store->write_state_range(g, StateKind::kGradAccum, 0, {acc, bytes});
      if (st.is_ok()) report.bytes_written += bytes;
    }
    release();
    if (!st.is_ok()) return st.with_context("gradient accumulator: sub-group " + std::to_string(g));
    return Status::ok();
  }

  // Note [Gradients stored in 16 bits]: the owner's (or the only rank's) complete sums of sub-group
  // g at `sums` (sum dtype): their squared norm (per chunk when partitioned), then rounded into the
  // accumulator's home. Not for NVMe-resident accumulators of an unpartitioned run (flush_group
  // queues those). The caller releases the buffer.
  Status flush_rounded(uint32_t g, std::byte* sums, uint64_t n, const StateLocation& loc) {
    Status st;
    if (partitioned) {
      for (uint64_t c = 0; st.is_ok() && c * reducer.chunk_elems < n; ++c) {
        const uint64_t at = c * reducer.chunk_elems, count = std::min(reducer.chunk_elems, n - at);
        Result<double> sq = cpu_optim::squared_norm({sums + at * sb, sum_dtype}, count, *executor);
        if (sq.is_ok()) report.chunk_sq[first_chunk[g] + c] = *sq;
        st = sq.status();
      }
    } else {
      Result<double> sq = cpu_optim::squared_norm({sums, sum_dtype}, n, *executor);
      if (sq.is_ok()) {
        report.sum_sq += *sq;
        report.nonfinite = report.nonfinite || !std::isfinite(*sq);
      }
      st = sq.status();
    }
    if (!st.is_ok()) return st.with_context("gradient accumulator: norm of sub-group " + std::to_string(g));
    if (loc.tier == Tier::kCpu) {
      st = cpu_optim::convert({sums, sum_dtype}, {loc.host, grad_dtype}, n, *executor);
    } else {
      st = narrow_in_place(sums, n);
      if (st.is_ok()) st = store->write_state_range(g, StateKind::kGradAccum, 0, {sums, n * gb});
      if (st.is_ok()) report.bytes_written += n * gb;
    }
    if (!st.is_ok()) return st.with_context("gradient accumulator: storing sub-group " + std::to_string(g));
    return Status::ok();
  }

  // Note [No accumulator]: sub-group g's complete sums go to the sink, and its buffer is free again.
  Status flush_to_sink(uint32_t g) {
    const int32_t b = group_buffer[g];
    group_buffer[g] = -1;
    struct Free {
      Impl* s;
      int32_t b;
      ~Free() { s->free_buffer(b); }
    } free_on_return{this, b};
    const uint64_t n = store->registry().sub_groups()[g].n_elems;
    std::byte* sums = buffer_data(b);
    if (partitioned) {
      // The sums over the ranks go to the owner (Note [Partitioned gradients]), which alone steps
      // the sub-group; its chunks' squared norms are what owners_norm adds up over the ranks.
      Status st = reducer.reduce(g, sums, n);
      if (!st.is_ok()) return st.with_context("gradient accumulator: reducing sub-group " + std::to_string(g));
      if (!store->plan().owns(g)) return Status::ok();
      for (uint64_t c = 0; c * reducer.chunk_elems < n; ++c) {
        const uint64_t at = c * reducer.chunk_elems, count = std::min(reducer.chunk_elems, n - at);
        Result<double> sq = cpu_optim::squared_norm({sums + at * sb, sum_dtype}, count, *executor);
        if (!sq.is_ok())
          return Status(sq.status()).with_context("gradient accumulator: norm of sub-group " + std::to_string(g));
        report.chunk_sq[first_chunk[g] + c] = *sq;
      }
    } else if (lands_in_place && !rounded) {
      // Note [Gradients that land where they are summed]: the optimizer takes the norm (and turns
      // what landed in place into 0 + g) in the pass that reads the sums for the update.
      double sq = 0;
      Status st = sink(g, sums, &sq).with_context("sub-group " + std::to_string(g) + " stepped from its gradient");
      report.sum_sq += sq;
      report.nonfinite = report.nonfinite || !std::isfinite(sq);
      return st;
    } else {
      // What landed in place becomes 0 + g here, before the sums are rounded.
      Result<double> sq = lands_in_place ? cpu_optim::squared_norm_canonical({sums, sum_dtype}, n, *executor)
                                         : cpu_optim::squared_norm({sums, sum_dtype}, n, *executor);
      if (!sq.is_ok())
        return Status(sq.status()).with_context("gradient accumulator: norm of sub-group " + std::to_string(g));
      report.sum_sq += *sq;
      report.nonfinite = report.nonfinite || !std::isfinite(*sq);
    }
    if (rounded) {
      Status st = narrow_in_place(sums, n);
      if (!st.is_ok()) return st.with_context("gradient accumulator: rounding sub-group " + std::to_string(g));
    }
    return sink(g, sums, nullptr).with_context("sub-group " + std::to_string(g) + " stepped from its gradient");
  }

  Status flush_group(uint32_t g) {
    if (sink) return flush_to_sink(g);
    if (partitioned) return flush_partitioned(g);
    const uint64_t bytes = store->state_bytes(g, StateKind::kGradAccum);
    const StateLocation& loc = store->location(g, StateKind::kGradAccum);
    if (rounded && loc.tier != Tier::kNvme) {
      const int32_t b = group_buffer[g];
      Status st = flush_rounded(g, buffers[b].data(), bytes / gb, loc);
      group_buffer[g] = -1;
      free_buffers.push_back(b);
      return st;
    }
    if (last) {
      Result<double> sq = cpu_optim::squared_norm({group_bytes(g), sum_dtype}, bytes / gb, *executor);
      if (!sq.is_ok())
        return Status(sq.status()).with_context("gradient accumulator: norm of sub-group " + std::to_string(g));
      report.sum_sq += *sq;
      report.nonfinite = report.nonfinite || !std::isfinite(*sq);
    }
    if (in_place) return Status::ok();
    const int32_t b = group_buffer[g];
    if (loc.tier == Tier::kNvme) {  // Note [Asynchronous accumulator writes]
      group_buffer[g] = -1;
      if (rounded) {  // the norm above was the fp32 sums'
        Status st = narrow_in_place(buffers[b].data(), bytes / gb);
        if (!st.is_ok()) {
          free_buffers.push_back(b);
          return st.with_context("gradient accumulator: storing sub-group " + std::to_string(g));
        }
      }
      const uint64_t padded = store->padded_state_bytes(g, StateKind::kGradAccum);
      std::memset(buffers[b].data() + bytes, 0, padded - bytes);  // the region's padding, as the store writes it
      Result<StateStore::PendingWrite> queued =
          store->write_state_async(g, StateKind::kGradAccum, buffers[b].bytes().first(padded));
      if (!queued.is_ok()) {
        free_buffers.push_back(b);
        return write_failed(queued.status(), g);
      }
      writing.push_back({*queued, b});
      report.bytes_written += bytes;
      return Status::ok();
    }
    Status st = store->write_state_range(g, StateKind::kGradAccum, 0, buffers[b].bytes().first(bytes));
    group_buffer[g] = -1;
    free_buffers.push_back(b);
    if (!st.is_ok()) return write_failed(std::move(st), g);
    report.bytes_written += bytes;
    return Status::ok();
  }

  void reset_step() {
    (void)finish_writes();  // a failure is the step's, already reported (or abandoned)
    {
      std::lock_guard<std::mutex> lock(claim_mu);
      for (uint32_t g = 0; g < group_buffer.size(); ++g) {
        if (group_buffer[g] >= 0) free_buffers.push_back(group_buffer[g]);
        group_buffer[g] = -1;
      }
      std::sort(free_buffers.begin(), free_buffers.end(), std::greater<>());
      claims_cancelled = false;
    }
    freed.notify_all();
    open = false;
  }
};

GradAccumulator::GradAccumulator(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
GradAccumulator::~GradAccumulator() {
  // Note [Asynchronous accumulator writes]: no write may still read a buffer freed below.
  if (impl_) (void)impl_->finish_writes();
}

Result<std::unique_ptr<GradAccumulator>> GradAccumulator::create(StateStore& store,
                                                                 std::vector<uint32_t> contribution_order,
                                                                 const cpu_optim::Executor& executor,
                                                                 ReducerOptions reducer, FinalGradSink sink) {
  const ParamRegistry& registry = store.registry();
  auto impl = std::make_unique<Impl>();
  Impl& s = *impl;
  s.store = &store;
  s.executor = &executor;
  const Placement& pl = store.plan().placement;
  s.grad_dtype = pl.grad_dtype;
  s.gb = dtype_size_bytes(s.grad_dtype);
  s.sum_dtype = pl.grad_sum_dtype;
  s.sb = dtype_size_bytes(s.sum_dtype);
  s.rounded = pl.grads_rounded();
  s.partitioned = static_cast<bool>(reducer.reduce);
  if (s.partitioned != store.plan().partition_grads)
    return invalid_argument(std::string("gradient accumulator: ") +
                            (s.partitioned ? "a reducer for a store that holds every accumulator"
                                           : "the store holds one partition's accumulators but no reducer was given"));
  if (s.partitioned && reducer.chunk_elems == 0) return invalid_argument("gradient accumulator: chunk_elems 0");
  s.reducer = std::move(reducer);
  if (static_cast<bool>(sink) != pl.no_accumulator)
    return invalid_argument(std::string("gradient accumulator: ") +
                            (pl.no_accumulator ? "the plan has no accumulators but no sink takes the final gradients"
                                               : "a sink for final gradients, but the plan has accumulators"));
  s.sink = std::move(sink);
  s.in_place = pl.grad == Tier::kCpu && !s.partitioned && !s.rounded && !pl.no_accumulator;
  const uint32_t n_params = static_cast<uint32_t>(registry.params().size());
  const uint32_t n_groups = static_cast<uint32_t>(registry.sub_groups().size());
  s.uses.assign(n_params, 0);
  for (uint32_t p : contribution_order) {
    if (p >= n_params) {
      return invalid_argument("gradient accumulator: contribution order names param id " + std::to_string(p) +
                              " but the registry has " + std::to_string(n_params) + " params");
    }
    ++s.uses[p];
  }
  for (uint32_t p = 0; p < n_params; ++p) {
    const ParamInfo& info = registry.params()[p];
    if (s.uses[p] == 0 && info.trainable) {
      return invalid_argument("gradient accumulator: param " + info.name +
                              " never appears in the contribution order (every trainable param needs a gradient)");
    }
    if (s.uses[p] > 0 && !info.trainable)  // Note [Frozen sub-groups]: it has no accumulator
      return invalid_argument("gradient accumulator: param " + info.name + " is frozen but has a gradient");
  }
  s.group_total.assign(n_groups, 0);
  for (uint32_t p = 0; p < n_params; ++p) {
    for (const ParamPiece& piece : registry.pieces_of_param(p)) s.group_total[piece.sub_group] += s.uses[p];
  }
  std::vector<uint32_t> pending = s.group_total;
  for (uint32_t p : contribution_order) {
    for (const ParamPiece& piece : registry.pieces_of_param(p))
      if (--pending[piece.sub_group] == 0) s.completion.push_back(piece.sub_group);
  }
  BufferPlan bp = plan_buffers(registry, store.plan().placement, contribution_order, s.partitioned);
  s.buffer_bytes = bp.bytes_each;
  if (bp.narrowing_bytes > 0) {
    ZO_ASSIGN_OR_RETURN(AlignedBuffer scratch, AlignedBuffer::allocate(bp.narrowing_bytes));
    s.narrowing.emplace(std::move(scratch));
  }
  if (s.partitioned && pl.grad != Tier::kCpu && !s.rounded) {
    --bp.count;
    ZO_ASSIGN_OR_RETURN(AlignedBuffer home, AlignedBuffer::allocate(s.buffer_bytes));
    s.home.emplace(std::move(home));
  }
  if (s.partitioned) {
    for (const SubGroup& g : registry.sub_groups()) {
      s.first_chunk.push_back(s.n_chunks);
      if (g.trainable) s.n_chunks += (g.n_elems + s.reducer.chunk_elems - 1) / s.reducer.chunk_elems;
    }
  }
  // Note [Gradients that land where they are summed]: the plan put the buffers in the pinned pool.
  const MemoryPlan& mp = store.plan();
  s.lands_in_place = mp.landing_buffers > 0;
  if (s.lands_in_place && (mp.landing_buffers != bp.count || mp.landing_buffer_bytes < s.buffer_bytes || !s.sink ||
                           s.partitioned || s.sum_dtype != DType::kF32))
    return invalid_argument("gradient accumulator: the plan's " + std::to_string(mp.landing_buffers) +
                            " landing buffers of " + format_bytes(mp.landing_buffer_bytes) + " are not the " +
                            std::to_string(bp.count) + " of " + format_bytes(s.buffer_bytes) +
                            " fp32 sums an unpartitioned run without accumulators needs");
  for (uint32_t i = 0; i < bp.count; ++i) {
    if (s.lands_in_place) {
      ZO_ASSIGN_OR_RETURN(std::span<std::byte> buf,
                          store.pool().allocate(s.buffer_bytes, "gradient landing buffer " + std::to_string(i)));
      s.pool_buffers.push_back(buf);
    } else {
      ZO_ASSIGN_OR_RETURN(AlignedBuffer buf, AlignedBuffer::allocate(s.buffer_bytes));
      s.buffers.push_back(std::move(buf));
    }
  }
  for (int32_t i = static_cast<int32_t>(bp.count) - 1; i >= 0; --i) s.free_buffers.push_back(i);
  s.received.assign(n_params, 0);
  s.reserved.assign(n_params, 0);
  s.group_pending.assign(n_groups, 0);
  s.group_buffer.assign(n_groups, -1);
  return std::unique_ptr<GradAccumulator>(new GradAccumulator(std::move(impl)));
}

Status GradAccumulator::begin_micro_step(bool first, bool last) {
  Impl& s = *impl_;
  if (s.open) {
    return failed_precondition(
        "gradient accumulator: begin_micro_step while a micro-step is open "
        "(end_micro_step has not succeeded; abandon_micro_step drops it)");
  }
  if (s.sink && !(first && last)) {
    return failed_precondition(
        "gradient accumulator: with no accumulators each gradient goes to the optimizer once final, so every "
        "micro-step must be the step's only window (first and last); gradient_accumulators \"none\" needs GAS 1 "
        "or the vertical schedule");
  }
  if (s.rounded && !(first && last)) {
    return failed_precondition(
        "gradient accumulator: stored gradients are rounded once final, so every micro-step must be the "
        "step's only window (first and last); gradient_store_dtype needs GAS 1 or the vertical schedule");
  }
  s.open = true;
  s.first = first;
  s.last = last;
  std::fill(s.received.begin(), s.received.end(), 0);
  std::fill(s.reserved.begin(), s.reserved.end(), 0);
  s.group_pending = s.group_total;
  s.report = GradNormReport{};
  if (s.partitioned && last) s.report.chunk_sq.assign(s.n_chunks, 0.0);
  return Status::ok();
}

Status GradAccumulator::add(uint32_t param, std::span<const std::byte> grad, DType dtype) {
  Impl& s = *impl_;
  Stopwatch timer;
  const ParamRegistry& registry = s.store->registry();
  ZO_RETURN_IF_ERROR(
      s.check_contribution("add of", param, grad.size(), dtype, param < s.received.size() ? s.received[param] : 0));
  const ParamInfo& info = registry.params()[param];
  const uint64_t eb = dtype_size_bytes(dtype);
  const bool from_zero = s.starts_from_zero() && s.received[param] == 0;
  const auto pieces = registry.pieces_of_param(param);
  for (const ParamPiece& piece : pieces) {
    Status st = s.open_group(piece.sub_group);
    if (!st.is_ok()) {
      s.report.offload_s += timer.elapsed_s();
      return st.with_context("add of " + info.name);
    }
  }
  for (const ParamPiece& piece : pieces) {
    std::byte* acc = s.group_bytes(piece.sub_group) + piece.group_offset * s.sb;
    Status st = cpu_optim::accumulate({acc, s.sum_dtype}, {grad.data() + piece.param_offset * eb, dtype}, piece.n_elems,
                                      from_zero, *s.executor);
    if (!st.is_ok()) {
      s.report.offload_s += timer.elapsed_s();
      return st.with_context("add of " + info.name);
    }
  }
  ++s.received[param];
  Status result;
  for (const ParamPiece& piece : pieces) {
    if (--s.group_pending[piece.sub_group] != 0) continue;
    Status st = s.flush_group(piece.sub_group);
    if (!st.is_ok() && result.is_ok()) result = st.with_context("add of " + info.name);
  }
  s.report.offload_s += timer.elapsed_s();
  return result;
}

Result<LandingRuns> GradAccumulator::reserve(uint32_t param, DType dtype, uint64_t size_bytes) {
  Impl& s = *impl_;
  if (!s.sink) return LandingRuns{};  // the worker opens sub-groups as contributions arrive
  const ParamRegistry& registry = s.store->registry();
  ZO_RETURN_IF_ERROR(
      s.check_contribution("reserve for", param, size_bytes, dtype, param < s.reserved.size() ? s.reserved[param] : 0));
  const ParamInfo& info = registry.params()[param];
  const auto pieces = registry.pieces_of_param(param);
  {
    std::unique_lock<std::mutex> lock(s.claim_mu);
    for (const ParamPiece& piece : pieces) {
      if (s.group_buffer[piece.sub_group] >= 0) continue;
      s.freed.wait(lock, [&] { return s.claims_cancelled || !s.free_buffers.empty(); });
      if (s.claims_cancelled)
        return failed_precondition("gradient accumulator: reserve for " + info.name +
                                   " after the micro-step's adds failed");
      s.group_buffer[piece.sub_group] = s.free_buffers.back();
      s.free_buffers.pop_back();
    }
  }
  ++s.reserved[param];
  // Note [Gradients that land where they are summed]: a tied matrix's uses are added in the ring.
  if (!s.lands_in_place || dtype != s.sum_dtype || s.uses[param] != 1) return LandingRuns{};
  LandingRuns runs;
  for (const ParamPiece& piece : pieces)  // the sub-group cannot be flushed before this contribution is added
    runs.push_back({s.buffer_data(s.group_buffer[piece.sub_group]) + piece.group_offset * s.sb, piece.n_elems * s.sb});
  return runs;
}

Status GradAccumulator::add_in_place(uint32_t param) {
  Impl& s = *impl_;
  Stopwatch timer;
  if (param >= s.uses.size())
    return invalid_argument("gradient accumulator: add_in_place of param id " + std::to_string(param));
  const ParamInfo& info = s.store->registry().params()[param];
  if (!s.open) return failed_precondition("gradient accumulator: add of " + info.name + " outside a micro-step");
  if (!s.lands_in_place || s.uses[param] != 1 || s.received[param] != 0 || s.reserved[param] != 1)
    return failed_precondition("gradient accumulator: " + info.name + " was not reserved to land in place");
  ++s.received[param];
  Status result;
  for (const ParamPiece& piece : s.store->registry().pieces_of_param(param)) {
    if (--s.group_pending[piece.sub_group] != 0) continue;
    Status st = s.flush_group(piece.sub_group);
    if (!st.is_ok() && result.is_ok()) result = st.with_context("add of " + info.name);
  }
  s.report.offload_s += timer.elapsed_s();
  return result;
}

void GradAccumulator::cancel_reservations() {
  Impl& s = *impl_;
  {
    std::lock_guard<std::mutex> lock(s.claim_mu);
    s.claims_cancelled = true;
  }
  s.freed.notify_all();
}

Result<GradNormReport> GradAccumulator::end_micro_step() {
  Impl& s = *impl_;
  if (!s.open) return failed_precondition("gradient accumulator: end_micro_step without begin_micro_step");
  const ParamRegistry& registry = s.store->registry();
  std::string missing;
  uint32_t n_missing = 0;
  for (uint32_t p = 0; p < s.uses.size(); ++p) {
    if (s.received[p] == s.uses[p]) continue;
    if (++n_missing <= 8) {
      missing += (missing.empty() ? "" : ", ") + registry.params()[p].name + " (" + std::to_string(s.received[p]) +
                 " of " + std::to_string(s.uses[p]) + ")";
    }
  }
  if (n_missing > 0) {
    if (n_missing > 8) missing += " and " + std::to_string(n_missing - 8) + " more";
    return failed_precondition("gradient accumulator: end_micro_step with " + std::to_string(n_missing) +
                               " param(s) missing contributions: " + missing);
  }
  // Note [Asynchronous accumulator writes]: every write is finished before anyone reads them; a
  // failure leaves the micro-step open (abandon_micro_step drops it).
  ZO_RETURN_IF_ERROR(s.finish_writes());
  s.reset_step();
  if (s.partitioned) {
    for (double sq : s.report.chunk_sq) s.report.sum_sq += sq;
    s.report.nonfinite = !std::isfinite(s.report.sum_sq);
  }
  return s.report;
}

void GradAccumulator::abandon_micro_step() { impl_->reset_step(); }

Status GradAccumulator::finish_writes() { return impl_->finish_writes(); }

const std::vector<uint32_t>& GradAccumulator::completion_order() const { return impl_->completion; }
uint32_t GradAccumulator::buffer_count() const { return static_cast<uint32_t>(impl_->buffers.size()); }
uint64_t GradAccumulator::buffer_bytes() const { return impl_->buffer_bytes; }
uint32_t GradAccumulator::queued_writes() const { return static_cast<uint32_t>(impl_->writing.size()); }

}  // namespace zo::engine

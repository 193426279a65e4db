// GradAccumulator: adds each micro-step's gradients (host memory, fp32/bf16/fp16) into the
// gradient accumulators of the StateStore (StateKind::kGradAccum, in the grad dtype) wherever they
// live — in place on the CPU, through bounded host buffers for device and NVMe — and at the
// accumulation boundary reports Σ g² and overflow over the accumulated values. Synchronous; not
// thread-safe (one thread drives it, like the store).
//
// No zeroing pass: the optimizer step (OptimizerSwapper) reads the accumulators and leaves them
// unchanged; the next accumulation window starts with begin_micro_step(first = true), which makes
// every accumulator start from zero without reading (or writing) its old contents.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "common/dtype.h"
#include "common/status.h"
#include "cpu_optim/executor.h"
#include "engine/memory/state_store.h"

namespace zo::engine {

struct GradNormReport {
  // Σ g² over every accumulated gradient element (fp64), as the accumulators hold them (still
  // multiplied by the loss scale). Only filled at the last micro-step (0 otherwise).
  double sum_sq = 0;
  // With a Reducer (partitioned gradients), at the last micro-step: Σ g² of each chunk of
  // ReducerOptions::chunk_elems elements of each sub-group, in sub-group order, filled for the
  // sub-groups this rank holds and 0 for the others (sum_sq is their sum in that order).
  std::vector<double> chunk_sq;
  bool nonfinite = false;  // any inf/nan in the accumulated gradients (overflow); last micro-step only
  double offload_s = 0;    // wall time in add() and the flushes of this micro-step
  // Bytes of accumulators moved between their home tier (device, NVMe) and the host buffers.
  uint64_t bytes_read = 0, bytes_written = 0;
};

// Note [Partitioned gradients] (ZeRO stage 2): a data-parallel rank holds the accumulators of its
// own sub-groups only. Every sub-group then collects one micro-step's contributions in a host
// buffer from zero, and when they are complete `reduce` sums the buffer over the ranks into the
// owner's copy (a collective: called on add()'s thread, in the same order on every rank, since the
// contribution order is the same); the owner adds it to its accumulator (acc = round(acc + sum),
// the sum itself on the first micro-step) and the other ranks drop it.
struct ReducerOptions {
  // In place, sub-group g's n_elems sums of this rank; on return the owner's hold every rank's sum.
  std::function<Status(uint32_t sub_group, std::byte* data, uint64_t n_elems)> reduce;
  uint64_t chunk_elems = uint64_t{1} << 22;  // GradNormReport::chunk_sq's chunks
};

// Note [No accumulator] (grad_accumulator.cpp): with the plan's Placement::no_accumulator there are
// no accumulators; each sub-group's sums, once complete (and their squared norm taken), are handed
// here as n_elems of Placement::grad_dtype in a host buffer that stays valid until this returns —
// the optimizer steps the sub-group from it. Called on add()'s thread; its error is add()'s.
// sum_sq: nullptr when the sums' squared norm was taken already; else (fp32 sums landed in place,
// Note [Gradients that land where they are summed]) the sink takes it as it reads the sums, as
// cpu_optim::squared_norm_canonical does (OptimizerSwapper::step_direct with sum_sq), into *sum_sq.
using FinalGradSink = std::function<Status(uint32_t sub_group, std::byte* grad, double* sum_sq)>;

// Note [Gradients that land where they are summed] (grad_accumulator.cpp): with no accumulators,
// unpartitioned, and fp32 sums, a gradient that is its param's only contribution of the micro-step
// is written by its copy from the device straight into the host buffer where its sub-group is
// summed, not into the landing ring and then copied. The planner and create() then take those
// buffers from the pinned pool (MemoryPlan::landing_buffers).
bool gradients_land_in_place(const Placement& placement, bool partitioned, DType transfer_dtype);

// Where one contribution's bytes go when they land in place: runs of the sub-groups' buffers, in
// the param's element order (two where the param straddles a sub-group boundary).
using LandingRuns = std::vector<std::span<std::byte>>;

// Rounds n elements of `from` at `data` to the narrower (or equal) `to` at the front of the same
// memory, scratch.size() / sizeof(to) elements at a time through `scratch` (Note [Gradients stored
// in 16 bits]). kInvalidArgument for a wider `to` or a scratch under one element.
Status narrow_in_place(std::byte* data, uint64_t n, DType from, DType to, std::span<std::byte> scratch,
                       const cpu_optim::Executor& executor);

class GradAccumulator {
 public:
  // Stored-16-bit sums are rounded in place in chunks of this many elements.
  static constexpr uint64_t kNarrowChunkElems = uint64_t{1} << 20;

  // `contribution_order`: the param ids in the order gradients arrive in one micro-step (backward
  // order of the blocks; a tied param appears once per use). Gives each param's uses per
  // micro-step and, simulated, the most sub-groups open at once (first contribution arrived, not
  // all yet), which sizes the host buffers allocated here, once, for accumulators that are not
  // CPU-resident (pageable, each the largest sub-group's accumulator). kInvalidArgument naming the
  // param for an id out of range or a param that never appears. `store` must outlive this.
  // The kernels run on `executor`'s threads and SIMD path; it must outlive this.
  // With reducer.reduce set, the gradients are partitioned (Note [Partitioned gradients]): the
  // store's plan must partition them (MemoryPlan::partition_grads), and the other way round.
  // `sink` is given exactly when the plan has no accumulators (Placement::no_accumulator; not
  // with partitioned gradients); kInvalidArgument otherwise.
  static Result<std::unique_ptr<GradAccumulator>> create(StateStore& store, std::vector<uint32_t> contribution_order,
                                                         const cpu_optim::Executor& executor,
                                                         ReducerOptions reducer = {}, FinalGradSink sink = {});

  // The host buffers create() allocates (none when the accumulators are CPU-resident): the planner's
  // figure and create()'s. `contribution_order` must be valid (as create() checks it).
  // bytes_each holds the largest sub-group's accumulator in the sum dtype; narrowing_bytes is the
  // scratch that rounds stored-16-bit sums in place (Note [Gradients stored in 16 bits]), 0 otherwise.
  struct BufferPlan {
    uint32_t count = 0;
    uint64_t bytes_each = 0;
    uint64_t narrowing_bytes = 0;
  };
  // Runs the accumulate kernel and the squared norm over n elements, as add() and the last
  // micro-step do (the planner times it).
  static Status measure_kernel(std::byte* acc, DType acc_dtype, const std::byte* grad, DType grad_dtype, uint64_t n,
                               const cpu_optim::Executor& executor);
  // partitioned: MemoryPlan::partition_grads (every sub-group buffered, plus one buffer to combine
  // with an accumulator that is not in host memory).
  static BufferPlan plan_buffers(const ParamRegistry& registry, const Placement& placement,
                                 const std::vector<uint32_t>& contribution_order, bool partitioned = false);
  ~GradAccumulator();
  GradAccumulator(const GradAccumulator&) = delete;
  GradAccumulator& operator=(const GradAccumulator&) = delete;

  // first: the accumulators start from zero this micro-step (previous contents ignored, not read);
  // last: the accumulation boundary (fills the norm report). Both may be true (no accumulation).
  // kFailedPrecondition while a micro-step is open (end_micro_step not yet successful), and with
  // stored-16-bit gradients or no accumulators unless both are true.
  Status begin_micro_step(bool first, bool last);

  // Adds one gradient contribution of `param`: n_elems of `dtype` in host memory, row-major as the
  // param: acc = round_to_grad_dtype(float(acc) + float(g)) element-wise, with acc = +0 on the
  // first micro-step (the same arithmetic on every tier, so results are bit-identical). A
  // sub-group whose every contribution of this micro-step has arrived is flushed (CPU: updated in
  // place, no buffer; device and NVMe: read into a host buffer unless first, add, write back; the
  // NVMe write is queued and finished later, Note [Asynchronous accumulator writes], so its failure
  // may be returned by a later add(), finish_writes() or end_micro_step()).
  // At the last micro-step each flushed sub-group's squared norm (cpu_optim::squared_norm, its fixed
  // tile order) is added to sum_sq / nonfinite in a fixed order (sub-groups as they complete). Synchronous. kInvalidArgument
  // for a bad param, a wrong size or dtype, or a contribution beyond the param's uses;
  // kFailedPrecondition outside a micro-step or when the buffers are exhausted (gradients arriving
  // in an order that opens more sub-groups than the contribution order did). Store errors name the
  // sub-group.
  Status add(uint32_t param, std::span<const std::byte> grad, DType dtype);

  // (addition) Note [Gradients that land where they are summed]. On the producer's thread, before
  // a contribution of `param` (size_bytes of `dtype`) is written anywhere: without accumulators,
  // claims the host buffers of the param's sub-groups in submission order (waiting while every
  // buffer is held by sub-groups the worker has not flushed yet), and, when the contribution may
  // land in place, returns the runs it is to be written to; then the worker calls add_in_place.
  // Empty: it goes through the ring and add(). With accumulators it claims nothing and returns
  // empty. kInvalidArgument for a bad param, size or a contribution beyond its uses;
  // kFailedPrecondition outside a micro-step, and once cancel_reservations() was called in it.
  Result<LandingRuns> reserve(uint32_t param, DType dtype, uint64_t size_bytes);
  // The contribution reserve() placed in its runs has been written (its copy complete): counted as
  // add() counts one, and the sub-groups it completes are flushed. On the worker's thread.
  Status add_in_place(uint32_t param);
  // Wakes a reserve() waiting for a buffer and fails it and every later one until the micro-step
  // is abandoned: the worker's adds failed, so the buffers it holds will not be freed. Any thread.
  void cancel_reservations();

  // kFailedPrecondition naming the params still missing contributions (the micro-step stays
  // open); else finishes the queued writes (a failure names the sub-group, file and offset; the
  // micro-step stays open), closes the micro-step and returns its report.
  Result<GradNormReport> end_micro_step();

  // Waits for the accumulator writes queued so far (Note [Asynchronous accumulator writes]); the
  // first failure, naming the sub-group, file and offset. On the thread that adds.
  Status finish_writes();

  // (addition) Abandons an open micro-step (after a failure): drops the open sub-groups' buffers.
  // Accumulators are then undefined until a micro-step with first = true.
  void abandon_micro_step();

  // The sub-groups in the order they complete in a micro-step whose gradients arrive in the
  // contribution order given at create (an optimizer reading ahead for a direct step follows it).
  const std::vector<uint32_t>& completion_order() const;

  // (addition) The host buffers allocated at create(): count (0 when the accumulators are
  // CPU-resident) and bytes each.
  uint32_t buffer_count() const;
  uint64_t buffer_bytes() const;
  // (addition) Accumulator writes queued and not yet finished (Note [Asynchronous accumulator
  // writes]); on the thread that adds.
  uint32_t queued_writes() const;

  struct Impl;

 private:
  explicit GradAccumulator(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace zo::engine

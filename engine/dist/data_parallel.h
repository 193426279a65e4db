// DataParallel: the steps of a data-parallel run that cross between ranks around the optimizer —
// the gradient sums at the accumulation boundary, the norm of partitioned gradients, and the
// optimizer step with the updated compute copies sent from their owners beside it (Note [Replicated
// data parallel], Note [Partitioned data parallel], Note [Gather beside the step]). It owns the
// staging buffers those collectives use for states that do not live in host memory (charged to the
// run's MemoryAccounting as CPU memory; the planner counts them: data_parallel_staging_bytes). Not
// thread-safe: the trainer's thread calls it (reduce_in_buckets also from the gradient worker's
// thread, on the gradient worker's collectives, while the trainer's thread issues none). This header
// includes no LibTorch header.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "common/aligned_buffer.h"
#include "common/status.h"
#include "cpu_optim/executor.h"
#include "engine/coord/grad_accumulator.h"
#include "engine/dist/process_group.h"
#include "engine/memory/optimizer_swapper.h"
#include "engine/memory/memory_plan.h"
#include "engine/memory/state_store.h"

namespace zo::engine::dist {

// Note [One outcome for every rank]: each rank says whether its part of a collective piece of work
// failed, and every rank learns the lowest rank that did (nullopt: none), with one all-reduce of a
// flag per rank. A rank that failed still takes part, so that the others never wait for it.
// kAborted (the group's error) when the all-reduce itself fails.
Result<std::optional<uint32_t>> first_failed_rank(ProcessGroup& group, bool failed_here, const std::string& what);

struct DataParallelOptions {
  // zero_optimization.reduce_bucket_size: at most this many elements per collective (element-wise
  // sums: the bucket never changes the result). ≥ 1.
  uint64_t reduce_bucket_elems = 500'000'000;
};

class DataParallel {
 public:
  // Borrows everything; all must outlive it. `store`'s plan says how the states are split
  // (MemoryPlan::partitioned, partition_grads, partition_params).
  DataParallel(ProcessGroup& group, StateStore& store, const ParamRegistry& registry,
               const cpu_optim::Executor& executor, MemoryAccounting& accounting, DataParallelOptions options);
  ~DataParallel();
  DataParallel(const DataParallel&) = delete;
  DataParallel& operator=(const DataParallel&) = delete;

  // Sums every rank's gradient accumulators, sub-group by sub-group: into each rank's (replicated)
  // or into the owner's (partitioned: Note [Partitioned data parallel]), and returns the norm report
  // of the sums (the loss scale still in them), the same on every rank.
  Result<GradNormReport> reduce_gradients();
  // Partitioned: every chunk's squared norm, filled by its owner (0 elsewhere), all-reduced and
  // added up in chunk order on every rank (Note [Partitioned data parallel]).
  Result<GradNormReport> owners_norm(std::vector<double> chunk_sq);
  // Sums n gradients of `dtype` at data over the ranks: to `owner` (reduce) or, without
  // one, to every rank (all-reduce), in collectives of at most reduce_bucket_elems elements.
  Status reduce_in_buckets(void* data, uint64_t n, DType dtype, std::optional<uint32_t> owner, const std::string& what);
  // The optimizer step, then (partitioned) the updated compute copies from their owners to the other
  // ranks beside it, on a thread of its own; `publish` (may be empty) is told of each sub-group whose
  // new compute copy is at its home here. Unpartitioned: optimizer.step(args) alone.
  Result<OptimizerStepReport> update(OptimizerSwapper& optimizer, const OptimizerStepArgs& args,
                                     const std::function<void(uint32_t)>& publish);
  // After a direct step (Note [No accumulator]), which each rank ran on its own partition during
  // backward: the updated compute copies from their owners to the other ranks (stage 2; at stage 3
  // the next forward gathers them), and every rank learns whether every rank's step succeeded
  // (`stepped`: this rank's did). kAborted naming the first rank whose step failed; OK here when
  // this rank's own failed (its error is the step's). On failure the store is marked torn, as after
  // update(). Unpartitioned: nothing.
  Status send_direct_update(bool stepped);
  // The last update's (or send_direct_update's) time in collectives (0 unpartitioned).
  double gather_s() const { return gather_s_; }

  class ReadyGroups;

 private:
  Status gather_compute(ReadyGroups& ready, const std::function<void(uint32_t)>& publish);
  // A staging buffer of `bytes`, charged to the accounting until the destructor.
  Result<AlignedBuffer> allocate_staging(uint64_t bytes);

  ProcessGroup& group_;
  StateStore& store_;
  const ParamRegistry& registry_;
  const cpu_optim::Executor& executor_;
  MemoryAccounting& accounting_;
  const DataParallelOptions options_;
  std::optional<AlignedBuffer> reduce_staging_;  // for accumulators not in host memory
  std::optional<AlignedBuffer> gather_staging_;  // for compute copies not in host memory
  double gather_s_ = 0;
};

}  // namespace zo::engine::dist

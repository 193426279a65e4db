// The data-parallel steps around the optimizer: gradient sums, the partitioned norm, and the
// compute copies sent from their owners beside the optimizer step.
#include "engine/dist/data_parallel.h"

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <mutex>
#include <system_error>
#include <thread>

#include "common/bytes.h"
#include "common/timer.h"
#include "common/trace.h"
#include "cpu_optim/vector_ops.h"

namespace zo::engine::dist {

Result<std::optional<uint32_t>> first_failed_rank(ProcessGroup& group, bool failed_here, const std::string& what) {
  std::vector<double> failed(group.world_size(), 0.0);
  failed[group.rank()] = failed_here ? 1.0 : 0.0;
  ZO_RETURN_IF_ERROR(group.all_reduce_sum(failed, what));
  for (uint32_t r = 0; r < group.world_size(); ++r)
    if (failed[r] != 0) return std::optional<uint32_t>(r);
  return std::optional<uint32_t>();
}

DataParallel::DataParallel(ProcessGroup& group, StateStore& store, const ParamRegistry& registry,
                           const cpu_optim::Executor& executor, MemoryAccounting& accounting,
                           DataParallelOptions options)
    : group_(group),
      store_(store),
      registry_(registry),
      executor_(executor),
      accounting_(accounting),
      options_(options) {}

DataParallel::~DataParallel() {
  for (const std::optional<AlignedBuffer>* b : {&reduce_staging_, &gather_staging_})
    if (b->has_value()) accounting_.remove_resident(Tier::kCpu, (*b)->size());
}

Result<AlignedBuffer> DataParallel::allocate_staging(uint64_t bytes) {
  ZO_ASSIGN_OR_RETURN(AlignedBuffer b, AlignedBuffer::allocate(bytes));
  accounting_.add_resident(Tier::kCpu, b.size());
  return b;
}

// Note [Replicated data parallel]
// With several ranks (torchrun, mpirun, srun; engine/dist) each rank trains on its own slice of
// every global batch (Dataset's rank split). At ZeRO stage 0 each holds every state, as one
// process does. At the accumulation boundary the ranks sum their gradient accumulators with one
// all-reduce per chunk (every rank ends with the same bits, the loss factor having divided by the
// world size already, so the sum is the mean), and each rank takes the norm of the sums. From
// there every rank holds the same gradients, norm, overflow flag and loss scale, and runs the same
// optimizer step on the same states, so the replicas stay bit-identical without exchanging
// weights; rank 0 writes the metrics and checkpoints. The chunks are kDataParallelChunkElems whatever the
// tier, so the norm's summation order, and the weights, do not depend on where the accumulators
// live.
//
// Note [Partitioned data parallel]
// At ZeRO stages 1-3 each rank owns one partition of the sub-groups (Note [Partitions] in
// param_registry.cpp) and holds the optimizer states (master, exp_avg, exp_avg_sq) of that
// partition only: the 12 bytes per parameter that dominate an offloaded run are divided by the
// world size. At stage 1 every rank still holds every gradient accumulator; at the boundary
// each chunk is reduced to its owner instead of all-reduced; the owner takes its squared norm, and
// one all-reduce of the per-chunk norms (each slot filled by one rank, the others adding zeros,
// which is exact) lets every rank add them up in the replicated path's order: with two ranks the
// same bits as stage 0 (a reduce and an all-reduce of two values both compute a + b). Each rank
// then steps its own sub-groups while, beside it and the next forward, each sub-group's new compute
// copy is broadcast from its owner, chunk by chunk in sub-group order, and published to the next
// forward as it arrives (Note [Gather beside the step]).
// From stage 2 the gradient accumulators are partitioned too: each micro-step's gradients are
// reduced to their owners during backward (Note [Partitioned gradients] in grad_accumulator.h), and
// the boundary only all-reduces the owners' chunk norms, in the same order.
// At stage 3 the compute copies are partitioned as well: nothing is broadcast after the step, and
// each block is gathered from its owners whenever the coordinator fetches it (Note [Gathered
// parameters] in block_gatherer.cpp); gather_compute then only publishes the other ranks' sub-groups
// to the gate and exchanges the step's outcome.
Result<GradNormReport> DataParallel::reduce_gradients() {
  const MemoryPlan& plan = store_.plan();
  const bool partitioned = plan.partitioned();
  trace::Span span(trace::Track::kCollective,
                   partitioned ? "reduce the gradients to their owners" : "all-reduce the gradients");
  const DType dtype = plan.placement.grad_dtype;
  const uint64_t elem_bytes = dtype_size_bytes(dtype);
  GradNormReport report;
  std::vector<double> chunk_sq;  // partitioned: each chunk's squared norm, from its owner
  for (uint32_t g = 0; g < plan.n_sub_groups; ++g) {
    if (plan.is_frozen(g)) continue;  // no gradient on any rank (Note [Frozen sub-groups])
    const StateLocation& loc = store_.location(g, StateKind::kGradAccum);
    const uint64_t n = store_.state_bytes(g, StateKind::kGradAccum) / elem_bytes;
    const uint32_t owner = registry_.partition_of_group(g);
    const bool mine = !partitioned || owner == group_.rank();
    const std::string what =
        (partitioned ? "reducing the gradients of sub-group " : "all-reducing the gradients of sub-group ") +
        std::to_string(g);
    for (uint64_t first = 0; first < n; first += kDataParallelChunkElems) {
      const uint64_t count = std::min(kDataParallelChunkElems, n - first);
      const uint64_t offset_bytes = first * elem_bytes;
      std::byte* p = nullptr;
      if (loc.tier == Tier::kCpu) {
        p = loc.host + offset_bytes;
      } else {
        if (!reduce_staging_) {
          ZO_ASSIGN_OR_RETURN(AlignedBuffer b, allocate_staging(kDataParallelChunkElems * elem_bytes));
          reduce_staging_.emplace(std::move(b));
        }
        p = reduce_staging_->data();
        ZO_RETURN_IF_ERROR(store_.read_state_range(g, StateKind::kGradAccum, offset_bytes, {p, count * elem_bytes}));
      }
      ZO_RETURN_IF_ERROR(
          reduce_in_buckets(p, count, dtype, partitioned ? std::optional<uint32_t>(owner) : std::nullopt, what));
      double sq = 0;
      if (mine) {
        ZO_ASSIGN_OR_RETURN(sq, cpu_optim::squared_norm({p, dtype}, count, executor_));
        if (loc.tier != Tier::kCpu)
          ZO_RETURN_IF_ERROR(store_.write_state_range(g, StateKind::kGradAccum, offset_bytes, {p, count * elem_bytes}));
      }
      if (partitioned) {
        chunk_sq.push_back(sq);
      } else {
        report.sum_sq += sq;
      }
    }
  }
  if (partitioned) return owners_norm(std::move(chunk_sq));
  report.nonfinite = !std::isfinite(report.sum_sq);
  return report;
}

Status DataParallel::reduce_in_buckets(void* data, uint64_t n, DType dtype, std::optional<uint32_t> owner,
                                       const std::string& what) {
  const uint64_t bucket = std::max<uint64_t>(1, options_.reduce_bucket_elems);
  auto* bytes = static_cast<std::byte*>(data);
  for (uint64_t at = 0; at < n; at += bucket) {
    const uint64_t count = std::min(bucket, n - at);
    std::byte* p = bytes + at * dtype_size_bytes(dtype);
    ZO_RETURN_IF_ERROR(owner ? group_.reduce_sum(p, count, dtype, *owner, what)
                             : group_.all_reduce_sum(p, count, dtype, what));
  }
  return Status::ok();
}

Result<GradNormReport> DataParallel::owners_norm(std::vector<double> chunk_sq) {
  ZO_RETURN_IF_ERROR(group_.all_reduce_sum(chunk_sq, "all-reducing the gradient norm"));
  GradNormReport report;
  for (double sq : chunk_sq) report.sum_sq += sq;
  report.nonfinite = !std::isfinite(report.sum_sq);
  return report;
}

// The owned sub-groups whose new compute copy is at its home, told by the optimizer's thread,
// waited for by the thread that broadcasts them (Note [Gather beside the step]).
class DataParallel::ReadyGroups {
 public:
  explicit ReadyGroups(uint32_t n) : ready_(n, 0) {}
  void ready(uint32_t g) {
    std::lock_guard<std::mutex> lock(mu_);
    ready_[g] = 1;
    cv_.notify_all();
  }
  // The step is over (`ok`: it succeeded): groups not ready by now never will be.
  void finish(bool ok) {
    std::lock_guard<std::mutex> lock(mu_);
    finished_ = true;
    ok_ = ok;
    cv_.notify_all();
  }
  // Waits for finish(); its `ok`.
  bool outcome() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return finished_; });
    return ok_;
  }
  // Whether g became ready (false: the step ended without it).
  bool wait(uint32_t g) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return ready_[g] != 0 || finished_; });
    return ready_[g] != 0;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<uint8_t> ready_;
  bool finished_ = false;
  bool ok_ = false;
};

// Note [Gather beside the step]: the broadcasts run on their own thread while this rank's optimizer
// steps its partition, in sub-group order on every rank; the owner of each sub-group broadcasts it
// as soon as the optimizer has written it. Rank r thus receives rank 0's copies while it is still
// stepping its own, and the next forward gets block 0 as soon as its owner has stepped it. An owner
// whose step failed still sends the sub-groups it did not finish (whatever their homes hold), so
// that no rank waits for copies that will never come; after the last one the ranks exchange
// whether every step succeeded (Note [One outcome for every rank]), and every rank stops if one
// failed (the copies received are then stale: the states are torn, as after any failed step).
Status DataParallel::gather_compute(ReadyGroups& ready, const std::function<void(uint32_t)>& publish) {
  trace::Span span(trace::Track::kCollective, "all-gather the updated parameters");
  const MemoryPlan& plan = store_.plan();
  const uint32_t rank = group_.rank();
  const uint64_t elem_bytes = state_elem_bytes(plan.placement, StateKind::kCompute);
  Status local;
  if (plan.partition_params) {
    // Nothing to send: the next forward gathers each block from its owner once the owner's gate says
    // the block is written (Note [Gathered parameters]); the other ranks' sub-groups are final here.
    for (uint32_t g = 0; g < plan.n_sub_groups && publish; ++g)
      if (!plan.owns(g)) publish(g);
  } else {
    for (uint32_t g = 0; g < plan.n_sub_groups; ++g) {
      // A frozen sub-group's compute copy is the same on every rank and no step changes it (the
      // gate holds it final: Note [Frozen sub-groups]).
      if (plan.is_frozen(g)) continue;
      const StateLocation& loc = store_.location(g, StateKind::kCompute);
      const uint64_t n = store_.state_bytes(g, StateKind::kCompute) / elem_bytes;
      const uint32_t owner = registry_.partition_of_group(g);
      const std::string what = "all-gathering the compute copies of sub-group " + std::to_string(g);
      if (owner == rank) (void)ready.wait(g);  // sent even when not updated: see above
      for (uint64_t first = 0; first < n; first += kDataParallelChunkElems) {
        const uint64_t bytes = std::min(kDataParallelChunkElems, n - first) * elem_bytes;
        const uint64_t offset_bytes = first * elem_bytes;
        std::byte* p = nullptr;
        if (loc.tier == Tier::kCpu) {
          p = loc.host + offset_bytes;
        } else {
          p = gather_staging_->data();
          // A local failure (here or below) is kept for the end: this rank still takes part in every
          // broadcast, so that the others do not wait for it.
          if (owner == rank && local.is_ok())
            local = store_.read_state_range(g, StateKind::kCompute, offset_bytes, {p, bytes});
        }
        ZO_RETURN_IF_ERROR(group_.broadcast(p, bytes, owner, what));
        if (owner != rank && loc.tier != Tier::kCpu && local.is_ok())
          local = store_.write_state_range(g, StateKind::kCompute, offset_bytes, {p, bytes});
      }
      if (owner != rank && publish && local.is_ok()) publish(g);
    }
  }
  const bool ok = ready.outcome();
  ZO_ASSIGN_OR_RETURN(
      std::optional<uint32_t> failed,
      first_failed_rank(group_, !(ok && local.is_ok()), "exchanging the outcome of the optimizer step"));
  if (!local.is_ok()) return local.with_context("all-gathering the compute copies");
  if (!ok) return Status::ok();  // the optimizer's own error is the step's
  if (failed)
    return Status(StatusCode::kAborted, "the optimizer step of rank " + std::to_string(*failed) + " of " +
                                            std::to_string(group_.world_size()) +
                                            " failed (its own output has the error)");
  return Status::ok();
}

Status DataParallel::send_direct_update(bool stepped) {
  gather_s_ = 0;
  const MemoryPlan& plan = store_.plan();
  if (!plan.partitioned()) return Status::ok();
  if (!gather_staging_ && !plan.partition_params) {
    ZO_ASSIGN_OR_RETURN(AlignedBuffer b, allocate_staging(kDataParallelChunkElems *
                                                          state_elem_bytes(plan.placement, StateKind::kCompute)));
    gather_staging_.emplace(std::move(b));
  }
  ReadyGroups ready(plan.n_sub_groups);
  for (uint32_t g = plan.owned_begin; stepped && g < plan.owned_end; ++g) ready.ready(g);
  ready.finish(stepped);
  const double t0 = group_.seconds();
  Status gathered = gather_compute(ready, {});
  gather_s_ = group_.seconds() - t0;
  if (!gathered.is_ok()) store_.mark_torn(gathered.to_string());  // some compute copies may be stale
  return gathered;
}

Result<OptimizerStepReport> DataParallel::update(OptimizerSwapper& optimizer, const OptimizerStepArgs& args,
                                                 const std::function<void(uint32_t)>& publish) {
  gather_s_ = 0;
  const MemoryPlan& plan = store_.plan();
  if (!plan.partitioned()) return optimizer.step(args);
  if (!gather_staging_ && !plan.partition_params) {  // for compute copies not in host memory; before any collective
    ZO_ASSIGN_OR_RETURN(AlignedBuffer b, allocate_staging(kDataParallelChunkElems *
                                                          state_elem_bytes(plan.placement, StateKind::kCompute)));
    gather_staging_.emplace(std::move(b));
  }
  ReadyGroups ready(plan.n_sub_groups);
  OptimizerStepArgs own = args;
  own.on_compute_ready = [&ready, &args](uint32_t g) {
    if (args.on_compute_ready) args.on_compute_ready(g);
    ready.ready(g);
  };
  const double t0 = group_.seconds();
  Stopwatch wall;
  Status gathered;
  double gather_wall_s = 0;
  std::thread comm;
  try {
    comm = std::thread([&] {
      gathered = gather_compute(ready, publish);
      gather_wall_s = wall.elapsed_s();
    });
  } catch (const std::system_error& e) {
    return errno_status("starting the thread that all-gathers the parameters", e.code().value());
  }
  Result<OptimizerStepReport> r = optimizer.step(own);
  ready.finish(r.is_ok());
  comm.join();
  gather_s_ = group_.seconds() - t0;
  if (!r.is_ok()) return r;
  if (!gathered.is_ok()) {
    // Some compute copies may be stale: the run cannot go on from these states.
    store_.mark_torn(gathered.to_string());
    return gathered;
  }
  // The optimizer's thread's time now ends when the last copy has arrived.
  r->total_s = std::max(r->total_s, gather_wall_s);
  return r;
}

}  // namespace zo::engine::dist

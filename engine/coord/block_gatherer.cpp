#include "engine/coord/block_gatherer.h"

#include <algorithm>
#include <condition_variable>
#include <mutex>
#include <system_error>
#include <thread>
#include <utility>

#include "common/bytes.h"
#include "common/check.h"
#include "common/timer.h"
#include "common/trace.h"

// Note [Gathered parameters]
//
// At ZeRO stage 3 with several ranks each rank holds the compute copies of its partition only (the
// 2 bytes per parameter of a bf16 run divide by the world size, as the optimizer states' 12 do), and
// a block's compute copies are gathered from their owners whenever the coordinator fetches the
// block, as DeepSpeed's stage 3 all-gathers a module's partitioned parameters before its forward and
// again before its backward.
//
// Who gathers when. The collectives must come in the same order on every rank, but what the
// coordinator fetches, and when, depends on timing (prefetch stops at a param whose update is not
// written yet, or whose swap buffer is busy). So the collectives are taken out of the coordinator:
// this thread walks the schedule — forward blocks 0..n-1, backward n-1..0, every position, every
// micro-step — and gathers each position's whole block into a host slot, whatever the coordinator
// will find already on the device. That is a fixed sequence, the same on every rank. It runs up to
// slots − 1 positions ahead of the position in use (done() frees a slot), so the next block is
// gathered while this one computes; the coordinator prefetches a param only from a position already
// gathered (poll), and waits at acquire for its own (wait). A position's slot is reused only after
// every copy to the device out of it has completed.
//
// A slot holds the block's params once each, back to back in the block's order; its runs of bytes
// with one owner go in one broadcast each (a decoder layer usually lies within one partition: one
// broadcast), or in several of at most allgather_bucket_size elements. The owner first reads its bytes from their homes (CPU, NVMe or device), once the
// update gate says the optimizer has written them; the sub-groups of other ranks are published to
// the gate by the trainer at once, so only the owner waits for its own step. It never waits across
// a micro-step boundary: a micro-step's positions are gathered only after begin_micro_step, which
// the trainer calls after the gate has opened for the update in between, so nothing stale is read.
//
// Failures. A broadcast that fails (a peer died or stalled: the process group names it) ends the
// gathering: every wait from then on returns it. A failure to read this rank's own bytes is kept
// for the waits of that position, and the broadcasts still go out (with whatever bytes the slot
// held), so that the other ranks do not wait for them; this rank's error then stops the run, and
// the other ranks with it. A micro-step the coordinator abandons is gathered to its end all the
// same (begin_micro_step waits for that), for the ranks that did not abandon it.

namespace zo::engine {

namespace {

constexpr uint64_t kSlotAlignment = 4096;

// A block's params once each, in the order the block first uses them (the slot's layout).
std::vector<uint32_t> unique_params(const std::vector<uint32_t>& block) {
  std::vector<uint32_t> out;
  for (uint32_t p : block)
    if (std::find(out.begin(), out.end(), p) == out.end()) out.push_back(p);
  return out;
}

}  // namespace

struct BlockGatherer::Impl {
  // One run of a block's slot bytes with one owner.
  struct Fill {  // this rank's own bytes of a run: from sub-group g's compute copy
    uint32_t group = 0;
    uint64_t group_offset_bytes = 0;
    uint64_t slot_offset_bytes = 0;
    uint64_t bytes = 0;
  };
  struct Run {
    uint64_t slot_offset_bytes = 0;
    uint64_t bytes = 0;
    uint32_t owner = 0;
    uint32_t groups_end = 0;  // the owner's sub-groups of this run are below this
    std::vector<Fill> fills;  // owner == this rank
  };
  struct Block {
    std::vector<std::pair<uint32_t, uint64_t>> offsets;  // (param, slot offset), sorted by param
    std::vector<Run> runs;
    std::string name;
  };

  StateStore* store = nullptr;
  BlockGathererOptions options;
  std::vector<Block> blocks;
  uint32_t n_blocks = 0;
  uint64_t slot_bytes = 0;

  mutable std::mutex mu;
  std::condition_variable cv;
  bool stop = false;
  bool in_step = false;                // a micro-step's positions are being gathered
  bool abandoned = false;              // its consumer is gone: gather the rest without waiting for done()
  uint32_t gathered = 0;               // positions of the micro-step gathered (each < 2n)
  uint32_t done_count = 0;             // positions done() by the coordinator
  Status failure;                      // a broadcast failed: no more gathering
  std::vector<Status> local_failures;  // per position of this micro-step: reading own bytes failed
  BlockGathererStats stats;
  std::thread thread;

  uint32_t positions() const { return 2 * n_blocks; }
  uint32_t block_at(uint32_t q) const { return q < n_blocks ? q : 2 * n_blocks - 1 - q; }
  std::byte* slot(uint32_t q) { return options.memory.data() + (q % options.slots) * slot_bytes; }

  uint64_t offset_of(uint32_t q, uint32_t param) const {
    const auto& offs = blocks[block_at(q)].offsets;
    auto it = std::lower_bound(offs.begin(), offs.end(), std::make_pair(param, uint64_t{0}));
    ZO_CHECK(it != offs.end() && it->first == param)
        << "block gatherer: param " << param << " is not in the block at position " << q;
    return it->second;
  }

  // Gathers position q into its slot: this rank's bytes from their homes, then one broadcast per run.
  Status gather(uint32_t q, Status* local) {
    const Block& b = blocks[block_at(q)];
    trace::Span span(trace::Track::kGather,
                     [&] { return "gather " + b.name + (q < n_blocks ? " (forward)" : " (backward)"); });
    std::byte* base = slot(q);
    for (const Run& run : b.runs) {
      if (run.owner == options.rank) {
        if (options.gate != nullptr && local->is_ok()) {
          *local = options.gate->wait_prefix(run.groups_end);
          if (!local->is_ok()) *local = local->with_context("the optimizer step writing " + b.name + " failed");
        }
        for (const Fill& f : run.fills) {
          if (!local->is_ok()) break;
          *local = store->read_state_range(f.group, StateKind::kCompute, f.group_offset_bytes,
                                           {base + f.slot_offset_bytes, f.bytes});
          if (!local->is_ok()) *local = local->with_context("reading this rank's parameters of " + b.name);
        }
      }
      Stopwatch sw;
      Status st =
          options.broadcast(base + run.slot_offset_bytes, run.bytes, run.owner,
                            "gathering the parameters of " + b.name + " from rank " + std::to_string(run.owner));
      const double s = sw.elapsed_s();
      std::lock_guard<std::mutex> lock(mu);
      stats.collective_s += s;
      if (!st.is_ok()) return st;
      stats.bytes += run.bytes;
    }
    return Status::ok();
  }

  void loop() {
    std::unique_lock<std::mutex> lock(mu);
    for (;;) {
      cv.wait(lock, [&] {
        return stop || (failure.is_ok() && in_step && gathered < positions() &&
                        (abandoned || gathered < done_count + options.slots));
      });
      if (stop) return;
      const uint32_t q = gathered;
      lock.unlock();
      Status local;
      Status st = gather(q, &local);
      lock.lock();
      if (!st.is_ok()) {
        failure = std::move(st);
        cv.notify_all();
        continue;  // waits for stop
      }
      local_failures[q] = std::move(local);
      if (++gathered == positions()) in_step = false;
      cv.notify_all();
    }
  }
};

uint64_t BlockGatherer::slot_bytes(const ParamRegistry& registry, const Placement& placement,
                                   const std::vector<std::vector<uint32_t>>& blocks) {
  const uint64_t cb = state_elem_bytes(placement, StateKind::kCompute);
  uint64_t most = 0;
  for (const auto& ps : blocks) {
    uint64_t bytes = 0;
    for (uint32_t p : unique_params(ps)) bytes += registry.params()[p].n_elems * cb;
    most = std::max(most, bytes);
  }
  return align_up(most, kSlotAlignment);
}

uint64_t BlockGatherer::nvme_read_bytes_per_pass(const ParamRegistry& registry, const MemoryPlan& plan,
                                                 const std::vector<std::vector<uint32_t>>& blocks) {
  const uint64_t cb = state_elem_bytes(plan.placement, StateKind::kCompute);
  uint64_t bytes = 0;
  for (const auto& ps : blocks) {
    for (uint32_t p : unique_params(ps)) {
      for (const ParamPiece& piece : registry.pieces_of_param(p)) {
        if (plan.placement.compute[piece.sub_group] != Tier::kNvme || !plan.holds(piece.sub_group, StateKind::kCompute))
          continue;
        const uint64_t begin = piece.group_offset * cb, end = begin + piece.n_elems * cb;
        bytes += 2 * (align_up(end, kSwapAlignment) - begin / kSwapAlignment * kSwapAlignment);  // forward, backward
      }
    }
  }
  return bytes;
}

BlockGatherer::BlockGatherer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

BlockGatherer::~BlockGatherer() {
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->stop = true;
  }
  impl_->cv.notify_all();
  if (impl_->thread.joinable()) impl_->thread.join();
}

Result<std::unique_ptr<BlockGatherer>> BlockGatherer::create(StateStore& store,
                                                             std::vector<std::vector<uint32_t>> blocks,
                                                             BlockGathererOptions options) {
  const MemoryPlan& plan = store.plan();
  const ParamRegistry& registry = store.registry();
  if (!plan.partition_params)
    return invalid_argument("block gatherer: this rank's plan does not partition the parameters");
  if (blocks.empty()) return invalid_argument("block gatherer: no blocks");
  if (!options.broadcast) return invalid_argument("block gatherer: no broadcast");
  if (options.slots < 2)
    return invalid_argument("block gatherer: " + std::to_string(options.slots) + " slots; it needs 2");
  if (options.bucket_elems == 0) return invalid_argument("block gatherer: a bucket of 0 elements");
  if (!options.block_names.empty() && options.block_names.size() != blocks.size())
    return invalid_argument("block gatherer: " + std::to_string(blocks.size()) + " blocks but " +
                            std::to_string(options.block_names.size()) + " block names");
  auto impl = std::make_unique<Impl>();
  Impl& s = *impl;
  s.store = &store;
  s.n_blocks = static_cast<uint32_t>(blocks.size());
  s.slot_bytes = slot_bytes(registry, plan.placement, blocks);
  if (options.memory.size() < uint64_t{options.slots} * s.slot_bytes) {
    return invalid_argument("block gatherer: " + std::to_string(options.memory.size()) + " bytes of memory for " +
                            std::to_string(options.slots) + " slots of " + std::to_string(s.slot_bytes) + " bytes");
  }
  s.options = std::move(options);
  const uint64_t cb = state_elem_bytes(plan.placement, StateKind::kCompute);
  s.blocks.resize(s.n_blocks);
  for (uint32_t bi = 0; bi < s.n_blocks; ++bi) {
    Impl::Block& b = s.blocks[bi];
    b.name = "block " + std::to_string(bi);
    if (bi < s.options.block_names.size()) b.name += " '" + s.options.block_names[bi] + "'";
    uint64_t off = 0;
    for (uint32_t p : blocks[bi]) {
      if (p >= registry.params().size())
        return invalid_argument("block gatherer: block " + std::to_string(bi) + " uses param id " + std::to_string(p) +
                                " but the registry has " + std::to_string(registry.params().size()) + " params");
    }
    for (uint32_t p : unique_params(blocks[bi])) {
      b.offsets.emplace_back(p, off);
      for (const ParamPiece& piece : registry.pieces_of_param(p)) {
        const uint32_t owner = registry.partition_of_group(piece.sub_group);
        const uint64_t bytes = piece.n_elems * cb;
        const uint64_t at = off + piece.param_offset * cb;
        if (b.runs.empty() || b.runs.back().owner != owner) b.runs.push_back({.slot_offset_bytes = at, .owner = owner});
        Impl::Run& run = b.runs.back();
        ZO_CHECK_EQ(run.slot_offset_bytes + run.bytes, at);
        run.bytes += bytes;
        run.groups_end = std::max(run.groups_end, piece.sub_group + 1);
        if (owner == s.options.rank)
          run.fills.push_back({.group = piece.sub_group,
                               .group_offset_bytes = piece.group_offset * cb,
                               .slot_offset_bytes = at,
                               .bytes = bytes});
      }
      off += registry.params()[p].n_elems * cb;
    }
    std::sort(b.offsets.begin(), b.offsets.end());
    // allgather_bucket_size: runs longer than a bucket go in several broadcasts.
    const uint64_t bucket_bytes = s.options.bucket_elems * cb;
    std::vector<Impl::Run> split;
    for (Impl::Run& run : b.runs) {
      for (uint64_t at = 0; at < run.bytes; at += bucket_bytes) {
        Impl::Run part{.slot_offset_bytes = run.slot_offset_bytes + at,
                       .bytes = std::min(bucket_bytes, run.bytes - at),
                       .owner = run.owner,
                       .groups_end = run.groups_end};
        if (at == 0) part.fills = std::move(run.fills);  // read before the run's first broadcast
        split.push_back(std::move(part));
      }
    }
    b.runs = std::move(split);
  }
  s.local_failures.resize(s.positions());
  try {
    s.thread = std::thread([&s] { s.loop(); });
  } catch (const std::system_error& e) {
    return errno_status("starting the thread that gathers the parameters", e.code().value());
  }
  return std::unique_ptr<BlockGatherer>(new BlockGatherer(std::move(impl)));
}

void BlockGatherer::begin_micro_step() {
  Impl& s = *impl_;
  std::unique_lock<std::mutex> lock(s.mu);
  if (s.in_step) {  // the last micro-step was abandoned: finish its collectives for the peers
    s.abandoned = true;
    s.cv.notify_all();
    s.cv.wait(lock, [&] { return !s.in_step || !s.failure.is_ok() || s.stop; });
  }
  s.in_step = true;
  s.abandoned = false;
  s.gathered = 0;
  s.done_count = 0;
  for (Status& st : s.local_failures) st = Status::ok();
  s.cv.notify_all();
}

Result<const std::byte*> BlockGatherer::wait(uint32_t q, uint32_t param) {
  Impl& s = *impl_;
  ZO_CHECK_LT(q, s.positions());
  std::unique_lock<std::mutex> lock(s.mu);
  s.cv.wait(lock, [&] { return s.gathered > q || !s.failure.is_ok() || s.stop; });
  if (s.gathered <= q) {
    if (!s.failure.is_ok()) return s.failure;
    return failed_precondition("block gatherer: stopped");
  }
  if (!s.local_failures[q].is_ok()) return s.local_failures[q];
  return static_cast<const std::byte*>(s.slot(q) + s.offset_of(q, param));
}

const std::byte* BlockGatherer::poll(uint32_t q, uint32_t param) {
  Impl& s = *impl_;
  ZO_CHECK_LT(q, s.positions());
  std::lock_guard<std::mutex> lock(s.mu);
  if (s.gathered <= q || !s.local_failures[q].is_ok()) return nullptr;
  return s.slot(q) + s.offset_of(q, param);
}

void BlockGatherer::done(uint32_t q) {
  Impl& s = *impl_;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    ZO_CHECK_EQ(q, s.done_count) << "block gatherer: positions are done in order";
    ++s.done_count;
  }
  s.cv.notify_all();
}

BlockGathererStats BlockGatherer::stats() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->stats;
}

}  // namespace zo::engine

// BlockGatherer: at ZeRO stage 3 across data-parallel ranks (MemoryPlan::partition_params) each rank
// holds the compute copies of its own partition only; the gatherer assembles each block's whole
// compute copies in host slots, from the ranks that own them, in the stage-3 schedule's order, on a
// thread of its own, a few positions ahead of the coordinator that fetches them to the device
// (Note [Gathered parameters] in the .cpp). Thread-safe: the coordinator's thread calls
// begin_micro_step/wait/poll/done; the gatherer's thread issues the broadcasts, and is the only one
// that does (give it a process group of its own).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "common/status.h"
#include "engine/coord/update_gate.h"
#include "engine/memory/state_store.h"

namespace zo::engine {

struct BlockGathererOptions {
  uint32_t rank = 0;
  // Every rank's n_bytes at data become root's (a collective: every rank calls it, in the same
  // order). `what` names the call in errors. Called on the gatherer's thread only.
  std::function<Status(void* data, uint64_t n_bytes, uint32_t root, const std::string& what)> broadcast;
  // The optimizer's progress (may be null): a block's own bytes are read from their homes only once
  // the gate holds their sub-groups final. The sub-groups other ranks own must be published to it
  // at once whenever it opens. Must outlive the gatherer.
  UpdateGate* gate = nullptr;
  // Host memory for `slots` slots of slot_bytes() each (pinned: the coordinator copies from it to
  // the device). The gatherer runs at most slots - 1 positions ahead of the one in use.
  std::span<std::byte> memory;
  uint32_t slots = 2;
  // zero_optimization.allgather_bucket_size: the most elements one broadcast carries (a longer run
  // of one owner's bytes goes in several).
  uint64_t bucket_elems = 500'000'000;
  // Names of the blocks in errors and the trace, as the coordinator's (empty: by number).
  std::vector<std::string> block_names;
};

struct BlockGathererStats {
  double collective_s = 0;  // wall time in broadcasts, on the gatherer's thread
  uint64_t bytes = 0;       // bytes gathered (every block's whole compute copies, own ones too)
};

class BlockGatherer {
 public:
  // The bytes one slot needs: the largest block's compute copies (each param once), 4 KiB-rounded.
  static uint64_t slot_bytes(const ParamRegistry& registry, const Placement& placement,
                             const std::vector<std::vector<uint32_t>>& blocks);
  // The NVMe bytes one pass of the schedule (every block forward and backward) reads for a rank
  // with `plan`: its own pieces of each block whose compute copy is on NVMe, each read through the
  // store's scratch, so the 4 KiB pages it covers (the planner's per-step figure).
  static uint64_t nvme_read_bytes_per_pass(const ParamRegistry& registry, const MemoryPlan& plan,
                                           const std::vector<std::vector<uint32_t>>& blocks);
  static constexpr uint32_t kDefaultSlots = 2;

  // `blocks` as ParamCoordinator::create takes them. The store's plan must partition the params
  // (kInvalidArgument otherwise); memory must hold options.slots slots; starts the thread (an
  // errno Status if it cannot).
  static Result<std::unique_ptr<BlockGatherer>> create(StateStore& store, std::vector<std::vector<uint32_t>> blocks,
                                                       BlockGathererOptions options);
  // Stops the thread after the broadcast in flight, if any (it waits for the peers in it).
  ~BlockGatherer();
  BlockGatherer(const BlockGatherer&) = delete;
  BlockGatherer& operator=(const BlockGatherer&) = delete;

  // A micro-step's 2n positions (forward 0..n-1, backward n-1..0) may be gathered from now on. When
  // the previous micro-step was abandoned before all its positions were done, its remaining
  // positions are gathered first (the other ranks need this rank's part of them), then dropped.
  void begin_micro_step();
  // The host address of `param`'s whole compute copy as gathered for schedule position q (param is
  // used by q's block), once it is there: valid until done(q). Blocking. An error from a broadcast
  // (a peer died or stalled) or from reading this rank's own part of the block (then the other
  // ranks got stale bytes from it, and must be stopped by its error).
  Result<const std::byte*> wait(uint32_t q, uint32_t param);
  // As wait, without blocking: null when q is not gathered yet or failed.
  const std::byte* poll(uint32_t q, uint32_t param);
  // Position q's bytes are no longer read (every copy out of them has completed). In order.
  void done(uint32_t q);

  BlockGathererStats stats() const;

  struct Impl;

 private:
  explicit BlockGatherer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace zo::engine

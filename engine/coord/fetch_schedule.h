// The stage-3 schedule of one micro-step and the device arena it needs, from the placement alone
// (Note [Prefetch and release] in param_coordinator.cpp): CoordinatorOptions (the config's
// stage3_* keys), FetchSchedule (what each position fetches) and ArenaPlan (plan_arena). The
// planner sizes the arena with these before anything is allocated; ParamCoordinator::create
// allocates it with the same figures.
#pragma once

#include <cstdint>
#include <vector>

#include "engine/config/config.h"
#include "engine/memory/memory_plan.h"

namespace zo::engine {

struct CoordinatorOptions {
  // zero_optimization.stage3_prefetch_bucket_size: elements fetched ahead of the block in use.
  uint64_t prefetch_bucket_elems = 50'000'000;
  // stage3_max_live_parameters: elements resident on the device at once (fetched, not persistent).
  // Prefetch never takes the live elements past it; the block in use is always fetched whole.
  uint64_t max_live_elems = 1'000'000'000;
  // stage3_param_persistence_threshold: params this small stay resident once fetched.
  uint64_t persistence_threshold_elems = 100'000;
  // stage3_max_reuse_distance: a released param that is used again within this many elements of
  // schedule stays resident. The distance is the elements of the blocks scheduled strictly between
  // the release and the next use (the schedule wraps into the next micro-step).
  uint64_t max_reuse_distance_elems = 1'000'000'000;
  // Not a DeepSpeed key (addition): device bytes of the budget the arena must leave free (for
  // activations and gradients the trainer allocates later). 0: the arena may take all that is left.
  uint64_t device_reserve_bytes = 0;

  // zero_optimization.stage3_* of `config` (device_reserve_bytes stays 0).
  static CoordinatorOptions from_config(const Config& config);
};

// One micro-step's schedule — forward blocks 0..n-1, then backward n-1..0, 2n positions — and what
// each position fetches, from the placement alone (Note [Prefetch and release]). Built once; the
// arena's size (plan_arena, which the planner calls before anything is allocated) and the
// coordinator's fetches, slots and reuse distances (create) all read this one.
struct FetchSchedule {
  uint32_t n_blocks = 0;
  // Per block: its params that are fetched (compute copy off the device, or gathered), each once,
  // in the block's order; and the elements of all its params, each once (device-resident too).
  std::vector<std::vector<uint32_t>> fetched;
  std::vector<uint64_t> block_elems;
  // Per param (registry order).
  std::vector<uint8_t> used;        // some block uses it
  std::vector<uint8_t> fetches;     // its compute copy is off the device, or gathered
  std::vector<uint8_t> persistent;  // fetched, and at most stage3_param_persistence_threshold elements
  std::vector<uint64_t> n_elems;    // its weight's elements (ParamInfo::weights())
  std::vector<uint64_t> slot_bytes;  // its weights' bytes in the compute dtype, rounded to the arena's slots
  // A packed weight (ParamInfo::packed, Note [The packed 4-bit base]) is always fetched: its blob
  // is copied (or, on the device, read where it lives) and dequantized into its slot. `staged`: the
  // blob crosses PCIe first, into the arena's staging region (ArenaPlan::staging_bytes).
  std::vector<uint8_t> staged;
  std::vector<uint64_t> blob_bytes;  // its compute copy's bytes (the blob's, for a packed weight)

  // `blocks[b]` = the param ids block b uses (each < registry.params().size(); ZO_CHECK). A param's
  // compute copy is on the device when its sub-groups' placement.compute is Tier::kDevice, unless
  // `gathered` (MemoryPlan::partition_params: every param is fetched, from a BlockGatherer). A
  // packed weight is fetched wherever it lives.
  static FetchSchedule build(const ParamRegistry& registry, const Placement& placement,
                             const std::vector<std::vector<uint32_t>>& blocks, const CoordinatorOptions& options,
                             bool gathered);
  uint32_t positions() const { return 2 * n_blocks; }
  // The block at schedule position q, wrapping into the next micro-step.
  uint32_t block_at(uint64_t q) const {
    q %= 2 * uint64_t{n_blocks};
    return static_cast<uint32_t>(q < n_blocks ? q : 2 * uint64_t{n_blocks} - 1 - q);
  }
};

// The device arena a schedule needs, from the placement alone: create() sizes its arena with this,
// and the planner calls it before anything is allocated (Note [Prefetch and release]).
struct ArenaPlan {
  uint64_t persistent_bytes = 0;     // the persistent params' fixed slots
  uint64_t staging_bytes = 0;  // where a packed weight's blob lands before it is dequantized: the largest staged blob
  uint64_t dynamic_bytes = 0;        // the dynamic region wanted, before the device budget caps it
  uint64_t largest_block_bytes = 0;  // the most one block needs in the dynamic region
  uint32_t largest_block = 0;
  uint64_t largest_block_elems = 0;  // its non-persistent elements
  // The bucket prefetch runs with (Note [Prefetch and release]): stage3_prefetch_bucket_size, or,
  // when that cannot hold the largest fetched param (prefetch would never start), the most
  // elements one block fetches, so prefetch works by whole blocks; 0 (prefetch off) stays 0.
  uint64_t prefetch_bucket_elems = 0;
  bool prefetch_by_blocks = false;   // the bucket was raised to whole blocks
  uint64_t largest_param_elems = 0;  // the largest fetched param (the bucket must hold it)
  uint64_t total_bytes() const { return persistent_bytes + staging_bytes + dynamic_bytes; }
  // The arena create() allocates when `left` device bytes are free: the persistent slots, the
  // staging region and as much of the dynamic region as fits (whole alignment units).
  uint64_t bytes_within(uint64_t left) const;
};

ArenaPlan plan_arena(const FetchSchedule& schedule, const CoordinatorOptions& options);
// The same, building the schedule (FetchSchedule::build) first.
ArenaPlan plan_arena(const ParamRegistry& registry, const Placement& placement,
                     const std::vector<std::vector<uint32_t>>& blocks, const CoordinatorOptions& options,
                     bool gathered = false);

}  // namespace zo::engine

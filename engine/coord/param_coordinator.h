// ParamCoordinator: the stage-3 parameter coordinator. Makes each block's compute copies resident on
// the device when the block runs — fetched from pinned/pageable CPU memory or NVMe into one device
// arena allocated at create() — prefetches along the known forward/backward schedule, and frees
// arena space on release. Not thread-safe: one thread drives it. Device addresses it returns point
// into the store's device states or its own arena and stay valid until the block is released.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"
#include "engine/config/config.h"
#include "engine/coord/block_gatherer.h"
#include "engine/coord/fetch_schedule.h"
#include "engine/coord/update_gate.h"
#include "engine/memory/param_swapper.h"
#include "engine/memory/state_store.h"
#include "gpu/device.h"

namespace zo::engine {

struct CoordinatorStats {
  double fetch_wait_s = 0;       // time acquire() blocked waiting for NVMe reads and H2D copies
  double update_wait_s = 0;      // time acquire() blocked on the update gate (not in fetch_wait_s)
  uint64_t h2d_bytes = 0;        // bytes copied to the device by fetches
  uint64_t nvme_read_bytes = 0;  // compute-copy bytes of fetched params that live on NVMe
  // Params copied to the device / found already resident (or already in flight because a prefetch
  // issued them) when their block was acquired. Device-resident params count in neither.
  uint64_t fetches = 0, hits = 0;
  uint64_t prefetches = 0;       // (addition) fetches issued ahead of the acquire that needs them
  uint64_t evictions = 0;        // (addition) cached params dropped to make room
  uint64_t arena_bytes = 0;      // device bytes the coordinator allocated at create (fixed)
  uint64_t peak_live_bytes = 0;  // high-water mark of fetched-param bytes in the arena
};

class ParamCoordinator {
 public:
  // `blocks[b]` = the param ids block b uses, in the order the block takes them; `block_names[b]`
  // names it in errors. Allocates one device arena here and never allocates device memory
  // afterwards: the persistent params plus the most any schedule position needs (its block and
  // what prefetch fetches ahead within the bucket and max_live_elems, plus one largest block of
  // slack against fragmentation when prefetch is on), bounded by what the device budget has left
  // (Device::stats(), minus device_reserve_bytes). Params whose compute copy is device-resident
  // need no arena space. See Note [Prefetch and release] in the .cpp.
  // Errors: kOutOfMemory "gpu budget X leaves Y for parameters; block 'name' alone needs Z ..."
  // when even the largest block plus the persistent params cannot fit; kInvalidArgument for an
  // empty schedule, a bad param id, mismatched name count, or a param on NVMe with no swapper.
  // `param_swapper` may be null when no compute copy is on NVMe (CPU copies are then read from
  // their store location directly); both must outlive the coordinator.
  // With a `gatherer` (required when the store's plan partitions the params, and only then; it must
  // have the same blocks and outlive the coordinator) every param is fetched, from the gatherer's
  // slot of the schedule position it is fetched for, and the swapper is not used (null). An acquire
  // then also waits for its block's copies to land before it returns (the slot is reused after),
  // and hands the position back to the gatherer (Note [Gathered parameters] in block_gatherer.cpp).
  static Result<std::unique_ptr<ParamCoordinator>> create(StateStore& store, ParamSwapper* param_swapper,
                                                          std::vector<std::vector<uint32_t>> blocks,
                                                          std::vector<std::string> block_names,
                                                          const CoordinatorOptions& options,
                                                          BlockGatherer* gatherer = nullptr);
  ~ParamCoordinator();  // drains copies and reads in flight, frees the arena
  ParamCoordinator(const ParamCoordinator&) = delete;
  ParamCoordinator& operator=(const ParamCoordinator&) = delete;

  // Starts one micro-step's schedule: forward 0..n-1 then backward n-1..0 (2n acquires). Prefetch
  // follows this order exactly (no tracing) and never crosses into the next micro-step. Params
  // cached from the previous micro-step stay until evicted or invalidate(). A block still acquired
  // from an abandoned micro-step is treated as released (with a gatherer, every param is dropped
  // then, and the gatherer finishes that micro-step's collectives before this returns).
  void begin_micro_step();

  // The device addresses of block b's compute copies (blocks[b] order; a param listed twice gets
  // the same address), resident and complete (H2D finished) when it returns. Synchronous.
  // kFailedPrecondition naming the expected and given block when b is not next in the schedule (or
  // before begin_micro_step / after the 2n-th acquire); kOutOfMemory when the arena cannot hold the
  // block because other acquired blocks pin it; I/O errors name the block and the param.
  Result<std::vector<gpu::DevicePtr>> acquire(uint32_t block);

  // (addition) The block's addresses and an event that completes when they are resident.
  struct Acquired {
    std::vector<gpu::DevicePtr> ptrs;  // as acquire() returns them
    // Owned by the coordinator, and it may be re-recorded by the next acquire: wait on it before
    // then. Null (complete) when nothing of the block was in transfer.
    gpu::Event ready;
  };
  // As acquire(), with the same checks and errors, but it does not wait for the H2D copies: it
  // returns once the block's NVMe reads are done and its copies are queued (ahead of any prefetch,
  // on the copy stream), with `ready` completing when they have landed. The caller makes its
  // compute wait on `ready` (gpu::wait_foreign on LibTorch's stream, Device::wait, or
  // synchronize) before it touches the addresses: the host does not stall on PCIe (Note [Prefetch
  // and release]). An H2D copy that fails asynchronously is reported by a later synchronize.
  Result<Acquired> acquire_async(uint32_t block);

  // Done with block b for now: its params are released (arena space reusable) unless persistent,
  // still held by another acquired block, or used again within max_reuse_distance_elems of the
  // schedule. The caller must have completed every device operation that reads the block's
  // addresses (use the overload with an event otherwise). kFailedPrecondition when b is not held.
  Status release(uint32_t block);
  // (addition) As above, but later copies into the freed space wait (on the device, without
  // blocking the host) for `reads_done`, recorded by the caller after its last use of the block.
  Status release(uint32_t block, gpu::Event reads_done);

  // After an optimizer step the compute copies changed: drops every device-cached copy
  // (persistent ones too) so the next micro-step fetches fresh ones; waits for transfers in flight.
  // Nothing may be acquired when called (aborts otherwise: a caller bug). Call it before the
  // optimizer starts writing when the step overlaps the next forward (set_update_gate).
  void invalidate();

  // (addition) An optimizer step may be writing compute copies while this coordinator runs the
  // next forward (Note [Overlapped optimizer]): from now on acquire(b) first waits until the gate
  // holds every sub-group of block b's params final (an update failure is returned, naming the
  // block), and prefetch fetches only params whose sub-groups are final. null: no gate. The gate
  // must outlive the coordinator or be unset first.
  void set_update_gate(UpdateGate* gate);

  CoordinatorStats stats() const;

  struct Impl;

 private:
  explicit ParamCoordinator(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace zo::engine

// GradWorker: a bounded landing ring for gradients and a thread that feeds them to one
// GradAccumulator, so that backward copies a block's gradients into the ring and goes on computing
// while they are accumulated (and NVMe-resident accumulators written). Items are added in
// submission order, so the accumulators and the norm are bit-identical to calling
// GradAccumulator::add directly. submit() blocks while the ring has no room for the next item
// (back-pressure). The ring is allocated once, at create(). One producer thread; the accumulator
// must not be touched by anyone else from the first submit() until drain() returns.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>

#include "common/dtype.h"
#include "common/status.h"
#include "engine/coord/grad_accumulator.h"
#include "gpu/device.h"

namespace zo::engine {

class GradWorker {
 public:
  struct Stats {
    uint64_t full_waits = 0;  // submits that had to wait for room in the ring
    uint64_t peak_in_flight_bytes = 0;
    uint64_t items = 0;
    uint64_t in_place_items = 0;  // of them, landed where they are summed (not in the ring)
  };

  // A worker landing gradients in `ring` (non-empty, 64-byte aligned; the planner's size: the
  // largest block's gradients; the trainer carves it from the pinned pool, so that copies from the
  // GPU are DMA). `acc`, the ring's memory and `device` must outlive the worker; `device` is what
  // the events of asynchronous fills belong to (nullptr: every fill is synchronous). before_add
  // (tests) runs on the worker thread before each add, e.g. to slow the worker so that the ring fills.
  static Result<std::unique_ptr<GradWorker>> create(GradAccumulator& acc, std::span<std::byte> ring,
                                                    std::function<void()> before_add = {},
                                                    gpu::Device* device = nullptr);
  ~GradWorker();  // drops what is still queued without adding it, and stops the thread
  GradWorker(const GradWorker&) = delete;
  GradWorker& operator=(const GradWorker&) = delete;

  // Queues one contribution of `param`: `size_bytes` of `dtype`, written by `fill` on the calling
  // thread (a copy from the device or from LibTorch's tensor): fill(dest, from) writes the
  // contribution's bytes [from, from + dest.size()) into dest. That is a ring slot, the whole
  // contribution at once, or, when it lands where it is summed (GradAccumulator::reserve; Note
  // [Gradients that land where they are summed]), each run of the sums' buffers in turn. Waits for
  // room first (in the ring, or a buffer the worker has not freed yet). kInvalidArgument for an
  // item larger than the ring; fill's error is returned with nothing queued. Once an add has failed, nothing more is added until drain(): queued items are dropped
  // and submit() returns that first error at once.
  // An asynchronous fill (a D2H copy still queued on a stream when fill returns) passes `ready`, an
  // event of the worker's device recorded behind it (by fill): the worker waits for the event's
  // latest record before it reads the slot, and its failure is the add's.
  using Fill = std::function<Status(std::span<std::byte> dest, uint64_t from)>;
  Status submit(uint32_t param, DType dtype, uint64_t size_bytes, const Fill& fill, gpu::Event ready = {});

  // Waits until every queued item is added or dropped and the accumulator's queued writes are
  // finished (GradAccumulator::finish_writes); returns the first add or write error since the
  // previous drain() (naming the param and, for I/O, the sub-group, file and offset) and clears it,
  // so the next micro-step starts clean.
  Status drain();

  uint64_t ring_bytes() const;
  Stats stats() const;

  struct Impl;

 private:
  explicit GradWorker(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace zo::engine

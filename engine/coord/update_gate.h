// UpdateGate: how far an optimizer step running behind the next forward has got. The optimizer's
// thread publishes each sub-group whose new compute copy is at its home; the coordinator's thread
// asks whether (or waits until) the sub-groups a block needs are final, so the forward of step N+1
// reads block k as soon as step N's update of block k is written, never a stale or torn copy
// (Note [Overlapped optimizer] in update_gate.cpp). Thread-safe: any method from any thread.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <vector>

#include "common/status.h"

namespace zo::engine {

class UpdateGate {
 public:
  // n_groups: the store's sub-groups. Starts closed (no update running: everything final).
  // `always_final` (empty, or one flag per sub-group): sub-groups no update writes, final even
  // while one runs (the frozen ones, MemoryPlan::frozen).
  explicit UpdateGate(uint32_t n_groups, std::vector<uint8_t> always_final = {});

  // An update starts: no sub-group is final until published. Nobody may be waiting.
  void open();
  // Sub-group g's new compute copy is at its home (the optimizer's thread, once per g per update;
  // a second publish of g is ignored).
  void publish(uint32_t g);
  // The update is over: every sub-group final when `status` is ok; otherwise the sub-groups not yet
  // published never will be, and every wait for one of them returns `status` until the gate is
  // closed again with ok (or opened) — e.g. once the failure has been reported.
  void close(const Status& status);

  // Sub-groups [0, final_prefix()) are final. Lock-free; an acquire load, so the compute copies of
  // those sub-groups are visible to the caller.
  uint32_t final_prefix() const { return prefix_.load(std::memory_order_acquire); }
  // Blocks until sub-groups [0, n) are final (ok) or the update failed before reaching them (its
  // Status). n ≤ n_groups.
  Status wait_prefix(uint32_t n);

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<uint8_t> final_;
  std::vector<uint8_t> always_final_;
  uint32_t n_groups_ = 0;
  std::atomic<uint32_t> prefix_;
  Status failure_;
};

}  // namespace zo::engine

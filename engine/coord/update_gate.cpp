#include "engine/coord/update_gate.h"

#include <algorithm>
#include <utility>

#include "common/check.h"

// Note [Overlapped optimizer]
//
// The optimizer of step N runs on its own thread while the main thread reads the next batch and
// runs the forward of step N+1's first micro-batch (docs/design.md, "The overlapped step").
// Sub-groups are updated in registry order, which is forward order (embedding, layers, head), so
// the forward trails the optimizer: block k waits only for the sub-groups holding its params.
// Before the update starts the coordinator drops every cached compute copy (invalidate()), so a
// block can only be read from its home, and only once the gate says the home holds the new copy:
// acquire waits for the block's sub-groups, prefetch stops at the first param that is not final.
// The backward needs every block, and the head's sub-groups come last, so the trainer joins the
// optimizer before the head: gradients of step N+1 never meet an accumulator the optimizer of step
// N is still reading. Nothing is computed from a different value than in the sequential step, so
// the weights are bit-identical to it.

namespace zo::engine {

UpdateGate::UpdateGate(uint32_t n_groups, std::vector<uint8_t> always_final)
    : final_(n_groups, 1), always_final_(std::move(always_final)), n_groups_(n_groups), prefix_(n_groups) {
  if (always_final_.empty()) always_final_.assign(n_groups, 0);
  ZO_CHECK_EQ(always_final_.size(), uint64_t{n_groups});
}

void UpdateGate::open() {
  std::lock_guard<std::mutex> lock(mu_);
  final_ = always_final_;
  failure_ = Status::ok();
  uint32_t p = 0;
  while (p < n_groups_ && final_[p] != 0) ++p;
  prefix_.store(p, std::memory_order_release);
}

void UpdateGate::publish(uint32_t g) {
  ZO_CHECK_LT(g, n_groups_);
  {
    std::lock_guard<std::mutex> lock(mu_);
    final_[g] = 1;
    uint32_t p = prefix_.load(std::memory_order_relaxed);
    while (p < n_groups_ && final_[p] != 0) ++p;
    prefix_.store(p, std::memory_order_release);
  }
  cv_.notify_all();
}

void UpdateGate::close(const Status& status) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (status.is_ok()) {
      std::fill(final_.begin(), final_.end(), 1);
      prefix_.store(n_groups_, std::memory_order_release);
      failure_ = Status::ok();
    } else {
      failure_ = status;
    }
  }
  cv_.notify_all();
}

Status UpdateGate::wait_prefix(uint32_t n) {
  ZO_CHECK_LE(n, n_groups_);
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return prefix_.load(std::memory_order_relaxed) >= n || !failure_.is_ok(); });
  if (prefix_.load(std::memory_order_relaxed) >= n) return Status::ok();
  return failure_;
}

}  // namespace zo::engine

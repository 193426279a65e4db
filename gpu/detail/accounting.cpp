#include "gpu/detail/accounting.h"

#include "common/bytes.h"
#include "common/check.h"

namespace zo::gpu::detail {
namespace {

std::string describe(uint64_t n) { return format_bytes(n) + " (" + std::to_string(n) + " bytes)"; }

// The live entry of `table` containing address `a`, or table.end().
std::map<uintptr_t, uint64_t>::const_iterator containing(const std::map<uintptr_t, uint64_t>& table, uintptr_t a) {
  auto it = table.upper_bound(a);
  if (it == table.begin()) return table.end();
  --it;
  return a < it->first + it->second ? it : table.end();
}

}  // namespace

Status Accounting::reserve(uint64_t size_bytes) {
  if (size_bytes == 0) return invalid_argument("device allocation of 0 bytes");
  const uint64_t rounded = round_up(size_bytes);
  std::lock_guard lock(mu_);
  if (rounded > budget_bytes_ || allocated_bytes_ > budget_bytes_ - rounded) {
    return out_of_memory("device memory budget exceeded: requested " + describe(size_bytes) + ", " +
                         describe(allocated_bytes_) + " in use, budget " + describe(budget_bytes_));
  }
  allocated_bytes_ += rounded;
  if (allocated_bytes_ > peak_allocated_bytes_) peak_allocated_bytes_ = allocated_bytes_;
  return Status::ok();
}

void Accounting::release(uint64_t size_bytes) {
  const uint64_t rounded = round_up(size_bytes);
  std::lock_guard lock(mu_);
  ZO_CHECK_LE(rounded, allocated_bytes_);
  allocated_bytes_ -= rounded;
}

void Accounting::commit(void* addr, uint64_t size_bytes) {
  std::lock_guard lock(mu_);
  const bool inserted = allocations_.emplace(reinterpret_cast<uintptr_t>(addr), round_up(size_bytes)).second;
  ZO_CHECK(inserted) << "device address " << addr << " handed out twice";
}

uint64_t Accounting::forget(void* addr) {
  std::lock_guard lock(mu_);
  auto it = allocations_.find(reinterpret_cast<uintptr_t>(addr));
  ZO_CHECK(it != allocations_.end()) << "free of " << addr << ", which is not a live device allocation";
  const uint64_t rounded = it->second;
  allocations_.erase(it);
  allocated_bytes_ -= rounded;
  return rounded;
}

Status Accounting::check_range(const void* addr, uint64_t size_bytes, const char* what) const {
  const auto a = reinterpret_cast<uintptr_t>(addr);
  std::lock_guard lock(mu_);
  auto it = containing(allocations_, a);
  if (it == allocations_.end()) {
    return invalid_argument(std::string(what) + " " + std::to_string(a) + " is not inside a live device allocation");
  }
  if (size_bytes > it->first + it->second - a) {
    return invalid_argument(std::string(what) + ": " + std::to_string(size_bytes) + " bytes at offset " +
                            std::to_string(a - it->first) + " run past the end of a " + std::to_string(it->second) +
                            "-byte device allocation");
  }
  return Status::ok();
}

void Accounting::add_pinned(void* ptr, uint64_t size_bytes) {
  std::lock_guard lock(mu_);
  pinned_.emplace(reinterpret_cast<uintptr_t>(ptr), size_bytes);
  pinned_bytes_ += size_bytes;
}

uint64_t Accounting::forget_pinned(void* ptr) {
  std::lock_guard lock(mu_);
  auto it = pinned_.find(reinterpret_cast<uintptr_t>(ptr));
  ZO_CHECK(it != pinned_.end()) << "free_pinned of " << ptr << ", which allocate_pinned did not return";
  const uint64_t n = it->second;
  pinned_.erase(it);
  pinned_bytes_ -= n;
  return n;
}

Status Accounting::check_unregistered(const void* ptr, uint64_t size_bytes) const {
  const auto a = reinterpret_cast<uintptr_t>(ptr);
  std::lock_guard lock(mu_);
  auto it = registered_.lower_bound(a);
  const bool overlaps_next = it != registered_.end() && it->first < a + size_bytes;
  const bool overlaps_prev = it != registered_.begin() && std::prev(it)->first + std::prev(it)->second > a;
  if (overlaps_next || overlaps_prev) {
    return invalid_argument("register_host: [" + std::to_string(a) + ", +" + std::to_string(size_bytes) +
                            ") overlaps memory that is already registered");
  }
  return Status::ok();
}

void Accounting::add_registered(void* ptr, uint64_t size_bytes) {
  std::lock_guard lock(mu_);
  registered_.emplace(reinterpret_cast<uintptr_t>(ptr), size_bytes);
  registered_bytes_ += size_bytes;
}

uint64_t Accounting::forget_registered(void* ptr) {
  std::lock_guard lock(mu_);
  auto it = registered_.find(reinterpret_cast<uintptr_t>(ptr));
  ZO_CHECK(it != registered_.end()) << "unregister_host of " << ptr << ", which is not registered";
  const uint64_t n = it->second;
  registered_.erase(it);
  registered_bytes_ -= n;
  return n;
}

DeviceStats Accounting::stats() const {
  DeviceStats s;
  {
    std::lock_guard lock(mu_);
    s.budget_bytes = budget_bytes_;
    s.allocated_bytes = allocated_bytes_;
    s.peak_allocated_bytes = peak_allocated_bytes_;
    s.pinned_bytes = pinned_bytes_;
    s.registered_bytes = registered_bytes_;
  }
  s.h2d_bytes = h2d_bytes_.load(std::memory_order_relaxed);
  s.d2h_bytes = d2h_bytes_.load(std::memory_order_relaxed);
  s.d2d_bytes = d2d_bytes_.load(std::memory_order_relaxed);
  return s;
}

}  // namespace zo::gpu::detail

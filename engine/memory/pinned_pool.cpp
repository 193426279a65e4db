#include "engine/memory/pinned_pool.h"

#include <linux/capability.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <map>
#include <optional>
#include <mutex>
#include <string>

#include "common/aligned_buffer.h"
#include "common/bytes.h"
#include "common/check.h"

// The pool is sized once, from the plan (Note [Pinned pool sizing] in memory_plan.cpp), and
// carved during setup. One allocation rather than one per buffer: cudaHostAlloc is slow and
// serialising, and a single block makes the cap a hard, checkable number.

namespace zo::engine {

namespace {

// CAP_IPC_LOCK in the effective set, asked of the kernel directly so that no /proc parsing can
// get it wrong; nullopt when capget itself is unavailable (seccomp).
std::optional<bool> has_cap_ipc_lock() {
  __user_cap_header_struct header{};
  header.version = _LINUX_CAPABILITY_VERSION_3;
  header.pid = 0;
  __user_cap_data_struct data[_LINUX_CAPABILITY_U32S_3] = {};
  if (syscall(SYS_capget, &header, data) != 0) return std::nullopt;
  return (data[CAP_IPC_LOCK / 32].effective & (1u << (CAP_IPC_LOCK % 32))) != 0;
}

}  // namespace

bool process_can_lock_unlimited() {
  // The kernel lets a process lock past RLIMIT_MEMLOCK only with CAP_IPC_LOCK (mm/mlock.c
  // can_do_mlock). Root in a container usually lacks it, so euid 0 is only a fallback for when the
  // capability set cannot be read.
  if (auto cap = has_cap_ipc_lock()) return *cap;
  return geteuid() == 0;
}

Status check_pinned_cap(uint64_t cap_bytes, bool pin, const HostInfo& host, bool can_lock_unlimited,
                        std::string_view what, std::string_view ram_remedy) {
  const std::string name(what);
  if (cap_bytes > host.mem_available_bytes || host.mem_available_bytes - cap_bytes < kHostMemoryReserveBytes) {
    return out_of_memory(name + ": " + std::string(pin ? "pinned" : "host") + " memory of " + format_bytes(cap_bytes) +
                         " plus " + format_bytes(kHostMemoryReserveBytes) +
                         " kept free for the system does not fit in the " + format_bytes(host.mem_available_bytes) +
                         " of RAM available (MemAvailable, of " + format_bytes(host.mem_total_bytes) + " total); " +
                         (ram_remedy.empty()
                              ? "lower " + name + ", offload more to NVMe, or use a machine with more RAM"
                              : std::string(ram_remedy)));
  }
  if (pin && !can_lock_unlimited && host.memlock_limit_bytes != UINT64_MAX && cap_bytes > host.memlock_limit_bytes) {
    return out_of_memory(name + ": pinned memory of " + format_bytes(cap_bytes) +
                         " exceeds the locked-memory limit of " + format_bytes(host.memlock_limit_bytes) +
                         " (ulimit -l) and the process lacks CAP_IPC_LOCK; raise the limit (`ulimit -l unlimited`"
                         ", a memlock line in /etc/security/limits.conf, LimitMEMLOCK= for a systemd unit, or "
                         "--ulimit memlock=-1 for docker), or set pin_memory false in the offload config");
  }
  return Status::ok();
}

struct PinnedPool::Impl {
  gpu::Device* device = nullptr;
  bool pin = false;
  MemoryAccounting* accounting = nullptr;
  std::byte* base = nullptr;
  uint64_t capacity = 0;
  AlignedBuffer pageable;  // owns the bytes when not pinned

  std::mutex mu;
  // Free runs and carved spans, both keyed by byte offset from base. Ordered maps give first fit
  // in address order and O(log n) coalescing on free; the pool holds tens of spans, not millions.
  std::map<uint64_t, uint64_t> free_runs;
  std::map<uint64_t, uint64_t> carved;
  uint64_t used = 0;
  uint64_t peak = 0;
};

Result<std::unique_ptr<PinnedPool>> PinnedPool::create(gpu::Device& device, uint64_t capacity_bytes, bool pin,
                                                       MemoryAccounting* accounting) {
  auto impl = std::make_unique<Impl>();
  impl->device = &device;
  impl->pin = pin;
  impl->accounting = accounting;
  impl->capacity = align_up(capacity_bytes, kPinnedAlignment);
  if (impl->capacity > 0) {
    if (pin) {
      auto p = device.allocate_pinned(impl->capacity);
      if (!p.is_ok()) {
        Status s = p.status();
        return s.with_context("pinned pool of " + format_bytes(impl->capacity));
      }
      impl->base = static_cast<std::byte*>(*p);
    } else {
      auto buf = AlignedBuffer::allocate(impl->capacity, kPinnedAlignment);
      if (!buf.is_ok()) {
        return out_of_memory("host buffer pool of " + format_bytes(impl->capacity) + ": " + buf.status().message());
      }
      impl->pageable = std::move(buf).value();
      impl->base = impl->pageable.data();
    }
    impl->free_runs.emplace(0, impl->capacity);
    if (accounting != nullptr) accounting->add_resident(Tier::kCpu, impl->capacity, pin);
  }
  return std::unique_ptr<PinnedPool>(new PinnedPool(std::move(impl)));
}

PinnedPool::PinnedPool(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

PinnedPool::~PinnedPool() {
  if (impl_->capacity == 0) return;
  if (impl_->pin) impl_->device->free_pinned(impl_->base);
  if (impl_->accounting != nullptr) impl_->accounting->remove_resident(Tier::kCpu, impl_->capacity, impl_->pin);
}

Result<std::span<std::byte>> PinnedPool::allocate(uint64_t size_bytes, std::string_view what) {
  ZO_CHECK(size_bytes > 0) << "PinnedPool::allocate of 0 bytes for " << what;
  const uint64_t size = align_up(size_bytes, kPinnedAlignment);
  std::lock_guard lock(impl_->mu);
  auto it = std::find_if(impl_->free_runs.begin(), impl_->free_runs.end(),
                         [&](const auto& run) { return run.second >= size; });
  if (it == impl_->free_runs.end()) {
    uint64_t largest = 0;
    for (const auto& run : impl_->free_runs) largest = std::max(largest, run.second);
    return out_of_memory(std::string(what) + ": cannot carve " + format_bytes(size) + " from the " +
                         (impl_->pin ? "pinned" : "host") + " pool: " + format_bytes(impl_->used) + " of " +
                         format_bytes(impl_->capacity) + " in use, largest free run " + format_bytes(largest) +
                         " (the pool is sized from the memory plan; this is a sizing bug or a larger "
                         "zoffload.pinned_memory_limit is needed)");
  }
  const uint64_t offset = it->first;
  const uint64_t run = it->second;
  impl_->free_runs.erase(it);
  if (run > size) impl_->free_runs.emplace(offset + size, run - size);
  impl_->carved.emplace(offset, size);
  impl_->used += size;
  impl_->peak = std::max(impl_->peak, impl_->used);
  return std::span<std::byte>(impl_->base + offset, size);
}

void PinnedPool::free(std::span<std::byte> span) {
  std::lock_guard lock(impl_->mu);
  ZO_CHECK(span.data() >= impl_->base && span.data() < impl_->base + impl_->capacity)
      << "PinnedPool::free of a pointer not from this pool";
  const uint64_t offset = static_cast<uint64_t>(span.data() - impl_->base);
  auto it = impl_->carved.find(offset);
  ZO_CHECK(it != impl_->carved.end()) << "PinnedPool::free of offset " << offset << " which is not carved";
  uint64_t start = offset;
  uint64_t size = it->second;
  impl_->carved.erase(it);
  impl_->used -= size;
  // Coalesce with the neighbouring free runs so a freed pair of buffers can hold one larger one.
  auto next = impl_->free_runs.lower_bound(start);
  if (next != impl_->free_runs.end() && next->first == start + size) {
    size += next->second;
    next = impl_->free_runs.erase(next);
  }
  if (next != impl_->free_runs.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == start) {
      start = prev->first;
      size += prev->second;
      impl_->free_runs.erase(prev);
    }
  }
  impl_->free_runs.emplace(start, size);
}

bool PinnedPool::pinned() const { return impl_->pin; }
uint64_t PinnedPool::capacity_bytes() const { return impl_->capacity; }

uint64_t PinnedPool::used_bytes() const {
  std::lock_guard lock(impl_->mu);
  return impl_->used;
}

uint64_t PinnedPool::peak_used_bytes() const {
  std::lock_guard lock(impl_->mu);
  return impl_->peak;
}

}  // namespace zo::engine

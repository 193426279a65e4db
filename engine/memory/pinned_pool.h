// PinnedPool: the one block of pinned (page-locked) host memory allocated at start, with a hard
// cap, out of which every pinned buffer of the engine is carved during setup — never inside the
// step loop (see Note [Pinned pool sizing] in memory_plan.cpp). Also the start-up check of a cap
// against the machine (RAM, ulimit -l). Thread-safe; carved spans belong to the caller until
// free() and must not outlive the pool.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "common/host_info.h"
#include "common/status.h"
#include "engine/memory/accounting.h"
#include "gpu/device.h"

namespace zo::engine {

// Carved spans start on, and are sized in multiples of, this many bytes (O_DIRECT-ready).
inline constexpr uint64_t kPinnedAlignment = 4096;

// RAM kept free for the OS, the process and page cache when checking a cap against the machine.
inline constexpr uint64_t kHostMemoryReserveBytes = uint64_t{2} << 30;

// Whether the process may lock memory beyond RLIMIT_MEMLOCK (root or CAP_IPC_LOCK).
bool process_can_lock_unlimited();

// Checks, before anything is allocated, that `cap_bytes` of pinned memory can exist here:
// - cap + reserve must fit in MemAvailable (kOutOfMemory naming cap, available RAM, reserve);
// - if `pin` and the process is subject to RLIMIT_MEMLOCK (`can_lock_unlimited` false), the cap
//   must fit under host.memlock_limit_bytes (kOutOfMemory naming cap and `ulimit -l`, and how to
//   raise it or set pin_memory false).
// `what` names the amount for the message, e.g. "zoffload.pinned_memory_limit"; `ram_remedy`
// replaces the default advice when RAM is short ("lower <what>, offload more to NVMe, or use a
// machine with more RAM").
Status check_pinned_cap(uint64_t cap_bytes, bool pin, const HostInfo& host, bool can_lock_unlimited,
                        std::string_view what, std::string_view ram_remedy = {});

class PinnedPool {
 public:
  // Allocates `capacity_bytes` (rounded up to kPinnedAlignment; 0 allowed: an empty pool) once:
  // device.allocate_pinned() when `pin`, else 4 KiB-aligned pageable memory. Counts it in
  // `accounting` (if given) as CPU-resident, pinned when `pin`. kOutOfMemory on failure.
  static Result<std::unique_ptr<PinnedPool>> create(gpu::Device& device, uint64_t capacity_bytes, bool pin,
                                                    MemoryAccounting* accounting);
  ~PinnedPool();
  PinnedPool(const PinnedPool&) = delete;
  PinnedPool& operator=(const PinnedPool&) = delete;

  // Carves `size_bytes` (> 0; rounded up to kPinnedAlignment), first fit. Contents are unspecified.
  // kOutOfMemory when no free run is large enough, naming `what`, the size, the bytes in use and
  // the capacity.
  Result<std::span<std::byte>> allocate(uint64_t size_bytes, std::string_view what);
  // Returns a span from allocate() (same data pointer). Unknown pointer: aborts.
  void free(std::span<std::byte> span);

  bool pinned() const;
  uint64_t capacity_bytes() const;
  uint64_t used_bytes() const;       // carved now (rounded sizes)
  uint64_t peak_used_bytes() const;  // high-water mark of used_bytes

  struct Impl;

 private:
  explicit PinnedPool(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace zo::engine

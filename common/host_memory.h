// Large host allocations on transparent huge pages: the memory every O_DIRECT transfer, pinned
// pool and optimizer state lives in. Thread-safe (plain mmap/munmap); the caller owns what it gets
// and frees it with free_host() and the same size.
#pragma once

#include <cstddef>
#include <string>

namespace zo {

inline constexpr size_t kHugePageBytes = size_t{2} << 20;

// `size_bytes` (> 0) bytes aligned to `alignment` (a power of two ≤ kHugePageBytes), zero-filled
// and not yet touched, or nullptr when the kernel refuses. Sizes of at least kHugePageBytes are
// mapped on a 2 MiB boundary and advised MADV_HUGEPAGE (Note [Huge pages for I/O buffers]);
// smaller ones come from aligned_alloc.
void* allocate_host(size_t size_bytes, size_t alignment);

// Frees what allocate_host(size_bytes, …) returned; nullptr is a no-op.
void free_host(void* ptr, size_t size_bytes);

// The kernel's transparent huge page mode ("always", "madvise" or "never", from
// /sys/kernel/mm/transparent_hugepage/enabled), or "unavailable" without THP support.
std::string transparent_huge_pages_mode();

}  // namespace zo

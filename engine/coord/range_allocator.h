// RangeAllocator: first-fit allocation of aligned byte ranges inside one fixed range (the
// coordinator's device arena), with coalescing of freed neighbours. Deterministic: the same calls
// give the same offsets. Not thread-safe. Offsets only; it owns no memory.
#pragma once

#include <cstdint>
#include <map>
#include <optional>

namespace zo::engine::detail {

class RangeAllocator {
 public:
  RangeAllocator() = default;
  // Manages [begin, begin + size_bytes); both multiples of `alignment` (a power of two).
  RangeAllocator(uint64_t begin, uint64_t size_bytes, uint64_t alignment);

  // The lowest free offset where `size_bytes` (rounded up to the alignment, > 0) fits; nullopt when
  // no free range is large enough (the total free may still be larger: fragmentation).
  std::optional<uint64_t> allocate(uint64_t size_bytes);
  // Returns a range from allocate() with the same size_bytes. Unknown or overlapping: aborts.
  void free(uint64_t offset, uint64_t size_bytes);

  uint64_t free_bytes() const { return free_bytes_; }
  uint64_t largest_free_bytes() const;
  uint64_t size_bytes() const { return size_bytes_; }
  uint64_t rounded(uint64_t size_bytes) const { return (size_bytes + alignment_ - 1) & ~(alignment_ - 1); }

 private:
  uint64_t begin_ = 0;
  uint64_t size_bytes_ = 0;
  uint64_t alignment_ = 1;
  uint64_t free_bytes_ = 0;
  std::map<uint64_t, uint64_t> free_;  // offset → length of each free range, never adjacent
};

}  // namespace zo::engine::detail

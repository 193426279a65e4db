#include "engine/coord/range_allocator.h"

#include <algorithm>
#include <iterator>

#include "common/check.h"

namespace zo::engine::detail {

RangeAllocator::RangeAllocator(uint64_t begin, uint64_t size_bytes, uint64_t alignment)
    : begin_(begin), size_bytes_(size_bytes), alignment_(alignment), free_bytes_(size_bytes) {
  ZO_CHECK(alignment > 0 && (alignment & (alignment - 1)) == 0)
      << "alignment " << alignment << " is not a power of two";
  ZO_CHECK(begin % alignment == 0 && size_bytes % alignment == 0)
      << "range [" << begin << ", +" << size_bytes << ") is not " << alignment << "-aligned";
  if (size_bytes > 0) free_.emplace(begin, size_bytes);
}

std::optional<uint64_t> RangeAllocator::allocate(uint64_t size_bytes) {
  ZO_CHECK(size_bytes > 0) << "allocate of 0 bytes";
  const uint64_t need = rounded(size_bytes);
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    if (it->second < need) continue;
    const uint64_t offset = it->first;
    const uint64_t rest = it->second - need;
    free_.erase(it);
    if (rest > 0) free_.emplace(offset + need, rest);
    free_bytes_ -= need;
    return offset;
  }
  return std::nullopt;
}

void RangeAllocator::free(uint64_t offset, uint64_t size_bytes) {
  const uint64_t len = rounded(size_bytes);
  ZO_CHECK(offset >= begin_ && offset + len <= begin_ + size_bytes_)
      << "free of [" << offset << ", +" << len << ") outside the range";
  auto next = free_.lower_bound(offset);
  ZO_CHECK(next == free_.end() || next->first >= offset + len)
      << "free of [" << offset << ", +" << len << ") overlaps a free range (double free?)";
  uint64_t start = offset;
  uint64_t end = offset + len;
  if (next != free_.begin()) {
    auto prev = std::prev(next);
    ZO_CHECK(prev->first + prev->second <= offset)
        << "free of [" << offset << ", +" << len << ") overlaps a free range (double free?)";
    if (prev->first + prev->second == offset) {
      start = prev->first;
      free_.erase(prev);
    }
  }
  if (next != free_.end() && next->first == end) {
    end += next->second;
    free_.erase(next);
  }
  free_.emplace(start, end - start);
  free_bytes_ += len;
}

uint64_t RangeAllocator::largest_free_bytes() const {
  uint64_t best = 0;
  for (const auto& [offset, len] : free_) best = std::max(best, len);
  return best;
}

}  // namespace zo::engine::detail

#include "common/aligned_buffer.h"

#include <cstring>
#include <utility>

#include "common/bytes.h"
#include "common/host_memory.h"

namespace zo {

Result<AlignedBuffer> AlignedBuffer::allocate(size_t size_bytes, size_t alignment) {
  ZO_CHECK(alignment >= sizeof(void*) && (alignment & (alignment - 1)) == 0 && alignment <= kHugePageBytes)
      << "alignment " << alignment;
  AlignedBuffer buf;
  buf.alignment_ = alignment;
  if (size_bytes == 0) return buf;
  // Large buffers land on huge pages (Note [Huge pages for I/O buffers]).
  void* p = allocate_host(size_bytes, alignment);
  if (p == nullptr)
    return out_of_memory("cannot allocate " + format_bytes(size_bytes) + " of host memory aligned to " +
                         std::to_string(alignment));
  std::memset(p, 0, size_bytes);
  buf.data_ = static_cast<std::byte*>(p);
  buf.size_ = size_bytes;
  return buf;
}

AlignedBuffer::AlignedBuffer(AlignedBuffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      alignment_(std::exchange(other.alignment_, 0)) {}

AlignedBuffer& AlignedBuffer::operator=(AlignedBuffer&& other) noexcept {
  if (this != &other) {
    free_host(data_, size_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    alignment_ = std::exchange(other.alignment_, 0);
  }
  return *this;
}

AlignedBuffer::~AlignedBuffer() { free_host(data_, size_); }

}  // namespace zo

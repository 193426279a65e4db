// AlignedBuffer: an owned, zero-initialised heap buffer aligned for O_DIRECT and SIMD (4 KiB by
// default), on huge pages from 2 MiB up (common/host_memory.h). Move-only; not thread-safe
// (callers synchronise access to the bytes).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "common/status.h"

namespace zo {

inline constexpr size_t kDirectIoAlignment = 4096;

class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  // Allocates `size_bytes` (may be 0) aligned to `alignment` (a power of two ≥ sizeof(void*) and
  // ≤ 2 MiB), and touches every byte so that no page faults later in a hot loop.
  static Result<AlignedBuffer> allocate(size_t size_bytes, size_t alignment = kDirectIoAlignment);

  AlignedBuffer(AlignedBuffer&& other) noexcept;
  AlignedBuffer& operator=(AlignedBuffer&& other) noexcept;
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  ~AlignedBuffer();

  std::byte* data() { return data_; }
  const std::byte* data() const { return data_; }
  size_t size() const { return size_; }
  size_t alignment() const { return alignment_; }
  std::span<std::byte> bytes() { return {data_, size_}; }
  std::span<const std::byte> bytes() const { return {data_, size_}; }
  template <typename T>
  std::span<T> as() {
    return {reinterpret_cast<T*>(data_), size_ / sizeof(T)};
  }

 private:
  std::byte* data_ = nullptr;
  size_t size_ = 0;
  size_t alignment_ = 0;
};

}  // namespace zo

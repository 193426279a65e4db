// Comparing a device's output elements with cpu_optim's where a step may make NaNs: every bit equal,
// except that a NaN matches a NaN of any sign and payload (docs/gpu.md, "Adam on the device": NaN
// payloads are not part of the contract; x86 makes 0xFFC00000 where CUDA makes 0x7FFFFFFF).
// Header-only, pure functions; thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>

#include "common/dtype.h"

namespace zo::gpu::test {

// Whether the element at `at` (fp32, bf16 or fp16, little-endian) is a NaN.
inline bool is_nan_elem(const uint8_t* at, DType dtype) {
  if (dtype == DType::kF32) {
    uint32_t u;
    std::memcpy(&u, at, 4);
    return (u & 0x7FFFFFFFu) > 0x7F800000u;
  }
  uint16_t h;
  std::memcpy(&h, at, 2);
  return (h & 0x7FFFu) > (dtype == DType::kBF16 ? 0x7F80u : 0x7C00u);
}

// True when a and b hold the same number of `dtype` elements and each pair has the same bits or is
// NaN on both sides. Otherwise false, with *first_diff (when given) the first element that differs
// (the element count when only the sizes do).
inline bool same_bits_up_to_nan_payload(std::span<const uint8_t> a, std::span<const uint8_t> b, DType dtype,
                                        size_t* first_diff = nullptr) {
  const size_t w = dtype_size_bytes(dtype);
  if (a.size() != b.size() || a.size() % w != 0) {
    if (first_diff != nullptr) *first_diff = a.size() / w;
    return false;
  }
  for (size_t i = 0; i < a.size() / w; ++i) {
    const uint8_t* x = a.data() + i * w;
    const uint8_t* y = b.data() + i * w;
    if (std::memcmp(x, y, w) == 0 || (is_nan_elem(x, dtype) && is_nan_elem(y, dtype))) continue;
    if (first_diff != nullptr) *first_diff = i;
    return false;
  }
  return true;
}

}  // namespace zo::gpu::test

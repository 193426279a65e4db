// CRC-32C (Castagnoli), as used by checkpoint manifests. Uses the SSE4.2 crc32 instruction when the
// CPU has it (chosen once at run time), a table otherwise. Pure functions; thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>

namespace zo {

// Extends `crc` (0 to start) with `n` bytes; crc32c(crc32c(0, a), b) == crc32c(0, a+b).
uint32_t crc32c_extend(uint32_t crc, const void* data, size_t n);
inline uint32_t crc32c(const void* data, size_t n) { return crc32c_extend(0, data, n); }

// The CRC-32C of the concatenation A‖B, given crc_a = crc32c(A), crc_b = crc32c(B) and len_b = B's
// length in bytes (A's length is not needed; either may be empty). Lets pieces checksummed apart
// (by different writers, threads or processes) be joined into the CRC of the whole without reading
// the bytes again. O(log len_b): about 32 shift-xor steps per set bit of len_b, no allocation.
uint32_t crc32c_combine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b);

// Whether the hardware path is in use (for logs and benchmarks).
bool crc32c_is_hardware();

namespace detail {
uint32_t crc32c_extend_portable(uint32_t crc, const void* data, size_t n);
}  // namespace detail

}  // namespace zo

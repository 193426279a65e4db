// Parsing and printing of byte sizes ("24GiB", "5GB", "128K", 5e8) and element counts ("5e8").
// Pure functions; thread-safe.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "common/status.h"

namespace zo {

inline constexpr uint64_t kKiB = 1024;
inline constexpr uint64_t kMiB = 1024 * kKiB;
inline constexpr uint64_t kGiB = 1024 * kMiB;
inline constexpr uint64_t kTiB = 1024 * kGiB;

// A size in bytes. Accepts a plain or scientific number ("4096", "5e8", "1.5e9") and a number
// followed by an optional space and a unit, case-insensitive:
//   B; K, KiB, M, MiB, G, GiB, T, TiB  → powers of 1024 (the single letters as fio and dd use them);
//   KB, MB, GB, TB                     → powers of 1000 (as Hugging Face's "5GB" shard size).
// Fractions are allowed ("1.5GiB") as long as the result is a whole number of bytes.
// Fails on negative, empty, overflowing or unknown-unit input, naming the text.
Result<uint64_t> parse_size_bytes(std::string_view text);

// A non-negative whole count written as an integer or in scientific notation ("5e8", "1e9",
// "100000"). Fails on fractions ("1.5"), negatives and overflow.
Result<uint64_t> parse_count(std::string_view text);

// "24.0 GiB", "512 B", "1.50 MiB": binary units, three significant figures.
std::string format_bytes(uint64_t size_bytes);

// "3.41 M", "1.24 B", "4096": element and parameter counts for humans.
std::string format_count(uint64_t n);

// Rounds `n` up (align_up) or down (align_down) to a multiple of `alignment` (a power of two).
constexpr uint64_t align_up(uint64_t n, uint64_t alignment) { return (n + alignment - 1) & ~(alignment - 1); }
constexpr uint64_t align_down(uint64_t n, uint64_t alignment) { return n & ~(alignment - 1); }
constexpr bool is_aligned(uint64_t n, uint64_t alignment) { return (n & (alignment - 1)) == 0; }

}  // namespace zo

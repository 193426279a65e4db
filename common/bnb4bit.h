// bitsandbytes' 4-bit blockwise quantization (NF4 and FP4), as bitsandbytes 0.50.2 defines it: the
// codes of get_4bit_type, the packing of quantize_4bit (two codes a byte, the even element in the
// high nibble) and the arithmetic of its reference dequantize_4bit (code × the block's absmax in
// fp32, then rounded to the compute dtype). Host code; what the device runs too is in
// common/bnb4_blob.h. Thread-safe.
// tests/common/bnb4bit_bnb_test.py checks all of it against bitsandbytes (Note [4-bit blocks]).
#pragma once

#include <array>
#include <cstdint>
#include <string_view>

#include "common/bnb4_blob.h"
#include "common/dtype.h"
#include "common/half.h"

namespace zo::bnb4 {

// Note [4-bit blocks]
// ~~~~~~~~~~~~~~~~~~~
// A tensor of n elements, flattened in row-major order, is cut into blocks of `blocksize` elements
// (bitsandbytes: 32 … 4096, a power of two; the last block partial when blocksize does not divide
// n), each scaled by its largest |x|, its absmax (fp32, one per block). Element i is the 4-bit code
// q_i, an index into a table of 16 values in [-1, 1], and reads back as table[q_i] × absmax[i /
// blocksize] in fp32. Codes are packed two a byte, element 2k in the high nibble, 2k+1 in the low
// one, so n elements take ⌈n / 2⌉ bytes (an odd n pads the last byte with the code of 0).
// Quantizing (bitsandbytes' quantize_4bit, its default backend, which the CPU runs):
// - a whole block is scaled by multiplying with 1 / max(absmax, 1e-38), the partial last block by
//   dividing by max(absmax, 1e-38), which is also the absmax that block stores (a whole block
//   stores its absmax as it is); the quotient is clamped to [-1, 1];
// - the code is the bucket of the scaled value among the midpoints between the table's values
//   sorted ascending (a value on a midpoint takes the lower bucket), mapped back to its index in
//   the table (FP4's table is not sorted; ties in the sort, its +0 and the other +0, keep table
//   order).
// Double quantization ("compress_statistics", bnb_4bit_use_double_quant) stores the absmax values
// themselves in 8 bits: absmax − offset (the mean of the absmax values, fp32) quantized blockwise
// with 256 per block against bitsandbytes' signed dynamic map; they read back as
// map[c_j] × absmax2[j / 256] + offset, in fp32.
// bitsandbytes' own CPU library reads a zero code of FP4 as −0 where this table (and its reference
// path) gives +0; every other bit agrees.

enum class QuantType : uint8_t { kNf4 = 0, kFp4 = 1 };

// "nf4", "fp4"; false for anything else.
bool parse_quant_type(std::string_view name, QuantType* out);
std::string_view quant_type_name(QuantType type);

// bitsandbytes' get_4bit_type("nf4") and get_4bit_type("fp4") (normalised to [-1, 1]), as fp32.
// clang-format off
inline constexpr std::array<float, 16> kNf4Code = {
    -0x1.p+0f, -0x1.647362p-1f, -0x1.0cd66p-1f, -0x1.94654p-2f, -0x1.23449ap-2f, -0x1.7a6a7ep-3f,
    -0x1.74f0e2p-4f, 0.0f, 0x1.45f5fep-4f, 0x1.4995c6p-3f, 0x1.f809bap-3f, 0x1.5a0674p-2f,
    0x1.c3497p-2f, 0x1.200f56p-1f, 0x1.722766p-1f, 0x1.p+0f};
inline constexpr std::array<float, 16> kFp4Code = {
    0.0f, 0x1.555556p-8f, 0x1.555556p-1f, 0x1.p+0f, 0x1.555556p-2f, 0x1.p-1f, 0x1.555556p-3f, 0x1.p-2f,
    0.0f, -0x1.555556p-8f, -0x1.555556p-1f, -0x1.p+0f, -0x1.555556p-2f, -0x1.p-1f, -0x1.555556p-3f, -0x1.p-2f};
// clang-format on

// Bytes of n packed codes, and absmax values of n elements in blocks of `blocksize` (> 0).
constexpr uint64_t packed_bytes(uint64_t n) { return (n + 1) / 2; }
constexpr uint64_t block_count(uint64_t n, uint64_t blocksize) { return (n + blocksize - 1) / blocksize; }

// Element i's code in a packed array (Note [4-bit blocks]).
inline uint8_t code_at(const uint8_t* packed, uint64_t i) {
  const uint8_t b = packed[i >> 1];
  return (i & 1) != 0 ? static_cast<uint8_t>(b & 0xF) : static_cast<uint8_t>(b >> 4);
}

// The value of code q (0..15) in a block with this absmax, in fp32 (rounded once, by the product).
inline float dequantize_value(QuantType type, uint8_t q, float absmax) {
  const float c = type == QuantType::kNf4 ? kNf4Code[q & 0xF] : kFp4Code[q & 0xF];
  return c * absmax;
}

// Elements [first, first + n) of a packed tensor as dequantize_4bit gives them in `dtype` (fp32, or
// rounded to nearest even to bf16 or fp16), widened exactly to fp32 in `out`. `absmax` is the
// tensor's (indexed by element / blocksize); `packed` holds the codes from byte first / 2 on, so a
// caller may read only the bytes of the range (element first's code is its high nibble when
// first is even, its low one when odd).
void dequantize(const uint8_t* packed, const float* absmax, uint64_t first, uint64_t n, uint64_t blocksize,
                QuantType type, DType dtype, float* out);

// Double quantization's absmax values read back (Note [4-bit blocks]): out[j] = map[codes[j]] ×
// absmax2[j / blocksize2] + offset, in fp32, for j < n_blocks. `map` is the 256-entry table the
// file stores (nested_quant_map: bitsandbytes' signed dynamic map).
void dequantize_absmax(const uint8_t* codes, const float* absmax2, const float* map, uint64_t n_blocks,
                       uint64_t blocksize2, float offset, float* out);

// Quantizes n fp32 values as bitsandbytes' quantize_4bit does without double quantization: writes
// packed_bytes(n) bytes to `packed` and block_count(n, blocksize) values to `absmax`.
void quantize(const float* x, uint64_t n, uint64_t blocksize, QuantType type, uint8_t* packed, float* absmax);

// Both tables for the element reads of common/bnb4_blob.h (a kernel argument).
CodeTables code_tables();

// Elements [first, first + n) of a blob (Note [The packed 4-bit base]) whose header is `h`, each as
// blob_element gives it and then rounded to `dtype` (the compute dtype), widened exactly to fp32 in
// `out`. `codes` holds the blob's code bytes from byte blob_code_byte(h.type, first) on, `scales`
// its scale bytes from scale blob_scale_index(h.type, h.cols, first) on: a caller reads only the
// bytes of the range.
void dequantize_blob(const BlobHeader& h, const uint8_t* codes, const uint8_t* scales, uint64_t first, uint64_t n,
                     DType dtype, float* out);
// The same from a whole blob of blob_size bytes in memory, its header read there: false (nothing
// written) when the header is not a blob's, says more bytes than blob_size, or [first, first + n) is
// not inside its elements.
bool dequantize_whole_blob(const uint8_t* blob, uint64_t blob_size, uint64_t first, uint64_t n, DType dtype,
                           float* out);

}  // namespace zo::bnb4

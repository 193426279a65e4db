// The packed 4-bit base's unit of storage: one frozen weight in bitsandbytes' 4-bit form as one blob
// of bytes (Note [The packed 4-bit base]) — what the compute copy of such a weight holds in pinned
// RAM, on NVMe and in a checkpoint, and what crosses PCIe. The layout, the header, and the element
// read that the CUDA kernel, HostDevice and the host's readers all run. Usable from host code and,
// compiled by nvcc, from device code (no std containers below). Pure functions; thread-safe.
#pragma once

#include <cstdint>
#include <cstring>

#include "common/dtype.h"
#include "common/half.h"

namespace zo::bnb4 {

// Note [The packed 4-bit base]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A decoder projection of a 4-bit base (a bitsandbytes checkpoint, or zoffload.quantize_base) is
// frozen and stays in its 4-bit form: its compute copy is a blob of blob_bytes(n) bytes, not n
// elements of the compute dtype, and that blob is what lives in pinned RAM or on NVMe, what a
// checkpoint saves and what is copied to the GPU. There it is dequantized into the compute dtype,
// into the coordinator's slot for the weight, by dequantize_4bit (gpu/quant_kernels.h).
//   [0, 32)          the header: "ZB4" and version 1, the quant type (0 nf4, 1 fp4), the dtype
//                    bitsandbytes dequantizes to (its DType), two zero bytes, rows and cols (u64
//                    little-endian; a 1-D weight has cols 1), eight zero bytes;
//   [32, 32 + C)     the codes as bitsandbytes packs them (Note [4-bit blocks] in bnb4bit.h),
//                    packed_bytes(n) of them, zero-padded to C, a multiple of 16;
//   [32 + C, ...)    the absmax of every block of kBlobBlock elements, fp32, then zeros to a
//                    multiple of 16. A checkpoint quantized with larger blocks (bitsandbytes'
//                    blocksize 128 … 4096) repeats each block's absmax for each of its 64-element
//                    blocks — the same value for every element, so the same bits; double
//                    quantization's absmax are stored read back (fp32), as dequantize_4bit uses them.
// Element i reads back as table[code_i] × absmax[i / 64] in fp32, rounded to the header's dtype
// (bitsandbytes' dequantize_4bit), then to the compute dtype — 4.5 bits a weight in all, 0.28× bf16.

inline constexpr uint64_t kBlobBlock = 64;
inline constexpr uint64_t kBlobHeaderBytes = 32;
inline constexpr uint8_t kBlobMagic[4] = {'Z', 'B', '4', 1};

ZO_HOST_DEVICE constexpr uint64_t align16(uint64_t n) { return (n + 15) / 16 * 16; }
ZO_HOST_DEVICE constexpr uint64_t blob_codes_offset() { return kBlobHeaderBytes; }
ZO_HOST_DEVICE constexpr uint64_t blob_absmax_offset(uint64_t n) { return kBlobHeaderBytes + align16((n + 1) / 2); }
ZO_HOST_DEVICE constexpr uint64_t blob_blocks(uint64_t n) { return (n + kBlobBlock - 1) / kBlobBlock; }
ZO_HOST_DEVICE constexpr uint64_t blob_bytes(uint64_t n) { return align16(blob_absmax_offset(n) + 4 * blob_blocks(n)); }

// What the header says.
struct BlobHeader {
  uint8_t type = 0;  // bnb4::QuantType: 0 nf4, 1 fp4
  DType round = DType::kF32;
  uint64_t rows = 0, cols = 0;
  uint64_t n() const { return rows * cols; }
};

// The 32 header bytes of `h`.
inline void write_blob_header(const BlobHeader& h, uint8_t* out) {
  std::memset(out, 0, kBlobHeaderBytes);
  std::memcpy(out, kBlobMagic, 4);
  out[4] = h.type;
  out[5] = static_cast<uint8_t>(h.round);
  std::memcpy(out + 8, &h.rows, 8);
  std::memcpy(out + 16, &h.cols, 8);
}

// The header at `blob`; false when its magic, version, type or dtype is not one written above.
inline bool read_blob_header(const uint8_t* blob, BlobHeader* out) {
  if (std::memcmp(blob, kBlobMagic, 4) != 0 || blob[4] > 1 || blob[5] > static_cast<uint8_t>(DType::kF16)) return false;
  out->type = blob[4];
  out->round = static_cast<DType>(blob[5]);
  std::memcpy(&out->rows, blob + 8, 8);
  std::memcpy(&out->cols, blob + 16, 8);
  return true;
}

// The 16 values of both code tables, nf4's then fp4's (bnb4::kNf4Code, kFp4Code), as a kernel
// argument can carry them.
struct CodeTables {
  float v[2][16];
};

// `v` rounded to `dtype` (nearest even) and widened back exactly.
ZO_HOST_DEVICE float round_to(DType dtype, float v) {
  return dtype == DType::kBF16  ? bf16_to_float(float_to_bf16(v))
         : dtype == DType::kF16 ? f16_to_float(float_to_f16(v))
                                : v;
}

// Element i of an n-element blob whose header says `type` and `round`, in fp32 as dequantize_4bit
// gives it: table[code] × absmax, rounded to `round`. `codes` is the blob's code bytes from byte
// `code_base` on (the element's byte is codes[i / 2 - code_base]), `absmax` its absmax bytes from
// block `block_base` on; neither need be aligned.
ZO_HOST_DEVICE float blob_element(const CodeTables& tables, uint8_t type, DType round, const uint8_t* codes,
                                  uint64_t code_base, const uint8_t* absmax, uint64_t block_base, uint64_t i) {
  const uint8_t b = codes[(i >> 1) - code_base];
  const uint8_t q = (i & 1) != 0 ? static_cast<uint8_t>(b & 0xF) : static_cast<uint8_t>(b >> 4);
  const uint8_t* a = absmax + 4 * (i / kBlobBlock - block_base);  // little-endian fp32, any alignment
  const float scale = bits_float(uint32_t{a[0]} | uint32_t{a[1]} << 8 | uint32_t{a[2]} << 16 | uint32_t{a[3]} << 24);
  return round_to(round, tables.v[type & 1][q] * scale);
}

// Stores `v` as element i of a `dtype` array at `out` (aligned to its element), rounded to nearest
// even: what dequantize_4bit writes.
ZO_HOST_DEVICE void store_element(DType dtype, float v, void* out, uint64_t i) {
  if (dtype == DType::kBF16) static_cast<uint16_t*>(out)[i] = float_to_bf16(v);
  else if (dtype == DType::kF16) static_cast<uint16_t*>(out)[i] = float_to_f16(v);
  else static_cast<float*>(out)[i] = v;
}

}  // namespace zo::bnb4

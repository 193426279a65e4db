// The packed base's unit of storage: one frozen weight in bitsandbytes' 4-bit or 8-bit form as one
// blob of bytes (Note [The packed 4-bit base]) — what the compute copy of such a weight holds in
// pinned RAM, on NVMe and in a checkpoint, and what crosses PCIe. The layout, the header, and the element
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
// A decoder projection of a 4-bit base (a bitsandbytes checkpoint, or zoffload.quantize_base) or
// an 8-bit one (below) is frozen and stays in its quantized form: its compute copy is a blob of
// blob_bytes(type, rows, cols) bytes, not rows × cols elements of the compute dtype, and that blob
// is what lives in pinned RAM or on NVMe, what a checkpoint saves and what is copied to the GPU.
// There it is dequantized into the compute dtype, into the coordinator's slot for the weight, by
// dequantize_packed (gpu/quant_kernels.h). A 4-bit blob:
//   [0, 32)          the header: "ZB4" and version 1, the quant type (0 nf4, 1 fp4; 2 int8 below),
//                    the dtype bitsandbytes dequantizes to (its DType), two zero bytes, rows and
//                    cols (u64 little-endian; a 1-D weight has cols 1), eight zero bytes;
//   [32, 32 + C)     the codes as bitsandbytes packs them (Note [4-bit blocks] in bnb4bit.h),
//                    packed_bytes(n) of them, zero-padded to C, a multiple of 16;
//   [32 + C, ...)    the absmax of every block of kBlobBlock elements, fp32, then zeros to a
//                    multiple of 16. A checkpoint quantized with larger blocks (bitsandbytes'
//                    blocksize 128 … 4096) repeats each block's absmax for each of its 64-element
//                    blocks — the same value for every element, so the same bits; double
//                    quantization's absmax are stored read back (fp32), as dequantize_4bit uses them.
// Element i reads back as table[code_i] × absmax[i / 64] in fp32, rounded to the header's dtype
// (bitsandbytes' dequantize_4bit), then to the compute dtype — 4.5 bits a weight in all, 0.28× bf16.
//
// An 8-bit (LLM.int8) base's projection is a blob of the same frame, quant type 2 (kBlobInt8): the
// int8 codes, one a byte in row-major order (n bytes, zero-padded to a multiple of 16), then each
// row's scale as bitsandbytes stores it (SCB: the row's absmax, fp32), then zeros to a multiple of
// 16; the header's dtype is fp32. Element (r, c) reads back as code × (SCB[r] × (1/127 in fp32)) in
// fp32, rounded to the compute dtype once: what bitsandbytes' training path computes with
// (MatMul8bitFp: CB.to(A.dtype).mul_(SCB.unsqueeze(1).mul(1.0 / 127.0))) — 8 bits a weight and
// 32 a row, 0.50× bf16.

inline constexpr uint64_t kBlobBlock = 64;
inline constexpr uint64_t kBlobHeaderBytes = 32;
inline constexpr uint8_t kBlobMagic[4] = {'Z', 'B', '4', 1};
inline constexpr uint8_t kBlobInt8 = 2;  // the quant type of an 8-bit (LLM.int8) blob

// The layout of a blob of quant type `type` holding a rows × cols weight (n = rows × cols): its
// code bytes, where its scales start (the absmax of 4-bit blocks, the SCB of 8-bit rows), how many
// scales it has, and its bytes in all. Element i's code is byte blob_code_byte(type, i) of the
// codes, its scale number blob_scale_index(type, cols, i).
ZO_HOST_DEVICE constexpr uint64_t align16(uint64_t n) { return (n + 15) / 16 * 16; }
ZO_HOST_DEVICE constexpr uint64_t blob_codes_offset() { return kBlobHeaderBytes; }
ZO_HOST_DEVICE constexpr uint64_t blob_code_bytes(uint8_t type, uint64_t n) {
  return type == kBlobInt8 ? n : (n + 1) / 2;
}
ZO_HOST_DEVICE constexpr uint64_t blob_scales_offset(uint8_t type, uint64_t n) {
  return kBlobHeaderBytes + align16(blob_code_bytes(type, n));
}
ZO_HOST_DEVICE constexpr uint64_t blob_scale_count(uint8_t type, uint64_t rows, uint64_t cols) {
  return type == kBlobInt8 ? rows : (rows * cols + kBlobBlock - 1) / kBlobBlock;
}
ZO_HOST_DEVICE constexpr uint64_t blob_bytes(uint8_t type, uint64_t rows, uint64_t cols) {
  return align16(blob_scales_offset(type, rows * cols) + 4 * blob_scale_count(type, rows, cols));
}
ZO_HOST_DEVICE constexpr uint64_t blob_code_byte(uint8_t type, uint64_t i) { return type == kBlobInt8 ? i : i >> 1; }
ZO_HOST_DEVICE constexpr uint64_t blob_scale_index(uint8_t type, uint64_t cols, uint64_t i) {
  return type == kBlobInt8 ? i / cols : i / kBlobBlock;
}

// What the header says.
struct BlobHeader {
  uint8_t type = 0;  // 0 nf4, 1 fp4 (bnb4::QuantType), kBlobInt8
  DType round = DType::kF32;
  uint64_t rows = 0, cols = 0;
  ZO_HOST_DEVICE uint64_t n() const { return rows * cols; }
  // rows and cols positive and their product (and the blob's bytes) far from overflow: 2^48 at most.
  bool sane() const { return rows > 0 && cols > 0 && rows <= (uint64_t{1} << 48) / cols; }
  ZO_HOST_DEVICE uint64_t bytes() const { return blob_bytes(type, rows, cols); }
  ZO_HOST_DEVICE uint64_t scales_offset() const { return blob_scales_offset(type, n()); }
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

// The header at `blob` as it is written, unchecked: what the kernels read (the store wrote it).
ZO_HOST_DEVICE BlobHeader blob_header_unchecked(const uint8_t* blob) {
  BlobHeader h;
  h.type = blob[4];
  h.round = static_cast<DType>(blob[5]);
  for (int k = 7; k >= 0; --k) {  // little-endian
    h.rows = h.rows << 8 | blob[8 + k];
    h.cols = h.cols << 8 | blob[16 + k];
  }
  return h;
}

// The header at `blob`; false when its magic, version, type or dtype is not one written above.
inline bool read_blob_header(const uint8_t* blob, BlobHeader* out) {
  if (std::memcmp(blob, kBlobMagic, 4) != 0 || blob[4] > kBlobInt8 || blob[5] > static_cast<uint8_t>(DType::kF16))
    return false;
  *out = blob_header_unchecked(blob);
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

// Element (r, c) of an 8-bit blob in fp32, from its int8 code and its row's SCB, as bitsandbytes'
// training path computes it: the scale SCB × (1/127 as fp32), then the code times that.
ZO_HOST_DEVICE float int8_element(int8_t code, float scb) {
  constexpr float kInverse127 = static_cast<float>(1.0 / 127.0);
  const float scale = scb * kInverse127;
  return static_cast<float>(code) * scale;
}

// Element i of a blob whose header says `type`, `round` and `cols`, in fp32 as bitsandbytes reads it
// back, rounded to `round`: a 4-bit blob's table[code] × absmax (dequantize_4bit), an 8-bit blob's
// int8_element. `codes` is the blob's code bytes from byte `code_base` on (the element's byte is
// codes[blob_code_byte(type, i) - code_base]), `scales` its scale bytes from scale `scale_base` on;
// neither need be aligned.
ZO_HOST_DEVICE float blob_element(const CodeTables& tables, uint8_t type, DType round, uint64_t cols,
                                  const uint8_t* codes, uint64_t code_base, const uint8_t* scales, uint64_t scale_base,
                                  uint64_t i) {
  const uint8_t b = codes[blob_code_byte(type, i) - code_base];
  const uint8_t* a = scales + 4 * (blob_scale_index(type, cols, i) - scale_base);  // little-endian fp32
  const float scale = bits_float(uint32_t{a[0]} | uint32_t{a[1]} << 8 | uint32_t{a[2]} << 16 | uint32_t{a[3]} << 24);
  if (type == kBlobInt8) return round_to(round, int8_element(static_cast<int8_t>(b), scale));
  const uint8_t q = (i & 1) != 0 ? static_cast<uint8_t>(b & 0xF) : static_cast<uint8_t>(b >> 4);
  return round_to(round, tables.v[type & 1][q] * scale);
}

// Stores `v` as element i of a `dtype` array at `out` (aligned to its element), rounded to nearest
// even: what dequantize_packed writes.
ZO_HOST_DEVICE void store_element(DType dtype, float v, void* out, uint64_t i) {
  if (dtype == DType::kBF16) static_cast<uint16_t*>(out)[i] = float_to_bf16(v);
  else if (dtype == DType::kF16) static_cast<uint16_t*>(out)[i] = float_to_f16(v);
  else static_cast<float*>(out)[i] = v;
}

}  // namespace zo::bnb4

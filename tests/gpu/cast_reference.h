// Test inputs and the reference for the Device cast kernels: cpu_optim's scalar conversions
// (cpu_optim/dtype.h), which define the bits every fp32↔bf16/fp16 path in zoffload must produce.
#pragma once

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "cpu_optim/dtype.h"
#include "gpu/device.h"

namespace zo::gpu::test {

// Every 16-bit pattern (all bf16 / fp16 values: denormals, ±inf, NaNs included).
inline std::vector<uint16_t> all_16bit_patterns() {
  std::vector<uint16_t> v(65536);
  for (uint32_t i = 0; i < 65536; ++i) v[i] = static_cast<uint16_t>(i);
  return v;
}

// fp32 inputs that exercise rounding: specials, the fp16 overflow and denormal edges, exact ties
// and near-ties for both 16-bit formats, fp32 denormals, and a strided sweep of all bit patterns.
inline std::vector<float> float_cast_inputs() {
  using cpu_optim::bits_float;
  std::vector<uint32_t> bits = {0x00000000u,
                                0x80000000u,
                                0x7F800000u,
                                0xFF800000u,
                                0x7FC00000u,
                                0xFFC00000u,
                                0x7F800001u,
                                0xFF812345u,
                                0x7FBFFFFFu,
                                0x00000001u,
                                0x80000001u,
                                0x007FFFFFu,
                                0x00800000u,
                                0x7F7FFFFFu,
                                0xFF7FFFFFu,
                                0x477FE000u /*65504*/,
                                0x477FEFFFu,
                                0x477FF000u /*65520*/,
                                0x477FF001u,
                                0x38800000u /*2^-14*/,
                                0x387FFFFFu,
                                0x33000000u /*2^-25*/,
                                0x33000001u,
                                0x33800000u /*2^-24*/,
                                0x3F800000u,
                                0x3F808000u /*bf16 tie to even (down)*/,
                                0x3F818000u /*tie up*/,
                                0x3F807FFFu,
                                0x3F808001u,
                                0x3F801000u /*fp16 tie*/,
                                0x3F803000u,
                                0x3F800FFFu,
                                0x3F801001u,
                                0x7F7F8000u,
                                0x7F7F7FFFu};
  std::mt19937 rng(1234);
  for (int i = 0; i < 20000; ++i) {
    const uint32_t r = rng();
    for (uint32_t low : {0x8000u, 0x7FFFu, 0x8001u}) bits.push_back((r & 0xFFFF0000u) | low);  // bf16 ties
    for (uint32_t low : {0x1000u, 0x0FFFu, 0x1001u}) bits.push_back((r & 0xFFFFE000u) | low);  // fp16 ties
    // fp16 denormal range (2^-25 .. 2^-14), where the rounding shift varies.
    bits.push_back((r & 0x80000000u) | (0x33000000u + (r % (0x38800000u - 0x33000000u))));
  }
  for (uint64_t u = 0; u <= 0xFFFFFFFFull; u += 4099) bits.push_back(static_cast<uint32_t>(u));
  std::vector<float> out;
  out.reserve(bits.size());
  for (uint32_t b : bits) out.push_back(bits_float(b));
  return out;
}

inline uint32_t ref_bits_from_16(uint16_t h, DType src) {
  return cpu_optim::float_bits(src == DType::kBF16 ? cpu_optim::bf16_to_float(h) : cpu_optim::f16_to_float(h));
}

inline uint16_t ref_16_from_float(float f, DType dst) {
  return dst == DType::kBF16 ? cpu_optim::float_to_bf16(f) : cpu_optim::float_to_f16(f);
}

inline bool is_nan_16(uint16_t h, DType t) {
  return t == DType::kBF16 ? (h & 0x7FFFu) > 0x7F80u : (h & 0x7FFFu) > 0x7C00u;
}
inline bool is_nan_32(uint32_t u) { return (u & 0x7FFFFFFFu) > 0x7F800000u; }

}  // namespace zo::gpu::test

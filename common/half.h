// Scalar fp32↔bf16/fp16 conversions: the reference that defines the bits every converting path
// produces (cpu_optim's SIMD kernels, HostDevice, CudaDevice's cast kernels). Round to nearest,
// ties to even, in integer arithmetic, so denormals round like any other value; ±inf and ±0 are
// kept; NaN gives a quiet NaN with the sign kept (payload not part of the contract).
// Usable from host code and, compiled by nvcc, from device code. Pure functions; thread-safe.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define ZO_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define ZO_HOST_DEVICE inline
#endif

namespace zo {

ZO_HOST_DEVICE uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
#endif
}

ZO_HOST_DEVICE float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}

// Exact: the bf16 bits are the high half of the fp32 bits.
ZO_HOST_DEVICE float bf16_to_float(uint16_t h) { return bits_float(uint32_t{h} << 16); }

// Round to nearest, ties to even, in integer arithmetic so denormals round like any other value.
// NaN → quiet NaN with the sign kept.
ZO_HOST_DEVICE uint16_t float_to_bf16(float f) {
  const uint32_t u = float_bits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  const uint32_t rounded = u + 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(rounded >> 16);
}

// Note [Stochastic rounding to bf16]
// bf16 masters (zoffload.master_dtype "bf16") keep no fp32 copy: each update is computed in fp32
// and rounded to one of the two bf16 neighbours of the result, the one away from zero with
// probability (dropped low 16 bits) / 2^16 — torchao's bf16_stochastic_round rule. Its expectation
// is the fp32 value, so updates far below a bf16 ulp still move the weight on average, where
// round-to-nearest would drop every one of them. The 16 random bits of element `index` of a
// parameter come from a fixed integer hash of (key, index), the key from (the run's seed, the
// optimizer step, the parameter): no generator state, so every ISA, thread count, tier,
// sub-group size and a resumed run draw the same bits for the same element.

// The 16 random bits of element `index` under `key`: Chris Wellons' lowbias32 of the index spread
// by the golden ratio and xor-ed with the key. Every path computes exactly this.
ZO_HOST_DEVICE uint32_t sr_random16(uint32_t key, uint32_t index) {
  uint32_t x = (index * 0x9E3779B9u) ^ key;
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return x >> 16;
}

// Rounds f to its bf16 neighbour toward zero, or away from zero when random16 (uniform in
// [0, 2^16)) is below f's dropped low 16 bits: unbiased. Values exact in bf16, ±0 and ±inf are
// kept; the largest finite values may round to ±inf as often as their fraction says; NaN → quiet
// NaN with the sign kept (as float_to_bf16).
ZO_HOST_DEVICE uint16_t float_to_bf16_sr(float f, uint32_t random16) {
  const uint32_t u = float_bits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  return static_cast<uint16_t>((u >> 16) + (random16 < (u & 0xFFFFu) ? 1u : 0u));
}

// The key of one parameter's rounding in one optimizer step: splitmix64's finaliser over the
// run's seed, the step and the parameter's index, folded to 32 bits.
ZO_HOST_DEVICE uint32_t sr_key(uint64_t seed, uint64_t step, uint32_t param) {
  uint64_t x = seed ^ (step * 0x9E3779B97F4A7C15ull) ^ (uint64_t{param} * 0xD1B54A32D192ED03ull);
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  x ^= x >> 31;
  return static_cast<uint32_t>(x ^ (x >> 32));
}

// Exact: fp16 denormals become fp32 normals.
ZO_HOST_DEVICE float f16_to_float(uint16_t h) {
  const uint32_t sign = (uint32_t{h} & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  uint32_t mant = h & 0x3FFu;
  if (exp == 0x1F) return bits_float(sign | 0x7F800000u | (mant << 13) | (mant ? 0x00400000u : 0u));
  if (exp != 0) return bits_float(sign | ((exp + 112u) << 23) | (mant << 13));
  if (mant == 0) return bits_float(sign);
  uint32_t e = 113;  // biased fp32 exponent of 2^-14, the fp16 denormal scale
  while ((mant & 0x400u) == 0) {
    mant <<= 1;
    --e;
  }
  return bits_float(sign | (e << 23) | ((mant & 0x3FFu) << 13));
}

// Round to nearest, ties to even; ≥ 65520 gives ±inf; tiny values become fp16 denormals or ±0.
ZO_HOST_DEVICE uint16_t float_to_f16(float f) {
  const uint32_t u = float_bits(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return static_cast<uint16_t>(sign | 0x7E00u | ((a >> 13) & 0x3FFu));  // NaN
  if (a >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);
  if (a >= 0x38800000u) {  // fp16 normal range: rebias the exponent, round away 13 mantissa bits
    const uint32_t r = a - 0x38000000u;
    return static_cast<uint16_t>(sign | ((r + 0xFFFu + ((r >> 13) & 1u)) >> 13));
  }
  if (a <= 0x33000000u) return static_cast<uint16_t>(sign);  // ≤ 2^-25 rounds to ±0
  const uint32_t exp = a >> 23;
  const uint32_t mant = (a & 0x7FFFFFu) | 0x800000u;
  const uint32_t shift = 126u - exp;  // 14..24
  uint32_t r = mant >> shift;
  const uint32_t rem = mant & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1u);
  if (rem > half || (rem == half && (r & 1u))) ++r;
  return static_cast<uint16_t>(sign | r);
}

}  // namespace zo

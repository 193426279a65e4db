// Element types of the spans cpu_optim reads and writes (fp32, bf16, fp16), typeless views of
// gradient and copy-out buffers, and the scalar reference conversions every SIMD path must match
// bit for bit. Pure functions and plain values; thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string_view>

#include "common/dtype.h"
#include "common/half.h"
#include "common/status.h"

namespace zo::cpu_optim {

// The element type is zoffload's one DType (common/dtype.h).
using ::zo::DType;
using ::zo::dtype_name;
using ::zo::dtype_size_bytes;
using ::zo::parse_dtype;

// A read-only span of n elements of `dtype` whose length is given by the call it is passed to
// (always the length of the fp32 parameter span). Not owned.
struct ConstElemSpan {
  const void* data = nullptr;
  DType dtype = DType::kF32;
};

// A writable span of n elements of `dtype`; data == nullptr means "no such output". Not owned.
struct ElemSpan {
  void* data = nullptr;
  DType dtype = DType::kBF16;
};

// Parameters kept as bf16 masters (zoffload.master_dtype "bf16"): the update is computed in fp32
// from the widened value and stored with stochastic rounding (Note [Stochastic rounding to bf16]
// in common/half.h), element i drawing sr_random16(sr_key, first_index + i). first_index is where
// bits[0] sits in its parameter, so any split of a parameter draws the same bits; first_index +
// bits.size() must not exceed 2^32. A copy-out, if any, must be bf16 and receives the same bits.
struct Bf16Master {
  std::span<uint16_t> bits;
  uint32_t sr_key = 0;
  uint32_t first_index = 0;
};

// ---- Scalar reference conversions -------------------------------------------------------------
// These define the results: every SIMD kernel produces exactly these bits for every input,
// including denormals, ±inf and ±0. NaN in gives NaN out (quiet, sign kept); the payload bits are
// not part of the contract.

// The conversions themselves live in common/half.h (shared with gpu/).
using ::zo::bf16_to_float;
using ::zo::bits_float;
using ::zo::f16_to_float;
using ::zo::float_bits;
using ::zo::float_to_bf16;
using ::zo::float_to_bf16_sr;
using ::zo::float_to_f16;
using ::zo::sr_key;
using ::zo::sr_random16;

inline float load_as_float(const void* data, DType dtype, size_t i) {
  switch (dtype) {
    case DType::kF32: return static_cast<const float*>(data)[i];
    case DType::kBF16: return bf16_to_float(static_cast<const uint16_t*>(data)[i]);
    case DType::kF16: return f16_to_float(static_cast<const uint16_t*>(data)[i]);
  }
  return 0.0f;
}

inline void store_from_float(void* data, DType dtype, size_t i, float value) {
  switch (dtype) {
    case DType::kF32: static_cast<float*>(data)[i] = value; return;
    case DType::kBF16: static_cast<uint16_t*>(data)[i] = float_to_bf16(value); return;
    case DType::kF16: static_cast<uint16_t*>(data)[i] = float_to_f16(value); return;
  }
}

}  // namespace zo::cpu_optim

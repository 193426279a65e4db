// DType: the element types zoffload stores and converts (fp32, bf16, fp16), shared by cpu_optim,
// gpu and the engine so that one value means one thing everywhere. Conversions are in half.h.
// Pure values and functions; thread-safe.
#pragma once

#include <cstdint>
#include <string_view>

#include "common/status.h"

namespace zo {

enum class DType : uint8_t { kF32 = 0, kBF16 = 1, kF16 = 2 };

// "fp32", "bf16", "fp16".
std::string_view dtype_name(DType dtype);
// Accepts "fp32"/"float32"/"f32", "bf16"/"bfloat16", "fp16"/"float16"/"half"/"f16"; InvalidArgument
// naming the text otherwise.
Result<DType> parse_dtype(std::string_view text);
constexpr uint64_t dtype_size_bytes(DType dtype) { return dtype == DType::kF32 ? 4 : 2; }
// The largest finite value: fp32's and bf16's (2^128 · (1 − 2^−24) and its bf16 rounding down,
// 2^128 · (1 − 2^−8)), fp16's 65504.
constexpr double dtype_max_value(DType dtype) {
  return dtype == DType::kF32 ? 3.4028234663852886e38 : dtype == DType::kBF16 ? 3.3895313892515355e38 : 65504.0;
}

}  // namespace zo

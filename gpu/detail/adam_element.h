// The bodies of the device's adam_step and adam8bit_step (gpu/optim_kernels.h), shared by
// HostDevice's loops and CudaDevice's kernels: load the gradient and the states as fp32
// (common/half.h), run zo::adam_update or zo::adam8bit_update (common/adam_math.h), store the new
// values and the optional copy-out. Pure functions of their arguments; thread-safe for disjoint
// elements. Internal to gpu/.
#pragma once

#include <cstdint>

#include "common/adam_math.h"
#include "gpu/detail/half.h"

namespace zo::gpu::detail {

// Dtypes are the values of zo::DType (0 fp32, 1 bf16, 2 fp16); copy == nullptr: no copy-out.
struct AdamElementArgs {
  void* params;
  uint8_t param_dtype;  // 0 fp32, or 1: bf16 masters stored with stochastic rounding
  uint32_t sr_key, sr_first;
  void* exp_avg;
  void* exp_avg_sq;
  uint8_t moment_dtype;  // 0 fp32 or 1 bf16 (stored rounded to nearest even)
  const void* grad;
  uint8_t grad_dtype;
  void* copy;
  uint8_t copy_dtype;
};

// The new parameter of element i: fp32 stored as computed (the copy-out rounded to nearest even),
// or a bf16 master rounded stochastically with element i's random bits, its copy-out the same bits.
ZO_HOST_DEVICE void store_param(void* params, uint8_t param_dtype, uint32_t sr_key, uint32_t sr_first, void* copy,
                                uint8_t copy_dtype, uint64_t i, float p) {
  if (param_dtype == 0) {
    static_cast<float*>(params)[i] = p;
    if (copy != nullptr) store_from_float(copy, copy_dtype, i, p);
    return;
  }
  const uint16_t r = float_to_bf16_sr(p, sr_random16(sr_key, sr_first + static_cast<uint32_t>(i)));
  static_cast<uint16_t*>(params)[i] = r;
  if (copy != nullptr) static_cast<uint16_t*>(copy)[i] = r;
}

ZO_HOST_DEVICE void adam_element(const AdamConstants& k, const AdamElementArgs& a, uint64_t i) {
  float p = load_as_float(a.params, a.param_dtype, i);
  float m = load_as_float(a.exp_avg, a.moment_dtype, i);
  float v = load_as_float(a.exp_avg_sq, a.moment_dtype, i);
  adam_update(k, load_as_float(a.grad, a.grad_dtype, i), p, m, v);
  store_param(a.params, a.param_dtype, a.sr_key, a.sr_first, a.copy, a.copy_dtype, i, p);
  store_from_float(a.exp_avg, a.moment_dtype, i, m);
  store_from_float(a.exp_avg_sq, a.moment_dtype, i, v);
}

// ---- 8-bit blockwise moments --------------------------------------------------------------------

inline constexpr uint64_t kQuantBlockElems = 256;  // cpu_optim::kQuantBlockElems

struct Adam8bitElementArgs {
  void* params;
  uint8_t param_dtype;
  uint32_t sr_key, sr_first;
  uint8_t* m_codes;
  float* m_absmax;
  uint8_t* v_codes;
  float* v_absmax;
  const void* grad;
  uint8_t grad_dtype;
  void* copy;
  uint8_t copy_dtype;
};

// The first pass of element i: dequantize its moments with its block's absmax (m_map, v_map: the
// signed and unsigned dynamic maps), update, store the parameter and copy-out; the new moments are
// returned in m and v for the block's absmax and re-quantization.
ZO_HOST_DEVICE void adam8bit_element(const Adam8bitConstants& k, const Adam8bitElementArgs& a, const float* m_map,
                                     const float* v_map, uint64_t i, float& m, float& v) {
  namespace op = adam_detail;
  const uint64_t b = i / kQuantBlockElems;
  float p = load_as_float(a.params, a.param_dtype, i);
  m = op::mul(m_map[a.m_codes[i]], a.m_absmax[b]);
  v = op::mul(v_map[a.v_codes[i]], a.v_absmax[b]);
  adam8bit_update(k, load_as_float(a.grad, a.grad_dtype, i), p, m, v);
  store_param(a.params, a.param_dtype, a.sr_key, a.sr_first, a.copy, a.copy_dtype, i, p);
}

// |x|, with NaN as 0: a block's absmax is the largest of these (the largest non-NaN |moment|, 0 if
// none), which any order of max() over them gives exactly.
ZO_HOST_DEVICE float absmax_term(float x) { return x != x ? 0.0f : bits_float(float_bits(x) & 0x7FFFFFFFu); }

// The code of a new moment x in a block whose absmax is `absmax`.
ZO_HOST_DEVICE uint8_t requantize(const float* map, float x, float absmax) {
  return nearest_map_entry(map, adam_detail::div(x, absmax));
}

}  // namespace zo::gpu::detail

// The one definition of the Adam/AdamW update: hyperparameters (AdamConfig), their validation, the
// per-call constants derived on the host (adam_constants) and the per-element update (adam_update),
// which cpu_optim's scalar path, HostDevice and CudaDevice's kernel all call, so every place that
// steps Adam produces the same bits (docs/cpu_optim.md gives the operation order). Pure functions;
// thread-safe. adam_update compiles for host and, under nvcc, for device code.
#pragma once

#include <cmath>
#include <cstdint>
#include <string_view>

#include "common/half.h"
#include "common/status.h"

namespace zo {

struct AdamConfig {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;
  // true: AdamW, decoupled decay p -= lr*wd*p. false: classic Adam, L2 decay grad += wd*p.
  bool adam_w_mode = true;
  bool bias_correction = true;
};

// The per-call constants of one Adam step, each derived in double from the float hyperparameters
// and rounded once to float, so every path that uses them sees the same values.
struct AdamConstants {
  float grad_scale;
  float beta1, one_minus_beta1;
  float beta2, one_minus_beta2;
  float eps;
  float bc2_rsqrt;     // 1/sqrt(1 - beta2^step), or 1 without bias correction
  float neg_step;      // -lr / (1 - beta1^step), or -lr
  float l2_decay;      // wd; used when use_l2
  float decay_factor;  // fp32(1 - lr*wd); used when use_decoupled
  bool use_l2;         // !adam_w_mode && wd > 0
  bool use_decoupled;  // adam_w_mode && wd > 0
};

// OK when `value` is finite and in [lo, hi] ([lo, hi) unless hi_inclusive); else kInvalidArgument
// "<op>: <name> = <value> is outside [lo, hi]" or "... is not a finite fp32 number". The range
// check of every optimizer's hyperparameters (cpu_optim's Adagrad and Lion too).
Status check_hyperparameter(std::string_view op, const char* name, float value, float lo, float hi, bool hi_inclusive);

// OK when step ≥ 1, lr, eps, weight_decay are finite and ≥ 0, beta1 and beta2 are in [0, 1) and
// grad_scale is finite; else kInvalidArgument whose message starts with "<op>: " and names the value.
Status check_adam_hyperparameters(std::string_view op, const AdamConfig& config, int64_t step, float grad_scale);

// The constants of step `step` (1-based). Precondition: check_adam_hyperparameters passed.
AdamConstants adam_constants(const AdamConfig& config, int64_t step, float grad_scale);

// The per-call constants of one step of Adam with 8-bit blockwise moments (cpu_optim/adam8bit.h),
// each derived in double from the float hyperparameters and rounded once to float, as
// bitsandbytes' Python hands them to torch's fp32 ops.
struct Adam8bitConstants {
  float grad_scale;
  float beta1, one_minus_beta1;
  float beta2, one_minus_beta2;
  float c2;  // sqrt(1 - beta2^step), or 1
  float eps;
  float step_size;  // -lr / (1 - beta1^step), or -lr
  float decay;      // 1 - lr*wd; used when use_decoupled
  float wd;         // used when use_l2
  bool use_l2, use_decoupled;
};

// The constants of step `step` (1-based). Precondition: check_adam_hyperparameters passed.
Adam8bitConstants adam8bit_constants(const AdamConfig& config, int64_t step, float grad_scale);

namespace adam_detail {
// Each one IEEE-754 operation, correctly rounded to nearest even. On the device they are spelled as
// the _rn intrinsics, so neither -fmad nor -prec-div/-prec-sqrt can change them; on the host the
// callers' translation units are built with -ffp-contract=off (see docs/cpu_optim.md).
ZO_HOST_DEVICE float mul(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
ZO_HOST_DEVICE float add(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
ZO_HOST_DEVICE float sub(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
ZO_HOST_DEVICE float fma(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}
ZO_HOST_DEVICE float div(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
ZO_HOST_DEVICE float sqrt(float x) {
#if defined(__CUDA_ARCH__)
  return __fsqrt_rn(x);
#else
  return std::sqrt(x);
#endif
}
}  // namespace adam_detail

// One element of one Adam step: reads `grad` (the stored gradient as fp32, before grad_scale) and
// updates p, m (exp_avg) and v (exp_avg_sq) in place, in exactly this order (the same as the SIMD
// template in cpu_optim/detail/kernel_impl.h). Do not call it from a translation unit built with
// ISA flags (-mavx2, ...): the linker may keep that copy of this inline function for every caller.
ZO_HOST_DEVICE void adam_update(const AdamConstants& k, float grad, float& p, float& m, float& v) {
  namespace op = adam_detail;
  float g = op::mul(grad, k.grad_scale);
  if (k.use_l2) g = op::fma(p, k.l2_decay, g);
  m = op::fma(g, k.one_minus_beta1, op::mul(m, k.beta1));
  v = op::fma(op::mul(g, g), k.one_minus_beta2, op::mul(v, k.beta2));
  const float d = op::div(m, op::fma(op::sqrt(v), k.bc2_rsqrt, k.eps));
  float q = p;
  if (k.use_decoupled) q = op::mul(q, k.decay_factor);  // Note [Decoupled decay rounding]
  p = op::fma(d, k.neg_step, q);
}

// One element of one step of Adam with 8-bit blockwise moments, between the dequantization and the
// re-quantization: `grad` is the stored gradient as fp32 (before grad_scale), m and v the
// dequantized moments (map entry × block absmax), updated in place with p in bitsandbytes'
// operation order, the order of cpu_optim's 8-bit kernels (cpu_optim/detail/kernel_impl.h,
// adam8bit_block), whose SIMD paths the tests hold to each other and to this one through the
// device backends.
ZO_HOST_DEVICE void adam8bit_update(const Adam8bitConstants& k, float grad, float& p, float& m, float& v) {
  namespace op = adam_detail;
  float g = op::mul(grad, k.grad_scale);
  if (k.use_l2) g = op::fma(p, k.wd, g);
  m = op::fma(g, k.one_minus_beta1, op::mul(m, k.beta1));
  v = op::fma(op::mul(k.one_minus_beta2, g), g, op::mul(v, k.beta2));
  const float denom = op::add(op::div(op::sqrt(v), k.c2), k.eps);
  if (k.use_decoupled) p = op::mul(p, k.decay);
  p = op::add(op::div(op::mul(k.step_size, m), denom), p);
}

// The index of the entry of a 256-entry ascending `map` nearest x, the lower one on a tie, 0 for
// NaN: the largest i with map[i] <= x (0 when none), then one step right where map[i + 1] is
// strictly nearer in fp32. The rule cpu_optim's bucket tables encode (Note [Nearest codes by bucket]
// in cpu_optim/adam8bit.cpp), as a binary search.
ZO_HOST_DEVICE uint8_t nearest_map_entry(const float* map, float x) {
  namespace op = adam_detail;
  if (x != x) return 0;
  unsigned lo = 0, count = 256;  // upper_bound: the first entry > x
  while (count > 0) {
    const unsigned half = count / 2;
    if (!(x < map[lo + half])) {
      lo += half + 1;
      count -= half + 1;
    } else {
      count = half;
    }
  }
  const unsigned i = lo == 0 ? 0 : lo - 1;
  const float below = map[i], above = map[i < 255 ? i + 1 : 255];
  const auto abs = [](float d) { return bits_float(float_bits(d) & 0x7FFFFFFFu); };
  return static_cast<uint8_t>(abs(op::sub(x, above)) < abs(op::sub(x, below)) ? i + 1 : i);
}

}  // namespace zo

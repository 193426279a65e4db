// Lion step over raw spans with DeepSpeed's cpu_lion semantics, the gradient scale applied as the
// gradient is read and an optional fused 16-bit copy-out. Stateless; the caller owns the buffers
// and must not touch them from another thread during the call. Spans must not overlap.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>

#include "common/status.h"
#include "cpu_optim/adam8bit.h"
#include "cpu_optim/dtype.h"
#include "cpu_optim/executor.h"

namespace zo::cpu_optim {

struct LionConfig {
  float lr = 1e-4f;
  float beta1 = 0.9f;
  float beta2 = 0.99f;
  float weight_decay = 0.0f;
};

// OK when lr and weight_decay are finite and ≥ 0 and beta1 and beta2 are in [0, 1); else
// kInvalidArgument whose message starts with "<op>: " and names the value. Every Lion step checks it.
Status check_lion_config(std::string_view op, const LionConfig& config);

// Per element, with g = grad * grad_scale:
//   c = beta1*m + (1-beta1)*g ;  u = -lr * sign(c)   (sign(±0) = 0, sign(NaN) = NaN)
//   p = (wd > 0) ? p*(1 - lr*wd) + u : p + u ;  m = beta2*m + (1-beta2)*g
// Fails with kInvalidArgument on mismatched sizes, null data or out-of-range hyperparameters.
Status lion_step(const LionConfig& config, std::span<float> params, std::span<float> exp_avg, ConstElemSpan grad,
                 float grad_scale, ElemSpan copy_out, const Executor& executor);

// The same step with the momentum kept in bf16 (zoffload.moment_dtype "bf16"): widened exactly as
// it is read, the update (the parameter's included) in fp32, stored rounded to nearest even. One
// step equals lion_step's with the state rounded afterwards.
Status lion_step_bf16_moments(const LionConfig& config, std::span<float> params, std::span<uint16_t> exp_avg,
                              ConstElemSpan grad, float grad_scale, ElemSpan copy_out, const Executor& executor);

// The step with bf16 masters (Bf16Master; adam_step_bf16_master's rules), the momentum of n
// elements in fp32 or bf16.
Status lion_step_bf16_master(const LionConfig& config, Bf16Master params, ElemSpan exp_avg, ConstElemSpan grad,
                             float grad_scale, ElemSpan copy_out, const Executor& executor);

// The step with the momentum 8-bit blockwise (zoffload.moment_dtype "8bit"), as bitsandbytes'
// Lion8bit keeps it: codes into the signed dynamic map and one fp32 absmax per 256 elements
// (BlockwiseState). Per element, dequantized m = map[code] * absmax, in bitsandbytes' CPU order:
//   p = p*(1 - lr*wd) (wd > 0) ;  c = m*beta1 + g*(1-beta1) (two products, one add) ;
//   p = p - lr*sign(c) (sign(NaN) = 0, as torch's) ;  m = fma(g, 1-beta2, m*beta2)
// then each block's absmax is the largest non-NaN |m| and each code the nearest entry to m/absmax
// (adam8bit_step's rule). Any thread count and ISA give the same bits.
Status lion8bit_step(const LionConfig& config, std::span<float> params, BlockwiseState exp_avg, ConstElemSpan grad,
                     float grad_scale, ElemSpan copy_out, const Executor& executor);
// The same with bf16 masters (Bf16Master; adam_step_bf16_master's rules).
Status lion8bit_step_bf16_master(const LionConfig& config, Bf16Master params, BlockwiseState exp_avg,
                                 ConstElemSpan grad, float grad_scale, ElemSpan copy_out, const Executor& executor);

}  // namespace zo::cpu_optim

// Adagrad step over raw spans with DeepSpeed's cpu_adagrad semantics, the gradient scale applied as
// the gradient is read and an optional fused 16-bit copy-out. Stateless; the caller owns the
// buffers and must not touch them from another thread during the call. Spans must not overlap.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>

#include "common/status.h"
#include "cpu_optim/adam8bit.h"
#include "cpu_optim/dtype.h"
#include "cpu_optim/executor.h"

namespace zo::cpu_optim {

struct AdagradConfig {
  float lr = 1e-2f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;
};

// OK when lr, eps and weight_decay are finite and ≥ 0; else kInvalidArgument whose message starts
// with "<op>: " and names the value. Every Adagrad step checks it.
Status check_adagrad_config(std::string_view op, const AdagradConfig& config);

// Per element, with g = grad * grad_scale (as DeepSpeed's cpu_adagrad, whose numerator is the
// gradient before weight decay):
//   d = (wd > 0) ? g + wd*p : g ;  v = v + d*d ;  p = p - lr * g / (sqrt(v) + eps)
// Fails with kInvalidArgument on mismatched sizes, null data or out-of-range hyperparameters.
Status adagrad_step(const AdagradConfig& config, std::span<float> params, std::span<float> exp_avg_sq,
                    ConstElemSpan grad, float grad_scale, ElemSpan copy_out, const Executor& executor);

// The same step with the sum of squares kept in bf16 (zoffload.moment_dtype "bf16"): widened
// exactly as it is read, the update (the parameter's included) in fp32, stored rounded to nearest
// even. One step equals adagrad_step's with the state rounded afterwards.
Status adagrad_step_bf16_moments(const AdagradConfig& config, std::span<float> params, std::span<uint16_t> exp_avg_sq,
                                 ConstElemSpan grad, float grad_scale, ElemSpan copy_out, const Executor& executor);

// The step with bf16 masters (Bf16Master; adam_step_bf16_master's rules), the sum of squares of
// n elements in fp32 or bf16.
Status adagrad_step_bf16_master(const AdagradConfig& config, Bf16Master params, ElemSpan exp_avg_sq, ConstElemSpan grad,
                                float grad_scale, ElemSpan copy_out, const Executor& executor);

// The step with the sum of squares 8-bit blockwise (zoffload.moment_dtype "8bit"), as bitsandbytes'
// Adagrad8bit keeps it: codes into the signed dynamic map (bitsandbytes' choice for this state too)
// and one fp32 absmax per 256 elements (BlockwiseState). Per element, dequantized s = map[code] *
// absmax, zoffload's Adagrad above in bitsandbytes' CPU operations:
//   d = fma(p, wd, g) (even at wd 0, as bitsandbytes) ;  s = fma(d, d, s) ;
//   p = (-lr*g) / (sqrt(s) + eps) + p
// (bitsandbytes' numerator is d; the same without weight decay), then the block's absmax and the
// nearest codes as adam8bit_step. Any thread count and ISA give the same bits.
Status adagrad8bit_step(const AdagradConfig& config, std::span<float> params, BlockwiseState exp_avg_sq,
                        ConstElemSpan grad, float grad_scale, ElemSpan copy_out, const Executor& executor);
// The same with bf16 masters (Bf16Master; adam_step_bf16_master's rules).
Status adagrad8bit_step_bf16_master(const AdagradConfig& config, Bf16Master params, BlockwiseState exp_avg_sq,
                                    ConstElemSpan grad, float grad_scale, ElemSpan copy_out, const Executor& executor);

}  // namespace zo::cpu_optim

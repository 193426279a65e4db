// Adam / AdamW step over raw spans, with DeepSpeed's CPU Adam semantics (adam_w_mode, bias
// correction), the gradient scale applied as the gradient is read and an optional fused 16-bit
// copy-out of the new parameters. Stateless functions; the caller owns every buffer and must not
// touch them from another thread during the call. Spans of one call must not overlap.
#pragma once

#include <cstdint>
#include <span>

#include "common/adam_math.h"
#include "common/status.h"
#include "cpu_optim/dtype.h"
#include "cpu_optim/executor.h"

namespace zo::cpu_optim {

// The hyperparameters (lr, beta1, beta2, eps, weight_decay, adam_w_mode, bias_correction) are
// zoffload's one AdamConfig (common/adam_math.h), shared with gpu::OptimKernels::adam_step.
using AdamConfig = ::zo::AdamConfig;

// One Adam step on n = params.size() elements; per element, with g = grad * grad_scale:
//   if (!adam_w_mode && wd > 0) g = g + wd*p
//   m = beta1*m + (1-beta1)*g ;  v = beta2*v + (1-beta2)*g*g
//   p = p * (1 - lr*wd)                               (adam_w_mode && wd > 0)
//   p = p - lr/bc1 * m / (sqrt(v)/sqrt(bc2) + eps)     bc_i = 1 - beta_i^step (1 if !bias_correction)
// evaluated in fp32 in the exact operation order of docs/cpu_optim.md (the same on every ISA, and
// the same as zo::adam_update in common/adam_math.h, which gpu::OptimKernels::adam_step runs).
// `step` is the 1-based step number of this update (DeepSpeed passes it per call; sub-groups of one
// iteration pass the same value). `grad_scale` = 1/loss_scale × clip coefficient.
// `grad` has n elements of fp32/bf16/fp16; `copy_out`, if its data is non-null, receives the new
// parameters as bf16/fp16 (round to nearest even) or fp32, in the same pass.
// Fails with kInvalidArgument (sizes differ, null data with n > 0, step < 1, a hyperparameter out of
// range); then nothing was written.
Status adam_step(const AdamConfig& config, int64_t step, std::span<float> params, std::span<float> exp_avg,
                 std::span<float> exp_avg_sq, ConstElemSpan grad, float grad_scale, ElemSpan copy_out,
                 const Executor& executor);

// The same step with bf16 moments (zoffload.moment_dtype "bf16"): each moment element is widened
// to fp32 (exactly) as it is read, updated as above, and stored rounded to nearest even; the
// parameter's update uses the fp32 moments before the rounding. The same errors.
Status adam_step_bf16_moments(const AdamConfig& config, int64_t step, std::span<float> params,
                              std::span<uint16_t> exp_avg, std::span<uint16_t> exp_avg_sq, ConstElemSpan grad,
                              float grad_scale, ElemSpan copy_out, const Executor& executor);

// The step with bf16 masters (Bf16Master): p widened exactly, updated as above in fp32, stored
// with stochastic rounding; the moments `exp_avg` and `exp_avg_sq` have n elements of fp32 or bf16
// (as adam_step or adam_step_bf16_moments keep them); `copy_out` none or bf16 (the master's bits).
// The same errors, and kInvalidArgument for moments of another dtype, a copy-out of another dtype,
// or first_index + n beyond 2^32.
Status adam_step_bf16_master(const AdamConfig& config, int64_t step, Bf16Master params, ElemSpan exp_avg,
                             ElemSpan exp_avg_sq, ConstElemSpan grad, float grad_scale, ElemSpan copy_out,
                             const Executor& executor);

}  // namespace zo::cpu_optim

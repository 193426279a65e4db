// Validation and per-call constants of the Adam step: one compiled copy that cpu_optim, HostDevice
// and CudaDevice all call, so the constants (and hence the results) cannot differ between them.
#include "common/adam_math.h"

#include <cmath>
#include <cstdio>
#include <string>

namespace zo {
namespace {

constexpr float kInf = INFINITY;

}  // namespace

Status check_hyperparameter(std::string_view op, const char* name, float value, float lo, float hi, bool hi_inclusive) {
  // %g: "lr = 1e-08", not std::to_string's "0.000000"; a value that is not finite says so
  // rather than "inf is outside [0, inf]".
  auto text = [](float v) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%g", static_cast<double>(v));
    return std::string(buf);
  };
  if (!std::isfinite(value))
    return invalid_argument(std::string(op) + ": " + name + " = " + text(value) + " is not a finite fp32 number");
  const bool ok = value >= lo && (hi_inclusive ? value <= hi : value < hi);
  if (!ok)
    return invalid_argument(std::string(op) + ": " + name + " = " + text(value) + " is outside [" + text(lo) + ", " +
                            text(hi) + (hi_inclusive ? "]" : ")"));
  return Status::ok();
}

Status check_adam_hyperparameters(std::string_view op, const AdamConfig& config, int64_t step, float grad_scale) {
  if (step < 1) return invalid_argument(std::string(op) + ": step must be ≥ 1 (1-based), got " + std::to_string(step));
  ZO_RETURN_IF_ERROR(check_hyperparameter(op, "lr", config.lr, 0.0f, kInf, true));
  ZO_RETURN_IF_ERROR(check_hyperparameter(op, "beta1", config.beta1, 0.0f, 1.0f, false));
  ZO_RETURN_IF_ERROR(check_hyperparameter(op, "beta2", config.beta2, 0.0f, 1.0f, false));
  ZO_RETURN_IF_ERROR(check_hyperparameter(op, "eps", config.eps, 0.0f, kInf, true));
  ZO_RETURN_IF_ERROR(check_hyperparameter(op, "weight_decay", config.weight_decay, 0.0f, kInf, true));
  if (!std::isfinite(grad_scale))
    return invalid_argument(std::string(op) + ": grad_scale must be finite, got " + std::to_string(grad_scale));
  return Status::ok();
}

AdamConstants adam_constants(const AdamConfig& config, int64_t step, float grad_scale) {
  const double lr = config.lr, b1 = config.beta1, b2 = config.beta2, wd = config.weight_decay;
  const double bc1 = config.bias_correction ? 1.0 - std::pow(b1, static_cast<double>(step)) : 1.0;
  const double bc2 = config.bias_correction ? 1.0 - std::pow(b2, static_cast<double>(step)) : 1.0;
  AdamConstants k{};
  k.grad_scale = grad_scale;
  k.beta1 = config.beta1;
  k.one_minus_beta1 = static_cast<float>(1.0 - b1);
  k.beta2 = config.beta2;
  k.one_minus_beta2 = static_cast<float>(1.0 - b2);
  k.eps = config.eps;
  k.bc2_rsqrt = static_cast<float>(1.0 / std::sqrt(bc2));
  k.neg_step = static_cast<float>(-lr / bc1);
  k.use_l2 = !config.adam_w_mode && config.weight_decay > 0.0f;
  k.use_decoupled = config.adam_w_mode && config.weight_decay > 0.0f;
  k.l2_decay = config.weight_decay;
  // Note [Decoupled decay rounding]: DeepSpeed applies the decay as fma(p, -lr*wd, p); we multiply
  // by fp32(1 - lr*wd) as torch.optim.AdamW does. Same formula, but the rounding of the factor is a
  // systematic bias (up to 3e-8 relative per step when lr*wd ≈ 1e-5), so DeepSpeed's form drifts
  // ~3e-6 from LibTorch over 200 steps while this one stays within ~1e-8 (docs/design.md,
  // "Invariants": the fp32 engine matches plain LibTorch AdamW training).
  k.decay_factor = static_cast<float>(1.0 - lr * wd);
  return k;
}

Adam8bitConstants adam8bit_constants(const AdamConfig& c, int64_t step, float grad_scale) {
  const double b1 = c.beta1, b2 = c.beta2, lr = c.lr, wd = c.weight_decay, t = static_cast<double>(step);
  Adam8bitConstants k{};
  k.grad_scale = grad_scale;
  k.beta1 = c.beta1;
  k.one_minus_beta1 = static_cast<float>(1.0 - b1);
  k.beta2 = c.beta2;
  k.one_minus_beta2 = static_cast<float>(1.0 - b2);
  k.c2 = c.bias_correction ? static_cast<float>(std::sqrt(1.0 - std::pow(b2, t))) : 1.0f;
  k.eps = c.eps;
  k.step_size = static_cast<float>(-lr / (c.bias_correction ? 1.0 - std::pow(b1, t) : 1.0));
  k.decay = static_cast<float>(1.0 - lr * wd);
  k.wd = c.weight_decay;
  k.use_l2 = !c.adam_w_mode && c.weight_decay > 0.0f;
  k.use_decoupled = c.adam_w_mode && c.weight_decay > 0.0f;
  return k;
}

}  // namespace zo

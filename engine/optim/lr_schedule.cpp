#include "engine/optim/lr_schedule.h"

#include <algorithm>
#include <cmath>
#include <numbers>
#include <string>

namespace zo::engine {
namespace {

Status bad(std::string_view key, const std::string& message) {
  return invalid_argument("scheduler.params." + std::string(key) + ": " + message);
}

bool finite_nonnegative(double v) { return std::isfinite(v) && v >= 0; }

}  // namespace

// Note [Past the end]
// DeepSpeed's WarmupCosineLR keeps evaluating (1 + cos(π·x))/2 after x = real_last/real_total
// passes 1, so a run longer than total_num_steps sees its lr climb back towards the base lr. Steps
// 0 … total_num_steps−1 give exactly DeepSpeed's values (the last of them is the minimum,
// base·cos_min_ratio); from step total_num_steps on we hold that minimum instead. WarmupDecayLR
// already holds warmup_min_lr there (its max(0, …)), and WarmupLR holds warmup_max_lr, so every schedule ends
// the same way: on its final value.

Result<LrSchedule> LrSchedule::create(const SchedulerConfig& config, double base_lr) {
  if (!finite_nonnegative(base_lr))
    return invalid_argument("optimizer.params.lr: must be a finite number ≥ 0, got " + std::to_string(base_lr));
  switch (config.type) {
    case SchedulerType::kNone: break;
    case SchedulerType::kWarmupLR:
    case SchedulerType::kWarmupDecayLR:
      if (!finite_nonnegative(config.warmup_min_lr))
        return bad("warmup_min_lr", "must be a finite number ≥ 0, got " + std::to_string(config.warmup_min_lr));
      if (!finite_nonnegative(config.warmup_max_lr))
        return bad("warmup_max_lr", "must be a finite number ≥ 0, got " + std::to_string(config.warmup_max_lr));
      if (config.warmup_min_lr > config.warmup_max_lr)
        return bad("warmup_min_lr", "must be ≤ warmup_max_lr (" + std::to_string(config.warmup_max_lr) + "), got " +
                                        std::to_string(config.warmup_min_lr));
      if (config.type == SchedulerType::kWarmupDecayLR && config.total_num_steps == 0)
        return bad("total_num_steps", "WarmupDecayLR needs the number of training steps (> 0)");
      break;
    case SchedulerType::kWarmupCosineLR:
      if (!(config.warmup_min_ratio >= 0 && config.warmup_min_ratio <= 1))
        return bad("warmup_min_ratio", "must be in [0, 1], got " + std::to_string(config.warmup_min_ratio));
      if (!(config.cos_min_ratio >= 0 && config.cos_min_ratio <= 1))
        return bad("cos_min_ratio", "must be in [0, 1], got " + std::to_string(config.cos_min_ratio));
      if (config.total_num_steps == 0)
        return bad("total_num_steps", "WarmupCosineLR needs the number of training steps (> 0)");
      break;
  }
  return LrSchedule(config, base_lr);
}

LrSchedule::LrSchedule(const SchedulerConfig& config, double base_lr)
    : config_(config),
      base_lr_(base_lr),
      warmup_steps_(config.type == SchedulerType::kNone ? 0 : std::max<uint64_t>(2, config.warmup_num_steps)) {}

double LrSchedule::warmup_gamma(uint64_t t) const {
  const double n = static_cast<double>(warmup_steps_);
  if (config_.warmup_type == WarmupType::kLog) return std::log(static_cast<double>(t) + 1) / std::log(n);
  return static_cast<double>(t) / n;
}

double LrSchedule::lr_at(uint64_t t) const {
  const double min_lr = config_.warmup_min_lr;
  const double delta_lr = config_.warmup_max_lr - config_.warmup_min_lr;
  switch (config_.type) {
    case SchedulerType::kNone: return base_lr_;
    case SchedulerType::kWarmupLR: return min_lr + delta_lr * (t < warmup_steps_ ? warmup_gamma(t) : 1.0);
    case SchedulerType::kWarmupDecayLR: {
      if (t < warmup_steps_) return min_lr + delta_lr * warmup_gamma(t);
      const double total = static_cast<double>(config_.total_num_steps);
      const double decay_len = std::max(1.0, total - static_cast<double>(warmup_steps_));
      return min_lr + delta_lr * std::max(0.0, (total - static_cast<double>(t)) / decay_len);
    }
    case SchedulerType::kWarmupCosineLR: {
      if (t < warmup_steps_)
        return base_lr_ * (config_.warmup_min_ratio + (1 - config_.warmup_min_ratio) * warmup_gamma(t));
      // A run no longer than its warm-up ends inside it; past the end it holds the final value
      // (Note [Past the end]), the minimum.
      if (config_.total_num_steps <= warmup_steps_) return base_lr_ * config_.cos_min_ratio;
      const uint64_t real_total = config_.total_num_steps - warmup_steps_;
      const uint64_t real_last = std::min(t - warmup_steps_ + 1, real_total);  // Note [Past the end]
      const double cosine =
          (1 + std::cos(std::numbers::pi * static_cast<double>(real_last) / static_cast<double>(real_total))) / 2;
      return base_lr_ * std::max(0.0, config_.cos_min_ratio + (1 - config_.cos_min_ratio) * cosine);
    }
  }
  return base_lr_;
}

}  // namespace zo::engine

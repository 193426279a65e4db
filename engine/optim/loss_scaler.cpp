#include "engine/optim/loss_scaler.h"

#include <algorithm>
#include <cmath>
#include <string>

namespace zo::engine {

LossScaler::LossScaler(bool dynamic, bool skip_on_overflow, double scale, uint64_t window, uint64_t hysteresis,
                       bool consecutive_hysteresis, double min_scale)
    : dynamic_(dynamic),
      skip_on_overflow_(skip_on_overflow),
      window_(window),
      delayed_shift_(hysteresis),
      consecutive_hysteresis_(consecutive_hysteresis),
      min_scale_(min_scale) {
  state_.cur_scale = scale;
  state_.cur_hysteresis = hysteresis;
}

Result<LossScaler> LossScaler::from_fp16(const Fp16Config& c) {
  if (!std::isfinite(c.loss_scale) || c.loss_scale < 0)
    return invalid_argument("fp16.loss_scale: must be 0 (dynamic) or a finite positive scale, got " +
                            std::to_string(c.loss_scale));
  if (c.loss_scale > 0) return LossScaler(false, true, c.loss_scale, 1, 1, false, c.loss_scale);
  // 2^127 is the largest power of two a double scale can hold and still halve back exactly.
  if (c.initial_scale_power < 0 || c.initial_scale_power > 127)
    return invalid_argument("fp16.initial_scale_power: must be in [0, 127], got " +
                            std::to_string(c.initial_scale_power));
  if (c.loss_scale_window == 0) return invalid_argument("fp16.loss_scale_window: must be ≥ 1");
  if (c.hysteresis == 0) return invalid_argument("fp16.hysteresis: must be ≥ 1");
  if (!std::isfinite(c.min_loss_scale) || c.min_loss_scale <= 0)
    return invalid_argument("fp16.min_loss_scale: must be a finite number > 0, got " +
                            std::to_string(c.min_loss_scale));
  return LossScaler(true, true, std::ldexp(1.0, c.initial_scale_power), c.loss_scale_window, c.hysteresis,
                    c.consecutive_hysteresis, c.min_loss_scale);
}

LossScaler LossScaler::unscaled(bool skip_on_overflow) {
  return LossScaler(false, skip_on_overflow, 1, 1, 1, false, 1);
}

Result<LossScaler> LossScaler::for_config(const Config& config) {
  if (config.fp16.enabled) return from_fp16(config.fp16);
  if (config.bf16.enabled) return unscaled(config.bf16.check_grad_overflow);
  return unscaled(false);
}

bool LossScaler::update(bool overflow) {
  LossScalerState& s = state_;
  if (!dynamic_) {
    if (overflow) s.last_overflow_iter = static_cast<int64_t>(s.cur_iter);
    ++s.cur_iter;
    return should_skip(overflow);
  }
  // DeepSpeed's DynamicLossScaler.update_scale, including its quirks: the window counts from the
  // last overflow (so the first growth comes after `window` clean steps from the start as well),
  // and without consecutive_hysteresis the hysteresis refills only when the scale grows.
  if (overflow) {
    if (delayed_shift_ == 1 || s.cur_hysteresis == 1) {
      s.cur_scale = std::max(s.cur_scale / 2, min_scale_);
    } else {
      --s.cur_hysteresis;
    }
    s.last_overflow_iter = static_cast<int64_t>(s.cur_iter);
  } else {
    if (consecutive_hysteresis_) s.cur_hysteresis = delayed_shift_;
    const auto since = static_cast<uint64_t>(static_cast<int64_t>(s.cur_iter) - s.last_overflow_iter);
    if (since % window_ == 0) {
      if (!consecutive_hysteresis_) s.cur_hysteresis = delayed_shift_;
      s.cur_scale *= 2;
    }
  }
  ++s.cur_iter;
  return should_skip(overflow);
}

Status LossScaler::restore(const LossScalerState& state) {
  if (!std::isfinite(state.cur_scale) || state.cur_scale <= 0)
    return invalid_argument("loss scaler state: scale must be finite and > 0, got " + std::to_string(state.cur_scale));
  if (state.last_overflow_iter < -1 || state.last_overflow_iter >= static_cast<int64_t>(state.cur_iter))
    return invalid_argument("loss scaler state: last_overflow_iter " + std::to_string(state.last_overflow_iter) +
                            " must be in [-1, cur_iter " + std::to_string(state.cur_iter) + ")");
  if (dynamic_ && (state.cur_hysteresis == 0 || state.cur_hysteresis > delayed_shift_))
    return invalid_argument("loss scaler state: cur_hysteresis " + std::to_string(state.cur_hysteresis) +
                            " must be in [1, hysteresis " + std::to_string(delayed_shift_) + "]");
  const double scale = state_.cur_scale;
  const uint64_t hysteresis = state_.cur_hysteresis;
  state_ = state;
  if (!dynamic_) {
    state_.cur_scale = scale;
    state_.cur_hysteresis = hysteresis;
  }
  return Status::ok();
}

}  // namespace zo::engine

// LossScaler: the loss scale of fp16 training and the rule for skipping a step whose gradients
// overflowed — DeepSpeed's DynamicLossScaler (deepspeed/runtime/fp16/loss_scaler.py) step for step,
// a static scale when fp16.loss_scale > 0, and a unit scale for bf16/fp32 that only decides skips.
// Rules in docs/training.md. Not synchronised: the trainer thread owns it.
#pragma once

#include <cstdint>

#include "common/status.h"
#include "engine/config/config.h"

namespace zo::engine {

// Everything a checkpoint needs to continue the dynamic scale exactly (DeepSpeed's field names).
struct LossScalerState {
  double cur_scale = 1;
  uint64_t cur_iter = 0;            // update() calls so far
  int64_t last_overflow_iter = -1;  // cur_iter of the last overflow; -1: none yet
  uint64_t cur_hysteresis = 1;      // overflows still tolerated before the next halving
};

class LossScaler {
 public:
  // fp16: dynamic (loss_scale == 0: cur_scale = 2^initial_scale_power) or static (loss_scale > 0).
  // Every overflow skips the step, in both. kInvalidArgument (naming the fp16 key) for a scale
  // that is not a finite positive number, initial_scale_power outside [0, 127], loss_scale_window
  // or hysteresis 0, or min_loss_scale ≤ 0.
  static Result<LossScaler> from_fp16(const Fp16Config& config);
  // Scale 1, never changes. `skip_on_overflow`: whether an overflow skips the step (bf16 with
  // check_grad_overflow); it is still counted in the state either way.
  static LossScaler unscaled(bool skip_on_overflow);
  // The scaler the config asks for: fp16 → from_fp16; bf16 → unscaled(check_grad_overflow);
  // fp32 → unscaled(false), as DeepSpeed does not check fp32 gradients.
  static Result<LossScaler> for_config(const Config& config);

  // The factor the loss is multiplied by before backward (gradients are divided by it again).
  double scale() const { return state_.cur_scale; }
  bool dynamic() const { return dynamic_; }
  // Whether a step whose gradients overflowed (`overflow`: any inf/nan, or the global norm is not
  // finite) must skip the optimizer step. Pure: does not change the scale.
  bool should_skip(bool overflow) const { return overflow && skip_on_overflow_; }
  // Records the outcome of one accumulation boundary, overflowed or clean, and moves the dynamic
  // scale by DeepSpeed's rules; returns should_skip(overflow). Call exactly once per boundary,
  // skipped or not.
  bool update(bool overflow);

  LossScalerState state() const { return state_; }
  // Continues from a checkpointed state. A static or unit scaler keeps its configured scale and
  // takes only the counters. kInvalidArgument for a state no scaler can reach (scale not finite
  // or ≤ 0, cur_hysteresis 0 or above hysteresis, last_overflow_iter ≥ cur_iter).
  Status restore(const LossScalerState& state);

 private:
  LossScaler(bool dynamic, bool skip_on_overflow, double scale, uint64_t window, uint64_t hysteresis,
             bool consecutive_hysteresis, double min_scale);

  bool dynamic_ = false;
  bool skip_on_overflow_ = false;
  uint64_t window_ = 1;         // loss_scale_window
  uint64_t delayed_shift_ = 1;  // hysteresis
  bool consecutive_hysteresis_ = false;
  double min_scale_ = 1;
  LossScalerState state_;
};

}  // namespace zo::engine

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <utility>
#include <vector>

#include "engine/optim/grad_clip.h"
#include "engine/optim/loss_scaler.h"
#include "engine/optim/lr_schedule.h"

namespace zo::engine {
namespace {

using ::testing::HasSubstr;

struct LrCase {
  uint64_t step;
  double lr;
};

// Expected values below were computed in Python (double) with DeepSpeed's formulas as written in
// docs/training.md: γ_log = ln(t+1)/ln(N), γ_linear = t/N, N = max(2, warmup_num_steps);
// WarmupLR lr = min + (max − min)·γ; WarmupDecayLR after warm-up γ = max(0, (total − t)/max(1, total − N));
// WarmupCosineLR ratio = wmr + (1 − wmr)·γ in warm-up, then cmr + (1 − cmr)·(1 + cos(π(t − N + 1)/(total − N)))/2.
void expect_schedule(const LrSchedule& s, const std::vector<LrCase>& cases) {
  for (const LrCase& c : cases) EXPECT_NEAR(s.lr_at(c.step), c.lr, 1e-15 + 1e-12 * c.lr) << "step " << c.step;
}

SchedulerConfig warmup(SchedulerType type, double min_lr, double max_lr, uint64_t n, WarmupType wt) {
  SchedulerConfig c;
  c.type = type;
  c.warmup_min_lr = min_lr;
  c.warmup_max_lr = max_lr;
  c.warmup_num_steps = n;
  c.warmup_type = wt;
  return c;
}

TEST(LrSchedule, NoneIsTheOptimizerLr) {
  auto s = LrSchedule::create(SchedulerConfig{}, 3e-4);
  ASSERT_TRUE(s) << s.status().to_string();
  expect_schedule(*s, {{0, 3e-4}, {1, 3e-4}, {1'000'000, 3e-4}});
}

TEST(LrSchedule, WarmupLrLogMatchesDeepSpeed) {
  auto s = LrSchedule::create(warmup(SchedulerType::kWarmupLR, 1e-5, 1e-3, 10, WarmupType::kLog), 1e-3);
  ASSERT_TRUE(s) << s.status().to_string();
  EXPECT_EQ(s->warmup_steps(), 10u);
  expect_schedule(*s, {{0, 1e-05},
                       {1, 0.0003080196957073414},
                       {5, 0.0007803697378798071},
                       {9, 0.001},  // ln(10)/ln(10): warm-up reaches max on its last step
                       {10, 0.001},
                       {11, 0.001},
                       {1000, 0.001}});
}

TEST(LrSchedule, WarmupLrLinearMatchesDeepSpeed) {
  auto s = LrSchedule::create(warmup(SchedulerType::kWarmupLR, 0, 2e-4, 4, WarmupType::kLinear), 1e-3);
  ASSERT_TRUE(s) << s.status().to_string();
  expect_schedule(*s, {{0, 0.0}, {1, 5e-05}, {3, 0.00015000000000000001}, {4, 0.0002}, {100, 0.0002}});
}

TEST(LrSchedule, WarmupShorterThanTwoStepsCountsAsTwo) {
  auto s = LrSchedule::create(warmup(SchedulerType::kWarmupLR, 0, 1.0, 0, WarmupType::kLinear), 1.0);
  ASSERT_TRUE(s) << s.status().to_string();
  EXPECT_EQ(s->warmup_steps(), 2u);
  expect_schedule(*s, {{0, 0.0}, {1, 0.5}, {2, 1.0}});
}

TEST(LrSchedule, WarmupDecayLrMatchesDeepSpeed) {
  SchedulerConfig c = warmup(SchedulerType::kWarmupDecayLR, 1e-5, 1e-3, 10, WarmupType::kLinear);
  c.total_num_steps = 30;
  auto s = LrSchedule::create(c, 1e-3);
  ASSERT_TRUE(s) << s.status().to_string();
  expect_schedule(*s, {{0, 1e-05},
                       {5, 0.000505},
                       {9, 0.000901},
                       {10, 0.001},  // t = N: decay starts from γ = (30 − 10)/20 = 1
                       {11, 0.0009505},
                       {20, 0.000505},
                       {29, 5.95e-05},
                       {30, 1e-05},  // t = total: down to warmup_min_lr
                       {31, 1e-05},
                       {100, 1e-05}});
}

TEST(LrSchedule, WarmupDecayLrLogWarmup) {
  SchedulerConfig c = warmup(SchedulerType::kWarmupDecayLR, 0, 1e-3, 10, WarmupType::kLog);
  c.total_num_steps = 30;
  auto s = LrSchedule::create(c, 1e-3);
  ASSERT_TRUE(s) << s.status().to_string();
  expect_schedule(*s, {{0, 0.0}, {3, 0.0006020599913279623}, {9, 0.001}});
}

TEST(LrSchedule, WarmupCosineLrMatchesDeepSpeed) {
  SchedulerConfig c;
  c.type = SchedulerType::kWarmupCosineLR;
  c.warmup_num_steps = 10;
  c.warmup_type = WarmupType::kLinear;
  c.total_num_steps = 30;
  c.warmup_min_ratio = 0.1;
  c.cos_min_ratio = 1e-4;
  auto s = LrSchedule::create(c, 3e-4);
  ASSERT_TRUE(s) << s.status().to_string();
  expect_schedule(*s, {{0, 2.9999999999999997e-05},
                       {5, 0.000165},
                       {9, 0.00027299999999999997},
                       {10, 0.00029815343576416174},  // t = N: already one step into the cosine
                       {11, 0.0002926592115965286},
                       {19, 0.00015001499999999998},  // half way: (1 + cmr)/2
                       {28, 1.8765642358382781e-06},
                       {29, 3e-08}});  // t = total − 1: base·cos_min_ratio
}

TEST(LrSchedule, WarmupCosineLrLogWarmup) {
  SchedulerConfig c;
  c.type = SchedulerType::kWarmupCosineLR;
  c.warmup_num_steps = 8;
  c.warmup_type = WarmupType::kLog;
  c.total_num_steps = 20;
  c.warmup_min_ratio = 0;
  c.cos_min_ratio = 0.05;
  auto s = LrSchedule::create(c, 1e-3);
  ASSERT_TRUE(s) << s.status().to_string();
  expect_schedule(*s, {{0, 0.0},
                       {1, 0.0003333333333333334},
                       {7, 0.001},
                       {8, 0.0009838147674873074},
                       {13, 0.0005250000000000001},
                       {19, 5e-05}});
}

TEST(LrSchedule, WarmupCosineLrHoldsItsMinimumPastTheEnd) {
  SchedulerConfig c;
  c.type = SchedulerType::kWarmupCosineLR;
  c.warmup_num_steps = 10;
  c.warmup_type = WarmupType::kLinear;
  c.total_num_steps = 30;
  c.cos_min_ratio = 1e-4;
  auto s = LrSchedule::create(c, 3e-4);
  ASSERT_TRUE(s) << s.status().to_string();
  for (uint64_t t : {30u, 31u, 49u, 1000u}) EXPECT_DOUBLE_EQ(s->lr_at(t), s->lr_at(29)) << "step " << t;
}

TEST(LrSchedule, IsAPureFunctionOfTheStep) {
  SchedulerConfig c = warmup(SchedulerType::kWarmupDecayLR, 0, 1e-3, 10, WarmupType::kLog);
  c.total_num_steps = 50;
  auto a = LrSchedule::create(c, 1e-3);
  auto b = LrSchedule::create(c, 1e-3);
  ASSERT_TRUE(a && b);
  std::vector<double> forward;
  for (uint64_t t = 0; t < 60; ++t) forward.push_back(a->lr_at(t));
  for (uint64_t t = 60; t-- > 0;) EXPECT_EQ(b->lr_at(t), forward[t]) << "step " << t;
}

// A run shorter than its warm-up (a smoke test of a long config; DeepSpeed only warns) warms up
// as the full schedule would and, past its end, holds the cosine's minimum.
TEST(LrSchedule, WarmupCosineLrShorterThanItsWarmup) {
  SchedulerConfig full;
  full.type = SchedulerType::kWarmupCosineLR;
  full.warmup_num_steps = 100;
  full.total_num_steps = 1000;
  full.cos_min_ratio = 0.1;
  SchedulerConfig smoke = full;
  smoke.total_num_steps = 5;
  auto a = LrSchedule::create(full, 1e-3);
  auto b = LrSchedule::create(smoke, 1e-3);
  ASSERT_TRUE(a && b);
  for (uint64_t t = 0; t < 5; ++t) EXPECT_EQ(b->lr_at(t), a->lr_at(t)) << "step " << t;
  EXPECT_EQ(b->lr_at(100), 1e-3 * 0.1);
}

TEST(LrSchedule, RejectsConfigsNoScheduleCanUse) {
  SchedulerConfig cos;
  cos.type = SchedulerType::kWarmupCosineLR;
  cos.warmup_num_steps = 10;
  cos.total_num_steps = 0;
  auto r = LrSchedule::create(cos, 1e-3);
  ASSERT_FALSE(r);
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("scheduler.params.total_num_steps"));
  cos.total_num_steps = 3;
  EXPECT_TRUE(LrSchedule::create(cos, 1e-3));
  cos.cos_min_ratio = 1.5;
  EXPECT_THAT(LrSchedule::create(cos, 1e-3).status().message(), HasSubstr("cos_min_ratio"));

  SchedulerConfig decay = warmup(SchedulerType::kWarmupDecayLR, 0, 1e-3, 10, WarmupType::kLog);
  decay.total_num_steps = 0;
  EXPECT_THAT(LrSchedule::create(decay, 1e-3).status().message(), HasSubstr("total_num_steps"));

  SchedulerConfig inverted = warmup(SchedulerType::kWarmupLR, 1e-2, 1e-3, 10, WarmupType::kLog);
  EXPECT_THAT(LrSchedule::create(inverted, 1e-3).status().message(), HasSubstr("warmup_min_lr"));

  EXPECT_FALSE(LrSchedule::create(SchedulerConfig{}, -1));
  EXPECT_FALSE(LrSchedule::create(SchedulerConfig{}, std::numeric_limits<double>::quiet_NaN()));
}

// ---- loss scaling ------------------------------------------------------------------------------

Fp16Config fp16(int power, uint64_t window, uint64_t hysteresis, bool consecutive = false, double min_scale = 1) {
  Fp16Config c;
  c.enabled = true;
  c.initial_scale_power = power;
  c.loss_scale_window = window;
  c.hysteresis = hysteresis;
  c.consecutive_hysteresis = consecutive;
  c.min_loss_scale = min_scale;
  return c;
}

// Feeds `steps` ('o' = overflow, '.' = clean) and returns the scale after each.
std::vector<double> run(LossScaler& s, const char* steps) {
  std::vector<double> scales;
  for (const char* p = steps; *p; ++p) {
    const bool overflow = *p == 'o';
    EXPECT_EQ(s.update(overflow), overflow) << "an fp16 overflow always skips the step";
    scales.push_back(s.scale());
  }
  return scales;
}

TEST(LossScaler, StartsAtTwoToTheInitialPower) {
  auto s = LossScaler::from_fp16(fp16(16, 1000, 2));
  ASSERT_TRUE(s) << s.status().to_string();
  EXPECT_TRUE(s->dynamic());
  EXPECT_EQ(s->scale(), 65536.0);
  LossScalerState st = s->state();
  EXPECT_EQ(st.cur_iter, 0u);
  EXPECT_EQ(st.last_overflow_iter, -1);
  EXPECT_EQ(st.cur_hysteresis, 2u);
}

TEST(LossScaler, HysteresisOneHalvesOnEveryOverflow) {
  auto s = LossScaler::from_fp16(fp16(4, 1000, 1));
  ASSERT_TRUE(s);
  EXPECT_EQ(run(*s, "ooo"), (std::vector<double>{8, 4, 2}));
}

TEST(LossScaler, HysteresisTwoToleratesOneOverflowThenHalves) {
  auto s = LossScaler::from_fp16(fp16(4, 1000, 2));
  ASSERT_TRUE(s);
  // First overflow uses up the hysteresis, the next ones halve. Without consecutive_hysteresis a
  // clean step in between does not refill it.
  EXPECT_EQ(run(*s, "oo.o"), (std::vector<double>{16, 8, 8, 4}));
  EXPECT_EQ(s->state().cur_hysteresis, 1u);
}

TEST(LossScaler, ConsecutiveHysteresisRefillsOnEveryCleanStep) {
  auto s = LossScaler::from_fp16(fp16(4, 1000, 2, /*consecutive=*/true));
  ASSERT_TRUE(s);
  // Isolated overflows never halve: each clean step restores the tolerance.
  EXPECT_EQ(run(*s, "o.o.o."), (std::vector<double>{16, 16, 16, 16, 16, 16}));
  EXPECT_EQ(run(*s, "oo"), (std::vector<double>{16, 8}));
}

TEST(LossScaler, DoublesAfterAWindowOfCleanStepsAndRefillsHysteresis) {
  auto s = LossScaler::from_fp16(fp16(4, 3, 2));
  ASSERT_TRUE(s);
  // From the start: (cur_iter − (−1)) % 3 == 0 at cur_iter 2, 5, ...
  EXPECT_EQ(run(*s, "......"), (std::vector<double>{16, 16, 32, 32, 32, 64}));
  // An overflow at iter 6 uses the hysteresis; growth then counts from it: iter 9 (= 6 + 3).
  EXPECT_EQ(run(*s, "o..."), (std::vector<double>{64, 64, 64, 128}));
  EXPECT_EQ(s->state().cur_hysteresis, 2u) << "growth refills the hysteresis";
  EXPECT_EQ(s->state().last_overflow_iter, 6);
  EXPECT_EQ(s->state().cur_iter, 10u);
}

TEST(LossScaler, NeverGoesBelowTheMinimum) {
  auto s = LossScaler::from_fp16(fp16(3, 1000, 1, false, /*min_scale=*/2));
  ASSERT_TRUE(s);
  EXPECT_EQ(run(*s, "oooo"), (std::vector<double>{4, 2, 2, 2}));
}

TEST(LossScaler, StaticScaleNeverMovesButOverflowsStillSkip) {
  Fp16Config c = fp16(16, 2, 1);
  c.loss_scale = 128;
  auto s = LossScaler::from_fp16(c);
  ASSERT_TRUE(s);
  EXPECT_FALSE(s->dynamic());
  EXPECT_EQ(run(*s, "....oo...."), std::vector<double>(10, 128.0));
  EXPECT_EQ(s->state().last_overflow_iter, 5);
}

TEST(LossScaler, UnscaledForBf16AndFp32) {
  Config c;
  c.bf16.enabled = true;
  auto bf16 = LossScaler::for_config(c);
  ASSERT_TRUE(bf16);
  EXPECT_EQ(bf16->scale(), 1.0);
  EXPECT_TRUE(bf16->update(true)) << "bf16 check_grad_overflow skips";
  EXPECT_FALSE(bf16->update(false));
  EXPECT_EQ(bf16->scale(), 1.0);
  c.bf16.check_grad_overflow = false;
  EXPECT_FALSE(LossScaler::for_config(c)->should_skip(true));
  c.bf16.enabled = false;
  auto fp32 = LossScaler::for_config(c);
  ASSERT_TRUE(fp32);
  EXPECT_FALSE(fp32->should_skip(true));
  c.fp16 = fp16(10, 100, 2);
  auto f16 = LossScaler::for_config(c);
  ASSERT_TRUE(f16);
  EXPECT_EQ(f16->scale(), 1024.0);
}

TEST(LossScaler, RestoredStateContinuesIdentically) {
  const char* steps = "..o.oo.....o......o.o..........";
  auto a = LossScaler::from_fp16(fp16(8, 4, 2));
  auto b = LossScaler::from_fp16(fp16(8, 4, 2));
  ASSERT_TRUE(a && b);
  run(*a, "..o.oo....o");
  ASSERT_TRUE(b->restore(a->state()).is_ok());
  EXPECT_EQ(run(*a, steps), run(*b, steps));
  EXPECT_EQ(a->state().cur_iter, b->state().cur_iter);
}

TEST(LossScaler, RejectsBadConfigsAndStates) {
  EXPECT_THAT(LossScaler::from_fp16(fp16(16, 0, 2)).status().message(), HasSubstr("fp16.loss_scale_window"));
  EXPECT_THAT(LossScaler::from_fp16(fp16(16, 10, 0)).status().message(), HasSubstr("fp16.hysteresis"));
  EXPECT_THAT(LossScaler::from_fp16(fp16(16, 10, 2, false, 0)).status().message(), HasSubstr("fp16.min_loss_scale"));
  EXPECT_THAT(LossScaler::from_fp16(fp16(200, 10, 2)).status().message(), HasSubstr("fp16.initial_scale_power"));

  auto s = LossScaler::from_fp16(fp16(8, 4, 2));
  ASSERT_TRUE(s);
  LossScalerState bad = s->state();
  bad.cur_scale = std::numeric_limits<double>::infinity();
  EXPECT_FALSE(s->restore(bad).is_ok());
  bad = s->state();
  bad.cur_hysteresis = 3;
  EXPECT_FALSE(s->restore(bad).is_ok());
  bad = s->state();
  bad.last_overflow_iter = 0;  // cur_iter is 0: no overflow can have happened yet
  EXPECT_FALSE(s->restore(bad).is_ok());
  EXPECT_EQ(s->scale(), 256.0) << "a rejected state changes nothing";
}

// ---- gradient clipping -------------------------------------------------------------------------

TEST(GradClip, CoefficientFollowsClipGradNorm) {
  EXPECT_EQ(clip_coefficient(0.5, 1.0), 1.0f);
  EXPECT_EQ(clip_coefficient(0.0, 1.0), 1.0f);
  EXPECT_EQ(clip_coefficient(4.0, 1.0), static_cast<float>(1.0 / (4.0 + 1e-6)));
  EXPECT_EQ(clip_coefficient(10.0, 2.5), static_cast<float>(2.5 / (10.0 + 1e-6)));
  // PyTorch clamps max_norm/(norm + 1e-6) to 1, so a norm exactly at the limit is scaled by a
  // hair under 1 too.
  EXPECT_EQ(clip_coefficient(1.0, 1.0), static_cast<float>(1.0 / (1.0 + 1e-6)));
  EXPECT_LT(clip_coefficient(1.0, 1.0), 1.0f);
}

TEST(GradClip, ZeroOrNegativeMaxNormDisablesClipping) {
  EXPECT_EQ(clip_coefficient(1e6, 0.0), 1.0f);
  EXPECT_EQ(clip_coefficient(1e6, -1.0), 1.0f);
}

TEST(GradClip, ClippedNormLandsOnTheLimit) {
  for (double norm : {1.5, 37.5, 1e4}) EXPECT_NEAR(norm * clip_coefficient(norm, 1.0), 1.0, 1e-6) << norm;
}

TEST(GradClip, NonFiniteNormsAreDetected) {
  EXPECT_TRUE(is_finite_norm(0.0));
  EXPECT_TRUE(is_finite_norm(1e300));
  EXPECT_FALSE(is_finite_norm(std::numeric_limits<double>::infinity()));
  EXPECT_FALSE(is_finite_norm(std::numeric_limits<double>::quiet_NaN()));
}

}  // namespace
}  // namespace zo::engine

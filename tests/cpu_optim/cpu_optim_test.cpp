// cpu_optim: every SIMD path against the scalar path (bit-identical, NaN payloads aside) on random
// data with denormals, infinities and NaNs; the scalar path against a naive per-element restatement
// of the formulas; conversions against hand-picked edge cases; determinism of the squared norm.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "cpu_optim/adagrad.h"
#include "cpu_optim/adam.h"
#include "cpu_optim/adam8bit.h"
#include "cpu_optim/detail/kernels.h"
#include "cpu_optim/dtype.h"
#include "cpu_optim/executor.h"
#include "cpu_optim/isa.h"
#include "cpu_optim/lion.h"
#include "cpu_optim/vector_ops.h"

namespace zo::cpu_optim {
namespace {

// Multi-tile, with a ragged tail that is not a multiple of any SIMD width.
constexpr size_t kN = 3 * kTileElems + 37;

std::unique_ptr<Executor> make_executor(Isa isa, int threads = 2, bool bind = false) {
  auto e = Executor::create({.n_threads = threads, .bind_cores = bind, .isa = isa});
  ZO_CHECK(e.is_ok()) << e.status().to_string();
  return std::move(e).value();
}

std::string hex(uint32_t x) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "0x%08x", x);
  return buf;
}

bool is_nan16(uint16_t h, DType dtype) { return dtype == DType::kBF16 ? (h & 0x7FFF) > 0x7F80 : (h & 0x7FFF) > 0x7C00; }

// Same bits, or both NaN (payload and sign of NaNs are not part of the contract).
::testing::AssertionResult same_floats(const std::vector<float>& a, const std::vector<float>& b, const char* what) {
  if (a.size() != b.size()) return ::testing::AssertionFailure() << what << ": sizes differ";
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::isnan(a[i]) && std::isnan(b[i])) continue;
    if (float_bits(a[i]) != float_bits(b[i]))
      return ::testing::AssertionFailure() << what << "[" << i << "]: " << a[i] << " (" << hex(float_bits(a[i]))
                                           << ") vs " << b[i] << " (" << hex(float_bits(b[i])) << ")";
  }
  return ::testing::AssertionSuccess();
}

::testing::AssertionResult same_u16(const std::vector<uint16_t>& a, const std::vector<uint16_t>& b, DType dtype,
                                    const char* what) {
  if (a.size() != b.size()) return ::testing::AssertionFailure() << what << ": sizes differ";
  for (size_t i = 0; i < a.size(); ++i) {
    if (is_nan16(a[i], dtype) && is_nan16(b[i], dtype)) continue;
    if (a[i] != b[i])
      return ::testing::AssertionFailure() << what << "[" << i << "]: " << hex(a[i]) << " vs " << hex(b[i]);
  }
  return ::testing::AssertionSuccess();
}

// Mostly ordinary values of the given magnitude, ~8% specials: denormals, ±0, ±inf, NaN, extremes.
float random_value(std::mt19937& rng, float scale, bool non_negative) {
  std::uniform_int_distribution<int> pick(0, 99);
  std::normal_distribution<float> normal(0.0f, scale);
  const int k = pick(rng);
  float x;
  if (k < 92) {
    x = normal(rng);
  } else if (k < 94) {
    x = bits_float(std::uniform_int_distribution<uint32_t>(1, 0x007FFFFF)(rng));  // denormal
  } else if (k == 94) {
    x = 0.0f;
  } else if (k == 95) {
    x = -0.0f;
  } else if (k == 96) {
    x = std::numeric_limits<float>::infinity();
  } else if (k == 97) {
    x = std::numeric_limits<float>::quiet_NaN();
  } else if (k == 98) {
    x = 3.0e38f;
  } else {
    x = 1.5e-38f;
  }
  if (!non_negative && (pick(rng) & 1)) x = -x;
  if (non_negative) x = std::fabs(x);
  return x;
}

// Memoised: the comparisons below regenerate the same inputs for every path and case.
std::vector<float> random_floats(size_t n, uint32_t seed, float scale, bool non_negative = false) {
  static std::map<std::tuple<size_t, uint32_t, float, bool>, std::vector<float>> cache;
  std::vector<float>& v = cache[{n, seed, scale, non_negative}];
  if (v.size() != n) {
    std::mt19937 rng(seed);
    v.resize(n);
    for (float& x : v) x = random_value(rng, scale, non_negative);
  }
  return v;
}

// A gradient buffer in any dtype; 16-bit ones mix converted values with raw random bit patterns
// (which include that format's denormals, infinities and NaNs).
struct Grad {
  DType dtype;
  std::vector<float> f32;
  std::vector<uint16_t> u16;
  ConstElemSpan span() const {
    return {dtype == DType::kF32 ? static_cast<const void*>(f32.data()) : u16.data(), dtype};
  }
};

Grad make_random_grad(DType dtype, size_t n, uint32_t seed) {
  Grad g{dtype, {}, {}};
  const std::vector<float> f = random_floats(n, seed, 1.0f);
  if (dtype == DType::kF32) {
    g.f32 = f;
    return g;
  }
  std::mt19937 rng(seed ^ 0x9E3779B9u);
  g.u16.resize(n);
  for (size_t i = 0; i < n; ++i) {
    const bool raw = (rng() % 16) == 0;
    g.u16[i] = raw ? static_cast<uint16_t>(rng()) : (dtype == DType::kBF16 ? float_to_bf16(f[i]) : float_to_f16(f[i]));
  }
  return g;
}

Grad random_grad(DType dtype, size_t n, uint32_t seed) {
  static std::map<std::tuple<DType, size_t, uint32_t>, Grad> cache;
  auto it = cache.find({dtype, n, seed});
  if (it == cache.end()) it = cache.emplace(std::tuple{dtype, n, seed}, make_random_grad(dtype, n, seed)).first;
  return it->second;
}

struct Copy {
  bool enabled;
  DType dtype;
  std::vector<float> f32;
  std::vector<uint16_t> u16;
  Copy(bool on, DType d, size_t n) : enabled(on), dtype(d) {
    if (!on) return;
    if (d == DType::kF32) f32.assign(n, -1.0f);
    else u16.assign(n, 0xFFFF);
  }
  ElemSpan span() {
    if (!enabled) return {};
    return {dtype == DType::kF32 ? static_cast<void*>(f32.data()) : u16.data(), dtype};
  }
};

struct CopyCase {
  bool on;
  DType dtype;
};
const CopyCase kCopyCases[] = {{false, DType::kF32}, {true, DType::kF32}, {true, DType::kBF16}, {true, DType::kF16}};
const DType kDTypes[] = {DType::kF32, DType::kBF16, DType::kF16};

std::string case_name(DType g, const CopyCase& c) {
  return "grad " + std::string(dtype_name(g)) + ", copy " + (c.on ? std::string(dtype_name(c.dtype)) : "none");
}

// ---- Conversions ---------------------------------------------------------------------------------

TEST(Conversion, Bf16RoundsToNearestEvenIncludingDenormals) {
  EXPECT_EQ(float_to_bf16(1.0f), 0x3F80);
  EXPECT_EQ(float_to_bf16(bits_float(0x3F808000)), 0x3F80);  // tie, even stays
  EXPECT_EQ(float_to_bf16(bits_float(0x3F818000)), 0x3F82);  // tie, odd rounds up
  EXPECT_EQ(float_to_bf16(bits_float(0x3F808001)), 0x3F81);
  EXPECT_EQ(float_to_bf16(bits_float(0x00008000)), 0x0000);  // denormal tie to even (zero)
  EXPECT_EQ(float_to_bf16(bits_float(0x00018000)), 0x0002);  // denormal tie, odd rounds up
  EXPECT_EQ(float_to_bf16(bits_float(0x7F7FFFFF)), 0x7F80);  // FLT_MAX rounds to inf
  EXPECT_EQ(float_to_bf16(-std::numeric_limits<float>::infinity()), 0xFF80);
  EXPECT_TRUE(is_nan16(float_to_bf16(bits_float(0x7F800001)), DType::kBF16));  // sNaN with low payload only
  for (uint32_t h = 0; h < 0x10000; ++h) {
    if (is_nan16(static_cast<uint16_t>(h), DType::kBF16)) continue;
    ASSERT_EQ(float_to_bf16(bf16_to_float(static_cast<uint16_t>(h))), h) << hex(h);
  }
}

TEST(Conversion, F16RoundsToNearestEvenIncludingDenormalsAndOverflow) {
  EXPECT_EQ(float_to_f16(1.0f), 0x3C00);
  EXPECT_EQ(float_to_f16(65504.0f), 0x7BFF);
  EXPECT_EQ(float_to_f16(65519.996f), 0x7BFF);
  EXPECT_EQ(float_to_f16(65520.0f), 0x7C00);  // tie between 65504 and 65536 goes to even = inf
  EXPECT_EQ(float_to_f16(std::ldexp(1.0f, -24)), 0x0001);
  EXPECT_EQ(float_to_f16(std::ldexp(1.0f, -25)), 0x0000);  // tie to even
  EXPECT_EQ(float_to_f16(std::ldexp(1.5f, -25)), 0x0001);
  EXPECT_EQ(float_to_f16(std::ldexp(3.0f, -25)), 0x0002);     // 1.5 ulp: tie, odd → even
  EXPECT_EQ(float_to_f16(std::ldexp(1023.5f, -24)), 0x0400);  // rounds up into the smallest normal
  EXPECT_EQ(float_to_f16(-0.0f), 0x8000);
  EXPECT_EQ(float_to_f16(bits_float(0x00000001)), 0x0000);
  for (uint32_t h = 0; h < 0x10000; ++h) {
    if (is_nan16(static_cast<uint16_t>(h), DType::kF16)) continue;
    ASSERT_EQ(float_to_f16(f16_to_float(static_cast<uint16_t>(h))), h) << hex(h);
  }
}

class SimdPath : public ::testing::TestWithParam<Isa> {
 protected:
  void SetUp() override {
    if (!isa_supported(GetParam()))
      GTEST_SKIP() << "this CPU cannot run the " << isa_name(GetParam()) << " path (best here: " << isa_name(best_isa())
                   << "); it is tested on a machine that can";
    simd_ = make_executor(GetParam());
    scalar_ = make_executor(Isa::kScalar);
  }
  std::unique_ptr<Executor> simd_, scalar_;
};

// The hardware conversions (VCVTPS2PH/VCVTPH2PS) and our integer bf16 rounding against the scalar
// definitions, over a sweep of 2^32/61 bit patterns (every exponent, both signs, varied low bits).
TEST_P(SimdPath, ConversionsMatchScalarOverBitPatternSweep) {
  constexpr size_t kChunk = 1 << 20;
  std::vector<float> src(kChunk), back_simd(kChunk), back_scalar(kChunk);
  std::vector<uint16_t> simd16(kChunk), scalar16(kChunk);
  uint64_t bits = 0;
  while (bits < (uint64_t{1} << 32)) {
    size_t n = 0;
    for (; n < kChunk && bits < (uint64_t{1} << 32); ++n, bits += 61) src[n] = bits_float(static_cast<uint32_t>(bits));
    for (DType d : {DType::kBF16, DType::kF16}) {
      ASSERT_TRUE(convert({src.data(), DType::kF32}, {simd16.data(), d}, n, *simd_).is_ok());
      ASSERT_TRUE(convert({src.data(), DType::kF32}, {scalar16.data(), d}, n, *scalar_).is_ok());
      ASSERT_TRUE(same_u16(simd16, scalar16, d, d == DType::kBF16 ? "fp32→bf16" : "fp32→fp16"));
      ASSERT_TRUE(convert({simd16.data(), d}, {back_simd.data(), DType::kF32}, n, *simd_).is_ok());
      ASSERT_TRUE(convert({scalar16.data(), d}, {back_scalar.data(), DType::kF32}, n, *scalar_).is_ok());
      ASSERT_TRUE(same_floats(back_simd, back_scalar, "16→fp32"));
    }
  }
}

TEST_P(SimdPath, ConvertsEveryDtypePairLikeScalar) {
  for (DType s : kDTypes) {
    for (DType d : kDTypes) {
      const Grad src = random_grad(s, kN, 11);
      Copy a(true, d, kN), b(true, d, kN);
      ASSERT_TRUE(convert(src.span(), a.span(), kN, *simd_).is_ok());
      ASSERT_TRUE(convert(src.span(), b.span(), kN, *scalar_).is_ok());
      if (d == DType::kF32) EXPECT_TRUE(same_floats(a.f32, b.f32, "convert"));
      else EXPECT_TRUE(same_u16(a.u16, b.u16, d, "convert"));
    }
  }
}

// ---- Optimizers: SIMD vs scalar ------------------------------------------------------------------

struct AdamRun {
  std::vector<float> p, m, v;
  Copy copy;
};

AdamRun run_adam(const Executor& ex, const AdamConfig& cfg, DType gdt, CopyCase cc, float scale, int steps) {
  AdamRun r{random_floats(kN, 1, 1.0f), random_floats(kN, 2, 0.01f), random_floats(kN, 3, 1e-4f, true),
            Copy(cc.on, cc.dtype, kN)};
  for (int s = 1; s <= steps; ++s) {
    const Grad g = random_grad(gdt, kN, 100 + s);
    const Status st = adam_step(cfg, s == steps ? 1000 : s, r.p, r.m, r.v, g.span(), scale, r.copy.span(), ex);
    ZO_CHECK(st.is_ok()) << st.to_string();
  }
  return r;
}

// Guards against a vacuous comparison: the step must have changed most parameters to finite values.
::testing::AssertionResult mostly_updated(const std::vector<float>& before, const std::vector<float>& after) {
  size_t changed = 0;
  for (size_t i = 0; i < before.size(); ++i) changed += std::isfinite(after[i]) && after[i] != before[i];
  if (changed * 10 < before.size() * 7)
    return ::testing::AssertionFailure() << "only " << changed << " of " << before.size() << " parameters changed";
  return ::testing::AssertionSuccess();
}

void expect_same_copy(const Copy& a, const Copy& b, const std::string& what) {
  if (!a.enabled) return;
  if (a.dtype == DType::kF32) EXPECT_TRUE(same_floats(a.f32, b.f32, "copy_out")) << what;
  else EXPECT_TRUE(same_u16(a.u16, b.u16, a.dtype, "copy_out")) << what;
}

TEST_P(SimdPath, AdamIsBitIdenticalToScalar) {
  AdamConfig configs[4];
  configs[0] = {.lr = 1e-3f, .weight_decay = 0.01f, .adam_w_mode = true, .bias_correction = true};
  configs[1] = {.lr = 2e-4f, .weight_decay = 0.1f, .adam_w_mode = false, .bias_correction = true};
  configs[2] = {
      .lr = 1e-2f, .beta1 = 0.8f, .beta2 = 0.95f, .eps = 1e-6f, .weight_decay = 0.0f, .bias_correction = false};
  configs[3] = {.lr = 5e-3f, .weight_decay = 0.0f, .adam_w_mode = false, .bias_correction = true};
  for (int c = 0; c < 4; ++c) {
    for (DType g : kDTypes) {
      for (const CopyCase& cc : kCopyCases) {
        const float scale = (c % 2) ? 1.0f : 0.7f / 1024.0f;
        const AdamRun a = run_adam(*simd_, configs[c], g, cc, scale, 3);
        const AdamRun b = run_adam(*scalar_, configs[c], g, cc, scale, 3);
        const std::string what = "config " + std::to_string(c) + ", " + case_name(g, cc);
        ASSERT_TRUE(mostly_updated(random_floats(kN, 1, 1.0f), a.p)) << what;
        ASSERT_TRUE(same_floats(a.p, b.p, "params")) << what;
        ASSERT_TRUE(same_floats(a.m, b.m, "exp_avg")) << what;
        ASSERT_TRUE(same_floats(a.v, b.v, "exp_avg_sq")) << what;
        expect_same_copy(a.copy, b.copy, what);
      }
    }
  }
}

// bf16 moments (adam_step_bf16_moments): 3 steps, every ISA against the scalar path, bit for bit.
struct Bf16MomentRun {
  std::vector<float> p;
  std::vector<uint16_t> m, v;
  Copy copy;
};

Bf16MomentRun run_adam_bf16_moments(const Executor& ex, const AdamConfig& cfg, DType gdt, CopyCase cc, int steps) {
  Bf16MomentRun r{random_floats(kN, 1, 1.0f), {}, {}, Copy(cc.on, cc.dtype, kN)};
  for (float x : random_floats(kN, 2, 0.01f)) r.m.push_back(float_to_bf16(x));
  for (float x : random_floats(kN, 3, 1e-4f, true)) r.v.push_back(float_to_bf16(x));
  for (int s = 1; s <= steps; ++s) {
    const Grad g = random_grad(gdt, kN, 100 + s);
    const Status st = adam_step_bf16_moments(cfg, s, r.p, r.m, r.v, g.span(), 0.7f / 1024.0f, r.copy.span(), ex);
    ZO_CHECK(st.is_ok()) << st.to_string();
  }
  return r;
}

TEST_P(SimdPath, AdamWithBf16MomentsIsBitIdenticalToScalar) {
  const AdamConfig adamw{.lr = 1e-3f, .weight_decay = 0.01f, .adam_w_mode = true, .bias_correction = true};
  const AdamConfig l2{.lr = 2e-4f, .weight_decay = 0.1f, .adam_w_mode = false, .bias_correction = true};
  for (const AdamConfig& cfg : {adamw, l2}) {
    for (DType g : kDTypes) {
      for (const CopyCase& cc : kCopyCases) {
        const Bf16MomentRun a = run_adam_bf16_moments(*simd_, cfg, g, cc, 3);
        const Bf16MomentRun b = run_adam_bf16_moments(*scalar_, cfg, g, cc, 3);
        const std::string what = std::string(cfg.adam_w_mode ? "AdamW, " : "Adam (L2), ") + case_name(g, cc);
        ASSERT_TRUE(mostly_updated(random_floats(kN, 1, 1.0f), a.p)) << what;
        ASSERT_TRUE(same_floats(a.p, b.p, "params")) << what;
        ASSERT_EQ(a.m, b.m) << what;
        ASSERT_EQ(a.v, b.v) << what;
        expect_same_copy(a.copy, b.copy, what);
      }
    }
  }
}

// The definition: one step with bf16 moments is the fp32 step on the widened moments, the parameters
// bit for bit, with the new moments rounded to nearest even.
TEST(AdamBf16Moments, IsTheFp32StepWithTheMomentsRounded) {
  const auto ex = make_executor(Isa::kAuto);
  const AdamConfig cfg{.lr = 1e-3f, .weight_decay = 0.01f, .adam_w_mode = true, .bias_correction = true};
  std::vector<float> p = random_floats(kN, 1, 1.0f), p32 = p, m32, v32;
  std::vector<uint16_t> m, v;
  for (float x : random_floats(kN, 2, 0.01f)) m.push_back(float_to_bf16(x));
  for (float x : random_floats(kN, 3, 1e-4f, true)) v.push_back(float_to_bf16(x));
  for (uint16_t x : m) m32.push_back(bf16_to_float(x));
  for (uint16_t x : v) v32.push_back(bf16_to_float(x));
  const Grad g = random_grad(DType::kF32, kN, 7);
  ASSERT_TRUE(adam_step_bf16_moments(cfg, 5, p, m, v, g.span(), 1.0f, {}, *ex).is_ok());
  ASSERT_TRUE(adam_step(cfg, 5, p32, m32, v32, g.span(), 1.0f, {}, *ex).is_ok());
  EXPECT_TRUE(same_floats(p, p32, "params"));
  size_t rounded = 0;
  for (size_t i = 0; i < kN; ++i) {
    ASSERT_EQ(m[i], float_to_bf16(m32[i])) << i;
    ASSERT_EQ(v[i], float_to_bf16(v32[i])) << i;
    rounded += bf16_to_float(m[i]) != m32[i];
  }
  EXPECT_GT(rounded, kN / 2) << "the fp32 moments should mostly not be bf16 values";
}

TEST(AdamBf16Moments, RefusesMismatchedSpansBeforeWritingAnything) {
  const auto ex = make_executor(Isa::kAuto);
  std::vector<float> p(10, 1.0f), g(10, 1.0f);
  std::vector<uint16_t> m(10, 0), v(9, 0);
  const Status s = adam_step_bf16_moments(AdamConfig{}, 1, p, m, v, {g.data(), DType::kF32}, 1.0f, {}, *ex);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("adam_step_bf16_moments: exp_avg_sq has 9 elements but params has 10"), std::string::npos)
      << s.to_string();
  for (float x : p) EXPECT_EQ(x, 1.0f);
}

TEST_P(SimdPath, AdagradIsBitIdenticalToScalar) {
  for (float wd : {0.0f, 0.05f}) {
    for (DType g : kDTypes) {
      for (const CopyCase& cc : kCopyCases) {
        const AdagradConfig cfg{.lr = 1e-2f, .eps = 1e-10f, .weight_decay = wd};
        std::vector<float> p[2], v[2];
        Copy copies[2] = {Copy(cc.on, cc.dtype, kN), Copy(cc.on, cc.dtype, kN)};
        const Executor* ex[2] = {simd_.get(), scalar_.get()};
        for (int k = 0; k < 2; ++k) {
          p[k] = random_floats(kN, 1, 1.0f);
          v[k] = random_floats(kN, 3, 1e-4f, true);
          for (int s = 1; s <= 3; ++s)
            ASSERT_TRUE(
                adagrad_step(cfg, p[k], v[k], random_grad(g, kN, 200 + s).span(), 0.5f, copies[k].span(), *ex[k])
                    .is_ok());
        }
        const std::string what = "wd " + std::to_string(wd) + ", " + case_name(g, cc);
        ASSERT_TRUE(mostly_updated(random_floats(kN, 1, 1.0f), p[0])) << what;
        ASSERT_TRUE(same_floats(p[0], p[1], "params")) << what;
        ASSERT_TRUE(same_floats(v[0], v[1], "exp_avg_sq")) << what;
        expect_same_copy(copies[0], copies[1], what);
      }
    }
  }
}

TEST_P(SimdPath, LionIsBitIdenticalToScalar) {
  for (float wd : {0.0f, 0.1f}) {
    for (DType g : kDTypes) {
      for (const CopyCase& cc : kCopyCases) {
        const LionConfig cfg{.lr = 1e-4f, .beta1 = 0.9f, .beta2 = 0.99f, .weight_decay = wd};
        std::vector<float> p[2], m[2];
        Copy copies[2] = {Copy(cc.on, cc.dtype, kN), Copy(cc.on, cc.dtype, kN)};
        const Executor* ex[2] = {simd_.get(), scalar_.get()};
        for (int k = 0; k < 2; ++k) {
          p[k] = random_floats(kN, 1, 1.0f);
          m[k] = random_floats(kN, 2, 0.01f);
          for (int s = 1; s <= 3; ++s)
            ASSERT_TRUE(
                lion_step(cfg, p[k], m[k], random_grad(g, kN, 300 + s).span(), 2.0f, copies[k].span(), *ex[k]).is_ok());
        }
        const std::string what = "wd " + std::to_string(wd) + ", " + case_name(g, cc);
        ASSERT_TRUE(mostly_updated(random_floats(kN, 1, 1.0f), p[0])) << what;
        ASSERT_TRUE(same_floats(p[0], p[1], "params")) << what;
        ASSERT_TRUE(same_floats(m[0], m[1], "exp_avg")) << what;
        expect_same_copy(copies[0], copies[1], what);
      }
    }
  }
}

// Adagrad's sum of squares and Lion's momentum in bf16 (zoffload.moment_dtype "bf16"): 3 steps,
// every ISA against the scalar path, bit for bit.
TEST_P(SimdPath, AdagradAndLionWithBf16StateAreBitIdenticalToScalar) {
  for (float wd : {0.0f, 0.05f}) {
    for (DType g : kDTypes) {
      for (const CopyCase& cc : kCopyCases) {
        const std::string what = "wd " + std::to_string(wd) + ", " + case_name(g, cc);
        const AdagradConfig ada{.lr = 1e-2f, .eps = 1e-10f, .weight_decay = wd};
        const LionConfig lion{.lr = 1e-4f, .beta1 = 0.9f, .beta2 = 0.99f, .weight_decay = wd};
        std::vector<float> p[2][2];
        std::vector<uint16_t> state[2][2];  // [optimizer][path]
        Copy copies[2][2] = {{Copy(cc.on, cc.dtype, kN), Copy(cc.on, cc.dtype, kN)},
                             {Copy(cc.on, cc.dtype, kN), Copy(cc.on, cc.dtype, kN)}};
        const Executor* ex[2] = {simd_.get(), scalar_.get()};
        for (int k = 0; k < 2; ++k) {
          for (int o = 0; o < 2; ++o) {
            p[o][k] = random_floats(kN, 1, 1.0f);
            for (float x : random_floats(kN, 3, o == 0 ? 1e-4f : 0.01f, o == 0))
              state[o][k].push_back(float_to_bf16(x));
          }
          for (int s = 1; s <= 3; ++s) {
            ASSERT_TRUE(adagrad_step_bf16_moments(ada, p[0][k], state[0][k], random_grad(g, kN, 200 + s).span(), 0.5f,
                                                  copies[0][k].span(), *ex[k])
                            .is_ok());
            ASSERT_TRUE(lion_step_bf16_moments(lion, p[1][k], state[1][k], random_grad(g, kN, 300 + s).span(), 2.0f,
                                               copies[1][k].span(), *ex[k])
                            .is_ok());
          }
        }
        for (int o = 0; o < 2; ++o) {
          const std::string which = (o == 0 ? "Adagrad, " : "Lion, ") + what;
          ASSERT_TRUE(mostly_updated(random_floats(kN, 1, 1.0f), p[o][0])) << which;
          ASSERT_TRUE(same_floats(p[o][0], p[o][1], "params")) << which;
          ASSERT_EQ(state[o][0], state[o][1]) << which;
          expect_same_copy(copies[o][0], copies[o][1], which);
        }
      }
    }
  }
}

// The definition: one step with a bf16 state is the fp32 step on the widened state, the parameters
// bit for bit, with the new state rounded to nearest even.
TEST(Bf16State, AdagradAndLionStepsAreTheFp32StepsWithTheStateRounded) {
  const auto ex = make_executor(Isa::kAuto);
  const Grad g = random_grad(DType::kF32, kN, 7);
  for (int o = 0; o < 2; ++o) {
    SCOPED_TRACE(o == 0 ? "Adagrad" : "Lion");
    std::vector<float> p = random_floats(kN, 1, 1.0f), p32 = p, s32;
    std::vector<uint16_t> s;
    for (float x : random_floats(kN, 3, o == 0 ? 1e-4f : 0.01f, o == 0)) s.push_back(float_to_bf16(x));
    for (uint16_t x : s) s32.push_back(bf16_to_float(x));
    if (o == 0) {
      const AdagradConfig cfg{.lr = 1e-2f, .eps = 1e-10f, .weight_decay = 0.05f};
      ASSERT_TRUE(adagrad_step_bf16_moments(cfg, p, s, g.span(), 1.0f, {}, *ex).is_ok());
      ASSERT_TRUE(adagrad_step(cfg, p32, s32, g.span(), 1.0f, {}, *ex).is_ok());
    } else {
      const LionConfig cfg{.lr = 3e-4f, .beta1 = 0.9f, .beta2 = 0.99f, .weight_decay = 0.1f};
      ASSERT_TRUE(lion_step_bf16_moments(cfg, p, s, g.span(), 1.0f, {}, *ex).is_ok());
      ASSERT_TRUE(lion_step(cfg, p32, s32, g.span(), 1.0f, {}, *ex).is_ok());
    }
    EXPECT_TRUE(same_floats(p, p32, "params"));
    size_t rounded = 0;
    for (size_t i = 0; i < kN; ++i) {
      ASSERT_EQ(s[i], float_to_bf16(s32[i])) << i;
      rounded += bf16_to_float(s[i]) != s32[i];
    }
    EXPECT_GT(rounded, kN / 2) << "the fp32 state should mostly not be bf16 values";
  }
  std::vector<float> p(10, 1.0f), gg(10, 1.0f);
  std::vector<uint16_t> short_state(9, 0);
  const Status st = lion_step_bf16_moments(LionConfig{}, p, short_state, {gg.data(), DType::kF32}, 1.0f, {}, *ex);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("lion_step_bf16_moments: exp_avg has 9 elements but params has 10"), std::string::npos)
      << st.to_string();
  for (float x : p) EXPECT_EQ(x, 1.0f);
}

TEST_P(SimdPath, SquaredNormIsBitIdenticalToScalar) {
  for (DType g : kDTypes) {
    // Finite data (an inf or NaN would make every path return inf/NaN and prove little).
    Grad grad{g, {}, {}};
    std::vector<float> f = random_floats(kN, 42, 1.0f);
    for (float& x : f)
      if (!std::isfinite(x) || std::fabs(x) > 1e18f) x = 0.25f;
    if (g == DType::kF32) {
      grad.f32 = f;
    } else {
      for (float x : f) grad.u16.push_back(g == DType::kBF16 ? float_to_bf16(x) : float_to_f16(x));
    }
    const Result<double> a = squared_norm(grad.span(), kN, *simd_);
    const Result<double> b = squared_norm(grad.span(), kN, *scalar_);
    ASSERT_TRUE(a.is_ok() && b.is_ok());
    EXPECT_EQ(*a, *b) << dtype_name(g);
    long double ref = 0;
    for (size_t i = 0; i < kN; ++i) {
      const long double x = load_as_float(grad.span().data, g, i);
      ref += x * x;
    }
    EXPECT_NEAR(*a, static_cast<double>(ref), 1e-12 * static_cast<double>(ref)) << dtype_name(g);
  }
}

// The accumulator before the add: `dtype` values from a seed (16-bit ones include raw patterns).
Copy random_acc(DType dtype, uint32_t seed) {
  Copy acc(true, dtype, kN);
  const Grad g = random_grad(dtype, kN, seed);
  if (dtype == DType::kF32) acc.f32 = g.f32;
  else acc.u16 = g.u16;
  return acc;
}

::testing::AssertionResult same_acc(const Copy& a, const Copy& b, const char* what) {
  return a.dtype == DType::kF32 ? same_floats(a.f32, b.f32, what) : same_u16(a.u16, b.u16, a.dtype, what);
}

TEST_P(SimdPath, AccumulatesEveryDtypePairLikeScalar) {
  for (DType a : kDTypes) {
    for (DType g : kDTypes) {
      for (bool from_zero : {false, true}) {
        const Grad grad = random_grad(g, kN, 500);
        Copy simd = random_acc(a, 501), scalar = random_acc(a, 501);
        ASSERT_TRUE(accumulate(simd.span(), grad.span(), kN, from_zero, *simd_).is_ok());
        ASSERT_TRUE(accumulate(scalar.span(), grad.span(), kN, from_zero, *scalar_).is_ok());
        EXPECT_TRUE(same_acc(simd, scalar, "accumulate"))
            << dtype_name(a) << " += " << dtype_name(g) << (from_zero ? ", from zero" : "");
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Isas, SimdPath, ::testing::Values(Isa::kAvx2, Isa::kAvx512),
                         [](const ::testing::TestParamInfo<Isa>& info) { return std::string(isa_name(info.param)); });

// ---- The scalar path against a naive restatement of the formulas ----------------------------------

// The definition: one fp32 add, rounded once to the accumulator's dtype; from zero, +0 + g.
TEST(ScalarAccumulate, IsOneFloatAddRoundedToTheAccumulator) {
  auto ex = make_executor(Isa::kScalar);
  for (DType a : kDTypes) {
    for (DType g : kDTypes) {
      for (bool from_zero : {false, true}) {
        const Grad grad = random_grad(g, kN, 510);
        Copy acc = random_acc(a, 511);
        const Copy before = acc;
        ASSERT_TRUE(accumulate(acc.span(), grad.span(), kN, from_zero, *ex).is_ok());
        Copy want(true, a, kN);
        for (size_t i = 0; i < kN; ++i) {
          const float old = from_zero ? 0.0f : load_as_float(const_cast<Copy&>(before).span().data, a, i);
          const float sum = old + load_as_float(grad.span().data, g, i);
          if (a == DType::kF32) want.f32[i] = sum;
          else want.u16[i] = a == DType::kBF16 ? float_to_bf16(sum) : float_to_f16(sum);
        }
        EXPECT_TRUE(same_acc(acc, want, "accumulate")) << dtype_name(a) << " += " << dtype_name(g);
      }
    }
  }
}

TEST(Accumulate, DoesNotDependOnThreadCountAndRefusesNull) {
  const Grad grad = random_grad(DType::kBF16, kN, 520);
  Copy first = random_acc(DType::kF32, 521);
  for (int threads : {1, 2, 3}) {
    auto ex = make_executor(Isa::kAuto, threads);
    Copy acc = random_acc(DType::kF32, 521);
    ASSERT_TRUE(accumulate(acc.span(), grad.span(), kN, false, *ex).is_ok());
    if (threads == 1) first = acc;
    else EXPECT_TRUE(same_acc(acc, first, "accumulate")) << threads << " threads";
  }
  auto ex = make_executor(Isa::kAuto);
  EXPECT_EQ(accumulate({}, grad.span(), kN, false, *ex).code(), StatusCode::kInvalidArgument);
  // A -0 gradient lands as +0 from zero, as in a zeroed buffer.
  float acc = 5.0f;
  const float neg_zero = -0.0f;
  ASSERT_TRUE(accumulate({&acc, DType::kF32}, {&neg_zero, DType::kF32}, 1, true, *ex).is_ok());
  EXPECT_EQ(acc, 0.0f);
  EXPECT_FALSE(std::signbit(acc));
}

TEST(Roofline, AddsTheReadStreamToEveryWrittenStreamOrSumsIt) {
  for (Isa isa : {Isa::kScalar, Isa::kAuto}) {
    auto ex = make_executor(isa, 2);
    std::vector<uint16_t> ro(kN);
    for (size_t i = 0; i < kN; ++i) ro[i] = float_to_bf16(static_cast<float>(i % 97) * 0.25f);
    std::vector<float> a = random_floats(kN, 530, 1.0f), b = random_floats(kN, 531, 1.0f);
    for (float& x : a)
      if (!std::isfinite(x)) x = 1.0f;
    for (float& x : b)
      if (!std::isfinite(x)) x = 1.0f;
    const std::vector<float> a0 = a, b0 = b;
    float* rw[] = {a.data(), b.data()};
    const Result<double> r = roofline_pass(rw, {ro.data(), DType::kBF16}, kN, *ex);
    ASSERT_TRUE(r.is_ok()) << r.status().to_string();
    EXPECT_EQ(*r, 0.0);
    for (size_t i = 0; i < kN; ++i) {
      const float x = bf16_to_float(ro[i]);
      ASSERT_EQ(a[i], a0[i] + x) << i;
      ASSERT_EQ(b[i], b0[i] + x) << i;
    }
    double want = 0;
    for (size_t i = 0; i < kN; ++i) want += bf16_to_float(ro[i]);
    const Result<double> sum = roofline_pass({}, {ro.data(), DType::kBF16}, kN, *ex);
    ASSERT_TRUE(sum.is_ok());
    EXPECT_NEAR(*sum, want, 1e-4 * want) << isa_name(ex->isa());
  }
  auto ex = make_executor(Isa::kAuto);
  std::vector<float> x(64, 1.0f);
  float* four[] = {x.data(), x.data(), x.data(), x.data()};
  EXPECT_EQ(roofline_pass(four, {x.data(), DType::kF32}, 64, *ex).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(roofline_pass({}, {}, 64, *ex).status().code(), StatusCode::kInvalidArgument);
}

TEST(ScalarAdam, MatchesNaiveDeepSpeedFormulas) {
  auto ex = make_executor(Isa::kScalar, 1);
  for (bool w_mode : {true, false}) {
    const AdamConfig cfg{.lr = 1e-3f, .weight_decay = 0.02f, .adam_w_mode = w_mode, .bias_correction = true};
    std::vector<float> p = random_floats(kN, 5, 1.0f), m = random_floats(kN, 6, 0.01f),
                       v = random_floats(kN, 7, 1e-4f, true);
    std::vector<float> rp = p, rm = m, rv = v;
    const float scale = 0.125f;
    for (int step = 1; step <= 4; ++step) {
      const Grad g = random_grad(DType::kF32, kN, 400 + step);
      ASSERT_TRUE(adam_step(cfg, step, p, m, v, g.span(), scale, {}, *ex).is_ok());
      // The library derives per-step constants in double from the float hyperparameters.
      const double lr = 1e-3f, b1 = 0.9f, b2 = 0.999f;
      const float bc2 = static_cast<float>(1.0 / std::sqrt(1.0 - std::pow(b2, step)));
      const float neg_step = static_cast<float>(-lr / (1.0 - std::pow(b1, step)));
      const float decay = static_cast<float>(1.0 - static_cast<double>(1e-3f) * static_cast<double>(0.02f));
      for (size_t i = 0; i < kN; ++i) {
        float grad = g.f32[i] * scale;
        if (!w_mode) grad = std::fma(rp[i], 0.02f, grad);
        rm[i] = std::fma(grad, 1.0f - 0.9f, rm[i] * 0.9f);
        rv[i] = std::fma(grad * grad, static_cast<float>(1.0 - static_cast<double>(0.999f)), rv[i] * 0.999f);
        const float denom = std::fma(std::sqrt(rv[i]), bc2, 1e-8f);
        if (w_mode) rp[i] = rp[i] * decay;
        rp[i] = std::fma(rm[i] / denom, neg_step, rp[i]);
      }
    }
    EXPECT_TRUE(same_floats(p, rp, "params")) << "adam_w_mode " << w_mode;
    EXPECT_TRUE(same_floats(m, rm, "exp_avg"));
    EXPECT_TRUE(same_floats(v, rv, "exp_avg_sq"));
  }
}

TEST(ScalarLion, MatchesNaiveFormulas) {
  auto ex = make_executor(Isa::kScalar, 1);
  const LionConfig cfg{.lr = 3e-4f, .beta1 = 0.9f, .beta2 = 0.99f, .weight_decay = 0.1f};
  std::vector<float> p = random_floats(kN, 8, 1.0f), m = random_floats(kN, 9, 0.01f);
  m[0] = 0.0f;  // with a zero gradient below, c = 0 and the update is 0
  std::vector<float> rp = p, rm = m;
  Grad g = random_grad(DType::kF32, kN, 500);
  g.f32[0] = 0.0f;
  ASSERT_TRUE(lion_step(cfg, p, m, g.span(), 1.0f, {}, *ex).is_ok());
  const float after = static_cast<float>(1.0 - static_cast<double>(3e-4f) * static_cast<double>(0.1f));
  for (size_t i = 0; i < kN; ++i) {
    const float c = std::fma(g.f32[i], 1.0f - 0.9f, rm[i] * 0.9f);
    const float u = c > 0 ? -3e-4f : c < 0 ? 3e-4f : std::isnan(c) ? c : 0.0f;
    rp[i] = std::fma(rp[i], after, u);
    rm[i] = std::fma(g.f32[i], static_cast<float>(1.0 - static_cast<double>(0.99f)), rm[i] * 0.99f);
  }
  EXPECT_TRUE(same_floats(p, rp, "params"));
  EXPECT_TRUE(same_floats(m, rm, "exp_avg"));
  EXPECT_EQ(p[0], rp[0]);
}

TEST(ScalarAdagrad, MatchesDeepSpeedFormulasWithUndecayedNumerator) {
  auto ex = make_executor(Isa::kScalar, 1);
  const AdagradConfig cfg{.lr = 1e-2f, .eps = 1e-10f, .weight_decay = 0.05f};
  std::vector<float> p = random_floats(kN, 10, 1.0f), v = random_floats(kN, 11, 1e-4f, true);
  std::vector<float> rp = p, rv = v;
  const Grad g = random_grad(DType::kF32, kN, 600);
  ASSERT_TRUE(adagrad_step(cfg, p, v, g.span(), 1.0f, {}, *ex).is_ok());
  for (size_t i = 0; i < kN; ++i) {
    const float d = std::fma(rp[i], 0.05f, g.f32[i]);
    rv[i] = std::fma(d, d, rv[i]);
    rp[i] = std::fma(g.f32[i] / (std::sqrt(rv[i]) + 1e-10f), -1e-2f, rp[i]);
  }
  EXPECT_TRUE(same_floats(p, rp, "params"));
  EXPECT_TRUE(same_floats(v, rv, "exp_avg_sq"));
}

// ---- Properties on the best path ---------------------------------------------------------------

TEST(Adam, GradScaleIsAppliedToTheGradientAsItIsRead) {
  auto ex = make_executor(Isa::kAuto);
  const AdamConfig cfg{.weight_decay = 0.01f};
  std::vector<float> p1 = random_floats(kN, 1, 1.0f), m1(kN, 0.0f), v1(kN, 0.0f);
  std::vector<float> p2 = p1, m2 = m1, v2 = v1;
  std::vector<float> g = random_floats(kN, 2, 1.0f), g_scaled = g;
  for (float& x : g_scaled) x *= 0.25f;  // power of two: exact
  ASSERT_TRUE(adam_step(cfg, 1, p1, m1, v1, {g.data(), DType::kF32}, 0.25f, {}, *ex).is_ok());
  ASSERT_TRUE(adam_step(cfg, 1, p2, m2, v2, {g_scaled.data(), DType::kF32}, 1.0f, {}, *ex).is_ok());
  EXPECT_TRUE(same_floats(p1, p2, "params"));
  EXPECT_TRUE(same_floats(v1, v2, "exp_avg_sq"));
}

TEST(Adam, CopyOutEqualsConvertedParams) {
  auto ex = make_executor(Isa::kAuto);
  for (DType d : {DType::kBF16, DType::kF16}) {
    std::vector<float> p = random_floats(kN, 1, 1.0f), m(kN, 0.0f), v(kN, 0.0f);
    const std::vector<float> g = random_floats(kN, 2, 1.0f);
    std::vector<uint16_t> fused(kN), separate(kN);
    ASSERT_TRUE(adam_step({}, 1, p, m, v, {g.data(), DType::kF32}, 1.0f, {fused.data(), d}, *ex).is_ok());
    ASSERT_TRUE(convert({p.data(), DType::kF32}, {separate.data(), d}, kN, *ex).is_ok());
    EXPECT_TRUE(same_u16(fused, separate, d, "copy_out"));
  }
}

TEST(Adam, ResultDoesNotDependOnThreadsOrBinding) {
  const AdamConfig cfg{.weight_decay = 0.01f};
  std::vector<float> ref_p;
  for (auto [threads, bind] : {std::pair{1, false}, std::pair{2, false}, std::pair{2, true}, std::pair{3, false}}) {
    auto ex = make_executor(Isa::kAuto, threads, bind);
    std::vector<float> p = random_floats(kN, 1, 1.0f), m(kN, 0.0f), v(kN, 0.0f);
    const std::vector<float> g = random_floats(kN, 2, 1.0f);
    ASSERT_TRUE(adam_step(cfg, 1, p, m, v, {g.data(), DType::kF32}, 1.0f, {}, *ex).is_ok());
    if (ref_p.empty()) ref_p = p;
    else EXPECT_TRUE(same_floats(p, ref_p, "params")) << threads << " threads, bind " << bind;
  }
}

TEST(SquaredNorm, DoesNotDependOnThreadCount) {
  std::vector<float> g = random_floats(kN, 3, 1.0f);
  for (float& x : g)
    if (!std::isfinite(x) || std::fabs(x) > 1e18f) x = 1.0f;
  double first = -1;
  for (int threads : {1, 2, 3}) {
    auto ex = make_executor(Isa::kAuto, threads);
    const Result<double> r = squared_norm({g.data(), DType::kF32}, kN, *ex);
    ASSERT_TRUE(r.is_ok());
    if (first < 0) first = *r;
    else EXPECT_EQ(*r, first) << threads << " threads";
  }
}

TEST(SquaredNorm, PropagatesInfAndNan) {
  auto ex = make_executor(Isa::kAuto);
  std::vector<float> g(1000, 1.0f);
  g[517] = std::numeric_limits<float>::infinity();
  EXPECT_TRUE(std::isinf(*squared_norm({g.data(), DType::kF32}, g.size(), *ex)));
  g[3] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_TRUE(std::isnan(*squared_norm({g.data(), DType::kF32}, g.size(), *ex)));
}

TEST(Adam, RejectsBadArgumentsWithoutWriting) {
  auto ex = make_executor(Isa::kAuto);
  std::vector<float> p(10, 1.0f), m(10, 0.0f), v(9, 0.0f), g(10, 1.0f);
  Status st = adam_step({}, 1, p, m, v, {g.data(), DType::kF32}, 1.0f, {}, *ex);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("exp_avg_sq"), std::string::npos) << st.message();
  v.resize(10);
  EXPECT_EQ(adam_step({}, 0, p, m, v, {g.data(), DType::kF32}, 1.0f, {}, *ex).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(adam_step({.beta2 = 1.0f}, 1, p, m, v, {g.data(), DType::kF32}, 1.0f, {}, *ex).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(adam_step({}, 1, p, m, v, {nullptr, DType::kF32}, 1.0f, {}, *ex).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(adam_step({}, 1, p, m, v, {g.data(), DType::kF32}, INFINITY, {}, *ex).code(), StatusCode::kInvalidArgument);
  for (float x : p) EXPECT_EQ(x, 1.0f);
  EXPECT_TRUE(adam_step({}, 1, {}, {}, {}, {nullptr, DType::kF32}, 1.0f, {}, *ex).is_ok());  // n = 0
}

TEST(Executor, ResolvesAutoAndRejectsNegativeThreads) {
  auto ex = make_executor(Isa::kAuto, 0);
  EXPECT_EQ(ex->isa(), best_isa());
  EXPECT_GE(ex->n_threads(), 1);
  EXPECT_EQ(Executor::create({.n_threads = -1}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(parse_isa("avx512").value(), Isa::kAvx512);
  EXPECT_FALSE(parse_isa("sse9").is_ok());
  for (Isa isa : {Isa::kAvx2, Isa::kAvx512}) {
    if (isa_supported(isa)) continue;
    EXPECT_EQ(Executor::create({.isa = isa}).status().code(), StatusCode::kUnavailable);
  }
}

// ---- 8-bit blockwise Adam (the bitsandbytes comparison is tests/cpu_optim/adam8bit_bnb_test.py) ----
// Five steps from the zero state on a multi-tile size with a partial last block, the gradients
// with their specials (NaN, ±inf, denormals): every parameter, code, absmax and copy-out as scalar.
struct Adam8bitRun {
  std::vector<float> p, m_absmax, v_absmax;
  std::vector<uint8_t> m_codes, v_codes;
  Copy copy;
};

Adam8bitRun run_adam8bit(const Executor& ex, const AdamConfig& cfg, DType gdt, CopyCase cc) {
  Adam8bitRun r{random_floats(kN, 31, 1.0f),
                std::vector<float>(quant_block_count(kN), 0.0f),
                std::vector<float>(quant_block_count(kN), 0.0f),
                std::vector<uint8_t>(kN, 0),
                std::vector<uint8_t>(kN, 0),
                Copy(cc.on, cc.dtype, kN)};
  for (int step = 1; step <= 5; ++step) {
    const Grad g = random_grad(gdt, kN, 40 + static_cast<uint32_t>(step));
    const Status s = adam8bit_step(cfg, step, r.p, {r.m_codes, r.m_absmax}, {r.v_codes, r.v_absmax}, g.span(), 0.5f,
                                   r.copy.span(), ex);
    ZO_CHECK(s.is_ok()) << s.to_string();
  }
  return r;
}

TEST_P(SimdPath, Adam8bitMatchesScalarBitForBit) {
  AdamConfig adamw;
  adamw.weight_decay = 0.01f;
  AdamConfig l2 = adamw;
  l2.adam_w_mode = false;
  AdamConfig no_bias = adamw;
  no_bias.bias_correction = false;
  for (const AdamConfig& cfg : {adamw, l2, no_bias}) {
    for (DType gdt : kDTypes) {
      for (CopyCase cc : {CopyCase{false, DType::kBF16}, CopyCase{true, DType::kBF16}, CopyCase{true, DType::kF16}}) {
        SCOPED_TRACE(std::string("adam_w_mode ") + (cfg.adam_w_mode ? "1" : "0") + ", bias correction " +
                     (cfg.bias_correction ? "1" : "0") + ", grad " + std::string(dtype_name(gdt)));
        const Adam8bitRun a = run_adam8bit(*simd_, cfg, gdt, cc), b = run_adam8bit(*scalar_, cfg, gdt, cc);
        EXPECT_TRUE(same_floats(a.p, b.p, "params"));
        EXPECT_TRUE(same_floats(a.m_absmax, b.m_absmax, "exp_avg absmax"));
        EXPECT_TRUE(same_floats(a.v_absmax, b.v_absmax, "exp_avg_sq absmax"));
        EXPECT_EQ(a.m_codes, b.m_codes);
        EXPECT_EQ(a.v_codes, b.v_codes);
        if (cc.on) { EXPECT_TRUE(same_u16(a.copy.u16, b.copy.u16, cc.dtype, "copy-out")); }
      }
    }
  }
}

// Lion's and Adagrad's one 8-bit state (lion8bit_step, adagrad8bit_step), and with bf16 masters:
// every SIMD path gives the scalar path's parameters, codes, absmax and copy-out over 5 steps; a NaN
// gradient and a block of zero gradients are planted.
TEST_P(SimdPath, OneState8bitMatchesScalarBitForBit) {
  struct Run {
    std::vector<float> p, absmax;
    std::vector<uint16_t> bf16_p;
    std::vector<uint8_t> codes;
    Copy copy;
  };
  auto run = [](const Executor& ex, bool lion, bool bf16_master, float wd, DType gdt, CopyCase cc) {
    // Finite parameters and fp32 gradients (but for the NaN planted below): an inf or 3e38 in a block
    // makes its absmax inf and, from the next step on, every element of it NaN, for both optimizers
    // (as in bitsandbytes), which would leave little to compare. The 16-bit gradients keep their raw
    // bit patterns.
    auto finite = [](std::vector<float> v) {
      for (float& x : v)
        if (!std::isfinite(x) || std::fabs(x) > 1e10f) x = 0.25f;
      return v;
    };
    Run r{finite(random_floats(kN, 33, 1.0f)),
          std::vector<float>(quant_block_count(kN), 0.0f),
          {},
          std::vector<uint8_t>(kN, 0),
          Copy(cc.on, cc.dtype, kN)};
    for (float x : r.p) r.bf16_p.push_back(float_to_bf16(x));
    for (int step = 1; step <= 5; ++step) {
      Grad g = random_grad(gdt, kN, 60 + static_cast<uint32_t>(step));
      if (gdt == DType::kF32) g.f32 = finite(g.f32);
      auto set = [&](size_t i, float x) {
        if (gdt == DType::kF32) g.f32[i] = x;
        else g.u16[i] = gdt == DType::kBF16 ? float_to_bf16(x) : float_to_f16(x);
      };
      if (step == 3) set(300, NAN);
      for (size_t i = 512; i < 768; ++i) set(i, 0.0f);
      const BlockwiseState st{r.codes, r.absmax};
      const Bf16Master master{r.bf16_p, sr_key(5, static_cast<uint64_t>(step), 2), 4096};
      Status s;
      if (lion) {
        const LionConfig c{.lr = 1e-3f, .beta1 = 0.9f, .beta2 = 0.99f, .weight_decay = wd};
        s = bf16_master ? lion8bit_step_bf16_master(c, master, st, g.span(), 0.5f, r.copy.span(), ex)
                        : lion8bit_step(c, r.p, st, g.span(), 0.5f, r.copy.span(), ex);
      } else {
        const AdagradConfig c{.lr = 1e-2f, .eps = 1e-8f, .weight_decay = wd};
        s = bf16_master ? adagrad8bit_step_bf16_master(c, master, st, g.span(), 0.5f, r.copy.span(), ex)
                        : adagrad8bit_step(c, r.p, st, g.span(), 0.5f, r.copy.span(), ex);
      }
      ZO_CHECK(s.is_ok()) << s.to_string();
    }
    return r;
  };
  for (bool lion : {true, false})
    for (bool bf16_master : {false, true})
      for (float wd : {0.0f, 0.01f})
        for (DType gdt : kDTypes)
          for (CopyCase cc : {CopyCase{false, DType::kBF16}, CopyCase{true, DType::kBF16}}) {
            SCOPED_TRACE(std::string(lion ? "lion" : "adagrad") + (bf16_master ? ", bf16 masters" : "") + ", wd " +
                         std::to_string(wd) + ", grad " + std::string(dtype_name(gdt)));
            const Run a = run(*simd_, lion, bf16_master, wd, gdt, cc),
                      b = run(*scalar_, lion, bf16_master, wd, gdt, cc);
            EXPECT_TRUE(same_floats(a.p, b.p, "params"));
            EXPECT_TRUE(same_u16(a.bf16_p, b.bf16_p, DType::kBF16, "bf16 masters"));
            EXPECT_TRUE(same_floats(a.absmax, b.absmax, "absmax"));
            EXPECT_EQ(a.codes, b.codes);
            if (gdt == DType::kF32) {  // not a vacuous comparison: the state moved, the weights are numbers
              EXPECT_NE(a.codes, std::vector<uint8_t>(kN, 0)) << "the state moved";
              size_t nan = 0;
              for (float x : a.p) nan += std::isnan(x) ? 1 : 0;
              EXPECT_LT(nan, kN / 100) << "NaN parameters";
            }
            if (cc.on) { EXPECT_TRUE(same_u16(a.copy.u16, b.copy.u16, cc.dtype, "copy-out")); }
          }
}

// The oracle of the nearest-entry rule, independent of the kernels' tables: 0 for NaN; a scan keeping
// the first of equally near entries over the entries within 3 of where x falls (farther ones are
// farther by many ulps); beyond the map's ends the end entries (there, float differences of a huge x
// tie where exact ones do not).
uint8_t nearest_by_scan(const std::array<float, 256>& map, float x) {
  if (std::isnan(x) || x < map[0]) return 0;
  if (x > map[255]) return 255;
  const size_t at = static_cast<size_t>(std::upper_bound(map.begin(), map.end(), x) - map.begin());
  size_t best = at > 3 ? at - 3 : 0;
  for (size_t j = best + 1; j < 256 && j <= at + 3; ++j)
    if (std::fabs(x - map[j]) < std::fabs(x - map[best])) best = j;
  return static_cast<uint8_t>(best);
}

// Where the nearest entry changes, and everywhere else in [-1, 1], the values the 8-bit step
// re-quantizes: 2^20 floats evenly spaced in bit order over [-1, 1], each pair of neighbouring
// entries' float midpoint ±40 ulps, each entry ±8 ulps, and every 65,537th bit pattern (NaN, inf,
// beyond ±1, denormals).
std::vector<float> nearest_code_sweep(const std::array<float, 256>& map) {
  std::vector<float> xs;
  const auto step_ulps = [](float x, int k) {
    for (; k > 0; --k) x = std::nextafter(x, std::numeric_limits<float>::infinity());
    for (; k < 0; ++k) x = std::nextafter(x, -std::numeric_limits<float>::infinity());
    return x;
  };
  const uint32_t one = std::bit_cast<uint32_t>(1.0f);
  for (uint32_t i = 0; i < (1u << 20); ++i) {
    const uint32_t b = static_cast<uint32_t>(uint64_t{i} * one >> 19);  // 0 .. 2·one, in order of |x|
    xs.push_back(std::bit_cast<float>(b >= one ? b - one : (one - b) | 0x80000000u));
  }
  for (size_t c = 0; c + 1 < 256; ++c)
    for (int k = -40; k <= 40; ++k) xs.push_back(step_ulps(map[c] + (map[c + 1] - map[c]) / 2, k));
  for (size_t c = 0; c < 256; ++c)
    for (int k = -8; k <= 8; ++k) xs.push_back(step_ulps(map[c], k));
  for (uint64_t b = 0; b < (uint64_t{1} << 32); b += 65537)
    xs.push_back(std::bit_cast<float>(static_cast<uint32_t>(b)));
  return xs;
}

TEST(Adam8bit, QuantizeNearestMatchesALinearScan) {
  for (const auto* map : {&signed_dynamic_map(), &unsigned_dynamic_map()}) {
    size_t wrong = 0;
    for (float x : nearest_code_sweep(*map)) {
      const uint8_t want = nearest_by_scan(*map, x), got = quantize_nearest(*map, x);
      if (got != want && ++wrong <= 5)
        ADD_FAILURE() << std::hexfloat << x << ": " << int(got) << ", the scan " << int(want);
    }
    EXPECT_EQ(wrong, 0u) << (map == &signed_dynamic_map() ? "signed map" : "unsigned map");
  }
}

// The SIMD paths' nearest codes (the kernels' bucket tables) against the same scan.
TEST_P(SimdPath, NearestCodesMatchALinearScan) {
  const detail::KernelTable* kernels = detail::kernel_table(GetParam());
  ASSERT_NE(kernels, nullptr);
  for (const auto* map : {&signed_dynamic_map(), &unsigned_dynamic_map()}) {
    const detail::QuantTable& table =
        map == &signed_dynamic_map() ? detail::signed_map_quant_table() : detail::unsigned_map_quant_table();
    const std::vector<float> xs = nearest_code_sweep(*map);
    std::vector<uint8_t> codes(xs.size());
    kernels->nearest_codes(table, xs.data(), 1.0f, codes.data(), 0, xs.size());
    size_t wrong = 0;
    for (size_t i = 0; i < xs.size(); ++i) {
      const uint8_t want = nearest_by_scan(*map, xs[i]);
      if (codes[i] != want && ++wrong <= 5)
        ADD_FAILURE() << std::hexfloat << xs[i] << ": " << int(codes[i]) << ", the scan " << int(want);
    }
    EXPECT_EQ(wrong, 0u) << (map == &signed_dynamic_map() ? "signed map" : "unsigned map");
  }
}

// The kernels' quotient of a moment over its block's absmax (on the SIMD paths a multiply by the
// reciprocal in double, Note [Dividing by a constant in double] in detail/kernel_impl.h) and its
// nearest code, against the scalar path, which divides. Divisors of every kind (ordinary, powers of
// two, odd significands, the extremes, subnormal, 0, inf) and, for each, x = d times values just
// around every threshold of both maps (where a quotient one ulp off changes the code), x = ±d, and
// x of every magnitude down to subnormal.
TEST_P(SimdPath, NearestCodesOfQuotientsMatchScalar) {
  const detail::KernelTable* kernels = detail::kernel_table(GetParam());
  ASSERT_NE(kernels, nullptr);
  std::mt19937 rng(61);
  std::vector<float> divisors = {1.0f, 0.75f, 3.0f, 0x1.fffffep-1f, 0x1.000002p+0f, 1e-3f, 7e-12f, 3e30f,
                                 std::numeric_limits<float>::max(), std::numeric_limits<float>::min(),
                                 std::numeric_limits<float>::denorm_min(), 3e-42f, 0.0f,
                                 std::numeric_limits<float>::infinity()};
  std::uniform_real_distribution<float> mant(1.0f, 2.0f);
  std::uniform_int_distribution<int> expo(-140, 120);
  for (int i = 0; i < 18; ++i) divisors.push_back(std::ldexp(mant(rng), expo(rng)));
  const auto around = [](float x, int k) {
    const float toward = k < 0 ? -std::numeric_limits<float>::infinity() : std::numeric_limits<float>::infinity();
    for (int j = 0; j < std::abs(k); ++j) x = std::nextafter(x, toward);
    return x;
  };
  for (const auto* map : {&signed_dynamic_map(), &unsigned_dynamic_map()}) {
    const detail::QuantTable& table =
        map == &signed_dynamic_map() ? detail::signed_map_quant_table() : detail::unsigned_map_quant_table();
    size_t moved = 0;  // codes that differ from the quotient's neighbours': the sweep crosses thresholds
    for (float d : divisors) {
      std::vector<float> xs = {d, -d, 0.0f, -0.0f, std::numeric_limits<float>::quiet_NaN()};
      for (size_t c = 0; c + 1 < 256; ++c) {
        const float mid = (*map)[c] + ((*map)[c + 1] - (*map)[c]) / 2;
        for (int k = -6; k <= 6; ++k) {
          const float x = around(mid, k) * d;  // |x| <= |d|, as a moment over its absmax
          if (std::fabs(x) <= d) xs.push_back(x);
          xs.push_back(around(x, 1));
          xs.push_back(around(x, -1));
        }
      }
      for (int e = 0; e < 160; ++e) xs.push_back(std::ldexp(mant(rng), -e) * (e % 2 != 0 ? -0.5f : 0.5f) * d);
      std::erase_if(xs, [d](float x) { return !(std::fabs(x) <= d) && !std::isnan(x); });
      std::vector<uint8_t> simd(xs.size()), scalar(xs.size());
      kernels->nearest_codes(table, xs.data(), d, simd.data(), 0, xs.size());
      detail::kScalarKernels.nearest_codes(table, xs.data(), d, scalar.data(), 0, xs.size());
      size_t wrong = 0;
      for (size_t i = 0; i < xs.size(); ++i) {
        if (simd[i] != scalar[i] && ++wrong <= 5)
          ADD_FAILURE() << std::hexfloat << xs[i] << " / " << d << ": " << int(simd[i]) << ", scalar " << int(scalar[i]);
        moved += i > 0 && scalar[i] != scalar[i - 1];
        // The scalar path is the nearest entry of the correctly rounded quotient.
        if (i % 7 == 0) {
          ASSERT_EQ(scalar[i], quantize_nearest(*map, xs[i] / d)) << std::hexfloat << xs[i] << " / " << d;
        }
      }
      EXPECT_EQ(wrong, 0u) << std::hexfloat << "divisor " << d;
    }
    EXPECT_GT(moved, 255u * 10) << "the sweep crosses the thresholds";
  }
}

TEST(Adam8bit, ThreadCountDoesNotChangeTheResult) {
  AdamConfig cfg;
  cfg.weight_decay = 0.01f;
  const Adam8bitRun one = run_adam8bit(*make_executor(Isa::kAuto, 1), cfg, DType::kBF16, {true, DType::kBF16});
  const Adam8bitRun three = run_adam8bit(*make_executor(Isa::kAuto, 3), cfg, DType::kBF16, {true, DType::kBF16});
  EXPECT_TRUE(same_floats(one.p, three.p, "params"));
  EXPECT_TRUE(same_floats(one.m_absmax, three.m_absmax, "exp_avg absmax"));
  EXPECT_EQ(one.m_codes, three.m_codes);
  EXPECT_EQ(one.v_codes, three.v_codes);
}

TEST(Adam8bit, QuantizeNearestTakesTheNearestEntryAndTheLowerOnATie) {
  for (const auto* map : {&signed_dynamic_map(), &unsigned_dynamic_map()}) {
    const std::array<float, 256>& m = *map;
    for (size_t i = 0; i < 256; ++i) EXPECT_EQ(quantize_nearest(m, m[i]), i) << "an entry itself, " << i;
    for (size_t i = 0; i + 1 < 256; ++i) {
      const float mid = m[i] + (m[i + 1] - m[i]) / 2;
      const uint8_t q = quantize_nearest(m, mid);
      const float dl = std::fabs(mid - m[i]), dr = std::fabs(mid - m[i + 1]);
      EXPECT_EQ(q, dr < dl ? i + 1 : i) << "between " << i << " and " << i + 1;
    }
    EXPECT_EQ(quantize_nearest(m, std::numeric_limits<float>::quiet_NaN()), 0);
    EXPECT_EQ(quantize_nearest(m, -2.0f), 0);
    EXPECT_EQ(quantize_nearest(m, 2.0f), 255);
  }
}

TEST(Adam8bit, ZeroGradientKeepsTheZeroStateAndTheParameters) {
  auto ex = Executor::create({.n_threads = 2});
  ASSERT_TRUE(ex.is_ok());
  const size_t n = 300;  // a full block and a partial one
  std::vector<float> p(n, 0.5f), g(n, 0.0f), am(quant_block_count(n), 0.0f), av(quant_block_count(n), 0.0f);
  std::vector<uint8_t> cm(n, 0), cv(n, 0);
  AdamConfig c;
  ASSERT_TRUE(adam8bit_step(c, 1, p, {cm, am}, {cv, av}, {g.data(), DType::kF32}, 1.0f, {}, **ex).is_ok());
  for (float x : p) EXPECT_EQ(x, 0.5f);
  for (float x : am) EXPECT_EQ(x, 0.0f);
  for (float x : av) EXPECT_EQ(x, 0.0f);
}

TEST(Adam8bit, RefusesMismatchedStatesBeforeWritingAnything) {
  auto ex = Executor::create({.n_threads = 1});
  ASSERT_TRUE(ex.is_ok());
  const size_t n = 300;
  std::vector<float> p(n, 1.0f), g(n, 1.0f), am(2, 0.0f), av(2, 0.0f), short_absmax(1, 0.0f);
  std::vector<uint8_t> cm(n, 0), cv(n, 0), short_codes(n - 1, 0);
  const AdamConfig c;
  Status s = adam8bit_step(c, 1, p, {cm, short_absmax}, {cv, av}, {g.data(), DType::kF32}, 1.0f, {}, **ex);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("exp_avg has 1 absmax values; 300 elements need 2"), std::string::npos) << s.to_string();
  s = adam8bit_step(c, 1, p, {cm, am}, {short_codes, av}, {g.data(), DType::kF32}, 1.0f, {}, **ex);
  EXPECT_NE(s.message().find("exp_avg_sq has 299 codes but params has 300"), std::string::npos) << s.to_string();
  s = adam8bit_step(c, 0, p, {cm, am}, {cv, av}, {g.data(), DType::kF32}, 1.0f, {}, **ex);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  for (float x : p) EXPECT_EQ(x, 1.0f);
  for (uint8_t x : cm) EXPECT_EQ(x, 0);
}

// ---- bf16 masters with stochastic rounding (Note [Stochastic rounding to bf16]) ------------------

enum class MasterOpt { kAdam, kAdagrad, kLion, kAdam8bit };

struct MasterCase {
  const char* name;
  MasterOpt opt;
  DType moments;  // fp32 or bf16 (8-bit: its own)
  AdamConfig adam;
};

const MasterCase kMasterCases[] = {
    {"AdamW fp32 moments", MasterOpt::kAdam, DType::kF32, {.lr = 1e-3f, .weight_decay = 0.01f, .adam_w_mode = true}},
    {"Adam L2 bf16 moments", MasterOpt::kAdam, DType::kBF16, {.lr = 2e-4f, .weight_decay = 0.1f, .adam_w_mode = false}},
    {"Adagrad fp32", MasterOpt::kAdagrad, DType::kF32, {.lr = 1e-2f, .weight_decay = 0.01f}},
    {"Adagrad bf16", MasterOpt::kAdagrad, DType::kBF16, {.lr = 1e-2f}},
    {"Lion fp32", MasterOpt::kLion, DType::kF32, {.lr = 1e-3f, .beta1 = 0.9f, .beta2 = 0.99f, .weight_decay = 0.1f}},
    {"Lion bf16", MasterOpt::kLion, DType::kBF16, {.lr = 1e-3f, .beta1 = 0.9f, .beta2 = 0.99f}},
    {"AdamW 8-bit", MasterOpt::kAdam8bit, DType::kF32, {.lr = 1e-3f, .weight_decay = 0.01f, .adam_w_mode = true}},
};

struct MasterRun {
  std::vector<uint16_t> p;
  std::vector<float> m32, v32, ma, va;
  std::vector<uint16_t> m16, v16;
  std::vector<uint8_t> mc, vc;
  Copy copy;
};

std::vector<uint16_t> to_bf16(const std::vector<float>& x) {
  std::vector<uint16_t> out;
  for (float v : x) out.push_back(float_to_bf16(v));
  return out;
}

MasterRun fresh_master_run(size_t n, bool copy) {
  MasterRun r{to_bf16(random_floats(n, 61, 1.0f)),
              std::vector<float>(n, 0.0f),
              std::vector<float>(n, 0.0f),
              std::vector<float>(quant_block_count(n), 0.0f),
              std::vector<float>(quant_block_count(n), 0.0f),
              std::vector<uint16_t>(n, 0),
              std::vector<uint16_t>(n, 0),
              std::vector<uint8_t>(n, 0),
              std::vector<uint8_t>(n, 0),
              Copy(copy, DType::kBF16, n)};
  return r;
}

// One step of elements [b, e) of the run, as a parameter's piece starting at element b.
Status master_step(const MasterCase& c, MasterRun& r, int step, uint32_t key, size_t b, size_t e, const Grad& g,
                   const Executor& ex) {
  const size_t n = e - b;
  const Bf16Master p{{r.p.data() + b, n}, key, static_cast<uint32_t>(b)};
  const size_t gb = dtype_size_bytes(g.dtype);
  const ConstElemSpan grad{static_cast<const char*>(g.span().data) + b * gb, g.dtype};
  const ElemSpan copy = r.copy.enabled ? ElemSpan{r.copy.u16.data() + b, DType::kBF16} : ElemSpan{};
  const bool m16 = c.moments == DType::kBF16;
  const ElemSpan m = m16 ? ElemSpan{r.m16.data() + b, DType::kBF16} : ElemSpan{r.m32.data() + b, DType::kF32};
  const ElemSpan v = m16 ? ElemSpan{r.v16.data() + b, DType::kBF16} : ElemSpan{r.v32.data() + b, DType::kF32};
  const AdamConfig& h = c.adam;
  switch (c.opt) {
    case MasterOpt::kAdam: return adam_step_bf16_master(h, step, p, m, v, grad, 0.5f, copy, ex);
    case MasterOpt::kAdagrad:
      return adagrad_step_bf16_master({.lr = h.lr, .eps = h.eps, .weight_decay = h.weight_decay}, p, v, grad, 0.5f,
                                      copy, ex);
    case MasterOpt::kLion:
      return lion_step_bf16_master({.lr = h.lr, .beta1 = h.beta1, .beta2 = h.beta2, .weight_decay = h.weight_decay}, p,
                                   m, grad, 0.5f, copy, ex);
    case MasterOpt::kAdam8bit: {
      ZO_CHECK(b % kQuantBlockElems == 0) << "an 8-bit piece starts on a block";
      const size_t ab = b / kQuantBlockElems, an = quant_block_count(n);
      return adam8bit_step_bf16_master(h, step, p, {{r.mc.data() + b, n}, {r.ma.data() + ab, an}},
                                       {{r.vc.data() + b, n}, {r.va.data() + ab, an}}, grad, 0.5f, copy, ex);
    }
  }
  return Status::ok();
}

uint32_t step_key(int step, uint64_t seed = 7) { return sr_key(seed, static_cast<uint64_t>(step), 3); }

// Gradients without specials: a block of 8-bit moments holding an inf is NaN from then on, which would
// leave nothing of the 8-bit cases to compare.
Grad finite_grad(DType dtype, size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  Grad g{dtype, {}, {}};
  for (size_t i = 0; i < n; ++i) {
    const float x = normal(rng);
    if (dtype == DType::kF32) g.f32.push_back(x);
    else g.u16.push_back(float_to_bf16(x));
  }
  return g;
}

// Three steps over n elements, each as one call or as two pieces split at `split`.
MasterRun run_master(const Executor& ex, const MasterCase& c, DType gdt, bool copy, size_t n = kN, size_t split = 0,
                     uint64_t seed = 7) {
  MasterRun r = fresh_master_run(n, copy);
  for (int step = 1; step <= 3; ++step) {
    const uint32_t gseed = 70 + static_cast<uint32_t>(step);
    const Grad g = c.opt == MasterOpt::kAdam8bit ? finite_grad(gdt, n, gseed) : random_grad(gdt, n, gseed);
    const uint32_t key = step_key(step, seed);
    Status st = split == 0 ? master_step(c, r, step, key, 0, n, g, ex) : master_step(c, r, step, key, 0, split, g, ex);
    if (st.is_ok() && split != 0) st = master_step(c, r, step, key, split, n, g, ex);
    ZO_CHECK(st.is_ok()) << st.to_string();
  }
  return r;
}

::testing::AssertionResult same_master_runs(const MasterRun& a, const MasterRun& b) {
  if (auto r = same_u16(a.p, b.p, DType::kBF16, "params"); !r) return r;
  if (auto r = same_floats(a.m32, b.m32, "exp_avg"); !r) return r;
  if (auto r = same_floats(a.v32, b.v32, "exp_avg_sq"); !r) return r;
  if (auto r = same_u16(a.m16, b.m16, DType::kBF16, "bf16 exp_avg"); !r) return r;
  if (auto r = same_u16(a.v16, b.v16, DType::kBF16, "bf16 exp_avg_sq"); !r) return r;
  if (auto r = same_floats(a.ma, b.ma, "exp_avg absmax"); !r) return r;
  if (auto r = same_floats(a.va, b.va, "exp_avg_sq absmax"); !r) return r;
  if (a.mc != b.mc || a.vc != b.vc) return ::testing::AssertionFailure() << "8-bit codes differ";
  if (a.copy.enabled) {
    if (auto r = same_u16(a.copy.u16, b.copy.u16, DType::kBF16, "copy_out"); !r) return r;
    if (auto r = same_u16(a.copy.u16, a.p, DType::kBF16, "copy_out against the master"); !r) return r;
  }
  return ::testing::AssertionSuccess();
}

TEST_P(SimdPath, Bf16MastersAreBitIdenticalToScalar) {
  for (const MasterCase& c : kMasterCases) {
    for (DType g : {DType::kF32, DType::kBF16}) {
      for (bool copy : {false, true}) {
        SCOPED_TRACE(std::string(c.name) + ", grad " + std::string(dtype_name(g)) + (copy ? ", copy" : ""));
        const MasterRun a = run_master(*simd_, c, g, copy), b = run_master(*scalar_, c, g, copy);
        EXPECT_NE(a.p, fresh_master_run(kN, false).p);
        EXPECT_TRUE(same_master_runs(a, b));
      }
    }
  }
}

// The definition: one step is the fp32-master step on the widened parameters, the moments bit for bit,
// with the new parameters rounded by float_to_bf16_sr with element i's bits sr_random16(key, first + i).
TEST(Bf16Master, OneStepIsTheFp32StepRoundedStochastically) {
  const auto ex = make_executor(Isa::kAuto);
  const AdamConfig cfg{.lr = 1e-3f, .weight_decay = 0.01f, .adam_w_mode = true};
  const size_t first = 123457;  // the piece's offset in its parameter
  std::vector<uint16_t> p16 = to_bf16(random_floats(kN, 61, 1.0f));
  std::vector<float> p32, m(kN, 0.0f), v(kN, 0.0f), m2(kN, 0.0f), v2(kN, 0.0f);
  for (uint16_t h : p16) p32.push_back(bf16_to_float(h));
  const Grad g = random_grad(DType::kF32, kN, 71);
  const uint32_t key = step_key(1);
  ASSERT_TRUE(adam_step(cfg, 1, p32, m, v, g.span(), 0.5f, {}, *ex).is_ok());
  ASSERT_TRUE(adam_step_bf16_master(cfg, 1, {p16, key, first}, {m2.data(), DType::kF32}, {v2.data(), DType::kF32},
                                    g.span(), 0.5f, {}, *ex)
                  .is_ok());
  EXPECT_TRUE(same_floats(m, m2, "exp_avg"));
  EXPECT_TRUE(same_floats(v, v2, "exp_avg_sq"));
  std::vector<uint16_t> want;
  size_t rounded_up = 0, rounded_down = 0;
  for (size_t i = 0; i < kN; ++i) {
    want.push_back(float_to_bf16_sr(p32[i], sr_random16(key, static_cast<uint32_t>(first + i))));
    if (std::isfinite(p32[i]) && bf16_to_float(want[i]) != p32[i]) {
      (std::fabs(bf16_to_float(want[i])) > std::fabs(p32[i]) ? rounded_up : rounded_down)++;
    }
  }
  EXPECT_TRUE(same_u16(want, p16, DType::kBF16, "params"));
  // Both directions happen (round-to-nearest would also give both, but not in these proportions).
  EXPECT_GT(rounded_up, kN / 5);
  EXPECT_GT(rounded_down, kN / 5);
}

// Unbiasedness: an update far below a bf16 ulp (every weight moving up), rounded under 2,000 keys,
// averages to the exact fp32 result. Per element within 6 standard errors of a Bernoulli(f) ulp step; over all elements the
// summed bias in ulps within 6 of its standard deviation. Round-to-nearest, on the same inputs, is
// biased by hundreds of those deviations: the test tells the two apart.
TEST(Bf16Master, StochasticRoundingIsUnbiased) {
  const auto ex = make_executor(Isa::kAuto);
  constexpr size_t n = 4096;
  constexpr int kKeys = 2000;
  const AdamConfig cfg{.lr = 1e-4f, .weight_decay = 0.0f, .adam_w_mode = true};
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<uint16_t> p0(n);
  std::vector<float> grad(n);
  for (size_t i = 0; i < n; ++i) {
    p0[i] = float_to_bf16(0.25f + std::fabs(normal(rng)));  // ulps from 2^-9 to 2^-6
    grad[i] = -std::fabs(normal(rng));                      // every weight moves up: round-to-nearest's bias adds up
  }
  std::vector<float> exact(n), m(n, 0.0f), v(n, 0.0f);
  for (size_t i = 0; i < n; ++i) exact[i] = bf16_to_float(p0[i]);
  ASSERT_TRUE(adam_step(cfg, 1, exact, m, v, {grad.data(), DType::kF32}, 1.0f, {}, *ex).is_ok());
  std::vector<double> sum(n, 0.0);
  std::vector<uint16_t> p(n);
  for (int k = 0; k < kKeys; ++k) {
    p = p0;
    std::fill(m.begin(), m.end(), 0.0f);
    std::fill(v.begin(), v.end(), 0.0f);
    ASSERT_TRUE(adam_step_bf16_master(cfg, 1, {p, sr_key(11, 1, static_cast<uint32_t>(k)), 0}, {m.data(), DType::kF32},
                                      {v.data(), DType::kF32}, {grad.data(), DType::kF32}, 1.0f, {}, *ex)
                    .is_ok());
    for (size_t i = 0; i < n; ++i) {
      const uint32_t down = float_bits(exact[i]) >> 16;
      ASSERT_TRUE(p[i] == down || p[i] == down + 1) << "element " << i << " left its two neighbours";
      sum[i] += bf16_to_float(p[i]);
    }
  }
  double bias_ulps = 0, var_ulps = 0, rne_bias_ulps = 0;
  size_t moved = 0;
  for (size_t i = 0; i < n; ++i) {
    const uint32_t down = float_bits(exact[i]) >> 16;
    const double lo = bf16_to_float(static_cast<uint16_t>(down));
    const double ulp = bf16_to_float(static_cast<uint16_t>(down + 1)) - lo;
    const double f = (exact[i] - lo) / ulp;  // the exact fraction of an ulp
    const double mean = sum[i] / kKeys;
    const double se = std::sqrt(f * (1 - f) / kKeys);
    EXPECT_LE(std::fabs(mean - exact[i]) / ulp, 6 * se + 1e-9) << "element " << i << ", fraction " << f;
    bias_ulps += (mean - exact[i]) / ulp;
    var_ulps += f * (1 - f) / kKeys;
    rne_bias_ulps += (bf16_to_float(float_to_bf16(exact[i])) - exact[i]) / ulp;
    moved += bf16_to_float(p0[i]) != bf16_to_float(float_to_bf16(exact[i]));
  }
  const double sd = std::sqrt(var_ulps);
  EXPECT_LE(std::fabs(bias_ulps), 6 * sd) << "summed bias " << bias_ulps << " ulps, sd " << sd;
  EXPECT_GT(std::fabs(rne_bias_ulps), 100 * sd) << "round-to-nearest: " << rne_bias_ulps << " ulps";
  EXPECT_EQ(moved, 0u) << "round-to-nearest would move no weight: the update is below half an ulp";
}

// Where an element sits in its parameter, not how the call is cut or threaded, decides its bits;
// another seed gives other bits.
TEST(Bf16Master, SplitsThreadsAndSeedsDecideTheBitsAsDocumented) {
  const auto one = make_executor(Isa::kAuto, 1), two = make_executor(Isa::kAuto, 2);
  for (const MasterCase& c : kMasterCases) {
    SCOPED_TRACE(c.name);
    const MasterRun whole = run_master(*two, c, DType::kBF16, true);
    const size_t split = c.opt == MasterOpt::kAdam8bit ? 3 * kQuantBlockElems : 1001;
    EXPECT_TRUE(same_master_runs(whole, run_master(*two, c, DType::kBF16, true, kN, split)));
    EXPECT_TRUE(same_master_runs(whole, run_master(*one, c, DType::kBF16, true)));
    EXPECT_NE(whole.p, run_master(*two, c, DType::kBF16, true, kN, 0, 8).p);
  }
}

TEST(Bf16Master, RefusesABadCopyIndexOrMomentDtypeBeforeWriting) {
  const auto ex = make_executor(Isa::kAuto);
  constexpr size_t n = 100;
  std::vector<uint16_t> p(n, 0x3F80), before = p;
  std::vector<float> m(n, 0.0f), v(n, 0.0f), grad(n, 1.0f), copy32(n, 0.0f);
  std::vector<uint16_t> v16(n, 0);
  const ConstElemSpan g{grad.data(), DType::kF32};
  const AdamConfig cfg;
  const ElemSpan ms{m.data(), DType::kF32}, vs{v.data(), DType::kF32};
  const Status bad_copy = adam_step_bf16_master(cfg, 1, {p, 1, 0}, ms, vs, g, 1.0f, {copy32.data(), DType::kF32}, *ex);
  EXPECT_EQ(bad_copy.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad_copy.message().find("copy-out is bf16"), std::string::npos) << bad_copy.to_string();
  const Status past = adam_step_bf16_master(cfg, 1, {p, 1, 0xFFFFFFFFu - 10}, ms, vs, g, 1.0f, {}, *ex);
  EXPECT_EQ(past.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(past.message().find("32 bits"), std::string::npos) << past.to_string();
  const Status mixed = adam_step_bf16_master(cfg, 1, {p, 1, 0}, ms, {v16.data(), DType::kBF16}, g, 1.0f, {}, *ex);
  EXPECT_EQ(mixed.code(), StatusCode::kInvalidArgument);
  const Status f16 = lion_step_bf16_master({}, {p, 1, 0}, {v16.data(), DType::kF16}, g, 1.0f, {}, *ex);
  EXPECT_EQ(f16.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(p, before);
  EXPECT_EQ(m, std::vector<float>(n, 0.0f));
}

}  // namespace
}  // namespace zo::cpu_optim

// Test inputs and the reference for the device's adam_step (gpu/optim_kernels.h):
// cpu_optim::adam_step on every CPU path this machine runs (ExecutorOptions::isa), compared bit for
// bit (memcmp), never as floats.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "cpu_optim/adam.h"
#include "cpu_optim/dtype.h"
#include "cpu_optim/executor.h"
#include "cpu_optim/isa.h"
#include "gpu/device.h"

namespace zo::gpu::test {

// fp32 master params, moments and (when the case has one) the copy-out bytes after a step.
struct AdamState {
  AdamState() = default;
  AdamState(size_t n, size_t copy_bytes) : p(n), m(n), v(n), copy(copy_bytes) {}
  std::vector<float> p, m, v;
  std::vector<uint8_t> copy;

  size_t nan_count() const {
    size_t n = 0;
    for (const std::vector<float>* x : {&p, &m, &v})
      for (float f : *x) n += std::isnan(f) ? 1 : 0;
    return n;
  }
};

struct AdamCase {
  DType grad_dtype = DType::kF32;
  bool copy = false;
  DType copy_dtype = DType::kBF16;
  AdamConfig config;
  std::string describe() const {
    return std::string("grad ") + std::string(dtype_name(grad_dtype)) + ", copy " +
           (copy ? std::string(dtype_name(copy_dtype)) : std::string("none")) + ", adam_w_mode " +
           (config.adam_w_mode ? "true" : "false") + ", weight_decay " + std::to_string(config.weight_decay);
  }
};

// Every grad dtype × copy-out (none, bf16, fp16, fp32) × adam_w_mode × weight decay 0 / non-zero.
inline std::vector<AdamCase> adam_cases() {
  std::vector<AdamCase> cases;
  for (DType g : {DType::kF32, DType::kBF16, DType::kF16})
    for (int copy = 0; copy < 4; ++copy)
      for (bool w : {true, false})
        for (float wd : {0.0f, 0.05f}) {
          AdamCase c;
          c.grad_dtype = g;
          c.copy = copy > 0;
          c.copy_dtype = copy == 1 ? DType::kBF16 : copy == 2 ? DType::kF16 : DType::kF32;
          c.config = {.lr = 3e-3f,
                      .beta1 = 0.9f,
                      .beta2 = 0.999f,
                      .eps = 1e-8f,
                      .weight_decay = wd,
                      .adam_w_mode = w,
                      .bias_correction = true};
          cases.push_back(c);
        }
  return cases;
}

// A value of magnitude up to `max_abs`: mostly ordinary (1e-4..1e2), with zeros of both signs,
// fp32 denormals, tiny normals and huge values mixed in.
inline float adam_test_value(std::mt19937& rng, float max_abs, bool non_negative) {
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  const uint32_t k = rng() % 100;
  float x;
  if (k < 80) {
    x = std::pow(10.0f, -4.0f + 6.0f * unit(rng)) * (0.5f + unit(rng));
  } else if (k < 84) {
    x = 0.0f;
  } else if (k < 90) {
    x = cpu_optim::bits_float(1 + rng() % 0x007FFFFFu);  // denormal
  } else if (k < 95) {
    x = std::pow(10.0f, -37.0f + 7.0f * unit(rng));  // tiny normal
  } else {
    x = max_abs * (0.01f + 0.99f * unit(rng));  // huge
  }
  if (!non_negative && (rng() & 1)) x = -x;
  return x;
}

// Initial params (up to 1e20), exp_avg (up to 1e10) and exp_avg_sq (≥ 0, up to 1e30).
inline AdamState adam_initial_state(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  AdamState s(n, 0);
  for (size_t i = 0; i < n; ++i) {
    s.p[i] = adam_test_value(rng, 1e20f, false);
    s.m[i] = adam_test_value(rng, 1e10f, false);
    s.v[i] = adam_test_value(rng, 1e30f, true);
  }
  return s;
}

// A gradient buffer of `dtype`; values up to 1e30 (fp32), 3e38 (bf16) or 6e4 (fp16, its range).
struct AdamGrad {
  DType dtype;
  std::vector<float> f32;
  std::vector<uint16_t> u16;
  const void* data() const { return dtype == DType::kF32 ? static_cast<const void*>(f32.data()) : u16.data(); }
  uint64_t size_bytes() const { return dtype == DType::kF32 ? f32.size() * 4 : u16.size() * 2; }
};

inline AdamGrad adam_grad(DType dtype, size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  AdamGrad g{dtype, {}, {}};
  const float max_abs = dtype == DType::kF32 ? 1e30f : dtype == DType::kBF16 ? 3e38f : 6e4f;
  for (size_t i = 0; i < n; ++i) {
    const float x = adam_test_value(rng, max_abs, false);
    if (dtype == DType::kF32) g.f32.push_back(x);
    else g.u16.push_back(dtype == DType::kBF16 ? cpu_optim::float_to_bf16(x) : cpu_optim::float_to_f16(x));
  }
  return g;
}

struct AdamCpuPath {
  std::string name;
  std::unique_ptr<cpu_optim::Executor> executor;
};

// One executor per ISA this CPU runs (scalar always; avx2, avx512 where supported), 2 threads.
inline std::vector<AdamCpuPath> adam_cpu_paths() {
  std::vector<AdamCpuPath> paths;
  for (cpu_optim::Isa isa : cpu_optim::supported_isas()) {
    auto ex = cpu_optim::Executor::create({.n_threads = 2, .isa = isa});
    if (!ex.is_ok()) {
      ADD_FAILURE() << "Executor for " << cpu_optim::isa_name(isa) << ": " << ex.status().to_string();
      continue;
    }
    paths.push_back({std::string(cpu_optim::isa_name(isa)), std::move(ex).value()});
  }
  return paths;
}

// cpu_optim::adam_step on `s` (its copy sized for the case's copy-out).
inline Status cpu_adam_step(const AdamCase& c, int64_t step, float grad_scale, const AdamGrad& g,
                            const cpu_optim::Executor& ex, AdamState& s) {
  cpu_optim::ElemSpan copy{};
  if (c.copy) {
    s.copy.resize(s.p.size() * dtype_size_bytes(c.copy_dtype));
    copy = {s.copy.data(), c.copy_dtype};
  }
  return cpu_optim::adam_step(c.config, step, s.p, s.m, s.v, {g.data(), g.dtype}, grad_scale, copy, ex);
}

// memcmp of every output; on a difference, the first differing element of each buffer.
inline ::testing::AssertionResult same_adam_state(const AdamState& got, const AdamState& want, int step,
                                                  const std::string& path) {
  std::string diff;
  auto check = [&](const char* name, const std::vector<float>& a, const std::vector<float>& b) {
    if (a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * 4) == 0) return;
    for (size_t i = 0; i < std::min(a.size(), b.size()); ++i)
      if (cpu_optim::float_bits(a[i]) != cpu_optim::float_bits(b[i])) {
        char buf[160];
        std::snprintf(buf, sizeof buf, " %s[%zu]: device 0x%08x (%g), cpu 0x%08x (%g);", name, i,
                      cpu_optim::float_bits(a[i]), a[i], cpu_optim::float_bits(b[i]), b[i]);
        diff += buf;
        return;
      }
    diff += std::string(" ") + name + " sizes differ;";
  };
  check("params", got.p, want.p);
  check("exp_avg", got.m, want.m);
  check("exp_avg_sq", got.v, want.v);
  // No memcmp of empty vectors: their data() may be null, which memcmp does not allow.
  if (got.copy.size() != want.copy.size() ||
      (!got.copy.empty() && std::memcmp(got.copy.data(), want.copy.data(), got.copy.size()) != 0))
    diff += " copy_out differs;";
  if (diff.empty()) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "step " << step << " vs cpu_optim " << path << ":" << diff;
}

}  // namespace zo::gpu::test

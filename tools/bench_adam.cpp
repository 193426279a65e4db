// zoffload-bench adam: times one cpu_optim optimizer step over N parameters (fp32 master and
// moments, fp32/bf16/fp16 gradients, optional fused bf16/fp16 copy-out), after checking the chosen
// SIMD path against the scalar path bit for bit; then, in the same run, on the same threads and
// buffers, a STREAM triad (bandwidth baseline) and torch's fused CPU kernel (at::_fused_adamw_, the
// fastest PyTorch path), checked against cpu_optim before it is timed. The three alternate round by
// round. Prints medians, effective bandwidth with its bytes-per-parameter accounting, and the two
// ratios; --json for scripts (tools/bench_adam_deepspeed.py reads it).
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/aligned_buffer.h"
#include "common/bytes.h"
#include "common/status.h"
#include "common/timer.h"
#include "cpu_optim/adagrad.h"
#include "cpu_optim/adam.h"
#include "cpu_optim/dtype.h"
#include "cpu_optim/executor.h"
#include "cpu_optim/isa.h"
#include "cpu_optim/lion.h"
#include "cpu_optim/vector_ops.h"
#include "tools/bench_adam.h"
#include "tools/bench_adam_torch.h"
#include "tools/bench_util.h"
#include "tools/commands.h"
#include "zo_build_config.h"

namespace zo::tools {

namespace {

using cpu_optim::ConstElemSpan;
using cpu_optim::DType;
using cpu_optim::ElemSpan;
using cpu_optim::Executor;
using cpu_optim::Isa;

struct Hyper {
  float lr = 1e-3f, beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f, weight_decay = 0.01f;
};

// The hyperparameters each optimizer runs with. Adagrad runs without weight decay: torch's Adagrad
// adds the decay to the gradient in the numerator as well, cpu_optim's (DeepSpeed's cpu_adagrad)
// does not, so only then do both compute one step.
Hyper hyper_for(const std::string& optimizer) {
  Hyper h;
  if (optimizer == "adagrad") h.weight_decay = 0.0f;
  if (optimizer == "lion") h.beta2 = 0.99f;  // the Lion paper's beta2
  return h;
}

struct Buffers {
  AlignedBuffer p, m, v, grad, copy;
};

// One optimizer step of `optimizer` on the given spans.
Status run_step(const std::string& optimizer, const Hyper& h, int64_t step, std::span<float> p, std::span<float> m,
                std::span<float> v, ConstElemSpan grad, ElemSpan copy, const Executor& ex) {
  if (optimizer == "adamw" || optimizer == "adam") {
    const cpu_optim::AdamConfig cfg{.lr = h.lr,
                                    .beta1 = h.beta1,
                                    .beta2 = h.beta2,
                                    .eps = h.eps,
                                    .weight_decay = h.weight_decay,
                                    .adam_w_mode = optimizer == "adamw"};
    return cpu_optim::adam_step(cfg, step, p, m, v, grad, 1.0f / 1024.0f, copy, ex);
  }
  if (optimizer == "adagrad")
    return cpu_optim::adagrad_step({.lr = h.lr, .eps = h.eps, .weight_decay = h.weight_decay}, p, v, grad,
                                   1.0f / 1024.0f, copy, ex);
  return cpu_optim::lion_step({.lr = h.lr, .beta1 = h.beta1, .beta2 = h.beta2, .weight_decay = h.weight_decay}, p, m,
                              grad, 1.0f / 1024.0f, copy, ex);
}

bool same_or_both_nan(float a, float b) {
  return (std::isnan(a) && std::isnan(b)) || cpu_optim::float_bits(a) == cpu_optim::float_bits(b);
}

// Correctness first: three steps on a slice (with denormals, ±inf, NaN and ±0 planted) with the
// timed path and with the scalar path; every output must match bit for bit (NaN payloads aside).
Status check_against_scalar(const AdamArgs& a, const Hyper& h, DType gdt, bool has_copy, DType cdt, const Executor& ex,
                            size_t n_check, std::string* summary) {
  ZO_ASSIGN_OR_RETURN(auto scalar, Executor::create({.n_threads = ex.n_threads(), .isa = Isa::kScalar}));
  const size_t gs = cpu_optim::dtype_size_bytes(gdt), cs = cpu_optim::dtype_size_bytes(cdt);
  std::vector<float> p[2], m[2], v[2];
  std::vector<unsigned char> g(n_check * gs), c[2];
  random_fill(g.data(), gdt, n_check, 4, -1.0f, 1.0f, ex);
  for (int k = 0; k < 2; ++k) {
    p[k].resize(n_check);
    m[k].assign(n_check, 0.0f);
    v[k].assign(n_check, 0.0f);
    random_fill(p[k].data(), DType::kF32, n_check, 1, -1.0f, 1.0f, ex);
    c[k].assign(has_copy ? n_check * cs : 0, 0);
  }
  const float specials[] = {1e-40f, -3e-39f, INFINITY, -INFINITY, NAN, -0.0f, 0.0f, 3e38f};
  for (size_t i = 0, s = 0; i < n_check; i += 997, ++s) {
    const float x = specials[s % 8];
    cpu_optim::store_from_float(g.data(), gdt, i, x);
    p[0][(i + 13) % n_check] = p[1][(i + 13) % n_check] = specials[(s + 3) % 8];
  }
  for (int k = 0; k < 2; ++k) {
    const Executor& e = k == 0 ? ex : *scalar;
    for (int64_t step = 1; step <= 3; ++step)
      ZO_RETURN_IF_ERROR(run_step(a.optimizer, h, step, p[k], m[k], v[k], {g.data(), gdt},
                                  has_copy ? ElemSpan{c[k].data(), cdt} : ElemSpan{}, e));
  }
  size_t mismatches = 0, first = 0;
  for (size_t i = 0; i < n_check; ++i) {
    const bool ok = same_or_both_nan(p[0][i], p[1][i]) && same_or_both_nan(m[0][i], m[1][i]) &&
                    same_or_both_nan(v[0][i], v[1][i]) &&
                    (!has_copy || same_or_both_nan(cpu_optim::load_as_float(c[0].data(), cdt, i),
                                                   cpu_optim::load_as_float(c[1].data(), cdt, i)));
    if (!ok && mismatches++ == 0) first = i;
  }
  if (mismatches > 0)
    return internal_error(std::to_string(mismatches) + " of " + std::to_string(n_check) +
                          " parameters differ between " + std::string(cpu_optim::isa_name(ex.isa())) +
                          " and scalar, first at " + std::to_string(first));
  *summary = std::string(cpu_optim::isa_name(ex.isa())) + " vs scalar on " + std::to_string(n_check) +
             " params x 3 steps (denormals, inf, NaN planted): bit-identical";
  return Status::ok();
}

#if ZO_HAVE_TORCH
// relative L2 error ||a - b|| / ||b|| in double.
double rel_l2(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double d = static_cast<double>(a[i]) - b[i];
    num += d * d;
    den += static_cast<double>(b[i]) * b[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

struct TorchCheck {
  size_t n = 0;
  int steps = 3;
  double tolerance = 1e-6;
  double err_params = 0, err_exp_avg = 0, err_exp_avg_sq = 0;
  bool passed = false;
  std::string text;
};

// The baseline must compute what cpu_optim computes: `steps` steps of torch's fused kernel and of
// cpu_optim (on the timed path) from the same parameters and gradients (the grads as the timed run
// hands them to each: grad dtype ×1024 unscaled in the pass for cpu_optim, the same values in fp32
// for torch), then the relative L2 error of each state vs cpu_optim's. Fails above `tolerance`.
Result<TorchCheck> check_torch_fused(const AdamArgs& a, const Hyper& h, DType gdt, const Executor& ex, size_t n_check) {
  TorchCheck c;
  c.n = n_check;
  const bool uses_m = a.optimizer != "adagrad";
  std::vector<float> p0(n_check), p[2], m[2], v[2], g32(n_check);
  std::vector<unsigned char> g(n_check * cpu_optim::dtype_size_bytes(gdt));
  random_fill(p0.data(), DType::kF32, n_check, 11, -1.0f, 1.0f, ex);
  random_fill(g.data(), gdt, n_check, 12, -1024.0f, 1024.0f, ex);
  ZO_RETURN_IF_ERROR(cpu_optim::convert({g.data(), gdt}, {g32.data(), DType::kF32}, n_check, ex));
  for (float& x : g32) x *= 1.0f / 1024.0f;  // exact: a power of two
  for (int k = 0; k < 2; ++k) {
    p[k] = p0;
    m[k].assign(uses_m ? n_check : 0, 0.0f);
    v[k].assign(n_check, 0.0f);
  }
  for (int64_t step = 1; step <= c.steps; ++step)
    ZO_RETURN_IF_ERROR(run_step(a.optimizer, h, step, p[0], m[0], v[0], {g.data(), gdt}, ElemSpan{}, ex));
  const detail::TorchHyper th{h.lr, h.beta1, h.beta2, h.eps, h.weight_decay};
  ZO_ASSIGN_OR_RETURN(
      auto torch_step,
      detail::make_torch_fused_step(
          a.optimizer, th, {p[1].data(), g32.data(), uses_m ? m[1].data() : nullptr, v[1].data(), n_check, nullptr, 0},
          ex.n_threads()));
  for (int step = 1; step <= c.steps; ++step) ZO_RETURN_IF_ERROR(torch_step());
  c.err_params = rel_l2(p[1], p[0]);
  c.err_exp_avg = uses_m ? rel_l2(m[1], m[0]) : 0.0;
  c.err_exp_avg_sq = rel_l2(v[1], v[0]);
  c.passed = c.err_params <= c.tolerance && c.err_exp_avg <= c.tolerance && c.err_exp_avg_sq <= c.tolerance;
  auto sci = [](double x) {
    char buf[16];
    std::snprintf(buf, sizeof buf, "%.1e", x);
    return std::string(buf);
  };
  c.text = std::string(detail::torch_fused_kernel(a.optimizer)) + " vs " + std::string(cpu_optim::isa_name(ex.isa())) +
           " after " + std::to_string(c.steps) + " steps on " + std::to_string(n_check) +
           " params: relative L2 error params " + sci(c.err_params) +
           (uses_m ? ", exp_avg " + sci(c.err_exp_avg) + ", exp_avg_sq " + sci(c.err_exp_avg_sq)
                   : ", state_sum " + sci(c.err_exp_avg_sq)) +
           " (limit " + sci(c.tolerance) + ")";
  return c;
}
#endif

}  // namespace

Result<AdamCommon> parse_adam_common(const AdamArgs& a) {
  AdamCommon c;
  const Result<uint64_t> n = parse_count(a.params);
  if (!n.is_ok() || *n == 0)
    return invalid_argument("--params: expected a positive count like 2e8, got '" + a.params + "'");
  c.n = *n;
  const Result<DType> gdt = cpu_optim::parse_dtype(a.grad_dtype);
  if (!gdt.is_ok()) return invalid_argument("--grad-dtype: " + gdt.status().message());
  c.grad = *gdt;
  c.has_copy = a.copy_out != "none";
  if (c.has_copy) {
    const Result<DType> copy = cpu_optim::parse_dtype(a.copy_out);
    if (!copy.is_ok() || *copy == DType::kF32)
      return invalid_argument("--copy-out: expected bf16, fp16 or none, got '" + a.copy_out + "'");
    c.copy = *copy;
  }
  const Result<Isa> isa = cpu_optim::parse_isa(a.isa);
  if (!isa.is_ok()) return invalid_argument("--isa: " + isa.status().message());
  c.isa = *isa;
  if (a.threads < 0) return invalid_argument("--threads must be ≥ 0");
  if (a.repeats < 1) return invalid_argument("--repeats must be ≥ 1");
  return c;
}

namespace {

int run_adam_bench(const AdamArgs& a) {
  const BenchError usage{"adam", 2}, failure{"adam", 1};
  if (a.masters != "fp32" && a.masters != "bf16")
    return usage("--masters: expected fp32 or bf16, got '" + a.masters + "'");
  if (a.moments != "fp32" && a.moments != "bf16" && a.moments != "8bit")
    return usage("--moments: expected fp32, bf16 or 8bit, got '" + a.moments + "'");
  if (a.moments != "fp32" || a.masters == "bf16") return run_adam_narrow_moments_bench(a);
  const Result<AdamCommon> common = parse_adam_common(a);
  if (!common.is_ok()) return usage(common.status().message());
  if (a.optimizer != "adamw" && a.optimizer != "adam" && a.optimizer != "adagrad" && a.optimizer != "lion")
    return usage("--optimizer: expected adamw, adam, adagrad or lion, got '" + a.optimizer + "'");
  const size_t n = common->n;
  const DType gdt = common->grad;
  const bool has_copy = common->has_copy;
  const DType cdt = common->copy;

  auto ex_r = Executor::create({.n_threads = a.threads, .bind_cores = a.bind_cores, .isa = common->isa});
  if (!ex_r.is_ok()) return failure(ex_r.status().to_string());
  const Executor& ex = **ex_r;
  const Hyper h = hyper_for(a.optimizer);
  const bool uses_m = a.optimizer != "adagrad",
             uses_v = a.optimizer == "adamw" || a.optimizer == "adam" || a.optimizer == "adagrad";
  const size_t gs = cpu_optim::dtype_size_bytes(gdt), cs = has_copy ? cpu_optim::dtype_size_bytes(cdt) : 0;
  const size_t n_states = 1 + uses_m + uses_v;  // fp32 params + moments
  const size_t read_bytes = 4 * n_states + gs, write_bytes = 4 * n_states + cs;
  const std::string opt_label = a.optimizer;
  if (!a.json) {
    std::printf("zoffload-bench adam: %s, %zu params, grad %s, copy-out %s, %s\n", opt_label.c_str(), n,
                a.grad_dtype.c_str(), has_copy ? a.copy_out.c_str() : "none", ex.describe().c_str());
    std::printf("hyper     lr %g, betas (%g, %g), eps %g, weight_decay %g%s\n", h.lr, h.beta1, h.beta2, h.eps,
                h.weight_decay,
                a.optimizer == "adagrad" ? " (Adagrad: torch's decays the numerator too, cpu_optim's does not)" : "");
  }

  // 1. Correctness: the timed path against scalar, and the torch baseline against cpu_optim.
  std::string check_summary;
  const Status check =
      check_against_scalar(a, h, gdt, has_copy, cdt, ex, std::min<size_t>(n, size_t{1} << 20), &check_summary);
  if (!check.is_ok()) return failure("check failed: " + check.to_string());
  if (!a.json) std::printf("check     %s\n", check_summary.c_str());

  // The torch baseline: what it is, and why it is absent when it is.
  std::string torch_kernel = "(none)", torch_skip;
  bool torch_failed = false;  // the check ran and failed, or torch threw: no ratio, exit 1
#if ZO_HAVE_TORCH
  TorchCheck torch_check;
  if (detail::torch_fused_kernel(a.optimizer) != nullptr) torch_kernel = detail::torch_fused_kernel(a.optimizer);
  if (a.no_torch) {
    torch_skip = "--no-torch";
  } else if (torch_kernel == "(none)") {
    torch_skip = "torch has no " + a.optimizer + " optimizer";
  } else {
    // 65 536 + 1 000 elements: whole vectors and a ragged tail on every path.
    Result<TorchCheck> tc = check_torch_fused(a, h, gdt, ex, std::min<size_t>(n, 66536));
    if (!tc.is_ok()) {
      torch_skip = tc.status().to_string();
      torch_failed = true;
    } else {
      torch_check = *tc;
      if (!a.json) std::printf("check     %s: %s\n", torch_check.text.c_str(), torch_check.passed ? "ok" : "FAILED");
      if (!torch_check.passed) {
        torch_skip = "its check against cpu_optim failed: " + torch_check.text;
        torch_failed = true;
      }
    }
  }
#else
  torch_skip = "zoffload was built without LibTorch (not found at configure time, or -Dtorch=disabled)";
#endif
  [[maybe_unused]] const bool torch_on = torch_skip.empty();  // read only with LibTorch

  // 2. Buffers, first touched by the executor's threads (fill) in the partition the step uses.
  Buffers b;
  auto alloc = [&](AlignedBuffer* buf, size_t bytes) -> Status {
    ZO_ASSIGN_OR_RETURN(*buf, AlignedBuffer::allocate(bytes));
    return Status::ok();
  };
  Status st = alloc(&b.p, n * 4);
  if (st.is_ok() && uses_m) st = alloc(&b.m, n * 4);
  if (st.is_ok() && uses_v) st = alloc(&b.v, n * 4);
  if (st.is_ok()) st = alloc(&b.grad, n * gs);
  if (st.is_ok() && has_copy) st = alloc(&b.copy, n * cs);
  if (!st.is_ok()) return failure(st.to_string() + " (try a smaller --params)");
  auto p = b.p.as<float>();
  // Lion has no second moment and Adagrad no first: the unused span is empty and never touched.
  auto m = uses_m ? b.m.as<float>() : std::span<float>();
  auto v = uses_v ? b.v.as<float>() : std::span<float>();
  random_fill(p.data(), DType::kF32, n, 1, -1.0f, 1.0f, ex);
  if (uses_m) cpu_optim::fill(m, 0.0f, ex);
  if (uses_v) cpu_optim::fill(v, 0.0f, ex);
  // Gradients as a loss-scaled run would hand them over (×1024), unscaled inside the step.
  random_fill(b.grad.data(), gdt, n, 2, -1024.0f, 1024.0f, ex);
  const ConstElemSpan grad{b.grad.data(), gdt};
  const ElemSpan copy = has_copy ? ElemSpan{b.copy.data(), cdt} : ElemSpan{};
  auto opt_step = [&](int64_t step) { return run_step(a.optimizer, h, step, p, m, v, grad, copy, ex); };
  // STREAM triad a = b + 3c over three n-float buffers: the params and moment buffers (a fresh one
  // when the optimizer keeps a single moment), same threads, partition and SIMD path. The triad
  // overwrites params and moments with other ordinary floats, which changes no timing.
  AlignedBuffer extra;
  std::span<float> ta = p, tb = uses_m ? m : v, tc;
  if (uses_m && uses_v) {
    tc = v;
  } else {
    if (Status s = alloc(&extra, n * 4); !s.is_ok()) return failure(s.to_string());
    tc = extra.as<float>();
    cpu_optim::fill(tc, 2.0f, ex);
  }
  // torch steps the same params, moments and copy buffer in place. Its gradients are fp32 (torch's
  // kernels take the params' dtype), unscaled once outside the timing (the baseline is the plain
  // fused step, no grad_scale): exactly the values cpu_optim sees after its in-pass unscaling.
  std::function<Status()> torch_step;
  AlignedBuffer g32;
#if ZO_HAVE_TORCH
  const detail::TorchHyper th{h.lr, h.beta1, h.beta2, h.eps, h.weight_decay};
  auto torch_buffers = [&]() -> detail::TorchBuffers {
    return {p.data(),
            g32.as<float>().data(),
            uses_m ? m.data() : nullptr,
            v.data(),
            n,
            has_copy ? b.copy.data() : nullptr,
            has_copy ? (cdt == DType::kBF16 ? 1 : 2) : 0};
  };
  if (torch_on) {
    if (Status s = alloc(&g32, n * 4); !s.is_ok())
      return failure(s.to_string() + " (try a smaller --params or --no-torch)");
    (void)cpu_optim::convert(grad, {g32.data(), DType::kF32}, n, ex);
    float* g32p = g32.as<float>().data();
    ex.for_each_tile(n, [&](size_t lo, size_t hi) {
      for (size_t i = lo; i < hi; ++i) g32p[i] *= 1.0f / 1024.0f;
    });
    Result<std::function<Status()>> ts =
        detail::make_torch_fused_step(a.optimizer, th, torch_buffers(), ex.n_threads());
    if (!ts.is_ok()) return failure(ts.status().to_string());
    torch_step = *ts;
  }
#endif

  // 3. Warm-ups, then --repeats rounds of: one timed cpu_optim step, one timed triad, one timed torch
  // step. Alternating puts all three under the same load on a shared machine.
  if (Status s = opt_step(1); !s.is_ok()) return failure(s.to_string());
  if (Status s = cpu_optim::stream_triad(ta, tb, tc, 3.0f, ex); !s.is_ok()) return failure(s.to_string());
  if (torch_step)
    if (Status s = torch_step(); !s.is_ok()) return failure(s.to_string());
  std::vector<double> opt_s, triad_s, torch_s;
  for (int r = 0; r < a.repeats; ++r) {
    Stopwatch sw;
    if (Status s = opt_step(2 + r); !s.is_ok()) return failure(s.to_string());
    opt_s.push_back(sw.elapsed_s());
    sw.reset();
    (void)cpu_optim::stream_triad(ta, tb, tc, 3.0f, ex);
    triad_s.push_back(sw.elapsed_s());
    if (torch_step) {
      sw.reset();
      if (Status s = torch_step(); !s.is_ok()) return failure(s.to_string());
      torch_s.push_back(sw.elapsed_s());
    }
  }
  const double opt_med = median(opt_s);
  const double params_per_s = static_cast<double>(n) / opt_med;
  const double eff_gbps = static_cast<double>(n) * static_cast<double>(read_bytes + write_bytes) / opt_med / 1e9;
  const double triad_med = median(triad_s);
  const double triad_gbps = static_cast<double>(n) * 12.0 / triad_med / 1e9;
  extra = AlignedBuffer();

  // 4. Optionally torch::optim's per-tensor loop, after the rounds (it keeps moments of its own).
  std::string loop_name = a.optimizer == "adamw"     ? "torch::optim::AdamW"
                          : a.optimizer == "adam"    ? "torch::optim::Adam"
                          : a.optimizer == "adagrad" ? "torch::optim::Adagrad"
                                                     : "(none)";
  std::vector<double> loop_s;
  std::string loop_skip;
#if ZO_HAVE_TORCH
  if (a.torch_loop && torch_on) {
    torch_step = nullptr;
    b.m = AlignedBuffer();
    b.v = AlignedBuffer();
    random_fill(p.data(), DType::kF32, n, 1, -1.0f, 1.0f, ex);
    Result<std::vector<double>> ls =
        detail::time_torch_loop(a.optimizer, th, torch_buffers(), ex.n_threads(), a.repeats);
    if (ls.is_ok()) loop_s = *ls;
    else loop_skip = ls.status().to_string();
  } else if (a.torch_loop) {
    loop_skip = torch_skip;
  }
#else
  if (a.torch_loop) loop_skip = torch_skip;
#endif
  const bool have_torch = !torch_s.empty(), have_loop = !loop_s.empty();
  const double torch_med = have_torch ? median(torch_s) : 0.0;
  const double torch_pps = have_torch ? static_cast<double>(n) / torch_med : 0.0;
  const double loop_med = have_loop ? median(loop_s) : 0.0;
  const double loop_pps = have_loop ? static_cast<double>(n) / loop_med : 0.0;
  const double ratio_triad = eff_gbps / triad_gbps;
  const double ratio_torch = have_torch ? params_per_s / torch_pps : 0.0;
  const std::string copy_text = has_copy ? " + copy_ to " + a.copy_out : "";

  auto bytes_text = [&] {
    std::string r = "params";
    if (uses_m) r += ", exp_avg";
    if (uses_v) r += ", exp_avg_sq";
    return r;
  }();
  if (a.json) {
    nlohmann::json j = adam_run_json(a, n, has_copy, ex, h, check_summary);
    j["bytes_per_param"] = {{"read", read_bytes},
                            {"write", write_bytes},
                            {"total", read_bytes + write_bytes},
                            {"streams", bytes_text + " fp32 read+write; grad " + a.grad_dtype + " read" +
                                            (has_copy ? "; copy " + a.copy_out + " written" : "")}};
    j["step_s"] = {{"median", opt_med}, {"all", opt_s}};
    j["params_per_s"] = params_per_s;
    j["effective_gbps"] = eff_gbps;
    j["triad"] = {{"bytes_per_elem", 12},
                  {"median_s", triad_med},
                  {"all_s", triad_s},
                  {"gbps", triad_gbps},
                  {"gbps_with_write_allocate", triad_gbps * 16.0 / 12.0}};
    j["ratio_to_triad"] = ratio_triad;
    j["torch"] = {{"kernel", torch_kernel}, {"available", have_torch}, {"copy_out", has_copy ? a.copy_out : "none"}};
#if ZO_HAVE_TORCH
    if (torch_check.n > 0)
      j["torch"]["check"] = {{"params", torch_check.n},
                             {"steps", torch_check.steps},
                             {"rel_l2_params", torch_check.err_params},
                             {"rel_l2_exp_avg", uses_m ? nlohmann::json(torch_check.err_exp_avg) : nlohmann::json()},
                             {"rel_l2_exp_avg_sq", torch_check.err_exp_avg_sq},
                             {"tolerance", torch_check.tolerance},
                             {"passed", torch_check.passed}};
#endif
    if (have_torch) {
      j["torch"]["median_s"] = torch_med;
      j["torch"]["all_s"] = torch_s;
      j["torch"]["params_per_s"] = torch_pps;
      j["ratio_to_torch"] = ratio_torch;
    } else {
      j["torch"]["skipped"] = torch_skip;
      j["ratio_to_torch"] = nullptr;
    }
    if (a.torch_loop) {
      j["torch_loop"] = {{"optimizer", loop_name}, {"available", have_loop}};
      if (have_loop) {
        j["torch_loop"]["median_s"] = loop_med;
        j["torch_loop"]["all_s"] = loop_s;
        j["torch_loop"]["params_per_s"] = loop_pps;
      } else {
        j["torch_loop"]["skipped"] = loop_skip;
      }
    }
    j["targets"] = {{"ratio_to_triad", 0.85}, {"ratio_to_torch", 1.0}};
    std::printf("%s\n", j.dump(2).c_str());
  } else {
    std::printf(
        "bytes     %zu B/param = read %zu (%s fp32, grad %s) + write %zu (%s fp32%s); "
        "triad counts 12 B/elem (read b, c; write a; write-allocate not counted, as STREAM)\n",
        read_bytes + write_bytes, read_bytes, bytes_text.c_str(), a.grad_dtype.c_str(), write_bytes, bytes_text.c_str(),
        has_copy ? (", copy " + a.copy_out).c_str() : "");
    std::printf("%-9s median %.4f s/step of %d (min %.4f, max %.4f): %.1f M params/s, %.2f GB/s effective\n",
                opt_label.c_str(), opt_med, a.repeats, *std::min_element(opt_s.begin(), opt_s.end()),
                *std::max_element(opt_s.begin(), opt_s.end()), params_per_s / 1e6, eff_gbps);
    std::printf("triad     median %.4f s of %d: %.2f GB/s (%.2f GB/s counting the write-allocate read of a)\n",
                triad_med, a.repeats, triad_gbps, triad_gbps * 16.0 / 12.0);
    if (have_torch)
      std::printf("torch     %s%s: median %.4f s/step of %d (min %.4f, max %.4f): %.1f M params/s\n",
                  torch_kernel.c_str(), copy_text.c_str(), torch_med, a.repeats,
                  *std::min_element(torch_s.begin(), torch_s.end()), *std::max_element(torch_s.begin(), torch_s.end()),
                  torch_pps / 1e6);
    else std::printf("torch     baseline %s: %s\n", torch_failed ? "refused" : "skipped", torch_skip.c_str());
    if (have_loop)
      std::printf("torch     %s per-tensor loop%s, after the rounds: median %.4f s/step of %d: %.1f M params/s\n",
                  loop_name.c_str(), copy_text.c_str(), loop_med, a.repeats, loop_pps / 1e6);
    else if (a.torch_loop) std::printf("torch     per-tensor loop skipped: %s\n", loop_skip.c_str());
    std::printf("ratio     effective/triad %.2f (target >= 0.85)", ratio_triad);
    if (have_torch) std::printf(", vs torch's fused kernel %.2fx params/s (target >= 1)", ratio_torch);
    std::printf("\n");
  }
  if (torch_failed) {
    std::fprintf(stderr, "zoffload-bench adam: torch baseline refused: %s\n", torch_skip.c_str());
    return 1;
  }
  return 0;
}

}  // namespace

void register_bench_adam(CLI::App& app, int* exit_code) {
  auto args = std::make_shared<AdamArgs>();
  CLI::App* cmd = app.add_subcommand(
      "adam",
      "CPU optimizer step (cpu_optim): params/s and effective GB/s, checked against the scalar path, "
      "with a same-run STREAM triad and torch's fused kernel (at::_fused_adamw_) and their ratios");
  cmd->add_option("--params", args->params, "number of parameters, e.g. 2e8")->capture_default_str();
  cmd->add_option("--optimizer", args->optimizer, "adamw|adam|adagrad|lion (adam = L2 decay, adam_w_mode off)")
      ->capture_default_str();
  cmd->add_option("--moments", args->moments,
                  "fp32|bf16|8bit: Adam's moments (zoffload.moment_dtype); bf16 and 8bit time adam_step_bf16_moments "
                  "or adam8bit_step beside the fp32 kernel and the triad (no torch baseline; for 8bit "
                  "tools/bench_adam_bnb.py runs bitsandbytes' beside it)")
      ->capture_default_str();
  cmd->add_option("--masters", args->masters,
                  "fp32|bf16: the master weights (zoffload.master_dtype); bf16 times adam_step_bf16_master (or "
                  "adam8bit_step_bf16_master with --moments 8bit), stochastic rounding, beside the fp32 kernel and "
                  "the triad; the copy-out is then bf16 or none")
      ->capture_default_str();
  cmd->add_option("--grad-dtype", args->grad_dtype, "fp32|bf16|fp16")->capture_default_str();
  cmd->add_option("--copy-out", args->copy_out, "bf16|fp16|none: fused 16-bit copy of the new params")
      ->capture_default_str();
  cmd->add_option("--threads", args->threads, "threads (0 = all hardware threads)")->capture_default_str();
  cmd->add_option("--isa", args->isa, "auto|avx512|avx2|scalar: force a SIMD path")->capture_default_str();
  cmd->add_option("--repeats", args->repeats, "timed repetitions of each measurement; medians are reported")
      ->capture_default_str();
  cmd->add_flag("--bind-cores", args->bind_cores, "pin the threads to cores (hwloc)");
  cmd->add_flag("--no-torch", args->no_torch, "skip the torch baselines");
  cmd->add_flag("--torch-loop", args->torch_loop,
                "also time torch::optim's per-tensor loop (torch::optim::AdamW etc.), after the rounds; "
                "the ratio stays against the fused kernel");
  cmd->add_flag("--json", args->json, "print machine-readable results on stdout");
  cmd->callback([args, exit_code] { *exit_code = run_adam_bench(*args); });
}

}  // namespace zo::tools

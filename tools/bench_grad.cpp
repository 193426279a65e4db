// zoffload-bench grad: the gradient accumulator's two kernels, cpu_optim::accumulate (acc += grad,
// rounded to the accumulator's dtype) and cpu_optim::squared_norm (Σ acc² in double, fixed order),
// checked bit for bit against the scalar path, then timed against a memory roofline measured in the
// same run on the same threads: a pass with each kernel's own stream mix and one add per element
// (cpu_optim::roofline_pass, on the best SIMD path). The kernels and their rooflines alternate round
// by round. Prints medians, GB/s with the bytes counted, and the ratios; --json for scripts.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/aligned_buffer.h"
#include "common/bytes.h"
#include "common/status.h"
#include "common/timer.h"
#include "cpu_optim/dtype.h"
#include "cpu_optim/executor.h"
#include "cpu_optim/isa.h"
#include "cpu_optim/vector_ops.h"
#include "tools/bench_util.h"
#include "tools/commands.h"

namespace zo::tools {

namespace {

using cpu_optim::DType;
using cpu_optim::Executor;
using cpu_optim::Isa;

struct GradArgs {
  std::string elems = "2e8";
  std::string acc_dtype = "fp32";
  std::string grad_dtype = "bf16";
  std::string isa = "auto";
  int threads = 0;
  int repeats = 5;
  bool bind_cores = false;
  bool json = false;
};

constexpr double kTarget = 0.85;  // the ratio to the roofline at which a kernel counts as running at memory speed

// The timed path against the scalar path on the first `n` elements: the same accumulator bits
// (NaN patterns compared as NaN) and the same norm.
Status check_against_scalar(DType acc_dtype, DType grad_dtype, const Executor& ex, size_t n, std::string* summary) {
  ZO_ASSIGN_OR_RETURN(auto scalar, Executor::create({.n_threads = 1, .isa = Isa::kScalar}));
  const size_t ab = cpu_optim::dtype_size_bytes(acc_dtype), gb = cpu_optim::dtype_size_bytes(grad_dtype);
  ZO_ASSIGN_OR_RETURN(AlignedBuffer grad, AlignedBuffer::allocate(n * gb));
  ZO_ASSIGN_OR_RETURN(AlignedBuffer a, AlignedBuffer::allocate(n * ab));
  ZO_ASSIGN_OR_RETURN(AlignedBuffer b, AlignedBuffer::allocate(n * ab));
  random_fill(grad.data(), grad_dtype, n, 7, -4.0f, 4.0f, ex);
  random_fill(a.data(), acc_dtype, n, 8, -4.0f, 4.0f, ex);
  std::memcpy(b.data(), a.data(), n * ab);
  for (bool from_zero : {true, false}) {
    ZO_RETURN_IF_ERROR(cpu_optim::accumulate({a.data(), acc_dtype}, {grad.data(), grad_dtype}, n, from_zero, ex));
    ZO_RETURN_IF_ERROR(cpu_optim::accumulate({b.data(), acc_dtype}, {grad.data(), grad_dtype}, n, from_zero, *scalar));
    if (std::memcmp(a.data(), b.data(), n * ab) != 0)
      return internal_error(std::string("accumulate on ") + std::string(isa_name(ex.isa())) +
                            " differs from the scalar path" + (from_zero ? " (from zero)" : ""));
  }
  ZO_ASSIGN_OR_RETURN(double na, cpu_optim::squared_norm({a.data(), acc_dtype}, n, ex));
  ZO_ASSIGN_OR_RETURN(double nb, cpu_optim::squared_norm({b.data(), acc_dtype}, n, *scalar));
  if (!(na == nb))
    return internal_error("squared_norm on " + std::string(isa_name(ex.isa())) + " differs from the scalar path");
  *summary = std::string(isa_name(ex.isa())) + " = scalar bit for bit over " + std::to_string(n) +
             " elements (accumulate from zero and onto values; squared norm)";
  return Status::ok();
}

int run_grad_bench(const GradArgs& a) {
  const BenchError usage{"grad", 2}, failure{"grad", 1};
  const Result<uint64_t> n_r = parse_count(a.elems);
  if (!n_r.is_ok() || *n_r == 0) return usage("--elems: expected a positive count such as 2e8, got '" + a.elems + "'");
  const size_t n = *n_r;
  const Result<DType> acc_dtype = cpu_optim::parse_dtype(a.acc_dtype),
                      grad_dtype = cpu_optim::parse_dtype(a.grad_dtype);
  if (!acc_dtype.is_ok()) return usage("--acc-dtype: expected fp32, bf16 or fp16, got '" + a.acc_dtype + "'");
  if (!grad_dtype.is_ok()) return usage("--grad-dtype: expected fp32, bf16 or fp16, got '" + a.grad_dtype + "'");
  const Result<Isa> isa = cpu_optim::parse_isa(a.isa);
  if (!isa.is_ok()) return usage("--isa: " + isa.status().message());
  if (a.threads < 0) return usage("--threads must be ≥ 0");
  if (a.repeats < 1) return usage("--repeats must be ≥ 1");
  const size_t ab = cpu_optim::dtype_size_bytes(*acc_dtype), gb = cpu_optim::dtype_size_bytes(*grad_dtype);
  // The roofline's written stream is fp32: it carries the accumulate mix only for fp32 accumulators.
  const bool acc_roofline = *acc_dtype == DType::kF32;

  auto ex_r = Executor::create({.n_threads = a.threads, .bind_cores = a.bind_cores, .isa = *isa});
  if (!ex_r.is_ok()) return failure(ex_r.status().to_string());
  const Executor& ex = **ex_r;
  // The roofline is what this machine's memory gives the mix: the best SIMD path, the same threads.
  std::unique_ptr<Executor> best_ex;
  if (ex.isa() != cpu_optim::best_isa()) {
    auto r = Executor::create({.n_threads = a.threads, .bind_cores = a.bind_cores});
    if (!r.is_ok()) return failure(r.status().to_string());
    best_ex = std::move(*r);
  }
  const Executor& roof_ex = best_ex ? *best_ex : ex;
  if (!a.json) {
    std::printf("zoffload-bench grad: %zu elements, accumulator %s, gradient %s, %s\n", n, a.acc_dtype.c_str(),
                a.grad_dtype.c_str(), ex.describe().c_str());
  }

  // 1. Correctness first.
  std::string check_summary;
  if (Status s =
          check_against_scalar(*acc_dtype, *grad_dtype, ex, std::min<size_t>(n, size_t{1} << 20), &check_summary);
      !s.is_ok())
    return failure("check failed: " + s.to_string());
  if (!a.json) std::printf("check     %s\n", check_summary.c_str());

  // 2. Buffers, first touched by the executor's threads in the partition the kernels use.
  auto acc_r = AlignedBuffer::allocate(n * ab);
  auto grad_r = AlignedBuffer::allocate(n * gb);
  if (!acc_r.is_ok() || !grad_r.is_ok())
    return failure((acc_r.is_ok() ? grad_r.status() : acc_r.status()).to_string() + " (try a smaller --elems)");
  AlignedBuffer acc = std::move(*acc_r), grad = std::move(*grad_r);
  random_fill(acc.data(), *acc_dtype, n, 1, -1.0f, 1.0f, ex);
  random_fill(grad.data(), *grad_dtype, n, 2, -1e-3f, 1e-3f, ex);
  const cpu_optim::ElemSpan acc_span{acc.data(), *acc_dtype};
  const cpu_optim::ConstElemSpan acc_read{acc.data(), *acc_dtype}, grad_read{grad.data(), *grad_dtype};
  float* rw[] = {reinterpret_cast<float*>(acc.data())};

  // 3. A warm-up of each, then --repeats rounds of: accumulate, its roofline, norm, its roofline.
  // Gradients of ±1e-3 onto ±1 keep the accumulator's values ordinary floats for every round.
  std::vector<double> acc_s, acc_roof_s, norm_s, norm_roof_s;
  double sink = 0;
  for (int r = -1; r < a.repeats; ++r) {
    Stopwatch sw;
    if (Status s = cpu_optim::accumulate(acc_span, grad_read, n, false, ex); !s.is_ok()) return failure(s.to_string());
    const double t_acc = sw.elapsed_s();
    double t_acc_roof = 0;
    if (acc_roofline) {
      sw.reset();
      Result<double> x = cpu_optim::roofline_pass(rw, grad_read, n, roof_ex);
      t_acc_roof = sw.elapsed_s();
      if (!x.is_ok()) return failure(x.status().to_string());
    }
    sw.reset();
    Result<double> sq = cpu_optim::squared_norm(acc_read, n, ex);
    const double t_norm = sw.elapsed_s();
    if (!sq.is_ok()) return failure(sq.status().to_string());
    sw.reset();
    Result<double> sum = cpu_optim::roofline_pass({}, acc_read, n, roof_ex);
    const double t_norm_roof = sw.elapsed_s();
    if (!sum.is_ok()) return failure(sum.status().to_string());
    sink += *sq + *sum;
    if (r < 0) continue;  // the warm-up
    acc_s.push_back(t_acc);
    if (acc_roofline) acc_roof_s.push_back(t_acc_roof);
    norm_s.push_back(t_norm);
    norm_roof_s.push_back(t_norm_roof);
  }
  if (!std::isfinite(sink)) return failure("the accumulator overflowed during the rounds (values not finite)");

  // Bytes per element: accumulate reads acc and grad and writes acc; the norm reads acc.
  const double acc_bytes = static_cast<double>(2 * ab + gb), norm_bytes = static_cast<double>(ab);
  auto gbps = [&](double bytes, double s) { return static_cast<double>(n) * bytes / s / 1e9; };
  const double acc_med = median(acc_s), norm_med = median(norm_s), norm_roof_med = median(norm_roof_s);
  const double acc_roof_med = acc_roofline ? median(acc_roof_s) : 0.0;
  const double acc_ratio = acc_roofline ? acc_roof_med / acc_med : 0.0;
  const double norm_ratio = norm_roof_med / norm_med;
  const std::string no_roof = "no same-mix roofline for a " + a.acc_dtype + " accumulator (its written stream is fp32)";

  if (a.json) {
    nlohmann::ordered_json j;
    j["elems"] = n;
    j["acc_dtype"] = a.acc_dtype;
    j["grad_dtype"] = a.grad_dtype;
    j["isa"] = isa_name(ex.isa());
    j["roofline_isa"] = isa_name(roof_ex.isa());
    j["threads"] = ex.n_threads();
    j["repeats"] = a.repeats;
    j["check"] = check_summary;
    j["accumulate"] = {{"bytes_per_elem", acc_bytes},
                       {"median_s", acc_med},
                       {"all_s", acc_s},
                       {"gbps", gbps(acc_bytes, acc_med)},
                       {"elems_per_s", static_cast<double>(n) / acc_med}};
    if (acc_roofline) {
      j["accumulate_roofline"] = {
          {"median_s", acc_roof_med}, {"all_s", acc_roof_s}, {"gbps", gbps(acc_bytes, acc_roof_med)}};
      j["accumulate_ratio_to_roofline"] = acc_ratio;
    } else {
      j["accumulate_roofline"] = nullptr;
      j["accumulate_ratio_to_roofline"] = nullptr;
      j["accumulate_roofline_skipped"] = no_roof;
    }
    j["squared_norm"] = {{"bytes_per_elem", norm_bytes},
                         {"median_s", norm_med},
                         {"all_s", norm_s},
                         {"gbps", gbps(norm_bytes, norm_med)},
                         {"elems_per_s", static_cast<double>(n) / norm_med}};
    j["squared_norm_roofline"] = {
        {"median_s", norm_roof_med}, {"all_s", norm_roof_s}, {"gbps", gbps(norm_bytes, norm_roof_med)}};
    j["squared_norm_ratio_to_roofline"] = norm_ratio;
    j["targets"] = {{"ratio_to_roofline", kTarget}};
    std::printf("%s\n", j.dump(2).c_str());
    return 0;
  }
  std::printf("bytes     accumulate %.0f B/elem (read acc and grad, write acc); norm %.0f B/elem (read acc)\n",
              acc_bytes, norm_bytes);
  std::printf("roofline  the same stream mix with one add per element (cpu_optim::roofline_pass), %s path\n",
              std::string(isa_name(roof_ex.isa())).c_str());
  std::printf("accumulate median %.4f s of %d: %.2f GB/s, %.2f G elements/s\n", acc_med, a.repeats,
              gbps(acc_bytes, acc_med), static_cast<double>(n) / acc_med / 1e9);
  if (acc_roofline) {
    std::printf("  roofline median %.4f s: %.2f GB/s; ratio %.2f (target >= %.2f)\n", acc_roof_med,
                gbps(acc_bytes, acc_roof_med), acc_ratio, kTarget);
  } else {
    std::printf("  %s\n", no_roof.c_str());
  }
  std::printf("norm      median %.4f s of %d: %.2f GB/s, %.2f G elements/s\n", norm_med, a.repeats,
              gbps(norm_bytes, norm_med), static_cast<double>(n) / norm_med / 1e9);
  std::printf("  roofline median %.4f s: %.2f GB/s; ratio %.2f (target >= %.2f)\n", norm_roof_med,
              gbps(norm_bytes, norm_roof_med), norm_ratio, kTarget);
  return 0;
}

}  // namespace

void register_bench_grad(CLI::App& app, int* exit_code) {
  auto args = std::make_shared<GradArgs>();
  CLI::App* cmd = app.add_subcommand(
      "grad",
      "Gradient accumulation kernels (cpu_optim::accumulate and squared_norm): GB/s, checked against the "
      "scalar path, with a same-run memory roofline of each kernel's stream mix and their ratios");
  cmd->add_option("--elems", args->elems, "elements per pass, e.g. 2e8")->capture_default_str();
  cmd->add_option("--acc-dtype", args->acc_dtype, "fp32|bf16|fp16: the accumulator (data_types.grad_accum_dtype)")
      ->capture_default_str();
  cmd->add_option("--grad-dtype", args->grad_dtype, "fp32|bf16|fp16: the gradients (the compute dtype)")
      ->capture_default_str();
  cmd->add_option("--threads", args->threads, "threads (0 = all hardware threads)")->capture_default_str();
  cmd->add_option("--isa", args->isa,
                  "auto|avx512|avx2|scalar: force the kernels' SIMD path (the roofline keeps "
                  "the best)")
      ->capture_default_str();
  cmd->add_option("--repeats", args->repeats, "timed rounds; medians are reported")->capture_default_str();
  cmd->add_flag("--bind-cores", args->bind_cores, "pin the threads to cores (hwloc)");
  cmd->add_flag("--json", args->json, "print machine-readable results on stdout");
  cmd->callback([args, exit_code] { *exit_code = run_grad_bench(*args); });
}

}  // namespace zo::tools

// zoffload-bench merge: `zoffload export --merge`'s arithmetic (engine/ckpt/export.h, merge_lora:
// W += s · B·A, chunk by chunk as the export streams W, each chunk over the hardware's threads) at
// every projection shape of a model, against torch's `W.addmm_(B, A, alpha=s)` on the same buffers
// in the same run — what a PyTorch user merging by hand runs (its default threads: the cores). Each
// shape is checked first (the two results agree to fp32 rounding), then timed; the model's merge
// time is the sum over its projections. A merged export also reads and writes the model once: that
// I/O is `zoffload-bench io`'s, not this.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/aligned_buffer.h"
#include "common/host_info.h"
#include "common/parallel_ranges.h"
#include "common/status.h"
#include "common/timer.h"
#include "cpu_optim/executor.h"
#include "engine/ckpt/export.h"
#include "engine/model/model_config.h"
#include "io/env.h"
#include "tools/bench_util.h"
#include "tools/commands.h"
#include "zo_build_config.h"
#if ZO_HAVE_TORCH
#include "tools/bench_merge_torch.h"
#endif

namespace zo::tools {

namespace {

struct MergeArgs {
  std::string model = "llama3-70b";
  uint64_t r = 16;
  int repeats = 3;
  int torch_threads = 0;
  bool no_torch = false;
  bool json = false;
};

// The export's chunk of W (what its reader hands merge_lora at a time).
constexpr uint64_t kChunkElems = uint64_t{1} << 20;

struct Shape {
  uint64_t out = 0, in = 0;
  uint64_t count = 0;  // projections of this shape in the model
  std::string names;   // their HF module names in one layer
};

// The distinct [out, in] shapes of a model's decoder projections, with how many it has of each.
std::vector<Shape> projection_shapes(const engine::ModelConfig& c) {
  using R = engine::DecoderRole;
  std::map<std::pair<uint64_t, uint64_t>, Shape> by;
  for (const engine::DecoderParam& d : engine::decoder_params(c)) {
    if (d.role != R::kQ && d.role != R::kK && d.role != R::kV && d.role != R::kO && d.role != R::kGate &&
        d.role != R::kUp && d.role != R::kDown && d.role != R::kQkv && d.role != R::kGateUp)
      continue;
    Shape& s = by[{d.shape[0], d.shape[1]}];
    s.out = static_cast<uint64_t>(d.shape[0]);
    s.in = static_cast<uint64_t>(d.shape[1]);
    s.count += c.num_hidden_layers;
    s.names += (s.names.empty() ? "" : ",") + std::string(engine::lora_module_name(d.role));
  }
  std::vector<Shape> out;
  for (auto& [key, s] : by) out.push_back(s);
  return out;
}

int run_merge_bench(const MergeArgs& a) {
  const BenchError usage{"merge", 2}, failure{"merge", 1};
  if (a.r < 1 || a.r > 4096) return usage("--r must be 1 to 4096");
  if (a.repeats < 1) return usage("--repeats must be ≥ 1");
  auto model = engine::resolve_model_config(a.model, io::Env::posix());
  if (!model.is_ok()) return usage("--model: " + model.status().message());
  const bool with_torch = ZO_HAVE_TORCH && !a.no_torch;
  auto ex_r = cpu_optim::Executor::create({.n_threads = 0});
  if (!ex_r.is_ok()) return failure(ex_r.status().to_string());
  const cpu_optim::Executor& ex = **ex_r;
  const float s = 2.0f;  // lora_alpha 2r
  const HostInfo host = host_info();
  const uint64_t threads = parallel_threads(kChunkElems);  // merge_lora's on each chunk
  if (!a.json)
    std::printf(
        "zoffload-bench merge: %s, LoRA r=%llu, W += s·B·A in fp32; CPU %s (%u logical CPUs); baseline: %s\n",
        a.model.c_str(), static_cast<unsigned long long>(a.r),
        host.cpu_model.empty() ? "unknown" : host.cpu_model.c_str(), host.logical_cpus,
        with_torch ? "torch W.addmm_(B, A, alpha=s)" : (a.no_torch ? "none (--no-torch)" : "none (no LibTorch)"));

  nlohmann::json rows = nlohmann::json::array();
  double zo_total = 0, torch_total = 0;
  for (const Shape& sh : projection_shapes(*model)) {
    const uint64_t n = sh.out * sh.in;
    auto w_r = AlignedBuffer::allocate(n * 4);
    auto w2_r = AlignedBuffer::allocate(n * 4);
    if (!w_r.is_ok() || !w2_r.is_ok())
      return failure("cannot allocate W [" + std::to_string(sh.out) + ", " + std::to_string(sh.in) + "] twice in fp32");
    float* w = reinterpret_cast<float*>(w_r->data());
    float* w2 = reinterpret_cast<float*>(w2_r->data());
    std::vector<float> A(a.r * sh.in), B(sh.out * a.r);
    random_fill(w, DType::kF32, n, 1, -0.05f, 0.05f, ex);
    random_fill(A.data(), DType::kF32, A.size(), 2, -0.02f, 0.02f, ex);
    random_fill(B.data(), DType::kF32, B.size(), 3, -0.02f, 0.02f, ex);
    std::copy(w, w + n, w2);
    auto zo_merge = [&] {
      for (uint64_t off = 0; off < n; off += kChunkElems)
        engine::merge_lora(A, B, a.r, sh.in, s, off, std::span(w + off, std::min(kChunkElems, n - off)));
    };
    // Checked once on fresh copies: the same sums in another order, so fp32 rounding apart.
    Stopwatch first;
    zo_merge();
    std::vector<double> zo_s{first.elapsed_s()}, torch_s;
    double worst = 0;
#if ZO_HAVE_TORCH
    if (with_torch) {
      auto t = detail::torch_merge(w2, A.data(), B.data(), sh.out, sh.in, a.r, s, a.torch_threads);
      if (!t.is_ok()) return failure(t.status().to_string());
      torch_s.push_back(*t);
      double scale = 0;
      for (uint64_t i = 0; i < n; ++i) {
        worst = std::max(worst, static_cast<double>(std::fabs(w[i] - w2[i])));
        scale = std::max(scale, static_cast<double>(std::fabs(w2[i])));
      }
      worst /= scale;
      if (worst > 1e-6)
        return failure("W [" + std::to_string(sh.out) + ", " + std::to_string(sh.in) +
                       "]: zoffload's merge and torch's differ by " + std::to_string(worst) + " of max |W|");
    }
#endif
    for (int k = 1; k < a.repeats; ++k) {
      Stopwatch t;
      zo_merge();
      zo_s.push_back(t.elapsed_s());
#if ZO_HAVE_TORCH
      if (with_torch) {
        auto tt = detail::torch_merge(w2, A.data(), B.data(), sh.out, sh.in, a.r, s, a.torch_threads);
        if (!tt.is_ok()) return failure(tt.status().to_string());
        torch_s.push_back(*tt);
      }
#endif
    }
    const double zo = median(zo_s), th = with_torch ? median(torch_s) : 0.0;
    const double flops = 2.0 * static_cast<double>(n) * static_cast<double>(a.r);
    zo_total += zo * static_cast<double>(sh.count);
    torch_total += th * static_cast<double>(sh.count);
    rows.push_back({{"out", sh.out},
                    {"in", sh.in},
                    {"projections", sh.names},
                    {"count", sh.count},
                    {"zoffload_s", zo},
                    {"zoffload_gflops", flops / zo / 1e9},
                    {"torch_s", with_torch ? nlohmann::json(th) : nlohmann::json()},
                    {"torch_gflops", with_torch ? nlohmann::json(flops / th / 1e9) : nlohmann::json()},
                    {"max_rel_diff", with_torch ? nlohmann::json(worst) : nlohmann::json()}});
    if (!a.json) {
      std::printf("  [%6llu, %6llu] %-22s x%-4llu zoffload %7.3f s (%5.1f GFLOP/s)",
                  static_cast<unsigned long long>(sh.out), static_cast<unsigned long long>(sh.in), sh.names.c_str(),
                  static_cast<unsigned long long>(sh.count), zo, flops / zo / 1e9);
      if (with_torch)
        std::printf("  torch %7.3f s (%6.1f GFLOP/s)  torch/zoffload %.2f  max diff %.1e\n", th, flops / th / 1e9,
                    th / zo, worst);
      else std::printf("\n");
    }
  }
  if (a.json) {
    nlohmann::json out = {{"model", a.model},
                          {"r", a.r},
                          {"cpu", host.cpu_model},
                          {"logical_cpus", host.logical_cpus},
                          {"threads", threads},
                          {"shapes", rows},
                          {"model_merge_s", zo_total},
                          {"torch_model_merge_s", with_torch ? nlohmann::json(torch_total) : nlohmann::json()}};
    std::printf("%s\n", out.dump(2).c_str());
  } else {
    std::printf("model: every projection merged in %.1f s (zoffload on %llu threads, medians of %d)", zo_total,
                static_cast<unsigned long long>(threads), a.repeats);
    if (with_torch) std::printf(", torch %.1f s: ratio %.2f", torch_total, torch_total / zo_total);
    std::printf("\n");
  }
  return 0;
}

}  // namespace

void register_bench_merge(CLI::App& app, int* exit_code) {
  auto args = std::make_shared<MergeArgs>();
  CLI::App* cmd = app.add_subcommand(
      "merge",
      "`zoffload export --merge`'s arithmetic (W += s·B·A, as the export streams W) at each projection shape of a "
      "model, checked against and timed beside torch's addmm_ on the same buffers; the sum is the model's merge time");
  cmd->add_option("--model", args->model, "a preset or model directory whose projection shapes are merged")
      ->capture_default_str();
  cmd->add_option("--r", args->r, "the adapters' rank")->capture_default_str();
  cmd->add_option("--repeats", args->repeats, "timed rounds per shape; medians are reported")->capture_default_str();
  cmd->add_option("--torch-threads", args->torch_threads, "torch's threads (0: its default)")->capture_default_str();
  cmd->add_flag("--no-torch", args->no_torch, "skip the torch baseline");
  cmd->add_flag("--json", args->json, "print machine-readable results on stdout");
  cmd->callback([args, exit_code] { *exit_code = run_merge_bench(*args); });
}

}  // namespace zo::tools

// zoffload-bench host: the host's half of a training step for a model's shape, with no GPU and no
// compute. Gradients land in the pinned landing ring param by param in backward order, as a
// backward delivers them (at --landing-gbps, or as fast as the host takes them), and go through the
// engine's real GradWorker, GradAccumulator, OptimizerSwapper and StateStore exactly as
// `zoffload train` runs them for the config: the accumulation (or, without accumulators, the
// optimizer on the worker's thread during backward), the norm, the optimizer step and the new
// compute copies to their home. A STREAM triad on the same threads, measured between the steps,
// is the baseline. Prints per step where the host's time goes, the bytes each stage moves per
// parameter, GB/s against the triad, and which stage bounds the step; --json for scripts.
#include <CLI/CLI.hpp>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "common/string_util.h"
#include "common/aligned_buffer.h"
#include "common/bytes.h"
#include "common/status.h"
#include "common/timer.h"
#include "cpu_optim/executor.h"
#include "cpu_optim/vector_ops.h"
#include "engine/config/config.h"
#include "engine/config/io_settings.h"
#include "engine/coord/grad_accumulator.h"
#include "engine/coord/grad_worker.h"
#include "engine/memory/accounting.h"
#include "engine/memory/optimizer_swapper.h"
#include "engine/memory/memory_plan.h"
#include "engine/memory/pinned_pool.h"
#include "engine/memory/state_store.h"
#include "engine/model/model_config.h"
#include "engine/plan/planner.h"
#include "gpu/device.h"
#include "io/io_engine.h"
#include "tools/bench_store.h"
#include "tools/bench_util.h"
#include "tools/commands.h"

namespace zo::tools {
namespace {

using engine::StateKind;
using engine::Tier;

struct HostArgs {
  std::string model = "llama3-8b";
  std::string config_path;
  uint64_t layers = 0;  // 0: the model's
  uint64_t vocab = 0;   // 0: the model's
  std::string moments, masters, accumulators, grad_store;
  int threads = -1;  // -1: the config's optimizer_threads
  int steps = 4;
  double landing_gbps = 0;    // 0: as fast as the host takes them
  bool through_ring = false;  // every gradient through the ring, as before gradients landed in place
  bool json = false;
};

// The run's config: the user's file, or the shipped exact fp32 config's choices, with the flags
// laid over it and the device emulated on the host; parsed by the real config parser.
Result<engine::Config> make_config(const HostArgs& a, const engine::ModelConfig& model) {
  nlohmann::json j;
  if (!a.config_path.empty()) {
    ZO_ASSIGN_OR_RETURN(j, read_bench_config(a.config_path));
  } else {
    // configs/llama8b_24gb_exact_ram.json's host side: fp32 masters and moments in RAM, no
    // accumulators, the vertical schedule (one window a step), no clipping.
    j = nlohmann::json::parse(R"({
      "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 8, "gradient_clipping": 0,
      "bf16": {"enabled": true, "check_grad_overflow": false},
      "data_types": {"grad_accum_dtype": "fp32"},
      "optimizer": {"type": "AdamW", "params": {"lr": 2e-5, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.0}},
      "zero_optimization": {"stage": 3, "sub_group_size": 1e8,
        "offload_param": {"device": "cpu", "pin_memory": true},
        "offload_optimizer": {"device": "cpu", "pin_memory": false}},
      "zoffload": {"schedule": "vertical", "gradient_accumulators": "none"}})");
  }
  auto& z = j["zoffload"];
  z["device"] = "host";
  z.erase("gpu_memory_limit");
  if (!a.moments.empty()) z["moment_dtype"] = a.moments;
  if (!a.masters.empty()) z["master_dtype"] = a.masters;
  if (!a.accumulators.empty()) z["gradient_accumulators"] = a.accumulators;
  if (!a.grad_store.empty()) z["gradient_store_dtype"] = a.grad_store;
  if (a.threads >= 0) z["optimizer_threads"] = a.threads;
  engine::ResolveContext ctx;
  ctx.hidden_size = model.hidden_size;
  return parse_bench_config(j, ctx);
}

// One step's figures, in seconds of wall time.
struct StepTimes {
  double step = 0;       // the producer's whole step: every window, then the optimizer when it follows
  double land = 0;       // the producer writing gradients into the ring (the device's D2H, emulated)
  double ring_wait = 0;  // the producer waiting for room in the ring (backward would stall)
  double drain = 0;      // the producer waiting for the worker at the end of each window
  double worker = 0;     // the worker's adds and flushes (with the optimizer inside, without accumulators)
  double optimizer = 0;  // the optimizer's sub-groups (inside `worker` when direct)
  double triad = 0;      // the triad timed after this step
  double norm = 0;       // Σ g², for the check that every step saw gradients
};

// Bytes one step moves through host memory per trainable parameter, stage by stage, counted from
// the placement (the data each kernel reads and writes; write-allocate reads not counted, as STREAM
// does not count them).
struct StageBytes {
  double land = 0;        // the gradient written into the ring
  double accumulate = 0;  // ring → sums (read, write; + read the old sums after the first window)
  double norm = 0;        // the sums read again for Σ g²
  double round = 0;       // fp32 sums rounded to a 16-bit store
  double optimizer = 0;   // gradient, masters and moments read; masters, moments, compute copy written
  double total() const { return land + accumulate + norm + round + optimizer; }
};

// `landed`: the elements a window's contributions carry (a tied matrix's twice); `through_ring`:
// those that land in the ring and are added from it, the others landing where they are summed.
StageBytes count_bytes(const engine::StateStore& store, const engine::Placement& pl, DType transfer, uint32_t windows,
                       uint64_t trainable, uint64_t landed, uint64_t through_ring) {
  StageBytes b;
  const auto& reg = store.registry();
  double master = 0, moments = 0, compute = 0, grad = 0;
  for (const auto& g : reg.sub_groups()) {
    if (!store.plan().steps(g.index)) continue;
    master += static_cast<double>(store.state_bytes(g.index, StateKind::kMaster));
    moments += static_cast<double>(store.state_bytes(g.index, StateKind::kExpAvg) +
                                   store.state_bytes(g.index, StateKind::kExpAvgSq));
    compute += static_cast<double>(store.state_bytes(g.index, StateKind::kCompute));
    grad += static_cast<double>(store.state_bytes(g.index, StateKind::kGradAccum));
  }
  const double n = static_cast<double>(std::max<uint64_t>(trainable, 1));
  const double tb = static_cast<double>(dtype_size_bytes(transfer));
  const double sb = static_cast<double>(dtype_size_bytes(pl.grad_sum_dtype));
  const double landed_per = static_cast<double>(landed) / n, ring_per = static_cast<double>(through_ring) / n;
  b.land = tb * landed_per * windows;
  // From the ring: read it, write the sums (and read them back after the first window).
  b.accumulate = (tb + sb) * ring_per * windows + sb * ring_per * (windows - 1);
  // The norm reads the sums once more, unless the optimizer takes it in the update's pass (landed
  // in place, fp32 sums not rounded, a sub-group stepped in one call: fp32 masters, moments not 8-bit).
  const bool fused_norm = store.plan().landing_buffers > 0 && !pl.grads_rounded() &&
                          pl.moments != engine::MomentDtype::k8bit && pl.master_dtype == DType::kF32;
  b.norm = fused_norm ? 0 : sb;
  if (pl.grads_rounded()) b.round = sb + static_cast<double>(dtype_size_bytes(pl.grad_dtype));
  // Without accumulators the optimizer reads the sums where they were accumulated.
  const double grad_read = pl.no_accumulator ? (pl.grads_rounded() ? grad : sb * n) : grad;
  b.optimizer = (grad_read + 2 * master + 2 * moments + compute) / n;
  return b;
}

int run_host_bench(const HostArgs& a) {
  const BenchError usage{"host", 2}, failure{"host", 1};
  if (a.steps < 2) return usage("--steps must be at least 2 (the first step is a warm-up, left out of the medians)");
  if (!(a.landing_gbps >= 0) || !std::isfinite(a.landing_gbps))
    return usage("--landing-gbps: expected a rate in GB/s >= 0 (0: as fast as the host takes them)");
  Result<engine::ModelConfig> model_r = engine::resolve_model_config(a.model, io::Env::posix());
  if (!model_r.is_ok()) return usage(model_r.status().to_string());
  engine::ModelConfig model = *model_r;
  if (a.layers > 0) {
    if (a.layers > model.num_hidden_layers)
      return usage("--layers " + std::to_string(a.layers) + ": " + a.model + " has " +
                   std::to_string(model.num_hidden_layers));
    model.num_hidden_layers = a.layers;
    if (!model.sliding_layers.empty()) model.sliding_layers.resize(a.layers);
  }
  if (a.vocab > 0) model.vocab_size = a.vocab;
  if (Status s = engine::check_model_size(model); !s.is_ok()) return usage(s.to_string());

  Result<engine::Config> cfg = make_config(a, model);
  if (!cfg.is_ok()) return usage(cfg.status().message());
  const engine::Config& config = *cfg;
  Result<engine::ModelLayout> layout = engine::training_layout(&model, config);
  if (!layout.is_ok()) return usage(layout.status().to_string());
  auto reg = engine::ParamRegistry::build(layout->params, config.zero.sub_group_size);
  if (!reg.is_ok()) return usage(reg.status().to_string());
  auto plan = engine::plan_memory_with_ring(config, *reg, *layout);
  if (!plan.is_ok()) return usage(plan.status().to_string());
  if (a.through_ring && plan->landing_buffers > 0) {  // the baseline: the sums' buffers pageable, all in the ring
    plan->landing_buffers = 0;
    plan->landing_buffer_bytes = 0;
    plan->grad_ring_bytes = engine::grad_ring_bytes(*layout, *reg, engine::grad_transfer_dtype(config));
  }
  const engine::Placement& pl = plan->placement;
  if (pl.optimizer == Tier::kDevice)
    return usage(
        "the config keeps the optimizer on the device, where the host does no optimizer work: offload it "
        "(zero_optimization.offload_optimizer.device cpu or nvme)");
  const std::vector<uint32_t> order = engine::contribution_order(*layout);
  const engine::GradAccumulator::BufferPlan buffers = engine::GradAccumulator::plan_buffers(*reg, pl, order);
  const DType transfer = engine::grad_transfer_dtype(config);
  const uint32_t windows =
      static_cast<uint32_t>(engine::vertical_micro_batches(config) > 1 ? 1 : config.gradient_accumulation_steps);

  // Refused before anything large is allocated: what the states and buffers take against MemAvailable.
  const uint64_t triad_elems = uint64_t{1} << 25;  // three 128 MiB streams: far past any cache
  const uint64_t need = plan->cpu_pinned_bytes + plan->cpu_pageable_bytes + plan->pinned_pool_bytes() +
                        (plan->landing_buffers > 0 ? 0 : uint64_t{buffers.count} * buffers.bytes_each) +
                        buffers.narrowing_bytes + 3 * 4 * triad_elems;
  const engine::HostFacts host = engine::probe_host(config, "");
  if (host.ram_available_bytes > 0 && need > host.ram_available_bytes)
    return failure(a.model + " with this config needs about " + format_bytes(need) + " of host memory and " +
                   format_bytes(host.ram_available_bytes) +
                   " is available: measure a slice of it with --layers N (and --vocab N for the embedding and head); "
                   "the per-parameter figures do not depend on the model's size");
  const std::string nvme_dir = !config.zero.offload_optimizer.nvme_path.empty()
                                   ? config.zero.offload_optimizer.nvme_path
                                   : config.zero.offload_param.nvme_path;
  if (plan->nvme_optimizer_bytes + plan->nvme_param_bytes > 0 && nvme_dir.empty())
    return usage("the config puts states on nvme without an nvme_path");

  Result<std::unique_ptr<BenchStore>> parts = BenchStore::create(config, *reg, *plan);
  if (!parts.is_ok()) return failure(parts.status().to_string());
  const cpu_optim::Executor* ex = (*parts)->executor.get();
  engine::StateStore& store = *(*parts)->store;

  uint64_t trainable = 0;
  for (const auto& p : reg->params())
    if (p.trainable) trainable += p.n_elems;
  if (!a.json) {
    std::printf("zoffload-bench host: %s%s, %s trainable params in %zu sub-groups; %s\n", a.model.c_str(),
                a.layers > 0 || a.vocab > 0 ? " (cut: --layers/--vocab)" : "", format_count(trainable).c_str(),
                reg->sub_groups().size(), ex->describe().c_str());
    std::printf(
        "placement optimizer on %s, masters %s, moments %s, gradients %s (%s), %u window%s a step, arriving in %s\n",
        std::string(engine::tier_name(pl.optimizer)).c_str(), std::string(dtype_name(pl.master_dtype)).c_str(),
        std::string(engine::moment_dtype_name(pl.moments)).c_str(),
        pl.no_accumulator ? "not accumulated" : std::string(engine::tier_name(pl.grad)).c_str(),
        std::string(dtype_name(pl.grad_dtype)).c_str(), windows, windows == 1 ? "" : "s",
        std::string(dtype_name(transfer)).c_str());
    std::fflush(stdout);
  }

  Stopwatch init_sw;
  if (Status s = (*parts)->init_weights(); !s.is_ok()) return failure(s.to_string());
  const double init_s = init_sw.elapsed_s();

  auto swapper = engine::OptimizerSwapper::create(store, *ex, engine::PipelineOptions::from_config(config));
  if (!swapper.is_ok()) return failure(swapper.status().to_string());
  engine::FinalGradSink sink;
  if (pl.no_accumulator)
    sink = [s = swapper->get()](uint32_t g, std::byte* grad, double* sum_sq) {
      return s->step_direct(g, grad, sum_sq);
    };
  auto grads = engine::GradAccumulator::create(store, order, *ex, {}, std::move(sink));
  if (!grads.is_ok()) return failure(grads.status().to_string());
  auto ring = store.pool().allocate(plan->grad_ring_bytes, "the gradient landing ring");
  if (!ring.is_ok()) return failure(ring.status().to_string());
  auto worker = engine::GradWorker::create(**grads, *ring, {}, nullptr);
  if (!worker.is_ok()) return failure(worker.status().to_string());

  // The gradients' source: 16 MiB of values in the transfer dtype, copied cyclically, so the copy
  // reads from cache and writes the ring as a DMA would (plus the read of the source from cache).
  const uint64_t source_bytes = uint64_t{16} << 20;
  auto source = AlignedBuffer::allocate(source_bytes);
  if (!source.is_ok()) return failure(source.status().to_string());
  random_fill(source->data(), transfer, source_bytes / dtype_size_bytes(transfer), 77, -1e-3f, 1e-3f, *ex);
  auto triad_buf = AlignedBuffer::allocate(3 * 4 * triad_elems);
  if (!triad_buf.is_ok()) return failure(triad_buf.status().to_string());
  std::span<float> all = triad_buf->as<float>();
  std::span<float> ta = all.first(triad_elems), tb = all.subspan(triad_elems, triad_elems),
                   tc = all.subspan(2 * triad_elems, triad_elems);
  random_fill(tb.data(), DType::kF32, triad_elems, 3, -1.0f, 1.0f, *ex);
  random_fill(tc.data(), DType::kF32, triad_elems, 4, -1.0f, 1.0f, *ex);
  (void)cpu_optim::stream_triad(ta, tb, tc, 3.0f, *ex);

  const engine::OptimizerHyperparameters hyperparameters =
      engine::optimizer_hyperparameters(config.optimizer, config.optimizer.lr);
  std::vector<StepTimes> times;
  for (int step = 1; step <= a.steps; ++step) {
    StepTimes t;
    const Stopwatch wall;
    const engine::OptimizerStepArgs args{
        .hyperparameters = hyperparameters, .step = step, .grad_scale = 1.0f, .rounding_seed = 1};
    if (pl.no_accumulator) {
      if (Status s = (*swapper)->begin_direct(args, (*grads)->completion_order()); !s.is_ok())
        return failure("step " + std::to_string(step) + ": " + s.to_string());
    }
    uint64_t landed = 0, src_at = 0;
    const Stopwatch paced;
    for (uint32_t w = 0; w < windows; ++w) {
      if (Status s = (*grads)->begin_micro_step(w == 0, w + 1 == windows); !s.is_ok()) return failure(s.to_string());
      for (uint32_t id : order) {
        const engine::ParamInfo& p = reg->params()[id];
        const uint64_t bytes = p.n_elems * dtype_size_bytes(transfer);
        if (a.landing_gbps > 0) {  // a backward delivering at this rate
          const double due = static_cast<double>(landed) / (a.landing_gbps * 1e9);
          const double now = paced.elapsed_s();
          if (due > now) std::this_thread::sleep_for(std::chrono::duration<double>(due - now));
        }
        const Stopwatch submitting;
        double fill_s = 0;
        // Into the ring, or where the gradient is summed (Note [Gradients that land where they are
        // summed]): one run or two.
        Status s = (*worker)->submit(id, transfer, bytes, [&](std::span<std::byte> dest, uint64_t) {
          const Stopwatch filling;
          for (uint64_t at = 0; at < dest.size();) {
            const uint64_t n = std::min<uint64_t>(dest.size() - at, source_bytes - src_at);
            std::memcpy(dest.data() + at, source->data() + src_at, n);
            at += n;
            src_at = (src_at + n) % source_bytes;
          }
          fill_s += filling.elapsed_s();
          return Status::ok();
        });
        if (!s.is_ok()) return failure("step " + std::to_string(step) + ": " + s.to_string());
        t.land += fill_s;
        t.ring_wait += submitting.elapsed_s() - fill_s;
        landed += bytes;
      }
      const Stopwatch draining;
      Status drained = (*worker)->drain();
      t.drain += draining.elapsed_s();
      if (!drained.is_ok()) return failure("step " + std::to_string(step) + ": " + drained.to_string());
      auto report = (*grads)->end_micro_step();
      if (!report.is_ok()) return failure(report.status().to_string());
      t.worker += report->offload_s;
      t.norm += report->sum_sq;
    }
    Result<engine::OptimizerStepReport> opt_report =
        pl.no_accumulator ? (*swapper)->end_direct() : (*swapper)->step(args);
    if (!opt_report.is_ok()) return failure("step " + std::to_string(step) + ": " + opt_report.status().to_string());
    t.optimizer = opt_report->total_s;
    t.step = wall.elapsed_s();
    if (!(t.norm > 0) || !std::isfinite(t.norm))
      return failure("step " + std::to_string(step) + ": the gradients' squared norm is " + std::to_string(t.norm));
    const Stopwatch triad_sw;
    (void)cpu_optim::stream_triad(ta, tb, tc, 3.0f, *ex);
    t.triad = triad_sw.elapsed_s();
    times.push_back(t);
    if (!a.json) {
      std::printf(
          "step %-3d %.3f s: land %.3f, ring wait %.3f, drain %.3f | worker %.3f (optimizer %.3f%s) | triad %.3f s%s\n",
          step, t.step, t.land, t.ring_wait, t.drain, t.worker, t.optimizer,
          pl.no_accumulator ? " inside it" : " after backward", t.triad, step == 1 ? "  (warm-up)" : "");
      std::fflush(stdout);
    }
  }

  auto med = [&](double StepTimes::*field) {
    std::vector<double> v;
    for (size_t i = 1; i < times.size(); ++i) v.push_back(times[i].*field);
    return median(v);
  };
  const double step_s = med(&StepTimes::step), land_s = med(&StepTimes::land), wait_s = med(&StepTimes::ring_wait),
               drain_s = med(&StepTimes::drain), worker_s = med(&StepTimes::worker), opt_s = med(&StepTimes::optimizer),
               triad_s = med(&StepTimes::triad);
  const double triad_gbps = static_cast<double>(triad_elems) * 12.0 / triad_s / 1e9;
  uint64_t landed_elems = 0, ring_elems = 0;
  {
    std::vector<uint32_t> uses(reg->params().size(), 0);
    for (uint32_t id : order) ++uses[id];
    for (uint32_t id : order) {
      landed_elems += reg->params()[id].n_elems;
      if (plan->landing_buffers == 0 || uses[id] > 1) ring_elems += reg->params()[id].n_elems;
    }
  }
  const StageBytes per = count_bytes(store, pl, transfer, windows, trainable, landed_elems, ring_elems);
  const engine::GradWorker::Stats wstats = (*worker)->stats();
  const double n = static_cast<double>(trainable);
  // The host's kernels: everything but the landing, which the GPU's DMA does (here a copy on the
  // producer's thread, beside the executor's). Without accumulators they all run in the worker's
  // adds; else the optimizer follows backward.
  const double kernel_bytes = per.total() - per.land;
  const double kernel_s = pl.no_accumulator ? worker_s : worker_s + opt_s;
  const double kernel_gbps = kernel_bytes * n / kernel_s / 1e9;
  const double step_gbps = per.total() * n / step_s / 1e9;
  const double floor_s = per.total() * n / (triad_gbps * 1e9);
  // Which stage bounds the step: the producer's landing, the worker's accumulation (the optimizer
  // apart), or the optimizer.
  const double accumulate_s = pl.no_accumulator ? worker_s - opt_s : worker_s;
  struct Stage {
    const char* name;
    double s;
  };
  const Stage stages[] = {{"landing", land_s}, {"accumulate+norm", accumulate_s}, {"optimizer", opt_s}};
  const Stage* bound = &stages[0];
  for (const Stage& s : stages)
    if (s.s > bound->s) bound = &s;
  const double bytes_of[] = {per.land, per.accumulate + per.norm + per.round, per.optimizer};
  const double bound_gbps = bytes_of[bound - stages] * n / bound->s / 1e9;

  if (a.json) {
    nlohmann::json j;
    j["model"] = a.model;
    j["layers"] = model.num_hidden_layers;
    j["vocab"] = model.vocab_size;
    j["trainable_params"] = trainable;
    j["sub_groups"] = reg->sub_groups().size();
    j["executor"] = ex->describe();
    j["placement"] = {{"optimizer", engine::tier_name(pl.optimizer)},
                      {"masters", dtype_name(pl.master_dtype)},
                      {"moments", engine::moment_dtype_name(pl.moments)},
                      {"accumulators", pl.no_accumulator ? "none" : std::string(engine::tier_name(pl.grad))},
                      {"grad_dtype", dtype_name(pl.grad_dtype)},
                      {"transfer_dtype", dtype_name(transfer)},
                      {"windows", windows}};
    j["landing_gbps"] = a.landing_gbps;
    j["through_ring"] = a.through_ring;
    j["landed_in_place"] = {{"items", wstats.in_place_items}, {"of_items", wstats.items}};
    j["init_s"] = init_s;
    nlohmann::json steps = nlohmann::json::array();
    for (const StepTimes& t : times)
      steps.push_back({{"step_s", t.step},
                       {"land_s", t.land},
                       {"ring_wait_s", t.ring_wait},
                       {"drain_s", t.drain},
                       {"worker_s", t.worker},
                       {"optimizer_s", t.optimizer},
                       {"triad_s", t.triad}});
    j["steps"] = steps;
    j["median"] = {
        {"step_s", step_s},     {"land_s", land_s},     {"ring_wait_s", wait_s},        {"drain_s", drain_s},
        {"worker_s", worker_s}, {"optimizer_s", opt_s}, {"accumulate_s", accumulate_s}, {"triad_s", triad_s}};
    j["bytes_per_param"] = {{"land", per.land},   {"accumulate", per.accumulate}, {"norm", per.norm},
                            {"round", per.round}, {"optimizer", per.optimizer},   {"total", per.total()}};
    j["triad_gbps"] = triad_gbps;
    j["kernels"] = {{"bytes_per_param", kernel_bytes}, {"s", kernel_s}, {"gbps", kernel_gbps}};
    j["ratio_to_triad"] = kernel_gbps / triad_gbps;
    j["step_gbps"] = step_gbps;
    j["memory_floor_s"] = floor_s;
    j["bound"] = {{"stage", bound->name}, {"s", bound->s}, {"gbps", bound_gbps}};
    j["target"] = {{"ratio_to_triad", 0.8}};
    std::printf("%s\n", j.dump(2).c_str());
    return 0;
  }
  std::printf(
      "medians  of steps 2-%d: step %.3f s; land %.3f, ring wait %.3f, drain %.3f; worker %.3f, optimizer %.3f\n",
      a.steps, step_s, land_s, wait_s, drain_s, worker_s, opt_s);
  std::printf("landing  %llu of %llu gradients landed where they are summed, the others in the %s ring\n",
              static_cast<unsigned long long>(wstats.in_place_items), static_cast<unsigned long long>(wstats.items),
              format_bytes(plan->grad_ring_bytes).c_str());
  std::printf("bytes    per param: land %.1f + accumulate %.1f + norm %.1f + round %.1f + optimizer %.1f = %.1f B\n",
              per.land, per.accumulate, per.norm, per.round, per.optimizer, per.total());
  std::printf(
      "memory   the host's kernels: %.1f B/param in %.3f s, %.2f GB/s; triad %.2f GB/s on the executor's threads: "
      "%.2f of the triad (target 0.8)\n",
      kernel_bytes, kernel_s, kernel_gbps, triad_gbps, kernel_gbps / triad_gbps);
  std::printf("         the step: %.2f GB/s with the landing; at the triad its bytes take %.3f s (%.2f of the step)\n",
              step_gbps, floor_s, floor_s / step_s);
  std::printf("bound    %s: %.3f s a step, %.2f GB/s over its bytes\n", bound->name, bound->s, bound_gbps);
  return 0;
}

}  // namespace

void register_bench_host(CLI::App& app, int* exit_code) {
  auto args = std::make_shared<HostArgs>();
  CLI::App* cmd = app.add_subcommand(
      "host",
      "the host's half of a training step for a model's shape, no GPU: gradients landing in pinned memory in "
      "backward order, the gradient worker, the norm, the optimizer and the compute copies, through the engine's "
      "own parts; prints the bytes per parameter, the host kernels' GB/s against a triad on the executor's threads, "
      "and the bounding stage");
  cmd->add_option("--model", args->model,
                  "a Hugging Face model directory or a preset: " + join(engine::model_preset_names(), ", "))
      ->capture_default_str();
  cmd->add_option("--config", args->config_path,
                  "a DeepSpeed/zoffload JSON config (default: configs/llama8b_24gb_exact_ram.json's host side: fp32 "
                  "states in RAM, no accumulators, vertical); the device is emulated on the host");
  cmd->add_option("--layers", args->layers, "keep the first N decoder layers (a slice that fits this host)");
  cmd->add_option("--vocab", args->vocab, "vocabulary size (shrinks the embedding and head)");
  cmd->add_option("--moments", args->moments, "zoffload.moment_dtype: fp32|bf16|8bit");
  cmd->add_option("--masters", args->masters, "zoffload.master_dtype: fp32|bf16");
  cmd->add_option("--accumulators", args->accumulators, "zoffload.gradient_accumulators: auto|cpu|nvme|none");
  cmd->add_option("--grad-store", args->grad_store, "zoffload.gradient_store_dtype: fp32|bf16");
  cmd->add_option("--threads", args->threads, "zoffload.optimizer_threads (0: every CPU; default: the config's)");
  cmd->add_option("--landing-gbps", args->landing_gbps,
                  "the rate gradients land at, as a backward would deliver them (0: as fast as the host takes them)")
      ->capture_default_str();
  cmd->add_flag("--through-ring", args->through_ring,
                "every gradient through the landing ring and copied into its sub-group's sums (the path before "
                "gradients landed where they are summed): the baseline to compare with");
  cmd->add_option("--steps", args->steps, "steps, the first a warm-up; medians of the others")->capture_default_str();
  cmd->add_flag("--json", args->json, "print machine-readable results on stdout");
  cmd->callback([args, exit_code] { *exit_code = run_host_bench(*args); });
}

}  // namespace zo::tools

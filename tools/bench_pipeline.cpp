// zoffload-bench pipeline: full optimizer steps over N parameters with the optimizer states (and
// gradients) on the chosen tier, through the engine's real StateStore and OptimizerSwapper; then, in
// the same run, the same NVMe reads and writes alone (no Adam) and the same Adam alone (no I/O).
// Prints the step time, each part, overlap efficiency = max(io, adam) / step, bytes moved, peak
// pinned memory against its cap and peak RSS; --json for scripts. Correctness first: the first step
// of one sub-group is compared bit for bit with cpu_optim::adam_step on the same inputs.
#include <CLI/CLI.hpp>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
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
#include "cpu_optim/adam.h"
#include "cpu_optim/executor.h"
#include "engine/config/config.h"
#include "engine/config/io_settings.h"
#include "engine/memory/accounting.h"
#include "engine/memory/optimizer_swapper.h"
#include "engine/memory/memory_plan.h"
#include "engine/memory/pinned_pool.h"
#include "engine/memory/state_store.h"
#include "gpu/device.h"
#include "io/io_engine.h"
#include "tools/bench_store.h"
#include "tools/bench_util.h"
#include "tools/commands.h"

namespace zo::tools {
namespace {

using engine::StateKind;
using engine::Tier;

struct PipelineArgs {
  std::string params = "5e8";
  std::string nvme_path;
  std::string optimizer_device = "nvme";
  std::string param_device;  // default: nvme with the optimizer on nvme, else cpu
  std::string config_path;
  std::string sub_group_size;  // default 2.5e7 unless --config sets it
  std::string param_elems = "16777216";
  std::string pinned_limit;  // zoffload.pinned_memory_limit; default: what the plan needs
  int steps = 3;
  bool no_pipeline_read = false;
  bool no_pipeline_write = false;
  bool json = false;
};

constexpr uint64_t kDefaultSubGroupSize = 25'000'000;

// The run's config: the user's file (or an empty one) with the benchmark's choices laid over it, so
// a user measures their own aio, buffer and pipeline settings; parsed by the real config parser.
Result<engine::Config> make_config(const PipelineArgs& a, uint64_t sub_group_size_override, std::string* why_usage) {
  nlohmann::json j = nlohmann::json::object();
  if (!a.config_path.empty()) { ZO_ASSIGN_OR_RETURN(j, read_bench_config(a.config_path)); }
  auto& zero = j["zero_optimization"];
  zero["stage"] = 3;
  if (sub_group_size_override != 0 || !zero.contains("sub_group_size"))
    zero["sub_group_size"] = sub_group_size_override != 0 ? sub_group_size_override : kDefaultSubGroupSize;
  auto& opt = zero["offload_optimizer"];
  opt["device"] = a.optimizer_device;
  if (!a.nvme_path.empty()) opt["nvme_path"] = a.nvme_path;
  if (!opt.contains("pipeline_read")) opt["pipeline_read"] = true;
  if (!opt.contains("pipeline_write")) opt["pipeline_write"] = true;
  if (a.no_pipeline_read) opt["pipeline_read"] = false;
  if (a.no_pipeline_write) opt["pipeline_write"] = false;
  auto& par = zero["offload_param"];
  par["device"] = a.param_device;
  if (!a.nvme_path.empty()) par["nvme_path"] = a.nvme_path;
  if (!j.contains("bf16") && !j.contains("fp16")) j["bf16"] = {{"enabled", true}};
  j["zoffload"]["device"] = "host";
  if (!a.pinned_limit.empty()) j["zoffload"]["pinned_memory_limit"] = a.pinned_limit;
  engine::ResolveContext ctx;
  ctx.hidden_size = 4096;  // only for "auto" bucket sizes, which this benchmark does not use
  ctx.micro_batch_size = 1;
  ctx.gradient_accumulation_steps = 1;
  Result<engine::Config> c = parse_bench_config(j, ctx);
  if (!c.is_ok()) {
    *why_usage = c.status().message();
    return c.status();
  }
  if (c->zoffload.moment_dtype != "fp32") {
    *why_usage = "zoffload.moment_dtype \"" + c->zoffload.moment_dtype +
                 "\": this benchmark steps fp32 moments only (zoffload-bench adam --moments 8bit times the 8-bit "
                 "kernel; zoffload train runs the whole step)";
    return invalid_argument(*why_usage);
  }
  if (c->zoffload.master_dtype != "fp32") {
    *why_usage = "zoffload.master_dtype \"" + c->zoffload.master_dtype +
                 "\": this benchmark steps fp32 masters only (zoffload-bench adam --masters bf16 times the "
                 "bf16-master kernel; zoffload train runs the whole step)";
    return invalid_argument(*why_usage);
  }
  if (c->zoffload.gradient_accumulators == "none") {
    *why_usage =
        "zoffload.gradient_accumulators \"none\": this benchmark steps from stored gradients; without them each "
        "sub-group is stepped during backward, which zoffload train times (its gradient worker and optimizer)";
    return invalid_argument(*why_usage);
  }
  return *c;
}

// The NVMe traffic of one optimizer step without the update: every sub-group's record read
// (master|m|v|grad) and its new states written back (master|m|v, compute copy to the param file),
// with the same buffers and the same overlap as the pipeline (read i+1 and write i−1 in flight
// together). Writes back what it read, so the states do not change; the compute copies it writes are
// stale until the next optimizer step rewrites them.
Result<double> time_io_alone(engine::StateStore& store, bool pipeline_read, bool pipeline_write) {
  engine::SwapFile* ofile = store.optimizer_file();
  engine::SwapFile* pfile = store.param_file();
  const auto bufs = store.optimizer_swap_buffers();
  const auto& reg = store.registry();
  const uint32_t n_groups = static_cast<uint32_t>(reg.sub_groups().size());
  Stopwatch sw;
  if (ofile == nullptr) {
    // Optimizer on the CPU: the only NVMe traffic is the compute copies written to the param file.
    if (pfile == nullptr) return 0.0;
    const auto staging = store.compute_staging_buffers();
    std::vector<io::Ticket> inflight;
    for (uint32_t g = 0; g < n_groups; ++g) {
      const auto& loc = store.location(g, StateKind::kCompute);
      if (loc.tier != Tier::kNvme) continue;
      const auto buf = staging[g % staging.size()].first(loc.region.size_bytes);
      if (inflight.size() == staging.size()) {
        ZO_RETURN_IF_ERROR(pfile->wait(inflight.front()));
        inflight.erase(inflight.begin());
      }
      ZO_ASSIGN_OR_RETURN(io::Ticket t, pfile->write_async(loc.region, 0, buf, "io-alone compute write"));
      inflight.push_back(t);
    }
    for (io::Ticket t : inflight) ZO_RETURN_IF_ERROR(pfile->wait(t));
    return sw.elapsed_s();
  }
  struct Slot {
    bool reading = false, writing = false;
    io::Ticket read{}, write_states{}, write_compute{};
    bool has_compute = false;
  };
  std::vector<Slot> slots(bufs.size());
  auto record_bytes = [&](uint32_t g) {
    const auto& m = store.location(g, StateKind::kMaster).region;
    const auto& gr = store.location(g, StateKind::kGradAccum).region;
    return gr.offset_bytes + gr.size_bytes - m.offset_bytes;
  };
  auto states_bytes = [&](uint32_t g) {
    const auto& m = store.location(g, StateKind::kMaster).region;
    const auto& v = store.location(g, StateKind::kExpAvgSq).region;
    return v.offset_bytes + v.size_bytes - m.offset_bytes;
  };
  auto finish_write = [&](Slot& s) -> Status {
    if (!s.writing) return Status::ok();
    s.writing = false;
    ZO_RETURN_IF_ERROR(ofile->wait(s.write_states));
    if (s.has_compute) ZO_RETURN_IF_ERROR(pfile->wait(s.write_compute));
    return Status::ok();
  };
  auto start_read = [&](uint32_t g) -> Status {
    Slot& s = slots[g % slots.size()];
    ZO_RETURN_IF_ERROR(finish_write(s));
    const auto region = store.location(g, StateKind::kMaster).region;
    const engine::SwapRegion whole{region.offset_bytes, record_bytes(g)};
    ZO_ASSIGN_OR_RETURN(s.read,
                        ofile->read_async(whole, 0, bufs[g % bufs.size()].first(whole.size_bytes), "io-alone read"));
    s.reading = true;
    return Status::ok();
  };
  // Prefetching g+1 needs a second buffer; a write left in flight is waited for before its buffer is
  // read into again (start_read) — the pipeline's rotation.
  const bool prefetch = pipeline_read && slots.size() >= 2;
  for (uint32_t g = 0; g < n_groups; ++g) {
    Slot& s = slots[g % slots.size()];
    if (!s.reading) ZO_RETURN_IF_ERROR(start_read(g));
    ZO_RETURN_IF_ERROR(ofile->wait(s.read));
    s.reading = false;
    if (prefetch && g + 1 < n_groups) ZO_RETURN_IF_ERROR(start_read(g + 1));
    const auto buf = bufs[g % bufs.size()];
    const auto region = store.location(g, StateKind::kMaster).region;
    const engine::SwapRegion states{region.offset_bytes, states_bytes(g)};
    ZO_ASSIGN_OR_RETURN(s.write_states, ofile->write_async(states, 0, buf.first(states.size_bytes), "io-alone write"));
    const auto& cloc = store.location(g, StateKind::kCompute);
    s.has_compute = cloc.tier == Tier::kNvme && pfile != nullptr;
    if (s.has_compute) {
      // Any bytes of the buffer past the record do: the next optimizer step rewrites every compute copy.
      const uint64_t offset = record_bytes(g);
      ZO_ASSIGN_OR_RETURN(
          s.write_compute,
          pfile->write_async(cloc.region, 0, buf.subspan(offset, cloc.region.size_bytes), "io-alone compute write"));
    }
    s.writing = true;
    if (!pipeline_write) ZO_RETURN_IF_ERROR(finish_write(s));
  }
  for (Slot& s : slots) ZO_RETURN_IF_ERROR(finish_write(s));
  return sw.elapsed_s();
}

// The update alone: cpu_optim::adam_step over every sub-group's size, on in-memory buffers the size
// of the largest sub-group, with the same executor, gradient dtype and copy-out dtype as the step.
Result<double> time_adam_alone(const engine::StateStore& store, const cpu_optim::AdamConfig& adam,
                               const cpu_optim::Executor& ex, std::vector<AlignedBuffer>& scratch) {
  const auto& reg = store.registry();
  const auto& pl = store.plan().placement;
  const uint64_t n_max = reg.max_group_elems();
  const uint64_t gbytes = engine::state_elem_bytes(pl, StateKind::kGradAccum);
  const uint64_t cbytes = engine::state_elem_bytes(pl, StateKind::kCompute);
  if (scratch.empty()) {
    for (uint64_t bytes : {4 * n_max, 4 * n_max, 4 * n_max, gbytes * n_max, cbytes * n_max}) {
      ZO_ASSIGN_OR_RETURN(AlignedBuffer b, AlignedBuffer::allocate(bytes));
      scratch.push_back(std::move(b));
    }
    random_fill(scratch[0].data(), DType::kF32, n_max, 11, -1.0f, 1.0f, ex);
    random_fill(scratch[3].data(), pl.grad_dtype, n_max, 12, -1.0f, 1.0f, ex);
  }
  Stopwatch sw;
  for (const auto& g : reg.sub_groups()) {
    const size_t n = g.n_elems;
    ZO_RETURN_IF_ERROR(cpu_optim::adam_step(adam, 1, scratch[0].as<float>().first(n), scratch[1].as<float>().first(n),
                                            scratch[2].as<float>().first(n), {scratch[3].data(), pl.grad_dtype}, 1.0f,
                                            {scratch[4].data(), pl.compute_dtype}, ex));
  }
  return sw.elapsed_s();
}

// Correctness first: sub-group 0's states before a step, stepped in memory by cpu_optim::adam_step,
// must equal what the swapper left at their home, bit for bit.
struct GroupSnapshot {
  std::vector<std::byte> master, m, v, grad, compute;
};
Result<GroupSnapshot> snapshot_group(engine::StateStore& store, uint32_t g) {
  const auto& pl = store.plan().placement;
  const uint64_t n = store.registry().sub_groups()[g].n_elems;
  GroupSnapshot s;
  const std::pair<StateKind, std::vector<std::byte>*> parts[] = {{StateKind::kMaster, &s.master},
                                                                 {StateKind::kExpAvg, &s.m},
                                                                 {StateKind::kExpAvgSq, &s.v},
                                                                 {StateKind::kGradAccum, &s.grad},
                                                                 {StateKind::kCompute, &s.compute}};
  for (const auto& [kind, out] : parts) {
    out->resize(n * engine::state_elem_bytes(pl, kind));
    ZO_RETURN_IF_ERROR(store.read_state(g, kind, *out));
  }
  return s;
}

Status check_step(const GroupSnapshot& before, const GroupSnapshot& after, const engine::Placement& pl,
                  const cpu_optim::AdamConfig& adam, int64_t step, float grad_scale, const cpu_optim::Executor& ex) {
  GroupSnapshot ref = before;
  const size_t n = ref.master.size() / 4;
  auto f32 = [n](std::vector<std::byte>& b) { return std::span<float>(reinterpret_cast<float*>(b.data()), n); };
  ZO_RETURN_IF_ERROR(cpu_optim::adam_step(adam, step, f32(ref.master), f32(ref.m), f32(ref.v),
                                          {ref.grad.data(), pl.grad_dtype}, grad_scale,
                                          {ref.compute.data(), pl.compute_dtype}, ex));
  const std::pair<const char*, bool> same[] = {{"master", ref.master == after.master},
                                               {"exp_avg", ref.m == after.m},
                                               {"exp_avg_sq", ref.v == after.v},
                                               {"compute copy", ref.compute == after.compute}};
  for (const auto& [name, ok] : same)
    if (!ok)
      return internal_error(std::string("sub-group 0 ") + name +
                            " differs from cpu_optim::adam_step on the same inputs");
  return Status::ok();
}

int run_pipeline_bench(PipelineArgs a) {
  const BenchError usage{"pipeline", 2}, failure{"pipeline", 1};
  const Result<uint64_t> n_total = parse_count(a.params);
  if (!n_total.is_ok() || *n_total == 0)
    return usage("--params: expected a positive count like 5e8, got '" + a.params + "'");
  const Result<uint64_t> per_param = parse_count(a.param_elems);
  if (!per_param.is_ok() || *per_param == 0)
    return usage("--param-elems: expected a positive count, got '" + a.param_elems + "'");
  uint64_t sgs = 0;
  if (!a.sub_group_size.empty()) {
    const Result<uint64_t> s = parse_count(a.sub_group_size);
    if (!s.is_ok() || *s == 0)
      return usage("--sub-group-size: expected a positive count, got '" + a.sub_group_size + "'");
    sgs = *s;
  }
  if (a.optimizer_device != "cpu" && a.optimizer_device != "nvme")
    return usage("--optimizer-device: expected cpu or nvme, got '" + a.optimizer_device + "'");
  if (a.param_device.empty()) a.param_device = a.optimizer_device == "nvme" ? "nvme" : "cpu";
  if (a.param_device != "none" && a.param_device != "cpu" && a.param_device != "nvme")
    return usage("--param-device: expected none, cpu or nvme, got '" + a.param_device + "'");
  if (a.steps < 1) return usage("--steps must be >= 1");
  if ((a.optimizer_device == "nvme" || a.param_device == "nvme") && a.nvme_path.empty() && a.config_path.empty())
    return usage("--nvme-path DIR is required with a device on nvme (a directory on the drive to measure)");

  std::string why;
  Result<engine::Config> cfg = make_config(a, sgs, &why);
  if (!cfg.is_ok()) return usage(why.empty() ? cfg.status().message() : why);
  const engine::Config& config = *cfg;

  // The model: --params elements as params of --param-elems each (the last one smaller).
  std::vector<ParamSpec> specs;
  for (uint64_t done = 0, i = 0; done < *n_total; ++i) {
    const uint64_t n = std::min(*per_param, *n_total - done);
    specs.push_back({"layers." + std::to_string(i) + ".weight", {static_cast<int64_t>(n)}});
    done += n;
  }
  auto reg = engine::ParamRegistry::build(std::move(specs), config.zero.sub_group_size);
  if (!reg.is_ok()) return usage(reg.status().to_string());
  auto plan = engine::plan_memory(config, *reg);
  if (!plan.is_ok()) return usage(plan.status().to_string());

  const auto& opt = config.zero.offload_optimizer;
  const auto& par = config.zero.offload_param;
  const uint64_t nvme_need = plan->nvme_optimizer_bytes + plan->nvme_param_bytes;
  const std::string nvme_dir = !opt.nvme_path.empty() ? opt.nvme_path : par.nvme_path;
  if (nvme_need > 0) {
    struct statvfs sv {};
    if (::statvfs(nvme_dir.c_str(), &sv) == 0) {
      const uint64_t free_bytes = static_cast<uint64_t>(sv.f_bavail) * sv.f_frsize;
      if (free_bytes < nvme_need)
        return failure(nvme_dir + ": needs " + format_bytes(nvme_need) + " of swap files, " + format_bytes(free_bytes) +
                       " free; pick another --nvme-path or fewer --params");
    }
  }
  const uint64_t pinned_cap = config.zoffload.pinned_memory_limit;
  if (!a.json) {
    std::printf(
        "zoffload-bench pipeline: %s params in %zu sub-groups of <= %s elements; optimizer on %s, "
        "params on %s, %s compute, grads %s\n",
        a.params.c_str(), reg->sub_groups().size(), std::to_string(config.zero.sub_group_size).c_str(),
        a.optimizer_device.c_str(), a.param_device.c_str(),
        std::string(dtype_name(plan->placement.compute_dtype)).c_str(),
        std::string(dtype_name(plan->placement.grad_dtype)).c_str());
    uint32_t compute_on[3] = {0, 0, 0};
    for (const Tier t : plan->placement.compute) ++compute_on[static_cast<int>(t)];
    std::printf(
        "placement compute copies of %u sub-groups on nvme, %u on cpu (offload_param.max_in_cpu = %s), "
        "%u on the device\n",
        compute_on[2], compute_on[1], std::to_string(par.max_in_cpu).c_str(), compute_on[0]);
    std::printf("plan      pinned pool %s (cap %s); swap files %s; pipeline read %s, write %s\n",
                format_bytes(plan->pinned_pool_bytes()).c_str(),
                pinned_cap ? format_bytes(pinned_cap).c_str() : "= plan", format_bytes(nvme_need).c_str(),
                opt.pipeline_read ? "on" : "off", opt.pipeline_write ? "on" : "off");
    std::fflush(stdout);
  }

  Result<std::unique_ptr<BenchStore>> parts = BenchStore::create(config, *reg, *plan);
  if (!parts.is_ok()) return failure(parts.status().to_string());
  const cpu_optim::Executor* ex = (*parts)->executor.get();
  engine::MemoryAccounting& acct = (*parts)->accounting;
  engine::StateStore& store = *(*parts)->store;

  // Initial states: random master weights streamed in bounded chunks, then gradients, as a backward
  // pass would leave them (×1024, unscaled by the step's grad_scale).
  Stopwatch init_sw;
  {
    Status weights = (*parts)->init_weights([&](uint64_t done, uint64_t total) {
      if (!a.json && isatty(fileno(stderr)))
        std::fprintf(stderr, "\rinit      %5.1f%%", 100.0 * static_cast<double>(done) / static_cast<double>(total));
    });
    if (!weights.is_ok()) return failure(weights.to_string());
    const uint64_t gb = engine::state_elem_bytes(plan->placement, StateKind::kGradAccum);
    AlignedBuffer grad;
    if (auto g = AlignedBuffer::allocate(reg->max_group_elems() * gb); g.is_ok()) grad = std::move(*g);
    else return failure(g.status().to_string());
    for (const auto& g : reg->sub_groups()) {
      random_fill(grad.data(), plan->placement.grad_dtype, g.n_elems, 5000 + g.index, -1024.0f, 1024.0f, *ex);
      if (Status s = store.write_state(g.index, StateKind::kGradAccum, grad.bytes().first(g.n_elems * gb)); !s.is_ok())
        return failure("writing gradients: " + s.to_string());
    }
  }
  const double init_s = init_sw.elapsed_s();
  if (!a.json) {
    if (isatty(fileno(stderr))) std::fprintf(stderr, "\r");
    std::printf("init      %.1f s (master weights, compute copies and gradients written to their tiers)\n", init_s);
    std::fflush(stdout);
  }

  auto swapper = engine::OptimizerSwapper::create(store, *ex, engine::PipelineOptions::from_config(config));
  if (!swapper.is_ok()) return failure(swapper.status().to_string());
  cpu_optim::AdamConfig adam{.lr = 1e-4f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f, .weight_decay = 0.01f};
  const float grad_scale = 1.0f / 1024.0f;

  // 1. Correctness: the first (untimed) step, checked on sub-group 0.
  auto before = snapshot_group(store, 0);
  if (!before.is_ok()) return failure(before.status().to_string());
  auto first = (*swapper)->step({adam, 1, grad_scale});
  if (!first.is_ok()) return failure("step 1: " + first.status().to_string());
  auto after = snapshot_group(store, 0);
  if (!after.is_ok()) return failure(after.status().to_string());
  if (Status s = check_step(*before, *after, plan->placement, adam, 1, grad_scale, *ex); !s.is_ok())
    return failure("check failed: " + s.to_string());
  const std::string check =
      "sub-group 0 after step 1 (" + std::to_string(reg->sub_groups()[0].n_elems) +
      " params): master, exp_avg, exp_avg_sq and compute copy bit-identical to cpu_optim::adam_step";
  if (!a.json) std::printf("check     %s\n", check.c_str());

  // 2. Timed: each repeat runs the I/O alone, the update alone, then a full step, so all three see
  // the same load on a shared machine.
  acct.reset_peaks();
  const uint64_t pool_used_before = store.pool().used_bytes();
  std::vector<double> step_s, io_s, adam_s, read_wait_s, write_wait_s, update_s;
  std::vector<AlignedBuffer> scratch;
  uint64_t bytes_read = 0, bytes_written = 0;
  for (int r = 0; r < a.steps; ++r) {
    auto t_io = time_io_alone(store, opt.pipeline_read, opt.pipeline_write);
    if (!t_io.is_ok()) return failure("io alone: " + t_io.status().to_string());
    auto t_adam = time_adam_alone(store, adam, *ex, scratch);
    if (!t_adam.is_ok()) return failure("adam alone: " + t_adam.status().to_string());
    auto rep = (*swapper)->step({adam, 2 + r, grad_scale});
    if (!rep.is_ok()) return failure("step " + std::to_string(2 + r) + ": " + rep.status().to_string());
    io_s.push_back(*t_io);
    adam_s.push_back(*t_adam);
    step_s.push_back(rep->total_s);
    read_wait_s.push_back(rep->read_wait_s);
    write_wait_s.push_back(rep->write_wait_s);
    update_s.push_back(rep->update_s);
    bytes_read = rep->bytes_read;
    bytes_written = rep->bytes_written;
    if (!a.json)
      std::printf(
          "step %-4d %.3f s  (update %.3f s, read wait %.3f s, write wait %.3f s) | io alone %.3f s | adam alone %.3f "
          "s\n",
          2 + r, rep->total_s, rep->update_s, rep->read_wait_s, rep->write_wait_s, *t_io, *t_adam);
    std::fflush(stdout);
  }
  scratch.clear();
  const double step_med = median(step_s), io_med = median(io_s), adam_med = median(adam_s);
  const double overlap = step_med > 0 ? std::max(io_med, adam_med) / step_med : 0.0;
  const engine::MemoryStats ms = acct.snapshot();
  const RssBytes rss = process_rss();
  const uint64_t pool_cap = store.pool().capacity_bytes(), pool_peak = store.pool().peak_used_bytes();
  const bool pool_grew = store.pool().used_bytes() != pool_used_before;
  const uint64_t state_bytes = *n_total * (12 + engine::state_elem_bytes(plan->placement, StateKind::kGradAccum) +
                                           engine::state_elem_bytes(plan->placement, StateKind::kCompute));

  // The pool minus the states that live in it: the part that must not grow with the model.
  const uint64_t buffer_bytes = plan->pinned_pool_bytes() - align_up(plan->cpu_pinned_bytes, engine::kPinnedAlignment);
  const uint64_t nvme_state_bytes = plan->nvme_optimizer_bytes + plan->nvme_param_bytes;
  if (a.json) {
    nlohmann::json j;
    j["params"] = *n_total;
    j["sub_groups"] = reg->sub_groups().size();
    j["sub_group_size"] = config.zero.sub_group_size;
    j["optimizer_device"] = a.optimizer_device;
    j["param_device"] = a.param_device;
    j["pipeline_read"] = opt.pipeline_read;
    j["pipeline_write"] = opt.pipeline_write;
    j["io_backend"] = std::string(io::backend_name((*parts)->io->backend()));
    j["executor"] = ex->describe();
    j["check"] = check;
    j["init_s"] = init_s;
    j["step_s"] = {{"median", step_med}, {"all", step_s}};
    j["update_s"] = {{"median", median(update_s)}, {"all", update_s}};
    j["read_wait_s"] = {{"median", median(read_wait_s)}, {"all", read_wait_s}};
    j["write_wait_s"] = {{"median", median(write_wait_s)}, {"all", write_wait_s}};
    j["io_alone_s"] = {{"median", io_med}, {"all", io_s}};
    j["adam_alone_s"] = {{"median", adam_med}, {"all", adam_s}};
    j["overlap_efficiency"] = overlap;
    j["bytes_per_step"] = {{"read", bytes_read}, {"written", bytes_written}};
    j["step_gbps"] = {{"read", gbps(bytes_read, step_med)}, {"write", gbps(bytes_written, step_med)}};
    j["state_bytes"] = state_bytes;
    j["pinned"] = {{"cap_bytes", pool_cap},
                   {"peak_used_bytes", pool_peak},
                   {"buffer_bytes", buffer_bytes},
                   {"cpu_resident_state_bytes", plan->cpu_pinned_bytes},
                   {"allocated_in_step_loop", pool_grew}};
    j["nvme_state_bytes"] = nvme_state_bytes;
    j["rss_bytes"] = {{"current", rss.current}, {"peak", rss.peak}};
    j["memory"] = nlohmann::json::parse(ms.to_json());
    j["plan"] = nlohmann::json::parse(plan->to_json());
    j["targets"] = {{"overlap_efficiency", 0.9}};
    std::printf("%s\n", j.dump(2).c_str());
    return 0;
  }
  std::printf("step      median %.3f s of %d: reads %s + writes %s = %.2f + %.2f GB/s\n", step_med, a.steps,
              format_bytes(bytes_read).c_str(), format_bytes(bytes_written).c_str(), gbps(bytes_read, step_med),
              gbps(bytes_written, step_med));
  std::printf(
      "parts     io alone %.3f s, adam alone %.3f s (medians); in the step: update %.3f s, read wait %.3f s, "
      "write wait %.3f s\n",
      io_med, adam_med, median(update_s), median(read_wait_s), median(write_wait_s));
  std::printf("overlap   max(io, adam) / step = %.2f (target >= 0.9)\n", overlap);
  std::printf("memory    pinned peak %s of cap %s (swap/staging buffers %s, CPU-resident states %s)%s\n",
              format_bytes(pool_peak).c_str(), format_bytes(pool_cap).c_str(), format_bytes(buffer_bytes).c_str(),
              format_bytes(plan->cpu_pinned_bytes).c_str(),
              pool_grew ? "; the pool changed inside the step loop!" : "");
  std::printf("          RSS peak %s; model state %s, of it %s on NVMe; NVMe written %s in this run\n",
              format_bytes(rss.peak).c_str(), format_bytes(state_bytes).c_str(), format_bytes(nvme_state_bytes).c_str(),
              format_bytes(ms.nvme_write_bytes).c_str());
  return 0;
}

}  // namespace

void register_bench_pipeline(CLI::App& app, int* exit_code) {
  auto args = std::make_shared<PipelineArgs>();
  CLI::App* cmd = app.add_subcommand(
      "pipeline",
      "optimizer steps with states on cpu or nvme through the real swapper; times the I/O alone and Adam alone "
      "in the same run and prints overlap efficiency = max(io, adam) / step");
  cmd->add_option("--params", args->params, "number of parameters, e.g. 5e8 or 2e9")->capture_default_str();
  cmd->add_option("--nvme-path", args->nvme_path,
                  "directory on the drive to measure; swap files go to DIR/zoffload-swap/rank0 and are removed after");
  cmd->add_option("--optimizer-device", args->optimizer_device, "cpu|nvme: where optimizer states and gradients live")
      ->capture_default_str();
  cmd->add_option(
      "--param-device", args->param_device,
      "none|cpu|nvme: where the bf16 compute copies live (default: nvme with the optimizer on nvme, else cpu)");
  cmd->add_option("--config", args->config_path,
                  "a DeepSpeed JSON config whose aio, sub_group_size, buffer and pipeline settings to use; "
                  "the flags above override it");
  cmd->add_option("--sub-group-size", args->sub_group_size,
                  "elements per sub-group (default 2.5e7, or the config's): the pipeline needs several sub-groups")
      ->check(CLI::TypeValidator<std::string>());
  cmd->add_option("--param-elems", args->param_elems, "elements per synthetic parameter tensor")->capture_default_str();
  cmd->add_option("--pinned-limit", args->pinned_limit,
                  "zoffload.pinned_memory_limit, e.g. 2GiB (default: what the plan needs)");
  cmd->add_option("--steps", args->steps, "timed steps (after one checked warm-up step); medians are reported")
      ->capture_default_str();
  cmd->add_flag("--no-pipeline-read", args->no_pipeline_read, "read sub-group i+1 only after updating i");
  cmd->add_flag("--no-pipeline-write", args->no_pipeline_write, "wait for the write of i before updating i+1");
  cmd->add_flag("--json", args->json, "print machine-readable results on stdout");
  cmd->callback([args, exit_code] { *exit_code = run_pipeline_bench(*args); });
}

}  // namespace zo::tools

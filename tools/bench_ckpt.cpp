// `zoffload-bench ckpt`: checkpoint save, verify, load and export throughput of a store whose
// optimizer states live on NVMe, against a plain sequential write of the same bytes with the same
// I/O engine on the same drive (the baseline, measured in the same run), with the peak extra RSS of
// the save and of the export.
#include <CLI/CLI.hpp>

#include <sys/statvfs.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "common/aligned_buffer.h"
#include "common/bytes.h"
#include "common/host_info.h"
#include "engine/ckpt/checkpoint.h"
#include "engine/ckpt/export.h"
#include "engine/config/config.h"
#include "engine/config/io_settings.h"
#include "engine/memory/memory_plan.h"
#include "engine/memory/state_store.h"
#include "gpu/device.h"
#include "io/env.h"
#include "io/io_engine.h"
#include "tools/bench_util.h"
#include "tools/commands.h"

namespace zo::tools {
namespace {

namespace fs = std::filesystem;
using engine::StateKind;

struct CkptArgs {
  std::string params = "5e8";
  std::string nvme_path;
  std::string sub_group_size = "2.5e7";
  std::string param_elems = "16777216";
  std::string staging = "256MiB";
  bool json = false;
};

using Clock = std::chrono::steady_clock;
double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }
// The baseline: `bytes` written front to back into a new file in `dir` by the same engine, from a
// buffer of the staging size cut into 4 slots with all 4 in flight — the save's write pattern
// without the reads that feed it.
Result<double> time_plain_write(io::IoEngine& io, const std::string& dir, uint64_t bytes, std::span<std::byte> buf) {
  const std::string path = dir + "/zoffload-bench-ckpt-baseline." + std::to_string(::getpid()) + ".dat";
  ZO_ASSIGN_OR_RETURN(io::File file, io::Env::posix()->open_file(path, io::OpenMode::kCreateNew, /*direct=*/true));
  const uint64_t slot = buf.size() / 4 / kDirectIoAlignment * kDirectIoAlignment;
  std::vector<std::optional<io::Ticket>> tickets(4);
  const auto t0 = Clock::now();
  uint64_t off = 0;
  Status s;
  for (uint32_t i = 0; off < bytes && s.is_ok(); i = (i + 1) % 4) {
    if (tickets[i]) s = io.wait(*tickets[i]);
    tickets[i].reset();
    if (!s.is_ok()) break;
    const uint64_t n = std::min(slot, align_up(bytes - off, kDirectIoAlignment));
    auto t = io.submit(io::write_request(file, off, buf.data() + uint64_t{i} * slot, n));
    if (!t.is_ok()) {
      s = t.status();
      break;
    }
    tickets[i] = *t;
    off += n;
  }
  for (auto& t : tickets) {
    if (!t) continue;
    Status w = io.wait(*t);
    if (s.is_ok()) s = std::move(w);
  }
  if (s.is_ok()) s = file.sync();
  const double secs = since(t0);
  (void)file.close();
  fs::remove(path);
  if (!s.is_ok()) return s;
  return secs;
}

// The drive's ceiling for any save that streams swap files into checkpoint files on the same
// drive: `bytes` read from `src` and written to a new file in `dir` at once (read of chunk c in
// flight with the write of chunk c-1, 4 slots), no checksums.
Result<double> time_plain_copy(io::IoEngine& io, const std::string& src, const std::string& dir, uint64_t bytes,
                               std::span<std::byte> buf) {
  const std::string path = dir + "/zoffload-bench-ckpt-copy." + std::to_string(::getpid()) + ".dat";
  ZO_ASSIGN_OR_RETURN(io::File in, io::Env::posix()->open_file(src, io::OpenMode::kRead, /*direct=*/true));
  ZO_ASSIGN_OR_RETURN(io::File out, io::Env::posix()->open_file(path, io::OpenMode::kCreateNew, /*direct=*/true));
  const uint64_t slot = buf.size() / 4 / kDirectIoAlignment * kDirectIoAlignment;
  const uint64_t n_chunks = (bytes + slot - 1) / slot;
  std::vector<std::optional<io::Ticket>> rt(4), wt(4);
  auto wait = [&](std::optional<io::Ticket>& t) -> Status {
    if (!t) return Status::ok();
    const io::Ticket k = *t;
    t.reset();
    return io.wait(k);
  };
  const auto t0 = Clock::now();
  Status s;
  for (uint64_t c = 0; c <= n_chunks && s.is_ok(); ++c) {
    if (c < n_chunks) {
      const uint32_t k = c % 4;
      s = wait(wt[k]);
      if (!s.is_ok()) break;
      auto t = io.submit(io::read_request(in, c * slot, buf.data() + k * slot, slot));
      if (!t.is_ok()) {
        s = t.status();
        break;
      }
      rt[k] = *t;
    }
    if (c >= 1) {
      const uint32_t k = (c - 1) % 4;
      s = wait(rt[k]);
      if (!s.is_ok()) break;
      auto t = io.submit(io::write_request(out, (c - 1) * slot, buf.data() + k * slot, slot));
      if (!t.is_ok()) {
        s = t.status();
        break;
      }
      wt[k] = *t;
    }
  }
  for (uint32_t k = 0; k < 4; ++k) {
    Status r = wait(rt[k]), w = wait(wt[k]);
    if (s.is_ok()) s = !r.is_ok() ? std::move(r) : std::move(w);
  }
  if (s.is_ok()) s = out.sync();
  const double secs = since(t0);
  (void)out.close();
  fs::remove(path);
  if (!s.is_ok()) return s;
  return secs;
}

// The value the benchmark fills element i of a state with.
float fill_value(uint64_t i, StateKind kind) {
  return static_cast<float>(i % 1000003) * 1e-6f + static_cast<float>(kind);
}

int run_ckpt_bench(const CkptArgs& a) {
  const BenchError usage{"ckpt", 2}, failure{"ckpt", 1};
  const auto n_total = parse_count(a.params);
  if (!n_total.is_ok() || *n_total == 0)
    return usage("--params: expected a positive count like 1.1e9, got '" + a.params + "'");
  const auto per_param = parse_count(a.param_elems);
  if (!per_param.is_ok() || *per_param == 0) return usage("--param-elems: expected a positive count");
  const auto sgs = parse_count(a.sub_group_size);
  if (!sgs.is_ok() || *sgs == 0) return usage("--sub-group-size: expected a positive count");
  const auto staging_bytes = parse_size_bytes(a.staging);
  if (!staging_bytes.is_ok()) return usage("--staging: expected a size like 256MiB, got '" + a.staging + "'");
  if (Status st = engine::check_staging_bytes(*staging_bytes, "--staging " + a.staging); !st.is_ok())
    return usage(st.message());
  if (a.nvme_path.empty()) return usage("--nvme-path DIR is required: a directory on the drive to measure");

  nlohmann::json j = {{"train_micro_batch_size_per_gpu", 1},
                      {"bf16", {{"enabled", true}}},
                      {"zero_optimization",
                       {{"stage", 3},
                        {"sub_group_size", *sgs},
                        {"offload_optimizer", {{"device", "nvme"}, {"nvme_path", a.nvme_path}}},
                        {"offload_param", {{"device", "cpu"}}}}},
                      {"zoffload", {{"device", "host"}}}};
  engine::ConfigDiagnostics diag;
  std::optional<engine::Config> config = engine::parse_config_json(j, engine::ResolveContext{}, &diag);
  if (!config) return usage(diag.errors.empty() ? "bad config" : diag.errors.front().to_string());

  std::vector<ParamSpec> specs;
  for (uint64_t done = 0, i = 0; done < *n_total; ++i) {
    const uint64_t n = std::min(*per_param, *n_total - done);
    specs.push_back({"model.layers." + std::to_string(i) + ".weight", {static_cast<int64_t>(n)}});
    done += n;
  }
  auto reg = engine::ParamRegistry::build(std::move(specs), config->zero.sub_group_size);
  if (!reg.is_ok()) return usage(reg.status().to_string());
  auto plan = engine::plan_memory(*config, *reg);
  if (!plan.is_ok()) return usage(plan.status().to_string());
  const uint64_t state_bytes = reg->total_elems() * 4 * 3;
  {
    struct statvfs sv {};
    if (::statvfs(a.nvme_path.c_str(), &sv) == 0) {
      const uint64_t free_bytes = static_cast<uint64_t>(sv.f_bavail) * sv.f_frsize;
      const uint64_t need = plan->nvme_optimizer_bytes + 2 * state_bytes;
      if (free_bytes < need)
        return failure(a.nvme_path + ": needs " + format_bytes(need) + " (swap files, one checkpoint, the baseline), " +
                       format_bytes(free_bytes) + " free");
    }
  }

  auto io_options = engine::io_options_from_config(*config);
  if (!io_options.is_ok()) return failure(io_options.status().to_string());
  auto io = io::IoEngine::create(*io_options);
  if (!io.is_ok()) return failure(io.status().to_string());
  auto device = gpu::make_device(gpu::DeviceKind::kHost, uint64_t{1} << 30);
  if (!device.is_ok()) return failure(device.status().to_string());
  engine::MemoryAccounting accounting;
  engine::StateStoreOptions so;
  so.optimizer_nvme_path = a.nvme_path;
  so.env = io::Env::posix();
  auto store = engine::StateStore::create(*reg, *plan, **device, **io, so, accounting);
  if (!store.is_ok()) return failure(store.status().to_string());

  if (!a.json) {
    std::printf(
        "zoffload-bench ckpt: %s params, %s of fp32 states (master, exp_avg, exp_avg_sq) on NVMe in %zu "
        "sub-groups; staging %s; I/O %s\n",
        a.params.c_str(), format_bytes(state_bytes).c_str(), reg->sub_groups().size(), a.staging.c_str(),
        std::string(io::backend_name((*io)->backend())).c_str());
    std::fflush(stdout);
  }
  // Fill every state on disk with distinct values (a never-written state would read as zeros
  // without touching the drive, see Note [Zero watermark]).
  const auto t_fill = Clock::now();
  {
    auto buf = AlignedBuffer::allocate(uint64_t{64} << 20);
    if (!buf.is_ok()) return failure(buf.status().to_string());
    auto floats = buf->as<float>();
    for (const engine::SubGroup& g : reg->sub_groups()) {
      for (StateKind kind : {StateKind::kMaster, StateKind::kExpAvg, StateKind::kExpAvgSq}) {
        for (uint64_t e = 0; e < g.n_elems; e += floats.size()) {
          const uint64_t n = std::min<uint64_t>(floats.size(), g.n_elems - e);
          for (uint64_t i = 0; i < n; ++i) floats[i] = fill_value(g.first_elem + e + i, kind);
          Status s = (*store)->write_state_range(g.index, kind, e * 4, buf->bytes().first(n * 4));
          if (!s.is_ok()) return failure(s.to_string());
        }
      }
    }
  }
  const double fill_s = since(t_fill);

  auto staging = AlignedBuffer::allocate(*staging_bytes);
  if (!staging.is_ok()) return failure(staging.status().to_string());
  // Its own names (with the pid), created new and removed on every way out: nothing of the user's
  // under --nvme-path is ever replaced or removed.
  const std::string ckpt_dir = a.nvme_path + "/zoffload-bench-ckpt." + std::to_string(::getpid());
  if (fs::exists(ckpt_dir)) return failure(ckpt_dir + " exists already: remove it, or give another --nvme-path");
  struct RemoveOnExit {
    std::string path;
    ~RemoveOnExit() {
      std::error_code ec;
      fs::remove_all(path, ec);
    }
  } remove_ckpt_dir{ckpt_dir};
  auto baseline = time_plain_write(**io, a.nvme_path, state_bytes, staging->bytes());
  if (!baseline.is_ok()) return failure("baseline write: " + baseline.status().to_string());
  // The swap file holds every state (and the gradients) back to back: copying its first
  // state_bytes moves as many bytes each way as the save.
  const uint64_t copy_slot = staging->size() / 4 / kDirectIoAlignment * kDirectIoAlignment;
  const uint64_t copy_bytes =
      std::min(state_bytes, (*store)->optimizer_file()->capacity_bytes()) / copy_slot * copy_slot;
  auto copy = time_plain_copy(**io, (*store)->optimizer_file()->path(), a.nvme_path, copy_bytes, staging->bytes());
  if (!copy.is_ok()) return failure("baseline copy: " + copy.status().to_string());
  staging = AlignedBuffer();  // the save allocates its own

  engine::TrainingState st;
  st.steps_done = 1;
  st.model = "zoffload-bench ckpt";
  st.config = engine::to_json(*config);
  engine::SaveOptions save_opts;
  save_opts.dir = ckpt_dir;
  save_opts.staging_bytes = *staging_bytes;
  save_opts.env = io::Env::posix();
  const PhaseRss save_phase;
  auto saved = engine::save_checkpoint(**store, st, "{\"model_type\": \"llama\"}", save_opts);
  const int64_t save_rss = save_phase.peak_extra_bytes();
  if (!saved.is_ok()) return failure("save: " + saved.status().to_string());

  auto info = engine::open_checkpoint(saved->path, io::Env::posix());
  if (!info.is_ok()) return failure("open: " + info.status().to_string());
  staging = std::move(AlignedBuffer::allocate(*staging_bytes)).value();
  const auto t_verify = Clock::now();
  Status vs = engine::verify_checkpoint(*info, **io, staging->bytes(), io::Env::posix());
  const double verify_s = since(t_verify);
  if (!vs.is_ok()) return failure("verify: " + vs.to_string());
  const auto t_load = Clock::now();
  Status ls = engine::load_checkpoint(*info, **store, **io, staging->bytes(), io::Env::posix());
  const double load_s = since(t_load);
  if (!ls.is_ok()) return failure("load: " + ls.to_string());
  staging = AlignedBuffer();
  // Correctness before figures: what the load wrote back is what was saved (first and last
  // sub-group of every state, element by element), and the compute copies are the master rounded.
  {
    const auto groups = reg->sub_groups();
    std::vector<float> got;
    for (const engine::SubGroup* g : {&groups.front(), &groups.back()}) {
      got.resize(g->n_elems);
      for (StateKind kind : {StateKind::kMaster, StateKind::kExpAvg, StateKind::kExpAvgSq}) {
        Status rs = (*store)->read_state(g->index, kind, std::as_writable_bytes(std::span(got)));
        if (!rs.is_ok()) return failure("reading back: " + rs.to_string());
        for (uint64_t i = 0; i < g->n_elems; ++i) {
          if (got[i] != fill_value(g->first_elem + i, kind))
            return failure("the loaded checkpoint differs from the saved states: sub-group " +
                           std::to_string(g->index) + " " + std::string(engine::state_name(kind)) + " element " +
                           std::to_string(i));
        }
      }
    }
  }

  engine::ExportOptions eo;
  eo.dtype = DType::kBF16;
  eo.out_dir = ckpt_dir + "/export-bf16";
  eo.staging_bytes = *staging_bytes;
  eo.env = io::Env::posix();
  const PhaseRss export_phase;
  const auto t_export = Clock::now();
  auto exported = engine::export_checkpoint(*info, **io, eo);
  const double export_s = since(t_export);
  const int64_t export_rss = export_phase.peak_extra_bytes();
  if (!exported.is_ok()) return failure("export: " + exported.status().to_string());

  const double save_gbps = gbps(saved->bytes, saved->seconds);
  const double base_gbps = gbps(state_bytes, *baseline);
  const double copy_gbps = gbps(copy_bytes, *copy);
  if (a.json) {
    nlohmann::json out = {{"params", reg->total_elems()},
                          {"state_bytes", state_bytes},
                          {"checkpoint_bytes", saved->bytes},
                          {"staging_bytes", *staging_bytes},
                          {"fill_s", fill_s},
                          {"baseline_write_gbps", base_gbps},
                          {"baseline_copy_gbps", copy_gbps},
                          {"save_vs_copy", copy_gbps > 0 ? save_gbps / copy_gbps : 0.0},
                          {"save_s", saved->seconds},
                          {"save_gbps", save_gbps},
                          {"save_vs_baseline", base_gbps > 0 ? save_gbps / base_gbps : 0.0},
                          {"save_peak_extra_rss_bytes", save_rss},
                          {"verify_gbps", gbps(saved->bytes, verify_s)},
                          {"load_gbps", gbps(saved->bytes, load_s)},
                          {"export_s", export_s},
                          {"export_bytes", exported->tensor_bytes},
                          {"export_read_gbps", gbps(state_bytes / 3, export_s)},
                          {"export_peak_extra_rss_bytes", export_rss}};
    std::cout << out.dump(2) << "\n";
    return 0;
  }
  auto rss = [](int64_t b) { return b >= 0 ? "+" + format_bytes(static_cast<uint64_t>(b)) : std::string("?"); };
  std::printf("  fill (setup)             %7.1f s\n", fill_s);
  std::printf("  baseline: plain write    %7.2f GB/s  (%s, same engine and slots, no reads)\n", base_gbps,
              format_bytes(state_bytes).c_str());
  std::printf("  baseline: plain copy     %7.2f GB/s  (swap file -> new file on the same drive, no checksums)\n",
              copy_gbps);
  std::printf(
      "  save                     %7.2f GB/s  %.1f s, %.2f x write baseline, %.2f x copy baseline, peak RSS %s\n",
      save_gbps, saved->seconds, base_gbps > 0 ? save_gbps / base_gbps : 0.0,
      copy_gbps > 0 ? save_gbps / copy_gbps : 0.0, rss(save_rss).c_str());
  std::printf("  verify                   %7.2f GB/s\n", gbps(saved->bytes, verify_s));
  std::printf("  load (resume)            %7.2f GB/s\n", gbps(saved->bytes, load_s));
  std::printf("  export bf16              %7.2f GB/s of master read, %.1f s, %s written, peak RSS %s\n",
              gbps(state_bytes / 3, export_s), export_s, format_bytes(exported->tensor_bytes).c_str(),
              rss(export_rss).c_str());
  return 0;
}

}  // namespace

void register_bench_ckpt(CLI::App& app, int* exit_code) {
  auto args = std::make_shared<CkptArgs>();
  CLI::App* cmd = app.add_subcommand(
      "ckpt",
      "Checkpoint throughput with the optimizer on NVMe: save (swap files -> staging -> checkpoint files), verify,\n"
      "load and bf16 export, against a plain sequential write of the same bytes by the same I/O engine on the\n"
      "same drive (measured in the same run); prints GB/s, the save/baseline ratio and the peak extra RSS of\n"
      "the save and the export. Needs room for the swap files, one checkpoint and the baseline file.");
  cmd->add_option("--params", args->params, "number of parameters, e.g. 1.1e9")->capture_default_str();
  cmd->add_option("--nvme-path", args->nvme_path, "directory on the drive to measure (swap files, checkpoint)")
      ->required();
  cmd->add_option("--sub-group-size", args->sub_group_size, "zero_optimization.sub_group_size")->capture_default_str();
  cmd->add_option("--param-elems", args->param_elems, "elements per synthetic parameter tensor")->capture_default_str();
  cmd->add_option("--staging", args->staging, "zoffload.checkpoint.staging_buffer_size")->capture_default_str();
  cmd->add_flag("--json", args->json, "print machine-readable results on stdout");
  cmd->callback([args, exit_code] { *exit_code = run_ckpt_bench(*args); });
}

}  // namespace zo::tools

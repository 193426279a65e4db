// `zoffload plan`: what a config needs on this machine and how fast it will go, before anything runs.
#include <CLI/CLI.hpp>

#include <cstdio>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "common/bytes.h"
#include "common/host_info.h"
#include "common/string_util.h"
#include "engine/config/config.h"
#include "engine/model/model_config.h"
#include "engine/model/weights.h"
#include "engine/plan/fixes.h"
#include "engine/plan/lora.h"
#include "engine/plan/planner.h"
#include "gpu/device_info.h"
#include "tools/auto_flags.h"
#include "tools/commands.h"
#include "zo_build_config.h"
#if ZO_HAVE_TORCH
#include "engine/model/torch_runtime.h"
#endif

namespace zo::tools {
namespace {

struct PlanArgs {
  std::string config;
  std::string model;
  std::string out = "zoffload-run";
  std::string io_results;
  uint64_t seq_len = 0;
  uint64_t steps = 0;
  uint32_t ranks = 1;
  AutoFlags flags;
  bool no_measure = false;
  bool json = false;
  // The machine to plan for, when it is not this one (empty / 0: this machine's own).
  std::string host_ram, gpu_memory, disk_free;
  double gpu_tflops = 0, gpu_step_tflops = 0, nvme_read_gbps = 0, nvme_write_gbps = 0;
  double pcie_gbps = 0, host_triad_gbps = 0;  // speeds of the step-time range (Note [Step-time range])
  unsigned cpus = 0;
  bool target() const { return !host_ram.empty() || !gpu_memory.empty() || !disk_free.empty() || cpus != 0; }
};

// --host-ram, --gpu-memory, --gpu-tflops, --cpus, --disk-free, --nvme-read, --nvme-write: the
// machine the user is about to buy or rent, in place of the facts probed here. A target's
// ulimit -l and -v are taken as unlimited (a machine set up for training). Returns a usage error.
std::string gbps_text(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}

std::string apply_target(const PlanArgs& a, engine::PlanInputs* in, std::vector<std::string>* notes) {
  auto size = [](const std::string& flag, const std::string& text, uint64_t* out) -> std::string {
    auto v = parse_size_bytes(text);
    if (!v.is_ok() || *v == 0) return flag + ": expected a size such as 128GiB, got '" + text + "'";
    *out = *v;
    return {};
  };
  engine::HostFacts& h = in->host;
  if (!a.host_ram.empty()) {
    uint64_t ram = 0;
    if (auto e = size("--host-ram", a.host_ram, &ram); !e.empty()) return e;
    h.ram_total_bytes = h.ram_available_bytes = ram;
    h.memlock_limit_bytes = UINT64_MAX;
    h.address_space_limit_bytes = UINT64_MAX;
    notes->push_back("RAM: --host-ram " + format_bytes(ram) +
                     " as MemAvailable, ulimit -l and -v unlimited; the process's own RSS is this machine's");
  }
  if (!a.gpu_memory.empty()) {
    uint64_t gpu = 0;
    if (auto e = size("--gpu-memory", a.gpu_memory, &gpu); !e.empty()) return e;
    h.cuda = true;
    h.device_total_bytes = gpu;
    h.device_name = "a GPU of " + format_bytes(gpu) + " (--gpu-memory)";
  }
  if (a.gpu_tflops > 0) {
    in->speeds.compute_flops = a.gpu_tflops * 1e12;
    in->speeds.compute_source = "--gpu-tflops " + gbps_text(a.gpu_tflops);
  }
  if (a.gpu_step_tflops > 0) {
    if (a.gpu_tflops <= 0 || a.gpu_step_tflops > a.gpu_tflops)
      return "--gpu-step-tflops needs --gpu-tflops, and at most its rate (a step's compute runs below the matmul's)";
    in->speeds.compute_step_flops = a.gpu_step_tflops * 1e12;
    in->speeds.compute_step_source = "--gpu-step-tflops " + gbps_text(a.gpu_step_tflops) + " at the high end";
  }
  if (!a.disk_free.empty()) {
    uint64_t free = 0;
    if (auto e = size("--disk-free", a.disk_free, &free); !e.empty()) return e;
    h.optimizer_disk_free_bytes = h.param_disk_free_bytes = free;
    in->disk_free_given = true;
  }
  if (a.cpus != 0) {
    h.logical_cpus = a.cpus;
    notes->push_back("CPUs: --cpus " + std::to_string(a.cpus) +
                     " for the threads the run starts; the CPU kernels' speeds are this machine's");
  }
  if (a.nvme_read_gbps > 0 || a.nvme_write_gbps > 0) {
    if (a.nvme_read_gbps <= 0 || a.nvme_write_gbps <= 0) return "--nvme-read and --nvme-write go together";
    in->speeds.nvme_read_bytes_per_s = a.nvme_read_gbps * 1e9;
    in->speeds.nvme_write_bytes_per_s = a.nvme_write_gbps * 1e9;
    in->speeds.nvme_source =
        "--nvme-read " + gbps_text(a.nvme_read_gbps) + " GB/s, --nvme-write " + gbps_text(a.nvme_write_gbps) + " GB/s";
  }
  return {};
}

void print_plan(const engine::RunPlan& p, const engine::PlanInputs& in, const std::vector<engine::PlanFix>& fixes,
                const std::string& config_path, bool target) {
  const char* machine = target ? "the machine given (--host-ram, --gpu-memory, ...)" : "this machine";
  const engine::MemoryPlan& mp = p.memory;
  const engine::Placement& pl = mp.placement;
  const engine::LoraConfig& lora = in.config.zoffload.lora;
  const std::string trainable = p.n_trainable == p.n_params ? ""
                                : lora.r > 0                ? " (" + format_count(p.n_trainable) +
                                                   " trainable: LoRA r=" + std::to_string(lora.r) +
                                                   " adapters on the frozen base)"
                                             : " (" + format_count(p.n_trainable) + " trainable, the rest frozen)";
  std::printf(
      "zoffload plan: %s, %.2f B params%s, %llu sub-groups | micro-batch %llu x seq %llu, %llu micro-steps per step\n",
      in.model_name.c_str(), static_cast<double>(p.n_params) / 1e9, trainable.c_str(),
      static_cast<unsigned long long>(mp.n_sub_groups),
      static_cast<unsigned long long>(in.config.train_micro_batch_size_per_gpu),
      static_cast<unsigned long long>(in.seq_len),
      static_cast<unsigned long long>(in.config.gradient_accumulation_steps));
  if (in.world_size > 1) {
    std::printf(
        "data parallel: rank 0 of %u on this node, planned with 1/%u of its RAM and disk%s\n", in.world_size,
        in.world_size,
        mp.partitioned()
            ? (", holding the optimizer states" + std::string(mp.partition_grads ? ", gradient accumulators" : "") +
               (mp.partition_params ? " and compute copies (each block gathered from its owners at fetch)" : "") +
               " of sub-groups " + std::to_string(mp.owned_begin) + "-" + std::to_string(mp.owned_end - 1) +
               " (ZeRO stage " + std::to_string(in.config.zero.stage) + ")")
                  .c_str()
            : " and every state (ZeRO stage 0)");
  }
  std::printf(
      "placement: optimizer states on %s, gradient accumulators %s, compute copies %s, %s compute, %s gradients, "
      "%s masters, %s moments\n",
      std::string(engine::tier_name(pl.optimizer)).c_str(),
      (pl.no_accumulator ? std::string("none (each sub-group stepped from backward)")
                         : "on " + std::string(engine::tier_name(pl.grad)))
          .c_str(),
      std::string(engine::tier_name(pl.compute.empty() ? engine::Tier::kDevice : pl.compute.back())).c_str(),
      std::string(dtype_name(pl.compute_dtype)).c_str(), std::string(dtype_name(pl.grad_dtype)).c_str(),
      std::string(dtype_name(pl.master_dtype)).c_str(), std::string(engine::moment_dtype_name(pl.moments)).c_str());
  std::printf("\nmemory\n");
  std::printf("  device %-22s %10s of budget %s\n", ("(" + in.host.device_name + ")").c_str(),
              format_bytes(p.device_total_bytes).c_str(), format_bytes(p.device_budget_bytes).c_str());
  std::printf("    states                        %10s\n", format_bytes(p.device_state_bytes).c_str());
  std::printf(
      "    coordinator arena             %10s (wants %s: the largest block, prefetch window, persistent params)\n",
      format_bytes(p.device_arena_bytes).c_str(), format_bytes(p.arena.total_bytes()).c_str());
  std::printf("    LibTorch activations          %10s%s\n", format_bytes(p.activation_bytes).c_str(),
              in.host.cuda ? "" : " (in host RAM: the device is emulated)");
  std::printf("  pinned                          %10s (pool %s)\n", format_bytes(p.pinned_bytes).c_str(),
              format_bytes(p.pool_bytes).c_str());
  std::printf("  RAM                             %10s (pool + pageable states %s + buffers %s%s + process %s)\n",
              format_bytes(p.ram_bytes + p.process_bytes).c_str(), format_bytes(p.pageable_state_bytes).c_str(),
              format_bytes(p.host_buffer_bytes).c_str(),
              in.host.cuda ? "" : (" + activations " + format_bytes(p.activation_bytes)).c_str(),
              format_bytes(p.process_bytes).c_str());
  std::printf("  NVMe                            %10s (optimizer file %s, parameter file %s)\n",
              format_bytes(p.nvme_optimizer_bytes + p.nvme_param_bytes).c_str(),
              format_bytes(p.nvme_optimizer_bytes).c_str(), format_bytes(p.nvme_param_bytes).c_str());
  std::printf("  checkpoint save peak RSS        +%9s; export +%s\n", format_bytes(p.save_rss_bytes).c_str(),
              format_bytes(p.export_rss_bytes).c_str());
  std::printf("\nper step\n");
  if (p.nvme_exact) {
    std::printf("  NVMe read %s, written %s (drive wear %s per 1000 steps)\n", format_bytes(p.nvme_read_bytes).c_str(),
                format_bytes(p.nvme_write_bytes).c_str(), format_bytes(p.nvme_write_bytes * 1000).c_str());
  } else {
    std::printf("  NVMe read %s to %s, written %s (drive wear %s per 1000 steps)\n",
                format_bytes(p.nvme_read_min_bytes).c_str(), format_bytes(p.nvme_read_max_bytes).c_str(),
                format_bytes(p.nvme_write_bytes).c_str(), format_bytes(p.nvme_write_bytes * 1000).c_str());
  }
  std::printf("  to the device %s to %s; from it %s\n", format_bytes(p.h2d_min_bytes).c_str(),
              format_bytes(p.h2d_max_bytes).c_str(), format_bytes(p.d2h_bytes).c_str());
  if (!p.time_parts.empty()) {
    std::printf(
        "\nstep time %.2f s (every overlap perfect) to %.2f s (only the schedule's own overlap; docs/plan.md)\n",
        p.step_s_low, p.step_s_high);
    for (const engine::StepTimePart& t : p.time_parts)
      std::printf("  %-11s %6.2f-%6.2f s   %s\n", t.name.c_str(), t.seconds_low, t.seconds, t.basis.c_str());
    if (!p.time_unknown.empty())
      std::printf("  not counted (no measured speed): %s\n", join(p.time_unknown, ", ").c_str());
  }
  for (const std::string& n : p.notes) std::printf("note: %s\n", n.c_str());
  std::printf("\n");
  if (p.fits()) {
    std::printf("fits %s\n", machine);
    return;
  }
  std::printf("does NOT fit %s:\n", machine);
  for (const engine::PlanProblem& pr : p.problems) std::printf("  %s\n", pr.to_string().c_str());
  if (fixes.empty()) {
    std::printf(
        "no change tried makes it fit (one, two or three offload or state changes, or lean states combined): a "
        "smaller model, a shorter sequence or a larger machine\n");
  } else {
    std::printf("changes that make it fit (each accepted by the config checker and planned again):\n");
    for (const engine::PlanFix& f : fixes)
      std::printf("  %s\n    -> %s\n       %s\n       config: %s\n", join(f.changes, "; ").c_str(), f.result.c_str(),
                  f.trade.c_str(), f.config_json.c_str());
    std::printf("(merge a fix's config keys into %s; `zoffload config check` validates the result)\n",
                config_path.c_str());
  }
}

int run_plan(const PlanArgs& a) {
  auto model = engine::resolve_model_config(a.model, io::Env::posix());
  if (!model.is_ok()) return command_error("zoffload plan", model.status().message(), 2);
  // The run trains what transformers loads (Note [A tied head the weights untie]).
  if (auto kind = io::Env::posix()->path_kind(a.model); kind.is_ok() && *kind == io::PathKind::kDirectory) {
    if (Status st = engine::apply_weights_tying(a.model, &*model, io::Env::posix()); !st.is_ok())
      return command_error("zoffload plan", st.message(), 2);
  }
  std::optional<engine::Config> config =
      load_config_with_flags(a.config, model->hidden_size, a.steps, a.flags, a.ranks);
  if (!config) return 2;
  if (Status st = engine::read_peft_adapter_config(*model, &config->zoffload.lora, io::Env::posix()); !st.is_ok())
    return command_error("zoffload plan", st.message(), 2);
  engine::PlanInputs in;
  in.world_size = a.ranks;
  in.config = *config;
  in.model = *model;
  in.model_name = a.model;
  in.seq_len = a.seq_len != 0 ? a.seq_len : std::min<uint64_t>(256, model->max_position_embeddings);
  if (Status st = engine::check_seq_len(*model, in.seq_len); !st.is_ok())
    return command_error("zoffload plan", st.message(), 2);
  in.out_dir = a.out;
  in.host = engine::probe_host(*config, a.out);

  // The device the run would get, as `train` chooses it (docs/gpu.md).
  bool cuda = false;
  if (config->zoffload.device != gpu::DeviceKind::kHost && a.gpu_memory.empty()) {
#if ZO_HAVE_TORCH
    const gpu::GpuProbe probe = engine::probe_usable_gpus();
    cuda = !probe.gpus.empty();
#else
    gpu::GpuProbe probe = gpu::probe_gpus();
    probe.reason = "zoffload was built without LibTorch";
#endif
    if (cuda) {
      in.host.cuda = true;
      in.host.device_name = probe.gpus.front().name;
      in.host.device_total_bytes = probe.gpus.front().total_bytes;
    } else if (config->zoffload.device == gpu::DeviceKind::kCuda) {
      return command_error("zoffload plan",
                           "zoffload.device is cuda but no usable GPU is here" +
                               (probe.reason.empty() ? std::string() : " (" + probe.reason + ")"),
                           1);
    }
  }
  // The target machine, when one is given, replaces what was probed (and the GPU found here).
  std::vector<std::string> target_notes;
  if (a.target() || a.gpu_tflops > 0 || a.gpu_step_tflops > 0 || a.nvme_read_gbps > 0 || a.nvme_write_gbps > 0) {
    if (a.gpu_tflops > 0 && a.gpu_memory.empty())
      return command_error("zoffload plan", "--gpu-tflops needs --gpu-memory", 2);
    if (!a.io_results.empty() && (a.nvme_read_gbps > 0 || a.nvme_write_gbps > 0))
      return command_error("zoffload plan", "--io-results and --nvme-read/--nvme-write: give one", 2);
    if (std::string e = apply_target(a, &in, &target_notes); !e.empty()) return command_error("zoffload plan", e, 2);
    cuda = in.host.cuda;
  }
  // --ranks: one of that many ranks started on this node, as `train` plans each (rank 0; the
  // partitions differ by at most 4096 elements).
  engine::share_host(&in.host, a.ranks);
  in.device_budget_bytes =
      config->zoffload.gpu_memory_limit != 0 ? config->zoffload.gpu_memory_limit : in.host.device_total_bytes;

  if (!a.io_results.empty()) {
    Status st = engine::read_io_results(a.io_results, *config, &in.speeds);
    if (!st.is_ok()) return command_error("zoffload plan", "--io-results: " + st.message(), 2);
  }
  if (!a.no_measure) {
    Status st = engine::measure_cpu_speeds(*config, &in.speeds);
    if (!st.is_ok()) return command_error("zoffload plan", "measuring the CPU kernels: " + st.to_string(), 1);
#if ZO_HAVE_TORCH
    // A target GPU is not here to measure: its speed comes from --gpu-tflops or is left out.
    if (a.gpu_memory.empty()) {
      in.speeds.compute_flops = engine::measure_matmul_flops(config->compute_dtype(), cuda);
      in.speeds.compute_source = std::string("measured: LibTorch ") + std::string(dtype_name(config->compute_dtype())) +
                                 " matmul on " + (cuda ? in.host.device_name : "the host CPU");
    }
#endif
  }
  // Given speeds replace what was measured here (the kernels' own speeds stay this machine's).
  if (a.pcie_gbps > 0) {
    in.speeds.pcie_bytes_per_s = a.pcie_gbps * 1e9;
    in.speeds.pcie_source = "--pcie " + gbps_text(a.pcie_gbps) + " GB/s";
  }
  if (a.host_triad_gbps > 0) {
    // The kernels measured here run on the target at the same fraction of its triad as of this
    // machine's (memory-bound ones exactly so; a compute-bound one, like the 8-bit kernel on a small
    // host, is then slower there than it will be: the low end takes the host's passes at the triad).
    if (const double here = in.speeds.host_triad_bytes_per_s; here > 0) {
      const double f = a.host_triad_gbps * 1e9 / here;
      engine::HostSpeeds& sp = in.speeds;
      for (double* r : {&sp.adam_elems_per_s, &sp.adam8bit_elems_per_s, &sp.adam_bf16_moments_elems_per_s,
                        &sp.bf16_master_elems_per_s[0], &sp.bf16_master_elems_per_s[1], &sp.bf16_master_elems_per_s[2],
                        &sp.accumulate_elems_per_s})
        *r *= f;
      sp.kernels_scaled = true;
      target_notes.push_back("host: the CPU kernels measured here scaled by --host-triad over this machine's triad (" +
                             gbps_text(here / 1e9) + " GB/s)");
    }
    in.speeds.host_triad_bytes_per_s = a.host_triad_gbps * 1e9;
    in.speeds.host_triad_source = "--host-triad " + gbps_text(a.host_triad_gbps) + " GB/s";
  }
  auto plan = engine::plan_run(in);
  if (!plan.is_ok()) {
    const Status& s = plan.status();
    return command_error("zoffload plan", s.to_string(), s.code() == StatusCode::kInvalidArgument ? 2 : 1);
  }
  for (const std::string& n : target_notes) plan->notes.push_back("target machine: " + n);
  const std::vector<engine::PlanFix> fixes = engine::suggest_fixes(in);
  if (a.json) {
    nlohmann::ordered_json j = nlohmann::ordered_json::parse(plan->to_json());
    j["model"] = a.model;
    j["ranks"] = a.ranks;
    j["seq_len"] = in.seq_len;
    j["device_name"] = in.host.device_name;
    j["host"]["ram_available_bytes"] = in.host.ram_available_bytes;
    j["host"]["memlock_limit_bytes"] = in.host.memlock_limit_bytes;
    j["target"] = a.target();
    j["speeds"] = {{"nvme_read_bytes_per_s", in.speeds.nvme_read_bytes_per_s},
                   {"nvme_write_bytes_per_s", in.speeds.nvme_write_bytes_per_s},
                   {"adam_elems_per_s", in.speeds.adam_elems_per_s},
                   {"adam8bit_elems_per_s", in.speeds.adam8bit_elems_per_s},
                   {"adam_bf16_moments_elems_per_s", in.speeds.adam_bf16_moments_elems_per_s},
                   {"bf16_master_elems_per_s",
                    {{"fp32_moments", in.speeds.bf16_master_elems_per_s[0]},
                     {"bf16_moments", in.speeds.bf16_master_elems_per_s[1]},
                     {"8bit_moments", in.speeds.bf16_master_elems_per_s[2]}}},
                   {"accumulate_elems_per_s", in.speeds.accumulate_elems_per_s},
                   {"compute_flops", in.speeds.compute_flops},
                   {"compute_step_flops", in.speeds.compute_step_flops},
                   {"pcie_bytes_per_s", in.speeds.pcie_bytes_per_s},
                   {"host_triad_bytes_per_s", in.speeds.host_triad_bytes_per_s}};
    nlohmann::ordered_json fx = nlohmann::ordered_json::array();
    for (const engine::PlanFix& f : fixes)
      fx.push_back({{"changes", f.changes},
                    {"result", f.result},
                    {"trade", f.trade},
                    {"config", nlohmann::ordered_json::parse(f.config_json.empty() ? "{}" : f.config_json)}});
    j["fixes"] = fx;
    std::cout << j.dump(2) << "\n";
  } else {
    print_plan(*plan, in, fixes, a.config, a.target() || a.gpu_tflops > 0);
    if (in.speeds.nvme_read_bytes_per_s == 0 && plan->nvme_read_min_bytes + plan->nvme_write_bytes > 0)
      std::printf(
          "(for NVMe time: zoffload-bench io --file <nvme_path>/bench.dat --json > io.json, then --io-results "
          "io.json)\n");
  }
  return plan->fits() ? 0 : 3;
}

}  // namespace

void register_plan_command(CLI::App& app, int* exit_code) {
  auto args = std::make_shared<PlanArgs>();
  CLI::App* plan = app.add_subcommand(
      "plan",
      "Say, without allocating, what `zoffload train` with these arguments needs and whether it fits this\n"
      "machine: bytes per tier (device states, the coordinator's arena, LibTorch activations; pinned;\n"
      "RAM; NVMe), the extra RSS of a checkpoint save and of an export, bytes moved per step (NVMe read\n"
      "and written, drive wear, host<->device), and a step-time range from this host's measured speeds\n"
      "(the Adam and gradient kernels and a LibTorch matmul, measured in about a second; NVMe from\n"
      "--io-results). When it does not fit it lists the config changes that make it fit, each accepted\n"
      "by the config checker and planned again, with the JSON keys to merge into the config: the exact\n"
      "ones (states to NVMe, ...) first, then those that round, least lossy first, and the least lossy\n"
      "combination of lean states (no accumulator, bf16 gradients, bf16 or 8-bit moments, bf16\n"
      "masters) that fits. The figures come from the code the engine allocates with; `train` prints the\n"
      "same plan's summary at start and refuses a plan that does not fit.\n"
      "Exit 0: fits; 3: does not fit; 2: bad config or arguments; 1: other failure.");
  plan->add_option("--config", args->config, "DeepSpeed/zoffload JSON config (see docs/config.md)")->required();
  plan->add_option(
          "--model", args->model,
          "A Hugging Face model directory (its config.json is read, and its weights' lm_head.weight only where "
          "the config ties it) or a preset: " +
              join(engine::model_preset_names(), ", "))
      ->required();
  plan->add_option("--seq-len", args->seq_len,
                   "Tokens per sequence (default: min(256, max_position_embeddings), as train)")
      ->check(whole_number(1));
  plan->add_option("--steps", args->steps, "Training steps: resolves scheduler total_num_steps, as train")
      ->check(whole_number(1));
  plan->add_option("--out", args->out,
                   "The run directory train would use: relative nvme_path resolve against it (default: zoffload-run)");
  plan->add_option("--io-results", args->io_results, "`zoffload-bench io --json` output for the NVMe read/write speed");
  add_auto_flags(plan, &args->flags);
  plan->add_option("--ranks", args->ranks,
                   "Plan one of N data-parallel ranks started on this node (torchrun --nproc-per-node N): each gets "
                   "1/N of its RAM and disk, and at ZeRO stage >= 1 holds 1/N of the optimizer states (default 1)")
      ->check(whole_number(1, 65536));
  const char* target = "The machine to plan for, when not this one";
  plan->add_option("--host-ram", args->host_ram,
                   "The target's RAM as the run may use it (its MemAvailable with nothing else running), e.g. 124GiB; "
                   "its ulimit -l and -v are taken as unlimited")
      ->group(target);
  plan->add_option("--gpu-memory", args->gpu_memory, "The target's GPU memory, e.g. 24GiB (plans a CUDA run)")
      ->group(target);
  plan->add_option("--gpu-tflops", args->gpu_tflops,
                   "The target GPU's dense matmul TFLOP/s in the compute dtype, for the step time (else left out)")
      ->check(finite_number(true))
      ->group(target);
  plan->add_option("--gpu-step-tflops", args->gpu_step_tflops,
                   "The TFLOP/s a measured step's device compute reached on the target GPU (its FLOPs, `plan --json`'s "
                   "step_time.compute_flops, over its device time), for the step time's high end (else --gpu-tflops)")
      ->check(finite_number(true))
      ->group(target);
  plan->add_option("--pcie", args->pcie_gbps,
                   "Host<->GPU copy GB/s each way (zoffload-bench pcie, pinned), for the step time")
      ->check(finite_number(true))
      ->group(target);
  plan->add_option(
          "--host-triad", args->host_triad_gbps,
          "The host's STREAM triad in GB/s on the optimizer's threads (zoffload-bench adam prints it), for the "
          "step time; else measured here")
      ->check(finite_number(true))
      ->group(target);
  plan->add_option("--cpus", args->cpus, "The target's logical CPUs (threads and malloc arenas the run starts)")
      ->check(whole_number(1, 65536))
      ->group(target);
  plan->add_option("--disk-free", args->disk_free, "Free space where the target's nvme_path is, e.g. 2TB")
      ->group(target);
  plan->add_option("--nvme-read", args->nvme_read_gbps, "The target drive's read GB/s (with --nvme-write)")
      ->check(finite_number(true))
      ->group(target);
  plan->add_option("--nvme-write", args->nvme_write_gbps, "The target drive's write GB/s (with --nvme-read)")
      ->check(finite_number(true))
      ->group(target);
  plan->add_flag("--no-measure", args->no_measure, "Do not time the CPU kernels and the matmul (no step-time range)");
  plan->add_flag("--json", args->json, "Print the plan as JSON on stdout");
  plan->callback([args, exit_code] { *exit_code = run_plan(*args); });
}

}  // namespace zo::tools

// Note [Lean combinations]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// A config whose states do not fit the host's RAM has two ways out: move states to a drive (exact,
// paid in NVMe traffic every step) or keep fewer or narrower states (no drive, paid in rounding).
// One lean change alone is often not enough where two or three together are: llama3-8b (8.03 B
// parameters) with `configs/llama8b_24gb_8bit_ram.json` on a host with 60 GiB free holds its bf16
// compute copies (2 B a parameter, in the pinned pool) beside fp32 masters (4), fp32 accumulators
// (4) and 8-bit moments (2 × (1 + 4/256) = 2.03): bf16-stored gradients alone leave 8.03 B a
// parameter of pageable states, bf16 masters alone 6.03 (the master is then the compute copy: 0 B
// of its own), and both 4.03 (30.1 GiB), the only one of the three that fits. A plan that stopped at the first
// fitting single change offered only the optimizer on NVMe.
//
// So the planner also searches the lean changes' combinations. Each change's cost to the numbers,
// least first (docs/memory.md, "What the narrow states cost in quality", held-out loss at 300 steps
// against fp32 AdamW at one seed):
//   0. gradient_accumulators none: no rounding; a step with inf/NaN gradients is applied rather than
//      skipped when bf16.check_grad_overflow was on;
//   1. gradient_store_dtype bf16: each step's fp32 sum rounded once, after its norm (+0.05%);
//   2. moment_dtype bf16: both moments rounded to nearest after every update (−0.13%);
//   3. moment_dtype 8bit: both moments quantized blockwise, as bitsandbytes does (+0.36%);
//   4. master_dtype bf16: the weights themselves kept in bf16, stochastically rounded (+0.69%; +0.14%
//      at a second seed, within what the seed moves).
// A combination is as lossy as its lossiest change, then its next lossiest, and so on: with change
// i as bit i of a mask, that is the order of the masks as numbers, so the search tries the masks
// 1, 2, 3, ... and the first that fits is the least lossy fitting one. It is also minimal: every
// combination of a subset of its changes has a smaller mask, was tried before and did not fit. At
// most 2^5 - 1 = 31 plans (bf16 and 8-bit moments exclude each other: 23 of them apply), each a
// fraction of a second for an 8B model, the same ones in the same order for the same inputs.
//
// Each combination is a config the config checker accepts (refused_keys), with the keys its rules
// ask for with it (the vertical schedule for bf16-stored gradients or no accumulator at GAS > 1),
// and its plan is made again from scratch, so what is offered is what `train` would then run.

#include "engine/plan/fixes.h"

#include <algorithm>
#include <set>
#include <utility>

#include "common/string_util.h"

namespace zo::engine {

std::vector<ConfigChange> lean_state_changes(const Config& base, uint32_t world_size) {
  std::vector<ConfigChange> out;
  const auto& oo = base.zero.offload_optimizer;
  // Note [No accumulator]: the exact change that saves the most RAM (or NVMe traffic), where nothing
  // global is needed before an update (no clipping, no fp16; with ranks, partitioned gradients). It
  // turns off bf16's overflow skip, and with GAS on the horizontal schedule it takes the vertical one
  // (the same sums, in the same order).
  if (oo.device != OffloadDevice::kNone && base.zoffload.gradient_accumulators != "none" &&
      base.gradient_clipping == 0 && !base.fp16.enabled && (world_size <= 1 || base.zero.stage >= 2)) {
    const bool unskip = base.bf16.enabled && base.bf16.check_grad_overflow;
    const bool to_vertical = base.gradient_accumulation_steps > 1 && base.zoffload.schedule != "vertical";
    out.push_back(
        {std::string("zoffload.gradient_accumulators: none") + (unskip ? " and bf16.check_grad_overflow: false" : "") +
             (to_vertical ? " and zoffload.schedule: vertical" : ""),
         [](Config& c) {
           c.zoffload.gradient_accumulators = "none";
           c.bf16.check_grad_overflow = false;
           if (c.gradient_accumulation_steps > 1) c.zoffload.schedule = "vertical";
           return true;
         },
         unskip ? "the same update; a step whose gradients hold inf or NaN is applied instead of skipped" : "",
         /*rounds=*/false});
  }
  const bool adam = base.optimizer.type == OptimizerType::kAdam || base.optimizer.type == OptimizerType::kAdamW;
  // The changes that round: the gradient sums stored in bf16 (2 bytes per parameter less where the
  // accumulators live), bf16 moments (4 bytes less on the optimizer's tier), bitsandbytes' 8-bit
  // moments (6 bytes less), then bf16 masters with stochastic rounding (2 bytes less; all 4 where
  // the compute copies are beside them, in RAM or on the device: Note [A bf16 master is its compute
  // copy]). The moments and masters narrow on every tier, the device's included (its adam_step
  // and adam8bit_step, gpu/optim_kernels.h).
  if (base.grad_accum_dtype == DType::kF32 && base.grad_store_dtype() == DType::kF32 &&
      oo.device != OffloadDevice::kNone && (world_size <= 1 || base.zero.stage >= 2)) {
    // Note [Gradients stored in 16 bits]: one sum per step on the host, so with GAS the vertical schedule.
    const bool to_vertical = base.gradient_accumulation_steps > 1 && base.zoffload.schedule != "vertical";
    out.push_back(
        {std::string("zoffload.gradient_store_dtype: bf16") + (to_vertical ? " and zoffload.schedule: vertical" : ""),
         [](Config& c) {
           c.zoffload.gradient_store_dtype = "bf16";
           if (c.gradient_accumulation_steps > 1) c.zoffload.schedule = "vertical";
           return true;
         },
         "rounds: each step's fp32 gradient sum is stored in bf16 once final; the norm, clipping and "
         "overflow check are the fp32 sum's, and masters, moments and the update stay fp32",
         /*rounds=*/true});
  }
  if (base.zoffload.moment_dtype == "fp32") {
    out.push_back({"zoffload.moment_dtype: bf16",
                   [](Config& c) {
                     c.zoffload.moment_dtype = "bf16";
                     return true;
                   },
                   std::string("rounds: ") +
                       (adam                                          ? "Adam's moments"
                        : base.optimizer.type == OptimizerType::kLion ? "Lion's momentum"
                                                                      : "Adagrad's sum of squares") +
                       " stored in bf16 (rounded to nearest even after each update); masters, gradients and the "
                       "update stay fp32",
                   /*rounds=*/true});
  }
  if (base.zoffload.moment_dtype != "8bit") {
    // DeepSpeed's bf16.bf16_optimizer_states would contradict it: the change says to drop that too.
    const bool ds_key = base.bf16.bf16_optimizer_states;
    out.push_back(
        {std::string("zoffload.moment_dtype: 8bit") + (ds_key ? " and bf16.bf16_optimizer_states: false" : ""),
         [from = base.zoffload.moment_dtype](Config& c) {
           if (c.zoffload.moment_dtype != from) return false;  // the bf16 change came first
           c.zoffload.moment_dtype = "8bit";
           c.bf16.bf16_optimizer_states = false;
           return true;
         },
         std::string("rounds: ") +
             (adam ? "Adam's moments kept as bitsandbytes' AdamW8bit keeps them"
              : base.optimizer.type == OptimizerType::kLion ? "Lion's momentum kept as bitsandbytes' Lion8bit keeps it"
                                                            : "Adagrad's sum of squares kept as bitsandbytes' "
                                                              "Adagrad8bit keeps it") +
             " (a byte per element, an fp32 absmax per 256); masters, gradients and the update stay fp32",
         /*rounds=*/true});
  }
  if (base.zoffload.master_dtype == "fp32" && base.bf16.enabled) {
    out.push_back({"zoffload.master_dtype: bf16",
                   [](Config& c) {
                     c.zoffload.master_dtype = "bf16";
                     return true;
                   },
                   "rounds: no fp32 masters; each update is computed in fp32 and stored in bf16 with seeded "
                   "stochastic rounding (unbiased, so updates below a bf16 ulp still count on average)",
                   /*rounds=*/true});
  }
  return out;
}

namespace {

void diff_into(const nlohmann::json& base, const nlohmann::json& changed, nlohmann::json* out) {
  for (auto it = changed.begin(); it != changed.end(); ++it) {
    const auto was = base.find(it.key());
    if (was != base.end() && was->is_object() && it->is_object()) {
      nlohmann::json inner = nlohmann::json::object();
      diff_into(*was, *it, &inner);
      if (!inner.empty()) (*out)[it.key()] = std::move(inner);
    } else if (was == base.end() || *was != *it) {
      (*out)[it.key()] = *it;
    }
  }
}

// What parse_config_json refuses in `c`, as the resolved config's JSON on `world_size` ranks.
std::vector<ConfigIssue> config_errors(const Config& c, uint32_t world_size) {
  ResolveContext ctx;
  ctx.world_size = world_size;
  ConfigDiagnostics diag;
  (void)parse_config_json(to_json(c), ctx, &diag);
  return std::move(diag.errors);
}

}  // namespace

nlohmann::json changed_keys(const Config& base, const Config& changed) {
  nlohmann::json out = nlohmann::json::object();
  diff_into(to_json(base), to_json(changed), &out);
  return out;
}

std::vector<std::string> refused_keys(const Config& base, const Config& changed, uint32_t world_size) {
  std::set<std::string> seen;
  for (const ConfigIssue& e : config_errors(base, world_size)) seen.insert(e.path);
  std::vector<std::string> out;
  for (const ConfigIssue& e : config_errors(changed, world_size))
    if (seen.insert(e.path).second) out.push_back(e.to_string());
  return out;
}

std::optional<PlanFix> plan_with_changes(const PlanInputs& in, const std::vector<const ConfigChange*>& chosen) {
  PlanInputs next = in;
  std::vector<std::string> names, trades;
  for (const ConfigChange* change : chosen) {
    if (!change->apply(next.config)) return std::nullopt;
    names.push_back(change->change);
    if (!change->trade.empty()) trades.push_back(change->trade);
  }
  if (!refused_keys(in.config, next.config, in.world_size).empty()) return std::nullopt;
  // The disk facts follow the config's paths (unless the user gave them for another machine).
  if (!in.disk_free_given) {
    const HostFacts fresh = probe_host(next.config, next.out_dir);
    next.host.optimizer_disk_free_bytes = fresh.optimizer_disk_free_bytes;
    next.host.param_disk_free_bytes = fresh.param_disk_free_bytes;
  }
  auto r = plan_run(next);
  if (!r.is_ok() || !r->fits()) return std::nullopt;
  return PlanFix{.changes = names,
                 .result = r->summary(),
                 .trade = trades.empty() ? "exact: the same weights bit for bit" : join(trades, "; "),
                 .config_json = changed_keys(in.config, next.config).dump()};
}

std::optional<PlanFix> cheapest_lean_fix(const PlanInputs& in, const std::vector<ConfigChange>& lean) {
  // Note [Lean combinations]: mask order is the order of what a combination costs the numbers.
  const uint64_t n = std::min<size_t>(lean.size(), 16);
  for (uint64_t mask = 1; mask < (uint64_t{1} << n); ++mask) {
    std::vector<const ConfigChange*> chosen;
    for (uint64_t i = 0; i < n; ++i)
      if (mask & (uint64_t{1} << i)) chosen.push_back(&lean[i]);
    if (std::optional<PlanFix> fix = plan_with_changes(in, chosen)) return fix;
  }
  return std::nullopt;
}

namespace {

// Every single change tried, the exact ones first: a name for the user and how it edits the config.
std::vector<ConfigChange> candidates(const Config& base, uint32_t world_size) {
  std::vector<ConfigChange> out;
  auto& oo = base.zero.offload_optimizer;
  auto& op = base.zero.offload_param;
  // The lean-state changes (lean_state_changes), least lossy first: the exact one (no accumulator, the
  // change that saves the most RAM or NVMe traffic) before every placement change, the ones that
  // round after every change that keeps the arithmetic.
  const std::vector<ConfigChange> lean = lean_state_changes(base, world_size);
  for (const ConfigChange& c : lean)
    if (!c.rounds) out.push_back(c);
  if (oo.device != OffloadDevice::kNvme) {
    out.push_back({"zero_optimization.offload_optimizer.device: nvme", [](Config& c) {
                     c.zero.offload_optimizer.device = OffloadDevice::kNvme;
                     if (c.zero.offload_optimizer.nvme_path.empty())
                       c.zero.offload_optimizer.nvme_path = "zoffload-nvme";
                     return true;
                   }});
  }
  if (oo.device == OffloadDevice::kNone) {
    out.push_back({"zero_optimization.offload_optimizer.device: cpu", [](Config& c) {
                     c.zero.offload_optimizer.device = OffloadDevice::kCpu;
                     return true;
                   }});
  }
  if (op.device == OffloadDevice::kNone) {
    out.push_back({"zero_optimization.offload_param.device: cpu", [](Config& c) {
                     if (c.zero.offload_optimizer.device == OffloadDevice::kNone) return false;
                     c.zero.offload_param.device = OffloadDevice::kCpu;
                     return true;
                   }});
  }
  if (op.device != OffloadDevice::kNvme) {
    out.push_back({"zero_optimization.offload_param.device: nvme", [](Config& c) {
                     if (c.zero.offload_optimizer.device == OffloadDevice::kNone) return false;
                     c.zero.offload_param.device = OffloadDevice::kNvme;
                     if (c.zero.offload_param.nvme_path.empty())
                       c.zero.offload_param.nvme_path = c.zero.offload_optimizer.nvme_path.empty()
                                                            ? "zoffload-nvme"
                                                            : c.zero.offload_optimizer.nvme_path;
                     return true;
                   }});
  }
  if (oo.pin_memory || op.pin_memory) {
    out.push_back({"offload_optimizer.pin_memory and offload_param.pin_memory: false", [](Config& c) {
                     c.zero.offload_optimizer.pin_memory = false;
                     c.zero.offload_param.pin_memory = false;
                     return true;
                   }});
  }
  if (op.pin_memory) {  // the CPU compute copies, the only states that are pinned
    out.push_back({"zero_optimization.offload_param.pin_memory: false", [](Config& c) {
                     c.zero.offload_param.pin_memory = false;
                     return true;
                   }});
  }
  if (base.zoffload.pinned_memory_limit != 0) {  // the user's own cap; the RAM and ulimit checks still apply
    out.push_back({"zoffload.pinned_memory_limit: 0 (the pool sized from the plan)", [](Config& c) {
                     c.zoffload.pinned_memory_limit = 0;
                     return true;
                   }});
  }
  if (oo.device == OffloadDevice::kCpu && base.zoffload.gradient_accumulators != "nvme") {
    // Note [Where the gradients wait]: 4 bytes per element of RAM for a read and a write per step.
    out.push_back({"zoffload.gradient_accumulators: nvme", [](Config& c) {
                     if (c.zero.offload_optimizer.device != OffloadDevice::kCpu) return false;
                     c.zoffload.gradient_accumulators = "nvme";
                     if (c.zero.offload_optimizer.nvme_path.empty())
                       c.zero.offload_optimizer.nvme_path =
                           c.zero.offload_param.nvme_path.empty() ? "zoffload-nvme" : c.zero.offload_param.nvme_path;
                     return true;
                   }});
  }
  if (base.zoffload.activation_checkpoints == "device") {  // "auto" moves them when that is what fits
    out.push_back({"zoffload.activation_checkpoints: cpu", [](Config& c) {
                     c.zoffload.activation_checkpoints = "cpu";
                     return true;
                   }});
  }
  for (uint64_t sg : {uint64_t{100'000'000}, uint64_t{25'000'000}, uint64_t{5'000'000}}) {
    if (base.zero.sub_group_size <= sg) continue;
    out.push_back({"zero_optimization.sub_group_size: " + std::to_string(sg),
                   [sg](Config& c) {
                     c.zero.sub_group_size = sg;
                     return true;
                   },
                   "the same update; the gradient norm is summed per sub-group, so a clipped step can differ in "
                   "the last bits"});
  }
  if (base.train_micro_batch_size_per_gpu > 1) {
    const uint64_t mb = base.train_micro_batch_size_per_gpu / 2;
    out.push_back({"train_micro_batch_size_per_gpu: " + std::to_string(mb) + " and gradient_accumulation_steps: " +
                       std::to_string(base.gradient_accumulation_steps * 2) + " (the same batch)",
                   [](Config& c) {
                     c.train_micro_batch_size_per_gpu /= 2;
                     c.gradient_accumulation_steps *= 2;
                     return true;
                   },
                   "the same batch and update; the loss and gradients are summed in another order"});
  }
  for (const ConfigChange& c : lean)
    if (c.rounds) out.push_back(c);
  return out;
}

}  // namespace

std::vector<PlanFix> suggest_fixes(const PlanInputs& in, size_t max_fixes) {
  std::vector<PlanFix> out;
  auto first = plan_run(in);
  if (max_fixes == 0 || !first.is_ok() || first->fits()) return out;
  const std::vector<ConfigChange> cs = candidates(in.config, in.world_size);
  auto try_changes = [&](const std::vector<const ConfigChange*>& chosen) {
    if (std::optional<PlanFix> fix = plan_with_changes(in, chosen)) out.push_back(std::move(*fix));
  };
  for (const ConfigChange& a : cs) {
    if (out.size() >= max_fixes) break;
    try_changes({&a});
  }
  if (out.empty()) {
    for (size_t i = 0; i < cs.size() && out.size() < max_fixes; ++i)
      for (size_t j = i + 1; j < cs.size() && out.size() < max_fixes; ++j) try_changes({&cs[i], &cs[j]});
  }
  if (out.empty()) {
    // Three at once: a placement change with two lean ones, or three of them.
    for (size_t i = 0; i < cs.size() && out.size() < max_fixes; ++i)
      for (size_t j = i + 1; j < cs.size() && out.size() < max_fixes; ++j)
        for (size_t k = j + 1; k < cs.size() && out.size() < max_fixes; ++k) try_changes({&cs[i], &cs[j], &cs[k]});
  }
  // Note [Lean combinations]: the states kept where the config puts them, fewer or narrower, with
  // the least rounding that fits; beside the drive, not instead of it.
  if (std::optional<PlanFix> lean = cheapest_lean_fix(in, lean_state_changes(in.config, in.world_size))) {
    const bool listed =
        std::any_of(out.begin(), out.end(), [&](const PlanFix& f) { return f.changes == lean->changes; });
    if (!listed) {
      if (out.size() >= max_fixes) out.resize(max_fixes - 1);
      out.push_back(std::move(*lean));
    }
  }
  return out;
}

}  // namespace zo::engine

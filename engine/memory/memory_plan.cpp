// Note [Pinned pool sizing]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// All pinned memory comes from one pool allocated at start (PinnedPool), so its size must be known
// before anything is allocated and must not depend on anything but the config and the model.
//
// DeepSpeed sizes its NVMe swap buffers as sub_group_size × buffer_count elements of fp32, whatever
// the real sub-groups are: with the default sub_group_size 1e9 and buffer_count 4 that is ≈16 GB
// pinned for a model whose sub-groups may hold a few hundred million elements, and it is the
// classic reason NVMe offload is OOM-killed where CPU offload is not. Nobody can tell in advance
// how much RAM a config needs.
//
// We size from what exists and from what the pipeline uses:
// - every buffer holds the largest *actual* sub-group (ParamRegistry::max_group_elems), never
//   sub_group_size; so the pool does not grow with the number of sub-groups, only with the size of
//   the largest one;
// - optimizer swap buffers: one for the sub-group being stepped, plus one if reads are pipelined
//   (i+1 is being read) and one if writes are (i−1 is being written): 1 + pipeline_read +
//   pipeline_write, never more than there are sub-groups. buffer_count only has to allow that many;
//   zoffload.optimizer_read_ahead adds that many, to read states under the forward and backward
//   (Note [Reading the states ahead] in engine/memory/optimizer_swapper.cpp);
// - compute staging (optimizer on CPU, compute copy elsewhere): double-buffered, two sub-groups;
// - parameter swap buffers: offload_param.buffer_count whole params (at most the number of params
//   on NVMe), each the largest such param plus two 4 KiB pages, because an O_DIRECT read of a param
//   that starts and ends mid-page is widened to the aligned superset;
// - the gradient landing ring: the largest block's gradients as they leave the device (the
//   planner's grad_ring_bytes; the blocks are the model's, so plan_memory leaves it to the caller).
// Only what crosses PCIe is pinned (state_is_pinned): CPU-resident compute copies (offload_param.
// pin_memory) and the buffers. Masters, moments and gradient accumulators never reach the GPU (the
// optimizer's copy-out goes through the staging buffers, gradients land in the gradient worker's
// ring), so pinning them would only lock RAM: DeepSpeed configs carry pin_memory true for both, and
// an 8B model's 16 bytes per parameter of optimizer states pinned is 120 GiB no host can lock.
// Swap and staging buffers live in the pool, which is pinned unless both pin_memory flags are false:
// they are the source and target of O_DIRECT I/O and of device DMA, which is what pinning is for.
// With both flags false the whole pool is pageable — the way out when ulimit -l cannot be raised.
// Each state of each sub-group and each buffer is carved in 4 KiB units (kPinnedAlignment), and the
// plan counts those rounded sizes, so the pool the plan asks for is exactly what is carved.

#include "engine/memory/memory_plan.h"

#include <algorithm>
#include <limits>
#include <tuple>

#include <nlohmann/json.hpp>

#include "common/bytes.h"
#include "common/check.h"
#include "common/string_util.h"
#include "engine/memory/moment_layout.h"
#include "engine/memory/pinned_pool.h"
#include "engine/memory/swap_file.h"

namespace zo::engine {

std::string_view state_name(StateKind kind) {
  switch (kind) {
    case StateKind::kMaster: return "master";
    case StateKind::kExpAvg: return "exp_avg";
    case StateKind::kExpAvgSq: return "exp_avg_sq";
    case StateKind::kGradAccum: return "grad_accum";
    case StateKind::kCompute: return "compute";
  }
  return "unknown";
}

// Note [A bf16 master is its compute copy]
// With bf16 masters the new compute copy is the master's bits (Note [Stochastic rounding to bf16]).
// Where both would live in CPU memory (the optimizer's states on the CPU, the sub-group's compute
// copy offloaded to the CPU) or both on the device (the optimizer on the device, whose compute
// copies are always there) they are one array: the master's location is the compute copy's, in
// the pinned pool when offload_param pins, and the optimizer updates it in place with no copy-out.
// The plan counts its bytes once, as the compute copy. Everything that reads or writes the master
// (a checkpoint's save and load, init_param) reads or writes those bytes, and the values it writes
// to the compute copy as well are the same bf16 values. The forward reads a sub-group's compute
// copy only after its update published it (UpdateGate), as for any compute copy the optimizer
// writes in place. Elsewhere (the optimizer on NVMe, a compute copy on the device or NVMe) the
// master is a bf16 array of its own, swapped with the other optimizer states.
bool master_is_compute_copy(const Placement& placement, uint32_t sub_group) {
  return placement.master_dtype == DType::kBF16 && placement.compute_dtype == DType::kBF16 &&
         (placement.optimizer == Tier::kCpu || placement.optimizer == Tier::kDevice) &&
         sub_group < placement.compute.size() && placement.compute[sub_group] == placement.optimizer;
}

bool state_is_pinned(const Placement& placement, StateKind kind) {
  return kind == StateKind::kCompute && placement.param_pinned;
}

bool pool_is_pinned(const Placement& placement) { return placement.optimizer_pinned || placement.param_pinned; }

std::string_view moment_dtype_name(MomentDtype dtype) {
  switch (dtype) {
    case MomentDtype::kF32: return "fp32";
    case MomentDtype::k8bit: return "8bit";
    case MomentDtype::kBF16: return "bf16";
  }
  return "?";
}

DType moment_elem_dtype(MomentDtype dtype) {
  ZO_CHECK(dtype != MomentDtype::k8bit) << "8-bit moments have no element dtype";
  return dtype == MomentDtype::kBF16 ? DType::kBF16 : DType::kF32;
}

uint64_t state_elem_bytes(const Placement& placement, StateKind kind) {
  switch (kind) {
    case StateKind::kMaster: return dtype_size_bytes(placement.master_dtype);
    case StateKind::kExpAvg:
    case StateKind::kExpAvgSq:
      ZO_CHECK(placement.moments != MomentDtype::k8bit) << "state_elem_bytes of 8-bit " << state_name(kind);
      return dtype_size_bytes(moment_elem_dtype(placement.moments));
    case StateKind::kGradAccum: return dtype_size_bytes(placement.grad_dtype);
    case StateKind::kCompute: return dtype_size_bytes(placement.compute_dtype);
  }
  return 0;
}

uint64_t group_state_bytes(const Placement& placement, const ParamRegistry& registry, uint32_t sub_group,
                           StateKind kind) {
  if (placement.moments == MomentDtype::k8bit && (kind == StateKind::kExpAvg || kind == StateKind::kExpAvgSq))
    return moment_layout(registry, sub_group).total_bytes;
  return registry.sub_groups()[sub_group].n_elems * state_elem_bytes(placement, kind);
}

uint64_t max_group_state_bytes(const Placement& placement, const ParamRegistry& registry, StateKind kind) {
  // Note [Frozen sub-groups]: the optimizer never steps a frozen one.
  if (placement.moments != MomentDtype::k8bit || (kind != StateKind::kExpAvg && kind != StateKind::kExpAvgSq))
    return registry.max_trainable_group_elems() * state_elem_bytes(placement, kind);
  uint64_t most = 0;
  for (const SubGroup& g : registry.sub_groups())
    if (g.trainable) most = std::max(most, group_state_bytes(placement, registry, g.index, kind));
  return most;
}

uint64_t data_parallel_staging_bytes(const MemoryPlan& plan, uint32_t world_size) {
  if (world_size <= 1) return 0;
  uint64_t bytes = 0;
  if (!plan.partition_grads && plan.placement.grad != Tier::kCpu)
    bytes += kDataParallelChunkElems * dtype_size_bytes(plan.placement.grad_dtype);
  if (plan.partitioned() && !plan.partition_params)
    bytes += kDataParallelChunkElems * state_elem_bytes(plan.placement, StateKind::kCompute);
  return bytes;
}

uint64_t MemoryPlan::pinned_pool_bytes() const {
  auto buffers = [](uint32_t count, uint64_t size) { return count * align_up(size, kPinnedAlignment); };
  return align_up(cpu_pinned_bytes, kPinnedAlignment) + buffers(optimizer_swap_buffers, optimizer_swap_buffer_bytes) +
         buffers(compute_staging_buffers, compute_staging_buffer_bytes) +
         buffers(param_swap_buffers, param_swap_buffer_bytes) + align_up(grad_ring_bytes, kPinnedAlignment) +
         buffers(landing_buffers, landing_buffer_bytes) + buffers(gather_slots, gather_slot_bytes);
}

std::string_view accumulator_home(const Placement& placement) {
  return placement.no_accumulator ? std::string_view("none") : tier_name(placement.grad);
}

std::string MemoryPlan::to_json() const {
  uint64_t compute_counts[3] = {0, 0, 0};
  for (Tier t : placement.compute) ++compute_counts[static_cast<int>(t)];
  nlohmann::ordered_json j;
  j["placement"] = {
      {"optimizer", tier_name(placement.optimizer)},
      {"grad", accumulator_home(placement)},
      {"compute", {{"device", compute_counts[0]}, {"cpu", compute_counts[1]}, {"nvme", compute_counts[2]}}},
      {"optimizer_pinned", placement.optimizer_pinned},
      {"param_pinned", placement.param_pinned},
      {"compute_dtype", dtype_name(placement.compute_dtype)},
      {"grad_dtype", dtype_name(placement.grad_dtype)},
      {"grad_sum_dtype", dtype_name(placement.grad_sum_dtype)},
      {"moment_dtype", moment_dtype_name(placement.moments)},
      {"master_dtype", dtype_name(placement.master_dtype)},
  };
  j["n_sub_groups"] = n_sub_groups;
  j["total_elems"] = total_elems;
  j["owned_sub_groups"] = {owned_begin, owned_end};
  j["frozen_sub_groups"] = std::count(frozen.begin(), frozen.end(), uint8_t{1});
  j["partition_grads"] = partition_grads;
  j["partition_params"] = partition_params;
  j["device_bytes"] = device_bytes;
  j["cpu_pinned_bytes"] = cpu_pinned_bytes;
  j["cpu_pageable_bytes"] = cpu_pageable_bytes;
  j["nvme_optimizer_bytes"] = nvme_optimizer_bytes;
  j["nvme_param_bytes"] = nvme_param_bytes;
  j["optimizer_swap_buffers"] = optimizer_swap_buffers;
  j["optimizer_swap_buffer_bytes"] = optimizer_swap_buffer_bytes;
  j["compute_staging_buffers"] = compute_staging_buffers;
  j["compute_staging_buffer_bytes"] = compute_staging_buffer_bytes;
  j["param_swap_buffers"] = param_swap_buffers;
  j["param_swap_buffer_bytes"] = param_swap_buffer_bytes;
  j["grad_read_buffers"] = grad_read_buffers;
  j["grad_read_buffer_bytes"] = grad_read_buffer_bytes;
  j["grad_ring_bytes"] = grad_ring_bytes;
  j["landing_buffers"] = landing_buffers;
  j["landing_buffer_bytes"] = landing_buffer_bytes;
  j["gather_slots"] = gather_slots;
  j["gather_slot_bytes"] = gather_slot_bytes;
  j["pinned_pool_bytes"] = pinned_pool_bytes();
  return j.dump();
}

namespace {

Tier tier_of(OffloadDevice d) {
  switch (d) {
    case OffloadDevice::kNone: return Tier::kDevice;
    case OffloadDevice::kCpu: return Tier::kCpu;
    case OffloadDevice::kNvme: return Tier::kNvme;
  }
  return Tier::kDevice;
}

constexpr StateKind kAllStates[] = {StateKind::kMaster, StateKind::kExpAvg, StateKind::kExpAvgSq, StateKind::kGradAccum,
                                    StateKind::kCompute};
constexpr StateKind kOptimizerRecord[] = {StateKind::kMaster, StateKind::kExpAvg, StateKind::kExpAvgSq,
                                          StateKind::kGradAccum};

}  // namespace

Result<MemoryPlan> plan_memory(const Config& config, const ParamRegistry& registry,
                               std::optional<uint32_t> owned_partition) {
  const OffloadOptimizerConfig& oo = config.zero.offload_optimizer;
  const OffloadParamConfig& op = config.zero.offload_param;
  if (op.device != OffloadDevice::kNone && oo.device == OffloadDevice::kNone) {
    return invalid_argument("zero_optimization.offload_param.device: \"" + std::string(to_string(op.device)) +
                            "\" needs zero_optimization.offload_optimizer.device cpu or nvme: parameters are "
                            "updated where the optimizer runs, and with the optimizer on the device the "
                            "offloaded copies would have to come back every step; offload the optimizer too or "
                            "set offload_param.device none");
  }

  MemoryPlan plan;
  Placement& pl = plan.placement;
  pl.optimizer = tier_of(oo.device);
  pl.grad = pl.optimizer;
  const std::string& grads = config.zoffload.gradient_accumulators;
  if (grads != "auto") {
    if (pl.optimizer == Tier::kDevice) {
      return invalid_argument("zoffload.gradient_accumulators: \"" + grads +
                              "\" needs zero_optimization.offload_optimizer.device cpu or nvme");
    }
    pl.grad = grads == "nvme" ? Tier::kNvme : Tier::kCpu;
    pl.no_accumulator = grads == "none";
  }
  // Note [No accumulator] in engine/coord/grad_accumulator.cpp; the config's other rules (no
  // clipping, no overflow skip) are the resolver's. Checked here too for configs built in code.
  if (pl.no_accumulator && (pl.optimizer == Tier::kDevice || (owned_partition && config.zero.stage < 2) ||
                            (config.gradient_accumulation_steps > 1 && config.zoffload.schedule != "vertical"))) {
    return invalid_argument(
        "zoffload.gradient_accumulators: \"none\" needs the optimizer states offloaded (cpu or nvme), with "
        "several ranks ZeRO stage 2 or 3, and one gradient window per step (GAS 1 or zoffload.schedule "
        "\"vertical\")");
  }
  pl.optimizer_pinned = oo.pin_memory;
  pl.param_pinned = op.pin_memory;
  pl.compute_dtype = config.compute_dtype();
  pl.grad_dtype = config.grad_store_dtype();
  pl.grad_sum_dtype = config.grad_accum_dtype;
  pl.moments = config.zoffload.moment_dtype == "8bit"   ? MomentDtype::k8bit
               : config.zoffload.moment_dtype == "bf16" ? MomentDtype::kBF16
                                                        : MomentDtype::kF32;
  pl.master_dtype = config.zoffload.master_dtype == "bf16" ? DType::kBF16 : DType::kF32;
  pl.optimizer_type = config.optimizer.type;

  const auto groups = registry.sub_groups();
  plan.n_sub_groups = static_cast<uint32_t>(groups.size());
  plan.total_elems = registry.total_elems();
  plan.owned_end = plan.n_sub_groups;
  if (owned_partition) {
    std::tie(plan.owned_begin, plan.owned_end) = registry.partition_groups(*owned_partition);
    plan.partition_grads = plan.partitioned() && config.zero.stage >= 2;
    plan.partition_params = plan.partitioned() && config.zero.stage >= 3;
  }
  // Note [Frozen sub-groups]: a frozen sub-group keeps its compute copy and nothing else.
  if (registry.trainable_elems() != registry.total_elems()) {
    plan.frozen.resize(groups.size());
    for (const SubGroup& g : groups) plan.frozen[g.index] = g.trainable ? 0 : 1;
  }
  for (uint32_t g = plan.owned_begin; g < plan.owned_end; ++g)
    if (plan.steps(g)) plan.stepped.push_back(g);
  const uint32_t owned_groups = static_cast<uint32_t>(plan.stepped.size());
  pl.compute.resize(groups.size(), tier_of(op.device));
  if (op.device == OffloadDevice::kNvme) {
    uint64_t in_cpu = 0;
    for (const SubGroup& g : groups) {
      if (in_cpu + g.n_elems > op.max_in_cpu) break;
      in_cpu += g.n_elems;
      pl.compute[g.index] = Tier::kCpu;
    }
  }

  auto tier_of_state = [&](uint32_t g, StateKind k) {
    if (k == StateKind::kCompute) return pl.compute[g];
    return k == StateKind::kGradAccum ? pl.grad : pl.optimizer;
  };
  auto pinned_state = [&](StateKind k) { return state_is_pinned(pl, k); };

  // Each state of each group is its own section, rounded as the state store carves it.
  for (const SubGroup& g : groups) {
    for (StateKind k : kAllStates) {
      if (!plan.holds(g.index, k)) continue;  // another rank's (Note [Partitions])
      if (k == StateKind::kMaster && master_is_compute_copy(pl, g.index)) continue;  // counted as the compute copy
      const uint64_t raw = group_state_bytes(pl, registry, g.index, k);
      switch (tier_of_state(g.index, k)) {
        case Tier::kDevice: plan.device_bytes += align_up(raw, gpu::kDeviceAlignment); break;
        case Tier::kCpu:
          (pinned_state(k) ? plan.cpu_pinned_bytes : plan.cpu_pageable_bytes) += align_up(raw, kPinnedAlignment);
          break;
        case Tier::kNvme:
          if (k == StateKind::kCompute) {
            plan.nvme_param_bytes += align_up(raw, kSwapAlignment);
          } else {
            plan.nvme_optimizer_bytes += align_up(raw, kSwapAlignment);
          }
          break;
      }
    }
  }

  // Buffers: see Note [Pinned pool sizing]. The optimizer's are for the sub-groups it steps.
  const uint64_t max_group = registry.max_trainable_group_elems();
  const uint64_t compute_bytes = state_elem_bytes(pl, StateKind::kCompute);
  if (pl.optimizer == Tier::kNvme) {
    const uint64_t needed = 1 + uint64_t{oo.pipeline_read} + uint64_t{oo.pipeline_write};
    if (oo.buffer_count < needed) {
      return invalid_argument("zero_optimization.offload_optimizer.buffer_count: " + std::to_string(oo.buffer_count) +
                              " is too few; the optimizer pipeline needs " + std::to_string(needed) +
                              " (1 + pipeline_read + pipeline_write)");
    }
    // Only where something is read ahead (Note [Reading the states ahead]).
    const bool reads_ahead = !pl.no_accumulator && pl.grad != Tier::kNvme;
    const uint64_t ahead = reads_ahead ? std::min<uint64_t>(config.zoffload.optimizer_read_ahead, owned_groups) : 0;
    plan.optimizer_swap_buffers = static_cast<uint32_t>(std::min<uint64_t>(needed + ahead, owned_groups));
    for (StateKind k : kAllStates) {
      if (k == StateKind::kGradAccum && pl.grad != Tier::kNvme) continue;  // read in place
      plan.optimizer_swap_buffer_bytes += align_up(max_group_state_bytes(pl, registry, k), kSwapAlignment);
    }
  }
  if (pl.optimizer == Tier::kCpu && pl.grad == Tier::kNvme) {
    plan.grad_read_buffers = static_cast<uint32_t>(std::min<uint32_t>(2, owned_groups));
    plan.grad_read_buffer_bytes = align_up(max_group * state_elem_bytes(pl, StateKind::kGradAccum), kSwapAlignment);
  }
  bool compute_off_cpu = false;  // of a sub-group the optimizer writes
  for (const SubGroup& g : groups) compute_off_cpu |= g.trainable && pl.compute[g.index] != Tier::kCpu;
  if (pl.optimizer == Tier::kCpu && compute_off_cpu) {
    plan.compute_staging_buffers = static_cast<uint32_t>(std::min<size_t>(
        2, std::count_if(groups.begin(), groups.end(), [](const SubGroup& g) { return g.trainable; })));
    plan.compute_staging_buffer_bytes = align_up(max_group * compute_bytes, kPinnedAlignment);
  }
  uint64_t nvme_params = 0;
  const ParamInfo* largest = nullptr;
  for (const ParamInfo& p : registry.params()) {
    const auto pieces = registry.pieces_of_param(p.id);
    const bool on_nvme = std::any_of(pieces.begin(), pieces.end(), [&](const ParamPiece& piece) {
      return pl.compute[piece.sub_group] == Tier::kNvme;
    });
    if (!on_nvme) continue;
    ++nvme_params;
    if (largest == nullptr || p.n_elems > largest->n_elems) largest = &p;
  }
  // Partitioned parameters are read from their homes by the gatherer, not through swap buffers.
  if (nvme_params > 0 && !plan.partition_params) {
    if (op.buffer_count == 0) {
      return invalid_argument(
          "zero_optimization.offload_param.buffer_count: 0, but parameters on NVMe need at least one "
          "swap buffer");
    }
    if (op.buffer_size < largest->n_elems) {
      return invalid_argument("zero_optimization.offload_param.buffer_size: " + std::to_string(op.buffer_size) +
                              " elements cannot hold parameter " + largest->name + " (" +
                              std::to_string(largest->n_elems) + " elements); raise it to at least " +
                              std::to_string(largest->n_elems));
    }
    plan.param_swap_buffers = static_cast<uint32_t>(std::min(op.buffer_count, nvme_params));
    plan.param_swap_buffer_bytes = align_up(largest->n_elems * compute_bytes, kSwapAlignment) + 2 * kSwapAlignment;
  }
  return plan;
}

}  // namespace zo::engine

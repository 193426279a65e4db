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

#include "engine/memory/param_registry.h"

#include <algorithm>
#include <limits>
#include <tuple>
#include <unordered_set>

#include <nlohmann/json.hpp>

#include "common/bytes.h"
#include "common/check.h"
#include "common/string_util.h"
#include "engine/memory/moment_layout.h"
#include "engine/memory/pinned_pool.h"
#include "engine/memory/swap_file.h"

namespace zo::engine {

// Note [Partitions]
// Data-parallel ranks each own the optimizer states of one partition of the flat parameter space
// (ZeRO stages 1-3, docs/design.md "Scaling out"), as DeepSpeed gives each rank 1/N of the
// flattened parameters. The partitions are contiguous, so each rank's states are one run of every
// checkpoint state file; their boundaries sit near total·r/N, moved to the nearest element a split
// may cut at (a multiple of kSplitAlignElems from the param's start, or its end); and no sub-group
// crosses one, so a rank steps whole sub-groups. A param cut by a boundary starts a sub-group of
// its own, so its pieces stay back to back (the layout rule below). The sub-groups, and with them
// the order of the norm's partial sums, therefore depend on the number of partitions: a
// data-parallel run cuts into one partition per rank whatever its ZeRO stage, so stage 0 and stages
// 1-3 at one world size lay out alike.
// Note [Frozen sub-groups]
// A frozen param (ParamSpec::trainable false: a fine-tune's frozen embedding or layers, a LoRA
// adapter's base weights) is fetched for the forward like any other and never updated, so it needs
// its compute copy and nothing else: no master, no moments, no gradient accumulator, no record in
// the optimizer's swap file. The registry keeps frozen and trainable params in different sub-groups
// (a param whose trainability differs from the open group's closes it, as a param that does not fit
// does), so a sub-group is frozen or trainable whole and every per-sub-group structure stays dense:
// the Adam kernels, the 8-bit moment layout and the swap records never see a hole. With nothing
// frozen the rule never fires and the layout is the one it always was. MemoryPlan::frozen marks the
// frozen sub-groups; holds() is false for their other states, which removes them from the plan's
// bytes, the store's allocation and the swap files in one place; plan.stepped lists the sub-groups
// this rank steps (owned and trainable), which the optimizer's loops walk, and the optimizer's
// buffers are sized for the largest trainable sub-group. The partitions of data-parallel ranks are
// still cut by all elements, so the compute copies, which frozen params dominate, stay balanced.
// Above the store: the gradient accumulator expects no gradient of a frozen param, the update gate
// holds a frozen sub-group final while an update runs (UpdateGate's always_final), the data-parallel
// steps neither reduce nor send one, and the trainer computes no gradient for it (requires_grad
// false) and none below the lowest block that trains. zoffload.freeze makes them. A checkpoint keeps
// their compute copies in frozen.safetensors (engine/ckpt/state_files.h), the trainable sub-groups'
// states in the other files.

namespace {

Result<std::vector<uint64_t>> partition_bounds(const std::vector<ParamInfo>& params, uint64_t total, uint32_t n) {
  if (n == 0) return invalid_argument("parameter registry: 0 partitions");
  std::vector<uint64_t> bounds;
  uint64_t start = 0;
  size_t p = 0;
  for (uint32_t r = 1; r < n; ++r) {
    const auto target = static_cast<uint64_t>(static_cast<unsigned __int128>(total) * r / n);
    while (p < params.size() && start + params[p].n_elems <= target) start += params[p++].n_elems;
    uint64_t b = total;
    if (p < params.size()) {
      const uint64_t offset = (target - start + kSplitAlignElems / 2) / kSplitAlignElems * kSplitAlignElems;
      b = start + std::min(offset, params[p].n_elems);
    }
    if (b >= total || (!bounds.empty() && b <= bounds.back()) || b == 0) {
      return invalid_argument("the model's " + std::to_string(total) + " parameters are too few to partition over " +
                              std::to_string(n) + " data-parallel ranks (a partition ends between two params or " +
                              std::to_string(kSplitAlignElems) + "·k elements into one, and none may be empty)");
    }
    bounds.push_back(b);
  }
  return bounds;
}

}  // namespace

Result<ParamRegistry> ParamRegistry::build(std::vector<ParamSpec> params, uint64_t sub_group_size,
                                           uint32_t n_partitions) {
  if (params.empty()) return invalid_argument("parameter registry: the model has no trainable parameters");
  if (sub_group_size < kSplitAlignElems) {
    return invalid_argument("zero_optimization.sub_group_size: " + std::to_string(sub_group_size) +
                            " elements is below the minimum of " + std::to_string(kSplitAlignElems) +
                            " (pieces of split params are aligned to that many elements)");
  }
  ParamRegistry r;
  r.params_.reserve(params.size());
  std::unordered_set<std::string> names;
  for (size_t i = 0; i < params.size(); ++i) {
    ParamSpec& spec = params[i];
    const std::string label = spec.name.empty() ? "parameter #" + std::to_string(i) : "parameter " + spec.name;
    if (spec.name.empty()) return invalid_argument(label + " has an empty name");
    if (!names.insert(spec.name).second) return invalid_argument(label + " is registered twice");
    uint64_t n = 1;
    for (int64_t d : spec.shape) {
      if (d < 1) return invalid_argument(label + " has a dimension of " + std::to_string(d) + " (each must be ≥ 1)");
      if (n > std::numeric_limits<uint64_t>::max() / static_cast<uint64_t>(d)) {
        return invalid_argument(label + " has too many elements");
      }
      n *= static_cast<uint64_t>(d);
    }
    ParamInfo info;
    info.id = static_cast<uint32_t>(i);
    info.name = std::move(spec.name);
    info.shape = std::move(spec.shape);
    info.n_elems = n;
    info.trainable = spec.trainable;
    r.params_.push_back(std::move(info));
  }
  // Finding 1 of issue 19: a model the plan could never hold must not cost RAM in proportion to its
  // claims: the sub-group table is counted before it is built.
  uint64_t total = 0;
  for (const ParamInfo& p : r.params_) {
    if (__builtin_add_overflow(total, p.n_elems, &total))
      return invalid_argument("the model has more elements than 64 bits count");
  }
  const uint64_t groups_at_least = total / (sub_group_size / kSplitAlignElems * kSplitAlignElems);
  if (groups_at_least > kMaxSubGroups) {
    return invalid_argument("zero_optimization.sub_group_size: " + std::to_string(sub_group_size) +
                            " elements cuts the model's " + std::to_string(total) + " elements into more than " +
                            std::to_string(kMaxSubGroups) + " sub-groups; raise it to at least " +
                            std::to_string(align_up(total / kMaxSubGroups + 1, kSplitAlignElems)));
  }

  // The layout rule (see the header): whole params are packed while they fit; a param that does
  // not fit closes the current group. A param too big for an empty group is cut into pieces of
  // `split` elements, each filling a group of its own, and only its last piece may share a group
  // with the params after it. So every group holding a non-final piece has a multiple of
  // kSplitAlignElems elements, and the pieces of one param sit in consecutive groups back to back:
  // laid out as 4 KiB-aligned per-group regions, a param's compute copy stays contiguous.
  const uint64_t split = sub_group_size / kSplitAlignElems * kSplitAlignElems;
  ZO_ASSIGN_OR_RETURN(const std::vector<uint64_t> bounds, partition_bounds(r.params_, total, n_partitions));
  r.partition_starts_.push_back(0);
  uint64_t flat = 0;
  auto open_group = [&](bool trainable) {
    SubGroup g;
    g.index = static_cast<uint32_t>(r.groups_.size());
    g.first_elem = flat;
    g.first_piece = static_cast<uint32_t>(r.pieces_.size());
    g.trainable = trainable;
    r.groups_.push_back(g);
  };
  auto add_piece = [&](ParamInfo& p, uint64_t param_offset, uint64_t n) {
    SubGroup& g = r.groups_.back();
    r.pieces_.push_back(ParamPiece{p.id, g.index, param_offset, g.n_elems, n});
    ++g.n_pieces;
    ++p.n_pieces;
    g.n_elems += n;
    flat += n;
  };
  // Elements [offset, offset + n) of p, all in one partition.
  // Note [Frozen sub-groups]: a param that differs in trainability from the group's closes it too.
  auto pack = [&](ParamInfo& p, uint64_t offset, uint64_t n, bool fresh_group) {
    if (fresh_group || r.groups_.empty() || r.groups_.back().n_elems + n > sub_group_size ||
        r.groups_.back().trainable != p.trainable)
      open_group(p.trainable);
    if (n <= sub_group_size) {
      add_piece(p, offset, n);
      return;
    }
    // Too big even for the empty group just opened.
    uint64_t done = 0;
    while (n - done > split) {
      if (r.groups_.back().n_elems > 0) open_group(p.trainable);
      add_piece(p, offset + done, split);
      done += split;
    }
    open_group(p.trainable);
    add_piece(p, offset + done, n - done);
  };
  size_t next_bound = 0;
  for (ParamInfo& p : r.params_) {
    p.first_piece = static_cast<uint32_t>(r.pieces_.size());
    const uint64_t start = flat;
    const bool cut = next_bound < bounds.size() && bounds[next_bound] > start && bounds[next_bound] < start + p.n_elems;
    uint64_t done = 0;
    while (done < p.n_elems) {
      bool fresh = cut && done == 0;  // a param cut by a partition starts its own group (contiguity, above)
      if (next_bound < bounds.size() && bounds[next_bound] == flat) {
        r.partition_starts_.push_back(static_cast<uint32_t>(r.groups_.size()));
        ++next_bound;
        fresh = true;
      }
      uint64_t end = p.n_elems;
      if (next_bound < bounds.size() && bounds[next_bound] < start + p.n_elems) end = bounds[next_bound] - start;
      pack(p, done, end - done, fresh);
      done = end;
    }
  }
  ZO_CHECK_EQ(r.partition_starts_.size(), uint64_t{n_partitions}) << "partition bounds not all reached";
  for (const SubGroup& g : r.groups_) {
    ZO_CHECK(g.n_elems > 0 && g.n_elems <= sub_group_size) << "sub-group " << g.index << " has " << g.n_elems;
    r.max_group_elems_ = std::max(r.max_group_elems_, g.n_elems);
    if (!g.trainable) continue;
    r.max_trainable_group_elems_ = std::max(r.max_trainable_group_elems_, g.n_elems);
    r.trainable_elems_ += g.n_elems;
  }
  for (const ParamInfo& p : r.params_) r.max_param_elems_ = std::max(r.max_param_elems_, p.n_elems);
  r.total_elems_ = flat;
  return r;
}

std::pair<uint32_t, uint32_t> ParamRegistry::partition_groups(uint32_t partition) const {
  ZO_CHECK_LT(partition, partition_starts_.size());
  const uint32_t end = partition + 1 < partition_starts_.size() ? partition_starts_[partition + 1]
                                                                : static_cast<uint32_t>(groups_.size());
  return {partition_starts_[partition], end};
}

uint32_t ParamRegistry::partition_of_group(uint32_t sub_group) const {
  ZO_CHECK_LT(sub_group, groups_.size());
  const auto it = std::upper_bound(partition_starts_.begin(), partition_starts_.end(), sub_group);
  return static_cast<uint32_t>(it - partition_starts_.begin()) - 1;
}

std::span<const ParamPiece> ParamRegistry::pieces_of_param(uint32_t param) const {
  ZO_CHECK_LT(param, params_.size());
  const ParamInfo& p = params_[param];
  return std::span<const ParamPiece>(pieces_).subspan(p.first_piece, p.n_pieces);
}

std::span<const ParamPiece> ParamRegistry::pieces_of_group(uint32_t sub_group) const {
  ZO_CHECK_LT(sub_group, groups_.size());
  const SubGroup& g = groups_[sub_group];
  return std::span<const ParamPiece>(pieces_).subspan(g.first_piece, g.n_pieces);
}

Result<uint32_t> ParamRegistry::find(const std::string& name) const {
  for (const ParamInfo& p : params_) {
    if (p.name == name) return p.id;
  }
  std::vector<std::string> names;
  names.reserve(params_.size());
  for (const ParamInfo& p : params_) names.push_back(p.name);
  std::string msg = "no parameter named \"" + name + "\"";
  const std::string close = closest_match(name, names);
  if (!close.empty()) msg += " (did you mean \"" + close + "\"?)";
  return not_found(msg);
}

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

// MemoryPlan: where each state of each sub-group lives (the tiers of Placement, from the config)
// and how many bytes every tier and every pinned buffer needs — computed from the config and the
// registry before anything is allocated, so an impossible configuration fails at start with
// numbers. One of the three plans (docs/design.md "Planning"): the run's (engine/plan) asks it
// what the states cost; the coordinator's arena (engine/coord/fetch_schedule.h) sizes the device
// side. Immutable; thread-safe to read.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "common/dtype.h"
#include "common/status.h"
#include "engine/config/config.h"
#include "engine/memory/accounting.h"
#include "engine/memory/param_registry.h"

namespace zo::engine {

// The states of a sub-group.
enum class StateKind : uint8_t { kMaster = 0, kExpAvg = 1, kExpAvgSq = 2, kGradAccum = 3, kCompute = 4 };
inline constexpr int kNumStateKinds = 5;
std::string_view state_name(StateKind kind);  // "master", "exp_avg", "exp_avg_sq", "grad_accum", "compute"

// How Adam's moments are stored (zoffload.moment_dtype): fp32, 8-bit blockwise in the layout of
// engine/memory/moment_layout.h, or bf16 (two bytes per element, like fp32's layout).
enum class MomentDtype : uint8_t { kF32 = 0, k8bit = 1, kBF16 = 2 };
std::string_view moment_dtype_name(MomentDtype dtype);  // "fp32", "8bit", "bf16": the config's spelling
// The dtype of a moment's elements when it has one (fp32, bf16); not for 8-bit moments.
DType moment_elem_dtype(MomentDtype dtype);

// Where the states live (from zero_optimization.offload_optimizer / offload_param) and their dtypes.
struct Placement {
  Tier optimizer = Tier::kDevice;  // master, exp_avg, exp_avg_sq
  Tier grad = Tier::kDevice;       // gradient accumulator: with the optimizer (device / cpu / nvme)
  // The compute copy, per sub-group: offload_param.device, except that with nvme the first
  // sub-groups whose elements total at most offload_param.max_in_cpu stay on the CPU.
  std::vector<Tier> compute;
  bool optimizer_pinned = true;  // offload_optimizer.pin_memory (its buffers; the states never cross PCIe)
  bool param_pinned = true;      // offload_param.pin_memory
  DType compute_dtype = DType::kF32;
  DType grad_dtype = DType::kF32;      // the accumulators as stored (zoffload.gradient_store_dtype)
  DType grad_sum_dtype = DType::kF32;  // the sums as added (data_types.grad_accum_dtype)
  // Whether the gradient sums are stored rounded to a narrower dtype once final (Note [Gradients
  // stored in 16 bits] in engine/coord/grad_accumulator.cpp).
  bool grads_rounded() const { return grad_dtype != grad_sum_dtype; }
  MomentDtype moments = MomentDtype::kF32;  // exp_avg and exp_avg_sq
  // The masters (zoffload.master_dtype): fp32, or bf16 updated with stochastic rounding (then the
  // compute dtype is bf16 and each new compute copy is its master's bits; Note [Stochastic
  // rounding to bf16] in common/half.h).
  DType master_dtype = DType::kF32;
  // zoffload.gradient_accumulators "none": no accumulator at all. Each sub-group's gradient is summed
  // in a host buffer until final and handed to the optimizer there (Note [No accumulator] in
  // engine/coord/grad_accumulator.cpp); `grad` is then kCpu, where those buffers are.
  bool no_accumulator = false;
  // optimizer.type: which state an 8-bit layout holds in each region and the map its codes index
  // (quant_map in moment_layout.h; Note [One moment for Adagrad and Lion]).
  OptimizerType optimizer_type = OptimizerType::kAdamW;
};

// Where the gradient accumulators live: the tier's name, or "none" (Placement::no_accumulator).
std::string_view accumulator_home(const Placement& placement);

// Whether sub-group g's master is its compute copy (Note [A bf16 master is its compute copy] in
// memory_plan.cpp): bf16 masters and bf16 compute copies both in CPU memory, or both on the
// device. The master then has no bytes of its own; the store points it at the compute copy.
bool master_is_compute_copy(const Placement& placement, uint32_t sub_group);

// Bytes per element of each state, from its dtype (bf16 moments: 2). Not for the moments when they
// are 8-bit (their bytes are not a multiple of the elements): group_state_bytes.
uint64_t state_elem_bytes(const Placement& placement, StateKind kind);
// The bytes of state `kind` of one sub-group: n_elems × state_elem_bytes, or for 8-bit moments their
// MomentLayout's total_bytes. What the store allocates and read_state/write_state move.
uint64_t group_state_bytes(const Placement& placement, const ParamRegistry& registry, uint32_t sub_group,
                           StateKind kind);
// The largest group_state_bytes of `kind` over the sub-groups the optimizer steps, the trainable
// ones (what one optimizer swap buffer section holds).
uint64_t max_group_state_bytes(const Placement& placement, const ParamRegistry& registry, StateKind kind);
// Whether a CPU-resident state of this kind is pinned: only the compute copy, and only with
// offload_param.pin_memory — the other states never cross PCIe (Note [Pinned pool sizing]).
bool state_is_pinned(const Placement& placement, StateKind kind);
// Whether the pinned pool (the pinned states and every swap and staging buffer) is page-locked:
// unless both pin_memory flags are false.
bool pool_is_pinned(const Placement& placement);

// Every byte the states of this rank need, per tier and per pinned buffer. See
// Note [Pinned pool sizing] in memory_plan.cpp for how the buffers are sized.
struct MemoryPlan {
  Placement placement;
  uint32_t n_sub_groups = 0;
  uint64_t total_elems = 0;
  // The sub-groups [owned_begin, owned_end) whose optimizer states (master and moments) this rank
  // holds and steps: all of them, or one partition of a data-parallel run (Note [Partitions]). The
  // gradient accumulators and compute copies exist for every sub-group, unless partitioned below.
  uint32_t owned_begin = 0;
  uint32_t owned_end = 0;
  bool owns(uint32_t sub_group) const { return sub_group >= owned_begin && sub_group < owned_end; }
  bool partitioned() const { return owned_begin != 0 || owned_end != n_sub_groups; }
  // ZeRO stage ≥ 2 with a partition: the gradient accumulators too exist only for the owned
  // sub-groups (each micro-step's gradients are reduced to their owner as they are produced).
  bool partition_grads = false;
  // ZeRO stage 3 with a partition: the compute copies too exist only for the owned sub-groups; the
  // stage-3 coordinator gathers each block's from their owners when it fetches the block
  // (Note [Gathered parameters] in block_gatherer.cpp).
  bool partition_params = false;
  // Per sub-group: 1 where its params are frozen (SubGroup::trainable false; Note [Frozen
  // sub-groups] in param_registry.cpp): it holds its compute copy only, and is never stepped.
  // Empty: nothing is frozen.
  std::vector<uint8_t> frozen;
  bool is_frozen(uint32_t sub_group) const { return !frozen.empty() && frozen[sub_group] != 0; }
  // Whether this rank steps `sub_group`: it owns it and it is trainable.
  bool steps(uint32_t sub_group) const { return owns(sub_group) && !is_frozen(sub_group); }
  // The sub-groups this rank steps, in order: [owned_begin, owned_end) less the frozen ones.
  std::vector<uint32_t> stepped;
  // Whether this rank holds state `kind` of `sub_group`.
  bool holds(uint32_t sub_group, StateKind kind) const {
    if (kind != StateKind::kCompute && is_frozen(sub_group)) return false;
    if (kind == StateKind::kGradAccum && placement.no_accumulator) return false;
    if (owns(sub_group)) return true;
    if (kind == StateKind::kGradAccum) return !partition_grads;
    if (kind == StateKind::kCompute) return !partition_params;
    return false;
  }

  uint64_t device_bytes = 0;          // states resident on the device (parameters fetched by the
                                      // stage-3 coordinator are budgeted separately)
  uint64_t cpu_pinned_bytes = 0;      // states resident in pinned CPU memory (from the pool)
  uint64_t cpu_pageable_bytes = 0;    // states resident in pageable CPU memory (pin_memory false)
  uint64_t nvme_optimizer_bytes = 0;  // size of the optimizer swap file (states + gradients)
  uint64_t nvme_param_bytes = 0;      // size of the parameter swap file (compute copies)

  // Optimizer swap buffers (optimizer on NVMe): each holds one sub-group's master, exp_avg,
  // exp_avg_sq, gradient and compute sections, each section 4 KiB-aligned.
  // 1 + pipeline_read + pipeline_write + zoffload.optimizer_read_ahead, at most the sub-groups stepped
  uint32_t optimizer_swap_buffers = 0;
  uint64_t optimizer_swap_buffer_bytes = 0;
  // Staging for the new compute copy of a sub-group on its way to the device or NVMe when the
  // optimizer states are not swapped (optimizer on CPU): double-buffered.
  uint32_t compute_staging_buffers = 0;
  uint64_t compute_staging_buffer_bytes = 0;
  // Parameter swap buffers (compute copies on NVMe): offload_param.buffer_count, at most the number
  // of params, each sized for the largest param (at most offload_param.buffer_size elements).
  uint32_t param_swap_buffers = 0;
  uint64_t param_swap_buffer_bytes = 0;
  // Gradient read buffers (accumulators on NVMe, optimizer on the CPU): the optimizer step reads
  // sub-group i+1's accumulator while it updates i. Ordinary memory, not from the pool: they never
  // cross PCIe.
  uint32_t grad_read_buffers = 0;
  uint64_t grad_read_buffer_bytes = 0;
  // The gradient worker's landing ring, where gradients arrive from the device (GradWorker): the
  // largest block's gradients. 0 from plan_memory, which knows no blocks; the planner's
  // plan_memory_with_ring sets it, and the trainer carves it from the pool.
  uint64_t grad_ring_bytes = 0;
  // Without accumulators, unpartitioned, with fp32 sums arriving in fp32: the host buffers where
  // each sub-group is summed, which gradients land in directly (Note [Gradients that land where
  // they are summed] in engine/coord/grad_accumulator.cpp): GradAccumulator::plan_buffers' count
  // and size, in the pool so that copies from the GPU are DMA. 0 from plan_memory; set by the
  // planner's plan_memory_with_ring like the ring, which then carries only the other gradients.
  uint32_t landing_buffers = 0;
  uint64_t landing_buffer_bytes = 0;
  // partition_params: the slots where the coordinator's blocks are gathered from their owners
  // (BlockGatherer), each the largest block's compute copies. 0 from plan_memory, which knows no
  // blocks; set by plan_memory_with_ring like the landing ring, and carved from the pool.
  uint32_t gather_slots = 0;
  uint64_t gather_slot_bytes = 0;

  // cpu_pinned_bytes (when pinned) + every buffer above and the ring, in pool units (kPinnedAlignment).
  uint64_t pinned_pool_bytes() const;
  // One JSON object with every field above and pinned_pool_bytes.
  std::string to_json() const;
};

// Data parallel: gradients and compute copies cross between ranks in chunks of this many elements
// (engine/dist/data_parallel.h), whatever the tier of their state, so the norm's summation order
// (and the weights) do not depend on the tier.
inline constexpr uint64_t kDataParallelChunkElems = uint64_t{1} << 22;
// The host staging the data-parallel steps allocate for states that do not live in host memory: one
// chunk of gradient accumulators where they are summed at the boundary (ZeRO stages 0–1) and are not
// on the CPU, and one chunk of compute copies where the owners send them after the step (stages
// 1–2). 0 with one rank.
uint64_t data_parallel_staging_bytes(const MemoryPlan& plan, uint32_t world_size);

// Derives the placement from `config` and sizes everything for `registry`. The gradient
// accumulators go where zoffload.gradient_accumulators says; "auto" puts them with the optimizer
// states (the planner resolves "auto" against the host first, Note [Where the gradients wait]).
// kInvalidArgument naming the key path when the combination is impossible (offload_param on
// cpu/nvme with the optimizer on the device; accumulators off the device with it there; offload_optimizer.buffer_count below what pipeline_read/pipeline_write need;
// offload_param.buffer_size smaller than the largest param, naming the param). With
// owned_partition, only that partition of the registry's holds optimizer states (MemoryPlan::owns),
// at ZeRO stage ≥ 2 gradient accumulators (MemoryPlan::partition_grads) and at stage 3 compute
// copies (MemoryPlan::partition_params: no parameter swap buffers then, the gather slots instead).
Result<MemoryPlan> plan_memory(const Config& config, const ParamRegistry& registry,
                               std::optional<uint32_t> owned_partition = std::nullopt);

}  // namespace zo::engine

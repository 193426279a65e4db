// Note [Activation estimate]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// LibTorch's memory during a micro-step is the activation checkpoints (each block's input, kept from
// forward to backward), plus, at its peak, one of:
// - the end of a decoder's backward: every gradient of the block's parameters and a few [B,T,H]
//   tensors;
// - the middle of a decoder's backward (the MLP): its recomputed activations, about six [B,T,I]
//   tensors and a few [B,T,H] ones (rms_norm works in fp32 whatever the compute dtype), with part
//   of the block's gradients;
// - the head: the fp32 logits, their log-softmax and its gradient ([B,T,V] fp32 each), or later the
//   lm_head's gradient with the logits' gradient.
// The coefficients below were measured, not derived: a counting wrapper around LibTorch's CPU
// allocator (track_torch_memory) recorded the peak of one step ("torch_peak_bytes" in
// metrics.jsonl) on LibTorch 2.11's CPU kernels for five model shapes (hidden 256–1024, intermediate
// 688–2816, vocabulary 256–8192, MHA and GQA), fp32 and bf16, B·T from 64 to 2048; the largest of
// the four terms is within 9% of every measured peak there (tests/engine/plan checks the presets
// against real runs). On CPUs where LibTorch sends bf16 matmuls to oneDNN (AVX-512 without native
// bf16, e.g. an Ice Lake-class Xeon) its reorders add a few hundred KB the terms do not hold:
// +398/486/603 KB for the tiny preset at B·T 16/32/64, +217 KB at 128. CUDA kernels (cuBLAS workspaces, flash attention) differ: on a GPU this is an
// estimate until it is measured there.

#include "engine/plan/planner.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "common/aligned_buffer.h"
#include "common/bnb4_blob.h"
#include "common/bytes.h"
#include "common/dtype.h"
#include "common/host_info.h"
#include "common/string_util.h"
#include "common/timer.h"
#include "cpu_optim/adam.h"
#include "cpu_optim/adam8bit.h"
#include "cpu_optim/executor.h"
#include "cpu_optim/vector_ops.h"
#include "engine/ckpt/stream_file.h"
#include "engine/coord/block_gatherer.h"
#include "engine/coord/grad_accumulator.h"
#include "engine/memory/pinned_pool.h"
#include "engine/memory/state_store.h"
#include "engine/plan/fixes.h"
#include "engine/plan/lora.h"
#include "engine/memory/swap_file.h"
#include "io/env.h"

namespace zo::engine {
namespace {

namespace fs = std::filesystem;

// Free bytes of the file system holding `path` (its nearest existing ancestor); 0 when unknown.
uint64_t disk_free(const std::string& path) {
  if (path.empty()) return 0;
  io::Env* env = io::Env::posix();
  fs::path p = fs::absolute(path);
  for (Result<io::PathKind> kind = env->path_kind(p.string()); kind.is_ok() && *kind == io::PathKind::kMissing;
       kind = env->path_kind(p.string())) {
    if (p == p.parent_path()) break;
    p = p.parent_path();
  }
  Result<uint64_t> free = env->free_bytes(p.string());
  return free.is_ok() ? *free : 0;
}

// Note [Activation estimate]: bytes per element of each term, measured.
constexpr double kDecEndPerBth = 7.3;      // × B·T·H × compute bytes, with all block gradients
constexpr double kDecMidPerBti = 5.4;      // × B·T·I × compute bytes
constexpr double kDecMidPerBthE = 3.3;     // × B·T·H × compute bytes
constexpr double kDecMidPerBthF32 = 6.0;   // × B·T·H × 4 (rms_norm's fp32)
constexpr double kDecMidGradShare = 0.73;  // of the MLP's gradients
constexpr double kHeadPerBtv = 13.5;       // bytes × B·T·V (fp32 logits, log-softmax, gradient)
constexpr double kHeadGradPerBtvE = 0.8;   // × B·T·V × compute bytes, with the lm_head gradient
constexpr double kHeadGradPerBtvF32 = 0.55;

// `held`: micro-batches whose checkpoints are held at once (GAS with the vertical schedule, else 1);
// `sum_bytes`: bytes per element of the per-block gradient sums the vertical schedule keeps (0: none);
// `ckpts_on_host`: the decoder layers' checkpoints wait on the host (Note [Checkpoints on the CPU]).
uint64_t activation_estimate(const ModelConfig& m, uint64_t micro_batch, uint64_t seq_len, uint64_t e, uint64_t held,
                             uint64_t sum_bytes, bool ckpts_on_host) {
  const double bt = static_cast<double>(micro_batch * seq_len);
  const double h = static_cast<double>(m.hidden_size), inter = static_cast<double>(m.intermediate_size);
  const double v = static_cast<double>(m.vocab_size), de = static_cast<double>(e);
  const double kv_dim = static_cast<double>(m.num_key_value_heads * m.head_dim);
  const double q_dim = static_cast<double>(m.num_attention_heads * m.head_dim);
  // The activation checkpoints: every block's input (the token ids as int64 for the embedding),
  // the targets, and the RoPE tables. With the vertical schedule (Note [Vertical schedule]) every
  // held micro-batch's, the other micro-batches' gradients between blocks, and the summed
  // gradients of the block in backward: derived, not measured like the coefficients. On the host,
  // three per micro-batch stay on the device: a layer's input and output in forward (the input is
  // copied out only after the output exists), the layer in backward and the next one coming back.
  const double n_held = static_cast<double>(held);
  const double on_device = ckpts_on_host ? std::min<double>(3, static_cast<double>(m.num_hidden_layers + 1))
                                         : static_cast<double>(m.num_hidden_layers + 1);
  const double resident = n_held * (on_device * bt * h * de + 2 * bt * 8) + (n_held - 1) * bt * h * de +
                          2.0 * static_cast<double>(seq_len * m.head_dim) * 4;
  const double p_attn = 2 * h * q_dim + 2 * h * kv_dim + 2 * h;
  const double p_mlp = 3 * h * inter;
  const double p_head = v * h + h;
  const double ds = static_cast<double>(sum_bytes);
  const double dec_end = (p_attn + p_mlp) * (de + ds) + bt * h * de * kDecEndPerBth;
  const double dec_mid = bt * (inter * kDecMidPerBti * de + h * (kDecMidPerBthE * de + kDecMidPerBthF32 * 4)) +
                         p_mlp * de * kDecMidGradShare + (p_attn + p_mlp) * ds;
  const double head_a = bt * v * kHeadPerBtv + p_head * ds;
  const double head_b = p_head * (de + ds) + bt * v * (kHeadGradPerBtvE * de + kHeadGradPerBtvF32 * 4);
  return static_cast<uint64_t>(resident + std::max({dec_end, dec_mid, head_a, head_b}));
}

std::string seconds_text(double s) {
  char buf[32];
  std::snprintf(buf, sizeof buf, s < 10 ? "%.2f s" : "%.1f s", s);
  return buf;
}

}  // namespace

Status check_model_size(const ModelConfig& m) {
  constexpr uint64_t kMaxParams = uint64_t{1} << 42;  // 4.4 T parameters: 70 TB of Adam state
  auto mul = [](uint64_t a, uint64_t b, uint64_t* out) { return !__builtin_mul_overflow(a, b, out); };
  auto add = [](uint64_t a, uint64_t b, uint64_t* out) { return !__builtin_add_overflow(a, b, out); };
  const uint64_t h = m.hidden_size, q_dim_heads = m.num_attention_heads, kv_heads = m.num_key_value_heads;
  uint64_t q_dim = 0, kv_dim = 0, t = 0, layer = 0, total = 0, emb = 0;
  bool ok = mul(q_dim_heads, m.head_dim, &q_dim) && mul(kv_heads, m.head_dim, &kv_dim);
  ok = ok && mul(2 * h, q_dim, &layer) && mul(2 * h, kv_dim, &t) && add(layer, t, &layer);
  ok = ok && mul(3 * h, m.intermediate_size, &t) && add(layer, t, &layer) && add(layer, 2 * h, &layer);
  ok = ok && mul(layer, m.num_hidden_layers, &total) && mul(m.vocab_size, h, &emb) && add(total, 2 * emb, &total);
  // Layers and heads are capped on their own: a model of a billion one-wide layers has few
  // parameters but a table entry per tensor (the largest real models have a few hundred layers).
  constexpr uint64_t kMaxLayers = uint64_t{1} << 16, kMaxHeads = uint64_t{1} << 16;
  if (m.num_hidden_layers > kMaxLayers || q_dim_heads > kMaxHeads || kv_heads > kMaxHeads)
    return invalid_argument("the model's config claims " + std::to_string(m.num_hidden_layers) + " layers and " +
                            std::to_string(q_dim_heads) + " attention heads (" + std::to_string(kv_heads) +
                            " key/value heads): more than any plan can hold (at most " + std::to_string(kMaxLayers) +
                            " layers and " + std::to_string(kMaxHeads) + " heads)");
  if (!ok || total > kMaxParams || h > (uint64_t{1} << 20))
    return invalid_argument(
        "the model's config claims " +
        (ok ? std::to_string(total) + " parameters" : std::string("more parameters than 64 bits count")) +
        " (hidden_size " + std::to_string(h) + ", intermediate_size " + std::to_string(m.intermediate_size) +
        ", num_hidden_layers " + std::to_string(m.num_hidden_layers) + ", vocab_size " + std::to_string(m.vocab_size) +
        "): more than any plan can hold (at most " + std::to_string(kMaxParams) + " parameters)");
  return Status::ok();
}

DType grad_transfer_dtype(const Config& c) {
  return vertical_micro_batches(c) > 1 ? c.grad_accum_dtype : c.compute_dtype();
}

void share_host(HostFacts* host, uint32_t local_ranks) {
  if (local_ranks <= 1) return;
  for (uint64_t* share : {&host->ram_total_bytes, &host->ram_available_bytes, &host->optimizer_disk_free_bytes,
                          &host->param_disk_free_bytes})
    *share /= local_ranks;
  if (!host->cuda) host->device_total_bytes /= local_ranks;
}

uint64_t vertical_micro_batches(const Config& c) {
  return c.zoffload.schedule == "vertical" ? c.gradient_accumulation_steps : 1;
}

uint64_t host_checkpoint_bytes_per_micro_batch(const Config& c, const ModelConfig& m, uint64_t seq_len) {
  return c.train_micro_batch_size_per_gpu * seq_len * m.hidden_size * m.num_hidden_layers *
         dtype_size_bytes(c.compute_dtype());
}

Result<ModelLayout> training_layout(ModelConfig* model, const Config& config) {
  if (!config.zoffload.lora.init_from.empty() && config.zoffload.lora.r == 0)
    return internal_error("training_layout: zoffload.lora.init_from is not read yet (read_peft_adapter_config)");
  ZO_ASSIGN_OR_RETURN(model->lora, lora_spec(*model, config.zoffload.lora));
  ModelLayout layout = model_layout(*model);
  // Note [LoRA adapters]: the base is frozen, as PEFT freezes it.
  if (model->lora.r > 0)
    for (ParamSpec& p : layout.params) p.trainable = is_lora_param(p.name);
  ZO_RETURN_IF_ERROR(freeze_params(config.zoffload.freeze, &layout));
  // Note [The packed 4-bit base]: a 4-bit or 8-bit base's frozen decoder projections stay packed (a
  // quantized weight trained in full is read back into the compute dtype at load).
  if (model->quantization.load_in_8bit && config.zoffload.quantize_base != "none")
    return invalid_argument("zoffload.quantize_base is \"" + config.zoffload.quantize_base +
                            "\", but the model is already a bitsandbytes 8-bit checkpoint: leave quantize_base out "
                            "to train over its 8-bit base, or give the 16-bit weights to quantize them");
  if (model->quantization.quantized() || config.zoffload.quantize_base != "none") {
    const uint64_t cb = dtype_size_bytes(config.compute_dtype());
    const uint8_t type = model->quantization.load_in_8bit ? bnb4::kBlobInt8 : 0;  // 4-bit blobs: nf4's size, fp4's
    for (ParamSpec& p : layout.params) {
      if (p.trainable || is_lora_param(p.name) || kept_in_16_bits(p.name, layout.quantization)) continue;
      uint64_t n = 1;
      for (int64_t d : p.shape) n *= static_cast<uint64_t>(d);
      const uint64_t rows = static_cast<uint64_t>(p.shape.front());
      p.storage_elems = bnb4::blob_bytes(type, rows, n / rows) / cb;
    }
  }
  return layout;
}

std::vector<uint32_t> contribution_order(const ModelLayout& layout) {
  std::vector<uint32_t> order;
  for (size_t b = layout.blocks.size(); b-- > 0;)
    for (uint32_t p : layout.blocks[b].params)
      if (layout.params[p].trainable) order.push_back(p);
  return order;
}

uint64_t grad_ring_bytes(const ModelLayout& layout, const ParamRegistry& registry, DType dtype, bool shared_only) {
  std::vector<uint32_t> uses(registry.params().size(), 0);
  for (const BlockSpec& b : layout.blocks)
    for (uint32_t p : b.params) ++uses[p];
  uint64_t most = 0;
  for (const BlockSpec& b : layout.blocks) {
    uint64_t elems = 0;
    for (uint32_t p : b.params)
      if (registry.params()[p].trainable && (!shared_only || uses[p] > 1)) elems += registry.params()[p].n_elems;
    most = std::max(most, elems);
  }
  // A ring no gradient goes through still has one slot: GradWorker needs one.
  return std::max<uint64_t>(most * dtype_size_bytes(dtype), kMinGradRingBytes);
}

Result<MemoryPlan> plan_memory_with_ring(const Config& c, const ParamRegistry& registry, const ModelLayout& layout,
                                         std::optional<uint32_t> owned_partition) {
  ZO_ASSIGN_OR_RETURN(MemoryPlan mp, plan_memory(c, registry, owned_partition));
  // Note [Gradients that land where they are summed] (grad_accumulator.cpp): the sums' buffers in
  // the pool, and only a tied matrix's gradients in the ring.
  const bool in_place = gradients_land_in_place(mp.placement, mp.partition_grads, grad_transfer_dtype(c));
  if (in_place) {
    const GradAccumulator::BufferPlan buffers =
        GradAccumulator::plan_buffers(registry, mp.placement, contribution_order(layout), mp.partition_grads);
    mp.landing_buffers = buffers.count;
    mp.landing_buffer_bytes = buffers.bytes_each;
  }
  mp.grad_ring_bytes = grad_ring_bytes(layout, registry, grad_transfer_dtype(c), in_place);
  if (mp.partition_params) {
    std::vector<std::vector<uint32_t>> blocks;
    for (const BlockSpec& b : layout.blocks) blocks.push_back(b.params);
    mp.gather_slots = BlockGatherer::kDefaultSlots;
    mp.gather_slot_bytes = BlockGatherer::slot_bytes(registry, mp.placement, blocks);
  }
  return mp;
}

std::string prefetch_by_blocks_text(const ArenaPlan& arena, uint64_t configured_bucket_elems) {
  return "by whole blocks, " + format_count(arena.prefetch_bucket_elems) +
         " elements ahead: stage3_prefetch_bucket_size " + format_count(configured_bucket_elems) +
         " cannot hold the largest param (" + format_count(arena.largest_param_elems) + " elements)";
}

std::string resolve_run_path(const std::string& out_dir, const std::string& path) {
  if (path.empty()) return path;
  fs::path p(path);
  if (p.is_absolute() || out_dir.empty()) return p.lexically_normal().string();
  return (fs::path(out_dir) / p).lexically_normal().string();
}

std::string PlanProblem::to_string() const {
  return resource + ": needs " + format_bytes(need_bytes) + ", has " + format_bytes(have_bytes) +
         (detail.empty() ? "" : " (" + detail + ")");
}

namespace {

// What every part of plan_run reads: its inputs and what is derived from them once.
struct PlanBasis {
  const PlanInputs& in;
  const Config& c;
  const ModelConfig& m;
  const ModelLayout& layout;
  const ParamRegistry& registry;
  std::vector<std::vector<uint32_t>> blocks;  // each block's params
  std::vector<uint32_t> contribution_order;   // backward's: the head, the layers n-2..1, the embedding
  uint64_t device_limit = 0;                  // the budget, capped by the GPU's memory
  uint64_t passes = 0;                        // forward and backward passes per step
  uint64_t compute_elem_bytes = 0;
};

// The device: states, the coordinator's arena (what it wants, capped as create() caps it), and
// LibTorch's own memory; where the activation checkpoints wait.
void plan_device(const PlanBasis& b, RunPlan* out) {
  RunPlan& p = *out;
  const Config& c = b.c;
  const MemoryPlan& mp = p.memory;
  p.arena = plan_arena(b.registry, mp.placement, b.blocks, CoordinatorOptions::from_config(c), mp.partition_params);
  p.device_budget_bytes = b.in.device_budget_bytes;
  p.device_state_bytes = mp.device_bytes;
  // Note [The budget holds LibTorch too]: zoffload.gpu_memory_limit (else the device's memory) is
  // the budget for everything zoffload puts on the GPU: the states and the coordinator's arena,
  // which the device's allocator counts, and LibTorch's activations, which it does not. The arena
  // takes what the states and the activations leave (at run time through the coordinator's
  // device_reserve_bytes), down to its minimum: the persistent params and the largest block. On an
  // H200, with the budget compared to the card's 140 GiB rather than to gpu_memory_limit, llama3-8b
  // at micro-batch 8 (vertical, GAS 8) ran with 31.0 GiB of LibTorch beside a 2.8 GiB arena under
  // a "24GiB" limit, and tinyllama-1.1b with 1.01 GiB beside 0.37 GiB under "1GiB".
  const uint64_t left = b.device_limit > mp.device_bytes ? b.device_limit - mp.device_bytes : 0;
  // Note [Checkpoints on the CPU]: "auto" moves the checkpoints to the host where they do not fit
  // on the GPU; on the emulated device activations are in host RAM already.
  auto activations = [&](bool on_host) {
    return activation_estimate(b.m, c.train_micro_batch_size_per_gpu, b.in.seq_len, b.compute_elem_bytes,
                               p.held_micro_batches,
                               p.held_micro_batches > 1 ? dtype_size_bytes(c.grad_accum_dtype) : 0, on_host);
  };
  // With the arena it wants, they go to the host where that is what fits; and where the GPU cannot
  // hold them even beside the arena's minimum (the persistent params and the largest block), they
  // go to the host whenever that needs less (the problem then names the smaller shortfall, and the
  // fixes start from there).
  const uint64_t wanted_fixed = p.device_state_bytes + p.arena.bytes_within(left);
  const uint64_t fixed_min =
      p.device_state_bytes + p.arena.persistent_bytes + p.arena.staging_bytes + p.arena.largest_block_bytes;
  const std::string& where = c.zoffload.activation_checkpoints;
  const bool fits_wanted_on_host = wanted_fixed + activations(true) <= b.device_limit;
  const bool fits_min_on_device = fixed_min + activations(false) <= b.device_limit;
  p.checkpoints_on_host =
      where == "cpu" ||
      (where == "auto" && b.in.host.cuda && b.device_limit > 0 && wanted_fixed + activations(false) > b.device_limit &&
       (fits_wanted_on_host || (!fits_min_on_device && activations(true) < activations(false))));
  p.activation_bytes = activations(p.checkpoints_on_host);
  p.device_torch_reserve_bytes = b.in.host.cuda ? p.activation_bytes : 0;
  p.device_arena_bytes =
      p.arena.bytes_within(left > p.device_torch_reserve_bytes ? left - p.device_torch_reserve_bytes : 0);
  p.checkpoint_host_bytes =
      p.checkpoints_on_host ? p.held_micro_batches * host_checkpoint_bytes_per_micro_batch(c, b.m, b.in.seq_len) : 0;
  p.device_total_bytes = p.device_state_bytes + p.device_arena_bytes + p.device_torch_reserve_bytes;
}

// Host memory: the pool (pinned or not), pageable states, buffers, checkpoints, the swap files, and
// what a checkpoint save or an export adds.
void plan_host(const PlanBasis& b, RunPlan* out) {
  RunPlan& p = *out;
  const MemoryPlan& mp = p.memory;
  const Placement& pl = mp.placement;
  p.pool_bytes = mp.pinned_pool_bytes();
  p.pinned_bytes = (pool_is_pinned(pl) ? p.pool_bytes : 0) + p.checkpoint_host_bytes;
  p.pageable_state_bytes = mp.cpu_pageable_bytes;
  const GradAccumulator::BufferPlan gbuf =
      GradAccumulator::plan_buffers(b.registry, pl, b.contribution_order, mp.partition_grads);
  p.grad_ring_bytes = mp.grad_ring_bytes;  // in the pool
  // Landing buffers are in the pool (Note [Gradients that land where they are summed]).
  const uint64_t pageable_gbuf = mp.landing_buffers > 0 ? 0 : uint64_t{gbuf.count} * gbuf.bytes_each;
  p.host_buffer_bytes = kStoreScratchBytes + pageable_gbuf + gbuf.narrowing_bytes +
                        uint64_t{mp.grad_read_buffers} * mp.grad_read_buffer_bytes +
                        data_parallel_staging_bytes(mp, b.in.world_size);
  p.ram_bytes = p.pool_bytes + p.pageable_state_bytes + p.host_buffer_bytes + p.checkpoint_host_bytes +
                (b.in.host.cuda ? 0 : p.activation_bytes);
  p.process_bytes = b.in.host.process_bytes;
  p.nvme_optimizer_bytes = mp.nvme_optimizer_bytes;
  p.nvme_param_bytes = mp.nvme_param_bytes;
  const uint64_t largest_ckpt_file = b.registry.total_elems() * 4;  // one state of every sub-group
  p.save_rss_bytes = staging_bytes_for(b.c.zoffload.checkpoint.staging_buffer_size, largest_ckpt_file);
  p.export_rss_bytes = p.save_rss_bytes;
}

// The accumulators' share of a step's NVMe traffic, moved during backward by the gradient worker.
struct GradTraffic {
  uint64_t read_bytes = 0, write_bytes = 0;
};

// Note [Bytes per step]
// What one optimizer step moves between the tiers, counted as the run moves it: NVMe read and
// written (RunPlan::nvme_*; in metrics.jsonl, the steps' deltas of memory.nvme_read_bytes and
// memory.nvme_write_bytes), compute copies host→device (h2d_*) and gradients device→host
// (d2h_bytes, on CUDA). NVMe transfers move whole 4 KiB-aligned sections, one per state per
// sub-group, so each is counted rounded as the swap file lays it out; a write that ends at a
// state's end pads its last page without reading it back.
// A pass is one forward and backward over the blocks: GAS per step, or one with the vertical
// schedule, which carries every micro-batch through each block at once. Per pass each
// NVMe-resident gradient accumulator this rank holds is written, and read back on every pass but
// the first, and the optimizer reads it once more; an optimizer on NVMe reads and writes master,
// exp_avg and exp_avg_sq of the sub-groups this rank owns. Compute copies on NVMe are written
// once (the optimizer's new copy) and read between once per step and twice per pass (forward and
// backward), as the coordinator's cache decides: a range (nvme_exact false), like the H2D copies
// of every fetched param. Gathered parameters (stage 3 across ranks) are read at every position
// of the schedule, exactly. The real runs of tests/tools/plan_cli_test.py and
// tests/tools/dist_cli_test.py move exactly these NVMe bytes, or bytes within the range.
GradTraffic plan_bytes_per_step(const PlanBasis& b, RunPlan* out) {
  RunPlan& p = *out;
  const MemoryPlan& mp = p.memory;
  const Placement& pl = mp.placement;
  const uint64_t passes = b.passes;
  const uint64_t cb = b.compute_elem_bytes;
  uint64_t rd = 0, wr = 0, compute_nvme_bytes = 0, compute_nvme_written = 0, n_fetched = 0;
  uint64_t grad_rd = 0, grad_wr = 0;  // the accumulators' share, moved during backward
  for (const SubGroup& g : b.registry.sub_groups()) {
    if (pl.compute[g.index] != Tier::kDevice || mp.partition_params) n_fetched += g.n_elems;
    auto sec = [&](StateKind k) { return align_up(group_state_bytes(pl, b.registry, g.index, k), kSwapAlignment); };
    if (pl.compute[g.index] == Tier::kNvme && mp.holds(g.index, StateKind::kCompute)) {
      compute_nvme_bytes += sec(StateKind::kCompute);
      if (g.trainable) compute_nvme_written += sec(StateKind::kCompute);  // a frozen one is never rewritten
    }
    if (pl.grad == Tier::kNvme && mp.holds(g.index, StateKind::kGradAccum)) {
      const uint64_t grad = sec(StateKind::kGradAccum);
      // The gradient accumulator: written every pass, read back on all but the first, and read
      // once more by the optimizer step.
      grad_wr += passes * grad;
      grad_rd += (passes - 1) * grad;
      rd += grad;
      // Stage 1 across ranks (every rank holds every accumulator): the read above is the boundary's
      // reduce; the owner writes the sums back, and its optimizer reads them once more.
      if (mp.partitioned() && !mp.partition_grads && mp.steps(g.index)) {
        wr += grad;
        rd += grad;
      }
    }
    // The optimizer step: master, exp_avg and exp_avg_sq in and out, of this rank's sub-groups.
    if (pl.optimizer != Tier::kNvme || !mp.steps(g.index)) continue;
    const uint64_t states = sec(StateKind::kMaster) + sec(StateKind::kExpAvg) + sec(StateKind::kExpAvgSq);
    rd += states;
    wr += states;
  }
  wr += compute_nvme_written;  // the new compute copies of trainable params that live on NVMe
  rd += grad_rd;
  wr += grad_wr;
  p.nvme_write_bytes = wr;
  p.nvme_read_min_bytes = rd + compute_nvme_bytes;
  p.nvme_read_max_bytes = rd + 2 * passes * compute_nvme_bytes;
  p.nvme_exact = compute_nvme_bytes == 0;
  if (mp.partition_params) {
    // Note [Gathered parameters]: the owner reads its part of every block at every position of the
    // schedule, whatever is cached on the device.
    p.nvme_read_min_bytes = p.nvme_read_max_bytes =
        rd + passes * BlockGatherer::nvme_read_bytes_per_pass(b.registry, mp, b.blocks);
    p.nvme_exact = true;
  }
  p.nvme_read_bytes = p.nvme_exact ? p.nvme_read_min_bytes : p.nvme_read_max_bytes;
  p.h2d_min_bytes = n_fetched * cb;
  p.h2d_max_bytes = 2 * passes * n_fetched * cb;
  p.d2h_bytes = b.in.host.cuda ? passes * p.n_trainable * dtype_size_bytes(grad_transfer_dtype(b.c)) : 0;
  return {grad_rd, grad_wr};
}

// Does it fit? Every resource the run would exceed, with the numbers.
void check_fits(const PlanBasis& b, RunPlan* out) {
  RunPlan& p = *out;
  const PlanInputs& in = b.in;
  const Config& c = b.c;
  const MemoryPlan& mp = p.memory;
  const uint64_t micro = c.train_micro_batch_size_per_gpu;
  const uint64_t device_limit = b.device_limit;
  const bool pin = pool_is_pinned(mp.placement);
  const HostFacts& host = in.host;
  const uint64_t arena_min = p.arena.persistent_bytes + p.arena.staging_bytes + p.arena.largest_block_bytes;
  if (p.device_state_bytes + arena_min + p.device_torch_reserve_bytes > device_limit) {
    const bool budget_binds = in.device_budget_bytes <= device_limit;
    std::string detail = "device-resident states " + format_bytes(p.device_state_bytes) + " + the largest block '" +
                         b.layout.blocks[p.arena.largest_block].name + "' " +
                         format_bytes(p.arena.largest_block_bytes) + " + persistent params " +
                         format_bytes(p.arena.persistent_bytes);
    if (p.arena.staging_bytes > 0) detail += " + the 4-bit weights' staging " + format_bytes(p.arena.staging_bytes);
    if (p.device_torch_reserve_bytes > 0) {
      detail +=
          " + LibTorch's activations " + format_bytes(p.activation_bytes) + " at micro-batch " + std::to_string(micro) +
          ", seq " + std::to_string(in.seq_len) +
          (p.held_micro_batches > 1 ? ", " + std::to_string(p.held_micro_batches) +
                                          " micro-batches held by the vertical schedule (\"horizontal\" holds one)"
                                    : std::string());
    }
    detail += budget_binds ? "; the budget is zoffload.gpu_memory_limit or the device's free memory"
                           : "; the budget is the device's memory";
    p.problems.push_back({in.host.cuda ? "GPU memory" : "device budget",
                          p.device_state_bytes + arena_min + p.device_torch_reserve_bytes, device_limit, detail});
  }
  const uint64_t cap = c.zoffload.pinned_memory_limit;
  if (cap != 0 && p.pool_bytes + p.checkpoint_host_bytes > cap) {
    p.problems.push_back({"zoffload.pinned_memory_limit", p.pool_bytes + p.checkpoint_host_bytes, cap,
                          "CPU-resident states " + format_bytes(mp.cpu_pinned_bytes) +
                              ", swap/staging buffers and the gradient landing ring " +
                              format_bytes(mp.grad_ring_bytes) +
                              (p.checkpoint_host_bytes > 0
                                   ? ", activation checkpoints on the CPU " + format_bytes(p.checkpoint_host_bytes)
                                   : std::string())});
  }
  if ((pin || p.checkpoint_host_bytes > 0) && !host.can_lock_unlimited && host.memlock_limit_bytes != UINT64_MAX &&
      p.pinned_bytes > host.memlock_limit_bytes) {
    p.problems.push_back({"locked memory (ulimit -l)", p.pinned_bytes, host.memlock_limit_bytes,
                          p.checkpoint_host_bytes > 0
                              ? "raise ulimit -l, set pin_memory false or zoffload.activation_checkpoints \"device\""
                              : "raise ulimit -l or set pin_memory false"});
  }
  {
    // The threads a run starts (Note [Address space]) — LibTorch's intra-op pool and the
    // optimizer's (one per CPU each, at most), the I/O engine's, and about ten of its own (the
    // optimizer and gradient workers, the gatherer, Gloo's) — each reserve a stack, and each may
    // open a malloc arena of 64 MiB (glibc: at most 8 per CPU, or MALLOC_ARENA_MAX).
    const uint64_t cpus = std::max<unsigned>(1, host.logical_cpus);
    const uint64_t threads = 2 * cpus + c.aio.intra_op_parallelism + 10;
    const uint64_t arenas = std::min({threads, 8 * cpus, host.malloc_arena_max});
    p.thread_reserve_bytes = threads * host.thread_stack_bytes + arenas * (uint64_t{64} << 20);
    p.address_space_bytes =
        host.process_virtual_bytes + p.ram_bytes + (in.host.cuda ? 0 : p.device_total_bytes) + p.thread_reserve_bytes;
    if (host.address_space_limit_bytes != UINT64_MAX && p.address_space_bytes > host.address_space_limit_bytes) {
      p.problems.push_back(
          {"address space (ulimit -v)", p.address_space_bytes, host.address_space_limit_bytes,
           "the process with LibTorch " + format_bytes(host.process_virtual_bytes) + " + the run's memory " +
               format_bytes(p.address_space_bytes - host.process_virtual_bytes - p.thread_reserve_bytes) + " + about " +
               std::to_string(threads) + " threads' stacks and malloc arenas " + format_bytes(p.thread_reserve_bytes) +
               ": raise ulimit -v, or set MALLOC_ARENA_MAX=2 to cap the arenas"});
    }
  }
  const uint64_t ram_need = p.ram_bytes + p.process_bytes;
  if (host.ram_available_bytes > 0 && ram_need > host.ram_available_bytes) {
    p.problems.push_back(
        {"RAM (MemAvailable)", ram_need, host.ram_available_bytes,
         "pool " + format_bytes(p.pool_bytes) + " + pageable states " + format_bytes(p.pageable_state_bytes) +
             " + buffers " + format_bytes(p.host_buffer_bytes) +
             (p.checkpoint_host_bytes > 0 ? " + checkpoints " + format_bytes(p.checkpoint_host_bytes) : "") +
             (in.host.cuda ? "" : " + activations " + format_bytes(p.activation_bytes)) + " + process " +
             format_bytes(p.process_bytes)});
  }
  const std::string opt_path = resolve_run_path(in.out_dir, c.zero.offload_optimizer.nvme_path);
  const std::string par_path = resolve_run_path(in.out_dir, c.zero.offload_param.nvme_path);
  const bool same_disk = !opt_path.empty() && opt_path == par_path;
  if (p.nvme_optimizer_bytes > 0 && host.optimizer_disk_free_bytes > 0) {
    const uint64_t need = p.nvme_optimizer_bytes + (same_disk ? p.nvme_param_bytes : 0);
    if (need > host.optimizer_disk_free_bytes)
      p.problems.push_back({"disk at " + opt_path, need, host.optimizer_disk_free_bytes, "the optimizer swap file"});
  }
  if (p.nvme_param_bytes > 0 && host.param_disk_free_bytes > 0 && !(same_disk && p.nvme_optimizer_bytes > 0)) {
    if (p.nvme_param_bytes > host.param_disk_free_bytes)
      p.problems.push_back(
          {"disk at " + par_path, p.nvme_param_bytes, host.param_disk_free_bytes, "the parameter swap file"});
  }
}

// What the summary says besides the figures.
void add_notes(const PlanBasis& b, RunPlan* out) {
  RunPlan& p = *out;
  if (!b.in.host.cuda)
    p.notes.push_back("no GPU: the device is emulated in host memory and LibTorch computes on the CPU");
  if (p.arena.prefetch_by_blocks)
    p.notes.push_back("prefetch " + prefetch_by_blocks_text(p.arena, b.c.zero.stage3_prefetch_bucket_size));
  if (!p.nvme_exact)
    p.notes.push_back("compute copies on NVMe are read once to " + std::to_string(2 * b.passes) +
                      " times per step, as the coordinator's cache and prefetch decide");
  // Note [Reading the states ahead]: "auto" accumulators may land in the swap file's records.
  if (b.c.zoffload.optimizer_read_ahead > 0 && p.memory.placement.grad == Tier::kNvme)
    p.notes.push_back(
        "zoffload.optimizer_read_ahead: nothing is read ahead, the gradient accumulators are in the "
        "optimizer swap file (no room for them in RAM), whose records the backward writes");
}

}  // namespace

Result<RunPlan> plan_run(const PlanInputs& in) {
  // Note [Where the gradients wait]: with the optimizer on NVMe, "auto" keeps the gradient
  // accumulators in RAM when the whole plan then still leaves a tenth of MemAvailable free: the
  // drive moves 4 bytes per element less each way at every step. Otherwise they go with the states.
  if (in.config.zoffload.gradient_accumulators == "auto" &&
      in.config.zero.offload_optimizer.device == OffloadDevice::kNvme && in.host.ram_available_bytes > 0) {
    PlanInputs in_ram = in;
    in_ram.config.zoffload.gradient_accumulators = "cpu";
    Result<RunPlan> p = plan_run(in_ram);
    if (p.is_ok() && p->ram_bytes + p->process_bytes <= in.host.ram_available_bytes / 10 * 9) {
      p->notes.push_back("gradient accumulators in RAM (zoffload.gradient_accumulators \"auto\": they fit with " +
                         format_bytes(in.host.ram_available_bytes - p->ram_bytes - p->process_bytes) +
                         " of MemAvailable to spare)");
      return p;
    }
  }
  const Config& c = in.config;
  if (in.seq_len == 0) return invalid_argument("--seq-len: 0 tokens per sequence");
  ZO_RETURN_IF_ERROR(check_model_size(in.model));
  ModelConfig model = in.model;
  ZO_ASSIGN_OR_RETURN(const ModelLayout layout, training_layout(&model, c));
  ZO_ASSIGN_OR_RETURN(ParamRegistry registry,
                      ParamRegistry::build(layout.params, c.zero.sub_group_size, in.world_size));
  RunPlan p;
  ZO_ASSIGN_OR_RETURN(
      p.memory,
      plan_memory_with_ring(c, registry, layout,
                            in.world_size > 1 && c.zero.stage >= 1 ? std::optional<uint32_t>(in.rank) : std::nullopt));
  p.n_params = registry.total_weights();
  p.n_trainable = registry.trainable_elems();
  p.tokens_per_micro_step = c.train_micro_batch_size_per_gpu * in.seq_len;
  p.held_micro_batches = vertical_micro_batches(c);
  PlanBasis b{.in = in, .c = c, .m = in.model, .layout = layout, .registry = registry};
  for (const BlockSpec& block : layout.blocks) b.blocks.push_back(block.params);
  b.contribution_order = contribution_order(layout);
  b.device_limit = in.host.cuda && in.host.device_total_bytes > 0
                       ? std::min(in.device_budget_bytes, in.host.device_total_bytes)
                       : in.device_budget_bytes;
  b.passes = c.gradient_accumulation_steps / p.held_micro_batches;
  b.compute_elem_bytes = state_elem_bytes(p.memory.placement, StateKind::kCompute);
  plan_device(b, &p);
  plan_host(b, &p);
  const GradTraffic grads = plan_bytes_per_step(b, &p);
  plan_step_time(step_work(c, in.model, layout, registry, in.seq_len, b.passes, in.speeds, in.host.cuda, grads.read_bytes,
                           grads.write_bytes, p),
                 in.speeds, &p);
  check_fits(b, &p);
  add_notes(b, &p);
  return p;
}

std::string RunPlan::summary() const {
  std::ostringstream s;
  s << "plan: " << format_bytes(device_total_bytes) << " device (states " << format_bytes(device_state_bytes)
    << ", arena " << format_bytes(device_arena_bytes) << ", activations " << format_bytes(activation_bytes)
    << (held_micro_batches > 1 ? " for " + std::to_string(held_micro_batches) + " micro-batches, vertical"
                               : std::string())
    << (checkpoints_on_host ? "; checkpoints on the CPU, " + format_bytes(checkpoint_host_bytes) : std::string())
    << "), pinned " << format_bytes(pinned_bytes) << ", RAM " << format_bytes(ram_bytes + process_bytes) << ", NVMe "
    << format_bytes(nvme_optimizer_bytes + nvme_param_bytes);
  if (nvme_read_bytes + nvme_write_bytes > 0)
    s << " (" << format_bytes(nvme_read_bytes) << " read, " << format_bytes(nvme_write_bytes) << " written per step)";
  if (!time_parts.empty()) {
    s << ", step " << seconds_text(step_s_low) << "–" << seconds_text(step_s_high);
    if (!time_unknown.empty()) s << " (without " << join(time_unknown, ", ") << ")";
  }
  s << (fits() ? "; fits" : "; does NOT fit");
  return s.str();
}

std::string RunPlan::to_json() const {
  nlohmann::ordered_json j;
  j["fits"] = fits();
  j["n_params"] = n_params;
  j["n_trainable"] = n_trainable;
  j["tokens_per_micro_step"] = tokens_per_micro_step;
  j["device"] = {{"budget_bytes", device_budget_bytes},
                 {"state_bytes", device_state_bytes},
                 {"arena_bytes", device_arena_bytes},
                 {"arena_wanted_bytes", arena.total_bytes()},
                 {"torch_reserve_bytes", device_torch_reserve_bytes},
                 {"activation_bytes", activation_bytes},
                 {"held_micro_batches", held_micro_batches},
                 {"checkpoints_on_host", checkpoints_on_host},
                 {"total_bytes", device_total_bytes}};
  j["host"] = {{"pinned_bytes", pinned_bytes},
               {"pool_bytes", pool_bytes},
               {"pageable_state_bytes", pageable_state_bytes},
               {"buffer_bytes", host_buffer_bytes},
               {"grad_ring_bytes", grad_ring_bytes},
               {"checkpoint_bytes", checkpoint_host_bytes},
               {"ram_bytes", ram_bytes},
               {"process_bytes", process_bytes},
               {"address_space_bytes", address_space_bytes},
               {"thread_reserve_bytes", thread_reserve_bytes}};
  j["nvme"] = {{"optimizer_file_bytes", nvme_optimizer_bytes}, {"param_file_bytes", nvme_param_bytes}};
  j["save_peak_extra_rss_bytes"] = save_rss_bytes;
  j["export_peak_extra_rss_bytes"] = export_rss_bytes;
  j["per_step"] = {{"nvme_read_bytes", nvme_read_bytes},
                   {"nvme_read_min_bytes", nvme_read_min_bytes},
                   {"nvme_read_max_bytes", nvme_read_max_bytes},
                   {"nvme_write_bytes", nvme_write_bytes},
                   {"nvme_exact", nvme_exact},
                   {"nvme_write_bytes_per_1000_steps", nvme_write_bytes * 1000},
                   {"h2d_min_bytes", h2d_min_bytes},
                   {"h2d_max_bytes", h2d_max_bytes},
                   {"d2h_bytes", d2h_bytes}};
  nlohmann::ordered_json parts = nlohmann::ordered_json::array();
  for (const StepTimePart& t : time_parts)
    parts.push_back({{"name", t.name}, {"seconds", t.seconds}, {"seconds_low", t.seconds_low}, {"basis", t.basis}});
  j["step_time"] = {{"low_s", step_s_low},
                    {"high_s", step_s_high},
                    {"compute_flops", compute_flops_per_step},
                    {"parts", parts},
                    {"unknown", time_unknown}};
  nlohmann::ordered_json probs = nlohmann::ordered_json::array();
  for (const PlanProblem& pr : problems)
    probs.push_back({{"resource", pr.resource},
                     {"need_bytes", pr.need_bytes},
                     {"have_bytes", pr.have_bytes},
                     {"detail", pr.detail}});
  j["problems"] = probs;
  j["notes"] = notes;
  j["memory_plan"] = nlohmann::json::parse(memory.to_json());
  return j.dump();
}

HostFacts probe_host(const Config& config, const std::string& out_dir) {
  const HostInfo h = host_info();
  HostFacts f;
  f.ram_total_bytes = h.mem_total_bytes;
  f.ram_available_bytes = h.mem_available_bytes;
  f.memlock_limit_bytes = h.memlock_limit_bytes;
  f.can_lock_unlimited = process_can_lock_unlimited();
  const RssBytes rss = process_rss();
  f.process_bytes = rss.current;
  f.address_space_limit_bytes = h.address_space_limit_bytes;
  f.process_virtual_bytes = rss.virtual_bytes;
  f.thread_stack_bytes = h.thread_stack_bytes;
  f.logical_cpus = h.logical_cpus;
  // glibc reads MALLOC_ARENA_MAX at start; a number ≥ 1 caps the arenas (Note [Address space]).
  if (const char* text = std::getenv("MALLOC_ARENA_MAX"); text != nullptr) {
    char* end = nullptr;
    const unsigned long long v = std::strtoull(text, &end, 10);
    if (end != text && *end == '\0' && v >= 1) f.malloc_arena_max = v;
  }
  f.device_name = "host (emulated)";
  f.device_total_bytes = h.mem_total_bytes;
  if (config.zero.offload_optimizer.device == OffloadDevice::kNvme)
    f.optimizer_disk_free_bytes = disk_free(resolve_run_path(out_dir, config.zero.offload_optimizer.nvme_path));
  if (config.zero.offload_param.device == OffloadDevice::kNvme)
    f.param_disk_free_bytes = disk_free(resolve_run_path(out_dir, config.zero.offload_param.nvme_path));
  return f;
}

Status read_io_results(const std::string& path, const Config& config, HostSpeeds* speeds) {
  constexpr uint64_t kMaxIoResultsBytes = uint64_t{64} << 20;  // a sweep's JSON is a few KiB
  ZO_ASSIGN_OR_RETURN(std::string text, io::Env::posix()->read_file(path, "io results file", kMaxIoResultsBytes));
  nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object() || !j.contains("best") || !j["best"].is_object())
    return invalid_argument(path + ": not the JSON of `zoffload-bench io --json` (no \"best\" object)");
  auto has_speeds = [](const nlohmann::json& row) {
    return row.is_object() && row.contains("read_gbps") && row["read_gbps"].is_number() && row.contains("write_gbps") &&
           row["write_gbps"].is_number();
  };
  auto number_is = [](const nlohmann::json& row, const char* key, uint64_t want) {
    return row.contains(key) && row[key].is_number_unsigned() && row[key].get<uint64_t>() == want;
  };
  // The run does its I/O with the config's aio settings and backend, so their row is the one that
  // predicts it; the sweep's best row only when the sweep did not measure them.
  const AioConfig& aio = config.aio;
  std::string backend = config.zoffload.io_backend;
  if (backend == "auto" && j.contains("auto_backend") && j["auto_backend"].is_string())
    backend = j["auto_backend"].get<std::string>();
  const nlohmann::json* chosen = nullptr;
  if (j.contains("results") && j["results"].is_array()) {
    for (const nlohmann::json& row : j["results"]) {
      if (has_speeds(row) && row.contains("backend") && row["backend"] == backend &&
          number_is(row, "block_size", aio.block_size) && number_is(row, "queue_depth", aio.queue_depth) &&
          number_is(row, "threads", aio.intra_op_parallelism)) {
        chosen = &row;
        break;
      }
    }
  }
  const std::string settings = backend + ", block " + format_bytes(aio.block_size) + ", queue depth " +
                               std::to_string(aio.queue_depth) + ", " + std::to_string(aio.intra_op_parallelism) +
                               " thread(s)";
  if (chosen != nullptr) {
    speeds->nvme_source = "zoffload-bench io " + path + " at the config's aio (" + settings + ")";
  } else {
    if (!has_speeds(j["best"]))
      return invalid_argument(
          path + ": its \"best\" row lacks read_gbps or write_gbps (run the benchmark with reads and writes)");
    chosen = &j["best"];
    speeds->nvme_source =
        "zoffload-bench io " + path + ", best row (the config's aio, " + settings + ", was not measured)";
  }
  speeds->nvme_read_bytes_per_s = (*chosen)["read_gbps"].get<double>() * 1e9;
  speeds->nvme_write_bytes_per_s = (*chosen)["write_gbps"].get<double>() * 1e9;
  return Status::ok();
}

}  // namespace zo::engine

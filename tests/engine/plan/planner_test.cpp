#include "engine/plan/planner.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <optional>
#include <tuple>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "engine/coord/grad_accumulator.h"
#include "engine/plan/fixes.h"
#include "tests/engine/plan/shipped_inputs.h"

namespace zo::engine {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

PlanInputs tiny_inputs(OffloadDevice optimizer, OffloadDevice param) {
  PlanInputs in;
  in.config.zero.stage = 3;
  in.config.zero.sub_group_size = 1'000'000;
  in.config.zero.offload_optimizer.device = optimizer;
  in.config.zero.offload_optimizer.nvme_path = "nvme";
  in.config.zero.offload_param.device = param;
  in.config.zero.offload_param.nvme_path = "nvme";
  // With the optimizer on NVMe, "auto" would keep the accumulators in this host's ample RAM; the
  // tests below that move them through the drive say so (Note [Where the gradients wait]).
  if (optimizer == OffloadDevice::kNvme) in.config.zoffload.gradient_accumulators = "nvme";
  in.config.train_micro_batch_size_per_gpu = 1;
  in.config.gradient_accumulation_steps = 1;
  in.model = *model_preset("tiny");
  in.model_name = "tiny";
  in.seq_len = 64;
  in.device_budget_bytes = uint64_t{1} << 30;
  in.host.ram_total_bytes = in.host.ram_available_bytes = uint64_t{64} << 30;
  in.host.device_total_bytes = uint64_t{64} << 30;
  in.host.device_name = "host (emulated)";
  return in;
}

// The tiny preset's figures, worked out by hand (fp32 compute and accumulators: 4 bytes per element
// of every state; optimizer and accumulators on NVMe, compute copies pinned on the CPU).
//   V = 256, H = 256, I = 688, 4 layers, 8 heads × 32 = q_dim 256, 4 kv heads × 32 = kv_dim 128,
//   untied. A decoder layer: 2 norms 2·256 + q 256·256 + k, v 2·128·256 + o 256·256 + gate, up,
//   down 3·688·256 = 512 + 65536 + 65536 + 65536 + 528384 = 725504 elements.
//   n_params = embed 65536 + 4·725504 + norm 256 + lm_head 65536 = 3033344.
// Sub-groups of at most 1,000,000 elements, whole params packed in order until the next does not fit:
//   0: embed + layer 0 + layer 1 up to its post_attention_layernorm  65536 + 725504 + 197120 = 988160
//   1: layer 1's gate, up, down + layer 2 up to its gate      528384 + 197120 + 176128 = 901632
//   2: layer 2's up, down + layer 3 up to its up              352256 + 197120 + 352256 = 901632
//   3: layer 3's down + norm + lm_head                        176128 + 256 + 65536     = 241920
// Each state of each sub-group is a 4 KiB-aligned section (kSwapAlignment, kPinnedAlignment):
//   988160·4 = 3952640 = 965 pages exactly; 901632·4 = 3606528 = 880.5 pages → 3608576;
//   241920·4 = 967680 = 236.25 pages → 970752; one state over the four: 3952640 + 2·3608576 +
//   970752 = 12140544.
// The optimizer's swap file: master, exp_avg, exp_avg_sq and the accumulator, 4·12140544 = 48562176.
// The gradient ring: the largest block's gradients, a decoder layer (the embedding and the head are
//   65536 and 65792 elements): 725504·4 = 2902016 (708.5 pages: 2904064 in the pool).
// The pool: the pinned compute copies 12140544 + one optimizer swap buffer (no pipelining) of five
//   sections of the largest sub-group, 5·3952640 = 19763200, + the ring 2904064 = 34807808.
// Host buffers: the store's 4 MiB scratch + the accumulator's write buffers. Contributions arrive
//   head first: sub-group 3 opens at the norm, 2 at layer 3, which closes 3 with its down_proj; 1
//   opens at layer 2, which closes 2; 0 at layer 1, which closes 1: at most two open, plus one
//   write behind them, 3 × 3952640 (the largest sub-group's section): 4194304 + 11857920 = 16052224.
TEST(Planner, CountsTheTinyPresetsBytesAsWorkedOutByHand) {
  const PlanInputs in = tiny_inputs(OffloadDevice::kNvme, OffloadDevice::kCpu);
  auto p = plan_run(in);
  ASSERT_TRUE(p.is_ok()) << p.status().to_string();
  EXPECT_EQ(p->n_params, 3033344u);
  EXPECT_EQ(p->memory.n_sub_groups, 4u);
  EXPECT_EQ(p->nvme_optimizer_bytes, 48562176u);
  EXPECT_EQ(p->nvme_param_bytes, 0u);
  EXPECT_EQ(p->device_state_bytes, 0u);
  EXPECT_EQ(p->memory.cpu_pinned_bytes, 12140544u);
  EXPECT_EQ(p->grad_ring_bytes, 2902016u);
  EXPECT_EQ(p->pool_bytes, 34807808u);
  EXPECT_EQ(p->pinned_bytes, 34807808u);
  EXPECT_EQ(p->host_buffer_bytes, 16052224u);
  EXPECT_GT(p->arena.total_bytes(), 0u);
  EXPECT_GT(p->activation_bytes, 0u);
  EXPECT_TRUE(p->fits()) << p->summary();
  EXPECT_THAT(p->summary(), HasSubstr("; fits"));
}

TEST(Planner, NvmeTrafficGrowsWithAccumulationAsTheAccumulatorsMove) {
  PlanInputs in = tiny_inputs(OffloadDevice::kNvme, OffloadDevice::kCpu);
  auto one = plan_run(in);
  in.config.gradient_accumulation_steps = 3;
  auto three = plan_run(in);
  ASSERT_TRUE(one.is_ok() && three.is_ok());
  // Two more micro-steps write and read back every gradient section once more each.
  const uint64_t grad_file = one->n_params * 4;
  EXPECT_GE(three->nvme_write_bytes - one->nvme_write_bytes, 2 * grad_file);
  EXPECT_GE(three->nvme_read_bytes - one->nvme_read_bytes, 2 * grad_file);
  EXPECT_TRUE(one->nvme_exact);
}

// Note [Where the gradients wait]: "auto" keeps the accumulators in RAM beside an NVMe optimizer
// when the host has room, which takes them out of the swap file and the drive's traffic; on a host
// without room they stay with the states; a CPU optimizer short of RAM is offered the drive.
TEST(Planner, AutoKeepsTheAccumulatorsInRamWhenTheHostHasRoom) {
  PlanInputs in = tiny_inputs(OffloadDevice::kNvme, OffloadDevice::kCpu);
  in.config.gradient_accumulation_steps = 2;
  // Sub-groups small beside the model: the accumulators' host buffers on the drive (the open
  // sub-groups and one write behind them) cost less RAM than the accumulators themselves.
  in.config.zero.sub_group_size = 65536;
  auto on_nvme = plan_run(in);
  in.config.zoffload.gradient_accumulators = "auto";
  auto in_ram = plan_run(in);
  ASSERT_TRUE(on_nvme.is_ok() && in_ram.is_ok()) << on_nvme.status().to_string() << in_ram.status().to_string();
  EXPECT_EQ(on_nvme->memory.placement.grad, Tier::kNvme);
  EXPECT_EQ(in_ram->memory.placement.grad, Tier::kCpu);
  EXPECT_THAT(in_ram->to_json(), HasSubstr("gradient accumulators in RAM"));
  uint64_t sections = 0, in_memory = 0;  // the accumulators: in the swap file, in RAM
  const ModelLayout layout = model_layout(in.model);
  auto reg = ParamRegistry::build(layout.params, in.config.zero.sub_group_size);
  ASSERT_TRUE(reg.is_ok());
  for (const SubGroup& g : reg->sub_groups()) {
    sections += align_up(g.n_elems * 4, kSwapAlignment);
    in_memory += align_up(g.n_elems * 4, kPinnedAlignment);
  }
  EXPECT_EQ(on_nvme->nvme_optimizer_bytes - in_ram->nvme_optimizer_bytes, sections);
  EXPECT_EQ(in_ram->pageable_state_bytes - on_nvme->pageable_state_bytes, in_memory);
  // GAS 2: written twice and read back once by backward, read once by the optimizer.
  EXPECT_EQ(on_nvme->nvme_write_bytes - in_ram->nvme_write_bytes, 2 * sections);
  EXPECT_GE(on_nvme->nvme_read_bytes - in_ram->nvme_read_bytes, 2 * sections);
  EXPECT_EQ(in_ram->memory.optimizer_swap_buffer_bytes + align_up(reg->max_group_elems() * 4, kSwapAlignment),
            on_nvme->memory.optimizer_swap_buffer_bytes)
      << "the swap buffers lose their gradient section";

  // A host that cannot spare the RAM: "auto" leaves them on the drive.
  in.host.ram_available_bytes = in_ram->ram_bytes + in_ram->process_bytes;  // fits, but not with a tenth to spare
  auto tight = plan_run(in);
  ASSERT_TRUE(tight.is_ok());
  EXPECT_EQ(tight->memory.placement.grad, Tier::kNvme);
  EXPECT_TRUE(tight->fits()) << tight->summary();

  // A CPU optimizer on a host without the RAM for its accumulators: the drive is a fix.
  PlanInputs cpu = tiny_inputs(OffloadDevice::kCpu, OffloadDevice::kCpu);
  cpu.config.zero.sub_group_size = 65536;  // buffers of a sub-group each, small beside the model
  auto want = plan_run(cpu);
  ASSERT_TRUE(want.is_ok());
  PlanInputs moved = cpu;
  moved.config.zoffload.gradient_accumulators = "nvme";
  auto on_drive = plan_run(moved);
  ASSERT_TRUE(on_drive.is_ok()) << on_drive.status().to_string();
  EXPECT_EQ(on_drive->memory.grad_read_buffers, 2u);
  // Between the two: short of what the accumulators in RAM need, enough once they are on the drive
  // (their RAM less the read and accumulation buffers they then need).
  const uint64_t need_ram = want->ram_bytes + want->process_bytes;
  const uint64_t need_drive = on_drive->ram_bytes + on_drive->process_bytes;
  ASSERT_LT(need_drive, need_ram);
  cpu.host.ram_available_bytes = (need_ram + need_drive) / 2;
  EXPECT_FALSE(plan_run(cpu)->fits());
  const std::vector<PlanFix> fixes = suggest_fixes(cpu, 8);
  const bool offered = std::any_of(fixes.begin(), fixes.end(), [](const PlanFix& f) {
    return f.changes.size() == 1 && f.changes[0] == "zoffload.gradient_accumulators: nvme";
  });
  EXPECT_TRUE(offered) << fixes.size() << " fixes";
}

// Note [Reading the states ahead]: zoffload.optimizer_read_ahead adds swap buffers to the pinned
// pool where something is read into them, and where "auto" puts the accumulators in the swap file
// it adds none and the plan says why.
TEST(Planner, StatesReadAheadTakeSwapBuffersOnlyWhereTheyAreRead) {
  PlanInputs in = tiny_inputs(OffloadDevice::kNvme, OffloadDevice::kCpu);
  in.config.zero.sub_group_size = 65536;
  in.config.zoffload.gradient_accumulators = "auto";
  auto base = plan_run(in);
  in.config.zoffload.optimizer_read_ahead = 2;
  auto ahead = plan_run(in);
  ASSERT_TRUE(base.is_ok() && ahead.is_ok()) << base.status().to_string() << ahead.status().to_string();
  ASSERT_EQ(ahead->memory.placement.grad, Tier::kCpu);
  EXPECT_EQ(ahead->memory.optimizer_swap_buffers, base->memory.optimizer_swap_buffers + 2);
  EXPECT_EQ(ahead->memory.pinned_pool_bytes() - base->memory.pinned_pool_bytes(),
            2 * ahead->memory.optimizer_swap_buffer_bytes);
  EXPECT_THAT(ahead->to_json(), Not(HasSubstr("nothing is read ahead")));

  in.host.ram_available_bytes = ahead->ram_bytes + ahead->process_bytes;  // no tenth to spare: the drive
  auto tight = plan_run(in);
  ASSERT_TRUE(tight.is_ok());
  ASSERT_EQ(tight->memory.placement.grad, Tier::kNvme);
  in.config.zoffload.optimizer_read_ahead = 0;
  auto tight_base = plan_run(in);
  ASSERT_TRUE(tight_base.is_ok());
  EXPECT_EQ(tight->memory.optimizer_swap_buffers, tight_base->memory.optimizer_swap_buffers);
  EXPECT_THAT(tight->to_json(), HasSubstr("zoffload.optimizer_read_ahead: nothing is read ahead"));
}

// A shipped llama3-8b config (seq 1024, 1000 steps) on the machine it is for: a 24 GB card and a
// 128 GiB host.
std::optional<PlanInputs> shipped_8b_on_128gib(const std::string& file) {
  // 124 GiB: what such a host reports as MemAvailable with nothing else running.
  return shipped_llama8b(file, uint64_t{128} << 30, uint64_t{124} << 30, "a 24 GB card", uint64_t{24'000'000'000});
}

// The flagship config on the machine it is for: llama3-8b on a 24 GB card and a 128 GiB host. Its
// gradient accumulators on the drive (16 bytes per parameter would not leave room) and the
// vertical schedule (each written once per step) leave more than a tenth of the host free.
TEST(Planner, TheShipped8bConfigFitsA128GiBHostWithRoomToSpare) {
  const std::optional<PlanInputs> shipped = shipped_8b_on_128gib("llama8b_24gb_optimizer_cpu.json");
  ASSERT_TRUE(shipped) << "ZO_SOURCE_DIR set and the config loads";
  const PlanInputs& in = *shipped;
  auto p = plan_run(in);
  ASSERT_TRUE(p.is_ok()) << p.status().to_string();
  EXPECT_TRUE(p->fits()) << p->summary();
  EXPECT_EQ(p->memory.placement.optimizer, Tier::kCpu);
  EXPECT_EQ(p->memory.placement.grad, Tier::kNvme);
  const uint64_t ram = p->ram_bytes + p->process_bytes;
  EXPECT_LE(ram, in.host.ram_total_bytes / 10 * 9) << p->summary();
  EXPECT_LE(p->pinned_bytes, in.config.zoffload.pinned_memory_limit);
}

// A CPU optimizer on a host a little short of RAM for fp32 moments but not for 8-bit ones: the plan
// offers zoffload.moment_dtype 8bit, says it rounds, and offers it after the exact fixes (which here
// also fit: the accumulators or the optimizer to the drive).
TEST(Planner, EightBitMomentsAreOfferedAfterTheExactFixes) {
  PlanInputs in = tiny_inputs(OffloadDevice::kCpu, OffloadDevice::kCpu);
  in.config.zero.sub_group_size = 65536;
  in.config.zoffload.gradient_accumulators = "cpu";
  auto fp32 = plan_run(in);
  PlanInputs q = in;
  q.config.zoffload.moment_dtype = "8bit";
  auto eight = plan_run(q);
  ASSERT_TRUE(fp32.is_ok() && eight.is_ok());
  // 3,033,344 params, each ≥ 4096 elements except the norms (256): 6 bytes per parameter fewer,
  // less the absmax, give or take a page per section.
  const uint64_t saved = (fp32->ram_bytes + fp32->process_bytes) - (eight->ram_bytes + eight->process_bytes);
  EXPECT_GT(saved, 5 * fp32->n_params);
  EXPECT_LT(saved, 6 * fp32->n_params + 2 * fp32->memory.n_sub_groups * 4096);
  in.host.ram_available_bytes = eight->ram_bytes + eight->process_bytes + saved / 2;
  EXPECT_FALSE(plan_run(in)->fits());
  const std::vector<PlanFix> fixes = suggest_fixes(in, 16);
  size_t at = fixes.size();
  for (size_t i = 0; i < fixes.size(); ++i) {
    if (fixes[i].changes.size() == 1 && fixes[i].changes[0].rfind("zoffload.moment_dtype: 8bit", 0) == 0) at = i;
  }
  ASSERT_LT(at, fixes.size()) << fixes.size() << " fixes";
  EXPECT_THAT(fixes[at].trade, HasSubstr("rounds"));
  for (size_t i = 0; i < at; ++i) {
    if (fixes[i].changes.size() == 1 && fixes[i].changes[0].rfind("zero_optimization.offload_", 0) == 0) {
      EXPECT_EQ(fixes[i].trade, "exact: the same weights bit for bit") << fixes[i].changes[0];
    }
  }
  EXPECT_THAT(fixes[at].result, HasSubstr("; fits"));
  EXPECT_GT(at, 0u) << "an exact fix comes first: " << fixes.front().changes.front();
}

// The index of the fix that makes exactly `change`, or fixes.size() when none does.
size_t fix_index(const std::vector<PlanFix>& fixes, const std::string& change) {
  for (size_t i = 0; i < fixes.size(); ++i)
    if (fixes[i].changes.size() == 1 && fixes[i].changes[0] == change) return i;
  return fixes.size();
}

// bf16 moments (zoffload.moment_dtype "bf16", or DeepSpeed's bf16.bf16_optimizer_states): 4 bytes
// per parameter fewer on the optimizer's tier, give or take a page per section; on a host that
// holds them and not fp32 moments the plan offers them after the exact fixes and before 8-bit.
TEST(Planner, Bf16MomentsSaveFourBytesAParameterAndComeBefore8bit) {
  PlanInputs in = tiny_inputs(OffloadDevice::kCpu, OffloadDevice::kCpu);
  in.config.zero.sub_group_size = 65536;
  in.config.zoffload.gradient_accumulators = "cpu";
  auto fp32 = plan_run(in);
  PlanInputs q = in;
  q.config.zoffload.moment_dtype = "bf16";
  auto bf16 = plan_run(q);
  ASSERT_TRUE(fp32.is_ok() && bf16.is_ok());
  EXPECT_EQ(bf16->memory.placement.moments, MomentDtype::kBF16);
  const uint64_t saved = (fp32->ram_bytes + fp32->process_bytes) - (bf16->ram_bytes + bf16->process_bytes);
  EXPECT_GE(saved + 2 * fp32->memory.n_sub_groups * 4096, 4 * fp32->n_params);
  EXPECT_LE(saved, 4 * fp32->n_params + 2 * fp32->memory.n_sub_groups * 4096);
  in.host.ram_available_bytes = bf16->ram_bytes + bf16->process_bytes + saved / 4;
  EXPECT_FALSE(plan_run(in)->fits());
  const std::vector<PlanFix> fixes = suggest_fixes(in, 16);
  const size_t at_bf16 = fix_index(fixes, "zoffload.moment_dtype: bf16");
  const size_t at_8bit = fix_index(fixes, "zoffload.moment_dtype: 8bit");
  ASSERT_LT(at_bf16, fixes.size()) << fixes.size() << " fixes";
  ASSERT_LT(at_8bit, fixes.size()) << fixes.size() << " fixes";
  EXPECT_LT(at_bf16, at_8bit);
  EXPECT_GT(at_bf16, 0u) << "an exact fix comes first: " << fixes.front().changes.front();
  EXPECT_THAT(fixes[at_bf16].trade, HasSubstr("rounds"));
  EXPECT_THAT(fixes[at_bf16].trade, HasSubstr("bf16"));
  EXPECT_THAT(fixes[at_bf16].result, HasSubstr("; fits"));

  // Already in bf16 (DeepSpeed's key) on a host that holds only 8-bit moments: 8-bit is offered,
  // with the key that would contradict it dropped.
  PlanInputs b = q;
  b.config.bf16.bf16_optimizer_states = true;
  PlanInputs e = in;
  e.config.zoffload.moment_dtype = "8bit";
  auto eight = plan_run(e);
  ASSERT_TRUE(eight.is_ok());
  b.host.ram_available_bytes = eight->ram_bytes + eight->process_bytes + fp32->n_params / 2;
  EXPECT_FALSE(plan_run(b)->fits());
  const std::vector<PlanFix> b_fixes = suggest_fixes(b, 16);
  EXPECT_LT(fix_index(b_fixes, "zoffload.moment_dtype: 8bit and bf16.bf16_optimizer_states: false"), b_fixes.size());
}

// Note [Gradients stored in 16 bits]: the accumulators in bf16 (2 bytes per parameter less where
// they live) summed in fp32 host buffers of the largest sub-group each, one per sub-group open at
// once, plus a 2 MiB rounding scratch where they are not in RAM. Offered as a fix that rounds,
// before bf16 moments, and with the vertical schedule when the config accumulates horizontally.
TEST(Planner, Bf16StoredGradientsSaveTwoBytesAParameterLessTheirFp32Buffers) {
  for (const char* where : {"cpu", "nvme"}) {
    SCOPED_TRACE(where);
    PlanInputs in = tiny_inputs(OffloadDevice::kCpu, OffloadDevice::kCpu);
    in.config.zero.sub_group_size = 65536;
    in.config.zoffload.gradient_accumulators = where;
    auto fp32 = plan_run(in);
    PlanInputs q = in;
    q.config.zoffload.gradient_store_dtype = "bf16";
    auto bf16 = plan_run(q);
    ASSERT_TRUE(fp32.is_ok() && bf16.is_ok());
    EXPECT_EQ(bf16->memory.placement.grad_dtype, DType::kBF16);
    EXPECT_EQ(bf16->memory.placement.grad_sum_dtype, DType::kF32);
    const uint64_t n = fp32->n_params, groups = fp32->memory.n_sub_groups;
    const uint64_t largest = 65536;  // the tiny preset's largest tensor is under a sub-group
    if (std::string(where) == "cpu") {
      // The states: 2 bytes a parameter less, each sub-group's accumulator rounded up to 4 KiB.
      const uint64_t saved = fp32->memory.cpu_pageable_bytes - bf16->memory.cpu_pageable_bytes;
      EXPECT_GE(saved + groups * 4096, 2 * n);
      EXPECT_LE(saved, 2 * n + groups * 4096);
      // The buffers: none before (summed in place), now at least one fp32 sub-group.
      EXPECT_GE(bf16->host_buffer_bytes - fp32->host_buffer_bytes, 4 * largest);
    } else {
      // The NVMe section shrinks; the accumulator's buffers hold the same fp32 sub-groups, plus the
      // scratch (min(65536, 2^20) bf16 elements), and the optimizer's read buffers hold bf16 now.
      EXPECT_LT(bf16->memory.nvme_optimizer_bytes, fp32->memory.nvme_optimizer_bytes);
      const MemoryPlan &a = fp32->memory, &b = bf16->memory;
      EXPECT_EQ(b.grad_read_buffers, a.grad_read_buffers);
      EXPECT_EQ(b.grad_read_buffer_bytes * 2, a.grad_read_buffer_bytes);
      EXPECT_EQ(bf16->host_buffer_bytes + a.grad_read_buffers * (a.grad_read_buffer_bytes - b.grad_read_buffer_bytes),
                fp32->host_buffer_bytes + 2 * largest);
      EXPECT_LT(bf16->nvme_write_bytes, fp32->nvme_write_bytes);
    }
  }

  PlanInputs in = tiny_inputs(OffloadDevice::kCpu, OffloadDevice::kCpu);
  in.config.zero.sub_group_size = 65536;
  in.config.zoffload.gradient_accumulators = "cpu";
  in.config.gradient_accumulation_steps = 2;
  auto fp32 = plan_run(in);
  PlanInputs q = in;
  q.config.zoffload.gradient_store_dtype = "bf16";
  q.config.zoffload.schedule = "vertical";
  auto bf16 = plan_run(q);
  ASSERT_TRUE(fp32.is_ok() && bf16.is_ok());
  ASSERT_TRUE(bf16->fits());
  in.host.ram_available_bytes = bf16->ram_bytes + bf16->process_bytes;
  ASSERT_FALSE(plan_run(in)->fits());
  const std::vector<PlanFix> fixes = suggest_fixes(in, 16);
  const size_t at_grads = fix_index(fixes, "zoffload.gradient_store_dtype: bf16 and zoffload.schedule: vertical");
  const size_t at_moments = fix_index(fixes, "zoffload.moment_dtype: bf16");
  ASSERT_LT(at_grads, fixes.size()) << fixes.size() << " fixes";
  EXPECT_LT(at_grads, at_moments);
  EXPECT_THAT(fixes[at_grads].trade, HasSubstr("rounds"));
  EXPECT_THAT(fixes[at_grads].trade, HasSubstr("norm"));
  EXPECT_THAT(fixes[at_grads].result, HasSubstr("; fits"));
}

// bf16 masters (zoffload.master_dtype "bf16"): 2 bytes per parameter fewer in the swap file (the
// optimizer on NVMe), all 4 fewer in RAM when the compute copies are there too (Note [A bf16 master
// is its compute copy]), give or take a page per sub-group; offered, with bf16 compute, as the last
// fix that rounds; and the three rounding fixes together are tried when no one or two fit.
TEST(Planner, Bf16MastersSaveTwoBytesOrAllFourAndAreOfferedLast) {
  for (OffloadDevice where : {OffloadDevice::kCpu, OffloadDevice::kNvme}) {
    PlanInputs in = tiny_inputs(where, OffloadDevice::kCpu);
    in.config.bf16.enabled = true;
    in.config.zero.sub_group_size = 65536;
    in.config.zoffload.gradient_accumulators = "cpu";
    auto fp32 = plan_run(in);
    PlanInputs q = in;
    q.config.zoffload.master_dtype = "bf16";
    auto bf16 = plan_run(q);
    ASSERT_TRUE(fp32.is_ok() && bf16.is_ok());
    EXPECT_EQ(bf16->memory.placement.master_dtype, DType::kBF16);
    const uint64_t n = fp32->n_params, pages = fp32->memory.n_sub_groups * 4096;
    const uint64_t saved = where == OffloadDevice::kCpu
                               ? fp32->memory.cpu_pageable_bytes - bf16->memory.cpu_pageable_bytes
                               : fp32->memory.nvme_optimizer_bytes - bf16->memory.nvme_optimizer_bytes;
    const uint64_t per_param = where == OffloadDevice::kCpu ? 4 : 2;
    EXPECT_GE(saved + pages, per_param * n);
    EXPECT_LE(saved, per_param * n + pages);
    EXPECT_EQ(bf16->memory.cpu_pinned_bytes, fp32->memory.cpu_pinned_bytes) << "the compute copies, as before";
    if (where == OffloadDevice::kNvme) { EXPECT_LT(bf16->nvme_write_bytes, fp32->nvme_write_bytes); }
  }

  PlanInputs in = tiny_inputs(OffloadDevice::kCpu, OffloadDevice::kCpu);
  in.config.bf16.enabled = true;
  in.config.zero.sub_group_size = 65536;
  in.config.zoffload.gradient_accumulators = "cpu";
  in.config.zoffload.moment_dtype = "8bit";
  in.config.zoffload.gradient_store_dtype = "bf16";
  PlanInputs q = in;
  q.config.zoffload.master_dtype = "bf16";
  auto lean = plan_run(q);
  ASSERT_TRUE(lean.is_ok());
  in.host.ram_available_bytes = lean->ram_bytes + lean->process_bytes;
  ASSERT_FALSE(plan_run(in)->fits());
  const std::vector<PlanFix> fixes = suggest_fixes(in, 16);
  const size_t at_master = fix_index(fixes, "zoffload.master_dtype: bf16");
  ASSERT_LT(at_master, fixes.size()) << fixes.size() << " fixes";
  EXPECT_GT(at_master, 0u) << "an exact fix comes first: " << fixes.front().changes.front();
  EXPECT_THAT(fixes[at_master].trade, HasSubstr("stochastic"));
  EXPECT_THAT(fixes[at_master].result, HasSubstr("; fits"));

  // fp32 everything, on a host that holds the states only with all three narrowed and no room on
  // the drive for a swap file: no single change nor pair fits, the three together do.
  PlanInputs all = in;
  all.config.zoffload.moment_dtype = "fp32";
  all.config.zoffload.gradient_store_dtype = "auto";
  all.host.optimizer_disk_free_bytes = all.host.param_disk_free_bytes = 1 << 20;
  all.disk_free_given = true;
  ASSERT_FALSE(plan_run(all)->fits());
  for (const PlanFix& f : suggest_fixes(all, 16)) {
    SCOPED_TRACE(f.result);
    EXPECT_EQ(f.changes.size(), 3u);
    EXPECT_THAT(f.result, HasSubstr("; fits"));
  }
  bool found = false;
  for (const PlanFix& f : suggest_fixes(all, 16))
    found |= f.changes == std::vector<std::string>{"zoffload.gradient_store_dtype: bf16", "zoffload.moment_dtype: 8bit",
                                                   "zoffload.master_dtype: bf16"};
  EXPECT_TRUE(found) << "the three rounding fixes together";
}

// With the optimizer on the device the states narrow there too: the device bytes of 8-bit moments
// and bf16 masters (the master being the compute copy) are the closed form's, and on a GPU budget
// that holds 8-bit moments but not fp32 ones the plan offers them after the exact fixes (the
// optimizer offloaded), keeping the optimizer on the device.
TEST(Planner, NarrowStatesOnTheDeviceAreFixesThereToo) {
  PlanInputs in = tiny_inputs(OffloadDevice::kNone, OffloadDevice::kNone);
  in.config.bf16.enabled = true;
  in.config.zero.stage = 2;
  auto fp32 = plan_run(in);
  PlanInputs q = in;
  q.config.zoffload.moment_dtype = "8bit";
  q.config.zoffload.master_dtype = "bf16";
  auto narrow = plan_run(q);
  ASSERT_TRUE(fp32.is_ok() && narrow.is_ok()) << narrow.status().to_string();
  EXPECT_EQ(narrow->memory.placement.optimizer, Tier::kDevice);
  // fp32 masters, moments and accumulators and bf16 compute copies: 18 bytes a parameter; then the
  // masters are the compute copies (4 bytes fewer) and both moments 2 + 8/256 bytes instead of 8
  // (the nine 256-element norms keep fp32 moments), give or take kDeviceAlignment per state and
  // sub-group: 9.97 bytes a parameter fewer.
  const uint64_t n = fp32->n_params, slack = 5 * 256 * fp32->memory.n_sub_groups;
  const uint64_t saved = fp32->memory.device_bytes - narrow->memory.device_bytes;
  EXPECT_GE(saved + slack, n * 99 / 10);
  EXPECT_LE(saved, 10 * n + slack);
  // A budget that holds 8-bit moments beside fp32 masters, and not fp32 moments.
  PlanInputs e = in;
  e.config.zoffload.moment_dtype = "8bit";
  auto eight = plan_run(e);
  ASSERT_TRUE(eight.is_ok()) << eight.status().to_string();
  in.device_budget_bytes = eight->device_total_bytes + (fp32->device_total_bytes - eight->device_total_bytes) / 4;
  ASSERT_FALSE(plan_run(in)->fits());
  const std::vector<PlanFix> fixes = suggest_fixes(in, 32);
  ASSERT_FALSE(fixes.empty());
  EXPECT_EQ(fixes.front().trade, "exact: the same weights bit for bit") << fixes.front().changes.front();
  bool narrowed_on_device = false;
  for (const PlanFix& f : fixes) {
    bool moves_the_optimizer = false, narrows = false;
    for (const std::string& c : f.changes) {
      moves_the_optimizer |= c.rfind("zero_optimization.offload_optimizer.device", 0) == 0;
      narrows |= c.rfind("zoffload.moment_dtype", 0) == 0 || c.rfind("zoffload.master_dtype", 0) == 0;
    }
    if (narrows && !moves_the_optimizer) {
      narrowed_on_device = true;
      EXPECT_THAT(f.trade, HasSubstr("rounds"));
      EXPECT_THAT(f.result, HasSubstr("; fits"));
    }
  }
  EXPECT_TRUE(narrowed_on_device) << fixes.size() << " fixes";
}

// Note [No accumulator]: without clipping the accumulators' 4 bytes per parameter go (less the
// buffers of the sub-groups open at once), and the fix is offered first, as exact; with clipping
// it is not offered.
TEST(Planner, NoAccumulatorIsTheFirstExactFixWhereNothingIsClipped) {
  PlanInputs in = tiny_inputs(OffloadDevice::kCpu, OffloadDevice::kCpu);
  in.config.bf16.enabled = true;
  in.config.gradient_clipping = 0;
  in.config.zero.sub_group_size = 65536;
  in.config.zoffload.gradient_accumulators = "cpu";
  PlanInputs q = in;
  q.config.zoffload.gradient_accumulators = "none";
  q.config.bf16.check_grad_overflow = false;
  auto stored = plan_run(in);
  auto direct = plan_run(q);
  ASSERT_TRUE(stored.is_ok() && direct.is_ok()) << direct.status().to_string();
  EXPECT_TRUE(direct->memory.placement.no_accumulator);
  const uint64_t n = stored->n_params, pages = stored->memory.n_sub_groups * 4096;
  const uint64_t saved = stored->memory.cpu_pageable_bytes - direct->memory.cpu_pageable_bytes;
  EXPECT_GE(saved + pages, 4 * n);
  EXPECT_LE(saved, 4 * n + pages);
  EXPECT_GT(direct->host_buffer_bytes, stored->host_buffer_bytes) << "the open sub-groups' sums";
  EXPECT_LT(direct->ram_bytes, stored->ram_bytes);
  EXPECT_EQ(nlohmann::json::parse(direct->to_json())["memory_plan"]["placement"]["grad"], "none");

  in.host.ram_available_bytes = direct->ram_bytes + direct->process_bytes;
  ASSERT_FALSE(plan_run(in)->fits());
  const std::vector<PlanFix> fixes = suggest_fixes(in, 16);
  ASSERT_FALSE(fixes.empty());
  EXPECT_EQ(fixes.front().changes,
            std::vector<std::string>{"zoffload.gradient_accumulators: none and bf16.check_grad_overflow: false"});
  EXPECT_THAT(fixes.front().trade, HasSubstr("applied instead of skipped"));
  EXPECT_THAT(fixes.front().result, HasSubstr("; fits"));

  // Already unskipped: exact, bit for bit.
  in.config.bf16.check_grad_overflow = false;
  const std::vector<PlanFix> exact = suggest_fixes(in, 16);
  ASSERT_FALSE(exact.empty());
  EXPECT_EQ(exact.front().changes, std::vector<std::string>{"zoffload.gradient_accumulators: none"});
  EXPECT_EQ(exact.front().trade, "exact: the same weights bit for bit");

  // Two ranks: offered at stage 2 or 3 (each owner steps its partition), not at stage 1, where the
  // gradients are all-reduced whole after backward.
  for (int stage : {1, 3}) {
    PlanInputs ranks = in;
    ranks.world_size = 2;
    ranks.config.zero.stage = stage;
    auto whole = plan_run(ranks);
    ASSERT_TRUE(whole.is_ok()) << whole.status().to_string();
    PlanInputs none = ranks;
    none.config.zoffload.gradient_accumulators = "none";
    auto without = plan_run(none);
    ASSERT_EQ(without.is_ok(), stage == 3) << without.status().to_string();
    if (stage != 3) continue;
    ranks.host.ram_available_bytes = without->ram_bytes + without->process_bytes;
    const std::vector<PlanFix> two = suggest_fixes(ranks, 16);
    ASSERT_FALSE(two.empty());
    EXPECT_EQ(two.front().changes, std::vector<std::string>{"zoffload.gradient_accumulators: none"});
  }

  // With clipping the update needs the step's norm first: not offered.
  in.config.gradient_clipping = 1.0;
  for (const PlanFix& f : suggest_fixes(in, 16))
    for (const std::string& c : f.changes) EXPECT_THAT(c, Not(HasSubstr("gradient_accumulators: none")));
}

// Its sibling with 8-bit moments and everything in RAM: on the same 128 GiB host nothing touches a
// drive. Every llama3-8b tensor has ≥ 4096 elements, so each moment is n + 4⌈n/256⌉ bytes per
// sub-group: the pageable states are the fp32 masters and accumulators (8 B per parameter) and the
// two moments (2 × (1 + 4/256) B), each section of each of the 108 sub-groups rounded up to 4 KiB.
TEST(Planner, TheShipped8bit8bConfigPlansEverythingInRamOnA128GiBHost) {
  const std::optional<PlanInputs> shipped = shipped_8b_on_128gib("llama8b_24gb_8bit_ram.json");
  ASSERT_TRUE(shipped) << "ZO_SOURCE_DIR set and the config loads";
  const PlanInputs& in = *shipped;
  auto p = plan_run(in);
  ASSERT_TRUE(p.is_ok()) << p.status().to_string();
  EXPECT_TRUE(p->fits()) << p->summary();
  EXPECT_EQ(p->memory.placement.moments, MomentDtype::k8bit);
  EXPECT_EQ(p->memory.placement.optimizer, Tier::kCpu);
  EXPECT_EQ(p->memory.placement.grad, Tier::kCpu);
  EXPECT_EQ(p->nvme_read_max_bytes, 0u);
  EXPECT_EQ(p->nvme_write_bytes, 0u);
  EXPECT_EQ(p->memory.nvme_optimizer_bytes + p->memory.nvme_param_bytes, 0u);
  const uint64_t n = p->n_params, groups = p->memory.n_sub_groups;
  EXPECT_EQ(groups, 108u);
  const uint64_t exact = 8 * n + 2 * (n + 4 * (n / 256));  // lower bound: blocks rounded down
  EXPECT_GE(p->memory.cpu_pageable_bytes, exact);
  EXPECT_LE(p->memory.cpu_pageable_bytes, exact + groups * 4 * (4096 + 4096));
  EXPECT_LE(p->ram_bytes + p->process_bytes, in.host.ram_total_bytes / 10 * 9) << p->summary();
}

// Its exact sibling: fp32 masters and moments in RAM (12 bytes per parameter, each section of each
// sub-group rounded up to 4 KiB) and no accumulator, so the same 128 GiB host holds it with no drive
// in the step (Note [No accumulator]).
TEST(Planner, TheShippedExact8bConfigPlansEverythingInRamOnA128GiBHost) {
  const std::optional<PlanInputs> shipped = shipped_8b_on_128gib("llama8b_24gb_exact_ram.json");
  ASSERT_TRUE(shipped) << "ZO_SOURCE_DIR set and the config loads";
  const PlanInputs& in = *shipped;
  auto p = plan_run(in);
  ASSERT_TRUE(p.is_ok()) << p.status().to_string();
  EXPECT_TRUE(p->fits()) << p->summary();
  EXPECT_TRUE(p->memory.placement.no_accumulator);
  EXPECT_EQ(p->memory.placement.moments, MomentDtype::kF32);
  EXPECT_EQ(p->memory.placement.master_dtype, DType::kF32);
  EXPECT_EQ(p->memory.placement.grad_dtype, DType::kF32);
  EXPECT_EQ(p->nvme_read_max_bytes + p->nvme_write_bytes, 0u);
  EXPECT_EQ(p->memory.nvme_optimizer_bytes + p->memory.nvme_param_bytes, 0u);
  const uint64_t n = p->n_params, groups = p->memory.n_sub_groups;
  EXPECT_GE(p->memory.cpu_pageable_bytes, 12 * n);
  EXPECT_LE(p->memory.cpu_pageable_bytes, 12 * n + groups * 3 * 4096);
  EXPECT_LE(p->ram_bytes + p->process_bytes, in.host.ram_total_bytes / 10 * 9) << p->summary();
}

// Note [Vertical schedule]: every micro-batch's checkpoints held at once, the gradients sent once
// per step in grad_accum_dtype, the NVMe accumulators written once per step.
TEST(Planner, VerticalScheduleHoldsEveryMicroBatchAndMovesGradientsOnce) {
  PlanInputs in = tiny_inputs(OffloadDevice::kNvme, OffloadDevice::kCpu);
  in.config.bf16.enabled = true;  // bf16 compute, fp32 accumulators
  in.config.gradient_accumulation_steps = 4;
  auto horizontal = plan_run(in);
  in.config.zoffload.schedule = "vertical";
  auto vertical = plan_run(in);
  ASSERT_TRUE(horizontal.is_ok() && vertical.is_ok());
  EXPECT_EQ(horizontal->held_micro_batches, 1u);
  EXPECT_EQ(vertical->held_micro_batches, 4u);
  EXPECT_GT(vertical->activation_bytes, horizontal->activation_bytes);
  EXPECT_THAT(vertical->summary(), HasSubstr("for 4 micro-batches, vertical"));
  // The ring lands fp32 sums instead of bf16 gradients.
  EXPECT_EQ(vertical->grad_ring_bytes, 2 * horizontal->grad_ring_bytes);
  // Three fewer accumulator writes and read-backs of every gradient section per step.
  const uint64_t grad_file = horizontal->n_params * 4;
  EXPECT_GE(horizontal->nvme_write_bytes - vertical->nvme_write_bytes, 3 * grad_file);
  EXPECT_GE(horizontal->nvme_read_bytes - vertical->nvme_read_bytes, 3 * grad_file);
  EXPECT_EQ(vertical->h2d_max_bytes * 4, horizontal->h2d_max_bytes);
}

// Note [Checkpoints on the CPU]: "auto" moves the layers' inputs to pinned host memory exactly when
// that is what makes the GPU fit; "cpu" always; the emulated device never needs it.
TEST(Planner, CheckpointsMoveToTheCpuWhenThatIsWhatFitsTheGpu) {
  PlanInputs in = tiny_inputs(OffloadDevice::kCpu, OffloadDevice::kCpu);
  in.config.bf16.enabled = true;
  in.config.gradient_accumulation_steps = 8;
  in.config.train_micro_batch_size_per_gpu = 4;
  in.config.zoffload.schedule = "vertical";
  in.host.cuda = true;
  in.config.zoffload.activation_checkpoints = "device";
  auto on_device = plan_run(in);
  in.config.zoffload.activation_checkpoints = "cpu";
  auto on_cpu = plan_run(in);
  ASSERT_TRUE(on_device.is_ok() && on_cpu.is_ok());
  EXPECT_FALSE(on_device->checkpoints_on_host);
  EXPECT_EQ(on_device->checkpoint_host_bytes, 0u);
  ASSERT_TRUE(on_cpu->checkpoints_on_host);
  // Every layer's input of every held micro-batch, in the compute dtype; three per micro-batch
  // stay on the device.
  const ModelConfig& m = in.model;
  const uint64_t slot = 4 * in.seq_len * m.hidden_size * 2;
  EXPECT_EQ(on_cpu->checkpoint_host_bytes, 8 * m.num_hidden_layers * slot);
  EXPECT_EQ(on_device->activation_bytes - on_cpu->activation_bytes, 8 * (m.num_hidden_layers + 1 - 3) * slot);
  EXPECT_EQ(on_cpu->pinned_bytes, on_device->pinned_bytes + on_cpu->checkpoint_host_bytes);
  EXPECT_EQ(on_cpu->ram_bytes, on_device->ram_bytes + on_cpu->checkpoint_host_bytes);
  EXPECT_THAT(on_cpu->summary(), HasSubstr("checkpoints on the CPU"));

  // "auto": a card between the two totals takes them to the CPU; a larger one keeps them.
  in.config.zoffload.activation_checkpoints = "auto";
  in.host.device_total_bytes = (on_device->device_total_bytes + on_cpu->device_total_bytes) / 2;
  auto tight = plan_run(in);
  ASSERT_TRUE(tight.is_ok());
  EXPECT_TRUE(tight->checkpoints_on_host);
  EXPECT_TRUE(tight->fits()) << tight->summary();
  in.host.device_total_bytes = on_device->device_total_bytes;
  auto roomy = plan_run(in);
  ASSERT_TRUE(roomy.is_ok());
  EXPECT_FALSE(roomy->checkpoints_on_host);
  // Too small either way (below the arena's minimum beside the activations on the CPU): on the
  // CPU, where the shortfall the problem names is the smaller one, and the fixes start from there.
  in.host.device_total_bytes = on_cpu->device_state_bytes + on_cpu->arena.persistent_bytes +
                               on_cpu->arena.largest_block_bytes + on_cpu->activation_bytes - 1;
  auto small = plan_run(in);
  ASSERT_TRUE(small.is_ok());
  EXPECT_TRUE(small->checkpoints_on_host);
  ASSERT_FALSE(small->fits());
  EXPECT_EQ(small->problems.front().need_bytes, small->problems.front().have_bytes + 1);
  // Emulated: activations live in host RAM already.
  in.host.cuda = false;
  auto host = plan_run(in);
  ASSERT_TRUE(host.is_ok());
  EXPECT_FALSE(host->checkpoints_on_host);
}

// Note [The budget holds LibTorch too]: on a GPU, zoffload.gpu_memory_limit bounds the states, the
// arena and LibTorch's activations together; the arena takes what is left, down to its minimum.
TEST(Planner, OnAGpuTheBudgetHoldsTheActivationsAndTheArenaTakesTheRest) {
  PlanInputs in = tiny_inputs(OffloadDevice::kCpu, OffloadDevice::kCpu);
  in.config.bf16.enabled = true;
  in.config.train_micro_batch_size_per_gpu = 8;
  in.host.cuda = true;
  in.host.device_total_bytes = uint64_t{80} << 30;  // the card is far larger than the budget
  in.device_budget_bytes = uint64_t{1} << 30;
  auto roomy = plan_run(in);
  ASSERT_TRUE(roomy.is_ok());
  ASSERT_TRUE(roomy->fits()) << roomy->summary();
  EXPECT_EQ(roomy->device_torch_reserve_bytes, roomy->activation_bytes);
  EXPECT_EQ(roomy->device_arena_bytes, roomy->arena.total_bytes());  // all it wants
  const uint64_t arena_min = roomy->arena.persistent_bytes + roomy->arena.largest_block_bytes;
  ASSERT_LT(arena_min, roomy->arena.total_bytes());

  // A budget between the minimum and what the arena wants: it fits, with a smaller arena, and the
  // total stays within the budget.
  in.device_budget_bytes =
      roomy->device_state_bytes + roomy->activation_bytes + (arena_min + roomy->arena.total_bytes()) / 2;
  auto tight = plan_run(in);
  ASSERT_TRUE(tight.is_ok());
  EXPECT_TRUE(tight->fits()) << tight->summary();
  EXPECT_LT(tight->device_arena_bytes, roomy->arena.total_bytes());
  EXPECT_GE(tight->device_arena_bytes, arena_min);
  EXPECT_LE(tight->device_total_bytes, in.device_budget_bytes);

  // Below the minimum beside the activations: with the checkpoints kept on the device, a GPU
  // memory problem that names them, although the card itself has room; "auto" moves them to the
  // CPU instead, and it fits.
  in.device_budget_bytes = roomy->device_state_bytes + roomy->activation_bytes + arena_min - 1;
  in.config.zoffload.activation_checkpoints = "auto";
  auto moved = plan_run(in);
  ASSERT_TRUE(moved.is_ok());
  EXPECT_TRUE(moved->checkpoints_on_host);
  EXPECT_TRUE(moved->fits()) << moved->summary();
  in.config.zoffload.activation_checkpoints = "device";
  auto small = plan_run(in);
  ASSERT_TRUE(small.is_ok());
  ASSERT_FALSE(small->fits());
  EXPECT_EQ(small->problems.front().resource, "GPU memory");
  EXPECT_EQ(small->problems.front().have_bytes, in.device_budget_bytes);
  EXPECT_THAT(small->problems.front().detail, HasSubstr("LibTorch's activations"));
  EXPECT_THAT(small->problems.front().detail, HasSubstr("zoffload.gpu_memory_limit"));

  // The emulated device keeps the activations in host RAM: the budget holds states and arena.
  in.host.cuda = false;
  auto host = plan_run(in);
  ASSERT_TRUE(host.is_ok());
  EXPECT_TRUE(host->fits()) << host->summary();
  EXPECT_EQ(host->device_torch_reserve_bytes, 0u);
}

TEST(Planner, RefusesAbsurdModelSizesBeforeBuildingAnything) {
  PlanInputs in = tiny_inputs(OffloadDevice::kCpu, OffloadDevice::kCpu);
  in.model.hidden_size = 1'000'000'000'000;
  auto p = plan_run(in);
  ASSERT_FALSE(p.is_ok());
  EXPECT_EQ(p.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(p.status().message(), HasSubstr("hidden_size 1000000000000"));
  in = tiny_inputs(OffloadDevice::kCpu, OffloadDevice::kCpu);
  in.model.num_hidden_layers = uint64_t{1} << 40;
  EXPECT_EQ(check_model_size(in.model).code(), StatusCode::kInvalidArgument);
  // Few parameters but a billion tensors: refused by count, not by running out of memory.
  in = tiny_inputs(OffloadDevice::kCpu, OffloadDevice::kCpu);
  in.model.hidden_size = in.model.intermediate_size = in.model.head_dim = 1;
  in.model.num_attention_heads = in.model.num_key_value_heads = 1;
  in.model.num_hidden_layers = uint64_t{1} << 30;
  Status layers = check_model_size(in.model);
  EXPECT_EQ(layers.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(layers.message(), HasSubstr("1073741824 layers"));
  in = tiny_inputs(OffloadDevice::kCpu, OffloadDevice::kCpu);
  in.model.num_attention_heads = in.model.num_key_value_heads = 8'000'000'000;
  in.model.head_dim = 1;
  EXPECT_THAT(check_model_size(in.model).message(), HasSubstr("8000000000 attention heads"));
}

TEST(ParamRegistryLimits, TooManySubGroupsAreRefusedBeforeTheTableIsBuilt) {
  // 2^37 elements at the smallest sub_group_size would be 2^25 sub-groups: refused with the size
  // that would do, without allocating the table (a test that ran out of memory would not finish).
  std::vector<ParamSpec> params = {{"model.embed_tokens.weight", {int64_t{1} << 20, int64_t{1} << 17}}};
  auto r = ParamRegistry::build(params, kSplitAlignElems);
  ASSERT_FALSE(r.is_ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("zero_optimization.sub_group_size: 4096"));
  EXPECT_THAT(r.status().message(), HasSubstr("raise it to at least 12288"));
  EXPECT_TRUE(ParamRegistry::build(params, uint64_t{1} << 20).is_ok());
}

TEST(Planner, ShortfallsAreNamedAndTheFixesFitWhenPlannedAgain) {
  PlanInputs in = tiny_inputs(OffloadDevice::kCpu, OffloadDevice::kCpu);
  in.host.memlock_limit_bytes = 1 << 20;  // ulimit -l 1 MiB: the pinned pool cannot be locked
  auto p = plan_run(in);
  ASSERT_TRUE(p.is_ok());
  ASSERT_FALSE(p->fits());
  EXPECT_EQ(p->problems.front().resource, "locked memory (ulimit -l)");
  EXPECT_THAT(p->summary(), HasSubstr("does NOT fit"));
  const std::vector<PlanFix> fixes = suggest_fixes(in);
  ASSERT_FALSE(fixes.empty());
  EXPECT_THAT(fixes.front().changes.front(), HasSubstr("pin_memory"));
  for (const PlanFix& f : fixes) EXPECT_THAT(f.result, HasSubstr("; fits"));
}

// Note [Address space]: under ulimit -v the plan counts what the process maps. Here 2 CPUs and
// aio.intra_op_parallelism 1 make 2*2 + 1 + 10 = 15 threads, each with an 8 MiB stack and (15 ≤ 8*2)
// its own 64 MiB arena: 15 * 72 MiB = 1080 MiB on top of the 3 GiB the process maps already.
TEST(Planner, UlimitVCountsTheProcessTheRunAndItsThreads) {
  PlanInputs in = tiny_inputs(OffloadDevice::kCpu, OffloadDevice::kCpu);
  in.host.process_virtual_bytes = uint64_t{3} << 30;
  in.host.thread_stack_bytes = uint64_t{8} << 20;
  in.host.logical_cpus = 2;
  auto unlimited = plan_run(in);
  ASSERT_TRUE(unlimited.is_ok());
  EXPECT_TRUE(unlimited->fits());
  EXPECT_EQ(unlimited->thread_reserve_bytes, uint64_t{1080} << 20);
  const uint64_t need =
      (uint64_t{3} << 30) + unlimited->ram_bytes + unlimited->device_total_bytes + (uint64_t{1080} << 20);
  EXPECT_EQ(unlimited->address_space_bytes, need);
  in.host.address_space_limit_bytes = need - 1;
  auto short_by_one = plan_run(in);
  ASSERT_TRUE(short_by_one.is_ok());
  ASSERT_FALSE(short_by_one->fits());
  EXPECT_EQ(short_by_one->problems.front().resource, "address space (ulimit -v)");
  EXPECT_THAT(short_by_one->problems.front().detail, HasSubstr("raise ulimit -v"));
  in.host.address_space_limit_bytes = need;
  EXPECT_TRUE(plan_run(in)->fits());
}

TEST(Planner, ADeviceBudgetBelowTheLargestBlockIsAProblemNamingIt) {
  PlanInputs in = tiny_inputs(OffloadDevice::kCpu, OffloadDevice::kCpu);
  in.device_budget_bytes = 16 << 10;
  auto p = plan_run(in);
  ASSERT_TRUE(p.is_ok());
  ASSERT_FALSE(p->fits());
  EXPECT_EQ(p->problems.front().resource, "device budget");
  EXPECT_THAT(p->problems.front().detail, HasSubstr("block 'model."));
}

TEST(Planner, NoRoomForTheSwapFileIsADiskProblem) {
  PlanInputs in = tiny_inputs(OffloadDevice::kNvme, OffloadDevice::kCpu);
  in.host.optimizer_disk_free_bytes = 1 << 20;
  auto p = plan_run(in);
  ASSERT_TRUE(p.is_ok());
  ASSERT_FALSE(p->fits());
  EXPECT_THAT(p->problems.front().resource, HasSubstr("disk at nvme"));
}

TEST(Planner, StepTimePutsTheAccumulatorWritesInBackwardAndTheRestBesideAdam) {
  PlanInputs in = tiny_inputs(OffloadDevice::kNvme, OffloadDevice::kCpu);
  in.config.gradient_accumulation_steps = 2;
  in.speeds.nvme_read_bytes_per_s = 1e9;
  in.speeds.nvme_write_bytes_per_s = 2e9;
  in.speeds.adam_elems_per_s = 1e6;  // slow enough that Adam, not the drive, bounds the optimizer
  in.speeds.accumulate_elems_per_s = 1e8;
  in.speeds.compute_flops = 1e10;
  auto p = plan_run(in);
  ASSERT_TRUE(p.is_ok()) << p.status().to_string();
  std::map<std::string, double> s;
  for (const StepTimePart& t : p->time_parts) s[t.name] = t.seconds;
  ASSERT_EQ(s.size(), 5u) << p->to_json();
  // The accumulators: written at both micro-steps, read back at the second.
  const double grad_file = static_cast<double>(p->n_params) * 4;
  EXPECT_NEAR(s["nvme grads"], 2 * grad_file / 2e9 + grad_file / 1e9, 0.01 * s["nvme grads"]);
  EXPECT_NEAR(s["nvme grads"] + s["nvme optim"],
              static_cast<double>(p->nvme_read_bytes) / 1e9 + static_cast<double>(p->nvme_write_bytes) / 2e9, 1e-9);
  EXPECT_GT(s["optimizer"], s["nvme optim"]);
  // Horizontal GAS 2: the optimizer beside the first pass's forward only (Note [Step-time range]).
  const double fwd = s["compute"] / 4;  // 2 of the 8 FLOPs a weight and token
  EXPECT_NEAR(p->step_s_high, std::max(fwd / 2, s["optimizer"]) + fwd / 2 + 3 * fwd + s["gradients"] + s["nvme grads"],
              1e-9 * p->step_s_high);
  EXPECT_GE(p->step_s_low, std::max({s["compute"], s["optimizer"], s["nvme grads"] + s["nvme optim"]}));
}

// The optimizer's time is the measured kernel of the placement's masters and moments; a kernel not
// measured is stood in for by the nearest one, and the basis says which.
TEST(Planner, TheOptimizerIsTimedByItsOwnMastersAndMomentsKernel) {
  PlanInputs in = tiny_inputs(OffloadDevice::kCpu, OffloadDevice::kCpu);
  in.config.bf16.enabled = true;
  in.speeds.adam_elems_per_s = 4e8;
  in.speeds.adam8bit_elems_per_s = 2e8;
  in.speeds.adam_bf16_moments_elems_per_s = 5e8;
  in.speeds.bf16_master_elems_per_s[0] = 6e8;
  in.speeds.bf16_master_elems_per_s[2] = 1e8;
  auto optimizer_part = [](const PlanInputs& q) {
    auto p = plan_run(q);
    EXPECT_TRUE(p.is_ok());
    for (const StepTimePart& t : p->time_parts)
      if (t.name == "optimizer") return std::make_tuple(t.seconds * 1e9 / static_cast<double>(p->n_params), t.basis);
    return std::make_tuple(0.0, std::string("no optimizer part"));
  };
  struct Want {
    const char* masters;
    const char* moments;
    double rate;
    const char* basis;
  };
  for (const Want& w : {Want{"fp32", "fp32", 4e8, "with fp32 masters and fp32 moments, measured"},
                        Want{"fp32", "bf16", 5e8, "with fp32 masters and bf16 moments, measured"},
                        Want{"fp32", "8bit", 2e8, "with fp32 masters and 8-bit moments, measured"},
                        Want{"bf16", "fp32", 6e8, "with bf16 masters and fp32 moments, measured"},
                        Want{"bf16", "8bit", 1e8, "with bf16 masters and 8-bit moments, measured"},
                        Want{"bf16", "bf16", 5e8, "measured with fp32 masters and bf16 moments"}}) {
    SCOPED_TRACE(std::string(w.masters) + " masters, " + w.moments + " moments");
    PlanInputs q = in;
    q.config.zoffload.master_dtype = w.masters;
    q.config.zoffload.moment_dtype = w.moments;
    const auto [seconds_per_1e9, basis] = optimizer_part(q);
    EXPECT_NEAR(seconds_per_1e9 * w.rate, 1e9, 1.0);
    EXPECT_THAT(basis, HasSubstr(w.basis));
  }
}

TEST(Planner, IoResultsAreReadAtTheConfigsAioSettings) {
  const std::string path = ::testing::TempDir() + "/zo_plan_io.json";
  {
    std::ofstream f(path);
    f << R"({"auto_backend": "io_uring", "results": [
      {"backend": "io_uring", "block_size": 131072, "queue_depth": 32, "threads": 1, "read_gbps": 3.0, "write_gbps": 4.0},
      {"backend": "libaio", "block_size": 1048576, "queue_depth": 8, "threads": 1, "read_gbps": 1.5, "write_gbps": 1.6},
      {"backend": "io_uring", "block_size": 1048576, "queue_depth": 8, "threads": 1, "read_gbps": 1.0, "write_gbps": 2.0}],
      "best": {"backend": "io_uring", "block_size": 131072, "queue_depth": 32, "threads": 1, "read_gbps": 3.0, "write_gbps": 4.0}})";
  }
  Config config;  // aio defaults: 1 MiB, queue depth 8, one thread; io_backend auto
  HostSpeeds sp;
  ASSERT_TRUE(read_io_results(path, config, &sp).is_ok());
  EXPECT_DOUBLE_EQ(sp.nvme_read_bytes_per_s, 1.0e9);  // auto is io_uring here, not libaio's row
  EXPECT_DOUBLE_EQ(sp.nvme_write_bytes_per_s, 2.0e9);
  EXPECT_THAT(sp.nvme_source, HasSubstr("at the config's aio"));

  config.zoffload.io_backend = "libaio";
  ASSERT_TRUE(read_io_results(path, config, &sp).is_ok());
  EXPECT_DOUBLE_EQ(sp.nvme_read_bytes_per_s, 1.5e9);

  config.aio.queue_depth = 64;  // not in the sweep: the best row, said so
  ASSERT_TRUE(read_io_results(path, config, &sp).is_ok());
  EXPECT_DOUBLE_EQ(sp.nvme_read_bytes_per_s, 3.0e9);
  EXPECT_THAT(sp.nvme_source, HasSubstr("best row"));

  {
    std::ofstream f(path);
    f << R"({"results": []})";
  }
  Status st = read_io_results(path, config, &sp);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("zoffload-bench io --json"));
  std::remove(path.c_str());
}

// Note [Gradients that land where they are summed]: without accumulators, fp32 sums arriving in fp32
// land in the sums' buffers, which the pool then holds (pinned, for DMA) instead of the host's
// pageable buffers, and the ring shrinks to the gradients that are added there: a tied matrix's two
// uses, or nothing (its 4 KiB minimum). Bf16 gradients (horizontal bf16 compute) still land in the
// ring and are added into pageable sums.
TEST(Planner, GradientsThatLandInPlaceTakeTheRingsPlaceInThePool) {
  PlanInputs in = tiny_inputs(OffloadDevice::kCpu, OffloadDevice::kCpu);
  in.config.zoffload.gradient_accumulators = "none";
  in.config.gradient_clipping = 0;
  auto in_place = plan_run(in);  // fp32: sums and gradients in fp32
  ASSERT_TRUE(in_place.is_ok()) << in_place.status().to_string();
  const MemoryPlan& m = in_place->memory;
  const GradAccumulator::BufferPlan buffers =
      GradAccumulator::plan_buffers(*ParamRegistry::build(model_layout(in.model).params, in.config.zero.sub_group_size),
                                    m.placement, contribution_order(model_layout(in.model)));
  EXPECT_EQ(m.landing_buffers, buffers.count);
  EXPECT_EQ(m.landing_buffer_bytes, buffers.bytes_each);
  EXPECT_EQ(m.grad_ring_bytes, kMinGradRingBytes);   // untied: every gradient lands in place
  EXPECT_EQ(in_place->host_buffer_bytes, 4u << 20);  // only the store's scratch is pageable
  EXPECT_GE(in_place->pool_bytes, m.cpu_pinned_bytes + uint64_t{buffers.count} * buffers.bytes_each);

  in.model.tie_word_embeddings = true;  // the embedding's two gradients are added in the ring
  auto tied = plan_run(in);
  ASSERT_TRUE(tied.is_ok()) << tied.status().to_string();
  EXPECT_EQ(tied->memory.grad_ring_bytes, in.model.vocab_size * in.model.hidden_size * 4);
  EXPECT_GT(tied->memory.landing_buffers, 0u);

  in.model.tie_word_embeddings = false;
  in.config.bf16.enabled = true;  // bf16 gradients into fp32 sums: through the ring, as before
  in.config.bf16.check_grad_overflow = false;
  auto ring = plan_run(in);
  ASSERT_TRUE(ring.is_ok()) << ring.status().to_string();
  EXPECT_EQ(ring->memory.landing_buffers, 0u);
  EXPECT_EQ(ring->memory.grad_ring_bytes, 725504u * 2);  // a decoder layer's bf16 gradients
  EXPECT_GT(ring->host_buffer_bytes, 4u << 20);
}

}  // namespace
}  // namespace zo::engine

#include "engine/plan/fixes.h"

#include <algorithm>
#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "engine/model/model_config.h"
#include "tests/engine/plan/shipped_inputs.h"

namespace zo::engine {
namespace {

using ::testing::HasSubstr;

constexpr uint64_t kGiB = uint64_t{1} << 30;

// llama3-8b at seq 1024 with a shipped config on the machine `zoffload plan --host-ram RAM
// --gpu-memory 24GiB --disk-free 2TB` describes: RAM as MemAvailable, no ulimit, a 24 GiB card,
// 2 TB free where the swap files would go. The process is LibTorch's with CUDA (2 GiB), more than
// `plan` measures without it, so what fits here fits there.
std::optional<PlanInputs> llama8b_on(const std::string& file, uint64_t host_ram_bytes) {
  std::optional<PlanInputs> in = shipped_llama8b(file, host_ram_bytes, host_ram_bytes, "a GPU of 24 GiB", 24 * kGiB);
  if (!in) return std::nullopt;
  in->host.optimizer_disk_free_bytes = in->host.param_disk_free_bytes = uint64_t{2'000'000'000'000};
  in->disk_free_given = true;
  return in;
}

// The config a user gets by merging a fix's keys into theirs, read by the config checker itself.
std::optional<Config> merged(const Config& base, const std::string& config_json, std::string* errors) {
  nlohmann::json j = to_json(base);
  j.merge_patch(nlohmann::json::parse(config_json));
  ConfigDiagnostics d;
  std::optional<Config> c = parse_config_json(j, ResolveContext{}, &d);
  for (const ConfigIssue& e : d.errors) *errors += e.to_string() + "\n";
  return c;
}

// `in` planned again with `fix`'s keys merged into its config as a user would merge them: the
// checker must accept them and the plan must fit; nullopt (with a test failure) otherwise.
std::optional<RunPlan> planned_with(const PlanInputs& in, const PlanFix& fix) {
  std::string errors;
  std::optional<Config> c = merged(in.config, fix.config_json, &errors);
  EXPECT_TRUE(c) << errors;
  if (!c) return std::nullopt;
  PlanInputs applied = in;
  applied.config = *c;
  Result<RunPlan> q = plan_run(applied);
  EXPECT_TRUE(q.is_ok()) << q.status().to_string();
  if (!q.is_ok()) return std::nullopt;
  EXPECT_TRUE(q->fits()) << q->summary();
  return *q;
}

const PlanFix* find_fix(const std::vector<PlanFix>& fixes, const std::vector<std::string>& changes) {
  for (const PlanFix& f : fixes)
    if (f.changes == changes) return &f;
  return nullptr;
}

// llama3-8b: embedding and head 128256 × 4096 = 525,336,576 each (untied), 32 layers of
// q, o 4096² + k, v 1024 × 4096 + gate, up, down 3 × 4096 × 14336 + two norms 2 × 4096 =
// 218,112,000, and the final norm 4096: n = 8,030,261,248 parameters.
constexpr uint64_t kLlama8bParams = 2 * uint64_t{525'336'576} + 32 * uint64_t{218'112'000} + 4096;

// Note [Lean combinations]: `configs/llama8b_24gb_exact_ram.json` (fp32 masters and moments in RAM,
// no accumulator, bf16 compute copies pinned) on a 60 GiB host. Bytes per parameter of its pageable
// states, n = 8.03 B (1 GiB = 1.0737 GB, so 1 B/param = 7.48 GiB):
//   as configured: masters 4 + moments 4 + 4 = 12 B (89.7 GiB)        does not fit
//   bf16-stored gradients: no accumulator to narrow, still 12 B       does not fit
//   bf16 moments: 4 + 2 + 2 = 8 B (59.8 GiB)                          does not fit
//   8-bit moments: 4 + 2 × (1 + 4/256) = 6.03 B (45.1 GiB)            does not fit
//   bf16 masters: the master is the pinned compute copy, 0 + 8 = 8 B  does not fit
//   bf16 moments and bf16 masters: 0 + 4 = 4 B (29.9 GiB)             fits
// Beside them: the pinned pool (the bf16 compute copies, 2 B = 15.0 GiB, with the swap and landing
// buffers: 16.9 GiB), the sums of the sub-groups open at once (2.6 GiB) and the process (2 GiB),
// which leave 38.5 GiB of the 60 for states, 5.1 B a parameter. The least lossy combination
// under it is bf16 moments with bf16 masters (8-bit moments with bf16 masters, 2.03 B, fit too but
// round the moments harder); the optimizer on the drive, exact, is still offered first.
TEST(LeanFixes, Llama8bExactConfigOn60GiBGetsBf16MomentsAndMastersAfterTheDrive) {
  const std::optional<PlanInputs> shipped = llama8b_on("llama8b_24gb_exact_ram.json", 60 * kGiB);
  ASSERT_TRUE(shipped) << "ZO_SOURCE_DIR set and the config loads";
  const PlanInputs& in = *shipped;
  auto p = plan_run(in);
  ASSERT_TRUE(p.is_ok()) << p.status().to_string();
  ASSERT_EQ(p->n_params, kLlama8bParams);
  ASSERT_FALSE(p->fits()) << p->summary();
  EXPECT_GE(p->memory.cpu_pageable_bytes, 12 * kLlama8bParams);

  const std::vector<PlanFix> fixes = suggest_fixes(in);
  ASSERT_FALSE(fixes.empty());
  EXPECT_EQ(fixes.front().changes, std::vector<std::string>{"zero_optimization.offload_optimizer.device: nvme"});
  EXPECT_EQ(fixes.front().trade, "exact: the same weights bit for bit");
  const PlanFix* lean = find_fix(fixes, {"zoffload.moment_dtype: bf16", "zoffload.master_dtype: bf16"});
  ASSERT_NE(lean, nullptr) << fixes.back().changes.front();
  EXPECT_EQ(lean, &fixes.back()) << "after every exact fix";
  EXPECT_THAT(lean->result, HasSubstr("; fits"));
  EXPECT_THAT(lean->trade, HasSubstr("stored in bf16"));
  EXPECT_THAT(lean->trade, HasSubstr("stochastic"));
  EXPECT_EQ(nlohmann::json::parse(lean->config_json),
            nlohmann::json::parse(R"({"zoffload": {"moment_dtype": "bf16", "master_dtype": "bf16"}})"));
  for (const PlanFix& f : fixes) {
    EXPECT_THAT(f.result, HasSubstr("; fits"));
    EXPECT_NE(f.changes, std::vector<std::string>{"zoffload.moment_dtype: 8bit"}) << "6.03 B a parameter: 66 GiB";
  }

  // The keys merged into the config as a user would: the checker accepts them and the plan fits,
  // with 4 bytes a parameter of pageable states (the two bf16 moments, each section of each of the
  // 108 sub-groups rounded up to 4 KiB).
  std::optional<RunPlan> q = planned_with(in, *lean);
  ASSERT_TRUE(q);
  EXPECT_EQ(q->memory.placement.moments, MomentDtype::kBF16);
  EXPECT_EQ(q->memory.placement.master_dtype, DType::kBF16);
  EXPECT_EQ(q->memory.nvme_optimizer_bytes + q->memory.nvme_param_bytes, 0u) << "everything still in RAM";
  EXPECT_GE(q->memory.cpu_pageable_bytes, 4 * kLlama8bParams);
  EXPECT_LE(q->memory.cpu_pageable_bytes, 4 * kLlama8bParams + q->memory.n_sub_groups * 2 * 4096);
  EXPECT_LT(q->ram_bytes + q->process_bytes, 54 * kGiB) << q->summary();

  // The next lighter combinations, as the arithmetic says, do not fit: 8-bit moments alone, bf16
  // masters alone, and bf16 moments alone.
  for (const char* key : {"moment_dtype:8bit", "master_dtype:bf16", "moment_dtype:bf16"}) {
    const std::string k(key);
    PlanInputs one = in;
    if (k == "moment_dtype:8bit") one.config.zoffload.moment_dtype = "8bit";
    if (k == "master_dtype:bf16") one.config.zoffload.master_dtype = "bf16";
    if (k == "moment_dtype:bf16") one.config.zoffload.moment_dtype = "bf16";
    auto r = plan_run(one);
    ASSERT_TRUE(r.is_ok());
    EXPECT_FALSE(r->fits()) << key << ": " << r->summary();
  }
}

// `configs/llama8b_24gb_8bit_ram.json` (fp32 masters and accumulators, 8-bit moments, clipping on)
// on a 60 GiB host: 4 + 4 + 2.03 = 10.03 B a parameter (75.0 GiB). bf16-stored gradients alone
// leave 8.03 B (60.1 GiB), bf16 masters alone 6.03 B (45.1 GiB, with the 16.9 GiB pool and the
// process 64.0 GiB); both, 2 + 2.03 = 4.03 B (30.1 GiB, plus the 2.6 GiB of fp32 sums the worker
// then keeps: about 51.6 GiB with the process) fit. With clipping on, no accumulator is not offered.
TEST(LeanFixes, Llama8b8bitConfigOn60GiBGetsBf16GradientsAndMasters) {
  const std::optional<PlanInputs> shipped = llama8b_on("llama8b_24gb_8bit_ram.json", 60 * kGiB);
  ASSERT_TRUE(shipped) << "ZO_SOURCE_DIR set and the config loads";
  const PlanInputs& in = *shipped;
  ASSERT_FALSE(plan_run(in)->fits());
  const std::vector<PlanFix> fixes = suggest_fixes(in);
  ASSERT_FALSE(fixes.empty());
  EXPECT_EQ(fixes.front().trade, "exact: the same weights bit for bit");
  const PlanFix* lean = find_fix(fixes, {"zoffload.gradient_store_dtype: bf16", "zoffload.master_dtype: bf16"});
  ASSERT_NE(lean, nullptr);
  EXPECT_EQ(nlohmann::json::parse(lean->config_json),
            nlohmann::json::parse(R"({"zoffload": {"gradient_store_dtype": "bf16", "master_dtype": "bf16"}})"));
  for (const PlanFix& f : fixes)
    for (const std::string& change : f.changes) EXPECT_THAT(change, ::testing::Not(HasSubstr("accumulators: none")));

  std::optional<RunPlan> q = planned_with(in, *lean);
  ASSERT_TRUE(q);
  EXPECT_EQ(q->memory.placement.moments, MomentDtype::k8bit);
  EXPECT_EQ(q->memory.placement.grad_dtype, DType::kBF16);
  // Accumulators 2 B and moments n + 4⌈n/256⌉ each (every tensor of llama3-8b has ≥ 4096 elements):
  // 4.03 B a parameter give or take the blocks' rounding and a page per section.
  const uint64_t n = kLlama8bParams, low = 2 * n + 2 * (n + 4 * (n / 256));
  EXPECT_GE(q->memory.cpu_pageable_bytes, low);
  EXPECT_LE(q->memory.cpu_pageable_bytes, low + q->memory.n_sub_groups * 3 * (4096 + 4096));
  EXPECT_LT(q->ram_bytes + q->process_bytes, 54 * kGiB) << q->summary();
}

// The tiny preset at seq 64, stage 3, parameters, optimizer and accumulators on the CPU, sub-groups
// of 65,536, on a host with 64 GiB of RAM and a 64 GiB device given 1 GiB.
PlanInputs tiny_in_ram() {
  PlanInputs in;
  in.config.zero.stage = 3;
  in.config.zero.sub_group_size = 65536;
  in.config.zero.offload_optimizer.device = OffloadDevice::kCpu;
  in.config.zero.offload_param.device = OffloadDevice::kCpu;
  in.config.zoffload.gradient_accumulators = "cpu";
  in.model = *model_preset("tiny");
  in.model_name = "tiny";
  in.seq_len = 64;
  in.device_budget_bytes = kGiB;
  in.host.ram_total_bytes = in.host.ram_available_bytes = 64 * kGiB;
  in.host.device_total_bytes = 64 * kGiB;
  return in;
}

// A change the config checker refuses is not offered, however well it plans: bf16-stored gradients
// without the vertical schedule at GAS 2 (the host would never see the step's whole sum at once).
// The offered change carries the schedule with it, and its keys say so.
TEST(LeanFixes, AChangeTheConfigCheckerRefusesIsNotOffered) {
  PlanInputs in = tiny_in_ram();
  in.config.gradient_accumulation_steps = 2;
  in.config.train_batch_size = 2;

  const ConfigChange bare{"zoffload.gradient_store_dtype: bf16",
                          [](Config& c) {
                            c.zoffload.gradient_store_dtype = "bf16";
                            return true;
                          },
                          "rounds", true};
  Config horizontal = in.config;
  ASSERT_TRUE(bare.apply(horizontal));
  const std::vector<std::string> refused = refused_keys(in.config, horizontal, 1);
  ASSERT_EQ(refused.size(), 1u);
  EXPECT_THAT(refused.front(), HasSubstr("zoffload.gradient_store_dtype"));
  EXPECT_THAT(refused.front(), HasSubstr("vertical"));
  EXPECT_FALSE(plan_with_changes(in, {&bare})) << "the plan alone would fit; the checker refuses it";

  const std::vector<ConfigChange> lean = lean_state_changes(in.config, 1);
  ASSERT_FALSE(lean.empty());
  ASSERT_EQ(lean.front().change, "zoffload.gradient_store_dtype: bf16 and zoffload.schedule: vertical");
  const std::optional<PlanFix> fix = plan_with_changes(in, {&lean.front()});
  ASSERT_TRUE(fix);
  EXPECT_EQ(nlohmann::json::parse(fix->config_json),
            nlohmann::json::parse(R"({"zoffload": {"gradient_store_dtype": "bf16", "schedule": "vertical"}})"));
  std::string errors;
  EXPECT_TRUE(merged(in.config, fix->config_json, &errors)) << errors;
}

// Note [Lean combinations]: the search returns the least lossy fitting combination, a lossier
// change only where the less lossy ones cannot do it, and tries each combination once. On the tiny
// preset with fp32 states in RAM: a host that holds bf16 moments with bf16 masters gets them, not
// 8-bit moments with bf16 masters (which hold less); one that holds only 8-bit moments, bf16-stored
// gradients and bf16 masters together gets those three; one that holds nothing gets nothing.
TEST(LeanFixes, TheSearchReturnsTheLeastLossyFittingCombination) {
  PlanInputs in = tiny_in_ram();
  in.config.bf16.enabled = true;
  const std::vector<ConfigChange> lean = lean_state_changes(in.config, 1);
  std::vector<std::string> names;
  for (const ConfigChange& c : lean) names.push_back(c.change);
  ASSERT_EQ(names, (std::vector<std::string>{"zoffload.gradient_store_dtype: bf16", "zoffload.moment_dtype: bf16",
                                             "zoffload.moment_dtype: 8bit", "zoffload.master_dtype: bf16"}))
      << "clipping is on: no accumulator is not among them";

  auto ram_with = [&](const std::string& moments, const std::string& grads) {
    PlanInputs q = in;
    q.config.zoffload.moment_dtype = moments;
    q.config.zoffload.master_dtype = "bf16";
    q.config.zoffload.gradient_store_dtype = grads;
    auto r = plan_run(q);
    EXPECT_TRUE(r.is_ok());
    return r->ram_bytes + r->process_bytes;
  };
  PlanInputs bf16_host = in;
  bf16_host.host.ram_available_bytes = ram_with("bf16", "auto");
  ASSERT_FALSE(plan_run(bf16_host)->fits());
  std::optional<PlanFix> fix = cheapest_lean_fix(bf16_host, lean);
  ASSERT_TRUE(fix);
  EXPECT_EQ(fix->changes, (std::vector<std::string>{"zoffload.moment_dtype: bf16", "zoffload.master_dtype: bf16"}));

  PlanInputs tight = in;
  tight.host.ram_available_bytes = ram_with("8bit", "bf16");
  ASSERT_GT(ram_with("8bit", "auto"), tight.host.ram_available_bytes);
  fix = cheapest_lean_fix(tight, lean);
  ASSERT_TRUE(fix);
  EXPECT_EQ(fix->changes, (std::vector<std::string>{"zoffload.gradient_store_dtype: bf16",
                                                    "zoffload.moment_dtype: 8bit", "zoffload.master_dtype: bf16"}));

  PlanInputs none = in;
  none.host.ram_available_bytes = ram_with("8bit", "bf16") / 2;
  EXPECT_FALSE(cheapest_lean_fix(none, lean));

  // Without clipping, no accumulator (exact but for an overflowing step) is the least lossy change
  // of all: on a host that holds it with bf16 moments, and neither alone, that pair, with the keys
  // the checker asks for with it.
  PlanInputs unclipped = in;
  unclipped.config.gradient_clipping = 0;
  const std::vector<ConfigChange> lean0 = lean_state_changes(unclipped.config, 1);
  ASSERT_EQ(lean0.size(), 5u);
  EXPECT_FALSE(lean0.front().rounds);
  PlanInputs target = unclipped;
  target.config.zoffload.gradient_accumulators = "none";
  target.config.bf16.check_grad_overflow = false;
  target.config.zoffload.moment_dtype = "bf16";
  auto both = plan_run(target);
  ASSERT_TRUE(both.is_ok()) << both.status().to_string();
  unclipped.host.ram_available_bytes = both->ram_bytes + both->process_bytes;
  fix = cheapest_lean_fix(unclipped, lean0);
  ASSERT_TRUE(fix);
  EXPECT_EQ(fix->changes, (std::vector<std::string>{"zoffload.gradient_accumulators: none and "
                                                    "bf16.check_grad_overflow: false",
                                                    "zoffload.moment_dtype: bf16"}));
  const nlohmann::json keys = {{"bf16", {{"check_grad_overflow", false}}},
                               {"zoffload", {{"gradient_accumulators", "none"}, {"moment_dtype", "bf16"}}}};
  EXPECT_EQ(nlohmann::json::parse(fix->config_json), keys);
}

}  // namespace
}  // namespace zo::engine

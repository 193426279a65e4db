// The planner under DeepSpeed's measured GPU peak (issue 61, item 4): llama3.2-3b as gpu_checks.sh's
// deepspeed part runs it, with zoffload.gpu_memory_limit set to what DeepSpeed used.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "engine/config/config.h"
#include "engine/model/model_config.h"
#include "engine/plan/fixes.h"
#include "engine/plan/planner.h"

namespace zo::engine {
namespace {

using ::testing::HasSubstr;

// gpu_checks.sh's ds_run config: stage 3, parameters and optimizer in pinned CPU memory, bf16,
// AdamW, clipping 1.0, the vertical schedule, micro-batch 4, GAS 8, seq 1024; on a CUDA card of
// 80 GiB with 124 GiB of RAM, as on the H100 machine.
PlanInputs deepspeed_run(uint64_t gpu_memory_limit) {
  const nlohmann::json j = nlohmann::json::parse(R"({
    "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 8, "gradient_clipping": 1.0,
    "bf16": {"enabled": true},
    "optimizer": {"type": "AdamW", "params": {"lr": 2e-5, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.0}},
    "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": "auto",
      "stage3_param_persistence_threshold": "auto", "reduce_bucket_size": "auto",
      "offload_param": {"device": "cpu", "pin_memory": true},
      "offload_optimizer": {"device": "cpu", "pin_memory": true}},
    "zoffload": {"schedule": "vertical", "device": "cuda"}})");
  PlanInputs in;
  in.model = *model_preset("llama3.2-3b");
  in.model_name = "llama3.2-3b";
  ResolveContext ctx;
  ctx.hidden_size = in.model.hidden_size;
  ConfigDiagnostics d;
  std::optional<Config> c = parse_config_json(j, ctx, &d);
  EXPECT_TRUE(c.has_value());
  if (c) in.config = *c;
  in.config.zoffload.gpu_memory_limit = gpu_memory_limit;
  in.seq_len = 1024;
  in.device_budget_bytes = gpu_memory_limit;
  in.host.cuda = true;
  in.host.device_name = "a GPU of 80 GiB";
  in.host.device_total_bytes = uint64_t{80} << 30;
  in.host.ram_total_bytes = in.host.ram_available_bytes = uint64_t{124} << 30;
  in.host.process_bytes = uint64_t{2} << 30;
  return in;
}

// DeepSpeed's max_memory_allocated on this run: 8.6 GiB (docs/gpu.md, "zoffload against DeepSpeed
// ZeRO-3 offload (H100, 2026-11-26)"). At micro-batch 4 the activation estimate alone, with the
// checkpoints on the CPU, is 8.8 GiB (the H100 measured 7.85 beside a 2.17 GiB arena), so the plan
// moves the checkpoints to the CPU, shrinks the arena and still says it does not fit (by the
// largest block); its first fix is the same batch at half the micro-batch, which fits.
TEST(EqualMemory, Llama32_3bUnderDeepSpeedsPeakMovesCheckpointsAndHalvesTheMicroBatch) {
  const uint64_t peak = static_cast<uint64_t>(8.6 * (uint64_t{1} << 30));
  PlanInputs in = deepspeed_run(peak);
  auto p = plan_run(in);
  ASSERT_TRUE(p.is_ok()) << p.status().to_string();
  EXPECT_TRUE(p->checkpoints_on_host) << p->summary();
  EXPECT_THAT(p->summary(), HasSubstr("checkpoints on the CPU"));
  EXPECT_LT(p->device_arena_bytes, p->arena.total_bytes()) << p->summary();  // the arena gives way first
  ASSERT_FALSE(p->fits());
  EXPECT_EQ(p->problems.front().resource, "GPU memory");

  const std::vector<PlanFix> fixes = suggest_fixes(in);
  ASSERT_FALSE(fixes.empty());
  EXPECT_THAT(fixes.front().changes.front(), HasSubstr("train_micro_batch_size_per_gpu: 2"));
  PlanInputs fixed = in;
  fixed.config.train_micro_batch_size_per_gpu = 2;
  fixed.config.gradient_accumulation_steps = 16;
  auto q = plan_run(fixed);
  ASSERT_TRUE(q.is_ok());
  EXPECT_TRUE(q->fits()) << q->summary();
  EXPECT_TRUE(q->checkpoints_on_host);
  EXPECT_LE(q->device_total_bytes, peak);

  // On the whole card the checkpoints stay on the GPU with the arena it wants, as on the H100.
  in.config.zoffload.gpu_memory_limit = 0;
  in.device_budget_bytes = in.host.device_total_bytes;
  auto roomy = plan_run(in);
  ASSERT_TRUE(roomy.is_ok());
  EXPECT_TRUE(roomy->fits());
  EXPECT_FALSE(roomy->checkpoints_on_host);
  EXPECT_EQ(roomy->device_arena_bytes, roomy->arena.total_bytes());
}

}  // namespace
}  // namespace zo::engine

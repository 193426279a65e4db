#include "engine/plan/planner.h"

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <map>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace zo::engine {
namespace {

using ::testing::HasSubstr;

PlanInputs tiny_inputs(OffloadDevice optimizer, OffloadDevice param) {
  PlanInputs in;
  in.config.zero.stage = 3;
  in.config.zero.sub_group_size = 1'000'000;
  in.config.zero.offload_optimizer.device = optimizer;
  in.config.zero.offload_optimizer.nvme_path = "nvme";
  in.config.zero.offload_param.device = param;
  in.config.zero.offload_param.nvme_path = "nvme";
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

TEST(Planner, UsesTheEnginesOwnMemoryPlan) {
  const PlanInputs in = tiny_inputs(OffloadDevice::kNvme, OffloadDevice::kCpu);
  auto p = plan_run(in);
  ASSERT_TRUE(p.is_ok()) << p.status().to_string();
  const ModelLayout layout = model_layout(in.model);
  auto reg = ParamRegistry::build(layout.params, in.config.zero.sub_group_size);
  ASSERT_TRUE(reg.is_ok());
  auto mp = plan_memory(in.config, *reg);
  ASSERT_TRUE(mp.is_ok());
  EXPECT_EQ(mp->grad_ring_bytes, 0u);  // plan_memory knows no blocks
  EXPECT_EQ(p->nvme_optimizer_bytes, mp->nvme_optimizer_bytes);
  EXPECT_EQ(p->n_params, reg->total_elems());
  // The gradient worker's ring: the largest block's gradients (the head, with the tied embedding's
  // or its own vocabulary × hidden), carved from the pinned pool.
  EXPECT_EQ(p->grad_ring_bytes, grad_ring_bytes(layout, *reg, in.config.compute_dtype()));
  EXPECT_GE(p->grad_ring_bytes, in.model.vocab_size * in.model.hidden_size * 4);
  EXPECT_EQ(p->pool_bytes, mp->pinned_pool_bytes() + align_up(p->grad_ring_bytes, kPinnedAlignment));
  EXPECT_GE(p->host_buffer_bytes, kStoreScratchBytes);
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
  // Too small either way: kept on the device, and the fix offered is planned again.
  in.host.device_total_bytes = on_cpu->device_total_bytes - 1;
  auto small = plan_run(in);
  ASSERT_TRUE(small.is_ok());
  EXPECT_FALSE(small->checkpoints_on_host);
  EXPECT_FALSE(small->fits());
  // Emulated: activations live in host RAM already.
  in.host.cuda = false;
  auto host = plan_run(in);
  ASSERT_TRUE(host.is_ok());
  EXPECT_FALSE(host->checkpoints_on_host);
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
  EXPECT_DOUBLE_EQ(p->step_s_high, s["compute"] + s["gradients"] + s["nvme grads"] + s["optimizer"]);
  EXPECT_DOUBLE_EQ(p->step_s_low, std::max({s["compute"], s["gradients"], s["optimizer"], s["nvme grads"] + s["nvme optim"]}));
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

}  // namespace
}  // namespace zo::engine

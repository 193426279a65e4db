// The trainer end to end on a small LLaMA with HostDevice and real swap files: offload and prefetch
// settings never change the arithmetic (bit-identical weights), fp32 stage 0 matches plain LibTorch
// training with torch::optim::AdamW, device budgets hold (and an impossible one fails at start),
// an fp16 overflow skips the step and halves the scale, and clipping matches a reference.
#include "engine/train/trainer.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adamw.h>
#include <torch/types.h>
#include <torch/utils.h>

#include <array>
#include <barrier>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include <unistd.h>

#include "common/bytes.h"
#include "common/check.h"
#include "common/crc32c.h"
#include "common/dynamic_maps.h"
#include "common/half.h"
#include "engine/data/dataset.h"
#include "engine/dist/process_group.h"
#include "engine/memory/memory_plan.h"
#include "engine/memory/swap_file.h"
#include "engine/model/safetensors.h"
#include "engine/model/decoder.h"
#include "engine/model/weights.h"
#include "engine/optim/lr_schedule.h"
#include "io/io_engine.h"
#include "tests/engine/free_port.h"
#include "tests/engine/temp_dir.h"
#include "tests/engine/test_config.h"

namespace zo::engine {
namespace {

// The allocator setting tools/zoffload makes before it trains (Note [Host compute]): without it
// these tests run the same arithmetic, only slower.
const bool kAllocatorTuned = (tune_allocator_for_host_compute(), true);

using ::testing::HasSubstr;

std::string corpus_path() {
  const char* root = std::getenv("ZO_SOURCE_DIR");
  ZO_CHECK(root != nullptr) << "ZO_SOURCE_DIR is not set (meson sets it)";
  return std::string(root) + "/configs/data/demo_corpus.txt";
}

// Two decoder layers, GQA, byte vocabulary: every code path of the model at a size fp32 CPU
// matmuls run quickly.
ModelConfig small_model(bool tied = false) {
  ModelConfig m;
  m.vocab_size = 256;
  m.hidden_size = 64;
  m.intermediate_size = 160;
  m.num_hidden_layers = 2;
  m.num_attention_heads = 4;
  m.num_key_value_heads = 2;
  m.head_dim = 16;
  m.max_position_embeddings = 256;
  m.tie_word_embeddings = tied;
  return m;
}

// What a test varies; the rest of the config is fixed.
struct RunSetup {
  int stage = 3;
  std::string param = "none";      // offload_param.device
  std::string optimizer = "none";  // offload_optimizer.device
  bool pipeline = false;
  uint64_t max_in_cpu = 1'000'000'000;
  uint64_t prefetch = 50'000'000;
  uint64_t max_live = 1'000'000'000;
  uint64_t persistence = 0;
  uint64_t reuse = 1'000'000'000;
  std::string precision = "bf16";  // bf16 | fp16 | fp32
  double clipping = 1.0;
  uint64_t grad_accum = 2;
  std::string gpu_limit = "256MiB";
  bool scheduler = true;
  std::string opt_type = "AdamW";       // optimizer.type
  std::string schedule = "horizontal";  // zoffload.schedule
  std::string checkpoints = "auto";     // zoffload.activation_checkpoints
  std::string accumulators = "auto";    // zoffload.gradient_accumulators
  std::string store = "auto";           // zoffload.gradient_store_dtype
  std::string moments = "fp32";         // zoffload.moment_dtype
  std::string master = "fp32";          // zoffload.master_dtype
  bool check_overflow = true;           // bf16.check_grad_overflow
  std::vector<std::string> freeze;      // zoffload.freeze
  nlohmann::json lora;                  // zoffload.lora, when not null
  uint64_t read_ahead = 0;              // zoffload.optimizer_read_ahead
};

Config make_config(const RunSetup& s, const std::string& nvme) {
  nlohmann::json j = {{"train_micro_batch_size_per_gpu", 2},
                      {"gradient_accumulation_steps", s.grad_accum},
                      {"gradient_clipping", s.clipping},
                      {"optimizer",
                       {{"type", s.opt_type},
                        {"params", {{"lr", 3e-3}, {"betas", {0.9, 0.95}}, {"eps", 1e-8}, {"weight_decay", 0.01}}}}},
                      {"zero_optimization",
                       {{"stage", s.stage},
                        {"sub_group_size", 16384},
                        {"stage3_prefetch_bucket_size", s.prefetch},
                        {"stage3_max_live_parameters", s.max_live},
                        {"stage3_param_persistence_threshold", s.persistence},
                        {"stage3_max_reuse_distance", s.reuse}}},
                      {"zoffload",
                       {{"device", "host"},
                        {"gpu_memory_limit", s.gpu_limit},
                        {"schedule", s.schedule},
                        {"activation_checkpoints", s.checkpoints},
                        {"gradient_accumulators", s.accumulators},
                        {"gradient_store_dtype", s.store},
                        {"moment_dtype", s.moments},
                        {"master_dtype", s.master}}}};
  if (s.scheduler)
    j["scheduler"] = {{"type", "WarmupCosineLR"},
                      {"params", {{"warmup_num_steps", 3}, {"total_num_steps", 20}, {"warmup_type", "linear"}}}};
  if (!s.freeze.empty()) j["zoffload"]["freeze"] = s.freeze;
  if (s.read_ahead != 0) j["zoffload"]["optimizer_read_ahead"] = s.read_ahead;
  if (!s.lora.is_null()) j["zoffload"]["lora"] = s.lora;
  if (s.opt_type == "Adagrad") j["optimizer"]["params"] = {{"lr", 1e-2}, {"eps", 1e-10}, {"weight_decay", 0.0}};
  if (s.opt_type == "Lion") j["optimizer"]["params"] = {{"lr", 3e-4}, {"betas", {0.9, 0.99}}, {"weight_decay", 0.01}};
  if (s.precision == "bf16") j["bf16"] = {{"enabled", true}, {"check_grad_overflow", s.check_overflow}};
  if (s.precision == "fp16") j["fp16"] = {{"enabled", true}, {"initial_scale_power", 12}, {"hysteresis", 1}};
  if (s.stage == 3 && s.param != "none")
    j["zero_optimization"]["offload_param"] = {
        {"device", s.param}, {"nvme_path", nvme}, {"max_in_cpu", s.max_in_cpu}, {"buffer_count", 4}};
  if (s.optimizer != "none")
    j["zero_optimization"]["offload_optimizer"] = {
        {"device", s.optimizer}, {"nvme_path", nvme}, {"pipeline_read", s.pipeline}, {"pipeline_write", s.pipeline}};
  return parse_test_config(j.dump());
}

TrainOptions make_options(const RunSetup& s, const TempDir& dir, bool tied = false) {
  TrainOptions o;
  o.config = make_config(s, dir.path + "/nvme");
  o.model = "small";
  o.model_config = small_model(tied);
  o.data_path = corpus_path();
  o.seq_len = 32;
  o.seed = 7;
  o.out_dir = dir.path + "/run";
  return o;
}

uint64_t param_elems(const ParamSpec& p) {
  uint64_t n = 1;
  for (int64_t d : p.shape) n *= static_cast<uint64_t>(d);
  return n;
}

std::vector<std::vector<float>> masters(Trainer& t) {
  std::vector<std::vector<float>> out;
  for (uint32_t p = 0; p < t.layout().params.size(); ++p) {
    out.emplace_back(param_elems(t.layout().params[p]));
    Status s = t.read_master(p, out.back());
    ZO_CHECK(s.is_ok()) << s.to_string();
  }
  return out;
}

// Per param, its master where this (data-parallel) rank holds all of it, else empty.
std::vector<std::vector<float>> masters_held(Trainer& t) {
  std::vector<std::vector<float>> out;
  for (uint32_t p = 0; p < t.layout().params.size(); ++p) {
    std::vector<float> v(param_elems(t.layout().params[p]));
    out.push_back(t.read_master(p, v).is_ok() ? std::move(v) : std::vector<float>{});
  }
  return out;
}

// Runs `steps` steps; returns the masters after them (and the metrics through `metrics`).
std::vector<std::vector<float>> train(const TrainOptions& o, int steps, std::vector<StepMetrics>* metrics = nullptr,
                                      nlohmann::json* plan = nullptr) {
  auto t = Trainer::create(o);
  ZO_CHECK(t.is_ok()) << t.status().to_string();
  if (plan) *plan = nlohmann::json::parse((*t)->plan_json());
  for (int i = 0; i < steps; ++i) {
    auto m = (*t)->step();
    ZO_CHECK(m.is_ok()) << m.status().to_string();
    if (metrics) metrics->push_back(*m);
  }
  return masters(**t);
}

// Runs `steps` steps of `t`, saving a checkpoint after step `save_after`; each step's metrics.
Result<std::vector<StepMetrics>> steps_saving_after(Trainer& t, int steps, int save_after) {
  std::vector<StepMetrics> out;
  for (int i = 0; i < steps; ++i) {
    ZO_ASSIGN_OR_RETURN(StepMetrics m, t.step());
    out.push_back(m);
    if (i + 1 == save_after) ZO_RETURN_IF_ERROR(t.save_checkpoint().status());
  }
  return out;
}

bool bit_identical(const std::vector<std::vector<float>>& a, const std::vector<std::vector<float>>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i].size() != b[i].size() || std::memcmp(a[i].data(), b[i].data(), a[i].size() * sizeof(float)) != 0)
      return false;
  return true;
}

TEST(Trainer, OffloadAndPrefetchSettingsGiveBitIdenticalWeights) {
  constexpr int kSteps = 20;
  TempDir ref_dir;
  std::vector<StepMetrics> ref_metrics;
  const auto reference = train(make_options(RunSetup{}, ref_dir), kSteps, &ref_metrics);
  // The run must actually train, or equality would prove nothing.
  EXPECT_LT(ref_metrics.back().loss, ref_metrics.front().loss);

  struct Variant {
    const char* name;
    RunSetup setup;
  };
  std::vector<Variant> variants = {
      {"params cpu, optimizer cpu", {.param = "cpu", .optimizer = "cpu"}},
      {"params nvme, optimizer nvme, pipelined",
       {.param = "nvme", .optimizer = "nvme", .pipeline = true, .max_in_cpu = 0}},
      {"params cpu, optimizer nvme, no prefetch, no reuse",
       {.param = "cpu", .optimizer = "nvme", .prefetch = 0, .max_live = 40000, .reuse = 0}},
      {"params nvme, optimizer cpu, persistent small params, big prefetch",
       {.param = "nvme", .optimizer = "cpu", .max_in_cpu = 20000, .prefetch = 1'000'000, .persistence = 5000}},
      {"stage 2, optimizer cpu", {.stage = 2, .optimizer = "cpu"}},
      {"stage 0", {.stage = 0}},
      // Note [Where the gradients wait]: the accumulators apart from the optimizer states.
      {"params cpu, optimizer nvme, accumulators nvme", {.param = "cpu", .optimizer = "nvme", .accumulators = "nvme"}},
      {"params cpu, optimizer cpu, accumulators nvme", {.param = "cpu", .optimizer = "cpu", .accumulators = "nvme"}},
      {"params nvme, optimizer nvme, pipelined, accumulators cpu",
       {.param = "nvme", .optimizer = "nvme", .pipeline = true, .max_in_cpu = 0, .accumulators = "cpu"}},
      // Note [Reading the states ahead]: the first sub-groups' states read under forward and backward.
      {"params cpu, optimizer nvme, pipelined, states read ahead",
       {.param = "cpu", .optimizer = "nvme", .pipeline = true, .accumulators = "cpu", .read_ahead = 2}},
  };
  auto tier = [](const std::string& device) { return device == "none" ? std::string("device") : device; };
  for (const Variant& v : variants) {
    SCOPED_TRACE(v.name);
    TempDir dir;
    std::vector<StepMetrics> metrics;
    nlohmann::json plan;
    const auto weights = train(make_options(v.setup, dir), kSteps, &metrics, &plan);
    // The variant really put the states where it says, or equality would prove nothing.
    const nlohmann::json& placed = plan["memory_plan"]["placement"];
    EXPECT_EQ(placed["optimizer"], tier(v.setup.optimizer)) << placed.dump();
    const std::string grads = v.setup.accumulators != "auto" ? v.setup.accumulators
                              : v.setup.optimizer == "nvme"  ? "cpu"  // the planner's choice: this host has room
                                                             : tier(v.setup.optimizer);
    EXPECT_EQ(placed["grad"], grads) << placed.dump();
    if (v.setup.param != "none") { EXPECT_GT(placed["compute"][v.setup.param].get<uint64_t>(), 0u) << placed.dump(); }
    if (v.setup.read_ahead != 0)  // the pipeline's three buffers and those reading ahead
      EXPECT_EQ(plan["memory_plan"]["optimizer_swap_buffers"], 3 + v.setup.read_ahead);
    EXPECT_TRUE(bit_identical(weights, reference));
    ASSERT_EQ(metrics.size(), ref_metrics.size());
    for (size_t i = 0; i < metrics.size(); ++i) EXPECT_EQ(metrics[i].loss, ref_metrics[i].loss) << "step " << i + 1;
  }
}

TEST(Trainer, TiedEmbeddingsAreBitIdenticalAcrossOffload) {
  TempDir a, b;
  const auto ref = train(make_options(RunSetup{}, a, /*tied=*/true), 5);
  const auto off =
      train(make_options({.param = "nvme", .optimizer = "nvme", .pipeline = true, .max_in_cpu = 0}, b, true), 5);
  EXPECT_TRUE(bit_identical(ref, off));
}

// Plain LibTorch training of the same model: the same functional blocks run as one graph (no
// block-wise recompute, no offload), torch::optim::AdamW, the same batches.
struct Reference {
  Reference(Trainer& trainer, const TrainOptions& o)
      : model(trainer.model_config()),
        layout(trainer.layout()),
        gas(o.config.gradient_accumulation_steps),
        schedule(*LrSchedule::create(o.config.scheduler, o.config.optimizer.lr)) {
    for (std::vector<float>& w : masters(trainer)) {
      params.push_back(torch::from_blob(w.data(), {static_cast<int64_t>(w.size())}, torch::kFloat).clone());
    }
    for (size_t i = 0; i < params.size(); ++i)  // a frozen one (zoffload.freeze) gets no gradient
      params[i] = params[i].view(layout.params[i].shape).set_requires_grad(layout.params[i].trainable);
    oc = o.config.optimizer;
    if (oc.type == OptimizerType::kAdamW) {
      opt = std::make_unique<torch::optim::AdamW>(params, torch::optim::AdamWOptions(oc.lr)
                                                              .betas({oc.betas[0], oc.betas[1]})
                                                              .eps(oc.eps)
                                                              .weight_decay(oc.weight_decay));
    } else if (oc.type == OptimizerType::kAdagrad) {
      // Without weight decay torch's Adagrad and DeepSpeed's (cpu_optim's) are the same update.
      ZO_CHECK(oc.weight_decay == 0) << "torch's Adagrad decays the numerator too";
      opt = std::make_unique<torch::optim::Adagrad>(params, torch::optim::AdagradOptions(oc.lr).eps(oc.eps));
    } else {
      ZO_CHECK(oc.type == OptimizerType::kLion) << "no reference for " << to_string(oc.type);
      for (const torch::Tensor& p : params) lion_m.push_back(torch::zeros_like(p));
    }
    DataOptions d;
    d.path = o.data_path;
    d.source.env = io::Env::posix();
    d.seq_len = o.seq_len;
    d.micro_batch = o.config.train_micro_batch_size_per_gpu;
    d.seed = o.seed;
    auto ds = Dataset::open(d);
    ZO_CHECK(ds.is_ok()) << ds.status().to_string();
    data = std::move(*ds);
    rope = make_rope_tables(model, static_cast<int64_t>(o.seq_len), torch::kCPU);
  }

  // One step over `gas` micro-batches (loss / gas each, gradients summed by autograd); returns the
  // global gradient norm before clipping.
  double step(double clip) {
    for (torch::Tensor& p : params)
      if (p.grad().defined()) p.mutable_grad().zero_();
    for (uint64_t micro = 0; micro < gas; ++micro) {
      Batch batch;
      Status s = data->next_batch(&batch);
      ZO_CHECK(s.is_ok()) << s.to_string();
      const int64_t b = static_cast<int64_t>(batch.batch), t = static_cast<int64_t>(batch.seq_len);
      torch::Tensor x = torch::from_blob(batch.inputs.data(), {b, t}, torch::kInt32).to(torch::kInt64);
      torch::Tensor y = torch::from_blob(batch.targets.data(), {b, t}, torch::kInt32).to(torch::kInt64);
      for (const BlockSpec& block : layout.blocks) {
        std::vector<torch::Tensor> p;
        for (uint32_t id : block.params) p.push_back(params[id]);
        x = block_forward(model, block, p, x, rope);
      }
      (lm_loss(x, y) / static_cast<double>(gas)).backward();
    }
    double norm = 0;
    for (const torch::Tensor& p : params)
      if (p.grad().defined()) norm += p.grad().pow(2).sum().item<double>();
    norm = std::sqrt(norm);
    if (clip > 0) torch::nn::utils::clip_grad_norm_(params, clip);
    const double lr = schedule.lr_at(steps);
    if (opt) {
      for (auto& group : opt->param_groups()) group.options().set_lr(lr);
      opt->step();
    } else {
      // Lion (torch has none): the paper's update in tensor ops, independent of cpu_optim.
      torch::NoGradGuard no_grad;
      const double b1 = oc.betas[0], b2 = oc.betas[1];
      for (size_t i = 0; i < params.size(); ++i) {
        const torch::Tensor g = params[i].grad();
        const torch::Tensor c = lion_m[i] * b1 + g * (1 - b1);
        if (oc.weight_decay > 0) params[i].mul_(1 - lr * oc.weight_decay);
        params[i].add_(c.sign(), -lr);
        lion_m[i].mul_(b2).add_(g, 1 - b2);
      }
    }
    ++steps;
    return norm;
  }

  std::vector<torch::Tensor> params;
  OptimizerConfig oc;
  std::unique_ptr<torch::optim::Optimizer> opt;  // AdamW or Adagrad; null for Lion
  std::vector<torch::Tensor> lion_m;
  std::unique_ptr<Dataset> data;
  ModelConfig model;
  ModelLayout layout;
  RopeTables rope;
  uint64_t gas = 1;
  LrSchedule schedule;
  uint64_t steps = 0;
};

double max_relative_error(const std::vector<std::vector<float>>& got, const std::vector<torch::Tensor>& want) {
  double worst = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    torch::Tensor g =
        torch::from_blob(const_cast<float*>(got[i].data()), {static_cast<int64_t>(got[i].size())}, torch::kFloat);
    torch::Tensor w = want[i].detach().reshape({-1});
    worst = std::max(worst, ((g - w).norm() / w.norm()).item<double>());
  }
  return worst;
}

// Accumulation over 2 micro-batches, WarmupCosineLR, untied and tied heads (the embedding then
// gets gradients from two blocks).
TEST(Trainer, Fp32Stage0MatchesPlainLibTorchAdamW) {
  for (bool tied : {false, true}) {
    SCOPED_TRACE(tied ? "tied" : "untied");
    TempDir dir;
    const TrainOptions o = make_options({.stage = 0, .precision = "fp32", .clipping = 0}, dir, tied);
    auto t = Trainer::create(o);
    ASSERT_TRUE(t.is_ok()) << t.status().to_string();
    Reference ref(**t, o);
    for (int i = 0; i < 20; ++i) {
      auto m = (*t)->step();
      ASSERT_TRUE(m.is_ok()) << m.status().to_string();
      const double lr = ref.schedule.lr_at(ref.steps);
      const double ref_norm = ref.step(0);
      EXPECT_NEAR(m->grad_norm, ref_norm, 1e-4 * ref_norm) << "step " << i + 1;
      EXPECT_EQ(m->lr, lr) << "step " << i + 1;
    }
    const double err = max_relative_error(masters(**t), ref.params);
    EXPECT_LT(err, 1e-5) << "relative error of the weights after 20 steps";
  }
}

// Note [Frozen sub-groups]: with the embedding and layer 0 frozen (zoffload.freeze), the run is plain
// LibTorch's with requires_grad false on them and torch's AdamW over the rest, untied and tied (the
// tied head is then frozen too), at stage 0 and with the states offloaded at stage 3; the frozen
// weights end bit for bit as they started.
TEST(Trainer, FrozenParamsMatchLibTorchAndNeverMove) {
  for (bool tied : {false, true}) {
    for (const RunSetup& setup :
         {RunSetup{.stage = 0, .precision = "fp32", .clipping = 0},
          RunSetup{.param = "cpu", .optimizer = "nvme", .precision = "fp32", .clipping = 1.0}}) {
      SCOPED_TRACE(std::string(tied ? "tied" : "untied") + ", stage " + std::to_string(setup.stage));
      TempDir dir;
      RunSetup s = setup;
      s.freeze = {"model.embed_tokens.weight", "model.layers.0.*"};
      const TrainOptions o = make_options(s, dir, tied);
      auto t = Trainer::create(o);
      ASSERT_TRUE(t.is_ok()) << t.status().to_string();
      const std::vector<std::vector<float>> before = masters(**t);
      Reference ref(**t, o);
      uint32_t frozen = 0;
      for (const ParamSpec& p : (*t)->layout().params) frozen += p.trainable ? 0 : 1;
      EXPECT_EQ(frozen, 1 + 9u);  // the embedding and layer 0's nine params
      for (int i = 0; i < 8; ++i) {
        auto m = (*t)->step();
        ASSERT_TRUE(m.is_ok()) << m.status().to_string();
        const double ref_norm = ref.step(s.clipping);
        EXPECT_NEAR(m->grad_norm, ref_norm, 1e-4 * ref_norm) << "step " << i + 1;
      }
      const std::vector<std::vector<float>> after = masters(**t);
      EXPECT_LT(max_relative_error(after, ref.params), 1e-5) << "relative error of the weights after 8 steps";
      for (uint32_t p = 0; p < after.size(); ++p) {
        if ((*t)->layout().params[p].trainable) {
          EXPECT_NE(after[p], before[p]) << (*t)->layout().params[p].name << " trains";
        } else {
          EXPECT_EQ(after[p], before[p]) << (*t)->layout().params[p].name << " is frozen";
        }
      }
    }
  }
}

// Frozen params on every placement, both schedules, stages 0 to 3, without accumulators and over
// two ranks: the same bits as resident stage 3 (and, without accumulators, as the stored path), and
// the plan holds no optimizer state for them.
TEST(Trainer, FrozenIsBitIdenticalAcrossPlacementsSchedulesStagesAndRanks) {
  constexpr int kSteps = 4;
  const std::vector<std::string> freeze = {"model.embed_tokens.weight", "model.layers.1.mlp.*", "model.norm.weight"};
  RunSetup resident{.grad_accum = 2, .freeze = freeze};
  TempDir rd;
  std::vector<StepMetrics> rm;
  nlohmann::json rplan;
  const auto want = train(make_options(resident, rd), kSteps, &rm, &rplan);
  EXPECT_LT(rm.back().loss, rm.front().loss) << "it trains";
  // The plan: 16 bytes per trainable element only (fp32 master, moments, accumulator).
  TempDir all_dir;
  RunSetup unfrozen = resident;
  unfrozen.freeze.clear();
  nlohmann::json all_plan;
  train(make_options(unfrozen, all_dir), 1, nullptr, &all_plan);
  EXPECT_LT(rplan["n_trainable"].get<uint64_t>(), rplan["n_params"].get<uint64_t>());
  EXPECT_EQ(all_plan["n_trainable"], all_plan["n_params"]);
  EXPECT_GT(rplan["memory_plan"]["frozen_sub_groups"].get<uint64_t>(), 0u);
  const double frozen_elems = rplan["n_params"].get<double>() - rplan["n_trainable"].get<double>();
  EXPECT_NEAR(
      all_plan["memory_plan"]["device_bytes"].get<double>() - rplan["memory_plan"]["device_bytes"].get<double>(),
      16 * frozen_elems, 16 * 4 * 4096.0);

  struct Variant {
    const char* name;
    RunSetup setup;
  };
  auto with = [&](RunSetup s) {
    s.freeze = freeze;
    return s;
  };
  const std::vector<Variant> variants = {
      {"params and optimizer on the CPU", with({.param = "cpu", .optimizer = "cpu"})},
      {"params and optimizer on NVMe, pipelined",
       with({.param = "nvme", .optimizer = "nvme", .pipeline = true, .max_in_cpu = 0})},
      {"vertical, params cpu, optimizer nvme", with({.param = "cpu", .optimizer = "nvme", .schedule = "vertical"})},
      {"8-bit moments and bf16 masters on the CPU",
       with({.param = "cpu", .optimizer = "cpu", .moments = "8bit", .master = "bf16"})},
      {"stage 0", with({.stage = 0})},
      {"stage 2, optimizer on the CPU, accumulators on NVMe",
       with({.stage = 2, .optimizer = "cpu", .accumulators = "nvme"})},
  };
  for (const Variant& v : variants) {
    SCOPED_TRACE(v.name);
    TempDir d;
    RunSetup s = v.setup;
    s.grad_accum = 2;
    std::vector<StepMetrics> m;
    const auto got = train(make_options(s, d), kSteps, &m);
    // 8-bit moments and bf16 masters round otherwise: they train, and the frozen params stay put.
    if (v.setup.moments == "8bit") {
      ModelLayout layout = model_layout(small_model());
      ASSERT_TRUE(freeze_params(freeze, &layout).is_ok());
      for (size_t p = 0; p < got.size(); ++p)
        if (!layout.params[p].trainable) EXPECT_EQ(got[p], want[p]) << layout.params[p].name;
      EXPECT_LT(m.back().loss, m.front().loss);
      continue;
    }
    EXPECT_TRUE(bit_identical(got, want));
    for (int i = 0; i < kSteps; ++i) EXPECT_EQ(m[i].loss, rm[i].loss) << "step " << i + 1;
  }

  // Without accumulators: the stored path's bits.
  auto direct_setup = [&](std::string accumulators) {
    return with({.param = "cpu",
                 .optimizer = "cpu",
                 .clipping = 0,
                 .grad_accum = 2,
                 .schedule = "vertical",
                 .accumulators = std::move(accumulators),
                 .check_overflow = false});
  };
  TempDir sd, dd;
  const auto stored = train(make_options(direct_setup("auto"), sd), kSteps);
  const auto direct = train(make_options(direct_setup("none"), dd), kSteps);
  EXPECT_TRUE(bit_identical(direct, stored)) << "without accumulators";
}

// zoffload.freeze refuses what it cannot do, naming the key.
TEST(Trainer, FreezeRefusesBadPatternsAndCheckpointsByKey) {
  const std::pair<std::vector<std::string>, std::string> refused[] = {
      {{"model.layers.9.*"}, "zoffload.freeze[0]: \"model.layers.9.*\" matches no parameter of the model"},
      {{"model.embed_tokens.weight", "model.layers.{1..0}.*"},
       "zoffload.freeze[1]: \"model.layers.{1..0}.*\": \"{\" at character 14 does not open a range"},
      {{"*"}, "zoffload.freeze freezes every parameter of the model: nothing would train"},
  };
  for (const auto& [patterns, message] : refused) {
    TempDir dir;
    RunSetup s{.precision = "fp32"};
    s.freeze = patterns;
    auto t = Trainer::create(make_options(s, dir));
    ASSERT_FALSE(t.is_ok());
    EXPECT_EQ(t.status().code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(t.status().message(), HasSubstr(message));
  }
}

TEST(Trainer, ClippingMatchesTorchClipGradNorm) {
  TempDir dir;
  // A max norm far below the gradients' so every step clips.
  const TrainOptions o = make_options({.stage = 3,
                                       .param = "cpu",
                                       .optimizer = "nvme",
                                       .precision = "fp32",
                                       .clipping = 0.05,
                                       .grad_accum = 1,
                                       .scheduler = false},
                                      dir);
  auto t = Trainer::create(o);
  ASSERT_TRUE(t.is_ok()) << t.status().to_string();
  Reference ref(**t, o);
  for (int i = 0; i < 5; ++i) {
    auto m = (*t)->step();
    ASSERT_TRUE(m.is_ok()) << m.status().to_string();
    const double ref_norm = ref.step(0.05);
    EXPECT_GT(ref_norm, 0.05);
    EXPECT_NEAR(m->grad_norm, ref_norm, 1e-4 * ref_norm);
  }
  EXPECT_LT(max_relative_error(masters(**t), ref.params), 1e-5);
}

// Adagrad and Lion step on the CPU with their states on CPU or NVMe (config check refuses them on
// the device). fp32 against torch::optim::Adagrad and against the Lion update written in torch
// ops; CPU and NVMe states give the same weights bit for bit.
TEST(Trainer, AdagradAndLionTrainOnCpuAndNvmeAsTorch) {
  for (const char* type : {"Adagrad", "Lion"}) {
    SCOPED_TRACE(type);
    TempDir dir, nvme_dir;
    const TrainOptions o =
        make_options({.stage = 2, .optimizer = "cpu", .precision = "fp32", .clipping = 0, .opt_type = type}, dir);
    auto t = Trainer::create(o);
    ASSERT_TRUE(t.is_ok()) << t.status().to_string();
    Reference ref(**t, o);
    double first = 0, last = 0;
    for (int i = 0; i < 10; ++i) {
      auto m = (*t)->step();
      ASSERT_TRUE(m.is_ok()) << m.status().to_string();
      const double ref_norm = ref.step(0);
      EXPECT_NEAR(m->grad_norm, ref_norm, 1e-4 * ref_norm) << "step " << i + 1;
      (i == 0 ? first : last) = m->loss;
    }
    EXPECT_LT(last, first) << "it trains";
    // Measured: Adagrad 1.4e-6, Lion 1.3e-7 (the gradients differ in summation order only; no
    // element of Lion's lr·sign(c) flipped here, which would cost 2·lr in that element).
    EXPECT_LT(max_relative_error(masters(**t), ref.params), 1e-5);
    const auto on_nvme = train(make_options({.stage = 3,
                                             .param = "nvme",
                                             .optimizer = "nvme",
                                             .pipeline = true,
                                             .max_in_cpu = 0,
                                             .precision = "fp32",
                                             .clipping = 0,
                                             .opt_type = type},
                                            nvme_dir),
                               10);
    EXPECT_TRUE(bit_identical(masters(**t), on_nvme));
  }
}

// Adagrad's sum of squares and Lion's momentum in bf16 or 8 bits (zoffload.moment_dtype): on the CPU
// and on NVMe the same bits; not the fp32 state's (the rounding happened); and it trains. With 8 bits
// a run resumed on NVMe from the CPU run's step-4 checkpoint (the state saved in its own bytes)
// continues it bit-exactly.
TrainOptions with_checkpoints(TrainOptions o, const std::string& dir);  // below, beside the resume tests
std::string file_bytes(const std::string& path);                        // below

TEST(Trainer, AdagradAndLionWithNarrowStatesAreBitIdenticalOnCpuAndNvme) {
  constexpr int kSteps = 8, kSaveAt = 4;
  for (const char* type : {"Adagrad", "Lion"})
    for (const char* md : {"bf16", "8bit"}) {
      SCOPED_TRACE(std::string(type) + " " + md);
      TempDir cpu_dir, nvme_dir, fp32_dir, resume_dir;
      RunSetup cpu{.stage = 2, .optimizer = "cpu", .precision = "fp32", .clipping = 0, .opt_type = type};
      cpu.moments = md;
      RunSetup nvme = cpu;
      nvme.stage = 3;
      nvme.param = "nvme";
      nvme.optimizer = "nvme";
      nvme.pipeline = true;
      nvme.max_in_cpu = 0;
      RunSetup fp32 = cpu;
      fp32.moments = "fp32";
      TrainOptions co = with_checkpoints(make_options(cpu, cpu_dir), cpu_dir.path + "/ckpt");
      auto tc = Trainer::create(co);
      ASSERT_TRUE(tc.is_ok()) << tc.status().to_string();
      std::vector<StepMetrics> metrics;
      for (int i = 0; i < kSteps; ++i) {
        auto m = (*tc)->step();
        ASSERT_TRUE(m.is_ok()) << m.status().to_string();
        metrics.push_back(*m);
        if (i + 1 == kSaveAt) ASSERT_TRUE((*tc)->save_checkpoint().is_ok());
      }
      const auto on_cpu = masters(**tc);
      EXPECT_LT(metrics.back().loss, metrics.front().loss) << "it trains";
      EXPECT_TRUE(bit_identical(on_cpu, train(make_options(nvme, nvme_dir), kSteps)));
      EXPECT_FALSE(bit_identical(on_cpu, train(make_options(fp32, fp32_dir), kSteps)));
      if (std::string(md) != "8bit") continue;
      // The checkpoint names the map each state's codes index: bitsandbytes' signed map for Lion's
      // momentum (exp_avg) and for Adagrad's sum of squares (exp_avg_sq), as its optimizers keep them.
      for (const char* file : {"exp_avg.safetensors", "exp_avg_sq.safetensors"}) {
        auto f = SafetensorsFile::open(cpu_dir.path + "/ckpt/step-" + std::to_string(kSaveAt) + "/" + file,
                                       io::Env::posix());
        ASSERT_TRUE(f.is_ok()) << f.status().to_string();
        ASSERT_EQ((*f)->tensors().front().name, "zoffload.qmap");
        std::array<float, 256> map{};
        ASSERT_TRUE(
            (*f)->read_raw((*f)->tensors().front(), 0, {reinterpret_cast<uint8_t*>(map.data()), sizeof map}).is_ok());
        const bool unsigned_map = std::string(file) == "exp_avg_sq.safetensors" && std::string(type) == "Lion";
        EXPECT_EQ(map, unsigned_map ? kUnsignedDynamicMap : kSignedDynamicMap) << file;
      }
      TrainOptions ro = make_options(nvme, resume_dir);
      ro.resume = cpu_dir.path + "/ckpt/step-" + std::to_string(kSaveAt);
      auto tr = Trainer::create(ro);
      ASSERT_TRUE(tr.is_ok()) << tr.status().to_string();
      for (int i = kSaveAt; i < kSteps; ++i) {
        auto m = (*tr)->step();
        ASSERT_TRUE(m.is_ok()) << m.status().to_string();
        EXPECT_EQ(m->loss, metrics[i].loss) << "step " << m->step;
      }
      EXPECT_TRUE(bit_identical(masters(**tr), on_cpu));
      // The manifest names the optimizer; another optimizer's run refuses the states, naming the key.
      const std::string ckpt = cpu_dir.path + "/ckpt/step-" + std::to_string(kSaveAt);
      EXPECT_EQ(nlohmann::json::parse(file_bytes(ckpt + "/manifest.json"))["optimizer_type"], type);
      RunSetup adamw = nvme;
      adamw.opt_type = "AdamW";
      TempDir other_dir;
      TrainOptions oo = make_options(adamw, other_dir);
      oo.resume = ckpt;
      auto refused = Trainer::create(oo);
      EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
      EXPECT_THAT(refused.status().message(), HasSubstr(std::string("it holds ") + type +
                                                        "'s optimizer states, this run steps AdamW (optimizer.type)"));
    }
}

// The compute copies are ~233 KiB in bf16, a decoder layer ~84 KiB: a 96 KiB budget forces the
// coordinator to fetch and evict block by block. (HostDevice refuses any allocation past its
// budget, so what this shows is that training fits and runs, with the peak reported.)
TEST(Trainer, DeviceBudgetBelowTheModelHolds) {
  TempDir dir;
  const TrainOptions o = make_options({.param = "cpu", .optimizer = "cpu", .gpu_limit = "96KiB"}, dir);
  auto t = Trainer::create(o);
  ASSERT_TRUE(t.is_ok()) << t.status().to_string();
  uint64_t model_bytes = 0;
  for (const ParamSpec& p : (*t)->layout().params) model_bytes += 2 * param_elems(p);
  // The device refuses an allocation over its budget anyway, so "peak ≤ budget" alone proves
  // nothing: the peak must be exactly what the plan said fits the budget (issue 19).
  const nlohmann::json plan = nlohmann::json::parse((*t)->plan_json());
  const uint64_t planned =
      plan["device"]["state_bytes"].get<uint64_t>() + plan["device"]["arena_bytes"].get<uint64_t>();
  for (int i = 0; i < 3; ++i) {
    auto m = (*t)->step();
    ASSERT_TRUE(m.is_ok()) << m.status().to_string();
    EXPECT_EQ(m->device_peak_bytes, planned);
    EXPECT_LE(planned, m->device_budget_bytes);
    EXPECT_LT(m->device_budget_bytes, model_bytes);
    EXPECT_GT(m->device_peak_bytes, 0u);
    EXPECT_GT(m->memory.h2d_bytes, static_cast<uint64_t>(i + 1) * model_bytes) << "every block fetched again each step";
  }
}

TEST(Trainer, DeviceBudgetBelowOneBlockFailsAtStart) {
  TempDir dir;
  auto t = Trainer::create(make_options({.param = "cpu", .optimizer = "cpu", .gpu_limit = "16KiB"}, dir));
  ASSERT_FALSE(t.is_ok());
  EXPECT_EQ(t.status().code(), StatusCode::kOutOfMemory);
  EXPECT_THAT(t.status().to_string(), HasSubstr("block 'model.layers."));
}

// The overflow arrives in the last micro-step's last gradient (the embedding's), when every other
// sub-group's gradients are final: nothing may be updated. With the vertical schedule it arrives
// in the one summed gradient of the embedding.
TEST(Trainer, Fp16OverflowSkipsTheStepAndHalvesTheScale) {
  for (const char* schedule : {"horizontal", "vertical"}) {
    SCOPED_TRACE(schedule);
    TempDir dir;
    TrainOptions o = make_options(
        {.param = "cpu", .optimizer = "nvme", .precision = "fp16", .grad_accum = 3, .schedule = schedule}, dir);
    o.inject_overflow_steps = {3};
    auto t = Trainer::create(o);
    ASSERT_TRUE(t.is_ok()) << t.status().to_string();
    std::vector<StepMetrics> m;
    for (int i = 0; i < 2; ++i) {
      auto r = (*t)->step();
      ASSERT_TRUE(r.is_ok()) << r.status().to_string();
      m.push_back(*r);
    }
    const auto before = masters(**t);
    auto skipped = (*t)->step();
    ASSERT_TRUE(skipped.is_ok()) << skipped.status().to_string();
    EXPECT_TRUE(skipped->skipped);
    EXPECT_FALSE(std::isfinite(skipped->grad_norm));
    EXPECT_TRUE(bit_identical(masters(**t), before)) << "a skipped step changed the weights";
    auto next = (*t)->step();
    ASSERT_TRUE(next.is_ok()) << next.status().to_string();
    EXPECT_FALSE(next->skipped);
    EXPECT_EQ(next->loss_scale, skipped->loss_scale / 2);
    EXPECT_EQ(skipped->loss_scale, 4096.0);
    EXPECT_FALSE(bit_identical(masters(**t), before));
    // The lr schedule does not advance on a skipped step (DeepSpeed).
    EXPECT_EQ(next->lr, skipped->lr);
  }
}

// Note [Vertical schedule]: the same micro-batches through the same blocks, and each gradient
// summed over them in grad_accum_dtype in the same order; only the order of the block visits
// changes. Each placement is compared with the horizontal schedule on the same placement, so the
// vertical runs also agree across placements.
TEST(Trainer, VerticalScheduleMatchesHorizontalOnEveryPlacementAndPrecision) {
  constexpr int kSteps = 5;
  struct Variant {
    const char* name;
    RunSetup setup;
  };
  const std::vector<Variant> variants = {
      {"bf16, params on the device, optimizer cpu", {.optimizer = "cpu", .grad_accum = 3}},
      {"bf16, params cpu, optimizer nvme, pipelined",
       {.param = "cpu", .optimizer = "nvme", .pipeline = true, .grad_accum = 3, .accumulators = "nvme"}},
      {"bf16, params nvme, optimizer nvme, no cache",
       {.param = "nvme",
        .optimizer = "nvme",
        .max_in_cpu = 0,
        .max_live = 40000,
        .reuse = 0,
        .grad_accum = 4,
        .accumulators = "nvme"}},
      {"bf16, optimizer cpu, accumulators nvme",
       {.param = "cpu", .optimizer = "cpu", .grad_accum = 3, .accumulators = "nvme"}},
      {"fp32, params cpu, optimizer cpu", {.param = "cpu", .optimizer = "cpu", .precision = "fp32", .grad_accum = 3}},
      {"fp16, params cpu, optimizer nvme", {.param = "cpu", .optimizer = "nvme", .precision = "fp16", .grad_accum = 2}},
      {"bf16, stage 0", {.stage = 0, .grad_accum = 3}},
  };
  for (const Variant& v : variants) {
    SCOPED_TRACE(v.name);
    TempDir h_dir, v_dir;
    RunSetup vs = v.setup;
    vs.schedule = "vertical";
    std::vector<StepMetrics> hm, vm;
    const auto horizontal = train(make_options(v.setup, h_dir), kSteps, &hm);
    const auto vertical = train(make_options(vs, v_dir), kSteps, &vm);
    EXPECT_TRUE(bit_identical(vertical, horizontal));
    ASSERT_EQ(vm.size(), hm.size());
    for (size_t i = 0; i < vm.size(); ++i) {
      EXPECT_EQ(vm[i].loss, hm[i].loss) << "step " << i + 1;
      EXPECT_EQ(vm[i].grad_norm, hm[i].grad_norm) << "step " << i + 1;
      EXPECT_EQ(vm[i].tokens, hm[i].tokens) << "step " << i + 1;
    }
    EXPECT_LT(hm.back().loss, hm.front().loss);
    // What the schedule is for: a fetched block serves every micro-batch, and the accumulators
    // (on NVMe) are written once per step instead of once per micro-batch.
    const uint64_t gas = v.setup.grad_accum;
    if (v.setup.reuse == 0) {  // nothing cached between uses: every acquire fetches
      const uint64_t h_h2d = hm[3].memory.h2d_bytes - hm[2].memory.h2d_bytes;
      const uint64_t v_h2d = vm[3].memory.h2d_bytes - vm[2].memory.h2d_bytes;
      EXPECT_GT(v_h2d, 0u);
      // Horizontal fetches every block once per micro-batch and direction, except that the
      // embedding stays from one micro-batch's backward to the next one's forward.
      EXPECT_LT(v_h2d * (gas - 1), h_h2d) << "bytes fetched per step: vertical " << v_h2d << ", horizontal " << h_h2d;
    }
    if (v.setup.accumulators == "nvme") {
      const uint64_t h_wr = hm[3].memory.nvme_write_bytes - hm[2].memory.nvme_write_bytes;
      const uint64_t v_wr = vm[3].memory.nvme_write_bytes - vm[2].memory.nvme_write_bytes;
      EXPECT_LT(v_wr, h_wr) << "NVMe bytes written per step";
    }
  }
}

// Note [Gradients stored in 16 bits]: the step's fp32 sums rounded once to bf16 where the optimizer
// reads them, on every tier and schedule the same bits, with the fp32 sums' norm: step 1's norm
// equals the fp32-stored run's, and the weights do not (the rounding happened).
TEST(Trainer, Bf16StoredGradientsAreBitIdenticalAcrossPlacementsWithTheFp32Norm) {
  constexpr int kSteps = 5;
  struct Variant {
    const char* name;
    RunSetup setup;
  };
  const RunSetup ref_setup{.optimizer = "cpu", .grad_accum = 3, .schedule = "vertical", .store = "bf16"};
  const std::vector<Variant> variants = {
      {"params cpu, optimizer nvme, accumulators nvme",
       {.param = "cpu",
        .optimizer = "nvme",
        .grad_accum = 3,
        .schedule = "vertical",
        .accumulators = "nvme",
        .store = "bf16"}},
      {"params nvme, optimizer nvme, accumulators cpu",
       {.param = "nvme",
        .optimizer = "nvme",
        .max_in_cpu = 0,
        .grad_accum = 3,
        .schedule = "vertical",
        .accumulators = "cpu",
        .store = "bf16"}},
      {"stage 2, optimizer cpu, accumulators nvme",
       {.stage = 2,
        .optimizer = "cpu",
        .grad_accum = 3,
        .schedule = "vertical",
        .accumulators = "nvme",
        .store = "bf16"}},
  };
  TempDir ref_dir, fp32_dir;
  std::vector<StepMetrics> ref_metrics, fp32_metrics;
  nlohmann::json plan;
  const auto reference = train(make_options(ref_setup, ref_dir), kSteps, &ref_metrics, &plan);
  EXPECT_EQ(plan["memory_plan"]["placement"]["grad_dtype"], "bf16") << plan.dump();
  EXPECT_EQ(plan["memory_plan"]["placement"]["grad_sum_dtype"], "fp32") << plan.dump();
  EXPECT_LT(ref_metrics.back().loss, ref_metrics.front().loss);
  RunSetup fp32_setup = ref_setup;
  fp32_setup.store = "auto";
  const auto fp32 = train(make_options(fp32_setup, fp32_dir), kSteps, &fp32_metrics);
  EXPECT_EQ(ref_metrics[0].grad_norm, fp32_metrics[0].grad_norm);
  EXPECT_EQ(ref_metrics[0].loss, fp32_metrics[0].loss);
  EXPECT_FALSE(bit_identical(reference, fp32));
  for (const Variant& v : variants) {
    SCOPED_TRACE(v.name);
    TempDir dir;
    std::vector<StepMetrics> metrics;
    const auto weights = train(make_options(v.setup, dir), kSteps, &metrics);
    EXPECT_TRUE(bit_identical(weights, reference));
    ASSERT_EQ(metrics.size(), ref_metrics.size());
    for (size_t i = 0; i < metrics.size(); ++i) {
      EXPECT_EQ(metrics[i].loss, ref_metrics[i].loss) << "step " << i + 1;
      EXPECT_EQ(metrics[i].grad_norm, ref_metrics[i].grad_norm) << "step " << i + 1;
    }
  }
  // GAS 1 needs no vertical schedule (one window per step either way). With bf16 compute and no
  // tied parameter each gradient leaves the device in bf16 and its sum is that one value, so storing
  // it in bf16 rounds nothing: the weights are the fp32-stored run's.
  TempDir one_dir, one_fp32_dir;
  RunSetup one_setup{.param = "cpu", .optimizer = "nvme", .grad_accum = 1, .accumulators = "nvme", .store = "bf16"};
  const auto one = train(make_options(one_setup, one_dir), 3);
  one_setup.store = "auto";
  EXPECT_TRUE(bit_identical(one, train(make_options(one_setup, one_fp32_dir), 3)));
}

// Note [No accumulator]: each sub-group is stepped from its final gradient while backward goes on,
// with no accumulator; the weights, losses and norms are those of the stored path, on every
// placement of the compute copies, with the vertical schedule, 16-bit stored gradients, 8-bit
// moments and bf16 masters updated in place in the pinned compute copies.
TEST(Trainer, NoAccumulatorIsBitIdenticalToTheStoredPath) {
  constexpr int kSteps = 4;
  struct Variant {
    const char* name;
    RunSetup setup;
    bool tied = false;
    uint64_t sub_group_size = 16384;
  };
  auto base = [](RunSetup s, const char* optimizer = "cpu", bool pipeline = false) {
    s.optimizer = optimizer;
    s.pipeline = pipeline;
    s.clipping = 0;
    s.check_overflow = false;
    return s;
  };
  const std::vector<Variant> variants = {
      {"bf16, GAS 1, params on the device, tied", base({.grad_accum = 1}), true},
      {"bf16, vertical GAS 3, params cpu", base({.param = "cpu", .grad_accum = 3, .schedule = "vertical"})},
      {"bf16, GAS 1, params nvme, bf16 stored gradients, sub-groups of 4096",
       base({.param = "nvme", .max_in_cpu = 0, .grad_accum = 1, .store = "bf16"}), false, 4096},
      {"bf16, GAS 1, params cpu, 8-bit moments, bf16 masters in the compute copies",
       base({.param = "cpu", .grad_accum = 1, .moments = "8bit", .master = "bf16"}), true},
      {"fp32, stage 2, GAS 1, one optimizer thread", base({.stage = 2, .precision = "fp32", .grad_accum = 1})},
      {"bf16, vertical GAS 2, params cpu, optimizer nvme pipelined",
       base({.param = "cpu", .grad_accum = 2, .schedule = "vertical"}, "nvme", true), true},
      {"bf16, GAS 1, params nvme, optimizer nvme, 8-bit moments, sub-groups of 4096",
       base({.param = "nvme", .max_in_cpu = 0, .grad_accum = 1, .moments = "8bit"}, "nvme"), false, 4096},
  };
  for (const Variant& v : variants) {
    SCOPED_TRACE(v.name);
    TempDir stored_dir, direct_dir;
    RunSetup direct = v.setup;
    direct.accumulators = "none";
    TrainOptions so = make_options(v.setup, stored_dir, v.tied), dopt = make_options(direct, direct_dir, v.tied);
    so.config.zero.sub_group_size = dopt.config.zero.sub_group_size = v.sub_group_size;
    if (v.setup.stage == 2) so.config.zoffload.optimizer_threads = dopt.config.zoffload.optimizer_threads = 1;
    std::vector<StepMetrics> sm, dm;
    nlohmann::json splan, dplan;
    const auto stored = train(so, kSteps, &sm, &splan);
    const auto direct_run = train(dopt, kSteps, &dm, &dplan);
    EXPECT_LT(sm.back().loss, sm.front().loss);  // it trains, so equality proves something
    EXPECT_TRUE(bit_identical(direct_run, stored));
    ASSERT_EQ(dm.size(), sm.size());
    for (size_t i = 0; i < dm.size(); ++i) {
      EXPECT_EQ(dm[i].loss, sm[i].loss) << "step " << i + 1;
      EXPECT_EQ(dm[i].grad_norm, sm[i].grad_norm) << "step " << i + 1;
      EXPECT_GT(dm[i].optimizer_s, 0.0) << "step " << i + 1;
      EXPECT_EQ(dm[i].optimizer_wait_s, 0.0) << "step " << i + 1;
    }
    // The plan holds no accumulator: RAM is smaller by at least the stored gradients' bytes (beside
    // an NVMe optimizer too: "auto" keeps them in RAM there).
    const nlohmann::json &sp = splan["memory_plan"], &dp = dplan["memory_plan"];
    EXPECT_EQ(dp["placement"]["grad"], "none") << dp.dump();
    const uint64_t n = sp["total_elems"];
    const uint64_t grad_bytes = v.setup.store == "bf16" ? 2 : 4;
    EXPECT_GE(sp["cpu_pageable_bytes"].get<uint64_t>() - dp["cpu_pageable_bytes"].get<uint64_t>(), grad_bytes * n);
    EXPECT_EQ(sp["nvme_optimizer_bytes"], dp["nvme_optimizer_bytes"]);
    // Note [Gradients that land where they are summed]: fp32 sums arriving in fp32 (the vertical
    // schedule's, or an fp32 model's) land in pinned buffers, not in the ring, with the same bits.
    const bool lands = (v.setup.schedule == "vertical" || v.setup.precision == "fp32") && v.setup.store != "bf16";
    EXPECT_EQ(dp["landing_buffers"].get<uint64_t>() > 0, lands) << dp.dump();
    EXPECT_EQ(sp["landing_buffers"].get<uint64_t>(), 0u);
  }
}

// A compute copy's write fails while backward is stepping the sub-groups: the step reports it with
// the sub-group and file, and the run refuses to go on with states some of whose sub-groups are a
// step ahead (torn), as after a failed optimizer step.
// Trains step 1, makes the write at offset 0 of the swap file named `file` fail (EIO) in step 2, and
// checks that step 2 fails with an I/O error whose message holds each of `named`, and that step 3
// refuses the torn states.
void expect_a_failed_write_ends_the_run(TrainOptions o, const std::string& file,
                                        const std::vector<std::string>& named) {
  o.io_faults = std::make_shared<io::FaultInjector>();
  auto t = Trainer::create(o);
  ASSERT_TRUE(t.is_ok()) << t.status().to_string();
  ASSERT_TRUE((*t)->step().is_ok());
  o.io_faults->add({.kind = io::FaultKind::kEio, .op = io::IoOp::kWrite, .path_contains = file, .offset_bytes = 0});
  auto failed = (*t)->step();
  ASSERT_FALSE(failed.is_ok());
  EXPECT_EQ(failed.status().code(), StatusCode::kIoError);
  const std::string msg = failed.status().to_string();
  for (const std::string& part : named) EXPECT_THAT(msg, HasSubstr(part));
  EXPECT_EQ(o.io_faults->injected(), 1u);
  auto after = (*t)->step();
  ASSERT_FALSE(after.is_ok());
  EXPECT_EQ(after.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(after.status().to_string(), HasSubstr("torn"));
}

TEST(Trainer, ANoAccumulatorStepFailureEndsTheRun) {
  TempDir dir;
  // Offset 0 of param.swp is sub-group 0's compute copy (the embedding's): backward's last, so the
  // other sub-groups have been stepped when it fails.
  expect_a_failed_write_ends_the_run(make_options({.param = "nvme",
                                                   .optimizer = "cpu",
                                                   .max_in_cpu = 0,
                                                   .clipping = 0,
                                                   .grad_accum = 1,
                                                   .accumulators = "none",
                                                   .check_overflow = false},
                                                  dir),
                                     "param.swp", {"optimizer step 2", "sub-group 0", "param.swp"});
}

// Note [Checkpoints on the CPU]: the layers' inputs wait in pinned host slots and come back for
// backward; bytes are copied, not recomputed, so the weights cannot change.
TEST(Trainer, CheckpointsOnTheCpuGiveBitIdenticalWeightsUnderBothSchedules) {
  constexpr int kSteps = 4;
  struct Variant {
    const char* name;
    RunSetup setup;
  };
  const std::vector<Variant> variants = {
      {"bf16, vertical, params cpu, optimizer nvme",
       {.param = "cpu", .optimizer = "nvme", .grad_accum = 4, .schedule = "vertical"}},
      {"fp32, horizontal, optimizer cpu", {.optimizer = "cpu", .precision = "fp32", .grad_accum = 2}},
      {"fp16, vertical, stage 0", {.stage = 0, .precision = "fp16", .grad_accum = 3, .schedule = "vertical"}},
  };
  for (const Variant& v : variants) {
    SCOPED_TRACE(v.name);
    TempDir d_dir, c_dir;
    RunSetup on_device = v.setup, on_cpu = v.setup;
    on_device.checkpoints = "device";
    on_cpu.checkpoints = "cpu";
    // Six layers: with two, backward's first layer holds as many checkpoints either way.
    TrainOptions d_opt = make_options(on_device, d_dir), c_opt = make_options(on_cpu, c_dir);
    d_opt.model_config->num_hidden_layers = c_opt.model_config->num_hidden_layers = 6;
    std::vector<StepMetrics> dm, cm;
    const auto device_run = train(d_opt, kSteps, &dm);
    std::string plan;
    std::vector<std::vector<float>> cpu_run;
    {
      auto t = Trainer::create(c_opt);
      ASSERT_TRUE(t.is_ok()) << t.status().to_string();
      plan = (*t)->plan_json();
      for (int i = 0; i < kSteps; ++i) {
        auto m = (*t)->step();
        ASSERT_TRUE(m.is_ok()) << m.status().to_string();
        cm.push_back(*m);
      }
      cpu_run = masters(**t);
    }
    EXPECT_TRUE(bit_identical(cpu_run, device_run));
    ASSERT_EQ(cm.size(), dm.size());
    for (size_t i = 0; i < cm.size(); ++i) {
      EXPECT_EQ(cm[i].loss, dm[i].loss) << "step " << i + 1;
      EXPECT_EQ(cm[i].grad_norm, dm[i].grad_norm) << "step " << i + 1;
    }
    EXPECT_LT(dm.back().loss, dm.front().loss);
    const nlohmann::json pj = nlohmann::json::parse(plan);
    EXPECT_TRUE(pj["device"]["checkpoints_on_host"].get<bool>()) << plan;
    EXPECT_GT(pj["host"]["checkpoint_bytes"].get<uint64_t>(), 0u) << plan;
    // The checkpoints really left LibTorch's memory: its peak (backward's first layer) falls by the
    // four of six layers' inputs that no longer wait there, 2/3 of the host bytes.
    EXPECT_LE(cm.back().torch_peak_bytes + pj["host"]["checkpoint_bytes"].get<uint64_t>() / 2,
              dm.back().torch_peak_bytes)
        << "LibTorch's peak: checkpoints on the CPU " << cm.back().torch_peak_bytes << ", on the device "
        << dm.back().torch_peak_bytes;
  }
}

TEST(Trainer, BadInputsFailAtStartWithClearErrors) {
  TempDir dir;
  TrainOptions o = make_options(RunSetup{}, dir);
  o.data_path = dir.path + "/missing.txt";
  auto t = Trainer::create(o);
  ASSERT_FALSE(t.is_ok());
  EXPECT_THAT(t.status().to_string(), HasSubstr("missing.txt"));

  TrainOptions seq = make_options(RunSetup{}, dir);
  seq.seq_len = 1024;
  auto s = Trainer::create(seq);
  ASSERT_FALSE(s.is_ok());
  EXPECT_THAT(s.status().to_string(), HasSubstr("max_position_embeddings"));

  EXPECT_FALSE(resolve_model_config("no-such-model", io::Env::posix()).is_ok());
  EXPECT_THAT(resolve_model_config("no-such-model", io::Env::posix()).status().to_string(), HasSubstr("tiny"));
}

// Issue 40 (Note [One run per run directory]): a second run on a run directory another run holds
// is refused before it touches anything there; the first run's metrics go on whole, and the
// directory is free again once the first run ends.
TEST(Trainer, ASecondRunOnTheSameRunDirectoryIsRefused) {
  TempDir dir;
  const TrainOptions o = make_options({.param = "cpu", .optimizer = "cpu"}, dir);
  auto first = Trainer::create(o);
  ASSERT_TRUE(first.is_ok()) << first.status().to_string();
  ASSERT_TRUE((*first)->step().is_ok());
  auto second = Trainer::create(o);
  ASSERT_FALSE(second.is_ok());
  EXPECT_EQ(second.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(second.status().message(),
              HasSubstr("run directory " + o.out_dir + " is in use by another zoffload run"));
  ASSERT_TRUE((*first)->step().is_ok());
  std::ifstream metrics((*first)->metrics_path());
  std::string line;
  int lines = 0;
  while (std::getline(metrics, line)) ++lines;
  EXPECT_EQ(lines, 2) << "the refused run touched the first run's metrics";
  first->reset();
  auto third = Trainer::create(o);
  EXPECT_TRUE(third.is_ok()) << "the lock ends with the run: " << third.status().to_string();
}

// Note [One run per run directory]: two runs with one checkpoint directory (each its own --out) are
// one too many; Note [Run ids]: one after the other, `latest` found from the first run's --out is
// refused when the second wrote it, and the second's pruning leaves the first's steps.
TEST(Trainer, TwoRunsOnOneCheckpointDirectoryNeverMixTheirCheckpoints) {
  TempDir dir;
  const std::string shared = dir.path + "/shared-ckpt";
  TrainOptions a = with_checkpoints(make_options({.param = "cpu", .optimizer = "cpu", .precision = "fp32"}, dir),
                                    shared);
  a.config.zoffload.checkpoint.keep_last = 1;
  TrainOptions b = a;
  a.out_dir = dir.path + "/a";
  b.out_dir = dir.path + "/b";
  {
    auto first = Trainer::create(a);
    ASSERT_TRUE(first.is_ok()) << first.status().to_string();
    auto second = Trainer::create(b);
    ASSERT_FALSE(second.is_ok());
    EXPECT_EQ(second.status().code(), StatusCode::kFailedPrecondition);
    EXPECT_THAT(second.status().message(),
                HasSubstr("zoffload.checkpoint.dir " + shared + " is in use by another zoffload run"));
    EXPECT_FALSE(std::filesystem::exists(b.out_dir)) << "the refused run left its --out";
    for (int i = 0; i < 3; ++i) ASSERT_TRUE((*first)->step().is_ok());
    ASSERT_TRUE((*first)->save_checkpoint().is_ok());
  }
  {
    auto second = Trainer::create(b);
    ASSERT_TRUE(second.is_ok()) << "once the first has ended: " << second.status().to_string();
    ASSERT_TRUE((*second)->step().is_ok());
    auto saved = (*second)->save_checkpoint();
    ASSERT_TRUE(saved.is_ok()) << saved.status().to_string();
    EXPECT_TRUE(saved->pruned.empty()) << "keep_last 1 pruned the other run's " << saved->pruned.front();
  }
  EXPECT_TRUE(std::filesystem::exists(shared + "/step-3")) << "the first run's checkpoint";
  TrainOptions again = a;
  again.resume = "latest";
  auto refused = Trainer::create(again);
  ASSERT_FALSE(refused.is_ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.status().message(), HasSubstr("was written by another run"));
  EXPECT_THAT(refused.status().message(), HasSubstr("--out " + std::filesystem::absolute(b.out_dir).string()));
  again.resume = shared + "/step-3";
  auto named = Trainer::create(again);
  ASSERT_TRUE(named.is_ok()) << "the step directory itself continues the run: " << named.status().to_string();
  EXPECT_EQ((*named)->steps_done(), 3u);
}

// Issue 40 (Note [Output files]): what the run would write over is checked before anything is
// built — a directory where the metrics or a csv_monitor file goes, a checkpoint directory under a
// regular file — with one error naming it, and nothing of the user's is touched.
TEST(Trainer, OutputPathsInTheWayAreRefusedAtStartAndKept) {
  TempDir dir;
  const std::string run = dir.path + "/run";
  std::filesystem::create_directories(run + "/mine/sub");
  std::ofstream(run + "/mine/keep.txt") << "keep\n";
  std::ofstream(dir.path + "/notes.txt") << "mine\n";
  struct Case {
    std::string name, want;
    std::function<void(TrainOptions&)> set;
  };
  const std::vector<Case> cases = {
      {"metrics_path", "the metrics file (zoffload.log.metrics_path) " + run + "/mine is a directory",
       [&](TrainOptions& o) { o.config.zoffload.log.metrics_path = "mine"; }},
      {"csv_monitor", "csv_monitor file " + run + "/logs/mine/Train_Samples_train_loss.csv is a directory",
       [&](TrainOptions& o) {
         std::filesystem::create_directories(run + "/logs/mine/Train_Samples_train_loss.csv");
         o.config.csv_monitor = {.enabled = true, .output_path = "logs", .job_name = "mine"};
       }},
      {"checkpoint.dir", dir.path + "/notes.txt is not a directory",
       [&](TrainOptions& o) { o.config.zoffload.checkpoint.dir = dir.path + "/notes.txt/ckpt"; }},
  };
  for (const Case& c : cases) {
    TrainOptions o = make_options({.param = "cpu", .optimizer = "nvme"}, dir);
    c.set(o);
    auto t = Trainer::create(o);
    ASSERT_FALSE(t.is_ok()) << c.name;
    EXPECT_EQ(t.status().code(), StatusCode::kInvalidArgument) << c.name;
    EXPECT_THAT(t.status().message(), HasSubstr(c.want)) << c.name;
    EXPECT_FALSE(std::filesystem::exists(dir.path + "/nvme")) << c.name << ": refused after the swap files were made";
  }
  std::ifstream keep(run + "/mine/keep.txt"), notes(dir.path + "/notes.txt");
  std::string a, b;
  std::getline(keep, a);
  std::getline(notes, b);
  EXPECT_EQ(a, "keep");
  EXPECT_EQ(b, "mine");
  EXPECT_TRUE(std::filesystem::is_directory(run + "/mine/sub"));
}

// A step that fails before the optimizer (here: a label outside the vocabulary in the data) loses
// its gradients; the next step starts a fresh accumulation window and trains.
TEST(Trainer, AStepThatFailsBeforeTheOptimizerDoesNotWedgeTheRun) {
  // Under both schedules: the vertical one reads all three batches of a step before any forward.
  for (const char* schedule : {"horizontal", "vertical"}) {
    SCOPED_TRACE(schedule);
    TempDir dir;
    const std::string data = dir.path + "/data.jsonl";
    {
      std::ofstream f(data);
      for (int line = 0; line < 40; ++line) {
        nlohmann::json ids = nlohmann::json::array(), labels = nlohmann::json::array();
        for (int i = 0; i < 33; ++i) {
          ids.push_back((line * 37 + i * 11) % 256);
          labels.push_back(line == 5 && i == 20 ? 999 : (line * 37 + i * 11) % 256);
        }
        f << nlohmann::json{{"input_ids", ids}, {"labels", labels}}.dump() << "\n";
      }
    }
    const uint64_t gas = std::string(schedule) == "vertical" ? 3 : 1;
    TrainOptions o = make_options({.param = "cpu", .optimizer = "nvme", .grad_accum = gas, .schedule = schedule}, dir);
    o.data_path = data;
    auto t = Trainer::create(o);
    ASSERT_TRUE(t.is_ok()) << t.status().to_string();
    int failed_at = -1;
    for (int i = 0; i < 40 && failed_at < 0; ++i) {
      auto m = (*t)->step();
      if (!m.is_ok()) {
        failed_at = i;
        EXPECT_THAT(m.status().to_string(), HasSubstr("label 999"));
      }
    }
    ASSERT_GE(failed_at, 0) << "the bad label was never read";
    for (int i = 0; i < 3; ++i) {
      auto m = (*t)->step();
      ASSERT_TRUE(m.is_ok()) << "step after the failure: " << m.status().to_string();
      EXPECT_FALSE(m->skipped);
    }
  }
}

// Note [Overlapped optimizer]: the optimizer of step N running beside the forward of step N+1
// computes exactly what running it after the backward computes, on every placement.
TEST(Trainer, OverlappedOptimizerIsBitIdenticalToTheSequentialStep) {
  constexpr int kSteps = 6;
  struct Variant {
    const char* name;
    RunSetup setup;
  };
  const std::vector<Variant> variants = {
      {"params on the device, optimizer cpu", {.optimizer = "cpu"}},
      {"params cpu, optimizer cpu, persistent small params", {.param = "cpu", .optimizer = "cpu", .persistence = 5000}},
      {"params cpu, optimizer nvme, prefetch", {.param = "cpu", .optimizer = "nvme", .pipeline = true}},
      {"params nvme, optimizer nvme, pipelined",
       {.param = "nvme", .optimizer = "nvme", .pipeline = true, .max_in_cpu = 0}},
      {"tied embeddings, params nvme, optimizer nvme", {.param = "nvme", .optimizer = "nvme", .max_in_cpu = 0}},
      {"stage 0", {.stage = 0}},
  };
  for (const Variant& v : variants) {
    SCOPED_TRACE(v.name);
    const bool tied = std::string(v.name).rfind("tied", 0) == 0;
    TempDir seq_dir, over_dir;
    TrainOptions seq = make_options(v.setup, seq_dir, tied);
    seq.config.zoffload.overlap_optimizer = false;
    std::vector<StepMetrics> seq_metrics, over_metrics;
    const auto sequential = train(seq, kSteps, &seq_metrics);
    const auto overlapped = train(make_options(v.setup, over_dir, tied), kSteps, &over_metrics);
    EXPECT_TRUE(bit_identical(overlapped, sequential));
    ASSERT_EQ(over_metrics.size(), seq_metrics.size());
    for (size_t i = 0; i < over_metrics.size(); ++i) {
      EXPECT_EQ(over_metrics[i].loss, seq_metrics[i].loss) << "step " << i + 1;
      EXPECT_EQ(over_metrics[i].grad_norm, seq_metrics[i].grad_norm) << "step " << i + 1;
      // Run inline, the optimizer is all waiting for the training thread.
      EXPECT_GE(seq_metrics[i].optimizer_wait_s, seq_metrics[i].optimizer_s) << "step " << i + 1;
    }
    EXPECT_LT(seq_metrics.back().loss, seq_metrics.front().loss);
  }
}

// The optimizer's I/O fails while the next step's forward runs behind it: the step reports the
// failure with the sub-group, file and offset, and the run refuses to go on with torn states
// (docs/memory.md) instead of training on them.
TEST(Trainer, AnOptimizerFailureBehindTheNextForwardEndsTheRun) {
  TempDir dir;
  // Offset 0 of optimizer.swp is sub-group 0's master: only the optimizer writes it.
  expect_a_failed_write_ends_the_run(make_options({.param = "cpu", .optimizer = "nvme", .pipeline = true}, dir),
                                     "optimizer.swp",
                                     {"step 2: optimizer step 2", "sub-group 0", "optimizer.swp", "offset 0"});
}

// A write of an NVMe gradient accumulator fails on the gradient worker's thread, behind the
// backward: the step reports it with the sub-group, file and offset, loses its gradients, and the
// next steps start a fresh accumulation window and train (as a data error does).
TEST(Trainer, AGradientWriteFailureIsReportedAndTheNextStepsTrain) {
  // Under both schedules: the vertical one writes each accumulator once per step, after summing.
  for (const char* schedule : {"horizontal", "vertical"}) {
    SCOPED_TRACE(schedule);
    TempDir dir;
    TrainOptions o =
        make_options({.param = "cpu", .optimizer = "nvme", .schedule = schedule, .accumulators = "nvme"}, dir);
    o.io_faults = std::make_shared<io::FaultInjector>();
    // The head's sub-group is the last, the first whose gradients backward writes; its gradient
    // section sits after its master and moments in optimizer.swp (docs/memory.md, swap file layout).
    auto registry = ParamRegistry::build(model_layout(small_model()).params, 16384);
    ASSERT_TRUE(registry.is_ok()) << registry.status().to_string();
    const auto groups = registry->sub_groups();
    const uint32_t last = static_cast<uint32_t>(groups.size() - 1);
    uint64_t grad_offset = 0;
    for (uint32_t g = 0; g < groups.size(); ++g) {
      const uint64_t section = align_up(groups[g].n_elems * 4, kSwapAlignment);  // fp32 states and accumulator
      grad_offset += g < last ? 4 * section : 3 * section;
    }
    auto t = Trainer::create(o);
    ASSERT_TRUE(t.is_ok()) << t.status().to_string();
    ASSERT_TRUE((*t)->step().is_ok());
    o.io_faults->add({.kind = io::FaultKind::kEio,
                      .op = io::IoOp::kWrite,
                      .path_contains = "optimizer.swp",
                      .offset_bytes = grad_offset});
    auto failed = (*t)->step();
    ASSERT_FALSE(failed.is_ok());
    EXPECT_EQ(failed.status().code(), StatusCode::kIoError);
    const std::string msg = failed.status().to_string();
    EXPECT_THAT(msg, HasSubstr("step 2: "));
    EXPECT_THAT(msg, HasSubstr("sub-group " + std::to_string(last)));
    EXPECT_THAT(msg, HasSubstr("optimizer.swp"));
    EXPECT_THAT(msg, HasSubstr("offset " + std::to_string(grad_offset)));
    EXPECT_EQ(o.io_faults->injected(), 1u);
    for (int i = 0; i < 3; ++i) {
      auto m = (*t)->step();
      ASSERT_TRUE(m.is_ok()) << "step after the failure: " << m.status().to_string();
      EXPECT_FALSE(m->skipped);
      EXPECT_TRUE(std::isfinite(m->loss) && std::isfinite(m->grad_norm));
    }
  }
}

TEST(Trainer, WritesOneMetricsLinePerStep) {
  TempDir dir;
  const TrainOptions o = make_options({.param = "cpu", .optimizer = "nvme"}, dir);
  {
    auto t = Trainer::create(o);
    ASSERT_TRUE(t.is_ok()) << t.status().to_string();
    for (int i = 0; i < 3; ++i) ASSERT_TRUE((*t)->step().is_ok());
  }
  std::ifstream in(o.out_dir + "/metrics.jsonl");
  std::string line;
  int n = 0;
  while (std::getline(in, line)) {
    auto j = nlohmann::json::parse(line);
    EXPECT_EQ(j["step"], n + 1);
    EXPECT_TRUE(j.contains("time_s") && j["time_s"].contains("fetch") && j["time_s"].contains("optimizer"));
    EXPECT_TRUE(j["time_s"].contains("optimizer_wait") && j["time_s"].contains("nvme_busy"));
    // The optimizer is on NVMe: the drive was busy, and the busiest resource is part of the step.
    EXPECT_GT(j["time_s"]["nvme_busy"].get<double>(), 0.0);
    EXPECT_GT(j["overlap"].get<double>(), 0.0);
    // The device's own time: the blocks' compute (on the emulated device, the host's, within the
    // training thread's compute), parameters up (offload_param cpu) and gradients down.
    const double step_s = j["step_s"].get<double>();
    EXPECT_GT(j["time_s"]["device_compute"].get<double>(), 0.0);
    EXPECT_LE(j["time_s"]["device_compute"].get<double>(), j["time_s"]["compute"].get<double>());
    EXPECT_GT(j["time_s"]["device_h2d"].get<double>(), 0.0);
    EXPECT_GT(j["time_s"]["device_d2h"].get<double>(), 0.0);
    EXPECT_DOUBLE_EQ(j["device_busy"].get<double>(), j["time_s"]["device_compute"].get<double>() / step_s);
    EXPECT_GE(j["overlap"].get<double>(), j["device_busy"].get<double>());
    // The gradient worker accumulated every gradient, on its thread within the step's micro-steps.
    const double worker_s = j["time_s"]["grad_worker"].get<double>();
    EXPECT_GT(worker_s, 0.0);
    EXPECT_LE(worker_s, step_s);
    EXPECT_GE(j["overlap"].get<double>(), worker_s / step_s);
    EXPECT_GT(j["memory"]["nvme"]["peak_bytes"].get<uint64_t>(), 0u);
    EXPECT_GT(j["tokens"].get<uint64_t>(), 0u);
    ++n;
  }
  EXPECT_EQ(n, 3);
}

// ---------------------------------------------------------------------------------------------
// Checkpoints and resume

std::string file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

TrainOptions with_checkpoints(TrainOptions o, const std::string& dir) {
  o.config.zoffload.checkpoint.dir = dir;
  o.config.zoffload.checkpoint.every_steps = 0;
  o.config.zoffload.checkpoint.keep_last = 0;
  o.config.zoffload.checkpoint.staging_buffer_size = uint64_t{1} << 20;
  return o;
}

// N steps + save + resume (a new Trainer, possibly with other offload settings) + M steps equals
// N + M uninterrupted steps: every loss, and the weights and both Adam moments bit for bit.
TEST(Resume, ContinuesBitExactlyWithTheOptimizerOnNvme) {
  constexpr int kN = 3, kM = 3;
  struct Variant {
    const char* name;
    RunSetup first;
    RunSetup resumed;
    std::vector<uint64_t> overflow;
  };
  const std::vector<Variant> variants = {
      {"bf16 nvme/nvme -> nvme/nvme",
       {.param = "nvme", .optimizer = "nvme", .pipeline = true, .max_in_cpu = 0},
       {.param = "nvme", .optimizer = "nvme", .pipeline = true, .max_in_cpu = 0},
       {}},
      {"bf16 nvme/nvme -> cpu/cpu",
       {.param = "nvme", .optimizer = "nvme", .max_in_cpu = 0},
       {.param = "cpu", .optimizer = "cpu"},
       {}},
      {"fp16 with an overflow before the save, nvme/cpu",
       {.param = "cpu", .optimizer = "nvme", .precision = "fp16"},
       {.param = "cpu", .optimizer = "nvme", .precision = "fp16"},
       {2}},
      // The vertical schedule reads all three batches of the next step ahead: the checkpoint
      // records the position before them, whichever schedule resumes.
      {"vertical, GAS 3, nvme/nvme -> vertical cpu/cpu",
       {.param = "nvme", .optimizer = "nvme", .max_in_cpu = 0, .grad_accum = 3, .schedule = "vertical"},
       {.param = "cpu", .optimizer = "cpu", .grad_accum = 3, .schedule = "vertical"},
       {}},
      {"vertical, GAS 3, cpu/nvme -> horizontal cpu/nvme",
       {.param = "cpu", .optimizer = "nvme", .grad_accum = 3, .schedule = "vertical"},
       {.param = "cpu", .optimizer = "nvme", .grad_accum = 3},
       {}},
  };
  for (const Variant& v : variants) {
    SCOPED_TRACE(v.name);
    TempDir a_dir, b_dir;
    // The uninterrupted run, saving after step N (a save only reads) and at the end.
    TrainOptions a = with_checkpoints(make_options(v.first, a_dir), a_dir.path + "/ckpt");
    a.inject_overflow_steps = v.overflow;
    auto ta = Trainer::create(a);
    ASSERT_TRUE(ta.is_ok()) << ta.status().to_string();
    std::vector<StepMetrics> am;
    for (int i = 0; i < kN + kM; ++i) {
      auto m = (*ta)->step();
      ASSERT_TRUE(m.is_ok()) << m.status().to_string();
      am.push_back(*m);
      if (i + 1 == kN) {
        auto saved = (*ta)->save_checkpoint();
        ASSERT_TRUE(saved.is_ok()) << saved.status().to_string();
      }
    }
    ASSERT_TRUE((*ta)->save_checkpoint().is_ok());
    const auto a_master = masters(**ta);
    if (!v.overflow.empty()) { EXPECT_TRUE(am[1].skipped); }

    // The same run without any save: saving changed nothing.
    TempDir c_dir;
    TrainOptions c = make_options(v.first, c_dir);
    c.inject_overflow_steps = v.overflow;
    EXPECT_TRUE(bit_identical(train(c, kN + kM), a_master));

    // Resumed from step N.
    TrainOptions b = with_checkpoints(make_options(v.resumed, b_dir), b_dir.path + "/ckpt");
    b.resume = a_dir.path + "/ckpt/step-" + std::to_string(kN);
    b.seed = 12345;  // ignored: the checkpoint's seed orders the data
    auto tb = Trainer::create(b);
    ASSERT_TRUE(tb.is_ok()) << tb.status().to_string();
    EXPECT_EQ((*tb)->steps_done(), static_cast<uint64_t>(kN));
    EXPECT_EQ((*tb)->resumed_from(), b.resume);
    EXPECT_FALSE((*tb)->checkpoint_due(true));  // nothing new to save yet
    for (int i = kN; i < kN + kM; ++i) {
      auto m = (*tb)->step();
      ASSERT_TRUE(m.is_ok()) << m.status().to_string();
      EXPECT_EQ(m->step, am[i].step);
      EXPECT_EQ(m->loss, am[i].loss) << "step " << m->step;
      EXPECT_EQ(m->lr, am[i].lr);
      EXPECT_EQ(m->loss_scale, am[i].loss_scale);
      EXPECT_EQ(m->grad_norm, am[i].grad_norm);
    }
    ASSERT_TRUE((*tb)->checkpoint_due(true));
    ASSERT_TRUE((*tb)->save_checkpoint().is_ok());
    EXPECT_TRUE(bit_identical(masters(**tb), a_master));
    const std::string step = "/ckpt/step-" + std::to_string(kN + kM) + "/";
    for (const char* f : {"master.safetensors", "exp_avg.safetensors", "exp_avg_sq.safetensors"}) {
      const std::string x = file_bytes(a_dir.path + step + f), y = file_bytes(b_dir.path + step + f);
      EXPECT_GT(x.size(), 4096u);
      EXPECT_TRUE(x == y) << f << " differs after resume";
    }
    // The moments are not trivially equal: training moved them.
    EXPECT_NE(file_bytes(a_dir.path + step + "exp_avg.safetensors"),
              file_bytes(a_dir.path + "/ckpt/step-" + std::to_string(kN) + "/exp_avg.safetensors"));
  }
}

// bf16 masters (Note [Stochastic rounding to bf16]): every element's rounding is keyed by the run's
// seed, the step and its parameter, so the placement, the sub-group size, the optimizer's threads
// and a resume change no bit; the weights are bf16 values, unlike an fp32-master run's; a checkpoint
// keeps them in bf16, and a run with fp32 masters refuses to resume from it.
TEST(Resume, Bf16MastersAreBitIdenticalAcrossPlacementsThreadsAndAResume) {
  constexpr int kN = 3, kM = 3;
  struct Variant {
    const char* name;
    RunSetup setup;
    uint64_t sub_group_size = 16384;
    int threads = 0;
  };
  const RunSetup ref_setup{.optimizer = "cpu", .master = "bf16"};
  const std::vector<Variant> variants = {
      {"params cpu, optimizer nvme, pipelined",
       {.param = "cpu", .optimizer = "nvme", .pipeline = true, .master = "bf16"}},
      {"params nvme, optimizer nvme, sub-groups of 4096",
       {.param = "nvme", .optimizer = "nvme", .max_in_cpu = 0, .master = "bf16"},
       4096},
      {"stage 2, optimizer cpu, one optimizer thread", {.stage = 2, .optimizer = "cpu", .master = "bf16"}, 16384, 1},
      // Note [A bf16 master is its compute copy]: both in RAM, one array, updated in place.
      {"params cpu, optimizer cpu: the master is the compute copy",
       {.param = "cpu", .optimizer = "cpu", .master = "bf16"}},
  };
  TempDir a_dir;
  TrainOptions a = with_checkpoints(make_options(ref_setup, a_dir), a_dir.path + "/ckpt");
  auto ta = Trainer::create(a);
  ASSERT_TRUE(ta.is_ok()) << ta.status().to_string();
  EXPECT_EQ(nlohmann::json::parse((*ta)->plan_json())["memory_plan"]["placement"]["master_dtype"], "bf16");
  auto run = steps_saving_after(**ta, kN + kM, kN);
  ASSERT_TRUE(run.is_ok()) << run.status().to_string();
  const std::vector<StepMetrics>& am = *run;
  ASSERT_TRUE((*ta)->save_checkpoint().is_ok());
  const auto reference = masters(**ta);
  EXPECT_LT(am.back().loss, am.front().loss);
  size_t elems = 0;
  for (const auto& p : reference)
    for (float x : p) {
      EXPECT_EQ(float_bits(x) & 0xFFFFu, 0u) << "a bf16 master holds bf16 values";
      ++elems;
    }
  ASSERT_GT(elems, 0u);
  TempDir fp32_dir;
  RunSetup fp32_setup = ref_setup;
  fp32_setup.master = "fp32";
  EXPECT_FALSE(bit_identical(train(make_options(fp32_setup, fp32_dir), kN + kM), reference));

  for (const Variant& v : variants) {
    SCOPED_TRACE(v.name);
    TempDir dir;
    TrainOptions o = make_options(v.setup, dir);
    o.config.zero.sub_group_size = v.sub_group_size;
    o.config.zoffload.optimizer_threads = v.threads;
    std::vector<StepMetrics> metrics;
    nlohmann::json plan;
    EXPECT_TRUE(bit_identical(train(o, kN + kM, &metrics, &plan), reference));
    for (size_t i = 0; i < metrics.size(); ++i) EXPECT_EQ(metrics[i].loss, am[i].loss) << "step " << i + 1;
    if (v.setup.param == "cpu" && v.setup.optimizer == "cpu") {
      // RAM holds the fp32 moments and accumulators, 12 bytes a parameter (each section of each
      // sub-group rounded up to a page), and no master beside the pinned compute copies.
      const nlohmann::json& mp = plan["memory_plan"];
      const uint64_t n = mp["total_elems"], groups = mp["n_sub_groups"];
      EXPECT_GE(mp["cpu_pageable_bytes"].get<uint64_t>(), 12 * n);
      EXPECT_LE(mp["cpu_pageable_bytes"].get<uint64_t>(), 12 * n + 3 * 4096 * groups);
      EXPECT_LE(mp["cpu_pinned_bytes"].get<uint64_t>(), 2 * n + 4096 * groups);
    }
  }

  // Resumed from step N on NVMe: the same steps, weights and checkpoint files.
  TempDir b_dir;
  TrainOptions b = with_checkpoints(make_options(variants[1].setup, b_dir), b_dir.path + "/ckpt");
  b.resume = a_dir.path + "/ckpt/step-" + std::to_string(kN);
  b.seed = 12345;  // ignored: the checkpoint's seed orders the data and keys the rounding
  auto tb = Trainer::create(b);
  ASSERT_TRUE(tb.is_ok()) << tb.status().to_string();
  for (int i = kN; i < kN + kM; ++i) {
    auto m = (*tb)->step();
    ASSERT_TRUE(m.is_ok()) << m.status().to_string();
    EXPECT_EQ(m->loss, am[i].loss) << "step " << m->step;
    EXPECT_EQ(m->grad_norm, am[i].grad_norm) << "step " << m->step;
  }
  ASSERT_TRUE((*tb)->save_checkpoint().is_ok());
  EXPECT_TRUE(bit_identical(masters(**tb), reference));
  const std::string step = "/ckpt/step-" + std::to_string(kN + kM) + "/";
  const std::string master_file = file_bytes(a_dir.path + step + "master.safetensors");
  EXPECT_EQ(master_file, file_bytes(b_dir.path + step + "master.safetensors"));
  EXPECT_NE(master_file.find("\"BF16\""), std::string::npos) << "the masters are saved in bf16";
  EXPECT_EQ(nlohmann::json::parse(file_bytes(a_dir.path + step + "manifest.json"))["master_dtype"], "bf16");

  // A run with fp32 masters does not resume from bf16 ones.
  TempDir c_dir;
  TrainOptions c = make_options(RunSetup{.optimizer = "cpu"}, c_dir);
  c.resume = b.resume;
  auto tc = Trainer::create(c);
  EXPECT_EQ(tc.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(tc.status().message(), HasSubstr("zoffload.master_dtype"));
}

// The narrow states on the device (the optimizer not offloaded): bf16 moments, 8-bit moments and
// bf16 masters, alone and together, step through the device's adam_step / adam8bit_step with the CPU
// tier's arithmetic, so a run is bit-identical to the same run with the optimizer on the CPU; a
// bf16 master is its device compute copy (no bytes of its own on the device); and a run resumed on
// the device from the CPU tier's checkpoint continues it bit-exactly.
TEST(Trainer, NarrowStatesOnTheDeviceAreBitIdenticalToTheCpuTier) {
  constexpr int kN = 3, kM = 2;
  struct Variant {
    const char* name;
    std::string moments, master;
  };
  const std::vector<Variant> variants = {{"bf16 moments", "bf16", "fp32"},
                                         {"8-bit moments", "8bit", "fp32"},
                                         {"bf16 masters", "fp32", "bf16"},
                                         {"8-bit moments, bf16 masters", "8bit", "bf16"}};
  for (const Variant& v : variants) {
    SCOPED_TRACE(v.name);
    // Stage 2 with the optimizer on the CPU and the compute copies on the device, against stage 2
    // with everything on the device; 4096-element sub-groups split the larger parameters.
    RunSetup device_setup{.stage = 2, .grad_accum = 1};
    device_setup.moments = v.moments;
    device_setup.master = v.master;
    RunSetup cpu_setup = device_setup;
    cpu_setup.optimizer = "cpu";
    TempDir cpu_dir, device_dir, fp32_dir, resume_dir;
    TrainOptions co = with_checkpoints(make_options(cpu_setup, cpu_dir), cpu_dir.path + "/ckpt");
    TrainOptions dopt = make_options(device_setup, device_dir);
    co.config.zero.sub_group_size = dopt.config.zero.sub_group_size = 4096;
    auto tc = Trainer::create(co);
    ASSERT_TRUE(tc.is_ok()) << tc.status().to_string();
    auto run = steps_saving_after(**tc, kN + kM, kN);
    ASSERT_TRUE(run.is_ok()) << run.status().to_string();
    const std::vector<StepMetrics>& cm = *run;
    const auto on_cpu = masters(**tc);
    EXPECT_LT(cm.back().loss, cm.front().loss) << "it trains";
    std::vector<StepMetrics> dm;
    nlohmann::json dplan;
    EXPECT_TRUE(bit_identical(train(dopt, kN + kM, &dm, &dplan), on_cpu));
    ASSERT_EQ(dm.size(), cm.size());
    for (size_t i = 0; i < dm.size(); ++i) {
      EXPECT_EQ(dm[i].loss, cm[i].loss) << "step " << i + 1;
      EXPECT_EQ(dm[i].grad_norm, cm[i].grad_norm) << "step " << i + 1;
    }
    const nlohmann::json& placement = dplan["memory_plan"]["placement"];
    EXPECT_EQ(placement["optimizer"], "device") << placement.dump();
    EXPECT_EQ(placement["moment_dtype"], v.moments) << placement.dump();
    EXPECT_EQ(placement["master_dtype"], v.master) << placement.dump();
    // The narrowing is real: the fp32 run's weights differ.
    RunSetup fp32_setup{.stage = 2, .grad_accum = 1};
    TrainOptions fo = make_options(fp32_setup, fp32_dir);
    fo.config.zero.sub_group_size = 4096;
    const nlohmann::json fplan = [&] {
      nlohmann::json plan;
      EXPECT_FALSE(bit_identical(train(fo, kN + kM, nullptr, &plan), on_cpu));
      return plan;
    }();
    // Device bytes: the states shrink with them (a bf16 master has none of its own).
    EXPECT_LT(dplan["memory_plan"]["device_bytes"].get<uint64_t>(),
              fplan["memory_plan"]["device_bytes"].get<uint64_t>());
    // Resumed on the device from the CPU run's step-kN checkpoint: the CPU run's last steps.
    TrainOptions ro = make_options(device_setup, resume_dir);
    ro.config.zero.sub_group_size = 4096;
    ro.resume = cpu_dir.path + "/ckpt/step-" + std::to_string(kN);
    auto tr = Trainer::create(ro);
    ASSERT_TRUE(tr.is_ok()) << tr.status().to_string();
    for (int i = kN; i < kN + kM; ++i) {
      auto m = (*tr)->step();
      ASSERT_TRUE(m.is_ok()) << m.status().to_string();
      EXPECT_EQ(m->loss, cm[i].loss) << "step " << m->step;
    }
    EXPECT_TRUE(bit_identical(masters(**tr), on_cpu));
  }
}

// Note [No accumulator]: the accumulators are not part of a checkpoint, so a run without them saves
// what a run with them saves, and either resumes the other's checkpoint bit-exactly.
TEST(Resume, NoAccumulatorAndStoredRunsResumeEachOthersCheckpointsBitExactly) {
  constexpr int kN = 2, kM = 2;
  auto setup = [](const char* accumulators) {
    return RunSetup{.param = "cpu",
                    .optimizer = "nvme",
                    .pipeline = true,
                    .clipping = 0,
                    .grad_accum = 2,
                    .schedule = "vertical",
                    .accumulators = accumulators,
                    .check_overflow = false};
  };
  struct Run {
    std::vector<StepMetrics> metrics;
    std::vector<std::vector<float>> weights;
  };
  std::map<std::string, Run> full;
  std::map<std::string, std::unique_ptr<TempDir>> dirs;
  for (const char* acc : {"none", "cpu"}) {
    dirs[acc] = std::make_unique<TempDir>();
    TrainOptions o = with_checkpoints(make_options(setup(acc), *dirs[acc]), dirs[acc]->path + "/ckpt");
    auto t = Trainer::create(o);
    ASSERT_TRUE(t.is_ok()) << t.status().to_string();
    auto run = steps_saving_after(**t, kN + kM, kN);
    ASSERT_TRUE(run.is_ok()) << run.status().to_string();
    full[acc].metrics = *run;
    full[acc].weights = masters(**t);
  }
  EXPECT_TRUE(bit_identical(full["none"].weights, full["cpu"].weights));
  const std::string step = "/ckpt/step-" + std::to_string(kN) + "/";
  for (const char* file : {"master.safetensors", "exp_avg.safetensors", "exp_avg_sq.safetensors"})
    EXPECT_EQ(file_bytes(dirs["none"]->path + step + file), file_bytes(dirs["cpu"]->path + step + file)) << file;
  // Each resumes the other's checkpoint.
  for (const auto& [from, to] : {std::pair<std::string, const char*>{"cpu", "none"}, {"none", "cpu"}}) {
    SCOPED_TRACE("resumed from a " + from + " run's checkpoint with accumulators " + to);
    TempDir dir;
    TrainOptions o = make_options(setup(to), dir);
    o.resume = dirs[from]->path + "/ckpt/step-" + std::to_string(kN);
    auto t = Trainer::create(o);
    ASSERT_TRUE(t.is_ok()) << t.status().to_string();
    for (int i = kN; i < kN + kM; ++i) {
      auto m = (*t)->step();
      ASSERT_TRUE(m.is_ok()) << m.status().to_string();
      EXPECT_EQ(m->loss, full[from].metrics[i].loss) << "step " << m->step;
      EXPECT_EQ(m->grad_norm, full[from].metrics[i].grad_norm) << "step " << m->step;
    }
    EXPECT_TRUE(bit_identical(masters(**t), full[from].weights));
  }
}

// ENOSPC in the middle of a save: the error names the file; the previous checkpoint and `latest`
// are intact; training goes on exactly as if no save had been tried.
TEST(Resume, AFailedSaveLeavesTrainingUnchanged) {
  TempDir dir, ref_dir;
  const RunSetup setup{.param = "nvme", .optimizer = "nvme", .max_in_cpu = 0};
  TrainOptions o = with_checkpoints(make_options(setup, dir), dir.path + "/ckpt");
  o.io_faults = std::make_shared<io::FaultInjector>();
  auto t = Trainer::create(o);
  ASSERT_TRUE(t.is_ok()) << t.status().to_string();
  ASSERT_TRUE((*t)->step().is_ok());
  ASSERT_TRUE((*t)->save_checkpoint().is_ok());
  ASSERT_TRUE((*t)->step().is_ok());
  o.io_faults->add({.kind = io::FaultKind::kNoSpace,
                    .op = io::IoOp::kWrite,
                    .path_contains = "exp_avg_sq.safetensors",
                    .offset_bytes = 8192});
  auto failed = (*t)->save_checkpoint();
  ASSERT_FALSE(failed.is_ok());
  EXPECT_EQ(failed.status().code(), StatusCode::kNoSpace);
  EXPECT_THAT(failed.status().to_string(), HasSubstr("exp_avg_sq.safetensors"));
  EXPECT_EQ(file_bytes(dir.path + "/ckpt/latest"), "step-1\n");
  EXPECT_FALSE(std::filesystem::exists(dir.path + "/ckpt/step-2"));
  EXPECT_TRUE((*t)->checkpoint_due(true));  // still owed
  for (int i = 0; i < 2; ++i) ASSERT_TRUE((*t)->step().is_ok());
  EXPECT_TRUE(bit_identical(masters(**t), train(make_options(setup, ref_dir), 4)));
  auto ok = (*t)->save_checkpoint();
  ASSERT_TRUE(ok.is_ok()) << ok.status().to_string();
  EXPECT_EQ(file_bytes(dir.path + "/ckpt/latest"), "step-4\n");
}

TEST(Resume, RefusesWhatItCannotContinue) {
  TempDir dir, other;
  TrainOptions o = make_options(RunSetup{}, dir);
  o.resume = "latest";
  EXPECT_THAT(Trainer::create(o).status().message(), HasSubstr("zoffload.checkpoint.dir"));
  // A checkpoint of another shape.
  TrainOptions small = with_checkpoints(make_options(RunSetup{}, dir), dir.path + "/ckpt");
  {
    auto t = Trainer::create(small);
    ASSERT_TRUE(t.is_ok());
    ASSERT_TRUE((*t)->step().is_ok());
    ASSERT_TRUE((*t)->save_checkpoint().is_ok());
  }
  TrainOptions wide = make_options(RunSetup{}, other);
  wide.model_config->hidden_size = 96;
  wide.model_config->num_attention_heads = 6;
  wide.model_config->num_key_value_heads = 3;
  wide.resume = dir.path + "/ckpt";
  auto r = Trainer::create(wide);
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("model.embed_tokens.weight"));

  // A checkpoint of a family this build does not know (as a newer build would save it: its
  // config.json says so and the manifest checks it), though its tensors have the run's names and
  // shapes: refused naming model_type, before anything is read.
  const std::string step = dir.path + "/ckpt/step-1";
  std::string config = file_bytes(step + "/config.json");
  const size_t at = config.find("\"llama\"");
  ASSERT_NE(at, std::string::npos) << config;
  config.replace(at, 7, "\"mamba2\"");
  std::ofstream(step + "/config.json", std::ios::binary | std::ios::trunc) << config;
  nlohmann::json manifest = nlohmann::json::parse(file_bytes(step + "/manifest.json"));
  char crc[9];
  std::snprintf(crc, sizeof crc, "%08x", crc32c(config.data(), config.size()));
  for (nlohmann::json& f : manifest["files"]) {
    if (f["name"] != "config.json") continue;
    f["size_bytes"] = config.size();
    f["crc32c"] = {std::string(crc)};
  }
  std::ofstream(step + "/manifest.json", std::ios::binary | std::ios::trunc) << manifest.dump(1);
  TrainOptions same = make_options(RunSetup{}, other);
  same.resume = step;
  auto unknown = Trainer::create(same);
  EXPECT_EQ(unknown.status().code(), StatusCode::kInvalidArgument) << unknown.status().to_string();
  EXPECT_THAT(unknown.status().message(), HasSubstr("key 'model_type': unsupported model_type \"mamba2\""));
  EXPECT_THAT(unknown.status().message(), HasSubstr("its model is not one this build trains"));
}

// Runs two ranks as threads of this process, joined by a real TCPStore and Gloo: each makes its
// options with `options(rank)` (the group is set here, and the batch doubled for the two ranks),
// creates its Trainer and runs `body(rank, trainer, options)`. Returns each rank's first error:
// creating its group or trainer, or the body's. The ranks share this process (and Gloo's device
// loop), so neither tears its trainer down before both have left `body` (a barrier), and the groups
// outlive both threads. Separate processes, as `zoffload train` runs them, have no such overlap. A
// CI run once died with SIGSEGV while each thread destroyed its trainer and group as it left; about
// 150 runs here did not reproduce it. The trainers are still torn down side by side: one by one, the
// first would wait for the other's part of a collective until the group's timeout.
std::array<Status, 2> run_two_ranks(const std::function<TrainOptions(uint32_t)>& options,
                                    const std::function<Status(uint32_t, Trainer&, const TrainOptions&)>& body) {
  std::array<Status, 2> out;
  const uint16_t port = free_port();
  std::vector<std::unique_ptr<dist::ProcessGroup>> groups(2);
  std::vector<std::unique_ptr<Trainer>> trainers(2);
  std::barrier both_done(2);
  std::vector<std::thread> ranks;
  for (uint32_t r = 0; r < 2; ++r) {
    ranks.emplace_back([&, r] {
      struct TearDown {
        std::barrier<>& both_done;
        std::unique_ptr<Trainer>& trainer;
        ~TearDown() {
          both_done.arrive_and_wait();
          trainer.reset();
        }
      } tear_down{both_done, trainers[r]};
      dist::WorldInfo w;
      w.rank = r;
      w.world_size = 2;
      w.local_rank = r;
      w.local_world_size = 2;
      w.master_addr = "127.0.0.1";
      w.master_port = port;
      auto group = dist::ProcessGroup::create(w, std::chrono::seconds(60));
      if (!group.is_ok()) {
        out[r] = group.status();
        return;
      }
      groups[r] = std::move(*group);
      TrainOptions o = options(r);
      o.config.train_batch_size *= 2;
      o.group = groups[r].get();
      auto t = Trainer::create(o);
      if (!t.is_ok()) {
        out[r] = t.status();
        return;
      }
      trainers[r] = std::move(*t);
      out[r] = body(r, *trainers[r], o);
    });
  }
  for (std::thread& t : ranks) t.join();
  groups.clear();
  return out;
}

// Two ranks train `steps` steps of `setup`: each rank's metrics and, per param, its master where that
// rank holds all of it (empty where not).
struct TwoRanks {
  std::array<Status, 2> setup;
  std::vector<StepMetrics> metrics[2];
  std::vector<std::vector<float>> masters[2];
};
// `model`: the ranks' model where not small_model().
TwoRanks train_two_ranks(const RunSetup& setup, int steps, const ModelConfig* model = nullptr) {
  TwoRanks out;
  TempDir own[2];
  out.setup = run_two_ranks(
      [&](uint32_t r) {
        TrainOptions o = make_options(setup, own[r]);
        if (model != nullptr) o.model_config = *model;
        return o;
      },
      [&](uint32_t r, Trainer& t, const TrainOptions&) -> Status {
        for (int i = 0; i < steps; ++i) {
          auto m = t.step();
          if (!m.is_ok()) return m.status();
          out.metrics[r].push_back(*m);
        }
        out.masters[r] = masters_held(t);
        return Status::ok();
      });
  return out;
}

// Note [No accumulator] with two ranks at stage 2 (the compute copies replicated: each owner sends
// its updated ones after backward) and stage 3 (the compute copies partitioned, on the CPU, and the
// optimizer states on NVMe: the next forward gathers the blocks from their owners): each rank steps
// the sub-groups it owns as their reduced gradients land, and every step's loss and norm and every
// rank's masters are those of the stored path.
TEST(Trainer, NoAccumulatorOverTwoRanksIsBitIdenticalToTheStoredPath) {
  constexpr int kSteps = 3;
  for (const int stage : {2, 3}) {
    SCOPED_TRACE("stage " + std::to_string(stage));
    RunSetup stored{.stage = stage, .clipping = 0, .grad_accum = 1, .check_overflow = false};
    stored.param = stage == 3 ? "cpu" : "none";
    stored.optimizer = stage == 3 ? "nvme" : "cpu";
    RunSetup direct = stored;
    direct.accumulators = "none";
    const TwoRanks a = train_two_ranks(stored, kSteps), b = train_two_ranks(direct, kSteps);
    for (uint32_t r = 0; r < 2; ++r) {
      SCOPED_TRACE("rank " + std::to_string(r));
      ASSERT_TRUE(a.setup[r].is_ok()) << a.setup[r].to_string();
      ASSERT_TRUE(b.setup[r].is_ok()) << b.setup[r].to_string();
      ASSERT_EQ(a.metrics[r].size(), static_cast<size_t>(kSteps));
      ASSERT_EQ(b.metrics[r].size(), static_cast<size_t>(kSteps));
      for (int i = 0; i < kSteps; ++i) {
        EXPECT_EQ(b.metrics[r][i].loss, a.metrics[r][i].loss) << "step " << i + 1;
        EXPECT_EQ(b.metrics[r][i].grad_norm, a.metrics[r][i].grad_norm) << "step " << i + 1;
      }
      EXPECT_LT(a.metrics[r].back().loss, a.metrics[r].front().loss) << "it trains";
      size_t held = 0;
      for (const auto& m : a.masters[r]) held += m.empty() ? 0 : 1;
      EXPECT_GT(held, 0u) << "this rank holds whole params";
      EXPECT_LT(held, a.masters[r].size()) << "and not all of them: the states are partitioned";
      EXPECT_TRUE(bit_identical(b.masters[r], a.masters[r]));
    }
  }
}

// Note [Gather beside the step]: two ranks (threads of this process, joined by a real TCPStore and
// Gloo) with partitioned optimizer states on NVMe. Rank 1's optimizer cannot write: it reports its
// I/O error, and rank 0 stops too, naming rank 1, instead of waiting for copies that will never
// come: at stage 1 the updated compute copies rank 1 still sends, at stage 3 (Note [Gathered
// parameters]) the blocks the next forward gathers from it.
TEST(Trainer, APartitionedRankWhoseOptimizerFailsStopsEveryRank) {
  for (const int stage : {1, 3}) {
    SCOPED_TRACE("stage " + std::to_string(stage));
    std::vector<Result<StepMetrics>> second(2, Result<StepMetrics>(internal_error("not run")));
    TempDir own[2];
    const std::array<Status, 2> setup = run_two_ranks(
        [&](uint32_t r) {
          TrainOptions o =
              make_options({.stage = stage, .param = stage == 3 ? "cpu" : "none", .optimizer = "nvme"}, own[r]);
          o.io_faults = std::make_shared<io::FaultInjector>();
          return o;
        },
        [&](uint32_t r, Trainer& t, const TrainOptions& o) -> Status {
          auto first = t.step();
          if (!first.is_ok()) return first.status();
          // Offset 0 of rank 1's optimizer.swp is the master of the first sub-group it owns.
          if (r == 1)
            o.io_faults->add({.kind = io::FaultKind::kEio,
                              .op = io::IoOp::kWrite,
                              .path_contains = "optimizer.swp",
                              .offset_bytes = 0});
          second[r] = t.step();
          return Status::ok();
        });
    for (uint32_t r = 0; r < 2; ++r) ASSERT_TRUE(setup[r].is_ok()) << "rank " << r << ": " << setup[r].to_string();
    ASSERT_FALSE(second[1].is_ok());
    EXPECT_EQ(second[1].status().code(), StatusCode::kIoError) << second[1].status().to_string();
    EXPECT_THAT(second[1].status().to_string(), HasSubstr("optimizer.swp"));
    ASSERT_FALSE(second[0].is_ok());
    EXPECT_EQ(second[0].status().code(), StatusCode::kAborted) << second[0].status().to_string();
    EXPECT_THAT(second[0].status().to_string(), HasSubstr("the optimizer step of rank 1 of 2 failed"));
  }
}

}  // namespace
// The families beside llama (Note [Model families]) hold what every llama placement holds: the
// small model in each family's shape (Qwen3's per-head q/k norms, OLMo 2's post norms and whole
// q/k norms, Gemma 3's sandwich norms with a window shorter than the rows on its sliding layer,
// Phi-3's fused projections with longrope over part of each head and a window on every layer)
// trains bit-identically with its parameters and optimizer on NVMe as with nothing offloaded, and
// at stages 0–2 with the optimizer resident, on the CPU or on NVMe; resumes from a checkpoint
// bit-exactly on another placement; and trains over two ranks at stage 3 (partitioned, gathered
// over Gloo) bit-identically whether the ranks offload or not.
TEST(Trainer, EveryFamilyTrainsAlikeOnEveryPlacementOverTwoRanksAndAfterAResume) {
  const std::string shape = R"("vocab_size": 256, "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2,
      "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256, "rms_norm_eps": 1e-5)";
  const std::vector<std::pair<std::string, std::string>> families = {
      {"qwen3", R"({"model_type": "qwen3", "head_dim": 32, )" + shape + "}"},
      {"olmo2", R"({"model_type": "olmo2", )" + shape + "}"},
      {"gemma3_text", R"({"model_type": "gemma3_text", "head_dim": 16, "query_pre_attn_scalar": 24,
          "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"], "final_logit_softcapping": 5.0,
          "rope_scaling": {"rope_type": "linear", "factor": 2.0}, )" +
                          shape + "}"},
      {"phi3", R"({"model_type": "phi3", "pad_token_id": 0, "partial_rotary_factor": 0.5, "sliding_window": 8,
          "original_max_position_embeddings": 16, "rope_scaling": {"type": "longrope",
          "short_factor": [1.0, 1.1, 1.2, 1.3], "long_factor": [1.0, 2.0, 4.0, 8.0]}, )" +
                   shape + "}"},
  };
  constexpr int kN = 2, kM = 2;
  for (const auto& [name, json] : families) {
    SCOPED_TRACE(name);
    Result<ModelConfig> model = parse_hf_config(json, name + "/config.json");
    ASSERT_TRUE(model.is_ok()) << model.status().to_string();
    const RunSetup resident{.param = "none", .optimizer = "none"};
    const RunSetup offloaded{.param = "nvme", .optimizer = "nvme", .pipeline = true, .max_in_cpu = 0};

    TempDir a_dir, b_dir, c_dir;
    TrainOptions a = with_checkpoints(make_options(resident, a_dir), a_dir.path + "/ckpt");
    a.model_config = *model;
    auto ta = Trainer::create(a);
    ASSERT_TRUE(ta.is_ok()) << ta.status().to_string();
    auto run = steps_saving_after(**ta, kN + kM, kN);
    ASSERT_TRUE(run.is_ok()) << run.status().to_string();
    const std::vector<StepMetrics>& am = *run;
    EXPECT_LT(am.back().loss, am.front().loss) << "it trains";
    const auto a_master = masters(**ta);

    TrainOptions b = make_options(offloaded, b_dir);
    b.model_config = *model;
    std::vector<StepMetrics> bm;
    EXPECT_TRUE(bit_identical(train(b, kN + kM, &bm), a_master)) << "offloaded to NVMe";
    for (int i = 0; i < kN + kM; ++i) EXPECT_EQ(bm[i].loss, am[i].loss) << "step " << i + 1;

    TrainOptions c = make_options(offloaded, c_dir);
    c.model_config = *model;
    c.resume = a_dir.path + "/ckpt/step-" + std::to_string(kN);
    auto tc = Trainer::create(c);
    ASSERT_TRUE(tc.is_ok()) << tc.status().to_string();
    for (int i = kN; i < kN + kM; ++i) {
      auto m = (*tc)->step();
      ASSERT_TRUE(m.is_ok()) << m.status().to_string();
      EXPECT_EQ(m->loss, am[i].loss) << "resumed, step " << m->step;
      EXPECT_EQ(m->grad_norm, am[i].grad_norm) << "resumed, step " << m->step;
    }
    EXPECT_TRUE(bit_identical(masters(**tc), a_master)) << "resumed on NVMe";

    // Stages 0–2 keep the compute copies whole on the device: with the optimizer on the CPU, on NVMe
    // or resident, the same weights as stage 3's.
    for (const auto& [stage, optimizer] :
         std::vector<std::pair<int, std::string>>{{0, "none"}, {1, "cpu"}, {2, "nvme"}}) {
      TempDir d;
      RunSetup setup = resident;
      setup.stage = stage;
      setup.optimizer = optimizer;
      TrainOptions o = make_options(setup, d);
      o.model_config = *model;
      EXPECT_TRUE(bit_identical(train(o, kN + kM), a_master)) << "stage " << stage << ", optimizer " << optimizer;
    }

    RunSetup ranks_resident = resident, ranks_offloaded = offloaded;
    ranks_resident.grad_accum = ranks_offloaded.grad_accum = 1;
    const TwoRanks x = train_two_ranks(ranks_resident, 3, &*model), y = train_two_ranks(ranks_offloaded, 3, &*model);
    for (uint32_t r = 0; r < 2; ++r) {
      SCOPED_TRACE("rank " + std::to_string(r));
      ASSERT_TRUE(x.setup[r].is_ok()) << x.setup[r].to_string();
      ASSERT_TRUE(y.setup[r].is_ok()) << y.setup[r].to_string();
      ASSERT_EQ(x.metrics[r].size(), 3u);
      ASSERT_EQ(y.metrics[r].size(), 3u);
      for (int i = 0; i < 3; ++i) EXPECT_EQ(y.metrics[r][i].loss, x.metrics[r][i].loss) << "step " << i + 1;
      EXPECT_LT(x.metrics[r].back().loss, x.metrics[r].front().loss) << "it trains";
      EXPECT_TRUE(bit_identical(y.masters[r], x.masters[r]));
    }
  }
}

namespace {

// Chat-like JSONL of a masked prompt and a labelled reply per example, of uneven lengths (so every
// micro-batch has its own count of labelled targets): about `tokens` tokens under the byte vocabulary.
std::string write_masked_jsonl(const std::string& path, uint64_t tokens, uint64_t seed) {
  std::ofstream out(path);
  uint64_t state = seed, written = 0;
  auto next = [&](uint64_t bound) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    return (state >> 33) % bound;
  };
  while (written < tokens) {
    const uint64_t prompt = 2 + next(23), reply = 1 + next(12);
    nlohmann::json ids = nlohmann::json::array(), labels = nlohmann::json::array();
    for (uint64_t i = 0; i < prompt + reply; ++i) {
      const uint64_t token = next(256);
      ids.push_back(token);
      labels.push_back(i < prompt ? nlohmann::json(-100) : nlohmann::json(token));
    }
    out << nlohmann::json{{"input_ids", ids}, {"labels", labels}}.dump() << "\n";
    written += prompt + reply;
  }
  return path;
}

// Note [Loss normalisation] and Note [Evaluation] over ranks: two ranks at stage 3 (the compute
// copies partitioned and gathered, the vertical schedule, GAS 2) read the same global batches per
// step as one rank with GAS 4, so with loss_normalization "tokens" (the labelled tokens of every
// rank) the two runs take the same steps, and the held-out data's loss (each rank evaluating every
// other batch, the vertical schedule's passes of two) is the one rank's. Equal to float rounding:
// the sums are added in another order.
TEST(Trainer, LossByTokensAndEvaluationOverTwoRanksAreOneRanks) {
  TempDir data_dir;
  const std::string data = write_masked_jsonl(data_dir.path + "/chat.jsonl", 6000, 45);
  const std::string eval = write_masked_jsonl(data_dir.path + "/eval.jsonl", 1200, 46);
  constexpr int kSteps = 3;
  auto options = [&](const RunSetup& setup, const TempDir& dir) {
    TrainOptions o = make_options(setup, dir);
    o.config.zoffload.loss_normalization = "tokens";
    o.data_path = data;
    o.eval_data_path = eval;
    o.eval_every = 2;
    o.eval_batches = 4;
    o.last_step = kSteps;
    return o;
  };
  const RunSetup one{.param = "cpu", .optimizer = "cpu", .precision = "fp32", .grad_accum = 4};
  const RunSetup two{.param = "cpu", .optimizer = "cpu", .precision = "fp32", .grad_accum = 2, .schedule = "vertical"};
  TempDir single_dir;
  std::vector<StepMetrics> want;
  {
    auto single = Trainer::create(options(one, single_dir));
    ASSERT_TRUE(single.is_ok()) << single.status().to_string();
    for (int i = 0; i < kSteps; ++i) {
      auto m = (*single)->step();
      ASSERT_TRUE(m.is_ok()) << m.status().to_string();
      want.push_back(*m);
    }
  }
  ASSERT_TRUE(want[1].eval && want[2].eval && !want[0].eval) << "evaluated after steps 2 and 3 (the last)";
  // The steps are worth comparing: their labelled tokens differ, so the two normalisations differ.
  EXPECT_NE(want[0].tokens, want[1].tokens);
  EXPECT_LT(want[0].tokens, uint64_t{4 * 2 * 32});

  TempDir own[2];
  std::vector<StepMetrics> got[2];
  const std::array<Status, 2> ranks = run_two_ranks([&](uint32_t r) { return options(two, own[r]); },
                                                    [&](uint32_t r, Trainer& t, const TrainOptions&) -> Status {
                                                      for (int i = 0; i < kSteps; ++i) {
                                                        auto m = t.step();
                                                        if (!m.is_ok()) return m.status();
                                                        got[r].push_back(*m);
                                                      }
                                                      return Status::ok();
                                                    });
  for (uint32_t r = 0; r < 2; ++r) ASSERT_TRUE(ranks[r].is_ok()) << "rank " << r << ": " << ranks[r].to_string();
  auto near = [](double a, double b) { return std::abs(a - b) <= 1e-5 * std::abs(b); };
  for (uint32_t r = 0; r < 2; ++r) {
    ASSERT_EQ(got[r].size(), want.size());
    for (size_t i = 0; i < want.size(); ++i) {
      SCOPED_TRACE("rank " + std::to_string(r) + ", step " + std::to_string(i + 1));
      EXPECT_EQ(got[r][i].tokens, want[i].tokens);
      EXPECT_PRED2(near, got[r][i].loss, want[i].loss);
      EXPECT_PRED2(near, got[r][i].grad_norm, want[i].grad_norm);
      ASSERT_EQ(got[r][i].eval.has_value(), want[i].eval.has_value());
      if (!want[i].eval) continue;
      EXPECT_EQ(got[r][i].eval->batches, 4u);
      EXPECT_EQ(got[r][i].eval->tokens, want[i].eval->tokens);
      EXPECT_PRED2(near, got[r][i].eval->loss, want[i].eval->loss);
      EXPECT_GT(got[r][i].eval->eval_s, 0.0);
    }
  }
  // The evaluation after step 2 saw step 2's weights, not step 3's: its loss moved by step 3.
  EXPECT_NE(want[1].eval->loss, want[2].eval->loss);
}

// Evaluation refuses what it cannot do, before the run starts.
TEST(Trainer, EvaluationSettingsAreCheckedAtStart) {
  TempDir dir;
  TrainOptions o = make_options({.precision = "fp32"}, dir);
  o.eval_data_path = corpus_path();
  o.eval_every = 0;
  o.last_step = 0;
  auto never = Trainer::create(o);
  ASSERT_FALSE(never.is_ok());
  EXPECT_THAT(never.status().message(), HasSubstr("would never be evaluated"));
  o.eval_every = 1;
  o.eval_data_path = dir.path + "/missing.bin";
  auto missing = Trainer::create(o);
  ASSERT_FALSE(missing.is_ok());
  EXPECT_THAT(missing.status().message(), HasSubstr("--eval-data"));
  EXPECT_THAT(missing.status().message(), HasSubstr("missing.bin"));
}

// Note [Evaluation]: the rows an evaluation reads are checked when the run starts; an evaluation
// that fails later (here a read of the held-out file, made to fail) leaves its step complete,
// recorded and saveable, and the run resumes from it.
TEST(Trainer, AnEvaluationNeverCostsItsStep) {
  TempDir dir;
  TrainOptions o = make_options({.precision = "fp32"}, dir);
  o.eval_every = 2;
  o.eval_batches = 2;
  const std::vector<uint16_t> bad = {1, 2, 3, 256, 4};  // 256: one past the byte vocabulary
  std::vector<uint16_t> tokens(4000, 7);
  std::copy(bad.begin(), bad.end(), tokens.begin() + 40);
  o.eval_data_path = dir.path + "/eval.bin";
  {
    std::ofstream f(o.eval_data_path, std::ios::binary);
    f.write(reinterpret_cast<const char*>(tokens.data()), static_cast<std::streamsize>(tokens.size() * 2));
  }
  auto refused = Trainer::create(o);
  ASSERT_FALSE(refused.is_ok());
  EXPECT_THAT(refused.status().message(),
              HasSubstr("eval.bin: token 256 at token 43 (window 1, read by every evaluation) is outside the model's "
                        "vocabulary of 256"));

  o.eval_data_path = dir.path + "/eval.txt";
  std::filesystem::copy_file(corpus_path(), o.eval_data_path);
  o = with_checkpoints(o, dir.path + "/ckpt");
  o.io_faults = std::make_shared<io::FaultInjector>();
  auto t = Trainer::create(o);
  ASSERT_TRUE(t.is_ok()) << t.status().to_string();
  ASSERT_TRUE((*t)->step().is_ok());
  o.io_faults->add({.kind = io::FaultKind::kEio, .op = io::IoOp::kRead, .path_contains = "eval.txt"});
  auto second = (*t)->step();
  ASSERT_TRUE(second.is_ok()) << "the step is not the evaluation's: " << second.status().to_string();
  EXPECT_EQ(o.io_faults->injected(), 1u);
  EXPECT_FALSE(second->eval.has_value());
  EXPECT_THAT(second->eval_error.to_string(), HasSubstr("evaluating --eval-data " + o.eval_data_path));
  EXPECT_EQ((*t)->steps_done(), 2u);
  EXPECT_TRUE((*t)->checkpoint_due(/*end_of_run=*/true));
  auto saved = (*t)->save_checkpoint();
  ASSERT_TRUE(saved.is_ok()) << saved.status().to_string();
  std::ifstream metrics((*t)->metrics_path());
  std::string line;
  int lines = 0;
  while (std::getline(metrics, line)) ++lines;
  EXPECT_EQ(lines, 2) << "the step was recorded";
  const std::vector<std::vector<float>> before = masters(**t);
  t->reset();
  TrainOptions again = o;
  again.io_faults.reset();
  again.resume = "latest";
  auto resumed = Trainer::create(again);
  ASSERT_TRUE(resumed.is_ok()) << resumed.status().to_string();
  EXPECT_EQ((*resumed)->steps_done(), 2u);
  EXPECT_TRUE(bit_identical(masters(**resumed), before));
}

// Frozen params over two ranks (Note [Frozen sub-groups]) at stage 3, the compute copies partitioned
// and gathered: with the states offloaded to the CPU, the bits of the states on the device.
TEST(Trainer, FrozenOverTwoRanksIsBitIdenticalToResidentRanks) {
  const std::vector<std::string> freeze = {"model.embed_tokens.weight", "model.layers.1.mlp.*", "model.norm.weight"};
  RunSetup ranks_resident{.grad_accum = 1, .freeze = freeze};
  RunSetup ranks_offloaded{.param = "cpu", .optimizer = "cpu", .grad_accum = 1, .freeze = freeze};
  const TwoRanks x = train_two_ranks(ranks_resident, 3), y = train_two_ranks(ranks_offloaded, 3);
  for (uint32_t r = 0; r < 2; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    ASSERT_TRUE(x.setup[r].is_ok()) << x.setup[r].to_string();
    ASSERT_TRUE(y.setup[r].is_ok()) << y.setup[r].to_string();
    for (int i = 0; i < 3; ++i) EXPECT_EQ(y.metrics[r][i].loss, x.metrics[r][i].loss) << "step " << i + 1;
    EXPECT_LT(x.metrics[r].back().loss, x.metrics[r].front().loss) << "it trains";
    EXPECT_TRUE(bit_identical(y.masters[r], x.masters[r]));
  }
  // Stages 1 and 2 (the compute copies replicated: each owner sends its updated trainable
  // sub-groups, the frozen ones never): the same losses, and the same weights wherever both hold them.
  for (const int stage : {1, 2}) {
    SCOPED_TRACE("stage " + std::to_string(stage));
    RunSetup replicated{.stage = stage, .optimizer = "cpu", .grad_accum = 1, .freeze = freeze};
    const TwoRanks z = train_two_ranks(replicated, 3);
    for (uint32_t r = 0; r < 2; ++r) {
      ASSERT_TRUE(z.setup[r].is_ok()) << z.setup[r].to_string();
      for (int i = 0; i < 3; ++i) EXPECT_EQ(z.metrics[r][i].loss, x.metrics[r][i].loss) << "step " << i + 1;
      uint32_t compared = 0;
      for (size_t p = 0; p < x.masters[r].size(); ++p) {
        if (x.masters[r][p].empty() || z.masters[r][p].empty()) continue;
        EXPECT_EQ(z.masters[r][p], x.masters[r][p]) << "param " << p << ", rank " << r;
        ++compared;
      }
      EXPECT_GT(compared, 3u);
    }
  }
}

// Note [Frozen sub-groups] in checkpoints: the frozen params' compute copies are saved in
// frozen.safetensors (the rest as always), so a frozen run resumes bit-exactly on another placement
// and over two ranks (each rank writing its part), exports from the checkpoint what it exports live,
// and a run that freezes other params is refused by name.
TEST(Resume, FrozenRunsResumeBitExactlyAndExportFromTheCheckpoint) {
  constexpr int kN = 3, kM = 3;
  const std::vector<std::string> freeze = {"model.embed_tokens.weight", "model.layers.0.*"};
  for (const auto& [first, resumed] : std::vector<std::pair<RunSetup, RunSetup>>{
           {{.param = "nvme", .optimizer = "nvme", .max_in_cpu = 0, .freeze = freeze},
            {.param = "cpu", .optimizer = "cpu", .freeze = freeze}},
           {{.stage = 0, .precision = "fp32", .freeze = freeze},
            {.param = "nvme", .optimizer = "cpu", .max_in_cpu = 0, .precision = "fp32", .freeze = freeze}}}) {
    SCOPED_TRACE(first.precision + ", stage " + std::to_string(first.stage) + " -> " + resumed.param);
    TempDir a_dir, b_dir;
    TrainOptions a = with_checkpoints(make_options(first, a_dir), a_dir.path + "/ckpt");
    auto ta = Trainer::create(a);
    ASSERT_TRUE(ta.is_ok()) << ta.status().to_string();
    auto am = steps_saving_after(**ta, kN + kM, kN);
    ASSERT_TRUE(am.is_ok()) << am.status().to_string();
    const auto want = masters(**ta);
    const std::string ckpt = a_dir.path + "/ckpt/step-" + std::to_string(kN);
    const nlohmann::json manifest = nlohmann::json::parse(file_bytes(ckpt + "/manifest.json"));
    EXPECT_EQ(manifest["frozen_tensors"].size(), 1 + 9u);
    EXPECT_EQ(manifest["tensors"].size(), (*ta)->layout().params.size() - 10);
    EXPECT_EQ(manifest["frozen_dtype"], first.precision);

    TrainOptions b = make_options(resumed, b_dir);
    b.resume = ckpt;
    auto tb = Trainer::create(b);
    ASSERT_TRUE(tb.is_ok()) << tb.status().to_string();
    for (int i = kN; i < kN + kM; ++i) {
      auto m = (*tb)->step();
      ASSERT_TRUE(m.is_ok()) << m.status().to_string();
      EXPECT_EQ(m->loss, (*am)[i].loss) << "step " << i + 1;
    }
    EXPECT_TRUE(bit_identical(masters(**tb), want));

    // The export from the checkpoint holds what the live run at that step exported.
    TempDir live_dir;
    TrainOptions live = make_options(first, live_dir);
    auto tl = Trainer::create(live);
    ASSERT_TRUE(tl.is_ok()) << tl.status().to_string();
    for (int i = 0; i < kN; ++i) ASSERT_TRUE((*tl)->step().is_ok());
    ExportOptions eo;
    eo.dtype = DType::kF32;
    eo.out_dir = live_dir.path + "/live";
    eo.env = io::Env::posix();
    ASSERT_TRUE((*tl)->export_model(eo).is_ok());
    auto info = open_checkpoint(ckpt, io::Env::posix());
    ASSERT_TRUE(info.is_ok()) << info.status().to_string();
    auto io = io::IoEngine::create(io::IoOptions{});
    ASSERT_TRUE(io.is_ok());
    eo.out_dir = live_dir.path + "/from-ckpt";
    auto exported = export_checkpoint(*info, **io, eo);
    ASSERT_TRUE(exported.is_ok()) << exported.status().to_string();
    auto lf = SafetensorsFile::open(live_dir.path + "/live/model.safetensors", io::Env::posix());
    auto cf = SafetensorsFile::open(live_dir.path + "/from-ckpt/model.safetensors", io::Env::posix());
    ASSERT_TRUE(lf.is_ok() && cf.is_ok());
    ASSERT_EQ((*lf)->tensors().size(), (*cf)->tensors().size());
    for (const SafetensorsTensor& t : (*lf)->tensors()) {
      const SafetensorsTensor* c = (*cf)->find(t.name);
      ASSERT_NE(c, nullptr) << t.name;
      std::vector<uint8_t> x(t.size_bytes), y(c->size_bytes);
      ASSERT_TRUE((*lf)->read_raw(t, 0, x).is_ok());
      ASSERT_TRUE((*cf)->read_raw(*c, 0, y).is_ok());
      EXPECT_EQ(x, y) << t.name;
    }
  }
  // Another freeze set is refused by name, before anything is read.
  TempDir c_dir, d_dir;
  RunSetup s{.precision = "fp32", .freeze = freeze};
  auto tc = Trainer::create(with_checkpoints(make_options(s, c_dir), c_dir.path + "/ckpt"));
  ASSERT_TRUE(tc.is_ok()) << tc.status().to_string();
  ASSERT_TRUE((*tc)->step().is_ok());
  ASSERT_TRUE((*tc)->save_checkpoint().is_ok());
  RunSetup other = s;
  other.freeze = {"model.embed_tokens.weight"};
  TrainOptions d = make_options(other, d_dir);
  d.resume = c_dir.path + "/ckpt/step-1";
  auto refused = Trainer::create(d);
  ASSERT_FALSE(refused.is_ok());
  EXPECT_THAT(refused.status().message(),
              HasSubstr("model.layers.0.input_layernorm.weight was frozen when it was saved and this run trains it: "
                        "resume with the checkpoint's zoffload.freeze"));
}

// LoRA adapters (Note [LoRA adapters]) over the frozen base train like any trainable params: the
// same bits on every placement, the vertical schedule, stage 0 and over two ranks at stage 3, with
// optimizer states for the adapters only; the base never changes. A checkpoint resumes bit-exactly
// on another placement, and a run without the checkpoint's zoffload.lora is refused by name.
TEST(Lora, AdaptersTrainBitIdenticallyAcrossPlacementsSchedulesStagesAndRanks) {
  constexpr int kSteps = 4;
  const nlohmann::json lora = {{"r", 4}, {"lora_alpha", 8}, {"target_modules", {"all-linear"}}};
  RunSetup resident{.grad_accum = 2, .lora = lora};
  TempDir rd;
  auto t = Trainer::create(make_options(resident, rd));
  ASSERT_TRUE(t.is_ok()) << t.status().to_string();
  const ModelLayout& layout = (*t)->layout();
  const auto before = masters(**t);
  uint64_t adapter_elems = 0, adapters = 0;
  for (const ParamSpec& p : layout.params) {
    EXPECT_EQ(p.trainable, is_lora_param(p.name)) << p.name;
    if (!is_lora_param(p.name)) continue;
    ++adapters;
    adapter_elems += static_cast<uint64_t>(p.shape[0] * p.shape[1]);
  }
  EXPECT_EQ(adapters, 2 * 7 * (*t)->model_config().num_hidden_layers);  // A and B on the 7 projections
  const nlohmann::json plan = nlohmann::json::parse((*t)->plan_json());
  EXPECT_EQ(plan["n_trainable"].get<uint64_t>(), adapter_elems);
  std::vector<StepMetrics> rm;
  for (int i = 0; i < kSteps; ++i) {
    auto m = (*t)->step();
    ASSERT_TRUE(m.is_ok()) << m.status().to_string();
    rm.push_back(*m);
  }
  const auto want = masters(**t);
  EXPECT_LT(rm.back().loss, rm.front().loss) << "it trains";
  for (size_t p = 0; p < layout.params.size(); ++p) {
    if (is_lora_param(layout.params[p].name)) {
      EXPECT_NE(want[p], before[p]) << layout.params[p].name << " trains";
    } else {
      EXPECT_EQ(want[p], before[p]) << layout.params[p].name << " stays as loaded";
    }
  }
  auto with = [&](RunSetup s) {
    s.lora = lora;
    return s;
  };
  for (const auto& [name, setup] : std::vector<std::pair<std::string, RunSetup>>{
           {"cpu", with({.param = "cpu", .optimizer = "cpu"})},
           {"nvme", with({.param = "nvme", .optimizer = "nvme", .max_in_cpu = 0})},
           {"vertical", with({.schedule = "vertical"})},
           {"stage 0", with({.stage = 0})}}) {
    SCOPED_TRACE(name);
    TempDir d;
    std::vector<StepMetrics> m;
    const auto got = train(make_options(setup, d), kSteps, &m);
    for (int i = 0; i < kSteps; ++i) EXPECT_EQ(m[i].loss, rm[i].loss) << "step " << i + 1;
    EXPECT_TRUE(bit_identical(got, want));
  }
  // Two ranks at stage 3, the compute copies partitioned: offloaded as resident.
  const TwoRanks x = train_two_ranks(with({.grad_accum = 1}), 3),
                 y = train_two_ranks(with({.param = "cpu", .optimizer = "cpu", .grad_accum = 1}), 3);
  for (uint32_t r = 0; r < 2; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    ASSERT_TRUE(x.setup[r].is_ok()) << x.setup[r].to_string();
    ASSERT_TRUE(y.setup[r].is_ok()) << y.setup[r].to_string();
    for (int i = 0; i < 3; ++i) EXPECT_EQ(y.metrics[r][i].loss, x.metrics[r][i].loss) << "step " << i + 1;
    EXPECT_TRUE(bit_identical(y.masters[r], x.masters[r]));
  }
}

// Note [Exporting LoRA adapters] through the gathered export (stage 3 across ranks, each rank sending
// its part of the adapters): PEFT's adapter directory, the same bytes as the replicated stage 2
// run's export in the same dtype.
TEST(Lora, TwoRanksAtStage3ExportThePeftAdapterStage2Exports) {
  const nlohmann::json lora = {{"r", 4}, {"target_modules", {"q_proj", "up_proj"}}};
  TempDir out;
  for (const int stage : {3, 2}) {
    SCOPED_TRACE("stage " + std::to_string(stage));
    RunSetup setup{.stage = stage, .optimizer = "cpu", .grad_accum = 1, .lora = lora};
    TempDir own[2];
    const std::string dir = out.path + "/stage" + std::to_string(stage);
    const std::array<Status, 2> ranks =
        run_two_ranks([&](uint32_t r) { return make_options(setup, own[r]); },
                      [&](uint32_t r, Trainer& t, const TrainOptions&) -> Status {
                        for (int i = 0; i < 2; ++i) ZO_RETURN_IF_ERROR(t.step().status());
                        if (r != 0 && !t.export_needs_every_rank()) return Status::ok();
                        ExportOptions eo;
                        eo.dtype = DType::kBF16;  // the compute dtype: what a stage 3 rank holds
                        eo.out_dir = dir;
                        return t.export_model(eo).status();
                      });
    for (uint32_t r = 0; r < 2; ++r) ASSERT_TRUE(ranks[r].is_ok()) << "rank " << r << ": " << ranks[r].to_string();
    const nlohmann::json config = nlohmann::json::parse(file_bytes(dir + "/adapter_config.json"));
    EXPECT_EQ(config["peft_type"], "LORA");
    EXPECT_EQ(config["r"], 4);
    EXPECT_EQ(config["target_modules"], nlohmann::json({"q_proj", "up_proj"}));
    auto f = SafetensorsFile::open(dir + "/adapter_model.safetensors", io::Env::posix());
    ASSERT_TRUE(f.is_ok()) << f.status().to_string();
    EXPECT_EQ((*f)->tensors().size(), 2 * 2 * small_model().num_hidden_layers);
    for (const SafetensorsTensor& t : (*f)->tensors()) EXPECT_TRUE(t.name.starts_with(kPeftPrefix)) << t.name;
    EXPECT_FALSE(std::filesystem::exists(dir + "/model.safetensors"));
  }
  EXPECT_EQ(file_bytes(out.path + "/stage3/adapter_model.safetensors"),
            file_bytes(out.path + "/stage2/adapter_model.safetensors"));
}

TEST(Resume, LoraRunsResumeBitExactlyAndOnlyWithTheirAdapters) {
  constexpr int kN = 2, kM = 2;
  const nlohmann::json lora = {{"r", 2}, {"target_modules", {"q_proj", "down_proj"}}, {"use_rslora", true}};
  RunSetup first{.param = "nvme", .optimizer = "nvme", .max_in_cpu = 0, .precision = "fp32", .lora = lora};
  RunSetup resumed{.param = "cpu", .optimizer = "cpu", .precision = "fp32", .lora = lora};
  TempDir a_dir, b_dir;
  auto ta = Trainer::create(with_checkpoints(make_options(first, a_dir), a_dir.path + "/ckpt"));
  ASSERT_TRUE(ta.is_ok()) << ta.status().to_string();
  auto am = steps_saving_after(**ta, kN + kM, kN);
  ASSERT_TRUE(am.is_ok()) << am.status().to_string();
  const std::string ckpt = a_dir.path + "/ckpt/step-" + std::to_string(kN);
  TrainOptions b = make_options(resumed, b_dir);
  b.resume = ckpt;
  auto tb = Trainer::create(b);
  ASSERT_TRUE(tb.is_ok()) << tb.status().to_string();
  for (int i = kN; i < kN + kM; ++i) {
    auto m = (*tb)->step();
    ASSERT_TRUE(m.is_ok()) << m.status().to_string();
    EXPECT_EQ(m->loss, (*am)[i].loss) << "step " << i + 1;
  }
  EXPECT_TRUE(bit_identical(masters(**tb), masters(**ta)));
  // No adapters, others, and the same adapters at another scale (no tensor's shape tells the scale).
  nlohmann::json other_alpha = lora, no_rslora = lora;
  other_alpha["lora_alpha"] = 16;
  no_rslora["use_rslora"] = false;
  for (const nlohmann::json& other : {nlohmann::json(), nlohmann::json{{"r", 4}, {"target_modules", {"q_proj"}}},
                                      other_alpha, no_rslora}) {
    SCOPED_TRACE(other.dump());
    TempDir c_dir;
    RunSetup s = resumed;
    s.lora = other;
    TrainOptions c = make_options(s, c_dir);
    c.resume = ckpt;
    auto refused = Trainer::create(c);
    ASSERT_FALSE(refused.is_ok());
    EXPECT_THAT(refused.status().message(), HasSubstr("resume with the checkpoint's zoffload.lora"));
  }
}

// Two ranks save a frozen run together (each its part of every file, frozen.safetensors too) and
// resume it at another stage and placement.
TEST(Resume, FrozenRunsResumeOverTwoRanks) {
  const std::vector<std::string> freeze = {"model.embed_tokens.weight", "model.layers.1.mlp.*"};
  for (const int stage : {3, 2}) {
    SCOPED_TRACE("stage " + std::to_string(stage));
    TempDir shared;
    const std::string dir = shared.path + "/ckpt";
    RunSetup setup{
        .stage = stage, .param = stage == 3 ? "cpu" : "none", .optimizer = "cpu", .grad_accum = 1, .freeze = freeze};
    TempDir own[2], again[2];
    std::vector<StepMetrics> straight[2];
    std::vector<std::vector<float>> final_masters[2];
    const std::array<Status, 2> first =
        run_two_ranks([&](uint32_t r) { return with_checkpoints(make_options(setup, own[r]), dir); },
                      [&](uint32_t r, Trainer& t, const TrainOptions&) -> Status {
                        ZO_ASSIGN_OR_RETURN(straight[r], steps_saving_after(t, 4, 2));
                        final_masters[r] = masters_held(t);
                        return Status::ok();
                      });
    for (uint32_t r = 0; r < 2; ++r) ASSERT_TRUE(first[r].is_ok()) << first[r].to_string();
    RunSetup other = setup;
    other.stage = 3;
    other.param = "nvme";
    other.optimizer = "nvme";
    other.max_in_cpu = 0;
    std::vector<StepMetrics> resumed[2];
    std::vector<std::vector<float>> resumed_masters[2];
    const std::array<Status, 2> second = run_two_ranks(
        [&](uint32_t r) {
          TrainOptions o = make_options(other, again[r]);
          o.resume = dir + "/step-2";
          return o;
        },
        [&](uint32_t r, Trainer& t, const TrainOptions&) -> Status {
          for (int i = 0; i < 2; ++i) {
            auto m = t.step();
            if (!m.is_ok()) return m.status();
            resumed[r].push_back(*m);
          }
          resumed_masters[r] = masters_held(t);
          return Status::ok();
        });
    for (uint32_t r = 0; r < 2; ++r) {
      ASSERT_TRUE(second[r].is_ok()) << second[r].to_string();
      for (int i = 0; i < 2; ++i) EXPECT_EQ(resumed[r][i].loss, straight[r][i + 2].loss) << "step " << i + 3;
      uint32_t compared = 0;
      for (size_t p = 0; p < final_masters[r].size(); ++p) {
        if (final_masters[r][p].empty() || resumed_masters[r][p].empty()) continue;
        EXPECT_EQ(resumed_masters[r][p], final_masters[r][p]) << "param " << p << ", rank " << r;
        ++compared;
      }
      EXPECT_GT(compared, 3u);
    }
  }
}

}  // namespace

}  // namespace zo::engine

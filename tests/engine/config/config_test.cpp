#include "engine/config/config.h"
#include "engine/config/io_settings.h"

#include <sys/stat.h>
#include <unistd.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <tuple>
#include <nlohmann/json.hpp>

namespace zo::engine {
namespace {

using nlohmann::json;
using ::testing::HasSubstr;
using ::testing::Not;

// A minimal valid config; tests patch it.
json base() { return json{{"train_micro_batch_size_per_gpu", 2}}; }

std::optional<Config> parse(const json& j, ConfigDiagnostics* diag, const ResolveContext& ctx = {}) {
  return parse_config(std::string_view(j.dump()), ctx, diag);
}

std::string all(const std::vector<ConfigIssue>& issues) {
  std::string s;
  for (const auto& i : issues) s += i.to_string() + "\n";
  return s;
}

TEST(ConfigParse, EmptyishConfigGetsDeepSpeedDefaults) {
  ConfigDiagnostics d;
  auto c = parse(base(), &d);
  ASSERT_TRUE(c) << all(d.errors);
  EXPECT_TRUE(d.warnings.empty()) << all(d.warnings);
  EXPECT_EQ(c->zero.stage, 0);
  EXPECT_EQ(c->zero.reduce_bucket_size, 500'000'000u);
  EXPECT_EQ(c->zero.sub_group_size, 1'000'000'000u);
  EXPECT_EQ(c->zero.stage3_prefetch_bucket_size, 50'000'000u);
  EXPECT_EQ(c->zero.stage3_param_persistence_threshold, 100'000u);
  EXPECT_EQ(c->zero.offload_param.buffer_count, 5u);
  EXPECT_EQ(c->zero.offload_param.buffer_size, 100'000'000u);
  EXPECT_EQ(c->zero.offload_optimizer.buffer_count, 4u);
  EXPECT_EQ(c->aio.block_size, 1048576u);
  EXPECT_EQ(c->aio.queue_depth, 8u);
  EXPECT_EQ(c->aio.intra_op_parallelism, 1u);
  EXPECT_TRUE(c->aio.overlap_events);
  EXPECT_EQ(c->fp16.initial_scale_power, 16);
  EXPECT_EQ(c->fp16.loss_scale_window, 1000u);
  EXPECT_EQ(c->fp16.hysteresis, 2u);
  EXPECT_DOUBLE_EQ(c->fp16.min_loss_scale, 1.0);
  EXPECT_TRUE(c->bf16.check_grad_overflow);
  EXPECT_DOUBLE_EQ(c->gradient_clipping, 1.0);
  EXPECT_EQ(c->gradient_accumulation_steps, 1u);
  EXPECT_EQ(c->train_batch_size, 2u);
  EXPECT_EQ(c->optimizer.type, OptimizerType::kAdamW);
  EXPECT_DOUBLE_EQ(c->optimizer.lr, 1e-3);
  EXPECT_EQ(c->compute_dtype(), DType::kF32);
  EXPECT_EQ(c->grad_accum_dtype, DType::kF32);
}

TEST(ConfigParse, NumbersAsStringsAndScientific) {
  json j = base();
  j["zero_optimization"] = {
      {"stage", "3"}, {"sub_group_size", "5e8"}, {"reduce_bucket_size", 2e8}, {"stage3_max_live_parameters", "1000"}};
  j["optimizer"] = {{"type", "AdamW"}, {"params", {{"lr", 3e-4}, {"betas", {0.9, 0.95}}}}};
  ConfigDiagnostics d;
  auto c = parse(j, &d);
  ASSERT_TRUE(c) << all(d.errors);
  EXPECT_EQ(c->zero.stage, 3);
  EXPECT_EQ(c->zero.sub_group_size, 500'000'000u);
  EXPECT_EQ(c->zero.reduce_bucket_size, 200'000'000u);
  EXPECT_EQ(c->zero.stage3_max_live_parameters, 1000u);
  EXPECT_DOUBLE_EQ(c->optimizer.lr, 3e-4);
  EXPECT_DOUBLE_EQ(c->optimizer.betas[1], 0.95);
}

// Issue 40: "lr": "0.001" was read as 0.001 although a wrong type is an error. Counts and integers
// still read numeric strings, as DeepSpeed's configs write sizes; real numbers do not.
TEST(ConfigParse, RealNumbersAreNotReadFromStrings) {
  json j = base();
  j["zero_optimization"] = {{"sub_group_size", "5e8"}};
  j["optimizer"] = {{"type", "AdamW"}, {"params", {{"lr", "0.001"}, {"betas", {"0.9", 0.95}}}}};
  j["gradient_clipping"] = "1.0";
  ConfigDiagnostics d;
  EXPECT_FALSE(parse(j, &d));
  ASSERT_EQ(d.errors.size(), 3u) << all(d.errors);
  EXPECT_EQ(all(d.errors),
            "gradient_clipping: expected a number, got \"1.0\" (a string; write the number without quotes)\n"
            "optimizer.params.lr: expected a number, got \"0.001\" (a string; write the number without quotes)\n"
            "optimizer.params.betas[0]: expected a number, got \"0.9\" (a string; write the number without quotes)\n");

  j["optimizer"]["params"] = {{"lr", 0.001}, {"betas", {0.9, 0.95}}};
  j.erase("gradient_clipping");
  ConfigDiagnostics ok;
  auto c = parse(j, &ok);
  ASSERT_TRUE(c) << all(ok.errors);
  EXPECT_EQ(c->zero.sub_group_size, 500'000'000u);
}

// Issue 40: a non-zero literal that underflows read as 0 (1e-400 was a micro-batch of 0, an lr of
// 0) or as a denormal. The text is parsed raw here: nlohmann::json would make 1e-400 a 0 itself.
TEST(ConfigParse, NumbersThatUnderflowAreRefusedAtTheirKey) {
  ConfigDiagnostics d;
  EXPECT_FALSE(parse_config(std::string_view(R"({"train_micro_batch_size_per_gpu": 1e-400})"), {}, &d));
  ASSERT_EQ(d.errors.size(), 1u) << all(d.errors);
  EXPECT_EQ(d.errors[0].to_string(),
            "train_micro_batch_size_per_gpu: 1e-400 is not representable (it underflows to 0)");

  // Brackets, commas and quotes inside a string do not move the key path; zeros written with a
  // small exponent are zeros. 2.2250738585072014e-308 is DBL_MIN, the smallest normal double.
  ConfigDiagnostics f;
  EXPECT_FALSE(parse_config(std::string_view(R"({"train_micro_batch_size_per_gpu": 1,
    "zoffload": {"checkpoint": {"dir": "c,{[\"k\": 1e-400"}},
    "optimizer": {"type": "AdamW", "params": {"weight_decay": 0e-400, "eps": 0.000, "lr": 1e-400,
                                               "betas": [0.9, 1e-310]}}})"),
                            {}, &f));
  EXPECT_EQ(all(f.errors),
            "optimizer.params.lr: 1e-400 is not representable (it underflows to 0)\n"
            "optimizer.params.betas[1]: 1e-310 is not representable (it underflows to a denormal, below "
            "2.2250738585072014e-308)\n");

  // A count written as a string underflows too.
  json j = base();
  j["zero_optimization"] = {{"stage3_max_live_parameters", "1e-400"}};
  ConfigDiagnostics s;
  EXPECT_FALSE(parse(j, &s));
  ASSERT_EQ(s.errors.size(), 1u) << all(s.errors);
  EXPECT_EQ(s.errors[0].to_string(),
            "zero_optimization.stage3_max_live_parameters: \"1e-400\" is not representable (it underflows to 0)");
}

// `depth` objects nested in one another: {"a":{"a":...{}...}}.
std::string nested_objects(int depth) {
  std::string text;
  for (int i = 1; i < depth; ++i) text += "{\"a\":";
  text += "{}";
  text += std::string(static_cast<size_t>(depth - 1), '}');
  return text;
}

// Issue 40: a 1.2 MB config nested 100 000 deep took 10 GB and 22 s in the parse (the duplicate-key
// check kept each open object's path). Nesting is capped at 64 levels, checked before the parse.
TEST(ConfigParse, NestingDeeperThanTheCapIsRefusedBeforeTheParse) {
  // The 65th opening bracket is refused: at byte 64 · 5 of the objects ({"a": is 5 bytes), byte 64
  // of the arrays, so columns 321 and 65.
  const std::pair<std::string, std::string> deep[] = {
      {nested_objects(100'000), "invalid JSON (line 1, column 321): nested deeper than 64 levels"},
      {std::string(100'000, '[') + std::string(100'000, ']'),
       "invalid JSON (line 1, column 65): nested deeper than 64 levels"},
      {nested_objects(65), "invalid JSON (line 1, column 321): nested deeper than 64 levels"},
  };
  for (const auto& [text, error] : deep) {
    ConfigDiagnostics d;
    EXPECT_FALSE(parse_config(text, {}, &d));
    ASSERT_EQ(d.errors.size(), 1u) << all(d.errors).substr(0, 1000);
    EXPECT_EQ(d.errors[0].to_string(), error);
    EXPECT_LT(d.errors[0].to_string().size(), 300u);
  }
  // At the cap: parsed, and refused only for its unknown key. Brackets and escaped quotes inside a
  // string are no nesting.
  const std::string at_cap[] = {
      nested_objects(64),
      "{\"a\": \"" + std::string(100'000, '[') + "\\\"" + std::string(100'000, '{') + "\"}",
  };
  for (const std::string& text : at_cap) {
    ConfigDiagnostics d;
    EXPECT_FALSE(parse_config(text, {}, &d));
    ASSERT_EQ(d.errors.size(), 2u) << all(d.errors).substr(0, 1000);
    EXPECT_EQ(d.errors[0].path, "a");
    EXPECT_THAT(d.errors[0].message, ::testing::StartsWith("unknown key"));
    EXPECT_EQ(d.errors[1].path, "train_micro_batch_size_per_gpu");
  }
}

// Integers set from C++ are signed in nlohmann::json (parsed text gives unsigned): both count.
TEST(ConfigParse, SignedIntegersFromCodeAreCountsAndSizes) {
  json j = base();
  j["zero_optimization"] = {{"stage", 3}, {"sub_group_size", int64_t{16384}}};
  j["zoffload"] = {{"gpu_memory_limit", int64_t{1} << 20}};
  ConfigDiagnostics d;
  auto c = parse(j, &d);
  ASSERT_TRUE(c) << all(d.errors);
  EXPECT_EQ(c->zero.sub_group_size, 16384u);
  EXPECT_EQ(c->zoffload.gpu_memory_limit, uint64_t{1} << 20);

  j["zero_optimization"]["sub_group_size"] = int64_t{-5};
  ConfigDiagnostics bad;
  EXPECT_FALSE(parse(j, &bad));
  ASSERT_EQ(bad.errors.size(), 1u);
  EXPECT_EQ(bad.errors[0].path, "zero_optimization.sub_group_size");
}

TEST(ConfigParse, AutoResolvesFromHiddenSizeAsAccelerateDoes) {
  json j = base();
  j["zero_optimization"] = {{"stage", 3},
                            {"reduce_bucket_size", "auto"},
                            {"stage3_prefetch_bucket_size", "auto"},
                            {"stage3_param_persistence_threshold", "auto"}};
  ResolveContext ctx;
  ctx.hidden_size = 4096;
  ConfigDiagnostics d;
  auto c = parse(j, &d, ctx);
  ASSERT_TRUE(c) << all(d.errors);
  EXPECT_EQ(c->zero.reduce_bucket_size, 4096u * 4096u);
  EXPECT_EQ(c->zero.stage3_prefetch_bucket_size, 15099494u);  // 0.9 · 4096²
  EXPECT_EQ(c->zero.stage3_param_persistence_threshold, 40960u);
}

TEST(ConfigParse, UnresolvableAutoNamesTheValueNeeded) {
  json j = base();
  j["zero_optimization"] = {{"stage", 3}, {"stage3_prefetch_bucket_size", "auto"}};
  j["train_micro_batch_size_per_gpu"] = "auto";
  j["scheduler"] = {{"type", "WarmupDecayLR"}, {"params", {{"total_num_steps", "auto"}}}};
  ConfigDiagnostics d;
  EXPECT_FALSE(parse(j, &d));
  ASSERT_EQ(d.errors.size(), 3u) << all(d.errors);
  EXPECT_EQ(d.errors[0].path, "zero_optimization.stage3_prefetch_bucket_size");
  EXPECT_THAT(d.errors[0].message, HasSubstr("--hidden-size"));
  EXPECT_THAT(
      all(d.errors),
      HasSubstr("scheduler.params.total_num_steps: \"auto\" needs the number of training steps (pass --steps N)"));
  EXPECT_THAT(all(d.errors), HasSubstr("train_micro_batch_size_per_gpu: \"auto\" needs the per-GPU micro-batch size"));
}

TEST(ConfigParse, BatchAutoAndOptimizerAutoFromCommandLine) {
  json j = {
      {"train_batch_size", "auto"},
      {"train_micro_batch_size_per_gpu", "auto"},
      {"gradient_accumulation_steps", "auto"},
      {"gradient_clipping", "auto"},
      {"bf16", {{"enabled", "auto"}}},
      {"fp16", {{"enabled", "auto"}}},
      {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", "auto"}, {"weight_decay", "auto"}, {"betas", "auto"}}}}},
      {"scheduler",
       {{"type", "WarmupDecayLR"},
        {"params",
         {{"warmup_min_lr", "auto"},
          {"warmup_max_lr", "auto"},
          {"warmup_num_steps", "auto"},
          {"total_num_steps", "auto"}}}}}};
  ResolveContext ctx;
  ctx.micro_batch_size = 4;
  ctx.gradient_accumulation_steps = 3;
  ctx.world_size = 2;
  ctx.lr = 5e-5;
  ctx.weight_decay = 0.1;
  ctx.total_steps = 1000;
  ctx.warmup_steps = 50;
  ctx.mixed_precision = DType::kBF16;
  ConfigDiagnostics d;
  auto c = parse(j, &d, ctx);
  ASSERT_TRUE(c) << all(d.errors);
  EXPECT_EQ(c->train_micro_batch_size_per_gpu, 4u);
  EXPECT_EQ(c->gradient_accumulation_steps, 3u);
  EXPECT_EQ(c->train_batch_size, 24u);
  EXPECT_DOUBLE_EQ(c->gradient_clipping, 1.0);
  EXPECT_TRUE(c->bf16.enabled);
  EXPECT_FALSE(c->fp16.enabled);
  EXPECT_DOUBLE_EQ(c->optimizer.lr, 5e-5);
  EXPECT_DOUBLE_EQ(c->optimizer.weight_decay, 0.1);
  EXPECT_DOUBLE_EQ(c->optimizer.betas[0], 0.9);
  EXPECT_DOUBLE_EQ(c->scheduler.warmup_max_lr, 5e-5);
  EXPECT_DOUBLE_EQ(c->scheduler.warmup_min_lr, 0.0);
  EXPECT_EQ(c->scheduler.warmup_num_steps, 50u);
  EXPECT_EQ(c->scheduler.total_num_steps, 1000u);
}

// Note [Flags fill the config]: a flag fills an "auto" or absent key; a different explicit value
// is an error naming the key, the config's value and the flag, never silently outvoted.
TEST(ConfigParse, FlagsFillAbsentKeysAndRefuseDisagreeingOnes) {
  ResolveContext ctx;
  ctx.micro_batch_size = 3;
  ctx.gradient_accumulation_steps = 2;
  ctx.lr = 2e-5;
  ctx.weight_decay = 0.05;
  ctx.max_grad_norm = 0.5;
  ctx.warmup_steps = 7;
  ctx.mixed_precision = DType::kBF16;
  ConfigDiagnostics d;
  auto c = parse(json{{"optimizer", {{"type", "AdamW"}}}, {"scheduler", {{"type", "WarmupLR"}}}}, &d, ctx);
  ASSERT_TRUE(c) << all(d.errors);
  EXPECT_EQ(c->train_micro_batch_size_per_gpu, 3u);
  EXPECT_EQ(c->gradient_accumulation_steps, 2u);
  EXPECT_DOUBLE_EQ(c->optimizer.lr, 2e-5);
  EXPECT_DOUBLE_EQ(c->optimizer.weight_decay, 0.05);
  EXPECT_DOUBLE_EQ(c->gradient_clipping, 0.5);
  EXPECT_EQ(c->scheduler.warmup_num_steps, 7u);
  EXPECT_TRUE(c->bf16.enabled);

  // The same values written in the config agree with the flags.
  d = {};
  c = parse(json{{"train_micro_batch_size_per_gpu", 3},
                 {"gradient_accumulation_steps", 2},
                 {"gradient_clipping", 0.5},
                 {"bf16", {{"enabled", true}}},
                 {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 2e-5}, {"weight_decay", 0.05}}}}},
                 {"scheduler", {{"type", "WarmupLR"}, {"params", {{"warmup_num_steps", 7}, {"warmup_max_lr", 2e-5}}}}}},
            &d, ctx);
  EXPECT_TRUE(c) << all(d.errors);

  // Every disagreeing key is reported, each naming the flag.
  d = {};
  c = parse(
      json{{"train_micro_batch_size_per_gpu", 4},
           {"gradient_accumulation_steps", 1},
           {"gradient_clipping", 1.0},
           {"fp16", {{"enabled", true}}},
           {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 1e-4}, {"weight_decay", 0.0}}}}},
           {"scheduler", {{"type", "WarmupLR"}, {"params", {{"warmup_num_steps", 100}, {"warmup_max_lr", 1e-4}}}}}},
      &d, ctx);
  EXPECT_FALSE(c);
  const std::string errors = all(d.errors);
  EXPECT_THAT(errors, HasSubstr("train_micro_batch_size_per_gpu: 4 in the config disagrees with --micro-batch 3"));
  EXPECT_THAT(errors, HasSubstr("gradient_accumulation_steps: 1 in the config disagrees with --grad-accum 2"));
  EXPECT_THAT(errors, HasSubstr("optimizer.params.lr: 1e-04 in the config disagrees with --lr 2e-05"));
  EXPECT_THAT(errors, HasSubstr("optimizer.params.weight_decay: 0 in the config disagrees with --weight-decay 0.05"));
  EXPECT_THAT(errors, HasSubstr("gradient_clipping: 1 in the config disagrees with --max-grad-norm 0.5"));
  EXPECT_THAT(errors,
              HasSubstr("scheduler.params.warmup_num_steps: 100 in the config disagrees with --warmup-steps 7"));
  EXPECT_THAT(errors, HasSubstr("scheduler.params.warmup_max_lr: 1e-04 in the config disagrees with --lr 2e-05"));
  EXPECT_THAT(errors, HasSubstr("fp16.enabled: true in the config disagrees with --precision bf16"));
  EXPECT_EQ(d.errors.size(), 8u) << errors;

  // --warmup-steps without a scheduler has nothing to set.
  d = {};
  ResolveContext warm;
  warm.warmup_steps = 10;
  EXPECT_FALSE(parse(base(), &d, warm));
  EXPECT_THAT(all(d.errors), HasSubstr("scheduler: --warmup-steps needs a scheduler"));
}

TEST(ConfigParse, DerivesMissingBatchValueAsDeepSpeedDoes) {
  ConfigDiagnostics d;
  auto c = parse(json{{"train_batch_size", 32}, {"train_micro_batch_size_per_gpu", 4}}, &d);
  ASSERT_TRUE(c) << all(d.errors);
  EXPECT_EQ(c->gradient_accumulation_steps, 8u);
  c = parse(json{{"train_batch_size", 32}, {"gradient_accumulation_steps", 4}}, &d);
  ASSERT_TRUE(c) << all(d.errors);
  EXPECT_EQ(c->train_micro_batch_size_per_gpu, 8u);
}

// PEFT's LoraConfig takes target_modules as one string ("all-linear") as well as a list; every
// list key reads a bare string as a list of one.
TEST(ConfigParse, ListKeysTakeOneStringAsAListOfOne) {
  ConfigDiagnostics d;
  auto c =
      parse(json{{"train_micro_batch_size_per_gpu", 1},
                 {"zoffload",
                  {{"lora", {{"r", 8}, {"target_modules", "all-linear"}}}, {"freeze", "model.embed_tokens.weight"}}}},
            &d);
  ASSERT_TRUE(c) << all(d.errors);
  EXPECT_EQ(c->zoffload.lora.target_modules, std::vector<std::string>{"all-linear"});
  EXPECT_EQ(c->zoffload.freeze, std::vector<std::string>{"model.embed_tokens.weight"});
  c = parse(
      json{{"train_micro_batch_size_per_gpu", 1}, {"zoffload", {{"lora", {{"r", 8}, {"target_modules", "q_proj"}}}}}},
      &d);
  ASSERT_TRUE(c) << all(d.errors);
  EXPECT_EQ(c->zoffload.lora.target_modules, std::vector<std::string>{"q_proj"});
}

// DeepSpeed warns, not fails, when a run is shorter than its warm-up: a smoke test of a long config.
TEST(ConfigParse, RunShorterThanItsWarmupIsAWarning) {
  json j = base();
  j["scheduler"] = {{"type", "WarmupDecayLR"}, {"params", {{"warmup_num_steps", 100}, {"total_num_steps", 10}}}};
  ConfigDiagnostics d;
  ASSERT_TRUE(parse(j, &d)) << all(d.errors);
  EXPECT_THAT(
      all(d.warnings),
      HasSubstr("scheduler.params.total_num_steps: 10 steps end inside the warm-up of max(2, warmup_num_steps) = 100"));
  // The warm-up lasts N = max(2, warmup_num_steps) steps. The log ramp peaks at its last step
  // (t = N − 1), the linear one only after it.
  for (auto [type, total, warns] : {std::tuple{"linear", 2, true}, std::tuple{"linear", 3, false},
                                    std::tuple{"log", 1, true}, std::tuple{"log", 2, false}}) {
    SCOPED_TRACE(std::string(type) + " " + std::to_string(total));
    j["scheduler"]["params"] = {{"warmup_num_steps", 1}, {"total_num_steps", total}, {"warmup_type", type}};
    d = {};
    ASSERT_TRUE(parse(j, &d)) << all(d.errors);
    EXPECT_EQ(all(d.warnings).find("the lr never reaches its peak") != std::string::npos, warns) << all(d.warnings);
  }
}

// --steps says where the run stops. With an explicit schedule length, stopping earlier is a short
// run; going past it is a warning, since those steps all take the schedule's final lr.
TEST(ConfigParse, StepsPastAnExplicitScheduleWarn) {
  json j = base();
  j["scheduler"] = {{"type", "WarmupCosineLR"}, {"params", {{"warmup_num_steps", 5}, {"total_num_steps", 80}}}};
  ResolveContext ctx;
  ctx.total_steps = 20;
  ConfigDiagnostics d;
  auto c = parse(j, &d, ctx);
  ASSERT_TRUE(c) << all(d.errors);
  EXPECT_EQ(c->scheduler.total_num_steps, 80u);
  EXPECT_TRUE(d.warnings.empty()) << all(d.warnings);
  ctx.total_steps = 200;
  d = {};
  ASSERT_TRUE(parse(j, &d, ctx)) << all(d.errors);
  EXPECT_THAT(all(d.warnings),
              HasSubstr("scheduler.params.total_num_steps: 80 is less than --steps 200: steps 81 to 200"));
}

// The deprecated "bfloat16" block is the file's bf16 setting too: --precision may not outvote it.
TEST(ConfigParse, PrecisionFlagDisagreesWithTheBfloat16Alias) {
  json j = base();
  j["bfloat16"] = {{"enabled", true}};
  ResolveContext ctx;
  ctx.mixed_precision = DType::kF32;
  ConfigDiagnostics d;
  EXPECT_FALSE(parse(j, &d, ctx));
  EXPECT_THAT(all(d.errors), HasSubstr("bf16.enabled: true in the config disagrees with --precision fp32"));
}

// One source of truth for what trains: an optimizer config check accepts trains on that placement.
// Adagrad and Lion step on the CPU only; Adagrad's accumulator starts at zero.
TEST(ConfigParse, AdagradAndLionNeedTheOptimizerOnCpuOrNvme) {
  for (const char* type : {"Adagrad", "Lion"}) {
    SCOPED_TRACE(type);
    json j = base();
    j["optimizer"] = {{"type", type}};
    j["zero_optimization"] = {{"stage", 2}};
    ConfigDiagnostics d;
    EXPECT_FALSE(parse(j, &d));
    EXPECT_THAT(all(d.errors), HasSubstr("optimizer.type: " + std::string(type) + " steps on the CPU only"));
    EXPECT_THAT(all(d.errors), HasSubstr("offload_optimizer.device to \"cpu\" or \"nvme\""));
    j["zero_optimization"]["offload_optimizer"] = {{"device", "cpu"}};
    d = {};
    EXPECT_TRUE(parse(j, &d)) << all(d.errors);
  }
  json j = base();
  j["optimizer"] = {{"type", "Adagrad"}, {"params", {{"initial_accumulator_value", 0.1}}}};
  j["zero_optimization"] = {{"stage", 2}, {"offload_optimizer", {{"device", "cpu"}}}};
  ConfigDiagnostics d;
  EXPECT_FALSE(parse(j, &d));
  EXPECT_THAT(all(d.errors), HasSubstr("optimizer.params.initial_accumulator_value: only 0 is supported"));
}

TEST(ConfigParse, DeprecatedAliasesWarnAndNameTheNewKey) {
  json j = base();
  j["aio"] = {{"thread_count", 4}};
  j["zero_optimization"] = {{"stage", 3}, {"stage3_gather_fp16_weights_on_model_save", true}, {"cpu_offload", true}};
  j["bfloat16"] = {{"enabled", true}};
  ConfigDiagnostics d;
  auto c = parse(j, &d);
  ASSERT_TRUE(c) << all(d.errors);
  EXPECT_EQ(c->aio.intra_op_parallelism, 4u);
  EXPECT_TRUE(c->zero.stage3_gather_16bit_weights_on_model_save);
  EXPECT_EQ(c->zero.offload_optimizer.device, OffloadDevice::kCpu);
  EXPECT_TRUE(c->bf16.enabled);
  const std::string w = all(d.warnings);
  EXPECT_THAT(w, HasSubstr("aio.thread_count: deprecated name; read as aio.intra_op_parallelism"));
  EXPECT_THAT(w, HasSubstr("zero_optimization.stage3_gather_fp16_weights_on_model_save: deprecated name; read as "
                           "zero_optimization.stage3_gather_16bit_weights_on_model_save"));
  EXPECT_THAT(w, HasSubstr("bfloat16: deprecated name; read as bf16"));
  EXPECT_THAT(w, HasSubstr("zero_optimization.cpu_offload: deprecated; read as offload_optimizer.device = \"cpu\""));
}

// The read-ahead and write-behind of sub-groups are NVMe's: on another device they warn at the key
// that asked for them (the legacy "pipeline" too), and on "nvme" they are silent.
TEST(ConfigParse, PipelineFlagsOffNvmeWarnAtTheirKey) {
  struct Case {
    json offload;
    const char* warned;  // nullptr: no warning
  };
  const Case cases[] = {
      {{{"device", "cpu"}, {"pipeline_write", true}}, "zero_optimization.offload_optimizer.pipeline_write"},
      {{{"device", "cpu"}, {"pipeline_read", true}, {"pipeline_write", true}},
       "zero_optimization.offload_optimizer.pipeline_read"},
      {{{"device", "cpu"}, {"pipeline", true}}, "zero_optimization.offload_optimizer.pipeline"},
      {{{"device", "cpu"}, {"pipeline_read", false}}, nullptr},
      {{{"device", "nvme"}, {"nvme_path", "/nvme"}, {"pipeline_read", true}}, nullptr},
  };
  for (const Case& k : cases) {
    json j = base();
    j["zero_optimization"] = {{"stage", 3}, {"offload_optimizer", k.offload}};
    ConfigDiagnostics d;
    ASSERT_TRUE(parse(j, &d)) << all(d.errors);
    const std::string w = all(d.warnings);
    if (k.warned == nullptr) EXPECT_THAT(w, Not(HasSubstr("has no effect: the read-ahead"))) << k.offload.dump();
    else EXPECT_THAT(w, HasSubstr(std::string(k.warned) + ": has no effect: the read-ahead")) << k.offload.dump();
  }
}

// DeepSpeed keys nothing in zoffload reads are accepted with a warning that says so, each once;
// a value of the wrong type is still an error, not a warning about a key that changes nothing.
TEST(ConfigParse, KeysWithNoEffectWarnAndStillCheckTheirType) {
  json j = base();
  j["zero_optimization"] = {{"stage", 3},
                            {"overlap_comm", true},
                            {"contiguous_gradients", false},
                            {"reduce_scatter", true},
                            {"allgather_partitions", true},
                            {"round_robin_gradients", false},
                            {"model_persistence_threshold", "1e6"},
                            {"offload_optimizer", {{"device", "cpu"}, {"fast_init", true}}}};
  ConfigDiagnostics d;
  ASSERT_TRUE(parse(j, &d)) << all(d.errors);
  const char* keys[] = {"zero_optimization.overlap_comm",
                        "zero_optimization.contiguous_gradients",
                        "zero_optimization.reduce_scatter",
                        "zero_optimization.allgather_partitions",
                        "zero_optimization.round_robin_gradients",
                        "zero_optimization.stage3_model_persistence_threshold",
                        "zero_optimization.offload_optimizer.fast_init"};
  for (const char* key : keys) {
    int n = 0;
    for (const ConfigIssue& w : d.warnings)
      if (w.path == key && w.message.find("accepted but has no effect in zoffload: ") == 0) ++n;
    EXPECT_EQ(n, 1) << key << ": " << all(d.warnings);
  }
  EXPECT_EQ(d.warnings.size(), std::size(keys)) << all(d.warnings);

  for (const auto& [key, bad] : {std::pair<const char*, json>{"overlap_comm", "yes"},
                                 {"round_robin_gradients", 1},
                                 {"stage3_model_persistence_threshold", -5}}) {
    json k = base();
    k["zero_optimization"] = {{"stage", 3}, {key, bad}};
    ConfigDiagnostics e;
    EXPECT_FALSE(parse(k, &e)) << key;
    ASSERT_EQ(e.errors.size(), 1u) << key << ": " << all(e.errors);
    EXPECT_EQ(e.errors[0].path, std::string("zero_optimization.") + key);
    EXPECT_TRUE(e.warnings.empty()) << all(e.warnings);
  }
}

TEST(ConfigParse, ReportsEveryErrorOfAFileAtOnce) {
  json j = base();
  j["zero_optimization"] = {{"stage", 7}, {"sub_grup_size", 5}, {"overlap_comm", "yes"}};
  j["aio"] = {{"queue_depth", 0}};
  j["gradient_clipping"] = -1;
  ConfigDiagnostics d;
  EXPECT_FALSE(parse(j, &d));
  EXPECT_EQ(d.errors.size(), 5u) << all(d.errors);
}

TEST(ConfigParse, AnInvalidValueIsReportedOnceNotEchoedByRulesThatUseIt) {
  const json cases[] = {
      {{"train_micro_batch_size_per_gpu", 0}, {"train_batch_size", 8}},
      {{"train_micro_batch_size_per_gpu", 1},
       {"zero_optimization", {{"stage", 3}, {"offload_param", {{"device", "nvme"}, {"nvme_path", 5}}}}}},
      {{"train_micro_batch_size_per_gpu", 1},
       {"zero_optimization", {{"stage", 9}, {"offload_param", {{"device", "cpu"}}}}}},
  };
  for (const json& j : cases) {
    ConfigDiagnostics d;
    EXPECT_FALSE(parse(j, &d));
    EXPECT_EQ(d.errors.size(), 1u) << j.dump() << "\n" << all(d.errors);
  }
}

TEST(ConfigParse, UnknownKeySuggestsClosest) {
  json j = base();
  j["zero_optimization"] = {{"stage", 3}, {"stage3_prefetch_bucket_sise", 5}};
  ConfigDiagnostics d;
  EXPECT_FALSE(parse(j, &d));
  ASSERT_EQ(d.errors.size(), 1u) << all(d.errors);
  EXPECT_EQ(
      d.errors[0].to_string(),
      "zero_optimization.stage3_prefetch_bucket_sise: unknown key; did you mean \"stage3_prefetch_bucket_size\"?");
}

TEST(ConfigParse, DuplicateKeysAndSyntaxErrorsAreReportedWithPlace) {
  ConfigDiagnostics d;
  EXPECT_FALSE(parse_config(
      std::string_view(R"({"train_micro_batch_size_per_gpu": 1, "aio": {"queue_depth": 4, "queue_depth": 8}})"), {},
      &d));
  ASSERT_EQ(d.errors.size(), 1u) << all(d.errors);
  EXPECT_EQ(d.errors[0].to_string(), "aio.queue_depth: duplicate key");
  ConfigDiagnostics d2;
  EXPECT_FALSE(parse_config(std::string_view("{\n  \"bf16\": {\"enabled\": true,}\n}"), {}, &d2));
  ASSERT_EQ(d2.errors.size(), 1u);
  EXPECT_THAT(d2.errors[0].message, HasSubstr("invalid JSON (line 2"));
  // Issue 19: a number too long for a double aborted the program (an exception nlohmann does not
  // class as a parse error), and errors quoted the whole 100 KB token; a deep nest is no crash.
  ConfigDiagnostics d3;
  EXPECT_FALSE(parse_config("{\"train_micro_batch_size_per_gpu\": " + std::string(100'000, '7') + "}", {}, &d3));
  ASSERT_EQ(d3.errors.size(), 1u);
  EXPECT_THAT(d3.errors[0].message, HasSubstr("invalid JSON"));
  EXPECT_THAT(d3.errors[0].message, HasSubstr("number overflow"));
  EXPECT_LT(d3.errors[0].message.size(), 300u);
  ConfigDiagnostics d4;
  EXPECT_FALSE(parse_config("{\"bf16\": " + std::string(100'000, '[') + std::string(100'000, ']') + "}", {}, &d4));
  ASSERT_EQ(d4.errors.size(), 1u);
  EXPECT_THAT(d4.errors[0].message, HasSubstr("nested deeper than 64 levels"));
}

// Issue 40: an error line never echoes a megabyte of the user's text; the unknown key's path is an
// excerpt, and no "did you mean" is sought for it (the edit distance costs its length).
TEST(ConfigParse, AHugeUnknownKeyIsNamedByAnExcerpt) {
  json j = base();
  j[std::string(1'000'000, 'k')] = 1;
  ConfigDiagnostics d;
  EXPECT_FALSE(parse(j, &d));
  ASSERT_EQ(d.errors.size(), 1u);
  EXPECT_EQ(d.errors[0].to_string(), std::string(200, 'k') + "... (1000000 bytes): unknown key");
}

TEST(ConfigParse, ResolvedJsonParsesBackToTheSameConfig) {
  json j = base();
  j["zero_optimization"] = {
      {"stage", 3},
      {"offload_param", {{"device", "nvme"}, {"nvme_path", "/nvme"}}},
      {"offload_optimizer", {{"device", "nvme"}, {"nvme_path", "/nvme"}, {"pipeline_read", true}}}};
  j["scheduler"] = {{"type", "WarmupCosineLR"}, {"params", {{"total_num_steps", 100}, {"warmup_num_steps", 10}}}};
  j["zoffload"] = {{"gpu_memory_limit", "24GiB"}, {"checkpoint", {{"dir", "ck"}, {"every_steps", 10}}}};
  ConfigDiagnostics d;
  auto c = parse(j, &d);
  ASSERT_TRUE(c) << all(d.errors);
  const json resolved = to_json(*c);
  ConfigDiagnostics d2;
  auto c2 = parse(resolved, &d2);
  ASSERT_TRUE(c2) << all(d2.errors);
  EXPECT_TRUE(d2.warnings.empty()) << all(d2.warnings);
  EXPECT_EQ(to_json(*c2), resolved);
  EXPECT_EQ(c2->zoffload.gpu_memory_limit, 24ull << 30);
}

// Each malformed config must fail with an error at exactly this key path.
struct Malformed {
  const char* name;
  json patch;  // merged into base()
  const char* path;
  const char* message_part;
};

class MalformedConfig : public ::testing::TestWithParam<Malformed> {};

TEST_P(MalformedConfig, FailsAtTheKeyPath) {
  const Malformed& m = GetParam();
  json j = base();
  j.merge_patch(m.patch);
  ConfigDiagnostics d;
  EXPECT_FALSE(parse(j, &d)) << m.name;
  ASSERT_FALSE(d.errors.empty()) << m.name;
  bool found = false;
  for (const auto& e : d.errors)
    if (e.path == m.path && e.message.find(m.message_part) != std::string::npos) found = true;
  EXPECT_TRUE(found) << m.name << ": expected an error at " << m.path << " containing \"" << m.message_part
                     << "\", got:\n"
                     << all(d.errors);
}

const Malformed kMalformed[] = {
    {"stage4", {{"zero_optimization", {{"stage", 4}}}}, "zero_optimization.stage", "between 0 and 3"},
    {"stage_negative", {{"zero_optimization", {{"stage", -1}}}}, "zero_optimization.stage", "between 0 and 3"},
    {"stage_string", {{"zero_optimization", {{"stage", "three"}}}}, "zero_optimization.stage", "expected an integer"},
    {"stage_auto", {{"zero_optimization", {{"stage", "auto"}}}}, "zero_optimization.stage", "\"auto\" is not accepted"},
    {"zero_not_object", {{"zero_optimization", 3}}, "zero_optimization", "expected an object"},
    {"unknown_top", {{"zero_optimisation", {{"stage", 1}}}}, "zero_optimisation", "did you mean \"zero_optimization\""},
    {"unknown_nested",
     {{"zero_optimization", {{"offload_param", {{"devise", "cpu"}}}}}},
     "zero_optimization.offload_param.devise",
     "did you mean \"device\""},
    {"param_offload_stage2",
     {{"zero_optimization", {{"stage", 2}, {"offload_param", {{"device", "cpu"}}}}}},
     "zero_optimization.offload_param.device",
     "needs stage 3"},
    {"optimizer_offload_stage0",
     {{"zero_optimization", {{"stage", 0}, {"offload_optimizer", {{"device", "cpu"}}}}}},
     "zero_optimization.offload_optimizer.device",
     "needs stage 1, 2 or 3"},
    {"nvme_param_without_path",
     {{"zero_optimization", {{"stage", 3}, {"offload_param", {{"device", "nvme"}}}}}},
     "zero_optimization.offload_param.nvme_path",
     "needed"},
    {"nvme_optimizer_without_path",
     {{"zero_optimization", {{"stage", 3}, {"offload_optimizer", {{"device", "nvme"}}}}}},
     "zero_optimization.offload_optimizer.nvme_path",
     "needed"},
    {"bad_device",
     {{"zero_optimization", {{"stage", 3}, {"offload_param", {{"device", "gpu"}}}}}},
     "zero_optimization.offload_param.device",
     "one of none, cpu, nvme"},
    {"device_typo",
     {{"zero_optimization", {{"stage", 3}, {"offload_optimizer", {{"device", "nvm"}}}}}},
     "zero_optimization.offload_optimizer.device",
     "did you mean \"nvme\""},
    {"negative_sub_group",
     {{"zero_optimization", {{"sub_group_size", -5}}}},
     "zero_optimization.sub_group_size",
     "must be ≥ 1"},
    {"zero_sub_group",
     {{"zero_optimization", {{"sub_group_size", 0}}}},
     "zero_optimization.sub_group_size",
     "must be ≥ 1"},
    {"fraction_bucket",
     {{"zero_optimization", {{"reduce_bucket_size", 1.5}}}},
     "zero_optimization.reduce_bucket_size",
     "whole number"},
    {"garbage_count_string",
     {{"zero_optimization", {{"allgather_bucket_size", "lots"}}}},
     "zero_optimization.allgather_bucket_size",
     "expected a whole number"},
    {"buffer_count_zero",
     {{"zero_optimization", {{"stage", 3}, {"offload_param", {{"device", "cpu"}, {"buffer_count", 0}}}}}},
     "zero_optimization.offload_param.buffer_count",
     "must be ≥ 1"},
    {"pin_memory_string",
     {{"zero_optimization", {{"offload_optimizer", {{"pin_memory", "true"}}}}}},
     "zero_optimization.offload_optimizer.pin_memory",
     "expected true or false"},
    {"ratio_partial",
     {{"zero_optimization", {{"offload_optimizer", {{"ratio", 0.5}}}}}},
     "zero_optimization.offload_optimizer.ratio",
     "not supported"},
    {"ratio_above_one",
     {{"zero_optimization", {{"offload_optimizer", {{"ratio", 2}}}}}},
     "zero_optimization.offload_optimizer.ratio",
     "must be > 0 and ≤ 1"},
    {"quantized_weights",
     {{"zero_optimization", {{"zero_quantized_weights", true}}}},
     "zero_optimization.zero_quantized_weights",
     "not supported"},
    {"alias_conflict",
     {{"aio", {{"thread_count", 2}, {"intra_op_parallelism", 4}}}},
     "aio.thread_count",
     "keep only intra_op_parallelism"},
    {"aio_block_unaligned", {{"aio", {{"block_size", 1000}}}}, "aio.block_size", "multiple of 4096"},
    {"aio_queue_depth_zero", {{"aio", {{"queue_depth", 0}}}}, "aio.queue_depth", "must be ≥ 1"},
    {"aio_unknown", {{"aio", {{"queue_dept", 8}}}}, "aio.queue_dept", "did you mean \"queue_depth\""},
    {"aio_queue_depth_huge", {{"aio", {{"queue_depth", 100000}}}}, "aio.queue_depth", "at most 4096"},
    {"io_backend",
     {{"zoffload", {{"io_backend", "spdk"}}}},
     "zoffload.io_backend",
     "one of auto, io_uring, libaio, psync"},
    {"loss_normalization",
     {{"zoffload", {{"loss_normalization", "mean"}}}},
     "zoffload.loss_normalization",
     "one of micro_batch, tokens"},
    {"data_shuffle_string",
     {{"zoffload", {{"data", {{"shuffle", "no"}}}}}},
     "zoffload.data.shuffle",
     "expected true or false"},
    {"freeze_not_a_list",
     {{"zoffload", {{"freeze", 3}}}},
     "zoffload.freeze",
     "expected a string or an array of strings"},
    {"freeze_not_strings", {{"zoffload", {{"freeze", {"a", 3}}}}}, "zoffload.freeze[1]", "expected a string"},
    {"lora_r_zero",
     {{"zoffload", {{"lora", {{"r", 0}, {"target_modules", {"q_proj"}}}}}}},
     "zoffload.lora.r",
     "must be at least 1"},
    {"lora_r_negative", {{"zoffload", {{"lora", {{"r", -4}}}}}}, "zoffload.lora.r", "must be ≥ 0"},
    {"lora_without_r", {{"zoffload", {{"lora", {{"lora_alpha", 16}}}}}}, "zoffload.lora.r", "needed"},
    {"lora_dropout",
     {{"zoffload", {{"lora", {{"r", 8}, {"lora_dropout", 0.05}}}}}},
     "zoffload.lora.lora_dropout",
     "must be 0"},
    {"lora_alpha_zero",
     {{"zoffload", {{"lora", {{"r", 8}, {"lora_alpha", 0}}}}}},
     "zoffload.lora.lora_alpha",
     "must be > 0"},
    {"lora_targets_number",
     {{"zoffload", {{"lora", {{"r", 8}, {"target_modules", 7}}}}}},
     "zoffload.lora.target_modules",
     "expected a string or an array of strings"},
    {"lora_unknown", {{"zoffload", {{"lora", {{"r", 8}, {"rank", 8}}}}}}, "zoffload.lora.rank", "unknown"},
    {"data_unknown",
     {{"zoffload", {{"data", {{"shufle", false}}}}}},
     "zoffload.data.shufle",
     "did you mean \"shuffle\""},
    {"both_precisions",
     {{"fp16", {{"enabled", true}}}, {"bf16", {{"enabled", true}}}},
     "bf16.enabled",
     "cannot both be enabled"},
    {"fp16_enabled_string", {{"fp16", {{"enabled", "yes"}}}}, "fp16.enabled", "expected true or false"},
    {"loss_scale_negative", {{"fp16", {{"loss_scale", -1}}}}, "fp16.loss_scale", "must be ≥ 0"},
    {"min_loss_scale_zero", {{"fp16", {{"min_loss_scale", 0}}}}, "fp16.min_loss_scale", "must be > 0"},
    {"hysteresis_zero", {{"fp16", {{"hysteresis", 0}}}}, "fp16.hysteresis", "must be ≥ 1"},
    {"grad_accum_dtype",
     {{"data_types", {{"grad_accum_dtype", "fp8"}}}},
     "data_types.grad_accum_dtype",
     "one of fp32, fp16, bf16"},
    {"clipping_negative", {{"gradient_clipping", -0.5}}, "gradient_clipping", "must be ≥ 0"},
    {"accumulation_zero", {{"gradient_accumulation_steps", 0}}, "gradient_accumulation_steps", "must be ≥ 1"},
    {"batch_mismatch",
     {{"train_batch_size", 10}, {"gradient_accumulation_steps", 2}},
     "train_batch_size",
     "2 × 2 × 1 = 4"},
    {"micro_missing", {{"train_micro_batch_size_per_gpu", nullptr}}, "train_micro_batch_size_per_gpu", "missing"},
    {"optimizer_type", {{"optimizer", {{"type", "SGD"}}}}, "optimizer.type", "one of Adam, AdamW, Adagrad, Lion"},
    {"optimizer_type_missing", {{"optimizer", {{"params", {{"lr", 1e-3}}}}}}, "optimizer.type", "missing"},
    {"lr_zero", {{"optimizer", {{"type", "Adam"}, {"params", {{"lr", 0}}}}}}, "optimizer.params.lr", "must be > 0"},
    // Issue 19: accepted, then "lr = inf is outside [0, inf]" at the first step (fp32 overflow).
    {"lr_over_fp32",
     {{"optimizer", {{"type", "Adam"}, {"params", {{"lr", 1e39}}}}}},
     "optimizer.params.lr",
     "≤ 3.40282"},
    {"warmup_lr_over_fp32",
     {{"scheduler", {{"type", "WarmupLR"}, {"params", {{"warmup_max_lr", 1e39}}}}}},
     "scheduler.params.warmup_max_lr",
     "≤ 3.40282"},
    {"beta_out_of_range",
     {{"optimizer", {{"type", "AdamW"}, {"params", {{"betas", {0.9, 1.5}}}}}}},
     "optimizer.params.betas[1]",
     "< 1"},
    {"betas_wrong_length",
     {{"optimizer", {{"type", "AdamW"}, {"params", {{"betas", {0.9}}}}}}},
     "optimizer.params.betas",
     "array of 2 numbers"},
    {"adamw_l2",
     {{"optimizer", {{"type", "AdamW"}, {"params", {{"adam_w_mode", false}}}}}},
     "optimizer.params.adam_w_mode",
     "use type \"Adam\""},
    {"lion_has_no_eps",
     {{"optimizer", {{"type", "Lion"}, {"params", {{"eps", 1e-8}}}}}},
     "optimizer.params.eps",
     "unknown key"},
    {"scheduler_type", {{"scheduler", {{"type", "OneCycle"}}}}, "scheduler.type", "one of WarmupLR"},
    {"warmup_type",
     {{"scheduler", {{"type", "WarmupLR"}, {"params", {{"warmup_type", "cosine"}}}}}},
     "scheduler.params.warmup_type",
     "one of log, linear"},
    {"cos_ratio",
     {{"scheduler", {{"type", "WarmupCosineLR"}, {"params", {{"total_num_steps", 10}, {"cos_min_ratio", 2}}}}}},
     "scheduler.params.cos_min_ratio",
     "≤ 1"},
    {"zoffload_device", {{"zoffload", {{"device", "tpu"}}}}, "zoffload.device", "one of auto, cuda, host"},
    {"gpu_limit_unit",
     {{"zoffload", {{"gpu_memory_limit", "24 parsecs"}}}},
     "zoffload.gpu_memory_limit",
     "unknown unit"},
    {"pinned_limit_negative",
     {{"zoffload", {{"pinned_memory_limit", "-4GiB"}}}},
     "zoffload.pinned_memory_limit",
     "negative"},
    {"gpu_limit_bool", {{"zoffload", {{"gpu_memory_limit", true}}}}, "zoffload.gpu_memory_limit", "a size in bytes"},
    {"checkpoint_every_without_dir",
     {{"zoffload", {{"checkpoint", {{"every_steps", 10}}}}}},
     "zoffload.checkpoint.dir",
     "needed"},
    {"checkpoint_every_with_empty_dir",
     {{"zoffload", {{"checkpoint", {{"dir", ""}, {"every_steps", 10}}}}}},
     "zoffload.checkpoint.dir",
     "needed"},
    {"checkpoint_unknown", {{"zoffload", {{"checkpoint", {{"keep", 3}}}}}}, "zoffload.checkpoint.keep", "unknown key"},
    {"staging_too_small",
     {{"zoffload", {{"checkpoint", {{"staging_buffer_size", "4KiB"}}}}}},
     "zoffload.checkpoint.staging_buffer_size",
     "at least 1MiB"},
    {"log_unknown",
     {{"zoffload", {{"log", {{"metric_path", "m.jsonl"}}}}}},
     "zoffload.log.metric_path",
     "did you mean \"metrics_path\""},
    {"wall_clock_string", {{"wall_clock_breakdown", "true"}}, "wall_clock_breakdown", "expected true or false"},
    {"accumulators_place",
     {{"zoffload", {{"gradient_accumulators", "gpu"}}}},
     "zoffload.gradient_accumulators",
     "one of auto, cpu, nvme"},
    {"accumulators_without_offload",
     {{"zoffload", {{"gradient_accumulators", "cpu"}}}},
     "zoffload.gradient_accumulators",
     "needs the optimizer offloaded"},
    {"accumulators_nvme_without_path",
     {{"zero_optimization", {{"stage", 3}, {"offload_optimizer", {{"device", "cpu"}}}}},
      {"zoffload", {{"gradient_accumulators", "nvme"}}}},
     "zero_optimization.offload_optimizer.nvme_path",
     "zoffload.gradient_accumulators is \"nvme\""},
    {"read_ahead_without_nvme",
     {{"zero_optimization", {{"stage", 3}, {"offload_optimizer", {{"device", "cpu"}}}}},
      {"zoffload", {{"optimizer_read_ahead", 2}}}},
     "zoffload.optimizer_read_ahead",
     "reads optimizer states ahead from NVMe, but they are not there"},
    {"read_ahead_without_accumulators",
     {{"zero_optimization", {{"stage", 3}, {"offload_optimizer", {{"device", "nvme"}, {"nvme_path", "/tmp/x"}}}}},
      {"gradient_clipping", 0},
      {"zoffload", {{"optimizer_read_ahead", 2}, {"gradient_accumulators", "none"}}}},
     "zoffload.optimizer_read_ahead",
     "each sub-group's states are read as its gradient becomes final"},
    {"read_ahead_with_accumulators_in_the_file",
     {{"zero_optimization", {{"stage", 3}, {"offload_optimizer", {{"device", "nvme"}, {"nvme_path", "/tmp/x"}}}}},
      {"zoffload", {{"optimizer_read_ahead", 2}, {"gradient_accumulators", "nvme"}}}},
     "zoffload.optimizer_read_ahead",
     "the backward writes the gradients into the same records"},
    {"read_ahead_negative", {{"zoffload", {{"optimizer_read_ahead", -1}}}}, "zoffload.optimizer_read_ahead", "≥ 0"},
};

INSTANTIATE_TEST_SUITE_P(Table, MalformedConfig, ::testing::ValuesIn(kMalformed),
                         [](const ::testing::TestParamInfo<Malformed>& info) { return std::string(info.param.name); });

TEST(IoSettings, AioBlockMapsOntoIoOptions) {
  json j = base();
  j["aio"] = {{"block_size", 8 << 20},
              {"queue_depth", 32},
              {"thread_count", 2},
              {"single_submit", true},
              {"overlap_events", false}};
  j["zoffload"] = {{"io_backend", "libaio"}};
  ConfigDiagnostics d;
  auto c = parse(j, &d);
  ASSERT_TRUE(c) << all(d.errors);
  Result<io::IoOptions> o = io_options_from_config(*c);
  ASSERT_TRUE(o.is_ok()) << o.status().to_string();
  EXPECT_EQ(o->backend, io::Backend::kAio);
  EXPECT_EQ(o->block_size_bytes, 8u << 20);
  EXPECT_EQ(o->queue_depth, 32u);
  EXPECT_EQ(o->threads, 2u);
  EXPECT_TRUE(o->single_submit);
  EXPECT_FALSE(o->overlap_events);
  EXPECT_TRUE(o->direct);
  // Defaults map onto the io layer's defaults.
  auto dflt = parse(base(), &d);
  ASSERT_TRUE(dflt);
  Result<io::IoOptions> od = io_options_from_config(*dflt);
  ASSERT_TRUE(od.is_ok());
  EXPECT_EQ(od->backend, io::Backend::kAuto);
  EXPECT_EQ(od->block_size_bytes, io::IoOptions{}.block_size_bytes);
  EXPECT_EQ(od->queue_depth, io::IoOptions{}.queue_depth);
}

TEST(IoSettings, EveryValueTheConfigAcceptsTheIoLayerAccepts) {
  // The config's aio limits and io::IoOptions::validate() agree at the edges.
  json j = base();
  j["aio"] = {{"block_size", io::kMaxRequestBytes},
              {"queue_depth", io::kMaxQueueDepth},
              {"intra_op_parallelism", io::kMaxThreads}};
  ConfigDiagnostics d;
  auto c = parse(j, &d);
  ASSERT_TRUE(c) << all(d.errors);
  EXPECT_TRUE(io_options_from_config(*c).is_ok());
  for (const char* key : {"block_size", "queue_depth", "intra_op_parallelism"}) {
    json k = j;
    k["aio"][key] = k["aio"][key].get<uint64_t>() + (std::string(key) == "block_size" ? 4096 : 1);
    ConfigDiagnostics dk;
    EXPECT_FALSE(parse(k, &dk)) << key;
    ASSERT_EQ(dk.errors.size(), 1u) << all(dk.errors);
    EXPECT_EQ(dk.errors[0].path, std::string("aio.") + key);
  }
}

TEST(ConfigParse, NotAnObject) {
  ConfigDiagnostics d;
  EXPECT_FALSE(parse_config(std::string_view("[1, 2]"), {}, &d));
  ASSERT_EQ(d.errors.size(), 1u);
  EXPECT_THAT(d.errors[0].message, HasSubstr("must be a JSON object"));
}

TEST(ConfigFiles, EveryShippedConfigLoads) {
  const char* src = std::getenv("ZO_SOURCE_DIR");
  ASSERT_NE(src, nullptr) << "ZO_SOURCE_DIR is set by meson test";
  int files = 0;
  for (const auto& entry : std::filesystem::recursive_directory_iterator(std::filesystem::path(src) / "configs")) {
    if (entry.path().extension() != ".json") continue;
    ++files;
    // What `zoffload train --model <4096-wide> --steps 1000` supplies, plus --micro-batch only
    // where the file leaves the micro-batch to the command line (a flag that disagrees with the
    // file is an error).
    ResolveContext ctx;
    ctx.hidden_size = 4096;
    ctx.total_steps = 1000;
    std::ifstream in(entry.path());
    const json j = json::parse(in, nullptr, false);
    const bool micro_from_flags =
        j.is_object() &&
        (!j.contains("train_micro_batch_size_per_gpu") || j["train_micro_batch_size_per_gpu"] == "auto") &&
        !j.contains("train_batch_size");
    if (micro_from_flags || (j.is_object() && j.value("train_batch_size", json()) == "auto")) {
      // What `train` does without --micro-batch: refuse, naming what is missing (issue 19: the
      // micro-batch given below is one train never supplies on its own).
      ConfigDiagnostics without;
      EXPECT_FALSE(load_config_file(entry.path().string(), ctx, &without)) << entry.path();
      EXPECT_THAT(all(without.errors), HasSubstr("micro")) << entry.path();
      ctx.micro_batch_size = 4;
    }
    ConfigDiagnostics d;
    auto c = load_config_file(entry.path().string(), ctx, &d);
    EXPECT_TRUE(c) << entry.path() << ":\n" << all(d.errors);
  }
  EXPECT_GE(files, 6);
}

TEST(ConfigFiles, AccelerateStage3OffloadConfigResolvesAsAccelerateWould) {
  const char* src = std::getenv("ZO_SOURCE_DIR");
  ASSERT_NE(src, nullptr);
  ResolveContext ctx;
  ctx.hidden_size = 1280;  // gpt2-large, as in Accelerate's example
  ctx.micro_batch_size = 32;
  ctx.total_steps = 500;
  ctx.lr = 5e-4;
  ConfigDiagnostics d;
  auto c = load_config_file(std::string(src) + "/configs/accelerate/zero_stage3_offload_config.json", ctx, &d);
  ASSERT_TRUE(c) << all(d.errors);
  EXPECT_EQ(c->zero.stage, 3);
  EXPECT_EQ(c->zero.offload_param.device, OffloadDevice::kCpu);
  EXPECT_EQ(c->zero.offload_optimizer.device, OffloadDevice::kCpu);
  EXPECT_EQ(c->zero.reduce_bucket_size, 1280u * 1280u);
  EXPECT_EQ(c->zero.stage3_param_persistence_threshold, 12800u);
  EXPECT_TRUE(c->fp16.enabled);
  EXPECT_EQ(c->train_batch_size, 32u);
  EXPECT_DOUBLE_EQ(c->scheduler.warmup_max_lr, 5e-4);
  EXPECT_EQ(c->scheduler.total_num_steps, 500u);
}

// Issue 19, finding 4: a FIFO given as --config hung; it is refused before it is opened.
TEST(ConfigFiles, AFifoIsRefusedNotWaitedOn) {
  const std::string path =
      (std::filesystem::temp_directory_path() / ("zo_config_fifo_" + std::to_string(::getpid()))).string();
  std::filesystem::remove(path);
  ASSERT_EQ(::mkfifo(path.c_str(), 0600), 0);
  ConfigDiagnostics d;
  EXPECT_FALSE(load_config_file(path, {}, &d));
  std::filesystem::remove(path);
  ASSERT_EQ(d.errors.size(), 1u) << all(d.errors);
  EXPECT_EQ(d.errors[0].message, "config file is a FIFO (named pipe), not a regular file");
}

// Issue 40: a 10 MB config path was printed twice on one line (20 MB of stderr). load_config_file's
// messages leave the path out (callers print it first); load_config prints it once, bounded.
TEST(ConfigFiles, AnUnreadablePathIsNamedOnceAndBounded) {
  const std::string missing = "/nonexistent/zo-config-" + std::to_string(::getpid()) + ".json";
  Result<Config> r = load_config(missing, {});
  ASSERT_FALSE(r.is_ok());
  EXPECT_EQ(r.status().message(), missing + ": cannot open config file: " + std::strerror(ENOENT));

  // Longer than PATH_MAX: the kernel refuses the name (ENAMETOOLONG).
  const std::string huge(100'000, 'x');
  Result<Config> h = load_config(huge, {});
  ASSERT_FALSE(h.is_ok());
  EXPECT_EQ(h.status().message(),
            std::string(200, 'x') + "... (100000 bytes): cannot read config file: " + std::strerror(ENAMETOOLONG));
}

TEST(ConfigFiles, EmbeddedDemoConfigIsValid) {
  ConfigDiagnostics d;
  auto c = parse_config(embedded_demo_config(), {}, &d);
  ASSERT_TRUE(c) << all(d.errors);
  EXPECT_TRUE(d.warnings.empty()) << all(d.warnings);
  EXPECT_EQ(c->zero.offload_optimizer.device, OffloadDevice::kNvme);
}

// ---- the key table (config_schema.h) drives reading, writing and listing ---------------------------

// The value at a dotted path of a JSON object; null where absent.
json at(const json& root, const std::string& dotted) {
  const json* j = &root;
  size_t start = 0;
  while (start <= dotted.size()) {
    const size_t dot = dotted.find('.', start);
    const std::string part = dotted.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
    if (!j->is_object() || !j->contains(part)) return nullptr;
    j = &(*j)[part];
    if (dot == std::string::npos) break;
    start = dot + 1;
  }
  return *j;
}

void put(json* root, const std::string& dotted, const json& v) {
  json* j = root;
  size_t start = 0;
  for (size_t dot; (dot = dotted.find('.', start)) != std::string::npos; start = dot + 1)
    j = &(*j)[dotted.substr(start, dot - start)];
  (*j)[dotted.substr(start)] = v;
}

bool is_custom(const std::string& path) { return path.starts_with("optimizer") || path.starts_with("scheduler"); }

// Values other than a key's default that the config may hold, in the order to try them.
std::vector<json> candidates(const ConfigKey& k, const json& resolved) {
  std::vector<json> out;
  if (k.type == "bool") return {!resolved.get<bool>()};
  if (k.type.starts_with("one of ")) {
    std::string names = k.type.substr(7);
    for (size_t start = 0, bar; start <= names.size(); start = bar + 1) {
      bar = names.find('|', start);
      if (bar == std::string::npos) bar = names.size();
      out.push_back(names.substr(start, bar - start));
    }
    return out;
  }
  if (k.type == "string") return {"some/where"};
  if (k.type == "string or list of strings") return {json::array({"model.layers.{0..1}.*"})};
  if (resolved.is_number_unsigned() || resolved.is_number_integer()) {
    const uint64_t d = resolved.get<uint64_t>();
    for (uint64_t v : {d + 4096, d - 4096, d + 1, d - 1, uint64_t{1}, uint64_t{2}, uint64_t{3}})
      if (v != d) out.push_back(v);
    return out;
  }
  const double d = resolved.get<double>();
  for (double v : {d * 2, d / 2, d + 1, 0.5, 2.0})
    if (v != d) out.push_back(v);
  return out;
}

// Every key of the table is read from JSON and written back by to_json: set alone (on a minimal
// config, or where its rules need it on one that offloads to NVMe) to a value other than what the
// base resolves to, it comes back at its path. The keys whose every other value is refused as
// unsupported are checked to be refused.
TEST(ConfigKeys, EveryKeyIsReadAndWrittenAtItsPath) {
  json rich = base();
  rich["zero_optimization"] = {{"stage", 3},
                               {"offload_param", {{"device", "cpu"}, {"nvme_path", "/nvme"}}},
                               {"offload_optimizer", {{"device", "nvme"}, {"nvme_path", "/nvme"}}}};
  rich["zoffload"] = {{"checkpoint", {{"dir", "ck"}}}, {"lora", {{"r", 4}}}};  // the other lora keys need r
  rich["bf16"] = {{"enabled", true}};  // bf16.bf16_optimizer_states is read only then
  const std::set<std::string> only_default = {
      "zero_optimization.offload_optimizer.ratio", "zero_optimization.zero_hpz_partition_size",
      "zero_optimization.zero_quantized_weights", "zero_optimization.zero_quantized_gradients",
      "bf16.bf16_master_weights_and_grads", "zoffload.lora.lora_dropout"};
  int checked = 0;
  for (const ConfigKey& k : config_keys().keys) {
    if (is_custom(k.path)) continue;
    bool found = false, refused = false;
    for (const json& b : {base(), rich}) {
      ConfigDiagnostics d0;
      const std::optional<Config> c0 = parse(b, &d0);
      ASSERT_TRUE(c0) << all(d0.errors);
      const json resolved = at(to_json(*c0), k.path);
      for (const json& v : candidates(k, resolved)) {
        // "auto" is every choice key's default, or (zoffload.gradient_store_dtype) resolved away.
        if (v == resolved || v == "auto") continue;
        json j = b;
        put(&j, k.path, v);
        ConfigDiagnostics d;
        const std::optional<Config> c = parse(j, &d);
        if (!c) {
          refused = refused || all(d.errors).find(k.path + ":") != std::string::npos;
          continue;
        }
        const json got = at(to_json(*c), k.path);
        if (v.is_number() && got.is_number()) EXPECT_EQ(got.get<double>(), v.get<double>()) << k.path;
        else EXPECT_EQ(got, v) << k.path;
        found = true;
        break;
      }
      if (found) break;
    }
    if (only_default.count(k.path)) {
      EXPECT_FALSE(found) << k.path << " took a value other than its default";
      EXPECT_TRUE(refused) << k.path << ": a value other than the default is refused at its path";
    } else {
      EXPECT_TRUE(found) << k.path << ": no value other than the default was read back";
      ++checked;
    }
  }
  EXPECT_GT(checked, 55);
}

// Issue 40: "nvme_path": "a\u0000b" used the path "a" (the C file API stops at the NUL). Every
// string key of the table (nvme_path, checkpoint.dir, log.metrics_path, the monitors' output_path
// and job_name) refuses one at its path.
TEST(ConfigKeys, EveryStringKeyRefusesANul) {
  int checked = 0;
  for (const ConfigKey& k : config_keys().keys) {
    if (k.type != "string") continue;
    json j = base();
    put(&j, k.path, std::string("a\0b", 3));
    ConfigDiagnostics d;
    EXPECT_FALSE(parse(j, &d)) << k.path;
    ASSERT_EQ(d.errors.size(), 1u) << k.path << ":\n" << all(d.errors);
    EXPECT_EQ(d.errors[0].to_string(), k.path + ": contains a NUL character (\\u0000)");
    ++checked;
  }
  EXPECT_GE(checked, 7);  // two nvme_path, checkpoint.dir, log.metrics_path, two output_path, two job_name

  ConfigDiagnostics d;
  EXPECT_FALSE(parse_config(std::string_view(R"({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3,
    "offload_param": {"device": "nvme", "nvme_path": "a\u0000b"}}})"),
                            {}, &d));
  EXPECT_EQ(all(d.errors), "zero_optimization.offload_param.nvme_path: contains a NUL character (\\u0000)\n");
}

// Adam's moment dtype: zoffload.moment_dtype, or DeepSpeed's bf16.bf16_optimizer_states for bf16
// moments; each refusal names its key.
TEST(ConfigParse, MomentDtypesAndDeepSpeedsBf16OptimizerStates) {
  auto with = [](json patch) {
    json j = base();
    j["zero_optimization"] = {{"stage", 3}, {"offload_optimizer", {{"device", "cpu"}}}};
    j["bf16"] = {{"enabled", true}};
    j.merge_patch(patch);
    return j;
  };
  for (const char* md : {"fp32", "8bit", "bf16"}) {
    ConfigDiagnostics d;
    const auto c = parse(with({{"zoffload", {{"moment_dtype", md}}}}), &d);
    ASSERT_TRUE(c) << md << ": " << all(d.errors);
    EXPECT_EQ(c->zoffload.moment_dtype, md);
  }
  for (const char* type : {"Lion", "Adagrad"})  // their one state in bf16 or 8 bits too
    for (const char* md : {"bf16", "8bit"}) {
      ConfigDiagnostics d;
      const auto c = parse(with({{"zoffload", {{"moment_dtype", md}}}, {"optimizer", {{"type", type}}}}), &d);
      ASSERT_TRUE(c) << type << " " << md << ": " << all(d.errors);
      EXPECT_EQ(c->zoffload.moment_dtype, md);
    }
  {
    ConfigDiagnostics d;
    const auto c = parse(with({{"bf16", {{"bf16_optimizer_states", true}}}}), &d);
    ASSERT_TRUE(c) << all(d.errors);
    EXPECT_EQ(c->zoffload.moment_dtype, "bf16");
    const auto same =
        parse(with({{"bf16", {{"bf16_optimizer_states", true}}}, {"zoffload", {{"moment_dtype", "bf16"}}}}), &d);
    ASSERT_TRUE(same) << all(d.errors);
    // Every moment dtype steps on the device too (the device's adam_step and adam8bit_step).
    for (const char* md : {"bf16", "8bit"}) {
      const auto on_device = parse(with({{"zoffload", {{"moment_dtype", md}}},
                                         {"zero_optimization", {{"offload_optimizer", {{"device", "none"}}}}}}),
                                   &d);
      ASSERT_TRUE(on_device) << md << ": " << all(d.errors);
      EXPECT_EQ(on_device->zoffload.moment_dtype, md);
    }
  }
  const std::pair<json, std::string> refused[] = {
      {{{"bf16", {{"bf16_optimizer_states", true}}}, {"zoffload", {{"moment_dtype", "8bit"}}}},
       "bf16.bf16_optimizer_states: asks for bf16 moments but zoffload.moment_dtype is \"8bit\": keep one of the two"},
      {{{"bf16", {{"bf16_optimizer_states", true}}}, {"zoffload", {{"moment_dtype", "fp32"}}}},
       "bf16.bf16_optimizer_states: asks for bf16 moments but zoffload.moment_dtype is \"fp32\": keep one of the two"},
      {{{"bf16", {{"enabled", false}, {"bf16_optimizer_states", true}}}},
       "bf16.bf16_optimizer_states: needs bf16.enabled true (DeepSpeed reads it only then); for bf16 moments with "
       "another compute dtype set zoffload.moment_dtype to \"bf16\""},
      {{{"bf16", {{"bf16_master_weights_and_grads", true}}}},
       "bf16.bf16_master_weights_and_grads: DeepSpeed's round-to-nearest bf16 masters are not built: zoffload's "
       "bf16 masters round stochastically; set zoffload.master_dtype to \"bf16\""},
      {{{"zoffload", {{"moment_dtype", "fp16"}}}}, "zoffload.moment_dtype"},
  };
  for (const auto& [patch, want] : refused) {
    ConfigDiagnostics d;
    EXPECT_FALSE(parse(with(patch), &d)) << patch.dump();
    EXPECT_THAT(all(d.errors), HasSubstr(want)) << patch.dump();
  }
}

// zoffload.gradient_store_dtype: "auto" is the accumulation dtype; "bf16" over fp32 sums only where
// the host holds one sum per step (GAS 1 or vertical), with the optimizer offloaded, and with several
// ranks only at stage 2 or 3.
TEST(ConfigParse, GradientStoreDtype) {
  auto with = [](json patch) {
    json j = base();
    j["zero_optimization"] = {{"stage", 2}, {"offload_optimizer", {{"device", "cpu"}}}};
    j["bf16"] = {{"enabled", true}};
    j.merge_patch(patch);
    return j;
  };
  struct Accepted {
    json patch;
    std::string resolved;
    DType stored;
  };
  const Accepted accepted[] = {
      {json::object(), "fp32", DType::kF32},
      {{{"data_types", {{"grad_accum_dtype", "bf16"}}}}, "bf16", DType::kBF16},
      {{{"zoffload", {{"gradient_store_dtype", "bf16"}}}}, "bf16", DType::kBF16},
      {{{"zoffload", {{"gradient_store_dtype", "fp32"}}}}, "fp32", DType::kF32},
      {{{"zoffload", {{"gradient_store_dtype", "bf16"}, {"schedule", "vertical"}}}, {"gradient_accumulation_steps", 4}},
       "bf16",
       DType::kBF16},
      {{{"data_types", {{"grad_accum_dtype", "bf16"}}}, {"zoffload", {{"gradient_store_dtype", "bf16"}}}},
       "bf16",
       DType::kBF16},
  };
  for (const Accepted& a : accepted) {
    ConfigDiagnostics d;
    const auto c = parse(with(a.patch), &d);
    ASSERT_TRUE(c) << a.patch.dump() << ": " << all(d.errors);
    EXPECT_EQ(c->zoffload.gradient_store_dtype, a.resolved) << a.patch.dump();
    EXPECT_EQ(c->grad_store_dtype(), a.stored) << a.patch.dump();
  }
  {  // several ranks at stage 2: the fp32 sums are reduced before their owner rounds them
    ConfigDiagnostics d;
    ResolveContext two;
    two.world_size = 2;
    EXPECT_TRUE(parse(with({{"zoffload", {{"gradient_store_dtype", "bf16"}}}}), &d, two)) << all(d.errors);
  }
  const std::pair<json, std::string> refused[] = {
      {{{"zoffload", {{"gradient_store_dtype", "bf16"}}}, {"gradient_accumulation_steps", 4}},
       "zoffload.gradient_store_dtype: \"bf16\" needs the step's whole sum on the host at once, but "
       "gradient_accumulation_steps is 4 with the horizontal schedule: set zoffload.schedule to \"vertical\""},
      {{{"zoffload", {{"gradient_store_dtype", "fp16"}}}},
       "zoffload.gradient_store_dtype: \"fp16\" cannot hold every loss-scaled fp32 sum"},
      {{{"zoffload", {{"gradient_store_dtype", "fp32"}}}, {"data_types", {{"grad_accum_dtype", "bf16"}}}},
       "zoffload.gradient_store_dtype: \"fp32\" needs fp32 sums (data_types.grad_accum_dtype is bf16"},
      {{{"zoffload", {{"gradient_store_dtype", "bf16"}}},
        {"zero_optimization", {{"offload_optimizer", {{"device", "none"}}}}}},
       "zoffload.gradient_store_dtype: \"bf16\" stores the gradient sums the host keeps for the optimizer"},
      {{{"zoffload", {{"gradient_store_dtype", "int8"}}}}, "zoffload.gradient_store_dtype"},
  };
  for (const auto& [patch, want] : refused) {
    ConfigDiagnostics d;
    EXPECT_FALSE(parse(with(patch), &d)) << patch.dump();
    EXPECT_THAT(all(d.errors), HasSubstr(want)) << patch.dump();
  }
  ConfigDiagnostics d;
  ResolveContext two;
  two.world_size = 2;
  EXPECT_FALSE(
      parse(with({{"zero_optimization", {{"stage", 1}}}, {"zoffload", {{"gradient_store_dtype", "bf16"}}}}), &d, two));
  EXPECT_THAT(all(d.errors), HasSubstr("zoffload.gradient_store_dtype: \"bf16\" with 2 ranks needs "
                                       "zero_optimization.stage 2 or 3"));
}

// zoffload.master_dtype: "fp32" by default; "bf16" with bf16 compute and the optimizer offloaded,
// with any moment dtype, optimizer and stored-gradient dtype.
TEST(ConfigParse, MasterDtype) {
  auto with = [](json patch) {
    json j = base();
    j["zero_optimization"] = {{"stage", 3}, {"offload_optimizer", {{"device", "nvme"}, {"nvme_path", "/tmp/x"}}}};
    j["bf16"] = {{"enabled", true}};
    j.merge_patch(patch);
    return j;
  };
  {
    ConfigDiagnostics d;
    const auto c = parse(with(json::object()), &d);
    ASSERT_TRUE(c) << all(d.errors);
    EXPECT_EQ(c->zoffload.master_dtype, "fp32");
  }
  for (const json& patch : {json{{"zoffload", {{"master_dtype", "bf16"}}}},
                            json{{"zoffload", {{"master_dtype", "bf16"}, {"moment_dtype", "8bit"}}}},
                            json{{"zoffload", {{"master_dtype", "bf16"}, {"gradient_store_dtype", "bf16"}}}},
                            json{{"zoffload", {{"master_dtype", "bf16"}}}, {"optimizer", {{"type", "Lion"}}}},
                            json{{"zoffload", {{"master_dtype", "bf16"}, {"moment_dtype", "8bit"}}},
                                 {"zero_optimization", {{"offload_optimizer", {{"device", "none"}}}}}}}) {
    ConfigDiagnostics d;
    const auto c = parse(with(patch), &d);
    ASSERT_TRUE(c) << patch.dump() << ": " << all(d.errors);
    EXPECT_EQ(c->zoffload.master_dtype, "bf16");
  }
  const std::pair<json, std::string> refused[] = {
      {{{"zoffload", {{"master_dtype", "bf16"}}}, {"bf16", {{"enabled", false}}}},
       "zoffload.master_dtype: \"bf16\" masters are the bf16 compute copies' source: needs bf16.enabled true (the "
       "compute dtype is fp32)"},
      {{{"zoffload", {{"master_dtype", "fp16"}}}}, "zoffload.master_dtype"},
  };
  for (const auto& [patch, want] : refused) {
    ConfigDiagnostics d;
    EXPECT_FALSE(parse(with(patch), &d)) << patch.dump();
    EXPECT_THAT(all(d.errors), HasSubstr(want)) << patch.dump();
  }
}

// Note [No accumulator]: allowed only where no global fact is needed before an update; each
// refusal names the key and what to change.
TEST(ConfigParse, NoAccumulatorNeedsNothingGlobalBeforeTheUpdate) {
  auto with = [](json patch) {
    json j = base();
    j["gradient_clipping"] = 0;
    j["zero_optimization"] = {{"stage", 3}, {"offload_optimizer", {{"device", "cpu"}}}};
    j["bf16"] = {{"enabled", true}, {"check_grad_overflow", false}};
    j["zoffload"] = {{"gradient_accumulators", "none"}};
    j.merge_patch(patch);
    return j;
  };
  for (const json& patch :
       {json::object(), json{{"bf16", {{"enabled", false}}}},
        json{{"gradient_accumulation_steps", 4}, {"zoffload", {{"schedule", "vertical"}}}},
        json{{"zoffload", {{"gradient_store_dtype", "bf16"}, {"moment_dtype", "8bit"}}}},
        json{{"zero_optimization", {{"offload_optimizer", {{"device", "nvme"}, {"nvme_path", "/tmp/x"}}}}}}}) {
    ConfigDiagnostics d;
    const auto c = parse(with(patch), &d);
    ASSERT_TRUE(c) << patch.dump() << ": " << all(d.errors);
    EXPECT_EQ(c->zoffload.gradient_accumulators, "none");
  }
  const std::string key = "zoffload.gradient_accumulators: \"none\" updates each sub-group as its gradient lands";
  const std::pair<json, std::string> refused[] = {
      {{{"gradient_clipping", 1.0}}, key + ", before the step's norm is known: set gradient_clipping to 0 (it is 1;"},
      {{{"bf16", {{"check_grad_overflow", true}}}}, "set bf16.check_grad_overflow to false"},
      {{{"bf16", {{"enabled", false}}}, {"fp16", {{"enabled", true}}}}, "fp16's loss scaling skips a step"},
      {{{"gradient_accumulation_steps", 2}}, "gradient_accumulation_steps is 2 with the horizontal schedule"},
      {{{"zero_optimization", {{"offload_optimizer", {{"device", "none"}}}}}},
       "zoffload.gradient_accumulators: \"none\" needs the optimizer offloaded"},
  };
  for (const auto& [patch, want] : refused) {
    ConfigDiagnostics d;
    EXPECT_FALSE(parse(with(patch), &d)) << patch.dump();
    EXPECT_THAT(all(d.errors), HasSubstr(want)) << patch.dump();
  }
  // Several ranks: each sub-group's gradient is reduced to its owner as it lands (stage 2 or 3).
  ResolveContext two;
  two.world_size = 2;
  ConfigDiagnostics d;
  EXPECT_TRUE(parse(with(json::object()), &d, two)) << all(d.errors);
  for (int stage : {1, 2}) {
    ConfigDiagnostics ds;
    const bool ok = static_cast<bool>(parse(with({{"zero_optimization", {{"stage", stage}}}}), &ds, two));
    EXPECT_EQ(ok, stage == 2) << stage << ": " << all(ds.errors);
    if (stage == 1)
      EXPECT_THAT(all(ds.errors), HasSubstr("with 2 ranks each sub-group's gradient must be reduced to its owner as it "
                                            "lands, which needs zero_optimization.stage 2 or 3 (it is 1)"));
  }
  // Note [Loss normalisation]: "tokens" needs the step's labelled tokens before the first update;
  // one rank knows them from its batches, several would need a collective before backward.
  const json by_tokens = {{"zoffload", {{"loss_normalization", "tokens"}}}};
  ConfigDiagnostics one_rank;
  EXPECT_TRUE(parse(with(by_tokens), &one_rank)) << all(one_rank.errors);
  ConfigDiagnostics ranks;
  EXPECT_FALSE(parse(with(by_tokens), &ranks, two));
  EXPECT_THAT(all(ranks.errors), HasSubstr("zoffload.gradient_accumulators: \"none\" updates each sub-group as its "
                                           "gradient lands, before the step's norm is known: "
                                           "zoffload.loss_normalization \"tokens\" divides by the labelled tokens of "
                                           "every rank"));
}

}  // namespace
}  // namespace zo::engine

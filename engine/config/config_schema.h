// The config's keys, declared once: for each config struct, `keys(v, s)` names every key of its JSON
// object with its type, range and "auto" rule, in the order it is read. Three visitors walk it —
// the reader (JSON → structs, config.cpp), the writer (to_json) and the lister (config_keys(),
// `zoffload config keys`, the docs check), config_describe.cpp — so the struct's field, the key
// that reads it, the resolved JSON and the key list cannot drift apart (Note [Keys declared once]).
// Internal to engine/config. Pure declarations: thread-safe.
#pragma once

#include <array>
#include <cstdint>
#include <limits>
#include <set>
#include <string>
#include <string_view>

#include "common/bytes.h"
#include "common/string_util.h"
#include "engine/config/config.h"
#include "engine/config/json_reader.h"
#include "io/io_options.h"
#include "zo_build_config.h"

namespace zo::engine::detail {

// Note [Keys declared once]
// A plain key is one line here: `v.count("buffer_count", c.buffer_count, 1)`. The struct's member
// initializer is its default. What a table cannot say stays code, placed where it runs while
// reading: `v.rule(...)` holds a check between keys of its object or a value the table's ranges
// cannot express (it runs only when reading, after the keys above it), `v.alias` a second name
// (before the key it renames), `v.no_effect` a DeepSpeed key accepted with a warning. The
// optimizer's and the scheduler's params depend on their type and are hand-written (`v.custom`:
// read_optimizer, read_scheduler in config.cpp; their JSON in config_describe.cpp).
//
// The visitor interface (each visitor implements all of it):
//   flag(key, bool&, AutoOk)                    true or false
//   count(key, uint64_t&, min, AutoOk)          a whole number ≥ min
//   integer(key, int&, min, max)                a whole number in [min, max]
//   number(key, double&, Range, AutoOk)         a real number in the range
//   text(key, std::string&)                     a string (paths)
//   choice(key, E&, names, AutoOk)              one of the names (E an enum, or std::string)
//   bytes(key, uint64_t&)                       a byte size ("24GiB" or an integer)
//   object(key, fn)                             a nested object; fn() visits its keys
//   custom(key, OptimizerConfig& | SchedulerConfig&)
//   alias(old_key, new_key, deprecated)
//   legacy(key, reads_as)                       a deprecated key a rule reads (listed only;
//                                               reads_as is written out in full)
//   no_effect(key, why[, NoEffectValue])    accepted with a warning; the value's type still checked
//   rule(fn(ReadContext&))

// Rules between keys of different blocks, and the resolution of "auto", need the whole file and
// the command line: they are resolve()'s (config.cpp), one Resolver part per key family. A rule whose
// keys are all in one object is written here, beside them.

// A real number's range: [min, max], or (min, max] with min_exclusive.
struct Range {
  double min = 0;
  double max = std::numeric_limits<double>::max();
  bool min_exclusive = false;
};
inline constexpr double kMaxDouble = std::numeric_limits<double>::max();
// The optimizers compute in fp32: a hyperparameter above this would become inf there (issue 19:
// "lr = inf is outside [0, inf]" at the first step, after the config had been accepted).
inline constexpr double kMaxFloat = std::numeric_limits<float>::max();

template <class E>
struct Named {
  E value;
  std::string_view name;
};

inline constexpr std::array<Named<OffloadDevice>, 3> kOffloadDevices = {
    {{OffloadDevice::kNone, "none"}, {OffloadDevice::kCpu, "cpu"}, {OffloadDevice::kNvme, "nvme"}}};
inline constexpr std::array<Named<DeviceKind>, 3> kDeviceKinds = {
    {{DeviceKind::kAuto, "auto"}, {DeviceKind::kCuda, "cuda"}, {DeviceKind::kHost, "host"}}};
inline constexpr std::array<Named<DType>, 3> kAccumDtypes = {
    {{DType::kF32, "fp32"}, {DType::kF16, "fp16"}, {DType::kBF16, "bf16"}}};
inline constexpr std::array<std::string_view, 2> kSchedules = {"horizontal", "vertical"};
inline constexpr std::array<std::string_view, 3> kCheckpointPlaces = {"auto", "device", "cpu"};
inline constexpr std::array<std::string_view, 4> kGradPlaces = {"auto", "cpu", "nvme", "none"};
inline constexpr std::array<std::string_view, 3> kMomentDtypes = {"fp32", "8bit", "bf16"};
inline constexpr std::array<std::string_view, 2> kMasterDtypes = {"fp32", "bf16"};
inline constexpr std::array<std::string_view, 4> kGradStoreDtypes = {"auto", "fp32", "bf16", "fp16"};
inline constexpr std::array<std::string_view, 4> kIoBackends = {"auto", "io_uring", "libaio", "psync"};
inline constexpr std::array<std::string_view, 2> kLossNormalizations = {"micro_batch", "tokens"};
inline constexpr std::array<std::string_view, 3> kBaseQuantizations = {"none", "nf4", "fp4"};

// What a rule sees: the object being read, the parse, and which of its keys were read valid.
struct ReadContext {
  ObjectReader& r;
  ParseState* st;
  const std::set<std::string>& valid;  // keys of this object present with a valid value

  bool given(std::string_view key) const { return valid.count(std::string(key)) != 0; }
  void error(std::string_view key, std::string message) const { st->error(r.key_path(key), std::move(message)); }
  void warn(std::string_view key, std::string message) const { st->warn(r.key_path(key), std::move(message)); }
};

// An offload block's device "nvme" needs its directory (an nvme_path of the wrong type has already
// been reported at its key, and is not echoed).
inline void nvme_path_rule(const ReadContext& x, OffloadDevice device, const std::string& nvme_path) {
  if (device == OffloadDevice::kNvme && nvme_path.empty() && (x.given("nvme_path") || !x.r.has("nvme_path")))
    x.error("nvme_path", "needed when device is \"nvme\"");
}

template <class V>
void keys(V& v, OffloadParamConfig& c) {
  v.choice("device", c.device, kOffloadDevices);
  v.text("nvme_path", c.nvme_path);
  v.count("buffer_count", c.buffer_count, 1);
  v.count("buffer_size", c.buffer_size, 1);
  v.count("max_in_cpu", c.max_in_cpu, 0);
  v.flag("pin_memory", c.pin_memory);
  v.rule([&](const ReadContext& x) { nvme_path_rule(x, c.device, c.nvme_path); });
}

template <class V>
void keys(V& v, OffloadOptimizerConfig& c) {
  v.choice("device", c.device, kOffloadDevices);
  v.text("nvme_path", c.nvme_path);
  v.count("buffer_count", c.buffer_count, 1);
  v.flag("pin_memory", c.pin_memory);
  v.flag("pipeline_read", c.pipeline_read);
  v.flag("pipeline_write", c.pipeline_write);
  v.no_effect("fast_init", "swap files are sized once at start (fallocate)", NoEffectValue::kBool);
  v.no_effect("cpuadam_cores_perc", "zoffload's CPU optimizer chooses its own threads");
  v.legacy("pipeline", "zero_optimization.offload_optimizer.pipeline_read and pipeline_write");
  v.rule([&](const ReadContext& x) {
    // DeepSpeed's old single flag for both directions.
    bool pipeline = false;
    if (!x.r.boolean("pipeline", &pipeline)) return;
    x.warn("pipeline", "deprecated; read as pipeline_read and pipeline_write");
    if (!x.r.has("pipeline_read")) c.pipeline_read = pipeline;
    if (!x.r.has("pipeline_write")) c.pipeline_write = pipeline;
  });
  v.rule([&](const ReadContext& x) {
    nvme_path_rule(x, c.device, c.nvme_path);
    if (c.device == OffloadDevice::kNvme || !(c.pipeline_read || c.pipeline_write)) return;
    const char* key = c.pipeline_read && x.given("pipeline_read")     ? "pipeline_read"
                      : c.pipeline_write && x.given("pipeline_write") ? "pipeline_write"
                                                                      : "pipeline";
    x.warn(key, "has no effect: the read-ahead and write-behind of sub-groups apply with device \"nvme\" only");
  });
  v.number("ratio", c.ratio, {.min = 0.0, .max = 1.0, .min_exclusive = true});
  v.rule([&](const ReadContext& x) {
    if (x.given("ratio") && c.ratio < 1.0)
      x.error("ratio", "partial optimizer offload (ratio < 1) is not supported by zoffload; use 1.0");
  });
}

template <class V>
void keys(V& v, ZeroConfig& z) {
  v.integer("stage", z.stage, 0, 3);
  v.no_effect("contiguous_gradients", "zoffload's gradient path stages and accumulates gradients its own way",
              NoEffectValue::kBool);
  v.no_effect("reduce_scatter", "zoffload reduces each gradient partition to the rank that owns it its own way",
              NoEffectValue::kBool);
  v.count("reduce_bucket_size", z.reduce_bucket_size, 1, AutoOk::kYes);
  v.no_effect("allgather_partitions", "updated partitions are always all-gathered", NoEffectValue::kBool);
  v.count("allgather_bucket_size", z.allgather_bucket_size, 1);
  v.no_effect("overlap_comm", "zoffload overlaps gradient offload with backward on its own schedule",
              NoEffectValue::kBool);
  v.count("sub_group_size", z.sub_group_size, 1);

  // DeepSpeed's pydantic model names these without the stage3_ prefix and accepts both.
  v.alias("prefetch_bucket_size", "stage3_prefetch_bucket_size", false);
  v.alias("param_persistence_threshold", "stage3_param_persistence_threshold", false);
  v.alias("model_persistence_threshold", "stage3_model_persistence_threshold", false);
  v.alias("max_live_parameters", "stage3_max_live_parameters", false);
  v.alias("max_reuse_distance", "stage3_max_reuse_distance", false);
  v.alias("gather_16bit_weights_on_model_save", "stage3_gather_16bit_weights_on_model_save", false);
  v.alias("stage3_gather_fp16_weights_on_model_save", "stage3_gather_16bit_weights_on_model_save", true);
  v.alias("module_granularity_threshold", "stage3_module_granularity_threshold", false);
  v.alias("use_all_reduce_for_fetch_params", "stage3_use_all_reduce_for_fetch_params", false);
  v.alias("allgather_sequential", "stage3_allgather_sequential", false);
  v.count("stage3_prefetch_bucket_size", z.stage3_prefetch_bucket_size, 0, AutoOk::kYes);
  v.count("stage3_param_persistence_threshold", z.stage3_param_persistence_threshold, 0, AutoOk::kYes);
  v.no_effect("stage3_model_persistence_threshold",
              "which parameters stay resident is decided by stage3_param_persistence_threshold alone",
              NoEffectValue::kCount);
  v.count("stage3_max_live_parameters", z.stage3_max_live_parameters, 0);
  v.count("stage3_max_reuse_distance", z.stage3_max_reuse_distance, 0);
  v.flag("stage3_gather_16bit_weights_on_model_save", z.stage3_gather_16bit_weights_on_model_save, AutoOk::kYes);

  v.no_effect("round_robin_gradients", "zoffload's gradient path has one order", NoEffectValue::kBool);
  // Newer DeepSpeed keys for its own machinery (0.19.8's DeepSpeedZeroConfig; the golden file of
  // tests/tools/deepspeed_defaults_test.py lists them): a config that sets them trains here too.
  v.no_effect("stage3_module_granularity_threshold", "zoffload fetches whole decoder blocks", NoEffectValue::kCount);
  v.no_effect("stage3_use_all_reduce_for_fetch_params", "zoffload gathers each block its own way",
              NoEffectValue::kBool);
  v.no_effect("stage3_allgather_sequential", "zoffload gathers each block its own way", NoEffectValue::kBool);
  v.no_effect("compute_grad_norm", "the global gradient norm is always computed (clipping and the metrics use it)",
              NoEffectValue::kBool);
  v.no_effect("load_from_fp32_weights", "a resume always loads the fp32 master weights", NoEffectValue::kBool);
  v.no_effect("enable_sanity_checks", "zoffload's own checks always run", NoEffectValue::kBool);
  v.no_effect("log_trace_cache_warnings", "zoffload's fetch schedule is fixed; it keeps no trace cache",
              NoEffectValue::kBool);
  v.no_effect("override_module_apply", "zoffload wraps no nn.Module", NoEffectValue::kBool);
  v.no_effect("pipeline_loading_checkpoint", "checkpoints are read by zoffload's own loader", NoEffectValue::kBool);
  v.no_effect("parameter_alignment", "zoffload aligns its own buffers", NoEffectValue::kBool);
  v.no_effect("save_muon_momentum_buffer_in_memory", "zoffload has no Muon optimizer", NoEffectValue::kBool);
  v.no_effect("leaf_module", "zoffload fetches whole decoder blocks (no MoE leaf modules)");
  v.count("zero_hpz_partition_size", z.zero_hpz_partition_size, 1);
  v.flag("zero_quantized_weights", z.zero_quantized_weights);
  v.flag("zero_quantized_gradients", z.zero_quantized_gradients);
  v.rule([&](const ReadContext& x) {
    if (x.given("zero_hpz_partition_size") && z.zero_hpz_partition_size > 1)
      x.error("zero_hpz_partition_size", "hierarchical partitioning (ZeRO++ hpZ) is not supported; use 1");
    if (x.given("zero_quantized_weights") && z.zero_quantized_weights)
      x.error("zero_quantized_weights", "quantized weights (ZeRO++ qwZ) are not supported; use false");
    if (x.given("zero_quantized_gradients") && z.zero_quantized_gradients)
      x.error("zero_quantized_gradients", "quantized gradients (ZeRO++ qgZ) are not supported; use false");
  });

  // Legacy ZeRO-Offload flags (DeepSpeed ≤ 0.3): cpu_offload → offload_optimizer.device "cpu",
  // cpu_offload_params → offload_param.device "cpu", cpu_offload_use_pin_memory → pin_memory.
  // Read before the offload blocks (so their messages come first), applied after them.
  v.legacy("cpu_offload", "zero_optimization.offload_optimizer.device \"cpu\" (true) or \"none\" (false)");
  v.legacy("cpu_offload_params", "zero_optimization.offload_param.device \"cpu\" (true) or \"none\" (false)");
  v.legacy("cpu_offload_use_pin_memory", "pin_memory of zero_optimization.offload_optimizer and offload_param");
  // One legacy flag per offload block: what it names and where it puts its value.
  struct LegacyDevice {
    const char* key;
    const char* block;
    OffloadDevice* device;
    bool* pin_memory;
    bool value = false;
    bool given = false;
  };
  LegacyDevice legacy[] = {
      {"cpu_offload", "offload_optimizer", &z.offload_optimizer.device, &z.offload_optimizer.pin_memory},
      {"cpu_offload_params", "offload_param", &z.offload_param.device, &z.offload_param.pin_memory}};
  bool legacy_pin = true, has_legacy_pin = false;
  v.rule([&](const ReadContext& x) {
    for (LegacyDevice& l : legacy) l.given = x.r.boolean(l.key, &l.value);
    has_legacy_pin = x.r.boolean("cpu_offload_use_pin_memory", &legacy_pin);
    for (const LegacyDevice& l : legacy) {
      if (!l.given) continue;
      const std::string block = l.block;
      if (x.r.has(block)) x.error(l.key, "given together with " + block + "; keep only " + block);
      else x.warn(l.key, "deprecated; read as " + block + ".device = \"" + (l.value ? "cpu" : "none") + "\"");
    }
    if (has_legacy_pin)
      x.warn("cpu_offload_use_pin_memory", "deprecated; read as pin_memory of offload_optimizer/offload_param");
  });
  v.object("offload_param", [&] { keys(v, z.offload_param); });
  v.object("offload_optimizer", [&] { keys(v, z.offload_optimizer); });
  v.rule([&](const ReadContext& x) {
    for (const LegacyDevice& l : legacy) {
      if (!l.given || x.r.has(l.block)) continue;
      *l.device = l.value ? OffloadDevice::kCpu : OffloadDevice::kNone;
      if (has_legacy_pin) *l.pin_memory = legacy_pin;
    }
  });

  // Keys of DeepSpeed's that do not change what a single-process zoffload run computes.
  v.no_effect("elastic_checkpoint", "zoffload checkpoints are always resharding-free per rank");
  v.no_effect("ignore_unused_parameters", "every parameter of the model is trained");
  v.no_effect("legacy_stage1", "there is one stage-1 implementation");
  v.no_effect("memory_efficient_linear", "zoffload's linear layers never keep extra copies");
  v.no_effect("use_multi_rank_bucket_allreduce", "buckets are reduced per rank");
}

template <class V>
void keys(V& v, AioConfig& a) {
  v.count("block_size", a.block_size, 1);
  v.count("queue_depth", a.queue_depth, 1);
  v.alias("thread_count", "intra_op_parallelism", true);
  v.count("intra_op_parallelism", a.intra_op_parallelism, 1);
  v.flag("single_submit", a.single_submit);
  v.flag("overlap_events", a.overlap_events);
  v.flag("use_gds", a.use_gds);
  v.rule([&](const ReadContext& x) {
    if (x.given("use_gds") && a.use_gds)
      x.warn("use_gds", "GPUDirect Storage is not available in zoffload; NVMe I/O goes through pinned host memory");
    if (x.given("block_size") && (a.block_size % 4096 != 0 || a.block_size > io::kMaxRequestBytes))
      x.error("block_size", "must be a multiple of 4096 bytes (O_DIRECT) and at most " +
                                format_bytes(io::kMaxRequestBytes) + " (got " + std::to_string(a.block_size) + ")");
    if (a.queue_depth > io::kMaxQueueDepth)
      x.error("queue_depth",
              "must be at most " + std::to_string(io::kMaxQueueDepth) + " (got " + std::to_string(a.queue_depth) + ")");
    if (a.intra_op_parallelism > io::kMaxThreads)
      x.error("intra_op_parallelism", "must be at most " + std::to_string(io::kMaxThreads) + " (got " +
                                          std::to_string(a.intra_op_parallelism) + ")");
  });
}

template <class V>
void keys(V& v, Fp16Config& f) {
  v.flag("enabled", f.enabled, AutoOk::kYes);
  v.flag("auto_cast", f.auto_cast);
  v.number("loss_scale", f.loss_scale, {});
  v.integer("initial_scale_power", f.initial_scale_power, 0, 63);
  v.count("loss_scale_window", f.loss_scale_window, 1);
  v.count("hysteresis", f.hysteresis, 1);
  v.flag("consecutive_hysteresis", f.consecutive_hysteresis);
  v.number("min_loss_scale", f.min_loss_scale, {.min_exclusive = true});
  v.no_effect("fp16_master_weights_and_grads", "master weights are always fp32 in zoffload");
}

template <class V>
void keys(V& v, Bf16Config& b) {
  v.flag("enabled", b.enabled, AutoOk::kYes);
  v.flag("check_grad_overflow", b.check_grad_overflow);
  v.flag("bf16_optimizer_states", b.bf16_optimizer_states);
  v.flag("bf16_master_weights_and_grads", b.bf16_master_weights_and_grads);
  v.no_effect("immediate_grad_update", "gradients are accumulated in grad_accum_dtype");
}

template <class V>
void keys(V& v, CheckpointConfig& c) {
  v.text("dir", c.dir);
  v.count("every_steps", c.every_steps, 0);
  v.count("keep_last", c.keep_last, 0);
  v.bytes("staging_buffer_size", c.staging_buffer_size);
  v.rule([&](const ReadContext& x) {
    if (x.given("staging_buffer_size") && (c.staging_buffer_size < (1u << 20) || c.staging_buffer_size % 4096 != 0))
      x.error("staging_buffer_size",
              "must be at least 1MiB and a multiple of 4096 bytes (got " + std::to_string(c.staging_buffer_size) + ")");
    if (x.r.has("every_steps") && c.every_steps > 0 && c.dir.empty())
      x.error("dir", "needed (a directory, not \"\") when every_steps is set");
  });
}

template <class V>
void keys(V& v, MonitorConfig& m) {
  v.flag("enabled", m.enabled);
  v.text("output_path", m.output_path);
  v.text("job_name", m.job_name);
}

template <class V>
void keys(V& v, LoraConfig& l) {
  v.count("r", l.r, 0);
  // The scale alpha / r multiplies in fp32: a larger alpha is inf there.
  v.number("lora_alpha", l.lora_alpha, {.max = kMaxFloat, .min_exclusive = true});
  v.texts("target_modules", l.target_modules);
  v.flag("use_rslora", l.use_rslora);
  v.number("lora_dropout", l.lora_dropout, {.max = 1});
  v.text("init_from", l.init_from);
  v.rule([&](const ReadContext& x) {
    l.lora_alpha_given = x.given("lora_alpha");
    l.use_rslora_given = x.given("use_rslora");
    l.lora_dropout_given = x.given("lora_dropout");
    // r 0 (the default, as the resolved config prints it) is no adapters; a block that asks for
    // them without a rank is refused at r.
    const bool asks = (x.given("target_modules") && !l.target_modules.empty()) ||
                      (x.given("use_rslora") && l.use_rslora) ||
                      (x.given("lora_alpha") && l.lora_alpha != LoraConfig{}.lora_alpha);
    if (l.r == 0 && l.init_from.empty() && asks)
      x.error("r", x.given("r") ? "must be at least 1 (the adapters' rank; 0 means no adapters)"
                                : "needed: the adapters' rank (or init_from, a PEFT adapter directory to start from)");
    if (x.given("lora_dropout") && l.lora_dropout != 0)
      x.error("lora_dropout",
              "must be 0: zoffload's adapters have no dropout (got " + format_number(l.lora_dropout) + ")");
  });
}

template <class V>
void keys(V& v, ZoffloadConfig& z) {
  v.choice("device", z.device, kDeviceKinds);
  v.bytes("gpu_memory_limit", z.gpu_memory_limit);
  v.bytes("pinned_memory_limit", z.pinned_memory_limit);
  v.count("optimizer_threads", z.optimizer_threads, 0);
  v.flag("bind_cores", z.bind_cores);
  v.flag("overlap_optimizer", z.overlap_optimizer);
  v.count("optimizer_read_ahead", z.optimizer_read_ahead, 0);
  v.choice("schedule", z.schedule, kSchedules);
  v.choice("activation_checkpoints", z.activation_checkpoints, kCheckpointPlaces);
  v.choice("gradient_accumulators", z.gradient_accumulators, kGradPlaces);
  v.choice("moment_dtype", z.moment_dtype, kMomentDtypes);
  v.choice("gradient_store_dtype", z.gradient_store_dtype, kGradStoreDtypes);
  v.choice("master_dtype", z.master_dtype, kMasterDtypes);
  v.choice("io_backend", z.io_backend, kIoBackends);
  v.choice("loss_normalization", z.loss_normalization, kLossNormalizations);
  v.texts("freeze", z.freeze);
  v.object("lora", [&] { keys(v, z.lora); });
  v.choice("quantize_base", z.quantize_base, kBaseQuantizations);
  v.rule([&](const ReadContext& x) {
    if (z.quantize_base != "none" && z.lora.r == 0 && z.lora.init_from.empty())
      x.error("quantize_base",
              "quantizes the frozen base under LoRA adapters: it needs zoffload.lora (r or init_from)");
  });
  v.object("data", [&] { v.flag("shuffle", z.data.shuffle); });
  v.object("checkpoint", [&] { keys(v, z.checkpoint); });
  v.object("log", [&] { v.text("metrics_path", z.log.metrics_path); });
}

template <class V>
void keys(V& v, Config& c) {
  v.object("zero_optimization", [&] { keys(v, c.zero); });
  v.object("aio", [&] { keys(v, c.aio); });
  v.object("fp16", [&] { keys(v, c.fp16); });
  v.alias("bfloat16", "bf16", true);
  v.object("bf16", [&] { keys(v, c.bf16); });
  v.object("data_types", [&] { v.choice("grad_accum_dtype", c.grad_accum_dtype, kAccumDtypes); });
  v.number("gradient_clipping", c.gradient_clipping, {}, AutoOk::kYes);
  v.count("gradient_accumulation_steps", c.gradient_accumulation_steps, 1, AutoOk::kYes);
  v.count("train_micro_batch_size_per_gpu", c.train_micro_batch_size_per_gpu, 1, AutoOk::kYes);
  v.count("train_batch_size", c.train_batch_size, 1, AutoOk::kYes);
  v.custom("optimizer", c.optimizer);
  v.custom("scheduler", c.scheduler);
  v.count("steps_per_print", c.steps_per_print, 1);
  v.flag("wall_clock_breakdown", c.wall_clock_breakdown);
  v.object("tensorboard", [&] { keys(v, c.tensorboard); });
  v.rule([&](const ReadContext& x) {
    if (c.tensorboard.enabled && !ZO_HAVE_PROTOBUF)
      x.error("tensorboard.enabled",
              "this zoffload was built without protobuf, which writes TensorBoard's event files "
              "(install libprotobuf-dev and protobuf-compiler and run tools/setup.sh again; "
              "csv_monitor needs neither)");
  });
  v.object("csv_monitor", [&] { keys(v, c.csv_monitor); });
  v.object("zoffload", [&] { keys(v, c.zoffload); });

  // Top-level DeepSpeed keys that do not change what zoffload computes.
  v.no_effect("zero_allow_untested_optimizer", "zoffload runs only its own CPU optimizers");
  v.no_effect("zero_force_ds_cpu_optimizer", "zoffload runs only its own CPU optimizers");
  v.no_effect("memory_breakdown", "zoffload reports tier usage in its own stats");
  v.no_effect("dump_state", "use `zoffload config check` to print the resolved config");
  v.no_effect("prescale_gradients", "gradients are averaged after reduction");
  v.no_effect("gradient_predivide_factor", "gradients are averaged after reduction");
  v.no_effect("communication_data_type", "collectives use the gradient dtype");
  v.no_effect("activation_checkpointing", "zoffload checkpoints activations at block boundaries");
  v.no_effect("flops_profiler", "use --json metrics and wall_clock_breakdown");
  v.no_effect("wandb", "use tensorboard or csv_monitor (wandb can sync TensorBoard logs)");
  v.no_effect("comet", "use tensorboard or csv_monitor");
  v.no_effect("comms_logger", "zoffload has no communication logger");
}

}  // namespace zo::engine::detail

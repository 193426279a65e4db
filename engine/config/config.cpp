#include "engine/config/config.h"

#include <algorithm>
#include <cstring>
#include <tuple>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/bytes.h"
#include "common/log.h"
#include "common/string_util.h"
#include "engine/config/json_reader.h"
#include "io/env.h"
#include "io/io_options.h"

namespace zo::engine {

using detail::AutoOk;
using detail::format_number;
using detail::json_at;
using detail::ObjectReader;
using detail::ParseState;
using nlohmann::json;

std::string_view to_string(OffloadDevice v) {
  switch (v) {
    case OffloadDevice::kNone: return "none";
    case OffloadDevice::kCpu: return "cpu";
    case OffloadDevice::kNvme: return "nvme";
  }
  return "?";
}
std::string_view to_string(OptimizerType v) {
  switch (v) {
    case OptimizerType::kAdam: return "Adam";
    case OptimizerType::kAdamW: return "AdamW";
    case OptimizerType::kAdagrad: return "Adagrad";
    case OptimizerType::kLion: return "Lion";
  }
  return "?";
}
std::string_view to_string(SchedulerType v) {
  switch (v) {
    case SchedulerType::kNone: return "none";
    case SchedulerType::kWarmupLR: return "WarmupLR";
    case SchedulerType::kWarmupDecayLR: return "WarmupDecayLR";
    case SchedulerType::kWarmupCosineLR: return "WarmupCosineLR";
  }
  return "?";
}
std::string_view to_string(WarmupType v) { return v == WarmupType::kLog ? "log" : "linear"; }

DType Config::compute_dtype() const {
  if (bf16.enabled) return DType::kBF16;
  if (fp16.enabled) return DType::kF16;
  return DType::kF32;
}

namespace {

constexpr double kMaxDouble = std::numeric_limits<double>::max();
// The optimizers compute in fp32: a hyperparameter above this would become inf there (issue 19:
// "lr = inf is outside [0, inf]" at the first step, after the config had been accepted).
constexpr double kMaxFloat = std::numeric_limits<float>::max();
constexpr std::string_view kDevices[] = {"none", "cpu", "nvme"};
constexpr std::string_view kDtypes[] = {"fp32", "fp16", "bf16"};

OffloadDevice device_from(const std::string& s) {
  return s == "cpu" ? OffloadDevice::kCpu : s == "nvme" ? OffloadDevice::kNvme : OffloadDevice::kNone;
}

// ---- reading: JSON → structs, "auto" recorded in ParseState::autos -------------------------------

void read_offload_param(ObjectReader r, OffloadParamConfig* c) {
  std::string device;
  if (r.choice("device", kDevices, &device)) c->device = device_from(device);
  r.string("nvme_path", &c->nvme_path);
  r.count("buffer_count", &c->buffer_count, 1);
  r.count("buffer_size", &c->buffer_size, 1);
  r.count("max_in_cpu", &c->max_in_cpu, 0);
  r.boolean("pin_memory", &c->pin_memory);
  r.finish();
}

void read_offload_optimizer(ParseState* st, ObjectReader r, OffloadOptimizerConfig* c) {
  std::string device;
  if (r.choice("device", kDevices, &device)) c->device = device_from(device);
  r.string("nvme_path", &c->nvme_path);
  r.count("buffer_count", &c->buffer_count, 1);
  r.boolean("pin_memory", &c->pin_memory);
  r.boolean("pipeline_read", &c->pipeline_read);
  r.boolean("pipeline_write", &c->pipeline_write);
  r.boolean("fast_init", &c->fast_init);
  // DeepSpeed's old single flag for both directions.
  bool pipeline = false;
  if (r.boolean("pipeline", &pipeline)) {
    st->warn(r.key_path("pipeline"), "deprecated; read as pipeline_read and pipeline_write");
    if (!r.has("pipeline_read")) c->pipeline_read = pipeline;
    if (!r.has("pipeline_write")) c->pipeline_write = pipeline;
  }
  if (r.number("ratio", &c->ratio, 0.0, 1.0, /*min_exclusive=*/true) && c->ratio < 1.0)
    st->error(r.key_path("ratio"), "partial optimizer offload (ratio < 1) is not supported by zoffload; use 1.0");
  r.finish();
}

void read_zero(ParseState* st, ObjectReader r, ZeroConfig* z) {
  r.integer("stage", &z->stage, 0, 3);
  r.boolean("contiguous_gradients", &z->contiguous_gradients);
  r.boolean("reduce_scatter", &z->reduce_scatter);
  r.count("reduce_bucket_size", &z->reduce_bucket_size, 1, AutoOk::kYes);
  r.boolean("allgather_partitions", &z->allgather_partitions);
  r.count("allgather_bucket_size", &z->allgather_bucket_size, 1);
  bool overlap = false;
  if (r.boolean("overlap_comm", &overlap)) z->overlap_comm = overlap;
  r.count("sub_group_size", &z->sub_group_size, 1);

  // DeepSpeed's pydantic model names these without the stage3_ prefix and accepts both.
  r.alias("prefetch_bucket_size", "stage3_prefetch_bucket_size", false);
  r.alias("param_persistence_threshold", "stage3_param_persistence_threshold", false);
  r.alias("model_persistence_threshold", "stage3_model_persistence_threshold", false);
  r.alias("max_live_parameters", "stage3_max_live_parameters", false);
  r.alias("max_reuse_distance", "stage3_max_reuse_distance", false);
  r.alias("gather_16bit_weights_on_model_save", "stage3_gather_16bit_weights_on_model_save", false);
  r.alias("stage3_gather_fp16_weights_on_model_save", "stage3_gather_16bit_weights_on_model_save", true);
  r.count("stage3_prefetch_bucket_size", &z->stage3_prefetch_bucket_size, 0, AutoOk::kYes);
  r.count("stage3_param_persistence_threshold", &z->stage3_param_persistence_threshold, 0, AutoOk::kYes);
  r.count("stage3_model_persistence_threshold", &z->stage3_model_persistence_threshold, 0);
  r.count("stage3_max_live_parameters", &z->stage3_max_live_parameters, 0);
  r.count("stage3_max_reuse_distance", &z->stage3_max_reuse_distance, 0);
  r.boolean("stage3_gather_16bit_weights_on_model_save", &z->stage3_gather_16bit_weights_on_model_save, AutoOk::kYes);

  r.boolean("round_robin_gradients", &z->round_robin_gradients);
  if (r.count("zero_hpz_partition_size", &z->zero_hpz_partition_size, 1) && z->zero_hpz_partition_size > 1)
    st->error(r.key_path("zero_hpz_partition_size"), "hierarchical partitioning (ZeRO++ hpZ) is not supported; use 1");
  if (r.boolean("zero_quantized_weights", &z->zero_quantized_weights) && z->zero_quantized_weights)
    st->error(r.key_path("zero_quantized_weights"), "quantized weights (ZeRO++ qwZ) are not supported; use false");
  if (r.boolean("zero_quantized_gradients", &z->zero_quantized_gradients) && z->zero_quantized_gradients)
    st->error(r.key_path("zero_quantized_gradients"), "quantized gradients (ZeRO++ qgZ) are not supported; use false");

  // Legacy ZeRO-Offload flags (DeepSpeed ≤ 0.3): cpu_offload → offload_optimizer.device "cpu",
  // cpu_offload_params → offload_param.device "cpu", cpu_offload_use_pin_memory → pin_memory.
  bool legacy_optimizer = false, legacy_params = false, legacy_pin = true;
  const bool has_legacy_optimizer = r.boolean("cpu_offload", &legacy_optimizer);
  const bool has_legacy_params = r.boolean("cpu_offload_params", &legacy_params);
  const bool has_legacy_pin = r.boolean("cpu_offload_use_pin_memory", &legacy_pin);
  if (has_legacy_optimizer) {
    if (r.has("offload_optimizer"))
      st->error(r.key_path("cpu_offload"), "given together with offload_optimizer; keep only offload_optimizer");
    else
      st->warn(r.key_path("cpu_offload"), std::string("deprecated; read as offload_optimizer.device = \"") +
                                              (legacy_optimizer ? "cpu" : "none") + "\"");
  }
  if (has_legacy_params) {
    if (r.has("offload_param"))
      st->error(r.key_path("cpu_offload_params"), "given together with offload_param; keep only offload_param");
    else
      st->warn(r.key_path("cpu_offload_params"), std::string("deprecated; read as offload_param.device = \"") +
                                                     (legacy_params ? "cpu" : "none") + "\"");
  }
  if (has_legacy_pin)
    st->warn(r.key_path("cpu_offload_use_pin_memory"), "deprecated; read as pin_memory of offload_optimizer/offload_param");

  read_offload_param(r.child("offload_param"), &z->offload_param);
  read_offload_optimizer(st, r.child("offload_optimizer"), &z->offload_optimizer);
  if (has_legacy_optimizer && !r.has("offload_optimizer")) {
    z->offload_optimizer.device = legacy_optimizer ? OffloadDevice::kCpu : OffloadDevice::kNone;
    if (has_legacy_pin) z->offload_optimizer.pin_memory = legacy_pin;
  }
  if (has_legacy_params && !r.has("offload_param")) {
    z->offload_param.device = legacy_params ? OffloadDevice::kCpu : OffloadDevice::kNone;
    if (has_legacy_pin) z->offload_param.pin_memory = legacy_pin;
  }

  // Keys of DeepSpeed's that do not change what a single-process zoffload run computes.
  r.accept_without_effect("elastic_checkpoint", "zoffload checkpoints are always resharding-free per rank");
  r.accept_without_effect("ignore_unused_parameters", "every parameter of the model is trained");
  r.accept_without_effect("legacy_stage1", "there is one stage-1 implementation");
  r.accept_without_effect("memory_efficient_linear", "zoffload's linear layers never keep extra copies");
  r.accept_without_effect("use_multi_rank_bucket_allreduce", "buckets are reduced per rank");
  r.finish();
}

void read_aio(ParseState* st, ObjectReader r, AioConfig* a) {
  r.count("block_size", &a->block_size, 1);
  r.count("queue_depth", &a->queue_depth, 1);
  r.alias("thread_count", "intra_op_parallelism", true);
  r.count("intra_op_parallelism", &a->intra_op_parallelism, 1);
  r.boolean("single_submit", &a->single_submit);
  r.boolean("overlap_events", &a->overlap_events);
  if (r.boolean("use_gds", &a->use_gds) && a->use_gds)
    st->warn(r.key_path("use_gds"), "GPUDirect Storage is not available in zoffload; NVMe I/O goes through pinned host memory");
  if (r.has("block_size") && (a->block_size % 4096 != 0 || a->block_size > io::kMaxRequestBytes))
    st->error(r.key_path("block_size"), "must be a multiple of 4096 bytes (O_DIRECT) and at most " +
                                            format_bytes(io::kMaxRequestBytes) + " (got " + std::to_string(a->block_size) + ")");
  if (a->queue_depth > io::kMaxQueueDepth)
    st->error(r.key_path("queue_depth"), "must be at most " + std::to_string(io::kMaxQueueDepth) + " (got " +
                                             std::to_string(a->queue_depth) + ")");
  if (a->intra_op_parallelism > io::kMaxThreads)
    st->error(r.key_path("intra_op_parallelism"), "must be at most " + std::to_string(io::kMaxThreads) + " (got " +
                                                      std::to_string(a->intra_op_parallelism) + ")");
  r.finish();
}

void read_fp16(ObjectReader r, Fp16Config* f) {
  r.boolean("enabled", &f->enabled, AutoOk::kYes);
  r.boolean("auto_cast", &f->auto_cast);
  r.number("loss_scale", &f->loss_scale, 0, kMaxDouble);
  r.integer("initial_scale_power", &f->initial_scale_power, 0, 63);
  r.count("loss_scale_window", &f->loss_scale_window, 1);
  r.count("hysteresis", &f->hysteresis, 1);
  r.boolean("consecutive_hysteresis", &f->consecutive_hysteresis);
  r.number("min_loss_scale", &f->min_loss_scale, 0, kMaxDouble, /*min_exclusive=*/true);
  r.accept_without_effect("fp16_master_weights_and_grads", "master weights are always fp32 in zoffload");
  r.finish();
}

void read_bf16(ObjectReader r, Bf16Config* b) {
  r.boolean("enabled", &b->enabled, AutoOk::kYes);
  r.boolean("check_grad_overflow", &b->check_grad_overflow);
  r.accept_without_effect("immediate_grad_update", "gradients are accumulated in grad_accum_dtype");
  r.finish();
}

void read_optimizer(ParseState* st, ObjectReader r, OptimizerConfig* o) {
  static constexpr std::string_view kTypes[] = {"Adam", "AdamW", "Adagrad", "Lion"};
  std::string type;
  if (!r.has("type")) st->error(r.key_path("type"), "missing; one of Adam, AdamW, Adagrad, Lion");
  if (r.choice("type", kTypes, &type)) {
    o->type = type == "Adam"      ? OptimizerType::kAdam
              : type == "AdamW"   ? OptimizerType::kAdamW
              : type == "Adagrad" ? OptimizerType::kAdagrad
                                  : OptimizerType::kLion;
  }
  // Type-specific defaults before reading params (DeepSpeed's and the reference implementations').
  if (o->type == OptimizerType::kAdagrad) o->eps = 1e-10;
  if (o->type == OptimizerType::kLion) {
    o->lr = 1e-4;
    o->betas = {0.9, 0.99};
  }
  ObjectReader p = r.child("params");
  p.number("lr", &o->lr, 0, kMaxFloat, /*min_exclusive=*/true, AutoOk::kYes);
  p.number("weight_decay", &o->weight_decay, 0, kMaxFloat, false, AutoOk::kYes);
  if (o->type != OptimizerType::kAdagrad) p.number_array("betas", o->betas, 0.0, 1.0, AutoOk::kYes);
  if (o->type != OptimizerType::kLion) p.number("eps", &o->eps, 0, kMaxFloat, /*min_exclusive=*/true, AutoOk::kYes);
  if (o->type == OptimizerType::kAdam || o->type == OptimizerType::kAdamW) {
    bool w_mode = true;
    if (p.boolean("adam_w_mode", &w_mode)) {
      if (o->type == OptimizerType::kAdamW && !w_mode)
        st->error(p.key_path("adam_w_mode"), "AdamW always decouples weight decay; use type \"Adam\" for L2 decay");
      o->adam_w_mode = w_mode;
    }
    p.boolean("bias_correction", &o->bias_correction);
    bool amsgrad = false;
    if (p.boolean("amsgrad", &amsgrad) && amsgrad) st->error(p.key_path("amsgrad"), "AMSGrad is not supported; use false");
    p.accept_without_effect("torch_adam", "zoffload always uses its own vectorized CPU Adam");
    p.accept_without_effect("fused", "zoffload always uses its own vectorized CPU Adam");
  }
  if (o->type == OptimizerType::kAdagrad &&
      p.number("initial_accumulator_value", &o->initial_accumulator_value, 0, kMaxFloat) &&
      o->initial_accumulator_value != 0)
    st->error(p.key_path("initial_accumulator_value"),
              "only 0 is supported (the accumulator starts at zero, as in DeepSpeed's cpu_adagrad)");
  p.finish();
  r.finish();
}

void read_scheduler(ParseState* st, ObjectReader r, SchedulerConfig* s) {
  static constexpr std::string_view kTypes[] = {"WarmupLR", "WarmupDecayLR", "WarmupCosineLR"};
  std::string type;
  if (!r.has("type")) st->error(r.key_path("type"), "missing; one of WarmupLR, WarmupDecayLR, WarmupCosineLR");
  if (r.choice("type", kTypes, &type)) {
    s->type = type == "WarmupLR"        ? SchedulerType::kWarmupLR
              : type == "WarmupDecayLR" ? SchedulerType::kWarmupDecayLR
                                        : SchedulerType::kWarmupCosineLR;
  }
  ObjectReader p = r.child("params");
  static constexpr std::string_view kWarmupTypes[] = {"log", "linear"};
  std::string warmup_type;
  if (p.choice("warmup_type", kWarmupTypes, &warmup_type))
    s->warmup_type = warmup_type == "log" ? WarmupType::kLog : WarmupType::kLinear;
  p.count("warmup_num_steps", &s->warmup_num_steps, 0, AutoOk::kYes);
  if (s->type == SchedulerType::kWarmupCosineLR) {
    p.number("warmup_min_ratio", &s->warmup_min_ratio, 0, 1);
    p.number("cos_min_ratio", &s->cos_min_ratio, 0, 1);
  } else {
    p.number("warmup_min_lr", &s->warmup_min_lr, 0, kMaxFloat, false, AutoOk::kYes);
    p.number("warmup_max_lr", &s->warmup_max_lr, 0, kMaxFloat, false, AutoOk::kYes);
    // Without an explicit value, warm up to the optimizer's lr (resolved later).
    if (!p.has("warmup_max_lr")) st->autos.insert(p.key_path("warmup_max_lr"));
  }
  if (s->type == SchedulerType::kWarmupDecayLR || s->type == SchedulerType::kWarmupCosineLR) {
    if (!p.has("total_num_steps")) st->autos.insert(p.key_path("total_num_steps"));
    p.count("total_num_steps", &s->total_num_steps, 1, AutoOk::kYes);
  }
  p.accept_without_effect("last_batch_iteration", "resume restores the scheduler from the checkpoint");
  p.finish();
  r.finish();
}

void read_zoffload(ParseState* st, ObjectReader r, ZoffloadConfig* z) {
  static constexpr std::string_view kKinds[] = {"auto", "cuda", "host"};
  std::string device;
  if (r.choice("device", kKinds, &device))
    z->device = gpu::parse_device_kind(device).value();  // one of kKinds
  r.size_bytes("gpu_memory_limit", &z->gpu_memory_limit);
  r.size_bytes("pinned_memory_limit", &z->pinned_memory_limit);
  r.count("optimizer_threads", &z->optimizer_threads, 0);
  r.boolean("bind_cores", &z->bind_cores);
  r.boolean("overlap_optimizer", &z->overlap_optimizer);
  static constexpr std::string_view kSchedules[] = {"horizontal", "vertical"};
  r.choice("schedule", kSchedules, &z->schedule);
  static constexpr std::string_view kCheckpointPlaces[] = {"auto", "device", "cpu"};
  r.choice("activation_checkpoints", kCheckpointPlaces, &z->activation_checkpoints);
  static constexpr std::string_view kGradPlaces[] = {"auto", "cpu", "nvme"};
  r.choice("gradient_accumulators", kGradPlaces, &z->gradient_accumulators);
  static constexpr std::string_view kBackends[] = {"auto", "io_uring", "libaio", "psync"};
  r.choice("io_backend", kBackends, &z->io_backend);
  ObjectReader c = r.child("checkpoint");
  c.string("dir", &z->checkpoint.dir);
  c.count("every_steps", &z->checkpoint.every_steps, 0);
  c.count("keep_last", &z->checkpoint.keep_last, 0);
  if (c.size_bytes("staging_buffer_size", &z->checkpoint.staging_buffer_size) &&
      (z->checkpoint.staging_buffer_size < (1u << 20) || z->checkpoint.staging_buffer_size % 4096 != 0))
    st->error(c.key_path("staging_buffer_size"), "must be at least 1MiB and a multiple of 4096 bytes (got " +
                                                      std::to_string(z->checkpoint.staging_buffer_size) + ")");
  if (c.has("every_steps") && z->checkpoint.every_steps > 0 && z->checkpoint.dir.empty())
    st->error(c.key_path("dir"), "needed (a directory, not \"\") when every_steps is set");
  c.finish();
  ObjectReader l = r.child("log");
  l.string("metrics_path", &z->log.metrics_path);
  l.finish();
  r.finish();
}

// ---- resolution of "auto" and cross-key rules -----------------------------------------------------

void resolve(ParseState* st, const ResolveContext& ctx, const json& root, Config* c) {
  ZeroConfig& z = c->zero;
  auto needs = [&](const std::string& path, const std::string& what) {
    st->error(path, "\"auto\" needs " + what);
  };

  // Model-size buckets, as Accelerate sets them from hidden_size.
  const bool hidden_auto = st->is_auto("zero_optimization.reduce_bucket_size") ||
                           st->is_auto("zero_optimization.stage3_prefetch_bucket_size") ||
                           st->is_auto("zero_optimization.stage3_param_persistence_threshold");
  if (hidden_auto && !ctx.hidden_size) {
    for (const char* key : {"reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold"}) {
      const std::string path = std::string("zero_optimization.") + key;
      if (st->is_auto(path)) needs(path, "the model's hidden size (pass --hidden-size H or --model)");
    }
  } else if (ctx.hidden_size) {
    const uint64_t h = *ctx.hidden_size;
    if (st->is_auto("zero_optimization.reduce_bucket_size")) z.reduce_bucket_size = h * h;
    if (st->is_auto("zero_optimization.stage3_prefetch_bucket_size"))
      z.stage3_prefetch_bucket_size = static_cast<uint64_t>(0.9 * static_cast<double>(h * h));
    if (st->is_auto("zero_optimization.stage3_param_persistence_threshold"))
      z.stage3_param_persistence_threshold = 10 * h;
  }
  const json* zjson = root.contains("zero_optimization") ? &root["zero_optimization"] : nullptr;
  if (zjson == nullptr || !zjson->is_object() || !zjson->contains("overlap_comm")) z.overlap_comm = z.stage == 3;
  if (st->is_auto("zero_optimization.stage3_gather_16bit_weights_on_model_save"))
    z.stage3_gather_16bit_weights_on_model_save = false;  // Accelerate's zero3_save_16bit_model default

  // Note [Flags fill the config]: a command-line value (ResolveContext) fills its key where the
  // config says "auto" or nothing; where the config gives another value it is an error naming
  // both, as Accelerate refuses a DeepSpeed config that disagrees with the Trainer's arguments.
  // A flag is never silently outvoted by the file.
  // The file's own key, under its deprecated alias too ("bfloat16" for "bf16", the only alias
  // among the keys a flag fills).
  auto explicit_key = [&](const std::string& path) {
    if (st->is_auto(path)) return false;
    if (json_at(root, path) != nullptr) return true;
    return path.starts_with("bf16.") && json_at(root, "bfloat16." + path.substr(5)) != nullptr;
  };
  auto disagree = [&](const std::string& path, const std::string& config_value, const std::string& flag) {
    st->error(path, config_value + " in the config disagrees with " + flag +
                        " (set the key to \"auto\" or remove it to take the flag, or drop the flag)");
  };
  auto fill = [&](const std::string& path, auto* field, auto flag_value, const std::string& flag) {
    if (explicit_key(path) && *field != flag_value)
      disagree(path, format_number(static_cast<double>(*field)), flag + " " + format_number(static_cast<double>(flag_value)));
    else
      *field = flag_value;
  };

  // Precision.
  if (ctx.mixed_precision) {
    const bool f16 = *ctx.mixed_precision == DType::kF16, b16 = *ctx.mixed_precision == DType::kBF16;
    const std::string flag = std::string("--precision ") + (f16 ? "fp16" : b16 ? "bf16" : "fp32");
    for (auto [path, field, want] : {std::tuple{"fp16.enabled", &c->fp16.enabled, f16},
                                     std::tuple{"bf16.enabled", &c->bf16.enabled, b16}}) {
      if (explicit_key(path) && *field != want)
        disagree(path, *field ? "true" : "false", flag);
      else
        *field = want;
    }
  } else {
    if (st->is_auto("fp16.enabled")) c->fp16.enabled = false;
    if (st->is_auto("bf16.enabled")) c->bf16.enabled = false;
  }
  if (c->fp16.enabled && c->bf16.enabled && !st->has_error("fp16.enabled") && !st->has_error("bf16.enabled"))
    st->error("bf16.enabled", "fp16 and bf16 cannot both be enabled");

  // Optimizer hyper-parameters: command line, else the optimizer's defaults.
  if (ctx.lr) fill("optimizer.params.lr", &c->optimizer.lr, *ctx.lr, "--lr");
  if (ctx.weight_decay) fill("optimizer.params.weight_decay", &c->optimizer.weight_decay, *ctx.weight_decay, "--weight-decay");
  if (ctx.max_grad_norm) fill("gradient_clipping", &c->gradient_clipping, *ctx.max_grad_norm, "--max-grad-norm");
  else if (st->is_auto("gradient_clipping")) c->gradient_clipping = 1.0;

  // Scheduler.
  SchedulerConfig& s = c->scheduler;
  if (s.type == SchedulerType::kNone && ctx.warmup_steps && *ctx.warmup_steps > 0)
    st->error("scheduler", "--warmup-steps needs a scheduler in the config (WarmupLR, WarmupDecayLR or WarmupCosineLR)");
  if (s.type != SchedulerType::kNone) {
    if (st->is_auto("scheduler.params.warmup_min_lr")) s.warmup_min_lr = 0;
    if (st->is_auto("scheduler.params.warmup_max_lr")) s.warmup_max_lr = c->optimizer.lr;
    else if (ctx.lr && explicit_key("scheduler.params.warmup_max_lr") && s.warmup_max_lr != *ctx.lr)
      disagree("scheduler.params.warmup_max_lr", format_number(s.warmup_max_lr), "--lr " + format_number(*ctx.lr));
    if (ctx.warmup_steps) fill("scheduler.params.warmup_num_steps", &s.warmup_num_steps, *ctx.warmup_steps, "--warmup-steps");
    else if (st->is_auto("scheduler.params.warmup_num_steps")) s.warmup_num_steps = 0;
    if (st->is_auto("scheduler.params.total_num_steps")) {
      if (ctx.total_steps) s.total_num_steps = *ctx.total_steps;
      else needs("scheduler.params.total_num_steps", "the number of training steps (pass --steps N)");
    } else if (ctx.total_steps && s.total_num_steps > 0 && *ctx.total_steps > s.total_num_steps &&
               s.type != SchedulerType::kWarmupLR) {
      // --steps is where the run stops: stopping before the schedule ends is a plain short run, but
      // steps past it all take the schedule's final lr (Note [Past the end] in lr_schedule.cpp).
      st->warn("scheduler.params.total_num_steps",
               std::to_string(s.total_num_steps) + " is less than --steps " + std::to_string(*ctx.total_steps) +
                   ": steps " + std::to_string(s.total_num_steps + 1) + " to " + std::to_string(*ctx.total_steps) +
                   " run at the schedule's final lr (set the key to \"auto\" to make --steps the schedule's length)");
    }
    // DeepSpeed warns here too: a short run (a smoke test of a long config) ends inside the warm-up,
    // which lasts N = max(2, warmup_num_steps) steps (docs/training.md). Its last step t = N − 1
    // reaches the peak with the log ramp (ln N / ln N) but not with the linear one ((N − 1) / N).
    const uint64_t warmup_len = std::max<uint64_t>(2, s.warmup_num_steps);
    const uint64_t total = s.total_num_steps;
    const bool short_of_peak = s.warmup_type == WarmupType::kLog ? total < warmup_len : total <= warmup_len;
    if ((s.type == SchedulerType::kWarmupDecayLR || s.type == SchedulerType::kWarmupCosineLR) && total > 0 && short_of_peak)
      st->warn("scheduler.params.total_num_steps",
               std::to_string(total) + " steps end inside the warm-up of max(2, warmup_num_steps) = " +
                   std::to_string(warmup_len) + " steps: the lr never reaches its peak");
    if (s.type != SchedulerType::kWarmupCosineLR && s.warmup_min_lr > s.warmup_max_lr)
      st->error("scheduler.params.warmup_min_lr", "must be ≤ warmup_max_lr");
  }

  // Batch sizes: train_batch_size = micro × accumulation × world size, derived as DeepSpeed does
  // when one of the three is missing.
  // A batch key that was itself invalid would only produce echo errors here.
  const bool batch_keys_valid = !st->has_error("train_batch_size") && !st->has_error("train_micro_batch_size_per_gpu") &&
                                !st->has_error("gradient_accumulation_steps");
  const bool tbs_auto = st->is_auto("train_batch_size");
  const bool micro_auto = st->is_auto("train_micro_batch_size_per_gpu");
  const bool gas_auto = st->is_auto("gradient_accumulation_steps");
  const bool has_tbs = root.contains("train_batch_size") && !tbs_auto;
  const bool has_micro = root.contains("train_micro_batch_size_per_gpu") && !micro_auto;
  const bool has_gas = root.contains("gradient_accumulation_steps") && !gas_auto;
  const uint64_t world = ctx.world_size;
  if (has_micro && ctx.micro_batch_size && batch_keys_valid && *ctx.micro_batch_size != c->train_micro_batch_size_per_gpu)
    disagree("train_micro_batch_size_per_gpu", std::to_string(c->train_micro_batch_size_per_gpu),
             "--micro-batch " + std::to_string(*ctx.micro_batch_size));
  if (has_gas && ctx.gradient_accumulation_steps && batch_keys_valid &&
      *ctx.gradient_accumulation_steps != c->gradient_accumulation_steps)
    disagree("gradient_accumulation_steps", std::to_string(c->gradient_accumulation_steps),
             "--grad-accum " + std::to_string(*ctx.gradient_accumulation_steps));
  if (micro_auto || (!has_micro && ctx.micro_batch_size)) {
    if (ctx.micro_batch_size) c->train_micro_batch_size_per_gpu = *ctx.micro_batch_size;
    else needs("train_micro_batch_size_per_gpu", "the per-GPU micro-batch size (pass --micro-batch N)");
  }
  if (gas_auto || (!has_gas && ctx.gradient_accumulation_steps))
    c->gradient_accumulation_steps = ctx.gradient_accumulation_steps.value_or(1);
  const bool micro_known = has_micro || ctx.micro_batch_size.has_value();
  const bool gas_known = has_gas || gas_auto || ctx.gradient_accumulation_steps.has_value();
  if (!batch_keys_valid) {
    // reported already
  } else if (has_tbs) {
    const uint64_t tbs = c->train_batch_size;
    if (micro_known && gas_known) {
      const uint64_t product = c->train_micro_batch_size_per_gpu * c->gradient_accumulation_steps * world;
      if (product != tbs)
        st->error("train_batch_size", "must equal train_micro_batch_size_per_gpu × gradient_accumulation_steps × world size (" +
                                          std::to_string(c->train_micro_batch_size_per_gpu) + " × " +
                                          std::to_string(c->gradient_accumulation_steps) + " × " + std::to_string(world) +
                                          " = " + std::to_string(product) + "), got " + std::to_string(tbs));
    } else if (micro_known) {  // derive accumulation
      const uint64_t denom = c->train_micro_batch_size_per_gpu * world;
      if (tbs % denom != 0)
        st->error("train_batch_size", "must be a multiple of train_micro_batch_size_per_gpu × world size (" +
                                          std::to_string(denom) + "), got " + std::to_string(tbs));
      else
        c->gradient_accumulation_steps = tbs / denom;
    } else {  // derive the micro-batch
      const uint64_t denom = c->gradient_accumulation_steps * world;
      if (tbs % denom != 0)
        st->error("train_batch_size", "must be a multiple of gradient_accumulation_steps × world size (" +
                                          std::to_string(denom) + "), got " + std::to_string(tbs));
      else
        c->train_micro_batch_size_per_gpu = tbs / denom;
    }
  } else if (!micro_known && !micro_auto) {
    st->error("train_micro_batch_size_per_gpu",
              "missing: give train_micro_batch_size_per_gpu or train_batch_size (or pass --micro-batch N)");
  }
  if (!has_tbs) c->train_batch_size = c->train_micro_batch_size_per_gpu * c->gradient_accumulation_steps * world;

  // Gradient accumulation dtype: fp32 unless given (DeepSpeed would use the compute dtype; fp32
  // accumulation is what keeps 16-bit training stable, so it is our default).
  const json* dt = root.contains("data_types") ? &root["data_types"] : nullptr;
  if (dt == nullptr || !dt->is_object() || !dt->contains("grad_accum_dtype")) c->grad_accum_dtype = DType::kF32;

  // Offload placement rules (skipped when the stage itself was invalid: they would only echo it).
  if (st->has_error("zero_optimization.stage")) return;
  const OffloadParamConfig& op = z.offload_param;
  const OffloadOptimizerConfig& oo = z.offload_optimizer;
  if (op.device != OffloadDevice::kNone && z.stage != 3)
    st->error("zero_optimization.offload_param.device",
              "parameter offload needs stage 3 (zero_optimization.stage is " + std::to_string(z.stage) + ")");
  if (oo.device != OffloadDevice::kNone && z.stage == 0)
    st->error("zero_optimization.offload_optimizer.device", "optimizer offload needs stage 1, 2 or 3 (zero_optimization.stage is 0)");
  if (op.device == OffloadDevice::kNvme && op.nvme_path.empty() && !st->has_error("zero_optimization.offload_param.nvme_path"))
    st->error("zero_optimization.offload_param.nvme_path", "needed when offload_param.device is \"nvme\"");
  if (oo.device == OffloadDevice::kNvme && oo.nvme_path.empty() &&
      !st->has_error("zero_optimization.offload_optimizer.nvme_path"))
    st->error("zero_optimization.offload_optimizer.nvme_path", "needed when offload_optimizer.device is \"nvme\"");
  const std::string& grads = c->zoffload.gradient_accumulators;
  if (grads != "auto" && oo.device == OffloadDevice::kNone)
    st->error("zoffload.gradient_accumulators", "\"" + grads +
                                                    "\" needs the optimizer offloaded (zero_optimization.offload_optimizer.device "
                                                    "cpu or nvme); with the optimizer on the device its accumulators stay there");
  if (grads == "nvme" && oo.nvme_path.empty() && !st->has_error("zero_optimization.offload_optimizer.nvme_path"))
    st->error("zero_optimization.offload_optimizer.nvme_path",
              "needed when zoffload.gradient_accumulators is \"nvme\" (their swap file lives there)");
  if (oo.device != OffloadDevice::kNvme && (oo.pipeline_read || oo.pipeline_write))
    st->warn("zero_optimization.offload_optimizer", "pipeline_read/pipeline_write only apply with device \"nvme\"");
  // What training supports, said here so `config check` and `train` cannot disagree: Adagrad and
  // Lion step on the CPU (cpu_optim); the device's optimizer kernel is Adam's.
  const OptimizerType type = c->optimizer.type;
  if ((type == OptimizerType::kAdagrad || type == OptimizerType::kLion) && oo.device == OffloadDevice::kNone &&
      !st->has_error("optimizer.type"))
    st->error("optimizer.type", std::string(to_string(type)) +
                                    " steps on the CPU only (the GPU optimizer kernel is Adam's): set "
                                    "zero_optimization.offload_optimizer.device to \"cpu\" or \"nvme\"");
}

// ---- JSON text → json, with duplicate keys rejected ----------------------------------------------

// Line and column (1-based) of byte `offset` in `text`.
std::string line_col(std::string_view text, size_t offset) {
  size_t line = 1, col = 1;
  for (size_t i = 0; i < offset && i < text.size(); ++i) {
    if (text[i] == '\n') {
      ++line;
      col = 1;
    } else {
      ++col;
    }
  }
  return "line " + std::to_string(line) + ", column " + std::to_string(col);
}

std::optional<json> parse_json_text(std::string_view text, ConfigDiagnostics* diag) {
  // Track keys per open object to reject duplicates, which nlohmann would silently collapse.
  std::vector<std::pair<std::string, std::set<std::string>>> stack;  // (object path, keys seen)
  std::string last_key;
  bool duplicate = false;
  auto cb = [&](int depth, json::parse_event_t event, json& parsed) -> bool {
    (void)depth;
    switch (event) {
      case json::parse_event_t::object_start: {
        std::string path = stack.empty() ? "" : (stack.back().first.empty() ? last_key : stack.back().first + "." + last_key);
        stack.push_back({path, {}});
        break;
      }
      case json::parse_event_t::object_end:
        if (!stack.empty()) stack.pop_back();
        break;
      case json::parse_event_t::key: {
        last_key = parsed.get<std::string>();
        if (!stack.empty() && !stack.back().second.insert(last_key).second) {
          const std::string& base = stack.back().first;
          diag->errors.push_back({base.empty() ? last_key : base + "." + last_key, "duplicate key"});
          duplicate = true;
        }
        break;
      }
      default:
        break;
    }
    return true;
  };
  try {
    json j = json::parse(text.begin(), text.end(), cb, /*allow_exceptions=*/true, /*ignore_comments=*/false);
    if (duplicate) return std::nullopt;
    return j;
  } catch (const json::exception& e) {  // parse_error, or out_of_range for a number too long
    std::string what = e.what();
    // nlohmann's text: "[json.exception.parse_error.101] parse error at line 3, column 5: ..."
    const size_t colon = what.find("]");
    if (colon != std::string::npos) what = what.substr(colon + 2);
    // It quotes the last token read, which can be a 100 KB number: quote a bounded excerpt.
    what = quote_excerpt(what, 160);
    const auto* parse = dynamic_cast<const json::parse_error*>(&e);
    const std::string at = parse != nullptr ? " (" + line_col(text, parse->byte == 0 ? 0 : parse->byte - 1) + ")" : "";
    diag->errors.push_back({"", "invalid JSON" + at + ": " + what});
    return std::nullopt;
  }
}

}  // namespace

std::optional<Config> parse_config_json(const json& root, const ResolveContext& ctx, ConfigDiagnostics* diag) {
  const size_t errors_before = diag->errors.size();
  if (!root.is_object()) {
    diag->errors.push_back({"", "a config must be a JSON object, got " + detail::describe(root)});
    return std::nullopt;
  }
  ParseState st{diag, {}};
  Config c;
  ObjectReader r(&st, &root, "");

  read_zero(&st, r.child("zero_optimization"), &c.zero);
  read_aio(&st, r.child("aio"), &c.aio);
  read_fp16(r.child("fp16"), &c.fp16);
  r.alias("bfloat16", "bf16", true);
  read_bf16(r.child("bf16"), &c.bf16);

  ObjectReader dt = r.child("data_types");
  std::string accum;
  if (dt.choice("grad_accum_dtype", kDtypes, &accum)) c.grad_accum_dtype = parse_dtype(accum).value();  // one of kDtypes
  dt.finish();

  r.number("gradient_clipping", &c.gradient_clipping, 0, kMaxDouble, false, AutoOk::kYes);
  r.count("gradient_accumulation_steps", &c.gradient_accumulation_steps, 1, AutoOk::kYes);
  r.count("train_micro_batch_size_per_gpu", &c.train_micro_batch_size_per_gpu, 1, AutoOk::kYes);
  r.count("train_batch_size", &c.train_batch_size, 1, AutoOk::kYes);

  if (r.has("optimizer")) read_optimizer(&st, r.child("optimizer"), &c.optimizer);
  else r.child("optimizer");  // records the key as known
  if (r.has("scheduler")) read_scheduler(&st, r.child("scheduler"), &c.scheduler);
  else r.child("scheduler");

  r.count("steps_per_print", &c.steps_per_print, 1);
  r.boolean("wall_clock_breakdown", &c.wall_clock_breakdown);
  read_zoffload(&st, r.child("zoffload"), &c.zoffload);

  // Top-level DeepSpeed keys that do not change what zoffload computes.
  r.accept_without_effect("zero_allow_untested_optimizer", "zoffload runs only its own CPU optimizers");
  r.accept_without_effect("zero_force_ds_cpu_optimizer", "zoffload runs only its own CPU optimizers");
  r.accept_without_effect("memory_breakdown", "zoffload reports tier usage in its own stats");
  r.accept_without_effect("dump_state", "use `zoffload config check` to print the resolved config");
  r.accept_without_effect("prescale_gradients", "gradients are averaged after reduction");
  r.accept_without_effect("gradient_predivide_factor", "gradients are averaged after reduction");
  r.accept_without_effect("communication_data_type", "collectives use the gradient dtype");
  r.accept_without_effect("activation_checkpointing", "zoffload checkpoints activations at block boundaries");
  r.accept_without_effect("flops_profiler", "use --json metrics and wall_clock_breakdown");
  r.accept_without_effect("tensorboard", "use zoffload.log.metrics_path");
  r.accept_without_effect("wandb", "use zoffload.log.metrics_path");
  r.accept_without_effect("csv_monitor", "use zoffload.log.metrics_path");
  r.accept_without_effect("comms_logger", "zoffload has no communication logger");
  r.finish();

  resolve(&st, ctx, root, &c);
  if (diag->errors.size() > errors_before) return std::nullopt;
  return c;
}

std::optional<Config> parse_config(std::string_view json_text, const ResolveContext& ctx, ConfigDiagnostics* diag) {
  std::optional<json> j = parse_json_text(json_text, diag);
  if (!j) return std::nullopt;
  return parse_config_json(*j, ctx, diag);
}

std::optional<Config> load_config_file(const std::string& path, const ResolveContext& ctx, ConfigDiagnostics* diag) {
  // The Env refuses a FIFO before opening it: it would block the read forever.
  Result<std::string> text = io::Env::posix()->read_file(path, "config file", kMaxConfigFileBytes);
  if (!text.is_ok()) {
    const Status& st = text.status();
    diag->errors.push_back({"", st.code() == StatusCode::kNotFound
                                    ? "cannot open config file " + path + ": " + std::strerror(ENOENT)
                                    : st.message()});
    return std::nullopt;
  }
  return parse_config(*text, ctx, diag);
}

Result<Config> load_config(const std::string& path, const ResolveContext& ctx) {
  ConfigDiagnostics diag;
  std::optional<Config> c = load_config_file(path, ctx, &diag);
  for (const ConfigIssue& w : diag.warnings) ZO_LOG(kWarn) << path << ": " << w.to_string();
  if (c) return *c;
  std::string msg;
  for (const ConfigIssue& e : diag.errors) {
    if (!msg.empty()) msg += "\n";
    msg += path + ": " + e.to_string();
  }
  return invalid_argument(msg);
}

json to_json(const Config& c) {
  const ZeroConfig& z = c.zero;
  json zero = {
      {"stage", z.stage},
      {"contiguous_gradients", z.contiguous_gradients},
      {"reduce_scatter", z.reduce_scatter},
      {"reduce_bucket_size", z.reduce_bucket_size},
      {"allgather_partitions", z.allgather_partitions},
      {"allgather_bucket_size", z.allgather_bucket_size},
      {"overlap_comm", z.overlap_comm},
      {"sub_group_size", z.sub_group_size},
      {"stage3_prefetch_bucket_size", z.stage3_prefetch_bucket_size},
      {"stage3_param_persistence_threshold", z.stage3_param_persistence_threshold},
      {"stage3_model_persistence_threshold", z.stage3_model_persistence_threshold},
      {"stage3_max_live_parameters", z.stage3_max_live_parameters},
      {"stage3_max_reuse_distance", z.stage3_max_reuse_distance},
      {"stage3_gather_16bit_weights_on_model_save", z.stage3_gather_16bit_weights_on_model_save},
      {"round_robin_gradients", z.round_robin_gradients},
      {"zero_hpz_partition_size", z.zero_hpz_partition_size},
      {"zero_quantized_weights", z.zero_quantized_weights},
      {"zero_quantized_gradients", z.zero_quantized_gradients},
      {"offload_param",
       {{"device", to_string(z.offload_param.device)},
        {"nvme_path", z.offload_param.nvme_path},
        {"buffer_count", z.offload_param.buffer_count},
        {"buffer_size", z.offload_param.buffer_size},
        {"max_in_cpu", z.offload_param.max_in_cpu},
        {"pin_memory", z.offload_param.pin_memory}}},
      {"offload_optimizer",
       {{"device", to_string(z.offload_optimizer.device)},
        {"nvme_path", z.offload_optimizer.nvme_path},
        {"buffer_count", z.offload_optimizer.buffer_count},
        {"pin_memory", z.offload_optimizer.pin_memory},
        {"pipeline_read", z.offload_optimizer.pipeline_read},
        {"pipeline_write", z.offload_optimizer.pipeline_write},
        {"fast_init", z.offload_optimizer.fast_init},
        {"ratio", z.offload_optimizer.ratio}}},
  };
  const OptimizerConfig& o = c.optimizer;
  json params = {{"lr", o.lr}, {"weight_decay", o.weight_decay}};
  if (o.type != OptimizerType::kAdagrad) params["betas"] = {o.betas[0], o.betas[1]};
  if (o.type != OptimizerType::kLion) params["eps"] = o.eps;
  if (o.type == OptimizerType::kAdam || o.type == OptimizerType::kAdamW) {
    params["adam_w_mode"] = o.adam_w_mode;
    params["bias_correction"] = o.bias_correction;
  }
  if (o.type == OptimizerType::kAdagrad) params["initial_accumulator_value"] = o.initial_accumulator_value;

  json out = {
      {"train_batch_size", c.train_batch_size},
      {"train_micro_batch_size_per_gpu", c.train_micro_batch_size_per_gpu},
      {"gradient_accumulation_steps", c.gradient_accumulation_steps},
      {"gradient_clipping", c.gradient_clipping},
      {"steps_per_print", c.steps_per_print},
      {"wall_clock_breakdown", c.wall_clock_breakdown},
      {"fp16",
       {{"enabled", c.fp16.enabled},
        {"auto_cast", c.fp16.auto_cast},
        {"loss_scale", c.fp16.loss_scale},
        {"initial_scale_power", c.fp16.initial_scale_power},
        {"loss_scale_window", c.fp16.loss_scale_window},
        {"hysteresis", c.fp16.hysteresis},
        {"consecutive_hysteresis", c.fp16.consecutive_hysteresis},
        {"min_loss_scale", c.fp16.min_loss_scale}}},
      {"bf16", {{"enabled", c.bf16.enabled}, {"check_grad_overflow", c.bf16.check_grad_overflow}}},
      {"data_types", {{"grad_accum_dtype", dtype_name(c.grad_accum_dtype)}}},
      {"optimizer", {{"type", to_string(o.type)}, {"params", params}}},
      {"zero_optimization", zero},
      {"aio",
       {{"block_size", c.aio.block_size},
        {"queue_depth", c.aio.queue_depth},
        {"intra_op_parallelism", c.aio.intra_op_parallelism},
        {"single_submit", c.aio.single_submit},
        {"overlap_events", c.aio.overlap_events},
        {"use_gds", c.aio.use_gds}}},
  };
  const SchedulerConfig& s = c.scheduler;
  if (s.type != SchedulerType::kNone) {
    json sp = {{"warmup_num_steps", s.warmup_num_steps}, {"warmup_type", to_string(s.warmup_type)}};
    if (s.type == SchedulerType::kWarmupCosineLR) {
      sp["warmup_min_ratio"] = s.warmup_min_ratio;
      sp["cos_min_ratio"] = s.cos_min_ratio;
    } else {
      sp["warmup_min_lr"] = s.warmup_min_lr;
      sp["warmup_max_lr"] = s.warmup_max_lr;
    }
    if (s.type != SchedulerType::kWarmupLR) sp["total_num_steps"] = s.total_num_steps;
    out["scheduler"] = {{"type", to_string(s.type)}, {"params", sp}};
  }
  const ZoffloadConfig& zo = c.zoffload;
  out["zoffload"] = {
      {"device", gpu::device_kind_name(zo.device)},
      {"gpu_memory_limit", zo.gpu_memory_limit},
      {"pinned_memory_limit", zo.pinned_memory_limit},
      {"optimizer_threads", zo.optimizer_threads},
      {"bind_cores", zo.bind_cores},
      {"overlap_optimizer", zo.overlap_optimizer},
      {"schedule", zo.schedule},
      {"activation_checkpoints", zo.activation_checkpoints},
      {"gradient_accumulators", zo.gradient_accumulators},
      {"io_backend", zo.io_backend},
      {"checkpoint",
       {{"dir", zo.checkpoint.dir},
        {"every_steps", zo.checkpoint.every_steps},
        {"keep_last", zo.checkpoint.keep_last},
        {"staging_buffer_size", zo.checkpoint.staging_buffer_size}}},
      {"log", {{"metrics_path", zo.log.metrics_path}}},
  };
  return out;
}

}  // namespace zo::engine

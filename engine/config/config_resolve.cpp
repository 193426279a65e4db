// The resolution of a parsed config: each key family's "auto" (Accelerate's rules, the flags of
// ResolveContext) and the rules between keys of different blocks. parse_config_json runs it once
// every key is read (config.cpp).
#include <algorithm>
#include <string>

#include <nlohmann/json.hpp>

#include "common/log.h"
#include "common/string_util.h"
#include "engine/config/config.h"
#include "engine/config/config_schema.h"
#include "engine/config/json_reader.h"

namespace zo::engine::detail {

using nlohmann::json;

namespace {

// resolve() in its parts, each one key family's "auto" and the rules between keys of different
// blocks, over the helpers they share. A rule within one object sits beside its keys in
// config_schema.h (Note [Keys declared once]).
struct Resolver {
  ParseState* st;
  const ResolveContext& ctx;
  const json& root;
  Config* c;

  void model_size_buckets();
  void precision();
  void optimizer_hyperparameters();
  void scheduler();
  void batch_sizes();
  void grad_accum_dtype();
  void offload_placement();
  void gradient_store_dtype();
  void no_accumulator();

  void needs(const std::string& path, const std::string& what) { st->error(path, "\"auto\" needs " + what); }

  // Note [Flags fill the config]: a command-line value (ResolveContext) fills its key where the
  // config says "auto" or nothing; where the config gives another value it is an error naming
  // both, as Accelerate refuses a DeepSpeed config that disagrees with the Trainer's arguments.
  // A flag is never silently outvoted by the file.
  // The file's own key, under its deprecated alias too ("bfloat16" for "bf16", the only alias
  // among the keys a flag fills).
  bool explicit_key(const std::string& path) const {
    if (st->is_auto(path)) return false;
    if (json_at(root, path) != nullptr) return true;
    return path.starts_with("bf16.") && json_at(root, "bfloat16." + path.substr(5)) != nullptr;
  }
  void disagree(const std::string& path, const std::string& config_value, const std::string& flag) {
    st->error(path, config_value + " in the config disagrees with " + flag +
                        " (set the key to \"auto\" or remove it to take the flag, or drop the flag)");
  }
  template <typename T, typename V>
  void fill(const std::string& path, T* field, V flag_value, const std::string& flag) {
    if (explicit_key(path) && *field != flag_value)
      disagree(path, format_number(static_cast<double>(*field)),
               flag + " " + format_number(static_cast<double>(flag_value)));
    else *field = flag_value;
  }
};

// Model-size buckets, as Accelerate sets them from hidden_size.
void Resolver::model_size_buckets() {
  ZeroConfig& z = c->zero;
  const bool hidden_auto = st->is_auto("zero_optimization.reduce_bucket_size") ||
                           st->is_auto("zero_optimization.stage3_prefetch_bucket_size") ||
                           st->is_auto("zero_optimization.stage3_param_persistence_threshold");
  if (hidden_auto && !ctx.hidden_size) {
    for (const char* key :
         {"reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold"}) {
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
  if (st->is_auto("zero_optimization.stage3_gather_16bit_weights_on_model_save"))
    z.stage3_gather_16bit_weights_on_model_save = false;  // Accelerate's zero3_save_16bit_model default
}

// Precision.
void Resolver::precision() {
  if (ctx.mixed_precision) {
    const bool f16 = *ctx.mixed_precision == DType::kF16, b16 = *ctx.mixed_precision == DType::kBF16;
    const std::string flag = std::string("--precision ") + (f16 ? "fp16" : b16 ? "bf16" : "fp32");
    for (auto [path, field, want] :
         {std::tuple{"fp16.enabled", &c->fp16.enabled, f16}, std::tuple{"bf16.enabled", &c->bf16.enabled, b16}}) {
      if (explicit_key(path) && *field != want) disagree(path, *field ? "true" : "false", flag);
      else *field = want;
    }
  } else {
    if (st->is_auto("fp16.enabled")) c->fp16.enabled = false;
    if (st->is_auto("bf16.enabled")) c->bf16.enabled = false;
  }
  if (c->fp16.enabled && c->bf16.enabled && !st->has_error("fp16.enabled") && !st->has_error("bf16.enabled"))
    st->error("bf16.enabled", "fp16 and bf16 cannot both be enabled");
}

// Optimizer hyper-parameters: command line, else the optimizer's defaults.
void Resolver::optimizer_hyperparameters() {
  if (ctx.lr) fill("optimizer.params.lr", &c->optimizer.lr, *ctx.lr, "--lr");
  if (ctx.weight_decay)
    fill("optimizer.params.weight_decay", &c->optimizer.weight_decay, *ctx.weight_decay, "--weight-decay");
  if (ctx.max_grad_norm) fill("gradient_clipping", &c->gradient_clipping, *ctx.max_grad_norm, "--max-grad-norm");
  else if (st->is_auto("gradient_clipping")) c->gradient_clipping = 1.0;
}

// Scheduler.
void Resolver::scheduler() {
  SchedulerConfig& s = c->scheduler;
  if (s.type == SchedulerType::kNone && ctx.warmup_steps && *ctx.warmup_steps > 0)
    st->error("scheduler",
              "--warmup-steps needs a scheduler in the config (WarmupLR, WarmupDecayLR or WarmupCosineLR)");
  if (s.type != SchedulerType::kNone) {
    if (st->is_auto("scheduler.params.warmup_min_lr")) s.warmup_min_lr = 0;
    if (st->is_auto("scheduler.params.warmup_max_lr")) s.warmup_max_lr = c->optimizer.lr;
    else if (ctx.lr && explicit_key("scheduler.params.warmup_max_lr") && s.warmup_max_lr != *ctx.lr)
      disagree("scheduler.params.warmup_max_lr", format_number(s.warmup_max_lr), "--lr " + format_number(*ctx.lr));
    if (ctx.warmup_steps)
      fill("scheduler.params.warmup_num_steps", &s.warmup_num_steps, *ctx.warmup_steps, "--warmup-steps");
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
    if ((s.type == SchedulerType::kWarmupDecayLR || s.type == SchedulerType::kWarmupCosineLR) && total > 0 &&
        short_of_peak)
      st->warn("scheduler.params.total_num_steps",
               std::to_string(total) + " steps end inside the warm-up of max(2, warmup_num_steps) = " +
                   std::to_string(warmup_len) + " steps: the lr never reaches its peak");
    if (s.type != SchedulerType::kWarmupCosineLR && s.warmup_min_lr > s.warmup_max_lr)
      st->error("scheduler.params.warmup_min_lr", "must be ≤ warmup_max_lr");
  }
}

// Batch sizes: train_batch_size = micro × accumulation × world size, derived as DeepSpeed does
// when one of the three is missing.
void Resolver::batch_sizes() {
  // A batch key that was itself invalid would only produce echo errors here.
  const bool batch_keys_valid = !st->has_error("train_batch_size") &&
                                !st->has_error("train_micro_batch_size_per_gpu") &&
                                !st->has_error("gradient_accumulation_steps");
  const bool tbs_auto = st->is_auto("train_batch_size");
  const bool micro_auto = st->is_auto("train_micro_batch_size_per_gpu");
  const bool gas_auto = st->is_auto("gradient_accumulation_steps");
  const bool has_tbs = root.contains("train_batch_size") && !tbs_auto;
  const bool has_micro = root.contains("train_micro_batch_size_per_gpu") && !micro_auto;
  const bool has_gas = root.contains("gradient_accumulation_steps") && !gas_auto;
  const uint64_t world = ctx.world_size;
  if (has_micro && ctx.micro_batch_size && batch_keys_valid &&
      *ctx.micro_batch_size != c->train_micro_batch_size_per_gpu)
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
        st->error("train_batch_size",
                  "must equal train_micro_batch_size_per_gpu × gradient_accumulation_steps × world size (" +
                      std::to_string(c->train_micro_batch_size_per_gpu) + " × " +
                      std::to_string(c->gradient_accumulation_steps) + " × " + std::to_string(world) + " = " +
                      std::to_string(product) + "), got " + std::to_string(tbs));
    } else if (micro_known) {  // derive accumulation
      const uint64_t denom = c->train_micro_batch_size_per_gpu * world;
      if (tbs % denom != 0)
        st->error("train_batch_size", "must be a multiple of train_micro_batch_size_per_gpu × world size (" +
                                          std::to_string(denom) + "), got " + std::to_string(tbs));
      else c->gradient_accumulation_steps = tbs / denom;
    } else {  // derive the micro-batch
      const uint64_t denom = c->gradient_accumulation_steps * world;
      if (tbs % denom != 0)
        st->error("train_batch_size", "must be a multiple of gradient_accumulation_steps × world size (" +
                                          std::to_string(denom) + "), got " + std::to_string(tbs));
      else c->train_micro_batch_size_per_gpu = tbs / denom;
    }
  } else if (!micro_known && !micro_auto) {
    st->error("train_micro_batch_size_per_gpu",
              "missing: give train_micro_batch_size_per_gpu or train_batch_size (or pass --micro-batch N)");
  }
  if (!has_tbs) c->train_batch_size = c->train_micro_batch_size_per_gpu * c->gradient_accumulation_steps * world;
}

// Gradient accumulation dtype: fp32 unless given (DeepSpeed would use the compute dtype; fp32
// accumulation is what keeps 16-bit training stable, so it is our default).
void Resolver::grad_accum_dtype() {
  const json* dt = root.contains("data_types") ? &root["data_types"] : nullptr;
  if (dt == nullptr || !dt->is_object() || !dt->contains("grad_accum_dtype")) c->grad_accum_dtype = DType::kF32;
}

// Offload placement rules (skipped when the stage itself was invalid: they would only echo it).
void Resolver::offload_placement() {
  ZeroConfig& z = c->zero;
  if (st->has_error("zero_optimization.stage")) return;
  const OffloadParamConfig& op = z.offload_param;
  const OffloadOptimizerConfig& oo = z.offload_optimizer;
  if (op.device != OffloadDevice::kNone && z.stage != 3)
    st->error("zero_optimization.offload_param.device",
              "parameter offload needs stage 3 (zero_optimization.stage is " + std::to_string(z.stage) + ")");
  if (oo.device != OffloadDevice::kNone && z.stage == 0)
    st->error("zero_optimization.offload_optimizer.device",
              "optimizer offload needs stage 1, 2 or 3 (zero_optimization.stage is 0)");
  const std::string& grads = c->zoffload.gradient_accumulators;
  if (grads != "auto" && oo.device == OffloadDevice::kNone)
    st->error("zoffload.gradient_accumulators",
              "\"" + grads +
                  "\" needs the optimizer offloaded (zero_optimization.offload_optimizer.device "
                  "cpu or nvme); with the optimizer on the device its accumulators stay there");
  if (c->zoffload.optimizer_read_ahead > 0 && oo.device != OffloadDevice::kNvme)
    st->error("zoffload.optimizer_read_ahead", std::to_string(c->zoffload.optimizer_read_ahead) +
                                                   " reads optimizer states ahead from NVMe, but they are not there "
                                                   "(zero_optimization.offload_optimizer.device is not \"nvme\")");
  else if (c->zoffload.optimizer_read_ahead > 0 && (grads == "none" || grads == "nvme"))
    st->error("zoffload.optimizer_read_ahead",
              grads == "none"
                  ? "reads ahead for a step after the backward; without accumulators (gradient_accumulators "
                    "\"none\") each sub-group's states are read as its gradient becomes final"
                  : "cannot read ahead with gradient_accumulators \"nvme\": the backward writes the "
                    "gradients into the same records of the swap file");
  if (grads == "nvme" && oo.nvme_path.empty() && !st->has_error("zero_optimization.offload_optimizer.nvme_path"))
    st->error("zero_optimization.offload_optimizer.nvme_path",
              "needed when zoffload.gradient_accumulators is \"nvme\" (their swap file lives there)");
  // What training supports, said here so `config check` and `train` cannot disagree: Adagrad and
  // Lion step on the CPU (cpu_optim); the device's optimizer kernel is Adam's.
  const OptimizerType type = c->optimizer.type;
  if ((type == OptimizerType::kAdagrad || type == OptimizerType::kLion) && oo.device == OffloadDevice::kNone &&
      !st->has_error("optimizer.type"))
    st->error("optimizer.type", std::string(to_string(type)) +
                                    " steps on the CPU only (the GPU optimizer kernel is Adam's): set "
                                    "zero_optimization.offload_optimizer.device to \"cpu\" or \"nvme\"");
  // DeepSpeed's bf16.bf16_optimizer_states is zoffload.moment_dtype "bf16" (DeepSpeed reads the bf16
  // section's keys only with bf16.enabled); its bf16 masters are not built.
  const bool moment_dtype_given = json_at(root, "zoffload.moment_dtype") != nullptr;
  if (c->bf16.bf16_optimizer_states && !st->has_error("bf16.bf16_optimizer_states")) {
    if (!c->bf16.enabled) {
      st->error("bf16.bf16_optimizer_states",
                "needs bf16.enabled true (DeepSpeed reads it only then); for bf16 moments with another compute "
                "dtype set zoffload.moment_dtype to \"bf16\"");
    } else if (moment_dtype_given && c->zoffload.moment_dtype != "bf16") {
      st->error("bf16.bf16_optimizer_states", "asks for bf16 moments but zoffload.moment_dtype is \"" +
                                                  c->zoffload.moment_dtype + "\": keep one of the two");
    } else {
      c->zoffload.moment_dtype = "bf16";
    }
  }
  // DeepSpeed's bf16.bf16_master_weights_and_grads rounds its bf16 masters to nearest; zoffload's
  // round stochastically, a different algorithm, so the key is refused with the one that asks for it.
  if (c->bf16.bf16_master_weights_and_grads && !st->has_error("bf16.bf16_master_weights_and_grads"))
    st->error("bf16.bf16_master_weights_and_grads",
              "DeepSpeed's round-to-nearest bf16 masters are not built: zoffload's bf16 masters round "
              "stochastically; set zoffload.master_dtype to \"bf16\" (and zoffload.gradient_store_dtype to "
              "\"bf16\" for bf16 gradients), and remove this key or set it to false");
  if (c->zoffload.master_dtype == "bf16" && !st->has_error("zoffload.master_dtype")) {
    if (!c->bf16.enabled) {
      st->error("zoffload.master_dtype",
                "\"bf16\" masters are the bf16 compute copies' source: needs bf16.enabled true (the compute "
                "dtype is " +
                    std::string(c->fp16.enabled ? "fp16" : "fp32") + ")");
    }
  }
}

// zoffload.gradient_store_dtype: "auto" is grad_accum_dtype; a narrower dtype rounds fp32 sums, each
// once, after its norm is taken, which needs the step's whole sum on the host at once (Note
// [Gradients stored in 16 bits] in engine/coord/grad_accumulator.cpp).
void Resolver::gradient_store_dtype() {
  std::string& d = c->zoffload.gradient_store_dtype;
  const std::string_view accum = dtype_name(c->grad_accum_dtype);
  if (st->has_error("zoffload.gradient_store_dtype") || st->has_error("data_types.grad_accum_dtype")) return;
  if (d == "auto") d = std::string(accum);
  if (d == accum) return;
  const char* key = "zoffload.gradient_store_dtype";
  if (c->grad_accum_dtype != DType::kF32) {
    st->error(key, "\"" + d + "\" needs fp32 sums (data_types.grad_accum_dtype is " + std::string(accum) +
                       ", which the accumulators already keep)");
  } else if (d == "fp16") {
    st->error(key,
              "\"fp16\" cannot hold every loss-scaled fp32 sum (its range ends at 65504): use \"bf16\", or \"auto\"");
  } else if (c->zero.offload_optimizer.device == OffloadDevice::kNone && !st->has_error("zero_optimization.stage")) {
    st->error(key, "\"" + d +
                       "\" stores the gradient sums the host keeps for the optimizer: set "
                       "zero_optimization.offload_optimizer.device to \"cpu\" or \"nvme\"");
  } else if (c->gradient_accumulation_steps > 1 && c->zoffload.schedule != "vertical") {
    st->error(key, "\"" + d + "\" needs the step's whole sum on the host at once, but gradient_accumulation_steps is " +
                       std::to_string(c->gradient_accumulation_steps) +
                       " with the horizontal schedule: set zoffload.schedule to \"vertical\" (the device sums "
                       "the micro-batches in fp32), or leave this \"auto\"");
  } else if (ctx.world_size > 1 && c->zero.stage < 2) {
    st->error(key, "\"" + d + "\" with " + std::to_string(ctx.world_size) + " ranks needs zero_optimization.stage " +
                       "2 or 3 (each rank's fp32 sums are reduced to their owner before they are rounded; at stage " +
                       std::to_string(c->zero.stage) + " the stored gradients would be summed over the ranks)");
  }
}

// zoffload.gradient_accumulators "none": each sub-group's gradient goes from the landing ring to the
// optimizer when it is final, so nothing global may be needed before the first update and every
// window must be the step's only one (Note [No accumulator] in engine/coord/grad_accumulator.cpp).
void Resolver::no_accumulator() {
  const char* key = "zoffload.gradient_accumulators";
  if (c->zoffload.gradient_accumulators != "none" || st->has_error(key)) return;
  const std::string why = "\"none\" updates each sub-group as its gradient lands, before the step's norm is known: ";
  if (c->zero.offload_optimizer.device == OffloadDevice::kNone) {
    return;  // offload_placement said so
  } else if (c->gradient_clipping != 0 && !st->has_error("gradient_clipping")) {
    std::ostringstream v;
    v << c->gradient_clipping;
    st->error(key, why + "set gradient_clipping to 0 (it is " + v.str() +
                       "; clipping scales every update by the step's global norm), or keep the accumulators");
  } else if (c->fp16.enabled) {
    st->error(key, why +
                       "fp16's loss scaling skips a step whose gradients overflow, which needs every gradient "
                       "first: use bf16 or fp32, or keep the accumulators");
  } else if (c->bf16.enabled && c->bf16.check_grad_overflow) {
    st->error(key, why +
                       "set bf16.check_grad_overflow to false (it skips a step whose gradients overflow, which "
                       "needs every gradient first), or keep the accumulators");
  } else if (c->gradient_accumulation_steps > 1 && c->zoffload.schedule != "vertical") {
    st->error(key, why + "gradient_accumulation_steps is " + std::to_string(c->gradient_accumulation_steps) +
                       " with the horizontal schedule, so a gradient is final only after the last micro-batch: set "
                       "zoffload.schedule to \"vertical\" (the device sums the micro-batches) or use GAS 1");
  } else if (ctx.world_size > 1 && c->zero.stage < 2 && !st->has_error("zero_optimization.stage")) {
    st->error(key, why + "with " + std::to_string(ctx.world_size) +
                       " ranks each sub-group's gradient must be reduced to its owner as it lands, which needs "
                       "zero_optimization.stage 2 or 3 (it is " +
                       std::to_string(c->zero.stage) + "); or keep the accumulators");
  } else if (ctx.world_size > 1 && c->zoffload.loss_normalization == "tokens") {
    st->error(key, why +
                       "zoffload.loss_normalization \"tokens\" divides by the labelled tokens of every rank, "
                       "which are summed only after backward with " +
                       std::to_string(ctx.world_size) +
                       " ranks: use \"micro_batch\", one rank, or keep the accumulators");
  }
}

}  // namespace

void resolve_config(ParseState* st, const ResolveContext& ctx, const json& root, Config* c) {
  Resolver r{.st = st, .ctx = ctx, .root = root, .c = c};
  r.model_size_buckets();
  r.precision();
  r.optimizer_hyperparameters();
  r.scheduler();
  r.batch_sizes();
  r.grad_accum_dtype();
  r.offload_placement();  // it stops early when the stage itself is invalid
  r.gradient_store_dtype();
  r.no_accumulator();
}

}  // namespace zo::engine::detail

#include "engine/config/config.h"

#include <algorithm>
#include <cctype>
#include <cstring>
#include <set>
#include <sstream>
#include <span>
#include <tuple>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/log.h"
#include "common/string_util.h"
#include "engine/config/config_schema.h"
#include "engine/config/json_reader.h"
#include "io/env.h"

namespace zo::engine {

using detail::AutoOk;
using detail::json_at;
using detail::kMaxFloat;
using detail::NoEffectValue;
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

DType Config::grad_store_dtype() const {
  const std::string& d = zoffload.gradient_store_dtype;
  if (d == "bf16") return DType::kBF16;
  if (d == "fp16") return DType::kF16;
  if (d == "fp32") return DType::kF32;
  return grad_accum_dtype;  // "auto"
}

namespace {

// ---- reading: JSON → structs through the key table, "auto" recorded in ParseState::autos ---------

// Why no file system takes `path`, or "": Linux's PATH_MAX (4096 bytes with its NUL) and NAME_MAX
// (255 bytes a component), and the NUL byte, which ends a path in every system call.
std::string unusable_path(std::string_view path) {
  if (path.find('\0') != std::string_view::npos) return "holds a NUL byte, which no path may";
  if (path.size() >= 4096)
    return "is " + std::to_string(path.size()) + " bytes long; a path may have at most 4095";
  for (const std::string& part : split(path, '/'))
    if (part.size() > 255)
      return "has a component of " + std::to_string(part.size()) + " bytes; a file name may have at most 255";
  return "";
}

void read_optimizer(ParseState* st, ObjectReader r, OptimizerConfig* o);
void read_scheduler(ParseState* st, ObjectReader r, SchedulerConfig* s);

// The visitor of config_schema.h that reads: each key through its ObjectReader getter, each nested
// object through a child reader that is finished (unknown keys reported) when its keys are done.
class Reader {
 public:
  Reader(ParseState* st, ObjectReader root) : st_(st) { frames_.push_back({std::move(root), {}}); }

  void flag(std::string_view key, bool& out, AutoOk a = AutoOk::kNo) { note(key, top().boolean(key, &out, a)); }
  void count(std::string_view key, uint64_t& out, uint64_t min, AutoOk a = AutoOk::kNo) {
    note(key, top().count(key, &out, min, a));
  }
  void integer(std::string_view key, int& out, int min, int max) { note(key, top().integer(key, &out, min, max)); }
  void number(std::string_view key, double& out, detail::Range range, AutoOk a = AutoOk::kNo) {
    note(key, top().number(key, &out, range.min, range.max, range.min_exclusive, a));
  }
  // Every text key names a path: one no file system takes is refused here, quoted within bounds
  // (a 10 MB path was echoed twice by the error that found it later).
  void text(std::string_view key, std::string& out) {
    std::string value;
    if (!top().string(key, &value)) return note(key, false);
    if (const std::string why = unusable_path(value); !why.empty()) {
      st_->error(top().key_path(key), "\"" + bounded_name(value, 120) + "\" " + why);
      return note(key, false);
    }
    out = std::move(value);
    note(key, true);
  }
  void texts(std::string_view key, std::vector<std::string>& out) { note(key, top().string_list(key, &out)); }
  void bytes(std::string_view key, uint64_t& out) { note(key, top().size_bytes(key, &out)); }
  void choice(std::string_view key, std::string& out, std::span<const std::string_view> names, AutoOk a = AutoOk::kNo) {
    note(key, top().choice(key, names, &out, a));
  }
  template <class E, size_t N>
  void choice(std::string_view key, E& out, const std::array<detail::Named<E>, N>& names, AutoOk a = AutoOk::kNo) {
    std::array<std::string_view, N> choices;
    for (size_t i = 0; i < N; ++i) choices[i] = names[i].name;
    std::string name;
    if (!top().choice(key, choices, &name, a)) return;
    for (const detail::Named<E>& n : names)
      if (n.name == name) out = n.value;
    note(key, true);
  }
  template <class Fn>
  void object(std::string_view key, Fn&& visit_keys) {
    ObjectReader child = top().child(key);
    frames_.push_back({std::move(child), {}});
    visit_keys();
    top().finish();
    frames_.pop_back();
  }
  // The optimizer and scheduler blocks are read only when present: their "type" is required.
  void custom(std::string_view key, OptimizerConfig& o) {
    if (top().has(key)) read_optimizer(st_, top().child(key), &o);
    else top().child(key);  // records the key as known
  }
  void custom(std::string_view key, SchedulerConfig& s) {
    if (top().has(key)) read_scheduler(st_, top().child(key), &s);
    else top().child(key);
  }
  void alias(std::string_view old_key, std::string_view new_key, bool deprecated) {
    top().alias(old_key, new_key, deprecated);
  }
  void legacy(std::string_view, std::string_view) {}  // read by the rule beside it
  void no_effect(std::string_view key, std::string_view why, NoEffectValue value = NoEffectValue::kAny) {
    top().accept_without_effect(key, why, value);
  }
  template <class Fn>
  void rule(Fn&& check) {
    check(detail::ReadContext{top(), st_, frames_.back().valid});
  }

  ObjectReader& top() { return frames_.back().reader; }

 private:
  struct Frame {
    ObjectReader reader;
    std::set<std::string> valid;  // keys read with a valid value
  };
  void note(std::string_view key, bool valid) {
    if (valid) frames_.back().valid.insert(std::string(key));
  }

  ParseState* st_;
  std::vector<Frame> frames_;
};

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
    if (p.boolean("amsgrad", &amsgrad) && amsgrad)
      st->error(p.key_path("amsgrad"), "AMSGrad is not supported; use false");
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

// ---- resolution of "auto" and cross-key rules -----------------------------------------------------

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

void resolve(ParseState* st, const ResolveContext& ctx, const json& root, Config* c) {
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

// Note [JSON pre-scan]
// One pass over the text before nlohmann parses it refuses what that parse would mishandle:
// - nesting deeper than kMaxConfigDepth. The duplicate-key callback below keeps each open object's
//   dotted path, so memory grew with the square of the depth: a 1.2 MB file nested 100 000 deep
//   took 10 GB and 22 s, or aborted on std::bad_alloc (issue 40).
// - a number literal that underflows: nlohmann reads 1e-400 as 0, silently another value. The
//   scan follows the key path, so the error names the key.
// It knows strings (brackets, quotes and digits inside them do not count) and leaves every other
// malformation to nlohmann, which reports it with its place. Returns false after reporting.
bool prescan_json_text(std::string_view text, ConfigDiagnostics* diag) {
  struct Level {
    bool object;
    std::string key;   // in an object: the key last read (as bounded_name shows it)
    size_t index = 0;  // in an array: the element being read
  };
  std::vector<Level> open;
  bool key_next = false;  // in an object, after '{' or ',': the next string is a key
  auto path = [&] {
    std::string p;
    for (const Level& l : open) p += l.object ? (p.empty() ? "" : ".") + l.key : "[" + std::to_string(l.index) + "]";
    return p;
  };
  bool ok = true;
  constexpr uint64_t kMaxReported = 20;
  uint64_t underflows = 0;
  for (size_t i = 0; i < text.size();) {
    const char c = text[i];
    if (c == '"') {
      size_t end = i + 1;
      while (end < text.size() && text[end] != '"') end += text[end] == '\\' ? 2 : 1;
      if (end >= text.size()) break;  // unterminated
      if (key_next && !open.empty() && open.back().object)
        open.back().key = bounded_name(text.substr(i + 1, end - i - 1));
      key_next = false;
      i = end + 1;
    } else if (c == '{' || c == '[') {
      if (open.size() == kMaxConfigDepth) {
        diag->errors.push_back({"", "invalid JSON (" + line_col(text, i) + "): nested deeper than " +
                                        std::to_string(kMaxConfigDepth) + " levels"});
        return false;
      }
      open.push_back({c == '{', "", 0});
      key_next = c == '{';
      ++i;
    } else if (c == '}' || c == ']') {
      if (!open.empty()) open.pop_back();
      key_next = false;
      ++i;
    } else if (c == ',') {
      if (!open.empty() && open.back().object) key_next = true;
      else if (!open.empty()) ++open.back().index;
      ++i;
    } else if (c == '-' || std::isdigit(static_cast<unsigned char>(c))) {
      size_t end = i;
      while (end < text.size() &&
             (std::isdigit(static_cast<unsigned char>(text[end])) || std::strchr(".eE+-", text[end]) != nullptr))
        ++end;
      const std::string_view number = text.substr(i, end - i);
      if (std::string why = detail::underflow_reason(number); !why.empty()) {
        // A file of a million such numbers is reported in a screenful.
        if (++underflows <= kMaxReported)
          diag->errors.push_back({path(), quote_excerpt(number, 40) + " is not representable (" + why + ")"});
        ok = false;
      }
      i = end;
    } else {
      ++i;
    }
  }
  if (underflows > kMaxReported)
    diag->errors.push_back({"", "and " + std::to_string(underflows - kMaxReported) + " more numbers that underflow"});
  return ok;
}

std::optional<json> parse_json_text(std::string_view text, ConfigDiagnostics* diag) {
  if (!prescan_json_text(text, diag)) return std::nullopt;
  // Track keys per open object to reject duplicates, which nlohmann would silently collapse.
  std::vector<std::pair<std::string, std::set<std::string>>> stack;  // (object path, keys seen)
  std::string last_key;
  bool duplicate = false;
  auto cb = [&](int depth, json::parse_event_t event, json& parsed) -> bool {
    (void)depth;
    switch (event) {
      case json::parse_event_t::object_start: {
        std::string path =
            stack.empty() ? "" : (stack.back().first.empty() ? last_key : stack.back().first + "." + last_key);
        stack.push_back({path, {}});
        break;
      }
      case json::parse_event_t::object_end:
        if (!stack.empty()) stack.pop_back();
        break;
      case json::parse_event_t::key: {
        // Paths hold keys as errors show them (a 10 MB key is an excerpt); the set, whole keys.
        const std::string& key = parsed.get_ref<const std::string&>();
        last_key = bounded_name(key);
        if (!stack.empty() && !stack.back().second.insert(key).second) {
          const std::string& base = stack.back().first;
          diag->errors.push_back({base.empty() ? last_key : base + "." + last_key, "duplicate key"});
          duplicate = true;
        }
        break;
      }
      default: break;
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
  Reader reader(&st, ObjectReader(&st, &root, ""));
  detail::keys(reader, c);
  reader.top().finish();

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
    // The message leaves the path out: callers print it before each error, and once is enough
    // (issue 40: a 10 MB path came out twice on one line).
    const Status& st = text.status();
    std::string message;
    if (st.code() == StatusCode::kNotFound) {
      message = std::string("cannot open config file: ") + std::strerror(ENOENT);
    } else if (st.sys_errno() != 0) {
      message = std::string("cannot read config file: ") + std::strerror(st.sys_errno());
    } else {  // "config file PATH is a FIFO (named pipe), ...", "config file PATH is N bytes, over ..."
      message = st.message();
      const std::string named = "config file " + path;
      if (const size_t at = message.find(named); at != std::string::npos)
        message.replace(at, named.size(), "config file");
    }
    diag->errors.push_back({"", message});
    return std::nullopt;
  }
  return parse_config(*text, ctx, diag);
}

Result<Config> load_config(const std::string& path, const ResolveContext& ctx) {
  ConfigDiagnostics diag;
  std::optional<Config> c = load_config_file(path, ctx, &diag);
  const std::string shown = bounded_name(path);
  for (const ConfigIssue& w : diag.warnings) ZO_LOG(kWarn) << shown << ": " << w.to_string();
  if (c) return *c;
  std::string msg;
  for (const ConfigIssue& e : diag.errors) {
    if (!msg.empty()) msg += "\n";
    msg += shown + ": " + e.to_string();
  }
  return invalid_argument(msg);
}

}  // namespace zo::engine

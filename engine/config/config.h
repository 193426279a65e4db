// The training configuration: DeepSpeed's JSON keys (with DeepSpeed's defaults) plus zoffload's own
// keys under "zoffload", parsed strictly into typed structs, with "auto" resolved as Hugging Face
// Accelerate resolves it. Every key is documented in docs/config.md.
// Plain values; parsing is a pure function of its inputs (thread-safe).
#pragma once

#include <array>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "common/dtype.h"
#include "common/status.h"
#include "gpu/device.h"

namespace zo::engine {

// Element types and device kinds are the ones the rest of zoffload uses.
using gpu::DeviceKind;
using ::zo::DType;

enum class OffloadDevice { kNone, kCpu, kNvme };
enum class OptimizerType { kAdam, kAdamW, kAdagrad, kLion };
enum class SchedulerType { kNone, kWarmupLR, kWarmupDecayLR, kWarmupCosineLR };
enum class WarmupType { kLog, kLinear };

std::string_view to_string(OffloadDevice v);
std::string_view to_string(OptimizerType v);
std::string_view to_string(SchedulerType v);
std::string_view to_string(WarmupType v);

inline constexpr uint64_t kUnlimited = std::numeric_limits<uint64_t>::max();

// zero_optimization.offload_param. Counts are in elements, as in DeepSpeed.
struct OffloadParamConfig {
  OffloadDevice device = OffloadDevice::kNone;
  std::string nvme_path;
  uint64_t buffer_count = 5;
  uint64_t buffer_size = 100'000'000;
  uint64_t max_in_cpu = 1'000'000'000;
  bool pin_memory = true;
};

// zero_optimization.offload_optimizer.
struct OffloadOptimizerConfig {
  OffloadDevice device = OffloadDevice::kNone;
  std::string nvme_path;
  uint64_t buffer_count = 4;
  bool pin_memory = true;
  bool pipeline_read = false;
  bool pipeline_write = false;
  double ratio = 1.0;
};

// zero_optimization. Sizes and thresholds count elements.
struct ZeroConfig {
  int stage = 0;
  uint64_t reduce_bucket_size = 500'000'000;
  uint64_t allgather_bucket_size = 500'000'000;
  uint64_t sub_group_size = 1'000'000'000;
  uint64_t stage3_prefetch_bucket_size = 50'000'000;
  uint64_t stage3_param_persistence_threshold = 100'000;
  uint64_t stage3_max_live_parameters = 1'000'000'000;
  uint64_t stage3_max_reuse_distance = 1'000'000'000;
  bool stage3_gather_16bit_weights_on_model_save = false;
  uint64_t zero_hpz_partition_size = 1;
  bool zero_quantized_weights = false;
  bool zero_quantized_gradients = false;
  OffloadParamConfig offload_param;
  OffloadOptimizerConfig offload_optimizer;
};

// aio: settings of the NVMe I/O engine (io/).
struct AioConfig {
  uint64_t block_size = 1'048'576;  // bytes
  uint64_t queue_depth = 8;
  uint64_t intra_op_parallelism = 1;
  bool single_submit = false;
  bool overlap_events = true;
  bool use_gds = false;  // accepted; GPUDirect Storage is not available in zoffload
};

struct Fp16Config {
  bool enabled = false;
  bool auto_cast = false;
  double loss_scale = 0;  // 0 = dynamic
  int initial_scale_power = 16;
  uint64_t loss_scale_window = 1000;
  uint64_t hysteresis = 2;
  bool consecutive_hysteresis = false;
  double min_loss_scale = 1;
};

struct Bf16Config {
  bool enabled = false;
  bool check_grad_overflow = true;
  // DeepSpeed's: Adam's moments in bf16 (resolved into zoffload.moment_dtype "bf16"), and bf16
  // master weights and gradients (not built: refused when true).
  bool bf16_optimizer_states = false;
  bool bf16_master_weights_and_grads = false;
};

// optimizer: {"type", "params"}. Defaults depend on the type (see docs/config.md).
struct OptimizerConfig {
  OptimizerType type = OptimizerType::kAdamW;
  double lr = 1e-3;
  std::array<double, 2> betas = {0.9, 0.999};
  double eps = 1e-8;
  double weight_decay = 0;
  bool adam_w_mode = true;               // Adam/AdamW: decoupled weight decay
  bool bias_correction = true;           // Adam/AdamW
  double initial_accumulator_value = 0;  // Adagrad
};

struct SchedulerConfig {
  SchedulerType type = SchedulerType::kNone;
  double warmup_min_lr = 0;     // WarmupLR, WarmupDecayLR
  double warmup_max_lr = 1e-3;  // WarmupLR, WarmupDecayLR (resolved: optimizer lr)
  uint64_t warmup_num_steps = 1000;
  WarmupType warmup_type = WarmupType::kLog;
  uint64_t total_num_steps = 0;  // WarmupDecayLR, WarmupCosineLR
  double warmup_min_ratio = 0;   // WarmupCosineLR
  double cos_min_ratio = 1e-4;   // WarmupCosineLR
};

// tensorboard, csv_monitor: DeepSpeed's monitors (engine/monitor). Files go to
// output_path/job_name; output_path is relative to the run directory ("": the run directory).
struct MonitorConfig {
  bool enabled = false;
  std::string output_path;
  std::string job_name = "DeepSpeedJobName";
};

struct CheckpointConfig {
  std::string dir;                              // empty: no periodic checkpoints
  uint64_t every_steps = 0;                     // 0: only at the end (when dir is set)
  uint64_t keep_last = 2;                       // 0: keep all
  uint64_t staging_buffer_size = 256ull << 20;  // bytes
};

struct LogConfig {
  std::string metrics_path;  // JSONL, one record per step; empty: none
};

// (addition) The order the training data is read in (engine/data/dataset.h).
struct DataConfig {
  bool shuffle = true;  // each epoch in its own seeded order; false: file order every epoch
};

// (addition) LoRA adapters over a frozen base, as PEFT's LoraConfig names them (Note [LoRA
// adapters] in engine/model/param_selection.cpp). Off while r is 0 and init_from empty.
struct LoraConfig {
  uint64_t r = 0;  // the rank; 0: no adapters (unless init_from names a directory, whose r applies)
  double lora_alpha = 8;
  // PEFT's names (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj; qkv_proj and
  // gate_up_proj for phi3) or "all-linear"; empty: PEFT's default for the family (q_proj and
  // v_proj; phi3's qkv_proj).
  std::vector<std::string> target_modules;
  bool use_rslora = false;  // scale by lora_alpha / √r instead of lora_alpha / r
  double lora_dropout = 0;  // must be 0: zoffload's adapters have no dropout
  // A PEFT adapter directory (adapter_config.json, adapter_model.safetensors) to start from: its
  // r, lora_alpha, target_modules and use_rslora apply (the keys above, when given, must agree).
  std::string init_from;
  // Which of the keys above the file gave (set while reading; not keys themselves): next to
  // init_from an explicit lora_alpha or use_rslora must agree with the adapter's, and an explicit
  // lora_dropout 0 trains an adapter saved with dropout without it.
  bool lora_alpha_given = false, use_rslora_given = false, lora_dropout_given = false;
  bool enabled() const { return r > 0 || !init_from.empty(); }
};

// The "zoffload" block: what DeepSpeed has no key for.
struct ZoffloadConfig {
  DeviceKind device = DeviceKind::kAuto;
  uint64_t gpu_memory_limit = 0;     // bytes; 0: what the device has
  uint64_t pinned_memory_limit = 0;  // bytes; 0: sized from the plan, capped by RAM and ulimit -l
  uint64_t optimizer_threads =
      0;  // CPU optimizer threads; 0: one per CPU this process may run on (oneTBB's default concurrency: logical CPUs)
  bool bind_cores = false;  // pin optimizer threads to cores (hwloc)
  // (addition) Run each optimizer step beside the next step's first forward (Note [Overlapped
  // optimizer]); false: after the backward, on the training thread. Bit-identical either way.
  bool overlap_optimizer = true;
  // (addition) With the optimizer states on NVMe: buffers beyond the pipeline's, so that the first
  // 1 + pipeline_read + pipeline_write + this many sub-groups' states are read while the step's
  // forward and backward run, not after them (Note [Reading the states ahead]). 0: the pipeline's
  // buffers only (they read ahead too).
  uint64_t optimizer_read_ahead = 0;
  // (addition) Gradient accumulation order: "horizontal" runs each micro-batch through every block;
  // "vertical" runs every micro-batch of a step through a block before the next block, so each
  // block is fetched once per step and its gradients leave the device once (Note [Vertical schedule]).
  std::string schedule = "horizontal";
  // (addition) Where the activation checkpoints (each decoder layer's input) wait between forward
  // and backward: "device"; "cpu" (pinned host memory: copied out after the layer's forward and
  // back one layer ahead of its backward, on a copy stream); "auto": cpu when the plan does not fit
  // the GPU with them on it but fits with them on the CPU, else device (Note [Checkpoints on the CPU]).
  std::string activation_checkpoints = "auto";
  // (addition) Where the gradient accumulators live when the optimizer is offloaded: "cpu"
  // (ordinary RAM, accumulated in place), "nvme" (a section of the optimizer swap file under
  // offload_optimizer.nvme_path, read back by the optimizer step), or "auto": with the optimizer
  // states, except that with the optimizer on NVMe they stay in RAM when the planner finds room
  // (Note [Where the gradients wait]).
  std::string gradient_accumulators = "auto";
  // (addition) How Adam keeps exp_avg and exp_avg_sq: "fp32"; "8bit": bitsandbytes' AdamW8bit
  // blockwise states (a byte per element plus one fp32 absmax per 256), fp32 for parameters under
  // 4096 elements (Note [8-bit moment layout] in engine/memory/moment_layout.cpp); or "bf16" (also
  // what DeepSpeed's bf16.bf16_optimizer_states asks for).
  std::string moment_dtype = "fp32";
  // (addition) The dtype the host keeps each step's gradient sum in until the optimizer reads it:
  // "auto" resolves to data_types.grad_accum_dtype (the sums as they were added); "bf16" with fp32
  // sums rounds each final fp32 sum to bf16 after its squared norm is taken, so the norm, clipping
  // and the overflow check are the fp32 gradient's (Note [Gradients stored in 16 bits] in
  // engine/coord/grad_accumulator.cpp). Needs one sum per step on the host: GAS 1 or the vertical
  // schedule.
  std::string gradient_store_dtype = "auto";
  // (addition) The dtype of the masters the optimizer updates: "fp32", or "bf16": no fp32 copy, each
  // update computed in fp32 and stored with seeded stochastic rounding (torchao's
  // bf16_stochastic_round rule; Note [Stochastic rounding to bf16] in common/half.h), the new
  // compute copy its bits. Needs bf16 compute (bf16.enabled) and the optimizer offloaded.
  std::string master_dtype = "fp32";
  std::string io_backend = "auto";  // auto | io_uring | libaio | psync (the aio block tunes it)
  // (addition) How a step's loss averages its tokens (Note [Loss normalisation] in
  // engine/train/step.cpp): "micro_batch" weighs each micro-batch's mean token loss equally, as
  // DeepSpeed's engine does; "tokens" divides the step's summed token losses by its labelled tokens,
  // over every micro-batch and rank, as transformers' Trainer does (num_items_in_batch).
  std::string loss_normalization = "micro_batch";
  // (addition) Parameters that are not trained, by Hugging Face name: glob patterns ("*" any run of
  // characters, "?" one, "{a..b}" a decimal in [a, b]) matched against the whole name, e.g.
  // "model.embed_tokens.weight" or "model.layers.{0..7}.*". A frozen parameter is fetched for the
  // forward and never updated: no master, moments, accumulator or gradient (Note [Frozen
  // sub-groups] in engine/memory/param_registry.cpp). Each pattern must match a parameter.
  std::vector<std::string> freeze;
  LoraConfig lora;
  // (addition) QLoRA from a 16-bit directory: "nf4" or "fp4" quantizes each decoder projection of
  // the frozen base at load as transformers' BitsAndBytesConfig(load_in_4bit=True,
  // bnb_4bit_quant_type=..., blocksize 64, no double quantization) does (common/bnb4bit.h), and
  // trains the adapters over the weights read back from it; "none": the base as it is. Needs
  // zoffload.lora.
  std::string quantize_base = "none";
  DataConfig data;
  CheckpointConfig checkpoint;
  LogConfig log;
};

struct Config {
  ZeroConfig zero;
  AioConfig aio;
  Fp16Config fp16;
  Bf16Config bf16;
  DType grad_accum_dtype = DType::kF32;
  double gradient_clipping = 1.0;  // 0 disables
  uint64_t gradient_accumulation_steps = 1;
  uint64_t train_micro_batch_size_per_gpu = 1;
  uint64_t train_batch_size = 1;
  OptimizerConfig optimizer;
  SchedulerConfig scheduler;
  uint64_t steps_per_print = 10;
  bool wall_clock_breakdown = false;
  MonitorConfig tensorboard;
  MonitorConfig csv_monitor;
  ZoffloadConfig zoffload;

  // The dtype the model computes in: bf16, fp16 or fp32.
  DType compute_dtype() const;
  // The dtype the gradient accumulators are stored in (zoffload.gradient_store_dtype, resolved):
  // grad_accum_dtype, or bf16 when fp32 sums are stored rounded.
  DType grad_store_dtype() const;
};

// What "auto" values resolve from: the model and the command line. Anything unset that an "auto"
// needs is an error naming the value (and the flag that gives it).
struct ResolveContext {
  std::optional<uint64_t> hidden_size;                  // from the model (--hidden-size, --model)
  std::optional<uint64_t> micro_batch_size;             // --micro-batch
  std::optional<uint64_t> gradient_accumulation_steps;  // --grad-accum
  uint64_t world_size = 1;
  std::optional<double> lr;              // --lr
  std::optional<double> weight_decay;    // --weight-decay
  std::optional<double> max_grad_norm;   // --max-grad-norm
  std::optional<uint64_t> warmup_steps;  // --warmup-steps
  std::optional<uint64_t> total_steps;   // --steps
  std::optional<DType> mixed_precision;  // --precision bf16|fp16|fp32
};

// One problem found in a config, located by its key path ("zero_optimization.offload_param.device").
struct ConfigIssue {
  std::string path;
  std::string message;
  std::string to_string() const { return path.empty() ? message : path + ": " + message; }
};

struct ConfigDiagnostics {
  std::vector<ConfigIssue> errors;    // the config is unusable if any
  std::vector<ConfigIssue> warnings;  // deprecated aliases, keys with no effect here
};

// Parses and validates JSON text. Returns the resolved config, or nullopt with every error found
// in `diag->errors` (all of them, not only the first). Warnings go to `diag->warnings`.
// Text nested deeper than kMaxConfigDepth, or holding a number literal that underflows ("1e-400"
// would read as 0), is refused before it is parsed, with no other error.
std::optional<Config> parse_config(std::string_view json_text, const ResolveContext& ctx, ConfigDiagnostics* diag);
std::optional<Config> parse_config_json(const nlohmann::json& json, const ResolveContext& ctx, ConfigDiagnostics* diag);

// Objects and arrays a config may nest, counting the outermost object as 1. DeepSpeed's configs
// nest 3 or 4 deep (optimizer.params.betas); the cap keeps a hostile 100 000-deep file from
// costing gigabytes in the parse (issue 40).
inline constexpr size_t kMaxConfigDepth = 64;

// Reads `path` (a regular file of at most kMaxConfigFileBytes) and parses it; an unreadable file is
// one error with an empty key path, whose message does not repeat `path` ("cannot open config
// file: No such file or directory"): callers print the path before each error.
inline constexpr uint64_t kMaxConfigFileBytes = 64ull << 20;
std::optional<Config> load_config_file(const std::string& path, const ResolveContext& ctx, ConfigDiagnostics* diag);

// Convenience for callers that only need pass/fail: logs warnings, returns all errors joined in one
// kInvalidArgument Status ("FILE: path: message" lines, FILE as bounded_name shows it).
Result<Config> load_config(const std::string& path, const ResolveContext& ctx);

// The fully resolved config as DeepSpeed-style JSON (every default filled in, no "auto").
nlohmann::json to_json(const Config& config);

// Every key the config reads, from the one table that reads and writes them (config_schema.h):
// what `zoffload config keys` prints and what tests check docs/config.md against.
struct ConfigKey {
  std::string path;          // "zero_optimization.offload_param.buffer_count"
  std::string type;          // "count ≥ 1", "one of none|cpu|nvme", "byte size", …
  std::string default_json;  // the default as JSON text ("5", "\"none\"", "true"), before resolution
  bool auto_ok = false;      // whether "auto" is accepted
};
struct ConfigAlias {
  std::string path;      // the other name ("aio.thread_count")
  std::string reads_as;  // the key it is read as ("aio.intra_op_parallelism"), or for a legacy key what it sets
  bool deprecated = false;
};
struct ConfigNoEffect {
  std::string path;  // a DeepSpeed key accepted with a warning ("tensorboard")
  std::string why;
};
struct ConfigKeyList {
  std::vector<ConfigKey> keys;  // in reading order; `optimizer` and `scheduler` as one entry each
  std::vector<ConfigAlias> aliases;
  std::vector<ConfigNoEffect> no_effect;
};
ConfigKeyList config_keys();

// The demo config compiled into the binary (configs/tiny_demo_nvme.json).
std::string_view embedded_demo_config();

}  // namespace zo::engine

// ModelConfig: the shape of a LLaMA-shaped model (llama, mistral, qwen2, qwen3, olmo2, gemma3_text,
// phi3) read from a Hugging Face config.json or a built-in preset, and ModelLayout: its parameters
// (HF names, HF shapes) and the blocks forward runs, in order. No LibTorch. Pure values and functions; thread-safe.
#pragma once

#include <cmath>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "io/env.h"
#include "common/param_spec.h"

namespace zo::engine {

enum class RopeScalingType : uint8_t { kNone, kLinear, kLlama3, kLongRope };

struct RopeScaling {
  RopeScalingType type = RopeScalingType::kNone;
  double factor = 1.0;                               // longrope: 0 = max_position_embeddings / original
  double low_freq_factor = 1.0;                      // llama3 only
  double high_freq_factor = 4.0;                     // llama3 only
  uint64_t original_max_position_embeddings = 8192;  // llama3 and longrope
  // longrope (Phi-3): the per-frequency divisors for rows up to original_max_position_embeddings
  // (short) and longer (long), rotary_dim / 2 each, and the factor cos and sin are scaled by (0: from
  // `factor`, as transformers derives it).
  std::vector<double> short_factor, long_factor;
  double attention_factor = 0;
};

// How a family's decoder block normalizes (Note [Model families]).
enum class NormPlacement : uint8_t {
  kPre,       // llama: h = x + attn(norm(x)); h + mlp(norm(h))
  kPost,      // OLMo 2: h = x + norm(attn(x)); h + norm(mlp(h))
  kSandwich,  // Gemma 3: h = x + norm(attn(norm(x))); h + norm(mlp(norm(h)))
};
// How an RMSNorm applies its weight to x normalized in fp32 (every norm of the model, the final one too).
enum class NormScale : uint8_t {
  kCastThenScale,  // llama: weight * x̂.to(dtype)
  kScaleInFp32,    // OLMo 2: (weight * x̂).to(dtype), the product in fp32
  kOnePlusInFp32,  // Gemma 3: (x̂ * (1 + weight)).to(dtype) in fp32; the weight starts at 0
};
enum class QkNorm : uint8_t {
  kNone,
  kPerHead,  // Qwen3: RMSNorm over each head's dims after the head split, weight [head_dim]
  kWhole,    // OLMo 2: RMSNorm over the whole projection before the split, weight [heads · head_dim]
};
// The MLP's gate activation, config.json's hidden_act (or Gemma's hidden_activation).
enum class MlpActivation : uint8_t {
  kSilu,      // "silu"
  kGeluTanh,  // "gelu_pytorch_tanh": GELU with the tanh approximation
};

// The config.json keys a family's config class has and no other family's does (hf_config.cpp
// reads them after the keys every family shares, and to_hf_config_json writes them back).
enum class FamilyKeys : uint8_t {
  kNone,
  kGemma3Text,  // Gemma3TextConfig's: hidden_activation, query_pre_attn_scalar, layer_types or a sliding
                // pattern, per-layer-type RoPE (rope_local_base_freq), logit soft-capping; rope_theta 1e6
                // and tied embeddings by default
  kPhi3,        // Phi3Config's: resid_pdrop/embd_pdrop (0 only), a window over every layer
};

// Note [Model families]: the families differ from llama by a few choices of the one decoder block
// (engine/model/decoder.cpp) and of the config keys that say so; each is a row here, looked up by
// config.json's model_type, whose fields name those choices (a field left out is llama's choice).
// decoder_params() turns a row into the block's parameters (HF names, shapes, the role each plays),
// which the layout, the weights and block_forward all read; the next family that is llama-shaped is
// a row (and its parity case). Keys of a family's own config class (own_keys) are read by a reader of
// their own in hf_config.cpp into ModelConfig fields that block_forward reads as it reads the
// others.
struct ModelFamily {
  const char* model_type = nullptr;
  const char* architecture = nullptr;  // the *ForCausalLM class transformers saves and loads
  bool qkv_bias = false;           // q/k/v projections always carry biases (Qwen2); else attention_bias must be false
  QkNorm qk_norm = QkNorm::kNone;  // q_norm, k_norm
  NormPlacement norms = NormPlacement::kPre;         // where the block's norms sit
  NormScale norm_scale = NormScale::kCastThenScale;  // how a norm's weight scales
  bool rope_in_fp32 = false;  // q, k rotated in fp32 and cast back (OLMo 2); else the tables are cast to q's dtype
  // q, k and v one projection (qkv_proj), gate and up one (gate_up_proj), stored, adapted and sliced
  // as Phi-3 does.
  bool fused_projections = false;
  // RoPE over part of the head (partial_rotary_factor, top level or in the RoPE dict) and the
  // longrope type (also under its old names su and yarn), as Phi-3 reads them; else the factor must
  // be 1 and longrope is refused.
  bool partial_longrope = false;
  bool window = false;                // a sliding window: mistral's always, Qwen's with use_sliding_window
  bool window_opt_in = false;         // the window applies only with use_sliding_window (and layer_types names it)
  bool mlp_bias_key = false;          // config.json has mlp_bias (llama, mistral), which must be false
  uint64_t default_head_dim = 0;      // head_dim where config.json has none (Qwen3Config's 128); 0: hidden / heads
  int64_t default_pad_token_id = -1;  // pad_token_id where config.json has none (Olmo2Config's 1); -1: none
  FamilyKeys own_keys = FamilyKeys::kNone;
};
// The rows, in the order error messages list them.
const std::vector<ModelFamily>& model_families();
// The row of `model_type`, or nullptr.
const ModelFamily* find_model_family(std::string_view model_type);
// The rows' model_types in that order, joined by ", " ("llama, mistral, …"): what error messages
// and --help list.
std::string model_type_list();

enum class DecoderRole : uint8_t;  // below
struct ModelConfig;

// LoRA adapters on a model's projections (Note [LoRA adapters] in param_selection.cpp), as PEFT's
// LoraConfig describes them: rank r, lora_alpha, use_rslora, and the projection weights adapted.
struct LoraSpec {
  uint32_t r = 0;  // 0: none
  double alpha = 8;
  bool rslora = false;
  std::vector<DecoderRole> targets;  // weights: kQ, kK, kV, kO, kGate, kUp, kDown, kQkv, kGateUp
  // PEFT's scaling of B·A·x: alpha / r, or alpha / √r with rsLoRA.
  double scaling() const { return rslora ? alpha / std::sqrt(static_cast<double>(r)) : alpha / r; }
  bool adapts(DecoderRole role) const;
};
// PEFT's target_modules names ("q_proj", ..., "down_proj"; "qkv_proj", "gate_up_proj" for phi3; or
// "all-linear": every projection but the head) as `config`'s roles, in the family's order.
// kInvalidArgument naming `key` and the module for one this family does not have (phi3's fused
// q/k/v, say, with the name to use), or an empty list.
Result<std::vector<DecoderRole>> lora_targets(const ModelConfig& config, std::span<const std::string> modules,
                                              const std::string& key);
// PEFT's target_modules default for the family (q_proj and v_proj; phi3: qkv_proj), as PEFT picks
// it when a LoraConfig names none.
std::vector<std::string> default_lora_modules(const ModelConfig& config);
// The PEFT module name of a projection weight's role (kQ: "q_proj", ...; kQkv: "qkv_proj").
std::string_view lora_module_name(DecoderRole role);
// Whether `name` is a LoRA adapter's (….lora_A.weight or ….lora_B.weight).
bool is_lora_param(std::string_view name);

// A bitsandbytes checkpoint (config.json's quantization_config, quant_method "bitsandbytes"):
// load_in_4bit, its decoder projections stored as packed NF4/FP4 codes with their quantization
// state (Note [4-bit blocks] in common/bnb4bit.h), or load_in_8bit, stored as LLM.int8 int8 codes
// with each row's scale (`SCB`). A frozen projection stays packed (Note [The packed 4-bit base] in
// common/bnb4_blob.h); one trained in full is read back into the compute dtype. What transformers
// left unquantized (the embeddings, norms, the head, llm_int8_skip_modules) is stored as it is.
struct BnbQuantization {
  bool load_in_4bit = false;
  bool load_in_8bit = false;
  std::string quant_type = "nf4";         // bnb_4bit_quant_type, informational: each tensor's state says
  bool double_quant = false;              // bnb_4bit_use_double_quant, informational likewise
  std::vector<std::string> skip_modules;  // llm_int8_skip_modules: modules left in 16 bits
  bool quantized() const { return load_in_4bit || load_in_8bit; }
  // "4-bit" or "8-bit", for messages.
  const char* bits_name() const { return load_in_8bit ? "8-bit" : "4-bit"; }
};

// Whether transformers leaves `name` unquantized in a bitsandbytes checkpoint: what is not a decoder
// projection (embeddings, norms, the head), and any module whose name holds an entry of
// llm_int8_skip_modules (transformers' substring test).
bool kept_in_16_bits(std::string_view name, const BnbQuantization& quantization);

struct ModelConfig {
  std::string model_type = "llama";  // a ModelFamily's (qwen2 => attention_bias true)
  uint64_t vocab_size = 0, hidden_size = 0, intermediate_size = 0, num_hidden_layers = 0, num_attention_heads = 0,
           num_key_value_heads = 0, head_dim = 0 /*resolved: hidden/heads when absent*/, max_position_embeddings = 2048;
  double rms_norm_eps = 1e-6, rope_theta = 10000.0, initializer_range = 0.02;
  RopeScaling rope_scaling;
  bool tie_word_embeddings = false;
  bool attention_bias = false;  // q/k/v projections have biases (Qwen2)
  MlpActivation activation = MlpActivation::kSilu;
  bool scale_embeddings = false;     // the embedding's output times √hidden_size rounded to the compute dtype (Gemma)
  double query_pre_attn_scalar = 0;  // Gemma: q·k is scaled by its ^-1/2; 0: by head_dim^-1/2
  double final_logit_softcap = 0;    // logits = cap · tanh(logits / cap) in the compute dtype; 0: none
  // transformers' nn.Embedding padding_idx: the lookup adds no gradient to this row (the head's
  // use of a tied matrix still does); -1: none.
  int64_t pad_token_id = -1;
  // config.json's bos_token_id and eos_token_id as written (a token id, a list of them — Llama 3.1
  // ends on any of three — or null), kept so an export's config.json generates as the source's
  // did; empty when absent. They do not change training.
  std::string bos_token_id_json, eos_token_id_json;
  std::string source_dtype = "float32";  // config.json "torch_dtype", informational
  // Mistral's (or Qwen2's, when use_sliding_window) attention window in tokens; 0 = full causal.
  // Without sliding_layers, block_forward runs full causal attention and refuses sequences longer
  // than a set window.
  uint64_t sliding_window = 0;
  // Gemma 3 and Phi-3: per layer, whether it attends within the window (a query sees the
  // sliding_window keys up to itself), or to every earlier key. Empty for the other families.
  std::vector<bool> sliding_layers;
  // Gemma 3: the sliding layers rotate with this theta, unscaled; 0 (the others): every layer with
  // rope_theta and rope_scaling.
  double local_rope_theta = 0;
  // Phi-3: RoPE rotates the first int(head_dim · factor) dims of each head and passes the rest.
  double partial_rotary_factor = 1.0;
  int64_t rotary_dim() const { return static_cast<int64_t>(static_cast<double>(head_dim) * partial_rotary_factor); }
  // LoRA adapters on the decoder layers' projections, appended to each layer's params
  // (decoder_params); not part of config.json. Off by default.
  LoraSpec lora;
  // The checkpoint's bitsandbytes quantization, when it has one; an export writes the weights as
  // the run holds them, without it.
  BnbQuantization quantization;

  // The row of model_type (which must be one: parse_hf_config and model_preset only return those).
  const ModelFamily& family() const;
};

// Parses a Hugging Face config.json as transformers < 5 and ≥ 5 write it (rope_theta/rope_scaling or
// rope_parameters; torch_dtype or dtype). kInvalidArgument naming `source_name` and the key for a
// missing required key, a wrong type, a non-positive size, heads not dividing hidden (when head_dim
// is absent), num_attention_heads not a multiple of num_key_value_heads, and for every key that
// would change the arithmetic to something not implemented: model_type (a ModelFamily's),
// architectures (the *ForCausalLM of the model_type), RoPE type (default/linear/llama3),
// partial_rotary_factor ≠ 1, per-layer-type RoPE, hidden_act (silu), llama's attention_bias/mlp_bias,
// attention_dropout ≠ 0, a quantization_config other than bitsandbytes' 4-bit one (any key it does not
// know, 8-bit, a quant_storage other than uint8), use_mrope, Qwen2 layer_types, a pad_token_id outside
// the vocabulary. Other keys (bos/eos token ids, use_cache, ...) do not change training and are
// ignored. The audit is in docs/training.md.
Result<ModelConfig> parse_hf_config(std::string_view json_text, const std::string& source_name);
// Reads model_dir/config.json through `env` (at most kMaxModelConfigBytes); kNotFound naming the path.
inline constexpr uint64_t kMaxModelConfigBytes = 16ull << 20;
Result<ModelConfig> load_hf_config(const std::string& model_dir, io::Env* env);

// Built-in shapes for random init: "tiny" (byte-level vocab 256, hidden 256, intermediate 688,
// 4 layers, 8 heads, 4 kv heads, untied, max_position 1024), "tinyllama-1.1b", "llama3.2-1b" and
// "llama3.2-3b" (tied), "llama-7b" (Llama-2-7B), "llama3-8b" (Llama-3.1-8B: rope_theta 5e5, llama3
// rope scaling), "llama-13b" (Llama-2-13B), "llama-70b" (Llama-2-70B, GQA 8), "llama3-70b"
// (Llama-3.1-70B), and from their published config.json "qwen3-8b", "qwen3-32b", "gemma3-12b" and
// "gemma3-27b" (the text models), "phi4-mini" (Phi-4-mini-instruct), "olmo2-7b", "olmo2-13b"
// (OLMo-2-1124). kNotFound listing the names, with a close-match suggestion.
Result<ModelConfig> model_preset(std::string_view name);
std::vector<std::string> model_preset_names();
// The model a --model argument names: config.json of a Hugging Face model directory, or a preset.
// kNotFound naming both possibilities (and the presets) when it is neither.
Result<ModelConfig> resolve_model_config(const std::string& model, io::Env* env);

// HF config.json text for export (architectures: the family's *ForCausalLM, torch_dtype as given);
// parse_hf_config reads it back to `config`.
std::string to_hf_config_json(const ModelConfig& config, std::string_view torch_dtype);
uint64_t num_parameters(const ModelConfig& config);
// Whether the model computes sequences of `seq_len` tokens: at most max_position_embeddings, and,
// where one window covers every layer (mistral's, Qwen's use_sliding_window), at most the window,
// which block_forward does not apply. kInvalidArgument naming --seq-len and the config key.
Status check_seq_len(const ModelConfig& config, uint64_t seq_len);

enum class BlockKind : uint8_t { kEmbedding, kDecoder, kHead };

struct BlockSpec {
  BlockKind kind = BlockKind::kDecoder;
  int64_t layer = -1;            // decoder layer index; -1 otherwise
  std::string name;              // "model.embed_tokens", "model.layers.3", "model.norm+lm_head"
  std::vector<uint32_t> params;  // indices into ModelLayout::params, in the order block_forward takes them
};

struct ModelLayout {
  std::vector<ParamSpec>
      params;  // registration order: embed_tokens, layers 0..L-1, model.norm, lm_head (absent when tied)
  std::vector<BlockSpec> blocks;  // embedding, decoder 0..L-1, head — the order forward runs them
  BnbQuantization quantization;   // the config's: how load_hf_weights finds the weights stored
};

// What a decoder parameter is to the block (a family's norms play different roles under one name:
// llama's post_attention_layernorm is the norm before the MLP, OLMo 2's the norm after attention).
enum class DecoderRole : uint8_t {
  kInputNorm,  // before attention (kPre, kSandwich)
  kQ,
  kQBias,
  kK,
  kKBias,
  kV,
  kVBias,
  kO,
  kQNorm,
  kKNorm,
  kQkv,  // Phi-3's qkv_proj: the q, k and v rows one after the other

  kPostAttnNorm,  // after attention, before the residual add (kPost, kSandwich)
  kPreMlpNorm,    // before the MLP (kPre, kSandwich)
  kPostMlpNorm,   // after the MLP, before the residual add (kPost, kSandwich)
  kGate,
  kUp,
  kDown,
  kGateUp,  // Phi-3's gate_up_proj: the gate's rows, then up's
  kLoraA,   // a LoRA adapter's A [r, in] on DecoderParam::target (Note [LoRA adapters])
  kLoraB,   // its B [out, r]
  kCount
};
struct DecoderParam {
  DecoderRole role;
  std::string name;  // HF name after "model.layers.<i>."
  std::vector<int64_t> shape;
  DecoderRole target = DecoderRole::kCount;  // kLoraA/kLoraB: the projection weight adapted
};
// One decoder layer's parameters in the engine's order (block_forward takes them so). llama, mistral,
// qwen2, qwen3: input_layernorm, q_proj (weight, [bias]), k_proj, v_proj, o_proj, [q_norm, k_norm],
// post_attention_layernorm (the pre-MLP norm), gate_proj, up_proj, down_proj. OLMo 2 in its module order:
// q/k/v/o_proj, q_norm, k_norm, gate/up/down_proj, post_attention_layernorm, post_feedforward_layernorm.
// Gemma 3 likewise: ..., down_proj, input_layernorm, post_attention_layernorm, pre_feedforward_layernorm,
// post_feedforward_layernorm. Phi-3: input_layernorm, qkv_proj, o_proj, post_attention_layernorm,
// gate_up_proj, down_proj.
std::vector<DecoderParam> decoder_params(const ModelConfig& config);

// Layout: the embedding; per layer decoder_params with the "model.layers.<i>." prefix; the head block:
// model.norm.weight, then lm_head.weight — or model.embed_tokens.weight when tied (the embedding param
// is then used by two blocks). Shapes as HF stores them ([out, in] for Linear).
// `config` must be valid (as parse_hf_config / model_preset return it).
ModelLayout model_layout(const ModelConfig& config);

// Whether `name` matches the glob `pattern` whole: "*" any run of characters (dots too), "?" one
// character, "{a..b}" a decimal number in [a, b] (no sign, no leading zero), anything else itself.
// kInvalidArgument for a "{" that does not open "{a..b}" with a ≤ b.
Result<bool> name_matches(std::string_view pattern, std::string_view name);
// zoffload.freeze: marks the params of `layout` that some pattern matches frozen (ParamSpec::
// trainable false; Note [Frozen sub-groups] in engine/memory/param_registry.cpp). kInvalidArgument
// naming zoffload.freeze[i] for a malformed pattern or one that matches no param (with the closest
// name), and naming zoffload.freeze when every param would be frozen.
Status freeze_params(std::span<const std::string> patterns, ModelLayout* layout);

}  // namespace zo::engine

// The families' rows (Note [Model families]), the presets, a block's params and the layout. config.json
// in and out is hf_config.cpp; LoRA targets and freeze patterns, param_selection.cpp.
#include "engine/model/model_config.h"

#include <algorithm>
#include <cmath>
#include <span>
#include <utility>

#include <nlohmann/json.hpp>

#include "common/check.h"
#include "common/string_util.h"

namespace zo::engine {

const std::vector<ModelFamily>& model_families() {
  static const std::vector<ModelFamily> families = {
      {.model_type = "llama", .architecture = "LlamaForCausalLM", .mlp_bias_key = true},
      {.model_type = "mistral", .architecture = "MistralForCausalLM", .window = true, .mlp_bias_key = true},
      {.model_type = "qwen2",
       .architecture = "Qwen2ForCausalLM",
       .qkv_bias = true,
       .window = true,
       .window_opt_in = true},
      {.model_type = "qwen3",
       .architecture = "Qwen3ForCausalLM",
       .qk_norm = QkNorm::kPerHead,
       .window = true,
       .window_opt_in = true,
       .default_head_dim = 128},
      {.model_type = "olmo2",
       .architecture = "Olmo2ForCausalLM",
       .qk_norm = QkNorm::kWhole,
       .norms = NormPlacement::kPost,
       .norm_scale = NormScale::kScaleInFp32,
       .rope_in_fp32 = true,
       .default_pad_token_id = 1},
      {.model_type = "gemma3_text",
       .architecture = "Gemma3ForCausalLM",
       .qk_norm = QkNorm::kPerHead,
       .norms = NormPlacement::kSandwich,
       .norm_scale = NormScale::kOnePlusInFp32,
       .default_head_dim = 256,
       .default_pad_token_id = 0,
       .own_keys = FamilyKeys::kGemma3Text},
      {.model_type = "phi3",
       .architecture = "Phi3ForCausalLM",
       .fused_projections = true,
       .partial_longrope = true,
       .default_pad_token_id = 32000,
       .own_keys = FamilyKeys::kPhi3},
  };
  return families;
}

const ModelFamily* find_model_family(std::string_view model_type) {
  for (const ModelFamily& f : model_families())
    if (model_type == f.model_type) return &f;
  return nullptr;
}

std::string model_type_list() {
  std::vector<std::string> names;
  for (const ModelFamily& f : model_families()) names.emplace_back(f.model_type);
  return join(names, ", ");
}

const ModelFamily& ModelConfig::family() const {
  const ModelFamily* f = find_model_family(model_type);
  ZO_CHECK(f != nullptr) << "model_type " << model_type << " has no family row";
  return *f;
}

namespace {

ModelConfig llama2(uint64_t hidden, uint64_t inter, uint64_t layers, uint64_t heads, uint64_t kv_heads) {
  ModelConfig c;
  c.vocab_size = 32000;
  c.hidden_size = hidden;
  c.intermediate_size = inter;
  c.num_hidden_layers = layers;
  c.num_attention_heads = heads;
  c.num_key_value_heads = kv_heads;
  c.head_dim = hidden / heads;
  c.max_position_embeddings = 4096;
  c.rms_norm_eps = 1e-5;
  c.source_dtype = "float16";
  return c;
}

ModelConfig llama3(uint64_t hidden, uint64_t inter, uint64_t layers, uint64_t heads, uint64_t kv_heads, double factor) {
  ModelConfig c = llama2(hidden, inter, layers, heads, kv_heads);
  c.vocab_size = 128256;
  c.max_position_embeddings = 131072;
  c.rope_theta = 500000.0;
  c.rope_scaling = {.type = RopeScalingType::kLlama3,
                    .factor = factor,
                    .low_freq_factor = 1.0,
                    .high_freq_factor = 4.0,
                    .original_max_position_embeddings = 8192};
  c.source_dtype = "bfloat16";
  return c;
}

// A preset written as its published config.json (ZO_CHECK: the text is this file's).
ModelConfig from_config_json(const char* name, std::string_view json) {
  Result<ModelConfig> c = parse_hf_config(json, std::string("preset ") + name);
  ZO_CHECK(c.is_ok()) << c.status().to_string();
  return *c;
}

std::vector<std::pair<std::string, ModelConfig>> presets() {
  std::vector<std::pair<std::string, ModelConfig>> p;
  ModelConfig tiny = llama2(256, 688, 4, 8, 4);
  tiny.vocab_size = 256;
  tiny.max_position_embeddings = 1024;
  tiny.source_dtype = "float32";
  p.emplace_back("tiny", tiny);
  ModelConfig tinyllama = llama2(2048, 5632, 22, 32, 4);
  tinyllama.max_position_embeddings = 2048;
  tinyllama.source_dtype = "bfloat16";
  p.emplace_back("tinyllama-1.1b", tinyllama);
  ModelConfig l32 = llama3(2048, 8192, 16, 32, 8, 32.0);
  l32.tie_word_embeddings = true;
  p.emplace_back("llama3.2-1b", l32);
  ModelConfig l32_3b = llama3(3072, 8192, 28, 24, 8, 32.0);
  l32_3b.tie_word_embeddings = true;
  p.emplace_back("llama3.2-3b", l32_3b);
  p.emplace_back("llama-7b", llama2(4096, 11008, 32, 32, 32));
  p.emplace_back("llama3-8b", llama3(4096, 14336, 32, 32, 8, 8.0));
  p.emplace_back("llama-13b", llama2(5120, 13824, 40, 40, 40));
  ModelConfig l30 = llama2(6656, 17920, 60, 52, 52);  // LLaMA-30B ("33B"): the largest base a 128 GiB host pins
  l30.max_position_embeddings = 2048;
  p.emplace_back("llama-30b", l30);
  p.emplace_back("llama-70b", llama2(8192, 28672, 80, 64, 8));
  p.emplace_back("llama3-70b", llama3(8192, 28672, 80, 64, 8, 8.0));
  // The shapes people fine-tune, from their published config.json (the keys that shape the model;
  // a Gemma 3 text_config's keys the Hub file leaves to transformers' defaults are written out).
  p.emplace_back("qwen3-8b", from_config_json("qwen3-8b", R"({"model_type": "qwen3", "vocab_size": 151936,
    "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 40960, "rms_norm_eps": 1e-06,
    "rope_theta": 1000000, "rope_scaling": null, "tie_word_embeddings": false, "sliding_window": null,
    "use_sliding_window": false, "max_window_layers": 36, "attention_bias": false, "hidden_act": "silu",
    "torch_dtype": "bfloat16", "bos_token_id": 151643, "eos_token_id": 151645})"));
  p.emplace_back("qwen3-32b", from_config_json("qwen3-32b", R"({"model_type": "qwen3", "vocab_size": 151936,
    "hidden_size": 5120, "intermediate_size": 25600, "num_hidden_layers": 64, "num_attention_heads": 64,
    "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 40960, "rms_norm_eps": 1e-06,
    "rope_theta": 1000000, "rope_scaling": null, "tie_word_embeddings": false, "sliding_window": null,
    "use_sliding_window": false, "max_window_layers": 64, "attention_bias": false, "hidden_act": "silu",
    "torch_dtype": "bfloat16", "bos_token_id": 151643, "eos_token_id": 151645})"));
  p.emplace_back("gemma3-12b", from_config_json("gemma3-12b", R"({"model_type": "gemma3_text", "vocab_size": 262208,
    "hidden_size": 3840, "intermediate_size": 15360, "num_hidden_layers": 48, "num_attention_heads": 16,
    "num_key_value_heads": 8, "head_dim": 256, "query_pre_attn_scalar": 256, "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-06, "rope_theta": 1000000, "rope_local_base_freq": 10000,
    "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024, "sliding_window_pattern": 6,
    "final_logit_softcapping": null, "attn_logit_softcapping": null, "attention_bias": false,
    "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": true, "torch_dtype": "bfloat16",
    "bos_token_id": 2, "eos_token_id": [1, 106], "pad_token_id": 0})"));
  p.emplace_back("gemma3-27b", from_config_json("gemma3-27b", R"({"model_type": "gemma3_text", "vocab_size": 262208,
    "hidden_size": 5376, "intermediate_size": 21504, "num_hidden_layers": 62, "num_attention_heads": 32,
    "num_key_value_heads": 16, "head_dim": 128, "query_pre_attn_scalar": 168, "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
    "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024, "sliding_window_pattern": 6,
    "final_logit_softcapping": null, "attn_logit_softcapping": null, "attention_bias": false,
    "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": true, "torch_dtype": "bfloat16",
    "bos_token_id": 2, "eos_token_id": [1, 106], "pad_token_id": 0})"));
  p.emplace_back("phi4-mini", from_config_json("phi4-mini", R"({"model_type": "phi3", "vocab_size": 200064,
    "hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 32, "num_attention_heads": 24,
    "num_key_value_heads": 8, "max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
    "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "partial_rotary_factor": 0.75, "sliding_window": 262144,
    "tie_word_embeddings": true, "attention_bias": false, "hidden_act": "silu", "torch_dtype": "bfloat16",
    "bos_token_id": 199999, "pad_token_id": 199999,
    "rope_scaling": {"type": "longrope", "long_factor": [
      1, 1.118320672, 1.250641126, 1.398617824, 1.564103225, 1.74916897, 1.956131817, 2.187582649, 2.446418898,
      2.735880826, 3.059592084, 3.421605075, 3.826451687, 4.279200023, 4.785517845, 5.351743533, 5.984965424,
      6.693110555, 7.485043894, 8.370679318, 9.36110372, 10.4687158, 11.70738129, 13.09260651, 14.64173252,
      16.37415215, 18.31155283, 20.47818807, 22.90118105, 25.61086418, 28.64115884, 32.03, 32.1, 32.13, 32.23,
      32.6, 32.61, 32.64, 32.66, 32.7, 32.71, 32.93, 32.97, 33.28, 33.49, 33.5, 44.16, 47.77],
      "short_factor": [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0,
      1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0,
      1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]}})"));
  p.emplace_back("olmo2-7b", from_config_json("olmo2-7b", R"({"model_type": "olmo2", "vocab_size": 100352,
    "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 32, "max_position_embeddings": 4096, "rms_norm_eps": 1e-06, "rope_theta": 500000,
    "rope_scaling": null, "tie_word_embeddings": false, "attention_bias": false, "hidden_act": "silu",
    "torch_dtype": "bfloat16", "eos_token_id": 100257, "pad_token_id": 100277})"));
  p.emplace_back("olmo2-13b", from_config_json("olmo2-13b", R"({"model_type": "olmo2", "vocab_size": 100352,
    "hidden_size": 5120, "intermediate_size": 13824, "num_hidden_layers": 40, "num_attention_heads": 40,
    "num_key_value_heads": 40, "max_position_embeddings": 4096, "rms_norm_eps": 1e-06, "rope_theta": 500000,
    "rope_scaling": null, "tie_word_embeddings": false, "attention_bias": false, "hidden_act": "silu",
    "torch_dtype": "float32", "eos_token_id": 100257, "pad_token_id": 100277})"));
  return p;
}

}  // namespace

std::vector<std::string> model_preset_names() {
  std::vector<std::string> names;
  for (const auto& [name, config] : presets()) names.push_back(name);
  return names;
}

Result<ModelConfig> model_preset(std::string_view name) {
  for (const auto& [preset, config] : presets())
    if (preset == name) return config;
  const std::vector<std::string> names = model_preset_names();
  std::string message = "unknown model preset \"" + std::string(name) + "\"";
  if (const std::string guess = closest_match(name, names); !guess.empty())
    message += " (did you mean \"" + guess + "\"?)";
  return not_found(message + "; presets: " + join(names, ", "));
}

std::vector<DecoderParam> decoder_params(const ModelConfig& c) {
  using R = DecoderRole;
  const auto H = static_cast<int64_t>(c.hidden_size);
  const auto I = static_cast<int64_t>(c.intermediate_size);
  const auto D = static_cast<int64_t>(c.head_dim);
  const auto q_dim = static_cast<int64_t>(c.num_attention_heads) * D;
  const auto kv_dim = static_cast<int64_t>(c.num_key_value_heads) * D;
  const ModelFamily& f = c.family();
  std::vector<DecoderParam> out;
  auto add = [&](R role, const char* name, std::vector<int64_t> shape) {
    out.push_back({role, name, std::move(shape)});
  };
  // The pre-norm families keep the order this engine has always used (bf16 masters' rounding keys
  // follow it, so checkpoints stay resumable); the others take their HF module order.
  if (f.norms == NormPlacement::kPre) add(R::kInputNorm, "input_layernorm.weight", {H});
  if (f.fused_projections) {  // fused, read and written as stored
    add(R::kQkv, "self_attn.qkv_proj.weight", {q_dim + 2 * kv_dim, H});
  } else {
    add(R::kQ, "self_attn.q_proj.weight", {q_dim, H});
    if (c.attention_bias) add(R::kQBias, "self_attn.q_proj.bias", {q_dim});
    add(R::kK, "self_attn.k_proj.weight", {kv_dim, H});
    if (c.attention_bias) add(R::kKBias, "self_attn.k_proj.bias", {kv_dim});
    add(R::kV, "self_attn.v_proj.weight", {kv_dim, H});
    if (c.attention_bias) add(R::kVBias, "self_attn.v_proj.bias", {kv_dim});
  }
  add(R::kO, "self_attn.o_proj.weight", {H, q_dim});
  if (f.qk_norm != QkNorm::kNone) {
    const bool whole = f.qk_norm == QkNorm::kWhole;
    add(R::kQNorm, "self_attn.q_norm.weight", {whole ? q_dim : D});
    add(R::kKNorm, "self_attn.k_norm.weight", {whole ? kv_dim : D});
  }
  if (f.norms == NormPlacement::kPre) add(R::kPreMlpNorm, "post_attention_layernorm.weight", {H});
  if (f.fused_projections) {
    add(R::kGateUp, "mlp.gate_up_proj.weight", {2 * I, H});
  } else {
    add(R::kGate, "mlp.gate_proj.weight", {I, H});
    add(R::kUp, "mlp.up_proj.weight", {I, H});
  }
  add(R::kDown, "mlp.down_proj.weight", {H, I});
  if (f.norms == NormPlacement::kPost) {
    add(R::kPostAttnNorm, "post_attention_layernorm.weight", {H});
    add(R::kPostMlpNorm, "post_feedforward_layernorm.weight", {H});
  } else if (f.norms == NormPlacement::kSandwich) {
    add(R::kInputNorm, "input_layernorm.weight", {H});
    add(R::kPostAttnNorm, "post_attention_layernorm.weight", {H});
    add(R::kPreMlpNorm, "pre_feedforward_layernorm.weight", {H});
    add(R::kPostMlpNorm, "post_feedforward_layernorm.weight", {H});
  }
  // Note [LoRA adapters]: after the family's own params (their order, and so every layout and
  // checkpoint without adapters, unchanged), A then B of each adapted projection in the family's order.
  if (c.lora.r > 0) {
    const auto r = static_cast<int64_t>(c.lora.r);
    const size_t base = out.size();
    for (size_t i = 0; i < base; ++i) {
      const DecoderParam p = out[i];
      if (!c.lora.adapts(p.role)) continue;
      const std::string module = p.name.substr(0, p.name.size() - std::string_view(".weight").size());
      out.push_back({R::kLoraA, module + ".lora_A.weight", {r, p.shape[1]}, p.role});
      out.push_back({R::kLoraB, module + ".lora_B.weight", {p.shape[0], r}, p.role});
    }
  }
  return out;
}

Status check_seq_len(const ModelConfig& config, uint64_t seq_len) {
  if (seq_len > config.max_position_embeddings)
    return invalid_argument("--seq-len " + std::to_string(seq_len) + " exceeds the model's max_position_embeddings (" +
                            std::to_string(config.max_position_embeddings) + ")");
  // The same condition block_forward checks, found before anything is allocated.
  if (config.sliding_layers.empty() && config.sliding_window != 0 && seq_len > config.sliding_window)
    return invalid_argument("--seq-len " + std::to_string(seq_len) + " exceeds the model's sliding attention window (" +
                            std::string("sliding_window ") + std::to_string(config.sliding_window) + " in its " +
                            config.model_type +
                            " config.json), which zoffload does not apply to this family: train with --seq-len at "
                            "most " +
                            std::to_string(config.sliding_window));
  return Status::ok();
}

ModelLayout model_layout(const ModelConfig& c) {
  const auto H = static_cast<int64_t>(c.hidden_size);
  const auto V = static_cast<int64_t>(c.vocab_size);
  ModelLayout layout;
  layout.quantization = c.quantization;
  auto add = [&](BlockSpec* block, std::string name, std::vector<int64_t> shape) {
    block->params.push_back(static_cast<uint32_t>(layout.params.size()));
    layout.params.push_back({std::move(name), std::move(shape)});
  };

  BlockSpec embedding{.kind = BlockKind::kEmbedding, .layer = -1, .name = "model.embed_tokens", .params = {}};
  add(&embedding, "model.embed_tokens.weight", {V, H});
  const uint32_t embed_param = embedding.params[0];
  layout.blocks.push_back(std::move(embedding));

  const std::vector<DecoderParam> decoder = decoder_params(c);
  for (uint64_t l = 0; l < c.num_hidden_layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l);
    BlockSpec b{.kind = BlockKind::kDecoder, .layer = static_cast<int64_t>(l), .name = p, .params = {}};
    for (const DecoderParam& d : decoder) add(&b, p + "." + d.name, d.shape);
    layout.blocks.push_back(std::move(b));
  }

  BlockSpec head{.kind = BlockKind::kHead, .layer = -1, .name = "model.norm+lm_head", .params = {}};
  add(&head, "model.norm.weight", {H});
  if (c.tie_word_embeddings) head.params.push_back(embed_param);
  else add(&head, "lm_head.weight", {V, H});
  layout.blocks.push_back(std::move(head));
  return layout;
}

uint64_t num_parameters(const ModelConfig& c) {
  uint64_t layer = 0;
  for (const DecoderParam& d : decoder_params(c)) {
    uint64_t n = 1;
    for (const int64_t e : d.shape) n *= static_cast<uint64_t>(e);
    layer += n;
  }
  const uint64_t H = c.hidden_size, V = c.vocab_size;
  return V * H + c.num_hidden_layers * layer + H + (c.tie_word_embeddings ? 0 : V * H);
}

Result<ModelConfig> resolve_model_config(const std::string& model, io::Env* env) {
  ZO_ASSIGN_OR_RETURN(const io::PathKind kind, env->path_kind(model));
  if (kind == io::PathKind::kDirectory) return load_hf_config(model, env);
  Result<ModelConfig> preset = model_preset(model);
  if (preset.is_ok()) return preset;
  return not_found("--model " + model +
                   ": not a directory (a Hugging Face model with config.json and *.safetensors) "
                   "nor a preset (" +
                   join(model_preset_names(), ", ") + ")");
}

}  // namespace zo::engine

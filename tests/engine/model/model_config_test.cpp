// ModelConfig from Hugging Face config.json texts (Llama-2, Llama-3.1, Qwen2, Mistral), its errors,
// the presets and their parameter counts against the published figures, the layout and the export.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <string>
#include <tuple>
#include <vector>

#include "engine/model/model_config.h"
#include "tests/engine/model/safetensors_test_util.h"

namespace zo::engine {
namespace {

using ::testing::HasSubstr;

constexpr const char* kLlama2_7b = R"({
  "architectures": ["LlamaForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
  "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 11008, "max_position_embeddings": 4096,
  "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32,
  "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": null, "tie_word_embeddings": false,
  "torch_dtype": "float16", "transformers_version": "4.31.0.dev0", "use_cache": true, "vocab_size": 32000
})";

constexpr const char* kLlama31_8b = R"({
  "architectures": ["LlamaForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
  "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "hidden_act": "silu", "hidden_size": 4096,
  "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 131072, "mlp_bias": false,
  "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
  "pretraining_tp": 1, "rms_norm_eps": 1e-05,
  "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192, "rope_type": "llama3"},
  "rope_theta": 500000.0, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
  "transformers_version": "4.43.0.dev0", "use_cache": true, "vocab_size": 128256
})";

constexpr const char* kQwen2_05b = R"({
  "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
  "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 896, "initializer_range": 0.02,
  "intermediate_size": 4864, "max_position_embeddings": 131072, "max_window_layers": 24, "model_type": "qwen2",
  "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
  "rope_theta": 1000000.0, "sliding_window": 131072, "tie_word_embeddings": true, "torch_dtype": "bfloat16",
  "transformers_version": "4.40.1", "use_cache": true, "use_sliding_window": false, "vocab_size": 151936
})";

constexpr const char* kMistral_7b = R"({
  "architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
  "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 32768,
  "model_type": "mistral", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
  "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "sliding_window": 4096, "tie_word_embeddings": false,
  "torch_dtype": "bfloat16", "transformers_version": "4.34.0.dev0", "use_cache": true, "vocab_size": 32000
})";

// Current model pages (Llama 3.2, Qwen2.5, Mistral v0.3), as transformers 4.4x saved them.
constexpr const char* kLlama32_1b = R"({
  "architectures": ["LlamaForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
  "bos_token_id": 128000, "eos_token_id": 128001, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2048,
  "initializer_range": 0.02, "intermediate_size": 8192, "max_position_embeddings": 131072, "mlp_bias": false,
  "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8,
  "pretraining_tp": 1, "rms_norm_eps": 1e-05,
  "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                   "original_max_position_embeddings": 8192, "rope_type": "llama3"},
  "rope_theta": 500000.0, "tie_word_embeddings": true, "torch_dtype": "bfloat16",
  "transformers_version": "4.45.0.dev0", "use_cache": true, "vocab_size": 128256
})";

constexpr const char* kQwen25_7b = R"({
  "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
  "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 3584, "initializer_range": 0.02,
  "intermediate_size": 18944, "max_position_embeddings": 131072, "max_window_layers": 28, "model_type": "qwen2",
  "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4, "rms_norm_eps": 1e-06,
  "rope_theta": 1000000.0, "sliding_window": 131072, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
  "transformers_version": "4.43.1", "use_cache": true, "use_mrope": false, "use_sliding_window": false,
  "vocab_size": 152064
})";

constexpr const char* kMistral_7b_v03 = R"({
  "architectures": ["MistralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2,
  "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
  "max_position_embeddings": 32768, "model_type": "mistral", "num_attention_heads": 32, "num_hidden_layers": 32,
  "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "sliding_window": null,
  "tie_word_embeddings": false, "torch_dtype": "bfloat16", "transformers_version": "4.42.0.dev0",
  "use_cache": true, "vocab_size": 32768
})";

// The same Llama 3.2 and Qwen2.5 shapes as transformers 5.17 saves them (save_pretrained of the
// loaded config): rope_parameters, no top-level rope_theta, "dtype", Qwen2's layer_types.
constexpr const char* kLlama32_1b_v5 = R"({
  "architectures": ["LlamaForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
  "bos_token_id": 128000, "dtype": "bfloat16", "eos_token_id": 128001, "head_dim": 64, "hidden_act": "silu",
  "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 8192, "max_position_embeddings": 131072,
  "mlp_bias": false, "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 16,
  "num_key_value_heads": 8, "pad_token_id": null, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
  "rope_parameters": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                      "original_max_position_embeddings": 8192, "rope_theta": 500000.0, "rope_type": "llama3"},
  "tie_word_embeddings": true, "transformers_version": "5.17.0", "use_cache": true, "vocab_size": 128256
})";

constexpr const char* kQwen25_7b_v5 = R"({
  "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643, "dtype": "bfloat16",
  "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 3584, "initializer_range": 0.02,
  "intermediate_size": 18944, "layer_types": ["full_attention", "full_attention", "full_attention",
  "full_attention", "full_attention", "full_attention", "full_attention", "full_attention", "full_attention",
  "full_attention", "full_attention", "full_attention", "full_attention", "full_attention", "full_attention",
  "full_attention", "full_attention", "full_attention", "full_attention", "full_attention", "full_attention",
  "full_attention", "full_attention", "full_attention", "full_attention", "full_attention", "full_attention",
  "full_attention"], "max_position_embeddings": 131072, "max_window_layers": 28, "model_type": "qwen2",
  "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4, "pad_token_id": null,
  "rms_norm_eps": 1e-06, "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
  "sliding_window": null, "tie_word_embeddings": false, "transformers_version": "5.17.0", "use_cache": true,
  "use_mrope": false, "use_sliding_window": false, "vocab_size": 152064
})";

// OLMo-2-1124-7B's config.json from its model page (transformers 4.46).
constexpr const char* kOlmo2_7b = R"({
  "architectures": ["Olmo2ForCausalLM"], "attention_bias": false, "attention_dropout": 0.0, "eos_token_id": 100257,
  "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 11008,
  "max_position_embeddings": 4096, "model_type": "olmo2", "num_attention_heads": 32, "num_hidden_layers": 32,
  "num_key_value_heads": 32, "pad_token_id": 100277, "rms_norm_eps": 1e-06, "rope_scaling": null, "rope_theta": 500000,
  "tie_word_embeddings": false, "torch_dtype": "float32", "transformers_version": "4.46.0.dev0", "use_cache": true,
  "vocab_size": 100352})";

// Gemma-3-4B's text model: its model page's text_config (hidden 2560, intermediate 10240, 34 layers,
// linear RoPE scaling 8 on the full layers, window 1024) with Gemma3TextConfig's defaults written out,
// in the form transformers < 5 wrote (rope_theta, rope_local_base_freq, sliding_window_pattern).
constexpr const char* kGemma3_4b = R"({
  "architectures": ["Gemma3ForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
  "attn_logit_softcapping": null, "bos_token_id": 2, "cache_implementation": "hybrid", "eos_token_id": [1, 106],
  "final_logit_softcapping": null, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 2560,
  "initializer_range": 0.02, "intermediate_size": 10240, "max_position_embeddings": 131072,
  "model_type": "gemma3_text", "num_attention_heads": 8, "num_hidden_layers": 34, "num_key_value_heads": 4,
  "pad_token_id": 0, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000.0,
  "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "rope_theta": 1000000.0, "sliding_window": 1024,
  "sliding_window_pattern": 6, "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0", "use_cache": true,
  "vocab_size": 262208})";

// Gemma-3-12B's text model likewise, as transformers 5.17 writes it (rope_parameters per layer type,
// layer_types; tie_word_embeddings left out where it is the default).
std::string gemma3_12b() {
  std::string types;
  for (int i = 0; i < 48; ++i)
    types += std::string(i == 0 ? "" : ", ") + ((i + 1) % 6 ? "\"sliding_attention\"" : "\"full_attention\"");
  return R"({"architectures": ["Gemma3ForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
  "attn_logit_softcapping": null, "bos_token_id": 2, "eos_token_id": 1, "final_logit_softcapping": null,
  "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 3840, "initializer_range": 0.02,
  "intermediate_size": 15360, "layer_types": [)" +
         types + R"(], "max_position_embeddings": 131072,
  "model_type": "gemma3_text", "num_attention_heads": 16, "num_hidden_layers": 48, "num_key_value_heads": 8,
  "pad_token_id": 0, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06,
  "rope_parameters": {"full_attention": {"factor": 8.0, "rope_theta": 1000000.0, "rope_type": "linear"},
                      "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"}},
  "sliding_window": 1024, "transformers_version": "5.17.0", "use_bidirectional_attention": false,
  "use_cache": true, "vocab_size": 262208})";
}

// Phi-3-mini-4k-instruct's config.json from its model page (auto_map left out): window 2047 on
// every layer, RoPE unscaled over the whole head.
constexpr const char* kPhi3_mini = R"({
  "architectures": ["Phi3ForCausalLM"], "attention_bias": false, "attention_dropout": 0.0, "bos_token_id": 1,
  "embd_pdrop": 0.0, "eos_token_id": 32000, "hidden_act": "silu", "hidden_size": 3072, "initializer_range": 0.02,
  "intermediate_size": 8192, "max_position_embeddings": 4096, "model_type": "phi3", "num_attention_heads": 32,
  "num_hidden_layers": 32, "num_key_value_heads": 32, "original_max_position_embeddings": 4096, "pad_token_id": 32000,
  "resid_pdrop": 0.0, "rms_norm_eps": 1e-05, "rope_scaling": null, "rope_theta": 10000.0, "sliding_window": 2047,
  "tie_word_embeddings": false, "torch_dtype": "bfloat16", "transformers_version": "4.40.2", "use_cache": true,
  "vocab_size": 32064})";

// Phi-4-mini-instruct's config.json from its model page (auto_map left out, and its 48 short and 48
// long RoPE factors replaced by placeholders of the same count): GQA, RoPE over 0.75 of each head
// with longrope, tied, and the keys transformers' Phi3Config does not read (lm_head_bias, mlp_bias,
// full_attn_mod, interpolate_factor).
std::string phi4_mini() {
  std::string short_factor, long_factor;
  for (int i = 0; i < 48; ++i) {
    short_factor += std::string(i == 0 ? "" : ", ") + "1.0";
    long_factor += std::string(i == 0 ? "" : ", ") + std::to_string(1.0 + i);
  }
  return R"({"architectures": ["Phi3ForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
  "bos_token_id": 199999, "embd_pdrop": 0.0, "eos_token_id": 199999, "full_attn_mod": 1, "hidden_act": "silu",
  "hidden_size": 3072, "initializer_range": 0.02, "intermediate_size": 8192, "interpolate_factor": 1,
  "lm_head_bias": false, "max_position_embeddings": 131072, "mlp_bias": false, "model_type": "phi3",
  "num_attention_heads": 24, "num_hidden_layers": 32, "num_key_value_heads": 8,
  "original_max_position_embeddings": 4096, "pad_token_id": 199999, "partial_rotary_factor": 0.75,
  "resid_pdrop": 0.0, "rms_norm_eps": 1e-05, "rope_scaling": {"long_factor": [)" +
         long_factor + R"(], "short_factor": [)" + short_factor + R"(], "type": "longrope"},
  "rope_theta": 10000.0, "sliding_window": 262144, "tie_word_embeddings": true, "torch_dtype": "bfloat16",
  "transformers_version": "4.45.0", "use_cache": true, "vocab_size": 200064})";
}

// Qwen3-8B's config.json from its model page (transformers 4.51).
constexpr const char* kQwen3_8b = R"({
  "architectures": ["Qwen3ForCausalLM"], "attention_bias": false, "attention_dropout": 0.0, "bos_token_id": 151643,
  "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
  "intermediate_size": 12288, "max_position_embeddings": 40960, "max_window_layers": 36, "model_type": "qwen3",
  "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
  "rope_scaling": null, "rope_theta": 1000000, "sliding_window": null, "tie_word_embeddings": false,
  "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": true, "use_sliding_window": false,
  "vocab_size": 151936
})";

// Σ over the layout's tensors of their element counts.
uint64_t layout_elems(const ModelLayout& layout) {
  uint64_t total = 0;
  for (const ParamSpec& p : layout.params) {
    uint64_t n = 1;
    for (int64_t d : p.shape) n *= static_cast<uint64_t>(d);
    total += n;
  }
  return total;
}

ModelConfig parse_ok(const std::string& text) {
  Result<ModelConfig> r = parse_hf_config(text, "config.json");
  EXPECT_TRUE(r.is_ok()) << r.status().to_string();
  return r.is_ok() ? *r : ModelConfig{};
}

// The Llama-2 text with one key's value replaced (or the key removed when value is empty).
std::string llama2_with(const std::string& key, const std::string& value) {
  std::string text = kLlama2_7b;
  const std::string quoted = "\"" + key + "\": ";
  const size_t at = text.find(quoted);
  EXPECT_NE(at, std::string::npos) << key;
  size_t end = text.find_first_of(",}", at + quoted.size());
  if (text[at + quoted.size()] == '[') end = text.find(']', at) + 1;
  if (value.empty() && text[end] == ',') return text.erase(at, end - at + 1);
  if (value.empty()) return text.erase(text.rfind(',', at), end - text.rfind(',', at));  // the last key
  return text.replace(at, end - at, quoted + value);
}

void expect_same(const ModelConfig& a, const ModelConfig& b) {
  EXPECT_EQ(a.model_type, b.model_type);
  EXPECT_EQ(a.vocab_size, b.vocab_size);
  EXPECT_EQ(a.hidden_size, b.hidden_size);
  EXPECT_EQ(a.intermediate_size, b.intermediate_size);
  EXPECT_EQ(a.num_hidden_layers, b.num_hidden_layers);
  EXPECT_EQ(a.num_attention_heads, b.num_attention_heads);
  EXPECT_EQ(a.num_key_value_heads, b.num_key_value_heads);
  EXPECT_EQ(a.head_dim, b.head_dim);
  EXPECT_EQ(a.max_position_embeddings, b.max_position_embeddings);
  EXPECT_EQ(a.rms_norm_eps, b.rms_norm_eps);
  EXPECT_EQ(a.rope_theta, b.rope_theta);
  EXPECT_EQ(a.initializer_range, b.initializer_range);
  EXPECT_EQ(a.bos_token_id_json, b.bos_token_id_json);
  EXPECT_EQ(a.eos_token_id_json, b.eos_token_id_json);
  EXPECT_EQ(a.rope_scaling.type, b.rope_scaling.type);
  EXPECT_EQ(a.rope_scaling.factor, b.rope_scaling.factor);
  EXPECT_EQ(a.rope_scaling.low_freq_factor, b.rope_scaling.low_freq_factor);
  EXPECT_EQ(a.rope_scaling.high_freq_factor, b.rope_scaling.high_freq_factor);
  EXPECT_EQ(a.rope_scaling.original_max_position_embeddings, b.rope_scaling.original_max_position_embeddings);
  EXPECT_EQ(a.tie_word_embeddings, b.tie_word_embeddings);
  EXPECT_EQ(a.attention_bias, b.attention_bias);
  EXPECT_EQ(a.source_dtype, b.source_dtype);
  EXPECT_EQ(a.sliding_window, b.sliding_window);
  EXPECT_EQ(a.pad_token_id, b.pad_token_id);
  EXPECT_EQ(a.activation, b.activation);
  EXPECT_EQ(a.scale_embeddings, b.scale_embeddings);
  EXPECT_EQ(a.query_pre_attn_scalar, b.query_pre_attn_scalar);
  EXPECT_EQ(a.final_logit_softcap, b.final_logit_softcap);
  EXPECT_EQ(a.sliding_layers, b.sliding_layers);
  EXPECT_EQ(a.local_rope_theta, b.local_rope_theta);
  EXPECT_EQ(a.partial_rotary_factor, b.partial_rotary_factor);
  EXPECT_EQ(a.rope_scaling.short_factor, b.rope_scaling.short_factor);
  EXPECT_EQ(a.rope_scaling.long_factor, b.rope_scaling.long_factor);
  EXPECT_EQ(a.rope_scaling.attention_factor, b.rope_scaling.attention_factor);
}

TEST(HfConfig, ParsesLlama2) {
  const ModelConfig c = parse_ok(kLlama2_7b);
  EXPECT_EQ(c.model_type, "llama");
  EXPECT_EQ(c.vocab_size, 32000u);
  EXPECT_EQ(c.hidden_size, 4096u);
  EXPECT_EQ(c.intermediate_size, 11008u);
  EXPECT_EQ(c.num_hidden_layers, 32u);
  EXPECT_EQ(c.num_attention_heads, 32u);
  EXPECT_EQ(c.num_key_value_heads, 32u);
  EXPECT_EQ(c.head_dim, 128u);
  EXPECT_EQ(c.max_position_embeddings, 4096u);
  EXPECT_EQ(c.rms_norm_eps, 1e-5);
  EXPECT_EQ(c.rope_theta, 10000.0);
  EXPECT_EQ(c.rope_scaling.type, RopeScalingType::kNone);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_FALSE(c.attention_bias);
  EXPECT_EQ(c.source_dtype, "float16");
  EXPECT_EQ(num_parameters(c), 6'738'415'616u);
}

TEST(HfConfig, ParsesLlama31WithLlama3RopeScaling) {
  const ModelConfig c = parse_ok(kLlama31_8b);
  EXPECT_EQ(c.num_key_value_heads, 8u);
  EXPECT_EQ(c.rope_theta, 500000.0);
  EXPECT_EQ(c.rope_scaling.type, RopeScalingType::kLlama3);
  EXPECT_EQ(c.rope_scaling.factor, 8.0);
  EXPECT_EQ(c.rope_scaling.low_freq_factor, 1.0);
  EXPECT_EQ(c.rope_scaling.high_freq_factor, 4.0);
  EXPECT_EQ(c.rope_scaling.original_max_position_embeddings, 8192u);
  EXPECT_EQ(c.source_dtype, "bfloat16");
  EXPECT_EQ(num_parameters(c), 8'030'261'248u);
}

TEST(HfConfig, ParsesQwen2WithBiasesAndTiedEmbeddings) {
  const ModelConfig c = parse_ok(kQwen2_05b);
  EXPECT_EQ(c.model_type, "qwen2");
  EXPECT_TRUE(c.attention_bias);
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_EQ(c.head_dim, 64u);
  EXPECT_EQ(c.rope_theta, 1e6);
  EXPECT_EQ(c.rms_norm_eps, 1e-6);
  EXPECT_EQ(c.sliding_window, 0u) << "use_sliding_window is false";
  EXPECT_EQ(num_parameters(c), 494'032'768u);  // Qwen2-0.5B
}

// Qwen3: llama plus q_norm and k_norm ([head_dim] each, per layer), an explicit head_dim, no biases.
// Its parameter count is transformers' for Qwen3-8B (Qwen3ForCausalLM built from this config on the
// meta device: 8,190,735,360).
TEST(HfConfig, ParsesQwen3WithQkNorms) {
  const ModelConfig c = parse_ok(kQwen3_8b);
  EXPECT_EQ(c.model_type, "qwen3");
  EXPECT_EQ(c.family().qk_norm, QkNorm::kPerHead);
  EXPECT_FALSE(c.attention_bias);
  EXPECT_EQ(c.head_dim, 128u);
  EXPECT_EQ(c.sliding_window, 0u) << "use_sliding_window is false";
  EXPECT_EQ(num_parameters(c), 8'190'735'360u);
  const ModelLayout layout = model_layout(c);
  const BlockSpec& b0 = layout.blocks[1];
  ASSERT_EQ(b0.params.size(), 11u);
  EXPECT_EQ(layout.params[b0.params[5]].name, "model.layers.0.self_attn.q_norm.weight");
  EXPECT_EQ(layout.params[b0.params[5]].shape, std::vector<int64_t>{128});
  EXPECT_EQ(layout.params[b0.params[6]].name, "model.layers.0.self_attn.k_norm.weight");
  EXPECT_EQ(layout_elems(layout), num_parameters(c));
  // Without head_dim, Qwen3Config's default (128), not hidden / heads as for llama.
  const ModelConfig small = parse_ok(R"({"model_type": "qwen3", "vocab_size": 256, "hidden_size": 64,
    "intermediate_size": 160, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2})");
  EXPECT_EQ(small.head_dim, 128u);
  // Biases on all four projections are another layout: refused, naming the key.
  std::string biased = kQwen3_8b;
  biased.replace(biased.find("\"attention_bias\": false"), 23, "\"attention_bias\": true");
  const Result<ModelConfig> r = parse_hf_config(biased, "config.json");
  ASSERT_FALSE(r.is_ok());
  EXPECT_THAT(r.status().message(), HasSubstr("attention_bias"));
}

// OLMo 2: no input norm, norms after attention and after the MLP, q/k norms over the whole
// projection. Its parameter count is transformers' for OLMo-2-1124-7B (Olmo2ForCausalLM built from
// this config on the meta device: 7,298,617,344).
TEST(HfConfig, ParsesOlmo2WithPostNorms) {
  const ModelConfig c = parse_ok(kOlmo2_7b);
  EXPECT_EQ(c.model_type, "olmo2");
  EXPECT_EQ(c.family().norms, NormPlacement::kPost);
  EXPECT_EQ(c.family().qk_norm, QkNorm::kWhole);
  EXPECT_EQ(c.head_dim, 128u);
  EXPECT_EQ(c.rope_theta, 500000.0);
  EXPECT_EQ(num_parameters(c), 7'298'617'344u);
  const ModelLayout layout = model_layout(c);
  const BlockSpec& b0 = layout.blocks[1];
  std::vector<std::string> names;
  for (const uint32_t p : b0.params)
    names.push_back(layout.params[p].name.substr(std::string("model.layers.0.").size()));
  EXPECT_THAT(names,
              ::testing::ElementsAre("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                                     "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
                                     "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
                                     "post_attention_layernorm.weight", "post_feedforward_layernorm.weight"));
  EXPECT_EQ(layout.params[b0.params[4]].shape, std::vector<int64_t>{4096});
  EXPECT_EQ(layout_elems(layout), num_parameters(c));
  // Biases on all four projections are another layout: refused, naming the key.
  std::string biased = kOlmo2_7b;
  biased.replace(biased.find("\"attention_bias\": false"), 23, "\"attention_bias\": true");
  const Result<ModelConfig> r = parse_hf_config(biased, "config.json");
  ASSERT_FALSE(r.is_ok());
  EXPECT_THAT(r.status().message(), HasSubstr("attention_bias"));
}

// Gemma 3 text: four norms per layer (1 + weight), GELU-tanh, q/k norms per head, the embeddings
// scaled by √hidden, five sliding layers to one full one with their own RoPE. Parameter counts are
// transformers' for these configs (Gemma3ForCausalLM on the meta device): 3,880,263,168 (4B) and
// 11,766,034,176 (12B).
TEST(HfConfig, ParsesGemma3TextInBothForms) {
  const ModelConfig c = parse_ok(kGemma3_4b);
  EXPECT_EQ(c.model_type, "gemma3_text");
  EXPECT_EQ(c.family().norms, NormPlacement::kSandwich);
  EXPECT_EQ(c.family().norm_scale, NormScale::kOnePlusInFp32);
  EXPECT_EQ(c.activation, MlpActivation::kGeluTanh);
  EXPECT_TRUE(c.scale_embeddings);
  EXPECT_TRUE(c.tie_word_embeddings) << "Gemma3TextConfig's default";
  EXPECT_EQ(c.pad_token_id, 0);
  EXPECT_EQ(c.head_dim, 256u);
  EXPECT_EQ(c.query_pre_attn_scalar, 256.0);
  EXPECT_EQ(c.sliding_window, 1024u);
  EXPECT_EQ(c.rope_theta, 1e6);
  EXPECT_EQ(c.rope_scaling.type, RopeScalingType::kLinear);
  EXPECT_EQ(c.rope_scaling.factor, 8.0);
  EXPECT_EQ(c.local_rope_theta, 1e4);
  ASSERT_EQ(c.sliding_layers.size(), 34u);
  for (size_t i = 0; i < 34; ++i) EXPECT_EQ(c.sliding_layers[i], (i + 1) % 6 != 0) << i;
  EXPECT_EQ(num_parameters(c), 3'880'263'168u);
  const ModelLayout layout = model_layout(c);
  EXPECT_EQ(layout_elems(layout), num_parameters(c));
  const BlockSpec& b0 = layout.blocks[1];
  ASSERT_EQ(b0.params.size(), 13u);
  EXPECT_EQ(layout.params[b0.params[4]].name, "model.layers.0.self_attn.q_norm.weight");
  EXPECT_EQ(layout.params[b0.params[4]].shape, std::vector<int64_t>{256});
  EXPECT_EQ(layout.params[b0.params[11]].name, "model.layers.0.pre_feedforward_layernorm.weight");

  const ModelConfig big = parse_ok(gemma3_12b());
  EXPECT_EQ(num_parameters(big), 11'766'034'176u);
  EXPECT_TRUE(big.tie_word_embeddings);
  EXPECT_EQ(big.rope_theta, 1e6);
  EXPECT_EQ(big.rope_scaling.type, RopeScalingType::kLinear);
  EXPECT_EQ(big.local_rope_theta, 1e4);
  ASSERT_EQ(big.sliding_layers.size(), 48u);
  for (size_t i = 0; i < 48; ++i) EXPECT_EQ(big.sliding_layers[i], (i + 1) % 6 != 0) << i;
}

// Multimodal Gemma 3 as gemma-3-4b-it's config.json ships (vision_config abridged): its text model,
// with Gemma3TextConfig's defaults for what text_config leaves out, as transformers reads it (the same
// 3,880,263,168 parameters as the 4B text model above). Errors inside name text_config's keys.
TEST(HfConfig, ParsesMultimodalGemma3AsItsTextModel) {
  const std::string gemma3_4b_it = R"({"architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999,
    "eoi_token_index": 256000, "eos_token_id": [1, 106], "image_token_index": 262144, "initializer_range": 0.02,
    "mm_tokens_per_image": 256, "model_type": "gemma3",
    "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                    "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                    "sliding_window": 1024},
    "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0",
    "vision_config": {"hidden_size": 1152, "image_size": 896, "model_type": "siglip_vision_model"}})";
  const ModelConfig c = parse_ok(gemma3_4b_it);
  EXPECT_EQ(c.model_type, "gemma3_text") << "trained and exported as its text model";
  EXPECT_EQ(c.vocab_size, 262208u);
  EXPECT_EQ(c.num_attention_heads, 8u);
  EXPECT_EQ(c.head_dim, 256u);
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_EQ(c.rope_scaling.type, RopeScalingType::kLinear);
  EXPECT_EQ(c.source_dtype, "bfloat16");
  EXPECT_EQ(num_parameters(c), 3'880'263'168u);
  std::string bad = gemma3_4b_it;
  bad.replace(bad.find("\"sliding_window\": 1024"), 22, "\"sliding_window\": null");
  const Result<ModelConfig> r = parse_hf_config(bad, "config.json");
  ASSERT_FALSE(r.is_ok());
  EXPECT_THAT(r.status().message(), HasSubstr("key 'text_config.sliding_window'"));
  std::string scaled = gemma3_4b_it;
  scaled.replace(scaled.find("\"factor\": 8.0"), 13, "\"factor\": 0");
  const Result<ModelConfig> s = parse_hf_config(scaled, "config.json");
  ASSERT_FALSE(s.is_ok());
  EXPECT_THAT(s.status().message(), HasSubstr("key 'text_config.rope_scaling.factor'"));
  // Gemma3ForConditionalGeneration does not cap its logits, whatever text_config says.
  std::string capped = gemma3_4b_it;
  capped.replace(capped.find("\"sliding_window\": 1024"), 22,
                 "\"sliding_window\": 1024, \"final_logit_softcapping\": 30.0");
  EXPECT_EQ(parse_ok(capped).final_logit_softcap, 0.0);
  const Result<ModelConfig> no_text = parse_hf_config(R"({"model_type": "gemma3"})", "config.json");
  ASSERT_FALSE(no_text.is_ok());
  EXPECT_THAT(no_text.status().message(), HasSubstr("key 'text_config'"));
  std::string vision = gemma3_4b_it;
  vision.replace(vision.find("Gemma3ForConditionalGeneration"), 30, "Gemma3ForImageTextToText");
  EXPECT_FALSE(parse_hf_config(vision, "config.json").is_ok());
}

// What Gemma 3 sets that zoffload does not compute is refused, naming the key.
TEST(HfConfig, RefusesGemma3SettingsNotImplemented) {
  const std::string base = kGemma3_4b;
  auto with = [&](const std::string& from, const std::string& to) {
    std::string t = base;
    const size_t at = t.find(from);
    EXPECT_NE(at, std::string::npos) << from;
    return t.replace(at, from.size(), to);
  };
  for (const auto& [from, to, key] : std::vector<std::tuple<std::string, std::string, std::string>>{
           {"\"attn_logit_softcapping\": null", "\"attn_logit_softcapping\": 50.0", "attn_logit_softcapping"},
           {"\"hidden_activation\": \"gelu_pytorch_tanh\"", "\"hidden_activation\": \"gelu\"", "hidden_activation"},
           {"\"use_cache\": true", "\"use_bidirectional_attention\": true", "use_bidirectional_attention"},
           {"\"sliding_window\": 1024", "\"sliding_window\": null", "sliding_window"},
           {"\"use_cache\": true", "\"layer_types\": [\"full_attention\"]", "layer_types"}}) {
    const Result<ModelConfig> r = parse_hf_config(with(from, to), "config.json");
    ASSERT_FALSE(r.is_ok()) << to;
    EXPECT_THAT(r.status().message(), HasSubstr("key '" + key + "'")) << to;
  }
  std::string local_scaled = gemma3_12b();
  const std::string local = "{\"rope_theta\": 10000.0, \"rope_type\": \"default\"}";
  local_scaled.replace(local_scaled.find(local), local.size(),
                       "{\"rope_theta\": 10000.0, \"rope_type\": \"linear\", \"factor\": 2.0}");
  const Result<ModelConfig> r = parse_hf_config(local_scaled, "config.json");
  ASSERT_FALSE(r.is_ok());
  EXPECT_THAT(r.status().message(), HasSubstr("rope_parameters.sliding_attention"));
}

// Phi-3: fused qkv_proj and gate_up_proj read as stored, partial rotary and longrope. Parameter
// counts are transformers' for these configs (Phi3ForCausalLM on the meta device): 3,821,079,552
// (Phi-3-mini) and 3,836,021,760 (Phi-4-mini).
TEST(HfConfig, ParsesPhi3AndPhi4Mini) {
  const ModelConfig mini = parse_ok(kPhi3_mini);
  EXPECT_EQ(mini.model_type, "phi3");
  EXPECT_TRUE(mini.family().fused_projections);
  EXPECT_TRUE(mini.family().partial_longrope);
  EXPECT_EQ(mini.rotary_dim(), 96);
  EXPECT_EQ(mini.sliding_window, 2047u);
  EXPECT_EQ(mini.sliding_layers, std::vector<bool>(32, true)) << "Phi-3's window is every layer's";
  EXPECT_EQ(mini.pad_token_id, 32000);
  EXPECT_EQ(num_parameters(mini), 3'821'079'552u);
  const ModelLayout layout = model_layout(mini);
  EXPECT_EQ(layout_elems(layout), num_parameters(mini));
  std::vector<std::string> names;
  for (const uint32_t p : layout.blocks[1].params) names.push_back(layout.params[p].name);
  EXPECT_THAT(names, ::testing::ElementsAre(
                         "model.layers.0.input_layernorm.weight", "model.layers.0.self_attn.qkv_proj.weight",
                         "model.layers.0.self_attn.o_proj.weight", "model.layers.0.post_attention_layernorm.weight",
                         "model.layers.0.mlp.gate_up_proj.weight", "model.layers.0.mlp.down_proj.weight"));
  EXPECT_EQ(layout.params[layout.blocks[1].params[1]].shape, (std::vector<int64_t>{3 * 3072, 3072}));
  EXPECT_EQ(layout.params[layout.blocks[1].params[4]].shape, (std::vector<int64_t>{2 * 8192, 3072}));

  const ModelConfig phi4 = parse_ok(phi4_mini());
  EXPECT_EQ(num_parameters(phi4), 3'836'021'760u);
  EXPECT_TRUE(phi4.tie_word_embeddings);
  EXPECT_EQ(phi4.partial_rotary_factor, 0.75);
  EXPECT_EQ(phi4.rotary_dim(), 96);
  EXPECT_EQ(phi4.rope_scaling.type, RopeScalingType::kLongRope);
  EXPECT_EQ(phi4.rope_scaling.original_max_position_embeddings, 4096u);
  ASSERT_EQ(phi4.rope_scaling.long_factor.size(), 48u);
  EXPECT_EQ(phi4.rope_scaling.long_factor[47], 48.0);
  EXPECT_EQ(layout_elems(model_layout(phi4)), num_parameters(phi4));
}

// What Phi-3 sets that zoffload does not compute is refused, naming the key.
TEST(HfConfig, RefusesPhi3SettingsNotImplemented) {
  auto with = [](std::string text, const std::string& from, const std::string& to) {
    const size_t at = text.find(from);
    EXPECT_NE(at, std::string::npos) << from;
    return text.replace(at, from.size(), to);
  };
  for (const auto& [text, key] : std::vector<std::pair<std::string, std::string>>{
           {with(kPhi3_mini, "\"resid_pdrop\": 0.0", "\"resid_pdrop\": 0.1"), "resid_pdrop"},
           {with(kPhi3_mini, "\"embd_pdrop\": 0.0", "\"embd_pdrop\": 0.1"), "embd_pdrop"},
           {with(kPhi3_mini, "\"rope_scaling\": null", "\"rope_scaling\": {\"type\": \"dynamic\", \"factor\": 2.0}"),
            "rope_scaling.type"},
           {with(phi4_mini(), "\"partial_rotary_factor\": 0.75", "\"partial_rotary_factor\": 0.7"),
            "partial_rotary_factor"},
           {with(phi4_mini(), "\"partial_rotary_factor\": 0.75", "\"partial_rotary_factor\": 0.5"), "rope_scaling"},
           {with(phi4_mini(), "\"type\": \"longrope\"", "\"type\": \"longrope\", \"short_factor\": 2"),
            "rope_scaling.short_factor"},
           {with(kPhi3_mini, "\"pad_token_id\": 32000,", ""), "pad_token_id"}}) {
    std::string input = text;
    if (key == "pad_token_id") input = with(input, "\"vocab_size\": 32064", "\"vocab_size\": 32000");
    const Result<ModelConfig> r = parse_hf_config(input, "config.json");
    ASSERT_FALSE(r.is_ok()) << key;
    EXPECT_THAT(r.status().message(), HasSubstr("key '" + key + "'")) << key;
  }
  // partial_rotary_factor is Phi-3's only.
  const Result<ModelConfig> llama =
      parse_hf_config(llama2_with("rms_norm_eps", "1e-05, \"partial_rotary_factor\": 0.5"), "config.json");
  ASSERT_FALSE(llama.is_ok());
  EXPECT_THAT(llama.status().message(), HasSubstr("partial_rotary_factor"));
}

// pad_token_id is nn.Embedding's padding_idx in transformers: read, the family's default where absent,
// null for none, negative from the end as torch takes it, refused outside the vocabulary; exported.
TEST(HfConfig, PadTokenIdIsReadWithTheFamilysDefault) {
  auto llama_with_pad = [](const std::string& value) {
    return "{\"pad_token_id\": " + value + "," + std::string(kLlama2_7b).substr(1);
  };
  EXPECT_EQ(parse_ok(kLlama2_7b).pad_token_id, -1);
  EXPECT_EQ(parse_ok(kOlmo2_7b).pad_token_id, 100277);
  std::string olmo = kOlmo2_7b;
  olmo.replace(olmo.find("\"pad_token_id\": 100277, "), 24, "");
  EXPECT_EQ(parse_ok(olmo).pad_token_id, 1) << "Olmo2Config's default";
  EXPECT_EQ(parse_ok(llama_with_pad("null")).pad_token_id, -1);
  EXPECT_EQ(parse_ok(llama_with_pad("0")).pad_token_id, 0);
  EXPECT_EQ(parse_ok(llama_with_pad("-1")).pad_token_id, 31999);
  for (const char* bad : {"32000", "-32001", "\"0\"", "1.5"}) {
    const Result<ModelConfig> r = parse_hf_config(llama_with_pad(bad), "config.json");
    ASSERT_FALSE(r.is_ok()) << bad;
    EXPECT_THAT(r.status().message(), HasSubstr("key 'pad_token_id'")) << bad;
  }
  ModelConfig c = parse_ok(llama_with_pad("7"));
  c.source_dtype = "bfloat16";
  expect_same(parse_ok(to_hf_config_json(c, "bfloat16")), c);
  ModelConfig none = parse_ok(kOlmo2_7b);
  none.pad_token_id = -1;
  EXPECT_EQ(parse_ok(to_hf_config_json(none, "float32")).pad_token_id, -1) << "null, not Olmo2Config's default";
}

TEST(HfConfig, ParsesMistralWithSlidingWindow) {
  const ModelConfig c = parse_ok(kMistral_7b);
  EXPECT_EQ(c.model_type, "mistral");
  EXPECT_FALSE(c.attention_bias);
  EXPECT_EQ(c.sliding_window, 4096u);
  EXPECT_EQ(c.max_position_embeddings, 32768u);
  EXPECT_EQ(num_parameters(c), 7'241'732'096u);  // Mistral-7B-v0.1
}

TEST(HfConfig, DefaultsAbsentOptionalKeys) {
  const ModelConfig c = parse_ok(R"({"model_type": "llama", "vocab_size": 10, "hidden_size": 8,
      "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2})");
  EXPECT_EQ(c.num_key_value_heads, 2u);
  EXPECT_EQ(c.head_dim, 4u);
  EXPECT_EQ(c.max_position_embeddings, 2048u);
  EXPECT_EQ(c.rms_norm_eps, 1e-6);
  EXPECT_EQ(c.rope_theta, 10000.0);
  EXPECT_EQ(c.initializer_range, 0.02);
  EXPECT_EQ(c.source_dtype, "float32");
}

TEST(HfConfig, ExplicitHeadDimNeedNotDivideHidden) {
  std::string text = llama2_with("num_key_value_heads", "8, \"head_dim\": 128");
  const std::string heads = "\"num_attention_heads\": 32";
  text.replace(text.find(heads), heads.size(), "\"num_attention_heads\": 24");  // 4096 / 24 is not whole
  const ModelConfig c = parse_ok(text);
  EXPECT_EQ(c.head_dim, 128u);
  EXPECT_EQ(model_layout(c).params[2].shape, (std::vector<int64_t>{24 * 128, 4096}));  // q_proj
}

TEST(HfConfig, RopeScalingDefaultAndLinear) {
  EXPECT_EQ(parse_ok(llama2_with("rope_scaling", R"({"rope_type": "default"})")).rope_scaling.type,
            RopeScalingType::kNone);
  const ModelConfig c = parse_ok(llama2_with("rope_scaling", R"({"type": "linear", "factor": 4.0})"));
  EXPECT_EQ(c.rope_scaling.type, RopeScalingType::kLinear);
  EXPECT_EQ(c.rope_scaling.factor, 4.0);
}

TEST(HfConfig, ParsesCurrentModelPages) {
  const ModelConfig l = parse_ok(kLlama32_1b);
  EXPECT_EQ(l.rope_theta, 500000.0);
  EXPECT_EQ(l.rope_scaling.type, RopeScalingType::kLlama3);
  EXPECT_EQ(l.rope_scaling.factor, 32.0);
  EXPECT_TRUE(l.tie_word_embeddings);
  EXPECT_EQ(num_parameters(l), 1'235'814'400u);  // counted by transformers 5.17 on the meta device
  const ModelConfig q = parse_ok(kQwen25_7b);
  EXPECT_EQ(q.rope_theta, 1e6);
  EXPECT_EQ(q.sliding_window, 0u) << "use_sliding_window is false";
  EXPECT_EQ(num_parameters(q), 7'615'616'512u);
  const ModelConfig m = parse_ok(kMistral_7b_v03);
  EXPECT_EQ(m.rope_theta, 1e6);
  EXPECT_EQ(m.sliding_window, 0u) << "null: no window";
  EXPECT_EQ(num_parameters(m), 7'248'023'552u);
}

// The regression this guards: a Llama-3 config as transformers ≥ 5 writes it used to train with
// rope_theta 10000 and no scaling, silently.
TEST(HfConfig, ReadsTransformers5RopeParametersAsTheOldForm) {
  const ModelConfig v5 = parse_ok(kLlama32_1b_v5);
  const ModelConfig v4 = parse_ok(kLlama32_1b);
  expect_same(v5, v4);
  EXPECT_EQ(v5.rope_theta, 500000.0);
  EXPECT_EQ(v5.rope_scaling.type, RopeScalingType::kLlama3);
  EXPECT_EQ(v5.rope_scaling.factor, 32.0);
  EXPECT_EQ(v5.rope_scaling.original_max_position_embeddings, 8192u);
  const ModelConfig q5 = parse_ok(kQwen25_7b_v5);
  expect_same(q5, parse_ok(kQwen25_7b));
  EXPECT_EQ(q5.rope_theta, 1e6);
  EXPECT_EQ(q5.rope_scaling.type, RopeScalingType::kNone);
}

TEST(HfConfig, RopePrecedenceFollowsTransformers) {
  // The dict's rope_theta wins over the top-level one.
  EXPECT_EQ(
      parse_ok(
          llama2_with(
              "rope_scaling",
              R"(null, "rope_theta": 20000.0, "rope_parameters": {"rope_type": "default", "rope_theta": 40000.0})"))
          .rope_theta,
      40000.0);
  // Without one in the dict, the top-level rope_theta holds.
  EXPECT_EQ(parse_ok(llama2_with("rope_scaling",
                                 R"(null, "rope_theta": 20000.0, "rope_parameters": {"rope_type": "default"})"))
                .rope_theta,
            20000.0);
  // A non-null rope_scaling is read in place of rope_parameters.
  const ModelConfig both = parse_ok(llama2_with(
      "rope_scaling", R"({"rope_type": "linear", "factor": 2.0}, "rope_parameters": {"rope_type": "default"})"));
  EXPECT_EQ(both.rope_scaling.type, RopeScalingType::kLinear);
  // llama3 without original_max_position_embeddings: max_position_embeddings, as transformers 5.
  const ModelConfig l3 = parse_ok(llama2_with(
      "rope_scaling",
      R"(null, "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0})"));
  EXPECT_EQ(l3.rope_scaling.original_max_position_embeddings, 4096u);
  // An empty rope_scaling is no rope_scaling (Python's `rope_scaling or rope_parameters`).
  const ModelConfig empty = parse_ok(llama2_with(
      "rope_scaling",
      R"({}, "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0})"));
  EXPECT_EQ(empty.rope_scaling.type, RopeScalingType::kLlama3);
  EXPECT_EQ(empty.rope_theta, 500000.0);
  // A top-level original_max_position_embeddings wins over the dict's (standardize_rope_params).
  const ModelConfig top = parse_ok(llama2_with(
      "rope_scaling",
      R"(null, "original_max_position_embeddings": 64, "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 32})"));
  EXPECT_EQ(top.rope_scaling.original_max_position_embeddings, 64u);
  // partial_rotary_factor 1.0 is the plain rotary.
  EXPECT_EQ(parse_ok(llama2_with("rope_scaling", R"({"rope_type": "default", "partial_rotary_factor": 1.0})"))
                .rope_scaling.type,
            RopeScalingType::kNone);
}

TEST(HfConfig, SlidingWindowDefaultsAsTransformers) {
  std::string no_window = kMistral_7b;
  const std::string key = "\"sliding_window\": 4096, ";
  no_window.erase(no_window.find(key), key.size());
  EXPECT_EQ(parse_ok(no_window).sliding_window, 4096u) << "transformers' MistralConfig default";
  std::string qwen = kQwen2_05b;
  qwen.replace(qwen.find("\"use_sliding_window\": false"), 27, "\"use_sliding_window\": true");
  EXPECT_EQ(parse_ok(qwen).sliding_window, 131072u);
}

void expect_error(const std::string& text, const std::string& key, const std::string& also = "") {
  Result<ModelConfig> r = parse_hf_config(text, "/models/x/config.json");
  ASSERT_FALSE(r.is_ok()) << key;
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("/models/x/config.json"));
  EXPECT_THAT(r.status().message(), HasSubstr("'" + key + "'"));
  if (!also.empty()) { EXPECT_THAT(r.status().message(), HasSubstr(also)); }
}

TEST(HfConfig, ErrorsNameFileAndKey) {
  expect_error(llama2_with("hidden_size", ""), "hidden_size", "missing");
  expect_error(llama2_with("vocab_size", ""), "vocab_size", "missing");
  expect_error(llama2_with("model_type", ""), "model_type", "missing");
  expect_error(llama2_with("hidden_size", "\"4096\""), "hidden_size", "string");
  expect_error(llama2_with("intermediate_size", "11008.5"), "intermediate_size", "integer");
  expect_error(llama2_with("num_hidden_layers", "0"), "num_hidden_layers", "positive");
  expect_error(llama2_with("vocab_size", "-5"), "vocab_size", "positive");
  expect_error(llama2_with("rms_norm_eps", "0"), "rms_norm_eps", "positive");
  expect_error(llama2_with("tie_word_embeddings", "1"), "tie_word_embeddings");
  expect_error(llama2_with("num_attention_heads", "30"), "num_attention_heads", "not divisible");
  expect_error(llama2_with("num_key_value_heads", "5"), "num_key_value_heads", "multiple");
  expect_error(llama2_with("model_type", "\"gpt2\""), "model_type", "llama, mistral, qwen2, qwen3, olmo2, gemma3_text");
  expect_error(llama2_with("model_type", "\"qwen3_moe\""), "model_type", "mixture-of-experts");
  expect_error(llama2_with("model_type", "\"gemma3\""), "architectures", "Gemma3ForConditionalGeneration");
  expect_error(llama2_with("rope_scaling", R"({"rope_type": "yarn", "factor": 4.0})"), "rope_scaling.rope_type",
               "linear, llama3");
  expect_error(llama2_with("rope_scaling", R"({"type": "dynamic", "factor": 4.0})"), "rope_scaling.type");
  expect_error(llama2_with("rope_scaling", R"({"rope_type": "llama3", "factor": 8.0})"),
               "rope_scaling.low_freq_factor");
  expect_error(llama2_with("rope_scaling", R"({"rope_type": "linear"})"), "rope_scaling.factor", "missing");
  expect_error(llama2_with("rope_scaling", "4"), "rope_scaling");
  expect_error(llama2_with("hidden_act", "\"gelu\""), "hidden_act", "silu");
  expect_error(llama2_with("pretraining_tp", "1, \"attention_bias\": true"), "attention_bias");
}

// Every key that would change what the model computes, set to what zoffload does not implement, is
// refused with the file and the key, never ignored.
// bos_token_id and eos_token_id do not change training but an export's config.json keeps them as the
// source wrote them: Llama 3.1's list of three eos ids, Llama 2's single ids; a value that is none of
// a token id, a list of them or null is refused by key.
TEST(HfConfig, KeepsBosAndEosTokenIdsForTheExport) {
  const ModelConfig l31 = parse_ok(kLlama31_8b);
  EXPECT_EQ(l31.bos_token_id_json, "128000");
  EXPECT_EQ(l31.eos_token_id_json, "[128001,128008,128009]");
  const nlohmann::json out = nlohmann::json::parse(to_hf_config_json(l31, "bfloat16"));
  EXPECT_EQ(out["bos_token_id"], 128000);
  EXPECT_EQ(out["eos_token_id"], nlohmann::json({128001, 128008, 128009}));
  expect_same(parse_ok(to_hf_config_json(l31, "bfloat16")), l31);
  const ModelConfig none = parse_ok(llama2_with("bos_token_id", "null"));
  EXPECT_EQ(none.bos_token_id_json, "null");
  EXPECT_TRUE(nlohmann::json::parse(to_hf_config_json(none, "float32"))["bos_token_id"].is_null());
  ModelConfig preset = parse_ok(kLlama2_7b);
  preset.bos_token_id_json.clear();
  EXPECT_FALSE(nlohmann::json::parse(to_hf_config_json(preset, "float32")).contains("bos_token_id"));
  expect_error(llama2_with("eos_token_id", "\"</s>\""), "eos_token_id", "token id");
  expect_error(llama2_with("bos_token_id", "-1"), "bos_token_id", "token id");
}

// quantization_config as transformers' BitsAndBytesConfig.to_dict writes it for a 4-bit base is read;
// both 4-bit and 8-bit, neither, another storage, another quant type, a key it does not know are
// refused by key.
TEST(HfConfig, ReadsABitsandbytes4BitQuantizationConfig) {
  const std::string four_bit = R"({"_load_in_4bit": true, "_load_in_8bit": false, "bnb_4bit_compute_dtype": "bfloat16",
      "bnb_4bit_quant_storage": "uint8", "bnb_4bit_quant_type": "fp4", "bnb_4bit_use_double_quant": true,
      "llm_int8_enable_fp32_cpu_offload": false, "llm_int8_has_fp16_weight": false,
      "llm_int8_skip_modules": ["mlp.down_proj"], "llm_int8_threshold": 6.0, "load_in_4bit": true,
      "load_in_8bit": false, "quant_method": "bitsandbytes"})";
  auto with = [&](const std::string& edit_key, const std::string& edit_value) {
    std::string q = four_bit;
    if (!edit_key.empty()) q.insert(1, "\"" + edit_key + "\": " + edit_value + ", ");
    return llama2_with("pretraining_tp", "1, \"quantization_config\": " + q);
  };
  Result<ModelConfig> c = parse_hf_config(with("", ""), "/models/x/config.json");
  ASSERT_TRUE(c.is_ok()) << c.status().to_string();
  EXPECT_TRUE(c->quantization.load_in_4bit);
  EXPECT_EQ(c->quantization.quant_type, "fp4");
  EXPECT_TRUE(c->quantization.double_quant);
  EXPECT_EQ(c->quantization.skip_modules, std::vector<std::string>{"mlp.down_proj"});
  EXPECT_TRUE(model_layout(*c).quantization.load_in_4bit);
  EXPECT_FALSE(parse_hf_config(kLlama2_7b, "/models/x/config.json")->quantization.load_in_4bit);

  std::string both = four_bit;
  both.replace(both.find("\"load_in_8bit\": false"), 21, "\"load_in_8bit\": true ");
  expect_error(llama2_with("pretraining_tp", "1, \"quantization_config\": " + both), "quantization_config.load_in_8bit",
               "both true");
  std::string storage = four_bit;
  storage.replace(storage.find("\"uint8\""), 7, "\"bfloat16\"");
  expect_error(llama2_with("pretraining_tp", "1, \"quantization_config\": " + storage),
               "quantization_config.bnb_4bit_quant_storage", "uint8");
  std::string type = four_bit;
  type.replace(type.find("\"fp4\""), 5, "\"int4\"");
  expect_error(llama2_with("pretraining_tp", "1, \"quantization_config\": " + type),
               "quantization_config.bnb_4bit_quant_type", "nf4");
  expect_error(with("bnb_4bit_future", "1"), "quantization_config.bnb_4bit_future", "refused rather than ignored");
  expect_error(llama2_with("pretraining_tp", R"(1, "quantization_config": {"quant_method": "bitsandbytes"})"),
               "quantization_config.load_in_4bit", "neither");
}

// quantization_config as transformers writes it for an 8-bit (LLM.int8) base (its 4-bit keys at
// their defaults) is read; an 8-bit setting that trains 16-bit weights is refused by key.
TEST(HfConfig, ReadsABitsandbytes8BitQuantizationConfig) {
  const std::string eight_bit = R"({"_load_in_4bit": false, "_load_in_8bit": true, "bnb_4bit_compute_dtype": "float32",
      "bnb_4bit_quant_storage": "uint8", "bnb_4bit_quant_type": "fp4", "bnb_4bit_use_double_quant": false,
      "llm_int8_enable_fp32_cpu_offload": false, "llm_int8_has_fp16_weight": false, "llm_int8_skip_modules": null,
      "llm_int8_threshold": 6.0, "load_in_4bit": false, "load_in_8bit": true, "quant_method": "bitsandbytes"})";
  Result<ModelConfig> c = parse_hf_config(llama2_with("pretraining_tp", "1, \"quantization_config\": " + eight_bit),
                                          "/models/x/config.json");
  ASSERT_TRUE(c.is_ok()) << c.status().to_string();
  EXPECT_TRUE(c->quantization.load_in_8bit);
  EXPECT_FALSE(c->quantization.load_in_4bit);
  EXPECT_TRUE(c->quantization.quantized());
  EXPECT_TRUE(model_layout(*c).quantization.load_in_8bit);
  std::string fp16 = eight_bit;
  fp16.replace(fp16.find("\"llm_int8_has_fp16_weight\": false"), 33, "\"llm_int8_has_fp16_weight\": true ");
  expect_error(llama2_with("pretraining_tp", "1, \"quantization_config\": " + fp16),
               "quantization_config.llm_int8_has_fp16_weight", "16-bit weights");
}

TEST(HfConfig, RefusesKeysThatChangeTheArithmetic) {
  auto with_rope_parameters = [](const std::string& dict) {
    return llama2_with("rope_scaling", "null, \"rope_parameters\": " + dict);
  };
  expect_error(with_rope_parameters(R"({"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0})"),
               "rope_parameters.rope_type", "yarn");
  expect_error(with_rope_parameters(R"({"rope_type": "dynamic", "factor": 2.0})"), "rope_parameters.rope_type");
  expect_error(with_rope_parameters(R"({"rope_type": "longrope", "factor": 2.0})"), "rope_parameters.rope_type");
  expect_error(with_rope_parameters(R"({"rope_type": "llama3", "factor": 8.0})"), "rope_parameters.low_freq_factor");
  expect_error(with_rope_parameters(R"({"rope_type": "default", "partial_rotary_factor": 0.5})"),
               "rope_parameters.partial_rotary_factor");
  expect_error(with_rope_parameters(R"({"full_attention": {"rope_type": "default"}})"),
               "rope_parameters.full_attention", "per-layer-type");
  expect_error(with_rope_parameters("[1]"), "rope_parameters", "object");
  expect_error(llama2_with("pretraining_tp", "1, \"partial_rotary_factor\": 0.25"), "partial_rotary_factor");
  expect_error(llama2_with("pretraining_tp", "1, \"attention_dropout\": 0.1"), "attention_dropout", "dropout");
  expect_error(llama2_with("pretraining_tp", R"(1, "quantization_config": {"quant_method": "gptq"})"),
               "quantization_config.quant_method", "bitsandbytes");
  expect_error(llama2_with("pretraining_tp", "1, \"use_mrope\": true"), "use_mrope");
  expect_error(llama2_with("architectures", R"(["LlamaForSequenceClassification"])"), "architectures",
               "LlamaForCausalLM");
  std::string qwen = kQwen25_7b_v5;
  qwen.replace(qwen.find("\"full_attention\""), 16, "\"chunked_attention\"");
  expect_error(qwen, "layer_types", "chunked_attention");
  qwen = kQwen25_7b_v5;
  qwen.replace(qwen.find("\"full_attention\", "), 18, "");
  expect_error(qwen, "layer_types", "num_hidden_layers");
}

TEST(HfConfig, RejectsNonObjects) {
  for (const char* text : {"", "[1, 2]", "{\"model_type\": ", "42"}) {
    Result<ModelConfig> r = parse_hf_config(text, "cfg.json");
    ASSERT_FALSE(r.is_ok()) << text;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(r.status().message(), HasSubstr("cfg.json"));
  }
}

TEST(HfConfig, LoadsFromModelDirectory) {
  testing::TempDir dir;
  Result<ModelConfig> missing = load_hf_config(dir.path(), io::Env::posix());
  ASSERT_FALSE(missing.is_ok());
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_THAT(missing.status().message(), HasSubstr(dir.path() + "/config.json"));
  testing::write_file(dir.file("config.json"), kMistral_7b);
  Result<ModelConfig> r = load_hf_config(dir.path(), io::Env::posix());
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_EQ(r->model_type, "mistral");
}

TEST(ModelPreset, ParameterCountsMatchPublishedFigures) {
  const std::pair<const char*, uint64_t> expected[] = {
      {"tinyllama-1.1b", 1'100'048'384u}, {"llama3.2-1b", 1'235'814'400u}, {"llama3.2-3b", 3'212'749'824u},
      {"llama-7b", 6'738'415'616u},       {"llama3-8b", 8'030'261'248u},   {"llama-13b", 13'015'864'320u},
      {"llama-30b", 32'528'943'616u},     {"llama-70b", 68'976'648'192u}};
  for (const auto& [name, count] : expected) {
    Result<ModelConfig> c = model_preset(name);
    ASSERT_TRUE(c.is_ok()) << c.status().to_string();
    EXPECT_EQ(num_parameters(*c), count) << name;
  }
}

TEST(ModelPreset, ShapesAsDocumented) {
  const ModelConfig tiny = *model_preset("tiny");
  EXPECT_EQ(tiny.vocab_size, 256u);
  EXPECT_EQ(tiny.hidden_size, 256u);
  EXPECT_EQ(tiny.intermediate_size, 688u);
  EXPECT_EQ(tiny.num_hidden_layers, 4u);
  EXPECT_EQ(tiny.num_attention_heads, 8u);
  EXPECT_EQ(tiny.num_key_value_heads, 4u);
  EXPECT_EQ(tiny.head_dim, 32u);
  EXPECT_EQ(tiny.max_position_embeddings, 1024u);
  EXPECT_FALSE(tiny.tie_word_embeddings);
  EXPECT_GT(num_parameters(tiny), 2'000'000u);
  EXPECT_LT(num_parameters(tiny), 10'000'000u);
  EXPECT_TRUE(model_preset("llama3.2-1b")->tie_word_embeddings);
  EXPECT_TRUE(model_preset("llama3.2-3b")->tie_word_embeddings);
  const ModelConfig l3 = *model_preset("llama3-8b");
  EXPECT_EQ(l3.rope_theta, 500000.0);
  EXPECT_EQ(l3.rope_scaling.type, RopeScalingType::kLlama3);
  EXPECT_EQ(l3.rope_scaling.factor, 8.0);
  EXPECT_EQ(model_preset("llama-70b")->num_key_value_heads, 8u);
  // Every preset is a config parse_hf_config accepts.
  for (const std::string& name : model_preset_names()) {
    const ModelConfig c = *model_preset(name);
    expect_same(parse_ok(to_hf_config_json(c, c.source_dtype)), c);
  }
}

TEST(ModelPreset, UnknownNameListsPresetsAndSuggests) {
  Result<ModelConfig> r = model_preset("llama-7");
  ASSERT_FALSE(r.is_ok());
  EXPECT_EQ(r.status().code(), StatusCode::kNotFound);
  EXPECT_THAT(r.status().message(), HasSubstr("did you mean \"llama-7b\""));
  for (const std::string& name : model_preset_names()) EXPECT_THAT(r.status().message(), HasSubstr(name));
}

TEST(ModelLayout, TinyNamesShapesAndOrder) {
  const ModelConfig c = *model_preset("tiny");
  const ModelLayout layout = model_layout(c);
  ASSERT_EQ(layout.params.size(), 1u + 4 * 9 + 2);
  ASSERT_EQ(layout.blocks.size(), 1u + 4 + 1);
  EXPECT_EQ(layout.params[0].name, "model.embed_tokens.weight");
  EXPECT_EQ(layout.params[0].shape, (std::vector<int64_t>{256, 256}));
  const std::vector<std::pair<std::string, std::vector<int64_t>>> layer1 = {
      {"model.layers.1.input_layernorm.weight", {256}},       {"model.layers.1.self_attn.q_proj.weight", {256, 256}},
      {"model.layers.1.self_attn.k_proj.weight", {128, 256}}, {"model.layers.1.self_attn.v_proj.weight", {128, 256}},
      {"model.layers.1.self_attn.o_proj.weight", {256, 256}}, {"model.layers.1.post_attention_layernorm.weight", {256}},
      {"model.layers.1.mlp.gate_proj.weight", {688, 256}},    {"model.layers.1.mlp.up_proj.weight", {688, 256}},
      {"model.layers.1.mlp.down_proj.weight", {256, 688}}};
  const BlockSpec& b1 = layout.blocks[2];
  EXPECT_EQ(b1.kind, BlockKind::kDecoder);
  EXPECT_EQ(b1.layer, 1);
  EXPECT_EQ(b1.name, "model.layers.1");
  ASSERT_EQ(b1.params.size(), layer1.size());
  for (size_t i = 0; i < layer1.size(); ++i) {
    EXPECT_EQ(b1.params[i], 10 + i);
    EXPECT_EQ(layout.params[b1.params[i]].name, layer1[i].first);
    EXPECT_EQ(layout.params[b1.params[i]].shape, layer1[i].second);
  }
  EXPECT_EQ(layout.blocks[0].kind, BlockKind::kEmbedding);
  EXPECT_EQ(layout.blocks[0].name, "model.embed_tokens");
  EXPECT_EQ(layout.blocks[0].params, std::vector<uint32_t>{0});
  const BlockSpec& head = layout.blocks.back();
  EXPECT_EQ(head.kind, BlockKind::kHead);
  EXPECT_EQ(head.name, "model.norm+lm_head");
  ASSERT_EQ(head.params.size(), 2u);
  EXPECT_EQ(layout.params[head.params[0]].name, "model.norm.weight");
  EXPECT_EQ(layout.params[head.params[1]].name, "lm_head.weight");
  EXPECT_EQ(head.params[1], layout.params.size() - 1);
  EXPECT_EQ(layout_elems(layout), num_parameters(c));
}

TEST(ModelLayout, TiedHeadReusesEmbeddingAndQwenHasBiases) {
  const ModelConfig c = parse_ok(kQwen2_05b);
  const ModelLayout layout = model_layout(c);
  ASSERT_EQ(layout.params.size(), 1u + 24 * 12 + 1);
  EXPECT_EQ(layout.blocks.back().params, (std::vector<uint32_t>{static_cast<uint32_t>(layout.params.size() - 1), 0}));
  const BlockSpec& b0 = layout.blocks[1];
  ASSERT_EQ(b0.params.size(), 12u);
  EXPECT_EQ(layout.params[b0.params[2]].name, "model.layers.0.self_attn.q_proj.bias");
  EXPECT_EQ(layout.params[b0.params[2]].shape, std::vector<int64_t>{896});
  EXPECT_EQ(layout.params[b0.params[4]].name, "model.layers.0.self_attn.k_proj.bias");
  EXPECT_EQ(layout.params[b0.params[4]].shape, std::vector<int64_t>{128});
  EXPECT_EQ(layout.params[b0.params[6]].name, "model.layers.0.self_attn.v_proj.bias");
  EXPECT_EQ(layout.params[b0.params[7]].name, "model.layers.0.self_attn.o_proj.weight");
  for (const ParamSpec& p : layout.params) EXPECT_NE(p.name, "lm_head.weight");
}

TEST(HfConfigExport, RoundTripsEveryFamily) {
  for (const std::string& text : {std::string(kLlama2_7b), std::string(kLlama31_8b), std::string(kQwen2_05b),
                                  std::string(kMistral_7b), std::string(kQwen3_8b), std::string(kOlmo2_7b),
                                  std::string(kGemma3_4b), gemma3_12b(), std::string(kPhi3_mini), phi4_mini()}) {
    ModelConfig c = parse_ok(text);
    const std::string json = to_hf_config_json(c, "bfloat16");
    EXPECT_THAT(json, HasSubstr(c.model_type == "qwen2"         ? "Qwen2ForCausalLM"
                                : c.model_type == "qwen3"       ? "Qwen3ForCausalLM"
                                : c.model_type == "olmo2"       ? "Olmo2ForCausalLM"
                                : c.model_type == "gemma3_text" ? "Gemma3ForCausalLM"
                                : c.model_type == "phi3"        ? "Phi3ForCausalLM"
                                : c.model_type == "mistral"     ? "MistralForCausalLM"
                                                                : "LlamaForCausalLM"));
    c.source_dtype = "bfloat16";
    expect_same(parse_ok(json), c);
  }
  ModelConfig linear = parse_ok(llama2_with("rope_scaling", R"({"type": "linear", "factor": 2.5})"));
  linear.source_dtype = "float32";
  expect_same(parse_ok(to_hf_config_json(linear, "float32")), linear);
}

// zoffload.freeze's globs (Note [Frozen sub-groups]): "*" any run (dots too), "?" one character,
// "{a..b}" a decimal in [a, b] without a leading zero; the whole name must match.
TEST(Freeze, GlobsMatchWholeNamesWithRanges) {
  const std::pair<std::string, std::string> yes[] = {
      {"model.embed_tokens.weight", "model.embed_tokens.weight"},
      {"model.layers.*", "model.layers.3.mlp.up_proj.weight"},
      {"model.layers.{0..7}.*", "model.layers.7.self_attn.q_proj.weight"},
      {"model.layers.{8..11}.*", "model.layers.10.mlp.down_proj.weight"},
      {"*.self_attn.?_proj.weight", "model.layers.0.self_attn.k_proj.weight"},
      {"*norm*", "model.norm.weight"},
  };
  for (const auto& [pattern, name] : yes) {
    auto m = name_matches(pattern, name);
    ASSERT_TRUE(m.is_ok()) << m.status().to_string();
    EXPECT_TRUE(*m) << pattern << " ~ " << name;
  }
  const std::pair<std::string, std::string> no[] = {
      {"model.layers.{0..7}.*", "model.layers.8.mlp.up_proj.weight"},
      {"model.layers.{0..7}.*", "model.layers.07.mlp.up_proj.weight"},  // no leading zero
      {"model.layers.{1..1}.*", "model.layers.10.mlp.up_proj.weight"},  // the whole number
      {"model.embed_tokens", "model.embed_tokens.weight"},              // the whole name
      {"*.self_attn.?_proj.weight", "model.layers.0.self_attn.qk_proj.weight"},
  };
  for (const auto& [pattern, name] : no) {
    auto m = name_matches(pattern, name);
    ASSERT_TRUE(m.is_ok()) << m.status().to_string();
    EXPECT_FALSE(*m) << pattern << " ~ " << name;
  }
  for (const std::string bad : {"model.layers.{3..1}.*", "model.layers.{a..b}.*", "model.layers.{1}.*", "x{"}) {
    auto m = name_matches(bad, "model.layers.1.mlp.up_proj.weight");
    ASSERT_FALSE(m.is_ok()) << bad;
    EXPECT_THAT(m.status().message(), HasSubstr("does not open a range {a..b}")) << bad;
  }
}

TEST(Freeze, MarksMatchedParamsAndRefusesByKey) {
  ModelConfig c = *model_preset("tiny");
  ModelLayout layout = model_layout(c);
  const std::vector<std::string> patterns = {"model.embed_tokens.weight", "model.layers.{0..1}.*"};
  ASSERT_TRUE(freeze_params(patterns, &layout).is_ok());
  uint32_t frozen = 0;
  for (const ParamSpec& p : layout.params) {
    const bool expected = p.name == "model.embed_tokens.weight" || p.name.starts_with("model.layers.0.") ||
                          p.name.starts_with("model.layers.1.");
    EXPECT_EQ(p.trainable, !expected) << p.name;
    frozen += expected;
  }
  EXPECT_EQ(frozen, 1 + 2 * 9u);
  ModelLayout other = model_layout(c);
  Status none = freeze_params(std::vector<std::string>{"model.layers.0.*", "model.layer.1.mlp.*"}, &other);
  EXPECT_THAT(none.message(), HasSubstr("zoffload.freeze[1]: \"model.layer.1.mlp.*\" matches no parameter"));
  Status all = freeze_params(std::vector<std::string>{"*"}, &other);
  EXPECT_THAT(all.message(), HasSubstr("zoffload.freeze freezes every parameter of the model"));
}

}  // namespace
}  // namespace zo::engine

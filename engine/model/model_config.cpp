#include "engine/model/model_config.h"

#include <algorithm>
#include <cmath>
#include <span>
#include <utility>

#include <nlohmann/json.hpp>

#include "common/check.h"
#include "common/string_util.h"

namespace zo::engine {
namespace {

using nlohmann::json;

std::string type_name(const json& v) {
  if (v.is_number_integer()) return "integer";
  if (v.is_number_float()) return "number";
  return v.type_name();
}

// Reads the keys of one JSON object, each error naming the file and the key's path.
class KeyReader {
 public:
  KeyReader(const json& object, const std::string& source, std::string prefix)
      : object_(object), source_(source), prefix_(std::move(prefix)) {}

  const json* find(std::string_view key) const {
    auto it = object_.find(std::string(key));
    if (it == object_.end() || it->is_null()) return nullptr;
    return &*it;
  }
  Status error(std::string_view key, std::string_view what) const {
    return invalid_argument(source_ + ": key '" + prefix_ + std::string(key) + "': " + std::string(what));
  }
  Status missing(std::string_view key) const { return error(key, "required but missing"); }
  const std::string& prefix() const { return prefix_; }

  // A positive integer. Absent: `*out` unchanged unless `required`.
  Status size(std::string_view key, uint64_t* out, bool required, bool* present = nullptr) const {
    if (present != nullptr) *present = false;
    const json* v = find(key);
    if (v == nullptr) return required ? missing(key) : Status::ok();
    if (!v->is_number_integer()) return error(key, "expected a positive integer, got " + type_name(*v));
    if (v->is_number_unsigned() ? v->get<uint64_t>() == 0 : v->get<int64_t>() <= 0)
      return error(key, "must be positive, got " + v->dump());
    *out = v->get<uint64_t>();
    if (present != nullptr) *present = true;
    return Status::ok();
  }
  // A number > 0 (or ≥ 0 with allow_zero).
  Status positive(std::string_view key, double* out, bool required = false, bool allow_zero = false) const {
    const json* v = find(key);
    if (v == nullptr) return required ? missing(key) : Status::ok();
    if (!v->is_number()) return error(key, "expected a number, got " + type_name(*v));
    const double d = v->get<double>();
    if (!(allow_zero ? d >= 0.0 : d > 0.0))
      return error(key, std::string("must be ") + (allow_zero ? "non-negative" : "positive") + ", got " + v->dump());
    *out = d;
    return Status::ok();
  }
  Status boolean(std::string_view key, bool* out) const {
    const json* v = find(key);
    if (v == nullptr) return Status::ok();
    if (!v->is_boolean()) return error(key, "expected true or false, got " + type_name(*v));
    *out = v->get<bool>();
    return Status::ok();
  }
  Status string(std::string_view key, std::string* out, bool required = false) const {
    const json* v = find(key);
    if (v == nullptr) return required ? missing(key) : Status::ok();
    if (!v->is_string()) return error(key, "expected a string, got " + type_name(*v));
    *out = v->get<std::string>();
    return Status::ok();
  }

 private:
  const json& object_;
  const std::string& source_;
  std::string prefix_;
};

// A list of positive numbers.
Status positive_list(const KeyReader& r, std::string_view key, std::vector<double>* out) {
  const json* v = r.find(key);
  if (v == nullptr) return r.missing(key);
  if (!v->is_array()) return r.error(key, "expected a list of numbers, got " + type_name(*v));
  out->clear();
  for (const json& x : *v) {
    if (!x.is_number() || !(x.get<double>() > 0)) return r.error(key, "expected positive numbers, got " + x.dump());
    out->push_back(x.get<double>());
  }
  return Status::ok();
}

// The RoPE settings in either form transformers writes (Note [Two RoPE forms]): `dict` is the
// object under `key` ("rope_scaling" or "rope_parameters"), `top` the config's top level. `phi3`:
// partial_rotary_factor and longrope (Phi-3's, also under its old names su and yarn) are read.
Status parse_rope(const KeyReader& top, const char* key, const json& dict, const std::string& source,
                  uint64_t max_position_embeddings, ModelConfig* c, bool phi3 = false) {
  if (!dict.is_object()) return top.error(key, "expected an object or null, got " + type_name(dict));
  KeyReader r(dict, source, top.prefix() + key + ".");
  for (const auto& [name, value] : dict.items()) {
    // transformers ≥ 5 may key the dict by layer type ("full_attention": {...}, ...).
    if (value.is_object())
      return r.error(name, "per-layer-type RoPE settings are not supported (one set for every layer only)");
  }
  // Newer configs name the type "rope_type", older ones "type"; some carry both.
  std::string type = "default";
  const char* type_key = r.find("rope_type") != nullptr ? "rope_type" : "type";
  ZO_RETURN_IF_ERROR(r.string(type_key, &type));
  // The dict's rope_theta wins over the top-level one (as in transformers' convert_rope_params_to_dict).
  ZO_RETURN_IF_ERROR(r.positive("rope_theta", &c->rope_theta));
  double partial = c->partial_rotary_factor;
  ZO_RETURN_IF_ERROR(r.positive("partial_rotary_factor", &partial));
  if (phi3) c->partial_rotary_factor = partial;
  else if (partial != 1.0)
    return r.error("partial_rotary_factor", "only 1.0 (rotary over the whole head) is supported");
  RopeScaling s;
  if (type == "default") {
    // No scaling.
  } else if (type == "linear") {
    s.type = RopeScalingType::kLinear;
    ZO_RETURN_IF_ERROR(r.positive("factor", &s.factor, /*required=*/true));
  } else if (type == "llama3") {
    s.type = RopeScalingType::kLlama3;
    ZO_RETURN_IF_ERROR(r.positive("factor", &s.factor, true));
    ZO_RETURN_IF_ERROR(r.positive("low_freq_factor", &s.low_freq_factor, true));
    ZO_RETURN_IF_ERROR(r.positive("high_freq_factor", &s.high_freq_factor, true));
    // transformers ≥ 5 (standardize_rope_params): a top-level original_max_position_embeddings
    // wins over the dict's, and max_position_embeddings stands in when neither is given.
    s.original_max_position_embeddings = max_position_embeddings;
    ZO_RETURN_IF_ERROR(r.size("original_max_position_embeddings", &s.original_max_position_embeddings, false));
    ZO_RETURN_IF_ERROR(top.size("original_max_position_embeddings", &s.original_max_position_embeddings, false));
    if (s.high_freq_factor <= s.low_freq_factor)
      return r.error("high_freq_factor", "must be greater than low_freq_factor");
  } else if (phi3 && (type == "longrope" || type == "su" || type == "yarn")) {
    // Phi3Config renames su and yarn to longrope; its factors are checked against rotary_dim later.
    s.type = RopeScalingType::kLongRope;
    s.factor = 0;
    ZO_RETURN_IF_ERROR(positive_list(r, "short_factor", &s.short_factor));
    ZO_RETURN_IF_ERROR(positive_list(r, "long_factor", &s.long_factor));
    ZO_RETURN_IF_ERROR(r.positive("factor", &s.factor));
    ZO_RETURN_IF_ERROR(r.positive("attention_factor", &s.attention_factor));
    s.original_max_position_embeddings = 4096;  // Phi3Config's default
    ZO_RETURN_IF_ERROR(r.size("original_max_position_embeddings", &s.original_max_position_embeddings, false));
    ZO_RETURN_IF_ERROR(top.size("original_max_position_embeddings", &s.original_max_position_embeddings, false));
  } else {
    return r.error(type_key, "unsupported RoPE type \"" + type + "\" (supported: default, linear, llama3" +
                                 (phi3 ? ", longrope" : "") + "); training with it would give a different model");
  }
  c->rope_scaling = s;
  return Status::ok();
}

// A key that changes the arithmetic when it has anything but `expected`: refused, never ignored.
Status require_default(const KeyReader& r, std::string_view key, const json& expected, std::string_view why) {
  const json* v = r.find(key);
  if (v == nullptr || *v == expected) return Status::ok();
  return r.error(key, v->dump() + " is not supported (" + std::string(why) + ")");
}

// Gemma 3's own keys (Gemma3TextConfig; its defaults where absent). RoPE: transformers ≥ 5 writes
// rope_parameters per layer type ({"full_attention": {...}, "sliding_attention": {...}}); < 5 wrote
// rope_theta and rope_scaling for the full layers and rope_local_base_freq for the sliding ones.
Status parse_gemma(const KeyReader& r, const json& doc, const std::string& source, ModelConfig* c) {
  c->scale_embeddings = true;
  std::string act = "gelu_pytorch_tanh";
  ZO_RETURN_IF_ERROR(r.string("hidden_activation", &act));
  if (act != "gelu_pytorch_tanh")
    return r.error("hidden_activation", "unsupported activation \"" + act + "\" (supported: gelu_pytorch_tanh)");
  c->activation = MlpActivation::kGeluTanh;
  c->query_pre_attn_scalar = 256;
  ZO_RETURN_IF_ERROR(r.positive("query_pre_attn_scalar", &c->query_pre_attn_scalar));
  ZO_RETURN_IF_ERROR(r.positive("final_logit_softcapping", &c->final_logit_softcap));
  ZO_RETURN_IF_ERROR(
      require_default(r, "attn_logit_softcapping", nullptr, "soft-capped attention scores are not implemented"));
  ZO_RETURN_IF_ERROR(
      require_default(r, "use_bidirectional_attention", false, "zoffload trains causal language models"));
  c->sliding_window = 4096;
  if (doc.contains("sliding_window") && doc["sliding_window"].is_null())
    return r.error("sliding_window", "null is not supported: Gemma 3's sliding layers need a window");
  ZO_RETURN_IF_ERROR(r.size("sliding_window", &c->sliding_window, false));
  c->sliding_layers.assign(c->num_hidden_layers, false);
  if (const json* lt = r.find("layer_types"); lt != nullptr) {
    if (!lt->is_array() || lt->size() != c->num_hidden_layers)
      return r.error("layer_types",
                     "expected a list of num_hidden_layers (" + std::to_string(c->num_hidden_layers) + ") strings");
    for (size_t i = 0; i < lt->size(); ++i) {
      const json& t = (*lt)[i];
      if (t != "full_attention" && t != "sliding_attention")
        return r.error("layer_types", t.dump() + " is not supported (full_attention or sliding_attention)");
      c->sliding_layers[i] = t == "sliding_attention";
    }
  } else {
    uint64_t pattern = 6;  // every sixth layer full, the others sliding
    ZO_RETURN_IF_ERROR(r.size("sliding_window_pattern", &pattern, false));
    for (uint64_t i = 0; i < c->num_hidden_layers; ++i) c->sliding_layers[i] = (i + 1) % pattern != 0;
  }
  c->local_rope_theta = 10000.0;
  ZO_RETURN_IF_ERROR(r.positive("rope_local_base_freq", &c->local_rope_theta));
  const json* rp = r.find("rope_parameters");
  if (rp == nullptr || r.find("rope_scaling") != nullptr) return Status::ok();  // < 5's form, read above
  if (!rp->is_object()) return r.error("rope_parameters", "expected an object or null, got " + type_name(*rp));
  for (const auto& [type, value] : rp->items()) {
    if (type == "full_attention") {
      ZO_RETURN_IF_ERROR(parse_rope(r, "rope_parameters.full_attention", value, source, c->max_position_embeddings, c));
    } else if (type == "sliding_attention") {
      ModelConfig local;
      local.rope_theta = c->local_rope_theta;
      ZO_RETURN_IF_ERROR(
          parse_rope(r, "rope_parameters.sliding_attention", value, source, c->max_position_embeddings, &local));
      if (local.rope_scaling.type != RopeScalingType::kNone)
        return r.error("rope_parameters.sliding_attention",
                       "only the default RoPE type is supported for the sliding layers (as Gemma 3 ships)");
      c->local_rope_theta = local.rope_theta;
    } else {
      return r.error("rope_parameters." + type,
                     "expected the settings of full_attention and sliding_attention (per layer type)");
    }
  }
  return Status::ok();
}

// Phi-3's own keys (Phi3Config; its defaults where absent), after the RoPE settings are read.
Status parse_phi3(const KeyReader& r, ModelConfig* c) {
  const double partial = c->partial_rotary_factor;
  const int64_t rotary = c->rotary_dim();
  if (!(partial > 0 && partial <= 1) || rotary < 2 || rotary % 2 != 0)
    return r.error("partial_rotary_factor",
                   "must give an even rotary width int(head_dim · factor) ≥ 2 within the "
                   "head (head_dim " +
                       std::to_string(c->head_dim) + "), got " + std::to_string(partial));
  const RopeScaling& s = c->rope_scaling;
  if (s.type == RopeScalingType::kLongRope) {
    const auto want = static_cast<size_t>(rotary / 2);
    const char* key = r.find("rope_scaling") != nullptr ? "rope_scaling" : "rope_parameters";
    if (s.short_factor.size() != want || s.long_factor.size() != want)
      return r.error(key, "short_factor and long_factor must have rotary_dim / 2 = " + std::to_string(want) +
                              " entries each, got " + std::to_string(s.short_factor.size()) + " and " +
                              std::to_string(s.long_factor.size()));
  }
  for (const char* key : {"resid_pdrop", "embd_pdrop"}) {
    double dropout = 0.0;
    ZO_RETURN_IF_ERROR(r.positive(key, &dropout, false, /*allow_zero=*/true));
    if (dropout != 0.0) return r.error(key, "only 0 is supported (zoffload trains without dropout)");
  }
  // Phi3Config's window (none by default) applies to every layer, as its model's mask does.
  c->sliding_window = 0;
  ZO_RETURN_IF_ERROR(r.size("sliding_window", &c->sliding_window, false));
  if (c->sliding_window != 0) c->sliding_layers.assign(c->num_hidden_layers, true);
  return Status::ok();
}

const char* architecture_of(const std::string& model_type) { return find_model_family(model_type)->architecture; }

}  // namespace

const std::vector<ModelFamily>& model_families() {
  // clang-format off
  static const std::vector<ModelFamily> families = {
      // model_type     architecture         qkv_bias qk_norm           norms
      //   norm_scale                  rope_in_fp32 phi3  gemma  window window_opt_in mlp_bias_key head_dim pad
      {"llama",         "LlamaForCausalLM",   false, QkNorm::kNone,    NormPlacement::kPre,
         NormScale::kCastThenScale,  false,       false, false, false, false,        true,        0,       -1},
      {"mistral",       "MistralForCausalLM", false, QkNorm::kNone,    NormPlacement::kPre,
         NormScale::kCastThenScale,  false,       false, false, true,  false,        true,        0,       -1},
      {"qwen2",         "Qwen2ForCausalLM",   true,  QkNorm::kNone,    NormPlacement::kPre,
         NormScale::kCastThenScale,  false,       false, false, true,  true,         false,       0,       -1},
      {"qwen3",         "Qwen3ForCausalLM",   false, QkNorm::kPerHead, NormPlacement::kPre,
         NormScale::kCastThenScale,  false,       false, false, true,  true,         false,       128,     -1},
      {"olmo2",         "Olmo2ForCausalLM",   false, QkNorm::kWhole,   NormPlacement::kPost,
         NormScale::kScaleInFp32,    true,        false, false, false, false,        false,       0,       1},
      {"gemma3_text",   "Gemma3ForCausalLM",  false, QkNorm::kPerHead, NormPlacement::kSandwich,
         NormScale::kOnePlusInFp32,  false,       false, true,  false, false,        false,       256,     0},
      {"phi3",          "Phi3ForCausalLM",    false, QkNorm::kNone,    NormPlacement::kPre,
         NormScale::kCastThenScale,  false,       true,  false, false, false,        false,       0,       32000},
  };
  // clang-format on
  return families;
}

const ModelFamily* find_model_family(std::string_view model_type) {
  for (const ModelFamily& f : model_families())
    if (model_type == f.model_type) return &f;
  return nullptr;
}

const ModelFamily& ModelConfig::family() const {
  const ModelFamily* f = find_model_family(model_type);
  ZO_CHECK(f != nullptr) << "model_type " << model_type << " has no family row";
  return *f;
}

namespace {

// One model's config.json object (`prefix`: its key path, "text_config." inside a multimodal one).
Result<ModelConfig> parse_config(const json& doc, const std::string& source_name, const std::string& prefix) {
  const KeyReader r(doc, source_name, prefix);
  ModelConfig c;

  ZO_RETURN_IF_ERROR(r.string("model_type", &c.model_type, /*required=*/true));
  const ModelFamily* family = find_model_family(c.model_type);
  if (family == nullptr) {
    std::vector<std::string> names;
    for (const ModelFamily& f : model_families()) names.emplace_back(f.model_type);
    std::string why;
    if (c.model_type == "qwen3_moe" || c.model_type == "qwen2_moe" || c.model_type == "mixtral" ||
        c.model_type == "olmoe" || c.model_type == "deepseek_v3")
      why = "; mixture-of-experts models are not supported";
    return r.error("model_type",
                   "unsupported model_type \"" + c.model_type + "\" (supported: " + join(names, ", ") + ")" + why);
  }

  ZO_RETURN_IF_ERROR(r.size("vocab_size", &c.vocab_size, true));
  ZO_RETURN_IF_ERROR(r.size("hidden_size", &c.hidden_size, true));
  ZO_RETURN_IF_ERROR(r.size("intermediate_size", &c.intermediate_size, true));
  ZO_RETURN_IF_ERROR(r.size("num_hidden_layers", &c.num_hidden_layers, true));
  ZO_RETURN_IF_ERROR(r.size("num_attention_heads", &c.num_attention_heads, true));
  c.num_key_value_heads = c.num_attention_heads;  // HF's default: multi-head attention
  ZO_RETURN_IF_ERROR(r.size("num_key_value_heads", &c.num_key_value_heads, false));
  bool has_head_dim = false;
  ZO_RETURN_IF_ERROR(r.size("head_dim", &c.head_dim, false, &has_head_dim));
  if (!has_head_dim && family->default_head_dim != 0) {
    c.head_dim = family->default_head_dim;
  } else if (!has_head_dim) {
    if (c.hidden_size % c.num_attention_heads != 0)
      return r.error("num_attention_heads", "hidden_size " + std::to_string(c.hidden_size) +
                                                " is not divisible by num_attention_heads " +
                                                std::to_string(c.num_attention_heads) + " (and head_dim is absent)");
    c.head_dim = c.hidden_size / c.num_attention_heads;
  }
  if (c.head_dim % 2 != 0)
    return r.error("head_dim", "must be even for rotary embeddings, got " + std::to_string(c.head_dim));
  if (c.num_attention_heads % c.num_key_value_heads != 0)
    return r.error("num_key_value_heads", "num_attention_heads " + std::to_string(c.num_attention_heads) +
                                              " is not a multiple of num_key_value_heads " +
                                              std::to_string(c.num_key_value_heads));
  ZO_RETURN_IF_ERROR(r.size("max_position_embeddings", &c.max_position_embeddings, false));
  ZO_RETURN_IF_ERROR(r.positive("rms_norm_eps", &c.rms_norm_eps));
  if (family->gemma) {
    c.rope_theta = 1e6;  // Gemma3TextConfig's defaults: global 1e6, local 1e4, tied
    c.tie_word_embeddings = true;
  }
  ZO_RETURN_IF_ERROR(r.positive("rope_theta", &c.rope_theta));
  ZO_RETURN_IF_ERROR(r.positive("initializer_range", &c.initializer_range, false, /*allow_zero=*/true));
  ZO_RETURN_IF_ERROR(r.boolean("tie_word_embeddings", &c.tie_word_embeddings));
  c.pad_token_id = family->default_pad_token_id;
  if (const json* pad = r.find("pad_token_id"); pad != nullptr) {
    // As nn.Embedding takes padding_idx: -vocab_size ≤ id < vocab_size, a negative one from the end.
    const auto vocab = static_cast<int64_t>(c.vocab_size);
    if (!pad->is_number_integer() || pad->get<int64_t>() < -vocab || pad->get<int64_t>() >= vocab)
      return r.error("pad_token_id", "expected a token id in [-vocab_size, vocab_size) (vocab_size " +
                                         std::to_string(vocab) + ") or null, got " + pad->dump());
    c.pad_token_id = pad->get<int64_t>() < 0 ? pad->get<int64_t>() + vocab : pad->get<int64_t>();
  } else if (doc.contains("pad_token_id")) {
    c.pad_token_id = -1;  // null: no padding row, whatever the family's default
  } else if (c.pad_token_id >= static_cast<int64_t>(c.vocab_size)) {
    return r.error("pad_token_id", "absent, and " + std::string(family->architecture) + "'s default " +
                                       std::to_string(c.pad_token_id) + " is outside the vocabulary (vocab_size " +
                                       std::to_string(c.vocab_size) + "): give it, or null for none");
  }
  // Note [Two RoPE forms]: transformers < 5 writes top-level rope_theta plus rope_scaling (null when
  // unscaled); transformers ≥ 5 writes rope_parameters {rope_type, rope_theta, factor, ...} and no
  // top-level rope_theta. transformers ≥ 5 reads a non-null rope_scaling in place of
  // rope_parameters, and a rope_theta inside the dict in place of the top-level one; so do we.
  // `rope_scaling or rope_parameters` in Python: an empty dict counts as absent, as null does.
  auto given = [&](const char* key) {
    const json* v = r.find(key);
    return v != nullptr && !(v->is_object() && v->empty()) ? v : nullptr;
  };
  // Phi-3's top-level partial_rotary_factor; one in the RoPE dict wins (Phi3Config's setdefault).
  if (family->phi3) ZO_RETURN_IF_ERROR(r.positive("partial_rotary_factor", &c.partial_rotary_factor));
  if (const json* rs = given("rope_scaling"); rs != nullptr) {
    ZO_RETURN_IF_ERROR(parse_rope(r, "rope_scaling", *rs, source_name, c.max_position_embeddings, &c, family->phi3));
  } else if (const json* rp = given("rope_parameters"); rp != nullptr && !family->gemma) {
    ZO_RETURN_IF_ERROR(parse_rope(r, "rope_parameters", *rp, source_name, c.max_position_embeddings, &c, family->phi3));
  }
  if (family->gemma) ZO_RETURN_IF_ERROR(parse_gemma(r, doc, source_name, &c));
  if (family->phi3) {
    ZO_RETURN_IF_ERROR(parse_phi3(r, &c));
  } else {
    double partial = 1.0;
    ZO_RETURN_IF_ERROR(r.positive("partial_rotary_factor", &partial));
    if (partial != 1.0) return r.error("partial_rotary_factor", "only 1.0 (rotary over the whole head) is supported");
  }

  // Note [Config keys that change the arithmetic]: HF configs carry many keys that do not affect
  // training (token ids, use_cache, transformers_version, ...), and those are ignored. The keys
  // below would change what the model computes; anything but their plain-LLaMA value is refused.
  // The full audit of the llama/mistral/qwen2 keys is in docs/training.md ("Models").
  double dropout = 0.0;
  ZO_RETURN_IF_ERROR(r.positive("attention_dropout", &dropout, false, /*allow_zero=*/true));
  if (dropout != 0.0) return r.error("attention_dropout", "only 0 is supported (zoffload trains without dropout)");
  if (r.find("quantization_config") != nullptr)
    return r.error("quantization_config", "quantized checkpoints are not supported (give the 16- or 32-bit weights)");
  ZO_RETURN_IF_ERROR(require_default(r, "use_mrope", false, "multimodal rotary embeddings"));
  if (const json* arch = r.find("architectures"); arch != nullptr) {
    if (!arch->is_array()) return r.error("architectures", "expected a list of strings, got " + type_name(*arch));
    const std::string want = architecture_of(c.model_type);
    for (const json& a : *arch) {
      if (!a.is_string() || a.get<std::string>() != want)
        return r.error("architectures", a.dump() + " is not supported for model_type " + c.model_type + " (only " +
                                            want + ": zoffload trains the causal language-model head)");
    }
  }

  if (!family->gemma) {  // Gemma3TextConfig reads hidden_activation instead (parse_gemma)
    std::string act = "silu";
    ZO_RETURN_IF_ERROR(r.string("hidden_act", &act));
    if (act != "silu") return r.error("hidden_act", "unsupported activation \"" + act + "\" (supported: silu)");
  }

  // A sliding window only matters for sequences longer than it, and block_forward refuses those;
  // transformers' default window (4096) applies where the key is absent, null means none.
  auto read_window = [&]() -> Status {
    if (!doc.contains("sliding_window")) {
      c.sliding_window = 4096;
      return Status::ok();
    }
    return r.size("sliding_window", &c.sliding_window, false);
  };
  if (family->qkv_bias) {
    c.attention_bias = true;  // Qwen2's q/k/v projections always have biases, o_proj none
  } else {
    // Llama's and Qwen3's attention_bias put biases on o_proj too, and mlp_bias on the MLP: not
    // this layout.
    bool bias = false;
    ZO_RETURN_IF_ERROR(r.boolean("attention_bias", &bias));
    if (bias)
      return r.error("attention_bias", "true (biases on q/k/v/o_proj) is not supported for model_type " + c.model_type);
    if (family->mlp_bias_key) {
      ZO_RETURN_IF_ERROR(r.boolean("mlp_bias", &bias));
      if (bias) return r.error("mlp_bias", "true is not supported");
    }
  }
  if (family->window_opt_in) {
    bool use_sliding = false;
    ZO_RETURN_IF_ERROR(r.boolean("use_sliding_window", &use_sliding));
    if (use_sliding) ZO_RETURN_IF_ERROR(read_window());
    if (const json* lt = r.find("layer_types"); lt != nullptr) {
      if (!lt->is_array() || lt->size() != c.num_hidden_layers)
        return r.error("layer_types",
                       "expected a list of num_hidden_layers (" + std::to_string(c.num_hidden_layers) + ") strings");
      for (const json& t : *lt) {
        if (t != "full_attention" && t != "sliding_attention")
          return r.error("layer_types", t.dump() + " is not supported (full_attention or sliding_attention)");
      }
    }
  } else if (family->window) {
    ZO_RETURN_IF_ERROR(read_window());
  }

  // Newer transformers write "dtype", older "torch_dtype".
  ZO_RETURN_IF_ERROR(r.string("dtype", &c.source_dtype));
  ZO_RETURN_IF_ERROR(r.string("torch_dtype", &c.source_dtype));
  return c;
}

// Gemma3TextConfig's defaults for the keys parse_config requires, which the text_config of a
// multimodal Gemma 3 leaves out where they are the defaults (transformers writes a nested config's
// differences only).
const json& gemma3_text_defaults() {
  static const json defaults = {{"vocab_size", 262208},      {"hidden_size", 2304},
                                {"intermediate_size", 9216}, {"num_hidden_layers", 26},
                                {"num_attention_heads", 8},  {"num_key_value_heads", 4},
                                {"head_dim", 256},           {"max_position_embeddings", 131072}};
  return defaults;
}

}  // namespace

Result<ModelConfig> parse_hf_config(std::string_view json_text, const std::string& source_name) {
  const json doc = json::parse(json_text, nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded()) return invalid_argument(source_name + ": not valid JSON");
  if (!doc.is_object()) return invalid_argument(source_name + ": expected a JSON object, got " + type_name(doc));
  if (doc.value("model_type", json()) != "gemma3") return parse_config(doc, source_name, "");
  // Multimodal Gemma 3 (Gemma 3 4B and up as Google ships them): its text model, trained and
  // exported as gemma3_text (Gemma3ForCausalLM); the vision tower is not read (Note [Text weights of
  // a multimodal checkpoint] in weights.cpp).
  const KeyReader r(doc, source_name, "");
  if (const json* arch = r.find("architectures"); arch != nullptr && *arch != json{"Gemma3ForConditionalGeneration"})
    return r.error("architectures", arch->dump() +
                                        " is not supported for model_type gemma3 (only "
                                        "[\"Gemma3ForConditionalGeneration\"], whose text model is trained)");
  const json* tc = r.find("text_config");
  if (tc == nullptr || !tc->is_object())
    return r.error("text_config", "a multimodal Gemma 3 config needs its text model's settings here");
  json text = *tc;
  if (text.value("model_type", json("gemma3_text")) != "gemma3_text")
    return r.error("text_config.model_type", text["model_type"].dump() + " is not gemma3_text");
  text["model_type"] = "gemma3_text";
  for (const auto& [key, value] : gemma3_text_defaults().items())
    if (!text.contains(key) || text[key].is_null()) text[key] = value;
  if (!text.contains("torch_dtype") && !text.contains("dtype") && doc.contains("torch_dtype"))
    text["torch_dtype"] = doc["torch_dtype"];
  Result<ModelConfig> c = parse_config(text, source_name, "text_config.");
  // Gemma3ForConditionalGeneration does not soft-cap its logits (transformers 5.17), whatever
  // text_config says (Gemma 3 ships with none); its text model is trained as it computes.
  if (c.is_ok()) c->final_logit_softcap = 0;
  return c;
}

Result<ModelConfig> load_hf_config(const std::string& model_dir, io::Env* env) {
  const std::string path = model_dir + "/config.json";
  Result<std::string> text = env->read_file(path, "model config", kMaxModelConfigBytes);
  if (text.status().code() == StatusCode::kNotFound)
    return not_found("no model config " + path + " (a Hugging Face model directory has config.json)");
  ZO_RETURN_IF_ERROR(text.status());
  return parse_hf_config(*text, path);
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

std::string to_hf_config_json(const ModelConfig& c, std::string_view torch_dtype) {
  nlohmann::ordered_json j;
  j["architectures"] = {architecture_of(c.model_type)};
  j["model_type"] = c.model_type;
  j["vocab_size"] = c.vocab_size;
  j["hidden_size"] = c.hidden_size;
  j["intermediate_size"] = c.intermediate_size;
  j["num_hidden_layers"] = c.num_hidden_layers;
  j["num_attention_heads"] = c.num_attention_heads;
  j["num_key_value_heads"] = c.num_key_value_heads;
  j["head_dim"] = c.head_dim;
  const ModelFamily& family = c.family();
  if (family.gemma) j["hidden_activation"] = "gelu_pytorch_tanh";
  else j["hidden_act"] = "silu";
  j["max_position_embeddings"] = c.max_position_embeddings;
  j["rms_norm_eps"] = c.rms_norm_eps;
  j["rope_theta"] = c.rope_theta;
  j["initializer_range"] = c.initializer_range;
  switch (c.rope_scaling.type) {
    case RopeScalingType::kNone: j["rope_scaling"] = nullptr; break;
    case RopeScalingType::kLinear:
      j["rope_scaling"] = {{"rope_type", "linear"}, {"type", "linear"}, {"factor", c.rope_scaling.factor}};
      break;
    case RopeScalingType::kLlama3:
      j["rope_scaling"] = {{"rope_type", "llama3"},
                           {"factor", c.rope_scaling.factor},
                           {"low_freq_factor", c.rope_scaling.low_freq_factor},
                           {"high_freq_factor", c.rope_scaling.high_freq_factor},
                           {"original_max_position_embeddings", c.rope_scaling.original_max_position_embeddings}};
      break;
    case RopeScalingType::kLongRope: {
      nlohmann::ordered_json rope = {{"rope_type", "longrope"},
                                     {"type", "longrope"},
                                     {"short_factor", c.rope_scaling.short_factor},
                                     {"long_factor", c.rope_scaling.long_factor}};
      if (c.rope_scaling.factor > 0) rope["factor"] = c.rope_scaling.factor;
      if (c.rope_scaling.attention_factor > 0) rope["attention_factor"] = c.rope_scaling.attention_factor;
      j["rope_scaling"] = rope;
      j["original_max_position_embeddings"] = c.rope_scaling.original_max_position_embeddings;
      break;
    }
  }
  j["tie_word_embeddings"] = c.tie_word_embeddings;
  j["pad_token_id"] = c.pad_token_id >= 0 ? nlohmann::ordered_json(c.pad_token_id) : nullptr;
  if (!family.qkv_bias) j["attention_bias"] = false;
  if (family.mlp_bias_key) j["mlp_bias"] = false;
  if (family.window_opt_in) j["use_sliding_window"] = c.sliding_window != 0;
  if (family.window) j["sliding_window"] = c.sliding_window != 0 ? nlohmann::ordered_json(c.sliding_window) : nullptr;
  if (family.phi3) {
    j["partial_rotary_factor"] = c.partial_rotary_factor;
    j["sliding_window"] = c.sliding_window != 0 ? nlohmann::ordered_json(c.sliding_window) : nullptr;
    j["resid_pdrop"] = 0.0;
    j["embd_pdrop"] = 0.0;
  }
  if (family.gemma) {  // transformers ≥ 5 reads rope_theta/rope_scaling/rope_local_base_freq as < 5 wrote them
    j["rope_local_base_freq"] = c.local_rope_theta;
    // An int in Gemma3TextConfig, which from_pretrained checks.
    const double q = c.query_pre_attn_scalar;
    j["query_pre_attn_scalar"] =
        q == std::floor(q) ? nlohmann::ordered_json(static_cast<int64_t>(q)) : nlohmann::ordered_json(q);
    j["sliding_window"] = c.sliding_window;
    std::vector<std::string> types;
    for (const bool sliding : c.sliding_layers) types.emplace_back(sliding ? "sliding_attention" : "full_attention");
    j["layer_types"] = types;
    j["final_logit_softcapping"] = c.final_logit_softcap > 0 ? nlohmann::ordered_json(c.final_logit_softcap) : nullptr;
    j["attn_logit_softcapping"] = nullptr;
    j["use_bidirectional_attention"] = false;
  }
  j["torch_dtype"] = std::string(torch_dtype);
  return j.dump(2) + "\n";
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
  if (f.phi3) {  // fused, read and written as stored
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
  if (f.phi3) {
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

// Note [LoRA adapters]
// A LoRA adapter on a projection y = W·x (+ b) adds s·B·(A·x), with A [r, in], B [out, r] and
// s = lora_alpha / r (rsLoRA: / √r), as PEFT's LoraLayer computes it: the base output first, then
// lora_B(lora_A(x)) times the scaling, in the compute dtype. The adapters are decoder params of
// their own (DecoderRole kLoraA/kLoraB with the projection they adapt as `target`), appended to
// each layer's list after the family's params, so a model without adapters lays out and
// checkpoints as it always did, and each layer's adapters form a run of consecutive params: with
// the base frozen (Note [Frozen sub-groups]) they share sub-groups of their own. Their names are
// PEFT's saved names without its "base_model.model." prefix: model.layers.<i>.self_attn.q_proj.
// lora_A.weight. Phi-3's fused qkv_proj and gate_up_proj are adapted whole, as PEFT adapts them.

bool LoraSpec::adapts(DecoderRole role) const {
  return r > 0 && std::find(targets.begin(), targets.end(), role) != targets.end();
}

Result<std::vector<DecoderRole>> lora_targets(const ModelConfig& config, std::span<const std::string> modules,
                                              const std::string& key) {
  using R = DecoderRole;
  const bool phi3 = config.family().phi3;
  const std::vector<std::pair<std::string, R>> names =
      phi3 ? std::vector<std::pair<std::string, R>>{{"qkv_proj", R::kQkv},
                                                    {"o_proj", R::kO},
                                                    {"gate_up_proj", R::kGateUp},
                                                    {"down_proj", R::kDown}}
           : std::vector<std::pair<std::string, R>>{
                 {"q_proj", R::kQ},       {"k_proj", R::kK},   {"v_proj", R::kV},      {"o_proj", R::kO},
                 {"gate_proj", R::kGate}, {"up_proj", R::kUp}, {"down_proj", R::kDown}};
  if (modules.empty()) return invalid_argument(key + ": names no module (q_proj, ..., or \"all-linear\")");
  std::vector<R> out;
  for (const std::string& m : modules) {
    if (m == "all-linear") {
      for (const auto& [name, role] : names) out.push_back(role);
      continue;
    }
    auto it = std::find_if(names.begin(), names.end(), [&](const auto& n) { return n.first == m; });
    if (it == names.end()) {
      std::string have;
      for (const auto& [name, role] : names) have += (have.empty() ? "" : ", ") + name;
      const bool fused =
          phi3 && (m == "q_proj" || m == "k_proj" || m == "v_proj" || m == "gate_proj" || m == "up_proj");
      return invalid_argument(key + ": \"" + m + "\" is not a projection of a " + config.model_type + " layer (" +
                              have + ")" +
                              (fused ? std::string("; phi3 fuses them: adapt ") +
                                           (m == "gate_proj" || m == "up_proj" ? "gate_up_proj" : "qkv_proj")
                                     : std::string()));
    }
    out.push_back(it->second);
  }
  // In the family's order, each once.
  std::vector<R> ordered;
  for (const auto& [name, role] : names)
    if (std::find(out.begin(), out.end(), role) != out.end()) ordered.push_back(role);
  return ordered;
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

std::vector<std::string> default_lora_modules(const ModelConfig& config) {
  if (config.family().phi3) return {"qkv_proj"};
  return {"q_proj", "v_proj"};
}

std::string_view lora_module_name(DecoderRole role) {
  using R = DecoderRole;
  switch (role) {
    case R::kQ: return "q_proj";
    case R::kK: return "k_proj";
    case R::kV: return "v_proj";
    case R::kO: return "o_proj";
    case R::kGate: return "gate_proj";
    case R::kUp: return "up_proj";
    case R::kDown: return "down_proj";
    case R::kQkv: return "qkv_proj";
    case R::kGateUp: return "gate_up_proj";
    default: return "";
  }
}

bool is_lora_param(std::string_view name) {
  return name.ends_with(".lora_A.weight") || name.ends_with(".lora_B.weight");
}

namespace {

// "{a..b}" at the start of `p` (after its "{"): its bounds and its length with the braces.
bool parse_range(std::string_view p, uint64_t* lo, uint64_t* hi, size_t* length) {
  const size_t close = p.find('}');
  if (p.empty() || p[0] != '{' || close == std::string_view::npos) return false;
  const std::string_view body = p.substr(1, close - 1);
  const size_t dots = body.find("..");
  if (dots == std::string_view::npos || dots == 0 || dots + 2 >= body.size()) return false;
  auto number = [](std::string_view t, uint64_t* out) {
    if (t.empty() || t.size() > 18) return false;
    *out = 0;
    for (char ch : t) {
      if (ch < '0' || ch > '9') return false;
      *out = *out * 10 + static_cast<uint64_t>(ch - '0');
    }
    return true;
  };
  if (!number(body.substr(0, dots), lo) || !number(body.substr(dots + 2), hi) || *lo > *hi) return false;
  *length = close + 1;
  return true;
}

bool glob(std::string_view p, std::string_view s) {
  if (p.empty()) return s.empty();
  if (p[0] == '*') {
    for (size_t i = 0; i <= s.size(); ++i)
      if (glob(p.substr(1), s.substr(i))) return true;
    return false;
  }
  if (p[0] == '?') return !s.empty() && glob(p.substr(1), s.substr(1));
  if (p[0] == '{') {
    uint64_t lo = 0, hi = 0;
    size_t length = 0;
    ZO_CHECK(parse_range(p, &lo, &hi, &length)) << "checked by name_matches";
    // A number without a leading zero: its digits, as many as are there (at most 18).
    uint64_t value = 0;
    for (size_t n = 1; n <= s.size() && n <= 18 && s[n - 1] >= '0' && s[n - 1] <= '9'; ++n) {
      if (n == 2 && s[0] == '0') break;
      value = value * 10 + static_cast<uint64_t>(s[n - 1] - '0');
      if (value >= lo && value <= hi && glob(p.substr(length), s.substr(n))) return true;
    }
    return false;
  }
  return !s.empty() && p[0] == s[0] && glob(p.substr(1), s.substr(1));
}

}  // namespace

Result<bool> name_matches(std::string_view pattern, std::string_view name) {
  for (size_t i = 0; i < pattern.size(); ++i) {
    if (pattern[i] != '{') continue;
    uint64_t lo = 0, hi = 0;
    size_t length = 0;
    if (!parse_range(pattern.substr(i), &lo, &hi, &length))
      return invalid_argument("\"" + std::string(pattern) + "\": \"{\" at character " + std::to_string(i + 1) +
                              " does not open a range {a..b} of decimal numbers with a ≤ b");
    i += length - 1;
  }
  return glob(pattern, name);
}

Status freeze_params(std::span<const std::string> patterns, ModelLayout* layout) {
  std::vector<std::string> names;
  for (const ParamSpec& p : layout->params) names.push_back(p.name);
  for (size_t i = 0; i < patterns.size(); ++i) {
    const std::string key = "zoffload.freeze[" + std::to_string(i) + "]";
    bool matched = false;
    for (ParamSpec& p : layout->params) {
      Result<bool> m = name_matches(patterns[i], p.name);
      if (!m.is_ok()) return invalid_argument(key + ": " + m.status().message());
      if (!*m) continue;
      p.trainable = false;
      matched = true;
    }
    if (!matched) {
      std::string message = key + ": \"" + patterns[i] + "\" matches no parameter of the model";
      if (const std::string guess = closest_match(patterns[i], names); !guess.empty())
        message += " (did you mean \"" + guess + "\"?)";
      return invalid_argument(
          message + " (the names are Hugging Face's, as in the model's safetensors: " + names.front() + ", ...)");
    }
  }
  if (std::none_of(layout->params.begin(), layout->params.end(), [](const ParamSpec& p) { return p.trainable; }))
    return invalid_argument("zoffload.freeze freezes every parameter of the model: nothing would train");
  return Status::ok();
}

ModelLayout model_layout(const ModelConfig& c) {
  const auto H = static_cast<int64_t>(c.hidden_size);
  const auto V = static_cast<int64_t>(c.vocab_size);
  ModelLayout layout;
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

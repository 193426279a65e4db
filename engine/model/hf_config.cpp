// config.json in and out: ModelConfig from a Hugging Face config (every family's keys, then its
// config class's own; Note [Two RoPE forms]) and back (to_hf_config_json). The rest of
// model_config.h is in model_config.cpp (families, presets, layout) and param_selection.cpp.
#include "engine/model/model_config.h"

#include <algorithm>
#include <cmath>
#include <span>
#include <utility>

#include <nlohmann/json.hpp>

#include "common/bnb4bit.h"
#include "common/check.h"
#include "common/dtype.h"
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
  const std::string& source() const { return source_; }

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
// object under `key` ("rope_scaling" or "rope_parameters"), `top` the config's top level.
// `partial_longrope` (ModelFamily's): partial_rotary_factor and longrope (also under its old names su
// and yarn) are read.
Status parse_rope(const KeyReader& top, const char* key, const json& dict, const std::string& source,
                  uint64_t max_position_embeddings, ModelConfig* c, bool partial_longrope = false) {
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
  if (partial_longrope) c->partial_rotary_factor = partial;
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
  } else if (partial_longrope && (type == "longrope" || type == "su" || type == "yarn")) {
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
                                 (partial_longrope ? ", longrope" : "") +
                                 "); training with it would give a different model");
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

// The rotary width and longrope's factors (ModelFamily::partial_longrope), after the RoPE settings are read.
Status check_partial_rotary(const KeyReader& r, ModelConfig* c) {
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
  return Status::ok();
}

// quantization_config as transformers' BitsAndBytesConfig writes it (to_dict): a 4-bit base, with
// its packed codes in uint8, or an 8-bit (LLM.int8) one whose weights are frozen int8. Every key is
// checked; one this reader does not know is refused.
Status parse_bnb(const KeyReader& parent, const json& q, ModelConfig* c) {
  if (!q.is_object()) return parent.error("quantization_config", "expected an object, got " + type_name(q));
  const KeyReader r(q, parent.source(), parent.prefix() + "quantization_config.");
  const json* method = r.find("quant_method");
  if (method == nullptr || !method->is_string() || method->get<std::string>() != "bitsandbytes")
    return r.error("quant_method",
                   (method == nullptr ? std::string("missing") : method->dump()) +
                       ": only bitsandbytes' 4-bit and 8-bit checkpoints are supported (\"bitsandbytes\")");
  auto flag = [&](std::string_view key, bool* out) -> Status {
    const json* v = r.find(key);
    if (v == nullptr) return Status::ok();
    if (!v->is_boolean()) return r.error(key, "expected true or false, got " + type_name(*v));
    *out = v->get<bool>();
    return Status::ok();
  };
  BnbQuantization b;
  bool in8 = false, in8_private = false, in4_private = false, fp16_weight = false, fp32_offload = false;
  ZO_RETURN_IF_ERROR(flag("load_in_4bit", &b.load_in_4bit));
  ZO_RETURN_IF_ERROR(flag("_load_in_4bit", &in4_private));
  ZO_RETURN_IF_ERROR(flag("load_in_8bit", &in8));
  ZO_RETURN_IF_ERROR(flag("_load_in_8bit", &in8_private));
  b.load_in_4bit = b.load_in_4bit || in4_private;
  b.load_in_8bit = in8 || in8_private;
  if (b.load_in_4bit && b.load_in_8bit)
    return r.error(in8 ? "load_in_8bit" : "_load_in_8bit",
                   "and load_in_4bit are both true: a base is one or the other");
  if (!b.quantized())
    return r.error("load_in_4bit", "neither it nor load_in_8bit is true: say which bitsandbytes base this is");
  ZO_RETURN_IF_ERROR(flag("bnb_4bit_use_double_quant", &b.double_quant));
  ZO_RETURN_IF_ERROR(flag("llm_int8_has_fp16_weight", &fp16_weight));
  ZO_RETURN_IF_ERROR(flag("llm_int8_enable_fp32_cpu_offload", &fp32_offload));
  // An 8-bit base that keeps 16-bit weights to train (bitsandbytes' has_fp16_weights) is not a
  // frozen int8 base; its weights are not stored as int8 codes.
  if (b.load_in_8bit && fp16_weight)
    return r.error("llm_int8_has_fp16_weight",
                   "true: this 8-bit setting trains 16-bit weights, not a frozen int8 base; give the 16-bit weights");
  if (const json* t = r.find("bnb_4bit_quant_type"); t != nullptr) {
    bnb4::QuantType type;
    if (!t->is_string() || !bnb4::parse_quant_type(t->get<std::string>(), &type))
      return r.error("bnb_4bit_quant_type", t->dump() + " is not one of \"nf4\", \"fp4\"");
    b.quant_type = t->get<std::string>();
  }
  if (const json* s = r.find("bnb_4bit_quant_storage"); s != nullptr && (!s->is_string() || *s != "uint8"))
    return r.error("bnb_4bit_quant_storage", s->dump() + ": only \"uint8\" (two codes a byte) is supported");
  if (const json* d = r.find("bnb_4bit_compute_dtype"); d != nullptr) {
    if (!d->is_string() || !parse_dtype(d->get<std::string>()).is_ok())
      return r.error("bnb_4bit_compute_dtype", d->dump() + " is not float32, bfloat16 or float16");
  }
  if (const json* t = r.find("llm_int8_threshold"); t != nullptr && !t->is_number())
    return r.error("llm_int8_threshold", "expected a number, got " + type_name(*t));
  // llm_int8_threshold: LLM.int8's outlier split of the activations in bitsandbytes' int8 matmul;
  // zoffload computes over the dequantized weights as bitsandbytes' training path on the CPU does
  // (Note [The packed 4-bit base]), which does not use it.
  if (const json* m = r.find("llm_int8_skip_modules"); m != nullptr) {
    if (!m->is_array())
      return r.error("llm_int8_skip_modules", "expected a list of module names, got " + type_name(*m));
    for (const json& name : *m) {
      if (!name.is_string()) return r.error("llm_int8_skip_modules", "expected module names, got " + name.dump());
      b.skip_modules.push_back(name.get<std::string>());
    }
  }
  static constexpr std::string_view kKnown[] = {"quant_method",
                                                "load_in_4bit",
                                                "_load_in_4bit",
                                                "load_in_8bit",
                                                "_load_in_8bit",
                                                "bnb_4bit_use_double_quant",
                                                "bnb_4bit_quant_type",
                                                "bnb_4bit_quant_storage",
                                                "bnb_4bit_compute_dtype",
                                                "llm_int8_threshold",
                                                "llm_int8_skip_modules",
                                                "llm_int8_has_fp16_weight",
                                                "llm_int8_enable_fp32_cpu_offload"};
  for (const auto& [key, value] : q.items())
    if (std::find(std::begin(kKnown), std::end(kKnown), key) == std::end(kKnown))
      return r.error(key, "is not a bitsandbytes setting zoffload knows; refused rather than ignored");
  c->quantization = std::move(b);
  return Status::ok();
}

// Phi-3's own keys (Phi3Config; its defaults where absent).
Status parse_phi3(const KeyReader& r, ModelConfig* c) {
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

namespace {

// One model's config.json object (`prefix`: its key path, "text_config." inside a multimodal one).
Result<ModelConfig> parse_config(const json& doc, const std::string& source_name, const std::string& prefix) {
  const KeyReader r(doc, source_name, prefix);
  ModelConfig c;

  ZO_RETURN_IF_ERROR(r.string("model_type", &c.model_type, /*required=*/true));
  const ModelFamily* family = find_model_family(c.model_type);
  if (family == nullptr) {
    std::string why;
    if (c.model_type == "qwen3_moe" || c.model_type == "qwen2_moe" || c.model_type == "mixtral" ||
        c.model_type == "olmoe" || c.model_type == "deepseek_v3")
      why = "; mixture-of-experts models are not supported";
    return r.error("model_type",
                   "unsupported model_type \"" + c.model_type + "\" (supported: " + model_type_list() + ")" + why);
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
  const bool gemma = family->own_keys == FamilyKeys::kGemma3Text;
  if (gemma) {
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
  // A top-level partial_rotary_factor; one in the RoPE dict wins (Phi3Config's setdefault).
  const bool partial = family->partial_longrope;
  if (partial) ZO_RETURN_IF_ERROR(r.positive("partial_rotary_factor", &c.partial_rotary_factor));
  if (const json* rs = given("rope_scaling"); rs != nullptr) {
    ZO_RETURN_IF_ERROR(parse_rope(r, "rope_scaling", *rs, source_name, c.max_position_embeddings, &c, partial));
  } else if (const json* rp = given("rope_parameters"); rp != nullptr && !gemma) {
    ZO_RETURN_IF_ERROR(parse_rope(r, "rope_parameters", *rp, source_name, c.max_position_embeddings, &c, partial));
  }
  if (gemma) ZO_RETURN_IF_ERROR(parse_gemma(r, doc, source_name, &c));
  if (partial) {
    ZO_RETURN_IF_ERROR(check_partial_rotary(r, &c));
  } else {
    double factor = 1.0;
    ZO_RETURN_IF_ERROR(r.positive("partial_rotary_factor", &factor));
    if (factor != 1.0) return r.error("partial_rotary_factor", "only 1.0 (rotary over the whole head) is supported");
  }
  if (family->own_keys == FamilyKeys::kPhi3) ZO_RETURN_IF_ERROR(parse_phi3(r, &c));

  // Note [Config keys that change the arithmetic]: HF configs carry many keys that do not affect
  // training (token ids, use_cache, transformers_version, ...), and those are ignored. The keys
  // below would change what the model computes; anything but their plain-LLaMA value is refused.
  // The full audit of the llama/mistral/qwen2 keys is in docs/training.md ("Models").
  double dropout = 0.0;
  ZO_RETURN_IF_ERROR(r.positive("attention_dropout", &dropout, false, /*allow_zero=*/true));
  if (dropout != 0.0) return r.error("attention_dropout", "only 0 is supported (zoffload trains without dropout)");
  if (const json* q = r.find("quantization_config"); q != nullptr) ZO_RETURN_IF_ERROR(parse_bnb(r, *q, &c));
  const std::pair<const char*, std::string*> token_ids[] = {{"bos_token_id", &c.bos_token_id_json},
                                                            {"eos_token_id", &c.eos_token_id_json}};
  for (const auto& [key, out] : token_ids) {
    const auto it = doc.find(key);
    if (it == doc.end()) continue;
    const bool id = it->is_number_integer() && it->get<int64_t>() >= 0;
    const bool ids = it->is_array() && !it->empty() && std::all_of(it->begin(), it->end(), [](const json& t) {
                       return t.is_number_integer() && t.get<int64_t>() >= 0;
                     });
    if (!id && !ids && !it->is_null())
      return r.error(key, "expected a token id, a list of token ids or null, got " + it->dump());
    *out = it->dump();
  }
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

  if (!gemma) {  // Gemma3TextConfig reads hidden_activation instead (parse_gemma)
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
  const bool gemma = family.own_keys == FamilyKeys::kGemma3Text;
  if (gemma) j["hidden_activation"] = "gelu_pytorch_tanh";
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
  if (!c.bos_token_id_json.empty()) j["bos_token_id"] = nlohmann::ordered_json::parse(c.bos_token_id_json);
  if (!c.eos_token_id_json.empty()) j["eos_token_id"] = nlohmann::ordered_json::parse(c.eos_token_id_json);
  if (!family.qkv_bias) j["attention_bias"] = false;
  if (family.mlp_bias_key) j["mlp_bias"] = false;
  if (family.window_opt_in) j["use_sliding_window"] = c.sliding_window != 0;
  if (family.window) j["sliding_window"] = c.sliding_window != 0 ? nlohmann::ordered_json(c.sliding_window) : nullptr;
  if (family.partial_longrope) j["partial_rotary_factor"] = c.partial_rotary_factor;
  if (family.own_keys == FamilyKeys::kPhi3) {
    j["sliding_window"] = c.sliding_window != 0 ? nlohmann::ordered_json(c.sliding_window) : nullptr;
    j["resid_pdrop"] = 0.0;
    j["embd_pdrop"] = 0.0;
  }
  if (gemma) {  // transformers ≥ 5 reads rope_theta/rope_scaling/rope_local_base_freq as < 5 wrote them
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

}  // namespace zo::engine

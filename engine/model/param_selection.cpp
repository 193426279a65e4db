// Which params: the projections LoRA adapts (Note [LoRA adapters]), PEFT's module names, and the
// name patterns of zoffload.freeze. Declared in model_config.h.
#include "engine/model/model_config.h"

#include <algorithm>
#include <cmath>
#include <span>
#include <utility>

#include <nlohmann/json.hpp>

#include "common/check.h"
#include "common/string_util.h"

namespace zo::engine {

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
  const bool fused_layout = config.family().fused_projections;
  const std::vector<std::pair<std::string, R>> names =
      fused_layout ? std::vector<std::pair<std::string, R>>{{"qkv_proj", R::kQkv},
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
          fused_layout && (m == "q_proj" || m == "k_proj" || m == "v_proj" || m == "gate_proj" || m == "up_proj");
      return invalid_argument(key + ": \"" + m + "\" is not a projection of a " + config.model_type + " layer (" +
                              have + ")" +
                              (fused ? "; " + config.model_type + " fuses them: adapt " +
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

std::vector<std::string> default_lora_modules(const ModelConfig& config) {
  if (config.family().fused_projections) return {"qkv_proj"};  // PEFT's default for phi3, the fused layout
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

bool kept_in_16_bits(std::string_view name, const BnbQuantization& quantization) {
  if (!name.ends_with("_proj.weight")) return true;
  for (const std::string& skip : quantization.skip_modules)
    if (name.find(skip) != std::string_view::npos) return true;
  return false;
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

}  // namespace zo::engine

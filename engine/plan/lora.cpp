#include "engine/plan/lora.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <regex>
#include <set>

#include "common/string_util.h"
#include "engine/ckpt/manifest.h"
#include "engine/model/weights.h"

namespace zo::engine {
namespace {

constexpr uint64_t kMaxAdapterConfigBytes = uint64_t{1} << 20;

std::string module_list(const std::vector<std::string>& modules) {
  std::string out;
  for (const std::string& m : modules) out += (out.empty() ? "" : ", ") + m;
  return "[" + out + "]";
}

}  // namespace

// Note [Reading PEFT's target_modules]
// PEFT matches a list entry against each module's qualified name ("model.layers.0.self_attn.q_proj"):
// the entry is the whole name or a tail of it after a dot (check_target_module_exists). So "q_proj"
// and "self_attn.q_proj" adapt every layer's q_proj, and "model.layers.0.self_attn.q_proj" (how
// PEFT 0.21 saves "all-linear": one entry per layer and projection) only layer 0's. zoffload adapts
// a projection on every layer or on none, so each entry is matched as PEFT matches it against the
// model's projections, and a projection adapted on some layers but not all is refused, as is an
// entry that matches no projection (PEFT would skip it silently, or adapt the head or an embedding).
// A string other than "all-linear" is, to PEFT, a regular expression that a module's qualified
// name must match whole (re.fullmatch): it is matched so (std::regex, ECMAScript, which agrees with
// Python's re on the alternations, classes and anchors such patterns use), under the same rules.
namespace {

Result<std::vector<std::string>> peft_target_modules(const ModelConfig& model, const nlohmann::json& t,
                                                     const std::function<Status(const std::string&)>& bad) {
  if (t.is_string() && t == "all-linear") return std::vector<std::string>{"all-linear"};
  std::optional<std::regex> pattern;
  if (t.is_string()) {
    try {
      pattern.emplace(t.get<std::string>(), std::regex::ECMAScript);
    } catch (const std::regex_error& e) {
      return bad("target_modules is the regular expression " + quote_excerpt(t.get<std::string>(), 200) +
                 ", which does not compile (" + e.what() + ")");
    }
  } else if (!t.is_array() || t.empty() ||
             !std::all_of(t.begin(), t.end(), [](const auto& m) { return m.is_string(); })) {
    return bad("target_modules is " + quote_excerpt(t.dump(), 200) +
               ": zoffload reads a list of module names (q_proj, ...), \"all-linear\", or a regular expression "
               "as a string");
  }
  // The model's adaptable projections by qualified module name, with their layer.
  ZO_ASSIGN_OR_RETURN(const std::vector<DecoderRole> all, lora_targets(model, std::vector<std::string>{"all-linear"},
                                                                        "zoffload.lora.target_modules"));
  std::vector<std::string> projections;
  for (DecoderRole role : all) projections.emplace_back(lora_module_name(role));
  struct Module {
    std::string key, name;  // "model.layers.3.self_attn.q_proj", "q_proj"
    uint64_t layer;
  };
  std::vector<Module> modules;
  const ModelLayout layout = model_layout(model);
  for (const BlockSpec& block : layout.blocks) {
    if (block.kind != BlockKind::kDecoder) continue;
    for (uint32_t p : block.params) {
      std::string key = layout.params[p].name;
      if (!key.ends_with(".weight")) continue;
      key.resize(key.size() - std::string_view(".weight").size());
      const std::string name = key.substr(key.rfind('.') + 1);
      if (std::find(projections.begin(), projections.end(), name) != projections.end())
        modules.push_back({key, name, static_cast<uint64_t>(block.layer)});
    }
  }
  std::map<std::string, std::set<uint64_t>> adapted;  // projection name → layers
  const std::string example = modules.empty() ? std::string("-") : modules.front().key;
  if (pattern) {
    for (const Module& mod : modules)
      if (std::regex_match(mod.key, *pattern)) adapted[mod.name].insert(mod.layer);
    if (adapted.empty())
      return bad("target_modules is the regular expression " + quote_excerpt(t.get<std::string>(), 200) +
                 ", which matches none of this " + model.model_type + " model's decoder projections (" +
                 join(projections, ", ") + ") by qualified name, such as " + example + ": zoffload adapts those only");
  }
  for (const auto& m : pattern ? nlohmann::json::array() : t) {
    const std::string entry = m.get<std::string>();
    bool any = false;
    for (const Module& mod : modules) {
      if (mod.key == entry || mod.key.ends_with("." + entry)) {
        adapted[mod.name].insert(mod.layer);
        any = true;
      }
    }
    if (!any)
      return bad("target_modules names \"" + quote_excerpt(entry, 200) + "\", which is none of this " +
                 model.model_type + " model's decoder projections (" + join(projections, ", ") +
                 ", or their qualified names such as " + example + "): zoffload adapts those only");
  }
  std::vector<std::string> out;
  for (const std::string& name : projections) {
    const auto it = adapted.find(name);
    if (it == adapted.end()) continue;
    if (it->second.size() != model.num_hidden_layers) {
      std::vector<std::string> layers;
      for (uint64_t l : it->second) layers.push_back(std::to_string(l));
      if (layers.size() > 8) {
        layers.resize(8);
        layers.emplace_back("...");
      }
      return bad("target_modules adapts " + name + " on " + std::to_string(it->second.size()) + " of the model's " +
                 std::to_string(model.num_hidden_layers) + " layers (" + join(layers, ", ") +
                 "): zoffload adapts a projection on every layer or on none");
    }
    out.push_back(name);
  }
  return out;
}

// init_lora_weights values whose adapters are plain LoRA over the base as it is: PEFT only draws the
// first A and B differently (EVA zeroes B and is filled by a separate call; "orthogonal" draws A and B
// with B·A = 0), and a saved adapter loads the same way.
bool plain_lora_init(const nlohmann::json& v) {
  return v.is_boolean() || v.is_null() || v == "gaussian" || v == "eva" || v == "orthogonal";
}

}  // namespace

Status read_peft_adapter_config(const ModelConfig& model, LoraConfig* lora, io::Env* env) {
  if (lora->init_from.empty()) return Status::ok();
  const std::string key = "zoffload.lora.init_from";
  const std::string path = lora->init_from + "/" + kPeftConfigFile;
  ZO_ASSIGN_OR_RETURN(const io::PathKind kind, env->path_kind(lora->init_from));
  if (kind != io::PathKind::kDirectory)
    return invalid_argument(key + ": " + lora->init_from + " is not a directory (a PEFT adapter directory, with " +
                            kPeftConfigFile + " and " + kPeftWeightsFile +
                            "; a relative path is relative to the working directory)");
  Result<std::string> text = env->read_file(path, "PEFT adapter config", kMaxAdapterConfigBytes);
  if (!text.is_ok()) return invalid_argument(key + ": " + text.status().message());
  const nlohmann::json j = nlohmann::json::parse(*text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return invalid_argument(key + ": " + path + " is not a JSON object");
  auto bad = [&](const std::string& what) { return invalid_argument(key + ": " + path + ": " + what); };
  if (!j.contains("peft_type") || j["peft_type"] != "LORA")
    return bad("peft_type is " + (j.contains("peft_type") ? quote_excerpt(j["peft_type"].dump(), 100) : "missing") +
               ", not \"LORA\"");
  if (!j.contains("r") || !j["r"].is_number_integer() || j["r"].get<int64_t>() < 1)
    return bad("r must be a whole number ≥ 1");
  // The scale alpha / r is multiplied in fp32 (zoffload.lora.lora_alpha's range).
  if (!j.contains("lora_alpha") || !j["lora_alpha"].is_number() || !(j["lora_alpha"].get<double>() > 0) ||
      j["lora_alpha"].get<double>() > std::numeric_limits<float>::max())
    return bad("lora_alpha must be a number > 0 and at most 3.4e38 (got " +
               (j.contains("lora_alpha") ? quote_excerpt(j["lora_alpha"].dump(), 40) : std::string("none")) + ")");
  // PEFT tests `if use_rslora:`, so the string "false" would be true there: only a boolean is read.
  const nlohmann::json rslora = j.value("use_rslora", nlohmann::json(false));
  if (!rslora.is_boolean() && !rslora.is_null())
    return bad("use_rslora is " + quote_excerpt(rslora.dump(), 40) +
               ": give true or false (PEFT reads any non-empty string as true)");
  // What would change the adapted forward beyond s·B·A·x on whole projections: refused by name.
  auto is_set = [&](const char* name) {
    if (!j.contains(name)) return false;
    const nlohmann::json& v = j[name];
    return !(v.is_null() || v == false || (v.is_object() && v.empty()) || (v.is_array() && v.empty()) ||
             (v.is_string() && v == "none"));
  };
  for (const char* name : {"use_dora", "bias", "fan_in_fan_out", "rank_pattern", "alpha_pattern", "layers_to_transform",
                           "layers_pattern", "modules_to_save", "layer_replication", "lora_bias", "exclude_modules",
                           "target_parameters", "use_qalora", "trainable_token_indices", "alora_invocation_tokens",
                           "arrow_config", "kasa_config", "monteclora_config", "use_bdlora", "megatron_config"}) {
    if (is_set(name))
      return bad(std::string(name) + " is " + quote_excerpt(j[name].dump(), 100) +
                 ": zoffload's adapters are plain LoRA on whole projections (no DoRA, biases, per-layer ranks or "
                 "layers, saved modules or trainable tokens)");
  }
  // PiSSA, OLoRA, CorDA, LoftQ and LoRA-GA adapters belong to a base PEFT rewrites from the adapter
  // (W minus the initial B·A, or a quantized W) when it loads them; MiCA trains A alone.
  if (j.contains("init_lora_weights") && !plain_lora_init(j["init_lora_weights"]))
    return bad("init_lora_weights is " + quote_excerpt(j["init_lora_weights"].dump(), 60) +
               ": PEFT rebuilds the base weights from such an adapter (PiSSA, OLoRA, CorDA, LoftQ, LoRA-GA) or trains "
               "it otherwise (MiCA); zoffload trains plain LoRA over the base as it is. Convert it to plain LoRA first "
               "(PEFT's save_pretrained with path_initial_model_for_weight_conversion)");
  const nlohmann::json dropout = j.value("lora_dropout", nlohmann::json(0.0));
  if (!dropout.is_number() || !(dropout.get<double>() >= 0 && dropout.get<double>() <= 1))
    return bad("lora_dropout is " + quote_excerpt(dropout.dump(), 40) + ": a number in [0, 1] is needed");
  if (dropout.get<double>() != 0 && !lora->lora_dropout_given)
    return bad("lora_dropout is " + format_number(dropout.get<double>()) +
               ": zoffload's adapters train without dropout; set zoffload.lora.lora_dropout to 0 to train this "
               "adapter without it");
  ZO_ASSIGN_OR_RETURN(const std::vector<std::string> modules,
                      peft_target_modules(model, j.contains("target_modules") ? j["target_modules"] : nlohmann::json(),
                                          [&](const std::string& what) { return bad(what); }));
  const auto r = static_cast<uint64_t>(j["r"].get<int64_t>());
  const double alpha = j["lora_alpha"].get<double>();
  const bool use_rslora = rslora == true;
  if (lora->r != 0 && lora->r != r)
    return invalid_argument("zoffload.lora.r is " + std::to_string(lora->r) + ", but " + path + " has r " +
                            std::to_string(r) + ": leave r out to take the adapter's");
  if (lora->lora_alpha_given && lora->lora_alpha != alpha)
    return invalid_argument("zoffload.lora.lora_alpha is " + format_number(lora->lora_alpha) + ", but " + path +
                            " has lora_alpha " + format_number(alpha) + ": leave lora_alpha out to take the adapter's");
  if (lora->use_rslora_given && lora->use_rslora != use_rslora)
    return invalid_argument(std::string("zoffload.lora.use_rslora is ") + (lora->use_rslora ? "true" : "false") +
                            ", but " + path + " has use_rslora " + (use_rslora ? "true" : "false") +
                            ": leave use_rslora out to take the adapter's");
  if (!lora->target_modules.empty()) {
    ZO_ASSIGN_OR_RETURN(const std::vector<DecoderRole> a,
                        lora_targets(model, lora->target_modules, "zoffload.lora.target_modules"));
    ZO_ASSIGN_OR_RETURN(const std::vector<DecoderRole> b, lora_targets(model, modules, key));
    if (a != b)
      return invalid_argument("zoffload.lora.target_modules is " + module_list(lora->target_modules) + ", but " + path +
                              " adapts " + module_list(modules) + ": leave target_modules out to take the adapter's");
  }
  lora->r = r;
  lora->lora_alpha = alpha;
  lora->use_rslora = use_rslora;
  lora->target_modules = modules;
  lora->lora_dropout = 0;
  return Status::ok();
}

Result<LoraSpec> lora_spec(const ModelConfig& model, const LoraConfig& lora) {
  LoraSpec spec;
  if (lora.r == 0) return spec;
  if (lora.r > model.hidden_size)
    return invalid_argument("zoffload.lora.r " + std::to_string(lora.r) + " exceeds the model's hidden_size (" +
                            std::to_string(model.hidden_size) + ")");
  spec.r = static_cast<uint32_t>(lora.r);
  spec.alpha = lora.lora_alpha;
  spec.rslora = lora.use_rslora;
  const std::vector<std::string> modules =
      lora.target_modules.empty() ? default_lora_modules(model) : lora.target_modules;
  ZO_ASSIGN_OR_RETURN(spec.targets, lora_targets(model, modules, "zoffload.lora.target_modules"));
  return spec;
}

Result<LoraConfig> checkpoint_lora_config(const nlohmann::json& config, const std::string& source) {
  LoraConfig lc;
  if (!config.is_object() || !config.contains("zoffload") || !config["zoffload"].is_object() ||
      !config["zoffload"].contains("lora"))
    return lc;
  const nlohmann::json& lora = config["zoffload"]["lora"];
  try {
    lc.r = lora.value("r", uint64_t{0});
    lc.lora_alpha = lora.value("lora_alpha", LoraConfig{}.lora_alpha);
    lc.use_rslora = lora.value("use_rslora", false);
    lc.target_modules = lora.value("target_modules", std::vector<std::string>{});
  } catch (const nlohmann::json::exception& e) {
    return corruption(source + ": its config's zoffload.lora is malformed: " + quote_excerpt(e.what(), 200));
  }
  if (!(lc.lora_alpha > 0) || lc.lora_alpha > std::numeric_limits<float>::max())
    return corruption(source + ": its config's zoffload.lora.lora_alpha " + format_number(lc.lora_alpha) +
                      " is not a number in (0, 3.4e38]");
  return lc;
}

std::string lora_difference(const LoraSpec& saved, const LoraSpec& run) {
  auto targets = [](const LoraSpec& s) {
    std::vector<std::string> names;
    for (DecoderRole role : s.targets) names.emplace_back(lora_module_name(role));
    return module_list(names);
  };
  if (saved.r != run.r) return "r " + std::to_string(saved.r) + ", not " + std::to_string(run.r);
  if (saved.r == 0) return "";
  if (saved.targets != run.targets) return "target_modules " + targets(saved) + ", not " + targets(run);
  if (saved.alpha != run.alpha)
    return "lora_alpha " + format_number(saved.alpha) + ", not " + format_number(run.alpha);
  if (saved.rslora != run.rslora)
    return std::string("use_rslora ") + (saved.rslora ? "true" : "false") + ", not " + (run.rslora ? "true" : "false");
  return "";
}

Status check_lora_tensors(const ModelConfig& model, const LoraSpec& spec,
                          const std::vector<std::pair<std::string, std::vector<int64_t>>>& tensors,
                          const std::string& source) {
  ModelConfig with = model;
  with.lora = spec;
  std::vector<std::pair<std::string, std::vector<int64_t>>> want, have;
  for (const ParamSpec& p : model_layout(with).params)
    if (is_lora_param(p.name)) want.emplace_back(p.name, p.shape);
  for (const auto& t : tensors)
    if (is_lora_param(t.first)) have.push_back(t);
  const std::string says = "its config's zoffload.lora (r " + std::to_string(spec.r) + ")";
  if (want.size() != have.size())
    return corruption(source + ": it holds " + std::to_string(have.size()) + " LoRA adapter tensors, but " + says +
                      " lays out " + std::to_string(want.size()) + ": its trainer_state.json does not describe it");
  for (size_t i = 0; i < want.size(); ++i) {
    if (want[i] != have[i])
      return corruption(source + ": adapter tensor " + have[i].first + " " + shape_string(have[i].second) + ", but " +
                        says + " lays out " + want[i].first + " " + shape_string(want[i].second) +
                        ": its trainer_state.json does not describe it");
  }
  return Status::ok();
}

std::string peft_adapter_config_json(const LoraSpec& spec, const std::string& base_model) {
  nlohmann::json modules = nlohmann::json::array();
  for (DecoderRole role : spec.targets) modules.push_back(std::string(lora_module_name(role)));
  // An integral alpha as PEFT's int (16, not 16.0).
  const nlohmann::json alpha = spec.alpha == std::floor(spec.alpha) && std::abs(spec.alpha) < 1e15
                                   ? nlohmann::json(static_cast<int64_t>(spec.alpha))
                                   : nlohmann::json(spec.alpha);
  nlohmann::json j = {{"alpha_pattern", nlohmann::json::object()},
                      {"auto_mapping", nullptr},
                      {"base_model_name_or_path", base_model},
                      {"bias", "none"},
                      {"fan_in_fan_out", false},
                      {"inference_mode", true},
                      {"init_lora_weights", true},
                      {"layers_pattern", nullptr},
                      {"layers_to_transform", nullptr},
                      {"lora_alpha", alpha},
                      {"lora_dropout", 0.0},
                      {"modules_to_save", nullptr},
                      {"peft_type", "LORA"},
                      {"r", spec.r},
                      {"rank_pattern", nlohmann::json::object()},
                      {"revision", nullptr},
                      {"target_modules", modules},
                      {"task_type", "CAUSAL_LM"},
                      {"use_dora", false},
                      {"use_rslora", spec.rslora}};
  return j.dump(2) + "\n";
}

}  // namespace zo::engine

#include "engine/plan/lora.h"

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>
#include <set>

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

Status read_peft_adapter_config(LoraConfig* lora, io::Env* env) {
  if (lora->init_from.empty()) return Status::ok();
  const std::string key = "zoffload.lora.init_from";
  const std::string path = lora->init_from + "/" + kPeftConfigFile;
  ZO_ASSIGN_OR_RETURN(const io::PathKind kind, env->path_kind(lora->init_from));
  if (kind != io::PathKind::kDirectory)
    return invalid_argument(key + ": " + lora->init_from + " is not a directory (a PEFT adapter directory, with " +
                            kPeftConfigFile + " and " + kPeftWeightsFile + ")");
  Result<std::string> text = env->read_file(path, "PEFT adapter config", kMaxAdapterConfigBytes);
  if (!text.is_ok()) return invalid_argument(key + ": " + text.status().message());
  const nlohmann::json j = nlohmann::json::parse(*text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return invalid_argument(key + ": " + path + " is not a JSON object");
  auto bad = [&](const std::string& what) { return invalid_argument(key + ": " + path + ": " + what); };
  if (!j.contains("peft_type") || j["peft_type"] != "LORA")
    return bad("peft_type is " + (j.contains("peft_type") ? j["peft_type"].dump() : std::string("missing")) +
               ", not \"LORA\"");
  if (!j.contains("r") || !j["r"].is_number_integer() || j["r"].get<int64_t>() < 1)
    return bad("r must be a whole number ≥ 1");
  if (!j.contains("lora_alpha") || !j["lora_alpha"].is_number() || j["lora_alpha"].get<double>() <= 0)
    return bad("lora_alpha must be a number > 0");
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
      return bad(std::string(name) + " is " + j[name].dump() +
                 ": zoffload's adapters are plain LoRA on whole projections (no DoRA, biases, per-layer ranks or "
                 "layers, saved modules or trainable tokens)");
  }
  std::vector<std::string> modules;
  const nlohmann::json& t = j.contains("target_modules") ? j["target_modules"] : nlohmann::json();
  if (t.is_string() && t == "all-linear") {
    modules = {"all-linear"};
  } else if (t.is_array() && !t.empty() &&
             std::all_of(t.begin(), t.end(), [](const auto& m) { return m.is_string(); })) {
    // PEFT matches a name against a module's name or its last components, and saves "all-linear"
    // expanded into qualified names ("model.layers.0.self_attn.q_proj"): each is taken as its last
    // component, on every layer. An adapter that covers only some layers is then missing a tensor,
    // which load_peft_adapters names.
    for (const auto& m : t) {
      std::string name = m.get<std::string>();
      if (const size_t dot = name.rfind('.'); dot != std::string::npos) name = name.substr(dot + 1);
      if (std::find(modules.begin(), modules.end(), name) == modules.end()) modules.push_back(name);
    }
  } else {
    return bad("target_modules is " + t.dump() +
               ": zoffload reads a list of module names (q_proj, ...) or \"all-linear\", not a regular expression");
  }
  const auto r = static_cast<uint64_t>(j["r"].get<int64_t>());
  if (lora->r != 0 && lora->r != r)
    return invalid_argument("zoffload.lora.r is " + std::to_string(lora->r) + ", but " + path + " has r " +
                            std::to_string(r) + ": leave r out to take the adapter's");
  if (!lora->target_modules.empty()) {
    std::set<std::string> a(lora->target_modules.begin(), lora->target_modules.end()),
        b(modules.begin(), modules.end());
    if (a != b)
      return invalid_argument("zoffload.lora.target_modules is " + module_list(lora->target_modules) + ", but " + path +
                              " adapts " + module_list(modules) + ": leave target_modules out to take the adapter's");
  }
  lora->r = r;
  lora->lora_alpha = j["lora_alpha"].get<double>();
  lora->use_rslora = j.contains("use_rslora") && j["use_rslora"] == true;
  lora->target_modules = modules;
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

// LoRA runs (Note [LoRA adapters] in engine/model/param_selection.cpp): zoffload.lora resolved against
// a model, and PEFT's adapter_config.json read and written. No LibTorch.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "common/status.h"
#include "engine/config/config.h"
#include "engine/model/model_config.h"
#include "io/env.h"

namespace zo::engine {

// With zoffload.lora.init_from, reads that directory's adapter_config.json into `lora`: its r,
// lora_alpha, target_modules (written as the list of `model`'s projection names, matched as PEFT
// matches them: Note [Reading PEFT's target_modules]) and use_rslora. kInvalidArgument naming
// zoffload.lora.init_from for a file that is not a LoRA config, or one asking for what zoffload's
// adapters do not do (DoRA, biases, fan_in_fan_out, per-layer ranks or alphas, layers_to_transform,
// a projection on some layers only, aLoRA, Arrow, modules_to_save, an init_lora_weights by which PEFT
// rewrites the base (PiSSA, OLoRA, CorDA, LoftQ, LoRA-GA) or MiCA, dropout unless the config gives
// lora_dropout 0, a use_rslora that is not a boolean, ...); naming zoffload.lora.r, .lora_alpha,
// .use_rslora or .target_modules where the config gave them and they disagree with the file.
// Nothing to do without init_from, which is relative to the working directory.
Status read_peft_adapter_config(const ModelConfig& model, LoraConfig* lora, io::Env* env);

// The adapters zoffload.lora asks of `model` (r 0: none); kInvalidArgument naming
// zoffload.lora.target_modules for a module the family does not have.
Result<LoraSpec> lora_spec(const ModelConfig& model, const LoraConfig& lora);

// The zoffload.lora of a checkpoint's resolved config (trainer_state.json's "config"): r 0 when it
// has none. kCorruption naming `source` for a block of the wrong shape.
Result<LoraConfig> checkpoint_lora_config(const nlohmann::json& config, const std::string& source);

// Whether two runs' adapters compute the same function of the same tensors: r, targets, alpha and
// rsLoRA; the first difference said in words ("lora_alpha 16, not 32"), empty when none.
std::string lora_difference(const LoraSpec& saved, const LoraSpec& run);

// The adapter tensors of the tensors `names`/`shapes` of a checkpoint must be exactly those `spec`
// lays out over `model`: kCorruption naming `source` and the first tensor that differs (a
// trainer_state edited to another r, say).
Status check_lora_tensors(const ModelConfig& model, const LoraSpec& spec,
                          const std::vector<std::pair<std::string, std::vector<int64_t>>>& tensors,
                          const std::string& source);

// PEFT's adapter_config.json for `spec` over the base `base_model` (a directory or a hub id), as
// PEFT ≥ 0.13 writes it for a causal LM: peft_type LORA, r, lora_alpha, use_rslora,
// target_modules by name, and the defaults of everything else.
std::string peft_adapter_config_json(const LoraSpec& spec, const std::string& base_model);

}  // namespace zo::engine

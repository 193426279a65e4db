// LoRA runs (Note [LoRA adapters] in engine/model/model_config.cpp): zoffload.lora resolved against
// a model, and PEFT's adapter_config.json read and written. No LibTorch.
#pragma once

#include <string>

#include "common/status.h"
#include "engine/config/config.h"
#include "engine/model/model_config.h"
#include "io/env.h"

namespace zo::engine {

// With zoffload.lora.init_from, reads that directory's adapter_config.json into `lora`: its r,
// lora_alpha, target_modules (written as the list of module names) and use_rslora. kInvalidArgument
// naming zoffload.lora.init_from for a file that is not a LoRA config, or one asking for what
// zoffload's adapters do not do (DoRA, biases, fan_in_fan_out, per-layer ranks or alphas, layers_to_transform, aLoRA, Arrow,
// modules_to_save, ...); naming zoffload.lora.r or .target_modules where those keys were given and
// disagree with the file. Nothing to do without init_from.
Status read_peft_adapter_config(LoraConfig* lora, io::Env* env = io::Env::posix());

// The adapters zoffload.lora asks of `model` (r 0: none); kInvalidArgument naming
// zoffload.lora.target_modules for a module the family does not have.
Result<LoraSpec> lora_spec(const ModelConfig& model, const LoraConfig& lora);

// PEFT's adapter_config.json for `spec` over the base `base_model` (a directory or a hub id), as
// PEFT ≥ 0.13 writes it for a causal LM: peft_type LORA, r, lora_alpha, use_rslora,
// target_modules by name, and the defaults of everything else.
std::string peft_adapter_config_json(const LoraSpec& spec, const std::string& base_model);

}  // namespace zo::engine

// Filling every parameter of a ModelLayout, chunk by chunk, into wherever the caller keeps it (its
// home tier): from a Hugging Face model directory or by deterministic random init. RAM use is
// bounded by one chunk; the whole model is never in memory. Functions are thread-safe; the sink is
// called on the calling thread, one param after another in layout order.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>

#include "common/bnb4bit.h"
#include "common/status.h"
#include "engine/model/model_config.h"
#include "io/env.h"

namespace zo::engine {

// Receives consecutive chunks of one param, in fp32 (`values` is valid only during the call);
// returning an error stops the load with that error.
using ParamSink = std::function<Status(uint32_t param, uint64_t offset_elems, std::span<const float> values)>;
// Receives a packed weight's blob (ParamSpec::packed: Note [The packed 4-bit base] in
// common/bnb4_blob.h) in pieces that cover it once, in any order (`bytes` valid only during the call).
using PackedSink = std::function<Status(uint32_t param, uint64_t offset_bytes, std::span<const std::byte> bytes)>;

// Streams every param of `layout` but its LoRA adapters (is_lora_param: see init_lora_adapters and
// load_peft_adapters) from `model_dir` (see HfWeights) in chunks of at most chunk_elems
// (> 0) elements. Before reading any data, checks every param is present with its exact shape
// (errors name the tensor, the expected and found shapes and the file; a missing lm_head.weight says
// the config is untied) and logs one warning line listing the tensors the layout does not use
// (rotary_emb.inv_freq, a multimodal model's vision tower etc.) — not an error. A multimodal
// checkpoint's text weights are found under their prefix (Note [Text weights of a multimodal
// checkpoint]).
// The files are read through `env`.
// A bitsandbytes 4-bit weight goes to `sink` read back into fp32 as dequantize_4bit gives it, an
// 8-bit one as code × (SCB × 1/127) (bnb4::int8_element), unless its ParamSpec is packed: then its blob
// goes to `packed` (required then) — the stored codes, and the absmax read back (double
// quantization) and repeated into blocks of 64, or the rows' SCB; a 4-bit checkpoint quantized in
// blocks of 32 is refused for it before any data moves, naming the tensor. A quantized tensor whose
// kind (4-bit, 8-bit) is not the config's, or whose state is missing or of the wrong size, is refused
// by name before any data moves too.
Status load_hf_weights(const std::string& model_dir, const ModelLayout& layout, uint64_t chunk_elems,
                       const ParamSink& sink, io::Env* env, const PackedSink& packed = {});

// Random init, deterministic in (seed, param name, element index) and independent of chunk_elems:
// Linear and embedding weights ~ normal(0, config.initializer_range), norm weights 1 (0 for Gemma's
// 1 + weight), biases 0 — as Hugging Face initializes them; LoRA adapters as init_lora_adapters.
// The normal values: a param's elements 2p and 2p+1 are z0·std and z1·std (rounded to float) of
// Box–Muller on draws 2p+1 and 2p+2 (a, b) of a SplitMix64 stream (Vigna's splitmix64.c) seeded with
// key = first(seed) ^ first(FNV-1a-64(name) − 0x9E3779B97F4A7C15), first(s) being the first output of
// SplitMix64 seeded with s: u1 = ((a >> 11) + 1)·2⁻⁵³, u2 = (b >> 11)·2⁻⁵³, r = √(−2 ln u1),
// z0 = r cos 2πu2, z1 = r sin 2πu2, in double. Any element is computable on its own.
// QLoRA from a 16-bit directory (zoffload.quantize_base): a sink that quantizes each packed param
// (ParamSpec::packed: the frozen decoder projections training_layout marks) as bitsandbytes'
// quantize_4bit does in blocks of 64 without double quantization (bnb4::quantize, Note [4-bit
// blocks]; a large chunk's blocks over the hardware's threads, which cannot change a bit) and hands
// its blob to `packed`; other params go to `inner` as they are. A chunk of a
// packed param must start at a multiple of 64 elements and hold whole blocks unless it ends the
// tensor (load_hf_weights' and random_init_weights' chunks of a multiple of 64 do): InvalidArgument
// otherwise.
ParamSink quantizing_sink(const ModelLayout& layout, bnb4::QuantType type, ParamSink inner, PackedSink packed);

Status random_init_weights(const ModelConfig& config, const ModelLayout& layout, uint64_t seed, uint64_t chunk_elems,
                           const ParamSink& sink);

// Note [A tied head the weights untie]: transformers (5.x) ties lm_head.weight to the embedding
// when config.json says tie_word_embeddings, unless the weights hold an lm_head.weight whose values
// differ from model.embed_tokens.weight: then it keeps both, untied ("we will NOT tie them"). This
// applies that rule to `config` (read from `model_dir`'s config.json): tie_word_embeddings becomes
// false, with the same warning, when the weights untie it. Nothing for an untied config, weights
// without a head of their own, or weights that cannot be opened (load_hf_weights reports those).
// Reads both tensors when both are there.
Status apply_weights_tying(const std::string& model_dir, ModelConfig* config, io::Env* env);

// The LoRA adapters of `layout` (is_lora_param) only, as PEFT initialises them: each lora_A
// [r, in] uniform in ±1/√in (torch's kaiming_uniform_ with a = √5, which PEFT calls), drawn from a
// counter-based stream deterministic in (seed, name, index); each lora_B zero, so the adapted model
// starts as the base.
Status init_lora_adapters(const ModelLayout& layout, uint64_t seed, uint64_t chunk_elems, const ParamSink& sink);

// What an adapter loaded from a file may hold: its update s·B·A must stay within the square root
// of the compute dtype's range (Note [Adapter values] in weights.cpp).
struct AdapterLimits {
  double scaling = 1;                // s: lora_alpha / r (or / √r)
  double max_value = 3.4028234663852886e38;  // the compute dtype's largest finite value
};

// The LoRA adapters of `layout` from a PEFT adapter directory's adapter_model.safetensors, where
// they are named "base_model.model." + their name. Before any data moves: kNotFound naming a missing
// adapter (or a directory with only adapter_model.bin), kInvalidArgument for a shape that differs
// or a tensor the layout has no place for (another target module, layer or adapter kind), naming it,
// and for values out of `limits` (a NaN or inf, naming the tensor and element; a projection whose
// s·B·A can exceed √limits.max_value).
Status load_peft_adapters(const std::string& adapter_dir, const ModelLayout& layout, uint64_t chunk_elems,
                          const ParamSink& sink, io::Env* env, const AdapterLimits& limits = {});

// PEFT's files: an adapter directory holds these two, its tensors' names prefixed.
inline constexpr const char* kPeftConfigFile = "adapter_config.json";
inline constexpr const char* kPeftWeightsFile = "adapter_model.safetensors";
inline constexpr const char* kPeftPrefix = "base_model.model.";

}  // namespace zo::engine

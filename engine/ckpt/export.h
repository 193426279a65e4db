// Export of Hugging Face safetensors model directories (config.json, model.safetensors or
// model-0000k-of-0000n.safetensors + model.safetensors.index.json) in bf16, fp16 or fp32, converted
// from fp32 master weights with round-to-nearest-even and streamed through a bounded staging buffer:
// neither the model nor a whole tensor is ever held in RAM. Synchronous; not thread-safe. Layout and
// guarantees: docs/export.md.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "common/status.h"
#include "engine/ckpt/checkpoint.h"
#include "engine/memory/memory_plan.h"
#include "engine/memory/state_store.h"
#include "io/env.h"
#include "io/io_engine.h"

namespace zo::engine {

// One model.safetensors holds the whole model when its tensors fit in one shard; otherwise shard k
// of n is named like this (HF: model-00001-of-00003.safetensors).
inline constexpr const char* kSingleShardFile = "model.safetensors";
inline constexpr const char* kShardIndexFile = "model.safetensors.index.json";
std::string shard_file_name(uint32_t shard, uint32_t n_shards);  // shard counts from 1

// What an export writes of a model with LoRA adapters (Note [Exporting LoRA adapters]).
struct LoraExport {
  // false: PEFT's adapter directory — adapter_config.json (adapter_config_json) and
  // adapter_model.safetensors with the adapters alone, named "base_model.model." + their name;
  // true: the merged model, a Hugging Face directory like any export, each adapted weight
  // W + scaling · B·A and no adapter.
  bool merged = false;
  double scaling = 0;  // LoraSpec::scaling()
  std::string adapter_config_json;
};

struct ExportOptions {
  DType dtype = DType::kBF16;  // kBF16, kF16 or kF32
  // Set for a model with LoRA adapters (their params named ….lora_A.weight / ….lora_B.weight);
  // without it every param is written as it is.
  std::optional<LoraExport> lora;
  // Written into a sibling OUT.tmp-<random> and published whole (Note [Publishing a directory]):
  // out_dir must be missing or empty, or anything with `replace`, which swaps it out atomically.
  std::string out_dir;
  bool replace = false;
  uint64_t shard_bytes = 5'000'000'000;          // ≥ 1: at most this many tensor bytes per shard,
                                                 // except a larger tensor, which gets a shard alone
  uint64_t staging_bytes = uint64_t{256} << 20;  // ≥ 1 MiB, a multiple of 4096
  // Small files copied whole into out_dir under their own names and committed with the weights
  // (model_side_files: the tokenizer and generation config, so the export is a complete model
  // directory). A name the export writes itself (config.json, *.safetensors, the index) or a
  // missing file fails the export before anything is written.
  std::vector<std::string> side_files;
  // Called on the exporting thread after every chunk with the tensor bytes written so far and
  // their total (in the export dtype).
  std::function<void(uint64_t done_bytes, uint64_t total_bytes)> progress;
  // Small files, renames and directory fsyncs go through this Env; tests
  // pass an io::FaultyEnv. The shards' bytes go through the I/O engine. Required (io::require_env).
  io::Env* env = nullptr;
};

struct ExportResult {
  std::string out_dir;
  std::vector<std::string> files;  // written, relative to out_dir: the shards, the index, side files, config.json
  uint64_t tensors = 0;            // tensors written
  uint64_t tensor_bytes = 0;       // total_size of the index
  uint64_t overflowed = 0;         // fp16: finite fp32 values that became ±inf
};

// The merge of Note [Exporting LoRA adapters] for one chunk: `dst` holds elements [first, first +
// dst.size()) of a row-major [out, in] weight W, and each gets s · Σ_k B[o, k] · A[k, c] added, the
// sum over k in order in fp32, then times s (PEFT's delta, B @ A times s, added to W). A is [r, in],
// B [out, r]. Pure; thread-safe on distinct `dst`.
void merge_lora_chunk(std::span<const float> A, std::span<const float> B, uint64_t r, uint64_t in, float scaling,
                      uint64_t first, std::span<float> dst);
// merge_lora_chunk over the hardware's threads, each a part of `dst` (common/parallel_ranges.h): the
// same bits, each element's sum being its own. What the export runs.
void merge_lora(std::span<const float> A, std::span<const float> B, uint64_t r, uint64_t in, float scaling,
                uint64_t first, std::span<float> dst);

// Reads elements [offset_elems, offset_elems + out.size()) of param `param` (index into the params
// given to export_hf_model) as fp32. export_hf_model calls it front to back: params in order, each
// param's ranges ascending and contiguous, `out` at most a few MiB.
using Fp32Reader = std::function<Status(uint32_t param, uint64_t offset_elems, std::span<float> out)>;

// Writes every param of `params` (Hugging Face names and shapes, in this order) and
// `model_config_json` (its torch_dtype set to the export dtype) into options.out_dir. Every file is
// written into the sibling OUT.tmp-<random> (shards through io with O_DIRECT, all fdatasynced),
// which is fsynced and published as out_dir only when all are complete (publish_directory). The
// only large allocation is one staging buffer of options.staging_bytes. Errors: kInvalidArgument
// for bad options, params or config json; kAlreadyExists naming out_dir when it is not empty
// (without options.replace); the reader's or writer's error with the shard file, tensor and element
// range added. A failed export removes what it wrote (best effort): out_dir is left as it was found.
Result<ExportResult> export_hf_model(std::span<const ParamInfo> params, const std::string& model_config_json,
                                     const Fp32Reader& read, io::IoEngine& io, const ExportOptions& options);

// From a checkpoint's master weights (master.safetensors, read front to back once with pread),
// checking every chunk's CRC-32C against the manifest as it reads: a mismatch fails the export with
// kCorruption naming the file, chunk and byte range, and the export then removes what it wrote.
Result<ExportResult> export_checkpoint(const CheckpointInfo& ckpt, io::IoEngine& io, const ExportOptions& options);

// From a live store's master weights (the end-of-training export), whatever tier they live in, via
// StateStore::read_state_range. kFailedPrecondition for a torn store (its master is inconsistent).
// A data-parallel rank's store (MemoryPlan::partitioned) exports from its compute copies, in the
// compute dtype only (the same bytes: Note [Exporting partitioned states]); kFailedPrecondition for
// another dtype.
Result<ExportResult> export_store(StateStore& store, const std::string& model_config_json, io::IoEngine& io,
                                  const ExportOptions& options);

// The files of a Hugging Face model directory an export carries over unchanged, those present in
// `model_dir` (none when it is not a directory, e.g. a preset name): tokenizer.json,
// tokenizer_config.json, special_tokens_map.json, tokenizer.model, added_tokens.json, vocab.json,
// merges.txt, chat_template.jinja, chat_template.json, generation_config.json.
std::vector<std::string> model_side_files(const std::string& model_dir, io::Env* env);

}  // namespace zo::engine

// The checkpoint's schema: the names of its files, manifest.json (format version, step, every
// file's size and per-chunk CRC-32C, the tensors) and trainer_state.json, with their JSON forms.
// Parsing is strict: a missing or mistyped field is kCorruption naming the file and the field.
// Plain value types; on-disk format: docs/checkpoint_format.md.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "engine/ckpt/stream_file.h"
#include "engine/data/dataset.h"
#include "engine/memory/memory_plan.h"
#include "engine/optim/loss_scaler.h"

namespace zo::engine {

inline constexpr int kCheckpointFormatVersion = 1;

// The files of a checkpoint directory.
inline constexpr const char* kManifestFile = "manifest.json";
inline constexpr const char* kTrainerStateFile = "trainer_state.json";
inline constexpr const char* kModelConfigFile = "config.json";  // the model's Hugging Face config.json
inline constexpr const char* kLatestFile = "latest";            // in DIR: "step-<N>\n"
// fp32 safetensors files with Hugging Face tensor names, one per optimizer state.
inline constexpr const char* kMasterFile = "master.safetensors";
inline constexpr const char* kExpAvgFile = "exp_avg.safetensors";
inline constexpr const char* kExpAvgSqFile = "exp_avg_sq.safetensors";
// The compute copies of the frozen params (zoffload.freeze), in the compute dtype; only when some are.
inline constexpr const char* kFrozenFile = "frozen.safetensors";

// What a run needs besides the tiers to continue exactly (the lr schedule is a function of
// optimizer_steps; the data order of seed and position).
struct TrainingState {
  uint64_t steps_done = 0;       // optimizer steps attempted, skipped ones too: the N of step-<N>
  uint64_t optimizer_steps = 0;  // optimizer steps taken: Adam's step count, the lr index
  LossScalerState loss_scaler;
  DataPosition data_position;
  uint64_t seed = 0;
  std::string model;  // what --model named (a directory or preset), for humans
  std::string data;   // the data file, and the window length its position counts in
  uint64_t seq_len = 0;
  // The ranks that trained it (Note [Replicated data parallel] in engine/dist/data_parallel.cpp): any world size
  // resumes it. Absent in checkpoints written before data parallel: 1.
  uint64_t world_size = 1;
  nlohmann::json config;  // the resolved training config (to_json(Config))
  // Note [Run ids] (engine/train/run_outputs.cpp): the run that wrote it, 16 hex digits, and that run's
  // --out as an absolute path. Absent in checkpoints written before run ids: empty.
  std::string run_id;
  std::string out;

  nlohmann::json to_json() const;
  // kCorruption "SOURCE: KEY: ..." for a missing field or one of the wrong kind: every counter a
  // JSON integer within its type (no float, string or boolean), world_size and
  // loss_scaler.cur_hysteresis ≥ 1, loss_scaler.last_overflow_iter ≥ -1, loss_scaler.cur_scale a
  // finite number > 0; and for optimizer_steps > steps_done.
  static Result<TrainingState> from_json(const nlohmann::json& json, const std::string& source);
};

// One tensor of the state files (the same in each).
struct CheckpointTensor {
  std::string name;
  std::vector<int64_t> shape;
  uint64_t n_elems = 0;
};

struct Manifest {
  int format_version = kCheckpointFormatVersion;
  uint64_t step = 0;
  std::vector<FileDigest> files;          // every file of the directory but the manifest
  std::vector<CheckpointTensor> tensors;  // in file order; dtype F32
  // How the moments are stored: "moment_dtype" in the JSON, absent (fp32) in checkpoints older than
  // 8-bit moments. It decides the state files (state_files in state_files.h).
  MomentDtype moments = MomentDtype::kF32;
  // The masters' dtype: "master_dtype" in the JSON ("fp32" or "bf16"), absent (fp32) in checkpoints
  // older than bf16 masters. master.safetensors holds F32 or BF16 tensors accordingly.
  DType master_dtype = DType::kF32;
  // optimizer.type of the run that saved it: "optimizer_type" in the JSON, absent (unknown) in
  // checkpoints older than 8-bit Lion and Adagrad. Which optimizer's states the files hold.
  std::optional<OptimizerType> optimizer_type;
  // The frozen params (zoffload.freeze: Note [Frozen sub-groups]), in registry order, which have no
  // optimizer state and are not in `tensors`: their compute copies are in kFrozenFile, in
  // `frozen_dtype` (the run's compute dtype). "frozen_tensors" and "frozen_dtype" in the JSON,
  // absent when none is frozen (and in checkpoints older than zoffload.freeze).
  std::vector<CheckpointTensor> frozen;
  DType frozen_dtype = DType::kF32;
  std::optional<DType> frozen_file_dtype() const {
    return frozen.empty() ? std::nullopt : std::optional<DType>(frozen_dtype);
  }

  nlohmann::json to_json() const;
  static Result<Manifest> from_json(const nlohmann::json& json, const std::string& source);
  const FileDigest* find(std::string_view name) const;  // nullptr if absent
};

// The optimizer states a checkpoint holds, one fp32 safetensors file each, in this order.
inline constexpr StateKind kSavedStates[] = {StateKind::kMaster, StateKind::kExpAvg, StateKind::kExpAvgSq};
// The file of one of kSavedStates (kMasterFile, ...); any other state aborts.
const char* state_file_name(StateKind kind);

// The JSON object `text` holds, or kCorruption "<source>: not a JSON object".
Result<nlohmann::json> parse_json_object(const std::string& text, const std::string& source);
// "[4096, 11008]", for messages.
std::string shape_string(const std::vector<int64_t>& shape);

}  // namespace zo::engine

// Checkpoints: every state of every tier (fp32 master, Adam moments) and the training state,
// streamed through a bounded staging buffer into DIR/tmp-<step>-<random>, each file fdatasynced,
// manifest.json (sizes, dtypes, shapes, CRC-32C per chunk) written last, then renamed to
// DIR/step-<N> and DIR/latest replaced atomically; and reading them back: open, verify, load.
// On-disk format: docs/checkpoint_format.md. Functions are synchronous; not thread-safe per store.
// Every file operation goes through an io::Env (the state files' bytes through the I/O engine).
// checkpoint.cpp saves, commits and prunes; checkpoint_load.cpp opens, verifies and loads.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <vector>

#include "common/status.h"
#include "engine/ckpt/manifest.h"
#include "engine/ckpt/stream_file.h"
#include "engine/memory/state_store.h"
#include "io/env.h"

namespace zo::engine {

// The phases of a save, in order (the crash tests kill the process at each).
enum class SavePhase : uint8_t {
  kStarted,          // the tmp directory exists
  kStateFileDone,    // after each state file is written and fdatasynced (several times)
  kManifestWritten,  // manifest.json fsynced, the tmp directory fsynced
  kRenamed,          // tmp → step-<N>, DIR fsynced
  kLatestUpdated,    // DIR/latest replaced, DIR fsynced
  kPruned,           // old checkpoints beyond keep_last removed
};
std::string_view save_phase_name(SavePhase phase);

struct SaveOptions {
  std::string dir;                               // created if missing
  uint64_t keep_last = 2;  // 0: keep all; of the saving run's own checkpoints (TrainingState::run_id)
  uint64_t staging_bytes = uint64_t{256} << 20;  // ≥ 1 MiB, a multiple of 4096
  // Called on the saving thread with bytes written so far and the total (for progress lines).
  std::function<void(uint64_t done_bytes, uint64_t total_bytes)> progress;
  // Called on the saving thread at each phase boundary (tests).
  std::function<void(SavePhase)> on_phase;
  // Creates, opens, syncs, renames and removes through this Env; tests pass
  // an io::FaultyEnv. The state files' bytes go through the store's I/O engine.
  io::Env* env = nullptr;  // required (io::require_env)
  // Data parallel with partitioned optimizer states (StateStore's plan partitioned over
  // world_size ranks): every rank calls save_checkpoint with the same state and options, each
  // writes its partition's run of the state files and rank 0 commits (Note [Collaborative save]).
  // broadcast: root's n_bytes at data onto every rank (blocking; the process group's).
  struct Collective {
    uint32_t rank = 0;
    uint32_t world_size = 1;
    std::function<Status(void* data, uint64_t n_bytes, uint32_t root, const std::string& what)> broadcast;
  };
  std::optional<Collective> collective;
};

struct SaveResult {
  std::string path;    // DIR/step-<N>; empty on ranks other than 0 of a collaborative save
  uint64_t bytes = 0;  // of every file written (a collaborative save's other ranks: their part)
  double seconds = 0;
  std::vector<std::string> pruned;  // directories removed
};

// Saves the store's master, exp_avg and exp_avg_sq (from whatever tier each lives in, through one
// staging buffer of options.staging_bytes allocated for the save and freed after), `state`, the
// model's config.json text, and commits it as described at the top. The store is only read: a
// failed save (ENOSPC, EIO, a bad directory) returns the error naming the file, removes its tmp
// directory (best effort) and leaves the previous checkpoints, `latest` and the store as they were.
// kAlreadyExists when DIR/step-<N> exists. Compute copies are not saved: they are the master
// rounded to the compute dtype (load_checkpoint derives them).
Result<SaveResult> save_checkpoint(StateStore& store, const TrainingState& state, const std::string& model_config_json,
                                   const SaveOptions& options);

// Removes DIR/tmp-* directories a killed save left behind; returns their names. DIR may not exist.
Result<std::vector<std::string>> clean_stale_checkpoints(const std::string& dir, io::Env* env);

// What a --resume / --checkpoint argument names: a step directory (holding manifest.json), or a
// checkpoint DIR whose `latest` names one. kNotFound / kCorruption saying which, otherwise.
Result<std::string> resolve_checkpoint(const std::string& path, io::Env* env);

// A checkpoint opened for reading: the manifest, training state and model config parsed and
// checked against each other and the files' sizes (not yet their checksums).
struct CheckpointInfo {
  std::string path;  // the step directory
  Manifest manifest;
  TrainingState state;
  std::string model_config_json;
};

// kCorruption naming the file when manifest.json is missing or malformed (an incomplete save is
// never loaded), a listed file is missing or of the wrong size, or the state files' headers do not
// match the manifest's tensors; kInvalidArgument for an unsupported format_version.
Result<CheckpointInfo> open_checkpoint(const std::string& path, io::Env* env);

// Re-reads every file and checks every chunk's CRC-32C (kCorruption naming file, chunk and byte
// range). Reads through `staging` (4096-aligned, a multiple of 4096, ≥ 1 MiB).
Status verify_checkpoint(const CheckpointInfo& ckpt, io::IoEngine& io, std::span<std::byte> staging, io::Env* env,
                         const std::function<void(uint64_t done_bytes, uint64_t total_bytes)>& progress = {});

// Streams master, exp_avg and exp_avg_sq into the store's tiers and sets the compute copies to the
// master rounded to the compute dtype, checking every chunk's CRC-32C as it reads. The store's
// params must be the checkpoint's tensors (same names, shapes and order; kInvalidArgument naming
// the first difference); its sub-group size and tiers may differ from the saving run's, and so may
// its partitioning: a data-parallel rank's store (MemoryPlan::partitioned) reads only its own run
// of exp_avg and exp_avg_sq (read_stream_range) and all of master, which sets every compute copy. On
// kCorruption or an I/O error the store holds a partial load: do not train with it.
Status load_checkpoint(const CheckpointInfo& ckpt, StateStore& store, io::IoEngine& io, std::span<std::byte> staging,
                       io::Env* env);

// A summary for `zoffload ckpt inspect`: step, counters, loss scale, data position, tensors,
// parameters, bytes per file, model and config highlights.
nlohmann::json describe_checkpoint(const CheckpointInfo& ckpt);

}  // namespace zo::engine

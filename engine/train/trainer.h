// Trainer: one training run — the model, its states in their tiers, the stage-3 coordinator, the
// gradient accumulator, the optimizer swapper, loss scaling, the lr schedule and the data — driven
// one optimizer step at a time (docs/design.md, "One training step"). Includes no LibTorch header.
// Not thread-safe: one thread drives a Trainer.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "common/status.h"
#include "engine/ckpt/checkpoint.h"
#include "engine/ckpt/export.h"
#include "engine/config/config.h"
#include "engine/data/dataset.h"
#include "engine/dist/process_group.h"
#include "engine/memory/accounting.h"
#include "engine/model/model_config.h"
#include "engine/train/step_metrics.h"
#include "io/env.h"
#include "io/fault_injector.h"
#include "io/file.h"

namespace zo::engine {

struct TrainOptions {
  Config config;      // resolved (load_config / parse_config)
  std::string model;  // a Hugging Face model directory, or a preset name (model_preset_names())
  // Tests and benchmarks: this shape with random init instead of what `model` names (which then
  // only labels the run).
  std::optional<ModelConfig> model_config;
  std::string data_path;  // tokens: .bin (llm.c/nanoGPT), .jsonl with input_ids, or text (bytes)
  DataFormat data_format = DataFormat::kAuto;
  uint64_t seq_len = 0;  // tokens per row; 0: min(256, max_position_embeddings)
  uint64_t seed = 0;     // random init, data order (a resumed run keeps its checkpoint's)
  // Continue from a checkpoint: a step directory, a checkpoint directory whose `latest` names one,
  // or "latest" (zoffload.checkpoint.dir's). Weights, optimizer states, counters, loss scale and
  // data position come from it (checksums checked as it loads); `model` then only has to name the
  // same architecture. Empty: start fresh.
  std::string resume;
  // Where relative paths of the config (offload nvme_path, log.metrics_path) are resolved and
  // metrics.jsonl is written; created if missing. Empty: the current directory.
  std::string out_dir;
  // Tests: the steps (1-based) at whose last micro-step one gradient element of the embedding block
  // — the last gradients backward produces, when every other sub-group's are final — is replaced by
  // +inf before it reaches the accumulator: an overflow through the real path.
  std::vector<uint64_t> inject_overflow_steps;
  // The run's last step (zoffload train's --steps). Each step runs the next step's first forward
  // while its optimizer runs (Note [Overlapped optimizer]); the step that reaches last_step does
  // not, so no batch is read that the run never trains on. 0: every step reads ahead.
  uint64_t last_step = 0;
  // Held-out tokens (zoffload train's --eval-data; the formats of data_path, data_format applies):
  // evaluated after every eval_every-th step and after last_step, in file order (Note [Evaluation]
  // in engine/train/evaluator.cpp); the figures go into that step's StepMetrics::eval. Empty: none.
  std::string eval_data_path;
  uint64_t eval_every = 0;     // 0: only after last_step
  uint64_t eval_batches = 16;  // micro-batches per evaluation, all ranks together (fewer if the file is short); > 0
  // Tests: faults injected into the run's I/O engine (swap files, checkpoints, exports) and into
  // the file operations of its checkpoints and exports (an io::FaultyEnv over these rules).
  std::shared_ptr<io::FaultInjector> io_faults;
  // Called with each NVMe swap file's path once this process holds it, before it is sized and
  // filled with the weights (StateStoreOptions::on_swap_file): zoffload train's stop-signal
  // handler removes the files from then on (Note [Interrupted runs]). Empty: not called.
  std::function<void(const std::string&)> on_swap_file;
  // The ranks of a data-parallel run (Note [Replicated data parallel] in engine/dist/data_parallel.cpp); null: one
  // process. Every rank creates its Trainer with the same options and calls step() and
  // save_checkpoint() in the same order. Owned by the caller; outlives the Trainer.
  dist::ProcessGroup* group = nullptr;
  // Rank 0 holds out_dir's lock for the whole run (Note [One run per run directory] in
  // trainer.cpp). zoffload train takes it (lock_run_dir) before the ranks connect and hands it over
  // here; null: init takes it.
  std::shared_ptr<io::File> run_dir_lock;
};

// Creates `out_dir` (empty: the current directory) when missing and locks it for this run: an
// exclusive flock on OUT/.zoffload.lock, held until the returned file is closed.
// kFailedPrecondition "run directory OUT is in use by another zoffload run ..." when another
// process (or another lock in this one) holds it. On a file system without flock the run is not
// refused: a warning says it is unguarded. *created_top (when given): the topmost directory it
// created, empty when OUT existed (Env::make_dirs).
Result<std::shared_ptr<io::File>> lock_run_dir(const std::string& out_dir, io::Env* env,
                                               std::string* created_top = nullptr);

// Removes `dir` when it holds nothing but (empty) directories and the .zoffload.lock files of
// lock_run_dir: what a run that failed at start leaves of an output directory it created. Anything
// else there keeps it. No error when `dir` is missing.
Status remove_if_only_locks(const std::string& dir, io::Env* env);

// Tunes glibc's allocator for LibTorch's CPU kernels (Note [Host compute] in trainer.cpp): freed
// activation buffers stay in the heap instead of being unmapped and faulted in again, which was ~40%
// of a small model's step on the emulated device. Process-wide (mallopt), so the library never calls
// it: a program that trains calls it once, before Trainer::create (tools/zoffload does).
void tune_allocator_for_host_compute();

class Trainer {
 public:
  // Builds everything and initialises the weights (from the model directory, streamed into their
  // tiers, or random for a preset). Errors say what and where: a bad model directory, a budget
  // that cannot hold one block, data too short for one batch, an impossible pinned cap.
  static Result<std::unique_ptr<Trainer>> create(const TrainOptions& options);
  ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  // One optimizer step: gradient_accumulation_steps micro-batches, then the optimizer (or a skip),
  // with the next step's first forward running beside the optimizer (TrainOptions::last_step);
  // the step's update is complete when it returns. A failure before the optimizer (data, model,
  // fetch, gradient I/O) loses that step's gradients and the next call starts a fresh accumulation
  // window; a failure of the forward run ahead is returned by the next call, as that step's. A
  // failed optimizer step ends the run (its states may be torn, see docs/memory.md): resume from a
  // checkpoint. Errors start with "step N: ".
  Result<StepMetrics> step();

  uint64_t steps_done() const;
  // The planner's one-line summary of this run and its full JSON (the run was refused at create()
  // when it did not fit).
  std::string plan_summary() const;
  std::string plan_json() const;

  // Checkpoints (docs/checkpoint_format.md). The resolved zoffload.checkpoint.dir; empty: none.
  const std::string& checkpoint_dir() const;
  // The step directory this run resumed from; empty when it started fresh.
  const std::string& resumed_from() const;
  // Whether a save is due after the steps done so far: every zoffload.checkpoint.every_steps steps,
  // or, at the end of the run, when the last step has no checkpoint yet (never without a directory).
  bool checkpoint_due(bool end_of_run = false) const;
  // Saves the state after steps_done() steps into checkpoint_dir() as step-<N> (atomically, pruning
  // beyond keep_last). Only reads the training state: a failed save leaves it, the previous
  // checkpoints and `latest` unchanged, and training may go on. kFailedPrecondition without a
  // checkpoint directory or after a failed optimizer step. Data parallel: every rank calls it. With
  // replicated states (ZeRO stage 0) rank 0 writes while the others wait; partitioned, each rank
  // writes its partition's range of the state files in parallel and rank 0 commits (Note
  // [Collaborative save] in checkpoint.cpp). Other ranks return an empty path.
  Result<SaveResult> save_checkpoint(
      const std::function<void(uint64_t done_bytes, uint64_t total_bytes)>& progress = {});
  TrainingState training_state() const;
  // Exports the current master weights as a Hugging Face model directory (export.h), streamed from
  // their tiers through options.staging_bytes. When export_needs_every_rank(), a collective: every
  // rank calls it, rank 0 writes options.out_dir, and the others return an empty result (or the
  // export's error) — Note [Exporting gathered parameters] in engine/ckpt/export_gathered.cpp.
  Result<ExportResult> export_model(const ExportOptions& options);
  // ZeRO stage 3 across ranks: no rank holds every weight.
  bool export_needs_every_rank() const;
  // The dtype an end-of-training export uses: bf16 when bf16 is enabled, else fp16 when fp16 is,
  // else fp32.
  DType export_dtype() const;
  const ModelConfig& model_config() const;
  const ModelLayout& layout() const;
  uint64_t num_parameters() const;
  // The frozen weights kept packed in 4 bits (Note [The packed 4-bit base] in common/bnb4_blob.h),
  // and their blobs' bytes: what pinned RAM or NVMe holds of them and a fetch moves.
  uint64_t packed_weights() const;
  uint64_t packed_bytes() const;
  // The fp32 master weights of param `param` (layout().params order), its shape's elements; of a
  // frozen param (zoffload.freeze), which has no master, its compute copy widened (a packed
  // weight's dequantized, as the device computes with it).
  Status read_master(uint32_t param, std::span<float> out);
  // One line for humans: model, parameters, where each state lives, the device and budgets.
  std::string describe() const;
  // The resolved paths of the run's outputs.
  std::string metrics_path() const;
  std::string swap_dir() const;  // empty when nothing is on NVMe

  struct Impl;

 private:
  explicit Trainer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace zo::engine

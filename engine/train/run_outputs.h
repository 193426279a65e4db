// RunOutputs: the trainer's glue to training checkpoints and exports — the run's id (Note [Run
// ids]), the checkpoint directory, the checkpoint a run resumes from, saving the states of the
// setup's store and exporting them. The step loop's part of a checkpoint (counters, loss scale,
// data position) is StepLoop's. Includes no LibTorch. Not thread-safe: the training thread.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>

#include "common/status.h"
#include "engine/ckpt/checkpoint.h"
#include "engine/ckpt/export.h"
#include "engine/data/dataset.h"
#include "engine/train/run_dir.h"
#include "engine/train/run_setup.h"

namespace zo::engine {

class RunOutputs {
 public:
  // `setup` outlives it; its options and env are read from construction on, its store from
  // save() on. The run gets a fresh id (a resume takes its checkpoint's).
  explicit RunOutputs(const RunSetup& setup);

  // At start, in Note [Trainer construction]'s order: the id in OUT/.zoffload.run_id (rank 0);
  // the checkpoint directory resolved, checked, locked and tidied of unfinished saves (rank 0
  // locks and tidies); the checkpoint --resume names, opened and checked against the model.
  Status read_run_id();
  Status open_checkpoint_dir(OutputLocks* locks);
  Status find_resume();
  // The checkpoint found by find_resume until finish_resume; null when starting fresh.
  const CheckpointInfo* resume() const { return resume_ ? &*resume_ : nullptr; }
  // Once its counters are applied: says what differs from the checkpoint (the data the loop opened
  // with `data`), and releases it.
  void finish_resume(const DataOptions& data);
  // Rank 0: this run's id into OUT/.zoffload.run_id, once the run has started.
  Status write_run_id();

  const std::string& checkpoint_dir() const { return checkpoint_dir_; }  // resolved; empty: none
  const std::string& resumed_from() const { return resumed_from_; }      // empty when started fresh
  // Trainer::checkpoint_due after `steps_done` steps.
  bool checkpoint_due(uint64_t steps_done, bool end_of_run) const;
  // The run's part of a checkpoint's TrainingState: model, data, world size, config, run id, --out.
  void fill_state(TrainingState* state) const;
  // Trainer::save_checkpoint of `state` (complete: the loop's part filled in).
  Result<SaveResult> save(const TrainingState& state, const std::function<void(uint64_t, uint64_t)>& progress);
  // Trainer::export_model, export_needs_every_rank, export_dtype.
  Result<ExportResult> export_model(const ExportOptions& options) const;
  bool export_needs_every_rank() const;
  DType export_dtype() const;

 private:
  std::string model_config_json() const;
  // What --model named, a directory made absolute so that it resolves from anywhere: the
  // checkpoints' model (`zoffload export` finds its tokenizer there) and PEFT's base_model_name_or_path.
  std::string model_source() const;

  const RunSetup& setup_;
  std::string run_id_;
  std::string out_run_id_;  // the id OUT/.zoffload.run_id held when the run started; empty: none
  std::string checkpoint_dir_;
  std::optional<CheckpointInfo> resume_;
  std::string resumed_from_;
  std::optional<uint64_t> last_saved_step_;  // the step of the checkpoint saved or resumed from
};

}  // namespace zo::engine

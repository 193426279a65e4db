// MetricsSink: where rank 0 records each step (StepMetrics::record): metrics.jsonl and DeepSpeed's
// tensorboard and csv_monitor outputs. Includes no LibTorch. Not thread-safe: the training thread.
#pragma once

#include <memory>
#include <string>

#include "common/status.h"
#include "engine/monitor/monitor.h"
#include "engine/train/run_dir.h"
#include "engine/train/step_metrics.h"
#include "engine/train/trainer.h"
#include "io/env.h"

namespace zo::engine {

class MetricsSink {
 public:
  // `options` and `env` outlive the sink; `rank` 0 writes, the other ranks' sinks record nothing.
  MetricsSink(const TrainOptions& options, io::Env* env, uint32_t rank);

  // Note [Output files] (io/env.h): at start, before any step, rank 0 checks the metrics file and
  // locks the monitors' directories outside --out (Note [One run per run directory]) ...
  Status check_outputs(OutputLocks* locks);
  // ... and checks the csv_monitor's files (with an evaluation's when there is held-out data).
  Status check_monitor_files();
  // Opens the outputs (rank 0): appended to when the run resumed, started afresh otherwise.
  Status open(bool resumed);
  // The step's record into metrics.jsonl and the monitors (rank 0; nothing on the others).
  Status record(const StepMetrics& out);
  const std::string& path() const { return path_; }  // metrics.jsonl, resolved

 private:
  // Where a DeepSpeed monitor writes: output_path/job_name, relative to the run directory.
  std::string monitor_dir(const MonitorConfig& mc) const;

  const TrainOptions& opt_;
  io::Env* env_;
  uint32_t rank_;
  std::string path_;
  std::unique_ptr<io::AppendFile> metrics_;
  // DeepSpeed's monitors (tensorboard, csv_monitor); null when not enabled.
  std::unique_ptr<monitor::TensorBoardMonitor> tensorboard_;
  std::unique_ptr<monitor::CsvMonitor> csv_monitor_;
};

}  // namespace zo::engine

// Rank 0's record of each step: metrics.jsonl and the monitors (metrics_sink.h).
#include "engine/train/metrics_sink.h"

#include <vector>

#include <nlohmann/json.hpp>

#include "engine/plan/planner.h"

namespace zo::engine {

MetricsSink::MetricsSink(const TrainOptions& options, io::Env* env, uint32_t rank)
    : opt_(options),
      env_(env),
      rank_(rank),
      path_(resolve_run_path(opt_.out_dir, opt_.config.zoffload.log.metrics_path.empty()
                                               ? "metrics.jsonl"
                                               : opt_.config.zoffload.log.metrics_path)) {}

Status MetricsSink::check_outputs(OutputLocks* locks) {
  if (rank_ != 0) return Status::ok();
  const Config& config = opt_.config;
  ZO_RETURN_IF_ERROR(env_->check_output_file(path_, "the metrics file (zoffload.log.metrics_path)"));
  for (const MonitorConfig* mc : {&config.tensorboard, &config.csv_monitor}) {
    if (mc->enabled)
      ZO_RETURN_IF_ERROR(locks->lock_output_dir(
          monitor_dir(*mc), mc == &config.tensorboard ? "the tensorboard directory" : "the csv_monitor directory",
          /*inside_out_too=*/false, env_));
  }
  return Status::ok();
}

Status MetricsSink::check_monitor_files() {
  if (rank_ != 0 || !opt_.config.csv_monitor.enabled) return Status::ok();
  StepMetrics prototype;
  if (!opt_.eval_data_path.empty()) prototype.eval.emplace();  // its files too
  return monitor::CsvMonitor::check_files(env_, monitor_dir(opt_.config.csv_monitor),
                                          monitor::scalars_of_metrics_record(prototype.record()));
}

Status MetricsSink::open(bool resumed) {
  if (rank_ != 0) return Status::ok();  // rank 0 writes the metrics and monitors, for all ranks
  // A new run replaces an earlier run's metrics whole (Note [Output files]); a directory there was
  // refused by check_outputs.
  if (resumed) {
    ZO_ASSIGN_OR_RETURN(metrics_, env_->open_append(path_));
  } else {
    ZO_ASSIGN_OR_RETURN(metrics_, env_->open_fresh_append(path_, "the metrics file (zoffload.log.metrics_path)"));
  }
  const Config& config = opt_.config;
  if (config.tensorboard.enabled) {
    ZO_ASSIGN_OR_RETURN(tensorboard_, monitor::TensorBoardMonitor::open(env_, monitor_dir(config.tensorboard)));
  }
  if (config.csv_monitor.enabled) {
    ZO_ASSIGN_OR_RETURN(csv_monitor_, monitor::CsvMonitor::open(env_, monitor_dir(config.csv_monitor), resumed));
  }
  return Status::ok();
}

Status MetricsSink::record(const StepMetrics& out) {
  if (metrics_ == nullptr) return Status::ok();  // not rank 0
  const nlohmann::json line = out.record();
  ZO_RETURN_IF_ERROR(metrics_->append(line.dump() + "\n"));
  if (tensorboard_ || csv_monitor_) {
    // The same record, as DeepSpeed's monitors write it (Note [Monitor tags] in engine/monitor).
    const std::vector<monitor::Scalar> scalars = monitor::scalars_of_metrics_record(line);
    const uint64_t samples = out.step * opt_.config.train_batch_size;
    if (tensorboard_) ZO_RETURN_IF_ERROR(tensorboard_->write(samples, scalars).with_context("tensorboard"));
    if (csv_monitor_) ZO_RETURN_IF_ERROR(csv_monitor_->write(samples, scalars).with_context("csv_monitor"));
  }
  return Status::ok();
}

std::string MetricsSink::monitor_dir(const MonitorConfig& mc) const {
  // DeepSpeed writes to os.path.join(output_path, job_name); output_path is relative to the run
  // directory here, as every path of the config is.
  const std::string base = resolve_run_path(opt_.out_dir, mc.output_path.empty() ? "." : mc.output_path);
  return mc.job_name.empty() ? base : mc.job_name.front() == '/' ? mc.job_name : base + "/" + mc.job_name;
}

}  // namespace zo::engine

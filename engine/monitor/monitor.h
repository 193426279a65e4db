// DeepSpeed's monitors: each step's metrics written where DeepSpeed's `tensorboard` and
// `csv_monitor` write them (output_path/job_name), under DeepSpeed's tag names where it has them, so
// dashboards built for DeepSpeed runs read zoffload's. Files go through io::Env. Not thread-safe:
// one thread writes.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "common/status.h"
#include "io/env.h"

namespace zo::monitor {

// One scalar of a step: its tag ("Train/Samples/train_loss") and value.
struct Scalar {
  std::string tag;
  double value = 0;
};

// Note [Monitor tags]: the tags are DeepSpeed's engine's, "Train/Samples/<name>", with the number of
// samples trained on so far as the x axis (DeepSpeed's global_samples). The names are the keys of a
// metrics.jsonl record, nested keys joined with "/" ("time_s/compute"), except that the loss is
// DeepSpeed's "train_loss"; every number of the record is written (true/false as 1/0, a null
// gradient norm — an overflow — not at all), so the monitors hold what metrics.jsonl holds. The
// record's "eval" object (a step after which the held-out data was evaluated) is written under
// transformers' Trainer's tags instead, which DeepSpeed has none for: "eval/loss", "eval/perplexity",
// ... (CSV: eval_loss.csv), at the same x.
std::vector<Scalar> scalars_of_metrics_record(const nlohmann::json& record);

// A directory of CSV files as DeepSpeed's csvMonitor writes them: one file per tag, named by the
// tag with "/" and " " replaced by "_" (Train_Samples_train_loss.csv), holding "step,<last tag
// component>" and then one "samples,value" row per step.
class CsvMonitor {
 public:
  // Creates `dir` when missing. `append`: keep the rows already there (a resumed run); otherwise a
  // file this monitor writes starts afresh.
  static Result<std::unique_ptr<CsvMonitor>> open(io::Env* env, std::string dir, bool append);
  // Before the run starts: the files of these scalars' tags in `dir` can be written (io::Env::
  // check_output_file: a directory in the way is an error naming it, and is never removed).
  static Status check_files(io::Env* env, const std::string& dir, const std::vector<Scalar>& scalars);
  Status write(uint64_t samples, const std::vector<Scalar>& scalars);
  const std::string& dir() const { return dir_; }

 private:
  CsvMonitor(io::Env* env, std::string dir, bool append) : env_(env), dir_(std::move(dir)), append_(append) {}
  struct File {
    std::string tag;
    std::unique_ptr<io::AppendFile> out;
  };
  static std::string path_of(const std::string& dir, const std::string& tag);  // dir/Train_Samples_<name>.csv

  io::Env* env_;
  std::string dir_;
  bool append_;
  std::vector<std::unique_ptr<File>> files_;  // by first use
};

// A TensorBoard event file (events.out.tfevents.<time>.<host>.<pid>.zoffload) in a directory, as
// torch.utils.tensorboard.SummaryWriter writes it: TFRecord framing (length, masked CRC-32C of the
// length, the Event protobuf, its masked CRC-32C), a file_version record first, then one Event with
// a scalar summary per tag and step. Needs a build with protobuf (ZO_HAVE_PROTOBUF); open() says so
// otherwise.
class TensorBoardMonitor {
 public:
  static Result<std::unique_ptr<TensorBoardMonitor>> open(io::Env* env, const std::string& dir);
  Status write(uint64_t samples, const std::vector<Scalar>& scalars);
  const std::string& path() const { return file_->path(); }

 private:
  explicit TensorBoardMonitor(std::unique_ptr<io::AppendFile> file) : file_(std::move(file)) {}
  Status append_event(const std::string& event_bytes);
  std::unique_ptr<io::AppendFile> file_;
};

// TFRecord framing of one record (exposed for tests): 8-byte little-endian length, its masked
// CRC-32C, the data, the data's masked CRC-32C.
std::string tfrecord_frame(std::string_view data);

}  // namespace zo::monitor

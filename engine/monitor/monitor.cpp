#include "engine/monitor/monitor.h"

#include <unistd.h>

#include <chrono>
#include <cmath>

#include <nlohmann/json.hpp>

#include "common/crc32c.h"
#include "common/string_util.h"
#include "zo_build_config.h"

#if ZO_HAVE_PROTOBUF
#include "tensorboard_event.pb.h"
#endif

namespace zo::monitor {
namespace {

constexpr std::string_view kTagPrefix = "Train/Samples/";

void flatten(const nlohmann::json& j, const std::string& name, std::vector<Scalar>* out) {
  if (j.is_object()) {
    for (auto it = j.begin(); it != j.end(); ++it)
      flatten(it.value(), name.empty() ? it.key() : name + "/" + it.key(), out);
  } else if (j.is_number()) {
    // The evaluation's figures go under transformers' names (eval/loss), which DeepSpeed lacks.
    const bool eval = name.starts_with("eval/");
    out->push_back({eval ? name : std::string(kTagPrefix) + (name == "loss" ? "train_loss" : name), j.get<double>()});
  } else if (j.is_boolean()) {
    out->push_back({std::string(kTagPrefix) + name, j.get<bool>() ? 1.0 : 0.0});
  }
}

// A number as a CSV cell: shortest text that reads back to the same double.
std::string cell(double v) { return format_number(v); }

uint32_t masked_crc(std::string_view bytes) {
  const uint32_t crc = crc32c(bytes.data(), bytes.size());
  return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

void put_le(std::string* out, uint64_t v, int n) {
  for (int i = 0; i < n; ++i) out->push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

double wall_time_s() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

}  // namespace

std::vector<Scalar> scalars_of_metrics_record(const nlohmann::json& j) {
  std::vector<Scalar> out;
  if (!j.is_object()) return out;
  for (auto it = j.begin(); it != j.end(); ++it)
    if (it.key() != "step") flatten(it.value(), it.key(), &out);  // the step is the x axis's
  return out;
}

// ---- CSV ------------------------------------------------------------------------------------------

Result<std::unique_ptr<CsvMonitor>> CsvMonitor::open(io::Env* env, std::string dir, bool append) {
  ZO_RETURN_IF_ERROR(env->make_dirs(dir).with_context("csv_monitor output directory"));
  return std::unique_ptr<CsvMonitor>(new CsvMonitor(env, std::move(dir), append));
}

std::string CsvMonitor::path_of(const std::string& dir, const std::string& tag) {
  std::string name = tag;
  for (char& c : name)
    if (c == '/' || c == ' ') c = '_';
  return dir + "/" + name + ".csv";
}

Status CsvMonitor::check_files(io::Env* env, const std::string& dir, const std::vector<Scalar>& scalars) {
  for (const Scalar& s : scalars) ZO_RETURN_IF_ERROR(env->check_output_file(path_of(dir, s.tag), "csv_monitor file"));
  return Status::ok();
}

Status CsvMonitor::write(uint64_t samples, const std::vector<Scalar>& scalars) {
  for (const Scalar& s : scalars) {
    File* file = nullptr;
    for (const auto& f : files_)
      if (f->tag == s.tag) file = f.get();
    if (file == nullptr) {
      const std::string path = path_of(dir_, s.tag);
      // A new run replaces an earlier run's file whole (open_fresh_append checks the path); a
      // resumed one appends (Note [Output files]).
      uint64_t size = 0;
      auto f = std::make_unique<File>();
      f->tag = s.tag;
      if (append_) {
        ZO_RETURN_IF_ERROR(env_->check_output_file(path, "csv_monitor file"));
        ZO_ASSIGN_OR_RETURN(io::PathKind kind, env_->path_kind(path));
        if (kind == io::PathKind::kFile) { ZO_ASSIGN_OR_RETURN(size, env_->file_size(path)); }
        ZO_ASSIGN_OR_RETURN(f->out, env_->open_append(path));
      } else {
        ZO_ASSIGN_OR_RETURN(f->out, env_->open_fresh_append(path, "csv_monitor file"));
      }
      if (size == 0) {  // DeepSpeed's header: "step" and the tag's last component
        const size_t slash = s.tag.rfind('/');
        ZO_RETURN_IF_ERROR(f->out->append("step," + s.tag.substr(slash == std::string::npos ? 0 : slash + 1) + "\n"));
      }
      files_.push_back(std::move(f));
      file = files_.back().get();
    }
    ZO_RETURN_IF_ERROR(file->out->append(std::to_string(samples) + "," + cell(s.value) + "\n"));
  }
  return Status::ok();
}

// ---- TensorBoard ----------------------------------------------------------------------------------

std::string tfrecord_frame(std::string_view data) {
  std::string out;
  std::string length;
  put_le(&length, data.size(), 8);
  out += length;
  put_le(&out, masked_crc(length), 4);
  out += data;
  put_le(&out, masked_crc(data), 4);
  return out;
}

Status TensorBoardMonitor::append_event(const std::string& event_bytes) {
  return file_->append(tfrecord_frame(event_bytes));
}

#if ZO_HAVE_PROTOBUF

Result<std::unique_ptr<TensorBoardMonitor>> TensorBoardMonitor::open(io::Env* env, const std::string& dir) {
  ZO_RETURN_IF_ERROR(env->make_dirs(dir).with_context("tensorboard output directory"));
  char host[256] = "localhost";
  if (::gethostname(host, sizeof host) != 0) std::strcpy(host, "localhost");
  host[sizeof host - 1] = '\0';
  // SummaryWriter's name, made unique per process: TensorBoard reads every *tfevents* file of a
  // directory, so a resumed run's new file continues the curves.
  const std::string path = dir + "/events.out.tfevents." + std::to_string(static_cast<uint64_t>(wall_time_s())) + "." +
                           host + "." + std::to_string(::getpid()) + ".zoffload";
  ZO_ASSIGN_OR_RETURN(std::unique_ptr<io::AppendFile> file, env->open_append(path));
  std::unique_ptr<TensorBoardMonitor> m(new TensorBoardMonitor(std::move(file)));
  tb::Event first;
  first.set_wall_time(wall_time_s());
  first.set_file_version("brain.Event:2");
  ZO_RETURN_IF_ERROR(m->append_event(first.SerializeAsString()));
  return m;
}

Status TensorBoardMonitor::write(uint64_t samples, const std::vector<Scalar>& scalars) {
  // One event per scalar, as SummaryWriter.add_scalar writes them.
  std::string batch;
  const double now = wall_time_s();
  for (const Scalar& s : scalars) {
    tb::Event event;
    event.set_wall_time(now);
    event.set_step(static_cast<int64_t>(samples));
    tb::Summary::Value* value = event.mutable_summary()->add_value();
    value->set_tag(s.tag);
    value->set_simple_value(static_cast<float>(s.value));
    batch += tfrecord_frame(event.SerializeAsString());
  }
  return file_->append(batch);
}

#else

Result<std::unique_ptr<TensorBoardMonitor>> TensorBoardMonitor::open(io::Env*, const std::string&) {
  return failed_precondition(
      "tensorboard.enabled: this zoffload was built without protobuf, which writes TensorBoard's event files "
      "(install libprotobuf-dev and protobuf-compiler and run tools/setup.sh again; csv_monitor needs nothing)");
}

Status TensorBoardMonitor::write(uint64_t, const std::vector<Scalar>&) {
  return failed_precondition("tensorboard: built without protobuf");
}

#endif

}  // namespace zo::monitor

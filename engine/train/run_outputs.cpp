// The trainer's glue to checkpoints and exports: run ids, the checkpoint directory, resuming,
// saving and exporting (run_outputs.h).
#include "engine/train/run_outputs.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <random>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/log.h"
#include "common/string_util.h"
#include "common/trace.h"
#include "engine/ckpt/export_gathered.h"
#include "engine/plan/lora.h"

namespace zo::engine {
namespace {

namespace fs = std::filesystem;

constexpr const char* kRunIdFile = ".zoffload.run_id";

// A fresh run's id (Note [Run ids]).
std::string new_run_id() {
  std::random_device rd;
  const uint64_t v = (uint64_t{rd()} << 32) ^ rd();
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

// The key paths where two resolved configs differ in what affects the arithmetic.
void config_diff(const nlohmann::json& a, const nlohmann::json& b, const std::string& path,
                 std::vector<std::string>* out) {
  // Where the states live, how they move and where files go never change the arithmetic (the
  // offload invariant): only the rest is worth a warning. Of the zoffload block, the loss's
  // normalisation and the data's order do (the state dtypes are checked apart, and refused).
  if (path == "zoffload") {
    for (const char* key : {"loss_normalization", "data"}) {
      if (a.contains(key) && b.contains(key)) config_diff(a[key], b[key], path + "." + key, out);
    }
    return;
  }
  for (const char* skip :
       {"aio", "zero_optimization", "steps_per_print", "wall_clock_breakdown", "tensorboard", "csv_monitor"}) {
    if (path.rfind(skip, 0) == 0) return;
  }
  if (a.is_object() && b.is_object()) {
    for (auto it = a.begin(); it != a.end(); ++it) {
      const std::string p = path.empty() ? it.key() : path + "." + it.key();
      if (!b.contains(it.key())) out->push_back(p);
      else config_diff(it.value(), b[it.key()], p, out);
    }
    for (auto it = b.begin(); it != b.end(); ++it) {
      if (!a.contains(it.key())) out->push_back(path.empty() ? it.key() : path + "." + it.key());
    }
  } else if (a != b) {
    out->push_back(path);
  }
}

const char* torch_dtype_name(DType dtype) {
  return dtype == DType::kBF16 ? "bfloat16" : dtype == DType::kF16 ? "float16" : "float32";
}

}  // namespace

RunOutputs::RunOutputs(const RunSetup& setup) : setup_(setup), run_id_(new_run_id()) {}

// Note [Run ids]
// Each run has an id (16 hex digits, random at a fresh start, kept by a resumed run), written into
// its checkpoints' trainer_state.json with its --out, and into OUT/.zoffload.run_id once the run has
// started. Two runs that share a checkpoint directory one after the other (its lock stops them at
// the same time: Note [One run per run directory]) leave `latest` naming the last one's step:
// `--resume latest` from the other's --out would silently load its weights, moments and data
// position. So a resume that found its checkpoint through `latest` refuses one whose run id is not
// the id in --out; naming the step directory itself is the way to continue another run's checkpoint
// on purpose. Checkpoints and run directories from before run ids have none and are accepted.
Status RunOutputs::read_run_id() {
  const std::string path = resolve_run_path(setup_.options().out_dir, kRunIdFile);
  ZO_ASSIGN_OR_RETURN(const io::PathKind kind, setup_.env()->path_kind(path));
  if (kind != io::PathKind::kMissing) {
    ZO_ASSIGN_OR_RETURN(std::string text, setup_.env()->read_file(path, "the run id file", 64));
    while (!text.empty() && (text.back() == '\n' || text.back() == ' ')) text.pop_back();
    out_run_id_ = text;
  }
  return Status::ok();
}

Status RunOutputs::write_run_id() {
  if (setup_.rank() != 0 || run_id_ == out_run_id_) return Status::ok();
  return setup_.env()->publish_file(resolve_run_path(setup_.options().out_dir, kRunIdFile), run_id_ + "\n",
                                    "the run id file");
}

Status RunOutputs::open_checkpoint_dir(OutputLocks* locks) {
  const Config& config = setup_.config();
  io::Env* env = setup_.env();
  if (config.zoffload.checkpoint.dir.empty()) return Status::ok();
  checkpoint_dir_ = resolve_run_path(setup_.options().out_dir, config.zoffload.checkpoint.dir);
  ZO_ASSIGN_OR_RETURN(const io::PathKind kind, env->path_kind(checkpoint_dir_));
  if (kind != io::PathKind::kMissing && kind != io::PathKind::kDirectory)
    return invalid_argument("zoffload.checkpoint.dir " + checkpoint_dir_ + " exists and is not a directory");
  // Missing: its parents must be directories or missing (not "file/ckpt").
  if (kind == io::PathKind::kMissing)
    ZO_RETURN_IF_ERROR(env->check_output_file(checkpoint_dir_, "zoffload.checkpoint.dir"));
  if (setup_.rank() != 0) return Status::ok();  // rank 0 writes the checkpoints, and tidies them
  ZO_RETURN_IF_ERROR(locks->lock_output_dir(checkpoint_dir_, "zoffload.checkpoint.dir", /*inside_out_too=*/true, env));
  ZO_ASSIGN_OR_RETURN(std::vector<std::string> stale, clean_stale_checkpoints(checkpoint_dir_, env));
  for (const std::string& name : stale)
    ZO_LOG(kInfo) << "removed " << checkpoint_dir_ << "/" << name << ", left by a save that did not finish";
  return Status::ok();
}

Status RunOutputs::find_resume() {
  const TrainOptions& opt = setup_.options();
  const ModelConfig& model = setup_.model().config;
  if (opt.resume.empty()) return Status::ok();
  std::string where = opt.resume;
  if (where == "latest") {
    if (checkpoint_dir_.empty())
      return invalid_argument(
          "--resume latest: the config sets no zoffload.checkpoint.dir to look in; give the "
          "checkpoint's path instead");
    where = checkpoint_dir_;
  }
  auto path = resolve_checkpoint(where, setup_.env());
  // A --resume that names no checkpoint is bad input, like a bad --model.
  if (!path.is_ok() && path.status().code() == StatusCode::kNotFound)
    return invalid_argument("--resume: " + path.status().message());
  if (!path.is_ok()) return path.status();
  ZO_ASSIGN_OR_RETURN(CheckpointInfo info, open_checkpoint(*path, setup_.env()));
  // Note [Run ids]: a checkpoint found through `latest` must be this --out's run's.
  const bool via_latest = *path != where;
  if (via_latest && setup_.rank() == 0 && !info.state.run_id.empty() && !out_run_id_.empty() &&
      info.state.run_id != out_run_id_)
    return invalid_argument("--resume " + opt.resume + ": " + info.path + " was written by another run (run id " +
                            info.state.run_id + (info.state.out.empty() ? "" : ", --out " + info.state.out) +
                            ") than the one in " + (opt.out_dir.empty() ? "." : opt.out_dir) + " (run id " +
                            out_run_id_ + "): two runs share " + where + ". Give the step directory itself (--resume " +
                            info.path + ") to continue that run from here");
  run_id_ = info.state.run_id.empty() ? new_run_id() : info.state.run_id;
  // A model this build cannot compute (a family it does not know, saved by a newer build) is
  // refused before anything is read, even where its tensors have the run's names and shapes.
  Result<ModelConfig> saved = parse_hf_config(info.model_config_json, info.path + "/config.json");
  if (!saved.is_ok())
    return Status(saved.status()).with_context("--resume " + info.path + ": its model is not one this build trains");
  // The adapters' scale is no tensor's shape, so the state files cannot tell it: a resume with
  // another lora_alpha or use_rslora would go on training another function (as would other targets).
  ZO_ASSIGN_OR_RETURN(const LoraConfig saved_lora,
                      checkpoint_lora_config(info.state.config, info.path + "/trainer_state.json"));
  Result<LoraSpec> saved_spec = lora_spec(model, saved_lora);
  if (!saved_spec.is_ok())
    return invalid_argument("--resume " + info.path + ": its zoffload.lora does not fit this model (" +
                            saved_spec.status().message() + "): a checkpoint of another model");
  const std::string differs = lora_difference(*saved_spec, model.lora);
  if (!differs.empty() && saved_spec->r == 0)
    return invalid_argument("--resume " + info.path +
                            ": it holds no LoRA adapters, and this run's zoffload.lora asks "
                            "for r " +
                            std::to_string(model.lora.r) + ": resume with the checkpoint's zoffload.lora");
  if (!differs.empty())
    return invalid_argument("--resume " + info.path + ": its LoRA adapters were trained with " + differs +
                            " as this run's zoffload.lora gives: resume with the checkpoint's zoffload.lora (r, "
                            "lora_alpha, use_rslora, target_modules)");
  resume_ = std::move(info);
  return Status::ok();
}

// What differs from the checkpoint is said; training continues with the run's own.
void RunOutputs::finish_resume(const DataOptions& data) {
  const TrainOptions& opt = setup_.options();
  const TrainingState& st = resume_->state;
  resumed_from_ = resume_->path;
  last_saved_step_ = st.steps_done;
  std::vector<std::string> diff;
  config_diff(st.config, to_json(opt.config), "", &diff);
  if (!diff.empty()) {
    std::vector<std::string> shown(diff.begin(), diff.begin() + std::min<size_t>(diff.size(), 8));
    ZO_LOG(kWarn) << "resuming from " << resume_->path
                  << " with a config that differs from the one it was saved with at " << join(shown, ", ")
                  << (diff.size() > shown.size() ? ", ..." : "") << ": training continues with the new values";
  }
  if (st.data != fs::absolute(opt.data_path).lexically_normal().string() || st.seq_len != data.seq_len) {
    ZO_LOG(kWarn) << "resuming from " << resume_->path << ", saved while reading " << st.data << " with --seq-len "
                  << st.seq_len << ", now " << opt.data_path << " with " << data.seq_len
                  << ": the data position (epoch " << st.data_position.epoch << ", batch " << st.data_position.index
                  << ") is applied to the new data";
  }
  const std::string saved = resume_->model_config_json;
  if (saved != model_config_json()) {
    const ModelConfig& model = setup_.model().config;
    auto saved_model = parse_hf_config(saved, resume_->path + "/config.json");  // parsed by find_resume
    if (saved_model.is_ok() && to_hf_config_json(*saved_model, "") != to_hf_config_json(model, "")) {
      ZO_LOG(kWarn) << "resuming from " << resume_->path << ": its config.json differs from " << opt.model
                    << "'s beyond the tensor shapes (norm eps, rope, ...): training continues with " << opt.model
                    << "'s";
    }
  }
  resume_.reset();
}

bool RunOutputs::checkpoint_due(uint64_t steps_done, bool end_of_run) const {
  if (checkpoint_dir_.empty() || last_saved_step_ == steps_done) return false;
  if (end_of_run) return true;
  const uint64_t every = setup_.config().zoffload.checkpoint.every_steps;
  return every > 0 && steps_done % every == 0;
}

void RunOutputs::fill_state(TrainingState* st) const {
  const TrainOptions& opt = setup_.options();
  st->model = model_source();
  st->data = fs::absolute(opt.data_path).lexically_normal().string();
  st->world_size = setup_.world_size();
  st->config = to_json(opt.config);
  st->run_id = run_id_;
  st->out = fs::absolute(opt.out_dir.empty() ? "." : opt.out_dir).lexically_normal().string();
}

Result<SaveResult> RunOutputs::save(const TrainingState& state,
                                    const std::function<void(uint64_t, uint64_t)>& progress) {
  const uint64_t steps_done = state.steps_done;
  trace::Span span(trace::Track::kCheckpoint, [&] { return "save step-" + std::to_string(steps_done); });
  if (checkpoint_dir_.empty())
    return failed_precondition("no checkpoint directory: set zoffload.checkpoint.dir in the config");
  const CheckpointConfig& cc = setup_.config().zoffload.checkpoint;
  dist::ProcessGroup* group = setup_.group();
  SaveOptions o;
  o.dir = checkpoint_dir_;
  o.keep_last = cc.keep_last;
  o.staging_bytes = cc.staging_buffer_size;
  o.progress = progress;
  o.env = setup_.env();
  if (group == nullptr) {
    ZO_ASSIGN_OR_RETURN(SaveResult r, engine::save_checkpoint(setup_.store(), state, model_config_json(), o));
    last_saved_step_ = steps_done;
    return r;
  }
  if (setup_.plan().partitioned()) {
    // Note [Partitioned data parallel]: each rank writes its partition (Note [Collaborative save]).
    o.collective =
        SaveOptions::Collective{.rank = setup_.rank(),
                                .world_size = setup_.world_size(),
                                .broadcast = [group](void* data, uint64_t n, uint32_t root, const std::string& what) {
                                  return group->broadcast(data, n, root, what);
                                }};
    Result<SaveResult> r = engine::save_checkpoint(setup_.store(), state, model_config_json(), o);
    if (r.is_ok()) last_saved_step_ = steps_done;
    return r;
  }
  // Note [Replicated data parallel]: every rank holds the same states; rank 0 writes them while the
  // others wait, so that no rank runs ahead into the next step's collectives during a long save.
  Result<SaveResult> r = SaveResult{};
  if (setup_.rank() == 0) r = engine::save_checkpoint(setup_.store(), state, model_config_json(), o);
  {
    trace::Span wait(trace::Track::kCollective, "wait for rank 0's checkpoint");
    ZO_RETURN_IF_ERROR(group->barrier("waiting for rank 0 to save step-" + std::to_string(steps_done)));
  }
  if (r.is_ok()) last_saved_step_ = steps_done;
  return r;
}

Result<ExportResult> RunOutputs::export_model(const ExportOptions& options) const {
  const ModelConfig& model = setup_.model().config;
  ExportOptions o = options;
  o.env = setup_.env();  // the run's own: io_faults reach the export too
  const std::string config_json = to_hf_config_json(model, torch_dtype_name(options.dtype));
  if (model.lora.r > 0) {  // Note [Exporting LoRA adapters]
    o.lora.emplace();
    o.lora->merged = options.lora && options.lora->merged;
    o.lora->scaling = model.lora.scaling();
    o.lora->adapter_config_json = peft_adapter_config_json(model.lora, model_source());
  }
  if (!setup_.plan().partition_params) return export_store(setup_.store(), config_json, setup_.io(), o);
  dist::ProcessGroup* group = setup_.group();
  const ExportCollective ranks{
      .rank = setup_.rank(),
      .world_size = setup_.world_size(),
      .broadcast = [group](void* data, uint64_t n, uint32_t root,
                           const std::string& what) { return group->broadcast(data, n, root, what); },
      .first_failed_rank = [group](bool failed,
                                   const std::string& what) { return dist::first_failed_rank(*group, failed, what); }};
  return export_gathered(setup_.store(), config_json, setup_.io(), ranks, o);
}

bool RunOutputs::export_needs_every_rank() const { return setup_.plan().partition_params; }

DType RunOutputs::export_dtype() const {
  const Config& c = setup_.config();
  // LoRA adapters are small and kept in fp32, as PEFT keeps them; a rank holding its partition of
  // the compute copies only exports in the compute dtype.
  if (setup_.model().config.lora.r > 0 && !setup_.plan().partition_params) return DType::kF32;
  return c.bf16.enabled ? DType::kBF16 : c.fp16.enabled ? DType::kF16 : DType::kF32;
}

std::string RunOutputs::model_config_json() const {
  return to_hf_config_json(setup_.model().config, torch_dtype_name(setup_.model().compute_dtype));
}

std::string RunOutputs::model_source() const {
  const std::string& name = setup_.options().model;
  return setup_.model().from_dir ? fs::absolute(name).lexically_normal().string() : name;
}

}  // namespace zo::engine

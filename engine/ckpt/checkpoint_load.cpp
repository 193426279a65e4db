#include "engine/ckpt/checkpoint.h"

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <filesystem>

#include "common/check.h"
#include "common/string_util.h"
#include "engine/ckpt/state_files.h"
#include "engine/memory/moment_layout.h"
#include "engine/model/model_config.h"
#include "engine/model/safetensors.h"

namespace zo::engine {
using json = nlohmann::json;

namespace {

// A small file of a checkpoint (latest, the manifest, the trainer state, config.json), whole. No
// save writes one over kMaxSmallFileBytes, so a larger one is kCorruption, not a bad argument.
Result<std::string> read_checkpoint_file(io::Env* env, const std::string& path) {
  Result<std::string> text = env->read_file(path, "checkpoint file", kMaxSmallFileBytes);
  if (!text.is_ok() && text.status().sys_errno() == EFBIG) return corruption(text.status().message());
  return text;
}

}  // namespace

Result<std::string> resolve_checkpoint(const std::string& path, io::Env* env) {
  auto kind = [env](const std::string& p) {
    Result<io::PathKind> k = env->path_kind(p);
    return k.is_ok() ? *k : io::PathKind::kMissing;
  };
  if (kind(path) == io::PathKind::kMissing) return not_found("checkpoint " + path + " does not exist");
  if (kind(path + "/" + kManifestFile) != io::PathKind::kMissing) return path;
  if (kind(path + "/" + kLatestFile) != io::PathKind::kMissing) {
    ZO_ASSIGN_OR_RETURN(std::string text, read_checkpoint_file(env, path + "/" + kLatestFile));
    while (!text.empty() && (text.back() == '\n' || text.back() == ' ')) text.pop_back();
    if (text.rfind("step-", 0) != 0 || text.find('/') != std::string::npos) {
      return corruption(path + "/" + kLatestFile + " names \"" + quote_excerpt(text) + "\", not a step-<N> directory");
    }
    const std::string target = path + "/" + text;
    if (kind(target + "/" + kManifestFile) == io::PathKind::kMissing) {
      return corruption(path + "/" + kLatestFile + " names " + quote_excerpt(text) + ", which has no " + kManifestFile);
    }
    return target;
  }
  std::filesystem::path norm = std::filesystem::path(path).lexically_normal();
  if (norm.filename().empty()) norm = norm.parent_path();
  const std::string base = norm.filename().string();
  const bool is_dir = kind(path) == io::PathKind::kDirectory;
  if (is_dir && (base.rfind("step-", 0) == 0 || base.rfind("tmp-", 0) == 0)) {
    return corruption(path + " has no " + kManifestFile + ": an incomplete save, never loaded");
  }
  if (is_dir) {
    return not_found(path + " is not a checkpoint: it has neither " + kManifestFile + " (a step directory) nor " +
                     kLatestFile + " (a checkpoint directory)");
  }
  return not_found(path + " is not a checkpoint directory");
}

Result<CheckpointInfo> open_checkpoint(const std::string& path, io::Env* env) {
  CheckpointInfo info;
  info.path = path;
  const std::string mpath = path + "/" + kManifestFile;
  auto mtext = read_checkpoint_file(env, mpath);
  if (!mtext.is_ok()) {
    if (mtext.status().code() == StatusCode::kNotFound) {
      return corruption(path + " has no " + kManifestFile + ": an incomplete save, never loaded");
    }
    return mtext.status();
  }
  ZO_ASSIGN_OR_RETURN(json mj, parse_json_object(*mtext, mpath));
  ZO_ASSIGN_OR_RETURN(info.manifest, Manifest::from_json(mj, mpath));
  for (const char* required : {kTrainerStateFile, kModelConfigFile}) {
    if (!info.manifest.find(required)) return corruption(mpath + ": lists no " + required);
  }
  const std::vector<StateFile> files =
      state_files(info.manifest.moments, info.manifest.master_dtype, info.manifest.frozen_file_dtype());
  for (const StateFile& file : files) {
    if (!info.manifest.find(file.name)) return corruption(mpath + ": lists no " + file.name);
  }
  for (const FileDigest& f : info.manifest.files) {
    const std::string fpath = path + "/" + f.name;
    Result<uint64_t> size_or = env->file_size(fpath);
    if (!size_or.is_ok()) return corruption(fpath + ": listed in the manifest but " + size_or.status().message());
    const uint64_t size = *size_or;
    if (size != f.size_bytes) {
      return corruption(fpath + ": " + std::to_string(size) + " bytes, the manifest says " +
                        std::to_string(f.size_bytes));
    }
  }
  // The small files are read whole and checked here; the state files by verify/load.
  auto small = [&](const char* name) -> Result<std::string> {
    const std::string fpath = path + "/" + name;
    ZO_ASSIGN_OR_RETURN(std::string text, read_checkpoint_file(env, fpath));
    ChunkVerifier v(*info.manifest.find(name), fpath);
    ZO_RETURN_IF_ERROR(v.update(std::as_bytes(std::span(text.data(), text.size()))));
    ZO_RETURN_IF_ERROR(v.finish());
    return text;
  };
  ZO_ASSIGN_OR_RETURN(std::string stext, small(kTrainerStateFile));
  ZO_ASSIGN_OR_RETURN(json sj, parse_json_object(stext, path + "/" + kTrainerStateFile));
  ZO_ASSIGN_OR_RETURN(info.state, TrainingState::from_json(sj, path + "/" + kTrainerStateFile));
  ZO_ASSIGN_OR_RETURN(info.model_config_json, small(kModelConfigFile));
  if (info.state.steps_done != info.manifest.step) {
    return corruption(mpath + ": step " + std::to_string(info.manifest.step) + " but " + kTrainerStateFile +
                      " says steps_done " + std::to_string(info.state.steps_done));
  }
  // The state files' headers must list the tensors the manifest's imply, in order, in their dtype
  // (F32; BF16 for bf16 moments or masters); a codes file holds a byte per element of the quantized ones.
  for (const StateFile& file : files) {
    const std::string fpath = path + "/" + file.name;
    if (file.part == StatePart::kMomentCodes) {
      const uint64_t want = state_file_data_bytes(file, info.manifest.tensors);
      if (info.manifest.find(file.name)->size_bytes != want) {
        return corruption(fpath + ": " + std::to_string(info.manifest.find(file.name)->size_bytes) +
                          " bytes, but the manifest's tensors have " + std::to_string(want) + " quantized elements");
      }
      continue;
    }
    const std::vector<SafetensorsEntry> expected = state_file_tensors(file, file_tensors(info.manifest, file));
    ZO_ASSIGN_OR_RETURN(auto st, SafetensorsFile::open(fpath, env));
    const auto& ts = st->tensors();
    if (ts.size() != expected.size()) {
      return corruption(fpath + ": " + std::to_string(ts.size()) + " tensors, the manifest implies " +
                        std::to_string(expected.size()));
    }
    uint64_t expect_offset = ts.empty() ? 0 : ts.front().data_offset_bytes;
    if (expect_offset % 4 != 0) {
      return corruption(fpath + ": the data starts at offset " + std::to_string(expect_offset) +
                        ", not a multiple of 4 (a zoffload checkpoint pads it to 4096)");
    }
    for (size_t i = 0; i < ts.size(); ++i) {
      const SafetensorsEntry& t = expected[i];
      if (ts[i].bytes() || ts[i].name != t.name || ts[i].shape != t.shape || ts[i].dtype != t.dtype ||
          ts[i].data_offset_bytes != expect_offset) {
        return corruption(fpath + ": tensor " + std::to_string(i) + " is " + ts[i].name + " " +
                          std::string(ts[i].type_text()) + " " + shape_string(ts[i].shape) + ", the manifest says " +
                          t.name + " " + std::string(dtype_name(t.dtype)) + " " + shape_string(t.shape) +
                          ", stored back to back");
      }
      expect_offset += ts[i].size_bytes;
    }
    if (expect_offset != st->file_size_bytes()) {
      return corruption(fpath + ": the tensors end at " + std::to_string(expect_offset) + " but the file has " +
                        std::to_string(st->file_size_bytes()) + " bytes");
    }
  }
  return info;
}

Status verify_checkpoint(const CheckpointInfo& ckpt, io::IoEngine& io, std::span<std::byte> staging, io::Env* env,
                         const std::function<void(uint64_t, uint64_t)>& progress) {
  ZO_RETURN_IF_ERROR(check_staging_bytes(staging.size(), "verifying " + ckpt.path));
  uint64_t total = 0, done = 0;
  for (const FileDigest& f : ckpt.manifest.files) total += f.size_bytes;
  const Manifest& m = ckpt.manifest;
  const std::vector<StateFile> files = state_files(m.moments, m.master_dtype, m.frozen_file_dtype());
  for (const FileDigest& f : ckpt.manifest.files) {
    const std::string path = ckpt.path + "/" + f.name;
    // A state file's values are checked as they pass (Note [Checked values]); the others' checksums only.
    std::optional<StateValueCheck> values;
    for (const StateFile& file : files) {
      if (file.name == f.name) { ZO_ASSIGN_OR_RETURN(values, StateValueCheck::open(file, path, env)); }
    }
    ZO_RETURN_IF_ERROR(read_stream(
        io, env, path, f, staging, values ? values->data_start() : f.size_bytes,
        [&](uint64_t offset, std::span<const std::byte> bytes) {
          return values ? values->check(offset, bytes) : Status::ok();
        },
        [&](uint64_t n) {
          done += n;
          if (progress) progress(done, total);
        }));
  }
  return Status::ok();
}

Status load_checkpoint(const CheckpointInfo& ckpt, StateStore& store, io::IoEngine& io, std::span<std::byte> staging,
                       io::Env* env) {
  const std::string context = "loading checkpoint " + ckpt.path;
  ZO_RETURN_IF_ERROR(check_staging_bytes(staging.size(), context));
  const ParamRegistry& reg = store.registry();
  const Manifest& m = ckpt.manifest;
  // LoRA adapters (Note [LoRA adapters]): the same, or a mismatch said as such.
  auto adapters = [](const auto& list) {
    return std::count_if(list.begin(), list.end(), [](const auto& t) { return is_lora_param(t.name); });
  };
  const auto saved_adapters = adapters(m.tensors) + adapters(m.frozen), run_adapters = adapters(reg.params());
  if (saved_adapters != run_adapters)
    return invalid_argument(context + ": it holds " + std::to_string(saved_adapters) +
                            " LoRA adapter tensors, this run's model " + std::to_string(run_adapters) +
                            ": resume with the checkpoint's zoffload.lora (its r and target_modules)");
  // Its trainable and frozen tensors (Note [Frozen sub-groups]) must be this run's, name by name.
  if (m.tensors.size() + m.frozen.size() != reg.params().size()) {
    return invalid_argument(context + ": it holds " + std::to_string(m.tensors.size() + m.frozen.size()) +
                            " tensors, the model has " + std::to_string(reg.params().size()) + " parameters");
  }
  size_t next_trainable = 0, next_frozen = 0;
  for (const ParamInfo& p : reg.params()) {
    const CheckpointTensor want = checkpoint_tensor(p);
    const bool saved_trainable = next_trainable < m.tensors.size() && m.tensors[next_trainable].name == want.name;
    const bool saved_frozen =
        !saved_trainable && next_frozen < m.frozen.size() && m.frozen[next_frozen].name == want.name;
    const std::string other = p.packed ? p.name : p.name + std::string(kPackedTensorSuffix);
    if (!saved_trainable && !saved_frozen && next_frozen < m.frozen.size() && m.frozen[next_frozen].name == other)
      return invalid_argument(context + ": its " + p.name +
                              (p.packed
                                   ? " is in the compute dtype, and this run keeps it packed (a 4-bit or 8-bit base)"
                                   : " is packed (a 4-bit or 8-bit base), and this run keeps it in the compute dtype") +
                              ": resume over the checkpoint's base (its model directory and zoffload.quantize_base)");
    if (!saved_trainable && !saved_frozen) {
      const bool anywhere =
          std::any_of(m.tensors.begin(), m.tensors.end(),
                      [&](const CheckpointTensor& t) { return t.name == p.name; }) ||
          std::any_of(m.frozen.begin(), m.frozen.end(), [&](const CheckpointTensor& t) { return t.name == p.name; });
      return invalid_argument(context + ": the model's parameter " + std::to_string(p.id) + " " + p.name +
                              (anywhere ? " is not where this checkpoint has it" : " is not in it") +
                              ": a checkpoint of a different model");
    }
    const CheckpointTensor& t = saved_trainable ? m.tensors[next_trainable++] : m.frozen[next_frozen++];
    if (want.shape != t.shape)
      return invalid_argument(context + ": tensor " + t.name + " is " + shape_string(t.shape) +
                              " but the model's parameter is " + shape_string(want.shape) +
                              ": a checkpoint of a different model");
    if (saved_trainable != p.trainable)
      return invalid_argument(context + ": " + p.name + " was " + (saved_trainable ? "trained" : "frozen") +
                              " when it was saved and this run " + (p.trainable ? "trains" : "freezes") +
                              " it: resume with the checkpoint's zoffload.freeze");
  }
  const MemoryPlan& plan = store.plan();
  if (!m.frozen.empty() && m.frozen_dtype != plan.placement.compute_dtype)
    return invalid_argument(context + ": its frozen parameters are kept in " + std::string(dtype_name(m.frozen_dtype)) +
                            ", this run computes in " + std::string(dtype_name(plan.placement.compute_dtype)) +
                            ": resume with the checkpoint's precision (bf16.enabled / fp16.enabled)");
  if (ckpt.manifest.moments != plan.placement.moments) {
    return invalid_argument(context + ": it keeps the optimizer's moments in " +
                            std::string(moment_dtype_name(ckpt.manifest.moments)) + ", this run in " +
                            std::string(moment_dtype_name(plan.placement.moments)) +
                            " (zoffload.moment_dtype): resume with the checkpoint's moment_dtype");
  }
  // Adam and AdamW keep the same two moments; Adagrad's sum of squares and Lion's momentum are
  // other states (Note [One moment for Adagrad and Lion]). A checkpoint that does not say is older
  // than the optimizers that could tell them apart by their files, and is read as it always was.
  const auto family = [](OptimizerType t) { return t == OptimizerType::kAdamW ? OptimizerType::kAdam : t; };
  if (ckpt.manifest.optimizer_type && family(*ckpt.manifest.optimizer_type) != family(plan.placement.optimizer_type)) {
    return invalid_argument(context + ": it holds " + std::string(to_string(*ckpt.manifest.optimizer_type)) +
                            "'s optimizer states, this run steps " +
                            std::string(to_string(plan.placement.optimizer_type)) +
                            " (optimizer.type): resume with the checkpoint's optimizer.type, or start a new run "
                            "from `zoffload export` of it");
  }
  if (ckpt.manifest.master_dtype != plan.placement.master_dtype) {
    return invalid_argument(context + ": it keeps the master weights in " +
                            std::string(dtype_name(ckpt.manifest.master_dtype)) + ", this run in " +
                            std::string(dtype_name(plan.placement.master_dtype)) +
                            " (zoffload.master_dtype): resume with the checkpoint's master_dtype, or start a new "
                            "run from `zoffload export` of it");
  }
  const uint32_t n_groups = plan.n_sub_groups;
  for (const StateFile& file :
       state_files(plan.placement.moments, plan.placement.master_dtype, m.frozen_file_dtype())) {
    const StateKind kind = file.kind;
    const std::string fpath = ckpt.path + "/" + file.name;
    // What precedes the sub-groups' parts: the header (a codes file has none) and, in an 8-bit
    // moment's safetensors, the map, which must be the one this build quantizes with. The values
    // after it are checked as they pass (Note [Checked values]).
    ZO_ASSIGN_OR_RETURN(const StateValueCheck values, StateValueCheck::open(file, fpath, env));
    uint64_t data_start = values.data_start();
    if (file.part == StatePart::kMomentAux) {
      const SafetensorsFile* header = values.header();
      const auto& want = quant_map(plan.placement, kind);
      std::array<float, 256> map{};
      ZO_RETURN_IF_ERROR(
          header->read_raw(header->tensors().front(), 0, {reinterpret_cast<uint8_t*>(map.data()), sizeof map}));
      if (std::memcmp(map.data(), want.data(), sizeof map) != 0)
        return corruption(fpath + ": its " + kQuantMapTensor + " is not the map this run's " +
                          std::string(to_string(plan.placement.optimizer_type)) + " quantizes " +
                          std::string(state_name(kind)) + " with (a checkpoint of another optimizer.type?)");
      data_start += sizeof map;
    }
    // File bytes [data_start, ...) are the parts of every sub-group in order (Note [State file layout]).
    const StateFileLayout layout(reg, plan.placement, file, data_start);
    uint32_t g = 0;
    auto consume = [&](uint64_t offset, std::span<const std::byte> bytes) -> Status {
      ZO_RETURN_IF_ERROR(values.check(offset, bytes));
      uint64_t at = offset;
      while (!bytes.empty()) {
        while (g < n_groups && at >= layout.offset(g + 1)) ++g;
        if (g == n_groups) return corruption(fpath + ": more data than the model's parameters");
        const uint64_t in_group = layout.part(g).first + (at - layout.offset(g));
        const uint64_t n = std::min<uint64_t>(bytes.size(), layout.offset(g + 1) - at);
        // A frozen sub-group's compute copy (kFrozenFile) is held by every rank that holds its
        // compute copies; the optimizer states by their owner.
        if (file.frozen ? plan.holds(g, StateKind::kCompute) : plan.owns(g))
          ZO_RETURN_IF_ERROR(store.write_state_range(g, kind, in_group, bytes.first(n)));
        if (kind == StateKind::kMaster && plan.holds(g, StateKind::kCompute)) {
          if (file.dtype == DType::kF32) {
            ZO_CHECK(in_group % 4 == 0 && n % 4 == 0) << fpath << ": unaligned fp32 run";
            const auto* values = reinterpret_cast<const float*>(bytes.data());
            ZO_RETURN_IF_ERROR(store.write_compute_from_master(g, in_group / 4, {values, n / 4}));
          } else if (!(plan.owns(g) && master_is_compute_copy(plan.placement, g))) {
            // A bf16 master's bytes are its compute copy's (bf16 too), at the same offsets; where the
            // master is the compute copy (Note [A bf16 master is its compute copy]) they are written.
            ZO_RETURN_IF_ERROR(store.write_state_range(g, StateKind::kCompute, in_group, bytes.first(n)));
          }
        }
        bytes = bytes.subspan(n);
        at += n;
      }
      return Status::ok();
    };
    // A data-parallel rank (Note [Partitions]) reads its partition's run of exp_avg and exp_avg_sq,
    // and all of master and of the frozen compute copies, whose every element sets a compute copy —
    // or, when the compute copies are partitioned too (stage 3), its run of them as well.
    const FileDigest& digest = *ckpt.manifest.find(file.name);
    Status read;
    const bool sets_compute = kind == StateKind::kMaster || file.frozen;
    if ((sets_compute && !plan.partition_params) || !plan.partitioned()) {
      read = read_stream(io, env, fpath, digest, staging, data_start, consume, {});
    } else {
      g = plan.owned_begin;
      read = read_stream_range(io, env, fpath, digest, staging, layout.offset(plan.owned_begin),
                               layout.offset(plan.owned_end), consume, {});
    }
    ZO_RETURN_IF_ERROR(read.with_context(context));
  }
  return Status::ok();
}

json describe_checkpoint(const CheckpointInfo& ckpt) {
  uint64_t params = 0, frozen = 0, bytes = 0;
  for (const CheckpointTensor& t : ckpt.manifest.tensors) params += t.n_elems;
  // A packed weight's entry counts its blob, not its weights (Note [The packed 4-bit base]).
  uint64_t packed_tensors = 0, packed_bytes = 0;
  for (const CheckpointTensor& t : ckpt.manifest.frozen) {
    if (!t.name.ends_with(kPackedTensorSuffix)) {
      frozen += t.n_elems;
      continue;
    }
    ++packed_tensors;
    packed_bytes += t.n_elems * dtype_size_bytes(ckpt.manifest.frozen_dtype);
  }
  json files = json::object();
  for (const FileDigest& f : ckpt.manifest.files) {
    files[f.name] = f.size_bytes;
    bytes += f.size_bytes;
  }
  json model = json::parse(ckpt.model_config_json, nullptr, false);
  json out = {{"path", ckpt.path},
              {"format_version", ckpt.manifest.format_version},
              {"step", ckpt.state.steps_done},
              {"optimizer_steps", ckpt.state.optimizer_steps},
              {"skipped_steps", ckpt.state.steps_done - ckpt.state.optimizer_steps},
              {"loss_scale", ckpt.state.loss_scaler.cur_scale},
              {"data_position", {{"epoch", ckpt.state.data_position.epoch}, {"index", ckpt.state.data_position.index}}},
              {"seed", ckpt.state.seed},
              {"model", ckpt.state.model},
              {"data", ckpt.state.data},
              {"seq_len", ckpt.state.seq_len},
              {"world_size", ckpt.state.world_size},
              {"moment_dtype", moment_dtype_name(ckpt.manifest.moments)},
              {"tensors", ckpt.manifest.tensors.size() + ckpt.manifest.frozen.size()},
              {"parameters", params + frozen},
              {"frozen_parameters", frozen},
              {"packed_base_tensors", packed_tensors},
              {"packed_base_bytes", packed_bytes},
              {"bytes", bytes},
              {"files", files}};
  if (model.is_object()) {
    for (const char* k : {"model_type", "hidden_size", "num_hidden_layers", "vocab_size"}) {
      if (model.contains(k)) out["model_config"][k] = model[k];
    }
  }
  const json& c = ckpt.state.config;
  if (c.is_object()) {
    json highlights = json::object();
    for (const char* k : {"bf16", "fp16", "zero_optimization", "optimizer", "scheduler", "gradient_accumulation_steps",
                          "train_micro_batch_size_per_gpu"}) {
      if (c.contains(k)) highlights[k] = c[k];
    }
    out["config"] = highlights;
  }
  return out;
}

}  // namespace zo::engine

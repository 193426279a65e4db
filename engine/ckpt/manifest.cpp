#include "engine/ckpt/manifest.h"

#include <cmath>
#include <cstdint>
#include <cstdio>

#include "common/check.h"
#include "common/string_util.h"
#include "engine/ckpt/state_files.h"

namespace zo::engine {
using json = nlohmann::json;

namespace {

constexpr const char* kFormatName = "zoffload-checkpoint";

std::string hex32(uint32_t v) {
  char buf[9];
  std::snprintf(buf, sizeof buf, "%08x", v);
  return buf;
}

// Reads a json field of the expected kind or fails naming it.
template <typename T>
Status get(const json& j, const char* key, T* out, const std::string& source) {
  auto it = j.find(key);
  if (it == j.end()) return corruption(source + ": missing \"" + key + "\"");
  try {
    *out = it->get<T>();
  } catch (const json::exception& e) { return corruption(source + ": \"" + key + "\": " + e.what()); }
  return Status::ok();
}

// A value as an error quotes it: JSON, bounded.
std::string quoted(const json& v) { return quote_excerpt(v.dump(-1, ' ', false, json::error_handler_t::replace), 32); }

// Note [Strict counters]
// nlohmann's get<uint64_t>() converts whatever number it finds: -1 wraps to 2^64 − 1, 1e30 is cast
// out of range (undefined), true is 1. The counters of trainer_state.json are read as what they
// are instead: a JSON integer (no fraction, exponent, string or boolean) within the field's range,
// else kCorruption "SOURCE: KEY: VALUE is not a whole number in [MIN, MAX)". KEY is `prefix` +
// `field`: the dotted path of a nested field (loss_scaler.cur_iter).

// The field `prefix` + `field` names, or kCorruption "SOURCE: missing "KEY"".
Result<const json*> find_field(const json& j, const std::string& prefix, const char* field, const std::string& source) {
  auto it = j.find(field);
  if (it == j.end()) return corruption(source + ": missing \"" + prefix + field + "\"");
  return &*it;
}

Status get_whole(const json& j, const std::string& prefix, const char* field, uint64_t min, uint64_t* out,
                 const std::string& source) {
  ZO_ASSIGN_OR_RETURN(const json* v, find_field(j, prefix, field, source));
  const bool whole = v->is_number_unsigned() || (v->is_number_integer() && v->get<int64_t>() >= 0);
  if (!whole || v->get<uint64_t>() < min)
    return corruption(source + ": " + prefix + field + ": " + quoted(*v) + " is not a whole number in [" +
                      std::to_string(min) + ", 2^64)");
  *out = v->get<uint64_t>();
  return Status::ok();
}

// The same for a signed counter in [min, 2^63).
Status get_whole(const json& j, const std::string& prefix, const char* field, int64_t min, int64_t* out,
                 const std::string& source) {
  ZO_ASSIGN_OR_RETURN(const json* v, find_field(j, prefix, field, source));
  const bool whole =
      v->is_number_integer() && (!v->is_number_unsigned() || v->get<uint64_t>() <= static_cast<uint64_t>(INT64_MAX));
  if (!whole || v->get<int64_t>() < min)
    return corruption(source + ": " + prefix + field + ": " + quoted(*v) + " is not a whole number in [" +
                      std::to_string(min) + ", 2^63)");
  *out = v->get<int64_t>();
  return Status::ok();
}

// A loss scale: a JSON number, finite and > 0.
Status get_scale(const json& j, const std::string& prefix, const char* field, double* out, const std::string& source) {
  ZO_ASSIGN_OR_RETURN(const json* v, find_field(j, prefix, field, source));
  if (!v->is_number() || !std::isfinite(v->get<double>()) || v->get<double>() <= 0)
    return corruption(source + ": " + prefix + field + ": " + quoted(*v) + " is not a finite number > 0");
  *out = v->get<double>();
  return Status::ok();
}

Status get_string(const json& j, const char* key, std::string* out, const std::string& source) {
  ZO_ASSIGN_OR_RETURN(const json* v, find_field(j, "", key, source));
  if (!v->is_string()) return corruption(source + ": " + key + ": " + quoted(*v) + " is not a string");
  *out = v->get<std::string>();
  return Status::ok();
}

// An object-valued field, or kCorruption naming it.
Status get_object(const json& j, const char* key, json* out, const std::string& source) {
  ZO_ASSIGN_OR_RETURN(const json* v, find_field(j, "", key, source));
  if (!v->is_object()) return corruption(source + ": " + key + ": " + quoted(*v) + " is not an object");
  *out = *v;
  return Status::ok();
}

}  // namespace

const char* state_file_name(StateKind kind) {
  switch (kind) {
    case StateKind::kMaster: return kMasterFile;
    case StateKind::kExpAvg: return kExpAvgFile;
    case StateKind::kExpAvgSq: return kExpAvgSqFile;
    default: break;
  }
  ZO_CHECK(false) << "no checkpoint file for state " << state_name(kind);
  return "";
}

Result<json> parse_json_object(const std::string& text, const std::string& source) {
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return corruption(source + ": not a JSON object");
  return j;
}

std::string shape_string(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

json TrainingState::to_json() const {
  json j = {{"steps_done", steps_done},
          {"optimizer_steps", optimizer_steps},
          {"loss_scaler",
           {{"cur_scale", loss_scaler.cur_scale},
            {"cur_iter", loss_scaler.cur_iter},
            {"last_overflow_iter", loss_scaler.last_overflow_iter},
            {"cur_hysteresis", loss_scaler.cur_hysteresis}}},
          {"data_position", {{"epoch", data_position.epoch}, {"index", data_position.index}}},
          {"seed", seed},
          {"model", model},
          {"data", data},
          {"seq_len", seq_len},
          {"world_size", world_size},
          {"config", config}};
  if (!run_id.empty()) j["run_id"] = run_id;
  if (!out.empty()) j["out"] = out;
  return j;
}

Result<TrainingState> TrainingState::from_json(const json& j, const std::string& source) {
  TrainingState s;
  // Note [Strict counters].
  ZO_RETURN_IF_ERROR(get_whole(j, "", "steps_done", 0, &s.steps_done, source));
  ZO_RETURN_IF_ERROR(get_whole(j, "", "optimizer_steps", 0, &s.optimizer_steps, source));
  ZO_RETURN_IF_ERROR(get_whole(j, "", "seed", 0, &s.seed, source));
  ZO_RETURN_IF_ERROR(get_string(j, "model", &s.model, source));
  ZO_RETURN_IF_ERROR(get_string(j, "data", &s.data, source));
  ZO_RETURN_IF_ERROR(get_whole(j, "", "seq_len", 0, &s.seq_len, source));
  // Absent in a checkpoint from before data parallel: 1 rank.
  if (j.contains("world_size")) ZO_RETURN_IF_ERROR(get_whole(j, "", "world_size", 1, &s.world_size, source));
  json scaler, data;
  ZO_RETURN_IF_ERROR(get_object(j, "loss_scaler", &scaler, source));
  LossScalerState& ls = s.loss_scaler;
  ZO_RETURN_IF_ERROR(get_scale(scaler, "loss_scaler.", "cur_scale", &ls.cur_scale, source));
  ZO_RETURN_IF_ERROR(get_whole(scaler, "loss_scaler.", "cur_iter", 0, &ls.cur_iter, source));
  ZO_RETURN_IF_ERROR(
      get_whole(scaler, "loss_scaler.", "last_overflow_iter", int64_t{-1}, &ls.last_overflow_iter, source));
  ZO_RETURN_IF_ERROR(get_whole(scaler, "loss_scaler.", "cur_hysteresis", 1, &ls.cur_hysteresis, source));
  ZO_RETURN_IF_ERROR(get_object(j, "data_position", &data, source));
  ZO_RETURN_IF_ERROR(get_whole(data, "data_position.", "epoch", 0, &s.data_position.epoch, source));
  ZO_RETURN_IF_ERROR(get_whole(data, "data_position.", "index", 0, &s.data_position.index, source));
  ZO_RETURN_IF_ERROR(get(j, "config", &s.config, source));
  // Absent in a checkpoint from before run ids.
  if (j.contains("run_id")) ZO_RETURN_IF_ERROR(get_string(j, "run_id", &s.run_id, source));
  if (j.contains("out")) ZO_RETURN_IF_ERROR(get_string(j, "out", &s.out, source));
  if (s.optimizer_steps > s.steps_done) {
    return corruption(source + ": optimizer_steps " + std::to_string(s.optimizer_steps) + " > steps_done " +
                      std::to_string(s.steps_done));
  }
  return s;
}

json Manifest::to_json() const {
  json files_j = json::array();
  for (const FileDigest& f : files) {
    json crcs = json::array();
    for (uint32_t c : f.chunk_crc32c) crcs.push_back(hex32(c));
    files_j.push_back(
        {{"name", f.name}, {"size_bytes", f.size_bytes}, {"chunk_bytes", f.chunk_bytes}, {"crc32c", crcs}});
  }
  json tensors_j = json::array();
  for (const CheckpointTensor& t : tensors)
    tensors_j.push_back({{"name", t.name}, {"dtype", "F32"}, {"shape", t.shape}});
  json state_files_j = json::array();
  for (const StateFile& f : state_files(moments, master_dtype, frozen_file_dtype())) state_files_j.push_back(f.name);
  json out = {{"format", kFormatName},
              {"format_version", format_version},
              {"step", step},
              {"moment_dtype", moment_dtype_name(moments)},
              {"master_dtype", dtype_name(master_dtype)},
              {"state_files", state_files_j},
              {"tensors", tensors_j},
              {"files", files_j}};
  if (optimizer_type) out["optimizer_type"] = to_string(*optimizer_type);
  if (!frozen.empty()) {
    json frozen_j = json::array();
    for (const CheckpointTensor& t : frozen)
      frozen_j.push_back({{"name", t.name}, {"dtype", safetensors_dtype_name(frozen_dtype)}, {"shape", t.shape}});
    out["frozen_tensors"] = frozen_j;
    out["frozen_dtype"] = dtype_name(frozen_dtype);
  }
  return out;
}

Result<Manifest> Manifest::from_json(const json& j, const std::string& source) {
  Manifest m;
  std::string format;
  ZO_RETURN_IF_ERROR(get(j, "format", &format, source));
  if (format != kFormatName) return corruption(source + ": format \"" + format + "\" is not " + kFormatName);
  ZO_RETURN_IF_ERROR(get(j, "format_version", &m.format_version, source));
  if (m.format_version != kCheckpointFormatVersion) {
    return invalid_argument(source + ": format_version " + std::to_string(m.format_version) +
                            " is not supported (this zoffload reads version " +
                            std::to_string(kCheckpointFormatVersion) + ")");
  }
  ZO_RETURN_IF_ERROR(get(j, "step", &m.step, source));
  if (j.contains("moment_dtype")) {
    std::string moments;
    ZO_RETURN_IF_ERROR(get(j, "moment_dtype", &moments, source));
    if (moments == "8bit") {
      m.moments = MomentDtype::k8bit;
    } else if (moments == "bf16") {
      m.moments = MomentDtype::kBF16;
    } else if (moments != "fp32") {
      return corruption(source + ": moment_dtype \"" + quote_excerpt(moments) +
                        "\" is none of \"fp32\", \"8bit\" and \"bf16\"");
    }
  }
  if (j.contains("master_dtype")) {
    std::string master;
    ZO_RETURN_IF_ERROR(get(j, "master_dtype", &master, source));
    if (master == "bf16") {
      m.master_dtype = DType::kBF16;
    } else if (master != "fp32") {
      return corruption(source + ": master_dtype \"" + quote_excerpt(master) + "\" is neither \"fp32\" nor \"bf16\"");
    }
  }
  if (j.contains("optimizer_type")) {
    std::string type;
    ZO_RETURN_IF_ERROR(get(j, "optimizer_type", &type, source));
    for (OptimizerType t : {OptimizerType::kAdam, OptimizerType::kAdamW, OptimizerType::kAdagrad, OptimizerType::kLion})
      if (type == to_string(t)) m.optimizer_type = t;
    if (!m.optimizer_type)
      return corruption(source + ": optimizer_type \"" + quote_excerpt(type) +
                        "\" is none of \"Adam\", \"AdamW\", \"Adagrad\" and \"Lion\"");
  }
  json files_j, tensors_j;
  ZO_RETURN_IF_ERROR(get(j, "files", &files_j, source));
  ZO_RETURN_IF_ERROR(get(j, "tensors", &tensors_j, source));
  if (!files_j.is_array() || !tensors_j.is_array()) return corruption(source + ": files and tensors must be arrays");
  for (const json& f : files_j) {
    FileDigest d;
    std::vector<std::string> crcs;
    ZO_RETURN_IF_ERROR(get(f, "name", &d.name, source + " files"));
    ZO_RETURN_IF_ERROR(get(f, "size_bytes", &d.size_bytes, source + " " + d.name));
    ZO_RETURN_IF_ERROR(get(f, "chunk_bytes", &d.chunk_bytes, source + " " + d.name));
    ZO_RETURN_IF_ERROR(get(f, "crc32c", &crcs, source + " " + d.name));
    if (d.name.empty() || d.name.find('/') != std::string::npos || d.chunk_bytes == 0 ||
        crcs.size() != (d.size_bytes + d.chunk_bytes - 1) / d.chunk_bytes) {
      return corruption(source + ": file entry \"" + d.name + "\" is malformed (name, chunk_bytes or crc32c count)");
    }
    for (const std::string& c : crcs) {
      char* end = nullptr;
      const bool hex = c.size() == 8 && std::all_of(c.begin(), c.end(), [](char x) {
                         return std::isxdigit(static_cast<unsigned char>(x)) != 0;
                       });
      const unsigned long v = hex ? std::strtoul(c.c_str(), &end, 16) : 0;
      if (!hex || *end != '\0') return corruption(source + ": " + d.name + ": bad crc32c \"" + c + "\"");
      d.chunk_crc32c.push_back(static_cast<uint32_t>(v));
    }
    // Two entries for one file would let the second's sizes and checksums go unchecked.
    if (m.find(d.name) != nullptr)
      return corruption(source + ": file entry \"" + quote_excerpt(d.name) + "\" appears twice");
    m.files.push_back(std::move(d));
  }
  auto read_tensors = [&](const json& list, std::vector<CheckpointTensor>* out) -> Status {
    for (const json& t : list) {
      CheckpointTensor ct;
      ZO_RETURN_IF_ERROR(get(t, "name", &ct.name, source + " tensors"));
      ZO_RETURN_IF_ERROR(get(t, "shape", &ct.shape, source + " " + ct.name));
      ct.n_elems = 1;
      for (int64_t d : ct.shape) {
        if (d < 1) return corruption(source + ": tensor " + ct.name + " has shape " + shape_string(ct.shape));
        if (__builtin_mul_overflow(ct.n_elems, static_cast<uint64_t>(d), &ct.n_elems) ||
            ct.n_elems > (uint64_t{1} << 50)) {
          return corruption(source + ": tensor " + ct.name + " has an impossible shape " + shape_string(ct.shape));
        }
      }
      auto same = [&](const CheckpointTensor& x) { return x.name == ct.name; };
      if (std::any_of(m.tensors.begin(), m.tensors.end(), same) || std::any_of(m.frozen.begin(), m.frozen.end(), same))
        return corruption(source + ": tensor \"" + quote_excerpt(ct.name) + "\" appears twice");
      out->push_back(std::move(ct));
    }
    return Status::ok();
  };
  ZO_RETURN_IF_ERROR(read_tensors(tensors_j, &m.tensors));
  if (j.contains("frozen_tensors")) {  // Note [Frozen sub-groups]
    json frozen_j;
    std::string dtype;
    ZO_RETURN_IF_ERROR(get(j, "frozen_tensors", &frozen_j, source));
    ZO_RETURN_IF_ERROR(get(j, "frozen_dtype", &dtype, source));
    if (!frozen_j.is_array() || frozen_j.empty())
      return corruption(source + ": frozen_tensors must be a non-empty array");
    if (dtype == "bf16") m.frozen_dtype = DType::kBF16;
    else if (dtype == "fp16") m.frozen_dtype = DType::kF16;
    else if (dtype != "fp32")
      return corruption(source + ": frozen_dtype \"" + quote_excerpt(dtype) +
                        "\" is none of \"fp32\", \"bf16\" and \"fp16\"");
    ZO_RETURN_IF_ERROR(read_tensors(frozen_j, &m.frozen));
  }
  return m;
}

const FileDigest* Manifest::find(std::string_view name) const {
  for (const FileDigest& f : files) {
    if (f.name == name) return &f;
  }
  return nullptr;
}

}  // namespace zo::engine

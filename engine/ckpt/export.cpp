// Streaming Hugging Face export (export.h; layout and guarantees in docs/export.md).
#include "engine/ckpt/export.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <utility>

#include "common/aligned_buffer.h"
#include "common/bnb4_blob.h"
#include "common/bnb4bit.h"
#include "common/bytes.h"
#include "common/half.h"
#include "common/parallel_ranges.h"
#include "engine/ckpt/state_files.h"
#include "engine/ckpt/stream_file.h"
#include "engine/model/model_config.h"
#include "engine/model/safetensors.h"
#include "engine/model/weights.h"

namespace zo::engine {

std::string shard_file_name(uint32_t shard, uint32_t n_shards) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "model-%05u-of-%05u.safetensors", shard, n_shards);
  return buf;
}

namespace {

constexpr uint32_t kWriterSlots = 4;

std::string range_text(uint64_t begin, uint64_t end) {
  return "[" + std::to_string(begin) + ", " + std::to_string(end) + ")";
}

const char* torch_dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kBF16: return "bfloat16";
    case DType::kF16: return "float16";
    case DType::kF32: return "float32";
  }
  return "?";
}

Status validate(std::span<const ParamInfo> params, const ExportOptions& o) {
  if (o.dtype != DType::kBF16 && o.dtype != DType::kF16 && o.dtype != DType::kF32)
    return invalid_argument("export: dtype " + std::to_string(static_cast<int>(o.dtype)) +
                            " is not bf16, fp16 or fp32");
  if (o.out_dir.empty()) return invalid_argument("export: no output directory given");
  if (o.shard_bytes == 0) return invalid_argument("export: the shard size must be at least 1 byte");
  ZO_RETURN_IF_ERROR(check_staging_bytes(o.staging_bytes, "export"));
  if (params.empty()) return invalid_argument("export: no tensors to export");
  std::set<std::string_view> names;
  for (const ParamInfo& p : params) {
    if (p.name.empty()) return invalid_argument("export: tensor " + std::to_string(p.id) + " has no name");
    if (!names.insert(p.name).second) return invalid_argument("export: tensor " + p.name + " is given twice");
    uint64_t n = 1;
    for (int64_t d : p.shape) {
      if (d < 1) return invalid_argument("export: tensor " + p.name + " has a dimension < 1");
      n *= static_cast<uint64_t>(d);
    }
    if (n != p.weights())
      return invalid_argument("export: tensor " + p.name + ": " + std::to_string(p.weights()) +
                              " elements do not match its shape (" + std::to_string(n) + ")");
  }
  return Status::ok();
}

// The model's config.json with torch_dtype set to the export dtype.
Result<std::string> config_with_dtype(const std::string& model_config_json, DType dtype) {
  nlohmann::json config = nlohmann::json::parse(model_config_json, nullptr, /*allow_exceptions=*/false);
  if (config.is_discarded() || !config.is_object())
    return invalid_argument("export: the model config is not a JSON object");
  config["torch_dtype"] = torch_dtype_name(dtype);
  return config.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
}

struct Shard {
  size_t first = 0;  // params [first, end)
  size_t end = 0;
  uint64_t tensor_bytes = 0;
  std::string name;
};

// Consecutive params in order; a new shard starts when the next tensor would take the current one
// past shard_bytes, so a tensor larger than shard_bytes is alone in its shard.
std::vector<Shard> plan_shards(std::span<const ParamInfo> params, DType dtype, uint64_t shard_bytes) {
  std::vector<Shard> shards;
  for (size_t i = 0; i < params.size(); ++i) {
    const uint64_t bytes = params[i].weights() * dtype_size_bytes(dtype);
    if (shards.empty() || (shards.back().end > shards.back().first && shards.back().tensor_bytes + bytes > shard_bytes))
      shards.push_back({i, i, 0, ""});
    shards.back().end = i + 1;
    shards.back().tensor_bytes += bytes;
  }
  const auto n = static_cast<uint32_t>(shards.size());
  for (uint32_t k = 0; k < n; ++k) shards[k].name = n == 1 ? kSingleShardFile : shard_file_name(k + 1, n);
  return shards;
}

// The directory of an export in progress (Note [Publishing a directory]): every file is written
// into OUT.tmp-<random>, a sibling of out_dir, which commit() fsyncs and publishes whole. Until then
// out_dir is untouched; a failed export (the destructor without commit) removes the sibling, and
// the parents of out_dir it created.
class OutputDir {
 public:
  explicit OutputDir(io::Env* env) : env_(env) {}
  ~OutputDir() {
    if (committed_ || tmp_.empty()) return;
    (void)env_->remove_all(tmp_);  // best effort: the export's error is what the caller reports
    // Unless the failure came after the rename (the parent's fsync): then out_dir is in place.
    if (created_parent_.empty()) return;
    Result<io::PathKind> out = env_->path_kind(dir_);
    if (out.is_ok() && *out == io::PathKind::kMissing) (void)env_->remove_all(created_parent_);
  }

  // out_dir must be missing or an empty directory; with `replace`, any directory (it is swapped
  // out atomically at the commit and removed).
  Status open(const std::string& dir, bool replace) {
    ZO_ASSIGN_OR_RETURN(const io::PathKind kind, env_->path_kind(dir));
    if (kind != io::PathKind::kMissing && kind != io::PathKind::kDirectory)
      return Status(StatusCode::kAlreadyExists, "export directory " + dir + " exists and is not a directory");
    if (kind == io::PathKind::kDirectory && !replace) {
      Result<std::vector<std::string>> entries = env_->list_dir(dir);
      if (!entries.is_ok()) return Status(entries.status()).with_context("export");
      if (!entries->empty())
        return Status(StatusCode::kAlreadyExists, "export directory " + dir + " is not empty (it holds " +
                                                      entries->front() + "): give a new or empty one");
    }
    const std::filesystem::path normal = std::filesystem::path(dir).lexically_normal();
    const std::filesystem::path parent = normal.parent_path().empty() ? "." : normal.parent_path();
    // The outermost missing ancestor is removed again if the export fails.
    ZO_RETURN_IF_ERROR(env_->make_dirs(parent.string(), &created_parent_)
                           .with_context("export: creating the directory " + parent.string()));
    dir_ = normal.string();
    tmp_ = dir_ + ".tmp-" + random_hex();
    return env_->make_dir(tmp_).with_context("export");
  }

  // Where file `name` is written until the commit.
  std::string path(const std::string& name) const { return tmp_ + "/" + name; }
  void add(const std::string& name) { names_.push_back(name); }
  const std::vector<std::string>& names() const { return names_; }

  // fsyncs the written directory and publishes it as out_dir.
  Status commit() {
    ZO_RETURN_IF_ERROR(env_->sync_dir(tmp_).with_context("export"));
    ZO_RETURN_IF_ERROR(publish_directory(env_, tmp_, dir_).with_context("export"));
    committed_ = true;
    if (!created_parent_.empty()) {
      // The created parents' own entries must survive a power cut too.
      const std::string above = std::filesystem::path(created_parent_).parent_path().string();
      ZO_RETURN_IF_ERROR(env_->sync_dir(above.empty() ? "." : above).with_context("export"));
    }
    return Status::ok();
  }

 private:
  static std::string random_hex() {
    std::random_device rd;
    char buf[17];
    std::snprintf(buf, sizeof buf, "%08x%08x", rd(), rd());
    return buf;
  }

  io::Env* env_;
  std::string dir_, tmp_;
  std::string created_parent_;  // the outermost parent directory this export created, if any
  std::vector<std::string> names_;
  bool committed_ = false;
};

// Note [Staging split]
// The staging buffer is the export's one large allocation. fp32 needs no conversion: the reader
// fills the writer's slots directly, so all of it goes to the writer. bf16/fp16 read fp32 into a
// read buffer and convert into the writer's slots; a chunk is bounded by the slot it is converted
// into, so the read buffer holds twice a slot's elements: slot = staging / 6 (4 slots + 2), all
// multiples of 4096. The writer writes one slot while the next is filled.
struct Staging {
  std::span<std::byte> writer;
  std::span<float> read;  // empty for fp32
};

Staging split_staging(AlignedBuffer& buffer, DType dtype) {
  const uint64_t total = buffer.size();
  if (dtype == DType::kF32) {
    return {buffer.bytes().first(total / (kDirectIoAlignment * kWriterSlots) * kDirectIoAlignment * kWriterSlots), {}};
  }
  const uint64_t slot = total / 6 / kDirectIoAlignment * kDirectIoAlignment;
  const uint64_t writer = slot * kWriterSlots;
  std::span<std::byte> rest = buffer.bytes().subspan(writer);
  return {buffer.bytes().first(writer), {reinterpret_cast<float*>(rest.data()), rest.size() / sizeof(float)}};
}

class ShardExporter {
 public:
  ShardExporter(std::span<const ParamInfo> params, const Fp32Reader& read, io::IoEngine& io, const ExportOptions& o,
                Staging staging, uint64_t total_bytes)
      : params_(params), read_(read), io_(io), o_(o), staging_(staging), total_bytes_(total_bytes) {}

  uint64_t overflowed() const { return overflowed_; }

  Status write(const Shard& shard, const std::string& path) {
    ZO_ASSIGN_OR_RETURN(std::unique_ptr<StreamWriter> writer,
                        StreamWriter::create(io_, path, staging_.writer, o_.env, kWriterSlots));
    std::vector<SafetensorsEntry> entries;
    for (size_t i = shard.first; i < shard.end; ++i) entries.push_back({params_[i].name, o_.dtype, params_[i].shape});
    const std::string header = safetensors_header(entries, {{"format", "pt"}});
    ZO_RETURN_IF_ERROR(writer->append(std::as_bytes(std::span<const char>(header))));
    for (size_t i = shard.first; i < shard.end; ++i)
      ZO_RETURN_IF_ERROR(write_tensor(*writer, static_cast<uint32_t>(i), path));
    ZO_ASSIGN_OR_RETURN(FileDigest digest, writer->finish());
    if (digest.size_bytes != header.size() + shard.tensor_bytes)
      return internal_error("export: " + path + " holds " + std::to_string(digest.size_bytes) + " bytes, expected " +
                            std::to_string(header.size() + shard.tensor_bytes));
    return Status::ok();
  }

 private:
  Status read(uint32_t param, uint64_t offset_elems, std::span<float> out, const std::string& path) {
    Status s = read_(param, offset_elems, out);
    if (!s.is_ok()) {
      s.with_context("export: reading tensor " + params_[param].name + " elements " +
                     range_text(offset_elems, offset_elems + out.size()) + " for " + path);
    }
    return s;
  }

  void advance(uint64_t bytes) {
    done_bytes_ += bytes;
    if (o_.progress) o_.progress(done_bytes_, total_bytes_);
  }

  Status write_tensor(StreamWriter& writer, uint32_t param, const std::string& path) {
    const uint64_t n = params_[param].weights();
    uint64_t off = 0;
    if (o_.dtype == DType::kF32) {
      while (off < n) {
        ZO_ASSIGN_OR_RETURN(std::span<std::byte> span, writer.next_span((n - off) * sizeof(float)));
        uint64_t k = std::min<uint64_t>(span.size() / sizeof(float), n - off);
        if (k == 0 || reinterpret_cast<uintptr_t>(span.data()) % alignof(float) != 0) {
          // A span that cannot hold an aligned float (never with a 4096-aligned data section):
          // go through a few elements on the stack.
          float tmp[16];
          k = std::min<uint64_t>(16, n - off);
          ZO_RETURN_IF_ERROR(read(param, off, {tmp, k}, path));
          ZO_RETURN_IF_ERROR(writer.append(std::as_bytes(std::span<const float>(tmp, k))));
        } else {
          ZO_RETURN_IF_ERROR(read(param, off, {reinterpret_cast<float*>(span.data()), k}, path));
          ZO_RETURN_IF_ERROR(writer.commit(k * sizeof(float)));
        }
        off += k;
        advance(k * sizeof(float));
      }
      return Status::ok();
    }
    while (off < n) {
      const uint64_t k = std::min<uint64_t>(staging_.read.size(), n - off);
      std::span<const float> src = staging_.read.first(k);
      ZO_RETURN_IF_ERROR(read(param, off, staging_.read.first(k), path));
      uint64_t i = 0;
      while (i < k) {
        ZO_ASSIGN_OR_RETURN(std::span<std::byte> span, writer.next_span((k - i) * sizeof(uint16_t)));
        uint64_t m = std::min<uint64_t>(span.size() / sizeof(uint16_t), k - i);
        if (m == 0 || reinterpret_cast<uintptr_t>(span.data()) % alignof(uint16_t) != 0) {
          const uint16_t h = convert(src[i]);
          ZO_RETURN_IF_ERROR(writer.append(std::as_bytes(std::span<const uint16_t>(&h, 1))));
          m = 1;
        } else {
          convert(src.subspan(i, m), reinterpret_cast<uint16_t*>(span.data()));
          ZO_RETURN_IF_ERROR(writer.commit(m * sizeof(uint16_t)));
        }
        i += m;
      }
      off += k;
      advance(k * sizeof(uint16_t));
    }
    return Status::ok();
  }

  uint16_t convert(float f) {
    if (o_.dtype == DType::kBF16) return float_to_bf16(f);
    const uint16_t h = float_to_f16(f);
    if ((h & 0x7FFFu) == 0x7C00u && std::isfinite(f)) ++overflowed_;
    return h;
  }

  void convert(std::span<const float> src, uint16_t* dst) {
    if (o_.dtype == DType::kBF16) {
      for (size_t j = 0; j < src.size(); ++j) dst[j] = float_to_bf16(src[j]);
      return;
    }
    uint64_t overflowed = 0;
    for (size_t j = 0; j < src.size(); ++j) {
      const uint16_t h = float_to_f16(src[j]);
      dst[j] = h;
      overflowed += (h & 0x7FFFu) == 0x7C00u && std::isfinite(src[j]);
    }
    overflowed_ += overflowed;
  }

  std::span<const ParamInfo> params_;
  const Fp32Reader& read_;
  io::IoEngine& io_;
  const ExportOptions& o_;
  Staging staging_;
  uint64_t total_bytes_ = 0;
  uint64_t done_bytes_ = 0;
  uint64_t overflowed_ = 0;
};

// The files of an export: a Hugging Face model directory's, or PEFT's adapter directory's (one
// weights file, never sharded, and a config written as given).
struct ExportFiles {
  const char* single_file = kSingleShardFile;
  bool sharded = true;
  const char* config_file = kModelConfigFile;
  bool config_dtype = true;  // the config's torch_dtype set to the export dtype
};

// export_hf_model with a check that runs after every file is written and before any is renamed
// (export_checkpoint verifies the last checksum chunk there).
Result<ExportResult> export_files(std::span<const ParamInfo> params, const std::string& config_json,
                                  const Fp32Reader& read, io::IoEngine& io, const ExportOptions& options,
                                  const std::function<Status()>& before_commit, const ExportFiles& files) {
  ZO_RETURN_IF_ERROR(validate(params, options));
  std::string config_text = config_json;
  if (files.config_dtype) {
    ZO_ASSIGN_OR_RETURN(config_text, config_with_dtype(config_json, options.dtype));
  }
  std::vector<Shard> shards =
      plan_shards(params, options.dtype, files.sharded ? options.shard_bytes : std::numeric_limits<uint64_t>::max());
  if (shards.size() == 1) shards[0].name = files.single_file;
  // Side files are read before anything is written: a missing one fails the export at once.
  io::Env* env = options.env;
  std::vector<std::pair<std::string, std::string>> sides;  // name, content
  for (const std::string& path : options.side_files) {
    const std::string name = std::filesystem::path(path).filename().string();
    const bool weights = name.ends_with(".safetensors") || name == kShardIndexFile;
    if (name.empty() || name == kModelConfigFile || name == files.config_file || weights)
      return invalid_argument("export: side file " + path + " would replace a file the export writes");
    for (const auto& [other, text] : sides)
      if (other == name) return invalid_argument("export: two side files are named " + name);
    ZO_ASSIGN_OR_RETURN(std::string text, env->read_file(path, "side file", kMaxSmallFileBytes));
    sides.emplace_back(name, std::move(text));
  }
  uint64_t total_bytes = 0;
  for (const Shard& s : shards) total_bytes += s.tensor_bytes;

  ZO_ASSIGN_OR_RETURN(AlignedBuffer staging, AlignedBuffer::allocate(options.staging_bytes));
  OutputDir out(env);
  // A small file (config.json, the index, a side file): whole, fdatasynced, nothing left on failure.
  auto write_small_file = [env](const std::string& path, const std::string& text) {
    return env->write_file(path, text).with_context("export");
  };
  ZO_RETURN_IF_ERROR(out.open(options.out_dir, options.replace));

  ShardExporter exporter(params, read, io, options, split_staging(staging, options.dtype), total_bytes);
  for (const Shard& shard : shards) {
    out.add(shard.name);
    ZO_RETURN_IF_ERROR(exporter.write(shard, out.path(shard.name)));
  }
  if (shards.size() > 1) {
    nlohmann::json index;
    index["metadata"]["total_size"] = total_bytes;
    nlohmann::json& weight_map = index["weight_map"];
    weight_map = nlohmann::json::object();
    for (const Shard& shard : shards)
      for (size_t i = shard.first; i < shard.end; ++i) weight_map[params[i].name] = shard.name;
    out.add(kShardIndexFile);
    ZO_RETURN_IF_ERROR(write_small_file(out.path(kShardIndexFile),
                                        index.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) + "\n"));
  }
  for (const auto& [name, text] : sides) {
    out.add(name);
    ZO_RETURN_IF_ERROR(write_small_file(out.path(name), text));
  }
  out.add(files.config_file);
  ZO_RETURN_IF_ERROR(write_small_file(out.path(files.config_file), config_text));
  if (before_commit) ZO_RETURN_IF_ERROR(before_commit());
  ZO_RETURN_IF_ERROR(out.commit());

  ExportResult result;
  result.out_dir = options.out_dir;
  result.files = out.names();
  result.tensors = params.size();
  result.tensor_bytes = total_bytes;
  result.overflowed = exporter.overflowed();
  return result;
}

// Note [Exporting LoRA adapters]
// A model with LoRA adapters (Note [LoRA adapters]) is exported as PEFT's adapter directory, or
// merged. The adapter directory is what PeftModel.from_pretrained loads over the base:
// adapter_config.json and adapter_model.safetensors holding the adapters alone, each named
// "base_model.model." + its name, the way PEFT's save_pretrained names them. The merged model is a
// full Hugging Face directory of the base's params, each adapted weight W [out, in] written as
// W + s · B·A in fp32 (PEFT's merge: the delta B @ A times s, added to W), computed as W streams:
// the first read of an adapted weight reads its A [r, in] and B [out, r] whole (a projection's
// adapters, a few MiB), then each chunk's rows get Σ_k B[o, k] · A[k, :]. The reads keep each
// source's order: the base weights in order, and the adapters in order after them (the
// checkpoint's master.safetensors holds the adapters, frozen.safetensors the base).
Result<ExportResult> export_lora(std::span<const ParamInfo> params, const std::string& model_config_json,
                                 const Fp32Reader& read, io::IoEngine& io, const ExportOptions& options,
                                 const std::function<Status()>& before_commit) {
  const LoraExport lora = *options.lora;
  ExportOptions o = options;
  o.lora.reset();
  std::vector<ParamInfo> out;
  std::vector<uint32_t> source;  // of each param of `out`, its index in `params`
  auto add = [&](uint32_t i, std::string name) {
    ParamInfo info = params[i];
    info.id = static_cast<uint32_t>(out.size());
    info.name = std::move(name);
    out.push_back(std::move(info));
    source.push_back(i);
  };
  if (!lora.merged) {
    for (uint32_t i = 0; i < params.size(); ++i)
      if (is_lora_param(params[i].name)) add(i, kPeftPrefix + params[i].name);
    if (out.empty()) return invalid_argument("export: the model has no LoRA adapters to write");
    const Fp32Reader from_source = [&](uint32_t p, uint64_t off, std::span<float> dst) {
      return read(source[p], off, dst);
    };
    return export_files(
        out, lora.adapter_config_json, from_source, io, o, before_commit,
        ExportFiles{
            .single_file = kPeftWeightsFile, .sharded = false, .config_file = kPeftConfigFile, .config_dtype = false});
  }
  std::map<std::string, uint32_t> by_name;
  for (uint32_t i = 0; i < params.size(); ++i) by_name[params[i].name] = i;
  struct Adapted {
    uint32_t a = 0, b = 0;  // indices in `params`
  };
  std::vector<std::optional<Adapted>> adapted;
  for (uint32_t i = 0; i < params.size(); ++i) {
    const ParamInfo& w = params[i];
    if (is_lora_param(w.name)) continue;
    add(i, w.name);
    adapted.emplace_back();
    if (!w.name.ends_with(".weight")) continue;
    const std::string module = w.name.substr(0, w.name.size() - std::string_view(".weight").size());
    const auto a = by_name.find(module + ".lora_A.weight"), b = by_name.find(module + ".lora_B.weight");
    if (a == by_name.end() || b == by_name.end()) continue;
    const ParamInfo &pa = params[a->second], &pb = params[b->second];
    if (w.shape.size() != 2 || pa.shape.size() != 2 || pb.shape.size() != 2 || pa.shape[1] != w.shape[1] ||
        pb.shape[0] != w.shape[0] || pb.shape[1] != pa.shape[0])
      return invalid_argument("export: the adapters of " + w.name + " do not fit its shape");
    adapted.back() = Adapted{a->second, b->second};
  }
  constexpr uint64_t kReadElems = uint64_t{1} << 20;
  uint32_t cached = std::numeric_limits<uint32_t>::max();
  std::vector<float> A, B;
  auto read_whole = [&](uint32_t p, std::vector<float>& dst) -> Status {
    dst.resize(params[p].weights());
    for (uint64_t off = 0; off < dst.size(); off += kReadElems) {
      const std::span<float> part(dst.data() + off, std::min<uint64_t>(kReadElems, dst.size() - off));
      ZO_RETURN_IF_ERROR(read(p, off, part).with_context("export: reading " + params[p].name + " to merge it"));
    }
    return Status::ok();
  };
  const auto scaling = static_cast<float>(lora.scaling);
  const Fp32Reader merged = [&](uint32_t p, uint64_t off, std::span<float> dst) -> Status {
    ZO_RETURN_IF_ERROR(read(source[p], off, dst));
    if (!adapted[p]) return Status::ok();
    if (cached != p) {
      ZO_RETURN_IF_ERROR(read_whole(adapted[p]->a, A));
      ZO_RETURN_IF_ERROR(read_whole(adapted[p]->b, B));
      cached = p;
    }
    const auto r = static_cast<uint64_t>(params[adapted[p]->a].shape[0]);
    const auto in = static_cast<uint64_t>(params[adapted[p]->a].shape[1]);
    merge_lora(A, B, r, in, scaling, off, dst);
    return Status::ok();
  };
  return export_files(out, model_config_json, merged, io, o, before_commit, ExportFiles{});
}

Result<ExportResult> export_impl(std::span<const ParamInfo> params, const std::string& model_config_json,
                                 const Fp32Reader& read, io::IoEngine& io, const ExportOptions& options,
                                 const std::function<Status()>& before_commit) {
  ZO_RETURN_IF_ERROR(io::require_env(options.env, "ExportOptions::env"));
  if (options.lora) return export_lora(params, model_config_json, read, io, options, before_commit);
  return export_files(params, model_config_json, read, io, options, before_commit, ExportFiles{});
}

// master.safetensors read front to back through the Env, every byte (header and data) fed through
// the manifest's checksums. The export asks for the tensors in file order, so each read continues where
// the last one ended (the bytes before the first tensor are read and checked on the way).
class MasterReader {
 public:
  // The masters are fp32, or bf16 (zoffload.master_dtype), widened exactly as they are read; the
  // frozen params' compute copies (kFrozenFile) fp32, bf16 or fp16.
  MasterReader(std::string path, const FileDigest& digest, DType dtype)
      : path_(std::move(path)), verifier_(digest, path_), dtype_(dtype) {}
  MasterReader(const MasterReader&) = delete;
  MasterReader& operator=(const MasterReader&) = delete;

  Status open(io::Env* env, std::vector<uint64_t> data_offsets, uint64_t file_size_bytes) {
    ZO_ASSIGN_OR_RETURN(file_, env->open_read(path_, "checkpoint file"));
    file_->will_read_sequentially();
    data_offsets_ = std::move(data_offsets);
    file_size_bytes_ = file_size_bytes;
    return Status::ok();
  }

  Status read(uint32_t tensor, uint64_t offset_elems, std::span<float> out) {
    used_ = true;
    const uint64_t elem = dtype_size_bytes(dtype_);
    const uint64_t pos = data_offsets_[tensor] + offset_elems * elem;
    if (pos < verifier_.position())
      return internal_error("export: " + path_ + " read out of order at offset " + std::to_string(pos) + " (at " +
                            std::to_string(verifier_.position()) + ")");
    ZO_RETURN_IF_ERROR(skip_to(pos));
    if (dtype_ == DType::kF32) return read_checked(std::as_writable_bytes(out));
    // bf16: read into the back half of `out`, then widen from the front, so no element is
    // overwritten before it is read.
    auto bytes = std::as_writable_bytes(out);
    const auto half = bytes.subspan(bytes.size() / 2);
    ZO_RETURN_IF_ERROR(read_checked(half));
    for (size_t i = 0; i < out.size(); ++i) {
      uint16_t h;
      std::memcpy(&h, half.data() + 2 * i, 2);
      out[i] = dtype_ == DType::kBF16 ? bf16_to_float(h) : f16_to_float(h);
    }
    return Status::ok();
  }

  // A packed weight's blob (Note [The packed 4-bit base]), whole, as it is stored.
  Status read_bytes(uint32_t tensor, std::span<std::byte> out) {
    used_ = true;
    const uint64_t pos = data_offsets_[tensor];
    if (pos < verifier_.position())
      return internal_error("export: " + path_ + " read out of order at offset " + std::to_string(pos) + " (at " +
                            std::to_string(verifier_.position()) + ")");
    ZO_RETURN_IF_ERROR(skip_to(pos));
    return read_checked(out);
  }

  // Reads and checks what follows the last tensor, then the file's size and last chunk; nothing
  // for a file the export did not read (a LoRA adapter export's frozen.safetensors).
  Status finish() {
    if (!used_) return Status::ok();
    ZO_RETURN_IF_ERROR(skip_to(file_size_bytes_));
    return verifier_.finish();
  }

 private:
  Status read_checked(std::span<std::byte> out) {
    const uint64_t pos = verifier_.position();
    ZO_RETURN_IF_ERROR(file_->read_exact(pos, out).with_context("export"));
    ZO_RETURN_IF_ERROR(verifier_.update(out));
    // Read once: drop it from the page cache so the export does not push the machine's working set out.
    const uint64_t end = pos + out.size();
    if (end - dropped_ >= kDropBytes) {
      file_->drop_cached(dropped_, end - dropped_);
      dropped_ = end;
    }
    return Status::ok();
  }

  Status skip_to(uint64_t pos) {
    while (verifier_.position() < pos) {
      if (gap_.empty()) gap_.resize(kGapBytes);
      const uint64_t n = std::min<uint64_t>(gap_.size(), pos - verifier_.position());
      ZO_RETURN_IF_ERROR(read_checked(std::span<std::byte>(gap_).first(n)));
    }
    return Status::ok();
  }

  static constexpr uint64_t kGapBytes = uint64_t{256} << 10;
  static constexpr uint64_t kDropBytes = uint64_t{64} << 20;
  std::string path_;
  ChunkVerifier verifier_;
  DType dtype_;
  std::unique_ptr<io::ReadFile> file_;
  std::vector<uint64_t> data_offsets_;
  uint64_t file_size_bytes_ = 0;
  uint64_t dropped_ = 0;
  bool used_ = false;
  std::vector<std::byte> gap_;
};

}  // namespace

// Compiled twice on x86-64 with GCC, for AVX2 and for the baseline ISA, and picked at load by the
// CPU (function multiversioning): the same operations either way (no FMA: a multiply then an add),
// so the bits do not depend on the machine.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define ZO_MERGE_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define ZO_MERGE_CLONES
#endif
ZO_MERGE_CLONES void merge_lora_chunk(std::span<const float> A, std::span<const float> B, uint64_t r, uint64_t in,
                                      float scaling, uint64_t first, std::span<float> dst) {
  // Eight columns at a time, their sums in registers (a local array of 8, which the compiler keeps
  // in one or two vector registers) while k runs: each column's sum is still over k in order, then
  // times s, so the bits do not depend on the blocking. A's r rows of the block stay in cache.
  constexpr uint64_t kLanes = 8;
  for (uint64_t e = first, end = first + dst.size(); e < end;) {
    const uint64_t o_row = e / in, c0 = e % in, c1 = std::min<uint64_t>(in, c0 + (end - e));
    float* d = dst.data() + (e - first) - c0;  // d[c] is column c of this row
    const float* b = B.data() + o_row * r;
    uint64_t c = c0;
    for (; c + kLanes <= c1; c += kLanes) {
      float acc[kLanes] = {};
      for (uint64_t k = 0; k < r; ++k) {
        const float bk = b[k];
        const float* ak = A.data() + k * in + c;
        for (uint64_t l = 0; l < kLanes; ++l) acc[l] += bk * ak[l];
      }
      for (uint64_t l = 0; l < kLanes; ++l) d[c + l] += acc[l] * scaling;
    }
    for (; c < c1; ++c) {
      float acc = 0.0f;
      for (uint64_t k = 0; k < r; ++k) acc += b[k] * A[k * in + c];
      d[c] += acc * scaling;
    }
    e += c1 - c0;
  }
}

void merge_lora(std::span<const float> A, std::span<const float> B, uint64_t r, uint64_t in, float scaling,
                uint64_t first, std::span<float> dst) {
  parallel_ranges(dst.size(), 1, [&](uint64_t begin, uint64_t end) {
    merge_lora_chunk(A, B, r, in, scaling, first + begin, dst.subspan(begin, end - begin));
  });
}

Result<ExportResult> export_hf_model(std::span<const ParamInfo> params, const std::string& model_config_json,
                                     const Fp32Reader& read, io::IoEngine& io, const ExportOptions& options) {
  return export_impl(params, model_config_json, read, io, options, {});
}

Result<ExportResult> export_checkpoint(const CheckpointInfo& ckpt, io::IoEngine& io, const ExportOptions& options) {
  ZO_RETURN_IF_ERROR(io::require_env(options.env, "ExportOptions::env"));
  io::Env* env = options.env;
  std::vector<ParamInfo> params;
  // The masters of the trainable params, then the frozen params' compute copies (Note [Frozen
  // sub-groups]), each file read front to back; a reader per file.
  std::vector<std::unique_ptr<MasterReader>> readers;
  std::vector<uint32_t> first_param;  // of each reader
  auto add_file = [&](const char* name, const std::vector<CheckpointTensor>& expected, DType want) -> Status {
    const std::string path = ckpt.path + "/" + name;
    const FileDigest* digest = ckpt.manifest.find(name);
    if (digest == nullptr) return corruption("export: " + ckpt.path + "/" + kManifestFile + " does not list " + name);
    ZO_ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsFile> file, SafetensorsFile::open(path, env));
    const std::vector<SafetensorsTensor>& tensors = file->tensors();
    if (tensors.size() != expected.size())
      return corruption("export: " + path + " holds " + std::to_string(tensors.size()) +
                        " tensors, the manifest lists " + std::to_string(expected.size()));
    first_param.push_back(static_cast<uint32_t>(params.size()));
    std::vector<uint64_t> data_offsets(tensors.size());
    for (size_t i = 0; i < tensors.size(); ++i) {
      const SafetensorsTensor& t = tensors[i];
      if (t.bytes() || t.name != expected[i].name || t.shape != expected[i].shape || t.dtype != want)
        return corruption("export: " + path + ": tensor " + std::to_string(i) + " is " + t.name + " (" +
                          std::string(t.type_text()) + "), the manifest says " + expected[i].name + " (" +
                          std::string(dtype_name(want)) + ")");
      ParamInfo info;
      info.id = static_cast<uint32_t>(params.size());
      info.name = t.name;
      info.shape = t.shape;
      info.n_elems = t.n_elems;
      if (t.name.ends_with(kPackedTensorSuffix)) {
        // Note [The packed 4-bit base]: exported as the weights the run computed with.
        uint8_t head[bnb4::kBlobHeaderBytes];
        bnb4::BlobHeader h;
        const uint64_t size = t.n_elems * dtype_size_bytes(want);
        if (size < bnb4::kBlobHeaderBytes || !file->read_raw(t, 0, head).is_ok() || !bnb4::read_blob_header(head, &h) ||
            !h.sane() || h.bytes() != size)
          return corruption("export: " + path + ": " + t.name + " is not a packed weight's blob");
        info.name = t.name.substr(0, t.name.size() - kPackedTensorSuffix.size());
        info.shape = {static_cast<int64_t>(h.rows), static_cast<int64_t>(h.cols)};
        info.weight_elems = h.n();
        info.packed = true;
      }
      params.push_back(std::move(info));
      data_offsets[i] = t.data_offset_bytes;
    }
    const uint64_t file_size = file->file_size_bytes();
    file.reset();
    readers.push_back(std::make_unique<MasterReader>(path, *digest, want));
    return readers.back()->open(env, std::move(data_offsets), file_size);
  };
  ZO_RETURN_IF_ERROR(add_file(kMasterFile, ckpt.manifest.tensors, ckpt.manifest.master_dtype));
  if (!ckpt.manifest.frozen.empty())
    ZO_RETURN_IF_ERROR(add_file(kFrozenFile, ckpt.manifest.frozen, ckpt.manifest.frozen_dtype));
  // A packed weight is read whole when its first chunk is asked for, and dequantized from there.
  uint32_t blob_param = UINT32_MAX;
  std::vector<std::byte> blob;
  return export_impl(
      params, ckpt.model_config_json,
      [&](uint32_t p, uint64_t off, std::span<float> out) -> Status {
        const size_t r = first_param.size() > 1 && p >= first_param[1] ? 1 : 0;
        if (!params[p].packed) return readers[r]->read(p - first_param[r], off, out);
        if (blob_param != p) {
          blob.assign(params[p].n_elems * dtype_size_bytes(ckpt.manifest.frozen_dtype), std::byte{0});
          ZO_RETURN_IF_ERROR(readers[r]->read_bytes(p - first_param[r], blob));
          blob_param = p;
        }
        if (!bnb4::dequantize_whole_blob(reinterpret_cast<const uint8_t*>(blob.data()), blob.size(), off, out.size(),
                                         ckpt.manifest.frozen_dtype, out.data()))
          return corruption("export: " + params[p].name + ": its packed blob reads back damaged");
        return Status::ok();
      },
      io, options,
      [&]() -> Status {
        for (auto& r : readers) ZO_RETURN_IF_ERROR(r->finish());
        return Status::ok();
      });
}

Result<ExportResult> export_store(StateStore& store, const std::string& model_config_json, io::IoEngine& io,
                                  const ExportOptions& options) {
  if (!store.torn_reason().empty())
    return failed_precondition("export: the master weights are inconsistent after a failed step (" +
                               store.torn_reason() + "); export from a checkpoint instead");
  // Note [Exporting partitioned states]: a data-parallel rank holds the masters of its partition
  // only, but the compute copies of every param, and a compute copy is its master rounded to the
  // compute dtype with the same round-to-nearest-even the export uses: exporting in the compute
  // dtype from them writes the same bytes, with no rank sending its masters.
  const MemoryPlan& plan = store.plan();
  if (plan.partitioned()) {
    if (options.dtype != plan.placement.compute_dtype)
      return failed_precondition(
          "export: this data-parallel rank holds the fp32 masters of its own partition only; "
          "it can export in the compute dtype (" +
          std::string(dtype_name(plan.placement.compute_dtype)) +
          "), or export another dtype from a checkpoint with `zoffload export --dtype`");
    const Fp32Reader read = [&store](uint32_t p, uint64_t off, std::span<float> out) {
      return store.read_param_compute(p, off, out);
    };
    return export_impl(store.registry().params(), model_config_json, read, io, options, {});
  }
  // A frozen param has no master (Note [Frozen sub-groups]): it is exported as the run held it, its
  // compute copy, which no step changed.
  const Fp32Reader read = [&store](uint32_t p, uint64_t off, std::span<float> out) {
    return store.read_param_value(p, off, out);
  };
  return export_impl(store.registry().params(), model_config_json, read, io, options, {});
}

std::vector<std::string> model_side_files(const std::string& model_dir, io::Env* env) {
  static constexpr const char* kNames[] = {"tokenizer.json",
                                           "tokenizer_config.json",
                                           "special_tokens_map.json",
                                           "tokenizer.model",
                                           "added_tokens.json",
                                           "vocab.json",
                                           "merges.txt",
                                           "chat_template.jinja",
                                           "chat_template.json",
                                           "generation_config.json"};
  auto kind = [env](const std::string& path) {
    Result<io::PathKind> k = env->path_kind(path);
    return k.is_ok() ? *k : io::PathKind::kMissing;
  };
  std::vector<std::string> found;
  if (model_dir.empty() || kind(model_dir) != io::PathKind::kDirectory) return found;
  for (const char* name : kNames) {
    const std::string path = model_dir + "/" + name;
    if (kind(path) == io::PathKind::kFile) found.push_back(path);
  }
  return found;
}

}  // namespace zo::engine

#include "engine/model/safetensors.h"

#include <algorithm>
#include <bit>

#include <nlohmann/json.hpp>

#include "common/bytes.h"
#include "common/check.h"
#include "common/half.h"

namespace zo::engine {
namespace {

using nlohmann::json;

constexpr uint64_t kMaxHeaderBytes = 100ull << 20;
// Bounce buffer for 16-bit tensors: bounded, independent of the caller's chunk size.
constexpr uint64_t kBounceElems = 1u << 16;

// Reads exactly out.size() bytes at `offset`; `what` says which part of the file, in errors (end of
// file before the end is kCorruption: the file is shorter than its header says).
Status read_exact(io::ReadFile& file, uint64_t offset, std::span<uint8_t> out, const std::string& what) {
  Status s = file.read_exact(offset, std::as_writable_bytes(out));
  if (!s.is_ok()) return Status(s.code(), what + ": " + s.message(), s.sys_errno());
  return s;
}

bool parse_dtype_name(const std::string& name, DType* out) {
  if (name == "F32") *out = DType::kF32;
  else if (name == "BF16") *out = DType::kBF16;
  else if (name == "F16") *out = DType::kF16;
  else return false;
  return true;
}

bool as_u64(const json& v, uint64_t* out) {
  if (!v.is_number_integer()) return false;
  if (!v.is_number_unsigned() && v.get<int64_t>() < 0) return false;
  *out = v.get<uint64_t>();
  return true;
}

}  // namespace

SafetensorsFile::~SafetensorsFile() = default;

Result<std::unique_ptr<SafetensorsFile>> SafetensorsFile::open(const std::string& path, io::Env* env) {
  std::unique_ptr<SafetensorsFile> f(new SafetensorsFile());
  f->path_ = path;
  ZO_ASSIGN_OR_RETURN(f->file_, env->open_read(path, "safetensors file"));
  f->file_size_bytes_ = f->file_->size_bytes();
  const uint64_t file_size = f->file_size_bytes_;

  if (file_size < 8)
    return corruption(path + ": not a safetensors file: " + std::to_string(file_size) +
                      " bytes, shorter than the 8-byte header length");
  uint8_t len_bytes[8];
  ZO_RETURN_IF_ERROR(read_exact(*f->file_, 0, len_bytes, path + " header length"));
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | len_bytes[i];
  if (header_len > kMaxHeaderBytes)
    return corruption(path + ": header length " + std::to_string(header_len) +
                      " bytes exceeds the 100 MB limit (not a safetensors file?)");
  if (header_len > file_size - 8)
    return corruption(path + ": header length " + std::to_string(header_len) + " bytes runs beyond the file (" +
                      std::to_string(file_size) + " bytes; truncated?)");
  std::string header(header_len, '\0');
  ZO_RETURN_IF_ERROR(
      read_exact(*f->file_, 8, {reinterpret_cast<uint8_t*>(header.data()), header.size()}, path + " header"));
  const json doc = json::parse(header, nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded()) return corruption(path + ": header is not valid JSON");
  if (!doc.is_object()) return corruption(path + ": header is not a JSON object");

  const uint64_t data_start = 8 + header_len;
  const uint64_t data_size = file_size - data_start;
  for (const auto& [name, entry] : doc.items()) {
    if (name == "__metadata__") {
      if (!entry.is_object()) return corruption(path + ": __metadata__ is not an object");
      for (const auto& [k, v] : entry.items()) {
        if (!v.is_string()) return corruption(path + ": __metadata__." + k + " is not a string");
        f->metadata_[k] = v.get<std::string>();
      }
      continue;
    }
    const std::string where = path + ": tensor \"" + name + "\"";
    if (!entry.is_object()) return corruption(where + " is not an object");
    auto dt = entry.find("dtype");
    auto sh = entry.find("shape");
    auto off = entry.find("data_offsets");
    if (dt == entry.end() || !dt->is_string()) return corruption(where + ": missing or non-string \"dtype\"");
    if (sh == entry.end() || !sh->is_array()) return corruption(where + ": missing or non-array \"shape\"");
    if (off == entry.end() || !off->is_array() || off->size() != 2)
      return corruption(where + ": \"data_offsets\" is not a [begin, end] pair");
    SafetensorsTensor t;
    t.name = name;
    const std::string dtype_text = dt->get<std::string>();
    t.u8 = dtype_text == "U8";
    t.i8 = dtype_text == "I8";
    if (!t.bytes() && !parse_dtype_name(dtype_text, &t.dtype))
      return unavailable(where + " has dtype " + dtype_text +
                         ", which is not supported (supported: F32, BF16, F16, U8, I8)");
    t.n_elems = 1;
    for (const json& d : *sh) {
      uint64_t dim = 0;
      if (!as_u64(d, &dim)) return corruption(where + ": shape has a non-integer or negative dimension");
      if (dim > (uint64_t{1} << 62) || __builtin_mul_overflow(t.n_elems, dim, &t.n_elems))
        return corruption(where + ": shape overflows");
      t.shape.push_back(static_cast<int64_t>(dim));
    }
    uint64_t begin = 0, end = 0;
    if (!as_u64((*off)[0], &begin) || !as_u64((*off)[1], &end))
      return corruption(where + ": data_offsets are not non-negative integers");
    if (end < begin)
      return corruption(where + ": data_offsets out of order [" + std::to_string(begin) + ", " + std::to_string(end) +
                        "]");
    if (end > data_size)
      return corruption(where + ": data_offsets [" + std::to_string(begin) + ", " + std::to_string(end) +
                        "] outside the data section of " + std::to_string(data_size) + " bytes (truncated file?)");
    t.size_bytes = end - begin;
    uint64_t expected = 0;
    const uint64_t elem_bytes = t.bytes() ? 1 : dtype_size_bytes(t.dtype);
    if (__builtin_mul_overflow(t.n_elems, elem_bytes, &expected) || expected != t.size_bytes)
      return corruption(where + ": " + std::to_string(t.size_bytes) + " bytes in data_offsets, but shape × " +
                        dtype_text + " needs " + std::to_string(t.n_elems * elem_bytes));
    t.data_offset_bytes = data_start + begin;
    f->tensors_.push_back(std::move(t));
  }

  std::sort(f->tensors_.begin(), f->tensors_.end(), [](const SafetensorsTensor& a, const SafetensorsTensor& b) {
    return a.data_offset_bytes != b.data_offset_bytes ? a.data_offset_bytes < b.data_offset_bytes
                                                      : a.size_bytes < b.size_bytes;
  });
  // The tensors must cover the data section exactly, in offset order, as the reference library
  // requires: a gap or trailing bytes mean the offsets do not describe this file (a header length
  // one byte short shifts every weight by a byte and still parses).
  uint64_t covered = data_start;
  for (size_t i = 0; i < f->tensors_.size(); ++i) {
    const SafetensorsTensor& t = f->tensors_[i];
    if (t.data_offset_bytes < covered)
      return corruption(path + ": tensors \"" + f->tensors_[i - 1].name + "\" and \"" + t.name +
                        "\" overlap in the data section");
    if (t.data_offset_bytes > covered)
      return corruption(path + ": " + std::to_string(t.data_offset_bytes - covered) + " bytes before tensor \"" +
                        t.name + "\" (data offset " + std::to_string(covered - data_start) +
                        ") belong to no tensor: the header's offsets do not describe this file");
    covered = t.data_offset_bytes + t.size_bytes;
  }
  if (covered != file_size)
    return corruption(path + ": the last " + std::to_string(file_size - covered) +
                      " bytes of the file belong to no tensor (" + std::to_string(data_size) + " data bytes, " +
                      std::to_string(covered - data_start) +
                      " described): the header's offsets do not describe this file");
  for (size_t i = 0; i < f->tensors_.size(); ++i) f->by_name_.emplace(f->tensors_[i].name, i);
  return f;
}

const SafetensorsTensor* SafetensorsFile::find(std::string_view name) const {
  auto it = by_name_.find(std::string(name));
  return it == by_name_.end() ? nullptr : &tensors_[it->second];
}

Status SafetensorsFile::read_raw(const SafetensorsTensor& tensor, uint64_t offset_bytes, std::span<uint8_t> out) const {
  if (offset_bytes > tensor.size_bytes || out.size() > tensor.size_bytes - offset_bytes)
    return invalid_argument(path_ + ": read of bytes [" + std::to_string(offset_bytes) + ", " +
                            std::to_string(offset_bytes + out.size()) + ") beyond tensor \"" + tensor.name + "\" of " +
                            std::to_string(tensor.size_bytes) + " bytes");
  return read_exact(
      *file_, tensor.data_offset_bytes + offset_bytes, out,
      path_ + " tensor \"" + tensor.name + "\" (byte " + std::to_string(offset_bytes) + " of the tensor)");
}

Status SafetensorsFile::read_f32(const SafetensorsTensor& tensor, uint64_t offset_elems, std::span<float> out) const {
  if (tensor.bytes())
    return invalid_argument(path_ + ": tensor \"" + tensor.name + "\" is " + (tensor.i8 ? "I8" : "U8") +
                            " (bitsandbytes' codes or statistics), not a floating-point tensor");
  if (offset_elems > tensor.n_elems || out.size() > tensor.n_elems - offset_elems)
    return invalid_argument(path_ + ": read of elements [" + std::to_string(offset_elems) + ", " +
                            std::to_string(offset_elems + out.size()) + ") beyond tensor \"" + tensor.name + "\" of " +
                            std::to_string(tensor.n_elems) + " elements");
  static_assert(std::endian::native == std::endian::little, "safetensors data is little-endian");
  if (tensor.dtype == DType::kF32)
    return read_raw(tensor, offset_elems * 4, {reinterpret_cast<uint8_t*>(out.data()), out.size() * 4});
  std::vector<uint16_t> bounce(std::min<uint64_t>(out.size(), kBounceElems));
  for (uint64_t done = 0; done < out.size();) {
    const uint64_t n = std::min<uint64_t>(bounce.size(), out.size() - done);
    ZO_RETURN_IF_ERROR(read_raw(tensor, (offset_elems + done) * 2, {reinterpret_cast<uint8_t*>(bounce.data()), n * 2}));
    if (tensor.dtype == DType::kBF16)
      for (uint64_t i = 0; i < n; ++i) out[done + i] = bf16_to_float(bounce[i]);
    else
      for (uint64_t i = 0; i < n; ++i) out[done + i] = f16_to_float(bounce[i]);
    done += n;
  }
  return Status::ok();
}

Result<std::unique_ptr<HfWeights>> HfWeights::open(const std::string& model_dir, io::Env* env) {
  std::unique_ptr<HfWeights> w(new HfWeights());
  w->model_dir_ = model_dir;
  const std::string single = model_dir + "/model.safetensors";
  const std::string index_path = model_dir + "/model.safetensors.index.json";

  ZO_ASSIGN_OR_RETURN(const io::PathKind index_kind, env->path_kind(index_path));
  if (index_kind != io::PathKind::kMissing) {
    ZO_ASSIGN_OR_RETURN(const std::string text, env->read_file(index_path, "safetensors index", kMaxHeaderBytes));
    const json doc = json::parse(text, nullptr, false);
    if (doc.is_discarded() || !doc.is_object()) return corruption(index_path + ": not a JSON object");
    auto wm = doc.find("weight_map");
    if (wm == doc.end() || !wm->is_object()) return corruption(index_path + ": no \"weight_map\" object");
    std::map<std::string, const SafetensorsFile*> shards;
    for (const auto& [name, shard_json] : wm->items()) {
      if (!shard_json.is_string()) return corruption(index_path + ": weight_map[\"" + name + "\"] is not a file name");
      const std::string shard = shard_json.get<std::string>();
      if (shard.empty() || shard.find('/') != std::string::npos || shard == "." || shard == "..")
        return corruption(index_path + ": weight_map[\"" + name + "\"] = \"" + shard +
                          "\" is not a file name in the directory");
      auto it = shards.find(shard);
      if (it == shards.end()) {
        const std::string shard_path = model_dir + "/" + shard;
        ZO_ASSIGN_OR_RETURN(const io::PathKind shard_kind, env->path_kind(shard_path));
        if (shard_kind == io::PathKind::kMissing)
          return corruption(index_path + " maps tensor \"" + name + "\" to shard " + shard + ", which does not exist");
        ZO_ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsFile> file, SafetensorsFile::open(shard_path, env));
        w->files_.push_back(std::move(file));
        it = shards.emplace(shard, w->files_.back().get()).first;
      }
      const SafetensorsTensor* t = it->second->find(name);
      if (t == nullptr)
        return corruption(index_path + " maps tensor \"" + name + "\" to " + it->second->path() +
                          ", which does not contain it");
      w->entries_[name] = {it->second, t};
    }
    return w;
  }
  ZO_ASSIGN_OR_RETURN(const io::PathKind single_kind, env->path_kind(single));
  if (single_kind != io::PathKind::kMissing) {
    ZO_ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsFile> file, SafetensorsFile::open(single, env));
    w->files_.push_back(std::move(file));
    const SafetensorsFile* f = w->files_.back().get();
    for (const SafetensorsTensor& t : f->tensors()) w->entries_[t.name] = {f, &t};
    return w;
  }
  return not_found("no weights in " + model_dir +
                   ": neither model.safetensors nor model.safetensors.index.json exists "
                   "(.bin / PyTorch checkpoints are not supported: convert them to safetensors)");
}

const SafetensorsTensor* HfWeights::find(std::string_view name, const SafetensorsFile** file) const {
  auto it = entries_.find(name);
  if (it == entries_.end()) return nullptr;
  if (file != nullptr) *file = it->second.file;
  return it->second.tensor;
}

std::vector<std::string> HfWeights::names() const {
  std::vector<std::string> out;
  out.reserve(entries_.size());
  for (const auto& [name, entry] : entries_) out.push_back(name);
  return out;
}

}  // namespace zo::engine

namespace zo::engine {

uint64_t safetensors_entry_bytes(const SafetensorsEntry& entry) {
  uint64_t n = 1;
  for (int64_t d : entry.shape) n *= static_cast<uint64_t>(d);
  return n * dtype_size_bytes(entry.dtype);
}

const char* safetensors_dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kF32: return "F32";
    case DType::kBF16: return "BF16";
    case DType::kF16: return "F16";
    default: break;
  }
  ZO_CHECK(false) << "safetensors: unsupported dtype " << dtype_name(dtype);
  return "";
}

std::string safetensors_header(std::span<const SafetensorsEntry> tensors,
                               const std::map<std::string, std::string>& metadata, uint64_t data_alignment) {
  ZO_CHECK(data_alignment >= 8 && (data_alignment & (data_alignment - 1)) == 0) << data_alignment;
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) {
    nlohmann::ordered_json meta = nlohmann::ordered_json::object();
    for (const auto& [k, v] : metadata) meta[k] = v;
    header["__metadata__"] = std::move(meta);
  }
  uint64_t offset = 0;
  for (const SafetensorsEntry& t : tensors) {
    const uint64_t bytes = safetensors_entry_bytes(t);
    header[t.name] = {
        {"dtype", safetensors_dtype_name(t.dtype)}, {"shape", t.shape}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string text = header.dump();
  const uint64_t total = align_up(8 + text.size(), data_alignment);
  text.append(total - 8 - text.size(), ' ');
  std::string out(8, '\0');
  const uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out + text;
}

}  // namespace zo::engine

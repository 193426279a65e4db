// Streaming reader of safetensors files (the format: an 8-byte little-endian header length, a JSON
// header of dtype, shape and data_offsets per tensor, then the data) and of a Hugging Face model
// directory's weights (one file or an index with shards). Reads by range with pread into caller buffers: never a whole tensor or file in RAM.
// Immutable after open; find/read_* are thread-safe.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "common/dtype.h"
#include "common/status.h"
#include "io/env.h"

namespace zo::engine {

struct SafetensorsTensor {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  uint64_t n_elems = 0;
  uint64_t data_offset_bytes = 0;  // absolute in the file
  uint64_t size_bytes = 0;
  // A U8 tensor (bitsandbytes' packed codes and quantization statistics) or an I8 one (its 8-bit
  // codes): `dtype` means nothing, read_f32 refuses it, read_raw reads its bytes.
  bool u8 = false;
  bool i8 = false;
  bool bytes() const { return u8 || i8; }
  // Its dtype as the file names it ("U8", "I8", or dtype_name's).
  std::string_view type_text() const { return u8 ? "U8" : i8 ? "I8" : dtype_name(dtype); }
};

class SafetensorsFile {
 public:
  // Parses the header. kCorruption naming the file for: a header length beyond the file or > 100 MB,
  // JSON that is not an object, a malformed entry, offsets out of order/overlapping/outside the data
  // section, a size not matching shape × dtype. kUnavailable naming the dtype and the tensor for a
  // dtype other than F32/BF16/F16, U8 and I8 (F64, I64, ...). kNotFound / kIoError when the file cannot be opened.
  // All reads go through `env`, which must outlive the file.
  static Result<std::unique_ptr<SafetensorsFile>> open(const std::string& path, io::Env* env);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  // In file order (ascending data offset).
  const std::vector<SafetensorsTensor>& tensors() const { return tensors_; }
  const SafetensorsTensor* find(std::string_view name) const;                       // nullptr if absent
  const std::map<std::string, std::string>& metadata() const { return metadata_; }  // "__metadata__"
  uint64_t file_size_bytes() const { return file_size_bytes_; }

  // Reads elements [offset_elems, offset_elems + out.size()) of `tensor` (one of tensors()) converted
  // to fp32 (bf16/fp16 widened exactly). kInvalidArgument for a U8 or I8 tensor or a range beyond the tensor; I/O errors
  // and short reads name the file, tensor and offset.
  Status read_f32(const SafetensorsTensor& tensor, uint64_t offset_elems, std::span<float> out) const;
  // Reads the raw little-endian bytes [offset_bytes, offset_bytes + out.size()) of `tensor`.
  Status read_raw(const SafetensorsTensor& tensor, uint64_t offset_bytes, std::span<uint8_t> out) const;

 private:
  SafetensorsFile() = default;

  std::string path_;
  std::unique_ptr<io::ReadFile> file_;
  uint64_t file_size_bytes_ = 0;
  std::vector<SafetensorsTensor> tensors_;
  std::unordered_map<std::string, size_t> by_name_;
  std::map<std::string, std::string> metadata_;
};

// One tensor of a safetensors file to be written.
struct SafetensorsEntry {
  std::string name;
  DType dtype = DType::kF32;  // kF32, kBF16 or kF16
  std::vector<int64_t> shape;
};

// The bytes that precede the data of a safetensors file holding `tensors` back to back in this
// order: the 8-byte little-endian header length, then the JSON header (data_offsets contiguous from
// 0, "__metadata__" = `metadata`) padded with spaces so that the data starts at a multiple of
// `data_alignment` (a power of two; 4096 lets the data be written with O_DIRECT). Writers append
// the tensors' little-endian bytes after it.
std::string safetensors_header(std::span<const SafetensorsEntry> tensors,
                               const std::map<std::string, std::string>& metadata, uint64_t data_alignment = 4096);
// Bytes of one entry's data (elements × dtype size).
uint64_t safetensors_entry_bytes(const SafetensorsEntry& entry);
// The dtype's safetensors name: "F32", "BF16" or "F16".
const char* safetensors_dtype_name(DType dtype);

// A Hugging Face model directory's weights: model.safetensors, or model.safetensors.index.json
// ("weight_map": name -> shard file) with its shards. Each tensor name maps to one file.
class HfWeights {
 public:
  // kNotFound when neither file exists (saying that .bin/PyTorch checkpoints are not supported:
  // convert them to safetensors); kCorruption for a malformed index, an index naming a missing shard
  // or a tensor absent from its shard; the errors of SafetensorsFile::open.
  static Result<std::unique_ptr<HfWeights>> open(const std::string& model_dir, io::Env* env);

  // The tensor named `name` and (when `file` is not null) the file holding it; nullptr if absent.
  const SafetensorsTensor* find(std::string_view name, const SafetensorsFile** file) const;
  std::vector<std::string> names() const;  // sorted
  const std::string& model_dir() const { return model_dir_; }

 private:
  struct Entry {
    const SafetensorsFile* file = nullptr;
    const SafetensorsTensor* tensor = nullptr;
  };
  std::string model_dir_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, Entry, std::less<>> entries_;
};

}  // namespace zo::engine

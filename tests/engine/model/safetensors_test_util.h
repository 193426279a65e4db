// Test-only helpers for engine/model tests: a temporary directory and a minimal safetensors writer
// (plain C++, independent of the reader under test) that can also write deliberately broken files.
// Not thread-safe; each test owns its TempDir.
#pragma once

#include <gtest/gtest.h>
#include <stdlib.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "common/half.h"

namespace zo::engine::testing {

class TempDir {
 public:
  TempDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "zo_model_test_XXXXXX").string();
    path_ = ::mkdtemp(tmpl.data()) != nullptr ? tmpl : "";
    EXPECT_FALSE(path_.empty()) << "mkdtemp failed";
  }
  ~TempDir() {
    std::error_code ec;
    if (!path_.empty()) std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }
  std::string file(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

inline void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good()) << "writing " << path;
}

// 8-byte little-endian length, the header text (padded with spaces to a multiple of 8), the data.
inline std::string safetensors_bytes(const std::string& header, const std::string& data, uint64_t forced_len = 0) {
  std::string h = header;
  while (h.size() % 8 != 0) h += ' ';
  const uint64_t len = forced_len != 0 ? forced_len : h.size();
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((len >> (8 * i)) & 0xFF);
  return out + h + data;
}

struct TestTensor {
  std::string name;
  std::string dtype;  // "F32", "BF16", "F16" (or anything, bytes are given)
  std::vector<int64_t> shape;
  std::string bytes;
};

inline TestTensor f32_tensor(std::string name, std::vector<int64_t> shape, const std::vector<float>& v) {
  std::string b(v.size() * 4, '\0');
  std::memcpy(b.data(), v.data(), b.size());
  return {std::move(name), "F32", std::move(shape), std::move(b)};
}

// Rounds each value to 16 bits (bf16 or fp16); the expected read-back is the widened 16-bit value.
inline TestTensor half_tensor(std::string name, bool bf16, std::vector<int64_t> shape, const std::vector<float>& v) {
  std::string b(v.size() * 2, '\0');
  for (size_t i = 0; i < v.size(); ++i) {
    const uint16_t h = bf16 ? float_to_bf16(v[i]) : float_to_f16(v[i]);
    std::memcpy(b.data() + 2 * i, &h, 2);
  }
  return {std::move(name), bf16 ? "BF16" : "F16", std::move(shape), std::move(b)};
}

inline std::string shape_json(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? "," : "") + std::to_string(shape[i]);
  return s + "]";
}

// A well-formed file: tensors laid out contiguously in the given order.
inline void write_safetensors(const std::string& path, const std::vector<TestTensor>& tensors) {
  std::string header = "{\"__metadata__\":{\"format\":\"pt\"}";
  std::string data;
  for (const TestTensor& t : tensors) {
    header += ",\"" + t.name + "\":{\"dtype\":\"" + t.dtype + "\",\"shape\":" + shape_json(t.shape) +
              ",\"data_offsets\":[" + std::to_string(data.size()) + "," + std::to_string(data.size() + t.bytes.size()) +
              "]}";
    data += t.bytes;
  }
  write_file(path, safetensors_bytes(header + "}", data));
}

}  // namespace zo::engine::testing

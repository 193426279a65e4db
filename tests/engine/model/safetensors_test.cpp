// The safetensors reader against files written by an independent test writer: exact read-back of
// F32/BF16/F16 at any offset, every corruption the header can carry, and model directories (one
// file, sharded with an index, missing shards, no weights at all).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <sys/stat.h>

#include <cmath>
#include <string>
#include <vector>

#include "common/half.h"
#include "engine/model/model_config.h"
#include "engine/model/safetensors.h"
#include "tests/engine/model/safetensors_test_util.h"

namespace zo::engine {
namespace {

using testing::f32_tensor;
using testing::half_tensor;
using ::testing::HasSubstr;
using testing::TempDir;
using testing::write_file;
using testing::write_safetensors;

std::vector<float> ramp(size_t n, float scale) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i)
    v[i] = scale * std::sin(0.37f * static_cast<float>(i) + 0.1f) * static_cast<float>(i + 1);
  return v;
}

std::unique_ptr<SafetensorsFile> open_ok(const std::string& path) {
  auto r = SafetensorsFile::open(path, io::Env::posix());
  EXPECT_TRUE(r.is_ok()) << r.status().to_string();
  return r.is_ok() ? std::move(r).value() : nullptr;
}

TEST(SafetensorsFile, ReadsBackF32Bf16F16Exactly) {
  TempDir dir;
  const std::vector<float> a = ramp(60, 0.5f), b = ramp(35, 3.0f), c = ramp(17, 0.01f);
  write_safetensors(dir.file("m.safetensors"), {f32_tensor("a", {3, 4, 5}, a), half_tensor("b", true, {35}, b),
                                                half_tensor("c", false, {17, 1}, c)});
  auto f = open_ok(dir.file("m.safetensors"));
  ASSERT_NE(f, nullptr);
  ASSERT_EQ(f->tensors().size(), 3u);
  EXPECT_EQ(f->metadata().at("format"), "pt");
  EXPECT_EQ(f->find("missing"), nullptr);

  const SafetensorsTensor* ta = f->find("a");
  ASSERT_NE(ta, nullptr);
  EXPECT_EQ(ta->dtype, DType::kF32);
  EXPECT_EQ(ta->shape, (std::vector<int64_t>{3, 4, 5}));
  EXPECT_EQ(ta->n_elems, 60u);
  EXPECT_EQ(ta->size_bytes, 240u);
  std::vector<float> out(60);
  ASSERT_TRUE(f->read_f32(*ta, 0, out).is_ok());
  EXPECT_EQ(out, a);

  const SafetensorsTensor* tb = f->find("b");
  ASSERT_NE(tb, nullptr);
  EXPECT_EQ(tb->dtype, DType::kBF16);
  EXPECT_EQ(tb->data_offset_bytes, ta->data_offset_bytes + 240);
  out.assign(35, 0.0f);
  ASSERT_TRUE(f->read_f32(*tb, 0, out).is_ok());
  for (size_t i = 0; i < b.size(); ++i) EXPECT_EQ(out[i], bf16_to_float(float_to_bf16(b[i]))) << i;

  const SafetensorsTensor* tc = f->find("c");
  ASSERT_NE(tc, nullptr);
  EXPECT_EQ(tc->dtype, DType::kF16);
  out.assign(17, 0.0f);
  ASSERT_TRUE(f->read_f32(*tc, 0, out).is_ok());
  for (size_t i = 0; i < c.size(); ++i) EXPECT_EQ(out[i], f16_to_float(float_to_f16(c[i]))) << i;
}

TEST(SafetensorsFile, PartialReadsAtOffsets) {
  TempDir dir;
  const std::vector<float> a = ramp(1000, 1.0f);
  // More bf16 elements than the reader's bounce buffer, so a long read crosses its chunks.
  const std::vector<float> b = ramp(70000, 0.001f);
  write_safetensors(dir.file("m.safetensors"), {f32_tensor("a", {1000}, a), half_tensor("b", true, {70000}, b)});
  auto f = open_ok(dir.file("m.safetensors"));
  ASSERT_NE(f, nullptr);
  for (uint64_t off : {0u, 1u, 333u, 999u}) {
    std::vector<float> out(std::min<uint64_t>(17, 1000 - off));
    ASSERT_TRUE(f->read_f32(*f->find("a"), off, out).is_ok());
    for (size_t i = 0; i < out.size(); ++i) EXPECT_EQ(out[i], a[off + i]);
  }
  std::vector<float> out(69990);
  ASSERT_TRUE(f->read_f32(*f->find("b"), 7, out).is_ok());
  for (size_t i = 0; i < out.size(); ++i) ASSERT_EQ(out[i], bf16_to_float(float_to_bf16(b[7 + i]))) << i;
  std::vector<float> none;
  EXPECT_TRUE(f->read_f32(*f->find("a"), 1000, none).is_ok());
  std::vector<float> beyond(2);
  const Status s = f->read_f32(*f->find("a"), 999, beyond);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("\"a\""));
}

Status open_status(const std::string& path) {
  auto r = SafetensorsFile::open(path, io::Env::posix());
  return r.is_ok() ? Status::ok() : r.status();
}

void expect_corrupt(const std::string& bytes, const std::string& why, StatusCode code = StatusCode::kCorruption) {
  TempDir dir;
  const std::string path = dir.file("bad.safetensors");
  write_file(path, bytes);
  const Status s = open_status(path);
  EXPECT_EQ(s.code(), code) << why << ": " << s.to_string();
  EXPECT_THAT(s.message(), HasSubstr(path)) << why;
}

const std::string kEight(8, 'x');

TEST(SafetensorsFile, RejectsCorruptHeaders) {
  using testing::safetensors_bytes;
  expect_corrupt("abc", "shorter than the length field");
  expect_corrupt(safetensors_bytes("{}", "").substr(0, 6), "truncated length");
  expect_corrupt(safetensors_bytes(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", kEight, 4096),
                 "header length beyond the file");
  expect_corrupt(safetensors_bytes("{}", "", 200ull << 20), "header length > 100 MB");
  expect_corrupt(safetensors_bytes("[1,2]", ""), "JSON array");
  expect_corrupt(safetensors_bytes("{\"a\":", ""), "invalid JSON");
  expect_corrupt(safetensors_bytes(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},
                                     "b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                                   std::string(12, 'x')),
                 "overlapping offsets");
  expect_corrupt(safetensors_bytes(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", kEight),
                 "offsets out of order");
  expect_corrupt(safetensors_bytes(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", kEight),
                 "size not matching shape x dtype");
  expect_corrupt(safetensors_bytes(R"({"a":{"dtype":"BF16","shape":[2,2],"data_offsets":[0,16]}})", kEight),
                 "data beyond the end of the file");
  expect_corrupt(safetensors_bytes(R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", kEight),
                 "negative dimension");
  expect_corrupt(safetensors_bytes(R"({"a":{"dtype":"F32","data_offsets":[0,8]}})", kEight), "no shape");
  expect_corrupt(safetensors_bytes(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0]}})", kEight), "one offset");
}

// Issue 19, finding 3: the tensors must cover the data section exactly, as the reference library
// requires. A header length one byte short (its padding still parses) shifted every weight by a
// byte and trained to NaN; gaps and trailing bytes were accepted.
TEST(SafetensorsFile, TensorsMustCoverTheDataExactly) {
  using testing::safetensors_bytes;
  const std::string two = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  std::string padded = two;
  while (padded.size() % 8 != 0 || padded.size() == two.size()) padded += ' ';
  struct Case {
    std::string bytes;
    std::string why;
  };
  const std::vector<Case> cases = {
      {safetensors_bytes(two, kEight + "y"), "the last 1 bytes of the file belong to no tensor"},
      {safetensors_bytes(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", std::string(12, 'x')),
       "4 bytes before tensor \"a\" (data offset 0) belong to no tensor"},
      {safetensors_bytes(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},
                             "b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
                         std::string(12, 'x')),
       "4 bytes before tensor \"b\" (data offset 4) belong to no tensor"},
      {safetensors_bytes(padded, kEight, padded.size() - 1), "the last 1 bytes of the file belong to no tensor"},
  };
  for (const Case& c : cases) {
    TempDir dir;
    const std::string path = dir.file("bad.safetensors");
    write_file(path, c.bytes);
    const Status s = open_status(path);
    EXPECT_EQ(s.code(), StatusCode::kCorruption) << c.why << ": " << s.to_string();
    EXPECT_THAT(s.message(), HasSubstr(c.why));
  }
}

TEST(SafetensorsFile, UnsupportedDtypeNamesDtypeAndTensor) {
  TempDir dir;
  const std::string path = dir.file("f64.safetensors");
  write_file(path, testing::safetensors_bytes(
                       R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},
                           "pos":{"dtype":"F64","shape":[1],"data_offsets":[8,16]}})",
                       std::string(16, 'x')));
  const Status s = open_status(path);
  EXPECT_EQ(s.code(), StatusCode::kUnavailable);
  EXPECT_THAT(s.message(), HasSubstr("F64"));
  EXPECT_THAT(s.message(), HasSubstr("\"pos\""));
  EXPECT_THAT(s.message(), HasSubstr(path));
}

TEST(SafetensorsFile, MissingFileIsNotFound) {
  TempDir dir;
  EXPECT_EQ(open_status(dir.file("nope.safetensors")).code(), StatusCode::kNotFound);
}

TEST(SafetensorsFile, HandlesEmptyTensorsAndHeaderPadding) {
  TempDir dir;
  const std::string path = dir.file("m.safetensors");
  write_file(path, testing::safetensors_bytes(R"({"e":{"dtype":"F16","shape":[0,4],"data_offsets":[0,0]},
      "a":{"dtype":"F32","shape":[],"data_offsets":[0,4]}}     )",
                                              std::string("\x00\x00\x80\x3f", 4)));
  auto f = open_ok(path);
  ASSERT_NE(f, nullptr);
  EXPECT_EQ(f->find("e")->n_elems, 0u);
  std::vector<float> out(1);
  ASSERT_TRUE(f->read_f32(*f->find("a"), 0, out).is_ok());
  EXPECT_EQ(out[0], 1.0f);
}

TEST(HfWeights, SingleFile) {
  TempDir dir;
  write_safetensors(dir.file("model.safetensors"), {f32_tensor("x.weight", {2}, {1, 2}), f32_tensor("y", {1}, {3})});
  auto w = HfWeights::open(dir.path(), io::Env::posix());
  ASSERT_TRUE(w.is_ok()) << w.status().to_string();
  EXPECT_EQ((*w)->names(), (std::vector<std::string>{"x.weight", "y"}));
  const SafetensorsFile* file = nullptr;
  const SafetensorsTensor* t = (*w)->find("y", &file);
  ASSERT_NE(t, nullptr);
  ASSERT_NE(file, nullptr);
  EXPECT_EQ(file->path(), dir.file("model.safetensors"));
  std::vector<float> out(1);
  ASSERT_TRUE(file->read_f32(*t, 0, out).is_ok());
  EXPECT_EQ(out[0], 3.0f);
  EXPECT_EQ((*w)->find("z", &file), nullptr);
}

constexpr const char* kIndex = R"({"metadata": {"total_size": 28},
  "weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors",
                 "c": "model-00002-of-00002.safetensors"}})";

TEST(HfWeights, ShardedIndexMapsEachTensorToItsShard) {
  TempDir dir;
  write_safetensors(dir.file("model-00001-of-00002.safetensors"), {f32_tensor("a", {2}, {1, 2})});
  write_safetensors(dir.file("model-00002-of-00002.safetensors"),
                    {half_tensor("b", true, {2}, {3, 4}), f32_tensor("c", {3}, {5, 6, 7})});
  write_file(dir.file("model.safetensors.index.json"), kIndex);
  auto w = HfWeights::open(dir.path(), io::Env::posix());
  ASSERT_TRUE(w.is_ok()) << w.status().to_string();
  EXPECT_EQ((*w)->names(), (std::vector<std::string>{"a", "b", "c"}));
  for (const auto& [name, shard, first] : {std::tuple{"a", "model-00001-of-00002.safetensors", 1.0f},
                                           std::tuple{"b", "model-00002-of-00002.safetensors", 3.0f},
                                           std::tuple{"c", "model-00002-of-00002.safetensors", 5.0f}}) {
    const SafetensorsFile* file = nullptr;
    const SafetensorsTensor* t = (*w)->find(name, &file);
    ASSERT_NE(t, nullptr) << name;
    EXPECT_EQ(file->path(), dir.file(shard));
    std::vector<float> out(1);
    ASSERT_TRUE(file->read_f32(*t, 0, out).is_ok());
    EXPECT_EQ(out[0], first);
  }
}

TEST(HfWeights, IndexNamingMissingShardOrTensorIsCorruption) {
  {
    TempDir dir;
    write_safetensors(dir.file("model-00001-of-00002.safetensors"), {f32_tensor("a", {2}, {1, 2})});
    write_file(dir.file("model.safetensors.index.json"), kIndex);
    auto w = HfWeights::open(dir.path(), io::Env::posix());
    ASSERT_FALSE(w.is_ok());
    EXPECT_EQ(w.status().code(), StatusCode::kCorruption);
    EXPECT_THAT(w.status().message(), HasSubstr("model-00002-of-00002.safetensors"));
  }
  {
    TempDir dir;
    write_safetensors(dir.file("model-00001-of-00002.safetensors"), {f32_tensor("a", {2}, {1, 2})});
    write_safetensors(dir.file("model-00002-of-00002.safetensors"), {half_tensor("b", true, {2}, {3, 4})});
    write_file(dir.file("model.safetensors.index.json"), kIndex);
    auto w = HfWeights::open(dir.path(), io::Env::posix());
    ASSERT_FALSE(w.is_ok());
    EXPECT_EQ(w.status().code(), StatusCode::kCorruption);
    EXPECT_THAT(w.status().message(), HasSubstr("\"c\""));
  }
  {
    TempDir dir;
    write_file(dir.file("model.safetensors.index.json"), R"({"weight_map": {"a": "../evil.safetensors"}})");
    EXPECT_EQ(HfWeights::open(dir.path(), io::Env::posix()).status().code(), StatusCode::kCorruption);
    write_file(dir.file("model.safetensors.index.json"), R"({"metadata": {}})");
    EXPECT_EQ(HfWeights::open(dir.path(), io::Env::posix()).status().code(), StatusCode::kCorruption);
  }
}

TEST(HfWeights, NoSafetensorsSaysBinIsUnsupported) {
  TempDir dir;
  write_file(dir.file("pytorch_model.bin"), "not really");
  auto w = HfWeights::open(dir.path(), io::Env::posix());
  ASSERT_FALSE(w.is_ok());
  EXPECT_EQ(w.status().code(), StatusCode::kNotFound);
  EXPECT_THAT(w.status().message(), HasSubstr("model.safetensors"));
  EXPECT_THAT(w.status().message(), HasSubstr("convert"));
  EXPECT_THAT(w.status().message(), HasSubstr(dir.path()));
}

// Issue 19, finding 4: a FIFO named as config.json, model.safetensors or the index hung the run
// (open blocks until a writer appears); it is refused by kind, before it is opened.
TEST(HfWeights, AFifoInsteadOfAModelFileIsRefusedNotWaitedOn) {
  for (const char* name : {"config.json", "model.safetensors", "model.safetensors.index.json"}) {
    SCOPED_TRACE(name);
    TempDir dir;
    ASSERT_EQ(::mkfifo(dir.file(name).c_str(), 0600), 0);
    const Status st = std::string(name) == "config.json" ? load_hf_config(dir.path(), io::Env::posix()).status()
                                                         : HfWeights::open(dir.path(), io::Env::posix()).status();
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.to_string();
    EXPECT_THAT(st.message(), HasSubstr(dir.file(name) + " is a FIFO (named pipe), not a regular file"));
  }
}

}  // namespace
}  // namespace zo::engine

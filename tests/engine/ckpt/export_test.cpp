// The Hugging Face export (engine/ckpt/export.h) over real files: what it writes parses with the
// project's safetensors reader and holds the source rounded to the dtype bit for bit (a tensor
// spanning many chunks of a 1 MiB staging included), sharding and the index, fp16 overflow counts,
// bad options and a non-empty directory are refused, and a failing reader, a failing store read or a
// corrupted checkpoint leaves nothing behind. Also from a live StateStore on every tier and from a
// saved checkpoint.
#include "engine/ckpt/export.h"

#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "common/half.h"
#include "engine/config/config.h"
#include "engine/model/safetensors.h"
#include "gpu/device.h"
#include "io/env.h"
#include "io/io_engine.h"
#include "tests/engine/temp_dir.h"

namespace zo::engine {
namespace {

namespace fs = std::filesystem;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::UnorderedElementsAre;

constexpr const char* kConfigJson =
    R"({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "vocab_size": 300,
        "torch_dtype": "float32"})";

// Weights-like values (std 0.02) with every fifth a random bit pattern: ties, denormals, values
// beyond the fp16 range, infinities and NaNs all occur.
std::vector<float> make_values(uint64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 0.02f);
  std::vector<float> v(n);
  for (uint64_t i = 0; i < n; ++i) v[i] = i % 5 == 4 ? bits_float(rng()) : normal(rng);
  return v;
}

struct Model {
  std::vector<ParamInfo> params;
  std::vector<std::vector<float>> values;

  void add(std::string name, std::vector<int64_t> shape) {
    ParamInfo p;
    p.id = static_cast<uint32_t>(params.size());
    p.name = std::move(name);
    p.shape = std::move(shape);
    p.n_elems = 1;
    for (int64_t d : p.shape) p.n_elems *= static_cast<uint64_t>(d);
    values.push_back(make_values(p.n_elems, 17 + p.id));
    params.push_back(std::move(p));
  }
};

// An embedding large enough to span many chunks of a 1 MiB staging in every dtype, a 1-D norm and
// a small matrix.
Model small_model() {
  Model m;
  m.add("model.embed_tokens.weight", {300, 1000});
  m.add("model.norm.weight", {64});
  m.add("lm_head.weight", {7, 13});
  return m;
}

// An in-memory Fp32Reader that records its calls and fails the call numbered fail_at.
struct MemReader {
  const Model* model = nullptr;
  std::vector<std::array<uint64_t, 3>> calls;  // param, offset, n
  uint64_t fail_at = std::numeric_limits<uint64_t>::max();

  Fp32Reader reader() {
    return [this](uint32_t p, uint64_t off, std::span<float> out) -> Status {
      calls.push_back({p, off, out.size()});
      if (calls.size() - 1 == fail_at) return io_error("injected read failure", EIO);
      const std::vector<float>& v = model->values.at(p);
      if (off + out.size() > v.size()) return invalid_argument("read beyond the tensor");
      std::memcpy(out.data(), v.data() + off, out.size() * sizeof(float));
      return Status::ok();
    };
  }
};

std::unique_ptr<io::IoEngine> make_io() {
  auto io = io::IoEngine::create(io::IoOptions{});
  ZO_CHECK(io.is_ok()) << io.status().to_string();
  return std::move(io).value();
}

std::string slurp_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

std::set<std::string> files_in(const std::string& dir) {
  std::set<std::string> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) out.insert(e.path().filename().string());
  return out;
}

uint16_t expected_half(DType dtype, float f) { return dtype == DType::kBF16 ? float_to_bf16(f) : float_to_f16(f); }

// The tensor in `file` is `name` with `shape` in `dtype`, its bytes the source converted bit for bit.
void expect_tensor(const SafetensorsFile& file, const std::string& name, const std::vector<int64_t>& shape, DType dtype,
                   const std::vector<float>& src) {
  const SafetensorsTensor* t = file.find(name);
  ASSERT_NE(t, nullptr) << name << " in " << file.path();
  EXPECT_EQ(t->dtype, dtype) << name;
  EXPECT_EQ(t->shape, shape) << name;
  ASSERT_EQ(t->n_elems, src.size()) << name;
  std::vector<uint8_t> raw(t->size_bytes);
  ASSERT_TRUE(file.read_raw(*t, 0, raw).is_ok());
  uint64_t mismatches = 0, first = 0;
  for (uint64_t i = 0; i < src.size(); ++i) {
    bool same;
    if (dtype == DType::kF32) {
      uint32_t got;
      std::memcpy(&got, raw.data() + 4 * i, 4);
      same = got == float_bits(src[i]);
    } else {
      const uint16_t got = static_cast<uint16_t>(raw[2 * i] | (raw[2 * i + 1] << 8));
      same = got == expected_half(dtype, src[i]);
    }
    if (!same && mismatches++ == 0) first = i;
  }
  EXPECT_EQ(mismatches, 0u) << name << ": first mismatch at element " << first << " (source bits 0x" << std::hex
                            << float_bits(src[first]) << ")";
}

uint64_t expected_overflow(const Model& m) {
  uint64_t n = 0;
  for (const auto& v : m.values)
    for (float f : v) n += std::isfinite(f) && std::fabs(f) >= 65520.0f;
  return n;
}

ExportOptions options_for(const std::string& dir, DType dtype) {
  ExportOptions o;
  o.dtype = dtype;
  o.out_dir = dir;
  o.staging_bytes = kMiB;
  o.env = io::Env::posix();
  return o;
}

class ExportDtype : public ::testing::TestWithParam<DType> {};

TEST_P(ExportDtype, OneFileHoldsTheSourceRoundedBitForBit) {
  const DType dtype = GetParam();
  TempDir tmp("zo_export_test");
  const std::string out = tmp.path + "/hf";
  const Model m = small_model();
  MemReader reader{&m};
  auto io = make_io();
  ExportOptions o = options_for(out, dtype);
  std::vector<std::pair<uint64_t, uint64_t>> progress;
  o.progress = [&](uint64_t done, uint64_t total) { progress.emplace_back(done, total); };

  auto r = export_hf_model(m.params, kConfigJson, reader.reader(), *io, o);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  uint64_t bytes = 0;
  for (const ParamInfo& p : m.params) bytes += p.n_elems * dtype_size_bytes(dtype);
  EXPECT_EQ(r->tensor_bytes, bytes);
  EXPECT_EQ(r->out_dir, out);
  EXPECT_THAT(r->files, UnorderedElementsAre("model.safetensors", "config.json"));
  EXPECT_THAT(files_in(out), UnorderedElementsAre("model.safetensors", "config.json"));
  EXPECT_EQ(r->overflowed, dtype == DType::kF16 ? expected_overflow(m) : 0u);
  if (dtype == DType::kF16) { EXPECT_GT(r->overflowed, 0u); }

  // Front to back, several chunks for the embedding, each bounded by the staging.
  uint64_t embed_calls = 0;
  for (size_t i = 0; i < reader.calls.size(); ++i) {
    const auto [p, off, n] = reader.calls[i];
    EXPECT_LE(n * sizeof(float), o.staging_bytes);
    if (i > 0) {
      const auto [pp, poff, pn] = reader.calls[i - 1];
      EXPECT_TRUE((p == pp && off == poff + pn) || (p == pp + 1 && off == 0 && poff + pn == m.params[pp].n_elems))
          << "call " << i << " reads param " << p << " at " << off << " after param " << pp << " [" << poff << ", "
          << poff + pn << ")";
    }
    embed_calls += p == 0;
  }
  EXPECT_GE(embed_calls, 3u);
  ASSERT_FALSE(progress.empty());
  EXPECT_EQ(progress.back(), std::make_pair(bytes, bytes));
  for (size_t i = 1; i < progress.size(); ++i) EXPECT_LE(progress[i - 1].first, progress[i].first);

  auto file = SafetensorsFile::open(out + "/model.safetensors", io::Env::posix());
  ASSERT_TRUE(file.is_ok()) << file.status().to_string();
  EXPECT_EQ((*file)->metadata().at("format"), "pt");
  ASSERT_EQ((*file)->tensors().size(), m.params.size());
  EXPECT_EQ((*file)->tensors()[0].data_offset_bytes % 4096, 0u);
  for (size_t i = 0; i < m.params.size(); ++i) {
    EXPECT_EQ((*file)->tensors()[i].name, m.params[i].name) << "file order is param order";
    expect_tensor(**file, m.params[i].name, m.params[i].shape, dtype, m.values[i]);
  }
  EXPECT_EQ((*file)->file_size_bytes(), (*file)->tensors()[0].data_offset_bytes + bytes);

  std::ifstream config_in(out + "/config.json");
  const auto config = nlohmann::json::parse(config_in, nullptr, false);
  ASSERT_TRUE(config.is_object());
  EXPECT_EQ(config["torch_dtype"], dtype == DType::kBF16 ? "bfloat16" : dtype == DType::kF16 ? "float16" : "float32");
  EXPECT_EQ(config["hidden_size"], 64);
  EXPECT_EQ(config["architectures"][0], "LlamaForCausalLM");

  auto weights = HfWeights::open(out, io::Env::posix());
  ASSERT_TRUE(weights.is_ok()) << weights.status().to_string();
  EXPECT_EQ((*weights)->names().size(), m.params.size());
}

INSTANTIATE_TEST_SUITE_P(Export, ExportDtype, ::testing::Values(DType::kBF16, DType::kF16, DType::kF32),
                         [](const auto& info) { return std::string(dtype_name(info.param)); });

// merge_lora (what the export runs: a chunk over the hardware's threads) gives merge_lora_chunk's
// bits for chunks that start mid-row and span many rows, and merge_lora_chunk's sum is over k in
// order then times s (PEFT's B @ A · s, summed as a loop would).
TEST(MergeLora, ThreadsCannotChangeTheBitsAndTheSumIsInOrder) {
  const uint64_t out = 700, in = 301, r = 5;
  const float s = 1.75f;
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> A(r * in), B(out * r), W(out * in);
  for (float& v : A) v = u(rng);
  for (float& v : B) v = u(rng);
  for (float& v : W) v = u(rng);
  std::vector<float> serial = W, threaded = W;
  for (const uint64_t first : {uint64_t{0}, uint64_t{1234}}) {
    const uint64_t n = out * in - first;  // 210 700 elements or fewer: several threads where there are cores
    merge_lora_chunk(A, B, r, in, s, first, std::span(serial.data() + first, n));
    merge_lora(A, B, r, in, s, first, std::span(threaded.data() + first, n));
    EXPECT_EQ(0, std::memcmp(serial.data(), threaded.data(), serial.size() * 4)) << "from element " << first;
  }
  for (const uint64_t e : {uint64_t{0}, uint64_t{1233}, uint64_t{1234}, out * in - 1}) {
    float acc = 0.0f;
    for (uint64_t k = 0; k < r; ++k) acc += B[e / in * r + k] * A[k * in + e % in];
    // Merged once from element 0, again from 1234 on.
    EXPECT_EQ(serial[e], e >= 1234 ? (W[e] + acc * s) + acc * s : W[e] + acc * s) << e;
  }
}

TEST(Export, ShardsConsecutiveTensorsWithAnIndex) {
  TempDir tmp("zo_export_test");
  const std::string out = tmp.path + "/hf";
  Model m;
  m.add("a", {100});    // 200 bytes in bf16
  m.add("b", {5, 10});  // 100: a + b is exactly the shard size
  m.add("c", {1000});   // 2000: larger than a shard, alone
  m.add("d", {10});     // 20
  m.add("e", {2, 5});   // 20
  MemReader reader{&m};
  auto io = make_io();
  ExportOptions o = options_for(out, DType::kBF16);
  o.shard_bytes = 300;
  auto r = export_hf_model(m.params, kConfigJson, reader.reader(), *io, o);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_EQ(r->tensor_bytes, 2340u);
  const std::vector<std::string> shards = {"model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
                                           "model-00003-of-00003.safetensors"};
  EXPECT_THAT(files_in(out),
              UnorderedElementsAre(shards[0], shards[1], shards[2], "model.safetensors.index.json", "config.json"));
  EXPECT_EQ(r->files.size(), 5u);

  std::ifstream in(out + "/model.safetensors.index.json");
  const auto index = nlohmann::json::parse(in, nullptr, false);
  ASSERT_TRUE(index.is_object());
  EXPECT_EQ(index["metadata"]["total_size"], 2340);
  const nlohmann::json expected_map = {
      {"a", shards[0]}, {"b", shards[0]}, {"c", shards[1]}, {"d", shards[2]}, {"e", shards[2]}};
  EXPECT_EQ(index["weight_map"], expected_map);

  const std::vector<std::vector<std::string>> held = {{"a", "b"}, {"c"}, {"d", "e"}};
  for (size_t k = 0; k < shards.size(); ++k) {
    auto file = SafetensorsFile::open(out + "/" + shards[k], io::Env::posix());
    ASSERT_TRUE(file.is_ok()) << file.status().to_string();
    EXPECT_EQ((*file)->metadata().at("format"), "pt");
    std::vector<std::string> names;
    for (const auto& t : (*file)->tensors()) names.push_back(t.name);
    EXPECT_EQ(names, held[k]) << shards[k];
  }
  auto weights = HfWeights::open(out, io::Env::posix());
  ASSERT_TRUE(weights.is_ok()) << weights.status().to_string();
  for (size_t i = 0; i < m.params.size(); ++i) {
    const SafetensorsFile* file = nullptr;
    ASSERT_NE((*weights)->find(m.params[i].name, &file), nullptr);
    expect_tensor(*file, m.params[i].name, m.params[i].shape, DType::kBF16, m.values[i]);
  }
}

TEST(Export, AShardSizeAboveTheModelGivesOneFile) {
  TempDir tmp("zo_export_test");
  Model m;
  m.add("a", {100});
  m.add("b", {50});
  MemReader reader{&m};
  auto io = make_io();
  ExportOptions o = options_for(tmp.path + "/hf", DType::kF16);
  o.shard_bytes = 300;  // exactly the model
  auto r = export_hf_model(m.params, kConfigJson, reader.reader(), *io, o);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_THAT(files_in(o.out_dir), UnorderedElementsAre("model.safetensors", "config.json"));
  o.out_dir = tmp.path + "/hf2";
  o.shard_bytes = 299;
  r = export_hf_model(m.params, kConfigJson, reader.reader(), *io, o);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_THAT(files_in(o.out_dir),
              UnorderedElementsAre("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                                   "model.safetensors.index.json", "config.json"));
}

// The tokenizer and generation config of the trained model go along, byte for byte, so the export
// is a complete model directory; a side file that would replace the export's own files, a
// duplicate name or a missing file is refused before anything is written.
TEST(Export, CopiesSideFilesAndRefusesBadOnes) {
  TempDir tmp("zo_export_test");
  Model m;
  m.add("a", {100});
  MemReader reader{&m};
  auto io = make_io();
  const std::string model_dir = tmp.path + "/model";
  fs::create_directories(model_dir);
  const std::string tokenizer = std::string("{\"version\": \"1.0\", \"bytes\": \"") + std::string(100000, 'x') + "\"}";
  for (const auto& [name, text] : {std::pair<std::string, std::string>{"tokenizer.json", tokenizer},
                                   {"tokenizer_config.json", "{}"},
                                   {"generation_config.json", "{\"do_sample\": false}"},
                                   {"unrelated.txt", "not copied"}}) {
    std::ofstream(model_dir + "/" + name) << text;
  }
  const std::vector<std::string> sides = model_side_files(model_dir, io::Env::posix());
  EXPECT_EQ(sides.size(), 3u);
  EXPECT_TRUE(model_side_files("tiny", io::Env::posix()).empty()) << "a preset name is no directory";
  ExportOptions o = options_for(tmp.path + "/hf", DType::kBF16);
  o.side_files = sides;
  auto r = export_hf_model(m.params, kConfigJson, reader.reader(), *io, o);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_THAT(files_in(o.out_dir), UnorderedElementsAre("model.safetensors", "config.json", "tokenizer.json",
                                                        "tokenizer_config.json", "generation_config.json"));
  std::ifstream in(o.out_dir + "/tokenizer.json");
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(in), {}), tokenizer);

  const std::string out = tmp.path + "/refused";
  for (const std::vector<std::string>& bad : {std::vector<std::string>{model_dir + "/missing.json"},
                                              {model_dir + "/tokenizer.json", model_dir + "/tokenizer.json"},
                                              {tmp.path + "/hf/config.json"},
                                              {tmp.path + "/hf/model.safetensors"}}) {
    ExportOptions b = options_for(out, DType::kBF16);
    b.side_files = bad;
    auto refused = export_hf_model(m.params, kConfigJson, reader.reader(), *io, b);
    ASSERT_FALSE(refused.is_ok()) << bad[0];
    EXPECT_THAT(refused.status().message(), HasSubstr(fs::path(bad[0]).filename().string()));
    EXPECT_FALSE(fs::exists(out)) << "nothing written for " << bad[0];
  }
}

TEST(Export, Fp16RoundsToNearestEvenAndCountsOverflow) {
  TempDir tmp("zo_export_test");
  Model m;
  m.add("x", {12});
  const float inf = std::numeric_limits<float>::infinity();
  m.values[0] = {65504.0f, 65519.0f, 65520.0f, -70000.0f, 1e30f, inf, -inf, std::nanf(""),
                 // ties: 1 + 2^-11 rounds down to 1 (even), 1 + 3·2^-11 up to 1 + 2^-9
                 1.0f + 0x1p-11f, 1.0f + 3 * 0x1p-11f, 0x1p-25f, 0x1.8p-24f};
  MemReader reader{&m};
  auto io = make_io();
  auto r = export_hf_model(m.params, kConfigJson, reader.reader(), *io, options_for(tmp.path + "/hf", DType::kF16));
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_EQ(r->overflowed, 3u) << "65520, -70000 and 1e30 became inf; inf stays inf and is not counted";
  auto file = SafetensorsFile::open(tmp.path + "/hf/model.safetensors", io::Env::posix());
  ASSERT_TRUE(file.is_ok());
  std::vector<uint8_t> raw(24);
  ASSERT_TRUE((*file)->read_raw((*file)->tensors()[0], 0, raw).is_ok());
  std::vector<uint16_t> got(12);
  std::memcpy(got.data(), raw.data(), raw.size());
  EXPECT_THAT(std::vector<uint16_t>(got.begin(), got.begin() + 7),
              ElementsAre(0x7BFF, 0x7BFF, 0x7C00, 0xFC00, 0x7C00, 0x7C00, 0xFC00));
  EXPECT_EQ(got[7] & 0x7C00, 0x7C00);
  EXPECT_NE(got[7] & 0x03FF, 0);  // NaN stays NaN
  EXPECT_THAT(std::vector<uint16_t>(got.begin() + 8, got.end()), ElementsAre(0x3C00, 0x3C02, 0x0000, 0x0002));
}

TEST(Export, RejectsBadOptionsBeforeWritingAnything) {
  TempDir tmp("zo_export_test");
  const Model m = small_model();
  MemReader reader{&m};
  auto io = make_io();
  const std::string out = tmp.path + "/hf";
  auto expect_invalid = [&](ExportOptions o, const std::string& config, const std::string& needle) {
    auto r = export_hf_model(m.params, config, reader.reader(), *io, o);
    ASSERT_FALSE(r.is_ok()) << needle;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << r.status().to_string();
    EXPECT_THAT(r.status().message(), HasSubstr(needle));
    EXPECT_FALSE(fs::exists(out)) << needle;
  };
  ExportOptions o = options_for(out, DType::kBF16);
  o.dtype = static_cast<DType>(7);
  expect_invalid(o, kConfigJson, "dtype");
  o = options_for(out, DType::kBF16);
  o.staging_bytes = 512 * kKiB;
  expect_invalid(o, kConfigJson, "staging");
  o.staging_bytes = kMiB + 100;
  expect_invalid(o, kConfigJson, "staging");
  o = options_for(out, DType::kBF16);
  o.shard_bytes = 0;
  expect_invalid(o, kConfigJson, "shard");
  o = options_for("", DType::kBF16);
  expect_invalid(o, kConfigJson, "directory");
  expect_invalid(options_for(out, DType::kBF16), "{not json", "config");
  expect_invalid(options_for(out, DType::kBF16), "[1, 2]", "config");
  std::vector<ParamInfo> dup = m.params;
  dup[2].name = dup[0].name;
  auto r = export_hf_model(dup, kConfigJson, reader.reader(), *io, options_for(out, DType::kBF16));
  ASSERT_FALSE(r.is_ok());
  EXPECT_THAT(r.status().message(), HasSubstr("model.embed_tokens.weight"));
  EXPECT_TRUE(reader.calls.empty()) << "nothing was read";
}

TEST(Export, RefusesANonEmptyDirectoryAndUsesAnEmptyOne) {
  TempDir tmp("zo_export_test");
  const Model m = small_model();
  MemReader reader{&m};
  auto io = make_io();
  const std::string out = tmp.path + "/hf";
  fs::create_directories(out);
  std::ofstream(out + "/keep.txt") << "mine";
  auto r = export_hf_model(m.params, kConfigJson, reader.reader(), *io, options_for(out, DType::kBF16));
  ASSERT_FALSE(r.is_ok());
  EXPECT_EQ(r.status().code(), StatusCode::kAlreadyExists);
  EXPECT_THAT(r.status().message(), HasSubstr(out));
  EXPECT_THAT(files_in(out), ElementsAre("keep.txt"));

  const std::string file = tmp.path + "/a-file";
  std::ofstream(file) << "x";
  r = export_hf_model(m.params, kConfigJson, reader.reader(), *io, options_for(file, DType::kBF16));
  ASSERT_FALSE(r.is_ok());
  EXPECT_EQ(r.status().code(), StatusCode::kAlreadyExists);

  fs::remove(out + "/keep.txt");
  r = export_hf_model(m.params, kConfigJson, reader.reader(), *io, options_for(out, DType::kBF16));
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_THAT(files_in(out), UnorderedElementsAre("model.safetensors", "config.json"));
}

TEST(Export, AFailingReaderLeavesNothingBehind) {
  TempDir tmp("zo_export_test");
  const Model m = small_model();
  auto io = make_io();
  for (const bool existed : {false, true}) {
    for (const uint64_t fail_at : {uint64_t{0}, uint64_t{3}, uint64_t{1000}}) {
      SCOPED_TRACE("existed " + std::to_string(existed) + " fail_at " + std::to_string(fail_at));
      const std::string out = tmp.path + "/hf-" + std::to_string(existed) + "-" + std::to_string(fail_at);
      if (existed) fs::create_directories(out);
      MemReader reader{&m};
      ExportOptions o = options_for(out, DType::kBF16);
      o.shard_bytes = 100'000;  // the embedding in one shard, the rest in another
      if (fail_at == 1000) {
        // Count the calls of a good export, then fail the last one (in the last shard).
        MemReader probe{&m};
        TempDir scratch("zo_export_probe");
        ASSERT_TRUE(
            export_hf_model(m.params, kConfigJson, probe.reader(), *io, options_for(scratch.path + "/x", DType::kBF16))
                .is_ok());
        reader.fail_at = probe.calls.size() - 1;
      } else {
        reader.fail_at = fail_at;
      }
      auto r = export_hf_model(m.params, kConfigJson, reader.reader(), *io, o);
      ASSERT_FALSE(r.is_ok());
      EXPECT_EQ(r.status().code(), StatusCode::kIoError) << r.status().to_string();
      EXPECT_THAT(r.status().message(), HasSubstr("injected read failure"));
      const auto [p, off, n] = reader.calls.back();
      EXPECT_THAT(r.status().message(), HasSubstr(m.params[p].name));
      EXPECT_THAT(r.status().message(), HasSubstr("[" + std::to_string(off) + ", " + std::to_string(off + n) + ")"));
      EXPECT_THAT(r.status().message(), HasSubstr(".safetensors"));
      if (existed) {
        EXPECT_TRUE(fs::is_directory(out));
        EXPECT_TRUE(files_in(out).empty()) << *files_in(out).begin();
      } else {
        EXPECT_FALSE(fs::exists(out));
      }
    }
  }
}

// The file operations of an export (issue 19), failed through io::FaultyEnv: ENOSPC writing the
// index or config.json, a failed rename or directory fsync at the commit. Each is reported naming
// the file, and the directory is left as it was found (removed when the export created it).
TEST(Export, FileOperationFaultsLeaveNothingBehind) {
  TempDir tmp("zo_export_env");
  const Model m = small_model();
  auto io = make_io();
  const std::vector<io::FaultRule> rules = {
      {.kind = io::FaultKind::kNoSpace, .op = io::IoOp::kWrite, .path_contains = "model.safetensors.index.json"},
      {.kind = io::FaultKind::kNoSpace, .op = io::IoOp::kWrite, .path_contains = "config.json"},
      {.kind = io::FaultKind::kEio, .op = io::IoOp::kRename, .path_contains = "-> "},
      // Syncs under the directory: the index and config.json (passed), then the directory.
      {.kind = io::FaultKind::kEio, .op = io::IoOp::kSync, .path_contains = "/hf-", .skip = 2},
  };
  const char* says[] = {"model.safetensors.index.json", "config.json", "renaming", "fsync of directory"};
  for (size_t i = 0; i < rules.size(); ++i) {
    for (const bool existed : {false, true}) {
      SCOPED_TRACE(std::string(says[i]) + (existed ? ", existing directory" : ", new directory"));
      const std::string out = tmp.path + "/hf-" + std::to_string(i) + "-" + std::to_string(existed);
      if (existed) fs::create_directories(out);
      auto faults = std::make_shared<io::FaultInjector>();
      faults->add(rules[i]);
      io::FaultyEnv env(io::Env::posix(), faults);
      MemReader reader{&m};
      ExportOptions o = options_for(out, DType::kBF16);
      o.shard_bytes = 100'000;  // two shards and an index
      o.env = &env;
      auto r = export_hf_model(m.params, kConfigJson, reader.reader(), *io, o);
      ASSERT_FALSE(r.is_ok());
      EXPECT_EQ(faults->injected(), 1u);
      EXPECT_THAT(r.status().message(), HasSubstr(says[i]));
      EXPECT_THAT(r.status().message(), HasSubstr("export"));
      if (existed) {
        EXPECT_TRUE(fs::is_directory(out));
        EXPECT_TRUE(files_in(out).empty()) << *files_in(out).begin();
      } else {
        EXPECT_FALSE(fs::exists(out));
      }
      for (const auto& e : fs::directory_iterator(tmp.path))
        EXPECT_THAT(e.path().filename().string(), ::testing::Not(HasSubstr(".tmp-"))) << "the sibling is removed";
    }
  }
}

// Note [Publishing a directory]: with `replace` an existing export is swapped out whole (what
// cmd_train's end-of-run export does when the same --out runs again); without it, refused.
TEST(Export, ReplaceSwapsAnExistingDirectoryWhole) {
  TempDir tmp("zo_export_replace");
  const Model m = small_model();
  auto io = make_io();
  const std::string out = tmp.path + "/hf";
  MemReader first{&m};
  ASSERT_TRUE(export_hf_model(m.params, kConfigJson, first.reader(), *io, options_for(out, DType::kBF16)).is_ok());
  { std::ofstream(out + "/stale.txt") << "from an earlier run"; }
  MemReader again{&m};
  auto refused = export_hf_model(m.params, kConfigJson, again.reader(), *io, options_for(out, DType::kF32));
  EXPECT_EQ(refused.status().code(), StatusCode::kAlreadyExists);
  ExportOptions o = options_for(out, DType::kF32);
  o.replace = true;
  MemReader third{&m};
  auto r = export_hf_model(m.params, kConfigJson, third.reader(), *io, o);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_FALSE(fs::exists(out + "/stale.txt")) << "the old directory is gone, not merged";
  EXPECT_TRUE(fs::exists(out + "/config.json"));
  EXPECT_THAT(slurp_text(out + "/config.json"), HasSubstr("float32"));
  for (const auto& e : fs::directory_iterator(tmp.path)) EXPECT_EQ(e.path().filename().string(), "hf");
}

// A StateStore whose master lives on the device (HostDevice), in CPU memory or on NVMe.
struct StoreRig {
  TempDir dir{"zo_export_store"};
  Config config;
  ParamRegistry registry;
  MemoryPlan plan;
  std::unique_ptr<gpu::Device> device;
  std::unique_ptr<io::IoEngine> io;
  MemoryAccounting accounting;
  std::unique_ptr<StateStore> store;

  Status init(const std::string& optimizer_device, const Model& m) {
    const std::string json = R"({"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": true},
      "zero_optimization": {"stage": 3, "sub_group_size": 8192,
        "offload_optimizer": {"device": ")" +
                             optimizer_device + R"(", "nvme_path": ")" + dir.path + R"("}}})";
    ConfigDiagnostics diag;
    auto c = parse_config(json, ResolveContext{}, &diag);
    if (!c) return invalid_argument("config: " + (diag.errors.empty() ? "" : diag.errors[0].to_string()));
    config = *c;
    std::vector<ParamSpec> specs;
    for (const ParamInfo& p : m.params) specs.push_back({p.name, p.shape});
    ZO_ASSIGN_OR_RETURN(registry, ParamRegistry::build(specs, config.zero.sub_group_size));
    ZO_ASSIGN_OR_RETURN(plan, plan_memory(config, registry));
    ZO_ASSIGN_OR_RETURN(device, gpu::make_device(gpu::DeviceKind::kHost, uint64_t{256} << 20));
    io = make_io();
    StateStoreOptions so;
    so.optimizer_nvme_path = config.zero.offload_optimizer.nvme_path;
    so.env = io::Env::posix();
    ZO_ASSIGN_OR_RETURN(store, StateStore::create(registry, plan, *device, *io, so, accounting));
    for (uint32_t p = 0; p < m.params.size(); ++p) ZO_RETURN_IF_ERROR(store->init_param(p, 0, m.values[p]));
    return Status::ok();
  }
};

// Packed and split params: "c" spans three sub-groups of 8192 elements, "a"/"b" share one.
Model store_model() {
  Model m;
  m.add("model.a.weight", {37, 53});
  m.add("model.b.bias", {777});
  m.add("model.c.weight", {3, 7000});
  m.add("model.d.scale", {1});
  return m;
}

class ExportStoreTier : public ::testing::TestWithParam<const char*> {};

TEST_P(ExportStoreTier, HoldsTheMasterRounded) {
  const Model m = store_model();
  StoreRig rig;
  ASSERT_TRUE(rig.init(GetParam(), m).is_ok());
  ASSERT_GT(rig.registry.pieces_of_param(2).size(), 1u) << "a split param";
  for (const DType dtype : {DType::kBF16, DType::kF32}) {
    const std::string out = rig.dir.path + "/hf-" + std::string(dtype_name(dtype));
    ExportOptions o = options_for(out, dtype);
    o.shard_bytes = 20'000;
    auto r = export_store(*rig.store, kConfigJson, *rig.io, o);
    ASSERT_TRUE(r.is_ok()) << r.status().to_string();
    auto weights = HfWeights::open(out, io::Env::posix());
    ASSERT_TRUE(weights.is_ok()) << weights.status().to_string();
    for (size_t i = 0; i < m.params.size(); ++i) {
      const SafetensorsFile* file = nullptr;
      ASSERT_NE((*weights)->find(m.params[i].name, &file), nullptr);
      expect_tensor(*file, m.params[i].name, m.params[i].shape, dtype, m.values[i]);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Export, ExportStoreTier, ::testing::Values("none", "cpu", "nvme"),
                         [](const auto& info) { return std::string(info.param) == "none" ? "device" : info.param; });

TEST(ExportStore, RefusesATornStore) {
  const Model m = store_model();
  StoreRig rig;
  ASSERT_TRUE(rig.init("cpu", m).is_ok());
  rig.store->mark_torn("step 3, sub-group 1: injected");
  auto r = export_store(*rig.store, kConfigJson, *rig.io, options_for(rig.dir.path + "/hf", DType::kBF16));
  ASSERT_FALSE(r.is_ok());
  EXPECT_EQ(r.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(r.status().message(), HasSubstr("injected"));
  EXPECT_FALSE(fs::exists(rig.dir.path + "/hf"));
}

void flip_byte(const std::string& path, uint64_t offset, uint8_t to) {
  const int fd = ::open(path.c_str(), O_RDWR);
  ASSERT_GE(fd, 0) << path;
  ASSERT_EQ(::pwrite(fd, &to, 1, static_cast<off_t>(offset)), 1);
  ::close(fd);
}

uint8_t byte_at(const std::string& path, uint64_t offset) {
  uint8_t b = 0;
  const int fd = ::open(path.c_str(), O_RDONLY);
  EXPECT_EQ(::pread(fd, &b, 1, static_cast<off_t>(offset)), 1);
  ::close(fd);
  return b;
}

// A checkpoint of `m` saved from an NVMe store.
struct SavedCheckpoint {
  StoreRig rig;
  std::string path;

  Status save(const Model& m) {
    ZO_RETURN_IF_ERROR(rig.init("nvme", m));
    TrainingState state;
    state.steps_done = 4;
    state.optimizer_steps = 4;
    SaveOptions so;
    so.dir = rig.dir.path + "/ckpt";
    so.staging_bytes = kMiB;
    so.env = io::Env::posix();
    ZO_ASSIGN_OR_RETURN(SaveResult saved, save_checkpoint(*rig.store, state, kConfigJson, so));
    path = saved.path;
    return Status::ok();
  }
};

TEST(ExportCheckpoint, HoldsTheMasterRoundedAndChecksItsChecksums) {
  const Model m = store_model();
  SavedCheckpoint ckpt;
  ASSERT_TRUE(ckpt.save(m).is_ok());
  auto info = open_checkpoint(ckpt.path, io::Env::posix());
  ASSERT_TRUE(info.is_ok()) << info.status().to_string();
  auto io = make_io();
  for (const DType dtype : {DType::kBF16, DType::kF16, DType::kF32}) {
    const std::string out = ckpt.rig.dir.path + "/hf-" + std::string(dtype_name(dtype));
    ExportOptions o = options_for(out, dtype);
    o.shard_bytes = 20'000;
    auto r = export_checkpoint(*info, *io, o);
    ASSERT_TRUE(r.is_ok()) << r.status().to_string();
    EXPECT_EQ(r->overflowed, dtype == DType::kF16 ? expected_overflow(m) : 0u);
    auto weights = HfWeights::open(out, io::Env::posix());
    ASSERT_TRUE(weights.is_ok()) << weights.status().to_string();
    for (size_t i = 0; i < m.params.size(); ++i) {
      const SafetensorsFile* file = nullptr;
      ASSERT_NE((*weights)->find(m.params[i].name, &file), nullptr);
      expect_tensor(*file, m.params[i].name, m.params[i].shape, dtype, m.values[i]);
    }
  }

  // A flipped byte of the data, then of the header's padding (still valid JSON: only the checksum
  // can tell): kCorruption naming the file, and nothing left of the export.
  const std::string master = ckpt.path + "/" + kMasterFile;
  auto file = SafetensorsFile::open(master, io::Env::posix());
  ASSERT_TRUE(file.is_ok());
  const uint64_t data_begin = (*file)->tensors()[0].data_offset_bytes;
  file->reset();
  ASSERT_EQ(byte_at(master, data_begin - 1), ' ') << "the header is padded to the 4 KiB-aligned data";
  for (const auto& [offset, to] :
       {std::pair<uint64_t, int>{data_begin + 4 * 2000 + 1, -1}, std::pair<uint64_t, int>{data_begin - 1, '\t'}}) {
    const uint8_t before = byte_at(master, offset);
    flip_byte(master, offset, to < 0 ? static_cast<uint8_t>(before ^ 0x10) : static_cast<uint8_t>(to));
    const std::string out = ckpt.rig.dir.path + "/hf-corrupt";
    auto r = export_checkpoint(*info, *io, options_for(out, DType::kBF16));
    ASSERT_FALSE(r.is_ok()) << "offset " << offset;
    EXPECT_EQ(r.status().code(), StatusCode::kCorruption) << r.status().to_string();
    EXPECT_THAT(r.status().message(), HasSubstr(kMasterFile));
    EXPECT_FALSE(fs::exists(out)) << "offset " << offset;
    flip_byte(master, offset, before);
  }
  auto r = export_checkpoint(*info, *io, options_for(ckpt.rig.dir.path + "/hf-again", DType::kBF16));
  EXPECT_TRUE(r.is_ok()) << "restored: " << r.status().to_string();
}

// A master larger than one checksum chunk: a flipped byte in the first chunk fails the export
// while it is still reading (before the last tensor), not only at the end.
TEST(ExportCheckpoint, DetectsCorruptionMidWay) {
  Model m;
  m.add("model.big.weight", {5, int64_t{1} << 20});  // 20 MiB of fp32: two checksum chunks
  m.add("model.small.weight", {1000});
  SavedCheckpoint ckpt;
  ASSERT_TRUE(ckpt.save(m).is_ok());
  auto info = open_checkpoint(ckpt.path, io::Env::posix());
  ASSERT_TRUE(info.is_ok()) << info.status().to_string();
  const std::string master = ckpt.path + "/" + kMasterFile;
  flip_byte(master, 8 * kMiB, static_cast<uint8_t>(byte_at(master, 8 * kMiB) ^ 1));
  auto io = make_io();
  const std::string out = ckpt.rig.dir.path + "/hf";
  ExportOptions o = options_for(out, DType::kBF16);
  uint64_t last_done = 0, total = 0;
  o.progress = [&](uint64_t done, uint64_t t) {
    last_done = done;
    total = t;
  };
  auto r = export_checkpoint(*info, *io, o);
  ASSERT_FALSE(r.is_ok());
  EXPECT_EQ(r.status().code(), StatusCode::kCorruption) << r.status().to_string();
  EXPECT_LT(last_done, total - 1000 * 2) << "detected before the last tensor";
  EXPECT_FALSE(fs::exists(out));
}

// The export reads master.safetensors through the Env (issue 19): EIO in the middle of its data is
// reported naming the file and the offset of the failed read, and nothing of the export is left.
TEST(ExportCheckpoint, AReadErrorNamesTheFileAndLeavesNothing) {
  const Model m = store_model();
  SavedCheckpoint ckpt;
  ASSERT_TRUE(ckpt.save(m).is_ok());
  auto info = open_checkpoint(ckpt.path, io::Env::posix());
  ASSERT_TRUE(info.is_ok()) << info.status().to_string();
  const std::string master = ckpt.path + "/" + kMasterFile;
  const uint64_t middle = info->manifest.find(kMasterFile)->size_bytes / 2;
  auto faults = std::make_shared<io::FaultInjector>();
  io::FaultyEnv env(io::Env::posix(), faults);
  auto io = make_io();
  const std::string out = ckpt.rig.dir.path + "/hf-eio";
  ExportOptions o = options_for(out, DType::kBF16);
  o.env = &env;
  // The header is read when the file is opened; this rule waits for the data.
  faults->add({.kind = io::FaultKind::kEio,
               .op = io::IoOp::kRead,
               .path_contains = "/" + std::string(kMasterFile),
               .offset_bytes = middle});
  auto r = export_checkpoint(*info, *io, o);
  ASSERT_FALSE(r.is_ok());
  EXPECT_EQ(faults->injected(), 1u);
  EXPECT_EQ(r.status().code(), StatusCode::kIoError) << r.status().to_string();
  EXPECT_THAT(r.status().message(), HasSubstr("export: reading " + master + " at offset "));
  EXPECT_FALSE(fs::exists(out));
  for (const auto& e : fs::directory_iterator(ckpt.rig.dir.path))
    EXPECT_THAT(e.path().filename().string(), ::testing::Not(HasSubstr(".tmp-"))) << "the sibling is removed";
  ASSERT_TRUE(export_checkpoint(*info, *io, o).is_ok()) << "the rule was used up: the same export succeeds";
}

}  // namespace
}  // namespace zo::engine

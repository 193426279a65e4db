// load_hf_weights against model directories written by the test writer (one file and sharded, mixed
// dtypes): checks before any data moves, chunking that cannot change values, the unused-tensor
// warning; random_init_weights' determinism and statistics.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <numbers>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "engine/model/weights.h"
#include "tests/engine/model/safetensors_test_util.h"

namespace zo::engine {
namespace {

using ::testing::HasSubstr;
using testing::TempDir;

ModelConfig small_config(bool tied = false, bool bias = false) {
  ModelConfig c;
  c.model_type = bias ? "qwen2" : "llama";
  c.vocab_size = 16;
  c.hidden_size = 8;
  c.intermediate_size = 12;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 2;
  c.num_key_value_heads = 1;
  c.head_dim = 4;
  c.tie_word_embeddings = tied;
  c.attention_bias = bias;
  return c;
}

uint64_t elems(const std::vector<int64_t>& shape) {
  uint64_t n = 1;
  for (int64_t d : shape) n *= static_cast<uint64_t>(d);
  return n;
}

// Exactly representable in bf16 and fp16, distinct per param.
float value_of(size_t param, uint64_t i) { return static_cast<float>(param) + 0.25f * static_cast<float>(i % 64); }

struct DirOptions {
  std::string skip;
  std::string reshape;  // this param gets a transposed/odd shape
  std::vector<std::string> extra;
  bool sharded = false;
  std::string prefix;  // stored as prefix + the name less its "model." (a multimodal checkpoint's text model)
};

void write_model_dir(const TempDir& dir, const ModelLayout& layout, const DirOptions& opt = {}) {
  std::vector<testing::TestTensor> shards[2];
  for (size_t p = 0; p < layout.params.size(); ++p) {
    const ParamSpec& spec = layout.params[p];
    if (spec.name == opt.skip) continue;
    std::vector<float> v(elems(spec.shape));
    for (uint64_t i = 0; i < v.size(); ++i) v[i] = value_of(p, i);
    std::vector<int64_t> shape = spec.shape;
    if (spec.name == opt.reshape) shape = {shape.back() + 1};
    if (spec.name == opt.reshape) v.resize(elems(shape));
    const std::string name = opt.prefix.empty() ? spec.name : opt.prefix + spec.name.substr(6);
    testing::TestTensor t = p % 3 == 0   ? testing::f32_tensor(name, shape, v)
                            : p % 3 == 1 ? testing::half_tensor(name, true, shape, v)
                                         : testing::half_tensor(name, false, shape, v);
    shards[opt.sharded ? p % 2 : 0].push_back(std::move(t));
  }
  for (const std::string& name : opt.extra) shards[0].push_back(testing::f32_tensor(name, {2}, {1, 2}));
  if (!opt.sharded) {
    testing::write_safetensors(dir.file("model.safetensors"), shards[0]);
    return;
  }
  std::string index = R"({"metadata": {}, "weight_map": {)";
  for (int s = 0; s < 2; ++s) {
    const std::string file = "model-0000" + std::to_string(s + 1) + "-of-00002.safetensors";
    testing::write_safetensors(dir.file(file), shards[s]);
    for (const testing::TestTensor& t : shards[s]) index += "\"" + t.name + "\": \"" + file + "\",";
  }
  index.back() = '}';
  testing::write_file(dir.file("model.safetensors.index.json"), index + "}");
}

// Everything a sink received, checked to arrive as consecutive chunks of at most `chunk` elements.
struct Collected {
  std::map<uint32_t, std::vector<float>> values;
  std::vector<uint32_t> order;
  uint64_t max_chunk = 0;
};

ParamSink collector(Collected* c) {
  return [c](uint32_t param, uint64_t offset, std::span<const float> values) -> Status {
    std::vector<float>& v = c->values[param];
    EXPECT_EQ(offset, v.size()) << "chunks of param " << param << " not consecutive";
    if (v.empty()) c->order.push_back(param);
    v.insert(v.end(), values.begin(), values.end());
    c->max_chunk = std::max<uint64_t>(c->max_chunk, values.size());
    return Status::ok();
  };
}

TEST(LoadHfWeights, DeliversEveryParamIdenticallyForAnyChunkSize) {
  for (bool sharded : {false, true}) {
    for (bool tied : {false, true}) {
      const ModelLayout layout = model_layout(small_config(tied, /*bias=*/true));
      TempDir dir;
      write_model_dir(dir, layout, {.sharded = sharded});
      Collected whole, chunked;
      ASSERT_TRUE(load_hf_weights(dir.path(), layout, 1 << 20, collector(&whole), io::Env::posix()).is_ok());
      const Status s = load_hf_weights(dir.path(), layout, 5, collector(&chunked), io::Env::posix());
      ASSERT_TRUE(s.is_ok()) << s.to_string();
      EXPECT_EQ(chunked.max_chunk, 5u);
      ASSERT_EQ(whole.values.size(), layout.params.size());
      EXPECT_EQ(whole.values, chunked.values);
      std::vector<uint32_t> expected_order(layout.params.size());
      for (size_t p = 0; p < expected_order.size(); ++p) expected_order[p] = static_cast<uint32_t>(p);
      EXPECT_EQ(chunked.order, expected_order);
      for (size_t p = 0; p < layout.params.size(); ++p) {
        const std::vector<float>& v = whole.values[static_cast<uint32_t>(p)];
        ASSERT_EQ(v.size(), elems(layout.params[p].shape));
        for (uint64_t i = 0; i < v.size(); ++i) ASSERT_EQ(v[i], value_of(p, i)) << layout.params[p].name;
      }
    }
  }
}

TEST(LoadHfWeights, ShapeMismatchNamesTensorShapesAndFile) {
  const ModelLayout layout = model_layout(small_config());
  TempDir dir;
  write_model_dir(dir, layout, {.reshape = "model.layers.1.self_attn.k_proj.weight"});
  int calls = 0;
  const Status s = load_hf_weights(
      dir.path(), layout, 64,
      [&](uint32_t, uint64_t, std::span<const float>) {
        ++calls;
        return Status::ok();
      },
      io::Env::posix());
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("model.layers.1.self_attn.k_proj.weight"));
  EXPECT_THAT(s.message(), HasSubstr("[9]"));
  EXPECT_THAT(s.message(), HasSubstr("[4, 8]"));
  EXPECT_THAT(s.message(), HasSubstr(dir.file("model.safetensors")));
  EXPECT_EQ(calls, 0) << "no data may move before every param is checked";
}

TEST(LoadHfWeights, MissingTensorIsNamed) {
  const ModelLayout layout = model_layout(small_config());
  TempDir dir;
  write_model_dir(dir, layout, {.skip = "model.layers.0.mlp.up_proj.weight"});
  Collected c;
  const Status s = load_hf_weights(dir.path(), layout, 64, collector(&c), io::Env::posix());
  EXPECT_EQ(s.code(), StatusCode::kNotFound);
  EXPECT_THAT(s.message(), HasSubstr("model.layers.0.mlp.up_proj.weight"));
  EXPECT_THAT(s.message(), HasSubstr(dir.path()));
}

TEST(LoadHfWeights, MissingLmHeadWithUntiedConfigSaysSo) {
  const ModelLayout layout = model_layout(small_config(/*tied=*/false));
  TempDir dir;
  write_model_dir(dir, layout, {.skip = "lm_head.weight"});
  Collected c;
  const Status s = load_hf_weights(dir.path(), layout, 64, collector(&c), io::Env::posix());
  EXPECT_EQ(s.code(), StatusCode::kNotFound);
  EXPECT_THAT(s.message(), HasSubstr("lm_head.weight"));
  EXPECT_THAT(s.message(), HasSubstr("tie_word_embeddings"));
  EXPECT_TRUE(c.values.empty());
}

TEST(LoadHfWeights, UnusedTensorsAreOneWarningNotAnError) {
  const ModelLayout layout = model_layout(small_config());
  TempDir dir;
  write_model_dir(
      dir, layout,
      {.extra = {"model.layers.0.self_attn.rotary_emb.inv_freq", "model.layers.1.self_attn.rotary_emb.inv_freq"}});
  Collected c;
  ::testing::internal::CaptureStderr();
  const Status s = load_hf_weights(dir.path(), layout, 64, collector(&c), io::Env::posix());
  const std::string err = ::testing::internal::GetCapturedStderr();
  ASSERT_TRUE(s.is_ok()) << s.to_string();
  EXPECT_EQ(c.values.size(), layout.params.size());
  EXPECT_THAT(err, HasSubstr("model.layers.0.self_attn.rotary_emb.inv_freq"));
  EXPECT_THAT(err, HasSubstr("model.layers.1.self_attn.rotary_emb.inv_freq"));
  EXPECT_EQ(std::count(err.begin(), err.end(), '\n'), 1) << err;
}

// Note [Text weights of a multimodal checkpoint]: a tied text model stored under either prefix of
// multimodal Gemma 3, beside a vision tower, loads as if stored under its own names; the vision
// tensors are the one warning line.
TEST(LoadHfWeights, AMultimodalCheckpointsTextModelLoadsUnderEitherPrefix) {
  const ModelLayout layout = model_layout(small_config(/*tied=*/true));
  for (const std::string prefix : {"language_model.model.", "model.language_model."}) {
    SCOPED_TRACE(prefix);
    TempDir dir;
    write_model_dir(dir, layout, {.extra = {"vision_tower.vision_model.post_layernorm.weight"}, .prefix = prefix});
    Collected c;
    ::testing::internal::CaptureStderr();
    const Status s = load_hf_weights(dir.path(), layout, 64, collector(&c), io::Env::posix());
    const std::string err = ::testing::internal::GetCapturedStderr();
    ASSERT_TRUE(s.is_ok()) << s.to_string();
    ASSERT_EQ(c.values.size(), layout.params.size());
    for (size_t p = 0; p < layout.params.size(); ++p)
      EXPECT_EQ(c.values[static_cast<uint32_t>(p)].front(), value_of(p, 0)) << layout.params[p].name;
    EXPECT_THAT(err, HasSubstr("1 tensor(s) not used by the model, ignored: vision_tower"));
  }
}

// An 8-bit (LLM.int8) directory as transformers saves it: each decoder projection's I8 codes, its
// module's SCB and weight_format. Writes one with every projection 8-bit (code i of row r:
// (37·i + r) mod 255 − 127; SCB[r] = 0.5 + r/64) and the rest fp32. `edit` may change the tensors.
int8_t code_8bit(uint64_t r, uint64_t c) { return static_cast<int8_t>(static_cast<int>((37 * c + r) % 255) - 127); }

void write_8bit_dir(const TempDir& dir, const ModelLayout& layout,
                    const std::function<void(std::vector<testing::TestTensor>&)>& edit = {}) {
  std::vector<testing::TestTensor> tensors;
  for (size_t p = 0; p < layout.params.size(); ++p) {
    const ParamSpec& spec = layout.params[p];
    if (kept_in_16_bits(spec.name, layout.quantization)) {
      std::vector<float> v(elems(spec.shape));
      for (uint64_t i = 0; i < v.size(); ++i) v[i] = value_of(p, i);
      tensors.push_back(testing::f32_tensor(spec.name, spec.shape, v));
      continue;
    }
    const auto rows = static_cast<uint64_t>(spec.shape[0]), cols = static_cast<uint64_t>(spec.shape[1]);
    std::string codes(rows * cols, '\0');
    for (uint64_t r = 0; r < rows; ++r)
      for (uint64_t c = 0; c < cols; ++c) codes[r * cols + c] = static_cast<char>(code_8bit(r, c));
    std::vector<float> scb(rows);
    for (uint64_t r = 0; r < rows; ++r) scb[r] = 0.5f + static_cast<float>(r) / 64.0f;
    const std::string module = spec.name.substr(0, spec.name.size() - 7);  // less ".weight"
    tensors.push_back({spec.name, "I8", spec.shape, codes});
    tensors.push_back(testing::f32_tensor(module + ".SCB", {static_cast<int64_t>(rows)}, scb));
    tensors.push_back({module + ".weight_format", "U8", {}, std::string(1, '\0')});
  }
  if (edit) edit(tensors);
  testing::write_safetensors(dir.file("model.safetensors"), tensors);
}

// The frozen projection that training_layout would pack keeps its codes and SCB as they are stored
// (a blob of kind 2, Note [The packed 4-bit base]); one trained in full reads back as bitsandbytes'
// training path computes it, code × (SCB × 1/127) in fp32; a damaged state is refused by name.
TEST(LoadHfWeights, An8BitBaseIsReadAsStoredAndCheckedByName) {
  ModelConfig c = small_config();
  c.quantization.load_in_8bit = true;
  ModelLayout layout = model_layout(c);
  const std::string q_proj = "model.layers.0.self_attn.q_proj.weight", up = "model.layers.1.mlp.up_proj.weight";
  uint32_t packed_id = 0, full_id = 0;
  for (size_t p = 0; p < layout.params.size(); ++p) {
    ParamSpec& spec = layout.params[p];
    if (spec.name == up) full_id = static_cast<uint32_t>(p);
    if (spec.name != q_proj) continue;
    packed_id = static_cast<uint32_t>(p);
    spec.trainable = false;
    spec.storage_elems =
        bnb4::blob_bytes(bnb4::kBlobInt8, static_cast<uint64_t>(spec.shape[0]), static_cast<uint64_t>(spec.shape[1])) /
        4;
  }
  TempDir dir;
  write_8bit_dir(dir, layout);
  Collected values;
  std::map<uint32_t, std::vector<uint8_t>> blobs;
  const PackedSink packed = [&](uint32_t p, uint64_t off, std::span<const std::byte> bytes) {
    std::vector<uint8_t>& b = blobs[p];
    b.resize(layout.params[p].storage_elems * 4);
    EXPECT_LE(off + bytes.size(), b.size());
    std::memcpy(b.data() + off, bytes.data(), bytes.size());
    return Status::ok();
  };
  const Status st = load_hf_weights(dir.path(), layout, 64, collector(&values), io::Env::posix(), packed);
  ASSERT_TRUE(st.is_ok()) << st.to_string();
  ASSERT_EQ(blobs.size(), 1u);
  const std::vector<uint8_t>& blob = blobs[packed_id];
  bnb4::BlobHeader h;
  ASSERT_TRUE(bnb4::read_blob_header(blob.data(), &h));
  EXPECT_EQ(h.type, bnb4::kBlobInt8);
  EXPECT_EQ(h.rows, static_cast<uint64_t>(layout.params[packed_id].shape[0]));
  EXPECT_EQ(h.cols, static_cast<uint64_t>(layout.params[packed_id].shape[1]));
  EXPECT_EQ(h.bytes(), blob.size());
  for (uint64_t r = 0; r < h.rows; ++r) {
    float scale;
    std::memcpy(&scale, blob.data() + h.scales_offset() + 4 * r, 4);
    EXPECT_EQ(scale, 0.5f + static_cast<float>(r) / 64.0f) << r;
    for (uint64_t col = 0; col < h.cols; ++col)
      ASSERT_EQ(static_cast<int8_t>(blob[bnb4::blob_codes_offset() + r * h.cols + col]), code_8bit(r, col))
          << r << ", " << col;
  }
  EXPECT_FALSE(values.values.contains(packed_id));
  const std::vector<float>& full = values.values.at(full_id);
  const auto cols = static_cast<uint64_t>(layout.params[full_id].shape[1]);
  ASSERT_EQ(full.size(), elems(layout.params[full_id].shape));
  for (uint64_t i = 0; i < full.size(); ++i) {
    const uint64_t r = i / cols;
    const float code = static_cast<float>(code_8bit(r, i % cols));
    EXPECT_EQ(full[i], code * ((0.5f + static_cast<float>(r) / 64.0f) * static_cast<float>(1.0 / 127.0))) << i;
  }

  const std::string module = "model.layers.1.self_attn.k_proj";
  auto refused = [&](const char* what, const std::function<void(std::vector<testing::TestTensor>&)>& edit,
                     const std::string& names, const std::string& says) {
    TempDir bad;
    write_8bit_dir(bad, layout, edit);
    Collected none;
    const Status s = load_hf_weights(bad.path(), layout, 64, collector(&none), io::Env::posix(), packed);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << what << ": " << s.to_string();
    EXPECT_THAT(s.message(), HasSubstr(names)) << what;
    EXPECT_THAT(s.message(), HasSubstr(says)) << what;
    EXPECT_TRUE(none.values.empty()) << what << ": refused before any data moved";
  };
  auto find = [](std::vector<testing::TestTensor>& t, const std::string& name) -> testing::TestTensor& {
    for (testing::TestTensor& x : t)
      if (x.name == name) return x;
    ADD_FAILURE() << "no tensor " << name;
    return t.front();
  };
  refused(
      "no SCB", [&](auto& t) { std::erase_if(t, [&](const auto& x) { return x.name == module + ".SCB"; }); },
      module + ".weight", "has no " + module + ".SCB");
  refused(
      "a short SCB",
      [&](auto& t) {
        testing::TestTensor& scb = find(t, module + ".SCB");
        scb.shape[0] -= 1;
        scb.bytes.resize(scb.bytes.size() - 4);
      },
      module + ".SCB", "fp32 values (one per row)");
  refused(
      "column-major", [&](auto& t) { find(t, module + ".weight_format").bytes[0] = 1; }, module + ".weight_format",
      "row-major");
  refused(
      "fp32 codes beside a SCB",
      [&](auto& t) {
        testing::TestTensor& w = find(t, module + ".weight");
        w = testing::f32_tensor(w.name, w.shape, std::vector<float>(w.bytes.size()));
      },
      module + ".weight", "I8");
  ModelLayout four = layout;
  four.quantization.load_in_8bit = false;
  four.quantization.load_in_4bit = true;
  TempDir as_four;
  write_8bit_dir(as_four, layout);
  Collected none;
  const Status s = load_hf_weights(as_four.path(), four, 64, collector(&none), io::Env::posix(), packed);
  EXPECT_THAT(s.message(), HasSubstr("is bitsandbytes 8-bit, but config.json's quantization_config says 4-bit"));
}

TEST(LoadHfWeights, SinkErrorStopsTheLoad) {
  const ModelLayout layout = model_layout(small_config());
  TempDir dir;
  write_model_dir(dir, layout);
  int calls = 0;
  const Status s = load_hf_weights(
      dir.path(), layout, 8,
      [&](uint32_t, uint64_t, std::span<const float>) {
        return ++calls == 3 ? io_error("tier full", 28) : Status::ok();
      },
      io::Env::posix());
  EXPECT_EQ(s.code(), StatusCode::kIoError);
  EXPECT_EQ(calls, 3);
  Collected c;
  EXPECT_EQ(load_hf_weights(dir.path(), layout, 0, collector(&c), io::Env::posix()).code(),
            StatusCode::kInvalidArgument);
}

TEST(LoadHfWeights, NoWeightsIsNotFound) {
  TempDir dir;
  Collected c;
  EXPECT_EQ(load_hf_weights(dir.path(), model_layout(small_config()), 64, collector(&c), io::Env::posix()).code(),
            StatusCode::kNotFound);
}

Collected init(const ModelConfig& c, uint64_t seed, uint64_t chunk) {
  Collected out;
  const Status s = random_init_weights(c, model_layout(c), seed, chunk, collector(&out));
  EXPECT_TRUE(s.is_ok()) << s.to_string();
  EXPECT_LE(out.max_chunk, chunk);
  return out;
}

// SplitMix64 as Vigna's splitmix64.c runs it: a sequential generator, written here from its
// reference code (and checked against its published outputs below), not from the engine's
// counter-based form.
struct SplitMix64 {
  uint64_t x;
  uint64_t next() {
    uint64_t z = (x += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
};

uint64_t fnv1a64(std::string_view s) {
  uint64_t h = 0xCBF29CE484222325ull;
  for (unsigned char c : s) h = (h ^ c) * 0x100000001B3ull;
  return h;
}

// The published values: SplitMix64 seeded with 1234567 (Rosetta Code, "Pseudo-random
// numbers/Splitmix64"), FNV-1a 64 of "", "a" and "foobar" (the FNV reference values).
TEST(RandomInit, TheReferenceGeneratorsGiveTheirPublishedValues) {
  SplitMix64 g{1234567};
  for (uint64_t want : {6457827717110365317ull, 3203168211198807973ull, 9817491932198370423ull, 4593380528125082431ull,
                        16408922859458223821ull})
    EXPECT_EQ(g.next(), want);
  EXPECT_EQ(fnv1a64(""), 0xCBF29CE484222325ull);
  EXPECT_EQ(fnv1a64("a"), 0xAF63DC4C8601EC8Cull);
  EXPECT_EQ(fnv1a64("foobar"), 0x85944171F73967E8ull);
}

// A param's normal values as random_init_weights documents them (weights.h), drawn in sequence.
std::vector<float> reference_normal(uint64_t seed, const std::string& name, uint64_t n, double std) {
  const uint64_t key = SplitMix64{seed}.next() ^ SplitMix64 { fnv1a64(name) - 0x9E3779B97F4A7C15ull }.next();
  SplitMix64 g{key};
  std::vector<float> out;
  while (out.size() < n) {
    const uint64_t a = g.next(), b = g.next();
    const double u1 = static_cast<double>((a >> 11) + 1) * 0x1.0p-53;
    const double u2 = static_cast<double>(b >> 11) * 0x1.0p-53;
    const double r = std::sqrt(-2.0 * std::log(u1));
    out.push_back(static_cast<float>(r * std::cos(2.0 * std::numbers::pi * u2) * std));
    if (out.size() < n) out.push_back(static_cast<float>(r * std::sin(2.0 * std::numbers::pi * u2) * std));
  }
  return out;
}

TEST(RandomInit, IndependentOfChunkSizeAndDeterministicPerSeed) {
  const ModelConfig c = small_config(false, true);
  const Collected a = init(c, 42, 1 << 20), b = init(c, 42, 7), d = init(c, 42, 1), e = init(c, 43, 7);
  EXPECT_EQ(a.values, b.values);
  EXPECT_EQ(a.values, d.values);
  const ModelLayout layout = model_layout(c);
  ASSERT_EQ(a.values.size(), layout.params.size());
  for (size_t p = 0; p < layout.params.size(); ++p) {
    const std::string& name = layout.params[p].name;
    const std::vector<float>& va = a.values.at(static_cast<uint32_t>(p));
    const std::vector<float>& ve = e.values.at(static_cast<uint32_t>(p));
    ASSERT_EQ(va.size(), elems(layout.params[p].shape));
    if (name.ends_with("norm.weight")) {
      for (float x : va) ASSERT_EQ(x, 1.0f) << name;
    } else if (name.ends_with(".bias")) {
      for (float x : va) ASSERT_EQ(x, 0.0f) << name;
    } else {
      EXPECT_NE(va, ve) << name << ": another seed must give other values";
      EXPECT_EQ(va, reference_normal(42, name, va.size(), c.initializer_range)) << name;
    }
  }
  // Two params of the same shape get different values (the name is part of the key).
  EXPECT_NE(a.values.at(layout.blocks[1].params[7]), a.values.at(layout.blocks[2].params[7]));
}

TEST(RandomInit, LargeChunksSplitOverThreadsGiveTheSameValues) {
  const ModelConfig c = *model_preset("tiny");  // 176k-element MLP weights: filled by several threads
  const Collected big = init(c, 5, 1 << 20), small = init(c, 5, 1000);
  EXPECT_EQ(big.values, small.values);
}

// quantizing_sink (zoffload.quantize_base) splits a large chunk's blocks over threads: the blob is
// the one bnb4::quantize (held to bitsandbytes' quantize_4bit by bnb4bit-bnb) gives the whole tensor
// in one call — for one chunk of the whole tensor (threaded) and for small chunks (not), a partial
// last block included.
TEST(QuantizingSink, ThreadsCannotChangeTheBlob) {
  ModelLayout layout;
  ParamSpec spec;
  spec.name = "model.layers.0.mlp.up_proj.weight";
  spec.shape = {1001, 699};  // 699 699 elements: 10 932 blocks of 64 and a partial one of 51
  spec.trainable = false;
  const uint64_t n = 1001 * 699;
  spec.storage_elems = bnb4::blob_bytes(0, 1001, 699) / 4;
  layout.params = {spec};
  std::vector<float> x(n);
  for (uint64_t i = 0; i < n; ++i) x[i] = std::sin(0.37 * static_cast<double>(i)) * (1.0 + static_cast<double>(i % 97));
  for (const bnb4::QuantType type : {bnb4::QuantType::kNf4, bnb4::QuantType::kFp4}) {
    std::vector<uint8_t> want_codes(bnb4::packed_bytes(n));
    std::vector<float> want_absmax(bnb4::block_count(n, 64));
    bnb4::quantize(x.data(), n, 64, type, want_codes.data(), want_absmax.data());
    for (const uint64_t chunk : {n, uint64_t{64 * 7}}) {
      std::vector<uint8_t> blob(bnb4::blob_bytes(0, 1001, 699), 0xAA);
      ParamSink sink = quantizing_sink(
          layout, type, [](uint32_t, uint64_t, std::span<const float>) { return internal_error("not packed?"); },
          [&](uint32_t, uint64_t off, std::span<const std::byte> bytes) {
            EXPECT_LE(off + bytes.size(), blob.size());
            std::memcpy(blob.data() + off, bytes.data(), bytes.size());
            return Status::ok();
          });
      for (uint64_t off = 0; off < n; off += chunk) {
        const Status st = sink(0, off, std::span<const float>(x.data() + off, std::min(chunk, n - off)));
        ASSERT_TRUE(st.is_ok()) << st.to_string();
      }
      bnb4::BlobHeader h;
      ASSERT_TRUE(bnb4::read_blob_header(blob.data(), &h));
      EXPECT_EQ(h.rows, 1001u);
      EXPECT_EQ(h.cols, 699u);
      EXPECT_EQ(0, std::memcmp(blob.data() + bnb4::blob_codes_offset(), want_codes.data(), want_codes.size()))
          << "chunks of " << chunk;
      EXPECT_EQ(0, std::memcmp(blob.data() + h.scales_offset(), want_absmax.data(), 4 * want_absmax.size()))
          << "chunks of " << chunk;
    }
  }
}

TEST(RandomInit, NormalWithInitializerRange) {
  ModelConfig c = *model_preset("tiny");
  c.initializer_range = 0.02;
  const ModelLayout layout = model_layout(c);
  double sum = 0, sum_sq = 0, n = 0, max_abs = 0;
  const Status s = random_init_weights(c, layout, 7, 4096, [&](uint32_t p, uint64_t, std::span<const float> v) {
    if (layout.params[p].name.ends_with("norm.weight")) return Status::ok();
    for (float x : v) {
      sum += x;
      sum_sq += static_cast<double>(x) * x;
      max_abs = std::max(max_abs, static_cast<double>(std::fabs(x)));
    }
    n += static_cast<double>(v.size());
    return Status::ok();
  });
  ASSERT_TRUE(s.is_ok()) << s.to_string();
  ASSERT_GT(n, 2e6);
  const double mean = sum / n, std = std::sqrt(sum_sq / n - mean * mean);
  EXPECT_NEAR(mean, 0.0, 1e-4);
  EXPECT_NEAR(std, 0.02, 0.02 * 2e-3);
  EXPECT_GT(max_abs, 0.02 * 4.5) << "tails present";
  EXPECT_LT(max_abs, 0.02 * 7);
}

ModelConfig with_lora(ModelConfig c, std::vector<DecoderRole> targets, uint32_t r = 3) {
  c.lora.r = r;
  c.lora.targets = std::move(targets);
  return c;
}

// Note [LoRA adapters]: each A [r, in] uniform in ±1/√in (PEFT's kaiming_uniform_(a=√5)), each B
// zero, the same values from init_lora_adapters and random_init_weights, for any chunk size.
TEST(LoraInit, AUniformInOneOverRootFanInBZeroDeterministic) {
  ModelConfig c = with_lora(*model_preset("tiny"), {DecoderRole::kQ, DecoderRole::kDown}, 16);
  const ModelLayout layout = model_layout(c);
  Collected a, b, other;
  ASSERT_TRUE(init_lora_adapters(layout, 9, 1 << 20, collector(&a)).is_ok());
  ASSERT_TRUE(init_lora_adapters(layout, 9, 1000, collector(&b)).is_ok());
  ASSERT_TRUE(init_lora_adapters(layout, 10, 1 << 20, collector(&other)).is_ok());
  EXPECT_EQ(a.values, b.values);
  const Collected all = init(c, 9, 1 << 20);
  uint32_t n_a = 0, n_b = 0;
  for (const auto& [p, v] : a.values) {
    const ParamSpec& spec = layout.params[p];
    ASSERT_TRUE(is_lora_param(spec.name)) << spec.name;
    EXPECT_EQ(all.values.at(p), v) << spec.name << ": random_init_weights gives adapters the same values";
    if (spec.name.ends_with(".lora_B.weight")) {
      ++n_b;
      for (float x : v) ASSERT_EQ(x, 0.0f) << spec.name;
      continue;
    }
    ++n_a;
    EXPECT_NE(other.values.at(p), v) << spec.name << ": another seed, other values";
    const double bound = 1.0 / std::sqrt(static_cast<double>(spec.shape[1]));
    double sum = 0, sum_sq = 0, max_abs = 0;
    for (float x : v) {
      ASSERT_LE(std::fabs(x), bound) << spec.name;
      sum += x;
      sum_sq += static_cast<double>(x) * x;
      max_abs = std::max(max_abs, static_cast<double>(std::fabs(x)));
    }
    const double n = static_cast<double>(v.size()), mean = sum / n, var = sum_sq / n - mean * mean;
    EXPECT_NEAR(mean, 0.0, 0.02 * bound) << spec.name;
    EXPECT_NEAR(var, bound * bound / 3, 0.05 * bound * bound / 3) << spec.name << ": uniform's variance";
    EXPECT_GT(max_abs, 0.99 * bound) << spec.name;
  }
  EXPECT_EQ(n_a, 2 * c.num_hidden_layers);
  EXPECT_EQ(n_b, 2 * c.num_hidden_layers);
}

// The base loads from its directory without the adapters; the adapters load from a PEFT
// directory, which must hold each of them (and nothing else) in its shape.
TEST(LoraInit, BaseSkipsAdaptersAndPeftDirectoriesAreCheckedBeforeLoading) {
  const ModelConfig base = small_config();
  const ModelConfig c = with_lora(base, {DecoderRole::kQ, DecoderRole::kV});
  const ModelLayout layout = model_layout(c);
  TempDir model_dir;
  write_model_dir(model_dir, model_layout(base));
  Collected loaded;
  Status st = load_hf_weights(model_dir.path(), layout, 5, collector(&loaded), io::Env::posix());
  ASSERT_TRUE(st.is_ok()) << st.to_string();
  EXPECT_EQ(loaded.values.size(), model_layout(base).params.size());
  for (const auto& [p, v] : loaded.values) EXPECT_FALSE(is_lora_param(layout.params[p].name));

  std::vector<testing::TestTensor> adapters;
  std::vector<uint32_t> ids;
  for (uint32_t p = 0; p < layout.params.size(); ++p) {
    if (!is_lora_param(layout.params[p].name)) continue;
    std::vector<float> v(elems(layout.params[p].shape));
    for (uint64_t i = 0; i < v.size(); ++i) v[i] = value_of(p, i);
    adapters.push_back(testing::f32_tensor(kPeftPrefix + layout.params[p].name, layout.params[p].shape, v));
    ids.push_back(p);
  }
  ASSERT_EQ(adapters.size(), 8u);  // A and B of q and v on 2 layers
  TempDir good;
  testing::write_safetensors(good.file(kPeftWeightsFile), adapters);
  Collected peft;
  st = load_peft_adapters(good.path(), layout, 4, collector(&peft), io::Env::posix());
  ASSERT_TRUE(st.is_ok()) << st.to_string();
  ASSERT_EQ(peft.order, ids);
  for (uint32_t p : ids)
    for (uint64_t i = 0; i < peft.values.at(p).size(); ++i) ASSERT_EQ(peft.values.at(p)[i], value_of(p, i));

  Collected none;
  TempDir missing, extra, reshaped, bin_only;
  auto without_last = adapters;
  without_last.pop_back();
  testing::write_safetensors(missing.file(kPeftWeightsFile), without_last);
  st = load_peft_adapters(missing.path(), layout, 4, collector(&none), io::Env::posix());
  EXPECT_EQ(st.code(), StatusCode::kNotFound);
  EXPECT_THAT(st.message(), HasSubstr(adapters.back().name + " [4, 3] is missing from"));  // v: 1 head of 4
  auto more = adapters;
  more.push_back(testing::f32_tensor(std::string(kPeftPrefix) + "model.layers.0.mlp.up_proj.lora_A.weight", {3, 8},
                                     std::vector<float>(24)));
  testing::write_safetensors(extra.file(kPeftWeightsFile), more);
  st = load_peft_adapters(extra.path(), layout, 4, collector(&none), io::Env::posix());
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("mlp.up_proj.lora_A.weight, which this model has no place for"));
  auto wrong = adapters;
  wrong[0] = testing::f32_tensor(wrong[0].name, {2, 8}, std::vector<float>(16));
  testing::write_safetensors(reshaped.file(kPeftWeightsFile), wrong);
  st = load_peft_adapters(reshaped.path(), layout, 4, collector(&none), io::Env::posix());
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("has shape [2, 8]"));
  testing::write_file(bin_only.file("adapter_model.bin"), "pickle");
  st = load_peft_adapters(bin_only.path(), layout, 4, collector(&none), io::Env::posix());
  EXPECT_EQ(st.code(), StatusCode::kNotFound);
  EXPECT_THAT(st.message(), HasSubstr("adapter_model.bin"));
  EXPECT_TRUE(none.values.empty()) << "nothing is delivered before every check passed";
}

}  // namespace
}  // namespace zo::engine

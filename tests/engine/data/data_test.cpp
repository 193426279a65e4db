#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <set>
#include <string>
#include <vector>

#include "engine/data/dataset.h"
#include "engine/data/shuffle.h"
#include "engine/data/token_source.h"

namespace zo::engine {
namespace {

namespace fs = std::filesystem;
using ::testing::ElementsAre;
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;

// A fresh directory per test for the small data files it writes.
class DataFiles : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::path(::testing::TempDir()) /
           ("zo_data_" + std::to_string(::getpid()) + "_" + info->test_suite_name() + "_" + info->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string write(const std::string& name, const void* data, size_t size) {
    const std::string path = (dir_ / name).string();
    std::ofstream out(path, std::ios::binary);
    out.write(static_cast<const char*>(data), static_cast<std::streamsize>(size));
    return path;
  }
  std::string write_text(const std::string& name, const std::string& text) {
    return write(name, text.data(), text.size());
  }
  template <typename T>
  std::string write_tokens(const std::string& name, const std::vector<T>& tokens) {
    return write(name, tokens.data(), tokens.size() * sizeof(T));
  }
  // An llm.c token file: 256 int32 header (magic, version, count), then the tokens.
  template <typename T>
  std::string write_llmc(const std::string& name, const std::vector<T>& tokens, int32_t version,
                         int32_t magic = 20240520, int64_t count = -1) {
    std::vector<int32_t> header(256, 0);
    header[0] = magic;
    header[1] = version;
    header[2] = static_cast<int32_t>(count < 0 ? static_cast<int64_t>(tokens.size()) : count);
    std::string bytes(reinterpret_cast<const char*>(header.data()), header.size() * 4);
    bytes.append(reinterpret_cast<const char*>(tokens.data()), tokens.size() * sizeof(T));
    return write_text(name, bytes);
  }

  fs::path dir_;
};

// What the engine's callers pass: the files are read through the real file system.
SourceOptions source_options() { return {.env = io::Env::posix()}; }

std::unique_ptr<TokenSource> open_ok(const std::string& path, SourceOptions options = source_options()) {
  auto r = open_token_source(path, options);
  EXPECT_TRUE(r) << r.status().to_string();
  return r ? std::move(r).value() : nullptr;
}

std::vector<int32_t> read_all(const TokenSource& s, std::vector<int32_t>* labels = nullptr) {
  std::vector<int32_t> tokens(s.num_tokens());
  if (labels != nullptr) labels->resize(s.num_tokens());
  EXPECT_TRUE(s.read(0, s.num_tokens(), tokens.data(), labels ? labels->data() : nullptr).is_ok());
  return tokens;
}

std::vector<uint16_t> iota16(size_t n) {
  std::vector<uint16_t> v(n);
  std::iota(v.begin(), v.end(), uint16_t{0});
  return v;
}

// ---- sources ----------------------------------------------------------------------------------

TEST_F(DataFiles, LlmcVersion1IsUint16) {
  auto s = open_ok(write_llmc<uint16_t>("v1.bin", {1, 2, 3, 65535, 7}, 1));
  ASSERT_TRUE(s);
  EXPECT_EQ(s->format(), DataFormat::kLlmcBin);
  EXPECT_EQ(s->num_tokens(), 5u);
  std::vector<int32_t> labels;
  EXPECT_THAT(read_all(*s, &labels), ElementsAre(1, 2, 3, 65535, 7));
  EXPECT_THAT(labels, ElementsAre(1, 2, 3, 65535, 7)) << "without labels, the tokens are the labels";
  EXPECT_FALSE(s->has_labels());
  EXPECT_FALSE(s->vocab_size());
}

TEST_F(DataFiles, LlmcVersion2IsUint32) {
  auto s = open_ok(write_llmc<uint32_t>("v2.bin", {100000, 0, 128255}, 2));
  ASSERT_TRUE(s);
  EXPECT_EQ(s->format(), DataFormat::kLlmcBin);
  EXPECT_THAT(read_all(*s), ElementsAre(100000, 0, 128255));
  int32_t one[2];
  ASSERT_TRUE(s->read(1, 2, one, nullptr).is_ok());
  EXPECT_THAT(one, ElementsAre(0, 128255));
}

TEST_F(DataFiles, RawBinIsUint16UnlessToldUint32) {
  const std::string path = write_tokens<uint16_t>("raw.bin", {5, 600, 9, 1});
  auto s16 = open_ok(path);
  ASSERT_TRUE(s16);
  EXPECT_EQ(s16->format(), DataFormat::kRawBin);
  EXPECT_THAT(read_all(*s16), ElementsAre(5, 600, 9, 1));

  auto s32 = open_ok(path, {.format = DataFormat::kAuto, .raw_token_bytes = 4, .env = io::Env::posix()});
  ASSERT_TRUE(s32);
  EXPECT_EQ(s32->num_tokens(), 2u);
  EXPECT_THAT(read_all(*s32), ElementsAre(5 + (600 << 16), 9 + (1 << 16)));
}

TEST_F(DataFiles, RawUint32TokenBeyondInt32IsAnError) {
  auto s = open_ok(write_tokens<uint32_t>("big.bin", {1, 0x80000000u}),
                   {.format = DataFormat::kRawBin, .raw_token_bytes = 4, .env = io::Env::posix()});
  ASSERT_TRUE(s);
  int32_t t[2];
  Status st = s->read(0, 2, t, nullptr);
  EXPECT_EQ(st.code(), StatusCode::kCorruption);
  EXPECT_THAT(st.message(), HasSubstr("big.bin"));
  EXPECT_THAT(st.message(), HasSubstr("index 1"));
}

TEST_F(DataFiles, LlmcHeaderErrorsNameTheFileAndTheMismatch) {
  auto bad_magic = open_token_source(write_llmc<uint16_t>("m.bin", {1, 2}, 1, /*magic=*/12345),
                                     {.format = DataFormat::kLlmcBin, .env = io::Env::posix()});
  ASSERT_FALSE(bad_magic);
  EXPECT_EQ(bad_magic.status().code(), StatusCode::kCorruption);
  EXPECT_THAT(bad_magic.status().message(), HasSubstr("m.bin: bad llm.c magic 12345"));

  auto bad_count =
      open_token_source(write_llmc<uint16_t>("c.bin", {1, 2, 3, 4, 5}, 1, 20240520, /*count=*/10), source_options());
  ASSERT_FALSE(bad_count);
  EXPECT_EQ(bad_count.status().code(), StatusCode::kCorruption);
  EXPECT_THAT(bad_count.status().message(), HasSubstr("c.bin: llm.c header says 10 tokens (20 bytes) but 10 bytes"));

  auto bad_version = open_token_source(write_llmc<uint16_t>("v.bin", {1}, 3), source_options());
  ASSERT_FALSE(bad_version);
  EXPECT_THAT(bad_version.status().message(), HasSubstr("unsupported llm.c version 3"));

  auto short_header = open_token_source(write_tokens<uint16_t>("s.bin", {1, 2}),
                                        {.format = DataFormat::kLlmcBin, .env = io::Env::posix()});
  ASSERT_FALSE(short_header);
  EXPECT_THAT(short_header.status().message(), HasSubstr("shorter than the llm.c header"));
}

// Issue 40: an llm.c file whose magic is wrong was read as raw uint16 under auto, its 1024-byte
// header trained as 512 tokens. Note [llm.c lookalike] in token_source.cpp.
TEST_F(DataFiles, AnLlmcHeaderWithAWrongMagicIsRefusedUnderAuto) {
  const std::string v1 = write_llmc<uint16_t>("wrong.bin", {7, 8, 9, 10, 11}, 1, /*magic=*/12345);
  auto r = open_token_source(v1, source_options());
  ASSERT_FALSE(r);
  EXPECT_EQ(r.status().code(), StatusCode::kCorruption);
  EXPECT_EQ(r.status().message(), v1 + ": looks like an llm.c token file (version 1, 5 tokens) but its magic is 12345, "
                                       "not 20240520: pass --data-format raw to read it as raw uint16 tokens");

  // Version 2 (uint32 tokens), magic zeroed: the count fits the size (1024 + 3 · 4 bytes).
  auto v2 = open_token_source(write_llmc<uint32_t>("zero.bin", {1, 2, 3}, 2, /*magic=*/0), source_options());
  ASSERT_FALSE(v2);
  EXPECT_THAT(v2.status().message(),
              HasSubstr("zero.bin: looks like an llm.c token file (version 2, 3 tokens) but its magic is 0,"));

  // One bit off the magic (20240520 ^ 1) in a file cut short: the count no longer fits, the magic still says llm.c.
  auto cut =
      open_token_source(write_llmc<uint16_t>("cut.bin", {1, 2, 3}, 1, 20240520 ^ 1, /*count=*/1000), source_options());
  ASSERT_FALSE(cut);
  EXPECT_THAT(cut.status().message(),
              HasSubstr("cut.bin: looks like an llm.c token file (version 1, 1000 tokens) but its magic is 20240521,"));

  // Told raw, it is raw: the header's int32s as uint16 pairs (12345, 0, 1, 0, 5, 0, then zeros), then the tokens.
  auto raw = open_ok(v1, {.format = DataFormat::kRawBin, .env = io::Env::posix()});
  ASSERT_TRUE(raw);
  EXPECT_EQ(raw->format(), DataFormat::kRawBin);
  ASSERT_EQ(raw->num_tokens(), 512u + 5u);
  const std::vector<int32_t> tokens = read_all(*raw);
  EXPECT_THAT(std::vector<int32_t>(tokens.begin(), tokens.begin() + 8), ElementsAre(12345, 0, 1, 0, 5, 0, 0, 0));
  EXPECT_THAT(std::vector<int32_t>(tokens.end() - 5, tokens.end()), ElementsAre(7, 8, 9, 10, 11));
}

TEST_F(DataFiles, RawTokensThatOnlyStartLikeAnLlmcHeaderStayRaw) {
  // Tokens 2–5 read as version 1 and 3 tokens, but 600 tokens are 1200 bytes, not 1024 + 3 · 2, and
  // token 0 (5) is far from the magic: a raw file, read as one.
  std::vector<uint16_t> tokens(600, 0);
  tokens[0] = 5;
  tokens[2] = 1;
  tokens[4] = 3;
  tokens[599] = 42;
  auto s = open_ok(write_tokens("small_numbers.bin", tokens));
  ASSERT_TRUE(s);
  EXPECT_EQ(s->format(), DataFormat::kRawBin);
  EXPECT_EQ(s->num_tokens(), 600u);
  EXPECT_EQ(read_all(*s).back(), 42);
  // A version that is not 1 or 2 with a count that fits the size: not llm.c's header either.
  std::vector<uint16_t> other(512 + 4, 0);
  other[2] = 3;
  other[4] = 4;  // 1024 + 4 · 2 bytes: the size llm.c version 1 would need for a count of 4
  auto o = open_ok(write_tokens("version3.bin", other));
  ASSERT_TRUE(o);
  EXPECT_EQ(o->format(), DataFormat::kRawBin);
}

TEST_F(DataFiles, RawFileWithAPartialTokenIsAnError) {
  const char three[3] = {1, 2, 3};
  auto r = open_token_source(write("odd.bin", three, 3), source_options());
  ASSERT_FALSE(r);
  EXPECT_EQ(r.status().code(), StatusCode::kCorruption);
  EXPECT_THAT(r.status().message(), HasSubstr("odd.bin: 3 bytes is not a whole number of 2-byte tokens"));
}

TEST_F(DataFiles, MissingAndEmptyFiles) {
  auto missing = open_token_source((dir_ / "nope.bin").string(), source_options());
  ASSERT_FALSE(missing);
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_THAT(missing.status().message(), HasSubstr("nope.bin"));
  auto missing_jsonl = open_token_source((dir_ / "nope.jsonl").string(), source_options());
  EXPECT_EQ(missing_jsonl.status().code(), StatusCode::kNotFound);
  auto empty = open_token_source(write_text("empty.txt", ""), source_options());
  ASSERT_FALSE(empty);
  EXPECT_THAT(empty.status().message(), HasSubstr("empty.txt: the file is empty"));
}

// The Env is required: options without one are refused, naming the field, before the file is opened.
TEST_F(DataFiles, OptionsWithoutAnEnvAreRefused) {
  auto r = open_token_source(write_text("fine.jsonl", "{\"input_ids\": [1, 2]}\n"), SourceOptions{});
  ASSERT_FALSE(r);
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("SourceOptions::env is null"));
}

TEST_F(DataFiles, JsonlConcatenatesExamplesWithTheirLabels) {
  auto s = open_ok(write_text("ft.jsonl",
                              "{\"input_ids\": [10, 11, 12], \"labels\": [-100, -100, 12]}\n"
                              "\n"
                              "{\"input_ids\": [20, 21]}\n"
                              "{\"input_ids\": [30], \"labels\": [30], \"other\": \"ignored\"}\n"));
  ASSERT_TRUE(s);
  EXPECT_EQ(s->format(), DataFormat::kJsonl);
  EXPECT_TRUE(s->has_labels());
  std::vector<int32_t> labels;
  EXPECT_THAT(read_all(*s, &labels), ElementsAre(10, 11, 12, 20, 21, 30));
  EXPECT_THAT(labels, ElementsAre(-100, -100, 12, 20, 21, 30));
}

TEST_F(DataFiles, JsonlErrorsNameFileAndLine) {
  struct Case {
    std::string third_line;
    std::string message;
  };
  const std::vector<Case> cases = {
      {"{\"input_ids\": [1, 2,", "bad.jsonl:3: not valid JSON"},
      {"[1, 2, 3]", "bad.jsonl:3: expected a JSON object"},
      {"{\"tokens\": [1]}", "bad.jsonl:3: missing \"input_ids\""},
      {"{\"input_ids\": [1, -5]}", "bad.jsonl:3: input_ids[1] = -5 is not a token id"},
      {"{\"input_ids\": [1, 2.5]}", "bad.jsonl:3: input_ids[1] = 2.5"},
      {"{\"input_ids\": \"hello\"}", "bad.jsonl:3: \"input_ids\" must be an array"},
      {"{\"input_ids\": [1, 2], \"labels\": [1]}", "bad.jsonl:3: \"labels\" has 1 entries but \"input_ids\" has 2"},
      {"{\"input_ids\": [1, 2], \"labels\": [1, -7]}",
       "bad.jsonl:3: labels[1] = -7 is not a token id in [0, 2^31) or -100"},
  };
  for (const Case& c : cases) {
    auto r =
        open_token_source(write_text("bad.jsonl", "{\"input_ids\": [1]}\n{\"input_ids\": [2]}\n" + c.third_line + "\n"),
                          source_options());
    ASSERT_FALSE(r) << c.third_line;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(r.status().message(), HasSubstr(c.message)) << c.third_line;
  }
  auto no_tokens = open_token_source(write_text("none.jsonl", "{\"input_ids\": []}\n"), source_options());
  ASSERT_FALSE(no_tokens);
  EXPECT_THAT(no_tokens.status().message(), HasSubstr("none.jsonl: no tokens"));
}

// Issue 19, finding 2: a line nesting 100,000 arrays crashed train (recursion while building the
// error), and at 50,000 it printed a 100 KB error line. Errors quote a short excerpt at most.
TEST_F(DataFiles, DeeplyNestedOrHugeJsonlValuesGiveAShortError) {
  const auto nested = [](size_t depth) { return std::string(depth, '[') + "1" + std::string(depth, ']'); };
  struct Case {
    std::string line;
    std::string message;
  };
  const std::vector<Case> cases = {
      {"{\"input_ids\": " + nested(100'000) + "}", "bad.jsonl:1: nested deeper than 8 levels"},
      {"{\"input_ids\": [" + nested(5) + "]}", "bad.jsonl:1: input_ids[0] = an array is not a token id"},
      {"{\"input_ids\": [{\"a\": " + nested(4) + "}]}", "bad.jsonl:1: input_ids[0] = an object is not a token id"},
      {"{\"input_ids\": [\"" + std::string(1'000'000, 'x') + "\"]}", "(1000002 bytes) is not a token id"},
      {"{\"input_ids\": [1, " + std::string(1'000'000, '7') + "x]}", "bad.jsonl:1: not valid JSON"},
  };
  for (const Case& c : cases) {
    auto r = open_token_source(write_text("bad.jsonl", c.line + "\n"), source_options());
    ASSERT_FALSE(r) << c.message;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(r.status().message(), HasSubstr(c.message));
    EXPECT_LT(r.status().message().size(), 400u) << r.status().message().substr(0, 200);
  }
}

// Issue 19, finding 4: a FIFO given as --data hung the run; it is refused before it is opened.
TEST_F(DataFiles, AFifoIsRefusedNotWaitedOn) {
  const std::string path = (dir_ / "pipe.jsonl").string();
  ASSERT_EQ(::mkfifo(path.c_str(), 0600), 0);
  for (DataFormat format : {DataFormat::kAuto, DataFormat::kJsonl, DataFormat::kText, DataFormat::kRawBin}) {
    auto r = open_token_source(path, {.format = format, .env = io::Env::posix()});
    ASSERT_FALSE(r);
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(r.status().message(), HasSubstr("data file " + path + " is a FIFO (named pipe), not a regular file"));
  }
  auto dir = open_token_source(dir_.string(), source_options());
  ASSERT_FALSE(dir);
  EXPECT_THAT(dir.status().message(), HasSubstr("is a directory, not a regular file"));
}

TEST_F(DataFiles, TextIsByteLevel) {
  auto s = open_ok(write_text("a.txt", "Hi\n\xff"));
  ASSERT_TRUE(s);
  EXPECT_EQ(s->format(), DataFormat::kText);
  EXPECT_EQ(s->vocab_size(), 256u);
  EXPECT_THAT(read_all(*s), ElementsAre('H', 'i', '\n', 255));
  auto other = open_ok(write_text("notes.md", "ab"));
  ASSERT_TRUE(other);
  EXPECT_EQ(other->format(), DataFormat::kText) << "any extension but .bin and .jsonl is text";
}

// Note [Data files are read, not mapped]: a file cut short under an open source (cp over it, >
// into it) is an error naming it at the next read of what it lost; a mapping died of SIGBUS.
TEST_F(DataFiles, AFileCutShortUnderTheSourceIsAnErrorNotACrash) {
  for (const char* name : {"cut.txt", "cut.bin"}) {
    SCOPED_TRACE(name);
    const std::vector<uint16_t> tokens = iota16(3000);
    const std::string path = write_tokens(name, tokens);
    auto s = open_ok(path);
    ASSERT_TRUE(s);
    const uint64_t n = s->num_tokens();
    ASSERT_EQ(::truncate(path.c_str(), 100), 0);
    std::vector<int32_t> out(16);
    EXPECT_TRUE(s->read(0, 16, out.data(), nullptr).is_ok());  // still there
    Status cut = s->read(n - 16, 16, out.data(), nullptr);
    EXPECT_EQ(cut.code(), StatusCode::kCorruption);
    EXPECT_THAT(cut.message(), HasSubstr(path + ": the file is shorter than the 6000 bytes it had when the run opened "
                                                "it: it was changed during the run"));
  }
}

// JSONL is read in chunks (16 MiB; 7 bytes here): a line cut by a chunk's end is joined, blank
// lines and line numbers count on across chunks, the last line needs no newline.
TEST_F(DataFiles, JsonlLinesAcrossReadChunksParseWhole) {
  const std::string text =
      "{\"input_ids\": [10, 11, 12], \"labels\": [-100, 11, 12]}\n\n"
      "{\"input_ids\": [20, 21, 22, 23, 24, 25, 26, 27, 28, 29]}\n"
      "{\"input_ids\": [30]}";
  for (uint64_t chunk : {uint64_t{1}, uint64_t{7}, uint64_t{64}, uint64_t{16} << 20}) {
    SCOPED_TRACE(chunk);
    SourceOptions o = source_options();
    o.jsonl_chunk_bytes = chunk;
    auto s = open_ok(write_text("chunks.jsonl", text), o);
    ASSERT_TRUE(s);
    std::vector<int32_t> labels;
    EXPECT_THAT(read_all(*s, &labels), ElementsAre(10, 11, 12, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30));
    EXPECT_THAT(labels, ElementsAre(-100, 11, 12, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30));
    auto bad = open_token_source(write_text("bad.jsonl", text + "\n{\"input_ids\": [1, -5]}\n"), o);
    ASSERT_FALSE(bad.is_ok());
    EXPECT_THAT(bad.status().message(), HasSubstr("bad.jsonl:5: input_ids[1]"));
  }
}

TEST_F(DataFiles, ExplicitFormatOverridesTheExtension) {
  const std::string path = write_text("looks_like.bin", "abcd");
  auto text = open_ok(path, {.format = DataFormat::kText, .env = io::Env::posix()});
  ASSERT_TRUE(text);
  EXPECT_THAT(read_all(*text), ElementsAre('a', 'b', 'c', 'd'));
  auto jsonl = open_ok(write_text("data.txt", "{\"input_ids\": [4, 5]}\n"),
                       {.format = DataFormat::kJsonl, .env = io::Env::posix()});
  ASSERT_TRUE(jsonl);
  EXPECT_THAT(read_all(*jsonl), ElementsAre(4, 5));
}

TEST(DataFormat, ParsesItsNames) {
  for (DataFormat f :
       {DataFormat::kAuto, DataFormat::kLlmcBin, DataFormat::kRawBin, DataFormat::kJsonl, DataFormat::kText})
    EXPECT_EQ(parse_data_format(to_string(f)).value(), f);
  EXPECT_THAT(parse_data_format("csv").status().message(), HasSubstr("auto, llmc, raw, jsonl, text"));
}

// ---- shuffle ----------------------------------------------------------------------------------

TEST(Shuffle, SplitMix64MatchesTheReferenceSequence) {
  // Vigna's splitmix64.c seeded with 1234567.
  SplitMix64 rng(1234567);
  EXPECT_EQ(rng.next(), 6457827717110365317ull);
  EXPECT_EQ(rng.next(), 3203168211198807973ull);
  EXPECT_EQ(rng.next(), 9817491932198370423ull);
}

TEST(Shuffle, EpochPermutationIsPinned) {
  // From an independent Python implementation of Note [Epoch shuffle] (splitmix64 + Lemire).
  EXPECT_THAT(epoch_permutation(10, 42, 0), ElementsAre(2, 3, 6, 4, 7, 9, 0, 8, 1, 5));
  EXPECT_THAT(epoch_permutation(10, 42, 1), ElementsAre(6, 5, 2, 0, 4, 7, 8, 9, 3, 1));
  EXPECT_THAT(epoch_permutation(10, 7, 0), ElementsAre(0, 8, 9, 4, 1, 3, 6, 7, 2, 5));
}

TEST(Shuffle, BoundedDrawsStayInRange) {
  SplitMix64 rng(99);
  for (uint64_t bound : {1ull, 2ull, 3ull, 1000ull, (1ull << 63) + 1})
    for (int i = 0; i < 1000; ++i) EXPECT_LT(rng.below(bound), bound);
}

// ---- packing, order, position, ranks ----------------------------------------------------------

DataOptions options(const std::string& path, uint64_t seq_len, uint64_t micro_batch, uint64_t seed = 1,
                    bool shuffle = true, uint64_t rank = 0, uint64_t world = 1) {
  DataOptions o;
  o.path = path;
  o.source = source_options();
  o.seq_len = seq_len;
  o.micro_batch = micro_batch;
  o.seed = seed;
  o.shuffle = shuffle;
  o.rank = rank;
  o.world_size = world;
  return o;
}

std::unique_ptr<Dataset> open_dataset(const DataOptions& o) {
  auto r = Dataset::open(o);
  EXPECT_TRUE(r) << r.status().to_string();
  return r ? std::move(r).value() : nullptr;
}

Batch next(Dataset& d) {
  Batch b;
  EXPECT_TRUE(d.next_batch(&b).is_ok());
  return b;
}

TEST_F(DataFiles, WindowsShiftTargetsByOneAndDropTheTail) {
  // 23 tokens, seq_len 4: windows start every 4 tokens and take 5, so (23 − 1)/4 = 5 windows;
  // tokens 21 and 22 cannot fill another window and are never read.
  auto d = open_dataset(options(write_tokens("t.bin", iota16(23)), 4, 1, 0, /*shuffle=*/false));
  ASSERT_TRUE(d);
  EXPECT_EQ(d->num_windows(), 5u);
  EXPECT_EQ(d->batches_per_epoch(), 5u);
  for (int32_t w = 0; w < 5; ++w) {
    Batch b = next(*d);
    EXPECT_EQ(b.batch, 1u);
    EXPECT_EQ(b.seq_len, 4u);
    EXPECT_THAT(b.windows, ElementsAre(w));
    EXPECT_THAT(b.inputs, ElementsAre(4 * w, 4 * w + 1, 4 * w + 2, 4 * w + 3));
    EXPECT_THAT(b.targets, ElementsAre(4 * w + 1, 4 * w + 2, 4 * w + 3, 4 * w + 4));
  }
  EXPECT_EQ(next(*d).position, (DataPosition{1, 0})) << "then the next epoch starts";
}

TEST_F(DataFiles, BatchesAreRowMajor) {
  auto d = open_dataset(options(write_tokens("t.bin", iota16(13)), 3, 2, 0, false));
  ASSERT_TRUE(d);
  Batch b = next(*d);
  EXPECT_THAT(b.windows, ElementsAre(0, 1));
  EXPECT_THAT(b.inputs, ElementsAre(0, 1, 2, 3, 4, 5));
  EXPECT_THAT(b.targets, ElementsAre(1, 2, 3, 4, 5, 6));
}

TEST_F(DataFiles, JsonlLabelsMaskTargets) {
  // Stream: tokens 10 11 12 13 | 20 21 22 ; labels -100 -100 12 13 | 20 -100 22.
  auto d = open_dataset(options(write_text("ft.jsonl",
                                           "{\"input_ids\": [10, 11, 12, 13], \"labels\": [-100, -100, 12, 13]}\n"
                                           "{\"input_ids\": [20, 21, 22], \"labels\": [20, -100, 22]}\n"),
                                3, 1, 0, false));
  ASSERT_TRUE(d);
  EXPECT_EQ(d->num_windows(), 2u);
  Batch a = next(*d);
  EXPECT_THAT(a.inputs, ElementsAre(10, 11, 12));
  EXPECT_THAT(a.targets, ElementsAre(-100, 12, 13));
  Batch b = next(*d);
  EXPECT_THAT(b.inputs, ElementsAre(13, 20, 21));
  EXPECT_THAT(b.targets, ElementsAre(20, -100, 22)) << "the label of 20 crosses the example boundary unmasked";
}

// Issue 40: a JSONL file whose every label is -100 trained with loss 0 and no warning.
// Note [Nothing to train on] in dataset.cpp.
TEST_F(DataFiles, AllMaskedLabelsAreRefusedAtOpen) {
  const std::string masked = "{\"input_ids\": [1, 2, 3, 4, 5], \"labels\": [-100, -100, -100, -100, -100]}\n";
  const std::string all = write_text("all.jsonl", masked + masked);
  auto r = Dataset::open(options(all, 2, 1));
  ASSERT_FALSE(r);
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(r.status().message(), all + ": every label is -100 (masked): there is nothing to train on");

  // 9 tokens, seq_len 4: 2 windows with targets at tokens 1–8. A label only at token 0 is never a target.
  const std::string first = write_text("first.jsonl",
                                       "{\"input_ids\": [1, 2, 3, 4, 5, 6, 7, 8, 9], \"labels\": [1, -100, -100, -100, "
                                       "-100, -100, -100, -100, -100]}\n");
  auto f = Dataset::open(options(first, 4, 1));
  ASSERT_FALSE(f);
  EXPECT_EQ(f.status().message(), first +
                                      ": every target of its 2 windows of seq_len 4 is -100 (masked); its other "
                                      "labels are at token 0, which is never a target: there is nothing to train on");
  // 11 tokens, seq_len 4: still 2 windows (targets 1–8); the labels of the second example, tokens
  // 9 and 10, fill no window.
  const std::string tail = write_text("tail.jsonl",
                                      "{\"input_ids\": [1, 2, 3, 4, 5, 6, 7, 8, 9], \"labels\": [-100, -100, -100, "
                                      "-100, -100, -100, -100, -100, -100]}\n"
                                      "{\"input_ids\": [10, 11]}\n");
  auto t = Dataset::open(options(tail, 4, 1));
  ASSERT_FALSE(t);
  EXPECT_THAT(t.status().message(), HasSubstr("its other labels are in the last 2 tokens, which fill no window"));

  // One real label among the targets is enough, and the batch that holds it trains on it.
  const std::string one = write_text("one.jsonl",
                                     "{\"input_ids\": [1, 2, 3, 4, 5, 6, 7, 8, 9], \"labels\": [-100, -100, -100, "
                                     "-100, -100, 6, -100, -100, -100]}\n");
  auto d = open_dataset(options(one, 4, 1, 0, /*shuffle=*/false));
  ASSERT_TRUE(d);
  EXPECT_THAT(next(*d).targets, ElementsAre(-100, -100, -100, -100));
  EXPECT_THAT(next(*d).targets, ElementsAre(6, -100, -100, -100)) << "window 1: targets are tokens 5–8";
  // The source itself still opens: it is the data set that has nothing to train on.
  EXPECT_TRUE(open_token_source(all, source_options()).is_ok());
}

TEST_F(DataFiles, TooLittleDataSaysHowMuchIsNeeded) {
  auto r = Dataset::open(options(write_text("small.txt", std::string(40, 'x')), 16, 2, 0, true, 0, 2));
  ASSERT_FALSE(r);
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(),
              HasSubstr("small.txt: too little data: 40 tokens (text) make 2 windows of seq_len 16"));
  EXPECT_THAT(r.status().message(), HasSubstr("needs 4 windows, i.e. at least 65 tokens"));
  EXPECT_THAT(Dataset::open(options(write_text("one.txt", "x"), 1, 1)).status().message(), HasSubstr("make 0 windows"));
}

TEST_F(DataFiles, BadOptionsAreRejected) {
  const std::string path = write_text("a.txt", std::string(100, 'a'));
  EXPECT_THAT(Dataset::open(options(path, 0, 1)).status().message(), HasSubstr("seq_len"));
  EXPECT_THAT(Dataset::open(options(path, 4, 0)).status().message(), HasSubstr("micro_batch"));
  EXPECT_THAT(Dataset::open(options(path, 4, 1, 0, true, 2, 2)).status().message(), HasSubstr("rank 2"));
}

std::vector<uint64_t> epoch_windows(Dataset& d, uint64_t batches) {
  std::vector<uint64_t> windows;
  for (uint64_t i = 0; i < batches; ++i) {
    Batch b = next(d);
    windows.insert(windows.end(), b.windows.begin(), b.windows.end());
  }
  return windows;
}

TEST_F(DataFiles, ShuffleIsDeterministicAndCoversEveryWindowOncePerEpoch) {
  const std::string path = write_tokens("t.bin", iota16(8 * 24 + 1));  // 24 windows of 8
  auto a = open_dataset(options(path, 8, 3, /*seed=*/5));
  auto b = open_dataset(options(path, 8, 3, /*seed=*/5));
  auto c = open_dataset(options(path, 8, 3, /*seed=*/6));
  ASSERT_TRUE(a && b && c);
  ASSERT_EQ(a->batches_per_epoch(), 8u);
  const auto a0 = epoch_windows(*a, 8), a1 = epoch_windows(*a, 8);
  const auto b0 = epoch_windows(*b, 8), c0 = epoch_windows(*c, 8);
  EXPECT_EQ(a0, b0) << "same seed, same order";
  EXPECT_NE(a0, c0) << "another seed, another order";
  EXPECT_NE(a0, a1) << "each epoch has its own order";
  std::vector<uint64_t> all(24);
  std::iota(all.begin(), all.end(), uint64_t{0});
  for (const auto* epoch : {&a0, &a1, &c0}) {
    std::vector<uint64_t> sorted = *epoch;
    std::sort(sorted.begin(), sorted.end());
    EXPECT_EQ(sorted, all);
  }
  EXPECT_EQ(a0, std::vector<uint64_t>(epoch_permutation(24, 5, 0)));
}

TEST_F(DataFiles, BatchContentsFollowTheirWindows) {
  auto d = open_dataset(options(write_tokens("t.bin", iota16(8 * 24 + 1)), 8, 2, 3));
  ASSERT_TRUE(d);
  for (int i = 0; i < 30; ++i) {
    Batch b = next(*d);
    for (uint64_t row = 0; row < 2; ++row)
      for (uint64_t j = 0; j < 8; ++j) {
        EXPECT_EQ(b.inputs[row * 8 + j], static_cast<int32_t>(b.windows[row] * 8 + j));
        EXPECT_EQ(b.targets[row * 8 + j], static_cast<int32_t>(b.windows[row] * 8 + j + 1));
      }
  }
}

TEST_F(DataFiles, RestoredPositionContinuesExactly) {
  const std::string path = write_tokens("t.bin", iota16(4 * 10 + 1));  // 10 windows, 5 batches of 2
  auto a = open_dataset(options(path, 4, 2, 11));
  ASSERT_TRUE(a);
  for (int i = 0; i < 4; ++i) next(*a);
  const DataPosition saved = a->position();
  EXPECT_EQ(saved, (DataPosition{0, 4}));
  std::vector<Batch> expected;
  for (int i = 0; i < 8; ++i) expected.push_back(next(*a));  // runs into epochs 1 and 2

  auto b = open_dataset(options(path, 4, 2, 11));
  ASSERT_TRUE(b);
  ASSERT_TRUE(b->set_position(saved).is_ok());
  for (const Batch& e : expected) {
    Batch got = next(*b);
    EXPECT_EQ(got.position, e.position);
    EXPECT_EQ(got.windows, e.windows);
    EXPECT_EQ(got.inputs, e.inputs);
    EXPECT_EQ(got.targets, e.targets);
  }
  EXPECT_EQ(b->position(), a->position());

  Status bad = b->set_position({3, 6});
  EXPECT_EQ(bad.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.message(), HasSubstr("batch index 6 of epoch 3 is past the 5 batches"));
  EXPECT_TRUE(b->set_position({3, 5}).is_ok()) << "the end of an epoch is a valid position";
  EXPECT_EQ(next(*b).position, (DataPosition{4, 0}));
}

TEST_F(DataFiles, RanksSplitEachEpochDisjointlyAndCompletely) {
  const std::string path = write_tokens("t.bin", iota16(4 * 36 + 1));  // 36 windows, 12 batches of 3
  constexpr uint64_t kWorld = 3;
  std::vector<std::unique_ptr<Dataset>> ranks;
  for (uint64_t r = 0; r < kWorld; ++r) ranks.push_back(open_dataset(options(path, 4, 3, 9, true, r, kWorld)));
  for (const auto& d : ranks) ASSERT_TRUE(d);
  auto single = open_dataset(options(path, 4, 3, 9));
  ASSERT_TRUE(single);
  ASSERT_EQ(ranks[0]->steps_per_epoch(), 4u);

  for (uint64_t epoch = 0; epoch < 2; ++epoch) {
    std::vector<uint64_t> seen;
    for (uint64_t step = 0; step < 4; ++step) {
      for (uint64_t r = 0; r < kWorld; ++r) {
        Batch b = next(*ranks[r]);
        EXPECT_EQ(b.position, (DataPosition{epoch, step * kWorld})) << "every rank is at the same position";
        // Rank r reads global batch step·world + r: the one a single process reads at that point.
        EXPECT_EQ(b.windows, next(*single).windows) << "epoch " << epoch << " step " << step << " rank " << r;
        seen.insert(seen.end(), b.windows.begin(), b.windows.end());
      }
    }
    std::set<uint64_t> distinct(seen.begin(), seen.end());
    EXPECT_EQ(distinct.size(), seen.size()) << "no window twice in an epoch";
    EXPECT_EQ(distinct.size(), 36u) << "every window once";
  }
}

TEST_F(DataFiles, RanksDropTheLastIncompleteRound) {
  // 7 batches per epoch on 2 ranks: 3 steps each, global batch 6 is skipped, and both roll over together.
  const std::string path = write_tokens("t.bin", iota16(2 * 7 + 1));
  auto r0 = open_dataset(options(path, 2, 1, 4, true, 0, 2));
  auto r1 = open_dataset(options(path, 2, 1, 4, true, 1, 2));
  ASSERT_TRUE(r0 && r1);
  EXPECT_EQ(r0->steps_per_epoch(), 3u);
  for (int i = 0; i < 3; ++i) {
    next(*r0);
    next(*r1);
  }
  EXPECT_EQ(next(*r0).position, (DataPosition{1, 0}));
  EXPECT_EQ(next(*r1).position, (DataPosition{1, 0}));
}

TEST(DemoCorpus, IsPlainTextLongEnoughForTheDemo) {
  const char* root = std::getenv("ZO_SOURCE_DIR");
  const std::string path = std::string(root ? root : ".") + "/configs/data/demo_corpus.txt";
  auto s = open_token_source(path, source_options());
  ASSERT_TRUE(s) << s.status().to_string();
  EXPECT_EQ((*s)->format(), DataFormat::kText);
  EXPECT_GE((*s)->num_tokens(), 30'000u);
  std::vector<int32_t> tokens((*s)->num_tokens());
  ASSERT_TRUE((*s)->read(0, tokens.size(), tokens.data(), nullptr).is_ok());
  for (size_t i = 0; i < tokens.size(); ++i)
    ASSERT_TRUE(tokens[i] == '\n' || (tokens[i] >= 32 && tokens[i] < 127)) << "byte " << i << " is " << tokens[i];
}

}  // namespace
}  // namespace zo::engine

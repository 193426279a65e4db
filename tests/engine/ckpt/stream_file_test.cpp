// StreamWriter and ChunkVerifier over real files: any sequence of spans and appends lands in the
// file byte for byte with its exact size and per-chunk CRC-32C, aligned spans stay aligned, an
// existing file is refused, injected open and write errors surface with the path, and the verifier
// names the chunk a flipped byte is in. RangeWriters filling adjacent unaligned ranges of one file from
// several threads give the same bytes and, combined, the same digest as one StreamWriter, touch no
// byte outside their ranges, and read_stream_range reads and checks only the chunks it needs.
#include "engine/ckpt/stream_file.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "common/aligned_buffer.h"
#include "common/crc32c.h"
#include "io/env.h"
#include "io/fault_injector.h"
#include "tests/engine/temp_dir.h"

namespace zo::engine {
namespace {

using ::testing::HasSubstr;

std::vector<std::byte> read_all(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::string s((std::istreambuf_iterator<char>(in)), {});
  std::vector<std::byte> out(s.size());
  if (!s.empty()) std::memcpy(out.data(), s.data(), s.size());  // an empty vector's data() may be null
  return out;
}

TEST(StreamWriter, WritesExactBytesSizeAndChunkCrcs) {
  TempDir dir;
  auto io = io::IoEngine::create(io::IoOptions{});
  ASSERT_TRUE(io.is_ok());
  auto staging = AlignedBuffer::allocate(64 * 4096);
  ASSERT_TRUE(staging.is_ok());
  std::mt19937 rng(1);
  // Sizes around slot (64 KiB), block and chunk boundaries; 33 MiB crosses two 16 MiB chunks.
  for (uint64_t size :
       {uint64_t{0}, uint64_t{1}, uint64_t{4095}, uint64_t{65536}, uint64_t{65537}, uint64_t{33} << 20 | 12345}) {
    SCOPED_TRACE(size);
    std::vector<std::byte> data(size);
    for (auto& b : data) b = static_cast<std::byte>(rng());
    const std::string path = dir.path + "/f" + std::to_string(size);
    auto w = StreamWriter::create(**io, path, staging->bytes(), io::Env::posix(), 4);
    ASSERT_TRUE(w.is_ok()) << w.status().to_string();
    uint64_t off = 0;
    bool use_span = false;
    while (off < size) {
      const uint64_t want = std::min<uint64_t>(size - off, 1 + rng() % 100000);
      if (use_span) {
        auto span = (*w)->next_span(want);
        ASSERT_TRUE(span.is_ok());
        if ((*w)->position() % 4096 == 0) { EXPECT_EQ(reinterpret_cast<uintptr_t>(span->data()) % 4096, 0u); }
        std::memcpy(span->data(), data.data() + off, span->size());
        ASSERT_TRUE((*w)->commit(span->size()).is_ok());
        off += span->size();
      } else {
        ASSERT_TRUE((*w)->append({data.data() + off, want}).is_ok());
        off += want;
      }
      use_span = !use_span;
    }
    auto digest = (*w)->finish();
    ASSERT_TRUE(digest.is_ok()) << digest.status().to_string();
    EXPECT_EQ(digest->size_bytes, size);
    EXPECT_EQ(digest->name, "f" + std::to_string(size));
    EXPECT_TRUE(read_all(path) == data);
    ASSERT_EQ(digest->chunk_crc32c.size(), (size + kChecksumChunkBytes - 1) / kChecksumChunkBytes);
    for (size_t c = 0; c < digest->chunk_crc32c.size(); ++c) {
      const uint64_t a = c * kChecksumChunkBytes, n = std::min(kChecksumChunkBytes, size - a);
      EXPECT_EQ(digest->chunk_crc32c[c], crc32c(data.data() + a, n));
    }
    // The verifier accepts the bytes fed in any pieces, and locates a flipped byte.
    ChunkVerifier ok(*digest, path);
    for (uint64_t a = 0; a < size; a += 7777)
      ASSERT_TRUE(ok.update({data.data() + a, std::min<uint64_t>(7777, size - a)}).is_ok());
    EXPECT_TRUE(ok.finish().is_ok());
    if (size > 0) {
      data[size - 1] ^= std::byte{1};
      ChunkVerifier bad(*digest, path);
      Status s = bad.update(data);
      EXPECT_EQ(s.code(), StatusCode::kCorruption);
      EXPECT_THAT(s.message(), HasSubstr("chunk " + std::to_string((size - 1) / kChecksumChunkBytes)));
      ChunkVerifier short_read(*digest, path);
      ASSERT_TRUE(short_read.update({data.data(), size / 2}).is_ok());
      EXPECT_EQ(short_read.finish().code(), StatusCode::kCorruption);
    }
  }
}

TEST(StreamWriter, RefusesAnExistingFileAndBadStaging) {
  TempDir dir;
  auto io = io::IoEngine::create(io::IoOptions{});
  auto staging = AlignedBuffer::allocate(8 * 4096);
  std::ofstream(dir.path + "/x") << "keep me";
  auto w = StreamWriter::create(**io, dir.path + "/x", staging->bytes(), io::Env::posix(), 4);
  EXPECT_EQ(w.status().code(), StatusCode::kAlreadyExists);
  EXPECT_EQ(read_all(dir.path + "/x").size(), 7u);
  EXPECT_EQ(StreamWriter::create(**io, dir.path + "/y", staging->bytes().first(3 * 4096), io::Env::posix(), 4)
                .status()
                .code(),
            StatusCode::kInvalidArgument);
}

TEST(StreamWriter, AWriteErrorSurfacesWithThePath) {
  TempDir dir;
  auto faults = std::make_shared<io::FaultInjector>();
  auto io = io::IoEngine::create(io::IoOptions{}, faults);
  auto staging = AlignedBuffer::allocate(16 * 4096);
  faults->add(
      {.kind = io::FaultKind::kNoSpace, .op = io::IoOp::kWrite, .path_contains = "victim", .offset_bytes = 20000});
  auto w = StreamWriter::create(**io, dir.path + "/victim", staging->bytes(), io::Env::posix(), 4);
  ASSERT_TRUE(w.is_ok());
  std::vector<std::byte> data(200000, std::byte{7});
  Status s = (*w)->append(data);
  Result<FileDigest> d = s.is_ok() ? (*w)->finish() : Result<FileDigest>(s);
  ASSERT_FALSE(d.is_ok());
  EXPECT_EQ(d.status().code(), StatusCode::kNoSpace);
  EXPECT_THAT(d.status().to_string(), HasSubstr("victim"));
}

// Writes `data` (the file's bytes [w.begin, w.begin + data.size())) through `w` in random pieces,
// alternating append, next_span/commit and reserve/commit_reserved.
template <typename Writer>
Status write_in_pieces(Writer& w, std::span<const std::byte> data, uint64_t begin_bytes, uint32_t seed) {
  std::mt19937 rng(seed);
  uint64_t off = 0;
  int mode = 0;
  while (off < data.size()) {
    const uint64_t want = std::min<uint64_t>(data.size() - off, 1 + rng() % 30000);
    if (mode == 0) {
      ZO_RETURN_IF_ERROR(w.append(data.subspan(off, want)));
      off += want;
    } else if (mode == 1) {
      ZO_ASSIGN_OR_RETURN(std::span<std::byte> span, w.next_span(want));
      if ((begin_bytes + w.position()) % 4096 == 0 && reinterpret_cast<uintptr_t>(span.data()) % 4096 != 0) {
        return Status(StatusCode::kInternal, "a span at an aligned file offset is not aligned");
      }
      std::memcpy(span.data(), data.data() + off, span.size());
      ZO_RETURN_IF_ERROR(w.commit(span.size()));
      off += span.size();
    } else {
      // Two reservations in flight, committed oldest first.
      std::vector<std::span<std::byte>> spans;
      uint64_t at = off;
      for (int k = 0; k < 2 && at < data.size(); ++k) {
        ZO_ASSIGN_OR_RETURN(std::span<std::byte> span, w.reserve(std::min<uint64_t>(data.size() - at, want)));
        std::memcpy(span.data(), data.data() + at, span.size());
        at += span.size();
        spans.push_back(span);
      }
      if (w.reserved() != spans.size()) return Status(StatusCode::kInternal, "reserved() is off");
      for (size_t k = 0; k < spans.size(); ++k) ZO_RETURN_IF_ERROR(w.commit_reserved());
      off = at;
    }
    if (w.position() != off) return Status(StatusCode::kInternal, "position() is not the bytes committed");
    mode = (mode + 1) % 3;
  }
  return Status::ok();
}

std::vector<std::byte> random_bytes(uint64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<std::byte> data(n);
  for (auto& b : data) b = static_cast<std::byte>(rng());
  return data;
}

// The digest a StreamWriter gives for `data`, written to `path`.
FileDigest stream_digest(const std::string& path, std::span<const std::byte> data) {
  auto io = io::IoEngine::create(io::IoOptions{});
  ZO_CHECK(io.is_ok());
  auto staging = AlignedBuffer::allocate(64 * 4096);
  ZO_CHECK(staging.is_ok());
  auto w = StreamWriter::create(**io, path, staging->bytes(), io::Env::posix(), 4);
  ZO_CHECK(w.is_ok()) << w.status().to_string();
  ZO_CHECK((*w)->append(data).is_ok());
  auto d = (*w)->finish();
  ZO_CHECK(d.is_ok()) << d.status().to_string();
  return *d;
}

// Writes `data` into a file of its size with one RangeWriter per [cuts[i], cuts[i+1]), each on its
// own thread with its own engine and a small staging buffer; returns their digests in order.
std::vector<RangeDigest> write_ranges_concurrently(const std::string& path, const std::vector<std::byte>& data,
                                                   const std::vector<uint64_t>& cuts) {
  const size_t n = cuts.size() - 1;
  std::vector<Result<RangeDigest>> results(n, Result<RangeDigest>(Status(StatusCode::kInternal, "not run")));
  std::vector<std::thread> threads;
  for (size_t i = 0; i < n; ++i) {
    threads.emplace_back([&, i] {
      auto io = io::IoEngine::create(io::IoOptions{});
      auto staging = AlignedBuffer::allocate(16 * 4096);
      if (!io.is_ok() || !staging.is_ok()) return;
      auto w = RangeWriter::create(**io, path, cuts[i], cuts[i + 1], staging->bytes(), io::Env::posix(), 4);
      if (!w.is_ok()) {
        results[i] = w.status();
        return;
      }
      Status s = write_in_pieces(**w, std::span(data).subspan(cuts[i], cuts[i + 1] - cuts[i]), cuts[i],
                                 static_cast<uint32_t>(i + 1));
      results[i] = s.is_ok() ? (*w)->finish() : Result<RangeDigest>(s);
    });
  }
  for (auto& t : threads) t.join();
  std::vector<RangeDigest> digests;
  for (size_t i = 0; i < n; ++i) {
    EXPECT_TRUE(results[i].is_ok()) << "range " << i << ": " << results[i].status().to_string();
    if (results[i].is_ok()) digests.push_back(*results[i]);
  }
  return digests;
}

void expect_same_digest(const FileDigest& got, const FileDigest& want) {
  EXPECT_EQ(got.name, want.name);
  EXPECT_EQ(got.size_bytes, want.size_bytes);
  EXPECT_EQ(got.chunk_bytes, want.chunk_bytes);
  EXPECT_EQ(got.chunk_crc32c, want.chunk_crc32c);
}

TEST(RangeWriter, AdjacentUnalignedRangesFromThreadsMatchAStreamWriter) {
  TempDir dir;
  // 2 full chunks and a partial third; cuts at 4096·k + 123 on both sides of the 16 MiB boundary.
  const uint64_t size = 2 * kChecksumChunkBytes + 4096 * 7 + 55;
  const std::vector<std::byte> data = random_bytes(size, 42);
  const FileDigest whole = stream_digest(dir.path + "/whole", data);
  ASSERT_EQ(whole.chunk_crc32c.size(), 3u);
  const std::vector<std::vector<uint64_t>> layouts = {
      {0, 4096 * 4100 + 123, size},                                        // two: the first crosses a chunk
      {0, 4096 * 3000 + 123, 4096 * 6000 + 123, size},                     // three: the middle one crosses
      {0, 4096 * 5 + 123, 4096 * 5 + 123, 2 * kChecksumChunkBytes, size},  // an empty one, a chunk-aligned cut
  };
  for (size_t l = 0; l < layouts.size(); ++l) {
    SCOPED_TRACE(l);
    const std::string name = "shared" + std::to_string(l);
    const std::string path = dir.path + "/" + name;
    ASSERT_TRUE(create_sized_file(path, size, io::Env::posix()).is_ok());
    std::vector<RangeDigest> ranges = write_ranges_concurrently(path, data, layouts[l]);
    ASSERT_EQ(ranges.size(), layouts[l].size() - 1);
    EXPECT_TRUE(read_all(path) == data);
    for (size_t i = 0; i < ranges.size(); ++i) {
      EXPECT_EQ(ranges[i].begin_bytes, layouts[l][i]);
      EXPECT_EQ(ranges[i].end_bytes, layouts[l][i + 1]);
    }
    auto combined = combine_range_digests(name, size, ranges);
    ASSERT_TRUE(combined.is_ok()) << combined.status().to_string();
    FileDigest want = whole;
    want.name = name;
    expect_same_digest(*combined, want);
  }
}

TEST(RangeWriter, TouchesNoByteOutsideItsRange) {
  TempDir dir;
  const uint64_t size = 64 * 4096 + 777;
  const std::string path = dir.path + "/f";
  ASSERT_TRUE(create_sized_file(path, size, io::Env::posix()).is_ok());
  EXPECT_EQ(read_all(path), std::vector<std::byte>(size, std::byte{0}));
  auto io = io::IoEngine::create(io::IoOptions{});
  ASSERT_TRUE(io.is_ok());
  auto staging = AlignedBuffer::allocate(8 * 4096);
  ASSERT_TRUE(staging.is_ok());
  std::vector<std::byte> want(size, std::byte{0xA5});
  {
    auto w = RangeWriter::create(**io, path, 0, size, staging->bytes(), io::Env::posix(), 4);
    ASSERT_TRUE(w.is_ok()) << w.status().to_string();
    ASSERT_TRUE((*w)->append(want).is_ok());
    ASSERT_TRUE((*w)->finish().is_ok());
  }
  // Inside one block; across one block boundary (no whole block); many blocks with unaligned ends;
  // ending exactly at a block; and the file's unaligned tail. Garbage in the staging buffer around
  // the range's bytes must never reach the file.
  const std::vector<std::pair<uint64_t, uint64_t>> ranges = {{2 * 4096 + 100, 2 * 4096 + 300},
                                                             {5 * 4096 - 10, 5 * 4096 + 20},
                                                             {8 * 4096 + 123, 30 * 4096 + 4000},
                                                             {33 * 4096 + 1, 40 * 4096},
                                                             {64 * 4096 + 5, size}};
  uint32_t seed = 1;
  for (auto [b, e] : ranges) {
    SCOPED_TRACE(b);
    std::memset(staging->bytes().data(), 0xEE, staging->bytes().size());
    const std::vector<std::byte> bytes = random_bytes(e - b, seed++);
    auto w = RangeWriter::create(**io, path, b, e, staging->bytes(), io::Env::posix(), 4);
    ASSERT_TRUE(w.is_ok()) << w.status().to_string();
    ASSERT_TRUE(write_in_pieces(**w, bytes, b, seed).is_ok());
    auto d = (*w)->finish();
    ASSERT_TRUE(d.is_ok()) << d.status().to_string();
    ASSERT_EQ(d->piece_crc32c.size(), 1u);
    EXPECT_EQ(d->piece_crc32c[0], crc32c(bytes.data(), bytes.size()));
    std::memcpy(want.data() + b, bytes.data(), bytes.size());
    EXPECT_TRUE(read_all(path) == want);
  }
  EXPECT_EQ(read_all(path).size(), size);
}

TEST(RangeWriter, AnEmptyRangeWritesNothing) {
  TempDir dir;
  const std::string path = dir.path + "/f";
  ASSERT_TRUE(create_sized_file(path, 10000, io::Env::posix()).is_ok());
  auto io = io::IoEngine::create(io::IoOptions{});
  auto staging = AlignedBuffer::allocate(8 * 4096);
  auto w = RangeWriter::create(**io, path, 5000, 5000, staging->bytes(), io::Env::posix(), 4);
  ASSERT_TRUE(w.is_ok()) << w.status().to_string();
  EXPECT_EQ((*w)->next_span(10).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ((*w)->append(std::vector<std::byte>(1)).code(), StatusCode::kInvalidArgument);
  auto d = (*w)->finish();
  ASSERT_TRUE(d.is_ok()) << d.status().to_string();
  EXPECT_EQ(d->begin_bytes, 5000u);
  EXPECT_EQ(d->end_bytes, 5000u);
  EXPECT_TRUE(d->piece_crc32c.empty());
  EXPECT_EQ(read_all(path), std::vector<std::byte>(10000, std::byte{0}));
}

TEST(RangeWriter, RefusesToWritePastItsEndAndAShortRangeAtFinish) {
  TempDir dir;
  const std::string path = dir.path + "/short";
  ASSERT_TRUE(create_sized_file(path, 20000, io::Env::posix()).is_ok());
  auto io = io::IoEngine::create(io::IoOptions{});
  auto staging = AlignedBuffer::allocate(8 * 4096);
  {
    auto w = RangeWriter::create(**io, path, 100, 9000, staging->bytes(), io::Env::posix(), 4);
    ASSERT_TRUE(w.is_ok());
    ASSERT_TRUE((*w)->append(std::vector<std::byte>(8000, std::byte{1})).is_ok());
    auto d = (*w)->finish();
    ASSERT_FALSE(d.is_ok());
    EXPECT_EQ(d.status().code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(d.status().message(), HasSubstr("[100, 9000)"));
    EXPECT_THAT(d.status().message(), HasSubstr("8000 bytes committed"));
  }
  {
    auto w = RangeWriter::create(**io, path, 100, 9000, staging->bytes(), io::Env::posix(), 4);
    ASSERT_TRUE(w.is_ok());
    Status s = (*w)->append(std::vector<std::byte>(9000, std::byte{2}));
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
    EXPECT_EQ((*w)->position(), 8900u);
    auto d = (*w)->finish();
    ASSERT_TRUE(d.is_ok()) << d.status().to_string();
  }
  const std::vector<std::byte> got = read_all(path);
  ASSERT_EQ(got.size(), 20000u);
  EXPECT_EQ(got[99], std::byte{0});
  EXPECT_EQ(got[100], std::byte{2});
  EXPECT_EQ(got[8999], std::byte{2});
  EXPECT_EQ(got[9000], std::byte{0});
  // A range past the file's end, a reversed range and a missing file are refused at create.
  EXPECT_EQ(RangeWriter::create(**io, path, 0, 20001, staging->bytes(), io::Env::posix(), 4).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(RangeWriter::create(**io, path, 10, 9, staging->bytes(), io::Env::posix(), 4).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_FALSE(RangeWriter::create(**io, dir.path + "/missing", 0, 0, staging->bytes(), io::Env::posix(), 4).is_ok());
}

TEST(RangeWriter, CreateSizedFileRefusesAnExistingFile) {
  TempDir dir;
  std::ofstream(dir.path + "/x") << "keep me";
  EXPECT_EQ(create_sized_file(dir.path + "/x", 4096, io::Env::posix()).code(), StatusCode::kAlreadyExists);
  EXPECT_EQ(read_all(dir.path + "/x").size(), 7u);
  ASSERT_TRUE(create_sized_file(dir.path + "/y", 0, io::Env::posix()).is_ok());
  EXPECT_EQ(read_all(dir.path + "/y").size(), 0u);
}

TEST(RangeWriter, AnInjectedWriteErrorSurfacesWithThePath) {
  // Range [4096·3 + 123, 4096·40 + 77): the head block (edge, buffered), a block in the middle
  // (O_DIRECT where the file system allows it) and the tail block (edge).
  const uint64_t b = 4096 * 3 + 123, e = 4096 * 40 + 77;
  for (uint64_t fault_at : {b + 10, uint64_t{4096 * 20 + 5}, e - 3}) {
    SCOPED_TRACE(fault_at);
    TempDir dir;
    const std::string path = dir.path + "/victim";
    ASSERT_TRUE(create_sized_file(path, e + 1000, io::Env::posix()).is_ok());
    auto faults = std::make_shared<io::FaultInjector>();
    auto io = io::IoEngine::create(io::IoOptions{}, faults);
    ASSERT_TRUE(io.is_ok());
    auto staging = AlignedBuffer::allocate(8 * 4096);
    faults->add(
        {.kind = io::FaultKind::kEio, .op = io::IoOp::kWrite, .path_contains = "victim", .offset_bytes = fault_at});
    auto w = RangeWriter::create(**io, path, b, e, staging->bytes(), io::Env::posix(), 4);
    ASSERT_TRUE(w.is_ok()) << w.status().to_string();
    Status s = (*w)->append(random_bytes(e - b, 5));
    Result<RangeDigest> d = s.is_ok() ? (*w)->finish() : Result<RangeDigest>(s);
    ASSERT_FALSE(d.is_ok());
    EXPECT_EQ(faults->injected(), 1u);
    EXPECT_EQ(d.status().code(), StatusCode::kIoError);
    EXPECT_THAT(d.status().to_string(), HasSubstr("victim"));
  }
}

// Every file is opened through the Env: a fault injected at open time fails the create (nothing
// made) or the read, naming the file; RangeWriter's second, buffered descriptor too.
TEST(StreamFiles, AFaultOpeningAFileIsReportedWithThePath) {
  TempDir dir;
  auto faults = std::make_shared<io::FaultInjector>();
  io::FaultyEnv env(io::Env::posix(), faults);
  auto io = io::IoEngine::create(io::IoOptions{}, faults);
  ASSERT_TRUE(io.is_ok());
  auto staging = AlignedBuffer::allocate(8 * 4096);
  auto expect_refused = [&](const Status& s, const std::string& path) {
    EXPECT_EQ(s.code(), StatusCode::kIoError) << s.to_string();
    EXPECT_EQ(s.sys_errno(), EIO);
    EXPECT_THAT(s.message(), HasSubstr("open " + path + " (injected)"));
  };
  const std::string streamed = dir.path + "/master.safetensors";
  faults->add({.kind = io::FaultKind::kEio, .op = io::IoOp::kOpen, .path_contains = "master"});
  expect_refused(StreamWriter::create(**io, streamed, staging->bytes(), &env, 4).status(), streamed);
  EXPECT_FALSE(std::filesystem::exists(streamed));

  const std::string sized = dir.path + "/exp_avg.safetensors";
  faults->add({.kind = io::FaultKind::kEio, .op = io::IoOp::kOpen, .path_contains = "exp_avg"});
  expect_refused(create_sized_file(sized, 20000, &env), sized);
  EXPECT_FALSE(std::filesystem::exists(sized));
  ASSERT_TRUE(create_sized_file(sized, 20000, &env).is_ok()) << "the rule is used up";
  faults->add({.kind = io::FaultKind::kEio, .op = io::IoOp::kOpen, .path_contains = "exp_avg", .skip = 1});
  expect_refused(RangeWriter::create(**io, sized, 100, 9000, staging->bytes(), &env, 4).status(), sized);

  auto w = StreamWriter::create(**io, streamed, staging->bytes(), &env, 4);
  ASSERT_TRUE(w.is_ok()) << w.status().to_string();
  ASSERT_TRUE((*w)->append(random_bytes(10000, 3)).is_ok());
  auto digest = (*w)->finish();
  ASSERT_TRUE(digest.is_ok()) << digest.status().to_string();
  faults->add({.kind = io::FaultKind::kEio, .op = io::IoOp::kOpen, .path_contains = "master"});
  expect_refused(read_stream(**io, &env, streamed, *digest, staging->bytes(), 0,
                             [](uint64_t, std::span<const std::byte>) { return Status::ok(); }),
                 streamed);
  EXPECT_EQ(faults->injected(), 4u);
}

TEST(RangeWriter, CombineRefusesGapsOverlapsAndWrongPieceCounts) {
  const uint64_t size = kChecksumChunkBytes + 100;
  const std::vector<RangeDigest> ok = {
      {0, 1000, {1}}, {1000, kChecksumChunkBytes + 50, {2, 3}}, {kChecksumChunkBytes + 50, size, {4}}};
  EXPECT_TRUE(combine_range_digests("f", size, ok).is_ok());
  auto expect_refused = [&](std::vector<RangeDigest> ranges, const std::string& says) {
    auto d = combine_range_digests("f", size, ranges);
    ASSERT_FALSE(d.is_ok()) << says;
    EXPECT_EQ(d.status().code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(d.status().message(), HasSubstr(says));
  };
  expect_refused({{0, 1000, {1}}, {1001, kChecksumChunkBytes + 50, {2, 3}}, {kChecksumChunkBytes + 50, size, {4}}},
                 "a gap [1000, 1001)");
  expect_refused({{0, 1000, {1}}, {999, kChecksumChunkBytes + 50, {2, 3}}, {kChecksumChunkBytes + 50, size, {4}}},
                 "overlaps [999, 1000)");
  expect_refused({{0, 1000, {1}}, {1000, kChecksumChunkBytes + 50, {2, 3}}}, "a gap [16777266, 16777316) after");
  expect_refused({{0, 1000, {1}}, {1000, kChecksumChunkBytes + 50, {2}}, {kChecksumChunkBytes + 50, size, {4}}},
                 "1 piece checksums");
  expect_refused({{0, size + 1, {1, 2}}}, "ends past");
}

TEST(ReadStreamRange, ChecksOnlyTheChunksItReadsAndConsumesExactlyTheRange) {
  TempDir dir;
  const uint64_t size = 2 * kChecksumChunkBytes + 10000;  // chunks 0, 1 and a short 2
  const std::vector<std::byte> data = random_bytes(size, 9);
  const std::string path = dir.path + "/f";
  const FileDigest digest = stream_digest(path, data);
  auto io = io::IoEngine::create(io::IoOptions{});
  ASSERT_TRUE(io.is_ok());
  auto staging = AlignedBuffer::allocate(64 * 4096);
  ASSERT_TRUE(staging.is_ok());
  // Reads [from, until); true with the bytes consumed and the bytes read, or the error.
  auto read = [&](uint64_t from, uint64_t until, uint64_t* read_bytes) -> Status {
    uint64_t next = from;
    *read_bytes = 0;
    Status s = read_stream_range(
        **io, io::Env::posix(), path, digest, staging->bytes(), from, until,
        [&](uint64_t offset, std::span<const std::byte> bytes) -> Status {
          if (offset != next || bytes.empty() || offset + bytes.size() > until ||
              std::memcmp(bytes.data(), data.data() + offset, bytes.size()) != 0) {
            return Status(StatusCode::kInternal, "consumed the wrong bytes at " + std::to_string(offset));
          }
          next += bytes.size();
          return Status::ok();
        },
        [&](uint64_t n) { *read_bytes += n; });
    if (s.is_ok() && next != until) return Status(StatusCode::kInternal, "consumed up to " + std::to_string(next));
    return s;
  };
  uint64_t read_bytes = 0;
  // Within chunk 0; across chunks 0-1; inside the short last chunk; to the end; empty.
  EXPECT_TRUE(read(123, 4096 * 100 + 7, &read_bytes).is_ok());
  EXPECT_EQ(read_bytes, kChecksumChunkBytes);
  EXPECT_TRUE(read(kChecksumChunkBytes - 5, kChecksumChunkBytes + 5, &read_bytes).is_ok());
  EXPECT_EQ(read_bytes, 2 * kChecksumChunkBytes);
  EXPECT_TRUE(read(2 * kChecksumChunkBytes + 1, size - 1, &read_bytes).is_ok());
  EXPECT_EQ(read_bytes, 10000u);
  EXPECT_TRUE(read(0, size, &read_bytes).is_ok());
  EXPECT_EQ(read_bytes, size);
  EXPECT_TRUE(read(777, 777, &read_bytes).is_ok());
  EXPECT_EQ(read_bytes, 0u);
  EXPECT_EQ(read(10, 5, &read_bytes).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(read(0, size + 1, &read_bytes).code(), StatusCode::kInvalidArgument);

  // Flip a byte of chunk 2 on disk: ranges in chunks 0-1 still read, one touching chunk 2 fails
  // naming it, and so does the whole-file read_stream.
  {
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(2 * kChecksumChunkBytes + 4321));
    const char c = static_cast<char>(data[2 * kChecksumChunkBytes + 4321] ^ std::byte{0x40});
    f.write(&c, 1);
  }
  EXPECT_TRUE(read(5, 2 * kChecksumChunkBytes, &read_bytes).is_ok());
  EXPECT_EQ(read_bytes, 2 * kChecksumChunkBytes);
  Status bad = read(2 * kChecksumChunkBytes - 1, 2 * kChecksumChunkBytes + 1, &read_bytes);
  EXPECT_EQ(bad.code(), StatusCode::kCorruption);
  EXPECT_THAT(bad.message(), HasSubstr("chunk 2"));
  EXPECT_THAT(bad.message(), HasSubstr(path));
  Status whole = read_stream(**io, io::Env::posix(), path, digest, staging->bytes(), 0,
                             [](uint64_t, std::span<const std::byte>) { return Status::ok(); });
  EXPECT_EQ(whole.code(), StatusCode::kCorruption);
  // read_stream with from_bytes at the end still verifies the whole file (verify_checkpoint's use).
  Status verify = read_stream(**io, io::Env::posix(), path, digest, staging->bytes(), size,
                              [](uint64_t, std::span<const std::byte>) { return Status::ok(); });
  EXPECT_EQ(verify.code(), StatusCode::kCorruption);
}

}  // namespace
}  // namespace zo::engine

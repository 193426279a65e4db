// StreamWriter and ChunkVerifier over real files: any sequence of spans and appends lands in the
// file byte for byte with its exact size and per-chunk CRC-32C, aligned spans stay aligned, an
// existing file is refused, injected write errors surface with the path, and the verifier names
// the chunk a flipped byte is in.
#include "engine/ckpt/stream_file.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "common/aligned_buffer.h"
#include "common/crc32c.h"
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
  for (uint64_t size : {uint64_t{0}, uint64_t{1}, uint64_t{4095}, uint64_t{65536}, uint64_t{65537},
                        uint64_t{33} << 20 | 12345}) {
    SCOPED_TRACE(size);
    std::vector<std::byte> data(size);
    for (auto& b : data) b = static_cast<std::byte>(rng());
    const std::string path = dir.path + "/f" + std::to_string(size);
    auto w = StreamWriter::create(**io, path, staging->bytes(), 4);
    ASSERT_TRUE(w.is_ok()) << w.status().to_string();
    uint64_t off = 0;
    bool use_span = false;
    while (off < size) {
      const uint64_t want = std::min<uint64_t>(size - off, 1 + rng() % 100000);
      if (use_span) {
        auto span = (*w)->next_span(want);
        ASSERT_TRUE(span.is_ok());
        if ((*w)->position() % 4096 == 0) {
          EXPECT_EQ(reinterpret_cast<uintptr_t>(span->data()) % 4096, 0u);
        }
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
    for (uint64_t a = 0; a < size; a += 7777) ASSERT_TRUE(ok.update({data.data() + a, std::min<uint64_t>(7777, size - a)}).is_ok());
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
  auto w = StreamWriter::create(**io, dir.path + "/x", staging->bytes(), 4);
  EXPECT_EQ(w.status().code(), StatusCode::kAlreadyExists);
  EXPECT_EQ(read_all(dir.path + "/x").size(), 7u);
  EXPECT_EQ(StreamWriter::create(**io, dir.path + "/y", staging->bytes().first(3 * 4096), 4).status().code(),
            StatusCode::kInvalidArgument);
}

TEST(StreamWriter, AWriteErrorSurfacesWithThePath) {
  TempDir dir;
  auto faults = std::make_shared<io::FaultInjector>();
  auto io = io::IoEngine::create(io::IoOptions{}, faults);
  auto staging = AlignedBuffer::allocate(16 * 4096);
  faults->add({.kind = io::FaultKind::kNoSpace, .op = io::IoOp::kWrite, .path_contains = "victim", .offset_bytes = 20000});
  auto w = StreamWriter::create(**io, dir.path + "/victim", staging->bytes(), 4);
  ASSERT_TRUE(w.is_ok());
  std::vector<std::byte> data(200000, std::byte{7});
  Status s = (*w)->append(data);
  Result<FileDigest> d = s.is_ok() ? (*w)->finish() : Result<FileDigest>(s);
  ASSERT_FALSE(d.is_ok());
  EXPECT_EQ(d.status().code(), StatusCode::kNoSpace);
  EXPECT_THAT(d.status().to_string(), HasSubstr("victim"));
}

}  // namespace
}  // namespace zo::engine

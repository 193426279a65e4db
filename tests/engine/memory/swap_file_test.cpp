// SwapFile over real files in a temp dir ($ZO_TEST_TMPDIR, else $TMPDIR, else /tmp; O_DIRECT where
// the file system allows it): aligned regions, round trips, preallocation, running out of space at
// reserve and at create, and injected I/O errors (opening the file, reading and writing it)
// reported with what, path and offset.
#include "engine/memory/swap_file.h"

#include <sys/mount.h>
#include <sys/stat.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <random>

#include "common/aligned_buffer.h"
#include "io/env.h"
#include "io/fault_injector.h"
#include "io/io_engine.h"
#include "tests/engine/temp_dir.h"

namespace zo::engine {
namespace {

using ::testing::HasSubstr;

std::unique_ptr<io::IoEngine> make_engine(std::shared_ptr<io::FaultInjector> faults = nullptr) {
  io::IoOptions o;
  o.block_size_bytes = 64 * 1024;
  auto e = io::IoEngine::create(o, std::move(faults));
  ZO_CHECK(e.is_ok()) << e.status().to_string();
  return std::move(e).value();
}

AlignedBuffer random_buffer(size_t size, uint32_t seed) {
  auto b = AlignedBuffer::allocate(size);
  ZO_CHECK(b.is_ok());
  std::mt19937 rng(seed);
  for (auto& x : b->bytes()) x = static_cast<std::byte>(rng());
  return std::move(b).value();
}

TEST(SwapDir, IsPerRankUnderZoffloadSwap) {
  EXPECT_EQ(swap_dir("/nvme", 3), "/nvme/zoffload-swap/rank3");
  EXPECT_EQ(swap_dir("/nvme/", 0), "/nvme/zoffload-swap/rank0");
}

TEST(SwapFile, CreatesDirectoryAndPreallocatesRoundedCapacity) {
  TempDir tmp;
  auto engine = make_engine();
  const std::string dir = swap_dir(tmp.path, 0);
  auto f = SwapFile::create(dir, "optimizer.swp", 100'000, *engine, nullptr, io::Env::posix());
  ASSERT_TRUE(f.is_ok()) << f.status().to_string();
  EXPECT_EQ((*f)->capacity_bytes(), 102'400u);
  EXPECT_EQ((*f)->path(), dir + "/optimizer.swp");
  struct stat st {};
  ASSERT_EQ(::stat((*f)->path().c_str(), &st), 0);
  EXPECT_EQ(static_cast<uint64_t>(st.st_size), 102'400u);
  // Blocks are really reserved, not a sparse file.
  EXPECT_GE(static_cast<uint64_t>(st.st_blocks) * 512, 102'400u);
}

TEST(SwapFile, ReusesAndTrimsAFileOfAPreviousRun) {
  TempDir tmp;
  auto engine = make_engine();
  {
    auto big = SwapFile::create(tmp.path, "p.swp", 1 << 20, *engine, nullptr, io::Env::posix());
    ASSERT_TRUE(big.is_ok()) << big.status().to_string();
  }
  auto f = SwapFile::create(tmp.path, "p.swp", 8192, *engine, nullptr, io::Env::posix());
  ASSERT_TRUE(f.is_ok()) << f.status().to_string();
  EXPECT_EQ(std::filesystem::file_size((*f)->path()), 8192u);
}

// Two runs on one nvme_path would write each other's states: a file another open holds (another
// process; in a test, a second open in this one, which flock treats the same) is refused before
// anything in it changes, and claimed — given to the caller's clean-up — only once it is held.
TEST(SwapFile, AFileInUseIsRefusedUntouchedAndClaimedOnlyWhenHeld) {
  TempDir tmp;
  auto engine = make_engine();
  std::vector<std::string> claimed;
  auto claim = [&](const std::string& path) { claimed.push_back(path); };
  auto first = SwapFile::create(tmp.path, "optimizer.swp", 1 << 20, *engine, nullptr, io::Env::posix(), claim);
  ASSERT_TRUE(first.is_ok()) << first.status().to_string();
  ASSERT_EQ(claimed, std::vector<std::string>{(*first)->path()});
  auto second = SwapFile::create(tmp.path, "optimizer.swp", 8192, *engine, nullptr, io::Env::posix(), claim);
  ASSERT_FALSE(second.is_ok());
  EXPECT_EQ(second.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(second.status().message(), HasSubstr((*first)->path() + " is in use by another process"));
  EXPECT_THAT(second.status().message(), HasSubstr("nvme_path"));
  EXPECT_EQ(claimed.size(), 1u) << "a file this open does not hold was claimed";
  EXPECT_EQ(std::filesystem::file_size((*first)->path()), uint64_t{1} << 20) << "the refused open trimmed the file";
  first->reset();
  auto third = SwapFile::create(tmp.path, "optimizer.swp", 8192, *engine, nullptr, io::Env::posix(), claim);
  ASSERT_TRUE(third.is_ok()) << "the lock ends with the file's owner: " << third.status().to_string();
  EXPECT_EQ(claimed.size(), 2u);
}

// The file is opened through the Env: a fault injected there is reported naming the file, and
// nothing is created or claimed.
TEST(SwapFile, AFaultOpeningTheFileIsReportedAndNothingIsClaimed) {
  TempDir tmp;
  auto engine = make_engine();
  auto faults = std::make_shared<io::FaultInjector>();
  io::FaultyEnv env(io::Env::posix(), faults);
  std::vector<std::string> claimed;
  auto claim = [&](const std::string& path) { claimed.push_back(path); };
  faults->add({.kind = io::FaultKind::kNoSpace, .op = io::IoOp::kOpen, .path_contains = "optimizer.swp"});
  auto f = SwapFile::create(tmp.path, "optimizer.swp", 8192, *engine, nullptr, &env, claim);
  ASSERT_FALSE(f.is_ok());
  EXPECT_EQ(f.status().code(), StatusCode::kNoSpace);
  EXPECT_EQ(f.status().sys_errno(), ENOSPC);
  EXPECT_THAT(f.status().message(), HasSubstr("open " + tmp.path + "/optimizer.swp (injected)"));
  EXPECT_FALSE(std::filesystem::exists(tmp.path + "/optimizer.swp"));
  EXPECT_TRUE(claimed.empty());
  EXPECT_EQ(faults->injected(), 1u);
  auto again = SwapFile::create(tmp.path, "optimizer.swp", 8192, *engine, nullptr, &env, claim);
  ASSERT_TRUE(again.is_ok()) << "the rule is used up: " << again.status().to_string();
  EXPECT_EQ(claimed, std::vector<std::string>{(*again)->path()});
}

TEST(SwapFile, ReservesAlignedRegionsInOrderUntilFull) {
  TempDir tmp;
  auto engine = make_engine();
  MemoryAccounting acc;
  {
    auto f = SwapFile::create(tmp.path, "x.swp", 5 * 4096, *engine, &acc, io::Env::posix());
    ASSERT_TRUE(f.is_ok()) << f.status().to_string();
    auto a = (*f)->reserve(1);
    auto b = (*f)->reserve(4097);
    ASSERT_TRUE(a.is_ok() && b.is_ok());
    EXPECT_EQ(a->offset_bytes, 0u);
    EXPECT_EQ(a->size_bytes, 4096u);
    EXPECT_EQ(b->offset_bytes, 4096u);
    EXPECT_EQ(b->size_bytes, 8192u);
    EXPECT_EQ((*f)->reserved_bytes(), 3 * 4096u);
    EXPECT_EQ(acc.snapshot().nvme.resident_bytes, 3 * 4096u);
    auto c = (*f)->reserve(3 * 4096);
    ASSERT_FALSE(c.is_ok());
    EXPECT_EQ(c.status().code(), StatusCode::kNoSpace);
    EXPECT_THAT(c.status().message(), HasSubstr("x.swp"));
    auto d = (*f)->reserve(2 * 4096);
    ASSERT_TRUE(d.is_ok());
    EXPECT_EQ(d->offset_bytes, 3 * 4096u);
  }
  EXPECT_EQ(acc.snapshot().nvme.resident_bytes, 0u);
  EXPECT_EQ(acc.snapshot().nvme.peak_bytes, 5 * 4096u);
}

TEST(SwapFile, WritesAndReadsBackRegionsAsyncAndSync) {
  TempDir tmp;
  auto engine = make_engine();
  MemoryAccounting acc;
  auto f = SwapFile::create(tmp.path, "optimizer.swp", 1 << 20, *engine, &acc, io::Env::posix());
  ASSERT_TRUE(f.is_ok()) << f.status().to_string();
  SwapFile& file = **f;
  auto r1 = file.reserve(256 * 1024);
  auto r2 = file.reserve(300 * 1024);
  ASSERT_TRUE(r1.is_ok() && r2.is_ok());
  AlignedBuffer w1 = random_buffer(256 * 1024, 1);
  AlignedBuffer w2 = random_buffer(300 * 1024, 2);
  auto t1 = file.write_async(*r1, 0, w1.bytes(), "group 0");
  auto t2 = file.write_async(*r2, 0, w2.bytes(), "group 1");
  ASSERT_TRUE(t1.is_ok() && t2.is_ok());
  ASSERT_TRUE(file.wait(*t1).is_ok());
  ASSERT_TRUE(file.wait(*t2).is_ok());

  auto back = AlignedBuffer::allocate(300 * 1024);
  ASSERT_TRUE(back.is_ok());
  auto t3 = file.read_async(*r2, 0, back->bytes(), "group 1");
  ASSERT_TRUE(t3.is_ok());
  ASSERT_TRUE(file.wait(*t3).is_ok());
  EXPECT_EQ(std::memcmp(back->data(), w2.data(), w2.size()), 0);
  // A sub-range at an offset inside the region (a section of a record).
  ASSERT_TRUE(file.read(*r1, 8192, back->bytes().first(16384), "group 0 exp_avg").is_ok());
  EXPECT_EQ(std::memcmp(back->data(), w1.data() + 8192, 16384), 0);
  // Overwrite in place.
  AlignedBuffer w3 = random_buffer(4096, 3);
  ASSERT_TRUE(file.write(*r1, 4096, w3.bytes(), "group 0 master").is_ok());
  ASSERT_TRUE(file.read(*r1, 0, back->bytes().first(8192), "group 0").is_ok());
  EXPECT_EQ(std::memcmp(back->data(), w1.data(), 4096), 0);
  EXPECT_EQ(std::memcmp(back->data() + 4096, w3.data(), 4096), 0);

  MemoryStats s = acc.snapshot();
  EXPECT_EQ(s.nvme_write_bytes, (256 + 300 + 4) * 1024u);
  EXPECT_EQ(s.nvme_read_bytes, (300 + 16 + 8) * 1024u);
  EXPECT_EQ(s.nvme.resident_bytes, (256 + 300) * 1024u);
}

TEST(SwapFile, RangeOutsideTheRegionIsRejected) {
  TempDir tmp;
  auto engine = make_engine();
  auto f = SwapFile::create(tmp.path, "x.swp", 3 * 4096, *engine, nullptr, io::Env::posix());
  ASSERT_TRUE(f.is_ok());
  auto r = (*f)->reserve(4096);
  ASSERT_TRUE(r.is_ok());
  AlignedBuffer b = random_buffer(8192, 4);
  auto t = (*f)->write_async(*r, 0, b.bytes(), "group 7");
  ASSERT_FALSE(t.is_ok());
  EXPECT_EQ(t.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(t.status().message(), HasSubstr("group 7"));
}

TEST(SwapFile, InjectedErrorNamesWhatPathOffsetAndKeepsErrno) {
  TempDir tmp;
  auto faults = std::make_shared<io::FaultInjector>();
  auto engine = make_engine(faults);
  MemoryAccounting acc;
  auto f = SwapFile::create(tmp.path, "optimizer.swp", 1 << 20, *engine, &acc, io::Env::posix());
  ASSERT_TRUE(f.is_ok()) << f.status().to_string();
  auto r0 = (*f)->reserve(128 * 1024);
  auto r1 = (*f)->reserve(128 * 1024);
  ASSERT_TRUE(r0.is_ok() && r1.is_ok());
  AlignedBuffer b = random_buffer(128 * 1024, 5);
  ASSERT_TRUE((*f)->write(*r1, 0, b.bytes(), "sub-group 1 optimizer states").is_ok());

  io::FaultRule rule;
  rule.kind = io::FaultKind::kEio;
  rule.op = io::IoOp::kRead;
  rule.path_contains = "optimizer.swp";
  rule.offset_bytes = r1->offset_bytes + 70 * 1024;
  faults->add(rule);
  auto t = (*f)->read_async(*r1, 0, b.bytes(), "sub-group 1 optimizer states");
  ASSERT_TRUE(t.is_ok());
  Status s = (*f)->wait(*t);
  ASSERT_FALSE(s.is_ok());
  EXPECT_EQ(s.code(), StatusCode::kIoError);
  EXPECT_EQ(s.sys_errno(), EIO);
  EXPECT_THAT(s.message(),
              HasSubstr("sub-group 1 optimizer states: read of 128 KiB at offset 131072 in " + (*f)->path()));
  EXPECT_EQ(acc.snapshot().nvme_read_bytes, 0u);  // a failed read moved nothing usable

  rule.kind = io::FaultKind::kNoSpace;
  rule.op = io::IoOp::kWrite;
  rule.offset_bytes = 0;
  faults->add(rule);
  Status w = (*f)->write(*r0, 0, b.bytes(), "sub-group 0 optimizer states");
  EXPECT_EQ(w.code(), StatusCode::kNoSpace);
  EXPECT_EQ(w.sys_errno(), ENOSPC);
  EXPECT_THAT(w.message(), HasSubstr("sub-group 0 optimizer states: write of 128 KiB at offset 0"));
}

// Issue 40: a failed create removes the file it created (it left a 0-byte swap file), and only
// that: an earlier run's file that cannot be grown is left as it was.
TEST(SwapFile, CreateOnAFullFileSystemSaysSizeAndFreeSpaceAndRemovesOnlyWhatItMade) {
  TempDir tmp;
  const std::string mnt = tmp.path + "/small";
  std::filesystem::create_directory(mnt);
  if (::mount("tmpfs", mnt.c_str(), "tmpfs", 0, "size=256k") != 0) {
    GTEST_SKIP() << "cannot mount a small tmpfs here: " << std::strerror(errno);
  }
  auto engine = make_engine();
  Status s, earlier_made, refused;
  bool left = true, kept = false;
  {
    s = SwapFile::create(mnt + "/zoffload-swap", "optimizer.swp", 64 << 20, *engine, nullptr, io::Env::posix())
            .status();
    left = std::filesystem::exists(mnt + "/zoffload-swap/optimizer.swp");
    earlier_made = SwapFile::create(mnt, "earlier.swp", 8192, *engine, nullptr, io::Env::posix()).status();
    refused = SwapFile::create(mnt, "earlier.swp", 64 << 20, *engine, nullptr, io::Env::posix()).status();
    kept = std::filesystem::exists(mnt + "/earlier.swp");
  }
  ::umount(mnt.c_str());
  ASSERT_FALSE(s.is_ok());
  EXPECT_EQ(s.code(), StatusCode::kNoSpace);
  EXPECT_EQ(s.sys_errno(), ENOSPC);
  EXPECT_THAT(s.message(), HasSubstr("optimizer.swp"));
  EXPECT_THAT(s.message(), HasSubstr("64.0 MiB"));
  EXPECT_THAT(s.message(), HasSubstr("free on that file system"));
  EXPECT_FALSE(left) << "a failed create left its empty swap file behind";
  ASSERT_TRUE(earlier_made.is_ok()) << earlier_made.to_string();
  EXPECT_EQ(refused.code(), StatusCode::kNoSpace);
  EXPECT_TRUE(kept) << "the earlier run's file was removed";
}

TEST(SwapFile, RemoveFileDeletesIt) {
  TempDir tmp;
  auto engine = make_engine();
  auto f = SwapFile::create(tmp.path, "x.swp", 4096, *engine, nullptr, io::Env::posix());
  ASSERT_TRUE(f.is_ok());
  ASSERT_TRUE(std::filesystem::exists((*f)->path()));
  ASSERT_TRUE((*f)->remove_file().is_ok());
  EXPECT_FALSE(std::filesystem::exists((*f)->path()));
}

}  // namespace
}  // namespace zo::engine

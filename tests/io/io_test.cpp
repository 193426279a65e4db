// Tests of io/: option parsing (unit) and, on real files in a temp dir (io), every backend's round
// trips at odd sizes and offsets, agreement between backends, concurrency, fault injection, O_DIRECT
// alignment errors and the buffered fallback on tmpfs; the Env's file operations and its faults.
#include <fcntl.h>
#include <linux/filter.h>
#include <linux/magic.h>
#include <linux/seccomp.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <csignal>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "common/aligned_buffer.h"
#include "common/bytes.h"
#include "io/env.h"
#include "io/io_engine.h"

namespace zo::io {
namespace {

using ::testing::HasSubstr;

#define ZO_ASSERT_OK(expr)                                                                    \
  do {                                                                                        \
    const ::zo::Status zo_assert_status_ = (expr);                                            \
    ASSERT_TRUE(zo_assert_status_.is_ok()) << #expr << ": " << zo_assert_status_.to_string(); \
  } while (0)

// ---- unit ---------------------------------------------------------------------------------------

TEST(IoOptions, ValidateNamesTheDeepSpeedKey) {
  IoOptions o;
  EXPECT_TRUE(o.validate().is_ok());
  o.block_size_bytes = 1000;
  EXPECT_THAT(o.validate().message(), HasSubstr("aio.block_size"));
  o = IoOptions{};
  o.block_size_bytes = 2 * kGiB;
  EXPECT_THAT(o.validate().message(), HasSubstr("aio.block_size"));
  o = IoOptions{};
  o.queue_depth = 0;
  EXPECT_THAT(o.validate().message(), HasSubstr("aio.queue_depth"));
  o = IoOptions{};
  o.threads = 0;
  EXPECT_THAT(o.validate().message(), HasSubstr("aio.intra_op_parallelism"));
}

TEST(IoOptions, DefaultsAreDeepSpeeds) {
  IoOptions o;
  EXPECT_EQ(o.block_size_bytes, 1048576u);
  EXPECT_EQ(o.queue_depth, 8u);
  EXPECT_EQ(o.threads, 1u);
  EXPECT_FALSE(o.single_submit);
  EXPECT_TRUE(o.overlap_events);
  EXPECT_FALSE(o.use_gds);
}

TEST(IoOptions, ParsesBackendNames) {
  EXPECT_EQ(*parse_backend("auto"), Backend::kAuto);
  EXPECT_EQ(*parse_backend("io_uring"), Backend::kUring);
  EXPECT_EQ(*parse_backend("URING"), Backend::kUring);
  EXPECT_EQ(*parse_backend("libaio"), Backend::kAio);
  EXPECT_EQ(*parse_backend("psync"), Backend::kPsync);
  auto bad = parse_backend("spdk");
  ASSERT_FALSE(bad.is_ok());
  EXPECT_THAT(bad.status().message(), HasSubstr("'spdk'"));
  for (Backend b : {Backend::kAuto, Backend::kUring, Backend::kAio, Backend::kPsync})
    EXPECT_EQ(*parse_backend(backend_name(b)), b);
}

TEST(FaultInjectorRules, MatchOffsetOpPathAndCount) {
  FaultInjector f;
  f.add(FaultRule{FaultKind::kEio, IoOp::kRead, "swap", 8192, 2});
  EXPECT_FALSE(f.decide("/x/swap0", IoOp::kWrite, 0, 16384));  // wrong op
  EXPECT_FALSE(f.decide("/x/other", IoOp::kRead, 0, 16384));   // wrong path
  EXPECT_FALSE(f.decide("/x/swap0", IoOp::kRead, 0, 8192));    // ends just before the offset
  EXPECT_EQ(f.decide("/x/swap0", IoOp::kRead, 8192, 4096), FaultKind::kEio);
  EXPECT_EQ(f.decide("/x/swap0", IoOp::kRead, 4096, 8192), FaultKind::kEio);
  EXPECT_FALSE(f.decide("/x/swap0", IoOp::kRead, 8192, 4096));  // used up
  EXPECT_EQ(f.injected(), 2u);
}

TEST(FaultInjectorRules, SkipLetsTheFirstMatchesThrough) {
  FaultInjector f;
  f.add({.kind = FaultKind::kEio, .op = IoOp::kSync, .path_contains = "ckpt", .skip = 2});
  EXPECT_FALSE(f.decide("/r/ckpt/tmp-1", IoOp::kSync, 0, 1));
  EXPECT_FALSE(f.decide("/r/ckpt", IoOp::kRename, 0, 1));  // another op: not counted
  EXPECT_FALSE(f.decide("/r/ckpt", IoOp::kSync, 0, 1));
  EXPECT_EQ(f.decide("/r/ckpt", IoOp::kSync, 0, 1), FaultKind::kEio);
  EXPECT_FALSE(f.decide("/r/ckpt", IoOp::kSync, 0, 1));
  EXPECT_EQ(f.injected(), 1u);
  EXPECT_EQ(op_name(IoOp::kRename), "rename");
}

// ---- real files ----------------------------------------------------------------------------------

std::string test_root() {
  const char* env = std::getenv("ZO_TEST_TMPDIR");
  return env != nullptr ? env : "/tmp";
}

class TempDir {
 public:
  explicit TempDir(const std::string& parent) {
    std::string tmpl = parent + "/zo_io_test.XXXXXX";
    std::vector<char> buf(tmpl.begin(), tmpl.end());
    buf.push_back('\0');
    ZO_CHECK(::mkdtemp(buf.data()) != nullptr) << "mkdtemp in " << parent << ": " << std::strerror(errno);
    path_ = buf.data();
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }
  std::string file(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

AlignedBuffer random_buffer(size_t n, uint32_t seed) {
  auto buf = AlignedBuffer::allocate(n);
  ZO_CHECK(buf.is_ok());
  std::mt19937 rng(seed);
  for (auto& b : buf->bytes()) b = static_cast<std::byte>(rng());
  return std::move(buf).value();
}

// Reads the file with plain pread: the reference every backend is compared against.
std::vector<std::byte> pread_all(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  ZO_CHECK(fd >= 0) << path;
  std::vector<std::byte> out(static_cast<size_t>(::lseek(fd, 0, SEEK_END)));
  size_t done = 0;
  while (done < out.size()) {
    const ssize_t n = ::pread(fd, out.data() + done, out.size() - done, static_cast<off_t>(done));
    ZO_CHECK(n > 0);
    done += static_cast<size_t>(n);
  }
  ::close(fd);
  return out;
}

// Whether the test directory honours O_DIRECT (said once in the output, as the tests depend on it).
bool direct_supported(const std::string& dir) {
  static int cached = -1;
  if (cached < 0) {
    auto f = File::open(dir + "/probe_direct", OpenMode::kCreate, true);
    ZO_CHECK(f.is_ok()) << f.status().to_string();
    cached = f->direct() ? 1 : 0;
    std::printf("[ io ] %s %s O_DIRECT%s%s\n", dir.c_str(), cached ? "supports" : "does not support",
                cached ? "" : "; direct tests run buffered: ", f->buffered_reason().c_str());
    std::remove((dir + "/probe_direct").c_str());
  }
  return cached == 1;
}

class BackendTest : public ::testing::TestWithParam<Backend> {
 protected:
  void SetUp() override {
    dir_ = std::make_unique<TempDir>(test_root());
    direct_ = direct_supported(dir_->path());
  }

  // Creates an engine on the parameter's backend, or skips the test saying why it is unavailable.
  std::unique_ptr<IoEngine> engine(IoOptions o = {}, std::shared_ptr<FaultInjector> faults = nullptr) {
    o.backend = GetParam();
    auto e = IoEngine::create(o, std::move(faults));
    if (!e.is_ok()) {
      if (e.status().code() == StatusCode::kUnavailable) {
        skip_reason_ = e.status().to_string();
        return nullptr;
      }
      ADD_FAILURE() << e.status().to_string();
      return nullptr;
    }
    EXPECT_EQ(e.value()->backend(), GetParam());
    return std::move(e).value();
  }

  File open(const std::string& name, bool direct) {
    auto f = File::open(dir_->file(name), OpenMode::kCreate, direct);
    ZO_CHECK(f.is_ok()) << f.status().to_string();
    return std::move(f).value();
  }

  std::unique_ptr<TempDir> dir_;
  bool direct_ = false;
  std::string skip_reason_;
};

#define ZO_ENGINE_OR_SKIP(var, ...)                          \
  auto var = engine(__VA_ARGS__);                            \
  if (!var) {                                                \
    if (!skip_reason_.empty()) GTEST_SKIP() << skip_reason_; \
    return;                                                  \
  }

TEST_P(BackendTest, RoundTripsOddSizesAtUnalignedOffsetsBuffered) {
  IoOptions o;
  o.block_size_bytes = 8192;  // forces splitting into many pieces
  o.queue_depth = 4;
  o.threads = 2;
  ZO_ENGINE_OR_SKIP(e, o);
  File f = open("odd", /*direct=*/false);
  const std::vector<std::pair<uint64_t, uint64_t>> cases = {
      {0, 1}, {1, 4095}, {4097, 8193}, {12345, 100003}, {200001, 65536 * 3 + 7}};
  uint32_t seed = 1;
  for (auto [off, len] : cases) {
    AlignedBuffer src = random_buffer(len, seed++);
    ASSERT_TRUE(e->write(f, off, src.bytes()).is_ok());
    auto dst = AlignedBuffer::allocate(len + 1);  // read into an unaligned address
    ASSERT_TRUE(dst.is_ok());
    std::span<std::byte> out(dst->data() + 1, len);
    Status s = e->read(f, off, out);
    ASSERT_TRUE(s.is_ok()) << s.to_string();
    ASSERT_EQ(std::memcmp(out.data(), src.data(), len), 0) << "offset " << off << " length " << len;
    auto ref = pread_all(f.path());
    ASSERT_EQ(std::memcmp(ref.data() + off, src.data(), len), 0);
  }
}

TEST_P(BackendTest, RoundTripsLargeAlignedRequestsDirect) {
  IoOptions o;
  o.block_size_bytes = 64 * kKiB;
  o.queue_depth = 8;
  o.threads = 2;
  ZO_ENGINE_OR_SKIP(e, o);
  File f = open("direct", true);
  EXPECT_EQ(f.direct(), direct_);
  ASSERT_TRUE(f.preallocate(8 * kMiB).is_ok());
  const uint64_t len = 3 * kMiB + 4096, off = 4096 * 3;
  AlignedBuffer src = random_buffer(len, 7);
  ASSERT_TRUE(e->write(f, off, src.bytes()).is_ok());
  AlignedBuffer dst = AlignedBuffer::allocate(len).value();
  Status s = e->read(f, off, dst.bytes());
  ASSERT_TRUE(s.is_ok()) << s.to_string();
  EXPECT_EQ(std::memcmp(dst.data(), src.data(), len), 0);
  auto ref = pread_all(f.path());
  ASSERT_EQ(ref.size(), 8 * kMiB);  // preallocated, written in place
  EXPECT_EQ(std::memcmp(ref.data() + off, src.data(), len), 0);
  const IoStats st = e->stats();
  EXPECT_EQ(st.bytes_written, len);
  EXPECT_EQ(st.bytes_read, len);
  EXPECT_EQ(st.pieces, 2 * ((len + o.block_size_bytes - 1) / o.block_size_bytes));
  // Busy time counts only while requests are outstanding: it does not grow while the engine idles.
  EXPECT_GT(st.busy_s, 0.0);
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_EQ(e->stats().busy_s, st.busy_s);
}

TEST_P(BackendTest, DirectRejectsUnalignedRequestsClearlyAndWritesNothing) {
  if (!direct_) GTEST_SKIP() << "the test directory does not support O_DIRECT";
  ZO_ENGINE_OR_SKIP(e);
  File f = open("unaligned", true);
  ASSERT_TRUE(f.direct());
  AlignedBuffer src = random_buffer(3 * 4096, 3);
  ASSERT_TRUE(e->write(f, 0, src.bytes()).is_ok());
  AlignedBuffer other = random_buffer(2 * 4096, 4);
  for (auto [ptr, off, len] : {std::tuple{other.data() + 1, uint64_t{0}, uint64_t{4096}},
                               std::tuple{other.data(), uint64_t{100}, uint64_t{4096}},
                               std::tuple{other.data(), uint64_t{4096}, uint64_t{1000}}}) {
    auto t = e->submit(write_request(f, off, ptr, len));
    ASSERT_FALSE(t.is_ok());
    EXPECT_EQ(t.status().code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(t.status().message(), HasSubstr(f.path()));
    EXPECT_THAT(t.status().message(), HasSubstr("offset " + std::to_string(off)));
    EXPECT_THAT(t.status().message(), HasSubstr("O_DIRECT"));
  }
  auto ref = pread_all(f.path());
  ASSERT_EQ(ref.size(), src.size());
  EXPECT_EQ(std::memcmp(ref.data(), src.data(), src.size()), 0) << "a rejected request changed the file";
}

TEST_P(BackendTest, ReadPastEndOfFileIsAnErrorWithContext) {
  ZO_ENGINE_OR_SKIP(e);
  File f = open("short", false);
  AlignedBuffer src = random_buffer(10000, 5);
  ASSERT_TRUE(e->write(f, 0, src.bytes()).is_ok());
  AlignedBuffer dst = AlignedBuffer::allocate(16384).value();
  Status s = e->read(f, 0, dst.bytes());
  ASSERT_FALSE(s.is_ok());
  EXPECT_THAT(s.message(), HasSubstr(f.path()));
  EXPECT_THAT(s.message(), HasSubstr("end of file"));
  EXPECT_THAT(s.message(), HasSubstr("offset 10000"));
  EXPECT_EQ(std::memcmp(dst.data(), src.data(), 10000), 0) << "the bytes that exist were read";
}

TEST_P(BackendTest, KernelRejectionsCompleteEveryPieceWithTheError) {
  // Writes to a read-only fd are rejected at submission by libaio (io_submit stops at the bad iocb)
  // and at completion by io_uring and pwrite; either way every piece completes, none hangs.
  IoOptions o;
  o.block_size_bytes = 4096;
  o.queue_depth = 8;
  ZO_ENGINE_OR_SKIP(e, o);
  { File create = open("readonly", direct_); }
  auto ro = File::open(dir_->file("readonly"), OpenMode::kRead, direct_);
  ASSERT_TRUE(ro.is_ok());
  AlignedBuffer src = random_buffer(64 * kKiB, 19);
  Status s = e->write(*ro, 0, src.bytes());
  EXPECT_EQ(s.sys_errno(), EBADF) << s.to_string();
  EXPECT_THAT(s.message(), HasSubstr("write " + ro->path() + " offset "));
  // The engine is still usable afterwards.
  File rw = open("after_rejection", direct_);
  EXPECT_TRUE(e->write(rw, 0, src.bytes()).is_ok());
}

TEST_P(BackendTest, ConcurrentSubmittersKeepTheirBytesApart) {
  IoOptions o;
  o.block_size_bytes = 16 * kKiB;
  o.queue_depth = 16;
  o.threads = 2;
  ZO_ENGINE_OR_SKIP(e, o);
  File f = open("concurrent", direct_);
  constexpr int kThreads = 4;
  constexpr uint64_t kRegion = kMiB, kChunk = 64 * kKiB;
  ASSERT_TRUE(f.preallocate(kThreads * kRegion).is_ok());
  std::vector<AlignedBuffer> data;
  for (int t = 0; t < kThreads; ++t) data.push_back(random_buffer(kRegion, 100 + t));
  std::vector<std::thread> threads;
  std::vector<Status> results(kThreads);
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::vector<Ticket> tickets;
      for (uint64_t c = 0; c < kRegion; c += kChunk) {
        auto tk = e->submit(write_request(f, t * kRegion + c, data[t].data() + c, kChunk));
        if (!tk.is_ok()) {
          results[t] = tk.status();
          return;
        }
        tickets.push_back(*tk);
      }
      // Half by poll, half by wait.
      for (size_t i = 0; i < tickets.size(); ++i) {
        Status s;
        if (i % 2 == 0) {
          std::optional<Status> p;
          while (!(p = e->poll(tickets[i]))) std::this_thread::yield();
          s = std::move(*p);
        } else {
          s = e->wait(tickets[i]);
        }
        if (!s.is_ok() && results[t].is_ok()) results[t] = s;
      }
      AlignedBuffer back = AlignedBuffer::allocate(kRegion).value();
      Status s = e->read(f, t * kRegion, back.bytes());
      if (!s.is_ok()) results[t] = s;
      else if (std::memcmp(back.data(), data[t].data(), kRegion) != 0)
        results[t] = corruption("thread " + std::to_string(t));
    });
  }
  for (auto& th : threads) th.join();
  for (int t = 0; t < kThreads; ++t) EXPECT_TRUE(results[t].is_ok()) << results[t].to_string();
  auto ref = pread_all(f.path());
  for (int t = 0; t < kThreads; ++t) EXPECT_EQ(std::memcmp(ref.data() + t * kRegion, data[t].data(), kRegion), 0);
}

TEST_P(BackendTest, TicketsAreConsumedOnceAndWaitAllCollectsTheRest) {
  ZO_ENGINE_OR_SKIP(e);
  File f = open("tickets", false);
  AlignedBuffer src = random_buffer(8192, 9);
  auto t1 = e->submit(write_request(f, 0, src.data(), 4096));
  auto t2 = e->submit(write_request(f, 4096, src.data() + 4096, 4096));
  auto t0 = e->submit(write_request(f, 0, src.data(), 0));
  ASSERT_TRUE(t1.is_ok() && t2.is_ok() && t0.is_ok());
  EXPECT_TRUE(e->wait(*t1).is_ok());
  EXPECT_EQ(e->wait(*t1).code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(e->wait_all().is_ok());
  EXPECT_EQ(e->wait(*t2).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(pread_all(f.path()).size(), 8192u);
}

TEST_P(BackendTest, ConcurrentConsumersOfOneTicketEachGetAnAnswer) {
  // wait(t) and wait_all() racing for the same in-flight ticket: one consumes it, the other gets
  // InvalidArgument (or skips it); neither may touch the consumed ticket (ASan catches that).
  ZO_ENGINE_OR_SKIP(e);
  File f = open("consumers", false);
  AlignedBuffer src = random_buffer(64 * kKiB, 31);
  for (int i = 0; i < 200; ++i) {
    auto t = e->submit(write_request(f, 0, src.data(), src.size()));
    ASSERT_TRUE(t.is_ok());
    Status from_wait, from_wait_all;
    std::thread a([&] { from_wait_all = e->wait_all(); });
    std::thread b([&] { from_wait = e->wait(*t); });
    a.join();
    b.join();
    EXPECT_TRUE(from_wait_all.is_ok()) << from_wait_all.to_string();
    EXPECT_TRUE(from_wait.is_ok() || from_wait.code() == StatusCode::kInvalidArgument) << from_wait.to_string();
    EXPECT_EQ(e->wait(*t).code(), StatusCode::kInvalidArgument);  // consumed exactly once
  }
}

TEST_P(BackendTest, ABatchWhoseTotalOverflowsIsRejectedBeforeAnythingIsQueued) {
  ZO_ENGINE_OR_SKIP(e);
  File f = open("overflow", false);
  AlignedBuffer buf = random_buffer(4096, 5);
  const uint64_t half = uint64_t{1} << 63;  // each request is valid on its own; the sum wraps to 0
  const IoRequest batch[] = {write_request(f, 0, buf.data(), half), write_request(f, 0, buf.data(), half)};
  auto t = e->submit(batch);
  ASSERT_FALSE(t.is_ok());
  EXPECT_EQ(t.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(t.status().message(), ::testing::HasSubstr("totals more than 2^64 bytes"));
  EXPECT_TRUE(e->wait_all().is_ok());
  EXPECT_EQ(pread_all(f.path()).size(), 0u);
}

TEST_P(BackendTest, SingleSubmitAndNoOverlapStillRoundTrip) {
  IoOptions o;
  o.block_size_bytes = 4096;
  o.queue_depth = 4;
  o.single_submit = true;
  o.overlap_events = false;
  ZO_ENGINE_OR_SKIP(e, o);
  File f = open("nooverlap", direct_);
  AlignedBuffer src = random_buffer(256 * kKiB, 11);
  ASSERT_TRUE(e->write(f, 0, src.bytes()).is_ok());
  AlignedBuffer dst = AlignedBuffer::allocate(src.size()).value();
  ASSERT_TRUE(e->read(f, 0, dst.bytes()).is_ok());
  EXPECT_EQ(std::memcmp(dst.data(), src.data(), src.size()), 0);
}

TEST_P(BackendTest, RegisteredBuffersRoundTrip) {
  IoOptions o;
  o.block_size_bytes = 64 * kKiB;
  o.threads = 2;
  ZO_ENGINE_OR_SKIP(e, o);
  AlignedBuffer pool = AlignedBuffer::allocate(kMiB).value();
  std::span<std::byte> regions[] = {pool.bytes().subspan(0, kMiB / 2), pool.bytes().subspan(kMiB / 2)};
  Status r = e->register_buffers(regions);
  if (!r.is_ok()) GTEST_SKIP() << "kernel refused fixed buffers: " << r.to_string();
  File f = open("fixed", direct_);
  AlignedBuffer src = random_buffer(kMiB, 12);
  std::memcpy(pool.data(), src.data(), kMiB);
  ASSERT_TRUE(e->write(f, 0, pool.bytes()).is_ok());
  std::memset(pool.data(), 0, kMiB);
  ASSERT_TRUE(e->read(f, 0, pool.bytes()).is_ok());
  EXPECT_EQ(std::memcmp(pool.data(), src.data(), kMiB), 0);
  EXPECT_EQ(e->register_buffers(regions).code(), StatusCode::kFailedPrecondition);
}

// ---- fault injection: every error reaches the caller with its context ---------------------------

TEST_P(BackendTest, InjectedEioReachesTheCallerWithPathOffsetLengthAndErrno) {
  auto faults = std::make_shared<FaultInjector>();
  IoOptions o;
  o.block_size_bytes = 64 * kKiB;
  ZO_ENGINE_OR_SKIP(e, o, faults);
  File f = open("eio", direct_);
  AlignedBuffer src = random_buffer(kMiB, 13);
  ASSERT_TRUE(e->write(f, 0, src.bytes()).is_ok());
  faults->add(FaultRule{FaultKind::kEio, IoOp::kRead, "eio", 5 * 64 * kKiB + 10, 1});
  AlignedBuffer dst = AlignedBuffer::allocate(kMiB).value();
  Status s = e->read(f, 0, dst.bytes());
  ASSERT_FALSE(s.is_ok());
  EXPECT_EQ(s.code(), StatusCode::kIoError);
  EXPECT_EQ(s.sys_errno(), EIO);
  EXPECT_THAT(s.message(),
              HasSubstr("read " + f.path() + " offset " + std::to_string(5 * 64 * kKiB) + " length 65536"));
  EXPECT_THAT(s.message(), HasSubstr(std::strerror(EIO)));
  EXPECT_EQ(faults->injected(), 1u);
  // The fault was one-shot: the same read now succeeds and the engine is still usable.
  ASSERT_TRUE(e->read(f, 0, dst.bytes()).is_ok());
  EXPECT_EQ(std::memcmp(dst.data(), src.data(), kMiB), 0);
}

TEST_P(BackendTest, InjectedEnospcOnWriteIsNoSpace) {
  auto faults = std::make_shared<FaultInjector>();
  ZO_ENGINE_OR_SKIP(e, IoOptions{}, faults);
  File f = open("enospc", direct_);
  faults->add(FaultRule{FaultKind::kNoSpace, IoOp::kWrite, "", 0, 1});
  AlignedBuffer src = random_buffer(8192, 14);
  Status s = e->write(f, 0, src.bytes());
  EXPECT_EQ(s.code(), StatusCode::kNoSpace) << s.to_string();
  EXPECT_THAT(s.message(), HasSubstr("write " + f.path() + " offset 0 length 8192"));
}

TEST_P(BackendTest, ShortTransfersAreResubmittedAndTransientErrorsRetried) {
  auto faults = std::make_shared<FaultInjector>();
  IoOptions o;
  o.block_size_bytes = 64 * kKiB;
  o.queue_depth = 4;
  ZO_ENGINE_OR_SKIP(e, o, faults);
  File f = open("short_transfer", direct_);
  faults->add(
      FaultRule{FaultKind::kShortTransfer, IoOp::kWrite, "", 65535, 3});  // the remainder is shortened again, 3 times
  faults->add(FaultRule{FaultKind::kEagain, IoOp::kWrite, "", 200000, 2});
  faults->add(FaultRule{FaultKind::kShortTransfer, IoOp::kRead, "", 300000, 1});
  faults->add(FaultRule{FaultKind::kEintr, IoOp::kRead, "", 500000, 2});
  AlignedBuffer src = random_buffer(kMiB, 15);
  ASSERT_TRUE(e->write(f, 0, src.bytes()).is_ok());
  AlignedBuffer dst = AlignedBuffer::allocate(kMiB).value();
  Status s = e->read(f, 0, dst.bytes());
  ASSERT_TRUE(s.is_ok()) << s.to_string();
  EXPECT_EQ(std::memcmp(dst.data(), src.data(), kMiB), 0);
  EXPECT_EQ(faults->injected(), 8u);
  const IoStats st = e->stats();
  EXPECT_EQ(st.short_resubmits, 4u);
  EXPECT_EQ(st.transient_retries, 4u);
  EXPECT_EQ(st.bytes_written, kMiB);
  EXPECT_EQ(st.errors, 0u);
}

// EAGAIN or EINTR that never clears (a device stuck busy, a signal storm) must not spin forever:
// past the engine's cap (10000 retries of one piece) the piece fails with its path, offset, length
// and errno, and the engine stays usable.
TEST_P(BackendTest, EndlessTransientErrorsFailAtTheRetryCapNamingThePiece) {
  for (const auto& [kind, err] : {std::pair{FaultKind::kEagain, EAGAIN}, std::pair{FaultKind::kEintr, EINTR}}) {
    auto faults = std::make_shared<FaultInjector>();
    IoOptions o;
    o.block_size_bytes = 64 * kKiB;
    ZO_ENGINE_OR_SKIP(e, o, faults);
    File f = open("endless", direct_);
    AlignedBuffer src = random_buffer(2 * 64 * kKiB, 16);
    ASSERT_TRUE(e->write(f, 0, src.bytes()).is_ok());
    faults->add(FaultRule{kind, IoOp::kRead, "endless", 64 * kKiB, /*times=*/-1});
    AlignedBuffer dst = AlignedBuffer::allocate(2 * 64 * kKiB).value();
    Status s = e->read(f, 0, dst.bytes());
    ASSERT_FALSE(s.is_ok()) << "an endless transient error ends in an error";
    EXPECT_EQ(s.sys_errno(), err);
    EXPECT_THAT(s.message(), HasSubstr("read " + f.path() + " offset 65536 length 65536"));
    EXPECT_THAT(s.message(), HasSubstr("still failing after 10000 retries"));
    EXPECT_EQ(faults->injected(), 10001u) << "the first failure and 10000 retries";
    faults->clear();
    ASSERT_TRUE(e->read(f, 0, dst.bytes()).is_ok());
    EXPECT_EQ(std::memcmp(dst.data(), src.data(), dst.size()), 0);
  }
}

TEST_P(BackendTest, AFailedTicketDoesNotDisturbOthers) {
  auto faults = std::make_shared<FaultInjector>();
  IoOptions o;
  o.block_size_bytes = 4096;
  o.queue_depth = 2;
  ZO_ENGINE_OR_SKIP(e, o, faults);
  File bad = open("bad_file", direct_);
  File good = open("good_file", direct_);
  faults->add(FaultRule{FaultKind::kEio, IoOp::kWrite, "bad_file", 0, -1});
  AlignedBuffer src = random_buffer(256 * kKiB, 16);
  auto tb = e->submit(write_request(bad, 0, src.data(), src.size()));
  auto tg = e->submit(write_request(good, 0, src.data(), src.size()));
  ASSERT_TRUE(tb.is_ok() && tg.is_ok());
  EXPECT_EQ(e->wait(*tb).sys_errno(), EIO);
  EXPECT_TRUE(e->wait(*tg).is_ok());
  auto ref = pread_all(good.path());
  ASSERT_EQ(ref.size(), src.size());
  EXPECT_EQ(std::memcmp(ref.data(), src.data(), src.size()), 0);
}

// ---- every backend against every other ----------------------------------------------------------

TEST(BackendsAgree, EachReadsWhatEveryOtherWrote) {
  TempDir dir(test_root());
  const bool direct = direct_supported(dir.path());
  std::vector<std::unique_ptr<IoEngine>> engines;
  for (Backend b : {Backend::kPsync, Backend::kUring, Backend::kAio}) {
    IoOptions o;
    o.backend = b;
    o.block_size_bytes = 128 * kKiB;
    o.queue_depth = 8;
    auto e = IoEngine::create(o);
    if (e.is_ok()) engines.push_back(std::move(e).value());
    else
      std::printf("[ io ] %s not compared: %s\n", std::string(backend_name(b)).c_str(), e.status().to_string().c_str());
  }
  ASSERT_GE(engines.size(), 1u);
  auto f = File::open(dir.file("agree"), OpenMode::kCreate, direct);
  ASSERT_TRUE(f.is_ok());
  constexpr uint64_t kRegion = 2 * kMiB;
  ASSERT_TRUE(f->preallocate(engines.size() * kRegion).is_ok());
  std::vector<AlignedBuffer> data;
  for (size_t i = 0; i < engines.size(); ++i) {
    data.push_back(random_buffer(kRegion, 200 + static_cast<uint32_t>(i)));
    ASSERT_TRUE(engines[i]->write(*f, i * kRegion, data[i].bytes()).is_ok());
  }
  const auto ref = pread_all(f->path());
  for (size_t i = 0; i < engines.size(); ++i)
    ASSERT_EQ(std::memcmp(ref.data() + i * kRegion, data[i].data(), kRegion), 0) << backend_name(engines[i]->backend());
  for (auto& e : engines) {
    AlignedBuffer all = AlignedBuffer::allocate(ref.size()).value();
    ASSERT_TRUE(e->read(*f, 0, all.bytes()).is_ok());
    EXPECT_EQ(std::memcmp(all.data(), ref.data(), ref.size()), 0)
        << backend_name(e->backend()) << " disagrees with pread";
  }
}

TEST(AutoBackend, PicksABackendAndSaysWhyItFellBack) {
  auto e = IoEngine::create(IoOptions{});
  ASSERT_TRUE(e.is_ok()) << e.status().to_string();
  EXPECT_NE((*e)->backend(), Backend::kAuto);
  if ((*e)->backend() != Backend::kUring) { EXPECT_FALSE((*e)->fallback_reason().empty()); }
  std::printf("[ io ] auto picked %s%s%s\n", std::string(backend_name((*e)->backend())).c_str(),
              (*e)->fallback_reason().empty() ? "" : " because ", (*e)->fallback_reason().c_str());
}

// Makes the given system call fail with `err` in this process from now on, as a container's
// seccomp profile does. Only used inside death-test children.
bool deny_syscall(long nr, int err) {
  sock_filter filter[] = {
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, nr)),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, static_cast<uint32_t>(nr), 0, 1),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | (static_cast<uint32_t>(err) & SECCOMP_RET_DATA)),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
  };
  sock_fprog prog{static_cast<unsigned short>(sizeof(filter) / sizeof(filter[0])), filter};
  return ::prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0 && ::prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog) == 0;
}

// In a child: io_uring_setup → EPERM (and, with `deny_aio`, io_setup → ENOSYS); then checks that
// auto falls back with the reason, that asking for io_uring by name is Unavailable, and that the
// fallback engine moves data. Exits 0 on success, 1 with a message otherwise.
[[noreturn]] void fallback_child(bool deny_aio) {
  auto die = [](const std::string& why) {
    std::fprintf(stderr, "%s\n", why.c_str());
    std::_Exit(1);
  };
  if (!deny_syscall(__NR_io_uring_setup, EPERM)) die("cannot install the seccomp filter");
  if (deny_aio && !deny_syscall(__NR_io_setup, ENOSYS)) die("cannot install the seccomp filter");
  IoOptions named;
  named.backend = Backend::kUring;
  auto refused = IoEngine::create(named);
  if (refused.is_ok() || refused.status().code() != StatusCode::kUnavailable || refused.status().sys_errno() != EPERM)
    die("io_uring by name: " + refused.status().to_string());
  auto e = IoEngine::create(IoOptions{});
  if (!e.is_ok()) die(e.status().to_string());
  const Backend want = deny_aio ? Backend::kPsync : Backend::kAio;
  if ((*e)->backend() != want) die(std::string("auto chose ") + std::string(backend_name((*e)->backend())));
  if ((*e)->fallback_reason().find("Operation not permitted") == std::string::npos)
    die("fallback reason: " + (*e)->fallback_reason());
  TempDir dir(test_root());
  auto f = File::open(dir.file("fallback"), OpenMode::kCreate, true);
  if (!f.is_ok()) die(f.status().to_string());
  AlignedBuffer src = random_buffer(256 * kKiB, 21);
  AlignedBuffer dst = AlignedBuffer::allocate(src.size()).value();
  Status s = (*e)->write(*f, 0, src.bytes());
  if (s.is_ok()) s = (*e)->read(*f, 0, dst.bytes());
  if (!s.is_ok()) die(s.to_string());
  if (std::memcmp(src.data(), dst.data(), src.size()) != 0) die("data mismatch after fallback");
  std::_Exit(0);
}

// The fallback tests need the backends they take away to work in the first place.
std::string unusable(std::initializer_list<Backend> backends) {
  for (Backend b : backends) {
    IoOptions o;
    o.backend = b;
    auto e = IoEngine::create(o);
    if (!e.is_ok()) return e.status().to_string();
  }
  return "";
}

TEST(BackendFallback, AutoFallsBackToLibaioWhenIoUringIsRefused) {
  if (auto why = unusable({Backend::kUring, Backend::kAio}); !why.empty()) GTEST_SKIP() << why;
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(fallback_child(false), ::testing::ExitedWithCode(0), "falling back");
}

TEST(BackendFallback, AutoFallsBackToThePoolWhenBothAreRefused) {
  if (auto why = unusable({Backend::kUring, Backend::kAio}); !why.empty()) GTEST_SKIP() << why;
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(fallback_child(true), ::testing::ExitedWithCode(0), "libaio not usable");
}

// In a child: thread creation (clone3/clone) fails with EAGAIN, as under RLIMIT_NPROC or a
// container's pids.max; creating an engine on `backend` must return that error, not terminate.
[[noreturn]] void no_threads_child(Backend backend) {
  auto die = [](const std::string& why) {
    std::fprintf(stderr, "%s\n", why.c_str());
    std::_Exit(1);
  };
#ifdef __NR_clone3
  if (!deny_syscall(__NR_clone3, EAGAIN)) die("cannot install the seccomp filter");
#endif
  if (!deny_syscall(__NR_clone, EAGAIN)) die("cannot install the seccomp filter");
  IoOptions o;
  o.backend = backend;
  o.threads = 2;
  auto e = IoEngine::create(o);
  if (e.is_ok()) die("engine created without threads?");
  std::fprintf(stderr, "refused: %s\n", e.status().to_string().c_str());
  if (e.status().sys_errno() != EAGAIN) die("expected EAGAIN, got " + e.status().to_string());
  std::_Exit(0);
}

TEST(ThreadCreation, RefusedThreadsAreAnErrorNotATerminate) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  // The pool backend starts helper threads in its queue; the others only the engine's workers.
  EXPECT_EXIT(no_threads_child(Backend::kPsync), ::testing::ExitedWithCode(0), "refused: .*pread/pwrite pool thread");
  if (auto why = unusable({Backend::kUring}); why.empty()) {
    EXPECT_EXIT(no_threads_child(Backend::kUring), ::testing::ExitedWithCode(0), "refused: .*I/O worker thread 1 of 2");
  }
}

TEST(Tmpfs, DirectFallsBackToBufferedAndSaysWhy) {
  struct statfs sf {};
  if (::statfs("/dev/shm", &sf) != 0 || sf.f_type != TMPFS_MAGIC) GTEST_SKIP() << "/dev/shm is not tmpfs here";
  TempDir dir("/dev/shm");
  ::testing::internal::CaptureStderr();
  auto f = File::open(dir.file("on_tmpfs"), OpenMode::kCreate, /*direct=*/true);
  const std::string logged = ::testing::internal::GetCapturedStderr();
  ASSERT_TRUE(f.is_ok()) << f.status().to_string();
  EXPECT_THAT(logged, HasSubstr("using buffered I/O for " + dir.file("on_tmpfs")));
  EXPECT_FALSE(f->direct());
  EXPECT_EQ(f->mem_align(), 1u);
  EXPECT_THAT(f->buffered_reason(), HasSubstr("O_DIRECT"));
  std::printf("[ io ] tmpfs: %s\n", f->buffered_reason().c_str());
  // Issue 19: said once per file system, not for every file of every save.
  ::testing::internal::CaptureStderr();
  auto g = File::open(dir.file("also_on_tmpfs"), OpenMode::kCreate, /*direct=*/true);
  const std::string again = ::testing::internal::GetCapturedStderr();
  ASSERT_TRUE(g.is_ok()) << g.status().to_string();
  EXPECT_FALSE(g->direct());
  EXPECT_THAT(g->buffered_reason(), HasSubstr("O_DIRECT"));
  EXPECT_EQ(again.find("using buffered I/O"), std::string::npos) << again;
  auto e = IoEngine::create(IoOptions{});
  ASSERT_TRUE(e.is_ok());
  ASSERT_TRUE(f->preallocate(kMiB).is_ok());
  AlignedBuffer src = random_buffer(100001, 17);  // odd size: fine, the file is buffered
  ASSERT_TRUE((*e)->write(*f, 13, src.bytes()).is_ok());
  std::vector<std::byte> dst(src.size());
  ASSERT_TRUE((*e)->read(*f, 13, dst).is_ok());
  EXPECT_EQ(std::memcmp(dst.data(), src.data(), src.size()), 0);
}

TEST(FileOpen, MissingFileNamesThePathAndErrno) {
  auto f = File::open(test_root() + "/no/such/dir/file", OpenMode::kRead, true);
  ASSERT_FALSE(f.is_ok());
  EXPECT_EQ(f.status().sys_errno(), ENOENT);
  EXPECT_THAT(f.status().message(), HasSubstr("/no/such/dir/file"));
}

std::string backend_param_name(const ::testing::TestParamInfo<Backend>& info) {
  return info.param == Backend::kUring ? "io_uring" : info.param == Backend::kAio ? "libaio" : "psync";
}

INSTANTIATE_TEST_SUITE_P(Backends, BackendTest, ::testing::Values(Backend::kUring, Backend::kAio, Backend::kPsync),
                         backend_param_name);

// ---- Env: the file operations above the engine -------------------------------------------------

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

TEST(PosixEnv, WritesWholeFilesOnceAndSwapsDirectories) {
  TempDir dir(test_root());
  Env* env = Env::posix();
  const std::string path = dir.file("manifest.json");
  ZO_ASSERT_OK(env->write_file(path, "{\"a\": 1}\n"));
  EXPECT_EQ(slurp(path), "{\"a\": 1}\n");
  Status again = env->write_file(path, "other");
  EXPECT_FALSE(again.is_ok()) << "a file is created, never overwritten";
  EXPECT_THAT(again.message(), HasSubstr("creating " + path));
  EXPECT_EQ(slurp(path), "{\"a\": 1}\n");
  ZO_ASSERT_OK(env->sync_dir(dir.path()));
  EXPECT_THAT(env->sync_dir(dir.file("missing")).message(), HasSubstr("missing"));

  // rename over a file; then a directory moved, and swapped with a non-empty one.
  ZO_ASSERT_OK(env->write_file(dir.file("latest.tmp"), "step-2\n"));
  ZO_ASSERT_OK(env->rename(dir.file("latest.tmp"), path));
  EXPECT_EQ(slurp(path), "step-2\n");
  ZO_ASSERT_OK(env->make_dir(dir.file("a")));
  EXPECT_EQ(env->make_dir(dir.file("a")).code(), StatusCode::kAlreadyExists);
  ZO_ASSERT_OK(env->write_file(dir.file("a/x"), "new"));
  bool exchanged = true;
  ZO_ASSERT_OK(env->rename_or_exchange(dir.file("a"), dir.file("b"), &exchanged));
  EXPECT_FALSE(exchanged);
  ZO_ASSERT_OK(env->make_dir(dir.file("c")));
  ZO_ASSERT_OK(env->write_file(dir.file("c/x"), "newer"));
  ZO_ASSERT_OK(env->rename_or_exchange(dir.file("c"), dir.file("b"), &exchanged));
  EXPECT_TRUE(exchanged);
  EXPECT_EQ(slurp(dir.file("b/x")), "newer");
  EXPECT_EQ(slurp(dir.file("c/x")), "new") << "the old contents wait at the source name";
  ZO_ASSERT_OK(env->remove_all(dir.file("c")));
  ZO_ASSERT_OK(env->remove_all(dir.file("c")));  // already gone: fine
  EXPECT_FALSE(std::filesystem::exists(dir.file("c")));
}

TEST(FaultyEnv, FailsWhatTheRulesChooseAndLeavesNothingHalfDone) {
  TempDir dir(test_root());
  auto faults = std::make_shared<FaultInjector>();
  FaultyEnv env(Env::posix(), faults);
  // ENOSPC writing one file: an error naming it, no file, and the next write of it succeeds.
  faults->add({.kind = FaultKind::kNoSpace, .op = IoOp::kWrite, .path_contains = "manifest.json"});
  Status full = env.write_file(dir.file("manifest.json"), "{}");
  EXPECT_EQ(full.code(), StatusCode::kNoSpace);
  EXPECT_THAT(full.message(), HasSubstr(dir.file("manifest.json")));
  EXPECT_FALSE(std::filesystem::exists(dir.file("manifest.json")));
  ZO_ASSERT_OK(env.write_file(dir.file("manifest.json"), "{}"));
  // A failed fdatasync of a file and fsync of a directory.
  faults->add({.kind = FaultKind::kEio, .op = IoOp::kSync, .path_contains = "state.json"});
  EXPECT_EQ(env.write_file(dir.file("state.json"), "{}").code(), StatusCode::kIoError);
  EXPECT_FALSE(std::filesystem::exists(dir.file("state.json")));
  faults->add({.kind = FaultKind::kEio, .op = IoOp::kSync, .path_contains = dir.path()});
  Status sync = env.sync_dir(dir.path());
  EXPECT_EQ(sync.code(), StatusCode::kIoError);
  EXPECT_THAT(sync.message(), HasSubstr("fsync of directory " + dir.path()));
  // A rename aimed at by its destination: nothing moves.
  ZO_ASSERT_OK(env.write_file(dir.file("latest.tmp"), "step-3\n"));
  faults->add({.kind = FaultKind::kEio, .op = IoOp::kRename, .path_contains = "-> " + dir.file("latest")});
  EXPECT_FALSE(env.rename(dir.file("latest.tmp"), dir.file("latest")).is_ok());
  EXPECT_TRUE(std::filesystem::exists(dir.file("latest.tmp")));
  EXPECT_FALSE(std::filesystem::exists(dir.file("latest")));
  // Transient faults are retried: the operation succeeds.
  faults->add({.kind = FaultKind::kEintr, .op = IoOp::kRename});
  ZO_ASSERT_OK(env.rename(dir.file("latest.tmp"), dir.file("latest")));
  EXPECT_EQ(slurp(dir.file("latest")), "step-3\n");
  EXPECT_EQ(faults->injected(), 5u);
  // Rules are used up: the same operations now pass.
  ZO_ASSERT_OK(env.sync_dir(dir.path()));
}

TEST(PosixEnv, ReadsExactlyAndRefusesWhatIsNotARegularFile) {
  TempDir dir(test_root());
  Env* env = Env::posix();
  ZO_ASSERT_OK(env->write_file(dir.file("w"), "0123456789"));
  auto file = env->open_read(dir.file("w"), "weights");
  ZO_ASSERT_OK(file.status());
  EXPECT_EQ((*file)->size_bytes(), 10u);
  std::string out(4, '?');
  ZO_ASSERT_OK((*file)->read_exact(3, std::as_writable_bytes(std::span(out))));
  EXPECT_EQ(out, "3456");
  Status past = (*file)->read_exact(8, std::as_writable_bytes(std::span(out)));
  EXPECT_EQ(past.code(), StatusCode::kCorruption);
  EXPECT_THAT(past.message(), HasSubstr(dir.file("w") + ": end of file at offset 10, 2 bytes missing"));

  auto whole = env->read_file(dir.file("w"), "config file", 10);
  ZO_ASSERT_OK(whole.status());
  EXPECT_EQ(*whole, "0123456789");
  Status big = env->read_file(dir.file("w"), "config file", 9).status();
  EXPECT_EQ(big.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(big.message(), HasSubstr("config file " + dir.file("w") + " is 10 bytes, over the 9-byte limit"));
  EXPECT_EQ(big.sys_errno(), EFBIG) << "a caller can tell a file too large from one of the wrong kind";

  // Missing, a directory, a FIFO: refused by name, never opened (a FIFO would block).
  EXPECT_EQ(env->open_read(dir.file("none"), "data file").status().code(), StatusCode::kNotFound);
  EXPECT_THAT(env->open_read(dir.path(), "data file").status().message(),
              HasSubstr("is a directory, not a regular file"));
  ASSERT_EQ(::mkfifo(dir.file("fifo").c_str(), 0644), 0);
  EXPECT_THAT(env->open_read(dir.file("fifo"), "data file").status().message(),
              HasSubstr("data file " + dir.file("fifo") + " is a FIFO (named pipe), not a regular file"));
  EXPECT_NE(env->read_file(dir.file("fifo"), "data file", 9).status().sys_errno(), EFBIG);
}

TEST(PosixEnv, AppendsMakesDirectoriesAndAnswersQueries) {
  TempDir dir(test_root());
  Env* env = Env::posix();
  {
    auto log = env->open_append(dir.file("metrics.jsonl"));
    ZO_ASSERT_OK(log.status());
    ZO_ASSERT_OK((*log)->append("{\"step\": 1}\n"));
    ZO_ASSERT_OK((*log)->sync());
    ZO_ASSERT_OK((*log)->close());
    EXPECT_EQ((*log)->append("x").code(), StatusCode::kFailedPrecondition);
  }
  {
    auto log = env->open_append(dir.file("metrics.jsonl"));  // reopened: appends, keeps what was there
    ZO_ASSERT_OK(log.status());
    ZO_ASSERT_OK((*log)->append("{\"step\": 2}\n"));
  }
  EXPECT_EQ(slurp(dir.file("metrics.jsonl")), "{\"step\": 1}\n{\"step\": 2}\n");

  std::string top;
  ZO_ASSERT_OK(env->make_dirs(dir.file("a/b/c"), &top));
  EXPECT_EQ(top, dir.file("a"));
  ZO_ASSERT_OK(env->make_dirs(dir.file("a/b/c"), &top));
  EXPECT_EQ(top, "") << "nothing was created the second time";
  ZO_ASSERT_OK(env->make_dirs(dir.file("a/b/d/"), &top));
  EXPECT_EQ(top, dir.file("a/b/d"));
  Status through_file = env->make_dirs(dir.file("metrics.jsonl/x"));
  EXPECT_THAT(through_file.message(), HasSubstr(dir.file("metrics.jsonl") + " exists and is not a directory"));

  EXPECT_EQ(*env->path_kind(dir.file("a")), PathKind::kDirectory);
  EXPECT_EQ(*env->path_kind(dir.file("metrics.jsonl")), PathKind::kFile);
  EXPECT_EQ(*env->path_kind(dir.file("none")), PathKind::kMissing);
  EXPECT_EQ(*env->path_kind(dir.file("metrics.jsonl/x")), PathKind::kMissing);
  EXPECT_EQ(*env->file_size(dir.file("metrics.jsonl")), 24u);
  EXPECT_THAT(*env->list_dir(dir.path()), ::testing::ElementsAre("a", "metrics.jsonl"));
  EXPECT_THAT(*env->list_dir(dir.file("a/b")), ::testing::ElementsAre("c", "d"));
  EXPECT_FALSE(env->list_dir(dir.file("none")).is_ok());
  auto free = env->free_bytes(dir.path());
  ZO_ASSERT_OK(free.status());
  EXPECT_GT(*free, 0u);

  // One directory under two spellings (a symlink, "..", a missing tail) gives one canonical path.
  ASSERT_EQ(::symlink(dir.file("a/b").c_str(), dir.file("link").c_str()), 0);
  auto real = env->canonical_path(dir.file("a/b/c"));
  ZO_ASSERT_OK(real.status());
  EXPECT_EQ(*env->canonical_path(dir.file("link/c")), *real);
  EXPECT_EQ(*env->canonical_path(dir.file("a/b/d/../c")), *real);
  EXPECT_EQ(*env->canonical_path(dir.file("link/new/x")), *env->canonical_path(dir.file("a/b")) + "/new/x");
  EXPECT_EQ(real->front(), '/');
}

// Note [Output files], issue 40: `--trace v` with v a directory of the user's once left v replaced
// by the trace. A directory, a FIFO or a path under a file is refused with one line and left as it
// was; a file is replaced whole by rename, leaving no temporary.
TEST(PosixEnv, PublishesFilesAndNeverRemovesWhatIsNotOne) {
  TempDir dir(test_root());
  Env* env = Env::posix();
  ZO_ASSERT_OK(env->make_dirs(dir.file("v/sub")));
  ZO_ASSERT_OK(env->write_file(dir.file("v/important.txt"), "keep\n"));
  for (Status st :
       {env->check_output_file(dir.file("v"), "--trace"), env->publish_file(dir.file("v"), "{}", "--trace")}) {
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(st.message(), "--trace " + dir.file("v") + " is a directory: give the path of a file");
  }
  EXPECT_EQ(env->open_fresh_append(dir.file("v/sub"), "the metrics file").status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(slurp(dir.file("v/important.txt")), "keep\n");
  EXPECT_EQ(*env->path_kind(dir.file("v/sub")), PathKind::kDirectory);

  // Under a regular file: refused before anything is written, the file untouched.
  Status under = env->publish_file(dir.file("v/important.txt/trace.json"), "{}", "--trace");
  EXPECT_EQ(under.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(under.message(), HasSubstr(dir.file("v/important.txt") + " is not a directory"));
  EXPECT_EQ(slurp(dir.file("v/important.txt")), "keep\n");
  ASSERT_EQ(::mkfifo(dir.file("fifo").c_str(), 0644), 0);
  EXPECT_THAT(env->check_output_file(dir.file("fifo"), "--trace").message(), HasSubstr("is not a regular file"));

  // Missing parents are made; a file is replaced whole; nothing is left beside it.
  ZO_ASSERT_OK(env->check_output_file(dir.file("new/deep/trace.json"), "--trace"));
  ZO_ASSERT_OK(env->publish_file(dir.file("new/deep/trace.json"), "first", "--trace"));
  ZO_ASSERT_OK(env->publish_file(dir.file("new/deep/trace.json"), "second", "--trace"));
  EXPECT_EQ(slurp(dir.file("new/deep/trace.json")), "second");
  EXPECT_THAT(*env->list_dir(dir.file("new/deep")), ::testing::ElementsAre("trace.json"));
  {
    auto log = env->open_fresh_append(dir.file("new/deep/trace.json"), "the metrics file");
    ZO_ASSERT_OK(log.status());
    ZO_ASSERT_OK((*log)->append("line\n"));
  }
  EXPECT_EQ(slurp(dir.file("new/deep/trace.json")), "line\n") << "a fresh append file starts empty";
}

// Under `ulimit -f` (SIGXFSZ ignored, as the tools ignore it) a write past the limit writes what
// fits and then fails with EFBIG: the append's torn part is cut off again, so the file keeps
// whole records only.
TEST(PosixEnv, AnAppendThatFailsPartWayLeavesNoTornRecord) {
  TempDir dir(test_root());
  Env* env = Env::posix();
  auto log = env->open_append(dir.file("metrics.jsonl"));
  ZO_ASSERT_OK(log.status());
  ZO_ASSERT_OK((*log)->append(std::string(99, 'a') + "\n"));
  struct rlimit old_limit {};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &old_limit), 0);
  void (*old_handler)(int) = std::signal(SIGXFSZ, SIG_IGN);
  struct rlimit limit = old_limit;
  limit.rlim_cur = 150;
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &limit), 0);
  Status torn = (*log)->append(std::string(99, 'b') + "\n");
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &old_limit), 0);
  std::signal(SIGXFSZ, old_handler);
  EXPECT_EQ(torn.code(), StatusCode::kIoError);
  EXPECT_EQ(torn.sys_errno(), EFBIG);
  EXPECT_THAT(torn.message(), HasSubstr("appending to " + dir.file("metrics.jsonl")));
  EXPECT_EQ(slurp(dir.file("metrics.jsonl")), std::string(99, 'a') + "\n");
  ZO_ASSERT_OK((*log)->append("next\n"));
  EXPECT_EQ(slurp(dir.file("metrics.jsonl")), std::string(99, 'a') + "\nnext\n");
}

TEST(FaultyEnv, FailsReadsAppendsAndDirectoryCreation) {
  TempDir dir(test_root());
  auto faults = std::make_shared<FaultInjector>();
  FaultyEnv env(Env::posix(), faults);
  ZO_ASSERT_OK(env.write_file(dir.file("w"), std::string(8192, 'x')));
  auto file = env.open_read(dir.file("w"), "weights");
  ZO_ASSERT_OK(file.status());
  // EIO aimed at byte 5000: a read around it fails naming the offset it started at; others pass.
  faults->add({.kind = FaultKind::kEio, .op = IoOp::kRead, .path_contains = "/w", .offset_bytes = 5000});
  std::string buf(4096, '\0');
  ZO_ASSERT_OK((*file)->read_exact(0, std::as_writable_bytes(std::span(buf))));
  Status bad = (*file)->read_exact(4096, std::as_writable_bytes(std::span(buf)));
  EXPECT_EQ(bad.code(), StatusCode::kIoError);
  EXPECT_THAT(bad.message(), HasSubstr("reading " + dir.file("w") + " at offset 4096"));
  ZO_ASSERT_OK((*file)->read_exact(4096, std::as_writable_bytes(std::span(buf))));  // rule used up
  faults->add({.kind = FaultKind::kEio, .op = IoOp::kRead, .path_contains = "/w"});
  EXPECT_EQ(env.read_file(dir.file("w"), "weights", 1 << 20).status().code(), StatusCode::kIoError);

  // ENOSPC on the second append (the rule's offset is the byte the handle has reached).
  auto log = env.open_append(dir.file("metrics.jsonl"));
  ZO_ASSERT_OK(log.status());
  faults->add({.kind = FaultKind::kNoSpace, .op = IoOp::kWrite, .path_contains = "metrics", .offset_bytes = 6});
  ZO_ASSERT_OK((*log)->append("line1\n"));
  EXPECT_EQ((*log)->append("line2\n").code(), StatusCode::kNoSpace);
  faults->add({.kind = FaultKind::kEio, .op = IoOp::kSync, .path_contains = "metrics"});
  EXPECT_EQ((*log)->sync().code(), StatusCode::kIoError);
  faults->add({.kind = FaultKind::kEio, .op = IoOp::kCreate, .path_contains = "metrics"});
  EXPECT_FALSE(env.open_append(dir.file("metrics.jsonl")).is_ok());
  EXPECT_EQ(slurp(dir.file("metrics.jsonl")), "line1\n");

  faults->add({.kind = FaultKind::kNoSpace, .op = IoOp::kCreate, .path_contains = "/out"});
  EXPECT_EQ(env.make_dirs(dir.file("out/a")).code(), StatusCode::kNoSpace);
  EXPECT_FALSE(std::filesystem::exists(dir.file("out")));
  // Transient faults on reads are retried.
  faults->add({.kind = FaultKind::kEagain, .op = IoOp::kRead, .path_contains = "/w"});
  ZO_ASSERT_OK((*file)->read_exact(0, std::as_writable_bytes(std::span(buf))));
  EXPECT_EQ(faults->injected(), 7u);
}

// The engine's files (swap, checkpoint and export files) are opened through the Env too, so a rule
// on IoOp::kOpen fails the opening itself, before anything is created.
TEST(FaultyEnv, FailsOpeningAFileForTheEngineBeforeCreatingIt) {
  TempDir dir(test_root());
  auto faults = std::make_shared<FaultInjector>();
  FaultyEnv env(Env::posix(), faults);
  const std::string path = dir.file("optimizer.swp");
  faults->add({.kind = FaultKind::kEio, .op = IoOp::kOpen, .path_contains = "optimizer.swp"});
  auto refused = env.open_file(path, OpenMode::kCreate, /*direct=*/true);
  ASSERT_FALSE(refused.is_ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kIoError);
  EXPECT_EQ(refused.status().sys_errno(), EIO);
  EXPECT_THAT(refused.status().message(), HasSubstr("open " + path + " (injected)"));
  EXPECT_FALSE(std::filesystem::exists(path)) << "nothing is created when the open fails";
  // Another op's rule does not touch open_file; the rule above is used up: the file is made.
  faults->add({.kind = FaultKind::kEio, .op = IoOp::kCreate, .path_contains = "optimizer.swp"});
  auto made = env.open_file(path, OpenMode::kCreate, /*direct=*/true);
  ZO_ASSERT_OK(made.status());
  EXPECT_TRUE(made->is_open());
  EXPECT_EQ(made->path(), path);
  EXPECT_TRUE(std::filesystem::exists(path));
  faults->clear();
  // Any mode: ENOSPC opening the existing file to read it; a transient fault is retried.
  faults->add({.kind = FaultKind::kNoSpace, .op = IoOp::kOpen, .path_contains = "optimizer.swp"});
  EXPECT_EQ(env.open_file(path, OpenMode::kRead, /*direct=*/false).status().code(), StatusCode::kNoSpace);
  faults->add({.kind = FaultKind::kEintr, .op = IoOp::kOpen});
  ZO_ASSERT_OK(env.open_file(path, OpenMode::kReadWrite, /*direct=*/false).status());
  EXPECT_EQ(faults->injected(), 3u);
  // The base's own errors pass through unchanged.
  EXPECT_EQ(env.open_file(path, OpenMode::kCreateNew, /*direct=*/false).status().code(), StatusCode::kAlreadyExists);
  EXPECT_EQ(op_name(IoOp::kOpen), "open");
}

}  // namespace
}  // namespace zo::io

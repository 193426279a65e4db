#include "tests/gpu/device_conformance.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <thread>
#include <vector>

#include "cpu_optim/adam.h"
#include "cpu_optim/adam8bit.h"
#include "cpu_optim/executor.h"
#include "cpu_optim/isa.h"
#include "common/bnb4_blob.h"
#include "common/bnb4bit.h"
#include "common/half.h"
#include "common/trace.h"
#include "gpu/device_info.h"
#include "gpu/foreign_streams.h"
#include "gpu/optim_kernels.h"
#include "gpu/quant_kernels.h"
#include "gpu/test_hooks.h"
#include "tests/gpu/adam_reference.h"
#include "tests/gpu/cast_reference.h"
#include "tests/gpu/nan_payload.h"

namespace zo::gpu::test {

std::unique_ptr<Device> make_test_device(DeviceKind kind, uint64_t budget_bytes, std::string* skip_reason) {
  if (kind == DeviceKind::kCuda) {
    const GpuProbe probe = probe_gpus();
    if (probe.gpus.empty()) {
      *skip_reason = "CudaDevice not tested: " + probe.reason;
      return nullptr;
    }
  }
  Result<std::unique_ptr<Device>> dev = make_device(kind, budget_bytes);
  if (!dev.is_ok()) {
    ADD_FAILURE() << "make_device(" << device_kind_name(kind) << "): " << dev.status().to_string();
    return nullptr;
  }
  return std::move(dev).value();
}

void DeviceConformance::SetUp() {
  std::string skip_reason;
  dev_ = make_test_device(GetParam(), kTestBudgetBytes, &skip_reason);
  if (!skip_reason.empty()) GTEST_SKIP() << skip_reason;
  if (!dev_) return;
  Result<Stream> s = dev_->create_stream();
  ASSERT_TRUE(s.is_ok()) << s.status().to_string();
  stream_ = *s;
}

void DeviceConformance::TearDown() {
  if (dev_ && stream_) dev_->destroy_stream(stream_);
}

namespace {

#define ZO_ASSERT_OK(expr)                           \
  do {                                               \
    const ::zo::Status zo_s_ = (expr);               \
    ASSERT_TRUE(zo_s_.is_ok()) << zo_s_.to_string(); \
  } while (0)

DevicePtr alloc(Device& dev, uint64_t n) {
  Result<DevicePtr> p = dev.allocate(n);
  EXPECT_TRUE(p.is_ok()) << p.status().to_string();
  return p.is_ok() ? *p : DevicePtr{};
}

// Pinned host memory from the device under test, so copies are asynchronous on CUDA too (a D2H
// copy into pageable memory returns only when it has completed).
class PinnedWords {
 public:
  PinnedWords(Device& dev, size_t n) : dev_(dev), n_(n) {
    Result<void*> p = dev.allocate_pinned(n * 4);
    ZO_CHECK(p.is_ok()) << p.status().to_string();
    p_ = static_cast<uint32_t*>(*p);
    std::fill(p_, p_ + n, 0u);
  }
  ~PinnedWords() { dev_.free_pinned(p_); }
  uint32_t* data() { return p_; }
  uint32_t& operator[](size_t i) { return p_[i]; }
  std::vector<uint32_t> vec() const { return std::vector<uint32_t>(p_, p_ + n_); }
  void assign(const std::vector<uint32_t>& v) { std::copy(v.begin(), v.end(), p_); }

 private:
  Device& dev_;
  size_t n_;
  uint32_t* p_;
};

std::vector<uint32_t> pattern(size_t n, uint32_t seed) {
  std::vector<uint32_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = seed * 2654435761u + static_cast<uint32_t>(i) * 40503u + 1u;
  return v;
}

TEST_P(DeviceConformance, AllocationBeyondTheBudgetFailsNamingTheNumbers) {
  if (!dev_) return;
  const DevicePtr a = alloc(*dev_, 48ull << 20);
  ASSERT_TRUE(a);
  Result<DevicePtr> b = dev_->allocate(20ull << 20);
  ASSERT_FALSE(b.is_ok());
  EXPECT_EQ(b.status().code(), StatusCode::kOutOfMemory);
  const std::string& msg = b.status().message();
  EXPECT_NE(msg.find(std::to_string(20ull << 20)), std::string::npos) << msg;       // requested
  EXPECT_NE(msg.find(std::to_string(48ull << 20)), std::string::npos) << msg;       // in use
  EXPECT_NE(msg.find(std::to_string(kTestBudgetBytes)), std::string::npos) << msg;  // budget
  EXPECT_EQ(dev_->stats().allocated_bytes, 48ull << 20) << "a failed allocation must not count";
  // Exactly what is left fits.
  const DevicePtr c = alloc(*dev_, 16ull << 20);
  ASSERT_TRUE(c);
  EXPECT_FALSE(dev_->allocate(1).is_ok());
  dev_->free(a);
  dev_->free(c);
  EXPECT_EQ(dev_->stats().allocated_bytes, 0u);
  const DevicePtr d = alloc(*dev_, kTestBudgetBytes);
  ASSERT_TRUE(d);
  dev_->free(d);
}

TEST_P(DeviceConformance, AllocationsAreRoundedAndPeakIsTheHighWaterMark) {
  if (!dev_) return;
  const DevicePtr a = alloc(*dev_, 1);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(a.addr) % kDeviceAlignment, 0u);
  EXPECT_EQ(dev_->stats().allocated_bytes, kDeviceAlignment);
  const DevicePtr b = alloc(*dev_, 10 * kDeviceAlignment + 1);
  EXPECT_EQ(dev_->stats().allocated_bytes, 12 * kDeviceAlignment);
  dev_->free(b);
  const DevicePtr c = alloc(*dev_, 3 * kDeviceAlignment);
  const DeviceStats s = dev_->stats();
  EXPECT_EQ(s.allocated_bytes, 4 * kDeviceAlignment);
  EXPECT_EQ(s.peak_allocated_bytes, 12 * kDeviceAlignment);
  EXPECT_EQ(s.budget_bytes, kTestBudgetBytes);
  dev_->free(a);
  dev_->free(c);
}

TEST_P(DeviceConformance, OperationsAreAsynchronousAndRunInQueueOrder) {
  if (!dev_) return;
  constexpr size_t kN = 4096;
  constexpr int kRounds = 32;
  const DevicePtr d = alloc(*dev_, kN * 4);
  const DevicePtr d2 = alloc(*dev_, kN * 4);
  std::vector<std::unique_ptr<PinnedWords>> in, out;
  for (int r = 0; r < kRounds; ++r) {
    in.push_back(std::make_unique<PinnedWords>(*dev_, kN));
    in.back()->assign(pattern(kN, r + 1));
    out.push_back(std::make_unique<PinnedWords>(*dev_, kN));
  }
  Result<Event> done = dev_->create_event();
  ASSERT_TRUE(done.is_ok());
  // Everything is queued behind a slow operation: nothing may have run when the calls return.
  ZO_ASSERT_OK(test_delay(*dev_, stream_, 200'000));
  for (int r = 0; r < kRounds; ++r) {
    ZO_ASSERT_OK(dev_->copy_h2d(d, in[r]->data(), kN * 4, stream_));
    ZO_ASSERT_OK(dev_->copy_d2d(d2, d, kN * 4, stream_));
    ZO_ASSERT_OK(dev_->fill_zero(d, kN * 4, stream_));
    ZO_ASSERT_OK(dev_->copy_d2h(out[r]->data(), d2, kN * 4, stream_));
  }
  ZO_ASSERT_OK(dev_->record(*done, stream_));
  Result<bool> q = dev_->query(*done);
  ASSERT_TRUE(q.is_ok());
  EXPECT_FALSE(*q) << "the queue finished while a 200 ms delay was at its head";
  EXPECT_EQ((*out[0])[0], 0u);
  ZO_ASSERT_OK(dev_->synchronize(stream_));
  for (int r = 0; r < kRounds; ++r) EXPECT_EQ(out[r]->vec(), in[r]->vec()) << "round " << r;
  dev_->destroy_event(*done);
  dev_->free(d);
  dev_->free(d2);
}

TEST_P(DeviceConformance, EventsOrderWorkAcrossStreams) {
  if (!dev_) return;
  constexpr size_t kN = 1 << 16;
  PinnedWords src(*dev_, kN), out(*dev_, kN);
  src.assign(pattern(kN, 7));
  const DevicePtr d = alloc(*dev_, kN * 4);
  const DevicePtr d2 = alloc(*dev_, kN * 4);
  Result<Stream> b = dev_->create_stream();
  Result<Event> ev = dev_->create_event();
  ASSERT_TRUE(b.is_ok() && ev.is_ok());
  ZO_ASSERT_OK(dev_->fill_zero(d, kN * 4, stream_));
  ZO_ASSERT_OK(dev_->fill_zero(d2, kN * 4, *b));
  ZO_ASSERT_OK(dev_->synchronize());
  // Stream A is slow to produce; stream B consumes only after A's event. Without the wait, B would
  // read zeros.
  ZO_ASSERT_OK(test_delay(*dev_, stream_, 200'000));
  ZO_ASSERT_OK(dev_->copy_h2d(d, src.data(), kN * 4, stream_));
  ZO_ASSERT_OK(dev_->record(*ev, stream_));
  ZO_ASSERT_OK(dev_->wait(*b, *ev));
  ZO_ASSERT_OK(dev_->copy_d2d(d2, d, kN * 4, *b));
  ZO_ASSERT_OK(dev_->copy_d2h(out.data(), d2, kN * 4, *b));
  ZO_ASSERT_OK(dev_->synchronize(*b));
  EXPECT_EQ(out.vec(), src.vec());
  Result<bool> q = dev_->query(*ev);
  ASSERT_TRUE(q.is_ok());
  EXPECT_TRUE(*q);
  dev_->destroy_event(*ev);
  dev_->destroy_stream(*b);
  dev_->free(d);
  dev_->free(d2);
}

// The trainer releases a block with an event recorded on LibTorch's stream (nullptr here: the
// host's synchronous compute on HostDevice, CUDA's legacy stream on CudaDevice); the coordinator's
// stream waits on it before refilling the block's arena space.
TEST_P(DeviceConformance, AForeignRecordMovesTheEventAndADeviceStreamWaitsOnIt) {
  if (!dev_) return;
  constexpr size_t kN = 1 << 12;
  PinnedWords src(*dev_, kN), out(*dev_, kN);
  src.assign(pattern(kN, 3));
  const DevicePtr d = alloc(*dev_, kN * 4);
  Result<Event> ev = dev_->create_event();
  ASSERT_TRUE(ev.is_ok());
  // A record behind a 200 ms delay, then a foreign one: the latest record is the foreign one.
  ZO_ASSERT_OK(test_delay(*dev_, stream_, 200'000));
  ZO_ASSERT_OK(dev_->record(*ev, stream_));
  ZO_ASSERT_OK(gpu::record_foreign(*dev_, *ev, nullptr));
  ZO_ASSERT_OK(dev_->synchronize(*ev));
  Result<bool> q = dev_->query(*ev);
  ASSERT_TRUE(q.is_ok());
  EXPECT_TRUE(*q);
  ZO_ASSERT_OK(dev_->wait(stream_, *ev));
  ZO_ASSERT_OK(dev_->copy_h2d(d, src.data(), kN * 4, stream_));
  ZO_ASSERT_OK(dev_->copy_d2h(out.data(), d, kN * 4, stream_));
  ZO_ASSERT_OK(dev_->synchronize(stream_));
  EXPECT_EQ(out.vec(), src.vec());
  dev_->destroy_event(*ev);
  dev_->free(d);
}

// The converse: the trainer makes LibTorch's stream wait for a fetched block's ready event. Work
// queued on the foreign stream after the wait (a foreign record) completes only after the event.
TEST_P(DeviceConformance, AForeignStreamWaitsForAnEventWithoutADeviceStream) {
  if (!dev_) return;
  Result<Event> ev = dev_->create_event();
  Result<Event> after = dev_->create_event();
  ASSERT_TRUE(ev.is_ok() && after.is_ok());
  ZO_ASSERT_OK(gpu::wait_foreign(*dev_, nullptr, *ev));  // never recorded: complete, nothing to wait for
  ZO_ASSERT_OK(test_delay(*dev_, stream_, 200'000));
  ZO_ASSERT_OK(dev_->record(*ev, stream_));
  ZO_ASSERT_OK(gpu::wait_foreign(*dev_, nullptr, *ev));
  ZO_ASSERT_OK(gpu::record_foreign(*dev_, *after, nullptr));
  ZO_ASSERT_OK(dev_->synchronize(*after));
  Result<bool> q = dev_->query(*ev);
  ASSERT_TRUE(q.is_ok());
  EXPECT_TRUE(*q) << "the foreign stream ran past the event it waits for";
  dev_->destroy_event(*after);
  dev_->destroy_event(*ev);
}

TEST_P(DeviceConformance, EventQueryAndHostSynchronize) {
  if (!dev_) return;
  Result<Event> ev = dev_->create_event();
  ASSERT_TRUE(ev.is_ok());
  Result<bool> q = dev_->query(*ev);
  ASSERT_TRUE(q.is_ok());
  EXPECT_TRUE(*q) << "an event never recorded counts as complete";
  ZO_ASSERT_OK(test_delay(*dev_, stream_, 150'000));
  ZO_ASSERT_OK(dev_->record(*ev, stream_));
  q = dev_->query(*ev);
  ASSERT_TRUE(q.is_ok());
  EXPECT_FALSE(*q);
  ZO_ASSERT_OK(dev_->synchronize(*ev));
  q = dev_->query(*ev);
  ASSERT_TRUE(q.is_ok());
  EXPECT_TRUE(*q);
  dev_->destroy_event(*ev);
}

// The trace's copy tracks show when the device ran each direction's copies, not when they were
// queued: copies behind a 200 ms delay start after it, the D2H behind the H2D copies starts after
// them, and copies queued while the trace is paused leave no span.
TEST_P(DeviceConformance, TheTraceShowsCopiesWhenTheDeviceRunsThem) {
  if (!dev_) return;
  constexpr size_t kWords = 1 << 18;  // 1 MiB
  PinnedWords in(*dev_, kWords), out(*dev_, kWords);
  const DevicePtr d = alloc(*dev_, kWords * 4);
  trace::start(1000);
  const int64_t queued_ns = trace::now_ns();
  ZO_ASSERT_OK(test_delay(*dev_, stream_, 200'000));
  ZO_ASSERT_OK(dev_->copy_h2d(d, in.data(), kWords * 4, stream_));
  ZO_ASSERT_OK(dev_->copy_h2d(d, in.data(), kWords * 4, stream_));
  ZO_ASSERT_OK(dev_->copy_d2h(out.data(), d, kWords * 4, stream_));
  ZO_ASSERT_OK(dev_->synchronize(stream_));
  const int64_t synced_ns = trace::now_ns();
  trace::pause();
  ZO_ASSERT_OK(dev_->copy_h2d(d, in.data(), kWords * 4, stream_));
  ZO_ASSERT_OK(dev_->copy_d2h(out.data(), d, kWords * 4, stream_));
  ZO_ASSERT_OK(dev_->synchronize(stream_));

  // A GPU's spans are placed on the host clock through a base event, within microseconds.
  constexpr int64_t kSlackNs = 1'000'000;
  std::vector<trace::Recorded> spans[2];
  uint64_t copies[2] = {0, 0};
  for (const trace::Recorded& r : trace::snapshot()) {
    if (r.track != trace::Track::kCopyH2D && r.track != trace::Track::kCopyD2H) continue;
    const int dir = r.track == trace::Track::kCopyH2D ? 0 : 1;
    spans[dir].push_back(r);
    copies[dir] += std::stoull(r.name);  // "<copies> copies, <bytes>"
    EXPECT_NE(r.name.find(" copies, "), std::string::npos) << r.name;
    EXPECT_GE(r.start_ns, queued_ns + 200'000'000 - kSlackNs)
        << r.name << " started before the delay ahead of it ended";
    EXPECT_LE(r.end_ns, synced_ns + kSlackNs) << r.name << " ended after the stream was synchronized";
    EXPECT_LE(r.start_ns, r.end_ns);
  }
  EXPECT_EQ(copies[0], 2u) << "H2D copies traced (the one queued while paused must not be)";
  EXPECT_EQ(copies[1], 1u) << "D2H copies traced";
  for (auto& track : spans) {
    std::sort(track.begin(), track.end(), [](const auto& a, const auto& b) { return a.start_ns < b.start_ns; });
    for (size_t i = 1; i < track.size(); ++i) EXPECT_GE(track[i].start_ns, track[i - 1].end_ns) << "spans overlap";
  }
  if (!spans[0].empty() && !spans[1].empty()) {
    EXPECT_GE(spans[1].front().start_ns, spans[0].back().end_ns - kSlackNs)
        << "the D2H ran before the H2D copies queued ahead of it";
  }
  dev_->free(d);
}

// busy() is the device's own time per kind of work: copies as they ran (a delay queued ahead of
// them is not copy time), and foreign compute from its start to its end.
TEST_P(DeviceConformance, BusyCountsCopiesAsTheyRunAndForeignCompute) {
  if (!dev_) return;
  constexpr size_t kWords = 1 << 18;  // 1 MiB
  PinnedWords in(*dev_, kWords), out(*dev_, kWords);
  const DevicePtr d = alloc(*dev_, kWords * 4);
  const DeviceBusy before = dev_->busy();
  const auto t0 = std::chrono::steady_clock::now();
  ZO_ASSERT_OK(test_delay(*dev_, stream_, 200'000));
  ZO_ASSERT_OK(dev_->copy_h2d(d, in.data(), kWords * 4, stream_));
  ZO_ASSERT_OK(dev_->copy_h2d(d, in.data(), kWords * 4, stream_));
  ZO_ASSERT_OK(dev_->copy_d2h(out.data(), d, kWords * 4, stream_));
  ZO_ASSERT_OK(dev_->synchronize(stream_));
  // Compute another library queues: here the host holds the work open for 100 ms (CUDA: between
  // two events on the idle legacy stream; HostDevice: the call itself).
  Status queued = gpu::foreign_work(*dev_, DeviceWork::kCompute, 0, nullptr, "held for 100 ms", [] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    return Status::ok();
  });
  ZO_ASSERT_OK(queued);
  ZO_ASSERT_OK(dev_->synchronize());
  const double wall_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const DeviceBusy after = dev_->busy();
  const double h2d = after.h2d_s - before.h2d_s, d2h = after.d2h_s - before.d2h_s;
  const double compute = after.compute_s - before.compute_s;
  EXPECT_GT(h2d, 0.0);
  EXPECT_LT(h2d, 0.1) << "the 200 ms delay ahead of the copies counted as copy time";
  EXPECT_GT(d2h, 0.0);
  EXPECT_LT(d2h, 0.1);
  EXPECT_GE(compute, 0.099);
  EXPECT_LE(compute, wall_s);
  dev_->free(d);
}

TEST_P(DeviceConformance, CountsBytesMovedPerDirection) {
  if (!dev_) return;
  std::vector<std::byte> host(10000);
  const DevicePtr d = alloc(*dev_, 10000);
  const DevicePtr d2 = alloc(*dev_, 10000);
  ZO_ASSERT_OK(dev_->copy_h2d(d, host.data(), 10000, stream_));
  ZO_ASSERT_OK(dev_->copy_h2d(d + 100, host.data(), 900, stream_));
  ZO_ASSERT_OK(dev_->copy_d2d(d2, d, 5000, stream_));
  ZO_ASSERT_OK(dev_->copy_d2h(host.data(), d2, 3000, stream_));
  ZO_ASSERT_OK(dev_->fill_zero(d, 10000, stream_));
  ZO_ASSERT_OK(dev_->synchronize(stream_));
  const DeviceStats s = dev_->stats();
  EXPECT_EQ(s.h2d_bytes, 10900u);
  EXPECT_EQ(s.d2d_bytes, 5000u);
  EXPECT_EQ(s.d2h_bytes, 3000u);
  dev_->free(d);
  dev_->free(d2);
}

TEST_P(DeviceConformance, RangesOutsideAnAllocationAreRejected) {
  if (!dev_) return;
  std::vector<std::byte> host(2048);
  const DevicePtr d = alloc(*dev_, 1000);  // rounded to 1024
  EXPECT_EQ(dev_->copy_h2d(d, host.data(), 1024, stream_).code(), StatusCode::kOk);
  EXPECT_EQ(dev_->copy_h2d(d, host.data(), 1025, stream_).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(dev_->copy_d2h(host.data(), d + 512, 513, stream_).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(dev_->copy_h2d(DevicePtr{host.data()}, host.data(), 16, stream_).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(dev_->cast(d, DType::kBF16, d + 512, DType::kF32, 129, stream_).code(), StatusCode::kInvalidArgument);
  ZO_ASSERT_OK(dev_->synchronize(stream_));
  dev_->free(d);
}

// Casts `n` elements of `in` (src dtype) on the device and returns the output bytes.
template <typename Out, typename In>
std::vector<Out> device_cast(Device& dev, Stream s, const std::vector<In>& in, DType dst, DType src) {
  const uint64_t n = in.size();
  std::vector<Out> out(n);
  const DevicePtr din = alloc(dev, n * sizeof(In));
  const DevicePtr dout = alloc(dev, n * sizeof(Out));
  EXPECT_TRUE(dev.copy_h2d(din, in.data(), n * sizeof(In), s).is_ok());
  EXPECT_TRUE(dev.cast(dout, dst, din, src, n, s).is_ok());
  EXPECT_TRUE(dev.copy_d2h(out.data(), dout, n * sizeof(Out), s).is_ok());
  EXPECT_TRUE(dev.synchronize(s).is_ok());
  dev.free(din);
  dev.free(dout);
  return out;
}

TEST_P(DeviceConformance, CastsFrom16BitMatchCpuOptimForEveryPattern) {
  if (!dev_) return;
  const std::vector<uint16_t> in = all_16bit_patterns();
  for (DType src : {DType::kBF16, DType::kF16}) {
    const std::vector<uint32_t> out = device_cast<uint32_t>(*dev_, stream_, in, DType::kF32, src);
    int bad = 0;
    for (size_t i = 0; i < in.size() && bad < 10; ++i) {
      const uint32_t want = ref_bits_from_16(in[i], src);
      const bool ok = is_nan_32(want) ? is_nan_32(out[i]) : out[i] == want;
      if (!ok) {
        ++bad;
        ADD_FAILURE() << dtype_name(src) << " 0x" << std::hex << in[i] << " → 0x" << out[i] << ", want 0x" << want;
      }
    }
  }
}

TEST_P(DeviceConformance, CastsFromFp32MatchCpuOptimBitForBit) {
  if (!dev_) return;
  const std::vector<float> in = float_cast_inputs();
  for (DType dst : {DType::kBF16, DType::kF16}) {
    const std::vector<uint16_t> out = device_cast<uint16_t>(*dev_, stream_, in, dst, DType::kF32);
    int bad = 0;
    for (size_t i = 0; i < in.size() && bad < 10; ++i) {
      const uint16_t want = ref_16_from_float(in[i], dst);
      const bool ok =
          is_nan_16(want, dst) ? is_nan_16(out[i], dst) && (out[i] & 0x8000) == (want & 0x8000) : out[i] == want;
      if (!ok) {
        ++bad;
        ADD_FAILURE() << "fp32 0x" << std::hex << cpu_optim::float_bits(in[i]) << " → " << dtype_name(dst) << " 0x"
                      << out[i] << ", want 0x" << want;
      }
    }
  }
}

TEST_P(DeviceConformance, CastsBetween16BitTypesGoThroughFp32) {
  if (!dev_) return;
  const std::vector<uint16_t> in = all_16bit_patterns();
  const std::vector<uint16_t> to_f16 = device_cast<uint16_t>(*dev_, stream_, in, DType::kF16, DType::kBF16);
  const std::vector<uint16_t> same = device_cast<uint16_t>(*dev_, stream_, in, DType::kBF16, DType::kBF16);
  EXPECT_EQ(same, in);
  for (size_t i = 0; i < in.size(); ++i) {
    const uint16_t want = cpu_optim::float_to_f16(cpu_optim::bf16_to_float(in[i]));
    if (is_nan_16(want, DType::kF16)) {
      EXPECT_TRUE(is_nan_16(to_f16[i], DType::kF16)) << i;
    } else {
      ASSERT_EQ(to_f16[i], want) << "bf16 0x" << std::hex << in[i];
    }
  }
}

TEST_P(DeviceConformance, PinnedMemoryIsAllocatedAndRegisteredWithAccounting) {
  if (!dev_) return;
  Result<void*> p = dev_->allocate_pinned(3 << 20);
  ASSERT_TRUE(p.is_ok()) << p.status().to_string();
  EXPECT_EQ(reinterpret_cast<uintptr_t>(*p) % 4096, 0u);
  EXPECT_EQ(dev_->stats().pinned_bytes, 3u << 20);
  std::memset(*p, 0x5A, 3 << 20);

  std::vector<uint32_t> host = pattern(1 << 20, 3);
  ZO_ASSERT_OK(dev_->register_host(host.data(), host.size() * 4));
  EXPECT_EQ(dev_->stats().registered_bytes, host.size() * 4);
  EXPECT_EQ(dev_->register_host(host.data() + 100, 4096).code(), StatusCode::kInvalidArgument);

  // Round trip pinned → device → registered memory.
  const DevicePtr d = alloc(*dev_, 3 << 20);
  ZO_ASSERT_OK(dev_->copy_h2d(d, *p, 3 << 20, stream_));
  ZO_ASSERT_OK(dev_->copy_d2h(host.data(), d, 4 << 10, stream_));
  ZO_ASSERT_OK(dev_->synchronize(stream_));
  EXPECT_EQ(host[0], 0x5A5A5A5Au);
  EXPECT_EQ(host[1023], 0x5A5A5A5Au);
  EXPECT_EQ(host[1024], pattern(1 << 20, 3)[1024]);

  dev_->unregister_host(host.data());
  dev_->free_pinned(*p);
  dev_->free(d);
  const DeviceStats s = dev_->stats();
  EXPECT_EQ(s.pinned_bytes, 0u);
  EXPECT_EQ(s.registered_bytes, 0u);
}

// A pipeline across four streams, each stage waiting on the previous stage's event before copying
// the buffer one step along, with the events re-recorded every round. Delays put the producing
// stage behind, so any stage that ran early would forward stale data.
// Note [One registration per range] in gpu/cuda/cuda_device.cu: on the GPU, a copy whose host side
// spans two registrations fails, as 1 GiB registration pieces made copies across an address that
// is a multiple of 1 GiB fail on an H200. Pinned and registered ranges of over 1 GiB each hold such
// an address; a copy across it must run both ways.
TEST_P(DeviceConformance, CopiesSpanAGibibyteBoundaryOfPinnedMemory) {
  if (!dev_) return;
  constexpr uint64_t kGiB = uint64_t{1} << 30, kWindow = 8 << 20, kSize = kGiB + kWindow;
  const DevicePtr d = alloc(*dev_, kWindow);
  const std::vector<uint32_t> want = pattern(kWindow / 4, 11);
  // The window [boundary - 4 MiB, boundary + 4 MiB) around the first multiple of 1 GiB after the
  // range's start, moved to the start when the boundary is closer to it than 4 MiB.
  auto round_trip = [&](std::byte* base, const char* what) {
    const uint64_t to_boundary =
        (reinterpret_cast<uintptr_t>(base) / kGiB + 1) * kGiB - reinterpret_cast<uintptr_t>(base);
    std::byte* w = base + (to_boundary >= kWindow / 2 ? to_boundary - kWindow / 2 : 0);
    ASSERT_LE(w + kWindow, base + kSize) << what;
    std::memcpy(w, want.data(), kWindow);
    ZO_ASSERT_OK(dev_->fill_zero(d, kWindow, stream_));
    ZO_ASSERT_OK(dev_->copy_h2d(d, w, kWindow, stream_));
    ZO_ASSERT_OK(dev_->synchronize(stream_));
    std::memset(w, 0xA5, kWindow);
    ZO_ASSERT_OK(dev_->copy_d2h(w, d, kWindow, stream_));
    ZO_ASSERT_OK(dev_->synchronize(stream_));
    EXPECT_EQ(std::memcmp(w, want.data(), kWindow), 0)
        << what << ": the round trip across a 1 GiB address changed bytes";
  };
  Result<void*> p = dev_->allocate_pinned(kSize);
  ASSERT_TRUE(p.is_ok()) << p.status().to_string();
  round_trip(static_cast<std::byte*>(*p), "allocate_pinned");
  dev_->free_pinned(*p);

  std::vector<std::byte> host(kSize);
  ZO_ASSERT_OK(dev_->register_host(host.data(), kSize));
  round_trip(host.data(), "register_host");
  dev_->unregister_host(host.data());
  dev_->free(d);
}

TEST_P(DeviceConformance, EventChainsAcrossFourStreamsHandDataAlong) {
  if (!dev_) return;
  constexpr size_t kN = 1 << 14;
  constexpr int kStages = 4;
  constexpr int kRounds = 8;
  std::vector<Stream> streams;
  std::vector<Event> events;
  std::vector<DevicePtr> bufs;
  for (int i = 0; i < kStages; ++i) {
    streams.push_back(*dev_->create_stream());
    events.push_back(*dev_->create_event());
    bufs.push_back(alloc(*dev_, kN * 4));
  }
  Event round_done = *dev_->create_event();
  std::vector<std::unique_ptr<PinnedWords>> in, out;
  for (int r = 0; r < kRounds; ++r) {
    in.push_back(std::make_unique<PinnedWords>(*dev_, kN));
    in.back()->assign(pattern(kN, 100 + r));
    out.push_back(std::make_unique<PinnedWords>(*dev_, kN));
  }
  for (int r = 0; r < kRounds; ++r) {
    // Stage 0 may overwrite its buffer only once the previous round has left the last stage.
    ZO_ASSERT_OK(dev_->wait(streams[0], round_done));
    ZO_ASSERT_OK(test_delay(*dev_, streams[0], 5'000));
    ZO_ASSERT_OK(dev_->copy_h2d(bufs[0], in[r]->data(), kN * 4, streams[0]));
    ZO_ASSERT_OK(dev_->record(events[0], streams[0]));
    for (int i = 1; i < kStages; ++i) {
      ZO_ASSERT_OK(dev_->wait(streams[i], events[i - 1]));
      ZO_ASSERT_OK(test_delay(*dev_, streams[i], 2'000 * (kStages - i)));
      ZO_ASSERT_OK(dev_->copy_d2d(bufs[i], bufs[i - 1], kN * 4, streams[i]));
      ZO_ASSERT_OK(dev_->record(events[i], streams[i]));
    }
    ZO_ASSERT_OK(dev_->copy_d2h(out[r]->data(), bufs[kStages - 1], kN * 4, streams[kStages - 1]));
    ZO_ASSERT_OK(dev_->record(round_done, streams[kStages - 1]));
    // The next round's stage i overwrites bufs[i]; stage i+1 of this round must have read it.
    for (int i = 0; i + 1 < kStages; ++i) ZO_ASSERT_OK(dev_->wait(streams[i], events[i + 1]));
  }
  ZO_ASSERT_OK(dev_->synchronize());
  for (int r = 0; r < kRounds; ++r) EXPECT_EQ(out[r]->vec(), in[r]->vec()) << "round " << r;
  for (int i = 0; i < kStages; ++i) {
    dev_->destroy_stream(streams[i]);
    dev_->destroy_event(events[i]);
    dev_->free(bufs[i]);
  }
  dev_->destroy_event(round_done);
}

// Several host threads share one device, each with its own stream; the budget is never exceeded
// and every thread's data comes back intact.
TEST_P(DeviceConformance, HostThreadsShareTheDevice) {
  if (!dev_) return;
  constexpr int kThreads = 4;
  constexpr int kIters = 40;
  constexpr size_t kN = 1 << 15;  // 128 KiB per buffer
  std::vector<std::thread> threads;
  std::vector<int> failures(kThreads, 0);
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      Stream s = *dev_->create_stream();
      PinnedWords src(*dev_, kN), dst(*dev_, kN);
      for (int it = 0; it < kIters; ++it) {
        src.assign(pattern(kN, t * 1000 + it));
        Result<DevicePtr> d = dev_->allocate(kN * 4);
        if (!d.is_ok()) {
          ++failures[t];
          continue;
        }
        bool ok = dev_->copy_h2d(*d, src.data(), kN * 4, s).is_ok() &&
                  dev_->copy_d2h(dst.data(), *d, kN * 4, s).is_ok() && dev_->synchronize(s).is_ok();
        ok = ok && dst.vec() == src.vec();
        if (!ok) ++failures[t];
        dev_->free(*d);
      }
      dev_->destroy_stream(s);
    });
  }
  for (auto& th : threads) th.join();
  for (int t = 0; t < kThreads; ++t) EXPECT_EQ(failures[t], 0) << "thread " << t;
  const DeviceStats s = dev_->stats();
  EXPECT_EQ(s.allocated_bytes, 0u);
  EXPECT_LE(s.peak_allocated_bytes, uint64_t{kThreads} * kN * 4);
  EXPECT_EQ(s.h2d_bytes, uint64_t{kThreads} * kIters * kN * 4);
}

// The device's adam_step against cpu_optim::adam_step on every CPU path here, bit for bit, after each of
// five steps, over every grad dtype × copy-out × (AdamW | Adam with L2) × (no decay | decay), with a
// grad_scale that rounds and n = 100003 (no multiple of any SIMD width or tile).
TEST_P(DeviceConformance, AdamStepMatchesCpuOptimBitForBit) {
  if (!dev_) return;
  constexpr size_t kN = 100003;
  constexpr int kSteps = 5;
  constexpr float kGradScale = 0.7311f;  // 1/loss_scale × clip coefficient: not a power of two
  const std::vector<AdamCpuPath> paths = adam_cpu_paths();
  ASSERT_FALSE(paths.empty());
  const AdamState init = adam_initial_state(kN, 42);
  const DevicePtr dp = alloc(*dev_, kN * 4), dm = alloc(*dev_, kN * 4), dv = alloc(*dev_, kN * 4);
  const DevicePtr dg = alloc(*dev_, kN * 4), dc = alloc(*dev_, kN * 4);
  int cases = 0;
  for (const AdamCase& c : adam_cases()) {
    SCOPED_TRACE(c.describe());
    std::vector<AdamState> cpu(paths.size(), init);
    ZO_ASSERT_OK(dev_->copy_h2d(dp, init.p.data(), kN * 4, stream_));
    ZO_ASSERT_OK(dev_->copy_h2d(dm, init.m.data(), kN * 4, stream_));
    ZO_ASSERT_OK(dev_->copy_h2d(dv, init.v.data(), kN * 4, stream_));
    for (int step = 1; step <= kSteps; ++step) {
      const AdamGrad g = adam_grad(c.grad_dtype, kN, static_cast<uint32_t>(1000 * step + cases));
      for (size_t k = 0; k < paths.size(); ++k)
        ZO_ASSERT_OK(cpu_adam_step(c, step, kGradScale, g, *paths[k].executor, cpu[k]));
      ZO_ASSERT_OK(dev_->copy_h2d(dg, g.data(), g.size_bytes(), stream_));
      const DeviceAdamArgs args{.params = dp,
                                .exp_avg = dm,
                                .exp_avg_sq = dv,
                                .grad = dg,
                                .grad_dtype = c.grad_dtype,
                                .grad_scale = kGradScale,
                                .copy_out = c.copy ? dc : DevicePtr{},
                                .copy_dtype = c.copy_dtype,
                                .n_elems = kN,
                                .config = c.config,
                                .step = step};
      ZO_ASSERT_OK(optim_kernels(*dev_).adam_step(*dev_, args, stream_));
      AdamState got(kN, c.copy ? kN * dtype_size_bytes(c.copy_dtype) : 0);
      ZO_ASSERT_OK(dev_->copy_d2h(got.p.data(), dp, kN * 4, stream_));
      ZO_ASSERT_OK(dev_->copy_d2h(got.m.data(), dm, kN * 4, stream_));
      ZO_ASSERT_OK(dev_->copy_d2h(got.v.data(), dv, kN * 4, stream_));
      if (c.copy) ZO_ASSERT_OK(dev_->copy_d2h(got.copy.data(), dc, got.copy.size(), stream_));
      ZO_ASSERT_OK(dev_->synchronize(stream_));
      for (size_t k = 0; k < paths.size(); ++k) {
        ASSERT_EQ(cpu[k].nan_count(), 0u) << "the inputs must not make NaNs (their payloads are unspecified)";
        ASSERT_TRUE(same_adam_state(got, cpu[k], step, paths[k].name));
      }
    }
    ++cases;
  }
  EXPECT_EQ(cases, 48);
  for (DevicePtr d : {dp, dm, dv, dg, dc}) dev_->free(d);
}

// The narrow optimizer states on the device: bf16 moments, bf16 masters with stochastic rounding,
// and 8-bit blockwise moments (alone and with bf16 masters), each against its cpu_optim step on
// every CPU path here, every output byte compared after each of five steps (a NaN matches a NaN of
// any payload: docs/gpu.md, "Adam on the device"). n = 100003 ends in a
// partial 8-bit block; the gradients hold a block of zeros, denormals and tiny normals; the
// parameters' rounding key and first index are not zero (a piece in the middle of a parameter).
TEST_P(DeviceConformance, NarrowStatesMatchCpuOptimBitForBit) {
  if (!dev_) return;
  constexpr size_t kN = 100003;
  constexpr size_t kBlocks = (kN + 255) / 256;
  constexpr size_t kAbsmax = (kN + 3) / 4 * 4;  // the absmax after the codes, 4-byte aligned as the swapper lays it
  constexpr int kSteps = 5;
  constexpr float kGradScale = 0.7311f;
  constexpr uint32_t kSrFirst = 4096 * 3;
  enum class Variant { kBf16Moments, kBf16Masters, kBf16MastersBf16Moments, k8bit, k8bitBf16Masters };
  const std::vector<AdamCpuPath> paths = adam_cpu_paths();
  ASSERT_FALSE(paths.empty());
  // Bytes of each state: params (fp32 or bf16), each moment (fp32, bf16, or codes then absmax).
  struct State {
    std::vector<uint8_t> p, m, v, copy;
  };
  std::mt19937 rng(7);
  std::vector<float> p0(kN), m0(kN), v0(kN);
  for (size_t i = 0; i < kN; ++i) {
    p0[i] = adam_test_value(rng, 1e3f, false);
    m0[i] = adam_test_value(rng, 1e2f, false);
    v0[i] = adam_test_value(rng, 1e4f, true);
  }
  auto bytes_of = [](const auto& vec) {
    std::vector<uint8_t> b(vec.size() * sizeof(vec[0]));
    std::memcpy(b.data(), vec.data(), b.size());
    return b;
  };
  auto bf16_of = [&](const std::vector<float>& x) {
    std::vector<uint16_t> h(x.size());
    for (size_t i = 0; i < x.size(); ++i) h[i] = cpu_optim::float_to_bf16(x[i]);
    return bytes_of(h);
  };
  auto blockwise_of = [&](bool is_signed) {  // random codes, absmax up to 1e2; one all-zero block
    std::vector<uint8_t> b(kAbsmax + kBlocks * 4);
    for (size_t i = 0; i < kN; ++i) b[i] = static_cast<uint8_t>(rng());
    for (size_t k = 0; k < kBlocks; ++k) {
      const float a = k == 5 ? 0.0f : adam_test_value(rng, 1e2f, true) * (is_signed ? 1.0f : 0.5f);
      std::memcpy(b.data() + kAbsmax + k * 4, &a, 4);
    }
    return b;
  };
  const std::vector<uint8_t> m8 = blockwise_of(true), v8 = blockwise_of(false);
  const DevicePtr dp = alloc(*dev_, kN * 4), dm = alloc(*dev_, kN * 4 + kBlocks * 4),
                  dv = alloc(*dev_, kN * 4 + kBlocks * 4), dg = alloc(*dev_, kN * 4), dc = alloc(*dev_, kN * 4);
  int cases = 0;
  for (Variant variant : {Variant::kBf16Moments, Variant::kBf16Masters, Variant::kBf16MastersBf16Moments,
                          Variant::k8bit, Variant::k8bitBf16Masters})
    for (DType grad_dtype : {DType::kF32, DType::kBF16})
      for (bool copy : {false, true})
        for (bool adam_w : {true, false}) {
          const bool bf16_masters = variant == Variant::kBf16Masters || variant == Variant::kBf16MastersBf16Moments ||
                                    variant == Variant::k8bitBf16Masters;
          const bool eight_bit = variant == Variant::k8bit || variant == Variant::k8bitBf16Masters;
          const bool bf16_moments = variant == Variant::kBf16Moments || variant == Variant::kBf16MastersBf16Moments;
          const DType copy_dtype = bf16_masters ? DType::kBF16 : DType::kF16;
          const AdamConfig config{.lr = 3e-3f, .weight_decay = 0.05f, .adam_w_mode = adam_w};
          const uint32_t key = sr_key(99, 1, 3);
          SCOPED_TRACE("variant " + std::to_string(static_cast<int>(variant)) + ", grad " +
                       std::string(dtype_name(grad_dtype)) + ", copy " + (copy ? "yes" : "no") + ", adam_w " +
                       (adam_w ? "true" : "false"));
          State init;
          init.p = bf16_masters ? bf16_of(p0) : bytes_of(p0);
          init.m = eight_bit ? m8 : bf16_moments ? bf16_of(m0) : bytes_of(m0);
          init.v = eight_bit ? v8 : bf16_moments ? bf16_of(v0) : bytes_of(v0);
          if (copy) init.copy.assign(kN * 2, 0);
          std::vector<State> cpu(paths.size(), init);
          ZO_ASSERT_OK(dev_->copy_h2d(dp, init.p.data(), init.p.size(), stream_));
          ZO_ASSERT_OK(dev_->copy_h2d(dm, init.m.data(), init.m.size(), stream_));
          ZO_ASSERT_OK(dev_->copy_h2d(dv, init.v.data(), init.v.size(), stream_));
          for (int step = 1; step <= kSteps; ++step) {
            AdamGrad g = adam_grad(grad_dtype, kN, static_cast<uint32_t>(1000 * step + cases));
            for (size_t i = 512; i < 768; ++i) {  // a block of zeros
              if (grad_dtype == DType::kF32) g.f32[i] = 0.0f;
              else g.u16[i] = 0;
            }
            // 8-bit moments: a gradient over ~1e21 overflows exp_avg_sq to inf, its block's absmax
            // becomes inf and at the next step every code of the block dequantizes to inf or NaN
            // (entry 0 × inf), and so do its params, for good. Only block 9 keeps such gradients;
            // elsewhere they are scaled down, so steps 2-5 still compare finite params.
            for (size_t i = 0; eight_bit && i < kN; ++i) {
              const float x = grad_dtype == DType::kF32 ? g.f32[i] : cpu_optim::bf16_to_float(g.u16[i]);
              if (i / 256 == 9 || !(std::fabs(x) > 1e15f)) continue;
              if (grad_dtype == DType::kF32) g.f32[i] = x * 1e-20f;
              else g.u16[i] = cpu_optim::float_to_bf16(x * 1e-20f);
            }
            const uint32_t step_key = key + static_cast<uint32_t>(step);
            for (size_t k = 0; k < paths.size(); ++k) {
              State& c = cpu[k];
              const cpu_optim::ConstElemSpan gs{g.data(), g.dtype};
              const cpu_optim::ElemSpan out{copy ? c.copy.data() : nullptr, copy_dtype};
              const cpu_optim::Bf16Master master{{reinterpret_cast<uint16_t*>(c.p.data()), kN}, step_key, kSrFirst};
              auto f32 = [&](std::vector<uint8_t>& b) {
                return std::span<float>(reinterpret_cast<float*>(b.data()), kN);
              };
              auto u16 = [&](std::vector<uint8_t>& b) {
                return std::span<uint16_t>(reinterpret_cast<uint16_t*>(b.data()), kN);
              };
              auto blockwise = [&](std::vector<uint8_t>& b) {
                return cpu_optim::BlockwiseState{{b.data(), kN},
                                                 {reinterpret_cast<float*>(b.data() + kAbsmax), kBlocks}};
              };
              const auto& ex = *paths[k].executor;
              const DType md = bf16_moments ? DType::kBF16 : DType::kF32;
              Status st;
              switch (variant) {
                case Variant::kBf16Moments:
                  st = cpu_optim::adam_step_bf16_moments(config, step, f32(c.p), u16(c.m), u16(c.v), gs, kGradScale,
                                                         out, ex);
                  break;
                case Variant::kBf16Masters:
                case Variant::kBf16MastersBf16Moments:
                  st = cpu_optim::adam_step_bf16_master(config, step, master, {c.m.data(), md}, {c.v.data(), md}, gs,
                                                        kGradScale, out, ex);
                  break;
                case Variant::k8bit:
                  st = cpu_optim::adam8bit_step(config, step, f32(c.p), blockwise(c.m), blockwise(c.v), gs, kGradScale,
                                                out, ex);
                  break;
                case Variant::k8bitBf16Masters:
                  st = cpu_optim::adam8bit_step_bf16_master(config, step, master, blockwise(c.m), blockwise(c.v), gs,
                                                            kGradScale, out, ex);
                  break;
              }
              ZO_ASSERT_OK(st);
            }
            ZO_ASSERT_OK(dev_->copy_h2d(dg, g.data(), g.size_bytes(), stream_));
            const DType pd = bf16_masters ? DType::kBF16 : DType::kF32;
            const DevicePtr out = copy ? dc : DevicePtr{};
            if (eight_bit) {
              const DeviceAdam8bitArgs a{.params = dp,
                                         .param_dtype = pd,
                                         .sr_key = step_key,
                                         .sr_first = kSrFirst,
                                         .m_codes = dm,
                                         .m_absmax = dm + kAbsmax,
                                         .v_codes = dv,
                                         .v_absmax = dv + kAbsmax,
                                         .grad = dg,
                                         .grad_dtype = grad_dtype,
                                         .grad_scale = kGradScale,
                                         .copy_out = out,
                                         .copy_dtype = copy_dtype,
                                         .n_elems = kN,
                                         .config = config,
                                         .step = step};
              ZO_ASSERT_OK(optim_kernels(*dev_).adam8bit_step(*dev_, a, stream_));
            } else {
              const DeviceAdamArgs a{.params = dp,
                                     .param_dtype = pd,
                                     .sr_key = step_key,
                                     .sr_first = kSrFirst,
                                     .exp_avg = dm,
                                     .exp_avg_sq = dv,
                                     .moment_dtype = bf16_moments ? DType::kBF16 : DType::kF32,
                                     .grad = dg,
                                     .grad_dtype = grad_dtype,
                                     .grad_scale = kGradScale,
                                     .copy_out = out,
                                     .copy_dtype = copy_dtype,
                                     .n_elems = kN,
                                     .config = config,
                                     .step = step};
              ZO_ASSERT_OK(optim_kernels(*dev_).adam_step(*dev_, a, stream_));
            }
            State got = init;
            ZO_ASSERT_OK(dev_->copy_d2h(got.p.data(), dp, got.p.size(), stream_));
            ZO_ASSERT_OK(dev_->copy_d2h(got.m.data(), dm, got.m.size(), stream_));
            ZO_ASSERT_OK(dev_->copy_d2h(got.v.data(), dv, got.v.size(), stream_));
            if (copy) ZO_ASSERT_OK(dev_->copy_d2h(got.copy.data(), dc, got.copy.size(), stream_));
            ZO_ASSERT_OK(dev_->synchronize(stream_));
            for (size_t k = 0; k < paths.size(); ++k) {
              SCOPED_TRACE("step " + std::to_string(step) + " vs cpu_optim " + paths[k].name);
              // Codes and absmax hold no NaN (a NaN moment is code 0 and left out of the absmax).
              const DType md = bf16_moments ? DType::kBF16 : DType::kF32;
              ASSERT_TRUE(same_bits_up_to_nan_payload(got.p, cpu[k].p, pd)) << "params differ";
              ASSERT_TRUE(eight_bit ? got.m == cpu[k].m : same_bits_up_to_nan_payload(got.m, cpu[k].m, md))
                  << "exp_avg differs";
              ASSERT_TRUE(eight_bit ? got.v == cpu[k].v : same_bits_up_to_nan_payload(got.v, cpu[k].v, md))
                  << "exp_avg_sq differs";
              ASSERT_TRUE(same_bits_up_to_nan_payload(got.copy, cpu[k].copy, copy_dtype)) << "copy_out differs";
            }
            if (step == kSteps && eight_bit) {  // the update moved the states: not a no-op kernel
              EXPECT_NE(got.m, init.m);
              EXPECT_NE(got.v, init.v);
            }
          }
          ++cases;
        }
  EXPECT_EQ(cases, 40);
  for (DevicePtr d : {dp, dm, dv, dg, dc}) dev_->free(d);
}

// Note [The packed 4-bit base]: the kernel gives, for every layout (odd counts, a partial last
// block, each quant type — NF4, FP4 and 8-bit rows —, each rounding and output dtype, a blob not
// 4-byte aligned), the bits of the host's reader (bnb4::dequantize_blob), which bnb4bit-bnb holds to
// bitsandbytes'.
TEST_P(DeviceConformance, DequantizePackedMatchesTheHostReaderBitForBit) {
  if (!dev_) return;
  std::mt19937 rng(7);
  const std::pair<uint64_t, uint64_t> shapes[] = {{1, 1}, {7, 9}, {8, 8}, {5, 13}, {17, 241}, {1, 100003}, {331, 302}};
  for (const auto& [rows, cols] : shapes) {
    const uint64_t n = rows * cols;
    for (const uint8_t type : {uint8_t{0}, uint8_t{1}, bnb4::kBlobInt8}) {
      for (const DType round : {DType::kF32, DType::kBF16, DType::kF16}) {
        for (const DType out_dtype : {DType::kF32, DType::kBF16, DType::kF16}) {
          const uint64_t misalign = 2;  // a blob at an odd pair of bytes: its scales are read bytewise
          const bnb4::BlobHeader written{.type = type, .round = round, .rows = rows, .cols = cols};
          std::vector<uint8_t> blob(written.bytes() + misalign, 0);
          uint8_t* b = blob.data() + misalign;
          bnb4::write_blob_header(written, b);
          for (uint64_t i = 0; i < bnb4::blob_code_bytes(type, n); ++i)
            b[bnb4::blob_codes_offset() + i] = static_cast<uint8_t>(rng());
          for (uint64_t j = 0; j < bnb4::blob_scale_count(type, rows, cols); ++j) {
            const float a =
                std::ldexp(static_cast<float>(rng() % 1000 + 1) / 997.0f, static_cast<int>(rng() % 40) - 20);
            std::memcpy(b + written.scales_offset() + 4 * j, &a, 4);
          }
          bnb4::BlobHeader h;
          ASSERT_TRUE(bnb4::read_blob_header(b, &h));
          ASSERT_EQ(h.bytes(), written.bytes());
          std::vector<float> want(n);
          bnb4::dequantize_blob(h, b + bnb4::blob_codes_offset(), b + h.scales_offset(), 0, n, out_dtype, want.data());
          const uint64_t out_bytes = n * dtype_size_bytes(out_dtype);
          const DevicePtr d_blob = alloc(*dev_, blob.size()), d_out = alloc(*dev_, out_bytes);
          std::vector<uint8_t> got(out_bytes);
          ZO_ASSERT_OK(dev_->copy_h2d(d_blob, blob.data(), blob.size(), stream_));
          ZO_ASSERT_OK(dequantize_packed(
              *dev_,
              {.blob = d_blob + misalign, .blob_bytes = h.bytes(), .out = d_out, .out_dtype = out_dtype, .n_elems = n},
              stream_));
          ZO_ASSERT_OK(dev_->copy_d2h(got.data(), d_out, out_bytes, stream_));
          ZO_ASSERT_OK(dev_->synchronize(stream_));
          int bad = 0;
          for (uint64_t i = 0; i < n && bad < 5; ++i) {
            float v;
            if (out_dtype == DType::kF32) {
              std::memcpy(&v, got.data() + 4 * i, 4);
            } else {
              uint16_t u;
              std::memcpy(&u, got.data() + 2 * i, 2);
              v = out_dtype == DType::kBF16 ? bf16_to_float(u) : f16_to_float(u);
            }
            if (std::memcmp(&v, &want[i], 4) != 0) {
              ++bad;
              ADD_FAILURE() << "shape " << rows << "x" << cols << " type " << int{type} << " round "
                            << dtype_name(round) << " out " << dtype_name(out_dtype) << " element " << i << ": " << v
                            << ", want " << want[i];
            }
          }
          dev_->free(d_blob);
          dev_->free(d_out);
        }
      }
    }
  }
}

TEST_P(DeviceConformance, DequantizePackedRejectsBadArguments) {
  if (!dev_) return;
  constexpr uint64_t kN = 1000;
  const uint64_t blob_bytes = bnb4::blob_bytes(0, kN, 1);
  const DevicePtr blob = alloc(*dev_, blob_bytes), out = alloc(*dev_, kN * 4);
  auto expect_refused = [&](const char* what, const DequantizePackedArgs& a, const char* names) {
    const Status st = dequantize_packed(*dev_, a, stream_);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << what << ": " << st.to_string();
    EXPECT_NE(st.message().find(names), std::string::npos) << what << ": " << st.message();
  };
  const DequantizePackedArgs ok{
      .blob = blob, .blob_bytes = blob_bytes, .out = out, .out_dtype = DType::kBF16, .n_elems = kN};
  DequantizePackedArgs a = ok;
  a.blob_bytes = 2 * blob_bytes;  // the blob no longer fits its allocation
  expect_refused("a blob past its allocation", a, "dequantize_packed blob");
  a = ok;
  a.blob_bytes = blob_bytes - 16;
  expect_refused("a blob smaller than its weights need", a, "smaller than any blob");
  a = ok;
  a.out = out + 2560;  // 2000 bytes from there run past the output's allocation
  expect_refused("an output past its allocation", a, "dequantize_packed out");
  a = ok;
  a.n_elems = 100;  // both ranges inside the blob's allocation, the output over the blob
  a.out = blob;
  expect_refused("overlapping ranges", a, "overlap");
  a = ok;
  a.out = out + 1;
  expect_refused("a misaligned output", a, "aligned");
  a = ok;
  a.out_dtype = static_cast<DType>(9);
  expect_refused("an unknown dtype", a, "out_dtype");
  a = ok;
  a.n_elems = 0;
  ZO_ASSERT_OK(dequantize_packed(*dev_, a, stream_));
  dev_->free(blob);
  dev_->free(out);
}

TEST_P(DeviceConformance, NarrowStateStepsRejectBadArguments) {
  if (!dev_) return;
  constexpr uint64_t kN = 1024;  // allocations of whole kDeviceAlignment units: no slack past them
  const DevicePtr dp = alloc(*dev_, kN * 4), dm = alloc(*dev_, kN * 4), dv = alloc(*dev_, kN * 4);
  const DevicePtr dg = alloc(*dev_, kN * 4), dc = alloc(*dev_, kN * 4);
  const DeviceAdamArgs adam{.params = dp,
                            .param_dtype = DType::kBF16,
                            .exp_avg = dm,
                            .exp_avg_sq = dv,
                            .moment_dtype = DType::kBF16,
                            .grad = dg,
                            .copy_out = dc,
                            .copy_dtype = DType::kBF16,
                            .n_elems = kN};
  const DeviceAdam8bitArgs eight{
      .params = dp, .m_codes = dm, .m_absmax = dm + kN, .v_codes = dv, .v_absmax = dv + kN, .grad = dg, .n_elems = kN};
  auto expect_refused = [&](const char* what, const Status& st, const char* names) {
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << what << ": " << st.to_string();
    EXPECT_NE(st.message().find(names), std::string::npos) << what << ": " << st.message();
  };
  DeviceAdamArgs a = adam;
  a.param_dtype = DType::kF16;
  expect_refused("fp16 masters", optim_kernels(*dev_).adam_step(*dev_, a, stream_), "param_dtype");
  a = adam;
  a.copy_dtype = DType::kF32;
  expect_refused("bf16 masters with an fp32 copy-out", optim_kernels(*dev_).adam_step(*dev_, a, stream_),
                 "copy_dtype must be bf16");
  a = adam;
  a.moment_dtype = DType::kF16;
  expect_refused("fp16 moments", optim_kernels(*dev_).adam_step(*dev_, a, stream_), "moment_dtype");
  a = adam;
  a.param_dtype = DType::kF32;
  a.moment_dtype = DType::kF32;
  a.exp_avg = dm + 8;  // fp32 moments no longer fit their allocation
  expect_refused("fp32 moments past the end", optim_kernels(*dev_).adam_step(*dev_, a, stream_), "exp_avg");
  DeviceAdam8bitArgs e = eight;
  e.m_absmax = dm + (kN - 8);  // overlaps the codes
  expect_refused("absmax over the codes", optim_kernels(*dev_).adam8bit_step(*dev_, e, stream_), "overlap");
  e = eight;
  e.m_absmax = dm + (kN + 1);  // a float the device cannot read (a CUDA fault, found on an H200)
  expect_refused("absmax not 4-byte aligned", optim_kernels(*dev_).adam8bit_step(*dev_, e, stream_),
                 "m_absmax is not 4-byte aligned");
  e = eight;
  e.v_absmax = dv + (kN * 4 - 8);  // 4 blocks need 16 bytes
  expect_refused("absmax past the end", optim_kernels(*dev_).adam8bit_step(*dev_, e, stream_), "v_absmax");
  e = eight;
  e.step = 0;
  expect_refused("step 0", optim_kernels(*dev_).adam8bit_step(*dev_, e, stream_), "adam8bit_step");
  e = eight;
  e.param_dtype = DType::kBF16;
  e.copy_out = dc;
  e.copy_dtype = DType::kF16;
  expect_refused("bf16 masters with an fp16 copy-out", optim_kernels(*dev_).adam8bit_step(*dev_, e, stream_),
                 "copy_dtype must be bf16");
  ZO_ASSERT_OK(dev_->synchronize(stream_));
  for (DevicePtr d : {dp, dm, dv, dg, dc}) dev_->free(d);
}

TEST_P(DeviceConformance, AdamStepRejectsBadArgumentsAndQueuesNothing) {
  if (!dev_) return;
  constexpr uint64_t kN = 1000;
  const DevicePtr dp = alloc(*dev_, kN * 4), dm = alloc(*dev_, kN * 4), dv = alloc(*dev_, kN * 4);
  const DevicePtr dg = alloc(*dev_, kN * 2), dc = alloc(*dev_, kN * 2);
  const std::vector<float> ones(kN, 1.0f);
  for (DevicePtr d : {dp, dm, dv}) ZO_ASSERT_OK(dev_->copy_h2d(d, ones.data(), kN * 4, stream_));
  ZO_ASSERT_OK(dev_->copy_h2d(dg, ones.data(), kN * 2, stream_));
  ZO_ASSERT_OK(dev_->copy_h2d(dc, ones.data(), kN * 2, stream_));
  ZO_ASSERT_OK(dev_->synchronize(stream_));
  const DeviceStats before = dev_->stats();
  const DeviceAdamArgs good{.params = dp,
                            .exp_avg = dm,
                            .exp_avg_sq = dv,
                            .grad = dg,
                            .grad_dtype = DType::kBF16,
                            .grad_scale = 0.5f,
                            .copy_out = dc,
                            .copy_dtype = DType::kF16,
                            .n_elems = kN,
                            .config = {.weight_decay = 0.01f},
                            .step = 3};
  std::vector<std::pair<const char*, DeviceAdamArgs>> bad;
  auto with = [&](const char* what, auto&& change) {
    DeviceAdamArgs a = good;
    change(a);
    bad.emplace_back(what, a);
  };
  with("step 0", [](DeviceAdamArgs& a) { a.step = 0; });
  with("negative step", [](DeviceAdamArgs& a) { a.step = -4; });
  with("beta1 = 1", [](DeviceAdamArgs& a) { a.config.beta1 = 1.0f; });
  with("beta2 < 0", [](DeviceAdamArgs& a) { a.config.beta2 = -0.1f; });
  with("negative lr", [](DeviceAdamArgs& a) { a.config.lr = -1e-3f; });
  with("NaN eps", [](DeviceAdamArgs& a) { a.config.eps = NAN; });
  with("infinite weight decay", [](DeviceAdamArgs& a) { a.config.weight_decay = INFINITY; });
  with("infinite grad_scale", [](DeviceAdamArgs& a) { a.grad_scale = INFINITY; });
  with("NaN grad_scale", [](DeviceAdamArgs& a) { a.grad_scale = NAN; });
  with("unknown grad dtype", [](DeviceAdamArgs& a) { a.grad_dtype = static_cast<DType>(7); });
  with("unknown copy dtype", [](DeviceAdamArgs& a) { a.copy_dtype = static_cast<DType>(3); });
  with("params past the end", [&](DeviceAdamArgs& a) { a.params = dp + 1024; });
  with("grad too short for fp32", [](DeviceAdamArgs& a) { a.grad_dtype = DType::kF32; });
  with("copy too short for fp32", [](DeviceAdamArgs& a) { a.copy_dtype = DType::kF32; });
  with("null exp_avg", [](DeviceAdamArgs& a) { a.exp_avg = DevicePtr{}; });
  with("host exp_avg_sq", [&](DeviceAdamArgs& a) { a.exp_avg_sq = DevicePtr{const_cast<float*>(ones.data())}; });
  with("n past the allocations", [](DeviceAdamArgs& a) { a.n_elems = 2000; });
  with("moments alias", [&](DeviceAdamArgs& a) { a.exp_avg_sq = dm; });
  with("copy_out overlaps grad", [&](DeviceAdamArgs& a) { a.copy_out = dg; });
  for (const auto& [what, args] : bad) {
    const Status st = optim_kernels(*dev_).adam_step(*dev_, args, stream_);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << what << ": " << st.to_string();
    EXPECT_NE(st.message().find("adam_step"), std::string::npos) << what << ": " << st.message();
  }
  // Nothing was queued: every buffer still holds its ones.
  std::vector<float> p(kN), m(kN), v(kN);
  std::vector<uint16_t> copy(kN);
  ZO_ASSERT_OK(dev_->copy_d2h(p.data(), dp, kN * 4, stream_));
  ZO_ASSERT_OK(dev_->copy_d2h(m.data(), dm, kN * 4, stream_));
  ZO_ASSERT_OK(dev_->copy_d2h(v.data(), dv, kN * 4, stream_));
  ZO_ASSERT_OK(dev_->copy_d2h(copy.data(), dc, kN * 2, stream_));
  ZO_ASSERT_OK(dev_->synchronize(stream_));
  EXPECT_EQ(p, ones);
  EXPECT_EQ(m, ones);
  EXPECT_EQ(v, ones);
  std::vector<uint16_t> ones16(kN);
  std::memcpy(ones16.data(), ones.data(), kN * 2);
  EXPECT_EQ(copy, ones16);
  // n = 0 is fine and touches nothing; the good call then runs and moves no bytes in the counters.
  DeviceAdamArgs empty = good;
  empty.n_elems = 0;
  empty.params = DevicePtr{};
  ZO_ASSERT_OK(optim_kernels(*dev_).adam_step(*dev_, empty, stream_));
  ZO_ASSERT_OK(optim_kernels(*dev_).adam_step(*dev_, good, stream_));
  ZO_ASSERT_OK(dev_->copy_d2h(p.data(), dp, kN * 4, stream_));
  ZO_ASSERT_OK(dev_->synchronize(stream_));
  EXPECT_NE(p, ones);
  const DeviceStats after = dev_->stats();
  EXPECT_EQ(after.h2d_bytes, before.h2d_bytes);
  EXPECT_EQ(after.d2d_bytes, before.d2d_bytes);
  EXPECT_EQ(after.d2h_bytes, before.d2h_bytes + (3 * kN * 4 + kN * 2) + kN * 4);  // the copies above only
  for (DevicePtr d : {dp, dm, dv, dg, dc}) dev_->free(d);
}

// adam_step is queued like any kernel: behind a delay it has not run when the call returns, and
// what it wrote is visible once the stream is synchronised.
TEST_P(DeviceConformance, AdamStepRunsInStreamOrder) {
  if (!dev_) return;
  constexpr size_t kN = 4099;
  const AdamState init = adam_initial_state(kN, 7);
  const AdamGrad g = adam_grad(DType::kF32, kN, 8);
  const AdamCase c{.grad_dtype = DType::kF32,
                   .copy = true,
                   .copy_dtype = DType::kBF16,
                   .config = {.lr = 1e-2f, .weight_decay = 0.1f}};
  const DevicePtr dp = alloc(*dev_, kN * 4), dm = alloc(*dev_, kN * 4), dv = alloc(*dev_, kN * 4);
  const DevicePtr dg = alloc(*dev_, kN * 4), dc = alloc(*dev_, kN * 2);
  PinnedWords out(*dev_, kN);
  Result<Event> done = dev_->create_event();
  ASSERT_TRUE(done.is_ok());
  ZO_ASSERT_OK(dev_->copy_h2d(dp, init.p.data(), kN * 4, stream_));
  ZO_ASSERT_OK(dev_->copy_h2d(dm, init.m.data(), kN * 4, stream_));
  ZO_ASSERT_OK(dev_->copy_h2d(dv, init.v.data(), kN * 4, stream_));
  ZO_ASSERT_OK(dev_->copy_h2d(dg, g.data(), kN * 4, stream_));
  ZO_ASSERT_OK(dev_->synchronize(stream_));
  ZO_ASSERT_OK(test_delay(*dev_, stream_, 200'000));
  ZO_ASSERT_OK(optim_kernels(*dev_).adam_step(*dev_,
                                              {.params = dp,
                                               .exp_avg = dm,
                                               .exp_avg_sq = dv,
                                               .grad = dg,
                                               .copy_out = dc,
                                               .copy_dtype = DType::kBF16,
                                               .n_elems = kN,
                                               .config = c.config,
                                               .step = 1},
                                              stream_));
  ZO_ASSERT_OK(dev_->copy_d2h(out.data(), dp, kN * 4, stream_));
  ZO_ASSERT_OK(dev_->record(*done, stream_));
  Result<bool> q = dev_->query(*done);
  ASSERT_TRUE(q.is_ok());
  EXPECT_FALSE(*q) << "adam_step finished while a 200 ms delay was at the head of its stream";
  EXPECT_EQ(out[0], 0u);
  ZO_ASSERT_OK(dev_->synchronize(stream_));
  auto ex = cpu_optim::Executor::create({.n_threads = 1, .isa = cpu_optim::Isa::kScalar});
  ASSERT_TRUE(ex.is_ok());
  AdamState want = init;
  ZO_ASSERT_OK(cpu_adam_step(c, 1, 1.0f, g, **ex, want));
  EXPECT_EQ(std::memcmp(out.data(), want.p.data(), kN * 4), 0);
  dev_->destroy_event(*done);
  for (DevicePtr d : {dp, dm, dv, dg, dc}) dev_->free(d);
}

TEST_P(DeviceConformance, DestructionWaitsForQueuedWork) {
  if (!dev_) return;
  std::string skip_reason;
  std::unique_ptr<Device> dev = make_test_device(GetParam(), kTestBudgetBytes, &skip_reason);
  ASSERT_TRUE(dev);
  constexpr size_t kN = 1 << 16;
  const std::vector<uint32_t> src = pattern(kN, 11);
  std::vector<uint32_t> out(kN, 0);
  Result<Stream> a = dev->create_stream();
  Result<Stream> b = dev->create_stream();
  Result<Event> ev = dev->create_event();
  ASSERT_TRUE(a.is_ok() && b.is_ok() && ev.is_ok());
  Result<DevicePtr> d = dev->allocate(kN * 4);
  ASSERT_TRUE(d.is_ok());
  ZO_ASSERT_OK(dev->register_host(out.data(), kN * 4));  // left registered: the destructor drops it
  ZO_ASSERT_OK(test_delay(*dev, *a, 100'000));
  ZO_ASSERT_OK(dev->copy_h2d(*d, src.data(), kN * 4, *a));
  ZO_ASSERT_OK(dev->record(*ev, *a));
  ZO_ASSERT_OK(dev->wait(*b, *ev));
  ZO_ASSERT_OK(dev->copy_d2h(out.data(), *d, kN * 4, *b));
  dev.reset();  // streams, event and allocation still alive, work still queued
  EXPECT_EQ(out, src);
}

}  // namespace
}  // namespace zo::gpu::test

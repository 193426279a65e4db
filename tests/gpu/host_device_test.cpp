// HostDevice (suite unit): the device-agnostic checks, plus what only the emulation can show —
// that the event test would fail without the wait, the poison fill, the factory without a GPU.
#include "gpu/host_device.h"

#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "cpu_optim/executor.h"
#include "gpu/device_info.h"
#include "gpu/foreign_streams.h"
#include "gpu/optim_kernels.h"
#include "gpu/test_hooks.h"
#include "tests/gpu/adam_reference.h"
#include "tests/engine/temp_dir.h"
#include "tests/gpu/device_conformance.h"

namespace zo::gpu {
namespace {

using test::DeviceConformance;

INSTANTIATE_TEST_SUITE_P(Host, DeviceConformance, ::testing::Values(DeviceKind::kHost), test::KindName());

std::unique_ptr<HostDevice> make_host(uint64_t budget_bytes = 1 << 20) {
  Result<std::unique_ptr<HostDevice>> dev = HostDevice::create(budget_bytes);
  ZO_CHECK(dev.is_ok()) << dev.status().to_string();
  return std::move(dev).value();
}

// Two pieces of work of one kind at once count once in busy() (the union of their intervals), and
// foreign work on a stream the emulated device does not have is refused without running.
TEST(HostDevice, BusyIsTheUnionOfOverlappingWorkAndForeignStreamsAreRefused) {
  auto dev = make_host();
  const DeviceBusy before = dev->busy();
  auto hold = [&] {
    return gpu::foreign_work(*dev, DeviceWork::kH2D, 1, nullptr, {}, [] {
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      return Status::ok();
    });
  };
  std::thread other([&] { EXPECT_TRUE(hold().is_ok()); });
  EXPECT_TRUE(hold().is_ok());
  other.join();
  const double h2d = dev->busy().h2d_s - before.h2d_s;
  EXPECT_GE(h2d, 0.199);
  EXPECT_LT(h2d, 0.35) << "two copies at once counted twice";
  bool ran = false;
  int foreign = 0;
  Status st = gpu::foreign_work(*dev, DeviceWork::kCompute, 0, &foreign, "x", [&] {
    ran = true;
    return Status::ok();
  });
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_FALSE(ran);
}

// The control for DeviceConformance.EventsOrderWorkAcrossStreams: the same work without the
// wait lets stream B read before stream A has written, so that test does depend on events.
TEST(HostDevice, WithoutAWaitTheConsumerStreamRunsAhead) {
  auto dev = make_host();
  Stream a = *dev->create_stream();
  Stream b = *dev->create_stream();
  const DevicePtr d = *dev->allocate(4096);
  std::vector<uint8_t> src(4096, 0x11), out(4096, 0x22);
  ASSERT_TRUE(dev->fill_zero(d, 4096, a).is_ok());
  ASSERT_TRUE(dev->synchronize(a).is_ok());
  ASSERT_TRUE(test_delay(*dev, a, 200'000).is_ok());
  ASSERT_TRUE(dev->copy_h2d(d, src.data(), 4096, a).is_ok());
  ASSERT_TRUE(dev->copy_d2h(out.data(), d, 4096, b).is_ok());
  ASSERT_TRUE(dev->synchronize(b).is_ok());
  EXPECT_EQ(out, std::vector<uint8_t>(4096, 0x00));
  ASSERT_TRUE(dev->synchronize().is_ok());
  dev->free(d);
}

TEST(HostDevice, ReRecordingAnEventKeepsEarlierWaitsOnTheirRecord) {
  auto dev = make_host();
  Stream slow = *dev->create_stream();
  Stream fast = *dev->create_stream();
  Stream consumer = *dev->create_stream();
  Event ev = *dev->create_event();
  const DevicePtr d = *dev->allocate(256);
  std::vector<uint8_t> src(256, 0x33), out(256, 0);
  ASSERT_TRUE(dev->fill_zero(d, 256, slow).is_ok());
  ASSERT_TRUE(test_delay(*dev, slow, 150'000).is_ok());
  ASSERT_TRUE(dev->copy_h2d(d, src.data(), 256, slow).is_ok());
  ASSERT_TRUE(dev->record(ev, slow).is_ok());
  ASSERT_TRUE(dev->wait(consumer, ev).is_ok());  // waits for the record on `slow`
  ASSERT_TRUE(dev->record(ev, fast).is_ok());    // completes at once; must not release the wait
  ASSERT_TRUE(dev->copy_d2h(out.data(), d, 256, consumer).is_ok());
  ASSERT_TRUE(dev->synchronize(consumer).is_ok());
  EXPECT_EQ(out, src);
  dev->destroy_event(ev);
  ASSERT_TRUE(dev->synchronize().is_ok());
  dev->free(d);
}

TEST(HostDevice, ForeignStreamsOtherThanTheHostAreRefused) {
  auto dev = HostDevice::create(1 << 20);
  ASSERT_TRUE(dev.is_ok());
  Result<Event> ev = (*dev)->create_event();
  ASSERT_TRUE(ev.is_ok());
  int not_a_stream = 0;
  const Status st = gpu::record_foreign(**dev, *ev, &not_a_stream);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.to_string();
  const Status waited = gpu::wait_foreign(**dev, &not_a_stream, *ev);
  EXPECT_EQ(waited.code(), StatusCode::kInvalidArgument) << waited.to_string();
  // The host's own "stream" has finished everything before the call: a foreign record moves the
  // event past a record still pending behind a slow stream, and is complete at once.
  Result<Stream> slow = (*dev)->create_stream();
  ASSERT_TRUE(slow.is_ok());
  ASSERT_TRUE(test_delay(**dev, *slow, 200'000).is_ok());
  ASSERT_TRUE((*dev)->record(*ev, *slow).is_ok());
  EXPECT_FALSE(*(*dev)->query(*ev));
  EXPECT_TRUE(gpu::record_foreign(**dev, *ev, nullptr).is_ok());
  EXPECT_TRUE(*(*dev)->query(*ev));
  (*dev)->destroy_event(*ev);
  (*dev)->destroy_stream(*slow);
}

TEST(HostDevice, NewDeviceMemoryIsPoisoned) {
  auto dev = make_host();
  Stream s = *dev->create_stream();
  const DevicePtr d = *dev->allocate(64);
  std::vector<uint8_t> out(64, 0);
  ASSERT_TRUE(dev->copy_d2h(out.data(), d, 64, s).is_ok());
  ASSERT_TRUE(dev->synchronize(s).is_ok());
  EXPECT_EQ(out, std::vector<uint8_t>(64, 0xFF));
  dev->free(d);
}

TEST(HostDevice, DestructionReleasesWhatWasNotFreed) {
  auto dev = make_host();
  ASSERT_TRUE(dev->allocate(1000).is_ok());
  ASSERT_TRUE(dev->allocate_pinned(5000).is_ok());
  ASSERT_TRUE(dev->create_event().is_ok());
  EXPECT_EQ(dev->stats().allocated_bytes, 1024u);
  dev.reset();  // LeakSanitizer (build-asan) would report anything left behind
}

// What only the emulation can show: device memory is host memory here, so the test can look at
// the parameters while adam_step waits behind a delay (untouched) and after synchronize (stepped).
TEST(HostDevice, AdamStepWritesOnlyWhenItsStreamReachesIt) {
  auto dev = make_host(1 << 20);
  Stream s = *dev->create_stream();
  constexpr size_t kN = 1000;
  const test::AdamState init = test::adam_initial_state(kN, 3);
  const test::AdamGrad g = test::adam_grad(DType::kBF16, kN, 4);
  const DevicePtr dp = *dev->allocate(kN * 4), dm = *dev->allocate(kN * 4), dv = *dev->allocate(kN * 4);
  const DevicePtr dg = *dev->allocate(kN * 2);
  ASSERT_TRUE(dev->copy_h2d(dp, init.p.data(), kN * 4, s).is_ok());
  ASSERT_TRUE(dev->copy_h2d(dm, init.m.data(), kN * 4, s).is_ok());
  ASSERT_TRUE(dev->copy_h2d(dv, init.v.data(), kN * 4, s).is_ok());
  ASSERT_TRUE(dev->copy_h2d(dg, g.data(), kN * 2, s).is_ok());
  ASSERT_TRUE(dev->synchronize(s).is_ok());
  const test::AdamCase c{.grad_dtype = DType::kBF16, .config = {.weight_decay = 0.01f, .adam_w_mode = false}};
  ASSERT_TRUE(test_delay(*dev, s, 200'000).is_ok());
  ASSERT_TRUE(optim_kernels(*dev)
                  .adam_step(*dev,
                             {.params = dp,
                              .exp_avg = dm,
                              .exp_avg_sq = dv,
                              .grad = dg,
                              .grad_dtype = DType::kBF16,
                              .grad_scale = 0.25f,
                              .n_elems = kN,
                              .config = c.config,
                              .step = 2},
                             s)
                  .is_ok());
  EXPECT_EQ(std::memcmp(dp.addr, init.p.data(), kN * 4), 0) << "adam_step ran before the delay ahead of it";
  EXPECT_EQ(std::memcmp(dv.addr, init.v.data(), kN * 4), 0);
  ASSERT_TRUE(dev->synchronize(s).is_ok());
  auto ex = cpu_optim::Executor::create({.n_threads = 1, .isa = cpu_optim::Isa::kScalar});
  ASSERT_TRUE(ex.is_ok());
  test::AdamState want = init;
  ASSERT_TRUE(test::cpu_adam_step(c, 2, 0.25f, g, **ex, want).is_ok());
  EXPECT_NE(std::memcmp(dp.addr, init.p.data(), kN * 4), 0);
  EXPECT_EQ(std::memcmp(dp.addr, want.p.data(), kN * 4), 0);
  EXPECT_EQ(std::memcmp(dm.addr, want.m.data(), kN * 4), 0);
  EXPECT_EQ(std::memcmp(dv.addr, want.v.data(), kN * 4), 0);
  for (DevicePtr d : {dp, dm, dv, dg}) dev->free(d);
}

TEST(HostDeviceDeathTest, FreeingAnUnknownAddressAborts) {
  auto dev = make_host();
  int x = 0;
  EXPECT_DEATH(dev->free(DevicePtr{&x}), "not a live device allocation");
}

TEST(HostDevice, ZeroBudgetIsRejected) {
  Result<std::unique_ptr<HostDevice>> dev = HostDevice::create(0);
  ASSERT_FALSE(dev.is_ok());
  EXPECT_EQ(dev.status().code(), StatusCode::kInvalidArgument);
}

TEST(MakeDevice, HostIsAlwaysAvailable) {
  Result<std::unique_ptr<Device>> dev = make_device(DeviceKind::kHost, 1 << 20);
  ASSERT_TRUE(dev.is_ok()) << dev.status().to_string();
  EXPECT_EQ((*dev)->kind(), DeviceKind::kHost);
  EXPECT_EQ((*dev)->stats().budget_bytes, 1u << 20);
  EXPECT_EQ(make_device(DeviceKind::kHost, 0).status().code(), StatusCode::kInvalidArgument);
}

TEST(MakeDevice, WithoutAGpuCudaIsAnErrorAndAutoPicksHost) {
  const GpuProbe probe = probe_gpus();
  if (!probe.gpus.empty()) GTEST_SKIP() << "a GPU is usable here; covered by gpu_test";
  Result<std::unique_ptr<Device>> cuda = make_device(DeviceKind::kCuda, 1 << 20);
  ASSERT_FALSE(cuda.is_ok());
  EXPECT_EQ(cuda.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(cuda.status().message().find(probe.reason), std::string::npos) << cuda.status().to_string();
  Result<std::unique_ptr<Device>> any = make_device(DeviceKind::kAuto, 1 << 20);
  ASSERT_TRUE(any.is_ok()) << any.status().to_string();
  EXPECT_EQ((*any)->kind(), DeviceKind::kHost);
}

// choose_device over made-up probes: the decision, not this machine's hardware.
GpuProbe probe_with(bool present, int n_gpus, std::string reason) {
  GpuProbe p;
  p.built_with_cuda = true;
  p.gpu_present = present;
  for (int i = 0; i < n_gpus; ++i) p.gpus.push_back({.index = i, .name = "Test GPU", .total_bytes = 1u << 30});
  p.reason = std::move(reason);
  return p;
}

TEST(ChooseDevice, AutoWithAPresentButUnusableGpuWarnsAndNamesTheReason) {
  const GpuProbe p = probe_with(true, 0, "CUDA runtime: CUDA driver version is insufficient for CUDA runtime version");
  Result<DeviceChoice> c = choose_device(DeviceKind::kAuto, p);
  ASSERT_TRUE(c.is_ok()) << c.status().to_string();
  EXPECT_EQ(c->kind, DeviceKind::kHost);
  EXPECT_TRUE(c->warn);
  EXPECT_NE(c->message.find(p.reason), std::string::npos) << c->message;
  EXPECT_NE(c->message.find("training runs on the CPU"), std::string::npos) << c->message;
  // cuda stays an error, with the same reason.
  Result<DeviceChoice> cuda = choose_device(DeviceKind::kCuda, p);
  ASSERT_FALSE(cuda.is_ok());
  EXPECT_EQ(cuda.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(cuda.status().message().find(p.reason), std::string::npos) << cuda.status().to_string();
}

TEST(ChooseDevice, AutoWithoutAnyGpuIsAnInfoLineNotAWarning) {
  Result<DeviceChoice> c = choose_device(DeviceKind::kAuto, probe_with(false, 0, "CUDA runtime reports no devices"));
  ASSERT_TRUE(c.is_ok());
  EXPECT_EQ(c->kind, DeviceKind::kHost);
  EXPECT_FALSE(c->warn);
  EXPECT_NE(c->message.find("CUDA runtime reports no devices"), std::string::npos) << c->message;
}

TEST(ChooseDevice, AUsableGpuIsTakenByAutoAndCudaAndHostStaysHost) {
  for (DeviceKind k : {DeviceKind::kAuto, DeviceKind::kCuda}) {
    Result<DeviceChoice> c = choose_device(k, probe_with(true, 2, ""));
    ASSERT_TRUE(c.is_ok());
    EXPECT_EQ(c->kind, DeviceKind::kCuda);
    EXPECT_FALSE(c->warn);
  }
  Result<DeviceChoice> host = choose_device(DeviceKind::kHost, probe_with(true, 2, ""));
  ASSERT_TRUE(host.is_ok());
  EXPECT_EQ(host->kind, DeviceKind::kHost);
  EXPECT_FALSE(host->warn);
}

TEST(NvidiaGpuPresent, SeesDriverEntriesAndDeviceFilesOnly) {
  namespace fs = std::filesystem;
  const engine::TempDir dir("zo_gpu_present");
  const fs::path root = dir.path;
  fs::create_directories(root / "dev");
  auto touch = [](const fs::path& p) { std::ofstream(p).put('x'); };
  EXPECT_FALSE(nvidia_gpu_present(root.string()));
  // The control and UVM nodes exist without any GPU (driver loaded, GPU gone): not a GPU.
  touch(root / "dev" / "nvidiactl");
  touch(root / "dev" / "nvidia-uvm");
  EXPECT_FALSE(nvidia_gpu_present(root.string()));
  touch(root / "dev" / "nvidia0");
  EXPECT_TRUE(nvidia_gpu_present(root.string()));
  fs::remove(root / "dev" / "nvidia0");
  fs::create_directories(root / "proc" / "driver" / "nvidia" / "gpus" / "0000:01:00.0");
  EXPECT_TRUE(nvidia_gpu_present(root.string()));
}

TEST(DeviceKind, ParsesItsNames) {
  EXPECT_EQ(*parse_device_kind("auto"), DeviceKind::kAuto);
  EXPECT_EQ(*parse_device_kind("cuda"), DeviceKind::kCuda);
  EXPECT_EQ(*parse_device_kind("host"), DeviceKind::kHost);
  EXPECT_EQ(parse_device_kind("gpu").status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace zo::gpu

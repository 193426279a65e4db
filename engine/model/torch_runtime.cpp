#include "engine/model/torch_runtime.h"

// The few LibTorch headers this needs, not torch/torch.h: this file compiles in seconds.
#include <ATen/core/Tensor.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/version.h>

#include <atomic>
#include <cstring>
#include <mutex>
#include <unordered_map>

namespace zo::engine {

LibTorchInfo libtorch_info() {
  LibTorchInfo info;
  info.version = TORCH_VERSION;
  // The CUDA hooks are registered by libtorch_cuda's static initialisers: when the library is not
  // loaded (Note [Linking CUDA LibTorch] in meson.build) the default hooks answer isBuilt() false.
  const at::CUDAHooksInterface& hooks = at::detail::getCUDAHooks();
  info.cuda_linked = hooks.isBuilt();
  if (info.cuda_linked) {
    const long v = hooks.versionCUDART();  // CUDART_VERSION: 1000 * major + 10 * minor
    info.cuda_version = std::to_string(v / 1000) + "." + std::to_string((v % 1000) / 10);
    info.cuda_devices = static_cast<int>(hooks.deviceCount());
  }
  return info;
}

gpu::GpuProbe probe_usable_gpus() {
  gpu::GpuProbe probe = gpu::probe_gpus();
  if (probe.gpus.empty()) return probe;
  const LibTorchInfo t = libtorch_info();
  if (!t.cuda_linked || t.cuda_devices == 0) {
    probe.reason = !t.cuda_linked
                       ? "LibTorch " + t.version +
                             " has no CUDA backend: a CPU-only PyTorch, or libtorch_cuda not linked (see docs/gpu.md)"
                       : "LibTorch " + t.version + " (CUDA " + t.cuda_version +
                             ") sees no GPU while the CUDA runtime lists " + std::to_string(probe.gpus.size());
    probe.gpus.clear();
  }
  return probe;
}

namespace {

// Counts what LibTorch's CPU allocator hands out. The inner DataPtr (whose deleter frees the memory)
// and the size are kept in a table keyed by the data pointer, so the context is the data pointer
// itself: raw_allocate()/raw_deleter() users (oneDNN's bf16 paths) require that.
class CountingCpuAllocator final : public c10::Allocator {
 public:
  explicit CountingCpuAllocator(c10::Allocator* inner) : inner_(inner) {}

  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr inner = inner_->allocate(n);
    void* data = inner.get();
    if (data == nullptr) return inner;  // n == 0
    {
      std::lock_guard<std::mutex> lock(mutex_);
      live_.emplace(data, Record{std::move(inner), n});
    }
    const uint64_t now = current_.fetch_add(n, std::memory_order_relaxed) + n;
    uint64_t peak = peak_.load(std::memory_order_relaxed);
    while (now > peak && !peak_.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {}
    return {data, data, &CountingCpuAllocator::release, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &CountingCpuAllocator::release; }
  void copy_data(void* dest, const void* src, std::size_t count) const override { std::memcpy(dest, src, count); }

  TorchMemory stats() const {
    return {current_.load(std::memory_order_relaxed), peak_.load(std::memory_order_relaxed)};
  }
  void reset_peak() { peak_.store(current_.load(std::memory_order_relaxed), std::memory_order_relaxed); }

  static CountingCpuAllocator* instance;

 private:
  struct Record {
    c10::DataPtr inner;
    size_t size;
  };
  static void release(void* data) {
    CountingCpuAllocator* self = instance;
    c10::DataPtr inner;  // frees the memory when it goes out of scope, outside the lock
    {
      std::lock_guard<std::mutex> lock(self->mutex_);
      auto it = self->live_.find(data);
      if (it == self->live_.end()) return;
      inner = std::move(it->second.inner);
      self->current_.fetch_sub(it->second.size, std::memory_order_relaxed);
      self->live_.erase(it);
    }
  }

  c10::Allocator* inner_;
  std::mutex mutex_;
  std::unordered_map<void*, Record> live_;
  std::atomic<uint64_t> current_{0};
  std::atomic<uint64_t> peak_{0};
};

CountingCpuAllocator* CountingCpuAllocator::instance = nullptr;

std::once_flag g_cpu_once;
CountingCpuAllocator* g_cpu_counter = nullptr;  // lives for the process: LibTorch keeps the pointer

c10::CachingDeviceAllocator::DeviceStats cuda_stats() {
  return c10::getDeviceAllocator(c10::DeviceType::CUDA)->getDeviceStats(0);
}

}  // namespace

void track_torch_memory(bool cuda) {
  if (cuda) return;  // the caching allocator always counts
  std::call_once(g_cpu_once, [] {
    g_cpu_counter = new CountingCpuAllocator(c10::GetCPUAllocator());
    CountingCpuAllocator::instance = g_cpu_counter;
    // A higher priority than the default allocator's 0, so it replaces it.
    c10::SetCPUAllocator(g_cpu_counter, /*priority=*/1);
  });
}

TorchMemory torch_memory(bool cuda) {
  if (cuda) {
    const c10::CachingDeviceAllocator::DeviceStats stats = cuda_stats();
    const auto& s = stats.allocated_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)];
    return {static_cast<uint64_t>(s.current), static_cast<uint64_t>(s.peak)};
  }
  return g_cpu_counter != nullptr ? g_cpu_counter->stats() : TorchMemory{};
}

void* torch_compute_stream(bool cuda) {
  if (!cuda) return nullptr;
  // Through c10's device-generic guard, so this file needs no CUDA header.
  const c10::impl::VirtualGuardImpl guard(c10::DeviceType::CUDA);
  return guard.getStream(c10::Device(c10::DeviceType::CUDA, 0)).native_handle();
}

namespace {

// Taken once: c10's pool hands out its streams round-robin, and every copy should share one.
const c10::Stream& copy_stream() {
  static const c10::Stream stream =
      c10::impl::VirtualGuardImpl(c10::DeviceType::CUDA).getStreamFromGlobalPool(c10::Device(c10::DeviceType::CUDA, 0));
  return stream;
}

}  // namespace

TorchCopyStreamScope::TorchCopyStreamScope(bool cuda) : cuda_(cuda) {
  if (!cuda) return;
  const c10::impl::VirtualGuardImpl guard(c10::DeviceType::CUDA);
  const c10::Stream previous = guard.exchangeStream(copy_stream());
  const c10::StreamData3 packed = previous.pack3();
  previous_[0] = packed.stream_id;
  previous_[1] = packed.device_index;
  previous_[2] = static_cast<int64_t>(packed.device_type);
  native_ = copy_stream().native_handle();
}

TorchCopyStreamScope::~TorchCopyStreamScope() {
  if (!cuda_) return;
  const c10::impl::VirtualGuardImpl guard(c10::DeviceType::CUDA);
  guard.exchangeStream(c10::Stream::unpack3(previous_[0], static_cast<c10::DeviceIndex>(previous_[1]),
                                            static_cast<c10::DeviceType>(previous_[2])));
}

void TorchCopyStreamScope::record_use(const at::Tensor& tensor) const {
  if (!cuda_ || !tensor.defined() || !tensor.is_cuda()) return;
  c10::impl::VirtualGuardImpl(c10::DeviceType::CUDA).recordDataPtrOnStream(tensor.storage().data_ptr(), copy_stream());
}

void reset_torch_memory_peak(bool cuda) {
  if (cuda) {
    c10::getDeviceAllocator(c10::DeviceType::CUDA)->resetPeakStats(0);
  } else if (g_cpu_counter != nullptr) {
    g_cpu_counter->reset_peak();
  }
}

}  // namespace zo::engine

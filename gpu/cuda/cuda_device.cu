#include "gpu/cuda/cuda_device.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <deque>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "common/bytes.h"
#include "common/check.h"
#include "common/host_memory.h"
#include "common/log.h"
#include "common/trace.h"
#include "gpu/cuda/cuda_error.cuh"
#include "gpu/detail/accounting.h"
#include "gpu/detail/half.h"

namespace zo::gpu {
namespace {

using detail::cuda_error;

// Grid-stride loop over the same scalar conversions HostDevice uses (common/half.h), so both
// backends produce identical bits; the dtype branches are uniform across a warp.
__global__ void cast_kernel(void* dst, uint8_t dst_dtype, const void* src, uint8_t src_dtype, uint64_t n) {
  const uint64_t stride = uint64_t{gridDim.x} * blockDim.x;
  for (uint64_t i = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n; i += stride) {
    detail::store_from_float(dst, dst_dtype, i, detail::load_as_float(src, src_dtype, i));
  }
}

__device__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__global__ void delay_kernel(uint64_t duration_ns) {
  const uint64_t start = global_timer_ns();
  while (global_timer_ns() - start < duration_ns) __nanosleep(1000);
}

// Note [One registration per range]: a range is page-locked by one cudaHostRegister call, never
// in pieces. A copy whose host side spans two registrations fails with cudaErrorInvalidValue: on
// an H200 (driver 580), with 1 GiB pieces, the 131 MB embedding of tinyllama-1.1b and a 1 GiB copy
// in `zoffload-bench pcie` failed so, while copies inside one piece ran. LibTorch's own copies
// from the pinned pool (gradients into the landing ring) could not be split at the pieces' edges.
Status register_range(void* ptr, uint64_t size_bytes) {
  if (cudaError_t err = cudaHostRegister(ptr, size_bytes, cudaHostRegisterPortable); err != cudaSuccess) {
    cudaGetLastError();
    return out_of_memory("cudaHostRegister of " + format_bytes(size_bytes) + ": " + cudaGetErrorString(err) +
                         " (check ulimit -l and available RAM)");
  }
  return Status::ok();
}

// `check`: abort on a failure; false in the destructor, which cannot report one.
void unregister_range(void* ptr, bool check = true) {
  const cudaError_t err = cudaHostUnregister(ptr);
  if (check)
    ZO_CHECK(err == cudaSuccess) << "cudaHostUnregister(p): " << cudaGetErrorName(err) << " ("
                                 << cudaGetErrorString(err) << ")";
}

cudaStream_t to_cuda(Stream s) { return static_cast<cudaStream_t>(s.handle); }
cudaEvent_t to_cuda(Event e) { return static_cast<cudaEvent_t>(e.handle); }

}  // namespace

// Note [CUDA pool]: freed blocks are cached by rounded size and reused for requests of the same
// size, since cudaMalloc/cudaFree synchronise the device and would stall a step loop that frees and
// re-allocates. The budget counts live bytes; to keep the memory actually held (live + cached)
// within the budget too, the cache is emptied before any cudaMalloc that would take it past, and
// before a retry when cudaMalloc reports the GPU itself full.
struct CudaDevice::State {
  State(int device_index, uint64_t budget_bytes) : device(device_index), acct(budget_bytes) {}

  Status use() const {
    ZO_CUDA_RETURN_IF_ERROR(cudaSetDevice(device), "cudaSetDevice(" + std::to_string(device) + ")");
    return Status::ok();
  }
  void use_or_die() const { ZO_CUDA_CHECK(cudaSetDevice(device)); }

  void release_cache_locked() {
    for (const auto& [size, p] : cache) ZO_CUDA_CHECK(cudaFree(p));
    cache.clear();
    cached_bytes = 0;
  }

  cudaStream_t stream(Stream s) {
    std::lock_guard lock(mu);
    ZO_CHECK(streams.contains(to_cuda(s))) << "unknown or destroyed stream " << s.handle;
    return to_cuda(s);
  }
  cudaEvent_t event(Event e) {
    std::lock_guard lock(mu);
    ZO_CHECK(events.contains(to_cuda(e))) << "unknown or destroyed event " << e.handle;
    return to_cuda(e);
  }

  // ---- Note [Device time from events] ---------------------------------------------------------
  // Each H2D and D2H copy, and each piece of compute another library queues through foreign_work,
  // is queued between two timing events. Once the second has completed, cudaEventElapsedTime
  // against a base event — recorded on an idle stream of its own and waited for, at a known host
  // time — places the work on the host's steady clock. The intervals of one kind are merged into
  // busy periods, whose lengths add up to busy(); while the trace records, a period of copies is a
  // span of its direction's track ("<n> copies, <bytes>") and each compute call a span of the
  // device compute track, named by the caller. Intervals are resolved in the order they were
  // queued (without blocking, at each new timed work and at busy(); blocking at a trace flush
  // and at synchronize()); one queued on a stream that started earlier than the period before it
  // is clamped to that period's end, so with several streams of one kind the union is a lower
  // bound. Two event records per operation cost a few microseconds of host time. The base is
  // renewed after kBaseRenewNs with nothing pending, so a float of milliseconds keeps
  // microseconds.
  struct Timed {
    cudaEvent_t begin = nullptr;
    cudaEvent_t end = nullptr;
    int kind = 0;  // DeviceWork
    uint64_t bytes = 0;
    bool traced = false;  // queued while the trace recorded
    std::string name;     // compute's span name
  };
  struct Period {
    int64_t begin_ns = 0;
    int64_t end_ns = 0;
    uint64_t items = 0;
    uint64_t bytes = 0;
    bool traced = false;
  };
  static constexpr int kKinds = 3;
  static constexpr int64_t kBaseRenewNs = int64_t{60} * 1'000'000'000;

  // Two timing events (reused ones when there are), and the base when there is none.
  Status take_timing_events(cudaEvent_t out[2]) {
    std::lock_guard lock(timing_mu);
    if (base == nullptr || (timed.empty() && trace::now_ns() - base_ns > kBaseRenewNs)) {
      if (base_stream == nullptr)
        ZO_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&base_stream, cudaStreamNonBlocking),
                                "cudaStreamCreate (timing)");
      if (base == nullptr) ZO_CUDA_RETURN_IF_ERROR(cudaEventCreate(&base), "cudaEventCreate (timing)");
      ZO_CUDA_RETURN_IF_ERROR(cudaEventRecord(base, base_stream), "cudaEventRecord (timing)");
      ZO_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(base), "cudaEventSynchronize (timing)");
      base_ns = trace::now_ns();
    }
    for (int i = 0; i < 2; ++i) {
      if (!spare_events.empty()) {
        out[i] = spare_events.back();
        spare_events.pop_back();
      } else if (cudaError_t err = cudaEventCreate(&out[i]); err != cudaSuccess) {
        if (i == 1) spare_events.push_back(out[0]);
        return cuda_error(err, "cudaEventCreate (timing)");
      }
    }
    return Status::ok();
  }

  // Calls `queue`, which queues work of `kind` on `st` (returning a cudaError_t or a Status),
  // between two timing events.
  template <class Queue>
  auto timed_work(DeviceWork kind, uint64_t bytes, cudaStream_t st, const std::string& name, Queue&& queue)
      -> decltype(queue()) {
    cudaEvent_t ev[2];
    if (!take_timing_events(ev).is_ok()) return queue();  // timing is best effort; the work is not
    cudaEventRecord(ev[0], st);
    auto result = queue();
    cudaEventRecord(ev[1], st);
    const bool traced = trace::on();
    {
      std::lock_guard lock(timing_mu);
      timed.push_back({ev[0], ev[1], static_cast<int>(kind), bytes, traced,
                       traced && kind == DeviceWork::kCompute ? name : std::string()});
    }
    resolve(/*wait=*/false);
    return result;
  }

  // Turns the timed work that has completed (all of it when `wait`) into periods; with `wait`,
  // records the open periods too.
  void resolve(bool wait) {
    std::lock_guard lock(timing_mu);
    while (!timed.empty()) {
      Timed& c = timed.front();
      cudaError_t err = wait ? cudaEventSynchronize(c.end) : cudaEventQuery(c.end);
      if (err == cudaErrorNotReady) break;
      float begin_ms = 0, end_ms = 0;
      if (err == cudaSuccess) err = cudaEventElapsedTime(&begin_ms, base, c.begin);
      if (err == cudaSuccess) err = cudaEventElapsedTime(&end_ms, base, c.end);
      if (err == cudaSuccess) {
        add(c, base_ns + static_cast<int64_t>(double{begin_ms} * 1e6),
            base_ns + static_cast<int64_t>(double{end_ms} * 1e6));
      } else {
        cudaGetLastError();  // a failed operation: its error reaches its caller through the stream, not here
      }
      spare_events.push_back(c.begin);
      spare_events.push_back(c.end);
      timed.pop_front();
    }
    if (wait)
      for (int k = 0; k < kKinds; ++k) close(k);
  }

  void add(const Timed& c, int64_t begin_ns, int64_t end_ns) {
    const int k = c.kind;
    begin_ns = std::max(begin_ns, closed_end_ns[k]);
    end_ns = std::max(end_ns, begin_ns);
    if (c.traced && k == static_cast<int>(DeviceWork::kCompute))
      trace::record_late(trace::Track::kDeviceCompute, c.name, begin_ns, end_ns);
    Period& p = open[k];
    if (p.items > 0 && begin_ns <= p.end_ns) {
      p.begin_ns = std::min(p.begin_ns, begin_ns);
      p.end_ns = std::max(p.end_ns, end_ns);
    } else {
      close(k);
      p = {.begin_ns = begin_ns, .end_ns = end_ns};
    }
    ++p.items;
    p.bytes += c.bytes;
    p.traced = p.traced || c.traced;
  }

  void close(int k) {
    Period& p = open[k];
    if (p.items == 0) return;
    busy_ns[k] += p.end_ns - p.begin_ns;
    if (p.traced && k != static_cast<int>(DeviceWork::kCompute)) {
      trace::record_period(k == static_cast<int>(DeviceWork::kH2D) ? trace::Track::kCopyH2D : trace::Track::kCopyD2H,
                           "copies", p.items, p.bytes, p.begin_ns, p.end_ns);
    }
    closed_end_ns[k] = p.end_ns;
    p = {};
  }

  DeviceBusy busy() {
    resolve(/*wait=*/false);
    std::lock_guard lock(timing_mu);
    double s[kKinds];
    for (int k = 0; k < kKinds; ++k)
      s[k] = static_cast<double>(busy_ns[k] + (open[k].items > 0 ? open[k].end_ns - open[k].begin_ns : 0)) / 1e9;
    return {.h2d_s = s[0], .d2h_s = s[1], .compute_s = s[2]};
  }

  void release_timing_events() {
    std::lock_guard lock(timing_mu);
    for (const Timed& c : timed) {
      cudaEventDestroy(c.begin);
      cudaEventDestroy(c.end);
    }
    timed.clear();
    for (cudaEvent_t ev : spare_events) cudaEventDestroy(ev);
    spare_events.clear();
    if (base != nullptr) cudaEventDestroy(base);
    if (base_stream != nullptr) cudaStreamDestroy(base_stream);
    base = nullptr;
    base_stream = nullptr;
  }

  const int device;
  std::string name;
  detail::Accounting acct;
  std::mutex mu;                         // guards the cache and the handle sets
  std::multimap<uint64_t, void*> cache;  // rounded size → freed block
  uint64_t cached_bytes = 0;
  std::set<cudaStream_t> streams;
  std::set<cudaEvent_t> events;

  std::mutex timing_mu;     // guards what follows (Note [Device time from events])
  std::deque<Timed> timed;  // queued, not yet resolved, in queue order
  std::vector<cudaEvent_t> spare_events;
  cudaStream_t base_stream = nullptr;
  cudaEvent_t base = nullptr;
  int64_t base_ns = 0;
  Period open[kKinds];
  int64_t closed_end_ns[kKinds] = {0, 0, 0};
  int64_t busy_ns[kKinds] = {0, 0, 0};
  // Last: registered once the rest exists, and removed (by the destructor) before it goes.
  std::unique_ptr<trace::FlushHook> flush_hook;
};

Result<std::unique_ptr<Device>> CudaDevice::create(int device_index, uint64_t budget_bytes) {
  if (budget_bytes == 0) return invalid_argument("CudaDevice: the device memory budget must be > 0 bytes");
  auto state = std::make_unique<State>(device_index, budget_bytes);
  const std::string where = "CudaDevice cuda:" + std::to_string(device_index);
  if (Status st = state->use(); !st.is_ok()) return unavailable(where + ": " + st.message());
  cudaDeviceProp prop{};
  if (cudaError_t err = cudaGetDeviceProperties(&prop, device_index); err != cudaSuccess) {
    return unavailable(where + ": cudaGetDeviceProperties: " + cudaGetErrorString(err));
  }
  // Creates the context now, so a broken driver fails here rather than at the first allocation.
  if (cudaError_t err = cudaFree(nullptr); err != cudaSuccess) {
    return unavailable(where + ": creating the CUDA context: " + cudaGetErrorString(err));
  }
  size_t free_b = 0, total_b = 0;
  if (cudaMemGetInfo(&free_b, &total_b) == cudaSuccess && budget_bytes > free_b) {
    ZO_LOG(kWarn) << where << ": budget " << format_bytes(budget_bytes) << " exceeds the " << format_bytes(free_b)
                  << " free on the device; allocations may fail before the budget is reached";
  }
  state->name = "cuda:" + std::to_string(device_index) + " " + prop.name;
  State* raw = state.get();
  state->flush_hook = std::make_unique<trace::FlushHook>([raw] {
    if (raw->use().is_ok()) raw->resolve(/*wait=*/true);
  });
  return std::unique_ptr<Device>(new CudaDevice(std::move(state)));
}

CudaDevice::CudaDevice(std::unique_ptr<State> state) : s_(std::move(state)) {}

CudaDevice::~CudaDevice() {
  // Errors here cannot be returned; a device that fails to synchronise is left as it is (the
  // process is about to lose it anyway) rather than aborting in a destructor.
  s_->flush_hook.reset();
  if (!s_->use().is_ok()) return;
  if (cudaError_t err = cudaDeviceSynchronize(); err != cudaSuccess) {
    ZO_LOG(kError) << s_->name << ": cudaDeviceSynchronize at destruction: " << cudaGetErrorString(err);
  }
  s_->resolve(/*wait=*/true);
  s_->release_timing_events();
  for (cudaStream_t st : s_->streams) cudaStreamDestroy(st);
  for (cudaEvent_t ev : s_->events) cudaEventDestroy(ev);
  s_->release_cache_locked();
  for (const auto& [addr, size] : s_->acct.live_allocations()) cudaFree(reinterpret_cast<void*>(addr));
  for (const auto& [addr, size] : s_->acct.live_pinned()) {
    unregister_range(reinterpret_cast<void*>(addr), /*check=*/false);
    free_host(reinterpret_cast<void*>(addr), size);
  }
  for (const auto& range : s_->acct.live_registered())
    unregister_range(reinterpret_cast<void*>(range.first), /*check=*/false);
}

std::string CudaDevice::name() const { return s_->name; }

Result<DevicePtr> CudaDevice::allocate(uint64_t size_bytes) {
  ZO_RETURN_IF_ERROR(s_->use());
  ZO_RETURN_IF_ERROR(s_->acct.reserve(size_bytes));
  const uint64_t rounded = detail::Accounting::round_up(size_bytes);
  void* p = nullptr;
  {
    std::lock_guard lock(s_->mu);
    if (auto it = s_->cache.find(rounded); it != s_->cache.end()) {
      p = it->second;
      s_->cache.erase(it);
      s_->cached_bytes -= rounded;
    } else {
      if (s_->acct.allocated_bytes() + s_->cached_bytes > s_->acct.budget_bytes()) s_->release_cache_locked();
      cudaError_t err = cudaMalloc(&p, rounded);
      if (err == cudaErrorMemoryAllocation && !s_->cache.empty()) {
        cudaGetLastError();
        s_->release_cache_locked();
        err = cudaMalloc(&p, rounded);
      }
      if (err != cudaSuccess) {
        cudaGetLastError();
        s_->acct.release(size_bytes);
        return cuda_error(err, "cudaMalloc of " + format_bytes(size_bytes) + " (" + std::to_string(size_bytes) +
                                   " bytes) on " + s_->name + " with " + std::to_string(s_->acct.allocated_bytes()) +
                                   " bytes in use, budget " + std::to_string(s_->acct.budget_bytes()));
      }
    }
  }
  s_->acct.commit(p, size_bytes);
  return DevicePtr{p};
}

void CudaDevice::free(DevicePtr ptr) {
  const uint64_t rounded = s_->acct.forget(ptr.addr);
  std::lock_guard lock(s_->mu);
  s_->cache.emplace(rounded, ptr.addr);
  s_->cached_bytes += rounded;
}

Result<void*> CudaDevice::allocate_pinned(uint64_t size_bytes) {
  if (size_bytes == 0) return invalid_argument("allocate_pinned: 0 bytes");
  ZO_RETURN_IF_ERROR(s_->use());
  // Huge pages registered with the driver rather than cudaHostAlloc's 4 KiB pages: the pool is also
  // where NVMe reads land, and a 1 MiB O_DIRECT read into 4 KiB pages reaches the drive split in
  // pieces (Note [Huge pages for I/O buffers] in common/host_memory.cpp).
  void* p = allocate_host(size_bytes, 4096);
  if (p == nullptr) {
    return out_of_memory("pinned allocation of " + format_bytes(size_bytes) + " (" + std::to_string(size_bytes) +
                         " bytes): the kernel refused the mapping");
  }
  if (Status st = register_range(p, size_bytes); !st.is_ok()) {
    free_host(p, size_bytes);
    return st;
  }
  s_->acct.add_pinned(p, size_bytes);
  return p;
}

void CudaDevice::free_pinned(void* ptr) {
  const uint64_t size_bytes = s_->acct.forget_pinned(ptr);
  s_->use_or_die();
  unregister_range(ptr);
  free_host(ptr, size_bytes);
}

Status CudaDevice::register_host(void* ptr, uint64_t size_bytes) {
  if (ptr == nullptr || size_bytes == 0) return invalid_argument("register_host: null pointer or 0 bytes");
  ZO_RETURN_IF_ERROR(s_->use());
  ZO_RETURN_IF_ERROR(s_->acct.check_unregistered(ptr, size_bytes));
  ZO_RETURN_IF_ERROR(register_range(ptr, size_bytes));  // Note [One registration per range]
  s_->acct.add_registered(ptr, size_bytes);
  return Status::ok();
}

void CudaDevice::unregister_host(void* ptr) {
  s_->acct.forget_registered(ptr);
  s_->use_or_die();
  unregister_range(ptr);
}

Result<Stream> CudaDevice::create_stream() {
  ZO_RETURN_IF_ERROR(s_->use());
  cudaStream_t st = nullptr;
  ZO_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), "cudaStreamCreate");
  std::lock_guard lock(s_->mu);
  s_->streams.insert(st);
  return Stream{st};
}

void CudaDevice::destroy_stream(Stream stream) {
  cudaStream_t st = s_->stream(stream);
  {
    std::lock_guard lock(s_->mu);
    s_->streams.erase(st);
  }
  s_->use_or_die();
  ZO_CUDA_CHECK(cudaStreamSynchronize(st));
  ZO_CUDA_CHECK(cudaStreamDestroy(st));
}

Status CudaDevice::synchronize(Stream stream) {
  cudaStream_t st = s_->stream(stream);
  ZO_RETURN_IF_ERROR(s_->use());
  ZO_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(st), "cudaStreamSynchronize on " + s_->name);
  return Status::ok();
}

Status CudaDevice::synchronize() {
  ZO_RETURN_IF_ERROR(s_->use());
  ZO_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize(), "cudaDeviceSynchronize on " + s_->name);
  s_->resolve(/*wait=*/true);
  return Status::ok();
}

Result<Event> CudaDevice::create_event() {
  ZO_RETURN_IF_ERROR(s_->use());
  cudaEvent_t ev = nullptr;
  ZO_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), "cudaEventCreate");
  std::lock_guard lock(s_->mu);
  s_->events.insert(ev);
  return Event{ev};
}

void CudaDevice::destroy_event(Event event) {
  cudaEvent_t ev = s_->event(event);
  {
    std::lock_guard lock(s_->mu);
    s_->events.erase(ev);
  }
  s_->use_or_die();
  ZO_CUDA_CHECK(cudaEventDestroy(ev));  // CUDA defers the release until pending work completes
}

Status CudaDevice::record(Event event, Stream stream) {
  cudaEvent_t ev = s_->event(event);
  cudaStream_t st = s_->stream(stream);
  ZO_RETURN_IF_ERROR(s_->use());
  ZO_CUDA_RETURN_IF_ERROR(cudaEventRecord(ev, st), "cudaEventRecord");
  return Status::ok();
}

Status CudaDevice::record_foreign(Event event, void* native_stream) {
  cudaEvent_t ev = s_->event(event);
  ZO_RETURN_IF_ERROR(s_->use());
  ZO_CUDA_RETURN_IF_ERROR(cudaEventRecord(ev, static_cast<cudaStream_t>(native_stream)),
                          "cudaEventRecord on a foreign stream");
  return Status::ok();
}

Status CudaDevice::wait_foreign(void* native_stream, Event event) {
  cudaEvent_t ev = s_->event(event);
  ZO_RETURN_IF_ERROR(s_->use());
  ZO_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(static_cast<cudaStream_t>(native_stream), ev, 0),
                          "cudaStreamWaitEvent on a foreign stream");
  return Status::ok();
}

Status CudaDevice::foreign_work(DeviceWork kind, uint64_t size_bytes, void* native_stream, const std::string& name,
                                const std::function<Status()>& queue) {
  ZO_RETURN_IF_ERROR(s_->use());
  return s_->timed_work(kind, size_bytes, static_cast<cudaStream_t>(native_stream), name, queue);
}

DeviceBusy CudaDevice::busy() {
  if (!s_->use().is_ok()) return {};
  return s_->busy();
}

Status CudaDevice::wait(Stream stream, Event event) {
  cudaEvent_t ev = s_->event(event);
  cudaStream_t st = s_->stream(stream);
  ZO_RETURN_IF_ERROR(s_->use());
  ZO_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(st, ev, 0), "cudaStreamWaitEvent");
  return Status::ok();
}

Status CudaDevice::synchronize(Event event) {
  cudaEvent_t ev = s_->event(event);
  ZO_RETURN_IF_ERROR(s_->use());
  ZO_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(ev), "cudaEventSynchronize on " + s_->name);
  return Status::ok();
}

Result<bool> CudaDevice::query(Event event) {
  cudaEvent_t ev = s_->event(event);
  ZO_RETURN_IF_ERROR(s_->use());
  const cudaError_t err = cudaEventQuery(ev);
  if (err == cudaSuccess) return true;
  if (err == cudaErrorNotReady) return false;
  return cuda_error(err, "cudaEventQuery on " + s_->name);
}

Status CudaDevice::copy_h2d(DevicePtr dst, const void* src, uint64_t size_bytes, Stream stream) {
  cudaStream_t st = s_->stream(stream);
  if (size_bytes == 0) return Status::ok();
  if (src == nullptr) return invalid_argument("copy_h2d: null host source");
  ZO_RETURN_IF_ERROR(s_->acct.check_range(dst.addr, size_bytes, "copy_h2d destination"));
  ZO_RETURN_IF_ERROR(s_->use());
  ZO_CUDA_RETURN_IF_ERROR(
      s_->timed_work(DeviceWork::kH2D, size_bytes, st, {},
                     [&] { return cudaMemcpyAsync(dst.addr, src, size_bytes, cudaMemcpyHostToDevice, st); }),
      "cudaMemcpyAsync H2D of " + std::to_string(size_bytes) + " bytes");
  s_->acct.count_h2d(size_bytes);
  return Status::ok();
}

Status CudaDevice::copy_d2h(void* dst, DevicePtr src, uint64_t size_bytes, Stream stream) {
  cudaStream_t st = s_->stream(stream);
  if (size_bytes == 0) return Status::ok();
  if (dst == nullptr) return invalid_argument("copy_d2h: null host destination");
  ZO_RETURN_IF_ERROR(s_->acct.check_range(src.addr, size_bytes, "copy_d2h source"));
  ZO_RETURN_IF_ERROR(s_->use());
  ZO_CUDA_RETURN_IF_ERROR(
      s_->timed_work(DeviceWork::kD2H, size_bytes, st, {},
                     [&] { return cudaMemcpyAsync(dst, src.addr, size_bytes, cudaMemcpyDeviceToHost, st); }),
      "cudaMemcpyAsync D2H of " + std::to_string(size_bytes) + " bytes");
  s_->acct.count_d2h(size_bytes);
  return Status::ok();
}

Status CudaDevice::copy_d2d(DevicePtr dst, DevicePtr src, uint64_t size_bytes, Stream stream) {
  cudaStream_t st = s_->stream(stream);
  if (size_bytes == 0) return Status::ok();
  ZO_RETURN_IF_ERROR(s_->acct.check_range(dst.addr, size_bytes, "copy_d2d destination"));
  ZO_RETURN_IF_ERROR(s_->acct.check_range(src.addr, size_bytes, "copy_d2d source"));
  ZO_RETURN_IF_ERROR(s_->use());
  ZO_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst.addr, src.addr, size_bytes, cudaMemcpyDeviceToDevice, st),
                          "cudaMemcpyAsync D2D of " + std::to_string(size_bytes) + " bytes");
  s_->acct.count_d2d(size_bytes);
  return Status::ok();
}

Status CudaDevice::fill_zero(DevicePtr dst, uint64_t size_bytes, Stream stream) {
  cudaStream_t st = s_->stream(stream);
  if (size_bytes == 0) return Status::ok();
  ZO_RETURN_IF_ERROR(s_->acct.check_range(dst.addr, size_bytes, "fill_zero destination"));
  ZO_RETURN_IF_ERROR(s_->use());
  ZO_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(dst.addr, 0, size_bytes, st), "cudaMemsetAsync");
  return Status::ok();
}

Status CudaDevice::cast(DevicePtr dst, DType dst_dtype, DevicePtr src, DType src_dtype, uint64_t n_elems,
                        Stream stream) {
  cudaStream_t st = s_->stream(stream);
  if (n_elems == 0) return Status::ok();
  const uint64_t dst_bytes = n_elems * dtype_size_bytes(dst_dtype);
  const uint64_t src_bytes = n_elems * dtype_size_bytes(src_dtype);
  ZO_RETURN_IF_ERROR(s_->acct.check_range(dst.addr, dst_bytes, "cast destination"));
  ZO_RETURN_IF_ERROR(s_->acct.check_range(src.addr, src_bytes, "cast source"));
  const auto d = reinterpret_cast<uintptr_t>(dst.addr);
  const auto s = reinterpret_cast<uintptr_t>(src.addr);
  if (d < s + src_bytes && s < d + dst_bytes) return invalid_argument("cast: source and destination overlap");
  ZO_RETURN_IF_ERROR(s_->use());
  if (dst_dtype == src_dtype) {
    ZO_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst.addr, src.addr, dst_bytes, cudaMemcpyDeviceToDevice, st),
                            "cudaMemcpyAsync (same-dtype cast)");
    return Status::ok();
  }
  constexpr unsigned kThreads = 256;
  const uint64_t blocks = std::min<uint64_t>((n_elems + kThreads - 1) / kThreads, 65535);
  cast_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, st>>>(dst.addr, static_cast<uint8_t>(dst_dtype), src.addr,
                                                                  static_cast<uint8_t>(src_dtype), n_elems);
  ZO_CUDA_RETURN_IF_ERROR(cudaGetLastError(), "launching the cast kernel");
  return Status::ok();
}

Result<void*> CudaDevice::kernel_stream(Stream stream) {
  cudaStream_t st = s_->stream(stream);
  ZO_RETURN_IF_ERROR(s_->use());
  return static_cast<void*>(st);
}

const detail::Accounting& CudaDevice::accounting() const { return s_->acct; }

Status CudaDevice::delay(Stream stream, uint32_t duration_us) {
  cudaStream_t st = s_->stream(stream);
  ZO_RETURN_IF_ERROR(s_->use());
  delay_kernel<<<1, 1, 0, st>>>(uint64_t{duration_us} * 1000);
  ZO_CUDA_RETURN_IF_ERROR(cudaGetLastError(), "launching the delay kernel");
  return Status::ok();
}

DeviceStats CudaDevice::stats() const { return s_->acct.stats(); }

}  // namespace zo::gpu

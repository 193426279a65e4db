#include "gpu/host_device.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <mutex>
#include <set>
#include <thread>
#include <unordered_map>
#include <vector>

#include "common/bytes.h"
#include "common/check.h"
#include "common/host_memory.h"
#include "common/trace.h"
#include "gpu/detail/accounting.h"
#include "gpu/detail/half.h"

namespace zo::gpu {
namespace {

constexpr uint64_t kPinnedAlignment = 4096;

// One stream: a worker thread running queued operations strictly in order.
class HostStream {
 public:
  HostStream() : worker_([this] { run(); }) {}
  // Runs what is queued, then stops.
  ~HostStream() {
    {
      std::lock_guard lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    worker_.join();
  }

  void push(std::function<void()> op) {
    {
      std::lock_guard lock(mu_);
      queue_.push_back(std::move(op));
      ++queued_;
    }
    cv_.notify_all();
  }

  // Blocks until everything queued before this call has run.
  void drain() {
    std::unique_lock lock(mu_);
    const uint64_t target = queued_;
    cv_.wait(lock, [&] { return done_ >= target; });
  }

 private:
  void run() {
    std::unique_lock lock(mu_);
    for (;;) {
      cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;
      std::function<void()> op = std::move(queue_.front());
      queue_.pop_front();
      lock.unlock();
      op();
      lock.lock();
      ++done_;
      cv_.notify_all();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;  // work queued, stop requested, or an operation finished
  std::deque<std::function<void()>> queue_;
  uint64_t queued_ = 0;
  uint64_t done_ = 0;
  bool stop_ = false;
  std::thread worker_;  // last: starts after the members it uses exist
};

// An event: each record() gets a number; a record is complete once its number leaves `pending`.
// Keeping every pending number (not just a high-water mark) keeps the CUDA semantics when one
// event is recorded on several streams: a wait is for the exact record it saw.
struct HostEvent {
  std::mutex mu;
  std::condition_variable cv;
  uint64_t last_record = 0;  // 0: never recorded
  std::set<uint64_t> pending;

  bool complete_locked(uint64_t record) const { return record == 0 || !pending.contains(record); }
  void wait_for(uint64_t record) {
    std::unique_lock lock(mu);
    cv.wait(lock, [&] { return complete_locked(record); });
  }
};

void* aligned_allocate(uint64_t alignment, uint64_t size_bytes) {
  return std::aligned_alloc(alignment, align_up(size_bytes, alignment));
}

bool overlaps(const void* a, uint64_t a_bytes, const void* b, uint64_t b_bytes) {
  const auto x = reinterpret_cast<uintptr_t>(a);
  const auto y = reinterpret_cast<uintptr_t>(b);
  return x < y + b_bytes && y < x + a_bytes;
}

}  // namespace

struct HostDevice::State {
  explicit State(uint64_t budget_bytes) : acct(budget_bytes) {}

  HostStream* stream(Stream s) {
    std::lock_guard lock(mu);
    auto it = streams.find(static_cast<HostStream*>(s.handle));
    ZO_CHECK(it != streams.end()) << "unknown or destroyed stream " << s.handle;
    return it->second.get();
  }
  std::shared_ptr<HostEvent> event(Event e) {
    std::lock_guard lock(mu);
    auto it = events.find(static_cast<HostEvent*>(e.handle));
    ZO_CHECK(it != events.end()) << "unknown or destroyed event " << e.handle;
    return it->second;
  }

  // Runs one piece of work of `kind` on the calling thread (a stream's worker, or the host for
  // foreign work) and counts it: in the kind's busy time, and while the trace records, in the
  // copies' busy periods or (compute) as a span called `name`.
  template <class Work>
  void timed(DeviceWork kind, uint64_t size_bytes, const std::string& name, Work&& work) {
    const auto k = static_cast<size_t>(kind);
    const int64_t begin_ns = trace::now_ns();
    bool counted = false;
    {
      std::lock_guard lock(busy_mu);
      Busy& b = busy[k];
      if (b.active++ == 0) b.since_ns = begin_ns;
      if (kind != DeviceWork::kCompute) counted = copy_tracks[k].begin(size_bytes);
    }
    work();
    const int64_t end_ns = trace::now_ns();
    if (kind == DeviceWork::kCompute) trace::record(trace::Track::kDeviceCompute, name, begin_ns, end_ns);
    std::lock_guard lock(busy_mu);
    Busy& b = busy[k];
    if (--b.active == 0) b.total_ns += end_ns - b.since_ns;
    if (counted) copy_tracks[k].end();
  }

  detail::Accounting acct;
  std::mutex mu;  // guards the two tables
  std::unordered_map<HostStream*, std::unique_ptr<HostStream>> streams;
  std::unordered_map<HostEvent*, std::shared_ptr<HostEvent>> events;
  // Busy time per DeviceWork kind (the union of its work's intervals: from the first of them
  // running until none is), and the trace's copy tracks.
  struct Busy {
    uint64_t active = 0;
    int64_t since_ns = 0;
    int64_t total_ns = 0;
  };
  std::mutex busy_mu;
  Busy busy[3];
  trace::BusyTrack copy_tracks[2] = {{trace::Track::kCopyH2D, "copies"}, {trace::Track::kCopyD2H, "copies"}};
};

Result<std::unique_ptr<HostDevice>> HostDevice::create(uint64_t budget_bytes) {
  if (budget_bytes == 0) return invalid_argument("HostDevice: the device memory budget must be > 0 bytes");
  return std::unique_ptr<HostDevice>(new HostDevice(std::make_unique<State>(budget_bytes)));
}

HostDevice::HostDevice(std::unique_ptr<State> state) : s_(std::move(state)) {}

HostDevice::~HostDevice() {
  // Streams are destroyed one by one, each running its queue to the end first. A wait on an event
  // only ever depends on a record queued before it, on a stream that is either already drained or
  // still running, so this cannot deadlock.
  while (!s_->streams.empty()) s_->streams.erase(s_->streams.begin());
  for (const auto& [addr, size] : s_->acct.live_allocations()) std::free(reinterpret_cast<void*>(addr));
  for (const auto& [addr, size] : s_->acct.live_pinned()) free_host(reinterpret_cast<void*>(addr), size);
}

Result<DevicePtr> HostDevice::allocate(uint64_t size_bytes) {
  ZO_RETURN_IF_ERROR(s_->acct.reserve(size_bytes));
  void* p = aligned_allocate(kDeviceAlignment, size_bytes);
  if (p == nullptr) {
    s_->acct.release(size_bytes);
    return out_of_memory("HostDevice: host allocation of " + format_bytes(size_bytes) + " for device memory failed");
  }
  std::memset(p, 0xFF, detail::Accounting::round_up(size_bytes));
  s_->acct.commit(p, size_bytes);
  return DevicePtr{p};
}

void HostDevice::free(DevicePtr ptr) {
  s_->acct.forget(ptr.addr);
  std::free(ptr.addr);
}

Result<void*> HostDevice::allocate_pinned(uint64_t size_bytes) {
  if (size_bytes == 0) return invalid_argument("allocate_pinned: 0 bytes");
  // The same huge-page-backed memory CudaDevice pins (Note [Huge pages for I/O buffers]).
  void* p = allocate_host(size_bytes, kPinnedAlignment);
  if (p == nullptr) return out_of_memory("HostDevice: pinned allocation of " + format_bytes(size_bytes) + " failed");
  s_->acct.add_pinned(p, size_bytes);
  return p;
}

void HostDevice::free_pinned(void* ptr) {
  const uint64_t size_bytes = s_->acct.forget_pinned(ptr);
  free_host(ptr, size_bytes);
}

Status HostDevice::register_host(void* ptr, uint64_t size_bytes) {
  if (ptr == nullptr || size_bytes == 0) return invalid_argument("register_host: null pointer or 0 bytes");
  ZO_RETURN_IF_ERROR(s_->acct.check_unregistered(ptr, size_bytes));
  // Host memory is already where the emulated device reads it: registering only records the range.
  s_->acct.add_registered(ptr, size_bytes);
  return Status::ok();
}

void HostDevice::unregister_host(void* ptr) { s_->acct.forget_registered(ptr); }

Result<Stream> HostDevice::create_stream() {
  auto stream = std::make_unique<HostStream>();
  HostStream* handle = stream.get();
  std::lock_guard lock(s_->mu);
  s_->streams.emplace(handle, std::move(stream));
  return Stream{handle};
}

void HostDevice::destroy_stream(Stream stream) {
  std::unique_ptr<HostStream> owned;
  {
    std::lock_guard lock(s_->mu);
    auto it = s_->streams.find(static_cast<HostStream*>(stream.handle));
    ZO_CHECK(it != s_->streams.end()) << "destroy_stream of unknown stream " << stream.handle;
    owned = std::move(it->second);
    s_->streams.erase(it);
  }
  owned.reset();  // drains the queue, then joins the worker
}

Status HostDevice::synchronize(Stream stream) {
  s_->stream(stream)->drain();
  return Status::ok();
}

Status HostDevice::synchronize() {
  std::vector<HostStream*> streams;
  {
    std::lock_guard lock(s_->mu);
    for (auto& [p, s] : s_->streams) streams.push_back(p);
  }
  for (HostStream* s : streams) s->drain();
  return Status::ok();
}

Result<Event> HostDevice::create_event() {
  auto event = std::make_shared<HostEvent>();
  HostEvent* handle = event.get();
  std::lock_guard lock(s_->mu);
  s_->events.emplace(handle, std::move(event));
  return Event{handle};
}

void HostDevice::destroy_event(Event event) {
  std::lock_guard lock(s_->mu);
  const size_t erased = s_->events.erase(static_cast<HostEvent*>(event.handle));
  ZO_CHECK(erased == 1) << "destroy_event of unknown event " << event.handle;
}

Status HostDevice::record(Event event, Stream stream) {
  std::shared_ptr<HostEvent> ev = s_->event(event);
  HostStream* st = s_->stream(stream);
  uint64_t n;
  {
    std::lock_guard lock(ev->mu);
    n = ++ev->last_record;
    ev->pending.insert(n);
  }
  st->push([ev, n] {
    {
      std::lock_guard lock(ev->mu);
      ev->pending.erase(n);
    }
    ev->cv.notify_all();
  });
  return Status::ok();
}

Status HostDevice::record_foreign(Event event, void* native_stream) {
  if (native_stream != nullptr)
    return invalid_argument(
        "record_foreign: the emulated device has no foreign streams (the host computes synchronously)");
  std::shared_ptr<HostEvent> ev = s_->event(event);
  {
    std::lock_guard lock(ev->mu);
    ++ev->last_record;  // a record that is not pending: complete
  }
  ev->cv.notify_all();
  return Status::ok();
}

Status HostDevice::wait_foreign(void* native_stream, Event event) {
  if (native_stream != nullptr)
    return invalid_argument(
        "wait_foreign: the emulated device has no foreign streams (the host computes synchronously)");
  return synchronize(event);
}

Status HostDevice::foreign_work(DeviceWork kind, uint64_t size_bytes, void* native_stream, const std::string& name,
                                const std::function<Status()>& queue) {
  if (native_stream != nullptr)
    return invalid_argument(
        "foreign_work: the emulated device has no foreign streams (the host runs the work synchronously)");
  Status st;
  s_->timed(kind, size_bytes, name, [&] { st = queue(); });
  return st;
}

DeviceBusy HostDevice::busy() {
  const int64_t now = trace::now_ns();
  std::lock_guard lock(s_->busy_mu);
  double s[3];
  for (size_t k = 0; k < 3; ++k) {
    const State::Busy& b = s_->busy[k];
    s[k] = static_cast<double>(b.total_ns + (b.active > 0 ? now - b.since_ns : 0)) / 1e9;
  }
  return {.h2d_s = s[0], .d2h_s = s[1], .compute_s = s[2]};
}

Status HostDevice::wait(Stream stream, Event event) {
  std::shared_ptr<HostEvent> ev = s_->event(event);
  HostStream* st = s_->stream(stream);
  uint64_t n;
  {
    std::lock_guard lock(ev->mu);
    n = ev->last_record;
  }
  if (n == 0) return Status::ok();
  st->push([ev, n] { ev->wait_for(n); });
  return Status::ok();
}

Status HostDevice::synchronize(Event event) {
  std::shared_ptr<HostEvent> ev = s_->event(event);
  uint64_t n;
  {
    std::lock_guard lock(ev->mu);
    n = ev->last_record;
  }
  ev->wait_for(n);
  return Status::ok();
}

Result<bool> HostDevice::query(Event event) {
  std::shared_ptr<HostEvent> ev = s_->event(event);
  std::lock_guard lock(ev->mu);
  return ev->complete_locked(ev->last_record);
}

Status HostDevice::copy_h2d(DevicePtr dst, const void* src, uint64_t size_bytes, Stream stream) {
  HostStream* st = s_->stream(stream);
  if (size_bytes == 0) return Status::ok();
  if (src == nullptr) return invalid_argument("copy_h2d: null host source");
  ZO_RETURN_IF_ERROR(s_->acct.check_range(dst.addr, size_bytes, "copy_h2d destination"));
  s_->acct.count_h2d(size_bytes);
  st->push([s = s_.get(), dst, src, size_bytes] {
    s->timed(DeviceWork::kH2D, size_bytes, {}, [&] { std::memcpy(dst.addr, src, size_bytes); });
  });
  return Status::ok();
}

Status HostDevice::copy_d2h(void* dst, DevicePtr src, uint64_t size_bytes, Stream stream) {
  HostStream* st = s_->stream(stream);
  if (size_bytes == 0) return Status::ok();
  if (dst == nullptr) return invalid_argument("copy_d2h: null host destination");
  ZO_RETURN_IF_ERROR(s_->acct.check_range(src.addr, size_bytes, "copy_d2h source"));
  s_->acct.count_d2h(size_bytes);
  st->push([s = s_.get(), dst, src, size_bytes] {
    s->timed(DeviceWork::kD2H, size_bytes, {}, [&] { std::memcpy(dst, src.addr, size_bytes); });
  });
  return Status::ok();
}

Status HostDevice::copy_d2d(DevicePtr dst, DevicePtr src, uint64_t size_bytes, Stream stream) {
  HostStream* st = s_->stream(stream);
  if (size_bytes == 0) return Status::ok();
  ZO_RETURN_IF_ERROR(s_->acct.check_range(dst.addr, size_bytes, "copy_d2d destination"));
  ZO_RETURN_IF_ERROR(s_->acct.check_range(src.addr, size_bytes, "copy_d2d source"));
  s_->acct.count_d2d(size_bytes);
  st->push([dst, src, size_bytes] { std::memmove(dst.addr, src.addr, size_bytes); });
  return Status::ok();
}

Status HostDevice::fill_zero(DevicePtr dst, uint64_t size_bytes, Stream stream) {
  HostStream* st = s_->stream(stream);
  if (size_bytes == 0) return Status::ok();
  ZO_RETURN_IF_ERROR(s_->acct.check_range(dst.addr, size_bytes, "fill_zero destination"));
  st->push([dst, size_bytes] { std::memset(dst.addr, 0, size_bytes); });
  return Status::ok();
}

Status HostDevice::cast(DevicePtr dst, DType dst_dtype, DevicePtr src, DType src_dtype, uint64_t n_elems,
                        Stream stream) {
  HostStream* st = s_->stream(stream);
  if (n_elems == 0) return Status::ok();
  const uint64_t dst_bytes = n_elems * dtype_size_bytes(dst_dtype);
  const uint64_t src_bytes = n_elems * dtype_size_bytes(src_dtype);
  ZO_RETURN_IF_ERROR(s_->acct.check_range(dst.addr, dst_bytes, "cast destination"));
  ZO_RETURN_IF_ERROR(s_->acct.check_range(src.addr, src_bytes, "cast source"));
  if (overlaps(dst.addr, dst_bytes, src.addr, src_bytes))
    return invalid_argument("cast: source and destination overlap");
  if (dst_dtype == src_dtype) {
    st->push([dst, src, dst_bytes] { std::memcpy(dst.addr, src.addr, dst_bytes); });
    return Status::ok();
  }
  const auto dt = static_cast<uint8_t>(dst_dtype);
  const auto sr = static_cast<uint8_t>(src_dtype);
  st->push([dst, dt, src, sr, n_elems] {
    for (uint64_t i = 0; i < n_elems; ++i) {
      detail::store_from_float(dst.addr, dt, i, detail::load_as_float(src.addr, sr, i));
    }
  });
  return Status::ok();
}

void HostDevice::enqueue(Stream stream, std::function<void()> work) { s_->stream(stream)->push(std::move(work)); }

const detail::Accounting& HostDevice::accounting() const { return s_->acct; }

Status HostDevice::delay(Stream stream, uint32_t duration_us) {
  s_->stream(stream)->push([duration_us] { std::this_thread::sleep_for(std::chrono::microseconds(duration_us)); });
  return Status::ok();
}

DeviceStats HostDevice::stats() const { return s_->acct.stats(); }

}  // namespace zo::gpu

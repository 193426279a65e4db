#include "engine/coord/grad_worker.h"

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

#include "common/bytes.h"
#include "common/check.h"
#include "common/trace.h"

// Note [Gradient landing ring]
//
// Slots are carved from the ring in submission order at `head`, each rounded up to 64 bytes; the
// oldest queued slot starts at the front item's offset. Unwrapped (the newest slot at or after the
// oldest), a slot goes at head if it fits before the ring's end, else at offset 0 if it fits before
// the front item (the ring's tail end stays unused until it drains). Wrapped, it goes at head only
// if it fits before the front item. With nothing queued the
// whole ring is free and head restarts at 0, so any item up to the ring's size eventually fits.
// The worker reads a slot while its item stays at the front of the queue and pops it only after
// the add, so the producer never reuses bytes still being read.

namespace zo::engine {

namespace {
constexpr uint64_t kSlotAlignment = 64;
}  // namespace

struct GradWorker::Impl {
  struct Item {
    uint32_t param = 0;
    DType dtype = DType::kF32;
    uint64_t offset = 0;
    uint64_t size = 0;  // the gradient's bytes
    uint64_t slot = 0;  // its slot's, rounded up to kSlotAlignment; 0 for an item landed in place
    gpu::Event ready;   // an asynchronous fill's: the slot holds the gradient once it completes
    bool in_place = false;  // Note [Gradients that land where they are summed]: not in the ring
  };

  GradAccumulator* acc = nullptr;
  gpu::Device* device = nullptr;
  std::function<void()> before_add;
  std::span<std::byte> ring;  // the caller's memory
  uint64_t capacity = 0;

  mutable std::mutex mu;
  std::condition_variable work_cv;  // the worker: an item was queued, or stop
  std::condition_variable done_cv;  // the producer: an item left the queue
  std::deque<Item> queue;           // guarded by mu; the front item is the one being added
  uint64_t head = 0;                // where the next slot starts (producer only, under mu)
  uint64_t in_flight = 0;           // bytes of the queued items
  bool stop = false;
  Status error;  // the first failed add since the last drain()
  Stats stats;
  std::thread thread;

  // The offset of a free slot of `size` bytes, or -1 when the ring has no room yet. Items landed in
  // place hold no slot.
  int64_t find_slot(uint64_t size) const {
    const Item* oldest = nullptr;
    const Item* newest = nullptr;
    for (const Item& item : queue) {
      if (item.in_place) continue;
      if (oldest == nullptr) oldest = &item;
      newest = &item;
    }
    if (oldest == nullptr) return 0;
    const uint64_t tail = oldest->offset;
    // Wrapped: the newest slot lies before the oldest, so only [head, tail) is free. (head == tail
    // alone cannot tell a full ring from an empty one; the queue's ends can.)
    if (newest->offset < tail) return head + size <= tail ? static_cast<int64_t>(head) : -1;
    if (head + size <= capacity) return static_cast<int64_t>(head);
    return size <= tail ? 0 : -1;
  }

  void run() {
    std::unique_lock<std::mutex> lock(mu);
    for (;;) {
      work_cv.wait(lock, [&] { return stop || !queue.empty(); });
      if (stop) {
        queue.clear();
        in_flight = 0;
        done_cv.notify_all();
        return;
      }
      const Item item = queue.front();
      const bool add = error.is_ok();
      lock.unlock();
      // Re-recording moves the event forward on the same stream, so its latest record completing
      // means this item's copy has too. A dropped item waits as well: its slot must not be handed
      // out again while a copy may still be landing in it.
      Status st =
          item.ready ? device->synchronize(item.ready).with_context("waiting for the gradient's copy") : Status::ok();
      if (add && st.is_ok()) {
        trace::Span span(trace::Track::kGradWorker, [&] { return "accumulate param " + std::to_string(item.param); });
        if (before_add) before_add();
        st = item.in_place
                 ? acc->add_in_place(item.param)
                 : acc->add(item.param, std::span<const std::byte>(ring.data() + item.offset, item.size), item.dtype);
      }
      lock.lock();
      if (!st.is_ok()) {
        if (error.is_ok()) error = std::move(st);
        // A producer waiting for a buffer that the items now dropped held returns this error.
        acc->cancel_reservations();
      }
      queue.pop_front();
      in_flight -= item.slot;
      done_cv.notify_all();
    }
  }
};

GradWorker::GradWorker(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

GradWorker::~GradWorker() {
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->stop = true;
  }
  impl_->work_cv.notify_all();
  if (impl_->thread.joinable()) impl_->thread.join();
}

Result<std::unique_ptr<GradWorker>> GradWorker::create(GradAccumulator& acc, std::span<std::byte> ring,
                                                       std::function<void()> before_add, gpu::Device* device) {
  if (ring.size() < kSlotAlignment)
    return invalid_argument("gradient worker: a landing ring of " + std::to_string(ring.size()) + " bytes");
  ZO_CHECK(reinterpret_cast<uintptr_t>(ring.data()) % kSlotAlignment == 0) << "landing ring not 64-byte aligned";
  auto impl = std::make_unique<Impl>();
  impl->acc = &acc;
  impl->device = device;
  impl->before_add = std::move(before_add);
  impl->capacity = ring.size() / kSlotAlignment * kSlotAlignment;
  impl->ring = ring.first(impl->capacity);
  Impl* raw = impl.get();
  impl->thread = std::thread([raw] { raw->run(); });
  return std::unique_ptr<GradWorker>(new GradWorker(std::move(impl)));
}

Status GradWorker::submit(uint32_t param, DType dtype, uint64_t size_bytes, const Fill& fill, gpu::Event ready) {
  Impl& s = *impl_;
  ZO_CHECK(!ready || s.device != nullptr) << "an asynchronous fill for a gradient worker without a device";
  {
    std::lock_guard<std::mutex> lock(s.mu);
    if (!s.error.is_ok()) return s.error;
  }
  // Note [Gradients that land where they are summed]: the sums' buffers are claimed here, in
  // submission order, whether the contribution lands in them or in the ring.
  Result<LandingRuns> runs = s.acc->reserve(param, dtype, size_bytes);
  if (!runs.is_ok()) {
    std::lock_guard<std::mutex> lock(s.mu);
    return s.error.is_ok() ? runs.status() : s.error;  // cancelled: the worker's error is the cause
  }
  if (!runs->empty()) {
    uint64_t from = 0;
    for (std::span<std::byte> run : *runs) {
      ZO_RETURN_IF_ERROR(fill(run, from));
      from += run.size();
    }
    std::unique_lock<std::mutex> lock(s.mu);
    ++s.stats.items;
    ++s.stats.in_place_items;
    s.queue.push_back({param, dtype, 0, size_bytes, 0, ready, /*in_place=*/true});
    lock.unlock();
    s.work_cv.notify_one();
    return Status::ok();
  }
  if (size_bytes > s.capacity) {
    return invalid_argument("gradient worker: a gradient of " + format_bytes(size_bytes) + " for param " +
                            std::to_string(param) + " does not fit the landing ring of " + format_bytes(s.capacity));
  }
  std::unique_lock<std::mutex> lock(s.mu);
  const uint64_t slot_size = align_up(std::max<uint64_t>(size_bytes, 1), kSlotAlignment);
  int64_t offset = s.error.is_ok() ? s.find_slot(slot_size) : 0;
  if (offset < 0) {
    ++s.stats.full_waits;
    s.done_cv.wait(lock, [&] { return !s.error.is_ok() || (offset = s.find_slot(slot_size)) >= 0; });
  }
  if (!s.error.is_ok()) return s.error;
  lock.unlock();
  // The slot lies outside every queued item's bytes, so it is filled without the lock.
  const std::span<std::byte> slot(s.ring.data() + offset, size_bytes);
  ZO_RETURN_IF_ERROR(fill(slot, 0));
  lock.lock();
  s.head = static_cast<uint64_t>(offset) + slot_size;
  s.in_flight += slot_size;
  s.stats.peak_in_flight_bytes = std::max(s.stats.peak_in_flight_bytes, s.in_flight);
  ++s.stats.items;
  s.queue.push_back({param, dtype, static_cast<uint64_t>(offset), size_bytes, slot_size, ready});
  lock.unlock();
  s.work_cv.notify_one();
  return Status::ok();
}

Status GradWorker::drain() {
  Impl& s = *impl_;
  std::unique_lock<std::mutex> lock(s.mu);
  s.done_cv.wait(lock, [&] { return s.queue.empty(); });
  Status err = std::move(s.error);
  s.error = Status::ok();
  lock.unlock();
  // The worker is idle until the next submit, which only this thread makes: the accumulator's
  // queued writes are finished here (Note [Asynchronous accumulator writes]), their failure
  // reported like an add's.
  Status written = s.acc->finish_writes();
  return err.is_ok() ? written : err;
}

uint64_t GradWorker::ring_bytes() const { return impl_->capacity; }

GradWorker::Stats GradWorker::stats() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->stats;
}

}  // namespace zo::engine

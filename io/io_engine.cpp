#include "io/io_engine.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cerrno>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <system_error>
#include <thread>
#include <unordered_map>
#include <vector>

#include "common/bytes.h"
#include "common/log.h"
#include "common/trace.h"
#include "io/detail/queue.h"

namespace zo::io {
namespace {

// A transient error that keeps coming back is treated as a real one rather than spinning forever.
constexpr uint32_t kMaxTransientRetries = 10000;

struct TicketState {
  uint64_t remaining_bytes = 0;  // bytes of pieces not yet finished (done or failed)
  Status status;                 // first error
  bool done = false;
  bool writes = false;  // the batch writes (for the trace's NVMe read and write tracks)
  bool traced = false;  // counted in a BusyTrack
};

// The not-yet-split rest of a request, waiting in the shared queue.
struct Segment {
  TicketState* ticket;
  IoOp op;
  const File* file;
  uint64_t offset_bytes;
  std::byte* buffer;
  uint64_t size_bytes;
};

// A piece owned by one worker from the moment it leaves the shared queue until it is finished.
struct Piece {
  TicketState* ticket = nullptr;
  IoOp op = IoOp::kRead;
  const File* file = nullptr;
  uint64_t offset_bytes = 0;
  std::byte* buffer = nullptr;
  uint64_t size_bytes = 0;
  uint64_t done_bytes = 0;
  uint32_t transient_retries = 0;
};

std::string describe(const Piece& p, uint64_t at_offset, uint64_t length) {
  return std::string(op_name(p.op)) + " " + p.file->path() + " offset " + std::to_string(at_offset) + " length " +
         std::to_string(length);
}

}  // namespace

class IoEngine::Impl {
 public:
  Impl(IoOptions options, std::string fallback_reason)
      : options_(options), fallback_reason_(std::move(fallback_reason)) {}

  ~Impl() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    work_cv_.notify_all();
    for (auto& t : threads_) t.join();
  }

  // Starts one worker per queue. If a thread cannot be created (RLIMIT_NPROC, a container's
  // pids.max), the workers already started are stopped and joined, the remaining queues freed, and
  // the error returned: creation fails cleanly instead of terminating the process.
  Status start(std::vector<std::unique_ptr<detail::Queue>> queues) {
    for (size_t i = 0; i < queues.size(); ++i) {
      detail::Queue* qp = queues[i].get();
      try {
        threads_.emplace_back([this, qp] {
          std::unique_ptr<detail::Queue> owned(qp);
          worker(*owned);
        });
      } catch (const std::system_error& e) {
        // queues[i] still owns its queue (released only after its thread started).
        {
          std::lock_guard<std::mutex> lock(mu_);
          stop_ = true;
        }
        work_cv_.notify_all();
        for (auto& t : threads_) t.join();
        threads_.clear();
        return errno_status(
            "starting I/O worker thread " + std::to_string(i + 1) + " of " + std::to_string(queues.size()),
            e.code().value());
      }
      (void)queues[i].release();  // now owned by its worker
    }
    return Status::ok();
  }

  Result<Ticket> submit(std::span<const IoRequest> batch) {
    uint64_t total = 0;
    for (const IoRequest& r : batch) {
      ZO_RETURN_IF_ERROR(validate(r));
      if (total + r.size_bytes < total)
        return invalid_argument("I/O batch of " + std::to_string(batch.size()) +
                                " requests totals more than 2^64 bytes");
      total += r.size_bytes;
    }
    std::lock_guard<std::mutex> lock(mu_);
    const Ticket id = next_ticket_++;
    auto state = std::make_unique<TicketState>();
    state->remaining_bytes = total;
    state->done = total == 0;
    state->writes = std::any_of(batch.begin(), batch.end(), [](const IoRequest& r) { return r.op == IoOp::kWrite; });
    if (total > 0) state->traced = (state->writes ? busy_writes_ : busy_reads_).begin(total);
    for (const IoRequest& r : batch) {
      if (r.size_bytes == 0) continue;
      pending_.push_back(Segment{state.get(), r.op, r.file, r.offset_bytes, r.buffer, r.size_bytes});
    }
    tickets_.emplace(id, std::move(state));
    if (total > 0 && active_tickets_++ == 0) busy_since_ = std::chrono::steady_clock::now();
    if (total > 0) {
      if (batch.size() == 1 && total <= options_.block_size_bytes) work_cv_.notify_one();
      else work_cv_.notify_all();
    }
    return id;
  }

  Status wait(Ticket ticket) {
    std::unique_lock<std::mutex> lock(mu_);
    auto it = tickets_.find(ticket);
    if (it == tickets_.end())
      return invalid_argument("unknown or already consumed I/O ticket " + std::to_string(ticket));
    // Note [Concurrent consumers]: another thread may consume (erase) the ticket while this one
    // sleeps, so no TicketState* is held across the wait; the ticket is looked up again on each wake.
    done_cv_.wait(lock, [&] {
      it = tickets_.find(ticket);
      return it == tickets_.end() || it->second->done;
    });
    if (it == tickets_.end())
      return invalid_argument("I/O ticket " + std::to_string(ticket) + " was consumed by another thread while waiting");
    Status s = std::move(it->second->status);
    tickets_.erase(it);
    return s;
  }

  std::optional<Status> poll(Ticket ticket) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = tickets_.find(ticket);
    if (it == tickets_.end())
      return invalid_argument("unknown or already consumed I/O ticket " + std::to_string(ticket));
    if (!it->second->done) return std::nullopt;
    Status s = std::move(it->second->status);
    tickets_.erase(it);
    return s;
  }

  Status wait_all() {
    std::unique_lock<std::mutex> lock(mu_);
    std::vector<Ticket> ids;
    ids.reserve(tickets_.size());
    for (auto& [id, state] : tickets_) ids.push_back(id);
    std::sort(ids.begin(), ids.end());
    Status first;
    for (Ticket id : ids) {
      // See Note [Concurrent consumers]: a ticket consumed by another thread is skipped.
      auto it = tickets_.find(id);
      done_cv_.wait(lock, [&] {
        it = tickets_.find(id);
        return it == tickets_.end() || it->second->done;
      });
      if (it == tickets_.end()) continue;
      if (first.is_ok() && !it->second->status.is_ok()) first = std::move(it->second->status);
      tickets_.erase(it);
    }
    return first;
  }

  Status register_buffers(std::span<const std::span<std::byte>> buffers) {
    std::unique_lock<std::mutex> lock(mu_);
    if (!fixed_buffers_.empty() || registration_pending_ > 0)
      return failed_precondition("register_buffers may be called only once per engine");
    for (auto b : buffers) fixed_buffers_.push_back(b);
    // Each worker registers with its own ring when it is idle (a ring must not be registered from
    // another thread while its owner waits in io_uring_enter).
    registration_pending_ = static_cast<uint32_t>(threads_.size());
    registration_status_ = Status::ok();
    ++registration_gen_;
    work_cv_.notify_all();
    done_cv_.wait(lock, [this] { return registration_pending_ == 0; });
    if (!registration_status_.is_ok()) {
      fixed_buffers_.clear();
      ZO_LOG(kWarn) << "registering " << buffers.size()
                    << " fixed buffers failed; continuing without them: " << registration_status_.to_string();
    }
    return registration_status_;
  }

  IoStats stats() const {
    IoStats s;
    s.bytes_read = bytes_read_.load(std::memory_order_relaxed);
    s.bytes_written = bytes_written_.load(std::memory_order_relaxed);
    s.pieces = pieces_.load(std::memory_order_relaxed);
    s.short_resubmits = short_resubmits_.load(std::memory_order_relaxed);
    s.transient_retries = transient_retries_.load(std::memory_order_relaxed);
    s.errors = errors_.load(std::memory_order_relaxed);
    std::lock_guard<std::mutex> lock(mu_);
    auto busy = busy_;
    if (active_tickets_ > 0) busy += std::chrono::steady_clock::now() - busy_since_;
    s.busy_s = std::chrono::duration<double>(busy).count();
    return s;
  }

  IoOptions options_;
  std::string fallback_reason_;

 private:
  Status validate(const IoRequest& r) const {
    if (r.file == nullptr || !r.file->is_open()) return invalid_argument(std::string(op_name(r.op)) + ": no open file");
    auto where = [&r] {
      return std::string(op_name(r.op)) + " " + r.file->path() + " offset " + std::to_string(r.offset_bytes) +
             " length " + std::to_string(r.size_bytes);
    };
    if (r.size_bytes == 0) return Status::ok();
    if (r.buffer == nullptr) return invalid_argument(where() + ": null buffer");
    if (r.offset_bytes + r.size_bytes < r.offset_bytes)
      return invalid_argument(where() + ": offset + length overflows");
    if (r.file->direct()) {
      const uint64_t mem = r.file->mem_align(), off = r.file->offset_align();
      const auto addr = reinterpret_cast<uintptr_t>(r.buffer);
      if (addr % mem != 0 || r.offset_bytes % off != 0 || r.size_bytes % off != 0)
        return invalid_argument(where() + ": O_DIRECT needs the buffer address aligned to " + std::to_string(mem) +
                                " bytes and the offset and length to " + std::to_string(off) +
                                " (open the file buffered for unaligned access)");
    }
    return Status::ok();
  }

  int fixed_index(const std::byte* p, uint64_t n, const detail::Queue& q) const {
    if (!q.uses_fixed_buffers()) return -1;
    for (size_t i = 0; i < fixed_buffers_.size(); ++i) {
      const auto& b = fixed_buffers_[i];
      if (p >= b.data() && p + n <= b.data() + b.size()) return static_cast<int>(i);
    }
    return -1;
  }

  // Charges finished pieces' bytes to their tickets and completes tickets; mu_ must be held.
  // Returns whether a ticket completed (the caller notifies done_cv_).
  bool finish_locked(std::vector<std::pair<Piece*, Status>>& finished) {
    bool any_done = false;
    for (auto& [p, s] : finished) {
      TicketState* t = p->ticket;
      if (!s.is_ok() && t->status.is_ok()) t->status = std::move(s);
      t->remaining_bytes -= p->size_bytes;
      if (t->remaining_bytes == 0) {
        t->done = true;
        any_done = true;
        if (--active_tickets_ == 0) busy_ += std::chrono::steady_clock::now() - busy_since_;
        if (t->traced) (t->writes ? busy_writes_ : busy_reads_).end();
      }
    }
    finished.clear();
    return any_done;
  }

  void worker(detail::Queue& queue) {
    const uint32_t qd = options_.queue_depth;
    std::vector<Piece> slots(qd);
    std::vector<uint32_t> free_slots;
    for (uint32_t i = qd; i > 0; --i) free_slots.push_back(i - 1);
    std::vector<uint32_t> resubmit;
    std::vector<detail::Sqe> sqes;
    std::vector<detail::Cqe> cqes(qd);
    std::vector<std::pair<Piece*, Status>> finished;
    std::vector<uint32_t> freed;
    uint32_t in_kernel = 0;
    uint64_t my_registration_gen = 0;
    uint64_t reap_failures = 0;

    auto make_sqe = [&](uint32_t slot) {
      Piece& p = slots[slot];
      const uint64_t left = p.size_bytes - p.done_bytes;
      std::byte* buf = p.buffer + p.done_bytes;
      return detail::Sqe{p.op,
                         p.file->fd(),
                         &p.file->path(),
                         p.offset_bytes + p.done_bytes,
                         buf,
                         static_cast<uint32_t>(left),
                         slot,
                         p.file->offset_align(),
                         fixed_index(buf, left, queue)};
    };
    auto fail = [&](uint32_t slot, Status s) {
      errors_.fetch_add(1, std::memory_order_relaxed);
      pieces_.fetch_add(1, std::memory_order_relaxed);
      finished.emplace_back(&slots[slot], std::move(s));
      freed.push_back(slot);
    };

    for (;;) {
      sqes.clear();
      for (uint32_t slot : resubmit) sqes.push_back(make_sqe(slot));
      resubmit.clear();
      const bool may_fill = options_.overlap_events || (in_kernel == 0 && sqes.empty());
      {
        std::unique_lock<std::mutex> lock(mu_);
        // Finished pieces are charged here, in the same critical section as the refill, so a
        // completion costs one lock round trip.
        if (finish_locked(finished)) done_cv_.notify_all();
        for (uint32_t slot : freed) free_slots.push_back(slot);
        freed.clear();
        const bool idle = free_slots.size() == qd;
        if (idle) {
          work_cv_.wait(lock, [&] { return stop_ || !pending_.empty() || registration_gen_ != my_registration_gen; });
          if (registration_gen_ != my_registration_gen) {
            my_registration_gen = registration_gen_;
            lock.unlock();
            Status s = queue.register_buffers(fixed_buffers_);
            lock.lock();
            if (!s.is_ok() && registration_status_.is_ok()) registration_status_ = std::move(s);
            if (--registration_pending_ == 0) done_cv_.notify_all();
            continue;
          }
          if (stop_ && pending_.empty()) return;
        }
        if (may_fill) {
          bool dropped_done = false;
          while (!free_slots.empty() && !pending_.empty()) {
            Segment& seg = pending_.front();
            if (!seg.ticket->status.is_ok()) {
              // The ticket already failed: don't start the rest of it.
              seg.ticket->remaining_bytes -= seg.size_bytes;
              if (seg.ticket->remaining_bytes == 0) {
                seg.ticket->done = true;
                dropped_done = true;
              }
              pending_.pop_front();
              continue;
            }
            const uint64_t n = std::min(seg.size_bytes, options_.block_size_bytes);
            const uint32_t slot = free_slots.back();
            free_slots.pop_back();
            slots[slot] = Piece{seg.ticket, seg.op, seg.file, seg.offset_bytes, seg.buffer, n, 0, 0};
            seg.offset_bytes += n;
            seg.buffer += n;
            seg.size_bytes -= n;
            if (seg.size_bytes == 0) pending_.pop_front();
            sqes.push_back(make_sqe(slot));
          }
          if (dropped_done) done_cv_.notify_all();
        }
      }
      if (!sqes.empty()) {
        Status s = queue.submit(sqes);
        if (!s.is_ok()) {
          // The queue refused the batch (Queue::submit fails only before anything reached the
          // kernel; per-piece rejections come back as completions), so fail those pieces.
          for (const detail::Sqe& sqe : sqes) {
            const Piece& p = slots[sqe.slot];
            Status e = s;
            e.with_context(describe(p, sqe.offset_bytes, sqe.size_bytes) + " (" +
                           std::string(backend_name(options_.backend)) + ")");
            fail(sqe.slot, std::move(e));
          }
          continue;
        }
        in_kernel += static_cast<uint32_t>(sqes.size());
      }
      if (in_kernel == 0) continue;
      auto reaped = queue.reap(cqes);
      if (!reaped.is_ok()) {
        // Waiting itself failed (not a piece). The pieces may still be in the kernel, so their
        // buffers cannot be handed back: report the failure once per streak and keep waiting.
        if (reap_failures++ == 0)
          ZO_LOG(kWarn) << "I/O completion wait failed, retrying: " << reaped.status().to_string();
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
        continue;
      }
      reap_failures = 0;
      const size_t n = *reaped;
      in_kernel -= static_cast<uint32_t>(n);
      for (size_t i = 0; i < n; ++i) handle(cqes[i], slots, resubmit, fail, freed, finished);
    }
  }

  template <typename Fail>
  void handle(const detail::Cqe& c, std::vector<Piece>& slots, std::vector<uint32_t>& resubmit, Fail& fail,
              std::vector<uint32_t>& freed, std::vector<std::pair<Piece*, Status>>& finished) {
    Piece& p = slots[c.slot];
    const uint64_t at = p.offset_bytes + p.done_bytes;
    const uint64_t left = p.size_bytes - p.done_bytes;
    auto where = [&] { return describe(p, at, left) + " (" + std::string(backend_name(options_.backend)) + ")"; };
    if (c.result == -EAGAIN || c.result == -EINTR) {
      transient_retries_.fetch_add(1, std::memory_order_relaxed);
      if (++p.transient_retries > kMaxTransientRetries) {
        fail(c.slot,
             errno_status(where() + ": still failing after " + std::to_string(kMaxTransientRetries) + " retries",
                          static_cast<int>(-c.result)));
        return;
      }
      if (c.result == -EAGAIN && p.transient_retries > 8) std::this_thread::yield();
      resubmit.push_back(c.slot);
      return;
    }
    if (c.result < 0) {
      fail(c.slot, errno_status(where(), static_cast<int>(-c.result)));
      return;
    }
    if (c.result == 0) {
      fail(c.slot,
           io_error(where() + ": " + (p.op == IoOp::kRead ? "unexpected end of file" : "wrote 0 bytes") + " after " +
                        std::to_string(p.done_bytes) + " of " + std::to_string(p.size_bytes) + " bytes",
                    0));
      return;
    }
    const uint64_t got = std::min<uint64_t>(static_cast<uint64_t>(c.result), left);
    (p.op == IoOp::kRead ? bytes_read_ : bytes_written_).fetch_add(got, std::memory_order_relaxed);
    p.done_bytes += got;
    if (p.done_bytes < p.size_bytes) {
      short_resubmits_.fetch_add(1, std::memory_order_relaxed);
      if ((p.offset_bytes + p.done_bytes) % p.file->offset_align() != 0) {
        fail(c.slot, io_error(where() + ": short " + std::string(op_name(p.op)) + " of " + std::to_string(got) +
                                  " bytes leaves an O_DIRECT remainder at an unaligned position (end of file?)",
                              0));
        return;
      }
      resubmit.push_back(c.slot);
      return;
    }
    pieces_.fetch_add(1, std::memory_order_relaxed);
    finished.emplace_back(&p, Status::ok());
    freed.push_back(c.slot);
  }

  mutable std::mutex mu_;
  std::condition_variable work_cv_;
  std::condition_variable done_cv_;
  std::deque<Segment> pending_;
  std::unordered_map<Ticket, std::unique_ptr<TicketState>> tickets_;
  // Busy time (IoStats::busy_s), under mu_: tickets with bytes still to move, and since when.
  uint64_t active_tickets_ = 0;
  std::chrono::steady_clock::time_point busy_since_;
  std::chrono::steady_clock::duration busy_{};
  // The trace's NVMe tracks: periods with tickets of one direction outstanding.
  trace::BusyTrack busy_reads_{trace::Track::kNvmeRead, "reads"};
  trace::BusyTrack busy_writes_{trace::Track::kNvmeWrite, "writes"};
  Ticket next_ticket_ = 1;
  bool stop_ = false;
  std::vector<std::thread> threads_;

  std::vector<std::span<std::byte>> fixed_buffers_;
  uint32_t registration_pending_ = 0;
  Status registration_status_;
  uint64_t registration_gen_ = 0;

  std::atomic<uint64_t> bytes_read_{0};
  std::atomic<uint64_t> bytes_written_{0};
  std::atomic<uint64_t> pieces_{0};
  std::atomic<uint64_t> short_resubmits_{0};
  std::atomic<uint64_t> transient_retries_{0};
  std::atomic<uint64_t> errors_{0};
};

Result<std::unique_ptr<IoEngine>> IoEngine::create(const IoOptions& options, std::shared_ptr<FaultInjector> faults) {
  ZO_RETURN_IF_ERROR(options.validate());
  if (options.use_gds)
    ZO_LOG(kWarn) << "aio.use_gds is set but GPUDirect Storage is not available in zoffload; using host I/O";
  std::string fallback_reason;
  ZO_ASSIGN_OR_RETURN(Backend backend, detail::resolve_backend(options.backend, &fallback_reason));
  IoOptions resolved = options;
  resolved.backend = backend;
  detail::QueueOptions qopts;
  qopts.queue_depth = options.queue_depth;
  qopts.single_submit = options.single_submit;
  std::vector<std::unique_ptr<detail::Queue>> queues;
  for (uint32_t i = 0; i < options.threads; ++i) {
    auto q = detail::make_queue(backend, qopts);
    if (!q.is_ok()) {
      Status s = q.status();
      return s.with_context("creating " + std::string(backend_name(backend)) + " queue " + std::to_string(i) + " of " +
                            std::to_string(options.threads));
    }
    std::unique_ptr<detail::Queue> queue = std::move(q).value();
    if (faults) queue = detail::make_fault_queue(std::move(queue), faults);
    queues.push_back(std::move(queue));
  }
  auto impl = std::make_unique<Impl>(resolved, std::move(fallback_reason));
  ZO_RETURN_IF_ERROR(impl->start(std::move(queues)));
  return std::unique_ptr<IoEngine>(new IoEngine(std::move(impl)));
}

IoEngine::IoEngine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
IoEngine::~IoEngine() = default;

Backend IoEngine::backend() const { return impl_->options_.backend; }
const IoOptions& IoEngine::options() const { return impl_->options_; }
const std::string& IoEngine::fallback_reason() const { return impl_->fallback_reason_; }
Result<Ticket> IoEngine::submit(std::span<const IoRequest> batch) { return impl_->submit(batch); }
Status IoEngine::wait(Ticket ticket) { return impl_->wait(ticket); }
std::optional<Status> IoEngine::poll(Ticket ticket) { return impl_->poll(ticket); }
Status IoEngine::wait_all() { return impl_->wait_all(); }
Status IoEngine::register_buffers(std::span<const std::span<std::byte>> buffers) {
  return impl_->register_buffers(buffers);
}
IoStats IoEngine::stats() const { return impl_->stats(); }

Status IoEngine::read(const File& file, uint64_t offset_bytes, std::span<std::byte> buffer) {
  ZO_ASSIGN_OR_RETURN(Ticket t, submit(read_request(file, offset_bytes, buffer.data(), buffer.size())));
  return wait(t);
}

Status IoEngine::write(const File& file, uint64_t offset_bytes, std::span<const std::byte> buffer) {
  ZO_ASSIGN_OR_RETURN(Ticket t, submit(write_request(file, offset_bytes, buffer.data(), buffer.size())));
  return wait(t);
}

}  // namespace zo::io

// pread/pwrite pool backend: each engine worker owns queue_depth (at most kMaxPoolThreads) helper
// threads that each perform one blocking system call per piece. Works on every kernel and file
// system; the fallback when neither io_uring nor libaio is usable.
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <system_error>
#include <thread>
#include <vector>

#include "io/detail/queue.h"

namespace zo::io::detail {
namespace {

constexpr uint32_t kMaxPoolThreads = 64;

class PsyncQueue final : public Queue {
 public:
  explicit PsyncQueue(const QueueOptions& options) : options_(options) {}
  ~PsyncQueue() override { stop_and_join(); }

  // Starts the helper threads; a thread the system refuses is an error (the ones started are
  // joined), never a std::terminate from a half-built object.
  Status start() {
    const uint32_t n = std::min(options_.queue_depth, kMaxPoolThreads);
    threads_.reserve(n);
    for (uint32_t i = 0; i < n; ++i) {
      try {
        threads_.emplace_back([this] { run(); });
      } catch (const std::system_error& e) {
        stop_and_join();
        return errno_status("starting pread/pwrite pool thread " + std::to_string(i + 1) + " of " + std::to_string(n),
                            e.code().value());
      }
    }
    return Status::ok();
  }

  Status submit(std::span<const Sqe> sqes) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      jobs_.insert(jobs_.end(), sqes.begin(), sqes.end());
    }
    if (sqes.size() == 1) work_cv_.notify_one();
    else work_cv_.notify_all();
    return Status::ok();
  }

  Result<size_t> reap(std::span<Cqe> out) override {
    std::unique_lock<std::mutex> lock(mu_);
    done_cv_.wait(lock, [this] { return !done_.empty(); });
    size_t n = 0;
    while (n < out.size() && !done_.empty()) {
      out[n++] = done_.front();
      done_.pop_front();
    }
    return n;
  }

 private:
  void run() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      work_cv_.wait(lock, [this] { return stop_ || !jobs_.empty(); });
      if (jobs_.empty()) return;
      const Sqe s = jobs_.front();
      jobs_.pop_front();
      lock.unlock();
      // One call, reported as the kernel returned it: the engine handles short transfers and
      // EINTR/EAGAIN the same way for every backend.
      const ssize_t rc = s.op == IoOp::kRead
                             ? ::pread(s.fd, s.buffer, s.size_bytes, static_cast<off_t>(s.offset_bytes))
                             : ::pwrite(s.fd, s.buffer, s.size_bytes, static_cast<off_t>(s.offset_bytes));
      const int64_t result = rc < 0 ? -static_cast<int64_t>(errno) : static_cast<int64_t>(rc);
      lock.lock();
      done_.push_back(Cqe{s.slot, result});
      done_cv_.notify_one();
    }
  }

  void stop_and_join() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    work_cv_.notify_all();
    for (auto& t : threads_) t.join();
    threads_.clear();
  }

  QueueOptions options_;
  std::mutex mu_;
  std::condition_variable work_cv_;
  std::condition_variable done_cv_;
  std::deque<Sqe> jobs_;
  std::deque<Cqe> done_;
  bool stop_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace

Result<std::unique_ptr<Queue>> make_psync_queue(const QueueOptions& options) {
  auto q = std::make_unique<PsyncQueue>(options);
  ZO_RETURN_IF_ERROR(q->start());
  return std::unique_ptr<Queue>(std::move(q));
}

}  // namespace zo::io::detail

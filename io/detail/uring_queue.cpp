// io_uring backend: one ring per engine worker. Built only when liburing is found.
#include <liburing.h>

#include <cerrno>
#include <vector>

#include "io/detail/queue.h"

namespace zo::io::detail {
namespace {

class UringQueue final : public Queue {
 public:
  explicit UringQueue(const QueueOptions& options) : options_(options) {}
  ~UringQueue() override {
    if (initialised_) io_uring_queue_exit(&ring_);
  }

  Status init() {
    const int rc = io_uring_queue_init(options_.queue_depth, &ring_, 0);
    if (rc < 0) return errno_status("io_uring_queue_init(" + std::to_string(options_.queue_depth) + ")", -rc);
    initialised_ = true;
    return Status::ok();
  }

  Status submit(std::span<const Sqe> sqes) override {
    for (const Sqe& s : sqes) {
      // reap() leaves the SQ ring empty and at most queue_depth (the ring's size) pieces are
      // outstanding, so there is always a free entry.
      io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
      ZO_CHECK(sqe != nullptr) << "io_uring SQ ring full with " << sqes.size() << " pieces to submit";
      if (s.buf_index >= 0) {
        if (s.op == IoOp::kRead)
          io_uring_prep_read_fixed(sqe, s.fd, s.buffer, s.size_bytes, s.offset_bytes, s.buf_index);
        else io_uring_prep_write_fixed(sqe, s.fd, s.buffer, s.size_bytes, s.offset_bytes, s.buf_index);
      } else {
        if (s.op == IoOp::kRead) io_uring_prep_read(sqe, s.fd, s.buffer, s.size_bytes, s.offset_bytes);
        else io_uring_prep_write(sqe, s.fd, s.buffer, s.size_bytes, s.offset_bytes);
      }
      io_uring_sqe_set_data64(sqe, s.slot);
      // single_submit: one io_uring_enter per piece. If it fails, the entry stays in the SQ ring
      // and reap() submits it (and reports a ring that keeps failing).
      if (options_.single_submit) (void)io_uring_submit(&ring_);
    }
    // Otherwise the prepared SQEs go to the kernel in reap(), in the same io_uring_enter call that
    // waits for a completion. Never fails: per-piece errors come back as completions.
    return Status::ok();
  }

  Result<size_t> reap(std::span<Cqe> out) override {
    io_uring_cqe* cqe = nullptr;
    while (io_uring_sq_ready(&ring_) > 0) {
      const int rc = io_uring_submit_and_wait(&ring_, 1);
      if (rc >= 0 || rc == -EINTR || rc == -EAGAIN || rc == -EBUSY) continue;
      return errno_status("io_uring_submit_and_wait", -rc);
    }
    for (;;) {
      const int rc = io_uring_wait_cqe(&ring_, &cqe);
      if (rc == 0) break;
      if (rc == -EINTR || rc == -EAGAIN) continue;
      return errno_status("io_uring_wait_cqe", -rc);
    }
    size_t n = 0;
    unsigned head;
    io_uring_for_each_cqe(&ring_, head, cqe) {
      if (n == out.size()) break;
      out[n++] = Cqe{static_cast<uint32_t>(io_uring_cqe_get_data64(cqe)), cqe->res};
    }
    io_uring_cq_advance(&ring_, static_cast<unsigned>(n));
    return n;
  }

  Status register_buffers(std::span<const std::span<std::byte>> buffers) override {
    std::vector<iovec> iov;
    iov.reserve(buffers.size());
    for (auto b : buffers) iov.push_back(iovec{b.data(), b.size()});
    const int rc = io_uring_register_buffers(&ring_, iov.data(), static_cast<unsigned>(iov.size()));
    if (rc < 0) return errno_status("io_uring_register_buffers(" + std::to_string(iov.size()) + " buffers)", -rc);
    fixed_ = true;
    return Status::ok();
  }
  bool uses_fixed_buffers() const override { return fixed_; }

 private:
  QueueOptions options_;
  io_uring ring_{};
  bool initialised_ = false;
  bool fixed_ = false;
};

}  // namespace

Result<std::unique_ptr<Queue>> make_uring_queue(const QueueOptions& options) {
  auto q = std::make_unique<UringQueue>(options);
  ZO_RETURN_IF_ERROR(q->init());
  return std::unique_ptr<Queue>(std::move(q));
}

}  // namespace zo::io::detail

// detail::Queue: the small interface each backend implements — one submission/completion queue
// owned by one engine worker thread (an io_uring ring, a libaio context, or a set of pread/pwrite
// threads). Not thread-safe: only its worker calls it. Internal to io/; the engine does splitting,
// retries and tickets on top.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "common/status.h"
#include "io/fault_injector.h"
#include "io/io_options.h"
#include "io/io_request.h"

namespace zo::io::detail {

// One piece handed to the kernel. `slot` (< queue depth) comes back in its completion.
struct Sqe {
  IoOp op;
  int fd;
  const std::string* path;  // for fault rules and messages
  uint64_t offset_bytes;
  std::byte* buffer;
  uint32_t size_bytes;
  uint32_t slot;
  uint32_t offset_align;  // the file's direct-I/O alignment (1 when buffered)
  int buf_index;          // registered buffer index, or -1
};

// `result` is the byte count transferred or -errno, exactly as the kernel reported it.
struct Cqe {
  uint32_t slot;
  int64_t result;
};

class Queue {
 public:
  virtual ~Queue() = default;
  // Hands all of `sqes` to the backend (at most queue_depth outstanding). An error here means the
  // queue itself is broken; per-piece errors come back as completions.
  virtual Status submit(std::span<const Sqe> sqes) = 0;
  // Blocks until at least one piece has completed and returns how many were written to `out`.
  virtual Result<size_t> reap(std::span<Cqe> out) = 0;
  // Registers fixed buffers (io_uring only); the default accepts and ignores them.
  virtual Status register_buffers(std::span<const std::span<std::byte>>) { return Status::ok(); }
  virtual bool uses_fixed_buffers() const { return false; }
};

struct QueueOptions {
  uint32_t queue_depth = 8;
  bool single_submit = false;
};

// Each backend's constructor; make_uring_queue/make_aio_queue exist only when the backend is built
// (backend_factory.cpp is the one place that knows which).
Result<std::unique_ptr<Queue>> make_uring_queue(const QueueOptions& options);
Result<std::unique_ptr<Queue>> make_aio_queue(const QueueOptions& options);
Result<std::unique_ptr<Queue>> make_psync_queue(const QueueOptions& options);
std::unique_ptr<Queue> make_fault_queue(std::unique_ptr<Queue> inner, std::shared_ptr<FaultInjector> faults);

// Resolves kAuto by probing (logging each fallback with its reason into *fallback_reason) and
// checks an explicit backend is built and accepted by the kernel.
Result<Backend> resolve_backend(Backend requested, std::string* fallback_reason);
// Builds one queue for a resolved backend.
Result<std::unique_ptr<Queue>> make_queue(Backend backend, const QueueOptions& options);

}  // namespace zo::io::detail

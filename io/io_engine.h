// IoEngine: asynchronous file I/O over io_uring, libaio or a pread/pwrite thread pool (one
// interface; the backend is chosen at creation). Requests of any size are split into
// block_size pieces, kept up to queue_depth in flight per worker thread, and complete a ticket with
// a Status. Every piece is checked: short transfers are resubmitted for the remainder,
// EAGAIN/EINTR retried, other errors reported with path, offset, length and errno.
// Thread-safe: any thread may submit, wait and poll; worker threads complete tickets. Buffers and
// files stay owned by the caller and must outlive the ticket.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>

#include "common/status.h"
#include "io/fault_injector.h"
#include "io/file.h"
#include "io/io_options.h"
#include "io/io_request.h"

namespace zo::io {

using Ticket = uint64_t;

// Counters since creation; read with stats() at any time.
struct IoStats {
  uint64_t bytes_read = 0;
  uint64_t bytes_written = 0;
  uint64_t pieces = 0;             // pieces completed (successfully or not)
  uint64_t short_resubmits = 0;    // remainders resubmitted after a short transfer
  uint64_t transient_retries = 0;  // EAGAIN/EINTR retries
  uint64_t errors = 0;             // pieces that failed for good
  double busy_s = 0;               // wall time with at least one ticket outstanding (the drive in use)
};

class IoEngine {
 public:
  // Creates the engine and its worker threads. With Backend::kAuto, tries io_uring, then libaio,
  // then the pool, logging why each was skipped (fallback_reason() keeps it). An explicitly named
  // backend that is not built or that the kernel refuses (EPERM/ENOSYS in containers) fails with
  // StatusCode::kUnavailable — it never falls back silently. `faults`, when given, wraps the
  // backend with fault injection.
  static Result<std::unique_ptr<IoEngine>> create(const IoOptions& options,
                                                  std::shared_ptr<FaultInjector> faults = nullptr);
  // Waits for all outstanding pieces, then stops the workers. Unwaited tickets are dropped.
  ~IoEngine();
  IoEngine(const IoEngine&) = delete;
  IoEngine& operator=(const IoEngine&) = delete;

  // The backend in use (never kAuto) and the options after resolution.
  Backend backend() const;
  const IoOptions& options() const;
  // Why kAuto did not pick io_uring (and libaio), e.g. "io_uring_queue_init: Operation not
  // permitted (errno 1)"; empty when nothing fell back.
  const std::string& fallback_reason() const;

  // Queues a batch of requests under one ticket; returns at once. Requests are validated here:
  // a null file or buffer, or, for O_DIRECT files, a buffer, offset or length not aligned to the
  // file's alignment, fails the whole batch before anything is queued (InvalidArgument naming the
  // path, offset, length and alignment). Zero-length requests complete immediately.
  Result<Ticket> submit(std::span<const IoRequest> batch);
  Result<Ticket> submit(const IoRequest& request) { return submit(std::span<const IoRequest>(&request, 1)); }

  // Blocks until the ticket's pieces have all completed; returns the first error among them
  // (after an error the ticket's remaining pieces are not started). A ticket is consumed by
  // wait() or by a poll() that returns a Status; waiting on it again is InvalidArgument.
  Status wait(Ticket ticket);
  // The ticket's Status if it has completed (consuming it), std::nullopt if it is still running.
  std::optional<Status> poll(Ticket ticket);
  // Waits for every outstanding ticket, consumes them and returns the first error.
  Status wait_all();

  // Synchronous helpers: submit one request and wait for it.
  Status read(const File& file, uint64_t offset_bytes, std::span<std::byte> buffer);
  Status write(const File& file, uint64_t offset_bytes, std::span<const std::byte> buffer);

  // Registers a pool of buffers with every io_uring ring so that pieces inside them use
  // READ_FIXED/WRITE_FIXED (no per-I/O page pinning). Call before submitting, at most once; the
  // buffers must outlive the engine. Other backends accept the call and do nothing. Fails if the
  // kernel refuses (e.g. RLIMIT_MEMLOCK) — the engine then keeps working unregistered.
  Status register_buffers(std::span<const std::span<std::byte>> buffers);

  IoStats stats() const;

  class Impl;

 private:
  explicit IoEngine(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace zo::io

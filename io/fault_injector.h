// FaultInjector: rules that make the I/O engine fail chosen requests (EIO, ENOSPC, short
// transfers, transient EAGAIN/EINTR) so the layers above can test their error paths. It wraps any
// backend (IoEngine::create(options, injector)); requests no rule matches go to the real backend.
// The same rules drive io::FaultyEnv (env.h) for the file operations outside the engine.
// Thread-safe: rules may be added while the engine runs.
#pragma once

#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "io/io_request.h"

namespace zo::io {

enum class FaultKind : uint8_t {
  kEio,            // the piece fails with EIO
  kNoSpace,        // the piece fails with ENOSPC
  kShortTransfer,  // the kernel transfers only part of the piece (the engine must resubmit the rest)
  kEagain,         // transient EAGAIN (the engine must retry)
  kEintr,          // transient EINTR (the engine must retry)
};

struct FaultRule {
  FaultKind kind = FaultKind::kEio;
  std::optional<IoOp> op;     // any op when empty
  std::string path_contains;  // any file when empty
  uint64_t offset_bytes = 0;  // the piece must cover this file offset
  int times = 1;              // how many pieces it hits; negative = every matching piece
  int skip = 0;               // matching pieces let through before the first hit
};

class FaultInjector {
 public:
  void add(FaultRule rule);
  void clear();
  // How many faults have been injected so far.
  uint64_t injected() const;

  // Called by the engine for each piece: the fault to inject, if a rule matches (and consumes one
  // of its `times`).
  std::optional<FaultKind> decide(const std::string& path, IoOp op, uint64_t offset_bytes, uint64_t size_bytes);

 private:
  mutable std::mutex mu_;
  std::vector<FaultRule> rules_;
  uint64_t injected_ = 0;
};

}  // namespace zo::io

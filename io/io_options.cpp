#include "io/io_options.h"

#include <algorithm>
#include <cctype>
#include <string>

namespace zo::io {

std::string_view backend_name(Backend backend) {
  switch (backend) {
    case Backend::kAuto: return "auto";
    case Backend::kUring: return "io_uring";
    case Backend::kAio: return "libaio";
    case Backend::kPsync: return "psync";
  }
  return "unknown";
}

Result<Backend> parse_backend(std::string_view text) {
  std::string lower(text);
  std::transform(lower.begin(), lower.end(), lower.begin(), [](unsigned char c) { return std::tolower(c); });
  if (lower == "auto") return Backend::kAuto;
  if (lower == "io_uring" || lower == "uring") return Backend::kUring;
  if (lower == "libaio" || lower == "aio") return Backend::kAio;
  if (lower == "psync" || lower == "pool") return Backend::kPsync;
  return invalid_argument("unknown I/O backend '" + std::string(text) + "' (expected auto, io_uring, libaio or psync)");
}

Status IoOptions::validate() const {
  if (block_size_bytes == 0 || block_size_bytes % 4096 != 0 || block_size_bytes > kMaxRequestBytes)
    return invalid_argument("aio.block_size " + std::to_string(block_size_bytes) +
                            " must be a positive multiple of 4096 bytes and at most " +
                            std::to_string(kMaxRequestBytes));
  if (queue_depth < 1 || queue_depth > kMaxQueueDepth)
    return invalid_argument("aio.queue_depth " + std::to_string(queue_depth) + " must be in 1.." +
                            std::to_string(kMaxQueueDepth));
  if (threads < 1 || threads > kMaxThreads)
    return invalid_argument("aio.intra_op_parallelism " + std::to_string(threads) + " must be in 1.." +
                            std::to_string(kMaxThreads));
  return Status::ok();
}

std::string IoOptions::to_string() const {
  std::string out(backend_name(backend));
  out += " bs=" + format_bytes(block_size_bytes);
  out += " qd=" + std::to_string(queue_depth);
  out += " threads=" + std::to_string(threads);
  out += direct ? " direct" : " buffered";
  if (single_submit) out += " single_submit";
  if (!overlap_events) out += " no_overlap";
  return out;
}

}  // namespace zo::io

// IoRequest: one read or write of a caller-owned buffer at a file offset, as handed to IoEngine.
// Plain value type; the file and the buffer must outlive the ticket that carries the request.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace zo::io {

class File;

// kRead and kWrite are the engine's requests; the others are Env's file operations (io/env.h),
// named here so one FaultRule can aim at either. kOpen is Env::open_file, opening a File for the
// engine.
enum class IoOp : uint8_t { kRead, kWrite, kCreate, kSync, kRename, kRemove, kOpen };

inline std::string_view op_name(IoOp op) {
  switch (op) {
    case IoOp::kRead: return "read";
    case IoOp::kWrite: return "write";
    case IoOp::kCreate: return "create";
    case IoOp::kSync: return "sync";
    case IoOp::kRename: return "rename";
    case IoOp::kRemove: return "remove";
    case IoOp::kOpen: return "open";
  }
  return "?";
}

struct IoRequest {
  IoOp op = IoOp::kRead;
  const File* file = nullptr;
  uint64_t offset_bytes = 0;
  std::byte* buffer = nullptr;  // for writes only read from
  uint64_t size_bytes = 0;      // any size; split into block_size pieces by the engine
};

inline IoRequest read_request(const File& file, uint64_t offset_bytes, std::byte* buffer, uint64_t size_bytes) {
  return {IoOp::kRead, &file, offset_bytes, buffer, size_bytes};
}
inline IoRequest write_request(const File& file, uint64_t offset_bytes, const std::byte* buffer, uint64_t size_bytes) {
  return {IoOp::kWrite, &file, offset_bytes, const_cast<std::byte*>(buffer), size_bytes};
}

}  // namespace zo::io

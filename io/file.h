// File: an open file descriptor for the async I/O engine, opened with O_DIRECT where the file
// system honours it (alignment from statx STATX_DIOALIGN, else 4096) and buffered otherwise, with
// the reason recorded and logged. Move-only; the fd is closed on destruction. Const methods are
// thread-safe; the engine reads fd/path/alignment from its worker threads.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "common/status.h"

namespace zo::io {

enum class OpenMode : uint8_t {
  kRead,       // read only; must exist
  kReadWrite,  // read and write; must exist
  kCreate,     // read and write; created (0644) if missing, never truncated
  kCreateNew,  // read and write; created (0644), and StatusCode::kAlreadyExists if it exists
};

class File {
 public:
  File() = default;
  // Opens `path`. With `direct` true, O_DIRECT is used unless the file system does not honour it
  // (open fails with EINVAL, statx reports no direct-I/O support, or it is tmpfs/ramfs, which
  // accept the flag but keep pages in RAM): then the file is buffered, buffered_reason() says why
  // and a warning is logged. Fails with the path and errno text (kAlreadyExists for kCreateNew
  // on an existing path).
  static Result<File> open(const std::string& path, OpenMode mode, bool direct = true);

  File(File&& other) noexcept;
  File& operator=(File&& other) noexcept;
  File(const File&) = delete;
  File& operator=(const File&) = delete;
  ~File();

  bool is_open() const { return fd_ >= 0; }
  int fd() const { return fd_; }
  const std::string& path() const { return path_; }
  // True when the fd has O_DIRECT; then buffers must be aligned to mem_align() and offsets and
  // lengths to offset_align(). Both are 1 for buffered files.
  bool direct() const { return direct_; }
  uint32_t mem_align() const { return mem_align_; }
  uint32_t offset_align() const { return offset_align_; }
  // Why direct I/O was requested but not used; empty otherwise.
  const std::string& buffered_reason() const { return buffered_reason_; }

  // Reserves `size_bytes` of blocks with fallocate (the file grows to at least that size) so later
  // in-place writes never hit ENOSPC. Where fallocate is unsupported (EOPNOTSUPP) the file is
  // extended with ftruncate instead, with a warning. ENOSPC maps to StatusCode::kNoSpace.
  Status preallocate(uint64_t size_bytes);
  Result<uint64_t> size_bytes() const;
  // An exclusive advisory lock on the file (flock), held until the fd is closed, so that two
  // processes never use one file at once. Does not wait: kFailedPrecondition "PATH is in use by
  // another process" when another open file description holds it (in this process too).
  Status lock_exclusive();
  // ftruncate to exactly `size_bytes` (shrinks or extends).
  Status truncate(uint64_t size_bytes);
  // fdatasync.
  Status sync();
  // Closes the fd, reporting a close() error (deferred write-back failures surface here).
  Status close();

 private:
  int fd_ = -1;
  std::string path_;
  bool direct_ = false;
  uint32_t mem_align_ = 1;
  uint32_t offset_align_ = 1;
  std::string buffered_reason_;
};

// Checks, without opening it, that `path` (symlinks followed) is a regular file: an input that is
// a FIFO, socket or device would block forever or never end. kNotFound "<what> PATH: no such file";
// kInvalidArgument "<what> PATH is a FIFO (named pipe), not a regular file" (or a directory, ...);
// another stat() failure with its errno. `what` names the input: "config file", "--data", ...
Status check_regular_file(const std::string& path, std::string_view what);

}  // namespace zo::io

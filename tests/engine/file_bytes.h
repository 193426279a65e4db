// Bytes of a real file as the OS has them, read and written with plain pread/pwrite past the code
// under test (the swap file's padding checks of swapper_test and coord_io_test). Test-only; a
// failed call aborts naming the path and offset.
#pragma once

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "common/check.h"

namespace zo::engine {

// Bytes [offset_bytes, offset_bytes + size_bytes) of the file at `path`.
inline std::vector<std::byte> read_file_bytes(const std::string& path, uint64_t offset_bytes, uint64_t size_bytes) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  ZO_CHECK(fd >= 0) << "open " << path << ": " << std::strerror(errno);
  std::vector<std::byte> out(size_bytes);
  const ssize_t n = ::pread(fd, out.data(), out.size(), static_cast<off_t>(offset_bytes));
  const int err = errno;
  ::close(fd);
  ZO_CHECK(n == static_cast<ssize_t>(size_bytes)) << "pread " << path << " offset " << offset_bytes << " length "
                                                  << size_bytes << ": " << n << " " << std::strerror(err);
  return out;
}

// Overwrites the file at `path` from offset_bytes with `bytes`, on disk (fdatasync) before returning,
// so that an O_DIRECT read sees them.
inline void write_file_bytes(const std::string& path, uint64_t offset_bytes, const std::vector<std::byte>& bytes) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CLOEXEC);
  ZO_CHECK(fd >= 0) << "open " << path << ": " << std::strerror(errno);
  const ssize_t n = ::pwrite(fd, bytes.data(), bytes.size(), static_cast<off_t>(offset_bytes));
  int err = errno;
  bool done = n == static_cast<ssize_t>(bytes.size());
  if (done && ::fdatasync(fd) != 0) {
    done = false;
    err = errno;
  }
  ::close(fd);
  ZO_CHECK(done) << "pwrite and fdatasync " << path << " offset " << offset_bytes << " length " << bytes.size() << ": "
                 << n << " " << std::strerror(err);
}

}  // namespace zo::engine

#include "io/file.h"

#include <fcntl.h>
#include <linux/magic.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <cerrno>
#include <mutex>
#include <set>
#include <utility>

#include "common/aligned_buffer.h"
#include "common/log.h"

namespace zo::io {
namespace {

int open_flags(OpenMode mode) {
  switch (mode) {
    case OpenMode::kRead: return O_RDONLY | O_CLOEXEC;
    case OpenMode::kReadWrite: return O_RDWR | O_CLOEXEC;
    case OpenMode::kCreate: return O_RDWR | O_CREAT | O_CLOEXEC;
    case OpenMode::kCreateNew: return O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC;
  }
  return O_RDONLY | O_CLOEXEC;
}

int retry_open(const std::string& path, int flags) {
  int fd;
  do { fd = ::open(path.c_str(), flags, 0644); } while (fd < 0 && errno == EINTR);
  return fd;
}

Status open_error(const std::string& path, int err) {
  if (err == EEXIST) return Status(StatusCode::kAlreadyExists, "open " + path + ": it already exists", err);
  return errno_status("open " + path, err);
}

// True the first time the process falls back to buffered I/O for `reason` on the file system
// holding `fd` (an fstat that fails counts as a first time).
bool first_fallback_on(int fd, const std::string& reason) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) return true;
  static std::mutex mu;
  static std::set<std::pair<dev_t, std::string>> said;
  std::lock_guard lock(mu);
  return said.emplace(st.st_dev, reason).second;
}

}  // namespace

// Note [Detecting O_DIRECT support]
// open(O_DIRECT) is not a reliable test: tmpfs (since 6.6) accepts the flag but serves every
// request from the page cache, and some FUSE file systems fail the first read instead. statx with
// STATX_DIOALIGN (Linux 6.1+) is authoritative where the file system reports it: a zero
// dio_mem_align means "no direct I/O". Where it is not reported we check for tmpfs/ramfs by magic,
// and otherwise assume the classic 4096-byte alignment, which satisfies every block device.
Result<File> File::open(const std::string& path, OpenMode mode, bool direct) {
  File f;
  f.path_ = path;
  const int flags = open_flags(mode);
  std::string reason;
  int fd = -1;
  if (direct) {
    fd = retry_open(path, flags | O_DIRECT);
    if (fd < 0 && errno == EINVAL)
      reason = "open with O_DIRECT failed with EINVAL (the file system does not support it)";
    else if (fd < 0) return open_error(path, errno);
  }
  if (fd < 0) {
    fd = retry_open(path, flags);
    if (fd < 0) return open_error(path, errno);
  }
  f.fd_ = fd;
  if (direct && reason.empty()) {
    f.direct_ = true;
    f.mem_align_ = f.offset_align_ = static_cast<uint32_t>(kDirectIoAlignment);
    bool known = false;
#ifdef STATX_DIOALIGN
    struct statx sx {};
    if (::statx(fd, "", AT_EMPTY_PATH, STATX_DIOALIGN, &sx) == 0 && (sx.stx_mask & STATX_DIOALIGN) != 0) {
      known = true;
      if (sx.stx_dio_mem_align == 0 || sx.stx_dio_offset_align == 0) {
        reason = "statx reports no direct I/O support for this file";
      } else {
        f.mem_align_ = sx.stx_dio_mem_align;
        f.offset_align_ = sx.stx_dio_offset_align;
      }
    }
#endif
    if (!known) {
      struct statfs sf {};
      if (::fstatfs(fd, &sf) == 0 && (sf.f_type == TMPFS_MAGIC || sf.f_type == RAMFS_MAGIC))
        reason = "tmpfs/ramfs does not honour O_DIRECT (pages stay in RAM)";
    }
    if (!reason.empty()) {
      const int fl = ::fcntl(fd, F_GETFL);
      if (fl < 0 || ::fcntl(fd, F_SETFL, fl & ~O_DIRECT) < 0)
        return errno_status("fcntl clear O_DIRECT " + path, errno);
      f.direct_ = false;
      f.mem_align_ = f.offset_align_ = 1;
    }
  }
  if (!reason.empty()) {
    f.buffered_reason_ = reason;
    // Once per file system and reason (issue 19: on tmpfs it repeated for every file of every
    // save); buffered_reason() still says it for each file.
    if (first_fallback_on(fd, reason)) {
      ZO_LOG(kWarn) << "using buffered I/O for " << path << ": " << reason
                    << " (said once for this file system; its other files are buffered too)";
    } else {
      ZO_LOG(kDebug) << "using buffered I/O for " << path << ": " << reason;
    }
  }
  return f;
}

File::File(File&& other) noexcept
    : fd_(std::exchange(other.fd_, -1)),
      path_(std::move(other.path_)),
      direct_(other.direct_),
      mem_align_(other.mem_align_),
      offset_align_(other.offset_align_),
      buffered_reason_(std::move(other.buffered_reason_)) {}

File& File::operator=(File&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = std::exchange(other.fd_, -1);
    path_ = std::move(other.path_);
    direct_ = other.direct_;
    mem_align_ = other.mem_align_;
    offset_align_ = other.offset_align_;
    buffered_reason_ = std::move(other.buffered_reason_);
  }
  return *this;
}

File::~File() {
  if (fd_ >= 0) ::close(fd_);
}

Status File::preallocate(uint64_t target_bytes) {
  if (target_bytes == 0) return Status::ok();
  int rc;
  do { rc = ::fallocate(fd_, 0, 0, static_cast<off_t>(target_bytes)); } while (rc != 0 && errno == EINTR);
  if (rc == 0) return Status::ok();
  if (errno != EOPNOTSUPP) return errno_status("fallocate " + path_ + " length " + std::to_string(target_bytes), errno);
  ZO_LOG(kWarn) << "fallocate is not supported for " << path_
                << "; extending with ftruncate (blocks are not reserved, a later write may hit ENOSPC)";
  ZO_ASSIGN_OR_RETURN(uint64_t current, size_bytes());
  if (current >= target_bytes) return Status::ok();
  if (::ftruncate(fd_, static_cast<off_t>(target_bytes)) != 0)
    return errno_status("ftruncate " + path_ + " length " + std::to_string(target_bytes), errno);
  return Status::ok();
}

Status File::lock_exclusive() {
  int rc;
  do { rc = ::flock(fd_, LOCK_EX | LOCK_NB); } while (rc != 0 && errno == EINTR);
  if (rc == 0) return Status::ok();
  if (errno == EWOULDBLOCK)
    return Status(StatusCode::kFailedPrecondition, path_ + " is in use by another process", errno);
  return errno_status("flock " + path_, errno);
}

Result<uint64_t> File::size_bytes() const {
  struct stat st {};
  if (::fstat(fd_, &st) != 0) return errno_status("fstat " + path_, errno);
  return static_cast<uint64_t>(st.st_size);
}

Status File::truncate(uint64_t size_bytes) {
  if (::ftruncate(fd_, static_cast<off_t>(size_bytes)) != 0)
    return errno_status("ftruncate " + path_ + " to " + std::to_string(size_bytes) + " bytes", errno);
  return Status::ok();
}

Status File::sync() {
  int rc;
  do { rc = ::fdatasync(fd_); } while (rc != 0 && errno == EINTR);
  if (rc != 0) return errno_status("fdatasync " + path_, errno);
  return Status::ok();
}

Status File::close() {
  if (fd_ < 0) return Status::ok();
  const int fd = std::exchange(fd_, -1);
  if (::close(fd) != 0 && errno != EINTR) return errno_status("close " + path_, errno);
  return Status::ok();
}

Status check_regular_file(const std::string& path, std::string_view what) {
  const std::string named = std::string(what) + " " + path;
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    const int err = errno;
    if (err == ENOENT) return Status(StatusCode::kNotFound, named + ": no such file", err);
    return errno_status(named, err);
  }
  if (S_ISREG(st.st_mode)) return Status::ok();
  const char* kind = S_ISFIFO(st.st_mode)   ? "a FIFO (named pipe)"
                     : S_ISDIR(st.st_mode)  ? "a directory"
                     : S_ISSOCK(st.st_mode) ? "a socket"
                     : S_ISCHR(st.st_mode)  ? "a character device"
                     : S_ISBLK(st.st_mode)  ? "a block device"
                                            : "not a file";
  return invalid_argument(named + " is " + kind + ", not a regular file");
}

}  // namespace zo::io

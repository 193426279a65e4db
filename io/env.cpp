#include "io/env.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>

namespace zo::io {
namespace {

class PosixEnv final : public Env {
 public:
  Status write_file(const std::string& path, std::string_view bytes) override {
    const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd < 0) return errno_status("creating " + path, errno);
    Status s;
    for (size_t done = 0; done < bytes.size() && s.is_ok();) {
      const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
      if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
      if (n < 0) s = errno_status("writing " + path + " at offset " + std::to_string(done), errno);
      else if (n == 0) s = io_error("writing " + path + " at offset " + std::to_string(done) + ": no progress", EIO);
      else done += static_cast<size_t>(n);
    }
    if (s.is_ok() && ::fdatasync(fd) != 0) s = errno_status("fdatasync of " + path, errno);
    if (::close(fd) != 0 && s.is_ok()) s = errno_status("closing " + path, errno);
    if (!s.is_ok()) ::unlink(path.c_str());  // nothing half-written stays behind
    return s;
  }

  Status sync_dir(const std::string& dir) override {
    const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return errno_status("opening directory " + dir + " to fsync it", errno);
    Status s;
    if (::fsync(fd) != 0) s = errno_status("fsync of directory " + dir, errno);
    ::close(fd);
    return s;
  }

  Status rename(const std::string& from, const std::string& to) override {
    if (::rename(from.c_str(), to.c_str()) != 0) return errno_status("renaming " + from + " to " + to, errno);
    return Status::ok();
  }

  Status rename_or_exchange(const std::string& from, const std::string& to, bool* exchanged) override {
    *exchanged = false;
    if (::rename(from.c_str(), to.c_str()) == 0) return Status::ok();
    if (errno != EEXIST && errno != ENOTEMPTY) return errno_status("renaming " + from + " to " + to, errno);
    if (::renameat2(AT_FDCWD, from.c_str(), AT_FDCWD, to.c_str(), RENAME_EXCHANGE) == 0) {
      *exchanged = true;
      return Status::ok();
    }
    const int err = errno;
    if (err == EINVAL || err == ENOSYS || err == EOPNOTSUPP) {
      return Status(StatusCode::kAlreadyExists,
                    to + " already exists and this file system cannot swap directories atomically "
                         "(renameat2 RENAME_EXCHANGE: " + std::string(std::strerror(err)) + "): remove it first");
    }
    return errno_status("swapping " + from + " with the existing " + to, err);
  }

  Status make_dir(const std::string& path) override {
    if (::mkdir(path.c_str(), 0755) == 0) return Status::ok();
    const int err = errno;
    if (err == EEXIST) return Status(StatusCode::kAlreadyExists, "creating " + path + ": it exists already");
    return errno_status("creating " + path, err);
  }

  Status remove_all(const std::string& path) override {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
    if (ec) return errno_status("removing " + path, ec.value());
    return Status::ok();
  }
};

}  // namespace

Env* Env::posix() {
  static PosixEnv* env = new PosixEnv();  // never destroyed: usable from exit handlers
  return env;
}

FaultyEnv::FaultyEnv(Env* base, std::shared_ptr<FaultInjector> faults) : base_(base), faults_(std::move(faults)) {}

Status FaultyEnv::inject(const std::string& what, const std::string& path, IoOp op, uint64_t offset, uint64_t size) {
  const std::optional<FaultKind> kind = faults_->decide(path, op, offset, size);
  if (!kind) return Status::ok();
  switch (*kind) {
    case FaultKind::kEio: return errno_status(what + " (injected)", EIO);
    case FaultKind::kNoSpace: return errno_status(what + " (injected)", ENOSPC);
    case FaultKind::kShortTransfer:
    case FaultKind::kEagain:
    case FaultKind::kEintr: return Status::ok();  // transient: the real Env retries it
  }
  return Status::ok();
}

Status FaultyEnv::write_file(const std::string& path, std::string_view bytes) {
  // An injected failure returns before the base creates anything: the state a real failure
  // leaves, since write_file removes a partial file.
  ZO_RETURN_IF_ERROR(inject("creating " + path, path, IoOp::kCreate));
  ZO_RETURN_IF_ERROR(inject("writing " + path, path, IoOp::kWrite, 0, std::max<uint64_t>(bytes.size(), 1)));
  ZO_RETURN_IF_ERROR(inject("fdatasync of " + path, path, IoOp::kSync));
  return base_->write_file(path, bytes);
}

Status FaultyEnv::sync_dir(const std::string& dir) {
  ZO_RETURN_IF_ERROR(inject("fsync of directory " + dir, dir, IoOp::kSync));
  return base_->sync_dir(dir);
}

Status FaultyEnv::rename(const std::string& from, const std::string& to) {
  ZO_RETURN_IF_ERROR(inject("renaming " + from + " to " + to, from + " -> " + to, IoOp::kRename));
  return base_->rename(from, to);
}

Status FaultyEnv::rename_or_exchange(const std::string& from, const std::string& to, bool* exchanged) {
  *exchanged = false;
  ZO_RETURN_IF_ERROR(inject("renaming " + from + " to " + to, from + " -> " + to, IoOp::kRename));
  return base_->rename_or_exchange(from, to, exchanged);
}

Status FaultyEnv::make_dir(const std::string& path) {
  ZO_RETURN_IF_ERROR(inject("creating " + path, path, IoOp::kCreate));
  return base_->make_dir(path);
}

Status FaultyEnv::remove_all(const std::string& path) {
  ZO_RETURN_IF_ERROR(inject("removing " + path, path, IoOp::kRemove));
  return base_->remove_all(path);
}

}  // namespace zo::io

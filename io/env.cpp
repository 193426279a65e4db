#include "io/env.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <random>
#include <utility>

#include "io/file.h"

namespace zo::io {
namespace {

std::string at(uint64_t offset) { return " at offset " + std::to_string(offset); }

class PosixReadFile final : public ReadFile {
 public:
  PosixReadFile(int fd, std::string path, uint64_t size) : fd_(fd), path_(std::move(path)), size_(size) {}
  ~PosixReadFile() override { ::close(fd_); }
  PosixReadFile(const PosixReadFile&) = delete;
  PosixReadFile& operator=(const PosixReadFile&) = delete;

  const std::string& path() const override { return path_; }
  uint64_t size_bytes() const override { return size_; }

  Status read_exact(uint64_t offset_bytes, std::span<std::byte> out) override {
    size_t done = 0;
    while (done < out.size()) {
      const ssize_t n = ::pread(fd_, out.data() + done, out.size() - done, static_cast<off_t>(offset_bytes + done));
      if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
      if (n < 0) return errno_status("reading " + path_ + at(offset_bytes + done), errno);
      if (n == 0) {
        return Status(StatusCode::kCorruption, path_ + ": end of file" + at(offset_bytes + done) + ", " +
                                                   std::to_string(out.size() - done) + " bytes missing");
      }
      done += static_cast<size_t>(n);
    }
    return Status::ok();
  }

  void will_read_sequentially() override { ::posix_fadvise(fd_, 0, 0, POSIX_FADV_SEQUENTIAL); }
  void drop_cached(uint64_t offset_bytes, uint64_t length_bytes) override {
    ::posix_fadvise(fd_, static_cast<off_t>(offset_bytes), static_cast<off_t>(length_bytes), POSIX_FADV_DONTNEED);
  }

 private:
  int fd_;
  std::string path_;
  uint64_t size_;
};

class PosixAppendFile final : public AppendFile {
 public:
  PosixAppendFile(int fd, std::string path) : fd_(fd), path_(std::move(path)) {}
  ~PosixAppendFile() override { (void)close(); }
  PosixAppendFile(const PosixAppendFile&) = delete;
  PosixAppendFile& operator=(const PosixAppendFile&) = delete;

  const std::string& path() const override { return path_; }

  Status append(std::string_view bytes) override {
    if (fd_ < 0) return Status(StatusCode::kFailedPrecondition, "appending to " + path_ + ": it is closed");
    // One writer appends (O_APPEND), so the end before this append is where a failed one is cut.
    const off_t start = ::lseek(fd_, 0, SEEK_END);
    Status s;
    size_t done = 0;
    while (done < bytes.size() && s.is_ok()) {
      const ssize_t n = ::write(fd_, bytes.data() + done, bytes.size() - done);
      if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
      if (n < 0) s = errno_status("appending to " + path_, errno);
      else if (n == 0) s = io_error("appending to " + path_ + ": no progress", EIO);
      else done += static_cast<size_t>(n);
    }
    if (!s.is_ok() && done > 0 && start >= 0 && ::ftruncate(fd_, start) != 0)
      s = Status(s.code(), s.message() + "; cutting the torn record off again failed too: " + std::strerror(errno),
                 s.sys_errno());
    return s;
  }

  Status sync() override {
    if (fd_ < 0) return Status(StatusCode::kFailedPrecondition, "fdatasync of " + path_ + ": it is closed");
    int rc;
    do { rc = ::fdatasync(fd_); } while (rc != 0 && errno == EINTR);
    if (rc != 0) return errno_status("fdatasync of " + path_, errno);
    return Status::ok();
  }

  Status close() override {
    if (fd_ < 0) return Status::ok();
    if (::close(std::exchange(fd_, -1)) != 0 && errno != EINTR) return errno_status("closing " + path_, errno);
    return Status::ok();
  }

 private:
  int fd_;
  std::string path_;
};

// open(2) of a file check_regular_file accepted; the fstat after it closes the race with a file
// replaced in between. On success *size holds the file's size.
Result<int> open_regular(const std::string& path, std::string_view what, uint64_t* size) {
  ZO_RETURN_IF_ERROR(check_regular_file(path, what));
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    const int err = errno;
    if (err == ENOENT) return Status(StatusCode::kNotFound, std::string(what) + " " + path + ": no such file", err);
    return errno_status("opening " + path, err);
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    return errno_status("fstat " + path, err);
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return invalid_argument(std::string(what) + " " + path + " is not a regular file");
  }
  // O_NONBLOCK only kept open() from blocking; regular files ignore it, but clear it anyway.
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  *size = static_cast<uint64_t>(st.st_size);
  return fd;
}

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
                    to +
                        " already exists and this file system cannot swap directories atomically "
                        "(renameat2 RENAME_EXCHANGE: " +
                        std::string(std::strerror(err)) + "): remove it first");
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

  Result<std::unique_ptr<ReadFile>> open_read(const std::string& path, std::string_view what) override {
    uint64_t size = 0;
    ZO_ASSIGN_OR_RETURN(const int fd, open_regular(path, what, &size));
    return std::unique_ptr<ReadFile>(new PosixReadFile(fd, path, size));
  }

  Result<std::unique_ptr<AppendFile>> open_append(const std::string& path) override {
    const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (fd < 0) return errno_status("opening " + path + " to append", errno);
    return std::unique_ptr<AppendFile>(new PosixAppendFile(fd, path));
  }

  Result<File> open_file(const std::string& path, OpenMode mode, bool direct) override {
    return File::open(path, mode, direct);
  }

  Status make_dirs(const std::string& path, std::string* created_top) override {
    if (created_top) created_top->clear();
    std::filesystem::path normal = std::filesystem::path(path).lexically_normal();
    if (!normal.has_filename() && normal.has_parent_path()) normal = normal.parent_path();  // "a/b/" is "a/b"
    // The missing ancestors, innermost first.
    std::vector<std::filesystem::path> missing;
    for (std::filesystem::path p = normal; !p.empty(); p = p.parent_path()) {
      ZO_ASSIGN_OR_RETURN(const PathKind kind, path_kind(p.string()));
      if (kind == PathKind::kDirectory) break;
      if (kind != PathKind::kMissing) {
        return Status(StatusCode::kAlreadyExists,
                      "creating " + normal.string() + ": " + p.string() + " exists and is not a directory", ENOTDIR);
      }
      missing.push_back(p);
      if (p == p.parent_path()) break;
    }
    for (auto it = missing.rbegin(); it != missing.rend(); ++it) {
      if (::mkdir(it->c_str(), 0755) != 0) {
        const int err = errno;
        if (err == EEXIST) continue;  // made meanwhile by someone else: fine when a directory
        return errno_status("creating " + it->string(), err);
      }
      if (created_top && created_top->empty()) *created_top = it->string();
    }
    return Status::ok();
  }

  Result<PathKind> path_kind(const std::string& path) override {
    struct stat st {};
    if (::stat(path.c_str(), &st) != 0) {
      const int err = errno;
      if (err == ENOENT || err == ENOTDIR) return PathKind::kMissing;
      return errno_status("stat " + path, err);
    }
    if (S_ISREG(st.st_mode)) return PathKind::kFile;
    if (S_ISDIR(st.st_mode)) return PathKind::kDirectory;
    return PathKind::kOther;
  }

  Result<uint64_t> file_size(const std::string& path) override {
    struct stat st {};
    if (::stat(path.c_str(), &st) != 0) return errno_status("stat " + path, errno);
    return static_cast<uint64_t>(st.st_size);
  }

  Result<std::vector<std::string>> list_dir(const std::string& dir) override {
    DIR* d = ::opendir(dir.c_str());
    if (d == nullptr) return errno_status("listing " + dir, errno);
    std::vector<std::string> names;
    errno = 0;
    while (const dirent* e = ::readdir(d)) {
      const std::string_view name = e->d_name;
      if (name != "." && name != "..") names.emplace_back(name);
      errno = 0;
    }
    const int err = errno;
    ::closedir(d);
    if (err != 0) return errno_status("listing " + dir, err);
    std::sort(names.begin(), names.end());
    return names;
  }

  Result<uint64_t> free_bytes(const std::string& path) override {
    struct statvfs s {};
    if (::statvfs(path.c_str(), &s) != 0) return errno_status("statvfs " + path, errno);
    return static_cast<uint64_t>(s.f_bavail) * s.f_frsize;
  }

  Result<std::string> canonical_path(const std::string& path) override {
    std::error_code ec;
    const std::filesystem::path p = std::filesystem::weakly_canonical(std::filesystem::absolute(path, ec), ec);
    if (ec) return errno_status("resolving " + path, ec.value());
    return p.string();
  }
};

// FaultyEnv's files: each read, append or sync asks the rules first.
class FaultyReadFile final : public ReadFile {
 public:
  FaultyReadFile(std::unique_ptr<ReadFile> base, FaultyEnv* env) : base_(std::move(base)), env_(env) {}
  const std::string& path() const override { return base_->path(); }
  uint64_t size_bytes() const override { return base_->size_bytes(); }
  Status read_exact(uint64_t offset_bytes, std::span<std::byte> out) override {
    ZO_RETURN_IF_ERROR(env_->inject("reading " + path() + at(offset_bytes), path(), IoOp::kRead, offset_bytes,
                                    std::max<uint64_t>(out.size(), 1)));
    return base_->read_exact(offset_bytes, out);
  }
  void will_read_sequentially() override { base_->will_read_sequentially(); }
  void drop_cached(uint64_t offset_bytes, uint64_t length_bytes) override {
    base_->drop_cached(offset_bytes, length_bytes);
  }

 private:
  std::unique_ptr<ReadFile> base_;
  FaultyEnv* env_;
};

class FaultyAppendFile final : public AppendFile {
 public:
  FaultyAppendFile(std::unique_ptr<AppendFile> base, FaultyEnv* env) : base_(std::move(base)), env_(env) {}
  const std::string& path() const override { return base_->path(); }
  Status append(std::string_view bytes) override {
    ZO_RETURN_IF_ERROR(
        env_->inject("appending to " + path(), path(), IoOp::kWrite, appended_, std::max<uint64_t>(bytes.size(), 1)));
    ZO_RETURN_IF_ERROR(base_->append(bytes));
    appended_ += bytes.size();
    return Status::ok();
  }
  Status sync() override {
    ZO_RETURN_IF_ERROR(env_->inject("fdatasync of " + path(), path(), IoOp::kSync));
    return base_->sync();
  }
  Status close() override { return base_->close(); }

 private:
  std::unique_ptr<AppendFile> base_;
  FaultyEnv* env_;
  uint64_t appended_ = 0;  // by this handle: a rule's offset counts from where it opened
};

}  // namespace

Result<std::string> Env::read_file(const std::string& path, std::string_view what, uint64_t max_bytes) {
  ZO_ASSIGN_OR_RETURN(std::unique_ptr<ReadFile> file, open_read(path, what));
  const uint64_t size = file->size_bytes();
  if (size > max_bytes) {
    return Status(StatusCode::kInvalidArgument,
                  std::string(what) + " " + path + " is " + std::to_string(size) + " bytes, over the " +
                      std::to_string(max_bytes) + "-byte limit",
                  EFBIG);
  }
  std::string bytes(size, '\0');
  ZO_RETURN_IF_ERROR(file->read_exact(0, std::as_writable_bytes(std::span(bytes))));
  return bytes;
}

Status Env::check_output_file(const std::string& path, std::string_view what) {
  ZO_ASSIGN_OR_RETURN(const PathKind kind, path_kind(path));
  if (kind == PathKind::kDirectory)
    return Status(StatusCode::kInvalidArgument,
                  std::string(what) + " " + path + " is a directory: give the path of a file", EISDIR);
  if (kind == PathKind::kOther) return invalid_argument(std::string(what) + " " + path + " is not a regular file");
  if (kind == PathKind::kFile) return Status::ok();
  // Missing: its nearest existing ancestor must be a directory.
  const std::filesystem::path normal = std::filesystem::path(path).lexically_normal();
  for (std::filesystem::path p = normal.parent_path(); !p.empty(); p = p.parent_path()) {
    ZO_ASSIGN_OR_RETURN(const PathKind up, path_kind(p.string()));
    if (up == PathKind::kDirectory) return Status::ok();
    if (up != PathKind::kMissing)
      return Status(StatusCode::kInvalidArgument,
                    std::string(what) + " " + path + ": " + p.string() + " is not a directory", ENOTDIR);
    if (p == p.parent_path()) break;
  }
  return Status::ok();
}

Status Env::publish_file(const std::string& path, std::string_view bytes, std::string_view what) {
  ZO_RETURN_IF_ERROR(check_output_file(path, what));
  const std::filesystem::path normal = std::filesystem::path(path).lexically_normal();
  const std::string parent = normal.has_parent_path() ? normal.parent_path().string() : ".";
  ZO_RETURN_IF_ERROR(make_dirs(parent).with_context(std::string(what) + " " + path));
  // A name nothing else uses; write_file creates it (O_EXCL), so nothing already there is touched.
  std::random_device rd;
  char suffix[17];
  std::snprintf(suffix, sizeof suffix, "%08x%08x", rd(), rd());
  const std::string tmp = normal.string() + ".tmp-" + suffix;
  ZO_RETURN_IF_ERROR(write_file(tmp, bytes).with_context(std::string(what)));
  // rename(2) replaces a file and never a directory (EISDIR), whatever appeared since the check.
  if (Status s = rename(tmp, normal.string()); !s.is_ok()) {
    (void)remove_all(tmp);
    return s.with_context(std::string(what));
  }
  return sync_dir(parent).with_context(std::string(what));
}

Result<std::unique_ptr<AppendFile>> Env::open_fresh_append(const std::string& path, std::string_view what) {
  ZO_RETURN_IF_ERROR(publish_file(path, "", what));
  return open_append(path);
}

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

Result<std::unique_ptr<ReadFile>> FaultyEnv::open_read(const std::string& path, std::string_view what) {
  ZO_ASSIGN_OR_RETURN(std::unique_ptr<ReadFile> file, base_->open_read(path, what));
  return std::unique_ptr<ReadFile>(new FaultyReadFile(std::move(file), this));
}

Result<std::unique_ptr<AppendFile>> FaultyEnv::open_append(const std::string& path) {
  ZO_RETURN_IF_ERROR(inject("opening " + path + " to append", path, IoOp::kCreate));
  ZO_ASSIGN_OR_RETURN(std::unique_ptr<AppendFile> file, base_->open_append(path));
  return std::unique_ptr<AppendFile>(new FaultyAppendFile(std::move(file), this));
}

Result<File> FaultyEnv::open_file(const std::string& path, OpenMode mode, bool direct) {
  ZO_RETURN_IF_ERROR(inject("open " + path, path, IoOp::kOpen));
  return base_->open_file(path, mode, direct);
}

Status FaultyEnv::make_dirs(const std::string& path, std::string* created_top) {
  if (created_top) created_top->clear();
  ZO_RETURN_IF_ERROR(inject("creating " + path, path, IoOp::kCreate));
  return base_->make_dirs(path, created_top);
}

Result<PathKind> FaultyEnv::path_kind(const std::string& path) { return base_->path_kind(path); }
Result<uint64_t> FaultyEnv::file_size(const std::string& path) { return base_->file_size(path); }
Result<std::vector<std::string>> FaultyEnv::list_dir(const std::string& dir) { return base_->list_dir(dir); }
Result<uint64_t> FaultyEnv::free_bytes(const std::string& path) { return base_->free_bytes(path); }
Result<std::string> FaultyEnv::canonical_path(const std::string& path) { return base_->canonical_path(path); }

Status require_env(const Env* env, std::string_view field) {
  if (env != nullptr) return Status::ok();
  return invalid_argument(std::string(field) +
                          " is null: pass the io::Env the files go through (io::Env::posix(), or a test's FaultyEnv)");
}

}  // namespace zo::io

// Env: every file operation other than the async engine's block reads and writes — opening the
// engine's files, files read at any offset or whole, files written whole or appended to, directory
// fsyncs, renames, directory creation, listing and removal, file kinds and free space — behind one
// interface, so a test can make any of them fail (FaultyEnv) the way FaultInjector makes the
// engine's requests fail. Env::posix() is the real one. Nothing above io/ calls a file syscall or
// File::open (tests/lint_file_syscalls.py).
// Env implementations are thread-safe, and so is ReadFile::read_exact; the other file methods are
// used by one thread at a time. Errors carry the path and errno text ("<op> PATH: <strerror>") and
// keep the errno's StatusCode.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "io/fault_injector.h"
#include "io/file.h"

namespace zo::io {

// A regular file opened for reading (Env::open_read); closed by destruction. read_exact may be
// called from several threads at once (it is pread).
class ReadFile {
 public:
  virtual ~ReadFile() = default;
  virtual const std::string& path() const = 0;
  // The size when it was opened.
  virtual uint64_t size_bytes() const = 0;
  // Reads exactly out.size() bytes at `offset_bytes` (short reads continued, EINTR and EAGAIN
  // retried). A file that ends first is kCorruption "PATH: end of file at offset X, N bytes
  // missing"; a failed read is "reading PATH at offset X: <strerror>".
  virtual Status read_exact(uint64_t offset_bytes, std::span<std::byte> out) = 0;
  // Hints, never errors: the file will be read front to back; [offset, offset + length) will not
  // be read again, so the page cache may drop it.
  virtual void will_read_sequentially() = 0;
  virtual void drop_cached(uint64_t offset_bytes, uint64_t length_bytes) = 0;
};

// A file written at its end (Env::open_append): created when missing, kept when present. Not
// thread-safe. Destruction closes without reporting; call close() to see a deferred error.
// An append that fails part way (EFBIG past `ulimit -f`, ENOSPC, EIO) is cut back off the file,
// so the file never ends in a torn record.
class AppendFile {
 public:
  virtual ~AppendFile() = default;
  virtual const std::string& path() const = 0;
  // Writes `bytes` whole at the end (short writes continued, EINTR and EAGAIN retried).
  virtual Status append(std::string_view bytes) = 0;
  // fdatasync.
  virtual Status sync() = 0;
  virtual Status close() = 0;
};

enum class PathKind : uint8_t { kMissing, kFile, kDirectory, kOther };

class Env {
 public:
  virtual ~Env() = default;

  // The process's POSIX Env (never null, never destroyed).
  static Env* posix();

  // Creates `path` (it must not exist), writes `bytes` whole (EINTR retried), fdatasyncs and
  // closes it. On any failure the partial file is removed, so a failed write leaves nothing.
  virtual Status write_file(const std::string& path, std::string_view bytes) = 0;
  // fsync of a directory, after entries in it were created, renamed or removed.
  virtual Status sync_dir(const std::string& dir) = 0;
  // rename(2): atomically replaces `to` when it is a file or an empty directory.
  virtual Status rename(const std::string& from, const std::string& to) = 0;
  // Moves `from` to `to` in one atomic step; when `to` is a non-empty directory the two are swapped
  // with renameat2(RENAME_EXCHANGE) and *exchanged is set (`from` then holds the old contents).
  // kAlreadyExists naming `to` on a file system without RENAME_EXCHANGE. The caller fsyncs the parent.
  virtual Status rename_or_exchange(const std::string& from, const std::string& to, bool* exchanged) = 0;
  // mkdir(2) of one directory, mode 0755; kAlreadyExists when it exists.
  virtual Status make_dir(const std::string& path) = 0;
  // Removes a file or a directory tree; a missing path is not an error.
  virtual Status remove_all(const std::string& path) = 0;

  // Opens a regular file for reading. `what` names the input in errors ("config file", ...): a
  // missing file is kNotFound "<what> PATH: no such file"; a FIFO, socket, device or directory is
  // refused without opening it (kInvalidArgument "<what> PATH is a FIFO (named pipe), not a
  // regular file"): reading one would block forever or never end.
  virtual Result<std::unique_ptr<ReadFile>> open_read(const std::string& path, std::string_view what) = 0;
  // Opens `path` for appending, creating it (0644) when missing.
  virtual Result<std::unique_ptr<AppendFile>> open_append(const std::string& path) = 0;
  // Opens `path` as a File for the I/O engine (swap, checkpoint and export files) or for a lock:
  // File::open(path, mode, direct), with its O_DIRECT fallback and its errors ("open PATH:
  // <strerror>", kAlreadyExists for kCreateNew on an existing path). The File's reads and writes
  // go through the IoEngine (and its FaultInjector); its preallocate, truncate, sync and lock are
  // the File's own.
  virtual Result<File> open_file(const std::string& path, OpenMode mode, bool direct) = 0;
  // mkdir -p: creates `path` and any missing parents (0755); an existing directory is not an
  // error. When `created_top` is given it receives the outermost directory this call created
  // (empty when none), so a caller can remove what it made.
  virtual Status make_dirs(const std::string& path, std::string* created_top = nullptr) = 0;
  // What `path` names, symlinks followed. kMissing for ENOENT and ENOTDIR; other stat errors fail.
  virtual Result<PathKind> path_kind(const std::string& path) = 0;
  // The size of the file `path` names (symlinks followed).
  virtual Result<uint64_t> file_size(const std::string& path) = 0;
  // The names of a directory's entries, without "." and "..", sorted.
  virtual Result<std::vector<std::string>> list_dir(const std::string& dir) = 0;
  // Bytes available to an unprivileged user on the file system holding `path`, which must exist.
  virtual Result<uint64_t> free_bytes(const std::string& path) = 0;
  // `path` made absolute with its symlinks, "." and ".." resolved as far as it exists (the rest
  // appended as written): two spellings of one directory give one string.
  virtual Result<std::string> canonical_path(const std::string& path) = 0;

  // Reads a whole regular file of at most `max_bytes` through open_read; a larger one is
  // kInvalidArgument "<what> PATH is N bytes, over the M-byte limit" with errno EFBIG (so a caller
  // for whom it means a damaged file can tell it from a FIFO), refused before reading.
  Result<std::string> read_file(const std::string& path, std::string_view what, uint64_t max_bytes);

  // Note [Output files]: a path the user names for a file this run writes (a trace, the metrics,
  // a monitor's file) is checked before any work, and is only ever created or replaced whole by
  // publish_file; nothing that is not a regular file is ever removed for it.
  // check_output_file: ok when `path` is missing (with its nearest existing ancestor a directory,
  // so the missing parents can be made) or a regular file; otherwise kInvalidArgument, one line:
  // "<what> PATH is a directory: give the path of a file", "<what> PATH is not a regular file" (a
  // FIFO, socket or device), "<what> PATH: A is not a directory" (an ancestor).
  Status check_output_file(const std::string& path, std::string_view what);
  // Creates or replaces the regular file `path` with `bytes`: check_output_file, the missing parent
  // directories made, the bytes written to a new PATH.tmp-<random> beside it (write_file: fdatasynced), renamed
  // over `path` and the parent fsynced. On failure `path` is as it was and the temporary is removed.
  Status publish_file(const std::string& path, std::string_view bytes, std::string_view what);
  // Opens `path` to append to, as a new empty file: an existing regular file is replaced by
  // publishing an empty one over it (never truncated in place, never removed when it is anything
  // else). Errors as publish_file's.
  Result<std::unique_ptr<AppendFile>> open_fresh_append(const std::string& path, std::string_view what);
};

// An Env that fails the operations `faults` chooses and passes every other one to `base`. Rules
// match on the path (a rename's is "FROM -> TO") and on the op: IoOp::kCreate (creating a file or
// directory, opening one to append), kOpen (open_file, in any mode: nothing is created or opened
// when it fails), kWrite (a file's bytes, written whole or appended; the rule's offset picks the
// byte), kRead (a ReadFile's bytes, or mapping a file: offset 0), kSync (fdatasync of a file, fsync
// of a directory), kRename, kRemove. kEio and kNoSpace fail the operation with EIO or ENOSPC as the
// kernel would (a failed write_file leaves no file); kShortTransfer, kEagain and kEintr are
// transient and retried, as the POSIX Env retries them. Queries (path_kind, file_size, list_dir,
// free_bytes) are passed through.
class FaultyEnv final : public Env {
 public:
  FaultyEnv(Env* base, std::shared_ptr<FaultInjector> faults);

  Status write_file(const std::string& path, std::string_view bytes) override;
  Status sync_dir(const std::string& dir) override;
  Status rename(const std::string& from, const std::string& to) override;
  Status rename_or_exchange(const std::string& from, const std::string& to, bool* exchanged) override;
  Status make_dir(const std::string& path) override;
  Status remove_all(const std::string& path) override;
  Result<std::unique_ptr<ReadFile>> open_read(const std::string& path, std::string_view what) override;
  Result<std::unique_ptr<AppendFile>> open_append(const std::string& path) override;
  Result<File> open_file(const std::string& path, OpenMode mode, bool direct) override;
  Status make_dirs(const std::string& path, std::string* created_top = nullptr) override;
  Result<PathKind> path_kind(const std::string& path) override;
  Result<uint64_t> file_size(const std::string& path) override;
  Result<std::vector<std::string>> list_dir(const std::string& dir) override;
  Result<uint64_t> free_bytes(const std::string& path) override;
  Result<std::string> canonical_path(const std::string& path) override;

  // The error a rule injects into `op` on `path` at [offset, offset + size), or ok.
  Status inject(const std::string& what, const std::string& path, IoOp op, uint64_t offset = 0, uint64_t size = 1);

 private:
  Env* base_;
  std::shared_ptr<FaultInjector> faults_;
};

// Every engine call that touches files takes its Env explicitly, with no default, so a caller that
// forgets it does not compile — or, for an options struct's `env` member (default nullptr), is
// refused here: InvalidArgument naming `field` when `env` is null, before anything is touched.
Status require_env(const Env* env, std::string_view field);

}  // namespace zo::io

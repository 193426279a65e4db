// Env: the file operations other than the async engine's block reads and writes — small files
// written whole, directory fsyncs, renames, directory creation and removal — behind one interface,
// so a test can make any of them fail (FaultyEnv) the way FaultInjector makes the engine's requests
// fail. Env::posix() is the real one. Implementations are thread-safe; errors carry the path and
// errno text ("<op> PATH: <strerror>") and keep the errno's StatusCode (ENOSPC is kNoSpace).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "common/status.h"
#include "io/fault_injector.h"

namespace zo::io {

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
};

// An Env that fails the operations `faults` chooses and passes every other one to `base`. Rules
// match on the path (a rename's is "FROM -> TO") and on the op: IoOp::kCreate (creating a file or
// directory), kWrite (a file's bytes; the rule's offset picks the byte), kSync (fdatasync of a file
// written by write_file, fsync of a directory), kRename, kRemove. kEio and kNoSpace fail the
// operation with EIO or ENOSPC as the kernel would (a failed write_file leaves no file);
// kShortTransfer, kEagain and kEintr are transient and retried, as the POSIX Env retries them.
class FaultyEnv final : public Env {
 public:
  FaultyEnv(Env* base, std::shared_ptr<FaultInjector> faults);

  Status write_file(const std::string& path, std::string_view bytes) override;
  Status sync_dir(const std::string& dir) override;
  Status rename(const std::string& from, const std::string& to) override;
  Status rename_or_exchange(const std::string& from, const std::string& to, bool* exchanged) override;
  Status make_dir(const std::string& path) override;
  Status remove_all(const std::string& path) override;

 private:
  // The error a rule injects into `op` on `path` at [offset, offset + size), or ok.
  Status inject(const std::string& what, const std::string& path, IoOp op, uint64_t offset = 0, uint64_t size = 1);

  Env* base_;
  std::shared_ptr<FaultInjector> faults_;
};

}  // namespace zo::io

// The run's output directories and their locks (run_dir.h), and the public lock_run_dir and
// remove_if_only_locks (trainer.h).
#include "engine/train/run_dir.h"

#include <cerrno>
#include <filesystem>
#include <functional>

#include "common/log.h"
#include "engine/train/trainer.h"

namespace zo::engine {
namespace {

namespace fs = std::filesystem;

// Locks `dir` (created when missing) with an exclusive flock on DIR/.zoffload.lock for as long as
// the returned file is open (Note [One run per run directory]). `what` names it in messages,
// `instead` says what to do when another run holds it.
Result<std::shared_ptr<io::File>> lock_dir(const std::string& dir, const std::string& what, const std::string& instead,
                                           io::Env* env, std::string* created_top = nullptr) {
  ZO_RETURN_IF_ERROR(env->make_dirs(dir, created_top).with_context("creating " + what + " " + dir));
  const std::string path = dir + "/.zoffload.lock";
  ZO_ASSIGN_OR_RETURN(io::File file, env->open_file(path, io::OpenMode::kCreate, /*direct=*/false));
  if (Status st = file.lock_exclusive(); !st.is_ok()) {
    const int err = st.sys_errno();
    if (st.code() != StatusCode::kFailedPrecondition && (err == ENOSYS || err == ENOLCK || err == EOPNOTSUPP)) {
      // A file system without flock (Lustre without -o flock, NFS without lockd): the run goes on
      // unguarded rather than not at all.
      ZO_LOG(kWarn) << "cannot lock " << what << " " << dir << " (" << st.message()
                    << "): nothing stops a second run on it";
      return std::make_shared<io::File>(std::move(file));
    }
    if (st.code() != StatusCode::kFailedPrecondition) return st.with_context("locking " + what + " " + dir);
    return failed_precondition(what + " " + dir + " is in use by another zoffload run (it holds " + path +
                               "): wait for that run to end, or " + instead);
  }
  return std::make_shared<io::File>(std::move(file));
}

// Two spellings of one directory compare equal (".", "./ckpt/..", symlinks).
std::string canonical_dir(io::Env* env, const std::string& dir) {
  Result<std::string> p = env->canonical_path(dir.empty() ? "." : dir);
  return p.is_ok() ? *p : fs::absolute(dir.empty() ? "." : dir).lexically_normal().string();
}

}  // namespace

Result<std::shared_ptr<io::File>> lock_run_dir(const std::string& out_dir_or_empty, io::Env* env,
                                               std::string* created_top) {
  const std::string out_dir = out_dir_or_empty.empty() ? "." : out_dir_or_empty;
  return lock_dir(out_dir, "run directory", "give this one another --out", env, created_top);
}

Status remove_if_only_locks(const std::string& dir, io::Env* env) {
  ZO_ASSIGN_OR_RETURN(const io::PathKind kind, env->path_kind(dir));
  if (kind != io::PathKind::kDirectory) return Status::ok();
  // Whether the tree under `d` holds only directories and lock files.
  std::function<Result<bool>(const std::string&)> only_locks = [&](const std::string& d) -> Result<bool> {
    ZO_ASSIGN_OR_RETURN(const std::vector<std::string> names, env->list_dir(d));
    for (const std::string& name : names) {
      ZO_ASSIGN_OR_RETURN(const io::PathKind k, env->path_kind(d + "/" + name));
      if (k == io::PathKind::kDirectory) {
        ZO_ASSIGN_OR_RETURN(const bool only, only_locks(d + "/" + name));
        if (!only) return false;
      } else if (name != ".zoffload.lock" || k != io::PathKind::kFile) {
        return false;
      }
    }
    return true;
  };
  ZO_ASSIGN_OR_RETURN(const bool only, only_locks(dir));
  return only ? env->remove_all(dir) : Status::ok();
}

OutputLocks::OutputLocks(std::string out_dir, std::shared_ptr<io::File> run_dir_lock)
    : out_dir_(std::move(out_dir)), run_dir_lock_(std::move(run_dir_lock)) {}

Status OutputLocks::lock_run_dir(bool lock, io::Env* env) {
  if (lock && !run_dir_lock_) {
    std::string created;
    ZO_ASSIGN_OR_RETURN(run_dir_lock_, engine::lock_run_dir(out_dir_, env, &created));
    if (!created.empty()) created_dirs_.push_back(created);
  } else if (!out_dir_.empty()) {
    ZO_RETURN_IF_ERROR(env->make_dirs(out_dir_).with_context("creating the run directory " + out_dir_));
  }
  return Status::ok();
}

Status OutputLocks::lock_output_dir(const std::string& dir, const std::string& what, bool inside_out_too,
                                    io::Env* env) {
  // --out's own lock covers it (a second lock of the same file by this process would conflict).
  const std::string canonical = canonical_dir(env, dir);
  const std::string out = canonical_dir(env, out_dir_);
  if (canonical == out) return Status::ok();
  if (!inside_out_too && canonical.starts_with(out + "/")) return Status::ok();
  for (const auto& held : locks_)
    if (canonical_dir(env, fs::path(held->path()).parent_path().string()) == canonical) return Status::ok();
  std::string created;
  ZO_ASSIGN_OR_RETURN(std::shared_ptr<io::File> lock,
                      lock_dir(dir, what, "give this run another " + what + " (or another --out)", env, &created));
  locks_.push_back(std::move(lock));
  if (!created.empty()) created_dirs_.push_back(created);
  return Status::ok();
}

}  // namespace zo::engine

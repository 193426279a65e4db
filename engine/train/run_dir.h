// The run's output directories and their locks (Note [One run per run directory] in trainer.cpp):
// --out's, and each output directory a config can put outside it, locked by rank 0 for the whole
// run, with the directories those locks created. Includes no LibTorch. Not thread-safe.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "common/status.h"
#include "io/env.h"
#include "io/file.h"

namespace zo::engine {

class OutputLocks {
 public:
  // `run_dir_lock`: --out's lock when the caller took it already (TrainOptions::run_dir_lock), else
  // null.
  OutputLocks(std::string out_dir, std::shared_ptr<io::File> run_dir_lock);

  // Rank 0 (`lock`): locks --out unless the caller holds its lock; the other ranks only create it.
  Status lock_run_dir(bool lock, io::Env* env);
  // Locks `dir` unless it is --out, or lies inside --out and not `inside_out_too`, or is locked
  // already; `what` names it in messages.
  Status lock_output_dir(const std::string& dir, const std::string& what, bool inside_out_too, io::Env* env);
  // The topmost directory each lock created (Env::make_dirs), for a run that fails at start to
  // remove once the locks are closed (remove_if_only_locks).
  std::vector<std::string> take_created_dirs() { return std::move(created_dirs_); }

 private:
  std::string out_dir_;
  std::shared_ptr<io::File> run_dir_lock_;
  std::vector<std::shared_ptr<io::File>> locks_;  // beside --out's
  std::vector<std::string> created_dirs_;
};

}  // namespace zo::engine

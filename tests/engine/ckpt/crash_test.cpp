// A real process (crash_child) saving checkpoints of a store on NVMe is killed with SIGKILL, at
// every phase of a save and at random moments: after every kill `latest` names a complete
// checkpoint that verifies and loads with exactly its generation's states, every step-<N> directory
// verifies, `latest` never goes back, and the next start removes what the killed save left.
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "common/aligned_buffer.h"
#include "engine/ckpt/checkpoint.h"
#include "tests/engine/ckpt/ckpt_rig.h"
#include "tests/engine/temp_dir.h"

extern char** environ;

namespace zo::engine {
namespace {

namespace fs = std::filesystem;

const char* child_path() { return std::getenv("ZO_CKPT_CRASH_CHILD"); }

// A running crash_child with its stdout on a pipe.
struct Child {
  pid_t pid = -1;
  int out = -1;
  std::string buffered;

  static Child spawn(const std::vector<std::string>& args) {
    Child c;
    int fds[2];
    ZO_CHECK(::pipe(fds) == 0);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, fds[1], 1);
    posix_spawn_file_actions_addclose(&fa, fds[0]);
    std::vector<char*> argv;
    for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    ZO_CHECK(posix_spawn(&c.pid, args[0].c_str(), &fa, nullptr, argv.data(), environ) == 0) << args[0];
    posix_spawn_file_actions_destroy(&fa);
    ::close(fds[1]);
    c.out = fds[0];
    return c;
  }
  // The next line of output; empty at EOF.
  std::string line() {
    for (;;) {
      const size_t nl = buffered.find('\n');
      if (nl != std::string::npos) {
        std::string l = buffered.substr(0, nl);
        buffered.erase(0, nl + 1);
        return l;
      }
      char buf[4096];
      const ssize_t n = ::read(out, buf, sizeof buf);
      if (n <= 0) {
        std::string rest = std::move(buffered);
        buffered.clear();
        return rest;
      }
      buffered.append(buf, static_cast<size_t>(n));
    }
  }
  std::vector<std::string> rest() {
    std::vector<std::string> lines;
    for (std::string l = line(); !l.empty(); l = line()) lines.push_back(l);
    return lines;
  }
  int wait() {
    int status = 0;
    ZO_CHECK(::waitpid(pid, &status, 0) == pid);
    ::close(out);
    return status;
  }
};

// "phase 7 renamed" -> "phase renamed", "begin 7" -> "begin": where in a save a line was printed.
std::string kind_of(const std::string& line) {
  std::istringstream in(line);
  std::string word, gen, rest;
  in >> word >> gen >> rest;
  return word == "phase" ? word + " " + rest : word;
}

// What the checkpoint directory must look like after any kill; returns latest's step.
uint64_t check_invariants(const std::string& dir, uint64_t previous_latest) {
  const std::string ckpt = dir + "/ckpt";
  auto latest = resolve_checkpoint(ckpt, io::Env::posix());
  EXPECT_TRUE(latest.is_ok()) << latest.status().to_string();
  if (!latest.is_ok()) return previous_latest;
  auto io = io::IoEngine::create(io::IoOptions{});
  auto staging = AlignedBuffer::allocate(uint64_t{4} << 20);
  // Every step directory (latest's and the one kept before it) is complete.
  for (const auto& e : fs::directory_iterator(ckpt)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("step-", 0) != 0) continue;
    auto info = open_checkpoint(e.path().string(), io::Env::posix());
    EXPECT_TRUE(info.is_ok()) << name << ": " << info.status().to_string();
    if (info.is_ok()) {
      EXPECT_TRUE(verify_checkpoint(*info, **io, staging->bytes(), io::Env::posix()).is_ok()) << name;
    }
  }
  auto info = open_checkpoint(*latest, io::Env::posix());
  EXPECT_TRUE(info.is_ok());
  if (!info.is_ok()) return previous_latest;
  const uint64_t step = info->state.steps_done;
  EXPECT_GE(step, previous_latest) << "latest went back";
  // It loads, and holds exactly generation `step`.
  TempDir swap("zo_crash_load");
  testing::Rig rig;
  EXPECT_TRUE(rig.init({.optimizer = "cpu", .param = "cpu", .sub_group_size = 100000}, swap.path, 40).is_ok());
  Status s = load_checkpoint(*info, *rig.store, *rig.io, staging->bytes(), io::Env::posix());
  EXPECT_TRUE(s.is_ok()) << s.to_string();
  testing::Rig expect;
  EXPECT_TRUE(expect.init({.optimizer = "cpu", .param = "cpu", .sub_group_size = 100000}, swap.path + "x", 40).is_ok());
  EXPECT_TRUE(expect.fill(step).is_ok());
  for (StateKind kind : {StateKind::kMaster, StateKind::kExpAvg, StateKind::kExpAvgSq, StateKind::kCompute}) {
    EXPECT_TRUE(rig.gather(kind) == expect.gather(kind)) << "step " << step << " " << state_name(kind);
  }
  return step;
}

TEST(CrashDuringSave, EveryPhaseAndRandomKillsLeaveALoadableLatest) {
  if (child_path() == nullptr) GTEST_SKIP() << "ZO_CKPT_CRASH_CHILD is not set (run through meson test)";
  TempDir dir("zo_crash");
  const std::string child = child_path();

  // A first, complete save, and how long a save takes.
  Child first = Child::spawn({child, dir.path, "--max-saves", "3"});
  std::vector<double> save_s;
  for (const std::string& l : first.rest()) {
    double secs = 0;
    unsigned long long gen = 0;
    if (std::sscanf(l.c_str(), "end %llu %lf", &gen, &secs) == 2) save_s.push_back(secs);
  }
  ASSERT_EQ(first.wait(), 0);
  ASSERT_EQ(save_s.size(), 3u);
  std::sort(save_s.begin(), save_s.end());
  const double save_median = save_s[1];
  uint64_t latest = check_invariants(dir.path, 0);
  EXPECT_EQ(latest, 3u);

  // Phase-targeted kills: phases 9..16 are the 8 phase callbacks of the second save of a run
  // (started, 3 state files, manifest, renamed, latest, pruned).
  std::map<std::string, int> killed_at;
  int trials = 0;
  // Each kill must land where it was aimed: the last line the child printed is that phase.
  const char* kPhases[] = {"started",          "state-file-done", "state-file-done", "state-file-done",
                           "manifest-written", "renamed",         "latest-updated",  "pruned"};
  for (int phase = 9; phase <= 16; ++phase) {
    SCOPED_TRACE("kill at phase callback " + std::to_string(phase));
    Child c = Child::spawn({child, dir.path, "--kill-at-phase", std::to_string(phase)});
    std::vector<std::string> lines = c.rest();
    const int status = c.wait();
    ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << "status " << status;
    ASSERT_FALSE(lines.empty());
    EXPECT_EQ(kind_of(lines.back()), std::string("phase ") + kPhases[phase - 9]) << "the kill landed elsewhere";
    ++killed_at[kind_of(lines.back())];
    latest = check_invariants(dir.path, latest);
    ++trials;
  }

  // Random kills: at a random moment of a save (the 1st to 3rd of the run, a uniform fraction of
  // 1.2 median saves after its "begin"), so the kills spread over the save's phases by time.
  std::mt19937 rng(20261121);
  std::uniform_real_distribution<double> when(0.0, 1.2 * save_median);
  std::uniform_int_distribution<int> which(1, 3);
  int mid_save = 0;
  for (int t = 0; t < 24; ++t) {
    Child c = Child::spawn({child, dir.path});
    std::vector<std::string> seen;
    const int target = which(rng);
    for (int begins = 0; begins < target;) {
      std::string l = c.line();
      ASSERT_FALSE(l.empty()) << "the child ended early";
      if (l.rfind("begin", 0) == 0) ++begins;
      seen.push_back(std::move(l));
    }
    std::this_thread::sleep_for(std::chrono::duration<double>(when(rng)));
    ::kill(c.pid, SIGKILL);
    std::vector<std::string> lines = c.rest();
    lines.insert(lines.begin(), seen.begin(), seen.end());
    const int status = c.wait();
    ASSERT_TRUE(WIFSIGNALED(status)) << "status " << status;
    if (!lines.empty()) {
      const std::string& last = lines.back();
      const std::string kind = kind_of(last);
      if (kind == "begin" || kind.rfind("phase", 0) == 0) ++mid_save;  // between "begin" and "end" of a save
      ++killed_at[kind_of(last)];
    }
    latest = check_invariants(dir.path, latest);
    ++trials;
  }
  std::ostringstream where;
  for (const auto& [k, n] : killed_at) where << k << ": " << n << "; ";
  std::printf("%d kills (median save %.3f s), %d random ones mid-save; last line before each kill: %s\n", trials,
              save_median, mid_save, where.str().c_str());
  // Where the random kills land depends on timing (reported above, not asserted); the 8 kills at
  // the phase callbacks cover every phase deterministically (each checked above).

  // The next start removes what the last killed save left; nothing but checkpoints remains.
  Child last = Child::spawn({child, dir.path, "--max-saves", "0"});
  last.rest();
  ASSERT_EQ(last.wait(), 0);
  for (const auto& e : fs::directory_iterator(dir.path + "/ckpt")) {
    const std::string name = e.path().filename().string();
    EXPECT_TRUE(name == "latest" || name.rfind("step-", 0) == 0) << name;
  }
}

}  // namespace
}  // namespace zo::engine

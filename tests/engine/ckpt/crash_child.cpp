// The process crash_test.cpp kills: it saves checkpoints of a store with its optimizer states and
// compute copies on NVMe, one after another, generation after generation (each generation's states
// are a known function of it), and reports every phase on stdout as it reaches it. Like the
// trainer it first removes what a killed save left (clean_stale_checkpoints) and continues after
// `latest`.
//   crash_child DIR [--kill-at-phase N] [--max-saves M]
// --kill-at-phase N: SIGKILL itself at the N-th phase callback (1-based, counted over all saves).
#include <signal.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "engine/ckpt/checkpoint.h"
#include "tests/engine/ckpt/ckpt_rig.h"

using namespace zo;
using namespace zo::engine;

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: crash_child DIR [--kill-at-phase N] [--max-saves M]\n");
    return 2;
  }
  const std::string dir = argv[1];
  uint64_t kill_at = 0, max_saves = 1000;
  for (int i = 2; i + 1 < argc; i += 2) {
    if (std::strcmp(argv[i], "--kill-at-phase") == 0) kill_at = std::strtoull(argv[i + 1], nullptr, 10);
    if (std::strcmp(argv[i], "--max-saves") == 0) max_saves = std::strtoull(argv[i + 1], nullptr, 10);
  }
  const std::string ckpt = dir + "/ckpt";
  auto stale = clean_stale_checkpoints(ckpt, io::Env::posix());
  ZO_CHECK(stale.is_ok()) << stale.status().to_string();
  uint64_t gen = 1;
  if (auto latest = resolve_checkpoint(ckpt, io::Env::posix()); latest.is_ok()) {
    auto info = open_checkpoint(*latest, io::Env::posix());
    ZO_CHECK(info.is_ok()) << "the latest checkpoint does not open: " << info.status().to_string();
    gen = info->state.steps_done + 1;
  }
  testing::Rig rig;
  Status s = rig.init({.optimizer = "nvme", .param = "nvme", .sub_group_size = 100000}, dir + "/swap", /*scale=*/40);
  ZO_CHECK(s.is_ok()) << s.to_string();
  std::printf("ready %llu\n", static_cast<unsigned long long>(gen));
  std::fflush(stdout);

  uint64_t phases = 0;
  for (uint64_t n = 0; n < max_saves; ++n, ++gen) {
    ZO_CHECK(rig.fill(gen).is_ok());
    TrainingState st;
    st.steps_done = gen;
    st.optimizer_steps = gen;
    st.model = "crash-rig";
    st.config = nlohmann::json::object();
    SaveOptions o;
    o.dir = ckpt;
    o.keep_last = 2;
    o.staging_bytes = uint64_t{4} << 20;
    o.env = io::Env::posix();
    o.on_phase = [&](SavePhase p) {
      ++phases;
      std::printf("phase %llu %s\n", static_cast<unsigned long long>(gen), std::string(save_phase_name(p)).c_str());
      std::fflush(stdout);
      if (phases == kill_at) raise(SIGKILL);
    };
    const auto t0 = std::chrono::steady_clock::now();
    std::printf("begin %llu\n", static_cast<unsigned long long>(gen));
    std::fflush(stdout);
    auto r = save_checkpoint(*rig.store, st, "{}", o);
    ZO_CHECK(r.is_ok()) << r.status().to_string();
    std::printf("end %llu %.4f\n", static_cast<unsigned long long>(gen),
                std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    std::fflush(stdout);
  }
  return 0;
}

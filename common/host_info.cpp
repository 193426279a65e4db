#include "common/host_info.h"

#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <sys/resource.h>

#include <fstream>
#include <limits>
#include <sstream>

namespace zo {
namespace {

uint64_t meminfo_kib(const std::string& text, const std::string& key) {
  const size_t pos = text.find(key + ":");
  if (pos == std::string::npos) return 0;
  std::istringstream is(text.substr(pos + key.size() + 1));
  uint64_t kib = 0;
  is >> kib;
  return kib * 1024;
}

}  // namespace

HostInfo host_info() {
  HostInfo h;
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) == 0) h.logical_cpus = static_cast<unsigned>(CPU_COUNT(&set));
#if defined(__x86_64__)
  __builtin_cpu_init();
  h.avx2 = __builtin_cpu_supports("avx2");
  h.fma = __builtin_cpu_supports("fma");
  h.avx512f = __builtin_cpu_supports("avx512f");
  h.avx512bw = __builtin_cpu_supports("avx512bw");
#endif
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line;
  while (std::getline(cpuinfo, line)) {
    if (h.cpu_model.empty() && line.rfind("model name", 0) == 0) {
      const size_t colon = line.find(':');
      if (colon != std::string::npos) h.cpu_model = line.substr(line.find_first_not_of(' ', colon + 1));
    }
    if (line.rfind("flags", 0) == 0) {
      h.f16c = line.find(" f16c") != std::string::npos;
      h.avx512_bf16 = line.find(" avx512_bf16") != std::string::npos;
      break;
    }
  }
  std::ifstream meminfo("/proc/meminfo");
  std::stringstream ss;
  ss << meminfo.rdbuf();
  h.mem_total_bytes = meminfo_kib(ss.str(), "MemTotal");
  h.mem_available_bytes = meminfo_kib(ss.str(), "MemAvailable");
  rlimit rl{};
  if (getrlimit(RLIMIT_MEMLOCK, &rl) == 0)
    h.memlock_limit_bytes = rl.rlim_cur == RLIM_INFINITY ? std::numeric_limits<uint64_t>::max() : rl.rlim_cur;
  h.address_space_limit_bytes = std::numeric_limits<uint64_t>::max();
  if (getrlimit(RLIMIT_AS, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY) h.address_space_limit_bytes = rl.rlim_cur;
  pthread_attr_t attr;
  size_t stack = 0;
  if (pthread_getattr_default_np(&attr) == 0) {
    if (pthread_attr_getstacksize(&attr, &stack) != 0) stack = 0;
    pthread_attr_destroy(&attr);
  }
  h.thread_stack_bytes = stack != 0 ? stack : uint64_t{8} << 20;  // glibc's default under ulimit -s 8192
  return h;
}

RssBytes process_rss() {
  RssBytes r;
  FILE* f = std::fopen("/proc/self/status", "r");
  if (f == nullptr) return r;
  char line[256];
  while (std::fgets(line, sizeof line, f) != nullptr) {
    unsigned long long kib = 0;
    if (std::sscanf(line, "VmRSS: %llu kB", &kib) == 1) r.current = kib * 1024;
    if (std::sscanf(line, "VmHWM: %llu kB", &kib) == 1) r.peak = kib * 1024;
    if (std::sscanf(line, "VmSize: %llu kB", &kib) == 1) r.virtual_bytes = kib * 1024;
  }
  std::fclose(f);
  return r;
}

PhaseRss::PhaseRss() : known_(reset_peak_rss()), start_bytes_(process_rss().current) {}

int64_t PhaseRss::peak_extra_bytes() const {
  if (!known_) return -1;
  return static_cast<int64_t>(process_rss().peak) - static_cast<int64_t>(start_bytes_);
}

bool reset_peak_rss() {
  FILE* f = std::fopen("/proc/self/clear_refs", "w");
  if (f == nullptr) return false;
  const bool ok = std::fputs("5", f) >= 0;
  return std::fclose(f) == 0 && ok;
}

}  // namespace zo

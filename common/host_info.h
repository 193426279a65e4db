// Facts about the host this process runs on: CPU features, cores, memory, the pinned-memory limit.
// Read from the CPU and /proc on each call; thread-safe.
#pragma once

#include <cstdint>
#include <string>

namespace zo {

struct HostInfo {
  std::string cpu_model;      // /proc/cpuinfo "model name", or "" when unknown
  unsigned logical_cpus = 0;  // CPUs this process may run on (affinity mask)
  bool avx2 = false, fma = false, f16c = false, avx512f = false, avx512bw = false, avx512_bf16 = false;
  uint64_t mem_total_bytes = 0;            // MemTotal
  uint64_t mem_available_bytes = 0;        // MemAvailable
  uint64_t memlock_limit_bytes = 0;        // RLIMIT_MEMLOCK soft limit; UINT64_MAX when unlimited
  uint64_t address_space_limit_bytes = 0;  // RLIMIT_AS soft limit (ulimit -v); UINT64_MAX when unlimited
  uint64_t thread_stack_bytes = 0;         // the address space a new thread's stack reserves (glibc's default)
};

HostInfo host_info();

// Resident set size of this process now (VmRSS) and its high-water mark (VmHWM), and its address
// space now (VmSize, what ulimit -v limits), in bytes; 0 when /proc/self/status cannot be read.
struct RssBytes {
  uint64_t current = 0;
  uint64_t peak = 0;
  uint64_t virtual_bytes = 0;
};
RssBytes process_rss();
// Resets the high-water mark to the current RSS (writes 5 to /proc/self/clear_refs), so the peak of
// one phase (a checkpoint save, an export) can be measured; false where the kernel does not allow it.
bool reset_peak_rss();

// The peak RSS one phase adds (a checkpoint save, an export): construct it just before the phase,
// read it after. Not thread-safe; one phase at a time per process (it resets the process's peak).
class PhaseRss {
 public:
  PhaseRss();  // resets the high-water mark and notes the RSS now
  // The peak RSS since construction minus the RSS at construction, in bytes; -1 where the kernel
  // does not let the peak be reset.
  int64_t peak_extra_bytes() const;

 private:
  bool known_ = false;
  uint64_t start_bytes_ = 0;
};

}  // namespace zo

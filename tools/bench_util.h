// Helpers shared by the zoffload-bench subcommands: medians, deterministic parallel random fills and
// the process's resident-memory figures. Stateless; thread-safe.
#pragma once

#include "common/host_info.h"

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "common/status.h"
#include "common/string_util.h"
#include "cpu_optim/executor.h"

namespace zo::tools {

// The median of `v` (the mean of the two middle values for an even count); 0 for an empty vector.
double median(std::vector<double> v);

// A bench's error line, "zoffload-bench <bench>: <msg>" on stderr; the call returns `code`, the
// exit code (2 bad usage, 1 a failure while running): `const BenchError usage{"adam", 2};` then
// `return usage("--params: ...");`.
struct BenchError {
  const char* bench;
  int code;
  int operator()(const std::string& msg) const;
};

// `bytes` moved in `seconds`, in GB/s (10^9 bytes a second); 0 for no time.
inline double gbps(uint64_t bytes, double seconds) {
  return seconds > 0 ? static_cast<double>(bytes) / seconds / 1e9 : 0.0;
}

// Fills n elements of `dtype` at `data` with uniform values in [lo, hi), the same for the same seed
// on any thread count (splitmix64 of seed and index), in parallel on `ex`.
void random_fill(void* data, DType dtype, size_t n, uint64_t seed, float lo, float hi, const cpu_optim::Executor& ex);

// A flag's comma-separated list ("1MiB,4MiB"), each item through `parse` (a Result<T>(string)):
// empty items are skipped; InvalidArgument "<flag>: <why>" for a bad item or an empty list.
template <typename T, typename Parse>
Result<std::vector<T>> parse_list(const std::string& flag, const std::string& text, Parse parse) {
  std::vector<T> out;
  for (const std::string& item : split(text, ',')) {
    if (item.empty()) continue;
    auto v = parse(item);
    if (!v.is_ok()) return invalid_argument(flag + ": " + v.status().message());
    out.push_back(*v);
  }
  if (out.empty()) return invalid_argument(flag + ": empty list");
  return out;
}

}  // namespace zo::tools

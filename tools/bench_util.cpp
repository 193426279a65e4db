#include "tools/bench_util.h"

#include <algorithm>
#include <cstdio>
#include <cstring>

#include "cpu_optim/dtype.h"

namespace zo::tools {

int BenchError::operator()(const std::string& msg) const {
  std::fprintf(stderr, "zoffload-bench %s: %s\n", bench, msg.c_str());
  return code;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n == 0 ? 0.0 : (n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]));
}

namespace {
uint64_t mix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}
}  // namespace

void random_fill(void* data, DType dtype, size_t n, uint64_t seed, float lo, float hi, const cpu_optim::Executor& ex) {
  ex.for_each_tile(n, [&](size_t b, size_t e) {
    for (size_t i = b; i < e; ++i) {
      const float u = static_cast<float>(mix(seed * 0x100000001B3ull + i) >> 40) * (1.0f / 16777216.0f);
      cpu_optim::store_from_float(data, dtype, i, lo + (hi - lo) * u);
    }
  });
}

}  // namespace zo::tools

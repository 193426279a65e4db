// Splitting element-wise work over the hardware's threads, for the setup's and the export's loops
// whose elements (or blocks of elements) depend on their index alone: the split cannot change a bit.
// Header-only; thread-safe as `fn` is.
#pragma once

#include <algorithm>
#include <cstdint>
#include <thread>
#include <vector>

namespace zo {

// Runs fn(begin, end) over [0, n) cut into ranges of whole `grain`s (> 0; the last range may end at
// n) of at least 2^16 elements, one range a thread, up to the hardware's threads (at most 32), the
// first range on this thread; returns when all are done. Below 2^17 elements, one call on this
// thread. `fn` must not throw.
template <typename Fn>
void parallel_ranges(uint64_t n, uint64_t grain, const Fn& fn) {
  constexpr uint64_t kMinPerThread = uint64_t{1} << 16;
  const uint64_t n_threads =
      std::min<uint64_t>({std::max(1u, std::thread::hardware_concurrency()), 32, n / kMinPerThread});
  if (n_threads <= 1) return fn(uint64_t{0}, n);
  const uint64_t per = ((n + n_threads - 1) / n_threads + grain - 1) / grain * grain;
  std::vector<std::thread> workers;
  for (uint64_t begin = per; begin < n; begin += per)
    workers.emplace_back([&fn, begin, end = std::min(n, begin + per)] { fn(begin, end); });
  fn(uint64_t{0}, std::min(n, per));
  for (std::thread& w : workers) w.join();
}

}  // namespace zo

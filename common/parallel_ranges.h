// Splitting element-wise work over the hardware's threads, for the setup's and the export's loops
// whose elements (or blocks of elements) depend on their index alone: the split cannot change a bit.
// Header-only; thread-safe as `fn` is.
#pragma once

#include <algorithm>
#include <cstdint>
#include <system_error>
#include <thread>
#include <vector>

namespace zo {

// The threads parallel_ranges runs n elements on: the hardware's (at most 32), one per 2^16
// elements at least, so 1 below 2^17 elements.
inline uint64_t parallel_threads(uint64_t n) {
  constexpr uint64_t kMinPerThread = uint64_t{1} << 16;
  return std::max<uint64_t>(
      1, std::min<uint64_t>({std::max(1u, std::thread::hardware_concurrency()), 32, n / kMinPerThread}));
}

// Runs fn(begin, end) over [0, n) cut into parallel_threads(n) ranges of whole `grain`s (> 0; the
// last range may end at n), one a thread, the first on this thread; returns when all are done. A
// thread that cannot be started (std::system_error) has its range run here instead. `fn` must not
// throw.
template <typename Fn>
void parallel_ranges(uint64_t n, uint64_t grain, const Fn& fn) {
  const uint64_t n_threads = parallel_threads(n);
  if (n_threads <= 1) return fn(uint64_t{0}, n);
  const uint64_t per = ((n + n_threads - 1) / n_threads + grain - 1) / grain * grain;
  std::vector<std::thread> workers;
  for (uint64_t begin = per; begin < n; begin += per) {
    const uint64_t end = std::min(n, begin + per);
    try {
      workers.emplace_back([&fn, begin, end] { fn(begin, end); });
    } catch (const std::system_error&) { fn(begin, end); }
  }
  fn(uint64_t{0}, std::min(n, per));
  for (std::thread& w : workers) w.join();
}

}  // namespace zo

// Helpers shared by the zoffload-bench subcommands: medians, deterministic parallel random fills and
// the process's resident-memory figures. Stateless; thread-safe.
#pragma once

#include "common/host_info.h"

#include <cstddef>
#include <cstdint>
#include <vector>

#include "common/dtype.h"
#include "cpu_optim/executor.h"

namespace zo::tools {

// The median of `v` (the mean of the two middle values for an even count); 0 for an empty vector.
double median(std::vector<double> v);

// Fills n elements of `dtype` at `data` with uniform values in [lo, hi), the same for the same seed
// on any thread count (splitmix64 of seed and index), in parallel on `ex`.
void random_fill(void* data, DType dtype, size_t n, uint64_t seed, float lo, float hi, const cpu_optim::Executor& ex);


}  // namespace zo::tools

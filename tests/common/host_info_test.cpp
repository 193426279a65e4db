#include "common/host_info.h"

#include <gtest/gtest.h>

namespace zo {
namespace {

TEST(HostInfo, ReadsCpusAndMemory) {
  const HostInfo h = host_info();
  EXPECT_GE(h.logical_cpus, 1u);
  EXPECT_GT(h.mem_total_bytes, 0u);
  EXPECT_LE(h.mem_available_bytes, h.mem_total_bytes);
  EXPECT_GT(h.memlock_limit_bytes, 0u);
  if (h.avx512bw) { EXPECT_TRUE(h.avx512f); }
}

}  // namespace
}  // namespace zo

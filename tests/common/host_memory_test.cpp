#include "common/host_memory.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>

#include "common/aligned_buffer.h"

namespace zo {
namespace {

bool all_zero(const std::byte* p, size_t n) {
  for (size_t i = 0; i < n; ++i)
    if (p[i] != std::byte{0}) return false;
  return true;
}

TEST(HostMemory, AllocationsAreAlignedZeroAndWritableOnBothSidesOfTheHugePageSize) {
  for (size_t size :
       {size_t{1}, size_t{4096}, kHugePageBytes - 1, kHugePageBytes, kHugePageBytes + 1, 9 * kHugePageBytes + 17}) {
    for (size_t alignment : {size_t{64}, size_t{4096}}) {
      SCOPED_TRACE("size " + std::to_string(size) + " alignment " + std::to_string(alignment));
      auto* p = static_cast<std::byte*>(allocate_host(size, alignment));
      ASSERT_NE(p, nullptr);
      const auto addr = reinterpret_cast<uintptr_t>(p);
      EXPECT_EQ(addr % alignment, 0u);
      if (size >= kHugePageBytes) {
        EXPECT_EQ(addr % kHugePageBytes, 0u);
        EXPECT_TRUE(all_zero(p, size));  // fresh anonymous memory; malloc'd small ones need not be
      }
      std::memset(p, 0xA5, size);
      EXPECT_EQ(p[size - 1], std::byte{0xA5});
      free_host(p, size);
    }
  }
  free_host(nullptr, 123);
}

// kB of AnonHugePages in the mapping of /proc/self/smaps that holds `addr`, or -1 if none does.
long anon_huge_kb(const void* addr) {
  std::ifstream smaps("/proc/self/smaps");
  const auto a = reinterpret_cast<uintptr_t>(addr);
  bool inside = false;
  for (std::string line; std::getline(smaps, line);) {
    unsigned long lo = 0, hi = 0;
    char dash = 0;
    std::istringstream head(line);
    if (head >> std::hex >> lo >> dash >> hi && dash == '-') {
      inside = a >= lo && a < hi;
      continue;
    }
    if (inside && line.rfind("AnonHugePages:", 0) == 0) return std::stol(line.substr(14));
  }
  return -1;
}

TEST(HostMemory, LargeBuffersLandOnHugePages) {
  const std::string mode = transparent_huge_pages_mode();
  ASSERT_TRUE(mode == "always" || mode == "madvise" || mode == "never" || mode == "unavailable") << mode;
  if (mode != "always" && mode != "madvise") GTEST_SKIP() << "transparent huge pages are " << mode;
  // AlignedBuffer is what the I/O paths allocate; it touches every byte, so the pages exist now.
  auto buf = AlignedBuffer::allocate(8 * kHugePageBytes + 4096);
  ASSERT_TRUE(buf.is_ok()) << buf.status().to_string();
  const long kb = anon_huge_kb(buf->data());
  ASSERT_GE(kb, 0) << "no mapping holds the buffer";
  // At least one 2 MiB page: with 4 KiB pages a 1 MiB O_DIRECT request reaches a virtio or NVMe
  // drive split in pieces (Note [Huge pages for I/O buffers]).
  EXPECT_GE(kb, 2048) << "the buffer is on 4 KiB pages";
}

}  // namespace
}  // namespace zo

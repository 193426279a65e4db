#include "common/host_memory.h"

#include <sys/mman.h>

#include <cstdint>
#include <cstdlib>
#include <fstream>

#include "common/bytes.h"
#include "common/check.h"

// Note [Huge pages for I/O buffers]
// A block device takes at most `max_segments` physically contiguous pieces per request
// (/sys/block/<dev>/queue/max_segments: 254 on virtio-blk, 127 or fewer on many NVMe drives).
// A 1 MiB O_DIRECT read into 4 KiB pages is 256 pieces, so the kernel splits it into two or more
// requests and the drive sees half-size I/O. Measured on this project's 2-core VM (virtio, 254
// segments), 1 MiB reads at QD32 through libaio ran at 1.1-1.6 GB/s into 4 KiB pages and at
// 3.2-3.5 GB/s into the same buffer on huge pages; this was the gap to DeepSpeed's aio, whose
// large locked tensors land on huge pages. A 2 MiB huge page is one piece, so every request up to
// the device's max_sectors_kb reaches it whole. The same pages also spare the optimizer's SIMD
// passes most TLB misses. When THP is "never" or missing, madvise is refused or ignored and the
// memory is ordinary pages: still correct, only split again; `zoffload-bench io` prints the mode.

namespace zo {

namespace {

bool use_mmap(size_t size_bytes) { return size_bytes >= kHugePageBytes; }

}  // namespace

void* allocate_host(size_t size_bytes, size_t alignment) {
  ZO_CHECK(size_bytes > 0) << "allocate_host of 0 bytes";
  ZO_CHECK(alignment >= sizeof(void*) && (alignment & (alignment - 1)) == 0 && alignment <= kHugePageBytes)
      << "allocate_host alignment " << alignment;
  if (!use_mmap(size_bytes)) return std::aligned_alloc(alignment, align_up(size_bytes, alignment));

  // Map one huge page more than needed, then unmap the slack on both sides so that what remains
  // starts on a 2 MiB boundary and is exactly align_up(size, 2 MiB) long, as free_host expects.
  const size_t length = align_up(size_bytes, kHugePageBytes);
  void* raw = ::mmap(nullptr, length + kHugePageBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) return nullptr;
  const auto base = reinterpret_cast<uintptr_t>(raw);
  const uintptr_t start = align_up(base, uintptr_t{kHugePageBytes});
  if (start > base) ::munmap(raw, start - base);
  if (const uintptr_t tail = base + length + kHugePageBytes - (start + length); tail > 0)
    ::munmap(reinterpret_cast<void*>(start + length), tail);
  // Refused only by kernels without THP; the pages are then ordinary ones.
  (void)::madvise(reinterpret_cast<void*>(start), length, MADV_HUGEPAGE);
  return reinterpret_cast<void*>(start);
}

void free_host(void* ptr, size_t size_bytes) {
  if (ptr == nullptr) return;
  if (!use_mmap(size_bytes)) {
    std::free(ptr);
    return;
  }
  ZO_CHECK(::munmap(ptr, align_up(size_bytes, kHugePageBytes)) == 0) << "munmap of " << ptr << " failed";
}

std::string transparent_huge_pages_mode() {
  std::ifstream in("/sys/kernel/mm/transparent_hugepage/enabled");
  std::string line;
  if (!in || !std::getline(in, line)) return "unavailable";
  // "always [madvise] never": the bracketed word is the mode.
  const auto open = line.find('[');
  const auto close = line.find(']', open);
  if (open == std::string::npos || close == std::string::npos) return "unavailable";
  return line.substr(open + 1, close - open - 1);
}

}  // namespace zo

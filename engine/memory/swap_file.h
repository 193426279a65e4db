// SwapFile: one preallocated NVMe swap file of a rank (e.g. DIR/zoffload-swap/rank0/optimizer.swp)
// with fixed 4 KiB-aligned regions reserved at setup and only ever overwritten in place. Reads and
// writes go through the IoEngine asynchronously; failures carry the file, offset, length and what
// the region holds. Thread-safe after setup (reserve() is setup-only); buffers are caller-owned.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "common/status.h"
#include "engine/memory/accounting.h"
#include "io/env.h"
#include "io/file.h"
#include "io/io_engine.h"

namespace zo::engine {

// Regions start on, and span multiples of, this many bytes.
inline constexpr uint64_t kSwapAlignment = 4096;

// A byte range of a swap file.
struct SwapRegion {
  uint64_t offset_bytes = 0;
  uint64_t size_bytes = 0;  // a multiple of kSwapAlignment
};

// The directory a rank's swap files live in: `nvme_path`/zoffload-swap/rank<rank>.
std::string swap_dir(const std::string& nvme_path, uint32_t rank);

class SwapFile {
 public:
  // Creates the directory (mkdir -p) and the file `dir`/`name` (an existing file of a previous run
  // is reused, its contents ignored), opens it with O_DIRECT where possible and preallocates
  // `capacity_bytes` (rounded up to kSwapAlignment) so that writes never hit ENOSPC later:
  // kNoSpace naming the file, the size and the free space when the drive is too small.
  // The file is locked (flock) for as long as it is open: a file another process holds (another
  // run with the same nvme_path and rank) is refused before anything in it changes,
  // kFailedPrecondition naming it. `claimed` (may be empty) is called with the path once the lock
  // is held, before the file is sized: from then on the file is this process's to remove.
  // `accounting` (may be null) counts reserved regions as NVMe-resident and I/O as moved bytes.
  // Directory creation, opening the file, free space and removal go through `env` (it must outlive
  // the file).
  static Result<std::unique_ptr<SwapFile>> create(const std::string& dir, const std::string& name,
                                                  uint64_t capacity_bytes, io::IoEngine& engine,
                                                  MemoryAccounting* accounting, io::Env* env,
                                                  const std::function<void(const std::string&)>& claimed = {});
  ~SwapFile();  // closes the file; the file stays on disk (remove_file() deletes it)
  SwapFile(const SwapFile&) = delete;
  SwapFile& operator=(const SwapFile&) = delete;

  // Reserves the next `size_bytes` (rounded up to kSwapAlignment) of the file. Setup only.
  // kNoSpace when the capacity is exhausted (a sizing bug in the caller's plan).
  Result<SwapRegion> reserve(uint64_t size_bytes);

  // Queues a read of `buffer.size()` bytes at `region.offset_bytes + offset_bytes` (the range must
  // lie in the region; buffer, offset and size aligned for O_DIRECT: kSwapAlignment works).
  // `what` (e.g. "sub-group 3 optimizer states") is put into any error of the ticket, with the
  // path, offset and length — see wait().
  Result<io::Ticket> read_async(SwapRegion region, uint64_t offset_bytes, std::span<std::byte> buffer,
                                std::string_view what);
  Result<io::Ticket> write_async(SwapRegion region, uint64_t offset_bytes, std::span<const std::byte> buffer,
                                 std::string_view what);
  // Waits for a ticket of this file; the Status of a failure names what/path/offset/length.
  Status wait(io::Ticket ticket);

  // Synchronous forms.
  Status read(SwapRegion region, uint64_t offset_bytes, std::span<std::byte> buffer, std::string_view what);
  Status write(SwapRegion region, uint64_t offset_bytes, std::span<const std::byte> buffer, std::string_view what);

  const std::string& path() const;
  uint64_t capacity_bytes() const;
  uint64_t reserved_bytes() const;
  bool direct() const;  // O_DIRECT in use (false on tmpfs, with a logged reason)

  // Closes and unlinks the file (end of a run that does not keep its swap).
  Status remove_file();

  struct Impl;

 private:
  explicit SwapFile(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace zo::engine

// StateStore::Impl, shared by state_store.cpp (create: layout, swap files, buffer carving, the
// accessors) and state_store_io.cpp (reads and writes of states in any tier, chunked through the
// scratch buffer, with the zero watermark on NVMe). Private to engine/memory.
#pragma once

#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/aligned_buffer.h"
#include "common/bytes.h"
#include "engine/memory/state_store.h"

namespace zo::engine {

inline std::string what_of(uint32_t g, StateKind kind) {
  return "sub-group " + std::to_string(g) + " " + std::string(state_name(kind));
}

struct StateStore::Impl {
  ParamRegistry registry;
  MemoryPlan plan;
  gpu::Device* device = nullptr;
  io::IoEngine* io = nullptr;
  StateStoreOptions options;
  MemoryAccounting* accounting = nullptr;

  std::unique_ptr<PinnedPool> pool;
  std::vector<std::array<StateLocation, kNumStateKinds>> locations;
  std::vector<std::array<uint64_t, kNumStateKinds>> nvme_written;
  std::vector<std::array<uint64_t, kNumStateKinds>> group_bytes;  // group_state_bytes, per sub-group

  // One block per state kind and tier, with a section per sub-group in sub-group order, so the
  // pieces of a split param (whose non-final pieces fill whole sub-groups of a multiple of
  // kSplitAlignElems elements) lie back to back in every tier.
  std::array<gpu::DevicePtr, kNumStateKinds> device_blocks{};
  uint64_t device_bytes = 0;
  std::vector<std::span<std::byte>> pinned_blocks;
  std::vector<AlignedBuffer> pageable_blocks;
  uint64_t pageable_bytes = 0;

  std::unique_ptr<SwapFile> optimizer_file;
  std::unique_ptr<SwapFile> param_file;

  std::vector<std::span<std::byte>> optimizer_swap_buffers;
  std::vector<std::span<std::byte>> compute_staging_buffers;
  std::vector<std::span<std::byte>> param_swap_buffers;

  AlignedBuffer scratch;
  // The synchronous transfers share `scratch` and `stream`: they take turns (they may come from the
  // gatherer's or the gradient worker's thread beside the training thread).
  std::recursive_mutex transfer_mu;
  gpu::Stream stream;
  std::string torn_reason;

  ~Impl();

  uint64_t n_elems(uint32_t g) const { return registry.sub_groups()[g].n_elems; }
  uint64_t elem_bytes(StateKind kind) const { return state_elem_bytes(plan.placement, kind); }
  uint64_t bytes(uint32_t g, StateKind kind) const { return group_bytes[g][static_cast<int>(kind)]; }
  Tier tier_of(uint32_t g, StateKind kind) const {
    if (kind == StateKind::kCompute) return plan.placement.compute[g];
    if (kind == StateKind::kGradAccum) return plan.placement.grad;
    return plan.placement.optimizer;
  }
  bool pinned_kind(StateKind kind) const { return state_is_pinned(plan.placement, kind); }
  SwapFile* file_of(StateKind kind) const {
    return kind == StateKind::kCompute ? param_file.get() : optimizer_file.get();
  }

  // kFailedPrecondition when the state is another rank's (StateLocation::held).
  Status check_held(uint32_t g, StateKind kind, const char* op) const;
  Status allocate_states();
  Status create_swap_files();
  Status carve_buffers();
  Status zero_states();

  // Byte-range transfers of one state of one sub-group, whatever its tier. `fill` produces, and
  // `consume` takes, the bytes [begin + rel, begin + rel + n) of the range, in chunks.
  using Fill = std::function<void(std::byte* dst, uint64_t rel, uint64_t n)>;
  using Consume = std::function<void(const std::byte* src, uint64_t rel, uint64_t n)>;
  Status write_range(uint32_t g, StateKind kind, uint64_t begin, uint64_t end, const Fill& fill);
  Status read_range(uint32_t g, StateKind kind, uint64_t begin, uint64_t end, const Consume& consume);
  Status zero_range(uint32_t g, StateKind kind, uint64_t begin, uint64_t end);
  // Compute copies of elements [first, first + master.size()) = master rounded to the compute dtype.
  Status write_compute(uint32_t g, uint64_t first, std::span<const float> master);
  Status nvme_write(uint32_t g, StateKind kind, uint64_t begin, uint64_t end, const Fill& fill);
  Status nvme_read(uint32_t g, StateKind kind, uint64_t begin, uint64_t end, const Consume& consume);
  // Reads [off, off + size) of the region into dst, zeros beyond the watermark (aligned range).
  Status nvme_read_aligned(uint32_t g, StateKind kind, uint64_t off, uint64_t size, std::byte* dst);
};

}  // namespace zo::engine

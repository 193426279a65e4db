// StateStore: the storage of every state of every sub-group of this rank, allocated once at start
// from a MemoryPlan — device memory, pinned pool, pageable CPU memory and the NVMe swap files —
// plus the pinned swap and staging buffers the swappers use. The one owner of model-state bytes.
// Thread-safety: layout queries (location, state_bytes, plan, registry, buffers) are read-only after
// create() and safe from any thread. The synchronous transfers (init_param, read_param_*,
// read_state*, write_state*, write_compute_from_master) share one scratch buffer and one stream and
// take turns under one mutex (recursive: a transfer may call another); during a step they come from
// the training thread, the optimizer's, the gradient worker's and the block gatherer's. Everything
// else (mark_torn, the asynchronous reads and writes of the swappers) is driven by one thread at a
// time, as the trainer's step orders it.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "common/status.h"
#include "engine/memory/accounting.h"
#include "engine/memory/memory_plan.h"
#include "engine/memory/pinned_pool.h"
#include "engine/memory/swap_file.h"
#include "gpu/device.h"
#include "io/env.h"
#include "io/io_engine.h"

namespace zo::engine {

// Synchronous transfers (init_param, read_state, write_state) go through this much scratch memory,
// whatever the size of the state, so a 4 GB sub-group never needs a 4 GB bounce buffer.
inline constexpr uint64_t kStoreScratchBytes = uint64_t{4} << 20;

struct StateStoreOptions {
  uint32_t rank = 0;
  std::string optimizer_nvme_path;  // offload_optimizer.nvme_path (optimizer on NVMe)
  std::string param_nvme_path;      // offload_param.nvme_path (compute copies on NVMe)
  // Hard cap of the pinned pool; 0: none. The pool is exactly plan.pinned_pool_bytes(); a plan
  // needing more than the cap fails at create() with both numbers and the breakdown, naming
  // pinned_cap_key.
  uint64_t pinned_cap_bytes = 0;
  std::string pinned_cap_key = "zoffload.pinned_memory_limit";
  // Check the pool against RAM and ulimit -l before allocating (check_pinned_cap). Tests of the
  // logic with fake host facts turn it off and call check_pinned_cap themselves.
  bool check_host = true;
  bool remove_swap_files_on_close = true;
  // Called with each swap file's path once this process holds it, before the file is sized and
  // filled (SwapFile::create's `claimed`): a stop signal's handler may remove it from then on.
  std::function<void(const std::string&)> on_swap_file;
  // The swap files are created, opened and removed through this Env; it must outlive the store.
  // Tests pass an io::FaultyEnv. Required (io::require_env).
  io::Env* env = nullptr;
};

// Where one state of one sub-group lives. Exactly one of the three is set, per `tier`, unless the
// state is not `held`: an optimizer state of a sub-group another data-parallel rank owns
// (MemoryPlan::owns), which has no storage here.
struct StateLocation {
  Tier tier = Tier::kCpu;
  bool held = true;
  std::byte* host = nullptr;  // Tier::kCpu: n_elems × elem bytes
  gpu::DevicePtr device;      // Tier::kDevice
  SwapRegion region;          // Tier::kNvme, in optimizer_file() (compute: param_file())
};

class StateStore {
 public:
  // Checks the pinned need against the cap (and the host), then allocates everything: the pool,
  // the device states (under the device budget: kOutOfMemory with the numbers), the pageable CPU
  // states, the swap files (preallocated), the swap and staging buffers. States start zeroed
  // (master too) — call init_param() for every param before the first step.
  static Result<std::unique_ptr<StateStore>> create(const ParamRegistry& registry, const MemoryPlan& plan,
                                                    gpu::Device& device, io::IoEngine& io,
                                                    const StateStoreOptions& options, MemoryAccounting& accounting);
  ~StateStore();  // frees everything; removes the swap files if options say so
  StateStore(const StateStore&) = delete;
  StateStore& operator=(const StateStore&) = delete;

  // Sets elements [offset_elems, offset_elems + values.size()) of a param: master = values,
  // compute = values rounded to the compute dtype, exp_avg = exp_avg_sq = 0 (the optimizer states
  // only where held). Any slice (streaming a large tensor in chunks); on NVMe unaligned edges are
  // read-modify-written. Synchronous.
  Status init_param(uint32_t param, uint64_t offset_elems, std::span<const float> values);
  // A packed weight's compute copy (ParamInfo::packed: its blob, Note [The packed 4-bit base] in
  // common/bnb4_blob.h): bytes [offset_bytes, offset_bytes + bytes.size()) written as they are,
  // where this rank holds them. InvalidArgument for a param that is not packed or a range outside
  // its blob. Synchronous.
  Status init_packed(uint32_t param, uint64_t offset_bytes, std::span<const std::byte> bytes);
  // Reads elements [offset_elems, offset_elems + out.size()) of a param's fp32 master, from
  // whichever sub-groups and tiers hold them (read_state_range per piece). Synchronous.
  // kFailedPrecondition when some of them are another rank's.
  Status read_param_master(uint32_t param, uint64_t offset_elems, std::span<float> out);
  // The same from the compute copies (held for every sub-group), widened to fp32 exactly: the master
  // rounded to the compute dtype; for a packed weight, its elements dequantized from the blob as
  // the device's dequantize_packed gives them (kCorruption naming the param when its header is not a
  // blob's). Uses the store's scratch: not beside other transfers.
  Status read_param_compute(uint32_t param, uint64_t offset_elems, std::span<float> out);
  // Bytes [offset_bytes, offset_bytes + out.size()) of a param's compute copy as stored (a packed
  // weight's blob), piece by piece. kFailedPrecondition when some are another rank's. Synchronous;
  // uses the store's scratch.
  Status read_compute_bytes(uint32_t param, uint64_t offset_bytes, std::span<std::byte> out);
  // A param's weights as the run holds them: its master, or, for a frozen param, which has none
  // (Note [Frozen sub-groups] in param_registry.cpp), its compute copy.
  Status read_param_value(uint32_t param, uint64_t offset_elems, std::span<float> out);

  // Copies one state of a sub-group (n_elems × state_elem_bytes) between its home and host memory,
  // synchronously, whatever the tier. For tests, checkpoints and the bench. Every transfer of a
  // state that is not held here fails with kFailedPrecondition.
  Status read_state(uint32_t sub_group, StateKind kind, std::span<std::byte> out);
  Status write_state(uint32_t sub_group, StateKind kind, std::span<const std::byte> in);
  // The same for bytes [offset_bytes, offset_bytes + size) of the state, so that checkpoints never
  // hold a whole state in RAM. From NVMe, whole 4 KiB blocks go straight into `out` when `out` and
  // offset_bytes are 4096-aligned (O_DIRECT, no bounce copy), and to NVMe likewise from `in`; other
  // bytes go through a 4 MiB scratch.
  Status read_state_range(uint32_t sub_group, StateKind kind, uint64_t offset_bytes, std::span<std::byte> out);
  Status write_state_range(uint32_t sub_group, StateKind kind, uint64_t offset_bytes, std::span<const std::byte> in);
  // The asynchronous form of read_state_range for checkpoints that keep several reads in flight:
  // for an NVMe state with `out` and offset_bytes 4096-aligned, the whole 4 KiB blocks are queued
  // straight into `out` and returned as a ticket of `file` to wait on with SwapFile::wait (`out`
  // must stay alive until then); everything else (other tiers, a tail, never-written bytes) is
  // copied before returning. file is null when nothing is left in flight.
  struct PendingRead {
    SwapFile* file = nullptr;
    io::Ticket ticket = 0;
  };
  Result<PendingRead> read_state_range_async(uint32_t sub_group, StateKind kind, uint64_t offset_bytes,
                                             std::span<std::byte> out);
  // The asynchronous write of a whole NVMe state (the gradient accumulators' write-behind, Note
  // [Asynchronous accumulator writes] in grad_accumulator.cpp): `in` is 4096-aligned and holds the
  // state's bytes padded to whole 4 KiB blocks (padded_state_bytes), which fill its region exactly;
  // the pad lands in the region's unused tail, never read as the state (zero it, as the store's own
  // writes of a state's end do). One O_DIRECT write
  // is queued; `in` must stay alive and unchanged until finish_write(), which waits for it and
  // only then raises the zero watermark. Anything else (another tier, a misaligned or missized
  // buffer) is kInvalidArgument: use write_state_range.
  struct PendingWrite {
    SwapFile* file = nullptr;
    io::Ticket ticket = 0;
    uint32_t sub_group = 0;
    StateKind kind = StateKind::kGradAccum;
    uint64_t bytes = 0;  // the padded bytes queued
  };
  Result<PendingWrite> write_state_async(uint32_t sub_group, StateKind kind, std::span<const std::byte> in);
  // Waits for a write_state_async; its failure names what, the file, offset and length.
  Status finish_write(const PendingWrite& pending);
  // state_bytes rounded up to whole 4 KiB blocks: the size of an NVMe state's region.
  uint64_t padded_state_bytes(uint32_t sub_group, StateKind kind) const;
  // Sets the compute copies of elements [offset_elems, offset_elems + master.size()) of a sub-group
  // to `master` rounded to the compute dtype (round to nearest even) — what the optimizer's fused
  // copy-out and init_param() write, so a resume derives them from the checkpointed master.
  Status write_compute_from_master(uint32_t sub_group, uint64_t offset_elems, std::span<const float> master);

  // After a failed optimizer step the states are torn (some sub-groups updated, some not): the
  // store refuses further steps with kFailedPrecondition naming the step and sub-group; resume from
  // a checkpoint. See docs/memory.md.
  void mark_torn(std::string reason);
  const std::string& torn_reason() const;  // empty when consistent

  // n_elems × state_elem_bytes of one state of a sub-group (the bytes read_state/write_state move).
  uint64_t state_bytes(uint32_t sub_group, StateKind kind) const;
  // NVMe states only — Note [Zero watermark] in state_store_io.cpp: the bytes of the state's region at
  // and beyond this offset were never written since create() and read as zeros (nothing is written
  // to zero a swap file). A multiple of kSwapAlignment. Swappers clip their reads to it (the rest of
  // their buffer is zeroed instead) and raise it with mark_nvme_written() after a completed write
  // of [start_bytes, end_bytes) with start_bytes ≤ the watermark (a write beyond it would leave a hole of
  // never-written bytes below it: aborts).
  uint64_t nvme_written_bytes(uint32_t sub_group, StateKind kind) const;
  void mark_nvme_written(uint32_t sub_group, StateKind kind, uint64_t start_bytes, uint64_t end_bytes);

  const ParamRegistry& registry() const;
  const MemoryPlan& plan() const;
  gpu::Device& device();
  io::IoEngine& io();
  MemoryAccounting& accounting();
  PinnedPool& pool();
  SwapFile* optimizer_file();  // null unless the optimizer is on NVMe
  SwapFile* param_file();      // null unless some compute copy is on NVMe
  const StateLocation& location(uint32_t sub_group, StateKind kind) const;
  // The plan's pinned buffers, carved from the pool at create().
  std::span<const std::span<std::byte>> optimizer_swap_buffers() const;
  std::span<const std::span<std::byte>> compute_staging_buffers() const;
  std::span<const std::span<std::byte>> param_swap_buffers() const;

  struct Impl;

 private:
  explicit StateStore(std::unique_ptr<Impl> impl);
  // read_param_compute of a packed weight (ParamInfo::packed).
  Status read_packed(uint32_t param, uint64_t offset_elems, std::span<float> out);
  // read_param_master / read_param_compute: `kind`'s elements of a param as fp32; `op` names the call.
  Status read_param(uint32_t param, uint64_t offset_elems, std::span<float> out, StateKind kind, const char* op);
  std::unique_ptr<Impl> impl_;
};

}  // namespace zo::engine

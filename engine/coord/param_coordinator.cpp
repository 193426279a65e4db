#include "engine/coord/param_coordinator.h"

#include <algorithm>
#include <deque>
#include <string>
#include <utility>

#include "common/bytes.h"
#include "common/log.h"
#include "common/timer.h"
#include "engine/coord/range_allocator.h"
#include "gpu/quant_kernels.h"

// Note [Prefetch and release]
//
// The schedule of one micro-step is fixed: forward blocks 0..n-1, then backward n-1..0 (each block's
// forward is recomputed there), 2n positions. Everything below is decided from that schedule and
// from the coordinator's own state, never from timing, so the same calls give the same fetches,
// evictions and counters on every backend.
//
// Arena. One device allocation at create(): [persistent region | dynamic region]. Every persistent
// param (compute copy off the device, at most stage3_param_persistence_threshold elements) has a
// fixed slot in the persistent region, so persistent params never fragment the rest. The dynamic
// region is managed first-fit in 256-byte slots. It is sized for the most that any schedule
// position needs — its block plus what prefetch would fetch ahead of it within the bucket and the
// live limit, counted in slots — at least the largest block. When prefetch can fetch anything,
// one largest block is added as slack against fragmentation: first-fit over params of different
// sizes leaves holes (a released embedding before a layer) that an exactly sized arena could not
// reuse, and prefetch would stop early. Everything is capped by the sum of all fetchable params and
// by the budget left; live elements stay bounded by the prefetch check, not by the arena size.
// Because it holds at least the largest block, an acquire can always proceed when no other block is
// held: if first-fit fails even after evicting every cached param, the block's own prefetched
// params are dropped too, which empties the region, and the block is placed again (in order, so it
// packs).
//
// Acquire(b) at position `cur`: params already resident or in flight are hits; the others get a
// slot (evicting released, non-persistent, cached params, farthest next use first, ties by the
// higher id) and their fetch is issued on the copy stream. The block's own NVMe reads are waited
// for and their H2D copies queued before any prefetch, so prefetch traffic never sits in the copy
// stream ahead of the block in use; then prefetch is issued; then the block's copies are waited for
// — by acquire() on the host, or, with acquire_async(), by whoever waits on the block's ready event:
// the event of the block's last-queued copy (the copy stream runs in order, so it lands after all
// the block's others, and later prefetch copies are not waited for). The compute stream waits on it
// on the device, and the block's params stay in transfer (holding their swap buffers) until they
// are released or a later fetch needs the buffer and completes them (a short H2D wait by then).
//
// Prefetch walks the schedule from cur+1 to the end of the micro-step (never into the next one: an
// optimizer step may change the compute copies in between) and fetches each param not yet present,
// in order, while (a) the elements fetched ahead (issued but not yet acquired) stay within
// stage3_prefetch_bucket_size — raised to the most one block fetches when the bucket cannot hold
// the largest param (Accelerate's "auto" 0.9·hidden² holds no 8B-class MLP projection, and a bucket
// that holds no param would turn prefetch off), so prefetch then runs by whole blocks —, (b) the
// live elements (non-persistent params in the arena) stay within stage3_max_live_parameters, and (c) a slot can be found, evicting only cached params whose
// next use comes after the one being prefetched. It stops at the first param that does not fit
// (strict order: never skips ahead). An NVMe param also needs one of the ParamSwapper's buffers;
// a buffer is freed by completing the oldest transfer only if its H2D copy is already queued
// (waiting for an H2D is short; waiting for an NVMe read here would stall the block in use), else
// prefetch stops. A buffer is released only after the H2D copy out of it completed.
//
// Release(b): each param of the block not held by another acquired block stays resident if it is
// persistent, or if its next use (wrapping into the next micro-step) comes within
// stage3_max_reuse_distance elements — the elements of the blocks scheduled strictly between — or
// if prefetch has already looked past its next use in this micro-step (it skipped the param then
// because it was present, and fetched later params instead: dropping it now would leave a miss
// behind the prefetch frontier; it is kept and counted as fetched ahead). Else its slot is freed
// at once. Cached params are dropped by evictions or invalidate().
//
// Packed weights (Note [The packed 4-bit base] in common/bnb4_blob.h). A frozen 4- or 8-bit weight's
// compute copy is its blob, and that is what a fetch moves: its H2D copy lands in the arena's
// staging region, between the persistent and dynamic regions, and dequantize_packed, queued behind it
// on the same copy stream, writes the weights into the param's slot (sized, like every limit above,
// by the weight's own elements in the compute dtype); the param's event is recorded after that. The
// stream runs in order, so one staging region of the largest blob serves every fetch. A blob that
// lives on the device is dequantized where it lives: such a param is fetched (it has a slot) but
// moves no bytes.

namespace zo::engine {

namespace {

enum class Residence : uint8_t {
  kAbsent = 0,  // not in the arena
  kPlaced,      // has a slot; no transfer issued yet
  kReading,     // NVMe read into a swap buffer in flight
  kCopying,     // H2D copy queued, event recorded
  kResident,    // on the device, copy complete
};

std::string bytes_text(uint64_t n) { return format_bytes(n) + " (" + std::to_string(n) + " bytes)"; }

}  // namespace

struct ParamCoordinator::Impl {
  struct Param {
    bool used = false;
    bool on_device = false;  // compute copy lives on the device: `home`, no arena slot
    gpu::DevicePtr home;
    const std::byte* host = nullptr;  // CPU-resident copy, read directly when there is no swapper
    uint64_t n_elems = 0;
    uint64_t bytes = 0;          // its slot: the weights in the compute dtype
    uint64_t src_bytes = 0;      // its compute copy, what a fetch moves: `bytes`, or a packed weight's blob
    bool packed = false;         // Note [The packed 4-bit base]: the blob is dequantized into the slot
    gpu::DevicePtr packed_home;  // a packed weight's blob when it lives on the device (read in place)
    uint64_t nvme_bytes = 0;  // the part of its compute copy that lives on NVMe
    bool persistent = false;
    std::vector<uint32_t> uses;  // schedule positions, ascending

    Residence state = Residence::kAbsent;
    uint64_t offset = 0;  // arena offset of its slot (fixed for persistent params)
    bool has_handle = false;
    ParamHandle handle;
    gpu::Event event;         // recorded behind its latest H2D copy
    uint64_t copy_seq = 0;    // that copy's place in the copy stream's order
    bool ahead = false;       // fetched by a prefetch, not yet acquired
    uint32_t holds = 0;       // acquired blocks using it
    uint64_t mark = 0;        // == mark_epoch: excluded from eviction
    Status failure;           // why its transfer failed (state back to kPlaced, buffer given back)
    uint32_t groups_end = 0;  // its sub-groups are below this: final once the gate's prefix reaches it
  };

  StateStore* store = nullptr;
  ParamSwapper* swapper = nullptr;
  BlockGatherer* gatherer = nullptr;  // every param comes from it (partitioned params)
  gpu::Device* device = nullptr;
  CoordinatorOptions options;
  std::vector<std::vector<uint32_t>> blocks;
  std::vector<std::string> names;
  FetchSchedule schedule;  // the micro-step's positions and what each fetches
  std::vector<Param> params;
  uint32_t n_blocks = 0;
  DType compute_dtype = DType::kF32;

  gpu::DevicePtr arena;
  uint64_t arena_bytes = 0;
  uint64_t persistent_bytes = 0;
  // [persistent_bytes, + staging_bytes) of the arena: where a packed weight's blob lands before the
  // dequantization on the copy stream reads it (one at a time: the stream runs in order).
  uint64_t staging_bytes = 0;
  detail::RangeAllocator dynamic;
  gpu::Stream stream;
  uint64_t copies_issued = 0;     // H2D copies queued so far (Param::copy_seq)
  std::deque<uint32_t> buffered;  // params holding a swap buffer, oldest fetch first
  UpdateGate* gate = nullptr;
  std::vector<uint32_t> block_groups_end;  // per block: the max groups_end of its params

  bool in_step = false;
  uint32_t pos = 0;  // next schedule position to acquire
  std::vector<uint32_t> block_holds;
  std::vector<uint32_t> block_pos;  // position of each block's latest acquire
  std::vector<uint64_t> prefix;     // prefix[k] = elements of schedule positions [0, k), over two micro-steps
  uint64_t mark_epoch = 0;
  uint64_t frontier = 0;  // the furthest schedule position prefetch has looked at this micro-step

  uint64_t live_elems = 0;
  uint64_t ahead_elems = 0;
  uint64_t live_bytes = 0;  // fetched-param bytes in the arena (persistent included)
  CoordinatorStats stats;

  // acquire() (waits for the copies on the host) and acquire_async() (records `ready`).
  Result<Acquired> acquire(uint32_t block, bool wait_copies);

  ~Impl() {
    for (uint32_t p = 0; p < params.size(); ++p) drain(p);
    for (Param& x : params) {
      if (x.event) device->destroy_event(x.event);
    }
    if (stream) device->destroy_stream(stream);
    if (arena) {
      device->free(arena);
      store->accounting().remove_resident(Tier::kDevice, arena_bytes);
    }
  }

  uint32_t block_at(uint64_t q) const { return schedule.block_at(q); }
  std::string block_text(uint32_t b) const {
    if (b >= n_blocks) return "block " + std::to_string(b) + " (out of range: " + std::to_string(n_blocks) + " blocks)";
    return "block " + std::to_string(b) + " '" + names[b] + "'";
  }
  std::string position_text(uint32_t q) const {
    return std::string(q < n_blocks ? "forward" : "backward") + ", schedule position " + std::to_string(q) + " of " +
           std::to_string(2 * n_blocks);
  }
  const std::string& param_name(uint32_t p) const { return store->registry().params()[p].name; }
  // The first use of `p` after position `cur`, wrapping into the next micro-step.
  uint64_t next_use(uint32_t p, uint64_t cur) const {
    const auto& u = params[p].uses;
    auto it = std::upper_bound(u.begin(), u.end(), cur);
    return it != u.end() ? *it : u.front() + 2 * uint64_t{n_blocks};
  }
  uint64_t slot_bytes(const Param& x) const { return dynamic.rounded(x.bytes); }

  // Waits for whatever transfer of `p` is in flight and gives back its swap buffer. Errors are
  // logged: the data is being dropped.
  void drain(uint32_t p) {
    Param& x = params[p];
    if (x.state == Residence::kCopying) {
      Status st = device->synchronize(x.event);
      if (!st.is_ok()) ZO_LOG(kWarn) << "coordinator: dropping " << param_name(p) << ": " << st.to_string();
    }
    give_back(p);  // waits for a read still in flight
  }

  void give_back(uint32_t p) {
    Param& x = params[p];
    if (!x.has_handle) return;
    swapper->release(x.handle);
    x.has_handle = false;
    auto it = std::find(buffered.begin(), buffered.end(), p);
    if (it != buffered.end()) buffered.erase(it);
  }

  // Takes `p` out of the arena (after draining it).
  void drop(uint32_t p) {
    Param& x = params[p];
    if (x.state == Residence::kAbsent) return;
    drain(p);
    if (!x.persistent) {
      dynamic.free(x.offset, x.bytes);
      live_elems -= x.n_elems;
    }
    live_bytes -= x.bytes;
    if (x.ahead) {
      ahead_elems -= x.n_elems;
      x.ahead = false;
    }
    x.state = Residence::kAbsent;
  }

  // Gives `p` (kAbsent) a slot; false when the arena has no room (nothing changed then).
  bool try_place(uint32_t p) {
    Param& x = params[p];
    if (!x.persistent) {
      auto off = dynamic.allocate(x.bytes);
      if (!off) return false;
      x.offset = *off;
      live_elems += x.n_elems;
    }
    x.state = Residence::kPlaced;
    x.failure = Status::ok();
    live_bytes += x.bytes;
    stats.peak_live_bytes = std::max(stats.peak_live_bytes, live_bytes);
    return true;
  }

  // The cached param to evict next: in the arena, not persistent, not held, not marked, and (when
  // `only_after` is set) resident, not fetched ahead, and next used after `*only_after`. Farthest
  // next use first, ties by the higher id. -1 when none.
  int64_t pick_victim(uint64_t cur, const uint64_t* only_after) const {
    int64_t best = -1;
    uint64_t best_use = 0;
    for (uint32_t p = 0; p < params.size(); ++p) {
      const Param& x = params[p];
      if (x.state == Residence::kAbsent || x.persistent || x.holds > 0 || x.mark == mark_epoch) continue;
      const uint64_t use = next_use(p, cur);
      if (only_after != nullptr && (x.state != Residence::kResident || x.ahead || use <= *only_after)) continue;
      if (best < 0 || use >= best_use) {
        best = p;
        best_use = use;
      }
    }
    return best;
  }

  // Queues the dequantization of a packed weight's blob at `blob` into its slot.
  Status dequantize(uint32_t p, gpu::DevicePtr blob) {
    const Param& x = params[p];
    return gpu::dequantize_packed(*device,
                                  {.blob = blob,
                                   .blob_bytes = x.src_bytes,
                                   .out = arena + x.offset,
                                   .out_dtype = compute_dtype,
                                   .n_elems = x.n_elems},
                                  stream);
  }

  // Queues the copy of `p`'s compute copy from `src` (host memory) — and for a packed weight its
  // dequantization, through the staging region — and records its event.
  void issue_h2d(uint32_t p, const std::byte* src, Status* status) {
    Param& x = params[p];
    const gpu::DevicePtr dst = x.packed ? arena + persistent_bytes : arena + x.offset;
    Status st = device->copy_h2d(dst, src, x.src_bytes, stream);
    if (st.is_ok()) store->accounting().add_moved(Move::kHostToDevice, x.src_bytes);
    if (st.is_ok() && x.packed) st = dequantize(p, dst);
    if (st.is_ok()) st = device->record(x.event, stream);
    if (!st.is_ok()) {
      *status = st.with_context("copying param " + param_name(p) + " to the device");
      return;
    }
    x.state = Residence::kCopying;
    x.copy_seq = ++copies_issued;
    ++stats.fetches;
    stats.h2d_bytes += x.src_bytes;
    stats.nvme_read_bytes += x.nvme_bytes;
  }

  // A packed weight whose blob lives on the device: only its dequantization is queued.
  Status issue_in_place(uint32_t p) {
    Param& x = params[p];
    Status st = dequantize(p, x.packed_home);
    if (st.is_ok()) st = device->record(x.event, stream);
    if (!st.is_ok()) return st.with_context("dequantizing param " + param_name(p) + " on the device");
    x.state = Residence::kCopying;
    x.copy_seq = ++copies_issued;
    ++stats.fetches;
    return Status::ok();
  }

  // A failed transfer leaves the param placed (slot kept, buffer given back) with its error, so
  // whoever needs it next sees the error instead of the bytes of a read that never landed.
  Status fail_transfer(uint32_t p, Status st) {
    Param& x = params[p];
    give_back(p);
    x.state = Residence::kPlaced;
    x.failure = st;
    return st;
  }

  // kReading → kCopying: waits for the NVMe read, queues the H2D copy.
  Status finish_read(uint32_t p) {
    Param& x = params[p];
    if (x.state != Residence::kReading) return Status::ok();
    auto span = swapper->wait(x.handle);
    if (!span.is_ok()) return fail_transfer(p, span.status());
    Status st;
    issue_h2d(p, span->data(), &st);
    if (!st.is_ok()) return fail_transfer(p, std::move(st));
    return Status::ok();
  }

  // Any transfer state → kResident; gives back the swap buffer after the copy completed.
  Status complete(uint32_t p) {
    Param& x = params[p];
    if (x.state == Residence::kPlaced && !x.failure.is_ok()) return x.failure;
    ZO_RETURN_IF_ERROR(finish_read(p));
    if (x.state == Residence::kCopying) {
      Status st = device->synchronize(x.event);
      if (!st.is_ok()) return fail_transfer(p, std::move(st));
      x.state = Residence::kResident;
    }
    give_back(p);
    return Status::ok();
  }

  // kCopying → kResident without blocking, when the copy has landed (acquire_async leaves a block's
  // params in transfer): gives back the swap buffer early. A failed query leaves it for complete().
  void settle(uint32_t p) {
    Param& x = params[p];
    if (x.state != Residence::kCopying) return;
    Result<bool> done = device->query(x.event);
    if (!done.is_ok() || !*done) return;
    x.state = Residence::kResident;
    give_back(p);
  }

  // Issues the fetch of `p` (kPlaced) for schedule position q. When `blocking` is false and a swap
  // buffer can only be had by waiting for an NVMe read, or q is not gathered yet, sets *would_block
  // and issues nothing.
  Status start_fetch(uint32_t p, uint64_t q, bool blocking, bool* would_block) {
    Param& x = params[p];
    x.failure = Status::ok();
    if (x.packed_home) return issue_in_place(p);
    if (gatherer != nullptr) {
      const std::byte* src = nullptr;
      if (blocking) {
        Stopwatch wait;  // the gatherer's thread may not have this position yet
        Result<const std::byte*> r = gatherer->wait(static_cast<uint32_t>(q), p);
        stats.fetch_wait_s += wait.elapsed_s();
        if (!r.is_ok()) return r.status();
        src = *r;
      } else {
        src = gatherer->poll(static_cast<uint32_t>(q), p);
        if (src == nullptr) {
          *would_block = true;
          return Status::ok();
        }
      }
      Status st;
      issue_h2d(p, src, &st);
      return st;
    }
    if (swapper == nullptr) {
      Status st;
      issue_h2d(p, x.host, &st);
      return st;
    }
    if (x.nvme_bytes > 0 && swapper->buffers_free() == 0 && !buffered.empty()) {
      const uint32_t oldest = buffered.front();
      if (!blocking && params[oldest].state != Residence::kCopying) {
        *would_block = true;
        return Status::ok();
      }
      Stopwatch wait;
      Status st = complete(oldest);
      stats.fetch_wait_s += wait.elapsed_s();
      if (!st.is_ok()) {
        // A held param's error belongs to this acquire; a prefetched one is fetched again (and its
        // error reported) by the acquire that needs it.
        if (params[oldest].holds > 0) return st;
        drop(oldest);
      }
    }
    ZO_ASSIGN_OR_RETURN(x.handle, swapper->fetch(p));
    x.has_handle = true;
    if (x.handle.buffer >= 0) {
      buffered.push_back(p);
      x.state = Residence::kReading;
      return Status::ok();
    }
    ZO_ASSIGN_OR_RETURN(auto span, swapper->wait(x.handle));  // CPU-resident: no I/O
    Status st;
    issue_h2d(p, span.data(), &st);
    return st;
  }

  Status place_block(uint32_t b, uint64_t cur) {
    const std::vector<uint32_t>& ps = schedule.fetched[b];
    for (int attempt = 0; attempt < 2; ++attempt) {
      bool placed_all = true;
      for (uint32_t p : ps) {
        if (params[p].state != Residence::kAbsent) continue;
        while (!try_place(p)) {
          const int64_t victim = pick_victim(cur, nullptr);
          if (victim < 0) {
            placed_all = false;
            break;
          }
          drop(static_cast<uint32_t>(victim));
          ++stats.evictions;
        }
        if (!placed_all) break;
      }
      if (placed_all) return Status::ok();
      // Fragmentation: drop this block's own params that nobody holds and place it again in order.
      for (uint32_t p : ps) {
        if (!params[p].persistent && params[p].holds == 0) drop(p);
      }
    }
    uint64_t need = 0;
    for (uint32_t p : ps) need += params[p].persistent ? 0 : slot_bytes(params[p]);
    std::string held;
    for (uint32_t other = 0; other < n_blocks; ++other) {
      if (block_holds[other] > 0) held += (held.empty() ? "" : ", ") + block_text(other);
    }
    return out_of_memory("acquire " + block_text(b) + ": its params need " + bytes_text(need) +
                         " of the coordinator arena's " + bytes_text(dynamic.size_bytes()) +
                         " for fetched params, but " + bytes_text(dynamic.size_bytes() - dynamic.free_bytes()) +
                         " are held by blocks still acquired (" + held + "); release them first");
  }

  void prefetch(uint64_t cur) {
    for (uint64_t q = cur + 1; q < 2 * uint64_t{n_blocks}; ++q) {
      for (uint32_t p : schedule.fetched[block_at(q)]) {
        Param& x = params[p];
        if (x.state != Residence::kAbsent) {
          frontier = std::max(frontier, q);
          continue;
        }
        if (ahead_elems + x.n_elems > options.prefetch_bucket_elems) return;
        if (gate != nullptr && gate->final_prefix() < x.groups_end) return;  // not updated yet
        if (!x.persistent && live_elems + x.n_elems > options.max_live_elems) return;
        while (!try_place(p)) {
          const int64_t victim = pick_victim(cur, &q);
          if (victim < 0) return;
          drop(static_cast<uint32_t>(victim));
          ++stats.evictions;
        }
        bool would_block = false;
        Status st = start_fetch(p, q, /*blocking=*/false, &would_block);
        if (!st.is_ok() || would_block) {
          // A failed prefetch is retried, and its error reported, by the acquire that needs it.
          if (!st.is_ok())
            ZO_LOG(kDebug) << "coordinator: prefetch of " << param_name(p) << " failed: " << st.to_string();
          drop(p);
          return;
        }
        x.ahead = true;
        ahead_elems += x.n_elems;
        ++stats.prefetches;
        frontier = std::max(frontier, q);
      }
    }
  }

  void unhold(uint32_t b) {
    --block_holds[b];
    for (uint32_t p : schedule.fetched[b]) --params[p].holds;
  }
};

ParamCoordinator::ParamCoordinator(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
ParamCoordinator::~ParamCoordinator() = default;

Result<std::unique_ptr<ParamCoordinator>> ParamCoordinator::create(StateStore& store, ParamSwapper* param_swapper,
                                                                   std::vector<std::vector<uint32_t>> blocks,
                                                                   std::vector<std::string> block_names,
                                                                   const CoordinatorOptions& options,
                                                                   BlockGatherer* gatherer) {
  const ParamRegistry& registry = store.registry();
  const bool gathered = store.plan().partition_params;
  if (blocks.empty()) return invalid_argument("parameter coordinator: no blocks");
  if (gathered != (gatherer != nullptr)) {
    return invalid_argument(
        gathered ? "parameter coordinator: this rank holds a partition of the params; it needs a gatherer"
                 : "parameter coordinator: a gatherer, but the params are not partitioned");
  }
  if (gathered && param_swapper != nullptr)
    return invalid_argument("parameter coordinator: gathered params are not read through a parameter swapper");
  if (block_names.size() != blocks.size()) {
    return invalid_argument("parameter coordinator: " + std::to_string(blocks.size()) + " blocks but " +
                            std::to_string(block_names.size()) + " block names");
  }
  auto impl = std::make_unique<Impl>();
  Impl& s = *impl;
  s.store = &store;
  s.swapper = param_swapper;
  s.gatherer = gatherer;
  s.device = &store.device();
  s.options = options;
  s.n_blocks = static_cast<uint32_t>(blocks.size());
  s.blocks = std::move(blocks);
  s.names = std::move(block_names);
  s.params.resize(registry.params().size());
  s.block_holds.assign(s.n_blocks, 0);
  s.block_pos.assign(s.n_blocks, 0);
  s.compute_dtype = store.plan().placement.compute_dtype;
  const uint64_t cb = state_elem_bytes(store.plan().placement, StateKind::kCompute);

  for (uint32_t b = 0; b < s.n_blocks; ++b) {
    for (uint32_t p : s.blocks[b]) {
      if (p >= s.params.size()) {
        return invalid_argument("parameter coordinator: block '" + s.names[b] + "' uses param id " + std::to_string(p) +
                                " but the registry has " + std::to_string(s.params.size()) + " params");
      }
    }
  }
  s.schedule = FetchSchedule::build(registry, store.plan().placement, s.blocks, options, gathered);
  for (uint32_t p = 0; p < s.params.size(); ++p) {
    Impl::Param& x = s.params[p];
    const ParamInfo& info = registry.params()[p];
    x.n_elems = info.weights();
    x.bytes = info.weights() * cb;
    x.src_bytes = info.n_elems * cb;
    x.packed = info.packed;
    const auto pieces = registry.pieces_of_param(p);
    x.groups_end = pieces.back().sub_group + 1;
    x.persistent = s.schedule.persistent[p];
    if (gathered) continue;  // from the gatherer's slots: nothing of the store's locations is used
    const StateLocation& first = store.location(pieces.front().sub_group, StateKind::kCompute);
    uint32_t on_device = 0;
    for (const ParamPiece& piece : pieces) {
      const StateLocation& loc = store.location(piece.sub_group, StateKind::kCompute);
      on_device += loc.tier == Tier::kDevice ? 1 : 0;
      if (loc.tier == Tier::kNvme) x.nvme_bytes += piece.n_elems * cb;
      // A split param is contiguous in every tier (non-final pieces fill whole sub-groups whose
      // sizes are 4096-element multiples), so one address and one copy cover it.
      if (loc.tier == first.tier && loc.tier == Tier::kDevice) {
        ZO_CHECK((loc.device + piece.group_offset * cb) ==
                 (first.device + (pieces.front().group_offset + piece.param_offset) * cb))
            << "param " << info.name << ": its device compute copy is not contiguous";
      } else if (loc.tier == first.tier && loc.tier == Tier::kCpu && param_swapper == nullptr) {
        ZO_CHECK(loc.host + piece.group_offset * cb ==
                 first.host + (pieces.front().group_offset + piece.param_offset) * cb)
            << "param " << info.name << ": its CPU compute copy is not contiguous";
      }
    }
    if (on_device != 0 && on_device != pieces.size()) {
      return internal_error("parameter coordinator: param " + info.name +
                            " has its compute copy partly on the device and partly off it");
    }
    x.on_device = !s.schedule.fetches[p];
    if (x.packed && on_device != 0) x.packed_home = first.device + pieces.front().group_offset * cb;
    if (x.on_device != (on_device != 0) && !x.packed_home) {
      return internal_error("parameter coordinator: param " + info.name + "'s compute copy is " +
                            (x.on_device ? "off" : "on") + " the device in the store, not where the placement puts it");
    }
    if (x.on_device) x.home = first.device + pieces.front().group_offset * cb;
    if (!x.on_device && !x.packed_home && param_swapper == nullptr) {
      if (x.nvme_bytes > 0) {
        return invalid_argument("parameter coordinator: param " + info.name +
                                " has its compute copy on NVMe but no ParamSwapper was given");
      }
      x.host = first.host + pieces.front().group_offset * cb;
    }
  }

  // The schedule's positions of every use, and the elements up to each position.
  s.block_groups_end.assign(s.n_blocks, 0);
  for (uint32_t b = 0; b < s.n_blocks; ++b) {
    for (uint32_t p : s.blocks[b]) s.block_groups_end[b] = std::max(s.block_groups_end[b], s.params[p].groups_end);
  }
  for (uint32_t p = 0; p < s.params.size(); ++p) s.params[p].used = s.schedule.used[p] != 0;
  s.mark_epoch = 1;  // no param is marked (Param::mark == mark_epoch) before the first acquire
  const uint32_t n_pos = s.schedule.positions();
  s.prefix.assign(2 * n_pos + 1, 0);
  for (uint32_t q = 0; q < 2 * n_pos; ++q) s.prefix[q + 1] = s.prefix[q] + s.schedule.block_elems[s.block_at(q)];
  for (uint32_t q = 0; q < n_pos; ++q) {
    for (uint32_t p : s.schedule.fetched[s.block_at(q)]) s.params[p].uses.push_back(q);
  }

  // Arena sizing (Note [Prefetch and release]): from the same schedule; the persistent params get
  // their slots in registry order.
  const ArenaPlan ap = plan_arena(s.schedule, options);
  s.options.prefetch_bucket_elems = ap.prefetch_bucket_elems;
  uint64_t persistent_bytes = 0;
  for (uint32_t p = 0; p < s.params.size(); ++p) {
    if (!s.schedule.used[p] || !s.schedule.persistent[p]) continue;
    s.params[p].offset = persistent_bytes;
    persistent_bytes += s.schedule.slot_bytes[p];
  }
  const uint64_t largest = ap.largest_block_bytes;
  const uint32_t largest_block = ap.largest_block;
  s.staging_bytes = ap.staging_bytes;

  if (ap.total_bytes() > 0) {
    const gpu::DeviceStats ds = s.device->stats();
    uint64_t left = ds.budget_bytes > ds.allocated_bytes ? ds.budget_bytes - ds.allocated_bytes : 0;
    left = left > options.device_reserve_bytes ? left - options.device_reserve_bytes : 0;
    if (persistent_bytes + s.staging_bytes + largest > left) {
      const uint64_t block_elems_off = ap.largest_block_elems;
      std::string msg = "gpu budget " + bytes_text(ds.budget_bytes) + " leaves " + bytes_text(left) + " for parameters";
      if (options.device_reserve_bytes > 0)
        msg += " (after " + bytes_text(ds.allocated_bytes) + " in use and a reserve of " +
               bytes_text(options.device_reserve_bytes) + ")";
      else msg += " (after " + bytes_text(ds.allocated_bytes) + " in use)";
      msg += "; block '" + s.names[largest_block] + "' alone needs " + bytes_text(largest) + " (" +
             std::to_string(block_elems_off) + " elements, compute dtype " + std::string(dtype_name(s.compute_dtype)) +
             ")";
      if (persistent_bytes > 0) {
        msg += " besides " + bytes_text(persistent_bytes) +
               " for the persistent params (stage3_param_persistence_threshold " +
               std::to_string(options.persistence_threshold_elems) + ")";
      }
      if (s.staging_bytes > 0)
        msg += " besides " + bytes_text(s.staging_bytes) + " to stage the largest 4-bit weight's blob";
      return out_of_memory(msg + "; raise zoffload.gpu_memory_limit or offload fewer states to the device");
    }
    s.persistent_bytes = persistent_bytes;
    s.arena_bytes = ap.bytes_within(left);
    ZO_ASSIGN_OR_RETURN(s.arena, s.device->allocate(s.arena_bytes));
    store.accounting().add_resident(Tier::kDevice, s.arena_bytes);
  }
  const uint64_t dynamic_begin = s.persistent_bytes + s.staging_bytes;
  s.dynamic = detail::RangeAllocator(dynamic_begin, s.arena_bytes - dynamic_begin, gpu::kDeviceAlignment);
  s.stats.arena_bytes = s.arena_bytes;
  ZO_ASSIGN_OR_RETURN(s.stream, s.device->create_stream());
  for (Impl::Param& x : s.params) {
    if (x.used && !x.on_device) { ZO_ASSIGN_OR_RETURN(x.event, s.device->create_event()); }
  }
  return std::unique_ptr<ParamCoordinator>(new ParamCoordinator(std::move(impl)));
}

void ParamCoordinator::begin_micro_step() {
  Impl& s = *impl_;
  for (uint32_t b = 0; b < s.n_blocks; ++b) {
    while (s.block_holds[b] > 0) s.unhold(b);
  }
  if (s.gatherer != nullptr) {
    // An abandoned micro-step may have left copies out of slots the gatherer is about to refill.
    if (s.in_step && s.pos < 2 * s.n_blocks) {
      for (uint32_t p = 0; p < s.params.size(); ++p) s.drop(p);
    }
    s.gatherer->begin_micro_step();
  }
  s.in_step = true;
  s.pos = 0;
  s.frontier = 0;
}

Result<std::vector<gpu::DevicePtr>> ParamCoordinator::acquire(uint32_t block) {
  ZO_ASSIGN_OR_RETURN(Acquired a, impl_->acquire(block, /*wait=*/true));
  return std::move(a.ptrs);
}

Result<ParamCoordinator::Acquired> ParamCoordinator::acquire_async(uint32_t block) {
  return impl_->acquire(block, /*wait=*/false);
}

Result<ParamCoordinator::Acquired> ParamCoordinator::Impl::acquire(uint32_t block, bool wait_copies) {
  Impl& s = *this;
  if (!s.in_step) return failed_precondition("acquire " + s.block_text(block) + ": begin_micro_step was not called");
  if (s.pos >= 2 * s.n_blocks) {
    return failed_precondition("acquire " + s.block_text(block) + ": the micro-step's " +
                               std::to_string(2 * s.n_blocks) + " acquires are done; call begin_micro_step first");
  }
  const uint32_t expected = s.block_at(s.pos);
  if (block != expected) {
    return failed_precondition("acquire out of schedule order: expected " + s.block_text(expected) + " (" +
                               s.position_text(s.pos) + "), given " + s.block_text(block));
  }
  const uint64_t cur = s.pos;
  const std::vector<uint32_t>& ps = s.schedule.fetched[block];
  if (s.gate != nullptr && s.gate->final_prefix() < s.block_groups_end[block]) {
    Stopwatch wait;
    Status st = s.gate->wait_prefix(s.block_groups_end[block]);
    s.stats.update_wait_s += wait.elapsed_s();
    if (!st.is_ok()) {
      return st.with_context("acquire " + s.block_text(block) + ": the optimizer step updating it failed");
    }
  }

  ++s.mark_epoch;
  for (uint32_t p : ps) {
    Impl::Param& x = s.params[p];
    x.mark = s.mark_epoch;
    if (x.state != Residence::kAbsent) ++s.stats.hits;
    if (x.ahead) {
      x.ahead = false;
      s.ahead_elems -= x.n_elems;
    }
  }
  ZO_RETURN_IF_ERROR(s.place_block(block, cur));
  ++s.block_holds[block];
  for (uint32_t p : ps) ++s.params[p].holds;

  // On failure the block's params whose transfer never started (or failed) leave the arena, so a
  // retried acquire fetches them; transfers in flight stay valid and complete later.
  auto fail = [&](uint32_t p, Status st) -> Status {
    s.drop(p);
    for (uint32_t q : ps) {
      if (s.params[q].state == Residence::kPlaced) s.drop(q);
    }
    s.unhold(block);
    return st.with_context("acquire " + s.block_text(block));
  };
  for (uint32_t p : ps) {
    if (s.params[p].state != Residence::kPlaced) continue;
    bool would_block = false;
    Status st = s.start_fetch(p, cur, /*blocking=*/true, &would_block);
    if (!st.is_ok()) return fail(p, std::move(st));
  }
  // Runs `step` (which may wait) over the block's params, counting the time as fetch wait; the
  // first failure fails the acquire.
  auto for_each_waiting = [&](auto step) -> Status {
    Stopwatch wait;
    for (uint32_t p : ps) {
      Status st = step(p);
      if (!st.is_ok()) {
        s.stats.fetch_wait_s += wait.elapsed_s();
        return fail(p, std::move(st));
      }
    }
    s.stats.fetch_wait_s += wait.elapsed_s();
    return Status::ok();
  };
  ZO_RETURN_IF_ERROR(for_each_waiting([&](uint32_t p) { return s.finish_read(p); }));
  // The copy stream runs in order: the block is resident when the last of its copies queued has
  // landed, and that copy's own event says so (no later prefetch copy is waited for).
  gpu::Event ready;
  if (!wait_copies) {
    uint64_t last = 0;
    for (uint32_t p : ps) {
      const Impl::Param& x = s.params[p];
      if (x.state == Residence::kCopying && x.copy_seq > last) {
        last = x.copy_seq;
        ready = x.event;
      }
    }
  }
  s.prefetch(cur);
  if (s.gatherer != nullptr) {
    // The gatherer reuses this position's slot once done(): every copy out of it must have landed
    // (the block's own, and those prefetched for it earlier).
    ZO_RETURN_IF_ERROR(for_each_waiting([&](uint32_t p) { return s.complete(p); }));
    s.gatherer->done(static_cast<uint32_t>(cur));
    ready = gpu::Event{};
  } else if (wait_copies) {
    ZO_RETURN_IF_ERROR(for_each_waiting([&](uint32_t p) { return s.complete(p); }));
  }

  s.block_pos[block] = s.pos;
  ++s.pos;
  Acquired out;
  out.ready = ready;
  out.ptrs.reserve(s.blocks[block].size());
  for (uint32_t p : s.blocks[block]) {
    const Impl::Param& x = s.params[p];
    ZO_CHECK(x.on_device || x.state == Residence::kResident ||
             (!wait_copies && s.gatherer == nullptr && x.state == Residence::kCopying))
        << "acquire: param " << s.param_name(p) << " neither resident nor being copied";
    out.ptrs.push_back(x.on_device ? x.home : s.arena + x.offset);
  }
  return out;
}

Status ParamCoordinator::release(uint32_t block) { return release(block, gpu::Event{}); }

Status ParamCoordinator::release(uint32_t block, gpu::Event reads_done) {
  Impl& s = *impl_;
  if (block >= s.n_blocks || s.block_holds[block] == 0) {
    return failed_precondition("release " + s.block_text(block) + ": the block is not acquired");
  }
  if (reads_done) ZO_RETURN_IF_ERROR(s.device->wait(s.stream, reads_done));
  s.unhold(block);
  const uint64_t cur = s.block_pos[block];
  for (uint32_t p : s.schedule.fetched[block]) {
    s.settle(p);
    const Impl::Param& x = s.params[p];
    if (x.holds > 0 || x.persistent || x.state == Residence::kAbsent) continue;
    Impl::Param& y = s.params[p];
    const uint64_t use = s.next_use(p, cur);
    const uint64_t distance = s.prefix[use] - s.prefix[cur + 1];
    if (distance <= s.options.max_reuse_distance_elems) continue;
    if (use <= s.frontier && !y.ahead) {
      // Prefetch already passed its next use (it was present then): keep it as if prefetched.
      y.ahead = true;
      s.ahead_elems += y.n_elems;
      continue;
    }
    s.drop(p);
  }
  return Status::ok();
}

void ParamCoordinator::invalidate() {
  Impl& s = *impl_;
  for (uint32_t b = 0; b < s.n_blocks; ++b) {
    ZO_CHECK(s.block_holds[b] == 0) << "invalidate() while " << s.block_text(b) << " is acquired";
  }
  for (uint32_t p = 0; p < s.params.size(); ++p) s.drop(p);
}

void ParamCoordinator::set_update_gate(UpdateGate* gate) { impl_->gate = gate; }

CoordinatorStats ParamCoordinator::stats() const { return impl_->stats; }

}  // namespace zo::engine

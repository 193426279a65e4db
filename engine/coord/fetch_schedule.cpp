#include "engine/coord/fetch_schedule.h"

#include <algorithm>

#include "common/bytes.h"
#include "engine/coord/range_allocator.h"
#include "gpu/device.h"

namespace zo::engine {

CoordinatorOptions CoordinatorOptions::from_config(const Config& config) {
  CoordinatorOptions o;
  o.prefetch_bucket_elems = config.zero.stage3_prefetch_bucket_size;
  o.max_live_elems = config.zero.stage3_max_live_parameters;
  o.persistence_threshold_elems = config.zero.stage3_param_persistence_threshold;
  o.max_reuse_distance_elems = config.zero.stage3_max_reuse_distance;
  return o;
}

FetchSchedule FetchSchedule::build(const ParamRegistry& registry, const Placement& placement,
                                   const std::vector<std::vector<uint32_t>>& blocks, const CoordinatorOptions& options,
                                   bool gathered) {
  const uint64_t cb = state_elem_bytes(placement, StateKind::kCompute);
  const detail::RangeAllocator sizing(0, 0, gpu::kDeviceAlignment);
  const size_t n_params = registry.params().size();
  FetchSchedule s;
  s.n_blocks = static_cast<uint32_t>(blocks.size());
  s.fetched.resize(s.n_blocks);
  s.block_elems.assign(s.n_blocks, 0);
  s.used.assign(n_params, 0);
  s.fetches.assign(n_params, 0);
  s.persistent.assign(n_params, 0);
  s.slot_bytes.assign(n_params, 0);
  s.n_elems.assign(n_params, 0);
  s.staged.assign(n_params, 0);
  s.blob_bytes.assign(n_params, 0);
  for (const ParamInfo& info : registry.params()) {
    const uint32_t p = info.id;
    const bool off_device =
        gathered || placement.compute[registry.pieces_of_param(p).front().sub_group] != Tier::kDevice;
    s.n_elems[p] = info.weights();
    s.slot_bytes[p] = sizing.rounded(info.weights() * cb);
    s.blob_bytes[p] = info.n_elems * cb;
    s.staged[p] = info.packed && off_device;
    s.fetches[p] = off_device || info.packed;
    s.persistent[p] = s.fetches[p] && info.weights() <= options.persistence_threshold_elems;
  }
  std::vector<uint32_t> seen(n_params, UINT32_MAX);  // the last block that listed the param
  for (uint32_t b = 0; b < s.n_blocks; ++b) {
    for (uint32_t p : blocks[b]) {
      ZO_CHECK_LT(p, n_params);
      if (seen[p] == b) continue;
      seen[p] = b;
      s.used[p] = 1;
      s.block_elems[b] += s.n_elems[p];
      if (s.fetches[p]) s.fetched[b].push_back(p);
    }
  }
  return s;
}

ArenaPlan plan_arena(const ParamRegistry& registry, const Placement& placement,
                     const std::vector<std::vector<uint32_t>>& blocks, const CoordinatorOptions& options,
                     bool gathered) {
  return plan_arena(FetchSchedule::build(registry, placement, blocks, options, gathered), options);
}

ArenaPlan plan_arena(const FetchSchedule& schedule, const CoordinatorOptions& options) {
  const auto& fetched = schedule.fetched;
  const auto& elems = schedule.n_elems;
  const auto& slot = schedule.slot_bytes;
  const auto& persistent = schedule.persistent;
  const uint32_t n_blocks = schedule.n_blocks;
  ArenaPlan out;
  uint64_t ceiling = 0;
  const detail::RangeAllocator sizing(0, 0, gpu::kDeviceAlignment);
  for (size_t p = 0; p < schedule.used.size(); ++p) {
    if (!schedule.used[p] || !schedule.fetches[p]) continue;
    (persistent[p] ? out.persistent_bytes : ceiling) += slot[p];
    if (schedule.staged[p]) out.staging_bytes = std::max(out.staging_bytes, sizing.rounded(schedule.blob_bytes[p]));
  }
  uint64_t largest_block_fetch_elems = 0;  // a block's fetched elements, persistent ones included
  for (uint32_t b = 0; b < n_blocks; ++b) {
    uint64_t need = 0, block_elems = 0, fetch_elems = 0;
    for (uint32_t p : fetched[b]) {
      fetch_elems += elems[p];
      if (persistent[p]) continue;
      need += slot[p];
      block_elems += elems[p];
      out.largest_param_elems = std::max(out.largest_param_elems, elems[p]);
    }
    largest_block_fetch_elems = std::max(largest_block_fetch_elems, fetch_elems);
    if (need > out.largest_block_bytes) {
      out.largest_block_bytes = need;
      out.largest_block = b;
      out.largest_block_elems = block_elems;
    }
  }
  out.prefetch_bucket_elems = options.prefetch_bucket_elems;
  if (options.prefetch_bucket_elems > 0 && options.prefetch_bucket_elems < out.largest_param_elems) {
    out.prefetch_bucket_elems = largest_block_fetch_elems;
    out.prefetch_by_blocks = true;
  }
  // The dynamic region: the most that any position's block plus what prefetch would fetch ahead of
  // it from an empty arena needs, in slots (at least the largest block; at most every fetchable param).
  const uint32_t n_pos = schedule.positions();
  std::vector<uint32_t> mark(elems.size(), UINT32_MAX);  // the position that counted the param
  uint64_t dynamic_bytes = out.largest_block_bytes;
  for (uint32_t q = 0; q < n_pos; ++q) {
    uint64_t bytes = 0, live = 0, ahead = 0;
    for (uint32_t p : fetched[schedule.block_at(q)]) {
      mark[p] = q;
      if (!persistent[p]) {
        bytes += slot[p];
        live += elems[p];
      }
    }
    bool full = false;
    for (uint32_t r = q + 1; r < n_pos && !full; ++r) {
      for (uint32_t p : fetched[schedule.block_at(r)]) {
        if (mark[p] == q) continue;
        mark[p] = q;
        if (ahead + elems[p] > out.prefetch_bucket_elems ||
            (!persistent[p] && live + elems[p] > options.max_live_elems)) {
          full = true;
          break;
        }
        ahead += elems[p];
        if (!persistent[p]) {
          bytes += slot[p];
          live += elems[p];
        }
      }
    }
    dynamic_bytes = std::max(dynamic_bytes, bytes);
  }
  // Slack against fragmentation: blocks of different sizes leave holes a prefetch cannot use (live
  // elements are still bounded by the prefetch check, not by the arena).
  if (dynamic_bytes > out.largest_block_bytes) dynamic_bytes += out.largest_block_bytes;
  out.dynamic_bytes = std::min(dynamic_bytes, std::max(out.largest_block_bytes, ceiling));
  return out;
}

uint64_t ArenaPlan::bytes_within(uint64_t left) const {
  const uint64_t fixed = persistent_bytes + staging_bytes;
  const uint64_t room = left > fixed ? align_down(left - fixed, gpu::kDeviceAlignment) : 0;
  return fixed + std::min(dynamic_bytes, room);
}

}  // namespace zo::engine

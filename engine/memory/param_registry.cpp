#include "engine/memory/param_registry.h"

#include <algorithm>
#include <limits>
#include <unordered_set>

#include "common/bytes.h"
#include "common/check.h"
#include "common/string_util.h"

namespace zo::engine {

// Note [Partitions]
// Data-parallel ranks each own the optimizer states of one partition of the flat parameter space
// (ZeRO stages 1-3, docs/design.md "Scaling out"), as DeepSpeed gives each rank 1/N of the
// flattened parameters. The partitions are contiguous, so each rank's states are one run of every
// checkpoint state file; their boundaries sit near total·r/N, moved to the nearest element a split
// may cut at (a multiple of kSplitAlignElems from the param's start, or its end); and no sub-group
// crosses one, so a rank steps whole sub-groups. A param cut by a boundary starts a sub-group of
// its own, so its pieces stay back to back (the layout rule below). The sub-groups, and with them
// the order of the norm's partial sums, therefore depend on the number of partitions: a
// data-parallel run cuts into one partition per rank whatever its ZeRO stage, so stage 0 and stages
// 1-3 at one world size lay out alike.
// Note [Frozen sub-groups]
// A frozen param (ParamSpec::trainable false: a fine-tune's frozen embedding or layers, a LoRA
// adapter's base weights) is fetched for the forward like any other and never updated, so it needs
// its compute copy and nothing else: no master, no moments, no gradient accumulator, no record in
// the optimizer's swap file. The registry keeps frozen and trainable params in different sub-groups
// (a param whose trainability differs from the open group's closes it, as a param that does not fit
// does), so a sub-group is frozen or trainable whole and every per-sub-group structure stays dense:
// the Adam kernels, the 8-bit moment layout and the swap records never see a hole. With nothing
// frozen the rule never fires and the layout is the one it always was. MemoryPlan::frozen marks the
// frozen sub-groups; holds() is false for their other states, which removes them from the plan's
// bytes, the store's allocation and the swap files in one place; plan.stepped lists the sub-groups
// this rank steps (owned and trainable), which the optimizer's loops walk, and the optimizer's
// buffers are sized for the largest trainable sub-group. The partitions of data-parallel ranks are
// still cut by all elements, so the compute copies, which frozen params dominate, stay balanced.
// Above the store: the gradient accumulator expects no gradient of a frozen param, the update gate
// holds a frozen sub-group final while an update runs (UpdateGate's always_final), the data-parallel
// steps neither reduce nor send one, and the trainer computes no gradient for it (requires_grad
// false) and none below the lowest block that trains. zoffload.freeze makes them. A checkpoint keeps
// their compute copies in frozen.safetensors (engine/ckpt/state_files.h), the trainable sub-groups'
// states in the other files.

namespace {

Result<std::vector<uint64_t>> partition_bounds(const std::vector<ParamInfo>& params, uint64_t total, uint32_t n) {
  if (n == 0) return invalid_argument("parameter registry: 0 partitions");
  std::vector<uint64_t> bounds;
  uint64_t start = 0;
  size_t p = 0;
  for (uint32_t r = 1; r < n; ++r) {
    const auto target = static_cast<uint64_t>(static_cast<unsigned __int128>(total) * r / n);
    while (p < params.size() && start + params[p].n_elems <= target) start += params[p++].n_elems;
    uint64_t b = total;
    if (p < params.size()) {
      const uint64_t offset = (target - start + kSplitAlignElems / 2) / kSplitAlignElems * kSplitAlignElems;
      b = start + std::min(offset, params[p].n_elems);
    }
    if (b >= total || (!bounds.empty() && b <= bounds.back()) || b == 0) {
      return invalid_argument("the model's " + std::to_string(total) + " parameters are too few to partition over " +
                              std::to_string(n) + " data-parallel ranks (a partition ends between two params or " +
                              std::to_string(kSplitAlignElems) + "·k elements into one, and none may be empty)");
    }
    bounds.push_back(b);
  }
  return bounds;
}

}  // namespace

Result<ParamRegistry> ParamRegistry::build(std::vector<ParamSpec> params, uint64_t sub_group_size,
                                           uint32_t n_partitions) {
  if (params.empty()) return invalid_argument("parameter registry: the model has no trainable parameters");
  if (sub_group_size < kSplitAlignElems) {
    return invalid_argument("zero_optimization.sub_group_size: " + std::to_string(sub_group_size) +
                            " elements is below the minimum of " + std::to_string(kSplitAlignElems) +
                            " (pieces of split params are aligned to that many elements)");
  }
  ParamRegistry r;
  r.params_.reserve(params.size());
  std::unordered_set<std::string> names;
  for (size_t i = 0; i < params.size(); ++i) {
    ParamSpec& spec = params[i];
    const std::string label = spec.name.empty() ? "parameter #" + std::to_string(i) : "parameter " + spec.name;
    if (spec.name.empty()) return invalid_argument(label + " has an empty name");
    if (!names.insert(spec.name).second) return invalid_argument(label + " is registered twice");
    uint64_t n = 1;
    for (int64_t d : spec.shape) {
      if (d < 1) return invalid_argument(label + " has a dimension of " + std::to_string(d) + " (each must be ≥ 1)");
      if (n > std::numeric_limits<uint64_t>::max() / static_cast<uint64_t>(d)) {
        return invalid_argument(label + " has too many elements");
      }
      n *= static_cast<uint64_t>(d);
    }
    if (spec.packed() && spec.trainable) return invalid_argument(label + " is packed in 4 bits but trainable");
    ParamInfo info;
    info.id = static_cast<uint32_t>(i);
    info.name = std::move(spec.name);
    info.shape = std::move(spec.shape);
    info.n_elems = spec.packed() ? spec.storage_elems : n;
    info.weight_elems = spec.packed() ? n : 0;
    info.packed = spec.packed();
    info.trainable = spec.trainable;
    r.params_.push_back(std::move(info));
  }
  // Finding 1 of issue 19: a model the plan could never hold must not cost RAM in proportion to its
  // claims: the sub-group table is counted before it is built.
  uint64_t total = 0;
  for (const ParamInfo& p : r.params_) {
    if (__builtin_add_overflow(total, p.n_elems, &total) ||
        __builtin_add_overflow(r.total_weights_, p.weights(), &r.total_weights_))
      return invalid_argument("the model has more elements than 64 bits count");
    if (p.packed) r.packed_elems_ += p.n_elems;
  }
  const uint64_t groups_at_least = total / (sub_group_size / kSplitAlignElems * kSplitAlignElems);
  if (groups_at_least > kMaxSubGroups) {
    return invalid_argument("zero_optimization.sub_group_size: " + std::to_string(sub_group_size) +
                            " elements cuts the model's " + std::to_string(total) + " elements into more than " +
                            std::to_string(kMaxSubGroups) + " sub-groups; raise it to at least " +
                            std::to_string(align_up(total / kMaxSubGroups + 1, kSplitAlignElems)));
  }

  // The layout rule (see the header): whole params are packed while they fit; a param that does
  // not fit closes the current group. A param too big for an empty group is cut into pieces of
  // `split` elements, each filling a group of its own, and only its last piece may share a group
  // with the params after it. So every group holding a non-final piece has a multiple of
  // kSplitAlignElems elements, and the pieces of one param sit in consecutive groups back to back:
  // laid out as 4 KiB-aligned per-group regions, a param's compute copy stays contiguous.
  const uint64_t split = sub_group_size / kSplitAlignElems * kSplitAlignElems;
  ZO_ASSIGN_OR_RETURN(const std::vector<uint64_t> bounds, partition_bounds(r.params_, total, n_partitions));
  r.partition_starts_.push_back(0);
  uint64_t flat = 0;
  auto open_group = [&](bool trainable) {
    SubGroup g;
    g.index = static_cast<uint32_t>(r.groups_.size());
    g.first_elem = flat;
    g.first_piece = static_cast<uint32_t>(r.pieces_.size());
    g.trainable = trainable;
    r.groups_.push_back(g);
  };
  auto add_piece = [&](ParamInfo& p, uint64_t param_offset, uint64_t n) {
    SubGroup& g = r.groups_.back();
    r.pieces_.push_back(ParamPiece{p.id, g.index, param_offset, g.n_elems, n});
    ++g.n_pieces;
    ++p.n_pieces;
    g.n_elems += n;
    flat += n;
  };
  // Elements [offset, offset + n) of p, all in one partition.
  // Note [Frozen sub-groups]: a param that differs in trainability from the group's closes it too.
  auto pack = [&](ParamInfo& p, uint64_t offset, uint64_t n, bool fresh_group) {
    if (fresh_group || r.groups_.empty() || r.groups_.back().n_elems + n > sub_group_size ||
        r.groups_.back().trainable != p.trainable)
      open_group(p.trainable);
    if (n <= sub_group_size) {
      add_piece(p, offset, n);
      return;
    }
    // Too big even for the empty group just opened.
    uint64_t done = 0;
    while (n - done > split) {
      if (r.groups_.back().n_elems > 0) open_group(p.trainable);
      add_piece(p, offset + done, split);
      done += split;
    }
    open_group(p.trainable);
    add_piece(p, offset + done, n - done);
  };
  size_t next_bound = 0;
  for (ParamInfo& p : r.params_) {
    p.first_piece = static_cast<uint32_t>(r.pieces_.size());
    const uint64_t start = flat;
    const bool cut = next_bound < bounds.size() && bounds[next_bound] > start && bounds[next_bound] < start + p.n_elems;
    uint64_t done = 0;
    while (done < p.n_elems) {
      bool fresh = cut && done == 0;  // a param cut by a partition starts its own group (contiguity, above)
      if (next_bound < bounds.size() && bounds[next_bound] == flat) {
        r.partition_starts_.push_back(static_cast<uint32_t>(r.groups_.size()));
        ++next_bound;
        fresh = true;
      }
      uint64_t end = p.n_elems;
      if (next_bound < bounds.size() && bounds[next_bound] < start + p.n_elems) end = bounds[next_bound] - start;
      pack(p, done, end - done, fresh);
      done = end;
    }
  }
  ZO_CHECK_EQ(r.partition_starts_.size(), uint64_t{n_partitions}) << "partition bounds not all reached";
  for (const SubGroup& g : r.groups_) {
    ZO_CHECK(g.n_elems > 0 && g.n_elems <= sub_group_size) << "sub-group " << g.index << " has " << g.n_elems;
    r.max_group_elems_ = std::max(r.max_group_elems_, g.n_elems);
    if (!g.trainable) continue;
    r.max_trainable_group_elems_ = std::max(r.max_trainable_group_elems_, g.n_elems);
    r.trainable_elems_ += g.n_elems;
  }
  for (const ParamInfo& p : r.params_) r.max_param_elems_ = std::max(r.max_param_elems_, p.n_elems);
  r.total_elems_ = flat;
  return r;
}

std::pair<uint32_t, uint32_t> ParamRegistry::partition_groups(uint32_t partition) const {
  ZO_CHECK_LT(partition, partition_starts_.size());
  const uint32_t end = partition + 1 < partition_starts_.size() ? partition_starts_[partition + 1]
                                                                : static_cast<uint32_t>(groups_.size());
  return {partition_starts_[partition], end};
}

uint32_t ParamRegistry::partition_of_group(uint32_t sub_group) const {
  ZO_CHECK_LT(sub_group, groups_.size());
  const auto it = std::upper_bound(partition_starts_.begin(), partition_starts_.end(), sub_group);
  return static_cast<uint32_t>(it - partition_starts_.begin()) - 1;
}

std::span<const ParamPiece> ParamRegistry::pieces_of_param(uint32_t param) const {
  ZO_CHECK_LT(param, params_.size());
  const ParamInfo& p = params_[param];
  return std::span<const ParamPiece>(pieces_).subspan(p.first_piece, p.n_pieces);
}

std::span<const ParamPiece> ParamRegistry::pieces_of_group(uint32_t sub_group) const {
  ZO_CHECK_LT(sub_group, groups_.size());
  const SubGroup& g = groups_[sub_group];
  return std::span<const ParamPiece>(pieces_).subspan(g.first_piece, g.n_pieces);
}

Result<uint32_t> ParamRegistry::find(const std::string& name) const {
  for (const ParamInfo& p : params_) {
    if (p.name == name) return p.id;
  }
  std::vector<std::string> names;
  names.reserve(params_.size());
  for (const ParamInfo& p : params_) names.push_back(p.name);
  std::string msg = "no parameter named \"" + name + "\"";
  const std::string close = closest_match(name, names);
  if (!close.empty()) msg += " (did you mean \"" + close + "\"?)";
  return not_found(msg);
}

}  // namespace zo::engine

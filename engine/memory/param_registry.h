// ParamRegistry: the trainable tensors of a model in a stable order, flattened into sub-groups (the
// unit of the optimizer step and of NVMe swapping), and their partitions for data parallelism.
// Where each state of each sub-group lives is the memory plan's (engine/memory/memory_plan.h).
// Immutable after build(); thread-safe to read.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "common/dtype.h"
#include "common/param_spec.h"
#include "common/status.h"

namespace zo::engine {

// A param larger than a sub-group is split into pieces whose boundaries are multiples of this many
// elements, so every piece of every state starts 4 KiB-aligned in any dtype (fp32: 16 KiB).
inline constexpr uint64_t kSplitAlignElems = 4096;
// At most this many sub-groups (16 M: 16 T elements at DeepSpeed's 1e6 floor of useful sizes);
// checked before the table is built, so an absurd model or size costs no RAM.
inline constexpr uint64_t kMaxSubGroups = uint64_t{1} << 24;

struct ParamInfo {
  uint32_t id = 0;  // index in registration order
  std::string name;
  std::vector<int64_t> shape;
  // The elements of its compute copy, which every state and the sub-groups count: the shape's, or
  // for a packed weight its blob's (ParamSpec::storage_elems).
  uint64_t n_elems = 0;
  bool packed = false;  // ParamSpec::packed(): a frozen 4-bit or 8-bit weight (Note [The packed 4-bit base])
  // A packed weight's own elements (its shape's); 0: n_elems (a ParamInfo made by hand).
  uint64_t weight_elems = 0;
  uint64_t weights() const { return weight_elems != 0 ? weight_elems : n_elems; }
  uint32_t first_piece = 0;  // its pieces are [first_piece, first_piece + n_pieces) of pieces()
  uint32_t n_pieces = 0;
  bool trainable = true;  // ParamSpec::trainable
};

// A run of a param's elements inside one sub-group.
struct ParamPiece {
  uint32_t param = 0;
  uint32_t sub_group = 0;
  uint64_t param_offset = 0;  // elements into the param
  uint64_t group_offset = 0;  // elements into the sub-group
  uint64_t n_elems = 0;
};

struct SubGroup {
  uint32_t index = 0;
  uint64_t n_elems = 0;      // ≤ sub_group_size
  uint64_t first_elem = 0;   // offset of its first element in the flat parameter space
  uint32_t first_piece = 0;  // its pieces, in order: [first_piece, first_piece + n_pieces)
  uint32_t n_pieces = 0;
  bool trainable = true;  // its params' (a sub-group never mixes frozen and trainable params)
};

class ParamRegistry {
 public:
  // Lays the params out in the given order: consecutive whole params are packed into a sub-group
  // while they fit in `sub_group_size` elements; a param that does not fit in an empty sub-group is
  // split into pieces of at most sub_group_size elements (rounded down to kSplitAlignElems). A
  // frozen param never shares a sub-group with a trainable one (Note [Frozen sub-groups]).
  // kInvalidArgument (naming the param) for an empty list, an empty or duplicate name, a
  // dimension < 1, sub_group_size < kSplitAlignElems, or more than kMaxSubGroups sub-groups
  // (naming the sub_group_size that would do).
  // With n_partitions > 1 (data parallel: Note [Partitions] in the .cpp) the flat parameter space
  // is first cut into that many contiguous partitions of nearly equal size, at piece boundaries a
  // split may use, and no sub-group crosses a partition boundary; kInvalidArgument when the model is
  // too small to give every partition an element.
  static Result<ParamRegistry> build(std::vector<ParamSpec> params, uint64_t sub_group_size, uint32_t n_partitions = 1);

  std::span<const ParamInfo> params() const { return params_; }
  std::span<const SubGroup> sub_groups() const { return groups_; }
  std::span<const ParamPiece> pieces() const { return pieces_; }
  std::span<const ParamPiece> pieces_of_param(uint32_t param) const;
  std::span<const ParamPiece> pieces_of_group(uint32_t sub_group) const;
  // The id of the param named `name`; kNotFound naming it (with a close match) otherwise.
  Result<uint32_t> find(const std::string& name) const;

  // The partitions (1 unless build was asked for more) and the sub-groups [first, end) of each.
  uint32_t n_partitions() const { return static_cast<uint32_t>(partition_starts_.size()); }
  std::pair<uint32_t, uint32_t> partition_groups(uint32_t partition) const;
  uint32_t partition_of_group(uint32_t sub_group) const;

  uint64_t total_elems() const { return total_elems_; }
  // The weights of the model: total_elems with each packed weight's own elements, not its blob's.
  uint64_t total_weights() const { return total_weights_; }
  uint64_t packed_weights() const { return total_weights_ - (total_elems_ - packed_elems_); }
  uint64_t packed_elems() const { return packed_elems_; }  // the packed weights' blobs, in elements
  uint64_t max_group_elems() const { return max_group_elems_; }
  // Of the trainable params (Note [Frozen sub-groups]): their elements, and the largest sub-group
  // holding them (0 when every param is frozen).
  uint64_t trainable_elems() const { return trainable_elems_; }
  uint64_t max_trainable_group_elems() const { return max_trainable_group_elems_; }
  uint64_t max_param_elems() const { return max_param_elems_; }

 private:
  std::vector<ParamInfo> params_;
  std::vector<SubGroup> groups_;
  std::vector<ParamPiece> pieces_;
  std::vector<uint32_t> partition_starts_;  // the first sub-group of each partition
  uint64_t total_elems_ = 0;
  uint64_t total_weights_ = 0;
  uint64_t packed_elems_ = 0;
  uint64_t max_group_elems_ = 0;
  uint64_t trainable_elems_ = 0;
  uint64_t max_trainable_group_elems_ = 0;
  uint64_t max_param_elems_ = 0;
};

}  // namespace zo::engine

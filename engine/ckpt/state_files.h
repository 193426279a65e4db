// The state files of a checkpoint: which files hold the optimizer states for fp32, bf16 or 8-bit
// moments, which bytes of each sub-group's state each file carries, and what precedes them (the
// safetensors header; for an 8-bit moment's file, its quantization map). On-disk format:
// docs/checkpoint_format.md. Pure functions; thread-safe.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "engine/ckpt/manifest.h"
#include "engine/memory/memory_plan.h"
#include "engine/model/safetensors.h"
#include "io/env.h"

namespace zo::engine {

// Which bytes of a sub-group's state a file carries (Note [8-bit moment layout] in
// engine/memory/moment_layout.cpp): all of them; an 8-bit moment's aux run (absmax, or the fp32
// moment of a small parameter); or its codes.
enum class StatePart : uint8_t { kWhole, kMomentAux, kMomentCodes };

struct StateFile {
  StateKind kind = StateKind::kMaster;
  StatePart part = StatePart::kWhole;
  const char* name = "";
  DType dtype = DType::kF32;  // a whole state's elements: fp32, or bf16 for bf16 moments or masters
  // kFrozenFile: the frozen sub-groups' compute copies (Note [Frozen sub-groups]); every other file
  // carries the trainable sub-groups' states only.
  bool frozen = false;
};

// A packed weight's compute copy (Note [The packed 4-bit base] in common/bnb4_blob.h) is saved in
// kFrozenFile as its blob: a 1-D tensor of the compute dtype's size per element holding the blob's
// bytes, named the weight's name + this suffix (its bytes are not values of that dtype). The suffix
// says 4-bit for every blob, 8-bit ones too: the header says which (it was named before 8-bit bases).
inline constexpr std::string_view kPackedTensorSuffix = ".zoffload_4bit_blob";
// The tensor a checkpoint lists for registry param `p`: its name and shape, or a packed weight's
// blob as above.
CheckpointTensor checkpoint_tensor(const ParamInfo& p);

// 8-bit moments' codes: one byte per element of each quantized parameter, no header.
inline constexpr const char* kExpAvgCodesFile = "exp_avg.codes";
inline constexpr const char* kExpAvgSqCodesFile = "exp_avg_sq.codes";
// The quantization map an 8-bit moment's safetensors file holds first: F32 [256].
inline constexpr const char* kQuantMapTensor = "zoffload.qmap";

// The state files of a checkpoint whose moments are `moments` and masters `master` (fp32 or bf16),
// in the order a save writes them; and, with `frozen` (the compute dtype, when some params are
// frozen), kFrozenFile last.
std::vector<StateFile> state_files(MomentDtype moments, DType master, std::optional<DType> frozen = std::nullopt);
// The tensors `file` lists of `manifest`'s: the frozen ones for kFrozenFile, else the trainable ones.
const std::vector<CheckpointTensor>& file_tensors(const Manifest& manifest, const StateFile& file);

// Bytes [first, second) of state `file.kind` of sub-group `sub_group` that the file carries.
std::pair<uint64_t, uint64_t> group_part(const ParamRegistry& registry, const Placement& placement, uint32_t sub_group,
                                         const StateFile& file);

// Note [State file layout]: a state file is its prefix (state_file_prefix: the safetensors header
// and, for an 8-bit moment's aux file, the map its codes index), then the part group_part gives of
// every sub-group, in sub-group order, with nothing between them; a sub-group without a part (a
// frozen one in a state file, a trainable one in the frozen file) takes no bytes. A save writes each
// rank's partition at the offset of its first sub-group, a load reads every sub-group back from its
// offset: both ask this one layout.
class StateFileLayout {
 public:
  // `prefix_bytes`: what precedes the parts (as written: the prefix's size; as read: where the
  // file's header puts its first tensor, plus the map of an 8-bit aux file).
  StateFileLayout(const ParamRegistry& registry, const Placement& placement, const StateFile& file,
                  uint64_t prefix_bytes);
  uint32_t sub_groups() const { return static_cast<uint32_t>(parts_.size()); }
  // Sub-group g's part: bytes [first, second) of its state (group_part).
  std::pair<uint64_t, uint64_t> part(uint32_t g) const { return parts_[g]; }
  // The file offset where sub-group g's part begins; offset(sub_groups()) is the end of the file.
  uint64_t offset(uint32_t g) const { return starts_[g]; }
  uint64_t file_bytes() const { return starts_.back(); }

 private:
  std::vector<std::pair<uint64_t, uint64_t>> parts_;
  std::vector<uint64_t> starts_;  // sub_groups() + 1 file offsets
};

// The tensors a state file lists, in file order (none for a codes file): per parameter, F32 for a
// whole fp32 state, BF16 for a bf16 moment; for an 8-bit moment the map, then per parameter its
// absmax (`NAME.absmax`, F32 [blocks]) or, under 4096 elements, its fp32 moment (`NAME`).
std::vector<SafetensorsEntry> state_file_tensors(const StateFile& file, const std::vector<CheckpointTensor>& tensors);

// The bytes a file holds before the sub-groups' parts: the safetensors header (4096-aligned) and
// for an 8-bit moment the map its codes index under `placement` (quant_map); nothing for a codes file.
std::string state_file_prefix(const StateFile& file, const std::vector<CheckpointTensor>& tensors,
                              const Placement& placement);

// The bytes of the sub-groups' parts, all of them: what follows the prefix.
uint64_t state_file_data_bytes(const StateFile& file, const std::vector<CheckpointTensor>& tensors);

// Note [Checked values]: what a state file's values must be for a run to resume from them — every
// float finite; exp_avg_sq (Adam's second moment, Adagrad's sum of squares) and every 8-bit absmax
// ≥ 0 too. `ckpt verify` and a resume check each value as the bytes pass for their checksums, so a
// checkpoint whose CRCs were recomputed over NaN, inf or negative moments is refused by name instead
// of resuming into NaN losses. Codes files hold any byte.
class StateValueCheck {
 public:
  // The ranges of `file` (at `path`) as its safetensors header lists them, or nothing to check for a
  // codes file. Errors as SafetensorsFile::open's.
  static Result<StateValueCheck> open(const StateFile& file, const std::string& path, io::Env* env);
  // Where the tensors' data begins (the file's size for a file with none, 0 for a codes file).
  uint64_t data_start() const { return data_start_; }
  // The file's parsed header; null for a codes file.
  const SafetensorsFile* header() const { return header_.get(); }
  // Checks the whole elements of [offset_bytes, offset_bytes + bytes.size()) of the file; bytes
  // outside every tensor are not looked at. kCorruption "PATH: exp_avg_sq of NAME, element I, is
  // -0.5: ..." for the first value out of its range. Thread-safe.
  Status check(uint64_t offset_bytes, std::span<const std::byte> bytes) const;

 private:
  struct Range {
    uint64_t begin = 0, end = 0;  // absolute file offsets
    DType dtype = DType::kF32;
    bool non_negative = false;
    std::string name;
  };
  std::string path_;
  std::string what_;  // "exp_avg_sq", ...
  uint64_t data_start_ = 0;
  std::unique_ptr<const SafetensorsFile> header_;
  std::vector<Range> ranges_;  // by offset
};

}  // namespace zo::engine

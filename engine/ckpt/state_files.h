// The state files of a checkpoint: which files hold the optimizer states for fp32, bf16 or 8-bit
// moments, which bytes of each sub-group's state each file carries, and what precedes them (the
// safetensors header; for an 8-bit moment's file, its quantization map). On-disk format:
// docs/checkpoint_format.md. Pure functions; thread-safe.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "engine/ckpt/manifest.h"
#include "engine/memory/param_registry.h"
#include "engine/model/safetensors.h"

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

}  // namespace zo::engine

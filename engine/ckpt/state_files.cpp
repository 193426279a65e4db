#include "engine/ckpt/state_files.h"

#include <cstring>

#include "common/check.h"
#include "cpu_optim/adam8bit.h"
#include "engine/memory/moment_layout.h"

namespace zo::engine {

std::vector<StateFile> state_files(MomentDtype moments, DType master, std::optional<DType> frozen) {
  std::vector<StateFile> out;
  if (moments != MomentDtype::k8bit) {
    const DType m = moment_elem_dtype(moments);
    out = {{StateKind::kMaster, StatePart::kWhole, kMasterFile, master},
           {StateKind::kExpAvg, StatePart::kWhole, kExpAvgFile, m},
           {StateKind::kExpAvgSq, StatePart::kWhole, kExpAvgSqFile, m}};
  } else {
    out = {{StateKind::kMaster, StatePart::kWhole, kMasterFile, master},
           {StateKind::kExpAvg, StatePart::kMomentAux, kExpAvgFile},
           {StateKind::kExpAvgSq, StatePart::kMomentAux, kExpAvgSqFile},
           {StateKind::kExpAvg, StatePart::kMomentCodes, kExpAvgCodesFile},
           {StateKind::kExpAvgSq, StatePart::kMomentCodes, kExpAvgSqCodesFile}};
  }
  if (frozen) out.push_back({StateKind::kCompute, StatePart::kWhole, kFrozenFile, *frozen, /*frozen=*/true});
  return out;
}

const std::vector<CheckpointTensor>& file_tensors(const Manifest& manifest, const StateFile& file) {
  return file.frozen ? manifest.frozen : manifest.tensors;
}

std::pair<uint64_t, uint64_t> group_part(const ParamRegistry& registry, const Placement& placement, uint32_t sub_group,
                                         const StateFile& file) {
  // Note [Frozen sub-groups]: a frozen sub-group's compute copy is in kFrozenFile alone, a trainable
  // one's states in the others.
  if (file.frozen == registry.sub_groups()[sub_group].trainable) return {0, 0};
  if (file.part == StatePart::kWhole) return {0, group_state_bytes(placement, registry, sub_group, file.kind)};
  ZO_CHECK(placement.moments == MomentDtype::k8bit) << "an 8-bit part of fp32 moments";
  const MomentLayout layout = moment_layout(registry, sub_group);
  if (file.part == StatePart::kMomentCodes) return {0, layout.codes_bytes};
  return {layout.aux_begin_bytes, layout.total_bytes};
}

std::vector<SafetensorsEntry> state_file_tensors(const StateFile& file, const std::vector<CheckpointTensor>& tensors) {
  std::vector<SafetensorsEntry> out;
  switch (file.part) {
    case StatePart::kWhole:
      for (const CheckpointTensor& t : tensors) out.push_back({t.name, file.dtype, t.shape});
      break;
    case StatePart::kMomentAux:
      out.push_back({kQuantMapTensor, DType::kF32, {256}});
      for (const CheckpointTensor& t : tensors) {
        if (quantized_param(t.n_elems)) {
          out.push_back(
              {t.name + ".absmax", DType::kF32, {static_cast<int64_t>(cpu_optim::quant_block_count(t.n_elems))}});
        } else {
          out.push_back({t.name, DType::kF32, t.shape});
        }
      }
      break;
    case StatePart::kMomentCodes: break;
  }
  return out;
}

std::string state_file_prefix(const StateFile& file, const std::vector<CheckpointTensor>& tensors,
                              const Placement& placement) {
  if (file.part == StatePart::kMomentCodes) return {};
  std::map<std::string, std::string> metadata{{"format", "pt"}, {"zoffload_state", std::string(state_name(file.kind))}};
  if (file.part == StatePart::kMomentAux) metadata["zoffload_moment_dtype"] = "8bit";
  if (file.frozen) metadata["zoffload_frozen"] = "true";
  if (file.frozen) metadata["zoffload_compute_dtype"] = std::string(dtype_name(file.dtype));
  if (file.part == StatePart::kWhole && file.dtype == DType::kBF16 && !file.frozen)
    metadata[file.kind == StateKind::kMaster ? "zoffload_master_dtype" : "zoffload_moment_dtype"] = "bf16";
  std::string out = safetensors_header(state_file_tensors(file, tensors), metadata);
  if (file.part == StatePart::kMomentAux) {
    const auto& map = quant_map(placement, file.kind);
    const size_t at = out.size();
    out.resize(at + sizeof(float) * map.size());
    std::memcpy(out.data() + at, map.data(), sizeof(float) * map.size());
  }
  return out;
}

uint64_t state_file_data_bytes(const StateFile& file, const std::vector<CheckpointTensor>& tensors) {
  uint64_t bytes = 0;
  for (const CheckpointTensor& t : tensors) {
    const bool q = quantized_param(t.n_elems);
    switch (file.part) {
      case StatePart::kWhole: bytes += dtype_size_bytes(file.dtype) * t.n_elems; break;
      case StatePart::kMomentAux: bytes += q ? 4 * cpu_optim::quant_block_count(t.n_elems) : 4 * t.n_elems; break;
      case StatePart::kMomentCodes: bytes += q ? t.n_elems : 0; break;
    }
  }
  return bytes;
}

}  // namespace zo::engine

#include "engine/ckpt/state_files.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "common/check.h"
#include "common/half.h"
#include "common/string_util.h"
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

CheckpointTensor checkpoint_tensor(const ParamInfo& p) {
  if (!p.packed) return {p.name, p.shape, p.n_elems};
  return {p.name + std::string(kPackedTensorSuffix), {static_cast<int64_t>(p.n_elems)}, p.n_elems};
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

StateFileLayout::StateFileLayout(const ParamRegistry& registry, const Placement& placement, const StateFile& file,
                                 uint64_t prefix_bytes) {
  const auto n = static_cast<uint32_t>(registry.sub_groups().size());
  parts_.reserve(n);
  starts_.reserve(n + 1);
  starts_.push_back(prefix_bytes);
  for (uint32_t g = 0; g < n; ++g) {
    parts_.push_back(group_part(registry, placement, g, file));
    starts_.push_back(starts_.back() + (parts_.back().second - parts_.back().first));
  }
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

Result<StateValueCheck> StateValueCheck::open(const StateFile& file, const std::string& path, io::Env* env) {
  StateValueCheck c;
  c.path_ = path;
  c.what_ = file.frozen ? "the frozen weight" : std::string(state_name(file.kind));
  if (file.part == StatePart::kMomentCodes) return c;
  ZO_ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsFile> header, SafetensorsFile::open(path, env));
  c.header_ = std::move(header);
  const auto& ts = c.header_->tensors();
  c.data_start_ = ts.empty() ? c.header_->file_size_bytes() : ts.front().data_offset_bytes;
  for (const SafetensorsTensor& t : ts) {
    if (t.bytes())
      return corruption(path + ": tensor " + t.name + " is " + std::string(t.type_text()) +
                        "; a checkpoint's state files hold floats");
    if (file.frozen && t.name.ends_with(kPackedTensorSuffix)) continue;                // a blob's bytes, not values
    const bool map = file.part == StatePart::kMomentAux && t.name == kQuantMapTensor;  // the signed map is < 0 too
    const bool absmax = file.part == StatePart::kMomentAux && t.name.ends_with(".absmax");
    c.ranges_.push_back({t.data_offset_bytes, t.data_offset_bytes + t.size_bytes, t.dtype,
                         absmax || (!map && !file.frozen && file.kind == StateKind::kExpAvgSq), t.name});
  }
  std::sort(c.ranges_.begin(), c.ranges_.end(), [](const Range& a, const Range& b) { return a.begin < b.begin; });
  return c;
}

Status StateValueCheck::check(uint64_t offset_bytes, std::span<const std::byte> bytes) const {
  const uint64_t end = offset_bytes + bytes.size();
  auto it = std::upper_bound(ranges_.begin(), ranges_.end(), offset_bytes,
                             [](uint64_t off, const Range& r) { return off < r.begin; });
  if (it != ranges_.begin()) --it;
  for (; it != ranges_.end() && it->begin < end; ++it) {
    const Range& r = *it;
    const uint64_t width = dtype_size_bytes(r.dtype);
    // The whole elements of this tensor inside the bytes given.
    uint64_t from = std::max(r.begin, offset_bytes), to = std::min(r.end, end);
    from = r.begin + (from - r.begin + width - 1) / width * width;
    to = r.begin + (to - r.begin) / width * width;
    for (uint64_t pos = from; pos < to; pos += width) {
      const std::byte* p = bytes.data() + (pos - offset_bytes);
      float v = 0;
      if (r.dtype == DType::kF32) {
        std::memcpy(&v, p, 4);
      } else {
        uint16_t h = 0;
        std::memcpy(&h, p, 2);
        v = r.dtype == DType::kBF16 ? bf16_to_float(h) : f16_to_float(h);
      }
      if (std::isfinite(v) && !(r.non_negative && v < 0)) continue;
      return corruption(path_ + ": " + what_ + " of " + r.name + ", element " + std::to_string((pos - r.begin) / width) +
                        ", is " + format_number(v) + ": " +
                        (r.non_negative ? "it must be finite and ≥ 0" : "it must be finite") +
                        ". The file holds values no run writes (its checksums match them, so they were written so): "
                        "resume from an earlier checkpoint");
    }
  }
  return Status::ok();
}

}  // namespace zo::engine

// How a sub-group's Adam moments are laid out in bytes when they are 8-bit blockwise
// (zoffload.moment_dtype "8bit", Note [8-bit moment layout] in moment_layout.cpp): one byte per
// element of each parameter that is quantized, then per parameter piece its absmax (one fp32 per
// block of 256) or, for a parameter under kMin8bitElems, its moment in fp32 as bitsandbytes keeps
// it. Pure functions of the registry; thread-safe.
#pragma once

#include <array>
#include <cstdint>
#include <vector>

#include "engine/memory/memory_plan.h"

namespace zo::engine {

// bitsandbytes' min_8bit_size: a parameter with fewer elements keeps its moments in fp32.
inline constexpr uint64_t kMin8bitElems = 4096;

// Whether the moments of a parameter of n_elems are 8-bit under "8bit" (n_elems ≥ kMin8bitElems).
inline bool quantized_param(uint64_t n_elems) { return n_elems >= kMin8bitElems; }

// One piece of a sub-group in the 8-bit moment layout. Offsets are bytes from the start of the
// state (exp_avg and exp_avg_sq share the layout).
struct MomentPiece {
  const ParamPiece* piece = nullptr;
  bool quantized = false;
  uint64_t codes_offset_bytes = 0;  // quantized: its n_elems codes
  uint64_t aux_offset_bytes = 0;    // quantized: its absmax (4 × blocks); else its fp32 moment (4 × n_elems)
  uint64_t aux_bytes = 0;
};

struct MomentLayout {
  std::vector<MomentPiece> pieces;  // the sub-group's pieces, in order
  uint64_t codes_bytes = 0;         // Σ n_elems of the quantized pieces: bytes [0, codes_bytes)
  uint64_t aux_begin_bytes = 0;     // codes_bytes rounded up to 4; [codes_bytes, aux_begin) is zero
  uint64_t total_bytes = 0;         // aux_begin + Σ aux_bytes: the state's size
};

// The 8-bit layout of sub-group `sub_group`'s moments.
MomentLayout moment_layout(const ParamRegistry& registry, uint32_t sub_group);

// The map (common/dynamic_maps.h) the 8-bit codes of state `kind` (exp_avg or exp_avg_sq) index, as
// bitsandbytes picks it: the signed map for exp_avg; for exp_avg_sq the unsigned one, except
// Adagrad's sum of squares, which bitsandbytes' Adagrad8bit keeps with the signed map (its qmap1).
const std::array<float, 256>& quant_map(const Placement& placement, StateKind kind);

}  // namespace zo::engine

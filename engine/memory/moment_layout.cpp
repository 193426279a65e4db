#include "engine/memory/moment_layout.h"

#include "common/dynamic_maps.h"

#include "common/bytes.h"
#include "cpu_optim/adam8bit.h"

namespace zo::engine {

// Note [8-bit moment layout]
// bitsandbytes quantizes each tensor on its own: blocks of 256 elements from the tensor's first
// element, the last one partial. A sub-group packs whole parameters and pieces of split ones, and a
// split falls on a multiple of kSplitAlignElems (4096, a multiple of 256) from the parameter's start,
// so every piece's blocks are the parameter's blocks: the kernel runs piece by piece and the states
// equal bitsandbytes' per tensor. Each moment of a sub-group is one run of bytes:
//   [codes of every quantized piece, in order][zeros to a multiple of 4][aux of every piece, in order]
// where a quantized piece's aux is its absmax and a small parameter's (under kMin8bitElems, whose
// moments bitsandbytes keeps in fp32) is its fp32 moment. Codes first, aux after, is what lets a
// checkpoint store each moment as per-parameter tensors with no gaps: the codes of the sub-groups in
// order are the U8 codes of the quantized parameters back to back (a split parameter's pieces are
// consecutive), and their aux runs likewise give each parameter's absmax or fp32 moment whole
// (docs/checkpoint_format.md).

MomentLayout moment_layout(const ParamRegistry& registry, uint32_t sub_group) {
  MomentLayout out;
  const auto pieces = registry.pieces_of_group(sub_group);
  out.pieces.reserve(pieces.size());
  for (const ParamPiece& piece : pieces) {
    MomentPiece mp;
    mp.piece = &piece;
    mp.quantized = quantized_param(registry.params()[piece.param].n_elems);
    if (mp.quantized) {
      mp.codes_offset_bytes = out.codes_bytes;
      out.codes_bytes += piece.n_elems;
      mp.aux_bytes = 4 * cpu_optim::quant_block_count(piece.n_elems);
    } else {
      mp.aux_bytes = 4 * piece.n_elems;
    }
    out.pieces.push_back(mp);
  }
  out.aux_begin_bytes = align_up(out.codes_bytes, uint64_t{4});
  uint64_t aux = out.aux_begin_bytes;
  for (MomentPiece& mp : out.pieces) {
    mp.aux_offset_bytes = aux;
    aux += mp.aux_bytes;
  }
  out.total_bytes = aux;
  return out;
}

const std::array<float, 256>& quant_map(const Placement& placement, StateKind kind) {
  return kind == StateKind::kExpAvgSq && placement.optimizer_type != OptimizerType::kAdagrad ? kUnsignedDynamicMap
                                                                                             : kSignedDynamicMap;
}

}  // namespace zo::engine

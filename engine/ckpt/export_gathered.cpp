// The export of a run whose compute copies are partitioned over its ranks (export_gathered.h).
#include "engine/ckpt/export_gathered.h"

#include <algorithm>
#include <array>
#include <span>
#include <vector>

#include "common/bnb4_blob.h"
#include "common/bnb4bit.h"

namespace zo::engine {

// Note [Exporting gathered parameters]
// With the compute copies partitioned (stage 3 across ranks) no rank holds every weight, so the
// export is a collective: rank 0 writes the files exactly as export_store does, and each read it
// makes is sent to every rank first (a header: param, offset, count); each piece of the range goes
// from its owner to everyone (a broadcast, as the gatherer's), and one exchange of the ranks'
// outcomes (Note [One outcome for every rank]) says whether any owner failed to read its part,
// naming it. A header with no read ends the exchange and carries rank 0's outcome, so every rank
// returns the export's success or failure. Like the export of a rank holding all compute copies
// (Note [Exporting partitioned states]) it writes in the compute dtype only. The model streams
// through one read's worth of host memory per rank, never whole.
Result<ExportResult> export_gathered(StateStore& store, const std::string& model_config_json, io::IoEngine& io,
                                     const ExportCollective& ranks, const ExportOptions& o) {
  const ParamRegistry& registry = store.registry();
  const uint32_t rank = ranks.rank;
  const std::string of_world = " of " + std::to_string(ranks.world_size);
  ZO_ASSIGN_OR_RETURN(std::optional<uint32_t> torn,
                      ranks.first_failed_rank(!store.torn_reason().empty(), "exporting the model"));
  if (torn)
    return failed_precondition("export: the weights of rank " + std::to_string(*torn) + of_world +
                               " are inconsistent after a failed step; export from a checkpoint instead");
  bool broken = false;  // a collective failed: the ranks are no longer connected, nothing more is sent
  // A packed weight (Note [The packed 4-bit base]): its blob is gathered whole, piece by piece from
  // the owners, on its first read, and each read is dequantized from it.
  uint32_t blob_param = UINT32_MAX;
  std::vector<std::byte> blob;
  const uint64_t cb = dtype_size_bytes(store.plan().placement.compute_dtype);
  // Every rank, for one read of rank 0's: the pieces from their owners, then the owners' outcome.
  auto read_pieces = [&](uint32_t p, uint64_t off, std::span<float> out) -> Status {
    const std::string what = "exporting " + registry.params()[p].name;
    Status local;
    const bool packed = registry.params()[p].packed;
    if (packed && blob_param != p) {
      blob.assign(registry.params()[p].n_elems * cb, std::byte{0});
      blob_param = UINT32_MAX;
    }
    for (const ParamPiece& piece : registry.pieces_of_param(p)) {
      if (packed) {
        if (blob_param == p) break;
        const std::span<std::byte> part(blob.data() + piece.param_offset * cb, piece.n_elems * cb);
        const uint32_t owner = registry.partition_of_group(piece.sub_group);
        if (owner == rank && local.is_ok()) local = store.read_compute_bytes(p, piece.param_offset * cb, part);
        Status st = ranks.broadcast(part.data(), part.size_bytes(), owner, what);
        if (!st.is_ok()) {
          broken = true;
          return st;
        }
        continue;
      }
      const uint64_t a = std::max(off, piece.param_offset);
      const uint64_t b = std::min<uint64_t>(off + out.size(), piece.param_offset + piece.n_elems);
      if (a >= b) continue;
      const uint32_t owner = registry.partition_of_group(piece.sub_group);
      std::span<float> part = out.subspan(a - off, b - a);
      if (owner == rank && local.is_ok()) local = store.read_param_compute(p, a, part);
      Status st = ranks.broadcast(part.data(), part.size_bytes(), owner, what);
      if (!st.is_ok()) {
        broken = true;
        return st;
      }
    }
    Result<std::optional<uint32_t>> failed = ranks.first_failed_rank(!local.is_ok(), what);
    if (!failed.is_ok()) {
      broken = true;
      return failed.status();
    }
    if (!local.is_ok()) return local.with_context(what);
    if (*failed)
      return Status(StatusCode::kAborted, what + ": rank " + std::to_string(**failed) + of_world +
                                              " could not read its part (its own output has the error)");
    if (packed) {
      blob_param = p;
      if (!bnb4::dequantize_whole_blob(reinterpret_cast<const uint8_t*>(blob.data()), blob.size(), off, out.size(),
                                       store.plan().placement.compute_dtype, out.data()))
        return corruption(what + ": its compute copy is not a packed weight's blob");
    }
    return Status::ok();
  };
  using Header = std::array<double, 4>;  // {more, param, offset, count}; {0, ok} ends; exact below 2^53
  auto send_header = [&](Header& h) {
    Status st = ranks.broadcast(h.data(), sizeof(Header), 0, "exporting the model (rank 0's next read)");
    if (!st.is_ok()) broken = true;
    return st;
  };
  if (rank != 0) {
    std::vector<float> buffer;
    Status mine;  // this rank's first failure to read its part (rank 0 fails the export with it)
    for (;;) {
      Header h{};
      ZO_RETURN_IF_ERROR(send_header(h));
      if (h[0] == 0) {
        if (h[1] != 0) return ExportResult{};
        if (!mine.is_ok()) return mine;
        return Status(StatusCode::kAborted, "export: rank 0's export failed (its own output has the error)");
      }
      buffer.resize(static_cast<size_t>(h[3]));
      Status st = read_pieces(static_cast<uint32_t>(h[1]), static_cast<uint64_t>(h[2]), buffer);
      if (broken) return st;
      if (mine.is_ok()) mine = st;
    }
  }
  const DType compute_dtype = store.plan().placement.compute_dtype;
  Result<ExportResult> r =
      failed_precondition("export: at ZeRO stage 3 each of the " + std::to_string(ranks.world_size) +
                          " ranks holds its partition's compute copies "
                          "only; it exports in the compute dtype (" +
                          std::string(dtype_name(compute_dtype)) +
                          "), or export another dtype from a checkpoint with `zoffload export --dtype`");
  if (o.dtype == compute_dtype) {
    const Fp32Reader read = [&](uint32_t p, uint64_t off, std::span<float> out) -> Status {
      if (broken) return Status(StatusCode::kAborted, "export: the ranks are no longer connected");
      Header h{1.0, static_cast<double>(p), static_cast<double>(off), static_cast<double>(out.size())};
      ZO_RETURN_IF_ERROR(send_header(h));
      return read_pieces(p, off, out);
    };
    r = export_hf_model(registry.params(), model_config_json, read, io, o);
  }
  if (!broken) {
    Header end{0.0, r.is_ok() ? 1.0 : 0.0, 0.0, 0.0};
    Status st = send_header(end);
    if (!st.is_ok() && r.is_ok()) return st;
  }
  return r;
}

}  // namespace zo::engine

// Reads and writes of a StateStore's states in any tier: chunked through the scratch buffer, with
// the zero watermark on NVMe, and the param and state API built on them (state_store.h).
#include "engine/memory/state_store.h"

#include <algorithm>
#include <cstring>
#include <mutex>
#include <utility>
#include <vector>

#include "common/aligned_buffer.h"
#include "common/bnb4_blob.h"
#include "common/bnb4bit.h"
#include "common/check.h"
#include "common/bytes.h"
#include "common/half.h"
#include "common/log.h"
#include "cpu_optim/adam8bit.h"
#include "engine/memory/moment_layout.h"
#include "engine/memory/state_store_impl.h"

namespace zo::engine {

// Note [Zero watermark]
// States start zeroed. On the device and in CPU memory that is a fill at create(); on NVMe it
// would mean writing the whole swap file once (32 GB for the optimizer states of 2e9 params) only
// to overwrite most of it with the initial weights. Instead every NVMe state of every sub-group
// keeps a watermark: the end of the prefix of its region that has been written since create().
// Bytes at or beyond it are zeros by definition: reads clip to the watermark and zero the rest of
// their buffer, writes raise it. A write that starts beyond the watermark first writes zeros over
// the gap, so the prefix below the watermark is always real data and the watermark is one number.
// In practice init_param streams each param in order (no gap), the optimizer step writes whole
// regions, and exp_avg / exp_avg_sq are never written before the first step reads them as zeros.
// The watermark lives in memory only: it describes the swap file of this run, whose contents from a
// previous run are ignored (SwapFile::create) — a resume restores states through write_state().

Status StateStore::Impl::nvme_read_aligned(uint32_t g, StateKind kind, uint64_t off, uint64_t size, std::byte* dst) {
  const StateLocation& loc = locations[g][static_cast<int>(kind)];
  const uint64_t written = nvme_written[g][static_cast<int>(kind)];
  const uint64_t disk_end = std::min(off + size, std::max(off, written));
  if (disk_end > off) {
    ZO_RETURN_IF_ERROR(file_of(kind)->read(loc.region, off, {dst, disk_end - off}, what_of(g, kind)));
  }
  std::memset(dst + (disk_end - off), 0, off + size - disk_end);
  return Status::ok();
}

Status StateStore::Impl::nvme_write(uint32_t g, StateKind kind, uint64_t begin, uint64_t end, const Fill& fill) {
  const int k = static_cast<int>(kind);
  const StateLocation& loc = locations[g][k];
  SwapFile* file = file_of(kind);
  const std::string what = what_of(g, kind);
  uint64_t& written = nvme_written[g][k];
  std::byte* buf = scratch.data();
  // Zero the never-written gap below the first write so the watermark stays one number.
  const uint64_t first = align_down(begin, kSwapAlignment);
  while (written < first) {
    const uint64_t n = std::min(first - written, kStoreScratchBytes);
    std::memset(buf, 0, n);
    ZO_RETURN_IF_ERROR(file->write(loc.region, written, {buf, n}, what));
    written += n;
  }
  // Chunks end on aligned offsets, so only the first and the last chunk can have unaligned edges.
  // Past the state's end the last page is the region's padding, never read as the state: a write
  // that ends there zeroes it instead of reading it back first.
  const uint64_t state_end = bytes(g, kind);
  for (uint64_t cb = begin; cb < end;) {
    const uint64_t a = align_down(cb, kSwapAlignment);
    const uint64_t ce = std::min(end, a + kStoreScratchBytes);
    const uint64_t b = align_up(ce, kSwapAlignment);
    ZO_CHECK_LE(b, loc.region.size_bytes);
    if (cb > a) ZO_RETURN_IF_ERROR(nvme_read_aligned(g, kind, a, kSwapAlignment, buf));
    if (ce < b && ce == state_end) {
      std::memset(buf + (ce - a), 0, b - ce);
    } else if (ce < b && (b - kSwapAlignment > a || cb == a)) {
      ZO_RETURN_IF_ERROR(
          nvme_read_aligned(g, kind, b - kSwapAlignment, kSwapAlignment, buf + (b - kSwapAlignment - a)));
    }
    fill(buf + (cb - a), cb - begin, ce - cb);
    ZO_RETURN_IF_ERROR(file->write(loc.region, a, {buf, b - a}, what));
    written = std::max(written, b);
    cb = ce;
  }
  return Status::ok();
}

Status StateStore::Impl::nvme_read(uint32_t g, StateKind kind, uint64_t begin, uint64_t end, const Consume& consume) {
  for (uint64_t cb = begin; cb < end;) {
    const uint64_t a = align_down(cb, kSwapAlignment);
    const uint64_t ce = std::min(end, a + kStoreScratchBytes);
    const uint64_t b = align_up(ce, kSwapAlignment);
    ZO_RETURN_IF_ERROR(nvme_read_aligned(g, kind, a, b - a, scratch.data()));
    consume(scratch.data() + (cb - a), cb - begin, ce - cb);
    cb = ce;
  }
  return Status::ok();
}

Status StateStore::Impl::write_range(uint32_t g, StateKind kind, uint64_t begin, uint64_t end, const Fill& fill) {
  const StateLocation& loc = locations[g][static_cast<int>(kind)];
  switch (loc.tier) {
    case Tier::kCpu: fill(loc.host + begin, 0, end - begin); return Status::ok();
    case Tier::kDevice:
      for (uint64_t cb = begin; cb < end; cb += kStoreScratchBytes) {
        const uint64_t n = std::min(end - cb, kStoreScratchBytes);
        fill(scratch.data(), cb - begin, n);
        ZO_RETURN_IF_ERROR(device->copy_h2d(loc.device + cb, scratch.data(), n, stream));
        accounting->add_moved(Move::kHostToDevice, n);
        ZO_RETURN_IF_ERROR(device->synchronize(stream));
      }
      return Status::ok();
    case Tier::kNvme: return nvme_write(g, kind, begin, end, fill);
  }
  return internal_error("unknown tier");
}

Status StateStore::Impl::read_range(uint32_t g, StateKind kind, uint64_t begin, uint64_t end, const Consume& consume) {
  const StateLocation& loc = locations[g][static_cast<int>(kind)];
  switch (loc.tier) {
    case Tier::kCpu: consume(loc.host + begin, 0, end - begin); return Status::ok();
    case Tier::kDevice:
      for (uint64_t cb = begin; cb < end; cb += kStoreScratchBytes) {
        const uint64_t n = std::min(end - cb, kStoreScratchBytes);
        ZO_RETURN_IF_ERROR(device->copy_d2h(scratch.data(), loc.device + cb, n, stream));
        accounting->add_moved(Move::kDeviceToHost, n);
        ZO_RETURN_IF_ERROR(device->synchronize(stream));
        consume(scratch.data(), cb - begin, n);
      }
      return Status::ok();
    case Tier::kNvme: return nvme_read(g, kind, begin, end, consume);
  }
  return internal_error("unknown tier");
}

Status StateStore::Impl::zero_range(uint32_t g, StateKind kind, uint64_t begin, uint64_t end) {
  const StateLocation& loc = locations[g][static_cast<int>(kind)];
  if (loc.tier == Tier::kDevice) {
    ZO_RETURN_IF_ERROR(device->fill_zero(loc.device + begin, end - begin, stream));
    return device->synchronize(stream);
  }
  // Zeros beyond the watermark are already zeros: nothing to write.
  if (loc.tier == Tier::kNvme && align_down(begin, kSwapAlignment) >= nvme_written[g][static_cast<int>(kind)]) {
    return Status::ok();
  }
  return write_range(g, kind, begin, end, [](std::byte* dst, uint64_t, uint64_t n) { std::memset(dst, 0, n); });
}

Status StateStore::Impl::write_compute(uint32_t g, uint64_t first, std::span<const float> master) {
  const DType cdt = plan.placement.compute_dtype;
  const uint64_t cb = elem_bytes(StateKind::kCompute);
  const float* src = master.data();
  return write_range(g, StateKind::kCompute, first * cb, (first + master.size()) * cb,
                     [src, cdt, cb](std::byte* dst, uint64_t rel, uint64_t bytes) {
                       const float* from = src + rel / cb;
                       for (uint64_t i = 0; i < bytes / cb; ++i) {
                         if (cdt == DType::kF32) {
                           std::memcpy(dst + i * 4, &from[i], 4);
                         } else {
                           const uint16_t h = cdt == DType::kBF16 ? float_to_bf16(from[i]) : float_to_f16(from[i]);
                           std::memcpy(dst + i * 2, &h, 2);
                         }
                       }
                     });
}

namespace {

// The byte ranges of a moment that hold elements [rel, rel + n) of `piece`: fp32 or bf16 elements,
// or under 8-bit moments (Note [8-bit moment layout]) their codes and the absmax of every block they
// touch (a small parameter's fp32 moment in the aux run).
std::vector<std::pair<uint64_t, uint64_t>> moment_bytes_of(const StateStore::Impl& s, const ParamPiece& piece,
                                                           uint64_t rel, uint64_t n) {
  const uint64_t first = piece.group_offset + rel;
  if (s.plan.placement.moments != MomentDtype::k8bit) {
    const uint64_t bytes = state_elem_bytes(s.plan.placement, StateKind::kExpAvg);
    return {{first * bytes, (first + n) * bytes}};
  }
  const MomentLayout layout = moment_layout(s.registry, piece.sub_group);
  for (const MomentPiece& mp : layout.pieces) {
    if (mp.piece->param != piece.param) continue;
    if (!mp.quantized) return {{mp.aux_offset_bytes + rel * 4, mp.aux_offset_bytes + (rel + n) * 4}};
    const uint64_t b0 = rel / cpu_optim::kQuantBlockElems, b1 = cpu_optim::quant_block_count(rel + n);
    return {{mp.codes_offset_bytes + rel, mp.codes_offset_bytes + rel + n},
            {mp.aux_offset_bytes + b0 * 4, mp.aux_offset_bytes + b1 * 4}};
  }
  ZO_CHECK(false) << "param " << piece.param << " has no piece in sub-group " << piece.sub_group;
  return {};
}

// Bytes [lo, hi) of a param's compute copy, piece by piece: `fn(piece, offset in the sub-group's
// compute copy, offset into [lo, hi), bytes)` for each piece holding some of them, in order; the
// first error stops the walk.
template <class Fn>
Status for_compute_bytes(const StateStore::Impl& s, uint32_t param, uint64_t lo, uint64_t hi, Fn fn) {
  const uint64_t cb = state_elem_bytes(s.plan.placement, StateKind::kCompute);
  for (const ParamPiece& piece : s.registry.pieces_of_param(param)) {
    const uint64_t begin = piece.param_offset * cb, a = std::max(lo, begin),
                   b = std::min(hi, (piece.param_offset + piece.n_elems) * cb);
    if (a < b) ZO_RETURN_IF_ERROR(fn(piece, piece.group_offset * cb + (a - begin), a - lo, b - a));
  }
  return Status::ok();
}

}  // namespace

StateStore::StateStore(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
StateStore::~StateStore() = default;

Status StateStore::init_param(uint32_t param, uint64_t offset_elems, std::span<const float> values) {
  Impl& s = *impl_;
  std::lock_guard<std::recursive_mutex> transfer(s.transfer_mu);
  if (param >= s.registry.params().size()) {
    return invalid_argument("init_param: param " + std::to_string(param) + " out of range (" +
                            std::to_string(s.registry.params().size()) + " params)");
  }
  const ParamInfo& info = s.registry.params()[param];
  if (info.packed) return invalid_argument("init_param: " + info.name + " is a packed weight (init_packed)");
  if (offset_elems > info.n_elems || values.size() > info.n_elems - offset_elems) {
    return invalid_argument("init_param: " + info.name + ": elements [" + std::to_string(offset_elems) + ", " +
                            std::to_string(offset_elems + values.size()) + ") outside its " +
                            std::to_string(info.n_elems) + " elements");
  }
  const uint64_t lo = offset_elems, hi = offset_elems + values.size();
  for (const ParamPiece& piece : s.registry.pieces_of_param(param)) {
    const uint64_t a = std::max(lo, piece.param_offset), b = std::min(hi, piece.param_offset + piece.n_elems);
    if (a >= b) continue;
    const float* src = values.data() + (a - lo);
    const uint64_t first = piece.group_offset + (a - piece.param_offset), n = b - a;
    const uint32_t g = piece.sub_group;
    auto context = [&](Status st, StateKind kind) {
      return st.with_context("init_param " + info.name + " (" + what_of(g, kind) + ")");
    };
    Status st;
    // The optimizer states of this rank's trainable sub-groups (not another rank's, nor a frozen
    // one's: Note [Frozen sub-groups]).
    const bool stepped = s.plan.holds(g, StateKind::kMaster);
    if (stepped && s.plan.placement.master_dtype == DType::kBF16) {
      // A bf16 master starts as the weight rounded to nearest even: the compute copy's bits.
      st = s.write_range(g, StateKind::kMaster, first * 2, (first + n) * 2,
                         [src](std::byte* dst, uint64_t rel, uint64_t bytes) {
                           for (uint64_t i = 0; i < bytes / 2; ++i) {
                             const uint16_t h = float_to_bf16(src[rel / 2 + i]);
                             std::memcpy(dst + 2 * i, &h, 2);
                           }
                         });
    } else if (stepped) {
      st = s.write_range(g, StateKind::kMaster, first * 4, (first + n) * 4,
                         [src](std::byte* dst, uint64_t rel, uint64_t bytes) {
                           std::memcpy(dst, reinterpret_cast<const std::byte*>(src) + rel, bytes);
                         });
    }
    if (stepped) {
      if (!st.is_ok()) return context(std::move(st), StateKind::kMaster);
      for (StateKind kind : {StateKind::kExpAvg, StateKind::kExpAvgSq}) {
        for (auto [zb, ze] : moment_bytes_of(s, piece, a - piece.param_offset, n)) {
          st = s.zero_range(g, kind, zb, ze);
          if (!st.is_ok()) return context(std::move(st), kind);
        }
      }
    }
    if (!s.plan.holds(g, StateKind::kCompute)) continue;  // another rank's (partitioned params)
    st = s.write_compute(g, first, {src, n});
    if (!st.is_ok()) return context(std::move(st), StateKind::kCompute);
  }
  return Status::ok();
}

Status StateStore::read_param_master(uint32_t param, uint64_t offset_elems, std::span<float> out) {
  return read_param(param, offset_elems, out, StateKind::kMaster, "read_param_master");
}

Status StateStore::init_packed(uint32_t param, uint64_t offset_bytes, std::span<const std::byte> bytes) {
  Impl& s = *impl_;
  std::lock_guard<std::recursive_mutex> transfer(s.transfer_mu);
  if (param >= s.registry.params().size() || !s.registry.params()[param].packed)
    return invalid_argument("init_packed: param " + std::to_string(param) + " is not a packed weight");
  const ParamInfo& info = s.registry.params()[param];
  const uint64_t cb = s.elem_bytes(StateKind::kCompute), size = info.n_elems * cb;
  if (offset_bytes > size || bytes.size() > size - offset_bytes)
    return invalid_argument("init_packed: " + info.name + ": bytes [" + std::to_string(offset_bytes) + ", " +
                            std::to_string(offset_bytes + bytes.size()) + ") outside its blob of " +
                            std::to_string(size));
  return for_compute_bytes(s, param, offset_bytes, offset_bytes + bytes.size(),
                           [&](const ParamPiece& piece, uint64_t in_group, uint64_t rel, uint64_t n) -> Status {
                             if (!s.plan.holds(piece.sub_group, StateKind::kCompute)) return Status::ok();
                             return write_state_range(piece.sub_group, StateKind::kCompute, in_group,
                                                      bytes.subspan(rel, n))
                                 .with_context("init_packed " + info.name);
                           });
}

Status StateStore::read_compute_bytes(uint32_t param, uint64_t offset_bytes, std::span<std::byte> out) {
  std::lock_guard<std::recursive_mutex> transfer(impl_->transfer_mu);
  const Impl& s = *impl_;
  if (param >= s.registry.params().size())
    return invalid_argument("read_compute_bytes: param " + std::to_string(param) + " out of range");
  return for_compute_bytes(
      s, param, offset_bytes, offset_bytes + out.size(),
      [&](const ParamPiece& piece, uint64_t in_group, uint64_t rel, uint64_t n) -> Status {
        ZO_RETURN_IF_ERROR(s.check_held(piece.sub_group, StateKind::kCompute, "read_param_compute"));
        return read_state_range(piece.sub_group, StateKind::kCompute, in_group, out.subspan(rel, n));
      });
}

Status StateStore::read_packed(uint32_t param, uint64_t offset_elems, std::span<float> out) {
  const ParamInfo& info = impl_->registry.params()[param];
  const uint64_t n = info.weights();
  if (offset_elems > n || out.size() > n - offset_elems)
    return invalid_argument("read_param_compute: " + info.name + ": elements [" + std::to_string(offset_elems) + ", " +
                            std::to_string(offset_elems + out.size()) + ") outside its " + std::to_string(n) +
                            " elements");
  if (out.empty()) return Status::ok();
  auto context = [&](Status st) { return st.with_context("reading the packed weight " + info.name); };
  std::array<std::byte, bnb4::kBlobHeaderBytes> head{};
  Status st = read_compute_bytes(param, 0, head);
  if (!st.is_ok()) return context(std::move(st));
  bnb4::BlobHeader h;
  if (!bnb4::read_blob_header(reinterpret_cast<const uint8_t*>(head.data()), &h) || !h.sane() || h.n() != n ||
      h.bytes() > info.n_elems * impl_->elem_bytes(StateKind::kCompute))
    return corruption("the compute copy of " + info.name + " is not the packed blob of its " + std::to_string(n) +
                      " elements (its header is damaged)");
  const uint64_t first = offset_elems, last = offset_elems + out.size() - 1;
  const uint64_t code = bnb4::blob_code_byte(h.type, first), scale = bnb4::blob_scale_index(h.type, h.cols, first);
  std::vector<std::byte> codes(bnb4::blob_code_byte(h.type, last) - code + 1),
      scales(4 * (bnb4::blob_scale_index(h.type, h.cols, last) - scale + 1));
  st = read_compute_bytes(param, bnb4::blob_codes_offset() + code, codes);
  if (st.is_ok()) st = read_compute_bytes(param, h.scales_offset() + 4 * scale, scales);
  if (!st.is_ok()) return context(std::move(st));
  bnb4::dequantize_blob(h, reinterpret_cast<const uint8_t*>(codes.data()),
                        reinterpret_cast<const uint8_t*>(scales.data()), first, out.size(),
                        impl_->plan.placement.compute_dtype, out.data());
  return Status::ok();
}

Status StateStore::read_param_compute(uint32_t param, uint64_t offset_elems, std::span<float> out) {
  if (param < impl_->registry.params().size() && impl_->registry.params()[param].packed) {
    std::lock_guard<std::recursive_mutex> transfer(impl_->transfer_mu);
    return read_packed(param, offset_elems, out);
  }
  return read_param(param, offset_elems, out, StateKind::kCompute, "read_param_compute");
}

Status StateStore::read_param_value(uint32_t param, uint64_t offset_elems, std::span<float> out) {
  const bool frozen = param < impl_->registry.params().size() && !impl_->registry.params()[param].trainable;
  return frozen ? read_param_compute(param, offset_elems, out) : read_param_master(param, offset_elems, out);
}

Status StateStore::read_param(uint32_t param, uint64_t offset_elems, std::span<float> out, StateKind kind,
                              const char* op) {
  // The 16-bit path below reads through the scratch buffer, as read_state_range does: another
  // thread's transfer (the block gatherer reading this rank's compute copies) must not share it.
  std::lock_guard<std::recursive_mutex> transfer(impl_->transfer_mu);
  const Impl& s = *impl_;
  const ParamRegistry& registry = s.registry;
  const MemoryPlan& plan = s.plan;
  if (param >= registry.params().size()) {
    return invalid_argument(std::string(op) + ": param " + std::to_string(param) + " out of range (" +
                            std::to_string(registry.params().size()) + " params)");
  }
  const ParamInfo& info = registry.params()[param];
  if (offset_elems > info.n_elems || out.size() > info.n_elems - offset_elems) {
    return invalid_argument(std::string(op) + ": " + info.name + ": elements [" + std::to_string(offset_elems) + ", " +
                            std::to_string(offset_elems + out.size()) + ") outside its " +
                            std::to_string(info.n_elems) + " elements");
  }
  const DType dtype = kind == StateKind::kMaster ? plan.placement.master_dtype : plan.placement.compute_dtype;
  const uint64_t lo = offset_elems, hi = offset_elems + out.size();
  for (const ParamPiece& piece : registry.pieces_of_param(param)) {
    const uint64_t a = std::max(lo, piece.param_offset), b = std::min(hi, piece.param_offset + piece.n_elems);
    if (a >= b) continue;
    const uint64_t first = piece.group_offset + (a - piece.param_offset);
    const uint32_t g = piece.sub_group;
    Status st = s.check_held(g, kind, op);
    if (st.is_ok() && dtype == DType::kF32) {
      // read_state_range: whole 4 KiB blocks of an NVMe state go straight into `out` (O_DIRECT).
      st = read_state_range(g, kind, first * 4, std::as_writable_bytes(out.subspan(a - lo, b - a)));
    } else if (st.is_ok()) {
      st = impl_->read_range(g, kind, first * 2, (first + b - a) * 2,
                             [dst = out.data() + (a - lo), dtype](const std::byte* src, uint64_t rel, uint64_t n) {
                               for (uint64_t i = 0; i < n / 2; ++i) {
                                 uint16_t h;
                                 std::memcpy(&h, src + 2 * i, 2);
                                 dst[rel / 2 + i] = dtype == DType::kBF16 ? bf16_to_float(h) : f16_to_float(h);
                               }
                             });
    }
    if (!st.is_ok()) return st.with_context("reading the " + std::string(state_name(kind)) + " of " + info.name);
  }
  return Status::ok();
}

Status StateStore::Impl::check_held(uint32_t g, StateKind kind, const char* op) const {
  if (g < plan.n_sub_groups && !locations[g][static_cast<int>(kind)].held) {
    if (plan.is_frozen(g))
      return failed_precondition(std::string(op) + ": " + what_of(g, kind) +
                                 " does not exist: the sub-group is frozen (it holds its compute copy only)");
    return failed_precondition(
        std::string(op) + ": " + what_of(g, kind) + " is held by another data-parallel rank (sub-groups " +
        std::to_string(plan.owned_begin) + "-" + std::to_string(plan.owned_end) + " are this rank's)");
  }
  return Status::ok();
}

Status StateStore::read_state(uint32_t sub_group, StateKind kind, std::span<std::byte> out) {
  Impl& s = *impl_;
  std::lock_guard<std::recursive_mutex> transfer(s.transfer_mu);
  ZO_RETURN_IF_ERROR(s.check_held(sub_group, kind, "read_state"));
  if (sub_group >= s.plan.n_sub_groups || out.size() != state_bytes(sub_group, kind)) {
    return invalid_argument("read_state: sub-group " + std::to_string(sub_group) + " " + std::string(state_name(kind)) +
                            ": bad sub-group or size " + std::to_string(out.size()));
  }
  return s.read_range(sub_group, kind, 0, out.size(),
                      [out](const std::byte* src, uint64_t rel, uint64_t n) { std::memcpy(out.data() + rel, src, n); });
}

Status StateStore::write_state(uint32_t sub_group, StateKind kind, std::span<const std::byte> in) {
  Impl& s = *impl_;
  std::lock_guard<std::recursive_mutex> transfer(s.transfer_mu);
  ZO_RETURN_IF_ERROR(s.check_held(sub_group, kind, "write_state"));
  if (sub_group >= s.plan.n_sub_groups || in.size() != state_bytes(sub_group, kind)) {
    return invalid_argument("write_state: sub-group " + std::to_string(sub_group) + " " +
                            std::string(state_name(kind)) + ": bad sub-group or size " + std::to_string(in.size()));
  }
  return s.write_range(sub_group, kind, 0, in.size(),
                       [in](std::byte* dst, uint64_t rel, uint64_t n) { std::memcpy(dst, in.data() + rel, n); });
}

namespace {

// The byte range [offset_bytes, offset_bytes + size) of one state of one sub-group, or
// kInvalidArgument naming the call (`what`) and the range.
Status check_state_range(const StateStore& store, uint32_t n_sub_groups, const char* what, uint32_t sub_group,
                         StateKind kind, uint64_t offset_bytes, uint64_t size) {
  if (sub_group < n_sub_groups && offset_bytes <= store.state_bytes(sub_group, kind) &&
      size <= store.state_bytes(sub_group, kind) - offset_bytes)
    return Status::ok();
  return invalid_argument(std::string(what) + ": sub-group " + std::to_string(sub_group) + " " +
                          std::string(state_name(kind)) + ": bad sub-group or range at " +
                          std::to_string(offset_bytes) + " + " + std::to_string(size));
}

}  // namespace

Status StateStore::read_state_range(uint32_t sub_group, StateKind kind, uint64_t offset_bytes,
                                    std::span<std::byte> out) {
  Impl& s = *impl_;
  std::lock_guard<std::recursive_mutex> transfer(s.transfer_mu);
  ZO_RETURN_IF_ERROR(s.check_held(sub_group, kind, "read_state_range"));
  ZO_RETURN_IF_ERROR(
      check_state_range(*this, s.plan.n_sub_groups, "read_state_range", sub_group, kind, offset_bytes, out.size()));
  uint64_t direct = 0;
  if (s.locations[sub_group][static_cast<int>(kind)].tier == Tier::kNvme && is_aligned(offset_bytes, kSwapAlignment) &&
      is_aligned(reinterpret_cast<uintptr_t>(out.data()), kSwapAlignment)) {
    direct = align_down(out.size(), kSwapAlignment);
    if (direct > 0) ZO_RETURN_IF_ERROR(s.nvme_read_aligned(sub_group, kind, offset_bytes, direct, out.data()));
  }
  if (direct == out.size()) return Status::ok();
  const uint64_t begin = offset_bytes + direct;
  std::byte* dst = out.data() + direct;
  return s.read_range(sub_group, kind, begin, offset_bytes + out.size(),
                      [dst](const std::byte* src, uint64_t rel, uint64_t n) { std::memcpy(dst + rel, src, n); });
}

Result<StateStore::PendingRead> StateStore::read_state_range_async(uint32_t sub_group, StateKind kind,
                                                                   uint64_t offset_bytes, std::span<std::byte> out) {
  Impl& s = *impl_;
  std::lock_guard<std::recursive_mutex> transfer(s.transfer_mu);
  ZO_RETURN_IF_ERROR(s.check_held(sub_group, kind, "read_state_range_async"));
  ZO_RETURN_IF_ERROR(check_state_range(*this, s.plan.n_sub_groups, "read_state_range_async", sub_group, kind,
                                       offset_bytes, out.size()));
  PendingRead pending;
  const StateLocation& loc = s.locations[sub_group][static_cast<int>(kind)];
  if (loc.tier != Tier::kNvme || !is_aligned(offset_bytes, kSwapAlignment) ||
      !is_aligned(reinterpret_cast<uintptr_t>(out.data()), kSwapAlignment)) {
    ZO_RETURN_IF_ERROR(read_state_range(sub_group, kind, offset_bytes, out));
    return pending;
  }
  // Bytes at and beyond the zero watermark were never written: zeros, not a read.
  const uint64_t written = s.nvme_written[sub_group][static_cast<int>(kind)];
  const uint64_t blocks = align_down(out.size(), kSwapAlignment);
  const uint64_t disk = written > offset_bytes ? std::min(blocks, written - offset_bytes) : 0;
  if (blocks > disk) std::memset(out.data() + disk, 0, blocks - disk);
  if (blocks < out.size()) {
    ZO_RETURN_IF_ERROR(read_state_range(sub_group, kind, offset_bytes + blocks, out.subspan(blocks)));
  }
  if (disk > 0) {
    SwapFile* file = s.file_of(kind);
    ZO_ASSIGN_OR_RETURN(pending.ticket,
                        file->read_async(loc.region, offset_bytes, out.first(disk), what_of(sub_group, kind)));
    pending.file = file;
  }
  return pending;
}

uint64_t StateStore::padded_state_bytes(uint32_t sub_group, StateKind kind) const {
  return align_up(state_bytes(sub_group, kind), kSwapAlignment);
}

Result<StateStore::PendingWrite> StateStore::write_state_async(uint32_t sub_group, StateKind kind,
                                                               std::span<const std::byte> in) {
  Impl& s = *impl_;
  std::lock_guard<std::recursive_mutex> transfer(s.transfer_mu);
  ZO_RETURN_IF_ERROR(s.check_held(sub_group, kind, "write_state_async"));
  if (sub_group >= s.plan.n_sub_groups) {
    return invalid_argument("write_state_async: sub-group " + std::to_string(sub_group) + " of " +
                            std::to_string(s.plan.n_sub_groups));
  }
  const StateLocation& loc = s.locations[sub_group][static_cast<int>(kind)];
  if (loc.tier != Tier::kNvme || in.size() != loc.region.size_bytes ||
      !is_aligned(reinterpret_cast<uintptr_t>(in.data()), kSwapAlignment)) {
    return invalid_argument("write_state_async: sub-group " + std::to_string(sub_group) + " " +
                            std::string(state_name(kind)) + ": needs an NVMe state and a 4096-aligned buffer of its " +
                            std::to_string(loc.region.size_bytes) + " padded bytes (got " + std::to_string(in.size()) +
                            ")");
  }
  PendingWrite pending{.file = s.file_of(kind), .sub_group = sub_group, .kind = kind, .bytes = in.size()};
  ZO_ASSIGN_OR_RETURN(pending.ticket, pending.file->write_async(loc.region, 0, in, what_of(sub_group, kind)));
  return pending;
}

Status StateStore::finish_write(const PendingWrite& pending) {
  ZO_RETURN_IF_ERROR(pending.file->wait(pending.ticket));
  Impl& s = *impl_;
  std::lock_guard<std::recursive_mutex> transfer(s.transfer_mu);
  uint64_t& written = s.nvme_written[pending.sub_group][static_cast<int>(pending.kind)];
  written = std::max(written, pending.bytes);  // from offset 0: no gap below it
  return Status::ok();
}

Status StateStore::write_state_range(uint32_t sub_group, StateKind kind, uint64_t offset_bytes,
                                     std::span<const std::byte> in) {
  Impl& s = *impl_;
  std::lock_guard<std::recursive_mutex> transfer(s.transfer_mu);
  ZO_RETURN_IF_ERROR(s.check_held(sub_group, kind, "write_state_range"));
  ZO_RETURN_IF_ERROR(
      check_state_range(*this, s.plan.n_sub_groups, "write_state_range", sub_group, kind, offset_bytes, in.size()));
  // Whole 4 KiB blocks go from `in` straight to the swap file when nothing below them is a hole.
  const int k = static_cast<int>(kind);
  const StateLocation& loc = s.locations[sub_group][k];
  uint64_t direct = 0;
  if (loc.tier == Tier::kNvme && is_aligned(offset_bytes, kSwapAlignment) &&
      offset_bytes <= s.nvme_written[sub_group][k] &&
      is_aligned(reinterpret_cast<uintptr_t>(in.data()), kSwapAlignment)) {
    direct = align_down(in.size(), kSwapAlignment);
    if (direct > 0) {
      ZO_RETURN_IF_ERROR(s.file_of(kind)->write(loc.region, offset_bytes, in.first(direct), what_of(sub_group, kind)));
      s.nvme_written[sub_group][k] = std::max(s.nvme_written[sub_group][k], offset_bytes + direct);
    }
  }
  if (direct == in.size()) return Status::ok();
  const std::span<const std::byte> rest = in.subspan(direct);
  return s.write_range(sub_group, kind, offset_bytes + direct, offset_bytes + in.size(),
                       [rest](std::byte* dst, uint64_t rel, uint64_t n) { std::memcpy(dst, rest.data() + rel, n); });
}

Status StateStore::write_compute_from_master(uint32_t sub_group, uint64_t offset_elems, std::span<const float> master) {
  Impl& s = *impl_;
  std::lock_guard<std::recursive_mutex> transfer(s.transfer_mu);
  if (sub_group >= s.plan.n_sub_groups || offset_elems > s.n_elems(sub_group) ||
      master.size() > s.n_elems(sub_group) - offset_elems) {
    return invalid_argument("write_compute_from_master: sub-group " + std::to_string(sub_group) +
                            ": bad sub-group or range at element " + std::to_string(offset_elems) + " + " +
                            std::to_string(master.size()));
  }
  ZO_RETURN_IF_ERROR(s.check_held(sub_group, StateKind::kCompute, "write_compute_from_master"));
  return s.write_compute(sub_group, offset_elems, master);
}

}  // namespace zo::engine

#include "engine/memory/param_swapper.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "common/bytes.h"

namespace zo::engine {

struct ParamSwapper::Impl {
  StateStore* store = nullptr;
  struct Slot {
    std::span<std::byte> buf;
    bool held = false;
    uint32_t param = 0;
    uint64_t fetch_id = 0;
    std::vector<io::Ticket> reads;
    uint64_t data_offset = 0;  // where the param starts in buf
  };
  std::vector<Slot> slots;
  uint64_t next_fetch_id = 0;

  ~Impl() {
    for (auto& slot : slots) {
      for (io::Ticket t : slot.reads) (void)store->param_file()->wait(t);
    }
  }

  uint64_t compute_bytes() const { return state_elem_bytes(store->plan().placement, StateKind::kCompute); }
  std::string param_what(uint32_t param) const {
    return "param " + store->registry().params()[param].name + " compute copy";
  }
  Status wait_slot(Slot& slot) {
    Status first;
    for (io::Ticket t : slot.reads) {
      Status st = store->param_file()->wait(t);
      if (!st.is_ok() && first.is_ok()) first = std::move(st);
    }
    slot.reads.clear();
    return first;
  }
};

ParamSwapper::ParamSwapper(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
ParamSwapper::~ParamSwapper() = default;

Result<std::unique_ptr<ParamSwapper>> ParamSwapper::create(StateStore& store) {
  auto impl = std::make_unique<Impl>();
  impl->store = &store;
  for (auto b : store.param_swap_buffers()) {
    Impl::Slot slot;
    slot.buf = b;
    impl->slots.push_back(std::move(slot));
  }
  return std::unique_ptr<ParamSwapper>(new ParamSwapper(std::move(impl)));
}

Result<ParamHandle> ParamSwapper::fetch(uint32_t param) {
  Impl& s = *impl_;
  const ParamRegistry& registry = s.store->registry();
  if (param >= registry.params().size()) {
    return invalid_argument("fetch: param " + std::to_string(param) + " out of range (" +
                            std::to_string(registry.params().size()) + " params)");
  }
  const auto pieces = registry.pieces_of_param(param);
  const uint64_t cb = s.compute_bytes();
  bool any_nvme = false;
  for (const ParamPiece& piece : pieces) {
    const Tier tier = s.store->location(piece.sub_group, StateKind::kCompute).tier;
    if (tier == Tier::kDevice) {
      return invalid_argument("fetch: param " + registry.params()[param].name +
                              ": its compute copy lives on the device (sub-group " + std::to_string(piece.sub_group) +
                              ")");
    }
    any_nvme |= tier == Tier::kNvme;
  }
  if (!any_nvme) return ParamHandle{param, -1, 0};

  int index = -1;
  for (size_t i = 0; i < s.slots.size(); ++i) {
    if (!s.slots[i].held) {
      index = static_cast<int>(i);
      break;
    }
  }
  if (index < 0) {
    return failed_precondition("fetch " + registry.params()[param].name + ": all " + std::to_string(s.slots.size()) +
                               " parameter swap buffers are held; release one first");
  }
  Impl::Slot& slot = s.slots[index];
  // The CPU-resident pieces (the sub-groups kept in CPU by max_in_cpu) come first; the NVMe ones
  // follow back to back in the parameter file (one region per sub-group, in sub-group order, and
  // non-final pieces fill whole 4 KiB-multiple regions), so the NVMe part is one aligned superset
  // read. When a CPU part precedes it, the NVMe part starts a region and is therefore aligned.
  uint64_t cpu_bytes = 0;
  std::vector<const ParamPiece*> nvme_pieces;
  for (const ParamPiece& piece : pieces) {
    const StateLocation& home = s.store->location(piece.sub_group, StateKind::kCompute);
    if (home.tier == Tier::kCpu) {
      ZO_CHECK(nvme_pieces.empty()) << "param " << param << ": a CPU-resident piece after an NVMe one";
      cpu_bytes += piece.n_elems * cb;
    } else {
      nvme_pieces.push_back(&piece);
    }
  }
  const SwapRegion first_region = s.store->location(nvme_pieces.front()->sub_group, StateKind::kCompute).region;
  const uint64_t start = first_region.offset_bytes + nvme_pieces.front()->group_offset * cb;
  uint64_t nvme_bytes = 0;
  for (size_t i = 0; i < nvme_pieces.size(); ++i) {
    nvme_bytes += nvme_pieces[i]->n_elems * cb;
    if (i == 0) continue;
    const SwapRegion prev = s.store->location(nvme_pieces[i - 1]->sub_group, StateKind::kCompute).region;
    const SwapRegion cur = s.store->location(nvme_pieces[i]->sub_group, StateKind::kCompute).region;
    ZO_CHECK(cur.offset_bytes == prev.offset_bytes + prev.size_bytes &&
             nvme_pieces[i - 1]->n_elems * cb == prev.size_bytes)
        << "param " << param << ": its pieces are not back to back in the parameter file";
  }
  const uint64_t a = align_down(start, kSwapAlignment);
  const uint64_t b = align_up(start + nvme_bytes, kSwapAlignment);
  ZO_CHECK(cpu_bytes == 0 || a == start) << "param " << param << ": the NVMe part after a CPU part is unaligned";
  const uint64_t read_at = cpu_bytes;  // buffer offset of file byte `a`
  if (read_at + (b - a) > slot.buf.size()) {
    return internal_error("fetch " + registry.params()[param].name + ": needs " + std::to_string(read_at + (b - a)) +
                          " bytes of parameter swap buffer, the plan made " + std::to_string(slot.buf.size()));
  }
  slot.held = true;
  slot.param = param;
  slot.fetch_id = ++s.next_fetch_id;
  slot.data_offset = cpu_bytes > 0 ? 0 : start - a;
  uint64_t copied = 0;
  for (const ParamPiece& piece : pieces) {
    const StateLocation& home = s.store->location(piece.sub_group, StateKind::kCompute);
    if (home.tier != Tier::kCpu) break;
    std::memcpy(slot.buf.data() + copied, home.host + piece.group_offset * cb, piece.n_elems * cb);
    copied += piece.n_elems * cb;
  }
  // One read per sub-group region the superset touches, clipped to that region's zero watermark
  // (Note [Zero watermark] in state_store_io.cpp); what lies beyond it is zeroed here instead.
  const std::string what = s.param_what(param);
  SwapFile* file = s.store->param_file();
  for (const ParamPiece* piece : nvme_pieces) {
    const SwapRegion r = s.store->location(piece->sub_group, StateKind::kCompute).region;
    const uint64_t lo = std::max(a, r.offset_bytes), hi = std::min(b, r.offset_bytes + r.size_bytes);
    if (lo >= hi) continue;
    const uint64_t valid_end =
        std::min(hi, r.offset_bytes + s.store->nvme_written_bytes(piece->sub_group, StateKind::kCompute));
    std::byte* dst = slot.buf.data() + read_at + (lo - a);
    if (valid_end > lo) {
      auto t = file->read_async(r, lo - r.offset_bytes, {dst, valid_end - lo}, what);
      if (!t.is_ok()) {
        (void)s.wait_slot(slot);
        slot.held = false;
        return t.status();
      }
      slot.reads.push_back(*t);
    }
    if (hi > std::max(lo, valid_end))
      std::memset(dst + (std::max(lo, valid_end) - lo), 0, hi - std::max(lo, valid_end));
  }
  return ParamHandle{param, index, slot.fetch_id};
}

Result<std::span<const std::byte>> ParamSwapper::wait(const ParamHandle& handle) {
  Impl& s = *impl_;
  const ParamRegistry& registry = s.store->registry();
  ZO_CHECK_LT(handle.param, registry.params().size());
  const ParamInfo& info = registry.params()[handle.param];
  const uint64_t bytes = info.n_elems * s.compute_bytes();
  if (handle.buffer < 0) {
    const ParamPiece& first = registry.pieces_of_param(handle.param).front();
    const StateLocation& home = s.store->location(first.sub_group, StateKind::kCompute);
    return std::span<const std::byte>(home.host + first.group_offset * s.compute_bytes(), bytes);
  }
  if (static_cast<size_t>(handle.buffer) >= s.slots.size() || !s.slots[handle.buffer].held ||
      s.slots[handle.buffer].fetch_id != handle.ticket) {
    return invalid_argument("wait: a stale or released handle of param " + info.name);
  }
  Impl::Slot& slot = s.slots[handle.buffer];
  Status st = s.wait_slot(slot);
  if (!st.is_ok()) return st.with_context("fetching param " + info.name);
  return std::span<const std::byte>(slot.buf.data() + slot.data_offset, bytes);
}

void ParamSwapper::release(const ParamHandle& handle) {
  Impl& s = *impl_;
  if (handle.buffer < 0) return;
  ZO_CHECK(static_cast<size_t>(handle.buffer) < s.slots.size()) << "release: unknown buffer " << handle.buffer;
  Impl::Slot& slot = s.slots[handle.buffer];
  ZO_CHECK(slot.held && slot.fetch_id == handle.ticket) << "release: buffer " << handle.buffer << " released twice";
  // A read still in flight would land in the buffer after its next fetch took it.
  (void)s.wait_slot(slot);
  slot.held = false;
}

uint32_t ParamSwapper::buffers_total() const { return static_cast<uint32_t>(impl_->slots.size()); }
uint32_t ParamSwapper::buffers_free() const {
  uint32_t n = 0;
  for (const auto& slot : impl_->slots) n += slot.held ? 0 : 1;
  return n;
}

}  // namespace zo::engine

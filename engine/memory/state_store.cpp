#include "engine/memory/state_store.h"

#include <algorithm>
#include <cstring>
#include <functional>
#include <mutex>
#include <sstream>
#include <utility>

#include "common/aligned_buffer.h"
#include "common/bytes.h"
#include "common/half.h"
#include "common/host_info.h"
#include "common/log.h"

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

namespace {

constexpr uint64_t kScratchBytes = kStoreScratchBytes;

constexpr uint64_t align_down(uint64_t n, uint64_t alignment) { return n & ~(alignment - 1); }

std::string what_of(uint32_t g, StateKind kind) {
  return "sub-group " + std::to_string(g) + " " + std::string(state_name(kind));
}

}  // namespace

struct StateStore::Impl {
  ParamRegistry registry;
  MemoryPlan plan;
  gpu::Device* device = nullptr;
  io::IoEngine* io = nullptr;
  StateStoreOptions options;
  MemoryAccounting* accounting = nullptr;

  std::unique_ptr<PinnedPool> pool;
  std::vector<std::array<StateLocation, kNumStateKinds>> locations;
  std::vector<std::array<uint64_t, kNumStateKinds>> nvme_written;

  // One block per state kind and tier, with a section per sub-group in sub-group order, so the
  // pieces of a split param (whose non-final pieces fill whole sub-groups of a multiple of
  // kSplitAlignElems elements) lie back to back in every tier.
  std::array<gpu::DevicePtr, kNumStateKinds> device_blocks{};
  uint64_t device_bytes = 0;
  std::vector<std::span<std::byte>> pinned_blocks;
  std::vector<AlignedBuffer> pageable_blocks;
  uint64_t pageable_bytes = 0;

  std::unique_ptr<SwapFile> optimizer_file;
  std::unique_ptr<SwapFile> param_file;

  std::vector<std::span<std::byte>> optimizer_swap_buffers;
  std::vector<std::span<std::byte>> compute_staging_buffers;
  std::vector<std::span<std::byte>> param_swap_buffers;

  AlignedBuffer scratch;
  // The synchronous transfers share `scratch` and `stream`: they take turns (they may come from the
  // gatherer's or the gradient worker's thread beside the training thread).
  std::recursive_mutex transfer_mu;
  gpu::Stream stream;
  std::string torn_reason;

  ~Impl();

  uint64_t n_elems(uint32_t g) const { return registry.sub_groups()[g].n_elems; }
  uint64_t elem_bytes(StateKind kind) const { return state_elem_bytes(plan.placement, kind); }
  Tier tier_of(uint32_t g, StateKind kind) const {
    if (kind == StateKind::kCompute) return plan.placement.compute[g];
    if (kind == StateKind::kGradAccum) return plan.placement.grad;
    return plan.placement.optimizer;
  }
  bool pinned_kind(StateKind kind) const { return state_is_pinned(plan.placement, kind); }
  SwapFile* file_of(StateKind kind) const {
    return kind == StateKind::kCompute ? param_file.get() : optimizer_file.get();
  }

  // kFailedPrecondition when the state is another rank's (StateLocation::held).
  Status check_held(uint32_t g, StateKind kind, const char* op) const;
  Status allocate_states();
  Status create_swap_files();
  Status carve_buffers();
  Status zero_states();

  // Byte-range transfers of one state of one sub-group, whatever its tier. `fill` produces, and
  // `consume` takes, the bytes [begin + rel, begin + rel + n) of the range, in chunks.
  using Fill = std::function<void(std::byte* dst, uint64_t rel, uint64_t n)>;
  using Consume = std::function<void(const std::byte* src, uint64_t rel, uint64_t n)>;
  Status write_range(uint32_t g, StateKind kind, uint64_t begin, uint64_t end, const Fill& fill);
  Status read_range(uint32_t g, StateKind kind, uint64_t begin, uint64_t end, const Consume& consume);
  Status zero_range(uint32_t g, StateKind kind, uint64_t begin, uint64_t end);
  // Compute copies of elements [first, first + master.size()) = master rounded to the compute dtype.
  Status write_compute(uint32_t g, uint64_t first, std::span<const float> master);
  Status nvme_write(uint32_t g, StateKind kind, uint64_t begin, uint64_t end, const Fill& fill);
  Status nvme_read(uint32_t g, StateKind kind, uint64_t begin, uint64_t end, const Consume& consume);
  // Reads [off, off + size) of the region into dst, zeros beyond the watermark (aligned range).
  Status nvme_read_aligned(uint32_t g, StateKind kind, uint64_t off, uint64_t size, std::byte* dst);
};

StateStore::Impl::~Impl() {
  if (stream) {
    Status s = device->synchronize(stream);
    if (!s.is_ok()) ZO_LOG(kWarn) << "state store: device stream failed at close: " << s.to_string();
    device->destroy_stream(stream);
  }
  for (auto* list : {&optimizer_swap_buffers, &compute_staging_buffers, &param_swap_buffers}) {
    for (auto span : *list) pool->free(span);
  }
  for (auto span : pinned_blocks) pool->free(span);
  for (auto ptr : device_blocks) {
    if (ptr) device->free(ptr);
  }
  if (device_bytes > 0) accounting->remove_resident(Tier::kDevice, device_bytes);
  if (pageable_bytes > 0) accounting->remove_resident(Tier::kCpu, pageable_bytes);
  if (scratch.size() > 0) accounting->remove_resident(Tier::kCpu, scratch.size());
  for (auto* file : {&optimizer_file, &param_file}) {
    if (*file && options.remove_swap_files_on_close) {
      Status s = (*file)->remove_file();
      if (!s.is_ok()) ZO_LOG(kWarn) << "state store: could not remove a swap file: " << s.to_string();
    }
    file->reset();
  }
  pool.reset();
}

Status StateStore::Impl::allocate_states() {
  const uint32_t n_groups = plan.n_sub_groups;
  locations.assign(n_groups, {});
  nvme_written.assign(n_groups, {});
  for (int k = 0; k < kNumStateKinds; ++k) {
    const auto kind = static_cast<StateKind>(k);
    const uint64_t eb = elem_bytes(kind);
    uint64_t device_total = 0, cpu_total = 0;
    for (uint32_t g = 0; g < n_groups; ++g) {
      locations[g][k].tier = tier_of(g, kind);
      locations[g][k].held = plan.holds(g, kind);
      if (!locations[g][k].held) continue;
      if (locations[g][k].tier == Tier::kDevice) device_total += align_up(n_elems(g) * eb, gpu::kDeviceAlignment);
      if (locations[g][k].tier == Tier::kCpu) cpu_total += align_up(n_elems(g) * eb, kPinnedAlignment);
    }
    if (device_total > 0) {
      auto block = device->allocate(device_total);
      if (!block.is_ok()) {
        Status s = block.status();
        return s.with_context("device memory for the " + std::string(state_name(kind)) + " states (" +
                              format_bytes(device_total) + ", plan: " + format_bytes(plan.device_bytes) +
                              " of device-resident states)");
      }
      device_blocks[k] = *block;
      device_bytes += device_total;
      accounting->add_resident(Tier::kDevice, device_total);
    }
    std::byte* host_base = nullptr;
    if (cpu_total > 0) {
      if (pinned_kind(kind)) {
        ZO_ASSIGN_OR_RETURN(auto span, pool->allocate(cpu_total, std::string(state_name(kind)) + " states"));
        pinned_blocks.push_back(span);
        host_base = span.data();
      } else {
        auto buffer = AlignedBuffer::allocate(cpu_total);
        if (!buffer.is_ok()) {
          return out_of_memory("pageable CPU memory for the " + std::string(state_name(kind)) + " states (" +
                               format_bytes(cpu_total) + "): " + buffer.status().message());
        }
        host_base = buffer->data();
        pageable_blocks.push_back(std::move(buffer).value());
        pageable_bytes += cpu_total;
        accounting->add_resident(Tier::kCpu, cpu_total);
      }
    }
    uint64_t device_off = 0, cpu_off = 0;
    for (uint32_t g = 0; g < n_groups; ++g) {
      StateLocation& loc = locations[g][k];
      if (!loc.held) continue;
      if (loc.tier == Tier::kDevice) {
        loc.device = device_blocks[k] + device_off;
        device_off += align_up(n_elems(g) * eb, gpu::kDeviceAlignment);
      } else if (loc.tier == Tier::kCpu) {
        loc.host = host_base + cpu_off;
        cpu_off += align_up(n_elems(g) * eb, kPinnedAlignment);
      }
    }
  }
  return Status::ok();
}

Status StateStore::Impl::create_swap_files() {
  io::Env* env = options.env != nullptr ? options.env : io::Env::posix();
  const uint32_t n_groups = plan.n_sub_groups;
  bool optimizer_nvme = false, param_nvme = false;
  for (uint32_t g = 0; g < n_groups; ++g) {
    for (int k = 0; k < kNumStateKinds; ++k) {
      if (locations[g][k].tier != Tier::kNvme || !locations[g][k].held) continue;
      (k == static_cast<int>(StateKind::kCompute) ? param_nvme : optimizer_nvme) = true;
    }
  }
  if (optimizer_nvme) {
    if (options.optimizer_nvme_path.empty()) {
      return invalid_argument(
          "zero_optimization.offload_optimizer.nvme_path: required with offload_optimizer.device nvme "
          "or zoffload.gradient_accumulators nvme");
    }
    ZO_ASSIGN_OR_RETURN(optimizer_file,
                        SwapFile::create(swap_dir(options.optimizer_nvme_path, options.rank), "optimizer.swp",
                                         plan.nvme_optimizer_bytes, *io, accounting, env, options.on_swap_file));
  }
  if (param_nvme) {
    if (options.param_nvme_path.empty()) {
      return invalid_argument("zero_optimization.offload_param.nvme_path: required with offload_param.device nvme");
    }
    ZO_ASSIGN_OR_RETURN(param_file,
                        SwapFile::create(swap_dir(options.param_nvme_path, options.rank), "param.swp",
                                         plan.nvme_param_bytes, *io, accounting, env, options.on_swap_file));
  }
  // One record per sub-group in the optimizer file, [master|exp_avg|exp_avg_sq|grad], so a step
  // reads a sub-group with one request and writes master|exp_avg|exp_avg_sq back with another; one
  // compute region per NVMe sub-group in the parameter file, in sub-group order, so a split param
  // is one contiguous run of the file.
  for (uint32_t g = 0; g < n_groups; ++g) {
    uint64_t record = 0;
    for (int k = 0; k < kNumStateKinds - 1; ++k) {
      if (locations[g][k].tier == Tier::kNvme && locations[g][k].held)
        record += align_up(n_elems(g) * elem_bytes(static_cast<StateKind>(k)), kSwapAlignment);
    }
    if (record > 0) {
      auto region = optimizer_file->reserve(record);
      if (!region.is_ok()) {
        Status s = region.status();
        return s.with_context("optimizer swap file, sub-group " + std::to_string(g) +
                              " (plan: " + std::to_string(plan.nvme_optimizer_bytes) + " bytes)");
      }
      uint64_t off = region->offset_bytes;
      for (int k = 0; k < kNumStateKinds - 1; ++k) {
        StateLocation& loc = locations[g][k];
        if (loc.tier != Tier::kNvme || !loc.held) continue;
        const uint64_t size = align_up(n_elems(g) * elem_bytes(static_cast<StateKind>(k)), kSwapAlignment);
        loc.region = {off, size};
        off += size;
      }
    }
    StateLocation& compute = locations[g][static_cast<int>(StateKind::kCompute)];
    if (compute.tier == Tier::kNvme && compute.held) {
      auto region = param_file->reserve(n_elems(g) * elem_bytes(StateKind::kCompute));
      if (!region.is_ok()) {
        Status s = region.status();
        return s.with_context("parameter swap file, sub-group " + std::to_string(g) +
                              " (plan: " + std::to_string(plan.nvme_param_bytes) + " bytes)");
      }
      compute.region = *region;
    }
  }
  return Status::ok();
}

Status StateStore::Impl::carve_buffers() {
  struct Spec {
    std::vector<std::span<std::byte>>* out;
    uint32_t count;
    uint64_t size;
    const char* what;
  };
  for (const Spec& spec :
       {Spec{&optimizer_swap_buffers, plan.optimizer_swap_buffers, plan.optimizer_swap_buffer_bytes,
             "optimizer swap buffer"},
        Spec{&compute_staging_buffers, plan.compute_staging_buffers, plan.compute_staging_buffer_bytes,
             "compute staging buffer"},
        Spec{&param_swap_buffers, plan.param_swap_buffers, plan.param_swap_buffer_bytes, "parameter swap buffer"}}) {
    if (spec.size == 0) continue;
    for (uint32_t i = 0; i < spec.count; ++i) {
      ZO_ASSIGN_OR_RETURN(auto span, pool->allocate(spec.size, spec.what));
      // Touched once here so that the step loop never page-faults on them, and so that the padding
      // a transfer rounds up to is deterministic.
      std::memset(span.data(), 0, span.size());
      spec.out->push_back(span);
    }
  }
  return Status::ok();
}

Status StateStore::Impl::zero_states() {
  for (auto span : pinned_blocks) std::memset(span.data(), 0, span.size());
  uint64_t device_off[kNumStateKinds] = {};
  for (int k = 0; k < kNumStateKinds; ++k) {
    if (!device_blocks[k]) continue;
    for (uint32_t g = 0; g < plan.n_sub_groups; ++g) {
      if (locations[g][k].tier == Tier::kDevice && locations[g][k].held) {
        device_off[k] += align_up(n_elems(g) * elem_bytes(static_cast<StateKind>(k)), gpu::kDeviceAlignment);
      }
    }
    ZO_RETURN_IF_ERROR(device->fill_zero(device_blocks[k], device_off[k], stream));
  }
  return device->synchronize(stream);
}

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
    const uint64_t n = std::min(first - written, kScratchBytes);
    std::memset(buf, 0, n);
    ZO_RETURN_IF_ERROR(file->write(loc.region, written, {buf, n}, what));
    written += n;
  }
  // Chunks end on aligned offsets, so only the first and the last chunk can have unaligned edges.
  // Past the state's end the last page is the region's padding, never read as the state: a write
  // that ends there zeroes it instead of reading it back first.
  const uint64_t state_end = n_elems(g) * elem_bytes(kind);
  for (uint64_t cb = begin; cb < end;) {
    const uint64_t a = align_down(cb, kSwapAlignment);
    const uint64_t ce = std::min(end, a + kScratchBytes);
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
    const uint64_t ce = std::min(end, a + kScratchBytes);
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
      for (uint64_t cb = begin; cb < end; cb += kScratchBytes) {
        const uint64_t n = std::min(end - cb, kScratchBytes);
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
      for (uint64_t cb = begin; cb < end; cb += kScratchBytes) {
        const uint64_t n = std::min(end - cb, kScratchBytes);
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

StateStore::StateStore(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
StateStore::~StateStore() = default;

Result<std::unique_ptr<StateStore>> StateStore::create(const ParamRegistry& registry, const MemoryPlan& plan,
                                                       gpu::Device& device, io::IoEngine& io,
                                                       const StateStoreOptions& options, MemoryAccounting& accounting) {
  if (plan.n_sub_groups != registry.sub_groups().size() || plan.placement.compute.size() != plan.n_sub_groups) {
    return invalid_argument("state store: the memory plan (" + std::to_string(plan.n_sub_groups) +
                            " sub-groups) was not made for this registry (" +
                            std::to_string(registry.sub_groups().size()) + " sub-groups)");
  }
  const uint64_t need = plan.pinned_pool_bytes();
  const uint64_t cap = options.pinned_cap_bytes == 0 ? need : options.pinned_cap_bytes;
  if (need > cap) {
    std::ostringstream msg;
    msg << options.pinned_cap_key << ": the memory plan needs " << need << " bytes (" << format_bytes(need)
        << ") of pinned memory but the cap is " << cap << " bytes (" << format_bytes(cap) << "): "
        << "CPU-resident states " << plan.cpu_pinned_bytes << " + optimizer swap buffers "
        << plan.optimizer_swap_buffers << " x " << plan.optimizer_swap_buffer_bytes << " + compute staging buffers "
        << plan.compute_staging_buffers << " x " << plan.compute_staging_buffer_bytes << " + parameter swap buffers "
        << plan.param_swap_buffers << " x " << plan.param_swap_buffer_bytes << " + the gradient landing ring "
        << plan.grad_ring_bytes << " (each rounded to " << kPinnedAlignment << " bytes); raise "
        << options.pinned_cap_key
        << ", lower zero_optimization.sub_group_size or the buffer counts, or set pin_memory false";
    return out_of_memory(msg.str());
  }
  const bool pin = pool_is_pinned(plan.placement);
  // The cap bounds the pool; the pool holds what the plan needs. Pinning the whole cap (a config's
  // 96 GiB written for an 8B model) would refuse or waste the host's RAM for a smaller model.
  if (options.check_host) {
    ZO_RETURN_IF_ERROR(check_pinned_cap(need, pin, host_info(), process_can_lock_unlimited(), "the memory plan's pool",
                                        "lower zero_optimization.sub_group_size or the offload buffer counts, offload "
                                        "more to NVMe, or use a machine with more RAM"));
  }

  auto impl = std::make_unique<Impl>();
  impl->registry = registry;
  impl->plan = plan;
  impl->device = &device;
  impl->io = &io;
  impl->options = options;
  impl->accounting = &accounting;
  ZO_ASSIGN_OR_RETURN(impl->pool, PinnedPool::create(device, need, pin, &accounting));
  ZO_ASSIGN_OR_RETURN(impl->stream, device.create_stream());
  {
    auto scratch = AlignedBuffer::allocate(kScratchBytes);
    if (!scratch.is_ok()) return scratch.status();
    impl->scratch = std::move(scratch).value();
    accounting.add_resident(Tier::kCpu, impl->scratch.size());
  }
  ZO_RETURN_IF_ERROR(impl->allocate_states());
  ZO_RETURN_IF_ERROR(impl->create_swap_files());
  ZO_RETURN_IF_ERROR(impl->carve_buffers());
  ZO_RETURN_IF_ERROR(impl->zero_states());
  return std::unique_ptr<StateStore>(new StateStore(std::move(impl)));
}

Status StateStore::init_param(uint32_t param, uint64_t offset_elems, std::span<const float> values) {
  Impl& s = *impl_;
  std::lock_guard<std::recursive_mutex> transfer(s.transfer_mu);
  if (param >= s.registry.params().size()) {
    return invalid_argument("init_param: param " + std::to_string(param) + " out of range (" +
                            std::to_string(s.registry.params().size()) + " params)");
  }
  const ParamInfo& info = s.registry.params()[param];
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
    if (s.plan.owns(g)) {
      st = s.write_range(g, StateKind::kMaster, first * 4, (first + n) * 4,
                         [src](std::byte* dst, uint64_t rel, uint64_t bytes) {
                           std::memcpy(dst, reinterpret_cast<const std::byte*>(src) + rel, bytes);
                         });
      if (!st.is_ok()) return context(std::move(st), StateKind::kMaster);
      for (StateKind kind : {StateKind::kExpAvg, StateKind::kExpAvgSq}) {
        st = s.zero_range(g, kind, first * 4, (first + n) * 4);
        if (!st.is_ok()) return context(std::move(st), kind);
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

Status StateStore::read_param_compute(uint32_t param, uint64_t offset_elems, std::span<float> out) {
  return read_param(param, offset_elems, out, StateKind::kCompute, "read_param_compute");
}

Status StateStore::read_param(uint32_t param, uint64_t offset_elems, std::span<float> out, StateKind kind,
                              const char* op) {
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
  const DType dtype = kind == StateKind::kMaster ? DType::kF32 : plan.placement.compute_dtype;
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

Status StateStore::read_state_range(uint32_t sub_group, StateKind kind, uint64_t offset_bytes,
                                    std::span<std::byte> out) {
  Impl& s = *impl_;
  std::lock_guard<std::recursive_mutex> transfer(s.transfer_mu);
  ZO_RETURN_IF_ERROR(s.check_held(sub_group, kind, "read_state_range"));
  if (sub_group >= s.plan.n_sub_groups || offset_bytes > state_bytes(sub_group, kind) ||
      out.size() > state_bytes(sub_group, kind) - offset_bytes) {
    return invalid_argument("read_state_range: sub-group " + std::to_string(sub_group) + " " +
                            std::string(state_name(kind)) + ": bad sub-group or range at " +
                            std::to_string(offset_bytes) + " + " + std::to_string(out.size()));
  }
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
  if (sub_group >= s.plan.n_sub_groups || offset_bytes > state_bytes(sub_group, kind) ||
      out.size() > state_bytes(sub_group, kind) - offset_bytes) {
    return invalid_argument("read_state_range_async: sub-group " + std::to_string(sub_group) + " " +
                            std::string(state_name(kind)) + ": bad sub-group or range at " +
                            std::to_string(offset_bytes) + " + " + std::to_string(out.size()));
  }
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
  if (sub_group >= s.plan.n_sub_groups || offset_bytes > state_bytes(sub_group, kind) ||
      in.size() > state_bytes(sub_group, kind) - offset_bytes) {
    return invalid_argument("write_state_range: sub-group " + std::to_string(sub_group) + " " +
                            std::string(state_name(kind)) + ": bad sub-group or range at " +
                            std::to_string(offset_bytes) + " + " + std::to_string(in.size()));
  }
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

void StateStore::mark_torn(std::string reason) { impl_->torn_reason = std::move(reason); }
const std::string& StateStore::torn_reason() const { return impl_->torn_reason; }

uint64_t StateStore::state_bytes(uint32_t sub_group, StateKind kind) const {
  return impl_->n_elems(sub_group) * impl_->elem_bytes(kind);
}

uint64_t StateStore::nvme_written_bytes(uint32_t sub_group, StateKind kind) const {
  return impl_->nvme_written[sub_group][static_cast<int>(kind)];
}

void StateStore::mark_nvme_written(uint32_t sub_group, StateKind kind, uint64_t start_bytes, uint64_t end_bytes) {
  uint64_t& written = impl_->nvme_written[sub_group][static_cast<int>(kind)];
  ZO_CHECK(start_bytes <= written) << what_of(sub_group, kind) << ": a write at " << start_bytes
                                   << " beyond the zero watermark " << written << " would leave a hole";
  written = std::max(written, end_bytes);
}

const ParamRegistry& StateStore::registry() const { return impl_->registry; }
const MemoryPlan& StateStore::plan() const { return impl_->plan; }
gpu::Device& StateStore::device() { return *impl_->device; }
io::IoEngine& StateStore::io() { return *impl_->io; }
MemoryAccounting& StateStore::accounting() { return *impl_->accounting; }
PinnedPool& StateStore::pool() { return *impl_->pool; }
SwapFile* StateStore::optimizer_file() { return impl_->optimizer_file.get(); }
SwapFile* StateStore::param_file() { return impl_->param_file.get(); }
const StateLocation& StateStore::location(uint32_t sub_group, StateKind kind) const {
  ZO_CHECK_LT(sub_group, impl_->plan.n_sub_groups);
  return impl_->locations[sub_group][static_cast<int>(kind)];
}
std::span<const std::span<std::byte>> StateStore::optimizer_swap_buffers() const {
  return impl_->optimizer_swap_buffers;
}
std::span<const std::span<std::byte>> StateStore::compute_staging_buffers() const {
  return impl_->compute_staging_buffers;
}
std::span<const std::span<std::byte>> StateStore::param_swap_buffers() const { return impl_->param_swap_buffers; }

}  // namespace zo::engine

#include "engine/memory/state_store.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "common/aligned_buffer.h"
#include "common/bytes.h"
#include "common/host_info.h"
#include "common/log.h"
#include "engine/memory/state_store_impl.h"

namespace zo::engine {

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
  group_bytes.assign(n_groups, {});
  for (uint32_t g = 0; g < n_groups; ++g) {
    for (int k = 0; k < kNumStateKinds; ++k)
      group_bytes[g][k] = group_state_bytes(plan.placement, registry, g, static_cast<StateKind>(k));
  }
  for (int k = 0; k < kNumStateKinds; ++k) {
    const auto kind = static_cast<StateKind>(k);
    uint64_t device_total = 0, cpu_total = 0;
    for (uint32_t g = 0; g < n_groups; ++g) {
      locations[g][k].tier = tier_of(g, kind);
      locations[g][k].held = plan.holds(g, kind);
      if (!locations[g][k].held) continue;
      if (kind == StateKind::kMaster && master_is_compute_copy(plan.placement, g)) continue;  // pointed below
      if (locations[g][k].tier == Tier::kDevice) device_total += align_up(bytes(g, kind), gpu::kDeviceAlignment);
      if (locations[g][k].tier == Tier::kCpu) cpu_total += align_up(bytes(g, kind), kPinnedAlignment);
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
      if (!loc.held || (kind == StateKind::kMaster && master_is_compute_copy(plan.placement, g))) continue;
      if (loc.tier == Tier::kDevice) {
        loc.device = device_blocks[k] + device_off;
        device_off += align_up(bytes(g, kind), gpu::kDeviceAlignment);
      } else if (loc.tier == Tier::kCpu) {
        loc.host = host_base + cpu_off;
        cpu_off += align_up(bytes(g, kind), kPinnedAlignment);
      }
    }
  }
  // Note [A bf16 master is its compute copy]: the master's bytes are the compute copy's.
  for (uint32_t g = 0; g < n_groups; ++g) {
    StateLocation& master = locations[g][static_cast<int>(StateKind::kMaster)];
    if (master.held && master_is_compute_copy(plan.placement, g)) {
      const StateLocation& compute = locations[g][static_cast<int>(StateKind::kCompute)];
      master.host = compute.host;
      master.device = compute.device;
    }
  }
  return Status::ok();
}

Status StateStore::Impl::create_swap_files() {
  io::Env* env = options.env;
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
        record += align_up(bytes(g, static_cast<StateKind>(k)), kSwapAlignment);
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
        const uint64_t size = align_up(bytes(g, static_cast<StateKind>(k)), kSwapAlignment);
        loc.region = {off, size};
        off += size;
      }
    }
    StateLocation& compute = locations[g][static_cast<int>(StateKind::kCompute)];
    if (compute.tier == Tier::kNvme && compute.held) {
      auto region = param_file->reserve(bytes(g, StateKind::kCompute));
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
        device_off[k] += align_up(bytes(g, static_cast<StateKind>(k)), gpu::kDeviceAlignment);
      }
    }
    ZO_RETURN_IF_ERROR(device->fill_zero(device_blocks[k], device_off[k], stream));
  }
  return device->synchronize(stream);
}

Result<std::unique_ptr<StateStore>> StateStore::create(const ParamRegistry& registry, const MemoryPlan& plan,
                                                       gpu::Device& device, io::IoEngine& io,
                                                       const StateStoreOptions& options, MemoryAccounting& accounting) {
  ZO_RETURN_IF_ERROR(io::require_env(options.env, "StateStoreOptions::env"));
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
    auto scratch = AlignedBuffer::allocate(kStoreScratchBytes);
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

void StateStore::mark_torn(std::string reason) { impl_->torn_reason = std::move(reason); }
const std::string& StateStore::torn_reason() const { return impl_->torn_reason; }

uint64_t StateStore::state_bytes(uint32_t sub_group, StateKind kind) const { return impl_->bytes(sub_group, kind); }

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

// What a run is built on, step by step (run_setup.h; Note [Trainer construction] in trainer.cpp).
#include "engine/train/run_setup.h"

#include <algorithm>
#include <span>
#include <sstream>

#include "common/aligned_buffer.h"
#include "common/bytes.h"
#include "common/host_info.h"
#include "common/string_util.h"
#include "engine/config/io_settings.h"
#include "engine/model/torch_runtime.h"
#include "engine/model/weights.h"
#include "engine/plan/lora.h"

namespace zo::engine {
namespace {

constexpr uint64_t kInitChunkElems = uint64_t{1} << 22;  // 16 MiB of fp32 per chunk while loading

}  // namespace

RunSetup::RunSetup(const TrainOptions& options) : opt_(options) {
  opt_.run_dir_lock.reset();  // OutputLocks holds it
  if (opt_.io_faults) faulty_env_ = std::make_unique<io::FaultyEnv>(io::Env::posix(), opt_.io_faults);
}

Status RunSetup::resolve_model() {
  ModelConfig& model = model_.config;
  if (opt_.model_config) {
    model = *opt_.model_config;
  } else {
    ZO_ASSIGN_OR_RETURN(const io::PathKind kind, env()->path_kind(opt_.model));
    model_.from_dir = kind == io::PathKind::kDirectory;
    ZO_ASSIGN_OR_RETURN(model, resolve_model_config(opt_.model, env()));
    if (model_.from_dir) ZO_RETURN_IF_ERROR(apply_weights_tying(opt_.model, &model, env()));
  }
  ZO_RETURN_IF_ERROR(check_model_size(model));
  // zoffload.lora.init_from's r, alpha and targets become the run's config, and so its checkpoints'.
  ZO_RETURN_IF_ERROR(read_peft_adapter_config(model, &opt_.config.zoffload.lora, env()));
  ZO_ASSIGN_OR_RETURN(model_.layout, training_layout(&model, opt_.config));
  const ModelLayout& layout = model_.layout;
  model_.trainable_slots.assign(layout.blocks.size(), {});
  model_.lowest_trainable_block = static_cast<uint32_t>(layout.blocks.size());
  for (uint32_t b = 0; b < layout.blocks.size(); ++b) {
    const std::vector<uint32_t>& params = layout.blocks[b].params;
    for (uint32_t i = 0; i < params.size(); ++i)
      if (layout.params[params[i]].trainable) model_.trainable_slots[b].push_back(i);
    if (!model_.trainable_slots[b].empty()) model_.lowest_trainable_block = std::min(model_.lowest_trainable_block, b);
  }
  model_.compute_dtype = opt_.config.compute_dtype();
  model_.seq_len = opt_.seq_len != 0 ? opt_.seq_len : std::min<uint64_t>(256, model.max_position_embeddings);
  return check_seq_len(model, model_.seq_len);
}

Status RunSetup::open_device() {
  const Config& config = opt_.config;
  ZO_ASSIGN_OR_RETURN(ParamRegistry reg,
                      ParamRegistry::build(model_.layout.params, config.zero.sub_group_size, world_size()));
  registry_.emplace(std::move(reg));
  // The device and its budget: zoffload.gpu_memory_limit, else what the GPU has (or, emulated, RAM).
  // A GPU the CUDA runtime lists but LibTorch cannot use is "present but unusable" for
  // make_device: auto warns and runs on the host, cuda is an error (docs/gpu.md).
  if (config.zoffload.device != DeviceKind::kHost) probe_ = probe_usable_gpus();
  uint64_t budget = config.zoffload.gpu_memory_limit;
  if (budget == 0) budget = !probe_.gpus.empty() ? probe_.gpus.front().total_bytes : host_info().mem_total_bytes;
  ZO_ASSIGN_OR_RETURN(device_, gpu::make_device(config.zoffload.device, budget, probe_));
  return Status::ok();
}

Status RunSetup::plan_memory() {
  PlanInputs pi;
  pi.config = opt_.config;
  pi.model = model_.config;
  pi.model_name = opt_.model;
  pi.seq_len = model_.seq_len;
  pi.device_budget_bytes = device_->stats().budget_bytes;
  pi.out_dir = opt_.out_dir;
  pi.host = probe_host(opt_.config, opt_.out_dir);
  pi.world_size = world_size();
  pi.rank = rank();
  if (device_->kind() == DeviceKind::kCuda && !probe_.gpus.empty()) {
    pi.host.cuda = true;
    pi.host.device_name = probe_.gpus.front().name;
    pi.host.device_total_bytes = probe_.gpus.front().total_bytes;
  }
  // Note [Replicated data parallel]: the ranks of one node start together, so each is planned
  // against its share of the node's RAM and disks (and, emulated, of the device's RAM) for the
  // states it holds (every one at stage 0, its partition's optimizer states at stages 1-3); each
  // GPU is its rank's own.
  const uint32_t local_ranks = opt_.group != nullptr ? opt_.group->world().local_world_size : 1;
  share_host(&pi.host, local_ranks);
  ZO_ASSIGN_OR_RETURN(run_plan_, plan_run(pi));
  // The memory plan the planner settled on ("auto" choices resolved against this host).
  plan_ = run_plan_.memory;
  if (!run_plan_.fits()) {
    std::vector<std::string> problems;
    for (const PlanProblem& p : run_plan_.problems) problems.push_back(p.to_string());
    const std::string shared = local_ranks > 1 ? " (each of this node's " + std::to_string(local_ranks) +
                                                     " ranks is planned with 1/" + std::to_string(local_ranks) +
                                                     " of its RAM and disk space)"
                                               : "";
    return out_of_memory("the plan does not fit this machine" + shared + ": " + join(problems, "; ") +
                         " (`zoffload plan` with the same arguments lists the changes that make it fit)");
  }
  track_torch_memory(cuda());
  return Status::ok();
}

Status RunSetup::create_states(const CheckpointInfo* resume) {
  const Config& config = opt_.config;
  ZO_ASSIGN_OR_RETURN(io::IoOptions io_options, io_options_from_config(config));
  ZO_ASSIGN_OR_RETURN(io_, io::IoEngine::create(io_options, opt_.io_faults));
  ZO_ASSIGN_OR_RETURN(executor_,
                      cpu_optim::Executor::create({.n_threads = static_cast<int>(config.zoffload.optimizer_threads),
                                                   .bind_cores = config.zoffload.bind_cores}));
  StateStoreOptions so;
  so.optimizer_nvme_path = resolve_run_path(opt_.out_dir, config.zero.offload_optimizer.nvme_path);
  so.param_nvme_path = resolve_run_path(opt_.out_dir, config.zero.offload_param.nvme_path);
  so.pinned_cap_bytes = config.zoffload.pinned_memory_limit;
  so.rank = rank();
  so.on_swap_file = opt_.on_swap_file;
  so.env = env();
  ZO_ASSIGN_OR_RETURN(store_, StateStore::create(*registry_, plan_, *device_, *io_, so, accounting_));
  if (store_->optimizer_file() != nullptr) swap_dir_ = engine::swap_dir(so.optimizer_nvme_path, so.rank);
  else if (store_->param_file() != nullptr) swap_dir_ = engine::swap_dir(so.param_nvme_path, so.rank);

  if (resume == nullptr) return init_weights();
  // Note [Resume]: the states stream from the checkpoint straight into their tiers through one
  // staging buffer (freed once loaded); the compute copies are re-derived from the master.
  uint64_t largest = 0;
  for (const FileDigest& f : resume->manifest.files) largest = std::max(largest, f.size_bytes);
  ZO_ASSIGN_OR_RETURN(AlignedBuffer staging, AlignedBuffer::allocate(staging_bytes_for(
                                                 config.zoffload.checkpoint.staging_buffer_size, largest)));
  return load_checkpoint(*resume, *store_, *io_, staging.bytes(), env());
}

// Weights stream chunk by chunk into their home tiers: the model is never whole in RAM.
Status RunSetup::init_weights() {
  const ModelConfig& model = model_.config;
  const ModelLayout& layout = model_.layout;
  ParamSink sink = [this](uint32_t param, uint64_t offset_elems, std::span<const float> values) {
    return store_->init_param(param, offset_elems, values);
  };
  // Note [The packed 4-bit base]: a frozen 4-bit or 8-bit projection's compute copy is its blob.
  PackedSink packed = [this](uint32_t param, uint64_t offset_bytes, std::span<const std::byte> bytes) {
    return store_->init_packed(param, offset_bytes, bytes);
  };
  if (const std::string& q = opt_.config.zoffload.quantize_base; q != "none") {  // QLoRA from a 16-bit base
    if (model.quantization.load_in_4bit && model.quantization.quant_type != q)
      return invalid_argument("zoffload.quantize_base is \"" + q + "\", but " + opt_.model +
                              " is already a bitsandbytes 4-bit checkpoint in " + model.quantization.quant_type +
                              ": set quantize_base to \"" + model.quantization.quant_type + "\" or leave it out");
    bnb4::QuantType type;
    ZO_CHECK(bnb4::parse_quant_type(q, &type)) << q;  // the config's choices
    // A directory already 4-bit in this type is trained as it is stored (the shipped QLoRA configs
    // serve both kinds of directory).
    if (!model.quantization.load_in_4bit) sink = quantizing_sink(layout, type, std::move(sink), packed);
  }
  if (!model_.from_dir) return random_init_weights(model, layout, opt_.seed, kInitChunkElems, sink);  // adapters too
  ZO_RETURN_IF_ERROR(load_hf_weights(opt_.model, layout, kInitChunkElems, sink, env(), packed));
  if (model.lora.r == 0) return Status::ok();
  const std::string& from = opt_.config.zoffload.lora.init_from;
  if (from.empty()) return init_lora_adapters(layout, opt_.seed, kInitChunkElems, sink);
  const AdapterLimits limits{.scaling = model.lora.scaling(), .max_value = dtype_max_value(model_.compute_dtype)};
  return load_peft_adapters(from, layout, kInitChunkElems, sink, env(), limits).with_context("zoffload.lora.init_from");
}

Status RunSetup::create_pipeline() {
  const Config& config = opt_.config;
  ZO_ASSIGN_OR_RETURN(optimizer_, OptimizerSwapper::create(*store_, *executor_, PipelineOptions::from_config(config)));
  if (store_->param_file() != nullptr && !plan_.partition_params) {  // gathered ones are read by the gatherer
    ZO_ASSIGN_OR_RETURN(param_swapper_, ParamSwapper::create(*store_));
  }
  std::vector<std::vector<uint32_t>> blocks;
  std::vector<std::string> names;
  for (const BlockSpec& b : model_.layout.blocks) {
    blocks.push_back(b.params);
    names.push_back(b.name);
  }
  // A frozen sub-group is final while an update runs (Note [Frozen sub-groups]).
  gate_ = std::make_unique<UpdateGate>(store_->plan().n_sub_groups, store_->plan().frozen);
  if (plan_.partition_params) {
    ZO_ASSIGN_OR_RETURN(param_group_, opt_.group->create_sibling("params"));
    ZO_ASSIGN_OR_RETURN(
        std::span<std::byte> slots,
        store_->pool().allocate(plan_.gather_slots * plan_.gather_slot_bytes, "the parameter gather slots"));
    BlockGathererOptions go;
    go.rank = rank();
    go.gate = gate_.get();
    go.memory = slots;
    go.slots = plan_.gather_slots;
    go.bucket_elems = config.zero.allgather_bucket_size;
    go.block_names = names;
    go.broadcast = [group = param_group_.get()](void* data, uint64_t n, uint32_t root, const std::string& what) {
      return group->broadcast(data, n, root, what);
    };
    ZO_ASSIGN_OR_RETURN(gatherer_, BlockGatherer::create(*store_, blocks, std::move(go)));
  }
  CoordinatorOptions coord_options = CoordinatorOptions::from_config(config);
  coord_options.device_reserve_bytes = run_plan_.device_torch_reserve_bytes;  // Note [The budget holds LibTorch too]
  ZO_ASSIGN_OR_RETURN(coord_, ParamCoordinator::create(*store_, param_swapper_.get(), std::move(blocks),
                                                       std::move(names), coord_options, gatherer_.get()));
  coord_->set_update_gate(gate_.get());
  if (opt_.group != nullptr)
    data_parallel_ = std::make_unique<dist::DataParallel>(
        *opt_.group, *store_, *registry_, *executor_, accounting_,
        dist::DataParallelOptions{.reduce_bucket_elems = config.zero.reduce_bucket_size});
  return Status::ok();
}

std::string RunSetup::describe() const {
  const Placement& pl = plan_.placement;
  uint64_t compute_nvme = 0, compute_cpu = 0;
  for (Tier t : pl.compute) {
    if (t == Tier::kNvme) ++compute_nvme;
    else if (t == Tier::kCpu) ++compute_cpu;
  }
  std::ostringstream s;
  s << "model " << opt_.model << " (" << model_.config.num_hidden_layers << " layers, hidden "
    << model_.config.hidden_size << ", " << format_count(registry_->total_weights()) << " params"
    << (registry_->trainable_elems() != registry_->total_elems()
            ? ", " + format_count(registry_->trainable_elems()) + " trainable (" +
                  (model_.config.lora.r > 0 ? "zoffload.lora: LoRA r=" + std::to_string(model_.config.lora.r)
                                            : "zoffload.freeze") +
                  ")"
            : "")
    << ")"
    << (registry_->packed_weights() > 0
            ? " | " + std::string(model_.config.quantization.bits_name()) +
                  " base: " + format_count(registry_->packed_weights()) + " frozen weights packed in " +
                  format_bytes(registry_->packed_elems() * dtype_size_bytes(model_.compute_dtype)) +
                  ", dequantized on the device as each block is fetched"
            : "")
    << " | " << dtype_name(model_.compute_dtype) << " compute, " << dtype_name(pl.grad_dtype) << " gradients"
    << (pl.grads_rounded() ? " (" + std::string(dtype_name(pl.grad_sum_dtype)) + " sums, norm before rounding)" : "")
    << " | ZeRO stage " << opt_.config.zero.stage << ", " << registry_->sub_groups().size() << " sub-groups";
  if (plan_.partitioned())
    s << " (this rank steps " << plan_.owned_begin << "-" << plan_.owned_end - 1 << ": partition " << rank() << " of "
      << world_size()
      << (plan_.partition_params ? "; it holds their compute copies only, each block gathered from its owners at fetch"
                                 : "")
      << ")";
  s << " | optimizer states on " << tier_name(pl.optimizer);
  if (pl.master_dtype != DType::kF32 || pl.moments != MomentDtype::kF32)
    s << " (" << dtype_name(pl.master_dtype) << " masters"
      << (pl.master_dtype == DType::kBF16 ? " rounded stochastically" : "") << ", " << moment_dtype_name(pl.moments)
      << " moments)";
  if (pl.no_accumulator) s << ", no gradient accumulators (each sub-group stepped as its gradient lands)";
  else s << ", gradient accumulators on " << tier_name(pl.grad);
  s << ", compute copies: " << (pl.compute.size() - compute_cpu - compute_nvme) << " device, " << compute_cpu
    << " cpu, " << compute_nvme << " nvme | device " << device_->name() << ", budget "
    << format_bytes(device_->stats().budget_bytes) << " | pinned pool "
    << format_bytes(store_->pool().capacity_bytes());
  const ArenaPlan& ap = run_plan_.arena;
  if (ap.largest_param_elems > 0) {  // some params are fetched
    s << " | prefetch ";
    if (ap.prefetch_bucket_elems == 0) s << "off (stage3_prefetch_bucket_size 0)";
    else if (ap.prefetch_by_blocks) s << prefetch_by_blocks_text(ap, opt_.config.zero.stage3_prefetch_bucket_size);
    else s << format_count(ap.prefetch_bucket_elems) << " elements ahead";
  }
  if (const uint64_t held = vertical_micro_batches(opt_.config); held > 1)
    s << " | vertical schedule: " << held << " micro-batches per block visit";
  return s.str();
}

}  // namespace zo::engine

// The trainer: the one place where the model (LibTorch), the tiers and the optimizer meet. This
// file builds a run and holds its public calls (checkpoints, export, description); the step is in
// step.cpp, activation checkpoints on the host in host_checkpoints.cpp (trainer_impl.h).
#include "engine/train/trainer.h"

#include <malloc.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <random>
#include <sstream>

#include <nlohmann/json.hpp>

#include "common/bytes.h"
#include "common/host_info.h"
#include "common/log.h"
#include "common/string_util.h"
#include "common/trace.h"
#include "engine/ckpt/export_gathered.h"
#include "engine/config/io_settings.h"
#include "engine/model/weights.h"
#include "engine/plan/lora.h"
#include "engine/train/trainer_impl.h"

namespace zo::engine {
namespace {

namespace fs = std::filesystem;

constexpr uint64_t kInitChunkElems = uint64_t{1} << 22;  // 16 MiB of fp32 per chunk while loading

// Locks `dir` (created when missing) with an exclusive flock on DIR/.zoffload.lock for as long as
// the returned file is open (Note [One run per run directory]). `what` names it in messages,
// `instead` says what to do when another run holds it.
Result<std::shared_ptr<io::File>> lock_dir(const std::string& dir, const std::string& what, const std::string& instead,
                                           io::Env* env, std::string* created_top = nullptr) {
  ZO_RETURN_IF_ERROR(env->make_dirs(dir, created_top).with_context("creating " + what + " " + dir));
  const std::string path = dir + "/.zoffload.lock";
  ZO_ASSIGN_OR_RETURN(io::File file, env->open_file(path, io::OpenMode::kCreate, /*direct=*/false));
  if (Status st = file.lock_exclusive(); !st.is_ok()) {
    const int err = st.sys_errno();
    if (st.code() != StatusCode::kFailedPrecondition && (err == ENOSYS || err == ENOLCK || err == EOPNOTSUPP)) {
      // A file system without flock (Lustre without -o flock, NFS without lockd): the run goes on
      // unguarded rather than not at all.
      ZO_LOG(kWarn) << "cannot lock " << what << " " << dir << " (" << st.message()
                    << "): nothing stops a second run on it";
      return std::make_shared<io::File>(std::move(file));
    }
    if (st.code() != StatusCode::kFailedPrecondition) return st.with_context("locking " + what + " " + dir);
    return failed_precondition(what + " " + dir + " is in use by another zoffload run (it holds " + path +
                               "): wait for that run to end, or " + instead);
  }
  return std::make_shared<io::File>(std::move(file));
}

// Two spellings of one directory compare equal (".", "./ckpt/..", symlinks).
std::string canonical_dir(io::Env* env, const std::string& dir) {
  Result<std::string> p = env->canonical_path(dir.empty() ? "." : dir);
  return p.is_ok() ? *p : fs::absolute(dir.empty() ? "." : dir).lexically_normal().string();
}

constexpr const char* kRunIdFile = ".zoffload.run_id";

// A fresh run's id (Note [Run ids]).
std::string new_run_id() {
  std::random_device rd;
  const uint64_t v = (uint64_t{rd()} << 32) ^ rd();
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

}  // namespace

// Note [Host compute]: on the emulated device the blocks run on LibTorch's CPU kernels, which
// allocate and free activation-sized buffers for every op. With glibc's defaults each buffer above
// the (dynamic) mmap threshold is a fresh mmap whose pages fault in and whose munmap returns them:
// that was ~40% of the tiny demo's step. Keeping freed memory in the heap (a high mmap and trim
// threshold) removes it. The setting is process-wide, so the program decides (tools/zoffload does).
void tune_allocator_for_host_compute() {
  mallopt(M_MMAP_THRESHOLD, 256 << 20);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
}

// Note [Trainer construction]: init runs the steps below in order; each one needs only what the
// steps before it built. Nothing large is allocated before plan_memory has checked the run against
// this machine, and nothing of the step loop exists before the states do.
Status Trainer::Impl::init(const TrainOptions& options) {
  opt = options;
  if (opt.group != nullptr) {
    const Config& c = opt.config;
    const uint64_t product = c.train_micro_batch_size_per_gpu * c.gradient_accumulation_steps * world_size();
    if (c.train_batch_size != product)
      return invalid_argument("train_batch_size " + std::to_string(c.train_batch_size) +
                              " is not train_micro_batch_size_per_gpu × "
                              "gradient_accumulation_steps × world size (" +
                              std::to_string(c.train_micro_batch_size_per_gpu) + " × " +
                              std::to_string(c.gradient_accumulation_steps) + " × " + std::to_string(world_size()) +
                              ")");
  }
  if (opt.io_faults) faulty_env = std::make_unique<io::FaultyEnv>(io::Env::posix(), opt.io_faults);
  run_id = new_run_id();  // a resume takes its checkpoint's (find_resume)
  ZO_RETURN_IF_ERROR(resolve_model());
  ZO_RETURN_IF_ERROR(prepare_run_dir());
  ZO_RETURN_IF_ERROR(find_resume());
  ZO_RETURN_IF_ERROR(open_device());
  ZO_RETURN_IF_ERROR(plan_memory());
  ZO_RETURN_IF_ERROR(create_states());
  ZO_RETURN_IF_ERROR(create_step_pipeline());
  ZO_RETURN_IF_ERROR(create_schedules());
  ZO_RETURN_IF_ERROR(open_data());
  if (resume) ZO_RETURN_IF_ERROR(resume_from_checkpoint());
  ZO_RETURN_IF_ERROR(open_metrics());
  ZO_RETURN_IF_ERROR(write_run_id());
  accounting.reset_peaks();
  return Status::ok();
}

Status Trainer::Impl::resolve_model() {
  if (opt.model_config) {
    model = *opt.model_config;
  } else {
    ZO_ASSIGN_OR_RETURN(const io::PathKind kind, env()->path_kind(opt.model));
    model_dir = kind == io::PathKind::kDirectory;
    ZO_ASSIGN_OR_RETURN(model, resolve_model_config(opt.model, env()));
    if (model_dir) ZO_RETURN_IF_ERROR(apply_weights_tying(opt.model, &model, env()));
  }
  ZO_RETURN_IF_ERROR(check_model_size(model));
  // zoffload.lora.init_from's r, alpha and targets become the run's config, and so its checkpoints'.
  ZO_RETURN_IF_ERROR(read_peft_adapter_config(model, &opt.config.zoffload.lora, env()));
  ZO_ASSIGN_OR_RETURN(layout, training_layout(&model, opt.config));
  trainable_slots.assign(layout.blocks.size(), {});
  lowest_trainable_block = static_cast<uint32_t>(layout.blocks.size());
  for (uint32_t b = 0; b < layout.blocks.size(); ++b) {
    const std::vector<uint32_t>& params = layout.blocks[b].params;
    for (uint32_t i = 0; i < params.size(); ++i)
      if (layout.params[params[i]].trainable) trainable_slots[b].push_back(i);
    if (!trainable_slots[b].empty()) lowest_trainable_block = std::min(lowest_trainable_block, b);
  }
  compute_dtype = opt.config.compute_dtype();
  seq_len = opt.seq_len != 0 ? opt.seq_len : std::min<uint64_t>(256, model.max_position_embeddings);
  return check_seq_len(model, seq_len);
}

Status Trainer::Impl::prepare_run_dir() {
  // Note [One run per run directory]: two runs on one --out would append to one metrics file, tidy
  // away each other's checkpoint saves in progress and mix their checkpoints. Rank 0 locks the
  // directory before anything in it is touched (the other ranks write nothing there before they
  // have connected to it); the lock file stays, so that no two processes can lock two files. The
  // same holds for every output directory a config can put outside --out, or share between two
  // --out: the checkpoint directory, wherever it is (two runs pruned each other's steps, removed
  // each other's saves in progress as stale and moved `latest` between them: another run's absolute
  // checkpoint.dir may point into this --out), and the monitors' directories outside --out. Each is
  // locked the same way, by a .zoffload.lock of its own, before this run touches it.
  if (rank() == 0 && !opt.run_dir_lock) {
    std::string created;
    ZO_ASSIGN_OR_RETURN(opt.run_dir_lock, lock_run_dir(opt.out_dir, env(), &created));
    if (!created.empty()) created_dirs.push_back(created);
  } else if (!opt.out_dir.empty()) {
    ZO_RETURN_IF_ERROR(env()->make_dirs(opt.out_dir).with_context("creating the run directory " + opt.out_dir));
  }
  const Config& config = opt.config;
  metrics_path = resolve_run_path(
      opt.out_dir, config.zoffload.log.metrics_path.empty() ? "metrics.jsonl" : config.zoffload.log.metrics_path);
  // Note [Output files] (io/env.h): the files this run writes are checked now, not after a step.
  if (rank() == 0) {
    ZO_RETURN_IF_ERROR(env()->check_output_file(metrics_path, "the metrics file (zoffload.log.metrics_path)"));
    for (const MonitorConfig* mc : {&config.tensorboard, &config.csv_monitor}) {
      if (mc->enabled)
        ZO_RETURN_IF_ERROR(lock_output_dir(monitor_dir(*mc),
                                           mc == &config.tensorboard ? "the tensorboard directory"
                                                                     : "the csv_monitor directory",
                                           /*inside_out_too=*/false));
    }
    ZO_RETURN_IF_ERROR(read_run_id());
    if (config.csv_monitor.enabled) {
      StepMetrics prototype;
      if (!opt.eval_data_path.empty()) prototype.eval.emplace();  // its files too
      ZO_RETURN_IF_ERROR(monitor::CsvMonitor::check_files(env(), monitor_dir(config.csv_monitor),
                                                          monitor::scalars_of_metrics_record(prototype.record())));
    }
  }
  if (!config.zoffload.checkpoint.dir.empty()) {
    checkpoint_dir = resolve_run_path(opt.out_dir, config.zoffload.checkpoint.dir);
    ZO_ASSIGN_OR_RETURN(const io::PathKind kind, env()->path_kind(checkpoint_dir));
    if (kind != io::PathKind::kMissing && kind != io::PathKind::kDirectory)
      return invalid_argument("zoffload.checkpoint.dir " + checkpoint_dir + " exists and is not a directory");
    // Missing: its parents must be directories or missing (not "file/ckpt").
    if (kind == io::PathKind::kMissing)
      ZO_RETURN_IF_ERROR(env()->check_output_file(checkpoint_dir, "zoffload.checkpoint.dir"));
    if (rank() != 0) return Status::ok();  // rank 0 writes the checkpoints, and tidies them
    ZO_RETURN_IF_ERROR(lock_output_dir(checkpoint_dir, "zoffload.checkpoint.dir", /*inside_out_too=*/true));
    ZO_ASSIGN_OR_RETURN(std::vector<std::string> stale, clean_stale_checkpoints(checkpoint_dir, env()));
    for (const std::string& name : stale)
      ZO_LOG(kInfo) << "removed " << checkpoint_dir << "/" << name << ", left by a save that did not finish";
  }
  return Status::ok();
}

Status Trainer::Impl::find_resume() {
  if (opt.resume.empty()) return Status::ok();
  std::string where = opt.resume;
  if (where == "latest") {
    if (checkpoint_dir.empty())
      return invalid_argument(
          "--resume latest: the config sets no zoffload.checkpoint.dir to look in; give the "
          "checkpoint's path instead");
    where = checkpoint_dir;
  }
  auto path = resolve_checkpoint(where, env());
  // A --resume that names no checkpoint is bad input, like a bad --model.
  if (!path.is_ok() && path.status().code() == StatusCode::kNotFound)
    return invalid_argument("--resume: " + path.status().message());
  if (!path.is_ok()) return path.status();
  ZO_ASSIGN_OR_RETURN(CheckpointInfo info, open_checkpoint(*path, env()));
  // Note [Run ids]: a checkpoint found through `latest` must be this --out's run's.
  const bool via_latest = *path != where;
  if (via_latest && rank() == 0 && !info.state.run_id.empty() && !out_run_id.empty() &&
      info.state.run_id != out_run_id)
    return invalid_argument("--resume " + opt.resume + ": " + info.path + " was written by another run (run id " +
                            info.state.run_id + (info.state.out.empty() ? "" : ", --out " + info.state.out) +
                            ") than the one in " + (opt.out_dir.empty() ? "." : opt.out_dir) + " (run id " +
                            out_run_id + "): two runs share " + where +
                            ". Give the step directory itself (--resume " + info.path +
                            ") to continue that run from here");
  run_id = info.state.run_id.empty() ? new_run_id() : info.state.run_id;
  // A model this build cannot compute (a family it does not know, saved by a newer build) is
  // refused before anything is read, even where its tensors have the run's names and shapes.
  Result<ModelConfig> saved = parse_hf_config(info.model_config_json, info.path + "/config.json");
  if (!saved.is_ok())
    return Status(saved.status()).with_context("--resume " + info.path + ": its model is not one this build trains");
  // The adapters' scale is no tensor's shape, so the state files cannot tell it: a resume with
  // another lora_alpha or use_rslora would go on training another function (as would other targets).
  ZO_ASSIGN_OR_RETURN(const LoraConfig saved_lora,
                      checkpoint_lora_config(info.state.config, info.path + "/trainer_state.json"));
  Result<LoraSpec> saved_spec = lora_spec(model, saved_lora);
  if (!saved_spec.is_ok())
    return invalid_argument("--resume " + info.path + ": its zoffload.lora does not fit this model (" +
                            saved_spec.status().message() + "): a checkpoint of another model");
  const std::string differs = lora_difference(*saved_spec, model.lora);
  if (!differs.empty() && saved_spec->r == 0)
    return invalid_argument("--resume " + info.path + ": it holds no LoRA adapters, and this run's zoffload.lora asks "
                            "for r " + std::to_string(model.lora.r) + ": resume with the checkpoint's zoffload.lora");
  if (!differs.empty())
    return invalid_argument("--resume " + info.path + ": its LoRA adapters were trained with " + differs +
                            " as this run's zoffload.lora gives: resume with the checkpoint's zoffload.lora (r, "
                            "lora_alpha, use_rslora, target_modules)");
  resume = std::move(info);
  return Status::ok();
}

Status Trainer::Impl::open_device() {
  const Config& config = opt.config;
  ZO_ASSIGN_OR_RETURN(ParamRegistry reg, ParamRegistry::build(layout.params, config.zero.sub_group_size, world_size()));
  registry.emplace(std::move(reg));
  // The device and its budget: zoffload.gpu_memory_limit, else what the GPU has (or, emulated, RAM).
  // A GPU the CUDA runtime lists but LibTorch cannot use is "present but unusable" for
  // make_device: auto warns and runs on the host, cuda is an error (docs/gpu.md).
  if (config.zoffload.device != DeviceKind::kHost) probe = probe_usable_gpus();
  uint64_t budget = config.zoffload.gpu_memory_limit;
  if (budget == 0) budget = !probe.gpus.empty() ? probe.gpus.front().total_bytes : host_info().mem_total_bytes;
  ZO_ASSIGN_OR_RETURN(device, gpu::make_device(config.zoffload.device, budget, probe));
  torch_device = device->kind() == DeviceKind::kCuda ? torch::Device(torch::kCUDA, 0) : torch::Device(torch::kCPU);
  return Status::ok();
}

Status Trainer::Impl::plan_memory() {
  PlanInputs pi;
  pi.config = opt.config;
  pi.model = model;
  pi.model_name = opt.model;
  pi.seq_len = seq_len;
  pi.device_budget_bytes = device->stats().budget_bytes;
  pi.out_dir = opt.out_dir;
  pi.host = probe_host(opt.config, opt.out_dir);
  pi.world_size = world_size();
  pi.rank = rank();
  if (device->kind() == DeviceKind::kCuda && !probe.gpus.empty()) {
    pi.host.cuda = true;
    pi.host.device_name = probe.gpus.front().name;
    pi.host.device_total_bytes = probe.gpus.front().total_bytes;
  }
  // Note [Replicated data parallel]: the ranks of one node start together, so each is planned
  // against its share of the node's RAM and disks (and, emulated, of the device's RAM) for the
  // states it holds (every one at stage 0, its partition's optimizer states at stages 1-3); each
  // GPU is its rank's own.
  const uint32_t local_ranks = opt.group != nullptr ? opt.group->world().local_world_size : 1;
  share_host(&pi.host, local_ranks);
  ZO_ASSIGN_OR_RETURN(run_plan, plan_run(pi));
  // The memory plan the planner settled on ("auto" choices resolved against this host).
  plan = run_plan.memory;
  if (!run_plan.fits()) {
    std::vector<std::string> problems;
    for (const PlanProblem& p : run_plan.problems) problems.push_back(p.to_string());
    const std::string shared = local_ranks > 1 ? " (each of this node's " + std::to_string(local_ranks) +
                                                     " ranks is planned with 1/" + std::to_string(local_ranks) +
                                                     " of its RAM and disk space)"
                                               : "";
    return out_of_memory("the plan does not fit this machine" + shared + ": " + join(problems, "; ") +
                         " (`zoffload plan` with the same arguments lists the changes that make it fit)");
  }
  track_torch_memory(torch_device.is_cuda());
  return Status::ok();
}

Status Trainer::Impl::create_states() {
  const Config& config = opt.config;
  ZO_ASSIGN_OR_RETURN(io::IoOptions io_options, io_options_from_config(config));
  ZO_ASSIGN_OR_RETURN(io, io::IoEngine::create(io_options, opt.io_faults));
  ZO_ASSIGN_OR_RETURN(executor,
                      cpu_optim::Executor::create({.n_threads = static_cast<int>(config.zoffload.optimizer_threads),
                                                   .bind_cores = config.zoffload.bind_cores}));
  StateStoreOptions so;
  so.optimizer_nvme_path = resolve_run_path(opt.out_dir, config.zero.offload_optimizer.nvme_path);
  so.param_nvme_path = resolve_run_path(opt.out_dir, config.zero.offload_param.nvme_path);
  so.pinned_cap_bytes = config.zoffload.pinned_memory_limit;
  so.rank = rank();
  so.on_swap_file = opt.on_swap_file;
  so.env = env();
  ZO_ASSIGN_OR_RETURN(store, StateStore::create(*registry, plan, *device, *io, so, accounting));
  if (store->optimizer_file() != nullptr) swap_dir = zo::engine::swap_dir(so.optimizer_nvme_path, so.rank);
  else if (store->param_file() != nullptr) swap_dir = zo::engine::swap_dir(so.param_nvme_path, so.rank);

  if (!resume) return init_weights();
  // Note [Resume]: the states stream from the checkpoint straight into their tiers through one
  // staging buffer (freed once loaded); the compute copies are re-derived from the master.
  uint64_t largest = 0;
  for (const FileDigest& f : resume->manifest.files) largest = std::max(largest, f.size_bytes);
  ZO_ASSIGN_OR_RETURN(AlignedBuffer staging, AlignedBuffer::allocate(staging_bytes_for(
                                                 config.zoffload.checkpoint.staging_buffer_size, largest)));
  return load_checkpoint(*resume, *store, *io, staging.bytes(), env());
}

Status Trainer::Impl::create_step_pipeline() {
  const Config& config = opt.config;
  ZO_ASSIGN_OR_RETURN(optimizer, OptimizerSwapper::create(*store, *executor, PipelineOptions::from_config(config)));
  if (store->param_file() != nullptr && !plan.partition_params) {  // gathered ones are read by the gatherer
    ZO_ASSIGN_OR_RETURN(param_swapper, ParamSwapper::create(*store));
  }
  std::vector<std::vector<uint32_t>> blocks;
  std::vector<std::string> names;
  for (const BlockSpec& b : layout.blocks) {
    blocks.push_back(b.params);
    names.push_back(b.name);
  }
  // Backward's order: head, decoders n-2..1, embedding; their trainable params only.
  std::vector<uint32_t> contribution_order = engine::contribution_order(layout);
  // A frozen sub-group is final while an update runs (Note [Frozen sub-groups]).
  gate = std::make_unique<UpdateGate>(store->plan().n_sub_groups, store->plan().frozen);
  if (plan.partition_params) {
    ZO_ASSIGN_OR_RETURN(param_group, opt.group->create_sibling("params"));
    ZO_ASSIGN_OR_RETURN(std::span<std::byte> slots, store->pool().allocate(plan.gather_slots * plan.gather_slot_bytes,
                                                                           "the parameter gather slots"));
    BlockGathererOptions go;
    go.rank = rank();
    go.gate = gate.get();
    go.memory = slots;
    go.slots = plan.gather_slots;
    go.bucket_elems = config.zero.allgather_bucket_size;
    go.block_names = names;
    go.broadcast = [group = param_group.get()](void* data, uint64_t n, uint32_t root, const std::string& what) {
      return group->broadcast(data, n, root, what);
    };
    ZO_ASSIGN_OR_RETURN(gatherer, BlockGatherer::create(*store, blocks, std::move(go)));
  }
  CoordinatorOptions coord_options = CoordinatorOptions::from_config(config);
  coord_options.device_reserve_bytes = run_plan.device_torch_reserve_bytes;  // Note [The budget holds LibTorch too]
  ZO_ASSIGN_OR_RETURN(coord, ParamCoordinator::create(*store, param_swapper.get(), std::move(blocks), std::move(names),
                                                      coord_options, gatherer.get()));
  ZO_ASSIGN_OR_RETURN(released, device->create_event());
  ZO_ASSIGN_OR_RETURN(landed, device->create_event());
  ZO_ASSIGN_OR_RETURN(copies_after, device->create_event());
  ZO_RETURN_IF_ERROR(create_host_checkpoints());
  coord->set_update_gate(gate.get());
  if (opt.group != nullptr)
    data_parallel = std::make_unique<dist::DataParallel>(
        *opt.group, *store, *registry, *executor, accounting,
        dist::DataParallelOptions{.reduce_bucket_elems = config.zero.reduce_bucket_size});
  ReducerOptions reducer;
  if (plan.partition_grads) {
    // Note [Partitioned gradients] (grad_accumulator.h): on the gradient worker's thread, as
    // backward produces them; the training thread issues no collective until the worker is drained.
    reducer.chunk_elems = kDataParallelChunkElems;
    reducer.reduce = [this](uint32_t g, std::byte* data, uint64_t n) {
      // In the sum dtype: stored-16-bit gradients are rounded by their owner after the reduce.
      return data_parallel->reduce_in_buckets(data, n, plan.placement.grad_sum_dtype, registry->partition_of_group(g),
                                              "reducing the gradients of sub-group " + std::to_string(g));
    };
  }
  FinalGradSink sink;
  if (plan.placement.no_accumulator) {  // Note [No accumulator]: on the gradient worker's thread
    sink = [this](uint32_t g, std::byte* grad, double* sum_sq) { return optimizer->step_direct(g, grad, sum_sq); };
  }
  ZO_ASSIGN_OR_RETURN(grads, GradAccumulator::create(*store, std::move(contribution_order), *executor,
                                                     std::move(reducer), std::move(sink)));
  // The landing ring comes from the pool: pinned, so that gradients leave the GPU by DMA.
  ZO_ASSIGN_OR_RETURN(std::span<std::byte> ring,
                      store->pool().allocate(plan.grad_ring_bytes, "the gradient landing ring"));
  ZO_ASSIGN_OR_RETURN(grad_worker, GradWorker::create(*grads, ring, {}, device.get()));
  return Status::ok();
}

Status Trainer::Impl::create_schedules() {
  ZO_ASSIGN_OR_RETURN(LossScaler s, LossScaler::for_config(opt.config));
  scaler.emplace(s);
  ZO_ASSIGN_OR_RETURN(LrSchedule sched, LrSchedule::create(opt.config.scheduler, opt.config.optimizer.lr));
  schedule.emplace(sched);
  return Status::ok();
}

Status Trainer::Impl::open_data() {
  DataOptions d;
  d.path = opt.data_path;
  d.source.format = opt.data_format;
  d.source.env = env();
  d.seq_len = seq_len;
  d.micro_batch = opt.config.train_micro_batch_size_per_gpu;
  d.seed = resume ? resume->state.seed : opt.seed;
  d.shuffle = opt.config.zoffload.data.shuffle;
  d.rank = rank();
  d.world_size = world_size();
  ZO_ASSIGN_OR_RETURN(data, Dataset::open(d));
  if (!opt.eval_data_path.empty()) ZO_RETURN_IF_ERROR(open_eval_data(d));
  return torch_call("building the RoPE tables",
                    [&] { rope = make_rope_tables(model, static_cast<int64_t>(d.seq_len), torch_device); });
}

Status Trainer::Impl::open_eval_data(const DataOptions& train) {
  if (opt.eval_batches == 0) return invalid_argument("--eval-batches must be at least 1");
  if (opt.eval_every == 0 && opt.last_step == 0)
    return invalid_argument("--eval-data " + opt.eval_data_path +
                            " would never be evaluated: it is evaluated every --eval-every steps and after the "
                            "last step, and neither is set");
  DataOptions d = train;
  d.path = opt.eval_data_path;
  d.shuffle = false;  // Note [Evaluation]: the same batches every time, in file order
  Result<std::unique_ptr<Dataset>> opened = Dataset::open(d);
  if (!opened.is_ok()) return Status(opened.status()).with_context("--eval-data");
  eval_data = std::move(*opened);
  const uint64_t batches = std::min(opt.eval_batches, eval_data->batches_per_epoch());
  eval_batches_per_rank = batches / world_size();
  if (eval_batches_per_rank == 0)
    return invalid_argument("--eval-batches " + std::to_string(opt.eval_batches) + " gives " +
                            std::to_string(world_size()) + " ranks no batch each: ask for at least " +
                            std::to_string(world_size()));
  if (batches < opt.eval_batches)
    ZO_LOG(kInfo) << "--eval-data " << opt.eval_data_path << " holds " << batches << " micro-batches of "
                  << train.micro_batch << " x " << train.seq_len << " tokens: each evaluation reads those ("
                  << "--eval-batches asked for " << opt.eval_batches << ")";
  // Note [Evaluation]: every evaluation reads the same rows, the file's first windows (every rank's
  // batches together, in file order), so their tokens and labels are checked now: an id outside the
  // vocabulary found at the first evaluation would stop the run after a step it then could not save.
  const uint64_t tokens = eval_batches_per_rank * world_size() * train.micro_batch * train.seq_len;
  const TokenSource& source = eval_data->source();
  constexpr uint64_t kChunk = uint64_t{1} << 20;
  std::vector<int32_t> ids, labels;
  for (uint64_t begin = 0; begin <= tokens; begin += kChunk) {
    const uint64_t n = std::min(kChunk, tokens + 1 - begin);  // tokens [0, T·windows] with the last target
    ids.resize(n);
    labels.resize(n);
    ZO_RETURN_IF_ERROR(source.read(begin, n, ids.data(), labels.data()).with_context("--eval-data"));
    for (uint64_t i = 0; i < n; ++i) {
      const uint64_t at = begin + i;
      // Position `at` is an input when it is below `tokens`, and a target from position 1 on.
      const bool bad_input = at < tokens && outside_vocab(ids[i], false);
      const bool bad_label = at > 0 && outside_vocab(labels[i], true);
      if (bad_input || bad_label)
        return invalid_argument("--eval-data " + opt.eval_data_path + ": " + (bad_input ? "token " : "label ") +
                                std::to_string(bad_input ? ids[i] : labels[i]) + " at token " + std::to_string(at) +
                                " (window " + std::to_string((at - (bad_input ? 0 : 1)) / train.seq_len) +
                                ", read by every evaluation) is outside the model's vocabulary of " +
                                std::to_string(model.vocab_size));
    }
  }
  return Status::ok();
}

Status Trainer::Impl::open_metrics() {
  // A resumed run appends to the metrics of the run it continues; a new run starts them afresh.
  // (resume_from_checkpoint, which runs before, has released `resume`: resumed_from says.)
  const bool resumed = !resumed_from.empty();
  if (rank() != 0) return Status::ok();  // rank 0 writes the metrics and monitors, for all ranks
  // A new run replaces an earlier run's metrics whole (Note [Output files]); a directory there was
  // refused by prepare_run_dir.
  if (resumed) {
    ZO_ASSIGN_OR_RETURN(metrics, env()->open_append(metrics_path));
  } else {
    ZO_ASSIGN_OR_RETURN(metrics,
                        env()->open_fresh_append(metrics_path, "the metrics file (zoffload.log.metrics_path)"));
  }
  const Config& config = opt.config;
  if (config.tensorboard.enabled) {
    ZO_ASSIGN_OR_RETURN(tensorboard, monitor::TensorBoardMonitor::open(env(), monitor_dir(config.tensorboard)));
  }
  if (config.csv_monitor.enabled) {
    ZO_ASSIGN_OR_RETURN(csv_monitor, monitor::CsvMonitor::open(env(), monitor_dir(config.csv_monitor), resumed));
  }
  return Status::ok();
}

std::string Trainer::Impl::monitor_dir(const MonitorConfig& mc) const {
  // DeepSpeed writes to os.path.join(output_path, job_name); output_path is relative to the run
  // directory here, as every path of the config is.
  const std::string base = resolve_run_path(opt.out_dir, mc.output_path.empty() ? "." : mc.output_path);
  return mc.job_name.empty() ? base : mc.job_name.front() == '/' ? mc.job_name : base + "/" + mc.job_name;
}

namespace {

// The key paths where two resolved configs differ in what affects the arithmetic.
void config_diff(const nlohmann::json& a, const nlohmann::json& b, const std::string& path,
                 std::vector<std::string>* out) {
  // Where the states live, how they move and where files go never change the arithmetic (the
  // offload invariant): only the rest is worth a warning. Of the zoffload block, the loss's
  // normalisation and the data's order do (the state dtypes are checked apart, and refused).
  if (path == "zoffload") {
    for (const char* key : {"loss_normalization", "data"}) {
      if (a.contains(key) && b.contains(key)) config_diff(a[key], b[key], path + "." + key, out);
    }
    return;
  }
  for (const char* skip :
       {"aio", "zero_optimization", "steps_per_print", "wall_clock_breakdown", "tensorboard", "csv_monitor"}) {
    if (path.rfind(skip, 0) == 0) return;
  }
  if (a.is_object() && b.is_object()) {
    for (auto it = a.begin(); it != a.end(); ++it) {
      const std::string p = path.empty() ? it.key() : path + "." + it.key();
      if (!b.contains(it.key())) out->push_back(p);
      else config_diff(it.value(), b[it.key()], p, out);
    }
    for (auto it = b.begin(); it != b.end(); ++it) {
      if (!a.contains(it.key())) out->push_back(path.empty() ? it.key() : path + "." + it.key());
    }
  } else if (a != b) {
    out->push_back(path);
  }
}

const char* torch_dtype_name(DType dtype) {
  return dtype == DType::kBF16 ? "bfloat16" : dtype == DType::kF16 ? "float16" : "float32";
}

}  // namespace

std::string Trainer::Impl::model_config_json() const {
  return to_hf_config_json(model, torch_dtype_name(compute_dtype));
}

std::string Trainer::Impl::model_source() const {
  return model_dir ? fs::absolute(opt.model).lexically_normal().string() : opt.model;
}

// The counters, loss scale and data position of the checkpoint; what differs from it is said.
Status Trainer::Impl::resume_from_checkpoint() {
  const TrainingState& st = resume->state;
  ZO_RETURN_IF_ERROR(scaler->restore(st.loss_scaler).with_context("resuming from " + resume->path));
  ZO_RETURN_IF_ERROR(data->set_position(st.data_position).with_context("resuming from " + resume->path));
  steps_done = st.steps_done;
  optimizer_steps = st.optimizer_steps;
  resumed_from = resume->path;
  last_saved_step = st.steps_done;
  std::vector<std::string> diff;
  config_diff(st.config, to_json(opt.config), "", &diff);
  if (!diff.empty()) {
    std::vector<std::string> shown(diff.begin(), diff.begin() + std::min<size_t>(diff.size(), 8));
    ZO_LOG(kWarn) << "resuming from " << resume->path
                  << " with a config that differs from the one it was saved with at " << join(shown, ", ")
                  << (diff.size() > shown.size() ? ", ..." : "") << ": training continues with the new values";
  }
  if (st.data != fs::absolute(opt.data_path).lexically_normal().string() || st.seq_len != data->options().seq_len) {
    ZO_LOG(kWarn) << "resuming from " << resume->path << ", saved while reading " << st.data << " with --seq-len "
                  << st.seq_len << ", now " << opt.data_path << " with " << data->options().seq_len
                  << ": the data position (epoch " << st.data_position.epoch << ", batch " << st.data_position.index
                  << ") is applied to the new data";
  }
  const std::string saved = resume->model_config_json;
  if (saved != model_config_json()) {
    auto saved_model = parse_hf_config(saved, resume->path + "/config.json");  // parsed by find_resume
    if (saved_model.is_ok() && to_hf_config_json(*saved_model, "") != to_hf_config_json(model, "")) {
      ZO_LOG(kWarn) << "resuming from " << resume->path << ": its config.json differs from " << opt.model
                    << "'s beyond the tensor shapes (norm eps, rope, ...): training continues with " << opt.model
                    << "'s";
    }
  }
  resume.reset();
  return Status::ok();
}

// Weights stream chunk by chunk into their home tiers: the model is never whole in RAM.
Status Trainer::Impl::init_weights() {
  ParamSink sink = [this](uint32_t param, uint64_t offset_elems, std::span<const float> values) {
    return store->init_param(param, offset_elems, values);
  };
  if (!model_dir) return random_init_weights(model, layout, opt.seed, kInitChunkElems, sink);  // adapters too
  ZO_RETURN_IF_ERROR(load_hf_weights(opt.model, layout, kInitChunkElems, sink, env()));
  if (model.lora.r == 0) return Status::ok();
  const std::string& from = opt.config.zoffload.lora.init_from;
  if (from.empty()) return init_lora_adapters(layout, opt.seed, kInitChunkElems, sink);
  const AdapterLimits limits{.scaling = model.lora.scaling(), .max_value = dtype_max_value(compute_dtype)};
  return load_peft_adapters(from, layout, kInitChunkElems, sink, env(), limits).with_context("zoffload.lora.init_from");
}

Trainer::Trainer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Trainer::~Trainer() = default;

Result<std::shared_ptr<io::File>> lock_run_dir(const std::string& out_dir_or_empty, io::Env* env,
                                               std::string* created_top) {
  const std::string out_dir = out_dir_or_empty.empty() ? "." : out_dir_or_empty;
  return lock_dir(out_dir, "run directory", "give this one another --out", env, created_top);
}

Status remove_if_only_locks(const std::string& dir, io::Env* env) {
  ZO_ASSIGN_OR_RETURN(const io::PathKind kind, env->path_kind(dir));
  if (kind != io::PathKind::kDirectory) return Status::ok();
  // Whether the tree under `d` holds only directories and lock files.
  std::function<Result<bool>(const std::string&)> only_locks = [&](const std::string& d) -> Result<bool> {
    ZO_ASSIGN_OR_RETURN(const std::vector<std::string> names, env->list_dir(d));
    for (const std::string& name : names) {
      ZO_ASSIGN_OR_RETURN(const io::PathKind k, env->path_kind(d + "/" + name));
      if (k == io::PathKind::kDirectory) {
        ZO_ASSIGN_OR_RETURN(const bool only, only_locks(d + "/" + name));
        if (!only) return false;
      } else if (name != ".zoffload.lock" || k != io::PathKind::kFile) {
        return false;
      }
    }
    return true;
  };
  ZO_ASSIGN_OR_RETURN(const bool only, only_locks(dir));
  return only ? env->remove_all(dir) : Status::ok();
}

Status Trainer::Impl::lock_output_dir(const std::string& dir, const std::string& what, bool inside_out_too) {
  // --out's own lock covers it (a second lock of the same file by this process would conflict).
  const std::string canonical = canonical_dir(env(), dir);
  const std::string out = canonical_dir(env(), opt.out_dir);
  if (canonical == out) return Status::ok();
  if (!inside_out_too && canonical.starts_with(out + "/")) return Status::ok();
  for (const auto& held : output_locks)
    if (canonical_dir(env(), fs::path(held->path()).parent_path().string()) == canonical) return Status::ok();
  std::string created;
  ZO_ASSIGN_OR_RETURN(std::shared_ptr<io::File> lock,
                      lock_dir(dir, what, "give this run another " + what + " (or another --out)", env(), &created));
  output_locks.push_back(std::move(lock));
  if (!created.empty()) created_dirs.push_back(created);
  return Status::ok();
}

// Note [Run ids]
// Each run has an id (16 hex digits, random at a fresh start, kept by a resumed run), written into
// its checkpoints' trainer_state.json with its --out, and into OUT/.zoffload.run_id once the run has
// started. Two runs that share a checkpoint directory one after the other (the lock above stops
// them at the same time) leave `latest` naming the last one's step: `--resume latest` from the
// other's --out would silently load its weights, moments and data position. So a resume that found
// its checkpoint through `latest` refuses one whose run id is not the id in --out; naming the step
// directory itself is the way to continue another run's checkpoint on purpose. Checkpoints and run
// directories from before run ids have none and are accepted.
Status Trainer::Impl::read_run_id() {
  const std::string path = resolve_run_path(opt.out_dir, kRunIdFile);
  ZO_ASSIGN_OR_RETURN(const io::PathKind kind, env()->path_kind(path));
  if (kind != io::PathKind::kMissing) {
    ZO_ASSIGN_OR_RETURN(std::string text, env()->read_file(path, "the run id file", 64));
    while (!text.empty() && (text.back() == '\n' || text.back() == ' ')) text.pop_back();
    out_run_id = text;
  }
  return Status::ok();
}

Status Trainer::Impl::write_run_id() {
  if (rank() != 0 || run_id == out_run_id) return Status::ok();
  return env()->publish_file(resolve_run_path(opt.out_dir, kRunIdFile), run_id + "\n", "the run id file");
}

Result<std::unique_ptr<Trainer>> Trainer::create(const TrainOptions& options) {
  auto impl = std::make_unique<Impl>();
  if (Status st = impl->init(options); !st.is_ok()) {
    // A run that never started leaves no output directory it created holding only its locks.
    std::vector<std::string> created = std::move(impl->created_dirs);
    impl.reset();  // closes the locks (the caller may still hold a run directory's it passed in)
    for (const std::string& dir : created) (void)remove_if_only_locks(dir, io::Env::posix());
    return st;
  }
  return std::unique_ptr<Trainer>(new Trainer(std::move(impl)));
}

Result<StepMetrics> Trainer::step() {
  // Named before it runs: a failure after the update (recording it) is still this step's.
  const std::string name = "step " + std::to_string(impl_->steps_done + 1);
  trace::Span span(trace::Track::kStep, [&] { return name; });
  Result<StepMetrics> r = impl_->step_once();
  if (!r.is_ok()) return Status(r.status()).with_context(name);
  return r;
}

uint64_t Trainer::steps_done() const { return impl_->steps_done; }
std::string Trainer::plan_summary() const { return impl_->run_plan.summary(); }
std::string Trainer::plan_json() const { return impl_->run_plan.to_json(); }
const ModelConfig& Trainer::model_config() const { return impl_->model; }
const ModelLayout& Trainer::layout() const { return impl_->layout; }
uint64_t Trainer::num_parameters() const { return impl_->registry->total_elems(); }
std::string Trainer::metrics_path() const { return impl_->metrics_path; }
std::string Trainer::swap_dir() const { return impl_->swap_dir; }

Status Trainer::read_master(uint32_t param, std::span<float> out) {
  const ParamRegistry& reg = *impl_->registry;
  if (param >= reg.params().size()) return invalid_argument("read_master: no param " + std::to_string(param));
  const ParamInfo& info = reg.params()[param];
  if (out.size() != info.n_elems)
    return invalid_argument("read_master: " + info.name + " has " + std::to_string(info.n_elems) + " elements, not " +
                            std::to_string(out.size()));
  return impl_->store->read_param_value(param, 0, out);
}

const std::string& Trainer::checkpoint_dir() const { return impl_->checkpoint_dir; }
const std::string& Trainer::resumed_from() const { return impl_->resumed_from; }

bool Trainer::checkpoint_due(bool end_of_run) const {
  const Impl& m = *impl_;
  if (m.checkpoint_dir.empty() || m.last_saved_step == m.steps_done) return false;
  if (end_of_run) return true;
  const uint64_t every = m.opt.config.zoffload.checkpoint.every_steps;
  return every > 0 && m.steps_done % every == 0;
}

TrainingState Trainer::training_state() const {
  const Impl& m = *impl_;
  TrainingState st;
  st.steps_done = m.steps_done;
  st.optimizer_steps = m.optimizer_steps;
  st.loss_scaler = m.scaler->state();
  // A batch already read for the next step's forward (Note [Overlapped optimizer]) is read again
  // by a run resumed from here.
  st.data_position = m.ahead ? m.ahead->micro.front().position : m.data->position();
  st.seed = m.data->options().seed;
  st.model = m.model_source();
  st.data = fs::absolute(m.opt.data_path).lexically_normal().string();
  st.seq_len = m.data->options().seq_len;
  st.world_size = m.world_size();
  st.config = to_json(m.opt.config);
  st.run_id = m.run_id;
  st.out = fs::absolute(m.opt.out_dir.empty() ? "." : m.opt.out_dir).lexically_normal().string();
  return st;
}

Result<SaveResult> Trainer::save_checkpoint(const std::function<void(uint64_t, uint64_t)>& progress) {
  Impl& m = *impl_;
  trace::Span span(trace::Track::kCheckpoint, [&] { return "save step-" + std::to_string(m.steps_done); });
  if (m.checkpoint_dir.empty())
    return failed_precondition("no checkpoint directory: set zoffload.checkpoint.dir in the config");
  const CheckpointConfig& cc = m.opt.config.zoffload.checkpoint;
  SaveOptions o;
  o.dir = m.checkpoint_dir;
  o.keep_last = cc.keep_last;
  o.staging_bytes = cc.staging_buffer_size;
  o.progress = progress;
  o.env = m.env();
  if (m.opt.group == nullptr) {
    ZO_ASSIGN_OR_RETURN(SaveResult r, engine::save_checkpoint(*m.store, training_state(), m.model_config_json(), o));
    m.last_saved_step = m.steps_done;
    return r;
  }
  if (m.plan.partitioned()) {
    // Note [Partitioned data parallel]: each rank writes its partition (Note [Collaborative save]).
    dist::ProcessGroup* group = m.opt.group;
    o.collective =
        SaveOptions::Collective{.rank = m.rank(),
                                .world_size = m.world_size(),
                                .broadcast = [group](void* data, uint64_t n, uint32_t root, const std::string& what) {
                                  return group->broadcast(data, n, root, what);
                                }};
    Result<SaveResult> r = engine::save_checkpoint(*m.store, training_state(), m.model_config_json(), o);
    if (r.is_ok()) m.last_saved_step = m.steps_done;
    return r;
  }
  // Note [Replicated data parallel]: every rank holds the same states; rank 0 writes them while the
  // others wait, so that no rank runs ahead into the next step's collectives during a long save.
  Result<SaveResult> r = SaveResult{};
  if (m.rank() == 0) r = engine::save_checkpoint(*m.store, training_state(), m.model_config_json(), o);
  {
    trace::Span wait(trace::Track::kCollective, "wait for rank 0's checkpoint");
    ZO_RETURN_IF_ERROR(m.opt.group->barrier("waiting for rank 0 to save step-" + std::to_string(m.steps_done)));
  }
  if (r.is_ok()) m.last_saved_step = m.steps_done;
  return r;
}

Result<ExportResult> Trainer::export_model(const ExportOptions& options) {
  Impl& m = *impl_;
  ExportOptions o = options;
  o.env = m.env();  // the run's own: io_faults reach the export too
  const std::string config_json = to_hf_config_json(m.model, torch_dtype_name(options.dtype));
  if (m.model.lora.r > 0) {  // Note [Exporting LoRA adapters]
    o.lora.emplace();
    o.lora->merged = options.lora && options.lora->merged;
    o.lora->scaling = m.model.lora.scaling();
    o.lora->adapter_config_json = peft_adapter_config_json(m.model.lora, m.model_source());
  }
  if (!m.plan.partition_params) return export_store(*m.store, config_json, *m.io, o);
  dist::ProcessGroup* group = m.opt.group;
  const ExportCollective ranks{
      .rank = m.rank(),
      .world_size = m.world_size(),
      .broadcast = [group](void* data, uint64_t n, uint32_t root,
                           const std::string& what) { return group->broadcast(data, n, root, what); },
      .first_failed_rank = [group](bool failed,
                                   const std::string& what) { return dist::first_failed_rank(*group, failed, what); }};
  return export_gathered(*m.store, config_json, *m.io, ranks, o);
}

bool Trainer::export_needs_every_rank() const { return impl_->plan.partition_params; }

DType Trainer::export_dtype() const {
  const Config& c = impl_->opt.config;
  // LoRA adapters are small and kept in fp32, as PEFT keeps them; a rank holding its partition of
  // the compute copies only exports in the compute dtype.
  if (impl_->model.lora.r > 0 && !impl_->plan.partition_params) return DType::kF32;
  return c.bf16.enabled ? DType::kBF16 : c.fp16.enabled ? DType::kF16 : DType::kF32;
}

std::string Trainer::describe() const {
  const Impl& m = *impl_;
  const Placement& pl = m.plan.placement;
  uint64_t compute_nvme = 0, compute_cpu = 0;
  for (Tier t : pl.compute) {
    if (t == Tier::kNvme) ++compute_nvme;
    else if (t == Tier::kCpu) ++compute_cpu;
  }
  std::ostringstream s;
  s << "model " << m.opt.model << " (" << m.model.num_hidden_layers << " layers, hidden " << m.model.hidden_size << ", "
    << format_count(m.registry->total_elems()) << " params"
    << (m.registry->trainable_elems() != m.registry->total_elems()
            ? ", " + format_count(m.registry->trainable_elems()) + " trainable (" +
                  (m.model.lora.r > 0 ? "zoffload.lora: LoRA r=" + std::to_string(m.model.lora.r) : "zoffload.freeze") +
                  ")"
            : "")
    << ") | " << dtype_name(m.compute_dtype) << " compute, " << dtype_name(pl.grad_dtype) << " gradients"
    << (pl.grads_rounded() ? " (" + std::string(dtype_name(pl.grad_sum_dtype)) + " sums, norm before rounding)" : "")
    << " | ZeRO stage " << m.opt.config.zero.stage << ", " << m.registry->sub_groups().size() << " sub-groups";
  if (m.plan.partitioned())
    s << " (this rank steps " << m.plan.owned_begin << "-" << m.plan.owned_end - 1 << ": partition " << m.rank()
      << " of " << m.world_size()
      << (m.plan.partition_params ? "; it holds their compute copies only, each block gathered from its owners at fetch"
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
    << " cpu, " << compute_nvme << " nvme | device " << m.device->name() << ", budget "
    << format_bytes(m.device->stats().budget_bytes) << " | pinned pool "
    << format_bytes(m.store->pool().capacity_bytes());
  const ArenaPlan& ap = m.run_plan.arena;
  if (ap.largest_param_elems > 0) {  // some params are fetched
    s << " | prefetch ";
    if (ap.prefetch_bucket_elems == 0) s << "off (stage3_prefetch_bucket_size 0)";
    else if (ap.prefetch_by_blocks) s << prefetch_by_blocks_text(ap, m.opt.config.zero.stage3_prefetch_bucket_size);
    else s << format_count(ap.prefetch_bucket_elems) << " elements ahead";
  }
  if (const uint64_t held = vertical_micro_batches(m.opt.config); held > 1)
    s << " | vertical schedule: " << held << " micro-batches per block visit";
  return s.str();
}

}  // namespace zo::engine

// The trainer: the one place where the model (LibTorch), the tiers and the optimizer meet.
#include "engine/train/trainer.h"

#include <torch/torch.h>

#include <malloc.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cmath>
#include <condition_variable>
#include <filesystem>
#include <limits>
#include <mutex>
#include <optional>
#include <sstream>
#include <system_error>
#include <thread>

#include <nlohmann/json.hpp>

#include "common/aligned_buffer.h"
#include "common/bytes.h"
#include "common/host_info.h"
#include "common/log.h"
#include "common/string_util.h"
#include "common/trace.h"
#include "cpu_optim/executor.h"
#include "cpu_optim/vector_ops.h"
#include "engine/config/io_settings.h"
#include "engine/coord/grad_accumulator.h"
#include "engine/coord/grad_worker.h"
#include "engine/coord/param_coordinator.h"
#include "engine/coord/update_gate.h"
#include "engine/dist/process_group.h"
#include "engine/memory/optimizer_swapper.h"
#include "engine/memory/param_registry.h"
#include "engine/memory/param_swapper.h"
#include "engine/memory/state_store.h"
#include "engine/model/llama.h"
#include "engine/model/torch_runtime.h"
#include "engine/model/weights.h"
#include "engine/monitor/monitor.h"
#include "engine/optim/grad_clip.h"
#include "engine/optim/loss_scaler.h"
#include "engine/optim/lr_schedule.h"
#include "engine/plan/planner.h"
#include "io/env.h"
#include "gpu/device.h"
#include "gpu/device_info.h"
#include "io/io_engine.h"

namespace zo::engine {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

// Data parallel: gradients and parameters cross between ranks in chunks of this many elements
// (Note [Replicated data parallel]).
constexpr uint64_t kReduceChunkElems = uint64_t{1} << 22;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

constexpr uint64_t kInitChunkElems = uint64_t{1} << 22;  // 16 MiB of fp32 per chunk while loading

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

std::string StepMetrics::to_json() const {
  nlohmann::json j;
  j["step"] = step;
  j["loss"] = loss;
  j["lr"] = lr;
  j["loss_scale"] = loss_scale;
  j["grad_norm"] = std::isfinite(grad_norm) ? nlohmann::json(grad_norm) : nlohmann::json(nullptr);
  j["skipped"] = skipped;
  j["tokens"] = tokens;
  j["step_s"] = step_s;
  j["tokens_per_s"] = step_s > 0 ? static_cast<double>(tokens) / step_s : 0.0;
  j["time_s"] = {{"data", data_s},
                 {"fetch", fetch_s},
                 {"compute", compute_s},
                 {"grad_offload", grad_offload_s},
                 {"optimizer_wait", optimizer_wait_s},
                 {"grad_worker", grad_worker_s},
                 {"optimizer", optimizer_s},
                 {"nvme_read_wait", nvme_read_wait_s},
                 {"nvme_write_wait", nvme_write_wait_s},
                 {"nvme_busy", nvme_busy_s},
                 {"device_h2d", device_h2d_s},
                 {"device_d2h", device_d2h_s},
                 {"device_compute", device_compute_s}};
  j["device_busy"] = device_busy;
  j["overlap"] = overlap;
  j["memory"] = nlohmann::json::parse(memory.to_json());
  j["device_peak_bytes"] = device_peak_bytes;
  j["device_budget_bytes"] = device_budget_bytes;
  j["device_arena_bytes"] = device_arena_bytes;
  j["torch_peak_bytes"] = torch_peak_bytes;
  j["collective_bytes"] = collective_bytes;
  j["time_s"]["collective"] = collective_s;
  j["time_s"]["rank_wait"] = rank_wait_s;
  j["time_s"]["gather"] = gather_s;
  j["time_s"]["grad_reduce"] = grad_reduce_s;
  return j.dump();
}

namespace detail {
class ReadyGroups;
}  // namespace detail

struct Trainer::Impl {
  TrainOptions opt;
  ModelConfig model;
  bool model_dir = false;  // --model is a Hugging Face model directory (else a preset or TrainOptions::model_config)
  ModelLayout layout;
  std::optional<ParamRegistry> registry;
  MemoryPlan plan;
  RunPlan run_plan;  // the planner's view, checked at start (Trainer::plan_summary)
  uint64_t seq_len = 0;
  DType compute_dtype = DType::kF32;
  torch::Device torch_device = torch::kCPU;
  gpu::GpuProbe probe;  // the GPUs LibTorch can use (not probed for zoffload.device "host")

  // Declared before what uses them, so they are destroyed after it.
  MemoryAccounting accounting;
  std::unique_ptr<gpu::Device> device;
  std::unique_ptr<io::IoEngine> io;
  // The file operations of checkpoints and exports: POSIX, or faulty under TrainOptions::io_faults.
  std::unique_ptr<io::FaultyEnv> faulty_env;
  io::Env* env() const { return faulty_env ? faulty_env.get() : io::Env::posix(); }
  std::unique_ptr<cpu_optim::Executor> executor;
  std::unique_ptr<StateStore> store;
  std::unique_ptr<OptimizerSwapper> optimizer;
  std::unique_ptr<ParamSwapper> param_swapper;
  std::unique_ptr<UpdateGate> gate;  // the optimizer's progress, for the forward that overlaps it
  // MemoryPlan::partition_params: the blocks' compute copies come from their owners, gathered on a
  // thread over a process group of its own (Note [Gathered parameters] in block_gatherer.cpp).
  std::unique_ptr<dist::ProcessGroup> param_group;
  std::unique_ptr<BlockGatherer> gatherer;
  std::unique_ptr<ParamCoordinator> coord;
  std::unique_ptr<GradAccumulator> grads;
  std::unique_ptr<GradWorker> grad_worker;  // feeds `grads` behind backward; destroyed before it
  std::optional<LossScaler> scaler;
  std::optional<LrSchedule> schedule;
  std::unique_ptr<Dataset> data;
  RopeTables rope;
  Batch batch;

  uint64_t steps_done = 0;       // optimizer steps attempted (skipped ones too)
  uint64_t optimizer_steps = 0;  // optimizer steps taken (Adam's step count, the lr index)
  std::string checkpoint_dir;    // resolved zoffload.checkpoint.dir; empty: none
  std::optional<CheckpointInfo> resume;
  std::string resumed_from;
  std::optional<uint64_t> last_saved_step;  // the step of the checkpoint saved or resumed from
  std::string model_config_json() const;
  Status resume_from_checkpoint();
  std::string metrics_path;
  std::string swap_dir;
  std::unique_ptr<io::AppendFile> metrics;
  // DeepSpeed's monitors (tensorboard, csv_monitor); null when not enabled.
  std::unique_ptr<monitor::TensorBoardMonitor> tensorboard;
  std::unique_ptr<monitor::CsvMonitor> csv_monitor;

  // One micro-batch run forward up to the head: its activation checkpoints and labels.
  struct Micro {
    std::vector<torch::Tensor> inputs;  // each block's input; inputs[0] the token ids
    torch::Tensor targets;
    uint64_t tokens = 0;
    DataPosition position;  // where its batch was read from
  };
  // The forward of the micro-batches one backward takes: one with the horizontal schedule, all of
  // a step's with the vertical one (Note [Vertical schedule]).
  struct Forward {
    std::vector<Micro> micro;
    double data_s = 0;
  };
  // Note [Overlapped optimizer]: the next step's first forward, run by step() while its optimizer
  // ran, or that forward's failure (returned by the next step()).
  std::optional<Forward> ahead;
  Status ahead_error;
  std::thread update_thread;  // the optimizer step in flight, joined before step() returns

  ~Impl() {
    if (update_thread.joinable()) update_thread.join();
    // Gradient copies of a failed step may still be landing in the pool's ring.
    if (landed) (void)device->synchronize(landed);
    grad_worker.reset();  // it may still wait on `landed`
    if (released) device->destroy_event(released);
    if (landed) device->destroy_event(landed);
    if (copies_after) device->destroy_event(copies_after);
    if (ckpt_host != nullptr) {
      if (ckpt_copied) (void)device->synchronize(ckpt_copied);  // copies of a failed step may be in flight
      device->free_pinned(ckpt_host);
    }
    if (ckpt_copied) device->destroy_event(ckpt_copied);
    for (gpu::Event e : ckpt_back)
      if (e) device->destroy_event(e);
  }

  // init and its steps, in the order it runs them (Note [Trainer construction]).
  Status init(const TrainOptions& options);
  Status resolve_model();         // model config, size checks, layout, sequence length
  Status prepare_run_dir();       // run directory, metrics path, stale checkpoints removed
  Status find_resume();           // the checkpoint --resume names, opened and checked
  Status open_device();           // parameter registry, device and its budget
  Status plan_memory();           // the planner: this run's needs against this machine
  Status create_states();         // I/O engine, executor, state store; weights loaded or resumed
  Status create_step_pipeline();  // optimizer, coordinator, events, host checkpoints, gradient path
  Status create_schedules();      // loss scaler and learning-rate schedule
  Status open_data();             // dataset and RoPE tables
  Status open_metrics();          // metrics.jsonl, appended to when resuming
  // Where a DeepSpeed monitor writes: output_path/job_name, relative to the run directory.
  std::string monitor_dir(const MonitorConfig& mc) const;
  Status init_weights();
  // The block's compute copies as tensors; leaves that collect gradients when `grad`.
  std::vector<torch::Tensor> wrap(uint32_t block, const std::vector<gpu::DevicePtr>& ptrs, bool grad) const;
  // Block b's addresses for LibTorch's stream, which waits on the device for their copies.
  Result<std::vector<gpu::DevicePtr>> acquire(uint32_t block);
  double ready_wait_s = 0;  // host time acquire() spent waiting for copies (HostDevice computes on the host)
  // Releases a block with an event after every kernel LibTorch has queued that reads it: on CUDA
  // LibTorch queues its kernels asynchronously, and the coordinator refills the freed arena space
  // only behind that event (no host sync).
  Status release(uint32_t block);
  gpu::Event released;     // re-recorded by every release()
  gpu::Event copies_after;  // re-recorded on the compute stream by begin_copies
  gpu::Event landed;       // re-recorded behind every gradient copy, waited on by the gradient worker
  // Note [Checkpoints on the CPU]: run_plan.checkpoints_on_host puts each decoder layer's input
  // in `ckpt_host` (pinned; one slot per held micro-batch and layer) between forward and backward.
  void* ckpt_host = nullptr;
  uint64_t ckpt_slot_bytes = 0;  // one micro-batch's input of one layer
  gpu::Event ckpt_back[2];       // on the copy stream, behind the copies back of layer b (b % 2)
  gpu::Event ckpt_copied;        // on the copy stream, behind the latest checkpoint copy either way
  // The host slot of block b's input (1 ≤ b ≤ num_hidden_layers) of held micro-batch k.
  torch::Tensor checkpoint_slot(uint32_t block, size_t k, const torch::Tensor& like) const;
  uint64_t checkpoint_bytes(uint32_t block, const Forward& f) const;
  Result<void*> compute_stream();
  Status compute_call(const std::string& what, const std::function<void()>& fn);
  // Copies block b's inputs (every micro-batch of f) to their slots and drops the device copies.
  Status checkpoints_out(uint32_t block, Forward& f);
  // Queues block b's inputs back to the device; wait_checkpoints makes LibTorch's stream wait.
  Status checkpoints_back(uint32_t block, Forward& f);
  Status wait_checkpoints(uint32_t block);
  // Makes LibTorch's copy stream current in *copies, ordered after the kernels queued so far on the
  // compute stream (copies_after, recorded there and waited for by the copy stream at once).
  Status begin_copies(std::optional<TorchCopyStreamScope>* copies, const std::string& where);
  bool host_checkpoint(uint32_t block) const {
    return ckpt_host != nullptr && block >= 1 && block + 1 < layout.blocks.size();
  }
  // Hands a block's gradients (one per param, in block order) to the accumulator.
  Status offload_grads(uint32_t block, const std::vector<torch::Tensor>& grads, bool inject_overflow);
  // Moves the gradients the last backward left in `params` into `sums` (the first micro-batch's are
  // copied, in grad_accum_dtype; later ones added), leaving the params without gradients.
  void fold_grads(std::vector<torch::Tensor>& params, std::vector<torch::Tensor>& sums, bool first) const;
  struct MicroResult {
    double loss = 0;
    double grad_offload_s = 0;  // gradients off the device and into the accumulators
    GradNormReport grads;
  };
  // Reads the next `count` batches and runs them forward through blocks 0..n-2, block by block
  // (begins the coordinator's micro-step: each block is fetched once for all of them).
  Result<Forward> forward(uint64_t count);
  // The rest: the head's forward and loss, then backward block by block, each block's gradients
  // (summed over f's micro-batches) handed to the accumulators. `loss` is the sum over them.
  Result<MicroResult> finish_micro_step(Forward& f, bool first, bool last, bool inject_overflow);
  // Trainer::step without the step number in its errors.
  Result<StepMetrics> step_once();

  // Note [Replicated data parallel]
  uint32_t rank() const { return opt.group != nullptr ? opt.group->rank() : 0; }
  uint32_t world_size() const { return opt.group != nullptr ? opt.group->world_size() : 1; }
  // Sums every rank's gradient accumulators, sub-group by sub-group: into each rank's (replicated)
  // or into the owner's (partitioned: Note [Partitioned data parallel]), and returns the norm report
  // of the sums (the loss scale still in them), the same on every rank.
  Result<GradNormReport> reduce_gradients();
  // Partitioned: every chunk's squared norm, filled by its owner (0 elsewhere), all-reduced and
  // added up in chunk order on every rank (Note [Partitioned data parallel]).
  Result<GradNormReport> owners_norm(std::vector<double> chunk_sq);
  // Sums n gradients (grad_accum_dtype) at data over the ranks: to `owner` (reduce) or, without
  // one, to every rank (all-reduce), in collectives of at most zero_optimization.reduce_bucket_size
  // elements (element-wise sums: the bucket never changes the result).
  Status reduce_in_buckets(void* data, uint64_t n, std::optional<uint32_t> owner, const std::string& what);
  std::optional<AlignedBuffer> reduce_staging;  // for accumulators not in host memory
  // Partitioned, on a thread beside the optimizer step (Note [Gather beside the step]): each
  // sub-group's new compute copy goes from its owner, once `ready` says it is written, to the
  // other ranks, which `publish` it (may be empty); with partitioned params (stage 3) nothing is
  // sent and the other ranks' sub-groups are published at once. Then the step's outcome is exchanged.
  Status gather_compute(detail::ReadyGroups& ready, const std::function<void(uint32_t)>& publish);
  std::optional<AlignedBuffer> gather_staging;  // for compute copies not in host memory
  double gather_s = 0;  // the last gather_compute's time in collectives
  // The optimizer step, then (partitioned) the all-gather of the updated compute copies.
  Result<OptimizerStepReport> update(const OptimizerStepArgs& args, const std::function<void(uint32_t)>& publish);
  // Trainer::export_model with partitioned params, on every rank (Note [Exporting gathered parameters]).
  Result<ExportResult> export_gathered(const ExportOptions& options);
};

// Note [Trainer construction]: init runs the steps below in order; each one needs only what the
// steps before it built. Nothing large is allocated before plan_memory has checked the run against
// this machine, and nothing of the step loop exists before the states do.
Status Trainer::Impl::init(const TrainOptions& options) {
  opt = options;
  if (opt.group != nullptr) {
    const Config& c = opt.config;
    const uint64_t product = c.train_micro_batch_size_per_gpu * c.gradient_accumulation_steps * world_size();
    if (c.train_batch_size != product)
      return invalid_argument("train_batch_size " + std::to_string(c.train_batch_size) + " is not train_micro_batch_size_per_gpu × "
                              "gradient_accumulation_steps × world size (" + std::to_string(c.train_micro_batch_size_per_gpu) +
                              " × " + std::to_string(c.gradient_accumulation_steps) + " × " + std::to_string(world_size()) + ")");
  }
  if (opt.io_faults) faulty_env = std::make_unique<io::FaultyEnv>(io::Env::posix(), opt.io_faults);
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
  }
  ZO_RETURN_IF_ERROR(check_model_size(model));
  layout = model_layout(model);
  compute_dtype = opt.config.compute_dtype();
  seq_len = opt.seq_len != 0 ? opt.seq_len : std::min<uint64_t>(256, model.max_position_embeddings);
  if (seq_len > model.max_position_embeddings)
    return invalid_argument("--seq-len " + std::to_string(seq_len) + " exceeds the model's max_position_embeddings (" +
                            std::to_string(model.max_position_embeddings) + ")");
  return Status::ok();
}

Status Trainer::Impl::prepare_run_dir() {
  // Note [One run per run directory]: two runs on one --out would append to one metrics file, tidy
  // away each other's checkpoint saves in progress and mix their checkpoints. Rank 0 locks the
  // directory before anything in it is touched (the other ranks write nothing there before they
  // have connected to it); the lock file stays, so that no two processes can lock two files.
  if (rank() == 0 && !opt.run_dir_lock) {
    ZO_ASSIGN_OR_RETURN(opt.run_dir_lock, lock_run_dir(opt.out_dir, env()));
  } else if (!opt.out_dir.empty()) {
    ZO_RETURN_IF_ERROR(env()->make_dirs(opt.out_dir).with_context("creating the run directory " + opt.out_dir));
  }
  const Config& config = opt.config;
  metrics_path = resolve_run_path(opt.out_dir, config.zoffload.log.metrics_path.empty() ? "metrics.jsonl"
                                                                                     : config.zoffload.log.metrics_path);
  // Note [Output files] (io/env.h): the files this run writes are checked now, not after a step.
  if (rank() == 0) {
    ZO_RETURN_IF_ERROR(env()->check_output_file(metrics_path, "the metrics file (zoffload.log.metrics_path)"));
    if (config.csv_monitor.enabled) {
      ZO_RETURN_IF_ERROR(monitor::CsvMonitor::check_files(env(), monitor_dir(config.csv_monitor),
                                                          monitor::scalars_of_metrics_record(StepMetrics{}.to_json())));
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
      return invalid_argument("--resume latest: the config sets no zoffload.checkpoint.dir to look in; give the "
                              "checkpoint's path instead");
    where = checkpoint_dir;
  }
  auto path = resolve_checkpoint(where);
  // A --resume that names no checkpoint is bad input, like a bad --model.
  if (!path.is_ok() && path.status().code() == StatusCode::kNotFound)
    return invalid_argument("--resume: " + path.status().message());
  if (!path.is_ok()) return path.status();
  ZO_ASSIGN_OR_RETURN(CheckpointInfo info, open_checkpoint(*path));
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
    const std::string shared =
        local_ranks > 1 ? " (each of this node's " + std::to_string(local_ranks) + " ranks is planned with 1/" +
                              std::to_string(local_ranks) + " of its RAM and disk space)"
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
  ZO_ASSIGN_OR_RETURN(executor, cpu_optim::Executor::create({.n_threads = static_cast<int>(config.zoffload.optimizer_threads),
                                                             .bind_cores = config.zoffload.bind_cores}));
  StateStoreOptions so;
  so.optimizer_nvme_path = resolve_run_path(opt.out_dir, config.zero.offload_optimizer.nvme_path);
  so.param_nvme_path = resolve_run_path(opt.out_dir, config.zero.offload_param.nvme_path);
  so.pinned_cap_bytes = config.zoffload.pinned_memory_limit;
  so.rank = rank();
  so.on_swap_file = opt.on_swap_file;
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
  return load_checkpoint(*resume, *store, *io, staging.bytes());
}

Status Trainer::Impl::create_step_pipeline() {
  const Config& config = opt.config;
  ZO_ASSIGN_OR_RETURN(optimizer, OptimizerSwapper::create(*store, *executor, PipelineOptions::from_config(config)));
  if (store->param_file() != nullptr && !plan.partition_params) {  // gathered ones are read by the gatherer
    ZO_ASSIGN_OR_RETURN(param_swapper, ParamSwapper::create(*store));
  }
  std::vector<std::vector<uint32_t>> blocks;
  std::vector<std::string> names;
  std::vector<uint32_t> contribution_order;  // backward: head, decoders n-2..1, embedding
  for (const BlockSpec& b : layout.blocks) {
    blocks.push_back(b.params);
    names.push_back(b.name);
  }
  for (size_t b = layout.blocks.size(); b-- > 0;)
    for (uint32_t p : layout.blocks[b].params) contribution_order.push_back(p);
  gate = std::make_unique<UpdateGate>(store->plan().n_sub_groups);
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
  if (run_plan.checkpoints_on_host) {
    ckpt_slot_bytes = host_checkpoint_bytes_per_micro_batch(config, model, seq_len) / model.num_hidden_layers;
    ZO_ASSIGN_OR_RETURN(ckpt_host, device->allocate_pinned(run_plan.checkpoint_host_bytes));
    ZO_ASSIGN_OR_RETURN(ckpt_copied, device->create_event());
    for (gpu::Event& e : ckpt_back) {
      ZO_ASSIGN_OR_RETURN(e, device->create_event());
    }
  }
  coord->set_update_gate(gate.get());
  ReducerOptions reducer;
  if (plan.partition_grads) {
    // Note [Partitioned gradients] (grad_accumulator.h): on the gradient worker's thread, as
    // backward produces them; the training thread issues no collective until the worker is drained.
    reducer.chunk_elems = kReduceChunkElems;
    reducer.reduce = [this](uint32_t g, std::byte* data, uint64_t n) {
      return reduce_in_buckets(data, n, registry->partition_of_group(g), "reducing the gradients of sub-group " + std::to_string(g));
    };
  }
  ZO_ASSIGN_OR_RETURN(grads, GradAccumulator::create(*store, std::move(contribution_order), *executor, std::move(reducer)));
  // The landing ring comes from the pool: pinned, so that gradients leave the GPU by DMA.
  ZO_ASSIGN_OR_RETURN(std::span<std::byte> ring, store->pool().allocate(plan.grad_ring_bytes, "the gradient landing ring"));
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
  d.rank = rank();
  d.world_size = world_size();
  ZO_ASSIGN_OR_RETURN(data, Dataset::open(d));
  return torch_call("building the RoPE tables", [&] {
    rope = make_rope_tables(model, static_cast<int64_t>(d.seq_len), torch_device);
  });
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
    ZO_ASSIGN_OR_RETURN(metrics, env()->open_fresh_append(metrics_path, "the metrics file (zoffload.log.metrics_path)"));
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
  // offload invariant): only the rest is worth a warning.
  for (const char* skip : {"zoffload", "aio", "zero_optimization", "steps_per_print", "wall_clock_breakdown", "tensorboard",
                           "csv_monitor"}) {
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

std::string Trainer::Impl::model_config_json() const { return to_hf_config_json(model, torch_dtype_name(compute_dtype)); }

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
    ZO_LOG(kWarn) << "resuming from " << resume->path << " with a config that differs from the one it was saved with at "
                  << join(shown, ", ") << (diff.size() > shown.size() ? ", ..." : "")
                  << ": training continues with the new values";
  }
  if (st.data != fs::absolute(opt.data_path).lexically_normal().string() || st.seq_len != data->options().seq_len) {
    ZO_LOG(kWarn) << "resuming from " << resume->path << ", saved while reading " << st.data << " with --seq-len "
                  << st.seq_len << ", now " << opt.data_path << " with " << data->options().seq_len
                  << ": the data position (epoch " << st.data_position.epoch << ", batch " << st.data_position.index
                  << ") is applied to the new data";
  }
  const std::string saved = resume->model_config_json;
  if (saved != model_config_json()) {
    auto saved_model = parse_hf_config(saved, resume->path + "/config.json");
    if (saved_model.is_ok() && to_hf_config_json(*saved_model, "") != to_hf_config_json(model, "")) {
      ZO_LOG(kWarn) << "resuming from " << resume->path << ": its config.json differs from " << opt.model
                    << "'s beyond the tensor shapes (norm eps, rope, ...): training continues with " << opt.model << "'s";
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
  if (model_dir) return load_hf_weights(opt.model, layout, kInitChunkElems, sink, env());
  return random_init_weights(model, layout, opt.seed, kInitChunkElems, sink);
}

std::vector<torch::Tensor> Trainer::Impl::wrap(uint32_t block, const std::vector<gpu::DevicePtr>& ptrs,
                                               bool grad) const {
  const BlockSpec& spec = layout.blocks[block];
  std::vector<torch::Tensor> out;
  out.reserve(ptrs.size());
  for (size_t i = 0; i < ptrs.size(); ++i) {
    torch::Tensor t = param_tensor(ptrs[i].addr, layout.params[spec.params[i]], compute_dtype, torch_device);
    if (grad) t.set_requires_grad(true);
    out.push_back(std::move(t));
  }
  return out;
}

// LibTorch's current stream, where the blocks compute (nullptr on the CPU).
Result<void*> Trainer::Impl::compute_stream() {
  void* stream = nullptr;
  ZO_RETURN_IF_ERROR(torch_call("reading LibTorch's stream", [&] { stream = torch_compute_stream(torch_device.is_cuda()); }));
  return stream;
}

// A block's forward or backward: a LibTorch call that is a span of the compute track when tracing,
// timed by the device as it runs it (its busy time, and the trace's device compute track).
Status Trainer::Impl::compute_call(const std::string& what, const std::function<void()>& fn) {
  trace::Span span(trace::Track::kCompute, [&] { return what; });
  ZO_ASSIGN_OR_RETURN(void* stream, compute_stream());
  return device->foreign_work(gpu::DeviceWork::kCompute, 0, stream, what, [&] { return torch_call(what, fn); });
}

Result<std::vector<gpu::DevicePtr>> Trainer::Impl::acquire(uint32_t block) {
  trace::Span span(trace::Track::kFetch, [&] { return "fetch " + layout.blocks[block].name; });
  // No host wait on CUDA: LibTorch's stream waits on the device for the block's ready event, so the
  // host queues the block's kernels while its copies are still landing.
  ZO_ASSIGN_OR_RETURN(ParamCoordinator::Acquired a, coord->acquire_async(block));
  if (!a.ready) return std::move(a.ptrs);  // nothing in transfer
  ZO_ASSIGN_OR_RETURN(void* stream, compute_stream());
  const auto t0 = Clock::now();
  Status st = device->wait_foreign(stream, a.ready);
  ready_wait_s += seconds_since(t0);
  ZO_RETURN_IF_ERROR(st.with_context("waiting for the parameters of " + layout.blocks[block].name));
  return std::move(a.ptrs);
}

Status Trainer::Impl::release(uint32_t block) {
  // No host sync: the coordinator's copy stream waits for this event, recorded after the kernels
  // LibTorch has queued so far (all that read the block), before it refills the block's space.
  ZO_ASSIGN_OR_RETURN(void* stream, compute_stream());
  ZO_RETURN_IF_ERROR(device->record_foreign(released, stream).with_context("releasing " + layout.blocks[block].name));
  return coord->release(block, released);
}

Status Trainer::Impl::offload_grads(uint32_t block, const std::vector<torch::Tensor>& grads, bool inject_overflow) {
  // Each gradient is copied into the gradient worker's landing ring (pinned) and accumulated there
  // behind the next block's backward (Note [Gradient landing ring]). On CUDA the copies are D2H
  // on LibTorch's copy stream, ordered after the backward kernels queued so far by an event on the
  // compute stream, so they overlap the next block's kernels instead of queueing between them; the
  // worker waits for the copy's event, and the host for neither.
  const BlockSpec& spec = layout.blocks[block];
  trace::Span span(trace::Track::kGradOffload, [&] { return "offload " + spec.name; });
  // The compute dtype, or grad_accum_dtype for the vertical schedule's device-side sums.
  const DType dtype = grad_transfer_dtype(opt.config);
  const bool cuda = torch_device.is_cuda();
  std::optional<TorchCopyStreamScope> copies;
  ZO_RETURN_IF_ERROR(begin_copies(&copies, "sending the gradients of " + spec.name));
  for (size_t i = 0; i < grads.size(); ++i) {
    const std::string& name = layout.params[spec.params[i]].name;
    const torch::Tensor& g = grads[i];
    if (!g.defined()) return internal_error("no gradient reached " + name);
    ZO_CHECK(g.scalar_type() == to_torch_dtype(dtype)) << "the gradient of " << name << " is not " << dtype_name(dtype);
    const uint64_t bytes = static_cast<uint64_t>(g.numel()) * g.element_size();
    ZO_RETURN_IF_ERROR(grad_worker->submit(
        spec.params[i], dtype, bytes,
        [&](std::span<std::byte> slot) {
          ZO_RETURN_IF_ERROR(device->foreign_work(gpu::DeviceWork::kD2H, bytes, copies->native_stream(), {}, [&] {
            return torch_call("copying the gradient of " + name, [&] {
              torch::Tensor src = g;
              if (inject_overflow && i == 0) {  // on the source: the copy below may still be in flight
                src = g.clone();
                src.view(-1)[0] = std::numeric_limits<float>::infinity();
              }
              copies->record_use(g);  // g's memory is not reused before the copy stream has read it
              torch::Tensor landed = torch::from_blob(slot.data(), g.sizes(), g.options().device(torch::kCPU));
              landed.copy_(src, /*non_blocking=*/true);
            });
          }));
          return device->record_foreign(landed, copies->native_stream());
        },
        landed));
    if (cuda) accounting.add_moved(Move::kDeviceToHost, bytes);
  }
  return Status::ok();
}

// Note [Checkpoints on the CPU]
// The vertical schedule at a large GAS holds GAS times every layer's input: for llama3-8b at
// micro-batch 8, seq 1024, GAS 8 that is 16 GiB, more than a 24 GB card has beside the arena. With
// zoffload.activation_checkpoints "cpu" (or "auto" when the planner finds that this is what fits)
// each decoder layer's input goes to a pinned host slot once the layer's output exists (so the
// forward holds its input and output), and comes back one layer ahead of the layer's backward
// (so backward holds the layer's and the next one's). The copies run on LibTorch's copy stream,
// ordered after the compute stream by an event: the compute stream waits only for a layer's
// copies back, on the GPU. Each (micro-batch, layer) has its own slot, allocated once at start;
// a slot is rewritten only by the next step's forward, whose copy out queues on the same copy
// stream behind the copy back that read it. The embedding's token ids and the head's input stay
// on the device (the head runs right after the forward). The bytes are copied, not recomputed,
// so the weights are bit-identical to checkpoints on the device.
torch::Tensor Trainer::Impl::checkpoint_slot(uint32_t block, size_t k, const torch::Tensor& like) const {
  const uint64_t layers = model.num_hidden_layers;
  const uint64_t offset = (k * layers + (block - 1)) * ckpt_slot_bytes;
  ZO_CHECK(static_cast<uint64_t>(like.nbytes()) <= ckpt_slot_bytes && offset + ckpt_slot_bytes <= run_plan.checkpoint_host_bytes)
      << "checkpoint of block " << block << ", micro-batch " << k << ": " << like.nbytes() << " bytes for a slot of "
      << ckpt_slot_bytes;
  return torch::from_blob(static_cast<std::byte*>(ckpt_host) + offset, like.sizes(), like.options().device(torch::kCPU));
}

Status Trainer::Impl::begin_copies(std::optional<TorchCopyStreamScope>* copies, const std::string& where) {
  const bool cuda = torch_device.is_cuda();
  void* compute = nullptr;
  ZO_RETURN_IF_ERROR(torch_call(where, [&] { compute = torch_compute_stream(cuda); }));
  ZO_RETURN_IF_ERROR(device->record_foreign(copies_after, compute).with_context(where));
  ZO_RETURN_IF_ERROR(torch_call(where, [&] { copies->emplace(cuda); }));
  return device->wait_foreign((*copies)->native_stream(), copies_after).with_context(where);
}

// The bytes of block's activation checkpoints, over the micro-batches (one copy each way).
uint64_t Trainer::Impl::checkpoint_bytes(uint32_t block, const Forward& f) const {
  uint64_t bytes = 0;
  for (const auto& m : f.micro) bytes += static_cast<uint64_t>(m.inputs[block].nbytes());
  return bytes;
}

Status Trainer::Impl::checkpoints_out(uint32_t block, Forward& f) {
  const std::string where = "moving the checkpoints of " + layout.blocks[block].name + " to the CPU";
  std::optional<TorchCopyStreamScope> copies;
  ZO_RETURN_IF_ERROR(begin_copies(&copies, where));
  ZO_RETURN_IF_ERROR(device->foreign_work(gpu::DeviceWork::kD2H, checkpoint_bytes(block, f), copies->native_stream(), {}, [&] {
    return torch_call(where, [&] {
      for (size_t k = 0; k < f.micro.size(); ++k) {
        torch::Tensor& x = f.micro[k].inputs[block];
        torch::Tensor slot = checkpoint_slot(block, k, x);
        slot.copy_(x, /*non_blocking=*/true);
        copies->record_use(x);  // freed now; not reused before the copy has read it
        x = slot;
      }
    });
  }));
  return device->record_foreign(ckpt_copied, copies->native_stream()).with_context(where);
}

Status Trainer::Impl::checkpoints_back(uint32_t block, Forward& f) {
  const std::string where = "moving the checkpoints of " + layout.blocks[block].name + " back to the device";
  std::vector<torch::Tensor> back(f.micro.size());
  ZO_RETURN_IF_ERROR(torch_call(where, [&] {
    // Allocated on the compute stream, which uses them; the copy stream waits for its earlier work.
    for (size_t k = 0; k < back.size(); ++k) back[k] = torch::empty_like(f.micro[k].inputs[block], torch_device);
  }));
  std::optional<TorchCopyStreamScope> copies;
  ZO_RETURN_IF_ERROR(begin_copies(&copies, where));
  ZO_RETURN_IF_ERROR(device->foreign_work(gpu::DeviceWork::kH2D, checkpoint_bytes(block, f), copies->native_stream(), {}, [&] {
    return torch_call(where, [&] {
      for (size_t k = 0; k < back.size(); ++k) {
        back[k].copy_(f.micro[k].inputs[block], /*non_blocking=*/true);
        copies->record_use(back[k]);
        f.micro[k].inputs[block] = back[k];
      }
    });
  }));
  ZO_RETURN_IF_ERROR(device->record_foreign(ckpt_back[block % 2], copies->native_stream()).with_context(where));
  return device->record_foreign(ckpt_copied, copies->native_stream()).with_context(where);
}

Status Trainer::Impl::wait_checkpoints(uint32_t block) {
  ZO_ASSIGN_OR_RETURN(void* compute, compute_stream());
  return device->wait_foreign(compute, ckpt_back[block % 2])
      .with_context("waiting for the checkpoints of " + layout.blocks[block].name);
}

void Trainer::Impl::fold_grads(std::vector<torch::Tensor>& params, std::vector<torch::Tensor>& sums, bool first) const {
  // Called inside torch_call. The sum is over micro-batches in order, each added once in
  // grad_accum_dtype: the additions the accumulator makes on the host with the horizontal schedule.
  const torch::ScalarType accum = to_torch_dtype(opt.config.grad_accum_dtype);
  sums.resize(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    torch::Tensor& g = params[i].mutable_grad();
    if (first) {
      sums[i] = g.to(accum, /*non_blocking=*/false, /*copy=*/true);
    } else {
      sums[i].add_(g);
    }
    g.reset();
  }
}

// One micro-step: forward block by block keeping only block inputs, then the head's loss and
// backward, then each block in reverse: re-fetch, recompute with autograd, backpropagate, hand its
// gradients to the accumulators, release (docs/design.md, "One training step").
//
// Note [Vertical schedule]
// With gradient accumulation the horizontal schedule runs each micro-batch through every block, so
// a step fetches every block 2·GAS times and sends every gradient to the host GAS times. The
// vertical one (zoffload.schedule "vertical", GreedySnake's order) runs all GAS micro-batches
// through block b before block b+1, forward and backward: one fetch of each block per direction
// and step, and one gradient transfer per parameter, at the price of holding every micro-batch's
// activation checkpoints at once (the planner counts GAS times the checkpoints, and the summed
// gradients of the largest block, in grad_accum_dtype).
// The gradients of a block are summed on the device in grad_accum_dtype, micro-batch by
// micro-batch in order (fold_grads), then sent once; the host accumulator sees one contribution.
// These are the same additions, in the same order and dtype, that the accumulator makes with the
// horizontal schedule, so the two agree to the bit where both sides round alike (fp32 sums: IEEE
// additions; the test compares them); the per-micro-batch forward and backward are unchanged.
Result<Trainer::Impl::Forward> Trainer::Impl::forward(uint64_t count) {
  Forward f;
  f.micro.resize(count);
  const uint32_t n = static_cast<uint32_t>(layout.blocks.size());
  auto out_of_vocab = [&](int32_t token, bool label) { return !(label && token == kIgnoreLabel) && (token < 0 || static_cast<uint64_t>(token) >= model.vocab_size); };
  for (Micro& mb : f.micro) {
    const auto data_t0 = Clock::now();
    ZO_RETURN_IF_ERROR(data->next_batch(&batch));
    mb.position = batch.position;
    for (size_t i = 0; i < batch.inputs.size(); ++i) {
      const bool bad_input = out_of_vocab(batch.inputs[i], false);
      if (bad_input || out_of_vocab(batch.targets[i], true))
        return invalid_argument(opt.data_path + ": " + (bad_input ? "token " : "label ") +
                                std::to_string(bad_input ? batch.inputs[i] : batch.targets[i]) + " (window " +
                                std::to_string(batch.windows[i / batch.seq_len]) + ") is outside the model's vocabulary of " +
                                std::to_string(model.vocab_size));
    }
    for (int32_t t : batch.targets) mb.tokens += t != kIgnoreLabel;
    f.data_s += seconds_since(data_t0);
    mb.inputs.resize(n);
    ZO_RETURN_IF_ERROR(torch_call("preparing the batch", [&] {
      const int64_t b = static_cast<int64_t>(batch.batch), t = static_cast<int64_t>(batch.seq_len);
      mb.inputs[0] = torch::from_blob(batch.inputs.data(), {b, t}, torch::kInt32).to(torch_device, torch::kInt64);
      mb.targets = torch::from_blob(batch.targets.data(), {b, t}, torch::kInt32).to(torch_device, torch::kInt64);
    }));
  }

  coord->begin_micro_step();
  for (uint32_t b = 0; b + 1 < n; ++b) {
    ZO_ASSIGN_OR_RETURN(std::vector<gpu::DevicePtr> ptrs, acquire(b));
    ZO_RETURN_IF_ERROR(compute_call("forward of " + layout.blocks[b].name, [&] {
      torch::NoGradGuard no_grad;
      const std::vector<torch::Tensor> params = wrap(b, ptrs, false);
      for (Micro& mb : f.micro) mb.inputs[b + 1] = block_forward(model, layout.blocks[b], params, mb.inputs[b], rope);
    }));
    ZO_RETURN_IF_ERROR(release(b));
    if (host_checkpoint(b)) ZO_RETURN_IF_ERROR(checkpoints_out(b, f));
  }
  return f;
}

Result<Trainer::Impl::MicroResult> Trainer::Impl::finish_micro_step(Forward& f, bool first, bool last,
                                                                    bool inject_overflow) {
  MicroResult result;
  ZO_RETURN_IF_ERROR(grads->begin_micro_step(first, last));
  // A failure below leaves the accumulator's window open; close it so the next step can start
  // (blocks still held are treated as released by the next begin_micro_step).
  struct Abandon {
    GradWorker* worker;
    GradAccumulator* grads;
    bool armed = true;
    ~Abandon() {
      if (!armed) return;
      (void)worker->drain();  // the worker must be idle before the window closes; the step's error is reported
      grads->abandon_micro_step();
    }
  } abandon{grad_worker.get(), grads.get()};
  const uint32_t n = static_cast<uint32_t>(layout.blocks.size());
  // Data parallel: each rank's share of the mean, so that the all-reduced sum is the mean.
  const double loss_factor = scaler->scale() / static_cast<double>(opt.config.gradient_accumulation_steps * world_size());
  const size_t count = f.micro.size();
  // With several micro-batches (the vertical schedule) each block's gradients are summed on the
  // device and leave it once (Note [Vertical schedule]).
  const bool fold = count > 1;
  // The block's gradients to send: the params' own, or their sums.
  auto block_grads = [&](const std::vector<torch::Tensor>& params, std::vector<torch::Tensor>& sums) {
    if (fold) return sums;
    std::vector<torch::Tensor> g;
    for (const torch::Tensor& p : params) g.push_back(p.grad());
    return g;
  };

  // The head: its forward and backward follow each other in the schedule, so it runs once with
  // autograd and its backward entry only acquires and releases it.
  std::vector<torch::Tensor> grad_out(count);
  {
    const uint32_t h = n - 1;
    ZO_ASSIGN_OR_RETURN(std::vector<gpu::DevicePtr> ptrs, acquire(h));
    std::vector<torch::Tensor> params, sums, grads_h;
    ZO_RETURN_IF_ERROR(compute_call("forward and backward of " + layout.blocks[h].name, [&] {
      params = wrap(h, ptrs, true);
      for (size_t k = 0; k < count; ++k) {
        Micro& mb = f.micro[k];
        torch::Tensor x = mb.inputs[h].detach().set_requires_grad(true);
        torch::Tensor loss = lm_loss(block_forward(model, layout.blocks[h], params, x, rope), mb.targets);
        result.loss += loss.item<double>();
        (loss * loss_factor).backward();
        grad_out[k] = x.grad();
        if (fold) fold_grads(params, sums, k == 0);
      }
      grads_h = block_grads(params, sums);
    }));
    const auto g0 = Clock::now();
    ZO_RETURN_IF_ERROR(offload_grads(h, grads_h, false));
    result.grad_offload_s += seconds_since(g0);
    ZO_RETURN_IF_ERROR(release(h));
    ZO_RETURN_IF_ERROR(acquire(h).status());
    ZO_RETURN_IF_ERROR(release(h));
  }

  for (uint32_t b = n - 1; b-- > 0;) {
    // Note [Checkpoints on the CPU]: block b's inputs were queued back with block b+1 (or now, for
    // the last layer), and block b-1's are queued before b computes.
    if (host_checkpoint(b) && b + 2 == n) ZO_RETURN_IF_ERROR(checkpoints_back(b, f));
    if (b > 0 && host_checkpoint(b - 1)) ZO_RETURN_IF_ERROR(checkpoints_back(b - 1, f));
    if (host_checkpoint(b)) ZO_RETURN_IF_ERROR(wait_checkpoints(b));
    ZO_ASSIGN_OR_RETURN(std::vector<gpu::DevicePtr> ptrs, acquire(b));
    std::vector<torch::Tensor> params, sums, grads_b;
    ZO_RETURN_IF_ERROR(compute_call("backward of " + layout.blocks[b].name, [&] {
      params = wrap(b, ptrs, true);
      for (size_t k = 0; k < count; ++k) {
        Micro& mb = f.micro[k];
        torch::Tensor x = b == 0 ? mb.inputs[0] : mb.inputs[b].detach().set_requires_grad(true);
        torch::Tensor out = block_forward(model, layout.blocks[b], params, x, rope);
        torch::autograd::backward({out}, {grad_out[k]});
        grad_out[k] = b == 0 ? torch::Tensor() : x.grad();
        mb.inputs[b] = torch::Tensor();
        if (fold) fold_grads(params, sums, k == 0);
      }
      grads_b = block_grads(params, sums);
    }));
    const auto g0 = Clock::now();
    ZO_RETURN_IF_ERROR(offload_grads(b, grads_b, b == 0 && inject_overflow));
    result.grad_offload_s += seconds_since(g0);
    ZO_RETURN_IF_ERROR(release(b));
  }
  {
    trace::Span span(trace::Track::kGradOffload, "wait for the gradient worker");
    const auto g0 = Clock::now();
    Status drained = grad_worker->drain();
    result.grad_offload_s += seconds_since(g0);
    ZO_RETURN_IF_ERROR(drained.with_context("accumulating gradients"));
  }
  ZO_ASSIGN_OR_RETURN(result.grads, grads->end_micro_step());
  abandon.armed = false;
  return result;
}

// Note [Replicated data parallel]
// With several ranks (torchrun, mpirun, srun; engine/dist) each rank trains on its own slice of
// every global batch (Dataset's rank split). At ZeRO stage 0 each holds every state, as one
// process does. At the accumulation boundary the ranks sum their gradient accumulators with one
// all-reduce per chunk (every rank ends with the same bits, the loss factor having divided by the
// world size already, so the sum is the mean), and each rank takes the norm of the sums. From
// there every rank holds the same gradients, norm, overflow flag and loss scale, and runs the same
// optimizer step on the same states, so the replicas stay bit-identical without exchanging
// weights; rank 0 writes the metrics and checkpoints. The chunks are kReduceChunkElems whatever the
// tier, so the norm's summation order, and the weights, do not depend on where the accumulators
// live.
//
// Note [Partitioned data parallel]
// At ZeRO stages 1-3 each rank owns one partition of the sub-groups (Note [Partitions] in
// param_registry.cpp) and holds the optimizer states (master, exp_avg, exp_avg_sq) of that
// partition only: the 12 bytes per parameter that dominate an offloaded run are divided by the
// world size. At stage 1 every rank still holds every gradient accumulator; at the boundary
// each chunk is reduced to its owner instead of all-reduced; the owner takes its squared norm, and
// one all-reduce of the per-chunk norms (each slot filled by one rank, the others adding zeros,
// which is exact) lets every rank add them up in the replicated path's order: with two ranks the
// same bits as stage 0 (a reduce and an all-reduce of two values both compute a + b). Each rank
// then steps its own sub-groups while, beside it and the next forward, each sub-group's new compute
// copy is broadcast from its owner, chunk by chunk in sub-group order, and published to the next
// forward as it arrives (Note [Gather beside the step]).
// From stage 2 the gradient accumulators are partitioned too: each micro-step's gradients are
// reduced to their owners during backward (Note [Partitioned gradients] in grad_accumulator.h), and
// the boundary only all-reduces the owners' chunk norms, in the same order.
// At stage 3 the compute copies are partitioned as well: nothing is broadcast after the step, and
// each block is gathered from its owners whenever the coordinator fetches it (Note [Gathered
// parameters] in block_gatherer.cpp); gather_compute then only publishes the other ranks' sub-groups
// to the gate and exchanges the step's outcome.
Result<GradNormReport> Trainer::Impl::reduce_gradients() {
  const bool partitioned = plan.partitioned();
  trace::Span span(trace::Track::kCollective, partitioned ? "reduce the gradients to their owners" : "all-reduce the gradients");
  const DType dtype = plan.placement.grad_dtype;
  const uint64_t elem_bytes = dtype_size_bytes(dtype);
  GradNormReport report;
  std::vector<double> chunk_sq;  // partitioned: each chunk's squared norm, from its owner
  for (uint32_t g = 0; g < store->plan().n_sub_groups; ++g) {
    const StateLocation& loc = store->location(g, StateKind::kGradAccum);
    const uint64_t n = store->state_bytes(g, StateKind::kGradAccum) / elem_bytes;
    const uint32_t owner = registry->partition_of_group(g);
    const bool mine = !partitioned || owner == rank();
    const std::string what = (partitioned ? "reducing the gradients of sub-group " : "all-reducing the gradients of sub-group ") +
                             std::to_string(g);
    for (uint64_t first = 0; first < n; first += kReduceChunkElems) {
      const uint64_t count = std::min(kReduceChunkElems, n - first);
      const uint64_t offset_bytes = first * elem_bytes;
      std::byte* p = nullptr;
      if (loc.tier == Tier::kCpu) {
        p = loc.host + offset_bytes;
      } else {
        if (!reduce_staging) {
          ZO_ASSIGN_OR_RETURN(AlignedBuffer b, AlignedBuffer::allocate(kReduceChunkElems * elem_bytes));
          reduce_staging.emplace(std::move(b));
        }
        p = reduce_staging->data();
        ZO_RETURN_IF_ERROR(store->read_state_range(g, StateKind::kGradAccum, offset_bytes, {p, count * elem_bytes}));
      }
      ZO_RETURN_IF_ERROR(reduce_in_buckets(p, count, partitioned ? std::optional<uint32_t>(owner) : std::nullopt, what));
      double sq = 0;
      if (mine) {
        ZO_ASSIGN_OR_RETURN(sq, cpu_optim::squared_norm({p, dtype}, count, *executor));
        if (loc.tier != Tier::kCpu)
          ZO_RETURN_IF_ERROR(store->write_state_range(g, StateKind::kGradAccum, offset_bytes, {p, count * elem_bytes}));
      }
      if (partitioned) {
        chunk_sq.push_back(sq);
      } else {
        report.sum_sq += sq;
      }
    }
  }
  if (partitioned) return owners_norm(std::move(chunk_sq));
  report.nonfinite = !std::isfinite(report.sum_sq);
  return report;
}

Status Trainer::Impl::reduce_in_buckets(void* data, uint64_t n, std::optional<uint32_t> owner, const std::string& what) {
  const DType dtype = plan.placement.grad_dtype;
  const uint64_t bucket = std::max<uint64_t>(1, opt.config.zero.reduce_bucket_size);
  auto* bytes = static_cast<std::byte*>(data);
  for (uint64_t at = 0; at < n; at += bucket) {
    const uint64_t count = std::min(bucket, n - at);
    std::byte* p = bytes + at * dtype_size_bytes(dtype);
    ZO_RETURN_IF_ERROR(owner ? opt.group->reduce_sum(p, count, dtype, *owner, what)
                             : opt.group->all_reduce_sum(p, count, dtype, what));
  }
  return Status::ok();
}

Result<GradNormReport> Trainer::Impl::owners_norm(std::vector<double> chunk_sq) {
  ZO_RETURN_IF_ERROR(opt.group->all_reduce_sum(chunk_sq, "all-reducing the gradient norm"));
  GradNormReport report;
  for (double sq : chunk_sq) report.sum_sq += sq;
  report.nonfinite = !std::isfinite(report.sum_sq);
  return report;
}

namespace detail {

// The owned sub-groups whose new compute copy is at its home, told by the optimizer's thread,
// waited for by the thread that broadcasts them (Note [Gather beside the step]).
class ReadyGroups {
 public:
  explicit ReadyGroups(uint32_t n) : ready_(n, 0) {}
  void ready(uint32_t g) {
    std::lock_guard<std::mutex> lock(mu_);
    ready_[g] = 1;
    cv_.notify_all();
  }
  // The step is over (`ok`: it succeeded): groups not ready by now never will be.
  void finish(bool ok) {
    std::lock_guard<std::mutex> lock(mu_);
    finished_ = true;
    ok_ = ok;
    cv_.notify_all();
  }
  // Waits for finish(); its `ok`.
  bool outcome() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return finished_; });
    return ok_;
  }
  // Whether g became ready (false: the step ended without it).
  bool wait(uint32_t g) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return ready_[g] != 0 || finished_; });
    return ready_[g] != 0;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<uint8_t> ready_;
  bool finished_ = false;
  bool ok_ = false;
};

}  // namespace detail

// Note [Gather beside the step]: the broadcasts run on their own thread while this rank's optimizer
// steps its partition, in sub-group order on every rank; the owner of each sub-group broadcasts it
// as soon as the optimizer has written it. Rank r thus receives rank 0's copies while it is still
// stepping its own, and the next forward gets block 0 as soon as its owner has stepped it. An owner
// whose step failed still sends the sub-groups it did not finish (whatever their homes hold), so
// that no rank waits for copies that will never come; after the last one the ranks all-reduce
// whether every step succeeded (one collective, not one per sub-group), and every rank stops if one
// failed (the copies received are then stale: the states are torn, as after any failed step).
Status Trainer::Impl::gather_compute(detail::ReadyGroups& ready, const std::function<void(uint32_t)>& publish) {
  trace::Span span(trace::Track::kCollective, "all-gather the updated parameters");
  const uint64_t elem_bytes = state_elem_bytes(plan.placement, StateKind::kCompute);
  Status local;
  if (plan.partition_params) {
    // Nothing to send: the next forward gathers each block from its owner once the owner's gate says
    // the block is written (Note [Gathered parameters]); the other ranks' sub-groups are final here.
    for (uint32_t g = 0; g < plan.n_sub_groups && publish; ++g)
      if (!plan.owns(g)) publish(g);
  } else {
    for (uint32_t g = 0; g < plan.n_sub_groups; ++g) {
      const StateLocation& loc = store->location(g, StateKind::kCompute);
      const uint64_t n = store->state_bytes(g, StateKind::kCompute) / elem_bytes;
      const uint32_t owner = registry->partition_of_group(g);
      const std::string what = "all-gathering the compute copies of sub-group " + std::to_string(g);
      if (owner == rank()) (void)ready.wait(g);  // sent even when not updated: see above
      for (uint64_t first = 0; first < n; first += kReduceChunkElems) {
        const uint64_t bytes = std::min(kReduceChunkElems, n - first) * elem_bytes;
        const uint64_t offset_bytes = first * elem_bytes;
        std::byte* p = nullptr;
        if (loc.tier == Tier::kCpu) {
          p = loc.host + offset_bytes;
        } else {
          p = gather_staging->data();
          // A local failure (here or below) is kept for the end: this rank still takes part in every
          // broadcast, so that the others do not wait for it.
          if (owner == rank() && local.is_ok()) local = store->read_state_range(g, StateKind::kCompute, offset_bytes, {p, bytes});
        }
        ZO_RETURN_IF_ERROR(opt.group->broadcast(p, bytes, owner, what));
        if (owner != rank() && loc.tier != Tier::kCpu && local.is_ok())
          local = store->write_state_range(g, StateKind::kCompute, offset_bytes, {p, bytes});
      }
      if (owner != rank() && publish && local.is_ok()) publish(g);
    }
  }
  std::vector<double> failed(world_size(), 0.0);
  const bool ok = ready.outcome();
  failed[rank()] = ok && local.is_ok() ? 0.0 : 1.0;
  ZO_RETURN_IF_ERROR(opt.group->all_reduce_sum(failed, "exchanging the outcome of the optimizer step"));
  if (!local.is_ok()) return local.with_context("all-gathering the compute copies");
  if (!ok) return Status::ok();  // the optimizer's own error is the step's
  for (uint32_t r = 0; r < world_size(); ++r) {
    if (failed[r] != 0)
      return Status(StatusCode::kAborted, "the optimizer step of rank " + std::to_string(r) + " of " +
                                              std::to_string(world_size()) + " failed (its own output has the error)");
  }
  return Status::ok();
}

Result<OptimizerStepReport> Trainer::Impl::update(const OptimizerStepArgs& args,
                                                  const std::function<void(uint32_t)>& publish) {
  gather_s = 0;
  if (!plan.partitioned()) return optimizer->step(args);
  if (!gather_staging && !plan.partition_params) {  // for compute copies not in host memory; before any collective
    ZO_ASSIGN_OR_RETURN(AlignedBuffer b, AlignedBuffer::allocate(kReduceChunkElems * state_elem_bytes(plan.placement, StateKind::kCompute)));
    gather_staging.emplace(std::move(b));
  }
  detail::ReadyGroups ready(plan.n_sub_groups);
  OptimizerStepArgs own = args;
  own.on_compute_ready = [&ready, &args](uint32_t g) {
    if (args.on_compute_ready) args.on_compute_ready(g);
    ready.ready(g);
  };
  const double t0 = opt.group->seconds();
  const auto c0 = Clock::now();
  Status gathered;
  double gather_wall_s = 0;
  std::thread comm;
  try {
    comm = std::thread([&] {
      gathered = gather_compute(ready, publish);
      gather_wall_s = seconds_since(c0);
    });
  } catch (const std::system_error& e) {
    return errno_status("starting the thread that all-gathers the parameters", e.code().value());
  }
  Result<OptimizerStepReport> r = optimizer->step(own);
  ready.finish(r.is_ok());
  comm.join();
  gather_s = opt.group->seconds() - t0;
  if (!r.is_ok()) return r;
  if (!gathered.is_ok()) {
    // Some compute copies may be stale: the run cannot go on from these states.
    store->mark_torn(gathered.to_string());
    return gathered;
  }
  // The optimizer's thread's time now ends when the last copy has arrived.
  r->total_s = std::max(r->total_s, gather_wall_s);
  return r;
}

Trainer::Trainer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Trainer::~Trainer() = default;

Result<std::shared_ptr<io::File>> lock_run_dir(const std::string& out_dir_or_empty, io::Env* env) {
  if (env == nullptr) env = io::Env::posix();
  const std::string out_dir = out_dir_or_empty.empty() ? "." : out_dir_or_empty;
  ZO_RETURN_IF_ERROR(env->make_dirs(out_dir).with_context("creating the run directory " + out_dir));
  const std::string path = out_dir + "/.zoffload.lock";
  ZO_ASSIGN_OR_RETURN(io::File file, io::File::open(path, io::OpenMode::kCreate, /*direct=*/false));
  if (Status st = file.lock_exclusive(); !st.is_ok()) {
    const int err = st.sys_errno();
    if (st.code() != StatusCode::kFailedPrecondition && (err == ENOSYS || err == ENOLCK || err == EOPNOTSUPP)) {
      // A file system without flock (Lustre without -o flock, NFS without lockd): the run goes on
      // unguarded rather than not at all.
      ZO_LOG(kWarn) << "cannot lock the run directory " << out_dir << " (" << st.message()
                    << "): nothing stops a second run on it";
      return std::make_shared<io::File>(std::move(file));
    }
    if (st.code() != StatusCode::kFailedPrecondition) return st.with_context("locking the run directory " + out_dir);
    return failed_precondition("run directory " + out_dir + " is in use by another zoffload run (it holds " + path +
                               "): wait for that run to end, or give this one another --out");
  }
  return std::make_shared<io::File>(std::move(file));
}

Result<std::unique_ptr<Trainer>> Trainer::create(const TrainOptions& options) {
  auto impl = std::make_unique<Impl>();
  ZO_RETURN_IF_ERROR(impl->init(options));
  return std::unique_ptr<Trainer>(new Trainer(std::move(impl)));
}

Result<StepMetrics> Trainer::step() {
  trace::Span span(trace::Track::kStep, [&] { return "step " + std::to_string(impl_->steps_done + 1); });
  Result<StepMetrics> r = impl_->step_once();
  if (!r.is_ok()) return Status(r.status()).with_context("step " + std::to_string(impl_->steps_done + 1));
  return r;
}

Result<StepMetrics> Trainer::Impl::step_once() {
  Impl& m = *this;
  const Config& config = m.opt.config;
  const auto t0 = Clock::now();
  StepMetrics out;
  out.step = m.steps_done + 1;
  if (!m.ahead_error.is_ok()) {  // this step's first forward already failed, behind the last optimizer
    Status failed = std::move(m.ahead_error);
    m.ahead_error = Status::ok();
    return failed;
  }
  out.loss_scale = m.scaler->scale();
  out.lr = m.schedule->lr_at(m.optimizer_steps);
  const bool inject = std::find(m.opt.inject_overflow_steps.begin(), m.opt.inject_overflow_steps.end(), out.step) !=
                      m.opt.inject_overflow_steps.end();

  const CoordinatorStats coord_before = m.coord->stats();
  const double ready_wait_before = m.ready_wait_s;
  const double io_busy_before = m.io->stats().busy_s;
  const gpu::DeviceBusy busy_before = m.device->busy();
  const bool cuda = m.torch_device.is_cuda();
  reset_torch_memory_peak(cuda);
  // Every collective of this step (the previous step's optimizer thread has been joined).
  const uint64_t collective_bytes_at_start = m.opt.group != nullptr ? m.opt.group->bytes() : 0;
  const double collective_s_at_start = m.opt.group != nullptr ? m.opt.group->seconds() : 0;
  const BlockGathererStats gathered_at_start = m.gatherer ? m.gatherer->stats() : BlockGathererStats{};
  const uint64_t gas = config.gradient_accumulation_steps;
  GradNormReport boundary;
  double loss_sum = 0;
  double offload_s = 0;
  double worker_s = 0;
  double data_s = 0;
  const uint64_t per_forward = vertical_micro_batches(config);  // micro-batches per forward
  for (uint64_t micro = 0; micro < gas; micro += per_forward) {
    const bool last = micro + per_forward == gas;
    Impl::Forward f;
    if (micro == 0 && m.ahead) {
      f = std::move(*m.ahead);
      m.ahead.reset();
    } else {
      ZO_ASSIGN_OR_RETURN(f, m.forward(per_forward));
      data_s += f.data_s;
    }
    ZO_ASSIGN_OR_RETURN(Impl::MicroResult r, m.finish_micro_step(f, micro == 0, last, inject && last));
    loss_sum += r.loss;
    for (const Impl::Micro& mb : f.micro) out.tokens += mb.tokens;
    offload_s += r.grad_offload_s;
    worker_s += r.grads.offload_s;
    if (last) boundary = r.grads;
  }
  double main_collective_s = 0;
  if (m.opt.group != nullptr) {
    // The micro-steps' collectives (partitioned gradients) ran on the gradient worker's thread.
    out.grad_reduce_s = m.opt.group->seconds() - collective_s_at_start;
    const double main_collective_before = m.opt.group->seconds();
    // Note [Replicated data parallel]: the step's facts, then its gradients, summed over the ranks.
    std::array<double, 2> sums{loss_sum, static_cast<double>(out.tokens)};
    {
      trace::Span span(trace::Track::kCollective, "all-reduce the loss");
      const double before = m.opt.group->seconds();
      ZO_RETURN_IF_ERROR(m.opt.group->all_reduce_sum(sums, "all-reducing the loss"));
      out.rank_wait_s = m.opt.group->seconds() - before;
    }
    loss_sum = sums[0];
    out.tokens = static_cast<uint64_t>(sums[1]);
    if (m.plan.partition_grads) {
      // Already reduced to their owners during backward: only the owners' chunk norms remain.
      trace::Span span(trace::Track::kCollective, "all-reduce the gradient norm");
      ZO_ASSIGN_OR_RETURN(boundary, m.owners_norm(std::move(boundary.chunk_sq)));
    } else {
      ZO_ASSIGN_OR_RETURN(boundary, m.reduce_gradients());
    }
    main_collective_s = m.opt.group->seconds() - main_collective_before;
  }
  out.loss = loss_sum / static_cast<double>(gas * m.world_size());
  out.torch_peak_bytes = torch_memory(cuda).peak_bytes;

  // The accumulation boundary: overflow check, loss-scale update, clipping, then the optimizer on
  // its own thread while this one runs the next step's first forward (Note [Overlapped optimizer]).
  out.grad_norm = std::sqrt(boundary.sum_sq) / out.loss_scale;
  const bool overflow = boundary.nonfinite || !is_finite_norm(out.grad_norm);
  out.skipped = m.scaler->update(overflow);
  const bool overlap = config.zoffload.overlap_optimizer;
  std::optional<Result<OptimizerStepReport>> stepped;
  double join_s = 0;  // waiting for the optimizer (all of it when it does not overlap)
  if (!out.skipped) {
    const OptimizerConfig& oc = config.optimizer;
    OptimizerStepArgs args;
    args.adam = {.lr = static_cast<float>(out.lr),
                 .beta1 = static_cast<float>(oc.betas[0]),
                 .beta2 = static_cast<float>(oc.betas[1]),
                 .eps = static_cast<float>(oc.eps),
                 .weight_decay = static_cast<float>(oc.weight_decay),
                 .adam_w_mode = oc.type == OptimizerType::kAdamW || oc.adam_w_mode,
                 .bias_correction = oc.bias_correction};
    args.step = static_cast<int64_t>(m.optimizer_steps + 1);
    // A non-finite norm that does not skip (fp32, or bf16 without check_grad_overflow, as in
    // DeepSpeed) cannot be clipped by: the gradients go in unclipped, and the log says so.
    double clip = 1.0;
    if (is_finite_norm(out.grad_norm)) {
      clip = clip_coefficient(out.grad_norm, config.gradient_clipping);
    } else {
      ZO_LOG(kWarn) << "step " << out.step << ": the gradient norm is not finite (" << out.grad_norm
                    << ") and this precision does not skip such steps: updating without clipping";
    }
    args.grad_scale = static_cast<float>(clip / out.loss_scale);
    // Every device copy is dropped before the update writes (even a failed one may have changed
    // some: a torn store); from here the forward reads the compute copies from their homes, gated.
    m.coord->invalidate();
    UpdateGate* gate = m.gate.get();
    if (!overlap) {
      const auto o0 = Clock::now();
      stepped.emplace(m.update(args, {}));
      join_s = seconds_since(o0);
    } else {
      auto publish = [gate](uint32_t g) { gate->publish(g); };
      args.on_compute_ready = publish;
      gate->open();
      try {
        m.update_thread = std::thread([&m, &stepped, gate, args, publish] {
          Result<OptimizerStepReport> r = m.update(args, publish);
          gate->close(r.is_ok() ? Status::ok() : r.status());
          stepped.emplace(std::move(r));
        });
      } catch (const std::system_error& e) {
        gate->close(Status::ok());  // nothing was written
        return errno_status("step " + std::to_string(out.step) + ": starting the optimizer thread", e.code().value());
      }
    }
  }
  if (overlap && (m.opt.last_step == 0 || out.step < m.opt.last_step)) {
    auto next = m.forward(per_forward);
    if (next.is_ok()) {
      data_s += next->data_s;
      m.ahead = std::move(*next);
    } else {
      m.ahead_error = next.status();
    }
  }
  if (m.update_thread.joinable()) {
    const auto j0 = Clock::now();
    m.update_thread.join();
    join_s = seconds_since(j0);
  }
  if (stepped) {
    if (!stepped->is_ok()) {
      // The run ends here (the states may be torn); what the forward run ahead did or hit is moot.
      // The gate stops failing forwards: as in the sequential step, the next optimizer step is
      // what refuses the torn states (OptimizerSwapper::step).
      m.ahead.reset();
      m.ahead_error = Status::ok();
      m.gate->close(Status::ok());
      return stepped->status();
    }
    const OptimizerStepReport& report = **stepped;
    ++m.optimizer_steps;
    out.optimizer_s = report.total_s;
    out.nvme_read_wait_s = report.read_wait_s;
    out.nvme_write_wait_s = report.write_wait_s;
  }
  ++m.steps_done;
  out.step_s = seconds_since(t0);
  const CoordinatorStats coord_after = m.coord->stats();
  out.fetch_s = coord_after.fetch_wait_s - coord_before.fetch_wait_s + (m.ready_wait_s - ready_wait_before);
  out.optimizer_wait_s = coord_after.update_wait_s - coord_before.update_wait_s + join_s;
  out.grad_offload_s = offload_s;
  out.grad_worker_s = worker_s;
  out.data_s = data_s;
  if (m.opt.group != nullptr) {
    out.collective_bytes = m.opt.group->bytes() - collective_bytes_at_start;
    out.gather_s = stepped && stepped->is_ok() ? m.gather_s : 0.0;
    if (m.gatherer) {  // Note [Gathered parameters]: the blocks gathered on the gatherer's thread
      const BlockGathererStats g = m.gatherer->stats();
      out.collective_bytes += g.bytes - gathered_at_start.bytes;
      out.gather_s = g.collective_s - gathered_at_start.collective_s;
    }
    out.collective_s = main_collective_s;
  }
  out.compute_s = std::max(0.0, out.step_s - out.fetch_s - out.grad_offload_s - out.data_s - out.optimizer_wait_s -
                                    out.collective_s);
  out.nvme_busy_s = m.io->stats().busy_s - io_busy_before;
  const gpu::DeviceBusy busy_after = m.device->busy();
  out.device_h2d_s = busy_after.h2d_s - busy_before.h2d_s;
  out.device_d2h_s = busy_after.d2h_s - busy_before.d2h_s;
  out.device_compute_s = busy_after.compute_s - busy_before.compute_s;
  out.device_busy = out.step_s > 0 ? out.device_compute_s / out.step_s : 0.0;
  out.overlap = out.step_s > 0 ? std::max({out.compute_s, out.device_compute_s, out.device_h2d_s, out.device_d2h_s,
                                           out.grad_worker_s, out.optimizer_s, out.nvme_busy_s}) /
                                     out.step_s
                               : 0.0;
  out.memory = m.accounting.snapshot();
  const gpu::DeviceStats ds = m.device->stats();
  out.device_peak_bytes = ds.peak_allocated_bytes;
  out.device_budget_bytes = ds.budget_bytes;
  out.device_arena_bytes = coord_after.arena_bytes;
  if (m.metrics == nullptr) return out;  // not rank 0
  const std::string record = out.to_json();
  ZO_RETURN_IF_ERROR(m.metrics->append(record + "\n"));
  if (m.tensorboard || m.csv_monitor) {
    // The same record, as DeepSpeed's monitors write it (Note [Monitor tags] in engine/monitor).
    const std::vector<monitor::Scalar> scalars = monitor::scalars_of_metrics_record(record);
    const uint64_t samples = out.step * config.train_batch_size;
    if (m.tensorboard) ZO_RETURN_IF_ERROR(m.tensorboard->write(samples, scalars).with_context("tensorboard"));
    if (m.csv_monitor) ZO_RETURN_IF_ERROR(m.csv_monitor->write(samples, scalars).with_context("csv_monitor"));
  }
  return out;
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
  return impl_->store->read_param_master(param, 0, out);
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
  // A directory is recorded absolute, so `zoffload export` finds its tokenizer from anywhere.
  st.model = m.model_dir ? fs::absolute(m.opt.model).lexically_normal().string() : m.opt.model;
  st.data = fs::absolute(m.opt.data_path).lexically_normal().string();
  st.seq_len = m.data->options().seq_len;
  st.world_size = m.world_size();
  st.config = to_json(m.opt.config);
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
    o.collective = SaveOptions::Collective{
        .rank = m.rank(),
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
  if (o.env == nullptr) o.env = m.env();
  if (m.plan.partition_params) return m.export_gathered(o);
  return export_store(*m.store, to_hf_config_json(m.model, torch_dtype_name(options.dtype)), *m.io, o);
}

bool Trainer::export_needs_every_rank() const { return impl_->plan.partition_params; }

// Note [Exporting gathered parameters]
// With the compute copies partitioned (stage 3 across ranks) no rank holds every weight, so the
// export is a collective: rank 0 writes the files exactly as export_store does, and each read it
// makes is sent to every rank first (a header: param, offset, count); each piece of the range goes
// from its owner to everyone (a broadcast, as the gatherer's), and one all-reduce of a flag per rank
// says whether any owner failed to read its part, naming it. A header with no read ends the
// exchange and carries rank 0's outcome, so every rank returns the export's success or failure.
// Like the export of a rank holding all compute copies (Note [Exporting partitioned states]) it
// writes in the compute dtype only. The model streams through one read's worth of host memory per
// rank, never whole.
Result<ExportResult> Trainer::Impl::export_gathered(const ExportOptions& o) {
  std::vector<double> torn(world_size(), 0.0);
  torn[rank()] = store->torn_reason().empty() ? 0.0 : 1.0;
  ZO_RETURN_IF_ERROR(opt.group->all_reduce_sum(torn, "exporting the model"));
  for (uint32_t r = 0; r < world_size(); ++r) {
    if (torn[r] != 0)
      return failed_precondition("export: the weights of rank " + std::to_string(r) + " of " + std::to_string(world_size()) +
                                 " are inconsistent after a failed step; export from a checkpoint instead");
  }
  bool broken = false;  // a collective failed: the group is unusable, nothing more is sent
  // Every rank, for one read of rank 0's: the pieces from their owners, then the owners' outcome.
  auto read_pieces = [&](uint32_t p, uint64_t off, std::span<float> out) -> Status {
    const std::string& name = registry->params()[p].name;
    const std::string what = "exporting " + name;
    Status local;
    for (const ParamPiece& piece : registry->pieces_of_param(p)) {
      const uint64_t a = std::max(off, piece.param_offset);
      const uint64_t b = std::min<uint64_t>(off + out.size(), piece.param_offset + piece.n_elems);
      if (a >= b) continue;
      const uint32_t owner = registry->partition_of_group(piece.sub_group);
      std::span<float> part = out.subspan(a - off, b - a);
      if (owner == rank() && local.is_ok()) local = store->read_param_compute(p, a, part);
      Status st = opt.group->broadcast(part.data(), part.size_bytes(), owner, what);
      if (!st.is_ok()) {
        broken = true;
        return st;
      }
    }
    std::vector<double> failed(world_size(), 0.0);
    failed[rank()] = local.is_ok() ? 0.0 : 1.0;
    if (Status st = opt.group->all_reduce_sum(failed, what); !st.is_ok()) {
      broken = true;
      return st;
    }
    if (!local.is_ok()) return local.with_context(what);
    for (uint32_t r = 0; r < world_size(); ++r) {
      if (failed[r] != 0)
        return Status(StatusCode::kAborted, what + ": rank " + std::to_string(r) + " of " + std::to_string(world_size()) +
                                                " could not read its part (its own output has the error)");
    }
    return Status::ok();
  };
  using Header = std::array<double, 4>;  // {more, param, offset, count}; {0, ok} ends; exact below 2^53
  auto send_header = [&](Header& h) {
    Status st = opt.group->broadcast(h.data(), sizeof(Header), 0, "exporting the model (rank 0's next read)");
    if (!st.is_ok()) broken = true;
    return st;
  };
  if (rank() != 0) {
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
  Result<ExportResult> r = failed_precondition(
      "export: at ZeRO stage 3 each of the " + std::to_string(world_size()) + " ranks holds its partition's compute copies "
      "only; it exports in the compute dtype (" + std::string(dtype_name(plan.placement.compute_dtype)) +
      "), or export another dtype from a checkpoint with `zoffload export --dtype`");
  if (o.dtype == plan.placement.compute_dtype) {
    const Fp32Reader read = [&](uint32_t p, uint64_t off, std::span<float> out) -> Status {
      if (broken) return Status(StatusCode::kAborted, "export: the ranks are no longer connected");
      Header h{1.0, static_cast<double>(p), static_cast<double>(off), static_cast<double>(out.size())};
      ZO_RETURN_IF_ERROR(send_header(h));
      return read_pieces(p, off, out);
    };
    r = export_hf_model(registry->params(), to_hf_config_json(model, torch_dtype_name(o.dtype)), read, *io, o);
  }
  if (!broken) {
    Header end{0.0, r.is_ok() ? 1.0 : 0.0, 0.0, 0.0};
    Status st = send_header(end);
    if (!st.is_ok() && r.is_ok()) return st;
  }
  return r;
}

DType Trainer::export_dtype() const {
  const Config& c = impl_->opt.config;
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
  s << "model " << m.opt.model << " (" << m.model.num_hidden_layers << " layers, hidden " << m.model.hidden_size
    << ", " << format_count(m.registry->total_elems()) << " params) | " << dtype_name(m.compute_dtype) << " compute, "
    << dtype_name(pl.grad_dtype) << " gradients | ZeRO stage " << m.opt.config.zero.stage << ", "
    << m.registry->sub_groups().size() << " sub-groups";
  if (m.plan.partitioned())
    s << " (this rank steps " << m.plan.owned_begin << "-" << m.plan.owned_end - 1 << ": partition " << m.rank() << " of "
      << m.world_size() << (m.plan.partition_params ? "; it holds their compute copies only, each block gathered from its owners at fetch" : "")
      << ")";
  s << " | optimizer states on " << tier_name(pl.optimizer)
    << ", gradient accumulators on " << tier_name(pl.grad)
    << ", compute copies: " << (pl.compute.size() - compute_cpu - compute_nvme) << " device, " << compute_cpu
    << " cpu, " << compute_nvme << " nvme | device " << m.device->name() << ", budget "
    << format_bytes(m.device->stats().budget_bytes) << " | pinned pool " << format_bytes(m.store->pool().capacity_bytes());
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

// Trainer::Impl, shared by the trainer's files: trainer.cpp (construction, checkpoints, export, the
// public calls), step.cpp (one optimizer step: micro-steps, boundary, the overlapped optimizer),
// host_checkpoints.cpp (activation checkpoints in pinned host memory) and step_metrics.cpp. Private
// to engine/train; includes LibTorch.
#pragma once

// Not <torch/torch.h>: tensors, autograd and NoGradGuard are all the trainer uses, and the whole
// C++ frontend (nn, optim, data, serialize) costs each of its files some 10 s more to compile.
#include <torch/csrc/autograd/autograd.h>
#include <torch/types.h>
#include <torch/utils.h>

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "common/aligned_buffer.h"
#include "cpu_optim/executor.h"
#include "engine/coord/block_gatherer.h"
#include "engine/coord/grad_accumulator.h"
#include "engine/coord/grad_worker.h"
#include "engine/coord/param_coordinator.h"
#include "engine/coord/update_gate.h"
#include "engine/dist/data_parallel.h"
#include "engine/dist/process_group.h"
#include "engine/memory/optimizer_swapper.h"
#include "engine/memory/param_registry.h"
#include "engine/memory/param_swapper.h"
#include "engine/memory/state_store.h"
#include "engine/model/decoder.h"
#include "engine/model/torch_runtime.h"
#include "engine/monitor/monitor.h"
#include "engine/optim/loss_scaler.h"
#include "engine/optim/lr_schedule.h"
#include "engine/plan/planner.h"
#include "engine/train/step_metrics.h"
#include "engine/train/trainer.h"
#include "gpu/device.h"
#include "gpu/device_info.h"
#include "io/env.h"
#include "io/io_engine.h"

namespace zo::engine {

struct Trainer::Impl {
  TrainOptions opt;
  ModelConfig model;
  bool model_dir = false;  // --model is a Hugging Face model directory (else a preset or TrainOptions::model_config)
  ModelLayout layout;      // training_layout: zoffload.freeze applied
  // Per block, the positions in BlockSpec::params of its trainable params (its gradients, in block
  // order), and the lowest block that has one: backward stops computing there (Note [Frozen
  // sub-groups]).
  std::vector<std::vector<uint32_t>> trainable_slots;
  uint32_t lowest_trainable_block = 0;
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
  // With opt.group: the steps that cross ranks around the optimizer (engine/dist/data_parallel.h).
  std::unique_ptr<dist::DataParallel> data_parallel;
  std::unique_ptr<ParamCoordinator> coord;
  std::unique_ptr<GradAccumulator> grads;
  std::unique_ptr<GradWorker> grad_worker;  // feeds `grads` behind backward; destroyed before it
  std::optional<LossScaler> scaler;
  std::optional<LrSchedule> schedule;
  std::unique_ptr<Dataset> data;
  RopeTables rope;
  Batch batch;
  // TrainOptions::eval_data_path's batches, in file order; null without one (Note [Evaluation]).
  std::unique_ptr<Dataset> eval_data;
  uint64_t eval_batches_per_rank = 0;

  uint64_t steps_done = 0;       // optimizer steps attempted (skipped ones too)
  uint64_t optimizer_steps = 0;  // optimizer steps taken (Adam's step count, the lr index)
  std::string checkpoint_dir;    // resolved zoffload.checkpoint.dir; empty: none
  std::optional<CheckpointInfo> resume;
  std::string resumed_from;
  std::optional<uint64_t> last_saved_step;  // the step of the checkpoint saved or resumed from
  // Note [Run ids] (trainer.cpp): this run's id, in its checkpoints and in OUT/.zoffload.run_id; the
  // id that file held when the run started (empty: none).
  std::string run_id;
  std::string out_run_id;
  // Rank 0's locks on the output directories beside --out's own lock (Note [One run per run
  // directory]): the checkpoint directory, the monitors' directories outside --out. Held for the
  // whole run.
  std::vector<std::shared_ptr<io::File>> output_locks;
  std::vector<std::string> created_dirs;  // the topmost directory each of those locks created
  // Locks `dir` unless it is --out, or lies inside --out and not `inside_out_too`.
  Status lock_output_dir(const std::string& dir, const std::string& what, bool inside_out_too);
  Status read_run_id();   // out_run_id from OUT/.zoffload.run_id
  Status write_run_id();  // run_id into it (rank 0), once the run has started
  std::string model_config_json() const;
  // What --model named, a directory made absolute so that it resolves from anywhere: the
  // checkpoints' model (`zoffload export` finds its tokenizer there) and PEFT's base_model_name_or_path.
  std::string model_source() const;
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
      accounting.remove_resident(Tier::kCpu, run_plan.checkpoint_host_bytes, /*pinned=*/true);
    }
    if (ckpt_copied) device->destroy_event(ckpt_copied);
    for (gpu::Event e : ckpt_back)
      if (e) device->destroy_event(e);
  }

  // init and its steps, in the order it runs them (Note [Trainer construction]; trainer.cpp).
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
  // The held-out data with the training data's options but file order (`train` is what open_data
  // opened the training data with); errors name --eval-data.
  Status open_eval_data(const DataOptions& train);
  Status open_metrics();  // metrics.jsonl, appended to when resuming
  // Where a DeepSpeed monitor writes: output_path/job_name, relative to the run directory.
  std::string monitor_dir(const MonitorConfig& mc) const;
  Status init_weights();

  // ---- LibTorch and the device around each block (step.cpp) ----
  // LibTorch's current stream, where the blocks compute (nullptr on the CPU).
  Result<void*> compute_stream();
  // A block's forward or backward, as a span of the compute track and the device's busy time.
  Status compute_call(const std::string& what, const std::function<void()>& fn);
  // Makes LibTorch's copy stream current in *copies, ordered after the kernels queued so far on the
  // compute stream (copies_after, recorded there and waited for by the copy stream at once).
  Status begin_copies(std::optional<TorchCopyStreamScope>* copies, const std::string& where);
  // Block b's addresses for LibTorch's stream, which waits on the device for their copies.
  Result<std::vector<gpu::DevicePtr>> acquire(uint32_t block);
  double ready_wait_s = 0;  // host time acquire() spent waiting for copies (HostDevice computes on the host)
  // Releases a block with an event after every kernel LibTorch has queued that reads it: on CUDA
  // LibTorch queues its kernels asynchronously, and the coordinator refills the freed arena space
  // only behind that event (no host sync).
  Status release(uint32_t block);
  // The block's compute copies as tensors; leaves that collect gradients when `grad`.
  std::vector<torch::Tensor> wrap(uint32_t block, const std::vector<gpu::DevicePtr>& ptrs, bool grad) const;
  gpu::Event released;      // re-recorded by every release()
  gpu::Event copies_after;  // re-recorded on the compute stream by begin_copies
  gpu::Event landed;        // re-recorded behind every gradient copy, waited on by the gradient worker

  // ---- Activation checkpoints in pinned host memory (host_checkpoints.cpp) ----
  // Note [Checkpoints on the CPU]: run_plan.checkpoints_on_host puts each decoder layer's input in
  // `ckpt_host` (pinned; one slot per held micro-batch and layer) between forward and backward.
  Status create_host_checkpoints();  // the slab and its events, from the plan
  void* ckpt_host = nullptr;
  uint64_t ckpt_slot_bytes = 0;  // one micro-batch's input of one layer
  gpu::Event ckpt_back[2];       // on the copy stream, behind the copies back of layer b (b % 2)
  gpu::Event ckpt_copied;        // on the copy stream, behind the latest checkpoint copy either way
  bool host_checkpoint(uint32_t block) const {
    return ckpt_host != nullptr && block >= 1 && block + 1 < layout.blocks.size();
  }
  // The host slot of block b's input (1 ≤ b ≤ num_hidden_layers) of held micro-batch k.
  torch::Tensor checkpoint_slot(uint32_t block, size_t k, const torch::Tensor& like) const;
  uint64_t checkpoint_bytes(uint32_t block, const Forward& f) const;
  // Copies block b's inputs (every micro-batch of f) to their slots and drops the device copies.
  Status checkpoints_out(uint32_t block, Forward& f);
  // Queues block b's inputs back to the device; wait_checkpoints makes LibTorch's stream wait.
  Status checkpoints_back(uint32_t block, Forward& f);
  Status wait_checkpoints(uint32_t block);

  // ---- One micro-step: forward, backward, gradients (step.cpp) ----
  // Hands a block's gradients (one per trainable param, in block order) to the accumulator.
  Status offload_grads(uint32_t block, const std::vector<torch::Tensor>& grads, bool inject_overflow);
  // Moves the gradients the last backward left in `params` into `sums` (the first micro-batch's are
  // copied, in grad_accum_dtype; later ones added), leaving the params without gradients.
  void fold_grads(std::vector<torch::Tensor>& params, std::vector<torch::Tensor>& sums, bool first) const;
  struct MicroResult {
    double loss = 0;
    double grad_offload_s = 0;  // gradients off the device and into the accumulators
    GradNormReport grads;
  };
  // `batch` (read from `path`) as mb's token ids and targets on the device, its labelled targets in
  // mb.tokens; kInvalidArgument naming the file and window for a token outside the vocabulary.
  Status load_micro(const Batch& batch, const std::string& path, Micro* mb);
  // Whether `id` is no token of the model's vocabulary; a label (a target) may also be kIgnoreLabel.
  bool outside_vocab(int32_t id, bool label) const {
    return !(label && id == kIgnoreLabel) && (id < 0 || static_cast<uint64_t>(id) >= model.vocab_size);
  }
  // Reads the next `count` batches and runs them forward through blocks 0..n-2, block by block
  // (begins the coordinator's micro-step: each block is fetched once for all of them).
  Result<Forward> forward(uint64_t count);
  // The rest: the head's forward and loss, then backward block by block, each block's gradients
  // (summed over f's micro-batches) handed to the accumulators. `loss` is the sum over them.
  Result<MicroResult> finish_micro_step(Forward& f, bool first, bool last, bool inject_overflow);

  // ---- One optimizer step, phase by phase (step.cpp) ----
  // Trainer::step without the step number in its errors.
  Result<StepMetrics> step_once();
  // The step's micro-batches, forward and backward, their gradients in the accumulators: the loss
  // summed over them and the boundary's norm report; tokens, data_s, grad_offload_s and
  // grad_worker_s into `out`.
  struct Accumulated {
    double loss_sum = 0;
    GradNormReport boundary;
  };
  // `first`, when given, runs once the step's first forward is done, before its backward.
  Result<Accumulated> accumulate(bool inject_overflow, StepMetrics* out,
                                 const std::function<Status(const Forward&)>& first = {});
  // With no accumulators (Note [No accumulator]): the micro-steps as accumulate() runs them, with the
  // optimizer stepping each sub-group from backward as its gradient is final; its report or error
  // in `stepped`, the states' failure before backward's.
  Result<Accumulated> accumulate_and_update(bool inject_overflow, StepMetrics* out,
                                            std::optional<Result<OptimizerStepReport>>* stepped);
  // This step's optimizer arguments: hyperparameters, step, seed, and grad_scale = clip ·
  // token_factor / loss scale.
  OptimizerStepArgs step_args(const StepMetrics& out, double clip) const;
  // Note [Loss normalisation] (step.cpp): zoffload.loss_normalization "tokens"; then backward
  // differentiates each micro-batch's summed token losses / target_slots(), and token_factor =
  // target_slots() / the step's labelled tokens finishes the division at the boundary (1 otherwise).
  bool by_tokens() const { return opt.config.zoffload.loss_normalization == "tokens"; }
  uint64_t target_slots() const {
    return opt.config.gradient_accumulation_steps * world_size() * opt.config.train_micro_batch_size_per_gpu * seq_len;
  }
  double token_factor = 1.0;  // this step's
  // Data parallel: the loss and token count summed over the ranks, the gradients summed (into their
  // owners, partitioned) and the norm of the sums, the same on every rank.
  Status sum_over_ranks(const StepCounters& before_step, Accumulated* acc, StepMetrics* out);
  // The optimizer step at the boundary: started on update_thread beside the next forward (Note
  // [Overlapped optimizer]) or, without zoffload.overlap_optimizer, run here (its time in *join_s).
  // `stepped` receives its outcome.
  Status start_update(const StepMetrics& out, std::optional<Result<OptimizerStepReport>>* stepped, double* join_s);
  // Joins the update; its report into `out`, or its error (the run ends there).
  Status finish_update(std::optional<Result<OptimizerStepReport>>& stepped, double* join_s, StepMetrics* out);
  // Note [Evaluation] (step.cpp): whether the held-out data is evaluated after step `step`, and
  // that evaluation (all ranks together; collective).
  bool eval_due(uint64_t step) const {
    return eval_data != nullptr && ((opt.eval_every > 0 && step % opt.eval_every == 0) || step == opt.last_step);
  }
  Result<EvalMetrics> evaluate();
  // This rank's part: the loss over its counted batches, those batches, their labelled targets.
  Result<std::array<double, 3>> evaluate_here();
  // The counters a step's metrics are differences of.
  StepCounters counters() const;
  // Rank 0: the step's record into metrics.jsonl and the monitors.
  Status record(const StepMetrics& out);

  // Data parallel (Note [Replicated data parallel] in engine/dist/data_parallel.cpp).
  uint32_t rank() const { return opt.group != nullptr ? opt.group->rank() : 0; }
  uint32_t world_size() const { return opt.group != nullptr ? opt.group->world_size() : 1; }
};

}  // namespace zo::engine

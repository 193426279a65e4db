// OptimizerSwapper: one optimizer step over every sub-group of a StateStore, wherever the states
// live: it moves them between their tiers and has each sub-group updated (SubGroupStep, in
// engine/memory/sub_group_step.h). On NVMe it runs as a pipeline — read sub-group i+1 ‖ update i ‖
// write i−1 — as far as offload_optimizer.pipeline_read / pipeline_write allow; on the CPU it
// updates in place; on the device it queues the device's kernels. The update also writes the new
// compute copy into the parameter tier. The arithmetic is the same everywhere (bit-identical
// results). Not thread-safe: one step at a time, from one thread.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "common/status.h"
#include "cpu_optim/executor.h"
#include "engine/config/config.h"
#include "engine/memory/state_store.h"
#include "engine/memory/sub_group_step.h"

namespace zo::engine {

struct PipelineOptions {
  bool pipeline_read = false;   // read i+1 while updating i
  bool pipeline_write = false;  // write i−1 while updating i
  // optimizer.type. Adam/AdamW on every tier; Adagrad and Lion with the states on CPU or NVMe.
  OptimizerType optimizer = OptimizerType::kAdamW;
  // A direct step that takes the gradient's norm (step_direct with sum_sq) goes through a sub-group
  // this many elements at a time, the norm's pass then the update, so that the update reads the
  // run from the cache the norm's pass left it in, on the threads that read it (the executor's
  // static partition). A positive multiple of cpu_optim::kTileElems; 64 tiles, 4 MiB of fp32
  // gradient, by default. Not a config key.
  uint64_t norm_run_elems = 64 * cpu_optim::kTileElems;

  // offload_optimizer.pipeline_read / pipeline_write and optimizer.type of `config`.
  static PipelineOptions from_config(const Config& config);
};

struct OptimizerStepArgs {
  // This step's hyperparameters (lr from the scheduler), in the struct of PipelineOptions::optimizer
  // (optimizer_hyperparameters gives them from the config).
  OptimizerHyperparameters hyperparameters;
  int64_t step = 1;         // 1-based optimizer step (bias correction)
  float grad_scale = 1.0f;  // 1/loss_scale × clip coefficient, applied as gradients are read
  // With bf16 masters: the seed of their stochastic rounding (the run's seed), which with the step
  // and the parameter keys every element's random bits (Note [Stochastic rounding to bf16]).
  uint64_t rounding_seed = 0;
  // step() updates the sub-groups the store's plan owns (MemoryPlan::owns: all of them, or a
  // data-parallel rank's partition). Called on step()'s thread, once per such sub-group, as soon as the sub-group's new compute copy is
  // at its home (written to CPU memory, NVMe write or H2D copy completed), before step() returns;
  // not called for sub-groups a failed step never finished. May be empty. For a forward that
  // overlaps the step (UpdateGate).
  std::function<void(uint32_t sub_group)> on_compute_ready;
};

// Where a step's time went, in seconds of wall time on the calling thread.
struct OptimizerStepReport {
  double total_s = 0;
  double update_s = 0;      // inside the optimizer's kernels (CPU or device)
  double read_wait_s = 0;   // blocked waiting for NVMe reads
  double write_wait_s = 0;  // blocked waiting for NVMe writes
  double transfer_s = 0;    // blocked on host↔device copies of compute copies / device states
  uint64_t bytes_read = 0;
  uint64_t bytes_written = 0;
  uint32_t sub_groups = 0;
};

class OptimizerSwapper {
 public:
  // kUnavailable for Adagrad or Lion with the states on the device (named), and for bf16 masters
  // with a compute dtype other than bf16; kInvalidArgument when the plan's buffers cannot carry the
  // requested pipelining. step() and begin_direct() fail with kInvalidArgument, touching nothing,
  // for hyperparameters of another optimizer or out of range (check_update_args).
  static Result<std::unique_ptr<OptimizerSwapper>> create(StateStore& store, const cpu_optim::Executor& executor,
                                                          const PipelineOptions& options);
  ~OptimizerSwapper();
  OptimizerSwapper(const OptimizerSwapper&) = delete;
  OptimizerSwapper& operator=(const OptimizerSwapper&) = delete;

  // Updates every sub-group once from its gradient accumulator (which is left unchanged; the caller
  // zeroes it); kFailedPrecondition for a plan without accumulators. Returns when every new state is
  // at its home (all writes completed). On failure the Status names the step, the sub-group, and for
  // I/O the file, offset and length; outstanding I/O is drained first, and the store is marked torn
  // (see StateStore::mark_torn) unless no sub-group was written yet. A torn store fails at once with
  // kFailedPrecondition.
  Result<OptimizerStepReport> step(const OptimizerStepArgs& args);
  // With the states on NVMe and the accumulators elsewhere, issues the reads of the first
  // sub-groups the next step() updates, one per swap buffer, and returns; step() takes them from
  // their buffers (Note [Reading the states ahead]). For the start of a training step, so that
  // they run under its forward and backward: no step may be in progress, and nothing but step()
  // may write the states until it has run. Does nothing for other placements, for torn states, or
  // when reads ahead are already waiting for a step. A read that cannot be issued is returned
  // (naming the sub-group and file); one that fails later fails the step() that waits for it.
  Status read_states_ahead();

  // A direct step (Note [No accumulator] in engine/coord/grad_accumulator.cpp): the same update of
  // every sub-group, each from a gradient handed over as it becomes final, in any order, instead of
  // from the accumulators. Needs the plan's Placement::no_accumulator, the states on the CPU or NVMe
  // and, with several ranks, partitioned gradients (kFailedPrecondition otherwise, or while a direct
  // step is open, or for torn states); a data-parallel rank steps the sub-groups it owns
  // (MemoryPlan::owns) and no others. args as for step() (on_compute_ready is called per sub-group
  // as there).
  // expected_order: the order the sub-groups will most likely come in (GradAccumulator::
  // completion_order); with the states on NVMe and pipeline_read, the next one's record is read
  // while one is updated. Any order is stepped correctly; another only reads less ahead.
  // kInvalidArgument for a sub-group out of range or listed twice in it.
  Status begin_direct(const OptimizerStepArgs& args, std::vector<uint32_t> expected_order = {});
  // Steps sub-group g from `grad` (its n_elems of the placement's grad dtype, in host memory, read
  // before this returns); the compute copy and (NVMe) the states may still be on their way home.
  // May run on another thread than begin_direct and end_direct, one call at a time, ordered with
  // them by the caller. kInvalidArgument for a sub-group out of range, already stepped or another
  // rank's. The first
  // failure drains, marks the store torn once something was written (as step() does), and is
  // returned again by every later call.
  Status step_direct(uint32_t sub_group, const std::byte* grad);
  // The same, also taking Σ g² of the fp32 gradient into *sum_sq (the bits of
  // cpu_optim::squared_norm_canonical, which also rewrites −0 and signalling NaNs in `grad` as
  // 0 + g first): in the pass that updates the sub-group, a run of tiles at a time, where the
  // sub-group is updated in one kernel call (fp32 masters, fp32 or bf16 moments), else in a pass
  // before the update (Note [Gradients that land where they are summed] in
  // engine/coord/grad_accumulator.cpp). kInvalidArgument for a grad dtype other than fp32. A null
  // sum_sq is the plain step above (what a FinalGradSink is handed when the norm was taken already).
  Status step_direct(uint32_t sub_group, std::byte* grad, double* sum_sq);
  // Waits for every state and compute copy to be home; the report (total_s: the time inside
  // step_direct and here). The step's failure, or kFailedPrecondition (the store marked torn) when
  // some sub-group this rank owns was never stepped. Closes the direct step either way.
  Result<OptimizerStepReport> end_direct();

  struct Impl;

 private:
  explicit OptimizerSwapper(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace zo::engine

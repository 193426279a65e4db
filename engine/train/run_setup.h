// RunSetup: what a training run is built on, in Note [Trainer construction]'s order (trainer.cpp):
// the model's shape, the registry, the device, the plan, the I/O engine, the executor, the state
// store (the weights in their tiers), the optimizer swapper, the update gate, the block gatherer,
// the coordinator and the data-parallel steps. It owns them; the trainer's other parts borrow them
// by reference and never outlive it. Includes no LibTorch. Not thread-safe: the training thread
// builds it (the objects it owns say which threads may use them).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/status.h"
#include "cpu_optim/executor.h"
#include "engine/ckpt/checkpoint.h"
#include "engine/coord/block_gatherer.h"
#include "engine/coord/param_coordinator.h"
#include "engine/coord/update_gate.h"
#include "engine/dist/data_parallel.h"
#include "engine/dist/process_group.h"
#include "engine/memory/accounting.h"
#include "engine/memory/optimizer_swapper.h"
#include "engine/memory/memory_plan.h"
#include "engine/memory/param_swapper.h"
#include "engine/memory/state_store.h"
#include "engine/model/model_config.h"
#include "engine/plan/planner.h"
#include "engine/train/trainer.h"
#include "gpu/device.h"
#include "gpu/device_info.h"
#include "io/env.h"
#include "io/fault_injector.h"
#include "io/io_engine.h"

namespace zo::engine {

// What the run trains, fixed once RunSetup::resolve_model has run.
struct RunModel {
  ModelConfig config;
  bool from_dir = false;  // --model is a Hugging Face model directory (else a preset or TrainOptions::model_config)
  ModelLayout layout;     // training_layout: zoffload.freeze applied
  // Per block, the positions in BlockSpec::params of its trainable params (its gradients, in block
  // order), and the lowest block that has one: backward stops computing there (Note [Frozen
  // sub-groups]).
  std::vector<std::vector<uint32_t>> trainable_slots;
  uint32_t lowest_trainable_block = 0;
  uint64_t seq_len = 0;
  DType compute_dtype = DType::kF32;
  uint32_t n_blocks() const { return static_cast<uint32_t>(layout.blocks.size()); }
};

class RunSetup {
 public:
  // The options of the run (their run_dir_lock is OutputLocks', not kept here).
  explicit RunSetup(const TrainOptions& options);
  RunSetup(const RunSetup&) = delete;
  RunSetup& operator=(const RunSetup&) = delete;

  // The setup's steps of Note [Trainer construction], in the order init runs them.
  Status resolve_model();  // model config, size checks, layout, sequence length
  Status open_device();    // parameter registry, device and its budget
  Status plan_memory();    // the planner: this run's needs against this machine
  // I/O engine, executor, state store; the weights loaded, or the states of `resume` when given.
  Status create_states(const CheckpointInfo* resume);
  // Optimizer swapper, parameter swapper, update gate, block gatherer, coordinator and (with
  // TrainOptions::group) the data-parallel steps.
  Status create_pipeline();

  // Trainer::describe: model, parameters, where each state lives, the device and budgets.
  std::string describe() const;

  const TrainOptions& options() const { return opt_; }
  const Config& config() const { return opt_.config; }
  const RunModel& model() const { return model_; }
  // The file operations of checkpoints, exports and outputs: POSIX, or faulty under
  // TrainOptions::io_faults.
  io::Env* env() const { return faulty_env_ ? faulty_env_.get() : io::Env::posix(); }
  // Data parallel (Note [Replicated data parallel] in engine/dist/data_parallel.cpp); null group:
  // one process.
  dist::ProcessGroup* group() const { return opt_.group; }
  uint32_t rank() const { return opt_.group != nullptr ? opt_.group->rank() : 0; }
  uint32_t world_size() const { return opt_.group != nullptr ? opt_.group->world_size() : 1; }

  const ParamRegistry& registry() const { return *registry_; }
  const MemoryPlan& plan() const { return plan_; }
  const RunPlan& run_plan() const { return run_plan_; }  // the planner's view, checked at start
  // The objects below exist from the step that creates them on; the references are the setup's
  // (shallow const, as owned pointers are).
  MemoryAccounting& accounting() const { return accounting_; }
  gpu::Device& device() const { return *device_; }
  bool cuda() const { return device_->kind() == DeviceKind::kCuda; }
  io::IoEngine& io() const { return *io_; }
  cpu_optim::Executor& executor() const { return *executor_; }
  StateStore& store() const { return *store_; }
  const std::string& swap_dir() const { return swap_dir_; }  // empty when nothing is on NVMe
  OptimizerSwapper& optimizer() const { return *optimizer_; }
  UpdateGate& gate() const { return *gate_; }  // the optimizer's progress, for the forward that overlaps it
  ParamCoordinator& coord() const { return *coord_; }
  // MemoryPlan::partition_params: the blocks' compute copies come from their owners (Note
  // [Gathered parameters] in block_gatherer.cpp); null otherwise.
  BlockGatherer* gatherer() const { return gatherer_.get(); }
  // With a group: the steps that cross ranks around the optimizer (engine/dist/data_parallel.h).
  dist::DataParallel* data_parallel() const { return data_parallel_.get(); }

 private:
  Status init_weights();

  TrainOptions opt_;
  RunModel model_;
  std::optional<ParamRegistry> registry_;
  MemoryPlan plan_;
  RunPlan run_plan_;
  gpu::GpuProbe probe_;  // the GPUs LibTorch can use (not probed for zoffload.device "host")
  std::string swap_dir_;

  // Declared before what uses them, so they are destroyed after it.
  mutable MemoryAccounting accounting_;
  std::unique_ptr<gpu::Device> device_;
  std::unique_ptr<io::IoEngine> io_;
  std::unique_ptr<io::FaultyEnv> faulty_env_;
  std::unique_ptr<cpu_optim::Executor> executor_;
  std::unique_ptr<StateStore> store_;
  std::unique_ptr<OptimizerSwapper> optimizer_;
  std::unique_ptr<ParamSwapper> param_swapper_;
  std::unique_ptr<UpdateGate> gate_;
  // Over a process group of its own (MemoryPlan::partition_params).
  std::unique_ptr<dist::ProcessGroup> param_group_;
  std::unique_ptr<BlockGatherer> gatherer_;
  std::unique_ptr<dist::DataParallel> data_parallel_;
  std::unique_ptr<ParamCoordinator> coord_;
};

}  // namespace zo::engine

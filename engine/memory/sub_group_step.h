// The update of one sub-group, apart from where its states live (OptimizerSwapper moves them):
// each optimizer's hyperparameters with their own check, the one table from (optimizer, moment
// dtype, master dtype, gradient dtype) to the kernel that steps such states on the CPU (cpu_optim)
// and on the device (gpu/optim_kernels.h), and the walk of a sub-group's pieces that calls it
// (Note [One table of optimizer kernels]). A SubGroupStep is immutable once created; several
// threads may use one on disjoint states.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>
#include <variant>

#include "common/status.h"
#include "cpu_optim/adagrad.h"
#include "cpu_optim/adam.h"
#include "cpu_optim/executor.h"
#include "cpu_optim/lion.h"
#include "engine/config/config.h"
#include "engine/memory/memory_plan.h"
#include "gpu/device.h"

namespace zo::engine {

// One optimizer's hyperparameters in its own struct: Adam's and AdamW's (adam_w_mode tells them
// apart), Lion's or Adagrad's.
using OptimizerHyperparameters = std::variant<cpu_optim::AdamConfig, cpu_optim::LionConfig, cpu_optim::AdagradConfig>;

// The hyperparameters optimizer.* of a config give at learning rate `lr` (the schedule's), in the
// struct of config.type (AdamW: adam_w_mode on).
OptimizerHyperparameters optimizer_hyperparameters(const OptimizerConfig& config, double lr);

// What every sub-group of one optimizer step is updated with.
struct UpdateArgs {
  OptimizerHyperparameters hyperparameters;
  int64_t step = 1;         // 1-based optimizer step (Adam's bias correction, the rounding keys)
  float grad_scale = 1.0f;  // 1/loss_scale × clip coefficient, applied as gradients are read
  // bf16 masters: the seed of their stochastic rounding (Note [Stochastic rounding to bf16]).
  uint64_t rounding_seed = 0;
};

// OK when `args` may step `optimizer`: the hyperparameters are that optimizer's struct and pass its
// own check (zo::check_adam_hyperparameters, cpu_optim::check_lion_config or
// check_adagrad_config), step ≥ 1 and grad_scale is finite. kInvalidArgument whose message starts
// with "<op>: " and names the value otherwise.
Status check_update_args(std::string_view op, OptimizerType optimizer, const UpdateArgs& args);

// A sub-group's states where a kernel reaches them, as group_state_bytes lays them out: host
// addresses (HostStates) or device ranges (DeviceStates). grad holds the placement's grad dtype,
// copy_out the compute dtype (null, or the master's own address: no copy-out, Note [A bf16 master
// is its compute copy]).
template <class Ptr, class ConstPtr>
struct GroupStates {
  Ptr master;
  Ptr exp_avg;
  Ptr exp_avg_sq;
  ConstPtr grad;
  Ptr copy_out;
};
using HostStates = GroupStates<std::byte*, const std::byte*>;
using DeviceStates = GroupStates<gpu::DevicePtr, gpu::DevicePtr>;

class SubGroupStep {
 public:
  // The kernels for `optimizer` over the states `placement` describes (moment, master, gradient
  // and compute dtypes), on the device when `on_device`. norm_run_elems: update_host's runs under
  // a fused norm (PipelineOptions::norm_run_elems). kUnavailable naming the optimizer when the
  // table has no kernel for them (Lion and Adagrad on the device).
  static Result<SubGroupStep> create(OptimizerType optimizer, const Placement& placement, bool on_device,
                                     uint64_t norm_run_elems);

  // Updates sub-group g of `registry` in host memory, on `executor`'s threads, and returns when it
  // is done. With fused_norm, also leaves Σ g² of its fp32 gradient there, with the bits of
  // cpu_optim::squared_norm_canonical, which first rewrites −0 and signalling NaNs in the gradient
  // (Note [Gradients that land where they are summed] in engine/coord/grad_accumulator.cpp): grad
  // must then be writable. The kernels' kInvalidArgument, naming the parameter where the sub-group
  // is stepped piece by piece.
  Status update_host(const ParamRegistry& registry, uint32_t g, const UpdateArgs& args, const HostStates& states,
                     const cpu_optim::Executor& executor, double* fused_norm) const;
  // Queues sub-group g's update on `stream` of `device` and returns; the same arithmetic, so the
  // states are update_host's bit for bit. Only for a SubGroupStep created on_device.
  Status update_device(const ParamRegistry& registry, uint32_t g, const UpdateArgs& args, const DeviceStates& states,
                       gpu::Device& device, gpu::Stream stream) const;

  struct Row;

 private:
  SubGroupStep() = default;
  const Row* main_ = nullptr;   // the states' own kernel
  const Row* small_ = nullptr;  // 8-bit moments: a small parameter's fp32 moments (Note [8-bit moment layout])
  MomentDtype moments_ = MomentDtype::kF32;
  DType master_dtype_ = DType::kF32;
  DType grad_dtype_ = DType::kF32;
  DType compute_dtype_ = DType::kBF16;
  uint64_t norm_run_elems_ = 0;
};

}  // namespace zo::engine

// The planner's step-time range (Note [Step-time range] in step_time.cpp): what one optimizer step
// asks of each resource — the GPU's FLOPs, PCIe's bytes each way, the host memory's bytes, the CPU
// kernels' elements, the drive's bytes — and how the schedule overlaps them. Pure functions.
#pragma once

#include <cstdint>
#include <string>

#include "common/status.h"
#include "engine/config/config.h"
#include "engine/memory/param_registry.h"
#include "engine/model/model_config.h"

namespace zo::engine {

struct RunPlan;
struct HostSpeeds;

// One of the host's passes over the trainable parameters: the gradient worker's (accumulate, norm,
// rounding) or the optimizer's.
struct HostPass {
  double elems = 0;        // elements through the kernel (0: the pass does no work of its own)
  double bytes = 0;        // host memory it reads and writes, counted as STREAM counts (no write-allocate)
  double kernel_rate = 0;  // the kernel's measured elements/s (0: not measured)
  std::string basis;       // which kernel was measured
};

// What one optimizer step is made of, from the plan (step_work in planner.cpp fills it).
struct StepWork {
  bool cuda = false;
  // Note [No accumulator]: the optimizer runs on the gradient worker during backward, and the next
  // forward waits for all of it (its first blocks are updated last). Otherwise the optimizer runs
  // after backward, beside the next step's first forward (Note [Overlapped optimizer]).
  bool optimizer_in_backward = false;
  double passes = 1;          // forward and backward passes a step (1 with the vertical schedule)
  double forward_flops = 0;   // every pass's forward
  double backward_flops = 0;  // the recomputed forward and the backward
  double h2d_min_bytes = 0, h2d_max_bytes = 0, d2h_bytes = 0;  // over PCIe (cuda only)
  double dma_host_bytes = 0;  // the copies' side in host memory: gradients landing, compute copies read
  HostPass gradients;
  HostPass optimizer;
  // The drive: the accumulators' share (moved during backward) and the optimizer's (pipelined with
  // it), read and written; the optimizer's reads with every compute copy read by every pass.
  double nvme_grad_read = 0, nvme_grad_write = 0;
  double nvme_opt_read = 0, nvme_opt_read_max = 0, nvme_opt_write = 0;
};

// What a step of `plan` (its memory plan, bytes per step, parameter counts) asks of each resource:
// the FLOPs of `config` on `model` at `seq_len`, the copies, the host's passes with the kernels'
// speeds from `speeds`; `n_passes` forward and backward passes; the accumulators' NVMe bytes.
StepWork step_work(const Config& config, const ModelConfig& model, const ModelLayout& layout,
                   const ParamRegistry& registry, uint64_t seq_len, uint64_t n_passes, const HostSpeeds& speeds,
                   bool cuda, uint64_t nvme_grad_read, uint64_t nvme_grad_write, const RunPlan& plan);

// Fills plan->compute_flops_per_step, time_parts, time_unknown, step_s_low and step_s_high from `work` at `speeds`.
void plan_step_time(const StepWork& work, const HostSpeeds& speeds, RunPlan* plan);

// Measures this host's Adam kernels (every master and moment dtype), the gradient kernel and the
// triad (about half a second) on the config's optimizer_threads; fills those fields of `speeds`.
Status measure_cpu_speeds(const Config& config, HostSpeeds* speeds);

}  // namespace zo::engine

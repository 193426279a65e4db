// StepMetrics: what one optimizer step did and where its time went, as metrics.jsonl, the progress
// line and the monitors report it; and StepCounters, the run's cumulative counters whose
// differences over a step fill most of it. Includes no LibTorch header.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include <nlohmann/json_fwd.hpp>

#include "engine/coord/block_gatherer.h"
#include "engine/coord/param_coordinator.h"
#include "engine/memory/accounting.h"
#include "gpu/device.h"

namespace zo::engine {

// One evaluation on the held-out data (TrainOptions::eval_data_path), after a step's update.
struct EvalMetrics {
  // Mean over the batches (of every rank) with a labelled target of their mean token loss; NaN when
  // none has one.
  double loss = 0;
  double perplexity = 0;  // exp(loss): inf past exp(709)
  uint64_t batches = 0;   // micro-batches evaluated, every rank's
  uint64_t tokens = 0;    // labelled targets in them
  double eval_s = 0;      // wall time, outside the step's step_s
};

// What one optimizer step did and where its time went (seconds of wall time).
struct StepMetrics {
  uint64_t step = 0;      // 1-based
  double loss = 0;        // mean over the micro-batches (of every rank) of their mean token loss
  double lr = 0;          // this step's lr (what the optimizer used, or would have when skipped)
  double loss_scale = 1;  // the scale this step's backward used
  double grad_norm = 0;   // global L2 norm of the unscaled gradients (inf/nan on overflow)
  bool skipped = false;   // overflow: no optimizer step
  uint64_t tokens = 0;    // tokens trained on in this step, by every rank (targets not masked)
  // Wall time of the step() call. The main thread's parts below add up to it; the optimizer runs
  // beside them on its own thread. A step's call also runs the next step's first forward (behind
  // its optimizer), so its parts include that forward's data, fetch and compute.
  double step_s = 0;
  double fetch_s = 0;           // blocked on parameter fetches (NVMe reads, H2D copies)
  double data_s = 0;            // reading and checking the batches
  double compute_s = 0;         // forward, recompute and backward (and the coordinator's bookkeeping)
  double grad_offload_s = 0;    // backward waiting on the gradient path: copies into the landing ring (D2H), a
                                // full ring, the last accumulation of each micro-step (the rest overlaps backward)
  double optimizer_wait_s = 0;  // the forward waiting for the optimizer's update of a block, and for its end
  // The gradient worker's time in the accumulator, on its thread beside backward: adding each
  // gradient (the cpu_optim kernels), the squared norms, reading device- or NVMe-resident
  // accumulators, writing device-resident ones and waiting for NVMe writes whose buffer it needs
  // (Note [Asynchronous accumulator writes]); with partitioned gradients grad_reduce_s too.
  double grad_worker_s = 0;
  // The optimizer's own time, on its thread (0 when skipped): the whole step with its I/O waits.
  double optimizer_s = 0;
  double nvme_read_wait_s = 0;   // of optimizer_s
  double nvme_write_wait_s = 0;  // of optimizer_s
  double nvme_busy_s = 0;        // the I/O engine had requests outstanding (all of the run's NVMe traffic)
  // The device's own time in this step (gpu::Device::busy, as the device ran the work: on a GPU,
  // from timing events): copying each way (PCIe), and running the blocks' forward and backward.
  double device_h2d_s = 0;
  double device_d2h_s = 0;
  double device_compute_s = 0;
  // device_compute_s / step_s: the GPU's busy fraction (on the emulated device, the host's compute).
  double device_busy = 0;
  // The longest of compute_s, device_compute_s, device_h2d_s, device_d2h_s, grad_worker_s,
  // optimizer_s and nvme_busy_s over step_s: near 1 when the step is as long as its busiest
  // resource (everything else hidden behind it), lower when parts wait on each other.
  double overlap = 0;
  MemoryStats memory;              // tiers after the step (peaks since the start of the run)
  uint64_t device_peak_bytes = 0;  // Device::stats().peak_allocated_bytes
  uint64_t device_budget_bytes = 0;
  // Of the device's resident bytes: the stage-3 coordinator's arena for fetched parameters (fixed at
  // start), the rest being the device-resident states.
  uint64_t device_arena_bytes = 0;
  // Data parallel: the payload bytes this rank passed to collectives this step (the gradients'
  // all-reduce or, partitioned, their reduce to the owners and the updated parameters' all-gather)
  // and the training thread's wall time in those at the boundary (part of step_s, outside the
  // parts above); 0 with one process.
  uint64_t collective_bytes = 0;
  double collective_s = 0;
  // Partitioned data parallel (ZeRO stage ≥ 1): sending this rank's updated compute copies to the
  // others and receiving theirs, beside the optimizer and the next forward (waits for the owners
  // included; optimizer_s lasts until the last copy arrived). At stage 3, where the compute copies
  // are partitioned too: gathering each block from its owners at every fetch, on the gatherer's
  // thread beside compute (waits for the owners included).
  double gather_s = 0;
  // ZeRO stage ≥ 2 with several ranks: reducing each micro-step's gradients to their owners, on the
  // gradient worker's thread beside backward (inside grad_offload_s where backward waited for it).
  double grad_reduce_s = 0;
  // Of collective_s: the first collective of the boundary, where this rank waits for the slowest
  // one to finish its micro-steps (the rest is the gradient all-reduce itself).
  double rank_wait_s = 0;
  // LibTorch's allocations (activations, autograd buffers, block gradients) at their highest during
  // this step: on CUDA GPU memory outside the budget above, on the emulated device host RAM.
  uint64_t torch_peak_bytes = 0;
  // What the OS and the device measured, beside the engine's own accounting in `memory`: this
  // process's resident set at its highest since it started (VmHWM), and the host bytes the device
  // holds pinned now (Device::stats, allocate_pinned: the pinned pool and the activation checkpoint
  // slab).
  uint64_t process_peak_rss_bytes = 0;
  uint64_t device_pinned_bytes = 0;
  // The evaluation run after this step's update, when one was due.
  std::optional<EvalMetrics> eval;
  // Why that evaluation failed (then `eval` is empty): the step itself is complete and recorded, so
  // the caller saves it before it stops (Note [Evaluation] in engine/train/evaluator.cpp). Not
  // recorded.
  Status eval_error;

  // The record of metrics.jsonl (one line of it: record().dump()), which the monitors write too.
  nlohmann::json record() const;
  std::string to_json() const;
};

// The run's counters that only grow, read at a step's start and end (StepLoop::counters).
struct StepCounters {
  CoordinatorStats coord;                      // fetch and update waits; arena_bytes (fixed)
  double ready_wait_s = 0;                     // the trainer's own waits for a block's copies
  double io_busy_s = 0;                        // IoEngine::stats().busy_s
  gpu::DeviceBusy device;                      // Device::busy()
  uint64_t collective_bytes = 0;               // the process group's (0 with one process)
  double collective_s = 0;                     // the process group's
  std::optional<BlockGathererStats> gathered;  // stage 3 across ranks: the block gatherer's
};

// Fills what `out` derives from the counters: fetch_s, the coordinator's share of optimizer_wait_s
// (added to the join time already there), nvme_busy_s, the device's times and busy fraction,
// collective_bytes (the gatherer's included), gather_s at stage 3 (the gatherer's; otherwise the
// caller's is kept), device_arena_bytes, and then compute_s (the rest of step_s) and overlap. `out`
// holds the step's own times already: step_s, data_s, grad_offload_s, grad_worker_s, optimizer_s,
// collective_s and the optimizer's join in optimizer_wait_s.
void add_counter_deltas(const StepCounters& before, const StepCounters& after, StepMetrics* out);

}  // namespace zo::engine

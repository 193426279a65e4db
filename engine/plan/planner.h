// The planner: what a run of a config on a model needs — bytes per tier, bytes moved per step, a
// step-time range — and whether it fits this machine, computed before anything is allocated from the
// same code the engine allocates with (ParamRegistry::build, plan_memory, plan_arena). `zoffload
// plan` prints it; the trainer prints its summary and refuses a plan that cannot fit. Pure
// functions; thread-safe.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "common/status.h"
#include "engine/config/config.h"
#include "engine/coord/param_coordinator.h"
#include "engine/memory/memory_plan.h"
#include "engine/model/model_config.h"
#include "engine/plan/step_time.h"  // measure_cpu_speeds, the step-time range

namespace zo::engine {

// The machine the plan is checked against (HostFacts::probe reads this one; tests make their own).
struct HostFacts {
  uint64_t ram_total_bytes = 0;
  uint64_t ram_available_bytes = 0;           // MemAvailable
  uint64_t memlock_limit_bytes = UINT64_MAX;  // ulimit -l; UINT64_MAX: unlimited
  bool can_lock_unlimited = false;            // CAP_IPC_LOCK: the limit does not apply
  uint64_t process_bytes = 0;                 // RSS of a process with LibTorch loaded, before the run allocates
  // Note [Address space]: ulimit -v (RLIMIT_AS; UINT64_MAX: unlimited) limits what the process maps,
  // resident or not: LibTorch's libraries, every allocation, each thread's stack and each malloc
  // arena a thread opens. The address space of this process at plan time (VmSize, LibTorch loaded),
  // the stack a thread reserves and the CPUs (threads and arenas scale with them).
  uint64_t address_space_limit_bytes = UINT64_MAX;
  uint64_t process_virtual_bytes = 0;
  uint64_t thread_stack_bytes = uint64_t{8} << 20;
  unsigned logical_cpus = 1;
  uint64_t malloc_arena_max = UINT64_MAX;  // MALLOC_ARENA_MAX when set, else no cap beyond glibc's own
  bool cuda = false;                       // the run's device is a GPU (else the emulated device on the host)
  std::string device_name;                 // "NVIDIA H100 80GB HBM3", or "host (emulated)"
  uint64_t device_total_bytes = 0;         // the GPU's memory (cuda), else RAM
  // Free space of the file systems the swap files go to (0: not known, e.g. the path does not exist).
  uint64_t optimizer_disk_free_bytes = 0;
  uint64_t param_disk_free_bytes = 0;
};

// One data-parallel rank's share of a node that `local_ranks` ranks start on together: 1/local_ranks
// of its RAM and of the free space of its disks (and, emulated, of the device's RAM); a GPU is its
// rank's own. What `zoffload train` plans each rank with, and `zoffload plan --ranks`.
void share_host(HostFacts* host, uint32_t local_ranks);

// Measured speeds the step-time range is computed from; 0 = not known (that part is left out and
// the plan says so).
struct HostSpeeds {
  double nvme_read_bytes_per_s = 0;
  double nvme_write_bytes_per_s = 0;
  std::string nvme_source;                   // "zoffload-bench io results FILE"
  double adam_elems_per_s = 0;               // cpu_optim Adam on the optimizer's threads, measured
  double adam8bit_elems_per_s = 0;           // the same with 8-bit moments (zoffload.moment_dtype "8bit")
  double adam_bf16_moments_elems_per_s = 0;  // the same with bf16 moments (zoffload.moment_dtype "bf16")
  // With bf16 masters (zoffload.master_dtype "bf16"), by moment dtype: fp32, bf16, 8-bit. 0 where not
  // measured: the kernel with fp32 masters stands for it, and the plan says so.
  double bf16_master_elems_per_s[3] = {0, 0, 0};
  double accumulate_elems_per_s = 0;  // the gradient accumulator's kernel plus its norm, measured
  double compute_flops = 0;           // dense matmul FLOP/s in the compute dtype
  std::string compute_source;         // "measured: LibTorch matmul on the host", "--gpu-tflops 800", ...
  // The FLOP/s a measured step's device compute reached (its FLOPs over its device time), below the
  // matmul rate: the step-time range's high end (Note [Step-time range]). 0: the matmul rate.
  double compute_step_flops = 0;
  std::string compute_step_source;
  double pcie_bytes_per_s = 0;  // host↔GPU copies each way (cuda only)
  std::string pcie_source;
  // STREAM's triad on the optimizer's threads, bytes/s as STREAM counts them: the host's memory
  // as one resource of the step (Note [Step-time range]).
  double host_triad_bytes_per_s = 0;
  std::string host_triad_source;
  // The kernels' speeds were measured on another host and scaled to this triad: the low end takes
  // a host pass at its bytes over the triad, not at the scaled kernel's speed.
  bool kernels_scaled = false;
};

struct PlanInputs {
  Config config;  // resolved (flags applied)
  ModelConfig model;
  std::string model_name;            // for messages: the --model argument
  uint64_t seq_len = 0;              // tokens per sequence
  uint64_t device_budget_bytes = 0;  // what the device is given: gpu_memory_limit, else its memory
  std::string out_dir;               // relative nvme paths resolve against it
  HostFacts host;
  HostSpeeds speeds;
  // Data parallel: the registry is cut into world_size partitions (Note [Partitions]) and, at ZeRO
  // stage ≥ 1, this rank holds the states of partition `rank` only (plan_memory). host is already
  // this rank's share of the node.
  // The free space of the drives is the user's (zoffload plan --disk-free), not probed: the fixes
  // keep it when they move a swap file instead of probing the path they would use.
  bool disk_free_given = false;
  uint32_t world_size = 1;
  uint32_t rank = 0;
};

// A shortfall: what does not fit, how much it needs and how much there is.
struct PlanProblem {
  std::string resource;  // "GPU memory", "pinned memory (ulimit -l)", "RAM", "disk at <path>", ...
  uint64_t need_bytes = 0;
  uint64_t have_bytes = 0;
  std::string detail;  // what makes up the need, and which key sets the limit
  std::string to_string() const;
};

// A change to the config that makes the plan fit, checked by planning again with it.
struct PlanFix {
  std::vector<std::string> changes;  // "zero_optimization.offload_optimizer.device: nvme", ...
  std::string result;                // the re-planned summary
  std::string trade;                 // what it does to the numbers: "exact: ..." or what rounds
  // The keys it sets, as the JSON object to merge into the config file (compact JSON text):
  // {"zoffload":{"master_dtype":"bf16","moment_dtype":"8bit"}}.
  std::string config_json;
};

struct StepTimePart {
  std::string name;  // compute, pcie, gradients, optimizer, host memory, nvme grads, nvme optim
  double seconds = 0;       // at the slower rates (the step's compute rate, the kernel or the triad)
  std::string basis;        // how it was computed
  double seconds_low = 0;   // at the faster ones (the matmul rate, the kernel as measured)
};

struct RunPlan {
  uint64_t n_params = 0;
  uint64_t n_trainable = 0;  // of n_params, not frozen (zoffload.freeze): the ones with gradients and states
  uint64_t tokens_per_micro_step = 0;
  MemoryPlan memory;
  ArenaPlan arena;

  // Device (the GPU, or the emulated device's budget on the host).
  uint64_t device_budget_bytes = 0;
  uint64_t device_state_bytes = 0;  // states resident on the device
  uint64_t device_arena_bytes = 0;  // the coordinator's arena: wanted, capped by the budget left
  // LibTorch's activations, autograd buffers and one block's gradients at their peak
  // (Note [Activation estimate]); on the GPU with CUDA, in host RAM on the emulated device.
  uint64_t activation_bytes = 0;
  uint64_t held_micro_batches = 1;  // micro-batches whose checkpoints are held at once (vertical: GAS)
  // zoffload.activation_checkpoints as resolved (Note [Checkpoints on the CPU]): the decoder layers'
  // checkpoints wait in pinned host memory, `checkpoint_host_bytes` of it (allocated at start).
  bool checkpoints_on_host = false;
  uint64_t checkpoint_host_bytes = 0;
  uint64_t device_total_bytes = 0;          // states + arena (+ activations on CUDA)
  uint64_t device_torch_reserve_bytes = 0;  // the budget left to LibTorch: its activations on CUDA, else 0

  // Host.
  uint64_t pinned_bytes = 0;  // the pinned pool (0 when both pin_memory flags are false) + host checkpoints
  uint64_t pool_bytes = 0;    // the pool, pinned or not
  uint64_t pageable_state_bytes = 0;
  uint64_t host_buffer_bytes = 0;  // scratch, gradient staging and data-parallel staging buffers
  uint64_t grad_ring_bytes = 0;    // the gradient worker's landing ring (in the pool)
  uint64_t ram_bytes = 0;          // pool + pageable states + buffers + host checkpoints (+ activations on the host)
  uint64_t process_bytes = 0;      // LibTorch and the program itself (measured at plan time)
  // The address space the run maps (Note [Address space]): the process at plan time + what the plan
  // allocates (+ the emulated device's bytes) + the threads' stacks and malloc arenas (estimated).
  uint64_t address_space_bytes = 0;
  uint64_t thread_reserve_bytes = 0;  // of address_space_bytes: the threads' stacks and arenas

  // NVMe: the swap files.
  uint64_t nvme_optimizer_bytes = 0;
  uint64_t nvme_param_bytes = 0;

  // Extra RSS of a checkpoint save and of an export (their staging buffer).
  uint64_t save_rss_bytes = 0;
  uint64_t export_rss_bytes = 0;

  // Bytes moved per optimizer step (gradient_accumulation_steps micro-steps).
  uint64_t nvme_read_bytes = 0;  // exact when nvme_exact, else the range below
  uint64_t nvme_write_bytes = 0;
  bool nvme_exact = true;  // false when compute copies on NVMe are re-read (coordinator caching)
  uint64_t nvme_read_min_bytes = 0, nvme_read_max_bytes = 0;
  uint64_t h2d_min_bytes = 0, h2d_max_bytes = 0;  // compute copies to the device (fetch caching decides)
  uint64_t d2h_bytes = 0;                         // gradients leaving the device (CUDA)

  // Note [Step-time range] (step_time.cpp): the low end is every overlap perfect (the longest
  // resource, and what the schedule cannot overlap), the high end only the overlap the schedule
  // builds in.
  double compute_flops_per_step = 0;  // the FLOPs the range's compute part counts
  std::vector<StepTimePart> time_parts;
  double step_s_low = 0;
  double step_s_high = 0;
  std::vector<std::string> time_unknown;  // parts left out for want of a measured speed

  std::vector<PlanProblem> problems;  // empty: it fits
  std::vector<std::string> notes;     // assumptions worth a line

  bool fits() const { return problems.empty(); }
  // One line: params, device, pinned, RAM, NVMe, step-time range, fits or not.
  std::string summary() const;
  std::string to_json() const;  // every field above, one JSON object
};

// The layout a run trains, the one the trainer and the planner both build: with zoffload.lora, sets
// model->lora (lora_spec; read_peft_adapter_config must have resolved init_from) and freezes every
// param but the adapters; then model_layout(*model) with zoffload.freeze applied (freeze_params).
Result<ModelLayout> training_layout(ModelConfig* model, const Config& config);
// The order backward hands gradients to the accumulators: the blocks last to first, each block's
// trainable params in its order (a tied embedding in both of its blocks; no frozen param).
std::vector<uint32_t> contribution_order(const ModelLayout& layout);

// The gradient worker's landing ring (engine/coord/grad_worker.h): the largest block's gradients
// (of its trainable params) in `dtype`, so that one block's gradients are accumulated while the
// next block's backward computes; with shared_only, of the params used by more than one block
// (a tied matrix), the others landing where they are summed (Note [Gradients that land where they
// are summed] in engine/coord/grad_accumulator.cpp). At least kMinGradRingBytes.
inline constexpr uint64_t kMinGradRingBytes = 4096;
uint64_t grad_ring_bytes(const ModelLayout& layout, const ParamRegistry& registry, DType dtype,
                         bool shared_only = false);
// plan_memory, with the landing ring (grad_ring_bytes in grad_transfer_dtype) in the pinned pool:
// the plan the trainer allocates and the planner reports.
Result<MemoryPlan> plan_memory_with_ring(const Config& c, const ParamRegistry& registry, const ModelLayout& layout,
                                         std::optional<uint32_t> owned_partition = std::nullopt);
// The dtype gradients leave the device in: the compute dtype, or grad_accum_dtype when the
// vertical schedule sums several micro-batches on the device first (Note [Vertical schedule]).
DType grad_transfer_dtype(const Config& c);
// Micro-batches one forward and backward carry: gradient_accumulation_steps with the vertical
// schedule, else 1.
uint64_t vertical_micro_batches(const Config& c);
// Bytes of one micro-batch's activation checkpoints that can wait on the host: every decoder
// layer's input (micro_batch × seq_len × hidden in the compute dtype).
uint64_t host_checkpoint_bytes_per_micro_batch(const Config& c, const ModelConfig& m, uint64_t seq_len);

// "by whole blocks, N elements ahead: stage3_prefetch_bucket_size B cannot hold the largest param
// (M elements)": the start line's and the plan's words for ArenaPlan::prefetch_by_blocks.
std::string prefetch_by_blocks_text(const ArenaPlan& arena, uint64_t configured_bucket_elems);

// A config path relative to the run directory `out_dir` (absolute paths and an empty out_dir as
// given), normalised: where train puts nvme_path, checkpoint.dir and metrics, and where plan looks.
std::string resolve_run_path(const std::string& out_dir, const std::string& path);

// A config.json can claim any size: kInvalidArgument naming the sizes when the model's parameter
// count overflows or exceeds what any plan could hold, checked before anything is built from it
// (model_layout and ParamRegistry::build allocate in proportion to the claimed model).
Status check_model_size(const ModelConfig& model);

// Plans `in`. Errors are the engine's own for an impossible config (plan_memory's, a sub_group_size
// below the minimum, a model with absurd sizes: kInvalidArgument naming the key); a plan that
// merely does not fit this machine is returned with its problems.
Result<RunPlan> plan_run(const PlanInputs& in);

// This machine's facts for `config` (RAM, ulimit -l, free disk at the resolved nvme paths); the
// device fields are the caller's (it knows which device the run gets).
HostFacts probe_host(const Config& config, const std::string& out_dir);


// Reads `zoffload-bench io --json` output: the read and write GB/s of the row measured with the
// config's aio settings and io_backend ("auto": the backend the benchmark says auto picks), else
// of the best row; nvme_source says which.
Status read_io_results(const std::string& path, const Config& config, HostSpeeds* speeds);

}  // namespace zo::engine

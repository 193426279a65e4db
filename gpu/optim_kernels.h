// The device's optimizer kernels, beside the Device interface rather than in it: the arguments of
// each kernel, and per backend a table (OptimKernels) of the functions that queue them on one of
// its streams. A new state format adds its arguments, a member of OptimKernels and each backend's
// function; Device stays memory, streams and copies. Thread-safe like Device.
#pragma once

#include <cstdint>

#include "common/adam_math.h"
#include "common/status.h"
#include "gpu/device.h"

namespace zo::gpu {

// One Adam/AdamW step over n_elems device-resident elements, for OptimKernels::adam_step. The buffers
// are device ranges of n_elems elements each (of the dtype named beside them) that must not overlap.
struct DeviceAdamArgs {
  DevicePtr params;  // the masters, param_dtype, updated in place
  // kF32, or kBF16: bf16 masters, widened exactly and stored with stochastic rounding, element i
  // drawing sr_random16(sr_key, sr_first + i) (Note [Stochastic rounding to bf16] in common/half.h);
  // copy_out, if any, must then be bf16 and gets the same bits.
  DType param_dtype = DType::kF32;
  uint32_t sr_key = 0;
  uint32_t sr_first = 0;
  DevicePtr exp_avg;                 // first moment, moment_dtype, updated in place
  DevicePtr exp_avg_sq;              // second moment, moment_dtype, updated in place
  DType moment_dtype = DType::kF32;  // kF32, or kBF16 (widened exactly, stored rounded to nearest even)
  DevicePtr grad;                    // read only, grad_dtype (fp32, bf16 or fp16)
  DType grad_dtype = DType::kF32;
  float grad_scale = 1.0f;  // 1/loss_scale × clip coefficient, applied to each gradient as it is read
  DevicePtr copy_out;       // null: none; else receives the new params as copy_dtype (round to nearest even)
  DType copy_dtype = DType::kBF16;
  uint64_t n_elems = 0;
  AdamConfig config;  // common/adam_math.h: the same hyperparameters cpu_optim::adam_step takes
  int64_t step = 1;   // 1-based step number of this update
};

// One step of Adam/AdamW with 8-bit blockwise moments over n_elems device-resident elements, for
// OptimKernels::adam8bit_step: each moment is n_elems codes into bitsandbytes' dynamic map
// (common/dynamic_maps.h: the signed one for exp_avg, the unsigned one for exp_avg_sq) and one fp32
// absmax per block of 256 elements, the last block partial (cpu_optim::BlockwiseState). Ranges must
// not overlap.
struct DeviceAdam8bitArgs {
  DevicePtr params;  // param_dtype (fp32, or bf16 with sr_key / sr_first as in DeviceAdamArgs)
  DType param_dtype = DType::kF32;
  uint32_t sr_key = 0;
  uint32_t sr_first = 0;
  DevicePtr m_codes;   // n_elems bytes
  DevicePtr m_absmax;  // ⌈n_elems / 256⌉ fp32
  DevicePtr v_codes;
  DevicePtr v_absmax;
  DevicePtr grad;
  DType grad_dtype = DType::kF32;
  float grad_scale = 1.0f;
  DevicePtr copy_out;
  DType copy_dtype = DType::kBF16;
  uint64_t n_elems = 0;
  AdamConfig config;
  int64_t step = 1;
};

// One backend's optimizer kernels. Each validates its arguments (device ranges must lie inside one
// live allocation of `device`: InvalidArgument otherwise, and nothing is queued), queues the kernel
// on `stream` and returns at once, as Device's asynchronous operations do. `device` must be of the
// backend the table was taken for (optim_kernels(device)). Kernels move no bytes in stats().
struct OptimKernels {
  // One Adam step (see DeviceAdamArgs): every element runs zo::adam_update (common/adam_math.h)
  // with the constants of zo::adam_constants(config, step, grad_scale), so the params, moments and
  // copy-out are bit-identical to cpu_optim::adam_step on the same inputs, on every backend (NaN
  // payloads aside). InvalidArgument, with nothing queued, when step < 1, a hyperparameter is out
  // of cpu_optim's ranges, grad_scale is not finite, a dtype is unknown, a range is not inside one
  // live allocation or two ranges overlap. n_elems == 0 queues nothing.
  Status (*adam_step)(Device& device, const DeviceAdamArgs& args, Stream stream);
  // One step of Adam with 8-bit blockwise moments (see DeviceAdam8bitArgs): every element
  // dequantizes its moments and runs zo::adam8bit_update, then each block's absmax is the largest
  // non-NaN |moment| (0 if none) and each code zo::nearest_map_entry of moment/absmax
  // (common/adam_math.h), so the bits equal cpu_optim::adam8bit_step's (and
  // adam8bit_step_bf16_master's) on the same inputs, on every backend. InvalidArgument as for
  // adam_step. n_elems == 0 queues nothing.
  Status (*adam8bit_step)(Device& device, const DeviceAdam8bitArgs& args, Stream stream);
};

// The kernels of `device`'s backend, found by its kind.
const OptimKernels& optim_kernels(const Device& device);

}  // namespace zo::gpu

// AdamW with 8-bit blockwise moments, computed as bitsandbytes' AdamW8bit computes them on the CPU
// (bitsandbytes 0.50.2, backends/cpu/ops.py): each moment is a byte per element indexing one of
// bitsandbytes' dynamic maps (signed for exp_avg, unsigned for exp_avg_sq) times one fp32 absmax
// per block of 256 elements; a step dequantizes, updates in fp32 in bitsandbytes' operation order
// and re-quantizes each block. One deliberate difference: re-quantization takes the nearest map
// entry (ties to the lower index), as bitsandbytes' CUDA kernels do; its CPU library looks entries
// up through an approximate table that, near zero, often returns a farther one (docs/cpu_optim.md,
// "Adam with 8-bit moments"). Scalar, AVX2 and AVX-512 paths give the same bits. Stateless; spans of
// one call must not overlap.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>

#include "common/adam_math.h"
#include "common/status.h"
#include "cpu_optim/dtype.h"
#include "cpu_optim/executor.h"

namespace zo::cpu_optim {

inline constexpr size_t kQuantBlockElems = 256;

// Blocks (absmax entries) of an n-element state: the last one may be partial.
inline constexpr size_t quant_block_count(size_t n) { return (n + kQuantBlockElems - 1) / kQuantBlockElems; }

// bitsandbytes' create_dynamic_map(signed=true) and (signed=false), ascending, bit for bit.
const std::array<float, 256>& signed_dynamic_map();
const std::array<float, 256>& unsigned_dynamic_map();

// The index of the entry of `map` (ascending) nearest x, the lower one on a tie; 0 for NaN: the
// kernels' rule for one value (through the scalar path; for tests and one-off values). A map other
// than the two above gets its table built on each call, and aborts the process if its entries are
// too dense for the table's buckets (Note [Nearest codes by bucket] in adam8bit.cpp).
uint8_t quantize_nearest(const std::array<float, 256>& map, float x);

// One 8-bit blockwise state of n elements: element i is map[codes[i]] * absmax[i / 256].
// All-zero codes and absmax are the zero state, a fresh optimizer's.
struct BlockwiseState {
  std::span<uint8_t> codes;  // n
  std::span<float> absmax;   // quant_block_count(n)
};

// One Adam step on n = params.size() elements. Per element, with g = grad * grad_scale,
// m and v dequantized, and the constants derived in double and rounded once to float
// (c1 = 1 - beta1^step, c2 = sqrt(1 - beta2^step); 1 without bias correction):
//   if (!adam_w_mode && wd > 0) g = fma(p, wd, g)      L2 decay (bitsandbytes' Adam8bit decouples it)
//   m = fma(g, 1-beta1, m*beta1) ;  v = fma((1-beta2)*g, g, v*beta2)
//   p = p * (1 - lr*wd)                                 (adam_w_mode && wd > 0)
//   p = (-lr/c1 * m) / (sqrt(v)/c2 + eps) + p
// then each block's absmax is the largest |m| (|v|) that is not NaN (0 if none) and each code the
// nearest entry to m / absmax. `grad` has n elements of fp32/bf16/fp16; `copy_out`, if its data is
// non-null, receives the new parameters (as adam_step's). Results depend on neither the thread
// count nor the ISA. Fails with kInvalidArgument (sizes differ, null data with n > 0, step < 1, a
// hyperparameter out of range); then nothing was written.
Status adam8bit_step(const AdamConfig& config, int64_t step, std::span<float> params, BlockwiseState exp_avg,
                     BlockwiseState exp_avg_sq, ConstElemSpan grad, float grad_scale, ElemSpan copy_out,
                     const Executor& executor);

// The step with bf16 masters (Bf16Master; adam_step_bf16_master's rules).
Status adam8bit_step_bf16_master(const AdamConfig& config, int64_t step, Bf16Master params, BlockwiseState exp_avg,
                                 BlockwiseState exp_avg_sq, ConstElemSpan grad, float grad_scale, ElemSpan copy_out,
                                 const Executor& executor);

}  // namespace zo::cpu_optim

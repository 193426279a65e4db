// Vectorized helpers on spans that go with the optimizer step: dtype conversion, gradient
// accumulation, the squared L2 norm of a gradient (for global-norm clipping and overflow checks), a parallel fill (first
// touch), the STREAM triad and a same-mix roofline pass used as bandwidth baselines. All run on an Executor's threads
// and SIMD path; thread-safe as long as callers don't share the output buffers.
#pragma once

#include <cstddef>
#include <span>

#include "common/status.h"
#include "cpu_optim/dtype.h"
#include "cpu_optim/executor.h"

namespace zo::cpu_optim {

// dst[i] = src[i] converted (fp32/bf16/fp16 in any direction; narrowing rounds to nearest even,
// 16→16 goes through fp32 exactly). n_elems elements; src and dst must not overlap.
Status convert(ConstElemSpan src, ElemSpan dst, size_t n_elems, const Executor& executor);

// acc[i] = acc[i] + grad[i]: one fp32 add per element (acc and grad fp32/bf16/fp16, read as fp32),
// rounded to acc's dtype (nearest even). The same bits on every ISA and thread count as the scalar
// definition. from_zero: acc's old contents are ignored (not read) and the add is to +0. n_elems
// elements; acc and grad must not overlap. The gradient accumulator's kernel.
Status accumulate(ElemSpan acc, ConstElemSpan grad, size_t n_elems, bool from_zero, const Executor& executor);

// Σ grad[i]² accumulated in double. Deterministic: the same bits for any thread count and every ISA
// (fixed 16-lane accumulation per tile, tiles summed in order; see docs/cpu_optim.md). Inf or NaN
// in the input gives inf or NaN.
Result<double> squared_norm(ConstElemSpan grad, size_t n_elems, const Executor& executor);

// squared_norm of fp32 values, which first rewrites each −0 and signalling NaN among them as
// 0 + x (+0, the NaN quieted): what accumulate from zero would have written. Tile by tile, so the
// values are rewritten in the pass that reads them for the norm, with the norm's bits unchanged.
// kInvalidArgument for another dtype. (Note [Gradients that land where they are summed] in
// engine/coord/grad_accumulator.cpp.)
Result<double> squared_norm_canonical(ElemSpan grad, size_t n_elems, const Executor& executor);
// The same, leaving each tile's sum in tile_sums[i] (at least ⌈n_elems / kTileElems⌉ of them)
// instead of adding them: squared_norm_canonical adds them in order. Called on consecutive runs of
// a longer array whose offsets are multiples of kTileElems, it gives that array's tile sums.
Status squared_norm_canonical_tiles(ElemSpan grad, size_t n_elems, std::span<double> tile_sums,
                                    const Executor& executor);

// data[i] = value, written by the threads and partition that later steps use (NUMA first touch).
void fill(std::span<float> data, float value, const Executor& executor);

// STREAM triad a[i] = b[i] + scalar * c[i] with this executor's threads and SIMD path; the
// bandwidth baseline of `zoffload-bench adam`. Sizes must match.
Status stream_triad(std::span<float> a, std::span<const float> b, std::span<const float> c, float scalar,
                    const Executor& executor);

// A memory roofline pass with a kernel's stream mix, built as the kernels are (the executor's SIMD
// path, threads, tiles and tail handling) but with one add per element: each of the rw.size() fp32
// streams (at most 3) is read and written in place, rw[j][i] += float(ro[i]), and `ro` is read.
// Mixes: the gradient accumulator (one fp32 accumulator, the gradient), the squared norm (no
// written stream, the accumulator read), Adam (master and moments, the gradient). With no written
// stream it returns Σ float(ro[i]) (order unspecified), else 0. The baseline of
// `zoffload-bench grad`. kInvalidArgument for more than 3 streams or a null pointer.
Result<double> roofline_pass(std::span<float* const> rw, ConstElemSpan ro, size_t n_elems, const Executor& executor);

}  // namespace zo::cpu_optim

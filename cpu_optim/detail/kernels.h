// Internal: the per-ISA kernel table and the argument blocks its kernels take. Every field is
// computed once per call in optimizers.cpp, so all ISA paths see identical constants.
// Kernels process the element range [begin, end) of one tile; no intrinsics here.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/adam_math.h"
#include "cpu_optim/dtype.h"
#include "cpu_optim/isa.h"

namespace zo::cpu_optim::detail {

// The parameters a kernel updates: fp32 masters, or bf16 masters stored with stochastic rounding
// (Note [Stochastic rounding to bf16] in common/half.h): element i of the call draws
// sr_random16(sr_key, sr_first + i). A bf16 master's copy-out, if any, is bf16: the same bits.
struct ParamArgs {
  void* params;
  DType param_dtype;  // kF32 or kBF16
  uint32_t sr_key;
  uint32_t sr_first;
};

struct AdamArgs {
  ParamArgs p;
  void* exp_avg;  // moment_dtype each: fp32, or bf16 (widened exactly, stored rounded to nearest even)
  void* exp_avg_sq;
  DType moment_dtype;
  const void* grad;
  DType grad_dtype;
  void* copy_out;  // nullptr: none
  DType copy_dtype;
  AdamConstants k;  // zo::adam_constants(), the same call gpu::OptimKernels::adam_step makes
};

struct AdagradArgs {
  ParamArgs p;
  void* exp_avg_sq;  // state_dtype: fp32, or bf16 (widened exactly, stored rounded to nearest even)
  DType state_dtype;
  const void* grad;
  DType grad_dtype;
  void* copy_out;
  DType copy_dtype;
  float grad_scale;
  float eps;
  float neg_lr;
  float weight_decay;
  bool use_decay;
};

struct LionArgs {
  ParamArgs p;
  void* exp_avg;  // state_dtype: fp32, or bf16 (widened exactly, stored rounded to nearest even)
  DType state_dtype;
  const void* grad;
  DType grad_dtype;
  void* copy_out;
  DType copy_dtype;
  float grad_scale;
  float beta1, one_minus_beta1;
  float beta2, one_minus_beta2;
  float lr;           // |u| = lr
  float after_decay;  // 1 - lr*wd
  bool use_decay;
};

// 8-bit blockwise Adam (cpu_optim/adam8bit.h): its per-call constants (common/adam_math.h).
using ::zo::Adam8bitConstants;

// Nearest map entries by bucket (Note [Nearest codes by bucket] in cpu_optim/adam8bit.cpp). A float
// x falls in bucket bits(x) >> 16: its sign, exponent and the top 7 bits of its mantissa, so a
// bucket is one shift and every bit pattern has one (inf and NaN included). Each bucket holds at
// most one threshold of its map, and all its x share their bits above bit 16, so "x is at or past
// the threshold" is a compare of x's low 16 bits (inverted for a negative x, whose order they
// reverse) with the threshold's. Each bucket's entry packs that 16-bit threshold key t (0x10000:
// none) and the nearest entry c of the bucket's smallest x as (t << kQuantCodeBits) | (c + 1); the
// nearest entry of x is then the low byte of c + 1 - (key(x) < t). The one bucket of +inf and the
// NaNs just above it has c + 1 = 256 and t = 1 (+inf: 255; those NaNs: 256, whose low byte is 0),
// the other NaN buckets and -inf's give 0.
inline constexpr int kQuantBuckets = 1 << 16;
inline constexpr int kQuantCodeBits = 9;                // c + 1 <= 256
inline constexpr uint32_t kQuantNoThreshold = 0x10000;  // above every 16-bit key
struct QuantTable {
  alignas(64) uint32_t entry[kQuantBuckets];
};
// Builds the table of an ascending 256-entry map; aborts if a bucket would hold two thresholds
// (cpu_optim/adam8bit.cpp). 256 KiB: keep it off the stack.
void build_quant_table(const float* map, QuantTable& table);
// The tables of the two dynamic maps, built once (cpu_optim/adam8bit.cpp).
const QuantTable& signed_map_quant_table();
const QuantTable& unsigned_map_quant_table();

// A kernel call covers whole 256-element blocks: begin is a multiple of 256 (end may cut the last).
struct Adam8bitArgs {
  ParamArgs p;
  uint8_t* m_codes;
  float* m_absmax;
  uint8_t* v_codes;
  float* v_absmax;
  const float* m_map;         // 256 entries, ascending (the signed dynamic map)
  const float* v_map;         // (the unsigned one)
  const QuantTable* m_quant;  // the nearest-entry tables of m_map and v_map
  const QuantTable* v_quant;
  const void* grad;
  DType grad_dtype;
  void* copy_out;  // nullptr: none
  DType copy_dtype;
  Adam8bitConstants k;
};
inline constexpr size_t kQuantBlock = 256;

// Lion or Adagrad with their one state 8-bit blockwise, as bitsandbytes' Lion8bit and Adagrad8bit
// keep it (cpu_optim/adam8bit.h): codes into the signed dynamic map (bitsandbytes' qmap1 for both)
// and one absmax per block. The update is bitsandbytes' CPU order (docs/cpu_optim.md). Whole blocks
// per call, as Adam8bitArgs.
struct OneState8bitArgs {
  ParamArgs p;
  uint8_t* codes;
  float* absmax;
  const float* map;         // the signed dynamic map
  const QuantTable* quant;  // its nearest-entry table
  const void* grad;
  DType grad_dtype;
  void* copy_out;  // nullptr: none
  DType copy_dtype;
  bool lion;  // else Adagrad
  float grad_scale;
  // Lion: fp32 constants from double, as bitsandbytes' Python hands them to torch.
  float beta1, one_minus_beta1, beta2, one_minus_beta2;
  float lr;           // |u| = lr
  float after_decay;  // 1 - lr*wd (Lion's decoupled decay), used when use_decay
  // Adagrad: d = g + wd*p (always, as bitsandbytes), s += d*d, p += -lr*g/(sqrt(s) + eps).
  float eps, neg_lr, weight_decay;
  bool use_decay;
};

// Number of double accumulators of the squared norm; element i of a tile goes to lane i % 16.
inline constexpr size_t kNormLanes = 16;

// Most read-and-written fp32 streams of a roofline pass (Adam's master and two moments).
inline constexpr size_t kMaxRooflineRw = 3;

struct KernelTable {
  Isa isa;
  void (*adam)(const AdamArgs& args, size_t begin, size_t end);
  void (*adagrad)(const AdagradArgs& args, size_t begin, size_t end);
  void (*lion)(const LionArgs& args, size_t begin, size_t end);
  void (*convert)(const void* src, DType src_dtype, void* dst, DType dst_dtype, size_t begin, size_t end);
  // acc[i] = round_acc(float(acc[i]) + float(grad[i])); from_zero: acc read as +0 (not read).
  void (*accumulate)(void* acc, DType acc_dtype, const void* grad, DType grad_dtype, bool from_zero, size_t begin,
                     size_t end);
  // Returns Σ x² over [begin, end) (begin a multiple of kNormLanes), lanes reduced by reduce_lanes().
  double (*squared_norm)(const void* src, DType dtype, size_t begin, size_t end);
  void (*triad)(float* a, const float* b, const float* c, float scalar, size_t begin, size_t end);
  // rw[j][i] += float(ro[i]) for j < n_rw (≤ kMaxRooflineRw); with n_rw = 0 returns Σ float(ro[i]).
  double (*roofline)(float* const* rw, size_t n_rw, const void* ro, DType ro_dtype, size_t begin, size_t end);
  void (*fill)(float* data, float value, size_t begin, size_t end);
  void (*adam8bit)(const Adam8bitArgs& args, size_t begin, size_t end);
  // codes[i] = the entry of `map` nearest x[i] / divisor (adam8bit's rule: the lower on a tie, 0 for
  // NaN), the quotient computed as the 8-bit kernels compute a value over its block's absmax.
  void (*nearest_codes)(const QuantTable& table, const float* x, float divisor, uint8_t* codes, size_t begin,
                        size_t end);
  void (*one_state8bit)(const OneState8bitArgs& args, size_t begin, size_t end);
};

// The table for `isa` (never kAuto), or nullptr if this build lacks it. Defined in dispatch.cpp,
// which is the one place that asks the CPU what it supports.
const KernelTable* kernel_table(Isa isa);

// One per ISA translation unit.
extern const KernelTable kScalarKernels;
#if defined(__x86_64__)
extern const KernelTable kAvx2Kernels;
extern const KernelTable kAvx512Kernels;
#endif

}  // namespace zo::cpu_optim::detail

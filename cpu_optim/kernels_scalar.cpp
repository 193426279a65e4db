// The plain scalar path: the reference every SIMD path is tested against, and the fallback on CPUs
// (or architectures) without one. Built with the default flags plus -ffp-contract=off, so a*b + c is
// never fused behind our back; fma() below is the correctly rounded std::fma. Its Adam is
// zo::adam_update (common/adam_math.h) itself, the per-element function the Device backends run.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>

#include "common/adam_math.h"
#include "cpu_optim/detail/kernels.h"
#include "cpu_optim/dtype.h"

namespace zo::cpu_optim::detail {
namespace {

struct ScalarVec {
  using F = float;
  static constexpr size_t W = 1;
  static F load(const float* p) { return *p; }
  static void store(float* p, F x) { *p = x; }
  static F load_bf16(const uint16_t* p) { return bf16_to_float(*p); }
  static F load_f16(const uint16_t* p) { return f16_to_float(*p); }
  static void store_bf16(uint16_t* p, F x) { *p = float_to_bf16(x); }
  static void store_f16(uint16_t* p, F x) { *p = float_to_f16(x); }
  static F set1(float x) { return x; }
  static F add(F a, F b) { return a + b; }
  static F mul(F a, F b) { return a * b; }
  static F fma(F a, F b, F c) { return std::fma(a, b, c); }
  static F div(F a, F b) { return a / b; }
  static F sqrt(F x) { return std::sqrt(x); }
  using I = int32_t;
  static void store_codes(uint8_t* p, I x) { *p = static_cast<uint8_t>(x); }
  static F lookup_codes(const float* map, const uint8_t* codes) { return map[*codes]; }
  static I lookup_u32(const uint32_t* table, I i) { return static_cast<I>(table[i]); }
  static I bucket_of(F x) { return static_cast<I>(std::bit_cast<uint32_t>(x) >> 16); }
  static I code_in_bucket(I entry, F x) {
    const uint32_t bits = std::bit_cast<uint32_t>(x);
    const uint32_t key = ((bits >> 31) != 0 ? ~bits : bits) & 0xFFFFu;
    const uint32_t e = static_cast<uint32_t>(entry);
    return static_cast<I>((e & ((1u << kQuantCodeBits) - 1)) - (key < (e >> kQuantCodeBits) ? 1 : 0));
  }
  // The reference divides (Note [Dividing by a constant in double]: the AVX-512 path does not).
  using Divisor = float;
  static Divisor divisor(float d) { return d; }
  static F div_by(F x, Divisor d) { return x / d; }
  static I sr_random16(uint32_t key, uint32_t index) { return static_cast<I>(::zo::sr_random16(key, index)); }
  static I round_bf16_sr(F x, I r) { return float_to_bf16_sr(x, static_cast<uint32_t>(r)); }
  static void store_u16(uint16_t* p, I x) { *p = static_cast<uint16_t>(x); }
  static F abs(F x) { return std::fabs(x); }
  static F max_keep(F acc, F x) { return x > acc ? x : acc; }
  static float hmax(F x) { return x; }
  static F lion_update(F c, F lr) {
    if (c > 0.0f) return -lr;
    if (c < 0.0f) return lr;
    if (c != c) return c;  // NaN stays NaN
    return 0.0f;
  }
  struct NormAcc {
    double lane[kNormLanes];
  };
  static void norm_zero(NormAcc& acc) {
    for (double& d : acc.lane) d = 0.0;
  }
  // x*x is exact in double (24-bit significands), so only the add rounds, as on the SIMD paths.
  static void norm_add(NormAcc& acc, size_t k, F x) {
    const double d = x;
    acc.lane[k] = acc.lane[k] + d * d;
  }
  static void norm_lanes(const NormAcc& acc, double (&out)[kNormLanes]) {
    for (size_t l = 0; l < kNormLanes; ++l) out[l] = acc.lane[l];
  }
};

}  // namespace
}  // namespace zo::cpu_optim::detail

#include "cpu_optim/detail/kernel_impl.h"

namespace zo::cpu_optim::detail {
namespace {

// adam_kernel<ScalarVec> spelled through the shared per-element function: the same operations in
// the same order, so this is what the SIMD paths are tested against and what gpu/ reproduces. bf16
// moments: widened before the update, rounded to nearest even after it. bf16 masters: widened
// before it, rounded stochastically after it (Note [Stochastic rounding to bf16]), the copy-out the
// same bits.
void adam_reference_kernel(const AdamArgs& a, size_t begin, size_t end) {
  auto step = [&]<DType P, DType M, DType G, bool kCopy, DType C>() {
    for (size_t i = begin; i < end; ++i) {
      float p = load_elems<ScalarVec, P>(a.p.params, i);
      float m = load_elems<ScalarVec, M>(a.exp_avg, i), v = load_elems<ScalarVec, M>(a.exp_avg_sq, i);
      adam_update(a.k, load_elems<ScalarVec, G>(a.grad, i), p, m, v);
      if constexpr (P == DType::kBF16) {
        const uint16_t bits = float_to_bf16_sr(p, sr_random16(a.p.sr_key, a.p.sr_first + static_cast<uint32_t>(i)));
        static_cast<uint16_t*>(a.p.params)[i] = bits;
        if constexpr (kCopy) static_cast<uint16_t*>(a.copy_out)[i] = bits;
      } else {
        static_cast<float*>(a.p.params)[i] = p;
        if constexpr (kCopy) store_elems<ScalarVec, C>(a.copy_out, i, p);
      }
      store_elems<ScalarVec, M>(a.exp_avg, i, m);
      store_elems<ScalarVec, M>(a.exp_avg_sq, i, v);
    }
  };
  with_step_dtypes(a.p.param_dtype, a.moment_dtype, a.grad_dtype, a.copy_out, a.copy_dtype, step);
}

constexpr KernelTable scalar_table() {
  KernelTable t = make_table<ScalarVec>(Isa::kScalar);
  t.adam = &adam_reference_kernel;
  return t;
}

}  // namespace

constinit const KernelTable kScalarKernels = scalar_table();
}  // namespace zo::cpu_optim::detail

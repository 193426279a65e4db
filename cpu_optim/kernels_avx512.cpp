// The AVX-512 path (F/BW/VL/DQ: Skylake-SP and later, Zen 4). Built with -mavx512f -mavx512bw
// -mavx512vl -mavx512dq -mavx2 -mfma -mf16c -ffp-contract=off and only ever called after
// dispatch.cpp has checked those features. bf16 rounding is done in integer arithmetic, not with
// AVX512_BF16's VCVTNEPS2BF16, which flushes denormals (see Note [Bit-identical paths]).
#if defined(__x86_64__)

#include <immintrin.h>

#include <cstdint>

#include "cpu_optim/detail/kernels.h"

namespace zo::cpu_optim::detail {
namespace {

struct Avx512Vec {
  using F = __m512;
  static constexpr size_t W = 16;
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, F x) { _mm512_storeu_ps(p, x); }
  static F load_bf16(const uint16_t* p) {
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  }
  static F load_f16(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static void store_bf16(uint16_t* p, F x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i hi = _mm512_srli_epi32(u, 16);
    const __m512i lsb = _mm512_and_si512(hi, _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_or_si512(hi, _mm512_set1_epi32(0x40)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
  }
  static void store_f16(uint16_t* p, F x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  using I = __m512i;
  static void store_codes(uint8_t* p, I x) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(x)); }
  static F lookup_codes(const float* map, const uint8_t* codes) {
    return _mm512_i32gather_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes))), map, 4);
  }
  static I lookup_u32(const uint32_t* table, I i) { return _mm512_i32gather_epi32(i, table, 4); }
  static I bucket_of(F x) { return _mm512_srli_epi32(_mm512_castps_si512(x), 16); }
  // (entry's code) - (key < entry's threshold key); key: x's low 16 bits, inverted where x < 0.
  static I code_in_bucket(I entry, F x) {
    const __m512i bits = _mm512_castps_si512(x);
    const __m512i key = _mm512_and_si512(_mm512_xor_si512(bits, _mm512_srai_epi32(bits, 31)), _mm512_set1_epi32(0xFFFF));
    const __mmask16 below = _mm512_cmpgt_epi32_mask(_mm512_srli_epi32(entry, kQuantCodeBits), key);
    const __m512i code = _mm512_and_si512(entry, _mm512_set1_epi32((1 << kQuantCodeBits) - 1));
    return _mm512_mask_sub_epi32(code, below, code, _mm512_set1_epi32(1));
  }
  // x / d as x times 1/d in double, rounded once to float: Note [Dividing by a constant in double].
  using Divisor = __m512d;
  static Divisor divisor(float d) { return _mm512_set1_pd(1.0 / static_cast<double>(d)); }
  static F div_by(F x, Divisor r) {
    const __m256 lo = _mm512_cvtpd_ps(_mm512_mul_pd(_mm512_cvtps_pd(_mm512_castps512_ps256(x)), r));
    const __m256 hi = _mm512_cvtpd_ps(
        _mm512_mul_pd(_mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1))), r));
    return _mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1);
  }
  // The masked and generic forms: GCC 12's plain _mm512_andnot_si512 and _mm512_max_ps pass an
  // _mm512_undefined_* source that -Wuninitialized reports inside avx512fintrin.h.
  // common/half.h's sr_random16 for index + 0..15, in 32-bit integer lanes.
  static I sr_random16(uint32_t key, uint32_t index) {
    __m512i x = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(index)),
                                 _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    x = _mm512_xor_si512(_mm512_mullo_epi32(x, _mm512_set1_epi32(static_cast<int>(0x9E3779B9u))),
                         _mm512_set1_epi32(static_cast<int>(key)));
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
    x = _mm512_mullo_epi32(x, _mm512_set1_epi32(0x7FEB352D));
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
    x = _mm512_mullo_epi32(x, _mm512_set1_epi32(static_cast<int>(0x846CA68Bu)));
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
    return _mm512_srli_epi32(x, 16);
  }
  // float_to_bf16_sr lane by lane (see the AVX2 path).
  static I round_bf16_sr(F x, I r) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i hi = _mm512_srli_epi32(u, 16);
    const __mmask16 up = _mm512_cmpgt_epi32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0xFFFF)), r);
    const __m512i out = _mm512_mask_add_epi32(hi, up, hi, _mm512_set1_epi32(1));
    return _mm512_mask_mov_epi32(out, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q),
                                 _mm512_or_si512(hi, _mm512_set1_epi32(0x40)));
  }
  static void store_u16(uint16_t* p, I x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(x));
  }
  static F abs(F x) {
    return _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(INT32_MAX)));
  }
  static F max_keep(F acc, F x) { return _mm512_maskz_max_ps(0xFFFF, x, acc); }  // acc where x is NaN
  // Once per block: through memory.
  static float hmax(F x) {
    alignas(64) float lanes[16];
    _mm512_store_ps(lanes, x);
    float m = lanes[0];
    for (float y : lanes) m = y > m ? y : m;
    return m;
  }
  static F set1(float x) { return _mm512_set1_ps(x); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F div(F a, F b) { return _mm512_div_ps(a, b); }
  static F sqrt(F x) { return _mm512_sqrt_ps(x); }
  static F lion_update(F c, F lr) {
    const F zero = _mm512_setzero_ps();
    F r = _mm512_mask_mov_ps(zero, _mm512_cmp_ps_mask(c, zero, _CMP_GT_OQ), _mm512_sub_ps(zero, lr));
    r = _mm512_mask_mov_ps(r, _mm512_cmp_ps_mask(c, zero, _CMP_LT_OQ), lr);
    return _mm512_mask_mov_ps(r, _mm512_cmp_ps_mask(c, c, _CMP_UNORD_Q), c);
  }
  // Two 8-wide double accumulators = lanes 0..15 (W = 16: one part per chunk, k is always 0).
  struct NormAcc {
    __m512d a[2];
  };
  static void norm_zero(NormAcc& acc) {
    acc.a[0] = _mm512_setzero_pd();
    acc.a[1] = _mm512_setzero_pd();
  }
  static void norm_add(NormAcc& acc, size_t, F x) {
    const __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(x));
    const __m512d hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
    acc.a[0] = _mm512_add_pd(acc.a[0], _mm512_mul_pd(lo, lo));
    acc.a[1] = _mm512_add_pd(acc.a[1], _mm512_mul_pd(hi, hi));
  }
  static void norm_lanes(const NormAcc& acc, double (&out)[kNormLanes]) {
    _mm512_storeu_pd(out, acc.a[0]);
    _mm512_storeu_pd(out + 8, acc.a[1]);
  }
};

}  // namespace
}  // namespace zo::cpu_optim::detail

#include "cpu_optim/detail/kernel_impl.h"

namespace zo::cpu_optim::detail {
constinit const KernelTable kAvx512Kernels = make_table<Avx512Vec>(Isa::kAvx512);
}  // namespace zo::cpu_optim::detail

#endif  // __x86_64__

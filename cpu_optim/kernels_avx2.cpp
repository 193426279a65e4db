// The AVX2 + FMA + F16C path (Haswell and later, Zen). Built with -mavx2 -mfma -mf16c
// -ffp-contract=off and only ever called after dispatch.cpp has checked those features.
#if defined(__x86_64__)

#include <immintrin.h>

#include <cstdint>

#include "cpu_optim/detail/kernels.h"

namespace zo::cpu_optim::detail {
namespace {

struct Avx2Vec {
  using F = __m256;
  static constexpr size_t W = 8;
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, F x) { _mm256_storeu_ps(p, x); }
  static F load_bf16(const uint16_t* p) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  }
  static F load_f16(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  // Round to nearest even in integer arithmetic, NaN → quiet NaN: float_to_bf16() lane by lane.
  static void store_bf16(uint16_t* p, F x) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i hi = _mm256_srli_epi32(u, 16);
    const __m256i lsb = _mm256_and_si256(hi, _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb), 16);
    const __m256i qnan = _mm256_or_si256(hi, _mm256_set1_epi32(0x40));
    r = _mm256_blendv_epi8(r, qnan, _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
    const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
  }
  static void store_f16(uint16_t* p, F x) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  static F set1(float x) { return _mm256_set1_ps(x); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F div(F a, F b) { return _mm256_div_ps(a, b); }
  static F sqrt(F x) { return _mm256_sqrt_ps(x); }
  using I = __m256i;
  static void store_codes(uint8_t* p, I x) {  // the low byte of each lane, in order
    const __m256i bytes =
        _mm256_shuffle_epi8(x, _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 0, 4, 8,
                                                12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1));
    const __m128i lo = _mm256_castsi256_si128(bytes), hi = _mm256_extracti128_si256(bytes, 1);
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_unpacklo_epi32(lo, hi));
  }
  // Lookups in small, L1-resident tables lane by lane: eight loads and inserts cost less than
  // vpgatherdd on Zen 3 (Note [Nearest codes by bucket] in adam8bit.cpp).
  static F lookup_codes(const float* map, const uint8_t* codes) {
    __m128 lo = _mm_load_ss(map + codes[0]), hi = _mm_load_ss(map + codes[4]);
    lo = _mm_insert_ps(lo, _mm_load_ss(map + codes[1]), 0x10);
    hi = _mm_insert_ps(hi, _mm_load_ss(map + codes[5]), 0x10);
    lo = _mm_insert_ps(lo, _mm_load_ss(map + codes[2]), 0x20);
    hi = _mm_insert_ps(hi, _mm_load_ss(map + codes[6]), 0x20);
    lo = _mm_insert_ps(lo, _mm_load_ss(map + codes[3]), 0x30);
    hi = _mm_insert_ps(hi, _mm_load_ss(map + codes[7]), 0x30);
    return _mm256_set_m128(hi, lo);
  }
  static I lookup_u32(const uint32_t* table, I i) {
    const __m128i l = _mm256_castsi256_si128(i), h = _mm256_extracti128_si256(i, 1);
    const uint64_t a = static_cast<uint64_t>(_mm_cvtsi128_si64(l)), b = static_cast<uint64_t>(_mm_extract_epi64(l, 1));
    const uint64_t c = static_cast<uint64_t>(_mm_cvtsi128_si64(h)), d = static_cast<uint64_t>(_mm_extract_epi64(h, 1));
    __m128i lo = _mm_cvtsi32_si128(static_cast<int>(table[static_cast<uint32_t>(a)]));
    __m128i hi = _mm_cvtsi32_si128(static_cast<int>(table[static_cast<uint32_t>(c)]));
    lo = _mm_insert_epi32(lo, static_cast<int>(table[a >> 32]), 1);
    hi = _mm_insert_epi32(hi, static_cast<int>(table[c >> 32]), 1);
    lo = _mm_insert_epi32(lo, static_cast<int>(table[static_cast<uint32_t>(b)]), 2);
    hi = _mm_insert_epi32(hi, static_cast<int>(table[static_cast<uint32_t>(d)]), 2);
    lo = _mm_insert_epi32(lo, static_cast<int>(table[b >> 32]), 3);
    hi = _mm_insert_epi32(hi, static_cast<int>(table[d >> 32]), 3);
    return _mm256_set_m128i(hi, lo);
  }
  static I bucket_of(F x) { return _mm256_srli_epi32(_mm256_castps_si256(x), 16); }
  // (entry's code) - (key < entry's threshold key); key: x's low 16 bits, inverted where x < 0.
  static I code_in_bucket(I entry, F x) {
    const __m256i bits = _mm256_castps_si256(x);
    const __m256i key = _mm256_and_si256(_mm256_xor_si256(bits, _mm256_srai_epi32(bits, 31)), _mm256_set1_epi32(0xFFFF));
    const __m256i below = _mm256_cmpgt_epi32(_mm256_srli_epi32(entry, kQuantCodeBits), key);  // -1 where key < t
    return _mm256_add_epi32(_mm256_and_si256(entry, _mm256_set1_epi32((1 << kQuantCodeBits) - 1)), below);
  }
  // x / d: the divider itself, unlike AVX-512 (Note [Dividing by a constant in double]).
  using Divisor = __m256;
  static Divisor divisor(float d) { return _mm256_set1_ps(d); }
  static F div_by(F x, Divisor d) { return _mm256_div_ps(x, d); }
  // common/half.h's sr_random16 for index + 0..7, in 32-bit integer lanes.
  static I sr_random16(uint32_t key, uint32_t index) {
    __m256i x = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(index)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    x = _mm256_xor_si256(_mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int>(0x9E3779B9u))),
                         _mm256_set1_epi32(static_cast<int>(key)));
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
    x = _mm256_mullo_epi32(x, _mm256_set1_epi32(0x7FEB352D));
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
    x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int>(0x846CA68Bu)));
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
    return _mm256_srli_epi32(x, 16);
  }
  // float_to_bf16_sr lane by lane: the high half, plus one where r < the dropped low half (both are
  // below 2^16, so the signed compare is exact); NaN → quiet NaN.
  static I round_bf16_sr(F x, I r) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i hi = _mm256_srli_epi32(u, 16);
    const __m256i up = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0xFFFF)), r);
    const __m256i out = _mm256_sub_epi32(hi, up);  // up is -1 where rounding away from zero
    const __m256i qnan = _mm256_or_si256(hi, _mm256_set1_epi32(0x40));
    return _mm256_blendv_epi8(out, qnan, _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
  }
  static void store_u16(uint16_t* p, I x) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                     _mm_packus_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1)));
  }
  static F abs(F x) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x); }
  static F max_keep(F acc, F x) { return _mm256_max_ps(x, acc); }  // acc where x is NaN
  static float hmax(F x) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
  }
  static F lion_update(F c, F lr) {
    const F zero = _mm256_setzero_ps();
    const F neg_lr = _mm256_xor_ps(lr, _mm256_set1_ps(-0.0f));
    const F pos = _mm256_and_ps(_mm256_cmp_ps(c, zero, _CMP_GT_OQ), neg_lr);
    const F neg = _mm256_and_ps(_mm256_cmp_ps(c, zero, _CMP_LT_OQ), lr);
    return _mm256_blendv_ps(_mm256_or_ps(pos, neg), c, _mm256_cmp_ps(c, c, _CMP_UNORD_Q));
  }
  // Four 4-wide double accumulators = lanes 0..15; part k (0 or 1) of a 16-element chunk is
  // elements 8k..8k+7, which go to lanes 8k..8k+7.
  struct NormAcc {
    __m256d a[4];
  };
  static void norm_zero(NormAcc& acc) {
    for (__m256d& a : acc.a) a = _mm256_setzero_pd();
  }
  static void norm_add(NormAcc& acc, size_t k, F x) {
    const __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(x));
    const __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1));
    acc.a[2 * k] = _mm256_add_pd(acc.a[2 * k], _mm256_mul_pd(lo, lo));
    acc.a[2 * k + 1] = _mm256_add_pd(acc.a[2 * k + 1], _mm256_mul_pd(hi, hi));
  }
  static void norm_lanes(const NormAcc& acc, double (&out)[kNormLanes]) {
    for (size_t i = 0; i < 4; ++i) _mm256_storeu_pd(out + 4 * i, acc.a[i]);
  }
};

}  // namespace
}  // namespace zo::cpu_optim::detail

#include "cpu_optim/detail/kernel_impl.h"

namespace zo::cpu_optim::detail {
constinit const KernelTable kAvx2Kernels = make_table<Avx2Vec>(Isa::kAvx2);
}  // namespace zo::cpu_optim::detail

#endif  // __x86_64__

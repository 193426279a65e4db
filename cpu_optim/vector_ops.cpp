#include "cpu_optim/vector_ops.h"

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "cpu_optim/detail/kernels.h"

namespace zo::cpu_optim {
namespace {

const detail::KernelTable& table_for(const Executor& executor) {
  const detail::KernelTable* table = detail::kernel_table(executor.isa());
  ZO_CHECK(table != nullptr) << "executor ISA " << isa_name(executor.isa()) << " has no kernels";
  return *table;
}

}  // namespace

Status convert(ConstElemSpan src, ElemSpan dst, size_t n_elems, const Executor& executor) {
  if (n_elems == 0) return Status::ok();
  if (src.data == nullptr || dst.data == nullptr)
    return invalid_argument("convert: null source or destination for " + std::to_string(n_elems) + " elements");
  const auto kernel = table_for(executor).convert;
  executor.for_each_tile(n_elems, [&](size_t b, size_t e) { kernel(src.data, src.dtype, dst.data, dst.dtype, b, e); });
  return Status::ok();
}

Status accumulate(ElemSpan acc, ConstElemSpan grad, size_t n_elems, bool from_zero, const Executor& executor) {
  if (n_elems == 0) return Status::ok();
  if (acc.data == nullptr || grad.data == nullptr)
    return invalid_argument("accumulate: null accumulator or gradient for " + std::to_string(n_elems) + " elements");
  const auto kernel = table_for(executor).accumulate;
  executor.for_each_tile(
      n_elems, [&](size_t b, size_t e) { kernel(acc.data, acc.dtype, grad.data, grad.dtype, from_zero, b, e); });
  return Status::ok();
}

// Note [Deterministic squared norm]: each tile's sum is formed in 16 double lanes (element i of the
// tile in lane i % 16; x*x is exact in double, so each lane only rounds its adds, in element order),
// the lanes are reduced by a fixed tree, and tile sums are added in tile order on this thread. Tile
// boundaries are fixed (kTileElems), so the result depends on neither the thread count nor the ISA.
Result<double> squared_norm(ConstElemSpan grad, size_t n_elems, const Executor& executor) {
  if (n_elems == 0) return 0.0;
  if (grad.data == nullptr)
    return invalid_argument("squared_norm: null gradient for " + std::to_string(n_elems) + " elements");
  const auto kernel = table_for(executor).squared_norm;
  std::vector<double> partial((n_elems + kTileElems - 1) / kTileElems);
  executor.for_each_tile(n_elems,
                         [&](size_t b, size_t e) { partial[b / kTileElems] = kernel(grad.data, grad.dtype, b, e); });
  double sum = 0.0;
  for (double p : partial) sum += p;
  return sum;
}

namespace {

// Rewrites x as 0 + x where that changes its bits: −0 (to +0) and a signalling NaN (quieted). The
// scan is vectorised (AVX2 where the executor's path has it, else SSE2) and branch-free; the
// rewrite is rare.
bool negative_zero_or_signalling(uint32_t u) {
  return u == 0x80000000u || ((u & 0x7fc00000u) == 0x7f800000u && (u & 0x003fffffu) != 0);
}

#if defined(__x86_64__)
// As the squared norm's kernel prefetches its lone read stream (Note [Prefetching a lone read
// stream] in cpu_optim/detail/kernel_impl.h).
constexpr size_t kScanPrefetchBytes = 8192;

__attribute__((target("avx2"))) size_t scan_avx2(const float* data, size_t begin, size_t end, int* any) {
  const __m256i minus_zero = _mm256_set1_epi32(static_cast<int>(0x80000000u));
  const __m256i exp_quiet = _mm256_set1_epi32(0x7fc00000), exp_only = _mm256_set1_epi32(0x7f800000);
  const __m256i payload = _mm256_set1_epi32(0x003fffff), none = _mm256_setzero_si256();
  __m256i hits = none;
  size_t i = begin;
#define ZO_SCAN_HIT(u)                                                                        \
  _mm256_or_si256(_mm256_cmpeq_epi32(u, minus_zero),                                          \
                  _mm256_andnot_si256(_mm256_cmpeq_epi32(_mm256_and_si256(u, payload), none), \
                                      _mm256_cmpeq_epi32(_mm256_and_si256(u, exp_quiet), exp_only)))
  for (; i + 16 <= end; i += 16) {  // a cache line a turn, the hardware prefetcher helped along
    _mm_prefetch(reinterpret_cast<const char*>(data + i) + kScanPrefetchBytes, _MM_HINT_T0);
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(data + i));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(data + i + 8));
    hits = _mm256_or_si256(hits, _mm256_or_si256(ZO_SCAN_HIT(a), ZO_SCAN_HIT(b)));
  }
  for (; i + 8 <= end; i += 8) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(data + i));
    hits = _mm256_or_si256(hits, ZO_SCAN_HIT(a));
  }
#undef ZO_SCAN_HIT
  *any |= _mm256_movemask_epi8(hits);
  return i;
}
#endif

void canonicalize_zeros_and_nans(float* data, size_t begin, size_t end, bool avx2) {
  const auto bits = [&](size_t i) {
    uint32_t u;
    std::memcpy(&u, data + i, sizeof u);
    return u;
  };
  size_t i = begin;
  int any = 0;
#if defined(__x86_64__)
  if (avx2) i = scan_avx2(data, begin, end, &any);
#else
  (void)avx2;
#endif
#if defined(__SSE2__)
  const __m128i minus_zero = _mm_set1_epi32(static_cast<int>(0x80000000u));
  const __m128i exp_quiet = _mm_set1_epi32(0x7fc00000), exp_only = _mm_set1_epi32(0x7f800000);
  const __m128i payload = _mm_set1_epi32(0x003fffff), none = _mm_setzero_si128();
  __m128i hits = none;
  for (; i + 4 <= end; i += 4) {
    const __m128i u = _mm_loadu_si128(reinterpret_cast<const __m128i*>(data + i));
    const __m128i nan_exp = _mm_cmpeq_epi32(_mm_and_si128(u, exp_quiet), exp_only);
    const __m128i no_payload = _mm_cmpeq_epi32(_mm_and_si128(u, payload), none);
    hits = _mm_or_si128(hits, _mm_or_si128(_mm_cmpeq_epi32(u, minus_zero), _mm_andnot_si128(no_payload, nan_exp)));
  }
  any |= _mm_movemask_epi8(hits);
#endif
  for (; i < end; ++i) any |= static_cast<int>(negative_zero_or_signalling(bits(i)));
  if (any == 0) return;
  volatile float zero = 0.0f;  // the add itself, never folded away
  for (i = begin; i < end; ++i)
    if (negative_zero_or_signalling(bits(i))) data[i] = zero + data[i];
}

}  // namespace

Status squared_norm_canonical_tiles(ElemSpan grad, size_t n_elems, std::span<double> tile_sums,
                                    const Executor& executor) {
  if (n_elems == 0) return Status::ok();
  if (grad.data == nullptr)
    return invalid_argument("squared_norm_canonical: null gradient for " + std::to_string(n_elems) + " elements");
  if (grad.dtype != DType::kF32)
    return invalid_argument("squared_norm_canonical: fp32 values only, not " + std::string(dtype_name(grad.dtype)));
  if (tile_sums.size() < (n_elems + kTileElems - 1) / kTileElems)
    return invalid_argument("squared_norm_canonical: " + std::to_string(tile_sums.size()) + " tile sums for " +
                            std::to_string(n_elems) + " elements");
  const auto kernel = table_for(executor).squared_norm;
  const bool avx2 = executor.isa() != Isa::kScalar;  // the AVX2 and AVX-512 paths both have AVX2
  float* values = static_cast<float*>(static_cast<void*>(grad.data));
  executor.for_each_tile(n_elems, [&](size_t b, size_t e) {
    // The scan brings the tile into cache; the norm reads it from there.
    canonicalize_zeros_and_nans(values, b, e, avx2);
    tile_sums[b / kTileElems] = kernel(grad.data, grad.dtype, b, e);
  });
  return Status::ok();
}

Result<double> squared_norm_canonical(ElemSpan grad, size_t n_elems, const Executor& executor) {
  std::vector<double> partial((n_elems + kTileElems - 1) / kTileElems);
  ZO_RETURN_IF_ERROR(squared_norm_canonical_tiles(grad, n_elems, partial, executor));
  double sum = 0.0;
  for (double p : partial) sum += p;  // as squared_norm adds them
  return sum;
}

void fill(std::span<float> data, float value, const Executor& executor) {
  const auto kernel = table_for(executor).fill;
  executor.for_each_tile(data.size(), [&](size_t b, size_t e) { kernel(data.data(), value, b, e); });
}

Status stream_triad(std::span<float> a, std::span<const float> b, std::span<const float> c, float scalar,
                    const Executor& executor) {
  if (b.size() != a.size() || c.size() != a.size())
    return invalid_argument("stream_triad: sizes differ (" + std::to_string(a.size()) + ", " +
                            std::to_string(b.size()) + ", " + std::to_string(c.size()) + ")");
  const auto kernel = table_for(executor).triad;
  executor.for_each_tile(a.size(), [&](size_t lo, size_t hi) { kernel(a.data(), b.data(), c.data(), scalar, lo, hi); });
  return Status::ok();
}

Result<double> roofline_pass(std::span<float* const> rw, ConstElemSpan ro, size_t n_elems, const Executor& executor) {
  if (rw.size() > detail::kMaxRooflineRw)
    return invalid_argument("roofline_pass: " + std::to_string(rw.size()) + " written streams (at most " +
                            std::to_string(detail::kMaxRooflineRw) + ")");
  if (n_elems == 0) return 0.0;
  if (ro.data == nullptr) return invalid_argument("roofline_pass: null read stream");
  for (float* p : rw)
    if (p == nullptr) return invalid_argument("roofline_pass: null written stream");
  const auto kernel = table_for(executor).roofline;
  std::vector<double> partial((n_elems + kTileElems - 1) / kTileElems);
  executor.for_each_tile(n_elems, [&](size_t b, size_t e) {
    partial[b / kTileElems] = kernel(rw.data(), rw.size(), ro.data, ro.dtype, b, e);
  });
  double sum = 0.0;
  for (double p : partial) sum += p;
  return sum;
}

}  // namespace zo::cpu_optim

// Internal: the one definition of every kernel, as templates over a vector "traits" type V that an
// ISA translation unit supplies (kernels_scalar.cpp, kernels_avx2.cpp, kernels_avx512.cpp). Because
// each path runs this same sequence of IEEE-754 operations (mul, add, fused multiply-add, div, sqrt,
// each correctly rounded) on the same constants, all paths give the same bits; see
// Note [Bit-identical paths] in docs/cpu_optim.md. Include only from a kernel .cpp,
// after V's definition, with V declared in that file's anonymous namespace: every function here is
// a template depending on V (or static), so its instantiations stay local to a translation unit
// compiled with its own -m flags and are never merged across units by the linker (an AVX-512 copy
// of a shared inline function picked for the scalar path would fault on older CPUs).
//
// V provides: F (W floats), W, load(const float*), store(float*, F), load_bf16/load_f16(const
// uint16_t*), store_bf16/store_f16(uint16_t*, F), set1, add, mul, fma(a, b, c) = a*b + c rounded
// once, div, sqrt, lion_update(c, lr) = -lr*sign(c), NormAcc with norm_zero/norm_add(acc, k, x) for
// the k-th W-wide part of a 16-element chunk / norm_lanes(acc, double[16]); for the 8-bit states,
// I (W int32 lanes) with store_codes (W bytes), lookup_codes(const float* map, const uint8_t* codes)
// (map[codes[l]] in lane l), lookup_u32(const uint32_t* table, I), bucket_of(F) and code_in_bucket(entry, x) (kernels.h's
// QuantTable; store_codes keeps the low byte of its lanes), Divisor with divisor(float d) and div_by(x, Divisor) = x / d
// correctly rounded (Note [Dividing by a constant in double]), and on F abs,
// max_keep(acc, x) = x > acc ? x : acc, hmax; for bf16 masters sr_random16(key, index) (lane l:
// common/half.h's sr_random16(key, index + l)), round_bf16_sr(F, I) (float_to_bf16_sr per lane, as
// I) and store_u16(uint16_t*, I) (the low 16 bits of each lane).
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "cpu_optim/detail/kernels.h"
#include "cpu_optim/dtype.h"

namespace zo::cpu_optim::detail {

// On a helper or lambda of a kernel's per-vector body: GCC's -O2 heuristics otherwise leave
// it a call per W elements, with every constant the body captures reloaded from memory.
#define ZO_KERNEL_INLINE __attribute__((always_inline))

// Element size as a constant (not dtype_size_bytes(), so no shared inline function is called here).
template <DType D>
inline constexpr size_t kElemBytes = D == DType::kF32 ? 4 : 2;

template <class V, DType D>
inline typename V::F load_elems(const void* base, size_t i) {
  if constexpr (D == DType::kF32) return V::load(static_cast<const float*>(base) + i);
  if constexpr (D == DType::kBF16) return V::load_bf16(static_cast<const uint16_t*>(base) + i);
  if constexpr (D == DType::kF16) return V::load_f16(static_cast<const uint16_t*>(base) + i);
}

template <class V, DType D>
inline void store_elems(void* base, size_t i, typename V::F x) {
  if constexpr (D == DType::kF32) V::store(static_cast<float*>(base) + i, x);
  if constexpr (D == DType::kBF16) V::store_bf16(static_cast<uint16_t*>(base) + i, x);
  if constexpr (D == DType::kF16) V::store_f16(static_cast<uint16_t*>(base) + i, x);
}

// Calls fn.template operator()<M>() for an optimizer state's runtime dtype: fp32, or bf16 (widened
// exactly as read, stored rounded to nearest even).
template <class Fn>
inline void with_state_dtype(DType m, Fn&& fn) {
  if (m == DType::kBF16) fn.template operator()<DType::kBF16>();
  else fn.template operator()<DType::kF32>();
}

// Calls fn.template operator()<P>() for a parameter span's runtime dtype: fp32 masters, or bf16
// masters stored with stochastic rounding.
template <class Fn>
inline void with_param_dtype(DType p, Fn&& fn) {
  if (p == DType::kBF16) fn.template operator()<DType::kBF16>();
  else fn.template operator()<DType::kF32>();
}

// Calls fn.template operator()<G, kCopy, C>() for the runtime dtypes (C is kF32 when there is no copy).
template <class Fn>
inline void with_dtypes(DType g, const void* copy, DType c, Fn&& fn) {
  auto with_copy = [&]<DType G>() {
    if (copy == nullptr) return fn.template operator()<G, false, DType::kF32>();
    switch (c) {
      case DType::kF32: return fn.template operator()<G, true, DType::kF32>();
      case DType::kBF16: return fn.template operator()<G, true, DType::kBF16>();
      case DType::kF16: return fn.template operator()<G, true, DType::kF16>();
    }
  };
  switch (g) {
    case DType::kF32: return with_copy.template operator()<DType::kF32>();
    case DType::kBF16: return with_copy.template operator()<DType::kBF16>();
    case DType::kF16: return with_copy.template operator()<DType::kF16>();
  }
}

// A bf16 master's copy-out is bf16 (the entry points refuse another dtype): the other combinations
// are never instantiated.
template <DType P, bool kCopy, DType C>
inline constexpr bool kValidCopy = P == DType::kF32 || !kCopy || C == DType::kBF16;

// Calls fn.template operator()<P, M, G, kCopy, C>() for an optimizer step's runtime dtypes: the
// parameters' (P), the state's (M), the gradient's (G) and the copy-out's (C), for the valid copies.
template <class Fn>
inline void with_step_dtypes(DType p, DType m, DType g, const void* copy, DType c, Fn&& fn) {
  with_param_dtype(p, [&]<DType P>() {
    with_state_dtype(m, [&]<DType M>() {
      with_dtypes(g, copy, c, [&]<DType G, bool kCopy, DType C>() {
        if constexpr (kValidCopy<P, kCopy, C>) fn.template operator()<P, M, G, kCopy, C>();
      });
    });
  });
}

// Runs body(ptrs, i) for i = begin, begin + W, ... over the full W-wide blocks of [begin, end), with
// ptrs the streams' base pointers (kept in registers: the loop is just the body's loads and stores).
// The last partial block is copied into zero-padded local buffers, run through the same body at
// i = 0 and copied back, so tails are computed by exactly the same instructions as everything else.
struct Stream {
  void* ptr;  // base pointer (nullptr: stream unused)
  size_t elem_size;
  bool written;
};

template <size_t N>
struct Ptrs {
  void* p[N];
};

// for_blocks_at passes body the element index the block starts at as well (i for a full block; the
// tail's true index beside its i = 0), for what depends on where an element is (stochastic rounding).
template <size_t W, size_t N, class Body>
inline void for_blocks_at(const Stream (&streams)[N], size_t begin, size_t end, Body&& body) {
  Ptrs<N> base;
  for (size_t s = 0; s < N; ++s) base.p[s] = streams[s].ptr;
  size_t i = begin;
  for (; i + W <= end; i += W) body(base, i, i);
  if (i == end) return;
  const size_t rem = end - i;
  alignas(64) unsigned char local[N][W * 4];
  Ptrs<N> tail;
  for (size_t s = 0; s < N; ++s) {
    std::memset(local[s], 0, sizeof local[s]);
    tail.p[s] = streams[s].ptr ? local[s] : nullptr;
    if (streams[s].ptr)
      std::memcpy(local[s], static_cast<unsigned char*>(streams[s].ptr) + i * streams[s].elem_size,
                  rem * streams[s].elem_size);
  }
  body(tail, 0, i);
  for (size_t s = 0; s < N; ++s)
    if (streams[s].ptr && streams[s].written)
      std::memcpy(static_cast<unsigned char*>(streams[s].ptr) + i * streams[s].elem_size, local[s],
                  rem * streams[s].elem_size);
}

template <size_t W, size_t N, class Body>
inline void for_blocks(const Stream (&streams)[N], size_t begin, size_t end, Body&& body) {
  for_blocks_at<W>(streams, begin, end, [&](const Ptrs<N>& at, size_t i, size_t) ZO_KERNEL_INLINE { body(at, i); });
}

// A kernel's new parameters: fp32 stored as computed (the copy-out rounded to nearest even), or a
// bf16 master rounded stochastically at element `index` of the call, its copy-out the same bits.
template <class V, DType P, bool kCopy, DType C>
inline void store_params(const ParamArgs& a, void* p, void* copy, size_t i, size_t index, typename V::F x) {
  if constexpr (P == DType::kF32) {
    V::store(static_cast<float*>(p) + i, x);
    if constexpr (kCopy) store_elems<V, C>(copy, i, x);
  } else {
    const typename V::I r = V::round_bf16_sr(x, V::sr_random16(a.sr_key, a.sr_first + static_cast<uint32_t>(index)));
    V::store_u16(static_cast<uint16_t*>(p) + i, r);
    if constexpr (kCopy) V::store_u16(static_cast<uint16_t*>(copy) + i, r);
  }
}

// The vector form of zo::adam_update (common/adam_math.h), operation for operation; the scalar
// path runs adam_update itself, and the tests hold every SIMD path to it bit for bit. bf16 moments
// are widened as they are read and rounded to nearest even as they are stored; the update in
// between, the parameter's included, uses the fp32 values.
template <class V>
void adam_kernel(const AdamArgs& a, size_t begin, size_t end) {
  using F = typename V::F;
  const AdamConstants& k = a.k;
  const F scale = V::set1(k.grad_scale), b1 = V::set1(k.beta1), omb1 = V::set1(k.one_minus_beta1),
          b2 = V::set1(k.beta2), omb2 = V::set1(k.one_minus_beta2), eps = V::set1(k.eps), bc2 = V::set1(k.bc2_rsqrt),
          neg_step = V::set1(k.neg_step), l2 = V::set1(k.l2_decay), decay = V::set1(k.decay_factor);
  const bool use_l2 = k.use_l2, use_decoupled = k.use_decoupled;
  auto step = [&]<DType P, DType M, DType G, bool kCopy, DType C>() {
    const Stream streams[5] = {{a.p.params, kElemBytes<P>, true},
                               {a.exp_avg, kElemBytes<M>, true},
                               {a.exp_avg_sq, kElemBytes<M>, true},
                               {const_cast<void*>(a.grad), kElemBytes<G>, false},
                               {kCopy ? a.copy_out : nullptr, kElemBytes<C>, true}};
    for_blocks_at<V::W>(streams, begin, end, [&](const Ptrs<5>& at, size_t i, size_t index) {
      F g = V::mul(load_elems<V, G>(at.p[3], i), scale);
      F p = load_elems<V, P>(at.p[0], i);
      if (use_l2) g = V::fma(p, l2, g);
      F m = V::mul(load_elems<V, M>(at.p[1], i), b1);
      m = V::fma(g, omb1, m);
      F v = V::mul(load_elems<V, M>(at.p[2], i), b2);
      g = V::mul(g, g);
      v = V::fma(g, omb2, v);
      F d = V::sqrt(v);
      d = V::fma(d, bc2, eps);
      d = V::div(m, d);
      if (use_decoupled) p = V::mul(p, decay);  // Note [Decoupled decay rounding]
      p = V::fma(d, neg_step, p);
      store_params<V, P, kCopy, C>(a.p, at.p[0], at.p[4], i, index, p);
      store_elems<V, M>(at.p[1], i, m);
      store_elems<V, M>(at.p[2], i, v);
    });
  };
  with_step_dtypes(a.p.param_dtype, a.moment_dtype, a.grad_dtype, a.copy_out, a.copy_dtype, step);
}

// Adagrad's and Lion's state in fp32 or bf16, as Adam's moments: widened as read, the update (the
// parameter's included) in fp32, stored rounded to nearest even.
template <class V>
void adagrad_kernel(const AdagradArgs& a, size_t begin, size_t end) {
  using F = typename V::F;
  const F scale = V::set1(a.grad_scale), eps = V::set1(a.eps), neg_lr = V::set1(a.neg_lr), wd = V::set1(a.weight_decay);
  const bool use_decay = a.use_decay;
  auto step = [&]<DType P, DType M, DType G, bool kCopy, DType C>() {
    const Stream streams[4] = {{a.p.params, kElemBytes<P>, true},
                               {a.exp_avg_sq, kElemBytes<M>, true},
                               {const_cast<void*>(a.grad), kElemBytes<G>, false},
                               {kCopy ? a.copy_out : nullptr, kElemBytes<C>, true}};
    for_blocks_at<V::W>(streams, begin, end, [&](const Ptrs<4>& at, size_t i, size_t index) {
      const F num = V::mul(load_elems<V, G>(at.p[2], i), scale);
      F p = load_elems<V, P>(at.p[0], i);
      F g = num;
      if (use_decay) g = V::fma(p, wd, g);
      F v = V::fma(g, g, load_elems<V, M>(at.p[1], i));
      F d = V::sqrt(v);
      d = V::add(d, eps);
      d = V::div(num, d);
      p = V::fma(d, neg_lr, p);
      store_params<V, P, kCopy, C>(a.p, at.p[0], at.p[3], i, index, p);
      store_elems<V, M>(at.p[1], i, v);
    });
  };
  with_step_dtypes(a.p.param_dtype, a.state_dtype, a.grad_dtype, a.copy_out, a.copy_dtype, step);
}

template <class V>
void lion_kernel(const LionArgs& a, size_t begin, size_t end) {
  using F = typename V::F;
  const F scale = V::set1(a.grad_scale), b1 = V::set1(a.beta1), omb1 = V::set1(a.one_minus_beta1),
          b2 = V::set1(a.beta2), omb2 = V::set1(a.one_minus_beta2), lr = V::set1(a.lr),
          after_decay = V::set1(a.after_decay);
  const bool use_decay = a.use_decay;
  auto step = [&]<DType P, DType M, DType G, bool kCopy, DType C>() {
    const Stream streams[4] = {{a.p.params, kElemBytes<P>, true},
                               {a.exp_avg, kElemBytes<M>, true},
                               {const_cast<void*>(a.grad), kElemBytes<G>, false},
                               {kCopy ? a.copy_out : nullptr, kElemBytes<C>, true}};
    for_blocks_at<V::W>(streams, begin, end, [&](const Ptrs<4>& at, size_t i, size_t index) {
      const F g = V::mul(load_elems<V, G>(at.p[2], i), scale);
      F m = load_elems<V, M>(at.p[1], i);
      F p = load_elems<V, P>(at.p[0], i);
      F c = V::mul(m, b1);
      c = V::fma(g, omb1, c);
      const F u = V::lion_update(c, lr);
      p = use_decay ? V::fma(p, after_decay, u) : V::add(p, u);
      m = V::mul(m, b2);
      m = V::fma(g, omb2, m);
      store_params<V, P, kCopy, C>(a.p, at.p[0], at.p[3], i, index, p);
      store_elems<V, M>(at.p[1], i, m);
    });
  };
  with_step_dtypes(a.p.param_dtype, a.state_dtype, a.grad_dtype, a.copy_out, a.copy_dtype, step);
}

template <class V>
void convert_kernel(const void* src, DType src_dtype, void* dst, DType dst_dtype, size_t begin, size_t end) {
  with_dtypes(src_dtype, dst, dst_dtype, [&]<DType S, bool kCopy, DType D>() {
    if constexpr (kCopy) {
      const Stream streams[2] = {{const_cast<void*>(src), kElemBytes<S>, false}, {dst, kElemBytes<D>, true}};
      for_blocks<V::W>(streams, begin, end, [&](const Ptrs<2>& at, size_t i) {
        store_elems<V, D>(at.p[1], i, load_elems<V, S>(at.p[0], i));
      });
    }
  });
}

// The gradient accumulator's add: one fp32 add per element, rounded to the accumulator's dtype as
// store_elems rounds (nearest even), so every path gives the scalar path's bits. from_zero adds to
// +0 rather than skipping the add, so a -0 gradient lands as +0 exactly as it does in a zeroed buffer.
template <class V>
void accumulate_kernel(void* acc, DType acc_dtype, const void* grad, DType grad_dtype, bool from_zero, size_t begin,
                       size_t end) {
  with_dtypes(grad_dtype, acc, acc_dtype, [&]<DType G, bool kAcc, DType A>() {
    if constexpr (kAcc) {
      const Stream streams[2] = {{const_cast<void*>(grad), kElemBytes<G>, false}, {acc, kElemBytes<A>, true}};
      if (from_zero) {
        const typename V::F zero = V::set1(0.0f);
        for_blocks<V::W>(streams, begin, end, [&](const Ptrs<2>& at, size_t i) {
          store_elems<V, A>(at.p[1], i, V::add(zero, load_elems<V, G>(at.p[0], i)));
        });
      } else {
        for_blocks<V::W>(streams, begin, end, [&](const Ptrs<2>& at, size_t i) {
          store_elems<V, A>(at.p[1], i, V::add(load_elems<V, A>(at.p[1], i), load_elems<V, G>(at.p[0], i)));
        });
      }
    }
  });
}

// Fixed pairwise reduction of the 16 lane sums: (((l0+l8)+(l4+l12))+((l2+l10)+(l6+l14))) + ... as
// a loop, the same on every path.
static inline double reduce_lanes(double (&lanes)[kNormLanes]) {
  for (size_t half = kNormLanes / 2; half >= 1; half /= 2)
    for (size_t l = 0; l < half; ++l) lanes[l] = lanes[l] + lanes[l + half];
  return lanes[0];
}

// Note [Prefetching a lone read stream]: a pass that only reads one stream and does more than an add
// per element (the squared norm widens to double, squares and adds) ran at 0.63 of the same stream's
// add-only pass on an Intel Xeon VM (AVX-512, 2 cores; 9.8 against 15.6 GB/s per thread): the
// hardware prefetcher stayed too close behind it. Asking for the line kPrefetchAheadBytes ahead,
// once per block, brought a stand-alone copy of the loop from 10.2 to 13.6 GB/s (the add-only pass:
// 14.6, 15.3 with the same prefetch). A prefetch changes no result and cannot fault, so the tail
// block (a stack copy) and the last blocks of a tile may ask for any address. The roofline pass of
// this mix prefetches the same way, so the ratio compares like with like.
inline constexpr size_t kPrefetchAheadBytes = 8192;

inline void prefetch_ahead(const void* base, size_t offset_bytes) {
  __builtin_prefetch(static_cast<const unsigned char*>(base) + offset_bytes + kPrefetchAheadBytes, 0, 3);
}

template <class V>
double squared_norm_kernel(const void* src, DType dtype, size_t begin, size_t end) {
  constexpr size_t kLanes = kNormLanes;
  static_assert(kLanes % V::W == 0);
  typename V::NormAcc acc;
  V::norm_zero(acc);
  with_dtypes(dtype, nullptr, DType::kF32, [&]<DType S, bool, DType>() {
    const Stream streams[1] = {{const_cast<void*>(src), kElemBytes<S>, false}};
    for_blocks<kLanes>(streams, begin, end, [&](const Ptrs<1>& at, size_t i) {
      prefetch_ahead(at.p[0], i * kElemBytes<S>);  // Note [Prefetching a lone read stream]
      for (size_t k = 0; k < kLanes / V::W; ++k) V::norm_add(acc, k, load_elems<V, S>(at.p[0], i + k * V::W));
    });
  });
  double lanes[kLanes];
  V::norm_lanes(acc, lanes);
  return reduce_lanes(lanes);
}

template <class V>
void triad_kernel(float* a, const float* b, const float* c, float scalar, size_t begin, size_t end) {
  using F = typename V::F;
  const F s = V::set1(scalar);
  const Stream streams[3] = {{a, 4, true}, {const_cast<float*>(b), 4, false}, {const_cast<float*>(c), 4, false}};
  for_blocks<V::W>(streams, begin, end, [&](const Ptrs<3>& at, size_t i) {
    // mul + add, not fma: the scalar path's fma is a libm call, which would make its triad
    // compute-bound instead of the memory-bandwidth baseline it is meant to be.
    V::store(static_cast<float*>(at.p[0]) + i, V::add(V::load(static_cast<const float*>(at.p[1]) + i),
                                                      V::mul(V::load(static_cast<const float*>(at.p[2]) + i), s)));
  });
}

// A memory roofline with a kernel's stream mix: one add per element and nothing else, through the
// same for_blocks loop, loads and widening as the kernels. kRw fp32 streams are read and written in
// place, one stream (dtype R) is read; with no written stream the reads are summed so that they
// cannot be elided.
template <class V, size_t kRw, DType R>
double roofline_mix(float* const* rw, const void* ro, size_t begin, size_t end) {
  using F = typename V::F;
  Stream streams[kRw + 1];
  for (size_t j = 0; j < kRw; ++j) streams[j] = {rw[j], 4, true};
  streams[kRw] = {const_cast<void*>(ro), kElemBytes<R>, false};
  F acc = V::set1(0.0f);
  for_blocks<V::W>(streams, begin, end, [&](const Ptrs<kRw + 1>& at, size_t i) {
    if constexpr (kRw == 0) prefetch_ahead(at.p[kRw], i * kElemBytes<R>);  // the norm's mix: as the norm does
    const F x = load_elems<V, R>(at.p[kRw], i);
    if constexpr (kRw == 0) acc = V::add(acc, x);
    for (size_t j = 0; j < kRw; ++j) {
      float* q = static_cast<float*>(at.p[j]) + i;
      V::store(q, V::add(V::load(q), x));
    }
  });
  alignas(64) float lanes[V::W];
  V::store(lanes, acc);
  double sum = 0;
  for (size_t l = 0; l < V::W; ++l) sum += lanes[l];
  return sum;
}

template <class V>
double roofline_kernel(float* const* rw, size_t n_rw, const void* ro, DType ro_dtype, size_t begin, size_t end) {
  double out = 0;
  with_dtypes(ro_dtype, nullptr, DType::kF32, [&]<DType R, bool, DType>() {
    switch (n_rw) {
      case 0: out = roofline_mix<V, 0, R>(rw, ro, begin, end); break;
      case 1: out = roofline_mix<V, 1, R>(rw, ro, begin, end); break;
      case 2: out = roofline_mix<V, 2, R>(rw, ro, begin, end); break;
      default: out = roofline_mix<V, 3, R>(rw, ro, begin, end); break;
    }
  });
  return out;
}

template <class V>
void fill_kernel(float* data, float value, size_t begin, size_t end) {
  const typename V::F x = V::set1(value);
  const Stream streams[1] = {{data, 4, true}};
  for_blocks<V::W>(streams, begin, end,
                   [&](const Ptrs<1>& at, size_t i) { V::store(static_cast<float*>(at.p[0]) + i, x); });
}

// The entry of a map nearest x, per lane (its low byte), the lower on a tie, 0 for NaN, from the
// map's QuantTable: one lookup of x's bucket, whose entry holds the bucket's first code and the low
// 16 bits of the threshold (if any) past which the code is one more.
template <class V>
ZO_KERNEL_INLINE inline typename V::I nearest_code(const QuantTable& t, typename V::F x) {
  return V::code_in_bucket(V::lookup_u32(t.entry, V::bucket_of(x)), x);
}

// Note [Dividing by a constant in double]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The 8-bit kernels divide by two kinds of constant: a block's absmax (each moment over it, to
// re-quantize) and c2 (sqrt(v) / c2, per call). A core has one divider; a 16-lane vdivps holds it
// 10 cycles on Skylake-X, so with the update's own division and sqrt these would be five divider
// operations per element there. The AVX-512 path instead multiplies by the divisor's reciprocal in
// double and rounds the product to float, which is the correctly rounded x / d (below). The AVX2
// path divides (V::div_by is vdivps): on Zen 3 an 8-lane vdivps holds the divider 3.5 cycles, and
// the double product's conversions, 12 micro-ops per 8 lanes, cost more than the divider time they
// save; with them the 8-bit step over 16 Ki parameters in L2 took 3.5 ns per parameter on one
// thread of the 2-core EPYC, with vdivps 2.7 (the same codes and parameters).
// * y = double(1/d) and double(x·y) each round once to 53 bits, so the product is within 2^-51.9
//   (relative) of q = x / d.
// * q is not within 2^-49 (relative) of any midpoint M between two adjacent normal floats. Write
//   x = X·2^ex, d = D·2^ed, M = K·2^eM with integers X < 2^24, D < 2^24 and K odd, 2^24 < K < 2^25.
//   x − M·d = X·2^ex − K·D·2^(eM+ed) is not 0 (its second term's odd part, at least K > 2^24, is not
//   the first's, below 2^24) and for q near M, eM + ed <= ex, so |x − M·d| >= 2^(eM+ed) while
//   M·d < 2^(49+eM+ed).
// So the product lies strictly on q's side of every such midpoint and rounds to float (to nearest,
// as MXCSR is on every path) as q does, overflow to inf included. Where |q| < 2^-126 the two may
// differ by a subnormal ulp, which never shows here: a moment over its absmax only picks a code,
// and no bucket of an |x| below 2^-24 holds a threshold (build_quant_table checks); sqrt(v) / c2
// with c2 <= 1 is 0 or at least sqrt(2^-149). The specials agree: d = 0 gives y = inf (0·inf = NaN
// = 0/0; |x| <= absmax = 0), d = inf gives y = 0 (x·0 = ±0 = x/inf for finite x, inf·0 = NaN =
// inf/inf), NaN stays NaN. The scalar path divides, so every test holding
// AVX-512 to scalar checks this too, and SimdPath.NearestCodesOfQuotientsMatchScalar aims at the
// thresholds with divisors of every kind (a float reciprocal instead fails it at once).

// Note [Prefetching the 8-bit streams]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// An 8-bit block does far more work per element between its loads than the fp32 step, so the
// out-of-order window holds few of them: with the hardware prefetcher alone, a step over 2·10^7
// parameters (in DRAM) took 8.8–10.6 ns per parameter on one thread of the 2-core EPYC, the same
// step over 64 Ki (in L2) 4.1, the loads waiting on DRAM one after another; with the prefetches
// below, 7.0–8.5 (a loaded machine). Each block therefore asks, before its own work, for the
// lines of the block kPrefetchBlocksAhead further on, in every stream it reads or writes (the
// written ones for writing). A prefetch changes no result and cannot fault, so the last blocks of a
// tile may ask past its end.
inline constexpr size_t kPrefetchBlocksAhead = 2;

template <size_t kBytes, int kWrite>
ZO_KERNEL_INLINE inline void prefetch_block_ahead(const void* block_start) {
  const unsigned char* p = static_cast<const unsigned char*>(block_start) + kPrefetchBlocksAhead * kQuantBlock * kBytes;
  for (size_t off = 0; off < kQuantBlock * kBytes; off += 64) __builtin_prefetch(p + off, kWrite, 3);
}

// Runs update(at, i, index, track_max) over the W-wide steps of a block's n elements, with
// track_max (a std::bool_constant) true on the full steps, whose lanes are all the block's, and
// false on a last partial step, whose padded lanes must not count; then zeroes the block's local
// floats past n up to the next multiple of W (in each of `locals`) and returns the first index the
// full steps did not cover, from which the caller folds the locals into its maxima.
template <size_t W, size_t N, size_t L, class Update>
ZO_KERNEL_INLINE inline size_t update_block(const Stream (&streams)[N], size_t n, float* const (&locals)[L],
                                            Update&& update) {
  const size_t full = n / W * W;
  for_blocks_at<W>(streams, 0, full, [&](const Ptrs<N>& at, size_t i, size_t index) ZO_KERNEL_INLINE {
    update(at, i, index, std::true_type{});
  });
  if (full == n) return n;
  for_blocks_at<W>(streams, full, n, [&](const Ptrs<N>& at, size_t i, size_t index) ZO_KERNEL_INLINE {
    update(at, i, index, std::false_type{});
  });
  for (float* local : locals)
    for (size_t j = n; j < full + W; ++j) local[j] = 0.0f;  // +0: no absmax is below it
  return full;
}

// One block of 8-bit blockwise Adam, elements [first, first + n), n <= 256: dequantize, update in
// bitsandbytes' order (docs/cpu_optim.md), then the block's absmax (the largest non-NaN |x|, 0 if
// none; kept in registers as the update goes) and the nearest codes. The new moments between the
// two passes live in two local arrays, in L1.
template <class V, DType P, DType G, bool kCopy, DType C>
void adam8bit_block(const Adam8bitArgs& a, typename V::Divisor c2, size_t first, size_t n) {
  using F = typename V::F;
  constexpr size_t W = V::W;
  const Adam8bitConstants& k = a.k;
  const F scale = V::set1(k.grad_scale), b1 = V::set1(k.beta1), omb1 = V::set1(k.one_minus_beta1),
          b2 = V::set1(k.beta2), omb2 = V::set1(k.one_minus_beta2), eps = V::set1(k.eps),
          step_size = V::set1(k.step_size), decay = V::set1(k.decay), wd = V::set1(k.wd);
  const size_t b = first / kQuantBlock;
  prefetch_block_ahead<kElemBytes<P>, 1>(static_cast<char*>(a.p.params) + first * kElemBytes<P>);
  prefetch_block_ahead<kElemBytes<G>, 0>(static_cast<const char*>(a.grad) + first * kElemBytes<G>);
  if constexpr (kCopy) prefetch_block_ahead<kElemBytes<C>, 1>(static_cast<char*>(a.copy_out) + first * kElemBytes<C>);
  prefetch_block_ahead<1, 1>(a.m_codes + first);
  prefetch_block_ahead<1, 1>(a.v_codes + first);
  const F m_scale = V::set1(a.m_absmax[b]), v_scale = V::set1(a.v_absmax[b]);
  alignas(64) float m_new[kQuantBlock], v_new[kQuantBlock];
  const Stream update[7] = {
      {static_cast<char*>(a.p.params) + first * kElemBytes<P>, kElemBytes<P>, true},
      {a.m_codes + first, 1, false},
      {a.v_codes + first, 1, false},
      {const_cast<char*>(static_cast<const char*>(a.grad)) + first * kElemBytes<G>, kElemBytes<G>, false},
      {kCopy ? static_cast<char*>(a.copy_out) + first * kElemBytes<C> : nullptr, kElemBytes<C>, true},
      {m_new, 4, true},
      {v_new, 4, true}};
  F m_max = V::set1(0.0f), v_max = V::set1(0.0f);
  const auto step = [&](const Ptrs<7>& at, size_t i, size_t index, auto track_max) ZO_KERNEL_INLINE {
    F g = V::mul(load_elems<V, G>(at.p[3], i), scale);
    F p = load_elems<V, P>(at.p[0], i);
    if (k.use_l2) g = V::fma(p, wd, g);
    F m = V::mul(V::lookup_codes(a.m_map, static_cast<const uint8_t*>(at.p[1]) + i), m_scale);
    F v = V::mul(V::lookup_codes(a.v_map, static_cast<const uint8_t*>(at.p[2]) + i), v_scale);
    m = V::fma(g, omb1, V::mul(m, b1));
    v = V::fma(V::mul(omb2, g), g, V::mul(v, b2));
    const F denom = V::add(V::div_by(V::sqrt(v), c2), eps);  // Note [Dividing by a constant in double]
    if (k.use_decoupled) p = V::mul(p, decay);
    p = V::add(V::div(V::mul(step_size, m), denom), p);
    store_params<V, P, kCopy, C>(a.p, at.p[0], at.p[4], i, first + index, p);
    V::store(static_cast<float*>(at.p[5]) + i, m);
    V::store(static_cast<float*>(at.p[6]) + i, v);
    if constexpr (decltype(track_max)::value) {
      m_max = V::max_keep(m_max, V::abs(m));
      v_max = V::max_keep(v_max, V::abs(v));
    }
  };
  const size_t tail = update_block<W>(update, n, {m_new, v_new}, step);
  if (tail < n) {
    m_max = V::max_keep(m_max, V::abs(V::load(m_new + tail)));
    v_max = V::max_keep(v_max, V::abs(V::load(v_new + tail)));
  }
  const float m_amax = V::hmax(m_max), v_amax = V::hmax(v_max);
  a.m_absmax[b] = m_amax;
  a.v_absmax[b] = v_amax;
  const typename V::Divisor m_div = V::divisor(m_amax), v_div = V::divisor(v_amax);
  const Stream quantize[4] = {
      {m_new, 4, false}, {v_new, 4, false}, {a.m_codes + first, 1, true}, {a.v_codes + first, 1, true}};
  for_blocks<W>(quantize, 0, n, [&](const Ptrs<4>& at, size_t i) ZO_KERNEL_INLINE {
    V::store_codes(static_cast<uint8_t*>(at.p[2]) + i,
                   nearest_code<V>(*a.m_quant, V::div_by(V::load(static_cast<const float*>(at.p[0]) + i), m_div)));
    V::store_codes(static_cast<uint8_t*>(at.p[3]) + i,
                   nearest_code<V>(*a.v_quant, V::div_by(V::load(static_cast<const float*>(at.p[1]) + i), v_div)));
  });
}

template <class V>
void adam8bit_kernel(const Adam8bitArgs& a, size_t begin, size_t end) {
  with_param_dtype(a.p.param_dtype, [&]<DType P>() {
    with_dtypes(a.grad_dtype, a.copy_out, a.copy_dtype, [&]<DType G, bool kCopy, DType C>() {
      if constexpr (kValidCopy<P, kCopy, C>) {
        const typename V::Divisor c2 = V::divisor(a.k.c2);
        for (size_t first = begin; first < end; first += kQuantBlock)
          adam8bit_block<V, P, G, kCopy, C>(a, c2, first, end - first < kQuantBlock ? end - first : kQuantBlock);
      }
    });
  });
}

// One block of Lion or Adagrad with an 8-bit blockwise state, elements [first, first + n), n <= 256:
// dequantize, update in bitsandbytes' CPU order (backends/cpu/ops.py; docs/cpu_optim.md), then the
// block's absmax and the nearest codes, as adam8bit_block does for two states.
template <class V, DType P, DType G, bool kCopy, DType C>
void one_state8bit_block(const OneState8bitArgs& a, size_t first, size_t n) {
  using F = typename V::F;
  constexpr size_t W = V::W;
  const F scale = V::set1(a.grad_scale), b1 = V::set1(a.beta1), omb1 = V::set1(a.one_minus_beta1),
          b2 = V::set1(a.beta2), omb2 = V::set1(a.one_minus_beta2), lr = V::set1(a.lr),
          after_decay = V::set1(a.after_decay), eps = V::set1(a.eps), neg_lr = V::set1(a.neg_lr),
          wd = V::set1(a.weight_decay), zero = V::set1(0.0f), minus_one = V::set1(-1.0f);
  const bool lion = a.lion, use_decay = a.use_decay;
  const size_t b = first / kQuantBlock;
  prefetch_block_ahead<kElemBytes<P>, 1>(static_cast<char*>(a.p.params) + first * kElemBytes<P>);
  prefetch_block_ahead<kElemBytes<G>, 0>(static_cast<const char*>(a.grad) + first * kElemBytes<G>);
  if constexpr (kCopy) prefetch_block_ahead<kElemBytes<C>, 1>(static_cast<char*>(a.copy_out) + first * kElemBytes<C>);
  prefetch_block_ahead<1, 1>(a.codes + first);  // Note [Prefetching the 8-bit streams]
  const F s_scale = V::set1(a.absmax[b]);
  alignas(64) float s_new[kQuantBlock];
  const Stream update[5] = {
      {static_cast<char*>(a.p.params) + first * kElemBytes<P>, kElemBytes<P>, true},
      {a.codes + first, 1, false},
      {const_cast<char*>(static_cast<const char*>(a.grad)) + first * kElemBytes<G>, kElemBytes<G>, false},
      {kCopy ? static_cast<char*>(a.copy_out) + first * kElemBytes<C> : nullptr, kElemBytes<C>, true},
      {s_new, 4, true}};
  F s_max = V::set1(0.0f);
  const auto step = [&](const Ptrs<5>& at, size_t i, size_t index, auto track_max) ZO_KERNEL_INLINE {
    F g = V::mul(load_elems<V, G>(at.p[2], i), scale);
    F p = load_elems<V, P>(at.p[0], i);
    F st = V::mul(V::lookup_codes(a.map, static_cast<const uint8_t*>(at.p[1]) + i), s_scale);
    if (lion) {
      if (use_decay) p = V::mul(p, after_decay);
      F c = V::add(V::mul(st, b1), V::mul(g, omb1));
      // torch.sign(NaN) is 0: a NaN c moves nothing, as in bitsandbytes. c's positive part minus its
      // negative part is c exactly, and 0 for NaN (max_keep drops it).
      c = V::add(V::max_keep(zero, c), V::mul(minus_one, V::max_keep(zero, V::mul(minus_one, c))));
      p = V::add(p, V::lion_update(c, lr));
      st = V::fma(g, omb2, V::mul(st, b2));
    } else {  // zoffload's Adagrad (the numerator before weight decay) in bitsandbytes' operations,
              // whose decay term is added even at weight decay 0 (so a non-finite p poisons d)
      const F d = V::fma(p, wd, g);
      st = V::fma(d, d, st);
      p = V::add(V::div(V::mul(neg_lr, g), V::add(V::sqrt(st), eps)), p);
    }
    store_params<V, P, kCopy, C>(a.p, at.p[0], at.p[3], i, first + index, p);
    V::store(static_cast<float*>(at.p[4]) + i, st);
    if constexpr (decltype(track_max)::value) s_max = V::max_keep(s_max, V::abs(st));
  };
  const size_t tail = update_block<W>(update, n, {s_new}, step);
  if (tail < n) s_max = V::max_keep(s_max, V::abs(V::load(s_new + tail)));
  const float s_amax = V::hmax(s_max);
  a.absmax[b] = s_amax;
  const typename V::Divisor s_div = V::divisor(s_amax);
  const Stream quantize[2] = {{s_new, 4, false}, {a.codes + first, 1, true}};
  for_blocks<W>(quantize, 0, n, [&](const Ptrs<2>& at, size_t i) ZO_KERNEL_INLINE {
    V::store_codes(static_cast<uint8_t*>(at.p[1]) + i,
                   nearest_code<V>(*a.quant, V::div_by(V::load(static_cast<const float*>(at.p[0]) + i), s_div)));
  });
}

template <class V>
void one_state8bit_kernel(const OneState8bitArgs& a, size_t begin, size_t end) {
  with_param_dtype(a.p.param_dtype, [&]<DType P>() {
    with_dtypes(a.grad_dtype, a.copy_out, a.copy_dtype, [&]<DType G, bool kCopy, DType C>() {
      if constexpr (kValidCopy<P, kCopy, C>) {
        for (size_t first = begin; first < end; first += kQuantBlock)
          one_state8bit_block<V, P, G, kCopy, C>(a, first, end - first < kQuantBlock ? end - first : kQuantBlock);
      }
    });
  });
}

template <class V>
void nearest_codes_kernel(const QuantTable& table, const float* x, float divisor, uint8_t* codes, size_t begin,
                          size_t end) {
  const typename V::Divisor d = V::divisor(divisor);
  const Stream streams[2] = {{const_cast<float*>(x), 4, false}, {codes, 1, true}};
  for_blocks<V::W>(streams, begin, end, [&](const Ptrs<2>& at, size_t i) {
    V::store_codes(static_cast<uint8_t*>(at.p[1]) + i,
                   nearest_code<V>(table, V::div_by(V::load(static_cast<const float*>(at.p[0]) + i), d)));
  });
}

template <class V>
constexpr KernelTable make_table(Isa isa) {
  return {isa,
          &adam_kernel<V>,
          &adagrad_kernel<V>,
          &lion_kernel<V>,
          &convert_kernel<V>,
          &accumulate_kernel<V>,
          &squared_norm_kernel<V>,
          &triad_kernel<V>,
          &roofline_kernel<V>,
          &fill_kernel<V>,
          &adam8bit_kernel<V>,
          &nearest_codes_kernel<V>,
          &one_state8bit_kernel<V>};
}

}  // namespace zo::cpu_optim::detail

#undef ZO_KERNEL_INLINE

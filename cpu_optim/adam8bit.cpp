// The two dynamic maps the 8-bit states index, their nearest-entry tables, and quantize_nearest (the
// kernels' nearest-entry rule for one value, through the scalar path).
// adam8bit_step is in optimizers.cpp, beside the other optimizers' validation and dispatch.
#include "cpu_optim/adam8bit.h"

#include <bit>
#include <limits>
#include <memory>

#include "common/adam_math.h"
#include "common/check.h"
#include "common/dynamic_maps.h"
#include "cpu_optim/detail/kernels.h"

namespace zo::cpu_optim {

const std::array<float, 256>& signed_dynamic_map() { return kSignedDynamicMap; }
const std::array<float, 256>& unsigned_dynamic_map() { return kUnsignedDynamicMap; }

// Note [Nearest codes by bucket]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Re-quantizing takes, for each x = m / absmax, the entry of a 256-entry ascending map nearest x,
// the lower on a tie, 0 for NaN (the rule of zo::nearest_map_entry in common/adam_math.h, computed in
// float as the kernels compute it; the device's 8-bit Adam runs it per element). A binary search
// over the map costs 8 dependent comparisons and, on AVX2/AVX-512, gathers: it was about 90% of the
// 8-bit step. Instead:
//
// * Thresholds. Between two neighbours map[c] < map[c+1], "map[c+1] is strictly nearer" is
//   |x - map[c+1]| < |x - map[c]| in float, which is monotone in x (a float subtraction is monotone
//   in its first operand): false at map[c], true at map[c+1]. So there is one smallest float tau[c]
//   from which the nearest entry is above c, and the nearest entry of any x is the number of
//   thresholds at or below it. build_quant_table finds each tau[c] by bisection over the floats
//   between the two entries, with nearest_map_entry itself deciding.
// * Buckets. A float's bits above bit 16 (sign, exponent, 7 mantissa bits) split each binade into
//   128 buckets of equal width, as fine relative to x everywhere as the maps are. With 7 bits, no
//   bucket of either dynamic map holds two thresholds (6 bits would put two in 8 buckets of the
//   unsigned map).
// * One entry per bucket. All x of a bucket share their bits above bit 16, so "x >= the bucket's
//   threshold" is a compare of x's low 16 bits with the threshold's (both inverted for negative x,
//   whose bits grow as x falls). Each bucket's 32-bit entry packs that 16-bit key (0x10000 where
//   the bucket has no threshold: above every key) and the nearest entry c of the bucket's smallest
//   float, as (key << 9) | (c + 1); the code of x is c + 1 minus one where x's key is below the
//   entry's. Before issue 61 the table held the first codes (bytes) and the 256 thresholds
//   (floats) apart, two dependent lookups per value.
// * Every bit pattern has its bucket. The table has an entry for each of the 2^16 values of x's
//   bits >> 16 (256 KiB per map, of which a step touches the few KiB its moments fall in), so the
//   bucket is one shift. It used to clamp |x| below 2^-24 and from 2 up into two end buckets
//   (25.7 KB per map) and zero NaN's code apart: per eight lanes, seven more
//   vector operations for each of the two moments. inf and NaN now get their codes from their
//   own buckets: NaN's and -inf's give 0, and the bucket of +inf and the NaNs next to it, whose
//   bits differ below bit 16 only, gives 255 at key 0 (+inf) and 256 past it, whose low byte, the
//   code stored, is 0.
// * The lookups. AVX-512 gathers them; AVX2 loads the eight lanes one by one and inserts them,
//   which on Zen 3 costs about two thirds of a vpgatherdd (9 against 13.5 cycles for eight lanes,
//   measured on the 2-core EPYC), as does dequantizing (map[code]) straight from the code bytes.
//
// build_quant_table checks the one-threshold property for every bucket and both signs from the two
// ends of each bucket (nearest_map_entry is monotone, so the ends bound everything between), that
// a bucket's threshold has the bucket's high bits and that no bucket below 2^-24 holds one, and
// aborts otherwise, so a wrong table cannot be built. The result is the binary search's, bit for
// bit: a one-off run put all 2^32 floats through the AVX2 kernel and nearest_map_entry (no
// difference, either map; repeated for the packed entries and again for the full-width table),
// and the tests compare every ISA's codes with a scan of the neighbouring entries over 1.1 M
// values and, for quotients by every kind of absmax, with the scalar path (tests/cpu_optim).
namespace {

// Floats in ascending order as integers, and back (-0 and +0 both map to 0).
int64_t ordered(float x) {
  const uint32_t b = std::bit_cast<uint32_t>(x);
  return (b >> 31) != 0 ? -static_cast<int64_t>(b & 0x7FFFFFFFu) : static_cast<int64_t>(b);
}
float from_ordered(int64_t k) {
  return std::bit_cast<float>(k >= 0 ? static_cast<uint32_t>(k) : static_cast<uint32_t>(-k) | 0x80000000u);
}

}  // namespace

namespace detail {
void build_quant_table(const float* map, QuantTable& t) {
  float tau[255];  // tau[c]: the smallest float whose nearest entry is above c
  for (size_t c = 0; c < 255; ++c) {
    ZO_CHECK(map[c] < map[c + 1]) << "the map is not ascending at " << c;
    int64_t lo = ordered(map[c]), hi = ordered(map[c + 1]);  // nearest_map_entry: c at lo, c + 1 at hi
    ZO_CHECK(nearest_map_entry(map, from_ordered(lo)) == c && nearest_map_entry(map, from_ordered(hi)) == c + 1);
    while (hi - lo > 1) {
      const int64_t mid = lo + (hi - lo) / 2;
      (nearest_map_entry(map, from_ordered(mid)) > c ? hi : lo) = mid;
    }
    tau[c] = from_ordered(hi);
  }
  constexpr uint32_t kInfBucket = 0x7F80;           // +inf's bits >> 16, the NaNs' from there up
  constexpr uint32_t kNoThresholdBelow = 103 << 7;  // 2^-24's bits >> 16
  const float inf = std::numeric_limits<float>::infinity();
  ZO_CHECK(nearest_map_entry(map, inf) == 255 && nearest_map_entry(map, -inf) == 0);
  for (uint32_t h = 0; h < kQuantBuckets; ++h) {
    const bool negative = (h >> 15) != 0;
    const uint32_t magnitude = h & 0x7FFFu;
    if (magnitude >= kInfBucket) {
      // -inf and every NaN: 0. +inf (key 0): 255, from c + 1 = 256 and a threshold at key 1, past
      // which the NaNs of its bucket get 256, whose low byte (the code stored) is 0.
      t.entry[h] =
          magnitude == kInfBucket && !negative ? 1u << kQuantCodeBits | 256u : kQuantNoThreshold << kQuantCodeBits | 1u;
      continue;
    }
    const float a = std::bit_cast<float>(magnitude << 16), b = std::bit_cast<float>(magnitude << 16 | 0xFFFFu);
    const float smallest = negative ? -b : a, largest = negative ? -a : b;  // the bucket's ends, finite
    const uint8_t first = nearest_map_entry(map, smallest), last = nearest_map_entry(map, largest);
    ZO_CHECK(last <= first + 1) << "bucket " << h << " holds two thresholds of the map";
    // Below 2^-24 a quotient in double may be a subnormal ulp off (Note [Dividing by a constant in
    // double] in detail/kernel_impl.h): no code may change there.
    ZO_CHECK(last == first || magnitude >= kNoThresholdBelow) << "bucket " << h << " holds a threshold below 2^-24";
    uint32_t key = kQuantNoThreshold;
    if (last != first) {
      // Every x of the bucket has the threshold's bits above bit 16: the low 16 bits decide, in
      // the order of x (inverted where x < 0, whose bits grow as x falls).
      const uint32_t bits = std::bit_cast<uint32_t>(tau[first]);
      ZO_CHECK((bits >> 16) == h) << "bucket " << h << ": its threshold is not in it";
      key = (negative ? ~bits : bits) & 0xFFFFu;
    }
    t.entry[h] = key << kQuantCodeBits | (first + 1u);
  }
}

namespace {
std::unique_ptr<QuantTable> quant_table_of(const float* map) {
  auto t = std::make_unique<QuantTable>();
  build_quant_table(map, *t);
  return t;
}
}  // namespace

const QuantTable& signed_map_quant_table() {
  static const std::unique_ptr<QuantTable> t = quant_table_of(kSignedDynamicMap.data());
  return *t;
}

const QuantTable& unsigned_map_quant_table() {
  static const std::unique_ptr<QuantTable> t = quant_table_of(kUnsignedDynamicMap.data());
  return *t;
}
}  // namespace detail

uint8_t quantize_nearest(const std::array<float, 256>& map, float x) {
  std::unique_ptr<detail::QuantTable> other;  // a map other than the two dynamic ones
  const detail::QuantTable* table = &detail::signed_map_quant_table();
  if (map == kUnsignedDynamicMap) {
    table = &detail::unsigned_map_quant_table();
  } else if (map != kSignedDynamicMap) {
    other = std::make_unique<detail::QuantTable>();
    detail::build_quant_table(map.data(), *other);
    table = other.get();
  }
  uint8_t code = 0;
  detail::kScalarKernels.nearest_codes(*table, &x, 1.0f, &code, 0, 1);
  return code;
}

}  // namespace zo::cpu_optim

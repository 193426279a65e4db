// The two dynamic maps the 8-bit states index, their nearest-entry tables, and quantize_nearest (the
// kernels' nearest-entry rule for one value, through the scalar path).
// adam8bit_step is in optimizers.cpp, beside the other optimizers' validation and dispatch.
#include "cpu_optim/adam8bit.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <memory>

#include "common/check.h"
#include "cpu_optim/detail/kernels.h"

namespace zo::cpu_optim {
namespace {

// bitsandbytes 0.50.2's create_dynamic_map(signed=True) and (signed=False), as returned (fp32
// bit patterns, ascending); tests/cpu_optim/adam8bit_bnb_test.py checks them against it.
// clang-format off
constexpr std::array<float, 256> kSignedDynamicMap = {
    -0x1.fc6666p-1f, -0x1.f53334p-1f, -0x1.eep-1f, -0x1.e6ccccp-1f, -0x1.df999ap-1f, -0x1.d86666p-1f,
    -0x1.d13334p-1f, -0x1.cap-1f, -0x1.c2ccccp-1f, -0x1.bb999ap-1f, -0x1.b46666p-1f, -0x1.ad3334p-1f,
    -0x1.a6p-1f, -0x1.9eccccp-1f, -0x1.97999ap-1f, -0x1.906666p-1f, -0x1.893334p-1f, -0x1.82p-1f,
    -0x1.7accccp-1f, -0x1.73999ap-1f, -0x1.6c6668p-1f, -0x1.653334p-1f, -0x1.5ep-1f, -0x1.56ccccp-1f,
    -0x1.4f999ap-1f, -0x1.486668p-1f, -0x1.413334p-1f, -0x1.3ap-1f, -0x1.32ccccp-1f, -0x1.2b999ap-1f,
    -0x1.246668p-1f, -0x1.1d3334p-1f, -0x1.16p-1f, -0x1.0eccccp-1f, -0x1.079998p-1f, -0x1.006666p-1f,
    -0x1.f26664p-2f, -0x1.e4p-2f, -0x1.d59998p-2f, -0x1.c73334p-2f, -0x1.b8ccccp-2f, -0x1.aa6666p-2f,
    -0x1.9cp-2f, -0x1.8d9998p-2f, -0x1.7f3334p-2f, -0x1.70ccccp-2f, -0x1.626666p-2f, -0x1.54p-2f,
    -0x1.459998p-2f, -0x1.373334p-2f, -0x1.28ccccp-2f, -0x1.1a6668p-2f, -0x1.0cp-2f, -0x1.fb3332p-3f,
    -0x1.de6666p-3f, -0x1.c1999ap-3f, -0x1.a4ccccp-3f, -0x1.88p-3f, -0x1.6b3334p-3f, -0x1.4e6666p-3f,
    -0x1.31999ap-3f, -0x1.14ccccp-3f, -0x1.fp-4f, -0x1.b66668p-4f, -0x1.93d70ap-4f, -0x1.8851eep-4f,
    -0x1.7ccccep-4f, -0x1.7147aep-4f, -0x1.65c29p-4f, -0x1.5a3d7p-4f, -0x1.4eb854p-4f, -0x1.433334p-4f,
    -0x1.37ae14p-4f, -0x1.2c28f6p-4f, -0x1.20a3d6p-4f, -0x1.151ebap-4f, -0x1.09999ap-4f, -0x1.fc28f6p-5f,
    -0x1.e51ebap-5f, -0x1.ce147ap-5f, -0x1.b70a3ep-5f, -0x1.ap-5f, -0x1.88f5c2p-5f, -0x1.71eb86p-5f,
    -0x1.5ae146p-5f, -0x1.43d70ap-5f, -0x1.2ccccep-5f, -0x1.15c29p-5f, -0x1.fd70a4p-6f, -0x1.cf5c2ap-6f,
    -0x1.a147aep-6f, -0x1.733334p-6f, -0x1.451ebap-6f, -0x1.170a3ep-6f, -0x1.d1eb86p-7f, -0x1.75c29p-7f,
    -0x1.3e76c8p-7f, -0x1.2c083p-7f, -0x1.19999ap-7f, -0x1.072b02p-7f, -0x1.e978d4p-8f, -0x1.c49ba6p-8f,
    -0x1.9fbe76p-8f, -0x1.7ae148p-8f, -0x1.56041ap-8f, -0x1.3126e8p-8f, -0x1.0c49bap-8f, -0x1.ced914p-9f,
    -0x1.851eb8p-9f, -0x1.3b645ap-9f, -0x1.e353f8p-10f, -0x1.4fdf3ap-10f, -0x1.eecbfep-11f, -0x1.b3d07cp-11f,
    -0x1.78d5p-11f, -0x1.3dd982p-11f, -0x1.02de02p-11f, -0x1.8fc506p-12f, -0x1.19ce0ap-12f, -0x1.47ae16p-13f,
    -0x1.743e96p-14f, -0x1.15df66p-14f, -0x1.6f0068p-15f, -0x1.64840cp-16f, -0x1.040bfep-17f, -0x1.b43528p-19f,
    -0x1.27476ep-21f, 0.0f, 0x1.27476ep-21f, 0x1.b43528p-19f, 0x1.040bfep-17f, 0x1.64840cp-16f,
    0x1.6f0068p-15f, 0x1.15df66p-14f, 0x1.743e96p-14f, 0x1.47ae16p-13f, 0x1.19ce0ap-12f, 0x1.8fc506p-12f,
    0x1.02de02p-11f, 0x1.3dd982p-11f, 0x1.78d5p-11f, 0x1.b3d07cp-11f, 0x1.eecbfep-11f, 0x1.4fdf3ap-10f,
    0x1.e353f8p-10f, 0x1.3b645ap-9f, 0x1.851eb8p-9f, 0x1.ced914p-9f, 0x1.0c49bap-8f, 0x1.3126e8p-8f,
    0x1.56041ap-8f, 0x1.7ae148p-8f, 0x1.9fbe76p-8f, 0x1.c49ba6p-8f, 0x1.e978d4p-8f, 0x1.072b02p-7f,
    0x1.19999ap-7f, 0x1.2c083p-7f, 0x1.3e76c8p-7f, 0x1.75c29p-7f, 0x1.d1eb86p-7f, 0x1.170a3ep-6f,
    0x1.451ebap-6f, 0x1.733334p-6f, 0x1.a147aep-6f, 0x1.cf5c2ap-6f, 0x1.fd70a4p-6f, 0x1.15c29p-5f,
    0x1.2ccccep-5f, 0x1.43d70ap-5f, 0x1.5ae146p-5f, 0x1.71eb86p-5f, 0x1.88f5c2p-5f, 0x1.ap-5f,
    0x1.b70a3ep-5f, 0x1.ce147ap-5f, 0x1.e51ebap-5f, 0x1.fc28f6p-5f, 0x1.09999ap-4f, 0x1.151ebap-4f,
    0x1.20a3d6p-4f, 0x1.2c28f6p-4f, 0x1.37ae14p-4f, 0x1.433334p-4f, 0x1.4eb854p-4f, 0x1.5a3d7p-4f,
    0x1.65c29p-4f, 0x1.7147aep-4f, 0x1.7ccccep-4f, 0x1.8851eep-4f, 0x1.93d70ap-4f, 0x1.b66668p-4f,
    0x1.fp-4f, 0x1.14ccccp-3f, 0x1.31999ap-3f, 0x1.4e6666p-3f, 0x1.6b3334p-3f, 0x1.88p-3f,
    0x1.a4ccccp-3f, 0x1.c1999ap-3f, 0x1.de6666p-3f, 0x1.fb3332p-3f, 0x1.0cp-2f, 0x1.1a6668p-2f,
    0x1.28ccccp-2f, 0x1.373334p-2f, 0x1.459998p-2f, 0x1.54p-2f, 0x1.626666p-2f, 0x1.70ccccp-2f,
    0x1.7f3334p-2f, 0x1.8d9998p-2f, 0x1.9cp-2f, 0x1.aa6666p-2f, 0x1.b8ccccp-2f, 0x1.c73334p-2f,
    0x1.d59998p-2f, 0x1.e4p-2f, 0x1.f26664p-2f, 0x1.006666p-1f, 0x1.079998p-1f, 0x1.0eccccp-1f,
    0x1.16p-1f, 0x1.1d3334p-1f, 0x1.246668p-1f, 0x1.2b999ap-1f, 0x1.32ccccp-1f, 0x1.3ap-1f,
    0x1.413334p-1f, 0x1.486668p-1f, 0x1.4f999ap-1f, 0x1.56ccccp-1f, 0x1.5ep-1f, 0x1.653334p-1f,
    0x1.6c6668p-1f, 0x1.73999ap-1f, 0x1.7accccp-1f, 0x1.82p-1f, 0x1.893334p-1f, 0x1.906666p-1f,
    0x1.97999ap-1f, 0x1.9eccccp-1f, 0x1.a6p-1f, 0x1.ad3334p-1f, 0x1.b46666p-1f, 0x1.bb999ap-1f,
    0x1.c2ccccp-1f, 0x1.cap-1f, 0x1.d13334p-1f, 0x1.d86666p-1f, 0x1.df999ap-1f, 0x1.e6ccccp-1f,
    0x1.eep-1f, 0x1.f53334p-1f, 0x1.fc6666p-1f, 0x1p+0f,
};
constexpr std::array<float, 256> kUnsignedDynamicMap = {
    0.0f, 0x1.5cf754p-22f, 0x1.a0133p-21f, 0x1.1d367p-19f, 0x1.2599ecp-18f, 0x1.bc98a2p-18f,
    0x1.29cbaap-17f, 0x1.0624dcp-16f, 0x1.c2e34p-16f, 0x1.3fd0dp-15f, 0x1.9e3p-15f, 0x1.fc8f34p-15f,
    0x1.2d7732p-14f, 0x1.5ca6c8p-14f, 0x1.8bd662p-14f, 0x1.0cb296p-13f, 0x1.82a994p-13f, 0x1.f8a092p-13f,
    0x1.374bc8p-12f, 0x1.724744p-12f, 0x1.ad42c6p-12f, 0x1.e83e44p-12f, 0x1.119ce2p-11f, 0x1.2f1aap-11f,
    0x1.4c986p-11f, 0x1.6a162p-11f, 0x1.8793dep-11f, 0x1.a511ap-11f, 0x1.c28f5ep-11f, 0x1.e00d1cp-11f,
    0x1.fd8adcp-11f, 0x1.2b020cp-10f, 0x1.74bc6ap-10f, 0x1.be76c8p-10f, 0x1.041894p-9f, 0x1.28f5c2p-9f,
    0x1.4dd2fp-9f, 0x1.72b02p-9f, 0x1.978d4ep-9f, 0x1.bc6a8p-9f, 0x1.e147aep-9f, 0x1.03126ep-8f,
    0x1.158104p-8f, 0x1.27ef9ep-8f, 0x1.3a5e34p-8f, 0x1.4cccccp-8f, 0x1.5f3b64p-8f, 0x1.71a9fap-8f,
    0x1.841894p-8f, 0x1.96872ap-8f, 0x1.a8f5c2p-8f, 0x1.bb645cp-8f, 0x1.cdd2fp-8f, 0x1.e0418ap-8f,
    0x1.f2b01ep-8f, 0x1.028f5cp-7f, 0x1.0bc6a8p-7f, 0x1.14fdf2p-7f, 0x1.1e354p-7f, 0x1.276c8ap-7f,
    0x1.30a3d6p-7f, 0x1.39db24p-7f, 0x1.43126ep-7f, 0x1.5eb854p-7f, 0x1.8ccccep-7f, 0x1.bae146p-7f,
    0x1.e8f5c4p-7f, 0x1.0b851ep-6f, 0x1.228f5ep-6f, 0x1.39999ap-6f, 0x1.50a3d6p-6f, 0x1.67ae16p-6f,
    0x1.7eb852p-6f, 0x1.95c28ep-6f, 0x1.accccep-6f, 0x1.c3d70ep-6f, 0x1.dae146p-6f, 0x1.f1eb86p-6f,
    0x1.047aep-5f, 0x1.1p-5f, 0x1.1b851ep-5f, 0x1.270a3ep-5f, 0x1.328f5ep-5f, 0x1.3e147ap-5f,
    0x1.49999ap-5f, 0x1.551eb8p-5f, 0x1.60a3d6p-5f, 0x1.6c28f6p-5f, 0x1.77ae14p-5f, 0x1.833334p-5f,
    0x1.8eb85p-5f, 0x1.9a3d7p-5f, 0x1.a5c28ep-5f, 0x1.b147aep-5f, 0x1.bccccep-5f, 0x1.c851eep-5f,
    0x1.d3d70ep-5f, 0x1.df5c2ap-5f, 0x1.eae146p-5f, 0x1.f66666p-5f, 0x1.00f5c4p-4f, 0x1.06b854p-4f,
    0x1.0c7ae2p-4f, 0x1.123d7p-4f, 0x1.18p-4f, 0x1.1dc29p-4f, 0x1.23852p-4f, 0x1.2947aep-4f,
    0x1.2f0a3ep-4f, 0x1.34cccep-4f, 0x1.3a8f5ep-4f, 0x1.4051ecp-4f, 0x1.46147cp-4f, 0x1.4bd70ap-4f,
    0x1.51999ap-4f, 0x1.575c2ap-4f, 0x1.5d1eb8p-4f, 0x1.62e148p-4f, 0x1.68a3d6p-4f, 0x1.6e6666p-4f,
    0x1.7428f6p-4f, 0x1.79eb86p-4f, 0x1.7fae16p-4f, 0x1.8570a4p-4f, 0x1.8b3334p-4f, 0x1.90f5c4p-4f,
    0x1.96b852p-4f, 0x1.a8p-4f, 0x1.c4ccccp-4f, 0x1.e1999ap-4f, 0x1.fe6666p-4f, 0x1.0d9998p-3f,
    0x1.1cp-3f, 0x1.2a6668p-3f, 0x1.38ccccp-3f, 0x1.473334p-3f, 0x1.559998p-3f, 0x1.64p-3f,
    0x1.726668p-3f, 0x1.80ccccp-3f, 0x1.8f3334p-3f, 0x1.9d9998p-3f, 0x1.acp-3f, 0x1.ba6668p-3f,
    0x1.c8ccccp-3f, 0x1.d73334p-3f, 0x1.e59998p-3f, 0x1.f4p-3f, 0x1.013332p-2f, 0x1.086666p-2f,
    0x1.0f999ap-2f, 0x1.16ccccp-2f, 0x1.1ep-2f, 0x1.253334p-2f, 0x1.2c6666p-2f, 0x1.339998p-2f,
    0x1.3accccp-2f, 0x1.42p-2f, 0x1.493334p-2f, 0x1.506666p-2f, 0x1.579998p-2f, 0x1.5eccccp-2f,
    0x1.66p-2f, 0x1.6d3334p-2f, 0x1.746666p-2f, 0x1.7b9998p-2f, 0x1.82ccccp-2f, 0x1.8ap-2f,
    0x1.913334p-2f, 0x1.986666p-2f, 0x1.9f9998p-2f, 0x1.a6ccccp-2f, 0x1.aep-2f, 0x1.b53334p-2f,
    0x1.bc6666p-2f, 0x1.c39998p-2f, 0x1.caccccp-2f, 0x1.d2p-2f, 0x1.d93334p-2f, 0x1.e06666p-2f,
    0x1.e79998p-2f, 0x1.eeccccp-2f, 0x1.f6p-2f, 0x1.fd3332p-2f, 0x1.023334p-1f, 0x1.05ccccp-1f,
    0x1.096666p-1f, 0x1.0dp-1f, 0x1.109998p-1f, 0x1.143334p-1f, 0x1.17ccccp-1f, 0x1.1b6668p-1f,
    0x1.1fp-1f, 0x1.22999ap-1f, 0x1.263334p-1f, 0x1.29ccccp-1f, 0x1.2d6668p-1f, 0x1.31p-1f,
    0x1.34999ap-1f, 0x1.383334p-1f, 0x1.3bccccp-1f, 0x1.3f6668p-1f, 0x1.43p-1f, 0x1.46999ap-1f,
    0x1.4a3334p-1f, 0x1.4dccccp-1f, 0x1.516668p-1f, 0x1.55p-1f, 0x1.58999ap-1f, 0x1.5c3334p-1f,
    0x1.5fccccp-1f, 0x1.636668p-1f, 0x1.67p-1f, 0x1.6a999ap-1f, 0x1.6e3334p-1f, 0x1.71ccccp-1f,
    0x1.756668p-1f, 0x1.79p-1f, 0x1.7c999ap-1f, 0x1.803334p-1f, 0x1.83ccccp-1f, 0x1.876668p-1f,
    0x1.8bp-1f, 0x1.8e9998p-1f, 0x1.923334p-1f, 0x1.95ccccp-1f, 0x1.996668p-1f, 0x1.9dp-1f,
    0x1.a09998p-1f, 0x1.a43334p-1f, 0x1.a7ccccp-1f, 0x1.ab6668p-1f, 0x1.afp-1f, 0x1.b29998p-1f,
    0x1.b63334p-1f, 0x1.b9ccccp-1f, 0x1.bd6668p-1f, 0x1.c1p-1f, 0x1.c49998p-1f, 0x1.c83334p-1f,
    0x1.cbccccp-1f, 0x1.cf6668p-1f, 0x1.d3p-1f, 0x1.d69998p-1f, 0x1.da3334p-1f, 0x1.ddccccp-1f,
    0x1.e16668p-1f, 0x1.e5p-1f, 0x1.e89998p-1f, 0x1.ec3334p-1f, 0x1.efccccp-1f, 0x1.f36668p-1f,
    0x1.f7p-1f, 0x1.fa9998p-1f, 0x1.fe3334p-1f, 0x1p+0f,
};
// clang-format on

}  // namespace

const std::array<float, 256>& signed_dynamic_map() { return kSignedDynamicMap; }
const std::array<float, 256>& unsigned_dynamic_map() { return kUnsignedDynamicMap; }

// Note [Nearest codes by bucket]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Re-quantizing takes, for each x = m / absmax, the entry of a 256-entry ascending map nearest x,
// the lower on a tie, 0 for NaN (the rule of nearest_entry below, computed in float as the kernels
// compute it). A binary search over the map costs 8 dependent comparisons and, on AVX2/AVX-512,
// gathers: it was about 90% of the 8-bit step. Instead:
//
// * Thresholds. Between two neighbours map[c] < map[c+1], "map[c+1] is strictly nearer" is
//   |x - map[c+1]| < |x - map[c]| in float, which is monotone in x (a float subtraction is monotone
//   in its first operand): false at map[c], true at map[c+1]. So there is one smallest float tau[c]
//   from which the nearest entry is above c, and the nearest entry of any x is the number of
//   thresholds at or below it. quant_table_of finds each tau[c] by bisection over the floats
//   between the two entries, with nearest_entry itself deciding.
// * Buckets. A float's bits above bit 16 (sign, exponent, 7 mantissa bits) split each binade into
//   128 buckets of equal width, as fine relative to x everywhere as the maps are. With 7 bits, no
//   bucket of either dynamic map holds two thresholds (6 bits would put two in 8 buckets of the
//   unsigned map); everything under 2^-24 (the smallest threshold is 1.6e-7, about 2^-22.6) shares
//   bucket 0 and everything from 2 up the last one. Each bucket stores the nearest entry of its
//   smallest float; the code of any x in it is that entry, plus one where x >= its threshold.
//
// quant_table_of checks the one-threshold property for every bucket and both signs from the two
// ends of each bucket (nearest_entry is monotone, so the ends bound everything between) and aborts
// otherwise, so a wrong table cannot be built. NaN lands in the top bucket and is zeroed apart.
// The result is the binary search's, bit for bit: a one-off run put all 2^32 floats through the
// AVX2 kernel and nearest_entry (no difference, either map), and the tests compare every ISA's
// codes with a scan of the neighbouring entries over 1.1 M values (tests/cpu_optim).
namespace {

// The reference rule: the largest i with map[i] <= x (0 when none, and for NaN), then one step
// right where map[i+1] is strictly nearer in float arithmetic.
uint8_t nearest_entry(const float* map, float x) {
  if (std::isnan(x)) return 0;
  const float* above = std::upper_bound(map, map + 256, x);
  const size_t i = above == map ? 0 : static_cast<size_t>(above - map) - 1;
  const float lo = map[i], hi = map[i < 255 ? i + 1 : 255];
  return static_cast<uint8_t>(std::fabs(x - hi) < std::fabs(x - lo) ? i + 1 : i);
}

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
QuantTable quant_table_of(const float* map) {
  QuantTable t{};
  for (size_t c = 0; c < 255; ++c) {
    ZO_CHECK(map[c] < map[c + 1]) << "the map is not ascending at " << c;
    int64_t lo = ordered(map[c]), hi = ordered(map[c + 1]);  // nearest_entry: c at lo, c + 1 at hi
    ZO_CHECK(nearest_entry(map, from_ordered(lo)) == c && nearest_entry(map, from_ordered(hi)) == c + 1);
    while (hi - lo > 1) {
      const int64_t mid = lo + (hi - lo) / 2;
      (nearest_entry(map, from_ordered(mid)) > c ? hi : lo) = mid;
    }
    t.tau[c] = from_ordered(hi);
  }
  t.tau[255] = std::numeric_limits<float>::quiet_NaN();
  for (int k = 0; k <= kBucketTop; ++k) {
    // The bucket's |x| bits: [low, high].
    const uint32_t low = k == 0 ? 0 : static_cast<uint32_t>(k + kBucketFloor) << 16;
    const uint32_t high = k == kBucketTop ? 0x7F800000u : (static_cast<uint32_t>(k + kBucketFloor + 1) << 16) - 1;
    for (bool negative : {false, true}) {
      const float a = std::bit_cast<float>(low), b = std::bit_cast<float>(high);
      const float smallest = negative ? -b : a, largest = negative ? -a : b;
      const uint8_t first = nearest_entry(map, smallest);
      ZO_CHECK(nearest_entry(map, largest) <= first + 1)
          << "bucket " << k << (negative ? " (negative)" : "") << " holds two thresholds of the map";
      t.first_code[negative ? k + kBucketNegative : k] = first;
    }
  }
  return t;
}

const QuantTable& signed_map_quant_table() {
  static const QuantTable t = quant_table_of(kSignedDynamicMap.data());
  return t;
}

const QuantTable& unsigned_map_quant_table() {
  static const QuantTable t = quant_table_of(kUnsignedDynamicMap.data());
  return t;
}
}  // namespace detail

uint8_t quantize_nearest(const std::array<float, 256>& map, float x) {
  std::unique_ptr<detail::QuantTable> other;  // a map other than the two dynamic ones
  const detail::QuantTable* table = &detail::signed_map_quant_table();
  if (map == kUnsignedDynamicMap) {
    table = &detail::unsigned_map_quant_table();
  } else if (map != kSignedDynamicMap) {
    other = std::make_unique<detail::QuantTable>(detail::quant_table_of(map.data()));
    table = other.get();
  }
  uint8_t code = 0;
  detail::kScalarKernels.nearest_codes(*table, &x, &code, 0, 1);
  return code;
}

}  // namespace zo::cpu_optim

#include "common/crc32c.h"

#include <array>
#include <cstring>

namespace zo {
namespace detail {
namespace {

constexpr uint32_t kPoly = 0x82F63B78u;  // reflected Castagnoli polynomial

constexpr std::array<std::array<uint32_t, 256>, 8> make_tables() {
  std::array<std::array<uint32_t, 256>, 8> t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ kPoly : c >> 1;
    t[0][i] = c;
  }
  for (uint32_t i = 0; i < 256; ++i)
    for (int s = 1; s < 8; ++s) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xFF];
  return t;
}
constexpr auto kTables = make_tables();

}  // namespace

// Slicing-by-8.
uint32_t crc32c_extend_portable(uint32_t crc, const void* data, size_t n) {
  const auto* p = static_cast<const unsigned char*>(data);
  crc = ~crc;
  while (n >= 8) {
    uint32_t lo, hi;
    std::memcpy(&lo, p, 4);
    std::memcpy(&hi, p + 4, 4);
    lo ^= crc;
    crc = kTables[7][lo & 0xFF] ^ kTables[6][(lo >> 8) & 0xFF] ^ kTables[5][(lo >> 16) & 0xFF] ^ kTables[4][lo >> 24] ^
          kTables[3][hi & 0xFF] ^ kTables[2][(hi >> 8) & 0xFF] ^ kTables[1][(hi >> 16) & 0xFF] ^ kTables[0][hi >> 24];
    p += 8;
    n -= 8;
  }
  while (n--) crc = (crc >> 8) ^ kTables[0][(crc ^ *p++) & 0xFF];
  return ~crc;
}

}  // namespace detail

// Note [Combining CRCs] (the method of zlib's crc32_combine): a CRC is the message polynomial
// times x^32 reduced modulo P, with the pre- and post-inversion cancelling out of the sum, so
// crc(A‖B) = crc(A) · x^(8·|B|) mod P  ⊕  crc(B). Polynomials are 32-bit values in the reflected
// bit order of the CRC (x^0 is bit 31). x^(8·|B|) is built by square-and-multiply from the
// precomputed x^(2^k): one multiply per set bit of |B|.
namespace {

constexpr uint32_t kPolyReflected = 0x82F63B78u;

// a · b mod P, reflected.
constexpr uint32_t mul_mod_p(uint32_t a, uint32_t b) {
  uint32_t p = 0;
  for (uint32_t m = uint32_t{1} << 31; m != 0; m >>= 1) {
    if (a & m) p ^= b;
    b = (b & 1) ? (b >> 1) ^ kPolyReflected : b >> 1;  // b · x
  }
  return p;
}

// x^(2^k) mod P for k < 67: enough for x^(8·n) with any 64-bit n (exponent bits 3..66).
constexpr int kPowers = 67;
constexpr std::array<uint32_t, kPowers> make_x_pow_2k() {
  std::array<uint32_t, kPowers> t{};
  t[0] = uint32_t{1} << 30;  // x^1
  for (int k = 1; k < kPowers; ++k) t[k] = mul_mod_p(t[k - 1], t[k - 1]);
  return t;
}
constexpr auto kXPow2k = make_x_pow_2k();

}  // namespace

uint32_t crc32c_combine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b) {
  uint32_t x_pow = uint32_t{1} << 31;  // x^0
  for (int k = 3; len_b != 0; len_b >>= 1, ++k) {
    if (len_b & 1) x_pow = mul_mod_p(kXPow2k[k], x_pow);
  }
  return mul_mod_p(x_pow, crc_a) ^ crc_b;
}

#if defined(__x86_64__)
namespace {
__attribute__((target("sse4.2"))) uint32_t crc32c_extend_sse42(uint32_t crc, const void* data, size_t n) {
  const auto* p = static_cast<const unsigned char*>(data);
  uint64_t c = ~crc;
  while (n >= 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    c = __builtin_ia32_crc32di(c, v);
    p += 8;
    n -= 8;
  }
  uint32_t c32 = static_cast<uint32_t>(c);
  while (n--) c32 = __builtin_ia32_crc32qi(c32, *p++);
  return ~c32;
}
}  // namespace

bool crc32c_is_hardware() {
  static const bool hw = __builtin_cpu_supports("sse4.2");
  return hw;
}

uint32_t crc32c_extend(uint32_t crc, const void* data, size_t n) {
  return crc32c_is_hardware() ? crc32c_extend_sse42(crc, data, n) : detail::crc32c_extend_portable(crc, data, n);
}
#else
bool crc32c_is_hardware() { return false; }
uint32_t crc32c_extend(uint32_t crc, const void* data, size_t n) {
  return detail::crc32c_extend_portable(crc, data, n);
}
#endif

}  // namespace zo

#include "common/crc32c.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <string>
#include <vector>

namespace zo {
namespace {

TEST(Crc32c, KnownVectors) {
  // RFC 3720 (iSCSI) B.4 test vectors and the classic "123456789" check value.
  EXPECT_EQ(crc32c("123456789", 9), 0xE3069283u);
  std::vector<unsigned char> zeros(32, 0x00), ones(32, 0xFF), inc(32);
  for (int i = 0; i < 32; ++i) inc[i] = static_cast<unsigned char>(i);
  EXPECT_EQ(crc32c(zeros.data(), zeros.size()), 0x8A9136AAu);
  EXPECT_EQ(crc32c(ones.data(), ones.size()), 0x62A8AB43u);
  EXPECT_EQ(crc32c(inc.data(), inc.size()), 0x46DD794Eu);
  EXPECT_EQ(crc32c(nullptr, 0), 0u);
}

TEST(Crc32c, HardwareMatchesPortableAndExtendIsConcatenation) {
  std::mt19937 rng(7);
  std::vector<unsigned char> data(100003);
  for (auto& b : data) b = static_cast<unsigned char>(rng());
  const uint32_t whole = crc32c(data.data(), data.size());
  EXPECT_EQ(whole, detail::crc32c_extend_portable(0, data.data(), data.size()));
  for (size_t cut : {size_t{0}, size_t{1}, size_t{7}, size_t{4096}, size_t{99999}}) {
    const uint32_t a = crc32c(data.data(), cut);
    EXPECT_EQ(crc32c_extend(a, data.data() + cut, data.size() - cut), whole) << cut;
  }
}

// Checks crc32c_combine(crc(A), crc(B), |B|) == crc(A‖B) for A = data[0, cut), B = data[cut, end).
void expect_combines(const std::vector<unsigned char>& data, size_t cut) {
  const uint32_t a = crc32c(data.data(), cut);
  const uint32_t b = crc32c(data.data() + cut, data.size() - cut);
  EXPECT_EQ(crc32c_combine(a, b, data.size() - cut), crc32c(data.data(), data.size()))
      << "size " << data.size() << " cut " << cut;
}

TEST(Crc32c, CombineIsTheCrcOfTheConcatenation) {
  std::mt19937 rng(11);
  // |B| = 0, 1, 3, 4096 and 16 MiB + 3, each after an A of a few sizes (0 included).
  for (size_t len_b : {size_t{0}, size_t{1}, size_t{3}, size_t{4096}, (size_t{16} << 20) + 3}) {
    for (size_t len_a : {size_t{0}, size_t{1}, size_t{5000}}) {
      std::vector<unsigned char> data(len_a + len_b);
      for (auto& b : data) b = static_cast<unsigned char>(rng());
      expect_combines(data, len_a);
    }
  }
  // Random splits of random data.
  for (int trial = 0; trial < 200; ++trial) {
    std::vector<unsigned char> data(rng() % 70000);
    for (auto& b : data) b = static_cast<unsigned char>(rng());
    expect_combines(data, data.empty() ? 0 : rng() % (data.size() + 1));
  }
}

TEST(Crc32c, CombineOfAnEmptyAIsB) {
  const unsigned char b[] = {'1', '2', '3', '4', '5', '6', '7', '8', '9'};
  EXPECT_EQ(crc32c_combine(0, crc32c(b, 9), 9), 0xE3069283u);
  EXPECT_EQ(crc32c_combine(0, 0, 0), 0u);
  // Many pieces folded left to right give the whole (as a digest of several ranges does).
  std::vector<unsigned char> data(100000);
  std::mt19937 rng(3);
  for (auto& x : data) x = static_cast<unsigned char>(rng());
  uint32_t acc = 0;
  for (size_t at = 0; at < data.size();) {
    const size_t n = std::min<size_t>(data.size() - at, 1 + rng() % 9000);
    acc = crc32c_combine(acc, crc32c(data.data() + at, n), n);
    at += n;
  }
  EXPECT_EQ(acc, crc32c(data.data(), data.size()));
}

}  // namespace
}  // namespace zo

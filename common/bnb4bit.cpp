#include "common/bnb4bit.h"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace zo::bnb4 {
namespace {

const std::array<float, 16>& table(QuantType type) { return type == QuantType::kNf4 ? kNf4Code : kFp4Code; }

// The table's indices sorted by value, ties in table order (as bitsandbytes' argsort gives them),
// and the 15 midpoints between neighbours in that order, each computed in fp32.
struct Buckets {
  std::array<uint8_t, 16> order{};
  std::array<float, 15> bounds{};
};

Buckets buckets_of(QuantType type) {
  const std::array<float, 16>& code = table(type);
  Buckets b;
  std::iota(b.order.begin(), b.order.end(), uint8_t{0});
  std::stable_sort(b.order.begin(), b.order.end(), [&](uint8_t x, uint8_t y) { return code[x] < code[y]; });
  for (size_t i = 0; i < 15; ++i) {
    const float sum = code[b.order[i]] + code[b.order[i + 1]];
    b.bounds[i] = sum / 2.0f;
  }
  return b;
}

const Buckets& buckets(QuantType type) {
  static const Buckets nf4 = buckets_of(QuantType::kNf4);
  static const Buckets fp4 = buckets_of(QuantType::kFp4);
  return type == QuantType::kNf4 ? nf4 : fp4;
}

// torch.bucketize(x, bounds) (right=False): the number of bounds below x, then the table index.
uint8_t code_of(const Buckets& b, float scaled) {
  unsigned below = 0;
  while (below < 15 && b.bounds[below] < scaled) ++below;
  return b.order[below];
}

}  // namespace

bool parse_quant_type(std::string_view name, QuantType* out) {
  if (name == "nf4") *out = QuantType::kNf4;
  else if (name == "fp4") *out = QuantType::kFp4;
  else return false;
  return true;
}

std::string_view quant_type_name(QuantType type) { return type == QuantType::kNf4 ? "nf4" : "fp4"; }

void dequantize(const uint8_t* packed, const float* absmax, uint64_t first, uint64_t n, uint64_t blocksize,
                QuantType type, DType dtype, float* out) {
  const uint64_t skip = first & 1;  // the codes before element `first` in packed's first byte
  for (uint64_t k = 0; k < n; ++k) {
    const float v = dequantize_value(type, code_at(packed, skip + k), absmax[(first + k) / blocksize]);
    out[k] = dtype == DType::kBF16  ? bf16_to_float(float_to_bf16(v))
             : dtype == DType::kF16 ? f16_to_float(float_to_f16(v))
                                    : v;
  }
}

CodeTables code_tables() {
  CodeTables t{};
  std::copy(kNf4Code.begin(), kNf4Code.end(), t.v[0]);
  std::copy(kFp4Code.begin(), kFp4Code.end(), t.v[1]);
  return t;
}

void dequantize_blob(const BlobHeader& h, const uint8_t* codes, const uint8_t* scales, uint64_t first, uint64_t n,
                     DType dtype, float* out) {
  static const CodeTables tables = code_tables();
  const uint64_t code_base = blob_code_byte(h.type, first), scale_base = blob_scale_index(h.type, h.cols, first);
  for (uint64_t k = 0; k < n; ++k)
    out[k] =
        round_to(dtype, blob_element(tables, h.type, h.round, h.cols, codes, code_base, scales, scale_base, first + k));
}

bool dequantize_whole_blob(const uint8_t* blob, uint64_t blob_size, uint64_t first, uint64_t n, DType dtype,
                           float* out) {
  BlobHeader h;
  if (blob_size < kBlobHeaderBytes || !read_blob_header(blob, &h) || !h.sane() || h.bytes() > blob_size ||
      first > h.n() || n > h.n() - first)
    return false;
  dequantize_blob(h, blob + blob_codes_offset() + blob_code_byte(h.type, first),
                  blob + h.scales_offset() + 4 * blob_scale_index(h.type, h.cols, first), first, n, dtype, out);
  return true;
}

void dequantize_absmax(const uint8_t* codes, const float* absmax2, const float* map, uint64_t n_blocks,
                       uint64_t blocksize2, float offset, float* out) {
  for (uint64_t j = 0; j < n_blocks; ++j) {
    const float v = map[codes[j]] * absmax2[j / blocksize2];
    out[j] = v + offset;
  }
}

void quantize(const float* x, uint64_t n, uint64_t blocksize, QuantType type, uint8_t* packed, float* absmax) {
  const Buckets& b = buckets(type);
  const uint64_t whole = n / blocksize;
  uint8_t pending = 0;  // the high nibble of the byte being filled
  auto put = [&](uint64_t i, uint8_t q) {
    if ((i & 1) == 0) pending = static_cast<uint8_t>(q << 4);
    else packed[i >> 1] = static_cast<uint8_t>(pending | q);
  };
  const auto clamp1 = [](float v) { return v < -1.0f ? -1.0f : (v > 1.0f ? 1.0f : v); };  // NaN stays NaN
  for (uint64_t blk = 0; blk < block_count(n, blocksize); ++blk) {
    const uint64_t begin = blk * blocksize, end = std::min(n, begin + blocksize);
    float m = 0.0f;
    bool nan = false;
    for (uint64_t i = begin; i < end; ++i) {
      const float a = std::fabs(x[i]);
      if (a != a) nan = true;
      else m = std::max(m, a);
    }
    if (nan) m = NAN;  // torch's max propagates NaN
    const float floor = nan ? m : std::max(m, 1e-38f);
    if (blk < whole) {
      absmax[blk] = m;
      const float inv = 1.0f / floor;
      for (uint64_t i = begin; i < end; ++i) put(i, code_of(b, clamp1(x[i] * inv)));
    } else {
      absmax[blk] = floor;
      for (uint64_t i = begin; i < end; ++i) put(i, code_of(b, clamp1(x[i] / floor)));
    }
  }
  if ((n & 1) != 0) put(n, code_of(b, 0.0f));  // the pad: bitsandbytes pads the scaled values with 0
}

}  // namespace zo::bnb4

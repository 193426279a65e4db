// The zoffload side of tests/common/bnb4bit_bnb_test.py: quantizes or dequantizes the tensors that
// script wrote with common/bnb4bit.h and writes the result back for it to compare with
// bitsandbytes. usage: bnb4bit_oracle DIR, where DIR/meta.txt holds "key value" lines:
//   mode quantize|dequantize, n, blocksize, type nf4|fp4, and for dequantize dtype fp32|bf16|fp16,
//   nested 0|1, and when nested blocksize2 and offset (as a float's bits, decimal).
// quantize reads DIR/x.f32 and writes DIR/out_packed.u8, DIR/out_absmax.f32. dequantize reads
// DIR/packed.u8 and DIR/absmax.f32 (nested: DIR/qabsmax.u8, DIR/absmax2.f32, DIR/map.f32) and writes
// DIR/out.bin (fp32, or the 16-bit patterns) and, nested, DIR/out_absmax.f32. Exit 0, or 1 with a
// line on stderr.
// Dequantize also checks the blob of the packed 4-bit base (blocks of 64 or more): its host reader
// and HostDevice's dequantize_packed must give the same bits as dequantize. Mode int8 (rows, cols,
// dtype) reads DIR/codes.i8 and DIR/scb.f32, an 8-bit weight, as the packed base's blob with both
// readers and writes DIR/out.bin.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "common/bnb4_blob.h"
#include "common/bnb4bit.h"
#include "common/half.h"
#include "gpu/host_device.h"
#include "gpu/quant_kernels.h"
#include "tests/oracle_files.h"

namespace {

using zo::testing::read_all;
using zo::testing::write_all;

int fail(const std::string& msg) {
  std::fprintf(stderr, "bnb4bit_oracle: %s\n", msg.c_str());
  return 1;
}

// The blob read back by HostDevice's dequantize_packed — the device kernel's element code — gives
// `want`'s bits (want: n values of `dtype`, widened to fp32).
int check_on_host_device(const std::vector<uint8_t>& blob, uint64_t n, zo::DType dtype,
                         const std::vector<float>& want) {
  auto device = zo::gpu::HostDevice::create(uint64_t{1} << 30);
  if (!device.is_ok()) return fail(device.status().to_string());
  zo::gpu::Device& d = **device;
  const uint64_t out_bytes = n * zo::dtype_size_bytes(dtype);
  auto b = d.allocate(blob.size());
  auto o = d.allocate(out_bytes);
  auto stream = d.create_stream();
  if (!b.is_ok() || !o.is_ok() || !stream.is_ok()) return fail("cannot set up the HostDevice");
  std::vector<uint8_t> got(out_bytes);
  zo::Status st = d.copy_h2d(*b, blob.data(), blob.size(), *stream);
  if (st.is_ok())
    st = zo::gpu::dequantize_packed(
        d, {.blob = *b, .blob_bytes = blob.size(), .out = *o, .out_dtype = dtype, .n_elems = n}, *stream);
  if (st.is_ok()) st = d.copy_d2h(got.data(), *o, out_bytes, *stream);
  if (st.is_ok()) st = d.synchronize(*stream);
  if (!st.is_ok()) return fail("dequantize_packed: " + st.to_string());
  for (uint64_t i = 0; i < n; ++i) {
    float v;
    if (dtype == zo::DType::kF32) {
      std::memcpy(&v, got.data() + 4 * i, 4);
    } else {
      uint16_t h16;
      std::memcpy(&h16, got.data() + 2 * i, 2);
      v = dtype == zo::DType::kBF16 ? zo::bf16_to_float(h16) : zo::f16_to_float(h16);
    }
    if (std::memcmp(&v, &want[i], 4) != 0)
      return fail("HostDevice's dequantize_packed gives element " + std::to_string(i) + " other bits than dequantize");
  }
  return 0;
}

// DIR/out.bin: `out` in fp32, or its 16-bit patterns (each value is one of the dtype's, so narrowing
// it is exact).
int write_out(const std::string& dir, zo::DType dtype, const std::vector<float>& out) {
  bool ok = false;
  if (dtype == zo::DType::kF32) {
    ok = write_all(dir + "/out.bin", out);
  } else {
    std::vector<uint16_t> bits(out.size());
    for (uint64_t i = 0; i < out.size(); ++i)
      bits[i] = dtype == zo::DType::kBF16 ? zo::float_to_bf16(out[i]) : zo::float_to_f16(out[i]);
    ok = write_all(dir + "/out.bin", bits);
  }
  return ok ? 0 : fail("cannot write out.bin");
}

// Mode int8: an 8-bit weight (rows × cols int8 codes, its rows' SCB) as the packed base's blob,
// read back in `dtype` by the host's reader (whole, and in ranges of 5 that cross rows) and by
// HostDevice; the script checks out.bin against bitsandbytes.
int int8_mode(const std::string& dir, std::map<std::string, std::string>& meta) {
  namespace bnb4 = zo::bnb4;
  for (const char* key : {"rows", "cols", "dtype"})
    if (!meta.contains(key)) return fail(dir + "/meta.txt has no " + key);
  const uint64_t rows = std::stoull(meta["rows"]), cols = std::stoull(meta["cols"]), n = rows * cols;
  zo::Result<zo::DType> dtype = zo::parse_dtype(meta["dtype"]);
  if (!dtype.is_ok()) return fail("unknown dtype " + meta["dtype"]);
  std::vector<uint8_t> codes(n);
  std::vector<float> scb(rows);
  if (!read_all(dir + "/codes.i8", &codes) || !read_all(dir + "/scb.f32", &scb)) return fail("cannot read the weight");
  const bnb4::BlobHeader written{.type = bnb4::kBlobInt8, .round = zo::DType::kF32, .rows = rows, .cols = cols};
  std::vector<uint8_t> blob(written.bytes(), 0);
  bnb4::write_blob_header(written, blob.data());
  std::memcpy(blob.data() + bnb4::blob_codes_offset(), codes.data(), n);
  std::memcpy(blob.data() + written.scales_offset(), scb.data(), 4 * rows);
  std::vector<float> out(n);
  if (!bnb4::dequantize_whole_blob(blob.data(), blob.size(), 0, n, *dtype, out.data()))
    return fail("the blob does not read back");
  for (uint64_t first = 0; first < n; first += 5) {
    const uint64_t count = std::min<uint64_t>(5, n - first);
    float part[5];
    bnb4::dequantize_blob(written, blob.data() + bnb4::blob_codes_offset() + first,
                          blob.data() + written.scales_offset() + 4 * (first / cols), first, count, *dtype, part);
    if (std::memcmp(part, out.data() + first, count * sizeof(float)) != 0)
      return fail("elements from " + std::to_string(first) + " read as a range differ from the whole blob's");
  }
  if (const int rc = check_on_host_device(blob, n, *dtype, out); rc != 0) return rc;
  return write_out(dir, *dtype, out);
}

}  // namespace

int main(int argc, char** argv) {
  namespace bnb4 = zo::bnb4;
  if (argc != 2) return fail("usage: bnb4bit_oracle DIR");
  const std::string dir = argv[1];
  std::map<std::string, std::string> meta;
  {
    std::ifstream f(dir + "/meta.txt");
    std::string k, v;
    while (f >> k >> v) meta[k] = v;
  }
  if (meta["mode"] == "int8") return int8_mode(dir, meta);
  for (const char* key : {"mode", "n", "blocksize", "type"})
    if (!meta.contains(key)) return fail(dir + "/meta.txt has no " + key);
  const uint64_t n = std::stoull(meta["n"]), blocksize = std::stoull(meta["blocksize"]);
  bnb4::QuantType type;
  if (!bnb4::parse_quant_type(meta["type"], &type)) return fail("unknown type " + meta["type"]);
  const uint64_t blocks = bnb4::block_count(n, blocksize);

  if (meta["mode"] == "quantize") {
    std::vector<float> x(n);
    if (!read_all(dir + "/x.f32", &x)) return fail("cannot read x.f32");
    std::vector<uint8_t> packed(bnb4::packed_bytes(n));
    std::vector<float> absmax(blocks);
    bnb4::quantize(x.data(), n, blocksize, type, packed.data(), absmax.data());
    if (!write_all(dir + "/out_packed.u8", packed) || !write_all(dir + "/out_absmax.f32", absmax))
      return fail("cannot write the results");
    return 0;
  }
  if (meta["mode"] != "dequantize") return fail("unknown mode " + meta["mode"]);
  std::vector<uint8_t> packed(bnb4::packed_bytes(n));
  if (!read_all(dir + "/packed.u8", &packed)) return fail("cannot read packed.u8");
  std::vector<float> absmax(blocks);
  if (meta["nested"] == "1") {
    const uint64_t blocksize2 = std::stoull(meta["blocksize2"]);
    const float offset = zo::bits_float(static_cast<uint32_t>(std::stoul(meta["offset"])));
    std::vector<uint8_t> codes(blocks);
    std::vector<float> absmax2(bnb4::block_count(blocks, blocksize2)), map(256);
    if (!read_all(dir + "/qabsmax.u8", &codes) || !read_all(dir + "/absmax2.f32", &absmax2) ||
        !read_all(dir + "/map.f32", &map))
      return fail("cannot read the nested statistics");
    bnb4::dequantize_absmax(codes.data(), absmax2.data(), map.data(), blocks, blocksize2, offset, absmax.data());
    if (!write_all(dir + "/out_absmax.f32", absmax)) return fail("cannot write out_absmax.f32");
  } else if (!read_all(dir + "/absmax.f32", &absmax)) {
    return fail("cannot read absmax.f32");
  }
  zo::Result<zo::DType> dtype = zo::parse_dtype(meta["dtype"]);
  if (!dtype.is_ok()) return fail("unknown dtype " + meta["dtype"]);
  std::vector<float> out(n);
  bnb4::dequantize(packed.data(), absmax.data(), 0, n, blocksize, type, *dtype, out.data());
  // The same elements a range at a time, from the bytes of each range only, as load_hf_weights
  // reads them (ranges of 5: odd starts too): the script checks `out` against bitsandbytes.
  for (uint64_t first = 0; first < n; first += 5) {
    const uint64_t count = std::min<uint64_t>(5, n - first);
    float part[5];
    bnb4::dequantize(packed.data() + first / 2, absmax.data(), first, count, blocksize, type, *dtype, part);
    if (std::memcmp(part, out.data() + first, count * sizeof(float)) != 0)
      return fail("elements from " + std::to_string(first) + " read as a range differ from the whole tensor's");
  }
  // Note [The packed 4-bit base]: the same tensor as a blob (blocks of 64: a larger block's absmax
  // repeated), read by the host's dequantize_blob in ranges of 5 and by HostDevice's
  // dequantize_packed — the device kernel's element code — must give `out`'s bits too.
  if (blocksize >= bnb4::kBlobBlock) {
    const bnb4::BlobHeader written{.type = static_cast<uint8_t>(type), .round = *dtype, .rows = n, .cols = 1};
    std::vector<uint8_t> blob(written.bytes(), 0);
    bnb4::write_blob_header(written, blob.data());
    std::memcpy(blob.data() + bnb4::blob_codes_offset(), packed.data(), packed.size());
    for (uint64_t j = 0; j < bnb4::blob_scale_count(written.type, n, 1); ++j)
      std::memcpy(blob.data() + written.scales_offset() + 4 * j, &absmax[j * bnb4::kBlobBlock / blocksize], 4);
    bnb4::BlobHeader h;
    if (!bnb4::read_blob_header(blob.data(), &h) || h.n() != n) return fail("the blob's header does not read back");
    for (uint64_t first = 0; first < n; first += 5) {
      const uint64_t count = std::min<uint64_t>(5, n - first);
      float part[5];
      bnb4::dequantize_blob(h, blob.data() + bnb4::blob_codes_offset() + first / 2,
                            blob.data() + h.scales_offset() + 4 * (first / bnb4::kBlobBlock), first, count, *dtype,
                            part);
      if (std::memcmp(part, out.data() + first, count * sizeof(float)) != 0)
        return fail("elements from " + std::to_string(first) + " read from the blob differ from dequantize's");
    }
    if (const int rc = check_on_host_device(blob, n, *dtype, out); rc != 0) return rc;
  }
  return write_out(dir, *dtype, out);
}

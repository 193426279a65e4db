#include "engine/model/weights.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <numbers>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/bnb4bit.h"
#include "common/log.h"
#include "common/parallel_ranges.h"
#include "common/string_util.h"
#include "engine/model/safetensors.h"

namespace zo::engine {
namespace {

std::string shape_string(std::span<const int64_t> shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

uint64_t elems_of(const std::vector<int64_t>& shape) {
  uint64_t n = 1;
  for (int64_t d : shape) n *= static_cast<uint64_t>(d);
  return n;
}

constexpr uint64_t kGamma = 0x9E3779B97F4A7C15ull;

// The splitmix64 finalizer: a bijective mix of all 64 bits.
uint64_t mix64(uint64_t x) {
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

uint64_t fnv1a(std::string_view s) {
  uint64_t h = 0xCBF29CE484222325ull;
  for (unsigned char c : s) h = (h ^ c) * 0x100000001B3ull;
  return h;
}

uint64_t stream_key(uint64_t seed, std::string_view name) { return mix64(seed + kGamma) ^ mix64(fnv1a(name)); }

// Elements 2p and 2p+1 are the two outputs of Box–Muller on draws 2p and 2p+1 of a splitmix64
// stream keyed by (seed, name): any element is computable on its own, so chunking cannot matter.
void normal_pair(uint64_t key, uint64_t pair, double* z0, double* z1) {
  const uint64_t a = mix64(key + (2 * pair + 1) * kGamma);
  const uint64_t b = mix64(key + (2 * pair + 2) * kGamma);
  const double u1 = static_cast<double>((a >> 11) + 1) * 0x1.0p-53;  // (0, 1]: log is finite
  const double u2 = static_cast<double>(b >> 11) * 0x1.0p-53;
  const double r = std::sqrt(-2.0 * std::log(u1));
  *z0 = r * std::cos(2.0 * std::numbers::pi * u2);
  *z1 = r * std::sin(2.0 * std::numbers::pi * u2);
}

bool ends_with(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

// Elements [first, first + out.size()) of the normal stream `key`, scaled by `std`.
void fill_normal_serial(uint64_t key, double std, uint64_t first, std::span<float> out) {
  for (uint64_t i = 0; i < out.size();) {
    const uint64_t e = first + i;
    double z0 = 0, z1 = 0;
    normal_pair(key, e / 2, &z0, &z1);
    if (e % 2 == 0) {
      out[i++] = static_cast<float>(z0 * std);
      if (i < out.size()) out[i++] = static_cast<float>(z1 * std);
    } else {
      out[i++] = static_cast<float>(z1 * std);
    }
  }
}

// Elements [first, first + out.size()) of the normal stream `key`, scaled by `std`, over the threads
// (parallel_ranges). Box–Muller costs ~20 ns an element and NF4 quantization (quantizing_sink) ~14:
// on one core a 70B model's setup would take most of an hour.
void fill_normal(uint64_t key, double std, uint64_t first, std::span<float> out) {
  parallel_ranges(out.size(), 1, [&](uint64_t begin, uint64_t end) {
    fill_normal_serial(key, std, first + begin, out.subspan(begin, end - begin));
  });
}

// Note [Text weights of a multimodal checkpoint]: multimodal Gemma 3 (Gemma3ForConditionalGeneration)
// stores its text model under another prefix — "language_model.model." in Google's files and as
// transformers (5.17 too) saves it, "model.language_model." as transformers ≥ 5 names its modules,
// which a state dict saved directly keeps — beside the vision tower, which the text model does not
// use. The stored name of a layout param ("model.…", "lm_head.weight")
// is the first of these the checkpoint holds.
std::string stored_name(const HfWeights& weights, const std::string& name) {
  const SafetensorsFile* file = nullptr;
  if (weights.find(name, &file) != nullptr) return name;
  const std::string rest = name.starts_with("model.") ? name.substr(6) : "";
  for (const std::string& candidate : {rest.empty() ? "" : "model.language_model." + rest,
                                       rest.empty() ? "language_model." + name : "language_model.model." + rest}) {
    if (!candidate.empty() && weights.find(candidate, &file) != nullptr) return candidate;
  }
  return name;
}

// A bitsandbytes 4-bit weight as transformers saves it (Note [4-bit blocks] in common/bnb4bit.h):
// the packed codes under the weight's own name (U8, ⌈n/2⌉ bytes), and beside it `.absmax` (fp32
// per block; U8 codes with double quantization, then `.nested_absmax`, `.nested_quant_map` and the
// state's nested_offset), `.quant_map` (the 16 values) and `.quant_state.bitsandbytes__<type>`
// (U8 bytes of JSON: quant_type, blocksize, dtype, shape, nested_blocksize, nested_dtype,
// nested_offset). Everything is checked before any data moves, naming the tensor.
struct Tensor {
  const SafetensorsFile* file = nullptr;
  const SafetensorsTensor* tensor = nullptr;
};

struct QuantizedWeight {
  Tensor packed, absmax, nested_absmax, nested_map;
  bnb4::QuantType type = bnb4::QuantType::kNf4;
  uint64_t n = 0, blocksize = 0, blocksize2 = 0;
  DType dtype = DType::kBF16;  // the state's: the dtype bitsandbytes dequantizes to
  bool nested = false;
  float offset = 0.0f;
  // An 8-bit (LLM.int8) weight: `packed` holds its int8 codes, `absmax` its rows' SCB, `cols` its
  // row length; the 4-bit fields above mean nothing.
  bool int8 = false;
  uint64_t cols = 0;
  uint8_t blob_type() const { return int8 ? bnb4::kBlobInt8 : static_cast<uint8_t>(type); }
  const char* bits_name() const { return int8 ? "8-bit" : "4-bit"; }
};

// An 8-bit weight as transformers saves bitsandbytes' Linear8bitLt: the int8 codes under the weight's
// own name (I8, the weight's shape, row-major), beside them the module's `SCB` (each row's absmax,
// fp32) and `weight_format` (U8, 0: rows — the only layout bitsandbytes still writes; absent in
// older files). Everything is checked before any data moves, naming the tensor.
Result<std::optional<QuantizedWeight>> find_int8(const HfWeights& w, const std::string& stored,
                                                 const SafetensorsFile* file, const SafetensorsTensor& codes,
                                                 const ParamSpec& spec, std::set<std::string>* used) {
  const std::string module = stored.ends_with(".weight") ? stored.substr(0, stored.size() - 7) : stored;
  const std::string where = "the 8-bit weight " + stored + " in " + w.model_dir();
  QuantizedWeight q;
  q.int8 = true;
  q.packed = {file, &codes};
  q.absmax.tensor = w.find(module + ".SCB", &q.absmax.file);
  if (!codes.i8) {  // not stored 8-bit: a SCB beside it is damage
    if (q.absmax.tensor == nullptr) return std::optional<QuantizedWeight>();
    return invalid_argument(where + ": it is " + std::string(codes.type_text()) + ", but " + module +
                            ".SCB beside it says an 8-bit weight, whose codes are I8");
  }
  if (q.absmax.tensor == nullptr) return invalid_argument(where + ": its quantization state has no " + module + ".SCB");
  used->insert(module + ".SCB");
  if (spec.shape.size() != 2 || codes.shape != spec.shape)
    return invalid_argument(where + ": its I8 codes have shape " + shape_string(codes.shape) + ", the model config's " +
                            spec.name + " is " + shape_string(spec.shape));
  const uint64_t rows = static_cast<uint64_t>(spec.shape[0]);
  if (q.absmax.tensor->bytes() || q.absmax.tensor->dtype != DType::kF32 || q.absmax.tensor->n_elems != rows)
    return invalid_argument(where + ": " + q.absmax.tensor->name + " is not " + std::to_string(rows) +
                            " fp32 values (one per row)");
  Tensor format;
  if ((format.tensor = w.find(module + ".weight_format", &format.file)) != nullptr) {
    used->insert(module + ".weight_format");
    uint8_t value = 0xFF;
    if (format.tensor->u8 && format.tensor->n_elems == 1)
      ZO_RETURN_IF_ERROR(format.file->read_raw(*format.tensor, 0, std::span(&value, 1)));
    if (value != 0)
      return invalid_argument(where + ": " + format.tensor->name +
                              " is not the U8 value 0 (row-major: the only layout bitsandbytes writes today)");
  }
  q.n = elems_of(spec.shape);
  q.cols = q.n / rows;
  q.dtype = DType::kF32;
  return std::optional<QuantizedWeight>(std::move(q));
}

// The 4-bit or 8-bit quantization state of `stored` (which the directory holds), or nullopt when it
// has none (a tensor stored as it is). `used` collects the names read.
Result<std::optional<QuantizedWeight>> find_quantized(const HfWeights& w, const std::string& stored,
                                                      const ParamSpec& spec, std::set<std::string>* used) {
  Tensor state;
  std::string type_name;
  for (const char* t : {"nf4", "fp4"}) {
    const std::string key = stored + ".quant_state.bitsandbytes__" + t;
    if ((state.tensor = w.find(key, &state.file)) != nullptr) {
      type_name = t;
      used->insert(key);
      break;
    }
  }
  if (state.tensor == nullptr) {
    const SafetensorsFile* file = nullptr;
    const SafetensorsTensor* codes = w.find(stored, &file);
    return find_int8(w, stored, file, *codes, spec, used);
  }
  const std::string where = "the 4-bit weight " + stored + " in " + w.model_dir();
  auto tensor = [&](const std::string& suffix, Tensor* out) -> Status {
    const std::string key = stored + suffix;
    out->tensor = w.find(key, &out->file);
    if (out->tensor == nullptr) return invalid_argument(where + ": its quantization state has no " + key);
    used->insert(key);
    return Status::ok();
  };
  // A tensor of the state that must hold `count` fp32 values.
  auto f32s = [&](const Tensor& t, uint64_t count, const std::string& note = "") -> Status {
    if (t.tensor->bytes() || t.tensor->dtype != DType::kF32 || t.tensor->n_elems != count)
      return invalid_argument(where + ": " + t.tensor->name + " is not " + std::to_string(count) + " fp32 values" +
                              note);
    return Status::ok();
  };
  QuantizedWeight q;
  ZO_RETURN_IF_ERROR(tensor("", &q.packed));
  if (!state.tensor->u8 || state.tensor->size_bytes > (uint64_t{1} << 20))
    return invalid_argument(where + ": " + state.tensor->name + " is not a U8 JSON state of at most 1 MiB");
  std::string text(state.tensor->size_bytes, '\0');
  ZO_RETURN_IF_ERROR(state.file->read_raw(*state.tensor, 0, {reinterpret_cast<uint8_t*>(text.data()), text.size()}));
  const nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) return invalid_argument(where + ": " + state.tensor->name + " is not a JSON object");
  auto bad = [&](const std::string& what) { return invalid_argument(where + ": " + state.tensor->name + ": " + what); };
  static constexpr std::string_view kKeys[] = {"quant_type",       "blocksize",    "dtype",        "shape",
                                               "nested_blocksize", "nested_dtype", "nested_offset"};
  for (const auto& [key, value] : j.items())
    if (std::find(std::begin(kKeys), std::end(kKeys), key) == std::end(kKeys)) return bad("unknown key " + key);
  if (j.value("quant_type", nlohmann::json()) != type_name)
    return bad("quant_type is " + j.value("quant_type", nlohmann::json()).dump() + ", the tensor's name says " +
               type_name);
  bnb4::parse_quant_type(type_name, &q.type);
  const nlohmann::json bs = j.value("blocksize", nlohmann::json());
  if (!bs.is_number_unsigned() || bs.get<uint64_t>() < 32 || bs.get<uint64_t>() > 4096 ||
      (bs.get<uint64_t>() & (bs.get<uint64_t>() - 1)) != 0)
    return bad("blocksize is " + bs.dump() + ": bitsandbytes' are powers of two from 32 to 4096");
  q.blocksize = bs.get<uint64_t>();
  const nlohmann::json shape = j.value("shape", nlohmann::json());
  const bool dims = shape.is_array() && std::all_of(shape.begin(), shape.end(),
                                                    [](const nlohmann::json& d) { return d.is_number_integer(); });
  if (!dims || shape.get<std::vector<int64_t>>() != spec.shape)
    return bad("shape is " + shape.dump() + ", the model config's " + spec.name + " is " + shape_string(spec.shape));
  const nlohmann::json dtype = j.value("dtype", nlohmann::json());
  Result<DType> dt = dtype.is_string() ? parse_dtype(dtype.get<std::string>()) : invalid_argument("");
  if (!dt.is_ok()) return bad("dtype is " + dtype.dump() + ", not float32, bfloat16 or float16");
  q.dtype = *dt;
  q.n = elems_of(spec.shape);
  const uint64_t blocks = bnb4::block_count(q.n, q.blocksize);
  if (!q.packed.tensor->u8 || q.packed.tensor->size_bytes != bnb4::packed_bytes(q.n))
    return invalid_argument(where + ": the packed codes are " + std::to_string(q.packed.tensor->size_bytes) + " bytes" +
                            (q.packed.tensor->u8 ? "" : " of floats") + ", " + std::to_string(bnb4::packed_bytes(q.n)) +
                            " U8 bytes hold " + shape_string(spec.shape));
  Tensor quant_map;
  ZO_RETURN_IF_ERROR(tensor(".quant_map", &quant_map));
  ZO_RETURN_IF_ERROR(tensor(".absmax", &q.absmax));
  std::array<float, 16> map{};
  ZO_RETURN_IF_ERROR(f32s(quant_map, 16));
  ZO_RETURN_IF_ERROR(quant_map.file->read_f32(*quant_map.tensor, 0, map));
  const std::array<float, 16>& code = q.type == bnb4::QuantType::kNf4 ? bnb4::kNf4Code : bnb4::kFp4Code;
  if (std::memcmp(map.data(), code.data(), sizeof(map)) != 0)
    return invalid_argument(where + ": " + quant_map.tensor->name + " is not bitsandbytes' " + type_name + " table");
  q.nested = j.contains("nested_offset");
  if (!q.nested) {
    ZO_RETURN_IF_ERROR(f32s(q.absmax, blocks, " (one per block of " + std::to_string(q.blocksize) + ")"));
    return std::optional<QuantizedWeight>(std::move(q));
  }
  const nlohmann::json bs2 = j.value("nested_blocksize", nlohmann::json()), off = j["nested_offset"];
  if (!bs2.is_number_unsigned() || bs2.get<uint64_t>() == 0 || bs2.get<uint64_t>() > 4096)
    return bad("nested_blocksize is " + bs2.dump());
  if (!off.is_number() || !std::isfinite(off.get<double>())) return bad("nested_offset is " + off.dump());
  if (j.contains("nested_dtype") && j["nested_dtype"] != "float32")
    return bad("nested_dtype is " + j["nested_dtype"].dump() + ", not float32");
  q.blocksize2 = bs2.get<uint64_t>();
  q.offset = static_cast<float>(off.get<double>());  // the fp32 offset, written as a double
  ZO_RETURN_IF_ERROR(tensor(".nested_absmax", &q.nested_absmax));
  ZO_RETURN_IF_ERROR(tensor(".nested_quant_map", &q.nested_map));
  if (!q.absmax.tensor->u8 || q.absmax.tensor->n_elems != blocks)
    return invalid_argument(where + ": " + q.absmax.tensor->name + " is not " + std::to_string(blocks) +
                            " U8 codes (one per block, double quantization)");
  const uint64_t blocks2 = bnb4::block_count(blocks, q.blocksize2);
  ZO_RETURN_IF_ERROR(f32s(q.nested_absmax, blocks2));
  ZO_RETURN_IF_ERROR(f32s(q.nested_map, 256));
  return std::optional<QuantizedWeight>(std::move(q));
}

// The absmax values of a 4-bit weight, double quantization read back (bnb4::dequantize_absmax); an
// 8-bit weight's SCB.
Result<std::vector<float>> read_absmax(const QuantizedWeight& q) {
  if (q.int8) {  // the rows' SCB
    std::vector<float> scb(q.n / q.cols);
    ZO_RETURN_IF_ERROR(q.absmax.file->read_f32(*q.absmax.tensor, 0, scb));
    return scb;
  }
  const uint64_t blocks = bnb4::block_count(q.n, q.blocksize);
  std::vector<float> absmax(blocks);
  if (!q.nested) {
    ZO_RETURN_IF_ERROR(q.absmax.file->read_f32(*q.absmax.tensor, 0, absmax));
    return absmax;
  }
  std::vector<uint8_t> codes(blocks);
  std::vector<float> absmax2(q.nested_absmax.tensor->n_elems), map(256);
  ZO_RETURN_IF_ERROR(q.absmax.file->read_raw(*q.absmax.tensor, 0, codes));
  ZO_RETURN_IF_ERROR(q.nested_absmax.file->read_f32(*q.nested_absmax.tensor, 0, absmax2));
  ZO_RETURN_IF_ERROR(q.nested_map.file->read_f32(*q.nested_map.tensor, 0, map));
  bnb4::dequantize_absmax(codes.data(), absmax2.data(), map.data(), blocks, q.blocksize2, q.offset, absmax.data());
  return absmax;
}

// A packed weight's blob (Note [The packed 4-bit base] in common/bnb4_blob.h) but its codes and
// scales: the header (`type`, `round`, the weight's shape) and the zeros after the codes and after
// the scales (at most 15 bytes each). Those two regions never overlap the codes or the scales, so
// this may be sent before, after or between them.
Status emit_blob_frame(const PackedSink& sink, uint32_t p, const ParamSpec& spec, uint8_t type, DType round) {
  static constexpr std::byte kZeros[16] = {};
  const uint64_t n = elems_of(spec.shape), rows = static_cast<uint64_t>(spec.shape.front()), cols = n / rows;
  uint8_t head[bnb4::kBlobHeaderBytes];
  bnb4::write_blob_header({.type = type, .round = round, .rows = rows, .cols = cols}, head);
  ZO_RETURN_IF_ERROR(sink(p, 0, std::as_bytes(std::span(head))));
  const uint64_t codes_end = bnb4::blob_codes_offset() + bnb4::blob_code_bytes(type, n),
                 scales_at = bnb4::blob_scales_offset(type, n),
                 scales_end = scales_at + 4 * bnb4::blob_scale_count(type, rows, cols);
  ZO_RETURN_IF_ERROR(sink(p, codes_end, std::span(kZeros, scales_at - codes_end)));
  return sink(p, scales_end, std::span(kZeros, bnb4::blob_bytes(type, rows, cols) - scales_end));
}

// The blob of a packed weight (Note [The packed 4-bit base] in common/bnb4_blob.h) from the
// checkpoint's own codes and scales, in pieces of at most chunk_bytes: the codes are copied as they
// are stored; a 4-bit weight's absmax is repeated for every 64-element block of its block (blocks
// of 64 or more: load_hf_weights refuses others before any data moves), an 8-bit weight's SCB is
// copied as it is.
Status emit_blob(const QuantizedWeight& q, const ParamSpec& spec, uint32_t p, uint64_t chunk_bytes,
                 const PackedSink& sink) {
  ZO_CHECK(q.int8 || bnb4::kBlobBlock <= q.blocksize) << spec.name;
  const uint8_t type = q.blob_type();
  ZO_RETURN_IF_ERROR(emit_blob_frame(sink, p, spec, type, q.dtype));
  const uint64_t rows = static_cast<uint64_t>(spec.shape.front()), cols = q.n / rows;
  const uint64_t codes = bnb4::blob_code_bytes(type, q.n), scales_at = bnb4::blob_scales_offset(type, q.n),
                 scales = bnb4::blob_scale_count(type, rows, cols);
  std::vector<uint8_t> buffer(std::min(chunk_bytes, std::max<uint64_t>(codes, 4 * scales)));
  for (uint64_t off = 0; off < codes; off += buffer.size()) {
    const std::span<uint8_t> chunk(buffer.data(), std::min<uint64_t>(buffer.size(), codes - off));
    ZO_RETURN_IF_ERROR(q.packed.file->read_raw(*q.packed.tensor, off, chunk));
    ZO_RETURN_IF_ERROR(sink(p, bnb4::blob_codes_offset() + off, std::as_bytes(chunk)));
  }
  ZO_ASSIGN_OR_RETURN(const std::vector<float> absmax, read_absmax(q));
  const uint64_t per = q.int8 ? 1 : q.blocksize / bnb4::kBlobBlock;
  std::vector<float> out(std::max<uint64_t>(1, buffer.size() / 4));
  for (uint64_t j = 0; j < scales; j += out.size()) {
    const uint64_t n = std::min<uint64_t>(out.size(), scales - j);
    for (uint64_t k = 0; k < n; ++k) out[k] = absmax[(j + k) / per];
    ZO_RETURN_IF_ERROR(sink(p, scales_at + 4 * j, std::as_bytes(std::span(out.data(), n))));
  }
  return Status::ok();
}

// Elements [off, off + out.size()) of a quantized weight as bitsandbytes reads it back — a 4-bit
// weight as dequantize_4bit gives it in the state's dtype, an 8-bit one as bnb4::int8_element —
// widened to fp32.
Status read_dequantized(const QuantizedWeight& q, const std::vector<float>& absmax, uint64_t off, std::span<float> out,
                        std::vector<uint8_t>* bytes) {
  if (q.int8) {
    bytes->resize(out.size());
    ZO_RETURN_IF_ERROR(q.packed.file->read_raw(*q.packed.tensor, off, *bytes));
    for (uint64_t k = 0; k < out.size(); ++k)
      out[k] = bnb4::int8_element(static_cast<int8_t>((*bytes)[k]), absmax[(off + k) / q.cols]);
    return Status::ok();
  }
  const uint64_t first = off / 2, last = (off + out.size() + 1) / 2;
  bytes->resize(last - first);
  ZO_RETURN_IF_ERROR(q.packed.file->read_raw(*q.packed.tensor, first, *bytes));
  bnb4::dequantize(bytes->data(), absmax.data(), off, out.size(), q.blocksize, q.type, q.dtype, out.data());
  return Status::ok();
}

// One adapter of init_lora_adapters, through `buffer` (at least min(chunk_elems, its size) long).
Status init_lora_adapter(const ParamSpec& spec, uint32_t p, uint64_t seed, uint64_t chunk_elems,
                         std::vector<float>& buffer, const ParamSink& sink) {
  const uint64_t n = elems_of(spec.shape);
  const bool a = ends_with(spec.name, ".lora_A.weight");
  const double bound = 1.0 / std::sqrt(static_cast<double>(spec.shape.back()));
  const uint64_t key = stream_key(seed, spec.name);
  for (uint64_t off = 0; off < n; off += chunk_elems) {
    const std::span<float> chunk(buffer.data(), std::min(chunk_elems, n - off));
    for (uint64_t i = 0; i < chunk.size(); ++i) {
      // u in [0, 1) from draw off + i of the stream: bound · (2u − 1) in [−bound, bound).
      const double u = static_cast<double>(mix64(key + (off + i + 1) * kGamma) >> 11) * 0x1.0p-53;
      chunk[i] = a ? static_cast<float>(bound * (2 * u - 1)) : 0.0f;
    }
    ZO_RETURN_IF_ERROR(sink(p, off, chunk));
  }
  return Status::ok();
}

}  // namespace

Status init_lora_adapters(const ModelLayout& layout, uint64_t seed, uint64_t chunk_elems, const ParamSink& sink) {
  if (chunk_elems == 0) return invalid_argument("init_lora_adapters: chunk_elems must be positive");
  std::vector<float> buffer;
  for (size_t p = 0; p < layout.params.size(); ++p) {
    const ParamSpec& spec = layout.params[p];
    if (!is_lora_param(spec.name)) continue;
    buffer.resize(std::max<size_t>(buffer.size(), std::min(chunk_elems, elems_of(spec.shape))));
    ZO_RETURN_IF_ERROR(init_lora_adapter(spec, static_cast<uint32_t>(p), seed, chunk_elems, buffer, sink));
  }
  return Status::ok();
}

Status load_peft_adapters(const std::string& adapter_dir, const ModelLayout& layout, uint64_t chunk_elems,
                          const ParamSink& sink, io::Env* env, const AdapterLimits& limits) {
  if (chunk_elems == 0) return invalid_argument("load_peft_adapters: chunk_elems must be positive");
  const std::string path = adapter_dir + "/" + kPeftWeightsFile;
  ZO_ASSIGN_OR_RETURN(const io::PathKind kind, env->path_kind(path));
  if (kind != io::PathKind::kFile) {
    ZO_ASSIGN_OR_RETURN(const io::PathKind bin, env->path_kind(adapter_dir + "/adapter_model.bin"));
    return not_found(path + " is missing" +
                     (bin == io::PathKind::kFile
                          ? std::string(" (the directory has adapter_model.bin, a pickle: save the adapter with "
                                        "safe_serialization=True, PEFT's default)")
                          : std::string()));
  }
  ZO_ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsFile> file, SafetensorsFile::open(path, env));
  std::vector<const SafetensorsTensor*> sources(layout.params.size(), nullptr);
  std::set<std::string> used;
  uint64_t max_elems = 0;
  for (size_t p = 0; p < layout.params.size(); ++p) {
    const ParamSpec& spec = layout.params[p];
    if (!is_lora_param(spec.name)) continue;
    const std::string stored = kPeftPrefix + spec.name;
    const SafetensorsTensor* t = file->find(stored);
    if (t == nullptr)
      return not_found("adapter " + stored + " " + shape_string(spec.shape) + " is missing from " + path +
                       " (its adapter_config.json's target_modules name the projections adapted)");
    if (t->shape != spec.shape)
      return invalid_argument("adapter " + stored + " has shape " + shape_string(t->shape) + " in " + path +
                              ", expected " + shape_string(spec.shape) + " from the model config and r");
    sources[p] = t;
    used.insert(stored);
    max_elems = std::max(max_elems, t->n_elems);
  }
  for (const SafetensorsTensor& t : file->tensors())
    if (!used.contains(t.name))
      return invalid_argument(path + " holds " + t.name +
                              ", which this model has no place for (zoffload loads LoRA adapters on the decoder "
                              "layers' projections: lora_A and lora_B)");
  std::vector<float> buffer(std::min(chunk_elems, max_elems));
  // Note [Adapter values]: a NaN or inf in an adapter, or a B and A whose product is out of range,
  // would train NaN losses from the first step (and PEFT's too), to exit 0. Each value must be
  // finite, and each projection's update s·B·A must be squarable in the compute dtype, as the terms
  // of a gradient norm are: every element of B·A is a sum of r products, so |s·(B·A)| ≤ s · r ·
  // max|B| · max|A| (in double) must stay within √max: 1.8e19 in fp32 and bf16, 256 in fp16. A
  // trained adapter's updates are far below 1. (A bound of the dtype's range itself passed a B of
  // 3e38 over a Kaiming A, whose first step's gradient norm was NaN.) Adapters are small next to the
  // base: this first pass reads them once more.
  struct Extent {
    double a = 0, b = 0, r = 0;  // max|A|, max|B|, the rank (A's rows)
  };
  std::map<std::string, Extent> extents;  // by module
  for (size_t p = 0; p < layout.params.size(); ++p) {
    const SafetensorsTensor* t = sources[p];
    if (t == nullptr) continue;
    double m = 0;
    for (uint64_t off = 0; off < t->n_elems; off += chunk_elems) {
      const std::span<float> chunk(buffer.data(), std::min(chunk_elems, t->n_elems - off));
      ZO_RETURN_IF_ERROR(file->read_f32(*t, off, chunk));
      for (size_t i = 0; i < chunk.size(); ++i) {
        if (!std::isfinite(chunk[i]))
          return invalid_argument(path + ": " + t->name + " holds " + format_number(chunk[i]) + " at element " +
                                  std::to_string(off + i) + ": an adapter must be finite");
        m = std::max(m, static_cast<double>(std::fabs(chunk[i])));
      }
    }
    const ParamSpec& spec = layout.params[p];
    Extent& e = extents[spec.name.substr(0, spec.name.rfind(".lora_"))];
    if (spec.name.find(".lora_A.") != std::string::npos) {
      e.a = m;
      e.r = static_cast<double>(spec.shape[0]);
    } else {
      e.b = m;
    }
  }
  for (const auto& [module, e] : extents) {
    const double bound = limits.scaling * e.r * e.a * e.b;
    if (!(bound <= std::sqrt(limits.max_value)))
      return invalid_argument(path + ": the adapter of " + module + " (max |A| " + format_number(e.a) +
                              ", max |B| " + format_number(e.b) + ", scale " + format_number(limits.scaling) +
                              ", r " + format_number(e.r) + ") can add up to " + format_number(bound) +
                              " to a weight, beyond " + format_number(std::sqrt(limits.max_value)) +
                              ", the square root of the compute dtype's largest value: its forward and "
                              "gradients would overflow");
  }
  for (size_t p = 0; p < layout.params.size(); ++p) {
    const SafetensorsTensor* t = sources[p];
    if (t == nullptr) continue;
    for (uint64_t off = 0; off < t->n_elems; off += chunk_elems) {
      const std::span<float> chunk(buffer.data(), std::min(chunk_elems, t->n_elems - off));
      ZO_RETURN_IF_ERROR(file->read_f32(*t, off, chunk));
      ZO_RETURN_IF_ERROR(sink(static_cast<uint32_t>(p), off, chunk));
    }
  }
  return Status::ok();
}

Status apply_weights_tying(const std::string& model_dir, ModelConfig* config, io::Env* env) {
  if (!config->tie_word_embeddings) return Status::ok();
  Result<std::unique_ptr<HfWeights>> opened = HfWeights::open(model_dir, env);
  // Weights that cannot be opened have no head to untie: a directory of config.json (and perhaps the
  // index) alone, as `zoffload plan` reads a model not downloaded; a run's loader says what is wrong.
  if (!opened.is_ok()) return Status::ok();
  ZO_ASSIGN_OR_RETURN(std::unique_ptr<HfWeights> weights, std::move(opened));
  const SafetensorsFile *head_file = nullptr, *embed_file = nullptr;
  const SafetensorsTensor* head = weights->find(stored_name(*weights, "lm_head.weight"), &head_file);
  const SafetensorsTensor* embed = weights->find(stored_name(*weights, "model.embed_tokens.weight"), &embed_file);
  if (head == nullptr || embed == nullptr) return Status::ok();
  bool differ = head->shape != embed->shape;
  constexpr uint64_t kChunk = uint64_t{1} << 22;
  std::vector<float> a(std::min(kChunk, head->n_elems)), b(a.size());
  for (uint64_t off = 0; !differ && off < head->n_elems; off += kChunk) {
    const uint64_t n = std::min(kChunk, head->n_elems - off);
    ZO_RETURN_IF_ERROR(head_file->read_f32(*head, off, std::span(a.data(), n)));
    ZO_RETURN_IF_ERROR(embed_file->read_f32(*embed, off, std::span(b.data(), n)));
    differ = std::memcmp(a.data(), b.data(), n * sizeof(float)) != 0;
  }
  if (!differ) return Status::ok();
  ZO_LOG(kWarn) << model_dir << ": config.json ties lm_head.weight to model.embed_tokens.weight "
                << "(tie_word_embeddings), but its weights hold both with different values: as transformers "
                << "does, they are not tied (set tie_word_embeddings false in config.json to silence this)";
  config->tie_word_embeddings = false;
  return Status::ok();
}

Status load_hf_weights(const std::string& model_dir, const ModelLayout& layout, uint64_t chunk_elems,
                       const ParamSink& sink, io::Env* env, const PackedSink& packed) {
  if (chunk_elems == 0) return invalid_argument("load_hf_weights: chunk_elems must be positive");
  ZO_ASSIGN_OR_RETURN(std::unique_ptr<HfWeights> weights, HfWeights::open(model_dir, env));

  // Every check before any data moves, so a wrong model directory never half-fills the tiers.
  std::vector<std::pair<const SafetensorsFile*, const SafetensorsTensor*>> sources(layout.params.size());
  std::vector<std::optional<QuantizedWeight>> quantized(layout.params.size());
  std::set<std::string> used;  // the stored names read
  uint64_t max_elems = 0;
  for (size_t p = 0; p < layout.params.size(); ++p) {
    const ParamSpec& spec = layout.params[p];
    if (is_lora_param(spec.name)) continue;  // not the base's: init_lora_adapters, load_peft_adapters
    const SafetensorsFile* file = nullptr;
    const std::string stored = stored_name(*weights, spec.name);
    used.insert(stored);
    const SafetensorsTensor* t = weights->find(stored, &file);
    if (t == nullptr) {
      std::string message =
          "tensor " + spec.name + " " + shape_string(spec.shape) + " is missing from the weights in " + model_dir;
      if (spec.name == "lm_head.weight")
        message +=
            " (the config has tie_word_embeddings false, so the model needs its own lm_head.weight; "
            "if the checkpoint ties it to model.embed_tokens.weight, set tie_word_embeddings true in config.json)";
      return not_found(message);
    }
    ZO_ASSIGN_OR_RETURN(quantized[p], find_quantized(*weights, stored, spec, &used));
    const BnbQuantization& quantization = layout.quantization;
    if (quantized[p].has_value() && !quantization.quantized())
      return invalid_argument("tensor " + stored + " in " + model_dir + " is bitsandbytes " +
                              quantized[p]->bits_name() + ", but config.json has no quantization_config saying so");
    if (quantized[p].has_value() && quantized[p]->int8 != quantization.load_in_8bit)
      return invalid_argument("tensor " + stored + " in " + model_dir + " is bitsandbytes " +
                              quantized[p]->bits_name() + ", but config.json's quantization_config says " +
                              quantization.bits_name());
    if (!quantized[p].has_value() && quantization.quantized() && !kept_in_16_bits(spec.name, quantization))
      return invalid_argument("tensor " + stored + " in " + model_dir + " has no " + quantization.bits_name() +
                              " quantization state, but config.json's quantization_config says the decoder "
                              "projections are " +
                              quantization.bits_name() + " (llm_int8_skip_modules does not name it)");
    if (quantized[p].has_value() && spec.packed() && !packed)
      return internal_error("load_hf_weights: " + spec.name + " is packed but no PackedSink was given");
    if (quantized[p].has_value() && spec.packed() && !quantized[p]->int8 && quantized[p]->blocksize < bnb4::kBlobBlock)
      return invalid_argument("tensor " + stored + " in " + model_dir + " is quantized in blocks of " +
                              std::to_string(quantized[p]->blocksize) +
                              ": a frozen 4-bit base is kept packed in "
                              "blocks of 64 or more (bitsandbytes' default is 64)");
    if (!quantized[p].has_value() && t->shape != spec.shape)  // a quantized weight's shape was checked
      return invalid_argument("tensor " + stored + " has shape " + shape_string(t->shape) + " in " + file->path() +
                              ", expected " + shape_string(spec.shape) + " from the model config");
    sources[p] = {file, t};
    max_elems = std::max(max_elems, elems_of(spec.shape));
  }
  std::vector<std::string> unused;
  for (const std::string& name : weights->names())
    if (!used.contains(name)) unused.push_back(name);
  if (!unused.empty()) {
    std::string list;
    for (size_t i = 0; i < unused.size() && i < 16; ++i) list += (i ? ", " : "") + unused[i];
    if (unused.size() > 16) list += ", ... (" + std::to_string(unused.size() - 16) + " more)";
    ZO_LOG(kWarn) << model_dir << ": " << unused.size() << " tensor(s) not used by the model, ignored: " << list;
  }

  std::vector<float> buffer(std::min(chunk_elems, max_elems));
  std::vector<uint8_t> bytes;
  for (size_t p = 0; p < layout.params.size(); ++p) {
    const auto [file, t] = sources[p];
    if (file == nullptr) continue;  // an adapter
    if (quantized[p].has_value() && layout.params[p].packed()) {
      ZO_RETURN_IF_ERROR(emit_blob(*quantized[p], layout.params[p], static_cast<uint32_t>(p), 4 * chunk_elems, packed));
      continue;
    }
    if (quantized[p].has_value()) {
      const QuantizedWeight& q = *quantized[p];
      ZO_ASSIGN_OR_RETURN(const std::vector<float> absmax, read_absmax(q));
      for (uint64_t off = 0; off < q.n; off += chunk_elems) {
        const std::span<float> chunk(buffer.data(), std::min(chunk_elems, q.n - off));
        ZO_RETURN_IF_ERROR(read_dequantized(q, absmax, off, chunk, &bytes));
        ZO_RETURN_IF_ERROR(sink(static_cast<uint32_t>(p), off, chunk));
      }
      continue;
    }
    for (uint64_t off = 0; off < t->n_elems; off += chunk_elems) {
      const std::span<float> chunk(buffer.data(), std::min(chunk_elems, t->n_elems - off));
      ZO_RETURN_IF_ERROR(file->read_f32(*t, off, chunk));
      ZO_RETURN_IF_ERROR(sink(static_cast<uint32_t>(p), off, chunk));
    }
  }
  return Status::ok();
}

ParamSink quantizing_sink(const ModelLayout& layout, bnb4::QuantType type, ParamSink inner, PackedSink packed) {
  constexpr uint64_t kBlock = bnb4::kBlobBlock;  // transformers' 4-bit blocksize
  return [&layout, type, inner = std::move(inner), sink = std::move(packed), codes = std::vector<uint8_t>(),
          absmax = std::vector<float>()](uint32_t param, uint64_t offset,
                                         std::span<const float> values) mutable -> Status {
    const ParamSpec& spec = layout.params[param];
    if (!spec.packed()) return inner(param, offset, values);
    const uint64_t n = elems_of(spec.shape);
    if (offset % kBlock != 0 || (values.size() % kBlock != 0 && offset + values.size() != n))
      return invalid_argument("quantizing " + spec.name + ": a chunk of " + std::to_string(values.size()) +
                              " elements at " + std::to_string(offset) + " is not whole blocks of 64");
    // Rounded once, to the compute dtype, by the kernel: the values as the fp32 product gives them.
    if (offset == 0) ZO_RETURN_IF_ERROR(emit_blob_frame(sink, param, spec, static_cast<uint8_t>(type), DType::kF32));
    codes.resize(bnb4::packed_bytes(values.size()));
    absmax.resize(bnb4::block_count(values.size(), kBlock));
    // Whole blocks on each thread (a partial one only at the chunk's end, which is the tensor's).
    parallel_ranges(values.size(), kBlock, [&](uint64_t begin, uint64_t end) {
      bnb4::quantize(values.data() + begin, end - begin, kBlock, type, codes.data() + begin / 2,
                     absmax.data() + begin / kBlock);
    });
    ZO_RETURN_IF_ERROR(sink(param, bnb4::blob_codes_offset() + offset / 2, std::as_bytes(std::span(codes))));
    return sink(param, bnb4::blob_scales_offset(static_cast<uint8_t>(type), n) + 4 * (offset / kBlock),
                std::as_bytes(std::span(absmax)));
  };
}

Status random_init_weights(const ModelConfig& config, const ModelLayout& layout, uint64_t seed, uint64_t chunk_elems,
                           const ParamSink& sink) {
  if (chunk_elems == 0) return invalid_argument("random_init_weights: chunk_elems must be positive");
  uint64_t max_elems = 0;
  for (const ParamSpec& spec : layout.params) max_elems = std::max(max_elems, elems_of(spec.shape));
  std::vector<float> buffer(std::min(chunk_elems, max_elems));
  const double std = config.initializer_range;
  for (size_t p = 0; p < layout.params.size(); ++p) {
    const ParamSpec& spec = layout.params[p];
    const uint64_t n = elems_of(spec.shape);
    if (is_lora_param(spec.name)) {
      ZO_RETURN_IF_ERROR(init_lora_adapter(spec, static_cast<uint32_t>(p), seed, chunk_elems, buffer, sink));
      continue;
    }
    const bool is_norm = ends_with(spec.name, "norm.weight");
    const bool is_bias = ends_with(spec.name, ".bias");
    const uint64_t key = stream_key(seed, spec.name);
    for (uint64_t off = 0; off < n; off += chunk_elems) {
      const std::span<float> chunk(buffer.data(), std::min(chunk_elems, n - off));
      if (is_norm || is_bias) {
        // A norm scales by 1 at init: its weight is 1, or 0 where it scales by 1 + weight (Gemma).
        const bool one_plus = config.family().norm_scale == NormScale::kOnePlusInFp32;
        std::fill(chunk.begin(), chunk.end(), is_norm && !one_plus ? 1.0f : 0.0f);
      } else {
        fill_normal(key, std, off, chunk);
      }
      ZO_RETURN_IF_ERROR(sink(static_cast<uint32_t>(p), off, chunk));
    }
  }
  return Status::ok();
}

}  // namespace zo::engine

#include "engine/model/weights.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <numbers>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "common/log.h"
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

// Box–Muller costs ~20 ns per element: a 7B model would take minutes on one core, so large chunks
// are split over threads. Each element depends only on its index, so the split cannot change values.
void fill_normal(uint64_t key, double std, uint64_t first, std::span<float> out) {
  constexpr uint64_t kMinPerThread = 1 << 16;
  const uint64_t n_threads =
      std::min<uint64_t>({std::max(1u, std::thread::hardware_concurrency()), 32, out.size() / kMinPerThread});
  if (n_threads <= 1) return fill_normal_serial(key, std, first, out);
  const uint64_t per = (out.size() + n_threads - 1) / n_threads;
  std::vector<std::thread> workers;
  for (uint64_t t = 1; t < n_threads; ++t) {
    const uint64_t begin = t * per;
    if (begin >= out.size()) break;
    workers.emplace_back(fill_normal_serial, key, std, first + begin,
                         out.subspan(begin, std::min(per, out.size() - begin)));
  }
  fill_normal_serial(key, std, first, out.subspan(0, per));
  for (std::thread& w : workers) w.join();
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
                       const ParamSink& sink, io::Env* env) {
  if (chunk_elems == 0) return invalid_argument("load_hf_weights: chunk_elems must be positive");
  ZO_ASSIGN_OR_RETURN(std::unique_ptr<HfWeights> weights, HfWeights::open(model_dir, env));

  // Every check before any data moves, so a wrong model directory never half-fills the tiers.
  std::vector<std::pair<const SafetensorsFile*, const SafetensorsTensor*>> sources(layout.params.size());
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
    if (t->shape != spec.shape)
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
  for (size_t p = 0; p < layout.params.size(); ++p) {
    const auto [file, t] = sources[p];
    if (file == nullptr) continue;  // an adapter
    for (uint64_t off = 0; off < t->n_elems; off += chunk_elems) {
      const std::span<float> chunk(buffer.data(), std::min(chunk_elems, t->n_elems - off));
      ZO_RETURN_IF_ERROR(file->read_f32(*t, off, chunk));
      ZO_RETURN_IF_ERROR(sink(static_cast<uint32_t>(p), off, chunk));
    }
  }
  return Status::ok();
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

#include "engine/model/decoder.h"
#include "engine/model/torch_runtime.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <exception>
#include <numbers>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <utility>

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-parameter"
#include <ATen/ATen.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <torch/version.h>
#pragma GCC diagnostic pop

#include "common/timer.h"

namespace zo::engine {
namespace {

// Hugging Face's RMSNorm: normalize in fp32, then LlamaRMSNorm casts back to the input dtype and
// scales, Olmo2RMSNorm scales in fp32 and casts back.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, NormScale scale) {
  const at::Tensor xf = x.to(at::kFloat);
  const at::Tensor variance = xf.pow(2).mean(-1, /*keepdim=*/true);
  const at::Tensor normed = xf * at::rsqrt(variance + eps);
  switch (scale) {
    case NormScale::kCastThenScale: return weight * normed.to(x.scalar_type());
    case NormScale::kScaleInFp32: return (weight * normed).to(x.scalar_type());
    case NormScale::kOnePlusInFp32: return (normed * (1.0 + weight.to(at::kFloat))).to(x.scalar_type());
  }
  TORCH_CHECK(false, "unknown norm scale");
}

at::Tensor rotate_half(const at::Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  return at::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
}

// [B, T, heads*D] -> [B, heads, T, D]
at::Tensor split_heads(const at::Tensor& x, int64_t heads, int64_t head_dim) {
  return x.view({x.size(0), x.size(1), heads, head_dim}).transpose(1, 2);
}

// HF's repeat_kv: each kv head serves n_rep consecutive query heads.
at::Tensor repeat_kv(const at::Tensor& x, int64_t n_rep) {
  if (n_rep == 1) return x;
  const int64_t b = x.size(0), kv = x.size(1), t = x.size(2), d = x.size(3);
  return x.unsqueeze(2).expand({b, kv, n_rep, t, d}).reshape({b, kv * n_rep, t, d});
}

at::Tensor dense(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b = {}) {
  return b.defined() ? at::linear(x, w, b) : at::linear(x, w);
}

size_t expected_params(const ModelConfig& config, BlockKind kind) {
  switch (kind) {
    case BlockKind::kEmbedding: return 1;
    case BlockKind::kDecoder: return decoder_params(config).size();
    case BlockKind::kHead: return 2;
  }
  return 0;
}

at::Tensor decoder_forward(const ModelConfig& config, int64_t layer, const std::vector<at::Tensor>& p,
                           const at::Tensor& x, const RopeTables& rope) {
  const int64_t T = x.size(1);
  const auto heads = static_cast<int64_t>(config.num_attention_heads);
  const auto kv_heads = static_cast<int64_t>(config.num_key_value_heads);
  const auto head_dim = static_cast<int64_t>(config.head_dim);
  TORCH_CHECK(x.dim() == 3 && x.size(2) == static_cast<int64_t>(config.hidden_size), "decoder input must be [B, T, ",
              config.hidden_size, "], got ", x.sizes());
  TORCH_CHECK(rope.cos.defined() && rope.cos.size(0) >= T, "RoPE tables cover fewer positions than the sequence (", T,
              ")");
  TORCH_CHECK(
      !config.sliding_layers.empty() || config.sliding_window == 0 || static_cast<uint64_t>(T) <= config.sliding_window,
      "sequence length ", T, " exceeds the model's sliding attention window ", config.sliding_window,
      " (zoffload applies a window for gemma3_text and phi3 only: train with --seq-len at most the window)");
  const bool sliding = !config.sliding_layers.empty() && config.sliding_layers.at(static_cast<size_t>(layer));
  const bool local_rope = sliding && config.local_rope_theta > 0;
  TORCH_CHECK(!local_rope || rope.local_cos.defined(), "the sliding layers' RoPE tables are missing");
  std::array<at::Tensor, static_cast<size_t>(DecoderRole::kCount)> w;  // undefined: not in this family
  // Note [LoRA adapters]: A and B of the adapted projections, by the projection's role.
  std::array<at::Tensor, static_cast<size_t>(DecoderRole::kCount)> lora_a, lora_b;
  const std::vector<DecoderParam> slots = decoder_params(config);
  for (size_t i = 0; i < slots.size(); ++i) {
    if (slots[i].role == DecoderRole::kLoraA) {
      lora_a[static_cast<size_t>(slots[i].target)] = p[i];
    } else if (slots[i].role == DecoderRole::kLoraB) {
      lora_b[static_cast<size_t>(slots[i].target)] = p[i];
    } else {
      w[static_cast<size_t>(slots[i].role)] = p[i];
    }
  }
  auto at_role = [&](DecoderRole role) -> const at::Tensor& { return w[static_cast<size_t>(role)]; };
  // A projection, and its adapter's s·B·(A·x) where it has one: PEFT's base output, then lora_B(lora_A(x)) · s.
  const double lora_scaling = config.lora.r > 0 ? config.lora.scaling() : 0.0;
  auto linear = [&](const at::Tensor& in, DecoderRole weight, const at::Tensor& bias = {}) {
    at::Tensor y = dense(in, at_role(weight), bias);
    const at::Tensor& a = lora_a[static_cast<size_t>(weight)];
    if (a.defined()) y = y + dense(dense(in, a), lora_b[static_cast<size_t>(weight)]) * lora_scaling;
    return y;
  };
  const ModelFamily& family = config.family();
  auto norm = [&](const at::Tensor& t, DecoderRole role) {
    return rms_norm(t, at_role(role), config.rms_norm_eps, family.norm_scale);
  };
  using R = DecoderRole;
  const bool pre = family.norms != NormPlacement::kPost, post = family.norms != NormPlacement::kPre;

  const at::Tensor n = pre ? norm(x, R::kInputNorm) : x;
  // Each projection with its norm, in transformers' order (q, then k, then v): in bf16 the order
  // autograd adds the three gradients of `n` in follows the order the ops were recorded in.
  auto project = [&](DecoderRole weight, DecoderRole bias, DecoderRole qk_norm, int64_t n_heads) {
    at::Tensor t = linear(n, weight, at_role(bias));
    if (family.qk_norm == QkNorm::kWhole) t = norm(t, qk_norm);  // OLMo 2: the whole projection
    t = split_heads(t, n_heads, head_dim);
    if (family.qk_norm == QkNorm::kPerHead) t = norm(t, qk_norm);  // Qwen3: each head's dims
    return t;
  };
  at::Tensor q, k, v;
  if (family.fused_projections) {  // one fused projection, sliced as Phi3Attention slices it
    const at::Tensor qkv = linear(n, R::kQkv);
    const int64_t q_dim = heads * head_dim, kv_dim = kv_heads * head_dim;
    q = split_heads(qkv.narrow(-1, 0, q_dim), heads, head_dim);
    k = split_heads(qkv.narrow(-1, q_dim, kv_dim), kv_heads, head_dim);
    v = split_heads(qkv.narrow(-1, q_dim + kv_dim, kv_dim), kv_heads, head_dim);
  } else {
    q = project(R::kQ, R::kQBias, R::kQNorm, heads);
    k = project(R::kK, R::kKBias, R::kKNorm, kv_heads);
    v = split_heads(linear(n, R::kV, at_role(R::kVBias)), kv_heads, head_dim);
  }
  const at::Tensor& cos_table = local_rope ? rope.local_cos : rope.cos;
  const at::Tensor& sin_table = local_rope ? rope.local_sin : rope.sin;
  if (family.rope_in_fp32) {
    // OLMo 2 rotates with the fp32 tables (q, k promoted to fp32) and casts the result back.
    TORCH_CHECK(config.rotary_dim() == head_dim, "RoPE in fp32 over part of the head is not implemented");
    const at::Tensor cos = cos_table.narrow(0, 0, T), sin = sin_table.narrow(0, 0, T);
    q = (q * cos + rotate_half(q) * sin).to(x.scalar_type());
    k = (k * cos + rotate_half(k) * sin).to(x.scalar_type());
  } else {
    // HF casts the fp32 tables to the activations' dtype before rotating.
    const at::Tensor cos = cos_table.narrow(0, 0, T).to(q.scalar_type());
    const at::Tensor sin = sin_table.narrow(0, 0, T).to(q.scalar_type());
    const int64_t rotary = config.rotary_dim();
    if (rotary == head_dim) {
      q = q * cos + rotate_half(q) * sin;
      k = k * cos + rotate_half(k) * sin;
    } else {  // Phi-3's partial rotary: the first `rotary` dims turn, the rest pass
      auto turn = [&](const at::Tensor& t) {
        const at::Tensor r = t.narrow(-1, 0, rotary);
        return at::cat({r * cos + rotate_half(r) * sin, t.narrow(-1, rotary, head_dim - rotary)}, -1);
      };
      q = turn(q);
      k = turn(k);
    }
  }
  const int64_t n_rep = heads / kv_heads;
  const double scale = config.query_pre_attn_scalar > 0 ? std::pow(config.query_pre_attn_scalar, -0.5) : 0.0;
  const at::Tensor attn = causal_attention(q, repeat_kv(k, n_rep), repeat_kv(v, n_rep), /*use_sdpa=*/true, scale,
                                           sliding ? static_cast<int64_t>(config.sliding_window) : 0);
  at::Tensor a = linear(attn.transpose(1, 2).reshape({x.size(0), T, heads * head_dim}), R::kO);
  if (post) a = norm(a, R::kPostAttnNorm);
  const at::Tensor h = x + a;

  const at::Tensor m = pre ? norm(h, R::kPreMlpNorm) : h;
  // gate before up, as transformers records them (C++ leaves the order of a product's operands open):
  // where `m` is the residual stream itself (post-norm), the order its three gradients are added in
  // shows in bf16.
  at::Tensor gate_in, up;
  if (family.fused_projections) {  // Phi3MLP: one projection, chunked into the gate and up halves
    const at::Tensor gate_up = linear(m, R::kGateUp);
    const auto I = static_cast<int64_t>(config.intermediate_size);
    gate_in = gate_up.narrow(-1, 0, I);
    up = gate_up.narrow(-1, I, I);
  } else {
    gate_in = linear(m, R::kGate);
  }
  const at::Tensor gate = config.activation == MlpActivation::kGeluTanh ? at::gelu(gate_in, "tanh") : at::silu(gate_in);
  if (!family.fused_projections) up = linear(m, R::kUp);
  at::Tensor f = linear(gate * up, R::kDown);
  if (post) f = norm(f, R::kPostMlpNorm);
  return h + f;
}

}  // namespace

torch::ScalarType to_torch_dtype(DType dtype) {
  switch (dtype) {
    case DType::kF32: return at::kFloat;
    case DType::kBF16: return at::kBFloat16;
    case DType::kF16: return at::kHalf;
  }
  return at::kFloat;
}

torch::Tensor param_tensor(void* addr, const ParamSpec& spec, DType dtype, torch::Device device) {
  return at::from_blob(addr, spec.shape, at::TensorOptions().dtype(to_torch_dtype(dtype)).device(device));
}

torch::Tensor rope_inv_freq(const ModelConfig& config, int64_t seq_len) {
  // Written op for op as transformers' rope init functions, so the fp32 roundings agree.
  const int64_t dim = config.rotary_dim();
  const at::Tensor exponent = at::arange(0, dim, 2, at::kLong).to(at::kFloat) / static_cast<double>(dim);
  const RopeScaling& s = config.rope_scaling;
  if (s.type == RopeScalingType::kLongRope) {
    const bool long_rows = static_cast<uint64_t>(seq_len) > s.original_max_position_embeddings;
    const at::Tensor ext = at::tensor(long_rows ? s.long_factor : s.short_factor, at::kDouble).to(at::kFloat);
    return at::reciprocal(ext * at::pow(config.rope_theta, exponent));
  }
  at::Tensor inv_freq = at::reciprocal(at::pow(config.rope_theta, exponent));
  switch (s.type) {
    case RopeScalingType::kNone:
    case RopeScalingType::kLongRope: break;
    case RopeScalingType::kLinear: inv_freq = inv_freq / s.factor; break;
    case RopeScalingType::kLlama3: {
      const auto old_context_len = static_cast<double>(s.original_max_position_embeddings);
      const double low_freq_wavelen = old_context_len / s.low_freq_factor;
      const double high_freq_wavelen = old_context_len / s.high_freq_factor;
      const at::Tensor wavelen = at::reciprocal(inv_freq) * (2 * std::numbers::pi);
      at::Tensor scaled = at::where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq);
      const at::Tensor smooth =
          (at::reciprocal(wavelen) * old_context_len - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
      const at::Tensor smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled;
      const at::Tensor is_medium =
          at::logical_not(wavelen < high_freq_wavelen) * at::logical_not(wavelen > low_freq_wavelen);
      inv_freq = at::where(is_medium, smoothed, scaled);
      break;
    }
  }
  return inv_freq;
}

double rope_attention_factor(const ModelConfig& config) {
  const RopeScaling& s = config.rope_scaling;
  if (s.type != RopeScalingType::kLongRope) return 1.0;
  if (s.attention_factor > 0) return s.attention_factor;
  const auto original = static_cast<double>(s.original_max_position_embeddings);
  const double factor = s.factor > 0 ? s.factor : static_cast<double>(config.max_position_embeddings) / original;
  return factor <= 1.0 ? 1.0 : std::sqrt(1 + std::log(factor) / std::log(original));
}

RopeTables make_rope_tables(const ModelConfig& config, int64_t seq_len, torch::Device device) {
  const at::Tensor positions = at::arange(seq_len, at::TensorOptions().dtype(at::kFloat).device(device));
  auto tables = [&](const ModelConfig& c) {
    const at::Tensor freqs = at::outer(positions, rope_inv_freq(c, seq_len).to(device));
    const at::Tensor emb = at::cat({freqs, freqs}, -1);
    if (const double factor = rope_attention_factor(c); factor != 1.0)
      return std::pair{emb.cos() * factor, emb.sin() * factor};
    return std::pair{emb.cos(), emb.sin()};
  };
  RopeTables out;
  std::tie(out.cos, out.sin) = tables(config);
  if (config.local_rope_theta > 0) {  // Gemma 3's sliding layers: their own theta, no scaling
    ModelConfig local = config;
    local.rope_theta = config.local_rope_theta;
    local.rope_scaling = RopeScaling{};
    std::tie(out.local_cos, out.local_sin) = tables(local);
  }
  return out;
}

torch::Tensor causal_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, bool use_sdpa,
                               double scale, int64_t window) {
  const int64_t T = q.size(-2), S = k.size(-2);
  // Keys a query may not see: later ones, and with a window those window or more behind it.
  at::Tensor hidden;
  if (window > 0 && window < S) {
    const at::Tensor i = at::arange(T, q.options().dtype(at::kLong)).unsqueeze(1);
    const at::Tensor j = at::arange(S, q.options().dtype(at::kLong)).unsqueeze(0);
    hidden = at::logical_or(j > i, j <= i - window);
  }
  const std::optional<double> sdpa_scale = scale > 0 ? std::optional<double>(scale) : std::nullopt;
  if (use_sdpa) {
    if (!hidden.defined())
      return at::scaled_dot_product_attention(q, k, v, /*attn_mask=*/{}, /*dropout_p=*/0.0, /*is_causal=*/true,
                                              sdpa_scale);
    return at::scaled_dot_product_attention(q, k, v, at::logical_not(hidden), /*dropout_p=*/0.0, /*is_causal=*/false,
                                            sdpa_scale);
  }
  // HF's eager attention: scores in the compute dtype, softmax in fp32, probabilities cast back.
  const double s = scale > 0 ? scale : 1.0 / std::sqrt(static_cast<double>(q.size(-1)));
  const at::Tensor scores = at::matmul(q, k.transpose(-2, -1)) * s;
  if (!hidden.defined()) hidden = at::ones({T, S}, q.options().dtype(at::kBool)).triu(1);
  const at::Tensor probs =
      at::softmax(scores.to(at::kFloat).masked_fill(hidden, -std::numeric_limits<float>::infinity()), -1)
          .to(q.scalar_type());
  return at::matmul(probs, v);
}

torch::Tensor block_forward(const ModelConfig& config, const BlockSpec& block, const std::vector<torch::Tensor>& params,
                            const torch::Tensor& input, const RopeTables& rope) {
  TORCH_CHECK(params.size() == expected_params(config, block.kind), "block ", block.name, " takes ",
              expected_params(config, block.kind), " parameters, got ", params.size());
  switch (block.kind) {
    case BlockKind::kEmbedding: {
      TORCH_CHECK(input.dim() == 2, "embedding input must be token ids [B, T], got ", input.sizes());
      const at::Tensor embedded = at::embedding(params[0], input.to(at::kLong), config.pad_token_id);
      if (!config.scale_embeddings) return embedded;
      // Gemma: √hidden as an fp32 tensor, rounded to the weights' dtype (transformers' embed_scale).
      const double root = std::sqrt(static_cast<double>(config.hidden_size));
      return embedded * at::scalar_tensor(root, at::kFloat).to(params[0].scalar_type());
    }
    case BlockKind::kDecoder: return decoder_forward(config, block.layer, params, input, rope);
    case BlockKind::kHead: {
      TORCH_CHECK(input.dim() == 3, "head input must be [B, T, H], got ", input.sizes());
      at::Tensor logits = dense(rms_norm(input, params[0], config.rms_norm_eps, config.family().norm_scale), params[1]);
      if (config.final_logit_softcap > 0)  // Gemma: in the compute dtype, as transformers caps them
        logits = at::tanh(logits / config.final_logit_softcap) * config.final_logit_softcap;
      return logits.to(at::kFloat);
    }
  }
  TORCH_CHECK(false, "unknown block kind");
}

namespace {

// Sum of the cross-entropy over the unmasked targets, and those targets as int64 [B·T].
std::pair<at::Tensor, at::Tensor> summed_loss(const torch::Tensor& logits, const torch::Tensor& targets) {
  TORCH_CHECK(logits.dim() == 3, "logits must be [B, T, V], got ", logits.sizes());
  TORCH_CHECK(targets.dim() == 2 && targets.size(0) == logits.size(0) && targets.size(1) == logits.size(1),
              "targets must be [B, T] matching logits ", logits.sizes(), ", got ", targets.sizes());
  const at::Tensor flat_logits = logits.reshape({-1, logits.size(-1)}).to(at::kFloat);
  at::Tensor flat_targets = targets.reshape({-1}).to(at::kLong);
  at::Tensor sum =
      at::cross_entropy_loss(flat_logits, flat_targets, /*weight=*/{}, at::Reduction::Sum, /*ignore_index=*/-100);
  return {std::move(sum), std::move(flat_targets)};
}

}  // namespace

torch::Tensor lm_loss(const torch::Tensor& logits, const torch::Tensor& targets) {
  auto [sum, flat_targets] = summed_loss(logits, targets);
  // Sum over unmasked targets / their count (at least 1): an all-masked batch gives 0, not 0/0, and
  // the count stays on the device.
  const at::Tensor count = flat_targets.ne(-100).sum().to(at::kFloat).clamp_min(1.0);
  return sum / count;
}

torch::Tensor lm_loss_sum(const torch::Tensor& logits, const torch::Tensor& targets) {
  return summed_loss(logits, targets).first;
}

double measure_matmul_flops(DType dtype, bool cuda) {
  const int64_t n = cuda ? 8192 : 1024;
  const auto options = at::TensorOptions().dtype(to_torch_dtype(dtype)).device(cuda ? at::kCUDA : at::kCPU);
  const at::Tensor a = at::randn({n, n}, options.dtype(at::kFloat)).to(options);
  const at::Tensor b = at::randn({n, n}, options.dtype(at::kFloat)).to(options);
  auto sync = [&] {
    if (cuda) at::detail::getCUDAHooks().deviceSynchronize(0);
  };
  at::Tensor c = at::matmul(a, b);  // warm-up
  sync();
  double best = 0;
  for (int i = 0; i < 3; ++i) {
    const Stopwatch watch;
    const int reps = cuda ? 10 : 1;
    for (int r = 0; r < reps; ++r) c = at::matmul(a, b);
    sync();
    const double s = watch.elapsed_s();
    best = std::max(best, 2.0 * static_cast<double>(n) * n * n * reps / s);
  }
  return best;
}

Status torch_call(std::string_view what, const std::function<void()>& fn) {
  try {
    fn();
  } catch (const c10::Error& e) {
    return internal_error(std::string(what) + ": " + e.what_without_backtrace());
  } catch (const std::exception& e) { return internal_error(std::string(what) + ": " + e.what()); } catch (...) {
    return internal_error(std::string(what) + ": unknown exception");
  }
  return Status::ok();
}

}  // namespace zo::engine

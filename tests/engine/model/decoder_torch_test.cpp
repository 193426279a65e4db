// The functional decoder blocks against independent references written here with plain torch ops in
// fp64 (RoPE in complex form, GQA by repeat_interleave, the whole model in one function; every
// family's choices in a second one): logits and gradients, rope scaling vs the transformers
// formulas, lm_loss, causality, zero-copy params, bf16.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
// LibTorch's headers are not clean under -Wextra; silence them here, not project-wide.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-parameter"
#include <ATen/TensorIndexing.h>
#include <torch/nn/functional/loss.h>
#include <torch/types.h>
#pragma GCC diagnostic pop

#include <cmath>
#include <map>
#include <string>
#include <numbers>
#include <stdexcept>
#include <vector>

#include "engine/model/decoder.h"

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-parameter"
#include <torch/version.h>
#pragma GCC diagnostic pop

namespace zo::engine {
namespace {

using ::testing::HasSubstr;
using torch::indexing::Slice;

// --- the reference --------------------------------------------------------------------------------

// inv_freq from the formulas of transformers' rope init functions, in double, one element at a time.
std::vector<double> reference_inv_freq(const ModelConfig& c) {
  const auto dim = static_cast<double>(c.head_dim);
  std::vector<double> out;
  for (uint64_t i = 0; i < c.head_dim / 2; ++i) {
    double f = 1.0 / std::pow(c.rope_theta, 2.0 * static_cast<double>(i) / dim);
    const RopeScaling& s = c.rope_scaling;
    if (s.type == RopeScalingType::kLinear) f /= s.factor;
    if (s.type == RopeScalingType::kLlama3) {
      const double old_len = static_cast<double>(s.original_max_position_embeddings);
      const double wavelen = 2 * std::numbers::pi / f;
      if (wavelen > old_len / s.low_freq_factor) {
        f /= s.factor;                                       // low frequency: scaled
      } else if (wavelen >= old_len / s.high_freq_factor) {  // medium: interpolated
        const double smooth = (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
        f = (1 - smooth) * f / s.factor + smooth * f;
      }
    }
    out.push_back(f);
  }
  return out;
}

// The whole model in fp64: `params` in ModelLayout::params order (any dtype; cast here).
torch::Tensor reference_logits(const ModelConfig& c, const std::vector<torch::Tensor>& params,
                               const torch::Tensor& ids) {
  const auto opt = torch::TensorOptions().dtype(torch::kFloat64);
  std::vector<torch::Tensor> P;
  for (const torch::Tensor& p : params) P.push_back(p.to(torch::kFloat64));
  const int64_t B = ids.size(0), T = ids.size(1), H = static_cast<int64_t>(c.hidden_size);
  const int64_t nh = static_cast<int64_t>(c.num_attention_heads), nkv = static_cast<int64_t>(c.num_key_value_heads);
  const int64_t hd = static_cast<int64_t>(c.head_dim);
  auto rms = [&](const torch::Tensor& x, const torch::Tensor& w) {
    return x / torch::sqrt(x.pow(2).mean({-1}, true) + c.rms_norm_eps) * w;
  };
  const std::vector<double> inv = reference_inv_freq(c);
  const torch::Tensor angles = torch::outer(torch::arange(T, opt), torch::tensor(inv, opt));  // [T, hd/2]
  const torch::Tensor rot = torch::polar(torch::ones_like(angles), angles).view({1, T, 1, hd / 2});
  auto rope = [&](const torch::Tensor& x) {  // [B, T, heads, hd]; HF pairs element i with i + hd/2
    const torch::Tensor z = torch::complex(x.index({"...", Slice(0, hd / 2)}), x.index({"...", Slice(hd / 2)})) * rot;
    return torch::cat({torch::real(z), torch::imag(z)}, -1);
  };
  size_t i = 0;
  torch::Tensor x = P[i++].index_select(0, ids.flatten()).view({B, T, H});
  const torch::Tensor future = torch::ones({T, T}, torch::kBool).triu(1);
  for (uint64_t l = 0; l < c.num_hidden_layers; ++l) {
    const torch::Tensor w_in = P[i++];
    torch::Tensor q = rms(x, w_in).matmul(P[i++].t());
    if (c.attention_bias) q = q + P[i++];
    torch::Tensor k = rms(x, w_in).matmul(P[i++].t());
    if (c.attention_bias) k = k + P[i++];
    torch::Tensor v = rms(x, w_in).matmul(P[i++].t());
    if (c.attention_bias) v = v + P[i++];
    q = rope(q.view({B, T, nh, hd}));
    k = rope(k.view({B, T, nkv, hd})).repeat_interleave(nh / nkv, 2);
    v = v.view({B, T, nkv, hd}).repeat_interleave(nh / nkv, 2);
    torch::Tensor scores = torch::einsum("bqhd,bkhd->bhqk", {q, k}) / std::sqrt(static_cast<double>(hd));
    scores = scores.masked_fill(future, -INFINITY);
    const torch::Tensor attn =
        torch::einsum("bhqk,bkhd->bqhd", {torch::softmax(scores, -1), v}).reshape({B, T, nh * hd});
    x = x + attn.matmul(P[i++].t());
    const torch::Tensor n = rms(x, P[i++]);
    const torch::Tensor g = n.matmul(P[i++].t());
    const torch::Tensor u = n.matmul(P[i++].t());
    x = x + (g * torch::sigmoid(g) * u).matmul(P[i++].t());
  }
  x = rms(x, P[i++]);
  return x.matmul((c.tie_word_embeddings ? P[0] : P[i++]).t());
}

// Every family's model in fp64, its params looked up by their Hugging Face names, written from
// transformers' modeling files (LlamaModel, Qwen3Model, Olmo2Model, Gemma3TextModel, Phi3Model) rather
// than from the engine's rows: where the norms sit, how a norm's weight scales, q/k norms, fused
// projections, partial rotary, Gemma's √hidden embedding, query scalar, sliding layers with their
// own RoPE, GELU-tanh and logit soft-capping.
torch::Tensor family_reference_logits(const ModelConfig& c, const ModelLayout& layout,
                                      const std::vector<torch::Tensor>& params, const torch::Tensor& ids) {
  const auto opt = torch::TensorOptions().dtype(torch::kFloat64);
  std::map<std::string, torch::Tensor> P;
  for (size_t i = 0; i < params.size(); ++i) P[layout.params[i].name] = params[i].to(torch::kFloat64);
  const std::string& type = c.model_type;
  const bool gemma = type == "gemma3_text", olmo = type == "olmo2", phi = type == "phi3", qwen3 = type == "qwen3";
  const int64_t B = ids.size(0), T = ids.size(1), H = static_cast<int64_t>(c.hidden_size);
  const int64_t nh = static_cast<int64_t>(c.num_attention_heads), nkv = static_cast<int64_t>(c.num_key_value_heads);
  const int64_t hd = static_cast<int64_t>(c.head_dim),
                rd = phi ? static_cast<int64_t>(hd * c.partial_rotary_factor) : hd;
  auto rms = [&](const torch::Tensor& x, const torch::Tensor& w) {
    const torch::Tensor n = x / torch::sqrt(x.pow(2).mean({-1}, true) + c.rms_norm_eps);
    return gemma ? n * (1 + w) : n * w;
  };
  // Rotary over the first rd dims, element i paired with i + rd/2 (rotate_half), the rest passed.
  auto rope = [&](const torch::Tensor& x, double theta) {  // [B, T, heads, hd]
    std::vector<double> inv;
    for (int64_t i = 0; i < rd / 2; ++i) inv.push_back(1.0 / std::pow(theta, 2.0 * static_cast<double>(i) / rd));
    const torch::Tensor ang = torch::outer(torch::arange(T, opt), torch::tensor(inv, opt)).view({1, T, 1, rd / 2});
    const torch::Tensor a = x.index({"...", Slice(0, rd / 2)}), b = x.index({"...", Slice(rd / 2, rd)});
    return torch::cat({a * ang.cos() - b * ang.sin(), b * ang.cos() + a * ang.sin(), x.index({"...", Slice(rd)})}, -1);
  };
  const torch::Tensor ii = torch::arange(T).view({T, 1}), jj = torch::arange(T).view({1, T});
  torch::Tensor x = P.at("model.embed_tokens.weight").index_select(0, ids.flatten()).view({B, T, H});
  if (gemma) x = x * std::sqrt(static_cast<double>(H));
  for (uint64_t l = 0; l < c.num_hidden_layers; ++l) {
    const std::string pre = "model.layers." + std::to_string(l) + ".";
    auto w = [&](const std::string& name) { return P.at(pre + name + ".weight"); };
    const bool sliding = !c.sliding_layers.empty() && c.sliding_layers[l];
    const torch::Tensor h = olmo ? x : rms(x, w("input_layernorm"));
    torch::Tensor q, k, v;
    if (phi) {
      const torch::Tensor qkv = h.matmul(w("self_attn.qkv_proj").t());
      q = qkv.index({"...", Slice(0, nh * hd)});
      k = qkv.index({"...", Slice(nh * hd, (nh + nkv) * hd)});
      v = qkv.index({"...", Slice((nh + nkv) * hd)});
    } else {
      q = h.matmul(w("self_attn.q_proj").t());
      k = h.matmul(w("self_attn.k_proj").t());
      v = h.matmul(w("self_attn.v_proj").t());
    }
    if (olmo) {  // Olmo2Attention: q_norm and k_norm over the whole projection
      q = rms(q, w("self_attn.q_norm"));
      k = rms(k, w("self_attn.k_norm"));
    }
    q = q.reshape({B, T, nh, hd});
    k = k.reshape({B, T, nkv, hd});
    v = v.reshape({B, T, nkv, hd});
    if (qwen3 || gemma) {  // per head, before the rotation
      q = rms(q, w("self_attn.q_norm"));
      k = rms(k, w("self_attn.k_norm"));
    }
    const double theta = sliding ? c.local_rope_theta : c.rope_theta;
    q = rope(q, theta);
    k = rope(k, theta).repeat_interleave(nh / nkv, 2);
    v = v.repeat_interleave(nh / nkv, 2);
    const double scale = gemma ? 1.0 / std::sqrt(c.query_pre_attn_scalar) : 1.0 / std::sqrt(static_cast<double>(hd));
    torch::Tensor scores = torch::einsum("bqhd,bkhd->bhqk", {q, k}) * scale;
    torch::Tensor hidden = jj > ii;  // transformers' sliding window: key j seen from i when i - j < window
    if (sliding) hidden = hidden | (ii - jj >= static_cast<int64_t>(c.sliding_window));
    scores = scores.masked_fill(hidden, -INFINITY);
    torch::Tensor attn = torch::einsum("bhqk,bkhd->bqhd", {torch::softmax(scores, -1), v}).reshape({B, T, nh * hd});
    attn = attn.matmul(w("self_attn.o_proj").t());
    if (olmo || gemma) attn = rms(attn, w("post_attention_layernorm"));
    x = x + attn;
    const torch::Tensor m = olmo ? x : rms(x, gemma ? w("pre_feedforward_layernorm") : w("post_attention_layernorm"));
    torch::Tensor gate, up;
    if (phi) {
      const std::vector<torch::Tensor> gu = m.matmul(w("mlp.gate_up_proj").t()).chunk(2, -1);
      gate = gu[0];
      up = gu[1];
    } else {
      gate = m.matmul(w("mlp.gate_proj").t());
      up = m.matmul(w("mlp.up_proj").t());
    }
    const torch::Tensor act =
        gemma ? 0.5 * gate * (1 + torch::tanh(std::sqrt(2.0 / std::numbers::pi) * (gate + 0.044715 * gate.pow(3))))
              : gate * torch::sigmoid(gate);
    torch::Tensor out = (act * up).matmul(w("mlp.down_proj").t());
    if (olmo || gemma) out = rms(out, w("post_feedforward_layernorm"));
    x = x + out;
  }
  x = rms(x, P.at("model.norm.weight"));
  torch::Tensor logits =
      x.matmul((c.tie_word_embeddings ? P.at("model.embed_tokens.weight") : P.at("lm_head.weight")).t());
  if (c.final_logit_softcap > 0) logits = torch::tanh(logits / c.final_logit_softcap) * c.final_logit_softcap;
  return logits;
}

// --- helpers -------------------------------------------------------------------------------------

ModelConfig test_config(bool qwen_like) {
  ModelConfig c = *model_preset("tiny");
  c.num_hidden_layers = 2;
  if (qwen_like) {  // biases, tied head, llama3 rope scaling with all three frequency bands in use
    c.model_type = "qwen2";
    c.attention_bias = true;
    c.tie_word_embeddings = true;
    c.num_key_value_heads = 2;
    c.rope_theta = 500000.0;
    c.rope_scaling = {.type = RopeScalingType::kLlama3,
                      .factor = 8.0,
                      .low_freq_factor = 1.0,
                      .high_freq_factor = 4.0,
                      .original_max_position_embeddings = 64};
  }
  return c;
}

// Random params in layout order; large enough that attention is far from uniform.
std::vector<torch::Tensor> random_params(const ModelLayout& layout, uint64_t seed) {
  torch::manual_seed(seed);
  std::vector<torch::Tensor> out;
  for (const ParamSpec& p : layout.params) {
    torch::Tensor t = torch::randn(p.shape, torch::kFloat32);
    if (p.name.ends_with("norm.weight")) t = 1 + 0.1 * t;
    else if (p.name.ends_with(".bias")) t = 0.1 * t;
    else if (p.name != "model.embed_tokens.weight") t = t / std::sqrt(static_cast<double>(p.shape.back()));
    out.push_back(t.contiguous());
  }
  return out;
}

std::vector<torch::Tensor> block_params(const BlockSpec& b, const std::vector<torch::Tensor>& all) {
  std::vector<torch::Tensor> out;
  for (uint32_t i : b.params) out.push_back(all[i]);
  return out;
}

torch::Tensor model_logits(const ModelConfig& c, const std::vector<torch::Tensor>& params, const torch::Tensor& ids) {
  const ModelLayout layout = model_layout(c);
  const RopeTables rope = make_rope_tables(c, ids.size(1), torch::kCPU);
  torch::Tensor h = ids;
  for (const BlockSpec& b : layout.blocks) h = block_forward(c, b, block_params(b, params), h, rope);
  return h;
}

double max_rel_error(const torch::Tensor& ours, const torch::Tensor& ref) {
  const torch::Tensor r = ref.to(torch::kFloat64);
  return ((ours.to(torch::kFloat64) - r).abs().max() / r.abs().max()).item<double>();
}

torch::Tensor random_ids(int64_t B, int64_t T, int64_t vocab, uint64_t seed) {
  torch::manual_seed(seed);
  return torch::randint(vocab, {B, T}, torch::kInt64);
}

// --- tests ---------------------------------------------------------------------------------------

class LlamaForward : public ::testing::TestWithParam<bool> {};

TEST_P(LlamaForward, LogitsMatchIndependentReferenceInFp32) {
  const ModelConfig c = test_config(GetParam());
  const std::vector<torch::Tensor> params = random_params(model_layout(c), 1);
  const torch::Tensor ids = random_ids(2, 96, static_cast<int64_t>(c.vocab_size), 2);
  torch::Tensor ours;
  ASSERT_TRUE(torch_call("forward", [&] { ours = model_logits(c, params, ids); }).is_ok());
  EXPECT_EQ(ours.scalar_type(), torch::kFloat32);
  EXPECT_EQ(ours.sizes(), (std::vector<int64_t>{2, 96, static_cast<int64_t>(c.vocab_size)}));
  const torch::Tensor ref = reference_logits(c, params, ids);
  EXPECT_LT(max_rel_error(ours, ref), 2e-5);
  EXPECT_GT(ref.std().item<double>(), 0.5) << "logits must not be trivially small";
}

TEST_P(LlamaForward, GradientsMatchReference) {
  const ModelConfig c = test_config(GetParam());
  std::vector<torch::Tensor> params = random_params(model_layout(c), 3);
  for (torch::Tensor& p : params) p.set_requires_grad(true);
  const torch::Tensor ids = random_ids(2, 24, static_cast<int64_t>(c.vocab_size), 4);
  const torch::Tensor targets = random_ids(2, 24, static_cast<int64_t>(c.vocab_size), 5);
  ASSERT_TRUE(torch_call("backward", [&] { lm_loss(model_logits(c, params, ids), targets).backward(); }).is_ok());
  std::vector<torch::Tensor> ours;
  for (torch::Tensor& p : params) {
    ours.push_back(p.grad().clone());
    p.mutable_grad().zero_();
  }
  const torch::Tensor ref_logits = reference_logits(c, params, ids);
  torch::nn::functional::cross_entropy(ref_logits.reshape({-1, ref_logits.size(-1)}), targets.flatten()).backward();
  const ModelLayout layout = model_layout(c);
  for (size_t i = 0; i < params.size(); ++i)
    EXPECT_LT(max_rel_error(ours[i], params[i].grad()), 1e-4) << layout.params[i].name;
}

INSTANTIATE_TEST_SUITE_P(Variants, LlamaForward, ::testing::Values(false, true),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? "BiasesTiedLlama3Rope" : "TinyPresetGqa";
                         });

// The families beside llama and qwen2, each with the choices that set it apart in use.
ModelConfig family_config(const std::string& type) {
  ModelConfig c = *model_preset("tiny");
  c.num_hidden_layers = 2;
  c.model_type = type;
  if (type == "gemma3_text") {
    c.tie_word_embeddings = true;
    c.scale_embeddings = true;
    c.activation = MlpActivation::kGeluTanh;
    c.query_pre_attn_scalar = 24;  // not head_dim: the scale is the scalar's
    c.final_logit_softcap = 3;     // small enough to bend the logits
    c.rope_theta = 1e6;
    c.local_rope_theta = 1e4;
    c.sliding_window = 16;  // shorter than the sequence
    c.sliding_layers = {true, false};
  } else if (type == "phi3") {
    c.partial_rotary_factor = 0.5;
  }
  return c;
}

class FamilyForward : public ::testing::TestWithParam<const char*> {};

TEST_P(FamilyForward, LogitsAndGradientsMatchTheFamilysReference) {
  const ModelConfig c = family_config(GetParam());
  const ModelLayout layout = model_layout(c);
  std::vector<torch::Tensor> params = random_params(layout, 7);
  for (torch::Tensor& p : params) p.set_requires_grad(true);
  const torch::Tensor ids = random_ids(2, 48, static_cast<int64_t>(c.vocab_size), 8);
  const torch::Tensor targets = random_ids(2, 48, static_cast<int64_t>(c.vocab_size), 9);
  torch::Tensor ours;
  ASSERT_TRUE(torch_call("forward", [&] { ours = model_logits(c, params, ids); }).is_ok());
  const torch::Tensor ref = family_reference_logits(c, layout, params, ids);
  EXPECT_LT(max_rel_error(ours, ref), 2e-5);
  EXPECT_GT(ref.std().item<double>(), 0.3) << "logits must not be trivially small";
  ASSERT_TRUE(torch_call("backward", [&] { lm_loss(ours, targets).backward(); }).is_ok());
  std::vector<torch::Tensor> grads;
  for (torch::Tensor& p : params) {
    grads.push_back(p.grad().clone());
    p.mutable_grad().zero_();
  }
  torch::nn::functional::cross_entropy(ref.reshape({-1, ref.size(-1)}), targets.flatten()).backward();
  for (size_t i = 0; i < params.size(); ++i)
    EXPECT_LT(max_rel_error(grads[i], params[i].grad()), 1e-4) << layout.params[i].name;
}

INSTANTIATE_TEST_SUITE_P(Families, FamilyForward, ::testing::Values("llama", "qwen3", "olmo2", "gemma3_text", "phi3"),
                         [](const ::testing::TestParamInfo<const char*>& info) { return std::string(info.param); });

TEST(LlamaForward, CausalLaterTokensDoNotChangeEarlierLogits) {
  const ModelConfig c = test_config(false);
  const std::vector<torch::Tensor> params = random_params(model_layout(c), 6);
  torch::Tensor ids = random_ids(1, 32, static_cast<int64_t>(c.vocab_size), 7);
  const torch::Tensor before = model_logits(c, params, ids);
  ids.index_put_({0, 20}, (ids.index({0, 20}) + 1) % static_cast<int64_t>(c.vocab_size));
  const torch::Tensor after = model_logits(c, params, ids);
  EXPECT_TRUE(torch::allclose(before.index({Slice(), Slice(0, 20)}), after.index({Slice(), Slice(0, 20)}), 1e-6, 1e-6));
  EXPECT_GT((before.index({Slice(), Slice(20)}) - after.index({Slice(), Slice(20)})).abs().max().item<double>(), 1e-3);
}

TEST(LlamaForward, Bf16RunsAndStaysCloseToFp32) {
  const ModelConfig c = test_config(true);
  const std::vector<torch::Tensor> params = random_params(model_layout(c), 8);
  std::vector<torch::Tensor> bf16;
  for (const torch::Tensor& p : params) bf16.push_back(p.to(torch::kBFloat16));
  const torch::Tensor ids = random_ids(2, 32, static_cast<int64_t>(c.vocab_size), 9);
  torch::Tensor ours;
  const Status s = torch_call("bf16 forward", [&] { ours = model_logits(c, bf16, ids); });
  ASSERT_TRUE(s.is_ok()) << s.to_string();
  EXPECT_EQ(ours.scalar_type(), torch::kFloat32);
  const torch::Tensor ref = model_logits(c, params, ids);
  const double err = max_rel_error(ours, ref);
  EXPECT_LT(err, 0.05);
  EXPECT_GT(err, 0.0) << "bf16 must actually have run in bf16";
}

TEST(LlamaForward, Int32TokenIdsEmbedLikeInt64) {
  const ModelConfig c = test_config(false);
  const std::vector<torch::Tensor> params = random_params(model_layout(c), 10);
  const torch::Tensor ids = random_ids(2, 8, static_cast<int64_t>(c.vocab_size), 11);
  const ModelLayout layout = model_layout(c);
  const BlockSpec& emb = layout.blocks[0];
  const RopeTables rope = make_rope_tables(c, 8, torch::kCPU);
  EXPECT_TRUE(torch::equal(block_forward(c, emb, block_params(emb, params), ids.to(torch::kInt32), rope),
                           block_forward(c, emb, block_params(emb, params), ids, rope)));
}

// transformers' nn.Embedding(padding_idx=pad_token_id): looking the pad token up adds nothing to its
// row's gradient; the other rows get theirs.
TEST(LlamaForward, PadTokensRowGetsNoGradientFromTheLookup) {
  ModelConfig c = test_config(false);
  c.pad_token_id = 3;
  const ModelLayout layout = model_layout(c);
  const BlockSpec& emb = layout.blocks[0];
  std::vector<torch::Tensor> params = block_params(emb, random_params(layout, 12));
  params[0].set_requires_grad(true);
  const torch::Tensor ids = torch::tensor({{3, 5, 3, 7}}, torch::kInt64);
  const RopeTables rope = make_rope_tables(c, 4, torch::kCPU);
  block_forward(c, emb, params, ids, rope).sum().backward();
  const torch::Tensor g = params[0].grad();
  EXPECT_TRUE(torch::equal(g[3], torch::zeros_like(g[3])));
  EXPECT_TRUE(torch::equal(g[5], torch::ones_like(g[5])));
  EXPECT_TRUE(torch::equal(g[7], torch::ones_like(g[7])));
}

TEST(LlamaForward, BadInputsBecomeStatusesAtTheBoundary) {
  ModelConfig c = test_config(false);
  const ModelLayout layout = model_layout(c);
  const std::vector<torch::Tensor> params = random_params(layout, 12);
  const RopeTables rope = make_rope_tables(c, 8, torch::kCPU);
  const torch::Tensor x = torch::randn({1, 8, static_cast<int64_t>(c.hidden_size)});
  Status s = torch_call(
      "layer 0", [&] { block_forward(c, layout.blocks[1], block_params(layout.blocks[2], params), x, rope).sum(); });
  ASSERT_TRUE(s.is_ok()) << "a decoder takes any decoder's params: " << s.to_string();
  s = torch_call("layer 0", [&] { block_forward(c, layout.blocks[1], {params[0]}, x, rope); });
  EXPECT_EQ(s.code(), StatusCode::kInternal);
  EXPECT_THAT(s.message(), HasSubstr("layer 0: block model.layers.0 takes 9 parameters, got 1"));
  s = torch_call("long", [&] {
    block_forward(c, layout.blocks[1], block_params(layout.blocks[1], params),
                  torch::randn({1, 9, static_cast<int64_t>(c.hidden_size)}), rope);
  });
  EXPECT_THAT(s.message(), HasSubstr("RoPE tables"));
  c.sliding_window = 4;
  s = torch_call("mistral",
                 [&] { block_forward(c, layout.blocks[1], block_params(layout.blocks[1], params), x, rope); });
  EXPECT_THAT(s.message(), HasSubstr("sliding"));
  s = torch_call("std", [] { throw std::runtime_error("boom"); });
  EXPECT_EQ(s.code(), StatusCode::kInternal);
  EXPECT_EQ(s.message(), "std: boom");
  EXPECT_TRUE(torch_call("fine", [] {}).is_ok());
}

TEST(Rope, InvFreqMatchesTransformersFormulas) {
  ModelConfig c = *model_preset("llama3-8b");  // llama3 scaling: factor 8, bands at 2048 / 8192
  const torch::Tensor ours = rope_inv_freq(c);
  const std::vector<double> ref = reference_inv_freq(c);
  ASSERT_EQ(ours.numel(), 64);
  int low = 0, medium = 0, high = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    EXPECT_NEAR(ours[static_cast<int64_t>(i)].item<double>(), ref[i], 2e-6 * ref[i]) << i;
    const double unscaled = std::pow(500000.0, -2.0 * static_cast<double>(i) / 128.0);
    const double wavelen = 2 * std::numbers::pi / unscaled;
    (wavelen < 2048 ? high : wavelen > 8192 ? low : medium)++;
  }
  EXPECT_GT(low, 0);
  EXPECT_GT(medium, 0);
  EXPECT_GT(high, 0);
  EXPECT_EQ(ours[0].item<float>(), 1.0f);  // the highest frequency is never scaled
  EXPECT_NEAR(ours[63].item<double>(), std::pow(500000.0, -126.0 / 128.0) / 8, 1e-6 * ours[63].item<double>());

  c.rope_scaling = {.type = RopeScalingType::kLinear, .factor = 4.0};
  c.rope_theta = 10000.0;
  const torch::Tensor linear = rope_inv_freq(c);
  for (int64_t i = 0; i < 64; ++i)
    EXPECT_NEAR(linear[i].item<double>(), std::pow(10000.0, -2.0 * static_cast<double>(i) / 128.0) / 4.0, 1e-6) << i;
}

// Phi's longrope over a partial rotary width: inv_freq[i] = 1 / (factor[i] · theta^(2i / rotary_dim)),
// the long factors for rows longer than original_max_position_embeddings, the short ones otherwise;
// cos and sin scaled by transformers' attention factor (1.1902380714238083 for Phi-4-mini's 131072 /
// 4096, as transformers 5.17 computes it).
TEST(Rope, LongRopeSwitchesFactorsByRowLengthOverThePartialWidth) {
  ModelConfig c = test_config(false);
  c.model_type = "phi3";
  c.head_dim = 16;
  c.partial_rotary_factor = 0.75;  // 12 dims turn
  c.max_position_embeddings = 131072;
  c.rope_scaling.type = RopeScalingType::kLongRope;
  c.rope_scaling.factor = 0;
  c.rope_scaling.original_max_position_embeddings = 4096;
  c.rope_scaling.short_factor = {1.0, 1.5, 2.0, 2.5, 3.0, 3.5};
  c.rope_scaling.long_factor = {4.0, 8.0, 16.0, 32.0, 64.0, 128.0};
  const torch::Tensor short_rows = rope_inv_freq(c, 4096), long_rows = rope_inv_freq(c, 4097);
  ASSERT_EQ(short_rows.numel(), 6);
  for (int64_t i = 0; i < 6; ++i) {
    const double base = std::pow(10000.0, -2.0 * static_cast<double>(i) / 12.0);
    EXPECT_NEAR(short_rows[i].item<double>(), base / c.rope_scaling.short_factor[static_cast<size_t>(i)], 1e-6 * base);
    EXPECT_NEAR(long_rows[i].item<double>(), base / c.rope_scaling.long_factor[static_cast<size_t>(i)], 1e-6 * base);
  }
  EXPECT_DOUBLE_EQ(rope_attention_factor(c), 1.1902380714238083);
  const RopeTables t = make_rope_tables(c, 8, torch::kCPU);
  ASSERT_EQ(t.cos.size(1), 12);
  EXPECT_NEAR(t.cos[0][0].item<double>(), 1.1902380714238083, 1e-6);  // cos 0, scaled
  c.rope_scaling.attention_factor = 1.5;                              // given: used as is
  EXPECT_EQ(rope_attention_factor(c), 1.5);
}

TEST(Rope, TablesAreCosSinOfPositionTimesFrequencyTwice) {
  const ModelConfig c = *model_preset("tiny");
  const RopeTables t = make_rope_tables(c, 50, torch::kCPU);
  ASSERT_EQ(t.cos.sizes(), (std::vector<int64_t>{50, 32}));
  EXPECT_EQ(t.cos.scalar_type(), torch::kFloat32);
  const std::vector<double> inv = reference_inv_freq(c);
  for (int64_t pos : {0, 1, 17, 49})
    for (int64_t i = 0; i < 32; ++i) {
      const double a = static_cast<double>(pos) * inv[static_cast<size_t>(i % 16)];
      EXPECT_NEAR(t.cos[pos][i].item<double>(), std::cos(a), 2e-6);
      EXPECT_NEAR(t.sin[pos][i].item<double>(), std::sin(a), 2e-6);
    }
}

TEST(CausalAttention, SdpaMatchesExplicitMaskedSoftmax) {
  torch::manual_seed(13);
  const torch::Tensor q = torch::randn({2, 4, 33, 16}), k = torch::randn({2, 4, 33, 16}),
                      v = torch::randn({2, 4, 33, 16});
  EXPECT_LT(max_rel_error(causal_attention(q, k, v, true), causal_attention(q, k, v, false)), 1e-5);
}

// Gemma's scale and sliding window: SDPA with the boolean mask against the explicit softmax, and the
// window against its definition (query i sees keys i - window < j ≤ i): changing a key the window
// hides leaves the output alone, changing one it shows does not.
TEST(CausalAttention, SlidingWindowAndScaleMatchTheExplicitSoftmax) {
  torch::manual_seed(15);
  const torch::Tensor q = torch::randn({2, 4, 33, 16}), k = torch::randn({2, 4, 33, 16}),
                      v = torch::randn({2, 4, 33, 16});
  const double scale = 1.0 / std::sqrt(24.0);
  const torch::Tensor out = causal_attention(q, k, v, true, scale, 5);
  EXPECT_LT(max_rel_error(out, causal_attention(q, k, v, false, scale, 5)), 1e-5);
  EXPECT_GT(max_rel_error(out, causal_attention(q, k, v, true, scale)), 1e-2) << "the window must hide keys";
  EXPECT_GT(max_rel_error(out, causal_attention(q, k, v, true, 0, 5)), 1e-3) << "the scale must matter";
  EXPECT_TRUE(torch::equal(causal_attention(q, k, v, true, scale, 40), causal_attention(q, k, v, true, scale)))
      << "a window as long as the row hides nothing";
  torch::Tensor v2 = v.clone();
  v2.index_put_({torch::indexing::Slice(), torch::indexing::Slice(), 20}, 7.0);  // key 20
  const torch::Tensor moved = causal_attention(q, k, v2, true, scale, 5);
  using torch::indexing::Slice;
  EXPECT_TRUE(torch::equal(moved.index({Slice(), Slice(), Slice(0, 20)}), out.index({Slice(), Slice(), Slice(0, 20)})));
  EXPECT_TRUE(
      torch::equal(moved.index({Slice(), Slice(), Slice(25, 33)}), out.index({Slice(), Slice(), Slice(25, 33)})))
      << "queries 25.. are 5 or more past key 20";
  EXPECT_FALSE(torch::equal(moved.index({Slice(), Slice(), 24}), out.index({Slice(), Slice(), 24})));
}

TEST(LmLoss, MeanOverUnmaskedTargetsMatchesManual) {
  torch::manual_seed(14);
  const torch::Tensor logits = torch::randn({2, 5, 11}, torch::requires_grad());
  torch::Tensor targets = torch::randint(11, {2, 5}, torch::kInt64);
  targets.index_put_({0, 1}, -100);
  targets.index_put_({1, 4}, -100);
  targets.index_put_({1, 0}, -100);
  double manual = 0;
  int count = 0;
  const torch::Tensor logp = torch::log_softmax(logits.to(torch::kFloat64), -1);
  for (int64_t b = 0; b < 2; ++b)
    for (int64_t t = 0; t < 5; ++t) {
      const int64_t y = targets[b][t].item<int64_t>();
      if (y == -100) continue;
      manual -= logp[b][t][y].item<double>();
      ++count;
    }
  manual /= count;
  for (torch::ScalarType type : {torch::kInt64, torch::kInt32}) {
    const torch::Tensor loss = lm_loss(logits, targets.to(type));
    EXPECT_EQ(loss.scalar_type(), torch::kFloat32);
    EXPECT_NEAR(loss.item<double>(), manual, 1e-6);
  }
  // bf16 logits are scored in fp32.
  EXPECT_NEAR(lm_loss(logits.to(torch::kBFloat16), targets).item<double>(),
              lm_loss(logits.to(torch::kBFloat16).to(torch::kFloat32), targets).item<double>(), 1e-6);
}

TEST(LmLoss, AllMaskedIsZeroWithAGradient) {
  const torch::Tensor logits = torch::randn({1, 3, 7}, torch::requires_grad());
  const torch::Tensor loss = lm_loss(logits, torch::full({1, 3}, -100, torch::kInt64));
  EXPECT_EQ(loss.item<float>(), 0.0f);
  ASSERT_TRUE(loss.requires_grad());
  loss.backward();
  EXPECT_EQ(logits.grad().abs().sum().item<float>(), 0.0f);
}

TEST(ParamTensor, AliasesEngineMemoryWithoutCopy) {
  const ParamSpec spec{"model.layers.0.mlp.up_proj.weight", {3, 4}};
  std::vector<float> f32(12, 0.0f);
  torch::Tensor t = param_tensor(f32.data(), spec, DType::kF32, torch::kCPU);
  EXPECT_EQ(t.data_ptr(), f32.data());
  EXPECT_EQ(t.sizes(), (std::vector<int64_t>{3, 4}));
  f32[5] = 7.5f;
  EXPECT_EQ(t[1][1].item<float>(), 7.5f);
  t.index_put_({2, 3}, -1.0f);
  EXPECT_EQ(f32[11], -1.0f);

  std::vector<uint16_t> half(12, 0);
  for (DType d : {DType::kBF16, DType::kF16}) {
    const torch::Tensor h = param_tensor(half.data(), spec, d, torch::kCPU);
    EXPECT_EQ(h.data_ptr(), half.data());
    EXPECT_EQ(h.scalar_type(), to_torch_dtype(d));
    h.fill_(1.0f);
    EXPECT_EQ(half[0], d == DType::kBF16 ? 0x3F80 : 0x3C00);
  }
  EXPECT_EQ(to_torch_dtype(DType::kF32), torch::kFloat32);
}

// Note [LoRA adapters]: each adapted projection's A and B follow the family's own params, which keep
// their order; the block computes the base output plus s·B·A·x, which equals the base block with
// the merged weights W + s·B·A (PEFT's merge_and_unload), and with B = 0 the base block bit for bit.
TEST(Lora, AdaptersFollowTheBaseParamsAndComputeTheMergedProjection) {
  for (const bool phi3 : {false, true}) {
    SCOPED_TRACE(phi3 ? "phi3" : "qwen2");
    ModelConfig base = test_config(!phi3);
    if (phi3) {
      base.model_type = "phi3";
      base.attention_bias = false;
    }
    const std::vector<std::string> all = {"all-linear"};
    auto targets = lora_targets(base, all, "zoffload.lora.target_modules");
    ASSERT_TRUE(targets.is_ok()) << targets.status().to_string();
    ModelConfig adapted = base;
    adapted.lora = {.r = 4, .alpha = 16, .rslora = phi3, .targets = *targets};
    const std::vector<DecoderParam> b = decoder_params(base), a = decoder_params(adapted);
    ASSERT_EQ(a.size(), b.size() + 2 * targets->size());
    for (size_t i = 0; i < b.size(); ++i) EXPECT_EQ(a[i].name, b[i].name);
    EXPECT_EQ(a[b.size()].name, phi3 ? "self_attn.qkv_proj.lora_A.weight" : "self_attn.q_proj.lora_A.weight");
    for (size_t i = b.size(); i < a.size(); i += 2) {  // A [r, in], B [out, r] of the weight they adapt
      const auto w = std::find_if(b.begin(), b.end(), [&](const DecoderParam& d) { return d.role == a[i].target; });
      ASSERT_NE(w, b.end()) << a[i].name;
      EXPECT_EQ(a[i].role, DecoderRole::kLoraA);
      EXPECT_EQ(a[i].shape, (std::vector<int64_t>{4, w->shape[1]})) << a[i].name;
      EXPECT_EQ(a[i + 1].shape, (std::vector<int64_t>{w->shape[0], 4})) << a[i + 1].name;
      EXPECT_EQ(a[i].name.substr(0, a[i].name.find(".lora_A")) + ".weight", w->name);
    }
    EXPECT_EQ(a.back().name, "mlp.down_proj.lora_B.weight");
    EXPECT_EQ(a.back().shape, (std::vector<int64_t>{static_cast<int64_t>(base.hidden_size), 4}));
    uint64_t extra = 0;
    for (size_t i = b.size(); i < a.size(); ++i) extra += a[i].shape[0] * a[i].shape[1];
    EXPECT_EQ(num_parameters(adapted), num_parameters(base) + base.num_hidden_layers * extra);

    // One decoder block in fp64, so that the merged weights' rounding does not hide a wrong formula:
    // adapters against the merged weights.
    const ModelLayout layout = model_layout(adapted);
    const BlockSpec& block = layout.blocks[1];
    std::vector<torch::Tensor> params = block_params(block, random_params(layout, 7));
    torch::manual_seed(8);
    for (size_t i = b.size(); i < a.size(); ++i) params[i] = 0.3 * torch::randn(a[i].shape);
    for (torch::Tensor& t : params) t = t.to(torch::kFloat64);
    const RopeTables rope = make_rope_tables(adapted, 16, torch::kCPU);
    torch::manual_seed(9);
    const torch::Tensor x = torch::randn({2, 16, static_cast<int64_t>(base.hidden_size)}, torch::kFloat64);
    const torch::Tensor y = block_forward(adapted, block, params, x, rope);
    std::vector<torch::Tensor> merged(params.begin(), params.begin() + static_cast<int64_t>(b.size()));
    for (size_t i = b.size(); i < a.size(); i += 2) {
      for (size_t j = 0; j < b.size(); ++j) {
        if (b[j].role != a[i].target) continue;
        merged[j] = merged[j] + adapted.lora.scaling() * params[i + 1].matmul(params[i]);
      }
    }
    const ModelLayout base_layout = model_layout(base);
    const torch::Tensor want = block_forward(base, base_layout.blocks[1], merged, x, rope);
    EXPECT_LT(max_rel_error(y, want), 1e-12);
    EXPECT_GT(
        max_rel_error(y, block_forward(base, base_layout.blocks[1],
                                       std::vector<torch::Tensor>(params.begin(), params.begin() + b.size()), x, rope)),
        1e-3)
        << "the adapters change the output";
    // B = 0 (PEFT's initialisation): the base block, bit for bit.
    for (size_t i = b.size() + 1; i < a.size(); i += 2) params[i] = torch::zeros(a[i].shape, torch::kFloat64);
    const torch::Tensor zero_b = block_forward(adapted, block, params, x, rope);
    EXPECT_TRUE(torch::equal(
        zero_b, block_forward(base, base_layout.blocks[1],
                              std::vector<torch::Tensor>(params.begin(), params.begin() + b.size()), x, rope)));
  }
}

TEST(Lora, TargetsAreTheFamilysProjectionsByPeftName) {
  // PEFT's scaling: lora_alpha / r, or lora_alpha / √r with use_rslora.
  EXPECT_EQ((LoraSpec{.r = 4, .alpha = 16}.scaling()), 4.0);
  EXPECT_EQ((LoraSpec{.r = 4, .alpha = 16, .rslora = true}.scaling()), 8.0);
  ModelConfig llama = test_config(false);
  const std::vector<std::string> some = {"v_proj", "q_proj", "down_proj"};
  auto t = lora_targets(llama, some, "k");
  ASSERT_TRUE(t.is_ok());
  EXPECT_EQ(*t, (std::vector<DecoderRole>{DecoderRole::kQ, DecoderRole::kV, DecoderRole::kDown}));
  ModelConfig phi3 = llama;
  phi3.model_type = "phi3";
  const std::vector<std::string> q = {"q_proj"};
  auto refused = lora_targets(phi3, q, "zoffload.lora.target_modules");
  ASSERT_FALSE(refused.is_ok());
  EXPECT_THAT(refused.status().message(),
              HasSubstr("zoffload.lora.target_modules: \"q_proj\" is not a projection of a phi3 layer (qkv_proj, "
                        "o_proj, gate_up_proj, down_proj); phi3 fuses them: adapt qkv_proj"));
  const std::vector<std::string> none;
  EXPECT_FALSE(lora_targets(llama, none, "k").is_ok());
  const std::vector<std::string> typo = {"q_prj"};
  EXPECT_THAT(lora_targets(llama, typo, "k").status().message(), HasSubstr("\"q_prj\" is not a projection"));
}

}  // namespace
}  // namespace zo::engine

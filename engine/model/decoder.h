// The forward pass of the LLaMA-shaped families in LibTorch, functional: each block takes its parameters as tensors
// (memory the engine owns, wrapped without a copy) and owns none. The only LibTorch header of
// engine/model. Functions throw c10::Error on bad input like any LibTorch op: call them inside
// torch_call(), which turns that into a Status. Thread-safe (no shared state).
#pragma once

#include <functional>
#include <string_view>
#include <vector>

// LibTorch's headers are not clean under -Wextra; silence them here, not project-wide.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-parameter"
#include <torch/types.h>
#pragma GCC diagnostic pop

#include "common/dtype.h"
#include "common/param_spec.h"
#include "common/status.h"
#include "engine/model/model_config.h"

namespace zo::engine {

// [seq_len, rotary_dim] fp32 on the device, HF's rotate_half convention: cos/sin of cat(freqs, freqs),
// freqs[t, i] = t · inv_freq[i], times longrope's attention factor.
struct RopeTables {
  torch::Tensor cos, sin;
  torch::Tensor local_cos, local_sin;  // Gemma's sliding layers' (config.local_rope_theta, unscaled)
};

// inv_freq[i] = 1 / rope_theta^(2i / rotary_dim), i < rotary_dim/2, with linear, llama3 or longrope
// scaling applied exactly as Hugging Face transformers computes it (in fp32). longrope divides by its
// long factors for rows longer than original_max_position_embeddings (`seq_len`), as transformers
// switches them by the row's length, else by its short ones. Returned on the CPU, fp32.
torch::Tensor rope_inv_freq(const ModelConfig& config, int64_t seq_len = 0);
// longrope's factor on cos and sin (transformers' attention_factor); 1 for the other types.
double rope_attention_factor(const ModelConfig& config);
RopeTables make_rope_tables(const ModelConfig& config, int64_t seq_len, torch::Device device);

// Wraps memory the engine owns as a tensor of the param's shape, no copy (from_blob; the caller
// keeps `addr` alive and on `device` while the tensor is used).
torch::Tensor param_tensor(void* addr, const ParamSpec& spec, DType dtype, torch::Device device);
torch::ScalarType to_torch_dtype(DType dtype);

// Runs one block. `params` are the block's tensors in BlockSpec::params order, in the compute dtype.
// kEmbedding: int64 (or int32) token ids [B, T] -> [B, T, H], the pad_token_id row getting no gradient
// from the lookup (nn.Embedding's padding_idx), times √hidden in the compute dtype where
// config.scale_embeddings. kDecoder: [B, T, H] -> [B, T, H], the family's block (Note [Model
// families]); llama's is h = x + o_proj(attn(rmsnorm(x))), h + down(silu(gate(n)) * up(n)) with
// n = rmsnorm(h); causal grouped-query attention with RoPE (q/k/v biases when config.attention_bias),
// within the window on config.sliding_layers. kHead: [B, T, H] -> logits [B, T, V] =
// lm_head(rmsnorm(x)) computed (and soft-capped, config.final_logit_softcap) in the compute dtype,
// returned as fp32. RMSNorm as HF's (normalize in fp32, the family's NormScale); attention softmax
// in fp32. `rope` must cover at least T positions. Autograd records it as usual.
torch::Tensor block_forward(const ModelConfig& config, const BlockSpec& block, const std::vector<torch::Tensor>& params,
                            const torch::Tensor& input, const RopeTables& rope);

// Causal attention over q [B, heads, T, D] and k, v [B, heads, T, D] (already expanded to `heads`),
// scores scaled by `scale` (0: 1/sqrt(D)), softmax in fp32. window > 0 and < T: query i sees keys
// i - window < j ≤ i only (transformers' sliding-window mask). use_sdpa: at::scaled_dot_product_attention,
// with is_causal or that boolean mask (what block_forward uses), else an explicit masked softmax as
// HF's eager attention (the reference the tests compare SDPA with). Same math to float tolerance.
torch::Tensor causal_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, bool use_sdpa,
                               double scale = 0, int64_t window = 0);

// Mean cross-entropy in fp32 over the targets != -100 (int64 or int32 [B, T]) of logits [B, T, V];
// 0 (still with a grad) when every target is masked. No host synchronisation.
torch::Tensor lm_loss(const torch::Tensor& logits, const torch::Tensor& targets);
// The same cross-entropy summed over the targets != -100 instead of averaged (0 when all are masked):
// what transformers' causal-LM loss divides by num_items_in_batch.
torch::Tensor lm_loss_sum(const torch::Tensor& logits, const torch::Tensor& targets);

// Runs `fn`, turning any c10::Error / std::exception it throws into kInternal "<what>: <message>"
// (without LibTorch's backtrace) — the LibTorch boundary.
Status torch_call(std::string_view what, const std::function<void()>& fn);

}  // namespace zo::engine

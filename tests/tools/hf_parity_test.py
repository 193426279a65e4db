#!/usr/bin/env python3
"""transformers is the oracle (docs/design.md, "Invariants"): tiny random models built and saved by
Hugging Face transformers train a few AdamW steps with `zoffload train`, and the same steps are
taken by the same saved directory loaded with `AutoModelForCausalLM.from_pretrained` and trained
with torch.optim.AdamW on the same batches.

Per step, metrics.jsonl's `loss`, `grad_norm` and `lr` must equal the reference's. After training,
the end-of-training export (`hf-export-step-N`) must load with `from_pretrained`, hold the
reference's final weights (rounded to the export dtype) and give the reference's logits.

- fp32 cases: the reference is transformers as shipped (SDPA attention) in fp32.
- bf16 cases (bf16.enabled): the reference does mixed precision as the engine does: fp32 master
  weights; a bf16 copy of the model, loaded as transformers loads a bf16 model and overwritten
  before every step with the masters rounded to nearest even; forward and backward in that copy;
  its bf16 gradients added per micro-batch into fp32 sums (`data_types.grad_accum_dtype` fp32); the
  norm and the clipping over those sums; fp32 AdamW on the masters. It runs twice:
  - "mirror": the engine's arithmetic, redone: transformers' model code, with the attention
    computed as the engine computes it (repeat_kv, then SDPA with is_causal; engine/model/decoder.cpp)
    registered through transformers' AttentionInterface, and AdamW and the clipping in the engine's
    documented operation order (EngineAdamW below). Bit-identical to the engine on the CPU, so it
    is compared with (almost) no tolerance: any difference is the engine's, not bf16 noise.
  - "hf": transformers' own SDPA attention (enable_gqa=True instead of repeating k/v) and
    torch.optim.AdamW with clip_grad_norm_. The forward is bit-identical, but the gradients round
    differently in bf16, so the curves agree only to bf16 noise: their loss and grad_norm are
    compared loosely, as an independent check of the mirror (the weights and the export are
    checked against the mirror only).
  (The fp32 cases check transformers' attention and torch's AdamW semantics tightly, so what the
  mirror redoes the engine's way hides nothing.)
- the 8-bit case (zoffload.moment_dtype "8bit"): fp32, and bitsandbytes' AdamW8bit in place of
  torch's AdamW, re-quantizing to the nearest code as zoffload does (bnb_nearest.py). Left out,
  with a line saying so, when bitsandbytes is not installed.
- the bf16-moments case (zoffload.moment_dtype "bf16"): fp32, and torch's AdamW with its exp_avg and
  exp_avg_sq rounded to bf16 after every step.
- the bf16-gradients case (zoffload.gradient_store_dtype "bf16", vertical schedule): fp32, and torch's
  AdamW fed each step's fp32 gradient sums rounded to bf16 after their norm was taken, then clipped.
- the freeze cases (zoffload.freeze): fp32, the frozen params requires_grad_(False) in transformers and
  skipped by torch's AdamW; the export's frozen tensors must be the saved model's, byte for byte.
- the bf16-masters case (zoffload.master_dtype "bf16"): a bf16 case whose masters start as the
  weights rounded to nearest even and, after every optimizer step, are rounded to bf16
  stochastically with the documented random bits (sr_round below: common/half.h's sr_key,
  sr_random16 and float_to_bf16_sr, redone in numpy), in the mirror and in the "hf" run.

The models: llama untied, llama tied (in fp32, and in bf16, where the engine adds the shared
matrix's two gradients into its fp32 sum, which the mirror does too), mistral, qwen2 (q/k/v biases,
rope_theta 1e6 as Qwen2 ships it), qwen3 (q/k norms, an explicit head_dim; none, cpu and nvme) and a
Llama-3 rope as transformers ≥ 5 writes it
(`rope_parameters`, rope_type llama3) whose original context is short enough that the scaling
changes most frequencies within the sequence. One file and sharded, fp32 and bf16 on disk. Each
placement (nothing offloaded: stage 3 in fp32, stage 2 in bf16; CPU; NVMe) runs in fp32 and in
bf16; gradient accumulation 1 and 2, clipping active and not, constant and warm-up learning
rates. The data is an llm.c .bin of random tokens; `zoffload train` always shuffles its windows, so
the reference takes them in the documented order (epoch_permutation below). Every case prints its
per-step figures, zoffload beside each reference, so a failure shows where the two part.

Usage: hf_parity_test.py ZOFFLOAD SOURCE_DIR
  ZO_PARITY_DEVICE=cuda   both sides on the GPU (zoffload.device "cuda"); default cpu: zoffload on
                          the emulated device ("host"), the reference on the CPU
  ZO_PARITY_CASES=a,b     only these cases (gemma3-multimodal: the multimodal Gemma 3 check)
Exit 77 (skip) when this Python lacks transformers, safetensors or numpy."""
import contextlib
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time

from cli_checks import expect, report_and_exit

zoffload, source_dir = sys.argv[1], sys.argv[2]
sys.path.insert(0, os.path.join(source_dir, "tools"))  # data_order: zoffload's token files and window order

try:
    import numpy as np
    from data_order import epoch_permutation, write_llmc
    import safetensors  # save_pretrained and from_pretrained go through it; safe_open lists a file's tensors
    import torch
    import torch.nn.functional as F
    import transformers
    from transformers import (AttentionInterface, AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig, MistralConfig,
                              Olmo2Config, Phi3Config, Qwen2Config, Qwen3Config)
except ImportError as e:
    print("SKIP: the transformers oracle is not installed in %s (%s); tools/requirements.txt pins it" %
          (sys.executable, e))
    sys.exit(77)

try:  # the oracle of the 8-bit moments case (its AdamW8bit runs on the CPU)
    import bitsandbytes as bnb
    import bnb_nearest
except ImportError:
    bnb = None

DEVICE = os.environ.get("ZO_PARITY_DEVICE", "cpu")
if DEVICE not in ("cpu", "cuda"):
    print("FAIL: ZO_PARITY_DEVICE must be cpu or cuda, got %r" % DEVICE)
    sys.exit(1)
if DEVICE == "cuda" and not torch.cuda.is_available():
    print("FAIL: ZO_PARITY_DEVICE=cuda, but torch %s sees no GPU" % torch.__version__)
    sys.exit(1)
ZO_DEVICE = {"cpu": "host", "cuda": "cuda"}[DEVICE]
if DEVICE == "cuda":
    # Plain fp32 matmuls, as LibTorch's default in zoffload: TF32 would be another reference.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False

# Two cores in CI: zoffload (one compute thread, one optimizer thread) runs while the reference (one
# thread) computes the same case. More threads on either side only oversubscribe the machine.
torch.set_num_threads(1)
ZO_ENV = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")

STEPS = 4
MICRO_BATCH = 2
HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS = 64, 160, 2, 4, 2
BETAS, EPS, WEIGHT_DECAY = (0.9, 0.95), 1e-8, 0.1
# std of the random init: large enough that attention is far from uniform (q·k/√d has std ≈ 1), so
# positions, and therefore RoPE, matter to the loss; with transformers' 0.02 they would barely.
INIT_STD = 0.12

# Tolerances. Per step: |zoffload − reference| / |reference| of loss and grad_norm. Export:
# ‖export − R(ref)‖ / ‖ref‖ per tensor (R = rounding to the export dtype) and max |Δlogit| / max
# |logit|. Measured on the CI machine (2-core EPYC, CPU; torch 2.11, transformers 5.17), over these
# cases and 15 variants of them with other seeds (model init and data):
TOLERANCES = {
    # fp32 vs transformers as shipped and torch.optim.AdamW: the same arithmetic with reductions in
    # another order (the engine's block-wise recompute, repeat_kv vs enable_gqa, an fp64 norm vs
    # torch's fp32 one, another Adam expression order). Measured ≤ 1.5e-7 in loss, ≤ 2.7e-7 in
    # grad_norm, ≤ 1.3e-6 in weights (Adam turns the rounding noise of a gradient element that nearly
    # cancels into an update difference of up to 2.4e-5 on that one element) but for
    # phi3-longrope-long, whose embedding has one such element moved 2.3e-4 apart (1.4e-5 over the
    # tensor; its other elements ≤ 1.2e-5), ≤ 1.2e-6 in logits.
    # Bounds ≈ 15–40× that, for other kernels (GPU); a real error is far beyond them: eps 1e-6 in
    # place of 1e-8 moves grad_norm by 7e-5 by step 2, beta2 0.96 for 0.95 the weights by 8e-5, a
    # missing weight decay the weights by 1e-3, an Adam step more or less by ~1e-2.
    "fp32": {"loss": 1e-5, "grad_norm": 1e-5, "weights": 2e-5, "logits": 1e-5},
    # bf16, mirror: the engine's arithmetic, redone. Measured bit-identical in loss, weights and
    # logits, grad_norm ≤ 7e-16 (the fp64 sum of squares in another order). The bounds leave room
    # for nothing but such order effects: one fp32 ulp of difference in one master can round a
    # compute copy to the neighbouring bf16 and shows as ~1e-5 or more within a step or two.
    "bf16-mirror": {"loss": 1e-6, "grad_norm": 1e-6, "weights": 1e-6, "logits": 1e-6},
    # bf16 vs transformers' own SDPA and torch.optim.AdamW: SDPA's backward with enable_gqa rounds
    # differently in bf16 from the repeat_kv one from step 1 on (grad_norm 7e-5 … 3.3e-4 apart
    # there), and Adam carries it on. Measured ≤ 6e-4 in loss, ≤ 2.4e-3 in grad_norm; bounds ≈ 3.3×
    # and 4×. Only the curves are compared with it: Adam's m/√v turns those gradient differences
    # into full-size update differences on small elements, so the weights are checked against the
    # mirror alone.
    "bf16-hf": {"loss": 2e-3, "grad_norm": 1e-2},
    # 8-bit moments vs transformers + bitsandbytes' AdamW8bit (re-quantizing to the nearest code,
    # bnb_nearest.py) with clip_grad_norm_: its state bytes equal zoffload's kernel's (tests/cpu_optim),
    # but here the gradients differ in the last bits as in the fp32 case, bitsandbytes' sqrt is not
    # correctly rounded, and it steps params under 4096 elements with its own 32-bit Adam expression;
    # a moment that lands near the midpoint of two codes then takes the other one, a step of up to
    # 1/127 of its block's absmax. Measured over seeds 18–26: ≤ 3.8e-7 in loss, ≤ 1.7e-6 in grad_norm,
    # ≤ 1.9e-5 in weights, ≤ 1.3e-4 in logits; bounds ≈ 10×. A real error is far beyond them: fp32
    # moments in zoffload move the weights by 6.6e-2 and the loss by 3.6e-4 by step 4; quantizing the
    # small tensors too (no 4096 threshold) the weights by 6.0e-3.
    "fp32-8bit": {"loss": 1e-5, "grad_norm": 2e-5, "weights": 2e-4, "logits": 1e-3},
    # bf16 moments vs transformers + torch.optim.AdamW with its moments rounded to bf16 after each
    # step: the gradients differ in the last bits as in the fp32 case, and a moment whose two fp32
    # values straddle a bf16 rounding boundary would be stored one bf16 ulp (2^-8) apart. Measured
    # (seed 19, the 2-core AMD EPYC): ≤ 4.0e-8 in loss, ≤ 5.9e-8 in grad_norm, 1.2e-6 in weights,
    # 7.4e-6 in logits; bounds ≈ 7–17× except the loss's. The error they catch: zoffload keeping
    # fp32 moments against this reference differs by 6.8e-6 in grad_norm, 4.0e-5 in weights and
    # 2.4e-4 in logits by step 4 (3.2e-7 in loss: the loss alone would not tell).
    "fp32-bf16-moments": {"loss": 1e-6, "grad_norm": 1e-6, "weights": 1e-5, "logits": 5e-5},
    # bf16-stored gradients (zoffload.gradient_store_dtype) vs transformers + torch.optim.AdamW whose
    # gradients are, each step, the fp32 sums' norm, then the sums rounded to bf16, then clipped: the
    # gradients differ in the last bits as in the fp32 case, so a sum near a bf16 rounding midpoint
    # may round to the other neighbour. Measured over seeds 20–23 (the 2-core AMD EPYC): ≤ 1.6e-7 in
    # loss, ≤ 2.6e-7 in grad_norm, ≤ 2.1e-6 in weights, ≤ 1.4e-5 in logits. The error they catch:
    # zoffload storing fp32 gradients against this reference differs by 7.3e-6 in grad_norm, 2.6e-5
    # in weights and 1.2e-4 in logits by step 4 (seed 20).
    "fp32-bf16-grads": {"loss": 1e-6, "grad_norm": 1e-6, "weights": 1e-5, "logits": 5e-5},
}
if DEVICE == "cuda":
    # Measured on an H200 (torch 2.11.0+cu130, transformers 5.17, TF32 off), one run of these cases:
    # fp32 vs hf: ≤ 1.5e-7 in loss and ≤ 3.2e-7 in grad_norm, as on the CPU, but the export ≤ 1.12e-5
    # in weights and ≤ 1.11e-5 in logits (cuBLAS's fp32 kernels sum in other orders than the
    # engine's block-wise recompute takes them): bounds 5e-5. bf16 mirror: bit-identical in loss,
    # weights and logits, grad_norm ≤ 1.7e-16, as on the CPU; the bounds leave 1e-5 for a GPU whose
    # SDPA backward accumulates in another order, still far below a real error (see fp32 above).
    TOLERANCES["fp32"] = {"loss": 1e-5, "grad_norm": 1e-5, "weights": 5e-5, "logits": 5e-5}
    TOLERANCES["bf16-mirror"] = {"loss": 1e-5, "grad_norm": 1e-5, "weights": 1e-5, "logits": 1e-5}
    # Not yet run on a GPU: the fp32 case's GPU bounds (cuBLAS's summation orders), which still
    # catch fp32 moments (or fp32-stored gradients) in zoffload by the logits (2.4e-4 and 1.2e-4 on
    # the CPU).
    TOLERANCES["fp32-bf16-moments"] = dict(TOLERANCES["fp32"])
    TOLERANCES["fp32-bf16-grads"] = dict(TOLERANCES["fp32"])


# ---- The cases ---------------------------------------------------------------------------------

def phi_longrope(n):
    """A longrope dict for n = rotary_dim / 2 frequencies: short and long factors that differ per
    frequency and from each other (as Phi's do), the long ones stretching the low frequencies most."""
    return {"rope_type": "longrope", "rope_theta": 10000.0,
            "short_factor": [1.0 + 0.05 * i for i in range(n)], "long_factor": [1.0 + 1.5 * i for i in range(n)]}


# placement: where the params and the optimizer states live ("none" at ZeRO stage `stage`).
CASES = [
    dict(name="llama-untied-fp32-none", arch="llama", tied=False, vocab=384, seq=32, disk="float32", shard=False,
         precision="fp32", placement="none", stage=3, gas=2, clip=0.3, schedule=None, lr=2e-3, seed=11),
    dict(name="llama-tied-fp32-cpu", arch="llama", tied=True, vocab=256, seq=32, disk="bfloat16", shard=True,
         precision="fp32", placement="cpu", stage=3, gas=2, clip=1.0, schedule="warmup", lr=2e-3, seed=12),
    dict(name="mistral-bf16-nvme", arch="mistral", tied=False, vocab=320, seq=48, disk="float32", shard=True,
         precision="bf16", placement="nvme", stage=3, gas=2, clip=1.0, schedule=None, lr=2e-3, seed=13),
    dict(name="qwen2-bf16-cpu", arch="qwen2", tied=False, vocab=448, seq=32, disk="bfloat16", shard=False,
         precision="bf16", placement="cpu", stage=3, gas=2, clip=1.0, schedule=None, lr=2e-3, seed=14,
         rope={"rope_type": "default", "rope_theta": 1e6}),
    dict(name="llama3-rope-fp32-nvme", arch="llama", tied=False, vocab=512, seq=64, disk="float32", shard=True,
         precision="fp32", placement="nvme", stage=3, gas=1, clip=1.0, schedule=None, lr=2e-3, seed=15,
         rope={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 4.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
         max_position=128),
    dict(name="llama-tied-bf16-nvme", arch="llama", tied=True, vocab=256, seq=32, disk="float32", shard=False,
         precision="bf16", placement="nvme", stage=3, gas=2, clip=1.0, schedule=None, lr=2e-3, seed=17),
    dict(name="llama-untied-bf16-none", arch="llama", tied=False, vocab=384, seq=32, disk="bfloat16", shard=True,
         precision="bf16", placement="none", stage=2, gas=1, clip=0.3, schedule="warmup", lr=2e-3, seed=16),
    # zoffload.moment_dtype "8bit" against bitsandbytes' AdamW8bit: quantized tensors with a partial
    # last block (the embeddings and the head, 385 × 64) and whole ones (q/o 4096, MLP 10240), fp32
    # ones under 4096 elements (k/v 2048, the norms).
    dict(name="llama-untied-fp32-nvme-8bit", arch="llama", tied=False, vocab=385, seq=32, disk="float32",
         shard=False, precision="fp32", placement="nvme", stage=3, gas=2, clip=1.0, schedule="warmup", lr=2e-3,
         seed=18, moments="8bit"),
    # zoffload.moment_dtype "bf16" against torch.optim.AdamW whose moments are rounded to bf16 after
    # every step (the documented semantics: the fp32 update, the moments stored in bf16).
    dict(name="llama-tied-fp32-cpu-bf16moments", arch="llama", tied=True, vocab=256, seq=32, disk="float32",
         shard=False, precision="fp32", placement="cpu", stage=3, gas=2, clip=1.0, schedule=None, lr=2e-3,
         seed=19, moments="bf16"),
    # zoffload.gradient_store_dtype "bf16" (the vertical schedule: the device sums the micro-batches in
    # fp32) against torch.optim.AdamW whose gradients are the fp32 sums' norm first, then rounded to
    # bf16, then clipped: the documented semantics. Tied, so the head's and the embedding's gradients
    # are added in fp32 before the one rounding.
    dict(name="llama-tied-fp32-nvme-bf16grads", arch="llama", tied=True, vocab=256, seq=32, disk="float32",
         shard=False, precision="fp32", placement="nvme", stage=3, gas=2, clip=0.5, schedule=None, lr=2e-3,
         seed=20, grads="bf16"),
    # zoffload.master_dtype "bf16": the masters rounded stochastically after every step, with the
    # engine's random bits keyed by --seed, the step and the parameter's index in the engine's order.
    # Qwen2, for its biases (parameters of their own between the projections).
    dict(name="qwen2-bf16-cpu-bf16masters", arch="qwen2", tied=False, vocab=320, seq=32, disk="float32",
         shard=False, precision="bf16", placement="cpu", stage=3, gas=2, clip=1.0, schedule="warmup", lr=2e-3,
         seed=21, master="bf16", rope={"rope_type": "default", "rope_theta": 1e6}),
    # zoffload.gradient_accumulators "none": no clipping and no overflow skip, each sub-group stepped
    # from its gradient during backward (the vertical schedule sums the two micro-batches on the
    # device first) against torch.optim.AdamW on the same sums. Tied, so the head's and the
    # embedding's gradients meet in one sum before their sub-group is stepped.
    # Qwen3: q_norm and k_norm over each head's dims before RoPE (randomised below like every norm), an
    # explicit head_dim (32, not hidden / heads = 16: the projections are 128 wide), on every placement.
    dict(name="qwen3-tied-fp32-none", arch="qwen3", tied=True, vocab=320, seq=32, disk="float32", shard=False,
         precision="fp32", placement="none", stage=3, gas=2, clip=0.5, schedule=None, lr=2e-3, seed=23, head_dim=32,
         rope={"rope_type": "default", "rope_theta": 1e6}),
    dict(name="qwen3-untied-bf16-cpu", arch="qwen3", tied=False, vocab=384, seq=32, disk="bfloat16", shard=True,
         precision="bf16", placement="cpu", stage=3, gas=2, clip=1.0, schedule="warmup", lr=2e-3, seed=24,
         head_dim=32, rope={"rope_type": "default", "rope_theta": 1e6}),
    dict(name="qwen3-untied-fp32-nvme", arch="qwen3", tied=False, vocab=256, seq=32, disk="float32", shard=False,
         precision="fp32", placement="nvme", stage=3, gas=1, clip=1.0, schedule=None, lr=2e-3, seed=25, head_dim=16),
    # OLMo 2: norms after attention and after the MLP (none before), q/k norms over the whole
    # projection, the norms' weights applied in fp32 and RoPE in fp32 (which only bf16 shows), and
    # Olmo2Config's pad_token_id 1: the random tokens hit that embedding row, which transformers'
    # lookup gives no gradient.
    dict(name="olmo2-untied-fp32-none", arch="olmo2", tied=False, vocab=320, seq=32, disk="float32", shard=False,
         precision="fp32", placement="none", stage=3, gas=2, clip=0.5, schedule=None, lr=2e-3, seed=26,
         rope={"rope_type": "default", "rope_theta": 500000.0}),
    dict(name="olmo2-untied-bf16-cpu", arch="olmo2", tied=False, vocab=384, seq=32, disk="bfloat16", shard=True,
         precision="bf16", placement="cpu", stage=3, gas=2, clip=1.0, schedule="warmup", lr=2e-3, seed=27),
    dict(name="olmo2-tied-fp32-nvme", arch="olmo2", tied=True, vocab=256, seq=32, disk="float32", shard=False,
         precision="fp32", placement="nvme", stage=3, gas=2, clip=1.0, schedule=None, lr=2e-3, seed=28),
    # Gemma 3 (text): four norms per layer scaling by 1 + weight in fp32, GELU-tanh, the embeddings
    # times √hidden, per-head q/k norms, and GEMMA's settings; Gemma3TextConfig's pad_token_id 0.
    dict(name="gemma3-tied-fp32-none", arch="gemma3_text", tied=True, vocab=320, seq=32, disk="float32",
         shard=False, precision="fp32", placement="none", stage=3, gas=2, clip=0.5, schedule=None, lr=2e-3, seed=29,
         head_dim=16),
    dict(name="gemma3-tied-bf16-cpu", arch="gemma3_text", tied=True, vocab=384, seq=32, disk="bfloat16", shard=True,
         precision="bf16", placement="cpu", stage=3, gas=2, clip=1.0, schedule="warmup", lr=2e-3, seed=30,
         head_dim=16),
    dict(name="gemma3-untied-fp32-nvme", arch="gemma3_text", tied=False, vocab=256, seq=32, disk="float32",
         shard=False, precision="fp32", placement="nvme", stage=3, gas=2, clip=1.0, schedule=None, lr=2e-3, seed=31,
         head_dim=16),
    # Phi-3: fused qkv_proj and gate_up_proj, RoPE over part of each head (Phi-4-mini's 0.75: 12 of
    # 16 dims; 0.5), longrope in both regimes: rows of 32 longer than original_max_position_embeddings
    # 16 (the long factors) and shorter than 64 (the short ones), with the attention factor from
    # max / original; and a window of 8 over every layer.
    dict(name="phi3-longrope-long-fp32-none", arch="phi3", tied=False, vocab=320, seq=32, disk="float32", shard=False,
         precision="fp32", placement="none", stage=3, gas=2, clip=0.5, schedule=None, lr=2e-3, seed=32, partial=0.5,
         max_position=64, original_max=16, rope=phi_longrope(4)),
    dict(name="phi3-longrope-short-bf16-cpu", arch="phi3", tied=True, vocab=384, seq=32, disk="bfloat16", shard=True,
         precision="bf16", placement="cpu", stage=3, gas=2, clip=1.0, schedule="warmup", lr=2e-3, seed=33,
         partial=0.75, max_position=512, original_max=64, rope=phi_longrope(6)),
    dict(name="phi3-window-fp32-nvme", arch="phi3", tied=False, vocab=256, seq=32, disk="float32", shard=False,
         precision="fp32", placement="nvme", stage=3, gas=2, clip=1.0, schedule=None, lr=2e-3, seed=34, partial=1.0,
         max_position=64, original_max=64, window=8),
    dict(name="llama-tied-bf16-cpu-noacc", arch="llama", tied=True, vocab=256, seq=32, disk="float32",
         shard=False, precision="bf16", placement="cpu", stage=3, gas=2, clip=0.0, schedule="warmup", lr=2e-3,
         seed=22, accumulators="none"),
    # zoffload.freeze: the frozen params get requires_grad_(False) in transformers, torch's AdamW steps
    # the rest; the export's frozen tensors are the saved model's, byte for byte.
    dict(name="llama-freeze-fp32-none", arch="llama", tied=False, vocab=384, seq=32, disk="float32", shard=False,
         precision="fp32", placement="none", stage=0, gas=2, clip=0.3, schedule=None, lr=2e-3, seed=41,
         freeze=["model.embed_tokens.weight", "model.layers.0.*"]),
    dict(name="qwen2-freeze-fp32-cpu", arch="qwen2", tied=True, vocab=256, seq=32, disk="float32", shard=False,
         precision="fp32", placement="cpu", stage=3, gas=2, clip=1.0, schedule=None, lr=2e-3, seed=42,
         freeze=["model.layers.{1..1}.mlp.*", "model.norm.weight"]),
    dict(name="mistral-freeze-fp32-nvme", arch="mistral", tied=False, vocab=320, seq=32, disk="float32", shard=True,
         precision="fp32", placement="nvme", stage=3, gas=2, clip=1.0, schedule="warmup", lr=2e-3, seed=43,
         freeze=["model.layers.0.self_attn.*", "lm_head.weight"]),
]

WARMUP = {"warmup_min_lr": 1e-4, "warmup_num_steps": 3}


# Gemma 3's own settings, each far from what a mistake would give: q·k scaled by 24^-1/2 (not the
# head_dim 16's), a window of 4 on the sliding layer 0 (the rows are 32 long), linear RoPE scaling
# on the full layer 1 and another theta on the sliding one, logits capped at 5.
GEMMA = {"query_pre_attn_scalar": 24, "sliding_window": 4, "softcap": 5.0,
         "rope": {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                  "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}}


def lr_at(case, t):
    """docs/training.md, Learning-rate schedules: WarmupLR linear, N = max(2, warmup_num_steps)."""
    if case["schedule"] is None:
        return case["lr"]
    lo, hi, n = WARMUP["warmup_min_lr"], case["lr"], max(2, WARMUP["warmup_num_steps"])
    return lo + (hi - lo) * t / n if t < n else hi


def zoffload_config(case):
    zero = {"stage": case["stage"], "sub_group_size": 20000, "stage3_gather_16bit_weights_on_model_save": True}
    if case["stage"] == 3:
        # Only the norms (and qwen2's biases) stay resident; the rest is fetched block by block.
        zero.update({"stage3_param_persistence_threshold": 200, "stage3_prefetch_bucket_size": 30000,
                     "stage3_max_live_parameters": 100000, "stage3_max_reuse_distance": 0})
    if case["placement"] == "cpu":
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    elif case["placement"] == "nvme":
        zero["offload_param"] = {"device": "nvme", "nvme_path": "nvme", "buffer_count": 4, "buffer_size": 40000}
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": "nvme", "pipeline_read": True,
                                     "pipeline_write": True}
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": case["gas"],
        "gradient_clipping": case["clip"],
        "steps_per_print": 1,
        "bf16": {"enabled": case["precision"] == "bf16"},
        "data_types": {"grad_accum_dtype": "fp32"},
        "optimizer": {"type": "AdamW", "params": {"lr": case["lr"], "betas": list(BETAS), "eps": EPS,
                                                  "weight_decay": WEIGHT_DECAY}},
        "zero_optimization": zero,
        "zoffload": {"device": ZO_DEVICE, "optimizer_threads": 1, "moment_dtype": case.get("moments", "fp32")},
    }
    if case.get("grads") == "bf16":
        cfg["zoffload"].update({"gradient_store_dtype": "bf16", "schedule": "vertical"})
    if case.get("master") == "bf16":
        cfg["zoffload"]["master_dtype"] = "bf16"
    if case.get("accumulators") == "none":
        cfg["zoffload"].update({"gradient_accumulators": "none", "schedule": "vertical"})
        cfg["bf16"]["check_grad_overflow"] = False
    if case.get("freeze"):
        cfg["zoffload"]["freeze"] = case["freeze"]
        cfg["zoffload"]["checkpoint"] = {"dir": "ckpt"}  # saved at the end, exported again below
    if case["schedule"] == "warmup":
        cfg["scheduler"] = {"type": "WarmupLR", "params": {
            "warmup_min_lr": WARMUP["warmup_min_lr"], "warmup_max_lr": case["lr"],
            "warmup_num_steps": WARMUP["warmup_num_steps"], "warmup_type": "linear"}}
    return cfg


# ---- Models and data ---------------------------------------------------------------------------

def hf_config(case, rope=None):
    if case["arch"] == "gemma3_text":
        return Gemma3TextConfig(
            vocab_size=case["vocab"], hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS,
            num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=case["head_dim"],
            max_position_embeddings=64, rms_norm_eps=1e-5, initializer_range=INIT_STD, tie_word_embeddings=case["tied"],
            query_pre_attn_scalar=GEMMA["query_pre_attn_scalar"], sliding_window=GEMMA["sliding_window"],
            layer_types=["sliding_attention", "full_attention"], final_logit_softcapping=GEMMA["softcap"],
            rope_parameters=rope or GEMMA["rope"])
    if case["arch"] == "phi3":
        # Phi3Config's pad_token_id (32000) lies outside these vocabularies; its sliding window,
        # partial rotary and longrope come from the case.
        return Phi3Config(
            vocab_size=case["vocab"], hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS,
            num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=case["max_position"],
            original_max_position_embeddings=case["original_max"], rms_norm_eps=1e-5, initializer_range=INIT_STD,
            tie_word_embeddings=case["tied"], pad_token_id=3, sliding_window=case.get("window"),
            partial_rotary_factor=case["partial"],
            rope_parameters=rope or case.get("rope", {"rope_type": "default", "rope_theta": 10000.0}))
    cls = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config,
           "olmo2": Olmo2Config}[case["arch"]]
    extra = {"head_dim": case["head_dim"]} if "head_dim" in case else {}
    return cls(vocab_size=case["vocab"], hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
               num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
               max_position_embeddings=case.get("max_position", 64), rms_norm_eps=1e-5,
               initializer_range=INIT_STD, tie_word_embeddings=case["tied"],
               rope_parameters=rope or case.get("rope", {"rope_type": "default", "rope_theta": 10000.0}), **extra)


def save_model(case, model_dir):
    """A random model as transformers initialises it (seeded), with the norms and biases moved off
    their constant init so that a wrong or missing one shows; saved with save_pretrained. Returns
    the config.json it wrote."""
    torch.manual_seed(case["seed"])
    model = AutoModelForCausalLM.from_config(hf_config(case), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.2 * torch.randn_like(p))
    model.to(getattr(torch, case["disk"])).save_pretrained(model_dir, max_shard_size="48KB" if case["shard"] else "1GB")
    files = sorted(os.listdir(model_dir))
    expect(("model.safetensors.index.json" in files) == case["shard"],
           "%s: saved %s: %s" % (case["name"], "sharded" if case["shard"] else "as one file", files))
    with open(os.path.join(model_dir, "config.json")) as f:
        return json.load(f)


def batches_of(case, tokens, data_seed):
    """(inputs, targets) [B, T] per micro-batch in zoffload's order: window w = tokens[w·T … w·T + T],
    inputs its first T, targets its last T; batch b = the windows at slots b·B … b·B + B − 1."""
    t = case["seq"]
    order = epoch_permutation((len(tokens) - 1) // t, data_seed, 0)
    out = []
    for b in range(STEPS * case["gas"]):
        rows = np.stack([tokens[w * t:w * t + t + 1] for w in order[b * MICRO_BATCH:(b + 1) * MICRO_BATCH]])
        x = torch.from_numpy(rows.astype(np.int64))
        out.append((x[:, :-1].contiguous(), x[:, 1:].contiguous()))
    return out


# ---- The references ----------------------------------------------------------------------------

def _engine_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                      sliding_window=None, **kwargs):
    """The engine's attention (engine/model/decoder.cpp, causal_attention): k and v repeated per query
    head (transformers' repeat_kv), then SDPA with is_causal, or on Gemma's sliding layers with the
    boolean mask i - window < j ≤ i, and the module's scale. An unknown implementation gets no mask
    from transformers (no padding here)."""
    assert attention_mask is None and dropout == 0.0
    n_rep = module.num_key_value_groups
    k = transformers.integrations.sdpa_attention.repeat_kv(key, n_rep)
    v = transformers.integrations.sdpa_attention.repeat_kv(value, n_rep)
    t = query.size(-2)
    scale = None if scaling == query.size(-1) ** -0.5 else scaling
    if sliding_window is not None and sliding_window < t:
        i, j = torch.arange(t).unsqueeze(1), torch.arange(t).unsqueeze(0)
        hidden = torch.logical_or(j > i, j <= i - sliding_window).to(query.device)
        out = F.scaled_dot_product_attention(query, k, v, attn_mask=torch.logical_not(hidden), scale=scale)
    else:
        out = F.scaled_dot_product_attention(query, k, v, is_causal=True, scale=scale)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register("zoffload_mirror", _engine_attention)


def fma32(a, b, c):
    """fp32 fused multiply-add, correctly rounded: the product of two fp32 is exact in fp64, the sum
    is rounded to odd in fp64 (TwoSum gives its exact error), and a round-to-odd result with ≥ 2·24+2
    bits rounds to fp32 exactly as the exact value would (Boldo & Melquiond)."""
    a, b, c = (np.asarray(x, dtype=np.float64) for x in (a, b, c))
    prod = a * b
    s = prod + c
    t = s - prod
    err = (prod - (s - t)) + (c - t)
    inexact_even = (err != 0) & ((s.view(np.int64) & 1) == 0)
    s = np.where(inexact_even, np.nextafter(s, np.where(err > 0, np.inf, -np.inf)), s)
    return s.astype(np.float32)


# ---- bf16 masters: the engine's stochastic rounding, redone (Note [Stochastic rounding to bf16]) ----

_M64 = (1 << 64) - 1
# The engine's parameter order within a decoder layer of the pre-norm families
# (engine/model/model_config.cpp, decoder_params), which keys each parameter's rounding.
_PRE_NORM = ("llama", "mistral", "qwen2", "qwen3", "phi3")
_LAYER_ORDER = ["input_layernorm.weight", "self_attn.qkv_proj.weight", "self_attn.q_proj.weight", "self_attn.q_proj.bias",
                "self_attn.k_proj.weight", "self_attn.k_proj.bias", "self_attn.v_proj.weight",
                "self_attn.v_proj.bias", "self_attn.o_proj.weight", "self_attn.q_norm.weight",
                "self_attn.k_norm.weight", "post_attention_layernorm.weight",
                "mlp.gate_up_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"]


def engine_param_index(names, arch):
    """name -> the engine's index of that parameter (embedding, layers, final norm, untied head).
    `names` in transformers' module order, which the engine keeps within a layer except for the
    pre-norm families (_LAYER_ORDER)."""
    def key(i_name):
        i, n = i_name
        if n == "model.embed_tokens.weight":
            return (0, 0, 0)
        if n.startswith("model.layers."):
            layer, rest = n[len("model.layers."):].split(".", 1)
            return (1, int(layer), _LAYER_ORDER.index(rest) if arch in _PRE_NORM else i)
        return (2, 0, 0 if n == "model.norm.weight" else 1)
    return {n: i for i, (_, n) in enumerate(sorted(enumerate(names), key=key))}


def sr_key(seed, step, param):
    x = (seed ^ ((step * 0x9E3779B97F4A7C15) & _M64) ^ ((param * 0xD1B54A32D192ED03) & _M64)) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    x ^= x >> 31
    return (x ^ (x >> 32)) & 0xFFFFFFFF


def sr_round(values, key):
    """An fp32 array rounded to bf16 stochastically (returned as fp32 holding bf16 values): element i
    (row-major) rounds away from zero when sr_random16(key, i) < its low 16 bits."""
    u = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32).ravel()
    with np.errstate(over="ignore"):
        x = np.arange(u.size, dtype=np.uint32) * np.uint32(0x9E3779B9) ^ np.uint32(key)
        x ^= x >> np.uint32(16)
        x *= np.uint32(0x7FEB352D)
        x ^= x >> np.uint32(15)
        x *= np.uint32(0x846CA68B)
        x ^= x >> np.uint32(16)
    rand16 = x >> np.uint32(16)
    hi = u >> np.uint32(16)
    out = hi + (rand16 < (u & np.uint32(0xFFFF))).astype(np.uint32)
    out = np.where((u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000), hi | np.uint32(0x40), out)
    return (out << np.uint32(16)).view(np.float32).reshape(np.shape(values))


class EngineAdamW:
    """AdamW, the per-step constants and the clipping in the engine's documented operation order
    (common/adam_math.h adam_constants/adam_update, docs/cpu_optim.md; engine/optim/grad_clip.cpp),
    in fp32 with every operation correctly rounded. Same formula as torch.optim.AdamW (which the fp32
    cases and the "hf" runs check); only the roundings differ from torch's, by an fp32 ulp now and
    then, and in bf16 such an ulp sometimes moves a compute copy to the neighbouring bf16. Adam's
    m/√v amplifies that into a visible difference where a gradient is rounding noise only (qwen2's
    k_proj bias: a bias on every key shifts all scores of a query alike, so its exact gradient is
    0). With these roundings the mirror is bit-identical to the engine."""

    def __init__(self, params):
        self.params = params  # name -> fp32 numpy array, updated in place
        self.m = {n: np.zeros_like(p) for n, p in params.items()}
        self.v = {n: np.zeros_like(p) for n, p in params.items()}

    def step(self, grads, step, lr, clip):
        f32 = np.float32
        norm = math.sqrt(sum(float(np.square(g.astype(np.float64)).sum()) for g in grads.values()))
        coef = clip / (norm + 1e-6) if clip > 0 else 1.0
        grad_scale = f32(coef) if coef < 1.0 else f32(1.0)
        lr, b1, b2, eps, wd = (float(f32(x)) for x in (lr, BETAS[0], BETAS[1], EPS, WEIGHT_DECAY))
        bc1, bc2 = 1.0 - b1 ** step, 1.0 - b2 ** step
        one_minus_b1, one_minus_b2 = f32(1.0 - b1), f32(1.0 - b2)
        bc2_rsqrt, neg_step, decay = f32(1.0 / math.sqrt(bc2)), f32(-lr / bc1), f32(1.0 - lr * wd)
        for n, p in self.params.items():
            g = grads[n] * grad_scale
            m = self.m[n] = fma32(g, one_minus_b1, self.m[n] * f32(b1))
            v = self.v[n] = fma32(g * g, one_minus_b2, self.v[n] * f32(b2))
            d = m / fma32(np.sqrt(v), bc2_rsqrt, f32(eps))
            p[...] = fma32(d, neg_step, p * decay)
        return norm


def frozen_names(case, names):
    """The names zoffload.freeze's globs match (docs/config.md): "*" any run, "?" one character,
    "{a..b}" a decimal in [a, b]; written here as regular expressions."""
    def regex(pattern):
        out = ""
        for token in re.split(r"(\{\d+\.\.\d+\}|\*|\?)", pattern):
            if token == "*":
                out += ".*"
            elif token == "?":
                out += "."
            elif re.fullmatch(r"\{\d+\.\.\d+\}", token):
                lo, hi = map(int, token[1:-1].split(".."))
                out += "(?:%s)" % "|".join(str(v) for v in range(lo, hi + 1))
            else:
                out += re.escape(token)
        return re.compile(out + r"\Z")
    patterns = [regex(p) for p in case.get("freeze", [])]
    return {n for n in names if any(p.match(n) for p in patterns)}


def reference_train(case, model_dir, batches, attention, engine_adam, data_seed):
    """transformers + AdamW (see the top): torch.optim.AdamW with clip_grad_norm_, or EngineAdamW.
    Returns the per-step figures and the final fp32 model (the masters). data_seed keys bf16
    masters' rounding, as zoffload's --seed does."""
    dev = torch.device(DEVICE)
    master = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation=attention).to(dev)
    master.train()
    bf16 = case["precision"] == "bf16"
    # The bf16 copy is loaded as transformers loads a bf16 model, which keeps the RoPE inv_freq buffer
    # in fp32 as the engine's tables are; model.to(torch.bfloat16) would round it to bf16.
    compute = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16,
                                                   attn_implementation=attention).to(dev) if bf16 else master
    compute.train()
    names = [n for n, _ in master.named_parameters()]  # a tied matrix once, as model.embed_tokens.weight
    frozen = frozen_names(case, names)
    expect(len(frozen) == 0 or not bf16, "%s: frozen params are compared in fp32 only" % case["name"])
    for n, p in master.named_parameters():
        if n in frozen:  # zoffload.freeze: no gradient, and AdamW skips it
            p.requires_grad_(False)
    tied_bf16 = bf16 and engine_adam and case["tied"]
    if tied_bf16:
        # The engine adds the two gradients of a tied matrix into its fp32 sum one after the other,
        # the head's first (its backward comes first); autograd would add them in bf16. So the
        # mirror's compute copy gets an lm_head of its own, holding the same bf16 values.
        compute.lm_head.weight = torch.nn.Parameter(compute.model.embed_tokens.weight.detach().clone())
    mparams, cparams = dict(master.named_parameters()), dict(compute.named_parameters())
    # name -> the compute copies that read that master, in the order the engine adds their gradients.
    copies = {n: [cparams[n]] for n in names}
    if tied_bf16:
        copies["model.embed_tokens.weight"].insert(0, cparams["lm_head.weight"])
    bf16_masters = case.get("master") == "bf16"
    param_index = engine_param_index(names, case["arch"])
    if bf16_masters:  # they start as the weights rounded to nearest even
        with torch.no_grad():
            for n in names:
                mparams[n].copy_(mparams[n].to(torch.bfloat16).float())
    if engine_adam:
        masters = {n: mparams[n].detach().cpu().numpy().copy() for n in names}
        opt = EngineAdamW(masters)
    elif case.get("moments") == "8bit":
        opt = bnb.optim.AdamW8bit(master.parameters(), lr=case["lr"], betas=BETAS, eps=EPS,
                                  weight_decay=WEIGHT_DECAY, min_8bit_size=4096)
    else:
        opt = torch.optim.AdamW(master.parameters(), lr=case["lr"], betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    gas = case["gas"]
    steps = []
    for step in range(STEPS):
        lr = lr_at(case, step)
        if bf16:
            with torch.no_grad():
                for n in names:  # rounded to nearest even, as the engine's fused copy-out
                    for c in copies[n]:
                        c.copy_(torch.from_numpy(masters[n]).to(dev) if engine_adam else mparams[n])
            acc = {n: torch.zeros_like(mparams[n]) for n in names}
        losses = []
        for micro in range(gas):
            inputs, targets = (x.to(dev) for x in batches[step * gas + micro])
            logits = compute(input_ids=inputs, use_cache=False).logits
            # The targets are the window's next tokens already: no labels=, which would shift again.
            loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))
            (loss * (1.0 / gas)).backward()  # metrics' loss is the mean of the micro-batches' losses
            losses.append(loss.item())
            if bf16:
                for n in names:  # acc = float(acc) + float(g) per micro-batch (grad_accum_dtype fp32)
                    for c in copies[n]:
                        acc[n] += c.grad.float()
                        c.grad = None
        if engine_adam:
            grads = {n: (acc[n] if bf16 else mparams[n].grad).detach().cpu().numpy() for n in names}
            norm = opt.step(grads, step + 1, lr, case["clip"])
            if bf16_masters:
                for n in names:
                    masters[n][...] = sr_round(masters[n], sr_key(data_seed, step + 1, param_index[n]))
            if not bf16:
                master.zero_grad(set_to_none=True)
        else:
            for group in opt.param_groups:
                group["lr"] = lr
            if bf16:
                for n in names:
                    mparams[n].grad = acc[n]
            if case.get("grads") == "bf16":  # the fp32 sums' norm, then the sums rounded, then clipped
                grads = [mparams[n].grad for n in names]
                norm = torch.nn.utils.get_total_norm(grads).item()
                coef = min(1.0, case["clip"] / (norm + 1e-6)) if case["clip"] > 0 else 1.0
                with torch.no_grad():
                    for g in grads:
                        g.copy_(g.to(torch.bfloat16).float()).mul_(coef)
            elif case["clip"] > 0:  # clip_coef = min(1, clip / (norm + 1e-6)): torch's rule and DeepSpeed's
                norm = torch.nn.utils.clip_grad_norm_(master.parameters(), case["clip"]).item()
            else:
                norm = torch.nn.utils.get_total_norm([mparams[n].grad for n in names if n not in frozen]).item()
            with bnb_nearest.nearest() if case.get("moments") == "8bit" else contextlib.nullcontext():
                opt.step()
            if case.get("moments") == "bf16":
                with torch.no_grad():
                    for st in opt.state.values():
                        for k in ("exp_avg", "exp_avg_sq"):
                            st[k].copy_(st[k].to(torch.bfloat16).float())
            if bf16_masters:
                with torch.no_grad():
                    for n in names:
                        rounded = sr_round(mparams[n].detach().cpu().numpy(), sr_key(data_seed, step + 1, param_index[n]))
                        mparams[n].copy_(torch.from_numpy(rounded))
            opt.zero_grad(set_to_none=True)
        steps.append({"loss": sum(losses) / gas, "grad_norm": norm, "lr": lr})
    if engine_adam:
        with torch.no_grad():
            for n in names:
                mparams[n].copy_(torch.from_numpy(masters[n]))
    return steps, master


def logits_of(model, inputs):
    with torch.no_grad():
        return model(input_ids=inputs.to(DEVICE), use_cache=False).logits.float()


# ---- One case ----------------------------------------------------------------------------------

def rel(a, b):
    return abs(a - b) / max(abs(b), 1e-12)


def check_steps(case, zo_steps, refs):
    name = case["name"]
    head = "  step  loss zoffload   " + "".join("%-22s" % ("  " + label) for label, _, _ in refs)
    head += "  grad_norm zoffload" + "".join("%-22s" % ("  " + label) for label, _, _ in refs) + "  lr"
    print(head)
    for i, z in enumerate(zo_steps):
        zn = z["grad_norm"] if z["grad_norm"] is not None else float("nan")
        line = "  %-4d  %-15.9g" % (i + 1, z["loss"])
        line += "".join("  %-12.9g %-7.1e" % (s[i]["loss"], rel(z["loss"], s[i]["loss"])) for _, s, _ in refs)
        line += "  %-18.9g" % zn
        line += "".join("  %-12.9g %-7.1e" % (s[i]["grad_norm"], rel(zn, s[i]["grad_norm"])) for _, s, _ in refs)
        print(line + "  %.6g" % z["lr"])
        expect(z["step"] == i + 1 and not z["skipped"], "%s step %d: numbered and not skipped: %s" % (name, i + 1, z))
        expect(z["tokens"] == case["gas"] * MICRO_BATCH * case["seq"], "%s step %d: tokens %d" % (name, i + 1, z["tokens"]))
        for label, s, tol in refs:
            r = s[i]
            expect(rel(z["lr"], r["lr"]) <= 1e-6, "%s step %d: lr %.9g, reference %.9g" % (name, i + 1, z["lr"], r["lr"]))
            for what, zv in (("loss", z["loss"]), ("grad_norm", zn)):
                expect(rel(zv, r[what]) <= tol[what], "%s step %d: %s %.9g, %s reference %.9g (rel %.2e > %.0e)" %
                       (name, i + 1, what, zv, label, r[what], rel(zv, r[what]), tol[what]))


def check_export(case, export_dir, batch, refs):
    """The export against each reference's final masters: weights and logits."""
    name = case["name"]
    export_dtype = torch.bfloat16 if case["precision"] == "bf16" else torch.float32
    try:
        exported = AutoModelForCausalLM.from_pretrained(export_dir, dtype=torch.float32).to(DEVICE)
    except Exception as e:  # noqa: BLE001 (any failure to load is the finding)
        expect(False, "%s: from_pretrained(%s) fails: %r" % (name, export_dir, e))
        return
    exp_state = exported.state_dict()
    frozen = frozen_names(case, exp_state.keys())
    if frozen:
        # zoffload.freeze: the frozen tensors are exported as they were saved (fp32 on disk and in
        # compute here), bit for bit; the references agree.
        saved = AutoModelForCausalLM.from_pretrained(os.path.join(os.path.dirname(os.path.dirname(export_dir)), "model"),
                                                     dtype=torch.float32).state_dict()
        same = all(torch.equal(exp_state[k].cpu(), saved[k]) for k in frozen)
        expect(same and all(torch.equal(refs[0][1].state_dict()[k].cpu(), saved[k]) for k in frozen),
               "%s: the %d frozen tensors are exported as saved" % (name, len(frozen)))
        print("  %d frozen tensors exported as saved: %s" % (len(frozen), "yes" if same else "NO"))
    for label, ref_model, tol in refs:
        ref_state = ref_model.state_dict()
        expect(sorted(ref_state) == sorted(exp_state), "%s: the export holds the reference's tensors (differ: %s)" %
               (name, sorted(set(exp_state) ^ set(ref_state))))
        worst_name, worst = "", 0.0
        for k in ref_state.keys() & exp_state.keys():
            ref_w = ref_state[k].detach().float()
            ref_r = ref_w.to(export_dtype).float()  # the engine exports its master rounded to nearest even
            err = ((exp_state[k].detach().float() - ref_r).norm() / ref_w.norm().clamp_min(1e-30)).item()
            if err > worst or not worst_name:
                worst_name, worst = k, err
        expect(worst <= tol["weights"], "%s: exported weights vs the %s reference's final ones: %s rel %.2e > %.0e" %
               (name, label, worst_name, worst, tol["weights"]))
        # Logits of the export (read back as fp32) vs the reference's masters rounded like the export.
        rounded = AutoModelForCausalLM.from_pretrained(export_dir, dtype=torch.float32).to(DEVICE)
        with torch.no_grad():
            for k, p in rounded.state_dict().items():
                p.copy_(ref_state[k].detach().to(export_dtype).float())
        zl, rl = logits_of(exported, batch), logits_of(rounded, batch)
        logit_err = ((zl - rl).abs().max() / rl.abs().max()).item()
        expect(logit_err <= tol["logits"], "%s: the export's logits vs the %s reference's: rel %.2e > %.0e" %
               (name, label, logit_err, tol["logits"]))
        print("  export (%s) vs %s: worst weights rel %.2e (%s), logits rel %.2e" %
              (str(export_dtype).replace("torch.", ""), label, worst, worst_name, logit_err))


def check_premises(case, saved, ref_steps, batches, model_dir):
    """What the case is there to exercise really happens, so it cannot pass vacuously."""
    name = case["name"]
    if case["clip"] < 1.0:
        expect(any(s["grad_norm"] > case["clip"] for s in ref_steps), "%s: clipping is active on some step "
               "(norms %s, clip %g)" % (name, [round(s["grad_norm"], 4) for s in ref_steps], case["clip"]))
    x, y = batches[0]

    def first_loss(**overrides):
        m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **overrides).to(DEVICE)
        return F.cross_entropy(logits_of(m, x).reshape(-1, case["vocab"]), y.to(DEVICE).reshape(-1)).item()

    # Against the tightest loss bound this case is checked with on this device (on cuda the bf16
    # mirror's is loosened), so a wrong setting cannot pass unseen wherever the test runs.
    kinds = ("fp32",) if case["precision"] == "fp32" else ("bf16-mirror", "bf16-hf")
    tightest = min(TOLERANCES[k]["loss"] for k in kinds)
    rope = case.get("rope")
    if rope is not None:
        expect("rope_parameters" in saved and "rope_scaling" not in saved and "rope_theta" not in saved,
               "%s: config.json in transformers-5 form (rope_parameters only): %s" % (name, sorted(saved)))
        # The rope settings change the loss far beyond the tolerance: with transformers' defaults
        # instead (rope_theta 10000, no scaling) the first batch's loss differs clearly.
        with_rope, plain = first_loss(), first_loss(rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
        expect(rel(plain, with_rope) > 10 * tightest,
               "%s: the rope settings matter: first loss %.6g, with the default rope %.6g" % (name, with_rope, plain))
        print("  premise: first loss %.7g with this rope, %.7g with the default one" % (with_rope, plain))
    if case["arch"] == "phi3":
        # The window, and the longrope regime the row length picks (moving original_max_position_embeddings
        # to the row's other side switches it), change the first loss.
        checks = []
        if case.get("window"):
            checks.append(("window", dict(sliding_window=None)))
        if rope is not None and rope["rope_type"] == "longrope":
            other = 64 if case["original_max"] < case["seq"] else 16
            checks.append(("longrope regime", dict(original_max_position_embeddings=other, rope_parameters=dict(
                rope, original_max_position_embeddings=other, factor=case["max_position"] / case["original_max"]))))
        base = first_loss()
        for what, override in checks:
            other_loss = first_loss(**override)
            expect(rel(other_loss, base) > 10 * tightest, "%s: the %s matters: first loss %.6g, otherwise %.6g" %
                   (name, what, base, other_loss))
    if case["arch"] == "gemma3_text":
        # Each of Gemma's own settings changes the first loss: the window, the rope of either layer
        # type, the attention scale and the soft-capping.
        base = first_loss()
        default_rope = {"rope_type": "default", "rope_theta": 10000.0}
        for what, override in [
                ("window", dict(sliding_window=case["seq"])),
                ("full layers' rope", dict(rope_parameters=dict(GEMMA["rope"], full_attention=default_rope))),
                ("sliding layers' rope", dict(rope_parameters=dict(
                    GEMMA["rope"], sliding_attention={"rope_type": "default", "rope_theta": 1e6}))),
                ("query_pre_attn_scalar", dict(query_pre_attn_scalar=case["head_dim"])),
                ("soft-capping", dict(final_logit_softcapping=None))]:
            other = first_loss(**override)
            expect(rel(other, base) > 10 * tightest, "%s: the %s matters: first loss %.6g, without it %.6g" %
                   (name, what, base, other))
    if rope is not None and rope["rope_type"] == "llama3":
        scaled = AutoModelForCausalLM.from_config(hf_config(case)).model.rotary_emb.inv_freq
        unscaled = AutoModelForCausalLM.from_config(hf_config(case, rope={
            "rope_type": "default", "rope_theta": rope["rope_theta"]})).model.rotary_emb.inv_freq
        changed = int((scaled != unscaled).sum())
        expect(changed >= len(unscaled) // 2, "%s: the llama3 scaling changes most frequencies (%d of %d)" %
               (name, changed, len(unscaled)))


def run_case(case, tmp):
    name, precision = case["name"], case["precision"]
    t0 = time.time()
    print("%s: %s%s, %s on disk (%s), %s compute, offload %s, stage %d, GAS %d, clip %g, %s lr" %
          (name, case["arch"], " tied" if case["tied"] else "", case["disk"], "sharded" if case["shard"] else "one file",
           precision, case["placement"], case["stage"], case["gas"], case["clip"], case["schedule"] or "constant"))
    work = os.path.join(tmp, name)
    model_dir, out_dir = os.path.join(work, "model"), os.path.join(work, "run")
    os.makedirs(model_dir)
    saved = save_model(case, model_dir)

    rng = np.random.default_rng(case["seed"])
    needed_windows = STEPS * case["gas"] * MICRO_BATCH
    # Three times the windows the run reads (the shuffle picks among them) and a tail that fills none.
    tokens = rng.integers(0, case["vocab"], size=3 * needed_windows * case["seq"] + 1 + case["seq"] // 2)
    data_path = os.path.join(work, "tokens.bin")
    write_llmc(data_path, tokens)
    config_path = os.path.join(work, "ds_config.json")
    with open(config_path, "w") as f:
        json.dump(zoffload_config(case), f, indent=1)
    data_seed = case["seed"] * 1000 + 7

    args = [zoffload, "train", "--config", config_path, "--model", model_dir, "--data", data_path,
            "--steps", str(STEPS), "--seq-len", str(case["seq"]), "--seed", str(data_seed), "--out", out_dir]
    try:
        proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ZO_ENV)
    except OSError as e:
        expect(False, "%s: cannot run %s: %s" % (name, zoffload, e))
        return

    batches = batches_of(case, tokens, data_seed)
    if case.get("moments") == "8bit":
        runs = [("bnb", "sdpa", False, TOLERANCES["fp32-8bit"])]
    elif case.get("moments") == "bf16":
        runs = [("hf-bf16m", "sdpa", False, TOLERANCES["fp32-bf16-moments"])]
    elif case.get("grads") == "bf16":
        runs = [("hf-bf16g", "sdpa", False, TOLERANCES["fp32-bf16-grads"])]
    elif precision == "fp32":
        runs = [("hf", "sdpa", False, TOLERANCES["fp32"])]
    else:
        runs = [("mirror", "zoffload_mirror", True, TOLERANCES["bf16-mirror"]),
                ("hf", "sdpa", False, TOLERANCES["bf16-hf"])]
    refs = []
    for label, attention, engine_adam, tol in runs:
        steps, model = reference_train(case, model_dir, batches, attention, engine_adam, data_seed)
        refs.append((label, steps, model, tol))
    check_premises(case, saved, refs[0][1], batches, model_dir)

    try:
        stdout, stderr = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
    if not expect(proc.returncode == 0, "%s: zoffload train exits 0 (got %d): %s" % (name, proc.returncode, stderr[-3000:])):
        return
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        zo_steps = [json.loads(line) for line in f]
    if not expect(len(zo_steps) == STEPS, "%s: %d metrics lines, expected %d" % (name, len(zo_steps), STEPS)):
        return
    check_steps(case, zo_steps, [(label, steps, tol) for label, steps, _, tol in refs])
    mem = zo_steps[-1]["memory"]
    # The CPU holds the pinned pool (buffers and the gradient landing ring, with offload none too)
    # and the store's 4 MiB scratch, plus the states offload cpu puts there: per parameter (counted
    # by transformers' model, a tied weight once) the fp32 master, exp_avg and exp_avg_sq and the
    # fp32 gradient accumulator, 16 bytes (12 with bf16 moments, 4 less with bf16 masters), each of
    # the four arrays of a sub-group rounded up to a 4 KiB page. A sub-group holds at least one tensor or one
    # sub_group_size (20000) slice of one, so there are at most (tensors + params / 20000) of them.
    pool_and_scratch = mem["pinned"]["peak_bytes"] + (4 << 20)
    # (Frozen params hold no optimizer state or accumulator: only the trainable ones count.)
    named = list(refs[0][2].named_parameters())
    frozen = frozen_names(case, [k for k, _ in named])
    params = [p for k, p in named if k not in frozen]
    n = sum(p.numel() for p in params)
    # bf16 masters on the CPU beside the compute copies are those copies (Note [A bf16 master is its
    # compute copy]): no bytes of their own; with no accumulators (Note [No accumulator]) the
    # gradient has none either.
    states = ((12 if case.get("moments") == "bf16" else 16) - (4 if case.get("master") == "bf16" else 0)
              - (4 if case.get("accumulators") == "none" else 0)) * n
    padding = 4 * 4096 * (len(params) + -(-n // 20000))
    extra = mem["cpu"]["peak_bytes"] - pool_and_scratch
    placed = {"none": mem["nvme"]["peak_bytes"] == 0 and extra == 0,
              "cpu": mem["nvme"]["peak_bytes"] == 0 and states <= extra <= states + padding,
              "nvme": mem["nvme"]["peak_bytes"] > 0 and mem["nvme_read_bytes"] > 0}[case["placement"]]
    expect(placed, "%s: the states live where offload %s puts them (pool + scratch %d, states %d + at most %d "
           "of padding): %s" % (name, case["placement"], pool_and_scratch, states, padding, mem))

    export_dir = os.path.join(out_dir, "hf-export-step-%d" % STEPS)
    if expect(os.path.isdir(export_dir), "%s: the export %s exists" % (name, export_dir)):
        check_export(case, export_dir, batches[0][0], [(label, model, tol) for label, _, model, tol in refs
                                                        if "weights" in tol])
    if case.get("freeze"):
        # The end-of-run checkpoint (frozen weights in frozen.safetensors) exports what the run did.
        again = os.path.join(work, "from-ckpt")
        p = subprocess.run([zoffload, "export", "--checkpoint", os.path.join(out_dir, "ckpt"), "--dtype", "fp32",
                            "--out", again, "-q"], capture_output=True, text=True, env=ZO_ENV)
        if expect(p.returncode == 0, "%s: zoffload export of the checkpoint: %s" % (name, p.stderr[-2000:])):
            a = AutoModelForCausalLM.from_pretrained(export_dir, dtype=torch.float32).state_dict()
            b = AutoModelForCausalLM.from_pretrained(again, dtype=torch.float32).state_dict()
            same = sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
            print("  the checkpoint's export equals the run's: %s" % ("yes" if same else "NO"))
            expect(same, "%s: the export of the end-of-run checkpoint equals the run's own export" % name)
    print("  %.1f s" % (time.time() - t0))


def check_multimodal_gemma3(tmp):
    """Multimodal Gemma 3 (Gemma3ForConditionalGeneration, as Gemma 3 4B and up ship) trains as its text
    model: transformers saves a tiny one (text weights under model.language_model., a vision tower
    beside them) and the same text weights as a Gemma3ForCausalLM, whose logits it gives equal to the
    multimodal model's on text; zoffload trains both directories with the same data and seed, and
    every step's loss and grad_norm and the exported weights are equal (the text directory is the
    gemma3 cases' oracle-checked path)."""
    from transformers import Gemma3Config, Gemma3ForCausalLM, Gemma3ForConditionalGeneration
    name = "gemma3-multimodal"
    print("%s: Gemma3ForConditionalGeneration against its text model as Gemma3ForCausalLM" % name)
    case = dict(CASES[[c["name"] for c in CASES].index("gemma3-tied-fp32-none")])
    torch.manual_seed(35)
    text = hf_config(case)
    # Gemma3ForConditionalGeneration does not soft-cap its logits (transformers 5.17), whatever its
    # text_config says, and zoffload reads a multimodal config so; Gemma 3 ships without capping.
    text.final_logit_softcapping = None
    vision = {"model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
              "num_attention_heads": 2, "image_size": 28, "patch_size": 14}
    mm = Gemma3ForConditionalGeneration(Gemma3Config(text_config=text.to_dict(), vision_config=vision,
                                                     mm_tokens_per_image=4)).float().eval()
    with torch.no_grad():
        for n, p in mm.named_parameters():
            if n.endswith("norm.weight"):
                p.copy_(0.2 * torch.randn_like(p))
    lm = Gemma3ForCausalLM(mm.config.text_config).float().eval()
    state = {"model." + k: v for k, v in mm.model.language_model.state_dict().items()}
    state["lm_head.weight"] = mm.lm_head.weight
    missing, unexpected = lm.load_state_dict(state, strict=False)
    expect(not unexpected and set(missing) <= {"lm_head.weight"}, "%s: the text model takes the multimodal model's "
           "text weights (missing %s, unexpected %s)" % (name, missing, unexpected))
    x = torch.randint(0, case["vocab"], (2, case["seq"]))
    with torch.no_grad():
        same = torch.equal(mm(input_ids=x).logits, lm(input_ids=x).logits)
    expect(same, "%s: transformers gives the text model the multimodal model's logits on text" % name)
    dirs = {}
    for label, model in (("multimodal", mm), ("text", lm)):
        dirs[label] = os.path.join(tmp, name, label)
        model.save_pretrained(dirs[label])
    with open(os.path.join(dirs["multimodal"], "config.json")) as f:
        saved = json.load(f)
    with safetensors.safe_open(os.path.join(dirs["multimodal"], "model.safetensors"), "pt") as f:
        keys = list(f.keys())
    # transformers 5.17 saves the text weights under Google's names (language_model.model.), though its
    # modules are named model.language_model.; the loader takes either.
    expect(saved["model_type"] == "gemma3" and any(k.startswith(("language_model.model.", "model.language_model."))
                                                   for k in keys) and any("vision_tower" in k for k in keys),
           "%s: saved as a multimodal checkpoint (model_type %s, tensors %s...)" % (name, saved["model_type"], keys[:3]))
    rng = np.random.default_rng(35)
    data_path = os.path.join(tmp, name, "tokens.bin")
    write_llmc(data_path, rng.integers(0, case["vocab"], size=3 * STEPS * 2 * MICRO_BATCH * case["seq"] + 1))
    config_path = os.path.join(tmp, name, "ds_config.json")
    with open(config_path, "w") as f:
        json.dump(zoffload_config(dict(case, placement="cpu")), f)
    results = {}
    for label, model_dir in dirs.items():
        out = os.path.join(tmp, name, "run-" + label)
        proc = subprocess.run([zoffload, "train", "--config", config_path, "--model", model_dir, "--data", data_path,
                               "--steps", str(STEPS), "--seq-len", str(case["seq"]), "--seed", "7", "--out", out],
                              capture_output=True, text=True, env=ZO_ENV, timeout=600)
        if not expect(proc.returncode == 0, "%s: zoffload train on the %s directory exits 0: %s" %
                      (name, label, proc.stderr[-2000:])):
            return
        with open(os.path.join(out, "metrics.jsonl")) as f:
            steps = [json.loads(line) for line in f]
        export = AutoModelForCausalLM.from_pretrained(os.path.join(out, "hf-export-step-%d" % STEPS),
                                                      dtype=torch.float32)
        results[label] = ([(s["loss"], s["grad_norm"]) for s in steps], export.state_dict(), type(export).__name__)
    (mm_steps, mm_state, mm_class), (lm_steps, lm_state, _) = results["multimodal"], results["text"]
    expect(mm_steps == lm_steps and len(mm_steps) == STEPS, "%s: every step's loss and grad_norm are the text "
           "model's: %s vs %s" % (name, mm_steps, lm_steps))
    expect(mm_class == "Gemma3ForCausalLM" and sorted(mm_state) == sorted(lm_state) and
           all(torch.equal(mm_state[k], lm_state[k]) for k in lm_state),
           "%s: the export is the text model's (%s)" % (name, mm_class))
    print("  %d steps alike, losses %s" % (len(mm_steps), [round(l, 6) for l, _ in mm_steps]))


def main():
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    named = [n for n in os.environ.get("ZO_PARITY_CASES", "").split(",") if n]
    multimodal = not named or "gemma3-multimodal" in named  # check_multimodal_gemma3, not a CASES row
    only = [n for n in named if n != "gemma3-multimodal"]
    if not expect(set(only) <= {c["name"] for c in CASES}, "ZO_PARITY_CASES names known cases: %s" % named):
        report_and_exit()
    # Every family the binary trains has parity cases (a family added without them fails here).
    info = json.loads(subprocess.run([zoffload, "info", "--json"], check=True, capture_output=True, text=True).stdout)
    families = {f["model_type"] for f in info["model_families"]}
    covered = {c["arch"] for c in CASES}
    expect(families <= covered, "every family `zoffload info` lists has a parity case; none for %s" %
           sorted(families - covered))
    cases = [c for c in CASES if not named or c["name"] in only]
    if bnb is None:
        print("bitsandbytes is not installed (tools/requirements.txt pins it): the 8-bit case is left out")
        cases = [c for c in cases if c.get("moments") != "8bit"]
    print("transformers %s, torch %s, device %s (zoffload.device %s)" %
          (transformers.__version__, torch.__version__, DEVICE, ZO_DEVICE))
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="zo-hf-parity-", dir=os.environ.get("TMPDIR", "/tmp")) as tmp:
        for case in cases:
            run_case(case, tmp)
        if multimodal:
            check_multimodal_gemma3(tmp)
    print("%d cases in %.1f s" % (len(cases), time.time() - t0))
    report_and_exit()


main()

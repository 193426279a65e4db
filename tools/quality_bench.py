#!/usr/bin/env python3
"""Does a narrower optimizer state cost model quality? Trains one small llama on real English text
with `zoffload train` once per state-dtype variant, and once with transformers + bitsandbytes'
AdamW8bit beside them, on the same initial weights and the same batches, and reports the held-out
loss every --eval-every steps, the final losses against fp32 AdamW's, and a PNG of the curves.

The corpus is Debian's `fortunes` package (/usr/share/games/fortunes: English quotations, about
1.3 MB of text; `apt-get install fortunes`), byte-level tokens (vocabulary 256), the last
--held-out fraction of the bytes kept for evaluation. The model is a transformers LlamaConfig
initialised by transformers (seeded) and saved with save_pretrained; every zoffload run starts from
that directory, computes in fp32 (bf16 matmuls are slow on CPUs without AVX512-BF16) except for the
variants whose masters are bf16, which need bf16 compute and are compared with bf16-compute, keeps the
optimizer on the CPU (ZeRO stage 2), and saves a checkpoint every --eval-every steps, which is
exported with `zoffload export` and evaluated with transformers.

Variants (--variants, comma-separated; default all but hf-adamw):
  fp32              AdamW, fp32 moments and gradients: the baseline
  bf16-moments      zoffload.moment_dtype "bf16"
  8bit-moments      zoffload.moment_dtype "8bit" (bitsandbytes' AdamW8bit blockwise states)
  bf16-grads        zoffload.gradient_store_dtype "bf16" (each step's fp32 sum stored rounded)
  8bit+bf16-grads   both of the last two
  bf16-compute      bf16 compute, fp32 masters, moments and gradients: the baseline of the next two
  bf16-masters      bf16 compute, zoffload.master_dtype "bf16" (stochastic rounding)
  8bit+bf16-grads+bf16-masters
                    bf16 compute with all three narrowed: the smallest host footprint, what fits
                    an 8B model's optimizer states in a 64 GB host
  hf-bnb-8bit       transformers + bitsandbytes.optim.AdamW8bit (min_8bit_size 4096) with
                    clip_grad_norm_, the batches in zoffload's order (docs/training.md, Data)
  hf-adamw          transformers + torch.optim.AdamW (not by default): how far transformers' own
                    fp32 run is from zoffload's fp32 one (summation order alone)

Target (issue 43): every variant's final held-out loss within 1% of fp32 AdamW's (the report also
gives the bf16-compute variants against bf16-compute). With the defaults the nine runs take about
an hour and a half on a 2-core VM; the results are in docs/memory.md ("What the narrow states cost
in quality").

Usage: quality_bench.py --zoffload BUILD/tools/zoffload --out DIR [--steps 300] [--eval-every 25]
       [--variants ...] [--smoke]   (--smoke: a 4-layer model for 10 steps, to check the plumbing)
Needs: torch, transformers, safetensors, numpy (tools/requirements.txt), bitsandbytes for
hf-bnb-8bit, matplotlib for the PNG (without it the report says so and writes the JSON only)."""
import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time

import numpy as np

from data_order import epoch_permutation, write_llmc

FORTUNES = "/usr/share/games/fortunes"
ZOFFLOAD_VARIANTS = {
    "fp32": {},
    "bf16-moments": {"moment_dtype": "bf16"},
    "8bit-moments": {"moment_dtype": "8bit"},
    "bf16-grads": {"gradient_store_dtype": "bf16"},
    "8bit+bf16-grads": {"moment_dtype": "8bit", "gradient_store_dtype": "bf16"},
    "bf16-compute": {},
    "bf16-masters": {"master_dtype": "bf16"},
    "8bit+bf16-grads+bf16-masters": {"moment_dtype": "8bit", "gradient_store_dtype": "bf16", "master_dtype": "bf16"},
}
# The variants that compute in bf16 (bf16 masters need it), compared with BF16_BASE as well as fp32.
BF16_COMPUTE = ("bf16-compute", "bf16-masters", "8bit+bf16-grads+bf16-masters")
BF16_BASE = "bf16-compute"
HF_VARIANTS = ("hf-bnb-8bit", "hf-adamw")
BETAS, EPS, WEIGHT_DECAY, CLIP = (0.9, 0.95), 1e-8, 0.1, 1.0


def fail(msg):
    print("quality_bench: error: " + msg, file=sys.stderr)
    sys.exit(2)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--zoffload", required=True, help="the zoffload binary (BUILD/tools/zoffload)")
    p.add_argument("--out", required=True, help="a new or empty directory for the runs, results.json and quality.png")
    p.add_argument("--variants", default=",".join(list(ZOFFLOAD_VARIANTS) + ["hf-bnb-8bit"]),
                   help="comma-separated, of: %s (default: all but hf-adamw)" %
                   ", ".join(list(ZOFFLOAD_VARIANTS) + list(HF_VARIANTS)))
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--hidden", type=int, default=384)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=1024)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--held-out", type=float, default=0.05)
    p.add_argument("--eval-windows", type=int, default=64)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--smoke", action="store_true", help="a 4-layer model for 10 steps: check the plumbing only")
    a = p.parse_args()
    if a.smoke:
        a.steps, a.eval_every, a.layers, a.hidden, a.heads, a.intermediate, a.seq_len = 10, 5, 2, 128, 4, 256, 64
    a.variants = [v for v in a.variants.split(",") if v]
    unknown = [v for v in a.variants if v not in ZOFFLOAD_VARIANTS and v not in HF_VARIANTS]
    if unknown:
        fail("unknown variant(s) %s (known: %s)" % (unknown, ", ".join(list(ZOFFLOAD_VARIANTS) + list(HF_VARIANTS))))
    if a.steps % a.eval_every:
        fail("--steps %d is not a multiple of --eval-every %d (the last evaluation is the final one)" %
             (a.steps, a.eval_every))
    if not os.access(a.zoffload, os.X_OK):
        fail("--zoffload %s is not an executable" % a.zoffload)
    if os.path.exists(a.out) and os.listdir(a.out):
        fail("--out %s is not empty" % a.out)
    return a


# ---- data ------------------------------------------------------------------------------------------

def corpus_bytes():
    if not os.path.isdir(FORTUNES):
        fail("%s is missing: install Debian's fortunes package (apt-get install fortunes)" % FORTUNES)
    names = sorted(n for n in os.listdir(FORTUNES)
                   if "." not in n and os.path.isfile(os.path.join(FORTUNES, n)) and n not in ("art", "ascii-art"))
    text = bytearray()
    for n in names:
        with open(os.path.join(FORTUNES, n), "rb") as f:
            # One quotation per '%' line: the separators go, a blank line between quotations stays.
            text += b"".join(b"\n" if line.strip() == b"%" else line for line in f)
    if len(text) < 100_000:
        fail("%s holds only %d bytes of text" % (FORTUNES, len(text)))
    return bytes(text), names


def lr_at(a, t):
    """WarmupLR, linear from 0 (docs/training.md, Learning-rate schedules: N = max(2, warmup_num_steps))."""
    n = max(2, a.warmup)
    return a.lr * t / n if t < n else a.lr


# ---- model and evaluation ---------------------------------------------------------------------------

def save_model(a, model_dir):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=256, hidden_size=a.hidden, intermediate_size=a.intermediate,
                      num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
                      max_position_embeddings=a.seq_len, rms_norm_eps=1e-5, tie_word_embeddings=False,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    torch.manual_seed(a.seed)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(model_dir)
    return sum(p.numel() for p in model.parameters())


def eval_windows(a, held):
    t = a.seq_len
    n = min(a.eval_windows, (len(held) - 1) // t)
    if n < 8:
        fail("the held-out split holds %d windows of %d tokens; lower --seq-len or raise --held-out" % (n, t))
    return np.stack([held[w * t:w * t + t + 1] for w in range(n)]).astype(np.int64)


def eval_loss(model, windows):
    import torch
    import torch.nn.functional as F
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(windows), 8):
            x = torch.from_numpy(windows[i:i + 8])
            logits = model(input_ids=x[:, :-1], use_cache=False).logits
            loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1), reduction="sum")
            total += loss.item()
            count += x[:, 1:].numel()
    model.train()
    return total / count


def eval_dir(model_dir, windows):
    from transformers import AutoModelForCausalLM
    import torch
    return eval_loss(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), windows)


# ---- the runs ---------------------------------------------------------------------------------------

def zoffload_config(a, variant, ckpt_dir):
    return {
        "train_micro_batch_size_per_gpu": a.micro_batch, "gradient_accumulation_steps": 1,
        "gradient_clipping": CLIP, "steps_per_print": a.eval_every, "bf16": {"enabled": variant in BF16_COMPUTE},
        "optimizer": {"type": "AdamW", "params": {"lr": a.lr, "betas": list(BETAS), "eps": EPS,
                                                  "weight_decay": WEIGHT_DECAY}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": a.lr,
                                                     "warmup_num_steps": a.warmup, "warmup_type": "linear"}},
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": False}},
        "zoffload": dict({"device": "host", "checkpoint": {"dir": ckpt_dir, "every_steps": a.eval_every,
                                                           "keep_last": 0}}, **ZOFFLOAD_VARIANTS[variant]),
    }


def run_zoffload(a, variant, work, model_dir, train_bin, windows):
    run = os.path.join(work, variant)
    os.makedirs(run)
    ckpt = os.path.join(run, "checkpoints")
    cfg_path = os.path.join(run, "config.json")
    with open(cfg_path, "w") as f:
        json.dump(zoffload_config(a, variant, ckpt), f, indent=1)
    t0 = time.time()
    p = subprocess.run([a.zoffload, "train", "--config", cfg_path, "--model", model_dir, "--data", train_bin,
                        "--steps", str(a.steps), "--seq-len", str(a.seq_len), "--seed", str(a.seed),
                        "--out", os.path.join(run, "out")], capture_output=True, text=True)
    train_s = time.time() - t0
    with open(os.path.join(run, "train.log"), "w") as f:
        f.write(p.stdout + p.stderr)
    if p.returncode != 0:
        fail("%s: zoffload train exited %d: %s" % (variant, p.returncode, p.stderr[-2000:]))
    with open(os.path.join(run, "out", "metrics.jsonl")) as f:
        train_loss = {m["step"]: m["loss"] for m in map(json.loads, f)}
    evals = {}
    for step in range(a.eval_every, a.steps + 1, a.eval_every):
        export = os.path.join(run, "export")
        p = subprocess.run([a.zoffload, "export", "--checkpoint", os.path.join(ckpt, "step-%d" % step),
                            "--dtype", "fp32", "--out", export, "--tokenizer-from", "none", "-q"],
                           capture_output=True, text=True)
        if p.returncode != 0:
            fail("%s: zoffload export of step %d exited %d: %s" % (variant, step, p.returncode, p.stderr[-2000:]))
        evals[step] = eval_dir(export, windows)
        shutil.rmtree(export)
    shutil.rmtree(ckpt)  # fp32 masters and moments of every eval step: not worth keeping
    return {"train_loss": train_loss, "eval_loss": evals, "train_s": train_s}


def run_hf(a, variant, model_dir, train_tokens, windows):
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM
    torch.manual_seed(a.seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    if variant == "hf-bnb-8bit":
        import bitsandbytes as bnb
        opt = bnb.optim.AdamW8bit(model.parameters(), lr=a.lr, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY,
                                  min_8bit_size=4096)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    t = a.seq_len
    order = epoch_permutation((len(train_tokens) - 1) // t, a.seed, 0)
    train_loss, evals = {}, {}
    t0 = time.time()
    for step in range(a.steps):
        rows = np.stack([train_tokens[w * t:w * t + t + 1]
                         for w in order[step * a.micro_batch:(step + 1) * a.micro_batch]]).astype(np.int64)
        x = torch.from_numpy(rows)
        logits = model(input_ids=x[:, :-1], use_cache=False).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        for group in opt.param_groups:
            group["lr"] = lr_at(a, step)
        opt.step()
        opt.zero_grad(set_to_none=True)
        train_loss[step + 1] = loss.item()
        if (step + 1) % a.eval_every == 0:
            evals[step + 1] = eval_loss(model, windows)
    return {"train_loss": train_loss, "eval_loss": evals, "train_s": time.time() - t0}


# ---- the report -------------------------------------------------------------------------------------

def report(a, results, initial, meta):
    print("\nheld-out loss (mean cross-entropy per byte, %d windows of %d), initial %.4f:" %
          (meta["eval_windows"], a.seq_len, initial))
    base = results.get("fp32", {}).get("eval_loss", {}).get(a.steps)
    bf16_base = results.get(BF16_BASE, {}).get("eval_loss", {}).get(a.steps)
    print("  %-28s %10s %10s %6s %14s %10s" % ("variant", "final", "vs fp32", "≤ 1%", "vs " + BF16_BASE, "train s"))
    for name, r in results.items():
        final = r["eval_loss"][a.steps]
        rel = "" if base is None else "%+.3f%%" % (100 * (final - base) / base)
        ok = "" if base is None or name == "fp32" else ("yes" if abs(final - base) <= 0.01 * base else "NO")
        rel16 = ("%+.3f%%" % (100 * (final - bf16_base) / bf16_base)
                 if bf16_base is not None and name in BF16_COMPUTE and name != BF16_BASE else "")
        print("  %-28s %10.4f %10s %6s %14s %10.0f" % (name, final, rel, ok, rel16, r["train_s"]))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no PNG: matplotlib is not installed (pip install matplotlib); the curves are in results.json")
        return
    # Left: the whole run from the initial weights; right: its last two thirds, where the variants
    # would part.
    fig, (whole, tail) = plt.subplots(1, 2, figsize=(12, 5))
    start = a.steps // 3
    for name, r in results.items():
        steps = sorted(r["eval_loss"])
        whole.plot([0] + steps, [initial] + [r["eval_loss"][s] for s in steps], marker=".", label=name)
        late = [s for s in steps if s >= start]
        tail.plot(late, [r["eval_loss"][s] for s in late], marker=".", label=name)
    whole.set_title("%.1f M-parameter llama, fortunes corpus, %d x %d bytes a step" %
                    (meta["n_params"] / 1e6, a.micro_batch, a.seq_len), fontsize=10)
    tail.set_title("from step %d" % start, fontsize=10)
    for ax in (whole, tail):
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("held-out loss (nats per byte)")
        ax.grid(alpha=0.3)
    tail.legend()
    fig.tight_layout()
    path = os.path.join(a.out, "quality.png")
    fig.savefig(path, dpi=110)
    print("plot: %s" % path)


def main():
    a = parse_args()
    import transformers
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    os.makedirs(a.out, exist_ok=True)
    text, files = corpus_bytes()
    tokens = np.frombuffer(text, dtype=np.uint8).astype(np.uint16)
    cut = int(len(tokens) * (1 - a.held_out))
    train_tokens, held = tokens[:cut], tokens[cut:]
    windows = eval_windows(a, held)
    n_windows = (len(train_tokens) - 1) // a.seq_len
    if a.steps * a.micro_batch > n_windows:
        fail("%d steps x %d rows need %d windows, the training split has %d: the reference follows zoffload's "
             "first epoch only" % (a.steps, a.micro_batch, a.steps * a.micro_batch, n_windows))
    train_bin = os.path.join(a.out, "train.bin")
    write_llmc(train_bin, train_tokens)
    model_dir = os.path.join(a.out, "model")
    n_params = save_model(a, model_dir)
    initial = eval_dir(model_dir, windows)
    meta = {"corpus": FORTUNES, "files": files, "bytes": len(text), "train_tokens": int(cut),
            "eval_windows": len(windows), "n_params": n_params, "args": vars(a)}
    print("%s: %d files, %d bytes (%d for training, %d windows held out); model %.2f M parameters; initial "
          "held-out loss %.4f" % (FORTUNES, len(files), len(text), cut, len(windows), n_params / 1e6, initial))
    results = {}
    for v in a.variants:
        t0 = time.time()
        if v in ZOFFLOAD_VARIANTS:
            results[v] = run_zoffload(a, v, a.out, model_dir, train_bin, windows)
        else:
            results[v] = run_hf(a, v, model_dir, train_tokens, windows)
        r = results[v]
        print("%-18s final held-out loss %.4f, train loss %.4f (%.0f s)" %
              (v, r["eval_loss"][a.steps], r["train_loss"][a.steps], time.time() - t0), flush=True)
        with open(os.path.join(a.out, "results.json"), "w") as f:
            json.dump({"meta": meta, "initial_eval_loss": initial, "results": results}, f, indent=1)
    report(a, results, initial, meta)
    base = results.get("fp32", {}).get("eval_loss", {}).get(a.steps)
    if base is not None and not all(math.isfinite(r["eval_loss"][a.steps]) for r in results.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()

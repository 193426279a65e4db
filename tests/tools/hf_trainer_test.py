#!/usr/bin/env python3
"""transformers' Trainer is the oracle of the loss normalisation and the evaluation
(docs/training.md, "Loss normalisation" and "Evaluation during training").

A tiny llama saved by transformers is fine-tuned on chat-like JSONL (a masked prompt, then a
labelled reply, examples of uneven lengths, so every micro-batch has its own count of labelled
targets) by `zoffload train` and by transformers.Trainer itself (AdamW from torch, constant lr,
clipping, gradient accumulation 3), reading the same rows in the same order: zoffload with
`zoffload.data.shuffle` false, the Trainer with a sequential sampler. Each row is given to the
Trainer as zoffload reads it: the window's first T tokens as input_ids and its next-token labels
as `shift_labels`, which transformers' causal-LM loss and the Trainer's token count
(num_items_in_batch) take as they are.

- `zoffload.loss_normalization: "tokens"` against the Trainer as it is (since 4.46 it divides a
  step's summed token losses by the labelled tokens of the whole accumulation), with accumulators
  (horizontal schedule, optimizer on the CPU, clipping) and without them (vertical schedule,
  `gradient_accumulators: "none"`, optimizer on NVMe, no clipping): every step's loss and
  gradient norm, and the exported weights. Without clipping, the horizontal and vertical schedules
  with accumulators train the same bits as the run without them.
- the default "micro_batch" against the Trainer told its model takes no loss kwargs
  (model_accepts_loss_kwargs = False: the mean of the micro-batches' mean losses, DeepSpeed's rule).
  First the premise: on this data the two normalisations give step 1 losses that differ far beyond
  the tolerance, so neither comparison can pass with the other's rule.
- `--eval-data` with `--eval-every 2` against the Trainer's evaluation at the same steps
  (eval_strategy "steps"; eval_loss, the mean of the batches' mean losses) on the same held-out rows,
  the first --eval-batches micro-batches of the file; perplexity is exp(eval loss). The run with
  evaluation trains bit-identically to the same run without it (losses and exported bytes).

Usage: hf_trainer_test.py ZOFFLOAD SOURCE_DIR
Exit 77 (skip) when this Python lacks transformers, accelerate (the Trainer needs it) or torch."""
import json
import math
import os
import subprocess
import sys
import tempfile

from cli_checks import expect, report_and_exit

zoffload, source_dir = sys.argv[1], sys.argv[2]

try:
    import numpy as np
    import torch
    import transformers
    import accelerate  # noqa: F401 (transformers.Trainer imports it)
    from transformers import AutoModelForCausalLM, LlamaConfig, Trainer, TrainerCallback, TrainingArguments
except ImportError as e:
    print("SKIP: transformers' Trainer is not installed in %s (%s); tools/requirements.txt pins it" %
          (sys.executable, e))
    sys.exit(77)

ZO_ENV = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
torch.set_num_threads(1)

STEPS, GAS, MICRO, SEQ = 4, 3, 2, 16
VOCAB, HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS = 128, 64, 160, 2, 4, 2
LR, BETAS, EPS, CLIP = 2e-3, (0.9, 0.95), 1e-8, 1.0
EVAL_EVERY, EVAL_BATCHES = 2, 4
# The fp32 tolerances of hf_parity_test.py: the same arithmetic with reductions in another order.
# Weights: an element differs by at most 2e-5 of its tensor's largest, except that Adam turns the
# rounding noise of a gradient element that nearly cancels into an update difference of up to a
# few lr on that element (measured here: 1 element of 4096 in one tensor, 1.4e-5 apart, where the
# division by the labelled tokens is done once at the boundary (zoffload) and per micro-batch
# (transformers)). Such outliers are allowed, at most 1 in 1000 elements of a tensor and each
# within 2·lr·steps; a wrong normalisation moves most elements (checked as a premise).
TOL = {"loss": 1e-5, "grad_norm": 1e-5, "weights": 2e-5, "eval": 1e-5}
MAX_OUTLIERS = 1e-3


def rel(a, b):
    return abs(a - b) / max(abs(b), 1e-12)


def chat_stream(rng, n_tokens):
    """Examples of a masked prompt (2–24 tokens) and a labelled reply (1–12), concatenated."""
    ids, labels = [], []
    examples = []
    while len(ids) < n_tokens:
        prompt = rng.integers(0, VOCAB, size=int(rng.integers(2, 25))).tolist()
        reply = rng.integers(0, VOCAB, size=int(rng.integers(1, 13))).tolist()
        examples.append({"input_ids": prompt + reply, "labels": [-100] * len(prompt) + reply})
        ids += prompt + reply
        labels += [-100] * len(prompt) + reply
    return examples, ids, labels


def write_jsonl(path, examples):
    with open(path, "w") as f:
        for e in examples:
            f.write(json.dumps(e) + "\n")


def rows_of(ids, labels, n_rows):
    """zoffload's windows in file order: row w = tokens [wT, wT + T) with the labels of the tokens
    after them (docs/training.md, Packing)."""
    out = []
    for w in range(n_rows):
        x = torch.tensor(ids[w * SEQ:w * SEQ + SEQ], dtype=torch.long)
        y = torch.tensor(labels[w * SEQ + 1:w * SEQ + SEQ + 1], dtype=torch.long)
        out.append((x, y))
    return out


class Rows(torch.utils.data.Dataset):
    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        x, y = self.rows[i]
        # labels makes the model compute a loss and the Trainer count tokens; shift_labels are the
        # targets as they are (no second shift).
        return {"input_ids": x, "labels": y, "shift_labels": y}


class InOrder(Trainer):
    def _get_train_sampler(self, *args, **kwargs):
        return torch.utils.data.SequentialSampler(self.train_dataset)


class Capture(TrainerCallback):
    def __init__(self):
        self.steps, self.evals = [], {}

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.steps.append({"loss": logs["loss"], "grad_norm": logs.get("grad_norm")})

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        self.evals[state.global_step] = metrics["eval_loss"]


def hf_train(model_dir, work, train_rows, eval_rows, by_tokens, clip):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    args = TrainingArguments(
        output_dir=os.path.join(work, "hf-%s-%g" % (by_tokens, clip)), per_device_train_batch_size=MICRO,
        per_device_eval_batch_size=MICRO, gradient_accumulation_steps=GAS, max_steps=STEPS, learning_rate=LR,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, adam_beta1=BETAS[0], adam_beta2=BETAS[1],
        adam_epsilon=EPS, max_grad_norm=clip, optim="adamw_torch", logging_steps=1,
        eval_strategy="steps" if eval_rows else "no", eval_steps=EVAL_EVERY, save_strategy="no", report_to=[],
        use_cpu=True, remove_unused_columns=False, disable_tqdm=True, dataloader_num_workers=0, seed=0)
    capture = Capture()
    trainer = InOrder(model=model, args=args, train_dataset=Rows(train_rows),
                      eval_dataset=Rows(eval_rows) if eval_rows else None, callbacks=[capture])
    trainer.remove_callback(transformers.trainer_callback.PrinterCallback)  # its log dicts on stdout
    if not by_tokens:  # the Trainer before 4.46, and DeepSpeed's engine: each micro-batch's mean / GAS
        trainer.model_accepts_loss_kwargs = False
    trainer.train()
    return capture, {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def zo_config(normalization, placement, clip, direct=False, vertical=False):
    zero = {"stage": 3, "sub_group_size": 20000, "stage3_gather_16bit_weights_on_model_save": True,
            "stage3_param_persistence_threshold": 200, "stage3_prefetch_bucket_size": 30000}
    if placement == "cpu":
        zero["offload_param"] = {"device": "cpu"}
        zero["offload_optimizer"] = {"device": "cpu"}
    elif placement == "nvme":
        zero["offload_param"] = {"device": "nvme", "nvme_path": "nvme", "buffer_count": 4, "buffer_size": 40000}
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": "nvme"}
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS, "gradient_clipping": clip,
           "data_types": {"grad_accum_dtype": "fp32"},
           "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": 0.0}},
           "zero_optimization": zero,
           "zoffload": {"device": "host", "optimizer_threads": 1, "loss_normalization": normalization,
                        "data": {"shuffle": False}}}
    if direct or vertical:
        cfg["zoffload"]["schedule"] = "vertical"
    if direct:
        cfg["zoffload"]["gradient_accumulators"] = "none"
    return cfg


def zo_train(work, name, cfg, model_dir, data, eval_data=None):
    run = os.path.join(work, name)
    os.makedirs(run)
    cfg_path = os.path.join(run, "ds.json")
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    args = [zoffload, "train", "--config", cfg_path, "--model", model_dir, "--data", data, "--steps", str(STEPS),
            "--seq-len", str(SEQ), "--out", os.path.join(run, "out"), "--json"]
    if eval_data:
        args += ["--eval-data", eval_data, "--eval-every", str(EVAL_EVERY), "--eval-batches", str(EVAL_BATCHES)]
    p = subprocess.run(args, capture_output=True, text=True, env=ZO_ENV, timeout=300)
    if not expect(p.returncode == 0, "%s: zoffload train exits 0 (got %d): %s" % (name, p.returncode, p.stderr[-3000:])):
        return None
    with open(os.path.join(run, "out", "metrics.jsonl")) as f:
        steps = [json.loads(line) for line in f]
    export = os.path.join(run, "out", "hf-export-step-%d" % STEPS)
    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    with open(os.path.join(export, "model.safetensors"), "rb") as f:
        raw = f.read()
    return {"steps": steps, "state": state, "bytes": raw, "summary": json.loads(p.stdout)}


def weight_gap(state, ref):
    """(the worst tensor's name, its largest difference over its largest element, the largest
    fraction of a tensor's elements beyond TOL["weights"] of it, the largest difference)."""
    worst_name, worst, outliers, largest = "", 0.0, 0.0, 0.0
    for k, v in ref.items():
        scale = v.abs().max().clamp_min(1e-12).item()
        d = (state[k] - v).abs()
        if d.max().item() / scale > worst:
            worst_name, worst = k, d.max().item() / scale
        outliers = max(outliers, (d > TOL["weights"] * scale).float().mean().item())
        largest = max(largest, d.max().item())
    return worst_name, worst, outliers, largest


def check_weights(name, state, ref):
    if not expect(sorted(state) == sorted(ref), "%s: the export holds the Trainer model's tensors" % name):
        return
    worst_name, worst, outliers, largest = weight_gap(state, ref)
    print("  weights: worst %s %.2e of its largest, outliers %.2e of a tensor" % (worst_name, worst, outliers))
    expect(outliers <= MAX_OUTLIERS and largest <= 2 * LR * STEPS,
           "%s: exported weights differ from the Trainer's: %.2e of %s's elements beyond %.0e, worst %.2e (%.2e "
           "of its largest)" % (name, outliers, worst_name, TOL["weights"], largest, worst))


def compare(name, zo, capture, hf_state, labelled):
    if not expect(len(zo["steps"]) == STEPS and len(capture.steps) == STEPS,
                  "%s: %d zoffload and %d Trainer steps, expected %d" % (name, len(zo["steps"]), len(capture.steps),
                                                                         STEPS)):
        return
    print("  step  labelled  loss zoffload   Trainer        rel      grad_norm zoffload  Trainer        rel")
    for i, (z, h) in enumerate(zip(zo["steps"], capture.steps)):
        zn, hn = z["grad_norm"], h["grad_norm"]
        print("  %-4d  %-8d  %-15.9g %-14.9g %-8.1e %-19.9g %-14.9g %.1e" %
              (i + 1, labelled[i], z["loss"], h["loss"], rel(z["loss"], h["loss"]), zn, hn, rel(zn, hn)))
        expect(z["tokens"] == labelled[i], "%s step %d: tokens %d, labelled targets %d" %
               (name, i + 1, z["tokens"], labelled[i]))
        expect(rel(z["loss"], h["loss"]) <= TOL["loss"], "%s step %d: loss %.9g, Trainer %.9g" %
               (name, i + 1, z["loss"], h["loss"]))
        expect(rel(zn, hn) <= TOL["grad_norm"], "%s step %d: grad_norm %.9g, Trainer %.9g" % (name, i + 1, zn, hn))
    check_weights(name, zo["state"], hf_state)


def main():
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    print("transformers %s, torch %s, accelerate %s" % (transformers.__version__, torch.__version__,
                                                        accelerate.__version__))
    rng = np.random.default_rng(45)
    n_rows = STEPS * GAS * MICRO
    train_examples, ids, labels = chat_stream(rng, n_rows * SEQ + 1 + SEQ // 2)
    eval_examples, eval_ids, eval_labels = chat_stream(rng, EVAL_BATCHES * MICRO * SEQ + 1 + 3 * SEQ)
    train_rows = rows_of(ids, labels, n_rows)
    eval_rows = rows_of(eval_ids, eval_labels, EVAL_BATCHES * MICRO)
    per_micro = [sum(int((y != -100).sum()) for _, y in train_rows[m * MICRO:(m + 1) * MICRO])
                 for m in range(STEPS * GAS)]
    labelled = [sum(per_micro[s * GAS:(s + 1) * GAS]) for s in range(STEPS)]
    print("labelled targets per micro-batch: %s" % per_micro)
    expect(len(set(per_micro)) > 2, "the micro-batches have uneven labelled counts: %s" % per_micro)

    with tempfile.TemporaryDirectory(prefix="zo-hf-trainer-", dir=os.environ.get("TMPDIR", "/tmp")) as work:
        torch.manual_seed(45)
        model_dir = os.path.join(work, "model")
        cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                          num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                          max_position_embeddings=64, rms_norm_eps=1e-5, initializer_range=0.1,
                          tie_word_embeddings=False)
        AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(model_dir)
        data, eval_data = os.path.join(work, "train.jsonl"), os.path.join(work, "eval.jsonl")
        write_jsonl(data, train_examples)
        write_jsonl(eval_data, eval_examples)

        print("tokens: horizontal, optimizer on the CPU, clip %g, --eval-data every %d steps" % (CLIP, EVAL_EVERY))
        hf_tok, hf_tok_state = hf_train(model_dir, work, train_rows, eval_rows, True, CLIP)
        zo_tok = zo_train(work, "tokens", zo_config("tokens", "cpu", CLIP), model_dir, data, eval_data)
        print("micro_batch: nothing offloaded, clip %g" % CLIP)
        hf_mb, hf_mb_state = hf_train(model_dir, work, train_rows, None, False, CLIP)
        zo_mb = zo_train(work, "micro_batch", zo_config("micro_batch", "none", CLIP), model_dir, data)
        if zo_tok is None or zo_mb is None:
            report_and_exit()
        # The premise: the rules part at step 1 far beyond the tolerance.
        gap = rel(hf_tok.steps[0]["loss"], hf_mb.steps[0]["loss"])
        print("premise: step 1 loss by tokens %.9g, by micro-batch %.9g (rel %.2e)" %
              (hf_tok.steps[0]["loss"], hf_mb.steps[0]["loss"], gap))
        expect(gap > 100 * TOL["loss"], "the two normalisations differ on this data (rel %.2e)" % gap)
        _, _, apart, _ = weight_gap(hf_mb_state, hf_tok_state)
        print("premise: %.0f%% of a tensor's weights part between the two rules" % (100 * apart))
        expect(apart > 0.5, "the two normalisations train most weights apart (%.2e)" % apart)

        print("tokens:")
        compare("tokens", zo_tok, hf_tok, hf_tok_state, labelled)
        print("micro_batch:")
        compare("micro_batch", zo_mb, hf_mb, hf_mb_state, labelled)

        # The evaluations, at the Trainer's steps.
        zo_evals = {s["step"]: s["eval"] for s in zo_tok["steps"] if "eval" in s}
        expect(sorted(zo_evals) == sorted(hf_tok.evals) == list(range(EVAL_EVERY, STEPS + 1, EVAL_EVERY)),
               "evaluated after steps %s, the Trainer after %s" % (sorted(zo_evals), sorted(hf_tok.evals)))
        eval_tokens = sum(int((y != -100).sum()) for _, y in eval_rows)
        for step in sorted(set(zo_evals) & set(hf_tok.evals)):
            z, h = zo_evals[step], hf_tok.evals[step]
            print("  eval after step %d: loss %.9g, Trainer %.9g (rel %.1e), perplexity %.6g" %
                  (step, z["loss"], h, rel(z["loss"], h), z["perplexity"]))
            expect(rel(z["loss"], h) <= TOL["eval"], "eval after step %d: loss %.9g, Trainer %.9g" % (step, z["loss"], h))
            expect(rel(z["perplexity"], math.exp(z["loss"])) <= 1e-12, "eval after step %d: perplexity is exp(loss)" % step)
            expect(z["batches"] == EVAL_BATCHES and z["tokens"] == eval_tokens and z["runtime_s"] > 0,
                   "eval after step %d: %d batches, %d tokens (expected %d, %d), %s s" %
                   (step, z["batches"], z["tokens"], EVAL_BATCHES, eval_tokens, z["runtime_s"]))
        summary = zo_tok["summary"]["evals"]
        expect([e["step"] for e in summary] == sorted(zo_evals) and
               all(e["loss"] == zo_evals[e["step"]]["loss"] for e in summary),
               "--json lists the evaluations: %s" % summary)

        # Evaluation changes nothing the training computes.
        zo_plain = zo_train(work, "tokens-no-eval", zo_config("tokens", "cpu", CLIP), model_dir, data)
        if zo_plain is not None:
            same = ([s["loss"] for s in zo_plain["steps"]] == [s["loss"] for s in zo_tok["steps"]] and
                    zo_plain["bytes"] == zo_tok["bytes"])
            print("  without --eval-data: losses and exported bytes %s" % ("identical" if same else "DIFFER"))
            expect(same, "the run without --eval-data trains bit-identically to the run with it")

        print("tokens without accumulators: vertical, optimizer on NVMe, no clipping")
        hf_direct, hf_direct_state = hf_train(model_dir, work, train_rows, None, True, 0.0)
        zo_direct = zo_train(work, "tokens-direct", zo_config("tokens", "nvme", 0.0, direct=True), model_dir, data)
        if zo_direct is not None:
            # Without clipping the Trainer does not compute the norm: losses and weights only.
            for s in hf_direct.steps:
                s["grad_norm"] = None
            for i, (z, h) in enumerate(zip(zo_direct["steps"], hf_direct.steps)):
                print("  %-4d  loss %-15.9g Trainer %-15.9g rel %.1e" % (i + 1, z["loss"], h["loss"],
                                                                       rel(z["loss"], h["loss"])))
                expect(rel(z["loss"], h["loss"]) <= TOL["loss"], "tokens-direct step %d: loss %.9g, Trainer %.9g" %
                       (i + 1, z["loss"], h["loss"]))
            check_weights("tokens-direct", zo_direct["state"], hf_direct_state)
            # Note [Loss normalisation]: the same division in every path, so the schedules and the
            # path without accumulators train the same bits.
            for name, cfg in (("tokens-horizontal", zo_config("tokens", "nvme", 0.0)),
                              ("tokens-vertical", zo_config("tokens", "nvme", 0.0, vertical=True))):
                other = zo_train(work, name, cfg, model_dir, data)
                if other is not None:
                    same = ([s["loss"] for s in other["steps"]] == [s["loss"] for s in zo_direct["steps"]] and
                            other["bytes"] == zo_direct["bytes"])
                    print("  %s with accumulators: losses and exported bytes %s" %
                          (name, "identical" if same else "DIFFER"))
                    expect(same, "%s trains bit-identically to the run without accumulators" % name)
    report_and_exit()


main()

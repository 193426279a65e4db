#!/usr/bin/env python3
"""Every config under configs/ (Accelerate's included) trains for a few steps with `zoffload train`
on the tiny model, given only the flags that fill "auto" (the HF Trainer's arguments), and `zoffload
config check` accepts it with the same flags: the two read a config the same way. A config that
leaves the micro-batch to the command line fails without --micro-batch with one line naming the
flag, and a flag that disagrees with the file is refused naming both.

The only edit to a file is its nvme_path where that is an absolute path of the machine it was
written for (/mnt/nvme/...): it is pointed into the run directory."""
import json
import math
import os
import subprocess
import sys
import tempfile

from cli_checks import expect, report_and_exit

zoffload, source_dir = sys.argv[1], sys.argv[2]
configs_dir = os.path.join(source_dir, "configs")
corpus = os.path.join(configs_dir, "data", "demo_corpus.txt")

# The flags each config needs: exactly its "auto" keys the model cannot fill (the tiny model fills
# the hidden-size buckets, --steps the scheduler's total_num_steps).
FLAGS = {
    "bench_1b_nvme.json": [],
    "llama13b_24gb_nvme.json": [],
    "llama8b_24gb_8bit_ram.json": [],
    "llama8b_24gb_exact_ram.json": [],
    "llama8b_24gb_optimizer_cpu.json": [],
    "llama70b_qlora_24gb.json": [],
    "llama8b_lora_24gb.json": [],
    "stage2_cpu_offload.json": [],
    "tiny_demo_nvme.json": [],
    "accelerate/zero_stage2_config.json": ["--micro-batch", "2", "--lr", "3e-4", "--weight-decay", "0.01",
                                           "--warmup-steps", "1"],
    "accelerate/zero_stage3_offload_config.json": ["--micro-batch", "2", "--lr", "3e-4", "--weight-decay", "0.01",
                                                   "--warmup-steps", "1"],
}
STEPS = "2"
# Tokens per sequence: the configs' batches (up to 32 sequences a step) in bf16, which CPUs without
# native bf16 multiply on a slow path; what is checked is how the config is read, not the model.
SEQ_LEN = 8


def run(*args, timeout=600):
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))
    return subprocess.run([zoffload, *args], capture_output=True, text=True, timeout=timeout, env=env)


def localized(path, tmp):
    """The config with an absolute nvme_path pointed into the run directory; else the file itself."""
    with open(path) as f:
        cfg = json.load(f)
    changed = False
    zero = cfg.get("zero_optimization", {})
    for key in ("offload_param", "offload_optimizer"):
        section = zero.get(key)
        if isinstance(section, dict) and str(section.get("nvme_path", "")).startswith("/"):
            section["nvme_path"] = "zoffload-nvme"
            changed = True
    if not changed:
        return path
    out = os.path.join(tmp, os.path.basename(path))
    with open(out, "w") as f:
        json.dump(cfg, f)
    return out


found = sorted(os.path.relpath(os.path.join(d, f), configs_dir)
               for d, _, files in os.walk(configs_dir) for f in files if f.endswith(".json"))
expect(found == sorted(FLAGS), "configs/ holds %s; this test knows %s (add new configs here)" % (found, sorted(FLAGS)))

with tempfile.TemporaryDirectory() as tmp:
    for name in sorted(FLAGS):
        path = os.path.join(configs_dir, name)
        if not os.path.exists(path):
            continue
        cfg = localized(path, tmp)
        flags = FLAGS[name]
        out = os.path.join(tmp, name.replace("/", "_") + ".run")
        r = run("train", "--config", cfg, "--model", "tiny", "--data", corpus, "--steps", STEPS,
                "--seq-len", str(SEQ_LEN), "--out", out, "--json", *flags)
        if not expect(r.returncode == 0, "%s: train exit %d: %s" % (name, r.returncode, r.stderr.strip()[-600:])):
            continue
        summary = json.loads(r.stdout)
        expect(summary["steps"] == int(STEPS) and math.isfinite(summary["last_loss"]),
               "%s: summary %s" % (name, summary))
        with open(summary["metrics_path"]) as f:
            lines = [json.loads(l) for l in f if l.strip()]
        expect(len(lines) == int(STEPS), "%s: %d metrics lines" % (name, len(lines)))
        # config check with the same flags (and what the model and --steps give train) resolves it
        # to what the run did: the batch it trained on, and its lr where the schedule says.
        c = run("config", "check", cfg, "--hidden-size", "256", "--steps", STEPS, *flags)
        if not expect(c.returncode == 0, "%s: config check exit %d: %s" % (name, c.returncode, c.stderr.strip())):
            continue
        resolved = json.loads(c.stdout)
        per_step = resolved["train_micro_batch_size_per_gpu"] * resolved["gradient_accumulation_steps"] * SEQ_LEN
        expect(all(l["tokens"] == per_step for l in lines),
               "%s: tokens per step %s, config check resolves micro x accumulation x seq = %d" %
               (name, [l["tokens"] for l in lines], per_step))
        sched = resolved.get("scheduler") or {}
        if sched.get("type") in ("WarmupLR", "WarmupDecayLR") and sched["params"]["warmup_num_steps"] <= 1:
            # Warm-up of max(2, N) = 2 steps: step 1 at warmup_min_lr, step 2 at warmup_max_lr.
            want = [sched["params"]["warmup_min_lr"], sched["params"]["warmup_max_lr"]]
            expect([l["lr"] for l in lines] == want,
                   "%s: lr per step %s, config check resolves %s" % (name, [l["lr"] for l in lines], want))
        print("%-45s trained %s steps, loss %.4f -> %.4f, %s" % (name, STEPS, summary["first_loss"],
                                                              summary["last_loss"], " ".join(flags) or "no flags"))

    # Without the micro-batch flag Accelerate's config stops at start, naming the flag.
    acc = os.path.join(configs_dir, "accelerate", "zero_stage3_offload_config.json")
    r = run("train", "--config", acc, "--model", "tiny", "--data", corpus, "--steps", STEPS, "--out",
            os.path.join(tmp, "nomicro"))
    # One error line; the file's keys with no effect here (overlap_comm, contiguous_gradients) are
    # warned about before it.
    errors = [l for l in r.stderr.strip().splitlines() if ": warning: " not in l]
    expect(r.returncode == 2 and "--micro-batch" in r.stderr and len(errors) == 1,
           "no --micro-batch: exit %d, %r" % (r.returncode, r.stderr))
    # A flag that disagrees with the file's value is refused, naming the key and the flag.
    demo = os.path.join(configs_dir, "tiny_demo_nvme.json")
    r = run("train", "--config", demo, "--model", "tiny", "--data", corpus, "--steps", STEPS, "--lr", "1e-3",
            "--out", os.path.join(tmp, "disagree"))
    expect(r.returncode == 2 and "optimizer.params.lr: 3e-04 in the config disagrees with --lr 0.001" in r.stderr,
           "disagreeing --lr: exit %d, %r" % (r.returncode, r.stderr))
    expect(not os.path.exists(os.path.join(tmp, "disagree", "metrics.jsonl")), "a refused run wrote metrics")

report_and_exit()

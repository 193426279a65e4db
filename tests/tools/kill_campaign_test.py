#!/usr/bin/env python3
"""A kill campaign over the features that write state together: evaluation during training, LoRA
adapters over a frozen base, narrow optimizer states (8-bit and bf16 moments), the optimizer on
NVMe, a checkpoint every step. Each campaign first trains its config uninterrupted, then trains it
again under SIGKILL at seeded random moments (a third during the start, the others just after a
metrics record: in a step, an evaluation or a save), each time resuming with `--resume latest`, until a run ends by itself. Then:

- every metrics record written under the campaign (a step trained twice, before a kill and after
  the resume, has two) equals the uninterrupted run's record of that step bit for bit: loss,
  gradient norm, lr, tokens and the evaluation's loss;
- the final checkpoint's state files are byte-identical to the uninterrupted run's, and `ckpt
  verify` accepts every checkpoint left;
- no tmp directory outlives the next start.

Usage: kill_campaign_test.py ZOFFLOAD SOURCE_DIR [KILLS_PER_CAMPAIGN]"""
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

from cli_checks import expect, report_and_exit

zoffload, source_dir = sys.argv[1], sys.argv[2]
kills_wanted = int(sys.argv[3]) if len(sys.argv) > 3 else 8
corpus = os.path.join(source_dir, "configs", "data", "demo_corpus.txt")
ENV = dict(os.environ, OMP_NUM_THREADS="1")
STEPS = 24
RECORD_KEYS = ("step", "loss", "grad_norm", "lr", "skipped", "tokens")


def config(moments, lora, optimizer):
    zero = {"stage": 3, "sub_group_size": 200000, "offload_param": {"device": "cpu"},
            "offload_optimizer": {"device": optimizer, "nvme_path": "nvme"}}
    z = {"device": "host", "optimizer_threads": 1, "moment_dtype": moments, "schedule": "vertical",
         "checkpoint": {"dir": "ckpt", "every_steps": 1, "keep_last": 2}}
    if lora:
        z["lora"] = lora
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 2e-3, "weight_decay": 0.01}},
            "scheduler": {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 3, "total_num_steps": STEPS}},
            "zero_optimization": zero, "zoffload": z}


CAMPAIGNS = [
    ("lora-8bit-nvme", config("8bit", {"r": 16, "lora_alpha": 32, "target_modules": ["all-linear"]}, "nvme")),
    ("full-bf16-moments-cpu", config("bf16", None, "cpu")),
]


def command(cfg, out, resume):
    return [zoffload, "train", "--config", cfg, "--model", "tiny", "--data", corpus, "--eval-data", corpus,
            "--eval-every", "3", "--eval-batches", "2", "--seq-len", "32", "--steps", str(STEPS), "--seed", "3",
            "--out", out, "-q"] + (["--resume", "latest"] if resume else [])


def records(out):
    path = os.path.join(out, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    out_records = []
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            key = {k: r[k] for k in RECORD_KEYS}
            key["eval"] = r["eval"]["loss"] if r.get("eval") else None
            out_records.append(key)
    return out_records


def lines_written(out):
    """Complete lines in the metrics file so far (read while the run appends to it)."""
    path = os.path.join(out, "metrics.jsonl")
    if not os.path.exists(path):
        return 0
    with open(path, "rb") as f:
        return f.read().count(b"\n")


def state_bytes(step_dir):
    return {name: open(os.path.join(step_dir, name), "rb").read() for name in sorted(os.listdir(step_dir))
            if name.endswith(".safetensors") or name.endswith(".codes")}


def campaign(name, cfg_json, tmp, rng):
    cfg = os.path.join(tmp, name + ".json")
    with open(cfg, "w") as f:
        json.dump(cfg_json, f)
    ref_out = os.path.join(tmp, name + "-reference")
    p = subprocess.run(command(cfg, ref_out, False), capture_output=True, text=True, env=ENV, timeout=900)
    if not expect(p.returncode == 0, "%s: the uninterrupted run: %s" % (name, p.stderr[-1500:])):
        return
    reference = {r["step"]: r for r in records(ref_out)}
    expect(len(reference) == STEPS and sum(r["eval"] is not None for r in reference.values()) == STEPS // 3,
           "%s: the reference has %d steps and an evaluation every 3" % (name, len(reference)))

    out = os.path.join(tmp, name)
    kills, starts = 0, 0
    while True:
        resume = os.path.exists(os.path.join(out, "ckpt", "latest"))
        proc = subprocess.Popen(command(cfg, out, resume), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=ENV)
        starts += 1
        if kills < kills_wanted:
            # A third of the kills land during the start; the others in the training after the next
            # metrics record (a step, its evaluation or its save, which every step makes).
            if rng.random() < 1 / 3:
                deadline = time.time() + rng.uniform(0.2, 1.5)
            else:
                before = lines_written(out)
                while proc.poll() is None and lines_written(out) <= before:
                    time.sleep(0.01)
                deadline = time.time() + rng.uniform(0.0, 0.3)
            try:
                proc.wait(timeout=max(0.0, deadline - time.time()))
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGKILL)
                kills += 1
        _, err = proc.communicate(timeout=900)
        if proc.returncode == 0:
            break
        if not expect(proc.returncode == -signal.SIGKILL, "%s: start %d ends by the kill, not %d: %s" %
                      (name, starts, proc.returncode, err[-1500:])):
            return
        if not expect(starts < 4 * kills_wanted + 10, "%s: the campaign ends" % name):
            return
    got = records(out)
    bad = [r for r in got if reference.get(r["step"]) != r]
    print("%s: %d starts, %d kills, %d records (%d steps trained again after a kill), %d differ" %
          (name, starts, kills, len(got), len(got) - STEPS, len(bad)))
    expect(not bad, "%s: every record equals the uninterrupted run's: %s vs %s" %
           (name, bad[:1], [reference.get(b["step"]) for b in bad[:1]]))
    expect({r["step"] for r in got} == set(reference), "%s: every step is recorded" % name)
    final = "step-%d" % STEPS
    same = state_bytes(os.path.join(out, "ckpt", final)) == state_bytes(os.path.join(ref_out, "ckpt", final))
    expect(same, "%s: the final state files are byte-identical to the uninterrupted run's" % name)
    left = sorted(os.listdir(os.path.join(out, "ckpt")))
    expect(all(n in (".zoffload.lock", "latest") or n.startswith("step-") for n in left),
           "%s: no tmp directory left: %s" % (name, left))
    for n in left:
        if n.startswith("step-"):
            v = subprocess.run([zoffload, "ckpt", "verify", os.path.join(out, "ckpt", n), "-q"], capture_output=True,
                               text=True)
            expect(v.returncode == 0, "%s: %s verifies: %s" % (name, n, v.stderr[-600:]))


def main():
    rng = random.Random(60)
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="zo-kill-", dir=os.environ.get("TMPDIR", "/tmp")) as tmp:
        for name, cfg in CAMPAIGNS:
            t = time.time()
            campaign(name, cfg, tmp, rng)
            print("%s: %.1f s" % (name, time.time() - t))
    print("%.1f s in all" % (time.time() - t0))
    report_and_exit()


main()

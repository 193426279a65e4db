#!/usr/bin/env python3
"""DeepSpeed's monitor blocks as a user runs them: `zoffload train` with `tensorboard` and
`csv_monitor` enabled writes TensorBoard event files and CSV files that the reference readers
(TensorBoard's own EventAccumulator, Python's csv) read back with the same values as
metrics.jsonl, under DeepSpeed's tag names, with samples as the x axis; a resumed run continues
them (a new event file, CSV rows appended under one header) and metrics.jsonl. The runs evaluate
held-out data (--eval-data) after steps 2 and 4: those records' "eval" figures go under
transformers' tags (eval/loss, ...) at the same x. Skips (77) where the
build writes event files but the tensorboard package, their reader, is not importable.

usage: monitors_cli_test.py ZOFFLOAD SOURCE_DIR"""
import csv
import glob
import json
import math
import os
import subprocess
import sys
import tempfile

from cli_checks import expect, report_and_exit

zoffload, source_dir = sys.argv[1], sys.argv[2]
corpus = os.path.join(source_dir, "configs", "data", "demo_corpus.txt")

info = json.loads(subprocess.run([zoffload, "info", "--json"], capture_output=True, text=True, check=True).stdout)
have_protobuf = info["build"]["protobuf"]
try:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
except ImportError as e:  # a PyTorch environment of the user's own, without tools/requirements.txt
    EventAccumulator = None
    if have_protobuf:
        # The event files are what this test is for: without their reader it would check nothing
        # of them and pass. Skip instead, visibly.
        print("skip: TensorBoard's event files cannot be read back: the tensorboard package "
              "(tools/requirements.txt) is not importable here: %s" % e)
        sys.exit(77)

with open(os.path.join(source_dir, "configs", "tiny_demo_nvme.json")) as f:
    config = json.load(f)
config["tensorboard"] = {"enabled": True, "output_path": "tb", "job_name": "demo"}
config["csv_monitor"] = {"enabled": True, "output_path": "csv", "job_name": "demo"}
config["zoffload"]["checkpoint"] = {"dir": "ckpt", "every_steps": 2}
config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = False  # no export at the end


def flatten(record):
    """{tag: value} as Note [Monitor tags] says: Train/Samples/<key>, nested keys joined with "/",
    loss as train_loss, booleans as 0/1, nulls left out, step left out (it is the x axis); the
    evaluation's keys as eval/<key>."""
    out = {}

    def walk(v, name):
        if isinstance(v, dict):
            for k, sub in v.items():
                walk(sub, name + "/" + k if name else k)
        elif isinstance(v, bool):
            out["Train/Samples/" + name] = 1.0 if v else 0.0
        elif isinstance(v, (int, float)):
            out[name if name.startswith("eval/") else "Train/Samples/" + ("train_loss" if name == "loss" else name)] = \
                float(v)

    for k, v in record.items():
        if k != "step":
            walk(v, k)
    return out


with tempfile.TemporaryDirectory(dir=os.environ.get("MESON_BUILD_ROOT")) as tmp:
    cfg = os.path.join(tmp, "ds.json")
    if not have_protobuf:
        with open(cfg, "w") as f:
            json.dump(config, f)
        p = subprocess.run([zoffload, "config", "check", cfg, "-q"], capture_output=True, text=True)
        expect(p.returncode == 2 and "tensorboard.enabled: this zoffload was built without protobuf" in p.stderr,
               "a build without protobuf refuses tensorboard.enabled at check time: %s" % p.stderr)
        config["tensorboard"]["enabled"] = False
    with open(cfg, "w") as f:
        json.dump(config, f)
    run = os.path.join(tmp, "run")
    # 32-token sequences: the demo config's bf16 is slow on CPUs without native bf16, and the
    # monitors' files are the same at any length.
    base = [zoffload, "train", "--config", cfg, "--model", "tiny", "--data", corpus, "--out", run, "-q", "--seq-len", "32",
            "--eval-data", corpus, "--eval-batches", "2"]
    # --eval-every and --eval-batches mean nothing without --eval-data: a usage error.
    p = subprocess.run([zoffload, "train", "--config", cfg, "--model", "tiny", "--data", corpus, "--out", run,
                        "--steps", "1", "--eval-every", "2"], capture_output=True, text=True, timeout=60)
    expect(p.returncode != 0 and "--eval-every requires --eval-data" in p.stderr,
           "--eval-every without --eval-data is refused: %d %s" % (p.returncode, p.stderr[-500:]))
    p = subprocess.run(base + ["--steps", "2"], capture_output=True, text=True, timeout=600)
    expect(p.returncode == 0, "the first run trains: %s" % p.stderr[-2000:])
    p = subprocess.run(base + ["--steps", "4", "--resume", "latest"], capture_output=True, text=True, timeout=600)
    expect(p.returncode == 0, "the resumed run trains: %s" % p.stderr[-2000:])

    with open(os.path.join(run, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    expect([r["step"] for r in records] == [1, 2, 3, 4], "metrics.jsonl holds steps 1-4: %s" % [r["step"] for r in records])
    batch = 4 * 2  # the demo's micro-batch × accumulation (× world size 1): DeepSpeed's samples per step
    want = {}  # tag -> [(samples, value)]
    for r in records:
        for tag, value in flatten(r).items():
            want.setdefault(tag, []).append((r["step"] * batch, value))
    for tag in ("Train/Samples/train_loss", "Train/Samples/lr", "Train/Samples/loss_scale", "Train/Samples/grad_norm",
                "Train/Samples/tokens_per_s", "Train/Samples/time_s/compute", "Train/Samples/overlap",
                "eval/loss", "eval/perplexity", "eval/tokens", "eval/runtime_s"):
        expect(tag in want, "the record gives %s" % tag)
    expect([s for s, _ in want.get("eval/loss", [])] == [2 * batch, 4 * batch],
           "the evaluations after steps 2 and 4 (the end of each run): %s" % want.get("eval/loss"))

    # CSV, read with Python's csv module.
    csv_dir = os.path.join(run, "csv", "demo")
    files = sorted(os.listdir(csv_dir)) if os.path.isdir(csv_dir) else []
    expect(len(files) == len(want), "one CSV file per tag: %d files, %d tags" % (len(files), len(want)))
    for tag, points in want.items():
        path = os.path.join(csv_dir, tag.replace("/", "_").replace(" ", "_") + ".csv")
        if not expect(os.path.exists(path), "CSV file for %s" % tag):
            continue
        with open(path, newline="") as f:
            rows = list(csv.reader(f))
        expect(rows[0] == ["step", tag.split("/")[-1]], "%s: DeepSpeed's header, once: %s" % (path, rows[0]))
        got = [(int(s), float(v)) for s, v in rows[1:]]
        expect(got == points, "%s holds metrics.jsonl's values exactly: %s vs %s" % (tag, got, points))

    # TensorBoard, read with TensorBoard's own loader.
    if have_protobuf and EventAccumulator is not None:
        tb_dir = os.path.join(run, "tb", "demo")
        event_files = glob.glob(os.path.join(tb_dir, "events.out.tfevents.*"))
        expect(len(event_files) == 2, "one event file per run (the resumed run adds one): %s" % event_files)
        acc = EventAccumulator(tb_dir, size_guidance={"scalars": 0})
        acc.Reload()
        tags = set(acc.Tags()["scalars"])
        expect(tags == set(want), "TensorBoard sees the record's tags: missing %s, extra %s"
               % (sorted(set(want) - tags), sorted(tags - set(want))))
        for tag, points in want.items():
            if tag not in tags:
                continue
            got = [(e.step, e.value) for e in acc.Scalars(tag)]
            ok = len(got) == len(points) and all(
                gs == ws and (gv == wv or math.isclose(gv, wv, rel_tol=1e-6, abs_tol=1e-30)) for (gs, gv), (ws, wv) in zip(got, points))
            expect(ok, "%s in TensorBoard equals metrics.jsonl (float32): %s vs %s" % (tag, got, points))

report_and_exit()

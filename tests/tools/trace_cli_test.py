#!/usr/bin/env python3
"""`zoffload train --trace FILE --trace-steps A-B` as a user runs it: the file is Chrome trace JSON
(what Perfetto opens) with one named track per stream of work; every span has a non-negative start
and duration, spans on a track nest and never partly overlap, only the chosen steps are traced, and
every block of the model (its count read from the run's own Hugging Face export) is computed,
forward and backward, and fetched inside each traced step, and the device copies gradients D2H in
each and parameters H2D; the gradient worker, the optimizer, NVMe reads and writes and the checkpoint have spans. Bad --trace-steps are one line and exit 2; so is a --trace that names a directory
or a path under a file, refused before the run starts with the user's files untouched; an earlier
trace file is replaced.

usage: trace_cli_test.py ZOFFLOAD SOURCE_DIR"""
import json
import os
import subprocess
import sys
import tempfile

from cli_checks import expect, report_and_exit

zoffload, source_dir = sys.argv[1], sys.argv[2]
corpus = os.path.join(source_dir, "configs", "data", "demo_corpus.txt")
EPS_US = 0.002  # the file's times are microseconds with three decimals: whole nanoseconds

with open(os.path.join(source_dir, "configs", "tiny_demo_nvme.json")) as f:
    config = json.load(f)
config["zoffload"]["checkpoint"] = {"dir": "ckpt", "every_steps": 2}
# Sub-groups of 200k elements (16 of them) stepped by one optimizer thread: the next step's first
# forward waits for its block's sub-groups only, so the overlap checked below has the other 15
# updates to happen in, and a core left for the forward; with the demo's four sub-groups on every
# core, a forward thread starved on a loaded 2-core machine could start after the last one.
config["zero_optimization"]["sub_group_size"] = 200000
config["zoffload"]["optimizer_threads"] = 1

with tempfile.TemporaryDirectory(dir=os.environ.get("MESON_BUILD_ROOT")) as tmp:
    cfg = os.path.join(tmp, "ds.json")
    with open(cfg, "w") as f:
        json.dump(config, f)
    run = os.path.join(tmp, "run")
    trace_path = os.path.join(tmp, "steps.json")
    # 32-token sequences: the demo config's bf16 is slow on CPUs without native bf16, and every
    # span is there at any length.
    base = [zoffload, "train", "--config", cfg, "--model", "tiny", "--data", corpus, "--out", run, "--steps", "3",
            "--seq-len", "32"]

    for bad, needle in [(["--trace", trace_path, "--trace-steps", "3-2"], "--trace-steps: expected A-B or A"),
                        (["--trace", trace_path, "--trace-steps", "0"], "--trace-steps: expected A-B or A"),
                        (["--trace-steps", "2-3"], "--trace-steps needs --trace FILE")]:
        p = subprocess.run(base + bad, capture_output=True, text=True, timeout=120)
        expect(p.returncode == 2 and needle in p.stderr and len(p.stderr.splitlines()) == 1,
               "%s is refused in one line: exit %d: %s" % (bad, p.returncode, p.stderr))

    # Issue 40: `--trace v`, v a directory of the user's, once left v replaced by the trace (exit 0),
    # and under a regular file failed only after training, having removed the target first. Both
    # are refused before the run starts, in one line, and nothing of the user's is touched.
    v = os.path.join(tmp, "v")
    os.makedirs(os.path.join(v, "sub"))
    with open(os.path.join(v, "important.txt"), "w") as f:
        f.write("keep\n")
    with open(os.path.join(tmp, "notes.txt"), "w") as f:
        f.write("mine\n")
    for target, needle in [(v, "--trace %s is a directory" % v),
                           (os.path.join(tmp, "notes.txt", "t.json"), "notes.txt is not a directory")]:
        p = subprocess.run(base + ["--trace", target], capture_output=True, text=True, timeout=120)
        expect(p.returncode == 2 and needle in p.stderr and len(p.stderr.splitlines()) == 1,
               "--trace %s is refused at start in one line: exit %d: %s" % (target, p.returncode, p.stderr[-1000:]))
        expect(not os.path.exists(run), "--trace %s: refused before the run starts (no %s)" % (target, run))
    with open(os.path.join(v, "important.txt")) as f, open(os.path.join(tmp, "notes.txt")) as g:
        expect(f.read() == "keep\n" and os.path.isdir(os.path.join(v, "sub")) and g.read() == "mine\n",
               "the user's directory and file are as they were")

    # An earlier trace (a file) is replaced whole.
    with open(trace_path, "w") as f:
        f.write("an earlier trace")
    p = subprocess.run(base + ["--trace", trace_path, "--trace-steps", "2-3"], capture_output=True, text=True, timeout=600)
    if not expect(p.returncode == 0, "the traced run trains: %s" % p.stderr[-2000:]):
        report_and_exit()
    expect("trace: " in p.stderr and trace_path in p.stderr, "the run says where the trace went: %s" % p.stderr[-500:])
    with open(os.path.join(run, "hf-export-step-3", "config.json")) as f:
        n_layers = json.load(f)["num_hidden_layers"]
    blocks = ["model.embed_tokens"] + ["model.layers.%d" % i for i in range(n_layers)] + ["model.norm+lm_head"]

    with open(trace_path) as f:
        trace = json.load(f)  # valid JSON
    events = trace["traceEvents"]
    tracks = {e["tid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "thread_name"}
    expect(set(tracks.values()) >= {"step", "compute", "fetch wait (NVMe, H2D)", "gradient offload (D2H)",
                                    "gradient worker", "optimizer", "NVMe reads", "NVMe writes", "checkpoint",
                                    "H2D copies (device)", "D2H copies (device)", "compute (device)"},
           "one named track per stream of work: %s" % sorted(tracks.values()))
    spans = [e for e in events if e.get("ph") == "X"]
    by_track = {}
    for e in spans:
        ok = e["tid"] in tracks and e["ts"] >= 0 and e["dur"] >= 0 and isinstance(e["name"], str) and e["name"]
        expect(ok, "a span on a named track with a non-negative start and duration: %s" % e)
        by_track.setdefault(tracks.get(e["tid"]), []).append(e)
    # Every named track has spans, but those of work between ranks: this run is one process.
    for name in sorted(set(tracks.values()) - set(by_track) - {"collectives", "parameter gatherer"}):
        expect(False, "the named track %s has no span" % name)
    for name, track in sorted(by_track.items()):
        stack, nested = [], True
        for e in sorted(track, key=lambda e: (e["ts"], -e["dur"])):
            end = e["ts"] + e["dur"]
            while stack and stack[-1] <= e["ts"] + EPS_US:
                stack.pop()
            if stack and end > stack[-1] + EPS_US:
                nested = False
                expect(False, "%s: %s [%.3f, %.3f] partly overlaps an enclosing span ending at %.3f"
                       % (name, e["name"], e["ts"], end, stack[-1]))
                break
            stack.append(end)
        expect(nested, "spans on %s nest" % name)
    for name in ("gradient worker", "optimizer", "NVMe reads", "NVMe writes", "checkpoint", "gradient offload (D2H)"):
        expect(len(by_track.get(name, [])) > 0, "the %s track has spans" % name)

    steps = sorted(by_track.get("step", []), key=lambda e: e["ts"])
    expect([e["name"] for e in steps] == ["step 2", "step 3"], "only steps 2-3 are traced: %s" % [e["name"] for e in steps])
    compute = by_track.get("compute", [])
    fetch = by_track.get("fetch wait (NVMe, H2D)", [])
    for step in steps:
        lo, hi = step["ts"] - EPS_US, step["ts"] + step["dur"] + EPS_US
        inside = lambda track: {e["name"] for e in track if e["ts"] >= lo and e["ts"] + e["dur"] <= hi}
        done = inside(compute)
        on_device = inside(by_track.get("compute (device)", []))
        for b in blocks:
            if b == "model.norm+lm_head":
                expect("forward and backward of " + b in done, "%s computes the head" % step["name"])
            else:
                expect("forward of " + b in done, "%s runs the forward of %s" % (step["name"], b))
                expect("backward of " + b in done, "%s runs the backward of %s" % (step["name"], b))
                expect({"forward of " + b, "backward of " + b} <= on_device,
                       "%s: the device ran the forward and backward of %s" % (step["name"], b))
            expect("fetch " + b in inside(fetch), "%s fetches %s" % (step["name"], b))
        expect(inside(by_track.get("optimizer", [])), "%s has optimizer spans" % step["name"])
        # Gradients leave in every step; a step's parameters may all have come up in the step
        # before it (its call runs the next step's first forward, and backward reuses them).
        copies = inside(by_track.get("D2H copies (device)", []))
        expect(copies and all(" copies, " in n for n in copies),
               "%s: the device copied gradients D2H, as '<n> copies, <bytes>' spans: %s" % (step["name"], sorted(copies)[:3]))
    # The overlapped step: the optimizer of one step still runs while the next step's first forward
    # has begun (a forward can overlap an optimizer span only then: a step's own forwards end before
    # its backward produces the gradients the optimizer needs).
    forwards = [e for e in compute if e["name"].startswith("forward of ")]
    overlapping = [(o["name"], f["name"]) for o in by_track.get("optimizer", []) for f in forwards
                   if f["ts"] < o["ts"] + o["dur"] - EPS_US and o["ts"] < f["ts"] + f["dur"] - EPS_US]
    expect(overlapping, "an optimizer span overlaps the next step's first forward")
    up = [e["name"] for e in by_track.get("H2D copies (device)", [])]
    expect(up and all(" copies, " in n for n in up), "the device copied parameters H2D: %s" % up[:3])
    expect(trace.get("otherData", {}).get("spans_dropped") == 0, "no span dropped")

report_and_exit()

#!/usr/bin/env python3
"""`zoffload-bench merge` as a user runs it: the tiny preset's projection shapes, each checked against
torch's addmm_ (when built with LibTorch) and timed, its JSON consistent (the shapes and counts of
the model's projections, the model's time their sum), the text form, and usage errors (exit 2,
one line naming the flag)."""
import json
import subprocess
import sys

from cli_checks import expect, report_and_exit

bench = sys.argv[1]


def run(*args):
    return subprocess.run([bench, "merge", *args], capture_output=True, text=True, timeout=120)


# tiny: hidden 256, intermediate 688, 8 heads, 4 KV heads (head_dim 32), 4 layers.
p = run("--model", "tiny", "--r", "8", "--repeats", "2", "--json")
if expect(p.returncode == 0, "tiny: exits 0: " + p.stderr):
    j = json.loads(p.stdout)
    shapes = {(s["out"], s["in"]): s for s in j["shapes"]}
    expect(set(shapes) == {(256, 256), (128, 256), (688, 256), (256, 688)},
           "the tiny model's four projection shapes: %s" % sorted(shapes))
    expect(shapes[(256, 256)]["count"] == 8 and shapes[(128, 256)]["count"] == 8 and
           shapes[(688, 256)]["count"] == 8 and shapes[(256, 688)]["count"] == 4,
           "each shape counted over the 4 layers: %s" % {k: v["count"] for k, v in shapes.items()})
    total = sum(s["zoffload_s"] * s["count"] for s in j["shapes"])
    expect(abs(j["model_merge_s"] - total) <= 1e-9 * max(total, 1e-12), "the model's time is the sum over its projections")
    if j["torch_model_merge_s"] is not None:
        expect(all(s["max_rel_diff"] is not None and s["max_rel_diff"] <= 1e-6 for s in j["shapes"]),
               "each shape agrees with torch's addmm_ before it is timed")
p = run("--model", "tiny", "--repeats", "1", "--no-torch")
expect(p.returncode == 0 and "model: every projection merged in" in p.stdout and "baseline: none (--no-torch)" in p.stdout,
       "text form without torch: %s %s" % (p.stdout[-400:], p.stderr))
for args, flag in [(["--r", "0"], "--r"), (["--repeats", "0"], "--repeats"), (["--model", "no-such-model"], "--model")]:
    p = run(*args)
    expect(p.returncode == 2 and flag in p.stderr and len(p.stderr.strip().splitlines()) == 1,
           "%s: exit 2, one line naming it: %d %s" % (args, p.returncode, p.stderr))
report_and_exit()

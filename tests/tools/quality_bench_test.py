#!/usr/bin/env python3
"""tools/quality_bench.py --smoke: the plumbing of the state-dtype quality benchmark on Debian's
fortunes corpus (a 2-layer model, 10 steps): every zoffload variant trains, its checkpoints export
and evaluate with transformers, and the report, results.json and the PNG are written; zoffload's
8-bit moments end where transformers + bitsandbytes' AdamW8bit end (the same init and batches);
bad arguments are one line and exit 2. The two-hour run itself is docs/memory.md's.
Usage: quality_bench_test.py SOURCE_ROOT ZOFFLOAD"""
import json
import math
import os
import subprocess
import sys
import tempfile

from cli_checks import expect, report_and_exit

root, zoffload = sys.argv[1], sys.argv[2]
script = os.path.join(root, "tools", "quality_bench.py")
try:
    import bitsandbytes  # noqa: F401
    import matplotlib  # noqa: F401
    import transformers  # noqa: F401
except ImportError as e:  # tools/requirements.txt
    print("skipped: %s" % e)
    sys.exit(77)
if not os.path.isdir("/usr/share/games/fortunes"):  # tools/setup.sh installs Debian's fortunes
    print("skipped: /usr/share/games/fortunes is missing (apt-get install fortunes)")
    sys.exit(77)


def run(args, timeout=600):
    return subprocess.run([sys.executable, script, "--zoffload", zoffload] + args, capture_output=True, text=True,
                          timeout=timeout)


with tempfile.TemporaryDirectory(dir=os.environ.get("MESON_BUILD_ROOT")) as tmp:
    # Usage errors: one line, exit 2, nothing trained.
    p = run(["--out", os.path.join(tmp, "a"), "--steps", "12", "--eval-every", "5"])
    expect(p.returncode == 2 and "--steps 12 is not a multiple of --eval-every 5" in p.stderr,
           "steps not a multiple of eval-every: exit %d: %s" % (p.returncode, p.stderr[-500:]))
    p = run(["--out", os.path.join(tmp, "b"), "--variants", "fp32,int4"])
    expect(p.returncode == 2 and "unknown variant(s) ['int4']" in p.stderr,
           "an unknown variant: exit %d: %s" % (p.returncode, p.stderr[-500:]))
    busy = os.path.join(tmp, "busy")
    os.makedirs(busy)
    open(os.path.join(busy, "x"), "w").close()
    p = run(["--out", busy, "--smoke"])
    expect(p.returncode == 2 and "is not empty" in p.stderr, "a non-empty --out: exit %d: %s" %
           (p.returncode, p.stderr[-500:]))

    out = os.path.join(tmp, "smoke")
    variants = ["fp32", "bf16-moments", "8bit-moments", "bf16-grads", "bf16-compute", "bf16-masters", "hf-bnb-8bit"]
    p = run(["--out", out, "--smoke", "--variants", ",".join(variants)])
    if expect(p.returncode == 0, "the smoke run exits 0: %s" % (p.stdout[-2000:] + p.stderr[-2000:])):
        with open(os.path.join(out, "results.json")) as f:
            r = json.load(f)
        initial = r["initial_eval_loss"]
        expect(sorted(r["results"]) == sorted(variants), "every variant has results: %s" % sorted(r["results"]))
        for v, res in r["results"].items():
            evals = {int(k): x for k, x in res["eval_loss"].items()}
            expect(sorted(evals) == [5, 10] and all(math.isfinite(x) for x in evals.values()),
                   "%s: held-out losses at steps 5 and 10: %s" % (v, evals))
            expect(evals.get(10, initial) < initial, "%s: the held-out loss falls (%.4f -> %s)" %
                   (v, initial, evals.get(10)))
        ours = r["results"].get("8bit-moments", {}).get("eval_loss", {}).get("10")
        bnb = r["results"].get("hf-bnb-8bit", {}).get("eval_loss", {}).get("10")
        if ours is not None and bnb is not None:
            expect(abs(ours - bnb) <= 1e-3 * bnb, "8-bit moments end where transformers + AdamW8bit end: %.6f vs %.6f" %
                   (ours, bnb))
        line = [x for x in p.stdout.splitlines() if x.split()[:1] == ["bf16-masters"] and "%" in x]
        expect(len(line) == 1 and line[0].count("%") == 2, "the report gives bf16-masters against fp32 and "
               "against bf16-compute: %s" % p.stdout[-1500:])
        with open(os.path.join(out, "quality.png"), "rb") as f:
            expect(f.read(8) == b"\x89PNG\r\n\x1a\n", "quality.png is a PNG")

report_and_exit()

#!/usr/bin/env python3
"""`zoffload-bench grad` as a user runs it: a small run per dtype mix and path, its JSON (the check
ran, times and ratios are there and consistent with the bytes counted), and the usage errors
(exit 2, one line naming the flag)."""
import json
import subprocess
import sys

from cli_checks import expect, report_and_exit

bench = sys.argv[1]


def run(*args):
    return subprocess.run([bench, "grad", *args], capture_output=True, text=True, timeout=120)


best = None
for acc, grad, isa in [("fp32", "bf16", "auto"), ("fp32", "fp32", "scalar"), ("bf16", "bf16", "auto")]:
    what = "acc %s, grad %s, isa %s" % (acc, grad, isa)
    p = run("--elems", "3e6", "--acc-dtype", acc, "--grad-dtype", grad, "--isa", isa, "--repeats", "2", "--json")
    expect(p.returncode == 0, what + ": exits 0: " + p.stderr)
    if p.returncode != 0:
        continue
    j = json.loads(p.stdout)
    expect("bit for bit" in j["check"], what + ": checked against scalar first")
    a, n = j["accumulate"], j["squared_norm"]
    ab, gb = (4 if acc == "fp32" else 2), (4 if grad == "fp32" else 2)
    expect(a["bytes_per_elem"] == 2 * ab + gb and n["bytes_per_elem"] == ab, what + ": bytes counted per stream")
    expect(len(a["all_s"]) == 2 and all(t > 0 for t in a["all_s"] + n["all_s"]), what + ": two timed rounds each")
    expect(abs(a["gbps"] - 3e6 * a["bytes_per_elem"] / a["median_s"] / 1e9) < 1e-6 * a["gbps"], what + ": GB/s from the median")
    expect(n["gbps"] > 0 and j["squared_norm_ratio_to_roofline"] > 0, what + ": norm roofline ratio")
    if acc == "fp32":
        expect(j["accumulate_ratio_to_roofline"] > 0, what + ": accumulate roofline ratio")
    else:
        expect(j["accumulate_ratio_to_roofline"] is None and "fp32" in j["accumulate_roofline_skipped"],
               what + ": no accumulate roofline for a 16-bit accumulator, and why")
    if isa == "auto":
        best = j["isa"]
        expect(j["roofline_isa"] == best, what + ": kernels and roofline on the best path")
    else:
        expect(j["isa"] == "scalar" and j["roofline_isa"] == best,
               what + ": the kernels on the forced path, the roofline kept on the best (%s)" % best)

p = run("--elems", "2e6", "--repeats", "1")
expect(p.returncode == 0 and "ratio" in p.stdout and "check" in p.stdout, "text output has the check and ratios")

for args, flag in [(["--elems", "lots"], "--elems"), (["--acc-dtype", "fp8"], "--acc-dtype"),
                   (["--grad-dtype", "int8"], "--grad-dtype"), (["--isa", "neon"], "--isa"),
                   (["--repeats", "0"], "--repeats")]:
    p = run(*args)
    lines = p.stderr.strip().splitlines()
    expect(p.returncode == 2 and len(lines) == 1 and flag in lines[0], "%s: exit 2, one line naming it: %r" % (flag, p.stderr))

report_and_exit()

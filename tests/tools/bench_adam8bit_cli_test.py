#!/usr/bin/env python3
"""`zoffload-bench adam --moments 8bit`, `--moments bf16` and `--masters bf16` as a user runs them: a small run per ISA
path and copy-out, its JSON (the check ran, times and ratios are there and consistent with the bytes
counted), and the usage errors (exit 2, one line naming the flag)."""
import json
import subprocess
import sys

from cli_checks import expect, report_and_exit

bench = sys.argv[1]


def run(*args):
    return subprocess.run([bench, "adam", *args], capture_output=True, text=True, timeout=120)


N = 300_000
for moments, masters, isa, copy, grad in [
        ("8bit", "fp32", "auto", "bf16", "fp32"), ("8bit", "fp32", "scalar", "none", "bf16"),
        ("bf16", "fp32", "auto", "bf16", "fp32"), ("bf16", "fp32", "scalar", "none", "bf16"),
        ("fp32", "bf16", "auto", "bf16", "fp32"), ("8bit", "bf16", "scalar", "none", "bf16"),
        ("bf16", "bf16", "auto", "none", "fp32")]:
    what = "%s moments, %s masters, isa %s, copy-out %s, grad %s" % (moments, masters, isa, copy, grad)
    p = run("--moments", moments, "--masters", masters, "--params", str(N), "--isa", isa, "--copy-out", copy,
            "--grad-dtype", grad, "--repeats", "2", "--threads", "2", "--json")
    expect(p.returncode == 0, what + ": exits 0: " + p.stderr)
    if p.returncode != 0:
        continue
    j = json.loads(p.stdout)
    expect(j["moments"] == moments and j["masters"] == masters and "bit-identical" in j["check"],
           what + ": checked against scalar first")
    # Per parameter: params 4 B (bf16 masters 2 B) and the moments (8-bit: two codes 1 B each and two
    # absmax 4 B per 256 elements; bf16: 2 B each; fp32: 4 B each), each way; the gradient read, the
    # copy written.
    gb, cb = (4 if grad == "fp32" else 2), (2 if copy != "none" else 0)
    mb = {"8bit": 2 + 8 / 256, "bf16": 4, "fp32": 8}[moments]
    pb = 2 if masters == "bf16" else 4
    b = j["bytes_per_param"]
    expect(abs(b["read"] - (pb + mb + gb)) < 1e-9 and abs(b["write"] - (pb + mb + cb)) < 1e-9,
           what + ": bytes counted per stream: %s" % b)
    expect(len(j["step_s"]["all"]) == 2 and len(j["fp32_kernel"]["all_s"]) == 2 and len(j["triad"]["all_s"]) == 2,
           what + ": two timed rounds of each")
    expect(abs(j["params_per_s"] - N / j["step_s"]["median"]) < 1e-6 * j["params_per_s"], what + ": params/s from the median")
    expect(abs(j["effective_gbps"] - N * b["total"] / j["step_s"]["median"] / 1e9) < 1e-6 * j["effective_gbps"],
           what + ": GB/s from the bytes counted")
    expect(abs(j["ratio_to_fp32"] - j["params_per_s"] / j["fp32_kernel"]["params_per_s"]) < 1e-9,
           what + ": the ratio to the fp32 kernel")
    expect(abs(j["ratio_to_triad"] - j["effective_gbps"] / j["triad"]["gbps"]) < 1e-9, what + ": the ratio to the triad")
    if isa == "scalar":
        expect(j["isa"] == "scalar", what + ": ran on the path asked for")

for args, flag in [(["--optimizer", "lion"], "--moments 8bit"), (["--torch-loop"], "--torch-loop"),
                   (["--params", "0"], "--params"), (["--copy-out", "fp32"], "--copy-out")]:
    p = run("--moments", "8bit", *args)
    expect(p.returncode == 2 and flag in p.stderr and len(p.stderr.strip().splitlines()) == 1,
           "%s: exit 2 naming %s (got %d: %s)" % (args, flag, p.returncode, p.stderr))
p = run("--moments", "bf16", "--optimizer", "adagrad")
expect(p.returncode == 2 and "--moments bf16" in p.stderr, "--moments bf16 --optimizer adagrad: exit 2: " + p.stderr)
p = run("--masters", "bf16", "--copy-out", "fp16")
expect(p.returncode == 2 and "--masters bf16" in p.stderr, "--masters bf16 --copy-out fp16: exit 2: " + p.stderr)
p = run("--masters", "fp8")
expect(p.returncode == 2 and "--masters" in p.stderr, "--masters fp8: exit 2 naming --masters: " + p.stderr)
p = run("--moments", "4bit")
expect(p.returncode == 2 and "--moments" in p.stderr, "--moments 4bit: exit 2 naming --moments: " + p.stderr)
report_and_exit()

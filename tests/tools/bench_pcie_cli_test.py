#!/usr/bin/env python3
"""`zoffload-bench pcie` as a user runs it, on the emulated device (CI has no GPU; the GPU machine's
figures are in docs/gpu.md): the round-trip check ran for each path, every size x host memory x
direction has a row with its medians, GB/s consistent with them and the ratio to torch's copy_,
small sizes are repeated to reach --sample-bytes, --no-torch leaves the baseline out and says why,
text output has the table, and usage errors exit 2 with one line naming the flag."""
import json
import subprocess
import sys

from cli_checks import expect, report_and_exit

bench = sys.argv[1]


def run(*args, device="host"):
    return subprocess.run([bench, "pcie", "--device", device, *args], capture_output=True, text=True, timeout=120)


MiB = 1 << 20
p = run("--sizes", "1MiB,4MiB", "--repeats", "2", "--sample-bytes", "8MiB", "--json")
expect(p.returncode == 0, "exits 0: " + p.stderr)
if p.returncode == 0:
    j = json.loads(p.stdout)
    expect(j["kind"] == "host" and j["repeats"] == 2 and j["sample_bytes"] == 8 * MiB, "device, rounds and sample size")
    with_torch = j["baseline"].startswith("torch")
    for who in ["zoffload pinned", "zoffload pageable"] + (["torch pinned", "torch pageable"] if with_torch else []):
        expect(who in j["check"], "the round trip was checked for " + who + ": " + j["check"])
    rows = {(r["host"], r["direction"], r["bytes"]): r for r in j["results"]}
    expect(len(rows) == len(j["results"]) == 8, "one row per host memory x direction x size: %d" % len(j["results"]))
    for host in ("pinned", "pageable"):
        for d in ("h2d", "d2h"):
            for size, copies in ((MiB, 8), (4 * MiB, 2)):
                r = rows.get((host, d, size))
                what = "%s %s %d" % (host, d, size)
                expect(r is not None, what + ": a row")
                if r is None:
                    continue
                z = r["zoffload"]
                expect(r["copies_per_sample"] == copies, what + ": repeated to reach --sample-bytes (%d)" % r["copies_per_sample"])
                expect(len(z["all_s"]) == 2 and all(t > 0 for t in z["all_s"]), what + ": two timed rounds")
                expect(abs(z["gbps"] - size / z["median_s"] / 1e9) < 1e-6 * z["gbps"], what + ": GB/s from the median")
                if with_torch:
                    t = r["torch"]
                    expect(len(t["all_s"]) == 2 and t["gbps"] > 0, what + ": torch's rounds")
                    expect(abs(r["ratio_to_torch"] - t["median_s"] / z["median_s"]) < 1e-9 * r["ratio_to_torch"],
                           what + ": ratio = torch time / zoffload time")

p = run("--sizes", "2MiB", "--repeats", "1", "--no-torch", "--json")
expect(p.returncode == 0, "--no-torch exits 0: " + p.stderr)
if p.returncode == 0:
    j = json.loads(p.stdout)
    expect("--no-torch" in j["baseline"] and all(r["torch"] is None and r["ratio_to_torch"] is None for r in j["results"]),
           "--no-torch: no baseline, and the JSON says why")

p = run("--sizes", "1MiB", "--repeats", "1")
expect(p.returncode == 0 and "check" in p.stdout and "zoffload GB/s" in p.stdout and "no GPU" in p.stdout,
       "text output: the check, the table, and that the emulated device moves no bytes over PCIe: " + p.stdout)

for args, device, flag in [(["--sizes", "lots"], "host", "--sizes"), (["--sizes", "0"], "host", "--sizes"),
                           (["--sizes", "65GiB"], "host", "--sizes"), (["--sample-bytes", "0"], "host", "--sample-bytes"),
                           (["--repeats", "0"], "host", "--repeats"), ([], "tpu", "--device")]:
    p = run(*args, device=device)
    expect(p.returncode == 2 and flag in p.stderr and p.stderr.count("\n") == 1,
           "%s --device %s: exit 2 with one line naming %s (got %d: %r)" % (args, device, flag, p.returncode, p.stderr))

report_and_exit()

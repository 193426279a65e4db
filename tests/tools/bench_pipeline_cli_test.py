#!/usr/bin/env python3
"""`zoffload-bench pipeline` as a user runs it: a small run per tier on a real directory, its JSON,
and the usage errors (exit 2, one line naming the flag)."""
import json
import os
import subprocess
import sys
import tempfile

from cli_checks import expect, report_and_exit

bench = sys.argv[1]


def run(*args):
    return subprocess.run([bench, "pipeline", *args], capture_output=True, text=True, timeout=240)


with tempfile.TemporaryDirectory(prefix="zo-bench-pipeline-", dir=os.environ.get("TMPDIR", "/tmp")) as d:
    small = ["--params", "3e6", "--param-elems", "700000", "--sub-group-size", "5e5", "--steps", "2", "--nvme-path", d]
    for opt, par, extra in [("nvme", "nvme", []), ("nvme", "cpu", ["--no-pipeline-write"]), ("cpu", "nvme", []),
                            ("cpu", "cpu", [])]:
        what = "optimizer %s, params %s %s" % (opt, par, " ".join(extra))
        p = run(*small, "--optimizer-device", opt, "--param-device", par, "--json", *extra)
        expect(p.returncode == 0, what + ": exits 0: " + p.stderr)
        if p.returncode != 0:
            continue
        j = json.loads(p.stdout)
        expect("bit-identical" in j.get("check", ""), what + ": the first step is checked")
        expect(j["sub_groups"] >= 6, what + ": several sub-groups (%d)" % j["sub_groups"])
        expect(j["step_s"]["median"] > 0 and len(j["step_s"]["all"]) == 2, what + ": two timed steps")
        expect(j["io_alone_s"]["median"] >= 0 and j["adam_alone_s"]["median"] > 0, what + ": parts timed")
        expect(0 < j["overlap_efficiency"], what + ": overlap efficiency reported")
        expect(j["pinned"]["peak_used_bytes"] <= j["pinned"]["cap_bytes"], what + ": pinned peak within the cap")
        expect(not j["pinned"]["allocated_in_step_loop"], what + ": no pinned allocation in the step loop")
        if opt == "nvme":
            # 3e6 params: read master, m, v, grad (16 B) and write master, m, v (12 B) at least.
            expect(j["bytes_per_step"]["read"] >= 16 * 3_000_000, what + ": reads the states and gradients")
            expect(j["bytes_per_step"]["written"] >= 12 * 3_000_000, what + ": writes the states")
            expect(j["memory"]["nvme_write_bytes"] > 0, what + ": NVMe bytes written counted")
        else:
            expect(j["bytes_per_step"]["read"] == 0, what + ": no NVMe reads with states on the CPU")
    left = [os.path.join(r, f) for r, _, fs in os.walk(d) for f in fs]
    expect(left == [], "swap files removed after the runs: %s" % left)

    p = run(*small, "--optimizer-device", "nvme")
    expect(p.returncode == 0 and "overlap" in p.stdout and "check" in p.stdout, "text output: " + p.stderr)

p = run("--params", "1e6")
expect(p.returncode == 2 and "--nvme-path" in p.stderr, "missing --nvme-path: exit 2 naming it (%d %s)" % (p.returncode, p.stderr))
p = run("--params", "1e6", "--optimizer-device", "gpu", "--nvme-path", "/tmp")
expect(p.returncode == 2 and "--optimizer-device" in p.stderr, "bad --optimizer-device: exit 2")
p = run("--params", "lots", "--nvme-path", "/tmp")
expect(p.returncode == 2 and "--params" in p.stderr, "bad --params: exit 2")
p = run("--params", "1e6", "--optimizer-device", "cpu", "--param-device", "cpu", "--pinned-limit", "64KiB",
        "--sub-group-size", "2e5")
expect(p.returncode == 1 and "pinned" in p.stderr, "pinned cap below the plan: exit 1 with the numbers (%d %s)" % (p.returncode, p.stderr))
# Configs whose step this benchmark does not run: refused before anything is allocated, naming the key.
with tempfile.TemporaryDirectory(prefix="zo-bench-pipeline-cfg-", dir=os.environ.get("TMPDIR", "/tmp")) as d:
    for key, value, extra in [("master_dtype", "bf16", {}), ("moment_dtype", "8bit", {}),
                              ("gradient_accumulators", "none",
                               {"gradient_clipping": 0, "bf16": {"enabled": True, "check_grad_overflow": False}})]:
        cfg = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
               "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}, "zoffload": {key: value}}
        cfg.update(extra)
        path = os.path.join(d, key + ".json")
        with open(path, "w") as f:
            json.dump(cfg, f)
        p = run("--config", path, "--params", "1e6", "--optimizer-device", "cpu", "--nvme-path", d)
        expect(p.returncode == 2 and ("zoffload.%s \"%s\"" % (key, value)) in p.stderr,
               "a %s %s config: exit 2 naming the key (%d %s)" % (key, value, p.returncode, p.stderr))
p = subprocess.run([bench, "pipeline", "--help"], capture_output=True, text=True)
expect(p.returncode == 0 and "overlap" in p.stdout and "--nvme-path" in p.stdout, "--help describes it")

report_and_exit()

#!/usr/bin/env python3
"""tools/gpu_machine/gpu_checks.sh without a GPU: its usage errors, a part skipped when --time-limit
leaves it no time, the exact, lora, qlora and devstates parts on the emulated device with the tiny
model, the deepspeed part failing with one line where DeepSpeed was not fetched, that
part's zoffload half on the emulated device (ZO_DS_SIDES=zoffload: a table row with zoffload's
tokens/s, ZO_DS_ZOFFLOAD merged into the run's config; under a stand-in for DeepSpeed's GPU peak as
its gpu_memory_limit, and below what fits), a run cut by the part's share of the time
limit reported as cut and failing the part, and no work folder left behind.
Usage: gpu_checks_test.py SOURCE_ROOT ZOFFLOAD"""
import json
import os
import subprocess
import sys
import tarfile
import tempfile

from cli_checks import expect, report_and_exit

root, zoffload = sys.argv[1], sys.argv[2]
script = os.path.join(root, "tools", "gpu_machine", "gpu_checks.sh")
tmp = tempfile.mkdtemp(prefix="zo-gpu-checks-test-")
# The script's python3 must import torch: the one running this test does.
env = dict(os.environ, BIN_DIR=os.path.dirname(os.path.abspath(zoffload)),
           PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
env.pop("ZO_DS_RUNS", None)


def run(args, timeout=240, **extra):
    out = tempfile.mkdtemp(dir=tmp)
    p = subprocess.run([script] + args, cwd=root, env=dict(env, OUT=out, **extra), capture_output=True, text=True,
                       timeout=timeout)
    return p.returncode, p.stdout + p.stderr, out


# Usage errors: exit 2, one line, nothing run.
rc, text, _ = run(["--time-limit", "soon"])
expect(rc == 2 and "--time-limit takes seconds" in text, "bad --time-limit: exit %d: %s" % (rc, text[-300:]))
rc, text, _ = run(["deepspeeed"])
expect(rc == 2 and "unknown part or option 'deepspeeed'" in text, "unknown part: exit %d: %s" % (rc, text[-300:]))

# No time for the part: skipped, said so in the table, exit 1.
rc, text, _ = run(["--time-limit", "20", "deepspeed"])
expect(rc == 1 and "skipped:" in text and "skipped (time)" in text.split("== gpu_checks:")[-1],
       "a part with no time left is skipped: exit %d: %s" % (rc, text[-500:]))

# DeepSpeed not fetched: the install's one line, the part FAILED, at once.
empty = tempfile.mkdtemp(dir=tmp)
rc, text, _ = run(["--time-limit", "200", "deepspeed"], ZO_DS_CARRY=empty)
expect(rc == 1 and "no %s/packages.txt: run tools/gpu_machine/fetch_deepspeed.sh here" % empty in text
       and "DeepSpeed is not installed" in text, "missing carry: exit %d: %s" % (rc, text[-600:]))
expect("FAILED" in text.split("== gpu_checks:")[-1], "missing carry: the table says FAILED: " + text[-300:])

# The runs below on the tiny model take sequences of 32 tokens (the cut run's, 64: its 5000 steps are
# sized for them): they compute in bf16, the slow path on a CPU without native bf16, and what is
# checked is the script's plumbing, not the model.
# zoffload's half alone on the emulated device: a row with its tokens/s, the extra settings merged.
rc, text, out = run(["--time-limit", "200", "deepspeed"], ZO_DS_SIDES="zoffload", ZO_DS_RUNS="tiny:2:2",
                    ZO_DS_MICRO="2", ZO_DS_SEQ="32", ZO_DS_DEVICE="host",
                    ZO_DS_ZOFFLOAD='{"activation_checkpoints": "device"}')
expect(rc == 0, "zoffload's half: exit %d: %s" % (rc, text[-800:]))
row = [l for l in text.splitlines() if l.strip().startswith("tiny-gas2 ")]
expect(len(row) == 1 and "not run (ZO_DS_SIDES=zoffload)" in row[0], "one table row for tiny-gas2: %s" % row)
header = [l for l in text.splitlines() if l.strip().startswith("run ")]
if row and expect(len(header) == 1, "one table header: %s" % header):
    column = lambda name, nxt: row[0][header[0].index(name):header[0].index(nxt)].strip()
    ds_tps, zo_tps = column("tokens/s DS", "tokens/s zo"), column("tokens/s zo", "zo/DS")
    expect(ds_tps == "-" and zo_tps.isdigit() and int(zo_tps) > 0, "tokens/s in the row: DS %r, zo %r" % (ds_tps, zo_tps))
try:
    with tarfile.open(os.path.join(out, "runs.tgz")) as t:
        cfg = json.load(t.extractfile("./ds-tiny-gas2.json"))
        metrics = [json.loads(l) for l in t.extractfile("./ds-tiny-gas2/metrics.jsonl")]
    expect(cfg["zoffload"] == {"schedule": "vertical", "device": "host", "activation_checkpoints": "device"},
           "the run's zoffload section: %s" % cfg["zoffload"])
    z = cfg["zero_optimization"]
    expect(z["stage"] == 3 and z["offload_param"]["device"] == "cpu" and z["offload_optimizer"]["device"] == "cpu"
           and cfg["gradient_accumulation_steps"] == 2 and cfg["train_micro_batch_size_per_gpu"] == 2,
           "the shared config: stage 3, both offloaded, micro 2, GAS 2: %s" % cfg)
    expect(len(metrics) == 2, "two steps in metrics.jsonl: %d" % len(metrics))
except (OSError, KeyError, tarfile.TarError, ValueError) as e:
    expect(False, "runs.tgz holds the run's config and metrics: %s" % e)

# Equal memory: zoffload runs under DeepSpeed's measured GPU peak as its gpu_memory_limit, here the
# test's stand-in for it (ZO_DS_TEST_PEAK_BYTES), and the table shows the limit.
peak = 3000000
rc, text, out = run(["--time-limit", "200", "deepspeed"], ZO_DS_SIDES="zoffload", ZO_DS_RUNS="tiny:2:2",
                    ZO_DS_MICRO="2", ZO_DS_SEQ="32", ZO_DS_DEVICE="host", ZO_DS_TEST_PEAK_BYTES=str(peak))
expect(rc == 0, "zoffload at the peak: exit %d: %s" % (rc, text[-800:]))
expect("zoffload under DeepSpeed's GPU peak, gpu_memory_limit %d bytes: plan exit 0" % peak in text,
       "the limit and its plan said: " + text[-800:])
row = [l for l in text.splitlines() if l.strip().startswith("tiny-gas2 ")]
expect(len(row) == 1 and " 0.00 GiB " in row[0], "the row shows the limit: %s" % row)
try:
    with tarfile.open(os.path.join(out, "runs.tgz")) as t:
        zo_cfg = json.load(t.extractfile("./ds-tiny-gas2-zo.json"))
    expect(zo_cfg["zoffload"]["gpu_memory_limit"] == peak, "zoffload's config: %s" % zo_cfg["zoffload"])
except (OSError, KeyError, tarfile.TarError, ValueError) as e:
    expect(False, "runs.tgz holds zoffload's config at the peak: %s" % e)
# Below what any change fits (the arena's largest block): the plan's problem said, the part fails.
rc, text, _ = run(["--time-limit", "200", "deepspeed"], ZO_DS_SIDES="zoffload", ZO_DS_RUNS="tiny:2:2",
                  ZO_DS_MICRO="2", ZO_DS_SEQ="32", ZO_DS_DEVICE="host", ZO_DS_TEST_PEAK_BYTES="4096")
expect(rc == 1 and "plan exit 3" in text and ("no change makes it fit" in text or "the plan's first fix" in text),
       "a peak nothing fits under: exit %d: %s" % (rc, text[-800:]))

# The exact part on the emulated device with the tiny model: the plan moves nothing through a disk,
# three steps train, and the part ends with its tokens/s beside the first runs'.
rc, text, _ = run(["--time-limit", "200", "exact"], ZO_EXACT_MODEL="tiny", ZO_EXACT_DEVICE="host", ZO_EXACT_MICRO="2",
                  ZO_EXACT_GAS="2", ZO_EXACT_SEQ="32", ZO_EXACT_STEPS="3")
expect(rc == 0, "the exact part: exit %d: %s" % (rc, text[-800:]))
expect("gradient accumulators none" in text and "NVMe read 0 B, written 0 B" in text,
       "the exact part's plan: no accumulators, no disk: %s" % text[-800:])
expect("exact, all in RAM:" in text and "tokens/s, device_busy" in text, "the exact part's figures: " + text[-400:])

# The lora part on the emulated device with the tiny model: adapters over the pinned base, the plan
# moving nothing through a disk, three steps, and its tokens/s.
rc, text, _ = run(["--time-limit", "200", "lora"], ZO_LORA_MODEL="tiny", ZO_LORA_DEVICE="host", ZO_LORA_MICRO="2",
                  ZO_LORA_GAS="2", ZO_LORA_SEQ="32")
expect(rc == 0, "the lora part: exit %d: %s" % (rc, text[-800:]))
expect("LoRA r=16 adapters on the frozen base" in text and "NVMe read 0 B, written 0 B" in text,
       "the lora part's plan: adapters, no disk: %s" % text[-800:])
expect("lora, base pinned:" in text and "tokens/s, device_busy" in text, "the lora part's figures: " + text[-400:])
# The qlora part on the emulated device with the tiny model: its base quantized to NF4 at load and
# kept packed, the plan moving nothing through a disk, three steps, and its tokens/s.
rc, text, _ = run(["--time-limit", "200", "qlora"], ZO_QLORA_MODEL="tiny", ZO_QLORA_DEVICE="host", ZO_QLORA_MICRO="2",
                  ZO_QLORA_GAS="2", ZO_QLORA_SEQ="32")
expect(rc == 0, "the qlora part: exit %d: %s" % (rc, text[-800:]))
expect("NVMe read 0 B, written 0 B" in text, "the qlora part's plan: no disk: %s" % text[-800:])
expect("qlora, NF4 base pinned:" in text and "tokens/s, device_busy" in text, "the qlora part's figures: " + text[-400:])
# The devstates part on the emulated device: the optimizer on the device with 8-bit moments and bf16
# masters, every step equal to the CPU tier's; four steps of each of its three runs, not ten (the
# tiny model in bf16 takes some 3 s a step on a CPU without native bf16).
rc, text, _ = run(["--time-limit", "200", "devstates"], ZO_DEVSTATES_DEVICE="host", ZO_DEVSTATES_STEPS="4")
expect(rc == 0, "the devstates part: exit %d: %s" % (rc, text[-800:]))
expect("optimizer on the device, moments 8bit, masters bf16" in text
       and "every step's loss and grad norm: equal" in text, "the devstates part's lines: " + text[-600:])

# A run longer than its share of the time limit: cut, said so, the part fails.
# (5000 steps: 500 took 41 s of the 45 s share on an idle 2-core VM, and were not cut.)
rc, text, _ = run(["--time-limit", "80", "deepspeed"], ZO_DS_SIDES="zoffload", ZO_DS_RUNS="tiny:2:5000",
                  ZO_DS_MICRO="2", ZO_DS_SEQ="64", ZO_DS_DEVICE="host")
expect(rc == 1 and "zoffload cut by the time limit" in text and "FAILED" in text.split("== gpu_checks:")[-1],
       "a run past its share is cut: exit %d: %s" % (rc, text[-600:]))
total = [l for l in text.splitlines() if l.startswith("== gpu_checks:")]
expect(len(total) == 1 and int(total[0].split()[2]) <= 80, "the cut run kept --time-limit 80: %s" % total)

expect(not os.path.exists(os.path.join(root, "gpu-checks-work")), "no gpu-checks-work folder left in the checkout")
report_and_exit()

#!/usr/bin/env python3
"""tools/deepspeed_zero3.py as a user runs it, on DeepSpeed's CPU accelerator (DS_ACCELERATOR=cpu,
gloo): a DeepSpeed that cannot be imported is one line and exit 2 with the install hint; usage and
config errors are one line and exit 2; --dry-run on tiny prints the resolved config with every "auto"
filled as the Hugging Face Trainer fills it (buckets from hidden 256) and DeepSpeed's estimate, equal
to the estimator's closed form for offloaded params and optimizer (18 bytes x 1.5 per parameter on
the host, 4 bytes per largest-layer parameter on the GPU) on a parameter count worked out here from
the shapes; the parameter counts of llama3.2-1b, llama3.2-3b and llama3-8b equal Meta's published
ones; a --host-memory below the estimate exits 3 with the "not started" line and trains nothing; and
tiny trains 3 optimizer steps of 2 x 2 micro-batches of 64 tokens: 3 step records, finite losses
starting near ln(vocab) (a fresh model's near-uniform prediction), tokens/s and TFLOPS consistent with
the step times, the summary's medians and peaks taken from the steps, and the same first loss again
from the same seed. The first run on a machine JIT-builds DeepSpeed's shm_comm and cpu_adam ops
(about 2 minutes on 2 cores, then cached under TORCH_EXTENSIONS_DIR).
Exits 77 (skip) when DeepSpeed or transformers cannot be imported by this Python.
Usage: deepspeed_zero3_test.py TOOLS/deepspeed_zero3.py"""
import atexit
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

from cli_checks import expect, report_and_exit

tool = sys.argv[1]
env = dict(os.environ, DS_ACCELERATOR="cpu", HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")

# Meta's published parameter counts (the model cards), independent of zoffload and of transformers.
PUBLISHED = {"llama3.2-1b": 1_235_814_400, "llama3.2-3b": 3_212_749_824, "llama3-8b": 8_030_261_248}
# zoffload's tiny preset: vocab 256, hidden 256, intermediate 688, 4 layers, 8 heads of 32, 4 kv heads, untied.
V, H, I, L, KV = 256, 256, 688, 4, 4 * 32
TINY_PARAMS = 2 * V * H + H + L * (2 * H + 2 * H * H + 2 * H * KV + 3 * H * I)  # 3,033,344
TINY_LARGEST_LAYER = I * H  # one MLP projection, above the 256 x 256 embedding and head

# What a user hands zoffload and the Trainer alike: "auto" wherever the Trainer fills one.
CONFIG = {
    "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "train_batch_size": "auto",
    "gradient_clipping": "auto",
    "bf16": {"enabled": True},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupCosineLR", "params": {"warmup_num_steps": "auto", "total_num_steps": "auto"}},
    "zero_optimization": {
        "stage": 3, "offload_param": {"device": "cpu", "pin_memory": True},
        "offload_optimizer": {"device": "cpu", "pin_memory": True}, "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto",
        "stage3_gather_16bit_weights_on_model_save": "auto"},
    "zoffload": {"device": "auto", "gpu_memory_limit": "2GiB"},  # zoffload's own "auto": passed along as it is
}

tmp = tempfile.mkdtemp(prefix="zo-ds-zero3-test-")
atexit.register(shutil.rmtree, tmp, True)


def write_json(name, value):
    path = os.path.join(tmp, name)
    with open(path, "w") as f:
        json.dump(value, f)
    return path


def run(*args, extra_env=None, timeout=120):
    return subprocess.run([sys.executable, tool, *args], capture_output=True, text=True, timeout=timeout,
                          env=dict(env, **(extra_env or {})))


def records(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def config_line(stdout):
    for line in stdout.splitlines():
        if line.startswith("config "):
            return json.loads(line[len("config "):])
    return None


config = write_json("ds.json", CONFIG)

probe = subprocess.run([sys.executable, "-c", "import deepspeed, transformers"], capture_output=True, text=True,
                       env=env, timeout=120)
if probe.returncode != 0:
    last = probe.stderr.strip().splitlines()[-1] if probe.stderr.strip() else "exit %d" % probe.returncode
    print("SKIP: %s cannot import deepspeed and transformers (%s); --help of %s says how to install DeepSpeed" %
          (sys.executable, last, tool))
    sys.exit(77)

# A DeepSpeed that fails on import, ahead of any real one on the path: exit 2, one line, the hint.
fake = os.path.join(tmp, "fake")
os.makedirs(os.path.join(fake, "deepspeed"))
with open(os.path.join(fake, "deepspeed", "__init__.py"), "w") as f:
    f.write("raise ImportError('no DeepSpeed here')\n")
p = run("--config", config, "--model", "tiny", "--dry-run",
        extra_env={"PYTHONPATH": os.pathsep.join(filter(None, [fake, env.get("PYTHONPATH")]))})
expect(p.returncode == 2 and p.stderr.count("\n") == 1 and "cannot import DeepSpeed" in p.stderr and
       "pip install" in p.stderr, "DeepSpeed not importable: exit 2, one line with the install hint (got %d: %r)" %
       (p.returncode, p.stderr))

# Usage and config errors: exit 2, one line naming what is wrong.
stage2 = write_json("stage2.json", dict(CONFIG, zero_optimization=dict(CONFIG["zero_optimization"], stage=2)))
unknown = write_json("unknown.json", dict(CONFIG, zero_optimization=dict(CONFIG["zero_optimization"], bogus=1)))
batch = write_json("batch.json", dict(CONFIG, train_batch_size=6, train_micro_batch_size_per_gpu=4,
                                      gradient_accumulation_steps=1))
usage_cases = [([], "--config"), (["--config", config], "--model"),
               (["--config", config, "--model", "huge"], "--model"),
               (["--config", config, "--model", "tiny", "--model-config", config], "--model-config"),
               (["--config", config, "--model", "tiny", "--gas", "0"], "--gas"),
               (["--config", config, "--model", "tiny", "--micro-batch", "x"], "--micro-batch"),
               (["--config", config, "--model", "tiny", "--host-memory", "lots"], "--host-memory"),
               (["--config", config, "--model", "tiny", "--lr", "-1"], "--lr"),
               (["--config", os.path.join(tmp, "absent.json"), "--model", "tiny"], "absent.json"),
               (["--config", stage2, "--model", "tiny"], "stage is 2"),
               (["--config", unknown, "--model", "tiny"], "bogus"),
               (["--config", batch, "--model", "tiny"], "train_batch_size 6"),
               (["--config", config, "--model", "tiny", "--seq-len", "4096"], "--seq-len")]
dry_out = os.path.join(tmp, "dry.jsonl")
refused_out = os.path.join(tmp, "refused.jsonl")
jobs = [[*args, "--dry-run"] for args, _ in usage_cases]
jobs.append(["--config", config, "--model", "tiny", "--micro-batch", "3", "--gas", "5", "--steps", "7", "--lr", "1e-4",
             "--dry-run", "--json", dry_out])
for model in PUBLISHED:
    jobs.append(["--config", config, "--model", model, "--micro-batch", "1", "--gas", "1", "--dry-run",
                 "--host-memory", "10TB", "--json", os.path.join(tmp, model + ".jsonl")])
jobs.append(["--config", config, "--model", "tiny", "--micro-batch", "2", "--gas", "2", "--seq-len", "64",
             "--host-memory", "1MB", "--json", refused_out])
# Each run imports DeepSpeed and transformers (seconds); they are independent, so run side by side.
with ThreadPoolExecutor(max_workers=min(8, max(2, os.cpu_count() or 2))) as pool:
    done = list(pool.map(lambda args: run(*args), jobs))
usage_runs, dry_run, published_runs, refused_run = (done[:len(usage_cases)], done[len(usage_cases)],
                                                    done[len(usage_cases) + 1:-1], done[-1])
for (args, needle), p in zip(usage_cases, usage_runs):
    expect(p.returncode == 2 and p.stderr.count("\n") == 1 and needle in p.stderr,
           "%s: exit 2 with one line naming %s (got %d: %r)" % (args, needle, p.returncode, p.stderr))

# --dry-run on tiny: the resolved config and the estimate, nothing started.
p, out = dry_run, dry_out
expect(p.returncode == 0, "--dry-run on tiny exits 0: " + p.stderr)
if p.returncode == 0:
    c = config_line(p.stdout)
    expect(c is not None, "--dry-run prints the resolved config on one line: " + p.stdout)
    if c is not None:
        z = c["zero_optimization"]
        expect(z["reduce_bucket_size"] == 256 * 256 and z["stage3_prefetch_bucket_size"] == 58982 and
               z["stage3_param_persistence_threshold"] == 2560,
               "bucket sizes from hidden 256: 256^2, int(0.9 x 256^2), 10 x 256: %s" % z)
        expect(z["stage3_gather_16bit_weights_on_model_save"] is False,
               "stage3_gather_16bit_weights_on_model_save: accelerate's default, false: %s" % z)
        expect(c["train_micro_batch_size_per_gpu"] == 3 and c["gradient_accumulation_steps"] == 5 and
               c["train_batch_size"] == 15, "micro-batch, gas and train_batch_size = 3 x 5 x 1: %s" % c)
        expect(c["optimizer"]["params"] == {"lr": 1e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0},
               "optimizer params: --lr and the Trainer's defaults: %s" % c["optimizer"])
        expect(c["scheduler"]["params"]["total_num_steps"] == 7 and c["scheduler"]["params"]["warmup_num_steps"] >= 1,
               "scheduler: total_num_steps = --steps, a warmup DeepSpeed accepts: %s" % c["scheduler"])
        expect(c["gradient_clipping"] == 1.0 and c["bf16"] == {"enabled": True} and c["zoffload"] == CONFIG["zoffload"],
               "gradient_clipping filled, bf16 and the zoffload section kept: %s" % c)
        expect("auto" not in json.dumps(dict(c, zoffload=None)), "no \"auto\" left outside zoffload's section: %s" % c)
    expect("estimate" in p.stdout and "not started" not in p.stderr and "step " not in p.stdout,
           "the estimate printed, nothing trained: " + p.stdout)
    r = records(out)
    s = r[-1] if r else {}
    expect(len(r) == 1 and s.get("status") == "dry-run", "--json: one summary record, status dry-run: %s" % r)
    expect(s.get("params") == TINY_PARAMS and s.get("largest_layer_params") == TINY_LARGEST_LAYER,
           "tiny: %d params, largest layer %d (got %s, %s)" % (TINY_PARAMS, TINY_LARGEST_LAYER, s.get("params"),
                                                               s.get("largest_layer_params")))
    expect(s.get("estimate_cpu_bytes") == int(TINY_PARAMS * 18 * 1.5) and
           s.get("estimate_gpu_bytes") == 4 * TINY_LARGEST_LAYER,
           "the estimator's figures for params and optimizer offloaded: %s, %s" % (s.get("estimate_cpu_bytes"),
                                                                                  s.get("estimate_gpu_bytes")))

# Published parameter counts; --host-memory large enough that the estimate fits this host.
for (model, count), p in zip(PUBLISHED.items(), published_runs):
    out = os.path.join(tmp, model + ".jsonl")
    r = records(out) if p.returncode == 0 else []
    expect(p.returncode == 0 and r and r[-1]["params"] == count and "{:,} params".format(count) in p.stdout,
           "%s: %s params, as published (got %d: %s %s)" % (model, "{:,}".format(count), p.returncode,
                                                             r[-1]["params"] if r else None, p.stderr))

# Refused by the estimate: exit 3, the line, no training.
p, out = refused_run, refused_out
last = p.stderr.strip().splitlines()[-1] if p.stderr.strip() else ""
expect(p.returncode == 3 and "DeepSpeed needs" in last and "of host memory for this run (its estimator)" in last and
       "1.0 MB available: not started" in last,
       "--host-memory 1MB: exit 3 with the not-started line (got %d: %r)" % (p.returncode, p.stderr))
expect("init " not in p.stdout and "step " not in p.stdout, "refused: nothing built or trained: " + p.stdout)
r = records(out)
expect(len(r) == 1 and r[0]["status"] == "refused" and r[0]["host_bytes"] == 1_000_000,
       "refused: one summary record, status refused, host_bytes 1e6: %s" % r)

# The real run on the CPU accelerator. The first run JIT-builds DeepSpeed's shm_comm and cpu_adam ops.
out = os.path.join(tmp, "run.jsonl")
p = run("--config", config, "--model", "tiny", "--micro-batch", "2", "--gas", "2", "--seq-len", "64", "--steps", "3",
        "--json", out, timeout=1200)
expect(p.returncode == 0, "tiny trains 3 steps on the CPU: exit %d: %s" % (p.returncode, p.stderr[-3000:]))
if p.returncode == 0:
    r = records(out)
    steps = [x for x in r if x["record"] == "step"]
    s = r[-1]
    expect(len(r) == 4 and [x["step"] for x in steps] == [1, 2, 3] and s["record"] == "summary",
           "3 step records, then the summary: %s" % [x["record"] for x in r])
    expect(all(math.isfinite(x["loss"]) for x in steps), "finite losses: %s" % [x["loss"] for x in steps])
    expect(abs(steps[0]["loss"] - math.log(V)) < 0.5,
           "first loss %.4f near ln(256) = %.4f, a fresh model's near-uniform prediction" %
           (steps[0]["loss"], math.log(V)))
    for x in steps:
        tps = 2 * 2 * 64 / x["time_s"]
        expect(abs(x["tokens_per_s"] - tps) <= 1e-9 * tps and
               abs(x["tflops"] - 6 * TINY_PARAMS * tps / 1e12) <= 1e-9 * tps,
               "step %d: tokens/s = 256 / time, TFLOPS = 6 x params x tokens/s: %s" % (x["step"], x))
        expect(x["gpu_peak_bytes"] > 0 and x["host_peak_bytes"] >= x["host_rss_bytes"] > 0,
               "step %d: peaks reported, VmHWM >= VmRSS: %s" % (x["step"], x))
    expect(s["status"] == "ran" and s["params"] == TINY_PARAMS and s["init_s"] > 0,
           "summary: ran, tiny's params, init time: %s" % s)
    expect(s["tokens_per_s"] == statistics.median([steps[1]["tokens_per_s"], steps[2]["tokens_per_s"]]) and
           s["tflops"] == 6 * TINY_PARAMS * s["tokens_per_s"] / 1e12,
           "summary: the median over steps 2-3 (step 1 is warm-up): %s" % s)
    expect(s["gpu_peak_bytes"] == max(x["gpu_peak_bytes"] for x in steps) and
           s["host_peak_bytes"] >= max(x["host_peak_bytes"] for x in steps),
           "summary: the peaks over the steps: %s" % s)
    for key in ("status", "tokens_per_s", "tflops", "gpu_peak_bytes", "host_peak_bytes", "params",
                "estimate_cpu_bytes", "host_bytes", "init_s"):
        expect(key in s, "summary has %s, which gpu_checks.sh reads" % key)
    expect(s["config"]["train_batch_size"] == 4 and s["config"]["scheduler"]["params"]["total_num_steps"] == 3,
           "summary: the resolved config: %s" % s["config"])
    lines = p.stdout.splitlines()
    expect(sum(line.startswith("step ") for line in lines) == 3 and
           any(line.startswith("init ") and "deepspeed.zero.Init" in line for line in lines),
           "stdout: the init line (built under zero.Init) and one line per step: " + p.stdout[-2000:])

    # The same seed again: the same model and tokens, so the same first loss.
    again = os.path.join(tmp, "again.jsonl")
    q = run("--config", config, "--model", "tiny", "--micro-batch", "2", "--gas", "2", "--seq-len", "64",
            "--steps", "1", "--json", again, timeout=600)
    ra = records(again) if q.returncode == 0 else []
    expect(q.returncode == 0 and ra and ra[0]["loss"] == steps[0]["loss"],
           "--seed 1234 twice: the same first loss (got %d: %s vs %s)" % (q.returncode, ra[0]["loss"] if ra else None,
                                                                         steps[0]["loss"]))

report_and_exit()

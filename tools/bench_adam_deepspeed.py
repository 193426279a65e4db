#!/usr/bin/env python3
"""DeepSpeed's CPU Adam beside zoffload's: the peer ratio of `zoffload-bench adam`, in one command.

Runs DeepSpeed's DeepSpeedCPUAdam (deepspeed.ops.adam, the cpu_adam op that ZeRO-Offload steps
with) on the sizes, threads and hyperparameters of `zoffload-bench adam`, in alternating rounds:
each round runs `zoffload-bench adam --json` (a separate process: its check, warm-up and --repeats
timed steps, with torch's fused kernel alternating inside it), then --repeats timed DeepSpeed steps
in this process. It prints the median over rounds of each round's median step time for zoffload,
DeepSpeed and torch's fused kernel (from zoffload-bench's JSON), and the ratios zoffload/DeepSpeed
and zoffload/torch in params/s; --json for scripts.

Before timing, DeepSpeed's result is checked against torch's reference (torch.optim.AdamW / Adam,
the single-tensor loop) after 3 steps on 66 536 parameters: relative L2 error of params, exp_avg
and exp_avg_sq must be at most 1e-6, else exit 1 (a benchmark that measures something else is a
defect). zoffload-bench checks itself and torch's kernel the same way.

What DeepSpeed is given: fp32 params, fp32 grads (its cpu_adam takes grads in the params' dtype, so
--grad-dtype is fp32 only), fp32 moments, bias correction on, no grad scale (zoffload-bench unscales
×1024 in its pass; DeepSpeed would need a separate pass, which is not timed here). cpu_adam has no
16-bit copy-out; with --copy-out bf16|fp16 the DeepSpeed step is followed by the copy_ a user would
do, as torch's baseline is. The default here is --copy-out none, the like-for-like comparison.

Installing DeepSpeed for the measurement only, outside the repository and outside the interpreter's
environment (its other requirements, torch, numpy, packaging, pydantic and tqdm, are the
interpreter's own; --no-deps keeps pip from installing a second torch):

    python3 -m pip install --target /tmp/ds --no-deps deepspeed hjson msgpack einops psutil py-cpuinfo
    PYTHONPATH=/tmp/ds python3 tools/bench_adam_deepspeed.py --params 2e8 --threads 1

Use the interpreter whose torch zoffload was built against (meson's -Dpython, e.g. .venv/bin/python3).
The first run JIT-builds the cpu_adam op with g++ -O3 -march=native -fopenmp against that torch, with
ninja (the system's /usr/bin/ninja serves): about 1–4 minutes on 2 cores, then cached under
~/.cache/torch_extensions (TORCH_EXTENSIONS_DIR moves it). The script sets DS_ACCELERATOR=cpu when
it is unset, so DeepSpeed uses its CPU op builder whether or not the machine has a GPU (on one
without, it would pick CPU anyway, with a warning). Threads: OMP_NUM_THREADS and
torch.set_num_threads are set to --threads before torch is imported (cpu_adam runs an OpenMP loop).

Exit codes: 0 success; 1 runtime failure (a check failed, zoffload-bench failed); 2 bad usage or
DeepSpeed not importable.
"""
import argparse
import json
import os
import statistics
import sys

import bench_adam_common as common

PROG = "bench_adam_deepspeed.py"
CHECK_PARAMS = 66536  # whole vectors and a ragged tail, as zoffload-bench's own torch check
CHECK_STEPS = 3
CHECK_TOLERANCE = 1e-6


def fail(msg, code=1):
    common.fail(PROG, msg, code)


def parse_args():
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--optimizer", default="adamw", choices=["adamw", "adam"],
                    help="adamw (decoupled decay) or adam (L2 decay); default adamw")
    ap.add_argument("--grad-dtype", default="fp32", choices=["fp32"],
                    help="fp32 only: DeepSpeed's cpu_adam takes grads in the params' dtype")
    ap.add_argument("--copy-out", default="none", choices=["none", "bf16", "fp16"],
                    help="16-bit copy of the new params after the step (default none: cpu_adam has none)")
    common.add_run_args(ap, "2e8")
    a = ap.parse_args()
    common.check_run_args(PROG, a, "2e8")
    return a


a = parse_args()
threads = a.threads or len(os.sched_getaffinity(0))
# Before torch is imported: OpenMP reads these once.
os.environ["OMP_NUM_THREADS"] = str(threads)
os.environ.setdefault("DS_ACCELERATOR", "cpu")

try:
    import torch
    import deepspeed
    from deepspeed.ops.adam import DeepSpeedCPUAdam
except Exception as e:  # ImportError, or DeepSpeed failing on import
    fail(f"cannot import DeepSpeed ({type(e).__name__}: {e}); install it outside the repo: python3 -m pip install "
         f"--target /tmp/ds --no-deps deepspeed hjson msgpack einops psutil py-cpuinfo, then run with "
         f"PYTHONPATH=/tmp/ds (see --help)", 2)

torch.set_num_threads(threads)
say = (lambda *x: None) if a.json else print


def run_zoffload():
    cmd = [a.bench, "adam", "--params", str(a.n), "--optimizer", a.optimizer, "--grad-dtype", a.grad_dtype,
           "--copy-out", a.copy_out, "--threads", str(threads), "--repeats", str(a.repeats), "--isa", a.isa, "--json"]
    return common.run_bench_json(PROG, cmd)


def make_deepspeed(params, h):
    return DeepSpeedCPUAdam([params], lr=h["lr"], betas=(h["beta1"], h["beta2"]), eps=h["eps"],
                            weight_decay=h["weight_decay"], bias_correction=True, adamw_mode=a.optimizer == "adamw")


def check_deepspeed(h):
    """CHECK_STEPS steps of DeepSpeedCPUAdam and of torch's single-tensor reference from the same start."""
    ds, ds_p, ref, ref_p, ref_cls = common.step_beside_torch(make_deepspeed, a.optimizer, h, CHECK_PARAMS,
                                                             CHECK_STEPS)
    errs = {"params": common.rel_l2(ds_p.detach(), ref_p.detach())}
    for k in ("exp_avg", "exp_avg_sq"):
        errs[k] = common.rel_l2(ds.state[ds_p][k], ref.state[ref_p][k])
    passed = all(e <= CHECK_TOLERANCE for e in errs.values())
    text = (f"DeepSpeedCPUAdam vs {ref_cls.__module__.split('.')[0]}.optim.{ref_cls.__name__} after {CHECK_STEPS} "
            f"steps on {CHECK_PARAMS} params: relative L2 error params {errs['params']:.1e}, "
            f"exp_avg {errs['exp_avg']:.1e}, exp_avg_sq {errs['exp_avg_sq']:.1e} (limit {CHECK_TOLERANCE:.0e})")
    return {"params": CHECK_PARAMS, "steps": CHECK_STEPS, "rel_l2": errs, "tolerance": CHECK_TOLERANCE,
            "passed": passed, "text": text}


class DeepSpeedRun:
    """DeepSpeedCPUAdam over n fp32 params with fp32 grads; moments allocated by its first (warm-up) step."""

    def __init__(self, h):
        self.p = common.timed_param(a.n)
        self.copy = None
        if a.copy_out != "none":
            self.copy = torch.empty(a.n, dtype=torch.bfloat16 if a.copy_out == "bf16" else torch.float16)
        self.opt = make_deepspeed(self.p, h)
        self.step()

    def step(self):
        self.opt.step()
        if self.copy is not None:
            with torch.no_grad():
                self.copy.copy_(self.p)

    def time_steps(self, repeats):
        return common.time_steps(self.step, repeats)


say(f"{PROG}: {a.optimizer}, {a.n} params, grad {a.grad_dtype}, copy-out {a.copy_out}, {threads} thread(s), "
    f"{a.rounds} alternating rounds of {a.repeats} steps; DeepSpeed {deepspeed.__version__}, torch {torch.__version__}, "
    f"DS_ACCELERATOR={os.environ['DS_ACCELERATOR']}")

rounds = []
ds_run = None
ds_check = None
for r in range(a.rounds):
    z = run_zoffload()
    if ds_run is None:
        # zoffload-bench states the hyperparameters it ran with; DeepSpeed gets the same.
        hyper = z["hyper"]
        ds_check = check_deepspeed(hyper)
        say(f"check     {ds_check['text']}: {'ok' if ds_check['passed'] else 'FAILED'}")
        if not ds_check["passed"]:
            fail(f"DeepSpeed's check against torch failed, not timing it: {ds_check['text']}")
        say(f"check     zoffload-bench: {z['check']}")
        if z["torch"].get("check"):
            tc = z["torch"]["check"]
            say(f"check     zoffload-bench: {z['torch']['kernel']} vs cpu_optim, relative L2 error params "
                f"{tc['rel_l2_params']:.1e}: {'ok' if tc['passed'] else 'FAILED'}")
        ds_run = DeepSpeedRun(hyper)
    ds_s = ds_run.time_steps(a.repeats)
    row = {"zoffload_s": z["step_s"]["median"], "deepspeed_s": statistics.median(ds_s), "deepspeed_all_s": ds_s,
           "torch_fused_s": z["torch"]["median_s"] if z["torch"].get("available") else None}
    rounds.append(row)
    torch_text = (f", torch fused {a.n / row['torch_fused_s'] / 1e9:.3f}" if row["torch_fused_s"] else "")
    say(f"round {r + 1}   zoffload {a.n / row['zoffload_s'] / 1e9:.3f} G params/s, DeepSpeed "
        f"{a.n / row['deepspeed_s'] / 1e9:.3f}{torch_text}  (medians of {a.repeats} steps)")


zo, ds, tf = (common.summary(rounds, k, a.n) for k in ("zoffload_s", "deepspeed_s", "torch_fused_s"))
ratio_ds = zo["params_per_s"] / ds["params_per_s"]
ratio_tf = zo["params_per_s"] / tf["params_per_s"] if tf else None
if a.json:
    print(json.dumps({
        "optimizer": a.optimizer, "params": a.n, "grad_dtype": a.grad_dtype, "copy_out": a.copy_out,
        "threads": threads, "rounds": a.rounds, "repeats": a.repeats, "hyper": hyper,
        "deepspeed": dict(ds, version=deepspeed.__version__, check=ds_check,
                          accelerator=os.environ["DS_ACCELERATOR"]),
        "zoffload": zo, "torch_fused": tf, "torch_version": torch.__version__,
        "ratio_zoffload_to_deepspeed": ratio_ds, "ratio_zoffload_to_torch_fused": ratio_tf,
    }, indent=2))
else:
    line = (f"median    zoffload {zo['params_per_s'] / 1e9:.3f} G params/s, DeepSpeed cpu_adam "
            f"{ds['params_per_s'] / 1e9:.3f}")
    if tf:
        line += f", torch fused {tf['params_per_s'] / 1e9:.3f}"
    print(line + f" (median over {a.rounds} rounds of each round's median)")
    print(f"ratio     zoffload/DeepSpeed {ratio_ds:.2f}x" +
          (f", zoffload/torch fused {ratio_tf:.2f}x" if ratio_tf else "") + " (params/s)")

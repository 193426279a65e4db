#!/usr/bin/env python3
"""bitsandbytes' AdamW8bit (its CPU path) beside zoffload's 8-bit Adam: the peer ratio of
`zoffload-bench adam --moments 8bit`, in one command.

Alternating rounds: each runs `zoffload-bench adam --moments 8bit --json` (a separate process: its
check against the scalar path, warm-up and --repeats timed steps, alternating with the fp32 kernel
and a STREAM triad inside it), then --repeats timed steps of bitsandbytes' AdamW8bit (or Adam8bit)
over one tensor of the same size, in this process, as bitsandbytes ships it (its own CPU
re-quantization). Prints the median over rounds of each round's median step time for zoffload's
8-bit kernel, its fp32 kernel and bitsandbytes, and the ratios in params/s; --json for scripts.

Before timing, bitsandbytes' step is checked against torch's: after 3 steps on 66 536 parameters
from the same start, its parameters must be within a relative L2 error of 1e-3 of
torch.optim.AdamW's (Adam's), else exit 1: 8-bit moments move each update by about a percent of its
size, a wrong optimizer or hyperparameter by far more. (That its states are zoffload's, code for
code, is the adam8bit-bnb test's job, tests/cpu_optim/adam8bit_bnb_test.py.)

What bitsandbytes is given: fp32 params and grads (its optimizer takes grads in the params'
dtype), bias correction on, the hyperparameters zoffload-bench reports, no gradient scale
(zoffload-bench unscales ×1024 in its pass) and no 16-bit copy (--copy-out none is passed to
zoffload-bench as well: the like-for-like comparison). Threads: torch.set_num_threads(--threads),
which bitsandbytes' CPU ops run under.

Exit codes: 0 success; 1 runtime failure (a check failed, zoffload-bench failed); 2 bad usage or
bitsandbytes not importable (tools/requirements.txt pins it).
"""
import argparse
import json
import os
import statistics
import sys

import bench_adam_common as common

PROG = "bench_adam_bnb.py"
CHECK_PARAMS = 66536
CHECK_STEPS = 3
CHECK_TOLERANCE = 1e-3


def fail(msg, code=1):
    common.fail(PROG, msg, code)


def parse_args():
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--optimizer", default="adamw", choices=["adamw", "adam"],
                    help="adamw (AdamW8bit) or adam (Adam8bit); default adamw")
    common.add_run_args(ap, "2e7")
    a = ap.parse_args()
    common.check_run_args(PROG, a, "2e7")
    return a


a = parse_args()
threads = a.threads or len(os.sched_getaffinity(0))
os.environ["OMP_NUM_THREADS"] = str(threads)
try:
    import torch
    import bitsandbytes as bnb
except Exception as e:
    fail(f"cannot import bitsandbytes ({type(e).__name__}: {e}); tools/requirements.txt pins it", 2)
torch.set_num_threads(threads)
say = (lambda *x: None) if a.json else print


def run_zoffload():
    cmd = [a.bench, "adam", "--moments", "8bit", "--params", str(a.n), "--optimizer", a.optimizer,
           "--copy-out", "none", "--threads", str(threads), "--repeats", str(a.repeats), "--isa", a.isa, "--json"]
    return common.run_bench_json(PROG, cmd)


def make_bnb(params, h):
    cls = bnb.optim.AdamW8bit if a.optimizer == "adamw" else bnb.optim.Adam8bit
    return cls([params], lr=h["lr"], betas=(h["beta1"], h["beta2"]), eps=h["eps"], weight_decay=h["weight_decay"],
               min_8bit_size=1)


def check_bnb(h):
    q, q_p, _, ref_p, ref_cls = common.step_beside_torch(make_bnb, a.optimizer, h, CHECK_PARAMS, CHECK_STEPS)
    err = common.rel_l2(q_p.detach(), ref_p.detach())
    passed = err <= CHECK_TOLERANCE
    text = (f"bitsandbytes {type(q).__name__} vs torch.optim.{ref_cls.__name__} after {CHECK_STEPS} steps on "
            f"{CHECK_PARAMS} params: relative L2 error params {err:.1e} (limit {CHECK_TOLERANCE:.0e})")
    return {"params": CHECK_PARAMS, "steps": CHECK_STEPS, "rel_l2_params": err, "tolerance": CHECK_TOLERANCE,
            "passed": passed, "text": text}


class BnbRun:
    def __init__(self, h):
        self.p = common.timed_param(a.n)
        self.opt = make_bnb(self.p, h)
        self.opt.step()  # allocates its states

    def time_steps(self, repeats):
        return common.time_steps(self.opt.step, repeats)


say(f"{PROG}: {a.optimizer} with 8-bit moments, {a.n} params, {threads} thread(s), {a.rounds} alternating rounds "
    f"of {a.repeats} steps; bitsandbytes {bnb.__version__}, torch {torch.__version__}")
rounds = []
run = None
check = None
hyper = None
for r in range(a.rounds):
    z = run_zoffload()
    if run is None:
        hyper = z["hyper"]
        check = check_bnb(hyper)
        say(f"check     {check['text']}: {'ok' if check['passed'] else 'FAILED'}")
        if not check["passed"]:
            fail(f"bitsandbytes' check against torch failed, not timing it: {check['text']}")
        say(f"check     zoffload-bench: {z['check']}")
        run = BnbRun(hyper)
    b_s = run.time_steps(a.repeats)
    row = {"zoffload_s": z["step_s"]["median"], "fp32_s": z["fp32_kernel"]["median_s"],
           "bnb_s": statistics.median(b_s), "bnb_all_s": b_s, "ratio_to_triad": z["ratio_to_triad"]}
    rounds.append(row)
    say(f"round {r + 1}   zoffload 8-bit {a.n / row['zoffload_s'] / 1e6:.1f} M params/s, zoffload fp32 "
        f"{a.n / row['fp32_s'] / 1e6:.1f}, bitsandbytes {a.n / row['bnb_s'] / 1e6:.1f}; zoffload 8-bit "
        f"effective/triad {row['ratio_to_triad']:.2f}  (medians of {a.repeats} steps)")


zo, fp, bb = (common.summary(rounds, k, a.n) for k in ("zoffload_s", "fp32_s", "bnb_s"))
ratio_bnb = zo["params_per_s"] / bb["params_per_s"]
ratio_fp32 = zo["params_per_s"] / fp["params_per_s"]
ratio_triad = statistics.median(row["ratio_to_triad"] for row in rounds)
if a.json:
    print(json.dumps({
        "optimizer": a.optimizer, "params": a.n, "threads": threads, "rounds": a.rounds, "repeats": a.repeats,
        "hyper": hyper, "zoffload_8bit": zo, "zoffload_fp32": fp,
        "bitsandbytes": dict(bb, version=bnb.__version__, check=check), "torch_version": torch.__version__,
        "ratio_zoffload_to_bitsandbytes": ratio_bnb, "ratio_8bit_to_fp32": ratio_fp32,
        "ratio_to_triad": ratio_triad,
    }, indent=2))
else:
    print(f"median    zoffload 8-bit {zo['params_per_s'] / 1e6:.1f} M params/s, zoffload fp32 "
          f"{fp['params_per_s'] / 1e6:.1f}, bitsandbytes {bb['params_per_s'] / 1e6:.1f} "
          f"(median over {a.rounds} rounds of each round's median)")
    print(f"ratio     zoffload/bitsandbytes {ratio_bnb:.2f}x, 8-bit/fp32 {ratio_fp32:.2f}x (params/s); "
          f"zoffload 8-bit effective/triad {ratio_triad:.2f} (target >= 0.85)")

"""What the peer-baseline scripts of `zoffload-bench adam` share (bench_adam_deepspeed.py,
bench_adam_bnb.py): failing with their exit codes, their common flags, running zoffload-bench
adam with --json, stepping the peer beside torch's own Adam for its check, timing its steps and
summarizing the rounds. The torch helpers take torch's objects (each script imports torch itself)."""
import json
import os
import statistics
import subprocess
import sys
import time


def fail(prog, msg, code=1):
    print(f"{prog}: {msg}", file=sys.stderr)
    sys.exit(code)


def parse_count(prog, text, example):
    try:
        value = float(text)
    except ValueError:
        value = -1
    if value < 1 or value != int(value):
        fail(prog, f"--params: expected a positive count like {example}, got '{text}'", 2)
    return int(value)


def run_bench_json(prog, cmd):
    """`cmd` (a zoffload-bench adam ... --json command line) run to completion; its JSON."""
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        last = r.stderr.strip().splitlines()[-1] if r.stderr.strip() else ""
        fail(prog, f"{' '.join(cmd)} exited {r.returncode}: {last}")
    try:
        return json.loads(r.stdout)
    except json.JSONDecodeError as e:
        fail(prog, f"{' '.join(cmd)}: output is not JSON ({e})")


def add_run_args(ap, default_params):
    """The flags both scripts take besides their own: sizes, threads, rounds, the bench and --json.
    --optimizer, and the dtype flags where there are any, are each script's."""
    ap.add_argument("--params", default=default_params,
                    help=f"number of parameters, e.g. {default_params} (default {default_params})")
    ap.add_argument("--threads", type=int, default=0, help="threads for both (0 = all the process may use)")
    ap.add_argument("--repeats", type=int, default=5, help="timed steps per round for each (default 5)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds (default 3)")
    ap.add_argument("--isa", default="auto", help="passed to zoffload-bench adam --isa (default auto)")
    ap.add_argument("--bench", default="build/tools/zoffload-bench",
                    help="path of zoffload-bench (default build/tools/zoffload-bench)")
    ap.add_argument("--json", action="store_true", help="print machine-readable results on stdout")


def check_run_args(prog, a, example):
    """Checks the flags of add_run_args (exit 2 naming the flag) and sets a.n from --params."""
    a.n = parse_count(prog, a.params, example)
    if a.threads < 0:
        fail(prog, "--threads must be >= 0", 2)
    if a.repeats < 1 or a.rounds < 1:
        fail(prog, "--repeats and --rounds must be >= 1", 2)
    if not (os.path.isfile(a.bench) and os.access(a.bench, os.X_OK)):
        fail(prog, f"--bench: {a.bench} is not an executable file (build with ninja -C build, or pass --bench PATH)",
             2)


def rel_l2(x, ref):
    """Relative L2 error of tensor x against ref (absolute where ref is all zeros), in double."""
    x, ref = x.double(), ref.double()
    den = ref.norm()
    return float((x - ref).norm() / den) if den > 0 else float((x - ref).norm())


def step_beside_torch(make_peer, optimizer, h, n, steps):
    """`steps` steps of make_peer(param, h) and of torch's single-tensor AdamW (optimizer "adamw") or
    Adam from the same n random params and gradients (seed 7). Returns (peer, peer_param, ref,
    ref_param, ref_cls)."""
    import torch
    gen = torch.Generator().manual_seed(7)
    p0 = torch.rand(n, generator=gen) * 2 - 1
    grads = [torch.rand(n, generator=gen) * 2 - 1 for _ in range(steps)]
    peer_p, ref_p = torch.nn.Parameter(p0.clone()), torch.nn.Parameter(p0.clone())
    ref_cls = torch.optim.AdamW if optimizer == "adamw" else torch.optim.Adam
    ref = ref_cls([ref_p], lr=h["lr"], betas=(h["beta1"], h["beta2"]), eps=h["eps"], weight_decay=h["weight_decay"],
                  foreach=False, fused=False)
    peer = make_peer(peer_p, h)
    for g in grads:
        peer_p.grad, ref_p.grad = g.clone(), g.clone()
        peer.step()
        ref.step()
    return peer, peer_p, ref, ref_p, ref_cls


def timed_param(n):
    """The timed runs' parameter: n random values with a random gradient (seed 1)."""
    import torch
    gen = torch.Generator().manual_seed(1)
    p = torch.nn.Parameter(torch.rand(n, generator=gen) * 2 - 1)
    p.grad = torch.rand(n, generator=gen) * 2 - 1
    return p


def time_steps(step, repeats):
    """Seconds of each of `repeats` calls of step()."""
    seconds = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        seconds.append(time.perf_counter() - t0)
    return seconds


def summary(rounds, key, n):
    """The median over the rounds of row[key] (a round's median step, None where not measured), the
    rounds' values and n / median as params/s; None when no round has it."""
    vals = [row[key] for row in rounds if row[key] is not None]
    if not vals:
        return None
    med = statistics.median(vals)
    return {"median_s": med, "round_medians_s": vals, "params_per_s": n / med}

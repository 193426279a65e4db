#!/usr/bin/env python3
"""Data parallel on this machine: step time and collective bytes per step of `zoffload train` at 1
and N ranks (torchrun, Gloo), and the bus bandwidth of its collectives against c10d's own
(torch.distributed, Gloo) on the same sizes, run in the same invocation: at ZeRO stage 0 the
gradient all-reduce against dist.all_reduce; at stages 1-3 (optimizer states partitioned) the
gradients' reduce to their owners plus the updated parameters' all-gather against
dist.reduce_scatter_tensor plus dist.all_gather_into_tensor, the collectives DeepSpeed uses (at stage 3, where the parameters are partitioned too and each block
is gathered at every fetch, the all-gather twice per micro-step: forward and backward).

    tools/dist_bench.py --zoffload build/tools/zoffload [--ranks 2] [--config C] [--stage S] [--model tiny]
                        [--steps 8] [--seq-len 256] [--rounds 3] [--json]

For each round it trains world 1 and world N (alternating) and then times the baseline. Step times
are medians over steps 3.. of each run, then medians over rounds. Bus bandwidth is the ring
all-reduce's: bytes x 2(N-1)/N over the time in the collective; reduce-scatter's and all-gather's:
bytes x (N-1)/N. zoffload's collective time is what rank 0 spent inside them (metrics'
time_s.collective less rank_wait, the wait for the slowest rank that the boundary's first
collective absorbs, plus time_s.gather, the all-gather on the optimizer's thread (stage 3: the gatherer's), and
time_s.grad_reduce, stage 2's reduce during backward, which also holds the wait for the other
ranks' backward to produce the same gradients: from stage 2 the ratio understates the collectives
themselves, and the step times are the figure to compare); the baseline
moves the same totals in chunks of the config's sub_group_size elements (zoffload's chunks are at
most that) from a loop that does nothing else. Needs the python that has torch.
"""
import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile

BASELINE = r"""
import os, sys, time, torch, torch.distributed as dist
total, chunk, reps, mode = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
dtype, copy_dtype = getattr(torch, sys.argv[5]), getattr(torch, sys.argv[6])
gathers = int(sys.argv[7])  # all-gathers of the parameters per step
dist.init_process_group("gloo")
n = dist.get_world_size()
step = n if mode == "partitioned" else 1  # partitioned: chunks of a multiple of n elements
bufs, left = [], total
while left > 0:
    bufs.append(torch.ones(max(step, min(chunk, left) // step * step), dtype=dtype))
    left -= bufs[-1].numel()
shards = [torch.empty(b.numel() // n, dtype=dtype) for b in bufs]
copies = [torch.ones(b.numel() // n, dtype=copy_dtype) for b in bufs]
gathered = [torch.empty(b.numel(), dtype=copy_dtype) for b in bufs]
times = []
for r in range(reps + 1):
    dist.barrier(); t0 = time.perf_counter()
    if mode == "partitioned":
        for b, s in zip(bufs, shards): dist.reduce_scatter_tensor(s, b)
        for _ in range(gathers):
            for c, g in zip(copies, gathered): dist.all_gather_into_tensor(g, c)
    else:
        for b in bufs: dist.all_reduce(b)
    times.append(time.perf_counter() - t0)
if dist.get_rank() == 0:
    times = sorted(times[1:]); print("BASELINE %.9f" % times[len(times) // 2])
dist.destroy_process_group()
"""


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(n, cmd, env=None):
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n), "--master-addr", "127.0.0.1",
            "--master-port", str(free_port())] + cmd


def train(args, tmp, n, rnd):
    out = os.path.join(tmp, "w%d-r%d" % (n, rnd))
    cmd = [args.zoffload, "train", "--config", args.config, "--model", args.model, "--data", args.data, "--out", out,
           "--steps", str(args.steps), "--seq-len", str(args.seq_len), "-q"]
    full = torchrun(n, ["--no-python"] + cmd) if n > 1 else cmd
    p = subprocess.run(full, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit("dist_bench: world %d failed:\n%s" % (n, p.stderr[-3000:]))
    with open(os.path.join(out, "metrics.jsonl")) as f:
        m = [json.loads(line) for line in f][2:]
    if not m:
        sys.exit("dist_bench: --steps must be at least 3 (steps 1-2 are warm-up)")
    med = lambda key: statistics.median(r[key] for r in m)
    return {"step_s": med("step_s"), "tokens_per_s": med("tokens_per_s"), "collective_bytes": med("collective_bytes"),
            # The gradient exchange alone: the boundary's first collective absorbs the ranks' skew;
            # partitioned, the all-gather runs on the optimizer's thread (time_s.gather) and, from
            # stage 2, the reduce on the gradient worker's during backward (time_s.grad_reduce).
            "collective_s": statistics.median(r["time_s"]["collective"] - r["time_s"]["rank_wait"] +
                                              r["time_s"].get("gather", 0.0) + r["time_s"].get("grad_reduce", 0.0)
                                              for r in m),
            "rank_wait_s": statistics.median(r["time_s"]["rank_wait"] for r in m)}


def main():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--zoffload", default=os.path.join(root, "build", "tools", "zoffload"))
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--config", default=None, help="default: configs/tiny_demo_nvme.json in fp32, micro-batch 1, GAS 1")
    ap.add_argument("--stage", type=int, choices=[0, 1, 2, 3], default=None,
                    help="override zero_optimization.stage (0: replicated states, nothing offloaded)")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--data", default=os.path.join(root, "configs", "data", "demo_corpus.txt"))
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.ranks < 2:
        ap.error("--ranks must be at least 2")
    with tempfile.TemporaryDirectory() as tmp:
        if args.config is None:
            with open(os.path.join(root, "configs", "tiny_demo_nvme.json")) as f:
                c = json.load(f)
            c["bf16"] = {"enabled": False}
            c["train_micro_batch_size_per_gpu"], c["gradient_accumulation_steps"] = 1, 1
            args.config = os.path.join(tmp, "bench.json")
            with open(args.config, "w") as f:
                json.dump(c, f)
        with open(args.config) as f:
            c = json.load(f)
        if args.stage is not None:
            z = c.setdefault("zero_optimization", {})
            z["stage"] = args.stage
            if args.stage == 0:  # stage 0 offloads nothing
                z["offload_param"], z["offload_optimizer"] = {"device": "none"}, {"device": "none"}
            elif args.stage < 3:  # parameter offload is stage 3's
                z["offload_param"] = {"device": "none"}
            args.config = os.path.join(tmp, "bench-stage.json")
            with open(args.config, "w") as f:
                json.dump(c, f)
        sub_group = int(float(c.get("zero_optimization", {}).get("sub_group_size", 1e9)))
        stage = int(c.get("zero_optimization", {}).get("stage", 0))
        partitioned = stage >= 1
        # Stage 3 partitions the parameters too: every block is gathered in the forward and again in
        # the backward (2 all-gathers of the model per micro-step); stages 1-2 all-gather once per step.
        gathers = 2 * int(c.get("gradient_accumulation_steps", 1)) if stage == 3 else 1
        names = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
        compute = "bf16" if c.get("bf16", {}).get("enabled") else "fp16" if c.get("fp16", {}).get("enabled") else "fp32"
        dtype = names[c.get("data_types", {}).get("grad_accum_dtype", "fp32" if compute == "fp32" else "fp32")]
        copy_dtype = names[compute]
        size = {"float32": 4, "bfloat16": 2, "float16": 2}
        # Bytes per parameter in the collectives: the gradients, and (partitioned) the compute copies.
        elem = size[dtype] + (gathers * size[copy_dtype] if partitioned else 0)
        rounds = []
        for rnd in range(args.rounds):
            one, many = train(args, tmp, 1, rnd), train(args, tmp, args.ranks, rnd)
            total = int(many["collective_bytes"]) // elem
            script = os.path.join(tmp, "baseline.py")
            with open(script, "w") as f:
                f.write(BASELINE)
            p = subprocess.run(torchrun(args.ranks, [script, str(total), str(sub_group), "5",
                                                     "partitioned" if partitioned else "replicated", dtype, copy_dtype,
                                                     str(gathers)]),
                               capture_output=True, text=True)
            line = [l for l in p.stdout.splitlines() if l.startswith("BASELINE ")]
            if p.returncode != 0 or not line:
                sys.exit("dist_bench: the c10d baseline failed:\n%s" % p.stderr[-3000:])
            rounds.append({"world1": one, "worldN": many, "baseline_s": float(line[0].split()[1])})
            if not args.json:
                print("round %d: world 1 %.3f s/step; world %d %.3f s/step (%.4f s waiting for the slowest rank), "
                      "%d collective bytes, %.4f s in the collectives; c10d's of the same %.4f s" % (
                          rnd + 1, one["step_s"], args.ranks, many["step_s"], many["rank_wait_s"],
                          many["collective_bytes"], many["collective_s"], rounds[-1]["baseline_s"]), file=sys.stderr)
    n = args.ranks
    med = lambda f: statistics.median(f(r) for r in rounds)
    nbytes = med(lambda r: r["worldN"]["collective_bytes"])
    factor = (n - 1) / n if partitioned else 2 * (n - 1) / n
    ours_s, base_s = med(lambda r: r["worldN"]["collective_s"]), med(lambda r: r["baseline_s"])
    result = {
        "ranks": n, "model": args.model, "partitioned": partitioned,
        "baseline": ("c10d reduce_scatter_tensor + %d x all_gather_into_tensor" % gathers if partitioned else "c10d all_reduce"),
        "seq_len": args.seq_len, "rounds": args.rounds,
        "step_s": {"world1": med(lambda r: r["world1"]["step_s"]), "worldN": med(lambda r: r["worldN"]["step_s"])},
        "tokens_per_s": {"world1": med(lambda r: r["world1"]["tokens_per_s"]),
                         "worldN": med(lambda r: r["worldN"]["tokens_per_s"])},
        "collective_bytes_per_step": nbytes,
        "collective_s": ours_s, "baseline_s": base_s, "rank_wait_s": med(lambda r: r["worldN"]["rank_wait_s"]),
        "busbw_gb_s": nbytes * factor / ours_s / 1e9 if ours_s > 0 else 0.0,
        "baseline_busbw_gb_s": nbytes * factor / base_s / 1e9 if base_s > 0 else 0.0,
    }
    result["busbw_ratio"] = result["busbw_gb_s"] / result["baseline_busbw_gb_s"] if result["baseline_busbw_gb_s"] else 0.0
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print("world 1: %.3f s/step, %.0f tok/s | world %d: %.3f s/step, %.0f tok/s (all ranks)" % (
            result["step_s"]["world1"], result["tokens_per_s"]["world1"], n, result["step_s"]["worldN"],
            result["tokens_per_s"]["worldN"]))
        print("collectives per step (%s): %s bytes per rank, %.4f s -> bus bandwidth %.2f GB/s; %s of the "
              "same sizes: %.4f s -> %.2f GB/s; ratio %.2f" % (
                  "gradients reduced to their owners, parameters all-gathered" if partitioned else "gradient all-reduce",
                  format(int(nbytes), ","), ours_s, result["busbw_gb_s"], result["baseline"], base_s,
                  result["baseline_busbw_gb_s"], result["busbw_ratio"]))


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Data parallel as a user launches it: `torchrun --no-python --nproc-per-node N zoffload train ...`
on CPU ranks joined by c10d's TCPStore and Gloo.

- world 2 x micro-batch 1 trains like world 1 x micro-batch 2 (the same rows per step): losses and
  grad norms to REL_TOL, final fp32 weights to WEIGHT_ATOL (the reduction order differs);
- at world 2 the weights are bit-identical whether the states live on the device, in CPU memory or
  on NVMe, and whether the states are replicated (ZeRO stage 0) or partitioned (stage 1: the
  optimizer states; stage 3: the gradient accumulators and the compute copies too, each block
  gathered from its owners at fetch), where each rank holds half of them, in fp32 and in bf16; the
  end-of-run export, made by all ranks together at stage 3, writes what `zoffload export` writes
  from the final checkpoint; 1000-element reduce and all-gather buckets change nothing; with 8-bit
  moments (zoffload.moment_dtype) too, on NVMe and in CPU memory; without gradient accumulators
  (each rank stepping its partition during backward) the stored path's bits;
- a checkpoint saved at world 2 (its manifest says so) resumes at world 1 and at world 3 with the same
  global batch and continues like the uninterrupted run, to the same tolerances;
- one rank killed (SIGKILL) or stalled (SIGSTOP) mid-run: the other exits non-zero within
  --dist-timeout, naming the rank, and the last checkpoint still verifies;
- `zoffload plan --ranks 2` predicts rank 0's NVMe bytes per step exactly (stage 1 with the
  accumulators on NVMe, stage 3 with the compute copies there);
- launches the build cannot serve are one line and exit 2: no MASTER_ADDR, a train_batch_size the
  world size does not divide; a plan that needs more than a rank's share of the node's RAM fails at
  start on every rank;
- tools/dist_bench.py (the data-parallel benchmark) runs and its JSON is consistent.

torchrun itself starts the first world-2 run and the world-3 resume; the other runs' ranks are
started as torchrun starts them (launch(): its environment, and its store served by this process),
without the 3 s of CPU its own Python start takes each time.

- a rank stalled while the other saves a checkpoint: the save fails and the survivor stops there,
  within one --dist-timeout, instead of training on into a second wait;

usage: dist_cli_test.py ZOFFLOAD SOURCE_DIR SLOW_FALLOCATE_SO"""
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

from cli_checks import expect, report_and_exit

try:
    import numpy as np
    import torch.distributed
    from safetensors import safe_open
    from safetensors.numpy import load_file
except ImportError as e:  # the oracle readers come with tools/requirements.txt
    print("skipped: %s" % e)
    sys.exit(77)

zoffload, source_dir, slow_shim = sys.argv[1], sys.argv[2], sys.argv[3]
corpus = os.path.join(source_dir, "configs", "data", "demo_corpus.txt")
REL_TOL = 1e-5       # losses and grad norms: the same rows, summed in another order
WEIGHT_ATOL = 2e-6   # final weights after 4 AdamW steps at lr 3e-4 (each step moves a weight by <= ~lr)
STEPS = 4

with open(os.path.join(source_dir, "configs", "tiny_demo_nvme.json")) as f:
    BASE = json.load(f)
BASE["bf16"] = {"enabled": False}  # fp32: exact arithmetic to compare, and fast on any CPU


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_config(tmp, name, micro, gas, placement="nvme", ckpt_every=None, tbs=None, stage=None, grads=None,
                 buckets=None, moments=None, store=None, master=None, clipping=None, schedule=None):
    c = json.loads(json.dumps(BASE))
    if clipping is not None:
        c["gradient_clipping"] = clipping
    if schedule is not None:
        c["zoffload"]["schedule"] = schedule
    if master is not None:  # bf16 masters need bf16 compute
        c["zoffload"]["master_dtype"] = master
        c["bf16"] = {"enabled": True}
    if store is not None:
        c["zoffload"]["gradient_store_dtype"] = store
    if moments is not None:
        c["zoffload"]["moment_dtype"] = moments
    if buckets is not None:
        c["zero_optimization"]["reduce_bucket_size"] = buckets
        c["zero_optimization"]["allgather_bucket_size"] = buckets
    if grads is not None:
        c["zoffload"]["gradient_accumulators"] = grads
    if stage is not None:
        c["zero_optimization"]["stage"] = stage
    c["train_micro_batch_size_per_gpu"] = micro
    c["gradient_accumulation_steps"] = gas
    if tbs is not None:
        c["train_batch_size"] = tbs
    z = c["zero_optimization"]
    if placement == "none":
        z["offload_param"] = {"device": "none"}
        z["offload_optimizer"] = {"device": "none"}
    elif placement == "cpu":
        z["offload_param"] = {"device": "cpu", "pin_memory": True}
        z["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if ckpt_every:
        c["zoffload"]["checkpoint"] = {"dir": "ckpt", "every_steps": ckpt_every, "keep_last": 4}
    path = os.path.join(tmp, name + ".json")
    with open(path, "w") as f:
        json.dump(c, f)
    return path


def train_args(cfg, out, steps=STEPS, extra=()):
    return ["train", "--config", cfg, "--model", "tiny", "--data", corpus, "--out", out, "--steps", str(steps),
            "--seq-len", "64", "--dist-timeout", "60"] + list(extra)


def torchrun(n, args, timeout=600):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--no-python", "--nproc-per-node", str(n),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), zoffload] + args
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def launch(n, args, timeout=600):
    """What torchrun(n, args) runs, without torchrun: n ranks of zoffload with the environment
    torchrun's local agent gives its workers (OMP_NUM_THREADS 1 unless set, the agent's store, which
    this process serves as the agent does). The exit status is the first failed rank's, the output
    rank 0's then the others'."""
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    files, procs = [], []
    try:
        for rank in range(n):
            env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", ROLE_RANK=str(rank),
                       ROLE_NAME="default", LOCAL_WORLD_SIZE=str(n), WORLD_SIZE=str(n), GROUP_WORLD_SIZE="1",
                       ROLE_WORLD_SIZE=str(n), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port),
                       TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_MAX_RESTARTS="0", TORCHELASTIC_RUN_ID="none",
                       TORCHELASTIC_USE_AGENT_STORE="True",
                       TORCH_NCCL_ASYNC_ERROR_HANDLING=os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
                       OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
            # Files, not pipes: a rank blocked on a full pipe could hold the other in a collective.
            out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
            files.append((out, err))
            procs.append(subprocess.Popen([zoffload] + args, stdout=out, stderr=err, text=True, env=env))
        deadline = time.time() + timeout
        for proc in procs:
            proc.wait(timeout=max(deadline - time.time(), 1))
    except subprocess.TimeoutExpired:
        for proc in procs:
            proc.kill()
            proc.wait()
        raise
    finally:
        del store
    texts = []
    for out, err in files:
        out.seek(0)
        err.seek(0)
        texts.append((out.read(), err.read()))
        out.close()
        err.close()
    rc = next((proc.returncode for proc in procs if proc.returncode != 0), 0)
    return subprocess.CompletedProcess([zoffload] + args, rc, "".join(o for o, _ in texts), "".join(e for _, e in texts))


def single(args, timeout=600):
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT")}
    return subprocess.run([zoffload] + args, capture_output=True, text=True, timeout=timeout, env=env)


def metrics(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def weights(out, step=STEPS):
    """The export's tensors as fp32 numpy arrays (a bf16 export widened exactly: numpy has no bf16)."""
    path = os.path.join(out, "hf-export-step-%d" % step, "model.safetensors")
    with safe_open(path, framework="pt") as f:
        return {k: f.get_tensor(k).float().numpy() for k in f.keys()}


def error_line(err):
    """The tool's own error line (the last one it printed), and whether a C++ backtrace came with it.

    c10d logs a failed store call with its backtrace, from whichever thread made it: a rank's stderr
    must show which rank failed, not 20 lines of frames (Note [A rank that fails])."""
    lines = [l for l in err.splitlines() if l.startswith("zoffload train") and "error:" in l]
    return (lines[-1] if lines else ""), "Exception raised from" in err


def close(a, b, rel=REL_TOL):
    return abs(a - b) <= rel * max(abs(a), abs(b), 1e-12)


def compare_runs(label, ref_out, out, steps):
    """Losses and grad norms of `steps` (1-based) and the final weights of two runs, within tolerance."""
    ref = {m["step"]: m for m in metrics(ref_out)}
    got = {m["step"]: m for m in metrics(out)}
    for s in steps:
        if not expect(s in ref and s in got, "%s: step %d in both metrics" % (label, s)):
            return
        for key in ("loss", "grad_norm"):
            expect(close(ref[s][key], got[s][key]),
                   "%s: step %d %s %.9g vs %.9g (rel tol %g)" % (label, s, key, ref[s][key], got[s][key], REL_TOL))
        expect(ref[s]["tokens"] == got[s]["tokens"], "%s: step %d trains the same tokens" % (label, s))
    wa, wb = weights(ref_out), weights(out)
    expect(sorted(wa) == sorted(wb), "%s: the same tensors" % label)
    worst = max(float(np.max(np.abs(wa[k].astype(np.float64) - wb[k].astype(np.float64)))) for k in wa)
    expect(worst <= WEIGHT_ATOL, "%s: final weights within %g (max |diff| %.3g)" % (label, WEIGHT_ATOL, worst))
    print("%s: max |weight diff| %.3g" % (label, worst))


with tempfile.TemporaryDirectory(dir=os.environ.get("MESON_BUILD_ROOT")) as tmp:
    # ---- launches that cannot be served: one line, exit 2, before any rendezvous --------------------
    cfg = write_config(tmp, "refuse", 1, 1)
    env = dict(os.environ, WORLD_SIZE="2", RANK="1")
    env.pop("MASTER_ADDR", None)
    p = subprocess.run([zoffload] + train_args(cfg, os.path.join(tmp, "refused")), capture_output=True, text=True,
                       timeout=120, env=env)
    expect(p.returncode == 2 and "MASTER_ADDR is not set" in p.stderr and len(p.stderr.strip().splitlines()) == 1,
           "a rank without MASTER_ADDR is refused in one line: exit %d: %s" % (p.returncode, p.stderr))
    cfg = write_config(tmp, "tbs", 1, 1, tbs=3)
    env = dict(os.environ, WORLD_SIZE="2", RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    p = subprocess.run([zoffload] + train_args(cfg, os.path.join(tmp, "refused")), capture_output=True, text=True,
                       timeout=120, env=env)
    expect(p.returncode == 2 and "train_batch_size" in p.stderr and "world size" in p.stderr,
           "train_batch_size 3 at world 2 is refused naming the key: exit %d: %s" % (p.returncode, p.stderr))

    # Each of two ranks of one node is planned with half the node's RAM, so a config that needs more
    # than half (tinyllama-1.1b in fp32 with its states in RAM: ~14 GiB per rank with the optimizer
    # states partitioned) is refused at start by both, before anything large is
    # allocated, saying why.
    big = os.path.join(tmp, "big.json")
    with open(big, "w") as f:
        json.dump({"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                   "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                                         "offload_optimizer": {"device": "cpu"}}}, f)
    # The two ranks are started by hand, as torchrun starts them: torchrun stops the other workers as
    # soon as one exits, so under load rank 1 could be stopped before it has said why.
    port = str(free_port())
    procs = []
    for rank in range(2):
        env = dict(os.environ, WORLD_SIZE="2", RANK=str(rank), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        procs.append(subprocess.Popen([zoffload, "train", "--config", big, "--model", "tinyllama-1.1b", "--data",
                                       corpus, "--out", os.path.join(tmp, "big"), "--steps", "1", "--seq-len", "64"],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
    for rank, proc in enumerate(procs):
        _, err = proc.communicate(timeout=300)
        expect(proc.returncode == 1 and "each of this node's 2 ranks is planned with 1/2 of its RAM" in err and
               "OutOfMemory: the plan does not fit" in err and (rank == 0 or "rank 1: error:" in err),
               "a plan that fits one rank's share of the node's RAM only is refused by rank %d: exit %d: %s"
               % (rank, proc.returncode, err[-2000:]))

    # ---- world 2 x micro 1 == world 1 x micro 2 ---------------------------------------------------------
    w1 = os.path.join(tmp, "w1")
    p = single(train_args(write_config(tmp, "m2", 2, 1), w1))
    expect(p.returncode == 0, "world 1 x micro 2 trains: %s" % p.stderr[-2000:])
    runs = {}
    for placement in ("nvme", "cpu", "none"):
        out = os.path.join(tmp, "w2-" + placement)
        extra = ("--trace", os.path.join(tmp, "w2.trace.json")) if placement == "nvme" else ()
        args = train_args(write_config(tmp, "m1-" + placement, 1, 1, placement), out, extra=extra)
        p = torchrun(2, args) if placement == "nvme" else launch(2, args)
        if expect(p.returncode == 0, "world 2 (%s) trains%s: %s" % (placement, " under torchrun" if placement == "nvme"
                                                                     else "", p.stderr[-3000:])):
            runs[placement] = out
            if placement == "nvme":
                expect("rank 1" not in p.stdout, "only rank 0 prints progress: %s" % p.stdout[-1000:])
                m = metrics(out)
                expect(len(m) == STEPS and all(r["collective_bytes"] > 0 for r in m),
                       "rank 0 writes one metrics line per step, with the collective bytes: %s" % m[-1:])
                # Stage 3: each block is gathered from its owners, forward and backward, on its own track.
                with open(os.path.join(tmp, "w2.trace.json")) as f:
                    events = json.load(f)["traceEvents"]
                tids = {e["tid"] for e in events if e.get("ph") == "M" and e["name"] == "thread_name" and
                        e["args"]["name"] == "parameter gatherer"}
                names = {e["name"] for e in events if e.get("ph") == "X" and e["tid"] in tids}
                expect(any(n.startswith("gather block 1 'model.layers.0'") and n.endswith("(forward)") for n in names) and
                       any(n.endswith("(backward)") for n in names),
                       "the trace has the gatherer's track, forward and backward: %s" % sorted(names)[:6])
    if "nvme" in runs:
        compare_runs("world 2 x micro 1 vs world 1 x micro 2", w1, runs["nvme"], range(1, STEPS + 1))
    if "nvme" in runs:
        # reduce_bucket_size and allgather_bucket_size split the collectives, never change the sums.
        out = os.path.join(tmp, "w2-buckets")
        p = launch(2, train_args(write_config(tmp, "m1-buckets", 1, 1, buckets=1000), out))
        if expect(p.returncode == 0, "world 2 with 1000-element buckets trains: %s" % p.stderr[-3000:]):
            a, b = weights(runs["nvme"]), weights(out)
            expect(all(np.array_equal(a[k].view(np.uint32), b[k].view(np.uint32)) for k in a),
                   "world 2: 1000-element reduce and all-gather buckets give the same weights bit for bit")
    if len(runs) == 3:
        ref = weights(runs["nvme"])
        for placement in ("cpu", "none"):
            other = weights(runs[placement])
            expect(all(np.array_equal(ref[k].view(np.uint32), other[k].view(np.uint32)) for k in ref),
                   "world 2: the weights are bit-identical with the states on nvme and %s" % placement)
            expect([m["loss"] for m in metrics(runs[placement])] == [m["loss"] for m in metrics(runs["nvme"])],
                   "world 2: the losses are identical on nvme and %s" % placement)

    def on_nvme_and_cpu(label, tag, start_line=None, **config):
        """World 2 with write_config's `config` on nvme and on cpu: the weights bit-identical, and not
        the fp32 run's (the variant ran). Returns {placement: run directory} of the runs that trained."""
        outs = {}
        for placement in ("nvme", "cpu"):
            out = os.path.join(tmp, "w2-%s-%s" % (tag, placement))
            p = launch(2, train_args(write_config(tmp, "m1-%s-%s" % (tag, placement), 1, 1, placement, **config),
                                       out))
            if expect(p.returncode == 0, "world 2 with %s (%s) trains: %s" % (label, placement, p.stderr[-3000:])):
                outs[placement] = out
                if start_line:
                    expect(start_line in p.stdout, "world 2 with %s: the start line says %r: %s" %
                           (label, start_line, p.stdout[:1500]))
        if len(outs) == 2 and "nvme" in runs:
            a, b, f = weights(outs["nvme"]), weights(outs["cpu"]), weights(runs["nvme"])
            expect(all(np.array_equal(a[k].view(np.uint32), b[k].view(np.uint32)) for k in a),
                   "world 2, %s: the weights are bit-identical with the states on nvme and cpu" % label)
            expect(any(not np.array_equal(a[k].view(np.uint32), f[k].view(np.uint32)) for k in a),
                   "world 2: %s give other weights than fp32 ones (they ran)" % label)
        return outs

    # 8-bit moments (zoffload.moment_dtype): each rank steps its partition piece by piece, and a
    # partition boundary falls where a split may, on a 4096-element multiple of its parameter, so the
    # blocks are the parameters' whatever the world: on nvme and on cpu the same bits, and not fp32's.
    on_nvme_and_cpu("8-bit moments", "8bit", moments="8bit")

    # Gradients stored in bf16 (zoffload.gradient_store_dtype): at stage 3 each micro-step's fp32 sums
    # are reduced to their owner, which takes their norm and only then rounds them (Note [Gradients
    # stored in 16 bits]): step 1's gradient norm is the fp32 run's bit for bit, the weights are the
    # same on nvme and cpu, and not fp32's. At stage 1 the stored gradients would be summed over the
    # ranks, so it is refused before any rendezvous.
    stored = on_nvme_and_cpu("bf16-stored gradients", "bf16grads", "bf16 gradients (fp32 sums, norm before rounding)",
                             store="bf16")
    if "nvme" in stored and "nvme" in runs:
        g16, g32 = metrics(stored["nvme"])[0]["grad_norm"], metrics(runs["nvme"])[0]["grad_norm"]
        expect(g16 == g32, "world 2: step 1's gradient norm is the fp32 sums' with bf16-stored gradients "
                           "(%.17g vs %.17g)" % (g16, g32))
    # bf16 masters (zoffload.master_dtype, bf16 compute): each rank rounds its partition's masters with
    # random bits keyed by the parameter and the element's index in it, not by the partition: on nvme
    # and on cpu the same bits.
    on_nvme_and_cpu("bf16 masters", "bf16masters", "bf16 masters rounded stochastically", master="bf16")
    p = launch(2, train_args(write_config(tmp, "m1-bf16grads-stage1", 1, 1, "cpu", stage=1, store="bf16"),
                               os.path.join(tmp, "refused-stage1")), timeout=120)
    expect(p.returncode != 0 and "zoffload.gradient_store_dtype" in p.stderr and "stage 2 or 3" in p.stderr,
           "world 2 at stage 1 with bf16-stored gradients is refused naming the key: %s" % p.stderr[-1500:])

    # ---- partitioned (stages 1, 3) vs replicated (stage 0) states at world 2 ---------------------------
    # Note [Partitioned data parallel]: with two ranks the reduce to the owner computes the same sums
    # as the all-reduce (and at GAS 1 stage 2's reduce during backward the same as stage 1's at the
    # boundary), so the runs agree bit for bit. Rank 0 holds half the optimizer states (12 B/param)
    # from stage 1, half the gradient accumulators (4 B/param in fp32) too from stage 2, and half the
    # compute copies (4 B/param in fp32) at stage 3, where each block is gathered from its owners
    # into the coordinator's arena (counted apart: device_arena_bytes).
    # Stage 0 offloads nothing: every run keeps its states on the (emulated) device.
    if "none" in runs:
        n_params = 3033344
        by_stage = {3: runs["none"]}
        for stage in (0, 1):
            out = os.path.join(tmp, "w2-stage%d" % stage)
            p = launch(2, train_args(write_config(tmp, "m1-stage%d" % stage, 1, 1, "none", stage=stage), out))
            if expect(p.returncode == 0, "world 2 at stage %d trains: %s" % (stage, p.stderr[-3000:])):
                by_stage[stage] = out
        if 0 in by_stage:
            rep = by_stage[0]
            def device_states(out):
                m = metrics(out)[-1]
                return m["memory"]["device"]["resident_bytes"] - m["device_arena_bytes"]
            dev0 = device_states(rep)
            for stage, saved_per_param in ((1, 6), (3, 10)):
                if stage not in by_stage:
                    continue
                part = by_stage[stage]
                a, b = weights(rep), weights(part)
                expect(all(np.array_equal(a[k].view(np.uint32), b[k].view(np.uint32)) for k in a),
                       "world 2: stage %d (partitioned) gives the weights of stage 0 (replicated) bit for bit" % stage)
                expect([m["loss"] for m in metrics(rep)] == [m["loss"] for m in metrics(part)] and
                       [m["grad_norm"] for m in metrics(rep)] == [m["grad_norm"] for m in metrics(part)],
                       "world 2: stage %d and stage 0 have the same losses and grad norms" % stage)
                dev = device_states(part)
                saved = dev0 - dev
                expect(abs(saved - saved_per_param * n_params) < 0.02 * saved_per_param * n_params,
                       "rank 0 holds its half at stage %d: device states %d vs %d bytes at stage 0 (%.2f B/param "
                       "saved, want %d)" % (stage, dev, dev0, saved / n_params, saved_per_param))
                print("rank 0 device-resident states: stage 0 %d, stage %d %d" % (dev0, stage, dev))
                for m in metrics(part):
                    expect(m["time_s"]["gather"] > 0, "stage %d step %d: the updated parameters are all-gathered" %
                           (stage, m["step"]))
                    expect((m["time_s"]["grad_reduce"] > 0) == (stage >= 2),
                           "stage %d step %d: gradients reduced during backward only from stage 2 (%g s)" %
                           (stage, m["step"], m["time_s"]["grad_reduce"]))

    # ---- bf16: the parameters gathered per block (stage 3) give stage 0's bits ---------------------------
    # The blocks travel in bf16 (the compute copies' dtype) and the export is bf16, from the compute
    # copies: the same bytes as the replicated run's.
    bf = {}
    for stage in (0, 3):
        cfg = write_config(tmp, "bf16-stage%d" % stage, 1, 1, "none", stage=stage)
        with open(cfg) as f:
            c = json.load(f)
        c["bf16"] = {"enabled": True}
        with open(cfg, "w") as f:
            json.dump(c, f)
        out = os.path.join(tmp, "bf16-stage%d" % stage)
        p = launch(2, train_args(cfg, out))
        if expect(p.returncode == 0, "world 2 in bf16 at stage %d trains: %s" % (stage, p.stderr[-3000:])):
            bf[stage] = out
    if len(bf) == 2:
        def export_bytes(out):  # numpy has no bfloat16: the files themselves
            with open(os.path.join(out, "hf-export-step-%d" % STEPS, "model.safetensors"), "rb") as f:
                return f.read()
        expect(export_bytes(bf[0]) == export_bytes(bf[3]) and
               [m["loss"] for m in metrics(bf[0])] == [m["loss"] for m in metrics(bf[3])],
               "world 2 in bf16: stage 3 (parameters gathered per block) gives stage 0's losses and weights bit for bit")

    # ---- stage 3 at world 2 with gradient accumulation: partitioned accumulators in RAM and on NVMe --
    # (the owner adds each micro-step's reduced sum to its accumulator in place, or through a host
    # buffer read back from NVMe): the same bits, as every placement at a fixed world size.
    acc = {}
    for grads in ("cpu", "nvme"):
        out = os.path.join(tmp, "w2-gas2-" + grads)
        p = launch(2, train_args(write_config(tmp, "g2-" + grads, 1, 2, grads=grads), out))
        if expect(p.returncode == 0, "world 2 x GAS 2, accumulators on %s, trains: %s" % (grads, p.stderr[-3000:])):
            acc[grads] = out
    if len(acc) == 2:
        a, b = weights(acc["cpu"]), weights(acc["nvme"])
        expect(all(np.array_equal(a[k].view(np.uint32), b[k].view(np.uint32)) for k in a) and
               [m["grad_norm"] for m in metrics(acc["cpu"])] == [m["grad_norm"] for m in metrics(acc["nvme"])],
               "world 2 x GAS 2: partitioned accumulators on cpu and nvme give the same weights and norms")
        expect(metrics(acc["nvme"])[-1]["memory"]["nvme_write_bytes"] > metrics(acc["cpu"])[-1]["memory"]["nvme_write_bytes"],
               "the nvme run's accumulators do go to the drive")

    # ---- no gradient accumulators at world 2 (Note [No accumulator]) ------------------------------------
    # Without clipping, each rank steps the sub-groups it owns as their gradients are reduced to it,
    # during backward: at stage 3 with GAS 2 on the vertical schedule, the weights, losses and norms
    # of the stored path bit for bit; at stage 1 it is refused naming the stage.
    direct = {}
    for grads in ("cpu", "none"):
        out = os.path.join(tmp, "w2-direct-" + grads)
        p = launch(2, train_args(write_config(tmp, "d2-" + grads, 1, 2, "cpu", grads=grads, clipping=0,
                                                schedule="vertical"), out))
        if expect(p.returncode == 0, "world 2, accumulators %s, no clipping, trains: %s" % (grads, p.stderr[-3000:])):
            direct[grads] = out
            if grads == "none":
                expect("no gradient accumulators" in p.stdout, "the start line says so: %s" % p.stdout[:1500])
    if len(direct) == 2:
        a, b = weights(direct["cpu"]), weights(direct["none"])
        ma, mb = metrics(direct["cpu"]), metrics(direct["none"])
        expect(all(np.array_equal(a[k].view(np.uint32), b[k].view(np.uint32)) for k in a) and
               [(m["loss"], m["grad_norm"]) for m in ma] == [(m["loss"], m["grad_norm"]) for m in mb],
               "world 2: no accumulators gives the stored path's weights, losses and norms bit for bit")
    p = launch(2, train_args(write_config(tmp, "d2-stage1", 1, 1, "cpu", stage=1, grads="none", clipping=0),
                               os.path.join(tmp, "refused-direct-stage1")), timeout=120)
    expect(p.returncode != 0 and "zoffload.gradient_accumulators" in p.stderr and "stage 2 or 3" in p.stderr,
           "world 2 at stage 1 without accumulators is refused naming the key: %s" % p.stderr[-1500:])

    # ---- save at world 2, resume at world 1 and world 3 (the same 6 rows per step) -------------------
    full = os.path.join(tmp, "full")
    p = launch(2, train_args(write_config(tmp, "g3", 1, 3, ckpt_every=2), full))
    if expect(p.returncode == 0, "world 2 x GAS 3 with checkpoints trains: %s" % p.stderr[-3000:]):
        step2 = os.path.join(full, "ckpt", "step-2")
        q = single(["ckpt", "inspect", step2, "--json"])
        expect(q.returncode == 0 and json.loads(q.stdout).get("world_size") == 2,
               "the checkpoint names its world size: %s %s" % (q.stdout[-500:], q.stderr[-500:]))
        # The end-of-run export, made by both ranks together from their compute copies (stage 3: no
        # rank holds every weight), writes what `zoffload export` writes from the final checkpoint's
        # masters.
        from_ckpt = os.path.join(tmp, "export-from-ckpt")
        q = single(["export", "--checkpoint", os.path.join(full, "ckpt", "step-%d" % STEPS), "--dtype", "fp32",
                    "--out", from_ckpt, "-q"])
        if expect(q.returncode == 0, "zoffload export of the final checkpoint: %s" % q.stderr[-1000:]):
            a, b = weights(full), load_file(os.path.join(from_ckpt, "model.safetensors"))
            expect(sorted(a) == sorted(b) and all(np.array_equal(a[k].view(np.uint32), b[k].view(np.uint32)) for k in a),
                   "world 2 at stage 3: the gathered end-of-run export equals the export of the final checkpoint")
        out1 = os.path.join(tmp, "resume-w1")
        p = single(train_args(write_config(tmp, "g6", 1, 6), out1, extra=["--resume", step2]))
        if expect(p.returncode == 0, "resumed at world 1 x GAS 6: %s" % p.stderr[-2000:]):
            compare_runs("world 2 -> world 1", full, out1, [3, 4])
        out3 = os.path.join(tmp, "resume-w3")
        p = torchrun(3, train_args(write_config(tmp, "g2", 1, 2), out3, extra=["--resume", step2]))
        if expect(p.returncode == 0, "resumed at world 3 x GAS 2: %s" % p.stderr[-3000:]):
            compare_runs("world 2 -> world 3", full, out3, [3, 4])

    # ---- the planner's NVMe bytes per step for a rank are what the rank moves ---------------------------
    # Stage 1 with the accumulators on NVMe (the boundary reads every accumulator to reduce it, the
    # owner writes its sums back and its optimizer reads them again); stage 3 with the compute copies
    # on NVMe (the owner reads its part of every block at every fetch). Steady steps: 2 to 3.
    def nvme_config(name, stage):
        c = json.loads(json.dumps(BASE))
        z = c["zero_optimization"]
        z["stage"] = stage
        if stage == 1:
            z["offload_param"] = {"device": "none"}
            c["zoffload"]["gradient_accumulators"] = "nvme"
        else:
            z["offload_param"] = {"device": "nvme", "nvme_path": "zoffload-nvme", "max_in_cpu": 0, "buffer_size": 2e7}
        path = os.path.join(tmp, name + ".json")
        with open(path, "w") as f:
            json.dump(c, f)
        return path
    for stage in (1, 3):
        cfg = nvme_config("nvme-stage%d" % stage, stage)
        out = os.path.join(tmp, "nvme-stage%d" % stage)
        p = launch(2, train_args(cfg, out))
        q = single(["plan", "--config", cfg, "--model", "tiny", "--seq-len", "64", "--ranks", "2", "--no-measure",
                    "--json", "--out", out])
        if expect(p.returncode == 0 and q.returncode in (0, 3), "stage %d on NVMe trains and plans at world 2: %s %s" %
                  (stage, p.stderr[-2000:], q.stderr[-1000:])):
            m = {r["step"]: r["memory"] for r in metrics(out)}
            got = (m[3]["nvme_read_bytes"] - m[2]["nvme_read_bytes"], m[3]["nvme_write_bytes"] - m[2]["nvme_write_bytes"])
            per_step = json.loads(q.stdout)["per_step"]
            want = (per_step["nvme_read_bytes"], per_step["nvme_write_bytes"])
            expect(per_step["nvme_exact"] and got == want,
                   "stage %d at world 2: rank 0 moves the planned NVMe bytes per step: read, written %s, planned %s" %
                   (stage, got, want))

    # ---- tools/dist_bench.py runs and reports consistent figures --------------------------------------
    p = subprocess.run([sys.executable, os.path.join(source_dir, "tools", "dist_bench.py"), "--zoffload", zoffload,
                        "--rounds", "1", "--steps", "3", "--seq-len", "64", "--json"],
                       capture_output=True, text=True, timeout=600)
    if expect(p.returncode == 0, "dist_bench.py runs: %s" % p.stderr[-2000:]):
        b = json.loads(p.stdout)
        expect(b["ranks"] == 2 and b["collective_bytes_per_step"] > 0 and b["step_s"]["world1"] > 0 and
               b["step_s"]["worldN"] > 0 and b["busbw_gb_s"] > 0 and b["baseline_busbw_gb_s"] > 0 and
               abs(b["busbw_ratio"] - b["busbw_gb_s"] / b["baseline_busbw_gb_s"]) < 1e-9,
               "dist_bench.py's JSON has its figures and their ratio: %s" % p.stdout)

    # ---- a rank that dies or stalls ---------------------------------------------------------------------
    def launch_ranks(name, timeout_s, placement="nvme", rank0_env=None):
        cfg = write_config(tmp, name, 1, 1, placement=placement, ckpt_every=1)
        out = os.path.join(tmp, name)
        port = str(free_port())
        procs = []
        for r in range(2):
            env = dict(os.environ, WORLD_SIZE="2", RANK=str(r), LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=port, **(rank0_env if r == 0 and rank0_env else {}))
            args = train_args(cfg, out, steps=100000)
            args[args.index("--dist-timeout") + 1] = str(timeout_s)
            procs.append(subprocess.Popen([zoffload] + args, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          text=True, env=env))
        deadline = time.time() + 300
        path = os.path.join(out, "metrics.jsonl")
        while time.time() < deadline and all(p.poll() is None for p in procs):
            if os.path.exists(path) and len(open(path).read().splitlines()) >= 2:
                break
            time.sleep(0.2)
        return out, procs

    for victim, sig, timeout_s in [(1, signal.SIGKILL, 60), (0, signal.SIGKILL, 60), (1, signal.SIGSTOP, 10)]:
        name = "fail-%d-%s" % (victim, signal.Signals(sig).name)
        out, procs = launch_ranks(name, timeout_s)
        if not expect(all(p.poll() is None for p in procs), "%s: both ranks train" % name):
            for p in procs:
                p.kill()
            continue
        survivor = procs[1 - victim]
        t0 = time.time()
        procs[victim].send_signal(sig)
        try:
            _, err = survivor.communicate(timeout=timeout_s + 60)
        except subprocess.TimeoutExpired:
            survivor.kill()
            _, err = survivor.communicate()
            err = "(still running after %d s) %s" % (timeout_s + 60, err)
        took = time.time() - t0
        procs[victim].kill()
        procs[victim].communicate()
        last, backtrace = error_line(err)
        expect(survivor.returncode not in (0, None) and ("rank %d of 2 did not respond" % victim) in last,
               "%s: rank %d exits non-zero naming rank %d: exit %s: %s" % (name, 1 - victim, victim, survivor.returncode, err[-1500:]))
        expect(not backtrace, "%s: no C++ backtrace on rank %d's stderr: %s" % (name, 1 - victim, err[-1500:]))
        expect(took <= timeout_s + 30, "%s: within --dist-timeout %d s (+ the check-in): %.1f s" % (name, timeout_s, took))
        print("%s: the survivor stopped after %.1f s: %s" % (name, took, last))
        q = single(["ckpt", "verify", os.path.join(out, "ckpt")])
        expect(q.returncode == 0, "%s: the last checkpoint verifies: %s %s" % (name, q.stdout[-500:], q.stderr[-500:]))

    # Issue 40: a rank that stalls while rank 0 saves once cost the timeout twice: the failed save
    # was a warning, so rank 0 trained on into the next collective and waited again. The shim holds
    # each ftruncate of rank 0 (sizing the checkpoint's files) for DELAY s; rank 1 is stopped then.
    delay_s, timeout_s = 3, 20
    name = "stall-during-save"
    out, procs = launch_ranks(name, timeout_s, placement="cpu",
                              rank0_env={"LD_PRELOAD": slow_shim, "ZO_TEST_FTRUNCATE_DELAY_MS": str(delay_s * 1000)})
    ckpt = os.path.join(out, "ckpt")
    deadline = time.time() + 300
    saving = []
    while time.time() < deadline and not saving and all(p.poll() is None for p in procs):
        saving = [d for d in (os.listdir(ckpt) if os.path.isdir(ckpt) else []) if d.startswith("tmp-") and
                  os.listdir(os.path.join(ckpt, d))]
        time.sleep(0.05)
    if expect(saving and all(p.poll() is None for p in procs), "%s: rank 0 is sizing a save's files: %s" % (name, saving)):
        t0 = time.time()
        procs[1].send_signal(signal.SIGSTOP)
        try:
            _, err = procs[0].communicate(timeout=3 * delay_s + 2 * timeout_s + 60)
        except subprocess.TimeoutExpired:
            procs[0].kill()
            _, err = procs[0].communicate()
        took = time.time() - t0
        last, backtrace = error_line(err)
        expect(procs[0].returncode == 1 and "checkpoint after step" in last and "rank 1 of 2 did not respond" in last,
               "%s: rank 0 stops at the failed save, naming rank 1: exit %s: %s" % (name, procs[0].returncode, err[-1500:]))
        expect(not backtrace, "%s: no C++ backtrace on rank 0's stderr: %s" % (name, err[-1500:]))
        expect(took <= 3 * delay_s + timeout_s + 20,
               "%s: within one --dist-timeout (%d s) of the stall, not two: %.1f s" % (name, timeout_s, took))
        print("%s: rank 0 stopped after %.1f s: %s" % (name, took, last))
    for p in procs:
        p.kill()
        p.communicate()

report_and_exit()

#!/usr/bin/env python3
"""`zoffload plan` predicts what `zoffload train` then measures (metrics.jsonl): on the tiny preset
with several placements and on the 1B-class tinyllama-1.1b, the per-tier peaks (device states and
arena, pinned pool, CPU, NVMe swap files) equal the measured ones, LibTorch's activation peak is
within 10% (1 MiB at the tiniest shapes, for oneDNN's bf16 scratch), and NVMe bytes per step (the second step, when every state has been written once) are
exact (the vertical schedule's too); with compute copies on NVMe the measured reads lie in the
predicted range. Beside the engine's own accounting, what the device and the OS measured: the host
bytes the device holds pinned equal the planned pinned bytes, and the process's peak RSS (VmHWM)
stays within the planned RAM plus a fixed allowance for the runtime. A plan that does not
fit exits 3 and lists changes that, planned again, fit; `train` refuses it at start with the
planner's message. A target machine given by flags (--host-ram, --gpu-memory, --disk-free, ...) is
planned in place of this one; the shipped LoRA configs (QLoRA of llama3-70b, LoRA over llama3-8b)
fit the 24 GB card and 60 GiB host they are for with no drive in the step."""
import json
import os
import subprocess
import sys
import tempfile

from cli_checks import expect, report_and_exit

zoffload, source_dir = sys.argv[1], sys.argv[2]
corpus = os.path.join(source_dir, "configs", "data", "demo_corpus.txt")
KERNEL_SCRATCH = 1 << 20  # bytes: see check()
# What no plan counts: LibTorch's intra-op pool and kernel scratch, oneDNN's JIT code, glibc's
# per-thread arenas and the threads' stacks, grown after `zoffload plan` measured the process (a
# fixed part), and the heap that LibTorch's freed activation buffers leave behind under the trainer's
# trim threshold (Note [Host compute]; a part of the RAM). On a 2-core AMD EPYC (AVX2) the tiny cases
# peaked 30-40 MiB above the plan, tinyllama-1.1b 241 MiB above its 10.9 GB (2.2%).
RUNTIME_ALLOWANCE = 96 << 20
RUNTIME_ALLOWANCE_SHARE = 0.05
ENV = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))


def config(prec="bf16", micro=1, gas=1, opt="cpu", par="cpu", max_in_cpu=None, sub_group=1e6, **extra):
    c = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas,
         "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
         "zero_optimization": {"stage": 3, "sub_group_size": sub_group,
                               "offload_param": {"device": par}, "offload_optimizer": {"device": opt}}}
    if opt == "nvme":
        c["zero_optimization"]["offload_optimizer"]["nvme_path"] = "nvme"
    if par == "nvme":
        c["zero_optimization"]["offload_param"]["nvme_path"] = "nvme"
    if max_in_cpu is not None:
        c["zero_optimization"]["offload_param"]["max_in_cpu"] = max_in_cpu
    if prec != "fp32":
        c[prec] = {"enabled": True}
    c.update(extra)
    return c


def plan_and_train(tmp, name, model, seq, steps, cfg):
    run_dir = os.path.join(tmp, name)
    os.makedirs(run_dir)
    path = os.path.join(run_dir, "config.json")
    with open(path, "w") as f:
        json.dump(cfg, f)
    p = subprocess.run([zoffload, "plan", "--config", path, "--model", model, "--seq-len", str(seq), "--out", run_dir,
                        "--json", "--no-measure"], capture_output=True, text=True, env=ENV, timeout=300)
    expect(p.returncode == 0, f"{name}: plan exits 0 (fits): {p.returncode} {p.stderr}")
    plan = json.loads(p.stdout)
    t = subprocess.run([zoffload, "train", "--config", path, "--model", model, "--data", corpus, "--steps", str(steps),
                        "--seq-len", str(seq), "--out", run_dir, "--json"], capture_output=True, text=True, env=ENV,
                       timeout=900)
    expect(t.returncode == 0, f"{name}: train runs: {t.stderr[-2000:]}")
    if t.returncode != 0:
        return plan, None
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        metrics = [json.loads(line) for line in f]
    summary = json.loads(t.stdout)
    expect(summary["plan"]["n_params"] == plan["n_params"], f"{name}: train reports the same plan")
    return plan, metrics


def check(name, plan, metrics):
    if metrics is None:
        return
    last = metrics[-1]
    mem = last["memory"]
    dev = plan["device"]
    host = plan["host"]
    expect(mem["device"]["peak_bytes"] == dev["state_bytes"] + dev["arena_bytes"],
           f"{name}: device peak {mem['device']['peak_bytes']} == planned states + arena "
           f"{dev['state_bytes'] + dev['arena_bytes']}")
    expect(mem["pinned"]["peak_bytes"] == host["pinned_bytes"],
           f"{name}: pinned peak {mem['pinned']['peak_bytes']} == planned {host['pinned_bytes']}")
    scratch = 4 << 20
    cpu = host["pool_bytes"] + host["pageable_state_bytes"] + host["checkpoint_bytes"] + scratch
    expect(mem["cpu"]["peak_bytes"] == cpu,
           f"{name}: CPU peak {mem['cpu']['peak_bytes']} == planned pool + pageable + checkpoints + scratch {cpu}")
    # The device's own count of what it pinned (the pool and the checkpoint slab), not the engine's.
    expect(last["device_pinned_bytes"] == host["pinned_bytes"],
           f"{name}: the device holds {last['device_pinned_bytes']} bytes pinned, planned {host['pinned_bytes']}")
    # The OS's: every byte the run allocates is in the plan, up to the runtime's allowance. On the
    # emulated device its states and arena are host RAM too.
    on_host = dev["state_bytes"] + dev["arena_bytes"] if plan["device_name"].startswith("host") else 0
    planned_rss = host["ram_bytes"] + host["process_bytes"] + on_host
    rss = last["process_peak_rss_bytes"]
    allowance = RUNTIME_ALLOWANCE + int(RUNTIME_ALLOWANCE_SHARE * planned_rss)
    expect(0 < rss <= planned_rss + allowance,
           f"{name}: peak RSS {rss} within the planned RAM {planned_rss} + {allowance} "
           f"({(rss - planned_rss) / (1 << 20):+.1f} MiB)")
    nvme = plan["nvme"]["optimizer_file_bytes"] + plan["nvme"]["param_file_bytes"]
    expect(mem["nvme"]["peak_bytes"] == nvme, f"{name}: NVMe files {mem['nvme']['peak_bytes']} == planned {nvme}")
    act = plan["device"]["activation_bytes"]
    meas = last["torch_peak_bytes"]
    # Within 10%, or within KERNEL_SCRATCH at the smallest shapes: where LibTorch multiplies bf16
    # through oneDNN (CPUs with AVX-512 but no native bf16, such as an Ice Lake-class Xeon), its
    # reorders add a few hundred KB that the measured coefficients (Note [Activation estimate])
    # do not hold: tiny bf16 at B*T 16/32/64 peaked 398/486/603 KB above the plan there
    # (+26/+29/+31%), at B*T 128 217 KB (+7%).
    expect(abs(act - meas) <= max(0.10 * meas, KERNEL_SCRATCH),
           f"{name}: activations planned {act} within 10% (or {KERNEL_SCRATCH} bytes) of measured {meas} "
           f"({act / meas - 1:+.1%})")
    if len(metrics) >= 2:
        rd = metrics[1]["memory"]["nvme_read_bytes"] - metrics[0]["memory"]["nvme_read_bytes"]
        wr = metrics[1]["memory"]["nvme_write_bytes"] - metrics[0]["memory"]["nvme_write_bytes"]
        ps = plan["per_step"]
        expect(wr == ps["nvme_write_bytes"], f"{name}: NVMe written per step {wr} == planned {ps['nvme_write_bytes']}")
        if ps["nvme_exact"]:
            expect(rd == ps["nvme_read_bytes"], f"{name}: NVMe read per step {rd} == planned {ps['nvme_read_bytes']}")
        else:
            expect(ps["nvme_read_min_bytes"] <= rd <= ps["nvme_read_max_bytes"],
                   f"{name}: NVMe read per step {rd} within the planned [{ps['nvme_read_min_bytes']}, "
                   f"{ps['nvme_read_max_bytes']}]")


with tempfile.TemporaryDirectory() as tmp:
    cases = [
        ("tiny-cpu-fp32", "tiny", 128, config(prec="fp32", micro=2)),
        ("tiny-nvme-bf16-gas2", "tiny", 64, config(opt="nvme", gas=2)),
        # The gradient accumulators apart from the optimizer states, both ways ("auto" keeps them
        # in RAM beside an NVMe optimizer on a host with room, as in the case above).
        ("tiny-nvme-grads-nvme-gas2", "tiny", 64, config(opt="nvme", gas=2,
                                                          zoffload={"gradient_accumulators": "nvme"})),
        ("tiny-optcpu-grads-nvme-gas2", "tiny", 64,
         config(opt="cpu", gas=2, zoffload={"gradient_accumulators": "nvme"},
                zero_optimization={"stage": 3, "sub_group_size": 1e6, "offload_param": {"device": "cpu"},
                                   "offload_optimizer": {"device": "cpu", "nvme_path": "nvme"}})),
        ("tiny-nvme-params", "tiny", 64, config(opt="nvme", par="nvme", max_in_cpu=0)),
        ("tiny-optcpu-params-nvme", "tiny", 256, config(opt="cpu", par="nvme", max_in_cpu=0, micro=2, gas=2)),
        # The vertical schedule: every micro-batch's checkpoints held at once, the accumulators
        # written once per step.
        ("tiny-nvme-bf16-gas3-vertical", "tiny", 128, config(opt="nvme", micro=2, gas=3,
                                                             zoffload={"schedule": "vertical",
                                                                       "gradient_accumulators": "nvme"})),
        # The decoder layers' inputs in pinned host slots between forward and backward.
        ("tiny-nvme-bf16-gas3-ckpt-cpu", "tiny", 128, config(opt="nvme", micro=2, gas=3,
                                                             zoffload={"schedule": "vertical",
                                                                       "activation_checkpoints": "cpu"})),
        ("tiny-device", "tiny", 64, config(opt="none", par="none", prec="fp32")),
        # zoffload.freeze: the frozen params' sub-groups hold compute copies only (on NVMe here), and
        # their NVMe traffic is reads alone.
        ("tiny-nvme-frozen", "tiny", 64, config(opt="nvme", par="nvme", max_in_cpu=0, gas=2,
                                                zoffload={"freeze": ["model.embed_tokens.weight",
                                                                     "model.layers.{0..1}.*"]})),
        ("tiny-unpinned", "tiny", 64, config(opt="cpu", par="cpu", micro=4,
                                             zero_optimization={"stage": 3, "sub_group_size": 1e6,
                                                                "offload_param": {"device": "cpu", "pin_memory": False},
                                                                "offload_optimizer": {"device": "cpu",
                                                                                      "pin_memory": False}})),
        # In fp32: LibTorch multiplies bf16 matrices on a CPU without AVX-512 in a scalar loop, and
        # the 1.1B model in bf16 took over 10 minutes a step on such a CI machine (fp32 uses its
        # fast gemm). The tiny cases above plan and measure bf16. Sequences of 32 tokens: its size is
        # in the weights and states the tiers hold, not in the activations (which the plan still
        # holds within 10%).
        ("tinyllama-1.1b-nvme", "tinyllama-1.1b", 32, config(prec="fp32", opt="nvme", sub_group=2.5e7)),
    ]
    # Three steps, step 2 measured: each step's window holds its backward and the next step's
    # first forward (run beside its optimizer), so the first and the last step are not typical.
    # tinyllama-1.1b trains two (some 50 s a step on a 2-core VM): its optimizer states on NVMe
    # move the same bytes in its last step as in a middle one (13.2 GB read and written in each of
    # steps 2 and 3 of three), and step 1's window already runs its optimizer beside step 2's first
    # forward (torch's and the tiers' peaks were the same after two steps as after three, the
    # process's peak RSS 36 MB lower).
    for name, model, seq, cfg in cases:
        plan, metrics = plan_and_train(tmp, name, model, seq, 2 if model == "tinyllama-1.1b" else 3, cfg)
        want_grads = cfg.get("zoffload", {}).get("gradient_accumulators")
        if want_grads:
            got = plan["memory_plan"]["placement"]["grad"]
            expect(got == want_grads, f"{name}: gradient accumulators on {got}, as configured ({want_grads})")
        check(name, plan, metrics)
        if cfg.get("zoffload", {}).get("freeze"):
            expect(0 < plan["n_trainable"] < plan["n_params"] and plan["memory_plan"]["frozen_sub_groups"] > 0,
                   f"{name}: {plan['n_trainable']} of {plan['n_params']} params trainable, "
                   f"{plan['memory_plan']['frozen_sub_groups']} frozen sub-groups")

    # Does not fit: a pinned cap below the pool. plan exits 3 with fixes that fit; train refuses at start.
    bad = os.path.join(tmp, "bad.json")
    with open(bad, "w") as f:
        # Below the tiny model's 5.8 MiB of compute copies and its gradient landing ring.
        json.dump(config(zoffload={"pinned_memory_limit": "1MiB"}), f)
    p = subprocess.run([zoffload, "plan", "--config", bad, "--model", "tiny", "--out", tmp, "--json", "--no-measure"],
                       capture_output=True, text=True, env=ENV)
    expect(p.returncode == 3, f"a plan that does not fit exits 3: {p.returncode} {p.stderr}")
    j = json.loads(p.stdout) if p.stdout else {"problems": [], "fixes": []}
    expect(any(pr["resource"] == "zoffload.pinned_memory_limit" for pr in j["problems"]),
           f"the problem names zoffload.pinned_memory_limit: {j['problems']}")
    expect(len(j["fixes"]) > 0 and all("fits" in f["result"] and "NOT" not in f["result"] for f in j["fixes"]),
           f"fixes are offered and each re-planned fits: {j['fixes']}")
    t = subprocess.run([zoffload, "train", "--config", bad, "--model", "tiny", "--data", corpus, "--steps", "1",
                        "--out", os.path.join(tmp, "bad-run")], capture_output=True, text=True, env=ENV)
    expect(t.returncode == 1 and "the plan does not fit this machine" in t.stderr and
           "pinned_memory_limit" in t.stderr, f"train refuses it with the planner's message: {t.stderr}")
    errors = [line for line in t.stderr.splitlines() if "error" in line]
    expect(len(errors) == 1, f"one error line: {t.stderr}")

    # --ranks N plans one of N data-parallel ranks on this node: at ZeRO stage 3 it holds the
    # optimizer states (12 B/param) and gradient accumulators (4 B/param), both on NVMe here, and the
    # compute copies of its partition only.
    nv = os.path.join(tmp, "nvme.json")
    with open(nv, "w") as f:
        json.dump(config(opt="nvme", zoffload={"gradient_accumulators": "nvme"}), f)
    plans = {}
    for ranks in (1, 2):
        p = subprocess.run([zoffload, "plan", "--config", nv, "--model", "llama3-8b", "--out", tmp, "--json",
                            "--no-measure", "--ranks", str(ranks)], capture_output=True, text=True, env=ENV)
        if expect(p.returncode in (0, 3) and p.stdout, f"plan --ranks {ranks} runs: {p.returncode} {p.stderr}"):
            plans[ranks] = json.loads(p.stdout)
    if len(plans) == 2:
        n = plans[1]["n_params"]
        one, two = (plans[r]["memory_plan"]["nvme_optimizer_bytes"] for r in (1, 2))
        expect(plans[2]["ranks"] == 2 and abs((one - two) - 8 * n) < 0.01 * 8 * n,
               f"--ranks 2 holds half the optimizer states and accumulators: {two} vs {one} bytes of swap for {n} params")
        # And its compute copies (pinned here), each block gathered into one of two pinned slots.
        mp1, mp2 = plans[1]["memory_plan"], plans[2]["memory_plan"]
        expect(mp2["partition_params"] and not mp1["partition_params"] and mp2["gather_slots"] == 2 and
               mp2["gather_slot_bytes"] > 0 and abs(mp2["cpu_pinned_bytes"] - mp1["cpu_pinned_bytes"] / 2) < 0.01 * mp1["cpu_pinned_bytes"],
               f"--ranks 2 at stage 3 holds half the compute copies: {mp2['cpu_pinned_bytes']} vs {mp1['cpu_pinned_bytes']} "
               f"pinned bytes, gather slots {mp2['gather_slots']} x {mp2['gather_slot_bytes']}")
        groups = plans[2]["memory_plan"]["owned_sub_groups"]
        expect(groups[0] == 0 and 0 < groups[1] < plans[2]["memory_plan"]["n_sub_groups"],
               f"rank 0 owns the first partition's sub-groups: {groups}")
    p = subprocess.run([zoffload, "plan", "--config", nv, "--model", "tiny", "--out", tmp, "--no-measure", "--ranks", "2"],
                       capture_output=True, text=True, env=ENV)
    expect(p.returncode == 0 and "data parallel: rank 0 of 2 on this node" in p.stdout and
           "compute copies (each block gathered from its owners at fetch)" in p.stdout,
           f"plan --ranks 2 says what it planned: {p.stdout[:600]} {p.stderr}")

    # The machine a user is about to buy or rent: llama3-8b with 8-bit moments plans entirely in RAM
    # on a 128 GiB host (124 GiB available) with a 24 GB card, and not on a 64 GiB one, where the
    # optimizer to the drive (whose free space and speed are given) is the fix.
    eight = os.path.join(source_dir, "configs", "llama8b_24gb_8bit_ram.json")
    box = ["--gpu-memory", "24GB", "--gpu-tflops", "160", "--cpus", "16", "--disk-free", "2TB", "--nvme-read", "6",
           "--nvme-write", "5"]
    base = [zoffload, "plan", "--config", eight, "--model", "llama3-8b", "--seq-len", "1024", "--steps", "1000",
            "--out", tmp, "--no-measure", "--json"]
    p = subprocess.run(base + box + ["--host-ram", "124GiB"], capture_output=True, text=True, env=ENV)
    if expect(p.returncode == 0 and p.stdout, f"llama3-8b, 8-bit moments, fits a 128 GiB target: {p.returncode} {p.stderr}"):
        j = json.loads(p.stdout)
        expect(j["target"] and j["memory_plan"]["placement"]["moment_dtype"] == "8bit" and
               j["per_step"]["nvme_write_bytes"] == 0 and j["per_step"]["nvme_read_max_bytes"] == 0 and
               j["nvme"]["optimizer_file_bytes"] == 0,
               f"all in RAM, nothing on a drive per step: {j['per_step']}")
        expect(j["device_name"] == "a GPU of 22.4 GiB (--gpu-memory)", f"the target's GPU: {j['device_name']}")
    p = subprocess.run(base + box + ["--host-ram", "62GiB"], capture_output=True, text=True, env=ENV)
    if expect(p.returncode == 3 and p.stdout, f"not on a 64 GiB target: {p.returncode} {p.stderr}"):
        fixes = json.loads(p.stdout)["fixes"]
        expect(any(f["changes"] == ["zero_optimization.offload_optimizer.device: nvme"] and "; fits" in f["result"]
                   for f in fixes), f"the optimizer to the given drive is a fix: {fixes}")
    # On 60 GiB, beside the drive and after it, everything kept in RAM with the least rounding that
    # fits: bf16-stored gradients (2 B/param) and bf16 masters (the compute copies, 0 B) beside the
    # 8-bit moments (2.03 B): 4.03 B/param, where either alone leaves 8.03 or 6.03 (docs/plan.md;
    # with bf16 masters alone the plan needs 62.0 GiB, so 62 GiB is too close to call here).
    p = subprocess.run(base + box + ["--host-ram", "60GiB"], capture_output=True, text=True, env=ENV)
    if expect(p.returncode == 3 and p.stdout, f"not on a 60 GiB target: {p.returncode} {p.stderr}"):
        fixes = json.loads(p.stdout)["fixes"]
        lean = [f for f in fixes if f["changes"] == ["zoffload.gradient_store_dtype: bf16",
                                                      "zoffload.master_dtype: bf16"]]
        expect(len(lean) == 1 and lean[0] is fixes[-1] and "; fits" in lean[0]["result"] and
               lean[0]["config"] == {"zoffload": {"gradient_store_dtype": "bf16", "master_dtype": "bf16"}} and
               fixes[0]["trade"].startswith("exact"),
               f"the exact fix first, then bf16 gradients and masters with the keys to merge: {fixes}")
        if lean:
            # The keys merged into the file: the config checker accepts it and the plan fits.
            merged = json.load(open(eight))
            merged["zoffload"].update(lean[0]["config"]["zoffload"])
            path = os.path.join(tmp, "eight_lean.json")
            with open(path, "w") as f:
                json.dump(merged, f)
            c = subprocess.run([zoffload, "config", "check", "-q", path, "--hidden-size", "4096", "--steps", "1000"],
                               capture_output=True, text=True, env=ENV)
            expect(c.returncode == 0, f"config check accepts the merged keys: {c.returncode} {c.stderr}")
            q = subprocess.run([zoffload, "plan", "--config", path] + base[4:] + box + ["--host-ram", "60GiB"],
                               capture_output=True, text=True, env=ENV)
            expect(q.returncode == 0 and q.stdout and json.loads(q.stdout)["per_step"]["nvme_write_bytes"] == 0,
                   f"and plans to fit with no drive in the step: {q.returncode} {q.stderr}")
    # The exact config (fp32 states, no accumulator) on 60 GiB: the text lists the drive, then bf16
    # moments with bf16 masters (4 B/param: 8-bit moments alone leave 6.03, bf16 masters alone 8).
    exact = os.path.join(source_dir, "configs", "llama8b_24gb_exact_ram.json")
    p = subprocess.run([zoffload, "plan", "--config", exact] + base[4:-1] + box + ["--host-ram", "60GiB"],
                       capture_output=True, text=True, env=ENV)
    out = p.stdout
    at_drive = out.find("  zero_optimization.offload_optimizer.device: nvme\n")
    at_lean = out.find("  zoffload.moment_dtype: bf16; zoffload.master_dtype: bf16\n")
    expect(p.returncode == 3 and 0 < at_drive < at_lean and
           'config: {"zoffload":{"master_dtype":"bf16","moment_dtype":"bf16"}}' in out[at_lean:] and
           "zoffload config check" in out[at_lean:],
           f"exact config on 60 GiB: the drive, then bf16 moments and masters with their keys: {p.returncode} {out[-2500:]}")
    # The shipped LoRA configs (issue 63): QLoRA of a 70B base on a 24 GB card with a 60 GiB host
    # (the packed NF4 base pinned, about 37 GB where bf16 would be 132 GiB), and LoRA over a 16-bit
    # llama3-8b base there: each fits with no drive in the step.
    for name, model, note in (("llama70b_qlora_24gb.json", "llama3-70b", "the NF4 base packed"),
                              ("llama8b_lora_24gb.json", "llama3-8b", "the bf16 base")):
        cfg = os.path.join(source_dir, "configs", name)
        p = subprocess.run([zoffload, "plan", "--config", cfg, "--model", model, "--seq-len", "1024", "--steps", "1000",
                            "--out", tmp, "--no-measure", "--json"] + box + ["--host-ram", "60GiB"],
                           capture_output=True, text=True, env=ENV)
        if expect(p.returncode == 0 and p.stdout, f"{name} over {model} fits 24 GB + 60 GiB: {p.returncode} "
                  f"{p.stdout[-1500:]} {p.stderr[-800:]}"):
            j = json.loads(p.stdout)
            expect(j["per_step"]["nvme_write_bytes"] == 0 and j["per_step"]["nvme_read_max_bytes"] == 0 and
                   j["nvme"]["param_file_bytes"] == 0, f"{name}: nothing on a drive per step ({note}): {j['per_step']}")
            if "qlora" in name:
                pinned = j["memory_plan"]["cpu_pinned_bytes"]
                expect(36e9 < pinned < 46e9, f"{name}: the pinned base is the packed one, 36-46 GB: {pinned}")
    for args, flag in [(["--host-ram", "lots"], "--host-ram"), (["--gpu-tflops", "100"], "--gpu-tflops"),
                       (["--nvme-read", "3"], "--nvme-read")]:
        p = subprocess.run(base + args, capture_output=True, text=True, env=ENV)
        expect(p.returncode == 2 and flag in p.stderr and len(p.stderr.strip().splitlines()) == 1,
               f"{args}: one line naming {flag}, exit 2: {p.returncode} {p.stderr}")

report_and_exit()

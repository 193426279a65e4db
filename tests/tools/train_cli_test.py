#!/usr/bin/env python3
"""`zoffload train` as a user runs it: the demo (tiny model, bundled corpus, optimizer on NVMe under
the run directory) trains and its loss falls by a clear margin; a Hugging Face model directory
written here with only the standard library (config.json + sharded bf16 safetensors) loads and
trains; bad input fails with one line naming what is wrong and exit 2 (or 1 at run time); a stop
signal removes the swap files, also during the start; a second run on the same nvme_path, or on the
same --out, is refused; a metrics_path that names a directory is refused at start, the directory kept.

usage: train_cli_test.py ZOFFLOAD SOURCE_DIR SLOW_FALLOCATE_SO"""
import json
import os
import random
import struct
import subprocess
import sys
import tempfile

from cli_checks import demo_config_as_setup_runs_it, expect, report_and_exit

zoffload, source_dir, slow_fallocate = sys.argv[1], sys.argv[2], sys.argv[3]
demo_config = os.path.join(source_dir, "configs", "tiny_demo_nvme.json")
corpus = os.path.join(source_dir, "configs", "data", "demo_corpus.txt")


def train(*args, timeout=1800):
    return subprocess.run([zoffload, "train", *args], capture_output=True, text=True, timeout=timeout)


def bf16_bytes(values):
    out = bytearray()
    for v in values:
        bits = struct.unpack("<I", struct.pack("<f", v))[0]
        bits += 0x7FFF + ((bits >> 16) & 1)  # round to nearest even
        out += struct.pack("<H", (bits >> 16) & 0xFFFF)
    return bytes(out)


def write_safetensors(path, tensors):
    """tensors: list of (name, shape, bf16 bytes)."""
    header, data = {"__metadata__": {"format": "pt"}}, bytearray()
    for name, shape, raw in tensors:
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + data)


def write_hf_model(d):
    """A 2-layer LLaMA with byte vocabulary in two shards with an index, as transformers saves it."""
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256, "hidden_size": 64,
           "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
           "torch_dtype": "bfloat16"}
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    rng = random.Random(3)
    h, i, kv = 64, 128, 2 * 16

    def w(*shape):
        n = 1
        for s in shape:
            n *= s
        return list(shape), bf16_bytes(rng.gauss(0, 0.02) for _ in range(n))

    def wide(*shape):  # std 1: logits far from uniform, so a first loss far above ln(256)
        n = 1
        for s in shape:
            n *= s
        return list(shape), bf16_bytes(rng.gauss(0, 1.0) for _ in range(n))

    def ones(n):
        return [n], bf16_bytes([1.0] * n)

    shards = [[("model.embed_tokens.weight", *w(256, h))], [("model.norm.weight", *ones(h)), ("lm_head.weight", *wide(256, h))]]
    for layer in range(2):
        p = "model.layers.%d." % layer
        shards[layer].extend([
            (p + "input_layernorm.weight", *ones(h)), (p + "post_attention_layernorm.weight", *ones(h)),
            (p + "self_attn.q_proj.weight", *w(h, h)), (p + "self_attn.k_proj.weight", *w(kv, h)),
            (p + "self_attn.v_proj.weight", *w(kv, h)), (p + "self_attn.o_proj.weight", *w(h, h)),
            (p + "mlp.gate_proj.weight", *w(i, h)), (p + "mlp.up_proj.weight", *w(i, h)),
            (p + "mlp.down_proj.weight", *w(h, i))])
    weight_map = {}
    for k, tensors in enumerate(shards):
        name = "model-%05d-of-%05d.safetensors" % (k + 1, len(shards))
        write_safetensors(os.path.join(d, name), tensors)
        weight_map.update({t[0]: name for t in tensors})
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


with tempfile.TemporaryDirectory(prefix="zo-train-cli-", dir=os.environ.get("TMPDIR", "/tmp")) as tmp:
    # 1. The demo, as README's first command runs it (fewer steps, and sequences of 64 tokens; in
    # fp32 where setup.sh runs it so, some 13 times faster than bf16 on a 2-core EPYC): the loss
    # falls clearly (5.32 to 3.26 over the first and last 5 steps in bf16 there).
    run_dir = os.path.join(tmp, "demo")
    p = train("--config", demo_config_as_setup_runs_it(source_dir, tmp), "--model", "tiny", "--data", corpus,
              "--steps", "30", "--seq-len", "64", "--out", run_dir)
    expect(p.returncode == 0, "demo exits 0: " + p.stderr[-2000:])
    if p.returncode == 0:
        lines = [json.loads(l) for l in open(os.path.join(run_dir, "metrics.jsonl"))]
        expect(len(lines) == 30, "one metrics line per step (%d)" % len(lines))
        first = sum(l["loss"] for l in lines[:5]) / 5
        last = sum(l["loss"] for l in lines[-5:]) / 5
        expect(first - last > 1.0, "the demo's loss falls by a clear margin: first 5 steps %.3f, last 5 %.3f" % (first, last))
        expect(all(l["memory"]["nvme"]["peak_bytes"] > 0 for l in lines), "optimizer states were on NVMe")
        said = [l for l in p.stdout.splitlines() if "NVMe swap files under " in l]
        expect(len(said) == 1, "names the swap directory: " + p.stdout)
        if said:
            swap = said[0].split("NVMe swap files under ")[1].split(" are removed")[0]
            expect(swap.startswith(run_dir), "swap files under the run directory: " + swap)
            expect(not os.path.isdir(swap) or not os.listdir(swap), "swap files removed at exit: %s" %
                   (os.listdir(swap) if os.path.isdir(swap) else ""))
        expect("done: 30 steps" in p.stdout and "metrics" in p.stdout, "says where its outputs are: " + p.stdout)
        expect("loss" in p.stderr and "fetch" in p.stderr, "progress shows loss and the time breakdown")

    # 2. A Hugging Face directory (sharded bf16 safetensors) loads and trains; --json summary.
    model_dir = os.path.join(tmp, "hf")
    os.makedirs(model_dir)
    write_hf_model(model_dir)
    p = train("--config", demo_config, "--model", model_dir, "--data", corpus, "--steps", "3", "--seq-len", "64",
              "--out", os.path.join(tmp, "hf-run"), "--json")
    expect(p.returncode == 0, "HF model dir trains: " + p.stderr[-2000:])
    if p.returncode == 0:
        j = json.loads(p.stdout)
        expect(j["steps"] == 3 and j["parameters"] == 2 * 256 * 64 + 64 + 2 * (2 * 64 + 2 * 64 * 64 + 2 * 32 * 64 + 3 * 64 * 128),
               "JSON summary with the model's parameter count: %s" % p.stdout)
        # Random init (std 0.02) starts at ln(256) = 5.55; this lm_head (std 1) makes it far larger.
        expect(j["first_loss"] > 8, "the loaded weights are used (first loss %.3f)" % j["first_loss"])

    # 3. Bad input: one line naming what is wrong.
    os.remove(os.path.join(model_dir, "model-00002-of-00002.safetensors"))
    cases = [
        (["--config", demo_config, "--model", "no-such-model", "--data", corpus, "--steps", "1"], 2, "no-such-model"),
        (["--config", demo_config, "--model", "tiny", "--data", os.path.join(tmp, "nope.txt"), "--steps", "1",
          "--out", os.path.join(tmp, "bad1")], 1, "nope.txt"),
        (["--config", demo_config, "--model", model_dir, "--data", corpus, "--steps", "1",
          "--out", os.path.join(tmp, "bad2")], 1, "model-00002-of-00002.safetensors"),
        (["--config", os.path.join(tmp, "missing.json"), "--model", "tiny", "--data", corpus], 2, "missing.json"),
        (["--config", demo_config, "--model", "tiny", "--data", corpus, "--steps", "1", "--seq-len", "5000",
          "--out", os.path.join(tmp, "bad3")], 2, "max_position_embeddings"),
        (["--config", demo_config, "--model", "tiny", "--data", corpus, "--data-format", "csv"], 2, "csv"),
        # Issue 19: CLI11's own range text printed 309 digits, and nan passed.
        (["--config", demo_config, "--model", "tiny", "--data", corpus, "--lr", "inf"], 2, "--lr: inf is not a finite number > 0"),
        (["--config", demo_config, "--model", "tiny", "--data", corpus, "--lr", "nan"], 2, "--lr: nan is not a finite number > 0"),
        (["--config", demo_config, "--model", "tiny", "--data", corpus, "--lr", "1e39"], 2, "and at most 3.40282e+38"),
        (["--config", demo_config, "--model", "tiny", "--data", corpus, "--micro-batch", "-1"], 2, "--micro-batch: -1 is not a whole number in [1, "),
    ]
    for args, code, needle in cases:
        p = train(*args, timeout=120)
        expect(p.returncode == code, "%s: exit %d, got %d: %s" % (needle, code, p.returncode, p.stderr))
        errors = [l for l in p.stderr.splitlines() if "error" in l]
        expect(len(errors) >= 1 and needle in p.stderr, "%s: named in the error: %s" % (needle, p.stderr))

    # 4. Issue 19: a FIFO as --config or --data is refused (it used to hang); a write past
    # `ulimit -f` is an error naming EFBIG (it used to die by SIGXFSZ without a word); SIGINT and
    # SIGTERM remove the NVMe swap files as a normal exit does.
    fifo = os.path.join(tmp, "pipe")
    os.mkfifo(fifo)
    for args, needle in [(["--config", fifo, "--model", "tiny", "--data", corpus, "--steps", "1"],
                          fifo + ": error: config file is a FIFO"),
                         (["--config", demo_config, "--model", "tiny", "--data", fifo, "--steps", "1",
                           "--out", os.path.join(tmp, "fifo-run")], "data file " + fifo + " is a FIFO")]:
        p = train(*args, timeout=60)
        expect(p.returncode == 2 and needle in p.stderr,
               "a FIFO is refused naming it (%s): exit %d: %s" % (needle, p.returncode, p.stderr))

    # Finding 1: a config.json claiming absurd sizes is one line and exit 2, before any allocation in
    # proportion to the claim (under a 4 GiB address-space limit, so a regression fails fast instead
    # of exhausting the machine).
    def limit_memory():
        import resource
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))
    for key, value, needle in [("num_hidden_layers", 1 << 30, "1073741824 layers"),
                               ("hidden_size", 10 ** 12, "hidden_size 1000000000000"),
                               ("vocab_size", 10 ** 12, "parameters")]:
        absurd = os.path.join(tmp, "absurd-" + key)
        os.makedirs(absurd)
        with open(os.path.join(model_dir, "config.json")) as f:
            cfg = json.load(f)
        cfg[key] = value
        with open(os.path.join(absurd, "config.json"), "w") as f:
            json.dump(cfg, f)
        p = subprocess.run([zoffload, "train", "--config", demo_config, "--model", absurd, "--data", corpus,
                            "--steps", "1", "--out", os.path.join(tmp, "absurd-run")], capture_output=True, text=True,
                           timeout=120, preexec_fn=limit_memory)
        errors = [l for l in p.stderr.splitlines() if "error" in l]
        expect(p.returncode == 2 and len(errors) == 1 and needle in p.stderr,
               "%s %d is refused in one line with exit 2: exit %d: %s" % (key, value, p.returncode, p.stderr[-1000:]))

    # A launch that data parallel cannot serve (no rank, no rendezvous, a variable that is not a count)
    # is refused before anything is written (dist_cli_test runs the ranks). One process (WORLD_SIZE=1) trains.
    plain_env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK")}
    for extra, needle in [({"WORLD_SIZE": "2"}, "RANK is not set, but WORLD_SIZE is (torchrun)"),
                          ({"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "1"},
                           "rank 1 of 4 (Open MPI): MASTER_ADDR is not set"),
                          ({"WORLD_SIZE": "two"}, "WORLD_SIZE=two (set by torchrun) is not a count")]:
        out = os.path.join(tmp, "ranks-" + "-".join(extra.values()))
        p = subprocess.run([zoffload, "train", "--config", demo_config, "--model", "tiny", "--data", corpus,
                            "--steps", "1", "--out", out], capture_output=True, text=True, timeout=120,
                           env=dict(plain_env, **extra))
        expect(p.returncode == 2 and needle in p.stderr and len(p.stderr.splitlines()) == 1 and not os.path.exists(out),
               "%s is refused in one line, nothing written: exit %d: %s" % (extra, p.returncode, p.stderr[-1000:]))
    out = os.path.join(tmp, "ranks-one")
    p = subprocess.run([zoffload, "train", "--config", demo_config, "--model", "tiny", "--data", corpus, "--steps", "1",
                        "--seq-len", "32", "--out", out, "-q"], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, WORLD_SIZE="1"))
    expect(p.returncode == 0, "WORLD_SIZE=1 trains: exit %d: %s" % (p.returncode, p.stderr[-1000:]))

    def limit_file_size():
        import resource
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
    p = subprocess.run([zoffload, "train", "--config", demo_config, "--model", "tiny", "--data", corpus, "--steps", "1",
                        "--out", os.path.join(tmp, "fsize")], capture_output=True, text=True, timeout=120,
                       preexec_fn=limit_file_size)
    expect(p.returncode == 1 and "File too large" in p.stderr,
           "a write past ulimit -f is an error, not SIGXFSZ: exit %d: %s" % (p.returncode, p.stderr[-1000:]))

    # A failed periodic save is a warning and training goes on (docs/checkpoint_format.md); the
    # final save failing too is an error, exit 1. The saves fail for real: each state file is over
    # `ulimit -f`, while metrics.jsonl's lines are not.
    with open(demo_config) as f:
        cfg = json.load(f)
    cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    cfg["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = False
    cfg["zoffload"]["checkpoint"] = {"dir": "ckpt", "every_steps": 1}
    every_step = os.path.join(tmp, "every-step.json")
    with open(every_step, "w") as f:
        json.dump(cfg, f)

    def limit_file_size_small():
        import resource
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))
    run = os.path.join(tmp, "failing-saves")
    p = subprocess.run([zoffload, "train", "--config", every_step, "--model", "tiny", "--data", corpus, "--steps", "3",
                        "--seq-len", "32", "--out", run], capture_output=True, text=True, timeout=300,
                       preexec_fn=limit_file_size_small)
    warnings = [l for l in p.stderr.splitlines() if "warning: the checkpoint after step" in l]
    expect(len(warnings) == 2 and "after step 1 failed" in warnings[0] and "File too large" in warnings[0] and
           "the previous checkpoints are intact and training goes on" in warnings[0],
           "each failed periodic save is one warning naming the step and the cause: %s" % p.stderr[-2000:])
    with open(os.path.join(run, "metrics.jsonl")) as f:
        steps = [json.loads(l)["step"] for l in f]
    expect(steps == [1, 2, 3], "training went on after the failed saves: %s" % steps)
    expect(p.returncode == 1 and "error: the final checkpoint failed" in p.stderr,
           "the final save failing is an error: exit %d: %s" % (p.returncode, p.stderr[-1000:]))
    ckpt = os.path.join(run, "ckpt")
    left = sorted(os.listdir(ckpt)) if os.path.isdir(ckpt) else []
    # The directory's lock file stays, as --out's does (Note [One run per run directory]).
    expect(left == [".zoffload.lock"], "failed saves leave nothing in the checkpoint directory: %s" % left)

    import signal
    import time

    def files_under(path):
        return [os.path.join(r, f) for r, _, fs in os.walk(path) for f in fs]

    def start_long_run(cfg, out):
        """A run of 100000 steps, returned with its metrics path once its first step is written."""
        proc = subprocess.Popen([zoffload, "train", "--config", cfg, "--model", "tiny", "--data", corpus,
                                 "--steps", "100000", "--seq-len", "32", "--out", out], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        metrics = os.path.join(out, "metrics.jsonl")
        deadline = time.time() + 120
        while time.time() < deadline and not (os.path.exists(metrics) and os.path.getsize(metrics) > 0):
            time.sleep(0.2)
        return proc, metrics

    for sig in (signal.SIGINT, signal.SIGTERM):
        run = os.path.join(tmp, "interrupted-%d" % sig)
        proc, _ = start_long_run(demo_config, run)
        swaps = files_under(os.path.join(run, "zoffload-nvme"))
        expect(len(swaps) > 0, "signal %d: the run has swap files while it trains: %s" % (sig, swaps))
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=60)
        expect(proc.returncode == -sig, "signal %d ends the run by that signal: %d" % (sig, proc.returncode))
        expect("interrupted; the NVMe swap files are removed" in err, "signal %d: says so: %s" % (sig, err[-500:]))
        left = [s for s in swaps if os.path.exists(s)]
        expect(not left, "signal %d: swap files removed: %s" % (sig, left))

    def swap_files(run):
        return [f for f in files_under(os.path.join(run, "zoffload-nvme")) if f.endswith(".swp")]

    # During the start: the swap file exists (locked) while fallocate is held for 30 s by the shim.
    run = os.path.join(tmp, "interrupted-at-start")
    env = dict(os.environ, LD_PRELOAD=slow_fallocate, ZO_TEST_FALLOCATE_DELAY_MS="30000")
    proc = subprocess.Popen([zoffload, "train", "--config", demo_config, "--model", "tiny", "--data", corpus,
                             "--steps", "3", "--out", run], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
    deadline = time.time() + 60
    while time.time() < deadline and not swap_files(run):
        time.sleep(0.05)
    swaps = swap_files(run)
    time.sleep(0.5)  # from creating the file to sizing it: microseconds
    expect(len(swaps) > 0 and proc.poll() is None, "a swap file exists while the run starts: %s" % swaps)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    expect(proc.returncode == -signal.SIGINT, "SIGINT during the start ends the run by it: %d" % proc.returncode)
    expect("interrupted; the NVMe swap files are removed" in err, "SIGINT during the start: says so: %s" % err[-500:])
    expect(not os.path.exists(os.path.join(run, "metrics.jsonl")) or os.path.getsize(os.path.join(run, "metrics.jsonl")) == 0,
           "the signal came before the first step")
    left = [s for s in swaps if os.path.exists(s)]
    expect(swaps and not left, "SIGINT during the start: swap files removed: %s of %s" % (left, swaps))

    # Two runs on one nvme_path would train on each other's states: the second is refused at start,
    # and the first goes on with its files.
    first_run = os.path.join(tmp, "first")
    shared = dict(json.load(open(demo_config)))
    shared["zero_optimization"]["offload_optimizer"]["nvme_path"] = os.path.join(tmp, "shared-nvme")
    shared_cfg = os.path.join(tmp, "shared-nvme.json")
    with open(shared_cfg, "w") as f:
        json.dump(shared, f)
    first, _ = start_long_run(shared_cfg, first_run)
    p = train("--config", shared_cfg, "--model", "tiny", "--data", corpus, "--steps", "2", "--out",
              os.path.join(tmp, "second"), timeout=300)
    expect(p.returncode == 1 and "is in use by another process" in p.stderr and "nvme_path" in p.stderr,
           "a second run on the same nvme_path is refused: exit %d: %s" % (p.returncode, p.stderr[-800:]))
    held = files_under(os.path.join(tmp, "shared-nvme"))
    expect(first.poll() is None and any(h.endswith("optimizer.swp") for h in held),
           "the first run goes on with its swap files: %s" % held)
    first.send_signal(signal.SIGTERM)
    first.communicate(timeout=60)
    expect(first.returncode == -signal.SIGTERM, "the first run ends by SIGTERM: %d" % first.returncode)

    # Issue 40: two runs on one --out with no swap files once clobbered each other (one metrics file,
    # each other's checkpoint saves tidied away). The second is refused at start, the first goes on.
    in_ram = json.load(open(demo_config))
    in_ram["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    in_ram["zoffload"]["checkpoint"] = {"dir": "ckpt", "every_steps": 1000}
    in_ram_cfg = os.path.join(tmp, "in-ram.json")
    with open(in_ram_cfg, "w") as f:
        json.dump(in_ram, f)
    shared_out = os.path.join(tmp, "shared-out")
    first, metrics = start_long_run(in_ram_cfg, shared_out)
    p = train("--config", in_ram_cfg, "--model", "tiny", "--data", corpus, "--steps", "2", "--out", shared_out,
              timeout=300)
    expect(p.returncode == 1 and ("run directory %s is in use by another zoffload run" % shared_out) in p.stderr and
           len(p.stderr.strip().splitlines()) == 1,
           "a second run on the same --out is refused in one line: exit %d: %s" % (p.returncode, p.stderr[-800:]))
    first.send_signal(signal.SIGTERM)
    first.communicate(timeout=60)
    steps = [json.loads(line)["step"] for line in open(metrics)]
    expect(first.returncode == -signal.SIGTERM and steps == list(range(1, len(steps) + 1)),
           "the first run went on, and its metrics are its own, whole: %s" % steps[:20])

    # Issue 40: zoffload.log.metrics_path naming an existing directory once replaced it by the
    # metrics. Refused at start, in one line, the directory as it was.
    bad = json.load(open(in_ram_cfg))
    bad["zoffload"]["log"] = {"metrics_path": "mine"}
    bad_cfg = os.path.join(tmp, "metrics-dir.json")
    with open(bad_cfg, "w") as f:
        json.dump(bad, f)
    run = os.path.join(tmp, "metrics-dir")
    os.makedirs(os.path.join(run, "mine", "sub"))
    with open(os.path.join(run, "mine", "notes.txt"), "w") as f:
        f.write("keep\n")
    p = train("--config", bad_cfg, "--model", "tiny", "--data", corpus, "--steps", "2", "--out", run, timeout=300)
    expect(p.returncode == 2 and "metrics_path) %s is a directory" % os.path.join(run, "mine") in p.stderr and
           len(p.stderr.strip().splitlines()) == 1,
           "metrics_path naming a directory is refused in one line: exit %d: %s" % (p.returncode, p.stderr[-800:]))
    expect(open(os.path.join(run, "mine", "notes.txt")).read() == "keep\n" and os.path.isdir(os.path.join(run, "mine", "sub")),
           "the directory metrics_path named is as it was")

    # Issue 40: under `ulimit -v 3000000` the run once aborted (exit 134: std::bad_alloc or
    # "pthread_create has failed") although its plan said it fit. The plan counts the address space
    # LibTorch and the threads reserve, and the refusal is one line and exit 1.
    import resource

    def limit_address_space():
        resource.setrlimit(resource.RLIMIT_AS, (3_000_000 * 1024, 3_000_000 * 1024))

    run = os.path.join(tmp, "ulimit-v")
    p = subprocess.run([zoffload, "train", "--config", demo_config, "--model", "tiny", "--data", corpus, "--steps", "2",
                        "--out", run], capture_output=True, text=True, timeout=300, preexec_fn=limit_address_space)
    errors = [line for line in p.stderr.splitlines() if "error" in line]
    expect(p.returncode == 1 and len(errors) == 1 and "address space (ulimit -v)" in errors[0],
           "under ulimit -v 3000000 the run is refused in one line: exit %d: %s" % (p.returncode, p.stderr[-1500:]))
    expect(not [f for f in files_under(run) if f.endswith(".swp")], "the refused run leaves no swap file")

    # Issue 40: a 100 KB --config path was echoed twice per error line.
    p = train("--config", os.path.join(tmp, "c" * 100_000 + ".json"), "--model", "tiny", "--data", corpus, timeout=60)
    expect(p.returncode == 2 and len(p.stderr) < 2000 and "cannot read config file" in p.stderr,
           "a 100 KB config path is one short line: exit %d, %d bytes: %s" % (p.returncode, len(p.stderr), p.stderr[:300]))

    p = subprocess.run([zoffload, "train", "--help"], capture_output=True, text=True)
    expect(p.returncode == 0 and "--model" in p.stdout and "metrics.jsonl" in p.stdout, "--help answers")

report_and_exit()

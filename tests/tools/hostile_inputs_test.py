#!/usr/bin/env python3
"""Hostile input to `zoffload train`, `export`, `plan`, `config check` and `ckpt verify`, as a user (or a
script gone wrong) gives it; each case checks what zoffload now does with it, and that nothing a
user had is lost:

- held-out data with a token or a label outside the vocabulary (JSONL ids, JSONL labels, a raw
  .bin) is refused at start, naming --eval-data and the token, before --out is made; an evaluation
  that fails later (its file cut short under the run) stops the run only after its step is saved;
- --data cut short under a running run ends it with one line naming the file (a mapped file died
  of SIGBUS), its checkpoints intact;
- two runs with one checkpoint directory: the second is refused while the first runs, and, run one
  after the other, `--resume latest` from the first run's --out refuses the second run's checkpoint,
  whose pruning left the first run's steps alone;
- negative or fractional numbers for whole-number options, and --eval-batches 0, are one short line;
- a run that fails at start leaves no --out it made; a Qwen3 window shorter than --seq-len is refused
  at start; a tied config whose weights hold a different lm_head.weight trains it untied, as
  transformers loads it; `export --out` inside a step directory is refused; a 10 MB nvme_path is
  refused in one bounded line;
- a checkpoint whose moments or 8-bit absmax are NaN, inf or negative, its checksums recomputed, is
  refused by `ckpt verify` and by --resume, naming the file and the tensor.

PEFT adapters (PiSSA and the like, scales, dropout, non-finite values) are peft_parity_test.py's.

Usage: hostile_inputs_test.py ZOFFLOAD SOURCE_DIR
Exit 77 (skip) when this Python lacks torch, transformers, safetensors or numpy."""
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time

from cli_checks import expect, report_and_exit, reseal

zoffload, source_dir = sys.argv[1], sys.argv[2]
try:
    import numpy as np
    import torch
    import transformers
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, LlamaConfig
except ImportError as e:
    print("SKIP: the test's model writer is not installed in %s (%s); tools/requirements.txt pins it" %
          (sys.executable, e))
    sys.exit(77)

corpus = os.path.join(source_dir, "configs", "data", "demo_corpus.txt")
ENV = dict(os.environ, OMP_NUM_THREADS="1")
SEQ = "32"


def run(*args, timeout=600):
    return subprocess.run([zoffload, *args], capture_output=True, text=True, env=ENV, timeout=timeout)


def errors(p):
    return [l for l in p.stderr.splitlines() if "error" in l]


def one_line(p, code, *words):
    """Exit `code` with exactly one error line holding every word."""
    lines = errors(p)
    return p.returncode == code and len(lines) == 1 and all(w in lines[0] for w in words)


def config(tmp, name, **zoffload_keys):
    """fp32, ZeRO-3 with parameters and optimizer in RAM, GAS 1: a tiny step takes a tenth of a second."""
    c = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
         "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
         "zero_optimization": {"stage": 3, "sub_group_size": 100000, "offload_param": {"device": "cpu"},
                               "offload_optimizer": {"device": "cpu"}},
         "zoffload": {"device": "host", "optimizer_threads": 1, **zoffload_keys}}
    path = os.path.join(tmp, name + ".json")
    with open(path, "w") as f:
        json.dump(c, f)
    return path


def train(cfg, out, *args, model="tiny", data=corpus, timeout=600):
    return run("train", "--config", cfg, "--model", model, "--data", data, "--out", out, "--seq-len", SEQ, "-q",
               *args, timeout=timeout)


def start(cfg, out, *args, data=corpus):
    return subprocess.Popen([zoffload, "train", "--config", cfg, "--model", "tiny", "--data", data, "--out", out,
                             "--seq-len", SEQ, "-q", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=ENV)


def wait_for_lines(path, n, proc, timeout=300):
    """Waits until `path` has n lines (a run's metrics: its steps done); False if the run ended first."""
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if os.path.exists(path) and sum(1 for _ in open(path)) >= n:
            return True
        time.sleep(0.02)
    return False


def save_llama(d, tied=False, distinct_head=False):
    """A 2-layer llama over bytes as transformers saves it (hidden 64: 4096-element matrices, so
    8-bit moments quantize them)."""
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=False)
    torch.manual_seed(5)
    model = AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(d)
    if tied:
        # A head of its own beside tie_word_embeddings true: transformers keeps it untied.
        with open(os.path.join(d, "config.json")) as f:
            c = json.load(f)
        c["tie_word_embeddings"] = True
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(c, f)
        if not distinct_head:
            sd = load_file(os.path.join(d, "model.safetensors"))
            sd["lm_head.weight"] = sd["model.embed_tokens.weight"].clone()
            save_file(sd, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})


def eval_data(tmp):
    """1. Held-out rows outside the vocabulary: found at start, not after a step."""
    cfg = config(tmp, "eval", checkpoint={"dir": "ckpt"})
    good = list(range(200)) * 2
    cases = {
        "ids.jsonl": (json.dumps({"input_ids": good[:60] + [300] + good[60:]}) + "\n", "token 300 at token 60"),
        "labels.jsonl": (json.dumps({"input_ids": good, "labels": good[:90] + [999] + good[91:]}) + "\n",
                         "label 999 at token 90"),
        "raw.bin": (struct.pack("<%dH" % len(good), *(good[:100] + [4000] + good[101:])), "token 4000 at token 100"),
    }
    for name, (content, words) in cases.items():
        path = os.path.join(tmp, name)
        with open(path, "wb" if isinstance(content, bytes) else "w") as f:
            f.write(content)
        out = os.path.join(tmp, "eval-" + name)
        p = train(cfg, out, "--steps", "2", "--eval-data", path)
        expect(one_line(p, 2, "--eval-data", words, "vocabulary of 256"),
               "eval %s: refused at start naming the token: rc %d, %s" % (name, p.returncode, p.stderr[-600:]))
        expect(not os.path.exists(out), "eval %s: the failed start left no --out behind" % name)

    # An evaluation that fails during the run (its .bin cut short once training runs) costs no step:
    # the last step is recorded and saved, and the run says where.
    held = os.path.join(tmp, "held.bin")
    with open(held, "wb") as f:
        f.write(struct.pack("<4096H", *([7] * 4096)))
    out = os.path.join(tmp, "eval-fails")
    proc = start(cfg, out, "--steps", "60", "--eval-data", held, "--eval-batches", "2")
    if expect(wait_for_lines(os.path.join(out, "metrics.jsonl"), 1, proc), "the eval run takes its first step"):
        with open(held, "wb"):
            pass
    _, err = proc.communicate(timeout=600)
    lines = [l for l in err.splitlines() if "error" in l]
    expect(proc.returncode == 1 and len(lines) == 1 and "step 60: " in lines[0] and "held.bin" in lines[0] and
           "saved in" in lines[0], "a failed evaluation ends the run after saving its step: rc %d, %s" %
           (proc.returncode, err[-800:]))
    latest = os.path.join(out, "ckpt", "latest")
    expect(os.path.exists(latest) and open(latest).read().strip() == "step-60",
           "the step before the failed evaluation is the latest checkpoint")
    expect(sum(1 for _ in open(os.path.join(out, "metrics.jsonl"))) == 60, "all 60 steps are recorded")


def shrinking_data(tmp):
    """2. --data cut short under the run: one line, exit 1, the checkpoints kept (was SIGBUS, exit 135)."""
    data = os.path.join(tmp, "shrinks.txt")
    shutil.copy(corpus, data)
    cfg = config(tmp, "shrink", checkpoint={"dir": "ckpt", "every_steps": 1})
    out = os.path.join(tmp, "shrink")
    proc = start(cfg, out, "--steps", "400", data=data)
    if expect(wait_for_lines(os.path.join(out, "metrics.jsonl"), 2, proc), "the run takes its first steps"):
        with open(data, "w") as f:
            f.write("x")  # `cat > data.txt` as a user would
    _, err = proc.communicate(timeout=600)
    lines = [l for l in err.splitlines() if "error" in l]
    expect(proc.returncode == 1 and len(lines) == 1 and "shrinks.txt" in lines[0] and "changed during the run" in
           lines[0], "a data file cut short ends the run with one line: rc %d, %s" % (proc.returncode, err[-600:]))
    p = run("ckpt", "verify", os.path.join(out, "ckpt"))
    expect(p.returncode == 0, "the checkpoints saved before are intact: %s" % p.stderr[-400:])


def shared_checkpoint_dir(tmp):
    """3. Two runs, one absolute checkpoint.dir."""
    shared = os.path.join(tmp, "shared-ckpt")
    cfg = config(tmp, "shared", checkpoint={"dir": shared, "every_steps": 2, "keep_last": 2})
    first_out, second_out = os.path.join(tmp, "first"), os.path.join(tmp, "second")
    first = start(cfg, first_out, "--steps", "100000")
    # Past step 10, so that its checkpoints are steps the second run's 6 never write over.
    if expect(wait_for_lines(os.path.join(first_out, "metrics.jsonl"), 10, first), "the first run trains"):
        p = train(cfg, second_out, "--steps", "2")
        expect(one_line(p, 1, "zoffload.checkpoint.dir " + shared, "in use by another zoffload run"),
               "a second run on the checkpoint directory is refused: rc %d, %s" % (p.returncode, p.stderr[-600:]))
        expect(not os.path.exists(second_out), "the refused run left no --out")
    first.send_signal(signal.SIGTERM)
    first.communicate(timeout=120)
    mine = sorted(n for n in os.listdir(shared) if n.startswith("step-"))
    # One after the other: the second run's pruning keeps the first's steps; `latest` is the second's.
    p = train(cfg, second_out, "--steps", "6")
    expect(p.returncode == 0, "the second run trains once the first has ended: %s" % p.stderr[-600:])
    left = sorted(n for n in os.listdir(shared) if n.startswith("step-"))
    expect(set(mine) <= set(left), "the first run's checkpoints %s are not pruned by the second's (%s)" % (mine, left))
    p = train(cfg, first_out, "--steps", "30", "--resume", "latest")
    expect(one_line(p, 2, "--resume latest", "written by another run", second_out),
           "--resume latest refuses the other run's checkpoint: rc %d, %s" % (p.returncode, p.stderr[-600:]))
    step = os.path.join(shared, mine[-1]) if mine else shared
    p = train(cfg, first_out, "--steps", str(int(mine[-1][5:]) + 1) if mine else "1", "--resume", step)
    expect(p.returncode == 0, "naming its own step directory continues the first run: %s" % p.stderr[-600:])


def whole_numbers(tmp):
    """4. Signs and fractions in whole-number options (--seed -1 was recorded as 2^64 - 1)."""
    cfg = config(tmp, "numbers")
    out = os.path.join(tmp, "numbers")
    for args in (["--seed", "-1"], ["--eval-every", "-1", "--eval-data", corpus], ["--eval-batches", "0",
                 "--eval-data", corpus], ["--steps", "-1"], ["--seq-len", "1.5"], ["--micro-batch", "2.5"]):
        steps = [] if args[0] == "--steps" else ["--steps", "1"]
        p = run("train", "--config", cfg, "--model", "tiny", "--data", corpus, "--out", out, *steps, *args)
        expect(one_line(p, 2, args[0], "is not a whole number") and len(p.stderr) < 400,
               "%s: one short line: rc %d, %s" % (" ".join(args), p.returncode, p.stderr[-400:]))
    for args in (["plan", "--config", cfg, "--model", "tiny", "--seq-len", "-3"],
                 ["config", "check", cfg, "--world-size", "-1"]):
        p = run(*args)
        expect(one_line(p, 2, "is not a whole number"), "%s: refused: %s" % (" ".join(args), p.stderr[-400:]))
    expect(not os.path.exists(out), "no --out for a command line refused")


def start_failures(tmp):
    """5. Found at start, after the config was read: nothing left behind."""
    cfg = config(tmp, "start", checkpoint={"dir": os.path.join(tmp, "start-ckpt")})
    out = os.path.join(tmp, "start", "deeper")
    p = train(cfg, out, "--steps", "2", data=os.path.join(tmp, "no-such-data.bin"))
    expect(p.returncode in (1, 2) and "no-such-data.bin" in p.stderr and not os.path.exists(os.path.join(tmp, "start")) and
           not os.path.exists(os.path.join(tmp, "start-ckpt")),
           "a missing --data leaves neither the --out it made nor the checkpoint dir: rc %d, %s, %s" %
           (p.returncode, p.stderr[-300:], os.listdir(tmp)))

    qwen = os.path.join(tmp, "qwen3")
    os.makedirs(qwen)
    with open(os.path.join(qwen, "config.json"), "w") as f:
        json.dump({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 256, "hidden_size": 64,
                   "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                   "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 128, "rms_norm_eps": 1e-6,
                   "rope_theta": 10000.0, "tie_word_embeddings": False, "use_sliding_window": True,
                   "sliding_window": 16, "max_window_layers": 2}, f)
    out = os.path.join(tmp, "qwen-run")
    p = train(cfg, out, "--steps", "1", model=qwen)
    expect(one_line(p, 2, "--seq-len 32", "sliding attention window", "sliding_window 16") and
           not os.path.exists(out), "a Qwen3 window under --seq-len is refused at start: rc %d, %s" %
           (p.returncode, p.stderr[-600:]))
    p = run("plan", "--config", cfg, "--model", qwen, "--seq-len", "32")
    expect(one_line(p, 2, "sliding attention window"), "plan refuses it too: %s" % p.stderr[-400:])

    big = json.load(open(cfg))
    big["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": "/tmp/" + "a" * 10_000_000}
    big_cfg = os.path.join(tmp, "big.json")
    with open(big_cfg, "w") as f:
        json.dump(big, f)
    for args in (["train", "--config", big_cfg, "--model", "tiny", "--data", corpus, "--out", out],
                 ["config", "check", big_cfg], ["plan", "--config", big_cfg, "--model", "tiny"]):
        p = run(*args)
        expect(p.returncode == 2 and len(p.stderr) < 1000 and "nvme_path" in p.stderr and "10000005 bytes" in p.stderr,
               "%s with a 10 MB nvme_path: one bounded line (%d bytes)" % (args[0], len(p.stderr)))


def tied_head(tmp):
    """6. tie_word_embeddings true with a different lm_head.weight in the file: untied, as transformers loads it."""
    cfg = config(tmp, "tied", checkpoint={"dir": "ckpt"})
    for distinct in (True, False):
        model = os.path.join(tmp, "tied-%s" % distinct)
        save_llama(model, tied=True, distinct_head=distinct)
        loaded = AutoModelForCausalLM.from_pretrained(model)
        untied = loaded.lm_head.weight.data_ptr() != loaded.get_input_embeddings().weight.data_ptr()
        out = os.path.join(tmp, "tied-run-%s" % distinct)
        p = train(cfg, out, "--steps", "1", model=model)
        if not expect(p.returncode == 0, "tied %s trains: %s" % (distinct, p.stderr[-600:])):
            continue
        step = os.path.join(out, "ckpt", "step-1")
        saved = json.load(open(os.path.join(step, "config.json")))["tie_word_embeddings"]
        header = open(os.path.join(step, "master.safetensors"), "rb").read(1 << 16)
        has_head = b'"lm_head.weight"' in header
        expect(untied == distinct and saved == (not distinct) and has_head == distinct,
               "distinct head %s: transformers ties %s, zoffload trains tie_word_embeddings %s with lm_head %s" %
               (distinct, not untied, saved, has_head))
        expect(("NOT tied" in p.stderr or "are not tied" in p.stderr) == distinct,
               "distinct head %s: warns as transformers does: %s" % (distinct, p.stderr[-400:]))
    # `zoffload plan` of a tied model whose weights are not downloaded reads its config.json alone.
    config_only = os.path.join(tmp, "config-only")
    os.makedirs(config_only)
    shutil.copy(os.path.join(tmp, "tied-True", "config.json"), config_only)
    p = run("plan", "--config", cfg, "--model", config_only, "--no-measure")
    expect(p.returncode == 0, "plan of a tied config.json without weights: rc %d, %s" % (p.returncode, p.stderr[-400:]))


def damaged_checkpoints(tmp):
    """7. NaN, inf or negative moments and absmax, their CRCs recomputed: refused by verify and resume."""
    model = os.path.join(tmp, "llama")
    save_llama(model)
    for moments in ("fp32", "8bit"):
        cfg = config(tmp, "moments-" + moments, moment_dtype=moments, checkpoint={"dir": "ckpt"})
        out = os.path.join(tmp, "moments-" + moments)
        p = train(cfg, out, "--steps", "2", model=model)
        if not expect(p.returncode == 0, "%s run: %s" % (moments, p.stderr[-600:])):
            continue
        pristine = os.path.join(out, "ckpt", "step-2")
        with open(os.path.join(pristine, "exp_avg_sq.safetensors"), "rb") as f:
            blob = f.read()
        n = struct.unpack("<Q", blob[:8])[0]
        header = json.loads(blob[8:8 + n])
        name = "model.layers.0.mlp.up_proj.weight" + (".absmax" if moments == "8bit" else "")
        begin = 8 + n + header[name]["data_offsets"][0]
        for what, value in (("negative", -0.5), ("nan", float("nan")), ("inf", float("inf"))):
            damaged = os.path.join(tmp, "damaged-%s-%s" % (moments, what), "step-2")
            shutil.copytree(pristine, damaged)
            with open(os.path.join(damaged, "exp_avg_sq.safetensors"), "r+b") as f:
                f.seek(begin + 4 * 3)
                f.write(struct.pack("<f", value))
            reseal(damaged, "exp_avg_sq.safetensors")
            p = run("ckpt", "verify", damaged)
            expect(one_line(p, 1, "exp_avg_sq.safetensors", name + ", element 3"),
                   "%s moments, %s: verify refuses it naming the tensor: rc %d, %s" %
                   (moments, what, p.returncode, p.stderr[-600:]))
            p = train(cfg, os.path.join(tmp, "resumed-%s-%s" % (moments, what)), "--steps", "3", "--resume", damaged,
                      model=model)
            expect(p.returncode == 1 and name in p.stderr and "finite" in p.stderr,
                   "%s moments, %s: --resume refuses it: rc %d, %s" % (moments, what, p.returncode, p.stderr[-600:]))

    # An export into its own checkpoint's step directory would be pruned with it.
    step = os.path.join(tmp, "moments-fp32", "ckpt", "step-2")
    p = run("export", "--checkpoint", step, "--dtype", "fp32", "--out", os.path.join(step, "export"))
    expect(one_line(p, 2, "inside the checkpoint") and not os.path.exists(os.path.join(step, "export")),
           "export --out inside a step directory is refused: rc %d, %s" % (p.returncode, p.stderr[-400:]))


def main():
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="zo-hostile-", dir=os.environ.get("TMPDIR", "/tmp")) as tmp:
        for part in (eval_data, shrinking_data, shared_checkpoint_dir, whole_numbers, start_failures, tied_head,
                     damaged_checkpoints):
            t = time.time()
            os.makedirs(os.path.join(tmp, part.__name__))
            part(os.path.join(tmp, part.__name__))
            print("%s: %.1f s" % (part.__name__, time.time() - t))
    print("%.1f s in all" % (time.time() - t0))
    report_and_exit()


main()

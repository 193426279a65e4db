#!/usr/bin/env python3
"""Checkpoints as a user meets them through the CLI (format: docs/checkpoint_format.md). The tiny
demo (optimizer states on NVMe) trains 6 steps saving every 2 with keep_last 2: step-4 and step-6
remain, `latest` names step-6, nothing tmp-* is left, and the files are what the format document
says (read here with the standard library: safetensors headers, manifest, CRC-32C of the small
files). Resuming from step-4 in another directory reproduces step-6 byte for byte, a save of a step
that exists replaces it, and `--resume latest` continues from step 6; with 8-bit and with bf16 moments
the same resume is byte for byte too, and one into fp32 moments is refused naming the key. `ckpt verify`/`inspect`
accept it; one flipped byte in any file, or a missing manifest, makes verify and --resume refuse it
with one error line naming the file; bad arguments give one line and the documented exit code; a
stale tmp directory is removed at the next start."""
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile

from cli_checks import crc32c, expect as check, report_and_exit

zoffload, source_dir = sys.argv[1], sys.argv[2]
demo_config = os.path.join(source_dir, "configs", "tiny_demo_nvme.json")
corpus = os.path.join(source_dir, "configs", "data", "demo_corpus.txt")
STATE_FILES = ["master.safetensors", "exp_avg.safetensors", "exp_avg_sq.safetensors"]
TINY_PARAMETERS = 3033344
TINY_TENSORS = 39
# The checkpoint directory's lock file, kept as --out's is (Note [One run per run directory]).
LOCK = [".zoffload.lock"]


def run(*args, timeout=600):
    return subprocess.run([zoffload, *args], capture_output=True, text=True, timeout=timeout)


# Sequences of 16 tokens: the demo config computes in bf16, which CPUs without native bf16 multiply
# on a slow path (14 s a step at the default 256 tokens on a 2-core EPYC, some 4 s at 32); what is
# checked here is the files, not the arithmetic's speed.
SEQ_LEN = 16


def train(config, out, steps, *extra):
    return run("train", "--config", config, "--model", "tiny", "--data", corpus, "--steps", str(steps), "--out", out,
               "--seq-len", str(SEQ_LEN), *extra)


def as_json(p):
    """The JSON object a successful command printed; {} otherwise (the checks then fail)."""
    try:
        return json.loads(p.stdout) if p.returncode == 0 else {}
    except ValueError:
        return {}


def error_lines(p):
    return [l for l in p.stderr.splitlines() if "error" in l]


def read(path):
    with open(path, "rb") as f:
        return f.read()


def flip(path, offset, mask=0x01):
    """XORs one byte; returns the byte it was."""
    with open(path, "r+b") as f:
        f.seek(offset)
        old = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([old ^ mask]))
    return old


def check_format(step_dir, step):
    """The layout docs/checkpoint_format.md describes, read independently of zoffload."""
    manifest = json.loads(read(os.path.join(step_dir, "manifest.json")))
    check(manifest.get("format") == "zoffload-checkpoint" and manifest.get("format_version") == 1 and
          manifest.get("step") == step and manifest.get("state_files") == STATE_FILES,
          "%s: manifest format, version, step and state files: %s" %
          (step_dir, {k: v for k, v in manifest.items() if k not in ("files", "tensors")}))
    names = [f["name"] for f in manifest.get("files", [])]
    check(sorted(names) == sorted(STATE_FILES + ["trainer_state.json", "config.json"]) and
          sorted(names + ["manifest.json"]) == sorted(os.listdir(step_dir)),
          "%s: the manifest lists every other file of the directory: %s vs %s" % (step_dir, names, os.listdir(step_dir)))
    tensors = manifest.get("tensors", [])
    check(len(tensors) == TINY_TENSORS and all(t["dtype"] == "F32" for t in tensors),
          "%s: %d F32 tensors in the manifest" % (step_dir, len(tensors)))
    for f in manifest.get("files", []):
        path = os.path.join(step_dir, f["name"])
        size = os.path.getsize(path)
        chunks = (size + f["chunk_bytes"] - 1) // f["chunk_bytes"]
        check(f["size_bytes"] == size and f["chunk_bytes"] == 16 << 20 and len(f["crc32c"]) == chunks and
              all(len(c) == 8 and int(c, 16) >= 0 for c in f["crc32c"]),
              "%s: size and one 8-hex-digit CRC per 16 MiB chunk: %s" % (path, f))
        if f["name"].endswith(".json"):
            check(f["crc32c"] == ["%08x" % crc32c(read(path))], "%s: CRC-32C as listed: %s" % (path, f["crc32c"]))
    for name in STATE_FILES:
        blob = read(os.path.join(step_dir, name))
        n = struct.unpack("<Q", blob[:8])[0]
        header_text = blob[8:8 + n].decode("utf-8")
        header = json.loads(header_text)
        meta = header.pop("__metadata__", {})
        check((8 + n) % 4096 == 0 and header_text == header_text.rstrip(" ") + " " * (len(header_text) -
                                                                                       len(header_text.rstrip(" "))),
              "%s: header padded with spaces so the data starts 4 KiB-aligned (at %d)" % (name, 8 + n))
        check(meta == {"format": "pt", "zoffload_state": name[:-len(".safetensors")]},
              "%s: __metadata__ %s" % (name, meta))
        end, ok = 0, True
        for t, (hname, h) in zip(tensors, header.items()):
            ok &= hname == t["name"] and h["dtype"] == "F32" and h["shape"] == t["shape"]
            ok &= h["data_offsets"][0] == end
            end = h["data_offsets"][1]
        check(ok and len(header) == len(tensors) and end == 4 * TINY_PARAMETERS and len(blob) == 8 + n + end,
              "%s: the manifest's tensors in order, fp32, back to back to the end of the file" % name)
    state = json.loads(read(os.path.join(step_dir, "trainer_state.json")))
    check(state.get("steps_done") == step and state.get("optimizer_steps") == step and
          set(state.get("loss_scaler", {})) == {"cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis"} and
          state.get("data_position") == {"epoch": 0, "index": 2 * step} and state.get("model") == "tiny" and
          state.get("seq_len") == SEQ_LEN and os.path.isabs(state.get("data", "")) and
          state.get("config", {}).get("zoffload", {}).get("checkpoint", {}).get("every_steps") == 2,
          "%s: trainer_state.json fields: %s" % (step_dir, {k: v for k, v in state.items() if k != "config"}))
    model = json.loads(read(os.path.join(step_dir, "config.json")))
    check(model.get("model_type") == "llama" and model.get("vocab_size") == 256 and
          model.get("num_hidden_layers") == 4, "%s: config.json is the model's HF config: %s" % (step_dir, model))


with tempfile.TemporaryDirectory(prefix="zo-ckpt-cli-", dir=os.environ.get("TMPDIR", "/tmp")) as tmp:
    with open(demo_config) as f:
        cfg = json.load(f)
    cfg["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = False
    check(cfg["zero_optimization"]["offload_optimizer"]["device"] == "nvme", "the demo config keeps Adam on NVMe")
    no_ckpt_config = os.path.join(tmp, "no_ckpt.json")
    with open(no_ckpt_config, "w") as f:
        json.dump(cfg, f)
    cfg["zoffload"]["checkpoint"] = {"dir": "ckpt", "every_steps": 2, "keep_last": 2}
    config = os.path.join(tmp, "ckpt.json")
    with open(config, "w") as f:
        json.dump(cfg, f)

    # 1. Six steps, a save every two, keep the last two.
    a = os.path.join(tmp, "A")
    a_ckpt = os.path.join(a, "ckpt")
    p = train(config, a, 6, "-q")
    if not check(p.returncode == 0, "6 steps with checkpoints exit 0: " + p.stderr[-2000:]):
        sys.exit("FAIL: the first run failed; nothing else can be checked\n" + p.stderr[-2000:])
    check(read(os.path.join(a_ckpt, "latest")) == b"step-6\n", "latest names step-6: %r" % read(os.path.join(a_ckpt, "latest")))
    check(sorted(os.listdir(a_ckpt)) == LOCK + ["latest", "step-4", "step-6"],
          "keep_last 2 leaves step-4 and step-6, nothing tmp-*: %s" % sorted(os.listdir(a_ckpt)))
    check_format(os.path.join(a_ckpt, "step-6"), 6)
    check_format(os.path.join(a_ckpt, "step-4"), 4)

    # 2. verify and inspect.
    p = run("ckpt", "verify", a_ckpt)
    check(p.returncode == 0 and "step-6: OK" in p.stdout, "ckpt verify exits 0: %d %s %s" % (p.returncode, p.stdout, p.stderr))
    p = run("ckpt", "verify", "--json", a_ckpt)
    j = as_json(p)
    check(j.get("ok") is True and j.get("files") == 5 and j.get("path", "").endswith("step-6"),
          "ckpt verify --json says ok: %d %s" % (p.returncode, p.stdout))
    p = run("ckpt", "inspect", "--json", a_ckpt)
    j = as_json(p)
    check(j.get("step") == 6 and j.get("optimizer_steps") == 6 and j.get("parameters") == TINY_PARAMETERS and
          j.get("tensors") == TINY_TENSORS and j.get("model") == "tiny" and
          j.get("bytes") == sum(os.path.getsize(os.path.join(a_ckpt, "step-6", n))
                                for n in STATE_FILES + ["trainer_state.json", "config.json"]),
          "ckpt inspect --json: step 6, %d parameters, %d tensors: %d %s" %
          (TINY_PARAMETERS, TINY_TENSORS, p.returncode, p.stdout[:600]))
    p = run("ckpt", "inspect", os.path.join(a_ckpt, "step-4"))
    check(p.returncode == 0 and "step 4 " in p.stdout and "%d parameters" % TINY_PARAMETERS in p.stdout,
          "ckpt inspect (text) of a step directory: %s %s" % (p.stdout, p.stderr))

    # 3. Resume bit-exactness: step-4 copied elsewhere, trained to 6, gives A's step-6 byte for byte.
    b = os.path.join(tmp, "B")
    os.makedirs(b)
    shutil.copytree(os.path.join(a_ckpt, "step-4"), os.path.join(b, "step-4"))
    p = train(config, b, 6, "--resume", os.path.join(b, "step-4"), "--json")
    check(p.returncode == 0, "resume from a copied step-4 exits 0: " + p.stderr[-2000:])
    j = as_json(p)
    check(j.get("first_step") == 4 and j.get("resumed_from") == os.path.join(b, "step-4"),
          "--json says it resumed at step 4: %s" % {k: j.get(k) for k in ("first_step", "resumed_from")})
    for name in STATE_FILES:
        mine, theirs = os.path.join(a_ckpt, "step-6", name), os.path.join(b, "ckpt", "step-6", name)
        check(os.path.isfile(theirs) and read(mine) == read(theirs),
              "%s after resuming at step 4 is byte-identical to the uninterrupted run's" % name)

    # 3b. 8-bit moments (zoffload.moment_dtype): five state files; bf16 moments: the three, BF16.
    # Each: the same bit-exact resume, and a resume into fp32 moments refused in one line naming the key.
    for md, files_md in (("8bit", STATE_FILES + ["exp_avg.codes", "exp_avg_sq.codes"]), ("bf16", STATE_FILES)):
        cfg_md = json.loads(json.dumps(cfg))
        cfg_md["zoffload"]["moment_dtype"] = md
        config_md = os.path.join(tmp, "ckpt-%s.json" % md)
        with open(config_md, "w") as f:
            json.dump(cfg_md, f)
        q = os.path.join(tmp, "Q-" + md)
        p = train(config_md, q, 4, "-q")
        if not check(p.returncode == 0, "4 steps with %s moments exit 0: %s" % (md, p.stderr[-2000:])):
            continue
        q4 = os.path.join(q, "ckpt", "step-4")
        check(all(os.path.isfile(os.path.join(q4, n)) for n in files_md) and
              json.loads(read(os.path.join(q4, "manifest.json")))["moment_dtype"] == md,
              "a %s checkpoint has its state files and says moment_dtype %s: %s" % (md, md, sorted(os.listdir(q4))))
        r_md = os.path.join(tmp, "R-" + md)
        os.makedirs(r_md)
        shutil.copytree(os.path.join(q, "ckpt", "step-2"), os.path.join(r_md, "step-2"))
        p = train(config_md, r_md, 4, "--resume", os.path.join(r_md, "step-2"), "-q")
        check(p.returncode == 0 and all(read(os.path.join(q4, n)) == read(os.path.join(r_md, "ckpt", "step-4", n))
                                        for n in files_md),
              "%s moments: resumed at step 2, step-4 is byte-identical to the uninterrupted run's: %s" %
              (md, p.stderr[-1000:]))
        p = train(config, os.path.join(tmp, "R32-" + md), 6, "--resume", q4, "-q")
        check(p.returncode == 2 and "zoffload.moment_dtype" in p.stderr and md in p.stderr and
              len(error_lines(p)) == 1,
              "a %s checkpoint resumed with fp32 moments: exit 2, one line naming the key: %d %s" %
              (md, p.returncode, p.stderr))

    # Again from step-4 into B, whose checkpoint directory already has step-6 (as after a run that
    # went further): the new step-6 replaces the old one atomically, and nothing tmp-* is left.
    b6 = os.path.join(b, "ckpt", "step-6")
    inode = os.stat(b6).st_ino if os.path.isdir(b6) else None
    p = train(config, b, 6, "--resume", os.path.join(b, "step-4"), "-q")
    if "cannot swap directories atomically" in p.stderr:
        check(p.returncode == 1, "without RENAME_EXCHANGE the final save fails with exit 1: %d" % p.returncode)
    else:
        check(p.returncode == 0 and os.stat(b6).st_ino != inode,
              "a save of an existing step replaces it: exit %d, %s" % (p.returncode, p.stderr[-1000:]))
        check(sorted(os.listdir(os.path.join(b, "ckpt"))) == LOCK + ["latest", "step-6"] and
              all(read(os.path.join(a_ckpt, "step-6", n)) == read(os.path.join(b6, n)) for n in STATE_FILES),
              "the replaced step-6 is byte-identical, nothing tmp-* left: %s" % os.listdir(os.path.join(b, "ckpt")))

    # 4. Corruption: one flipped byte in each file of a copy, in turn; verify and --resume refuse it
    # with one line naming the file, and accept the copy again once the byte is restored.
    c = os.path.join(tmp, "C")
    shutil.copytree(os.path.join(a_ckpt, "step-6"), c)
    master = read(os.path.join(c, "master.safetensors"))
    data_start = 8 + struct.unpack("<Q", master[:8])[0]
    meta_at = master.index(b'"zoffload_state":"master"') + len(b'"zoffload_state":"')
    manifest_text = read(os.path.join(c, "manifest.json"))
    # The first hex digit of the first file's first CRC (after `"crc32c": [` comes its opening quote).
    crc_at = manifest_text.index(b'"', manifest_text.index(b'"crc32c"') + len(b'"crc32c"')) + 1
    check(json.loads(manifest_text)["files"][0]["name"] == "master.safetensors", "the manifest lists master first")
    state_text = read(os.path.join(c, "trainer_state.json"))
    cases = [
        # (file, offset, xor mask, the file the error names, why)
        ("master.safetensors", data_start + 123457, 0x01, "master.safetensors", "a weight bit"),
        ("master.safetensors", meta_at, 0x20, "master.safetensors", "the header, still valid JSON"),
        ("master.safetensors", data_start - 5, 0x29, "master.safetensors", "the header padding, space to tab"),
        ("exp_avg_sq.safetensors", len(master) - 3, 0x01, "exp_avg_sq.safetensors", "the last chunk's tail"),
        ("trainer_state.json", state_text.index(b'"steps_done": 6') + len(b'"steps_done": '), 0x01,
         "trainer_state.json", "steps_done"),
        ("manifest.json", 0, 0x01, "manifest.json", "its first byte"),
        ("manifest.json", crc_at, 0x01, "master.safetensors", "a CRC digit of master.safetensors"),
        ("config.json", 10, 0x01, "config.json", "a key"),
    ]
    r = os.path.join(tmp, "R")
    for name, offset, mask, named, why in cases:
        path = os.path.join(c, name)
        before = read(path)
        flip(path, offset, mask)
        check(read(path) != before and len(read(path)) == len(before), "%s (%s): the byte changed" % (name, why))
        p = run("ckpt", "verify", c)
        lines = [l for l in p.stderr.splitlines() if l.strip()]
        check(p.returncode == 1 and len(lines) == 1 and named in lines[0] and
              ("checksum mismatch" in lines[0] or "Corruption" in lines[0]),
              "verify with %s flipped (%s): exit 1, one line naming %s: %d %s" % (name, why, named, p.returncode, p.stderr))
        p = run("ckpt", "verify", "--json", c)
        try:
            ok = json.loads(p.stdout).get("ok") if p.stdout.strip() else None
        except ValueError:
            ok = "not JSON"
        # Corruption found while reading prints ok false; found while opening, one error line.
        check(p.returncode == 1 and (ok is False or (ok is None and len(error_lines(p)) == 1)),
              "verify --json with %s flipped: exit 1 and ok false or one error line: %d %s %s" %
              (name, p.returncode, p.stdout, p.stderr))
        p = train(config, r, 8, "--resume", c, "-q")
        check(p.returncode == 1 and len(error_lines(p)) == 1 and named in error_lines(p)[0],
              "--resume with %s flipped (%s): exit 1, one error line naming %s: %d %s" %
              (name, why, named, p.returncode, p.stderr))
        flip(path, offset, mask)
        check(read(path) == before, "%s: the byte restored" % name)
    p = run("ckpt", "verify", "-q", c)
    check(p.returncode == 0, "the copy verifies again with every byte restored: " + p.stderr)
    check(not os.path.exists(os.path.join(r, "ckpt", "step-8")), "no refused resume trained or saved anything")

    # 5. A step directory without manifest.json (a save that did not finish) is never loaded.
    d = os.path.join(tmp, "D")
    shutil.copytree(a_ckpt, d)
    os.remove(os.path.join(d, "step-6", "manifest.json"))
    for target in (os.path.join(d, "step-6"), d):
        p = run("ckpt", "verify", target)
        check(p.returncode != 0 and len(error_lines(p)) == 1 and "manifest.json" in p.stderr,
              "verify %s without manifest.json refuses it naming manifest.json: %d %s" % (target, p.returncode, p.stderr))
        p = train(config, r, 8, "--resume", target, "-q")
        check(p.returncode == 1 and len(error_lines(p)) == 1 and "manifest.json" in p.stderr,
              "--resume %s without manifest.json: exit 1 naming manifest.json: %d %s" % (target, p.returncode, p.stderr))
    p = run("ckpt", "verify", d)
    check("no manifest.json" in p.stderr, "through latest the message says the step has no manifest.json: " + p.stderr)
    p = run("ckpt", "verify", os.path.join(d, "step-6"))
    check("incomplete save" in p.stderr, "the step directory itself is called an incomplete save: " + p.stderr)

    # 6. Bad arguments: one line, the documented exit code.
    p = train(no_ckpt_config, os.path.join(tmp, "E"), 8, "--resume", "latest", "-q")
    check(p.returncode == 2 and len(error_lines(p)) == 1 and "zoffload.checkpoint.dir" in p.stderr,
          "--resume latest without zoffload.checkpoint.dir: exit 2, one line: %d %s" % (p.returncode, p.stderr))
    p = train(config, os.path.join(tmp, "E"), 8, "--resume", "/nonexistent/zo-ckpt", "-q")
    check(p.returncode == 2 and len(error_lines(p)) == 1 and "/nonexistent/zo-ckpt" in p.stderr,
          "--resume /nonexistent: exit 2 (bad input), one line naming it: %d %s" % (p.returncode, p.stderr))
    for verb in ("verify", "inspect"):
        p = run("ckpt", verb, "/nonexistent/zo-ckpt")
        check(p.returncode == 2 and len(error_lines(p)) == 1 and "/nonexistent/zo-ckpt" in p.stderr,
              "ckpt %s /nonexistent: exit 2, one line: %d %s" % (verb, p.returncode, p.stderr))

    # 7. A stale tmp directory (a killed save) is removed at the next start with that config; a start
    # already at the requested step trains nothing and saves nothing.
    stale = os.path.join(a_ckpt, "tmp-99-deadbeef01234567")
    os.makedirs(stale)
    with open(os.path.join(stale, "junk"), "w") as f:
        f.write("left by a killed save")
    p = train(config, a, 6, "--resume", "latest", "--json")
    check(p.returncode == 0 and as_json(p).get("checkpoints") == [],
          "a start at step 6 of 6 exits 0 and saves nothing: %d %s %s" % (p.returncode, p.stdout[-300:], p.stderr[-1000:]))
    check(not os.path.exists(stale) and sorted(os.listdir(a_ckpt)) == LOCK + ["latest", "step-4", "step-6"],
          "the stale tmp-99-deadbeef01234567 is removed, the checkpoints kept: %s" % sorted(os.listdir(a_ckpt)))

    # 8. --resume latest continues from step 6 to 8 in the same directory.
    p = train(config, a, 8, "--resume", "latest", "--json")
    check(p.returncode == 0, "--resume latest to step 8 exits 0: " + p.stderr[-2000:])
    j = as_json(p)
    check(j.get("first_step") == 6 and j.get("resumed_from") == os.path.join(a_ckpt, "step-6") and
          [os.path.basename(s["path"]) for s in j.get("checkpoints", [])] == ["step-8"],
          "--resume latest continues from step 6 and saves step-8: %s" %
          {k: j.get(k) for k in ("first_step", "resumed_from", "checkpoints")})
    check(read(os.path.join(a_ckpt, "latest")) == b"step-8\n" and
          sorted(os.listdir(a_ckpt)) == LOCK + ["latest", "step-6", "step-8"],
          "latest names step-8 and step-4 is pruned: %s" % sorted(os.listdir(a_ckpt)))
    p = run("ckpt", "inspect", "--json", a_ckpt)
    check(as_json(p).get("step") == 8, "inspect follows latest to step 8: %s" % p.stdout[:300])

report_and_exit()

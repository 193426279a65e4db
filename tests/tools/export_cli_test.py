#!/usr/bin/env python3
"""`zoffload export` as a user runs it: the tiny demo trains 4 steps with checkpoints, its latest
checkpoint is exported in bf16 (one file), fp16 and fp32 (several shards with an index); a reader
written here with only the standard library parses every file (header length, JSON, contiguous
offsets, __metadata__.format == "pt", weight_map and total_size) and finds every tensor equal, bit
for bit, to the checkpoint's own fp32 master rounded to nearest even; the exported directory trains
again with `zoffload train --model`; bad input fails with one line and exit 2 (1 for a corrupted
checkpoint, which leaves nothing behind). A run with bf16 masters saves them as BF16, and its bf16
and fp32 exports hold their bits."""
import array
import json
import math
import os
import shutil
import struct
import subprocess
import sys
import tempfile

from cli_checks import expect, report_and_exit

zoffload, source_dir = sys.argv[1], sys.argv[2]
demo_config = os.path.join(source_dir, "configs", "tiny_demo_nvme.json")
corpus = os.path.join(source_dir, "configs", "data", "demo_corpus.txt")

DTYPE_BYTES = {"F32": 4, "BF16": 2, "F16": 2}


# Sequences of 32 tokens: the demo config computes in bf16, which CPUs without native bf16 multiply
# on a slow path; what is checked here is the exported files.
SEQ_LEN = "32"


def run(*args, timeout=600):
    return subprocess.run([zoffload, *args], capture_output=True, text=True, timeout=timeout)


def error_lines(p):
    return [l for l in p.stderr.splitlines() if l.strip()]


def read_safetensors(path, exported=True):
    """{name: (dtype, shape, raw bytes)}, checking the format as HF's reader does. An export's
    __metadata__ is exactly {"format": "pt"}; a checkpoint's may say more."""
    with open(path, "rb") as f:
        blob = f.read()
    n = struct.unpack("<Q", blob[:8])[0]
    expect(8 + n <= len(blob), "%s: header length %d within the file" % (path, n))
    header = json.loads(blob[8:8 + n].decode("utf-8"))
    expect((8 + n) % 4096 == 0, "%s: data starts 4 KiB-aligned (%d)" % (path, 8 + n))
    meta = header.pop("__metadata__", None)
    expect(meta == {"format": "pt"} if exported else (meta or {}).get("format") == "pt",
           "%s: __metadata__ is {format: pt}: %s" % (path, meta))
    data = blob[8 + n:]
    tensors, end = {}, 0
    for name, t in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        begin, stop = t["data_offsets"]
        expect(begin == end, "%s: %s starts at %d, right after the previous tensor (%d)" % (path, name, begin, end))
        count = 1
        for d in t["shape"]:
            count *= d
        expect(stop - begin == count * DTYPE_BYTES[t["dtype"]], "%s: %s size matches shape and dtype" % (path, name))
        tensors[name] = (t["dtype"], t["shape"], data[begin:stop])
        end = stop
    expect(end == len(data), "%s: the data section is exactly the tensors (%d of %d bytes)" % (path, end, len(data)))
    return tensors


def read_model_dir(d):
    """Every tensor of a HF directory: model.safetensors, or the index and its shards."""
    index_path = os.path.join(d, "model.safetensors.index.json")
    if not os.path.exists(index_path):
        return read_safetensors(os.path.join(d, "model.safetensors")), ["model.safetensors"]
    with open(index_path) as f:
        index = json.load(f)
    weight_map = index["weight_map"]
    shards = sorted(set(weight_map.values()))
    n = len(shards)
    expect(shards == ["model-%05d-of-%05d.safetensors" % (k + 1, n) for k in range(n)],
           "%s: shards named model-0000k-of-0000n: %s" % (d, shards))
    tensors, total = {}, 0
    for shard in shards:
        for name, t in read_safetensors(os.path.join(d, shard)).items():
            expect(weight_map.get(name) == shard, "%s: weight_map puts %s in %s" % (d, name, shard))
            expect(name not in tensors, "%s: %s in one shard only" % (d, name))
            tensors[name] = t
            total += len(t[2])
    expect(set(weight_map) == set(tensors), "%s: weight_map names exactly the tensors" % d)
    expect(index["metadata"]["total_size"] == total, "%s: total_size %s == %d" % (d, index["metadata"], total))
    return tensors, shards + ["model.safetensors.index.json"]


def to_bf16(raw_f32):
    bits = array.array("I", raw_f32)
    out = array.array("H", bytes(2 * len(bits)))
    for i, u in enumerate(bits):
        if (u & 0x7FFFFFFF) > 0x7F800000:
            out[i] = (u >> 16) | 0x40  # quiet NaN
        else:
            out[i] = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF  # round to nearest, ties to even
    return out.tobytes()


def to_f16(raw_f32):
    floats = array.array("f", raw_f32)
    try:
        return struct.pack("<%de" % len(floats), *floats)  # rounds to nearest even
    except OverflowError:
        out = bytearray()
        for v in floats:
            try:
                out += struct.pack("<e", v)
            except OverflowError:
                out += struct.pack("<e", math.copysign(math.inf, v))
        return bytes(out)


def widened_bf16(raw_f32):
    """The bf16 bytes of fp32 values whose low 16 bits are all zero (bf16 values widened), else None."""
    zeros = bytes(len(raw_f32) // 4)
    if raw_f32[0::4] != zeros or raw_f32[1::4] != zeros:
        return None
    out = bytearray(len(raw_f32) // 2)
    out[0::2], out[1::2] = raw_f32[2::4], raw_f32[3::4]
    return bytes(out)


def overflow_count(raw_f32):
    return sum(1 for v in array.array("f", raw_f32) if math.isfinite(v) and abs(v) >= 65520.0)


with tempfile.TemporaryDirectory(prefix="zo-export-cli-", dir=os.environ.get("TMPDIR", "/tmp")) as tmp:
    with open(demo_config) as f:
        config = json.load(f)
    config["zoffload"]["checkpoint"] = {"dir": "ckpt", "every_steps": 2}
    config_path = os.path.join(tmp, "config.json")
    with open(config_path, "w") as f:
        json.dump(config, f)
    # Training from an export: no checkpoints, no export at the end.
    plain = json.loads(json.dumps(config))
    del plain["zoffload"]["checkpoint"]
    plain["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = False
    plain_path = os.path.join(tmp, "plain.json")
    with open(plain_path, "w") as f:
        json.dump(plain, f)

    run_dir = os.path.join(tmp, "run")
    p = run("train", "--config", config_path, "--model", "tiny", "--data", corpus, "--steps", "4", "--seq-len", SEQ_LEN,
            "--out", run_dir, "-q")
    ckpt_dir = os.path.join(run_dir, "ckpt")
    if not expect(p.returncode == 0 and os.path.exists(os.path.join(ckpt_dir, "latest")),
                  "training with checkpoints exits 0 and writes ckpt/latest: %d %s" % (p.returncode, p.stderr[-2000:])):
        report_and_exit()
    with open(os.path.join(ckpt_dir, "latest")) as f:
        step_dir = os.path.join(ckpt_dir, f.read().strip())
    master = read_safetensors(os.path.join(step_dir, "master.safetensors"), exported=False)
    expect(all(t[0] == "F32" for t in master.values()) and len(master) > 10, "the master is fp32 with every tensor")
    with open(os.path.join(step_dir, "config.json")) as f:
        ckpt_config = json.load(f)

    exports = {}
    for dtype, shard_size, hf_dtype, torch_dtype in [("bf16", None, "BF16", "bfloat16"), ("fp16", "1MB", "F16", "float16"),
                                                    ("fp32", "3MiB", "F32", "float32")]:
        out = os.path.join(tmp, "hf-" + dtype)
        exports[dtype] = out
        args = ["export", "--checkpoint", ckpt_dir, "--dtype", dtype, "--out", out, "--staging", "1MiB", "--json"]
        if shard_size:
            args += ["--shard-size", shard_size]
        p = run(*args)
        if not expect(p.returncode == 0, "export %s exits 0: %s" % (dtype, p.stderr)):
            continue
        summary = json.loads(p.stdout)
        tensors, files = read_model_dir(out)
        expect(sorted(summary["files"]) == sorted(files + ["config.json"]) == sorted(os.listdir(out)),
               "%s: --json lists exactly the files written: %s vs %s" % (dtype, summary["files"], os.listdir(out)))
        expect(summary["dtype"] == dtype and summary["out_dir"] == out and summary["seconds"] >= 0,
               "%s: --json summary: %s" % (dtype, summary))
        expect(summary["tensor_bytes"] == sum(len(t[2]) for t in tensors.values()), "%s: tensor_bytes" % dtype)
        if shard_size:
            expect(len(files) > 2, "%s: --shard-size %s gives several shards: %s" % (dtype, shard_size, files))
        else:
            expect(files == ["model.safetensors"], "%s: a model under 5GB is one model.safetensors" % dtype)
        expect(set(tensors) == set(master), "%s: the master's tensor names" % dtype)
        expected_overflow = 0
        for name, (m_dtype, shape, raw) in master.items():
            if name not in tensors:
                continue
            got_dtype, got_shape, got = tensors[name]
            expect(got_dtype == hf_dtype and got_shape == shape, "%s: %s is %s %s" % (dtype, name, got_dtype, got_shape))
            want = to_bf16(raw) if dtype == "bf16" else to_f16(raw) if dtype == "fp16" else raw
            if got != want:
                first = next(i for i in range(0, len(want), 2) if got[i:i + 2] != want[i:i + 2])
                expect(False, "%s: %s differs from the rounded master at byte %d" % (dtype, name, first))
            if dtype == "fp16":
                expected_overflow += overflow_count(raw)
        expect(summary["overflowed"] == expected_overflow, "%s: overflowed %s" % (dtype, summary["overflowed"]))
        with open(os.path.join(out, "config.json")) as f:
            exported_config = json.load(f)
        expect(exported_config.pop("torch_dtype", None) == torch_dtype, "%s: config.json torch_dtype" % dtype)
        ckpt_config.pop("torch_dtype", None)
        expect(exported_config == ckpt_config, "%s: config.json is the checkpoint's model config" % dtype)

    # The end-of-training export (stage3_gather_16bit_weights_on_model_save, from the live store)
    # holds the same bytes as this export of the final checkpoint.
    for name in sorted(os.listdir(run_dir)):
        if name.startswith("hf-export") and os.path.isdir(os.path.join(run_dir, name)) and "bf16" in exports:
            end_of_training, _ = read_model_dir(os.path.join(run_dir, name))
            from_ckpt, _ = read_model_dir(exports["bf16"])
            expect(end_of_training == from_ckpt, "%s equals the bf16 export of the final checkpoint" % name)

    # An export trains again.
    for dtype in ("bf16", "fp16"):
        p = run("train", "--config", plain_path, "--model", exports[dtype], "--data", corpus, "--steps", "1",
                "--seq-len", SEQ_LEN, "--out", os.path.join(tmp, "again-" + dtype), "--json")
        expect(p.returncode == 0, "the %s export loads into zoffload train --model: %s" % (dtype, p.stderr[-2000:]))

    # The tokenizer goes along: --tokenizer-from copies its files byte for byte, and a run that
    # trained from a model directory with a tokenizer exports it at the end.
    tok = os.path.join(tmp, "tok")
    os.makedirs(tok)
    tok_files = {"tokenizer.json": '{"model": {"type": "BPE"}}', "tokenizer_config.json": '{"eos_token": "</s>"}',
                 "generation_config.json": '{"do_sample": false}'}
    for name, text in tok_files.items():
        with open(os.path.join(tok, name), "w") as f:
            f.write(text)
    with open(os.path.join(tok, "README.md"), "w") as f:
        f.write("not a tokenizer file")
    out = os.path.join(tmp, "hf-tok")
    p = run("export", "--checkpoint", ckpt_dir, "--dtype", "bf16", "--out", out, "--tokenizer-from", tok, "--json")
    if expect(p.returncode == 0, "export --tokenizer-from exits 0: %s" % p.stderr):
        expect(sorted(os.listdir(out)) == sorted(["model.safetensors", "config.json"] + list(tok_files)),
               "--tokenizer-from copies the tokenizer files only: %s" % os.listdir(out))
        expect(all(open(os.path.join(out, n)).read() == t for n, t in tok_files.items()), "copied byte for byte")
        expect(sorted(json.loads(p.stdout)["files"]) == sorted(os.listdir(out)), "--json lists the copied files")
    with_tok = os.path.join(tmp, "model-with-tokenizer")
    shutil.copytree(exports["bf16"], with_tok)
    for name in tok_files:
        shutil.copy(os.path.join(tok, name), with_tok)
    exporting = json.loads(json.dumps(plain))
    exporting["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    exporting_path = os.path.join(tmp, "exporting.json")
    with open(exporting_path, "w") as f:
        json.dump(exporting, f)
    again = os.path.join(tmp, "again-tok")
    p = run("train", "--config", exporting_path, "--model", with_tok, "--data", corpus, "--steps", "1",
            "--seq-len", SEQ_LEN, "--out", again, "-q")
    final = os.path.join(again, "hf-export-step-1")
    if expect(p.returncode == 0 and os.path.isdir(final), "training from a model with a tokenizer: %s" % p.stderr[-2000:]):
        expect(all(os.path.exists(os.path.join(final, n)) for n in tok_files),
               "the end-of-training export carries the tokenizer: %s" % os.listdir(final))

    # Bad input: one line saying what is wrong.
    busy = exports["bf16"]
    before = sorted(os.listdir(busy))
    cases = [
        (["--checkpoint", ckpt_dir, "--dtype", "fp8", "--out", os.path.join(tmp, "x1")], (2,), "fp8"),
        (["--checkpoint", os.path.join(tmp, "no-such-ckpt"), "--dtype", "bf16", "--out", os.path.join(tmp, "x2")], (2,),
         "no-such-ckpt"),
        (["--checkpoint", ckpt_dir, "--dtype", "bf16", "--out", busy], (1, 2), busy),
        (["--checkpoint", ckpt_dir, "--dtype", "bf16", "--out", os.path.join(tmp, "x3"), "--shard-size", "5XB"], (2,),
         "5XB"),
        (["--checkpoint", ckpt_dir, "--dtype", "bf16", "--out", os.path.join(tmp, "x5"), "--tokenizer-from",
          os.path.join(tmp, "no-such-model")], (2,), "no-such-model"),
    ]
    for args, codes, needle in cases:
        p = run("export", *args, timeout=120)
        lines = error_lines(p)
        expect(p.returncode in codes, "%s: exit %s, got %d: %s" % (needle, codes, p.returncode, p.stderr))
        expect(len(lines) == 1 and lines[0].startswith("zoffload export: error: ") and needle in lines[0],
               "%s: one line naming it: %s" % (needle, p.stderr))
    expect(sorted(os.listdir(busy)) == before, "a refused export leaves the directory as it was")
    for name in ("x1", "x2", "x3", "x5"):
        expect(not os.path.exists(os.path.join(tmp, name)), "a refused export creates nothing (%s)" % name)

    # A flipped byte in a copy of the checkpoint's master: exit 1 naming the file, nothing written.
    broken = os.path.join(tmp, "broken-step")
    shutil.copytree(step_dir, broken)
    master_path = os.path.join(broken, "master.safetensors")
    size = os.path.getsize(master_path)
    with open(master_path, "r+b") as f:
        f.seek(size // 2)
        b = f.read(1)
        f.seek(size // 2)
        f.write(bytes([b[0] ^ 0x01]))
    out = os.path.join(tmp, "x4")
    p = run("export", "--checkpoint", broken, "--dtype", "bf16", "--out", out, "-q")
    lines = error_lines(p)
    expect(p.returncode == 1, "corrupted master: exit 1, got %d: %s" % (p.returncode, p.stderr))
    expect(len(lines) == 1 and "master.safetensors" in lines[0] and "Corruption" in lines[0],
           "corrupted master: one line naming the file: %s" % p.stderr)
    expect(not os.path.exists(out), "a failed export removes what it wrote")

    # A killed export (SIGKILL while its files are being written) never leaves a partial --out:
    # at most an OUT.tmp-<random> sibling, as docs/export.md says; exporting again succeeds. The
    # process runs in slices of 2 ms (SIGCONT ... SIGSTOP) until its tmp directory holds a file,
    # so the kill lands mid-export however fast this machine is.
    import signal
    import time
    out = os.path.join(tmp, "killed")
    proc = subprocess.Popen([zoffload, "export", "--checkpoint", ckpt_dir, "--dtype", "fp32", "--shard-size", "64KiB",
                             "--staging", "1MiB", "--out", out, "-q"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    os.kill(proc.pid, signal.SIGSTOP)
    caught = False
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        tmps = [n for n in os.listdir(tmp) if n.startswith("killed.tmp-")]
        if tmps and os.listdir(os.path.join(tmp, tmps[0])):
            os.kill(proc.pid, signal.SIGKILL)
            caught = True
            break
        os.kill(proc.pid, signal.SIGCONT)
        time.sleep(0.002)
        os.kill(proc.pid, signal.SIGSTOP)
    if not caught and proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    expect(caught, "the export was caught with files in its tmp directory (exit %s)" % proc.returncode)
    expect(proc.returncode == -signal.SIGKILL, "the export was killed: %s" % proc.returncode)
    expect(not os.path.exists(out), "a killed export leaves no partial --out")
    left = [n for n in os.listdir(tmp) if n.startswith("killed.tmp-")]
    expect(len(left) == 1, "a killed export leaves its tmp sibling: %s" % left)
    p = run("export", "--checkpoint", ckpt_dir, "--dtype", "fp32", "--shard-size", "64KiB", "--out", out, "--json")
    expect(p.returncode == 0, "exporting again after the kill succeeds: %d %s" % (p.returncode, p.stderr[-500:]))
    tensors, files = read_model_dir(out)
    expect(len(tensors) > 0 and len(files) > 2, "the export after the kill is a whole, sharded model directory")

    p = run("export", "--help")
    expect(p.returncode == 0 and "--shard-size" in p.stdout and "--dtype" in p.stdout, "--help answers")

    # bf16 masters (zoffload.master_dtype): the checkpoint keeps them as BF16 tensors, a bf16 export
    # writes their bytes and an fp32 one widens them exactly (each value's low 16 bits zero).
    masters16 = json.loads(json.dumps(config))
    masters16["zoffload"]["master_dtype"] = "bf16"
    masters16_path = os.path.join(tmp, "masters16.json")
    with open(masters16_path, "w") as f:
        json.dump(masters16, f)
    run16 = os.path.join(tmp, "run16")
    p = run("train", "--config", masters16_path, "--model", "tiny", "--data", corpus, "--steps", "2", "--seq-len",
            SEQ_LEN, "--out", run16, "-q")
    if expect(p.returncode == 0, "training with bf16 masters exits 0: %s" % p.stderr[-2000:]):
        ckpt16 = os.path.join(run16, "ckpt", "step-2")
        master16 = read_safetensors(os.path.join(ckpt16, "master.safetensors"), exported=False)
        expect(len(master16) > 10 and all(t[0] == "BF16" for t in master16.values()), "the bf16 masters are saved as BF16")
        for dtype in ("bf16", "fp32"):
            out = os.path.join(tmp, "hf16-" + dtype)
            p = run("export", "--checkpoint", ckpt16, "--dtype", dtype, "--out", out, "-q")
            if not expect(p.returncode == 0, "export %s of bf16 masters exits 0: %s" % (dtype, p.stderr)):
                continue
            tensors, _ = read_model_dir(out)
            bad = []
            for name, (_, _, raw16) in master16.items():
                raw = tensors[name][2]
                if dtype == "fp32":
                    raw = widened_bf16(raw)
                if raw != raw16:
                    bad.append(name)
            expect(not bad, "the %s export of bf16 masters holds their bits: %s differ" % (dtype, bad[:3]))

report_and_exit()

#!/usr/bin/env python3
"""`zoffload config check` as a user runs it: exit codes, stdout JSON, one stderr line per error."""
import errno
import json
import os
import subprocess
import sys
import tempfile

zoffload, configs = sys.argv[1], sys.argv[2]
failures = []
checks = 0


def run(*args):
    p = subprocess.run([zoffload, "config", "check", *args], capture_output=True, text=True)
    return p.returncode, p.stdout, p.stderr


def expect(cond, what):
    global checks
    checks += 1
    if not cond:
        failures.append(what)


# A valid file: exit 0 and the fully resolved config on stdout.
rc, out, err = run(os.path.join(configs, "stage2_cpu_offload.json"))
expect(rc == 0, "valid config exits 0 (got %d: %s)" % (rc, err))
resolved = json.loads(out) if rc == 0 else {}
expect(resolved.get("zero_optimization", {}).get("sub_group_size") == 1000000000, "defaults are filled in")
expect(resolved.get("gradient_accumulation_steps") == 8, "accumulation derived from train_batch_size / micro")

# The resolved output is itself a valid config.
with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
    f.write(out)
rc2, out2, _ = run(f.name)
expect(rc2 == 0 and json.loads(out2) == resolved, "resolved output re-checks to itself")
os.unlink(f.name)

# "auto" needs values from flags.
accel = os.path.join(configs, "accelerate", "zero_stage3_offload_config.json")
rc, out, err = run(accel)
expect(rc == 2, "unresolved auto exits 2")
expect("--hidden-size" in err and "--steps" in err, "errors name the flags that resolve auto:\n" + err)
rc, out, err = run(accel, "--hidden-size", "4096", "--micro-batch", "2", "--steps", "100")
expect(rc == 0, "accelerate config loads with flags (got %d: %s)" % (rc, err))
expect(json.loads(out)["zero_optimization"]["stage3_prefetch_bucket_size"] == 15099494 if rc == 0 else False,
       "0.9*h*h resolved")

# A broken file: exit 2, one line per error, each naming file and key path.
with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
    json.dump({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 4, "sub_grup_size": 1},
               "aio": {"thread_count": 2}}, f)
rc, out, err = run(f.name)
lines = [l for l in err.splitlines() if ": error: " in l]
expect(rc == 2, "bad config exits 2")
expect(out == "", "nothing on stdout for a bad config")
expect(len(lines) == 2, "one line per error, got:\n" + err)
expect(any(l.startswith(f.name + ": error: zero_optimization.stage: ") for l in lines), "stage error names its path")
expect(any("zero_optimization.sub_grup_size: unknown key; did you mean \"sub_group_size\"?" in l for l in lines),
       "unknown key suggests the closest")
expect(any("warning: aio.thread_count: deprecated" in l for l in err.splitlines()), "deprecation warning printed")
os.unlink(f.name)

rc, _, err = run("/nonexistent/ds.json")
expect(rc == 2 and "/nonexistent/ds.json: error: cannot open config file: %s\n" % os.strerror(errno.ENOENT) in err,
       "missing file is a clear error, naming the path once: " + err)
# Issue 40: a 10 MB path was printed twice on one line. 100 KB is as long as one argument may be
# (execve's limit is 128 KiB); the kernel refuses a name over PATH_MAX, and each line names the
# file by a 200-byte excerpt.
long_path = "/nonexistent/" + "x" * 100_000
rc, out, err = run(long_path)
expect(rc == 2 and out == "", "a 100 KB path exits 2 (got %d)" % rc)
expect(len(err) < 2048, "a 100 KB path gives under 2 KB of stderr, got %d bytes" % len(err))
expect(err.splitlines()[:1] == ["/nonexistent/%s... (100013 bytes): error: cannot read config file: %s"
                                % ("x" * 187, os.strerror(errno.ENAMETOOLONG))],
       "a 100 KB path is named by an excerpt, once, with the problem: " + err[:500])
rc, out, _ = run("--demo")
expect(rc == 0 and json.loads(out)["zero_optimization"]["offload_optimizer"]["device"] == "nvme", "--demo checks the embedded config")

# `config keys`: one line per key with its type and default, then the other names and no-effect keys.
p = subprocess.run([zoffload, "config", "keys"], capture_output=True, text=True)
lines = p.stdout.splitlines()
expect(p.returncode == 0 and lines[0].split() == ["KEY", "TYPE", "DEFAULT"], "config keys prints its table: " + p.stderr)
row = [l for l in lines if l.startswith("aio.queue_depth ")]
expect(len(row) == 1 and "count ≥ 1" in row[0] and row[0].split()[-1] == "8", "config keys row of aio.queue_depth: %r" % row)
expect(any("aio.thread_count -> aio.intra_op_parallelism  (deprecated: warns)" in l for l in lines), "config keys lists other names")
expect(any(l.startswith("  wandb: ") for l in lines), "config keys lists no-effect keys")
p = subprocess.run([zoffload, "config", "keys", "--json"], capture_output=True, text=True)
keys = {k["path"]: k for k in json.loads(p.stdout)["keys"]} if p.returncode == 0 else {}
expect(keys.get("gradient_clipping", {}).get("auto") is True and keys["gradient_clipping"]["default"] == 1.0,
       "config keys --json: gradient_clipping takes auto, default 1.0")

# zoffload-bench io --emit-config writes an aio block that this loader accepts, keeping other keys.
bench = os.path.join(os.path.dirname(zoffload), "zoffload-bench")
with tempfile.TemporaryDirectory(dir=os.environ.get("MESON_BUILD_ROOT")) as d:
    cfg = os.path.join(d, "ds.json")
    with open(cfg, "w") as f:
        json.dump({"train_micro_batch_size_per_gpu": 2, "aio": {"thread_count": 3}}, f)
    p = subprocess.run([bench, "io", "--path", d, "--size", "16MiB", "--block-size", "128K,1M",
                        "--queue-depth", "4", "--backend", "psync", "--no-baseline", "--emit-config", cfg],
                       capture_output=True, text=True)
    expect(p.returncode == 0, "zoffload-bench io --emit-config ran (rc %d): %s" % (p.returncode, p.stderr[-2000:]))
    rc, out, err = run(cfg)
    expect(rc == 0 and "warning" not in err, "the emitted config loads without warnings: " + err)
    if rc == 0:
        aio = json.loads(out)["aio"]
        expect(aio["block_size"] in (131072, 1048576) and aio["queue_depth"] == 4, "emitted aio values are read back")
        expect(json.loads(out)["train_micro_batch_size_per_gpu"] == 2, "other keys kept")

for f in failures:
    print("FAIL:", f)
print("%d passed, %d failed" % (checks - len(failures), len(failures)))
sys.exit(1 if failures else 0)

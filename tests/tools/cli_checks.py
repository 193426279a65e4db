"""What the command-line tests here share: checks that are counted and collect their failures, and
the report at the end (every failure, then the counts; exit 1 when any check failed)."""
import json
import os
import sys

failures = []
_checks = 0


def expect(cond, what):
    """Counts a check; records `what` when `cond` is false. Returns cond, so a test can stop early."""
    global _checks
    _checks += 1
    if not cond:
        failures.append(what)
    return cond


def flatten(node, prefix="", leaves=()):
    """A nested JSON object as {"a.b.c": value}; the keys named in `leaves` stay whole values."""
    out = {}
    for k, v in node.items():
        path = prefix + k
        if isinstance(v, dict) and k not in leaves:
            out.update(flatten(v, path + ".", leaves))
        else:
            out[path] = v
    return out


def demo_config_as_setup_runs_it(source_dir, tmp):
    """configs/tiny_demo_nvme.json as `tools/setup.sh demo` runs it on this machine: with bf16 off
    where there is no GPU and the CPU has no native bf16 (avx512_bf16, amx_bf16), as LibTorch's bf16
    matmuls take a slow path there (some 13 times slower); else the file itself."""
    path = os.path.join(source_dir, "configs", "tiny_demo_nvme.json")
    with open("/proc/cpuinfo") as f:
        flags = set(f.read().split())
    if os.path.exists("/proc/driver/nvidia/gpus") or flags & {"avx512_bf16", "amx_bf16"}:
        return path
    with open(path) as f:
        c = json.load(f)
    c["bf16"] = {"enabled": False}
    fp32 = os.path.join(tmp, "tiny_demo_nvme_fp32.json")
    with open(fp32, "w") as f:
        json.dump(c, f, indent=2)
    return fp32


def crc32c(data):
    """CRC-32C (Castagnoli, reflected, init and final xor 0xffffffff): what the manifest lists."""
    crc = 0xFFFFFFFF
    for b in data:
        crc = CRC_TABLE[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def make_crc_table():
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


CRC_TABLE = make_crc_table()



def reseal(step_dir, name):
    """Recomputes the manifest's CRC-32C list (one per 16 MiB chunk) and size of the checkpoint file
    `name` after a test changed it: a damaged checkpoint whose checksums were made to match."""
    path = os.path.join(step_dir, "manifest.json")
    with open(path) as f:
        manifest = json.load(f)
    with open(os.path.join(step_dir, name), "rb") as f:
        data = f.read()
    for entry in manifest["files"]:
        if entry["name"] == name:
            chunk = entry["chunk_bytes"]
            entry["size_bytes"] = len(data)
            entry["crc32c"] = ["%08x" % crc32c(data[i:i + chunk]) for i in range(0, max(len(data), 1), chunk)]
    with open(path, "w") as f:
        f.write(json.dumps(manifest, indent=1, sort_keys=True) + "\n")


def report_and_exit():
    for f in failures:
        print("FAIL:", f)
    print("%d checks, %d failures" % (_checks, len(failures)))
    sys.exit(1 if failures else 0)

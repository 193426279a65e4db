#!/usr/bin/env python3
"""DeepSpeed's aio_handle as a same-run baseline for tools/fio_compare.sh.

Writes then reads FILE (which must exist and hold at least --size bytes) with DeepSpeed's async I/O
op at the given block size, queue depth and intra-op threads, O_DIRECT, between DeepSpeed's own
locked buffer and the file, the way ZeRO-Infinity's swappers use it. Prints one JSON object:
{"deepspeed": version, "write_gbps": …, "read_gbps": …} (GB/s = 1e9 bytes/s).
Exit 3 when DeepSpeed or its aio op is unavailable (the caller reports the baseline as skipped).
The op is built on first use (a few minutes; cached under ~/.cache/torch_extensions).
"""
import argparse
import contextlib
import json
import os
import sys
import time


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--file", required=True)
    ap.add_argument("--size", type=int, required=True, help="bytes, a multiple of 4096")
    ap.add_argument("--block-size", type=int, required=True)
    ap.add_argument("--queue-depth", type=int, required=True)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--mode", choices=["write", "read", "both"], default="both")
    a = ap.parse_args()
    try:
        # DeepSpeed logs to stdout; stdout carries only the result.
        with contextlib.redirect_stdout(sys.stderr):
            import torch
            import deepspeed
            from deepspeed.ops.op_builder import AsyncIOBuilder
            if not AsyncIOBuilder().is_compatible(verbose=False):
                raise RuntimeError("DeepSpeed's async_io op is not compatible here (libaio-dev missing?)")
            aio = AsyncIOBuilder().load(verbose=False)
    except Exception as e:  # ImportError, or the op failed to build
        print(f"deepspeed_aio.py: DeepSpeed aio unavailable: {e}", file=sys.stderr)
        return 3
    if os.path.getsize(a.file) < a.size:
        print(f"deepspeed_aio.py: {a.file} holds fewer than {a.size} bytes", file=sys.stderr)
        return 2
    # single_submit false and overlap_events true: DeepSpeed's recommended settings, the same
    # ones zoffload-bench io's --emit-config writes.
    h = aio.aio_handle(a.block_size, a.queue_depth, False, True, a.threads)
    buf = h.new_cpu_locked_tensor(a.size, torch.empty(0, dtype=torch.uint8))
    out = {"deepspeed": deepspeed.__version__}
    try:
        if a.mode in ("write", "both"):
            buf.random_(0, 256)
            t0 = time.perf_counter()
            if h.sync_pwrite(buf, a.file) < 0:
                raise RuntimeError("sync_pwrite failed")
            out["write_gbps"] = a.size / (time.perf_counter() - t0) / 1e9
        if a.mode in ("read", "both"):
            t0 = time.perf_counter()
            if h.sync_pread(buf, a.file) < 0:
                raise RuntimeError("sync_pread failed")
            out["read_gbps"] = a.size / (time.perf_counter() - t0) / 1e9
    finally:
        h.free_cpu_locked_tensor(buf)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

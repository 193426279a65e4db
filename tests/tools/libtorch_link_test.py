#!/usr/bin/env python3
"""The binaries run on the LibTorch meson found, with its CUDA backend linked when it has one.

Usage: libtorch_link_test.py ZOFFLOAD ZOFFLOAD_BENCH TORCH_VERSION TORCH_CUDA TORCH_LIB_DIR
(TORCH_* as tools/torch_probe.py reported them; TORCH_CUDA is "none" for a CPU-only PyTorch).
Reads each binary's dynamic section with readelf, as the dynamic loader will, and asks
`zoffload info --json` what the loaded LibTorch says of itself.
"""
import json
import os
import re
import subprocess
import sys

from cli_checks import expect, report_and_exit

zoffload, bench, torch_version, torch_cuda, torch_lib = sys.argv[1:6]
has_cuda = torch_cuda != "none"


def dynamic_section(binary):
    out = subprocess.run(["readelf", "-d", binary], capture_output=True, text=True, check=True).stdout
    needed = re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out)
    runpath = re.findall(r"\((?:RUNPATH|RPATH)\)\s+Library r\w*path: \[([^\]]+)\]", out)
    return needed, ":".join(runpath).split(":")


for binary in (zoffload, bench):
    name = os.path.basename(binary)
    needed, runpath = dynamic_section(binary)
    for lib in ["libtorch_cpu.so", "libc10.so"] + (["libtorch_cuda.so", "libc10_cuda.so"] if has_cuda else []):
        expect(lib in needed, "%s: NEEDED has %s (has %s)" % (name, lib, needed))
    if not has_cuda:
        expect("libtorch_cuda.so" not in needed, "%s: a CPU-only LibTorch has no libtorch_cuda" % name)
    # Note [libstdc++ before LibTorch] in meson.build: the loader searches NEEDED in order.
    torch_at = [i for i, lib in enumerate(needed) if lib.startswith(("libtorch", "libc10"))]
    expect("libstdc++.so.6" in needed and torch_at and needed.index("libstdc++.so.6") < min(torch_at),
           "%s: libstdc++.so.6 comes before every LibTorch library in NEEDED: %s" % (name, needed))
    expect(os.path.realpath(torch_lib) in [os.path.realpath(p) for p in runpath if p],
           "%s: its run path holds %s (has %s)" % (name, torch_lib, runpath))

# What the loaded LibTorch says, started without LD_LIBRARY_PATH (the run path must be enough).
env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
p = subprocess.run([zoffload, "info", "--json"], capture_output=True, text=True, env=env)
expect(p.returncode == 0, "info --json runs without LD_LIBRARY_PATH: " + p.stderr)
info = json.loads(p.stdout) if p.returncode == 0 else {}
t = info.get("libtorch") or {}
expect(t.get("version") == torch_version.split("+")[0],
       "info reports LibTorch %s (got %s)" % (torch_version.split("+")[0], t.get("version")))
expect(t.get("cuda") == (torch_cuda if has_cuda else None),
       "info reports LibTorch's CUDA %s (got %s): libtorch_cuda registered its backend" % (torch_cuda, t.get("cuda")))
p = subprocess.run([zoffload, "info"], capture_output=True, text=True, env=env)
expect(p.returncode == 0 and ("libtorch: " + torch_version.split("+")[0]) in p.stdout,
       "the text output names the LibTorch version: " + p.stdout)

report_and_exit()

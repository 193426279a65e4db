#!/usr/bin/env python3
"""`zoffload info` and `zoffload --help` as a user runs them."""
import json
import subprocess
import sys

from cli_checks import expect, report_and_exit

zoffload = sys.argv[1]


p = subprocess.run([zoffload, "info", "--json"], capture_output=True, text=True)
expect(p.returncode == 0, "info --json exits 0: " + p.stderr)
info = json.loads(p.stdout) if p.returncode == 0 else {}
expect(set(info.get("build", {})) == {"io_uring", "libaio", "libtorch", "cuda", "nccl", "protobuf"}, "build features listed")
expect(info.get("cpu", {}).get("logical_cpus", 0) >= 1, "at least one CPU")
expect(info.get("memory", {}).get("total_bytes", 0) > 0, "memory read from /proc/meminfo")
expect("libtorch" in info and (info["libtorch"] is None) == (not info["build"]["libtorch"]),
       "libtorch: its version when built with LibTorch, else null")
expect(len(info.get("gpus", [])) > 0 or info.get("gpu_note", "") != "", "no GPU comes with a reason")
families = [f.get("model_type") for f in info.get("model_families", [])]
expect("llama" in families and all(f.get("architecture", "").endswith("ForCausalLM")
                                   for f in info.get("model_families", [])),
       "the model families, each with its *ForCausalLM class: %s" % info.get("model_families"))

p = subprocess.run([zoffload, "info"], capture_output=True, text=True)
expect(p.returncode == 0 and p.stdout.startswith("zoffload ") and "memory:" in p.stdout, "text output")
expect(p.returncode == 0 and all(f in p.stdout.split("models:")[-1].splitlines()[0] for f in families),
       "the text output's models line lists every family")
p = subprocess.run([zoffload, "train", "--help"], capture_output=True, text=True)
expect(p.returncode == 0 and all(f in p.stdout for f in families), "train --help names every family")

p = subprocess.run([zoffload, "--help"], capture_output=True, text=True)
expect(p.returncode == 0 and "config" in p.stdout and "info" in p.stdout, "--help lists the commands")
p = subprocess.run([zoffload, "no-such-command"], capture_output=True, text=True)
expect(p.returncode == 2, "unknown command exits 2 (got %d)" % p.returncode)
p = subprocess.run([zoffload], capture_output=True, text=True)
expect(p.returncode == 2, "no command exits 2 (got %d)" % p.returncode)

report_and_exit()

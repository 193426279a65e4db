"""What the peer-baseline scripts of `zoffload-bench adam` share (bench_adam_deepspeed.py,
bench_adam_bnb.py): failing with their exit codes, --params counts, and running zoffload-bench adam
with --json."""
import json
import subprocess
import sys


def fail(prog, msg, code=1):
    print(f"{prog}: {msg}", file=sys.stderr)
    sys.exit(code)


def parse_count(prog, text, example):
    try:
        value = float(text)
    except ValueError:
        value = -1
    if value < 1 or value != int(value):
        fail(prog, f"--params: expected a positive count like {example}, got '{text}'", 2)
    return int(value)


def run_bench_json(prog, cmd):
    """`cmd` (a zoffload-bench adam ... --json command line) run to completion; its JSON."""
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        last = r.stderr.strip().splitlines()[-1] if r.stderr.strip() else ""
        fail(prog, f"{' '.join(cmd)} exited {r.returncode}: {last}")
    try:
        return json.loads(r.stdout)
    except json.JSONDecodeError as e:
        fail(prog, f"{' '.join(cmd)}: output is not JSON ({e})")

"""What the peer-baseline scripts of `zoffload-bench adam` share (bench_adam_deepspeed.py,
bench_adam_bnb.py): failing with their exit codes, their common flags, and running zoffload-bench
adam with --json."""
import json
import os
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


def add_run_args(ap, default_params):
    """The flags both scripts take besides their own: sizes, threads, rounds, the bench and --json.
    --optimizer, and the dtype flags where there are any, are each script's."""
    ap.add_argument("--params", default=default_params,
                    help=f"number of parameters, e.g. {default_params} (default {default_params})")
    ap.add_argument("--threads", type=int, default=0, help="threads for both (0 = all the process may use)")
    ap.add_argument("--repeats", type=int, default=5, help="timed steps per round for each (default 5)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds (default 3)")
    ap.add_argument("--isa", default="auto", help="passed to zoffload-bench adam --isa (default auto)")
    ap.add_argument("--bench", default="build/tools/zoffload-bench",
                    help="path of zoffload-bench (default build/tools/zoffload-bench)")
    ap.add_argument("--json", action="store_true", help="print machine-readable results on stdout")


def check_run_args(prog, a, example):
    """Checks the flags of add_run_args (exit 2 naming the flag) and sets a.n from --params."""
    a.n = parse_count(prog, a.params, example)
    if a.threads < 0:
        fail(prog, "--threads must be >= 0", 2)
    if a.repeats < 1 or a.rounds < 1:
        fail(prog, "--repeats and --rounds must be >= 1", 2)
    if not (os.path.isfile(a.bench) and os.access(a.bench, os.X_OK)):
        fail(prog, f"--bench: {a.bench} is not an executable file (build with ninja -C build, or pass --bench PATH)",
             2)

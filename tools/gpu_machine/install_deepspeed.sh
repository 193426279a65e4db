#!/usr/bin/env bash
# tools/gpu_machine/install_deepspeed.sh: installs the DeepSpeed that tools/gpu_machine/fetch_deepspeed.sh
# fetched, with no index, into a prefix of its own, checks that the machine's Python has everything
# else it needs, and builds the op ZeRO-3 with CPU offload steps with (cpu_adam), timed
# (docs/gpu.md, "DeepSpeed on the GPU machine").
# Runs THERE, from the repository root, with .carry carried (gpu_checks.sh's `deepspeed` part runs
# it first):
#   tools/gpu_machine/install_deepspeed.sh
# Then `. $ZO_DS_PREFIX/env.sh` puts the prefix on PYTHONPATH and points TORCH_EXTENSIONS_DIR at the
# built op. Prints the version of each requirement found on the machine, and one line naming what is
# missing or too old when something is; ends with the seconds of each stage.
# Exit status: 0 installed and built; 1 otherwise.
#
# Environment: ZO_DS_CARRY (default .carry/deepspeed), ZO_DS_PREFIX (emptied first; default
# /tmp/zo-deepspeed), PYTHON (default python3, the interpreter with torch that will run DeepSpeed).
set -uo pipefail

usage() {
  sed -n '2,/^[^#]/{/^#/p}' "$0" | sed 's/^# \{0,1\}//'
  exit "$1"
}
case "${1:-}" in
  -h|--help) usage 0 ;;
  "") ;;
  *) echo "install_deepspeed.sh: takes no arguments (see --help)" >&2; exit 2 ;;
esac

die() {
  echo "install_deepspeed: $*" >&2
  exit 1
}

carry=${ZO_DS_CARRY:-.carry/deepspeed}
prefix=${ZO_DS_PREFIX:-/tmp/zo-deepspeed}
python=${PYTHON:-python3}
case "$prefix" in
  "" | / | /usr | /usr/* | "$PWD" | "$PWD"/*) die "ZO_DS_PREFIX=$prefix: not a folder to empty (use one of its own, e.g. /tmp/zo-deepspeed)" ;;
esac
[ -f "$carry/packages.txt" ] || die "no $carry/packages.txt: run tools/gpu_machine/fetch_deepspeed.sh here and carry .carry"
files=()
while read -r f; do
  [ -f "$carry/$f" ] || die "$carry/packages.txt lists $f, which is not there: run fetch_deepspeed.sh again"
  files+=("$carry/$f")
done <"$carry/packages.txt"
"$python" -c 'import torch' 2>/dev/null || die "$python cannot import torch (set PYTHON)"

t0=$(date +%s.%N)
stage_start=$t0
times=()
stage_done() {
  local now
  now=$(date +%s.%N)
  times+=("$(awk -v n="$1" -v a="$stage_start" -v b="$now" 'BEGIN {printf "%-16s %6.1f s", n, b - a}')")
  stage_start=$now
}

rm -rf "$prefix"
mkdir -p "$prefix/site" "$prefix/torch_extensions"
# --no-deps: the requirements are checked below against what the machine has, since pip's --target
# ignores installed packages and would ask the (absent) index for torch. --no-build-isolation: the
# sdist's setup.py imports the machine's torch. DS_BUILD_OPS stays unset: no op is compiled here.
echo "== installing ${#files[@]} packages into $prefix/site"
"$python" -m pip install --disable-pip-version-check --no-input -q --no-index --no-deps --no-build-isolation \
  --no-cache-dir --target "$prefix/site" "${files[@]}" || die "pip install failed (above)"
stage_done install

# Each requirement of each carried package, markers evaluated for this Python, must be met by the
# prefix or the machine's own packages.
echo "== requirements"
"$python" - "$prefix/site" "${files[@]}" <<'PY' || die "requirements not met (above): carry them (fetch_deepspeed.sh's wheels)"
import importlib.metadata as md, re, sys
try:
    from packaging.requirements import Requirement
except ImportError:
    from pip._vendor.packaging.requirements import Requirement
site = sys.argv[1]
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
carried = {norm(d.metadata["Name"]): d for d in md.distributions(path=[site])}
machine = {}
for d in md.distributions(path=[p for p in sys.path if p != site]):
    machine.setdefault(norm(d.metadata["Name"]), d)
bad = []
for name, dist in sorted(carried.items()):
    for line in dist.requires or []:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        found = carried.get(norm(req.name)) or machine.get(norm(req.name))
        where = "carried" if norm(req.name) in carried else "machine"
        if found is None:
            bad.append("%s needs %s: not installed" % (name, line))
        elif req.specifier and not req.specifier.contains(found.version, prereleases=True):
            bad.append("%s needs %s: the %s has %s" % (name, line, where, found.version))
        else:
            print("  %-20s %-28s %s %s" % (name, line, where, found.version))
if bad:
    print("install_deepspeed: " + "; ".join(bad))
    sys.exit(1)
PY
stage_done check

cat >"$prefix/env.sh" <<EOF
export PYTHONPATH=$prefix/site\${PYTHONPATH:+:\$PYTHONPATH}
export TORCH_EXTENSIONS_DIR=$prefix/torch_extensions
EOF
# shellcheck source=/dev/null
. "$prefix/env.sh"
echo "== import"
"$python" -c 'import deepspeed, torch
from deepspeed.accelerator import get_accelerator
print("  deepspeed", deepspeed.__version__, "with torch", torch.__version__, "on the", get_accelerator().device_name(), "accelerator")' ||
  die "import deepspeed failed (above)"
stage_done import

# cpu_adam: DeepSpeedCPUAdam, the optimizer of offload_optimizer.device cpu. JIT-built with the
# machine's g++ and ninja into TORCH_EXTENSIONS_DIR, where the runs find it.
echo "== building cpu_adam"
"$python" -c 'from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()' ||
  die "building DeepSpeed's cpu_adam failed (above)"
stage_done "build cpu_adam"

echo "== install_deepspeed: $(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN {printf "%.1f", b - a}') s; . $prefix/env.sh to use it"
printf '  %s\n' "${times[@]}"

#!/usr/bin/env bash
# tools/gpu_machine/fetch_deepspeed.sh: downloads DeepSpeed and the Python packages it needs that the
# lent GPU machine lacks, for tools/gpu_machine/install_deepspeed.sh to install there with no index
# (docs/gpu.md, "DeepSpeed on the GPU machine").
# Runs HERE (PyPI reachable), from anywhere in the repository:
#   tools/gpu_machine/fetch_deepspeed.sh
# Puts DeepSpeed's source distribution, the wheels for the machine's Python (cp312, manylinux x86-64)
# and their list (packages.txt) in .carry/deepspeed/, which git ignores: name .carry in the device
# tool's carry. Files already there are kept, others removed. Every requirement of a carried package
# must be carried or named in the on_machine list below, so a new requirement stops the script
# instead of failing there. Prints the size and fails when .carry reaches 64 MiB, the tool's limit
# for everything that travels.
#
# Environment: ZO_DS_DEST (default .carry/deepspeed), ZO_DS_PYTHON_VERSION (the Python the wheels are
# for, default 3.12, the GPU machine's; tests set the local one), PYTHON (default python3; needs pip).
set -euo pipefail

usage() {
  sed -n '2,/^[^#]/{/^#/p}' "$0" | sed 's/^# \{0,1\}//'
  exit "$1"
}
case "${1:-}" in
  -h|--help) usage 0 ;;
  "") ;;
  *) echo "fetch_deepspeed.sh: takes no arguments (see --help)" >&2; exit 2 ;;
esac

die() {
  echo "fetch_deepspeed: $*" >&2
  exit 1
}

root=$(cd "$(dirname "$0")/../.." && pwd)
dest=${ZO_DS_DEST:-$root/.carry/deepspeed}
pyver=${ZO_DS_PYTHON_VERSION:-3.12}
python=${PYTHON:-python3}
limit_bytes=$((64 * 1024 * 1024))

# DeepSpeed as a source distribution (PyPI has no wheel): install_deepspeed.sh installs it there with
# DS_BUILD_OPS unset, so no op is compiled at install and the ops it uses are built there, timed.
sdists=(deepspeed==0.19.8)
# What DeepSpeed needs that the machine lacks (pydantic and its own needs, hjson). typing-extensions
# is there, but pydantic 2.14 needs 4.16 or newer, which that image may not have.
wheels=(hjson==3.1.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
        typing-extensions==4.16.0)
# Requirements the GPU machine's image satisfies (docs/gpu.md; install_deepspeed.sh checks each
# version there before anything runs). The check below fails on a requirement in neither list.
on_machine=(torch numpy packaging psutil py-cpuinfo tqdm einops msgpack ninja nvidia-ml-py)

"$python" -m pip --version >/dev/null 2>&1 || die "$python has no pip (set PYTHON)"
mkdir -p "$dest"
pip_download=("$python" -m pip download --disable-pip-version-check --no-input -q --no-deps -d "$dest")
"${pip_download[@]}" --no-binary=:all: "${sdists[@]}" || die "pip could not download ${sdists[*]}"
"${pip_download[@]}" --only-binary=:all: --python-version "$pyver" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  "${wheels[@]}" || die "pip could not download wheels for Python $pyver: ${wheels[*]}"

# The files of exactly these versions; anything else in $dest (an older version) goes.
"$python" - "$dest" "${sdists[@]}" "${wheels[@]}" -- "${on_machine[@]}" <<'PY'
import email.parser, os, re, sys, tarfile, zipfile
try:
    from packaging.requirements import Requirement
except ImportError:
    from pip._vendor.packaging.requirements import Requirement

dest = sys.argv[1]
split = sys.argv.index("--")
wanted = [a.split("==") for a in sys.argv[2:split]]
on_machine = set(sys.argv[split + 1:])
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()

files, metadata = {}, {}
for name in os.listdir(dest):
    path = os.path.join(dest, name)
    if name == "packages.txt":
        continue
    if name.endswith(".whl"):
        dist, version = name.split("-")[:2]
        with zipfile.ZipFile(path) as z:
            meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
            text = z.read(meta).decode()
    elif name.endswith(".tar.gz"):
        dist, version = name[:-len(".tar.gz")].rsplit("-", 1)
        with tarfile.open(path) as t:
            text = t.extractfile("%s-%s/PKG-INFO" % (dist, version)).read().decode()
    else:
        continue
    if [norm(dist), version] not in [[norm(n), v] for n, v in wanted]:
        os.remove(path)
        print("fetch_deepspeed: removed %s (not a version this script carries)" % name)
        continue
    files[norm(dist)] = name
    metadata[norm(dist)] = email.parser.Parser().parsestr(text)

missing = [n for n, _ in wanted if norm(n) not in files]
if missing:
    sys.exit("fetch_deepspeed: pip left no file for " + ", ".join(missing))

# The GPU machine's Python: markers are evaluated for it, extras are not installed.
environment = {"python_version": os.environ.get("ZO_DS_PYTHON_VERSION", "3.12"), "sys_platform": "linux",
               "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
               "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}
environment["python_full_version"] = environment["python_version"] + ".0"
unaccounted = []
for dist, meta in sorted(metadata.items()):
    for line in meta.get_all("Requires-Dist") or []:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate(environment):
            continue
        name = norm(req.name)
        if name not in files and name not in {norm(n) for n in on_machine}:
            unaccounted.append("%s (needed by %s)" % (line, dist))
if unaccounted:
    sys.exit("fetch_deepspeed: requirements neither carried nor on the machine: " + "; ".join(unaccounted) +
             "\n  add each to the script's wheels (carried) or on_machine list")
with open(os.path.join(dest, "packages.txt"), "w") as f:
    for dist in sorted(files):
        f.write(files[dist] + "\n")
PY

bytes=$(find "$dest" -type f -printf '%s\n' | awk '{s += $1} END {print s + 0}')
carry_bytes=$(find "$root/.carry" -type f -printf '%s\n' 2>/dev/null | awk '{s += $1} END {print s + 0}')
echo "fetch_deepspeed: $(wc -l <"$dest/packages.txt") packages in $dest, $bytes bytes" \
  "($(awk -v b="$bytes" 'BEGIN {printf "%.2f", b / 1048576}') MiB); .carry holds" \
  "$(awk -v b="$carry_bytes" 'BEGIN {printf "%.2f", b / 1048576}') MiB"
sed 's/^/  /' "$dest/packages.txt"
if [ "$carry_bytes" -ge "$limit_bytes" ]; then
  die ".carry is $carry_bytes bytes, at or over the device tool's 64 MiB for everything that travels"
fi

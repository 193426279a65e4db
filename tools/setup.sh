#!/usr/bin/env bash
# zoffload's two-command entry point (see README.md, "Quick start"):
#   tools/setup.sh demo   install missing Debian packages, configure, build, run the demo
#   tools/setup.sh test   the same set-up, then the whole test suite (meson test)
# LibTorch comes from PyTorch: the python3 on PATH when it imports a PyTorch zoffload can build
# against (tools/torch_probe.py says which), otherwise .venv/ at the repository root with the
# versions pinned in tools/requirements.txt (downloaded once; about 5 GB installed).
# Both are idempotent: packages already present are not reinstalled, .venv/ is not re-downloaded
# while tools/requirements.txt is unchanged, an existing build directory is reused and only what
# changed is rebuilt.
#
# Environment: BUILD_DIR (default: build), MESON_ARGS (extra `meson setup` arguments for a new
# build directory, e.g. "-Db_sanitize=address,undefined"), ZO_TEST_ARGS (extra `meson test` args),
# ZO_PYTHON (use this interpreter's PyTorch; it must pass tools/torch_probe.py).
set -euo pipefail

usage() {
  sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'
  exit "$1"
}
[ $# -ge 1 ] || usage 2
mode=$1
shift
case "$mode" in demo|test) ;; -h|--help) usage 0 ;; *) echo "tools/setup.sh: unknown command '$mode' (use demo or test)" >&2; exit 2 ;; esac

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
build=${BUILD_DIR:-build}

# ---- 1. Debian packages (only the missing ones) ---------------------------------------------------
packages=(
  meson ninja-build pkg-config g++ python3 python3-venv
  liburing-dev libaio-dev libhwloc-dev libtbb-dev
  libgtest-dev libgmock-dev nlohmann-json3-dev libcli11-dev libprotobuf-dev protobuf-compiler
  fio
  fortunes
)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "zoffload setup: installing ${missing[*]}"
  sudo=""
  if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null || { echo "zoffload setup: need root or sudo to install: ${missing[*]}" >&2; exit 1; }
    sudo="sudo"
  fi
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -qq
  $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# ---- 2. PyTorch (LibTorch and the test oracles) ---------------------------------------------------
# Note [One LibTorch]: zoffload builds against the user's PyTorch 2.x, so CI, a laptop and the GPU
# machine run the same LibTorch. A .venv/ made here is used from then on; python3 is used only
# while there is none.
venv="$root/.venv"
requirements="$root/tools/requirements.txt"
stamp="$venv/.zoffload-requirements"
# python3's answer, asked once (its report on success, its one-line reason on failure).
probe_ok=false
if [ -z "${ZO_PYTHON:-}" ] && [ ! -d "$venv" ] && probe=$(python3 tools/torch_probe.py 2>&1); then probe_ok=true; fi
if [ -n "${ZO_PYTHON:-}" ]; then
  "$ZO_PYTHON" tools/torch_probe.py >/dev/null || exit 1
  python=$("$ZO_PYTHON" -c 'import sys; print(sys.executable)')
elif $probe_ok; then
  python=$(python3 -c 'import sys; print(sys.executable)')
  echo "zoffload setup: using $python's PyTorch ($(sed -n 's/^version=//p' <<<"$probe"))"
  "$python" -c 'import transformers, safetensors, numpy' 2>/dev/null ||
    echo "zoffload setup: note: $python lacks transformers, safetensors or numpy, the test oracles tools/requirements.txt pins"
else
  if [ ! -d "$venv" ]; then
    why=$(tail -n 1 <<<"$probe")
    echo "zoffload setup: ${why#torch_probe: }; creating $venv with tools/requirements.txt"
    python3 -m venv "$venv"
  fi
  if ! cmp -s "$requirements" "$stamp"; then
    echo "zoffload setup: installing tools/requirements.txt into $venv (PyTorch with CUDA: a few GB, once)"
    "$venv/bin/python3" -m pip install --disable-pip-version-check --no-input -q -r "$requirements"
    cp "$requirements" "$stamp"
  fi
  python="$venv/bin/python3"
  "$python" tools/torch_probe.py >/dev/null || exit 1
fi

# ---- 3. configure (once, or again when the PyTorch changes) and build (incrementally) --------------
configured_python() {
  meson introspect "$build" --buildoptions 2>/dev/null |
    "$python" -c 'import json, sys; print(next((o["value"] for o in json.load(sys.stdin) if o["name"] == "python"), ""))' 2>/dev/null || true
}
if [ ! -f "$build/build.ninja" ]; then
  # shellcheck disable=SC2086
  meson setup "$build" -Dpython="$python" ${MESON_ARGS:-}
elif [ "$(configured_python)" != "$python" ]; then
  echo "zoffload setup: reconfiguring $build for $python"
  meson setup --reconfigure "$build" -Dpython="$python"
fi
ninja -C "$build"

# ---- 4. run ----------------------------------------------------------------------------------------
if [ "$mode" = test ]; then
  # Make UndefinedBehaviorSanitizer findings fail the test (with a sanitizer build); no effect otherwise.
  export UBSAN_OPTIONS=${UBSAN_OPTIONS:-halt_on_error=1:print_stacktrace=1}
  rc=0
  # shellcheck disable=SC2086
  meson test -C "$build" --print-errorlogs ${ZO_TEST_ARGS:-} "$@" || rc=$?
  # One closing line that any CI can read: meson's test programs by result.
  python3 - "$build/meson-logs/testlog.json" <<'PY' || true
import json, sys
counts = {"OK": 0, "FAIL": 0, "SKIP": 0}
for line in open(sys.argv[1]):
    r = json.loads(line).get("result", "")
    key = "OK" if r in ("OK", "EXPECTEDFAIL") else "SKIP" if r == "SKIP" else "FAIL"
    counts[key] += 1
print("tests: %d passed, %d failed, %d skipped" % (counts["OK"], counts["FAIL"], counts["SKIP"]))
PY
  exit $rc
fi

# The demo: fine-tune the tiny model on the bundled corpus with the demo config (bf16, parameters in
# pinned CPU memory, optimizer states on NVMe under the run directory), as README.md describes.
run_dir="$build/demo-run"
config=configs/tiny_demo_nvme.json
# Without a GPU LibTorch computes on the CPU, and it multiplies bf16 at speed only with AVX512-BF16 or
# AMX: elsewhere the demo's bf16 step took 13 s against 1.0 s in fp32 (2-core AMD EPYC, AVX2), 80
# steps 17 minutes. There the demo runs the same config with bf16 off, and says so.
if [ ! -e /proc/driver/nvidia/gpus ] && ! grep -qwE 'avx512_bf16|amx_bf16' /proc/cpuinfo; then
  config="$build/tiny_demo_nvme_fp32.json"
  "$python" - configs/tiny_demo_nvme.json "$config" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))
c["bf16"] = {"enabled": False}
with open(sys.argv[2], "w") as f:
    json.dump(c, f, indent=2)
PY
  echo
  echo "zoffload setup: no GPU, and this CPU has no native bf16 (avx512_bf16, amx_bf16): LibTorch's bf16 matmuls"
  echo "  would make each step about 13 times slower here, so the demo computes in fp32 ($config is"
  echo "  configs/tiny_demo_nvme.json with bf16 off); everything else is the same. The bf16 run, by hand:"
  echo "  $build/tools/zoffload train --config configs/tiny_demo_nvme.json --model tiny --data configs/data/demo_corpus.txt --out $run_dir"
fi
echo
echo "== zoffload train --config $config --model tiny --data configs/data/demo_corpus.txt --out $run_dir"
"$build/tools/zoffload" train --config "$config" --model tiny \
  --data configs/data/demo_corpus.txt --out "$run_dir"

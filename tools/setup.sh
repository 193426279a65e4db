#!/usr/bin/env bash
# zoffload's two-command entry point (see README.md, "Quick start"):
#   tools/setup.sh demo   install missing Debian packages, configure, build, run the demo
#   tools/setup.sh test   the same set-up, then the whole test suite (meson test)
# Both are idempotent: packages already present are not reinstalled, an existing build directory is
# reused and only what changed is rebuilt.
#
# Environment: BUILD_DIR (default: build), MESON_ARGS (extra `meson setup` arguments for a new
# build directory, e.g. "-Db_sanitize=address,undefined"), ZO_TEST_ARGS (extra `meson test` args).
set -euo pipefail

usage() {
  sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
}
[ $# -ge 1 ] || usage
mode=$1
shift
case "$mode" in demo|test) ;; -h|--help) usage ;; *) echo "tools/setup.sh: unknown command '$mode' (use demo or test)" >&2; exit 2 ;; esac

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
build=${BUILD_DIR:-build}

# ---- 1. Debian packages (only the missing ones) ---------------------------------------------------
packages=(
  meson ninja-build pkg-config g++ python3
  liburing-dev libaio-dev libhwloc-dev libtbb-dev libtorch-dev
  libgtest-dev libgmock-dev nlohmann-json3-dev libcli11-dev
  fio
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

# ---- 2. configure (once) and build (incrementally) ------------------------------------------------
if [ ! -f "$build/build.ninja" ]; then
  # shellcheck disable=SC2086
  meson setup "$build" ${MESON_ARGS:-}
fi
ninja -C "$build"

# ---- 3. run ----------------------------------------------------------------------------------------
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
echo
echo "== zoffload train --config configs/tiny_demo_nvme.json --model tiny --data configs/data/demo_corpus.txt --out $run_dir"
"$build/tools/zoffload" train --config configs/tiny_demo_nvme.json --model tiny \
  --data configs/data/demo_corpus.txt --out "$run_dir"

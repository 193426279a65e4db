#!/usr/bin/env bash
# tools/gpu_machine/build_there.sh: builds zoffload on the lent GPU machine and runs its GPU tests
# (docs/gpu.md, "Building and testing on the GPU machine").
# Runs THERE (no network, no Debian -dev packages; python3 with PyTorch, nvcc, meson, ninja, g++),
# from the repository root, with .carry/ carried after tools/gpu_machine/fetch_debs.sh ran here:
#   tools/gpu_machine/build_there.sh [MESON_TEST_ARGS...]
# Unpacks .carry/debs/ into a prefix outside the tree, configures build-gpu/ against python3's
# PyTorch with CUDA, LibTorch, io_uring and libaio required, builds with every core, shows the GPU,
# PyTorch and `zoffload info`, runs `meson test --suite gpu`, then `meson test MESON_TEST_ARGS` when
# given (`--suite unit`, test names), and ends with a table of the time of each part.
# Exit status: 0 when every part passed, 1 otherwise, 2 on bad usage.
#
# Environment: ZO_PREFIX (where the packages are unpacked, emptied first; default /tmp/zo-prefix),
# ZO_GPU_SM (CUDA architectures; default 90, the H100 and H200), BUILD_DIR (default build-gpu;
# reused and reconfigured when present), ZO_MESON_ARGS (more `meson setup` arguments), ZO_JOBS
# (default: every core), OUT (when set, logs go there; the device tool brings that folder back).
set -euo pipefail

usage() {
  sed -n '2,/^[^#]/{/^#/p}' "$0" | sed 's/^# \{0,1\}//'
  exit "$1"
}
case "${1:-}" in -h|--help) usage 0 ;; esac

die() {
  echo "build_there: $*" >&2
  exit 1
}

root=$(pwd)
if [ ! -f "$root/meson.build" ] || ! grep -q "^project('zoffload'" "$root/meson.build"; then
  echo "build_there: run me from the zoffload repository root (the folder with meson.build)" >&2
  exit 2
fi
debs="$root/.carry/debs"
prefix=${ZO_PREFIX:-/tmp/zo-prefix}
build=${BUILD_DIR:-build-gpu}
gpu_sm=${ZO_GPU_SM:-90}
jobs=${ZO_JOBS:-$(nproc)}
out=${OUT:-}

# ---- timing: each part is begun, then ended; the EXIT trap ends a part cut short as FAILED ------
part_names=()
part_secs=()
part_results=()
current=""
now() { date +%s.%N; }
t_part=0
t_all=$(now)
begin() {
  current=$1
  t_part=$(now)
  echo
  echo "== $current"
}
end() {
  part_names+=("$current")
  part_secs+=("$(awk -v a="$t_part" -v b="$(now)" 'BEGIN {printf "%.1f", b - a}')")
  part_results+=("${1:-ok}")
  current=""
}
print_table() {
  local i
  echo
  echo "== build_there: times on $(nproc) cores ($(uname -n))"
  printf '%-28s %9s  %s\n' part seconds result
  for i in "${!part_names[@]}"; do
    printf '%-28s %9s  %s\n' "${part_names[$i]}" "${part_secs[$i]}" "${part_results[$i]}"
  done
  printf '%-28s %9s\n' total "$(awk -v a="$t_all" -v b="$(now)" 'BEGIN {printf "%.1f", b - a}')"
}
on_exit() {
  local rc=$?
  [ -z "$current" ] || end "FAILED"
  [ ${#part_names[@]} -gt 0 ] || exit "$rc"   # stopped before the first part: its one line said why
  if [ -n "$out" ]; then
    print_table >"$out/times.txt"
    [ ! -f "$build/meson-logs/meson-log.txt" ] || cp "$build/meson-logs/meson-log.txt" "$out/meson-log.txt"
  fi
  print_table
  exit "$rc"
}

# "N passed, N failed, N skipped" from the test log meson just wrote, then the gtest cases that
# skipped inside passing programs (a CUDA case skips where no GPU is usable: on the GPU machine
# the gpu suite should skip none).
test_counts() {
  python3 - "$build/meson-logs/testlog.json" 2>/dev/null <<'PY' | tr -d '\n' || echo -n "no test log"
import json, sys
counts = {"passed": 0, "failed": 0, "skipped": 0}
for line in open(sys.argv[1]):
    r = json.loads(line).get("result", "")
    counts["passed" if r in ("OK", "EXPECTEDFAIL") else "skipped" if r == "SKIP" else "failed"] += 1
print("%(passed)d passed, %(failed)d failed, %(skipped)d skipped" % counts)
PY
  awk '/^\[  SKIPPED \] [0-9]+ tests?, listed below/ {n += $4} END {printf "; gtest cases skipped: %d\n", n}' \
    "$build/meson-logs/testlog.txt" 2>/dev/null || true
}

main() {
  trap on_exit EXIT

  # ---- what this machine must have (one line naming what is missing) ----------------------------
  [ -f "$debs/packages.txt" ] ||
    die "no .carry/debs/packages.txt: run tools/gpu_machine/fetch_debs.sh on the development machine and carry .carry"
  command -v dpkg-deb >/dev/null || die "no dpkg-deb on this machine (needed to unpack .carry/debs)"
  command -v g++ >/dev/null || die "no g++ on this machine (meson builds C++ with it and nvcc needs it as host compiler)"
  command -v gcc >/dev/null || die "no gcc on this machine (nvcc's default host compiler)"
  command -v python3 >/dev/null || die "no python3 on PATH (its PyTorch provides LibTorch)"
  python=$(command -v python3)
  command -v meson >/dev/null || die "no meson on PATH"
  command -v ninja >/dev/null || die "no ninja on PATH"
  if ! command -v nvcc >/dev/null; then
    [ -x /usr/local/cuda/bin/nvcc ] || die "no nvcc on PATH nor in /usr/local/cuda/bin (-Dcuda=enabled needs the CUDA toolkit)"
    echo "build_there: nvcc is not on PATH; using /usr/local/cuda/bin/nvcc"
    PATH="/usr/local/cuda/bin:$PATH"
  fi
  cuda_home=$(cd "$(dirname "$(command -v nvcc)")/.." && pwd)
  cuda_lib=""
  for dir in "$cuda_home/lib64" "$cuda_home/targets/x86_64-linux/lib" "$cuda_home/lib"; do
    if compgen -G "$dir/libcudart.so.*" >/dev/null; then
      cuda_lib=$dir
      break
    fi
  done
  [ -n "$cuda_lib" ] || die "no libcudart.so.* in $cuda_home/{lib64,targets/x86_64-linux/lib,lib} (the CUDA runtime the kernels link)"
  case "$prefix" in
    /?*) ;;
    *) die "ZO_PREFIX must be an absolute path other than / (got '$prefix')" ;;
  esac
  case "$prefix/" in
    "$root"/*) die "ZO_PREFIX ($prefix) is inside the repository; the packages go outside the tree" ;;
  esac
  if [ -e "$prefix" ] && [ ! -f "$prefix/.zoffload-prefix" ] && [ -n "$(ls -A "$prefix" 2>/dev/null)" ]; then
    die "$prefix exists and is not a prefix made by this script; set ZO_PREFIX to a new folder"
  fi
  if [ -n "$out" ]; then
    mkdir -p "$out" || die "cannot create OUT=$out"
  fi

  echo "== machine"
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi -L || echo "nvidia-smi -L failed"
  else
    echo "nvidia-smi: not on this machine (no NVIDIA driver)"
  fi
  torch_line=$("$python" -c 'import sys, torch
cuda = torch.cuda.is_available()
print("python3: %s, torch %s, built with CUDA %s, %s" % (sys.executable, torch.__version__, torch.version.cuda,
      "%d GPU(s) visible" % torch.cuda.device_count() if cuda else "no GPU visible"))' 2>&1) ||
    die "$python cannot import torch ($(tail -n 1 <<<"$torch_line"))"
  echo "$torch_line"
  echo "nvcc: $(command -v nvcc), $(nvcc --version | sed -n 's/^Cuda compilation tools, //p'); CUDA runtime in $cuda_lib"
  echo "g++: $(g++ --version | head -n 1); meson $(meson --version); ninja $(ninja --version); $(nproc) cores"

  # ---- unpack: the .deb files into the prefix, with .pc files pointing there ----------------------
  begin unpack
  rm -rf "$prefix"
  mkdir -p "$prefix"
  touch "$prefix/.zoffload-prefix"
  n=0
  while read -r pkg version _ file; do
    [ -f "$debs/$file" ] || die "missing .carry/debs/$file ($pkg $version, listed in packages.txt): run fetch_debs.sh again and carry .carry"
    dpkg-deb -x "$debs/$file" "$prefix"
    n=$((n + 1))
  done <"$debs/packages.txt"
  lib="$prefix/usr/lib/x86_64-linux-gnu"
  # Note [Prefix .pc files]: the Debian .pc files say /usr; they are rewritten to name the prefix
  # (prefix=, libdir=, includedir= and literal -I/-L). With this pkgconf 1.8, PKG_CONFIG_SYSROOT_DIR
  # gives the same flags, but what a sysroot applies to differs between pkg-config
  # implementations; rewritten files name real paths for any reader.
  for pc in "$lib"/pkgconfig/*.pc "$prefix"/usr/share/pkgconfig/*.pc; do
    sed -i -E "s#(^[A-Za-z_]+=|-I|-L)/usr(/|\$)#\1$prefix/usr\2#g" "$pc"
  done
  if grep -nE '(^[A-Za-z_]+=|-I|-L)/usr' "$lib"/pkgconfig/*.pc "$prefix"/usr/share/pkgconfig/*.pc; then
    die "a .pc file above still names /usr after the rewrite"
  fi
  # Note [System libudev]: libhwloc links libudev.so.1, which every systemd distribution has. The
  # prefix's libraries come first on LD_LIBRARY_PATH, for every program this script starts, so
  # Debian 12's older copy is used only where the machine has none.
  udev=$( { ldconfig -p 2>/dev/null || /sbin/ldconfig -p 2>/dev/null || true; } |
    awk '$1 == "libudev.so.1" && /x86-64/ && !found {print $NF; found = 1}')
  if [ -n "$udev" ] && [ -e "$udev" ]; then
    rm -f "$lib"/libudev.so.1*
    echo "libudev.so.1: the machine's ($udev)"
  else
    echo "libudev.so.1: the machine has none; using Debian 12's from the prefix"
  fi
  export PKG_CONFIG="$prefix/usr/bin/pkgconf"
  export PKG_CONFIG_LIBDIR="$lib/pkgconfig:$prefix/usr/share/pkgconfig"
  unset PKG_CONFIG_PATH PKG_CONFIG_SYSROOT_DIR
  export LIBRARY_PATH="$lib${LIBRARY_PATH:+:$LIBRARY_PATH}"
  # The CUDA runtime the kernels are linked with, whether or not the machine's loader looks there.
  export LD_LIBRARY_PATH="$lib:$cuda_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export CUDA_PATH="$cuda_home" CUDA_HOME="$cuda_home"
  unset CUDA_ROOT
  cat >"$prefix/env.sh" <<EOF
# Source this to run ninja, meson test or the binaries of $root/$build by hand.
export PATH="$PATH"
export PKG_CONFIG="$PKG_CONFIG" PKG_CONFIG_LIBDIR="$PKG_CONFIG_LIBDIR"
export LIBRARY_PATH="$LIBRARY_PATH" LD_LIBRARY_PATH="$LD_LIBRARY_PATH"
export CUDA_PATH="$CUDA_PATH" CUDA_HOME="$CUDA_HOME"
EOF
  "$PKG_CONFIG" --exists gtest gmock tbb hwloc liburing nlohmann_json CLI11 ||
    die "pkgconf in $prefix does not find the unpacked packages' .pc files"
  echo "$n packages in $prefix ($(du -sh "$prefix" | cut -f1)); pkg-config: $PKG_CONFIG $("$PKG_CONFIG" --version)"
  end

  # ---- configure ----------------------------------------------------------------------------------
  begin configure
  # Headers of the prefix as system headers (as /usr/include is here): libaio has no .pc file and
  # hwloc's generated config.h is in the multiarch folder; the -I from the .pc files then yields.
  setup_args=(-Dpython="$python" -Dtorch=enabled -Dcuda=enabled -During=enabled -Daio=enabled
    -Dgpu_sm="$gpu_sm" "-Dcpp_args=['-isystem$prefix/usr/include', '-isystem$prefix/usr/include/x86_64-linux-gnu']")
  # shellcheck disable=SC2206  # ZO_MESON_ARGS is a list of words by design
  setup_args+=(${ZO_MESON_ARGS:-})
  if [ -f "$build/build.ninja" ]; then
    meson setup --reconfigure "$build" "${setup_args[@]}"
  else
    meson setup "$build" "${setup_args[@]}"
  fi
  end

  # ---- build ----------------------------------------------------------------------------------------
  begin "build (-j$jobs)"
  ninja -C "$build" -j"$jobs"
  for exe in "$build/tools/zoffload" "$build/tools/zoffload-bench"; do
    if ldd "$exe" | grep 'not found'; then
      die "$exe: the loader does not find the libraries above"
    fi
  done
  echo "libraries from the prefix and CUDA's runtime, as the loader finds them for $build/tools/zoffload:"
  ldd "$build/tools/zoffload" | grep -E "$prefix|libcudart|libudev|libtorch_cuda" || true
  end

  echo
  echo "== $build/tools/zoffload info"
  "$build/tools/zoffload" info | tee ${out:+"$out/zoffload-info.txt"} || die "$build/tools/zoffload info failed"

  # ---- tests ------------------------------------------------------------------------------------------
  rc=0
  logs="$build/meson-logs"
  begin "test --suite gpu"
  rm -f "$logs/testlog.json" "$logs/testlog.txt"   # a run that writes none must not report the last one's
  if meson test -C "$build" --suite gpu --print-errorlogs; then
    end "ok: $(test_counts)"
  else
    rc=1
    end "FAILED: $(test_counts)"
  fi
  [ -z "$out" ] || [ ! -f "$logs/testlog.txt" ] || cp "$logs/testlog.txt" "$out/testlog-gpu.txt"
  if [ $# -gt 0 ]; then
    begin "test $*"
    rm -f "$logs/testlog.json" "$logs/testlog.txt"
    if meson test -C "$build" --print-errorlogs "$@"; then
      end "ok: $(test_counts)"
    else
      rc=1
      end "FAILED: $(test_counts)"
    fi
    [ -z "$out" ] || [ ! -f "$logs/testlog.txt" ] || cp "$logs/testlog.txt" "$out/testlog-more.txt"
  fi
  return "$rc"
}

if [ -n "$out" ]; then
  mkdir -p "$out"
  main "$@" 2>&1 | tee "$out/build_there.log"
  exit "${PIPESTATUS[0]}"
fi
main "$@"

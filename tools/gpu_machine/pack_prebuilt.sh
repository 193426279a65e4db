#!/usr/bin/env bash
# tools/gpu_machine/pack_prebuilt.sh: packs this machine's CUDA build of zoffload for the lent GPU
# machine, so that a device session spends its few minutes on checks rather than on compiling
# (docs/gpu.md, "Checks on the GPU machine").
# Runs HERE, from anywhere in the repository, after `ninja -C build` in a build configured with
# CUDA against the GPU machine's PyTorch version (2.11.0+cu130, as the development machine's):
#   tools/gpu_machine/pack_prebuilt.sh
# Puts stripped copies of zoffload, zoffload-bench and gpu_test in .carry/prebuilt/bin/; the shared
# libraries they link that the GPU machine lacks (what neither glibc, libstdc++, zlib, PyTorch's
# wheel nor its CUDA runtime provide: liburing, libaio, hwloc, oneTBB, protobuf, libudev) in
# .carry/prebuilt/lib/; and what was packed (commit, uncommitted changes or not, PyTorch and CUDA)
# in .carry/prebuilt/manifest.txt. Git ignores .carry. Prints the size and fails at 64 MiB, the
# device tool's limit for everything that travels. Then, through the device tool:
#   run(command: "tools/gpu_machine/gpu_checks.sh", carry: [".carry"], timeout_s: 600)
#
# Environment: BUILD_DIR (default build).
set -euo pipefail

usage() {
  sed -n '2,/^[^#]/{/^#/p}' "$0" | sed 's/^# \{0,1\}//'
  exit "$1"
}
case "${1:-}" in
  -h|--help) usage 0 ;;
  "") ;;
  *) echo "pack_prebuilt.sh: takes no arguments (see --help)" >&2; exit 2 ;;
esac

die() {
  echo "pack_prebuilt: $*" >&2
  exit 1
}

root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
build=${BUILD_DIR:-build}
dest="$root/.carry/prebuilt"
limit_bytes=$((64 * 1024 * 1024))
bins=("$build/tools/zoffload" "$build/tools/zoffload-bench" "$build/tests/gpu/gpu_test")

[ -f "$build/build.ninja" ] || die "no $build/build.ninja: configure and build first (README.md, \"Build\")"
for b in "${bins[@]}"; do
  [ -x "$b" ] || die "no $b: run ninja -C $build"
done
if ! ninja -C "$build" -n 2>/dev/null | grep -q "no work to do"; then
  die "$build is not up to date with the sources: run ninja -C $build first"
fi
# ldd's output is read whole first: `ldd | grep -q` under pipefail fails when grep's early exit
# kills ldd with SIGPIPE, which depends on timing.
needed=$(ldd "$build/tools/zoffload")
grep -q 'libtorch_cuda\.so' <<<"$needed" ||
  die "$build/tools/zoffload does not link libtorch_cuda.so: configure $build with a CUDA PyTorch (-Dpython=...) and -Dcuda=enabled"
grep -q 'libcudart\.so' <<<"$needed" ||
  die "$build/tools/zoffload does not link the CUDA runtime: configure $build with -Dcuda=enabled"
python=$(meson introspect --buildoptions "$build" |
  python3 -c 'import json, sys; print(next(o["value"] for o in json.load(sys.stdin) if o["name"] == "python"))')
torch_line=$("$python" -c 'import torch; print(torch.__version__, torch.version.cuda)') ||
  die "$python (the build's -Dpython) cannot import torch"
site=$("$python" -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))')

rm -rf "$dest"
mkdir -p "$dest/bin" "$dest/lib"
for b in "${bins[@]}"; do
  strip -o "$dest/bin/$(basename "$b")" "$b"
done
# The libraries to carry: each resolved path, less the C and C++ runtimes and zlib (every Linux has
# them), PyTorch's wheel (torch/lib and the nvidia-* packages beside it, there at the same version)
# and the CUDA runtime (the GPU machine's copy is the wheel's, which PyTorch loads anyway).
for b in "${bins[@]}"; do
  ldd "$b" | awk '$2 == "=>" && $3 ~ /^\// {print $1, $3}'
done | sort -u | while read -r name path; do
  case "$name" in
    libc.so.* | libm.so.* | libpthread.so.* | libdl.so.* | librt.so.* | libutil.so.* | ld-linux*) continue ;;
    libstdc++.so.* | libgcc_s.so.* | libz.so.* | libcudart.so.*) continue ;;
  esac
  case "$path" in "$site"/*) continue ;; esac
  cp -L "$path" "$dest/lib/$name"
done

{
  echo "commit: $(git rev-parse HEAD)$(git diff --quiet HEAD -- . ':!.carry' 2>/dev/null || echo ' with uncommitted changes')"
  echo "built: $build ($(meson introspect --buildoptions "$build" |
    python3 -c 'import json, sys; o = {x["name"]: x["value"] for x in json.load(sys.stdin)}; print(o["buildtype"])'))"
  echo "torch, CUDA: $torch_line"
  echo "binaries: $(cd "$dest/bin" && ls | tr '\n' ' ')"
  echo "libraries: $(cd "$dest/lib" && ls | tr '\n' ' ')"
} >"$dest/manifest.txt"
cat "$dest/manifest.txt"

size=$(du -sb "$root/.carry" | cut -f1)
tree=$(git ls-files -z | du -cb --files0-from=- 2>/dev/null | tail -n 1 | cut -f1)
total=$((size + tree))
echo "pack_prebuilt: .carry holds $(numfmt --to=iec "$size"); with this checkout's files $(numfmt --to=iec "$total") travel (limit 64 MiB)"
[ "$total" -lt "$limit_bytes" ] || die "over the device tool's 64 MiB: remove what .carry need not carry"

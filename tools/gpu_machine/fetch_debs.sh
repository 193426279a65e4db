#!/usr/bin/env bash
# tools/gpu_machine/fetch_debs.sh: downloads the Debian 12 (amd64) packages that the lent GPU machine
# lacks to build and test zoffload, for tools/gpu_machine/build_there.sh to unpack there
# (docs/gpu.md, "Building and testing on the GPU machine").
# Runs HERE (a Debian 12 machine with the Debian archive reachable), from anywhere in the repository:
#   tools/gpu_machine/fetch_debs.sh
# Puts the .deb files and their list (packages.txt) in .carry/debs/, which git ignores: name .carry
# in the device tool's carry. Files already there are kept, other versions of the same package
# removed. Prints the total size and fails if it reaches 64 MiB, the tool's limit for everything
# that travels. Needs apt-get; root only when apt's package lists must be fetched first.
#
# Environment: ZO_APT_DIR (a folder for apt's lists and cache of its own, filled with `apt-get
# update` when empty; default: none on an amd64 host, which uses the system's lists, else
# /var/tmp/zoffload-apt-amd64).
set -euo pipefail

usage() {
  sed -n '2,/^[^#]/{/^#/p}' "$0" | sed 's/^# \{0,1\}//'
  exit "$1"
}
case "${1:-}" in
  -h|--help) usage 0 ;;
  "") ;;
  *) echo "fetch_debs.sh: takes no arguments (see --help)" >&2; exit 2 ;;
esac

root=$(cd "$(dirname "$0")/../.." && pwd)
dest="$root/.carry/debs"
limit_bytes=$((64 * 1024 * 1024))

# What zoffload needs there and the GPU machine does not have (it has python3 with PyTorch, nvcc,
# meson, ninja and, presumably, g++). Runtime libraries come with their -dev package because the
# tests run there too.
packages=(
  # the -dev packages of tools/setup.sh: headers, .pc files, link-time .so links and static gtest
  liburing-dev libaio-dev libhwloc-dev libtbb-dev libgtest-dev libgmock-dev nlohmann-json3-dev libcli11-dev
  # the shared libraries those link, and what they link in turn
  liburing2 libaio1 libhwloc15 libudev1 libtbb12 libtbbmalloc2 libtbbbind-2-5
  # pkg-config (pkgconf), whether or not the machine has one, so that meson reads the .pc files
  # above the same way there as here
  pkgconf pkgconf-bin libpkgconf3
)
# What the packages above depend on but is not fetched: the machine has it, or zoffload does not
# need it. The dependency check below fails on anything in neither list.
not_fetched=(
  libc6 libgcc-s1 libstdc++6   # the C and C++ runtime of the machine's own (newer) g++
  libc6-dev libc-dev linux-libc-dev   # liburing-dev's: libc and kernel headers come with that g++
  googletest                   # libgtest-dev's: GoogleTest's sources; libgtest-dev holds the built libraries
  libnuma-dev libltdl-dev      # libhwloc-dev's: for hwloc's libnuma and plugin helper headers, which zoffload does not include
)

# amd64 whatever this host is; candidates come from the archive's lists alone, not from what this
# host has installed (Dir::State::status).
apt_opts=(-q -oAPT::Architecture=amd64 -oAPT::Architectures=amd64 -oDir::State::status=/dev/null)
apt_dir=${ZO_APT_DIR:-}
if [ -z "$apt_dir" ] && [ "$(dpkg --print-architecture 2>/dev/null || true)" != amd64 ]; then
  apt_dir=/var/tmp/zoffload-apt-amd64
fi
if [ -n "$apt_dir" ]; then
  # A private amd64 view of the archive: the system's own lists and cache are left alone.
  mkdir -p "$apt_dir/lists/partial" "$apt_dir/cache/archives/partial"
  apt_opts+=("-oDir::State::Lists=$apt_dir/lists" "-oDir::Cache=$apt_dir/cache")
fi
if [ "$(id -u)" -eq 0 ]; then
  # apt drops root to _apt for downloads, and _apt cannot write to a private temporary folder.
  apt_opts+=(-oAPT::Sandbox::User=root)
fi

# candidates[PACKAGE]="VERSION ARCH" for every package apt knows; missing: those it does not.
declare -A candidates=()
missing=()
read_candidates() {
  candidates=()
  missing=()
  local p v a
  while read -r p v a; do
    candidates[$p]="$v $a"
  done < <(apt-cache "${apt_opts[@]}" show --no-all-versions "${packages[@]}" 2>/dev/null |
    awk '/^Package: / {p = $2} /^Version: / {v = $2} /^Architecture: / {a = $2} /^$/ {print p, v, a}' || true)
  for p in "${packages[@]}"; do
    [ -n "${candidates[$p]:-}" ] || missing+=("$p")
  done
}
lists_dir=""
eval "$(apt-config "${apt_opts[@]}" shell lists_dir Dir::State::Lists/d)"
if compgen -G "$lists_dir/*_Packages*" >/dev/null; then
  read_candidates
else
  missing=("${packages[@]}")
fi
if [ ${#missing[@]} -gt 0 ]; then
  echo "fetch_debs: $lists_dir lacks ${missing[*]}; running apt-get update"
  if [ -z "$apt_dir" ] && [ "$(id -u)" -ne 0 ]; then
    echo "fetch_debs: apt-get update needs root (or set ZO_APT_DIR to a folder of your own)" >&2
    exit 1
  fi
  apt-get "${apt_opts[@]}" update
  read_candidates
  if [ ${#missing[@]} -gt 0 ]; then
    echo "fetch_debs: no amd64 candidate for ${missing[*]} (is this a Debian 12 apt configuration?)" >&2
    exit 1
  fi
fi

# Every dependency of a fetched package is fetched or named in not_fetched, so the list cannot
# silently fall behind the archive. An alternative group (a | b) needs one of its members.
declare -A known=()
for p in "${packages[@]}" "${not_fetched[@]}"; do known[$p]=1; done
unaccounted=()
pkg=""
group_ok=0
in_group=0
while read -r kind dep; do
  if [ "$kind" = Package ]; then
    pkg=$dep
    continue
  fi
  dep=${dep%%:*}
  [ -n "${known[$dep]:-}" ] && group_ok=1
  if [ "${kind#|}" != "$kind" ]; then
    in_group=1   # "|Depends:": one of alternatives, the group goes on on the next line
    continue
  fi
  if [ "$group_ok" -eq 0 ]; then
    if [ "$in_group" -eq 1 ]; then dep="$dep (or its alternatives)"; fi
    unaccounted+=("$pkg -> $dep")
  fi
  group_ok=0
  in_group=0
done < <(apt-cache "${apt_opts[@]}" depends "${packages[@]}" |
  sed -n -e 's/^\([^ ].*\)$/Package \1/p' \
    -e 's/^ *\(|\{0,1\}\(Pre\)\{0,1\}Depends:\) *<\{0,1\}\([^ >]*\)>\{0,1\}$/\1 \3/p')
if [ ${#unaccounted[@]} -gt 0 ]; then
  echo "fetch_debs: dependencies neither fetched nor listed in not_fetched (edit $0): ${unaccounted[*]}" >&2
  exit 1
fi

mkdir -p "$dest"
tmp=$(mktemp -d "$dest/.download.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
manifest=()
to_get=()
for p in "${packages[@]}"; do
  read -r version arch <<<"${candidates[$p]}"
  file="${p}_${version//:/%3a}_${arch}.deb"   # apt-get download's name for it
  manifest+=("$p $version $arch $file")
  [ -f "$dest/$file" ] || to_get+=("$p=$version")
done

if [ ${#to_get[@]} -gt 0 ]; then
  echo "fetch_debs: downloading ${#to_get[@]} of ${#packages[@]} packages into $dest"
  (cd "$tmp" && apt-get "${apt_opts[@]}" download "${to_get[@]}")
  mv "$tmp"/*.deb "$dest/"
else
  echo "fetch_debs: all ${#packages[@]} packages already in $dest"
fi

total=0
for line in "${manifest[@]}"; do
  read -r p version _ file <<<"$line"
  if [ ! -f "$dest/$file" ]; then
    echo "fetch_debs: apt-get download did not produce $file" >&2
    exit 1
  fi
  for old in "$dest/${p}"_*.deb; do
    if [ "$old" != "$dest/$file" ]; then
      echo "fetch_debs: removing $(basename "$old") (the archive now has $version)"
      rm -f "$old"
    fi
  done
  total=$((total + $(stat -c %s "$dest/$file")))
done
printf '%s\n' "${manifest[@]}" >"$dest/packages.txt"

tree_bytes=$(cd "$root" && git ls-files -z --cached --others --exclude-standard |
  xargs -0 stat -c %s 2>/dev/null | awk '{s += $1} END {print s + 0}')
mib() { awk -v b="$1" 'BEGIN {printf "%.1f MiB", b / 1048576}'; }
echo "fetch_debs: ${#packages[@]} packages, $(mib "$total") in .carry/debs; with this checkout's files ($(mib "$tree_bytes")) $(mib $((total + tree_bytes))) travel (limit 64 MiB)"
if [ "$total" -ge "$limit_bytes" ]; then
  echo "fetch_debs: the packages alone take $(mib "$total"), at or over the device tool's 64 MiB" >&2
  exit 1
fi
if [ $((total + tree_bytes)) -ge "$limit_bytes" ]; then
  echo "fetch_debs: packages and checkout together take $(mib $((total + tree_bytes))), at or over the device tool's 64 MiB" >&2
  exit 1
fi

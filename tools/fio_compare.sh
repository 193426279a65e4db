#!/usr/bin/env bash
# Runs `zoffload-bench io`, fio's io_uring engine and (when the Python environment has it)
# DeepSpeed's aio_handle with the same settings on the same file, back to back, N rounds, and
# prints the median GB/s of each and zoffload's ratio to each, for writes and reads.
# How to read the numbers: docs/io.md ("Comparing with fio and DeepSpeed").
#
#   tools/fio_compare.sh --path DIR [--size 1GiB] [--block-size 1M] [--queue-depth 32]
#                        [--threads 1] [--runs 3] [--backend io_uring] [--bench PATH]
#                        [--python PY] [--json]
#
# Needs fio (Debian: apt-get install fio) and python3. --python names the interpreter whose
# environment holds DeepSpeed (default python3); without DeepSpeed its column says "skipped". The
# data file DIR/zoffload-bench-io.dat is created by the benchmark (preallocated and filled) and
# deleted at the end.
set -euo pipefail

path="" size="1GiB" bs="1M" qd="32" threads="1" runs="3" backend="io_uring" json=0 python="python3"
bench="$(dirname "$0")/../build/tools/zoffload-bench"
usage() { sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --path) path=$2; shift 2 ;;
    --size) size=$2; shift 2 ;;
    --block-size) bs=$2; shift 2 ;;
    --queue-depth) qd=$2; shift 2 ;;
    --threads) threads=$2; shift 2 ;;
    --runs) runs=$2; shift 2 ;;
    --backend) backend=$2; shift 2 ;;
    --bench) bench=$2; shift 2 ;;
    --python) python=$2; shift 2 ;;
    --json) json=1; shift ;;
    -h|--help) usage ;;
    *) echo "fio_compare.sh: unknown argument '$1'" >&2; usage ;;
  esac
done
[[ -n $path ]] || { echo "fio_compare.sh: --path DIR is required" >&2; exit 2; }
[[ -d $path ]] || { echo "fio_compare.sh: --path $path is not a directory" >&2; exit 2; }
[[ $runs =~ ^[1-9][0-9]*$ ]] || { echo "fio_compare.sh: --runs must be a positive integer" >&2; exit 2; }
command -v fio >/dev/null || { echo "fio_compare.sh: fio not found (apt-get install fio)" >&2; exit 1; }
command -v python3 >/dev/null || { echo "fio_compare.sh: python3 not found" >&2; exit 1; }
[[ -x $bench ]] || { echo "fio_compare.sh: $bench is not executable (build it, or pass --bench)" >&2; exit 1; }

data="$path/zoffload-bench-io.dat"
tmp=$(mktemp -d)
rm -f "$data"  # never reuse a file this script did not fill
trap 'rm -f "$data"; rm -rf "$tmp"' EXIT

fs=$(stat -f -c %T "$path")
echo "fio_compare: $path ($fs), size $size, block $bs, QD $qd, threads $threads, $runs rounds, zoffload $backend vs fio io_uring and DeepSpeed aio, O_DIRECT" >&2
ds_tool="$(dirname "$0")/deepspeed_aio.py"
ds_skipped=""  # the reason, once DeepSpeed turned out to be unavailable

for ((i = 1; i <= runs; i++)); do
  # Round 1 creates and fills the file; later rounds reuse it, so each round does the same work
  # as fio: a short warm-up, then one write pass and one read pass (no baseline, no refill).
  run_zo() {
    "$bench" io --path "$path" --size "$size" --block-size "$bs" --queue-depth "$qd" --threads "$threads" \
      --backend "$backend" --direct on --mode both --keep --reuse --no-baseline --json \
      >"$tmp/zo.$i.json" 2>"$tmp/zo.$i.err" || { cat "$tmp/zo.$i.err" >&2; exit 1; }
  }
  # The size and block size the benchmark resolved in round 1, for the baselines to use the same.
  read_sizes() {
    read -r size_bytes bs_bytes < <(python3 -c 'import json,sys; j=json.load(open(sys.argv[1])); print(j["size_bytes"], j["results"][0]["block_size"])' "$tmp/zo.1.json")
  }
  run_fio() {
    # Same file, size, block size, queue depth and threads as the benchmark.
    read_sizes
    local per_job=$((size_bytes / threads))
    for rw in write read; do
      fio --name=zo_compare --filename="$data" --ioengine=io_uring --direct=1 --rw=$rw --bs="$bs_bytes" \
        --iodepth="$qd" --numjobs="$threads" --size="$per_job" --offset_increment="$per_job" \
        --group_reporting --output-format=json >"$tmp/fio.$rw.$i.json" \
        || { echo "fio $rw failed" >&2; exit 1; }
    done
  }
  run_ds() {
    [[ -z $ds_skipped ]] || return 0
    read_sizes
    local rc=0
    "$python" "$ds_tool" --file "$data" --size "$size_bytes" --block-size "$bs_bytes" --queue-depth "$qd" \
      --threads "$threads" >"$tmp/ds.$i.json" 2>"$tmp/ds.$i.err" || rc=$?
    if ((rc == 3)); then
      ds_skipped=$(tail -n 1 "$tmp/ds.$i.err")
      echo "  DeepSpeed baseline skipped: $ds_skipped" >&2
    elif ((rc != 0)); then
      cat "$tmp/ds.$i.err" >&2; echo "fio_compare.sh: the DeepSpeed baseline failed" >&2; exit 1
    fi
  }
  # The first round runs zoffload first (it creates the file); later rounds rotate the order, so
  # drift over time favours none of the three.
  case $(( (i - 1) % 3 )) in
    0) run_zo; run_fio; run_ds ;;
    1) run_fio; run_ds; run_zo ;;
    2) run_ds; run_zo; run_fio ;;
  esac
  echo "  round $i done" >&2
done

python3 - "$tmp" "$runs" "$json" "$ds_skipped" <<'PY'
import json, os, statistics, sys
tmp, runs, as_json, ds_skipped = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1", sys.argv[4]
zo = {"write": [], "read": []}
fio = {"write": [], "read": []}
ds = {"write": [], "read": []}
zo_cpu = {"write": [], "read": []}
fio_cpu = {"write": [], "read": []}
ds_version = None
for i in range(1, runs + 1):
    r = json.load(open(f"{tmp}/zo.{i}.json"))["results"][0]
    d = json.load(open(f"{tmp}/ds.{i}.json")) if not ds_skipped and os.path.exists(f"{tmp}/ds.{i}.json") else None
    for rw in ("write", "read"):
        zo[rw].append(r[f"{rw}_gbps"])
        zo_cpu[rw].append(r[f"{rw}_cpu_pct"])
        j = json.load(open(f"{tmp}/fio.{rw}.{i}.json"))["jobs"][0]
        fio[rw].append(j[rw]["bw_bytes"] / 1e9)
        fio_cpu[rw].append(j["usr_cpu"] + j["sys_cpu"])
        if d:
            ds[rw].append(d[f"{rw}_gbps"])
            ds_version = d["deepspeed"]
out = {"deepspeed": {"version": ds_version} if ds_version else {"skipped": ds_skipped}}
for rw in ("write", "read"):
    z, f = statistics.median(zo[rw]), statistics.median(fio[rw])
    out[rw] = {"zoffload_gbps": z, "fio_gbps": f, "ratio": z / f if f else None,
               "zoffload_runs_gbps": zo[rw], "fio_runs_gbps": fio[rw],
               "zoffload_cpu_pct": statistics.median(zo_cpu[rw]), "fio_cpu_pct": statistics.median(fio_cpu[rw])}
    if ds[rw]:
        m = statistics.median(ds[rw])
        out[rw].update({"deepspeed_gbps": m, "ratio_to_deepspeed": z / m if m else None, "deepspeed_runs_gbps": ds[rw]})
if as_json:
    print(json.dumps(out, indent=2))
else:
    have_ds = bool(ds["read"])
    print(f"{'':6} {'zoffload GB/s':>14} {'fio GB/s':>9} {'ratio':>6} {'DeepSpeed GB/s':>15} {'ratio':>6} {'CPU% zo/fio':>12}   runs (zoffload | fio | DeepSpeed)")
    for rw in ("write", "read"):
        o = out[rw]
        runs_txt = " | ".join(" ".join(f"{x:.3f}" for x in o[k]) for k in ("zoffload_runs_gbps", "fio_runs_gbps", "deepspeed_runs_gbps") if k in o)
        cpu_txt = f"{o['zoffload_cpu_pct']:.0f}/{o['fio_cpu_pct']:.0f}"
        ds_txt = f"{o['deepspeed_gbps']:15.3f} {o['ratio_to_deepspeed']:6.3f}" if have_ds else f"{'skipped':>15} {'-':>6}"
        print(f"{rw:6} {o['zoffload_gbps']:14.3f} {o['fio_gbps']:9.3f} {o['ratio']:6.3f} {ds_txt} {cpu_txt:>12}   {runs_txt}")
    print("GB/s = 1e9 bytes/s, median of rounds; ratio = zoffload / fio (target >= 0.95), zoffload / DeepSpeed (target >= 1.0);")
    print("CPU% = CPU time over wall time of the pass (zoffload: whole process; fio: its job)")
    print(f"DeepSpeed {ds_version}: aio_handle(block_size, queue_depth, single_submit=False, overlap_events=True, threads), its own locked buffer"
          if have_ds else f"DeepSpeed baseline skipped: {ds_skipped}")
PY

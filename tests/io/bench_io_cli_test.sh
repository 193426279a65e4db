#!/usr/bin/env bash
# End-to-end checks of `zoffload-bench io` on real files: exit codes, --json, --emit-config merging
# and atomicity, cleanup of the data file, and the buffered note on tmpfs.
# Usage: bench_io_cli_test.sh ZOFFLOAD_BENCH TMPDIR_PARENT
set -u
bench=$1
work=$(mktemp -d "${2:-/tmp}/zo_bench_io_cli.XXXXXX")
trap 'rm -rf "$work"' EXIT
fails=0
fail() { echo "FAIL: $*"; fails=$((fails + 1)); }
quick=(--size 8MiB --block-size 1M --queue-depth 4 --threads 1)

expect_rc() {  # expected_rc description command...
  local want=$1 what=$2; shift 2
  "$@" >"$work/out" 2>"$work/err"; local rc=$?
  [[ $rc == "$want" ]] || { fail "$what: exit $rc, expected $want"; cat "$work/err"; }
}

expect_rc 2 "block size not a multiple of 4096" "$bench" io --path "$work" --block-size 1000
grep -q -- "--block-size" "$work/err" || fail "bad block size message does not name the flag"
expect_rc 2 "bad mode" "$bench" io --path "$work" --mode sideways
expect_rc 2 "missing --path" "$bench" io
expect_rc 2 "path is not a directory" "$bench" io --path "$work/none"
expect_rc 2 "unknown backend" "$bench" io --path "$work" --backend spdk

# --json is valid JSON with one row and the DeepSpeed aio keys.
expect_rc 0 "json run" "$bench" io --path "$work" "${quick[@]}" --json
python3 - "$work/out" <<'PY' || fail "--json output"
import json, sys
j = json.load(open(sys.argv[1]))
assert len(j["results"]) == 1, j["results"]
r = j["results"][0]
assert r["block_size"] == 1048576 and r["queue_depth"] == 4 and r["threads"] == 1
assert r["write_gbps"] > 0 and r["read_gbps"] > 0
assert sorted(j["best"]["aio"]) == sorted(["block_size", "queue_depth", "intra_op_parallelism", "single_submit", "overlap_events"])
PY
ls "$work"/zoffload-bench-io.* >/dev/null 2>&1 && fail "data file left behind"

# --emit-config merges into an existing config and keeps everything else, in order.
cat >"$work/ds.json" <<'JS'
{
  "train_batch_size": 8,
  "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme"}},
  "aio": {"use_gds": false, "thread_count": 2, "queue_depth": 1}
}
JS
expect_rc 0 "emit-config into existing" "$bench" io --path "$work" "${quick[@]}" --emit-config "$work/ds.json"
python3 - "$work/ds.json" <<'PY' || fail "emit-config merge"
import json, sys
j = json.load(open(sys.argv[1]))
assert list(j) == ["train_batch_size", "zero_optimization", "aio"], list(j)
assert j["train_batch_size"] == 8
assert j["zero_optimization"]["offload_optimizer"]["nvme_path"] == "/nvme"
a = j["aio"]
assert a == {"use_gds": False, "queue_depth": 4, "block_size": 1048576, "intra_op_parallelism": 1,
             "single_submit": False, "overlap_events": True}, a
PY
ls "$work"/ds.json.tmp* >/dev/null 2>&1 && fail "temporary config file left behind"

# A new file is created.
expect_rc 0 "emit-config new file" "$bench" io --path "$work" "${quick[@]}" --emit-config "$work/new.json"
python3 -c 'import json,sys; assert "aio" in json.load(open(sys.argv[1]))' "$work/new.json" || fail "new config"

# An unparseable config is an error before any I/O, and it is left byte for byte.
printf '{"train_batch_size": 8,,}\n' >"$work/bad.json"
cp "$work/bad.json" "$work/bad.orig"
expect_rc 2 "emit-config into bad JSON" "$bench" io --path "$work" "${quick[@]}" --emit-config "$work/bad.json"
grep -q "bad.json" "$work/err" || fail "bad config message does not name the file"
cmp -s "$work/bad.json" "$work/bad.orig" || fail "bad config was modified"

# A directory is no config file: refused before any I/O (Note [Output files]), and left as it is.
mkdir -p "$work/dir.json/mine"
expect_rc 2 "emit-config into a directory" "$bench" io --path "$work" "${quick[@]}" --emit-config "$work/dir.json"
grep -q "dir.json is a directory" "$work/err" || fail "directory message does not say what is wrong"
[[ -d "$work/dir.json/mine" ]] || fail "the directory was changed"

# tmpfs: O_DIRECT is not honoured; the run works buffered and says so.
if [[ $(stat -f -c %T /dev/shm 2>/dev/null) == tmpfs ]]; then
  shm=$(mktemp -d /dev/shm/zo_bench_io_cli.XXXXXX)
  expect_rc 0 "tmpfs run" "$bench" io --path "$shm" "${quick[@]}"
  grep -q "buffered" "$work/err" || fail "tmpfs run did not report buffered I/O"
  grep -q "buffered" "$work/out" || fail "tmpfs table does not say buffered"
  rm -rf "$shm"
else
  echo "SKIP tmpfs part: /dev/shm is not tmpfs"
fi

if [[ $fails -gt 0 ]]; then echo "$fails failure(s)"; exit 1; fi
echo "all bench io CLI checks passed"

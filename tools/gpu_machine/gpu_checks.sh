#!/usr/bin/env bash
# tools/gpu_machine/gpu_checks.sh: the GPU checks of docs/gpu.md ("Checks on the GPU machine") in
# one device command: the gpu suite, transformers parity on cuda, zoffload-bench pcie, CudaDevice
# against HostDevice, the narrow optimizer states stepped on the device against the CPU's, the
# device budget, llama3-8b at GAS 1 and 8, llama3-8b with 8-bit moments and
# every state in RAM, llama3-8b with every state fp32 in RAM and no gradient accumulators, LoRA
# adapters over a pinned 32.5 B base, a 7B
# model whose gradient accumulators the host's RAM holds, and zoffload against DeepSpeed ZeRO-3
# offload on the same runs. Runs THERE, from the repository root, with .carry carried after
# tools/gpu_machine/pack_prebuilt.sh ran here (or with BIN_DIR naming a build made there by
# build_there.sh):
#   tools/gpu_machine/gpu_checks.sh [--time-limit S] [PART...]
# PART: suite parity pcie tiny devstates budget llama8b ram8bit exact exactgas lean lora qlora ram deepspeed host
# (default: all but exactgas, lean, qlora and host, in that order; host measures the machine's CPUs and
# memory, not its GPU). Each part is given at most its own share of time and the time left before --time-limit
# (default 560 s, under the tool's 600 s for one command), so a slow part cannot take the later
# ones' time unseen; the line of a part that was cut says so. Ends with a table of parts, seconds
# and results. Files in $OUT (the device tool brings them back): checks.log (everything printed),
# gpu_test.log, hf_parity.log, runs.tgz (every run's metrics.jsonl, log and plan),
# trace-llama8b-gas8.json.gz, trace-ram8bit.json.gz, trace-exact.json.gz, trace-exact-gas1.json.gz,
# trace-exact-gas16.json.gz, trace-lean.json.gz, trace-lora.json.gz, trace-qlora.json.gz,
# trace-ram.json.gz and the
# deepspeed part's zoffload traces, trace-ds-<shape>-gas<N>.json.gz. Exit status: 0 when every part
# passed, 1 otherwise, 2 on bad usage.
#
# Environment: BIN_DIR (zoffload, zoffload-bench and gpu_test; default .carry/prebuilt/bin, whose
# libraries are in .carry/prebuilt/lib), OUT (default /tmp/gpu-checks). The ram8bit part:
# ZO_8BIT_MODEL (default llama3-8b), ZO_8BIT_DEVICE (default cuda; host for a test), ZO_8BIT_MICRO,
# ZO_8BIT_GAS, ZO_8BIT_BASELINE (0: no fp32 baseline run), ZO_8BIT_GRADS (bf16: the 8-bit run stores
# its gradient sums in bf16, zoffload.gradient_store_dtype). The exact part: ZO_EXACT_MODEL (default
# llama3-8b), ZO_EXACT_DEVICE (default cuda; host for a test), ZO_EXACT_MICRO, ZO_EXACT_GAS,
# ZO_EXACT_SEQ (default 1024), ZO_EXACT_STEPS (default 5; the exact and lean parts; exactgas runs
# GAS 1 and 16 of it, three steps each). The lora part: ZO_LORA_MODEL (default llama-30b), ZO_LORA_DEVICE
# (default cuda; host for a test), ZO_LORA_MICRO, ZO_LORA_GAS, ZO_LORA_SEQ (default 1024). The devstates part: ZO_DEVSTATES_DEVICE (default cuda; host for a
# test), ZO_DEVSTATES_STEPS (default 10). The deepspeed part's runs: ZO_DS_RUNS (default "llama3.2-3b:8:3
# llama3.2-3b:1:3 llama3-8b:8:2", model:GAS:steps, in that order: the comparison that matters most
# first), ZO_DS_MICRO (micro-batch, default 4), ZO_DS_SEQ (default 1024), ZO_DS_DEVICE
# (zoffload.device, default cuda; host for a test without a GPU), ZO_DS_SIDES (both, or zoffload:
# zoffload's runs alone, DeepSpeed neither installed nor run), ZO_DS_ZOFFLOAD (JSON merged into the
# runs' "zoffload" section, e.g. '{"activation_checkpoints": "cpu"}'), ZO_DS_CARRY
# (install_deepspeed.sh's); ZO_DS_TEST_PEAK_BYTES (for gpu_checks_test.py only: stands in for
# DeepSpeed's measured GPU peak, zoffload's gpu_memory_limit, where DeepSpeed did not run).
set -uo pipefail

usage() {
  sed -n '2,/^[^#]/{/^#/p}' "$0" | sed 's/^# \{0,1\}//'
  exit "$1"
}

limit=560
parts=()
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage 0 ;;
    --time-limit) [ $# -ge 2 ] && [[ "$2" =~ ^[0-9]+$ ]] || { echo "gpu_checks: --time-limit takes seconds" >&2; exit 2; }
                  limit=$2; shift 2 ;;
    suite|parity|pcie|tiny|devstates|budget|llama8b|ram8bit|exact|exactgas|lean|lora|qlora|ram|deepspeed|host) parts+=("$1"); shift ;;
    *) echo "gpu_checks: unknown part or option '$1' (see --help)" >&2; exit 2 ;;
  esac
done
[ ${#parts[@]} -gt 0 ] || parts=(suite parity pcie tiny devstates budget llama8b ram8bit exact lora ram deepspeed)

root=$(pwd)
if [ ! -f "$root/meson.build" ] || ! grep -q "^project('zoffload'" "$root/meson.build"; then
  echo "gpu_checks: run me from the zoffload repository root (the folder with meson.build)" >&2
  exit 2
fi
out=${OUT:-/tmp/gpu-checks}
mkdir -p "$out"
exec > >(tee -a "$out/checks.log") 2>&1

t0=$(date +%s)
elapsed() { echo $(($(date +%s) - t0)); }
# seconds_left: the seconds before --time-limit, less the 30 kept for the packing at the end.
seconds_left() { echo $((limit - $(elapsed) - 30)); }
# budget MAX: the seconds a part may take: MAX, or less when the time limit is closer; at least 1
# (`timeout 0` would mean no limit at all).
budget() {
  local left
  left=$(seconds_left)
  [ "$left" -lt 1 ] && left=1
  [ "$left" -lt "$1" ] && echo "$left" || echo "$1"
}
results=()
record() { results+=("$(printf '%-8s %6ss  %s' "$1" "$2" "$3")"); }

python=$(command -v python3) || { echo "gpu_checks: no python3 on PATH" >&2; exit 1; }
# torch's version, then its site-packages: one import of torch (seconds on a small machine).
torch_info=$("$python" -c 'import os, torch; print(torch.__version__); print(os.path.dirname(os.path.dirname(torch.__file__)))') ||
  { echo "gpu_checks: $python cannot import torch" >&2; exit 1; }
torch_version=${torch_info%%$'\n'*}
site=${torch_info#*$'\n'}
bin=${BIN_DIR:-$root/.carry/prebuilt/bin}
[ -x "$bin/zoffload" ] || { echo "gpu_checks: no $bin/zoffload: run tools/gpu_machine/pack_prebuilt.sh here and carry .carry, or set BIN_DIR" >&2; exit 1; }
# PyTorch's own libraries (the same version the binaries were linked with) and the wheel's CUDA
# runtime; the carried libraries first.
export LD_LIBRARY_PATH="$root/.carry/prebuilt/lib:$site/torch/lib:$site/nvidia/cu13/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
gpu_test=$bin/gpu_test
[ -x "$gpu_test" ] || gpu_test=$root/${BUILD_DIR:-build-gpu}/tests/gpu/gpu_test
zo=$bin/zoffload
runs=/tmp/gpu-checks-runs
rm -rf "$runs"
mkdir -p "$runs"

pack() {
  (cd "$runs" && find . \( -name '*.jsonl' -o -name '*.log' -o -name '*.txt' -o -name '*.json' \) -print |
     grep -v trace | tar czf "$out/runs.tgz" -T -) 2>/dev/null
  # The work folder (swap files, NVMe sections) may be on the checkout's disk: never left behind.
  [ -n "${work:-}" ] && rm -rf "$work"
  echo
  echo "== gpu_checks: $(elapsed) s in all"
  printf '%s\n' "${results[@]}"
}
trap pack EXIT

echo "== machine"
nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv,noheader ||
  echo "nvidia-smi failed"
echo "$(nproc) cores, $(free -g | awk '/^Mem:/ {print $2}') GiB RAM; torch $torch_version"
[ -f "$root/.carry/prebuilt/manifest.txt" ] && [ -z "${BIN_DIR:-}" ] && cat "$root/.carry/prebuilt/manifest.txt"
if ldd "$zo" | grep "not found"; then
  echo "gpu_checks: $zo does not load (the libraries above are missing)"
  exit 1
fi
"$zo" info || { echo "gpu_checks: zoffload info failed"; exit 1; }
# Swap files and temporary folders on the largest disk that is not memory.
disk=$(for d in "$root" /tmp /var/tmp; do
         df --output=avail,fstype "$d" | awk -v d="$d" 'NR == 2 && $2 != "tmpfs" {print $1, d}'
       done | sort -rn | head -n 1 | cut -d' ' -f2)
work=${disk:-/tmp}/gpu-checks-work
rm -rf "$work"
mkdir -p "$work"
export TMPDIR=$work
echo "work folder: $work ($(df -h --output=avail "$work" | tail -n 1 | tr -d ' ') free)"
rc=0
data=$root/configs/data/demo_corpus.txt

# config FROM OUT PYTHON-STATEMENTS: a config derived from FROM with c (the parsed JSON) changed.
config() {
  "$python" - "$1" "$2" "$3" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))
exec(sys.argv[3])
json.dump(c, open(sys.argv[2], "w"), indent=1)
PY
}

# A summary line per step of a metrics.jsonl.
steps() {
  "$python" - "$1" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    m = json.loads(line); t = m["time_s"]
    print("  step %d: %.2f s, loss %.4f, %.0f tok/s, device_busy %.3f, overlap %.3f | device compute %.2f, h2d %.2f, d2h %.2f;"
          " host compute %.2f, grad offload %.2f (worker %.2f), optimizer %.2f (wait %.2f), nvme busy %.2f (read wait %.2f) |"
          " device peak %.2f GiB, torch peak %.2f GiB of budget %.2f GiB" % (
              m["step"], m["step_s"], m["loss"], m["tokens_per_s"], m["device_busy"], m["overlap"], t["device_compute"],
              t["device_h2d"], t["device_d2h"], t["compute"], t["grad_offload"], t["grad_worker"], t["optimizer"],
              t["optimizer_wait"],
              t["nvme_busy"], t["nvme_read_wait"], m["device_peak_bytes"] / 2**30, m["torch_peak_bytes"] / 2**30,
              m["device_budget_bytes"] / 2**30))
PY
}

# The small runs' config: stage 3, parameters and optimizer on the CPU, on the GPU.
cat >"$runs/tiny-base.json" <<'EOF'
{"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
 "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}},
 "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": true},
                       "offload_optimizer": {"device": "cpu", "pin_memory": true}},
 "zoffload": {"device": "cuda"}}
EOF

part_suite() {
  timeout -k 5 "$(budget 150)" "$gpu_test" --gtest_color=no >"$runs/gpu_test.log" 2>&1
  local r=$?
  cp "$runs/gpu_test.log" "$out/gpu_test.log"
  grep -E '^\[  (PASSED|FAILED|SKIPPED) |^\[==========\] [0-9]+ tests' "$runs/gpu_test.log"
  [ $r -eq 0 ] && ! grep -q '^\[  SKIPPED \]' "$runs/gpu_test.log"
}

part_parity() {
  PYTHONUNBUFFERED=1 ZO_PARITY_DEVICE=cuda timeout -k 5 "$(budget 120)" "$python" "$root/tests/tools/hf_parity_test.py" \
    "$zo" "$root" >"$runs/hf_parity.log" 2>&1
  local r=$?
  cp "$runs/hf_parity.log" "$out/hf_parity.log"
  grep -E '^FAIL|checks,' "$runs/hf_parity.log"
  return $r
}

part_pcie() {
  timeout -k 5 "$(budget 90)" "$bin/zoffload-bench" pcie >"$runs/pcie.txt" 2>&1
  local r=$?
  cat "$runs/pcie.txt"
  return $r
}

# The tiny preset, 20 steps, fp32 and bf16, on cuda and on the emulated device.
part_tiny() {
  local base=$runs/tiny-base.json prec dev ok=0
  for prec in fp32 bf16; do
    for dev in cuda host; do
      config "$base" "$runs/tiny-$dev.json" "c['zoffload']['device'] = '$dev'"
      timeout -k 5 "$(budget 60)" "$zo" train --config "$runs/tiny-$dev.json" --model tiny --data "$data" --seq-len 64 \
        --steps 20 --precision $prec --out "$runs/tiny-$prec-$dev" -q >"$runs/tiny-$prec-$dev.log" 2>&1 || ok=1
    done
  done
  "$python" - "$runs" <<'PY' || ok=1
import json, sys
r = sys.argv[1]
bad = False
for prec, tol in (("fp32", 1e-5), ("bf16", 1e-2)):
    try:
        c = [json.loads(l) for l in open("%s/tiny-%s-cuda/metrics.jsonl" % (r, prec))]
        h = [json.loads(l) for l in open("%s/tiny-%s-host/metrics.jsonl" % (r, prec))]
    except OSError as e:
        print("  %s: no metrics (%s; see tiny-%s-*.log in runs.tgz)  FAIL" % (prec, e.strerror, prec))
        bad = True
        continue
    rel = lambda a, b: abs(a - b) / max(abs(b), 1e-30)
    dl = max(rel(x["loss"], y["loss"]) for x, y in zip(c, h))
    dg = max(rel(x["grad_norm"], y["grad_norm"]) for x, y in zip(c, h))
    ok = len(c) == len(h) == 20 and dl <= tol
    bad |= not ok
    print("  %s: %d steps, loss cuda %.6f -> %.6f, host %.6f -> %.6f; worst relative difference: loss %.1e (bound %.0e), "
          "grad_norm %.1e%s" % (prec, len(c), c[0]["loss"], c[-1]["loss"], h[0]["loss"], h[-1]["loss"], dl, tol, dg,
                                "" if ok else "  FAIL"))
sys.exit(1 if bad else 0)
PY
  return $ok
}

# The narrow optimizer states on the device (Device::adam8bit_step and adam_step with bf16 masters):
# the tiny preset in bf16, 8-bit moments and bf16 masters, stage 2, 10 steps, with the optimizer on
# the device and then on the CPU, the compute copies on the device both times (ZO_DEVSTATES_STEPS
# replaces the 10 steps, for a test on the emulated device's slow bf16). The optimizer's
# arithmetic is the same on both tiers, so every step's loss and gradient norm must be equal, bit
# for bit, where a repeat of the CPU-tier run is (backward itself deterministic); where it is not,
# the part says so and compares within the repeat's own spread.
part_devstates() {
  local dev=${ZO_DEVSTATES_DEVICE:-cuda} n=${ZO_DEVSTATES_STEPS:-10} ok=0 v
  for v in device cpu cpu-again; do
    local od=none
    [ "$v" != device ] && od=cpu
    config "$runs/tiny-base.json" "$runs/devstates-$v.json" "c['zero_optimization'] = {'stage': 2, 'offload_optimizer': {'device': '$od'}}
c['bf16'] = {'enabled': True}; c['zoffload'] = {'device': '$dev', 'moment_dtype': '8bit', 'master_dtype': 'bf16'}"
    timeout -k 5 "$(budget 45)" "$zo" train --config "$runs/devstates-$v.json" --model tiny --data "$data" --seq-len 64 \
      --steps "$n" --out "$runs/devstates-$v" --json >"$runs/devstates-$v.out" 2>"$runs/devstates-$v.log" ||
      { ok=1; echo "  $v: failed (devstates-$v.log)"; tail -n 3 "$runs/devstates-$v.log"; }
  done
  [ $ok -eq 0 ] || return 1
  "$python" - "$runs" "$n" <<'PY'
import json, sys
r, n = sys.argv[1], int(sys.argv[2])
run = lambda v: [(m["loss"], m["grad_norm"]) for m in map(json.loads, open("%s/devstates-%s/metrics.jsonl" % (r, v)))]
dev, cpu, again = run("device"), run("cpu"), run("cpu-again")
plan = json.load(open("%s/devstates-device.out" % r))["plan"]["memory_plan"]["placement"]
print("  optimizer on the %s, moments %s, masters %s; %d steps, loss %.5f -> %.5f" % (
    plan["optimizer"], plan["moment_dtype"], plan["master_dtype"], len(dev), dev[0][0], dev[-1][0]))
ok = plan["optimizer"] == "device" and len(dev) == len(cpu) == n and dev[-1][0] < dev[0][0]
if cpu == again:
    same = dev == cpu
    print("  device tier against CPU tier, every step's loss and grad norm: %s" % ("equal" if same else "DIFFERENT"))
    ok = ok and same
else:
    rel = lambda a, b: abs(a - b) / max(abs(b), 1e-30)
    spread = max(rel(x[0], y[0]) for x, y in zip(cpu, again))
    diff = max(rel(x[0], y[0]) for x, y in zip(dev, cpu))
    print("  two CPU-tier runs differ (backward is not deterministic here, loss spread %.1e): device tier within %.1e" % (
        spread, diff))
    ok = ok and diff <= 4 * spread
sys.exit(0 if ok else 1)
PY
}

# tinyllama-1.1b in bf16 (2.2 GB of weights) under a 1 GiB budget: it must train, and the device
# pool's peak plus LibTorch's must stay within the budget.
part_budget() {
  local cfg=$runs/budget.json
  config "$runs/tiny-base.json" "$cfg" "c['train_micro_batch_size_per_gpu'] = 2; c['gradient_accumulation_steps'] = 1
c['zoffload']['gpu_memory_limit'] = '1GiB'; c['bf16'] = {'enabled': True}; c['wall_clock_breakdown'] = True"
  timeout -k 5 "$(budget 90)" "$zo" train --config "$cfg" --model tinyllama-1.1b --data "$data" --seq-len 512 --steps 3 \
    --out "$runs/budget" >"$runs/budget.log" 2>&1
  local r=$?
  grep -E '^plan:|error' "$runs/budget.log"
  [ $r -eq 0 ] || return 1
  steps "$runs/budget/metrics.jsonl"
  "$python" - "$runs/budget/metrics.jsonl" <<'PY'
import json, sys
worst = max(m["device_peak_bytes"] + m["torch_peak_bytes"] - m["device_budget_bytes"] for m in map(json.loads, open(sys.argv[1])))
print("  device peak + torch peak - budget, the worst step: %+.1f MiB%s" % (worst / 2**20, "" if worst <= 0 else "  FAIL"))
sys.exit(0 if worst <= 0 else 1)
PY
}

# train_traced NAME MODEL SECONDS [TRACE]: trains $runs/NAME.json on MODEL (random init), seq 1024,
# three steps traced over steps 2-3, within SECONDS of the time left; prints its plan, setup and done
# lines and one line per step, keeps its metrics in runs.tgz and the trace, gzipped, as $OUT/TRACE.
train_traced() {  # NAME MODEL SECONDS [TRACE [SEQ [STEPS]]]
  local name=$1 model=$2 max=$3 trace=${4:-} seq=${5:-1024} n=${6:-3} r
  timeout -k 10 "$(budget "$max")" "$zo" train --config "$runs/$name.json" --model "$model" --data "$data" --seq-len "$seq" \
    --steps "$n" --out "$work/$name" --trace "$work/$name.trace.json" --trace-steps "2-$n" >"$runs/$name.log" 2>&1
  r=$?
  grep -E '^(plan|setup|done):|error' "$runs/$name.log" | sed 's/^/  /'
  [ $r -eq 124 ] && echo "  $name: cut by the time limit"
  mkdir -p "$runs/$name"
  cp "$work/$name/metrics.jsonl" "$runs/$name/" 2>/dev/null && steps "$runs/$name/metrics.jsonl"
  [ -n "$trace" ] && [ -f "$work/$name.trace.json" ] && gzip -c "$work/$name.trace.json" >"$out/$trace"
  rm -rf "$work/$name" "$work/$name.trace.json"
  return $r
}

# llama3-8b (random init), bf16, seq 1024, the flagship config with gpu_memory_limit 24 GiB,
# micro-batch 8 (4 where the plan does not fit 8), GAS 8 then 1, three steps each; the GAS 8 run
# traced over steps 2-3.
llama8b_run() {  # NAME GAS MICRO SECONDS
  local name=$1 gas=$2 micro=$3 max=$4 cfg=$runs/$1.json
  config "$root/configs/llama8b_24gb_optimizer_cpu.json" "$cfg" "c['train_micro_batch_size_per_gpu'] = $micro
c['gradient_accumulation_steps'] = $gas; c['wall_clock_breakdown'] = True; c['steps_per_print'] = 1
c['scheduler']['params']['warmup_num_steps'] = 0; c['zoffload']['gpu_memory_limit'] = '24GiB'; c['zoffload'].pop('checkpoint')
c['zero_optimization']['stage3_gather_16bit_weights_on_model_save'] = False
c['zero_optimization']['offload_optimizer']['nvme_path'] = '$work/nvme'"
  "$zo" plan --config "$cfg" --model llama3-8b --seq-len 1024 --steps 3 --out "$work/$name" >"$runs/plan-$name.txt" 2>&1
  local r=$?
  if [ $r -ne 0 ]; then
    echo "  $name: micro-batch $micro does not fit (zoffload plan exit $r):"
    sed -n '/^does NOT fit/,$p' "$runs/plan-$name.txt" | head -n 6 | sed 's/^/    /'
    return 3
  fi
  echo "  $name: micro-batch $micro, GAS $gas"
  local trace=
  [ "$gas" -eq 8 ] && trace=trace-llama8b-gas8.json.gz
  train_traced "$name" llama3-8b "$max" "$trace"
}
part_llama8b() {
  local ok=0 r
  llama8b_run llama8b-gas8 8 8 240; r=$?
  if [ $r -eq 3 ]; then llama8b_run llama8b-gas8 8 4 240; r=$?; fi
  [ $r -eq 0 ] || ok=1
  llama8b_run llama8b-gas1 1 8 170 || ok=1
  return $ok
}

# plan_checked NAME STATUS IN_RAM: after `zoffload plan` wrote $runs/plan-NAME.txt with STATUS,
# fails saying why when the plan does not fit, or (IN_RAM 1) when it moves state through the disk.
plan_checked() {
  if [ "$2" -ne 0 ]; then
    echo "  $1 does not fit this host (zoffload plan exit $2):"
    sed -n '/^does NOT fit/,$p' "$runs/plan-$1.txt" | head -n 6 | sed 's/^/    /'
    return 1
  fi
  if [ "$3" = 1 ] && ! grep -q '^  NVMe read 0 B, written 0 B' "$runs/plan-$1.txt"; then
    echo "  $1: the plan moves state through the disk"
    return 1
  fi
}

# llama3-8b as configs/llama8b_24gb_8bit_ram.json ships it for a 24 GB card on a 128 GiB host: 8-bit
# Adam moments (2 bytes a parameter instead of 8), so fp32 masters, moments and gradient
# accumulators all stay in RAM; micro-batch 4, GAS 8, vertical, its 22 GiB GPU limit; three steps
# traced over steps 2-3. The plan runs first and must move nothing through the disk. Then the
# baseline, the same config with fp32 moments, which this host holds only with the accumulators
# on the disk (the planner's fix); the part ends with each run's median tokens/s and device_busy
# over steps 2-3 and their ratio. ZO_8BIT_MODEL, ZO_8BIT_DEVICE, ZO_8BIT_MICRO and ZO_8BIT_GAS
# replace the model, zoffload.device, micro-batch and GAS (for a test without a GPU);
# ZO_8BIT_BASELINE=0 runs the 8-bit run alone; ZO_8BIT_GRADS=bf16 stores the 8-bit run's gradient
# sums in bf16 (the baseline keeps fp32 ones).
ram8bit_run() {  # NAME MOMENTS ACCUMULATORS SECONDS [TRACE]
  local name=$1 cfg=$runs/$1.json r grads=auto
  [ "$2" = 8bit ] && grads=${ZO_8BIT_GRADS:-auto}
  config "$root/configs/llama8b_24gb_8bit_ram.json" "$cfg" "c['wall_clock_breakdown'] = True; c['steps_per_print'] = 1
c['scheduler']['params']['warmup_num_steps'] = 0; c['zoffload'].pop('checkpoint')
c['train_micro_batch_size_per_gpu'] = ${ZO_8BIT_MICRO:-4}; c['gradient_accumulation_steps'] = ${ZO_8BIT_GAS:-8}
c['zoffload']['device'] = '${ZO_8BIT_DEVICE:-cuda}'; c['zoffload']['moment_dtype'] = '$2'
c['zoffload']['gradient_accumulators'] = '$3'; c['zero_optimization']['offload_optimizer']['nvme_path'] = '$work/nvme'
c['zoffload']['gradient_store_dtype'] = '$grads'
c['zero_optimization']['stage3_gather_16bit_weights_on_model_save'] = False"
  "$zo" plan --config "$cfg" --model "${ZO_8BIT_MODEL:-llama3-8b}" --seq-len 1024 --steps 3 --out "$work/$name" \
    >"$runs/plan-$name.txt" 2>&1
  r=$?
  echo "  $name: $2 moments, gradient accumulators on $3 (gradient_store_dtype $grads)"
  sed -n '/^  RAM /p;/^  NVMe  /p;/^  NVMe read/p' "$runs/plan-$name.txt" | sed 's/^/  /'
  plan_checked "$name" "$r" "$([ "$3" = cpu ] && echo 1 || echo 0)" || return 1
  train_traced "$name" "${ZO_8BIT_MODEL:-llama3-8b}" "$4" "${5:-}"
  r=$?
  rm -rf "$work/nvme"
  return $r
}
part_ram8bit() {
  local ok=0
  ram8bit_run ram8bit 8bit cpu 300 trace-ram8bit.json.gz || ok=1
  [ "${ZO_8BIT_BASELINE:-1}" = 0 ] && return $ok
  ram8bit_run ram8bit-fp32 fp32 nvme 200 || ok=1
  "$python" - "$runs" <<'PY' || ok=1
import json, statistics, sys
def medians(name):
    try:
        ms = [json.loads(l) for l in open("%s/%s/metrics.jsonl" % (sys.argv[1], name))]
    except OSError:
        return None
    ms = ms[1:] or ms
    return statistics.median(m["tokens_per_s"] for m in ms), statistics.median(m["device_busy"] for m in ms)
a, b = medians("ram8bit"), medians("ram8bit-fp32")
for name, m in (("8-bit moments, all in RAM", a), ("fp32 moments, accumulators on the disk", b)):
    print("  %-40s %s" % (name, "no metrics" if m is None else "%.0f tokens/s, device_busy %.3f" % m))
if a and b:
    print("  8-bit / fp32: %.2fx tokens/s (medians of the steps after the first)" % (a[0] / b[0]))
sys.exit(0 if a and b else 1)
PY
  return $ok
}

# in_ram_run NAME MODEL SEQ TRACE WHAT SHOWN: plans $runs/NAME.json for MODEL at SEQ tokens and
# prints "NAME: MODEL, WHAT" with the plan's lines the sed script SHOWN picks; fails when the plan
# does not fit or moves state through the disk; else trains three steps traced over steps 2-3 into
# $out/TRACE.
in_ram_run() {
  local name=$1 model=$2 seq=$3 r
  "$zo" plan --config "$runs/$name.json" --model "$model" --seq-len "$seq" --steps 3 --out "$work/$name" \
    >"$runs/plan-$name.txt" 2>&1
  r=$?
  echo "  $name: $model, $5"
  sed -n "$6" "$runs/plan-$name.txt" | sed 's/^/  /'
  plan_checked "$name" "$r" 1 || return 1
  train_traced "$name" "$model" 300 "$4" "$seq" "${run_steps:-3}"
}

# medians METRICS LABEL [NOTE]: "LABEL: N tokens/s, device_busy B" over the steps after the first.
medians() {
  "$python" - "$1" "$2" "${3:-}" <<'PY'
import json, statistics, sys
ms = [json.loads(l) for l in open(sys.argv[1])]
ms = ms[1:] or ms
note = "; " + sys.argv[3] if sys.argv[3] else ""
print("  %s: %.0f tokens/s, device_busy %.3f (medians of the steps after the first%s)" %
      (sys.argv[2], statistics.median(m["tokens_per_s"] for m in ms), statistics.median(m["device_busy"] for m in ms),
       note))
PY
}

# exact_config NAME GAS [PYTHON]: $runs/NAME.json from configs/llama8b_24gb_exact_ram.json at GAS
# (the ZO_EXACT_* replacements applied), with PYTHON's further changes to c.
exact_config() {
  config "$root/configs/llama8b_24gb_exact_ram.json" "$runs/$1.json" "c['wall_clock_breakdown'] = True; c['steps_per_print'] = 1
c['scheduler']['params']['warmup_num_steps'] = 0; c['zoffload'].pop('checkpoint')
c['train_micro_batch_size_per_gpu'] = ${ZO_EXACT_MICRO:-4}; c['gradient_accumulation_steps'] = $2
c['zoffload']['device'] = '${ZO_EXACT_DEVICE:-cuda}'
c['zero_optimization']['stage3_gather_16bit_weights_on_model_save'] = False
${3:-}"
}

# llama3-8b as configs/llama8b_24gb_exact_ram.json ships it for a 24 GB card on a 128 GiB host:
# fp32 masters and moments in RAM and no gradient accumulators (zoffload.gradient_accumulators
# "none", so gradient_clipping 0): each sub-group is stepped during backward as its gradient lands,
# nothing is rounded and no drive is in the step. Micro-batch 4, GAS 8, vertical, its 22 GiB GPU
# limit; five steps traced over steps 2-5 (issue 61's medians). The plan runs first and must move
# nothing through the disk; the part ends with the median tokens/s and device_busy over the steps
# after the first, beside the first runs' 1,800 tokens/s and 0.16-0.20 (docs/gpu.md). ZO_EXACT_MODEL,
# ZO_EXACT_DEVICE, ZO_EXACT_MICRO, ZO_EXACT_GAS, ZO_EXACT_SEQ and ZO_EXACT_STEPS replace the model,
# zoffload.device, micro-batch, GAS, sequence length and steps (for a test without a GPU).
part_exact() {
  local name=exact model=${ZO_EXACT_MODEL:-llama3-8b} seq=${ZO_EXACT_SEQ:-1024} run_steps=${ZO_EXACT_STEPS:-5}
  exact_config "$name" "${ZO_EXACT_GAS:-8}"
  in_ram_run "$name" "$model" "$seq" trace-exact.json.gz "fp32 masters and moments, no gradient accumulators" \
    '/^placement:/p;/^  RAM /p;/^  NVMe read/p' || return 1
  medians "$runs/$name/metrics.jsonl" "exact, all in RAM" \
    "the first runs, accumulators on the disk: 1,800 tokens/s, 0.16-0.20"
}

# The exact config at GAS 1 and GAS 16 (issue 61: what bounds each), three steps each, traced over
# steps 2-3 (trace-exact-gas1.json.gz, trace-exact-gas16.json.gz); the ZO_EXACT_* replacements apply.
part_exactgas() {
  local ok=0 gas model=${ZO_EXACT_MODEL:-llama3-8b} seq=${ZO_EXACT_SEQ:-1024}
  for gas in 1 16; do
    exact_config "exact-gas$gas" "$gas"
    if in_ram_run "exact-gas$gas" "$model" "$seq" "trace-exact-gas$gas.json.gz" "the exact config at GAS $gas" \
      '/^  RAM /p;/^  NVMe read/p'; then
      medians "$runs/exact-gas$gas/metrics.jsonl" "exact, GAS $gas"
    else
      ok=1
    fi
  done
  return $ok
}

# The lean exact-style run (issue 61's target: device_busy >= 0.9): the exact config with 8-bit
# moments and bf16 masters (no accumulators), five steps traced over steps 2-5
# (trace-lean.json.gz); the ZO_EXACT_* replacements apply.
part_lean() {
  local name=lean model=${ZO_EXACT_MODEL:-llama3-8b} seq=${ZO_EXACT_SEQ:-1024} run_steps=${ZO_EXACT_STEPS:-5}
  exact_config "$name" "${ZO_EXACT_GAS:-8}" "c['zoffload']['moment_dtype'] = '8bit'; c['zoffload']['master_dtype'] = 'bf16'"
  in_ram_run "$name" "$model" "$seq" trace-lean.json.gz "8-bit moments and bf16 masters, no gradient accumulators" \
    '/^placement:/p;/^  RAM /p;/^  NVMe read/p' || return 1
  medians "$runs/$name/metrics.jsonl" "lean: 8-bit moments, bf16 masters"
}

# LoRA over the largest base the host holds in RAM: llama-30b (32.5 B parameters, 65 GB in bf16)
# pinned, zoffload.lora r=16 on every projection (122 M adapter parameters, their optimizer and
# accumulators in RAM), micro-batch 4, GAS 8, vertical, 24 GiB of the card; three steps traced over
# steps 2-3. The plan runs first and must move nothing through the disk; the part ends with the
# median tokens/s and device_busy over steps 2-3. ZO_LORA_MODEL, ZO_LORA_DEVICE, ZO_LORA_MICRO,
# ZO_LORA_GAS and ZO_LORA_SEQ replace the model, zoffload.device, micro-batch, GAS and sequence
# length (for a test without a GPU).
part_lora() {
  local name=lora cfg=$runs/lora.json model=${ZO_LORA_MODEL:-llama-30b} seq=${ZO_LORA_SEQ:-1024}
  config "$root/configs/llama8b_24gb_optimizer_cpu.json" "$cfg" "c['wall_clock_breakdown'] = True; c['steps_per_print'] = 1
c['scheduler']['params']['warmup_num_steps'] = 0; c['zoffload'].pop('checkpoint'); c['zoffload'].pop('pinned_memory_limit')
c['train_micro_batch_size_per_gpu'] = ${ZO_LORA_MICRO:-4}; c['gradient_accumulation_steps'] = ${ZO_LORA_GAS:-8}
c['zoffload']['device'] = '${ZO_LORA_DEVICE:-cuda}'; c['zoffload']['gpu_memory_limit'] = '24GiB'
c['zoffload']['gradient_accumulators'] = 'cpu'; c['optimizer']['params']['lr'] = 2e-4
c['zoffload']['lora'] = {'r': 16, 'lora_alpha': 32, 'target_modules': ['all-linear']}
c['zero_optimization']['stage3_gather_16bit_weights_on_model_save'] = False"
  in_ram_run "$name" "$model" "$seq" trace-lora.json.gz "LoRA r=16 on all-linear over the pinned base" \
    '/^zoffload plan:/p;/^  pinned /p;/^  RAM /p;/^  NVMe read/p' || return 1
  medians "$runs/$name/metrics.jsonl" "lora, base pinned"
}

# QLoRA over a 70B base on a 24 GB card (issue 63): the llama3-70b preset quantized to NF4 at load
# (configs/llama70b_qlora_24gb.json: zoffload.quantize_base nf4, LoRA r=16 on all-linear), its packed
# base (about 40 GiB with its 16-bit embeddings and head) pinned, micro-batch 4, GAS 8, horizontal,
# 24 GiB of the card; three steps traced
# over steps 2-3. The plan runs first and must move nothing through the disk; the part ends with the
# median tokens/s and device_busy over steps 2-3 (target device_busy >= 0.9) and the GPU peak.
# ZO_QLORA_MODEL, ZO_QLORA_DEVICE, ZO_QLORA_MICRO, ZO_QLORA_GAS and ZO_QLORA_SEQ replace the model,
# zoffload.device, micro-batch, GAS and sequence length (for a test without a GPU).
part_qlora() {
  local name=qlora model=${ZO_QLORA_MODEL:-llama3-70b} seq=${ZO_QLORA_SEQ:-1024}
  config "$root/configs/llama70b_qlora_24gb.json" "$runs/$name.json" "c['wall_clock_breakdown'] = True; c['steps_per_print'] = 1
c['scheduler']['params']['warmup_num_steps'] = 0; c['zoffload'].pop('checkpoint')
c['train_micro_batch_size_per_gpu'] = ${ZO_QLORA_MICRO:-4}; c['gradient_accumulation_steps'] = ${ZO_QLORA_GAS:-8}
c['zoffload']['device'] = '${ZO_QLORA_DEVICE:-cuda}'; c['zoffload']['gpu_memory_limit'] = '24GiB'"
  in_ram_run "$name" "$model" "$seq" trace-qlora.json.gz "QLoRA: LoRA r=16 on all-linear over the NF4 base, pinned" \
    '/^zoffload plan:/p;/^  pinned /p;/^  RAM /p;/^  NVMe read/p' || return 1
  medians "$runs/$name/metrics.jsonl" "qlora, NF4 base pinned"
}

# The overlapped step where the host is not the limit (issue 16's GPU busy fraction): llama3-8b's
# fp32 accumulators (32 GB) do not fit beside its masters and moments (96 GB) in a 128 GiB host, so
# the llama8b runs above are bound by the disk they go to. llama-7b (6.74 B parameters) keeps them
# in RAM (about 114 GiB with the pinned compute copies) on the whole card (no gpu_memory_limit):
# micro-batch 8, GAS 8, vertical, optimizer on the CPU, three steps, traced over steps 2-3. The plan
# runs first; when it does not fit this host the part says why and fails.
part_ram() {
  local name=ram cfg=$runs/ram.json r
  config "$root/configs/llama8b_24gb_optimizer_cpu.json" "$cfg" "c['train_micro_batch_size_per_gpu'] = 8
c['gradient_accumulation_steps'] = 8; c['wall_clock_breakdown'] = True; c['steps_per_print'] = 1
c['scheduler']['params']['warmup_num_steps'] = 0; c['zoffload'].pop('checkpoint'); c['zoffload'].pop('gpu_memory_limit')
c['zoffload']['gradient_accumulators'] = 'cpu'; c['zoffload']['pinned_memory_limit'] = '32GiB'
c['zero_optimization']['stage3_gather_16bit_weights_on_model_save'] = False"
  "$zo" plan --config "$cfg" --model llama-7b --seq-len 1024 --steps 3 --out "$work/$name" >"$runs/plan-$name.txt" 2>&1
  r=$?
  sed -n '/^memory/,/^  to the device/p' "$runs/plan-$name.txt" | sed 's/^/  /'
  if [ $r -ne 0 ]; then
    echo "  llama-7b with the accumulators in RAM does not fit this host (zoffload plan exit $r):"
    sed -n '/^does NOT fit/,$p' "$runs/plan-$name.txt" | head -n 6 | sed 's/^/    /'
    return 1
  fi
  train_traced "$name" llama-7b 240 trace-ram.json.gz
}

# peak_rss FILE CMD...: runs CMD and writes the peak resident set of the largest process of its tree
# (KiB, from getrusage of the waited-for children) to FILE; returns CMD's status.
peak_rss() {
  "$python" -c 'import resource, subprocess, sys
r = subprocess.call(sys.argv[2:])
open(sys.argv[1], "w").write("%d\n" % resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
sys.exit(r if r >= 0 else 128 - r)' "$@"
}

# zoffload against DeepSpeed ZeRO-3 with parameters and optimizer offloaded to pinned CPU memory, on
# the same runs: the same JSON config, model shape (random init, bf16), micro-batch, GAS and
# sequence length. DeepSpeed is installed from .carry/deepspeed first (install_deepspeed.sh, timed);
# tools/deepspeed_zero3.py asks DeepSpeed's estimator first and does not start a run it says this
# host cannot hold. Each run gets its share of the time left; a table ends the part. It fails when a
# run fails or is cut, not on the figures.
ds_share() {  # RUNS_AFTER: the seconds one run may take
  local s=$(($(seconds_left) - 45 * $1))
  [ "$s" -lt 30 ] && s=30
  budget "$s"
}
ds_run() {  # NAME MODEL GAS STEPS
  local name=$1 model=$2 gas=$3 steps=$4 cfg=$runs/$1.json r seconds
  local micro=${ZO_DS_MICRO:-4} seq=${ZO_DS_SEQ:-1024}
  # One config for both: DeepSpeed ignores the zoffload section and nvme_path with a cpu optimizer.
  config "$runs/tiny-base.json" "$cfg" "c['train_micro_batch_size_per_gpu'] = $micro; c['gradient_accumulation_steps'] = $gas
c['bf16'] = {'enabled': True}; c['steps_per_print'] = 1
c['optimizer']['params'] = {'lr': 2e-5, 'betas': [0.9, 0.95], 'eps': 1e-8, 'weight_decay': 0.0}
z = c['zero_optimization']
z.update({'stage3_prefetch_bucket_size': 'auto', 'stage3_param_persistence_threshold': 'auto', 'reduce_bucket_size': 'auto',
          'stage3_gather_16bit_weights_on_model_save': False})
c['zoffload'] = {'schedule': 'vertical', 'device': '${ZO_DS_DEVICE:-cuda}'}
if '$model' == 'llama3-8b':
    # 8 B parameters' fp32 masters, moments and accumulators (128 GB) do not fit this host's RAM; and
    # at DeepSpeed's default sub_group_size (1e9) zoffload's sub-group buffers (18.4 GiB) leave the
    # plan 2 GiB over a 125 GiB host (H100 machine, 2026-11-26), at 1e8 they take 3.7 GiB.
    c['zoffload']['gradient_accumulators'] = 'nvme'; z['offload_optimizer']['nvme_path'] = '$work/nvme'
    z['sub_group_size'] = 1e8
c['zoffload'].update(json.loads(__import__('os').environ.get('ZO_DS_ZOFFLOAD') or '{}'))"
  # A run may take the time left less 45 s for each run after it (DeepSpeed's and zoffload's), so a
  # quick one passes its time on and a slow one cannot starve the rest.
  seconds=$(ds_share $((ds_runs_left * 2 - 1)))
  local ok=0
  if [ "${ZO_DS_SIDES:-both}" = zoffload ]; then
    echo "  $name: $model, micro-batch $micro, GAS $gas, seq $seq, $steps steps; DeepSpeed not run (ZO_DS_SIDES=zoffload)"
  else
    echo "  $name: $model, micro-batch $micro, GAS $gas, seq $seq, $steps steps; DeepSpeed (at most $seconds s)"
    PYTHONUNBUFFERED=1 peak_rss "$runs/$name-ds.rss" timeout -k 10 "$seconds" "$python" "$root/tools/deepspeed_zero3.py" \
      --config "$cfg" --model "$model" --seq-len "$seq" --steps "$steps" --json "$runs/$name-ds.jsonl" \
      >"$runs/$name-ds.log" 2>&1
    r=$?
    grep -E '^(step|init|estimate|DeepSpeed needs|deepspeed_zero3)' "$runs/$name-ds.log" | sed 's/^/    /'
    case $r in
      0 | 3) ;;
      124 | 137) echo "    $name: DeepSpeed cut by the time limit"; ok=1 ;;
      *) echo "    $name: DeepSpeed failed (exit $r); its log's end:"; tail -n 15 "$runs/$name-ds.log" | sed 's/^/      /'; ok=1 ;;
    esac
  fi
  ds_runs_left=$((ds_runs_left - 1))
  # Equal memory (issue 61): zoffload gets DeepSpeed's measured GPU peak as its gpu_memory_limit,
  # and where its plan does not fit there, the plan's first fix (say, the same batch at half the
  # micro-batch), said so. ZO_DS_TEST_PEAK_BYTES stands in for the peak where DeepSpeed did not run:
  # for gpu_checks_test.py only.
  local peak zo_cfg=$cfg
  peak=$("$python" -c 'import json, sys
r = [json.loads(l) for l in open(sys.argv[1])]
print(next((x["gpu_peak_bytes"] for x in r if x.get("status") == "ran"), ""))' "$runs/$name-ds.jsonl" 2>/dev/null)
  [ -z "$peak" ] && peak=${ZO_DS_TEST_PEAK_BYTES:-}
  if [ -n "$peak" ]; then
    zo_cfg=$runs/$name-zo.json
    config "$cfg" "$zo_cfg" "c['zoffload']['gpu_memory_limit'] = int($peak)"
    "$zo" plan --config "$zo_cfg" --model "$model" --seq-len "$seq" --steps "$steps" --out "$work/$name" --json \
      >"$runs/$name-zo-plan.json" 2>"$runs/$name-zo-plan.err"
    r=$?
    echo "  $name: zoffload under DeepSpeed's GPU peak, gpu_memory_limit $peak bytes: plan exit $r"
    if [ $r -eq 3 ]; then
      if "$python" - "$runs/$name-zo-plan.json" "$zo_cfg" <<'PY'; then
import json, sys
plan = json.load(open(sys.argv[1]))
if not plan["fixes"]:
    print("    no change makes it fit: " + "; ".join(p["resource"] for p in plan["problems"]))
    sys.exit(1)
fix = plan["fixes"][0]
c = json.load(open(sys.argv[2]))
def merge(dst, src):
    for k, v in src.items():
        if isinstance(v, dict) and isinstance(dst.get(k), dict):
            merge(dst[k], v)
        else:
            dst[k] = v
merge(c, fix["config"])
json.dump(c, open(sys.argv[2], "w"), indent=1)
print("    does not fit there; the plan's first fix: " + "; ".join(fix["changes"]))
PY
        :
      else
        ok=1
      fi
    elif [ $r -ne 0 ]; then
      tail -n 3 "$runs/$name-zo-plan.err" | sed 's/^/    /'
      ok=1
    fi
  fi
  seconds=$(ds_share $((ds_runs_left * 2)))
  echo "  $name: zoffload (at most $seconds s)"
  local trace=()
  [ "$gas" -gt 1 ] && trace=(--trace "$work/$name.trace.json" --trace-steps "$steps")
  peak_rss "$runs/$name-zo.rss" timeout -k 10 "$seconds" "$zo" train --config "$zo_cfg" --model "$model" --data "$data" \
    --seq-len "$seq" --steps "$steps" --out "$work/$name" "${trace[@]}" >"$runs/$name-zo.log" 2>&1
  r=$?
  grep -E '^(plan|setup|done):|error' "$runs/$name-zo.log" | sed 's/^/    /'
  mkdir -p "$runs/$name"
  cp "$work/$name/metrics.jsonl" "$runs/$name/" 2>/dev/null && steps "$runs/$name/metrics.jsonl" | sed 's/^/  /'
  [ -f "$work/$name.trace.json" ] && gzip -c "$work/$name.trace.json" >"$out/trace-$name.json.gz"
  rm -rf "$work/$name" "$work/$name.trace.json" "$work/nvme"
  case $r in
    0) ;;
    124 | 137) echo "    $name: zoffload cut by the time limit"; ok=1 ;;
    *) echo "    $name: zoffload failed (exit $r)"; tail -n 5 "$runs/$name-zo.log" | sed 's/^/      /'; ok=1 ;;
  esac
  return $ok
}
part_deepspeed() {
  local ok=0 spec model gas steps r
  if [ "${ZO_DS_SIDES:-both}" = zoffload ]; then
    echo "  ZO_DS_SIDES=zoffload: zoffload's runs alone, DeepSpeed not installed"
  else
    ZO_DS_PREFIX=/tmp/zo-deepspeed timeout -k 5 "$(budget 240)" "$root/tools/gpu_machine/install_deepspeed.sh" \
      >"$runs/install_deepspeed.log" 2>&1
    r=$?
    grep -vE '^  [a-z-]+ +[^ ]+ +(carried|machine) ' "$runs/install_deepspeed.log" | grep -v '^W[0-9]' | sed 's/^/  /'
    [ $r -eq 0 ] || { echo "  DeepSpeed is not installed (install_deepspeed.sh exit $r)"; return 1; }
    # shellcheck source=/dev/null
    . /tmp/zo-deepspeed/env.sh
  fi
  local specs=(${ZO_DS_RUNS:-llama3.2-3b:8:3 llama3.2-3b:1:3 llama3-8b:8:2})
  ds_runs_left=${#specs[@]}
  local names=()
  for spec in "${specs[@]}"; do
    IFS=: read -r model gas steps <<<"$spec"
    names+=("ds-$model-gas$gas")
    ds_run "ds-$model-gas$gas" "$model" "$gas" "$steps" || ok=1
  done
  "$python" - "$runs" "${names[@]}" <<'PY' || ok=1
import json, os, re, statistics, sys
runs = sys.argv[1]
GiB = 2**30
def rss(path):
    try:
        return int(open(path).read()) * 1024 / GiB
    except (OSError, ValueError):
        return None
fmt = lambda v, f="%.0f": "-" if v is None else f % v
rows = [("run", "params", "tokens/s DS", "tokens/s zo", "zo/DS", "GPU peak DS", "GPU peak zo", "zo limit", "host peak DS",
         "host peak zo", "DeepSpeed")]
for name in sys.argv[2:]:
    ds = {}
    try:
        recs = [json.loads(l) for l in open(os.path.join(runs, name + "-ds.jsonl"))]
        ds = next((r for r in recs if "status" in r), {})
    except (OSError, ValueError):
        pass
    zo = []
    try:
        zo = [json.loads(l) for l in open(os.path.join(runs, name, "metrics.jsonl"))]
    except (OSError, ValueError):
        pass
    zo_tps = statistics.median(m["tokens_per_s"] for m in zo[1:] or zo) if zo else None
    zo_gpu = max(m["device_peak_bytes"] + m["torch_peak_bytes"] for m in zo) / GiB if zo else None
    try:
        limit = json.load(open(os.path.join(runs, name + "-zo.json")))["zoffload"]["gpu_memory_limit"] / GiB
    except (OSError, ValueError, KeyError):
        limit = None
    ds_tps = ds.get("tokens_per_s") if ds.get("status") == "ran" else None
    ds_gpu = ds["gpu_peak_bytes"] / GiB if ds.get("status") == "ran" else None
    params = ds.get("params")
    if params is None:
        m = re.search(r"([0-9.]+) B params", open(os.path.join(runs, name + "-zo.log")).read()) if os.path.exists(
            os.path.join(runs, name + "-zo.log")) else None
        params = float(m.group(1)) * 1e9 if m else None
    if ds.get("status") == "refused":
        note = "not started: needs %.0f GB of host memory (its estimator), the host has %.0f" % (
            ds["estimate_cpu_bytes"] / 1e9, ds["host_bytes"] / 1e9)
    elif ds.get("status") == "ran":
        zo_tflops = zo_tps and params and 6 * params * zo_tps / 1e12
        note = "ran, %.1f TFLOPS by 6N (zoffload %s)" % (ds["tflops"], fmt(zo_tflops, "%.1f"))
    elif not os.path.exists(os.path.join(runs, name + "-ds.log")):
        note = "not run (ZO_DS_SIDES=zoffload)"
    else:
        note = "failed or cut (see %s-ds.log)" % name
    rows.append((name[3:], fmt(params and params / 1e9, "%.2f B"), fmt(ds_tps), fmt(zo_tps),
                 fmt(ds_tps and zo_tps and zo_tps / ds_tps, "%.2f"), fmt(ds_gpu, "%.1f GiB"), fmt(zo_gpu, "%.1f GiB"),
                 fmt(limit, "%.2f GiB"),
                 fmt(rss(os.path.join(runs, name + "-ds.rss")) if ds.get("status") == "ran" else None, "%.1f GiB"),
                 fmt(rss(os.path.join(runs, name + "-zo.rss")) if zo else None, "%.1f GiB"), note))
widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
print()
for r in rows:
    print("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1])
print("  tokens/s: the median of the steps after the first; GPU peak: DeepSpeed's torch.cuda.max_memory_allocated,"
      "\n  zoffload's device pool peak + LibTorch's; zo limit: zoffload's gpu_memory_limit, DeepSpeed's peak (- when"
      "\n  DeepSpeed did not run); host peak: the largest resident set of the run's processes.")
PY
  return $ok
}

# The host's half of a llama3-8b step, no GPU (zoffload-bench host; issue 61's host-path target:
# >= 0.8 of the triad): two decoder layers of llama3-8b with a 32,000-token vocabulary (0.7 B
# parameters), fp32 states without accumulators (the exact config's), 8-bit moments with bf16
# masters, and bf16 moments, each on 1, 2 and all cores; then the fp32 case with every gradient
# through the landing ring, the path before gradients landed in place. One line per run.
part_host() {
  local ok=0 spec mom mas t r
  for spec in fp32:fp32 8bit:bf16 bf16:fp32 ring; do
    for t in 1 2 0; do
      [ "$spec" = ring ] && [ "$t" != 0 ] && continue
      IFS=: read -r mom mas <<<"$spec"
      local args=(--moments "$mom" --masters "$mas")
      [ "$spec" = ring ] && args=(--through-ring)
      timeout -k 5 "$(budget 60)" "$bin/zoffload-bench" host --model llama3-8b --layers 2 --vocab 32000 "${args[@]}" \
        --threads "$t" --steps 3 --json >"$runs/host-$spec-t$t.json" 2>"$runs/host-$spec-t$t.err"
      r=$?
      [ $r -eq 0 ] || { echo "  host $spec, threads $t: exit $r: $(tail -n 1 "$runs/host-$spec-t$t.err")"; ok=1; continue; }
      "$python" - "$runs/host-$spec-t$t.json" <<'PY'
import json, sys
j = json.load(open(sys.argv[1])); m = j["median"]; p = j["placement"]
k = j["kernels"]
print("  %-34s %-28s step %.3f s (worker %.3f, optimizer %.3f, drain %.3f); kernels %.1f B/param at %.1f GB/s = %.2f "
      "of the triad %.1f GB/s; bound: %s" % (
          "%s masters, %s moments%s" % (p["masters"], p["moments"], ", through the ring" if j["through_ring"] else ""),
          j["executor"], m["step_s"], m["worker_s"], m["optimizer_s"], m["drain_s"], k["bytes_per_param"], k["gbps"],
          j["ratio_to_triad"], j["triad_gbps"], j["bound"]["stage"]))
PY
    done
  done
  return $ok
}

for p in "${parts[@]}"; do
  echo
  echo "== [$(elapsed) s] $p"
  if [ "$(seconds_left)" -lt 30 ]; then
    echo "skipped: $((limit - $(elapsed))) s left of --time-limit $limit"
    record "$p" 0 "skipped (time)"
    rc=1
    continue
  fi
  start=$(elapsed)
  if "part_$p"; then
    record "$p" $(($(elapsed) - start)) ok
  else
    record "$p" $(($(elapsed) - start)) FAILED
    rc=1
  fi
done
exit $rc

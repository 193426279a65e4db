#!/usr/bin/env python3
"""DeepSpeed ZeRO-3 with CPU offload, as a user runs it: the baseline for `zoffload train` on the same GPU.

Trains a Llama model from its config (random weights, seeded random tokens) with DeepSpeed ZeRO-3
in one process, the way the Hugging Face Trainer sets it up, and prints per optimizer step the wall
time, loss, tokens/s, TFLOPS, the accelerator's peak memory and the host's peak RSS.

    deepspeed_zero3.py --config DS.json (--model PRESET | --model-config config.json) [--micro-batch N]
                       [--gas N] [--seq-len 1024] [--steps 3] [--seed 1234] [--lr 2e-5] [--dry-run]
                       [--json PATH] [--host-memory BYTES]

The model: --model names one of zoffload's presets (tiny, llama3.2-1b, llama3.2-3b, llama3-8b; the
same shapes as `zoffload train --model`), or --model-config gives a Hugging Face config.json.

The DeepSpeed config is the JSON file zoffload trains with; its top-level "zoffload" section is
passed along (DeepSpeed 0.19.8 ignores unknown top-level keys). "auto" values are filled as the
Trainer's DeepSpeed integration fills them (HfTrainerDeepSpeedConfig) with its default arguments:
train_micro_batch_size_per_gpu (Trainer default 8) and gradient_accumulation_steps (1), which
--micro-batch and --gas override, also when the file gives numbers; train_batch_size = micro x gas x
world size; gradient_clipping 1.0; optimizer lr = --lr, betas [0.9, 0.999], eps 1e-8, weight decay 0;
scheduler warmup_min_lr 0, warmup_max_lr = --lr, total_num_steps = --steps, warmup_num_steps 1 (the
Trainer writes its warmup_steps, 0 by default, which DeepSpeed 0.19.8's Warmup* schedulers refuse);
fp16/bf16 enabled false; reduce_bucket_size = hidden^2, stage3_prefetch_bucket_size = 0.9 hidden^2,
stage3_param_persistence_threshold = 10 hidden; stage3_gather_16bit_weights_on_model_save false
(accelerate's default, under which the Trainer runs). DeepSpeed itself would silently put its own
defaults in place of "auto" bucket sizes; an "auto" left elsewhere (outside the "zoffload" section)
is refused, exit 2. The resolved config is printed on one line and checked by DeepSpeed's own config
parser before anything is built.

Before building anything, the model is built on the meta device and DeepSpeed's estimator
(deepspeed.runtime.zero.stage3.estimate_zero3_model_states_mem_needs, zero_init, buffer factor 1.5,
offload as the config says; nvme offload counts as cpu, the only device it knows) gives the host
and GPU memory the model states need. Where the host figure exceeds MemAvailable (or --host-memory),
or the GPU figure the card's free memory, the run is refused, never started. --dry-run stops after
the estimate.

The run: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT (a free port) are set where
unset; deepspeed.init_distributed() (nccl on cuda, gloo on the CPU accelerator without oneCCL);
transformers' HfDeepSpeedConfig is kept alive (when accelerate is not installed, the same ZeRO-3
flag is registered with transformers.integrations.deepspeed.set_hf_deepspeed_config), so that
AutoModelForCausalLM.from_config builds the model under deepspeed.zero.Init, in bf16/fp16/fp32 as the
config enables; use_cache off, gradient_checkpointing_enable() with the Trainer's default kwargs;
deepspeed.initialize. The init time (model build + initialize) is printed. --seed seeds the initial
weights (transformers.set_seed, as the Trainer does) and the tokens. Each optimizer step runs --gas
micro-batches of --micro-batch x --seq-len tokens drawn uniformly from the vocabulary by a
torch.Generator (labels = input ids): loss = engine(...).loss, engine.backward(loss), engine.step().
TFLOPS = 6 x params x tokens/s (gradient checkpointing's recompute is not counted). Accelerator
peak = get_accelerator().max_memory_allocated(), reset each step (on the CPU accelerator that is the
process's RSS); host peak = VmHWM of /proc/self/status. The summary takes the median over the steps
after the first (the first is warm-up; with one step, that one).

--json PATH writes one JSON object per line: {"record": "step", ...} per step, then
{"record": "summary", "status": "ran" | "refused" | "dry-run" | "failed", "params",
"estimate_cpu_bytes", "estimate_gpu_bytes", "host_bytes", "init_s", "tokens_per_s", "tflops",
"gpu_peak_bytes", "host_peak_bytes", "config", ...}. On the GPU machine, the `deepspeed` part of
tools/gpu_machine/gpu_checks.sh runs this script with --json and reads the summary record.

DS_ACCELERATOR is left as set; unset, DeepSpeed picks cuda where torch sees a GPU (DS_ACCELERATOR=cpu
runs it on the CPU, as the test does). Installing DeepSpeed, outside the repository and outside the
interpreter's environment (--no-deps keeps pip from installing a second torch; the interpreter
provides torch, transformers, numpy, packaging, pydantic and tqdm):

    python3 -m pip install --target /tmp/ds --no-deps deepspeed hjson msgpack einops psutil py-cpuinfo
    PYTHONPATH=/tmp/ds python3 tools/deepspeed_zero3.py --config configs/llama8b_24gb_optimizer_cpu.json \\
        --model llama3-8b --micro-batch 1 --gas 1 --steps 3

(on the GPU machine, tools/gpu_machine/install_deepspeed.sh does this with no index). accelerate is
optional (see above). The first run JIT-builds DeepSpeed's cpu_adam op, and on the CPU accelerator
its shm_comm op too, with g++ and ninja (about 2 minutes for both on 2 cores), cached under
~/.cache/torch_extensions (TORCH_EXTENSIONS_DIR moves it).

Exit codes: 0 ran (or --dry-run fits); 1 runtime failure (one line: out of memory, DeepSpeed
failed); 2 bad usage, a bad config, or DeepSpeed not importable; 3 refused: DeepSpeed's estimate does
not fit this host or GPU.
"""
import argparse
import copy
import json
import math
import os
import socket
import statistics
import sys
import time

PROG = "deepspeed_zero3.py"
GB = 1e9
GiB = 1 << 30
INSTALL_HINT = ("install it outside the repo: python3 -m pip install --target /tmp/ds --no-deps deepspeed hjson "
                "msgpack einops psutil py-cpuinfo, then run with PYTHONPATH=/tmp/ds (see --help)")

# zoffload's presets (engine/model/model_config.cpp, presets()) as Hugging Face LlamaConfig kwargs.
_LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}


def _llama(hidden, inter, layers, heads, kv_heads, vocab, max_pos, rope, tied):
    return {"vocab_size": vocab, "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": hidden // heads,
            "max_position_embeddings": max_pos, "rms_norm_eps": 1e-5, "hidden_act": "silu",
            "rope_parameters": rope, "tie_word_embeddings": tied, "attention_bias": False, "mlp_bias": False}


PRESETS = {
    "tiny": _llama(256, 688, 4, 8, 4, 256, 1024, {"rope_type": "default", "rope_theta": 10000.0}, False),
    "llama3.2-1b": _llama(2048, 8192, 16, 32, 8, 128256, 131072, dict(_LLAMA3_ROPE, factor=32.0), True),
    "llama3.2-3b": _llama(3072, 8192, 28, 24, 8, 128256, 131072, dict(_LLAMA3_ROPE, factor=32.0), True),
    "llama3-8b": _llama(4096, 14336, 32, 32, 8, 128256, 131072, dict(_LLAMA3_ROPE, factor=8.0), False),
}

# The Trainer's TrainingArguments defaults, which its DeepSpeed integration writes over "auto".
TRAINER_MICRO_BATCH = 8
TRAINER_GAS = 1
TRAINER_MAX_GRAD_NORM = 1.0
TRAINER_BETAS = [0.9, 0.999]
TRAINER_EPS = 1e-8
TRAINER_WEIGHT_DECAY = 0.0


def fail(msg, code=1):
    print(f"{PROG}: {msg}", file=sys.stderr)
    sys.exit(code)


class Parser(argparse.ArgumentParser):
    def error(self, message):
        fail(f"{message} (see --help)", 2)


def first_line(e):
    """An exception's message, its first line only ("" when it has none)."""
    text = str(e).strip()
    return text.splitlines()[0] if text else ""


def parse_bytes(text):
    """A byte count: 123, 2e9, 64GiB, 64GB, 512MiB."""
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40, "kb": 1e3, "mb": 1e6, "gb": 1e9,
             "tb": 1e12, "b": 1}
    t = text.strip().lower()
    scale = 1
    for suffix, s in units.items():
        if t.endswith(suffix):
            t, scale = t[:-len(suffix)], s
            break
    try:
        value = float(t) * scale
    except ValueError:
        value = -1
    if not value > 0 or not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a positive byte count like 64GiB or 2e9, got '{text}'")
    return int(value)


def positive_int(text):
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got '{text}'")
    return value


def parse_args():
    ap = Parser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="DeepSpeed config JSON (the file zoffload trains with)")
    model = ap.add_mutually_exclusive_group(required=True)
    model.add_argument("--model", choices=sorted(PRESETS), help="one of zoffload's model presets")
    model.add_argument("--model-config", help="a Hugging Face config.json")
    ap.add_argument("--micro-batch", type=positive_int, help="train_micro_batch_size_per_gpu (overrides the config)")
    ap.add_argument("--gas", type=positive_int, help="gradient_accumulation_steps (overrides the config)")
    ap.add_argument("--seq-len", type=positive_int, default=1024, help="tokens per sequence (default 1024)")
    ap.add_argument("--steps", type=positive_int, default=3, help="optimizer steps (default 3)")
    ap.add_argument("--seed", type=int, default=1234, help="seed of the initial weights and the tokens (default 1234)")
    ap.add_argument("--lr", type=float, default=2e-5, help="learning rate where the config says auto (default 2e-5)")
    ap.add_argument("--dry-run", action="store_true", help="resolve the config and estimate, then stop")
    ap.add_argument("--json", metavar="PATH", help="write step and summary records, one JSON object a line")
    ap.add_argument("--host-memory", type=parse_bytes, metavar="BYTES",
                    help="host memory available to compare the estimate with (default MemAvailable)")
    a = ap.parse_args()
    if not (a.lr > 0 and math.isfinite(a.lr)):
        fail(f"--lr: expected a positive learning rate, got {a.lr}", 2)
    return a


def load_json(path, flag):
    try:
        with open(path) as f:
            value = json.load(f)
    except OSError as e:
        fail(f"{flag} {path}: {e.strerror}", 2)
    except json.JSONDecodeError as e:
        fail(f"{flag} {path}: not JSON ({e})", 2)
    if not isinstance(value, dict):
        fail(f"{flag} {path}: expected a JSON object", 2)
    return value


def read_proc_kb(path, key):
    """A 'Key:  N kB' line of a /proc file, in bytes; None where absent."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def batch_setting(ds, key):
    """The config's positive integer under `key`; None where absent or "auto"."""
    value = ds.get(key)
    if value is None or value == "auto":
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value) or value < 1:
        fail(f"--config: {key} is {json.dumps(value)}: expected a positive integer or \"auto\"", 2)
    return int(value)


def fill(ds, key_path, value, notes):
    """Writes `value` over an "auto" at `key_path` (dotted), as HfTrainerDeepSpeedConfig.fill_only does."""
    *parents, key = key_path.split(".")
    node = ds
    for p in parents:
        node = node.get(p)
        if not isinstance(node, dict):
            return
    if node.get(key) == "auto":
        node[key] = value
        notes.append(key_path)


def resolve_config(ds, a, hidden, world):
    """The config with --micro-batch/--gas written in and every "auto" filled; the dotted keys filled."""
    ds = copy.deepcopy(ds)
    filled = []
    overridden = a.micro_batch is not None or a.gas is not None
    micro = a.micro_batch or batch_setting(ds, "train_micro_batch_size_per_gpu")
    gas = a.gas or batch_setting(ds, "gradient_accumulation_steps")
    train = None if overridden else batch_setting(ds, "train_batch_size")
    # As DeepSpeed derives the missing one of the three (runtime/config.py, _set_batch_related_parameters).
    if train is not None and micro is None:
        micro = train // ((gas or 1) * world)
    if train is not None and gas is None:
        gas = train // (micro * world)
    micro = micro or TRAINER_MICRO_BATCH
    gas = gas or TRAINER_GAS
    if train is not None and train != micro * gas * world:
        fail(f"--config: train_batch_size {train} is not train_micro_batch_size_per_gpu {micro} x "
             f"gradient_accumulation_steps {gas} x world size {world} (pass --micro-batch and --gas)", 2)
    ds["train_micro_batch_size_per_gpu"] = micro
    ds["gradient_accumulation_steps"] = gas
    ds["train_batch_size"] = micro * gas * world

    fill(ds, "gradient_clipping", TRAINER_MAX_GRAD_NORM, filled)
    fill(ds, "optimizer.params.lr", a.lr, filled)
    fill(ds, "optimizer.params.betas", TRAINER_BETAS, filled)
    fill(ds, "optimizer.params.eps", TRAINER_EPS, filled)
    fill(ds, "optimizer.params.weight_decay", TRAINER_WEIGHT_DECAY, filled)
    fill(ds, "scheduler.params.warmup_min_lr", 0, filled)
    fill(ds, "scheduler.params.warmup_max_lr", a.lr, filled)
    fill(ds, "scheduler.params.total_num_steps", a.steps, filled)
    # The Trainer writes args.get_warmup_steps(), 0 by default: DeepSpeed 0.19.8's WarmupLR,
    # WarmupDecayLR and WarmupCosineLR raise on a warmup_num_steps that is not positive.
    fill(ds, "scheduler.params.warmup_num_steps", 1, filled)
    fill(ds, "fp16.enabled", False, filled)
    fill(ds, "bf16.enabled", False, filled)
    fill(ds, "zero_optimization.reduce_bucket_size", hidden * hidden, filled)
    fill(ds, "zero_optimization.stage3_prefetch_bucket_size", int(0.9 * hidden * hidden), filled)
    fill(ds, "zero_optimization.stage3_param_persistence_threshold", 10 * hidden, filled)
    # Filled by accelerate's DeepSpeedPlugin, which the Trainer runs under (zero3_save_16bit_model).
    fill(ds, "zero_optimization.stage3_gather_16bit_weights_on_model_save", False, filled)
    return ds, filled


def find_auto(node, path=""):
    """Dotted paths of the "auto" values left in `node`."""
    if isinstance(node, dict):
        return [p for k, v in node.items() for p in find_auto(v, f"{path}.{k}" if path else k)]
    if isinstance(node, list):
        return [p for i, v in enumerate(node) for p in find_auto(v, f"{path}[{i}]")]
    return [path] if node == "auto" else []


def enabled(ds, section):
    s = ds.get(section)
    return isinstance(s, dict) and s.get("enabled") is True


def hidden_size_of(cfg):
    """The hidden size the Trainer sizes the buckets by (trainer_config_finalize)."""
    for c in (cfg, getattr(cfg, "text_config", None)):
        if c is None:
            continue
        if getattr(c, "hidden_size", None):
            return c.hidden_size
        if getattr(c, "hidden_sizes", None):
            return max(c.hidden_sizes)
    return None


class Records:
    """--json: one JSON object a line."""

    def __init__(self, path):
        self.f = None
        if path:
            try:
                self.f = open(path, "w")
            except OSError as e:
                fail(f"--json {path}: {e.strerror}", 2)

    def write(self, record):
        if self.f:
            self.f.write(json.dumps(record) + "\n")
            self.f.flush()


def gb(n):
    return f"{n / GB:.1f} GB" if n >= GB else f"{n / 1e6:.1f} MB"


def register_zero3(ds):
    """What tells transformers' from_config to build under deepspeed.zero.Init; keep it alive."""
    from transformers.integrations import deepspeed as hf_ds
    try:
        import accelerate  # noqa: F401  (HfDeepSpeedConfig's base class is accelerate's)
        keep, how = hf_ds.HfDeepSpeedConfig(ds), "HfDeepSpeedConfig"
    except ImportError:
        class Zero3Config:
            """The two things transformers asks of its registered HfDeepSpeedConfig."""

            def __init__(self, config):
                self.config = config

            def is_zero3(self):
                return True

        keep = Zero3Config(ds)
        hf_ds.set_hf_deepspeed_config(keep)
        how = "set_hf_deepspeed_config (accelerate, HfDeepSpeedConfig's base, is not installed)"
    if not hf_ds.is_deepspeed_zero3_enabled():
        fail("transformers does not see ZeRO-3 enabled after registering the config", 1)
    return keep, how


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def model_config(a, transformers):
    """The Hugging Face config of --model or --model-config; exits 2 on a bad one."""
    hf_dict = dict(PRESETS[a.model]) if a.model else load_json(a.model_config, "--model-config")
    try:
        if a.model:
            return transformers.LlamaConfig(**hf_dict)
        if not isinstance(hf_dict.get("model_type"), str):
            fail(f"--model-config {a.model_config}: no model_type", 2)
        return transformers.AutoConfig.for_model(**hf_dict)
    except (ValueError, TypeError, KeyError) as e:
        fail(f"--model {a.model}: {e}" if a.model else f"--model-config {a.model_config}: {e}", 2)


def checked_config(a, ds_file, hidden, world, DeepSpeedConfig):
    """The resolved config, as DeepSpeed's own parser accepts it; exits 2 where it does not."""
    ds, filled = resolve_config(ds_file, a, hidden, world)
    left = find_auto({k: v for k, v in ds.items() if k != "zoffload"})
    if left:
        fail(f"--config {a.config}: \"auto\" where the Trainer fills none: {', '.join(left)}", 2)
    try:
        DeepSpeedConfig(copy.deepcopy(ds))
    except Exception as e:  # pydantic's ValidationError, or DeepSpeed's own checks
        errors = getattr(e, "errors", None)
        if callable(errors) and errors():
            err = errors()[0]
            where = ".".join(str(x) for x in err.get("loc", ()))
            text = f"{getattr(e, 'title', type(e).__name__)} {where}: {err.get('msg')}"
        else:
            text = first_line(e) or type(e).__name__
        fail(f"--config {a.config}: DeepSpeed refuses the resolved config: {text}", 2)
    return ds, filled


def count_params(cfg, dtype):
    """(parameters, largest layer's parameters) of the model built on the meta device."""
    import torch
    from transformers import AutoModelForCausalLM
    from deepspeed.runtime.zero.stage3 import model_to_params
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), dtype=dtype)
    # parameters() yields a tied weight once. model_to_params's total dedups by data_ptr(), which is
    # 0 for every meta tensor, so only its largest layer is taken.
    return sum(p.numel() for p in meta.parameters()), model_to_params(meta)[1]


def estimate(a, ds, params, largest_layer, world, accel):
    """DeepSpeed's estimate beside what this host (and GPU) has; the refusal line where it does not fit."""
    import torch
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    zero = ds["zero_optimization"]
    opt_dev = (zero.get("offload_optimizer") or {}).get("device", "none")
    param_dev = (zero.get("offload_param") or {}).get("device", "none")
    offloaded = ("cpu", "nvme")
    est_cpu, est_gpu, _ = estimate_zero3_model_states_mem_needs(
        total_params=params, largest_layer_params=largest_layer, num_gpus_per_node=world, num_nodes=1,
        cpu_offload=opt_dev in offloaded, cpu_offload_params=param_dev in offloaded, zero_init=True,
        additional_buffer_factor=1.5)
    host = a.host_memory or read_proc_kb("/proc/meminfo", "MemAvailable")
    source = "--host-memory" if a.host_memory else "MemAvailable"
    gpu_free = torch.cuda.mem_get_info()[0] if accel == "cuda" else None
    # On the CPU accelerator, what the estimator puts on the GPU lives in host memory too.
    need_host = est_cpu + (est_gpu if accel == "cpu" else 0)
    nvme = " (nvme counted as cpu: the estimator knows cpu offload only)" if "nvme" in (opt_dev, param_dev) else ""
    print(f"estimate  DeepSpeed's estimator (offload_param {param_dev}, offload_optimizer {opt_dev}, zero_init){nvme}: "
          f"host {gb(est_cpu)}, GPU {gb(est_gpu)}; the host has {gb(host) if host else 'unknown'} available "
          f"({source})" + (f", the GPU {gb(gpu_free)} free" if gpu_free is not None else "") +
          (f"; on the CPU accelerator both figures are host memory: {gb(need_host)}" if accel == "cpu" else ""))
    refusal = None
    if host is not None and need_host > host:
        refusal = (f"DeepSpeed needs {gb(need_host)} of host memory for this run (its estimator), the host has "
                   f"{gb(host)} available: not started")
    elif gpu_free is not None and est_gpu > gpu_free:
        refusal = (f"DeepSpeed needs {gb(est_gpu)} of GPU memory for this run (its estimator), the GPU has "
                   f"{gb(gpu_free)} free: not started")
    fields = {"estimate_cpu_bytes": est_cpu, "estimate_gpu_bytes": est_gpu, "host_bytes": host,
              "host_bytes_source": source, "gpu_free_bytes": gpu_free}
    return fields, refusal


def main():
    a = parse_args()
    ds_file = load_json(a.config, "--config")
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        world = 0
    if world != 1:
        fail(f"WORLD_SIZE={os.environ.get('WORLD_SIZE')}: this baseline runs in one process (WORLD_SIZE 1)", 2)
    zero = ds_file.get("zero_optimization")
    stage = zero.get("stage") if isinstance(zero, dict) else None
    if stage != 3:
        fail(f"--config {a.config}: zero_optimization.stage is {json.dumps(stage)}: this baseline runs ZeRO-3", 2)
    records = Records(a.json)

    try:
        import torch
        import transformers
        import deepspeed
        from deepspeed.accelerator import get_accelerator
        from deepspeed.runtime.config import DeepSpeedConfig
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs, model_to_params  # noqa: F401
    except Exception as e:  # ImportError, or DeepSpeed failing on import
        fail(f"cannot import DeepSpeed ({type(e).__name__}: {e}); {INSTALL_HINT}", 2)

    cfg = model_config(a, transformers)
    hidden = hidden_size_of(cfg)
    if hidden is None:
        fail(f"--model-config {a.model_config}: no hidden_size to size the \"auto\" buckets by", 2)
    max_pos = getattr(cfg, "max_position_embeddings", None)
    if max_pos and a.seq_len > max_pos:
        fail(f"--seq-len {a.seq_len} exceeds the model's max_position_embeddings {max_pos}", 2)
    ds, filled = checked_config(a, ds_file, hidden, world, DeepSpeedConfig)
    dtype = torch.bfloat16 if enabled(ds, "bf16") else torch.float16 if enabled(ds, "fp16") else torch.float32
    micro, gas = ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]

    accel = get_accelerator().device_name()
    print(f"{PROG}: DeepSpeed {deepspeed.__version__}, torch {torch.__version__}, transformers "
          f"{transformers.__version__}; accelerator {accel} "
          f"(DS_ACCELERATOR={os.environ.get('DS_ACCELERATOR', 'unset')})")
    print("config    " + json.dumps(ds, separators=(",", ":")))
    if filled:
        print("auto      filled as the HF Trainer does: " + ", ".join(filled))
    params, largest_layer = count_params(cfg, dtype)
    name = a.model or a.model_config
    print(f"model     {name}: {params:,} params, largest layer {largest_layer:,}, {str(dtype).replace('torch.', '')}, "
          f"micro-batch {micro} x gas {gas} x seq {a.seq_len}")
    fields, refusal = estimate(a, ds, params, largest_layer, world, accel)

    summary = {"record": "summary", "status": None, "model": name, "params": params,
               "largest_layer_params": largest_layer, **fields, "accelerator": accel, "micro_batch": micro,
               "gas": gas, "seq_len": a.seq_len, "steps": a.steps, "init_s": None, "tokens_per_s": None,
               "tflops": None, "gpu_peak_bytes": None, "host_peak_bytes": None,
               "deepspeed_version": deepspeed.__version__, "torch_version": torch.__version__,
               "transformers_version": transformers.__version__, "config": ds}
    if refusal:
        records.write(dict(summary, status="refused", reason=refusal))
        fail(refusal, 3)
    if a.dry_run:
        records.write(dict(summary, status="dry-run"))
        print("dry-run   the estimate fits; stopping before deepspeed.initialize")
        return 0

    try:
        summary = train(a, ds, cfg, dtype, params, records, summary)
    except (torch.OutOfMemoryError, MemoryError) as e:
        where = accel if isinstance(e, torch.OutOfMemoryError) else "host"
        first = first_line(e) or type(e).__name__
        msg, code = f"out of {where} memory: {first}", 1
    except ImportError as e:  # a requirement DeepSpeed imports only when it builds an op
        msg, code = f"DeepSpeed cannot run without {e.name or 'a module'} ({type(e).__name__}: {e}); {INSTALL_HINT}", 2
    except Exception as e:
        import traceback
        traceback.print_exc()
        first = first_line(e)
        msg, code = f"the run failed: {type(e).__name__}: {first}", 1
    else:
        records.write(summary)
        return 0
    records.write(dict(summary, status="failed", reason=msg,
                       host_peak_bytes=read_proc_kb("/proc/self/status", "VmHWM")))
    fail(msg, code)


def set_process_group_env():
    """One process, rank 0 of 1, on a free local port: what a launcher would have set."""
    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", str(free_port()))


def build_engine(ds, cfg, dtype, seed):
    """The model and engine as the Trainer builds them under ZeRO-3: (engine, the registered config, which
    transformers holds only a weak reference to, so the caller keeps it alive; how it was registered)."""
    import transformers
    import deepspeed
    from transformers import AutoModelForCausalLM
    transformers.set_seed(seed)  # as the Trainer seeds before it builds a model
    keep_alive, how = register_zero3(copy.deepcopy(ds))
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    if not all(hasattr(p, "ds_id") for p in model.parameters()):
        raise RuntimeError("from_config did not build the model under deepspeed.zero.Init")
    model.config.use_cache = False
    model.gradient_checkpointing_enable()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=copy.deepcopy(ds))
    engine.train()
    return engine, keep_alive, how


def train_step(engine, batches):
    """One optimizer step: GAS micro-batches forward, backward, engine.step(); the mean loss."""
    import torch
    losses = []
    for ids in batches:
        ids = ids.to(engine.device)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach().float())
    return float(torch.stack(losses).mean())


def train(a, ds, cfg, dtype, params, records, summary):
    """The run: init timed, --steps optimizer steps measured; the summary record."""
    import torch
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    set_process_group_env()
    accel = get_accelerator()
    deepspeed.init_distributed()
    print(f"dist      {torch.distributed.get_backend()} on {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}")
    micro, gas = ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]
    tokens_per_step = micro * gas * a.seq_len * int(os.environ["WORLD_SIZE"])
    try:
        t0 = time.perf_counter()
        engine, keep_alive, how = build_engine(ds, cfg, dtype, a.seed)
        accel.synchronize()
        init_s = time.perf_counter() - t0
        print(f"init      {init_s:.1f} s: model built under deepspeed.zero.Init (ZeRO-3 registered with "
              f"transformers through {how}) + deepspeed.initialize")

        gen = torch.Generator().manual_seed(a.seed)
        steps = []
        for step in range(1, a.steps + 1):
            batches = [torch.randint(0, cfg.vocab_size, (micro, a.seq_len), generator=gen) for _ in range(gas)]
            accel.reset_peak_memory_stats()
            accel.synchronize()
            t = time.perf_counter()
            loss = train_step(engine, batches)
            accel.synchronize()
            dt = time.perf_counter() - t
            if engine.global_steps != step:
                raise RuntimeError(f"DeepSpeed counts {engine.global_steps} optimizer steps after {step} x {gas} "
                                   f"micro-batches (gradient_accumulation_steps {gas})")
            tps = tokens_per_step / dt
            r = {"record": "step", "step": step, "time_s": dt, "loss": loss, "tokens_per_s": tps,
                 "tflops": 6 * params * tps / 1e12, "gpu_peak_bytes": int(accel.max_memory_allocated()),
                 "host_peak_bytes": read_proc_kb("/proc/self/status", "VmHWM"),
                 "host_rss_bytes": read_proc_kb("/proc/self/status", "VmRSS"),
                 "skipped_steps": engine.skipped_steps}
            steps.append(r)
            records.write(r)
            print(f"step {step}/{a.steps}  {dt:7.2f} s  loss {loss:.4f}  {tps:10.1f} tokens/s  "
                  f"{r['tflops']:7.3f} TFLOPS  {accel.device_name()} peak {r['gpu_peak_bytes'] / GiB:.2f} GiB  "
                  f"host peak {r['host_peak_bytes'] / GiB:.2f} GiB (rss {r['host_rss_bytes'] / GiB:.2f} GiB)" +
                  (f"  ({engine.skipped_steps} skipped on overflow so far)" if engine.skipped_steps else ""))
        del keep_alive
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()

    timed = steps[1:] if len(steps) > 1 else steps
    tps = statistics.median(s["tokens_per_s"] for s in timed)
    summary = dict(summary, status="ran", init_s=init_s, tokens_per_s=tps, tflops=6 * params * tps / 1e12,
                   gpu_peak_bytes=max(s["gpu_peak_bytes"] for s in steps),
                   host_peak_bytes=read_proc_kb("/proc/self/status", "VmHWM"),
                   losses=[s["loss"] for s in steps], skipped_steps=engine.skipped_steps)
    over = f"steps 2-{len(steps)}" if len(steps) > 1 else "step 1"
    print(f"summary   median over {over}: {tps:.1f} tokens/s, {summary['tflops']:.3f} TFLOPS (6 x {params:,} params); "
          f"init {init_s:.1f} s; {accel.device_name()} peak {summary['gpu_peak_bytes'] / GiB:.2f} GiB, "
          f"host peak {summary['host_peak_bytes'] / GiB:.2f} GiB")
    return summary


if __name__ == "__main__":
    sys.exit(main())

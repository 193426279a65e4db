#!/usr/bin/env python3
"""PEFT + transformers are the oracle of zoffload.lora (docs/training.md, "LoRA adapters").

Per case, transformers saves a tiny model (llama, mistral, qwen2 with its q/k/v biases) and PEFT
makes a LoRA adapter over it with its own initialisation (seeded; in some cases B is then moved off
zero, as an adapter trained before would be) and saves it with save_pretrained. Then
`zoffload train` starts from that directory (zoffload.lora.init_from) and the reference trains the
same PeftModel with torch.optim.AdamW, clipping and gradient accumulation 2 on the same windows
(zoffload.data.shuffle false: file order), for 6 steps:

- every step's loss and gradient norm, and the adapters written by the end-of-run export (PEFT's
  adapter directory), within the fp32 tolerances of hf_parity_test.py;
- the frozen base byte-identical after training (the checkpoint's frozen.safetensors against the
  weights the run started from);
- the exported adapter, loaded by PeftModel.from_pretrained over the base, gives the loss
  zoffload's own model gave on the held-out batches it evaluated after the last step (--eval-data);
- `zoffload export` of the checkpoint writes the same adapter file, and with --merge the merged
  model, which equals PEFT's merge_and_unload;

on every placement of the base (none, cpu, nvme) and ZeRO stages 0 and 3. Then the errors: a
module the model lacks, r 0, lora_dropout, and an init_from adapter that asks for DoRA, each
refused naming its key before anything is written.

Usage: peft_parity_test.py ZOFFLOAD SOURCE_DIR
Exit 77 (skip) when this Python lacks torch, transformers or peft."""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from cli_checks import expect, report_and_exit, reseal

zoffload, source_dir = sys.argv[1], sys.argv[2]
sys.path.insert(0, os.path.join(source_dir, "tools"))  # data_order: zoffload's token files

try:
    import numpy as np
    import torch
    import torch.nn.functional as F
    import transformers
    import peft
    from peft import LoraConfig, PeftModel, get_peft_model
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config
    from data_order import write_llmc
except ImportError as e:
    print("SKIP: PEFT's oracle is not installed in %s (%s); tools/requirements.txt pins it" % (sys.executable, e))
    sys.exit(77)

ZO_ENV = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
torch.set_num_threads(1)

STEPS, GAS, MICRO, SEQ, EVAL_BATCHES = 6, 2, 2, 24, 2
HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS = 64, 160, 2, 4, 2
LR, BETAS, EPS, WEIGHT_DECAY, CLIP = 5e-3, (0.9, 0.95), 1e-8, 0.1, 1.0
# hf_parity_test.py's fp32 tolerances (the same arithmetic with reductions in another order); the
# merged export: W + s·B·A summed in another order than PEFT's matmul, a few ulps of W.
TOL = {"loss": 1e-5, "grad_norm": 1e-5, "weights": 2e-5, "eval": 1e-5, "merged": 1e-6}

CASES = [
    dict(name="llama-none-stage0", arch="llama", tied=True, vocab=256, placement="none", stage=0, r=4, alpha=8,
         targets=["q_proj", "v_proj"], rslora=False, moved_b=False, seed=31),
    dict(name="llama-cpu-stage3-all-linear-rslora", arch="llama", tied=False, vocab=320, placement="cpu", stage=3,
         r=8, alpha=16, targets="all-linear", rslora=True, moved_b=True, seed=32),
    dict(name="mistral-nvme-stage3", arch="mistral", tied=False, vocab=288, placement="nvme", stage=3, r=4,
         alpha=4, targets=["q_proj", "k_proj", "v_proj", "o_proj"], rslora=False, moved_b=True, seed=33),
    dict(name="qwen2-cpu-stage3", arch="qwen2", tied=False, vocab=352, placement="cpu", stage=3, r=4, alpha=12,
         targets=["q_proj", "v_proj", "down_proj"], rslora=False, moved_b=True, seed=34),
    dict(name="qwen2-none-stage0", arch="qwen2", tied=False, vocab=352, placement="none", stage=0, r=2, alpha=8,
         targets=["gate_proj", "up_proj"], rslora=False, moved_b=False, seed=35),
]


def rel(a, b):
    return abs(a - b) / max(abs(b), 1e-12)


def tensor_gap(a, b):
    return ((a.double() - b.double()).norm() / max(b.double().norm().item(), 1e-30)).item()


def save_base(case, model_dir):
    cls = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[case["arch"]]
    config = cls(vocab_size=case["vocab"], hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                 num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                 max_position_embeddings=64, rms_norm_eps=1e-5, initializer_range=0.12,
                 tie_word_embeddings=case["tied"])
    torch.manual_seed(case["seed"])
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.copy_(0.2 * torch.randn_like(p))
    model.save_pretrained(model_dir)


def base_and_adapter(case, work):
    """The case's base model and PEFT's adapter over it, saved under `work`; their directories."""
    model_dir, adapter_dir = os.path.join(work, "model"), os.path.join(work, "adapter")
    os.makedirs(model_dir)
    save_base(case, model_dir)
    save_adapter(case, model_dir, adapter_dir)
    return model_dir, adapter_dir


def lora_config(case):
    return LoraConfig(r=case["r"], lora_alpha=case["alpha"], target_modules=case["targets"], lora_dropout=0.0,
                      use_rslora=case["rslora"], task_type="CAUSAL_LM")


def save_adapter(case, model_dir, adapter_dir):
    """PEFT's own initialisation (A Kaiming-uniform, B zero), seeded; B moved off zero when the case
    says, so that the adapters change the forward from the first step."""
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(case["seed"] + 100)
    model = get_peft_model(base, lora_config(case))
    if case["moved_b"]:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.copy_(0.05 * torch.randn_like(p))
    model.save_pretrained(adapter_dir)


def zo_config(case, lora):
    zero = {"stage": case["stage"], "sub_group_size": 20000, "stage3_gather_16bit_weights_on_model_save": True}
    if case["stage"] == 3:
        zero.update({"stage3_param_persistence_threshold": 200, "stage3_prefetch_bucket_size": 30000})
    if case["placement"] == "cpu":
        zero["offload_param"] = {"device": "cpu"}
        zero["offload_optimizer"] = {"device": "cpu"}
    elif case["placement"] == "nvme":
        zero["offload_param"] = {"device": "nvme", "nvme_path": "nvme", "buffer_count": 4, "buffer_size": 40000}
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": "nvme"}
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS, "gradient_clipping": CLIP,
            "data_types": {"grad_accum_dtype": "fp32"},
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS), "eps": EPS,
                                                      "weight_decay": WEIGHT_DECAY}},
            "zero_optimization": zero,
            "zoffload": {"device": "host", "optimizer_threads": 1, "data": {"shuffle": False},
                         "checkpoint": {"dir": "ckpt"}, "lora": lora}}


def windows(tokens, first, n):
    """zoffload's windows in file order (shuffle false): window w = tokens [wT, wT + T], inputs its
    first T, targets its last T."""
    rows = np.stack([tokens[w * SEQ:w * SEQ + SEQ + 1] for w in range(first, first + n)]).astype(np.int64)
    x = torch.from_numpy(rows)
    return x[:, :-1].contiguous(), x[:, 1:].contiguous()


def loss_of(model, x, y):
    logits = model(input_ids=x, use_cache=False).logits
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1))


def reference_train(case, model_dir, adapter_dir, tokens):
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    model = PeftModel.from_pretrained(base, adapter_dir, is_trainable=True)
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    steps = []
    for step in range(STEPS):
        losses = []
        for micro in range(GAS):
            x, y = windows(tokens, (step * GAS + micro) * MICRO, MICRO)
            loss = loss_of(model, x, y)
            (loss / GAS).backward()
            losses.append(loss.item())
        norm = torch.nn.utils.clip_grad_norm_(trainable, CLIP).item()
        opt.step()
        opt.zero_grad(set_to_none=True)
        steps.append({"loss": sum(losses) / GAS, "grad_norm": norm})
    adapters = {}
    for name, p in model.named_parameters():
        if p.requires_grad:  # base_model.model.….lora_A.default.weight: saved without ".default"
            adapters[name.replace(".default.", ".")] = p.detach().clone()
    return steps, adapters


def read_safetensors(path):
    with safe_open(path, framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def zo_train(case, work, model_dir, lora, data, eval_data, name="run", zoffload_keys=None):
    run = os.path.join(work, name)
    os.makedirs(run)
    cfg_path = os.path.join(run, "ds.json")
    cfg = zo_config(case, lora)
    cfg["zoffload"].update(zoffload_keys or {})
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    args = [zoffload, "train", "--config", cfg_path, "--model", model_dir, "--data", data, "--steps", str(STEPS),
            "--seq-len", str(SEQ), "--out", os.path.join(run, "out"), "--eval-data", eval_data, "--eval-every",
            str(STEPS), "--eval-batches", str(EVAL_BATCHES), "--json"]
    return subprocess.run(args, capture_output=True, text=True, env=ZO_ENV, timeout=600), os.path.join(run, "out")


def run_case(case, tmp):
    name = case["name"]
    t0 = time.time()
    print("%s: %s%s, LoRA r=%d alpha=%g on %s%s, base %s, stage %d" %
          (name, case["arch"], " tied" if case["tied"] else "", case["r"], case["alpha"], case["targets"],
           " (rsLoRA)" if case["rslora"] else "", case["placement"], case["stage"]))
    work = os.path.join(tmp, name)
    model_dir, adapter_dir = base_and_adapter(case, work)
    rng = np.random.default_rng(case["seed"])
    tokens = rng.integers(0, case["vocab"], size=STEPS * GAS * MICRO * SEQ + 1)
    eval_tokens = rng.integers(0, case["vocab"], size=EVAL_BATCHES * MICRO * SEQ + 1)
    data, eval_data = os.path.join(work, "train.bin"), os.path.join(work, "eval.bin")
    write_llmc(data, tokens)
    write_llmc(eval_data, eval_tokens)

    proc, out = zo_train(case, work, model_dir, {"init_from": adapter_dir}, data, eval_data)
    if not expect(proc.returncode == 0, "%s: zoffload train exits 0 (got %d): %s" %
                  (name, proc.returncode, proc.stderr[-3000:])):
        return
    ref_steps, ref_adapters = reference_train(case, model_dir, adapter_dir, tokens)
    zo_steps = read_metrics(out)
    if not expect(len(zo_steps) == STEPS, "%s: %d metrics lines" % (name, len(zo_steps))):
        return
    print("  step  loss zoffload  peft          rel      grad_norm zoffload  peft          rel")
    for i, (z, r) in enumerate(zip(zo_steps, ref_steps)):
        print("  %-4d  %-13.9g  %-13.9g %-7.1e  %-18.9g  %-13.9g %-7.1e" %
              (i + 1, z["loss"], r["loss"], rel(z["loss"], r["loss"]), z["grad_norm"], r["grad_norm"],
               rel(z["grad_norm"], r["grad_norm"])))
        expect(rel(z["loss"], r["loss"]) <= TOL["loss"], "%s step %d: loss %.9g vs PEFT's %.9g" %
               (name, i + 1, z["loss"], r["loss"]))
        expect(rel(z["grad_norm"], r["grad_norm"]) <= TOL["grad_norm"], "%s step %d: grad_norm %.9g vs PEFT's %.9g" %
               (name, i + 1, z["grad_norm"], r["grad_norm"]))

    # The end-of-run export: PEFT's adapter directory, the adapters in fp32.
    export = os.path.join(out, "hf-export-step-%d" % STEPS)
    files = sorted(os.listdir(export)) if os.path.isdir(export) else []
    if not expect({"adapter_config.json", "adapter_model.safetensors"} <= set(files) and
                  "model.safetensors" not in files, "%s: the export is an adapter directory: %s" % (name, files)):
        return
    exported = read_safetensors(os.path.join(export, "adapter_model.safetensors"))
    expect(sorted(exported) == sorted(ref_adapters), "%s: the export names the adapters as PEFT does: %s vs %s" %
           (name, sorted(exported)[:3], sorted(ref_adapters)[:3]))
    worst = max((tensor_gap(exported[k], ref_adapters[k]), k) for k in ref_adapters if k in exported)
    print("  adapters after training: worst relative gap %.1e (%s)" % worst)
    expect(worst[0] <= TOL["weights"], "%s: adapter %s differs from PEFT's by %.1e" % (name, worst[1], worst[0]))
    expect(all(t.dtype == torch.float32 for t in exported.values()), "%s: the adapters are exported in fp32" % name)
    start = read_safetensors(os.path.join(adapter_dir, "adapter_model.safetensors"))
    moved = sum(not torch.equal(exported[k], start[k]) for k in start if k in exported)
    expect(moved == len(start), "%s: training moved every adapter (%d of %d)" % (name, moved, len(start)))

    # The frozen base, byte for byte: the checkpoint's frozen.safetensors holds the weights it started from.
    base = read_safetensors(os.path.join(model_dir, "model.safetensors"))
    ckpt = os.path.join(out, "ckpt", "step-%d" % STEPS)
    frozen = read_safetensors(os.path.join(ckpt, "frozen.safetensors"))
    expect(sorted(frozen) == sorted(base), "%s: frozen.safetensors holds the base (%d tensors, the base %d)" %
           (name, len(frozen), len(base)))
    same = all(torch.equal(frozen[k], base[k]) for k in base if k in frozen)
    print("  base weights after training byte-identical: %s" % ("yes" if same else "NO"))
    expect(same, "%s: the frozen base is unchanged by training" % name)

    # PEFT loads the export over the base and gives the loss zoffload's model gave on the held-out batches.
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                                           export)
    peft_model.eval()
    with torch.no_grad():
        losses = [loss_of(peft_model, *windows(eval_tokens, b * MICRO, MICRO)).item() for b in range(EVAL_BATCHES)]
    peft_eval = sum(losses) / len(losses)
    zo_eval = zo_steps[-1]["eval"]["loss"]
    print("  held-out loss: zoffload %.9g, PEFT over the export %.9g (%.1e)" % (zo_eval, peft_eval, rel(zo_eval, peft_eval)))
    expect(rel(zo_eval, peft_eval) <= TOL["eval"], "%s: PEFT's loss over the exported adapter %.9g, zoffload's %.9g" %
           (name, peft_eval, zo_eval))

    # `zoffload export` of the checkpoint: the same adapter file; with --merge, PEFT's merge_and_unload.
    again = os.path.join(work, "adapter-again")
    p = subprocess.run([zoffload, "export", "--checkpoint", os.path.join(out, "ckpt"), "--dtype", "fp32", "--out",
                        again, "-q"], capture_output=True, text=True, env=ZO_ENV)
    if expect(p.returncode == 0, "%s: zoffload export: %s" % (name, p.stderr[-2000:])):
        with open(os.path.join(again, "adapter_model.safetensors"), "rb") as f1, \
                open(os.path.join(export, "adapter_model.safetensors"), "rb") as f2:
            expect(f1.read() == f2.read(), "%s: the checkpoint's adapter export equals the run's" % name)
    merged_dir = os.path.join(work, "merged")
    p = subprocess.run([zoffload, "export", "--checkpoint", os.path.join(out, "ckpt"), "--dtype", "fp32", "--merge",
                        "--out", merged_dir, "--json"], capture_output=True, text=True, env=ZO_ENV)
    if expect(p.returncode == 0, "%s: zoffload export --merge: %s" % (name, p.stderr[-2000:])):
        expect(json.loads(p.stdout)["format"] == "merged", "%s: --json says merged" % name)
        merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).state_dict()
        want = peft_model.merge_and_unload().state_dict()
        expect(sorted(merged) == sorted(want), "%s: the merged export has the base's tensors" % name)
        worst = max((tensor_gap(merged[k], want[k]), k) for k in want if k in merged)
        changed = sum(not torch.equal(want[k], base[k]) for k in base if k in want)
        print("  merged export vs merge_and_unload: worst relative gap %.1e (%s); %d weights adapted" %
              (worst[0], worst[1], changed))
        expect(worst[0] <= TOL["merged"], "%s: merged %s differs from PEFT's merge by %.1e" % (name, worst[1], worst[0]))
        expect(changed > 0, "%s: the merge changed the adapted weights" % name)
    print("  %.1f s" % (time.time() - t0))


def check_errors(tmp):
    """Bad LoRA settings: refused naming the key, before a step or a file."""
    case = CASES[0]
    work = os.path.join(tmp, "errors")
    model_dir, adapter_dir = base_and_adapter(case, work)
    data = os.path.join(work, "train.bin")
    write_llmc(data, np.arange(2000) % case["vocab"])
    dora = os.path.join(work, "dora")
    os.makedirs(dora)
    with open(os.path.join(adapter_dir, "adapter_config.json")) as f:
        cfg = json.load(f)
    cfg["use_dora"] = True
    with open(os.path.join(dora, "adapter_config.json"), "w") as f:
        json.dump(cfg, f)
    for i, (lora, key, words) in enumerate([
            ({"r": 4, "target_modules": ["q_proj", "qkv_proj"]}, "zoffload.lora.target_modules", "qkv_proj"),
            ({"r": 0, "target_modules": ["q_proj"]}, "zoffload.lora.r", "at least 1"),
            ({"r": 4, "lora_dropout": 0.05}, "zoffload.lora.lora_dropout", "must be 0"),
            ({"lora_alpha": 16}, "zoffload.lora.r", "needed"),
            ({"init_from": dora}, "zoffload.lora.init_from", "use_dora"),
            ({"init_from": adapter_dir, "r": 8}, "zoffload.lora.r", "leave r out")]):
        p, out = zo_train(case, work, model_dir, lora, data, data, name="bad-%d" % i)
        expect(p.returncode != 0 and key in p.stderr and words in p.stderr,
               "zoffload.lora %s: refused naming %s (%r): rc %d, %s" % (lora, key, words, p.returncode, p.stderr[-800:]))
        expect(not os.path.exists(os.path.join(out, "metrics.jsonl")), "zoffload.lora %s: no step taken" % lora)
    print("errors: each bad zoffload.lora refused by key")


def write_json(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f)


def adapter_variant(adapter_dir, work, name, config_edit=None, tensor_edit=None):
    """A copy of `adapter_dir` with its adapter_config.json and tensors changed as a user's might be."""
    from safetensors.torch import save_file
    out = os.path.join(work, name)
    os.makedirs(out)
    with open(os.path.join(adapter_dir, "adapter_config.json")) as f:
        cfg = json.load(f)
    if config_edit:
        config_edit(cfg)
    write_json(os.path.join(out, "adapter_config.json"), cfg)
    tensors = read_safetensors(os.path.join(adapter_dir, "adapter_model.safetensors"))
    if tensor_edit:
        tensor_edit(tensors)
    save_file(tensors, os.path.join(out, "adapter_model.safetensors"), metadata={"format": "pt"})
    return out


def check_hostile_adapters(tmp):
    """Adapters and settings PEFT reads otherwise than plain LoRA over the base as it is (issue 60):
    each either trains as PEFT computes it or is refused naming its key, before a step."""
    case = dict(CASES[0], moved_b=True)  # B off zero: the adapters change the forward from step 1
    work = os.path.join(tmp, "hostile")
    model_dir, adapter_dir = base_and_adapter(case, work)
    rng = np.random.default_rng(7)
    tokens = rng.integers(0, case["vocab"], size=STEPS * GAS * MICRO * SEQ + 1)
    data = os.path.join(work, "train.bin")
    write_llmc(data, tokens)

    def peft_first_loss(adapter):
        m = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), adapter)
        m.eval()
        with torch.no_grad():
            return sum(loss_of(m, *windows(tokens, k * MICRO, MICRO)).item() for k in range(GAS)) / GAS

    def first_loss(out):
        with open(os.path.join(out, "metrics.jsonl")) as f:
            return json.loads(f.readline())["loss"]

    def refused(lora, name, key, *words):
        p, out = zo_train(case, work, model_dir, lora, data, data, name="refused-" + name)
        ok = p.returncode == 2 and key in p.stderr and all(w in p.stderr for w in words) and \
            not os.path.exists(os.path.join(out, "metrics.jsonl"))
        expect(ok, "%s: refused naming %s %s: rc %d, %s" % (name, key, words, p.returncode, p.stderr[-800:]))

    # PiSSA as PEFT makes it: PEFT rebuilds the residual base W - s·B0·A0 when it loads the adapter,
    # so the same tensors read as plain LoRA give another model.
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    pissa_cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights="pissa",
                           task_type="CAUSAL_LM")
    pissa = os.path.join(work, "pissa")
    get_peft_model(base, pissa_cfg).save_pretrained(pissa)
    as_plain = adapter_variant(pissa, work, "pissa-as-plain", lambda c: c.update(init_lora_weights=True))
    gap = rel(peft_first_loss(pissa), peft_first_loss(as_plain))
    print("hostile: PiSSA's loss in PEFT vs its tensors read as plain LoRA: %.1e apart" % gap)
    expect(gap > 1e-4, "PEFT computes a PiSSA adapter otherwise than plain LoRA (%.1e)" % gap)
    refused({"init_from": pissa}, "pissa", "zoffload.lora.init_from", "init_lora_weights", "pissa")
    for init in ("olora", "corda", "loftq", "lora_ga", "mica", "pissa_niter_4"):
        variant = adapter_variant(adapter_dir, work, "init-" + init, lambda c, i=init: c.update(init_lora_weights=i))
        refused({"init_from": variant}, "init-" + init, "init_lora_weights", init)

    # EVA and orthogonal initialisations only draw the first A and B otherwise: PEFT loads their saved
    # adapters as plain LoRA, and so does zoffload.
    p, out = zo_train(case, work, model_dir, {"init_from": adapter_dir}, data, data, name="plain")
    plain_peft = peft_first_loss(adapter_dir)
    for init in ("eva", "orthogonal"):
        variant = adapter_variant(adapter_dir, work, "init-" + init, lambda c, i=init: c.update(init_lora_weights=i))
        peft_loss = peft_first_loss(variant)
        p, out = zo_train(case, work, model_dir, {"init_from": variant}, data, data, name="run-" + init)
        if expect(p.returncode == 0, "%s adapter trains: %s" % (init, p.stderr[-800:])):
            print("hostile: %s: PEFT's step-1 loss %.9g (plain %.9g), zoffload's %.9g" %
                  (init, peft_loss, plain_peft, first_loss(out)))
            expect(peft_loss == plain_peft and rel(first_loss(out), peft_loss) <= TOL["loss"],
                   "%s: PEFT's loss %.9g (plain %.9g) and zoffload's %.9g agree" %
                   (init, peft_loss, plain_peft, first_loss(out)))

    # Scales, dropout and targets PEFT reads otherwise, or that a config contradicts.
    refused({"init_from": adapter_variant(adapter_dir, work, "rslora-string", lambda c: c.update(use_rslora="true"))},
            "rslora-string", "use_rslora", "PEFT reads any non-empty string as true")
    dropout = adapter_variant(adapter_dir, work, "dropout", lambda c: c.update(lora_dropout=0.1))
    refused({"init_from": dropout}, "dropout", "lora_dropout is 0.1", "set zoffload.lora.lora_dropout to 0")
    p, out = zo_train(case, work, model_dir, {"init_from": dropout, "lora_dropout": 0}, data, data, name="no-dropout")
    expect(p.returncode == 0 and rel(first_loss(out), plain_peft) <= TOL["loss"],
           "an adapter saved with dropout trains without it when the config says lora_dropout 0: %s" % p.stderr[-600:])
    refused({"init_from": adapter_dir, "lora_alpha": 16}, "alpha-given", "zoffload.lora.lora_alpha", "has lora_alpha 8")
    refused({"init_from": adapter_dir, "use_rslora": True}, "rslora-given", "zoffload.lora.use_rslora")
    layer0 = os.path.join(work, "layer0")
    get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                   LoraConfig(r=4, lora_alpha=8, target_modules=["model.layers.0.self_attn.q_proj", "v_proj"],
                              task_type="CAUSAL_LM")).save_pretrained(layer0)
    refused({"init_from": layer0}, "layer0", "target_modules adapts q_proj on 1 of the model's 2 layers")
    # A target_modules string other than "all-linear" is PEFT's regular expression, which a module's
    # whole qualified name must match: read so, under the same every-layer-or-none rule.
    regex = adapter_variant(adapter_dir, work, "regex", lambda c: c.update(target_modules=r".*\.(q_proj|v_proj)"))
    peft_loss = peft_first_loss(regex)
    p, out = zo_train(case, work, model_dir, {"init_from": regex}, data, data, name="run-regex")
    if expect(p.returncode == 0, "a regular-expression target_modules trains: %s" % p.stderr[-800:]):
        print("hostile: regex target_modules: PEFT's step-1 loss %.9g (list %.9g), zoffload's %.9g" %
              (peft_loss, plain_peft, first_loss(out)))
        expect(peft_loss == plain_peft and rel(first_loss(out), peft_loss) <= TOL["loss"],
               "regex target_modules: PEFT's loss %.9g (list %.9g) and zoffload's %.9g agree" %
               (peft_loss, plain_peft, first_loss(out)))
    regex0 = adapter_variant(adapter_dir, work, "regex-layer0",
                             lambda c: c.update(target_modules=r".*layers\.0\.self_attn\.(q_proj|v_proj)"))
    refused({"init_from": regex0}, "regex-layer0", "target_modules adapts q_proj on 1 of the model's 2 layers")
    refused({"init_from": adapter_variant(adapter_dir, work, "regex-bad", lambda c: c.update(target_modules="(q_proj"))},
            "regex-bad", "zoffload.lora.init_from", "does not compile")
    refused({"init_from": adapter_variant(adapter_dir, work, "regex-none", lambda c: c.update(target_modules="lm_head"))},
            "regex-none", "zoffload.lora.init_from", "matches none of this llama model's decoder projections")

    # Values no forward survives.
    def set_first(name_part, value):
        def edit(tensors):
            k = sorted(n for n in tensors if name_part in n)[0]
            tensors[k].view(-1)[3] = value
        return edit
    for name, edit, words in (("a-nan", set_first("lora_A", float("nan")), ("lora_A", "nan", "element 3")),
                              ("b-inf", set_first("lora_B", float("inf")), ("lora_B", "inf", "element 3")),
                              ("b-huge", set_first("lora_B", 3e38), ("can add up to", "overflow"))):
        refused({"init_from": adapter_variant(adapter_dir, work, name, tensor_edit=edit)}, name,
                "zoffload.lora.init_from", *words)
    refused({"init_from": adapter_variant(adapter_dir, work, "alpha-huge", lambda c: c.update(lora_alpha=1e308))},
            "alpha-huge", "lora_alpha must be a number > 0 and at most 3.4e38")
    refused({"r": 4, "lora_alpha": 1e308}, "config-alpha-huge", "zoffload.lora.lora_alpha")

    # A checkpoint resumed with another scale, and exported with a trainer_state that lies about r.
    p, out = zo_train(case, work, model_dir, {"init_from": adapter_dir}, data, data, name="to-resume")
    if expect(p.returncode == 0, "the run to resume trains: %s" % p.stderr[-600:]):
        ckpt = os.path.join(out, "ckpt")
        cfg_path = os.path.join(work, "to-resume", "ds.json")
        cfg = json.load(open(cfg_path))
        cfg["zoffload"]["lora"] = {"r": 4, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}
        write_json(cfg_path, cfg)
        p = subprocess.run([zoffload, "train", "--config", cfg_path, "--model", model_dir, "--data", data, "--steps",
                            str(STEPS + 1), "--seq-len", str(SEQ), "--out", out, "--resume", "latest"],
                           capture_output=True, text=True, env=ZO_ENV)
        expect(p.returncode == 2 and "lora_alpha 8, not 16" in p.stderr,
               "a resume with another lora_alpha is refused: rc %d, %s" % (p.returncode, p.stderr[-600:]))
        step = os.path.join(ckpt, "step-%d" % STEPS)
        for r in (0, 8):
            edited = os.path.join(work, "r%d" % r, "step-%d" % STEPS)
            shutil.copytree(step, edited)
            state = json.load(open(os.path.join(edited, "trainer_state.json")))
            state["config"]["zoffload"]["lora"]["r"] = r
            with open(os.path.join(edited, "trainer_state.json"), "w") as f:
                f.write(json.dumps(state, indent=2, sort_keys=True) + "\n")
            reseal(edited, "trainer_state.json")
            p = subprocess.run([zoffload, "export", "--checkpoint", edited, "--dtype", "fp32", "--out",
                                os.path.join(work, "export-r%d" % r)], capture_output=True, text=True, env=ZO_ENV)
            expect(p.returncode == 1 and "does not describe it" in p.stderr and
                   not os.path.exists(os.path.join(work, "export-r%d" % r)),
                   "an export whose trainer_state says r %d is refused: rc %d, %s" % (r, p.returncode, p.stderr[-600:]))
    print("hostile: every adapter PEFT reads otherwise refused by key, the plain ones trained as PEFT computes them")


def read_metrics(out):
    """The run's metrics.jsonl, one dict a step."""
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def worst_gap(zo_steps, ref_steps):
    """The largest relative gap of zoffload's loss or gradient norm to the reference's, step by step."""
    return max(max(rel(z["loss"], r["loss"]), rel(z["grad_norm"], r["grad_norm"])) for z, r in zip(zo_steps, ref_steps))


def blob_bytes(rows, cols, int8=False):
    """A packed weight's bytes (common/bnb4_blob.h): header, codes (4-bit: two a byte; 8-bit: one) and
    fp32 scales (4-bit: an absmax per 64; 8-bit: one per row), each 16-aligned."""
    a16 = lambda x: (x + 15) // 16 * 16
    n = rows * cols
    if int8:
        return a16(32 + a16(n) + 4 * rows)
    return a16(32 + a16((n + 1) // 2) + 4 * ((n + 63) // 64))


def step_h2d(steps):
    """The bytes each step copied to the device, from the cumulative counter (the steps before the
    last, whose count includes the evaluation)."""
    h2d = [m["memory"]["h2d_bytes"] for m in steps]
    return [b - a for a, b in zip(h2d, h2d[1:-1])]


def check_packed_bytes(case, work, model_dir, adapter_dir, data, packed_steps, int8=False):
    """The packed base is what crosses PCIe: a step over it copies fewer bytes than the same step over
    the 16-bit base by at least each projection's 16-bit bytes less its blob's (every projection is
    fetched at least once a step; the schedule is the same)."""
    from safetensors import safe_open
    kind = "8-bit" if int8 else "NF4"
    proc, out = zo_train(case, work, model_dir, {"init_from": adapter_dir}, data, data,
                         name="run-16bit" + ("-int8" if int8 else ""))
    if not expect(proc.returncode == 0, "qlora: the same run over the 16-bit base: %s" % proc.stderr[-1000:]):
        return
    full = step_h2d(read_metrics(out))
    packed = step_h2d(packed_steps)
    with safe_open(os.path.join(model_dir, "model.safetensors"), "pt") as f:
        sizes = [f.get_slice(k).get_shape() for k in f.keys() if k.endswith("_proj.weight")]
    saving = sum(4 * a * b - blob_bytes(a, b, int8) for a, b in sizes)  # fp32 compute
    print("qlora: a step copies %d bytes to the device over the %s base, %d over the 16-bit base (%.2fx); "
          "the projections alone save at least %d" % (packed[0], kind, full[0], packed[0] / full[0], saving))
    expect(len(packed) == len(full) and all(f - p >= saving for p, f in zip(packed, full)),
           "qlora %s: each step copies the blobs, not the 16-bit weights (%s against %s)" % (kind, packed, full))


def check_qlora_exports(qdir, out, ref_adapters, tokens, zo_steps, work, int8=False):
    """The QLoRA run's exports: the end-of-run adapter equals PEFT's trained over the quantized base,
    PEFT over that base and that adapter gives zoffload's held-out loss, and `zoffload export --merge`
    of the run's checkpoint (whose frozen file holds the packed blobs) writes each weight as
    bitsandbytes reads it back plus s·B·A — a 16-bit model, not merge_and_unload's re-quantized one.
    An 8-bit base is evaluated in PEFT's training mode (no dropout: the same forward): bitsandbytes'
    eval mode on the CPU runs LLM.int8's int8 matmul (MatMul8bitLt), which rounds the activations to
    int8, where zoffload computes as its training path does, over the dequantized weights."""
    import bitsandbytes.functional as bnbf
    kind = "8-bit" if int8 else "4-bit"
    export = os.path.join(out, "hf-export-step-%d" % STEPS)
    exported = read_safetensors(os.path.join(export, "adapter_model.safetensors"))
    worst = max((tensor_gap(exported[k], ref_adapters[k]), k) for k in ref_adapters if k in exported)
    print("qlora: the exported adapter against PEFT's over the %s base: worst %.1e (%s)" % ((kind,) + worst))
    expect(sorted(exported) == sorted(ref_adapters) and worst[0] <= 1e-3,
           "qlora %s: the exported adapter within 1e-3 of PEFT's (worst %.1e)" % (kind, worst[0]))
    base = AutoModelForCausalLM.from_pretrained(qdir, dtype=torch.float32, device_map="cpu")
    peft_model = PeftModel.from_pretrained(base, export)
    if int8:
        peft_model.train()
    else:
        peft_model.eval()
    with torch.no_grad():
        losses = [loss_of(peft_model, *windows(tokens, b * MICRO, MICRO)).item() for b in range(EVAL_BATCHES)]
    peft_eval, zo_eval = sum(losses) / len(losses), zo_steps[-1]["eval"]["loss"]
    print("qlora: held-out loss: zoffload %.9g, PEFT over the %s base and the export %.9g (%.1e)" %
          (zo_eval, kind, peft_eval, rel(zo_eval, peft_eval)))
    expect(rel(zo_eval, peft_eval) <= TOL["eval"], "qlora %s: PEFT's held-out loss over the export %.9g, zoffload's "
           "%.9g" % (kind, peft_eval, zo_eval))
    merged_dir = os.path.join(work, "qlora-merged" + ("-int8" if int8 else ""))
    p = subprocess.run([zoffload, "export", "--checkpoint", os.path.join(out, "ckpt"), "--dtype", "fp32", "--merge",
                        "--out", merged_dir, "--json"], capture_output=True, text=True, env=ZO_ENV)
    if not expect(p.returncode == 0, "qlora: zoffload export --merge of the checkpoint: %s" % p.stderr[-2000:]):
        return
    merged = read_safetensors(os.path.join(merged_dir, "model.safetensors"))
    want = {}
    for name, module in peft_model.base_model.model.named_modules():
        weight = getattr(module, "weight", None)
        if weight is None or ".lora_" in name or name.endswith(".base_layer"):
            continue
        if hasattr(weight, "quant_state"):
            w = bnbf.dequantize_4bit(weight.data, weight.quant_state).float()
        elif weight.dtype == torch.int8:  # MatMul8bitFp's weight in fp32, from Linear8bitLt's SCB
            layer = module.get_base_layer() if hasattr(module, "get_base_layer") else module
            scb = layer.state.SCB if layer.state.SCB is not None else weight.SCB
            w = weight.data.to(torch.float32).mul_(scb.unsqueeze(1).mul(1.0 / 127.0))
        else:
            want[name + ".weight"] = weight.detach().float()
            continue
        if hasattr(module, "get_delta_weight"):
            w = w + module.get_delta_weight("default").float()
        want[name + ".weight"] = w
    projections = [k for k in want if k.endswith("_proj.weight")]
    worst = max((tensor_gap(merged[k], want[k]) if k in want else float("inf"), k) for k in merged)
    print("qlora: the merged export against bitsandbytes' %s base read back + s·B·A: worst %.1e (%s)" %
          ((kind,) + worst))
    expect(all(k in merged for k in projections) and worst[0] <= TOL["merged"],
           "qlora %s: the merged export holds the dequantized weights plus the adapters (worst %.1e; %d tensors, "
           "%d projections)" % (kind, worst[0], len(merged), len(projections)))


def save_quantized(model_dir, out_dir, qtype, double):
    """The model transformers loads from model_dir with BitsAndBytesConfig(load_in_4bit) on the CPU,
    saved to out_dir: a 4-bit directory as the Hub's …-bnb-4bit ones are."""
    from transformers import BitsAndBytesConfig
    quantized = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, device_map="cpu",
        quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=qtype,
                                               bnb_4bit_use_double_quant=double, bnb_4bit_compute_dtype=torch.float32))
    quantized.save_pretrained(out_dir)


def save_quantized_8bit(model_dir, out_dir):
    """The model transformers loads from model_dir with BitsAndBytesConfig(load_in_8bit) on the CPU,
    saved to out_dir: an 8-bit (LLM.int8) directory as the Hub's …-8bit ones are."""
    from transformers import BitsAndBytesConfig
    quantized = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, device_map="cpu",
                                                     quantization_config=BitsAndBytesConfig(load_in_8bit=True))
    quantized.save_pretrained(out_dir)


def check_qlora_8bit(case, work, model_dir, adapter_dir, tokens, data):
    """An 8-bit (LLM.int8) base as transformers saves it: zoffload keeps its int8 codes and row scales
    packed, dequantizes them into the weights bitsandbytes' training path computes with, and trains
    LoRA over them as PEFT does over Linear8bitLt on the CPU, pinned at stage 3; each step moves the
    blobs; the exports as check_qlora_exports says. Damaged states and contradicting settings are
    refused by name before a step."""
    qdir = os.path.join(work, "base-int8")
    save_quantized_8bit(model_dir, qdir)
    placed = dict(case, placement="cpu", stage=3)
    proc, out = zo_train(placed, work, qdir, {"init_from": adapter_dir}, data, data, name="run-int8")
    if expect(proc.returncode == 0, "qlora 8-bit: zoffload trains over the 8-bit base: %s" % proc.stderr[-2000:]):
        summary = json.loads(proc.stdout)
        weights, size = summary["packed_base_weights"], summary["packed_base_bytes"]
        expect(weights > 0 and weights < size < 1.2 * weights,
               "qlora 8-bit: the run's --json says its base is packed, a byte a weight and its rows' scales: %d "
               "weights in %d bytes" % (weights, size))
        ref_steps, ref_adapters = reference_train(case, qdir, adapter_dir, tokens)
        zo_steps = read_metrics(out)
        worst = worst_gap(zo_steps, ref_steps)
        print("qlora 8-bit, base pinned at stage 3: %d steps, losses %.9g .. %.9g, PEFT + bitsandbytes %.9g .. %.9g, "
              "worst rel %.1e" % (len(zo_steps), zo_steps[0]["loss"], zo_steps[-1]["loss"], ref_steps[0]["loss"],
                                  ref_steps[-1]["loss"], worst))
        expect(len(zo_steps) == STEPS and worst <= TOL["loss"],
               "qlora 8-bit: losses and gradient norms within %g of PEFT over bitsandbytes' Linear8bitLt (worst %.1e)"
               % (TOL["loss"], worst))
        check_packed_bytes(placed, work, model_dir, adapter_dir, data, zo_steps, int8=True)
        check_qlora_exports(qdir, out, ref_adapters, tokens, zo_steps, work, int8=True)

    def variant(name, tensors_edit=None, config_edit=None):
        return edited_copy(qdir, os.path.join(work, "bad-int8-" + name), tensors_edit, config_edit)

    def refused(name, base, *words, keys=None):
        p, out = zo_train(case, work, base, {"init_from": adapter_dir}, data, data, name="refused-int8-" + name,
                          zoffload_keys=keys)
        expect(p.returncode != 0 and all(w in p.stderr for w in words) and
               not os.path.exists(os.path.join(out, "metrics.jsonl")),
               "qlora 8-bit %s: refused naming %s before a step: rc %d, %s" % (name, words, p.returncode,
                                                                               p.stderr[-800:]))

    q_proj = "model.layers.1.self_attn.q_proj"
    refused("no-scb", variant("no-scb", lambda t: t.pop(q_proj + ".SCB")), q_proj + ".weight",
            "has no " + q_proj + ".SCB")
    refused("short-scb", variant("short-scb", lambda t: t.update({q_proj + ".SCB": t[q_proj + ".SCB"][:-1]})),
            q_proj + ".SCB", "one per row")
    refused("format", variant("format", lambda t: t.update({q_proj + ".weight_format": torch.tensor(1, dtype=torch.uint8)})),
            q_proj + ".weight_format", "row-major")
    refused("codes-16bit", variant("codes-16bit", lambda t: t.update({q_proj + ".weight": t[q_proj + ".weight"].float()})),
            q_proj + ".weight", "I8")
    refused("fp16-weight", variant("fp16-weight", config_edit=lambda c: c["quantization_config"].update(
        llm_int8_has_fp16_weight=True)), "quantization_config.llm_int8_has_fp16_weight")
    refused("says-4bit", variant("says-4bit", config_edit=lambda c: c["quantization_config"].update(
        load_in_8bit=False, _load_in_8bit=False, load_in_4bit=True, _load_in_4bit=True)),
        "model.layers.0.self_attn.q_proj.weight", "is bitsandbytes 8-bit", "says 4-bit")
    refused("quantize-base", qdir, "zoffload.quantize_base", "already a bitsandbytes 8-bit checkpoint",
            keys={"quantize_base": "nf4"})
    print("qlora 8-bit: damaged states and contradicting settings refused by name")


def edited_copy(src, out, tensors_edit=None, config_edit=None):
    """A copy of the model directory src at out, its tensors and config.json edited."""
    from safetensors.torch import load_file, save_file
    shutil.copytree(src, out)
    if tensors_edit:
        tensors = load_file(os.path.join(out, "model.safetensors"))
        tensors_edit(tensors)
        save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    if config_edit:
        with open(os.path.join(out, "config.json")) as f:
            cfg = json.load(f)
        config_edit(cfg)
        write_json(os.path.join(out, "config.json"), cfg)
    return out


def check_qlora(tmp):
    """A bitsandbytes 4-bit base as transformers saves it (issue 63): zoffload keeps the packed codes
    packed (Note [The packed 4-bit base]), dequantizes them into the weights bitsandbytes' Linear4bit
    computes with, and trains LoRA over them as PEFT does over that model on the CPU, step for step:
    NF4 double-quantized pinned at stage 3, FP4 from NVMe, FP4 quantized at load on the device, and
    NF4 over qwen2 and qwen3 bases. Each step moves the blobs (fewer bytes than over the 16-bit base
    by the projections' difference at least); the exported adapter matches PEFT's, PEFT over the
    4-bit base and it gives zoffload's held-out loss, and the merged export of the checkpoint holds
    the dequantized base plus s·B·A. A damaged quantization state or a config it does not know is
    refused by name before a step. Then the same over an 8-bit base (check_qlora_8bit)."""
    case = dict(CASES[0], moved_b=True, name="qlora")
    work = os.path.join(tmp, "qlora")
    model_dir, adapter_dir = base_and_adapter(case, work)
    rng = np.random.default_rng(case["seed"])
    tokens = rng.integers(0, case["vocab"], size=STEPS * GAS * MICRO * SEQ + 1)
    data = os.path.join(work, "train.bin")
    write_llmc(data, tokens)
    # Each on its own placement of the packed base (Note [The packed 4-bit base]): NF4 double-quantized
    # pinned and fetched at stage 3, FP4 fetched from NVMe, FP4 quantized at load and kept on the device.
    runs = (("nf4", True, "cpu", 3), ("fp4", False, "nvme", 3))
    for qtype, double, placement, stage in runs:
        qdir = os.path.join(work, "base-" + qtype)
        save_quantized(model_dir, qdir, qtype, double)
        placed = dict(case, placement=placement, stage=stage)
        # NF4: with zoffload.quantize_base "nf4" too, which a directory already NF4 trains as stored.
        proc, out = zo_train(placed, work, qdir, {"init_from": adapter_dir}, data, data, name="run-" + qtype,
                             zoffload_keys={"quantize_base": "nf4"} if double else None)
        if not expect(proc.returncode == 0, "qlora %s: zoffload trains over the 4-bit base: %s" %
                      (qtype, proc.stderr[-2000:])):
            continue
        summary = json.loads(proc.stdout)
        expect(summary["packed_base_weights"] > 0 and 0 < summary["packed_base_bytes"] < summary["packed_base_weights"],
               "qlora %s: the run's --json says its base is packed, under a byte a weight: %s" %
               (qtype, {k: v for k, v in summary.items() if k.startswith("packed")}))
        ref_steps, ref_adapters = reference_train(case, qdir, adapter_dir, tokens)
        zo_steps = read_metrics(out)
        worst = worst_gap(zo_steps, ref_steps)
        print("qlora %s%s, base on %s: %d steps, losses %.9g .. %.9g, PEFT + bitsandbytes %.9g .. %.9g, worst rel %.1e" %
              (qtype, " double-quantized" if double else "", placement, len(zo_steps), zo_steps[0]["loss"],
               zo_steps[-1]["loss"], ref_steps[0]["loss"], ref_steps[-1]["loss"], worst))
        expect(len(zo_steps) == STEPS and worst <= TOL["loss"],
               "qlora %s: losses and gradient norms within %g of PEFT over bitsandbytes' Linear4bit (worst %.1e)" %
               (qtype, TOL["loss"], worst))
        if double:
            check_packed_bytes(placed, work, model_dir, adapter_dir, data, zo_steps)
            check_qlora_exports(qdir, out, ref_adapters, tokens, zo_steps, work)
            continue
        # zoffload.quantize_base: the same quantization of the 16-bit directory, at load.
        proc, out = zo_train(case, work, model_dir, {"init_from": adapter_dir}, data, data, name="at-load-" + qtype,
                             zoffload_keys={"quantize_base": qtype})
        if expect(proc.returncode == 0, "qlora %s at load: %s" % (qtype, proc.stderr[-2000:])):
            at_load = read_metrics(out)
            worst = worst_gap(at_load, ref_steps)
            print("qlora %s quantized at load (zoffload.quantize_base), base on the device: worst rel %.1e against "
                  "PEFT over the model transformers quantized" % (qtype, worst))
            expect(len(at_load) == STEPS and worst <= TOL["loss"],
                   "qlora %s at load: within %g of PEFT over bitsandbytes (worst %.1e)" % (qtype, TOL["loss"], worst))

    # The other families: qwen2 (q/k/v biases) and qwen3 (per-head q/k norms), NF4 double-quantized,
    # each with its own base and PEFT adapter, the base pinned at stage 3.
    for extra in (dict(CASES[3], name="qlora-qwen2"),
                  dict(CASES[3], name="qlora-qwen3", arch="qwen3", vocab=320, seed=36, targets="all-linear")):
        fwork = os.path.join(tmp, extra["name"])
        fmodel, fadapter = base_and_adapter(extra, fwork)
        fdir = os.path.join(fwork, "base-nf4")
        save_quantized(fmodel, fdir, "nf4", True)
        ftokens = np.random.default_rng(extra["seed"]).integers(0, extra["vocab"], size=STEPS * GAS * MICRO * SEQ + 1)
        fdata = os.path.join(fwork, "train.bin")
        write_llmc(fdata, ftokens)
        proc, out = zo_train(extra, fwork, fdir, {"init_from": fadapter}, fdata, fdata, name="run-nf4")
        if not expect(proc.returncode == 0, "%s: zoffload trains over the 4-bit base: %s" %
                      (extra["name"], proc.stderr[-2000:])):
            continue
        ref_steps, _ = reference_train(extra, fdir, fadapter, ftokens)
        zo_steps = read_metrics(out)
        worst = worst_gap(zo_steps, ref_steps)
        print("%s nf4 double-quantized: %d steps, worst rel %.1e against PEFT over bitsandbytes" %
              (extra["name"], len(zo_steps), worst))
        expect(len(zo_steps) == STEPS and worst <= TOL["loss"],
               "%s: losses and gradient norms within %g of PEFT over Linear4bit (worst %.1e)" %
               (extra["name"], TOL["loss"], worst))

    qdir = os.path.join(work, "base-nf4")

    def variant(name, tensors_edit=None, config_edit=None):
        return edited_copy(qdir, os.path.join(work, "bad-" + name), tensors_edit, config_edit)

    def refused(name, base, *words):
        p, out = zo_train(case, work, base, {"init_from": adapter_dir}, data, data, name="refused-" + name)
        expect(p.returncode != 0 and all(w in p.stderr for w in words) and
               not os.path.exists(os.path.join(out, "metrics.jsonl")),
               "qlora %s: refused naming %s before a step: rc %d, %s" % (name, words, p.returncode, p.stderr[-800:]))

    q_proj = "model.layers.1.self_attn.q_proj.weight"
    refused("no-state", variant("no-state", lambda t: t.pop(q_proj + ".quant_state.bitsandbytes__nf4")),
            q_proj, "has no 4-bit quantization state")
    refused("no-absmax", variant("no-absmax", lambda t: t.pop(q_proj + ".absmax")), q_proj + ".absmax")
    refused("short-absmax", variant("short-absmax", lambda t: t.update({q_proj + ".absmax": t[q_proj + ".absmax"][:-1]})),
            q_proj + ".absmax", "U8 codes")
    refused("short-codes", variant("short-codes", lambda t: t.update({q_proj: t[q_proj][:-1]})), q_proj, "packed codes")
    refused("quant-type", variant("quant-type", config_edit=lambda c: c["quantization_config"].update(bnb_4bit_quant_type="int4")),
            "quantization_config.bnb_4bit_quant_type")
    refused("4-and-8-bit", variant("4-and-8-bit", config_edit=lambda c: c["quantization_config"].update(load_in_8bit=True)),
            "quantization_config.load_in_8bit", "both true")
    refused("unknown-key", variant("unknown-key", config_edit=lambda c: c["quantization_config"].update(bnb_4bit_new_thing=True)),
            "quantization_config.bnb_4bit_new_thing")
    refused("no-method", variant("no-method", config_edit=lambda c: c["quantization_config"].clear()),
            "quantization_config.quant_method")
    refused("config-says-16", variant("config-says-16", config_edit=lambda c: c.pop("quantization_config")),
            "is bitsandbytes 4-bit", "no quantization_config")
    p, out = zo_train(case, work, qdir, {"init_from": adapter_dir}, data, data, name="refused-twice",
                      zoffload_keys={"quantize_base": "fp4"})
    expect(p.returncode != 0 and "already a bitsandbytes 4-bit checkpoint in nf4" in p.stderr and
           not os.path.exists(os.path.join(out, "metrics.jsonl")),
           "qlora: quantize_base fp4 over an NF4 directory refused: rc %d, %s" % (p.returncode, p.stderr[-600:]))
    p, out = zo_train(case, work, model_dir, {}, data, data, name="refused-no-lora", zoffload_keys={"quantize_base": "nf4"})
    expect(p.returncode == 2 and "zoffload.quantize_base" in p.stderr and "zoffload.lora" in p.stderr,
           "qlora: quantize_base without lora refused by key: rc %d, %s" % (p.returncode, p.stderr[-600:]))
    print("qlora: damaged quantization states and unknown settings refused by name")
    check_qlora_8bit(case, work, model_dir, adapter_dir, tokens, data)


def main():
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    named = [n for n in os.environ.get("ZO_PEFT_CASES", "").split(",") if n]
    cases = [c for c in CASES if not named or c["name"] in named]
    print("peft %s, transformers %s, torch %s" % (peft.__version__, transformers.__version__, torch.__version__))
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="zo-peft-parity-", dir=os.environ.get("TMPDIR", "/tmp")) as tmp:
        for case in cases:
            run_case(case, tmp)
        if not named:
            check_errors(tmp)
            check_hostile_adapters(tmp)
            check_qlora(tmp)
    print("%d cases in %.1f s" % (len(cases), time.time() - t0))
    report_and_exit()


main()

#!/usr/bin/env python3
"""zoffload's config against DeepSpeed's own defaults: deepspeed_defaults.json holds every key of the
sections a DeepSpeed config has that zoffload reads, with DeepSpeed 0.19.8's default, read from its
config classes by deepspeed_defaults_gen.py (not from zoffload). For each key:
- a key zoffload reads resolves (`zoffload config check` of a minimal config) to DeepSpeed's
  default, or is in DEVIATIONS below with the reason it differs, and does differ;
- a key zoffload accepts with no effect (`config keys --json`) is accepted;
- a key zoffload does not accept is in REFUSED below with the reason, and `config check` of a config
  that sets it to DeepSpeed's own default is an error naming it.
So a new DeepSpeed default, a changed zoffload default and a key zoffload stops reading each fail
here, and a stale entry below fails too.

usage: deepspeed_defaults_test.py ZOFFLOAD deepspeed_defaults.json"""
import json
import subprocess
import sys
import tempfile

from cli_checks import expect, flatten, report_and_exit

zoffload, golden_path = sys.argv[1], sys.argv[2]

# Where zoffload's resolved default differs from DeepSpeed's, and why.
DEVIATIONS = {
    "steps_per_print": "DeepSpeed 0.19.8 defaults to no periodic log line (None); zoffload prints its "
                       "progress line every 10 steps",
}
# DeepSpeed keys zoffload refuses (unknown keys): features it does not have.
REFUSED = {
    "zero_optimization.zenflow": "ZenFlow (stall-free offload) is not implemented",
    "zero_optimization.zero_quantized_nontrainable_weights": "ZeRO++ quantization is not implemented",
    "zero_optimization.offload_optimizer.super_offload": "SuperOffload is not implemented",
}


def same(ds, zo):
    if ds is None and zo == "":  # an unset path: DeepSpeed's None, zoffload's ""
        return True
    if isinstance(ds, bool) or isinstance(zo, bool):
        return ds is zo
    if isinstance(ds, (int, float)) and isinstance(zo, (int, float)):
        return float(ds) == float(zo)
    return ds == zo


def check(config):
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump(config, f)
        f.flush()
        return subprocess.run([zoffload, "config", "check", f.name], capture_output=True, text=True, timeout=60)


golden = json.load(open(golden_path))
expect(golden.get("deepspeed_version") == "0.19.8", "the golden file is DeepSpeed 0.19.8's: %s" % golden.get("deepspeed_version"))
# leaf_module is one value (DeepSpeed's MoE leaf classes), not a section zoffload reads.
ds = flatten(golden["defaults"], leaves=("leaf_module",))
expect(len(ds) > 80, "the golden file holds DeepSpeed's keys: %d" % len(ds))

p = subprocess.run([zoffload, "config", "keys", "--json"], capture_output=True, text=True, timeout=60)
expect(p.returncode == 0, "config keys --json: %d %s" % (p.returncode, p.stderr))
table = json.loads(p.stdout)
no_effect = {n["path"] for n in table["no_effect"]}
p = check({"train_micro_batch_size_per_gpu": 1})
expect(p.returncode == 0, "config check of a minimal config: %d %s" % (p.returncode, p.stderr))
resolved = flatten(json.loads(p.stdout))

checked = deviating = accepted = refused = 0
for path, default in sorted(ds.items()):
    if path in resolved:
        checked += 1
        if path in DEVIATIONS:
            deviating += 1
            expect(not same(default, resolved[path]),
                   "%s: listed as a deviation, but zoffload resolves DeepSpeed's own %r (remove it from "
                   "DEVIATIONS)" % (path, default))
        else:
            expect(same(default, resolved[path]), "%s: DeepSpeed 0.19.8 defaults to %r, zoffload resolves %r"
                   % (path, default, resolved[path]))
    elif path in no_effect:
        accepted += 1
    elif path in REFUSED:
        refused += 1
        # The key at DeepSpeed's default, in a config otherwise minimal: an error naming it.
        config = {"train_micro_batch_size_per_gpu": 1}
        node = config
        *parents, key = path.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[key] = default
        r = check(config)
        expect(r.returncode == 2 and path in r.stderr,
               "%s: refused (%s), but config check said %d: %s" % (path, REFUSED[path], r.returncode, r.stderr[-300:]))
    else:
        expect(False, "%s (DeepSpeed default %r): zoffload neither reads it, nor accepts it with no effect, nor "
               "lists it in REFUSED" % (path, default))
for path in DEVIATIONS:
    expect(path in ds and path in resolved, "DEVIATIONS names %s, which is not a key of both" % path)
for path in REFUSED:
    expect(path in ds and path not in resolved and path not in no_effect,
           "REFUSED names %s, which DeepSpeed lacks or zoffload accepts" % path)
print("%d DeepSpeed keys: %d resolved by zoffload (%d deviating as listed), %d accepted with no effect, %d refused"
      % (len(ds), checked, deviating, accepted, refused))
report_and_exit()

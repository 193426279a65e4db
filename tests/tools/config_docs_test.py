#!/usr/bin/env python3
"""docs/config.md against the code: every key its tables list is a key the resolved config has,
every key the resolved config has is listed, and every default the docs state as a literal
(a number, true/false, a quoted string, "" or a byte size) is the default `zoffload config check`
resolves. The optimizer's and scheduler's params are documented per type and checked by
config_test; they are left out here. This catches docs and code drifting apart until the keys are
declared once (issue 19).

usage: config_docs_test.py ZOFFLOAD DOCS_CONFIG_MD"""
import json
import re
import subprocess
import sys
import tempfile

from cli_checks import expect, report_and_exit

zoffload, docs_path = sys.argv[1], sys.argv[2]

# The sections whose `| key | default | meaning |` tables hold config keys, and their key prefix.
SECTION_PREFIX = {
    "## `zero_optimization`": "zero_optimization.",
    "### `zero_optimization.offload_param` (stage 3 only)": "zero_optimization.offload_param.",
    "### `zero_optimization.offload_optimizer` (stage ≥ 1)": "zero_optimization.offload_optimizer.",
    "## `aio` — the NVMe I/O engine": "aio.",
    "## Precision": "",
    "## Training loop": "",
    "## `zoffload` — keys DeepSpeed lacks": "zoffload.",
}
SIZE_UNITS = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def documented_keys(text):
    """{key path: default text} from the key tables of the sections above."""
    keys, prefix, in_table = {}, None, False
    sections_seen = set()
    for line in text.splitlines():
        if line.startswith("#"):
            prefix = SECTION_PREFIX.get(line.strip())
            if prefix is not None:
                sections_seen.add(line.strip())
            in_table = False
            continue
        if prefix is None:
            continue
        if line.startswith("| key | default |"):
            in_table = True
            continue
        if in_table and line.startswith("| `"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            for name in re.findall(r"`([^`]+)`", cells[0]):
                keys[prefix + name] = cells[1]
        elif in_table and not line.startswith("|"):
            in_table = False
    expect(sections_seen == set(SECTION_PREFIX), "docs/config.md has every keyed section: missing %s"
           % sorted(set(SECTION_PREFIX) - sections_seen))
    return keys


def flatten(obj, prefix=""):
    out = {}
    for k, v in obj.items():
        path = prefix + k
        if isinstance(v, dict):
            out.update(flatten(v, path + "."))
        else:
            out[path] = v
    return out


def literal(default):
    """The value a docs default states, or None when it is prose ("true iff stage 3", "—")."""
    d = default.strip()
    if d in ("true", "false"):
        return d == "true"
    if d == '""':
        return ""
    m = re.fullmatch(r'`"([^"]*)"`|"([^"]+)"', d)
    if m:
        return m.group(1) if m.group(1) is not None else m.group(2)
    m = re.fullmatch(r"(\d+)(KiB|MiB|GiB)", d)
    if m:
        return int(m.group(1)) * SIZE_UNITS[m.group(2)]
    if re.fullmatch(r"-?\d+(\.\d+)?(e\d+)?", d):
        return float(d)
    if d in ("fp32", "fp16", "bf16"):
        return d
    return None


with open(docs_path, encoding="utf-8") as f:
    docs = documented_keys(f.read())
expect(len(docs) > 60, "found the key tables: %d keys" % len(docs))

with tempfile.NamedTemporaryFile("w", suffix=".json") as cfg:
    json.dump({"train_micro_batch_size_per_gpu": 1}, cfg)
    cfg.flush()
    p = subprocess.run([zoffload, "config", "check", cfg.name], capture_output=True, text=True, timeout=60)
expect(p.returncode == 0, "config check of a minimal config: %d %s" % (p.returncode, p.stderr))
resolved = flatten(json.loads(p.stdout))
code_keys = {k for k in resolved if not k.startswith(("optimizer.", "scheduler."))}

expect(not sorted(set(docs) - code_keys), "documented keys the resolved config lacks: %s" % sorted(set(docs) - code_keys))
expect(not sorted(code_keys - set(docs)), "resolved keys docs/config.md does not list: %s" % sorted(code_keys - set(docs)))
checked = 0
for key, default in sorted(docs.items()):
    want = literal(default)
    if want is None or key not in resolved:
        continue
    got = resolved[key]
    same = (got == want) if not isinstance(want, float) else (isinstance(got, (int, float)) and float(got) == want)
    expect(same, "%s: docs/config.md says the default is %s, the code resolves %r" % (key, default, got))
    checked += 1
expect(checked > 50, "defaults checked against the code: %d" % checked)

report_and_exit()

#!/usr/bin/env python3
"""docs/config.md against the key table the config reader uses (`zoffload config keys --json`,
engine/config/config_schema.h) and against what it resolves (`zoffload config check`):
- the key tables list exactly the table's keys, which are exactly the resolved config's keys;
- every default the docs state as a literal (a number, true/false, a quoted string, "" or a byte
  size) is the default `config check` resolves;
- the keys that accept "auto" are exactly the rows of the "auto" table;
- every deprecated name is in the deprecated-names table, every other name in the short-names
  paragraph, and the no-effect list names exactly the keys accepted with no effect.
The optimizer's and scheduler's params depend on their type, are documented per type and checked by
config_test; they are left out here.

usage: config_docs_test.py ZOFFLOAD DOCS_CONFIG_MD"""
import json
import re
import subprocess
import sys
import tempfile

from cli_checks import expect, flatten, report_and_exit

zoffload, docs_path = sys.argv[1], sys.argv[2]

# The sections whose `| key | default | meaning |` tables hold config keys, and their key prefix.
SECTION_PREFIX = {
    "## `zero_optimization`": "zero_optimization.",
    "### `zero_optimization.offload_param` (stage 3 only)": "zero_optimization.offload_param.",
    "### `zero_optimization.offload_optimizer` (stage ≥ 1)": "zero_optimization.offload_optimizer.",
    "## `aio` — the NVMe I/O engine": "aio.",
    "## Precision": "",
    "## Training loop": "",
    "## Monitors: `tensorboard`, `csv_monitor`": "",
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


def section(text, start, end):
    """The text from the line starting with `start` up to the next line starting with `end`."""
    i = text.index(start)
    j = text.find(end, i + len(start))
    return text[i:j if j >= 0 else len(text)]


def expand_braces(item):
    """`zero_optimization.{a, b}` -> [zero_optimization.a, zero_optimization.b]."""
    m = re.fullmatch(r"([\w.]*)\{([^}]*)\}", item)
    if not m:
        return [item]
    return [m.group(1) + part.strip() for part in m.group(2).split(",")]


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
    docs_text = f.read()
docs = documented_keys(docs_text)
expect(len(docs) > 60, "found the key tables: %d keys" % len(docs))

p = subprocess.run([zoffload, "config", "keys", "--json"], capture_output=True, text=True, timeout=60)
expect(p.returncode == 0, "config keys --json: %d %s" % (p.returncode, p.stderr))
table = json.loads(p.stdout)
table_keys = {k["path"]: k for k in table["keys"] if k["path"] not in ("optimizer", "scheduler")}
expect(not sorted(set(docs) - set(table_keys)), "documented keys the key table lacks: %s" % sorted(set(docs) - set(table_keys)))
expect(not sorted(set(table_keys) - set(docs)), "keys of the key table docs/config.md does not list: %s"
       % sorted(set(table_keys) - set(docs)))

# "auto": the table's auto keys against the rows of the `| key | resolves to |` table.
auto_rows = set()
for line in section(docs_text, "| key | resolves to |", "\n\n").splitlines()[2:]:
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    for name in re.findall(r"`([^`]+)`", cells[0]):
        auto_rows.add(name)
auto_rows = {k for k in auto_rows if not k.startswith(("optimizer.", "scheduler.", "weight_decay", "eps"))}
auto_keys = {k for k, v in table_keys.items() if v["auto"]}
expect(auto_keys == auto_rows, "keys accepting \"auto\": the table says %s, docs/config.md's auto table %s"
       % (sorted(auto_keys - auto_rows), sorted(auto_rows - auto_keys)))

# Other names: deprecated ones in the old/read-as table, the others in the short-names paragraph.
deprecated_rows = set(re.findall(r"^\s*\| `([^`]+)`", section(docs_text, "  | old | read as |", "\n\n"), re.M))
short_names = set(re.findall(r"`([^`]+)`", section(docs_text, "  DeepSpeed's own short names", "\n- **")))
for alias in table["aliases"]:
    if alias["deprecated"]:
        expect(alias["path"] in deprecated_rows, "deprecated name %s is in docs/config.md's table" % alias["path"])
    else:
        expect(alias["path"].split(".")[-1] in short_names, "other name %s is in the short-names paragraph" % alias["path"])

# Keys accepted with no effect: the bullet names exactly those of the table, plus the optimizer's and
# scheduler's, which their hand-written readers accept.
bullet = section(docs_text, "- **Keys with no effect here**", "\n- **")
listed = set()
for item in re.findall(r"`([^`]+)`", bullet.replace("\n  ", " ")):
    listed.update(expand_braces(item))
no_effect = {n["path"] for n in table["no_effect"]}
expect(not sorted(no_effect - listed), "keys with no effect docs/config.md does not list: %s" % sorted(no_effect - listed))
extra = sorted(k for k in listed - no_effect if not k.startswith(("optimizer.", "scheduler.")))
expect(not extra, "keys docs/config.md lists as having no effect that the table does not: %s" % extra)

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

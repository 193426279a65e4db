#!/usr/bin/env python3
"""Every Note that is cited is defined, once (docs/design.md, "Named notes").

A Note is rationale kept under a name, written once where the code it explains lives and cited by
name wherever it applies. This lint reads the repository's sources, build files, scripts and docs
and sorts each occurrence of `Note [<name>]` into a definition or a citation:

- A block definition: a comment line (`//`, or `#` in Python, shell and meson.build) that holds
  only the Note's name, optionally between rules of `-` or `~`, followed by a comment line: the
  Note is the comment below it. (The same line followed by code marks a place; it cites.)
- A heading definition: a Markdown heading that is only the Note's name, or a Markdown paragraph
  that opens with it.
- An inline definition: a comment line that opens with the name followed by `:`, or by an aside in
  parentheses and `:` ("(ZeRO stage 2):"; an aside that names a file, "(io/env.h):", cites). It
  defines a Note that has no block or heading definition; beside one, it says what the Note means
  at that place, and cites.
- Under tests/ only meson.build files define: a test says which Note it checks, so its Notes cite.
- Every other occurrence cites, in code, strings, docstrings and docs alike, and so does a name
  wrapped across two lines of a comment or a paragraph.

It fails, listing file:line, for a citation of a Note defined nowhere, and for a Note defined more
than once: two block or heading definitions, or, without one, two inline ones.

usage: lint_notes.py SOURCE_ROOT   (exit 1 listing each problem)
"""
from __future__ import annotations

import pathlib
import re
import sys

FOLDERS = ("common", "io", "cpu_optim", "gpu", "engine", "tools", "tests", "docs", ".ci")
SLASH_SUFFIXES = {".cpp", ".h", ".cu", ".proto"}
HASH_SUFFIXES = {".py", ".sh", ".supp"}
HASH_NAMES = {"meson.build", "meson_options.txt", "requirements.txt"}
SELF = "tests/lint_notes.py"  # its docstring spells out the syntax

NOTE = re.compile(r"Note \[([^\]\n]+)\]")
# A citation wrapped across lines: "(Note [Prefetch" ends one line, "and release])" opens the next.
WRAPPED = re.compile(r"Note \[([^\]\n]*)$")
RULE = "-~= "
# An aside that names a file ("(io/env.h)", "(grad_accumulator.h)") says where a Note is: a citation.
FILE_ASIDE = re.compile(r"/|\.(?:h|cpp|cu|py|sh|md|build)\b")
MD_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")


def comment_style(path: pathlib.Path) -> str | None:
    """'//', '#', 'md' or None (not scanned)."""
    if path.suffix in SLASH_SUFFIXES:
        return "//"
    if path.suffix in HASH_SUFFIXES or path.name in HASH_NAMES:
        return "#"
    if path.suffix == ".md":
        return "md"
    if path.suffix == "":
        try:
            with path.open("rb") as f:
                return "#" if f.read(2) == b"#!" else None
        except OSError:
            return None
    return None


def comment_text(line: str, style: str) -> str | None:
    """The text of a line that is only a comment, else None."""
    s = line.strip()
    if not s.startswith(style):
        return None
    return s.lstrip("/" if style == "//" else "#").strip()


def classify_code(lines: list[str], style: str, n: int, match: re.Match) -> str:
    """'block', 'inline' or 'cite' for a Note named on line n (0-based) of a source file."""
    text = comment_text(lines[n], style)
    if text is None or not text.strip(RULE).startswith(match.group(0)):
        return "cite"
    if text.strip(RULE) == match.group(0):
        nxt = comment_text(lines[n + 1], style) if n + 1 < len(lines) else None
        return "block" if nxt is not None else "cite"
    rest = text[len(match.group(0)):] if text.startswith(match.group(0)) else ""
    aside = re.match(r"\s*\(([^)]*)\)\s*:", rest)
    if rest.startswith(":") or (aside and not FILE_ASIDE.search(aside.group(1))):
        return "inline"
    return "cite"


def wrapped_name(lines: list[str], n: int, style: str) -> str | None:
    """The name of a Note whose citation line n (0-based) ends inside, joined with the next line."""
    head = WRAPPED.search(lines[n].rstrip())
    if not head or n + 1 >= len(lines):
        return None
    nxt = lines[n + 1].strip() if style == "md" else comment_text(lines[n + 1], style)
    if nxt is None or "]" not in nxt:
        return None
    return " ".join(part for part in (head.group(1).strip(), nxt.split("]", 1)[0].strip()) if part)


def classify_md(lines: list[str], n: int, match: re.Match, in_fence: bool) -> str:
    line = lines[n]
    if in_fence:
        return "cite"
    heading = MD_HEADING.match(line)
    if heading:
        return "block" if heading.group(1) == match.group(0) else "cite"
    if line.startswith(match.group(0)) and (n == 0 or not lines[n - 1].strip() or MD_HEADING.match(lines[n - 1])):
        return "block"
    return "cite"


def files_under(root: pathlib.Path):
    for path in sorted(root.iterdir()):
        if path.is_file():
            yield path
    for folder in FOLDERS:
        base = root / folder
        if not base.is_dir():
            continue
        for path in sorted(base.rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts:
                yield path


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__.strip().splitlines()[-1])
        return 2
    root = pathlib.Path(sys.argv[1])
    defs: dict[str, dict[str, list[str]]] = {}  # name -> kind -> ["file:line"]
    cites: dict[str, list[str]] = {}
    scanned = 0
    for path in files_under(root):
        rel = path.relative_to(root).as_posix()
        style = comment_style(path)
        if style is None or rel == SELF:
            continue
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except (UnicodeDecodeError, OSError):
            continue
        scanned += 1
        only_cites = rel.startswith("tests/") and path.name != "meson.build"
        in_fence = False
        for n, line in enumerate(lines):
            if style == "md" and line.lstrip().startswith("```"):
                in_fence = not in_fence
                continue
            for m in NOTE.finditer(line):
                kind = classify_md(lines, n, m, in_fence) if style == "md" else classify_code(lines, style, n, m)
                where = f"{rel}:{n + 1}"
                if only_cites or kind == "cite":
                    cites.setdefault(m.group(1), []).append(where)
                else:
                    defs.setdefault(m.group(1), {}).setdefault(kind, []).append(where)
            name = wrapped_name(lines, n, style)
            if name:
                cites.setdefault(name, []).append(f"{rel}:{n + 1}")
    if scanned < 100:
        print(f"lint_notes: only {scanned} files under {root}: wrong root?")
        return 1

    problems = []
    for name, kinds in sorted(defs.items()):
        strong = kinds.get("block", [])
        weak = kinds.get("inline", [])
        if len(strong) > 1:
            problems.append(f"Note [{name}] is defined {len(strong)} times: {', '.join(strong)}")
        elif not strong and len(weak) > 1:
            problems.append(f"Note [{name}] is defined {len(weak)} times (each opens a comment with it and ':'): "
                            f"{', '.join(weak)}; keep one definition and cite it elsewhere")
        if strong:  # an inline opening beside a block definition elaborates on it: a citation
            cites.setdefault(name, []).extend(weak)
    for name, places in sorted(cites.items()):
        if name not in defs:
            problems.extend(f"{where}: Note [{name}] is cited but defined nowhere" for where in places)
    if problems:
        print("Notes cited but not defined, or defined more than once (docs/design.md, \"Named notes\"):")
        print("\n".join(problems))
        return 1
    n_cites = sum(len(v) for v in cites.values())
    print(f"lint_notes: {scanned} files, {len(defs)} Notes defined once each, {n_cites} citations, none undefined")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What the command-line tests here share: checks that are counted and collect their failures, and
the report at the end (every failure, then the counts; exit 1 when any check failed)."""
import sys

failures = []
_checks = 0


def expect(cond, what):
    """Counts a check; records `what` when `cond` is false. Returns cond, so a test can stop early."""
    global _checks
    _checks += 1
    if not cond:
        failures.append(what)
    return cond


def flatten(node, prefix="", leaves=()):
    """A nested JSON object as {"a.b.c": value}; the keys named in `leaves` stay whole values."""
    out = {}
    for k, v in node.items():
        path = prefix + k
        if isinstance(v, dict) and k not in leaves:
            out.update(flatten(v, path + ".", leaves))
        else:
            out[path] = v
    return out


def report_and_exit():
    for f in failures:
        print("FAIL:", f)
    print("%d checks, %d failures" % (_checks, len(failures)))
    sys.exit(1 if failures else 0)

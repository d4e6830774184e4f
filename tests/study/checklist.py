"""Shared by the study's smoke tests: named checks, the exit code, and the skip (77) when
the Python packages a test needs are not installed."""

import importlib
import sys

FAILURES = []


def require_modules(*names):
    """Exits 77 (meson's "skipped") unless every module imports."""
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - any import failure means "not installed here"
            print("skipped: %s is not importable (%s)" % (name, e))
            sys.exit(77)


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what)
    if not cond:
        FAILURES.append(what)


def exit_code():
    if FAILURES:
        print("%d check(s) failed" % len(FAILURES))
        return 1
    print("all checks passed")
    return 0

#!/usr/bin/env python3
"""The tools' command lines: one parser for every tool, so --help and --version
everywhere, "--opt value" and "--opt=value" both, an unknown option refused by name; JSON that is
JSON when a number is not finite; the .npy reader refusing a shape it cannot read.

usage: test_cli.py CASE --version-expected V [--sim EXE] [--run EXE] [--perf EXE] [--demo EXE]
CASE is help_version, unknown_option, equals_form, jsonl_non_finite or npy_shape. A tool not
given (dynamiq-perf and dynamiq-demo need NCCL's headers) is left out of the case.
"""
import argparse
import json
import os
import struct
import subprocess
import sys
import tempfile

failures = []


def check(cond, what):
    if not cond:
        failures.append(what)


def run(exe, *args, timeout=120):
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def write_npy(path, shape, values):
    """A float32 .npy of `shape` holding `values` (no numpy needed)."""
    dims = ", ".join(str(d) for d in shape) + ("," if len(shape) == 1 else "")
    header = "{'descr': '<f4', 'fortran_order': False, 'shape': (%s), }" % dims
    header += " " * ((64 - (10 + len(header) + 1) % 64) % 64) + "\n"
    with open(path, "wb") as f:
        f.write(b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header.encode())
        f.write(struct.pack("<%df" % len(values), *values))


def strict_json(line):
    """json.loads that refuses NaN and Infinity, which Python's json accepts but JSON has not."""
    def refuse(name):
        raise ValueError(f"{name} is not JSON")
    return json.loads(line, parse_constant=refuse)


def tools(a):
    return [(name, exe) for name, exe in (("dynamiq-sim", a.sim), ("dynamiq-run", a.run),
                                          ("dynamiq-perf", a.perf), ("dynamiq-demo", a.demo))
            if exe]


def case_help_version(a):
    for name, exe in tools(a):
        for flag in ("--help", "-h"):
            r = run(exe, flag)
            check(r.returncode == 0 and "usage:" in r.stdout and "--version" in r.stdout,
                  f"{name} {flag}: rc {r.returncode} stdout {r.stdout[:200]!r} stderr {r.stderr[:300]!r}")
        r = run(exe, "--version")
        want = f"{name} {a.version_expected} (git "
        check(r.returncode == 0 and r.stdout.startswith(want) and r.stdout.endswith(")\n")
              and r.stdout.count("\n") == 1,
              f"{name} --version: rc {r.returncode} {r.stdout!r} {r.stderr[:300]!r} (want {want!r}...)")


def case_unknown_option(a):
    for name, exe in tools(a):
        for bad in ("--bogus", "-Q"):
            args = [bad] if name != "dynamiq-run" else ["-n", "1", bad, "true"]
            r = run(exe, *args)
            check(r.returncode == 2, f"{name} {bad}: rc {r.returncode}")
            check(r.stderr.startswith(f"{name}: unknown option '{bad}'"),
                  f"{name} {bad}: {r.stderr[:300]!r}")
            check("needs a value" not in r.stderr and "cannot open" not in r.stderr,
                  f"{name} {bad}: misleading message {r.stderr[:300]!r}")
        # A value option at the end without its value is named as such.
        opt = {"dynamiq-sim": "--input", "dynamiq-run": "--timeout", "dynamiq-perf": "--minbytes"}
        if name in opt:
            r = run(exe, opt[name])
            check(r.returncode == 2 and f"{opt[name]} needs a value" in r.stderr,
                  f"{name} {opt[name]}: {r.stderr[:300]!r}")
        # A flag given a value is refused, not read as true.
        flag = {"dynamiq-sim": "--quiet", "dynamiq-run": "--cpu-nccl", "dynamiq-perf": "--lossy"}
        if name in flag:
            r = run(exe, flag[name] + "=1", *(["-n", "1", "true"] if name == "dynamiq-run" else []))
            check(r.returncode == 2 and f"{flag[name]} takes no value" in r.stderr,
                  f"{name} {flag[name]}=1: {r.stderr[:300]!r}")
    if a.run:
        # After "--" or PROGRAM, everything belongs to the program, even our own options.
        r = run(a.run, "-n", "1", "--", "echo", "--bogus", "--version")
        check(r.returncode == 0 and "--bogus --version" in r.stdout, f"run -- echo: {r.stdout!r} {r.stderr!r}")
        r = run(a.run, "--nproc=1", "printf", "%s|", "-n", "3", "--help")
        check(r.returncode == 0 and "-n|3|--help|" in r.stdout, f"run printf -n 3: {r.stdout!r} {r.stderr!r}")
    if a.demo:
        r = run(a.demo, "x.npy", "3", "extra")
        check(r.returncode == 2 and "unexpected argument 'extra'" in r.stderr, f"demo extra: {r.stderr!r}")
        r = run(a.demo, "x.npy", "0")
        check(r.returncode == 2 and "ITERS" in r.stderr, f"demo ITERS 0: {r.stderr!r}")


def case_equals_form(a):
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "g.npy")
        write_npy(path, (2, 4096), [((i * 7919) % 1000 - 500) / 100.0 for i in range(2 * 4096)])
        if a.sim:
            rows = []
            for args in (["--input", path, "--workers", "2", "--format", "jsonl"],
                         [f"--input={path}", "--workers=2", "--format=jsonl"]):
                r = run(a.sim, *args, "--quiet")
                check(r.returncode == 0, f"sim {args}: rc {r.returncode} {r.stderr[:300]!r}")
                rows.append([strict_json(x) for x in r.stdout.splitlines() if x.strip()])
            check(len(rows[0]) == 1 and rows[0] == [dict(x, seconds=rows[0][0]["seconds"])
                                                     for x in rows[1]],
                  f"sim: --opt=value and --opt value differ: {rows}")
            # The last of a repeated option wins, whichever form each is in.
            r = run(a.sim, "--input", path, "--workers=3", "--workers", "2", "--format=table",
                    "--format", "jsonl", "--quiet")
            check(r.returncode == 0 and strict_json(r.stdout)["workers"] == 2,
                  f"sim repeated options: {r.stdout!r} {r.stderr!r}")
    if a.run:
        for args in (["--nproc=2", "--timeout=30", "--grace=1", "--", "true"],
                     ["--nproc", "2", "--timeout", "30", "--grace", "1", "--", "true"],
                     ["-n2", "true"]):
            r = run(a.run, *args)
            check(r.returncode == 0, f"run {args}: rc {r.returncode} {r.stderr[:300]!r}")
        r = run(a.run, "--nproc=2", "--timeout=abc", "true")
        check(r.returncode == 2 and "'abc'" in r.stderr, f"run --timeout=abc: {r.stderr!r}")
    if a.perf:
        # Parsed in both forms before the sweep is checked: the message names both values.
        for args in (["--minbytes=1K", "--maxbytes=512"], ["--minbytes", "1K", "--maxbytes", "512"],
                     ["-b1K", "-e512"], ["-b", "1K", "-e", "512"]):
            r = run(a.perf, *args)
            check(r.returncode == 2 and "-b (1024 B) is larger than -e (512 B)" in r.stderr,
                  f"perf {args}: {r.stderr[:300]!r}")
        r = run(a.perf, "--root=-2")
        check(r.returncode == 2 and "'-2'" in r.stderr, f"perf --root=-2: {r.stderr!r}")


def case_jsonl_non_finite(a):
    if not a.sim:
        return
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "inf.npy")
        values = [((i * 7919) % 1000 - 500) / 100.0 for i in range(4 * 4096)]
        values[5] = float("inf")
        values[4096 + 9] = float("-inf")
        write_npy(path, (4, 4096), values)
        for extra in ([], ["--per-hop"], ["--collective", "reducescatter"]):
            r = run(a.sim, "--input", path, "--format", "jsonl", "--quiet", "--codec",
                    "dynamiq:5,bf16", *extra)
            check(r.returncode == 0, f"sim {extra}: rc {r.returncode} {r.stderr[:300]!r}")
            lines = [x for x in r.stdout.splitlines() if x.strip()]
            check(len(lines) == 2, f"sim {extra}: {len(lines)} lines")
            for line in lines:
                try:
                    row = strict_json(line)
                except ValueError as e:
                    check(False, f"sim {extra}: not JSON ({e}): {line[:300]}")
                    continue
                check(row["vnmse"] is None and row["vnmse_finite"] is False,
                      f"sim {extra}: a non-finite vNMSE is null with vnmse_finite false: {row}")
                for key in ("block_vnmse", "hop_vnmse"):
                    if key in row:
                        check(row.get(key + "_finite") is False and None in row[key],
                              f"sim {extra}: {key}: {row}")
        # A finite result says so too.
        values[5] = values[4096 + 9] = 1.0
        write_npy(path, (4, 4096), values)
        r = run(a.sim, "--input", path, "--format", "jsonl", "--quiet")
        row = strict_json(r.stdout)
        check(row["vnmse_finite"] is True and 0 < row["vnmse"] < 1, f"finite row: {row}")


def case_npy_shape(a):
    with tempfile.TemporaryDirectory() as d:
        for shape, words in (((4, 8, 2), "(4, 8, 2)"), ((64,), "(64,)"),
                             ((1, 2, 4, 8), "(1, 2, 4, 8)")):
            path = os.path.join(d, "x.npy")
            n = 1
            for s in shape:
                n *= s
            write_npy(path, shape, [1.0] * n)
            r = run(a.sim, "--input", path, "--workers", "1", "--quiet")
            check(r.returncode == 2 and words in r.stderr and "dimensions" in r.stderr,
                  f"sim shape {shape}: rc {r.returncode} {r.stderr[:300]!r}")
        path = os.path.join(d, "ok.npy")
        write_npy(path, (2, 1024), [1.0] * 2048)
        r = run(a.sim, "--input", path, "--workers", "2", "--quiet")
        check(r.returncode == 0, f"sim 2-D: {r.stderr[:300]!r}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("case")
    p.add_argument("--version-expected", required=True)
    for t in ("sim", "run", "perf", "demo"):
        p.add_argument("--" + t)
    a = p.parse_args()
    globals()["case_" + a.case](a)
    for f in failures:
        print("FAIL:", f)
    print(f"{a.case}: {len(failures)} failures")
    sys.exit(1 if failures else 0)


main()

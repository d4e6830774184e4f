#!/usr/bin/env python3
"""profile_summary.py against a made-up raw page (testdata/ncu_raw.csv, in the shape ncu prints:
its own lines first, a header, a units row). The units row is not a launch; a kernel is named
without its namespace, return type and parameters; launches are labelled in order; thousands
separators are read; a missing or n/a metric prints n/a; a report with no launch exits 1."""
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
TOOL = os.path.join(HERE, "profile_summary.py")
RAW = os.path.join(HERE, "testdata", "ncu_raw.csv")


def run(*args):
    return subprocess.run([sys.executable, TOOL, *args], capture_output=True, text=True)


def main():
    r = run(RAW, "--values", "33554432", "--label", "dynamiq_hop_kernel=leaf/FP32,hop/FP32")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 3, lines  # three launches; the units row is none
    leaf, hop, finish = lines
    assert leaf.startswith("profile: dynamiq_hop_kernel leaf/FP32: time 312 us, "), leaf
    assert "DRAM 41.2% of peak" in leaf or "DRAM 41.3% of peak" in leaf, leaf
    assert "issue slots busy 86.1%" in leaf and "registers 64" in leaf, leaf
    # 104,857,600 warp instructions x 32 over 2^25 values: 100 a value.
    assert "(100.0 thread instructions a value at most)" in leaf, leaf
    assert hop.startswith("profile: dynamiq_hop_kernel hop/FP32: time 401 us"), hop
    assert "(150.0 thread instructions a value at most)" in hop, hop
    assert finish.startswith("profile: dynamiq_finish_kernel #1: "), finish
    assert "DRAM n/a" in finish and "warp instructions n/a" in finish, finish

    # Without --values: the count alone, no per-value figure.
    r = run(RAW)
    assert r.returncode == 0 and "a value" not in r.stdout, r.stdout
    assert "dynamiq_hop_kernel #2:" in r.stdout, r.stdout

    # A report with a header and units but no launch, and a file that is no report at all.
    with tempfile.TemporaryDirectory() as d:
        empty = os.path.join(d, "empty.csv")
        with open(RAW) as f, open(empty, "w") as g:
            g.writelines(f.readlines()[:2])
        junk = os.path.join(d, "junk.csv")
        with open(junk, "w") as g:
            g.write("==ERROR== the profiler could not be loaded\n")
        for path in (empty, junk):
            r = run(path)
            assert r.returncode == 1 and "no profiled launch" in r.stdout, (path, r.stdout)
    print("ok")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""dynamiq-sim's command-line contract: JSONL keys, honest bit counts, clear refusals."""
import json
import os
import subprocess
import sys
import tempfile

sim, sample = sys.argv[1], sys.argv[2]
failures = []


def check(cond, what):
    if not cond:
        failures.append(what)


def run(*args):
    return subprocess.run([sim, *args], capture_output=True, text=True, timeout=300)


r = run("--input", sample, "--workers", "4", "--topo", "ring,butterfly",
        "--codec", "dynamiq:5,mxfp8,mxfp6,mxfp4,bf16,uniform:5", "--seed", "1", "--format", "jsonl")
check(r.returncode == 0, f"contract command failed: {r.stderr}")
rows = [json.loads(line) for line in r.stdout.splitlines() if line.strip()]
check(len(rows) == 12, f"expected 12 results, got {len(rows)}")
for row in rows:
    for key in ("codec", "topo", "workers", "vnmse", "bits_per_coord"):
        check(key in row, f"missing key {key} in {row}")
    check(0 < row["vnmse"] < 0.1, f"implausible vNMSE {row}")
dq = [x for x in rows if x["codec"] == "dynamiq:5"]
check(all(x["bits_per_coord"] <= 5.0 for x in dq), f"dynamiq over budget: {dq}")
check(all(abs(x["bits_per_coord"] - 16.0) < 0.01 for x in rows if x["codec"] == "bf16"), "bf16 bits")
# Same seed, same result: the simulator is deterministic.
again = run("--input", sample, "--workers", "4", "--topo", "ring", "--codec", "dynamiq:5",
            "--format", "jsonl", "--quiet")
check(json.loads(again.stdout)["vnmse"] == [x for x in dq if x["topo"] == "ring"][0]["vnmse"],
      "same seed gave another vNMSE")
# Fewer rows than workers: says so and stops.
r = run("--input", sample, "--workers", "8")
check(r.returncode == 2 and "rows" in r.stderr, f"fewer rows than workers: rc {r.returncode} {r.stderr}")
# Bad inputs are named.
r = run("--input", sample, "--codec", "dynamiq:99")
check(r.returncode == 2 and "budget" in r.stderr, f"bad budget: {r.stderr}")
r = run("--input", sample, "--topo", "torus")
check(r.returncode == 2 and "torus" in r.stderr, f"bad topology: {r.stderr}")
with tempfile.TemporaryDirectory() as d:
    bad = os.path.join(d, "bad.npy")
    open(bad, "wb").write(b"not a numpy file")
    r = run("--input", bad)
    check(r.returncode == 2 and "bad.npy" in r.stderr, f"bad file: {r.stderr}")
    # Synthetic round trip through --save.
    saved = os.path.join(d, "syn.npy")
    r = run("--synthetic", "--dim", "5000", "--workers", "3", "--save", saved)
    check(r.returncode == 0 and os.path.getsize(saved) > 3 * 5000 * 4, f"--save: {r.stderr}")
    r = run("--input", saved, "--workers", "3", "--topo", "butterfly", "--format", "jsonl", "--quiet")
    check(r.returncode == 0 and json.loads(r.stdout)["workers"] == 3, f"saved file: {r.stderr}")

for f in failures:
    print("FAIL:", f)
print(f"{len(failures)} failures")
sys.exit(1 if failures else 0)

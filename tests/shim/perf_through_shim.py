#!/usr/bin/env python3
"""dynamiq-perf under the preloaded shim, on the CPU NCCL with 4 ranks.

perf_through_shim.py CASE --run DYNAMIQ_RUN --perf DYNAMIQ_PERF --shim LIBDYNAMIQ
  issue:  the issue's command (-b 1M -e 64M -f 4 -d float -o sum, -n 2 -w 1): every size
          compressed, finite, identical on all ranks, vNMSE in the codec's range, exit 0.
  mixed:  every dtype and op at 256 KiB and 1 MiB: exactly the FP32/BF16 SUM/AVG calls of at least
          DYNAMIQ_MIN_BYTES are compressed; every other row is exact (#wrong 0).
Exit 0 pass, 1 fail, 77 skip."""
import argparse
import os
import re
import subprocess
import sys

ROW = re.compile(r"^\[0\]\s+(\d+)\s+(\d+)\s+(\w+)\s+(\w+)\s+-?\d+\s+\S+\s+\S+\s+\S+\s+(\S+)"
                 r"\s+\S+\s+\S+\s+\S+\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)\s+(comp|pass)$")


def fail(msg):
    print("FAIL:", msg)
    sys.exit(1)


def run(a, perf_args, extra_env):
    env = dict(os.environ, LD_PRELOAD=a.shim, DYNAMIQ_ENABLE="1", **extra_env)
    cmd = [a.run, "--cpu-nccl", "-n", "4", "--timeout", "1200", "--", a.perf] + perf_args
    print("$ LD_PRELOAD=... DYNAMIQ_ENABLE=1", " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1300)
    out = [l for l in proc.stdout.splitlines() if "#  Rank" not in l]
    print("\n".join(out[-40:]))
    if proc.returncode != 0:
        fail(f"exit {proc.returncode}: {proc.stderr[-3000:]}")
    rows = []
    for line in proc.stdout.splitlines():
        m = ROW.match(line)
        if m:
            rows.append(dict(bytes=int(m[1]), type=m[3], op=m[4], wrong_oop=float(m[5]),
                             wrong_ip=float(m[6]), vnmse_oop=float(m[7]) if m[7] != "N/A" else 0,
                             ident_oop=m[8], vnmse_ip=float(m[9]) if m[9] != "N/A" else 0,
                             ident_ip=m[10], dynamiq=m[11]))
    if not rows:
        fail("no result rows with a dynamiq column (is the shim preloaded?)")
    return rows


def case_issue(a):
    # The issue's sizes, dtype and op; 2 timed iterations and 1 warm-up instead of 20 and 5
    # (the checks are per size, not timings: 158 s of CI at the defaults).
    rows = run(a, ["-b", "1M", "-e", "64M", "-f", "4", "-d", "float", "-o", "sum", "-n", "2",
                   "-w", "1"], {})
    if [r["bytes"] for r in rows] != [1 << 20, 4 << 20, 16 << 20, 64 << 20]:
        fail(f"sizes {[r['bytes'] for r in rows]}")
    for r in rows:
        if r["dynamiq"] != "comp":
            fail(f"{r['bytes']} B was not compressed")
        if r["wrong_oop"] or r["wrong_ip"] or r["ident_oop"] != "yes" or r["ident_ip"] != "yes":
            fail(f"{r['bytes']} B: non-finite or not identical on all ranks: {r}")
        # Uniform random inputs (no locality): 5 bits give ~2.4e-2 over the butterfly's hops;
        # an uncompressed float sum would be ~1e-15, a broken codec far above 0.1.
        for v in (r["vnmse_oop"], r["vnmse_ip"]):
            if not 1e-3 < v < 0.05:
                fail(f"{r['bytes']} B: vNMSE {v}")
    print(f"PASS: {len(rows)} sizes compressed, identical on every rank")


def case_mixed(a):
    # 256 KiB and 1 MiB: both sides of DYNAMIQ_MIN_BYTES (1 MiB) for every dtype and op (64 KiB
    # and 4 MiB added 15 s of CI and no case).
    rows = run(a, ["-b", "256K", "-e", "1M", "-f", "4", "-d", "all", "-o", "all", "-n", "2",
                   "-w", "1"], {})
    compressed = 0
    for r in rows:
        eligible = (r["type"] in ("float", "bfloat16") and r["op"] in ("sum", "avg")
                    and r["bytes"] >= 1 << 20)
        if (r["dynamiq"] == "comp") != eligible:
            fail(f"{r['type']} {r['op']} {r['bytes']} B: dynamiq={r['dynamiq']}, eligible={eligible}")
        if r["wrong_oop"] or r["wrong_ip"]:
            fail(f"{r['type']} {r['op']} {r['bytes']} B: #wrong {r['wrong_oop']}/{r['wrong_ip']}")
        compressed += eligible
    if compressed != 4:  # float and bfloat16, sum and avg, at 1 MiB
        fail(f"{compressed} compressed rows, expected 4")
    print(f"PASS: {len(rows)} rows; the {compressed} eligible ones compressed, the rest exact")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("case")
    p.add_argument("--run", required=True)
    p.add_argument("--perf", required=True)
    p.add_argument("--shim", required=True)
    a = p.parse_args()
    build = os.path.dirname(os.path.dirname(os.path.abspath(a.run)))
    if not os.path.exists(os.path.join(build, "tools", "cpu-nccl", "libnccl.so.2")):
        print("SKIP: CPU NCCL not built")
        sys.exit(77)
    {"issue": case_issue, "mixed": case_mixed}[a.case](a)


if __name__ == "__main__":
    main()

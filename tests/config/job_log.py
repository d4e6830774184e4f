#!/usr/bin/env python3
"""The settings and the log of a real job: 2 ranks of dynamiq-perf on the CPU NCCL with the shim
preloaded, so that every process holds three copies of the core library (the shim, the CPU NCCL,
the net plugin).

job_log.py --run DYNAMIQ_RUN --perf DYNAMIQ_PERF --shim LIBDYNAMIQ
  1. DYNAMIQ_NET_NSOCKS=99: one warning per process (22 in all before); the job still runs and
     compresses.
Exit 0 pass, 1 fail."""
import argparse
import os
import re
import subprocess
import sys


def fail(msg):
    print("FAIL:", msg)
    sys.exit(1)


def run(a, extra_env, perf_args):
    env = dict(os.environ, LD_PRELOAD=a.shim, DYNAMIQ_ENABLE="1", DYNAMIQ_NET_IFNAME="lo",
               **extra_env)
    for key in ("DYNAMIQ_DEBUG", "DYNAMIQ_DEBUG_SUBSYS", "DYNAMIQ_DEBUG_FILE"):
        if key not in extra_env:
            env.pop(key, None)
    cmd = [a.run, "--cpu-nccl", "-n", "2", "--timeout", "300", "--", a.perf] + perf_args
    print("$", " ".join(f"{k}={v}" for k, v in extra_env.items()), " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=400)
    if proc.returncode != 0:
        fail(f"exit {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc.stdout + proc.stderr


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--run", required=True)
    p.add_argument("--perf", required=True)
    p.add_argument("--shim", required=True)
    a = p.parse_args()

    # 1. An invalid plugin setting: warned about once per process, not once per call or copy.
    out = run(a, {"DYNAMIQ_NET_NSOCKS": "99"}, ["-b", "1M", "-e", "4M", "-f", "4", "-n", "2"])
    warnings = [l for l in out.splitlines() if "DYNAMIQ_NET_NSOCKS=99" in l]
    if len(warnings) != 2:
        fail(f"{len(warnings)} warnings about DYNAMIQ_NET_NSOCKS=99, expected 2 (one per rank):\n"
             + "\n".join(warnings[:30]))
    line = re.compile(r"^\[([01])\] .*dynamiq.* WARN ENV settings\.cc:\d+ DYNAMIQ_NET_NSOCKS=99"
                      r" is not valid; accepted: 1\.\.8; the net plugin uses the default 2$")
    ranks = sorted(m[1] for m in (line.search(w) for w in warnings) if m)
    if ranks != ["0", "1"]:
        fail("warnings not in the expected form:\n" + "\n".join(warnings))
    if not re.search(r"\bcomp$", out, re.M):
        fail("nothing was compressed: an invalid plugin setting must not turn compression off")
    print("PASS: one warning per process; still compressed")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""The settings and the log of a real job: 2 ranks of dynamiq-perf on the CPU NCCL with the shim
preloaded, so that every process holds three copies of the core library (the shim, the CPU NCCL,
the net plugin).

job_log.py --run DYNAMIQ_RUN --perf DYNAMIQ_PERF --shim LIBDYNAMIQ
  1. DYNAMIQ_NET_NSOCKS=99: one warning per process (22 in all before), in NCCL's line format
     with the rank; the job still runs and compresses.
  2. DYNAMIQ_DEBUG=INFO DYNAMIQ_DEBUG_SUBSYS=ENV DYNAMIQ_DEBUG_FILE=DIR/dq.%h.%p.%r.log: one file
     per rank, named with host, pid and rank, holding the version once and every setting once;
     nothing of the log on the terminal. dynamiq-perf -b 1MiB -e 1MB: one size syntax.
  3. NCCL_DEBUG=INFO with DYNAMIQ_DEBUG unset: dynamiq's INFO lines too (the banner, the shim's
     NCCL), on each rank; NCCL_DEBUG=VERSION: none, the default WARN. With NCCL_DEBUG_FILE too:
     those lines in NCCL's file name and .dynamiq, one per rank, none on the terminal.
Exit 0 pass, 1 fail."""
import argparse
import glob
import os
import re
import socket
import subprocess
import sys
import tempfile

SETTINGS_DEF = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "config",
                            "settings.def")


def fail(msg):
    print("FAIL:", msg)
    sys.exit(1)


def run(a, extra_env, perf_args):
    env = dict(os.environ, LD_PRELOAD=a.shim, DYNAMIQ_ENABLE="1", DYNAMIQ_NET_IFNAME="lo",
               **extra_env)
    for key in ("DYNAMIQ_DEBUG", "DYNAMIQ_DEBUG_SUBSYS", "DYNAMIQ_DEBUG_FILE", "NCCL_DEBUG",
                "NCCL_DEBUG_SUBSYS", "NCCL_DEBUG_FILE"):
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
    host = socket.gethostname().split(".")[0]

    # 1. An invalid plugin setting: warned about once per process, not once per call or copy.
    out = run(a, {"DYNAMIQ_NET_NSOCKS": "99"}, ["-b", "1M", "-e", "4M", "-f", "4", "-n", "2"])
    warnings = [l for l in out.splitlines() if "DYNAMIQ_NET_NSOCKS=99" in l]
    if len(warnings) != 2:
        fail(f"{len(warnings)} warnings about DYNAMIQ_NET_NSOCKS=99, expected 2 (one per rank):\n"
             + "\n".join(warnings[:30]))
    # NCCL's field order; [-]: host memory, no CUDA device. dynamiq-run's "[rank] " prefix says
    # which rank's process warned.
    line = re.compile(r"^\[([01])\]\s+\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\] " + re.escape(host) +
                      r":\d+:\d+ \[-\] settings\.cc:\d+ dynamiq WARN DYNAMIQ_NET_NSOCKS=99"
                      r" is not valid; accepted: 1\.\.8; the net plugin uses the default 2$")
    ranks = sorted(m[1] for m in (line.search(w) for w in warnings) if m)
    if ranks != ["0", "1"]:
        fail("warnings not in the expected form:\n" + "\n".join(warnings))
    if not re.search(r"\bcomp$", out, re.M):
        fail("nothing was compressed: an invalid plugin setting must not turn compression off")
    print("PASS: one warning per process, NCCL-style, with the rank; still compressed")

    # 2. TRACE (every setting, not only those that differ) into per-rank files.
    entries = re.findall(r'DQ_SETTING\(\w+, \w+, "(DYNAMIQ_\w+)"', open(SETTINGS_DEF).read())
    with tempfile.TemporaryDirectory() as d:
        out = run(a, {"DYNAMIQ_DEBUG": "TRACE", "DYNAMIQ_DEBUG_SUBSYS": "ENV",
                      "DYNAMIQ_DEBUG_FILE": os.path.join(d, "dq.%h.%p.%r.log")},
                  ["-b", "1MiB", "-e", "1MB", "-n", "1", "-w", "0"])
        if "dynamiq INFO" in out or "dynamiq WARN" in out or "dynamiq TRACE" in out:
            fail("log lines on the terminal although DYNAMIQ_DEBUG_FILE is set:\n" + out[-3000:])
        files = sorted(glob.glob(os.path.join(d, "*")))
        names = [os.path.basename(f) for f in files]
        pattern = re.compile(r"dq\." + re.escape(host) + r"\.\d+\.([01])\.log$")
        if sorted(pattern.match(n)[1] if pattern.match(n) else "?" for n in names) != ["0", "1"]:
            fail(f"log files {names}, expected dq.{host}.PID.0.log and dq.{host}.PID.1.log")
        for f in files:
            text = open(f).read()
            if len(re.findall(r"dynamiq INFO dynamiq \d+\.\d+\.\d+ \(git \S+\), NCCL [^,]+, "
                              r"CUDA runtime [^,]+, CUDA driver .+$", text, re.M)) != 1:
                fail(f"{f}: the version line is not there once:\n{text[:3000]}")
            for key in entries:
                n = text.count(f"dynamiq setting {key}=")
                if n != 1:
                    fail(f"{f}: {key} listed {n} times:\n{text[:3000]}")
        if not re.search(r"^\[0\]\s+1048576\s", out, re.M):
            fail("dynamiq-perf -b 1MiB -e 1MB did not run the 1 MiB size:\n" + out[-2000:])
    print(f"PASS: one log file per rank, the version and all {len(entries)} settings once each")

    # 3. NCCL_DEBUG raises dynamiq's level while DYNAMIQ_DEBUG is unset, and never lowers it.
    perf = ["-b", "1M", "-e", "1M", "-n", "1", "-w", "0"]
    out = run(a, {"NCCL_DEBUG": "INFO"}, perf)
    for rank in ("0", "1"):
        for what in (r"dynamiq INFO dynamiq \d+\.\d+\.\d+ \(git ",
                     r"dynamiq INFO dynamiq: wrapping NCCL "):
            if not re.search(r"^\[" + rank + r"\].* " + what, out, re.M):
                fail(f"NCCL_DEBUG=INFO: rank {rank} has no line matching {what!r}:\n"
                     + out[-3000:])
    out = run(a, {"NCCL_DEBUG": "VERSION"}, perf)
    if "dynamiq INFO" in out or "dynamiq VERSION" in out:
        fail("NCCL_DEBUG=VERSION changed dynamiq's level:\n" + out[-3000:])
    print("PASS: NCCL_DEBUG=INFO shows dynamiq's INFO lines on every rank; VERSION leaves WARN")
    with tempfile.TemporaryDirectory() as d:
        out = run(a, {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_FILE": os.path.join(d, "nccl.%h.%p")},
                  perf)
        if "dynamiq INFO" in out or "dynamiq WARN" in out:
            fail("log lines on the terminal although NCCL_DEBUG_FILE is set:\n" + out[-3000:])
        names = sorted(os.listdir(d))
        pattern = re.compile(r"nccl\." + re.escape(host) + r"\.\d+\.dynamiq$")
        if len(names) != 2 or not all(pattern.match(n) for n in names):
            fail(f"files {names}, expected nccl.{host}.PID.dynamiq for each of the 2 ranks")
        for n in names:
            text = open(os.path.join(d, n)).read()
            if not re.search(r"dynamiq INFO dynamiq: wrapping NCCL ", text):
                fail(f"{n} lacks the shim's INFO line:\n{text[:3000]}")
    print("PASS: with NCCL_DEBUG_FILE, dynamiq's lines in NCCL's name and .dynamiq, per rank")


if __name__ == "__main__":
    main()

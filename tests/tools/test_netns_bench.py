#!/usr/bin/env python3
"""tools/bench/netns_allreduce.sh end to end at a small size, one case per invocation.

usage: test_netns_bench.py CASE --script PATH --build DIR
Exit 0 pass, 1 fail, 77 skipped (needs root, `ip netns`, tc and the CPU NCCL). The namespaces
use a per-test prefix (dqt<pid>), so a benchmark running under the default prefix is never
touched. Times are not asserted (noisy); bytes on the links, errors and clean-up are.
"""
import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time


# The bench script runs `python3` for its NCCL client (numpy): make that the Python running this
# test (meson's, with numpy), not whichever python3 comes first on PATH.
os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")

def fail(message):
    print("FAIL:", message)
    sys.exit(1)


def check(condition, message):
    if not condition:
        fail(message)


def skip(message):
    print("SKIP:", message)
    sys.exit(77)


def namespaces_with(prefix):
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(prefix + "-")]


def preconditions(a):
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"):
        skip("needs root, ip and tc")
    probe = f"dqt{os.getpid()}-probe"
    proc = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if proc.returncode != 0:
        skip(f"ip netns add is not allowed here: {proc.stderr.strip()}")
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    if not os.path.exists(os.path.join(a.build, "tools/cpu-nccl/libnccl.so.2")):
        skip("CPU NCCL not built")


def case_smoke(a):
    preconditions(a)
    prefix = f"dqt{os.getpid()}"
    shim = os.path.exists(os.path.join(a.build, "shim/libdynamiq.so"))
    modes = "bf16,fp32" + (",dynamiq5" if shim else "")
    with tempfile.TemporaryDirectory() as out:
        proc = subprocess.run([a.script, "-B", a.build, "-o", out, "-P", prefix, "-r", "2gbit",
                               "-s", "2M", "-k", "2", "-w", "1", "-m", modes, "-t", "120"],
                              capture_output=True, text=True, timeout=600)
        check(proc.returncode == 0, f"exit {proc.returncode}: {proc.stderr[-3000:]}")
        check(namespaces_with(prefix) == [], f"namespaces left: {namespaces_with(prefix)}")
        result = json.load(open(os.path.join(out, "result.json")))
        runs = {r["label"]: r for r in result["runs"]}
        check("tbf" in result["setup"] and "rate 2Gbit" in result["setup"],
              f"no shaping recorded: {result['setup']!r}")
        for label in modes.split(","):
            r = runs.get(label)
            check(r is not None and r["exit"] == 0, f"{label}: {r}")
            check(r["identical_on_all_ranks"] is True and r["finite"] is True, f"{label}: {r}")
            check(len(r["times_s"]) == 2 and r["median_s"] > 0, f"{label} times: {r}")
        check(runs["fp32"]["vnmse"] < 1e-12, f"fp32 pass-through is not exact: {runs['fp32']}")
        check(1e-7 < runs["bf16"]["vnmse"] < 1e-4, f"bf16 vNMSE off: {runs['bf16']['vnmse']}")
        # Ring all-reduce: every rank sends 2(n-1)/n of the buffer per call, 3 calls (1 warm-up
        # + 2 timed) plus small barriers; BF16 moves half the bytes of FP32.
        fp32_tx, bf16_tx = runs["fp32"]["link_tx_bytes"], runs["bf16"]["link_tx_bytes"]
        expected = 4 * 1.5 * 2 * 2**20 * 3
        check(expected <= fp32_tx < 1.3 * expected, f"fp32 link bytes {fp32_tx} vs {expected}")
        check(0.45 < bf16_tx / fp32_tx < 0.6, f"bf16/fp32 link bytes {bf16_tx}/{fp32_tx}")
        if shim:
            d = runs["dynamiq5"]
            check(d["shim_metrics_rank0"]["communicators"][0]["calls"]["rerouted"] >= 3,
                  f"dynamiq5 calls not rerouted: {d.get('shim_metrics_rank0')}")
            # 5 bits per value against BF16's 16 (plus statistics and headers).
            check(d["link_tx_bytes"] < 0.5 * bf16_tx, f"dynamiq5 link bytes {d['link_tx_bytes']}")
            check(d["vnmse"] < 0.05, f"dynamiq5 vNMSE {d['vnmse']}")


def case_smoke_reducescatter(a):
    """-c reducescatter: the same runs as ncclReduceScatter (each rank's 2 MiB is the send
    buffer): exact FP32, link bytes 0.75 x the send buffer per call, DynamiQ compressed."""
    preconditions(a)
    prefix = f"dqt{os.getpid()}"
    shim = os.path.exists(os.path.join(a.build, "shim/libdynamiq.so"))
    modes = "bf16,fp32" + (",dynamiq5" if shim else "")
    with tempfile.TemporaryDirectory() as out:
        proc = subprocess.run([a.script, "-B", a.build, "-o", out, "-P", prefix, "-r", "2gbit",
                               "-s", "2M", "-k", "2", "-w", "1", "-m", modes, "-t", "120",
                               "-c", "reducescatter"],
                              capture_output=True, text=True, timeout=600)
        check(proc.returncode == 0, f"exit {proc.returncode}: {proc.stderr[-3000:]}")
        check(namespaces_with(prefix) == [], f"namespaces left: {namespaces_with(prefix)}")
        result = json.load(open(os.path.join(out, "result.json")))
        check("collective=reducescatter" in result["setup"], f"setup: {result['setup']!r}")
        runs = {r["label"]: r for r in result["runs"]}
        for label in modes.split(","):
            r = runs.get(label)
            check(r is not None and r["exit"] == 0, f"{label}: {r}")
            check(r["collective"] == "reducescatter", f"{label}: {r}")
            check(r["identical_on_all_ranks"] is None and r["finite"] is True, f"{label}: {r}")
            check(len(r["times_s"]) == 2 and r["median_s"] > 0, f"{label} times: {r}")
        check(runs["fp32"]["vnmse"] < 1e-12, f"fp32 pass-through is not exact: {runs['fp32']}")
        check(1e-7 < runs["bf16"]["vnmse"] < 1e-4, f"bf16 vNMSE off: {runs['bf16']['vnmse']}")
        # Ring reduce-scatter: every rank sends (n-1)/n of its send buffer per call, 3 calls, plus
        # barriers and the final pass-through all-gather of the blocks (3/4 of 2 MiB per rank).
        fp32_tx, bf16_tx = runs["fp32"]["link_tx_bytes"], runs["bf16"]["link_tx_bytes"]
        expected = 4 * 0.75 * 2 * 2**20 * 3 + 4 * 0.75 * 2 * 2**20
        check(expected <= fp32_tx < 1.3 * expected, f"fp32 link bytes {fp32_tx} vs {expected}")
        check(0.45 < bf16_tx / fp32_tx < 0.6, f"bf16/fp32 link bytes {bf16_tx}/{fp32_tx}")
        if shim:
            d = runs["dynamiq5"]
            check(d["shim_metrics_rank0"]["communicators"][0]["calls"]["rerouted"] >= 3,
                  f"dynamiq5 calls not rerouted: {d.get('shim_metrics_rank0')}")
            # 3 compressed calls at ~5/16 of BF16's bytes, and one all-gather of FP32 blocks.
            gather = 4 * 0.75 * 2 * 2**20
            check(d["link_tx_bytes"] - gather < 0.4 * (bf16_tx - gather / 2),
                  f"dynamiq5 link bytes {d['link_tx_bytes']} vs bf16 {bf16_tx}")
            check(d["vnmse"] < 0.05, f"dynamiq5 vNMSE {d['vnmse']}")


def case_interrupt(a):
    """Ctrl-C in the middle of a run: every namespace and rank process goes away."""
    preconditions(a)
    prefix = f"dqt{os.getpid()}"
    with tempfile.TemporaryDirectory() as out:
        proc = subprocess.Popen([a.script, "-B", a.build, "-o", out, "-P", prefix, "-s", "64M",
                                 "-k", "50", "-w", "0", "-m", "fp32", "-t", "300"],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 60
        ranks_seen = False
        while time.monotonic() < deadline and not ranks_seen:
            time.sleep(0.2)
            if os.path.exists(os.path.join(out, "fp32.log")):
                pids = subprocess.run(["ip", "netns", "pids", f"{prefix}-0"],
                                      capture_output=True, text=True).stdout.split()
                ranks_seen = bool(pids)
        if not ranks_seen:
            proc.kill()
            fail("the fp32 ranks never started")
        proc.send_signal(signal.SIGINT)
        try:
            output, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            fail("script did not stop within 60 s of SIGINT")
        check(proc.returncode != 0, "interrupted script exited 0")
        check(namespaces_with(prefix) == [], f"namespaces left: {namespaces_with(prefix)}")
        check("interrupted" in output, f"no interruption message: {output[-2000:]!r}")


CASES = {name[5:]: fn for name, fn in globals().items() if name.startswith("case_")}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("case", choices=sorted(CASES))
    parser.add_argument("--script", required=True)
    parser.add_argument("--build", required=True)
    a = parser.parse_args()
    CASES[a.case](a)
    print("PASS", a.case)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""dynamiq-run's --rank-env, --master-addr and --rank-netns, one case per invocation.

usage: test_dynamiq_run_netns.py CASE --run PATH [--perf PATH] [--build DIR]
Exit 0 pass, 1 fail, 77 skipped (the namespace cases need root and `ip netns`). Namespaces are
named dqtest-<pid>-<i>, addresses are in 198.18.0.0/15, and every namespace this test creates
is deleted before it exits.
"""
import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

PY = sys.executable


def fail(message):
    print("FAIL:", message)
    sys.exit(1)


def check(condition, message):
    if not condition:
        fail(message)


def skip(message):
    print("SKIP:", message)
    sys.exit(77)


def launch(run, args, timeout=120, env=None):
    return subprocess.run([run] + args, capture_output=True, text=True, timeout=timeout, env=env)


def rank_lines(stdout, tag):
    seen = {}
    for line in stdout.splitlines():
        m = re.match(rf"^\[(\d+)\] {tag} (.*)$", line)
        if m:
            seen[int(m.group(1))] = m.group(2)
    return seen


def case_rank_env(a):
    env = dict(os.environ, DQ_TEST_X="outer", DQ_TEST_KEEP="kept")
    proc = launch(a.run, ["-n", "3", "--master-addr", "198.18.0.9", "--rank-env",
                          "DQ_TEST_X=first{rank}", "--rank-env", "DQ_TEST_X=x{rank}-{rank}",
                          "--rank-env", "DQ_TEST_NEW==if{rank}", "--", "sh", "-c",
                          'echo "V $DQ_TEST_X $DQ_TEST_NEW $DQ_TEST_KEEP $MASTER_ADDR $RANK"'],
                  env=env)
    check(proc.returncode == 0, f"exit {proc.returncode}: {proc.stderr}")
    seen = rank_lines(proc.stdout, "V")
    check(sorted(seen) == [0, 1, 2], f"ranks seen {sorted(seen)}: {proc.stdout!r}")
    for r, v in seen.items():
        # The last --rank-env for a name wins over earlier ones and over the inherited value.
        check(v == f"x{r}-{r} =if{r} kept 198.18.0.9 {r}", f"rank {r}: {v!r}")


def case_rank_env_cpu_nccl(a):
    # With --cpu-nccl the launcher defaults DYNAMIQ_NET_IFNAME to lo; a --rank-env replaces it.
    libs = [os.path.join(a.build, "tools/cpu-nccl/libnccl.so.2"),
            os.path.join(a.build, "plugin/abi/libnccl-net-dynamiq.so")]
    if not all(os.path.exists(p) for p in libs):
        skip("CPU NCCL or plugin not built")
    env = {k: v for k, v in os.environ.items() if k != "DYNAMIQ_NET_IFNAME"}
    script = 'echo "V $DYNAMIQ_NET_IFNAME"'
    proc = launch(a.run, ["-n", "2", "--cpu-nccl", "--", "sh", "-c", script], env=env)
    check(proc.returncode == 0 and set(rank_lines(proc.stdout, "V").values()) == {"lo"},
          f"default: {proc.stdout!r} {proc.stderr!r}")
    proc = launch(a.run, ["-n", "2", "--cpu-nccl", "--rank-env", "DYNAMIQ_NET_IFNAME=v{rank}",
                          "--", "sh", "-c", script], env=env)
    check(proc.returncode == 0 and rank_lines(proc.stdout, "V") == {0: "v0", 1: "v1"},
          f"override: {proc.stdout!r} {proc.stderr!r}")


class Namespaces:
    """Creates dqtest-<pid>-0..n-1 (skips the test when the kernel or user may not)."""

    def __init__(self, count):
        if os.geteuid() != 0 or shutil.which("ip") is None:
            skip("needs root and iproute2 (ip netns)")
        self.names = [f"dqtest-{os.getpid()}-{i}" for i in range(count)]
        self.made = []

    def __enter__(self):
        for name in self.names:
            proc = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
            if proc.returncode != 0:
                self.__exit__()
                skip(f"ip netns add failed: {proc.stderr.strip()}")
            self.made.append(name)
        return self

    def ip(self, *args):
        proc = subprocess.run(["ip"] + list(args), capture_output=True, text=True, timeout=30)
        check(proc.returncode == 0, f"ip {' '.join(args)}: {proc.stderr}")
        return proc.stdout

    def __exit__(self, *exc):
        for name in self.made:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        self.made = []


def case_netns(a):
    with Namespaces(2) as ns:
        pattern = f"dqtest-{os.getpid()}-{{rank}}"
        proc = launch(a.run, ["-n", "2", "--rank-netns", pattern, "--", "sh", "-c",
                              'echo "NS $(readlink /proc/self/ns/net) $(cat /proc/net/dev | '
                              'tail -n +3 | cut -d: -f1 | tr -d " " | tr "\\n" ,)"'])
        check(proc.returncode == 0, f"exit {proc.returncode}: {proc.stderr}")
        seen = rank_lines(proc.stdout, "NS")
        check(sorted(seen) == [0, 1], f"ranks seen: {proc.stdout!r}")
        here = os.readlink("/proc/self/ns/net")
        for r, text in seen.items():
            inode = os.stat(f"/run/netns/{ns.names[r]}").st_ino
            ns_link, devices = text.split(" ")
            check(ns_link == f"net:[{inode}]", f"rank {r} in {ns_link}, expected inode {inode}")
            check(ns_link != here, f"rank {r} stayed in the launcher's namespace")
            # A fresh namespace has only its loopback.
            check(devices == "lo,", f"rank {r} sees devices {devices!r}")

        # A namespace that does not exist: usage error before any rank starts.
        with tempfile.TemporaryDirectory() as tmp:
            marker = os.path.join(tmp, "started")
            proc = launch(a.run, ["-n", "3", "--rank-netns", pattern, "--", "sh", "-c",
                                  f"touch {marker}.$RANK"])
            check(proc.returncode == 2, f"missing namespace: exit {proc.returncode}")
            check(f"/run/netns/dqtest-{os.getpid()}-2" in proc.stderr and "rank 2" in proc.stderr,
                  f"message {proc.stderr!r}")
            check(not any(f.startswith("started") for f in os.listdir(tmp)),
                  "a rank started although a namespace was missing")
            # A namespace file of another kind is refused too.
            proc = launch(a.run, ["-n", "1", "--rank-netns", "/proc/self/ns/uts", "--", "true"])
            check(proc.returncode == 2 and "not a network namespace" in proc.stderr,
                  f"uts namespace: exit {proc.returncode} {proc.stderr!r}")


def case_netns_cpu_nccl(a):
    """Two ranks in two namespaces joined by one veth: the CPU NCCL all-reduce runs over it."""
    libs = [os.path.join(a.build, "tools/cpu-nccl/libnccl.so.2"),
            os.path.join(a.build, "plugin/abi/libnccl-net-dynamiq.so")]
    if a.perf is None or not os.path.exists(a.perf) or not all(os.path.exists(p) for p in libs):
        skip("dynamiq-perf, the CPU NCCL or the plugin is not built")
    with Namespaces(2) as ns:
        stem = f"dqt{os.getpid() % 100000}"  # rank r's end is <stem><r> (15 characters at most)
        veth = [f"{stem}0", f"{stem}1"]
        ns.ip("-n", ns.names[0], "link", "add", veth[0], "type", "veth", "peer", "name", veth[1],
              "netns", ns.names[1])
        for i in range(2):
            ns.ip("-n", ns.names[i], "addr", "add", f"198.18.7.{i + 1}/24", "dev", veth[i])
            ns.ip("-n", ns.names[i], "link", "set", veth[i], "up")
            ns.ip("-n", ns.names[i], "link", "set", "lo", "up")

        def tx_bytes():
            out = ns.ip("-n", ns.names[0], "-s", "link", "show", "dev", veth[0])
            lines = out.splitlines()
            idx = next(i for i, l in enumerate(lines) if l.strip().startswith("TX:"))
            return int(lines[idx + 1].split()[0])

        before = tx_bytes()
        proc = launch(a.run, ["-n", "2", "--cpu-nccl", "--timeout", "200", "--rank-netns",
                              f"dqtest-{os.getpid()}-{{rank}}", "--master-addr", "198.18.7.1",
                              "--rank-env", f"DYNAMIQ_NET_IFNAME=={stem}{{rank}}",
                              "--", a.perf, "-b", "4M", "-e", "4M", "-n", "2", "-w", "1",
                              "-d", "float", "-o", "sum"], timeout=240)
        check(proc.returncode == 0,
              f"exit {proc.returncode}: {proc.stdout[-2000:]} {proc.stderr[-2000:]}")
        sent = tx_bytes() - before
        check("# Out of bounds values : 0 OK" in proc.stdout, f"perf output {proc.stdout!r}")
        # Ring all-reduce of 4 MiB on 2 ranks: each rank sends 4 MiB per operation, and
        # dynamiq-perf runs at least 3 out-of-place + 3 in-place + 2 checks.
        check(sent >= 8 * 4 * 2**20, f"only {sent} bytes left rank 0 over {veth[0]}")


CASES = {name[5:]: fn for name, fn in globals().items() if name.startswith("case_")}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("case", choices=sorted(CASES))
    parser.add_argument("--run", required=True, help="the dynamiq-run executable")
    parser.add_argument("--perf", help="the dynamiq-perf executable")
    parser.add_argument("--build", help="the build directory")
    a = parser.parse_args()
    CASES[a.case](a)
    print("PASS", a.case)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""dynamiq-run behaviour, one case per invocation: test_dynamiq_run.py CASE --run PATH [...].

Exit 0 pass, 1 fail, 77 skipped. The programs the launcher starts are small inline Python or
shell scripts, so every case checks the launcher, not some other tool.
"""
import argparse
import json
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time

PY = sys.executable


def fail(message):
    print("FAIL:", message)
    sys.exit(1)


def check(condition, message):
    if not condition:
        fail(message)


def launch(run, args, timeout=60, env=None, **kwargs):
    started = time.monotonic()
    proc = subprocess.run([run] + args, capture_output=True, text=True, timeout=timeout, env=env,
                          **kwargs)
    return proc, time.monotonic() - started


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purposes (its parent is gone or will reap it).
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1].split()[0] != "Z"
    except OSError:
        return False


def case_env(a):
    script = ("import json, os, stat;"
              "keys = ['RANK','WORLD_SIZE','LOCAL_RANK','LOCAL_WORLD_SIZE','MASTER_ADDR',"
              "'MASTER_PORT','DYNAMIQ_RUN_DIR','LD_LIBRARY_PATH','NCCL_NET_PLUGIN'];"
              "d = {k: os.environ.get(k) for k in keys};"
              "st = os.stat(d['DYNAMIQ_RUN_DIR']);"
              "d['dir_mode'] = stat.S_IMODE(st.st_mode); d['dir_is_dir'] = stat.S_ISDIR(st.st_mode);"
              "print('ENV ' + json.dumps(d))")
    env = dict(os.environ, RANK="99", WORLD_SIZE="99", LD_LIBRARY_PATH="/outer/lib",
               NCCL_NET_PLUGIN="outer")
    proc, _ = launch(a.run, ["-n", "5", "--", PY, "-c", script], env=env)
    check(proc.returncode == 0, f"exit {proc.returncode}: {proc.stderr}")
    seen = {}
    for line in proc.stdout.splitlines():
        m = re.match(r"^\[(\d+)\] ENV (.*)$", line)
        check(m is not None, f"unexpected line {line!r}")
        seen[int(m.group(1))] = json.loads(m.group(2))
    check(sorted(seen) == list(range(5)), f"ranks seen: {sorted(seen)}")
    ports, dirs = set(), set()
    for prefix_rank, d in seen.items():
        check(d["RANK"] == str(prefix_rank), f"RANK {d['RANK']} under prefix [{prefix_rank}]")
        check(d["LOCAL_RANK"] == str(prefix_rank), f"LOCAL_RANK {d['LOCAL_RANK']}")
        check(d["WORLD_SIZE"] == "5" and d["LOCAL_WORLD_SIZE"] == "5", f"sizes {d}")
        check(d["MASTER_ADDR"] == "127.0.0.1", f"MASTER_ADDR {d['MASTER_ADDR']}")
        check(d["dir_is_dir"] and d["dir_mode"] == 0o700, f"run dir mode {oct(d['dir_mode'])}")
        # Without --cpu-nccl the library path and plugin pass through untouched.
        check(d["LD_LIBRARY_PATH"] == "/outer/lib", f"LD_LIBRARY_PATH {d['LD_LIBRARY_PATH']}")
        check(d["NCCL_NET_PLUGIN"] == "outer", f"NCCL_NET_PLUGIN {d['NCCL_NET_PLUGIN']}")
        ports.add(d["MASTER_PORT"])
        dirs.add(d["DYNAMIQ_RUN_DIR"])
    check(len(ports) == 1 and 1024 <= int(next(iter(ports))) < 65535, f"ports {ports}")
    check(len(dirs) == 1, f"run dirs {dirs}")
    check(not os.path.exists(next(iter(dirs))), "run dir left behind after the job")
    # The port was free: we can bind it ourselves now that the job is over.
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", int(next(iter(ports)))))


def case_cpu_nccl_env(a):
    build = os.path.abspath(a.build)
    nccl_dir = os.path.join(build, "tools", "cpu-nccl")
    plugin_dir = os.path.join(build, "plugin", "abi")
    if not (os.path.exists(os.path.join(nccl_dir, "libnccl.so.2")) and
            os.path.exists(os.path.join(plugin_dir, "libnccl-net-dynamiq.so"))):
        print("SKIP: CPU NCCL or net plugin not built")
        sys.exit(77)
    script = "import os; print('LIB', os.environ['LD_LIBRARY_PATH'], os.environ['NCCL_NET_PLUGIN'])"
    env = dict(os.environ, LD_LIBRARY_PATH="/outer/lib")
    proc, _ = launch(a.run, ["-n", "2", "--cpu-nccl", "--", PY, "-c", script], env=env)
    check(proc.returncode == 0, f"exit {proc.returncode}: {proc.stderr}")
    want = f"LIB {nccl_dir}:{plugin_dir}:/outer/lib dynamiq"
    for line in proc.stdout.splitlines():
        check(line.split("] ", 1)[1] == want, f"{line!r} != {want!r}")
    # A launcher copied away from the build tree cannot find them: a clear usage error.
    with tempfile.TemporaryDirectory() as tmp:
        lone = os.path.join(tmp, "tools", "dynamiq-run", "dynamiq-run")
        os.makedirs(os.path.dirname(lone))
        shutil.copy2(a.run, lone)
        proc, _ = launch(lone, ["-n", "1", "--cpu-nccl", "--", "true"])
        check(proc.returncode == 2, f"exit {proc.returncode}")
        check("libnccl.so.2" in proc.stderr, f"message: {proc.stderr!r}")


def case_exit_code(a):
    proc, _ = launch(a.run, ["-n", "3", "--", "sh", "-c", "exit 0"])
    check(proc.returncode == 0, f"all ranks 0 -> {proc.returncode}")
    # Only rank 2 fails: its code comes back, whatever the others do.
    proc, _ = launch(a.run, ["-n", "3", "--", "sh", "-c", 'if [ "$RANK" = 2 ]; then exit 7; fi'])
    check(proc.returncode == 7, f"rank 2 exit 7 -> {proc.returncode}")
    check("rank 2" in proc.stderr, f"no rank named: {proc.stderr!r}")
    # The first failure wins: rank 1 fails at once, rank 0 later with another code.
    proc, _ = launch(a.run, ["-n", "2", "--grace", "3", "--", "sh", "-c",
                             'if [ "$RANK" = 1 ]; then exit 5; fi; trap "exit 9" TERM; '
                             'sleep 10 & wait'])
    check(proc.returncode == 5, f"first failure 5 -> {proc.returncode}")
    # Signal deaths map to 128 + signal.
    proc, _ = launch(a.run, ["-n", "2", "--", "sh", "-c",
                             'if [ "$RANK" = 0 ]; then kill -KILL $$; fi; sleep 10'])
    check(proc.returncode == 128 + signal.SIGKILL, f"SIGKILL -> {proc.returncode}")
    proc, _ = launch(a.run, ["-n", "1", "--", PY, "-c", "import os; os.abort()"])
    check(proc.returncode == 128 + signal.SIGABRT, f"SIGABRT -> {proc.returncode}")
    # A program that does not exist.
    proc, _ = launch(a.run, ["-n", "2", "--", "/nonexistent/program"])
    check(proc.returncode == 127, f"missing program -> {proc.returncode}")
    check("/nonexistent/program" in proc.stderr, f"message: {proc.stderr!r}")


def case_fail_fast(a):
    with tempfile.TemporaryDirectory() as tmp:
        # Ranks 1..3 record their pid and the pid of a grandchild, then sleep; rank 0 fails
        # after they started. Everything must be gone soon after, the grandchildren included.
        script = (f'echo $$ > {tmp}/pid.$RANK; sleep 60 & echo $! > {tmp}/child.$RANK; '
                  f'if [ "$RANK" = 0 ]; then '
                  f'  for i in $(seq 100); do [ $(ls {tmp} | wc -l) -ge 8 ] && break; sleep 0.05; done; '
                  f'  exit 3; fi; wait')
        proc, took = launch(a.run, ["-n", "4", "--", "sh", "-c", script])
        check(proc.returncode == 3, f"exit {proc.returncode}: {proc.stderr}")
        check(took < 10, f"took {took:.1f} s to stop the other ranks (they sleep 60 s)")
        pids = [int(open(os.path.join(tmp, f)).read()) for f in os.listdir(tmp)]
        check(len(pids) == 8, f"pid files: {os.listdir(tmp)}")
        deadline = time.monotonic() + 2
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        check(not any(alive(p) for p in pids), "a rank or its child outlived the launcher")
    # A rank that ignores SIGTERM is killed after the grace period.
    proc, took = launch(a.run, ["-n", "2", "--grace", "1", "--", "sh", "-c",
                                'if [ "$RANK" = 0 ]; then sleep 0.3; exit 4; fi; '
                                'trap "" TERM; sleep 30 & wait; sleep 30'])
    check(proc.returncode == 4, f"exit {proc.returncode}")
    check(1 <= took < 10, f"took {took:.1f} s (grace 1 s, ranks sleep 30 s)")
    check("SIGKILL" in proc.stderr, f"no SIGKILL notice: {proc.stderr!r}")


def case_leftovers(a):
    """Every rank exits 0, one leaving a process behind that holds its output open: the launcher
    exits soon with 0, and the leftover process is gone with the job."""
    with tempfile.TemporaryDirectory() as tmp:
        script = (f'if [ "$RANK" = 1 ]; then sleep 60 & echo $! > {tmp}/left; fi; exit 0')
        proc, took = launch(a.run, ["-n", "2", "--grace", "1", "--", "sh", "-c", script])
        check(proc.returncode == 0, f"exit {proc.returncode}: {proc.stderr}")
        check(took < 10, f"took {took:.1f} s (the leftover sleeps 60 s)")
        left = int(open(os.path.join(tmp, "left")).read())
        deadline = time.monotonic() + 2
        while alive(left) and time.monotonic() < deadline:
            time.sleep(0.05)
        check(not alive(left), "the process a rank left behind outlived the launcher")


def case_leftovers_as_init(a):
    """The same with the launcher as its own PID namespace's init (a container without --init),
    where a leftover process it stops becomes its child: the launcher reaps it, so the job ends as
    soon as it has stopped, not after the whole grace period with a needless SIGKILL."""
    if subprocess.run(["unshare", "-pf", "--mount-proc", "true"], capture_output=True).returncode:
        print("SKIP: unshare -pf (a PID namespace) is not permitted here")
        sys.exit(77)
    script = 'if [ "$RANK" = 1 ]; then sleep 60 & fi; exit 0'
    proc, took = launch("unshare", ["-pf", "--mount-proc", a.run, "-n", "2", "--grace", "5", "--",
                                    "sh", "-c", script])
    check(proc.returncode == 0, f"exit {proc.returncode}: {proc.stderr}")
    check(took < 4, f"took {took:.1f} s: the stopped leftover, a zombie child of the launcher, "
          f"was waited for until the 5 s grace ran out")


def case_timeout(a):
    proc, took = launch(a.run, ["-n", "3", "--timeout", "1", "--", "sleep", "30"])
    check(proc.returncode == 124, f"exit {proc.returncode}")
    check(0.9 <= took < 10, f"took {took:.1f} s for --timeout 1 (ranks sleep 30 s)")
    check("timeout" in proc.stderr, f"message: {proc.stderr!r}")
    # A job that finishes in time is not affected by the timeout.
    proc, took = launch(a.run, ["-n", "2", "--timeout", "20", "--", "sleep", "0.2"])
    check(proc.returncode == 0 and took < 15, f"exit {proc.returncode} after {took:.1f} s")


def case_prefix(a):
    # Each rank writes whole and partial lines in odd-sized raw writes to stdout and stderr;
    # the launcher must emit every line whole, once, with the right prefix.
    script = r"""
import os, random
rank = int(os.environ['RANK'])
rng = random.Random(rank)
for stream, fd in (('out', 1), ('err', 2)):
    text = ''.join(f'{stream} rank {rank} line {i} ' + 'x' * rng.randrange(0, 300) + '\n'
                   for i in range(300))
    text += f'{stream} rank {rank} tail without newline'
    data = text.encode()
    pos = 0
    while pos < len(data):
        n = rng.randrange(1, 700)
        pos += os.write(fd, data[pos:pos + n])
"""
    proc, _ = launch(a.run, ["-n", "4", "--", PY, "-c", script])
    check(proc.returncode == 0, f"exit {proc.returncode}: {proc.stderr[-500:]}")
    for stream, text in (("out", proc.stdout), ("err", proc.stderr)):
        counts = {}
        for line in text.splitlines():
            m = re.match(rf"^\[(\d)\] {stream} rank (\d) (line (\d+) x*|tail without newline)$",
                         line)
            check(m is not None, f"mangled {stream} line {line[:120]!r}")
            check(m.group(1) == m.group(2), f"rank {m.group(2)} output under prefix [{m.group(1)}]")
            counts[int(m.group(1))] = counts.get(int(m.group(1)), 0) + 1
        check(counts == {r: 301 for r in range(4)}, f"{stream} line counts {counts}")
    # A 150000-byte line comes out in 64 KiB pieces, each prefixed, none lost.
    proc, _ = launch(a.run, ["-n", "2", "--", PY, "-c",
                             "import sys; sys.stdout.write('y' * 150000 + '\\n')"])
    check(proc.returncode == 0, f"exit {proc.returncode}")
    for rank in (0, 1):
        pieces = [len(l) - 4 for l in proc.stdout.splitlines() if l.startswith(f"[{rank}] ")]
        check(pieces == [65536, 65536, 150000 - 131072], f"rank {rank} pieces {pieces}")
        check(all(set(l[4:]) == {"y"} for l in proc.stdout.splitlines()), "mangled long line")


def case_usage(a):
    for args in ([], ["-n"], ["-n", "0", "true"], ["-n", "x", "true"], ["-n", "2"],
                 ["-n", "2", "--"], ["--bogus", "-n", "2", "true"],
                 ["-n", "2", "--timeout", "-3", "true"], ["--timeout", "1", "true"]):
        proc, _ = launch(a.run, args)
        check(proc.returncode == 2, f"{args} -> exit {proc.returncode}")
        check(proc.stderr.startswith("dynamiq-run: ") and "usage:" in proc.stderr,
              f"{args}: message {proc.stderr!r}")
    proc, _ = launch(a.run, ["--help"])
    check(proc.returncode == 0 and "usage:" in proc.stdout, "--help")


def case_signal(a):
    # SIGTERM to the launcher stops the ranks and exits 128+15.
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.Popen([a.run, "-n", "3", "--", "sh", "-c",
                                 f"echo $$ > {tmp}/pid.$RANK; exec sleep 30"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 10
        while len(os.listdir(tmp)) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        check(len(os.listdir(tmp)) == 3, "ranks did not start")
        pids = [int(open(os.path.join(tmp, f)).read()) for f in os.listdir(tmp)]
        proc.send_signal(signal.SIGTERM)
        try:
            proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            fail("launcher ignored SIGTERM")
        check(proc.returncode == 128 + signal.SIGTERM, f"exit {proc.returncode}")
        check(not any(alive(p) for p in pids), "ranks outlived the launcher")


def probe_ids(output):
    ids = {}
    for line in output.splitlines():
        m = re.search(r"rank (\d+) of (\d+) id ([0-9a-f]{256})$", line)
        if m:
            ids[int(m.group(1))] = m.group(3)
    return ids


def case_rendezvous_file(a):
    proc, _ = launch(a.run, ["-n", "4", "--", a.probe])
    check(proc.returncode == 0, f"exit {proc.returncode}: {proc.stderr}")
    ids = probe_ids(proc.stdout)
    check(sorted(ids) == [0, 1, 2, 3], f"ranks {sorted(ids)}: {proc.stdout}")
    check(len(set(ids.values())) == 1, "ranks got different ids")
    check(set(next(iter(ids.values()))) != {"0"}, "id is all zeros")
    # Rank 0 never publishes: the others give up after the timeout with a clear error.
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, RANK="1", WORLD_SIZE="2", DYNAMIQ_RUN_DIR=tmp,
                   DYNAMIQ_RENDEZVOUS_TIMEOUT="1")
        started = time.monotonic()
        proc = subprocess.run([a.probe], env=env, capture_output=True, text=True, timeout=30)
        took = time.monotonic() - started
        check(proc.returncode == 1, f"exit {proc.returncode}")
        check(0.9 <= took < 10, f"gave up after {took:.1f} s")
        check("never appeared" in proc.stderr, f"message: {proc.stderr!r}")


def free_port_pair():
    for _ in range(50):
        with socket.socket() as s0, socket.socket() as s1:
            s0.bind(("127.0.0.1", 0))
            port = s0.getsockname()[1]
            try:
                s1.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port
    fail("no free port pair")


def case_rendezvous_tcp(a):
    # The torchrun case: RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT only, no DYNAMIQ_RUN_DIR.
    port = free_port_pair()
    base = {k: v for k, v in os.environ.items() if k != "DYNAMIQ_RUN_DIR"}
    procs = []
    for rank in (3, 1, 2, 0):  # rank 0 last: the others must wait for it
        env = dict(base, RANK=str(rank), WORLD_SIZE="4", LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   DYNAMIQ_RENDEZVOUS_TIMEOUT="20")
        procs.append(subprocess.Popen([a.probe], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
        time.sleep(0.1)
    outputs = ""
    for p in procs:
        out, err = p.communicate(timeout=30)
        check(p.returncode == 0, f"probe exit {p.returncode}: {err}")
        outputs += out
    ids = probe_ids(outputs)
    check(sorted(ids) == [0, 1, 2, 3] and len(set(ids.values())) == 1, f"ids {ids}")
    # No rank 0: a clear timeout.
    env = dict(base, RANK="1", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port_pair()), DYNAMIQ_RENDEZVOUS_TIMEOUT="1")
    started = time.monotonic()
    proc = subprocess.run([a.probe], env=env, capture_output=True, text=True, timeout=30)
    took = time.monotonic() - started
    check(proc.returncode == 1 and 0.9 <= took < 10, f"exit {proc.returncode} after {took:.1f} s")
    check("within" in proc.stderr, f"message: {proc.stderr!r}")
    # Without any rendezvous variable a multi-rank job is refused at once.
    env = dict(base, RANK="1", WORLD_SIZE="2")
    env.pop("MASTER_ADDR", None)
    env.pop("MASTER_PORT", None)
    proc = subprocess.run([a.probe], env=env, capture_output=True, text=True, timeout=30)
    check(proc.returncode == 1 and "DYNAMIQ_RUN_DIR" in proc.stderr, f"message {proc.stderr!r}")


CASES = {name[5:]: fn for name, fn in globals().items() if name.startswith("case_")}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("case", choices=sorted(CASES))
    parser.add_argument("--run", required=True, help="the dynamiq-run executable")
    parser.add_argument("--probe", help="the rendezvous_probe executable")
    parser.add_argument("--build", help="the build directory")
    a = parser.parse_args()
    CASES[a.case](a)
    print("PASS", a.case)


if __name__ == "__main__":
    main()

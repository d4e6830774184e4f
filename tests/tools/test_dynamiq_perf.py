#!/usr/bin/env python3
"""dynamiq-perf: usage errors, and full runs on the CPU NCCL under dynamiq-run.

test_dynamiq_perf.py CASE --perf PATH [--run PATH --build DIR --shim PATH]; exit 0 pass, 1 fail,
77 skip.
"""
import argparse
import math
import os
import re
import subprocess
import sys

DTYPE_BYTES = {"int8": 1, "uint8": 1, "int32": 4, "uint32": 4, "int64": 8, "uint64": 8,
               "half": 2, "float": 4, "double": 8, "bfloat16": 2}
OPS = ["sum", "prod", "max", "min", "avg"]
ROW = re.compile(r"^\[0\]\s+(\d+)\s+(\d+)\s+(\w+)\s+(\w+)\s+(-?\d+)"
                 r"\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)"
                 r"\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)$")
# The same, with the `dynamiq` column (comp / pass) a preloaded shim adds.
ROW_SHIM = re.compile(ROW.pattern[:-1] + r"\s+(comp|pass)$")


def fail(message):
    print("FAIL:", message)
    sys.exit(1)


def check(condition, message):
    if not condition:
        fail(message)


def case_usage(a):
    for args in (["-x"], ["-b", "2Q"], ["-b", "1M", "-e", "1K"], ["-d", "nope"], ["-o", "xor"],
                 ["-n", "0"], ["-b"], ["--memory", "gpu"], ["-c", "allgather"],
                 ["--collective", "2"], ["-r", "-3"]):
        proc = subprocess.run([a.perf] + args, capture_output=True, text=True, timeout=30)
        check(proc.returncode == 2, f"{args} -> exit {proc.returncode}: {proc.stderr}")
        check(proc.stderr.startswith("dynamiq-perf: ") and "usage:" in proc.stderr,
              f"{args}: message {proc.stderr!r}")
    proc = subprocess.run([a.perf, "-h"], capture_output=True, text=True, timeout=30)
    check(proc.returncode == 0 and "-b, --minbytes" in proc.stdout, "-h")
    check("reducescatter" in proc.stdout and "-r, --root" in proc.stdout, "-h names -c and -r")


def need_cpu_nccl(a):
    build = os.path.abspath(a.build)
    for lib in (os.path.join(build, "tools", "cpu-nccl", "libnccl.so.2"),
                os.path.join(build, "plugin", "abi", "libnccl-net-dynamiq.so")):
        if not os.path.exists(lib):
            print(f"SKIP: {lib} is not built")
            sys.exit(77)


def run_perf(a, ranks, perf_args, timeout):
    cmd = [a.run, "--cpu-nccl", "-n", str(ranks), "--timeout", str(timeout), "--", a.perf]
    cmd += perf_args
    print("$", " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout + 30)
    sys.stdout.write(proc.stdout[-3000:])
    check(proc.returncode == 0, f"exit {proc.returncode}; stderr: {proc.stderr[-2000:]}")
    rows = []
    for line in proc.stdout.splitlines():
        m = ROW.match(line)
        if m:
            rows.append(m.groups())
    return proc.stdout, rows


def check_rows(rows, ranks, want_keys, lossy):
    seen = set()
    for r in rows:
        size, count, dtype, op, root = int(r[0]), int(r[1]), r[2], r[3], int(r[4])
        key = (dtype, op, size)
        check(key not in seen, f"row {key} printed twice")
        seen.add(key)
        check(root == -1, f"root {root}")
        check(count * DTYPE_BYTES[dtype] == size, f"{key}: count {count}")
        for time_us, algbw, busbw, wrong in (r[5:9], r[9:13]):
            check(float(time_us) > 0, f"{key}: time {time_us}")
            # busbw = algbw * 2(n-1)/n, both printed with 2 decimals.
            expected = float(algbw) * 2 * (ranks - 1) / ranks
            check(abs(float(busbw) - expected) <= 0.011 + 0.01 * expected,
                  f"{key}: busbw {busbw} vs algbw {algbw}")
            check(wrong == "0", f"{key}: #wrong {wrong}")
        for vnmse, ident in (r[13:15], r[15:17]):
            check(ident == "yes", f"{key}: results differ across ranks")
            v = float(vnmse)
            check(math.isfinite(v), f"{key}: vNMSE {vnmse}")
            exact_type = dtype not in ("half", "float", "double", "bfloat16")
            if not lossy and (exact_type or op in ("max", "min")):
                check(v == 0, f"{key}: vNMSE {vnmse} for an exact reduction")
            else:
                check(v < 1e-3, f"{key}: vNMSE {vnmse}")
    check(seen == want_keys, f"missing rows: {sorted(want_keys - seen)[:10]}, "
                             f"extra rows: {sorted(seen - want_keys)[:10]}")


def check_footer(out, ranks):
    check(re.search(r"^\[0\] # Out of bounds values : 0 OK$", out, re.M), "no OK footer")
    check(re.search(r"^\[0\] # Avg bus bandwidth    : [0-9.e+-]+ ?$", out, re.M), "no bw footer")
    check(re.search(r"^\[0\] # Results identical on all ranks : yes$", out, re.M),
          "no identity footer")
    check(len(re.findall(r"^\[0\] #  Rank +\d+ ", out, re.M)) == ranks, "rank lines")


def case_all_types_ops(a):
    need_cpu_nccl(a)
    sizes = [1024 * 4 ** k for k in range(6)]  # 1K .. 1M, factor 4
    # 2 timed iterations and 1 warm-up: every row is checked, and the defaults (20 and 5) were
    # 41 s of CI for the same checks.
    out, rows = run_perf(a, 4, ["-b", "1K", "-e", "1M", "-f", "4", "-d", "all", "-o", "all",
                                "-c", "1", "-n", "2", "-w", "1"], timeout=1100)
    want = {(d, o, s) for d in DTYPE_BYTES for o in OPS for s in sizes}
    check_rows(rows, 4, want, lossy=False)
    check_footer(out, 4)


def case_lossy(a):
    need_cpu_nccl(a)
    sizes = [1024 * 4 ** k for k in range(4)]
    out, rows = run_perf(a, 3, ["-b", "1K", "-e", "64K", "-f", "4", "-d", "float", "-o", "sum",
                                "-n", "3", "-w", "1", "--lossy"], timeout=240)
    check("check: lossy" in out, "header does not say lossy")
    check_rows(rows, 3, {("float", "sum", s) for s in sizes}, lossy=True)
    check_footer(out, 3)


def case_corrupt_rank(a):
    """One rank's result altered (DYNAMIQ_PERF_CORRUPT_RANK): identity and #wrong must say so."""
    need_cpu_nccl(a)
    sizes = (4096, 16384)
    for lossy in (False, True):
        cmd = [a.run, "--cpu-nccl", "-n", "3", "--timeout", "240", "--", a.perf, "-b", "4K", "-e",
               "16K", "-f", "4", "-d", "int32", "-o", "sum", "-n", "2", "-w", "1"]
        cmd += ["--lossy"] if lossy else []
        env = dict(os.environ, DYNAMIQ_PERF_CORRUPT_RANK="1")
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=270, env=env)
        check(proc.returncode == 1, f"lossy={lossy}: exit {proc.returncode}, expected 1")
        rows = [m.groups() for m in map(ROW.match, proc.stdout.splitlines()) if m]
        check(sorted(int(r[0]) for r in rows) == list(sizes), f"rows {rows}")
        for r in rows:
            count = int(r[1])
            # Exact mode: the one flipped element on one rank; lossy: all elements, since the
            # ranks disagree.
            want = str(count) if lossy else "1"
            check(r[8] == want and r[12] == want, f"lossy={lossy}: #wrong {r[8]}, {r[12]}")
            check(r[14] == "no" and r[16] == "no", f"lossy={lossy}: identity {r[14]}, {r[16]}")
        check("# Out of bounds values" in proc.stdout and "FAILED" in proc.stdout, "footer")
        check("# Results identical on all ranks : NO" in proc.stdout, "identity footer")


def case_torchrun_env(a):
    """No launcher: torchrun's variables only, so the TCP rendezvous on MASTER_PORT+1 is used."""
    three_ranks_without_launcher(a, "RANK", "WORLD_SIZE", "LOCAL_RANK")


def case_slurm_env(a):
    """srun's variables only (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID): three ranks, not three
    one-rank jobs; and without MASTER_ADDR/MASTER_PORT a refusal naming them, not a 1-rank run."""
    need_cpu_nccl(a)
    env = {k: v for k, v in os.environ.items()
           if k not in ("DYNAMIQ_RUN_DIR", "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    env.update(SLURM_PROCID="1", SLURM_NTASKS="2", SLURM_LOCALID="1")
    out = subprocess.run([a.perf, "-b", "4K", "-e", "4K", "-n", "1", "-w", "0"], env=env,
                         capture_output=True, text=True, timeout=60)
    check(out.returncode != 0, "SLURM_NTASKS=2 without a rendezvous address ran: %s" % out.stdout)
    check("SLURM_PROCID says rank 1 of 2" in out.stderr and "MASTER_ADDR" in out.stderr,
          "no refusal naming the variables: %s" % out.stderr[-600:])
    three_ranks_without_launcher(a, "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")


def case_mpirun_in_slurm_env(a):
    """mpirun inside a Slurm allocation: Open MPI's rank variables beside the batch step's
    inherited SLURM_PROCID=0 and SLURM_NTASKS=1, which must not make every process rank 0 of 1."""
    three_ranks_without_launcher(a, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                                 "OMPI_COMM_WORLD_LOCAL_RANK",
                                 inherited={"SLURM_PROCID": "0", "SLURM_NTASKS": "1",
                                            "SLURM_LOCALID": "0"})


def case_master_addr_loopback_on_rank0(a):
    """MASTER_ADDR resolving on rank 0's host to another address than the one the other ranks
    reach (Debian maps the host name to 127.0.1.1): rank 0's rendezvous still serves them."""
    three_ranks_without_launcher(a, "RANK", "WORLD_SIZE", "LOCAL_RANK", rank0_addr="127.0.1.1")


def three_ranks_without_launcher(a, rank_var, size_var, local_var, inherited=None,
                                 rank0_addr=None):
    """Three dynamiq-perf processes given only a launcher's rank variables and MASTER_ADDR/PORT
    (and `inherited`, variables of an outer launcher every process sees alike; `rank0_addr`, the
    MASTER_ADDR rank 0 sees, where not the others' 127.0.0.1)."""
    need_cpu_nccl(a)
    import socket
    build = os.path.abspath(a.build)
    # The rendezvous listens on MASTER_PORT + 1, so both ports must be free: an ephemeral port
    # taken by another test's connection on P + 1 made rank 0 fail to listen (and the other
    # ranks wait out their timeout). Bounded retries; a small race remains until rank 0 binds.
    port = None
    for _ in range(64):
        with socket.socket() as s, socket.socket() as t:
            s.bind(("127.0.0.1", 0))
            candidate = s.getsockname()[1]
            if candidate >= 65535:
                continue
            try:
                t.bind(("127.0.0.1", candidate + 1))
            except OSError:
                continue
            port = candidate
            break
    check(port is not None, "no free pair of adjacent loopback ports in 64 tries")
    base = {k: v for k, v in os.environ.items()
            if k not in ("DYNAMIQ_RUN_DIR", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    base.update({"LD_LIBRARY_PATH": os.path.join(build, "tools", "cpu-nccl") + ":" +
                 os.path.join(build, "plugin", "abi"), "NCCL_NET_PLUGIN": "dynamiq",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), size_var: "3",
                 "DYNAMIQ_RENDEZVOUS_TIMEOUT": "60"})
    base.update(inherited or {})
    procs = []
    for rank in (2, 1, 0):
        env = dict(base, **{rank_var: str(rank), local_var: str(rank)})
        if rank == 0 and rank0_addr:
            env["MASTER_ADDR"] = rank0_addr
        procs.append(subprocess.Popen([a.perf, "-b", "4K", "-e", "64K", "-f", "4", "-d", "int32",
                                       "-o", "max", "-n", "2", "-w", "1"], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outputs, errors = [], []
    for p in procs:
        try:
            out, err = p.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            fail("ranks did not finish")
        outputs.append(out)
        errors.append((p.returncode, err))
    # Rank 0 (launched last) first: its failure explains the others' timeouts.
    for rank, (code, err) in zip((0, 1, 2), reversed(errors)):
        check(code == 0, f"rank {rank} exit {code}: {err[-1000:]}")
    rank0 = outputs[2]
    check(outputs[0] == "" and outputs[1] == "", "ranks other than 0 printed rows")
    prefixed = "".join("[0] " + line + "\n" for line in rank0.splitlines())
    rows = [m.groups() for m in map(ROW.match, prefixed.splitlines()) if m]
    check_rows(rows, 3, {("int32", "max", s) for s in (4096, 16384, 65536)}, lossy=False)
    check_footer(prefixed, 3)


# ---- reduce-scatter and reduce ---------------------------------------------------------------
def coll_counts(coll, size, esize, n):
    """nccl-tests' element counts: (send, recv, printed count)."""
    count = size // esize
    if coll != "reducescatter":
        return count, count, count
    align = 16 // esize
    recv = count // n // align * align
    return recv * n, recv, recv


def check_coll_rows(rows, coll, ranks, want_keys, exact_ident="-"):
    """Rows of -c reducescatter / reduce: nccl-tests sizes, bandwidths and roots."""
    seen = set()
    for r in rows:
        size, count, dtype, op, root = int(r[0]), int(r[1]), r[2], r[3], int(r[4])
        esize = DTYPE_BYTES[dtype]
        key = (dtype, op, root, size)
        check(key not in seen, f"row {key} printed twice")
        seen.add(key)
        if coll == "reducescatter":
            check(root == -1, f"{key}: root {root}")
            # The printed size is the larger buffer (the send buffer, n x recvcount); the count
            # is recvcount, a multiple of 16 bytes of elements.
            check(count * esize % 16 == 0 and size == count * esize * ranks, f"{key}: count {count}")
            factor = (ranks - 1) / ranks
        else:
            check(0 <= root < ranks and size == count * esize, f"{key}: count {count}")
            factor = 1.0
        for time_us, algbw, busbw, wrong in (r[5:9], r[9:13]):
            check(float(time_us) > 0, f"{key}: time {time_us}")
            # algbw = send bytes / time (nccl-tests), both printed with 2 decimals.
            expected_alg = size / (float(time_us) * 1e-6) / 1e9
            check(abs(float(algbw) - expected_alg) <= 0.011 + 0.01 * expected_alg,
                  f"{key}: algbw {algbw} vs {expected_alg}")
            expected = float(algbw) * factor
            check(abs(float(busbw) - expected) <= 0.011 + 0.01 * expected,
                  f"{key}: busbw {busbw} vs algbw {algbw}")
            check(wrong == "0", f"{key}: #wrong {wrong}")
        for vnmse, ident in (r[13:15], r[15:17]):
            check(ident == exact_ident, f"{key}: ident {ident}")
            v = float(vnmse)
            exact_type = dtype not in ("half", "float", "double", "bfloat16")
            if exact_type or op in ("max", "min"):
                check(v == 0, f"{key}: vNMSE {vnmse} for an exact reduction")
            else:
                check(v < 1e-3, f"{key}: vNMSE {vnmse}")
    check(seen == want_keys, f"missing rows: {sorted(want_keys - seen)[:10]}, "
                             f"extra rows: {sorted(seen - want_keys)[:10]}")


def check_coll_footer(out, coll):
    check(re.search(r"^\[0\] # Out of bounds values : 0 OK$", out, re.M), "no OK footer")
    what = "only the root holds the result" if coll == "reduce" else "each rank holds its own block"
    check(f"# Results identical on all ranks : n/a ({what})" in out, "identity footer")
    m = re.search(r"^\[0\] # Result digest        : ([0-9a-f]{16})$", out, re.M)
    check(m is not None, "no digest footer")
    check(f"# dynamiq-perf {'reduce_scatter' if coll == 'reducescatter' else 'reduce'}, "
          f"nccl-tests" in out, "header names the collective")
    return m.group(1)


def case_collectives(a):
    """The CPU NCCL alone: every type and op, exact; nccl-tests' sizes, roots and busbw."""
    need_cpu_nccl(a)
    ranks = 3  # recvcount rounding and (n-1)/n are visible at 3
    sizes = [1024 * 4 ** k for k in range(4)]  # 1K .. 64K
    out, rows = run_perf(a, ranks, ["-b", "1K", "-e", "64K", "-f", "4", "-d", "all", "-o", "all",
                                    "-c", "reducescatter", "-n", "2", "-w", "1"], timeout=900)
    want = set()
    for d in DTYPE_BYTES:
        for s in sizes:
            send, _, _ = coll_counts("reducescatter", s, DTYPE_BYTES[d], ranks)
            want |= {(d, o, -1, send * DTYPE_BYTES[d]) for o in OPS}
    check_coll_rows(rows, "reducescatter", ranks, want)
    check_coll_footer(out, "reducescatter")
    # Reduce to every root in turn (-r -1, as nccl-tests): non-roots' buffers stay untouched.
    out, rows = run_perf(a, ranks, ["-b", "1K", "-e", "16K", "-f", "4", "-d", "all", "-o", "sum",
                                    "-c", "reduce", "-r", "-1", "-n", "2", "-w", "1"], timeout=600)
    want = {(d, "sum", root, s) for d in DTYPE_BYTES for root in range(ranks)
            for s in (1024, 4096, 16384)}
    check_coll_rows(rows, "reduce", ranks, want)
    check_coll_footer(out, "reduce")
    out, rows = run_perf(a, ranks, ["-b", "4K", "-e", "4K", "-d", "float", "-o", "max", "-c",
                                    "reduce", "-r", "1", "-n", "1", "-w", "0"], timeout=120)
    check_coll_rows(rows, "reduce", ranks, {("float", "max", 1, 4096)})
    # A root the job does not have: named, exit 1.
    cmd = [a.run, "--cpu-nccl", "-n", "2", "--timeout", "60", "--", a.perf, "-c", "reduce", "-r",
           "5", "-b", "1K", "-e", "1K"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=90)
    check(proc.returncode != 0 and "-r 5" in proc.stderr, f"root 5 of 2: {proc.stderr[-500:]}")


def run_shim_perf(a, ranks, perf_args, env_extra=None):
    env = dict(os.environ, LD_PRELOAD=os.path.abspath(a.shim), DYNAMIQ_ENABLE="1")
    env.update(env_extra or {})
    cmd = [a.run, "--cpu-nccl", "-n", str(ranks), "--timeout", "300", "--", a.perf] + perf_args
    print("$", " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=330, env=env)
    sys.stdout.write(proc.stdout[-2500:])
    check(proc.returncode == 0, f"exit {proc.returncode}; stderr: {proc.stderr[-2000:]}")
    rows = [m.groups() for m in map(ROW_SHIM.match, proc.stdout.splitlines()) if m]
    return proc.stdout, rows


def case_collectives_shim(a):
    """Through the preloaded shim: compressed rows judged by vNMSE, pass-through rows exact, the
    digest the same when the job is repeated (same seed) and different with another seed."""
    need_cpu_nccl(a)
    if not a.shim or not os.path.exists(a.shim):
        print("SKIP: libdynamiq.so is not built")
        sys.exit(77)
    args = ["-b", "256K", "-e", "4M", "-f", "4", "-d", "float", "-o", "avg", "-c",
            "reducescatter", "-n", "2", "-w", "1"]
    out, rows = run_shim_perf(a, 4, args)
    check(len(rows) == 3, f"rows: {rows}")
    for r in rows:
        size, comp = int(r[0]), r[17]
        # DYNAMIQ_MIN_BYTES (1 MiB) counts the send buffer: 256 KiB passes through, exact.
        check(comp == ("comp" if size >= 1 << 20 else "pass"), f"{size}: {comp}")
        check(r[8] == "0" and r[12] == "0", f"{size}: #wrong {r[8]} {r[12]}")
        for v in (float(r[13]), float(r[15])):
            if comp == "pass":
                check(v < 1e-12, f"{size}: pass-through vNMSE {v}")
            else:
                # Uniform inputs without locality: 5 bits give 0.02-0.04 (ENGINE.md section 2).
                check(0.005 < v < 0.05, f"{size}: compressed vNMSE {v}")
    digest = check_coll_footer(out, "reducescatter")
    again, _ = run_shim_perf(a, 4, args)
    check(check_coll_footer(again, "reducescatter") == digest,
          "the same job gave other bytes: not deterministic")
    other, _ = run_shim_perf(a, 4, args, {"DYNAMIQ_SEED": "7"})
    check(check_coll_footer(other, "reducescatter") != digest, "another seed, the same bytes")
    # Reduce to rank 1, BF16: compressed; the other ranks' receive buffers untouched (#wrong 0).
    out, rows = run_shim_perf(a, 4, ["-b", "4M", "-e", "4M", "-d", "bfloat16", "-o", "sum", "-c",
                                     "reduce", "-r", "1", "-n", "2", "-w", "1"])
    check(len(rows) == 1 and rows[0][17] == "comp" and rows[0][4] == "1", f"reduce rows {rows}")
    check(rows[0][8] == "0" and rows[0][12] == "0", f"reduce #wrong {rows[0]}")
    check(0.005 < float(rows[0][13]) < 0.05, f"reduce vNMSE {rows[0][13]}")
    check_coll_footer(out, "reduce")


CASES = {name[5:]: fn for name, fn in globals().items() if name.startswith("case_")}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("case", choices=sorted(CASES))
    parser.add_argument("--perf", required=True)
    parser.add_argument("--run")
    parser.add_argument("--build")
    parser.add_argument("--shim")
    a = parser.parse_args()
    CASES[a.case](a)
    print("PASS", a.case)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""A corpus step through the real engine: flat against two-level, vNMSE against the exact sum.

Starts N ranks (processes) of this script on the CPU NCCL of a build, libdynamiq.so preloaded,
fake nodes by NCCL_HOSTID (rank r on node r // L, as NCCL's host hash honours it). Each rank
all-reduces its row of the step (worker r) as DDP does: one FP32 SUM call per bucket of the
step's sidecar (layout.buckets); the engine cuts each call into its DYNAMIQ_BLOCK_BYTES blocks.
The parent computes the exact sum of rows 0..N-1 in FP64 and prints, per topology and
hierarchy, the vNMSE over the whole vector (sum of squared errors over the sum of exact
energies) and per bucket, whether every call was compressed, and whether all ranks' results
were identical.

usage: engine_corpus.py BUILD STEP.npy [--ranks 8] [--ranks-per-node 2]
       [--topo ring,butterfly] [--hierarchy flat,node] [--env K=V ...] [--timeout 1800]
"""
import argparse
import ctypes
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

NCCL_FLOAT32, NCCL_SUM = 7, 0


def buckets_of(step):
    with open(os.path.splitext(step)[0] + ".json") as f:
        return [(b["offset"], b["numel"]) for b in json.load(f)["layout"]["buckets"]]


def child(a):
    """One rank: its communicator, one all-reduce per bucket, its result and digest to files."""
    nccl = ctypes.CDLL(os.path.join(a.build, "tools/cpu-nccl/libnccl.so.2"), mode=ctypes.RTLD_GLOBAL)
    api = ctypes.CDLL(None)  # the interposed entry points: the preloaded libdynamiq.so's
    rank, n = a.rank, a.ranks
    uid = ctypes.create_string_buffer(128)
    id_path = os.path.join(a.dir, "unique_id")
    if rank == 0:
        if api.ncclGetUniqueId(uid) != 0:
            return 20
        with open(id_path + ".tmp", "wb") as f:
            f.write(uid.raw)
        os.rename(id_path + ".tmp", id_path)
    else:
        deadline = time.monotonic() + 120  # the unique id: bounded wait for rank 0
        while not os.path.exists(id_path):
            if time.monotonic() > deadline:
                return 21
            time.sleep(0.05)
        with open(id_path, "rb") as f:
            uid = ctypes.create_string_buffer(f.read(), 128)
    comm = ctypes.c_void_p()
    # ncclUniqueId is passed by value: a 128-byte struct.
    class UniqueId(ctypes.Structure):
        _fields_ = [("internal", ctypes.c_char * 128)]
    uid_value = UniqueId()
    ctypes.memmove(ctypes.byref(uid_value), uid, 128)
    api.ncclCommInitRank.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, UniqueId,
                                     ctypes.c_int]
    if api.ncclCommInitRank(ctypes.byref(comm), n, uid_value, rank) != 0:
        return 22
    api.ncclAllReduce.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                  ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
    counters = api.dynamiqCommCounters
    counters.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_ulonglong),
                         ctypes.POINTER(ctypes.c_ulonglong)]
    data = np.load(a.step, mmap_mode="r")
    out = np.empty(data.shape[1], dtype=np.float32)
    rerouted = ctypes.c_ulonglong()
    passed = ctypes.c_ulonglong()
    counters(comm, ctypes.byref(rerouted), ctypes.byref(passed))
    before = rerouted.value
    for offset, numel in buckets_of(a.step):
        send = np.ascontiguousarray(data[rank, offset:offset + numel], dtype=np.float32)
        recv = out[offset:offset + numel]
        if api.ncclAllReduce(send.ctypes.data, recv.ctypes.data, numel, NCCL_FLOAT32, NCCL_SUM,
                             comm, None) != 0:
            return 23
    counters(comm, ctypes.byref(rerouted), ctypes.byref(passed))
    with open(os.path.join(a.dir, "rank%d.txt" % rank), "w") as f:
        f.write("%s %d\n" % (hashlib.sha256(out.tobytes()).hexdigest(), rerouted.value - before))
    if rank == 0:
        np.save(os.path.join(a.dir, "result.npy"), out)
    api.ncclCommDestroy(comm)
    return 0


def run_one(a, topo, hierarchy, tmp):
    """Starts the ranks of one (topology, hierarchy), waits (bounded), returns the result."""
    env = dict(os.environ)
    env.update({
        "LD_PRELOAD": os.path.join(a.build, "shim/libdynamiq.so"),
        "DYNAMIQ_CPU_NCCL_NET_PLUGIN": os.path.join(a.build, "plugin/abi/libnccl-net-dynamiq.so"),
        "DYNAMIQ_ENABLE": "1", "DYNAMIQ_TOPO": topo, "DYNAMIQ_HIERARCHY": hierarchy,
        "DYNAMIQ_TIMEOUT_MS": "600000",
    })
    for kv in a.env:
        k, v = kv.split("=", 1)
        env[k] = v
    procs = []
    for r in range(a.ranks):
        e = dict(env, NCCL_HOSTID="node%d" % (r // a.ranks_per_node))
        log = open(os.path.join(tmp, "log%d.txt" % r), "w")
        procs.append(subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), a.build, a.step, "--child", "--rank",
             str(r), "--ranks", str(a.ranks), "--dir", tmp], env=e, stdout=log, stderr=log))
    deadline = time.monotonic() + a.timeout
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise SystemExit("%s %s: timed out; logs in %s" % (topo, hierarchy, tmp))
    if any(codes):
        raise SystemExit("%s %s: rank exit codes %s; logs in %s" % (topo, hierarchy, codes, tmp))
    lines = [open(os.path.join(tmp, "rank%d.txt" % r)).read().split() for r in range(a.ranks)]
    identical = len({l[0] for l in lines}) == 1
    rerouted = min(int(l[1]) for l in lines)
    return np.load(os.path.join(tmp, "result.npy")), identical, rerouted


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("build")
    ap.add_argument("step")
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--ranks-per-node", type=int, default=2)
    ap.add_argument("--topo", default="ring,butterfly")
    ap.add_argument("--hierarchy", default="flat,node")
    ap.add_argument("--env", action="append", default=[])
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--dir")
    a = ap.parse_args()
    a.build = os.path.abspath(a.build)
    if a.child:
        sys.exit(child(a))
    data = np.load(a.step, mmap_mode="r")
    buckets = buckets_of(a.step)
    exact = np.empty(data.shape[1], dtype=np.float64)
    for b in range(0, data.shape[1], 1 << 20):
        e = min(data.shape[1], b + (1 << 20))
        exact[b:e] = data[:a.ranks, b:e].astype(np.float64).sum(axis=0)
    print("# %s, %d ranks, %d per node, buckets %s" %
          (os.path.basename(a.step), a.ranks, a.ranks_per_node, [n for _, n in buckets]))
    print("| topology | hierarchy | vNMSE | per bucket | calls compressed | identical |")
    print("|---|---|---|---|---|---|")
    for topo in a.topo.split(","):
        for hierarchy in a.hierarchy.split(","):
            with tempfile.TemporaryDirectory(prefix="engine_corpus.") as tmp:
                t0 = time.monotonic()
                got, identical, rerouted = run_one(a, topo, hierarchy, tmp)
                sq = en = 0.0
                per = []
                for off, n in buckets:
                    d = got[off:off + n].astype(np.float64) - exact[off:off + n]
                    s, e = float(np.dot(d, d)), float(np.dot(exact[off:off + n], exact[off:off + n]))
                    per.append("%.3e" % (s / e))
                    sq, en = sq + s, en + e
                print("| %s | %s | %.4e | %s | %d of %d | %s |" %
                      (topo, hierarchy, sq / en, " ".join(per), rerouted, len(buckets),
                       "yes" if identical else "NO"), flush=True)
                print("#   %.0f s" % (time.monotonic() - t0), file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()

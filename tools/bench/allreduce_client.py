#!/usr/bin/env python3
"""One rank of a timed all-reduce (or reduce-scatter) over the NCCL API, for netns_allreduce.sh.

Started by dynamiq-run (RANK, WORLD_SIZE, DYNAMIQ_RUN_DIR). It calls NCCL through ctypes and
resolves every nccl* symbol in the process's global scope, so an LD_PRELOADed shim
(libdynamiq.so) intercepts the calls exactly as it would in a C program linked with -lnccl.

Every rank holds the same float32 vector size per rank (its own gradient-like data, see
make_input); the all-reduce runs on it as float32 or converted to bfloat16. Each iteration is
timed between two barriers (a 1-value all-reduce), and the per-iteration time is the maximum
over ranks. Rank 0 prints one JSON object: times, median, vNMSE of the result against the exact
FP64 sum of the float32 inputs, and whether every rank holds identical result bytes.

--collective reducescatter runs ncclReduceScatter instead, out of place: the vector (rounded down
to a multiple of the rank count) is the send buffer and rank r receives block r. The vNMSE is
then over every rank's block (gathered with a pass-through ncclAllGather after the timed calls),
and identity does not apply (each rank holds its own block).
"""
import argparse
import ctypes
import hashlib
import json
import os
import sys
import time

import numpy as np

NCCL_DTYPES = {"float": 7, "bfloat16": 9, "float64": 8, "uint8": 1}
NCCL_SUM, NCCL_MAX = 0, 2
UID_BYTES = 128


class UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * UID_BYTES)]


def parse_bytes(text):
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    if text[-1].upper() in scale:
        return int(text[:-1]) * scale[text[-1].upper()]
    return int(text)


def die(message):
    print(f"allreduce_client: rank {os.environ.get('RANK', '?')}: {message}", file=sys.stderr,
          flush=True)
    sys.exit(1)


class Nccl:
    """The NCCL API through the global symbol scope (LD_PRELOAD first, then libnccl.so.2)."""

    def __init__(self):
        try:
            ctypes.CDLL("libnccl.so.2", mode=os.RTLD_GLOBAL | os.RTLD_NOW)
        except OSError as e:
            die(f"cannot load libnccl.so.2 ({e}); run under dynamiq-run --cpu-nccl")
        scope = ctypes.CDLL(None)
        self.get_unique_id = scope.ncclGetUniqueId
        self.comm_init_rank = scope.ncclCommInitRank
        self.comm_init_rank.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, UniqueId,
                                        ctypes.c_int]
        self.all_reduce = scope.ncclAllReduce
        self.all_reduce.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                                    ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
        self.reduce_scatter = scope.ncclReduceScatter
        self.reduce_scatter.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                                        ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                                        ctypes.c_void_p]
        self.all_gather = scope.ncclAllGather
        self.all_gather.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                                    ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
        self.destroy = scope.ncclCommDestroy
        self.destroy.argtypes = [ctypes.c_void_p]
        self.error_string = scope.ncclGetErrorString
        self.error_string.restype = ctypes.c_char_p
        self.comm = ctypes.c_void_p()

    def check(self, rc, what):
        if rc != 0:
            die(f"{what} failed: {self.error_string(rc).decode()} ({rc})")

    def allreduce(self, send, recv, dtype, op):
        count = send.size
        self.check(self.all_reduce(send.ctypes.data, recv.ctypes.data, count,
                                   NCCL_DTYPES[dtype], op, self.comm, None), "ncclAllReduce")

    def reducescatter(self, send, recv, dtype, op):
        self.check(self.reduce_scatter(send.ctypes.data, recv.ctypes.data, recv.size,
                                       NCCL_DTYPES[dtype], op, self.comm, None),
                   "ncclReduceScatter")

    def barrier(self):
        one = np.ones(1, dtype=np.float32)
        out = np.zeros(1, dtype=np.float32)
        self.allreduce(one, out, "float", NCCL_SUM)


def share_unique_id(nccl, rank, run_dir, timeout_s):
    """Rank 0 draws the id and publishes it as a file (temp + rename); the others poll."""
    uid = UniqueId()
    path = os.path.join(run_dir, "bench-nccl-unique-id")
    if rank == 0:
        nccl.check(nccl.get_unique_id(ctypes.byref(uid)), "ncclGetUniqueId")
        temp = path + f".tmp.{os.getpid()}"
        with open(temp, "wb") as f:
            f.write(bytes(uid))
        os.rename(temp, path)
        return uid
    deadline = time.monotonic() + timeout_s
    delay = 0.001
    while time.monotonic() < deadline:
        try:
            with open(path, "rb") as f:
                data = f.read()
            if len(data) == UID_BYTES:
                ctypes.memmove(ctypes.byref(uid), data, UID_BYTES)
                return uid
        except FileNotFoundError:
            pass
        time.sleep(delay)
        delay = min(delay * 2, 0.05)
    die(f"no unique id from rank 0 in {timeout_s} s ({path})")


def make_input(rank, count, source, sample_path):
    """Rank `rank`'s float32 vector of `count` values.

    sample: row `rank % rows` of the committed real gradient sample, tiled to `count` values;
    synthetic: a shared component plus 0.3x per-rank noise, scaled per 4096-value block by
    2^U(-4, 4) (layers of different magnitude), reproducible from the rank alone.
    """
    if source == "sample":
        rows = np.load(sample_path, mmap_mode="r")
        row = np.asarray(rows[rank % rows.shape[0]], dtype=np.float32)
        reps = -(-count // row.size)
        return np.tile(row, reps)[:count].copy()
    block = 4096
    blocks = -(-count // block)
    scales = np.exp2(np.random.default_rng(7).uniform(-4, 4, blocks)).astype(np.float32)
    shared = np.random.default_rng(11).standard_normal(count, dtype=np.float32)
    noise = np.random.default_rng(1000 + rank).standard_normal(count, dtype=np.float32)
    out = shared
    out += np.float32(0.3) * noise
    out *= np.repeat(scales, block)[:count]
    return out


def to_bf16_bits(values):
    """float32 -> bfloat16 bit patterns, round to nearest even (inputs are finite)."""
    bits = values.view(np.uint32)
    rounded = bits + (np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))
    return (rounded >> np.uint32(16)).astype(np.uint16)


def from_bf16_bits(bits):
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def vnmse(result, world, count, source, sample_path):
    """sum (result - exact)^2 / sum exact^2, exact = FP64 sum of every rank's float32 input."""
    inputs = [make_input(r, count, source, sample_path) for r in range(world)]
    err = ref = 0.0
    step = 1 << 22
    for start in range(0, count, step):
        end = min(count, start + step)
        exact = np.zeros(end - start, dtype=np.float64)
        for x in inputs:
            exact += x[start:end]
        diff = result[start:end].astype(np.float64) - exact
        err += float(np.dot(diff, diff))
        ref += float(np.dot(exact, exact))
    return err / ref if ref > 0 else float("nan")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bytes", default="256M", help="float32 bytes per rank (K/M/G suffixes)")
    p.add_argument("--dtype", choices=["float", "bfloat16"], default="float")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--data", choices=["sample", "synthetic"], default="sample")
    p.add_argument("--sample", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                    "../gradients/sample/step00079.npy"))
    p.add_argument("--label", default="run")
    p.add_argument("--no-check", action="store_true", help="skip vNMSE and identity")
    p.add_argument("-c", "--collective", choices=["allreduce", "reducescatter"],
                   default="allreduce")
    a = p.parse_args()
    if not (1 <= a.iters <= 1000 and 0 <= a.warmup <= 100):
        die("--iters must be 1..1000 and --warmup 0..100")
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    run_dir = os.environ.get("DYNAMIQ_RUN_DIR")
    if world > 1 and not run_dir:
        die("DYNAMIQ_RUN_DIR is not set; start this under dynamiq-run")
    count = parse_bytes(a.bytes) // 4
    scatter = a.collective == "reducescatter"
    if scatter:
        count -= count % world  # n blocks of count / n

    t_setup = time.monotonic()
    values = make_input(rank, count, a.data, a.sample)
    send = to_bf16_bits(values) if a.dtype == "bfloat16" else values
    recv = np.zeros(count // world if scatter else count, dtype=send.dtype)
    nccl = Nccl()
    uid = UniqueId()
    if world == 1:
        nccl.check(nccl.get_unique_id(ctypes.byref(uid)), "ncclGetUniqueId")
    else:
        uid = share_unique_id(nccl, rank, run_dir, 300.0)
    nccl.check(nccl.comm_init_rank(ctypes.byref(nccl.comm), world, uid, rank), "ncclCommInitRank")
    setup_s = time.monotonic() - t_setup

    times = np.zeros(a.warmup + a.iters, dtype=np.float64)
    cpu = np.zeros_like(times)  # CPU seconds of this process (all its threads) per call
    for i in range(times.size):
        nccl.barrier()
        c0, t0 = time.process_time(), time.perf_counter()
        if scatter:
            nccl.reducescatter(send, recv, a.dtype, NCCL_SUM)
        else:
            nccl.allreduce(send, recv, a.dtype, NCCL_SUM)
        times[i] = time.perf_counter() - t0
        cpu[i] = time.process_time() - c0
    slowest = np.zeros_like(times)
    nccl.allreduce(times, slowest, "float64", NCCL_MAX)
    cpu_all_ranks = np.zeros_like(cpu)
    nccl.allreduce(cpu, cpu_all_ranks, "float64", NCCL_SUM)
    timed = slowest[a.warmup:]

    if scatter and not a.no_check:
        # Every rank's block, gathered (pass-through) for the vNMSE over the whole vector.
        blocks = np.zeros(count, dtype=recv.dtype)
        nccl.check(nccl.all_gather(recv.ctypes.data, blocks.ctypes.data, recv.nbytes,
                                   NCCL_DTYPES["uint8"], nccl.comm, None), "ncclAllGather")
        recv = blocks
    result = from_bf16_bits(recv) if a.dtype == "bfloat16" else recv
    identical, error = None, None
    if not a.no_check and scatter:
        if rank == 0:
            error = vnmse(result, world, count, a.data, a.sample)
    elif not a.no_check:
        digest = np.frombuffer(hashlib.blake2b(recv.tobytes(), digest_size=32).digest(),
                               dtype=np.uint8).copy()
        digests = np.zeros(32 * world, dtype=np.uint8)
        nccl.check(nccl.all_gather(digest.ctypes.data, digests.ctypes.data, 32,
                                   NCCL_DTYPES["uint8"], nccl.comm, None), "ncclAllGather")
        identical = bool(all((digests[32 * r:32 * r + 32] == digest).all() for r in range(world)))
        if rank == 0:
            error = vnmse(result, world, count, a.data, a.sample)
    finite = bool(np.isfinite(result).all())
    nccl.barrier()
    nccl.check(nccl.destroy(nccl.comm), "ncclCommDestroy")
    if rank == 0:
        report = {
            "label": a.label, "collective": a.collective, "dtype": a.dtype, "data": a.data,
            "ranks": world,
            "fp32_bytes_per_rank": count * 4, "wire_dtype_bytes": send.nbytes,
            "warmup": a.warmup, "iters": a.iters,
            "times_s": [round(float(t), 6) for t in timed],
            "warmup_times_s": [round(float(t), 6) for t in slowest[:a.warmup]],
            "median_s": float(np.median(timed)), "min_s": float(timed.min()),
            "max_s": float(timed.max()),
            # CPU seconds all ranks together spent per call, and that over the wall time: how
            # many cores the job kept busy (the machine has os.cpu_count()).
            "cpu_s_all_ranks_median": float(np.median(cpu_all_ranks[a.warmup:])),
            "cores_busy_median": float(np.median(cpu_all_ranks[a.warmup:] / timed)),
            "cpu_count": os.cpu_count(), "vnmse": error, "identical_on_all_ranks": identical,
            "finite": finite, "setup_s": round(setup_s, 3),
        }
        print("RESULT " + json.dumps(report), flush=True)
    if identical is False or not finite:
        sys.exit(1)


if __name__ == "__main__":
    main()

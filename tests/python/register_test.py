#!/usr/bin/env python3
"""dynamiq.register and dynamiq.counters against the CPU NCCL, without torch or a GPU.

Run as 2+ ranks under `dynamiq-run --cpu-nccl` with libdynamiq.so preloaded, DYNAMIQ_ENABLE=1
and DYNAMIQ_COMMS=none (nothing is compressed unless registered), the package on PYTHONPATH:

    LD_PRELOAD=<libdynamiq.so> DYNAMIQ_ENABLE=1 DYNAMIQ_COMMS=none PYTHONPATH=python \\
        dynamiq-run --cpu-nccl -n 2 -- python3 tests/python/register_test.py

Each rank creates two communicators through the NCCL C API (ctypes, resolved in the global
scope so that the preloaded shim sees them, as it sees a framework's), opts the first one in
with dynamiq.register(<object with _comm_ptr()>) — the shape of a PyTorch ProcessGroupNCCL
backend — and all-reduces 1.25 MiB of float32 on both. Exits 0 when every check passes.
"""

import ctypes
import math
import os
import pathlib
import sys
import time

import dynamiq

FAILURES = []
RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])
RUN_DIR = pathlib.Path(os.environ["DYNAMIQ_RUN_DIR"])
COUNT = 5 << 16  # 1.25 MiB of float32: above DYNAMIQ_MIN_BYTES (1M)
NCCL_FLOAT32, NCCL_SUM = 7, 0


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what, flush=True)
    if not cond:
        FAILURES.append(what)


class UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * 128)]


class FakeProcessGroupBackend:
    """What PyTorch's ProcessGroupNCCL backend offers: _comm_ptr() -> the ncclComm_t as int."""

    def __init__(self, comm):
        self.comm = comm

    def _comm_ptr(self):
        return self.comm.value


def nccl_api():
    # libnccl.so.2 is the CPU NCCL here (dynamiq-run puts its folder first on the library path).
    # Loaded RTLD_GLOBAL and called through the global scope: the preloaded shim comes first,
    # and forwards to this library.
    ctypes.CDLL("libnccl.so.2", mode=ctypes.RTLD_GLOBAL)
    api = ctypes.CDLL(None)
    api.ncclGetUniqueId.argtypes = [ctypes.POINTER(UniqueId)]
    api.ncclCommInitRank.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, UniqueId,
                                     ctypes.c_int]
    api.ncclAllReduce.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                  ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
    api.ncclCommDestroy.argtypes = [ctypes.c_void_p]
    for fn in (api.ncclGetUniqueId, api.ncclCommInitRank, api.ncclAllReduce, api.ncclCommDestroy):
        fn.restype = ctypes.c_int
    return api


def shared_unique_id(api, name):
    """Rank 0 makes the id and publishes it in the launcher's run directory."""
    path = RUN_DIR / ("uid-" + name)
    uid = UniqueId()
    if RANK == 0:
        check(api.ncclGetUniqueId(ctypes.byref(uid)) == 0, "ncclGetUniqueId(%s)" % name)
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(bytes(uid))
        tmp.rename(path)
        return uid
    deadline = time.monotonic() + 60
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError("no unique id at %s" % path)
        time.sleep(0.01)
    ctypes.memmove(ctypes.byref(uid), path.read_bytes(), ctypes.sizeof(uid))
    return uid


def make_comm(api, name):
    comm = ctypes.c_void_p()
    uid = shared_unique_id(api, name)
    rc = api.ncclCommInitRank(ctypes.byref(comm), WORLD, uid, RANK)
    check(rc == 0 and comm.value, "ncclCommInitRank(%s) on rank %d" % (name, RANK))
    return comm


def value(rank, i):
    # Super-group scales that differ, as in real gradients; every rank's row differs.
    return math.sin(0.001 * i + rank) * (1.0 + (i >> 8) % 7)


def all_reduce(api, comm):
    send = (ctypes.c_float * COUNT)(*[value(RANK, i) for i in range(COUNT)])
    recv = (ctypes.c_float * COUNT)()
    rc = api.ncclAllReduce(send, recv, COUNT, NCCL_FLOAT32, NCCL_SUM, comm, None)
    exact = [sum(value(r, i) for r in range(WORLD)) for i in range(COUNT)]
    err = sum((recv[i] - exact[i]) ** 2 for i in range(COUNT))
    norm = sum(x * x for x in exact)
    return rc, err / norm


def main():
    check("torch" not in sys.modules, "import dynamiq does not import torch")
    api = nccl_api()
    opted, other = make_comm(api, "opted"), make_comm(api, "other")
    handle = FakeProcessGroupBackend(opted)

    # The handle as an int and as ctypes.c_void_p gives the same communicator.
    check(dynamiq.comm_handle(handle) == opted.value == dynamiq.comm_handle(opted),
          "comm_handle accepts _comm_ptr() objects and c_void_p")
    check(dynamiq.register(handle) == opted.value, "dynamiq.register(backend) returns the handle")
    try:
        dynamiq.register(0x1000)
        check(False, "an unknown communicator is refused")
    except dynamiq.DynamiqError as e:
        check(e.code == 4, "an unknown communicator is refused with code 4: %s" % e)

    rc, vnmse = all_reduce(api, opted)
    check(rc == 0 and 0 < vnmse < 0.05,
          "registered communicator: compressed all-reduce, vNMSE %.3e in (0, 0.05)" % vnmse)
    rc, vnmse = all_reduce(api, other)
    check(rc == 0 and vnmse < 1e-12,
          "unregistered communicator (DYNAMIQ_COMMS=none): exact all-reduce, vNMSE %.1e" % vnmse)

    c = dynamiq.counters(handle)
    check(c["rerouted"] == 1 and c["passed"] == 0,
          "counters(registered): 1 compressed, 0 passed through: %s" % c)
    check(c["bytes_in"] == 4 * COUNT and 0 < c["wire_bytes"] < c["bytes_in"],
          "counters(registered): bytes_in %d, wire_bytes %d (fewer)" % (c["bytes_in"],
                                                                    c["wire_bytes"]))
    c = dynamiq.counters(other)
    check(c["rerouted"] == 0 and c["passed"] == 1 and c["wire_bytes"] == 0,
          "counters(unregistered): 0 compressed, 1 passed through: %s" % c)
    try:
        dynamiq.register(other)
        check(False, "registering after the first all-reduce is refused")
    except dynamiq.DynamiqError as e:
        check(e.code == 5, "registering after the first all-reduce is refused with code 5: %s" % e)

    if os.environ.get("DYNAMIQ_METRICS_FILE"):
        # The file's layout is the shim's (README, DYNAMIQ_METRICS_FILE); only its being this
        # process's JSON is checked here.
        m = dynamiq.counters()
        check(isinstance(m, dict) and str(os.getpid()) in str(m),
              "counters() reads this process's metrics file (JSON naming its pid)")
        # The name as the shim expands it (%j, %h: the test's pattern has both), not a guess.
        shim_path = dynamiq._shim_metrics_path()
        check(shim_path is not None and os.path.exists(shim_path) and "%" not in shim_path,
              "dynamiqMetricsPath names the file the shim wrote: %s" % shim_path)

    check(api.ncclCommDestroy(opted) == 0 and api.ncclCommDestroy(other) == 0, "ncclCommDestroy")
    print("%d check(s) failed" % len(FAILURES) if FAILURES else "all checks passed", flush=True)
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Writes the seed corpora of tests/fuzz (corpus/<target>/seed-*): small valid and near-valid
inputs for each target, so that a short CI run starts deep in each parser. Deterministic; run
from anywhere: python3 tests/fuzz/make_corpus.py"""
import os
import random
import struct

HERE = os.path.dirname(os.path.abspath(__file__))
rng = random.Random(16)


def write(target, name, data):
    d = os.path.join(HERE, "corpus", target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "seed-" + name), "wb") as f:
        f.write(data)


# fuzz_codec: [codec][shape][flags][chunk|0x40 valid][n_in] + bytes (10 codecs, 8 shapes).
for spec in range(10):
    for shape in (0, 2, 4, 7):
        for flags, chunk in ((0x00, 0x40), (0x01, 0x00), (0x02, 0x41), (0x2c, 0x40)):
            body = bytes(rng.getrandbits(8) for _ in range(64))
            if chunk & 0x40:  # small XOR: mostly the valid payload
                body = bytes(b if rng.random() < 0.05 else 0 for b in body)
            write("fuzz_codec", f"{spec}-{shape}-{flags:02x}-{chunk:02x}",
                  bytes([spec, shape, flags, chunk, rng.randrange(3)]) + body)

# fuzz_net_frames: mode 0 hellos, mode 1 frames, mode 2 a handle (plugin/socket/socket_wire.h).
SECRET, COMM = 0x0123456789ABCDEF, 0x5EED5EED5EED5EED
HELLO, MSG, PART, HANDLE = 0x4C514E44, 0x4D514E44, 0x50514E44, 0x48514E44


def hello(idx, nsocks, nonce, secret=SECRET, flags=1, comm=COMM):
    return struct.pack("<IHHHHIQQQ", HELLO, 1, idx, nsocks, flags, 0, secret, comm, nonce)


for nsocks in (1, 2, 4, 8):
    hs = b"".join(hello(i, nsocks, 42) for i in range(nsocks))
    write("fuzz_net_frames", f"hello-{nsocks}", bytes([0, 1]) + hs)
write("fuzz_net_frames", "hello-two-conns",
      bytes([0, 1]) + hello(0, 2, 1) + hello(0, 2, 2) + hello(1, 2, 1) + hello(1, 2, 2))
write("fuzz_net_frames", "hello-bad-secret", bytes([0, 0]) + hello(0, 1, 3, secret=7))
write("fuzz_net_frames", "hello-dup-index", bytes([0, 1]) + hello(0, 2, 5) + hello(0, 2, 5))

STRIPE = 64 << 10


def split(size, nsocks):
    if nsocks > 1 and size >= 2 * STRIPE:
        parts = min(nsocks, size // STRIPE)
        return parts, (size + parts - 1) // parts
    return 1, size


def frames(nsocks, sizes):
    out = b""
    plans = []
    for seq, size in enumerate(sizes):
        parts, stripe = split(size, nsocks)
        out += b"\x01" + struct.pack("<IiQQ", MSG, 7, seq, size)
        plans.append((seq, size, parts, stripe))
    out += b"\x00"
    for seq, size, parts, stripe in plans:
        for k in range(1, parts):
            off = k * stripe
            ln = max(0, min(stripe, size - off))
            out += bytes([k - 1]) + struct.pack("<IIQQQ", PART, k, seq, off, ln)
    return out


write("fuzz_net_frames", "frames-1", bytes([1, 0]) + frames(1, [0, 10, 100]))
write("fuzz_net_frames", "frames-2", bytes([1, 1]) + frames(2, [5, 2 * STRIPE]))
write("fuzz_net_frames", "frames-3", bytes([1, 2]) + frames(3, [3 * STRIPE + 5, 1 << 40]))
write("fuzz_net_frames", "frames-bad-seq",
      bytes([1, 0]) + b"\x01" + struct.pack("<IiQQ", MSG, 1, 5, 10))
write("fuzz_net_frames", "handle",
      bytes([2, 0]) + struct.pack("<IHHHHI16sQQ", HANDLE, 1, 2, 0x3412, 2, 0, bytes(16), SECRET, 0))

# fuzz_settings: lines of [key index][value]; the index follows config/settings.def's order.
KEYS = ["DYNAMIQ_ENABLE", "DYNAMIQ_CODEC", "DYNAMIQ_BITS", "DYNAMIQ_TOPO", "DYNAMIQ_MIN_BYTES",
        "DYNAMIQ_DTYPES", "DYNAMIQ_COLLECTIVES", "DYNAMIQ_CORRELATED", "DYNAMIQ_SEED",
        "DYNAMIQ_TIMEOUT_MS", "DYNAMIQ_COMMS", "DYNAMIQ_BLOCK_BYTES"]
settings_seeds = {
    "defaults": [],
    "on": [(0, "1"), (1, "dynamiq"), (2, "4.5"), (3, "butterfly"), (4, "64KiB")],
    "lists": [(5, "float32"), (6, "allreduce,reduce"), (11, "256K")],
    "comms": [(0, "1"), (10, "name=grad*,size=8,index=0,color=3")],
    "bad": [(2, "abc"), (4, "1Q"), (8, "-1"), (9, "5"), (10, "name=")],
    "codecs": [(1, "uniform"), (2, "16"), (1, "mxfp6e2m3")],
}
for name, lines in settings_seeds.items():
    write("fuzz_settings", name, b"\n".join(bytes([k]) + v.encode() for k, v in lines))
write("fuzz_settings", "optin-last", bytes([10]) + b"none,all,name=a?b*,color=-1")


# fuzz_npy: .npy v1/v2 files (float32 C-order 2-D), and a few broken ones.
def npy(shape, data=b"", version=1, descr="<f4", fortran="False"):
    header = "{'descr': '%s', 'fortran_order': %s, 'shape': %s, }" % (descr, fortran, shape)
    header += " " * ((64 - (len(header) + 11) % 64) % 64) + "\n"
    if version == 1:
        return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header.encode() + data
    return b"\x93NUMPY\x02\x00" + struct.pack("<I", len(header)) + header.encode() + data


write("fuzz_npy", "2x3", npy("(2, 3)", struct.pack("<6f", *range(6))) + b"\x03")
write("fuzz_npy", "v2", npy("(1, 4)", struct.pack("<4f", 1, 2, 3, 4), version=2) + b"\x00")
write("fuzz_npy", "short", npy("(4, 4)", b"\0" * 12))
write("fuzz_npy", "1d", npy("(5,)", b"\0" * 20))
write("fuzz_npy", "f8", npy("(1, 1)", b"\0" * 8, descr="<f8"))
write("fuzz_npy", "fortran", npy("(1, 1)", b"\0" * 4, fortran="True"))
write("fuzz_npy", "empty", npy("(0, 7)"))

# fuzz_perf_options: NUL-separated arguments.
perf_seeds = {
    "sweep": ["-b", "8", "-e", "128M", "-f", "2"],
    "step": ["-b", "1K", "-e", "1M", "-i", "4096", "-n", "5", "-w", "1"],
    "types": ["-d", "all", "-o", "all", "-c", "1", "-a", "3"],
    "collective": ["--collective", "reducescatter", "-r", "-1", "-m", "1", "-G", "1"],
    "help": ["-h"],
    "bad": ["-b", "1X", "-e"],
}
for name, args in perf_seeds.items():
    write("fuzz_perf_options", name, b"\0".join(a.encode() for a in args))

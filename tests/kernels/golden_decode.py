#!/usr/bin/env python3
"""Independent decoder of the golden chunk messages (tests/kernels/golden/), written from
docs/FORMAT.md alone: it shares no code with the C++ library.

For every case directory it parses each chunk message's header and checks every field (magic,
version, codec id, chunk index, n_contrib, call, layout digest) and the zero padding; for DynamiQ
it rebuilds the per-call layout from the committed statistics (mu, F, the T816 bisection over the
float bit pattern, widths, stable wire order, byte-space chunk cuts, digests) and the level
tables from their formula; then it decodes every record or block and requires the result to
equal the committed decoded vectors (what the C++ finish() gave) bit for bit, FP32.

Usage: golden_decode.py [GOLDEN_DIR]   (default: the golden/ folder next to this file)
Exit status: 0 all cases agree, 1 a mismatch (each one printed), 77 numpy is missing.
"""
import math
import os
import struct
import sys

try:
    import numpy as np
except ImportError:
    print("SKIP: numpy is not installed (pip install numpy); golden_decode.py needs it")
    sys.exit(77)

F32 = np.float32
FLT_MAX = F32(np.finfo(np.float32).max)

HEADER_BYTES = 16
MAGIC = 0x5144
VERSION = 1
CODEC_IDS = {"dynamiq": 1, "bf16": 2, "mxfp8": 3, "mxfp6": 4, "mxfp6e3m2": 4, "mxfp6e2m3": 5,
             "mxfp4": 6, "uniform": 7}


class Mismatch(Exception):
    pass


# Statistics (docs/FORMAT.md): per super-group a mean and a sum of squares, then the all-zero
# counts packed several to a word: digits of a BF16 integer, or from 16 to 255 workers a byte each
# (summed as unsigned 8-bit integers).
PAIR_WORDS = 2


def counts_are_bytes(n):
    return 16 <= n <= 255


def count_digit_bits(n):
    """Bits of one all-zero count: enough for 0 .. n; a byte from 16 to 255 workers."""
    if counts_are_bytes(n):
        return 8
    bits = 1
    while (1 << bits) <= n:
        bits += 1
    return bits


def counts_per_word(n):
    bits = count_digit_bits(n)
    return 8 if bits == 1 else 4 if bits == 2 else 2 if bits <= 4 or bits == 8 else 1


def stats_words(S, n):
    k = counts_per_word(n)
    return PAIR_WORDS * S + -(-S // k)


def all_zero_count(stats, S, j, n):
    """Super-group j's summed all-zero count (a float; NaN for a bad word)."""
    k = counts_per_word(n)
    word = int(stats[PAIR_WORDS * S + j // k])
    if counts_are_bytes(n):  # memory order: the even super-group's byte is the low one
        return float((word >> (8 * (j % 2))) & 0xff)
    v = bf16(word)
    if k == 1:
        return v
    if not (0.0 <= v <= 255.0) or v != int(v):
        return float("nan")
    bits = count_digit_bits(n)
    return float((int(v) >> (bits * (j % k))) & ((1 << bits) - 1))

def expect(cond, what):
    if not cond:
        raise Mismatch(what)


# ---- scalar helpers (FP32 semantics through numpy scalars) ---------------------------------------

def bf16(word):
    """BF16 word -> FP32 (the high half of the FP32 bit pattern)."""
    return np.array([int(word) << 16], dtype=np.uint32).view(np.float32)[0]


def f32_from_bits(u):
    return np.array([u], dtype=np.uint32).view(np.float32)[0]


def fnv1a32_words(words):
    """FNV-1a 32-bit, byte-wise over little-endian u32 words."""
    h = 2166136261
    for w in words:
        for i in range(4):
            h ^= (w >> (8 * i)) & 0xFF
            h = (h * 16777619) & 0xFFFFFFFF
    return h


def fnv1a64_words(words):
    """FNV-1a 64-bit, byte-wise over little-endian u64 words."""
    h = 0xCBF29CE484222325
    for w in words:
        for i in range(8):
            h ^= (w >> (8 * i)) & 0xFF
            h = (h * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


def codes_lsb_first(data, n, bits):
    """n codes of `bits` bits, code k at bits [k*bits, (k+1)*bits) of the little-endian stream."""
    acc = int.from_bytes(bytes(data), "little")
    mask = (1 << bits) - 1
    return [(acc >> (k * bits)) & mask for k in range(n)]


# ---- the chunk header ------------------------------------------------------------------------------

def check_header(buf, codec_id, chunk, n_contrib, call, digest, what):
    expect(len(buf) >= HEADER_BYTES, f"{what}: {len(buf)} bytes, shorter than the header")
    magic, version, cid, ch, nc, call32, dig = struct.unpack_from("<HBBHHII", buf, 0)
    expect(magic == MAGIC, f"{what}: magic 0x{magic:04x}, expected 0x{MAGIC:04x}")
    expect(version == VERSION, f"{what}: version {version}, expected {VERSION}")
    expect(cid == codec_id, f"{what}: codec id {cid}, expected {codec_id}")
    expect(ch == chunk, f"{what}: chunk {ch}, expected {chunk}")
    expect(nc == n_contrib, f"{what}: n_contrib {nc}, expected {n_contrib}")
    expect(call32 == call & 0xFFFFFFFF, f"{what}: call {call32}, expected {call & 0xFFFFFFFF}")
    expect(dig == digest, f"{what}: layout digest 0x{dig:08x}, computed 0x{digest:08x}")


def check_padding(buf, used, what):
    tail = bytes(buf[used:])
    expect(tail == bytes(len(tail)), f"{what}: padding after byte {used} is not zero")


# ---- DynamiQ ----------------------------------------------------------------------------------------

SG = 256
GROUP = 16


def record_bytes(w):
    return 2 * SG if w == 16 else 2 + 16 + 32 * w


def level_table(w, eps):
    """level_w[r], r = 0..L: computed in double, stored as FP32, level[L] = 1; 2-bit {0, 1}."""
    L = 2 ** (w - 1) - 1
    if L == 1:
        return [F32(0.0), F32(1.0)]
    # eps is the configured FP32 value (0.23f, 0.30f, 0.05f), widened to double.
    e = float(F32(eps))
    q = 1.0 + 2.0 * e * e
    top = q ** L - 1.0
    lv = [F32((q ** r - 1.0) / top) for r in range(L + 1)]
    lv[L] = F32(1.0)
    return lv


class DynamiqLayout:
    def __init__(self, meta, stats):
        self.count = meta["count"]
        self.P = meta["n_chunks"]
        self.n = meta["n_workers"]
        self.call = meta["call"]
        b = meta["budget_bits"]
        S = (self.count + SG - 1) // SG
        self.S = S
        R = {w: record_bytes(w) for w in (2, 4, 8, 16)}
        self.R = R
        r_max = R[16]
        by_budget = max(0, (math.floor(b * self.count / 8) - 2 * stats_words(S, self.n))) // self.P
        honest_need = HEADER_BYTES + r_max - 1 + max(1, -(-R[2] * S // self.P))
        if by_budget >= honest_need:
            self.capacity = by_budget
        else:
            self.capacity = HEADER_BYTES + r_max - 1 + max(1, -(-r_max * S // self.P))
        self.honest = by_budget >= honest_need
        self.stride = self.capacity - HEADER_BYTES - r_max + 1
        W = PAIR_WORDS
        expect(len(stats) == stats_words(S, self.n),
               f"{len(stats)} statistics words, expected {stats_words(S, self.n)}")
        n = F32(self.n)
        raw_mu = [bf16(stats[W * j]) / n for j in range(S)]
        self.poisoned = [not np.isfinite(m) for m in raw_mu]
        # The mean is subtracted only where no worker's super-group is all zero (its count is 0).
        dense = [all_zero_count(stats, S, j, self.n) == 0.0 for j in range(S)]
        self.mu = [m if (d or not np.isfinite(m)) else F32(0) for m, d in zip(raw_mu, dense)]
        energy = []
        for j in range(S):
            f = bf16(stats[W * j + 1])
            energy.append(f if np.isfinite(f) else FLT_MAX)
        self.energy = energy
        # T816: the smallest non-negative float (bisection over its bit pattern) whose widths fit.
        # Every chunk but the last holds the records starting within its stride; the last may
        # fill its whole body.
        budget = (self.P - 1) * self.stride + self.capacity - HEADER_BYTES
        lo, hi = 0, 0x7F800000
        while lo < hi:
            mid = lo + (hi - lo) // 2
            if sum(R[w] for w in self.widths_at(f32_from_bits(mid))) <= budget:
                hi = mid
            else:
                lo = mid + 1
        self.t816 = f32_from_bits(lo)
        self.width = self.widths_at(self.t816)
        # Wire order: widest first, stable.
        self.order = sorted(range(S), key=lambda j: -self.width[j])
        # Byte-space cuts: record i starting at start_i goes to chunk min(P-1, start_i // stride).
        self.chunk_records = [[] for _ in range(self.P)]
        start = 0
        for j in self.order:
            c = min(self.P - 1, start // self.stride)
            self.chunk_records[c].append(j)
            start += R[self.width[j]]
        self.digest = []
        for c in range(self.P):
            words = [c, self.count & 0xFFFFFFFF]
            words += [j * 32 + self.width[j] + (1 if self.poisoned[j] else 0)
                      for j in self.chunk_records[c]]
            self.digest.append(fnv1a32_words(words))

    def widths_at(self, t816):
        t48 = F32(t816 * F32(257.0 / 131072.0))
        t24 = F32(t48 * F32(17.0 / 512.0))
        out = []
        for j in range(self.S):
            f = self.energy[j]
            if self.poisoned[j]:
                out.append(2)
            elif f >= t816:
                out.append(16)
            elif f >= t48:
                out.append(8)
            elif f >= t24:
                out.append(4)
            else:
                out.append(2)
        return out


def decode_dynamiq(meta, stats, payloads, n_contrib, log):
    lay = DynamiqLayout(meta, stats)
    expect(lay.capacity == meta["capacity"],
           f"chunk capacity {meta['capacity']} in meta.txt, FORMAT.md gives {lay.capacity}")
    tables = {w: level_table(w, e) for w, e in zip((2, 4, 8), meta["eps"])}
    out = np.full(lay.count, np.nan, dtype=np.float32)
    contributors = F32(n_contrib)
    for c, buf in enumerate(payloads):
        what = f"chunk {c} (n_contrib {n_contrib})"
        expect(len(buf) == lay.capacity, f"{what}: {len(buf)} bytes, capacity {lay.capacity}")
        check_header(buf, 1, c, n_contrib, lay.call, lay.digest[c], what)
        at = HEADER_BYTES
        for j in lay.chunk_records[c]:
            w = lay.width[j]
            rec = buf[at:at + lay.R[w]]
            expect(len(rec) == lay.R[w], f"{what}: record of super-group {j} runs past the message")
            at += lay.R[w]
            valid = min(SG, lay.count - SG * j)
            if w == 16:
                words = struct.unpack_from("<256H", rec, 0)
                vals = [F32(F32(0.0) + bf16(h)) + F32(0.0) for h in words]
            else:
                unit_word = struct.unpack_from("<H", rec, 0)[0]
                expect(unit_word & 0x8000 == 0, f"{what}: super-group {j} has a negative unit")
                unit = bf16(unit_word)
                factors = list(rec[2:18])
                expect(all(g != 0 for g in factors), f"{what}: super-group {j} has a zero factor")
                L = 2 ** (w - 1) - 1
                codes = codes_lsb_first(rec[18:], SG, w)
                expect(all(k <= 2 * L for k in codes), f"{what}: super-group {j} has an invalid code")
                level = tables[w]
                shift = contributors * lay.mu[j]
                vals = []
                for k, code in enumerate(codes):
                    q = code - L
                    s_g = F32(F32(factors[k // GROUP]) * unit)
                    mag = level[abs(q)]
                    dec = F32((-mag if q < 0 else mag) * s_g)
                    vals.append(F32(F32(0.0) + dec) + shift)
            out[SG * j:SG * j + valid] = np.array(vals[:valid], dtype=np.float32)
        check_padding(buf, at, what)
    widths = {w: lay.width.count(w) for w in (16, 8, 4, 2)}
    log(f"T816 0x{np.float32(lay.t816).view(np.uint32):08x} widths {widths} "
        f"records per chunk {[len(r) for r in lay.chunk_records]} "
        f"digests {['%08x' % d for d in lay.digest]}")
    return out


# ---- baselines ---------------------------------------------------------------------------------------

MX = {  # codec id: (variant, element bits, exponent bits, mantissa bits, bias, has NaN code)
    3: (0, 8, 4, 3, 7, True),    # E4M3
    4: (1, 6, 3, 2, 3, False),   # E3M2
    5: (2, 6, 2, 3, 1, False),   # E2M3
    6: (3, 4, 2, 1, 1, False),   # E2M1
}


def mx_element(code, ebits, mbits, bias, has_nan):
    mag_bits = ebits + mbits
    sign = (code >> mag_bits) & 1
    mag = code & ((1 << mag_bits) - 1)
    if has_nan and mag == (1 << mag_bits) - 1:
        return F32(np.nan)
    e = mag >> mbits
    m = mag & ((1 << mbits) - 1)
    if e == 0:  # subnormal
        v = m * 2.0 ** (1 - bias - mbits)
    else:
        v = (m + (1 << mbits)) * 2.0 ** (e - bias - mbits)
    return F32(-v if sign else v)


def decode_block_codec(meta, codec_id, payloads, n_contrib, log):
    count, P, call = meta["count"], meta["n_chunks"], meta["call"]
    spec = meta["spec"]
    if codec_id == 2:
        bk, block_bytes, variant = 1, 2, 0
    elif codec_id in MX:
        variant, wbits = MX[codec_id][0], MX[codec_id][1]
        bk, block_bytes = 32, 1 + 32 * wbits // 8
    else:
        B = int(spec.split(":")[1])
        k = B - 1
        bk, block_bytes, variant = 16, 2 + 16 * k // 8, B
    nb = -(-count // bk)
    capacity = HEADER_BYTES + -(-nb // P) * block_bytes
    expect(capacity == meta["capacity"],
           f"chunk capacity {meta['capacity']} in meta.txt, FORMAT.md gives {capacity}")
    out = np.full(count, np.nan, dtype=np.float32)
    for c, buf in enumerate(payloads):
        what = f"chunk {c} (n_contrib {n_contrib})"
        expect(len(buf) == capacity, f"{what}: {len(buf)} bytes, capacity {capacity}")
        b0, b1 = c * nb // P, (c + 1) * nb // P
        begin, end = min(b0 * bk, count), min(b1 * bk, count)
        h = fnv1a64_words([codec_id, variant, count, begin, end])
        check_header(buf, codec_id, c, n_contrib, call, (h & 0xFFFFFFFF) ^ (h >> 32), what)
        body = buf[HEADER_BYTES:]
        vals = []
        for b in range(b1 - b0):
            blk = body[b * block_bytes:(b + 1) * block_bytes]
            if codec_id == 2:
                vals.append(bf16(struct.unpack_from("<H", blk, 0)[0]))
            elif codec_id in MX:
                _, wbits, ebits, mbits, bias, has_nan = MX[codec_id]
                s = blk[0]
                scale = F32(np.nan) if s == 0xFF else F32(2.0 ** (s - 127))
                for code in codes_lsb_first(blk[1:], 32, wbits):
                    vals.append(F32(mx_element(code, ebits, mbits, bias, has_nan) * scale))
            else:
                k = int(spec.split(":")[1]) - 1
                L = 2 ** (k - 1) - 1
                S = bf16(struct.unpack_from("<H", blk, 0)[0])
                for code in codes_lsb_first(blk[2:], 16, k):
                    expect(code != (1 << k) - 1, f"{what}: block {b0 + b} holds the all-ones code")
                    vals.append(F32(F32(F32(code - L) * S) / F32(L)))
        out[begin:end] = np.array(vals[:end - begin], dtype=np.float32)
        check_padding(buf, HEADER_BYTES + (b1 - b0) * block_bytes, what)
    return out


# ---- driver --------------------------------------------------------------------------------------------

def read_meta(path):
    meta = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            key, _, value = line.partition(" ")
            meta[key] = value
    for key in ("variant", "count", "n_chunks", "n_workers", "call", "seed", "capacity",
                "stats_words"):
        meta[key] = int(meta[key])
    if "budget_bits" in meta:
        meta["budget_bits"] = float(meta["budget_bits"])
        meta["eps"] = [float(e) for e in meta["eps"].split()]
    return meta


def bits_equal(a, b):
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def run_case(d, name):
    meta = read_meta(os.path.join(d, "meta.txt"))
    family = meta["spec"].split(":")[0]
    codec_id = CODEC_IDS[family]
    P = meta["n_chunks"]
    stats = None
    if codec_id == 1:
        raw = open(os.path.join(d, "stats.u16"), "rb").read()
        stats = list(struct.unpack(f"<{len(raw) // 2}H", raw))
        expect(len(stats) == meta["stats_words"], f"{len(stats)} statistics words in stats.u16")
    notes = []
    for stage, n_contrib in (("leaf", 1), ("hop", 2)):
        payloads = [open(os.path.join(d, f"{stage}.c{c}.bin"), "rb").read() for c in range(P)]
        log = (lambda s: notes.append(s)) if stage == "leaf" else (lambda s: None)
        try:
            if codec_id == 1:
                got = decode_dynamiq(meta, stats, payloads, n_contrib, log)
            else:
                got = decode_block_codec(meta, codec_id, payloads, n_contrib, log)
        except Mismatch as e:
            raise Mismatch(f"{stage}: {e}")
        want = np.fromfile(os.path.join(d, f"decoded_{stage}.f32"), dtype=np.float32)
        if not bits_equal(got, want):
            if got.shape != want.shape:
                raise Mismatch(f"{stage}: decoded {got.shape[0]} values, committed {want.shape[0]}")
            diff = np.nonzero(got.view(np.uint32) != want.view(np.uint32))[0]
            i = diff[0]
            raise Mismatch(f"{stage}: {len(diff)} of {len(want)} decoded values differ from "
                           f"decoded_{stage}.f32, first at {i}: {got[i]!r} vs committed {want[i]!r}")
    return notes


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(
        os.path.abspath(__file__)), "golden")
    cases = sorted(n for n in os.listdir(root) if os.path.isfile(os.path.join(root, n, "meta.txt")))
    if not cases:
        print(f"FAIL: no golden cases under {root}")
        return 1
    failed = 0
    for name in cases:
        try:
            notes = run_case(os.path.join(root, name), name)
            print(f"ok   {name}" + "".join(f"\n     {n}" for n in notes))
        except (Mismatch, OSError, KeyError, ValueError) as e:
            failed += 1
            print(f"FAIL {name}: {e}")
    print(f"{len(cases) - failed} of {len(cases)} golden cases decode bit for bit from docs/FORMAT.md")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

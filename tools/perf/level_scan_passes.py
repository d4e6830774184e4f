#!/usr/bin/env python3
"""Passes a warp makes deriving a level table's lookup grid (kernels/cuda/dynamiq_record.cuh).

stage_level_tables() gives each of a block's 256 threads 5 of the grid's 1,025 cells. A warp
issues a loop until its last lane leaves it, so a warp's passes are its slowest lane's. This
replays, per lane, the scan from r = 0 at the thread's first cell (before) and the bisection of
the first cell then the resumed scan (now), on the levels build_level_table() makes
(kernels/dynamiq_codec.cc: level r = (q^r - 1) / (q^L - 1), q = 1 + 2 eps^2, rounded to FP32),
and prints each width's passes a block, the sum over the 8 warps of their slowest lane's loop
tests. It checks that both give every cell the same answer (exit 1 if not).

  level_scan_passes.py [--eps2 E] [--eps4 E] [--eps8 E]   (defaults: the codec's, 0.23 0.30 0.05)
"""

import argparse
import struct
import sys

GRID = 1024  # kLevelGrid
THREADS = 256  # kHopThreads
CELLS = (GRID + 1 + THREADS - 1) // THREADS  # cells a thread


def f32(x):
    return struct.unpack("f", struct.pack("f", x))[0]


def levels(bits, eps):
    top = 1 if bits == 2 else (1 << (bits - 1)) - 1
    q = 1.0 + 2.0 * eps * eps
    span = q ** top - 1.0
    geometric = top > 1 and eps > 0 and span > 0
    out = [f32((q ** r - 1.0) / span) if geometric else f32(r / top) for r in range(top + 1)]
    out[top] = 1.0
    return top, out + [2.0]  # the sentinel


def thread_passes(top, level, k, bisect):
    """(loop tests, the thread's cells' answers)."""
    first, r, tests, answers = k * CELLS, 0, 0, []
    if bisect:
        above, lo = top, f32(first / GRID)
        while r < above:
            tests += 1
            mid = (r + above + 1) // 2
            if level[mid] <= lo:
                r = mid
            else:
                above = mid - 1
    for cell in range(first, min(first + CELLS, GRID + 1)):
        lo = cell / GRID
        while r < top and level[r + 1] <= lo:
            r += 1
            tests += 1
        tests += 1  # the test that ends the scan
        answers.append(r)
    return tests, answers


def block_passes(top, level, bisect):
    per_thread = [thread_passes(top, level, k, bisect) for k in range(THREADS)]
    warps = sum(max(t for t, _ in per_thread[w:w + 32]) for w in range(0, THREADS, 32))
    return warps, [a for _, answers in per_thread for a in answers]


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--eps2", type=float, default=0.23)
    ap.add_argument("--eps4", type=float, default=0.30)
    ap.add_argument("--eps8", type=float, default=0.05)
    args = ap.parse_args(argv)
    total = [0, 0]
    for bits, eps in ((2, args.eps2), (4, args.eps4), (8, args.eps8)):
        top, level = levels(bits, eps)
        before, cells_before = block_passes(top, level, False)
        now, cells_now = block_passes(top, level, True)
        if cells_before != cells_now:
            print(f"FAIL: {bits} bits, eps {eps}: the bisection gives other cells")
            return 1
        total[0] += before
        total[1] += now
        print(f"{bits} bits (eps {eps:g}): {before} passes a block scanning from 0, {now} "
              "bisecting the first cell")
    print(f"all three: {total[0]} passes a block before, {total[1]} now")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

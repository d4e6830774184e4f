#!/usr/bin/env python3
"""Two-level against flat on a corpus step, call by call as the engine sees them.

DDP all-reduces one bucket per call (the sidecar's layout.buckets) and the engine cuts each call
into blocks of DYNAMIQ_BLOCK_BYTES (whole super-groups, the last block takes the remainder), one
codec and one budget per block. This runs dynamiq-sim once per block (--columns) with both
hierarchies and prints, per worker count, topology and hierarchy, the vNMSE over the whole vector
(each block's vNMSE weighted by its exact sum's energy), and per block the two-level / flat ratio.

usage: two_level_blocks.py SIM STEP.npy [--workers 8,16] [--ranks-per-node 2]
       [--topo ring,butterfly] [--codec dynamiq:5] [--block-bytes 16777216] [--whole]
       [--rail-block-bytes B] [--shards contiguous|interleaved]
--whole: the whole vector as one codec (one dynamiq-sim run) instead of the engine's blocks.
--rail-block-bytes, --shards: passed to dynamiq-sim (rail blocks of B bytes in each shard; the
interleaved shards what-if).
"""
import argparse
import json
import subprocess
import sys

import numpy as np


def engine_blocks(buckets, block_elems):
    """[begin, end) of every engine block of every bucket (engine_plan.cc's cut_blocks)."""
    out = []
    for b in buckets:
        span, first = b["numel"], b["offset"]
        n_blocks = max(1, span // block_elems)
        for i in range(n_blocks):
            begin = i * block_elems
            count = span - begin if i + 1 == n_blocks else block_elems
            out.append((first + begin, first + begin + count))
    return out


def exact_energy(data, n, begin, end):
    """||sum of the first n rows over columns [begin, end)||^2 in FP64."""
    total, step = 0.0, 1 << 20
    for b in range(begin, end, step):
        e = min(end, b + step)
        s = data[:n, b:e].astype(np.float64).sum(axis=0)
        total += float(np.dot(s, s))
    return total


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("sim")
    ap.add_argument("step")
    ap.add_argument("--workers", default="8,16")
    ap.add_argument("--ranks-per-node", default="2")
    ap.add_argument("--topo", default="ring,butterfly")
    ap.add_argument("--codec", default="dynamiq:5")
    ap.add_argument("--block-bytes", type=int, default=16 << 20)
    ap.add_argument("--whole", action="store_true")
    ap.add_argument("--rail-block-bytes")
    ap.add_argument("--shards", default="contiguous")
    a = ap.parse_args()
    data = np.load(a.step, mmap_mode="r")
    d = data.shape[1]
    if a.whole:
        blocks = [(0, d)]
    else:
        side = json.load(open(a.step[:-4] + ".json"))
        blocks = engine_blocks(side["layout"]["buckets"], a.block_bytes // 4 // 256 * 256)
    workers = [int(w) for w in a.workers.split(",")]
    err, energy, per_block = {}, {}, []
    for begin, end in blocks:
        r = subprocess.run([a.sim, "--input", a.step, "--columns", f"{begin}:{end}", "--workers",
                            a.workers, "--ranks-per-node", a.ranks_per_node, "--hierarchy",
                            "flat,node", "--topo", a.topo, "--codec", a.codec, "--format",
                            "jsonl", "--quiet", "--shards", a.shards] +
                           (["--rail-block-bytes", a.rail_block_bytes] if a.rail_block_bytes
                            else []), capture_output=True, text=True, check=True)
        rows = [json.loads(x) for x in r.stdout.splitlines() if x.strip()]
        e = {n: exact_energy(data, n, begin, end) for n in workers}
        got = {}
        for x in rows:
            key = (x["workers"], x["topo"], x["hierarchy"])
            err[key] = err.get(key, 0.0) + x["vnmse"] * e[x["workers"]]
            energy[key] = energy.get(key, 0.0) + e[x["workers"]]
            got[key] = x["vnmse"]
        per_block.append((begin, end, got))
    nodes = {n: n // int(a.ranks_per_node) for n in workers}
    print(f"| ranks | nodes x ranks | topology | flat vNMSE | two-level vNMSE | two-level / flat |")
    print("|---|---|---|---|---|---|")
    for n in workers:
        for t in a.topo.split(","):
            f = err[(n, t, "flat")] / energy[(n, t, "flat")]
            two = err[(n, t, "node")] / energy[(n, t, "node")]
            print(f"| {n} | {nodes[n]} x {a.ranks_per_node} | {t} | {f:.3e} | {two:.3e} | "
                  f"{two / f:.2f} |")
    if len(per_block) > 1:
        print("\nper block, two-level / flat:")
        for begin, end, got in per_block:
            ratios = " ".join(f"{n}/{t}:{got[(n, t, 'node')] / got[(n, t, 'flat')]:.2f}"
                              for n in workers for t in a.topo.split(","))
            print(f"  [{begin}, {end}) {ratios}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""dynamiq-sim's command-line contract: JSONL keys, honest bit counts, clear refusals."""
import json
import os
import subprocess
import sys
import tempfile

sim, sample = sys.argv[1], sys.argv[2]
failures = []


# The statistics all-reduce (docs/FORMAT.md): 2 BF16 words (mean, sum of squares) per 256
# values, and the all-zero counts, k super-groups to a word (k = 8, 4, 2, 2 for counts of 1, 2, 3
# and 4 bits; 2, a byte each, from 16 to 255 workers; else 1). At most 3 words a super-group.
STATS_BITS_MAX = 3 * 16 / 256


def stats_bits(n):
    """Statistics bits per coordinate for n workers, over whole words of super-groups."""
    bits = max(1, n.bit_length())
    k = 2 if 16 <= n <= 255 else {1: 8, 2: 4, 3: 2, 4: 2}.get(bits, 1)
    return (2 + 1 / k) * 16 / 256

def check(cond, what):
    if not cond:
        failures.append(what)


def run(*args):
    return subprocess.run([sim, *args], capture_output=True, text=True, timeout=300)


r = run("--input", sample, "--workers", "4", "--topo", "ring,butterfly",
        "--codec", "dynamiq:5,mxfp8,mxfp6,mxfp4,bf16,uniform:5", "--seed", "1", "--format", "jsonl")
check(r.returncode == 0, f"contract command failed: {r.stderr}")
rows = [json.loads(line) for line in r.stdout.splitlines() if line.strip()]
check(len(rows) == 12, f"expected 12 results, got {len(rows)}")
for row in rows:
    for key in ("codec", "topo", "workers", "vnmse", "bits_per_coord"):
        check(key in row, f"missing key {key} in {row}")
    check(0 < row["vnmse"] < 0.1, f"implausible vNMSE {row}")
dq = [x for x in rows if x["codec"] == "dynamiq:5"]
check(all(x["bits_per_coord"] <= 5.0 for x in dq), f"dynamiq over budget: {dq}")
check(all(abs(x["bits_per_coord"] - 16.0) < 0.01 for x in rows if x["codec"] == "bf16"), "bf16 bits")
# Same seed, same result: the simulator is deterministic.
again = run("--input", sample, "--workers", "4", "--topo", "ring", "--codec", "dynamiq:5",
            "--format", "jsonl", "--quiet")
check(json.loads(again.stdout)["vnmse"] == [x for x in dq if x["topo"] == "ring"][0]["vnmse"],
      "same seed gave another vNMSE")
# Fewer rows than workers: says so and stops.
r = run("--input", sample, "--workers", "8")
check(r.returncode == 2 and "rows" in r.stderr, f"fewer rows than workers: rc {r.returncode} {r.stderr}")
# Bad inputs are named.
r = run("--input", sample, "--codec", "dynamiq:99")
check(r.returncode == 2 and "budget" in r.stderr, f"bad budget: {r.stderr}")
r = run("--input", sample, "--topo", "torus")
check(r.returncode == 2 and "torus" in r.stderr, f"bad topology: {r.stderr}")
with tempfile.TemporaryDirectory() as d:
    bad = os.path.join(d, "bad.npy")
    open(bad, "wb").write(b"not a numpy file")
    r = run("--input", bad)
    check(r.returncode == 2 and "bad.npy" in r.stderr, f"bad file: {r.stderr}")
    # A header whose shape claims more than the file holds is refused before anything is
    # allocated (fuzz_npy found a 3e18-byte allocation here): the error names the shape.
    header = b"{'descr': '<f4', 'fortran_order': False, 'shape': (100000, 8160894870124), }"
    header += b" " * ((64 - (10 + len(header) + 1) % 64) % 64) + b"\n"
    huge = os.path.join(d, "huge.npy")
    open(huge, "wb").write(b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header +
                           b"\0" * 64)
    r = run("--input", huge)
    check(r.returncode == 2 and "shorter than its shape" in r.stderr,
          f"oversized shape: rc {r.returncode} {r.stderr}")
    # Synthetic round trip through --save.
    saved = os.path.join(d, "syn.npy")
    r = run("--synthetic", "--dim", "5000", "--workers", "3", "--save", saved)
    check(r.returncode == 0 and os.path.getsize(saved) > 3 * 5000 * 4, f"--save: {r.stderr}")
    r = run("--input", saved, "--workers", "3", "--topo", "butterfly", "--format", "jsonl", "--quiet")
    check(r.returncode == 0 and json.loads(r.stdout)["workers"] == 3, f"saved file: {r.stderr}")

# The reduce-scatter: each rank block's vNMSE, bits within the budget, deterministic.
def jsonl(*args):
    r = run(*args, "--format", "jsonl", "--quiet")
    check(r.returncode == 0, f"{args} failed: {r.stderr}")
    return [json.loads(line) for line in r.stdout.splitlines() if line.strip()]


ar = {(x["topo"], x["workers"]): x for x in jsonl(
    "--input", sample, "--workers", "2,3,4", "--topo", "ring,butterfly", "--codec", "dynamiq:5")}
rs_rows = jsonl("--input", sample, "--workers", "2,3,4", "--topo", "ring,butterfly",
                "--codec", "dynamiq:5", "--collective", "reducescatter")
check(len(rs_rows) == 6, f"expected 6 reduce-scatter results, got {len(rs_rows)}")
for x in rs_rows:
    n = x["workers"]
    check(x["collective"] == "reducescatter", f"collective field: {x}")
    check(x["recvcount"] * n == x["d"], f"d is n x recvcount: {x}")
    check(len(x["block_vnmse"]) == n, f"one vNMSE per rank block: {x}")
    check(all(0 < b < 0.1 for b in x["block_vnmse"]), f"implausible block vNMSE: {x}")
    # 5 bits per coordinate, statistics included, for one copy; on the wire each worker sends
    # (n-1)/n of that: (n-1) chunk messages of its rank block plus its ring share of the
    # statistics (at most 3 BF16 words per super-group and rank block, 2(n-1)/n of them).
    check(x["bits_per_coord"] <= 5.0, f"reduce-scatter over budget: {x}")
    check(x["wire_bits_per_coord"] <= (n - 1) / n * 5.0 + 2 * (n - 1) / n * STATS_BITS_MAX + 1e-9,
          f"reduce-scatter wire bits: {x}")
    check(x["budget_honest"] and x["chunks_large_enough"], f"sample too small? {x}")
    # The same data all-reduced on the same schedule: the reduce phase is the same, so the error
    # is of the same size (a non-power-of-two butterfly reduce-scatter runs on the ring).
    ref = ar[(x["topo"], n)]["vnmse"]
    check(0.5 * ref <= x["vnmse"] <= 2 * ref, f"reduce-scatter {x['vnmse']} vs all-reduce {ref}")
check([x["topo"] for x in rs_rows if x["workers"] == 3] == ["ring", "ring"],
      f"butterfly n=3 reduce-scatter must run on the ring: {rs_rows}")
again = jsonl("--input", sample, "--workers", "4", "--topo", "butterfly", "--codec", "dynamiq:5",
              "--collective", "reducescatter")
first = [x for x in rs_rows if x["workers"] == 4 and x["topo"] == "butterfly"][0]
check(again[0]["block_vnmse"] == first["block_vnmse"], "reduce-scatter is not deterministic")
other = jsonl("--input", sample, "--workers", "4", "--topo", "butterfly", "--codec", "dynamiq:5",
              "--collective", "reducescatter", "--seed", "2")
check(other[0]["block_vnmse"] != first["block_vnmse"], "another seed gave the same draws")
bf16 = jsonl("--input", sample, "--workers", "4", "--codec", "bf16", "--collective",
             "reducescatter", "--op", "avg")
check(bf16[0]["vnmse"] < 1e-4 and abs(bf16[0]["bits_per_coord"] - 16) < 0.01, f"bf16: {bf16}")
r = run("--input", sample, "--collective", "gather")
check(r.returncode == 2 and "--collective" in r.stderr, f"bad collective: {r.stderr}")
r = run("--input", sample, "--collective", "reducescatter", "--per-hop")
check(r.returncode == 2 and "per-hop" in r.stderr, f"per-hop with reducescatter: {r.stderr}")
check(all(x.get("collective") == "allreduce" for x in ar.values()), "all-reduce is the default")

# --bits-breakdown: the parts sum to the budget, the shares to 1, the
# per-width vNMSE parts to the vNMSE; only for DynamiQ on the all-reduce.
parts = ["values", "group_factors", "units", "statistics", "headers", "padding", "slack",
         "unallocated"]
for x in jsonl("--input", sample, "--workers", "4", "--topo", "ring,butterfly",
               "--codec", "dynamiq:4,dynamiq:5", "--bits-breakdown", "--calls", "2"):
    b = x["bits_breakdown"]
    check(abs(sum(b[p] for p in parts) - b["budget"]) < 1e-9, f"parts do not sum: {b}")
    check(abs(b["copy_bits_per_coord"] - x["bits_per_coord"]) < 1e-12, f"copy bits: {x}")
    check(abs(b["statistics"] - stats_bits(4)) < 1e-12 and abs(b["units"] - 0.0625) < 1e-12,
          f"statistics and units of whole super-groups: {b}")
    w = b["widths"]
    check([y["bits"] for y in w] == [2, 4, 8, 16], f"widths: {w}")
    for key in ("supergroup_share", "error_share", "energy_share", "record_bit_share"):
        check(abs(sum(y[key] for y in w) - 1) < 1e-9, f"{key} does not sum to 1: {w}")
    check(abs(sum(y["vnmse_part"] for y in w) - x["vnmse"]) < 1e-9 * x["vnmse"],
          f"vNMSE parts: {x}")
r = run("--input", sample, "--codec", "mxfp8", "--bits-breakdown")
check(r.returncode == 2 and "not a DynamiQ codec" in r.stderr, f"breakdown of mxfp8: {r.stderr}")
r = run("--input", sample, "--collective", "reducescatter", "--bits-breakdown")
check(r.returncode == 2 and "allreduce only" in r.stderr, f"breakdown of reducescatter: {r.stderr}")
r = run("--input", sample, "--bits-breakdown", "--quiet")
check(r.returncode == 0 and "err share" in r.stdout and "slack" in r.stdout, f"table: {r.stdout}")

# --hierarchy node --ranks-per-node L: the two-level all-reduce (tools/sim/two_level.h).
tl = {(x["topo"], x["hierarchy"], x["ranks_per_node"]): x for L in ("1", "2", "4") for x in jsonl(
    "--input", sample, "--workers", "4", "--topo", "ring,butterfly", "--codec", "dynamiq:5",
    "--hierarchy", "flat,node", "--ranks-per-node", L)}
for topo in ("ring", "butterfly"):
    fl, one = tl[(topo, "flat", 1)], tl[(topo, "node", 1)]
    # 4 nodes x 1 rank is the flat all-reduce: the same vNMSE and bits, to the last digit.
    check(all(fl[k] == one[k] for k in ("vnmse", "bits_per_coord", "wire_bits_per_coord")),
          f"4 x 1 is not flat: {fl} {one}")
    check(one["intra_node_bits_per_coord"] == 0 and "intra_node_bits_per_coord" not in fl,
          f"intra-node bits: {one}")
    # 1 node x 4 ranks: nothing is compressed, the FP32 sum.
    exact = tl[(topo, "node", 4)]
    check(exact["nodes"] == 1 and exact["vnmse"] < 1e-12 and exact["bits_per_coord"] == 0 and
          exact["wire_bits_per_coord"] == 0, f"one node: {exact}")
    # 2 nodes x 2: each rank sends its shard's ring of 2 on its rail: 2 x 1/2 of 5 bits over 2
    # ranks, 2.5 bits per coordinate (the flat ring of 4: 7.5), and 32 FP32 bits inside the node.
    two = tl[(topo, "node", 2)]
    check(two["nodes"] == 2 and abs(two["wire_bits_per_coord"] - 2.5) < 0.01 and
          two["intra_node_bits_per_coord"] == 32 and two["bits_per_coord"] <= 5.0,
          f"2 x 2 bits: {two}")
    check(0 < two["vnmse"] < tl[(topo, "flat", 2)]["vnmse"], f"2 x 2 vs flat: {two}")
# Rail blocks and interleaved shards change the cut, not the budget; both stay deterministic.
cuts = {args: jsonl("--input", sample, "--workers", "4", "--ranks-per-node", "2", "--hierarchy",
                    "node", *args)[0] for args in ((), ("--rail-block-bytes", "131072"),
                                                    ("--shards", "interleaved"))}
check(len({x["vnmse"] for x in cuts.values()}) == 3, f"cuts give the same result: {cuts}")
check(all(x["bits_per_coord"] <= 5.0 and 0 < x["vnmse"] < 0.1 for x in cuts.values()),
      f"cuts: {cuts}")
for args, what in ((("--workers", "3", "--ranks-per-node", "2", "--hierarchy", "node"), "multiple"),
                   (("--hierarchy", "tree"), "tree"),
                   (("--ranks-per-node", "0"), "--ranks-per-node"),
                   (("--hierarchy", "node", "--collective", "reducescatter"), "all-reduce only"),
                   (("--hierarchy", "node", "--per-hop"), "all-reduce only"),
                   (("--shards", "striped"), "--shards"),
                   (("--rail-block-bytes", "10"), "--rail-block-bytes"),
                   (("--collective", "reducescatter", "--rail-block-bytes", "65536"),
                    "--hierarchy node")):
    r = run("--input", sample, *args)
    check(r.returncode == 2 and what in r.stderr, f"{args}: rc {r.returncode} {r.stderr[:200]}")

for f in failures:
    print("FAIL:", f)
print(f"{len(failures)} failures")
sys.exit(1 if failures else 0)

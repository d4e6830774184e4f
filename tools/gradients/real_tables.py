#!/usr/bin/env python3
"""vNMSE of every codec on the real gradient corpus, split three ways.

Runs the project's own all-reduce (libdynamiq-capi.so: the simulator's engine, the
same hops, fused-input order and rounding keys as dynamiq-sim) on rows of the corpus
written by make_corpus.py, for three parts of the flattened gradient:
  all        every parameter, [0, d)
  embedding  the word-embedding matrix alone (all-MiniLM-L6-v2 has no output head
             tied to it: its only head is our 384 x 16 classifier)
  rest       every other parameter
Each part is all-reduced on its own (DynamiQ allocates its bit budget within the part),
exactly as if it were its own tensor.

Rows are read through a memory map, so a [64, 22.6M] file is never held twice; with
--subsample K only every K-th block of --block values (whole super-groups, in order)
is used, which keeps the super-group norm distribution and cuts the cost by K.

Also writes, per (step, part), the energy concentration: the share of sum x^2 held by
the top 10% of super-groups (256 values), for the exact sum of the workers' rows and
for F_j = sum_i ||x_ij||^2 (what DynamiQ's allocation sees).

    python3 tools/gradients/real_tables.py vnmse --corpus data/gradients --workers 4 ...
    python3 tools/gradients/real_tables.py match --corpus data/gradients ...
    python3 tools/gradients/real_tables.py report docs/results/real_*.jsonl
"""

import argparse
import json
import math
import pathlib
import sys
import time

try:  # the measuring modes need numpy; `report` reads JSON alone (and runs in CI without it)
    import numpy as np
except ImportError:
    np = None

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT / "tools" / "capi"))

SUPER_GROUP = 256
PARTS = ("all", "embedding", "rest")


def part_ranges(layout, part):
    """[begin, end) ranges of the flattened vector forming `part`."""
    d = layout["dim"]
    e = layout["embedding_slice"]
    eb, ee = e["offset"], e["offset"] + e["numel"]
    if part == "all":
        return [(0, d)]
    if part == "embedding":
        return [(eb, ee)]
    return [r for r in ((0, eb), (ee, d)) if r[1] > r[0]]


def part_rows(matrix, ranges, n, subsample, block):
    """n row vectors of the part: views of the memory map when possible, else copies."""
    if subsample <= 1 and len(ranges) == 1:
        b, e = ranges[0]
        return [matrix[i, b:e] for i in range(n)]
    picks = []
    for b, e in ranges:
        starts = np.arange(b, e, block)
        if subsample > 1:
            starts = starts[::subsample]
        picks += [(s, min(s + block, e)) for s in starts]
    length = sum(e - s for s, e in picks)
    rows = []
    for i in range(n):
        out = np.empty(length, dtype=np.float32)
        pos = 0
        for s, e in picks:
            out[pos:pos + e - s] = matrix[i, s:e]
            pos += e - s
        rows.append(out)
    return rows


def top_share(energy, fraction=0.1):
    """Share of the total held by the largest `fraction` of entries."""
    if energy.size == 0 or energy.sum() <= 0:
        return float("nan")
    k = max(1, int(math.ceil(fraction * energy.size)))
    top = np.partition(energy, energy.size - k)[energy.size - k:]
    return float(top.sum() / energy.sum())


def energy_stats(rows):
    d = rows[0].shape[0]
    usable = d // SUPER_GROUP * SUPER_GROUP
    exact = np.zeros(usable, dtype=np.float64)
    f_sum = np.zeros(usable // SUPER_GROUP, dtype=np.float64)
    for r in rows:
        x = np.asarray(r[:usable], dtype=np.float64)
        exact += x
        f_sum += (x * x).reshape(-1, SUPER_GROUP).sum(1)
    f_exact = (exact * exact).reshape(-1, SUPER_GROUP).sum(1)
    # The median of the non-zero super-groups, as in the profile: with more than half of
    # the super-groups exactly zero (the embedding) the plain median is 0.
    nonzero = f_exact[f_exact > 0]
    med = float(np.median(nonzero)) if nonzero.size else 0.0
    return {"top10_share_exact_sum": top_share(f_exact),
            "top10_share_F": top_share(f_sum),
            "super_groups": int(f_exact.size),
            "zero_super_groups_fraction": float(np.mean(f_exact == 0)),
            "below_1e-4_median_fraction": float(np.mean(f_exact < 1e-4 * med)) if med > 0
            else float("nan"),
            "median": "non-zero super-groups"}


def load_corpus(corpus, step, wait_s=2400):
    npy = pathlib.Path(corpus) / ("step%05d.npy" % step)
    sidecar = pathlib.Path(corpus) / ("step%05d.json" % step)
    # make_corpus.py writes the sidecar last: when it is missing the dump may still be on its
    # way (a corpus run in progress), so wait for it, bounded, then fail.
    deadline = time.time() + wait_s
    while not sidecar.exists() and time.time() < deadline:
        time.sleep(15)
    meta = json.loads(sidecar.read_text())
    return np.load(npy, mmap_mode="r"), meta["layout"]


def emit(fh, record):
    fh.write(json.dumps(record) + "\n")
    fh.flush()


def cmd_vnmse(args, lib):
    with open(args.out, "a") as fh:
        for step in args.steps:
            matrix, layout = load_corpus(args.corpus, step)
            n_max = max(args.workers)
            if matrix.shape[0] < n_max:
                raise SystemExit("%s step %d has %d rows, need %d" %
                                 (args.corpus, step, matrix.shape[0], n_max))
            for part in args.parts:
                ranges = part_ranges(layout, part)
                rows_all = part_rows(matrix, ranges, n_max, args.subsample, args.block)
                base = {"corpus": str(args.corpus), "step": step, "part": part,
                        "d": int(rows_all[0].shape[0]), "subsample": args.subsample,
                        "block": args.block if args.subsample > 1 else None,
                        "seed": args.seed, "calls": args.calls}
                if args.energy:
                    for n in args.workers:
                        emit(fh, dict(base, kind="energy", workers=n, **energy_stats(rows_all[:n])))
                for n in args.workers:
                    for topo in args.topos:
                        for codec in args.codecs:
                            vn, t0 = [], time.time()
                            for call in range(args.calls):
                                _, st = lib.allreduce(codec, topo, rows_all[:n], seed=args.seed,
                                                      call=call, average=False,
                                                      want_result=False)
                                vn.append(st["vnmse"])
                            emit(fh, dict(base, kind="vnmse", codec=codec, topo=topo, workers=n,
                                          vnmse=float(np.mean(vn)),
                                          bits_per_coord=st["bits_per_coord"],
                                          wire_bits_per_coord=st["wire_bits_per_coord"],
                                          budget_honest=bool(st["budget_honest"]),
                                          seconds=time.time() - t0))
                            print("step %d %-9s n=%-2d %-9s %-10s vNMSE %.4e (%.1f s)" %
                                  (step, part, n, topo, codec, np.mean(vn), time.time() - t0),
                                  file=sys.stderr, flush=True)
                del rows_all


def vnmse_at(lib, rows, budget, topo, seed, calls):
    vals = []
    for call in range(calls):
        _, st = lib.allreduce("dynamiq:%.4g" % budget, topo, rows, seed=seed, call=call,
                              average=False, want_result=False)
        vals.append(st["vnmse"])
    return float(np.mean(vals))


def cmd_profile(args):
    """Energy concentration profile of the exact sum of the first n rows, per part."""
    n = args.workers[0]
    with open(args.out, "a") as fh:
        for step in args.steps:
            matrix, layout = load_corpus(args.corpus, step)
            for part in args.parts:
                rows = part_rows(matrix, part_ranges(layout, part), n, args.subsample, args.block)
                usable = rows[0].shape[0] // SUPER_GROUP * SUPER_GROUP
                exact = np.zeros(usable, dtype=np.float64)
                for r in rows:
                    exact += np.asarray(r[:usable], dtype=np.float64)
                f = (exact * exact).reshape(-1, SUPER_GROUP).sum(1)
                nonzero = f[f > 0]
                med = float(np.median(nonzero)) if nonzero.size else float("nan")
                rec = {"kind": "profile", "corpus": str(args.corpus), "step": step, "part": part,
                       "workers": n, "super_groups": int(f.size),
                       "zero_fraction": float(np.mean(f == 0)),
                       "top_share": {str(q): top_share(f, q) for q in (0.01, 0.05, 0.1, 0.25, 0.5)},
                       "below_x_nonzero_median": {str(x): float(np.mean(f < x * med))
                                                  for x in (1e-1, 1e-2, 1e-4)},
                       "nonzero_median": med}
                emit(fh, rec)
                print(json.dumps(rec), file=sys.stderr, flush=True)


def cmd_match(args, lib):
    """Budget at which DynamiQ's vNMSE equals MXFP8's, for every --workers count:
    bisection on log(vNMSE) vs bits."""
    with open(args.out, "a") as fh:
        for n in args.workers:
            for step in args.steps:
                matrix, layout = load_corpus(args.corpus, step)
                for part in args.parts:
                    rows = part_rows(matrix, part_ranges(layout, part), n, args.subsample, args.block)
                    for topo in args.topos:
                        target = np.mean([lib.allreduce("mxfp8", topo, rows, seed=args.seed, call=c,
                                                        average=False, want_result=False)[1]["vnmse"]
                                          for c in range(args.calls)])
                        lo, hi = 3.0, 12.0
                        v_lo = vnmse_at(lib, rows, lo, topo, args.seed, args.calls)
                        v_hi = vnmse_at(lib, rows, hi, topo, args.seed, args.calls)
                        probes = [(lo, v_lo), (hi, v_hi)]
                        if v_lo <= target:
                            match = lo
                        elif v_hi > target:
                            match = float("inf")
                        else:
                            # vNMSE falls about 4x per bit: interpolate log(vNMSE) linearly between
                            # the bracketing probes (regula falsi), keeping the bracket.
                            for _ in range(args.match_iters):
                                t = (math.log(v_lo) - math.log(target)) / (math.log(v_lo) - math.log(v_hi))
                                mid = min(max(lo + t * (hi - lo), lo + 0.02), hi - 0.02)
                                mid = round(mid, 3)
                                v_mid = vnmse_at(lib, rows, mid, topo, args.seed, args.calls)
                                probes.append((mid, v_mid))
                                if v_mid > target:
                                    lo, v_lo = mid, v_mid
                                else:
                                    hi, v_hi = mid, v_mid
                                if hi - lo < 0.05:
                                    break
                            t = (math.log(v_lo) - math.log(target)) / (math.log(v_lo) - math.log(v_hi))
                            match = lo + t * (hi - lo)
                        emit(fh, {"kind": "match", "corpus": str(args.corpus), "step": step,
                                  "part": part, "topo": topo, "workers": n,
                                  "d": int(rows[0].shape[0]), "mxfp8_vnmse": float(target),
                                  "match_budget_bits": match, "probes": probes,
                                  "subsample": args.subsample, "seed": args.seed,
                                  "calls": args.calls})
                        print("step %d %-9s %s: DynamiQ matches MXFP8 (%.4e) at %.3f bits" %
                              (step, part, topo, target, match), file=sys.stderr, flush=True)


def fmt(v):
    return "%.3e" % v if isinstance(v, float) and math.isfinite(v) else str(v)


def ratio_summary(vn):
    """DynamiQ 5 / MXFP8 vNMSE per (step, part, topology) across worker counts: the table
    accuracy.md's "Larger n" section quotes (whole vectors only; a missing cell is blank)."""
    whole = [r for r in vn if r["subsample"] <= 1 and r["codec"] in ("dynamiq:5", "mxfp8")]
    counts = sorted({r["workers"] for r in whole})
    if len(counts) < 2:
        return []
    cell = {(r["corpus"], r["step"], r["part"], r["topo"], r["workers"], r["codec"]): r["vnmse"]
            for r in whole}
    out = ["\n#### DQ5 / MXFP8 by worker count (vNMSE ratio; below 1 = DynamiQ better)\n",
           "| corpus | step | part | topo | " + " | ".join("n = %d" % n for n in counts) + " |",
           "|---" * (len(counts) + 4) + "|"]
    for corpus, step in sorted({(r["corpus"], r["step"]) for r in whole}):
        for part in PARTS:
            for topo in ("ring", "butterfly"):
                ratios = []
                for n in counts:
                    dq = cell.get((corpus, step, part, topo, n, "dynamiq:5"))
                    mx = cell.get((corpus, step, part, topo, n, "mxfp8"))
                    ratios.append("%.2f" % (dq / mx) if dq is not None and mx else "")
                if any(ratios):
                    out.append("| %s | %d | %s | %s | %s |" % (corpus, step, part, topo,
                                                           " | ".join(ratios)))
    return out


def cmd_report(args):
    recs = []
    for path in args.inputs:
        recs += [json.loads(line) for line in open(path) if line.strip()]
    vn = [r for r in recs if r["kind"] == "vnmse"]
    out = []
    keys = sorted({(r["corpus"], r["step"], r["subsample"]) for r in vn})
    for corpus, step, sub in keys:
        sel = [r for r in vn if (r["corpus"], r["step"], r["subsample"]) == (corpus, step, sub)]
        codecs = list(dict.fromkeys(r["codec"] for r in sel))
        out.append("\n#### %s, step %d%s\n" % (corpus, step,
                   "" if sub <= 1 else ", every %d-th block of %d values" % (sub, sel[0]["block"])))
        out.append("| part | topo | n | " + " | ".join(codecs) + " | DQ5 / MXFP8 |")
        out.append("|---" * (len(codecs) + 4) + "|")
        for part in PARTS:
            for topo in ("ring", "butterfly"):
                for n in sorted({r["workers"] for r in sel}):
                    row = {r["codec"]: r["vnmse"] for r in sel
                           if r["part"] == part and r["topo"] == topo and r["workers"] == n}
                    if not row:
                        continue
                    ratio = row.get("dynamiq:5", float("nan")) / row["mxfp8"] \
                        if "mxfp8" in row else float("nan")
                    out.append("| %s | %s | %d | " % (part, topo, n) +
                               " | ".join(fmt(row.get(c, "")) for c in codecs) +
                               " | %.2f |" % ratio)
    out += ratio_summary(vn)
    en = [r for r in recs if r["kind"] == "energy"]
    if en:
        out.append("\n#### Energy held by the top 10% of super-groups\n")
        out.append("| corpus | step | part | n | top-10% share (exact sum) | top-10% share "
                   "(F_j = sum_i ||x_ij||^2) | zero super-groups | below 1e-4 x median |")
        out.append("|---|---|---|---|---|---|---|---|")
        for r in en:
            out.append("| %s | %d | %s | %d | %.3f | %.3f | %.3f | %.3f |" % (
                r["corpus"], r["step"], r["part"], r["workers"], r["top10_share_exact_sum"],
                r["top10_share_F"], r["zero_super_groups_fraction"],
                r["below_1e-4_median_fraction"]))
    ma = [r for r in recs if r["kind"] == "match"]
    if ma:
        out.append("\n#### Budget at which DynamiQ matches MXFP8's vNMSE\n")
        out.append("| step | part | topo | n | MXFP8 vNMSE | DynamiQ budget (bits/coord) |")
        out.append("|---|---|---|---|---|---|")
        for r in ma:
            bits = r["match_budget_bits"]
            out.append("| %d | %s | %s | %d | %.3e | %s |" % (
                r["step"], r["part"], r["topo"], r["workers"], r["mxfp8_vnmse"],
                "<= 3 (below MXFP8 already at the 3-bit minimum)" if bits <= 3.0 else
                "%.2f" % bits))
    pr = [r for r in recs if r["kind"] == "profile"]
    if pr:
        out.append("\n#### Energy concentration profile (exact sum of the workers' rows)\n")
        out.append("| step | part | super-groups | zero | top 1% | top 5% | top 10% | top 25% | "
                   "top 50% | below 0.1 x median | below 0.01 x median | below 1e-4 x median |")
        out.append("|---" * 12 + "|")
        for r in pr:
            t, b = r["top_share"], r["below_x_nonzero_median"]
            out.append("| %d | %s | %d | %.3f | %.3f | %.3f | %.3f | %.3f | %.3f | %.3f | %.3f | %.3f |" % (
                r["step"], r["part"], r["super_groups"], r["zero_fraction"], t["0.01"], t["0.05"],
                t["0.1"], t["0.25"], t["0.5"], b["0.1"], b["0.01"], b["0.0001"]))
        out.append("\n(median: of the non-zero super-groups' squared norms)")
    print("\n".join(out))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("mode", choices=["vnmse", "match", "profile", "report"])
    p.add_argument("inputs", nargs="*", help="report: jsonl files")
    p.add_argument("--corpus", type=pathlib.Path, default=REPO_ROOT / "data" / "gradients")
    p.add_argument("--steps", default="0,40,79")
    p.add_argument("--workers", default="4")
    p.add_argument("--topos", default="ring,butterfly")
    p.add_argument("--codecs", default="dynamiq:5,mxfp8,mxfp6,mxfp4,uniform:5,bf16")
    p.add_argument("--parts", default=",".join(PARTS))
    p.add_argument("--subsample", type=int, default=1)
    p.add_argument("--block", type=int, default=16384)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--calls", type=int, default=1)
    p.add_argument("--energy", action="store_true", help="also write energy concentration")
    p.add_argument("--match-iters", type=int, default=4, help="match: interpolation probes")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--capi", default=None)
    p.add_argument("--out", type=pathlib.Path)
    args = p.parse_args(argv)
    if args.mode == "report":
        cmd_report(args)
        return 0
    if np is None:
        p.error("mode %s needs numpy (only report runs without it)" % args.mode)
    if args.out is None:
        p.error("--out is required")
    args.steps = [int(s) for s in args.steps.split(",")]
    args.workers = [int(s) for s in args.workers.split(",")]
    args.topos = args.topos.split(",")
    args.codecs = [c for c in args.codecs.split(",") if c]  # "" with --energy: energy only
    args.parts = args.parts.split(",")
    if args.block % SUPER_GROUP:
        p.error("--block must be a multiple of 256")
    if args.mode == "profile":
        cmd_profile(args)
        return 0
    from dynamiq_capi import DynamiqCapi
    lib = DynamiqCapi(args.capi)
    if args.threads:
        lib.set_max_threads(args.threads)
    if args.mode == "vnmse":
        cmd_vnmse(args, lib)
    else:
        cmd_match(args, lib)
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Aggregates dynamiq-predict's JSON lines over the parts of the real corpus (the budget model's
check on real gradients).

Usage: predict_real_table.py FILE.jsonl[.xz] ...

Each file is one dynamiq-predict run on one part of one step, named stepSSSSS_PART.jsonl
(PART: rest or embedding; the step and part are read from the name). "all" is the union of the
two parts' buckets. Prints Markdown:
- auto (its target, e.g. mxfp8) per part x n x topology, the steps pooled: mean bits per
  coordinate of auto and of MXFP8 (weighted by the buckets' element counts), the bytes ratio,
  vNMSE of auto, of MXFP8 and of fixed 5 bits (sum(measured * energy) / sum(energy): total
  squared error over total energy), buckets where auto's measured vNMSE <= MXFP8's, and buckets
  sent as MXFP8 / MXFP6;
- the same for "all" per step;
- the budget model's targets: (a) over every bucket of every run, auto <= MXFP8 in >= 95% of buckets
  and bytes <= 0.85x MXFP8's over all parameters; (b) predicted / measured vNMSE of the fixed
  and mx rows: median, p10, p90 and the share in [0.67, 1.5] (target: 90%), also per part, n,
  codec.
"""
import collections
import json
import lzma
import os
import re
import sys


def open_text(path):
    return lzma.open(path, "rt") if path.endswith(".xz") else open(path)


def load(paths):
    autos, preds = [], []
    for path in paths:
        m = re.search(r"step(\d+)_(rest|embedding)\.jsonl", os.path.basename(path))
        if not m:
            sys.exit(f"{path}: expected a name stepSSSSS_rest.jsonl or stepSSSSS_embedding.jsonl")
        step, part = int(m.group(1)), m.group(2)
        with open_text(path) as f:
            for line in f:
                row = json.loads(line)
                row["step"], row["part"] = step, part
                if row.get("kind") == "auto":
                    autos.append(row)
                elif row.get("kind") in ("fixed", "mx"):
                    preds.append(row)
    return autos, preds


def quantile(values, q):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1) + 0.5))]


def auto_summary(rows):
    count = sum(r["count"] for r in rows)
    energy = sum(r["energy"] for r in rows)
    bits = sum(r["bits_per_coord"] * r["count"] for r in rows) / count
    mx_bits = sum(r["mxfp8_bits_per_coord"] * r["count"] for r in rows) / count
    err = lambda key: sum(r[key] * r["energy"] for r in rows) / energy
    meets = sum(r["measured"] <= r["mxfp8_measured"] for r in rows)
    return {
        "buckets": len(rows), "bits": bits, "mx_bits": mx_bits, "ratio": bits / mx_bits,
        "vnmse": err("measured"), "mx_vnmse": err("mxfp8_measured"),
        "five_vnmse": err("dynamiq5_measured"), "meets": meets,
        "as_mxfp8": sum(r["codec"] == "mxfp8" for r in rows),
        "as_mxfp6": sum(r["codec"] == "mxfp6" for r in rows),
    }


def auto_line(label, s):
    return (f"| {label} | {s['bits']:.2f} | {s['mx_bits']:.2f} | {s['ratio']:.3f} | "
            f"{s['vnmse']:.3g} | {s['mx_vnmse']:.3g} | {s['five_vnmse']:.3g} | "
            f"{s['meets']} of {s['buckets']} ({100 * s['meets'] / s['buckets']:.0f}%) | "
            f"{s['as_mxfp8']} / {s['as_mxfp6']} |")


AUTO_HEAD = ("| {} | auto bits | MXFP8 bits | auto / MXFP8 bytes | auto vNMSE | MXFP8 vNMSE | "
             "fixed 5 bits vNMSE | buckets with auto <= MXFP8 | sent as MXFP8 / MXFP6 |\n"
             "|---|---|---|---|---|---|---|---|---|")


def ratio_line(label, rows):
    r = [x["predicted"] / x["measured"] for x in rows if x["measured"] > 0 and x["predicted"] > 0]
    if not r:
        return f"| {label} | 0 | | | | |"
    inside = sum(0.67 <= v <= 1.5 for v in r)
    return (f"| {label} | {len(r)} | {quantile(r, 0.5):.2f} | {quantile(r, 0.1):.2f} | "
            f"{quantile(r, 0.9):.2f} | {100 * inside / len(r):.1f}% |")


RATIO_HEAD = ("| {} | rows | median | p10 | p90 | in [0.67, 1.5] |\n|---|---|---|---|---|---|")


def main(paths):
    if not paths:
        sys.exit(__doc__)
    autos, preds = load(paths)
    targets = sorted({r["target"] for r in autos})
    steps = sorted({r["step"] for r in autos})
    ns = sorted({r["workers"] for r in autos})
    topos = sorted({r["topo"] for r in autos}, key=lambda t: t != "ring")
    parts = [("all", ("rest", "embedding")), ("embedding", ("embedding",)), ("rest", ("rest",))]
    print(f"auto, target {', '.join(targets)}; steps {', '.join(map(str, steps))} pooled:\n")
    print(AUTO_HEAD.format("part, n, topology"))
    for name, members in parts:
        for n in ns:
            for topo in topos:
                rows = [r for r in autos if r["part"] in members and r["workers"] == n
                        and r["topo"] == topo]
                if rows:
                    print(auto_line(f"{name}, n = {n}, {topo}", auto_summary(rows)))
    print(f"\nauto per step, all parameters (n {', '.join(map(str, ns))} and both topologies "
          "pooled per cell):\n")
    print(AUTO_HEAD.format("step, part"))
    for step in steps:
        for name, members in parts:
            rows = [r for r in autos if r["step"] == step and r["part"] in members]
            if rows:
                print(auto_line(f"{step}, {name}", auto_summary(rows)))

    everything = auto_summary(autos)
    share = everything["meets"] / everything["buckets"]
    print("\nTarget (a), every bucket of every run (all parts, steps, n, topologies): "
          f"auto <= MXFP8 in {everything['meets']} of {everything['buckets']} buckets "
          f"({100 * share:.1f}%; target >= 95%: {'met' if share >= 0.95 else 'NOT met'}); "
          f"bytes {everything['ratio']:.3f}x MXFP8's (target <= 0.85x: "
          f"{'met' if everything['ratio'] <= 0.85 else 'NOT met'}); vNMSE auto "
          f"{everything['vnmse']:.3g}, MXFP8 {everything['mx_vnmse']:.3g}.")
    print("\nauto's choices (buckets per codec), steps, n and topologies pooled:\n")
    for name, members in parts:
        chosen = collections.Counter(r["codec"] for r in autos if r["part"] in members)
        print(f"- {name}: " + ", ".join(f"{c} {k}" for c, k in sorted(chosen.items())))
    rel = sorted(r["measured"] / r["mxfp8_measured"] for r in autos)
    print(f"\nauto / MXFP8 measured vNMSE per bucket: min {rel[0]:.3g}, median "
          f"{quantile(rel, 0.5):.3g}, p90 {quantile(rel, 0.9):.3g}, max {rel[-1]:.3g}; "
          f"fixed 5 bits over all: {everything['five_vnmse']:.3g}.")
    worst = [r for r in autos if r["measured"] > r["mxfp8_measured"]]
    if worst:
        print("\nBuckets where auto's measured vNMSE > MXFP8's (auto / MXFP8):\n")
        for r in sorted(worst, key=lambda r: -r["measured"] / r["mxfp8_measured"]):
            print(f"- step {r['step']} {r['part']} bucket {r['bucket']} n = {r['workers']} "
                  f"{r['topo']}: {r['codec']} {r['measured']:.3g} / {r['mxfp8_measured']:.3g} "
                  f"= {r['measured'] / r['mxfp8_measured']:.2f} (predicted {r['predicted']:.3g}, "
                  f"target {r['target_vnmse']:.3g})")

    print("\nTarget (b), predicted / measured vNMSE, fixed-budget and MX rows:\n")
    print(RATIO_HEAD.format("rows"))
    print(ratio_line("all", preds))
    for kind in ("fixed", "mx"):
        print(ratio_line(kind, [p for p in preds if p["kind"] == kind]))
    for part in ("embedding", "rest"):
        print(ratio_line(part, [p for p in preds if p["part"] == part]))
    for step in steps:
        print(ratio_line(f"step {step}", [p for p in preds if p["step"] == step]))
    for n in ns:
        for topo in topos:
            print(ratio_line(f"n = {n}, {topo}",
                             [p for p in preds if p["workers"] == n and p["topo"] == topo]))
    for part in ("embedding", "rest"):
        for n in ns:
            for topo in topos:
                print(ratio_line(f"{part}, n = {n}, {topo}",
                                 [p for p in preds if p["part"] == part and p["workers"] == n
                                  and p["topo"] == topo]))
    codecs = collections.OrderedDict((p["codec"], None) for p in preds)
    for codec in codecs:
        print(ratio_line(codec, [p for p in preds if p["codec"] == codec]))
    for part in ("embedding", "rest"):
        for codec in codecs:
            print(ratio_line(f"{part}, {codec}",
                             [p for p in preds if p["part"] == part and p["codec"] == codec]))
    r = [p["predicted"] / p["measured"] for p in preds if p["measured"] > 0 and p["predicted"] > 0]
    inside = sum(0.67 <= v <= 1.5 for v in r) / len(r)
    print(f"\nTarget (b): {100 * inside:.1f}% of {len(r)} rows in [0.67, 1.5] (target >= 90%: "
          f"{'met' if inside >= 0.9 else 'NOT met'}).")


if __name__ == "__main__":
    main(sys.argv[1:])

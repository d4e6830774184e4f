#!/usr/bin/env python3
"""The budget model against the simulator, flat against two-level: predicted / measured vNMSE of
dynamiq-predict's fixed and mx rows (runs with --hierarchy flat,node), per hierarchy and per part,
worker count and topology: median, p10, p90 and the share within [0.67, 1.5] (Markdown rows).

Usage: predict_two_level_table.py stepSSSSS_PART.jsonl ...   (PART: rest or embedding)
"""
import json
import os
import sys


def quantile(v, p):
    v = sorted(v)
    at = p * (len(v) - 1)
    lo = int(at)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (at - lo) * (v[hi] - v[lo])


def row(name, sel):
    r = [x["ratio"] for x in sel]
    if not r:
        return
    within = sum(0.67 <= x <= 1.5 for x in r) / len(r)
    print(f"| {name} | {len(r)} | {quantile(r, .5):.2f} | {quantile(r, .1):.2f} | "
          f"{quantile(r, .9):.2f} | {100 * within:.1f}% |")


def main(paths):
    rows = []
    for path in paths:
        part = os.path.basename(path).split("_")[1].split(".")[0]
        for line in open(path):
            x = json.loads(line)
            if x.get("kind") in ("fixed", "mx"):
                x["part"] = part
                rows.append(x)
    print("| rows | rows | median | p10 | p90 | in [0.67, 1.5] |")
    print("|---|---|---|---|---|---|")
    keys = sorted({(x["part"], x["workers"], x["topo"]) for x in rows}, reverse=True)
    for h in ("flat", "node"):
        row(f"{h}, all", [x for x in rows if x["hierarchy"] == h])
        for part, n, topo in keys:
            row(f"{h}, {part}, n = {n}, {topo}",
                [x for x in rows if x["hierarchy"] == h and (x["part"], x["workers"], x["topo"]) ==
                 (part, n, topo)])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

#!/usr/bin/env python3
"""Formats `dynamiq-sim --bits-breakdown --format jsonl` as Markdown tables
(docs/results/budget.md, "Where the bits go").

usage: bits_table.py LABEL=FILE.jsonl [LABEL=FILE.jsonl ...]

Table 1: bits per coordinate of one compressed copy, by part, per file, budget and worker count
n; topologies that give the same bits (the same number of chunks) share a row.
Table 2: per width 2/4/8/16, the share of super-groups, of the squared error and of the exact
sum's energy, one row per file, budget and topology, with the vNMSE.
"""
import json
import sys

PARTS = ["values", "group_factors", "units", "statistics", "headers", "padding", "slack",
         "unallocated"]


def pct(x):
    return f"{100 * x:.1f}"


def main(args):
    runs = []
    for arg in args:
        label, _, path = arg.partition("=")
        for line in open(path):
            if line.strip():
                runs.append((label, json.loads(line)))
    print("| data | budget | n | topo | " + " | ".join(p.replace("_", " ") for p in PARTS) +
          " | sum |")
    print("|---|---|---|---|" + "---|" * (len(PARTS) + 1))
    # One row per data and budget where every topology gives the same bits (same chunk count).
    rows = {}
    for label, r in runs:
        b = r["bits_breakdown"]
        total = sum(b[p] for p in PARTS)
        assert abs(total - b["budget"]) < 1e-9, (label, r["codec"], total)
        cells = " | ".join(f"{b[p]:.4f}" for p in PARTS) + f" | {total:.4f}"
        rows.setdefault((label, b["budget"], r["workers"], cells), []).append(r["topo"])
    for (label, budget, n, cells), topos in rows.items():
        print(f"| {label} | {budget:g} | {n} | {' = '.join(topos)} | {cells} |")
    print()
    print("| data | budget | n | topo | vNMSE | super-groups % (2/4/8/16 bits) | "
          "error % (2/4/8/16) | energy % (2/4/8/16) |")
    print("|---|---|---|---|---|---|---|---|")
    for label, r in runs:
        w = r["bits_breakdown"]["widths"]
        cell = lambda key: " / ".join(pct(x[key]) for x in w)
        print(f"| {label} | {r['bits_breakdown']['budget']:g} | {r['workers']} | {r['topo']} | "
              f"{r['vnmse']:.3e} | "
              f"{cell('supergroup_share')} | {cell('error_share')} | {cell('energy_share')} |")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(sys.argv[1:])

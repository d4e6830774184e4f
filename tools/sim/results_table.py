#!/usr/bin/env python3
"""Formats dynamiq-sim JSONL results as Markdown tables (rows: codec; columns: topo x n)."""
import json
import sys


def main(paths):
    for path in paths:
        rows = [json.loads(line) for line in open(path) if line.strip()]
        cols = sorted({(r["topo"], r["workers"]) for r in rows}, key=lambda c: (c[0] != "ring", c[1]))
        codecs = list(dict.fromkeys(r["codec"] for r in rows))
        by = {(r["codec"], r["topo"], r["workers"]): r for r in rows}
        print(f"`{path}` (vNMSE; bits/coord of one compressed copy in brackets)\n")
        print("| codec | " + " | ".join(f"{t} n={n}" for t, n in cols) + " |")
        print("|---|" + "---|" * len(cols))
        for c in codecs:
            cells = []
            for t, n in cols:
                r = by.get((c, t, n))
                # dynamiq-sim writes a vNMSE that is not finite as null (vnmse_finite: false).
                vnmse = "non-finite" if r is not None and r["vnmse"] is None else \
                    "" if r is None else f"{r['vnmse']:.3g}"
                cells.append("" if r is None else f"{vnmse} ({r['bits_per_coord']:.2f})")
            print(f"| {c} | " + " | ".join(cells) + " |")
        if any("hop_vnmse" in r for r in rows):
            print("\nPer-hop error (payloads summing k workers), k = 1..n:\n")
            for r in rows:
                print(f"- {r['codec']} {r['topo']} n={r['workers']}: " +
                      ", ".join("non-finite" if v is None else f"{v:.3g}" for v in r["hop_vnmse"]))
        print()


if __name__ == "__main__":
    main(sys.argv[1:])

#!/usr/bin/env python3
"""Scatter of predicted against measured vNMSE per bucket, from dynamiq-predict's JSON lines.

Usage: plot_prediction.py OUT.png LABEL=FILE.jsonl[,FILE.jsonl...] [LABEL=FILES ...]

A label may pool several files (comma-separated); a file ending in .xz is read compressed.

Every "fixed" row (DynamiQ at a fixed budget) and "mx" row (MXFP8, MXFP6) of each file is one
point, log-log, coloured by label; the diagonal and the band [0.67, 1.5] of the model's target are
drawn. Prints, per label and over all, the median and 90th percentile of predicted / measured and
the share of points inside the band. Needs matplotlib (tools/gradients/requirements.txt).
"""
import json
import lzma
import sys


def load(paths):
    points = []
    for path in paths.split(","):
        f = lzma.open(path, "rt") if path.endswith(".xz") else open(path)
        with f:
            for line in f:
                row = json.loads(line)
                if row.get("kind") not in ("fixed", "mx"):
                    continue
                if row["measured"] > 0 and row["predicted"] > 0:
                    points.append((row["kind"], row["predicted"], row["measured"]))
    return points


def quantile(values, q):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1) + 0.5))]


def main(argv):
    if len(argv) < 3 or any("=" not in a for a in argv[2:]):
        sys.exit(__doc__)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 6.0))
    everything = []
    for spec in argv[2:]:
        label, path = spec.rsplit("=", 1)  # a label may hold "=", a path not
        points = load(path)
        if not points:
            sys.exit(f"{path}: no fixed or mx rows")
        everything += points
        ratios = [p / m for _, p, m in points]
        inside = sum(0.67 <= r <= 1.5 for r in ratios) / len(ratios)
        print(f"{label}: {len(points)} points, predicted/measured median "
              f"{quantile(ratios, 0.5):.2f}, p10 {quantile(ratios, 0.1):.2f}, "
              f"p90 {quantile(ratios, 0.9):.2f}, in [0.67, 1.5] {100 * inside:.0f}%")
        ax.scatter([m for _, _, m in points], [p for _, p, _ in points], s=10, alpha=0.6,
                   label=label)
    ratios = [p / m for _, p, m in everything]
    inside = sum(0.67 <= r <= 1.5 for r in ratios) / len(ratios)
    print(f"all: {len(everything)} points, median {quantile(ratios, 0.5):.2f}, "
          f"p90 {quantile(ratios, 0.9):.2f}, in [0.67, 1.5] {100 * inside:.0f}%")
    lo = min(min(p, m) for _, p, m in everything) / 2
    hi = max(max(p, m) for _, p, m in everything) * 2
    ax.plot([lo, hi], [lo, hi], color="black", linewidth=1, label="predicted = measured")
    ax.fill_between([lo, hi], [0.67 * lo, 0.67 * hi], [1.5 * lo, 1.5 * hi], color="grey",
                    alpha=0.15, label="[0.67, 1.5]")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xlabel("measured vNMSE (simulator)")
    ax.set_ylabel("predicted vNMSE (budget model, from the statistics)")
    ax.set_title("auto's model per bucket: DynamiQ 3-8 bits, MXFP6, MXFP8", fontsize=10)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(argv[1], dpi=120)
    print(f"wrote {argv[1]}")


if __name__ == "__main__":
    main(sys.argv)

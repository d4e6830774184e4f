#!/usr/bin/env python3
"""Super-group statistics of a gradient corpus (the paper's Figure 1 on our data).

A super-group is 256 consecutive values of a flattened gradient. DynamiQ gains
over fixed formats when super-group L2 norms spread over orders of magnitude;
randomly shuffling the same values destroys that locality, so the shuffled
distribution is the baseline to compare against.

For every dumped step (stepNNNNN.npy [workers, d] + stepNNNNN.json written by
make_corpus.py) and for each part of the vector (all parameters; the
embedding tables alone; everything else), this prints, for the real and the
shuffled values: the share of gradient energy (sum of squares) held by the top
10% of super-groups, quantiles of super-group norm / median, and the share of
all-zero super-groups. Figures are means over workers (each worker's own
gradient, as the first hop of an all-reduce sees it).

Usage:
  python3 tools/gradients/sgstats.py [--corpus data/gradients] \
      [--plot docs/figures/sgnorms.png] [--json out.json]
Works on the committed sample too (--corpus tools/gradients/sample); a sample
slice that does not reach the embedding reports no embedding part.
Needs numpy; the plot also needs matplotlib.
"""

import argparse
import json
import pathlib
import sys

import numpy as np

SUPER_GROUP = 256  # values per super-group
TOP_FRACTION = 0.10  # "top 10% of super-groups"
REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
QUANTILES = (0.01, 0.10, 0.50, 0.90, 0.99)


def super_group_norms(values, group=SUPER_GROUP):
    """L2 norm of each run of `group` consecutive values (last may be short)."""
    values = np.asarray(values, dtype=np.float64)
    full = (values.size // group) * group
    norms = np.sqrt(np.square(values[:full]).reshape(-1, group).sum(axis=1))
    if full < values.size:
        norms = np.append(norms, np.sqrt(np.square(values[full:]).sum()))
    return norms


def top_energy_share(norms, fraction=TOP_FRACTION):
    """Share of sum(norm^2) held by the largest ceil(fraction * n) groups."""
    energy = np.sort(np.square(np.asarray(norms, dtype=np.float64)))[::-1]
    total = energy.sum()
    if total == 0.0:
        return float("nan")
    k = max(1, int(np.ceil(fraction * energy.size)))
    return float(energy[:k].sum() / total)


def relative_to_median(norms):
    """Norms divided by the median of the non-zero norms (zeros dropped).

    Returns (ratios of the non-zero groups, share of all-zero groups). A
    sparse embedding gradient has mostly all-zero super-groups, whose median
    is zero; the non-zero median keeps the ratio defined.
    """
    nonzero = norms[norms > 0]
    zero_share = 1.0 - nonzero.size / max(1, norms.size)
    if nonzero.size == 0:
        return nonzero, zero_share
    return nonzero / np.median(nonzero), zero_share


def load_corpus(folder):
    """Yields (step, gradients [n, d] memmap, sidecar dict) per dumped step."""
    for npy in sorted(pathlib.Path(folder).glob("step*.npy")):
        meta = json.loads(npy.with_suffix(".json").read_text())
        yield meta["step"], np.load(npy, mmap_mode="r"), meta


def merge_ranges(ranges):
    merged = []
    for a, b in sorted(ranges):
        if merged and merged[-1][1] == a:
            merged[-1] = (merged[-1][0], b)
        else:
            merged.append((a, b))
    return merged


def parts_of(meta, dim):
    """[(part name, [(start, stop), ...])] for all / embedding / the rest.

    "embedding" is every embedding table (word, position, token type; the
    sidecar's is_embedding flag), which DDP places contiguously at the end;
    the word table is 98% of it.
    """
    params = meta["layout"]["params"] if "layout" in meta else meta["params"]
    emb, rest = [], []
    for p in params:
        a = p["offset"]
        b = min(dim, a + p["numel"])
        if b > a:
            (emb if p["is_embedding"] else rest).append((a, b))
    parts = [("all", [(0, dim)])]
    if emb:
        parts.append(("embedding", merge_ranges(emb)))
        parts.append(("non-embedding", merge_ranges(rest)))
    return parts


def gather(row, ranges):
    return np.concatenate([np.asarray(row[a:b]) for a, b in ranges])


def analyse(folder, seed, max_workers):
    """Returns a list of per-(step, part) results and pooled ratio arrays."""
    rng = np.random.default_rng(seed)
    results = []
    for step, grads, meta in load_corpus(folder):
        n = min(grads.shape[0], max_workers)
        for part, ranges in parts_of(meta, grads.shape[1]):
            acc = {"real": [], "shuffled": []}
            ratios = {"real": [], "shuffled": []}
            for w in range(n):
                values = gather(grads[w], ranges).astype(np.float64)
                shuffled = rng.permutation(values)
                for kind, vec in (("real", values), ("shuffled", shuffled)):
                    norms = super_group_norms(vec)
                    rel, zero_share = relative_to_median(norms)
                    acc[kind].append((top_energy_share(norms), zero_share,
                                      np.quantile(rel, QUANTILES)
                                      if rel.size else
                                      np.full(len(QUANTILES), np.nan),
                                      rel.max() if rel.size else np.nan))
                    ratios[kind].append(rel)
            entry = {"step": step, "part": part, "workers": n,
                     "values": int(sum(b - a for a, b in ranges))}
            for kind in ("real", "shuffled"):
                shares = [a[0] for a in acc[kind]]
                entry[kind] = {
                    "top10_energy_share_mean": float(np.mean(shares)),
                    "top10_energy_share_min": float(np.min(shares)),
                    "top10_energy_share_max": float(np.max(shares)),
                    "zero_group_share": float(np.mean([a[1]
                                                       for a in acc[kind]])),
                    "norm_over_median_quantiles": dict(zip(
                        [str(q) for q in QUANTILES],
                        np.mean([a[2] for a in acc[kind]], axis=0).tolist())),
                    "norm_over_median_max": float(np.mean([a[3]
                                                           for a in acc[kind]])),
                }
            entry["ratios"] = {k: np.concatenate(v) for k, v in ratios.items()}
            results.append(entry)
    return results


def print_table(results, out=sys.stdout):
    header = ("%6s %-13s %9s | %-29s | %-29s" %
              ("step", "part", "values", "real: top10%  p1/p99 of n/med",
               "shuffled: top10% p1/p99"))
    print(header, file=out)
    print("-" * len(header), file=out)
    for r in results:
        cells = []
        for kind in ("real", "shuffled"):
            s = r[kind]
            q = s["norm_over_median_quantiles"]
            cells.append("%6.1f%%  %8.3g/%-8.3g z%4.1f%%" %
                         (100 * s["top10_energy_share_mean"], q["0.01"],
                          q["0.99"], 100 * s["zero_group_share"]))
        print("%6d %-13s %9d | %-29s | %-29s" %
              (r["step"], r["part"], r["values"], cells[0], cells[1]),
              file=out)
    print("top10%: share of sum of squares in the largest 10% of 256-value "
          "super-groups (mean over workers); p1/p99: 1st/99th percentile of "
          "super-group norm / median non-zero norm; z: all-zero groups",
          file=out)


def param_energy(folder, max_workers, top):
    """Per step, the parameters holding the most gradient energy.

    Returns [(step, [(name, share of the vector's sum of squares, share of
    its values)])], shares averaged over workers.
    """
    out = []
    for step, grads, meta in load_corpus(folder):
        params = meta["layout"]["params"] if "layout" in meta else \
            meta["params"]
        n = min(grads.shape[0], max_workers)
        dim = grads.shape[1]
        shares = np.zeros(len(params))
        for w in range(n):
            row = np.asarray(grads[w], dtype=np.float64)
            energy = np.array([np.square(row[p["offset"]:
                                             p["offset"] + p["numel"]]).sum()
                               for p in params])
            shares += energy / energy.sum() / n
        order = np.argsort(-shares)[:top]
        out.append((step, [(params[i]["name"], float(shares[i]),
                            params[i]["numel"] / dim) for i in order]))
    return out


def plot(results, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = sorted({r["step"] for r in results})
    parts = [p for p in ("all", "non-embedding", "embedding")
             if any(r["part"] == p for r in results)]
    fig, axes = plt.subplots(len(parts), len(steps), squeeze=False,
                             figsize=(4.2 * len(steps), 2.8 * len(parts)),
                             sharex=True)
    everything = np.concatenate([r["ratios"][k] for r in results
                                 for k in ("real", "shuffled")
                                 if r["ratios"][k].size])
    lo = max(everything.min(), 1e-6)
    bins = np.logspace(np.log10(lo), np.log10(everything.max()), 80)
    for i, part in enumerate(parts):
        for j, step in enumerate(steps):
            ax = axes[i][j]
            match = [r for r in results
                     if r["part"] == part and r["step"] == step]
            if not match:
                ax.set_visible(False)
                continue
            r = match[0]
            for kind, colour in (("real", "tab:blue"),
                                 ("shuffled", "tab:orange")):
                ratios = r["ratios"][kind]
                weights = np.full(ratios.size, 1.0 / max(1, ratios.size))
                ax.hist(ratios, bins=bins, weights=weights, histtype="step",
                        color=colour, linewidth=1.4,
                        label="%s (top 10%%: %.0f%% of energy)" %
                        (kind, 100 * r[kind]["top10_energy_share_mean"]))
            ax.set_xscale("log")
            ax.set_title("step %d, %s%s" % (
                step, part, "" if r["real"]["zero_group_share"] < 0.005 else
                " (%.1f%% of groups all-zero)" %
                (100 * r["real"]["zero_group_share"])), fontsize=9)
            ax.legend(fontsize=7, loc="upper left")
            ax.tick_params(labelsize=8)
            if i == len(parts) - 1:
                ax.set_xlabel("super-group L2 norm / median", fontsize=8)
            if j == 0:
                ax.set_ylabel("fraction of non-zero groups", fontsize=8)
    fig.suptitle("all-MiniLM-L6-v2 fine-tuning gradients: norms of 256-value\n"
                 "super-groups, real order vs randomly shuffled", fontsize=10)
    fig.tight_layout()
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", type=pathlib.Path,
                   default=REPO_ROOT / "data" / "gradients")
    p.add_argument("--plot", type=pathlib.Path, default=None,
                   help="write the histogram PNG here "
                        "(e.g. docs/figures/sgnorms.png)")
    p.add_argument("--json", type=pathlib.Path, default=None,
                   help="write the statistics (without raw ratios) as JSON")
    p.add_argument("--seed", type=int, default=0, help="shuffle seed")
    p.add_argument("--by-param", type=int, default=0, metavar="N",
                   help="also list the N parameters with the most energy")
    p.add_argument("--max-workers", type=int, default=4,
                   help="workers analysed per step")
    args = p.parse_args(argv)
    results = analyse(args.corpus, args.seed, args.max_workers)
    if not results:
        print("no stepNNNNN.npy in %s" % args.corpus, file=sys.stderr)
        return 1
    print_table(results)
    if args.by_param:
        for step, rows in param_energy(args.corpus, args.max_workers,
                                       args.by_param):
            print("step %d: parameters with the most gradient energy "
                  "(share of energy / share of values)" % step)
            for name, share, size in rows:
                print("  %6.2f%% / %6.2f%%  %s" % (100 * share, 100 * size,
                                                  name))
    if args.json:
        args.json.write_text(json.dumps(
            [{k: v for k, v in r.items() if k != "ratios"} for r in results],
            indent=1))
    if args.plot:
        plot(results, args.plot)
        print("wrote %s" % args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())

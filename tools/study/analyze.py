#!/usr/bin/env python3
"""Summarises the convergence study (tools/study/convergence.py run): a markdown table,
loss and accuracy curves as PNG, steps to 99% of exact averaging's final accuracy, and a
modelled time-to-accuracy at 10 and 100 Gbit/s.

    python3 tools/study/analyze.py [--runs docs/results/study/runs] \
        [--figures docs/figures] [--out docs/results/study/summary.md]

Steps to target are given two ways: to 99% of exact averaging's mean final accuracy, and
paired, to 99% of the same seed's exact final accuracy (which that exact run always reaches).
Time to accuracy = paired steps (mean over seeds) x the time per step.

Time model (per step, one worker): measured compute (its share of forward+backward, plus
the optimizer step; the mean over every run with the same n, since the computation does not
depend on the scheme and per-run timings mostly measure the machine's load) +
wire_bits_per_coord x d / bandwidth, where wire_bits_per_coord is what
the C API reports for the scheme (bytes each worker sends over every hop of the
reduce-scatter and all-gather, statistics included; 2 (n-1)/n x 32 for exact FP32). Codec
compute and link latency are left out (a GPU codec runs far faster than the link here).
"""

import argparse
import json
import math
import pathlib
import statistics

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
ORDER = ["exact", "bf16", "mxfp8", "mxfp4", "uniform5", "dynamiq5-ring", "dynamiq5-butterfly",
         "auto-mxfp8"]


def load(runs_dir):
    runs = []
    for path in sorted(pathlib.Path(runs_dir).glob("n*_s*.json")):
        runs.append(json.loads(path.read_text()))
    return runs


def mean_std(xs):
    if not xs:
        return float("nan"), float("nan")
    return statistics.mean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def steps_to(evals, target):
    """Steps until validation accuracy first reaches target, interpolated linearly between
    the two evaluations around the crossing (evaluations are every few steps); None if never."""
    prev = None
    for e in evals:
        if e["val_accuracy"] >= target:
            if prev is None or e["val_accuracy"] == prev["val_accuracy"]:
                return float(e["step"])
            t = (target - prev["val_accuracy"]) / (e["val_accuracy"] - prev["val_accuracy"])
            return prev["step"] + t * (e["step"] - prev["step"])
        prev = e
    return None


def runs_line(runs):
    """The first line: how many runs, and the training set-up they share."""
    r0 = runs[0]
    if r0.get("trainable", "top") == "full":
        what = "every parameter: encoder incl. word embeddings + head"
    else:
        what = "top %d encoder layer(s) + head" % (6 - r0["frozen_layers"])
    return ("Runs: %d; trainable d = %d (%s), %d steps, global batch %d, sequence "
            "length %d, lr %g, %s validation sentences.\n" % (
                len(runs), r0["d"], what, r0["steps"], r0["train_batch"], r0["seq_len"],
                r0["lr"], r0.get("val_sentences", "all")))


def paired_steps_to(sel, exact_run):
    """Per seed of `sel`: the steps to 99% of the same seed's exact final accuracy (None if
    never), and their ratio to the exact run's own steps (None when either is)."""
    paired_steps, paired_abs = [], []
    for r in sel:
        ex = exact_run.get(r["seed"])
        if ex is None:
            continue
        t = 0.99 * ex["final_val_accuracy"]
        mine, theirs = steps_to(r["evals"], t), steps_to(ex["evals"], t)
        paired_abs.append(mine)
        paired_steps.append(mine / theirs if (mine is not None and theirs) else None)
    return paired_abs, paired_steps


def scheme_row(scheme, sel, target, exact_final, exact_run, exact_steps, compute):
    """One scheme's table row for one n; also returns its mean steps to target (None unless
    every seed reached it)."""
    acc_m, acc_s = mean_std([r["final_val_accuracy"] for r in sel])
    loss_m, _ = mean_std([r["final_val_loss"] for r in sel])
    per_seed = [steps_to(r["evals"], target) for r in sel]
    reached = [s for s in per_seed if s is not None]
    st_mean = statistics.mean(reached) if len(reached) == len(per_seed) else None
    if scheme == "exact":
        exact_steps = st_mean
    ratio = (st_mean / exact_steps) if (st_mean is not None and exact_steps) else None
    # Paired: each seed's target is 99% of the same seed's exact final accuracy, which
    # that exact run always reaches; a low-accuracy seed cannot then hide the others.
    paired_abs, paired_steps = paired_steps_to(sel, exact_run)
    # Time to accuracy uses the paired steps (mean over seeds of the steps to 99% of
    # the same seed's exact final accuracy).
    tta_steps = statistics.mean(paired_abs) if paired_abs and all(
        x is not None for x in paired_abs) else None
    wire = sel[0]["wire_bits_per_coord"]
    comm = {gbit: wire * sel[0]["d"] / (gbit * 1e9) for gbit in (10, 100)}  # s per step
    tta = {gbit: tta_steps * (compute + c) if tta_steps is not None else None
           for gbit, c in comm.items()}
    if paired_steps and all(x is not None for x in paired_steps):
        paired_txt = "%.2f; %s" % (statistics.mean(paired_steps),
                                   ",".join("%.2f" % x for x in paired_steps))
    else:
        paired_txt = "not reached; " + ",".join(
            "%.2f" % x if x is not None else "-" for x in paired_steps)
    paired_m, paired_s = mean_std(
        [100 * (r["final_val_accuracy"] - exact_run[r["seed"]]["final_val_accuracy"])
         for r in sel if r["seed"] in exact_run])
    row = "| %s | %d | %.4f +- %.4f | %+.2f | %+.2f +- %.2f | %.4f | %s; %s | %s | %s | %.3f | %.3f | %.2f | %s | %s |" % (
        scheme, len(sel), acc_m, acc_s, 100 * (acc_m - exact_final), paired_m, paired_s, loss_m,
        "%.1f" % st_mean if st_mean is not None else "not reached",
        ",".join("%.1f" % s if s is not None else "-" for s in per_seed),
        "%.2f" % ratio if ratio is not None else "-", paired_txt,
        sel[0]["bits_per_coord"], wire,
        1e3 * comm[10],
        "%.2f" % tta[10] if tta[10] is not None else "-",
        "%.2f" % tta[100] if tta[100] is not None else "-")
    return row, st_mean


def section_lines(runs, n):
    """The markdown section of one worker count: the target, one row per scheme, and the
    measured compute per step."""
    lines = []
    exact = [r for r in runs if r["n"] == n and r["scheme"] == "exact"]
    exact_final, _ = mean_std([r["final_val_accuracy"] for r in exact])
    target = 0.99 * exact_final
    # Exact averaging's steps to target (mean over its seeds) is the reference.
    lines.append("\n### n = %d workers\n" % n)
    lines.append("Target: 99%% of exact averaging's mean final accuracy = %.4f.\n" % target)
    lines.append("| scheme | seeds | final val acc (mean +- std) | diff vs exact (pp) | "
                 "paired diff vs exact, same seed (pp, mean +- std) | final val loss | steps to target (mean; per seed, interpolated between evaluations) | steps / exact | "
                 "paired steps / exact (99% of the same seed's exact final; mean; per seed) | "
                 "bits/coord | wire bits/coord | comm per step at 10 Gbit/s (ms) | TTA 10 Gbit/s (s, "
                 "paired steps) | TTA 100 Gbit/s (s, paired steps) |")
    lines.append("|---" * 14 + "|")
    exact_run = {r["seed"]: r for r in exact}
    exact_steps = None
    compute = statistics.mean(r["compute_s_per_step_per_worker"] + r["optimizer_s_per_step"]
                              for r in runs if r["n"] == n)
    for scheme in ORDER:
        sel = [r for r in runs if r["n"] == n and r["scheme"] == scheme]
        if not sel:
            continue
        row, st_mean = scheme_row(scheme, sel, target, exact_final, exact_run, exact_steps,
                                  compute)
        if scheme == "exact":
            exact_steps = st_mean
        lines.append(row)
    lines.append("\nMeasured compute per step and worker (forward+backward share + optimizer), "
                 "mean over the %d runs with n = %d: %.4f s (used for every scheme's TTA)."
                 % (len([r for r in runs if r["n"] == n]), n, compute))
    return lines


def plot_curves(runs, n, figures):
    """study_curves_n<n>.png: validation accuracy and loss, smoothed training loss, and the
    accuracy gap to exact averaging, each the mean over seeds, per scheme."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 4, figsize=(21, 4.5))
    exact_sel = [r for r in runs if r["n"] == n and r["scheme"] == "exact"]
    exact_acc = [statistics.mean(r["evals"][k]["val_accuracy"] for r in exact_sel)
                 for k in range(len(exact_sel[0]["evals"]))] if exact_sel else None
    for i, scheme in enumerate(ORDER):
        sel = [r for r in runs if r["n"] == n and r["scheme"] == scheme]
        if not sel:
            continue
        color = "C%d" % i
        steps = [e["step"] for e in sel[0]["evals"]]
        accs = [statistics.mean(r["evals"][k]["val_accuracy"] for r in sel
                                if k < len(r["evals"])) for k in range(len(steps))]
        vls = [statistics.mean(r["evals"][k]["val_loss"] for r in sel
                               if k < len(r["evals"])) for k in range(len(steps))]
        axes[0].plot(steps, accs, color=color, label=scheme, marker=".")
        axes[1].plot(steps, vls, color=color, label=scheme, marker=".")
        hist = [statistics.mean(r["history"][k]["train_loss"] for r in sel
                                if k < len(r["history"])) for k in range(len(sel[0]["history"]))]
        window = 5
        smooth = [statistics.mean(hist[max(0, k - window + 1):k + 1]) for k in range(len(hist))]
        axes[2].plot(range(len(smooth)), smooth, color=color, label=scheme)
        if exact_acc is not None:
            axes[3].plot(steps, [100 * (a - b) for a, b in zip(accs, exact_acc)],
                         color=color, label=scheme, marker=".")
    axes[0].set_title("validation accuracy (mean of seeds), n=%d" % n)
    axes[1].set_title("validation loss (mean of seeds), n=%d" % n)
    axes[2].set_title("training loss (mean of seeds, 5-step mean), n=%d" % n)
    axes[3].set_title("val accuracy minus exact (pp, mean of seeds), n=%d" % n)
    for ax in axes:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    path = figures / ("study_curves_n%d.png" % n)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print("wrote", path)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=pathlib.Path,
                   default=REPO_ROOT / "docs" / "results" / "study" / "runs")
    p.add_argument("--figures", type=pathlib.Path, default=REPO_ROOT / "docs" / "figures")
    p.add_argument("--out", type=pathlib.Path,
                   default=REPO_ROOT / "docs" / "results" / "study" / "summary.md")
    args = p.parse_args(argv)
    runs = load(args.runs)
    if not runs:
        raise SystemExit("no runs in %s" % args.runs)
    ns = sorted({r["n"] for r in runs})
    lines = [runs_line(runs)]
    for n in ns:
        lines += section_lines(runs, n)
    wall = args.runs / "study_wall_seconds.json"
    if wall.exists():
        w = json.loads(wall.read_text())
        lines.append("\nStudy wall time: %.0f s for %d runs (%d in parallel, %d thread(s) each)."
                     % (w["wall_s"], w["runs"], w["jobs"], w["threads"]))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))

    import matplotlib  # noqa: F401  (without it, fail before making the figures folder)
    args.figures.mkdir(parents=True, exist_ok=True)
    for n in ns:
        plot_curves(runs, n, args.figures)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

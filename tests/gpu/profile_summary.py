#!/usr/bin/env python3
"""One line a profiled kernel from Nsight Compute's raw page, for check.sh's summary.

    profile_summary.py RAW_CSV [--values N] [--label KERNEL=L1,L2,...]...

RAW_CSV is what `ncu --import REPORT --page raw --csv --print-units base` prints: a header row
(one column a metric, after the launch's own columns such as "ID" and "Kernel Name"), often a
row of units, then one row a profiled launch, in launch order. Each line says where the launch
spent its time: its duration, DRAM and SM throughput against their peaks, the share of issue
slots that issued, the achieved occupancy, and the warp instructions it executed. With
--values (the values each launch processed), also the thread instructions a value (warp
instructions x 32 / N: an upper bound where lanes idle), the figure the fused hop's budget is
stated in (docs/results/gpu.md). --label names a kernel's launches in order (e.g. the hop
kernel's leaf and hop). A metric the report lacks prints as n/a; a file with no launch row
prints one line saying so and exits 1.
"""
import argparse
import csv
import sys

# (column, label, unit suffix, scale): what a line reports, in order.
METRICS = [
    ("gpu__time_duration.sum", "time", " us", 1e-3),  # base unit: ns
    ("dram__throughput.avg.pct_of_peak_sustained_elapsed", "DRAM", "% of peak", 1.0),
    ("sm__throughput.avg.pct_of_peak_sustained_elapsed", "SM", "% of peak", 1.0),
    ("smsp__issue_active.avg.pct_of_peak_sustained_active", "issue slots busy", "%", 1.0),
    ("sm__warps_active.avg.pct_of_peak_sustained_active", "achieved occupancy", "%", 1.0),
    ("launch__registers_per_thread", "registers", "", 1.0),
]
INSTRUCTIONS = "smsp__inst_executed.sum"


def number(text):
    """A metric's value as ncu prints it (maybe with thousands separators), or None."""
    text = (text or "").strip().replace(",", "")
    try:
        return float(text)
    except ValueError:
        return None


def fmt(value):
    if value is None:
        return "n/a"
    if abs(value) >= 100 or value == int(value):
        return f"{value:.0f}"
    return f"{value:.1f}"


def rows_of(path):
    """The header and the launch rows (the units row, if any, dropped)."""
    with open(path, newline="") as f:
        rows = [r for r in csv.reader(f) if r]
    header_at = next((i for i, r in enumerate(rows) if "Kernel Name" in r), None)
    if header_at is None:
        return None, []
    header = rows[header_at]
    body = rows[header_at + 1:]
    id_col = header.index("ID") if "ID" in header else None
    # The units row has an empty ID (or no number where a launch has its ID).
    launches = [r for r in body
                if len(r) == len(header) and (id_col is None or number(r[id_col]) is not None)]
    return header, launches


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("raw_csv")
    ap.add_argument("--values", type=float, default=0.0)
    ap.add_argument("--label", action="append", default=[])
    args = ap.parse_args()

    labels = {}
    for item in args.label:
        name, _, names = item.partition("=")
        labels[name] = names.split(",") if names else []

    header, launches = rows_of(args.raw_csv)
    if not launches:
        print(f"profile: no profiled launch in {args.raw_csv}")
        return 1
    col = {name: i for i, name in enumerate(header)}
    seen = {}
    for r in launches:
        # "void dq::cuda::dynamiq_hop_kernel(DynamiqDeviceParams, ...)" or the bare name: the
        # name alone.
        signature = r[col["Kernel Name"]].split("(")[0].split()
        kernel = signature[-1].split("::")[-1] if signature else ""

        k = seen.get(kernel, 0)
        seen[kernel] = k + 1
        own = labels.get(kernel, [])
        tag = own[k] if k < len(own) else f"#{k + 1}"
        parts = []
        for metric, label, unit, scale in METRICS:
            v = number(r[col[metric]]) if metric in col else None
            parts.append(f"{label} {fmt(None if v is None else v * scale)}"
                         f"{unit if v is not None else ''}")
        inst = number(r[col[INSTRUCTIONS]]) if INSTRUCTIONS in col else None
        if inst is None:
            parts.append("warp instructions n/a")
        elif args.values > 0:
            parts.append(f"warp instructions {inst:.3g} ({inst * 32 / args.values:.1f} "
                         "thread instructions a value at most)")
        else:
            parts.append(f"warp instructions {inst:.3g}")
        print(f"profile: {kernel} {tag}: " + ", ".join(parts))
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Summarises one netns_allreduce.sh run: results.jsonl + setup.txt -> result.json, result.md.

usage: summarize.py RESULTS.jsonl SETUP.txt OUT.json OUT.md

Ratios are speed-ups of the DynamiQ 5-bit run (median time per call) over the BF16 pass-through
and over MXFP8 through the engine, all from the same invocation; the collective (all-reduce or,
with netns_allreduce.sh -c reducescatter, reduce-scatter) is the same in every run. The
benchmark's targets (>= 2.5x and >= 1.5x at 1 Gbit/s) are printed next to them, never assumed.
"""
import json
import sys

# Keyed "<baseline>_over_<run>": the run's speed-up over the baseline. With nodes
# (netns_allreduce.sh --nodes 2 --local 2, 100 Mbit/s rails): two-level DynamiQ-5 against the
# engine's two-level BF16 and the flat DynamiQ-5 ring.
TARGETS = {"bf16_over_dynamiq5": 2.5, "mxfp8_over_dynamiq5": 1.5,
           "engine-bf16+node_over_dynamiq5+node": 2.9,
           "dynamiq5+flat+ring_over_dynamiq5+node": 2.5}


def main():
    if len(sys.argv) != 5:
        print(__doc__, file=sys.stderr)
        return 2
    records = []
    with open(sys.argv[1]) as f:
        for line in f:
            if line.strip():
                records.append(json.loads(line))
    setup = open(sys.argv[2]).read()
    by_label = {r["label"]: r for r in records}

    ratios = {}
    base = by_label.get("dynamiq5", {}).get("median_s")
    for other in ("bf16", "mxfp8", "fp32", "engine-bf16"):
        t = by_label.get(other, {}).get("median_s")
        if base and t:
            ratios[f"{other}_over_dynamiq5"] = t / base
    # Nodes (netns_allreduce.sh --nodes): the two-level DynamiQ-5 run over the rail-aware BF16
    # baseline (two levels through the engine) and over the flat DynamiQ-5 schedules.
    two_level = by_label.get("dynamiq5+node", {}).get("median_s")
    for other in ("engine-bf16+node", "dynamiq5+flat+ring", "dynamiq5+flat+butterfly", "bf16"):
        t = by_label.get(other, {}).get("median_s")
        if two_level and t:
            ratios[f"{other}_over_dynamiq5+node"] = t / two_level
    summary = {"setup": setup, "runs": records, "speedups": ratios,
               "targets": dict(TARGETS)}
    lines = ["```", setup.rstrip(), "```", ""]
    if "iperf3" in by_label:
        lines.append(f"iperf3 (one TCP stream, rank 0 -> rank "
                     f"{by_label['iperf3'].get('peer_rank', 1)}): "
                     f"{by_label['iperf3']['received_gbit_s']:.3f} Gbit/s")
        lines.append("")
    perf_rows = [r for r in records if r.get("tool") == "dynamiq-perf" and "busbw_gb_s" in r]
    if perf_rows:
        lines += ["| dynamiq-perf run | dtype | time per call (s, mean) | busbw (GB/s, "
                  "printed) | busbw (Gbit/s, from the time) | #wrong | identical | "
                  "link tx (MiB) |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in perf_rows:
            # dynamiq-perf prints busbw with two decimals; recompute it from the time (nccl-tests,
            # n = 4): bytes / time x 2(n-1)/n for an all-reduce, x (n-1)/n for a reduce-scatter.
            factor = 0.75 if r.get("collective") == "reducescatter" else 1.5
            busbw_gbit = r["bytes"] / (r["time_us"] / 1e6) * factor * 8 / 1e9
            r["busbw_gbit_s_from_time"] = busbw_gbit
            lines.append(f"| {r['label']} | {r['dtype']} | {r['time_us'] / 1e6:.3f} | "
                         f"{r['busbw_gb_s']:.2f} | {busbw_gbit:.3f} | {r['wrong']} | "
                         f"{r.get('identical_on_all_ranks')} | "
                         f"{r['link_tx_bytes'] / 2**20:.1f} |")
        lines.append("")
    client_rows = [r for r in records if r.get("tool") == "allreduce_client.py"]
    if client_rows or any("skipped" in r for r in records):
        lines += ["| run | wire dtype | median s per call | min | max | vNMSE | "
                  "identical | link tx (MiB, whole job) | CPU s per call (all ranks) | "
                  "cores busy | load after |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in records:
            if "skipped" in r:
                lines.append(f"| {r['label']} | skipped: {r['skipped']} | | | | | | | | | |")
            elif r.get("tool") == "allreduce_client.py" and "median_s" in r:
                vn = r["vnmse"]
                lines.append(f"| {r['label']} | {r['dtype']} | {r['median_s']:.3f} | "
                             f"{r['min_s']:.3f} | {r['max_s']:.3f} | "
                             f"{'n/a' if vn is None else f'{vn:.3e}'} | "
                             f"{r['identical_on_all_ranks']} | "
                             f"{r['link_tx_bytes'] / 2**20:.1f} | "
                             f"{r.get('cpu_s_all_ranks_median', float('nan')):.2f} | "
                             f"{r.get('cores_busy_median', float('nan')):.2f} | "
                             f"{r['load_after']} |")
            elif r.get("tool") == "allreduce_client.py":
                lines.append(f"| {r['label']} | FAILED (exit {r['exit']}) | | | | | | | | | |")
        lines.append("")
    for key, value in ratios.items():
        other, run = key.split("_over_")
        target = TARGETS.get(key)
        verdict = "" if target is None else (
            f" (target >= {target}x: {'met' if value >= target else 'NOT met'})")
        lines.append(f"- speed-up of {run} over {other}: {value:.2f}x{verdict}")
    with open(sys.argv[3], "w") as f:
        json.dump(summary, f, indent=1)
    with open(sys.argv[4], "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())

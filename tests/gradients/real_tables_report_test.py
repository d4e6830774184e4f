#!/usr/bin/env python3
"""real_tables.py report: the tables docs/results/accuracy.md quotes are computed from the
records, not copied by hand. On made-up records with known vNMSE, the per-step table's DQ5 /
MXFP8 column and the by-worker-count summary must give the ratios the records imply, leave a cell
blank where MXFP8 is missing, and leave subsampled records out of the summary; on the committed
records (docs/results/real_n4.jsonl, real_n64_full.jsonl) the two tables must agree cell for cell.
Needs no numpy (report reads JSON alone).

usage: real_tables_report_test.py [RECORDS_DIR (default docs/results)]
"""
import json
import pathlib
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "study"))
from checklist import check, exit_code  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "gradients" / "real_tables.py"


def report(*paths):
    done = subprocess.run([sys.executable, str(TOOL), "report"] + [str(p) for p in paths],
                          capture_output=True, text=True, timeout=120)
    check(done.returncode == 0, "report exits 0 (stderr: %s)" % done.stderr.strip()[-300:])
    return done.stdout


def rows_after(text, heading):
    """The table rows (cells, stripped) of the first table after a heading containing `heading`
    (not followed by a digit: "step 4" is not "step 40")."""
    lines = text.splitlines()
    pattern = re.compile(re.escape(heading) + r"(?!\d)")
    at = next((i for i, line in enumerate(lines)
               if line.startswith("####") and pattern.search(line)), None)
    if at is None:
        return []
    rows = []
    for line in lines[at + 1:]:
        if line.startswith("####"):
            break
        if line.startswith("|") and not line.startswith("|---"):
            rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows[1:]  # without the header


def record(step, part, topo, n, codec, vnmse, subsample=1):
    return {"kind": "vnmse", "corpus": "c", "step": step, "subsample": subsample,
            "block": 16384, "part": part, "topo": topo, "workers": n, "codec": codec,
            "vnmse": vnmse}


def made_up():
    recs = []
    for n, dq, mx in ((4, 3.0e-3, 1.0e-3), (8, 1.0e-3, 4.0e-3), (16, 2.5e-3, 1.0e-3)):
        recs.append(record(0, "rest", "ring", n, "dynamiq:5", dq))
        recs.append(record(0, "rest", "ring", n, "mxfp8", mx))
    recs.append(record(0, "all", "butterfly", 4, "dynamiq:5", 2.0e-3))
    recs.append(record(0, "all", "butterfly", 4, "mxfp8", 1.0e-3))
    recs.append(record(0, "all", "butterfly", 8, "dynamiq:5", 1.0e-3))  # no MXFP8: blank
    recs.append(record(0, "all", "butterfly", 16, "dynamiq:5", 1.0e-3, subsample=16))
    recs.append(record(0, "all", "butterfly", 16, "mxfp8", 1.0e-4, subsample=16))
    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp) / "made_up.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in recs))
        out = report(path)
    summary = rows_after(out, "by worker count")
    check(len(summary) == 2, "summary: one row per (step, part, topology) with a DQ5 record "
          "(got %d)" % len(summary))
    rest = [r for r in summary if r[2] == "rest"]
    check(rest == [["c", "0", "rest", "ring", "3.00", "0.25", "2.50"]],
          "rest, ring: the ratios 3.0e-3 / 1.0e-3, 1.0e-3 / 4.0e-3, 2.5e-3 / 1.0e-3 (got %s)"
          % rest)
    butterfly = [r for r in summary if r[2] == "all"]
    check(butterfly == [["c", "0", "all", "butterfly", "2.00", "", ""]],
          "all, butterfly: blank without MXFP8, the subsampled pair left out (got %s)" % butterfly)
    per_step = rows_after(out, "c, step 0")
    ratios = {(r[0], r[1], r[2]): r[-1] for r in per_step}
    at_8 = ratios.get(("rest", "ring", "8"))
    check(at_8 == "0.25", "per-step table: DQ5 / MXFP8 at n = 8 is 0.25 (got %s)" % at_8)


def committed(results):
    out = report(results / "real_n4.jsonl", results / "real_n64_full.jsonl")
    summary = rows_after(out, "by worker count")
    header = [line for line in out.splitlines() if line.startswith("| corpus | step | part")]
    counts = [int(c.strip()[4:]) for c in header[0].strip("|").split("|")[4:]] if header else []
    check(counts == [4, 8, 16, 32, 64], "committed records: n = 4 to 64 (got %s)" % counts)
    check(len(summary) == 18, "committed records: 3 steps x 3 parts x 2 topologies (got %d)"
          % len(summary))
    per_step = {}
    for step in sorted({r[1] for r in summary}):
        for r in rows_after(out, "data/gradients64, step %s" % step):
            per_step[(step, r[0], r[1], r[2])] = r[-1]
    mismatches = [(r[1], r[2], r[3], n, r[4 + i], per_step.get((r[1], r[2], r[3], str(n))))
                  for r in summary for i, n in enumerate(counts)
                  if r[4 + i] != per_step.get((r[1], r[2], r[3], str(n)))]
    check(not mismatches and len(per_step) == 90,
          "committed records: the summary equals the per-step tables' DQ5 / MXFP8 in all 90 "
          "cells (mismatches: %s)" % mismatches[:4])


made_up()
committed(pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "docs" / "results")
sys.exit(exit_code())

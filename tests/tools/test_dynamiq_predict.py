#!/usr/bin/env python3
"""dynamiq-predict's contract: buckets of a column range are the same buckets as in a whole run,
auto's summary is the energy-weighted aggregate of its rows, bad ranges are refused by name."""
import json
import subprocess
import sys

predict, sample = sys.argv[1], sys.argv[2]
failures = []


def check(cond, what):
    if not cond:
        failures.append(what)


def run(*args):
    return subprocess.run([predict, "--input", sample, "--workers", "4", "--topo", "ring",
                           "--budgets", "5,7", *args], capture_output=True, text=True, timeout=300)


def rows(r):
    check(r.returncode == 0, f"failed: {r.stderr}")
    return [json.loads(line) for line in r.stdout.splitlines() if line.strip()]


BUCKET = 65536
whole = rows(run("--bucket", str(BUCKET)))
part = rows(run("--bucket", str(BUCKET), "--columns", f"{BUCKET}:{3 * BUCKET}"))


def per_bucket(rs, offset):
    return [{k: v for k, v in x.items() if k != "bucket"} for x in rs
            if x.get("offset") == offset]


# The part's buckets are the whole run's second and third, offsets counted from column 0.
for off in (BUCKET, 2 * BUCKET):
    a, b = per_bucket(whole, off), per_bucket(part, off)
    check(len(a) == 5 and a == b, f"bucket at {off}: whole {a} part {b}")
check(not per_bucket(part, 0), "the part holds a bucket before its first column")

# The auto summary aggregates its rows: bits weighted by count, errors by the exact energy.
autos = [x for x in whole if x.get("kind") == "auto"]
summary = [x for x in whole if x.get("summary") == "auto"][0]
energy = sum(x["energy"] for x in autos)
check(len(autos) == summary["buckets"] and energy > 0, f"auto rows {len(autos)} {summary}")
vnmse = sum(x["measured"] * x["energy"] for x in autos) / energy
check(abs(vnmse - summary["vnmse"]) <= 1e-9 * vnmse, f"vnmse {vnmse} vs {summary}")
bits = sum(x["bits_per_coord"] * x["count"] for x in autos) / sum(x["count"] for x in autos)
check(abs(bits - summary["bits_per_coord"]) <= 1e-9 * bits, f"bits {bits} vs {summary}")
check(summary["buckets_at_most_mxfp8"] ==
      sum(x["measured"] <= x["mxfp8_measured"] for x in autos), f"meets: {summary}")
# A fixed row and auto's dynamiq:5 reference are the same simulation.
for x in autos:
    fixed5 = [y for y in whole if y.get("kind") == "fixed" and y["codec"] == "dynamiq:5" and
              y["offset"] == x["offset"]]
    check(len(fixed5) == 1 and fixed5[0]["measured"] == x["dynamiq5_measured"],
          f"dynamiq:5 at {x['offset']}: {fixed5} vs {x['dynamiq5_measured']}")

# Bad ranges are refused, naming the option.
for bad in ("5:3", "x:10", "10", "0:99999999999"):
    r = run("--columns", bad)
    named = "--columns" in r.stderr or "columns [" in r.stderr
    check(r.returncode == 2 and named, f"--columns {bad}: rc {r.returncode} {r.stderr[:200]}")

# The two-level shape. 4 nodes x 1 rank predicts and measures exactly what flat does.
def strip(rs, *keys):
    return [{k: v for k, v in x.items() if k not in keys} for x in rs if "kind" in x]


flat4 = rows(run("--bucket", str(BUCKET), "--columns", f"0:{2 * BUCKET}"))
node4 = rows(run("--bucket", str(BUCKET), "--columns", f"0:{2 * BUCKET}", "--hierarchy", "node"))
check(strip([x for x in flat4 if x.get("kind") != "auto"], "hierarchy") ==
      strip(node4, "hierarchy"), "4 x 1 two-level rows differ from flat")
check(all(x["hierarchy"] == "node" for x in node4 if "kind" in x), "hierarchy field")
# 2 nodes x 2 ranks: per-shard predictions within the model's band, no auto rows (each rail
# would choose its own rung), and other figures than the flat shape's of the same 4 ranks.
node22 = rows(run("--bucket", str(BUCKET), "--columns", f"0:{2 * BUCKET}", "--hierarchy",
                  "flat,node", "--ranks-per-node", "2"))
two = [x for x in node22 if x.get("hierarchy") == "node"]
check(len(two) == 2 * 4 and all(x["kind"] in ("fixed", "mx") for x in two), f"rows: {two}")
check(all(0.67 <= x["ratio"] <= 1.5 for x in two), f"two-level ratios: {two}")
for x in two:
    f = [y for y in node22 if y.get("hierarchy") == "flat" and y["kind"] == x["kind"] and
         y["codec"] == x["codec"] and y["offset"] == x["offset"]]
    check(len(f) == 1 and f[0]["measured"] != x["measured"] and f[0]["predicted"] != x["predicted"],
          f"two-level {x} against flat {f}")
r = run("--ranks-per-node", "3")
check(r.returncode == 2 and "--ranks-per-node" in r.stderr, f"4 ranks by 3: {r.stderr[:200]}")

for f in failures:
    print("FAIL:", f)
sys.exit(1 if failures else 0)

#!/usr/bin/env python3
"""dynamiq-sim --columns B:E: a part of --input gives the same result as a file holding only that
part, B:end runs to the last column, and a bad range is refused with exit 2 naming --columns.

Usage: test_dynamiq_sim_columns.py DYNAMIQ_SIM SAMPLE.npy (a float32 [rows, d] file, d >= 4096)
"""
import ast
import json
import os
import struct
import subprocess
import sys
import tempfile

sim, sample = sys.argv[1], sys.argv[2]
failures = []


def check(cond, what):
    if not cond:
        failures.append(what)


def run(*args):
    return subprocess.run([sim, *args], capture_output=True, text=True, timeout=300)


def read_npy(path):
    """(rows, cols, data bytes) of a little-endian float32 C-order 2-D .npy, without numpy."""
    with open(path, "rb") as f:
        raw = f.read()
    assert raw[:6] == b"\x93NUMPY", "not a .npy file"
    if raw[6] >= 2:
        hlen, start = struct.unpack("<I", raw[8:12])[0], 12
    else:
        hlen, start = struct.unpack("<H", raw[8:10])[0], 10
    header = ast.literal_eval(raw[start:start + hlen].decode("latin1"))
    assert header["descr"] == "<f4" and not header["fortran_order"], header
    rows, cols = header["shape"]
    return rows, cols, raw[start + hlen:]


def write_npy(path, rows, cols, data):
    header = "{'descr': '<f4', 'fortran_order': False, 'shape': (%d, %d), }" % (rows, cols)
    header += " " * ((64 - (10 + len(header) + 1) % 64) % 64) + "\n"
    with open(path, "wb") as f:
        f.write(b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header.encode("latin1"))
        f.write(data)


def slice_columns(rows, cols, data, begin, end):
    out = bytearray()
    for r in range(rows):
        out += data[(r * cols + begin) * 4:(r * cols + end) * 4]
    return bytes(out)


def results(*args):
    r = run(*args, "--workers", "4", "--topo", "ring,butterfly", "--codec", "dynamiq:5,mxfp8",
            "--format", "jsonl", "--quiet")
    check(r.returncode == 0, f"{' '.join(args)}: exit {r.returncode}: {r.stderr}")
    return [json.loads(line) for line in r.stdout.splitlines() if line.strip()]


def same(a, b, what):
    keys = ("codec", "topo", "workers", "d", "vnmse", "bits_per_coord")
    check(len(a) == len(b) == 4, f"{what}: expected 4 rows each, got {len(a)} and {len(b)}")
    for x, y in zip(a, b):
        check(all(x.get(k) == y.get(k) for k in keys), f"{what}: {x} differs from {y}")


rows, cols, data = read_npy(sample)
check(rows >= 4 and cols >= 4096, f"{sample}: need at least 4 rows and 4096 columns")
with tempfile.TemporaryDirectory() as tmp:
    # An inner part, not aligned to a super-group, against a file holding only that part.
    begin, end = 1000, cols - 777
    part = os.path.join(tmp, "part.npy")
    write_npy(part, rows, end - begin, slice_columns(rows, cols, data, begin, end))
    got = results("--input", sample, "--columns", f"{begin}:{end}")
    same(got, results("--input", part), f"--columns {begin}:{end}")
    check(all(x["d"] == end - begin for x in got), f"--columns {begin}:{end}: d {got}")
    # B:end runs to the last column.
    tail = os.path.join(tmp, "tail.npy")
    write_npy(tail, rows, cols - 2048, slice_columns(rows, cols, data, 2048, cols))
    same(results("--input", sample, "--columns", "2048:end"), results("--input", tail),
         "--columns 2048:end")
    # 0:end and 0:cols are the whole file; the option given twice: the last one wins.
    whole = results("--input", sample)
    same(results("--input", sample, "--columns", "0:end"), whole, "--columns 0:end")
    same(results("--input", sample, "--columns", f"0:{cols}"), whole, f"--columns 0:{cols}")
    same(results("--input", sample, "--columns", "0:10", "--columns", f"0:{cols}"), whole,
         "--columns given twice")

# Refusals: exit 2 and a message naming --columns, nothing on stdout.
bad = ["5:5", "3:2", "x:10", "10", "10:", ":10", "-1:10", "0:1e3", f"0:{cols + 1}",
       f"{cols}:end", f"{cols + 5}:end"]
for spec in bad:
    r = run("--input", sample, "--workers", "4", "--columns", spec, "--format", "jsonl")
    check(r.returncode == 2, f"--columns {spec}: exit {r.returncode}, expected 2")
    check("--columns" in r.stderr, f"--columns {spec}: message does not name --columns: {r.stderr}")
    check(r.stdout == "", f"--columns {spec}: printed results: {r.stdout[:200]}")
r = run("--synthetic", "--dim", "4096", "--columns", "0:100")
check(r.returncode == 2 and "--columns" in r.stderr,
      f"--columns with --synthetic: exit {r.returncode}: {r.stderr}")
r = run("--help")
check(r.returncode == 0 and "--columns B:E" in r.stdout, "--help does not list --columns B:E")

for f in failures:
    print("FAIL:", f)
print("dynamiq-sim --columns: " + ("all checks passed" if not failures else f"{len(failures)} failures"))
sys.exit(1 if failures else 0)

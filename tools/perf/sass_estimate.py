#!/usr/bin/env python3
"""Estimates a CUDA kernel's issued instructions from its SASS and an emulated run.

No GPU is needed. Two inputs:
- the kernel's SASS with line information: `nvdisasm -g -gi -c` of a cubin built with
  `-lineinfo`. Each instruction carries its inline chain, innermost frame first (file, line).
- gcov's per-line execution counts (`gcov --json-format`, a .gcov.json.gz) of the same kernel
  source run under the CUDA emulation (kernels/cuda/EMULATION.md), where every CUDA thread is a
  fiber, so a line's count is summed over threads.

An instruction is hot when every frame of its chain ran at least `--hot` times per lane and unit
of work (`--units`, e.g. super-groups: count / (32 * units)); the default, 1/64, keeps code that
one lane of a warp runs in half the units (a store by lane 0) and drops what runs rarely (ties,
error paths) or never in the run (another width, the other value type). Hot instructions are
counted once each: a fully unrolled loop body is one SASS copy a trip. Each call path in the
kernel's own file (`--depth` frames) gets a rate, how many times its code runs a unit (`--rate
PATH=R`, a path prefix such as "396 > 365"; `--other-rate`, default 0, where none matches),
and the estimate is the sum of hot instructions times their path's rate, in warp instructions a
unit and thread instructions a value (`--values-per-unit`). What it does not see:
- a loop nvcc did not unroll runs its body once (the hop's per-super-group ones take one trip,
  its block set-up's take more, so the set-up is counted low); a `for` line's increment shares
  its condition's line, so a loop whose body never ran still counts its control;
- divergence inside a hot path (both sides of a branch taken by different lanes) is counted
  once each side, as the warp issues them;
- instructions ptxas scheduled under another line's information take that line's heat (code
  after the last unconditional EXIT, out of line, is left out).

Prints the static and hot instruction counts, the estimate, a table by call path (static, hot,
rate, the deepest line's source) and the hot instructions by innermost function. With
--most-instructions or --most-per-value, exits 1 when the kernel exceeds either.
"""

import argparse
import collections
import gzip
import json
import os
import re
import sys

_FRAME = re.compile(r'\s*//## File "([^"]+)", line (\d+)')
_INSTRUCTION = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
# A definition's first line: a name and "(" at the start of a line, or after return types and
# qualifiers at column 0 (the kernel's name may sit alone on the next, indented line).
_DEFINITION = re.compile(r"^(?:[A-Za-z_][\w:<>,*& ]*\s)?\*?&?([A-Za-z_]\w*)\((?!.*;\s*$)")
_KEYWORDS = {"if", "for", "while", "switch", "return", "sizeof", "static_assert", "defined",
             "__launch_bounds__", "DQ_HD", "TEST"}


def normalise(path, root):
    path = os.path.normpath(path)
    root = os.path.normpath(root) + os.sep
    return path[len(root):] if path.startswith(root) else path


def load_counts(gcov_json, root):
    """{(file, line): count} from gcov's JSON (gzip or plain)."""
    opener = gzip.open if gcov_json.endswith(".gz") else open
    with opener(gcov_json, "rt") as f:
        data = json.load(f)
    counts = collections.Counter()
    for entry in data["files"]:
        name = normalise(entry["file"], root)
        for line in entry["lines"]:
            counts[(name, line["line_number"])] += line["count"]
    return counts


def read_instructions(sass_text, kernel, root):
    """[(opcode text, chain)] of the kernel's .text section; chain innermost frame first."""
    lines = sass_text.split("\n")
    starts = [i for i, l in enumerate(lines) if l.startswith(".text.") and kernel in l]
    if not starts:
        raise ValueError(f"no .text section of a kernel named like {kernel!r}")
    out, pending, chain = [], [], ()
    for line in lines[starts[0] + 1:]:
        if line.startswith(".text."):
            break
        frame = _FRAME.match(line)
        if frame:
            pending.append((normalise(frame.group(1), root), int(frame.group(2))))
            continue
        instruction = _INSTRUCTION.match(line)
        if instruction:
            if pending:
                chain, pending = tuple(pending), []
            out.append((instruction.group(2), chain))
    # ptxas places out-of-line code after the body's last unconditional EXIT: the slow paths of
    # divisions, the fallbacks of warp collectives for unconverged warps. It carries the line
    # information of the code before it, not its own, so it is cut off here.
    exits = [i for i, (text, _) in enumerate(out) if re.match(r"EXIT\b", text)]
    return out[:exits[-1] + 1] if exits else out


class Sources:
    """Source lines and the function each line lies in (by the definitions' first lines)."""

    def __init__(self, root):
        self.root = root
        self.files = {}

    def _load(self, name):
        if name not in self.files:
            path = name if os.path.isabs(name) else os.path.join(self.root, name)
            try:
                with open(path, encoding="utf-8", errors="replace") as f:
                    text = f.read().split("\n")
            except OSError:
                text = []
            owner, current = [], "?"
            for i, line in enumerate(text):
                m = _DEFINITION.match(line)
                if m and m.group(1) not in _KEYWORDS and not line.startswith((" ", "#", "//")):
                    current = m.group(1)
                elif line.startswith("    ") and i > 0 and text[i - 1].startswith("__global__"):
                    m2 = re.match(r"\s+([A-Za-z_]\w*)\(", line)
                    if m2:
                        current = m2.group(1)
                owner.append(current)
            self.files[name] = (text, owner)
        return self.files[name]

    def text(self, name, line):
        text, _ = self._load(name)
        return text[line - 1].strip() if 0 < line <= len(text) else ""

    def function(self, name, line):
        _, owner = self._load(name)
        return owner[line - 1] if 0 < line <= len(owner) else "?"


def hot_instructions(instructions, counts, units, hot, lanes=32):
    """[(is hot, chain)]: every frame of the chain ran >= hot times per lane and unit."""
    floor = hot * lanes * units
    out = []
    for _, chain in instructions:
        known = [counts[f] for f in chain if f in counts]
        out.append((bool(known) and min(known) >= floor, chain))
    return out


def rate_of(path, rates, other=0.0):
    """The rate of the longest prefix of `path` in rates (`other` when none)."""
    best, best_len = other, -1
    for prefix, r in rates.items():
        if (path == prefix or path.startswith(prefix + " > ")) and len(prefix) > best_len:
            best, best_len = r, len(prefix)
    return best


def parse_rate(text):
    path, sep, value = text.rpartition("=")
    if not sep or not path.strip():
        raise argparse.ArgumentTypeError(f"--rate {text!r}: expected PATH=RATE")
    try:
        return path.strip(), float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--rate {text!r}: {value!r} is not a number") from None


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("sass", help="nvdisasm -g -gi -c output")
    ap.add_argument("gcov_json", help="gcov --json-format output of the emulated run")
    ap.add_argument("--units", type=int, required=True, help="units of work the run did")
    ap.add_argument("--values-per-unit", type=int, default=256)
    ap.add_argument("--hot", type=float, default=1.0 / 64)
    ap.add_argument("--rate", type=parse_rate, action="append", default=[])
    ap.add_argument("--other-rate", type=float, default=0.0,
                    help="the rate of call paths no --rate prefix matches (e.g. a block's set-up)")
    ap.add_argument("--kernel", default="dynamiq_hop_kernel")
    ap.add_argument("--file", default="kernels/cuda/dynamiq_hop.cu",
                    help="the kernel's own file, whose frames make the call paths")
    ap.add_argument("--root", default=os.getcwd(), help="source root (paths are made relative)")
    ap.add_argument("--depth", type=int, default=2)
    ap.add_argument("--rows", type=int, default=25)
    ap.add_argument("--most-instructions", type=int, default=0,
                    help="exit 1 when the kernel has more instructions (0: no bound)")
    ap.add_argument("--most-per-value", type=float, default=0.0,
                    help="exit 1 when the estimate exceeds this many thread instructions a value")
    args = ap.parse_args(argv)
    if args.units <= 0:
        ap.error("--units must be positive")
    rates = dict(args.rate)
    with open(args.sass, encoding="utf-8", errors="replace") as f:
        instructions = read_instructions(f.read(), args.kernel, args.root)
    counts = load_counts(args.gcov_json, args.root)
    hot = hot_instructions(instructions, counts, args.units, args.hot)
    sources = Sources(args.root)
    by_path = collections.defaultdict(lambda: [0, 0, None])
    by_function = collections.defaultdict(lambda: [0.0, 0])
    total = 0.0
    for is_hot, chain in hot:
        own = [fr for fr in reversed(chain) if fr[0] == args.file][:args.depth]
        key = " > ".join(str(line) for _, line in own) or "(outside)"
        row = by_path[key]
        row[0] += 1
        row[1] += is_hot
        row[2] = own[-1] if own else None
        if is_hot:
            r = rate_of(key, rates, args.other_rate)
            total += r
            inner = chain[0] if chain else ("?", 0)
            fn = by_function[f"{os.path.basename(inner[0])}:{sources.function(*inner)}"]
            fn[0] += r
            fn[1] += 1
    n_hot = sum(1 for h, _ in hot if h)
    per_value = total * 32 / args.values_per_unit  # a warp instruction is 32 lanes' instructions
    print(f"{args.kernel}: {len(instructions)} instructions, {n_hot} hot; estimated "
          f"{total:.1f} warp instructions a unit, {per_value:.1f} thread instructions a value")
    print(f"\n{'static':>6} {'hot':>5} {'rate':>7}  call path in {args.file} (deepest line)")
    for key, (n, h, deepest) in sorted(by_path.items(), key=lambda x: -x[1][1])[:args.rows]:
        src = sources.text(*deepest)[:56] if deepest else ""
        print(f"{n:6d} {h:5d} {rate_of(key, rates, args.other_rate):7.4g}  {key:<16} {src}")
    print(f"\n{'issued':>8} {'hot':>5}  innermost function (hot instructions times their rate)")
    for key, (w, n) in sorted(by_function.items(), key=lambda x: -x[1][0])[:args.rows]:
        print(f"{w:8.1f} {n:5d}  {key}")
    failed = False
    if args.most_instructions and len(instructions) > args.most_instructions:
        print(f"FAIL: {len(instructions)} instructions, more than {args.most_instructions}")
        failed = True
    if args.most_per_value and per_value > args.most_per_value:
        print(f"FAIL: {per_value:.1f} thread instructions a value, more than "
              f"{args.most_per_value:g}")
        failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

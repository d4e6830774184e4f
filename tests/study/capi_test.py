#!/usr/bin/env python3
"""The C API half of the convergence study's path, numpy only (no torch): libdynamiq-capi.so
through its ctypes binding (tools/capi/dynamiq_capi.py) against the project's codecs and
schedules: error bounds, the bit budget, the bytes a ring sends, determinism of the rounding
keys, the codecs' order by error, errors returned as codes with a message, and auto's choice
(dq_auto_choose, the study's auto-mxfp8 scheme).
The torch half (training through the C API) is smoke_test.py.

usage: capi_test.py /path/to/libdynamiq-capi.so
Exits 77 (skipped) when numpy cannot be imported.
"""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "tools" / "capi"))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from checklist import check, exit_code, require_modules  # noqa: E402

require_modules("numpy")
import numpy as np  # noqa: E402

from dynamiq_capi import CapiError, DynamiqCapi  # noqa: E402


def spread_rows(rng, n, d, identical=False):
    """Rows whose super-group (256) norms spread over orders of magnitude, as real ones do."""
    scale = np.repeat(10.0 ** rng.normal(0, 1.5, d // 256 + 1), 256)[:d]
    shared = rng.standard_normal(d) * scale
    if identical:
        return np.tile(shared.astype(np.float32), (n, 1))
    return (shared + rng.standard_normal((n, d)) * scale).astype(np.float32)


def test_capi(lib):
    rng = np.random.default_rng(5)
    d = 1 << 17  # 128 super-groups per ring chunk at n = 4: 3 bits stays budget-honest
    for topo in ("ring", "butterfly"):
        for n in (4, 16):
            rows = spread_rows(rng, n, d, identical=True)
            avg, st = lib.allreduce("dynamiq:5", topo, rows, seed=3, call=7)
            x = rows[0].astype(np.float64)
            err = float(np.sum((avg - x) ** 2) / np.sum(x * x))
            # 5 bits per coordinate: the relative squared error of the mean of identical rows is
            # a few 1e-3 at most; a wrong scale, order or mean restore gives O(1).
            check(err < 2e-2, "dynamiq:5 %s n=%d: mean of identical rows within 2e-2 (got %.2e)"
                  % (topo, n, err))
            check(abs(st["vnmse"] - err) <= 1e-3 * max(err, 1e-12) + 1e-9,
                  "dynamiq:5 %s n=%d: reported vNMSE %.3e equals the measured %.3e"
                  % (topo, n, st["vnmse"], err))
            check(st["bits_per_coord"] <= 5.0 + 1e-9,
                  "dynamiq:5 %s n=%d: bits_per_coord %.4f <= 5.0" % (topo, n, st["bits_per_coord"]))
            check(bool(st["budget_honest"]), "dynamiq:5 %s n=%d: within budget" % (topo, n))
    # Ring of 4: every worker sends 2 x 3/4 of the compressed vector.
    rows = spread_rows(rng, 4, d)
    _, st = lib.allreduce("dynamiq:5", "ring", rows, want_result=False)
    check(abs(st["wire_bits_per_coord"] - 1.5 * st["bits_per_coord"]) < 0.05,
          "ring of 4 sends 1.5 copies per worker (%.3f vs %.3f)"
          % (st["wire_bits_per_coord"], st["bits_per_coord"]))
    # Same inputs and keys give the same bytes; another call number rounds differently.
    a, _ = lib.allreduce("dynamiq:5", "ring", rows, seed=1, call=3)
    b, _ = lib.allreduce("dynamiq:5", "ring", rows, seed=1, call=3)
    c, _ = lib.allreduce("dynamiq:5", "ring", rows, seed=1, call=4)
    check(np.array_equal(a, b), "identical (seed, call) gives identical results")
    check(not np.array_equal(a, c), "another call index changes the rounding")
    # More bits, less error; BF16 is near exact.
    v = {c: lib.allreduce(c, "ring", rows, want_result=False)[1]["vnmse"]
         for c in ("dynamiq:3", "dynamiq:5", "dynamiq:8", "mxfp4", "mxfp8", "bf16")}
    # (5 and 8 bits both sit near a floor of about 1e-5 on these rows, so only 3 bits is
    # compared with them.)
    check(v["dynamiq:3"] > 10 * max(v["dynamiq:5"], v["dynamiq:8"]),
          "DynamiQ at 3 bits is far worse than at 5 and 8 bits %s" % v)
    check(v["dynamiq:5"] < v["mxfp8"], "with super-group locality DynamiQ 5 beats MXFP8")
    check(v["mxfp4"] > v["mxfp8"] > v["bf16"], "MX error falls with element width")
    check(v["bf16"] < 1e-4, "BF16 vNMSE %.2e < 1e-4" % v["bf16"])
    # Errors come back as codes with a message, never as a crash.
    for codec, topo, n, code in (("dynamiq:2", "ring", 4, 1), ("nonsense", "ring", 4, 1),
                                 ("mxfp8", "mesh", 4, 1)):
        try:
            lib.allreduce(codec, topo, rows[:n])
            check(False, "%s/%s is rejected" % (codec, topo))
        except CapiError as e:
            check(e.code == code and len(str(e)) > 30, "%s/%s rejected: %s" % (codec, topo, e))


def test_auto_choose(lib):
    rng = np.random.default_rng(9)
    d, n = 1 << 17, 4
    # Super-group locality (scales spread over orders of magnitude): auto meets MXFP8's error
    # with a DynamiQ rung that costs fewer bits than MXFP8's 8.25, and that rung's measured
    # vNMSE is at most MXFP8's (the budget's target, on data where DynamiQ can win).
    rows = spread_rows(rng, n, d)
    spec, predicted = lib.auto_choose("mxfp8", "ring", rows)
    check(spec.startswith("dynamiq:") and float(spec.split(":")[1]) < 8.25,
          "locality: auto chooses a DynamiQ rung under 8.25 bits (%s)" % spec)
    chosen = lib.allreduce(spec, "ring", rows, want_result=False)[1]
    mx8 = lib.allreduce("mxfp8", "ring", rows, want_result=False)[1]
    check(chosen["vnmse"] <= mx8["vnmse"] and chosen["bits_per_coord"] < mx8["bits_per_coord"],
          "locality: %s %.3e at %.2f bits against MXFP8 %.3e at %.2f" %
          (spec, chosen["vnmse"], chosen["bits_per_coord"], mx8["vnmse"], mx8["bits_per_coord"]))
    check(0.67 <= predicted / chosen["vnmse"] <= 1.5,
          "prediction %.3e within [0.67, 1.5] of the measured %.3e" % (predicted, chosen["vnmse"]))
    # One scale for the whole tensor (dense, no locality): no rung under 8.25 bits beats MXFP8,
    # so auto falls back to MXFP8 itself (docs/results/budget.md, the MX fallback).
    dense = rng.standard_normal((n, d)).astype(np.float32)
    spec, _ = lib.auto_choose("mxfp8", "ring", dense)
    check(spec == "mxfp8", "dense: auto falls back to mxfp8 (%s)" % spec)
    # A loose target takes the cheapest rung; a tighter one never fewer bits.
    loose, _ = lib.auto_choose("vnmse:0.5", "ring", rows)
    check(loose == "dynamiq:3", "vnmse:0.5 takes the cheapest rung (%s)" % loose)
    tight, _ = lib.auto_choose("vnmse:1e-5", "ring", rows)
    check(tight != loose, "vnmse:1e-5 needs more than the cheapest rung (%s)" % tight)
    # Bad targets and non-finite statistics are errors with a message (the engine then keeps its
    # fixed budget), never a guess.
    bad = rows.copy()
    bad[1, 77] = np.nan
    for target, r in (("fp8", rows), ("vnmse:0", rows), ("mxfp8", bad)):
        try:
            lib.auto_choose(target, "ring", r)
            check(False, "auto_choose(%s) is refused" % target)
        except CapiError as e:
            check(e.code == 1 and len(str(e)) > 20, "auto_choose(%s) refused: %s" % (target, e))


def main():
    if len(sys.argv) != 2:
        print(__doc__)
        return 2
    lib = DynamiqCapi(sys.argv[1])
    lib.set_max_threads(1)
    test_capi(lib)
    test_auto_choose(lib)
    return exit_code()


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Smoke test of the committed gradient sample (numpy only, runs in seconds).

Checks tools/gradients/sample/: every stepNNNNN.npy has its JSON sidecar, is
float32 [workers, d] as the sidecar says, finite, and non-trivial; the
sidecar's parameter list tiles [0, d) exactly in DDP bucket order; the workers
saw disjoint micro-batches and got different gradients; every whole parameter
in the slice received a gradient; the sample fits the 16 MB budget. Also
checks sgstats.py's super-group helpers on vectors with known answers.

Usage: python3 tools/gradients/test_sample.py [SAMPLE_DIR]
Exits 0 when every check passes; prints one line per failed check and a
closing 'N passed, M failed' line.
"""

import json
import pathlib
import sys

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import sgstats  # noqa: E402  (numpy-only helpers)

SAMPLE_BUDGET_BYTES = 16 * 1024 * 1024
EXPECTED_WORKERS = 4


class Checker:
    def __init__(self):
        self.passed = 0
        self.failed = 0

    def check(self, ok, what):
        if ok:
            self.passed += 1
        else:
            self.failed += 1
            print("FAIL: %s" % what)
        return ok


def check_helpers(c):
    ones = np.ones(512)
    c.check(np.allclose(sgstats.super_group_norms(ones), [16.0, 16.0]),
            "super_group_norms of 512 ones is two norms of 16")
    short = np.ones(300)
    c.check(np.allclose(sgstats.super_group_norms(short),
                        [16.0, np.sqrt(44.0)]),
            "super_group_norms keeps a short last group")
    # 10 groups, one holding all the energy: the top 10% (1 group) holds 1.0.
    norms = np.zeros(10)
    norms[3] = 2.0
    c.check(abs(sgstats.top_energy_share(norms) - 1.0) < 1e-12,
            "top_energy_share with one non-zero group is 1")
    c.check(abs(sgstats.top_energy_share(np.ones(20)) - 0.1) < 1e-12,
            "top_energy_share of equal groups is 10%")
    rel, zero_share = sgstats.relative_to_median(np.array([0.0, 1.0, 2.0,
                                                           4.0]))
    c.check(np.allclose(rel, [0.5, 1.0, 2.0]) and abs(zero_share - 0.25)
            < 1e-12, "relative_to_median drops zeros and divides by median")


def check_step(c, npy, meta):
    name = npy.name
    grads = np.load(npy, mmap_mode="r")
    c.check(grads.dtype == np.float32, "%s: dtype %s, want float32" %
            (name, grads.dtype))
    c.check(grads.ndim == 2 and list(grads.shape) == meta["shape"],
            "%s: shape %s, sidecar says %s" % (name, grads.shape,
                                               meta["shape"]))
    c.check(grads.shape[0] == EXPECTED_WORKERS, "%s: %d workers, want %d" %
            (name, grads.shape[0], EXPECTED_WORKERS))
    c.check(meta["step"] == int(name[4:9]), "%s: sidecar step %s" %
            (name, meta["step"]))
    c.check(meta.get("dtype") == "float32", "%s: sidecar dtype" % name)
    g = np.asarray(grads, dtype=np.float64)
    c.check(np.isfinite(g).all(), "%s: non-finite values" % name)
    d = grads.shape[1]
    c.check(d % sgstats.SUPER_GROUP == 0,
            "%s: d=%d is not whole super-groups" % (name, d))
    c.check(meta["full_dim"] >= d, "%s: full_dim below the slice" % name)

    row_norms = np.linalg.norm(g, axis=1)
    c.check(not (row_norms == 0).any(), "%s: a worker's gradient is all zero" %
            name)
    distinct = all(not np.array_equal(g[i], g[j])
                   for i in range(len(g)) for j in range(i + 1, len(g)))
    c.check(distinct, "%s: two workers have identical gradients" % name)

    samples = meta["worker_samples"]
    flat = [i for s in samples for i in s]
    c.check(len(samples) == grads.shape[0] and len(set(flat)) == len(flat),
            "%s: workers' micro-batches are not disjoint" % name)
    micro = meta["args"]["micro_batch"]
    c.check(all(len(s) == micro for s in samples),
            "%s: a micro-batch is not %d sentences" % (name, micro))

    # The parameter list must tile [0, d) exactly, in order.
    params = meta["params"]
    names = [p["name"] for p in params]
    c.check(len(set(names)) == len(names), "%s: repeated parameter" % name)
    expected_offset, tiles = 0, True
    for k, p in enumerate(params):
        tiles &= p["offset"] == expected_offset
        tiles &= p["numel"] > 0
        tiles &= p["numel"] <= p["full_numel"]
        if not p["partial"]:
            tiles &= p["numel"] == int(np.prod(p["shape"]))
        else:
            tiles &= k == len(params) - 1  # only the last may be cut
        expected_offset += p["numel"]
    c.check(tiles and expected_offset == d,
            "%s: sidecar parameters do not tile [0, %d)" % (name, d))

    # DDP reduces the last-used parameters first: the classification head
    # leads the flattened gradient, and its shape matches the label count.
    head = [p for p in params if p["name"] == "head.weight"]
    c.check(bool(head) and head[0]["shape"] == [len(meta["labels"]),
                                                head[0]["shape"][1]],
            "%s: head.weight missing or not [labels, hidden]" % name)
    c.check(params[0]["name"].startswith("head."),
            "%s: first parameter is %s, not the head" %
            (name, params[0]["name"]))

    # Every whole parameter got a gradient (a dump that skipped one would
    # leave zeros).
    silent = [p["name"] for p in params if not p["partial"] and
              not np.any(g[:, p["offset"]:p["offset"] + p["numel"]])]
    c.check(not silent, "%s: no gradient in %s" % (name, silent[:3]))

    # Locality: the real layout concentrates more energy in its top 10% of
    # super-groups than the same values shuffled (what the corpus is for).
    rng = np.random.default_rng(0)
    real = sgstats.top_energy_share(sgstats.super_group_norms(g[0]))
    shuffled = sgstats.top_energy_share(
        sgstats.super_group_norms(rng.permutation(g[0])))
    c.check(real > shuffled, "%s: top-10%% energy share real %.3f <= "
            "shuffled %.3f" % (name, real, shuffled))
    return g


def main(argv):
    sample = pathlib.Path(argv[1]) if len(argv) > 1 else HERE / "sample"
    c = Checker()
    check_helpers(c)
    files = sorted(sample.glob("step*.npy"))
    c.check(len(files) >= 2, "want at least two steps in %s, found %d" %
            (sample, len(files)))
    total = sum(f.stat().st_size for f in sample.iterdir() if f.is_file())
    c.check(total <= SAMPLE_BUDGET_BYTES, "sample is %d bytes, budget %d" %
            (total, SAMPLE_BUDGET_BYTES))
    by_step = {}
    for npy in files:
        sidecar = npy.with_suffix(".json")
        if not c.check(sidecar.is_file(), "%s has no sidecar" % npy.name):
            continue
        meta = json.loads(sidecar.read_text())
        by_step[meta["step"]] = (check_step(c, npy, meta), meta)
    steps = sorted(by_step)
    if len(steps) >= 2:
        first, last = by_step[steps[0]][0], by_step[steps[-1]][0]
        c.check(first.shape != last.shape or not np.array_equal(first, last),
                "steps %d and %d hold the same gradients" %
                (steps[0], steps[-1]))
        c.check(by_step[steps[0]][1]["params"] ==
                by_step[steps[-1]][1]["params"],
                "the layout differs between steps")
    print("%d passed, %d failed" % (c.passed, c.failed))
    return 0 if c.failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))

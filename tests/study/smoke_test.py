#!/usr/bin/env python3
"""Smoke test of the convergence study's path: torch gradients -> libdynamiq-capi.so
(ctypes) -> the project's codec and schedule -> optimizer step.

usage: smoke_test.py /path/to/libdynamiq-capi.so
Exits 77 (skipped) when torch cannot be imported.
"""

import pathlib
import sys

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "tools" / "capi"))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from checklist import check, exit_code, require_modules  # noqa: E402

require_modules("torch")
import torch  # noqa: E402

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
    d = 1 << 16
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


def train(lib, codec, topo, n=4, steps=6):
    """A small MLP on a fixed synthetic task, data-parallel over n workers."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    dim, classes = 64, 8
    centers = torch.randn(classes, dim, generator=gen) * 2
    model = torch.nn.Sequential(torch.nn.Linear(dim, 512), torch.nn.ReLU(),
                                torch.nn.Linear(512, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, classes))
    params = list(model.parameters())
    d = sum(p.numel() for p in params)
    opt = torch.optim.Adam(params, lr=1e-3)
    val_y = torch.arange(512) % classes
    val_x = centers[val_y] + torch.randn(512, dim, generator=gen) * 2
    rows = np.zeros((n, d), np.float32)

    def val_loss():
        with torch.no_grad():
            return torch.nn.functional.cross_entropy(model(val_x), val_y).item()

    first = val_loss()
    for step in range(steps):
        for k in range(n):
            y = torch.randint(0, classes, (16,), generator=gen)
            x = centers[y] + torch.randn(16, dim, generator=gen) * 2
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            rows[k] = torch.cat([p.grad.reshape(-1) for p in params]).numpy()
        if codec is None:
            mean = rows.mean(0)
        else:
            mean, _ = lib.allreduce(codec, topo, rows, seed=11, call=step)
        off = 0
        for p in params:
            p.grad = torch.from_numpy(mean[off:off + p.numel()].copy()).view_as(p)
            off += p.numel()
        opt.step()
    return first, val_loss()


def test_training(lib):
    results = {}
    for codec, topo in ((None, "ring"), ("dynamiq:5", "ring"), ("dynamiq:5", "butterfly")):
        first, last = train(lib, codec, topo)
        results[(codec, topo)] = last
        check(last < 0.7 * first, "%s %s: validation loss falls %.3f -> %.3f"
              % (codec or "exact", topo, first, last))
    exact = results[(None, "ring")]
    for key in ((("dynamiq:5", "ring")), ("dynamiq:5", "butterfly")):
        check(abs(results[key] - exact) < 0.25 * exact + 0.05,
              "%s %s ends near exact averaging (%.3f vs %.3f)" % (key[0], key[1], results[key], exact))


def main():
    if len(sys.argv) != 2:
        print(__doc__)
        return 2
    torch.set_num_threads(1)
    lib = DynamiqCapi(sys.argv[1])
    lib.set_max_threads(1)
    test_capi(lib)
    test_training(lib)
    return exit_code()


if __name__ == "__main__":
    sys.exit(main())

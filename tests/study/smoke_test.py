#!/usr/bin/env python3
"""Smoke test of the convergence study's path: torch gradients -> libdynamiq-capi.so
(ctypes) -> the project's codec and schedule -> optimizer step. The C API's own checks, which
need only numpy, are capi_test.py (they run where torch is absent).

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

from dynamiq_capi import DynamiqCapi  # noqa: E402


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
    test_training(lib)
    return exit_code()


if __name__ == "__main__":
    sys.exit(main())

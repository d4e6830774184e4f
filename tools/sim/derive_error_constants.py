#!/usr/bin/env python3
"""Derives the rounding-error constants of kernels/budget_model.h (docs/ENGINE.md section 10).

For values Gaussian within a 256-value super-group (and Laplace, for comparison), the expected
squared error of one rounding as a fraction of the energy rounded:
- DynamiQ widths 2/4/8: stochastic rounding between adjacent levels of the default level table
  (eps 0.23/0.30/0.05), against the hierarchical scale (BF16 unit = sgmax/255 rounded up, UINT8
  group factor = ceil(gmax/unit)): per value (m - lo)(hi - m) s^2 with m = |v|/s;
- width 16: BF16 stochastic rounding, (v - lo)(lo + ulp - v);
- MXFP8 (E4M3) and MXFP6 (E3M2, E2M3): round to nearest even with the OCP shared exponent per 32.
Monte Carlo over 20,000 super-groups, seed 7. Usage: derive_error_constants.py
"""
import numpy as np

RNG = np.random.default_rng(7)


def levels(bits, eps):
    top_index = 2 ** (bits - 1) - 1
    e = float(np.float32(eps))
    q = 1.0 + (2.0 * e) * e
    if top_index == 1:
        return np.array([0.0, 1.0])
    top = q ** top_index - 1.0
    lv = np.array([(q ** r - 1.0) / top for r in range(top_index + 1)])
    lv = lv.astype(np.float32).astype(np.float64)
    lv[top_index] = 1.0
    return lv


def bf16_up(x):
    bits = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    hi = (bits >> 16) + ((bits & 0xFFFF) != 0)
    return (hi << 16).astype(np.uint32).view(np.float32).astype(np.float64)


def dynamiq_error(v, bits, eps):
    n = v.shape[0]
    a = np.abs(v)
    unit = bf16_up((a.max(1) / 255).astype(np.float32))
    gmax = a.reshape(n, 16, 16).max(2)
    factor = np.clip(np.ceil(gmax / unit[:, None]), 1, 255)
    s = np.repeat(factor * unit[:, None], 16, axis=1)
    m = np.minimum(a / s, 1.0)
    lv = levels(bits, eps)
    r = np.clip(np.searchsorted(lv, m, side="right") - 1, 0, len(lv) - 2)
    return ((m - lv[r]) * (lv[r + 1] - m) * s * s).sum()


def bf16_error(v):
    a = np.abs(v).astype(np.float32).astype(np.float64)
    ulp = 2.0 ** (np.floor(np.log2(np.maximum(a, 1e-38))) - 7)
    lo = np.floor(a / ulp) * ulp
    return ((a - lo) * (lo + ulp - a)).sum()


def mx_error(v, ebits, mbits, emax, largest):
    x = v.reshape(v.shape[0], -1, 32)
    amax = np.abs(x).max(2)
    scale = 2.0 ** (np.floor(np.log2(np.maximum(amax, 1e-38))) - emax)
    y = np.abs(x) / scale[:, :, None]
    emin = 2 - 2 ** (ebits - 1)
    ulp = 2.0 ** (np.maximum(np.floor(np.log2(np.maximum(y, 1e-38))), emin) - mbits)
    q = np.minimum(np.round(y / ulp) * ulp, largest)  # numpy rounds half to even
    return (((q - y) * scale[:, :, None]) ** 2).sum()


def main():
    for name, draw in (("gauss", RNG.standard_normal), ("laplace", RNG.laplace)):
        v = draw(size=(20000, 256))
        energy = (v * v).sum()
        out = [dynamiq_error(v, b, e) / energy for b, e in ((2, 0.23), (4, 0.30), (8, 0.05))]
        out.append(bf16_error(v) / energy)
        mx = [mx_error(v, 4, 3, 8, 448.0), mx_error(v, 3, 2, 4, 28.0), mx_error(v, 2, 3, 2, 7.5)]
        print(f"{name}: widths 2/4/8/16 " + " ".join(f"{x:.5g}" for x in out) +
              "; mxfp8 e4m3 / mxfp6 e3m2 / e2m3 " + " ".join(f"{x / energy:.5g}" for x in mx))


if __name__ == "__main__":
    main()

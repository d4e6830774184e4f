#!/usr/bin/env python3
"""Checks dynamiq's OCP MX element codec against ml_dtypes, an independent implementation.

Usage: mx_vs_ml_dtypes.py PATH/TO/libdynamiq-capi.so [--exhaustive]

For each element type (E4M3, E3M2, E2M3, E2M1): every code decodes to the value ml_dtypes gives
it; and random values, exact element values, midpoints between neighbours (ties), their FP32
neighbours and subnormal-range values, all within the finite range, encode to the same code as
ml_dtypes' round-to-nearest-even cast. Saturation beyond the range is checked against the
format's maximum. --exhaustive also encodes every FP32 bit pattern from +0 up to the format's
maximum, and their negatives (about 4.4e9 values in all; minutes). Exits 1 and prints every
kind of mismatch found.
"""
import ctypes
import sys

try:
    import ml_dtypes
    import numpy as np
except ImportError as e:  # CI installs both: pip install numpy ml_dtypes
    print(f"mx_vs_ml_dtypes: {e}; install with: pip install numpy ml_dtypes", file=sys.stderr)
    sys.exit(1)

KINDS = [  # (C enum value, name, ml_dtypes type, element bits)
    (0, "E4M3", ml_dtypes.float8_e4m3fn, 8),
    (1, "E3M2", ml_dtypes.float6_e3m2fn, 6),
    (2, "E2M3", ml_dtypes.float6_e2m3fn, 6),
    (3, "E2M1", ml_dtypes.float4_e2m1fn, 4),
]


def load(path):
    lib = ctypes.CDLL(path)
    for fn in (lib.dq_mx_encode, lib.dq_mx_decode):
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    return lib


def dq_encode(lib, kind, values):
    values = np.ascontiguousarray(values, dtype=np.float32)
    out = np.zeros(values.size, dtype=np.uint8)
    rc = lib.dq_mx_encode(kind, values.ctypes.data, out.ctypes.data, values.size)
    if rc != 0:
        raise RuntimeError(f"dq_mx_encode returned {rc}")
    return out


def dq_decode(lib, kind, codes):
    codes = np.ascontiguousarray(codes, dtype=np.uint8)
    out = np.zeros(codes.size, dtype=np.float32)
    rc = lib.dq_mx_decode(kind, codes.ctypes.data, out.ctypes.data, codes.size)
    if rc != 0:
        raise RuntimeError(f"dq_mx_decode returned {rc}")
    return out


def ml_codes(dtype, values):
    """ml_dtypes' RNE cast, as the element's bit pattern in the low bits of a uint8."""
    return np.asarray(values, dtype=np.float32).astype(dtype).view(np.uint8)


def report(errors, what, kind_name, inputs, got, want, limit=8):
    bad = np.nonzero(got != want)[0]
    if bad.size == 0:
        return
    errors.append(f"{kind_name} {what}: {bad.size} mismatches")
    for i in bad[:limit]:
        x = inputs[i]
        shown = f"{x!r} (0x{np.float32(x).view(np.uint32):08x})" if np.issubdtype(
            np.asarray(inputs).dtype, np.floating) else f"0x{int(x):02x}"
        errors.append(f"    input {shown}: dynamiq {got[i]!r}, ml_dtypes {want[i]!r}")


def check_kind(lib, kind, name, dtype, bits, rng, errors):
    n_codes = 1 << bits
    codes = np.arange(n_codes, dtype=np.uint8)
    # ml_dtypes stores sub-byte types in the low bits of a byte, sign at bit (bits - 1).
    want = codes.view(dtype).astype(np.float32)
    got = dq_decode(lib, kind, codes)
    both_nan = np.isnan(got) & np.isnan(want)
    same = (got.view(np.uint32) == want.view(np.uint32)) | both_nan
    report(errors, "decode of every code", name, codes, same, np.ones_like(same))

    finite = want[np.isfinite(want)]
    maxval = float(np.max(finite))
    # Exact element values, midpoints between neighbouring magnitudes (RNE ties) and the FP32
    # values on either side of each midpoint.
    mags = np.unique(np.abs(finite))
    mids = ((mags[:-1].astype(np.float64) + mags[1:]) / 2).astype(np.float32)
    near = np.concatenate([np.nextafter(mids, np.float32(0)), np.nextafter(mids, np.float32(np.inf))])
    smallest = float(mags[1])
    tiny = np.array([smallest / 2, smallest / 4, smallest * 0.75, smallest * 1e-3, 1e-30, 1e-45,
                     np.float32(np.finfo(np.float32).tiny)], dtype=np.float32)
    rand_uniform = rng.uniform(-maxval, maxval, 200_000).astype(np.float32)
    rand_log = (rng.choice([-1, 1], 200_000) *
                np.exp2(rng.uniform(np.log2(smallest) - 4, np.log2(maxval), 200_000))).astype(
                    np.float32)
    values = np.concatenate([finite, mids, near, tiny, rand_uniform, rand_log])
    values = np.concatenate([values, -values, np.float32([0.0, -0.0, maxval, -maxval])])
    values = values[np.abs(values) <= maxval]
    got = dq_encode(lib, kind, values)
    want = ml_codes(dtype, values)
    report(errors, "encode (RNE) in range", name, values, got, want)

    # Beyond the range the MX encoder saturates (OCP MX v1.0 conversion with saturation).
    big = np.float32([maxval * 1.01, maxval * 2, 1e30, np.inf, np.finfo(np.float32).max])
    big = np.concatenate([big, -big])
    got = dq_encode(lib, kind, big)
    want = ml_codes(dtype, np.sign(big) * maxval)
    report(errors, "saturation", name, big, got, want)

    # Decode(encode(x)) must equal ml_dtypes' round trip for in-range values.
    rt_got = dq_decode(lib, kind, dq_encode(lib, kind, values))
    rt_want = values.astype(dtype).astype(np.float32)
    report(errors, "round trip", name, values, rt_got.view(np.uint32), rt_want.view(np.uint32))
    print(f"{name}: {n_codes} codes decoded, {values.size} values encoded, "
          f"{big.size} saturating values checked")


def check_exhaustive(lib, kind, name, dtype, errors, step=1 << 24):
    """Every FP32 magnitude in [0, max] (and its negative) encodes as ml_dtypes casts it."""
    max_bits = int(np.float32(ml_dtypes.finfo(dtype).max).view(np.uint32))
    n_bad = 0
    for start in range(0, max_bits + 1, step):
        stop = min(start + step, max_bits + 1)
        for sign in (0, 0x80000000):
            values = (np.arange(start, stop, dtype=np.uint32) | np.uint32(sign)).view(np.float32)
            got = dq_encode(lib, kind, values)
            want = ml_codes(dtype, values)
            if not np.array_equal(got, want):
                n_bad += int(np.count_nonzero(got != want))
                report(errors, "exhaustive encode", name, values, got, want, limit=4)
    print(f"{name}: exhaustive check of {2 * (max_bits + 1)} FP32 values, {n_bad} mismatches")


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    flags = [a for a in sys.argv[1:] if a.startswith("--")]
    if len(args) != 1 or any(f != "--exhaustive" for f in flags):
        print(__doc__)
        return 2
    lib = load(args[0])
    rng = np.random.default_rng(12345)
    errors = []
    for kind, name, dtype, bits in KINDS:
        check_kind(lib, kind, name, dtype, bits, rng, errors)
        if flags:
            check_exhaustive(lib, kind, name, dtype, errors)
    # NaN: E4M3 has a NaN code, the FP6/FP4 types have none (the block's E8M0 scale carries it).
    nan_code = dq_encode(lib, 0, np.float32([np.nan]))[0]
    if not np.isnan(dq_decode(lib, 0, np.uint8([nan_code]))[0]):
        errors.append(f"E4M3: NaN encoded to 0x{nan_code:02x}, which does not decode to NaN")
    if lib.dq_mx_encode(7, None, None, 0) == 0:
        errors.append("dq_mx_encode accepted an unknown element kind")
    if errors:
        print("MISMATCHES against ml_dtypes:")
        print("\n".join(errors))
        return 1
    print("all MX element encodings match ml_dtypes")
    return 0


if __name__ == "__main__":
    sys.exit(main())

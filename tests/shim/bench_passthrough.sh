#!/usr/bin/env bash
# What libdynamiq.so adds to an ncclAllReduce it passes through (a 1 KiB call, below
# DYNAMIQ_MIN_BYTES), over a do-nothing NCCL: best of 5 x 1e6 calls, with and without the shim,
# in the same run. Usage: tests/shim/bench_passthrough.sh [build-dir]
set -euo pipefail
build="${1:-build}"
bench="$build/tests/shim/bench_passthrough"
fake="$build/tests/shim"  # the fake libnccl.so.2
base=$(LD_LIBRARY_PATH="$fake" "$bench" 1024 1000000)
shim=$(LD_LIBRARY_PATH="$fake" LD_PRELOAD="$build/shim/libdynamiq.so" DYNAMIQ_ENABLE=1 "$bench" 1024 1000000)
off=$(LD_LIBRARY_PATH="$fake" LD_PRELOAD="$build/shim/libdynamiq.so" DYNAMIQ_ENABLE=0 "$bench" 1024 1000000)
echo "ns per 1 KiB ncclAllReduce: no shim $base, shim enabled (passes it through: below DYNAMIQ_MIN_BYTES) $shim, shim disabled $off"
python3 -c "print('shim overhead per pass-through call: %.1f ns enabled, %.1f ns disabled' % ($shim - $base, $off - $base))"

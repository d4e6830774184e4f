#!/usr/bin/env bash
# Builds the libFuzzer targets of tests/fuzz in their own meson build dir: clang, ASan + UBSan,
# every source instrumented for coverage (-fsanitize=fuzzer-no-link), the targets linked with
# -fsanitize=fuzzer. -O1 -g1, asserts on: builds faster than -O2 -g (CI's 25 minutes) and keeps
# line numbers in reports. Usage: tests/fuzz/build.sh [BUILD_DIR]   (default /tmp/build-fuzz)
set -euo pipefail
src=$(cd "$(dirname "$0")/../.." && pwd)
build=${1:-/tmp/build-fuzz}
if [ ! -f "$build/build.ninja" ]; then
  CC=clang CXX=clang++ meson setup "$build" "$src" \
    -Dfuzz=true -Dtests=false -Dcuda=disabled -Dibverbs=disabled \
    -Dbuildtype=plain -Doptimization=1 -Db_ndebug=false \
    -Db_sanitize=address,undefined -Db_lundef=false \
    -Dcpp_args='-g1 -fsanitize=fuzzer-no-link -fno-sanitize-recover=undefined' \
    -Dc_args='-g1 -fsanitize=fuzzer-no-link -fno-sanitize-recover=undefined'
fi
ninja -C "$build" tests/fuzz/fuzz_codec tests/fuzz/fuzz_net_frames tests/fuzz/fuzz_settings \
  tests/fuzz/fuzz_npy tests/fuzz/fuzz_perf_options

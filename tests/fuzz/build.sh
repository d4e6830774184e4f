#!/usr/bin/env bash
# Builds the libFuzzer targets of tests/fuzz in their own meson build dir: clang, ASan + UBSan,
# every source instrumented for coverage (-fsanitize=fuzzer-no-link), the targets linked with
# -fsanitize=fuzzer. Usage: tests/fuzz/build.sh [BUILD_DIR]   (default /tmp/build-fuzz)
set -euo pipefail
src=$(cd "$(dirname "$0")/../.." && pwd)
build=${1:-/tmp/build-fuzz}
if [ ! -f "$build/build.ninja" ]; then
  CC=clang CXX=clang++ meson setup "$build" "$src" \
    -Dfuzz=true -Dtests=false -Dcuda=disabled -Dibverbs=disabled \
    -Dbuildtype=debugoptimized -Db_ndebug=false \
    -Db_sanitize=address,undefined -Db_lundef=false \
    -Dcpp_args='-fsanitize=fuzzer-no-link -fno-sanitize-recover=undefined' \
    -Dc_args='-fsanitize=fuzzer-no-link -fno-sanitize-recover=undefined'
fi
ninja -C "$build" tests/fuzz/fuzz_codec tests/fuzz/fuzz_net_frames tests/fuzz/fuzz_settings \
  tests/fuzz/fuzz_npy tests/fuzz/fuzz_perf_options

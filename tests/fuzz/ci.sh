#!/usr/bin/env bash
# CI leg of issue 16 section 1: builds the fuzzers and runs each for SECONDS (default 60) from
# the committed corpus, one after another. Fails when any target crashes, leaks or trips a
# sanitizer. Usage: tests/fuzz/ci.sh [SECONDS] [BUILD_DIR]
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
seconds=${1:-60}
build=${2:-/tmp/build-fuzz}
"$here/build.sh" "$build" || exit 1
failed=0
for t in fuzz_codec fuzz_net_frames fuzz_settings fuzz_npy fuzz_perf_options; do
  "$here/run.sh" "$t" "$seconds" "$build" || failed=1
done
exit $failed

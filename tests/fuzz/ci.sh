#!/usr/bin/env bash
# The CI's fuzzing leg: builds the fuzzers and runs each for SECONDS (default 60) from
# the committed corpus, JOBS targets at a time (default 2: one per core of the CI machine; each
# target is one process). Fails when any target crashes, leaks or trips a sanitizer.
# Usage: tests/fuzz/ci.sh [SECONDS] [BUILD_DIR]
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
seconds=${1:-60}
build=${2:-/tmp/build-fuzz}
jobs=${JOBS:-2}
"$here/build.sh" "$build" || exit 1
logs=$(mktemp -d "${TMPDIR:-/tmp}/fuzz-ci.XXXXXX")
failed=0
pids=() names=()
wait_one() {  # waits for the oldest running target, prints its summary
  local pid=${pids[0]} name=${names[0]}
  pids=("${pids[@]:1}") names=("${names[@]:1}")
  wait "$pid" || failed=1
  cat "$logs/$name"
}
for t in fuzz_codec fuzz_net_frames fuzz_settings fuzz_npy fuzz_perf_options; do
  [ ${#pids[@]} -lt "$jobs" ] || wait_one
  "$here/run.sh" "$t" "$seconds" "$build" >"$logs/$t" 2>&1 &
  pids+=($!) names+=("$t")
done
while [ ${#pids[@]} -gt 0 ]; do wait_one; done
rm -rf "$logs"
exit $failed

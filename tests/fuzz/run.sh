#!/usr/bin/env bash
# Runs one libFuzzer target for SECONDS from its committed corpus (tests/fuzz/corpus/TARGET),
# one process. New inputs go to a scratch corpus, never to the committed one. Exit 0 only when the
# run ended without a crash, leak, timeout or sanitizer report; prints the executions.
# Usage: tests/fuzz/run.sh TARGET SECONDS [BUILD_DIR]   (default /tmp/build-fuzz)
# Extra libFuzzer flags: FUZZ_FLAGS="-runs=1000000" tests/fuzz/run.sh ...
set -uo pipefail
target=$1
seconds=$2
here=$(cd "$(dirname "$0")" && pwd)
build=${3:-/tmp/build-fuzz}
exe=$build/tests/fuzz/$target
corpus=$here/corpus/$target
[ -x "$exe" ] || { echo "run.sh: $exe not built (tests/fuzz/build.sh)"; exit 2; }
[ -d "$corpus" ] || { echo "run.sh: no corpus $corpus"; exit 2; }
work=$(mktemp -d "${TMPDIR:-/tmp}/fuzz-$target.XXXXXX")
log=$work/log
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1:allocator_may_return_null=0}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
start=$(date +%s)
# shellcheck disable=SC2086
# One process, one job (no -jobs: libFuzzer would fork a worker logging to ./fuzz-0.log).
"$exe" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 \
  -print_final_stats=1 -artifact_prefix="$work/" ${FUZZ_FLAGS:-} "$work" "$corpus" >"$log" 2>&1
rc=$?
end=$(date +%s)
execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' | tail -1)
echo "$target: exit $rc, ${execs:-?} executions in $((end - start)) s (log $log)"
if [ $rc -ne 0 ] || grep -qE 'ERROR: (AddressSanitizer|LeakSanitizer|libFuzzer)|runtime error:|SUMMARY: ' "$log"; then
  grep -E 'ERROR:|runtime error:|SUMMARY:|Test unit written' "$log" | head -20
  echo "$target: FAILED"
  exit 1
fi
exit 0

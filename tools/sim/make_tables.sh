#!/usr/bin/env bash
# Regenerates the simulator figures of docs/results/accuracy.md into docs/results/*.jsonl.
# Usage: tools/sim/make_tables.sh [build-dir]   (about 5 minutes on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/../.."
sim="${1:-build}/tools/dynamiq-sim"
out=docs/results
mkdir -p "$out"
codecs=dynamiq:5,mxfp8,mxfp6,mxfp4,uniform:5,bf16
for spread in 0 1; do
  "$sim" --synthetic --dim 262144 --spread "$spread" --workers 4,8,16,32,64 --topo ring,butterfly \
    --codec "$codecs" --seed 1 --format jsonl --quiet > "$out/synthetic_spread$spread.jsonl"
done
"$sim" --synthetic --dim 262144 --spread 1 --workers 8 --topo ring,butterfly --seed 1 --format jsonl --quiet \
  --codec dynamiq:5,dynamiq:5:corr=0,dynamiq:5:levels=uniform,dynamiq:5:scales=flat,dynamiq:5:widths=fixed,dynamiq:5:mean=0,dynamiq:5:w16=0,dynamiq:5:corr=0:levels=uniform:scales=flat:widths=fixed \
  > "$out/ablation_spread1_n8.jsonl"
for step in 00000 00079; do
  "$sim" --input tools/gradients/sample/step$step.npy --workers 4 --topo ring,butterfly --seed 1 \
    --codec dynamiq:3,dynamiq:4,$codecs,dynamiq:6 --format jsonl --quiet > "$out/sample_step$step.jsonl"
done
"$sim" --synthetic --dim 262144 --spread 1 --workers 8 --topo ring --seed 1 --format jsonl --quiet --per-hop \
  --codec dynamiq:5,mxfp8 > "$out/perhop_spread1_n8.jsonl"

# eps selection on the bundled real gradients (4 workers).
for step in 00000 00079; do
  "$sim" --input tools/gradients/sample/step$step.npy --workers 4 --topo ring,butterfly --seed 1 --format jsonl --quiet \
    --codec dynamiq:5:eps4=0.18:eps8=0.1,dynamiq:5:eps4=0.3:eps8=0.1,dynamiq:5:eps4=0.4:eps8=0.1,dynamiq:5:eps4=0.5:eps8=0.1,dynamiq:5:eps4=0.3:eps8=0.05,dynamiq:5:eps4=0.3:eps8=0.15,dynamiq:5:levels=uniform \
    > "$out/eps_sample_step$step.jsonl"
done
echo "wrote $out"

#!/bin/sh
# Regenerates docs/results/real_*.jsonl: vNMSE of every codec on the real gradient corpus
# (issue 5 part 2). Needs libdynamiq-capi.so (DQ_CAPI_LIB, else <build>/tools/capi) and:
#   data/gradients    python3 tools/gradients/make_corpus.py            (4 workers, steps 0,40,79)
#   data/gradients64  python3 tools/gradients/make_corpus.py --workers 64 --steps 0,40 \
#                       --total-steps 80 --stop-after 40 --out data/gradients64
# THREADS (default 1) caps the core library's threads; the machine is shared.
set -eu
cd "$(dirname "$0")/../.."
T=${THREADS:-1}
R=docs/results
RT="python3 tools/gradients/real_tables.py"
mkdir -p "$R"
rm -f "$R/real_n4.jsonl" "$R/real_n64.jsonl" "$R/real_match.jsonl" "$R/real_profile.jsonl"
# 1. n = 4, the whole vector, three steps: every codec on the ring, the main ones on the butterfly.
$RT vnmse --corpus data/gradients --steps 0,40,79 --workers 4 --topos ring --energy \
  --codecs dynamiq:3,dynamiq:4,dynamiq:5,dynamiq:6,dynamiq:7,dynamiq:8,mxfp8,mxfp6,mxfp4,uniform:5,bf16 \
  --threads "$T" --out "$R/real_n4.jsonl"
$RT vnmse --corpus data/gradients --steps 0,40,79 --workers 4 --topos butterfly \
  --codecs dynamiq:3,dynamiq:4,dynamiq:5,dynamiq:6,mxfp8,mxfp6,mxfp4,uniform:5,bf16 \
  --threads "$T" --out "$R/real_n4.jsonl"
# Energy concentration profile of the exact sums (top-k shares, super-groups far below median).
$RT profile --corpus data/gradients --steps 0,40,79 --workers 4 --out "$R/real_profile.jsonl"
# 2. The budget at which DynamiQ matches MXFP8, n = 4, ring, whole vectors.
$RT match --corpus data/gradients --steps 0,40,79 --workers 4 --topos ring \
  --threads "$T" --out "$R/real_match.jsonl"
# 3. n = 4 .. 64 (64 workers on disjoint micro-batches), every 16th block of 16384 values.
$RT vnmse --corpus data/gradients64 --steps 0,40 --workers 4,8,16,32,64 --topos ring,butterfly \
  --energy --subsample 16 --codecs dynamiq:5,mxfp8,mxfp6,mxfp4,uniform:5,bf16 \
  --threads "$T" --out "$R/real_n64.jsonl"
$RT report "$R/real_n4.jsonl" "$R/real_profile.jsonl" "$R/real_match.jsonl" "$R/real_n64.jsonl" \
  > "$R/real_tables.md"

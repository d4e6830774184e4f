#!/bin/sh
# Regenerates docs/results/real_*.jsonl and real_tables.md: vNMSE of every codec on the real
# gradient corpus (docs/results/real_tables.md). Needs libdynamiq-capi.so (DQ_CAPI_LIB, else
# <build>/tools/capi) and the corpus:
#   data/gradients64  python3 tools/gradients/make_corpus.py --workers 64 --steps 0,40,79 \
#                       --total-steps 80 --out data/gradients64
# Since a007719 worker k's gradient does not depend on --workers, so the first 4 rows of
# data/gradients64 are the 4-worker corpus: every n reads this one corpus (its first n rows).
# THREADS (default 2) caps the core library's threads; STEPS (default 0,40,79) the steps of
# the n = 8..64 sweep and its energy records (the slowest part: about 7 min per step on 2 cores).
set -eu
cd "$(dirname "$0")/../.."
T=${THREADS:-2}
STEPS=${STEPS:-0,40,79}
C=data/gradients64
R=docs/results
RT="python3 tools/gradients/real_tables.py"
ALL_CODECS=dynamiq:5,mxfp8,dynamiq:3,dynamiq:4,dynamiq:6,mxfp6,mxfp4,uniform:5,bf16
mkdir -p "$R"
rm -f "$R/real_n4.jsonl" "$R/real_n64_full.jsonl" "$R/real_match.jsonl" "$R/real_profile.jsonl" \
  "$R/real_energy.jsonl"
# 1. n = 4, the whole vector, three steps: every codec on the ring, the main ones on the butterfly.
$RT vnmse --corpus $C --steps 0,40,79 --workers 4 --topos ring \
  --codecs $ALL_CODECS,dynamiq:7,dynamiq:8 --threads "$T" --out "$R/real_n4.jsonl"
$RT vnmse --corpus $C --steps 0,40,79 --workers 4 --topos butterfly \
  --codecs $ALL_CODECS --threads "$T" --out "$R/real_n4.jsonl"
# 2. n = 8 .. 64 workers on disjoint micro-batches, whole vectors, both topologies (n = 4 is
#    command 1: the same rows).
$RT vnmse --corpus $C --steps "$STEPS" --workers 8,16,32,64 --topos ring,butterfly \
  --codecs $ALL_CODECS --threads "$T" --out "$R/real_n64_full.jsonl"
# 3. Energy concentration: top-10% share per part and n, and the profile of the exact sums.
$RT vnmse --corpus $C --steps 0,40,79 --workers 4 --energy --codecs "" \
  --out "$R/real_energy.jsonl"
$RT vnmse --corpus $C --steps "$STEPS" --workers 8,16,32,64 --energy --codecs "" \
  --out "$R/real_energy.jsonl"
$RT profile --corpus $C --steps 0,40,79 --workers 4 --out "$R/real_profile.jsonl"
# 4. The budget at which DynamiQ matches MXFP8: n = 4 on the ring at every step; n = 16 and 64
#    on the ring at step 40.
$RT match --corpus $C --steps 0,40,79 --workers 4 --topos ring \
  --threads "$T" --out "$R/real_match.jsonl"
$RT match --corpus $C --steps 40 --workers 16,64 --topos ring \
  --threads "$T" --out "$R/real_match.jsonl"
$RT report "$R/real_n4.jsonl" "$R/real_n64_full.jsonl" "$R/real_energy.jsonl" \
  "$R/real_profile.jsonl" "$R/real_match.jsonl" > "$R/real_tables.md"

#!/bin/sh
# The fused hop's issued instructions a value on sm_90, estimated without a GPU
# (tools/perf/sass_estimate.py): the hop's SASS with line information, each instruction weighted by
# whether its lines ran in one emulated hop (tests/kernels/cuda/hop_once.cc, built here with gcov's
# instrumentation) and by how often its call path runs a super-group.
#
#   tools/perf/hop_instructions.sh [--most-instructions N] [--most-per-value X] BUILD_DIR \
#       [hop_once options, e.g. --bf16 --inputs 0]
#
# Run from the source root, after `ninja -C BUILD_DIR`. Needs nvcc, g++ and gcov, and nvdisasm
# and cuobjdump: from PATH, the CUDA toolkit, or PyPI's nvidia-cuda-nvdisasm and
# nvidia-cuda-cuobjdump in .venv or beside $PYTHON (tools/setup.sh installs them). Prints the
# estimator's tables; the work folder is removed. Exits 77 (a skip) when a tool is missing, 1
# when the hop exceeds a bound given (its SASS instructions, its thread instructions a value).
set -eu
bounds=""
while [ $# -ge 2 ]; do
  case $1 in
    --most-instructions | --most-per-value) bounds="$bounds $1 $2"; shift 2 ;;
    *) break ;;
  esac
done
[ $# -ge 1 ] || { echo "usage: $0 [--most-... N] BUILD_DIR [hop_once options]" >&2; exit 2; }
build=$1
shift
hop=kernels/cuda/dynamiq_hop.cu
[ -f "$hop" ] || { echo "$0: run from the source root ($hop not found)" >&2; exit 2; }
for lib in kernels/cuda/emu/libdynamiq-cuda-emu.a kernels/libdynamiq-kernels.a \
  common/libdynamiq-common.a; do
  [ -f "$build/$lib" ] || { echo "$0: $build/$lib not found: ninja -C $build first" >&2; exit 2; }
done

python=${PYTHON:-python3}
venv=$(dirname "$(command -v "$python")")/..
find_tool() {
  if command -v "$1" >/dev/null 2>&1; then command -v "$1"; return; fi
  for dir in /usr/local/cuda/bin "$venv"/lib/python3*/site-packages/nvidia/cu*/bin \
    .venv/lib/python3*/site-packages/nvidia/cu*/bin; do
    if [ -x "$dir/$1" ]; then echo "$(cd "$dir" && pwd)/$1"; return; fi
  done
  echo "$0: $1 not found (PATH, /usr/local/cuda/bin, .venv's nvidia-cuda-* wheels)" >&2
  exit 77
}
nvcc=$(find_tool nvcc) || exit 77
nvdisasm=$(find_tool nvdisasm) || exit 77
cuobjdump=$(find_tool cuobjdump) || exit 77
command -v gcov >/dev/null 2>&1 || { echo "$0: gcov not found" >&2; exit 77; }

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# The hop's SASS with its inline chains, built as the project builds it for sm_90.
"$nvcc" -x cu -std=c++20 -c -gencode=arch=compute_90,code=sm_90 --fmad=false -prec-div=true \
  -prec-sqrt=true -ftz=false -lineinfo -I. "$hop" -o "$work/hop.o"
(cd "$work" && "$cuobjdump" -xelf all hop.o >/dev/null)
"$nvdisasm" -g -gi -c "$work"/*sm_90.cubin >"$work/hop.sass"

# One emulated hop with gcov's line counts (-O0: every line keeps its own count).
g++ -std=c++20 -O0 --coverage -ffp-contract=off -fno-math-errno -fno-trapping-math -DNDEBUG \
  -DBOOST_CONTEXT_DYN_LINK=1 -I. -I"$build" -o "$work/hop_once" tests/kernels/cuda/hop_once.cc \
  tests/kernels/cuda/dynamiq_hop_emu.cc tests/kernels/cuda/dynamiq_finish_emu.cc \
  "$build/kernels/cuda/emu/libdynamiq-cuda-emu.a" "$build/kernels/libdynamiq-kernels.a" \
  "$build/common/libdynamiq-common.a" -lboost_context -ltbb -pthread
"$work/hop_once" "$@" | tee "$work/run.txt"
units=$(sed -n 's/.* values, \([0-9]*\) super-groups,.*/\1/p' "$work/run.txt")
inputs=$(sed -n 's/.* super-groups, \([0-9]*\) inputs,.*/\1/p' "$work/run.txt")
blocks=$(sed -n 's/.* bits, \([0-9]*\) blocks of 256 threads.*/\1/p' "$work/run.txt")
[ -n "$units" ] && [ -n "$inputs" ] && [ -n "$blocks" ] ||
  { echo "$0: hop_once's output not understood" >&2; exit 1; }
(cd "$work" && gcov --json-format hop_once-dynamiq_hop_emu.gcda >/dev/null)

# The call paths' rates, from the source: the kernel's call of hop_warp, whose call of
# hop_supergroup runs once a super-group (its input loop, not unrolled, once an input) and whose
# stratum draw once a pair of them. The rest (the block's set-up, hop_warp's loops) runs about
# once a warp: 8 warps a block, blocks / units a super-group (while a warp has at most 2, as at
# 16 super-groups a block, the hop's grid for large chunks).
line_of() {
  n=$(grep -n "$1" "$hop" | cut -d: -f1)
  [ "$(echo "$n" | wc -w)" -eq 1 ] || { echo "$0: '$1' is not one line of $hop" >&2; exit 1; }
  echo "$n"
}
warp=$(line_of '^  hop_warp(d, l, s_levels')
supergroup=$(line_of '^        hop_supergroup(d, levels')
input=$(line_of '^    bad |= add_input(d, levels')
stratum=$(line_of 'ws.pi\[lane\] = corr ?')
"$python" tools/perf/sass_estimate.py "$work/hop.sass" "$work/hop_once-dynamiq_hop_emu.gcov.json.gz" \
  --units "$units" --root "$(pwd)" --kernel dynamiq_hop_kernel --file "$hop" --depth 3 \
  --rate "$warp > $supergroup=1" --rate "$warp > $supergroup > $input=$inputs" \
  --rate "$warp > $stratum=0.5" --other-rate "$(awk "BEGIN { print 8 * $blocks / $units }")" \
  $bounds

#!/usr/bin/env bash
# The prepared GPU check: one command that, on a machine with a CUDA device
# (one H200, 16 cores: under 8 minutes), builds what the checks need and runs them, each step
# under its own timeout, continuing after a failed step.
#
#   tests/gpu/check.sh OUT_DIR [BUILD_DIR]
#
# OUT_DIR receives (few files, so that the device tool's $OUT brings them all back):
#   summary.txt    the commit (build-gpu-deps/COMMIT, written by tests/gpu/fetch_deps.sh), the
#                  table: step, result (pass / FAIL / skip / TIMEOUT), seconds, note; rewritten
#                  after every step ("partial: after STEP" in its header until the end)
#   check.log      every step's output in order, under a header naming the step
#   steps.tar.gz   the same per step (steps/NAME.log) and meson's test logs
#   profile.txt    Nsight Compute's sections for each profiled launch (profile_kernels)
#   hop_sass.csv   the hop kernel's SASS, each instruction with its counters (profile_kernels)
# BUILD_DIR: default build-gpu (gitignored), configured with -Dcuda=enabled when it has no
# build.ninja yet; an existing configured build dir is used as it is (never re-set up).
#
# Steps, in order (expected times on the H200 machine, from a fresh build dir):
#   gpu_info         nvidia-smi, nvcc, compute-sanitizer, compilers (1 s)
#   deps             gtest, TBB, nlohmann-json, CLI11: the system's, else the Debian packages carried in
#                    build-gpu-deps/ (tests/gpu/fetch_deps.sh fetches them where apt works),
#                    unpacked under BUILD_DIR-sysroot; NVIDIA's NCCL from the CUDA toolkit or pip (1 s)
#   configure        meson setup BUILD_DIR -Dcuda=enabled -Dgpu_werror=false, and -Dgpu_archs=the
#                    device's SM when it is 80 or 90 (20-40 s)
#   build_first      ninja -j$(nproc): the first measurements' targets alone (hop_bandwidth,
#                    call_kernels, call_vs_nccl, the shim, the net plugin, and what they need:
#                    the core library, nvcc for the device's SM) (60-150 s)
#   hop_bandwidth    the fused hop against a device-to-device cudaMemcpy of the same tensor in the
#                    same run, timed first and its RESULT line printed at once; then the leaf, the
#                    finish, the statistics, the layout; the same in BF16; prints GB/s and the
#                    ratio (target hop >= 60% of the copy); never fails on it (5 s)
#   call_kernels     the codec kernels of one 256 MiB FP32 all-reduce as rank 0 of a 2-rank
#                    ring runs them (statistics, budget, layout, leaf, hop, finish; 16 MiB
#                    pipeline blocks), as one call (its RESULT line printed at once) and each kind
#                    alone, against NCCL's BF16 all-reduce of the tensor on a 100 Gbit/s link,
#                    computed from its bytes (target <= 10%); never fails on it (5-20 s)
#   call_vs_nccl     one whole compressed 256 MiB FP32 call through the preloaded shim against
#                    NCCL's BF16 all-reduce of the same tensor, same 2 ranks (loopback link);
#                    prints both times and the bytes each sends (10-30 s)
#   build            ninja -k 0 -j$(nproc): every other gpu suite executable (a target's error
#                    leaves the others built; a step whose files are missing is a skip naming the
#                    file and the build's first error) (30-120 s)
#   gpu_math         the device's codec arithmetic against the host's, bit for bit (1 s)
#   cuda_stats_device, cuda_dynamiq_layout_device, cuda_dynamiq_hop_device
#                    tests/kernels/cuda/{stats,dynamiq}_test.cc on the device: every kernel
#                    against the host codec byte for byte, the emulated tests' matrix (5-30 s)
#   cuda_layout_batch_device, cuda_grid_kernels_device
#                    tests/kernels/cuda/{layout_batch,grid_kernels}_test.cc on the device: a
#                    call's layouts in one batch, the grid layout and the budget over many blocks
#                    (their hand-offs between blocks), byte for byte against the host (2-20 s)
#   hop_grids        hop_bandwidth --grids: the FP32 hop on its launch's grid and on 1/2, 1/4 and
#                    1/8 of it, for an 8-rank ring's step of a 16 MiB pipeline block (one
#                    super-group a warp) and for the default run's tensor; never fails on the
#                    ratios (5-15 s)
#   real_nccl_with_plugin, shim_passes_gpu_allreduce_through, real_nccl_compressed_2ranks,
#   shim_capture_gpu_2ranks
#                    NVIDIA's NCCL, 2 ranks as two fake hosts (NCCL_HOSTID) on the one GPU: the
#                    net plugin; the shim passing a small call through; the shim's compressed
#                    all-reduce on the CUDA device; PyTorch's warm-up-then-capture sequence (an
#                    eager compressed call, a captured all-reduce passed through, two exact
#                    replays, the communicator healthy and compressing afterwards) (10-60 s each)
#   torch_ddp_2ranks an unmodified PyTorch job through the preloaded shim (tests/gpu/torch_ddp_smoke.py):
#                    torch.distributed's NCCL backend, 2 ranks on the one GPU; FP32 and BF16 SUM
#                    and AVG all-reduces against FP64, DDP training against a twin on a group
#                    that dynamiq.register() opts out, the counters of both groups (20-60 s)
#   other gpu suite tests (cuda_device_gpu_steps, shim_4proc_device_buffers, any added later):
#                    meson test, one step each (10-60 s)
#   cpu_nccl_4proc_device_buffers  4 processes on the one GPU through the CPU NCCL with
#                    cuMemAlloc'd buffers staged in stream order: all-reduce FP32/BF16 SUM,
#                    reduce-scatter, all-gather in place, send/recv, exact (10-30 s); the CPU NCCL
#                    alone. shim_4proc_device_buffers (among the other gpu suite tests): the
#                    same buffers compressed by the shim's engine on the CUDA device (canary
#                    included), its bytes against the host engine's
#   profile_kernels  Nsight Compute (ncu) on hop_bandwidth's profiled round, 2^25 values in one
#                    chunk: the hop kernel (leaf and hop, FP32 and BF16) with every section and
#                    the SASS-level counters, then every kernel of the round (statistics, layout,
#                    finish) with the throughput sections; a line a launch in the summary, the
#                    sections in profile.txt, the hop's SASS with its counters in hop_sass.csv;
#                    a skip where ncu is missing or may not read the counters (30-120 s)
#   memcheck_grid_kernels, racecheck_grid_kernels, memcheck_layout_batch, memcheck_dynamiq,
#   racecheck_dynamiq, memcheck_stats, racecheck_stats, racecheck_layout_batch
#                    compute-sanitizer on the kernel tests with DQ_KERNEL_TESTS_REDUCED=1 (the
#                    largest cases left out); any report fails the step; last, since slowest:
#                    what the budget leaves (30-90 s each); a skip where compute-sanitizer
#                    refuses the device (a sandboxed runtime)
# The summary ends with the targets read from the benchmarks' RESULT lines (hop / copy >= 0.60,
# codec kernels / 100 Gbit/s BF16 link <= 0.10: met or NOT met) and those lines.
# A time budget (DQ_GPU_CHECK_BUDGET_S, default 450 s from the start) caps every step's timeout;
# a step that would start with under 10 s left is skipped with that reason. Once one of NVIDIA's
# NCCL steps (call_vs_nccl, real_nccl_*, shim_passes_gpu_*, *_gpu_2ranks, torch_ddp_2ranks) has
# timed out, the others get at most 45 s each, and after a second none runs (a skip with the
# reason), so that the profile and the sanitizers keep their time. summary.txt and steps.tar.gz
# are rewritten after every step, so that a run the device call kills still returns them.
# NCCL_SOCKET_IFNAME and DYNAMIQ_NET_IFNAME default to lo for every process (the parents that
# make NCCL's unique id included).
#
# Exit status: 0 every step passed or skipped with a CUDA device present; 1 some step failed or
# timed out; 3 nothing failed but no CUDA device was found (the GPU steps skipped: a machine
# without a GPU, where only the build is checked); 2 usage.
#
# Environment: DYNAMIQ_TIMEOUT_MS (10000 here), DQ_GPU_CHECK_BUDGET_S (450), DQ_GPU_PROFILE=0 (no
# profile_kernels step), DQ_GPU_ONLY (an extended regular expression: only the steps whose whole
# name it matches run, after the set-up steps; e.g. 'profile_kernels|(mem|race)check_.*' for a
# second call on the still-warm machine, whose build is then up to date), DQ_GPU_DEPS (build-gpu-deps: the carried .deb
# folder), DQ_GPU_DEPS_FORCE=1 (use the carried packages even where the system has them: to
# test that path), MESON (default: meson on PATH, else python3 -m mesonbuild.mesonmain, else
# .venv/bin/meson; ninja likewise from python3's package), JOBS (nproc).
# The step functions run through `step` (in a child bash, by name): shellcheck cannot see it.
# shellcheck disable=SC2317
set -u
set -o pipefail

if [ $# -lt 1 ] || [ $# -gt 2 ]; then
  echo "usage: $0 OUT_DIR [BUILD_DIR]" >&2
  exit 2
fi
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT" || exit 2
mkdir -p "$1" || exit 2
OUT=$(cd "$1" && pwd)
BUILD=${2:-build-gpu}
case "$BUILD" in /*) ;; *) BUILD="$ROOT/$BUILD" ;; esac
LOGS="$BUILD-check-logs"
rm -rf "$LOGS"
mkdir -p "$LOGS/steps" || exit 2
: >"$OUT/check.log"
: >"$LOGS/summary.rows"
JOBS=${JOBS:-$(nproc)}
# A hung peer ends a step in 10 s rather than the default minute (the engine's waits, the net
# plugin's and the CPU NCCL's follow it); NVIDIA's NCCL has no timeout of its own, so every step
# that runs it is bounded by its step timeout and the programs' own bounds on their ranks.
export DYNAMIQ_TIMEOUT_MS=${DYNAMIQ_TIMEOUT_MS:-10000}
# Loopback for NCCL's bootstrap and the net plugin in every process, the parents that make the
# NCCL unique id included: an id naming an interface the ranks cannot reach would leave them
# waiting until the step's bound.
export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-lo}
export DYNAMIQ_NET_IFNAME=${DYNAMIQ_NET_IFNAME:-lo}
BUDGET=${DQ_GPU_CHECK_BUDGET_S:-450}
T0=$(date +%s)
HAVE_DEVICE=0       # set by gpu_info
CONFIGURED=0
ANY_FAIL=0
LAST_STATUS=""      # the last recorded step's status
NCCL_TIMEOUTS=0     # NVIDIA's NCCL steps that timed out so far (nccl_guard)
# The commit the carried tree was (tests/gpu/fetch_deps.sh writes it: the device's copy of the
# tree has no .git), else this tree's own.
COMMIT=$(cat "${DQ_GPU_DEPS:-$ROOT/build-gpu-deps}/COMMIT" 2>/dev/null)
[ -n "$COMMIT" ] || COMMIT=$(git rev-parse HEAD 2>/dev/null)
[ -n "$COMMIT" ] || COMMIT="unknown (no build-gpu-deps/COMMIT, no .git)"

# Tools the GPU image may hold off PATH: nvcc and compute-sanitizer in the toolkit's bin folder
# (meson finds CUDA by nvcc on PATH), meson and ninja only as python3's pip packages (wrappers in
# $LOGS/bin). MESON: as given, else meson on PATH, else that wrapper, else the .venv of
# tools/setup.sh.
if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH="/usr/local/cuda/bin:$PATH"
fi
mkdir -p "$LOGS/bin"
if ! command -v meson >/dev/null 2>&1 && python3 -c 'import mesonbuild' >/dev/null 2>&1; then
  printf '#!/bin/sh\nexec python3 -m mesonbuild.mesonmain "$@"\n' >"$LOGS/bin/meson"
fi
if ! command -v ninja >/dev/null 2>&1 && python3 -c 'import ninja' >/dev/null 2>&1; then
  printf '#!/bin/sh\nexec python3 -m ninja "$@"\n' >"$LOGS/bin/ninja"
fi
chmod +x "$LOGS"/bin/* 2>/dev/null
export PATH="$PATH:$LOGS/bin"
if [ -z "${MESON:-}" ]; then
  if command -v meson >/dev/null 2>&1; then MESON=meson; else MESON=$ROOT/.venv/bin/meson; fi
fi

note() { printf '%s\n' "$*" | tee -a "$OUT/check.log"; }

# step NAME TIMEOUT_S COMMAND...: runs COMMAND under `timeout`, its output into steps/NAME.log
# and check.log; a command exiting 77 is a skip (its last "SKIP: ..." line is the reason).
# The note column: the step's own NOTE= line if it printed one, else its SKIP reason.
step() {
  local name=$1 limit=$2
  shift 2
  local now left start rc status why secs
  # A rerun of some steps (DQ_GPU_ONLY, e.g. on the still-warm machine): the set-up always runs.
  case $name in gpu_info | deps | configure | build_first | build) ;; *)
    if [ -n "${DQ_GPU_ONLY:-}" ] && ! [[ $name =~ ^(${DQ_GPU_ONLY})$ ]]; then
      record "$name" skip 0 "not in DQ_GPU_ONLY"
      return 0
    fi ;;
  esac
  now=$(date +%s)
  left=$((BUDGET - (now - T0)))
  if [ "$left" -lt 10 ]; then
    record "$name" skip 0 "time budget (${BUDGET} s) spent before this step"
    return 0
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  note ""
  note "=== $name (timeout ${limit} s) === $*"
  start=$(date +%s.%N)
  # In a child bash, so that the step may be one of this script's (exported) functions.
  # DQ_STEP_LIMIT: the step's own bound, for meson_one.
  DQ_STEP_LIMIT=$limit timeout --kill-after=10 "$limit" bash -c '"$@"' "$name" "$@" \
    >"$LOGS/steps/$name.log" 2>&1
  rc=$?
  secs=$(awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
  cat "$LOGS/steps/$name.log" >>"$OUT/check.log"
  why=$(grep -E '^NOTE: ' "$LOGS/steps/$name.log" | tail -n 1 | sed 's/^NOTE: //')
  case $rc in
    0) status=pass ;;
    77) status=skip
        [ -z "$why" ] && why=$(grep -E 'SKIP:? ' "$LOGS/steps/$name.log" | tail -n 1 | sed 's/.*SKIP:\{0,1\} //') ;;
    124|137) status=TIMEOUT; why="killed after ${limit} s${why:+; $why}" ;;
    *) status=FAIL; why="exit $rc${why:+; $why}" ;;
  esac
  note "--- $name: $status ($secs s) $why"
  record "$name" "$status" "$secs" "$why"
  return 0
}

# record NAME STATUS SECONDS NOTE: one row of the summary, then summary.txt rewritten, so that a
# run killed by the device call's own timeout still returns every step recorded before it.
record() {
  printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" >>"$LOGS/summary.rows"
  LAST_STATUS=$2
  case $2 in FAIL|TIMEOUT) ANY_FAIL=1 ;; esac
  write_summary "partial: after $1"
}

# result_of STEP KEY: the value of KEY=VALUE on the step's last RESULT line that has KEY ("" when
# none).
result_of() {
  grep -h '^RESULT ' "$LOGS/steps/$1.log" 2>/dev/null | tr ' ' '\n' |
    sed -n "s/^$2=//p" | tail -n 1
}

# The GPU path's targets on this device, from the benchmarks' RESULT lines, then those lines.
targets() {
  local hop hop16 kern
  hop=$(result_of hop_bandwidth hop_vs_copy)
  hop16=$(result_of hop_bandwidth bf16_hop_vs_copy)
  kern=$(result_of call_kernels kernels_vs_link)
  echo "targets:"
  if [ -n "$hop" ]; then
    echo "  fused hop / device-to-device copy bandwidth = $hop (target >= 0.60): $(awk -v x="$hop" 'BEGIN { print (x >= 0.60) ? "met" : "NOT met" }')"
  else
    echo "  fused hop / device-to-device copy bandwidth: not measured (no RESULT line from hop_bandwidth: see its row)"
  fi
  if [ -n "$hop16" ]; then
    echo "  fused hop / device-to-device copy bandwidth, BF16 own values = $hop16 (target >= 0.60): $(awk -v x="$hop16" 'BEGIN { print (x >= 0.60) ? "met" : "NOT met" }')"
  else
    echo "  fused hop / copy bandwidth, BF16 own values: not measured (no bf16_ RESULT from hop_bandwidth)"
  fi
  if [ -n "$kern" ]; then
    echo "  codec kernels of one 2-rank call / NCCL BF16 all-reduce at 100 Gbit/s = $kern (target <= 0.10): $(awk -v x="$kern" 'BEGIN { print (x <= 0.10) ? "met" : "NOT met" }')"
  else
    echo "  codec kernels / NCCL BF16 at 100 Gbit/s: not measured (no RESULT line from call_kernels: see its row)"
  fi
  local f
  for f in hop_bandwidth call_kernels call_vs_nccl hop_grids; do
    grep -h '^RESULT ' "$LOGS/steps/$f.log" 2>/dev/null | sed "s/^RESULT /RESULT $f: /"
  done
}

# write_summary STATE: summary.txt from the rows so far (STATE: "complete", or which step it
# follows), and steps.tar.gz; each written aside and moved, so that a kill leaves a whole file.
write_summary() {
  local total=$(( $(date +%s) - T0 ))
  {
    echo ""
    echo "tests/gpu/check.sh summary ($1; $(date -u +%Y-%m-%dT%H:%M:%SZ), ${total} s in all, budget ${BUDGET} s)"
    echo "commit: $COMMIT"
    printf '%-34s %-8s %8s  %s\n' step result seconds note
    while IFS=$'\t' read -r n s t w; do printf '%-34s %-8s %8s  %s\n' "$n" "$s" "$t" "$w"; done <"$LOGS/summary.rows"
    targets
    if [ -s "$LOGS/profile.summary" ]; then
      echo "profile (Nsight Compute, $PROFILE_VALUES values a launch; profile.txt, hop_sass.csv):"
      sed 's/^profile: /    /' "$LOGS/profile.summary"
    fi
    printf 'pass %d, fail %d, timeout %d, skip %d\n' \
      "$(grep -c $'\tpass\t' "$LOGS/summary.rows")" "$(grep -c $'\tFAIL\t' "$LOGS/summary.rows")" \
      "$(grep -c $'\tTIMEOUT\t' "$LOGS/summary.rows")" "$(grep -c $'\tskip\t' "$LOGS/summary.rows")"
  } >"$OUT/summary.txt.tmp" && mv -f "$OUT/summary.txt.tmp" "$OUT/summary.txt"
  cp "$BUILD/meson-logs/testlog.txt" "$LOGS/steps/meson-testlog.txt" 2>/dev/null
  tar -czf "$OUT/steps.tar.gz.tmp" -C "$LOGS" steps summary.rows 2>/dev/null &&
    mv -f "$OUT/steps.tar.gz.tmp" "$OUT/steps.tar.gz"
}

skip_step() { record "$1" skip 0 "$2"; note ""; note "=== $1: skip: $2"; }

# ---------------------------------------------------------------------------------------------
gpu_info() {
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)  host: $(hostname)  cores: $(nproc)  commit: $(git rev-parse --short HEAD 2>/dev/null) $(git status --porcelain 2>/dev/null | grep -q . && echo '(working tree has changes)')"
  grep PRETTY_NAME /etc/os-release 2>/dev/null
  echo "c++: $(c++ --version 2>/dev/null | head -n 1)"
  echo "meson: $($MESON --version 2>/dev/null) ninja: $(ninja --version 2>/dev/null)"
  echo "nvcc: $( (command -v nvcc || echo /usr/local/cuda/bin/nvcc) | xargs -I{} sh -c '{} --version 2>/dev/null | tail -n 2 | head -n 1')"
  echo "compute-sanitizer: ${SANITIZER:-not found}  ncu: ${NCU:-not found}"
  if ! command -v nvidia-smi >/dev/null 2>&1; then
    echo "SKIP: nvidia-smi not found: no NVIDIA driver on this machine"
    return 77
  fi
  if ! nvidia-smi; then
    echo "SKIP: nvidia-smi found no usable GPU"
    return 77
  fi
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv
  echo "NOTE: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -n 1)"
}

# The Debian packages carried in $DQ_GPU_DEPS, unpacked under $BUILD-sysroot; writes the exports.
DEPS_PREFIX="$BUILD-sysroot"  # not build-gpu-deps: that is the carried .deb folder
use_carried_deps() {
  local debs=${DQ_GPU_DEPS:-$ROOT/build-gpu-deps}
  if ! ls "$debs"/*.deb >/dev/null 2>&1; then
    echo "no carried packages in $debs (tests/gpu/fetch_deps.sh makes them)"
    return 1
  fi
  rm -rf "$DEPS_PREFIX"
  mkdir -p "$DEPS_PREFIX"
  local f
  for f in "$debs"/*.deb; do
    dpkg-deb -x "$f" "$DEPS_PREFIX" || { echo "cannot unpack $f"; return 1; }
  done
  # Their .pc files name /usr: point them at the prefix.
  find "$DEPS_PREFIX" -name '*.pc' -exec sed -i -e "s|=/usr|=$DEPS_PREFIX/usr|g" \
    -e "s|-I/usr/|-I$DEPS_PREFIX/usr/|g" -e "s|-L/usr/|-L$DEPS_PREFIX/usr/|g" {} +
  local P=$DEPS_PREFIX/usr lib=$DEPS_PREFIX/usr/lib/x86_64-linux-gnu
  echo "export PKG_CONFIG_LIBDIR='$lib/pkgconfig:$P/share/pkgconfig:/usr/lib/x86_64-linux-gnu/pkgconfig:/usr/lib/pkgconfig:/usr/share/pkgconfig'" >"$LOGS/deps.env"
  [ -x "$P/bin/pkgconf" ] && echo "export PKG_CONFIG='$P/bin/pkgconf'" >>"$LOGS/deps.env"
  cat >>"$LOGS/deps.env" <<EOF
export CMAKE_PREFIX_PATH='$P'\${CMAKE_PREFIX_PATH:+:\$CMAKE_PREFIX_PATH}
export CPATH='$P/include'\${CPATH:+:\$CPATH}
export LIBRARY_PATH='$lib'\${LIBRARY_PATH:+:\$LIBRARY_PATH}
export LD_LIBRARY_PATH='$lib'\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}
EOF
  # Tests run with their own LD_LIBRARY_PATH (meson's env.set: the plugin's folder), and the
  # preloaded shim needs libtbb: where the loader cannot find it, register the carried TBB
  # runtime alone (a folder of its own) with ldconfig, as root.
  if ! ldconfig -p 2>/dev/null | grep -q 'libtbb\.so\.12'; then
    mkdir -p "$DEPS_PREFIX/runtime"
    cp -a "$lib"/libtbb*.so.* "$DEPS_PREFIX/runtime/" 2>/dev/null
    if [ "$(id -u)" = 0 ] && [ -d /etc/ld.so.conf.d ]; then
      echo "$DEPS_PREFIX/runtime" >/etc/ld.so.conf.d/zz-dynamiq-gpu-check.conf && ldconfig &&
        echo "registered $DEPS_PREFIX/runtime with ldconfig (libtbb for the preloaded shim)"
    else
      echo "not root: tests that set their own LD_LIBRARY_PATH may not find libtbb.so.12"
    fi
  fi
  echo "carried packages unpacked under $DEPS_PREFIX:"
  ls "$debs"/*.deb
}

deps() {
  : >"$LOGS/deps.env"
  local missing=""
  [ -f /usr/include/gtest/gtest.h ] || [ -f /usr/local/include/gtest/gtest.h ] || missing="$missing gtest"
  [ -f /usr/include/oneapi/tbb.h ] || [ -f /usr/include/tbb/tbb.h ] || [ -f /usr/local/include/oneapi/tbb.h ] || missing="$missing tbb"
  [ -f /usr/include/nlohmann/json.hpp ] || [ -f /usr/local/include/nlohmann/json.hpp ] || missing="$missing nlohmann-json"
  [ -f /usr/include/CLI/CLI.hpp ] || [ -f /usr/local/include/CLI/CLI.hpp ] || missing="$missing CLI11"
  command -v pkg-config >/dev/null 2>&1 || command -v pkgconf >/dev/null 2>&1 || missing="$missing pkg-config"
  if [ -n "$missing" ] || [ "${DQ_GPU_DEPS_FORCE:-0}" = 1 ]; then
    echo "the system lacks:${missing:- nothing (DQ_GPU_DEPS_FORCE=1)}; using the carried packages"
    use_carried_deps || { echo "the build needs:$missing"; return 1; }
  else
    echo "gtest, TBB, nlohmann-json, CLI11 and pkg-config: the system's"
  fi
  # NVIDIA's NCCL: the toolkit's, else the pip wheel's (nvidia-nccl-cu13) for headers and library.
  if [ ! -f /usr/local/cuda/include/nccl.h ] && [ -z "${NCCL_HOME:-}" ]; then
    local pip_nccl
    pip_nccl=$(python3 -c 'import nvidia.nccl, os; print(os.path.dirname(nvidia.nccl.__file__) if nvidia.nccl.__file__ else list(nvidia.nccl.__path__)[0])' 2>/dev/null)
    if [ -n "$pip_nccl" ] && [ -f "$pip_nccl/include/nccl.h" ]; then
      echo "export NCCL_HOME='$pip_nccl'" >>"$LOGS/deps.env"
      echo "NCCL: the pip wheel's, $pip_nccl"
    else
      echo "NCCL: no nccl.h found (the real-NCCL tests will skip or not build)"
    fi
  fi
  local lib
  for lib in /usr/local/cuda/lib/libnccl.so.2 /usr/local/cuda/lib64/libnccl.so.2 \
             ${NCCL_HOME:+$NCCL_HOME/lib/libnccl.so.2} \
             "$(python3 -c 'import nvidia.nccl, os; print(list(nvidia.nccl.__path__)[0])' 2>/dev/null)/lib/libnccl.so.2"; do
    if [ -f "$lib" ]; then
      echo "export DYNAMIQ_REAL_NCCL='$lib'" >>"$LOGS/deps.env"
      echo "NVIDIA's libnccl.so.2 for the real-NCCL tests: $lib"
      break
    fi
  done
  # The CUDA runtime the nvcc-built programs link (libcudart.so): where the loader's cache
  # lacks it, the toolkit's folder on the library path (tests that set their own keep it by
  # prepending, or open the runtime by its full path).
  if ! ldconfig -p 2>/dev/null | grep -q 'libcudart\.so\.'; then
    local d
    for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
      if ls "$d"/libcudart.so.* >/dev/null 2>&1; then
        echo "export LD_LIBRARY_PATH='$d'\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}" >>"$LOGS/deps.env"
        echo "libcudart: not in the loader's cache; $d on LD_LIBRARY_PATH"
        break
      fi
    done
  fi
  echo "--- exported:"
  cat "$LOGS/deps.env"
}

configure() {
  if ! "$MESON" --version >/dev/null 2>&1; then
    echo "meson not found: MESON=$MESON (set MESON, or put meson on PATH)"
    return 1
  fi
  if [ -f "$BUILD/build.ninja" ]; then
    echo "NOTE: using the configured $BUILD as it is"
    "$MESON" introspect "$BUILD" --buildoptions | python3 -c 'import json,sys; print({o["name"]: o["value"] for o in json.load(sys.stdin) if o["name"] in ("cuda","gpu_archs","buildtype","native")})'
    return 0
  fi
  # gpu_werror=false: this machine's host compiler may warn where CI's (which builds with
  # warnings as errors) does not; a warning must not cost the lease its build.
  # gpu_archs: only this device's SM when it is one of the default's (nvcc then runs ptxas once
  # a kernel file, not twice); CI compiles and checks both.
  local archs=() cap
  cap=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n 1 | tr -d '. ')
  case "$cap" in
    80 | 90) archs=("-Dgpu_archs=$cap") && echo "device SM $cap: -Dgpu_archs=$cap" ;;
    *) echo "device SM '${cap:-unknown}': the default gpu_archs" ;;
  esac
  "$MESON" setup "$BUILD" -Dcuda=enabled -Dbuildtype=release -Dnative=false -Dgpu_werror=false \
    "${archs[@]}"
}

# Targets: `gpu_targets first`: the first measurements' (the benchmarks hop_bandwidth,
# call_kernels and call_vs_nccl, the shim libdynamiq.so and the net plugin; ninja builds what they
# need); `gpu_targets`: those and the executables (and depends) of every test in suite gpu.
gpu_targets() {
  "$MESON" introspect "$BUILD" --tests --targets 2>/dev/null | python3 -c '
import json, os, sys
d = json.load(sys.stdin)
build, first = sys.argv[1], sys.argv[2] == "first"
by_id = {t["id"]: t for t in d["targets"]}
out = set()
def add(path):
    if path.startswith(build + "/"):
        out.add(os.path.relpath(path, build))
for t in d["targets"]:
    if t["name"] in ("hop_bandwidth", "call_kernels", "call_vs_nccl") or \
       (t["type"] == "shared library" and t["name"] in ("dynamiq", "nccl-net-dynamiq")):
        for f in t["filename"]:
            add(f)
for t in [] if first else d["tests"]:
    if "gpu" not in t["suite"] and not any(s.endswith(":gpu") for s in t["suite"]):
        continue
    add(t["cmd"][0])
    for dep in t.get("depends", []):
        for f in by_id.get(dep, {}).get("filename", []):
            add(f)
print("\n".join(sorted(out)))
' "$BUILD" "${1:-all}"
}

# build_first: the first measurements' targets alone, so that they run before the rest is built.
# build: every gpu target, -k 0: one target's error does not stop the others (each step then
# checks its own files: need).
build_first() {
  local targets
  targets=$(gpu_targets first) || return 1
  [ -n "$targets" ] || { echo "no benchmark targets found in $BUILD"; return 1; }
  echo "targets:"
  echo "$targets"
  # shellcheck disable=SC2086
  ninja -C "$BUILD" -j"$JOBS" $targets
}
build() {
  local targets
  targets=$(gpu_targets) || return 1
  [ -n "$targets" ] || { echo "no gpu targets found in $BUILD"; return 1; }
  echo "targets:"
  echo "$targets"
  # shellcheck disable=SC2086
  ninja -C "$BUILD" -k 0 -j"$JOBS" $targets
}

# test_files NAME: the files of this build that meson test NAME runs (its command and its
# depends' outputs), one a line.
test_files() {
  "$MESON" introspect "$BUILD" --tests --targets 2>/dev/null | python3 -c '
import json, sys
d = json.load(sys.stdin)
build, name = sys.argv[1], sys.argv[2]
by_id = {t["id"]: t for t in d["targets"]}
for t in d["tests"]:
    if t["name"] == name:
        files = [t["cmd"][0]] + [f for dep in t.get("depends", [])
                                 for f in by_id.get(dep, {}).get("filename", [])]
        print("\n".join(f for f in files if f.startswith(build + "/")))
        break
' "$BUILD" "$1"
}

# The result meson recorded for test NAME in its last run (OK, SKIP, FAIL, TIMEOUT, ...), then
# the last line the test printed (a skip's reason).
meson_result() {
  python3 - "$BUILD/meson-logs/testlog.json" "$1" <<'EOF'
import json, sys
res, last = "NONE", ""
for line in open(sys.argv[1]):
    t = json.loads(line)
    if t["name"] == sys.argv[2] or t["name"].endswith(":" + sys.argv[2]):
        res = t["result"]
        lines = [l for l in (t.get("stdout") or "").splitlines() if l.strip()]
        last = lines[-1].strip() if lines else ""
print(res)
print(last)
EOF
}

# One registered test through meson (its env: LD_PRELOAD, plugin paths): 0 OK, 77 SKIP, 124
# TIMEOUT, else 1. meson's own timeout for the test is scaled to end 10 s inside the step's
# (DQ_STEP_LIMIT): meson then kills the test's process group (its ranks with it), which the
# step's `timeout` cannot reach (meson starts each test in a session of its own).
meson_one() {
  local name=$1 own mult
  own=$("$MESON" introspect "$BUILD" --tests | python3 -c '
import json, sys
print(next((t["timeout"] for t in json.load(sys.stdin) if t["name"] == sys.argv[1]), 30))' "$name")
  mult=$(awk -v l="${DQ_STEP_LIMIT:-0}" -v t="$own" \
    'BEGIN { m = (t > 0 && l > 20) ? (l - 10) / t : 1; printf "%.3f", m }')
  echo "meson timeout: ${own} s x ${mult}"
  "$MESON" test -C "$BUILD" --no-rebuild --print-errorlogs -v --timeout-multiplier "$mult" "$name"
  local out res
  out=$(meson_result "$name")
  res=$(echo "$out" | head -n 1)
  echo "meson result: $res"
  case $res in
    OK|EXPECTEDFAIL) return 0 ;;
    SKIP) echo "NOTE: $(echo "$out" | sed -n 2p | sed 's/^SKIP:* *//')"; return 77 ;;
    TIMEOUT) echo "NOTE: meson's timeout ($own s x $mult)"; return 124 ;;
    *) return 1 ;;
  esac
}

# with_shim COMMAND...: COMMAND with this build's libdynamiq.so preloaded and the net plugin's
# folder on the library path (as meson's env does for the shim's gpu tests).
with_shim() {
  LD_PRELOAD="$BUILD/shim/libdynamiq.so${LD_PRELOAD:+:$LD_PRELOAD}" \
    LD_LIBRARY_PATH="$BUILD/plugin/abi${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" "$@"
}

# compute-sanitizer TOOL on a kernel test executable, the reduced matrix; a report fails.
sanitize() {
  local tool=$1 exe=$2
  shift 2
  local extra=()
  [ "$tool" = memcheck ] && extra=(--leak-check full)
  [ "$tool" = racecheck ] && extra=(--racecheck-report hazard)
  local out
  out="$LOGS/sanitize-$tool-$(basename "$exe").out"
  DQ_KERNEL_TESTS_REDUCED=1 "$SANITIZER" --tool "$tool" --error-exitcode 10 --print-limit 20 "${extra[@]}" \
    "$BUILD/$exe" "$@" 2>&1 | tee "$out"
  local rc=${PIPESTATUS[0]}
  [ "$rc" = 10 ] && echo "compute-sanitizer $tool reported errors"
  # A runtime that hides the device from the sanitizer (seen on gVisor: "Device not supported",
  # then error 999 at the first allocation) says nothing of the kernels: a skip, with its words.
  if [ "$rc" != 0 ] && grep -q 'Device not supported' "$out"; then
    echo "SKIP: compute-sanitizer refused the device here: $(grep -m 1 'Device not supported' "$out" | sed 's/^=* *//')"
    return 77
  fi
  return "$rc"
}

# Nsight Compute on hop_bandwidth's profiled round (the header's profile_kernels). 2^25 values
# in one chunk, so that every profiled launch processes all of them (the summary's instructions a
# value), 2 timed rounds (the profiler attaches to the round after them alone:
# --profile-from-start off). --clock-control none: the clocks as a job sees them, not ncu's base
# clocks. Where ncu cannot read the counters (a sandboxed runtime, a driver that refuses them)
# it writes no report: a skip with ncu's first error.
PROFILE_VALUES=33554432
# profile_report REPORT TITLE LABEL_ARGS...: REPORT.ncu-rep's sections appended to profile.txt,
# its summary lines (profile_summary.py with LABEL_ARGS) under TITLE to profile.summary.
profile_report() {
  local rep=$1 title=$2
  shift 2
  "$NCU" --import "$rep.ncu-rep" --page details >>"$OUT/profile.txt" 2>&1
  "$NCU" --import "$rep.ncu-rep" --page raw --csv --print-units base >"$rep-raw.csv" 2>&1
  echo "  $title:" >>"$LOGS/profile.summary"
  python3 "$ROOT/tests/gpu/profile_summary.py" "$rep-raw.csv" --values "$PROFILE_VALUES" "$@" |
    tee -a "$LOGS/profile.summary"
}
profile_kernels() {
  local exe="$BUILD/tests/gpu/hop_bandwidth" rep="$LOGS/profile" rc made=0
  local common=(--profile-from-start off --clock-control none -f)
  # The step's bound shared: 60% for the full profile of the hop, the rest for the second pass,
  # so that a slow first pass still leaves a report of the other kernels.
  local limit=${DQ_STEP_LIMIT:-150}
  local first=$((limit * 6 / 10)) second=$((limit * 4 / 10 - 5))
  # A bound under 13 s leaves the second pass nothing: at least 1 s (timeout 0 never ends it).
  [ "$second" -lt 1 ] && second=1
  local hop_labels="dynamiq_hop_kernel=leaf/FP32,hop/FP32,leaf/BF16,hop/BF16"
  rm -f "$rep"-*.ncu-rep "$LOGS/profile.summary" "$OUT/profile.txt" "$OUT/hop_sass.csv"
  # The hop kernel: every section, and the SASS with its counters (where time goes inside it).
  timeout --kill-after=5 "$first" "$NCU" "${common[@]}" --kernel-name regex:dynamiq_hop_kernel \
    --set full -o "$rep-hop" \
    "$exe" "$PROFILE_VALUES" 1 2 2>&1 | tee "$LOGS/ncu-hop.out"
  rc=${PIPESTATUS[0]}
  if [ -f "$rep-hop.ncu-rep" ]; then
    made=1
    profile_report "$rep-hop" "the hop kernel, every section (--set full)" --label "$hop_labels"
    if ! "$NCU" --import "$rep-hop.ncu-rep" --page source --csv --print-source sass \
      >"$OUT/hop_sass.csv" 2>"$LOGS/ncu-source.err"; then
      echo "the SASS page could not be printed: $(head -n 1 "$LOGS/ncu-source.err")"
      rm -f "$OUT/hop_sass.csv"
    fi
  elif [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
    echo "the hop's full profile did not end within $first s"
  elif ! grep -q '==ERROR==' "$LOGS/ncu-hop.out" && [ "$rc" != 0 ]; then
    echo "hop_bandwidth failed under ncu (exit $rc)"
    return 1
  fi
  # Every kernel of the round, the throughput sections alone (a few passes a launch).
  timeout --kill-after=5 "$second" "$NCU" "${common[@]}" --section SpeedOfLight \
    --section Occupancy --section LaunchStats \
    --section SchedulerStats --section InstructionStats -o "$rep-all" \
    "$exe" "$PROFILE_VALUES" 1 2 2>&1 | tee "$LOGS/ncu-all.out"
  if [ -f "$rep-all.ncu-rep" ]; then
    made=1
    profile_report "$rep-all" "every kernel of the round, the throughput sections" \
      --label "$hop_labels" --label supergroup_stats_kernel=FP32,BF16 \
      --label dynamiq_finish_kernel=FP32,BF16
  fi
  if [ "$made" = 0 ]; then
    local why
    why=$(grep -h -m 1 '==ERROR==' "$LOGS/ncu-hop.out" "$LOGS/ncu-all.out" | head -n 1)
    echo "SKIP: Nsight Compute wrote no report: ${why:-neither pass ended within its bound ($first s, $second s)}"
    return 77
  fi
  echo "NOTE: $(grep -c '^profile: ' "$LOGS/profile.summary" 2>/dev/null) launches profiled (profile.txt)"
}

# ---------------------------------------------------------------------------------------------
SANITIZER=$(command -v compute-sanitizer 2>/dev/null)
if [ -z "$SANITIZER" ]; then
  for s in /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda/compute-sanitizer/compute-sanitizer \
           /opt/nvidia/compute-sanitizer/compute-sanitizer; do
    [ -x "$s" ] && SANITIZER=$s && break
  done
fi

# Nsight Compute: PATH, the toolkit, else the newest of the image's /opt/nvidia/nsight-compute.
NCU=$(command -v ncu 2>/dev/null)
if [ -z "$NCU" ]; then
  for s in /usr/local/cuda/bin/ncu $(ls -d /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | sort -rV); do
    [ -x "$s" ] && NCU=$s && break
  done
fi

export ROOT OUT BUILD LOGS JOBS MESON SANITIZER NCU DEPS_PREFIX PROFILE_VALUES
export -f gpu_info use_carried_deps deps configure gpu_targets build_first build test_files \
  meson_result meson_one \
  with_shim sanitize profile_report profile_kernels

note "tests/gpu/check.sh: out $OUT, build $BUILD, jobs $JOBS, budget ${BUDGET} s, commit $COMMIT"
step gpu_info 30 gpu_info
grep -q $'^gpu_info\tpass' "$LOGS/summary.rows" && HAVE_DEVICE=1

step deps 120 deps
# shellcheck disable=SC1091
[ -s "$LOGS/deps.env" ] && . "$LOGS/deps.env"

step configure 180 configure
grep -q $'^configure\tpass' "$LOGS/summary.rows" && CONFIGURED=1

NO_DEVICE_REASON="no CUDA device (nvidia-smi: see gpu_info)"
# build_error: the first error line of the build steps so far (a missing file's step quotes it).
# Else the last line of the last build step's log (e.g. "no gpu targets found").
build_error() {
  local line
  line=$(grep -h -m 1 -E 'error|FAILED' "$LOGS/steps/build_first.log" "$LOGS/steps/build.log" 2>/dev/null | head -n 1)
  [ -n "$line" ] || [ "$LAST_STATUS" = pass ] ||
    line=$(tail -n 1 "$LOGS/steps/build.log" 2>/dev/null || tail -n 1 "$LOGS/steps/build_first.log" 2>/dev/null)
  printf '%s' "$line" | cut -c 1-200
}
# need NAME FILE...: whether NAME's files were built; where one was not, NAME is recorded as a
# skip naming the file and the build's first error (the build step's own row is the failure).
need() {
  local name=$1 f
  shift
  if [ $CONFIGURED != 1 ]; then skip_step "$name" "configure failed"; return 1; fi
  for f in "$@"; do
    if [ ! -e "$f" ]; then
      skip_step "$name" "not built: ${f#"$BUILD"/}${BUILD_ERR:+ (build: $BUILD_ERR)}"
      return 1
    fi
  done
  return 0
}
# NVIDIA's NCCL steps (2 ranks through the net plugin and the shim): once one has timed out,
# the others get at most 45 s each, and after a second none runs, so that a hang in NCCL's
# set-up on this machine leaves the profile and the sanitizers their time.
is_nccl() {
  case $1 in call_vs_nccl | real_nccl_* | shim_passes_gpu_* | *_gpu_2ranks | torch_ddp_2ranks) return 0 ;; esac
  return 1
}
# guarded NAME LIMIT COMMAND...: step, with the NCCL bound above.
guarded() {
  local name=$1 limit=$2
  shift 2
  if is_nccl "$name"; then
    if [ "$NCCL_TIMEOUTS" -ge 2 ]; then
      skip_step "$name" "NVIDIA's NCCL steps timed out twice ($NCCL_TIMED_OUT): the rest left to the profile and the sanitizers"
      return
    fi
    [ "$NCCL_TIMEOUTS" -ge 1 ] && [ "$limit" -gt 45 ] && limit=45
  fi
  step "$name" "$limit" "$@"
  if is_nccl "$name" && [ "$LAST_STATUS" = TIMEOUT ]; then
    NCCL_TIMEOUTS=$((NCCL_TIMEOUTS + 1))
    NCCL_TIMED_OUT="${NCCL_TIMED_OUT:+$NCCL_TIMED_OUT, }$name"
  fi
}
NCCL_TIMED_OUT=""
# run_test NAME TIMEOUT: a registered meson test, when its files were built.
run_test() {
  local files
  [ $CONFIGURED = 1 ] && files=$(test_files "$1")
  # shellcheck disable=SC2086
  need "$1" $files || return 0
  guarded "$1" "$2" meson_one "$1"
}
# bench_step NAME TIMEOUT FILE COMMAND...: a benchmark of this build, when FILE was built.
bench_step() {
  local name=$1 limit=$2 file=$3
  shift 3
  need "$name" "$file" || return 0
  guarded "$name" "$limit" "$@"
}

BUILD_ERR=""
if [ $CONFIGURED = 1 ]; then
  # The first measurements' targets alone: they run before the rest is built.
  step build_first 400 build_first
  BUILD_ERR=$(build_error)
else
  skip_step build_first "configure failed"
fi

# First, what the lease is for: the targets' measurements (hop_bandwidth: the fused hop against
# a device-to-device copy; call_kernels: a 256 MiB call's codec kernels against NCCL's BF16 at
# 100 Gbit/s), then one whole compressed call against NCCL's BF16 all-reduce (call_vs_nccl).
bench_step hop_bandwidth 60 "$BUILD/tests/gpu/hop_bandwidth" "$BUILD/tests/gpu/hop_bandwidth"
bench_step call_kernels 90 "$BUILD/tests/gpu/call_kernels" "$BUILD/tests/gpu/call_kernels"
need call_vs_nccl "$BUILD/tests/gpu/call_vs_nccl" "$BUILD/shim/libdynamiq.so" \
  "$BUILD/plugin/abi/libnccl-net-dynamiq.so" &&
  guarded call_vs_nccl 120 with_shim "$BUILD/tests/gpu/call_vs_nccl"

if [ $CONFIGURED = 1 ]; then
  step build 400 build
  BUILD_ERR=$(build_error)
else
  skip_step build "configure failed"
fi

run_test gpu_math 30
for t in cuda_stats_device cuda_dynamiq_layout_device cuda_dynamiq_hop_device \
         cuda_layout_batch_device cuda_grid_kernels_device; do
  run_test "$t" 120
done
bench_step hop_grids 45 "$BUILD/tests/gpu/hop_bandwidth" "$BUILD/tests/gpu/hop_bandwidth" --grids

# NVIDIA's NCCL with 2 ranks on the one GPU (two fake hosts): the plugin alone, then through
# the shim: pass-through, compressed, the CUDA graph capture sequence.
for t in real_nccl_with_plugin shim_passes_gpu_allreduce_through real_nccl_compressed_2ranks \
         shim_capture_gpu_2ranks; do
  run_test "$t" 90
done
# What users run: PyTorch's own NCCL backend and DDP, unmodified, with the shim preloaded (the
# image's python3 holds torch; a skip with the reason where it does not).
bench_step torch_ddp_2ranks 150 "$BUILD/shim/libdynamiq.so" python3 "$ROOT/tests/gpu/torch_ddp_smoke.py" \
  --shim "$BUILD/shim/libdynamiq.so" --timeout 130

# Every other test of suite gpu (cuda_device_gpu_steps, shim_4proc_device_buffers, any added
# later), then 4 processes on the one GPU through the CPU NCCL with device buffers staged in
# stream order (tests/nccl/device_buffers_main.cc; shim_4proc_device_buffers runs the same with
# the shim's engine on the CUDA device).
if [ $CONFIGURED = 1 ]; then
  others=$("$MESON" introspect "$BUILD" --tests | python3 -c '
import json, sys
done = {"gpu_math", "cuda_stats_device", "cuda_dynamiq_layout_device", "cuda_dynamiq_hop_device",
        "cuda_layout_batch_device", "cuda_grid_kernels_device",
        "real_nccl_with_plugin", "shim_passes_gpu_allreduce_through", "real_nccl_compressed_2ranks",
        "shim_capture_gpu_2ranks", "cpu_nccl_4proc_device_buffers"}
for t in json.load(sys.stdin):
    if ("gpu" in t["suite"] or any(s.endswith(":gpu") for s in t["suite"])) and t["name"] not in done:
        print(t["name"])')
  for t in $others; do run_test "$t" 90; done
else
  skip_step gpu_suite_others "configure failed"
fi
run_test cpu_nccl_4proc_device_buffers 90

# Where the hop's time goes (Nsight Compute), before the sanitizers take what the budget leaves.
if [ "${DQ_GPU_PROFILE:-1}" = 0 ]; then skip_step profile_kernels "DQ_GPU_PROFILE=0"
elif ! need profile_kernels "$BUILD/tests/gpu/hop_bandwidth"; then :
elif [ -z "$NCU" ]; then skip_step profile_kernels "ncu not found (PATH, /usr/local/cuda/bin, /opt/nvidia/nsight-compute)"
elif [ $HAVE_DEVICE != 1 ]; then skip_step profile_kernels "$NO_DEVICE_REASON"
else step profile_kernels 150 profile_kernels
fi

# Last, as the slowest: compute-sanitizer on the kernel tests (whatever the budget leaves), the
# multi-block hand-offs first (grid layout and budget tickets, the digest chain, a call's layouts
# in one batch: the kernels the emulation runs one block at a time), then the single-block ones.
for pair in memcheck:grid_kernels racecheck:grid_kernels memcheck:layout_batch memcheck:dynamiq \
            racecheck:dynamiq memcheck:stats racecheck:stats racecheck:layout_batch; do
  tool=${pair%%:*} t=${pair#*:}
  name=${tool}_$t
  if ! need "$name" "$BUILD/tests/gpu/test_cuda_${t}_device"; then :
  elif [ -z "$SANITIZER" ]; then skip_step "$name" "compute-sanitizer not found (PATH, /usr/local/cuda/bin)"
  elif [ $HAVE_DEVICE != 1 ]; then skip_step "$name" "$NO_DEVICE_REASON"
  else step "$name" 90 sanitize "$tool" "tests/gpu/test_cuda_${t}_device"
  fi
done

# ---------------------------------------------------------------------------------------------
write_summary complete
tee -a "$OUT/check.log" <"$OUT/summary.txt"

if [ $ANY_FAIL = 1 ]; then exit 1; fi
if [ $HAVE_DEVICE != 1 ]; then
  echo "no CUDA device: the GPU steps were skipped (exit 3)"
  exit 3
fi
exit 0

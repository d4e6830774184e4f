#!/usr/bin/env bash
# Installs what dynamiq needs on a fresh Debian 12 machine and builds it into ./build.
# Idempotent: a second run only rebuilds what changed.
#
# System packages come from apt (sudo when not root). Python packages (meson, numpy, ml_dtypes,
# and meson-python, which builds the wheel: `pip install .`, tests/install/wheel_test.sh; it
# sets the CPU NCCL's RUNPATH in the wheel with patchelf, from apt) go
# into a virtual environment, .venv (DYNAMIQ_VENV names another), never into the system Python:
# Debian 12 marks it externally managed (PEP 668) and has no pip. The environment sees the
# system's site-packages, so what is installed there already is used, not downloaded again.
# Afterwards .venv/bin/meson and .venv/bin/python3 are the tools to use; the build's tests run
# with .venv/bin/python3 (set in the native file build/../.venv/dynamiq-native.ini at setup).
set -euo pipefail
cd "$(dirname "$0")/.."
# NVIDIA's toolkit packages install nvcc in /usr/local/cuda/bin, off PATH: Meson finds CUDA by
# nvcc on PATH, and a build without it has no CUDA device (every call of a job on NVIDIA's NCCL
# would pass through).
if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH="/usr/local/cuda/bin:$PATH"
  echo "setup: nvcc found in /usr/local/cuda/bin (not on PATH): the build uses it" >&2
fi
# ccache: Meson compiles through it when installed, so the wheel test's build (build-wheel, at
# the depth of build: the same relative paths) reuses the objects of this build. qemu-user: the
# codec test on an emulated CPU (tests/kernels/emulated_cpu.sh). locales: the de_DE source the
# locale tests compile (tests/common/locales.h).
need_apt=()
for pkg in g++ pkg-config ninja-build python3-venv libtbb-dev libgtest-dev libbenchmark-dev \
           nlohmann-json3-dev libcli11-dev \
           libibverbs-dev iperf3 iproute2 libboost-context-dev patchelf ccache qemu-user locales; do
  dpkg -s "$pkg" >/dev/null 2>&1 || need_apt+=("$pkg")
done
if ((${#need_apt[@]})); then
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

venv=${DYNAMIQ_VENV:-.venv}
if [ ! -x "$venv/bin/python3" ]; then
  python3 -m venv --system-site-packages "$venv"
fi
venv=$(cd "$venv" && pwd)
py=$venv/bin/python3
if ! "$py" -c "import mesonbuild, numpy, ml_dtypes, mesonpy" 2>/dev/null ||
   ! "$py" -c "import sys, mesonbuild.coredata as c; sys.exit(tuple(map(int, c.version.split('.')[:2])) < (1, 1))"; then
  "$py" -m pip install -q "meson>=1.1" numpy ml_dtypes "meson-python>=0.15"
fi
# nvdisasm and cuobjdump, PyPI's nvidia-cuda-* wheels (5.5 MB), where nvcc is installed:
# tools/perf/hop_instructions.sh reads the fused hop's SASS with them (its test skips without).
if command -v nvcc >/dev/null 2>&1 &&
   ! compgen -G "$venv/lib/python3*/site-packages/nvidia/cu*/bin/nvdisasm" >/dev/null; then
  "$py" -m pip install -q nvidia-cuda-nvdisasm nvidia-cuda-cuobjdump ||
    echo "setup: nvidia-cuda-nvdisasm not installed: the hop_instructions test will skip" >&2
fi
# A meson found only in the system's site-packages has no script in the environment: add one.
if [ ! -x "$venv/bin/meson" ]; then
  printf '#!/bin/sh\nexec "%s" -m mesonbuild.mesonmain "$@"\n' "$py" >"$venv/bin/meson"
  chmod +x "$venv/bin/meson"
fi
# Meson's find_program('python3') would take the system python3 (no numpy) from PATH: the
# native file names the environment's.
native=$venv/dynamiq-native.ini
printf "[binaries]\npython3 = '%s'\npython = '%s'\n" "$py" "$py" >"$native"

if [ ! -f build/build.ninja ]; then
  # Quiet when it works; Meson's own report (on stdout) when it does not.
  if ! log=$("$venv/bin/meson" setup build --buildtype=release --native-file "$native" 2>&1); then
    printf '%s\n' "$log" >&2
    echo "tools/setup.sh: meson setup failed (full log: build/meson-logs/meson-log.txt)" >&2
    exit 1
  fi
elif command -v nvcc >/dev/null 2>&1 &&
     ! "$py" -c "import json, sys; sys.exit('cuda' not in json.load(open(sys.argv[1]))['host'])" \
         build/meson-info/intro-compilers.json 2>/dev/null; then
  # A build configured before nvcc could be found (off PATH, or installed since) has no CUDA
  # device: Meson finds the language only at configuration.
  echo "setup: build/ has no CUDA but nvcc is found now: reconfiguring it" >&2
  if ! log=$("$venv/bin/meson" setup --reconfigure build --native-file "$native" 2>&1); then
    printf '%s\n' "$log" >&2
    echo "tools/setup.sh: meson setup --reconfigure failed" >&2
    exit 1
  fi
fi
"$venv/bin/meson" compile -C build

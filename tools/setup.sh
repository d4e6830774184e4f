#!/usr/bin/env bash
# Installs what dynamiq needs on a fresh Debian 12 machine (apt + pip) and builds it into
# ./build. Idempotent: a second run only rebuilds what changed.
set -euo pipefail
cd "$(dirname "$0")/.."
need_apt=()
for pkg in libtbb-dev libgtest-dev libbenchmark-dev libibverbs-dev pkg-config iperf3 iproute2; do
  dpkg -s "$pkg" >/dev/null 2>&1 || need_apt+=("$pkg")
done
if ((${#need_apt[@]})); then
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi
python3 -c "import mesonbuild, ninja, numpy, ml_dtypes" 2>/dev/null ||
  python3 -m pip install -q meson ninja numpy ml_dtypes
if [ ! -f build/build.ninja ]; then
  python3 -m mesonbuild.mesonmain setup build --buildtype=release >/dev/null ||
    meson setup build --buildtype=release
fi
meson compile -C build

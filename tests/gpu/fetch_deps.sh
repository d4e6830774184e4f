#!/usr/bin/env bash
# Fetches, with apt-get download, the few Debian 12 packages the build needs that a bare GPU
# machine may lack (its image has CUDA, meson and ninja but maybe not these): gtest, TBB,
# nlohmann-json, CLI11 (the tools' parsers: meson's configure needs it) and pkgconf. They land in build-gpu-deps/ (gitignored by /build*/), about 1 MB;
# name it in the device tool's `carry` and tests/gpu/check.sh unpacks them under
# BUILD_DIR-sysroot when the system has no gtest, TBB, nlohmann-json or pkg-config.
#
#   tests/gpu/fetch_deps.sh [DIR]     (default build-gpu-deps)
set -eu
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
DIR=${1:-$ROOT/build-gpu-deps}
mkdir -p "$DIR"
cd "$DIR"
rm -f ./*.deb
apt-get download libgtest-dev libtbb-dev libtbb12 libtbbmalloc2 libtbbbind-2-5 nlohmann-json3-dev \
  libcli11-dev pkgconf-bin libpkgconf3
ls -l "$DIR"

#!/usr/bin/env bash
# Fetches, with apt-get download, the few Debian 12 packages the build needs that a bare GPU
# machine may lack (its image has CUDA, meson and ninja but maybe not these): gtest, TBB,
# nlohmann-json, CLI11 (the tools' parsers: meson's configure needs it) and pkgconf. They land in build-gpu-deps/ (gitignored by /build*/), about 1 MB;
# name it in the device tool's `carry` and tests/gpu/check.sh unpacks them under
# BUILD_DIR-sysroot when the system has no gtest, TBB, nlohmann-json or pkg-config. Also writes
# COMMIT there: `git rev-parse HEAD`, with "-dirty" where the tree has changes.
#
#   tests/gpu/fetch_deps.sh [DIR]     (default build-gpu-deps)
set -eu
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
DIR=${1:-$ROOT/build-gpu-deps}
mkdir -p "$DIR"
# The commit the carried tree is (the device's copy has no .git; check.sh's summary names it),
# "-dirty" when the tree has changes git sees (committed files changed, new files not ignored).
# Written first, so that it is right even where apt-get cannot download: run this script (or
# again) right before the device call.
commit=$(git -C "$ROOT" rev-parse HEAD 2>/dev/null || echo unknown)
if [ -n "$(git -C "$ROOT" status --porcelain 2>/dev/null)" ]; then commit="$commit-dirty"; fi
echo "$commit" >"$DIR/COMMIT"
echo "commit: $commit (in $DIR/COMMIT)"
cd "$DIR"
rm -f ./*.deb
apt-get download libgtest-dev libtbb-dev libtbb12 libtbbmalloc2 libtbbbind-2-5 nlohmann-json3-dev \
  libcli11-dev pkgconf-bin libpkgconf3
ls -l "$DIR"

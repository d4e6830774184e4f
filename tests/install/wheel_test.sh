#!/usr/bin/env bash
# The wheel works on its own: `pip wheel` of the source tree (meson-python, pyproject.toml), the
# wheel installed into a fresh virtual environment, then, from that environment only and away
# from the checkout:
#   - python -m dynamiq --version prints the project's version and exits 0,
#   - the libraries inside the package: libdynamiq.so with its versioned SONAME, the net plugin
#     under the exact name NCCL dlopens, the CPU NCCL; dynamiq-predict and the other tools as
#     console scripts,
#   - the README's main job: python -m dynamiq run -- dynamiq-run --cpu-nccl -n 4 --
#     dynamiq-demo <the wheel's sample>: 4 ranks, compressed, fewer bytes than BF16.
# The wheel's build folder is BUILD_DIR-wheel (build-wheel beside build: at the same depth, so
# ccache serves the objects the main build compiled) and is kept: a second run recompiles only
# what changed. Needs meson-python in PYTHON's environment (tools/setup.sh installs it) and no
# network (--no-build-isolation, --no-index); 77 (skipped) without meson-python or patchelf.
#
# usage: wheel_test.sh BUILD_DIR SOURCE_DIR PYTHON
set -euo pipefail
[ $# -eq 3 ] || { echo "usage: $0 BUILD_DIR SOURCE_DIR PYTHON" >&2; exit 2; }
BUILD=$(cd "$1" && pwd)
SRC=$(cd "$2" && pwd)
PY=$3
if ! "$PY" -c "import mesonpy" 2>/dev/null; then
  echo "skip: meson-python is not installed for $PY (tools/setup.sh installs it)"
  exit 77
fi
if ! command -v patchelf >/dev/null; then  # meson-python sets the CPU NCCL's RUNPATH with it
  echo "skip: patchelf is not installed (tools/setup.sh installs it)"
  exit 77
fi
VERSION=$("$PY" -c 'import re, sys; print(re.search(r"version: *.([0-9.]+)", open(sys.argv[1]).read()).group(1))' "$SRC/meson.build")

D=$(mktemp -d "${TMPDIR:-/tmp}/dq-wheel-test.XXXXXX")
trap 'rm -rf "$D"' EXIT
FAILED=0
ok() { echo "ok   $*"; }
fail() { echo "FAIL $*"; FAILED=1; }
check() {  # check "what" command...
  local what=$1
  shift
  if "$@"; then ok "$what"; else fail "$what"; fi
}

# The build: meson and ninja from PYTHON's environment; ccache (when configured) serves the
# objects the main build already compiled.
start=$(date +%s)
if ! PATH="$(dirname "$PY"):$PATH" "$PY" -m pip wheel "$SRC" --no-build-isolation --no-deps \
       --no-index -w "$D/dist" -Cbuild-dir="$BUILD-wheel" >"$D/wheel.log" 2>&1; then
  tail -n 60 "$D/wheel.log"
  echo "FAIL pip wheel $SRC"
  exit 1
fi
WHEEL=$(ls "$D"/dist/dynamiq-"$VERSION"-*.whl)
ok "pip wheel: $(basename "$WHEEL") in $(($(date +%s) - start)) s"

# A fresh environment with nothing but the wheel (its own pip, not the build's).
"$PY" -m venv "$D/venv" >"$D/venv.log" 2>&1 || { cat "$D/venv.log"; echo "FAIL python -m venv"; exit 1; }
"$D/venv/bin/python" -m pip install -q --no-index --no-deps "$WHEEL" >"$D/pip.log" 2>&1 ||
  { cat "$D/pip.log"; echo "FAIL pip install the wheel"; exit 1; }
ok "pip install into a fresh venv"
VPY="$D/venv/bin/python"
cd "$D"  # away from the checkout: nothing below may come from it
unset DYNAMIQ_PREFIX LD_PRELOAD DYNAMIQ_ENABLE

check "python -m dynamiq --version prints $VERSION, exit 0" \
  test "$("$VPY" -m dynamiq --version)" = "$VERSION"
PKG=$("$VPY" -c 'import dynamiq, os; print(os.path.dirname(dynamiq.__file__))')
check "the package comes from the venv ($PKG)" test "${PKG#"$D/venv/"}" != "$PKG"
SHIM=$("$VPY" -m dynamiq library-path)
check "library-path: the shim inside the package ($SHIM)" test "${SHIM#"$PKG/lib/"}" != "$SHIM" -a -f "$SHIM"
check "the shim's SONAME is versioned (libdynamiq.so.${VERSION%%.*})" \
  sh -c "readelf -d '$SHIM' | grep -q 'Library soname: \[libdynamiq.so.${VERSION%%.*}\]'"
check "the net plugin under the name NCCL dlopens: lib/libnccl-net-dynamiq.so" \
  test -f "$PKG/lib/libnccl-net-dynamiq.so"
check "dlopen(\"libnccl-net-dynamiq.so\") with the package's lib on LD_LIBRARY_PATH" \
  env LD_LIBRARY_PATH="$PKG/lib" "$VPY" -c 'import ctypes; ctypes.CDLL("libnccl-net-dynamiq.so").ncclNetPlugin_v8'
check "the CPU NCCL: lib/dynamiq/cpu-nccl/libnccl.so.2" test -f "$PKG/lib/dynamiq/cpu-nccl/libnccl.so.2"
for t in dynamiq-run dynamiq-sim dynamiq-predict; do
  check "console script $t runs (--help)" sh -c "'$D/venv/bin/$t' --help >/dev/null"
done
# (into a file: grep -q closing the pipe early would fail the writer)
"$VPY" -m dynamiq env >"$D/env.txt" || fail "python -m dynamiq env exits non-zero"
check "python -m dynamiq env exports LD_PRELOAD=<the shim>" grep -qF "export LD_PRELOAD=$SHIM" "$D/env.txt"

# The README's main job, through `python -m dynamiq run` (LD_PRELOAD, the plugin's folder, the
# tools' folder and DYNAMIQ_ENABLE=1 from the package).
if [ -x "$PKG/bin/dynamiq-demo" ]; then
  DATA=$("$VPY" -m dynamiq data-path)
  if "$VPY" -m dynamiq run -- dynamiq-run --cpu-nccl -n 4 --timeout 120 -- dynamiq-demo \
       "$DATA/gradients/sample/step00079.npy" >"$D/demo.log" 2>&1 &&
     grep -q "dynamiq (FP32 in" "$D/demo.log" && grep -Eq "dynamiq sends [0-9.]+x fewer" "$D/demo.log"; then
    ok "python -m dynamiq run -- dynamiq-run --cpu-nccl -n 4 -- dynamiq-demo: compressed, fewer bytes than BF16"
  else
    cat "$D/demo.log"
    fail "python -m dynamiq run -- dynamiq-run --cpu-nccl -n 4 -- dynamiq-demo"
  fi
else
  echo "skip the demo: this wheel has no dynamiq-demo (no NCCL headers at build time)"
fi
exit $FAILED

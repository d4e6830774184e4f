#!/usr/bin/env bash
# The installed copy works on its own: `meson install` from a build directory into a temporary
# DESTDIR (no rebuild), then, from that tree only,
#   - every piece is there (shim, plugin, CPU NCCL in its own folder, tools, headers, C API
#     library, Python package and binding, dynamiq.pc, the demo's sample, the licence),
#   - the README's main job: 4 ranks of the installed dynamiq-demo on the installed CPU NCCL
#     found by the installed `dynamiq-run --cpu-nccl`, with the installed shim preloaded,
#   - pkg-config --modversion dynamiq, and a C program built with pkg-config's flags,
#   - the Python package finds the installed libraries; dynamiq.register against the CPU NCCL,
#   - NCCL_NET_PLUGIN=dynamiq's dlopen("libnccl-net-dynamiq.so") with the library path the
#     README gives, every /usr/local path the README names (default prefix), -Dnative=false.
#
# usage: install_test.sh BUILD_DIR SOURCE_DIR PYTHON MESON_COMMAND...
set -euo pipefail
[ $# -ge 4 ] || { echo "usage: $0 BUILD_DIR SOURCE_DIR PYTHON MESON_COMMAND..." >&2; exit 2; }
BUILD=$(cd "$1" && pwd)
SRC=$(cd "$2" && pwd)
PY=$3
shift 3
MESON=("$@")

D=$(mktemp -d "${TMPDIR:-/tmp}/dq-install-test.XXXXXX")
trap 'rm -rf "$D"' EXIT
FAILED=0
ok() { echo "ok   $*"; }
fail() { echo "FAIL $*"; FAILED=1; }
check() {  # check "what" command...
  local what=$1
  shift
  if "$@"; then ok "$what"; else fail "$what"; fi
}

"${MESON[@]}" install -C "$BUILD" --no-rebuild --quiet --destdir "$D/root" >"$D/install.log" 2>&1 ||
  { cat "$D/install.log"; echo "FAIL meson install"; exit 1; }
ok "meson install --destdir"

# The configured layout, from the build directory.
"${MESON[@]}" introspect --buildoptions "$BUILD" >"$D/options.json"
"${MESON[@]}" introspect --projectinfo "$BUILD" >"$D/project.json"
eval "$("$PY" - "$D/options.json" "$D/project.json" <<'EOF'
import json, shlex, sys
opts = {o["name"]: o["value"] for o in json.load(open(sys.argv[1]))}
for key in ("prefix", "libdir", "bindir", "datadir", "includedir"):
    print("%s=%s" % (key.upper(), shlex.quote(str(opts[key]))))
print("VERSION=%s" % shlex.quote(json.load(open(sys.argv[2]))["version"]))
EOF
)"
under() { case "$1" in /*) echo "$D/root$1" ;; *) echo "$D/root$PREFIX/$1" ;; esac; }
L=$(under "$LIBDIR")
B=$(under "$BINDIR")
S=$(under "$DATADIR")
I=$(under "$INCLUDEDIR")

for f in "$L/libdynamiq.so" "$L/libnccl-net-dynamiq.so" "$L/libdynamiq-capi.so" \
         "$L/dynamiq/cpu-nccl/libnccl.so.2" "$L/pkgconfig/dynamiq.pc" \
         "$B/dynamiq-run" "$B/dynamiq-sim" "$B/dynamiq-predict" \
         "$I/dynamiq/dynamiq.h" "$I/dynamiq/dynamiq_capi.h" \
         "$S/dynamiq/gradients/sample/step00079.npy" "$S/doc/dynamiq/LICENSE"; do
  check "installed: ${f#"$D/root"}" test -e "$f"
done
if [ -x "$BUILD/tools/dynamiq-perf" ]; then
  for t in dynamiq-perf dynamiq-demo; do check "installed: ${B#"$D/root"}/$t" test -x "$B/$t"; done
fi
check "no libnccl.so.2 directly in the libdir (only in dynamiq/cpu-nccl)" test ! -e "$L/libnccl.so.2"
# Versioned SONAMEs: libdynamiq.so -> libdynamiq.so.MAJOR -> libdynamiq.so.VERSION (the C API
# library alike); the plugin keeps the one name NCCL dlopens.
for lib in libdynamiq libdynamiq-capi; do
  check "$lib.so -> $lib.so.${VERSION%%.*} -> $lib.so.$VERSION, SONAME $lib.so.${VERSION%%.*}" \
    sh -c "test -L '$L/$lib.so' -a -L '$L/$lib.so.${VERSION%%.*}' -a -f '$L/$lib.so.$VERSION' &&
           readelf -d '$L/$lib.so' | grep -q 'Library soname: \[$lib.so.${VERSION%%.*}\]'"
done
check "the plugin is the plain file libnccl-net-dynamiq.so" \
  test -f "$L/libnccl-net-dynamiq.so" -a ! -L "$L/libnccl-net-dynamiq.so"
PYPKG=$(find "$D/root" -path '*/dynamiq/_install.py' -print -quit)
PYDIR=$(dirname "$(dirname "$PYPKG")")
check "installed: Python package dynamiq and binding dynamiq_capi.py (${PYDIR#"$D/root"})" \
  test -n "$PYPKG" -a -f "$PYDIR/dynamiq/__init__.py" -a -f "$PYDIR/dynamiq_capi.py"

cd "$D"  # nothing below reads the checkout except the test scripts named by path

# The README's main job, from the installed tree.
if [ -x "$B/dynamiq-demo" ]; then
  if LD_PRELOAD="$L/libdynamiq.so" DYNAMIQ_ENABLE=1 "$B/dynamiq-run" --cpu-nccl -n 4 --timeout 120 \
       -- "$B/dynamiq-demo" "$S/dynamiq/gradients/sample/step00079.npy" >"$D/demo.log" 2>&1 &&
     grep -q "dynamiq (FP32 in" "$D/demo.log" && grep -Eq "dynamiq sends [0-9.]+x fewer" "$D/demo.log"; then
    ok "installed dynamiq-run --cpu-nccl -n 4 -- dynamiq-demo: compressed, fewer bytes than BF16"
  else
    cat "$D/demo.log"
    fail "installed dynamiq-run --cpu-nccl -n 4 -- dynamiq-demo"
  fi
else
  echo "skip the installed demo: this build has no dynamiq-demo (no NCCL headers)"
fi

# pkg-config, and a C program built with its flags against the installed headers and libraries.
check "pkg-config --modversion dynamiq = $VERSION" \
  test "$(PKG_CONFIG_PATH="$L/pkgconfig" pkg-config --modversion dynamiq)" = "$VERSION"
check "pkg-config --variable=shim dynamiq names the installed shim" \
  test "$(PKG_CONFIG_PATH="$L/pkgconfig" pkg-config --variable=shim dynamiq)" = \
       "${L#"$D/root"}/libdynamiq.so"
cat >"$D/use.c" <<'EOF'
#include <dynamiq.h>
#include <dynamiq_capi.h>
#include <stdio.h>
int main(void) {
  printf("abi %d flush %d\n", dq_capi_abi_version(), dynamiqMetricsFlush());
  return dq_capi_abi_version() == DQ_CAPI_ABI_VERSION ? 0 : 1;
}
EOF
# shellcheck disable=SC2046  # pkg-config's words are separate arguments
if cc -o "$D/use" "$D/use.c" $(PKG_CONFIG_PATH="$L/pkgconfig" PKG_CONFIG_SYSROOT_DIR="$D/root" \
                               pkg-config --cflags --libs dynamiq) -ldynamiq-capi \
     >"$D/cc.log" 2>&1 && LD_LIBRARY_PATH="$L" "$D/use" >"$D/use.log" 2>&1; then
  ok "a C program built with pkg-config's flags runs: $(cat "$D/use.log")"
else
  cat "$D/cc.log" "$D/use.log" 2>/dev/null
  fail "a C program built with pkg-config's flags"
fi

# NCCL loads NCCL_NET_PLUGIN=dynamiq as dlopen("libnccl-net-dynamiq.so"): found with the
# libdir on LD_LIBRARY_PATH, as the README says.
check "dlopen(\"libnccl-net-dynamiq.so\") with LD_LIBRARY_PATH=<libdir> exports ncclNetPlugin_v8" \
  env LD_LIBRARY_PATH="$L" "$PY" -c 'import ctypes; ctypes.CDLL("libnccl-net-dynamiq.so").ncclNetPlugin_v8'

# The installed CPU NCCL finds the installed plugin through its RUNPATH: its folder alone on
# the library path (ncclGetUniqueId loads the plugin and listens on it).
check "LD_LIBRARY_PATH=<libdir>/dynamiq/cpu-nccl: the CPU NCCL loads the installed plugin" \
  env -u DYNAMIQ_CPU_NCCL_NET_PLUGIN LD_LIBRARY_PATH="$L/dynamiq/cpu-nccl" DYNAMIQ_NET_IFNAME=lo \
  "$PY" -c 'import ctypes, sys; sys.exit(ctypes.CDLL("libnccl.so.2").ncclGetUniqueId(ctypes.create_string_buffer(128)))'

# The installed Python package finds the installed libraries (no DYNAMIQ_PREFIX).
check "installed dynamiq: version $VERSION, library_path() and library_path('cpu-nccl') in the tree" \
  env -u DYNAMIQ_PREFIX PYTHONPATH="$PYDIR" "$PY" -c '
import sys, dynamiq
assert dynamiq.__version__ == sys.argv[1], dynamiq.__version__
assert str(dynamiq.library_path()) == sys.argv[2] + "/libdynamiq.so", dynamiq.library_path()
assert str(dynamiq.library_path("cpu-nccl")) == sys.argv[2] + "/dynamiq/cpu-nccl/libnccl.so.2"
assert dynamiq.__file__.startswith(sys.argv[3]), dynamiq.__file__
' "$VERSION" "$L" "$PYDIR"
if "$PY" -c "import numpy" 2>/dev/null; then
  check "installed dynamiq_capi loads the installed libdynamiq-capi.so" \
    env -u DYNAMIQ_PREFIX -u DQ_CAPI_LIB PYTHONPATH="$PYDIR" "$PY" -c '
import sys, dynamiq_capi
lib = dynamiq_capi.DynamiqCapi()
assert str(lib.path) == sys.argv[1] + "/libdynamiq-capi.so", lib.path
' "$L"
else
  echo "skip dynamiq_capi: numpy is not importable"
fi
if LD_PRELOAD="$L/libdynamiq.so" DYNAMIQ_ENABLE=1 DYNAMIQ_COMMS=none PYTHONPATH="$PYDIR" \
     "$B/dynamiq-run" --cpu-nccl -n 2 --timeout 120 -- "$PY" "$SRC/tests/python/register_test.py" \
     >"$D/register.log" 2>&1; then
  ok "installed dynamiq.register/counters on the installed CPU NCCL (2 ranks)"
else
  cat "$D/register.log"
  fail "installed dynamiq.register/counters on the installed CPU NCCL"
fi

# Build options: -Dnative=false is the default (the source tree's options, not this build's).
check "-Dnative defaults to false" test "$("${MESON[@]}" introspect --buildoptions "$SRC/meson.build" |
  "$PY" -c 'import json,sys; print([o["value"] for o in json.load(sys.stdin) if o["name"] == "native"])')" = "[False]"
check "LICENSE at the top of the source tree" test -s "$SRC/LICENSE"

# Every /usr/local path the README names exists in the tree a default install gives.
if [ "$PREFIX" = /usr/local ]; then
  named=$(grep -oE '/usr/local/[A-Za-z0-9_./+-]*[A-Za-z0-9_+-]' "$SRC/README.md" | sort -u |
          grep -v python || true)
  missing=$(for p in $named; do [ -e "$D/root$p" ] || echo "$p"; done)
  check "the README names installed /usr/local paths" test -n "$named"
  check "the README's /usr/local paths exist in the installed tree${missing:+ (missing: $missing)}" \
    test -z "$missing"
  check "the README's install section names the libdir of this build ($LIBDIR)" \
    grep -q "/usr/local/$LIBDIR/libdynamiq.so" "$SRC/README.md"
else
  echo "skip the README paths: prefix is $PREFIX, the README's examples use /usr/local"
fi

exit $FAILED

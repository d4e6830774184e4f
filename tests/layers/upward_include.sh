#!/bin/sh
# Proves the build refuses an upward #include (meson.build, layer_folders): compiled with a layer's
# include directory only, a file including a header of its own layer compiles, one including a
# header of a layer above it does not.
# Usage: upward_include.sh LAYER_INCLUDE_DIR ALLOWED_HEADER FORBIDDEN_HEADER COMPILER [ARGS...]
set -u
layer_dir=$1
allowed=$2
forbidden=$3
shift 3
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

printf '#include "%s"\n' "$allowed" >"$work/allowed.cc"
if ! "$@" -std=c++20 -fsyntax-only -I"$layer_dir" "$work/allowed.cc"; then
  echo "FAIL: $allowed does not compile with $layer_dir (the check itself is broken)"
  exit 1
fi

printf '#include "%s"\n' "$forbidden" >"$work/forbidden.cc"
if "$@" -std=c++20 -fsyntax-only -I"$layer_dir" "$work/forbidden.cc" 2>"$work/err"; then
  echo "FAIL: $forbidden compiled with $layer_dir: an upward include is not refused"
  exit 1
fi
if ! grep -q "$forbidden" "$work/err"; then
  echo "FAIL: the compile failed for another reason:"
  cat "$work/err"
  exit 1
fi
echo "ok: $allowed compiles, $forbidden is refused:"
head -n 3 "$work/err"

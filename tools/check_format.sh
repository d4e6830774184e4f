#!/usr/bin/env bash
# Fails when a tracked C, C++ or CUDA source differs from what clang-format makes of it under the
# repository's .clang-format. The style is pinned to clang-format 14 (Debian 12's): other
# versions format some constructs differently, so a different major version is refused rather than
# reporting differences the tree's own formatter would not.
# Usage: tools/check_format.sh [--fix]   (--fix rewrites the files in place instead)
set -euo pipefail
cd "$(dirname "$0")/.."
clang_format=${CLANG_FORMAT:-clang-format}
if ! command -v "$clang_format" >/dev/null; then
  echo "tools/check_format.sh: $clang_format not found (Debian: apt-get install clang-format)" >&2
  exit 2
fi
major=$("$clang_format" --version | sed -n 's/.*version \([0-9]*\)\..*/\1/p')
if [ "$major" != 14 ]; then
  echo "tools/check_format.sh: clang-format $major found; the tree is formatted with 14" >&2
  exit 2
fi
mapfile -t sources < <(git ls-files '*.h' '*.hpp' '*.c' '*.cc' '*.cpp' '*.cu' '*.cuh')
if [ "${1:-}" = --fix ]; then
  printf '%s\0' "${sources[@]}" | xargs -0 "$clang_format" -i
  exit 0
fi
unformatted=()
for f in "${sources[@]}"; do
  if ! "$clang_format" --dry-run -Werror "$f" >/dev/null 2>&1; then unformatted+=("$f"); fi
done
if ((${#unformatted[@]})); then
  echo "tools/check_format.sh: ${#unformatted[@]} of ${#sources[@]} files differ from clang-format:" >&2
  printf '  %s\n' "${unformatted[@]}" >&2
  echo "run tools/check_format.sh --fix, then commit" >&2
  exit 1
fi
echo "tools/check_format.sh: ${#sources[@]} files formatted"

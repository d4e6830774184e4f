#!/usr/bin/env bash
# Applies each mutation of a list (tools/mutations/list by default) to a temporary git worktree of
# a commit, rebuilds only the targets its tests need, runs them, and prints whether the mutation
# was caught (at least one named test failed) or survived (all passed). The caller's working tree
# is never touched: everything happens in /tmp/mut-<pid> (removed at the end unless KEEP=1).
#
# First the unmutated tree must pass every named test, or nothing is concluded (exit 2).
#
# Usage: tools/mutations/run.sh [-l LIST] [-r REV] [NAME ...]
#   -l LIST  mutation list (format: see the list's header); default tools/mutations/list
#   -r REV   commit to mutate; default HEAD
#   NAME     run only these mutations (default: all of the list)
# Environment: JOBS (ninja -j, default 2), KEEP=1 keeps the worktree and build, MESON_ARGS
# (extra meson setup options, e.g. -Dnative=true for the AVX2 paths; the default build is scalar).
# Exit status: 0 every mutation caught; 1 some survived or could not be applied; 2 setup failed.
set -u -o pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(git -C "$here" rev-parse --show-toplevel)
list="$here/list"
rev=HEAD
while getopts "l:r:" opt; do
  case $opt in
    l) list=$OPTARG ;;
    r) rev=$OPTARG ;;
    *) sed -n '2,17p' "$0"; exit 2 ;;
  esac
done
shift $((OPTIND - 1))
jobs=${JOBS:-2}

# The version in meson.build's project() (the shared libraries' file names carry it).
project_version() {
  sed -n "s/^ *version: *'\([0-9.]*\)'.*/\1/p" "$repo/meson.build" | head -n 1
}

# Meson test name -> ninja target(s) it runs.
targets_of() {
  case $1 in
    golden) echo tests/kernels/test_golden ;;
    golden_decode) echo ;;  # python3 over committed files
    dynamiq_codec) echo tests/kernels/test_dynamiq ;;
    baselines) echo tests/kernels/test_baselines ;;
    multihop) echo tests/kernels/test_multihop ;;
    engine@program) echo tests/shim/program_test ;;
    # Forked ranks over the CPU NCCL and its net plugin; the shim tests preload libdynamiq.so
    # (the versioned file is ninja's target: libdynamiq.so.<project version>).
    shim_*) echo tests/shim/shim_multirank "shim/libdynamiq.so.$(project_version)" \
                 plugin/abi/libnccl-net-dynamiq.so ;;
    engine_*) echo tests/shim/engine_multirank plugin/abi/libnccl-net-dynamiq.so ;;
    *) echo "$1" ;;  # assume the test's executable has the test's name
  esac
}

names=() files=() scripts=() tests=()
while IFS= read -r line; do
  case $line in '' | '#'*) continue ;; esac
  name=${line%% :: *}; rest=${line#* :: }
  file=${rest%% :: *}; rest=${rest#* :: }
  script=${rest% :: *}; t=${rest##* :: }
  if [ $# -gt 0 ]; then
    keep=0
    for want in "$@"; do [ "$want" = "$name" ] && keep=1; done
    [ $keep = 1 ] || continue
  fi
  names+=("$name") files+=("$file") scripts+=("$script") tests+=("$t")
done < "$list"
if [ ${#names[@]} -eq 0 ]; then
  echo "no mutations selected from $list" >&2
  exit 2
fi

commit=$(git -C "$repo" rev-parse --verify "$rev^{commit}") || exit 2
wt=/tmp/mut-$$
build=$wt/build-mut
cleanup() {
  if [ "${KEEP:-0}" = 1 ]; then
    echo "kept $wt"
  else
    git -C "$repo" worktree remove --force "$wt" >/dev/null 2>&1 || rm -rf "$wt"
    git -C "$repo" worktree prune
  fi
}
trap cleanup EXIT
git -C "$repo" worktree add --detach "$wt" "$commit" >/dev/null 2>&1 || {
  echo "cannot create the worktree $wt" >&2
  exit 2
}
echo "mutating $(git -C "$wt" log -1 --format='%h %s' | cut -c1-90) in $wt ${MESON_ARGS:-}"
# shellcheck disable=SC2086
meson setup "$build" "$wt" --buildtype=release ${MESON_ARGS:-} >"$wt/setup.log" 2>&1 || {
  echo "meson setup failed: $wt/setup.log" >&2
  tail -20 "$wt/setup.log" >&2
  exit 2
}

# Every test any selected mutation names, and their targets.
all_tests=$(printf '%s\n' "${tests[@]}" | tr ' ' '\n' | sed '/^$/d' | sort -u | tr '\n' ' ')
all_targets=$(for t in $all_tests; do targets_of "$t"; done | sed '/^$/d' | sort -u | tr '\n' ' ')

# Runs the named tests; prints "test PASS|FAIL" lines; returns the number of failures.
run_tests() {
  local log=$1 t failed=0
  shift
  for t in "$@"; do
    # A list names a test whose meson name holds spaces with @ in their place.
    if meson test -C "$build" --no-rebuild --print-errorlogs "${t//@/ }" >"$log.$t" 2>&1; then
      echo "    $t PASS"
    else
      echo "    $t FAIL"
      failed=$((failed + 1))
    fi
  done
  return $failed
}

echo "unmutated: building $all_targets"
# shellcheck disable=SC2086
ninja -C "$build" -j "$jobs" $all_targets >"$wt/build-base.log" 2>&1 || {
  echo "the unmutated tree does not build: $wt/build-base.log" >&2
  KEEP=1
  exit 2
}
# shellcheck disable=SC2086
if ! run_tests "$wt/base" $all_tests; then
  echo "the unmutated tree fails a named test (logs: $wt/base.*): no conclusion" >&2
  KEEP=1
  exit 2
fi

summary=()
status=0
for k in "${!names[@]}"; do
  name=${names[$k]} script=${scripts[$k]}
  echo "mutation $name (${files[$k]})"
  applied=1
  for file in ${files[$k]}; do
    cp "$wt/$file" "$wt/$file.orig"
    sed -i -e "$script" "$wt/$file"
    if cmp -s "$wt/$file" "$wt/$file.orig"; then
      echo "    NOT APPLIED: the sed script changed nothing in $file"
      applied=0
    fi
    diff -u "$wt/$file.orig" "$wt/$file" | sed -n '3,$p' | grep '^[-+]' | sed "s|^|    $file: |"
  done
  restore() { for file in ${files[$k]}; do mv "$wt/$file.orig" "$wt/$file"; done; }
  if [ $applied = 0 ]; then
    summary+=("$name: NOT APPLIED")
    status=1
    restore
    continue
  fi
  # shellcheck disable=SC2086
  targets=$(for t in ${tests[$k]}; do targets_of "$t"; done | sed '/^$/d' | sort -u | tr '\n' ' ')
  # shellcheck disable=SC2086
  if ! ninja -C "$build" -j "$jobs" $targets >"$wt/build-$name.log" 2>&1; then
    echo "    build failed ($wt/build-$name.log): counted as caught by the compiler"
    summary+=("$name: CAUGHT (does not build)")
  else
    # shellcheck disable=SC2086
    out=$(run_tests "$wt/$name" ${tests[$k]})
    echo "$out"
    caught_by=$(echo "$out" | awk '$2 == "FAIL" {print $1}' | tr '\n' ' ')
    if [ -n "$caught_by" ]; then
      summary+=("$name: CAUGHT by ${caught_by% }")
      for t in $caught_by; do  # the gtest cases that failed in each catching test
        grep -E '^\[  FAILED  \] [A-Za-z]' "$wt/$name.$t" 2>/dev/null | sed 's/ ([0-9]* ms)$//' | sort -u | cut -c1-150 | sed 's/^/      /'
      done
    else
      summary+=("$name: SURVIVED")
      status=1
    fi
  fi
  restore
done
# Leave the build as the unmutated tree would have it (KEEP=1 users run tests there).
# shellcheck disable=SC2086
ninja -C "$build" -j "$jobs" $all_targets >/dev/null 2>&1 || true

echo
echo "summary ($(git -C "$repo" rev-parse --short "$commit")):"
printf '  %s\n' "${summary[@]}"
exit $status

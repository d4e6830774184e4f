#!/usr/bin/env bash
# on_verbs.sh COMMAND [ARGS...]: runs COMMAND (in the guest) and fails if the net plugin ran on
# sockets instead of verbs. DYNAMIQ_NET_BACKEND=ib falls back to sockets with one warning when no
# verbs port works (plugin/net_tables.cc), which would let a verbs test pass without verbs.
set -u
log=$(mktemp) || exit 1
trap 'rm -f "$log"' EXIT
"$@" 2>"$log"  # stderr comes back once the command ends
rc=$?
cat "$log" >&2
if grep -q "verbs backend cannot run" "$log"; then
  echo "on_verbs.sh: the net plugin fell back to sockets: not a verbs run" >&2
  exit 1
fi
exit "$rc"

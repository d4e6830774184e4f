#!/usr/bin/env bash
# The fault campaign's own verdicts, checked: the campaign is the evidence that the engine never
# hangs nor returns a wrong result, so a harness that misjudges would hide a defect (or invent
# one). Each case runs campaign.sh once on 2 ranks with one harness self-test switch and checks
# its exit status and what it says:
#   corrupt   one rank alters one result (DQF_CORRUPT_*)          -> a wrong result, exit 1
#   slow-ranks the ranks time out after 60 s, not 2 (cut link)    -> a hang, exit 1
#   pause     every rank and the harness stopped 7 s after the cut -> judged clean, the pause named
#             (7 s: past the 5 s limit, so that without the detection the errors come late)
#   no-pause  the same pause, its detection out of reach          -> a hang, exit 1
#
#   tests/faults/selftest.sh BUILD OUT
# Exit: 0 every verdict as expected; 1 otherwise; 77 when the campaign cannot run here.
set -u -o pipefail
[ $# = 2 ] || { echo "usage: $0 BUILD OUT" >&2; exit 2; }
here=$(cd "$(dirname "$0")" && pwd)
build=$1 out=$2
rm -rf "$out"
mkdir -p "$out"
failures=0

# NAME EXPECTED_EXIT EXPECTED_TEXT [VAR=VALUE ...] -- CAMPAIGN_ARGS...
expect() {
  local name=$1 want=$2 text=$3 envs=()
  shift 3
  while [ "$1" != -- ]; do envs+=("$1"); shift; done
  shift
  env "${envs[@]}" timeout 300 "$here/campaign.sh" -n 2 -r 1 -s 11 -B "$build" \
    -o "$out/$name" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  if [ "$rc" = 77 ]; then
    grep -m1 SKIP "$out/$name.log"
    exit 77
  fi
  if [ "$rc" = "$want" ] && grep -q -- "$text" "$out/$name.log"; then
    echo "ok   $name: exit $rc, \"$text\""
  else
    echo "FAIL $name: exit $rc (want $want), \"$text\" $(grep -c -- "$text" "$out/$name.log") times; log:"
    sed 's/^/     /' "$out/$name.log"
    failures=$((failures + 1))
  fi
}

expect corrupt 1 "kill run 1: wrong" DQF_CORRUPT_RANK=1 DQF_CORRUPT_CALL=3 -- -k kill
expect slow-ranks 1 "cut run 1: hang" DQF_WORKER_TIMEOUT_MS=60000 -- -k cut
expect pause 0 "cut run 1: the machine paused" DQF_PAUSE_SELFTEST_MS=7000 -- -k cut
expect no-pause 1 "cut run 1: hang" DQF_PAUSE_SELFTEST_MS=7000 DQF_PAUSE_MS=60000 -- -k cut
[ "$failures" = 0 ] && echo "all verdicts as expected" && exit 0
echo "$failures verdict(s) wrong"
exit 1

#!/usr/bin/env bash
# The verbs bandwidth reference over rxe0: perftest's ib_write_bw and ib_send_bw (RC, GID index 1,
# server and client processes in the same guest) at 64 KiB and 4 MiB messages, in MiB/s as
# perftest prints it ("BW average[MB/sec]": 2^20 bytes per second; the client's report for
# WRITE, the receiver's for SEND), over eth0 MTU 9000 (rxe0 active MTU 4096; run.sh).
#
#   tests/vm/perftest_ref.sh [--runs N] [--sizes "B..."] [--tests "write send"]
#       on the host: boots the guest (tests/vm/run.sh) and runs the --inside form there
#   tests/vm/perftest_ref.sh --inside [--runs N] [--sizes ...] [--tests ...]
#       in the guest: one line per run, then one line per test and size with the median
#   tests/vm/perftest_ref.sh --inside --one write|send SIZE
#       in the guest: one run, prints the MiB/s figure alone (to alternate with another
#       benchmark in the same guest run, e.g. the plugin's loopback bandwidth)
#   . tests/vm/perftest_ref.sh   (sourced, in the guest): defines perftest_bw TEST SIZE, the same
#
# Lines printed (stable, for scripts):
#   perftest ib_write_bw size=65536 run=1 MiB/s=41.07
#   perftest ib_write_bw size=65536 median_MiB/s=41.07 runs=41.07,39.90,44.12
# Each run moves about DYNAMIQ_PERFTEST_BYTES (default 128 MiB; at least 5 messages, at most
# 20000) and is bounded by 120 s. Exit status: 0, 1 when a run failed, 77/124 from run.sh.

# perftest_bw TEST SIZE: one server and one client process of ib_TEST_bw over rxe0; prints the
# client's average MiB/s; returns non-zero (and prints both outputs to stderr) when one failed.
perftest_bw() {
  local test=$1 size=$2 dev=${DYNAMIQ_PERFTEST_DEV:-rxe0} gid=${DYNAMIQ_PERFTEST_GID:-1}
  local bytes=${DYNAMIQ_PERFTEST_BYTES:-134217728} iters port dir spid src crc i bw
  iters=$((bytes / size)); ((iters < 5)) && iters=5; ((iters > 20000)) && iters=20000
  _perftest_port=$(( ${_perftest_port:-18600} + 1 ))
  port=$_perftest_port
  dir=$(mktemp -d /tmp/perftest.XXXXXX) || return 1
  local common=(-d "$dev" -x "$gid" -p "$port" -s "$size" -n "$iters" -F)
  # Receive queue and send queue depths bounded so that 4 MiB messages fit the guest's memory.
  [ "$test" = send ] && common+=(-r 64 -t 64)
  timeout 120 "ib_${test}_bw" "${common[@]}" > "$dir/server" 2>&1 &
  spid=$!
  for ((i = 0; i < 200; i++)); do  # until the server's TCP side channel listens
    grep -q "$(printf ':%04X ' "$port")[0-9A-F:]* 0A " /proc/net/tcp /proc/net/tcp6 2>/dev/null && break
    sleep 0.1
  done
  timeout 120 "ib_${test}_bw" "${common[@]}" 127.0.0.1 > "$dir/client" 2>&1
  crc=$?
  wait "$spid"; src=$?
  # The results line: the message size first, then iterations, peak and average bandwidth. For
  # SEND the receiver's (server's) own measurement; for WRITE only the client measures (the
  # server prints the client's figure).
  local side=client; [ "$test" = send ] && side=server
  bw=$(awk -v s="$size" '$1 == s && NF >= 4 { print $4 }' "$dir/$side" | tail -n 1)
  if [ "$src" != 0 ] || [ "$crc" != 0 ] || [ -z "$bw" ] || awk -v b="$bw" 'BEGIN { exit !(b + 0 <= 0) }'; then
    echo "perftest ib_${test}_bw size=$size failed: server exit $src, client exit $crc" >&2
    sed 's/^/  server: /' "$dir/server" >&2; sed 's/^/  client: /' "$dir/client" >&2
    rm -rf "$dir"; return 1
  fi
  rm -rf "$dir"
  echo "$bw"
}

# Sourced: the function only.
[ "${BASH_SOURCE[0]}" != "$0" ] && return 0

set -u -o pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)
inside=0; runs=1; sizes="65536 4194304"; tests="write send"; one=()
args=("$@")
while [ $# -gt 0 ]; do
  case "$1" in
    --inside) inside=1; shift ;;
    --runs) runs=$2; shift 2 ;;
    --sizes) sizes=$2; shift 2 ;;
    --tests) tests=$2; shift 2 ;;
    --one) one=("$2" "$3"); shift 3 ;;
    *) echo "usage: $0 [--inside] [--runs N] [--sizes \"BYTES...\"] [--tests \"write send\"] | --inside --one TEST SIZE" >&2; exit 2 ;;
  esac
done

if [ $inside = 0 ]; then
  exec "$here/run.sh" --timeout "${DYNAMIQ_VM_PERFTEST_TIMEOUT:-900}" -- "$here/perftest_ref.sh" --inside "${args[@]}"
fi
[ "${DYNAMIQ_VM:-0}" = 1 ] || echo "note: not in the tests/vm guest (DYNAMIQ_VM unset); using ${DYNAMIQ_PERFTEST_DEV:-rxe0} here" >&2

if [ ${#one[@]} = 2 ]; then
  perftest_bw "${one[0]}" "${one[1]}"; exit $?
fi

status=0
for t in $tests; do
  for s in $sizes; do
    all=()
    for ((r = 1; r <= runs; r++)); do
      if bw=$(perftest_bw "$t" "$s"); then
        echo "perftest ib_${t}_bw size=$s run=$r MiB/s=$bw"; all+=("$bw")
      else
        echo "perftest ib_${t}_bw size=$s run=$r FAILED"; status=1
      fi
    done
    [ ${#all[@]} -gt 0 ] || continue
    med=$(printf '%s\n' "${all[@]}" | sort -g | awk '{ v[NR] = $1 } END { print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }')
    echo "perftest ib_${t}_bw size=$s median_MiB/s=$med runs=$(IFS=,; echo "${all[*]}")"
  done
done
exit $status

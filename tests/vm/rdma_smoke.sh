#!/usr/bin/env bash
# rdma_vm_smoke (suite rdma): boots the soft-RoCE guest (tests/vm/run.sh) and checks that rxe0
# works for real there: ibv_devinfo shows port 1 PORT_ACTIVE with an Ethernet link layer and the
# IPv4-mapped GID at index 1, then two 2-process RDMA tests pass over it:
#   ibv_rc_pingpong -g 1  (RC SEND/RECV, 200 iterations of 4 KiB, server and client processes)
#   ib_write_bw -x 1      (perftest RC RDMA WRITE, 64 KiB, server and client processes)
#
#   tests/vm/rdma_smoke.sh            on the host: boots the guest and runs the --inside part there
#   tests/vm/rdma_smoke.sh --inside   in the guest (DYNAMIQ_VM=1): the checks themselves
#
# Exit status: 0 passed, 1 a check failed (which one is printed), 77 no guest can be had here
# (run.sh's reason), 124 the guest ran out of time.
set -u -o pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)

if [ "${1:-}" != --inside ]; then
  exec "$here/run.sh" --timeout "${DYNAMIQ_VM_SMOKE_TIMEOUT:-240}" -- "$here/rdma_smoke.sh" --inside
fi

dev=rxe0
ip4=198.18.0.2
failed=0
step() { echo "== $*"; }
bad() { echo "FAIL: $*"; failed=1; }

# Waits (at most $2 s) until a TCP port listens (the servers' out-of-band channel).
wait_listen() {
  local hex i
  hex=$(printf ':%04X ' "$1")
  for ((i = 0; i < $2 * 10; i++)); do
    grep -q "${hex}[0-9A-F:]* 0A " /proc/net/tcp /proc/net/tcp6 2>/dev/null && return 0
    sleep 0.1
  done
  return 1
}

# Server in the background, client once it listens, both bounded; both must exit 0.
two_process() {
  local name=$1 port=$2 limit=$3; shift 3
  local server=() client=() in_client=0 a spid src crc
  for a in "$@"; do
    if [ "$a" = --client ]; then in_client=1; continue; fi
    if [ $in_client = 0 ]; then server+=("$a"); else client+=("$a"); fi
  done
  timeout "$limit" "${server[@]}" > "/tmp/$name.server" 2>&1 &
  spid=$!
  if ! wait_listen "$port" 20; then
    kill "$spid" 2>/dev/null; wait "$spid"
    bad "$name: the server never listened on port $port"; sed 's/^/  server: /' "/tmp/$name.server"; return 1
  fi
  timeout "$limit" "${client[@]}" > "/tmp/$name.client" 2>&1
  crc=$?
  wait "$spid"; src=$?
  sed 's/^/  server: /' "/tmp/$name.server"
  sed 's/^/  client: /' "/tmp/$name.client"
  [ $src = 0 ] && [ $crc = 0 ] && { echo "ok: $name (server and client exit 0)"; return 0; }
  bad "$name: server exit $src, client exit $crc (124 = timed out after $limit s)"
  return 1
}

step "ibv_devinfo -d $dev"
info=$(timeout 30 ibv_devinfo -d "$dev" -v 2>&1)
echo "$info" | grep -E 'hca_id|state|link_layer|active_mtu|GID\[' | sed 's/^/  /'
echo "$info" | grep -q 'state:.*PORT_ACTIVE' || bad "$dev port 1 is not PORT_ACTIVE"
echo "$info" | grep -q 'link_layer:.*Ethernet' || bad "$dev is not RoCE (link layer not Ethernet)"
echo "$info" | grep -Eq "GID\[ *1\]:.*ffff:c612:2, RoCE v2|GID\[ *1\]:.*$ip4" ||
  echo "note: GID index 1 is not the IPv4-mapped RoCE v2 GID of $ip4 (see the list above)"

step "ibv_rc_pingpong -g 1: RC SEND/RECV between two processes"
two_process rc_pingpong 18515 60 \
  ibv_rc_pingpong -d "$dev" -g 1 -p 18515 -s 4096 -n 200 \
  --client ibv_rc_pingpong -d "$dev" -g 1 -p 18515 -s 4096 -n 200 127.0.0.1

step "ib_write_bw -x 1: RC RDMA WRITE between two processes"
two_process write_bw 18516 90 \
  ib_write_bw -d "$dev" -x 1 -p 18516 -s 65536 -n 500 -F \
  --client ib_write_bw -d "$dev" -x 1 -p 18516 -s 65536 -n 500 -F "$ip4"

if [ $failed = 0 ]; then echo "PASS: rdma_vm_smoke"; exit 0; fi
echo "FAILED: rdma_vm_smoke"; exit 1

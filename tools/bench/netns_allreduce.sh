#!/usr/bin/env bash
# 4-rank all-reduce over rate-limited links: network namespaces + veth + bridge + tc tbf.
#
#   tools/bench/netns_allreduce.sh [options]      (as root; see --help)
#
# Topology (a star, like ranks on one switch): a hub namespace dq-bench-hub holds a bridge
# dqbr; each rank r has a namespace dq-bench-r whose only link dqr<r> (198.18.0.<r+1>/24, RFC
# 2544 benchmark range) is a veth to dqh<r> on the bridge. Nothing is created in the host
# namespace, so host interfaces, routes and firewalls are untouched. Each rank link is shaped
# to RATE in both directions with a token bucket filter on each end's egress: dqr<r> (rank ->
# switch) and dqh<r> (switch -> rank), i.e. what a rank's NIC port sees.
#
# Runs, in this order, in one invocation (each with a bounded timeout):
#   iperf3      one TCP stream rank 0 -> rank 1 (with --nodes: the first rank of node 1), the
#               link's reference rate
#   pt-float    dynamiq-perf FP32 pass-through (no shim): checks correctness and busbw
#   pt-bf16     dynamiq-perf BF16 pass-through (no shim)
#   bf16        allreduce_client.py: the FP32 data converted to BF16, plain NCCL (no shim)
#   fp32        allreduce_client.py: the FP32 data, plain NCCL (no shim)
#   dynamiq5    allreduce_client.py: FP32 through the shim, DYNAMIQ_CODEC=dynamiq BITS=5
#   mxfp8       allreduce_client.py: FP32 through the shim, DYNAMIQ_CODEC=mxfp8
# and writes OUT/result.json, OUT/result.md and each run's log. -c reducescatter runs every mode's
# collective as ncclReduceScatter instead (each rank's SIZE is the send buffer).
#
# Nodes (--nodes N --local L: N x L ranks): each rank's dqr<r> link is its rail (its own NIC to
# the switch, shaped as above; address 198.18.0.<r+1>/32), and the ranks of node k also share an
# unshaped bridge dqn<k> in the hub namespace (each rank's veth dqn<r>, no address). Host routes
# in each rank namespace send a node-mate's address over dqn<r> and everyone else's over the rail,
# so node-local traffic never touches a shaped link, and the link counters (dqr*) count the
# inter-node bytes alone. Each rank gets NCCL_HOSTID=node<k>. A mode name may carry settings
# after '+': +flat / +node (DYNAMIQ_HIERARCHY), +ring / +butterfly (DYNAMIQ_TOPO), e.g.
# dynamiq5+flat+ring, dynamiq5+node, engine-bf16+node.
set -u -o pipefail

usage() {
  cat <<'EOF'
usage: netns_allreduce.sh [-B BUILD] [-o OUT] [-r RATE] [-s SIZE] [-k ITERS] [-w WARMUP]
                          [-m MODES] [-t TIMEOUT] [-d sample|synthetic] [-P PREFIX]
                          [-e NAME=VALUE]... [-c allreduce|reducescatter]
                          [--nodes N --local L]
                          [--no-limit] [--no-idle-restart] [--cc NAME] [--keep] [--down]
  -B BUILD    meson build folder (default: build)
  -o OUT      output folder (default: /tmp/dq-netns-bench)
  -r RATE     tc rate of each rank link, each direction (default 1gbit; tc syntax)
  -s SIZE     FP32 bytes per rank (default 256M)
  -k ITERS    timed all-reduces per mode (default 5); the median is reported
  -w WARMUP   untimed all-reduces before them (default 1)
  -m MODES    comma list from iperf3,pt-float,pt-bf16,bf16,fp32,dynamiq5,mxfp8
              (default iperf3,pt-float,pt-bf16,bf16,dynamiq5,mxfp8)
  -t TIMEOUT  seconds allowed to each run (default 900)
  -d DATA     allreduce_client.py input: sample (real gradients, tiled) or synthetic
  -P PREFIX   namespace names PREFIX-0..3 and PREFIX-hub (default dq-bench)
  -e N=V      extra setting for the shim runs (dynamiq5, mxfp8, engine-bf16), e.g.
              -e DYNAMIQ_TOPO=ring -e DYNAMIQ_BLOCK_BYTES=4M (repeatable)
  -c COLL     allreduce (default) or reducescatter: the collective every mode runs (the
              client's --collective, dynamiq-perf's -c); SIZE is each rank's send buffer
  --nodes N   N nodes of --local L ranks each (N x L ranks; default: 4 ranks, no nodes): each
              rank's link is its rail, node-mates reach each other unshaped
  --local L   ranks per node (with --nodes)
  --no-limit  no tc shaping (same namespaces): shows whether the CPU or the link limits
  --no-idle-restart  net.ipv4.tcp_slow_start_after_idle=0 in every rank namespace: a TCP
              connection idle for one RTO keeps its congestion window instead of starting slow
              again (shows how much of the spread between invocations is that restart)
  --cc NAME   TCP congestion control of every rank namespace (net.ipv4.tcp_congestion_control)
              (default reno; 'host' keeps what a new namespace inherits from the host). A
              loss-based control (reno, like Linux's default cubic) lets the shaper queue; BBR
              overruns the token bucket after each idle gap, the shaper drops, and calls spread
              by up to 50% between invocations (docs/results/speed.md). Recorded in the result.
  --keep      leave the namespaces up at the end (tear down with: netns_allreduce.sh --down)
  --down      only tear down what an earlier run left
EOF
}

BUILD=build
OUT=/tmp/dq-netns-bench
RATE=1gbit
SIZE=256M
ITERS=5
WARMUP=1
MODES=iperf3,pt-float,pt-bf16,bf16,dynamiq5,mxfp8
RUN_TIMEOUT=900
DATA=sample
LIMIT=1
IDLE_RESTART=1
TCP_CC=reno
TCP_CC_ASKED=0
KEEP=0
DOWN_ONLY=0
PREFIX=dq-bench
COLLECTIVE=allreduce
SHIM_EXTRA=()
NODES=0
LOCAL=1
while [ $# -gt 0 ]; do
  case "$1" in
    -B) BUILD=$2; shift 2 ;;
    -o) OUT=$2; shift 2 ;;
    -r) RATE=$2; shift 2 ;;
    -s) SIZE=$2; shift 2 ;;
    -k) ITERS=$2; shift 2 ;;
    -w) WARMUP=$2; shift 2 ;;
    -m) MODES=$2; shift 2 ;;
    -t) RUN_TIMEOUT=$2; shift 2 ;;
    -d) DATA=$2; shift 2 ;;
    -P) PREFIX=$2; shift 2 ;;
    -e) SHIM_EXTRA+=("$2"); shift 2 ;;
    -c) COLLECTIVE=$2; shift 2 ;;
    --nodes) NODES=$2; shift 2 ;;
    --local) LOCAL=$2; shift 2 ;;
    --no-limit) LIMIT=0; shift ;;
    --no-idle-restart) IDLE_RESTART=0; shift ;;
    --cc) TCP_CC=$2; TCP_CC_ASKED=1; shift 2 ;;
    --keep) KEEP=1; shift ;;
    --down) DOWN_ONLY=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "netns_allreduce.sh: unknown argument '$1'" >&2; usage >&2; exit 2 ;;
  esac
done

for value in "$NODES" "$LOCAL"; do
  [[ "$value" =~ ^[0-9]+$ ]] || { echo "netns_allreduce.sh: '$value' is not a count" >&2; exit 2; }
done
if [ "$NODES" -gt 0 ]; then
  if [ "$NODES" -lt 2 ] || [ "$LOCAL" -lt 1 ] || [ $((NODES * LOCAL)) -gt 16 ]; then
    echo "netns_allreduce.sh: --nodes must be >= 2, --local >= 1, at most 16 ranks" >&2
    exit 2
  fi
  NRANKS=$((NODES * LOCAL))
else
  NRANKS=4
fi
readonly NODES LOCAL NRANKS
case "$COLLECTIVE" in
  allreduce|reducescatter) ;;
  *) echo "netns_allreduce.sh: -c must be allreduce or reducescatter, not '$COLLECTIVE'" >&2; exit 2 ;;
esac
readonly COLLECTIVE
[[ "$PREFIX" =~ ^[A-Za-z0-9][A-Za-z0-9_.-]{0,30}$ ]] || { echo "bad -P '$PREFIX'" >&2; exit 2; }
readonly PREFIX
for value in "$ITERS" "$WARMUP" "$RUN_TIMEOUT"; do
  [[ "$value" =~ ^[0-9]+$ ]] || { echo "netns_allreduce.sh: '$value' is not a count" >&2; exit 2; }
done
readonly HUB=$PREFIX-hub
readonly BRIDGE=dqbr
readonly SUBNET=198.18.0
# tbf: burst 256 KiB holds four 64 KiB GSO segments (a veth passes TSO/GSO super-packets; a
# bucket smaller than one would make tbf split or drop them) and is 2.1 ms at 1 Gbit/s;
# latency 20 ms bounds the queue (about 2.5 MB at 1 Gbit/s) so TCP sees drops, not bufferbloat.
readonly TBF_BURST=256kb
readonly TBF_LATENCY=20ms
SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
SRC_ROOT=$(cd "$SCRIPT_DIR/../.." && pwd)
readonly SCRIPT_DIR SRC_ROOT

say() { echo "netns_allreduce: $*" >&2; }
die() { say "$*"; exit 1; }

ns_names() {
  local r
  for ((r = 0; r < NRANKS; r++)); do echo "$PREFIX-$r"; done
  echo "$HUB"
}

# Removes only what this script creates (its namespace names); deleting a namespace deletes
# its veth ends and bridge with it.
teardown() {
  local ns
  for ns in $(ns_names); do
    if ip netns list | awk '{print $1}' | grep -qx -- "$ns"; then
      ip netns pids "$ns" 2>/dev/null | while read -r pid; do
        [ -n "$pid" ] && kill -TERM "$pid" 2>/dev/null
      done
      ip netns del "$ns" 2>/dev/null || say "could not delete namespace $ns"
    fi
  done
}

[ "$(id -u)" = 0 ] || die "needs root (network namespaces and tc)"
if [ "$DOWN_ONLY" = 1 ]; then teardown; exit 0; fi

for tool in ip tc python3 timeout; do
  command -v "$tool" >/dev/null || die "$tool not found"
done
# The client needs numpy, which tools/setup.sh installs into the repository's .venv, not into the
# system python3 (Debian 12's is externally managed): put that environment first when it exists.
venv_bin=$SCRIPT_DIR/../../.venv/bin
if [ -x "$venv_bin/python3" ] && ! python3 -c 'import numpy' 2>/dev/null; then
  PATH=$(cd "$venv_bin" && pwd):$PATH
fi
python3 -c 'import numpy' 2>/dev/null || die "python3 has no numpy (run tools/setup.sh)"
case "$BUILD" in /*) ;; *) BUILD=$(pwd)/$BUILD ;; esac
RUN=$BUILD/tools/dynamiq-run
PERF=$BUILD/tools/dynamiq-perf
SHIM=$BUILD/shim/libdynamiq.so
CLIENT=$SCRIPT_DIR/allreduce_client.py
[ -x "$RUN" ] || die "$RUN not found: build first (meson compile -C $BUILD)"
[ -f "$BUILD/tools/cpu-nccl/libnccl.so.2" ] || die "$BUILD/tools/cpu-nccl/libnccl.so.2 not built"
mkdir -p "$OUT" || die "cannot create $OUT"
# This script's own files from an earlier run in OUT (a stale metrics file would be read back).
rm -f "$OUT"/*.log "$OUT"/metrics-*.json "$OUT"/result.json "$OUT"/result.md \
  "$OUT"/results.jsonl "$OUT"/setup.txt
: >"$OUT/results.jsonl"

JOB_PID=
# shellcheck disable=SC2317  # invoked by the traps
stop_job() {  # the running job, if any: SIGTERM (timeout passes it on to dynamiq-run), then KILL
  [ -n "$JOB_PID" ] || return 0
  kill -TERM "$JOB_PID" 2>/dev/null
  local i
  for ((i = 0; i < 200; i++)); do  # at most 20 s (dynamiq-run's grace is 5 s)
    kill -0 "$JOB_PID" 2>/dev/null || break
    sleep 0.1
  done
  kill -KILL "$JOB_PID" 2>/dev/null
  wait "$JOB_PID" 2>/dev/null
  JOB_PID=
}

# shellcheck disable=SC2317  # invoked by the EXIT trap
on_exit() {
  local code=$?
  stop_job
  if [ "$KEEP" = 1 ]; then
    say "namespaces kept (--keep); remove them with: $0 --down"
  else
    teardown
  fi
  exit "$code"
}
trap on_exit EXIT
trap 'say "interrupted"; stop_job; exit 130' INT
trap 'say "terminated"; stop_job; exit 143' TERM HUP

setup() {
  local r ns
  teardown  # a previous run that was killed outright may have left its namespaces
  ip netns add "$HUB" || die "ip netns add $HUB failed"
  ip -n "$HUB" link set lo up
  ip -n "$HUB" link add "$BRIDGE" type bridge || die "cannot create bridge in $HUB"
  ip -n "$HUB" link set "$BRIDGE" up
  for ((r = 0; r < NRANKS; r++)); do
    ns=$PREFIX-$r
    ip netns add "$ns" || die "ip netns add $ns failed"
    ip -n "$ns" link set lo up
    if [ "$IDLE_RESTART" = 0 ]; then
      ip netns exec "$ns" sysctl -qw net.ipv4.tcp_slow_start_after_idle=0 ||
        die "cannot set tcp_slow_start_after_idle in $ns"
    fi
    # The default is a preference: where a namespace may not pick reno, the host's is kept
    # (the result records which ran); a control asked for with --cc must be the one that runs.
    if [ "$TCP_CC" != host ] &&
      ! ip netns exec "$ns" sysctl -qw net.ipv4.tcp_congestion_control="$TCP_CC" 2>/dev/null; then
      [ "$TCP_CC_ASKED" = 1 ] && die "cannot set tcp_congestion_control=$TCP_CC in $ns"
      say "$ns: cannot select TCP $TCP_CC; keeping the host's congestion control"
    fi
    ip -n "$HUB" link add "dqh$r" type veth peer name "dqr$r" netns "$ns" ||
      die "cannot create veth dqh$r/dqr$r"
    ip -n "$HUB" link set "dqh$r" master "$BRIDGE"
    ip -n "$HUB" link set "dqh$r" up
    if [ "$NODES" -gt 0 ]; then
      ip -n "$ns" addr add "$SUBNET.$((r + 1))/32" dev "dqr$r"
    else
      ip -n "$ns" addr add "$SUBNET.$((r + 1))/24" dev "dqr$r"
    fi
    ip -n "$ns" link set "dqr$r" up
    if [ "$LIMIT" = 1 ]; then
      tc -n "$ns" qdisc replace dev "dqr$r" root tbf rate "$RATE" burst "$TBF_BURST" \
        latency "$TBF_LATENCY" || die "tc on dqr$r failed"
      tc -n "$HUB" qdisc replace dev "dqh$r" root tbf rate "$RATE" burst "$TBF_BURST" \
        latency "$TBF_LATENCY" || die "tc on dqh$r failed"
    fi
  done
  [ "$NODES" -gt 0 ] && setup_nodes
  # Reachability: every other rank opens a TCP connection to rank 0 (no ping needed; the
  # bridge may need a moment before it forwards).
  ip netns exec "$PREFIX-0" timeout 20 python3 -c '
import socket, sys
s = socket.create_server((sys.argv[1], 5299)); s.settimeout(15)
for _ in range(int(sys.argv[2])): s.accept()[0].close()' "$SUBNET.1" "$((NRANKS - 1))" &
  local server=$!
  for ((r = 1; r < NRANKS; r++)); do
    ip netns exec "$PREFIX-$r" timeout 15 python3 -c '
import socket, sys, time
for attempt in range(100):
    try:
        socket.create_connection((sys.argv[1], 5299), timeout=1).close(); sys.exit(0)
    except OSError:
        time.sleep(0.1)
sys.exit(1)' "$SUBNET.1" || die "rank $r cannot reach $SUBNET.1"
  done
  wait "$server" || die "rank 0 did not see every rank connect"
}

# The node bridges and the host routes (--nodes): node-mates over dqn<r>, others over the rail.
setup_nodes() {
  local k r s ns dev
  for ((k = 0; k < NODES; k++)); do
    ip -n "$HUB" link add "dqn$k" type bridge || die "cannot create bridge dqn$k"
    ip -n "$HUB" link set "dqn$k" up
  done
  for ((r = 0; r < NRANKS; r++)); do
    ns=$PREFIX-$r
    ip -n "$HUB" link add "dqm$r" type veth peer name "dqn$r" netns "$ns" ||
      die "cannot create veth dqm$r/dqn$r"
    ip -n "$HUB" link set "dqm$r" master "dqn$((r / LOCAL))"
    ip -n "$HUB" link set "dqm$r" up
    ip -n "$ns" link set "dqn$r" up
    # The replies to a node-mate leave by dqn<r> although the address sits on dqr<r>.
    ip netns exec "$ns" sysctl -qw net.ipv4.conf.all.rp_filter=0 net.ipv4.conf.default.rp_filter=0
    for ((s = 0; s < NRANKS; s++)); do
      [ "$s" = "$r" ] && continue
      dev=dqr$r
      [ $((s / LOCAL)) = $((r / LOCAL)) ] && dev=dqn$r
      ip -n "$ns" route add "$SUBNET.$((s + 1))/32" dev "$dev" || die "route in $ns failed"
    done
  done
}

# Bytes sent by every rank link so far (sum of dqr* tx counters).
tx_bytes() {
  local r total=0 b
  for ((r = 0; r < NRANKS; r++)); do
    b=$(ip netns exec "$PREFIX-$r" cat "/sys/class/net/dqr$r/statistics/tx_bytes")
    total=$((total + b))
  done
  echo "$total"
}

# TCP segments retransmitted by every rank namespace so far (Tcp RetransSegs of /proc/net/snmp)
# and packets the shapers dropped (tbf drops of every dqr* and dqh*): what a congestion control
# that overruns the token bucket costs.
tcp_retrans() {
  local r total=0 n
  for ((r = 0; r < NRANKS; r++)); do
    n=$(ip netns exec "$PREFIX-$r" awk '/^Tcp: [0-9]/ { print $13 }' /proc/net/snmp)
    total=$((total + ${n:-0}))
  done
  echo "$total"
}
tbf_drops() {
  local r total=0 n
  for ((r = 0; r < NRANKS; r++)); do
    for n in $(tc -s -n "$PREFIX-$r" qdisc show dev "dqr$r" | awk '/dropped/ { print $7 }' | tr -d ,) \
      $(tc -s -n "$HUB" qdisc show dev "dqh$r" | awk '/dropped/ { print $7 }' | tr -d ,); do
      total=$((total + n))
    done
  done
  echo "$total"
}

load() { cut -d' ' -f1-3 /proc/loadavg; }

run_iperf3() {
  command -v iperf3 >/dev/null || { say "iperf3 not installed; skipping"; return 0; }
  local log=$OUT/iperf3.log
  # Over a shaped link: rank 1, or with nodes the first rank of node 1 (over both rails).
  local peer=1
  [ "$NODES" -gt 0 ] && peer=$LOCAL
  ip netns exec "$PREFIX-$peer" timeout 60 iperf3 -s -1 -B "$SUBNET.$((peer + 1))" -p 5201 >"$OUT/iperf3-server.log" 2>&1 &
  local server=$!
  local i
  for ((i = 0; i < 100; i++)); do  # until the server listens (at most 10 s)
    ip netns exec "$PREFIX-$peer" ss -Hltn "sport = :5201" | grep -q . && break
    sleep 0.1
  done
  say "iperf3: load $(load)"
  ip netns exec "$PREFIX-0" timeout 30 iperf3 -c "$SUBNET.$((peer + 1))" -p 5201 -t 5 -O 1 -J >"$log" 2>&1
  wait "$server" 2>/dev/null
  grep -q '"sum_received"' "$log" || { say "iperf3 failed (see $log)"; return 1; }
  python3 - "$log" "$OUT/results.jsonl" "$(load)" "$peer" <<'EOF'
import json, sys
d = json.load(open(sys.argv[1]))
bps = d["end"]["sum_received"]["bits_per_second"]
rec = {"label": "iperf3", "received_gbit_s": bps / 1e9, "load": sys.argv[3],
       "peer_rank": int(sys.argv[4])}
print(f"iperf3 rank0 -> rank{sys.argv[4]}: {bps / 1e9:.3f} Gbit/s")
open(sys.argv[2], "a").write(json.dumps(rec) + "\n")
EOF
}

# launch LABEL [VAR=VALUE ...] -- PROGRAM ARGS: one 4-rank job, one rank per namespace.
launch() {
  local label=$1; shift
  local rank_env=(--rank-env "DYNAMIQ_NET_IFNAME==dqr{rank}")
  while [ $# -gt 0 ] && [ "$1" != -- ]; do rank_env+=(--rank-env "$1"); shift; done
  shift
  local log=$OUT/$label.log
  local before after start end rc
  # Fake nodes: NCCL_HOSTID=node<RANK / LOCAL> (dynamiq-run sets RANK; --rank-env knows {rank}
  # only).
  if [ "$NODES" -gt 0 ]; then
    # shellcheck disable=SC2016  # expanded by the rank's shell, where RANK is set
    set -- /bin/sh -c 'NCCL_HOSTID=node$((RANK / '"$LOCAL"')) exec "$@"' sh "$@"
  fi
  before=$(tx_bytes)
  local retrans_before drops_before
  retrans_before=$(tcp_retrans)
  drops_before=$(tbf_drops)
  start=$(date +%s.%N)
  say "$label: load $(load); $*"
  # In the background + wait, so that a signal to this script runs its trap at once.
  timeout --kill-after=15 "$((RUN_TIMEOUT + 30))" \
    "$RUN" --cpu-nccl -n "$NRANKS" --timeout "$RUN_TIMEOUT" --grace 5 \
    --rank-netns "$PREFIX-{rank}" --master-addr "$SUBNET.1" "${rank_env[@]}" -- "$@" \
    >"$log" 2>&1 &
  JOB_PID=$!
  wait "$JOB_PID"
  rc=$?
  JOB_PID=
  end=$(date +%s.%N)
  after=$(tx_bytes)
  LAST_RETRANS=$(($(tcp_retrans) - retrans_before))
  LAST_DROPS=$(($(tbf_drops) - drops_before))
  LAST_WALL=$(awk -v a="$start" -v b="$end" 'BEGIN { printf "%.3f", b - a }')
  echo "# exit $rc, wall $LAST_WALL s, link tx bytes $((after - before)), TCP retransmits $LAST_RETRANS, tbf drops $LAST_DROPS, load after $(load)" >>"$log"
  [ "$rc" = 0 ] || say "$label: exit $rc (see $log)"
  LAST_TX=$((after - before))
  return "$rc"
}

run_perf() {
  local label=$1 dtype=$2
  [ -x "$PERF" ] || { say "$PERF not built; skipping $label"; return 0; }
  launch "$label" -- "$PERF" -b "$SIZE" -e "$SIZE" -d "$dtype" -o sum -n "$ITERS" -w "$WARMUP" \
    -c 1 -a 3 -c "$COLLECTIVE"
  local rc=$?
  python3 - "$OUT/$label.log" "$OUT/results.jsonl" "$label" "$dtype" "$(load)" "$rc" \
    "$LAST_TX" "$COLLECTIVE" <<'EOF'
import json, re, sys
log, out, label, dtype, load, rc, tx, collective = sys.argv[1:9]
rec = {"label": label, "tool": "dynamiq-perf", "collective": collective, "dtype": dtype,
       "exit": int(rc), "load_after": load, "link_tx_bytes": int(tx)}
for line in open(log):
    m = re.match(r"^\[0\]\s+(\d+)\s+(\d+)\s+(\S+)\s+(\S+)\s+(-?\d+)\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)",
                 line)
    if m:
        rec.update(bytes=int(m.group(1)), time_us=float(m.group(6)), algbw_gb_s=float(m.group(7)),
                   busbw_gb_s=float(m.group(8)), wrong=m.group(9))
    if "Results identical on all ranks" in line:
        rec["identical_on_all_ranks"] = (None if "n/a" in line
                                         else line.rstrip().endswith("yes"))
if "busbw_gb_s" in rec:
    print(f"{label}: {rec['time_us'] / 1e6:.3f} s per {collective} (mean, slowest rank), "
          f"busbw {rec['busbw_gb_s']:.3f} GB/s = {rec['busbw_gb_s'] * 8:.3f} Gbit/s, "
          f"#wrong {rec['wrong']}")
open(out, "a").write(json.dumps(rec) + "\n")
EOF
}

run_client() {
  local label=$1 dtype=$2; shift 2
  launch "$label" "$@" -- python3 "$CLIENT" --bytes "$SIZE" --dtype "$dtype" --iters "$ITERS" \
    --warmup "$WARMUP" --data "$DATA" --label "$label" --collective "$COLLECTIVE"
  local rc=$?
  python3 - "$OUT/$label.log" "$OUT/results.jsonl" "$label" "$(load)" "$rc" "$LAST_TX" \
    "$LAST_WALL" "$OUT" "$LAST_RETRANS" "$LAST_DROPS" <<'EOF'
import glob, json, os, sys
log, out, label, load, rc, tx, wall, folder, retrans, drops = sys.argv[1:11]
rec = {"label": label, "tool": "allreduce_client.py", "exit": int(rc), "load_after": load,
       "link_tx_bytes": int(tx), "job_wall_s": float(wall), "tcp_retrans_segs": int(retrans),
       "tbf_drops": int(drops)}
for line in open(log):
    if line.startswith("[0] RESULT "):
        rec.update(json.loads(line[len("[0] RESULT "):]))
metrics = sorted(glob.glob(os.path.join(folder, f"metrics-{label}-*.json")))
if metrics:
    rec["shim_metrics_rank0"] = json.load(open(metrics[0]))
if "median_s" in rec:
    print(f"{label}: median {rec['median_s']:.3f} s per {rec['collective']} over {rec['iters']} "
          f"(min {rec['min_s']:.3f}, max {rec['max_s']:.3f}), vNMSE {rec['vnmse']}, "
          f"identical {rec['identical_on_all_ranks']}, link tx {int(tx) / 2**20:.1f} MiB, "
          f"TCP retransmits {retrans}, tbf drops {drops}")
open(out, "a").write(json.dumps(rec) + "\n")
EOF
}


say "start $(date -u +%FT%TZ); host $(uname -r); $(nproc) cores; load $(load)"
setup
say "namespaces up: $(ns_names | tr '\n' ' '); rate ${RATE} per direction per rank link$([ "$LIMIT" = 1 ] || echo ' (NOT LIMITED: --no-limit)')"
{
  echo "date_utc=$(date -u +%FT%TZ) kernel=$(uname -r) cores=$(nproc) load_start=$(load)"
  echo "nodes=$NODES local=$LOCAL ranks=$NRANKS"
  echo "tcp_cc=$(ip netns exec "$PREFIX-0" sysctl -n net.ipv4.tcp_congestion_control)"
  echo "rate=$RATE limit=$LIMIT idle_restart=$IDLE_RESTART burst=$TBF_BURST latency=$TBF_LATENCY size=$SIZE iters=$ITERS warmup=$WARMUP data=$DATA collective=$COLLECTIVE"
  echo "git=$(git -C "$SRC_ROOT" rev-parse --short HEAD 2>/dev/null) shim_extra=${SHIM_EXTRA[*]}"
  for ((r = 0; r < NRANKS; r++)); do tc -n "$PREFIX-$r" qdisc show dev "dqr$r"; done
} >"$OUT/setup.txt"

failed=0
IFS=, read -ra mode_list <<<"$MODES"
for mode in "${mode_list[@]}"; do
  case "$mode" in
    iperf3) run_iperf3 || failed=1 ;;
    pt-float) run_perf pt-float float || failed=1 ;;
    pt-bf16) run_perf pt-bf16 bfloat16 || failed=1 ;;
    bf16) run_client bf16 bfloat16 || failed=1 ;;
    fp32) run_client fp32 float || failed=1 ;;
    dynamiq5|mxfp8|engine-bf16|dynamiq5+*|mxfp8+*|engine-bf16+*)
      if [ ! -f "$SHIM" ]; then
        say "$SHIM not built yet; skipping $mode"
        echo "{\"label\": \"$mode\", \"skipped\": \"$SHIM not built\"}" >>"$OUT/results.jsonl"
        continue
      fi
      # The shim is preloaded into the ranks only (a --rank-env), not into the launcher.
      shim=("LD_PRELOAD=$SHIM" DYNAMIQ_ENABLE=1 "DYNAMIQ_METRICS_FILE=$OUT/metrics-$mode-%r.json")
      case "${mode%%+*}" in
        dynamiq5) shim+=(DYNAMIQ_CODEC=dynamiq DYNAMIQ_BITS=5) ;;
        mxfp8) shim+=(DYNAMIQ_CODEC=mxfp8) ;;
        engine-bf16) shim+=(DYNAMIQ_CODEC=bf16) ;;
      esac
      # Settings after '+' in the mode's name, after -e (the mode's own win).
      suffixes=()
      IFS=+ read -ra suffixes <<<"${mode#"${mode%%+*}"}"
      extra=()
      for suffix in "${suffixes[@]}"; do
        case "$suffix" in
          '') ;;
          flat|node) extra+=("DYNAMIQ_HIERARCHY=$suffix") ;;
          ring|butterfly) extra+=("DYNAMIQ_TOPO=$suffix") ;;
          *) say "unknown mode suffix '+$suffix' in $mode"; failed=1; continue 2 ;;
        esac
      done
      run_client "$mode" float "${shim[@]}" "${SHIM_EXTRA[@]}" "${extra[@]}" || failed=1 ;;
    *) say "unknown mode '$mode'"; failed=1 ;;
  esac
done

python3 "$SCRIPT_DIR/summarize.py" "$OUT/results.jsonl" "$OUT/setup.txt" "$OUT/result.json" \
  "$OUT/result.md" || failed=1
say "done $(date -u +%FT%TZ); load $(load); results in $OUT/result.md"
exit $failed

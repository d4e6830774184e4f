#!/usr/bin/env bash
# The fault campaign: N ranks (2..8, random per run) of fault_worker through
# the preloaded shim on the CPU NCCL, each rank in its own network namespace, and one fault per
# run injected at a random call (random rank, random time) of a job that mixes compressed and
# pass-through all-reduces:
#   kill     the rank is SIGKILLed
#   stop     the rank is SIGSTOPped for longer than the timeout (T + 0.3..1.5 s), then SIGCONTed
#   cut      the rank's link is cut (its veth set down in its namespace) for the rest of the run
#   slow     the rank's link is made slow for 1..4 s, both ends of its veth: netem delay 20..200 ms
#            (+-25%) and loss 1..20%; without netem in the kernel, tbf at 1..30 Mbit/s with a
#            20..200 ms queue plus iptables dropping 1..25% of its packets (in and out) at random
#   reset    TCP connections of the rank are reset: ss -K on one random established connection,
#            or on all of them, or iptables REJECT --reject-with tcp-reset on its INPUT for
#            0.2..1 s (without iptables: ss -K only)
#   foreign  a foreign process (its own namespace on the same bridge, or the rank's namespace for
#            a loopback listener) connects to every listening TCP port of the job's processes
#            and sends 0..64 KiB of /dev/urandom, holding each connection 0..1.5 s; in a quarter
#            of the runs during ncclCommInitRank (as soon as a rank listens), else at a call
# Per run, every rank must either complete every call with a verified, rank-identical result or
# return an error; a rank that survives the fault (all but the killed or stopped one) must
# return its error within DYNAMIQ_TIMEOUT_MS + MARGIN of the injection (slow: of the end of the
# slow period; the stopped rank itself: of its SIGCONT). A rank still running at the run's hard
# deadline, or returning later than that limit, is a hang; it is killed, never waited on.
#
#   tests/faults/campaign.sh [-k KINDS] [-r RUNS] [-n RANKS] [-B BUILD] [-o OUT] [-t TIMEOUT_MS]
#                            [-m MARGIN_MS] [-s SEED] [--keep]
# Exit: 0 no hang, no wrong result, no crash; 1 otherwise (or the no-fault baseline failed);
# 2 usage; 77 cannot run here (not root, no `ip netns`, no tc, ss or the build).
#
# Harness self-tests (environment): DQF_WORKER_TIMEOUT_MS gives the ranks another
# DYNAMIQ_TIMEOUT_MS than the limit is computed from (a long one must be reported as hangs);
# DQF_CORRUPT_RANK=R DQF_CORRUPT_CALL=K make rank R alter its result of call K (must be reported
# as a wrong result); DQF_FOREIGN_INIT_ONE_IN=N: 1 in N foreign runs strike during the bootstrap
# (default 4); DQF_PAUSE_SELFTEST_MS=T stops every rank and this script for T ms right after the
# injection, as a machine-wide pause would (the run must be judged as without it, the pause
# reported); DQF_PAUSE_MS (default 1500): the gap between the wait loop's turns taken for a pause.
#
# Topology (as tools/bench/netns_allreduce.sh): a hub namespace PREFIX-hub with a bridge; rank r
# in PREFIX-r<r> with one veth dqr (198.18.0.<r+1>/24) to h<r> on the bridge; the foreign
# process in PREFIX-x (198.18.0.200/24). IPv6 is disabled in every namespace, so no address
# outside 198.18.0.0/15 (and each namespace's loopback) exists; nothing is created in the host
# namespace. PREFIX includes this script's pid, so two campaigns never share a namespace.
set -u -o pipefail

usage() {
  sed -n '/^#   tests\/faults\/campaign.sh/,/^# 2 usage/p' "$0" | sed 's/^# \{0,1\}//'
  cat <<'EOF'
  -k KINDS     comma list of kill,stop,cut,slow,reset,foreign (default all)
  -r RUNS      runs per kind (default 100)
  -n RANKS     ranks per run, 2..8 (default: random 2..8 per run)
  -B BUILD     meson build folder (default: build)
  -o OUT       output folder (default /tmp/dq-faults)
  -t MS        DYNAMIQ_TIMEOUT_MS of the ranks (default 2000)
  -m MS        margin over the timeout allowed to an error return (default 3000)
  -s SEED      seed of the campaign's random choices (default: from the clock)
  --keep       keep every run's folder (default: only those of runs that failed a check)
EOF
}

KINDS=kill,stop,cut,slow,reset,foreign
RUNS=100
FIXED_N=
BUILD=build
OUT=/tmp/dq-faults
TIMEOUT_MS=2000
MARGIN_MS=3000
SEED=$(( $(date +%s) % 32768 ))
KEEP=0
while [ $# -gt 0 ]; do
  case "$1" in
    -k) KINDS=$2; shift 2 ;;
    -r) RUNS=$2; shift 2 ;;
    -n) FIXED_N=$2; shift 2 ;;
    -B) BUILD=$2; shift 2 ;;
    -o) OUT=$2; shift 2 ;;
    -t) TIMEOUT_MS=$2; shift 2 ;;
    -m) MARGIN_MS=$2; shift 2 ;;
    -s) SEED=$2; shift 2 ;;
    --keep) KEEP=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "campaign.sh: unknown argument '$1'" >&2; usage >&2; exit 2 ;;
  esac
done
for v in "$RUNS" "$TIMEOUT_MS" "$MARGIN_MS" "$SEED"; do
  [[ "$v" =~ ^[0-9]+$ ]] || { echo "campaign.sh: '$v' is not a number" >&2; exit 2; }
done
[ -z "$FIXED_N" ] || [[ "$FIXED_N" =~ ^[2-8]$ ]] || { echo "campaign.sh: -n must be 2..8" >&2; exit 2; }
[ "$TIMEOUT_MS" -ge 100 ] || { echo "campaign.sh: -t must be >= 100 (DYNAMIQ_TIMEOUT_MS)" >&2; exit 2; }
IFS=, read -ra KIND_LIST <<<"$KINDS"
for k in "${KIND_LIST[@]}"; do
  case "$k" in kill|stop|cut|slow|reset|foreign) ;; *) echo "campaign.sh: unknown kind '$k'" >&2; exit 2 ;; esac
done

exec 3>&2  # the real stderr: say() writes there while the runs' shell noise goes to a file
say() { echo "campaign: $*" >&3; }
skip() { echo "SKIP: $*"; exit 77; }

# --- can this machine run it? ---------------------------------------------------------------
[ "$(id -u)" = 0 ] || skip "needs root (network namespaces, tc, ss -K)"
for tool in ip tc ss timeout head awk; do
  command -v "$tool" >/dev/null || skip "$tool not found (apt-get install -y iproute2 coreutils)"
done
case "$BUILD" in /*) ;; *) BUILD=$(pwd)/$BUILD ;; esac
WORKER=$BUILD/tests/faults/fault_worker
SHIM=$BUILD/shim/libdynamiq.so
PLUGIN=$BUILD/plugin/abi/libnccl-net-dynamiq.so
for f in "$WORKER" "$SHIM" "$PLUGIN"; do
  [ -e "$f" ] || skip "$f not built (ninja -C $BUILD)"
done
HAVE_IPTABLES=0
command -v iptables >/dev/null && HAVE_IPTABLES=1
HAVE_NETEM=0

readonly PREFIX=dqf$$
readonly HUB=$PREFIX-hub FOREIGN_NS=$PREFIX-x SUBNET=198.18.0 MAXN=8
readonly LIMIT_MS=$((TIMEOUT_MS + MARGIN_MS))
readonly PAUSE_US=${DQF_PAUSE_MS:-1500}000  # a gap between the wait loop's turns that is a pause
# gdb, when installed: the thread stacks of a hung rank are kept in its run folder (stacksR.txt).
GDB=$(command -v gdb || true)
HOOKS=
RANDOM=$SEED

# --- cleanup in every path -------------------------------------------------------------------
PIDS=()         # the current run's ranks
HELPERS=()      # the current run's foreign connectors and timers
kill_run() {
  local p
  for p in "${PIDS[@]}" "${HELPERS[@]}"; do
    [ -n "$p" ] || continue
    kill -CONT "$p" 2>/dev/null
    kill -KILL "$p" 2>/dev/null
  done
  for p in "${PIDS[@]}" "${HELPERS[@]}"; do [ -n "$p" ] && wait "$p" 2>/dev/null; done
  PIDS=()
  HELPERS=()
}
teardown() {
  local ns
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^$PREFIX-"); do
    ip netns pids "$ns" 2>/dev/null | while read -r p; do [ -n "$p" ] && kill -KILL "$p" 2>/dev/null; done
    ip netns del "$ns" 2>/dev/null || say "could not delete namespace $ns"
  done
}
on_exit() {
  local code=$?
  kill_run
  teardown
  exit "$code"
}
trap on_exit EXIT
trap 'say interrupted; exit 130' INT
trap 'say terminated; exit 143' TERM HUP

# --- topology --------------------------------------------------------------------------------
new_ns() {  # NAME: a namespace with lo up and IPv6 off (no link-local addresses, no ND traffic)
  ip netns add "$1" || return 1
  ip netns exec "$1" sysctl -qw net.ipv6.conf.all.disable_ipv6=1 net.ipv6.conf.default.disable_ipv6=1 \
    >/dev/null 2>&1
  ip -n "$1" link set lo up
}
attach() {  # NS HUBSIDE ADDR: veth dqr in NS (ADDR/24) to HUBSIDE on the bridge
  ip -n "$HUB" link add "$2" type veth peer name dqr netns "$1" || return 1
  ip -n "$HUB" link set "$2" master br0 && ip -n "$HUB" link set "$2" up &&
    ip -n "$1" addr add "$3/24" dev dqr && ip -n "$1" link set dqr up
}
setup() {
  local r
  new_ns "$HUB" || skip "ip netns add failed (no network namespaces here?)"
  ip -n "$HUB" link add br0 type bridge || return 1
  ip -n "$HUB" link set br0 up
  for ((r = 0; r < MAXN; r++)); do
    new_ns "$PREFIX-r$r" && attach "$PREFIX-r$r" "h$r" "$SUBNET.$((r + 1))" || return 1
  done
  new_ns "$FOREIGN_NS" && attach "$FOREIGN_NS" hx "$SUBNET.200" || return 1
  # netem (sch_netem) gives the slow link its delay and loss; kernels without it (this project's
  # CI kernel has none) get tbf's rate limit and queueing delay plus iptables' random drops.
  if tc -n "$PREFIX-r0" qdisc add dev lo root netem delay 1ms 2>/dev/null; then
    HAVE_NETEM=1
    tc -n "$PREFIX-r0" qdisc del dev lo root
  fi
  tc -n "$PREFIX-r0" qdisc add dev lo root tbf rate 1mbit burst 16kb latency 10ms 2>/dev/null ||
    skip "neither tc netem nor tc tbf works here"
  tc -n "$PREFIX-r0" qdisc del dev lo root
  # Only 198.18.0.0/15 (and loopback) anywhere.
  local bad
  bad=$(for ns in $(ip netns list | awk '{print $1}' | grep -E "^$PREFIX-"); do
          ip -n "$ns" -o addr show | awk '{print $4}'; done |
        grep -vE '^(198\.1[89]\.|127\.)' || true)
  [ -z "$bad" ] || { say "unexpected addresses: $bad"; return 1; }
}
restore_links() {  # undo every link fault on rank r's link
  local r=$1
  ip -n "$PREFIX-r$r" link set dqr up 2>/dev/null
  tc -n "$PREFIX-r$r" qdisc del dev dqr root 2>/dev/null
  tc -n "$HUB" qdisc del dev "h$r" root 2>/dev/null
  if [ "$HAVE_IPTABLES" = 1 ]; then
    ip netns exec "$PREFIX-r$r" iptables -w -F INPUT 2>/dev/null
    ip netns exec "$PREFIX-r$r" iptables -w -F OUTPUT 2>/dev/null
  fi
  return 0
}

# --- one run ---------------------------------------------------------------------------------
now_us() { local t=$EPOCHREALTIME; echo "${t/./}"; }
# Current time in microseconds into the variable named $1 (no fork).
stamp() { local t=$EPOCHREALTIME; printf -v "$1" '%s' "${t/./}"; }
# Alive and not a zombie (a finished child stays a zombie until waited on).
alive() {
  local st
  [ -r "/proc/$1/stat" ] || return 1
  read -r st </proc/"$1"/stat 2>/dev/null || return 1
  st=${st##*) }
  [ "${st:0:1}" != Z ]
}

start_rank() {  # DIR N R CALLS SEED
  ip netns exec "$PREFIX-r$3" env -i PATH=/usr/bin:/bin RANK="$3" WORLD_SIZE="$2" \
    LD_PRELOAD="$SHIM" DYNAMIQ_ENABLE=1 DYNAMIQ_MIN_BYTES=64K DYNAMIQ_TIMEOUT_MS="$TIMEOUT_MS" \
    DYNAMIQ_CPU_NCCL_NET_PLUGIN="$PLUGIN" DYNAMIQ_NET_IFNAME==dqr \
    ${DQF_WORKER_TIMEOUT_MS:+DYNAMIQ_TIMEOUT_MS=$DQF_WORKER_TIMEOUT_MS} \
    ${HOOKS:+${DQF_CORRUPT_RANK:+DQF_CORRUPT_RANK=$DQF_CORRUPT_RANK}} \
    ${HOOKS:+${DQF_CORRUPT_CALL:+DQF_CORRUPT_CALL=$DQF_CORRUPT_CALL}} \
    "$WORKER" "$1" "$4" "$5" >"$1/out$3.log" 2>&1 &
  PIDS[$3]=$!
}

# The job's listening TCP sockets, as "NS ADDR PORT" lines (ss -ltnp, by the ranks' pids).
listeners() {  # N [FIRST]: ranks FIRST..N-1 (FIRST default 0)
  local r n=$1
  for ((r = ${2:-0}; r < n; r++)); do
    ip netns exec "$PREFIX-r$r" ss -Hltnp 2>/dev/null |
      awk -v pid="pid=${PIDS[$r]}," -v ns="$PREFIX-r$r" 'index($0, pid) {
        a = $4; p = a; sub(/.*:/, "", p); sub(/:[0-9]+$/, "", a); gsub(/[][]/, "", a)
        print ns, a, p }'
  done
}

foreign_connect() {  # NS ADDR PORT: from the foreign namespace (or NS for a loopback listener)
  local ns=$1 addr=$2 port=$3 where bytes hold
  case "$addr" in
    198.18.*) where=$FOREIGN_NS ;;
    127.*|::1) where=$ns ;;
    *) where=$ns; addr=127.0.0.1 ;;  # 0.0.0.0 or *: reachable on the rank's own loopback
  esac
  case $((RANDOM % 4)) in
    0) bytes=0 ;;
    1) bytes=$((1 + RANDOM % 64)) ;;
    2) bytes=$((64 + RANDOM % 4033)) ;;
    *) bytes=$((4096 + (RANDOM * 2) % 61441)) ;;
  esac
  hold=$((RANDOM % 1500))
  echo "foreign: from $where to $addr:$port, $bytes random bytes, held $hold ms" >>"$RUN_DIR/inject.log"
  ip netns exec "$where" timeout -s KILL 4 bash -c \
    'exec 3<>"/dev/tcp/$0/$1" || exit 1; head -c "$2" /dev/urandom >&3; sleep "$3"' \
    "$addr" "$port" "$bytes" "$(printf '%d.%03d' $((hold / 1000)) $((hold % 1000)))" \
    >>"$RUN_DIR/inject.log" 2>&1 &
  HELPERS+=($!)
}

# Makes rank v's link slow, both directions (its veth's two ends). With netem: delay 20..200 ms
# (+-25%) and loss 1..20%. Without: tbf at 1..30 Mbit/s with a queue of 20..200 ms (queueing
# delay, tail drops past it) and iptables dropping 1..25% of the rank's packets at random.
slow_link() {  # VICTIM DURATION_MS
  local v=$1 d loss rate
  if [ "$HAVE_NETEM" = 1 ]; then
    d=$((20 + RANDOM % 181)) loss=$((1 + RANDOM % 20))
    INJ_METHOD="netem-delay${d}ms-loss${loss}%-for${2}ms"
    tc -n "$PREFIX-r$v" qdisc replace dev dqr root netem delay "${d}ms" "$((d / 4))ms" loss "${loss}%"
    tc -n "$HUB" qdisc replace dev "h$v" root netem delay "${d}ms" "$((d / 4))ms" loss "${loss}%"
    return
  fi
  rate=$((1 + RANDOM % 30)) d=$((20 + RANDOM % 181)) loss=$((1 + RANDOM % 25))
  INJ_METHOD="tbf${rate}mbit-queue${d}ms"
  tc -n "$PREFIX-r$v" qdisc replace dev dqr root tbf rate "${rate}mbit" burst 32kb latency "${d}ms"
  tc -n "$HUB" qdisc replace dev "h$v" root tbf rate "${rate}mbit" burst 32kb latency "${d}ms"
  if [ "$HAVE_IPTABLES" = 1 ]; then
    INJ_METHOD="$INJ_METHOD-loss${loss}%"
    local chain
    for chain in INPUT OUTPUT; do
      ip netns exec "$PREFIX-r$v" iptables -w -I "$chain" -m statistic --mode random \
        --probability "0.$(printf '%02d' "$loss")" -j DROP
    done
  fi
  INJ_METHOD="$INJ_METHOD-for${2}ms"
}

reset_connections() {  # VICTIM N
  local v=$1 mode lines line l p closed
  # 0, 1: one connection (ss -K); 2: all of the rank's connections (ss -K); 3: iptables.
  mode=$((RANDOM % (HAVE_IPTABLES ? 4 : 3)))
  if [ "$mode" = 3 ]; then
    local hold_ms=$((200 + RANDOM % 801))
    echo "reset: iptables INPUT REJECT tcp-reset in $PREFIX-r$v for $hold_ms ms" >>"$RUN_DIR/inject.log"
    stamp T_INJ  # before the rule: it acts as soon as it is in, before iptables returns
    ip netns exec "$PREFIX-r$v" iptables -w -I INPUT -p tcp -j REJECT --reject-with tcp-reset
    (sleep "$(printf '%d.%03d' $((hold_ms / 1000)) $((hold_ms % 1000)))"
     ip netns exec "$PREFIX-r$v" iptables -w -F INPUT) &
    HELPERS+=($!)
    INJ_METHOD=iptables
    return
  fi
  # Established connections of the victim's process.
  mapfile -t lines < <(ip netns exec "$PREFIX-r$v" ss -Htnp state established 2>/dev/null |
    awk -v pid="pid=${PIDS[$v]}," 'index($0, pid) { l = $3; p = $4; sub(/.*:/, "", l); sub(/.*:/, "", p); print l, p }')
  if [ "${#lines[@]}" = 0 ]; then
    echo "reset: no established connection found" >>"$RUN_DIR/inject.log"
    stamp T_INJ
    INJ_METHOD=none
    return
  fi
  if [ "$mode" = 2 ]; then
    echo "reset: ss -K every established connection of the rank (${#lines[@]})" >>"$RUN_DIR/inject.log"
    stamp T_INJ
    closed=$(ip netns exec "$PREFIX-r$v" ss -K -Htn state established 2>&1)
    INJ_METHOD=ss-all
  else
    line=${lines[$((RANDOM % ${#lines[@]}))]}
    l=${line% *}
    p=${line#* }
    echo "reset: ss -K the connection sport $l dport $p" >>"$RUN_DIR/inject.log"
    stamp T_INJ
    closed=$(ip netns exec "$PREFIX-r$v" ss -K -Htn state established "( sport = :$l and dport = :$p )" 2>&1)
    INJ_METHOD=ss-one
  fi
  echo "$closed" >>"$RUN_DIR/inject.log"
  # ss -K prints each socket it closed: none means the kernel refused (no
  # CONFIG_INET_DIAG_DESTROY) or the connection was gone already.
  [ -n "$closed" ] || INJ_METHOD="$INJ_METHOD(nothing-closed)"
}

# Runs one job with one fault. Appends one line to $OUT/runs.tsv.
run_one() {
  local kind=$1 idx=$2 n v calls k r
  n=${FIXED_N:-$((2 + RANDOM % 7))}
  v=$((RANDOM % n))
  calls=$((320 / n))
  k=$((2 + RANDOM % (calls * 3 / 4 - 2)))  # the last quarter is slack for the injection
  local seed=$((RANDOM * 32768 + RANDOM))
  RUN_DIR=$OUT/runs/$kind-$idx
  rm -rf "$RUN_DIR"
  mkdir -p "$RUN_DIR"
  PIDS=()
  HELPERS=()
  T_INJ=0 T_CONT=0 SLOW_END=0 INJ_METHOD=$kind
  local t_start injected=0 extra_ms=8000 stop_ms=0 slow_ms=0
  stamp t_start
  for ((r = 0; r < n; r++)); do start_rank "$RUN_DIR" "$n" "$r" "$calls" "$seed"; done

  # A quarter of the foreign runs strike during ncclCommInitRank (the bootstrap, while the ranks
  # accept their peers): as soon as a rank of the job listens. The others: wait (at most 30 s)
  # until the victim is in call k, then a random 0..30 ms more.
  local p=-1 i targets=()
  if [ "$kind" = foreign ] && [ $((RANDOM % ${DQF_FOREIGN_INIT_ONE_IN:-4})) = 0 ]; then
    k=-1  # the victim's own listening sockets, as soon as there are any (one ss per turn)
    for ((i = 0; i < 1500; i++)); do
      mapfile -t targets < <(listeners $((v + 1)) "$v")
      [ "${#targets[@]}" -gt 0 ] && break
      alive "${PIDS[$v]}" || break
      sleep 0.005
    done
  fi
  for ((i = 0; i < 3000; i++)); do
    read -r p 2>/dev/null <"$RUN_DIR/progress$v" || p=-1
    [[ "$p" =~ ^-?[0-9]+$ ]] || p=-1
    [ "$p" -ge "$k" ] && break
    alive "${PIDS[$v]}" || break
    sleep 0.01
  done
  if [ "$p" -ge "$k" ] && [ "$p" -lt "$calls" ] && alive "${PIDS[$v]}"; then
    [ "$k" -ge 0 ] && sleep "$(printf '0.%03d' $((RANDOM % 31)))"
    read -r p 2>/dev/null <"$RUN_DIR/progress$v"
    injected=1
    case "$kind" in
      kill)
        stamp T_INJ
        kill -KILL "${PIDS[$v]}" ;;
      stop)
        stop_ms=$((TIMEOUT_MS + 300 + RANDOM % 1201))
        extra_ms=$((extra_ms + stop_ms))
        stamp T_INJ
        kill -STOP "${PIDS[$v]}"
        INJ_METHOD="stop-${stop_ms}ms" ;;
      cut)
        stamp T_INJ
        ip -n "$PREFIX-r$v" link set dqr down ;;
      slow)
        slow_ms=$((1000 + RANDOM % 3001))
        extra_ms=$((extra_ms + slow_ms))
        stamp T_INJ
        slow_link "$v" "$slow_ms"
        SLOW_END=$((T_INJ + slow_ms * 1000)) ;;
      reset)
        reset_connections "$v" ;;
      foreign)
        local try
        for ((try = 0; try < 3 && ${#targets[@]} == 0; try++)); do
          mapfile -t targets < <(listeners "$n")
          [ "${#targets[@]}" -gt 0 ] && break
          # None found: record what ss saw, then look again.
          for ((r = 0; r < n; r++)); do
            echo "ss -ltnp in $PREFIX-r$r (rank pid ${PIDS[$r]}):"
            ip netns exec "$PREFIX-r$r" ss -Hltnp 2>&1
          done >>"$RUN_DIR/inject.log"
          sleep 0.02
        done
        echo "foreign: ${#targets[@]} listening sockets" >>"$RUN_DIR/inject.log"
        stamp T_INJ
        local tgt
        for tgt in "${targets[@]}"; do foreign_connect $tgt; done
        INJ_METHOD="foreign-${#targets[@]}ports" ;;
    esac
  fi

  echo "injected at $T_INJ us (0: not injected); victim rank $v in call $p" >>"$RUN_DIR/inject.log"
  # Wait for every rank, until the hard deadline (bounded loop: at most ~2000 s of 10 ms turns).
  local deadline
  if [ "$injected" = 1 ]; then
    deadline=$((T_INJ + (LIMIT_MS + extra_ms) * 1000))
  else
    deadline=$(( $(now_us) + (LIMIT_MS + extra_ms) * 1000 ))
  fi
  # A machine-wide pause (the VM snapshotted or stopped by its host: the guest's kernel logs
  # "crng reseeded due to virtual machine fork") freezes this loop with the ranks, then shows as
  # a jump of the clock: every deadline passed at once, and the ranks killed before they ran
  # again. A turn of this loop sleeps 10 ms, so a gap of more than PAUSE_US between turns is such
  # a pause: the deadline and the verdict's limit move by it (at most 120 s a run in all), and
  # the run says so. A hang of the ranks alone never pauses this loop.
  local now prev left hung=() codes=() paused=0
  stamp prev
  if [ -n "${DQF_PAUSE_SELFTEST_MS:-}" ] && [ "$injected" = 1 ]; then  # a pause, simulated
    for ((r = 0; r < n; r++)); do kill -STOP "${PIDS[$r]}" 2>/dev/null; done
    sleep "$(printf '%d.%03d' $((DQF_PAUSE_SELFTEST_MS / 1000)) $((DQF_PAUSE_SELFTEST_MS % 1000)))"
    for ((r = 0; r < n; r++)); do  # the stopped victim stays stopped, as after a real pause
      [ "$stop_ms" -gt 0 ] && [ "$r" = "$v" ] && continue
      kill -CONT "${PIDS[$r]}" 2>/dev/null
    done
  fi
  for ((i = 0; i < 200000; i++)); do
    stamp now
    if [ $((now - prev)) -gt "$PAUSE_US" ] && [ "$paused" -lt 120000000 ]; then
      paused=$((paused + now - prev))
      deadline=$((deadline + now - prev))
      echo "machine paused: $(((now - prev) / 1000)) ms between turns at $now us" >>"$RUN_DIR/inject.log"
    fi
    prev=$now
    if [ "$stop_ms" -gt 0 ] && [ "$T_CONT" = 0 ] && [ "$now" -ge $((T_INJ + stop_ms * 1000)) ]; then
      kill -CONT "${PIDS[$v]}"
      stamp T_CONT
    fi
    if [ "$slow_ms" -gt 0 ] && [ "$now" -ge "$SLOW_END" ]; then
      restore_links "$v"
      slow_ms=0
    fi
    left=0
    for ((r = 0; r < n; r++)); do alive "${PIDS[$r]}" && left=$((left + 1)); done
    [ "$left" = 0 ] && break
    [ "$now" -ge "$deadline" ] && break
    sleep 0.01
  done
  for ((r = 0; r < n; r++)); do
    hung[$r]=0
    if alive "${PIDS[$r]}"; then
      hung[$r]=1
      kill -CONT "${PIDS[$r]}" 2>/dev/null
      # A hang's evidence: every thread's stack, before the kill (gdb where present, 30 s at most).
      if [ -n "$GDB" ]; then
        timeout 30 "$GDB" -p "${PIDS[$r]}" -batch -nx -ex 'set pagination off' \
          -ex 'thread apply all bt' >"$RUN_DIR/stacks$r.txt" 2>&1
      fi
      kill -KILL "${PIDS[$r]}" 2>/dev/null
    fi
    wait "${PIDS[$r]}" 2>/dev/null
    codes[$r]=$?
    echo "M $r ${codes[$r]} ${hung[$r]}" >>"$RUN_DIR/meta.txt"
  done
  kill_run
  restore_links "$v"
  local t_end
  stamp t_end

  # The verdict.
  local verdict
  verdict=$(awk -v n="$n" -v kind="$kind" -v victim="$v" -v tinj="$T_INJ" -v tcont="$T_CONT" \
      -v slowend="$SLOW_END" -v limit="$((LIMIT_MS * 1000 + paused))" -v injected="$injected" \
      -v at="$p" '
    FNR == 1 { r = FILENAME; sub(/.*rank/, "", r); sub(/\.txt$/, "", r) }
    $1 == "M" { code[$2] = $3; hung[$2] = $4; next }
    $1 == "C" {
      k = $2; kindof[k] = $3
      if ($4 == 0) {
        if ($8 != "1") { wrong++; why = why " rank" r ":call" k ":unverified" }
        if ((k in hash) && hash[k] != $9) { wrong++; why = why " rank" r ":call" k ":hash-differs" }
        hash[k] = $9
      } else { failk[r] = k; failstart[r] = $5 }
    }
    $1 == "E" { est[r] = $2; et[r] = $3 }
    END {
      hangs = 0; errs = 0; oks = 0; crash = 0; before = 0; det = -1; worst = -1e18
      for (r = 0; r < n; r++) {
        survivor = !((kind == "kill" || kind == "stop") && r == victim)
        if (kind == "kill" && r == victim && injected) continue
        if (hung[r] == 1) { hangs++; why = why " rank" r ":no-return"; continue }
        if (est[r] == "wrong") { wrong++; continue }
        if (est[r] == "ok") { oks++; continue }
        if (est[r] == "error" || est[r] == "initfail") {
          errs++
          if (!injected || et[r] < tinj) { before++; why = why " rank" r ":error-before-fault"; continue }
          ref = tinj
          if (kind == "stop" && r == victim) ref = tcont
          if (kind == "slow") ref = slowend
          if (et[r] - ref > worst) worst = et[r] - ref
          if (et[r] > ref + limit) { hangs++; why = why sprintf(" rank%d:late(%.3fs)", r, (et[r] - ref) / 1e6) }
          if (survivor && et[r] - tinj > det) det = et[r] - tinj
          continue
        }
        crash++; why = why " rank" r ":exit" code[r] "-without-return"
      }
      if (hangs) outcome = "hang"
      else if (wrong) outcome = "wrong"
      else if (crash) outcome = "crash"
      else if (!injected) outcome = "not-injected"
      else if (before) outcome = "error-before-fault"
      else if (errs) outcome = "error"
      else outcome = "completed"
      atk = (at in kindof) ? kindof[at] : (at == -1 ? "i" : "-")
      printf "%s\t%d\t%d\t%d\t%d\t%s\t%.3f\t%s\t%s\n", outcome, hangs, wrong + 0, crash, errs, atk,
             det < 0 ? -1 : det / 1e6, worst == -1e18 ? "-" : sprintf("%.3f", worst / 1e6),
             why == "" ? "-" : substr(why, 2)
    }' "$RUN_DIR/meta.txt" "$RUN_DIR"/rank*.txt)
  local wall_ms=$(( (t_end - t_start) / 1000 ))
  printf '%s\t%d\t%d\t%d\t%d\t%d\t%s\t%s\t%d\n' "$kind" "$idx" "$n" "$v" "$k" "$calls" \
    "$INJ_METHOD" "$verdict" "$wall_ms" >>"$OUT/runs.tsv"
  local outcome=${verdict%%$'\t'*}
  [ "$paused" -gt 0 ] && say "$kind run $idx: the machine paused $((paused / 1000)) ms; deadline and limit extended by it"
  case "$outcome" in
    completed|error) [ "$KEEP" = 1 ] || rm -rf "$RUN_DIR" ;;
    *) say "$kind run $idx: $outcome ($(echo "$verdict" | cut -f8)); kept $RUN_DIR" ;;
  esac
}

# --- the campaign ----------------------------------------------------------------------------
mkdir -p "$OUT" || exit 1
rm -rf "$OUT/runs" "$OUT/runs.tsv" "$OUT/summary.md" "$OUT/shell.log"
mkdir -p "$OUT/runs"
setup || { say "network setup failed"; exit 1; }
printf 'kind\trun\tranks\tvictim\tcall\tcalls\tmethod\toutcome\thangs\twrong\tcrashes\terrors\tfault_in\tdetect_s\treturn_after_ref_s\twhy\twall_ms\n' \
  >"$OUT/runs.tsv"
T0=$(now_us)
say "seed $SEED; DYNAMIQ_TIMEOUT_MS=$TIMEOUT_MS, margin $MARGIN_MS ms; kinds $KINDS; $RUNS runs each; out $OUT"

# Baseline: 8 ranks (or -n), no fault: must complete, every call verified and rank-identical.
BASE_N=${FIXED_N:-8}
RUN_DIR=$OUT/runs/baseline
mkdir -p "$RUN_DIR"
for ((r = 0; r < BASE_N; r++)); do start_rank "$RUN_DIR" "$BASE_N" "$r" 60 1; done
base_ok=1
for ((r = 0; r < BASE_N; r++)); do
  for ((i = 0; i < 6000; i++)); do alive "${PIDS[$r]}" || break; sleep 0.01; done
  alive "${PIDS[$r]}" && base_ok=0
  kill -KILL "${PIDS[$r]}" 2>/dev/null
  wait "${PIDS[$r]}" || base_ok=0
done
PIDS=()
base_hashes=$(awk '$1 == "C" { print $2, $9 }' "$RUN_DIR"/rank*.txt | sort -u | awk '{print $1}' | uniq -d | wc -l)
[ "$base_hashes" = 0 ] || base_ok=0
if [ "$base_ok" != 1 ]; then
  say "the no-fault baseline ($BASE_N ranks) failed; see $RUN_DIR"
  tail -n 5 "$RUN_DIR"/out*.log >&2
  exit 1
fi
rm -rf "$RUN_DIR"
say "baseline: $BASE_N ranks, 60 calls, no fault: completed, verified, rank-identical"

HOOKS=1  # the self-test hooks (DQF_CORRUPT_*) apply to the campaign's runs, not the baseline
# bash reports each killed victim ("line N: PID Killed ...") whenever it reaps it: that, and any
# other stray message of the runs, goes to shell.log instead of the summary.
exec 2>>"$OUT/shell.log"
for kind in "${KIND_LIST[@]}"; do
  for ((run = 1; run <= RUNS; run++)); do
    run_one "$kind" "$run"
  done
  say "$kind: $RUNS runs done ($(( ($(now_us) - T0) / 1000000 )) s so far)"
done

exec 2>&3
# --- the table -------------------------------------------------------------------------------
awk -F'\t' -v limit="$LIMIT_MS" -v tmo="$TIMEOUT_MS" -v margin="$MARGIN_MS" -v kinds="$KINDS" '
  NR == 1 { next }
  { k = $1; runs[k]++; out[k, $8]++; if ($14 + 0 > det[k]) det[k] = $14 + 0
    if ($15 != "-" && (!(k in worst) || $15 + 0 > worst[k])) worst[k] = $15 + 0
    if ($8 != "not-injected") at[k, $13]++; wall[k] += $17 }
  END {
    print "| fault | runs | hangs | wrong results | crashes | errors (clean) | completed | errors before the fault | not injected | fault during compressed / pass-through call / init | slowest detection (s) | latest return after its reference (s) | limit (s) | mean wall per run (s) |"
    print "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    split(kinds, ks, ",")
    for (i = 1; i in ks; i++) {
      k = ks[i]
      if (!(k in runs)) continue
      printf "| %s | %d | %d | %d | %d | %d | %d | %d | %d | %d / %d / %d | %.2f | %s | %.1f | %.1f |\n", k, runs[k],
        out[k, "hang"], out[k, "wrong"], out[k, "crash"], out[k, "error"], out[k, "completed"],
        out[k, "error-before-fault"], out[k, "not-injected"], at[k, "c"], at[k, "p"], at[k, "i"], det[k],
        (k in worst) ? sprintf("%.2f", worst[k]) : "-", limit / 1000, wall[k] / runs[k] / 1000
    }
    printf "\nDYNAMIQ_TIMEOUT_MS=%d, margin %d ms: every rank that returns an error must return it within %.1f s of its reference: the injection (the stopped rank: its SIGCONT; slow: the end of the slow period). Slowest detection: injection to the last surviving rank'"'"'s error return, over the runs.\n", tmo, margin, limit / 1000
  }' "$OUT/runs.tsv" | tee "$OUT/summary.md"
say "total $(( ($(now_us) - T0) / 1000000 )) s; per-run records in $OUT/runs.tsv"
bad=$(awk -F'\t' 'NR > 1 && ($8 == "hang" || $8 == "wrong" || $8 == "crash")' "$OUT/runs.tsv" | wc -l)
if [ "$bad" != 0 ]; then
  say "FAIL: $bad runs with a hang, a wrong result or a crash"
  exit 1
fi
echo "PASS"
exit 0

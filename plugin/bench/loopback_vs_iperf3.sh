#!/usr/bin/env bash
# Loopback throughput of the net plugin against iperf3, same machine, same run.
#   plugin/bench/loopback_vs_iperf3.sh [BUILD_DIR] [SECONDS] [ROUNDS]
# Each round runs iperf3 (one TCP stream, 127.0.0.1) and then the plugin benchmark (one
# connection, 4 MiB messages, 8 in flight, DYNAMIQ_NET_NSOCKS sockets); rounds alternate so
# both see the same background load. Prints every measurement, the means and their ratio.
set -euo pipefail

build=${1:-build}
seconds=${2:-5}
rounds=${3:-3}
plugin="$build/plugin/abi/libnccl-net-dynamiq.so"
bench="$build/tests/plugin/net_loopback_bench"
[[ -f "$plugin" ]] || { echo "missing $plugin (build first)" >&2; exit 2; }
[[ -x "$bench" ]] || { echo "missing $bench (configure with -Dtests=true)" >&2; exit 2; }
command -v iperf3 >/dev/null || { echo "iperf3 not installed (apt-get install -y iperf3)" >&2; exit 2; }

iperf_gbps() {
  local json="" gbps="" attempt port server
  for attempt in 1 2 3 4 5; do  # a fresh port per attempt: another user may hold one
    port=$((20000 + RANDOM % 20000))
    iperf3 -s -1 -B 127.0.0.1 -p "$port" >/dev/null 2>&1 &
    server=$!
    sleep 1  # let the server bind, even on a loaded machine
    json=$(timeout $((seconds + 30)) iperf3 -c 127.0.0.1 -p "$port" -t "$seconds" -J 2>/dev/null) || json=""
    kill "$server" 2>/dev/null || true
    wait "$server" 2>/dev/null || true
    # iperf3 -J reports failures (e.g. "server is busy") as JSON too: keep only a real result.
    gbps=$(python3 -c 'import json,sys; print("%.3f" % (json.load(sys.stdin)["end"]["sum_received"]["bits_per_second"] / 1e9))' <<<"$json" 2>/dev/null) || gbps=""
    [[ -n "$gbps" ]] && { echo "$gbps"; return; }
  done
  echo "iperf3 failed 5 times" >&2
  exit 1
}

plugin_gbps() {
  DYNAMIQ_NET_IFNAME=lo DYNAMIQ_NET_PLUGIN_PATH="$plugin" \
    timeout $((seconds + 120)) "$bench" --size $((4 << 20)) --inflight 8 --seconds "$seconds" | sed -n 's/.*gbps=//p'
}

ours=()
theirs=()
for ((r = 1; r <= rounds; ++r)); do
  i=$(iperf_gbps)
  p=$(plugin_gbps)
  theirs+=("$i")
  ours+=("$p")
  echo "round $r: iperf3 ${i} Gbit/s   dynamiq plugin ${p} Gbit/s"
done
python3 - "${#ours[@]}" "${ours[@]}" "${theirs[@]}" <<'PY'
import sys
n = int(sys.argv[1])
ours = [float(x) for x in sys.argv[2:2 + n]]
theirs = [float(x) for x in sys.argv[2 + n:]]
mo, mt = sum(ours) / n, sum(theirs) / n
print(f"mean: iperf3 {mt:.3f} Gbit/s, dynamiq plugin {mo:.3f} Gbit/s, ratio {mo / mt:.2f} (target >= 0.70)")
PY

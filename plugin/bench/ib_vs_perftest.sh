#!/usr/bin/env bash
# Verbs loopback bandwidth of the net plugin (DYNAMIQ_NET_BACKEND=ib, tests/plugin's loopback
# benchmark: one connection, 8 messages in flight, every buffer registered once as NCCL does and
# as ib_write_bw does; DQ_BENCH_REGISTER=0 passes no handle, so the plugin registers per request)
# against perftest's `ib_write_bw -x 1`, in the same soft-RoCE guest run (tests/vm/run.sh),
# alternating per round so both see the same load.
#   plugin/bench/ib_vs_perftest.sh [BUILD_DIR] [ROUNDS] [SECONDS]
# BUILD_DIR must be configured with -Dnative=false (the guest CPU has no AVX-512). Prints one
# line per size and round, in MiB/s (2^20 bytes per second, as perftest prints it).
set -euo pipefail

root=$(cd "$(dirname "$0")/../.." && pwd)
build=$(cd "${1:-build}" && pwd)
rounds=${2:-3}
seconds=${3:-5}
if [[ "${DYNAMIQ_VM:-}" != 1 ]]; then
  exec "$root/tests/vm/run.sh" --timeout 1200 -- "$root/plugin/bench/ib_vs_perftest.sh" \
    "$build" "$rounds" "$seconds"
fi
# shellcheck source=../../tests/vm/perftest_ref.sh
. "$root/tests/vm/perftest_ref.sh"
for size in 65536 4194304; do
  for ((r = 1; r <= rounds; r++)); do
    ref=$(perftest_bw write "$size")
    gbps=$(DYNAMIQ_NET_BACKEND=ib DYNAMIQ_NET_TIMEOUT_MS=10000 \
      DYNAMIQ_NET_PLUGIN_PATH="$build/plugin/abi/libnccl-net-dynamiq.so" \
      timeout $((seconds + 120)) "$build/tests/plugin/net_loopback_bench" --size "$size" \
      --inflight 8 --seconds "$seconds" --register "${DQ_BENCH_REGISTER:-1}" |
      sed -n 's/.*gbps=//p')
    mib=$(python3 -c "import sys; print('%.2f' % (float(sys.argv[1]) * 1e9 / 8 / 2**20))" "$gbps")
    echo "size=$size round=$r ib_write_bw_MiB/s=$ref plugin_ib_MiB/s=$mib"
  done
done

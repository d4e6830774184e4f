#!/usr/bin/env bash
# Verbs loopback bandwidth of the net plugin against its queue pairs per connection
# (DYNAMIQ_NET_IB_QPS): tests/plugin's loopback benchmark (one connection, 8 messages in flight,
# buffers registered once) with 1, 2 and 4 QPs, alternating within each round so every setting
# sees the same load, in one soft-RoCE guest run (tests/vm/run.sh).
#   [DQ_BENCH_SIZES="BYTES ..."] plugin/bench/ib_qps_sweep.sh [BUILD_DIR] [ROUNDS] [SECONDS]
# BUILD_DIR must be configured with -Dnative=false (the guest CPU has no AVX-512). Prints one
# line per size, round and QP count, in MiB/s (2^20 bytes per second).
set -euo pipefail

root=$(cd "$(dirname "$0")/../.." && pwd)
build=$(cd "${1:-build}" && pwd)
rounds=${2:-3}
seconds=${3:-3}
if [[ "${DYNAMIQ_VM:-}" != 1 ]]; then
  exec "$root/tests/vm/run.sh" --timeout 1200 -- "$root/plugin/bench/ib_qps_sweep.sh" \
    "$build" "$rounds" "$seconds"
fi
for size in ${DQ_BENCH_SIZES:-4194304 33554432}; do
  for ((r = 1; r <= rounds; r++)); do
    for qps in 1 2 4; do
      gbps=$(DYNAMIQ_NET_BACKEND=ib DYNAMIQ_NET_TIMEOUT_MS=10000 DYNAMIQ_NET_IB_QPS=$qps \
        DYNAMIQ_NET_PLUGIN_PATH="$build/plugin/abi/libnccl-net-dynamiq.so" \
        timeout $((seconds + 120)) "$build/tests/plugin/net_loopback_bench" --size "$size" \
        --inflight 8 --seconds "$seconds" --register 1 | sed -n 's/.*gbps=//p')
      mib=$(python3 -c "import sys; print('%.2f' % (float(sys.argv[1]) * 1e9 / 8 / 2**20))" "$gbps")
      echo "size=$size round=$r qps=$qps plugin_ib_MiB/s=$mib"
    done
  done
done

// Time per ncclAllReduce of `bytes` on a fake NCCL, to measure what the preloaded shim adds to
// a call it passes through. Usage: bench_passthrough BYTES CALLS  (prints ns per call).
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "common/nccl_api.h"

int main(int argc, char** argv) {
  const size_t bytes = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 1024;
  const long calls = argc > 2 ? std::atol(argv[2]) : 1000000;
  ncclUniqueId id;
  ncclGetUniqueId(&id);
  ncclComm_t comm;
  if (ncclCommInitRank(&comm, 4, id, 0) != ncclSuccess) return 1;
  std::vector<float> send(bytes / 4 + 1, 1.0f), recv(bytes / 4 + 1);
  for (int i = 0; i < 1000; ++i)  // warm-up (includes the shim's handshake)
    ncclAllReduce(send.data(), recv.data(), bytes / 4, ncclFloat32, ncclSum, comm, nullptr);
  double best = 1e30;
  for (int rep = 0; rep < 5; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    for (long i = 0; i < calls; ++i)
      ncclAllReduce(send.data(), recv.data(), bytes / 4, ncclFloat32, ncclSum, comm, nullptr);
    const double ns =
        std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count() /
        calls;
    if (ns < best) best = ns;
  }
  std::printf("%.1f\n", best);
  ncclCommDestroy(comm);
  return 0;
}

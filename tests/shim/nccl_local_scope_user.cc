// A library that uses NCCL as a framework's extension module does: nccl_local_scope loads it with
// RTLD_LOCAL, so NCCL, its dependency, is in that local scope only and not after the preloaded
// shim in the global one. Each rank makes a communicator, runs one compressed all-reduce and
// checks its sum and the shim's counters.
#include <dlfcn.h>

#include <cstddef>
#include <cstdio>
#include <vector>

#include "common/nccl_api.h"

extern "C" __attribute__((visibility("default"))) int dq_local_scope_unique_id(ncclUniqueId* id) {
  return ncclGetUniqueId(id) == ncclSuccess ? 0 : 1;
}

// 0 when the call succeeded, was compressed and its sum is right to the codec's error; otherwise
// the step that failed.
extern "C" __attribute__((visibility("default"))) int dq_local_scope_all_reduce(
    const ncclUniqueId* id, int rank, int nranks) {
  ncclComm_t comm = nullptr;
  if (ncclCommInitRank(&comm, nranks, *id, rank) != ncclSuccess) return 10;
  constexpr size_t kCount = size_t{1} << 16;
  std::vector<float> in(kCount), out(kCount);
  auto pattern = [](size_t i) { return 0.25f * static_cast<float>(static_cast<int>(i % 13) - 6); };
  for (size_t i = 0; i < kCount; ++i) in[i] = static_cast<float>(rank + 1) * pattern(i);
  if (ncclAllReduce(in.data(), out.data(), kCount, ncclFloat32, ncclSum, comm, nullptr) !=
      ncclSuccess)
    return 11;
  // The error as the project measures it (vNMSE: squared error over squared sum). A sum missing
  // a rank's share is 0.11 or more (rank 0's third of it); the codec's on this input, 0.012.
  const double ranks_sum = nranks * (nranks + 1) / 2.0;
  double error = 0, energy = 0;
  for (size_t i = 0; i < kCount; ++i) {
    const double exact = ranks_sum * pattern(i);
    error += (out[i] - exact) * (out[i] - exact);
    energy += exact * exact;
  }
  if (!(error <= 0.05 * energy)) {
    std::fprintf(stderr, "rank %d: vNMSE %.3g\n", rank, error / energy);
    return 12;
  }
  using Counters = int (*)(void*, unsigned long long*, unsigned long long*);
  const auto counters = reinterpret_cast<Counters>(dlsym(RTLD_DEFAULT, "dynamiqCommCounters"));
  unsigned long long rerouted = 0, passed = 0;
  if (counters == nullptr || counters(comm, &rerouted, &passed) != 0) return 13;
  if (rerouted != 1) return 14;
  return ncclCommDestroy(comm) == ncclSuccess ? 0 : 15;
}

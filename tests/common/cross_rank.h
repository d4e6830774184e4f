// Whether every rank of a communicator holds the same thing, in one small all-reduce.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/fnv1a.h"
#include "common/nccl_api.h"

namespace dq::test {

// True when the `bytes` at `data` are the same on every rank of comm: one MAX all-reduce of
// (h, ~h), h their FNV-1a 64, gives the largest hash and the complement of the smallest.
inline bool same_bytes_everywhere(ncclComm_t comm, const void* data, size_t bytes) {
  const uint64_t h = fnv1a64(data, bytes);
  uint64_t w[2] = {h, ~h};
  if (ncclAllReduce(w, w, 2, ncclUint64, ncclMax, comm, nullptr) != ncclSuccess) return false;
  return w[0] == ~w[1];
}

}  // namespace dq::test

// Helpers shared by the tests that run dq::engine::Engine directly over the CPU NCCL.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>

#include "common/nccl_api.h"
#include "config/settings.h"
#include "shim/engine/engine.h"
#include "tests/common/check.h"
#include "tests/common/cross_rank.h"
#include "tests/common/test_data.h"

namespace dq::test {

// The engine's NCCL entry points, bound to the CPU NCCL this test links.
inline dq::engine::NcclOps cpu_nccl_ops() {
  dq::engine::NcclOps ops;
  ops.group_start = ncclGroupStart;
  ops.group_end = ncclGroupEnd;
  ops.send = ncclSend;
  ops.recv = ncclRecv;
  ops.all_reduce = ncclAllReduce;
  ops.error_string = ncclGetErrorString;
  ops.reduce_scatter = ncclReduceScatter;
  ops.all_gather = ncclAllGather;
  ops.reduce = ncclReduce;
  ops.comm_split = ncclCommSplit;
  ops.comm_destroy = ncclCommDestroy;
  ops.comm_abort = ncclCommAbort;
  return ops;
}

// A call of `count` elements from `send` into `recv`; the rest as CallArgs has it (an FP32 SUM
// all-reduce on the default stream, outside a group).
inline dq::engine::CallArgs call_of(const void* send, void* recv, size_t count) {
  dq::engine::CallArgs args;
  args.send = send;
  args.recv = recv;
  args.count = count;
  return args;
}

// Settings parsed from `env` alone (not the process environment); exits 2 on an invalid value.
inline dq::config::Settings settings_for(const std::map<std::string, std::string>& env) {
  dq::config::Settings s;
  std::string error;
  auto lookup = [](const char* key, void* ctx) -> const char* {
    const auto* m = static_cast<const std::map<std::string, std::string>*>(ctx);
    auto it = m->find(key);
    return it == m->end() ? nullptr : it->second.c_str();
  };
  if (dq::config::load(lookup, const_cast<std::map<std::string, std::string>*>(&env), &s, &error) !=
      dq::Status::kOk) {
    std::fprintf(stderr, "settings: %s\n", error.c_str());
    std::exit(2);
  }
  return s;
}

}  // namespace dq::test

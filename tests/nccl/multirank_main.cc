// Multi-process tests of the CPU NCCL (libnccl.so.2): each scenario forks N rank processes that
// meet through ncclGetUniqueId / ncclCommInitRank over the real net plugin.
//
//   cpu_nccl_multirank <scenario> <nranks> [runs]
// scenarios: allreduce, collectives, p2p, split, shrink, random, big [MiB], kill [runs],
// stall [runs], initall, api
// Exit status 0 = pass. Built twice: against our own declarations and, where installed, against
// the real nccl.h (proving that an unmodified NCCL program runs on this library).
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#if defined(DQ_TEST_REAL_NCCL_H)
#include <nccl.h>
#define TEST_SPLIT_NOCOLOR NCCL_SPLIT_NOCOLOR
#define TEST_CONFIG_MAGIC 0xcafebeefu
#define TEST_SHRINK_DEFAULT NCCL_SHRINK_DEFAULT
#define TEST_SHRINK_ABORT NCCL_SHRINK_ABORT
#define TEST_SIM_INFO_INITIALIZER NCCL_SIM_INFO_INITIALIZER
#else
#include "common/nccl_api.h"
#define TEST_SPLIT_NOCOLOR DQ_NCCL_SPLIT_NOCOLOR
#define TEST_CONFIG_MAGIC DQ_NCCL_CONFIG_MAGIC
#define TEST_SHRINK_DEFAULT DQ_NCCL_SHRINK_DEFAULT
#define TEST_SHRINK_ABORT DQ_NCCL_SHRINK_ABORT
#define TEST_SIM_INFO_INITIALIZER DQ_NCCL_SIM_INFO_INITIALIZER
#endif
#include "common/fnv1a.h"
#include "tests/common/rank_harness.h"
#include "tests/common/test_data.h"

extern "C" const char* dqCpuNcclCommName(ncclComm_t comm);

namespace {

using Clock = std::chrono::steady_clock;

#define FAIL_IF(cond, ...)                                                   \
  do {                                                                       \
    if (cond) {                                                              \
      std::fprintf(stderr, "[rank %d] %s:%d: ", g_rank, __FILE__, __LINE__); \
      std::fprintf(stderr, __VA_ARGS__);                                     \
      std::fprintf(stderr, "\n");                                            \
      return 1;                                                              \
    }                                                                        \
  } while (0)

#define NCCL_OK(call)                                                        \
  do {                                                                       \
    ncclResult_t r_ = (call);                                                \
    FAIL_IF(r_ != ncclSuccess, "%s -> %d (%s)", #call, static_cast<int>(r_), \
            ncclGetErrorString(r_));                                         \
  } while (0)

int g_rank = -1;

// ---- shared page between the parent and the rank processes --------------------------------
constexpr int kMaxRanks = 16;
struct Shared {
  std::atomic<int> id_ready;
  ncclUniqueId id;
  uint64_t digest[kMaxRanks][64];  // per rank: hashes of results that must match across ranks
  int digest_count[kMaxRanks];
  std::atomic<int> survivors_done;  // shrink: ranks done with the shrunk communicator
};
Shared* g_shared = nullptr;

int init_comm(int rank, int nranks, ncclComm_t* comm, ncclConfig_t* config = nullptr) {
  if (rank == 0) {
    NCCL_OK(ncclGetUniqueId(&g_shared->id));
    g_shared->id_ready.store(1, std::memory_order_release);
  } else {
    auto deadline = Clock::now() + std::chrono::seconds(30);
    while (!g_shared->id_ready.load(std::memory_order_acquire)) {
      FAIL_IF(Clock::now() > deadline, "no unique id from rank 0");
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
  if (config)
    NCCL_OK(ncclCommInitRankConfig(comm, nranks, g_shared->id, rank, config));
  else
    NCCL_OK(ncclCommInitRank(comm, nranks, g_shared->id, rank));
  int count = -1, me = -1;
  NCCL_OK(ncclCommCount(*comm, &count));
  NCCL_OK(ncclCommUserRank(*comm, &me));
  FAIL_IF(count != nranks || me != rank, "count %d rank %d", count, me);
  return 0;
}

// Forks nranks processes running body(rank); returns 0 when every one exits 0 in time.
int run_ranks(int nranks, int timeout_s, const std::function<int(int, int)>& body) {
  std::memset(static_cast<void*>(g_shared), 0, sizeof(Shared));
  dq::test::RankOptions opt;
  opt.timeout_s = timeout_s;
  const auto exits = dq::test::run_ranks(nranks, opt, [&](int r) {
    g_rank = r;
    return body(r, nranks);
  });
  int failures = 0;
  for (int r = 0; r < nranks; ++r)
    if (!exits[r].exited(0)) {
      std::fprintf(stderr, "rank %d %s\n", r, exits[r].describe().c_str());
      ++failures;
    }
  return failures ? 1 : 0;
}

// ---- independent reference arithmetic ---------------------------------------------------------
struct TypeInfo {
  ncclDataType_t type;
  const char* name;
  size_t size;
  bool is_int, is_signed, narrow;
  int exp_bits, man_bits;
  bool has_inf;
};
const TypeInfo kTypes[] = {
    {ncclInt8, "int8", 1, true, true, false, 0, 0, false},
    {ncclUint8, "uint8", 1, true, false, false, 0, 0, false},
    {ncclInt32, "int32", 4, true, true, false, 0, 0, false},
    {ncclUint32, "uint32", 4, true, false, false, 0, 0, false},
    {ncclInt64, "int64", 8, true, true, false, 0, 0, false},
    {ncclUint64, "uint64", 8, true, false, false, 0, 0, false},
    {ncclFloat16, "half", 2, false, true, true, 5, 10, true},
    {ncclFloat32, "float", 4, false, true, false, 0, 0, false},
    {ncclFloat64, "double", 8, false, true, false, 0, 0, false},
    {ncclBfloat16, "bfloat16", 2, false, true, true, 8, 7, true},
    {ncclFloat8e4m3, "e4m3", 1, false, true, true, 4, 3, false},
    {ncclFloat8e5m2, "e5m2", 1, false, true, true, 5, 2, true},
};
const char* const kOpNames[] = {"sum", "prod", "max", "min", "avg"};

// Value of a narrow float bit pattern, straight from the format's definition.
double narrow_value(const TypeInfo& t, uint32_t bits) {
  const int bias = (1 << (t.exp_bits - 1)) - 1;
  const uint32_t e = (bits >> t.man_bits) & ((1u << t.exp_bits) - 1);
  const uint32_t m = bits & ((1u << t.man_bits) - 1);
  const bool neg = (bits >> (t.exp_bits + t.man_bits)) & 1;
  double v;
  if (e == (1u << t.exp_bits) - 1 && (t.has_inf || m == (1u << t.man_bits) - 1))
    v = NAN;
  else if (e == 0)
    v = std::ldexp(m, 1 - bias - t.man_bits);
  else
    v = std::ldexp(1.0 + std::ldexp(m, -t.man_bits), static_cast<int>(e) - bias);
  return neg ? -v : v;
}

// Nearest representable value, ties to the even pattern, by exhaustive search (test only).
struct NarrowTable {
  std::vector<std::pair<double, uint32_t>> positives;  // finite, ascending
};
const NarrowTable& narrow_table(const TypeInfo& t) {
  static std::map<int, NarrowTable> cache;
  NarrowTable& nt = cache[static_cast<int>(t.type)];
  if (nt.positives.empty()) {
    const uint32_t sign_bit = 1u << (t.exp_bits + t.man_bits);
    for (uint32_t b = 0; b < sign_bit; ++b) {
      double v = narrow_value(t, b);
      if (std::isfinite(v)) nt.positives.push_back({v, b});
    }
    std::sort(nt.positives.begin(), nt.positives.end());
  }
  return nt;
}
uint32_t narrow_nearest(const TypeInfo& t, double x) {
  const NarrowTable& nt = narrow_table(t);
  const uint32_t sign = std::signbit(x) ? 1u << (t.exp_bits + t.man_bits) : 0;
  double a = std::fabs(x);
  auto it =
      std::lower_bound(nt.positives.begin(), nt.positives.end(), std::make_pair(a, uint32_t{0}));
  if (it == nt.positives.end()) return sign | nt.positives.back().second;  // not used by tests
  if (it->first == a || it == nt.positives.begin()) return sign | it->second;
  auto lo = it - 1;
  double dlo = a - lo->first, dhi = it->first - a;
  if (dlo < dhi) return sign | lo->second;
  if (dhi < dlo) return sign | it->second;
  return sign | ((lo->second & 1) == 0 ? lo->second : it->second);
}

// Integer-valued test data: every partial result is exact in every type, so the expected
// result does not depend on the reduction order.
int64_t test_value(const TypeInfo& t, int op, int rank, size_t i, int seed) {
  const uint64_t h = (i * 2654435761ull + static_cast<uint64_t>(rank) * 40503ull +
                      static_cast<uint64_t>(seed) * 977ull) >>
                     3;
  if (op == ncclProd) {
    // Products of up to 8 ranks stay exact: |value| <= 2 (powers of two for the floats).
    static const int64_t kSigned[] = {-2, -1, 1, 2}, kUnsigned[] = {1, 2, 1, 3};
    return t.is_int && !t.is_signed ? kUnsigned[h % 4] : kSigned[h % 4];
  }
  int64_t k = 8;  // magnitude bound per rank
  if (t.type == ncclFloat8e5m2) k = 1;
  if (t.type == ncclFloat8e4m3) k = 2;
  if (t.is_int && !t.is_signed) return static_cast<int64_t>(h % 60);
  if (t.is_int) return static_cast<int64_t>(h % 121) - 60;
  return static_cast<int64_t>(h % (2 * k + 1)) - k;
}

void store(const TypeInfo& t, void* buf, size_t i, double v_float, int64_t v_int) {
  char* p = static_cast<char*>(buf) + i * t.size;
  switch (t.type) {
    case ncclInt8: {
      int8_t x = static_cast<int8_t>(v_int);
      std::memcpy(p, &x, 1);
      break;
    }
    case ncclUint8: {
      uint8_t x = static_cast<uint8_t>(v_int);
      std::memcpy(p, &x, 1);
      break;
    }
    case ncclInt32: {
      int32_t x = static_cast<int32_t>(v_int);
      std::memcpy(p, &x, 4);
      break;
    }
    case ncclUint32: {
      uint32_t x = static_cast<uint32_t>(v_int);
      std::memcpy(p, &x, 4);
      break;
    }
    case ncclInt64: {
      int64_t x = v_int;
      std::memcpy(p, &x, 8);
      break;
    }
    case ncclUint64: {
      uint64_t x = static_cast<uint64_t>(v_int);
      std::memcpy(p, &x, 8);
      break;
    }
    case ncclFloat32: {
      float x = static_cast<float>(v_float);
      std::memcpy(p, &x, 4);
      break;
    }
    case ncclFloat64: {
      std::memcpy(p, &v_float, 8);
      break;
    }
    default: {
      uint32_t bits = narrow_nearest(t, v_float);
      std::memcpy(p, &bits, t.size);
    }
  }
}

// Expected element: reduce the ranks' integer values exactly, then apply the type's semantics.
void expected_element(const TypeInfo& t, int op, int nranks, size_t i, int seed, void* out,
                      size_t out_index, const std::vector<int>& ranks) {
  int64_t acc = 0;
  bool first = true;
  for (int r : ranks) {
    int64_t v = test_value(t, op, r, i, seed);
    if (first)
      acc = v;
    else if (op == ncclSum || op == ncclAvg)
      acc += v;
    else if (op == ncclProd)
      acc *= v;
    else if (op == ncclMax)
      acc = std::max(acc, v);
    else
      acc = std::min(acc, v);
    first = false;
  }
  (void)nranks;
  const int n = static_cast<int>(ranks.size());
  if (t.is_int) {
    int64_t wrapped = acc;
    // Wrap to the type first (the sum wraps), then divide for avg.
    switch (t.type) {
      case ncclInt8:
        wrapped = static_cast<int8_t>(acc);
        break;
      case ncclUint8:
        wrapped = static_cast<uint8_t>(acc);
        break;
      case ncclInt32:
        wrapped = static_cast<int32_t>(acc);
        break;
      case ncclUint32:
        wrapped = static_cast<uint32_t>(acc);
        break;
      default:
        break;
    }
    if (op == ncclAvg) {
      if (t.type == ncclUint64)
        wrapped = static_cast<int64_t>(static_cast<uint64_t>(acc) / n);
      else if (t.type == ncclInt64)
        wrapped = acc / n;
      else
        wrapped = wrapped / n;
    }
    store(t, out, out_index, 0.0, wrapped);
    return;
  }
  if (op == ncclAvg) {
    if (t.type == ncclFloat32) {
      store(t, out, out_index, static_cast<float>(acc) / static_cast<float>(n), 0);
    } else {
      store(t, out, out_index, static_cast<double>(acc) / n, 0);
    }
    return;
  }
  store(t, out, out_index, static_cast<double>(acc), 0);
}

void fill_input(const TypeInfo& t, int op, int rank, int seed, void* buf, size_t count,
                size_t first_index = 0) {
  for (size_t i = 0; i < count; ++i) {
    int64_t v = test_value(t, op, rank, first_index + i, seed);
    store(t, buf, i, static_cast<double>(v), v);
  }
}

std::vector<int> all_ranks(int n) {
  std::vector<int> v(n);
  for (int i = 0; i < n; ++i) v[i] = i;
  return v;
}

int compare(const TypeInfo& t, const void* got, const void* want, size_t count, const char* what,
            int op, size_t n) {
  if (count == 0 || std::memcmp(got, want, count * t.size) == 0) return 0;
  for (size_t i = 0; i < count; ++i) {
    if (std::memcmp(static_cast<const char*>(got) + i * t.size,
                    static_cast<const char*>(want) + i * t.size, t.size) != 0) {
      uint64_t g = 0, w = 0;
      std::memcpy(&g, static_cast<const char*>(got) + i * t.size, t.size);
      std::memcpy(&w, static_cast<const char*>(want) + i * t.size, t.size);
      FAIL_IF(true, "%s %s %s count %zu: element %zu is %#llx, expected %#llx", what, t.name,
              kOpNames[op], n, i, static_cast<unsigned long long>(g),
              static_cast<unsigned long long>(w));
    }
  }
  return 0;
}

std::vector<size_t> test_counts(int nranks) {
  return {0, 1, static_cast<size_t>(nranks) - 1, static_cast<size_t>(nranks) + 1, 1031, 20011};
}

// ---- scenarios ----------------------------------------------------------------------------------

// Every dtype x op, in-place and out-of-place, odd counts and 0, exact expected values.
int scenario_allreduce(int rank, int nranks) {
  ncclComm_t comm;
  if (init_comm(rank, nranks, &comm)) return 1;
  int seed = 0;
  for (const TypeInfo& t : kTypes) {
    for (int op = 0; op < 5; ++op) {
      for (size_t count : test_counts(nranks)) {
        for (int in_place = 0; in_place < 2; ++in_place) {
          ++seed;
          std::vector<char> send(count * t.size + 1), recv(count * t.size + 1, 0x5a),
              want(count * t.size + 1);
          fill_input(t, op, rank, seed, send.data(), count);
          for (size_t i = 0; i < count; ++i)
            expected_element(t, op, nranks, i, seed, want.data(), i, all_ranks(nranks));
          void* out = in_place ? send.data() : recv.data();
          NCCL_OK(ncclAllReduce(send.data(), out, count, t.type, static_cast<ncclRedOp_t>(op), comm,
                                nullptr));
          if (compare(t, out, want.data(), count,
                      in_place ? "allreduce in-place" : "allreduce out-of-place", op, count))
            return 1;
          if (!in_place) FAIL_IF(recv[count * t.size] != 0x5a, "wrote past the end of recvbuff");
        }
      }
    }
  }
  NCCL_OK(ncclCommDestroy(comm));
  return 0;
}

int scenario_collectives(int rank, int nranks) {
  ncclComm_t comm;
  if (init_comm(rank, nranks, &comm)) return 1;
  const TypeInfo& ti = kTypes[2];  // int32
  const TypeInfo& tf = kTypes[7];  // float
  const size_t counts[] = {0, 1, 3, 5003};
  int seed = 1000;
  for (size_t count : counts) {
    for (int root = 0; root < nranks; ++root) {
      // Broadcast, out-of-place then in-place.
      for (int in_place = 0; in_place < 2; ++in_place) {
        ++seed;
        std::vector<int32_t> send(count + 1), recv(count + 1, -7), want(count + 1);
        fill_input(ti, ncclSum, rank, seed, send.data(), count);
        fill_input(ti, ncclSum, root, seed, want.data(), count);
        int32_t* out = in_place ? send.data() : recv.data();
        NCCL_OK(ncclBroadcast(send.data(), out, count, ncclInt32, root, comm, nullptr));
        FAIL_IF(count && std::memcmp(out, want.data(), count * 4) != 0,
                "broadcast root %d count %zu in_place %d wrong", root, count, in_place);
      }
      // Reduce, every op, float and int32, result only at the root.
      for (const TypeInfo* t : {&ti, &tf}) {
        for (int op = 0; op < 5; ++op) {
          ++seed;
          std::vector<char> send(count * t->size + 1), recv(count * t->size + 1),
              want(count * t->size + 1);
          fill_input(*t, op, rank, seed, send.data(), count);
          for (size_t i = 0; i < count; ++i)
            expected_element(*t, op, nranks, i, seed, want.data(), i, all_ranks(nranks));
          NCCL_OK(ncclReduce(send.data(), rank == root ? recv.data() : nullptr, count, t->type,
                             static_cast<ncclRedOp_t>(op), root, comm, nullptr));
          if (rank == root && compare(*t, recv.data(), want.data(), count, "reduce", op, count))
            return 1;
        }
      }
    }
    // All-gather: out-of-place, then in-place (sendbuff = recvbuff + rank * count).
    for (int in_place = 0; in_place < 2; ++in_place) {
      ++seed;
      std::vector<int32_t> send(count + 1), recv(count * nranks + 1, -3), want(count * nranks + 1);
      for (int r = 0; r < nranks; ++r)
        fill_input(ti, ncclSum, r, seed, want.data() + r * count, count);
      fill_input(ti, ncclSum, rank, seed, send.data(), count);
      const int32_t* src = send.data();
      if (in_place) {
        std::memcpy(recv.data() + rank * count, send.data(), count * 4);
        src = recv.data() + rank * count;
      }
      NCCL_OK(ncclAllGather(src, recv.data(), count, ncclInt32, comm, nullptr));
      FAIL_IF(count && std::memcmp(recv.data(), want.data(), count * nranks * 4) != 0,
              "allgather count %zu in_place %d wrong", count, in_place);
    }
    // Reduce-scatter: every op, int32 and float, out-of-place and in-place.
    for (const TypeInfo* t : {&ti, &tf}) {
      for (int op = 0; op < 5; ++op) {
        for (int in_place = 0; in_place < 2; ++in_place) {
          ++seed;
          const size_t total = count * nranks;
          std::vector<char> send(total * t->size + 1), recv(count * t->size + 1),
              want(count * t->size + 1);
          fill_input(*t, op, rank, seed, send.data(), total);
          for (size_t i = 0; i < count; ++i)
            expected_element(*t, op, nranks, rank * count + i, seed, want.data(), i,
                             all_ranks(nranks));
          void* out = in_place ? send.data() + rank * count * t->size : recv.data();
          NCCL_OK(ncclReduceScatter(send.data(), out, count, t->type, static_cast<ncclRedOp_t>(op),
                                    comm, nullptr));
          if (compare(*t, out, want.data(), count, "reducescatter", op, count)) return 1;
        }
      }
    }
  }
  NCCL_OK(ncclCommDestroy(comm));
  return 0;
}

int scenario_p2p(int rank, int nranks) {
  ncclComm_t comm;
  if (init_comm(rank, nranks, &comm)) return 1;
  const int next = (rank + 1) % nranks, prev = (rank + nranks - 1) % nranks;
  const size_t sizes[] = {0, 1, 1000003};
  for (size_t n : sizes) {
    for (int order = 0; order < 2; ++order) {
      std::vector<uint8_t> out(n + 1), in(n + 1, 0);
      for (size_t i = 0; i < n; ++i) out[i] = static_cast<uint8_t>(rank * 31 + i * 7);
      // Even ranks post the send first in one round, the receive first in the other; odd
      // ranks the opposite: a group must not care.
      const bool send_first = ((rank % 2) == 0) == (order == 0);
      NCCL_OK(ncclGroupStart());
      if (send_first) NCCL_OK(ncclSend(out.data(), n, ncclUint8, next, comm, nullptr));
      NCCL_OK(ncclRecv(in.data(), n, ncclUint8, prev, comm, nullptr));
      if (!send_first) NCCL_OK(ncclSend(out.data(), n, ncclUint8, next, comm, nullptr));
      NCCL_OK(ncclGroupEnd());
      for (size_t i = 0; i < n; ++i)
        FAIL_IF(in[i] != static_cast<uint8_t>(prev * 31 + i * 7), "ring p2p byte %zu wrong", i);
    }
  }
  // A call refused inside a group (a peer out of range) drops the whole group, as NCCL does: its
  // end returns that error on every rank alike, no operation of it ran, and the communicator
  // still works. Run, the valid exchange would have written `in`.
  {
    const size_t n = 1000;
    std::vector<uint8_t> out(n, static_cast<uint8_t>(rank + 1)), in(n, 0);
    NCCL_OK(ncclGroupStart());
    NCCL_OK(ncclSend(out.data(), n, ncclUint8, next, comm, nullptr));
    NCCL_OK(ncclRecv(in.data(), n, ncclUint8, prev, comm, nullptr));
    const ncclResult_t bad = ncclSend(out.data(), n, ncclUint8, nranks + 5, comm, nullptr);
    const ncclResult_t end = ncclGroupEnd();
    FAIL_IF(bad != ncclInvalidArgument, "a send to peer %d returned %d", nranks + 5, bad);
    FAIL_IF(end != ncclInvalidArgument, "the group with a refused call ended with %d", end);
    for (size_t i = 0; i < n; ++i) FAIL_IF(in[i] != 0, "the dropped group's receive ran");
    int32_t one = 1, total = 0;
    NCCL_OK(ncclAllReduce(&one, &total, 1, ncclInt32, ncclSum, comm, nullptr));
    FAIL_IF(total != nranks, "all-reduce after a dropped group: %d", total);
  }
  // Every pair at once, receives posted in reverse order, plus one message to self.
  {
    const size_t n = 4099;
    std::vector<std::vector<int64_t>> out(nranks, std::vector<int64_t>(n)),
        in(nranks, std::vector<int64_t>(n, -1));
    for (int p = 0; p < nranks; ++p)
      for (size_t i = 0; i < n; ++i)
        out[p][i] = rank * 1000000 + p * 10000 + static_cast<int64_t>(i);
    NCCL_OK(ncclGroupStart());
    NCCL_OK(ncclGroupStart());  // nested: only the outermost end runs the batch
    for (int p = nranks - 1; p >= 0; --p)
      NCCL_OK(ncclRecv(in[p].data(), n, ncclInt64, p, comm, nullptr));
    NCCL_OK(ncclGroupEnd());
    for (int p = 0; p < nranks; ++p)
      NCCL_OK(ncclSend(out[p].data(), n, ncclInt64, p, comm, nullptr));
    NCCL_OK(ncclGroupEnd());
    for (int p = 0; p < nranks; ++p)
      for (size_t i = 0; i < n; ++i)
        FAIL_IF(in[p][i] != p * 1000000 + rank * 10000 + static_cast<int64_t>(i),
                "all-pairs from %d element %zu wrong", p, i);
  }
  // Outside a group: a blocking pair between ranks 0 and 1.
  if (nranks >= 2 && rank < 2) {
    double v[3] = {rank + 0.5, 2.0, 3.0}, w[3] = {0, 0, 0};
    if (rank == 0)
      NCCL_OK(ncclSend(v, 3, ncclFloat64, 1, comm, nullptr));
    else
      NCCL_OK(ncclRecv(w, 3, ncclFloat64, 0, comm, nullptr));
    if (rank == 1) FAIL_IF(w[0] != 0.5 || w[2] != 3.0, "blocking recv wrong");
  }
  // All-to-all.
  {
    const size_t n = 257;
    std::vector<int32_t> out(n * nranks), in(n * nranks, -1);
    for (int p = 0; p < nranks; ++p)
      for (size_t i = 0; i < n; ++i)
        out[p * n + i] = rank * 100000 + p * 1000 + static_cast<int>(i);
    NCCL_OK(ncclAlltoAll(out.data(), in.data(), n, ncclInt32, comm, nullptr));
    for (int p = 0; p < nranks; ++p)
      for (size_t i = 0; i < n; ++i)
        FAIL_IF(in[p * n + i] != p * 100000 + rank * 1000 + static_cast<int>(i),
                "alltoall from %d element %zu wrong", p, i);
  }
  NCCL_OK(ncclCommDestroy(comm));
  return 0;
}

// A blocking communicator named "parent-comm" (ncclConfig_t), for the split and shrink tests.
// A config with its header, `blocking` and `name` (nullptr: none) set, every other field 0.
ncclConfig_t test_config(int blocking, const char* name) {
  ncclConfig_t config;
  std::memset(&config, 0, sizeof config);
  config.size = sizeof config;
  config.magic = TEST_CONFIG_MAGIC;
  config.version = 22809;
  config.blocking = blocking;
  config.commName = name;
  return config;
}

int init_parent_comm(int rank, int nranks, ncclComm_t* comm) {
  ncclConfig_t config = test_config(1, "parent-comm");
  return init_comm(rank, nranks, comm, &config);
}

int scenario_split(int rank, int nranks) {
  ncclComm_t comm;
  if (init_parent_comm(rank, nranks, &comm)) return 1;
  FAIL_IF(std::strcmp(dqCpuNcclCommName(comm), "parent-comm") != 0, "commName not kept: '%s'",
          dqCpuNcclCommName(comm));
  // The last rank opts out (when there are 3 or more); the others split by parity with keys
  // that reverse the order.
  const bool opt_out = nranks >= 3 && rank == nranks - 1;
  const int color = opt_out ? TEST_SPLIT_NOCOLOR : rank % 2;
  ncclComm_t sub = nullptr;
  NCCL_OK(ncclCommSplit(comm, color, nranks - rank, &sub, nullptr));
  if (opt_out) {
    FAIL_IF(sub != nullptr, "NOCOLOR must give a NULL comm");
  } else {
    std::vector<int> members;
    for (int r = nranks - 1; r >= 0; --r)  // descending key order = descending rank
      if (r % 2 == rank % 2 && !(nranks >= 3 && r == nranks - 1)) members.push_back(r);
    int count = -1, me = -1;
    FAIL_IF(sub == nullptr, "split gave NULL");
    NCCL_OK(ncclCommCount(sub, &count));
    NCCL_OK(ncclCommUserRank(sub, &me));
    FAIL_IF(count != static_cast<int>(members.size()), "sub count %d want %zu", count,
            members.size());
    FAIL_IF(members[me] != rank, "sub rank %d is parent rank %d, want %d", me, members[me], rank);
    FAIL_IF(std::strcmp(dqCpuNcclCommName(sub), "parent-comm") != 0, "split lost commName");
    int64_t v[2] = {rank, 1}, sum[2] = {0, 0};
    NCCL_OK(ncclAllReduce(v, sum, 2, ncclInt64, ncclSum, sub, nullptr));
    int64_t want = 0;
    for (int r : members) want += r;
    FAIL_IF(sum[0] != want || sum[1] != count, "sub allreduce %lld/%lld want %lld/%d",
            static_cast<long long>(sum[0]), static_cast<long long>(sum[1]),
            static_cast<long long>(want), count);
    // Broadcast from the sub-root, then the parent still works.
    int32_t b = me == 0 ? 4242 + rank : -1;
    NCCL_OK(ncclBroadcast(&b, &b, 1, ncclInt32, 0, sub, nullptr));
    FAIL_IF(b != 4242 + members[0], "sub broadcast %d", b);
    NCCL_OK(ncclCommDestroy(sub));
  }
  int32_t one = 1, total = 0;
  NCCL_OK(ncclAllReduce(&one, &total, 1, ncclInt32, ncclSum, comm, nullptr));
  FAIL_IF(total != nranks, "parent allreduce after split: %d", total);
  NCCL_OK(ncclCommDestroy(comm));
  return 0;
}

// ncclCommShrink and ncclCommRevoke (NCCL 2.27 / 2.28 fault tolerance), one job per mode; rank
// `out` = nranks / 2 is the one left out:
//   healthy  it destroys its communicator and leaves; the others shrink (NCCL_SHRINK_DEFAULT);
//   dead     it exits right after init without a word; the others' all-reduce fails and they
//            shrink with NCCL_SHRINK_ABORT, after which the parent refuses work;
//   hung     it stays alive but never joins the all-reduce; each survivor's other thread revokes
//            the parent 300 ms in: the all-reduce returns at once (the timeout is 60 s), the
//            parent reports quiescent and refuses work, and the survivors shrink.
//   abort    as hung, but the survivors' other thread aborts the communicator (PyTorch's
//            watchdog does so) instead of revoking it: the all-reduce returns an error, the abort
//            returns once it has, and the freed communicator is not used after (no shrink).
//   split    as abort, but what waits for the missing rank is an ncclCommSplit of the parent: it
//            returns an error, and the abort frees the parent only after the split has left it
//            (the ASan leg reports a use after free otherwise).
// The shrunk communicator: n - 1 ranks in parent order, the parent's name, exact reductions;
// from 4 ranks it is shrunk once more (its last rank leaves), over the same shared listener.
enum class ShrinkMode { kHealthy, kDead, kHung, kAbort, kSplitAborted };

int check_shrunk(ncclComm_t sub, int rank, int nranks, int out) {
  FAIL_IF(sub == nullptr, "ncclCommShrink gave NULL");
  int count = -1, me = -1;
  NCCL_OK(ncclCommCount(sub, &count));
  NCCL_OK(ncclCommUserRank(sub, &me));
  FAIL_IF(count != nranks - 1 || me != rank - (rank > out ? 1 : 0),
          "shrunk communicator: rank %d of %d, want %d of %d", me, count,
          rank - (rank > out ? 1 : 0), nranks - 1);
  FAIL_IF(std::strcmp(dqCpuNcclCommName(sub), "parent-comm") != 0, "shrink lost commName: '%s'",
          dqCpuNcclCommName(sub));
  // Several pipeline chunks (4 KiB each here), every element exact.
  const size_t n = 50021;
  std::vector<int64_t> v(n), sum(n, -1);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<int64_t>(i) * 7 + rank;
  NCCL_OK(ncclAllReduce(v.data(), sum.data(), n, ncclInt64, ncclSum, sub, nullptr));
  int64_t ranks = 0;
  for (int r = 0; r < nranks; ++r) ranks += r == out ? 0 : r;
  for (size_t i = 0; i < n; ++i)
    FAIL_IF(sum[i] != static_cast<int64_t>(i) * 7 * (nranks - 1) + ranks,
            "shrunk all-reduce element %zu: %lld", i, static_cast<long long>(sum[i]));
  return 0;
}

// After a revoke (or NCCL_SHRINK_ABORT): quiescent, and work is refused as invalid usage.
int check_revoked(ncclComm_t comm) {
  ncclResult_t async = ncclInternalError;
  NCCL_OK(ncclCommGetAsyncError(comm, &async));
  FAIL_IF(async != ncclSuccess, "revoked parent reports %d, want quiescent (0)", async);
  int32_t one = 1, total = 0;
  const ncclResult_t r = ncclAllReduce(&one, &total, 1, ncclInt32, ncclSum, comm, nullptr);
  FAIL_IF(r != ncclInvalidUsage, "all-reduce on a revoked communicator returned %d", r);
  return 0;
}

int shrink_body(int rank, int nranks, ShrinkMode mode) {
  ncclComm_t comm;
  if (init_parent_comm(rank, nranks, &comm)) return 1;
  const int out = nranks / 2;
  if (rank == out) {
    if (mode == ShrinkMode::kDead) _exit(0);  // no destroy, no goodbye: its sockets just close
    if (mode == ShrinkMode::kHung || mode == ShrinkMode::kAbort ||
        mode == ShrinkMode::kSplitAborted) {
      const auto deadline = Clock::now() + std::chrono::seconds(120);
      while (g_shared->survivors_done.load() < nranks - 1 && Clock::now() < deadline)
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    ncclCommDestroy(comm);
    return 0;
  }
  int excluded[1] = {out};
  ncclComm_t sub = nullptr;
  if (mode == ShrinkMode::kHealthy) {
    NCCL_OK(ncclCommShrink(comm, excluded, 1, &sub, nullptr, TEST_SHRINK_DEFAULT));
  } else if (mode == ShrinkMode::kDead) {
    std::vector<float> buf(1 << 16, 1.0f);
    const ncclResult_t r =
        ncclAllReduce(buf.data(), buf.data(), buf.size(), ncclFloat32, ncclSum, comm, nullptr);
    FAIL_IF(r == ncclSuccess, "all-reduce without rank %d succeeded", out);
    // NCCL's ncclCommEnsureReady: a communicator with an asynchronous error answers it, not its
    // size.
    int size = 0;
    FAIL_IF(ncclCommCount(comm, &size) == ncclSuccess, "ncclCommCount of the failed parent: %d",
            size);
    NCCL_OK(ncclCommShrink(comm, excluded, 1, &sub, nullptr, TEST_SHRINK_ABORT));
    if (check_revoked(comm)) return 1;
  } else {
    // Hung: another thread revokes (or aborts) the communicator while the all-reduce (or the
    // split) waits.
    const bool aborting = mode != ShrinkMode::kHung;
    const char* what = aborting ? "ncclCommAbort" : "ncclCommRevoke";
    std::vector<float> buf(1 << 16, 1.0f);
    std::atomic<int> result{-1};
    ncclComm_t child = nullptr;
    std::thread op([&] {
      result = mode == ShrinkMode::kSplitAborted
                   ? ncclCommSplit(comm, 0, rank, &child, nullptr)
                   : ncclAllReduce(buf.data(), buf.data(), buf.size(), ncclFloat32, ncclSum, comm,
                                   nullptr);
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    const bool finished_early = result.load() != -1;
    const auto at = Clock::now();
    const ncclResult_t r = aborting ? ncclCommAbort(comm) : ncclCommRevoke(comm, 0);
    op.join();
    const double ended_s = std::chrono::duration<double>(Clock::now() - at).count();
    FAIL_IF(finished_early, "the call without rank %d ended before the %s: %d", out, what,
            result.load());
    FAIL_IF(r != ncclSuccess, "%s -> %d", what, r);
    FAIL_IF(child != nullptr, "the split without rank %d gave a communicator", out);
    // Ended as revoked, or by a peer's connection closed by that peer's own abort; never on a
    // communicator freed under it (an abort frees it only after the call has left it: the ASan
    // leg reports a use after free otherwise).
    FAIL_IF(result.load() == ncclSuccess, "the call succeeded after %s", what);
    FAIL_IF(ended_s > 5.0, "the call took %.2f s to end after %s", ended_s, what);
    if (aborting) {  // the communicator is freed: no shrink
      g_shared->survivors_done.fetch_add(1);
      return 0;
    }
    if (check_revoked(comm)) return 1;
    NCCL_OK(ncclCommShrink(comm, excluded, 1, &sub, nullptr, TEST_SHRINK_DEFAULT));
  }
  if (check_shrunk(sub, rank, nranks, out)) return 1;
  // A second failure: the shrunk communicator's last rank leaves it, the others shrink it again
  // (over the same shared listener).
  int sub_rank = -1, sub_count = 0;
  NCCL_OK(ncclCommUserRank(sub, &sub_rank));
  NCCL_OK(ncclCommCount(sub, &sub_count));
  if (sub_count >= 3 && sub_rank != sub_count - 1) {
    int last[1] = {sub_count - 1};
    ncclComm_t again = nullptr;
    NCCL_OK(ncclCommShrink(sub, last, 1, &again, nullptr, TEST_SHRINK_DEFAULT));
    int count = 0, me = -1;
    NCCL_OK(ncclCommCount(again, &count));
    NCCL_OK(ncclCommUserRank(again, &me));
    FAIL_IF(count != sub_count - 1 || me != sub_rank, "second shrink: rank %d of %d", me, count);
    int64_t mine = rank, total = 0, want = 0;
    NCCL_OK(ncclAllReduce(&mine, &total, 1, ncclInt64, ncclSum, again, nullptr));
    for (int r = 0, kept = 0; r < nranks; ++r)
      if (r != out && kept++ < sub_count - 1) want += r;
    FAIL_IF(total != want, "second shrink all-reduce %lld, want %lld",
            static_cast<long long>(total), static_cast<long long>(want));
    NCCL_OK(ncclCommDestroy(again));
  }
  NCCL_OK(ncclCommDestroy(sub));
  g_shared->survivors_done.fetch_add(1);
  NCCL_OK(ncclCommDestroy(comm));
  return 0;
}

int scenario_shrink(int nranks) {
  setenv("DYNAMIQ_CPU_NCCL_TIMEOUT_MS", "60000", 1);  // the hung job must not end by a timeout
  const std::pair<ShrinkMode, const char*> modes[] = {
      {ShrinkMode::kHealthy, "healthy"},
      {ShrinkMode::kDead, "dead"},
      {ShrinkMode::kHung, "hung"},
      {ShrinkMode::kAbort, "hung, aborted"},
      {ShrinkMode::kSplitAborted, "hung in a split, aborted"}};
  int failures = 0;
  for (const auto& [mode, name] : modes) {
    const auto start = Clock::now();
    const int rc =
        run_ranks(nranks, 120, [mode = mode](int r, int n) { return shrink_body(r, n, mode); });
    std::printf("shrink, rank %d %s: %s in %.2f s\n", nranks / 2, name, rc == 0 ? "pass" : "FAIL",
                std::chrono::duration<double>(Clock::now() - start).count());
    failures += rc != 0;
  }
  return failures ? 1 : 0;
}

// Random (non-integer) data: the result must be byte-identical on every rank and close to the
// exact sum.
int scenario_random(int rank, int nranks) {
  ncclComm_t comm;
  if (init_comm(rank, nranks, &comm)) return 1;
  const size_t count = 300007;
  int slot = 0;
  for (ncclDataType_t type : {ncclFloat32, ncclFloat16, ncclBfloat16, ncclFloat64}) {
    const TypeInfo& t = *std::find_if(std::begin(kTypes), std::end(kTypes),
                                      [&](const TypeInfo& x) { return x.type == type; });
    for (int op : {ncclSum, ncclAvg, ncclMax}) {
      std::vector<char> buf(count * t.size);
      std::vector<double> exact(count, 0.0);
      for (int r = 0; r < nranks; ++r) {
        std::mt19937_64 gen(1234 + r * 7 + op);
        std::normal_distribution<double> dist(0.0, 1.0);
        for (size_t i = 0; i < count; ++i) {
          double x = dist(gen);
          // The value as stored in the type (what the library sees).
          double stored = x;
          if (t.narrow)
            stored = narrow_value(t, narrow_nearest(t, x));
          else if (type == ncclFloat32)
            stored = static_cast<float>(x);
          if (r == rank) store(t, buf.data(), i, x, 0);
          if (op == ncclMax)
            exact[i] = r == 0 ? stored : std::max(exact[i], stored);
          else
            exact[i] += stored;
        }
      }
      NCCL_OK(ncclAllReduce(buf.data(), buf.data(), count, type, static_cast<ncclRedOp_t>(op), comm,
                            nullptr));
      const double rel = t.narrow ? (t.man_bits == 7 ? 1.0 / 128 : 1.0 / 1024)
                                  : (type == ncclFloat32 ? 1e-6 : 1e-14);
      for (size_t i = 0; i < count; ++i) {
        double got;
        if (type == ncclFloat32) {
          float f;
          std::memcpy(&f, buf.data() + i * 4, 4);
          got = f;
        } else if (type == ncclFloat64)
          std::memcpy(&got, buf.data() + i * 8, 8);
        else {
          uint32_t b = 0;
          std::memcpy(&b, buf.data() + i * t.size, t.size);
          got = narrow_value(t, b);
        }
        double want = op == ncclAvg ? exact[i] / nranks : exact[i];
        // Each of the n-1 roundings can add half an ulp of a partial sum (|partial| <= 4 n).
        double tol = rel * nranks * 4.0 * (op == ncclAvg ? 1.0 : nranks) + 1e-12;
        FAIL_IF(std::fabs(got - want) > tol, "%s %s element %zu: %g vs exact %g", t.name,
                kOpNames[op], i, got, want);
      }
      g_shared->digest[rank][slot++] = dq::fnv1a64(buf.data(), buf.size());
    }
  }
  g_shared->digest_count[rank] = slot;
  NCCL_OK(ncclCommDestroy(comm));
  return 0;
}

// A rank is SIGKILLed mid-run; every other rank must get an error (not hang), see it in
// ncclCommGetAsyncError, and exit with status 3 within the timeout.
int kill_body(int rank, int nranks, int victim, int sig) {
  ncclComm_t comm;
  if (init_comm(rank, nranks, &comm)) return 1;
  std::vector<float> buf(1 << 18, 1.0f);
  for (int iter = 0; iter < 100000; ++iter) {
    if (rank == victim && iter == 3) raise(sig);
    ncclResult_t r =
        ncclAllReduce(buf.data(), buf.data(), buf.size(), ncclFloat32, ncclSum, comm, nullptr);
    if (r != ncclSuccess) {
      ncclResult_t async = ncclSuccess;
      NCCL_OK(ncclCommGetAsyncError(comm, &async));
      FAIL_IF(async == ncclSuccess, "async error not reported after %d", static_cast<int>(r));
      FAIL_IF(r != ncclRemoteError && r != ncclSystemError, "unexpected error %d", r);
      ncclCommAbort(comm);
      return 3;
    }
    std::fill(buf.begin(), buf.end(), 1.0f);
  }
  return 1;  // never saw the failure
}

// sig = SIGKILL: connections drop at once. sig = SIGSTOP: the victim hangs with its
// connections open, so its neighbours must give up after DYNAMIQ_CPU_NCCL_TIMEOUT_MS.
int scenario_kill(int nranks, int runs, int sig) {
  const int timeout_ms = 3000;
  setenv("DYNAMIQ_CPU_NCCL_TIMEOUT_MS", std::to_string(timeout_ms).c_str(), 1);
  int passed = 0;
  double worst_s = 0;
  for (int run = 0; run < runs; ++run) {
    const int victim = 1 + run % (nranks - 1);
    std::memset(static_cast<void*>(g_shared), 0, sizeof(Shared));
    std::vector<pid_t> pids;
    for (int r = 0; r < nranks; ++r) {
      pid_t pid = fork();
      if (pid == 0) {
        g_rank = r;
        int rc = kill_body(r, nranks, victim, sig);
        std::fflush(stderr);
        _exit(rc);
      }
      pids.push_back(pid);
    }
    bool ok = true;
    Clock::time_point victim_death{};
    int remaining = nranks;
    auto hard_deadline = Clock::now() + std::chrono::seconds(60);
    while (remaining > 0) {
      int st = 0;
      pid_t done = waitpid(-1, &st, WNOHANG | WUNTRACED);
      if (done > 0) {
        int r = static_cast<int>(std::find(pids.begin(), pids.end(), done) - pids.begin());
        if (r == victim && WIFSTOPPED(st)) {  // stalled victim: reaped after the others
          victim_death = Clock::now();
          continue;
        }
        --remaining;
        if (r == victim) {
          if (sig == SIGKILL) victim_death = Clock::now();
          if (!WIFSIGNALED(st)) {
            std::fprintf(stderr, "run %d: victim not killed\n", run);
            ok = false;
          }
        } else {
          if (!WIFEXITED(st) || WEXITSTATUS(st) != 3) {
            std::fprintf(stderr, "run %d: rank %d status %#x (want exit 3)\n", run, r, st);
            ok = false;
          }
          if (victim_death != Clock::time_point{}) {
            double s = std::chrono::duration<double>(Clock::now() - victim_death).count();
            worst_s = std::max(worst_s, s);
            if (s > timeout_ms / 1000.0 + 3.0) {
              std::fprintf(stderr, "run %d: rank %d took %.2f s after the kill\n", run, r, s);
              ok = false;
            }
          }
        }
        continue;
      }
      if (Clock::now() > hard_deadline) {
        std::fprintf(stderr, "run %d: ranks hung; killing\n", run);
        for (pid_t p : pids) kill(p, SIGKILL);
        while (waitpid(-1, &st, 0) > 0) {
        }
        ok = false;
        break;
      }
      if (sig == SIGSTOP && remaining == 1 && victim_death != Clock::time_point{}) {
        kill(pids[victim], SIGKILL);  // every survivor is done: end the stalled victim
        waitpid(pids[victim], &st, 0);
        remaining = 0;
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    if (ok) ++passed;
  }
  std::printf(
      "%s: %d/%d runs passed with %d ranks (timeout %d ms, slowest survivor %.2f s "
      "after the victim %s)\n",
      sig == SIGKILL ? "kill" : "stall", passed, runs, nranks, timeout_ms, worst_s,
      sig == SIGKILL ? "died" : "stopped");
  return passed == runs ? 0 : 1;
}

// Large all-reduce (default 64 MiB) for every dtype x op, exact expected values. The data
// repeat with a prime period so the reference is computed once per period; the library does
// not know the period, and chunk boundaries never line up with it.
int scenario_big(int rank, int nranks, size_t bytes) {
  ncclComm_t comm;
  if (init_comm(rank, nranks, &comm)) return 1;
  const size_t period = 4099;
  int seed = 5000;
  for (const TypeInfo& t : kTypes) {
    const size_t count = bytes / t.size;
    std::vector<char> buf(count * t.size), want(count * t.size);
    for (int op = 0; op < 5; ++op) {
      ++seed;
      std::vector<char> in_period(period * t.size), want_period(period * t.size);
      fill_input(t, op, rank, seed, in_period.data(), period);
      for (size_t i = 0; i < period; ++i)
        expected_element(t, op, nranks, i, seed, want_period.data(), i, all_ranks(nranks));
      for (size_t i = 0; i < count; i += period) {
        size_t n = std::min(period, count - i);
        std::memcpy(buf.data() + i * t.size, in_period.data(), n * t.size);
        std::memcpy(want.data() + i * t.size, want_period.data(), n * t.size);
      }
      auto start = Clock::now();
      NCCL_OK(ncclAllReduce(buf.data(), buf.data(), count, t.type, static_cast<ncclRedOp_t>(op),
                            comm, nullptr));
      double s = std::chrono::duration<double>(Clock::now() - start).count();
      if (compare(t, buf.data(), want.data(), count, "big allreduce", op, count)) return 1;
      g_shared->digest[rank][0] = dq::fnv1a64(buf.data(), buf.size());
      if (rank == 0)
        std::printf("allreduce %zu MiB %-8s %-4s on %d ranks: correct (%.3f s)\n", bytes >> 20,
                    t.name, kOpNames[op], nranks, s);
    }
  }
  NCCL_OK(ncclCommDestroy(comm));
  return 0;
}

// Single process: ncclCommInitAll, then one thread drives every rank inside one group.
int scenario_initall(int nranks) {
  g_rank = 0;
  std::vector<ncclComm_t> comms(nranks);
  NCCL_OK(ncclCommInitAll(comms.data(), nranks, nullptr));
  const size_t count = 10007;
  std::vector<std::vector<int32_t>> bufs(nranks, std::vector<int32_t>(count));
  for (int r = 0; r < nranks; ++r)
    for (size_t i = 0; i < count; ++i) bufs[r][i] = r * 3 + static_cast<int32_t>(i % 17);
  NCCL_OK(ncclGroupStart());
  for (int r = 0; r < nranks; ++r)
    NCCL_OK(ncclAllReduce(bufs[r].data(), bufs[r].data(), count, ncclInt32, ncclSum, comms[r],
                          nullptr));
  NCCL_OK(ncclGroupEnd());
  for (int r = 0; r < nranks; ++r)
    for (size_t i = 0; i < count; ++i) {
      int32_t want = 3 * nranks * (nranks - 1) / 2 + nranks * static_cast<int32_t>(i % 17);
      FAIL_IF(bufs[r][i] != want, "initall rank %d element %zu: %d want %d", r, i, bufs[r][i],
              want);
    }
  // Threads, one per rank, without a group.
  std::vector<int> results(nranks, 0);
  std::vector<std::thread> threads;
  for (int r = 0; r < nranks; ++r)
    threads.emplace_back([&, r] {
      float x = static_cast<float>(r), y = 0;
      results[r] =
          ncclAllReduce(&x, &y, 1, ncclFloat32, ncclMax, comms[r], nullptr) == ncclSuccess &&
                  y == static_cast<float>(nranks - 1)
              ? 0
              : 1;
    });
  for (auto& th : threads) th.join();
  for (int r = 0; r < nranks; ++r) FAIL_IF(results[r] != 0, "threaded allreduce rank %d", r);
  for (auto c : comms) NCCL_OK(ncclCommDestroy(c));
  return 0;
}

int scenario_api() {
  g_rank = 0;
  int version = 0;
  NCCL_OK(ncclGetVersion(&version));
  FAIL_IF(version / 100 != 228, "version %d is not 2.28.x", version);
  FAIL_IF(std::strlen(ncclGetErrorString(ncclRemoteError)) == 0, "empty error string");
  void* p = nullptr;
  NCCL_OK(ncclMemAlloc(&p, 1024));
  FAIL_IF(p == nullptr, "ncclMemAlloc");
  NCCL_OK(ncclMemFree(p));
  // Invalid arguments are reported, not crashed on.
  FAIL_IF(ncclAllReduce(nullptr, nullptr, 1, ncclFloat32, ncclSum, nullptr, nullptr) !=
              ncclInvalidArgument,
          "NULL comm accepted");
  FAIL_IF(ncclGroupEnd() != ncclInvalidArgument, "unbalanced ncclGroupEnd accepted");
  // A one-rank comm works and a bad datatype / op is refused.
  ncclComm_t comm;
  if (init_comm(0, 1, &comm)) return 1;
  int32_t a[3] = {1, 2, 3}, b[3] = {0, 0, 0};
  NCCL_OK(ncclAllReduce(a, b, 3, ncclInt32, ncclSum, comm, nullptr));
  FAIL_IF(b[2] != 3, "1-rank allreduce");
  FAIL_IF(ncclAllReduce(a, b, 3, static_cast<ncclDataType_t>(99), ncclSum, comm, nullptr) !=
              ncclInvalidArgument,
          "bad dtype accepted");
  FAIL_IF(ncclAllReduce(a, b, 3, ncclInt32, static_cast<ncclRedOp_t>(77), comm, nullptr) !=
              ncclInvalidArgument,
          "bad op accepted");
  // A simulated group runs nothing, and a bad simInfo is refused.
  int32_t c[3] = {-1, -1, -1};
  ncclSimInfo_t sim = TEST_SIM_INFO_INITIALIZER;
  NCCL_OK(ncclGroupStart());
  NCCL_OK(ncclAllReduce(a, c, 3, ncclInt32, ncclSum, comm, nullptr));
  NCCL_OK(ncclGroupSimulateEnd(&sim));
  FAIL_IF(c[0] != -1 || c[2] != -1, "the simulated group's all-reduce ran");
  FAIL_IF(sim.estimatedTime < 0, "no estimate: %g", sim.estimatedTime);
  ncclSimInfo_t bad = sim;
  bad.magic = 0;
  NCCL_OK(ncclGroupStart());
  FAIL_IF(ncclGroupSimulateEnd(&bad) != ncclInvalidArgument, "an uninitialised simInfo accepted");
  NCCL_OK(ncclGroupEnd());
  NCCL_OK(ncclAllReduce(a, c, 3, ncclInt32, ncclSum, comm, nullptr));
  FAIL_IF(c[2] != 3, "all-reduce after a simulated group: %d", c[2]);
  ncclResult_t async = ncclInternalError;
  NCCL_OK(ncclCommGetAsyncError(comm, &async));
  FAIL_IF(async != ncclSuccess, "async error on a healthy comm");
  int dev = -1;
  NCCL_OK(ncclCommCuDevice(comm, &dev));
  FAIL_IF(dev != 0, "cuDevice");
  NCCL_OK(ncclCommFinalize(comm));
  NCCL_OK(ncclCommDestroy(comm));
  // A non-blocking communicator (main sets DYNAMIQ_CPU_NCCL_IN_PROGRESS_POLLS=2 for this job): its
  // all-reduce answers ncclInProgress, and until a poll finds it done, ncclCommCount, UserRank
  // and CuDevice are refused with ncclInvalidArgument, as NCCL's ncclCommEnsureReady refuses
  // them (a caller that reads the communicator's size then, as the shim does at each
  // reduce-scatter, must not rely on an answer NVIDIA's NCCL would not give).
  ncclConfig_t config = test_config(0, nullptr);
  ncclComm_t nb;
  g_shared->id_ready.store(0);
  if (init_comm(0, 1, &nb, &config)) return 1;
  FAIL_IF(ncclAllReduce(a, b, 3, ncclInt32, ncclSum, nb, nullptr) != ncclInProgress,
          "a non-blocking all-reduce did not answer ncclInProgress");
  int count = -1, me = -1;
  FAIL_IF(ncclCommCount(nb, &count) != ncclInvalidArgument, "ncclCommCount answered in progress");
  FAIL_IF(ncclCommUserRank(nb, &me) != ncclInvalidArgument,
          "ncclCommUserRank answered in progress");
  FAIL_IF(ncclCommCuDevice(nb, &dev) != ncclInvalidArgument,
          "ncclCommCuDevice answered in progress");
  ncclResult_t state = ncclInProgress;
  for (int poll = 0; poll < 100 && state == ncclInProgress; ++poll)
    NCCL_OK(ncclCommGetAsyncError(nb, &state));
  FAIL_IF(state != ncclSuccess, "the all-reduce never settled: %d", state);
  NCCL_OK(ncclCommCount(nb, &count));
  NCCL_OK(ncclCommUserRank(nb, &me));
  FAIL_IF(count != 1 || me != 0, "the settled communicator: rank %d of %d", me, count);
  NCCL_OK(ncclCommDestroy(nb));
  return 0;
}

int check_digests(int nranks) {
  for (int r = 1; r < nranks; ++r) {
    FAIL_IF(
        g_shared->digest_count[r] != g_shared->digest_count[0] || g_shared->digest_count[0] == 0,
        "digest counts differ");
    for (int s = 0; s < g_shared->digest_count[0]; ++s)
      FAIL_IF(g_shared->digest[r][s] != g_shared->digest[0][s],
              "result %d differs between rank 0 and rank %d", s, r);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s <scenario> <nranks> [runs]\n", argv[0]);
    return 2;
  }
  const std::string scenario = argv[1];
  const int nranks = std::atoi(argv[2]);
  if (nranks < 1 || nranks > kMaxRanks) return 2;
  void* mem =
      mmap(nullptr, sizeof(Shared), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (mem == MAP_FAILED) return 2;
  g_shared = new (mem) Shared();
  // Small chunks so that modest counts already cross several pipeline chunks.
  setenv("DYNAMIQ_CPU_NCCL_CHUNK_BYTES", "4096", 0);
  setenv("DYNAMIQ_CPU_NCCL_TIMEOUT_MS", "30000", 0);
  int rc = 2;
  if (scenario == "allreduce")
    rc = run_ranks(nranks, 600, scenario_allreduce);
  else if (scenario == "collectives")
    rc = run_ranks(nranks, 600, scenario_collectives);
  else if (scenario == "p2p")
    rc = run_ranks(nranks, 300, scenario_p2p);
  else if (scenario == "split")
    rc = run_ranks(nranks, 300, scenario_split);
  else if (scenario == "shrink" && nranks >= 3)
    rc = scenario_shrink(nranks);
  else if (scenario == "random") {
    rc = run_ranks(nranks, 600, scenario_random);
    if (rc == 0) rc = check_digests(nranks);
  } else if (scenario == "kill") {
    rc = scenario_kill(nranks, argc > 3 ? std::atoi(argv[3]) : 20, SIGKILL);
  } else if (scenario == "stall") {
    rc = scenario_kill(nranks, argc > 3 ? std::atoi(argv[3]) : 3, SIGSTOP);
  } else if (scenario == "big") {
    size_t mib = argc > 3 ? static_cast<size_t>(std::atol(argv[3])) : 64;
    setenv("DYNAMIQ_CPU_NCCL_CHUNK_BYTES", "1048576", 1);
    rc = run_ranks(nranks, 1800, [mib](int r, int n) { return scenario_big(r, n, mib << 20); });
  } else if (scenario == "initall")
    rc = scenario_initall(nranks);
  else if (scenario == "api") {
    setenv("DYNAMIQ_CPU_NCCL_IN_PROGRESS_POLLS", "2", 1);  // its non-blocking communicator
    rc = scenario_api();
  }
  std::printf("%s with %d ranks: %s\n", scenario.c_str(), nranks, rc == 0 ? "PASS" : "FAIL");
  return rc;
}

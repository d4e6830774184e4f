// Gradient collectives inside the caller's ncclGroupStart/End, through the preloaded shim on the
// CPU NCCL (Megatron coalesces every bucket this way). Usage: shim_groups NRANKS.
// Exit 0 pass, 1 fail, 77 skip (shim not preloaded).
//   1. one all-reduce in a group (Megatron's DDP bucket): compressed when the group ends
//   2. the first call of a fresh communicator in a group: the handshake runs at the group's end
//   3. an all-reduce, a reduce-scatter and a small all-reduce in one group: the two large ones
//      compressed, the small one passed through inside the group, exact
//   4. members on two communicators in one group: every member passes through, exact, no hang
//   5. a simulated group (ncclGroupSimulateEnd, NCCL's cost estimate): its all-reduce never runs,
//      not even at a later group's end, and the next call is compressed and complete on return
//   6. a non-blocking communicator (the CPU NCCL's model: each operation answers ncclInProgress,
//      settled after polls): its first group, an INT32 all-reduce and a large FP32 one, both held
//      for the handshake; the first passes through (ncclInProgress), the second must still run,
//      compressed, and the caller's polls then find every result in place
//   7. (3 ranks or more) a group on the world and on a split whose last rank is alone: the split's
//      call is not held on that rank (one rank reduces nothing), so its group holds the world's
//      call alone while the others hold two communicators' calls; the world's must take the same
//      path on every rank, passed through, exact (counted by held calls, the last rank compressed
//      it while the others passed it to NCCL: the two waited for each other)
//   8. one thread driving both ranks of a process-local communicator (ncclCommInitAll), and of its
//      split (made by one thread a rank), in one group: every member passes through, exact, no
//      hang (run one after another, the first rank's handshake would wait for the second's); the
//      same communicators compressed from a thread a rank
//   9. members on two communicators issued in one order on even ranks and the other on odd ones
//      (NCCL lets a group's members come in any order), each a new size for its communicator:
//      both pass through, exact, no hang (run one after another, each rank would wait in the
//      agreement of the communicator its peer reaches second)
//  10. a split the shim did not see made (NVIDIA's NCCL writes the handle of a split made inside a
//      group, or of a non-blocking communicator, after the split returns; here NCCL's own
//      ncclCommSplit is called past the shim): registered at its first call, and compressed
#include <dlfcn.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <thread>
#include <vector>

#include "common/nccl_api.h"
#include "tests/common/check.h"
#include "tests/common/rank_harness.h"

namespace {

using CountersFn = int (*)(void*, unsigned long long*, unsigned long long*);

unsigned long long rerouted(ncclComm_t comm) {
  static auto fn = reinterpret_cast<CountersFn>(dlsym(RTLD_DEFAULT, "dynamiqCommCounters"));
  unsigned long long r = 0, p = 0;
  fn(comm, &r, &p);
  return r;
}

// Integer-valued data: sums are exact in FP32, so a pass-through result is checkable bit for bit.
float value(int rank, size_t i) {
  return static_cast<float>(static_cast<int>((i * 7 + rank * 13) % 97) - 48);
}
std::vector<float> input(int rank, size_t n) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = value(rank, i);
  return v;
}
float exact(int n, size_t i) {
  float s = 0;
  for (int r = 0; r < n; ++r) s += value(r, i);
  return s;
}
// Relative squared error against the exact sum, elements [first, first + out.size()).
double rel_error(int n, const std::vector<float>& out, size_t first) {
  double num = 0, den = 0;
  for (size_t i = 0; i < out.size(); ++i) {
    const double e = exact(n, first + i);
    num += (out[i] - e) * (out[i] - e);
    den += e * e;
  }
  return num / den;
}
bool is_exact(int n, const std::vector<float>& out, size_t first) {
  for (size_t i = 0; i < out.size(); ++i)
    if (out[i] != exact(n, first + i)) return false;
  return true;
}

constexpr size_t kLarge = 1 << 20;  // 4 MiB FP32: above DYNAMIQ_MIN_BYTES
// This data has no locality (values spread evenly over -48..48): DynamiQ 5 bits measures about
// 2e-2 on it; a wrong block, order or scale gives 0.5 or more.
constexpr double kMaxError = 0.1;
constexpr size_t kSmall = 1000;  // below it

// Polls `comm` until its state leaves ncclInProgress, as NCCL documents for non-blocking
// communicators (at most 10 s): the state reached.
ncclResult_t settle(ncclComm_t comm, ncclResult_t r) {
  for (int poll = 0; r == ncclInProgress && poll < 100000; ++poll) {
    if (ncclCommGetAsyncError(comm, &r) != ncclSuccess) return ncclSystemError;
    if (r == ncclInProgress) usleep(100);
  }
  return r;
}

// Case 6's communicator: non-blocking, every other field NCCL's default.
ncclResult_t init_nonblocking(ncclComm_t* comm, int n, const ncclUniqueId& id, int rank) {
  ncclConfig_t c = DQ_NCCL_CONFIG_INITIALIZER;
  c.blocking = 0;
  return settle(*comm, ncclCommInitRankConfig(comm, n, id, rank, &c));
}

int rank_body(int n, int rank, const ncclUniqueId* ids) {
  ncclComm_t a = nullptr, b = nullptr, fresh = nullptr, nonblocking = nullptr;
  CHECK_OR(90, ncclCommInitRank(&a, n, ids[0], rank) == ncclSuccess, "init a");
  CHECK_OR(91, ncclCommInitRank(&b, n, ids[1], rank) == ncclSuccess, "init b");
  CHECK_OR(92, ncclCommInitRank(&fresh, n, ids[2], rank) == ncclSuccess, "init fresh");
  CHECK_OR(93, init_nonblocking(&nonblocking, n, ids[3], rank) == ncclSuccess, "init nonblocking");
  // Outside any group first, so communicator a has its handshake behind it.
  {
    auto in = input(rank, kLarge);
    std::vector<float> out(kLarge);
    CHECK_OR(10,
             ncclAllReduce(in.data(), out.data(), kLarge, ncclFloat32, ncclSum, a, nullptr) ==
                 ncclSuccess,
             "warm-up");
    CHECK_OR(11, rerouted(a) == 1, "warm-up not compressed");
  }
  // 1. Megatron's bucket: one in-place all-reduce in a group.
  {
    auto buf = input(rank, kLarge);
    CHECK_OR(20, ncclGroupStart() == ncclSuccess, "group start");
    CHECK_OR(21,
             ncclAllReduce(buf.data(), buf.data(), kLarge, ncclFloat32, ncclSum, a, nullptr) ==
                 ncclSuccess,
             "member");
    CHECK_OR(22, ncclGroupEnd() == ncclSuccess, "group end");
    CHECK_OR(23, rerouted(a) == 2, "1: the grouped all-reduce was not compressed");
    const double err = rel_error(n, buf, 0);
    CHECK_OR(24, err > 0 && err < kMaxError, "1: relative error %.3e", err);
  }
  // 2. A fresh communicator's first call inside a group.
  {
    auto in = input(rank, kLarge);
    std::vector<float> out(kLarge);
    CHECK_OR(30, ncclGroupStart() == ncclSuccess, "group start");
    CHECK_OR(31,
             ncclAllReduce(in.data(), out.data(), kLarge, ncclFloat32, ncclSum, fresh, nullptr) ==
                 ncclSuccess,
             "member");
    CHECK_OR(32, ncclGroupEnd() == ncclSuccess, "group end");
    CHECK_OR(33, rerouted(fresh) == 1, "2: not compressed after the handshake at group end");
    const double err = rel_error(n, out, 0);
    CHECK_OR(34, err > 0 && err < kMaxError, "2: relative error %.3e", err);
  }
  // 3. Three members: all-reduce, reduce-scatter (in place, as Megatron's distributed optimizer),
  //    and a small all-reduce that passes through inside the group.
  {
    auto ar = input(rank, kLarge);
    auto rs = input(rank, kLarge * n);
    auto small = input(rank, kSmall);
    CHECK_OR(40, ncclGroupStart() == ncclSuccess, "group start");
    CHECK_OR(41,
             ncclAllReduce(ar.data(), ar.data(), kLarge, ncclFloat32, ncclSum, a, nullptr) ==
                 ncclSuccess,
             "member ar");
    float* shard = rs.data() + static_cast<size_t>(rank) * kLarge;
    CHECK_OR(42,
             ncclReduceScatter(rs.data(), shard, kLarge, ncclFloat32, ncclSum, a, nullptr) ==
                 ncclSuccess,
             "member rs");
    CHECK_OR(43,
             ncclAllReduce(small.data(), small.data(), kSmall, ncclFloat32, ncclSum, a, nullptr) ==
                 ncclSuccess,
             "member small");
    CHECK_OR(44, ncclGroupEnd() == ncclSuccess, "group end");
    CHECK_OR(45, rerouted(a) == 4, "3: %llu compressed calls so far, expected 4", rerouted(a));
    CHECK_OR(46, is_exact(n, small, 0), "3: the small member is not exact");
    const double e_ar = rel_error(n, ar, 0);
    const double e_rs = rel_error(n, std::vector<float>(shard, shard + kLarge), rank * kLarge);
    CHECK_OR(47, e_ar > 0 && e_ar < kMaxError && e_rs > 0 && e_rs < kMaxError,
             "3: relative errors %.3e (all-reduce) %.3e (reduce-scatter)", e_ar, e_rs);
  }
  // 4. Members on two communicators: both pass through, exactly.
  {
    auto x = input(rank, kLarge), y = input(rank, kLarge);
    const unsigned long long ra = rerouted(a), rb = rerouted(b);
    CHECK_OR(50, ncclGroupStart() == ncclSuccess, "group start");
    CHECK_OR(
        51,
        ncclAllReduce(x.data(), x.data(), kLarge, ncclFloat32, ncclSum, a, nullptr) == ncclSuccess,
        "member a");
    CHECK_OR(
        52,
        ncclAllReduce(y.data(), y.data(), kLarge, ncclFloat32, ncclSum, b, nullptr) == ncclSuccess,
        "member b");
    CHECK_OR(53, ncclGroupEnd() == ncclSuccess, "group end");
    CHECK_OR(54, rerouted(a) == ra && rerouted(b) == rb, "4: a member was compressed");
    CHECK_OR(55, is_exact(n, x, 0) && is_exact(n, y, 0), "4: not exact");
  }
  // 5. A simulated group: NCCL estimates its members and runs none.
  {
    constexpr float kUntouched = 12345.0f;
    auto in = input(rank, kLarge);
    std::vector<float> simulated(kLarge, kUntouched), out(kLarge, kUntouched);
    const unsigned long long before = rerouted(a);
    ncclSimInfo_t info = DQ_NCCL_SIM_INFO_INITIALIZER;
    CHECK_OR(60, ncclGroupStart() == ncclSuccess, "group start");
    CHECK_OR(61,
             ncclAllReduce(in.data(), simulated.data(), kLarge, ncclFloat32, ncclSum, a, nullptr) ==
                 ncclSuccess,
             "member");
    CHECK_OR(62, ncclGroupSimulateEnd(&info) == ncclSuccess, "simulated end");
    CHECK_OR(63, info.estimatedTime >= 0, "5: no estimate (%g)", info.estimatedTime);
    CHECK_OR(64,
             ncclAllReduce(in.data(), out.data(), kLarge, ncclFloat32, ncclSum, a, nullptr) ==
                 ncclSuccess,
             "the call after it");
    CHECK_OR(65, rerouted(a) == before + 1, "5: the call after a simulated group: %llu compressed",
             rerouted(a) - before);
    const double err = rel_error(n, out, 0);
    CHECK_OR(66, err > 0 && err < kMaxError, "5: the call after it: relative error %.3e", err);
    CHECK_OR(67, ncclGroupStart() == ncclSuccess && ncclGroupEnd() == ncclSuccess, "empty group");
    for (size_t i = 0; i < kLarge; ++i)
      CHECK_OR(68, simulated[i] == kUntouched, "5: the simulated all-reduce wrote element %zu", i);
    CHECK_OR(69, rerouted(a) == before + 1, "5: the simulated all-reduce ran");
  }
  // 6. A non-blocking communicator's first group.
  {
    std::vector<int32_t> counts(kSmall);
    for (size_t i = 0; i < kSmall; ++i) counts[i] = static_cast<int32_t>(i) + rank;
    auto grads = input(rank, kLarge);
    CHECK_OR(70, ncclGroupStart() == ncclSuccess, "group start");
    CHECK_OR(71,
             ncclAllReduce(counts.data(), counts.data(), kSmall, ncclInt32, ncclSum, nonblocking,
                           nullptr) == ncclSuccess,
             "member int32");
    CHECK_OR(72,
             ncclAllReduce(grads.data(), grads.data(), kLarge, ncclFloat32, ncclSum, nonblocking,
                           nullptr) == ncclSuccess,
             "member fp32");
    const ncclResult_t end = settle(nonblocking, ncclGroupEnd());
    CHECK_OR(73, end == ncclSuccess, "6: group end settled to %s", ncclGetErrorString(end));
    for (size_t i = 0; i < kSmall; ++i)
      CHECK_OR(74, counts[i] == static_cast<int32_t>(n * i + n * (n - 1) / 2),
               "6: the int32 member's element %zu is %d", i, counts[i]);
    const double err = rel_error(n, grads, 0);
    CHECK_OR(75, err > 0 && err < kMaxError,
             "6: the fp32 member after an in-progress pass-through: relative error %.3e (never "
             "issued?)",
             err);
    CHECK_OR(76, rerouted(nonblocking) == 1, "6: %llu compressed calls, 1 expected",
             rerouted(nonblocking));
  }
  // 7. The world and a split that leaves the last rank alone, in one group.
  if (n >= 3) {
    ncclComm_t part = nullptr;
    const bool alone = rank == n - 1;
    CHECK_OR(80, ncclCommSplit(a, alone ? 1 : 0, rank, &part, nullptr) == ncclSuccess, "split");
    auto x = input(rank, kLarge), y = input(rank, kLarge);
    const unsigned long long ra = rerouted(a);
    CHECK_OR(81, ncclGroupStart() == ncclSuccess, "group start");
    CHECK_OR(
        82,
        ncclAllReduce(x.data(), x.data(), kLarge, ncclFloat32, ncclSum, a, nullptr) == ncclSuccess,
        "member on the world");
    CHECK_OR(83,
             ncclAllReduce(y.data(), y.data(), kLarge, ncclFloat32, ncclSum, part, nullptr) ==
                 ncclSuccess,
             "member on the split");
    CHECK_OR(84, ncclGroupEnd() == ncclSuccess, "group end");
    CHECK_OR(85, rerouted(a) == ra, "7: the world's member compressed");
    CHECK_OR(86, is_exact(n, x, 0), "7: the world's member is not exact");
    if (alone) {
      for (size_t i = 0; i < kLarge; ++i)
        CHECK_OR(87, y[i] == value(rank, i), "7: the lone rank's split member, element %zu", i);
    } else {
      CHECK_OR(88, rerouted(part) == 0, "7: the split's member compressed");
      CHECK_OR(89, is_exact(n - 1, y, 0), "7: the split's member is not exact");  // ranks 0 .. n-2
    }
    ncclCommDestroy(part);
  }
  // 8. Both ranks of a process-local communicator, and of its split, driven by this thread.
  {
    constexpr int kLocal = 2;
    ncclComm_t local[kLocal] = {}, halves[kLocal] = {};
    CHECK_OR(100, ncclCommInitAll(local, kLocal, nullptr) == ncclSuccess, "init all");
    ncclResult_t split_result[kLocal] = {ncclInternalError, ncclInternalError};
    {
      std::vector<std::thread> splitters;  // a split is collective: one thread a rank
      for (int r = 0; r < kLocal; ++r)
        splitters.emplace_back(
            [&, r] { split_result[r] = ncclCommSplit(local[r], 0, r, &halves[r], nullptr); });
      for (auto& t : splitters) t.join();
    }
    CHECK_OR(101, split_result[0] == ncclSuccess && split_result[1] == ncclSuccess, "local split");
    for (ncclComm_t* comms : {local, halves}) {
      std::vector<std::vector<float>> bufs;
      for (int r = 0; r < kLocal; ++r) bufs.push_back(input(r, kLarge));
      CHECK_OR(102, ncclGroupStart() == ncclSuccess, "group start");
      for (int r = 0; r < kLocal; ++r)
        CHECK_OR(103,
                 ncclAllReduce(bufs[r].data(), bufs[r].data(), kLarge, ncclFloat32, ncclSum,
                               comms[r], nullptr) == ncclSuccess,
                 "local member %d", r);
      CHECK_OR(104, ncclGroupEnd() == ncclSuccess, "group end");
      for (int r = 0; r < kLocal; ++r) {
        CHECK_OR(105, rerouted(comms[r]) == 0, "8: %s member %d compressed",
                 comms == local ? "a local" : "a split's", r);
        CHECK_OR(106, is_exact(kLocal, bufs[r], 0), "8: %s member %d not exact",
                 comms == local ? "a local" : "a split's", r);
      }
    }
    // The same communicators are compressed when each rank has a thread of its own (so what
    // passed the group's members through was the rule, not the communicators' opt-in).
    {
      std::vector<std::vector<float>> bufs;
      for (int r = 0; r < kLocal; ++r) bufs.push_back(input(r, kLarge));
      ncclResult_t results[kLocal] = {ncclInternalError, ncclInternalError};
      std::vector<std::thread> callers;
      for (int r = 0; r < kLocal; ++r)
        callers.emplace_back([&, r] {
          results[r] = ncclAllReduce(bufs[r].data(), bufs[r].data(), kLarge, ncclFloat32, ncclSum,
                                     local[r], nullptr);
        });
      for (auto& t : callers) t.join();
      for (int r = 0; r < kLocal; ++r) {
        CHECK_OR(107, results[r] == ncclSuccess && rerouted(local[r]) == 1,
                 "8: local rank %d on a thread of its own: %s, %llu compressed (1 expected)", r,
                 ncclGetErrorString(results[r]), rerouted(local[r]));
        const double err = rel_error(kLocal, bufs[r], 0);
        CHECK_OR(108, err > 0 && err < kMaxError, "8: local rank %d: relative error %.3e", r, err);
      }
    }
    for (int r = 0; r < kLocal; ++r) {
      ncclCommDestroy(halves[r]);
      ncclCommDestroy(local[r]);
    }
  }
  // 9. Two communicators' members in either order, each a new size for its communicator.
  {
    constexpr size_t kCount = kLarge / 2;
    auto x = input(rank, kCount), y = input(rank, kCount);
    const unsigned long long ra = rerouted(a), rb = rerouted(b);
    CHECK_OR(110, ncclGroupStart() == ncclSuccess, "group start");
    for (int k = 0; k < 2; ++k) {
      const bool first_a = (k == 0) == (rank % 2 == 0);
      CHECK_OR(111,
               ncclAllReduce(first_a ? x.data() : y.data(), first_a ? x.data() : y.data(), kCount,
                             ncclFloat32, ncclSum, first_a ? a : b, nullptr) == ncclSuccess,
               "member %d", k);
    }
    CHECK_OR(112, ncclGroupEnd() == ncclSuccess, "9: group end");
    CHECK_OR(113, rerouted(a) == ra && rerouted(b) == rb, "9: a member was compressed");
    CHECK_OR(114, is_exact(n, x, 0) && is_exact(n, y, 0), "9: not exact");
  }
  // 10. A split the shim did not see made.
  {
    using SplitFn = ncclResult_t (*)(ncclComm_t, int, int, ncclComm_t*, ncclConfig_t*);
    void* nccl = dlopen("libnccl.so.2", RTLD_NOW | RTLD_NOLOAD);
    CHECK_OR(120, nccl != nullptr, "libnccl.so.2 is not loaded: %s", dlerror());
    auto nccl_split = reinterpret_cast<SplitFn>(dlsym(nccl, "ncclCommSplit"));
    CHECK_OR(121, nccl_split != nullptr, "NCCL's ncclCommSplit: %s", dlerror());
    ncclComm_t unseen = nullptr;
    CHECK_OR(122, nccl_split(a, 0, rank, &unseen, nullptr) == ncclSuccess && unseen != nullptr,
             "NCCL's own split");
    auto x = input(rank, kLarge);
    CHECK_OR(123,
             ncclAllReduce(x.data(), x.data(), kLarge, ncclFloat32, ncclSum, unseen, nullptr) ==
                 ncclSuccess,
             "10: the call");
    CHECK_OR(124, rerouted(unseen) == 1, "10: %llu compressed, 1 expected", rerouted(unseen));
    const double err = rel_error(n, x, 0);
    CHECK_OR(125, err > 0 && err < kMaxError, "10: relative error %.3e", err);
    ncclCommDestroy(unseen);
    dlclose(nccl);
  }
  ncclCommDestroy(a);
  ncclCommDestroy(b);
  ncclCommDestroy(fresh);
  ncclCommDestroy(nonblocking);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (dlsym(RTLD_DEFAULT, "dynamiqCommCounters") == nullptr) {
    std::printf("SKIP: libdynamiq.so is not preloaded\n");
    return 77;
  }
  const int n = argc > 1 ? std::atoi(argv[1]) : 4;
  setenv("DYNAMIQ_ENABLE", "1", 1);
  // Case 6: the CPU NCCL answers for non-blocking communicators as NVIDIA's may.
  setenv("DYNAMIQ_CPU_NCCL_IN_PROGRESS_POLLS", "3", 1);
  dq::test::RankOptions opt;
  opt.timeout_s = 240;
  const auto exits = dq::test::run_ranks<ncclUniqueId>(
      n, 4, ncclGetUniqueId, opt,
      [n](int r, const ncclUniqueId* ids) { return rank_body(n, r, ids); });
  int failed = 0;
  for (int r = 0; r < n; ++r)
    if (!exits[r].exited(0)) {
      std::fprintf(stderr, "FAIL: rank %d %s\n", r, exits[r].describe().c_str());
      failed = 1;
    }
  if (!failed) std::printf("groups %d ranks: all cases pass\n", n);
  return failed;
}

// Soak: N ranks through the preloaded shim on the CPU NCCL, CALLS calls of
// random shape, checked one by one, with the process's resources sampled after every call.
//
// Usage: soak CALLS MAX_BYTES [SEED] [NRANKS] [WARMUP] [RSS_LIMIT_PCT] [TRIM]
//        (exit 0 pass, 1 fail, 77 not preloaded)
// WARMUP: calls before the resource baseline (default CALLS/10); RSS_LIMIT_PCT: allowed growth
// after it (default 1) of RSS less the shim's plan cache. The engine keeps 16 plans (LRU by
// shape), so with random sizes the memory it holds follows the sizes of the 16 latest shapes:
// raw RSS is bounded but not flat (docs/results/robustness.md, soak). The shim reports what its
// plans hold (held_bytes in its metrics) and maps their buffers, so RSS less that is what must
// stay flat.
//
// Every rank draws the same sequence from SEED. Each call picks: a collective (ncclAllReduce 1/2,
// ncclReduceScatter 1/4, ncclReduce 1/4, random root), a dtype (FP32, BF16), an op (SUM, AVG,
// or MAX 1/10, which always passes through), in place or not, a communicator (the opted-in one
// 4/5, or a split of it opted out with dynamiqCommRegister(comm, 0) before its first call), and a
// size log-uniform in [1 KiB, MAX_BYTES] (DYNAMIQ_MIN_BYTES is 64K, so most calls on the opted-in
// communicator are eligible). Before a call, with probability 1/20, rank 0 flips the A/B switch
// (DYNAMIQ_CONTROL_FILE); the switch read on an eligible call applies a control window of
// eligible calls later (DYNAMIQ_CONTROL_WINDOW, its default here; docs/ENGINE.md section 3), so
// every rank predicts which calls are compressed.
//
// Data are small integers (a bell-shaped sum of four nibbles, -30..30), so every sum, and every
// average over a power-of-two number of ranks (NRANKS must be one), is exact in FP32 and BF16
// whatever the order of additions. Per call, every rank checks:
//  - compressed exactly when predicted (dynamiqCommCounters), the same on every rank;
//  - a pass-through result is bit-exact;
//  - a compressed result is finite with vNMSE (squared error over squared exact result) below
//    kMaxVnmse; all-reduce results are bit-identical on every rank (a hash, MAX-reduced);
//  - the caller's input of an out-of-place call is untouched (a hash before and after).
// One small check all-reduce per call (on the opted-out communicator) carries every rank's
// verdict, so all ranks stop together on the first failure.
// Resources, sampled after every call on every rank: VmRSS (/proc/self/status), open file
// descriptors (/proc/self/fd) and threads (/proc/self/task); fds and threads may not grow at all
// after a warm-up of the first 10% of calls (WARMUP). RSS less the plan cache is sampled at
// kNetSamples evenly spaced calls after warm-up; its growth is the median of the last
// kNetWindow samples against the median of the first kNetWindow, and must stay under
// RSS_LIMIT_PCT. Medians, not the two end points: one sample moves by a few MiB with what the
// last call happened to allocate (the first full run's end points moved -1.22% .. +1.05% on
// four ranks whose malloc in-use bytes grew 0.2%; docs/results/robustness.md, soak), while a
// leak raises every later sample. The end-point figures are printed too, with the bytes malloc
// has in use (mallinfo2): flat in-use bytes with a rising RSS is the allocator keeping freed
// memory.
// TRIM=1 (default 0) calls malloc_trim(0) before each of the kNetSamples samples, so they count
// what the process holds, not the free heap pages glibc keeps: it tells a leak (still grows)
// from the allocator's retention (flat once trimmed). The judged series is then the trimmed one.
#include <dirent.h>
#include <dlfcn.h>
#include <malloc.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "common/fnv1a.h"
#include "common/nccl_api.h"
#include "config/settings.h"
#include "kernels/bf16.h"
#include "tests/common/rank_harness.h"
#include "tests/common/test_data.h"
#include "tests/common/text_file.h"

namespace {

using CountersFn = int (*)(void*, unsigned long long*, unsigned long long*);
using dq::test::read_file;
using dq::test::Rng;
using dq::test::splitmix;
using dq::test::write_text;
using RegisterFn = int (*)(void*, int);

constexpr size_t kMinBytes = 64 * 1024;  // DYNAMIQ_MIN_BYTES for the run
constexpr double kMaxVnmse = 0.05;       // measured: ~1e-3..2e-2 (docs/results/robustness.md)
constexpr int kFlipOneIn = 20;

std::string g_dir;
bool g_trace = false;  // DQ_SOAK_TRACE=1: one line per call in the rank logs
bool g_trim = false;   // TRIM argument: malloc_trim(0) before each RSS sample

CountersFn counters_fn() {
  return reinterpret_cast<CountersFn>(dlsym(RTLD_DEFAULT, "dynamiqCommCounters"));
}

enum Coll { kAllReduce, kReduceScatter, kReduce };
const char* coll_name(int c) {
  return c == kAllReduce ? "allreduce" : c == kReduceScatter ? "reducescatter" : "reduce";
}

struct Call {
  int coll, root;
  bool bf16, inplace, opted, flip;
  ncclRedOp_t op;
  size_t count;  // send elements (reduce-scatter: recvcount * n)
  uint64_t key;
};

Call draw(Rng& rng, int n, size_t max_bytes) {
  Call c;
  const int cr = rng.below(4);
  c.coll = cr < 2 ? kAllReduce : cr == 2 ? kReduceScatter : kReduce;
  c.root = rng.below(n);
  c.bf16 = rng.below(2) == 1;
  const int o = rng.below(10);
  c.op = o == 0 ? ncclMax : o <= 5 ? ncclSum : ncclAvg;
  c.inplace = rng.below(2) == 1;
  c.opted = rng.below(5) != 0;
  c.flip = rng.below(kFlipOneIn) == 0;
  const double lo = std::log(1024.0), hi = std::log(static_cast<double>(max_bytes));
  const size_t bytes = static_cast<size_t>(std::exp(lo + (hi - lo) * rng.uniform()));
  const size_t esize = c.bf16 ? 2 : 4;
  c.count = std::max<size_t>(1, bytes / esize);
  if (c.coll == kReduceScatter) c.count = std::max<size_t>(1, c.count / n) * n;
  c.key = rng.next();
  return c;
}

long vmrss_kib() {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("VmRSS:", 0) == 0) return std::atol(line.c_str() + 6);
  return -1;
}

int count_dir(const char* path) {
  DIR* d = opendir(path);
  if (!d) return -1;
  int n = 0;
  while (dirent* e = readdir(d))
    if (e->d_name[0] != '.') ++n;
  closedir(d);
  return n - (std::strcmp(path, "/proc/self/fd") == 0 ? 1 : 0);  // opendir's own descriptor
}

struct Sample {
  long rss;
  int fds, threads;
};

// RSS less the plan cache: kNetSamples samples after warm-up, growth judged on the medians of
// the first and last kNetWindow of them.
constexpr int kNetSamples = 200, kNetWindow = 20;

long median_of(std::vector<long> v) {
  if (v.empty()) return 0;
  std::nth_element(v.begin(), v.begin() + static_cast<long>(v.size() / 2), v.end());
  return v[v.size() / 2];
}

struct Stats {
  int calls = 0, compressed = 0, passed = 0, flips = 0, over_budget = 0, switch_off = 0;
  // Per (collective, dtype): the largest count passed as over budget, the smallest compressed.
  size_t max_over[6] = {0, 0, 0, 0, 0, 0};
  size_t min_fit[6] = {SIZE_MAX, SIZE_MAX, SIZE_MAX, SIZE_MAX, SIZE_MAX, SIZE_MAX};
  double max_vnmse = 0, sum_vnmse = 0;
  long rss_first = 0, rss_warm = 0, rss_end = 0, rss_max_after = 0, heap_warm = 0, heap_end = 0;
  long held_warm = 0, held_end = 0;  // KiB the shim's cached plans hold (its held_bytes metric)
  long net_first = 0, net_last = 0;  // KiB, medians of the first and last windows of samples
  std::vector<long> net_samples;     // RSS less the plan cache, KiB, after warm-up
  int fds_warm = 0, fds_end = 0, fds_max_after = 0, threads_warm = 0, threads_end = 0,
      threads_max_after = 0;
  double seconds = 0;
};

// The shim's metrics file, rewritten now (dynamiqMetricsFlush); empty when that fails.
std::string flushed_metrics() {
  auto flush = reinterpret_cast<int (*)()>(dlsym(RTLD_DEFAULT, "dynamiqMetricsFlush"));
  const char* path = std::getenv("DYNAMIQ_METRICS_FILE");
  if (!flush || !path || flush() != 0) return "";
  return read_file(path);
}

// An integer field of a flat JSON object's text, or -1.
long long json_field(const std::string& obj, const char* key) {
  const std::string k = std::string("\"") + key + "\":";
  const size_t p = obj.find(k);
  return p == std::string::npos ? -1 : std::atoll(obj.c_str() + p + k.size());
}

// The text of each object of the metrics JSON's "communicators" array, found by brace depth
// (strings skipped), so nested objects such as "budget" and "calls" stay inside their
// communicator whatever their order.
std::vector<std::string> communicator_objects(const std::string& m) {
  std::vector<std::string> out;
  const std::string key = "\"communicators\":[";
  size_t p = m.find(key);
  if (p == std::string::npos) return out;
  int depth = 0;
  size_t start = 0;
  bool in_string = false;
  for (p += key.size(); p < m.size(); ++p) {
    const char c = m[p];
    if (in_string) {
      if (c == '\\')
        ++p;  // skip the escaped character
      else if (c == '"')
        in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '{') {
      if (depth++ == 0) start = p;
    } else if (c == '}') {
      if (--depth == 0) out.push_back(m.substr(start, p - start + 1));
      if (depth < 0) break;
    } else if (c == ']' && depth == 0) {
      break;
    }
  }
  return out;
}

// Bytes all of this process's communicators' cached plans hold (their "held_bytes"), in KiB, or
// -1 when a communicator lacks it.
long held_kib() {
  long long total = 0;
  bool any = false;
  for (const std::string& obj : communicator_objects(flushed_metrics())) {
    const long long held = json_field(obj, "held_bytes");
    if (held < 0) return -1;
    total += held;
    any = true;
  }
  return any ? static_cast<long>(total / 1024) : -1;
}

// The command line (see the usage at the top).
struct Args {
  int calls = 0, n = 4, warm = 0;
  size_t max_bytes = 0;
  uint64_t seed = 16;
  double rss_limit = 1.0;
};

const char* op_name(ncclRedOp_t op) {
  return op == ncclMax ? "max" : op == ncclSum ? "sum" : "avg";
}

// One rank's state through the soak.
struct RankRun {
  int n = 0, rank = 0;
  ncclComm_t comm = nullptr;  // opted in
  ncclComm_t off = nullptr;   // a split of comm, opted out; it also carries the verdicts
  int calls = 0, warm = 0;
  size_t max_bytes = 0;
  std::string control;
  Stats* st = nullptr;
  std::vector<unsigned char> send, recv;
  bool file_on = true;     // what the control file says (rank 0 writes it)
  bool applied_on = true;  // the switch the next eligible call applies
  // The switch words of the latest eligible calls that sent one, oldest first, at most a window:
  // the next such call applies the oldest once the window is full (before: the handshake's, on).
  std::deque<bool> sent;
  size_t window = static_cast<size_t>(dq::config::Settings{}.control_window);
};

// One call as issued: where its result lands, what the model predicted and what happened.
struct Issued {
  Call c;
  size_t esize = 0, recvcount = 0;
  size_t first = 0;  // element offset of the result in the full reduced vector
  unsigned char* dst = nullptr;
  uint64_t send_hash = 0;
  bool eligible = false, expect_compressed = false, compressed = false, over_budget = false;
  ncclResult_t res = ncclSuccess;
};

// A call's verdict: 0, or the code of the first failed check and why.
struct Verdict {
  int bad = 0;
  char why[256] = {0};
};

// Call c: the switch flipped first if drawn so, the input written, the collective issued on
// the communicator drawn, and whether it was compressed read from the shim's counters.
Issued issue_call(RankRun& w, const Call& c) {
  Issued x;
  x.c = c;
  if (c.flip) {
    w.file_on = !w.file_on;
    if (w.rank == 0) write_text(w.control, w.file_on ? "on\n" : "off\n");
    ++w.st->flips;
  }
  x.esize = c.bf16 ? 2 : 4;
  x.recvcount = c.coll == kReduceScatter ? c.count / w.n : c.count;
  const ncclDataType_t dt = c.bf16 ? ncclBfloat16 : ncclFloat32;
  for (size_t i = 0; i < c.count; ++i)
    dq::test::store_element(w.send.data(), i, c.bf16,
                            static_cast<float>(dq::test::bell_value(c.key, w.rank, i)));
  x.send_hash = c.inplace ? 0 : dq::fnv1a64(w.send.data(), c.count * x.esize);
  // Where the result lands, and which elements of the full vector it holds.
  x.dst = w.recv.data();
  if (c.coll == kReduceScatter) x.first = static_cast<size_t>(w.rank) * x.recvcount;
  if (c.inplace)
    x.dst = w.send.data() + (c.coll == kReduceScatter ? x.first * x.esize : 0);
  else
    std::memset(w.recv.data(), 0xCD, x.recvcount * x.esize);
  x.eligible = c.opted && c.op != ncclMax && c.count * x.esize >= kMinBytes;
  // The switch model (docs/ENGINE.md section 3): an eligible call applies the switch word
  // agreed on the last eligible call that sent one. A call passed through by the switch sends
  // its word; a compressed call sends its word; a call whose plan does not fit the bit budget
  // (too few elements: "over_budget") passes through without sending one.
  x.expect_compressed = x.eligible && w.applied_on;
  ncclComm_t use = c.opted ? w.comm : w.off;
  unsigned long long r0 = 0, p0 = 0, r1 = 0, p1 = 0;
  counters_fn()(use, &r0, &p0);
  if (c.coll == kAllReduce)
    x.res = ncclAllReduce(w.send.data(), x.dst, c.count, dt, c.op, use, nullptr);
  else if (c.coll == kReduceScatter)
    x.res = ncclReduceScatter(w.send.data(), x.dst, x.recvcount, dt, c.op, use, nullptr);
  else
    x.res = ncclReduce(w.send.data(), x.dst, c.count, dt, c.op, c.root, use, nullptr);
  counters_fn()(use, &r1, &p1);
  x.compressed = r1 > r0;
  return x;
}

// The model's bookkeeping after call k: over-budget pass-throughs, the switch's, and the
// switch word the next eligible call applies.
void account_call(RankRun& w, int k, Issued& x) {
  const Call& c = x.c;
  Stats* st = w.st;
  if (x.eligible && w.applied_on && !x.compressed) {
    x.over_budget = true;  // checked against the shim's own counters at the end of the run
    ++st->over_budget;
    const int slot = c.coll * 2 + (c.bf16 ? 1 : 0);
    st->max_over[slot] = std::max(st->max_over[slot], c.count);
  } else if (x.compressed) {
    const int slot = c.coll * 2 + (c.bf16 ? 1 : 0);
    st->min_fit[slot] = std::min(st->min_fit[slot], c.count);
  }
  if (x.eligible && !w.applied_on) ++st->switch_off;
  if (x.eligible && !x.over_budget) {
    w.sent.push_back(w.file_on);  // rank 0 read the file in this call
    if (w.sent.size() == w.window) {
      w.applied_on = w.sent.front();
      w.sent.pop_front();
    }
  }
  if (g_trace)
    std::fprintf(stderr,
                 "call %d: %s %s %s count %zu %s %s flip %d eligible %d expected %d got %d\n", k,
                 coll_name(c.coll), c.bf16 ? "bf16" : "f32", op_name(c.op), c.count,
                 c.inplace ? "in-place" : "out-of-place", c.opted ? "opted-in" : "opted-out",
                 c.flip, x.eligible, x.expect_compressed, x.compressed);
}

// This rank's checks of a call: its return code, compressed as predicted, its result (exact
// when passed through, finite and within kMaxVnmse when compressed), the input untouched.
Verdict check_call(RankRun& w, const Issued& x) {
  const Call& c = x.c;
  Verdict v;
  const bool has_result = c.coll != kReduce || w.rank == c.root;
  double num = 0, den = 0;
  bool finite = true;
  if (x.res != ncclSuccess) {
    v.bad = 10;
    std::snprintf(v.why, sizeof v.why, "returned %d", static_cast<int>(x.res));
  } else if (x.compressed != x.expect_compressed && !x.over_budget) {
    v.bad = 11;
    std::snprintf(v.why, sizeof v.why, "compressed %d, expected %d (eligible %d)", x.compressed,
                  x.expect_compressed, x.eligible);
  } else if (has_result) {
    const size_t m = c.coll == kReduceScatter ? x.recvcount : c.count;
    for (size_t j = 0; j < m && !v.bad; ++j) {
      const size_t i = x.first + j;
      double want = dq::test::bell_reduced(c.key, w.n, i, c.op == ncclMax);
      if (c.op == ncclAvg) want /= w.n;
      const float got = dq::test::load_element(x.dst, j, c.bf16);
      if (!x.compressed) {
        if (got != static_cast<float>(want)) {
          v.bad = 12;
          std::snprintf(v.why, sizeof v.why, "pass-through element %zu is %g, exact %g", i,
                        static_cast<double>(got), want);
        }
      } else {
        finite = finite && std::isfinite(got);
        num += (got - want) * (got - want);
        den += want * want;
      }
    }
    if (!v.bad && x.compressed) {
      const double e = den > 0 ? num / den : num;
      w.st->max_vnmse = std::max(w.st->max_vnmse, e);
      w.st->sum_vnmse += e;
      if (g_trace)
        std::fprintf(stderr, "  %s %s %s count %zu (this rank: %zu): vNMSE %.4e\n",
                     coll_name(c.coll), c.bf16 ? "bf16" : "f32", op_name(c.op), c.count, m, e);
      if (!finite || !(e < kMaxVnmse)) {
        v.bad = 13;
        std::snprintf(v.why, sizeof v.why, "compressed result: finite %d, vNMSE %.4e (bound %.2g)",
                      finite, e, kMaxVnmse);
      }
    }
  }
  if (!v.bad && !c.inplace && dq::fnv1a64(w.send.data(), c.count * x.esize) != x.send_hash) {
    v.bad = 14;
    std::snprintf(v.why, sizeof v.why, "the input of an out-of-place call changed");
  }
  return v;
}

// Every rank's verdict on call k, and the result's identity across ranks, in one small
// all-reduce on the opted-out communicator: 0 when every rank passed, else the rank's exit code.
int agree_on_call(RankRun& w, int k, const Issued& x, Verdict& v) {
  const Call& c = x.c;
  // MAX of (x, ~x) is (max, ~min).
  const uint64_t h = c.coll == kAllReduce ? dq::fnv1a64(x.dst, c.count * x.esize) : 0;
  uint64_t words[6] = {h,
                       ~h,
                       static_cast<uint64_t>(x.compressed),
                       ~static_cast<uint64_t>(x.compressed),
                       static_cast<uint64_t>(v.bad),
                       0};
  if (ncclAllReduce(words, words, 6, ncclUint64, ncclMax, w.off, nullptr) != ncclSuccess) {
    std::fprintf(stderr, "call %d: the check all-reduce failed\n", k);
    return 20;
  }
  if (!v.bad && words[0] != ~words[1]) {
    v.bad = 15;
    std::snprintf(v.why, sizeof v.why, "results differ across ranks");
  }
  if (!v.bad && words[2] != ~words[3]) {
    v.bad = 16;
    std::snprintf(v.why, sizeof v.why, "compressed on some ranks only");
  }
  if (v.bad || words[4] != 0) {
    std::fprintf(stderr,
                 "call %d (%s %s %s %s %s, %zu elements, root %d, comm %s): %s (worst verdict "
                 "over ranks %llu)\n",
                 k, coll_name(c.coll), c.bf16 ? "bf16" : "f32", op_name(c.op),
                 c.inplace ? "in-place" : "out-of-place", x.compressed ? "compressed" : "passed",
                 c.count, c.root, c.opted ? "opted-in" : "opted-out",
                 v.bad ? v.why : "another rank failed", static_cast<unsigned long long>(words[4]));
    return v.bad ? v.bad : 30;
  }
  return 0;
}

long malloc_in_use_kib() {
  return static_cast<long>((mallinfo2().uordblks + mallinfo2().hblkhd) / 1024);
}

// The process's resources after call k: the warm-up baseline, the maxima after it, the end
// figures, and RSS less the plan cache at kNetSamples evenly spaced calls after warm-up.
void sample_resources(RankRun& w, int k) {
  Stats* st = w.st;
  const int calls = w.calls, warm = w.warm;
  const Sample s{vmrss_kib(), count_dir("/proc/self/fd"), count_dir("/proc/self/task")};
  if (k == 0) st->rss_first = s.rss;
  if (k == warm - 1) {
    st->held_warm = held_kib();
    st->rss_warm = vmrss_kib();  // after the flush, which allocates a little too
    st->heap_warm = malloc_in_use_kib();
    st->fds_warm = s.fds;
    st->threads_warm = s.threads;
  }
  if (k >= warm) {
    st->rss_max_after = std::max(st->rss_max_after, s.rss);
    st->fds_max_after = std::max(st->fds_max_after, s.fds);
    st->threads_max_after = std::max(st->threads_max_after, s.threads);
  }
  st->rss_end = s.rss;
  if (k == calls - 1) {
    st->heap_end = malloc_in_use_kib();
    st->held_end = held_kib();
    st->rss_end = vmrss_kib();
  }
  // Evenly spaced over the calls after warm-up, the last call included.
  const int after = calls - warm;
  if (k >= warm && after > 0 &&
      static_cast<long>(k - warm + 1) * kNetSamples / after !=
          static_cast<long>(k - warm) * kNetSamples / after) {
    const long held = held_kib();
    if (g_trim) malloc_trim(0);
    if (held >= 0) st->net_samples.push_back(vmrss_kib() - held);
  }
  st->fds_end = s.fds;
  st->threads_end = s.threads;
  if (w.rank == 0 && (k + 1) % std::max(1, calls / 10) == 0)
    std::fprintf(stderr,
                 "soak: %d/%d calls, RSS %ld KiB, malloc in use %ld KiB, fds %d, threads %d\n",
                 k + 1, calls, s.rss, malloc_in_use_kib(), s.fds, s.threads);
}

// The shim's own reasons for the opted-in communicator (index 0) must match the model: every
// inferred over-budget pass-through really was one, and the switch passed through exactly the
// calls predicted. 0, or the rank's exit code.
int check_shim_counters(const Stats* st) {
  const std::string m = flushed_metrics();
  if (m.empty()) return 40;
  const char* mpath = std::getenv("DYNAMIQ_METRICS_FILE");
  auto field = json_field;
  if (st->held_warm < 0 || st->held_end < 0) {
    std::fprintf(stderr, "no held_bytes in the metrics file %s:\n%s\n", mpath, m.c_str());
    return 44;
  }
  bool found = false;
  for (const std::string& obj : communicator_objects(m)) {
    if (field(obj, "index") != 0) continue;
    found = true;
    if (field(obj, "over_budget") != st->over_budget ||
        field(obj, "switch_off") != st->switch_off || field(obj, "rerouted") != st->compressed) {
      std::fprintf(stderr,
                   "the shim's counters (rerouted %lld, over_budget %lld, switch_off %lld) differ "
                   "from the soak's (%d, %d, %d)\n%s\n",
                   field(obj, "rerouted"), field(obj, "over_budget"), field(obj, "switch_off"),
                   st->compressed, st->over_budget, st->switch_off, m.c_str());
      return 41;
    }
  }
  if (!found) {
    std::fprintf(stderr, "no communicator 0 in the metrics file %s:\n%s\n", mpath, m.c_str());
    return 42;
  }
  for (int slot = 0; slot < 6; ++slot)
    if (st->max_over[slot] > 0 && st->min_fit[slot] != SIZE_MAX &&
        st->max_over[slot] >= st->min_fit[slot]) {
      std::fprintf(stderr, "%s %s: %zu elements passed as over budget, %zu were compressed\n",
                   coll_name(slot / 2), slot % 2 ? "bf16" : "f32", st->max_over[slot],
                   st->min_fit[slot]);
      return 43;
    }
  return 0;
}

// One rank. Returns 0, or a code naming the failed check (the message is in the rank's log).
int rank_body(int rank, ncclComm_t comm, const Args& a, const std::string& control, Stats* st) {
  auto reg = reinterpret_cast<RegisterFn>(dlsym(RTLD_DEFAULT, "dynamiqCommRegister"));
  if (!reg) return 2;
  RankRun w;
  w.n = a.n;
  w.rank = rank;
  w.comm = comm;
  w.calls = a.calls;
  w.warm = a.warm;
  w.max_bytes = a.max_bytes;
  w.control = control;
  w.st = st;
  if (ncclCommSplit(comm, 0, rank, &w.off, nullptr) != ncclSuccess || !w.off) return 3;
  if (reg(w.off, 0) != 0) return 4;
  // Buffers of the largest call, touched once, reused: the test's own memory stays flat.
  w.send.assign(a.max_bytes + 64, 1);
  w.recv.assign(a.max_bytes + 64, 1);
  Rng rng{a.seed};
  const auto t0 = std::chrono::steady_clock::now();
  for (int k = 0; k < a.calls; ++k) {
    Issued x = issue_call(w, draw(rng, a.n, a.max_bytes));
    account_call(w, k, x);
    Verdict v = check_call(w, x);
    if (const int rc = agree_on_call(w, k, x, v); rc != 0) return rc;
    ++st->calls;
    x.compressed ? ++st->compressed : ++st->passed;
    sample_resources(w, k);
  }
  st->seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const auto& ns = st->net_samples;
  const size_t window = std::min<size_t>(kNetWindow, ns.size());
  st->net_first = median_of(std::vector<long>(ns.begin(), ns.begin() + static_cast<long>(window)));
  st->net_last = median_of(std::vector<long>(ns.end() - static_cast<long>(window), ns.end()));
  if (const int rc = check_shim_counters(st); rc != 0) return rc;
  ncclCommDestroy(w.off);
  return 0;
}

size_t parse_bytes(const char* s) {
  char* end = nullptr;
  double v = std::strtod(s, &end);
  if (end && (*end == 'K' || *end == 'k')) v *= 1024;
  if (end && (*end == 'M' || *end == 'm')) v *= 1024 * 1024;
  return static_cast<size_t>(v);
}

// A rank's statistics as one line of text, for the parent to read back.
void write_stats(int r, const Stats& st) {
  char line[512];
  std::snprintf(
      line, sizeof line,
      "%d %d %d %d %.4e %.4e %ld %ld %ld %ld %d %d %d %d %d %d %.1f %d %d %ld %ld %ld %ld "
      "%ld %ld %zu\n",
      st.calls, st.compressed, st.passed, st.flips, st.max_vnmse,
      st.compressed ? st.sum_vnmse / st.compressed : 0.0, st.rss_first, st.rss_warm, st.rss_end,
      st.rss_max_after, st.fds_warm, st.fds_end, st.fds_max_after, st.threads_warm, st.threads_end,
      st.threads_max_after, st.seconds, st.over_budget, st.switch_off, st.heap_warm, st.heap_end,
      st.held_warm, st.held_end, st.net_first, st.net_last, st.net_samples.size());
  write_text(g_dir + "/stats" + std::to_string(r), line);
}

// Rank r's statistics line, as write_stats wrote it; false when there is none.
bool read_stats(int r, Stats* st, double* mean_vnmse, size_t* net_count) {
  std::istringstream in(read_file(g_dir + "/stats" + std::to_string(r)));
  in >> st->calls >> st->compressed >> st->passed >> st->flips >> st->max_vnmse >> *mean_vnmse >>
      st->rss_first >> st->rss_warm >> st->rss_end >> st->rss_max_after >> st->fds_warm >>
      st->fds_end >> st->fds_max_after >> st->threads_warm >> st->threads_end >>
      st->threads_max_after >> st->seconds >> st->over_budget >> st->switch_off >> st->heap_warm >>
      st->heap_end >> st->held_warm >> st->held_end >> st->net_first >> st->net_last >> *net_count;
  return static_cast<bool>(in);
}

// Rank r's process: its log, the shim's settings, its communicator, the soak, its statistics.
int rank_process(int r, const ncclUniqueId& id, const Args& a, const std::string& control) {
  const std::string log = g_dir + "/rank" + std::to_string(r) + ".log";
  if (std::freopen(log.c_str(), "w", stderr) == nullptr) return 98;
  setenv("DYNAMIQ_ENABLE", "1", 1);
  setenv("DYNAMIQ_MIN_BYTES", "64K", 1);
  setenv("DYNAMIQ_CONTROL_FILE", control.c_str(), 1);
  setenv("DYNAMIQ_METRICS_FILE", (g_dir + "/metrics" + std::to_string(r) + ".json").c_str(), 1);
  setenv("DYNAMIQ_METRICS_INTERVAL_S", "86400", 1);
  ncclComm_t comm = nullptr;
  // A fixed mmap threshold: the soak's and the CPU NCCL's large per-call buffers go back to
  // the kernel when freed, so RSS measures what is held, not glibc's high-water heap (the
  // default threshold rises to the largest block freed, up to 32 MiB). The shim maps its
  // plan buffers itself whatever this says.
  mallopt(M_MMAP_THRESHOLD, 256 * 1024);
  if (ncclCommInitRank(&comm, a.n, id, r) != ncclSuccess) return 97;
  Stats st;
  const int rc = rank_body(r, comm, a, control, &st);
  write_stats(r, st);
  std::fflush(stderr);
  if (rc == 0) ncclCommDestroy(comm);
  return rc;
}

// Rank r's figures printed, and judged: every call done, some compressed and some passed,
// enough samples, RSS less the plan cache flat, no fd or thread growth after warm-up.
bool judge_rank(int r, const Args& a, const Stats& st, double mean_vnmse, size_t net_count) {
  bool ok = true;
  const double growth = 100.0 * (st.rss_end - st.rss_warm) / st.rss_warm;
  const double growth_max = 100.0 * (st.rss_max_after - st.rss_warm) / st.rss_warm;
  // What the process holds beyond the shim's plan cache, whose size follows the last 16 call
  // shapes (reported by the shim itself): a leak anywhere shows here.
  const long net_warm = st.rss_warm - st.held_warm, net_end = st.rss_end - st.held_end;
  const double net_points = 100.0 * (net_end - net_warm) / net_warm;
  const double net_growth =
      st.net_first > 0 ? 100.0 * (st.net_last - st.net_first) / st.net_first : 100.0;
  std::printf(
      "rank %d: %d calls (%d compressed, %d passed through of which %d by the switch and %d over "
      "budget; %d switch flips) in %.1f s; "
      "vNMSE max %.3e mean %.3e; RSS KiB first %ld, after warm-up %ld, end %ld (%+.2f%%), "
      "max after warm-up %ld (%+.2f%%); plan cache KiB %ld -> %ld; RSS less plan cache KiB %ld "
      "-> %ld "
      "(%+.2f%%), medians of the first and last %d of %zu samples %ld -> %ld (%+.2f%%); "
      "malloc in use KiB %ld -> %ld; fds %d -> %d (max %d); threads %d -> %d (max %d)\n",
      r, st.calls, st.compressed, st.passed, st.switch_off, st.over_budget, st.flips, st.seconds,
      st.max_vnmse, mean_vnmse, st.rss_first, st.rss_warm, st.rss_end, growth, st.rss_max_after,
      growth_max, st.held_warm, st.held_end, net_warm, net_end, net_points, kNetWindow, net_count,
      st.net_first, st.net_last, net_growth, st.heap_warm, st.heap_end, st.fds_warm, st.fds_end,
      st.fds_max_after, st.threads_warm, st.threads_end, st.threads_max_after);
  if (st.calls != a.calls || st.compressed == 0 || st.passed == 0) {
    std::printf("FAIL: rank %d: expected %d calls, some compressed and some passed\n", r, a.calls);
    ok = false;
  }
  if (net_count < 2 * static_cast<size_t>(kNetWindow)) {
    std::printf("FAIL: rank %d: %zu samples of RSS after warm-up, fewer than %d\n", r, net_count,
                2 * kNetWindow);
    ok = false;
  }
  if (!(net_growth < a.rss_limit)) {
    std::printf(
        "FAIL: rank %d: RSS less the plan cache grew %.2f%% after warm-up (medians of the "
        "first and last %d samples; limit %g%%)\n",
        r, net_growth, kNetWindow, a.rss_limit);
    ok = false;
  }
  // Flat means no growth: a leak only ever adds. Fewer threads at the end is TBB's pool or an
  // engine's stream workers going idle and exiting (a CI run saw 30 -> 24 on one rank).
  if (st.fds_max_after > st.fds_warm || st.threads_max_after > st.threads_warm) {
    std::printf("FAIL: rank %d: file descriptors or threads grew after warm-up\n", r);
    ok = false;
  }
  return ok;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr,
                 "usage: soak CALLS MAX_BYTES [SEED] [NRANKS] [WARMUP] [RSS_LIMIT_PCT] [TRIM]\n");
    return 2;
  }
  if (counters_fn() == nullptr) {
    std::printf("SKIP: libdynamiq.so is not preloaded\n");
    return 77;
  }
  Args a;
  a.calls = std::atoi(argv[1]);
  a.max_bytes = std::max<size_t>(2048, parse_bytes(argv[2]));
  a.seed = argc > 3 ? std::strtoull(argv[3], nullptr, 0) : 16;
  a.n = argc > 4 ? std::atoi(argv[4]) : 4;
  if (a.n < 2 || (a.n & (a.n - 1)) != 0) {
    // An average over 3 ranks is not exact in BF16: the pass-through check would fail on it.
    std::fprintf(stderr, "soak: NRANKS %s: must be a power of two, at least 2\n",
                 argc > 4 ? argv[4] : "4");
    return 2;
  }
  a.warm = std::min(a.calls, std::max(1, argc > 5 ? std::atoi(argv[5]) : a.calls / 10));
  a.rss_limit = argc > 6 ? std::atof(argv[6]) : 1.0;
  g_trim = argc > 7 && std::atoi(argv[7]) != 0;
  char tmpl[] = "/tmp/dq-soak-XXXXXX";
  if (mkdtemp(tmpl) == nullptr) return 1;
  g_dir = tmpl;
  g_trace = std::getenv("DQ_SOAK_TRACE") != nullptr;
  const std::string control = g_dir + "/switch";
  write_text(control, "on\n");
  std::printf(
      "soak: %d ranks, %d calls (warm-up %d), sizes 1 KiB..%zu bytes, seed %llu, scratch %s%s\n",
      a.n, a.calls, a.warm, a.max_bytes, static_cast<unsigned long long>(a.seed), g_dir.c_str(),
      g_trim ? ", RSS samples after malloc_trim(0)" : "");
  std::fflush(stdout);

  // No deadline of the harness's own: a full soak runs for hours, and the ranks stop together on
  // a failure (the per-call verdict) or die with this process when the test runner times out.
  dq::test::RankOptions opt;
  opt.timeout_s = 0;
  const auto exits = dq::test::run_ranks<ncclUniqueId>(
      a.n, 1, ncclGetUniqueId, opt,
      [&](int r, const ncclUniqueId* ids) { return rank_process(r, ids[0], a, control); });
  bool ok = true;
  for (int r = 0; r < a.n; ++r) {
    if (exits[r].code() != 0) {
      std::printf("FAIL: rank %d %s; its log:\n%s", r, exits[r].describe().c_str(),
                  read_file(g_dir + "/rank" + std::to_string(r) + ".log").c_str());
      ok = false;
    }
  }
  if (!ok) return 1;
  for (int r = 0; r < a.n; ++r) {
    Stats st;
    double mean_vnmse;
    size_t net_count = 0;
    if (!read_stats(r, &st, &mean_vnmse, &net_count)) {
      std::printf("FAIL: rank %d wrote no statistics\n", r);
      return 1;
    }
    ok = judge_rank(r, a, st, mean_vnmse, net_count) && ok;
  }
  std::printf(ok ? "PASS\n" : "FAIL\n");
  return ok ? 0 : 1;
}

// One rank of the fault campaign (tests/faults/campaign.sh starts N of them,
// each in its own network namespace, and injects a fault from outside).
//
// Usage: fault_worker DIR CALLS SEED      (RANK and WORLD_SIZE from the environment)
//
// Runs under the preloaded shim (LD_PRELOAD=libdynamiq.so) on the CPU NCCL. Rank 0 creates the
// NCCL unique id and publishes it as DIR/uid (temp file + rename); the others poll for it. Then
// CALLS all-reduces, the same sequence on every rank (drawn from SEED): about half eligible for
// compression (FP32 or BF16 SUM, 32K..64K elements per rank of the job, above
// DYNAMIQ_MIN_BYTES=64K), the others
// passed through (INT32 SUM, FP32 SUM below the size threshold, FP32 MAX). Inputs are small
// integers, so every pass-through result is exact in any order of additions and is checked
// bit-exactly; a compressed result (the shim's counters say which calls were compressed) is
// checked to be finite with vNMSE below kMaxVnmse. The campaign compares the hash of each
// call's result across ranks (rank identity).
//
// DIR/rank<R>.txt, one line per event, written with one write(2) each (a killed rank keeps
// every line it wrote); times are CLOCK_REALTIME in microseconds, comparable with bash's
// $EPOCHREALTIME:
//   S rank world pid t_us                      after ncclCommInitRank returned
//   C k kind rc t_start_us t_end_us compressed verified hash vnmse
//       kind: c (eligible for compression) or p (pass-through); rc: the ncclResult_t;
//       verified: 1 checked and correct, 0 wrong, - not checked (the call failed)
//   E status t_us                              ok | error | wrong | initfail
// DIR/progress<R>: the index of the call in flight (or about to start), rewritten in place.
//
// Harness self-test: DQF_CORRUPT_RANK=R DQF_CORRUPT_CALL=K make rank R alter its result of call
// K after it returned (so the campaign must report a wrong result).
//
// Exit codes: 0 every call succeeded and verified; 3 a call returned an error (the rank stops
// at once, without ncclCommDestroy: the communicator is broken); 4 a call returned ncclSuccess
// with a wrong result; 5 ncclCommInitRank failed; 6 no unique id within the rendezvous time;
// 2 usage; 77 the shim is not preloaded.
#include <dlfcn.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "common/fnv1a.h"
#include "common/nccl_api.h"
#include "kernels/bf16.h"
#include "tests/common/test_data.h"

namespace {

using CountersFn = int (*)(void*, unsigned long long*, unsigned long long*);
using dq::test::Rng;
using dq::test::splitmix;

// Bound on a compressed result's vNMSE. Measured on this data at 5 bits: up to 0.053 (ring, 7
// ranks). A rank's contribution lost (or counted twice) gives about 1/n >= 0.125 for n <= 8.
constexpr double kMaxVnmse = 0.1;
constexpr int kRendezvousMs = 30000;

enum ExitCode { kOk = 0, kUsage = 2, kCallError = 3, kWrong = 4, kInitFail = 5, kNoId = 6 };

long long now_us() {
  timespec ts{};
  clock_gettime(CLOCK_REALTIME, &ts);
  return static_cast<long long>(ts.tv_sec) * 1000000 + ts.tv_nsec / 1000;
}

enum Shape { kF32Sum, kBf16Sum, kI32Sum, kF32Small, kF32Max };

struct Call {
  Shape shape;
  size_t count;
  uint64_t key;
  bool eligible() const { return shape == kF32Sum || shape == kBf16Sum; }
  size_t esize() const { return shape == kBf16Sum ? 2 : 4; }
  ncclDataType_t dtype() const {
    return shape == kBf16Sum ? ncclBfloat16 : shape == kI32Sum ? ncclInt32 : ncclFloat32;
  }
  ncclRedOp_t op() const { return shape == kF32Max ? ncclMax : ncclSum; }
};

// Compressed sizes grow with the rank count: the engine passes a tensor through ("over budget")
// below 64 super-groups of 256 values per chunk message, i.e. 16384 * n elements (kernels/codec.h
// kMinSuperGroupsPerChunk); 2x..4x that keeps every eligible call compressed and its vNMSE well
// inside the bound.
Call draw(Rng& rng, int n) {
  Call c{};
  const size_t pick = rng.between(0, 9);
  if (pick < 4)
    c.shape = kF32Sum;
  else if (pick < 5)
    c.shape = kBf16Sum;
  else if (pick < 7)
    c.shape = kI32Sum;
  else if (pick < 9)
    c.shape = kF32Small;
  else
    c.shape = kF32Max;
  switch (c.shape) {
    case kF32Sum:
    case kBf16Sum:
      c.count = rng.between(32768 * static_cast<size_t>(n), 65536 * static_cast<size_t>(n));
      break;
    case kI32Sum:
      c.count = rng.between(1 << 10, 64 << 10);
      break;
    case kF32Small:
      c.count = rng.between(1, 15 << 10);
      break;  // < 64 KiB: passes through
    case kF32Max:
      c.count = rng.between(16 << 10, 64 << 10);
      break;  // MAX: passes through
  }
  c.key = rng.next();
  return c;
}

void store(unsigned char* p, size_t i, const Call& c, int v) {
  if (c.shape == kBf16Sum) {
    const uint16_t b = dq::f32_to_bf16_rne(static_cast<float>(v));
    std::memcpy(p + i * 2, &b, 2);
  } else if (c.shape == kI32Sum) {
    const int32_t x = v;
    std::memcpy(p + i * 4, &x, 4);
  } else {
    const float f = static_cast<float>(v);
    std::memcpy(p + i * 4, &f, 4);
  }
}

double load(const unsigned char* p, size_t i, const Call& c) {
  if (c.shape == kBf16Sum) {
    uint16_t b;
    std::memcpy(&b, p + i * 2, 2);
    return dq::bf16_to_f32(b);
  }
  if (c.shape == kI32Sum) {
    int32_t x;
    std::memcpy(&x, p + i * 4, 4);
    return x;
  }
  float f;
  std::memcpy(&f, p + i * 4, 4);
  return f;
}

int g_log = -1;
int g_progress = -1;

void emit(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
void emit(const char* fmt, ...) {
  char line[512];
  va_list ap;
  va_start(ap, fmt);
  const int len = vsnprintf(line, sizeof line, fmt, ap);
  va_end(ap);
  if (len <= 0 || g_log < 0) return;
  ssize_t ignored = write(g_log, line, std::min<size_t>(static_cast<size_t>(len), sizeof line - 1));
  (void)ignored;
}

void progress(int k) {
  char text[16];
  const int len = std::snprintf(text, sizeof text, "%8d\n", k);
  ssize_t ignored = pwrite(g_progress, text, static_cast<size_t>(len), 0);
  (void)ignored;
}

// Rank 0 publishes the id; the others wait for it (bounded).
bool share_id(const std::string& dir, int rank, ncclUniqueId* id) {
  const std::string path = dir + "/uid";
  if (rank == 0) {
    if (ncclGetUniqueId(id) != ncclSuccess) return false;
    const std::string tmp = path + ".tmp";
    const int fd = open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0) return false;
    const bool ok = write(fd, id, sizeof *id) == static_cast<ssize_t>(sizeof *id);
    close(fd);
    return ok && rename(tmp.c_str(), path.c_str()) == 0;
  }
  for (int waited = 0; waited < kRendezvousMs; waited += 5) {
    const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd >= 0) {
      const bool ok = read(fd, id, sizeof *id) == static_cast<ssize_t>(sizeof *id);
      close(fd);
      if (ok) return true;
    }
    usleep(5000);
  }
  return false;
}

// Opens this rank's event log and progress file in dir (globals: emit and progress write them).
bool open_outputs(const std::string& dir, int rank) {
  const std::string log_path = dir + "/rank" + std::to_string(rank) + ".txt";
  g_log = open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_APPEND | O_CLOEXEC, 0644);
  const std::string prog_path = dir + "/progress" + std::to_string(rank);
  g_progress = open(prog_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (g_log < 0 || g_progress < 0) {
    std::perror("fault_worker: open");
    return false;
  }
  return true;
}

// The communicator of the job, after the unique id's rendezvous in dir; an exit code on failure.
int init_comm(const std::string& dir, int rank, int n, ncclComm_t* comm) {
  ncclUniqueId id{};
  if (!share_id(dir, rank, &id)) {
    emit("E initfail %lld\n", now_us());
    return kNoId;
  }
  const ncclResult_t init = ncclCommInitRank(comm, n, id, rank);
  if (init != ncclSuccess) {
    std::fprintf(stderr, "rank %d: ncclCommInitRank: %s\n", rank, ncclGetErrorString(init));
    emit("E initfail %lld\n", now_us());
    return kInitFail;
  }
  emit("S %d %d %d %lld\n", rank, n, static_cast<int>(getpid()), now_us());
  return kOk;
}

// Harness self-test (DQF_CORRUPT_RANK/CALL): a pass-through result fails its exact check
// here; a compressed one stays within the vNMSE bound, so only the campaign's comparison of
// hashes across ranks can catch it.
void corrupt(unsigned char* recv, const Call& c) {
  float f;
  std::memcpy(&f, recv, 4);
  f += c.shape == kI32Sum ? 0.0f : 1.0f;
  if (c.shape == kI32Sum)
    recv[0] ^= 1;
  else if (c.shape != kBf16Sum)
    std::memcpy(recv, &f, 4);
  else
    recv[1] ^= 1;
}

// Checks a call's result on n ranks: exact when passed through, finite and within kMaxVnmse when
// compressed. Sets *vnmse (0 when passed through) and, when wrong, why.
bool verify(const Call& c, int n, const unsigned char* recv, bool compressed, double* vnmse,
            char* why, size_t why_size) {
  bool ok = true;
  double num = 0, den = 0;
  for (size_t i = 0; i < c.count && ok; ++i) {
    const double want = dq::test::bell_reduced(c.key, n, i, c.op() == ncclMax);
    const double got = load(recv, i, c);
    if (!compressed) {
      // BF16 holds every integer up to 256 exactly; |sum| <= 8 * 30.
      if (got != want) {
        ok = false;
        std::snprintf(why, why_size, "element %zu is %g, exact %g", i, got, want);
      }
    } else {
      if (!std::isfinite(got)) {
        ok = false;
        std::snprintf(why, why_size, "element %zu is not finite", i);
      }
      num += (got - want) * (got - want);
      den += want * want;
    }
  }
  *vnmse = compressed ? (den > 0 ? num / den : num) : 0.0;
  if (ok && compressed && !(*vnmse < kMaxVnmse)) {
    ok = false;
    std::snprintf(why, why_size, "vNMSE %.4e over the bound %.2g", *vnmse, kMaxVnmse);
  }
  return ok;
}

// One rank's state through the calls.
struct Worker {
  int rank = 0, n = 0;
  ncclComm_t comm = nullptr;
  CountersFn counters = nullptr;
  int corrupt_rank = -1, corrupt_call = -1;
  std::vector<unsigned char> send, recv;
};

// Call k: issued, logged and verified. kOk, or the exit code that ends the rank.
int run_call(Worker& w, int k, const Call& c) {
  const size_t bytes = c.count * c.esize();
  for (size_t i = 0; i < c.count; ++i)
    store(w.send.data(), i, c, dq::test::bell_value(c.key, w.rank, i));
  std::memset(w.recv.data(), 0xCD, bytes);
  unsigned long long r0 = 0, p0 = 0, r1 = 0, p1 = 0;
  w.counters(w.comm, &r0, &p0);
  progress(k);
  const long long t0 = now_us();
  const ncclResult_t res =
      ncclAllReduce(w.send.data(), w.recv.data(), c.count, c.dtype(), c.op(), w.comm, nullptr);
  const long long t1 = now_us();
  w.counters(w.comm, &r1, &p1);
  const bool compressed = r1 > r0;
  const char kind = c.eligible() ? 'c' : 'p';
  if (res != ncclSuccess) {
    emit("C %d %c %d %lld %lld %d - 0 0\n", k, kind, static_cast<int>(res), t0, t1, compressed);
    emit("E error %lld\n", now_us());
    std::fprintf(stderr, "rank %d: call %d (%c) failed after %.3f s: %s\n", w.rank, k, kind,
                 (t1 - t0) / 1e6, ncclGetErrorString(res));
    return kCallError;  // the communicator is broken: no ncclCommDestroy
  }
  if (w.rank == w.corrupt_rank && k == w.corrupt_call) corrupt(w.recv.data(), c);
  double vnmse = 0;
  char why[160] = {0};
  const bool ok = verify(c, w.n, w.recv.data(), compressed, &vnmse, why, sizeof why);
  const uint64_t h = dq::fnv1a64(w.recv.data(), bytes);
  emit("C %d %c 0 %lld %lld %d %d %016llx %.4e\n", k, kind, t0, t1, compressed, ok ? 1 : 0,
       static_cast<unsigned long long>(h), vnmse);
  if (!ok) {
    std::fprintf(stderr, "rank %d: call %d (%c, %s) returned success with a wrong result: %s\n",
                 w.rank, k, kind, compressed ? "compressed" : "passed through", why);
    emit("E wrong %lld\n", now_us());
    return kWrong;
  }
  return kOk;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr,
                 "usage: fault_worker DIR CALLS SEED   (RANK, WORLD_SIZE in the environment)\n");
    return kUsage;
  }
  Worker w;
  w.counters = reinterpret_cast<CountersFn>(dlsym(RTLD_DEFAULT, "dynamiqCommCounters"));
  if (w.counters == nullptr) {
    std::printf("SKIP: libdynamiq.so is not preloaded\n");
    return 77;
  }
  const std::string dir = argv[1];
  const int calls = std::atoi(argv[2]);
  const uint64_t seed = std::strtoull(argv[3], nullptr, 0);
  const char* rank_s = std::getenv("RANK");
  const char* world_s = std::getenv("WORLD_SIZE");
  if (!rank_s || !world_s || calls < 1) return kUsage;
  w.rank = std::atoi(rank_s);
  w.n = std::atoi(world_s);
  if (w.n < 1 || w.rank < 0 || w.rank >= w.n) return kUsage;
  if (!open_outputs(dir, w.rank)) return kUsage;
  progress(-1);
  if (const int rc = init_comm(dir, w.rank, w.n, &w.comm); rc != kOk) return rc;

  const char* cr = std::getenv("DQF_CORRUPT_RANK");
  const char* cc = std::getenv("DQF_CORRUPT_CALL");
  w.corrupt_rank = cr ? std::atoi(cr) : -1;
  w.corrupt_call = cc ? std::atoi(cc) : -1;
  const size_t max_bytes = 65536 * static_cast<size_t>(w.n) * 4;
  w.send.resize(max_bytes);
  w.recv.resize(max_bytes);
  Rng rng{seed};
  for (int k = 0; k < calls; ++k)
    if (const int rc = run_call(w, k, draw(rng, w.n)); rc != kOk) return rc;
  progress(calls);
  ncclCommDestroy(w.comm);
  emit("E ok %lld\n", now_us());
  return kOk;
}

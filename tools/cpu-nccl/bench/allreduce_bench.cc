// All-reduce bus bandwidth of the CPU NCCL: forks N rank processes on this host and times
// ncclAllReduce over a size sweep (nccl-tests conventions: algbw = bytes / time,
// busbw = algbw * 2 (n-1) / n). Figures from here are loopback-on-one-host numbers.
//
//   cpu_nccl_allreduce_bench -n RANKS [-b MIN] [-e MAX] [-f FACTOR] [-i ITERS] [-w WARMUP]
//                            [-d float|bfloat16|half|int32|double]
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "common/nccl_api.h"
#include "config/bytes.h"

namespace {

struct Shared {
  std::atomic<int> id_ready;
  ncclUniqueId id;
};

size_t parse_size(const char* s) {  // config/bytes.h: 8, 1K, 1MB, 1MiB, ...
  uint64_t v = 0;
  if (!dq::config::parse_bytes(s, &v) || v > SIZE_MAX) {
    std::fprintf(stderr, "not a size: %s (e.g. 8, 64K, 1M, 1MiB)\n", s);
    std::exit(2);
  }
  return static_cast<size_t>(v);
}

struct Options {
  int nranks = 2;
  size_t min_bytes = 1 << 20, max_bytes = 64 << 20;
  int factor = 4, iters = 10, warmup = 3;
  ncclDataType_t type = ncclFloat32;
  size_t esize = 4;
  std::string type_name = "float";
};

int rank_main(const Options& o, int rank, Shared* sh) {
  if (rank == 0) {
    if (ncclGetUniqueId(&sh->id) != ncclSuccess) return 1;
    sh->id_ready.store(1);
  } else {
    for (int i = 0; !sh->id_ready.load(); ++i) {
      if (i > 30000) return 1;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
  ncclComm_t comm;
  if (ncclCommInitRank(&comm, o.nranks, sh->id, rank) != ncclSuccess) return 1;
  std::vector<char> send(o.max_bytes), recv(o.max_bytes);
  std::memset(send.data(), 0, send.size());  // zeros are valid in every type
  if (rank == 0)
    std::printf("# ranks %d type %s iters %d warmup %d\n#%13s %12s %10s %10s %10s\n", o.nranks,
                o.type_name.c_str(), o.iters, o.warmup, "size(B)", "count", "time(us)",
                "algbw(GB/s)", "busbw(GB/s)");
  for (size_t bytes = o.min_bytes; bytes <= o.max_bytes; bytes *= o.factor) {
    const size_t count = bytes / o.esize;
    for (int i = 0; i < o.warmup; ++i)
      if (ncclAllReduce(send.data(), recv.data(), count, o.type, ncclSum, comm, nullptr)) return 1;
    auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < o.iters; ++i)
      if (ncclAllReduce(send.data(), recv.data(), count, o.type, ncclSum, comm, nullptr)) return 1;
    double sec =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / o.iters;
    double algbw = static_cast<double>(count * o.esize) / sec / 1e9;
    double busbw = algbw * 2.0 * (o.nranks - 1) / o.nranks;
    if (rank == 0)
      std::printf("%14zu %12zu %10.1f %10.3f %10.3f\n", count * o.esize, count, sec * 1e6, algbw,
                  busbw);
    std::fflush(stdout);
    if (o.factor <= 1) break;
  }
  ncclCommDestroy(comm);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string flag = argv[i];
    const char* v = argv[i + 1];
    if (flag == "-n")
      o.nranks = std::atoi(v);
    else if (flag == "-b")
      o.min_bytes = parse_size(v);
    else if (flag == "-e")
      o.max_bytes = parse_size(v);
    else if (flag == "-f")
      o.factor = std::atoi(v);
    else if (flag == "-i")
      o.iters = std::atoi(v);
    else if (flag == "-w")
      o.warmup = std::atoi(v);
    else if (flag == "-d") {
      o.type_name = v;
      if (o.type_name == "float") {
        o.type = ncclFloat32;
        o.esize = 4;
      } else if (o.type_name == "bfloat16") {
        o.type = ncclBfloat16;
        o.esize = 2;
      } else if (o.type_name == "half") {
        o.type = ncclFloat16;
        o.esize = 2;
      } else if (o.type_name == "int32") {
        o.type = ncclInt32;
        o.esize = 4;
      } else if (o.type_name == "double") {
        o.type = ncclFloat64;
        o.esize = 8;
      } else {
        std::fprintf(stderr, "unknown type %s\n", v);
        return 2;
      }
    } else {
      std::fprintf(stderr, "unknown flag %s\n", flag.c_str());
      return 2;
    }
  }
  if (o.nranks < 1 || o.nranks > 64 || o.min_bytes < o.esize || o.max_bytes < o.min_bytes ||
      o.iters < 1) {
    std::fprintf(stderr, "bad options\n");
    return 2;
  }
  void* mem =
      mmap(nullptr, sizeof(Shared), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (mem == MAP_FAILED) return 1;
  auto* sh = new (mem) Shared();
  std::vector<pid_t> pids;
  for (int r = 0; r < o.nranks; ++r) {
    pid_t pid = fork();
    if (pid == 0) {
      int rc = rank_main(o, r, sh);
      std::fflush(stdout);
      _exit(rc);
    }
    pids.push_back(pid);
  }
  int failed = 0;
  for (size_t i = 0; i < pids.size(); ++i) {
    int st = 0;
    waitpid(pids[i], &st, 0);
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
      if (!failed)
        for (pid_t p : pids) kill(p, SIGKILL);  // one rank failed: do not leave others waiting
      failed = 1;
    }
  }
  if (failed) std::fprintf(stderr, "a rank failed\n");
  return failed;
}

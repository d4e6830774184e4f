// Two ranks of NVIDIA's NCCL on one machine, for the GPU programs that go through the preloaded
// shim (shim_capture_gpu.cc, call_vs_nccl.cc). Each rank is a fresh process (the program started
// again with DQ_TEST_RANK set: no CUDA state crosses a fork), claims a host of its own
// (NCCL_HOSTID), so that NCCL accepts two ranks on one device and connects them through a net
// transport (dynamiq's plugin unless DQ_TEST_NCCL_NET names another), and uses device r % devices.
// The parent makes the NCCL unique id with the real NCCL, waits for both ranks within a bound and
// kills what is left; the ranks leave small result files in a private folder for it to compare.
#pragma once
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "tests/common/text_file.h"

namespace dq::gputest {

constexpr int kSkip = 77;
constexpr int kRanks = 2;

// In a rank's step: unless `cond`, prints "rank R: FAIL: <message>" and returns `code` (the rank's
// exit code names the step that broke).
#define DQ_RANK_CHECK(rank, cond, code, ...)  \
  do {                                        \
    if (!(cond)) {                            \
      std::printf("rank %d: FAIL: ", (rank)); \
      std::printf(__VA_ARGS__);               \
      std::printf("\n");                      \
      return code;                            \
    }                                         \
  } while (0)

// NCCL's ABI (nccl.h of 2.x): the unique id, and the enum values these programs pass.
struct NcclId {
  char bytes[128];
};
constexpr int kNcclSuccess = 0;
constexpr int kNcclFloat32 = 7;
constexpr int kNcclBfloat16 = 9;
constexpr int kNcclSum = 0;

// NCCL's entry points as the application sees them: resolved in the global scope, so that a
// preloaded libdynamiq.so answers (ncclGetUniqueId from the real library itself).
struct Nccl {
  void* lib = nullptr;
  int (*get_unique_id)(NcclId*) = nullptr;
  int (*comm_init_rank)(void**, int, NcclId, int) = nullptr;
  int (*all_reduce)(const void*, void*, size_t, int, int, void*, void*) = nullptr;
  int (*comm_destroy)(void*) = nullptr;
  int (*get_async_error)(void*, int*) = nullptr;
  // dynamiq's C API (shim/dynamiq.h); null when the shim is not preloaded.
  int (*counters)(void*, unsigned long long*, unsigned long long*) = nullptr;
  int (*bytes)(void*, unsigned long long*, unsigned long long*) = nullptr;
};

template <class F>
void resolve(void* scope, const char* name, F* out) {
  *out = reinterpret_cast<F>(dlsym(scope, name));
}

// The real libnccl.so.2 (DYNAMIQ_REAL_NCCL first, as the shim looks for it), opened globally.
inline bool load_nccl(Nccl* n, std::string* why) {
  for (const char* name :
       {static_cast<const char*>(std::getenv("DYNAMIQ_REAL_NCCL")),
        "/usr/local/cuda/lib/libnccl.so.2", "/usr/local/cuda/lib64/libnccl.so.2", "libnccl.so.2"}) {
    if (name != nullptr && name[0] != '\0' && (n->lib = dlopen(name, RTLD_NOW | RTLD_GLOBAL)))
      break;
  }
  if (n->lib == nullptr) {
    *why = "NVIDIA's libnccl.so.2 not found (DYNAMIQ_REAL_NCCL, /usr/local/cuda, the loader path)";
    return false;
  }
  resolve(n->lib, "ncclGetUniqueId", &n->get_unique_id);
  resolve(RTLD_DEFAULT, "ncclCommInitRank", &n->comm_init_rank);
  resolve(RTLD_DEFAULT, "ncclAllReduce", &n->all_reduce);
  resolve(RTLD_DEFAULT, "ncclCommDestroy", &n->comm_destroy);
  resolve(RTLD_DEFAULT, "ncclCommGetAsyncError", &n->get_async_error);
  resolve(RTLD_DEFAULT, "dynamiqCommCounters", &n->counters);
  resolve(RTLD_DEFAULT, "dynamiqCommBytes", &n->bytes);
  if (!n->get_unique_id || !n->comm_init_rank || !n->all_reduce || !n->comm_destroy ||
      !n->get_async_error) {
    *why = "libnccl.so.2 lacks an entry point these tests call";
    return false;
  }
  return true;
}

// The parent's check before it starts the ranks: a CUDA device and NVIDIA's NCCL (loaded into
// *nccl). Without either it prints "SKIP: <why>" and returns false (the program exits kSkip).
inline bool device_and_nccl(Nccl* nccl) {
  int devices = 0;
  const cudaError_t e = cudaGetDeviceCount(&devices);
  if (e != cudaSuccess || devices == 0) {
    std::printf("SKIP: no CUDA device: %s\n",
                e != cudaSuccess ? cudaGetErrorString(e) : "cudaGetDeviceCount returned 0");
    return false;
  }
  // Loopback before NCCL is loaded: the parent's ncclGetUniqueId picks the bootstrap's interface
  // here, and one the ranks (loopback) cannot reach would leave them waiting until the bound.
  setenv("NCCL_SOCKET_IFNAME", "lo", 0);
  setenv("DYNAMIQ_NET_IFNAME", "lo", 0);
  std::string why;
  if (!load_nccl(nccl, &why)) {
    std::printf("SKIP: %s\n", why.c_str());
    return false;
  }
  return true;
}

inline std::string to_hex(const NcclId& id) {
  static const char digits[] = "0123456789abcdef";
  std::string s;
  for (char c : id.bytes) {
    const auto b = static_cast<unsigned char>(c);
    s += digits[b >> 4];
    s += digits[b & 15];
  }
  return s;
}

inline bool from_hex(const char* s, NcclId* id) {
  if (s == nullptr || std::strlen(s) != 2 * sizeof id->bytes) return false;
  auto nibble = [](char c) { return c <= '9' ? c - '0' : c - 'a' + 10; };
  for (size_t i = 0; i < sizeof id->bytes; ++i)
    id->bytes[i] = static_cast<char>(nibble(s[2 * i]) << 4 | nibble(s[2 * i + 1]));
  return true;
}

// This process's rank when it is one (DQ_TEST_RANK set by run_ranks), else -1.
inline int my_rank() {
  const char* r = std::getenv("DQ_TEST_RANK");
  return r != nullptr ? std::atoi(r) : -1;
}

// In a rank: the NCCL unique id the parent made.
inline bool my_nccl_id(NcclId* id) {
  return from_hex(std::getenv("DQ_TEST_NCCL_ID"), id);
}

// In a rank: writes `text` to NAME in the parent's folder (read back with read_result).
inline void write_result(const std::string& name, const std::string& text) {
  const char* dir = std::getenv("DQ_TEST_DIR");
  if (dir != nullptr) std::ofstream(std::string(dir) + "/" + name) << text;
}

// A rank's first steps through the preloaded shim: line-buffered output, NVIDIA's NCCL loaded
// into *nccl with the shim in front of it, the parent's id in *id, device rank % devices current
// and a non-blocking *stream. 0, or the failed step's exit code (10 NCCL, 11 the shim, 12 the
// id, 13 the device, 14 the stream) after its FAIL line.
inline int start_rank(int rank, Nccl* nccl, NcclId* id, cudaStream_t* stream) {
  setvbuf(stdout, nullptr, _IOLBF, 0);
  std::string why;
  DQ_RANK_CHECK(rank, load_nccl(nccl, &why), 10, "%s", why.c_str());
  DQ_RANK_CHECK(rank, nccl->counters != nullptr, 11, "libdynamiq.so is not preloaded (LD_PRELOAD)");
  DQ_RANK_CHECK(rank, my_nccl_id(id), 12, "no NCCL id from the parent");
  int devices = 0;
  DQ_RANK_CHECK(rank, cudaGetDeviceCount(&devices) == cudaSuccess && devices > 0, 13, "no device");
  DQ_RANK_CHECK(rank, cudaSetDevice(rank % devices) == cudaSuccess, 13, "cudaSetDevice");
  DQ_RANK_CHECK(rank, cudaStreamCreateWithFlags(stream, cudaStreamNonBlocking) == cudaSuccess, 14,
                "cudaStreamCreateWithFlags");
  return 0;
}

// The environment of rank r: its rank, the id, its own host, loopback, the net transport.
inline void set_rank_env(int rank, const std::string& id_hex, const std::string& dir) {
  setenv("DQ_TEST_RANK", std::to_string(rank).c_str(), 1);
  setenv("DQ_TEST_NCCL_ID", id_hex.c_str(), 1);
  setenv("DQ_TEST_DIR", dir.c_str(), 1);
  setenv("NCCL_HOSTID", rank == 0 ? "dynamiq-fake-host-a" : "dynamiq-fake-host-b", 1);
  setenv("NCCL_SOCKET_IFNAME", "lo", 0);
  setenv("DYNAMIQ_NET_IFNAME", "lo", 0);
  const char* net = std::getenv("DQ_TEST_NCCL_NET");
  if (net == nullptr || std::strcmp(net, "dynamiq") == 0) {
    setenv("NCCL_NET_PLUGIN", "dynamiq", 1);
    setenv("NCCL_NET", "dynamiq", 1);
  } else {
    setenv("NCCL_NET", net, 1);
  }
  setenv("NCCL_DEBUG", "WARN", 0);
}

// The parent: starts both ranks (this program again, same arguments), waits at most `seconds`
// in all, and 15 s more for the other rank once one has failed; kills what is left. Returns the
// ranks' exit codes (-1: killed at the bound) and sets *dir to the results folder.
inline std::vector<int> run_ranks(char** argv, const Nccl& nccl, int seconds, std::string* dir) {
  std::vector<int> codes(kRanks, -1);
  NcclId id{};
  if (nccl.get_unique_id(&id) != kNcclSuccess) {
    std::printf("FAIL: ncclGetUniqueId\n");
    return codes;
  }
  char dir_template[] = "/tmp/dynamiq-gpu-ranks-XXXXXX";
  if (mkdtemp(dir_template) == nullptr) return codes;
  *dir = dir_template;
  std::fflush(stdout);
  std::vector<pid_t> pids(kRanks, -1);
  for (int r = 0; r < kRanks; ++r) {
    pids[r] = fork();
    if (pids[r] == 0) {
      set_rank_env(r, to_hex(id), *dir);
      execv("/proc/self/exe", argv);
      _exit(127);
    }
  }
  using clock = std::chrono::steady_clock;
  auto deadline = clock::now() + std::chrono::seconds(seconds);
  int left = kRanks;
  while (left > 0 && clock::now() < deadline) {
    for (int r = 0; r < kRanks; ++r) {
      int status = 0;
      if (pids[r] <= 0 || waitpid(pids[r], &status, WNOHANG) != pids[r]) continue;
      codes[r] = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      pids[r] = -1;
      --left;
      if (codes[r] != 0 && clock::now() + std::chrono::seconds(15) < deadline)
        deadline = clock::now() + std::chrono::seconds(15);  // its peer may wait on it forever
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  for (int r = 0; r < kRanks; ++r)
    if (pids[r] > 0) {
      std::printf("rank %d: still running at the bound (%d s): killed\n", r, seconds);
      kill(pids[r], SIGKILL);
      waitpid(pids[r], nullptr, 0);
    }
  return codes;
}

// The parent: what rank's write_result left under NAME ("" when nothing).
inline std::string read_result(const std::string& dir, const std::string& name) {
  return dq::test::read_file(dir + "/" + name);
}

// The parent of a pass/fail test: both ranks within `seconds`, each exit printed, then `more`
// (given the results folder; true: pass) when both passed; PASS or FAIL, and the exit code.
inline int parent_main(char** argv, const Nccl& nccl, int seconds,
                       const std::function<bool(const std::string&)>& more) {
  std::string dir;
  const std::vector<int> codes = run_ranks(argv, nccl, seconds, &dir);
  int failures = 0;
  for (int r = 0; r < kRanks; ++r) {
    std::printf("rank %d: exit %d\n", r, codes[r]);
    if (codes[r] != 0) ++failures;
  }
  if (failures == 0 && more && !more(dir)) ++failures;
  if (!dir.empty()) std::filesystem::remove_all(dir);
  std::printf(failures == 0 ? "PASS\n" : "FAIL\n");
  return failures == 0 ? 0 : 1;
}

// A pass/fail program's main: in a rank (started by run_ranks), run_rank(rank); in the parent,
// kSkip without a device or NVIDIA's NCCL, else parent_main.
inline int two_ranks_main(char** argv, int (*run_rank)(int), int seconds,
                          const std::function<bool(const std::string&)>& more = nullptr) {
  if (const int rank = my_rank(); rank >= 0) return run_rank(rank);
  Nccl nccl;
  if (!device_and_nccl(&nccl)) return kSkip;
  return parent_main(argv, nccl, seconds, more);
}

}  // namespace dq::gputest

// The shim where NCCL is loaded into a local scope only: this program links no NCCL and loads a
// library that needs it (nccl_local_scope_user.cc) with RTLD_LOCAL, as Python loads a framework's
// extension module. The application's NCCL calls still reach the preloaded shim, whose lookup of
// the real NCCL must find it there (dlsym RTLD_NEXT does not search a local scope: every call
// failed with ncclSystemError). Two forked ranks; exit 0 pass.
// Usage: nccl_local_scope PATH_OF_THE_USER_LIBRARY PATH_OF_THE_CPU_NCCL
// The CPU NCCL is opened first, by its path and RTLD_LOCAL: the user library's libnccl.so.2 is then
// that one (the loader matches the soname of a loaded library), whatever LD_LIBRARY_PATH holds
// (the test folder's own libnccl.so.2 is a do-nothing NCCL for a benchmark).
#include <dlfcn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>

#include "common/nccl_api.h"

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s PATH_OF_THE_USER_LIBRARY PATH_OF_THE_CPU_NCCL\n", argv[0]);
    return 2;
  }
  if (dlopen(argv[2], RTLD_NOW | RTLD_LOCAL) == nullptr) {
    std::fprintf(stderr, "FAIL: dlopen %s: %s\n", argv[2], dlerror());
    return 1;
  }
  void* user = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (user == nullptr) {
    std::fprintf(stderr, "FAIL: dlopen %s: %s\n", argv[1], dlerror());
    return 1;
  }
  // The premise: the CPU NCCL (only it defines dqCpuNcclCommName) is the user library's NCCL, and
  // it is not in the global scope.
  if (dlsym(user, "dqCpuNcclCommName") == nullptr) {
    std::fprintf(stderr, "FAIL: the user library's NCCL is not the CPU NCCL\n");
    return 1;
  }
  if (dlsym(RTLD_DEFAULT, "dqCpuNcclCommName") != nullptr) {
    std::fprintf(stderr, "FAIL: NCCL is in the global scope: the case is not tested\n");
    return 1;
  }
  if (dlsym(RTLD_DEFAULT, "dynamiqCommCounters") == nullptr) {
    std::fprintf(stderr, "FAIL: the shim is not preloaded\n");
    return 1;
  }
  using UniqueId = int (*)(ncclUniqueId*);
  using AllReduce = int (*)(const ncclUniqueId*, int, int);
  const auto unique_id = reinterpret_cast<UniqueId>(dlsym(user, "dq_local_scope_unique_id"));
  const auto all_reduce = reinterpret_cast<AllReduce>(dlsym(user, "dq_local_scope_all_reduce"));
  if (unique_id == nullptr || all_reduce == nullptr) {
    std::fprintf(stderr, "FAIL: %s exports no dq_local_scope_* functions\n", argv[1]);
    return 1;
  }
  ncclUniqueId id{};
  if (unique_id(&id) != 0) {
    std::fprintf(stderr, "FAIL: ncclGetUniqueId through the local scope\n");
    return 1;
  }
  constexpr int kRanks = 2;
  pid_t pids[kRanks];
  for (int r = 0; r < kRanks; ++r) {
    pids[r] = fork();
    if (pids[r] < 0) return 1;
    if (pids[r] == 0) {
      alarm(60);  // a hung rank dies (SIGALRM) instead of hanging the test
      _exit(all_reduce(&id, r, kRanks));
    }
  }
  int failed = 0;
  for (int r = 0; r < kRanks; ++r) {
    int status = 0;
    if (waitpid(pids[r], &status, 0) != pids[r] || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      std::fprintf(stderr,
                   "FAIL: rank %d: %s %d (10: ncclCommInitRank failed, 11: ncclAllReduce failed, "
                   "12: a wrong sum, 13-14: not compressed, 15: ncclCommDestroy failed)\n",
                   r, WIFEXITED(status) ? "exit" : "signal",
                   WIFEXITED(status) ? WEXITSTATUS(status) : WTERMSIG(status));
      failed = 1;
    }
  }
  if (failed == 0)
    std::printf(
        "NCCL in a local scope only: both ranks' calls reached it through the shim, the "
        "all-reduce compressed, its vNMSE under 0.05\n");
  return failed;
}

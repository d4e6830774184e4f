// NCCL dlcloses its net plugin when the last communicator that used it is finalized, and loads it
// again for the next one (a job that aborts its process groups after a failure and makes new
// ones). A connection NCCL abandoned half set up (its peer died while connecting: NCCL frees
// only connections that completed) keeps the plugin's threads and sockets; they must never run
// in unmapped code. The plugin is linked -z nodelete: the dlclose leaves it mapped, the threads
// keep running valid code, and the next load finds the devices it discovered (no second verbs
// context a reload). Here: connections set up and never closed, the last reference dropped, the
// library still mapped, its threads alive for a second (a SIGSEGV ends the test otherwise), and
// a new load connects again.
#include <dlfcn.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>

#include "tests/plugin/plugin_harness.h"

namespace dq::net::testing {
namespace {

const char* plugin_path() {
  const char* path = std::getenv("DYNAMIQ_NET_PLUGIN_PATH");
  return path != nullptr ? path : "libnccl-net-dynamiq.so";
}

// A connection left open, as NCCL leaves one it abandoned, and what closes it at the end (the
// test's own clean-up, so that LeakSanitizer sees nothing left).
struct LeftOpen {
  const dqNetV11* net = nullptr;
  void* ctx = nullptr;
  void* listen_comm = nullptr;
  void* send_comm = nullptr;
  void* recv_comm = nullptr;
  void close() const {
    if (send_comm != nullptr) net->closeSend(send_comm);
    if (recv_comm != nullptr) net->closeRecv(recv_comm);
    if (listen_comm != nullptr) net->closeListen(listen_comm);
    if (ctx != nullptr) net->finalize(ctx);
  }
};

// Loads the plugin, connects a pair over loopback and leaves both ends (and the listener) open.
// False with a message when a step fails.
bool load_and_leave_a_connection(void** lib, LeftOpen* open) {
  *lib = dlopen(plugin_path(), RTLD_NOW | RTLD_LOCAL);
  if (*lib == nullptr) return std::fprintf(stderr, "dlopen: %s\n", dlerror()), false;
  open->net = static_cast<const dqNetV11*>(dlsym(*lib, "ncclNetPlugin_v11"));
  const dqNetV11* net = open->net;
  if (net == nullptr) return std::fprintf(stderr, "no ncclNetPlugin_v11\n"), false;
  if (net->init(&open->ctx, 0x5eedull, nullptr, &LogCapture::logger, nullptr) != dqNetSuccess)
    return std::fprintf(stderr, "init failed\n"), false;
  char handle[NCCL_NET_HANDLE_MAXSIZE] = {};
  if (net->listen(open->ctx, 0, handle, &open->listen_comm) != dqNetSuccess)
    return std::fprintf(stderr, "listen failed\n"), false;
  if (!connect_pair(net, open->ctx, open->listen_comm, handle, &open->send_comm, &open->recv_comm))
    return std::fprintf(stderr, "connect failed\n"), false;
  return true;
}

int run() {
  void* lib = nullptr;
  LeftOpen first, second;
  if (!load_and_leave_a_connection(&lib, &first)) return 1;
  if (dlclose(lib) != 0) return std::fprintf(stderr, "dlclose: %s\n", dlerror()), 1;
  void* still = dlopen(plugin_path(), RTLD_NOW | RTLD_NOLOAD);
  if (still == nullptr) {
    std::fprintf(stderr,
                 "the plugin was unmapped by its last dlclose while its connections' threads "
                 "still run (link it with -z nodelete)\n");
    return 1;
  }
  dlclose(still);                                        // the check's own reference
  std::this_thread::sleep_for(std::chrono::seconds(1));  // the I/O threads wake every 250 ms
  void* again = nullptr;
  if (!load_and_leave_a_connection(&again, &second)) return 1;
  // The first load's connection is still served by the mapped library: both close cleanly.
  first.close();
  second.close();
  std::puts("the plugin stayed mapped after its last dlclose and connected again after a reload");
  return 0;
}

}  // namespace
}  // namespace dq::net::testing

int main() {
  return dq::net::testing::run();
}

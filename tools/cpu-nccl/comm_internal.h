// Internals shared by the CPU NCCL communicator's source files (comm.cc, root.cc, mesh.cc,
// collectives.cc): the unique id and hello layout, idle timeouts, and the blocking helpers.
// Not part of the library's API.
#pragma once
#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <random>
#include <thread>

#include "common/status.h"
#include "tools/cpu-nccl/comm.h"
#include "tools/cpu-nccl/net.h"

namespace dq::cpunccl {

using Clock = std::chrono::steady_clock;

constexpr uint64_t kIdMagic = 0x31434e4350435144ull;     // "DQCPCNC1"
constexpr uint64_t kHelloMagic = 0x4f4c4c4548435144ull;  // "DQCHELLO"
constexpr size_t kIdHandleOffset = 16;
constexpr size_t kIdHandleBytes = kUniqueIdBytes - kIdHandleOffset;  // 112

enum HelloKind : int32_t { kRankToRoot = 1, kRootToRank = 2, kPeer = 3 };

// The bootstrap root's and the ranks' hello header: magic, comm tag (the job id for the root),
// kind, rank, nranks, reserved; the sender's listen handle or the rank table follows it.
constexpr size_t kHelloHeaderBytes = sizeof(uint64_t) * 2 + sizeof(int32_t) * 4;  // 32

inline uint64_t random_u64() {
  std::random_device rd;
  return (static_cast<uint64_t>(rd()) << 32) ^ rd() ^
         static_cast<uint64_t>(Clock::now().time_since_epoch().count());
}

inline uint64_t mix(uint64_t x) {  // splitmix64 finaliser: derives child comm tags
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Tracks time since the last progress and backs off while idle (no core burnt on waiting).
class IdleClock {
 public:
  explicit IdleClock(int timeout_ms) : timeout_(std::chrono::milliseconds(timeout_ms)) {}
  void progressed() {
    last_ = Clock::now();
    rounds_ = 0;
  }
  // Waits a little; false once nothing progressed for the whole timeout.
  bool idle() {
    ++rounds_;
    if (rounds_ < 16) {
      std::this_thread::yield();
    } else {
      unsigned shift = std::min(rounds_ - 16, 6u);
      std::this_thread::sleep_for(std::chrono::microseconds(std::min(500u, 8u << shift)));
    }
    return Clock::now() - last_ < timeout_;
  }
  long idle_ms() const {
    return static_cast<long>(
        std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - last_).count());
  }

 private:
  Clock::duration timeout_;
  Clock::time_point last_ = Clock::now();
  unsigned rounds_ = 0;
};

// An accepted connection whose one hello (or rank table) message is being received.
struct Incoming {
  void* comm = nullptr;
  void* request = nullptr;
  void* mhandle = nullptr;
  std::unique_ptr<unsigned char[]> buffer;
  bool done = false;
};

// Small blocking helpers on the plugin, all bounded by an idle timeout of timeout_ms.

// Waits for a posted request to complete with exactly expect_bytes; `what` names it in errors.
Status wait_request(Net* net, void* request, size_t expect_bytes, int timeout_ms, const char* what);
// Posts a send, retrying while the plugin is not ready to take it.
Status post_send(Net* net, void* comm, void* data, size_t bytes, void* mh, int timeout_ms,
                 void** request);
// Registers, sends and waits for one message.
Status send_blocking(Net* net, void* comm, void* data, size_t bytes, int timeout_ms,
                     const char* what);

// Listens for the ranks of job `job` on listen_comm and sends them the rank table; run on a
// thread of its own by Comm::make_unique_id. Closes listen_comm and finalises ctx before it
// returns.
struct RootState {
  Net* net;
  void* ctx;
  void* listen_comm;
  uint64_t job;
  int timeout_ms;
};
Status root_serve(const RootState& st);

}  // namespace dq::cpunccl

// The types the files of the socket backend share (private to plugin/socket/): limits and magic
// words, the send and receive comms with their requests and I/O threads, the listen comm and a
// connect in progress, and the backend class (SocketNet), whose calls are defined by concern:
//   socket_threads.cc   the I/O threads of a connection (one per socket and direction)
//   socket_connect.cc   listen/connect/accept: the handshake of a connection's sockets
//   socket_backend.cc   init, properties, isend/irecv/test, registration, close
// Wire formats: socket_wire.h; the checks of what a peer sends: socket_parse.h.
#pragma once

#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_set>
#include <vector>

#include "plugin/net_backend.h"
#include "plugin/net_backend_common.h"
#include "plugin/net_devices.h"
#include "plugin/net_log.h"
#include "plugin/socket/socket_fork.h"
#include "plugin/socket/socket_io.h"
#include "plugin/socket/socket_parse.h"
#include "plugin/socket/socket_wire.h"

namespace dq::net::sock {

constexpr uint32_t kListenCommMagic = 0x4c434e44;
constexpr uint32_t kSendCommMagic = 0x53434e44;
constexpr uint32_t kRecvCommMagic = 0x52434e44;
constexpr uint32_t kSendRequestMagic = 0x53524e44;
constexpr uint32_t kRecvRequestMagic = 0x52524e44;
constexpr uint32_t kMrMagic = 0x4d524e44;
constexpr size_t kMaxRequestsPerComm = 1024;  // isend/irecv return a NULL request beyond this
constexpr int kMaxAcceptsPerCall = 64;

// A memory handle of this backend: the registered bytes only (sockets need no registration).
using MemoryRegion = RegisteredRegion;

// ---------------------------------------------------------------- send side

struct SendComm;

struct SendRequest {
  uint32_t magic = kSendRequestMagic;
  SendComm* comm;
  uint64_t seq = 0;
  int tag = 0;
  const char* data = nullptr;
  size_t size = 0;
  wire::Split split{};
  int parts_left = 0;  // guarded by comm->mu
  bool done = false;   // guarded by comm->mu
};

struct SendComm {
  uint32_t magic = kSendCommMagic;
  std::string peer;
  int64_t timeout_ms = 30000;
  std::vector<int> fds;
  std::vector<std::thread> threads;
  std::atomic<bool> stop{false};

  std::mutex mu;
  std::condition_variable cv;
  bool failed = false;
  uint64_t next_seq = 0;
  std::vector<std::deque<SendRequest*>> queues;  // per socket, in seq order
  std::unordered_set<SendRequest*> requests;

  // Marks the connection failed (logged once) and wakes the threads. mu held.
  void fail(const std::string& why) {
    if (failed) return;
    failed = true;
    NET_WARN("send connection to %s failed: %s", peer.c_str(), why.c_str());
    for (int fd : fds) shutdown(fd, SHUT_RDWR);
    cv.notify_all();
  }

  // The thread of socket k: writes part k of each queued message, in seq order.
  void run(int k);
};

// ---------------------------------------------------------------- receive side

struct RecvRequest;

struct RecvSlot {
  RecvRequest* req = nullptr;
  char* data = nullptr;
  size_t capacity = 0;
  int tag = 0;
  size_t received = 0;
  bool done = false;
};

struct RecvRequest {
  uint32_t magic = kRecvRequestMagic;
  struct RecvComm* comm;
  int n = 0;
  int remaining = 0;  // guarded by comm->mu
  RecvSlot slots[kMaxGroupedRecvs];
};

struct RecvMsg {
  uint64_t seq;
  int tag;
  size_t size;
  wire::Split split;
  char* dest = nullptr;     // the matched receive buffer, or `staging`
  char* staging = nullptr;  // malloc'd while no receive was posted at header time
  RecvSlot* slot = nullptr;
  int parts_left;
  bool complete = false;
  uint32_t parts_seen = 1;  // bit k: part k's header was read (part 0 comes with the header)
};

struct RecvComm {
  uint32_t magic = kRecvCommMagic;
  std::string peer;
  int64_t timeout_ms = 30000;
  std::vector<int> fds;
  std::vector<std::thread> threads;
  std::atomic<bool> stop{false};

  std::mutex mu;
  std::condition_variable cv;
  bool failed = false;
  // What a receive on a failed connection returns: kMalformedPayload when the peer's bytes
  // failed validation, kSystemError otherwise (closed, reset, timed out, out of memory).
  Status fail_status = Status::kSystemError;
  int clean_eofs = 0;
  uint64_t next_seq = 0;
  // Socket 0 is inside a message (its own stall bound applies); other sockets waiting for a
  // header do not count that time against their bound.
  bool headers_busy = false;
  // Socket 0 ended in an orderly close between messages: no header comes any more, so a socket
  // holding a part whose header has not arrived fails now, not after its wait's stall bound (a
  // sender killed between writing a part on socket k and the header on socket 0).
  bool headers_closed = false;
  std::map<uint64_t, RecvMsg*> active;  // header read, parts outstanding
  std::deque<RecvMsg*> unexpected;      // header read, no receive matched yet (seq order)
  std::deque<RecvSlot*> posted;         // receives waiting for a message (posting order)
  std::unordered_set<RecvRequest*> requests;

  ~RecvComm();

  // Marks the connection failed (logged once; `warn` false: at INFO, an orderly end) and wakes
  // the threads. mu held.
  void fail(const std::string& why, bool warn = true);

  // The peer's bytes failed validation.
  void malformed(const std::string& why);  // mu held

  // The receive `slot` takes message `msg`; copies now if the message is already complete.
  void bind_message(RecvMsg* msg, RecvSlot* slot);  // mu held; size already checked

  // Completes the receive slot of `msg` (complete and bound), copying out of staging. mu held.
  void finish(RecvMsg* msg);

  // One more part of `msg` has arrived; the last one completes it. mu held.
  void part_done(RecvMsg* msg);

  // Fails the connection when `msg` does not fit the receive `slot`. mu held.
  bool oversized(const RecvMsg* msg, const RecvSlot* slot);

  // Stream end on socket k: orderly close between messages is not an error unless receives
  // are still waiting; anything else fails the connection.
  void end_of_stream(int k, IoEnd end, bool mid_message, int err);

  // The thread of socket 0: message headers (matched to receives by tag) and part 0.
  void run_headers();

  // The thread of socket k > 0: part k of each message, once socket 0 has read its header.
  void run_parts(int k);
};

// ---------------------------------------------------------------- listen side

struct PendingSocket {
  int fd = -1;
  std::string peer;
  wire::Hello hello{};
  size_t got = 0;
  Clock::time_point start;
};

using wire::PendingGroup;

struct ListenComm {
  uint32_t magic = kListenCommMagic;
  int fd = -1;
  uint64_t secret = 0;
  uint64_t comm_id = 0;
  bool has_comm_id = false;
  int64_t timeout_ms = 30000;
  std::mutex mu;
  std::vector<PendingSocket> pending;
  std::vector<PendingGroup> groups;

  ~ListenComm() {
    close_socket(&fd);
    for (auto& p : pending) close_socket(&p.fd);
    for (auto& g : groups) {
      for (int& f : g.fds) close_socket(&f);
    }
  }
};

struct PendingConnect {
  std::string peer;
  std::vector<int> fds;
  std::vector<bool> connected;
  std::vector<size_t> hello_sent;
  wire::Hello hello{};
  Clock::time_point start;
  int64_t timeout_ms = 30000;

  ~PendingConnect() {
    for (int& f : fds) close_socket(&f);
  }
};

// For tests: after `starts_before_failure` more I/O thread starts, the next one fails as
// std::thread fails at the process's thread or pids limit (std::system_error, EAGAIN), or with
// `out_of_memory` as it fails without memory for the thread's state (std::bad_alloc), once;
// -1: none fails (the default).
void fail_thread_start_for_testing(int starts_before_failure, bool out_of_memory = false);

// ---------------------------------------------------------------- the backend

class SocketNet final : public NetBackend {
 public:
  Status init() override;
  Status devices(int* ndev) override;
  Status get_properties(int dev, dqNetPropertiesV11* props) override;
  Status listen(const CommContext& ctx, int dev, void* handle, void** listen_comm) override;
  Status connect(const CommContext& ctx, int dev, void* handle, void** send_comm) override;
  Status accept(void* listen_comm, void** recv_comm) override;
  Status reg_mr(void* comm, void* data, size_t size, int type, void** mhandle) override;
  Status dereg_mr(void* comm, void* mhandle) override;
  Status isend(void* send_comm, void* data, size_t size, int tag, void* mhandle,
               void** request) override;
  Status irecv(void* recv_comm, int n, void** data, const size_t* sizes, const int* tags,
               void** mhandles, void** request) override;
  Status test(void* request, int* done, int* sizes) override;
  Status close_send(void* send_comm) override;
  Status close_recv(void* recv_comm) override;
  Status close_listen(void* listen_comm) override;

 private:
  Status check_dev(int dev);
  // Logs "`what` on `dev` failed: errno" and returns kSystemError.
  static Status sys_fail(const char* what, const std::string& dev);
  // After a failure, a receive can still complete if staged, complete messages cover it.
  static bool completable_from_staging(RecvComm* rc, int n, const int* tags);
  // Opens the handle's sockets (non-blocking connects) into the fresh connect `pc`.
  Status start_connect(const CommContext& ctx, const wire::Handle& h, PendingConnect* pc);
  // Finishes the connects and sends each socket's hello; then makes *send_comm.
  Status progress_connect(PendingConnect* pc, void** send_comm);
  // Reads the hellos of the sockets accepted so far; admitted ones join their group.
  void progress_hellos(ListenComm* lc);
  // Validates a complete hello; on success the socket joins its connection's group.
  bool admit_socket(ListenComm* lc, const PendingSocket& p);
  // A receive comm over the sockets of a complete group, with its I/O threads.
  static Status make_recv_comm(std::vector<int> fds, const std::string& peer, int64_t timeout_ms,
                               void** recv_comm);

  std::once_flag once_;
  Status init_status_ = Status::kOk;
  std::vector<NetDevice> devices_;
};

}  // namespace dq::net::sock

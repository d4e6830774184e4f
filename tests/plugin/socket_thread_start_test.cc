// The socket backend's set-up under injected failures.
// - A connection's I/O thread cannot start (std::thread throws std::system_error, EAGAIN, at the
//   process's thread or pids limit): connect and accept return an error, the threads already
//   started are joined and the connection's sockets closed. Injected with
//   fail_thread_start_for_testing; the environment sets DYNAMIQ_NET_IFNAME=lo and
//   DYNAMIQ_NET_NSOCKS=3, so the second of three threads fails after the first started.
// - accept(2) reports an incoming connection's own failure (Linux passes a new connection's
//   pending network error to accept): the listener goes on. Injected by this program's accept4,
//   which the backend's call resolves to before libc's.
#include <dirent.h>
#include <errno.h>
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <thread>

#include "plugin/net_backend.h"
#include "plugin/socket/socket_comms.h"

namespace {
// accept4 calls still to fail, and the errno they fail with.
std::atomic<int> g_failing_accepts{0};
std::atomic<int> g_accept_errno{0};
}  // namespace

extern "C" int accept4(int fd, sockaddr* addr, socklen_t* len, int flags) {
  if (g_failing_accepts.load() > 0 && g_failing_accepts.fetch_sub(1) > 0) {
    errno = g_accept_errno.load();
    return -1;
  }
  return static_cast<int>(syscall(SYS_accept4, fd, addr, len, flags));
}

namespace dq::net::sock {
namespace {

// Entries of a /proc/self folder (its own descriptor, while reading, counted the same each time).
int count_entries(const char* dir) {
  DIR* d = opendir(dir);
  if (d == nullptr) return -1;
  int n = 0;
  while (const dirent* e = readdir(d)) n += e->d_name[0] != '.';
  closedir(d);
  return n;
}
int open_fds() {
  return count_entries("/proc/self/fd");
}
int live_threads() {
  return count_entries("/proc/self/task");
}

constexpr auto kDeadline = std::chrono::seconds(5);

class SocketThreadStartTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_EQ(net_.init(), Status::kOk);
    int ndev = 0;
    ASSERT_EQ(net_.devices(&ndev), Status::kOk);
    ASSERT_GE(ndev, 1);
    fds_before_ = open_fds();
    threads_before_ = live_threads();
    ASSERT_EQ(net_.listen(ctx_, 0, handle_, &listen_comm_), Status::kOk);
  }
  void TearDown() override { fail_thread_start_for_testing(-1); }

  // connect() until it gives a comm or an error.
  Status connect(void** send_comm) {
    const auto start = std::chrono::steady_clock::now();
    while (std::chrono::steady_clock::now() - start < kDeadline) {
      const Status st = net_.connect(ctx_, 0, handle_, send_comm);
      if (st != Status::kOk || *send_comm != nullptr) return st;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    return Status::kTimeout;
  }
  // accept() until it gives a comm or an error.
  Status accept(void** recv_comm) {
    const auto start = std::chrono::steady_clock::now();
    while (std::chrono::steady_clock::now() - start < kDeadline) {
      const Status st = net_.accept(listen_comm_, recv_comm);
      if (st != Status::kOk || *recv_comm != nullptr) return st;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    return Status::kTimeout;
  }

  NetBackend& net_ = socket_backend();
  CommContext ctx_;
  char handle_[NCCL_NET_HANDLE_MAXSIZE] = {};
  void* listen_comm_ = nullptr;
  int fds_before_ = 0;
  int threads_before_ = 0;
};

TEST_F(SocketThreadStartTest, ConnectFailsCleanlyWhenAThreadCannotStart) {
  fail_thread_start_for_testing(1);
  void* send_comm = nullptr;
  EXPECT_EQ(connect(&send_comm), Status::kSystemError);
  EXPECT_EQ(send_comm, nullptr);
  EXPECT_EQ(live_threads(), threads_before_);  // the thread that started was joined
  EXPECT_EQ(net_.close_listen(listen_comm_), Status::kOk);
  EXPECT_EQ(open_fds(), fds_before_);  // the connection's sockets were closed
}

// Without memory for the thread's state std::thread throws std::bad_alloc, not std::system_error:
// the same clean failure (uncaught, it destroyed the comm with a joinable thread: terminate).
TEST_F(SocketThreadStartTest, ConnectFailsCleanlyWithoutMemoryForAThread) {
  fail_thread_start_for_testing(1, true);
  void* send_comm = nullptr;
  EXPECT_EQ(connect(&send_comm), Status::kSystemError);
  EXPECT_EQ(send_comm, nullptr);
  EXPECT_EQ(live_threads(), threads_before_);
  EXPECT_EQ(net_.close_listen(listen_comm_), Status::kOk);
  EXPECT_EQ(open_fds(), fds_before_);
}

TEST_F(SocketThreadStartTest, AcceptFailsCleanlyWhenAThreadCannotStart) {
  void* send_comm = nullptr;
  ASSERT_EQ(connect(&send_comm), Status::kOk);
  ASSERT_NE(send_comm, nullptr);
  fail_thread_start_for_testing(1);
  void* recv_comm = nullptr;
  EXPECT_EQ(accept(&recv_comm), Status::kSystemError);
  EXPECT_EQ(recv_comm, nullptr);
  fail_thread_start_for_testing(-1);
  EXPECT_EQ(net_.close_send(send_comm), Status::kOk);
  EXPECT_EQ(live_threads(), threads_before_);
  EXPECT_EQ(net_.close_listen(listen_comm_), Status::kOk);
  EXPECT_EQ(open_fds(), fds_before_);
}

TEST_F(SocketThreadStartTest, ConnectionsStillWorkAfterwards) {
  fail_thread_start_for_testing(1);
  void* failed = nullptr;
  ASSERT_EQ(connect(&failed), Status::kSystemError);
  void* send_comm = nullptr;
  void* recv_comm = nullptr;
  ASSERT_EQ(connect(&send_comm), Status::kOk);
  ASSERT_EQ(accept(&recv_comm), Status::kOk);
  ASSERT_NE(recv_comm, nullptr);
  EXPECT_EQ(net_.close_send(send_comm), Status::kOk);
  EXPECT_EQ(net_.close_recv(recv_comm), Status::kOk);
  EXPECT_EQ(net_.close_listen(listen_comm_), Status::kOk);
  EXPECT_EQ(live_threads(), threads_before_);
  EXPECT_EQ(open_fds(), fds_before_);
}

// Each error accept(2)'s manual lists as a new connection's pending network error, and the two
// that say the connection was aborted or the call interrupted: the next accept takes the
// connection that is waiting (before, each failed the accept and so the communicator's set-up).
TEST_F(SocketThreadStartTest, AcceptGoesOnAfterAConnectionsOwnFailure) {
  for (const int e : {EINTR, ECONNABORTED, ENETDOWN, EPROTO, ENOPROTOOPT, EHOSTDOWN, ENONET,
                      EHOSTUNREACH, EOPNOTSUPP, ENETUNREACH}) {
    void* send_comm = nullptr;
    ASSERT_EQ(connect(&send_comm), Status::kOk);
    g_accept_errno = e;
    g_failing_accepts = 2;
    void* recv_comm = nullptr;
    EXPECT_EQ(accept(&recv_comm), Status::kOk) << std::strerror(e);
    EXPECT_NE(recv_comm, nullptr) << std::strerror(e);
    EXPECT_EQ(g_failing_accepts.load(), 0) << "the injected failures were not reached";
    EXPECT_EQ(net_.close_send(send_comm), Status::kOk);
    if (recv_comm != nullptr) {
      EXPECT_EQ(net_.close_recv(recv_comm), Status::kOk);
    }
  }
  EXPECT_EQ(net_.close_listen(listen_comm_), Status::kOk);
  EXPECT_EQ(live_threads(), threads_before_);
  EXPECT_EQ(open_fds(), fds_before_);
}

// An error of the listener itself (out of descriptors) still fails the accept, with nothing left
// open once the listener is closed.
TEST_F(SocketThreadStartTest, AcceptReportsTheListenersOwnFailure) {
  void* send_comm = nullptr;
  ASSERT_EQ(connect(&send_comm), Status::kOk);
  g_accept_errno = EMFILE;
  g_failing_accepts = 1;
  void* recv_comm = nullptr;
  EXPECT_EQ(accept(&recv_comm), Status::kSystemError);
  EXPECT_EQ(recv_comm, nullptr);
  g_failing_accepts = 0;
  EXPECT_EQ(net_.close_send(send_comm), Status::kOk);
  EXPECT_EQ(net_.close_listen(listen_comm_), Status::kOk);
  EXPECT_EQ(live_threads(), threads_before_);
  EXPECT_EQ(open_fds(), fds_before_);
}

}  // namespace
}  // namespace dq::net::sock

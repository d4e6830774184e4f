// The rendezvous helper: read_job_env() (rank, size and local rank from the launcher's variables)
// and the TCP rendezvous's listener.
#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>

#include "tools/run/rendezvous.h"

namespace {

constexpr const char* kVariables[] = {"RANK",
                                      "WORLD_SIZE",
                                      "LOCAL_RANK",
                                      "OMPI_COMM_WORLD_RANK",
                                      "OMPI_COMM_WORLD_SIZE",
                                      "OMPI_COMM_WORLD_LOCAL_RANK",
                                      "PMI_RANK",
                                      "PMI_SIZE",
                                      "MPI_LOCALRANKID",
                                      "SLURM_PROCID",
                                      "SLURM_NTASKS",
                                      "SLURM_LOCALID"};

// A multi-rank job also needs a rendezvous: MASTER_ADDR and MASTER_PORT (loopback, never used).
void clear_launcher() {
  for (const char* v : kVariables) unsetenv(v);
  setenv("MASTER_ADDR", "127.0.0.1", 1);
  setenv("MASTER_PORT", "29999", 1);
}

TEST(RendezvousEnv, TheFirstLaunchersFamilyGivesRankSizeAndLocalRank) {
  clear_launcher();
  setenv("RANK", "3", 1);
  setenv("WORLD_SIZE", "8", 1);
  setenv("LOCAL_RANK", "1", 1);
  setenv("SLURM_PROCID", "0", 1);  // an outer launcher's: the innermost wins
  setenv("SLURM_NTASKS", "2", 1);
  dq::rendezvous::JobEnv job;
  ASSERT_EQ(dq::rendezvous::read_job_env(&job), dq::Status::kOk);
  EXPECT_EQ(job.rank, 3);
  EXPECT_EQ(job.world_size, 8);
  EXPECT_EQ(job.local_rank, 1);
  clear_launcher();
}

// Slurm's PMI-2 plugin (srun --mpi=pmi2) sets PMI_RANK and PMI_SIZE but not MPI_LOCALRANKID: the
// local rank is Slurm's for the same task (its rank agrees), not the global rank, which on two
// nodes of 4 tasks placed cyclically gave rank 2 the device of local rank 2 instead of 1.
TEST(RendezvousEnv, ALocalRankMissingFromItsFamilyComesFromTheSameTasksOther) {
  clear_launcher();
  setenv("PMI_RANK", "5", 1);
  setenv("PMI_SIZE", "8", 1);
  setenv("SLURM_PROCID", "5", 1);
  setenv("SLURM_NTASKS", "8", 1);
  setenv("SLURM_LOCALID", "1", 1);
  dq::rendezvous::JobEnv job;
  ASSERT_EQ(dq::rendezvous::read_job_env(&job), dq::Status::kOk);
  EXPECT_EQ(job.rank, 5);
  EXPECT_EQ(job.local_rank, 1);
  // Slurm's variables of another step (an sbatch script's: rank 0): not this task's.
  setenv("SLURM_PROCID", "0", 1);
  setenv("SLURM_LOCALID", "0", 1);
  ASSERT_EQ(dq::rendezvous::read_job_env(&job), dq::Status::kOk);
  EXPECT_EQ(job.local_rank, 5);
  clear_launcher();
}

// The local address of the TCP socket listening on `port` ("0100007F" is 127.0.0.1, "00000000"
// any), from /proc/net/tcp; empty while there is none.
std::string listener_address(int port) {
  std::ifstream f("/proc/net/tcp");
  std::string line;
  std::getline(f, line);  // the header
  char hex_port[8];
  std::snprintf(hex_port, sizeof hex_port, "%04X", port);
  while (std::getline(f, line)) {
    std::istringstream in(line);
    std::string slot, local, remote, state;
    in >> slot >> local >> remote >> state;
    if (state == "0A" && local.size() == 13 && local.substr(9) == hex_port)
      return local.substr(0, 8);
  }
  return "";
}

// A port no socket holds now (the kernel's choice; a small race until the rendezvous binds it).
int free_loopback_port() {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  int port = 0;
  if (fd >= 0 && bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 &&
      getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0)
    port = ntohs(a.sin_port);
  if (fd >= 0) close(fd);
  return port;
}

// A job on one host (MASTER_ADDR 127.0.0.1): rank 0's rendezvous listens on loopback only, never on
// every address of the host, where anything that can reach it could read the unique id.
TEST(RendezvousTcp, ALoopbackMasterAddressListensOnLoopbackOnly) {
  dq::rendezvous::JobEnv env;
  env.world_size = 2;
  env.master_addr = "127.0.0.1";
  env.master_port = free_loopback_port() - 1;  // the rendezvous listens on MASTER_PORT + 1
  env.timeout_s = 30;
  unsigned char sent[16] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16};
  dq::Status published = dq::Status::kInternal;
  std::thread rank0([&] { published = dq::rendezvous::share_bytes(env, "probe", sent, 16); });
  std::string address;
  for (int i = 0; i < 3000 && address.empty(); ++i) {  // at most 30 s
    address = listener_address(env.master_port + 1);
    if (address.empty()) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  dq::rendezvous::JobEnv peer = env;
  peer.rank = 1;
  unsigned char got[16] = {};
  EXPECT_EQ(dq::rendezvous::share_bytes(peer, "probe", got, 16), dq::Status::kOk);
  rank0.join();
  EXPECT_EQ(published, dq::Status::kOk);
  EXPECT_EQ(std::memcmp(sent, got, 16), 0);
  EXPECT_EQ(address, "0100007F") << "the rendezvous listened on " << address;
}

}  // namespace

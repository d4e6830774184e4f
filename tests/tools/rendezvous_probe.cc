// Test helper: shares 128 bytes drawn by rank 0 through the rendezvous helper and prints them
// in hex, so a test can check that every rank got the same bytes. Exit 1 on failure.
#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>

#include "tools/run/rendezvous.h"

int main(int argc, char** argv) {
  const char* key = argc > 1 ? argv[1] : "probe-id";
  dq::rendezvous::JobEnv job;
  if (dq::rendezvous::read_job_env(&job) != dq::Status::kOk) return 1;
  unsigned char id[128] = {};
  if (job.rank == 0) {
    int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
    if (fd < 0 || read(fd, id, sizeof id) != static_cast<ssize_t>(sizeof id)) return 1;
    close(fd);
  }
  if (dq::rendezvous::share_bytes(job, key, id, sizeof id) != dq::Status::kOk) {
    std::fprintf(stderr, "probe: rank %d: rendezvous failed\n", job.rank);
    return 1;
  }
  std::printf("rank %d of %d id ", job.rank, job.world_size);
  for (unsigned char b : id) std::printf("%02x", b);
  std::printf("\n");
  return 0;
}

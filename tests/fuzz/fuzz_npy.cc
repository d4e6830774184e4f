// libFuzzer target: the simulator's .npy reader (tools/sim/gradients.h read_npy) on arbitrary
// file contents. The bytes are written to an in-memory file (memfd) read through its
// /proc/self/fd path, as read_npy opens a path. Invariant: success means a 2-D float32 matrix
// with rows * cols values, rows no more than asked for.
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "tools/sim/gradients.h"

namespace {

int g_fd = -1;
std::string g_path;

void check(bool ok) {
  if (!ok) __builtin_trap();
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  g_fd = memfd_create("fuzz-npy", 0);
  if (g_fd < 0) std::abort();
  g_path = "/proc/self/fd/" + std::to_string(g_fd);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (ftruncate(g_fd, 0) != 0) std::abort();
  size_t done = 0;
  while (done < size) {
    const ssize_t n = pwrite(g_fd, data + done, size - done, static_cast<off_t>(done));
    if (n <= 0) std::abort();
    done += static_cast<size_t>(n);
  }
  // The simulator reads a handful of rows (one per simulated worker).
  const size_t max_rows = size > 0 ? 1 + data[size - 1] % 8 : 4;
  dq::sim::Matrix m;
  std::string error;
  const dq::Status s = dq::sim::read_npy(g_path, max_rows, &m, &error);
  if (s == dq::Status::kOk) {
    check(m.rows <= max_rows && m.data.size() == m.rows * m.cols);
  } else {
    check(!error.empty());
  }
  return 0;
}

// The fused hop's and the finish's level tables in shared memory (stage_level_tables() in
// kernels/cuda/dynamiq_hop.cu reads max_mag, extra_steps and the levels, and derives the lookups
// and the decode table; the finish's call derives the decode table alone)
// against the host's build_level_table(), every byte, for the widths' default eps, uniform levels
// and a spread of eps. This file compiles the kernel file itself (it links instead of
// dynamiq_hop_emu.cc), so the test kernel below reaches the file's internal functions.
#include "kernels/cuda/dynamiq_hop.cu"

#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "tests/kernels/cuda/device_buffers.h"

namespace dq::cuda {

// Stages `host` (three tables) the hop's way (`lookups`; the finish's way without) and writes the
// shared copy to `out` word by word.
__global__ void staged_level_tables_kernel(const LevelTable* host, LevelTable* out, int lookups) {
  __shared__ LevelTable s_tables[3];
  stage_level_tables(host, s_tables, lookups != 0);
  const uint32_t* from = reinterpret_cast<const uint32_t*>(s_tables);
  uint32_t* to = reinterpret_cast<uint32_t*>(out);
  for (size_t w = threadIdx.x; w < sizeof s_tables / 4; w += blockDim.x) to[w] = from[w];
}

namespace {

// The fields the kernels read, compared as bit patterns (the host zeroes what lies beyond L); a
// decode (`lookups` false: the finish) reads no inv_gap or start.
void expect_same_table(const LevelTable& h, const LevelTable& d, bool lookups, const char* what) {
  ASSERT_EQ(h.max_mag, d.max_mag) << what;
  ASSERT_EQ(h.extra_steps, d.extra_steps) << what;
  const int top = h.max_mag;
  for (int r = 0; r <= top + 1; ++r)
    ASSERT_EQ(std::memcmp(&h.level[r], &d.level[r], 4), 0) << what << " level " << r;
  for (int r = 0; r <= top && lookups; ++r)
    ASSERT_EQ(std::memcmp(&h.inv_gap[r], &d.inv_gap[r], 4), 0) << what << " inv_gap " << r;
  for (int c = 0; c <= kLevelGrid && lookups; ++c)
    ASSERT_EQ(h.start[c], d.start[c]) << what << " cell " << c;
  for (int c = 0; c < 256; ++c)
    ASSERT_EQ(std::memcmp(&h.decode[c], &d.decode[c], 4), 0) << what << " code " << c;
}

TEST(CudaDynamiqHopTables, StagedTablesMatchTheHostBuilder) {
  std::vector<DynamiqOptions> cases(1);
  cases.push_back(DynamiqOptions{});
  cases.back().nonuniform_levels = false;
  // The spec's whole range of eps ([0, 2]): 1e-12 rounds q to 1 (uniform levels); at 2 the
  // lowest 8-bit levels flush to 0 in FP32, so equal levels meet the bisection.
  for (float eps : {0.0f, 1e-12f, 0.01f, 0.05f, 0.3f, 0.5f, 1.0f, 2.0f}) {
    cases.push_back(DynamiqOptions{});
    for (float& e : cases.back().eps) e = eps;
  }
  for (size_t i = 0; i < cases.size(); ++i)
    for (int lookups : {1, 0}) {
      LevelTable host[3], dev[3];
      dynamiq_level_tables(cases[i], host);
      std::memset(dev, 0xA5, sizeof dev);
      const test::DeviceArray<LevelTable> d_host(host, 3);
      const test::DeviceArray<LevelTable> d_dev(dev, 3);
      ASSERT_EQ(DQ_LAUNCH(staged_level_tables_kernel, dim3(1), dim3(kHopThreads), 0, nullptr,
                          d_host.get(), d_dev.get(), lookups),
                cudaSuccess)
          << test::kernel_fault();
      ASSERT_EQ(d_dev.fetch(dev), cudaSuccess);
      for (int w = 0; w < 3; ++w) {
        const std::string what = "case " + std::to_string(i) + " width " + std::to_string(2 << w) +
                                 (lookups ? "" : " (decode only)");
        expect_same_table(host[w], dev[w], lookups != 0, what.c_str());
        if (HasFatalFailure()) return;
      }
    }
}

}  // namespace
}  // namespace dq::cuda

// Suite gpu: the device's codec arithmetic must equal the host's bit for bit. Exits 77 (skipped)
// where no GPU can run it.
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "kernels/baselines/mx_element.h"
#include "kernels/bf16.h"
#include "kernels/cuda/device_math_check.h"
#include "kernels/dynamiq_codec.h"
#include "kernels/dynamiq_math.h"

int main() {
  using namespace dq;
  std::mt19937 gen(42);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> values(1 << 16);
  for (auto& v : values) v = normal(gen) * (gen() % 2 ? 1.0f : 1e-30f);
  values[0] = 0.0f;
  values[1] = -0.0f;
  values[2] = 3.0e38f;
  values[3] = 1e-40f;
  LevelTable table;
  build_level_table(8, 0.1f, true, &table);
  const uint64_t seed = 0x1234567890abcdefull, call = 99;
  const uint32_t strata = 5;
  std::vector<cuda::MathProbe> device;
  if (!cuda::run_math_probe(values, table, seed, call, strata, &device)) {
    std::puts("no CUDA device: skipped");
    return 77;
  }
  size_t mismatches = 0;
  for (size_t e = 0; e < values.size(); ++e) {
    const cuda::MathProbe p =
        cuda::compute_probe(values[e], static_cast<uint32_t>(e), table, seed, call, strata);
    if (std::memcmp(&p, &device[e], sizeof p) != 0 && mismatches++ < 10)
      std::printf("element %zu (x=%g): device bytes differ from host\n", e, values[e]);
  }
  std::printf("%zu of %zu elements differ between device and host\n", mismatches, values.size());
  return mismatches == 0 ? 0 : 1;
}

// The GPU probe of the shared codec arithmetic (kernels/cuda/device_math_check.cu): the same
// per-element function runs on the device and on the host, and the results must match byte
// for byte.
#pragma once
#include <cstdint>
#include <vector>

#include "kernels/baselines/mx_element.h"
#include "kernels/bf16.h"
#include "kernels/dynamiq_math.h"
#include "kernels/philox.h"

namespace dq::cuda {

struct MathProbe {
  uint32_t philox[4];
  uint32_t stratum;
  int32_t magnitude;
  uint16_t bf16_rne, bf16_up, bf16_stochastic, unit, bits16, tie_up;
  uint8_t factor, mx_fp8, mx_fp4, pad;
  float decoded;
};

DQ_HD MathProbe compute_probe(float x, uint32_t e, const LevelTable& table, uint64_t seed,
                              uint64_t call, uint32_t strata) {
  MathProbe p{};
  const Philox4 w = philox_draw(seed, call, e & 7, kStreamRounding, e);
  for (int i = 0; i < 4; ++i) p.philox[i] = w.v[i];
  p.stratum = correlated_stratum(seed, call, e % 3, e / 16, e % strata, strata);
  p.magnitude = round_magnitude(table, magnitude_ratio(x, 1.5f), static_cast<float>(p.stratum),
                                static_cast<float>(strata), seed, call, e & 7, e);
  p.bits16 = static_cast<uint16_t>(rounding_bits16(seed, call, e & 7, e));
  // The tie rule (rare in real data) on every element: x within one 2^-16 step of the bits.
  const float x_tie =
      (static_cast<float>(p.bits16) + static_cast<float>(e & 255) / 256.0f) * 0x1p-16f;
  p.tie_up = static_cast<uint16_t>(
      round_up_tie(x_tie, p.bits16, rounding_tie_uniform(seed, call, e & 7, e)));
  const float mag = x < 0 ? -x : x;
  p.bf16_rne = f32_to_bf16_rne(x);
  p.bf16_up = f32_to_bf16_up(mag);
  p.bf16_stochastic = f32_to_bf16_stochastic(x, w.v[0]);
  p.unit = supergroup_unit_bf16(mag);
  p.factor = group_factor(mag, 0.01f);
  p.mx_fp8 = mx_encode_element(MxKind::kFp8E4M3, x);
  p.mx_fp4 = mx_encode_element(MxKind::kFp4E2M1, x);
  p.decoded = decode_code(table, e % (2 * table.max_mag + 1), 0.75f);
  return p;
}

// Runs compute_probe for every value on the GPU; false (and *out empty) without a device.
bool run_math_probe(const std::vector<float>& values, const LevelTable& table, uint64_t seed,
                    uint64_t call, uint32_t strata, std::vector<MathProbe>* out);

}  // namespace dq::cuda

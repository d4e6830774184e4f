// Comparison baselines behind the Codec interface (BF16, OCP MX v1.0, uniform stochastic),
// re-quantized at every hop exactly like DynamiQ so every comparison runs the same hops.
// Byte layouts: docs/FORMAT.md.
#pragma once
#include <cstdint>
#include <memory>

#include "kernels/codec.h"

namespace dq {

enum class MxKind { kFp8E4M3, kFp6E3M2, kFp6E2M3, kFp4E2M1 };

// Round to nearest even at every hop; 16 bits per coordinate plus the chunk header.
std::unique_ptr<Codec> make_bf16_codec();
// OCP Microscaling v1.0: 32-element blocks sharing an E8M0 scale.
std::unique_ptr<Codec> make_mx_codec(MxKind kind);
// "uniform:B": (B-1)-bit symmetric codes with unbiased stochastic rounding and one BF16 scale
// per group of 16 values, B bits per coordinate. B in 3..9, otherwise nullptr.
std::unique_ptr<Codec> make_uniform_codec(int total_bits);

}  // namespace dq

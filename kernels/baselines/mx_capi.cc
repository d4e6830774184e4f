// C entry points to the MX element codec, loaded with ctypes by tests/kernels/mx_vs_ml_dtypes.py.
// kind: 0 = E4M3, 1 = E3M2, 2 = E2M3, 3 = E2M1. Returns 0 on success, -1 on a bad argument.
#include <cstddef>
#include <cstdint>

#include "common/abi_guard.h"
#include "kernels/baselines/mx_element.h"

namespace {

bool mx_kind_from_int(int kind, dq::MxKind* out) {
  switch (kind) {
    case 0:
      *out = dq::MxKind::kFp8E4M3;
      return true;
    case 1:
      *out = dq::MxKind::kFp6E3M2;
      return true;
    case 2:
      *out = dq::MxKind::kFp6E2M3;
      return true;
    case 3:
      *out = dq::MxKind::kFp4E2M1;
      return true;
    default:
      return false;
  }
}

}  // namespace

#define DQ_CAPI extern "C" __attribute__((visibility("default")))

// Encodes n already scaled FP32 values to element codes (RNE, saturating).
DQ_CAPI int dq_mx_encode(int kind, const float* in, uint8_t* out, size_t n) {
  return dq::abi_guard(
      [&] {
        dq::MxKind k;
        if (!mx_kind_from_int(kind, &k) || (n > 0 && (in == nullptr || out == nullptr))) return -1;
        for (size_t i = 0; i < n; ++i) out[i] = dq::mx_encode_element(k, in[i]);
        return 0;
      },
      -2);
}

// Decodes n element codes to FP32.
DQ_CAPI int dq_mx_decode(int kind, const uint8_t* in, float* out, size_t n) {
  return dq::abi_guard(
      [&] {
        dq::MxKind k;
        if (!mx_kind_from_int(kind, &k) || (n > 0 && (in == nullptr || out == nullptr))) return -1;
        for (size_t i = 0; i < n; ++i) out[i] = dq::mx_decode_element(k, in[i]);
        return 0;
      },
      -2);
}

// Linked into the codec tests: DYNAMIQ_HOST_ISA=scalar|avx2|avx512|auto (as the engine's setting)
// forces the host codec's path before any test runs, so one test binary is run once per path
// (meson registers each test per ISA; tests/kernels/meson.build). A path this CPU lacks: exit 77
// (skip).
#include <cstdio>
#include <cstdlib>

#include "kernels/host_isa.h"

namespace {

const bool kForced = [] {
  const char* text = std::getenv("DYNAMIQ_HOST_ISA");
  if (text == nullptr || *text == '\0') return false;
  dq::HostIsa isa;
  if (!dq::parse_host_isa(text, &isa)) {
    std::fprintf(stderr, "DYNAMIQ_HOST_ISA=%s: expected scalar, avx2, avx512 or auto\n", text);
    std::exit(2);
  }
  if (!dq::select_host_isa(isa)) {
    std::fprintf(stderr, "DYNAMIQ_HOST_ISA=%s: not supported by this CPU; skipped\n", text);
    std::exit(77);
  }
  std::fprintf(stderr, "host codec path: %s\n", dq::host_isa_name());
  return true;
}();

}  // namespace

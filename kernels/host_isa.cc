#include "kernels/host_isa.h"

#include <atomic>
#include <cstring>

namespace dq {
namespace {

HostIsa best_supported() {
  return host_isa_supported(HostIsa::kAvx2) ? HostIsa::kAvx2 : HostIsa::kScalar;
}

// Selected once at start-up (the first codec made), or by select_host_isa().
std::atomic<HostIsa>& selected() {
  static std::atomic<HostIsa> isa{best_supported()};
  return isa;
}

}  // namespace

bool host_isa_supported(HostIsa isa) {
  if (isa != HostIsa::kAvx2) return true;
#if defined(__x86_64__) || defined(__i386__)
  return __builtin_cpu_supports("avx2");
#else
  return false;
#endif
}

bool select_host_isa(HostIsa isa) {
  if (!host_isa_supported(isa)) return false;
  selected().store(isa == HostIsa::kAuto ? best_supported() : isa);
  return true;
}

HostIsa host_isa() { return selected().load(); }

const char* host_isa_name(HostIsa isa) {
  switch (isa) {
    case HostIsa::kScalar:
      return "scalar";
    case HostIsa::kAvx2:
      return "avx2";
    case HostIsa::kAuto:
      break;
  }
  return "auto";
}

bool parse_host_isa(const char* text, HostIsa* isa) {
  for (HostIsa candidate : {HostIsa::kAuto, HostIsa::kScalar, HostIsa::kAvx2})
    if (text != nullptr && std::strcmp(text, host_isa_name(candidate)) == 0) {
      *isa = candidate;
      return true;
    }
  return false;
}

}  // namespace dq

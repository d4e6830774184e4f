#include "kernels/host_isa.h"

#include <atomic>
#include <cstring>

#include "common/log.h"

namespace dq {
namespace {

HostIsa best_supported() {
  for (HostIsa isa : {HostIsa::kAvx512, HostIsa::kAvx2})
    if (host_isa_supported(isa)) return isa;
  return HostIsa::kScalar;
}

// Selected once at start-up (the first codec made), or by select_host_isa().
std::atomic<HostIsa>& selected() {
  static std::atomic<HostIsa> isa{best_supported()};
  return isa;
}

}  // namespace

bool host_isa_supported(HostIsa isa) {
  if (isa == HostIsa::kAuto || isa == HostIsa::kScalar) return true;
#if defined(__x86_64__) || defined(__i386__)
  if (isa == HostIsa::kAvx2) return __builtin_cpu_supports("avx2");
  // The four subsets the AVX-512 path's target names (kernels/host_avx512_begin.h).
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("avx512f") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512dq");
#else
  return false;
#endif
}

bool select_host_isa(HostIsa isa) {
  if (!host_isa_supported(isa)) return false;
  selected().store(isa == HostIsa::kAuto ? best_supported() : isa);
  return true;
}

HostIsa host_isa() {
  return selected().load();
}

const char* host_isa_name(HostIsa isa) {
  switch (isa) {
    case HostIsa::kScalar:
      return "scalar";
    case HostIsa::kAvx2:
      return "avx2";
    case HostIsa::kAvx512:
      return "avx512";
    case HostIsa::kAuto:
      break;
  }
  return "auto";
}

bool parse_host_isa(const char* text, HostIsa* isa) {
  for (HostIsa candidate : {HostIsa::kAuto, HostIsa::kScalar, HostIsa::kAvx2, HostIsa::kAvx512})
    if (text != nullptr && std::strcmp(text, host_isa_name(candidate)) == 0) {
      *isa = candidate;
      return true;
    }
  return false;
}

void apply_host_isa_setting(const char* value) {
  HostIsa isa = HostIsa::kAuto;
  parse_host_isa(value, &isa);         // anything else was refused by the settings' validation
  static std::atomic<int> logged{-1};  // the path last logged: one line per change, not per engine
  if (!select_host_isa(isa)) {
    if (logged.load() == -1)
      DQ_WARN(Subsys::kKernel,
              "dynamiq: DYNAMIQ_HOST_ISA=%s: this CPU lacks it; taking auto's path", value);
    select_host_isa(HostIsa::kAuto);
  }
  const int taken = static_cast<int>(host_isa());
  if (logged.exchange(taken) != taken)
    DQ_INFO(Subsys::kKernel, "dynamiq: host codec path: %s (DYNAMIQ_HOST_ISA=%s)", host_isa_name(),
            value);
}

}  // namespace dq

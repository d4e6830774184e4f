#include "kernels/host_isa.h"

#include <atomic>
#include <cstring>
#include <mutex>
#include <string>

#include "common/log.h"
#include "kernels/host_path_check.h"

namespace dq {
namespace {

HostIsa best_supported() {
  for (HostIsa isa : {HostIsa::kAvx512, HostIsa::kAvx2})
    if (host_isa_supported(isa)) return isa;
  return HostIsa::kScalar;
}

// The path selected by select_host_isa(), or on first need by host_isa(); kAuto until then. Not a
// function-local static initialised with best_supported(): a failed start-up check logs, the log's
// first use reads the settings, and validating DYNAMIQ_CODEC makes a codec, which asks
// host_isa() again, inside that initialisation.
std::atomic<HostIsa> g_selected{HostIsa::kAuto};

// ThreadHostIsa's path for this thread; kAuto: none, g_selected applies.
thread_local HostIsa t_thread_isa = HostIsa::kAuto;

// The start-up check of a vector path (kAvx2 or kAvx512): run once per process on first need, and
// its failure logged once, after the check (a codec made while logging finds it done).
std::once_flag g_check_once[2];
std::atomic<bool> g_check_failed[2];  // the check ran and failed (host_isa_refused)

bool passes_start_up_check(HostIsa isa) {
  static bool passed[2];
  static std::string difference[2];
  static std::atomic<bool> warned[2];
  const int k = isa == HostIsa::kAvx2 ? 0 : 1;
  std::call_once(g_check_once[k], [isa, k] {
    passed[k] = host_path_gives_scalar_bytes(isa, &difference[k]);
    g_check_failed[k].store(!passed[k]);
  });
  if (!passed[k] && !warned[k].exchange(true))
    DQ_WARN(Subsys::kKernel,
            "dynamiq: the %s host codec path writes other bytes than the scalar path on this CPU "
            "(%s): an emulated or faulty CPU; the path is not used",
            host_isa_name(isa), difference[k].c_str());
  return passed[k];
}

}  // namespace

bool host_isa_supported(HostIsa isa) {
  if (isa == HostIsa::kAuto || isa == HostIsa::kScalar) return true;
  return host_isa_cpu_has(isa) && passes_start_up_check(isa);
}

bool host_isa_refused(HostIsa isa) {
  if (isa == HostIsa::kAuto || isa == HostIsa::kScalar) return false;
  return g_check_failed[isa == HostIsa::kAvx2 ? 0 : 1].load();
}

bool host_isa_cpu_has(HostIsa isa) {
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
  g_selected.store(isa == HostIsa::kAuto ? best_supported() : isa);
  return true;
}

ThreadHostIsa::ThreadHostIsa(HostIsa isa) : previous_(t_thread_isa) {
  t_thread_isa = isa;
}

ThreadHostIsa::~ThreadHostIsa() {
  t_thread_isa = previous_;
}

HostIsa host_isa() {
  if (t_thread_isa != HostIsa::kAuto) return t_thread_isa;
  HostIsa isa = g_selected.load();
  if (isa != HostIsa::kAuto) return isa;
  const HostIsa best = best_supported();
  // Another thread's (or a nested) first choice may have landed meanwhile: keep the one stored.
  return g_selected.compare_exchange_strong(isa, best) ? best : isa;
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
      DQ_WARN(Subsys::kKernel, "dynamiq: DYNAMIQ_HOST_ISA=%s: %s; taking auto's path", value,
              host_isa_cpu_has(isa) ? "the path failed its start-up check on this CPU"
                                    : "this CPU lacks it");
    select_host_isa(HostIsa::kAuto);
  }
  const int taken = static_cast<int>(host_isa());
  if (logged.exchange(taken) != taken)
    DQ_INFO(Subsys::kKernel, "dynamiq: host codec path: %s (DYNAMIQ_HOST_ISA=%s)", host_isa_name(),
            value);
}

}  // namespace dq

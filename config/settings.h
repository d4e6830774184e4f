// dynamiq's settings: one table (settings.def) for every environment variable the project's
// libraries read, parsed and validated by one loader.
//
// Who reads what:
//   global()   the shim and the logging: parsed once, at the first use in the library, frozen.
//   current()  the net plugin and the CPU NCCL: parsed again only when one of the table's
//              variables changed since the last call (tests change them at run time).
// The shim, the plugin and the CPU NCCL are separate shared libraries, each with its own copy of
// this code and of its statics, so each parses the table itself (the same code, the same
// result). Reports are made once per process, not once per copy: each warning and the INFO
// listing of the effective values are printed by whichever copy reports first
// (log_first_in_process in common/log.h says how the copies agree).
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "common/log.h"
#include "common/status.h"
#include "config/bytes.h"
#include "kernels/codec.h"

namespace dq::config {

enum class Kind { Bool, Int, Bytes, Real, Text };
// Who reads a setting, and what an invalid value does (settings.def): Agreed and Shim: the
// shim turns compression off; Metrics: the metrics file is off; Log, Net, CpuNccl, Tool
// (dynamiq-run, dynamiq-perf): the setting keeps its default.
enum class Scope { Agreed, Shim, Metrics, Log, Net, CpuNccl, Tool };

// Compile-time parsing of the table's default texts, so that the struct below carries them.
// A default that does not parse stops the build (settings.cc static_asserts each one).
namespace table {
template <Kind K>
using Type = std::conditional_t<
    K == Kind::Bool, bool,
    std::conditional_t<K == Kind::Real, double,
                       std::conditional_t<K == Kind::Text, const char*, int64_t>>>;

constexpr bool parse_decimal(std::string_view t, double* out) {  // digits[.digits]
  uint64_t mantissa = 0, scale = 1;
  bool dot = false, digits = false;
  for (char c : t) {
    if (c == '.' && !dot) {
      dot = true;
    } else if (c >= '0' && c <= '9' && mantissa < (uint64_t{1} << 52)) {
      mantissa = mantissa * 10 + static_cast<uint64_t>(c - '0');
      if (dot) scale *= 10;
      digits = true;
    } else {
      return false;
    }
  }
  *out = static_cast<double>(mantissa) / static_cast<double>(scale);  // both exact: one rounding
  return digits;
}

template <Kind K>
constexpr bool parse_default(const char* text, Type<K>* out) {
  const std::string_view t(text);
  if constexpr (K == Kind::Bool) {
    if (t != "0" && t != "1") return false;
    *out = t == "1";
    return true;
  } else if constexpr (K == Kind::Int || K == Kind::Bytes) {
    uint64_t v = 0;
    if (K == Kind::Int ? !parse_bytes(t, &v) || t.back() < '0' || t.back() > '9'
                       : !parse_bytes(t, &v))
      return false;
    *out = static_cast<int64_t>(v);
    return true;
  } else if constexpr (K == Kind::Real) {
    return parse_decimal(t, out);
  } else {
    *out = text;
    return true;
  }
}

template <Kind K>
constexpr Type<K> default_of(const char* text) {
  Type<K> v{};
  parse_default<K>(text, &v);
  return v;
}

template <Kind K>
using Field = std::conditional_t<K == Kind::Text, std::string, Type<K>>;
}  // namespace table

struct Settings {
  // One member per table entry, named by its first column, holding the table's default:
  // Bool: bool, Int and Bytes: int64_t, Real: double, Text: std::string.
#define DQ_SETTING(field, kind, key, fallback, lo, hi, scope, accepted, doc) \
  table::Field<Kind::kind> field = table::default_of<Kind::kind>(fallback);
#include "config/settings.def"
#undef DQ_SETTING

  // Derived by load() from the table's values; these initialisers are what load() derives from
  // the defaults (tests/config checks that Settings{} equals the loaded defaults).
  std::string codec_spec = "dynamiq:5";  // the codec's text, for logs (auto: a bucket's first call)
  uint64_t from_nccl = 0;       // bit i: table entry i took NCCL's variable's value, its own unset
  CodecSpec parsed_codec_spec;  // codec_spec parsed once: what the engine makes codecs of
  double budget_bits = 5.0;     // DYNAMIQ_BITS as a number (auto: the fixed default)
  bool bits_auto = false;       // DYNAMIQ_BITS=auto
  bool allow_f32 = true, allow_bf16 = true;
  bool allow_all_reduce = true, allow_reduce_scatter = true, allow_reduce = true;
  LogLevel log_level = LogLevel::kWarn;
  unsigned log_subsys = kAllSubsys;

  bool operator==(const Settings&) const = default;
};

// Where a value comes from: the environment in production, a map in tests.
using EnvLookup = const char* (*)(const char* key, void* ctx);

// The NCCL variable a setting takes while it is unset itself (NCCL_SOCKET_IFNAME for
// DYNAMIQ_NET_IFNAME, NCCL_IB_TC for DYNAMIQ_NET_IB_TC, ...), or nullptr.
const char* nccl_equivalent(const char* key);

// One invalid value, or an invalid combination. message names the variable, the value, what is
// accepted and what happens instead (compression off, or the default used).
struct Problem {
  Scope scope;
  std::string message;
};

// Parses and validates every setting. An invalid value leaves that setting at its default; if
// any was Agreed or Shim, enable is false (the shim passes everything through). Returns
// kInvalidArgument when anything was invalid, with every message in *problems (if given) and
// joined by newlines in *error.
// `names`, where given, are the variables set (all of them, or those starting DYNAMIQ_): one of
// the DYNAMIQ_ ones that the table does not hold (a misspelling) is a problem that turns
// compression off.
Status load(EnvLookup lookup, void* ctx, Settings* out, std::string* error,
            std::vector<Problem>* problems = nullptr,
            const std::vector<std::string>* names = nullptr);
Status load_from_environment(Settings* out, std::string* error,
                             std::vector<Problem>* problems = nullptr);

// The process-wide settings of the shim and the logging, loaded on first use (per library);
// problems are logged once per process (WARN). global_valid(): no Agreed or Shim problem
// (compression may run).
const Settings& global();
bool global_valid();

// The settings as the environment says now, for the net plugin and the CPU NCCL: parsed again
// only when a variable of the table (or an NCCL variable one falls back on) changed since the
// last call; new problems are logged once per process.
Settings current();

// Whether the environment sets `key` (a table variable), or the NCCL variable it falls back on,
// to a non-empty value now: a default the user did not choose may deserve a word.
bool set_in_environment(const char* key);

// Logs problems, each once per process, and (subsystem ENV) once per process the effective
// values: at DYNAMIQ_DEBUG=INFO those that differ from their defaults, at TRACE every one.
void report(const Settings& s, const std::vector<Problem>& problems);

// One line per setting "KEY=value (default ...)", for DYNAMIQ_DEBUG=INFO.
std::string describe(const Settings& s);

// Settings that every rank must share. hash(i) of agreed setting i; name(i) its env key.
struct Agreed {
  static int count();
  static const char* key(int i);
  static uint32_t hash(const Settings& s, int i);
};

// config/version.h's values: the project's version and the git revision it was built from.
const char* build_version();
const char* build_revision();

// Configures this library copy's log (common/log.h) from global()'s DYNAMIQ_DEBUG* once, then
// reports once per process: the version (INFO, subsystem CORE) and global()'s problems and
// values (report()). The entry points get it through their first global() or current(); the
// log calls it itself at a line logged before that (log_set_configurator).
void configure_log();

// Re-reads DYNAMIQ_DEBUG, DYNAMIQ_DEBUG_SUBSYS and DYNAMIQ_DEBUG_FILE from the environment and
// reconfigures the log (tests change them at run time); the debug file is reopened on the
// next line.
void reload_log_from_env();

}  // namespace dq::config

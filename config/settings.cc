#include "config/settings.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string_view>
#include <vector>

#include <unistd.h>  // environ

#include "common/c_locale.h"
#include "common/fnv1a.h"
#include "config/optin.h"
#include "kernels/budget_model.h"
#include "kernels/codec.h"
#include "kernels/host_isa.h"
#include "version.h"  // generated in the build folder (config/meson.build)

namespace dq::config {
namespace {

struct Entry {
  const char* field;
  Kind kind;
  const char* key;
  const char* fallback;
  double lo, hi;
  Scope scope;
  const char* accepted;
  const char* doc;
};

#define DQ_SETTING(field, kind, key, fallback, lo, hi, scope, accepted, doc) \
  Entry{#field, Kind::kind, key, fallback, lo, hi, Scope::scope, accepted, doc},
constexpr Entry kTable[] = {
#include "config/settings.def"
};
#undef DQ_SETTING
constexpr int kCount = static_cast<int>(sizeof kTable / sizeof kTable[0]);
static_assert(kCount <= 64, "Settings::from_nccl has a bit for each entry");

// Every default of the table parses and lies in its range (else the build stops here).
template <Kind K>
constexpr bool default_ok(const char* text, double lo, double hi) {
  table::Type<K> v{};
  if (!table::parse_default<K>(text, &v)) return false;
  if constexpr (K == Kind::Int || K == Kind::Bytes || K == Kind::Real)
    return static_cast<double>(v) >= lo && static_cast<double>(v) <= hi;
  return true;
}
#define DQ_SETTING(field, kind, key, fallback, lo, hi, scope, accepted, doc) \
  static_assert(default_ok<Kind::kind>(fallback, lo, hi), key ": the default does not parse");
#include "config/settings.def"
#undef DQ_SETTING

constexpr int index_of(std::string_view key) {
  for (int i = 0; i < kCount; ++i)
    if (key == kTable[i].key) return i;
  return -1;
}
constexpr int kTimeout = index_of("DYNAMIQ_TIMEOUT_MS");
constexpr int kNetTimeout = index_of("DYNAMIQ_NET_TIMEOUT_MS");
constexpr int kCpuNcclTimeout = index_of("DYNAMIQ_CPU_NCCL_TIMEOUT_MS");
constexpr int kNetNsocks = index_of("DYNAMIQ_NET_NSOCKS");
static_assert(kTimeout >= 0 && kNetTimeout >= 0 && kCpuNcclTimeout >= 0 && kNetNsocks >= 0);

// NCCL's sockets per connection are NCCL_SOCKET_NTHREADS x NCCL_NSOCKS_PERTHREAD (NCCL accepts
// 1..16 threads and at most 64 sockets in all); the plugin takes their product, up to its own
// bound, while DYNAMIQ_NET_NSOCKS is unset.
constexpr const char* kNcclSocketThreads = "NCCL_SOCKET_NTHREADS";
constexpr const char* kNcclSocketsPerThread = "NCCL_NSOCKS_PERTHREAD";
constexpr int kDebug = index_of("DYNAMIQ_DEBUG");
constexpr int kDebugFile = index_of("DYNAMIQ_DEBUG_FILE");
static_assert(kDebug >= 0 && kDebugFile >= 0);
constexpr const char* kNcclDebugFile = "NCCL_DEBUG_FILE";

// NCCL_DEBUG's levels that ask for more than dynamiq's default: INFO, and TRACE (NCCL's ABORT,
// between them, adds an abort on NCCL's own warnings, not asked of dynamiq: INFO). VERSION, WARN,
// NONE and words NCCL does not know (NCCL ignores those) leave dynamiq's default, so the one
// message that says why compression is off is never hidden by a setting made for NCCL.
const char* debug_level_from_nccl(std::string_view nccl_value) {
  const std::string v = lower_ascii(nccl_value);
  if (v == "info" || v == "abort") return "INFO";
  if (v == "trace") return "TRACE";
  return nullptr;
}

// Settings that take NCCL's variable of the same meaning while they are unset themselves: the
// net plugin replaces NCCL's own socket and IB transports, and a job's NCCL_* settings for those
// (its interfaces, HCAs, RoCE GID and traffic class) must still hold; a job run with
// NCCL_DEBUG=INFO to find a fault expects dynamiq's lines too. NCCL's value is checked as the
// setting's own would be, after `translate` where NCCL's words differ (nullptr from it: NCCL's
// value does not apply, as if unset).
struct NcclEquivalent {
  const char* key;
  const char* nccl;
  const char* (*translate)(std::string_view nccl_value) = nullptr;
};
constexpr NcclEquivalent kNcclEquivalents[] = {
    {"DYNAMIQ_DEBUG", "NCCL_DEBUG", &debug_level_from_nccl},
    {"DYNAMIQ_NET_IFNAME", "NCCL_SOCKET_IFNAME"},
    {"DYNAMIQ_NET_IB_DISABLE", "NCCL_IB_DISABLE"},
    {"DYNAMIQ_NET_IB_HCA", "NCCL_IB_HCA"},
    {"DYNAMIQ_NET_IB_GID_INDEX", "NCCL_IB_GID_INDEX"},
    {"DYNAMIQ_NET_IB_TC", "NCCL_IB_TC"},
    {"DYNAMIQ_NET_IB_SL", "NCCL_IB_SL"},
    {"DYNAMIQ_NET_IB_TIMEOUT", "NCCL_IB_TIMEOUT"},
    {"DYNAMIQ_NET_IB_RETRY_CNT", "NCCL_IB_RETRY_CNT"},
    {"DYNAMIQ_NET_IB_QPS", "NCCL_IB_QPS_PER_CONNECTION"},
    {"DYNAMIQ_NET_IB_PCI_RELAXED_ORDERING", "NCCL_IB_PCI_RELAXED_ORDERING"},
};
constexpr bool equivalents_named() {
  for (const NcclEquivalent& q : kNcclEquivalents)
    if (index_of(q.key) < 0) return false;
  return true;
}
static_assert(equivalents_named(), "every NCCL equivalent names a setting of the table");

const NcclEquivalent* equivalent_of(const char* key) {
  for (const NcclEquivalent& q : kNcclEquivalents)
    if (std::strcmp(q.key, key) == 0) return &q;
  return nullptr;
}

// The value `key` takes from its NCCL equivalent (translated), with *source set to the NCCL
// variable; nullptr where there is none, it is unset or empty, or its value does not apply.
const char* nccl_value(const char* key, EnvLookup lookup, void* ctx, const char** source) {
  const NcclEquivalent* q = equivalent_of(key);
  if (q == nullptr) return nullptr;
  const char* raw = lookup(q->nccl, ctx);
  if (raw == nullptr || *raw == '\0') return nullptr;
  if (q->translate != nullptr) raw = q->translate(raw);
  if (raw == nullptr) return nullptr;
  *source = q->nccl;
  return raw;
}

// What an entry takes from NCCL while it is unset itself, for the settings' INFO lines ("" for
// an entry that takes nothing).
const char* nccl_source_name(int i) {
  if (i == kNetNsocks) return "NCCL_SOCKET_NTHREADS x NCCL_NSOCKS_PERTHREAD";
  if (i == kDebugFile) return "NCCL_DEBUG_FILE + .dynamiq";
  const NcclEquivalent* q = equivalent_of(kTable[i].key);
  return q != nullptr ? q->nccl : "";
}

bool parse_bool(std::string_view v, bool* out) {
  const std::string s = lower_ascii(v);
  if (s == "1" || s == "true" || s == "on" || s == "yes") return *out = true, true;
  if (s == "0" || s == "false" || s == "off" || s == "no") return *out = false, true;
  return false;
}

// Int: decimal or 0x hex, no sign. A leading 0 is decimal (strtoull's base 0 would read "0123"
// as octal 83 and refuse "08").
bool parse_int(const std::string& s, double* out) {
  if (s.empty() || s[0] == '-' || s[0] == '+' || std::isspace(static_cast<unsigned char>(s[0])))
    return false;
  const bool hex = s.size() > 2 && s[0] == '0' && (s[1] == 'x' || s[1] == 'X');
  errno = 0;
  char* end = nullptr;
  const unsigned long long x = std::strtoull(s.c_str(), &end, hex ? 16 : 10);
  if (errno != 0 || end == s.c_str() || *end != '\0') return false;
  *out = static_cast<double>(x);
  return true;
}

// An integer as NCCL reads its own variables (ncclLoadParam: strtoll, base 0, refused only where
// it sets errno): a leading 0 is octal ("0140" is 96), 0x hex, leading blanks and a sign are
// taken, and the number ends at the first character that cannot continue it ("08" is 0, "96 " is
// 96, a text without digits 0). What NCCL_IB_TC=0140 means to NCCL's own transport, it means to
// the plugin; the entry's range is checked after.
bool parse_int_as_nccl(const std::string& s, double* out) {
  errno = 0;
  const long long x = std::strtoll(s.c_str(), nullptr, 0);
  if (errno != 0) return false;
  *out = static_cast<double>(x);
  return true;
}

bool parse_real(const std::string& s, double* out) {
  if (s.empty()) return false;
  char* end = nullptr;
  errno = 0;
  const double x = strtod_c(s.c_str(), &end);
  if (errno != 0 || *end != '\0' || !std::isfinite(x)) return false;
  *out = x;
  return true;
}

bool valid_codec(const std::string& v) {
  static const char* kNames[] = {"dynamiq",   "uniform",   "mxfp8", "mxfp6",
                                 "mxfp6e3m2", "mxfp6e2m3", "mxfp4", "bf16"};
  for (const char* n : kNames)
    if (v == n) return true;
  return false;
}

// Hands each comma-separated term of `v` (lowercased; empty terms skipped) to `take`, which
// returns false for a term it does not know: then false. Every term is read, however many
// (bounded by v's length: each term ends at a later comma or at the end).
template <class Take>
bool for_each_term(const std::string& v, Take take) {
  for (size_t pos = 0;;) {
    const size_t comma = v.find(',', pos);
    const std::string t =
        lower_ascii(v.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos));
    if (!t.empty() && !take(t)) return false;
    if (comma == std::string::npos) return true;
    pos = comma + 1;
  }
}

bool parse_dtypes(const std::string& v, Settings* s) {
  s->allow_f32 = s->allow_bf16 = false;
  return for_each_term(v, [s](const std::string& t) {
    if (t == "float32" || t == "float" || t == "fp32") return s->allow_f32 = true;
    if (t == "bfloat16" || t == "bf16") return s->allow_bf16 = true;
    return false;
  });
}

// The canonical texts of the parsed lists, what the agreement hashes: "bf16,fp32" and
// "float32,bfloat16" select the same calls, so they must agree.
std::string dtypes_text(const Settings& s) {
  std::string t = s.allow_f32 ? "float32" : "";
  if (s.allow_bf16) t += t.empty() ? "bfloat16" : ",bfloat16";
  return t;
}
std::string collectives_text(const Settings& s) {
  std::string t;
  for (const auto& [on, name] :
       {std::pair{s.allow_all_reduce, "allreduce"},
        std::pair{s.allow_reduce_scatter, "reducescatter"}, std::pair{s.allow_reduce, "reduce"}})
    if (on) t += (t.empty() ? "" : ",") + std::string(name);
  return t;
}

bool parse_collectives(const std::string& v, Settings* s) {
  s->allow_all_reduce = s->allow_reduce_scatter = s->allow_reduce = false;
  return for_each_term(v, [s](const std::string& t) {
    if (t == "allreduce") return s->allow_all_reduce = true;
    if (t == "reducescatter") return s->allow_reduce_scatter = true;
    if (t == "reduce") return s->allow_reduce = true;
    return false;
  });
}

struct Value {
  bool flag = false;
  double number = 0;
  std::string text;
};

void store(bool* f, const Value& v) {
  *f = v.flag;
}
void store(int64_t* f, const Value& v) {
  *f = static_cast<int64_t>(v.number);
}
void store(double* f, const Value& v) {
  *f = v.number;
}
void store(std::string* f, const Value& v) {
  *f = v.text;
}
std::string text_of(bool f) {
  return f ? "1" : "0";
}
std::string text_of(int64_t f) {
  return std::to_string(f);
}
std::string text_of(double f) {
  return number_text(f, 17);
}
std::string text_of(const std::string& f) {
  return f;
}

// Settings{} holds the table's defaults (settings.h); a function-local static, so that it
// exists before any use, however early.
const Settings& defaults() {
  static const Settings& d = *new Settings;
  return d;
}

// Per entry, in table order: store a parsed value; print the canonical text of the stored one;
// put back the default.
using Store = void (*)(Settings*, const Value&);
using Show = std::string (*)(const Settings&);
using Reset = void (*)(Settings*);
#define DQ_SETTING(field, kind, key, fallback, lo, hi, scope, accepted, doc) \
  [](Settings* s, const Value& v) { store(&s->field, v); },
constexpr Store kStore[] = {
#include "config/settings.def"
};
#undef DQ_SETTING
#define DQ_SETTING(field, kind, key, fallback, lo, hi, scope, accepted, doc) \
  [](const Settings& s) { return text_of(s.field); },
constexpr Show kShow[] = {
#include "config/settings.def"
};
#undef DQ_SETTING
#define DQ_SETTING(field, kind, key, fallback, lo, hi, scope, accepted, doc) \
  [](Settings* s) { s->field = defaults().field; },
constexpr Reset kReset[] = {
#include "config/settings.def"
};
#undef DQ_SETTING

// Text entries checked on their own (the others are checked with their neighbours in finish()).
bool valid_text(const Entry& e, const std::string& raw) {
  const std::string_view key = e.key;
  if (key == "DYNAMIQ_DEBUG") {
    LogLevel level;
    return log_parse_level(raw, &level);
  }
  if (key == "DYNAMIQ_DEBUG_SUBSYS") {
    unsigned mask;
    return log_parse_subsys(raw, &mask);
  }
  if (key == "DYNAMIQ_BITS") {
    // A budget in bits per value, or auto (canonicalised in finish()).
    double bits = 0;
    return lower_ascii(raw) == "auto" || (parse_real(raw, &bits) && bits >= 3 && bits <= 16);
  }
  if (key == "DYNAMIQ_TARGET") {
    BudgetTarget target;
    return parse_budget_target(raw, &target);
  }
  if (key == "DYNAMIQ_HOST_ISA")
    return raw == "auto" || raw == "scalar" || raw == "avx2" || raw == "avx512";
  if (key == "DYNAMIQ_NET_BACKEND") return raw == "socket" || raw == "ib" || raw == "auto";
  if (key == "DYNAMIQ_NET_IB_GDR") return raw == "auto" || raw == "off" || raw == "flush-all";
  if (key == "DYNAMIQ_NET_IB_GID_INDEX") {
    // -1 (auto) or a GID table index 0..255, decimal.
    if (raw == "-1") return true;
    if (raw.empty() || raw.size() > 3) return false;
    for (char c : raw) {
      if (c < '0' || c > '9') return false;
    }
    return std::stoi(raw) <= 255;
  }
  return true;
}

// Parses one raw value for entry e; false if it is not acceptable.
// `nccl_syntax`: raw is an NCCL variable's value (an integer as NCCL reads it).
bool parse(const Entry& e, const std::string& raw, Value* v, bool nccl_syntax) {
  switch (e.kind) {
    case Kind::Bool:
      if (nccl_syntax) {  // NCCL_IB_DISABLE: one of NCCL's integers, any but 0 true ("2", "01")
        double x = 0;
        if (!parse_int_as_nccl(raw, &x)) return false;
        v->flag = x != 0;
        return true;
      }
      return parse_bool(raw, &v->flag);
    case Kind::Int:
      if (!(nccl_syntax ? parse_int_as_nccl(raw, &v->number) : parse_int(raw, &v->number)))
        return false;
      return v->number >= e.lo && v->number <= e.hi;
    case Kind::Bytes: {
      uint64_t bytes = 0;
      if (!parse_bytes(raw, &bytes)) return false;
      v->number = static_cast<double>(bytes);
      return v->number >= e.lo && v->number <= e.hi;
    }
    case Kind::Real:
      if (!parse_real(raw, &v->number)) return false;
      return v->number >= e.lo && v->number <= e.hi;
    case Kind::Text:
      v->text = raw;
      if (nccl_syntax && std::string_view(e.key) == "DYNAMIQ_NET_IB_GID_INDEX") {
        // NCCL_IB_GID_INDEX is one of NCCL's integers: "010" is index 8 to NCCL's transport.
        double index = 0;
        if (!parse_int_as_nccl(raw, &index)) return false;
        v->text = std::to_string(static_cast<long long>(index));
      }
      return valid_text(e, v->text);
  }
  return false;
}

// What an invalid value of this entry does, appended to its message.
std::string consequence(const Entry& e) {
  const std::string fallback = *e.fallback ? e.fallback : "(empty)";
  switch (e.scope) {
    case Scope::Agreed:
    case Scope::Shim:
      return "; compression is OFF: every call passes through to NCCL";
    case Scope::Metrics:
      return "; the metrics file is off (compression is not affected)";
    case Scope::Log:
      return "; the log uses the default " + fallback;
    case Scope::Net:
      return "; the net plugin uses the default " + fallback;
    case Scope::CpuNccl:
      return "; the CPU NCCL uses the default " + fallback;
    case Scope::Tool:
      return "; the tool uses the default " + fallback;
  }
  return "";
}

// Edits (insert, delete, replace a character) from a to b: how close a misspelled name is.
size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t above = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] != b[j - 1] ? 1 : 0)});
      diagonal = above;
    }
  }
  return row[b.size()];
}

// DYNAMIQ_ variables of the project's own scripts, never read by the libraries: the setup's
// virtual environment, the benchmarks' plugin path and real NCCL, CI's and the test guests'
// switches (DYNAMIQ_VM marks a command run inside a test guest). Named without the prefix, as the
// rest of the name.
constexpr std::string_view kPrefix = "DYNAMIQ_";
constexpr std::string_view kScriptNames[] = {"VENV", "NET_PLUGIN_PATH", "REAL_NCCL", "VM"};
constexpr std::string_view kScriptPrefixes[] = {"CI_", "VM_", "PERFTEST_"};

bool names_a_script_variable(std::string_view rest) {
  for (std::string_view n : kScriptNames)
    if (rest == n) return true;
  for (std::string_view p : kScriptPrefixes)
    if (rest.substr(0, p.size()) == p) return true;
  return false;
}

// The table's name nearest to `name` when it is close enough to be a misspelling of it
// (DYNAMIQ_CODECS, DYNAMIQ_ENABLED, DYNAMIQ_TIMEOUT), else empty.
std::string nearest_setting(std::string_view name) {
  std::string_view best;
  size_t best_distance = 4;  // at most 3 edits
  for (const Entry& e : kTable) {
    const size_t d = edit_distance(name, e.key);
    if (d < best_distance) best_distance = d, best = e.key;
  }
  return std::string(best);
}

class Loader {
 public:
  Loader(EnvLookup lookup, void* ctx, const std::vector<std::string>* names)
      : lookup_(lookup), ctx_(ctx), names_(names) {}

  void run(Settings* s) {
    *s = defaults();
    for (int i = 0; i < kCount; ++i) {
      const Entry& e = kTable[i];
      const char* source = e.key;
      const char* raw = lookup_(source, ctx_);
      if (raw == nullptr || *raw == '\0') {
        raw = nccl_value(e.key, lookup_, ctx_, &source);
        if (raw == nullptr) continue;
      }
      Value v;
      if (!parse(e, raw, &v, source != e.key)) {
        fail_invalid(i, source, raw, e.accepted);
        continue;
      }
      kStore[i](s, v);
      set_[i] = true;
      if (source != e.key) s->from_nccl |= uint64_t{1} << i;
    }
    finish(s);
    check_names();
    for (const Problem& p : problems_) {
      if (p.scope == Scope::Agreed || p.scope == Scope::Shim) s->enable = false;
      if (p.scope == Scope::Metrics) s->metrics_file.clear();
    }
  }

  std::vector<Problem>& problems() { return problems_; }

 private:
  void fail(int i, const std::string& what) {
    problems_.push_back({kTable[i].scope, what + consequence(kTable[i])});
    failed_[i] = true;
  }

  // A DYNAMIQ_ variable the table does not hold is a setting the user believes is in force (a
  // misspelling, or a name of another release): compression is turned off and the name said,
  // rather than the job run as if the variable were not set.
  void check_names() {
    if (names_ == nullptr) return;
    for (const std::string& name : *names_) {
      const std::string_view n = name;
      if (n.substr(0, kPrefix.size()) != kPrefix || index_of(n) >= 0 ||
          names_a_script_variable(n.substr(kPrefix.size())))
        continue;
      const std::string near = nearest_setting(n);
      problems_.push_back(
          {Scope::Shim, name + " is set but is not a dynamiq setting" +
                            (near.empty() ? std::string(" (the README's Settings table lists them)")
                                          : " (did you mean " + near + "?)") +
                            "; compression is OFF: every call passes through to NCCL"});
    }
  }

  // `source`=`raw` does not parse for entry i; `source` is the entry's own variable or an NCCL
  // variable it was read from.
  void fail_invalid(int i, const char* source, const char* raw, const std::string& accepted) {
    const std::string read_for =
        std::strcmp(source, kTable[i].key) == 0
            ? ""
            : std::string(" (read for ") + kTable[i].key + ", which is unset)";
    fail(i, std::string(source) + "=" + raw + read_for + " is not valid; accepted: " + accepted);
  }

  // Cross-field checks, derived values and fallbacks; an invalid value goes back to its default.
  void finish(Settings* s) {
    const int codec = index_of("DYNAMIQ_CODEC"), bits = index_of("DYNAMIQ_BITS");
    std::string why;
    // DYNAMIQ_BITS (checked by valid_text): its canonical text, "auto" or the shortest decimal,
    // is what the agreement hashes, so 5 and 5.0 agree. auto starts every bucket at the
    // table's fixed default.
    if (lower_ascii(s->bits) == "auto") {
      s->bits = "auto";
      s->bits_auto = true;
      s->budget_bits = defaults().budget_bits;
    } else {
      parse_real(s->bits, &s->budget_bits);
      s->bits = number_text(s->budget_bits, 17);
    }
    BudgetTarget parsed_target;
    parse_budget_target(s->target, &parsed_target);  // validated by valid_text()
    s->target = budget_target_name(parsed_target);
    const std::string codec_text = s->codec;
    s->codec = lower_ascii(s->codec);
    if (!valid_codec(s->codec)) {
      fail(codec, "DYNAMIQ_CODEC=" + codec_text +
                      " is not a codec; accepted: dynamiq, uniform, mxfp8, mxfp6, mxfp6e2m3, "
                      "mxfp4, bf16");
      kReset[codec](s);
    }
    derive_codec_spec(s);
    // Made to be validated and dropped, so on the scalar path: making it on auto's would choose
    // the process's host path here, and a vector path failing its start-up check logs, and the
    // log's first use reads these settings, inside this parse (a deadlock on its call_once).
    const bool codec_valid = [&] {
      const ThreadHostIsa validate_on_scalar(HostIsa::kScalar);
      return make_codec(s->codec_spec, &why) != nullptr;
    }();
    if (!codec_valid) {
      fail(codec, "DYNAMIQ_CODEC=" + s->codec + " with DYNAMIQ_BITS=" + s->bits +
                      " is not a valid codec: " + why);
      kReset[codec](s);
      reset_bits(s);
      derive_codec_spec(s);
    }
    if (s->bits_auto && s->codec != "dynamiq") {
      fail(bits, "DYNAMIQ_BITS=auto is for DYNAMIQ_CODEC=dynamiq only (DYNAMIQ_CODEC=" + s->codec +
                     ": a fixed format has no budget to choose)");
      reset_bits(s);
      derive_codec_spec(s);
    }
    // The target steers only auto's choice of budget: with a fixed budget it would be ignored
    // while the user believes the error is held to it. Not where DYNAMIQ_BITS or the codec was
    // refused already (auto with a fixed format, an invalid budget): that message says it, and
    // the budget here is a reset, not the user's.
    if (const int target = index_of("DYNAMIQ_TARGET");
        set_[target] && !s->bits_auto && !failed_[bits] && !failed_[codec]) {
      fail(target, "DYNAMIQ_TARGET=" + s->target + " is used only with DYNAMIQ_BITS=auto (here " +
                       "DYNAMIQ_BITS=" + s->bits + ", a fixed budget)");
      kReset[target](s);
    }
    const int topo = index_of("DYNAMIQ_TOPO");
    const std::string topo_text = s->topology;
    s->topology = lower_ascii(s->topology);
    if (s->topology != "ring" && s->topology != "butterfly" && s->topology != "auto") {
      fail(topo,
           "DYNAMIQ_TOPO=" + topo_text + " is not a topology; accepted: ring, butterfly, auto");
      kReset[topo](s);
    }
    const int hierarchy = index_of("DYNAMIQ_HIERARCHY");
    const std::string hierarchy_text = s->hierarchy;
    s->hierarchy = lower_ascii(s->hierarchy);
    if (s->hierarchy != "auto" && s->hierarchy != "flat" && s->hierarchy != "node") {
      fail(hierarchy, "DYNAMIQ_HIERARCHY=" + hierarchy_text +
                          " is not a hierarchy; accepted: auto, flat, node");
      kReset[hierarchy](s);
    }
    if (!parse_dtypes(s->dtypes, s)) {
      fail(index_of("DYNAMIQ_DTYPES"),
           "DYNAMIQ_DTYPES=" + s->dtypes +
               " is not a comma list of float32, bfloat16 (aliases: float, fp32, bf16)");
      kReset[index_of("DYNAMIQ_DTYPES")](s);
      parse_dtypes(s->dtypes, s);
    }
    s->dtypes = dtypes_text(*s);
    if (!parse_collectives(s->collectives, s)) {
      fail(index_of("DYNAMIQ_COLLECTIVES"),
           "DYNAMIQ_COLLECTIVES=" + s->collectives +
               " is not a comma list of allreduce, reducescatter, reduce");
      kReset[index_of("DYNAMIQ_COLLECTIVES")](s);
      parse_collectives(s->collectives, s);
    }
    s->collectives = collectives_text(*s);
    OptInRules rules;
    if (parse_opt_in(s->comms, &rules, &why) != Status::kOk) {
      fail(index_of("DYNAMIQ_COMMS"),
           "DYNAMIQ_COMMS=" + s->comms + ": " + why +
               "; accepted: comma list of all, none, name=GLOB, size=N, index=N, color=N");
      kReset[index_of("DYNAMIQ_COMMS")](s);
    }
    // The log's level and subsystems (both validated by parse()).
    log_parse_level(s->debug, &s->log_level);
    log_parse_subsys(s->debug_subsys, &s->log_subsys);
    // DYNAMIQ_TIMEOUT_MS, when set, bounds the plugin's and the CPU NCCL's waits too, unless
    // their own variables are set.
    if (set_[kTimeout] && !set_[kNetTimeout]) s->net_timeout_ms = s->timeout_ms;
    if (set_[kTimeout] && !set_[kCpuNcclTimeout]) s->cpu_nccl_timeout_ms = s->timeout_ms;
    if (!set_[kNetNsocks]) nsocks_from_nccl(s);
    // Where NCCL_DEBUG raised the level and NCCL_DEBUG_FILE sends NCCL's log to a file, dynamiq's
    // lines go beside it (the same name and ".dynamiq") instead of onto the job's terminal. Not
    // into NCCL's file: NCCL truncates it when it opens it, whoever wrote first.
    if ((s->from_nccl >> kDebug & 1) != 0 && !set_[kDebugFile]) {
      const char* nccl_file = lookup_(kNcclDebugFile, ctx_);
      if (nccl_file != nullptr && *nccl_file != '\0') {
        s->debug_file = std::string(nccl_file) + ".dynamiq";
        s->from_nccl |= uint64_t{1} << kDebugFile;
      }
    }
  }

  // DYNAMIQ_NET_NSOCKS from NCCL's two socket variables (an unset one counts 1, as NCCL's
  // default outside the clouds it detects). The plugin gives each socket an I/O thread of its
  // own, so more than its bound of 8 buys nothing on one connection: the product is capped there.
  void nsocks_from_nccl(Settings* s) {
    // The variable's value; 0 where it is unset, -1 where it is invalid (reported).
    const auto read = [&](const char* name, double hi) {
      const char* raw = lookup_(name, ctx_);
      if (raw == nullptr || *raw == '\0') return 0.0;
      double v = 0;
      if (parse_int_as_nccl(raw, &v) && v >= 1 && v <= hi) return v;
      fail_invalid(kNetNsocks, name, raw, "1.." + number_text(hi, 17));
      return -1.0;
    };
    const double threads = read(kNcclSocketThreads, 16);
    const double per_thread = read(kNcclSocketsPerThread, 64);
    if (threads < 0 || per_thread < 0) return;  // reported: the default stays
    if (threads == 0 && per_thread == 0) return;
    s->net_nsocks = static_cast<int>(
        std::min(std::max(threads, 1.0) * std::max(per_thread, 1.0), kTable[kNetNsocks].hi));
    s->from_nccl |= uint64_t{1} << kNetNsocks;
  }

  static void reset_bits(Settings* s) {
    kReset[index_of("DYNAMIQ_BITS")](s);
    s->bits_auto = defaults().bits_auto;
    s->budget_bits = defaults().budget_bits;
  }

  static void derive_codec_spec(Settings* s) {
    if (s->codec == "dynamiq" || s->codec == "uniform") {
      s->codec_spec = s->codec + ":" + number_text(s->budget_bits, 17);
      if (s->codec == "dynamiq" && !s->correlated) s->codec_spec += ":corr=0";
    } else {
      s->codec_spec = s->codec;
    }
    std::string invalid;  // reported by finish(), which resets the codec
    if (!parse_codec_spec(s->codec_spec, &s->parsed_codec_spec, &invalid))
      s->parsed_codec_spec = CodecSpec{};
  }

  EnvLookup lookup_;
  void* ctx_;
  const std::vector<std::string>* names_;  // every variable set, where known
  bool set_[kCount] = {};
  bool failed_[kCount] = {};  // a problem was reported for the entry
  std::vector<Problem> problems_;
};

const char* from_environment(const char* key, void*) {
  return std::getenv(key);
}

}  // namespace

Status load(EnvLookup lookup, void* ctx, Settings* out, std::string* error,
            std::vector<Problem>* problems, const std::vector<std::string>* names) {
  Loader loader(lookup, ctx, names);
  loader.run(out);
  if (error != nullptr) {
    error->clear();
    for (const Problem& p : loader.problems()) {
      if (!error->empty()) *error += '\n';
      *error += p.message;
    }
  }
  const bool ok = loader.problems().empty();
  if (problems != nullptr) *problems = std::move(loader.problems());
  return ok ? Status::kOk : Status::kInvalidArgument;
}

Status load_from_environment(Settings* out, std::string* error, std::vector<Problem>* problems) {
  std::vector<std::string> names;
  for (char** v = environ; v != nullptr && *v != nullptr; ++v) {
    const char* eq = std::strchr(*v, '=');
    if (std::strncmp(*v, kPrefix.data(), kPrefix.size()) == 0)
      names.emplace_back(*v, eq != nullptr ? static_cast<size_t>(eq - *v) : std::strlen(*v));
  }
  return load(from_environment, nullptr, out, error, problems, &names);
}

namespace {
// Built at the first use, however early, and never destroyed: destructors of other statics
// (metrics written at exit) may still read the settings.
struct GlobalState {
  Settings settings;
  std::vector<Problem> problems;
  bool valid = false;
  std::once_flag once;
};
GlobalState& parse_global() {
  static GlobalState& g = *new GlobalState;
  std::call_once(g.once, [] {
    load_from_environment(&g.settings, nullptr, &g.problems);
    g.valid = true;
    for (const Problem& p : g.problems)
      if (p.scope == Scope::Agreed || p.scope == Scope::Shim) g.valid = false;
  });
  return g;
}

LogConfig log_config_of(const Settings& s) {
  LogConfig config;
  config.level = s.log_level;
  config.subsys_mask = s.log_subsys;
  config.file_pattern = s.debug_file;
  return config;
}

// Installed when this library copy is loaded: a line logged before any entry point configured
// the log configures it from the settings first, as configure_log() does.
const bool kLogConfiguratorInstalled = (log_set_configurator(&configure_log), true);
}  // namespace

bool set_in_environment(const char* key) {
  const char* own = from_environment(key, nullptr);
  if (own != nullptr && *own != '\0') return true;
  const char* source = nullptr;
  return nccl_value(key, from_environment, nullptr, &source) != nullptr;
}

const char* nccl_equivalent(const char* key) {
  const NcclEquivalent* q = equivalent_of(key);
  return q != nullptr ? q->nccl : nullptr;
}

const char* build_version() {
  return DYNAMIQ_VERSION;
}

const char* build_revision() {
  return DYNAMIQ_GIT_REVISION;
}

void configure_log() {
  static std::mutex mutex;
  static bool configured = false;
  const GlobalState& g = parse_global();
  {
    std::lock_guard<std::mutex> lock(mutex);
    if (configured) return;
    log_configure(log_config_of(g.settings));
    configured = true;
  }
  log_version_once(DYNAMIQ_VERSION, DYNAMIQ_GIT_REVISION);
  report(g.settings, g.problems);
}

void reload_log_from_env() {
  configure_log();
  Settings s;
  std::string error;
  load_from_environment(&s, &error);
  log_configure(log_config_of(s));
}

const Settings& global() {
  const GlobalState& g = parse_global();
  configure_log();  // the first use configures the log from these settings and reports them
  return g.settings;
}

bool global_valid() {
  global();
  return parse_global().valid;
}

Settings current() {
  static std::mutex mutex;
  static bool loaded = false;
  static std::string& seen = *new std::string;  // the raw values `cached` was parsed from
  static Settings& cached = *new Settings;
  std::string now;
  const auto add = [&now](const char* key) {
    const char* v = std::getenv(key);
    now += v != nullptr ? '=' : '-';
    now += v != nullptr ? v : "";
    now += '\0';
  };
  for (const Entry& e : kTable) add(e.key);
  for (const NcclEquivalent& q : kNcclEquivalents) add(q.nccl);
  add(kNcclSocketThreads);
  add(kNcclSocketsPerThread);
  add(kNcclDebugFile);
  std::vector<Problem> problems;
  Settings out;
  {
    std::lock_guard<std::mutex> lock(mutex);
    if (loaded && now == seen) return cached;
    load_from_environment(&cached, nullptr, &problems);
    seen = std::move(now);
    loaded = true;
    out = cached;
  }
  configure_log();
  report(out, problems);
  return out;
}

void report(const Settings& s, const std::vector<Problem>& problems) {
  for (const Problem& p : problems)
    if (log_first_in_process("warn:" + p.message)) DQ_WARN(Subsys::kEnv, "%s", p.message.c_str());
  if (!log_enabled(LogLevel::kInfo, Subsys::kEnv) || !log_first_in_process("settings")) return;
  // At INFO the settings that differ from their defaults (what this job changed); every one at
  // TRACE. One line per setting: log lines have a bounded length.
  const bool all = log_enabled(LogLevel::kTrace, Subsys::kEnv);
  int shown = 0;
  for (int i = 0; i < kCount; ++i) {
    const std::string value = kShow[i](s);
    if (all) {
      DQ_TRACE(Subsys::kEnv, "dynamiq setting %s=%s  (default %s)  %s", kTable[i].key,
               value.c_str(), *kTable[i].fallback ? kTable[i].fallback : "\"\"", kTable[i].doc);
    } else if (value != kShow[i](defaults())) {
      DQ_INFO(Subsys::kEnv, "dynamiq setting %s=%s  (default %s)%s%s", kTable[i].key, value.c_str(),
              *kTable[i].fallback ? kTable[i].fallback : "\"\"",
              (s.from_nccl >> i & 1) != 0 ? "  from " : "",
              (s.from_nccl >> i & 1) != 0 ? nccl_source_name(i) : "");
      ++shown;
    }
  }
  if (!all)
    DQ_INFO(Subsys::kEnv,
            "dynamiq settings: %d of %d differ from their defaults (listed above); "
            "DYNAMIQ_DEBUG=TRACE lists every one",
            shown, kCount);
}

std::string describe(const Settings& s) {
  std::string out;
  for (int i = 0; i < kCount; ++i) {
    out += "  ";
    out += kTable[i].key;
    out += '=';
    out += kShow[i](s);
    out += "  (default ";
    out += *kTable[i].fallback ? kTable[i].fallback : "\"\"";
    out += ")  ";
    out += kTable[i].doc;
    out += '\n';
  }
  return out;
}

int Agreed::count() {
  int n = 0;
  for (const Entry& e : kTable) n += e.scope == Scope::Agreed;
  return n;
}

namespace {
int agreed_index(int i) {
  for (int k = 0; k < kCount; ++k)
    if (kTable[k].scope == Scope::Agreed && i-- == 0) return k;
  return -1;
}
}  // namespace

const char* Agreed::key(int i) {
  const int k = agreed_index(i);
  return k < 0 ? "?" : kTable[k].key;
}

uint32_t Agreed::hash(const Settings& s, int i) {
  const int k = agreed_index(i);
  if (k < 0) return 0;
  return fnv1a32(kShow[k](s));  // over the canonical value text
}

}  // namespace dq::config

#include "config/settings.h"

#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string_view>

#include "config/bytes.h"
#include "config/optin.h"
#include "kernels/codec.h"

namespace dq::config {
namespace {

enum class Kind { Bool, Int, Bytes, Real, Text };

struct Entry {
  const char* field;
  Kind kind;
  const char* key;
  const char* fallback;
  double lo, hi;
  bool agreed;
  const char* accepted;
  const char* doc;
};

#define DQ_SETTING(field, kind, key, fallback, lo, hi, agreed, accepted, doc) \
  Entry{#field, Kind::kind, key, fallback, lo, hi, agreed != 0, accepted, doc},
constexpr Entry kTable[] = {
#include "config/settings.def"
};
#undef DQ_SETTING
constexpr int kCount = static_cast<int>(sizeof kTable / sizeof kTable[0]);

std::string lower(std::string_view v) {
  std::string s(v);
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

bool parse_bool(std::string_view v, bool* out) {
  const std::string s = lower(v);
  if (s == "1" || s == "true" || s == "on" || s == "yes") return *out = true, true;
  if (s == "0" || s == "false" || s == "off" || s == "no") return *out = false, true;
  return false;
}

// Int: decimal or 0x hex, no sign. Bytes: config/bytes.h (8, 64K, 1MB, 1MiB, ...).
bool parse_int(std::string_view v, bool bytes, double* out) {
  std::string s(v);
  if (bytes) {
    uint64_t x = 0;
    if (!parse_bytes(s, &x)) return false;
    *out = static_cast<double>(x);
    return true;
  }
  if (s.empty() || s[0] == '-' || s[0] == '+' || std::isspace(static_cast<unsigned char>(s[0])))
    return false;
  errno = 0;
  char* end = nullptr;
  unsigned long long x = std::strtoull(s.c_str(), &end, 0);
  if (errno != 0 || end == s.c_str() || *end != '\0') return false;
  *out = static_cast<double>(x);
  return true;
}

bool parse_real(std::string_view v, double* out) {
  std::string s(v);
  if (s.empty()) return false;
  char* end = nullptr;
  errno = 0;
  double x = std::strtod(s.c_str(), &end);
  if (errno != 0 || *end != '\0' || !std::isfinite(x)) return false;
  *out = x;
  return true;
}

// Text validators; on failure return false (the caller reports key, value and accepted values).
bool valid_codec(const std::string& v) {
  static const char* kNames[] = {"dynamiq",   "uniform",   "mxfp8", "mxfp6",
                                 "mxfp6e3m2", "mxfp6e2m3", "mxfp4", "bf16"};
  for (const char* n : kNames)
    if (v == n) return true;
  return false;
}

bool parse_dtypes(const std::string& v, Settings* s) {
  s->allow_f32 = s->allow_bf16 = false;
  size_t pos = 0;
  int terms = 0;
  while (pos <= v.size() && terms < 16) {
    size_t comma = v.find(',', pos);
    std::string t =
        lower(v.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos));
    if (t == "float32" || t == "float" || t == "fp32") {
      s->allow_f32 = true;
    } else if (t == "bfloat16" || t == "bf16") {
      s->allow_bf16 = true;
    } else if (!t.empty()) {
      return false;
    }
    ++terms;
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  return true;
}

bool parse_collectives(const std::string& v, Settings* s) {
  s->allow_all_reduce = s->allow_reduce_scatter = s->allow_reduce = false;
  size_t pos = 0;
  for (int terms = 0; pos <= v.size() && terms < 16; ++terms) {
    const size_t comma = v.find(',', pos);
    const std::string t =
        lower(v.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos));
    if (t == "allreduce") {
      s->allow_all_reduce = true;
    } else if (t == "reducescatter") {
      s->allow_reduce_scatter = true;
    } else if (t == "reduce") {
      s->allow_reduce = true;
    } else if (!t.empty()) {
      return false;
    }
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  return true;
}

std::string format_real(double x) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.17g", x);
  return buf;
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
  return format_real(f);
}
std::string text_of(const std::string& f) {
  return f;
}

// Per entry, in table order: store a parsed value; print the canonical text of the stored one.
using Store = void (*)(Settings*, const Value&);
using Show = std::string (*)(const Settings&);
#define DQ_SETTING(field, kind, key, fallback, lo, hi, agreed, accepted, doc) \
  [](Settings* s, const Value& v) { store(&s->field, v); },
constexpr Store kStore[] = {
#include "config/settings.def"
};
#undef DQ_SETTING
#define DQ_SETTING(field, kind, key, fallback, lo, hi, agreed, accepted, doc) \
  [](const Settings& s) { return text_of(s.field); },
constexpr Show kShow[] = {
#include "config/settings.def"
};
#undef DQ_SETTING

// Parses one raw value for entry e; false if it is not acceptable.
bool parse(const Entry& e, const std::string& raw, Value* v) {
  switch (e.kind) {
    case Kind::Bool:
      return parse_bool(raw, &v->flag);
    case Kind::Int:
    case Kind::Bytes:
      if (!parse_int(raw, e.kind == Kind::Bytes, &v->number)) return false;
      return v->number >= e.lo && v->number <= e.hi;
    case Kind::Real:
      if (!parse_real(raw, &v->number)) return false;
      return v->number >= e.lo && v->number <= e.hi;
    case Kind::Text:
      v->text = raw;
      return true;
  }
  return false;
}

// Cross-field checks and derived values; false with *error set on failure.
bool finish(Settings* s, std::string* error) {
  const std::string codec = lower(s->codec);
  if (!valid_codec(codec)) {
    *error = "DYNAMIQ_CODEC=" + s->codec +
             " is not a codec; accepted: dynamiq, uniform, mxfp8, mxfp6, mxfp6e2m3, mxfp4, bf16";
    return false;
  }
  s->codec = codec;
  if (codec == "dynamiq" || codec == "uniform") {
    s->codec_spec = codec + ":" + format_real(s->bits);
    if (codec == "dynamiq" && !s->correlated) s->codec_spec += ":corr=0";
  } else {
    s->codec_spec = codec;
  }
  std::string why;
  if (make_codec(s->codec_spec, &why) == nullptr) {
    *error = "DYNAMIQ_CODEC=" + s->codec + " with DYNAMIQ_BITS=" + format_real(s->bits) +
             " is not a valid codec: " + why;
    return false;
  }
  const std::string topo = lower(s->topology);
  if (topo != "ring" && topo != "butterfly" && topo != "auto") {
    *error = "DYNAMIQ_TOPO=" + s->topology + " is not a topology; accepted: ring, butterfly, auto";
    return false;
  }
  s->topology = topo;
  if (!parse_dtypes(s->dtypes, s)) {
    *error = "DYNAMIQ_DTYPES=" + s->dtypes +
             " is not a comma list of float32, bfloat16 (aliases: float, fp32, bf16)";
    return false;
  }
  if (!parse_collectives(s->collectives, s)) {
    *error = "DYNAMIQ_COLLECTIVES=" + s->collectives +
             " is not a comma list of allreduce, reducescatter, reduce";
    return false;
  }
  OptInRules rules;
  if (parse_opt_in(s->comms, &rules, &why) != Status::kOk) {
    *error = "DYNAMIQ_COMMS=" + s->comms + ": " + why +
             "; accepted: comma list of all, none, name=GLOB, size=N, index=N, color=N";
    return false;
  }
  return true;
}

Status load_defaults(Settings* out) {
  for (int i = 0; i < kCount; ++i) {
    Value v;
    if (!parse(kTable[i], kTable[i].fallback, &v)) return Status::kInternal;
    kStore[i](out, v);
  }
  std::string ignored;
  return finish(out, &ignored) ? Status::kOk : Status::kInternal;
}

}  // namespace

Status load(EnvLookup lookup, void* ctx, Settings* out, std::string* error) {
  *out = Settings{};
  if (load_defaults(out) != Status::kOk) {
    *error = "dynamiq: the built-in defaults are invalid (a bug)";
    out->enable = false;
    return Status::kInternal;
  }
  Settings parsed = *out;
  for (int i = 0; i < kCount; ++i) {
    const Entry& e = kTable[i];
    const char* raw = lookup(e.key, ctx);
    if (raw == nullptr || *raw == '\0') continue;
    Value v;
    if (!parse(e, raw, &v)) {
      *error = std::string(e.key) + "=" + raw + " is not valid; accepted: " + e.accepted;
      out->enable = false;
      return Status::kInvalidArgument;
    }
    kStore[i](&parsed, v);
  }
  if (!finish(&parsed, error)) {
    out->enable = false;
    return Status::kInvalidArgument;
  }
  *out = parsed;
  return Status::kOk;
}

Status load_from_environment(Settings* out, std::string* error) {
  return load([](const char* key, void*) -> const char* { return std::getenv(key); }, nullptr, out,
              error);
}

namespace {
Settings g_settings;
bool g_valid = false;
std::once_flag g_once;
}  // namespace

const Settings& global() {
  std::call_once(g_once, [] {
    Settings& settings = g_settings;
    std::string error;
    g_valid = load_from_environment(&settings, &error) == Status::kOk;
    if (!g_valid) {
      DQ_WARN(Subsys::kEnv, "dynamiq: %s. Compression is OFF: every call passes through to NCCL.",
              error.c_str());
    } else if (log_enabled(LogLevel::kInfo, Subsys::kEnv)) {
      // One line per setting: log lines have a bounded length.
      const std::string text = describe(settings);
      size_t begin = 0;
      for (int line = 0; line < 64 && begin < text.size(); ++line) {
        const size_t end = text.find('\n', begin);
        DQ_INFO(
            Subsys::kEnv, "dynamiq setting %s",
            text.substr(begin + 2, end == std::string::npos ? std::string::npos : end - begin - 2)
                .c_str());
        if (end == std::string::npos) break;
        begin = end + 1;
      }
    }
  });
  return g_settings;
}

bool global_valid() {
  global();
  return g_valid;
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
  for (const Entry& e : kTable) n += e.agreed;
  return n;
}

namespace {
int agreed_index(int i) {
  for (int k = 0; k < kCount; ++k)
    if (kTable[k].agreed && i-- == 0) return k;
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
  uint32_t h = 2166136261u;  // FNV-1a over the canonical value text
  for (unsigned char c : kShow[k](s)) h = (h ^ c) * 16777619u;
  return h;
}

}  // namespace dq::config

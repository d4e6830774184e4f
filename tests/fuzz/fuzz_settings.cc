// libFuzzer target: the settings parser and the per-communicator opt-in rules over arbitrary
// environment values.
//
// Input: lines (split at '\n'). Each line's first byte picks one of the table's variables (or
// an NCCL variable one falls back on), the rest is its value, as an EnvLookup returns it.
// config::load parses and validates them all; then the opt-in rules of the last line's value
// (and of the loaded DYNAMIQ_COMMS) are parsed and matched against a communicator whose identity
// comes from the first bytes. Invariants: load() succeeds exactly when it reported no problem;
// an invalid setting leaves its default; opt-in rules that parse give the same answer twice.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include "config/optin.h"
#include "config/settings.h"

namespace {

std::vector<std::string> keys() {
  std::vector<std::string> k;
#define DQ_SETTING(field, kind, key, fallback, lo, hi, scope, accepted, doc) k.push_back(key);
#include "config/settings.def"
#undef DQ_SETTING
  const size_t table = k.size();
  for (size_t i = 0; i < table; ++i)  // the NCCL variables settings fall back on
    if (const char* nccl = dq::config::nccl_equivalent(k[i].c_str())) k.push_back(nccl);
  return k;
}

struct Env {
  std::vector<std::pair<std::string, std::string>> vars;
};

const char* lookup(const char* key, void* ctx) {
  const auto* env = static_cast<const Env*>(ctx);
  const char* found = nullptr;
  for (const auto& [k, v] : env->vars)
    if (k == key) found = v.c_str();  // the last assignment wins, as in a shell
  return found;
}

void check(bool ok) {
  if (!ok) __builtin_trap();
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  setenv("DYNAMIQ_DEBUG", "NONE", 1);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::vector<std::string> kKeys = keys();
  Env env;
  std::string last_value;
  size_t start = 0;
  for (size_t i = 0; i <= size; ++i) {
    if (i < size && data[i] != '\n') continue;
    if (i > start) {
      const std::string key = kKeys[data[start] % kKeys.size()];
      std::string value(reinterpret_cast<const char*>(data) + start + 1, i - start - 1);
      // A C string ends at the first NUL, as getenv would return it.
      value = std::string(value.c_str());
      env.vars.emplace_back(key, value);
      last_value = value;
    }
    start = i + 1;
  }

  dq::config::Settings s;
  std::string error;
  std::vector<dq::config::Problem> problems;
  const dq::Status st = dq::config::load(lookup, &env, &s, &error, &problems);
  check((st == dq::Status::kOk) == problems.empty());
  check(st == dq::Status::kOk || st == dq::Status::kInvalidArgument);
  (void)dq::config::describe(s);
  for (int i = 0; i < dq::config::Agreed::count(); ++i) (void)dq::config::Agreed::hash(s, i);

  dq::config::CommIdentity comm;
  comm.name = size > 0 ? std::string(reinterpret_cast<const char*>(data), size < 12 ? size : 12)
                       : std::string();
  comm.name = std::string(comm.name.c_str());
  comm.size = size > 0 ? data[0] : 0;
  comm.index = size > 1 ? data[1] : 0;
  comm.color = size > 2 ? static_cast<int8_t>(data[2]) : -1;
  for (const std::string* text : {&last_value, &s.comms}) {
    dq::config::OptInRules rules;
    std::string why;
    if (dq::config::parse_opt_in(*text, &rules, &why) != dq::Status::kOk) {
      check(!why.empty());
      continue;
    }
    const bool a = dq::config::opted_in(rules, comm);
    check(a == dq::config::opted_in(rules, comm));
  }
  // Globs straight from the input: pattern = first half, text = second half.
  const std::string in(reinterpret_cast<const char*>(data), size);
  const std::string pattern(in.substr(0, size / 2).c_str()), text(in.substr(size / 2).c_str());
  (void)dq::config::glob_match(pattern.c_str(), text.c_str());
  return 0;
}

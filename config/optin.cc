#include "config/optin.h"

#include <cerrno>
#include <cstdlib>
#include <string>

namespace dq::config {

Status parse_opt_in(const std::string& text, OptInRules* out, std::string* error) {
  out->rules.clear();
  size_t pos = 0;
  for (int terms = 0; terms < 256; ++terms) {  // bounded: 256 terms is far beyond any real list
    const size_t comma = text.find(',', pos);
    const std::string t =
        text.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    if (t == "all") {
      out->rules.push_back({OptInRules::Term::kAll, "", 0});
    } else if (t == "none") {
      out->rules.push_back({OptInRules::Term::kNone, "", 0});
    } else if (t.rfind("name=", 0) == 0 && t.size() > 5) {
      out->rules.push_back({OptInRules::Term::kName, t.substr(5), 0});
    } else if (!t.empty()) {
      const size_t eq = t.find('=');
      const std::string k = t.substr(0, eq == std::string::npos ? t.size() : eq);
      OptInRules::Term term;
      if (k == "size") {
        term = OptInRules::Term::kSize;
      } else if (k == "index") {
        term = OptInRules::Term::kIndex;
      } else if (k == "color") {
        term = OptInRules::Term::kColor;
      } else {
        *error = "unknown term '" + t + "'";
        return Status::kInvalidArgument;
      }
      const std::string v = eq == std::string::npos ? "" : t.substr(eq + 1);
      char* end = nullptr;
      errno = 0;
      const long x = std::strtol(v.c_str(), &end, 10);
      if (v.empty() || *end != '\0' || errno != 0 || x < 0) {
        *error = "term '" + t + "' needs a non-negative integer";
        return Status::kInvalidArgument;
      }
      out->rules.push_back({term, "", x});
    }
    if (comma == std::string::npos) return Status::kOk;
    pos = comma + 1;
  }
  *error = "more than 256 terms";
  return Status::kInvalidArgument;
}

namespace {

bool term_matches(const OptInRules::Rule& r, const CommIdentity& comm) {
  switch (r.term) {
    case OptInRules::Term::kAll:
      return true;
    case OptInRules::Term::kNone:
      return false;
    case OptInRules::Term::kName:
      return !comm.name.empty() && glob_match(r.glob.c_str(), comm.name.c_str());
    case OptInRules::Term::kSize:
      return comm.size == r.value;
    case OptInRules::Term::kIndex:
      return comm.index == r.value;
    case OptInRules::Term::kColor:
      return comm.color >= 0 && comm.color == r.value;
  }
  return false;
}

std::string term_text(const OptInRules::Rule& r) {
  switch (r.term) {
    case OptInRules::Term::kAll:
      return "all";
    case OptInRules::Term::kNone:
      return "none";
    case OptInRules::Term::kName:
      return "name=" + r.glob;
    case OptInRules::Term::kSize:
      return "size=" + std::to_string(r.value);
    case OptInRules::Term::kIndex:
      return "index=" + std::to_string(r.value);
    case OptInRules::Term::kColor:
      return "color=" + std::to_string(r.value);
  }
  return "?";
}

}  // namespace

bool opted_in(const OptInRules& rules, const CommIdentity& comm) {
  return !matching_term(rules, comm).empty();
}

std::string matching_term(const OptInRules& rules, const CommIdentity& comm) {
  for (const auto& r : rules.rules)
    if (term_matches(r, comm)) return term_text(r);
  return "";
}

bool glob_match(const char* p, const char* t) {
  // Iterative matcher with one backtrack point: linear in practice, no recursion.
  const char* star = nullptr;
  const char* resume = nullptr;
  while (*t) {
    if (*p == '?' || (*p != '*' && *p == *t)) {
      ++p, ++t;
    } else if (*p == '*') {
      star = p++;
      resume = t;
    } else if (star) {
      p = star + 1;
      t = ++resume;
    } else {
      return false;
    }
  }
  while (*p == '*') ++p;
  return *p == '\0';
}

}  // namespace dq::config

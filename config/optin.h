// Per-communicator opt-in (DYNAMIQ_COMMS): a communicator is compressed when it matches any term.
#pragma once
#include <string>
#include <vector>

#include "common/status.h"

namespace dq::config {

struct CommIdentity {
  std::string name;  // ncclConfig_t commName, "" when the caller set none
  int size = 0;      // ranks
  int index = 0;     // creation order in this process, 0 = first communicator created
  int color = -1;    // ncclCommSplit color, -1 when not made by a split
};

struct OptInRules {
  enum class Term { kAll, kNone, kName, kSize, kIndex, kColor };
  struct Rule {
    Term term;
    std::string glob;  // kName
    long value = 0;    // kSize, kIndex, kColor
  };
  std::vector<Rule> rules;
};

// "all", "none", "name=grad*,size=8", ...; kInvalidArgument with *error naming the bad term.
Status parse_opt_in(const std::string& text, OptInRules* out, std::string* error);
bool opted_in(const OptInRules& rules, const CommIdentity& comm);
// The term of `rules` that selects `comm` ("name=grad*", "all", ...), or "" when none does.
std::string matching_term(const OptInRules& rules, const CommIdentity& comm);
// Shell-style glob: * any run, ? any one character.
bool glob_match(const char* pattern, const char* text);

}  // namespace dq::config

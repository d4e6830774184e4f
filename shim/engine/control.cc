#include "shim/engine/control.h"

namespace dq::engine {
namespace {

// Layout: [version pair][valid pair][enable pair][opt-in pair][kAgreedSlots setting pairs]
//         [switch][failure]
constexpr int kFixedPairs = 4;
constexpr int pairs() {
  return kFixedPairs + kAgreedSlots;
}

void put_pair(uint32_t v, uint32_t* w) {
  w[0] = v;
  w[1] = ~v;
}
bool pair_equal(const uint32_t* w) {
  return w[0] == ~w[1];
}  // max(v) == min(v)

}  // namespace

int control_words() {
  return 2 * pairs() + 2;  // Agreed::count() <= kAgreedSlots: Control.HandshakeSizeIsFixed
}

void pack_control(const LocalControl& local, uint32_t* words) {
  const config::Settings& s = *local.settings;
  put_pair(kProtocolVersion, words + 0);
  put_pair(local.settings_valid ? 1u : 0u, words + 2);
  put_pair(s.enable ? 1u : 0u, words + 4);
  put_pair(local.opted_in ? 1u : 0u, words + 6);
  for (int i = 0; i < kAgreedSlots; ++i)
    put_pair(i < config::Agreed::count() ? config::Agreed::hash(s, i) : 0u,
             words + 2 * (kFixedPairs + i));
  const int tail = 2 * pairs();
  // Rank 0 contributes 1 + state; everyone else 0, so the MAX is rank 0's value.
  words[tail] = local.is_root ? (local.switch_on ? 2u : 1u) : 0u;
  words[tail + 1] = local.local_failure ? 1u : 0u;
}

ControlDecision decide_control(const uint32_t* w) {
  ControlDecision d;
  auto note = [&](const char* what) {
    if (!d.differs.empty()) d.differs += ", ";
    d.differs += what;
  };
  if (!pair_equal(w + 0)) note("dynamiq version (protocol)");
  if (!pair_equal(w + 2)) note("validity of the DYNAMIQ_* environment");
  if (!pair_equal(w + 4)) note("DYNAMIQ_ENABLE");
  // With the same DYNAMIQ_COMMS everywhere an index= or color= term can still match on some
  // ranks only: a rank that made other communicators first (or none, where a split left it out)
  // counts indexes differently, and a split NCCL completed late has no color.
  if (!pair_equal(w + 6))
    note(
        "communicator opt-in (DYNAMIQ_COMMS or dynamiqCommRegister; with the same DYNAMIQ_COMMS "
        "on every rank, an index= or color= term that matches on some ranks only: select it by "
        "size= or name=, or with dynamiqCommRegister)");
  for (int i = 0; i < config::Agreed::count(); ++i)
    if (!pair_equal(w + 2 * (kFixedPairs + i))) {
      const char* key = config::Agreed::key(i);
      // DYNAMIQ_ENABLE is already reported through its own pair.
      if (std::string(key) != "DYNAMIQ_ENABLE") note(key);
    }
  d.agreed = d.differs.empty();
  d.all_valid = w[2] == 1u;  // max == 1 and, being agreed, min too
  d.settings_enabled = w[2] == 1u && w[4] == 1u;
  d.enabled = d.settings_enabled && w[6] == 1u;
  const int tail = 2 * pairs();
  d.switch_on = w[tail] != 1u;  // 0 (no root?) or 2 = on
  d.any_failure = w[tail + 1] != 0u;
  return d;
}

void pack_call_control(bool is_root, bool switch_on, uint32_t* words) {
  words[0] = is_root ? (switch_on ? 2u : 1u) : 0u;  // as in pack_control: MAX is rank 0's value
}

bool decide_call_switch(const uint32_t* reduced) {
  return reduced[0] != 1u;  // 0 (no root?) or 2 = on
}

}  // namespace dq::engine

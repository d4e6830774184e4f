// The control block: a few uint32 words every rank contributes to a MAX all-reduce, next to
// the statistics. Each rank-local fact that must be agreed travels as a pair (v, ~v): after
// MAX, every rank holds max(v) and ~min(v), so every rank sees the same "all equal or not".
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "config/settings.h"

namespace dq::engine {

// Bump when the wire protocol (control layout, payload format, schedule keys) changes.
// 2: the handshake's host-hash exchange and communicator splits of the two-level schedule.
// 3: the handshake's fixed size (kAgreedSlots).
inline constexpr uint32_t kProtocolVersion = 3;

// Pairs the handshake holds for agreed settings, whatever the build's count of them: the
// handshake's size (control_words()) must be the same in every build, or ranks of two builds
// would all-reduce different counts before the version pair could tell them apart (NCCL does not
// compare counts: a hang or mixed words). Never change it; unused pairs are (0, ~0).
inline constexpr int kAgreedSlots = 48;

struct LocalControl {
  const config::Settings* settings = nullptr;
  bool settings_valid = true;  // false when this rank's environment failed to parse
  bool opted_in = false;       // this rank's opt-in decision for the communicator
  bool is_root = false;        // rank 0: contributes the A/B switch
  bool switch_on = true;       // rank 0's control-file state
  bool local_failure = false;  // this rank cannot run the compressed path for this call
};

struct ControlDecision {
  bool agreed = false;     // every agreed setting, the opt-in and the protocol match
  std::string differs;     // when not agreed: what differs (env keys), for the one warning
  bool enabled = false;    // every rank valid, enabled, opted in
  bool all_valid = false;  // every rank's environment valid (and its NCCL supported)
  // Every rank valid and enabled (opted in or not): the communicator screens its calls, and a
  // communicator nobody opted in counts them as not_opted_in rather than disabled.
  bool settings_enabled = false;
  bool switch_on = true;
  bool any_failure = false;
  bool compress() const { return agreed && enabled && switch_on && !any_failure; }
};

int control_words();
void pack_control(const LocalControl& local, uint32_t* words);
// Pure function of the reduced words: identical on every rank.
ControlDecision decide_control(const uint32_t* reduced);

// The word every eligible call adds to its statistics all-reduce (MAX): rank 0's A/B switch,
// written by the host before the call's first enqueue and read by every rank one eligible call
// later, so every rank switches on the same call.
inline constexpr int kCallControlWords = 1;
void pack_call_control(bool is_root, bool switch_on, uint32_t* words);
bool decide_call_switch(const uint32_t* reduced);

}  // namespace dq::engine

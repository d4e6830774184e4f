// libFuzzer target: what the net plugin's socket backend reads from a peer, as raw bytes.
//
// The first byte picks what the rest is:
//   0: a connection handshake: a stream of 40-byte hellos arriving at one listener (secret and
//      communicator id fixed below), admitted or refused exactly as ProgressHellos/AdmitSocket do
//      (CheckHello, JoinGroup); complete groups are handed out as Accept does. Invariants: a
//      group never holds two sockets for one index or more sockets than it announced;
//   1: a connection's frames on `nsocks` sockets (second byte): socket 0's message headers, then
//      part headers for the other sockets, chosen by a byte each,
//      checked as RunHeaders/RunParts do (CheckMsgHeader, PartHeaderValid, PartMatches). Bodies
//      are not in the input: the parser never reads them.
//      Invariant: every accepted part lies inside its message and parts never overlap;
//   2: a 48-byte listen handle as a connector receives it (HandleValid);
//   3: the verbs backend's control message (CheckCtl; the second byte picks connect, accept or
//      bye). Invariant: an accepted connect or accept names 1..kMaxQps QPs, each in range;
//   4: the verbs receiver's stripe immediates for one entry on a connection of 1 + byte % 8 QPs:
//      [QP byte][32-bit immediate] records (StripeTracker::Take). Invariant: the entry completes
//      exactly when as many distinct QPs as the announced stripe count have been taken, and
//      never takes the same QP twice.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <vector>

#include "plugin/ibverbs/ib_wire.h"
#include "plugin/socket/socket_parse.h"

namespace {

namespace wire = dq::net::wire;

constexpr uint64_t kSecret = 0x0123456789abcdefull;
constexpr uint64_t kCommId = 0x5eed5eed5eed5eedull;

struct Reader {
  const uint8_t* p;
  size_t left;
  template <typename T>
  bool take(T* out) {
    if (left < sizeof(T)) return false;
    std::memcpy(out, p, sizeof(T));
    p += sizeof(T);
    left -= sizeof(T);
    return true;
  }
};

void check(bool ok) {
  if (!ok) __builtin_trap();
}

void handshake(Reader r, uint8_t mode) {
  std::vector<wire::PendingGroup> groups;
  const bool has_id = (mode & 1) != 0;
  int next_fd = 100;
  wire::Hello h{};
  while (r.take(&h)) {
    if (wire::check_hello(h, kSecret, has_id, kCommId) != wire::HelloCheck::kOk) continue;
    check(h.nsocks >= 1 && h.nsocks <= wire::kMaxSocks && h.sock_index < h.nsocks);
    const int fd = next_fd++;
    if (!wire::join_group(&groups, h, "fuzz", fd)) continue;
    // accept(): a complete group becomes a receive connection.
    for (size_t gi = 0; gi < groups.size(); ++gi) {
      const auto& g = groups[gi];
      check(!g.fds.empty() && g.fds.size() <= static_cast<size_t>(wire::kMaxSocks));
      int seen = 0;
      bool complete = true;
      for (int f : g.fds) {
        complete = complete && f >= 0;
        if (f == fd) ++seen;
      }
      check(seen <= 1);
      if (complete) {
        groups.erase(groups.begin() + static_cast<long>(gi));
        --gi;
      }
    }
  }
}

struct Msg {
  uint64_t size;
  wire::Split split;
  std::vector<bool> got;  // parts received
  uint32_t seen = 1;      // the same as a bit mask, as the backend keeps it
};

void frames(Reader r, int nsocks) {
  uint64_t next_seq = 0;
  std::map<uint64_t, Msg> active;
  // Socket 0: headers and part-0 bodies until the first refusal or the end of the headers (a
  // zero byte between messages ends socket 0's stream and starts the other sockets').
  uint8_t more = 1;
  while (more != 0 && r.take(&more) && more != 0) {
    wire::MsgHeader h{};
    if (!r.take(&h)) return;
    if (wire::check_msg_header(h, next_seq) != wire::MsgCheck::kOk) return;  // connection fails
    check(h.size <= wire::kMaxMessageBytes && h.seq == next_seq);
    ++next_seq;
    Msg m{h.size, wire::split_message(h.size, nsocks), {}};
    check(m.split.parts >= 1 && m.split.parts <= nsocks);
    // The parts tile the message: part k covers [k * stripe, min(size, (k+1) * stripe)).
    uint64_t covered = 0;
    for (int k = 0; k < m.split.parts; ++k) {
      check(m.split.offset(k) == covered || m.split.len(k, h.size) == 0);
      covered += m.split.len(k, h.size);
    }
    check(covered == h.size);
    m.got.assign(m.split.parts, false);
    m.got[0] = true;
    // Part 0's body follows on socket 0; the parser never looks at body bytes, so the input
    // leaves them out (a 1 TiB message costs nothing to describe).
    active[h.seq] = std::move(m);
  }
  // Other sockets: [socket byte][PartHeader][body].
  uint8_t pick = 0;
  while (nsocks > 1 && r.take(&pick)) {
    const int k = 1 + pick % (nsocks - 1);
    wire::PartHeader h{};
    if (!r.take(&h)) return;
    if (!wire::part_header_valid(h, k)) return;
    auto it = active.find(h.seq);
    if (it == active.end()) return;  // not in flight (or waits for a header that never comes)
    Msg& m = it->second;
    if (!wire::part_matches(h, k, m.split, m.size, m.seen)) return;
    m.seen |= 1u << k;
    check(h.offset <= m.size && h.len <= m.size - h.offset);
    check(!m.got[static_cast<size_t>(k)]);  // a part arrives once: the next needs a new seq
    m.got[static_cast<size_t>(k)] = true;
    bool all = true;
    for (bool g : m.got) all = all && g;
    if (all) active.erase(it);
  }
}

namespace ibwire = dq::net::ibwire;

void verbs_control(Reader r, uint8_t which) {
  static const uint16_t kinds[] = {ibwire::kConnect, ibwire::kAccept, ibwire::kBye};
  ibwire::Ctl c{};
  if (!r.take(&c)) return;
  const uint16_t want = kinds[which % 3];
  if (ibwire::check_ctl(c, want) != nullptr || want == ibwire::kBye) return;
  check(c.nqps >= 1 && c.nqps <= ibwire::kMaxQps);
  for (uint32_t i = 0; i < ibwire::kMaxQps; ++i) {
    if (i < c.nqps) {
      check(c.qpn[i] != 0 && c.qpn[i] < (1u << 24) && c.psn[i] < (1u << 24));
    } else {
      check(c.qpn[i] == 0 && c.psn[i] == 0);
    }
  }
}

void verbs_stripes(Reader r, uint32_t nqps) {
  ibwire::StripeTracker t;
  uint32_t taken = 0;  // QPs taken, as a mask kept apart from the tracker's
  uint8_t qp = 0;
  uint32_t imm = 0;
  while (r.take(&qp) && r.take(&imm)) {
    bool complete = false;
    if (t.take(qp, ibwire::imm_stripes(imm), nqps, &complete) != nullptr) continue;  // refused
    check(qp < nqps && ((taken >> qp) & 1u) == 0);
    taken |= 1u << qp;
    const uint32_t stripes = ibwire::imm_stripes(imm);
    check(complete == (static_cast<uint32_t>(__builtin_popcount(taken)) == stripes));
    if (complete) return;  // the backend marks the entry received: later immediates are refused
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  const uint8_t mode = data[0];
  Reader r{data + 2, size - 2};
  switch (mode % 5) {
    case 0:
      handshake(r, data[1]);
      break;
    case 1:
      frames(r, 1 + data[1] % wire::kMaxSocks);
      break;
    case 3:
      verbs_control(r, data[1]);
      break;
    case 4:
      verbs_stripes(r, 1 + data[1] % ibwire::kMaxQps);
      break;
    default: {
      wire::Handle h{};
      if (r.take(&h) && wire::handle_valid(h)) check(h.nsocks >= 1 && h.nsocks <= wire::kMaxSocks);
      break;
    }
  }
  return 0;
}

#include "plugin/socket/socket_parse.h"

#include <sys/socket.h>

namespace dq::net::wire {
namespace {

bool secrets_equal(uint64_t a, uint64_t b) {
  uint64_t diff = a ^ b;  // no early exit on the first differing byte
  return diff == 0;
}

}  // namespace

bool handle_valid(const Handle& h) {
  return h.magic == kHandleMagic && h.version == kVersion &&
         (h.family == AF_INET || h.family == AF_INET6) && h.nsocks >= 1 && h.nsocks <= kMaxSocks;
}

HelloCheck check_hello(const Hello& h, uint64_t secret, bool has_comm_id, uint64_t comm_id) {
  if (h.magic != kHelloMagic || h.version != kVersion) return HelloCheck::kNotDynamiq;
  if (!secrets_equal(h.secret, secret)) return HelloCheck::kWrongSecret;
  const bool peer_has_id = (h.flags & kHelloHasCommId) != 0;
  if (peer_has_id && has_comm_id && h.comm_id != comm_id) return HelloCheck::kWrongCommId;
  if (h.nsocks < 1 || h.nsocks > kMaxSocks || h.sock_index >= h.nsocks) {
    return HelloCheck::kBadSocket;
  }
  return HelloCheck::kOk;
}

bool join_group(std::vector<PendingGroup>* groups, const Hello& h, const std::string& peer,
                int fd) {
  PendingGroup* g = nullptr;
  for (auto& cand : *groups) {
    if (cand.nonce == h.nonce) g = &cand;
  }
  if (g == nullptr) {
    groups->push_back(PendingGroup{h.nonce, peer, std::vector<int>(h.nsocks, -1),
                                   std::chrono::steady_clock::now()});
    g = &groups->back();
  }
  if (g->fds.size() != h.nsocks || g->fds[h.sock_index] >= 0) return false;
  g->fds[h.sock_index] = fd;
  return true;
}

MsgCheck check_msg_header(const MsgHeader& h, uint64_t next_seq) {
  if (h.magic != kMsgMagic) return MsgCheck::kBadMagic;
  if (h.size > kMaxMessageBytes) return MsgCheck::kTooLarge;
  if (h.seq != next_seq) return MsgCheck::kBadSeq;
  return MsgCheck::kOk;
}

bool part_header_valid(const PartHeader& h, int k) {
  return h.magic == kPartMagic && h.sock_index == static_cast<uint32_t>(k);
}

bool part_matches(const PartHeader& h, int k, const Split& split, uint64_t size,
                  uint32_t parts_seen) {
  // A second part k of one message would count twice towards its completion: the message would
  // complete with another part never written (found by tests/fuzz/fuzz_net_frames).
  if (k < 0 || k >= kMaxSocks || (parts_seen >> k) & 1u) return false;
  return k < split.parts && h.offset == split.offset(k) && h.len == split.len(k, size);
}

}  // namespace dq::net::wire

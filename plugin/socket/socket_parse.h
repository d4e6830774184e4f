// What the socket backend reads from a peer, checked without any I/O: the listen handle a
// connector is given, the hello that opens each socket, and the frame headers of a connection.
// socket_connect.cc and socket_threads.cc call these on the bytes they received; tests/fuzz
// feeds them arbitrary bytes.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "plugin/socket/socket_wire.h"

namespace dq::net::wire {

// A listen handle that names a dynamiq listener this build can connect to.
bool handle_valid(const Handle& h);

enum class HelloCheck {
  kOk,
  kNotDynamiq,   // magic or version
  kWrongSecret,  // the peer does not hold this listen handle
  kWrongCommId,  // both sides name a communicator, and not the same one
  kBadSocket,    // nsocks out of [1, kMaxSocks] or sock_index >= nsocks
};
// Checks a complete hello against what the listener expects.
HelloCheck check_hello(const Hello& h, uint64_t secret, bool has_comm_id, uint64_t comm_id);

// Sockets of one connection arriving at a listener, grouped by the hello's nonce.
struct PendingGroup {
  uint64_t nonce = 0;
  std::string peer;
  std::vector<int> fds;  // -1 until that index arrives
  std::chrono::steady_clock::time_point start;
};
// Places socket `fd` of an admitted hello (check_hello == kOk) in its group, starting one for a
// new nonce. False when the group disagrees (another socket count) or already holds that index:
// the caller refuses the socket and keeps ownership of `fd`.
bool join_group(std::vector<PendingGroup>* groups, const Hello& h, const std::string& peer, int fd);

enum class MsgCheck { kOk, kBadMagic, kTooLarge, kBadSeq };
// A message header read on socket 0 when `next_seq` is the next message expected.
MsgCheck check_msg_header(const MsgHeader& h, uint64_t next_seq);

// A part header read on socket k: magic and socket index.
bool part_header_valid(const PartHeader& h, int k);
// The part's offset and length are the ones split_message gives part k of a message of `size`
// bytes cut over the connection's sockets (so offset + len <= size), and part k has not arrived
// yet: bit k of `parts_seen` (the parts already read of that message) is clear.
bool part_matches(const PartHeader& h, int k, const Split& split, uint64_t size,
                  uint32_t parts_seen);

}  // namespace dq::net::wire

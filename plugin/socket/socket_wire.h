// Wire formats of the socket backend (host byte order: both ends run this plugin on the same
// architecture, as NCCL's own socket transport assumes).
//
// A connection is `nsocks` TCP sockets. Each opens with a Hello binding it to the listen
// handle's secret (and the communicator id where the ABI version provides one). Then:
//  socket 0 carries, per message in send order, a MsgHeader followed by part 0 of the payload;
//  socket k > 0 carries, for each message that has a part k, a PartHeader and part k.
// split_message() decides the parts from the size alone, so both ends agree without asking.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

namespace dq::net::wire {

inline constexpr uint32_t kHandleMagic = 0x48514e44;  // "DNQH"
inline constexpr uint32_t kHelloMagic = 0x4c514e44;   // "DNQL"
inline constexpr uint32_t kMsgMagic = 0x4d514e44;     // "DNQM"
inline constexpr uint32_t kPartMagic = 0x50514e44;    // "DNQP"
inline constexpr uint16_t kVersion = 1;
inline constexpr int kMaxSocks = 8;
inline constexpr uint64_t kMaxMessageBytes = 1ull << 40;  // NCCL's own limit (1 TiB)
inline constexpr size_t kMinStripeBytes = 64 << 10;       // below this a message uses 1 socket

// Lives in NCCL's 128-byte listen handle.
struct Handle {
  uint32_t magic;
  uint16_t version;
  uint16_t family;   // AF_INET / AF_INET6
  uint16_t port_be;  // network byte order
  uint16_t nsocks;   // sockets the listener expects per connection
  uint32_t reserved;
  uint8_t addr[16];        // in_addr (first 4 bytes) or in6_addr
  uint64_t secret;         // drawn at listen time; a connection must present it
  uint64_t connect_state;  // connector-local progress (pointer), zero on the wire
};
static_assert(sizeof(Handle) == 48 && sizeof(Handle) <= 128, "handle must fit NCCL's 128 bytes");

inline constexpr uint16_t kHelloHasCommId = 1;

struct Hello {
  uint32_t magic;
  uint16_t version;
  uint16_t sock_index;
  uint16_t nsocks;
  uint16_t flags;  // kHelloHasCommId
  uint32_t reserved;
  uint64_t secret;
  uint64_t comm_id;
  uint64_t nonce;  // same for every socket of one connection
};
static_assert(sizeof(Hello) == 40);

struct MsgHeader {
  uint32_t magic;
  int32_t tag;
  uint64_t seq;   // 0, 1, 2, ... per connection
  uint64_t size;  // payload bytes of the whole message
};
static_assert(sizeof(MsgHeader) == 24);

struct PartHeader {
  uint32_t magic;
  uint32_t sock_index;
  uint64_t seq;
  uint64_t offset;
  uint64_t len;
};
static_assert(sizeof(PartHeader) == 32);

struct Split {
  int parts;      // >= 1; part k travels on socket k
  size_t stripe;  // bytes per part (the last may be shorter)
  size_t offset(int k) const { return static_cast<size_t>(k) * stripe; }
  size_t len(int k, size_t size) const {
    size_t off = offset(k);
    return off >= size ? 0 : std::min(stripe, size - off);
  }
};

inline Split split_message(size_t size, int nsocks) {
  Split s{1, size};
  if (nsocks > 1 && size >= 2 * kMinStripeBytes) {
    s.parts =
        static_cast<int>(std::min<size_t>(static_cast<size_t>(nsocks), size / kMinStripeBytes));
    s.stripe = (size + static_cast<size_t>(s.parts) - 1) / static_cast<size_t>(s.parts);
  }
  return s;
}

}  // namespace dq::net::wire

// Wire formats of the ibverbs backend (host byte order, like the socket backend: both ends run
// this plugin on the same architecture).
//
// Connection setup travels over the socket backend (its authenticated handshake, comm id check
// and framing): the connector opens a one-socket connection to the listener and sends a Ctl of
// kind kConnect that carries its QP, its address, its FIFO and the handle of a reply listener;
// the acceptor connects back to that reply listener and answers with kAccept. Both directions
// stay open for the life of the connection: each end keeps a receive posted on the side channel,
// so a dead peer (TCP reset or close) fails the connection, and an orderly close sends kBye.
//
// Data path (the receiver drives it, so large messages need no copy):
//  - the sender owns a FIFO of kFifoDepth slots in registered, remote-writable memory;
//  - irecv k writes a free slot (one whose entries have all arrived) with one RDMA WRITE: each
//    grouped receive's address, rkey, capacity and tag, the slot's seq = k + 1 (a new seq is a
//    new posting; the sender takes posted slots in seq order) and a check word over all of it.
//    The sender acts on a slot only once its check matches: nothing orders the bytes of one
//    RDMA WRITE as the sender's CPU sees them (soft-RoCE places them with the kernel's memcpy,
//    which may copy backwards, so a new seq can be visible before the entries it announces);
//  - isend matches the oldest posted entry with its tag, RDMA WRITEs the payload there, then
//    RDMA WRITE WITH IMMEDIATE of an 8-byte size record into the receiver's record array at
//    [slot][entry] with imm = slot * kMaxGroupedRecvs + entry (RC keeps the two in order);
//  - the receiver's completion (the immediate) names the request and entry; the record gives the
//    size, with kOversize set when the payload did not fit (then nothing was written).
#pragma once

#include <cstddef>
#include <cstdint>

#include "plugin/net_backend.h"
#include "plugin/socket/socket_wire.h"

namespace dq::net::ibwire {

inline constexpr uint32_t kHandleMagic = 0x49514e44;  // "DNQI"
inline constexpr uint32_t kCtlMagic = 0x43514e44;     // "DNQC"
inline constexpr uint16_t kVersion = 2;  // 2: FifoSlot::check
// Receives in flight per connection; at least NCCL_NET_MAX_REQUESTS (32).
inline constexpr uint32_t kFifoDepth = 64;
inline constexpr uint64_t kOversize = 1ull << 63;  // size record flag: the payload did not fit

// NCCL's 128-byte listen handle: the socket listener's handle (side channel), then ours.
struct Handle {
  wire::Handle sock;  // nsocks forced to 1: the side channel needs no striping
  uint32_t magic;     // kHandleMagic
  uint16_t version;   // kVersion
  uint16_t reserved;
  uint64_t connect_state;  // connector-local progress (pointer), zero on the wire
};
static_assert(sizeof(Handle) == 64 && sizeof(Handle) <= 128, "handle must fit NCCL's 128 bytes");

struct FifoEntry {
  uint64_t addr;  // receive buffer (virtual address registered under rkey)
  uint64_t size;  // its capacity in bytes
  uint32_t rkey;
  int32_t tag;
};

struct FifoSlot {
  FifoEntry e[kMaxGroupedRecvs];  // unused entries zero
  uint32_t n;                     // grouped receives in this slot, 1..kMaxGroupedRecvs
  uint32_t reserved;              // zero
  uint64_t seq;                   // receive index + 1
  uint64_t check;                 // SlotCheck of everything above
};
static_assert(sizeof(FifoSlot) == 24 * kMaxGroupedRecvs + 24);

// Check word of a slot: every 8-byte word before `check`, each folded in with splitmix64's
// finalizer, so a slot that mixes two postings' bytes (or a torn word) matches with probability
// about 2^-64. Plain words in, so the caller can run it on a snapshot.
inline uint64_t SlotCheck(const uint64_t* words, size_t nwords) {
  uint64_t h = 0x6479'6e61'6d69'7121ull;  // any constant; "dynamiq!"
  for (size_t i = 0; i < nwords; ++i) {
    uint64_t z = h ^ words[i];
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    h = z ^ (z >> 31);
  }
  return h;
}
inline constexpr size_t kSlotCheckedWords = offsetof(FifoSlot, check) / sizeof(uint64_t);
static_assert(offsetof(FifoSlot, check) % sizeof(uint64_t) == 0);

enum CtlKind : uint16_t { kConnect = 1, kAccept = 2, kBye = 3 };

struct Ctl {
  uint32_t magic;  // kCtlMagic
  uint16_t version;
  uint16_t kind;  // CtlKind
  uint32_t qpn;   // 24 bits
  uint32_t psn;   // 24 bits
  uint8_t gid[16];
  uint16_t lid;
  uint8_t link_layer;  // IBV_LINK_LAYER_*
  uint8_t mtu;         // enum ibv_mtu, 1..5
  uint32_t rkey;       // kConnect: the sender's FIFO; kAccept: the receiver's size records
  uint64_t addr;
  uint32_t fifo_depth;                         // kFifoDepth of the sender (must match)
  uint32_t max_recvs;                          // kMaxGroupedRecvs (must match)
  uint8_t reply_handle[sizeof(wire::Handle)];  // kConnect: where the acceptor answers
};
static_assert(sizeof(Ctl) == 56 + sizeof(wire::Handle));

// Why a Ctl is refused, or nullptr when it is well formed and of kind `want`.
inline const char* CheckCtl(const Ctl& c, uint16_t want) {
  if (c.magic != kCtlMagic || c.version != kVersion) return "not a dynamiq verbs control message";
  if (c.kind != want) return "unexpected control message kind";
  if (want == kBye) return nullptr;
  if (c.qpn == 0 || c.qpn >= (1u << 24)) return "queue pair number out of range";
  if (c.psn >= (1u << 24)) return "packet sequence number out of range";
  if (c.mtu < 1 || c.mtu > 5) return "path MTU out of range";
  if (c.fifo_depth != kFifoDepth || c.max_recvs != static_cast<uint32_t>(kMaxGroupedRecvs)) {
    return "FIFO geometry differs (another build of the plugin)";
  }
  if (c.addr == 0) return "NULL remote address";
  return nullptr;
}

}  // namespace dq::net::ibwire

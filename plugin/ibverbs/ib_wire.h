// Wire formats of the ibverbs backend (host byte order, like the socket backend: both ends run
// this plugin on the same architecture).
//
// Connection setup travels over the socket backend (its authenticated handshake, comm id check
// and framing): the connector opens a one-socket connection to the listener and sends a Ctl of
// kind kConnect that carries its QP, its address, its FIFO and the handle of a reply listener;
// the acceptor connects back to that reply listener and answers with kAccept; the connector moves
// its QPs to RTS and answers kReady, and only then is the acceptor's connection made (the
// acceptor's first FIFO write must not meet a QP still in INIT, which drops it silently until
// the write's ACK timeout resends it: a second or more on the connection's first use). Both
// directions stay open for the life of the connection: each end keeps a receive posted on the side
// channel, so a dead peer (TCP reset or close) fails the connection, and an orderly close sends
// kBye.
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
//    [slot][entry] (RC keeps the two in order);
//  - a connection has 1..kMaxQps queue pairs (DYNAMIQ_NET_IB_QPS): a message of at least
//    2 x kMinStripeBytes is cut into stripe_count contiguous stripes, stripe i written on QP i and
//    ended there by its own WRITE WITH IMMEDIATE (QP 0's carries the size record, the others are
//    zero-length), because RC orders the writes of one QP only;
//  - every immediate is stripe_imm(slot * kMaxGroupedRecvs + entry, stripes): the receiver counts
//    one per stripe, each from a different QP (StripeTracker), and the entry is complete when all
//    have arrived; the record gives the size, with kOversize set when the payload did not fit
//    (then nothing was written).
#pragma once

#include <cstddef>
#include <cstdint>

#include "plugin/net_backend.h"
#include "plugin/socket/socket_wire.h"

namespace dq::net::ibwire {

inline constexpr uint32_t kHandleMagic = 0x49514e44;  // "DNQI"
inline constexpr uint32_t kCtlMagic = 0x43514e44;     // "DNQC"
// 2: FifoSlot::check; 3: several QPs per connection; 4: kReady
inline constexpr uint16_t kVersion = 4;
// Receives in flight per connection; at least NCCL_NET_MAX_REQUESTS (32).
inline constexpr uint32_t kFifoDepth = 64;
inline constexpr uint64_t kOversize = 1ull << 63;  // size record flag: the payload did not fit
inline constexpr uint32_t kMaxQps = 8;  // queue pairs per connection, DYNAMIQ_NET_IB_QPS's bound
// Smallest stripe, in bytes: below it the extra work requests and completions cost more than a
// second QP's parallelism gains.
inline constexpr uint64_t kMinStripeBytes = 512u << 10;

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
  uint64_t check;                 // slot_check of everything above
};
static_assert(sizeof(FifoSlot) == 24 * kMaxGroupedRecvs + 24);

// Check word of a slot: every 8-byte word before `check`, each folded in with splitmix64's
// finalizer, so a slot that mixes two postings' bytes (or a torn word) matches with probability
// about 2^-64. Plain words in, so the caller can run it on a snapshot.
inline uint64_t slot_check(const uint64_t* words, size_t nwords) {
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

enum CtlKind : uint16_t { kConnect = 1, kAccept = 2, kBye = 3, kReady = 4 };

struct Ctl {
  uint32_t magic;  // kCtlMagic
  uint16_t version;
  uint16_t kind;          // CtlKind
  uint32_t nqps;          // queue pairs, 1..kMaxQps: the connector's choice, echoed by kAccept
  uint32_t reserved;      // zero
  uint32_t qpn[kMaxQps];  // 24 bits each; zero past nqps
  uint32_t psn[kMaxQps];  // 24 bits each; zero past nqps
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
static_assert(sizeof(Ctl) == 120 + sizeof(wire::Handle));

// Why a Ctl is refused, or nullptr when it is well formed and of kind `want`.
// A control message that carries its kind alone (kBye, kReady).
inline Ctl bare_ctl(CtlKind kind) {
  Ctl c{};
  c.magic = kCtlMagic;
  c.version = kVersion;
  c.kind = kind;
  return c;
}

inline const char* check_ctl(const Ctl& c, uint16_t want) {
  if (c.magic != kCtlMagic || c.version != kVersion) return "not a dynamiq verbs control message";
  if (c.kind != want) return "unexpected control message kind";
  if (want == kBye || want == kReady) return nullptr;
  if (c.nqps < 1 || c.nqps > kMaxQps) return "queue pair count out of range";
  if (c.reserved != 0) return "reserved field not zero";
  for (uint32_t i = 0; i < kMaxQps; ++i) {
    if (i >= c.nqps) {
      if (c.qpn[i] != 0 || c.psn[i] != 0) return "queue pair fields past the count not zero";
      continue;
    }
    if (c.qpn[i] == 0 || c.qpn[i] >= (1u << 24)) return "queue pair number out of range";
    if (c.psn[i] >= (1u << 24)) return "packet sequence number out of range";
  }
  if (c.mtu < 1 || c.mtu > 5) return "path MTU out of range";
  if (c.fifo_depth != kFifoDepth || c.max_recvs != static_cast<uint32_t>(kMaxGroupedRecvs)) {
    return "FIFO geometry differs (another build of the plugin)";
  }
  if (c.addr == 0) return "NULL remote address";
  return nullptr;
}

// ---- striping over the connection's queue pairs

// Stripes of a message of `size` bytes on a connection of `nqps` QPs: one per kMinStripeBytes,
// at least 1, at most nqps.
inline uint32_t stripe_count(uint64_t size, uint32_t nqps) {
  const uint64_t k = size / kMinStripeBytes;
  return static_cast<uint32_t>(k < 1 ? 1 : (k < nqps ? k : nqps));
}

// Bytes [*offset, *offset + *length) of stripe i of k: equal parts, rounded up to 4 KiB pages,
// the last one shorter. With size >= k * kMinStripeBytes no stripe is empty.
inline void stripe_range(uint64_t size, uint32_t k, uint32_t i, uint64_t* offset,
                         uint64_t* length) {
  uint64_t part = (size + k - 1) / k;
  part = (part + 4095) & ~uint64_t{4095};
  const uint64_t begin = i * part < size ? i * part : size;
  const uint64_t end = begin + part < size ? begin + part : size;
  *offset = begin;
  *length = end - begin;
}

// Immediate of every stripe of entry `index` (slot * kMaxGroupedRecvs + entry, < 2^16).
inline uint32_t stripe_imm(uint32_t index, uint32_t stripes) {
  return index | (stripes << 16);
}
static_assert(kFifoDepth * kMaxGroupedRecvs <= (1u << 16), "entry index must fit 16 bits");
inline uint32_t imm_index(uint32_t imm) {
  return imm & 0xffff;
}
inline uint32_t imm_stripes(uint32_t imm) {
  return imm >> 16;
}

// The receiver's count of one entry's stripes: each arrives once, from its own QP, and all carry
// the same stripe count.
struct StripeTracker {
  uint8_t stripes = 0;  // 0: none arrived yet
  uint8_t seen = 0;     // bit q: QP q's stripe arrived

  // Takes the stripe that arrived on QP `qp` of a connection of `nqps` QPs, announcing
  // `stripes`. nullptr when taken (*complete: every stripe is in), else why it is refused.
  const char* take(uint32_t qp, uint32_t stripes_announced, uint32_t nqps, bool* complete) {
    *complete = false;
    if (stripes_announced < 1 || stripes_announced > nqps) return "stripe count out of range";
    if (stripes != 0 && stripes != stripes_announced) return "stripe count differs between stripes";
    if (qp >= stripes_announced) return "a stripe on a QP past the stripe count";
    if (((seen >> qp) & 1u) != 0) return "a second stripe from the same QP";
    stripes = static_cast<uint8_t>(stripes_announced);
    seen = static_cast<uint8_t>(seen | (1u << qp));
    *complete = seen == (1u << stripes) - 1;
    return nullptr;
  }
};

}  // namespace dq::net::ibwire

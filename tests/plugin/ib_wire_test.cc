// The verbs wire (plugin/ibverbs/ib_wire.h). The FIFO's check word: a sender must never act on a
// slot whose bytes mix two postings, whatever order the RDMA WRITE's bytes land in (soft-RoCE's
// kernel memcpy may copy backwards, so the new seq can land before the entries it announces; that
// was the 4-rank rdma all-reduce's wrong results and stray immediates). The control message's
// checks, and the striping of a message over a connection's queue pairs: stripes tile the message,
// and the receiver completes an entry exactly when every stripe has arrived once.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <random>

#include "plugin/ibverbs/ib_wire.h"

namespace {

using dq::net::ibwire::Ctl;
using dq::net::ibwire::FifoSlot;
using dq::net::ibwire::kMaxQps;
using dq::net::ibwire::kMinStripeBytes;
using dq::net::ibwire::kSlotCheckedWords;
using dq::net::ibwire::slot_check;
using dq::net::ibwire::stripe_count;
using dq::net::ibwire::stripe_range;
using dq::net::ibwire::StripeTracker;
constexpr size_t kWords = sizeof(FifoSlot) / 8;

// A posting as the receiver writes it: n receives of one tag at neighbouring addresses.
FifoSlot posting(uint64_t seq, uint32_t n, uint64_t base, int tag) {
  FifoSlot s;
  std::memset(&s, 0, sizeof(s));
  for (uint32_t i = 0; i < n; ++i) {
    s.e[i].addr = base + i * 65536;
    s.e[i].size = 65536;
    s.e[i].rkey = 0x1234 + i;
    s.e[i].tag = tag;
  }
  s.n = n;
  s.seq = seq;
  s.check = slot_check(reinterpret_cast<const uint64_t*>(&s), kSlotCheckedWords);
  return s;
}

bool matches(const FifoSlot& s) {
  return slot_check(reinterpret_cast<const uint64_t*>(&s), kSlotCheckedWords) == s.check;
}

TEST(IbWire, CompletePostingsMatch) {
  EXPECT_TRUE(matches(posting(1, 1, 0x7f0000001000, 0)));
  EXPECT_TRUE(matches(posting(977, 8, 0x7f0000200000, -3)));
}

// Every state a copy of the new posting over the old one passes through, forwards or backwards,
// one 8-byte word at a time: only the finished copy matches.
TEST(IbWire, EveryPartlyWrittenSlotIsRefused) {
  std::mt19937_64 rng(7);
  for (int trial = 0; trial < 200; ++trial) {
    const uint64_t seq = 1 + rng() % 100000;
    const FifoSlot old_slot = posting(seq, 1 + rng() % 8, rng() & ~0xfffull, 0);
    // The same slot's next posting: often the same tag and count, only the buffer differs.
    const FifoSlot new_slot =
        posting(seq + 1 + rng() % 64, trial % 2 ? old_slot.n : 1 + rng() % 8, rng() & ~0xfffull, 0);
    uint64_t o[kWords], w[kWords];
    std::memcpy(o, &old_slot, sizeof(o));
    std::memcpy(w, &new_slot, sizeof(w));
    for (size_t k = 0; k < kWords; ++k) {
      uint64_t fwd[kWords], bwd[kWords];
      for (size_t i = 0; i < kWords; ++i) {
        fwd[i] = i < k ? w[i] : o[i];            // first k words landed
        bwd[i] = i >= kWords - k ? w[i] : o[i];  // last k words landed
      }
      FifoSlot f, b;
      std::memcpy(&f, fwd, sizeof(f));
      std::memcpy(&b, bwd, sizeof(b));
      // k words of kWords: never the whole posting, and the old one only when k = 0.
      EXPECT_EQ(matches(f), k == 0) << "trial " << trial << ", " << k << " words forwards";
      EXPECT_EQ(matches(b), k == 0) << "trial " << trial << ", " << k << " words backwards";
    }
  }
}

TEST(IbWire, ACorruptedWordIsRefused) {
  const FifoSlot s = posting(42, 3, 0x7f0000001000, 5);
  for (size_t i = 0; i < kWords; ++i) {
    for (int bit = 0; bit < 64; bit += 13) {
      FifoSlot t = s;
      reinterpret_cast<uint64_t*>(&t)[i] ^= 1ull << bit;
      EXPECT_FALSE(matches(t)) << "word " << i << " bit " << bit;
    }
  }
}

// ---- the control message

Ctl good_connect(uint32_t nqps) {
  Ctl c;
  std::memset(&c, 0, sizeof(c));
  c.magic = dq::net::ibwire::kCtlMagic;
  c.version = dq::net::ibwire::kVersion;
  c.kind = dq::net::ibwire::kConnect;
  c.nqps = nqps;
  for (uint32_t i = 0; i < nqps; ++i) {
    c.qpn[i] = 0x11 + i;
    c.psn[i] = 0xabcdef - i;
  }
  c.mtu = 3;
  c.addr = 0x7f0000001000;
  c.fifo_depth = dq::net::ibwire::kFifoDepth;
  c.max_recvs = dq::net::kMaxGroupedRecvs;
  return c;
}

TEST(IbWire, ControlMessageChecksEveryQueuePair) {
  using dq::net::ibwire::check_ctl;
  using dq::net::ibwire::kConnect;
  for (uint32_t n = 1; n <= kMaxQps; ++n)
    EXPECT_EQ(check_ctl(good_connect(n), kConnect), nullptr) << n;
  Ctl c = good_connect(0);
  EXPECT_STREQ(check_ctl(c, kConnect), "queue pair count out of range");
  c = good_connect(1);
  c.nqps = kMaxQps + 1;
  EXPECT_STREQ(check_ctl(c, kConnect), "queue pair count out of range");
  c = good_connect(4);
  c.qpn[3] = 0;  // the last QP of the count
  EXPECT_STREQ(check_ctl(c, kConnect), "queue pair number out of range");
  c = good_connect(4);
  c.qpn[2] = 1u << 24;
  EXPECT_STREQ(check_ctl(c, kConnect), "queue pair number out of range");
  c = good_connect(4);
  c.psn[1] = 1u << 24;
  EXPECT_STREQ(check_ctl(c, kConnect), "packet sequence number out of range");
  c = good_connect(2);
  c.qpn[2] = 0x99;  // a QP past the count
  EXPECT_STREQ(check_ctl(c, kConnect), "queue pair fields past the count not zero");
  c = good_connect(2);
  c.reserved = 1;
  EXPECT_STREQ(check_ctl(c, kConnect), "reserved field not zero");
  c = good_connect(2);
  c.version = 2;  // the single-QP wire of the previous version
  EXPECT_NE(check_ctl(c, kConnect), nullptr);
}

// ---- striping

TEST(IbWire, StripesTileTheMessage) {
  for (uint32_t nqps = 1; nqps <= kMaxQps; ++nqps) {
    for (uint64_t size : {uint64_t{0}, uint64_t{1}, kMinStripeBytes - 1, kMinStripeBytes,
                          2 * kMinStripeBytes - 1, 2 * kMinStripeBytes, 3 * kMinStripeBytes + 7,
                          uint64_t{4} << 20, (uint64_t{64} << 20) + 12345, uint64_t{256} << 20}) {
      const uint32_t k = stripe_count(size, nqps);
      ASSERT_GE(k, 1u);
      ASSERT_LE(k, nqps);
      // One stripe below two minimum stripes; all QPs from nqps minimum stripes on.
      EXPECT_EQ(k, std::min<uint64_t>(nqps, std::max<uint64_t>(1, size / kMinStripeBytes)))
          << size << " on " << nqps;
      uint64_t next = 0;
      for (uint32_t i = 0; i < k; ++i) {
        uint64_t off = 0, len = 0;
        stripe_range(size, k, i, &off, &len);
        EXPECT_EQ(off, next) << "stripe " << i << " of " << size;
        if (size > 0) {
          EXPECT_GT(len, 0u) << "stripe " << i << " of " << size << " is empty";
        }
        if (i + 1 < k) {
          EXPECT_EQ(off % 4096, 0u);
        }
        next = off + len;
      }
      EXPECT_EQ(next, size) << size << " on " << nqps;
    }
  }
}

TEST(IbWire, ImmediateCarriesEntryAndStripes) {
  using namespace dq::net::ibwire;
  for (uint32_t idx : {0u, 1u, 511u}) {
    for (uint32_t k = 1; k <= kMaxQps; ++k) {
      const uint32_t imm = stripe_imm(idx, k);
      EXPECT_EQ(imm_index(imm), idx);
      EXPECT_EQ(imm_stripes(imm), k);
    }
  }
}

TEST(IbWire, AnEntryCompletesWhenEveryStripeArrivedOnce) {
  // Every arrival order of 4 stripes completes on the last one, not before.
  uint32_t order[4] = {0, 1, 2, 3};
  do {
    StripeTracker t;
    for (int j = 0; j < 4; ++j) {
      bool complete = true;
      ASSERT_EQ(t.take(order[j], 4, 8, &complete), nullptr);
      EXPECT_EQ(complete, j == 3);
    }
  } while (std::next_permutation(order, order + 4));
  StripeTracker one;
  bool complete = false;
  ASSERT_EQ(one.take(0, 1, 1, &complete), nullptr);
  EXPECT_TRUE(complete);
  // Refused: the same QP twice, a count that changes, a QP past the count, a count past the
  // connection's QPs or zero.
  StripeTracker t;
  ASSERT_EQ(t.take(1, 3, 4, &complete), nullptr);
  EXPECT_STREQ(t.take(1, 3, 4, &complete), "a second stripe from the same QP");
  EXPECT_STREQ(t.take(0, 2, 4, &complete), "stripe count differs between stripes");
  EXPECT_STREQ(t.take(3, 3, 4, &complete), "a stripe on a QP past the stripe count");
  StripeTracker u;
  EXPECT_STREQ(u.take(0, 5, 4, &complete), "stripe count out of range");
  EXPECT_STREQ(u.take(0, 0, 4, &complete), "stripe count out of range");
  EXPECT_FALSE(complete);
}

}  // namespace

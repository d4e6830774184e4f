// The verbs FIFO's check word (plugin/ibverbs/ib_wire.h): a sender must never act on a slot whose
// bytes mix two postings, whatever order the RDMA WRITE's bytes land in (soft-RoCE's kernel
// memcpy may copy backwards, so the new seq can land before the entries it announces; that was
// the 4-rank rdma all-reduce's wrong results and stray immediates).
#include <gtest/gtest.h>

#include <cstring>
#include <random>

#include "plugin/ibverbs/ib_wire.h"

namespace {

using dq::net::ibwire::FifoSlot;
using dq::net::ibwire::kSlotCheckedWords;
using dq::net::ibwire::SlotCheck;
constexpr size_t kWords = sizeof(FifoSlot) / 8;

// A posting as the receiver writes it: n receives of one tag at neighbouring addresses.
FifoSlot Posting(uint64_t seq, uint32_t n, uint64_t base, int tag) {
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
  s.check = SlotCheck(reinterpret_cast<const uint64_t*>(&s), kSlotCheckedWords);
  return s;
}

bool Matches(const FifoSlot& s) {
  return SlotCheck(reinterpret_cast<const uint64_t*>(&s), kSlotCheckedWords) == s.check;
}

TEST(IbWire, CompletePostingsMatch) {
  EXPECT_TRUE(Matches(Posting(1, 1, 0x7f0000001000, 0)));
  EXPECT_TRUE(Matches(Posting(977, 8, 0x7f0000200000, -3)));
}

// Every state a copy of the new posting over the old one passes through, forwards or backwards,
// one 8-byte word at a time: only the finished copy matches.
TEST(IbWire, EveryPartlyWrittenSlotIsRefused) {
  std::mt19937_64 rng(7);
  for (int trial = 0; trial < 200; ++trial) {
    const uint64_t seq = 1 + rng() % 100000;
    const FifoSlot old_slot = Posting(seq, 1 + rng() % 8, rng() & ~0xfffull, 0);
    // The same slot's next posting: often the same tag and count, only the buffer differs.
    const FifoSlot new_slot = Posting(seq + 1 + rng() % 64, trial % 2 ? old_slot.n : 1 + rng() % 8,
                                      rng() & ~0xfffull, 0);
    uint64_t o[kWords], w[kWords];
    std::memcpy(o, &old_slot, sizeof(o));
    std::memcpy(w, &new_slot, sizeof(w));
    for (size_t k = 0; k < kWords; ++k) {
      uint64_t fwd[kWords], bwd[kWords];
      for (size_t i = 0; i < kWords; ++i) {
        fwd[i] = i < k ? w[i] : o[i];             // first k words landed
        bwd[i] = i >= kWords - k ? w[i] : o[i];  // last k words landed
      }
      FifoSlot f, b;
      std::memcpy(&f, fwd, sizeof(f));
      std::memcpy(&b, bwd, sizeof(b));
      // k words of kWords: never the whole posting, and the old one only when k = 0.
      EXPECT_EQ(Matches(f), k == 0) << "trial " << trial << ", " << k << " words forwards";
      EXPECT_EQ(Matches(b), k == 0) << "trial " << trial << ", " << k << " words backwards";
    }
  }
}

TEST(IbWire, ACorruptedWordIsRefused) {
  const FifoSlot s = Posting(42, 3, 0x7f0000001000, 5);
  for (size_t i = 0; i < kWords; ++i) {
    for (int bit = 0; bit < 64; bit += 13) {
      FifoSlot t = s;
      reinterpret_cast<uint64_t*>(&t)[i] ^= 1ull << bit;
      EXPECT_FALSE(Matches(t)) << "word " << i << " bit " << bit;
    }
  }
}

}  // namespace

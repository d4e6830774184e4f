// The socket backend's checks of what a peer sends (plugin/socket/socket_parse.h), without
// sockets. Regression found by the libFuzzer target tests/fuzz/fuzz_net_frames: a part sent twice
// for one message was accepted, so the message completed with another part never written.
#include <gtest/gtest.h>

#include "plugin/socket/socket_parse.h"

namespace dq::net::wire {
namespace {

TEST(SocketParse, APartArrivesOnce) {
  const uint64_t size = 3 * kMinStripeBytes + 5;
  const Split split = split_message(size, 3);
  ASSERT_EQ(split.parts, 3);
  const PartHeader p1{kPartMagic, 1, 0, split.offset(1), split.len(1, size)};
  uint32_t seen = 1;  // part 0 came with the message header
  ASSERT_TRUE(part_header_valid(p1, 1));
  ASSERT_TRUE(part_matches(p1, 1, split, size, seen));
  seen |= 1u << 1;
  EXPECT_FALSE(part_matches(p1, 1, split, size, seen)) << "the same part twice";
  const PartHeader p2{kPartMagic, 2, 0, split.offset(2), split.len(2, size)};
  EXPECT_TRUE(part_matches(p2, 2, split, size, seen));
}

TEST(SocketParse, PartsMustBeTheSplitsOwn) {
  const uint64_t size = 2 * kMinStripeBytes;
  const Split split = split_message(size, 2);
  const PartHeader shifted{kPartMagic, 1, 0, split.offset(1) - 1, split.len(1, size)};
  EXPECT_FALSE(part_matches(shifted, 1, split, size, 1));
  const PartHeader beyond{kPartMagic, 2, 0, split.offset(1), split.len(1, size)};
  EXPECT_FALSE(part_matches(beyond, 2, split, size, 1)) << "no part 2 in a 2-part message";
  EXPECT_FALSE(part_header_valid(PartHeader{kMsgMagic, 1, 0, 0, 0}, 1));
  EXPECT_FALSE(part_header_valid(PartHeader{kPartMagic, 2, 0, 0, 0}, 1));
}

TEST(SocketParse, HeadersAndHellos) {
  EXPECT_EQ(check_msg_header(MsgHeader{kMsgMagic, 1, 0, 10}, 0), MsgCheck::kOk);
  EXPECT_EQ(check_msg_header(MsgHeader{kMsgMagic, 1, 1, 10}, 0), MsgCheck::kBadSeq);
  EXPECT_EQ(check_msg_header(MsgHeader{kMsgMagic, 1, 0, kMaxMessageBytes + 1}, 0),
            MsgCheck::kTooLarge);
  EXPECT_EQ(check_msg_header(MsgHeader{0, 1, 0, 10}, 0), MsgCheck::kBadMagic);
  const Hello ok{kHelloMagic, kVersion, 0, 2, kHelloHasCommId, 0, 7, 9, 1};
  EXPECT_EQ(check_hello(ok, 7, true, 9), HelloCheck::kOk);
  EXPECT_EQ(check_hello(ok, 8, true, 9), HelloCheck::kWrongSecret);
  EXPECT_EQ(check_hello(ok, 7, true, 10), HelloCheck::kWrongCommId);
  Hello bad = ok;
  bad.sock_index = 2;
  EXPECT_EQ(check_hello(bad, 7, true, 9), HelloCheck::kBadSocket);
  std::vector<PendingGroup> groups;
  EXPECT_TRUE(join_group(&groups, ok, "peer", 10));
  EXPECT_FALSE(join_group(&groups, ok, "peer", 11)) << "socket 0 of this connection twice";
  Hello other = ok;
  other.sock_index = 1;
  other.nsocks = 3;
  EXPECT_FALSE(join_group(&groups, other, "peer", 12)) << "the group announced 2 sockets";
}

}  // namespace
}  // namespace dq::net::wire

// A payload that fails validation leaves the caller's output untouched (the error contract of
// docs/ENGINE.md section 4: never a silent wrong result): finish()
// checks a whole chunk before it writes anything.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "kernels/codec.h"

namespace dq {
namespace {

TEST(Finish, AMalformedPayloadLeavesTheOutputUntouched) {
  constexpr size_t kCount = 64 * 1024;  // 256 super-groups, one chunk
  std::string error;
  auto c = make_codec("dynamiq:5", &error);
  ASSERT_TRUE(c) << error;
  ASSERT_EQ(c->plan(kCount, 1, 1), Status::kOk);
  std::vector<float> x(kCount);
  for (size_t i = 0; i < kCount; ++i)
    x[i] = static_cast<float>(std::sin(0.01 * i) * (1 + (i / 4096) % 7));  // several widths
  std::vector<uint16_t> stats(c->stats_words());
  ASSERT_EQ(c->local_stats(ConstTensor{x.data(), DType::kF32, kCount}, stats.data()), Status::kOk);
  ASSERT_EQ(c->agree(stats.data(), 0), Status::kOk);
  std::vector<uint8_t> payload(c->chunk_capacity());
  RoundingKey key;
  ASSERT_EQ(c->hop(0, ConstTensor{x.data(), DType::kF32, kCount}, nullptr, 0, payload.data(), key),
            Status::kOk);
  // Control: the payload decodes.
  std::vector<float> out(kCount, -7.0f);
  ASSERT_EQ(c->finish(0, ByteView{payload.data(), payload.size()}, out.data(), DType::kF32,
                      ReduceOp::kSum, 1),
            Status::kOk);
  // 300 all-ones bytes late in the body (more than one record: at least one all-ones code, invalid
  // at widths 2, 4 and 8), after most of the output would have been written.
  std::vector<uint8_t> bad = payload;
  std::memset(bad.data() + bad.size() * 3 / 4, 0xFF, 300);
  std::vector<float> untouched(kCount, -7.0f);
  EXPECT_EQ(c->finish(0, ByteView{bad.data(), bad.size()}, untouched.data(), DType::kF32,
                      ReduceOp::kSum, 1),
            Status::kMalformedPayload);
  for (size_t i = 0; i < kCount; ++i) ASSERT_EQ(untouched[i], -7.0f) << "element " << i;
}

}  // namespace
}  // namespace dq

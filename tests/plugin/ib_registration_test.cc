// The verbs backend's registrations and PCIe relaxed ordering, over fake verbs in this process
// (fake_verbs_objects.h): in mode 2 only a registration the device refuses with relaxed ordering
// and takes without it turns relaxed ordering off; a region that fails either way leaves it on.
#include <gtest/gtest.h>

#include <cerrno>
#include <cstdint>

#include "plugin/ibverbs/ib_internal.h"
#include "tests/plugin/fake_verbs_objects.h"

namespace dq::net::ib {
namespace {

// Calls of the fake ibv_reg_mr_iova2, and whether it refuses relaxed ordering (EINVAL, as a
// device without it) or every registration (ENOMEM, as a region that cannot be pinned).
int g_iova2_calls = 0;
int g_iova2_errno = EINVAL;

ibv_mr* refusing_reg_mr_iova2(ibv_pd*, void*, size_t, uint64_t, unsigned access) {
  ++g_iova2_calls;
  EXPECT_NE(access & IBV_ACCESS_RELAXED_ORDERING, 0u) << "called without relaxed ordering";
  errno = g_iova2_errno;
  return nullptr;
}

class IbRegistrationTest : public ::testing::Test {
 protected:
  void SetUp() override {
    fake_verbs::install(&ctx_, &pd_, &dev_);
    verbs().reg_mr_iova2 = refusing_reg_mr_iova2;
    g_iova2_calls = 0;
    mrs_before_ = fake_verbs::live().mrs;
  }
  void TearDown() override {
    fake_verbs::registrations_before_failure() = -1;
    verbs().reg_mr_iova2 = nullptr;
    set_relaxed_ordering(0);
    EXPECT_EQ(fake_verbs::live().mrs, mrs_before_);
  }

  ibv_context ctx_{};
  ibv_pd pd_{};
  IbDevice dev_;
  char buffer_[256] = {};
  int mrs_before_ = 0;
};

TEST_F(IbRegistrationTest, ARefusalOfRelaxedOrderingTurnsItOffInMode2) {
  set_relaxed_ordering(2);
  ASSERT_EQ(relaxed_ordering_access(), IBV_ACCESS_RELAXED_ORDERING);
  g_iova2_errno = EINVAL;
  ibv_mr* first = nullptr;
  ASSERT_EQ(register_bytes(&pd_, buffer_, sizeof(buffer_), &first), Status::kOk);
  ASSERT_NE(first, nullptr);
  EXPECT_EQ(g_iova2_calls, 1);
  EXPECT_EQ(relaxed_ordering_access(), 0);
  ibv_mr* second = nullptr;  // made without relaxed ordering at once
  ASSERT_EQ(register_bytes(&pd_, buffer_, sizeof(buffer_), &second), Status::kOk);
  EXPECT_EQ(g_iova2_calls, 1);
  verbs().dereg_mr(first);
  verbs().dereg_mr(second);
}

// A region that fails with and without relaxed ordering: the registration fails, and relaxed
// ordering stays on for the next (it turned off for the rest of the process before).
TEST_F(IbRegistrationTest, ARegionThatFailsEitherWayLeavesRelaxedOrderingOn) {
  set_relaxed_ordering(2);
  g_iova2_errno = ENOMEM;
  fake_verbs::registrations_before_failure() = 0;
  ibv_mr* mr = nullptr;
  EXPECT_EQ(register_bytes(&pd_, buffer_, sizeof(buffer_), &mr), Status::kSystemError);
  EXPECT_EQ(mr, nullptr);
  EXPECT_EQ(relaxed_ordering_access(), IBV_ACCESS_RELAXED_ORDERING);
}

// Mode 1: relaxed ordering is required, so its refusal fails the registration, without a retry.
TEST_F(IbRegistrationTest, Mode1NeverRetriesWithoutRelaxedOrdering) {
  set_relaxed_ordering(1);
  g_iova2_errno = EINVAL;
  const int mrs = fake_verbs::live().mrs;
  ibv_mr* mr = nullptr;
  EXPECT_EQ(register_bytes(&pd_, buffer_, sizeof(buffer_), &mr), Status::kSystemError);
  EXPECT_EQ(mr, nullptr);
  EXPECT_EQ(fake_verbs::live().mrs, mrs);
  EXPECT_EQ(relaxed_ordering_access(), IBV_ACCESS_RELAXED_ORDERING);
}

}  // namespace
}  // namespace dq::net::ib

// The host device's streams, events, error word and audit, on their own.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <thread>

#include "shim/engine/device.h"

namespace dq::engine {
namespace {

struct Streams {
  Device* d;
  StreamHandle a = nullptr, b = nullptr;
  EventHandle e = nullptr;
  uint32_t* error = nullptr;
  explicit Streams(Device* device) : d(device) {
    EXPECT_EQ(d->create_stream(&a), Status::kOk);
    EXPECT_EQ(d->create_stream(&b), Status::kOk);
    EXPECT_EQ(d->create_event(&e), Status::kOk);
    void* w = nullptr;
    EXPECT_EQ(d->alloc_mapped(4, &w), Status::kOk);
    error = static_cast<uint32_t*>(w);
    *error = 0;
  }
  ~Streams() {
    d->destroy_stream(a);
    d->destroy_stream(b);
    d->destroy_event(e);
    d->release(error, nullptr);
  }
};

TEST(HostDevice, WorkOnAStreamRunsInOrderAndAnotherStreamWaitsOnItsEvent) {
  Device* d = host_device();
  Streams s(d);
  std::atomic<int> step{0};
  int seen_by_b = -1;
  // Stream a: a slow step, then the event; stream b waits for the event, then reads `step`.
  ASSERT_EQ(d->nccl({s.a, s.error},
                    [&] {
                      std::this_thread::sleep_for(std::chrono::milliseconds(50));
                      step = 1;
                      return ncclSuccess;
                    }),
            Status::kOk);
  ASSERT_EQ(d->record(s.e, s.a), Status::kOk);
  ASSERT_EQ(d->wait(s.b, s.e), Status::kOk);
  ASSERT_EQ(d->nccl({s.b, s.error},
                    [&] {
                      seen_by_b = step.load();
                      return ncclSuccess;
                    }),
            Status::kOk);
  ASSERT_EQ(d->record(s.e, s.b), Status::kOk);
  ASSERT_EQ(d->synchronize(s.e), Status::kOk);
  EXPECT_EQ(seen_by_b, 1);
  EXPECT_EQ(*s.error, 0u);
}

TEST(HostDevice, AFailedStepSetsTheErrorWordAndLaterStepsAreSkipped) {
  Device* d = host_device();
  Streams s(d);
  bool later_ran = false;
  ASSERT_EQ(d->nccl({s.a, s.error}, [] { return ncclRemoteError; }), Status::kOk);
  ASSERT_EQ(d->nccl({s.a, s.error},
                    [&] {
                      later_ran = true;
                      return ncclSuccess;
                    }),
            Status::kOk);
  ASSERT_EQ(d->record(s.e, s.a), Status::kOk);  // records still complete
  ASSERT_EQ(d->synchronize(s.e), Status::kOk);
  EXPECT_FALSE(later_ran);
  EXPECT_EQ(error_source(*s.error), ErrorSource::kNccl);
  EXPECT_EQ(error_code(*s.error), static_cast<int>(ncclRemoteError));
}

TEST(HostDevice, TheAuditCountsAHostReadBetweenAnEnqueueAndTheNextWait) {
  std::unique_ptr<Device> d = make_audited_host_device();
  Streams s(d.get());
  void* p = nullptr;
  ASSERT_EQ(d->alloc(4096, &p), Status::kOk);
  auto* words = static_cast<volatile uint32_t*>(p);
  words[0] = 7;
  const uint64_t before = audited_host_accesses(d.get());
  ASSERT_EQ(d->copy(static_cast<uint8_t*>(p) + 8, p, 4, {s.a, s.error}), Status::kOk);
  EXPECT_EQ(words[0], 7u);  // a host read inside the "call": counted
  EXPECT_EQ(audited_host_accesses(d.get()), before + 1);
  ASSERT_EQ(d->record(s.e, s.a), Status::kOk);
  ASSERT_EQ(d->synchronize(s.e), Status::kOk);
  EXPECT_EQ(words[2], 7u);  // after the wait: allowed, and the queued copy has run
  EXPECT_EQ(audited_host_accesses(d.get()), before + 1);
  d->release(p, nullptr);
}

}  // namespace
}  // namespace dq::engine

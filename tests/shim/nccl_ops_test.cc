// NcclOps::settled(): how the engine and the shim wait for a non-blocking communicator's call.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>

#include "shim/engine/nccl_ops.h"

namespace {

using dq::engine::NcclOps;

// The communicator's state as ncclCommGetAsyncError answers it: ncclInProgress for `polls_left`
// polls, then `final_state`; `query` is what the call itself returns.
int polls_left = 0;
int polls = 0;
ncclResult_t final_state = ncclSuccess;
ncclResult_t query = ncclSuccess;

ncclResult_t fake_async_error(ncclComm_t, ncclResult_t* state) {
  ++polls;
  if (query != ncclSuccess) return query;
  *state = polls_left > 0 ? ncclInProgress : final_state;
  if (polls_left > 0) --polls_left;
  return ncclSuccess;
}

NcclOps ops_polling(int in_progress_polls, ncclResult_t state) {
  polls_left = in_progress_polls;
  polls = 0;
  final_state = state;
  query = ncclSuccess;
  NcclOps ops;
  ops.comm_get_async_error = fake_async_error;
  return ops;
}

TEST(NcclOpsSettled, AnythingButInProgressIsTheAnswer) {
  const NcclOps ops = ops_polling(5, ncclSuccess);
  EXPECT_EQ(ops.settled(nullptr, ncclSuccess, 1000), ncclSuccess);
  EXPECT_EQ(ops.settled(nullptr, ncclInvalidUsage, 1000), ncclInvalidUsage);
  EXPECT_EQ(polls, 0);
  // A blocking NCCL (no ncclCommGetAsyncError in the table): what it returned.
  EXPECT_EQ(NcclOps{}.settled(nullptr, ncclInProgress, 1000), ncclInProgress);
}

TEST(NcclOpsSettled, InProgressIsPolledToItsState) {
  NcclOps ops = ops_polling(2500, ncclSuccess);
  EXPECT_EQ(ops.settled(nullptr, ncclInProgress, 60000), ncclSuccess);
  EXPECT_EQ(polls, 2501);
  ops = ops_polling(3, ncclRemoteError);
  EXPECT_EQ(ops.settled(nullptr, ncclInProgress, 60000), ncclRemoteError);
  ops = ops_polling(3, ncclSuccess);
  query = ncclInvalidArgument;  // the query itself failed
  EXPECT_EQ(ops.settled(nullptr, ncclInProgress, 60000), ncclInvalidArgument);
}

// A call that never settles: after the timeout a failure, never ncclInProgress (which the engine
// stored as the communicator's error and the shim's group end returned: the application, told to
// keep polling, polled for good).
TEST(NcclOpsSettled, AStuckCallFailsAfterTheTimeout) {
  const NcclOps ops = ops_polling(1 << 30, ncclSuccess);
  const auto start = std::chrono::steady_clock::now();
  const ncclResult_t r = ops.settled(nullptr, ncclInProgress, 50);
  const double waited_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(r, ncclRemoteError);
  EXPECT_GE(waited_ms, 50.0);
  EXPECT_LT(waited_ms, 10000.0);  // bounded (a loose limit: a loaded machine)
}

// An abort begun on another thread while a call is polled: the polling stops at the next poll
// (NVIDIA's abort frees the communicator being asked), with the engine's abort result, instead of
// going on until the timeout with the aborting thread's teardown waiting for it.
std::atomic<bool> aborted{false};
int abort_at_poll = 0;
ncclResult_t fake_async_error_then_abort(ncclComm_t comm, ncclResult_t* state) {
  if (polls + 1 == abort_at_poll) aborted = true;  // another thread's abort, during this poll
  return fake_async_error(comm, state);
}

TEST(NcclOpsSettled, AnAbortEndsThePolling) {
  NcclOps ops = ops_polling(1 << 30, ncclSuccess);
  ops.comm_get_async_error = fake_async_error_then_abort;
  ops.abort_flag = &aborted;
  abort_at_poll = 10;
  EXPECT_EQ(ops.settled(nullptr, ncclInProgress, 600000), ncclInvalidUsage);
  EXPECT_EQ(polls, 10);  // none after the abort began
  // Already aborted: the communicator is not asked at all.
  polls = 0;
  EXPECT_EQ(ops.settled(nullptr, ncclInProgress, 600000), ncclInvalidUsage);
  EXPECT_EQ(polls, 0);
  // A call that did not need polling is answered as NCCL answered it.
  EXPECT_EQ(ops.settled(nullptr, ncclSuccess, 600000), ncclSuccess);
  aborted = false;
}

}  // namespace

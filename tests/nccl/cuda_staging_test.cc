// The CPU NCCL's staging of CUDA device buffers (config/cuda_staging.h), in one
// process, by the driver DYNAMIQ_CPU_NCCL_CUDA_DRIVER names (meson registers this program once
// per case, each with its --gtest_filter):
// - NoDriver.*: a library that does not exist: unavailable with the reason, host buffers as before;
// - IncompleteDriver.*: a library without the driver's functions (libm): the same;
// - FakeDriver.*: tests/nccl/fake_cuda_driver.cc: classification, stream order, in-place overlap,
//   a CUDA error reported cleanly.
#include <dlfcn.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "config/cuda_staging.h"

namespace cuda = dq::staging;
using dq::Status;

namespace {

// Host buffers pass through: nothing staged, the same pointers, no error.
void expect_host_path(std::vector<float>* a, std::vector<float>* b) {
  cuda::Staging st;
  st.add(a->data(), a->size() * 4, true, false, nullptr);
  st.add(b->data(), b->size() * 4, false, true, nullptr);
  ASSERT_EQ(st.begin(), Status::kOk);
  EXPECT_FALSE(st.active());
  EXPECT_EQ(st.host(a->data()), a->data());
  EXPECT_EQ(st.host(b->data()), b->data());
  EXPECT_EQ(st.host(nullptr), nullptr);
  EXPECT_EQ(st.end(), Status::kOk);
  EXPECT_EQ(cuda::classify(a->data()), cuda::MemKind::kHost);
}

TEST(NoDriver, UnavailableWithTheReasonAndHostBuffersUnchanged) {
  std::string why;
  EXPECT_FALSE(cuda::available(&why));
  EXPECT_NE(why.find("cannot be loaded"), std::string::npos) << why;
  EXPECT_NE(why.find(std::getenv("DYNAMIQ_CPU_NCCL_CUDA_DRIVER")), std::string::npos) << why;
  std::vector<float> a(1000, 1.0f), b(1000, 0.0f);
  expect_host_path(&a, &b);
  // Any pointer at all is host memory (never dereferenced by the check).
  EXPECT_EQ(cuda::classify(reinterpret_cast<void*>(0x7f0000001000ull)), cuda::MemKind::kHost);
}

TEST(IncompleteDriver, UnavailableWithTheMissingFunction) {
  std::string why;
  EXPECT_FALSE(cuda::available(&why));
  EXPECT_NE(why.find("lacks cuPointerGetAttribute"), std::string::npos) << why;
  std::vector<float> a(10, 1.0f), b(10, 0.0f);
  expect_host_path(&a, &b);
}

struct Fake {
  void (*init)();
  void* (*malloc)(size_t);
  void* (*stream_create)();
  int (*write_async)(void*, const void*, size_t, void*);
  int (*read_now)(void*, const void*, size_t);
  void (*counts)(unsigned long long*);
  int (*begin_capture)(void*);
  int (*end_capture)();
};

Fake fake() {
  void* h = dlopen(std::getenv("DYNAMIQ_CPU_NCCL_CUDA_DRIVER"), RTLD_NOW | RTLD_LOCAL);
  EXPECT_NE(h, nullptr) << dlerror();
  Fake f{};
  if (h == nullptr) return f;
  f.init = reinterpret_cast<void (*)()>(dlsym(h, "fakeCudaInit"));
  f.malloc = reinterpret_cast<void* (*)(size_t)>(dlsym(h, "fakeCudaMalloc"));
  f.stream_create = reinterpret_cast<void* (*)()>(dlsym(h, "fakeCudaStreamCreate"));
  f.write_async =
      reinterpret_cast<int (*)(void*, const void*, size_t, void*)>(dlsym(h, "fakeCudaWriteAsync"));
  f.read_now = reinterpret_cast<int (*)(void*, const void*, size_t)>(dlsym(h, "fakeCudaReadNow"));
  f.counts = reinterpret_cast<void (*)(unsigned long long*)>(dlsym(h, "fakeCudaCounts"));
  f.begin_capture = reinterpret_cast<int (*)(void*)>(dlsym(h, "fakeCudaBeginCapture"));
  f.end_capture = reinterpret_cast<int (*)()>(dlsym(h, "fakeCudaEndCapture"));
  return f;
}

TEST(FakeDriver, ClassifiesOnlyOnceCudaIsInitialised) {
  ASSERT_TRUE(cuda::available());
  Fake f = fake();
  ASSERT_NE(f.init, nullptr);
  void* d = f.malloc(4096);
  std::vector<float> a(8), b(8);
  // The CPU NCCL never calls cuInit: before the program initialised CUDA, nothing is device.
  EXPECT_EQ(cuda::classify(d), cuda::MemKind::kHost);
  f.init();
  EXPECT_EQ(cuda::classify(d), cuda::MemKind::kDevice);
  EXPECT_EQ(cuda::classify(static_cast<char*>(d) + 100), cuda::MemKind::kDevice);
  expect_host_path(&a, &b);
}

TEST(FakeDriver, CopiesInAfterTheStreamsWorkAndBackBeforeReturning) {
  Fake f = fake();
  f.init();
  void* stream = f.stream_create();
  auto* d = static_cast<float*>(f.malloc(1024 * 4));
  std::vector<float> v(1024);
  for (int i = 0; i < 1024; ++i) v[i] = static_cast<float>(i);
  ASSERT_EQ(f.write_async(d, v.data(), v.size() * 4, stream), 0);  // lands at synchronisation
  cuda::Staging st;
  st.add(d, 1024 * 4, true, true, stream);
  ASSERT_EQ(st.begin(), Status::kOk) << st.error();
  ASSERT_TRUE(st.active());
  auto* h = static_cast<float*>(st.host(d));
  ASSERT_NE(static_cast<void*>(h), static_cast<void*>(d));
  for (int i = 0; i < 1024; ++i) ASSERT_EQ(h[i], static_cast<float>(i)) << i;
  for (int i = 0; i < 1024; ++i) h[i] = -h[i];
  ASSERT_EQ(st.end(), Status::kOk) << st.error();
  std::vector<float> back(1024);
  ASSERT_EQ(f.read_now(back.data(), d, back.size() * 4), 0);  // nothing left pending
  for (int i = 0; i < 1024; ++i) ASSERT_EQ(back[i], -static_cast<float>(i)) << i;
}

TEST(FakeDriver, InPlaceBuffersShareOneHostCopyAndReadOnlyOnesAreNotWrittenBack) {
  Fake f = fake();
  f.init();
  auto* recv = static_cast<char*>(f.malloc(4096));
  auto* other = static_cast<char*>(f.malloc(64));
  std::vector<char> ones(4096, 1), twos(64, 2);
  ASSERT_EQ(f.write_async(recv, ones.data(), 4096, nullptr), 0);
  ASSERT_EQ(f.write_async(other, twos.data(), 64, nullptr), 0);
  unsigned long long before[4], after[4];
  f.counts(before);
  cuda::Staging st;
  st.add(recv + 1024, 1024, true, false, nullptr);  // the send slice (all-gather in place)
  st.add(recv, 4096, false, true, nullptr);
  st.add(other, 64, true, false, nullptr);
  ASSERT_EQ(st.begin(), Status::kOk) << st.error();
  char* h = static_cast<char*>(st.host(recv));
  EXPECT_EQ(st.host(recv + 1024), h + 1024);
  EXPECT_EQ(static_cast<char*>(st.host(other))[0], 2);
  EXPECT_EQ(h[4095], 1);
  h[0] = 9;
  static_cast<char*>(st.host(other))[0] = 9;  // read-only: must not reach the device
  ASSERT_EQ(st.end(), Status::kOk);
  f.counts(after);
  EXPECT_EQ(after[0] - before[0], 2u);  // two regions copied in
  EXPECT_EQ(after[1] - before[1], 1u);  // one copied back
  char c = 0;
  f.read_now(&c, recv, 1);
  EXPECT_EQ(c, 9);
  f.read_now(&c, other, 1);
  EXPECT_EQ(c, 2);
}

// A buffer on a stream being captured: refused before the stream is touched, so the
// application's capture stays intact (a synchronisation would invalidate it, as the fake driver
// shows on its own); a stream not captured is staged as before.
TEST(FakeDriver, AStreamBeingCapturedIsRefusedAndTheCaptureKept) {
  Fake f = fake();
  f.init();
  void* stream = f.stream_create();
  auto* d = static_cast<float*>(f.malloc(256 * 4));
  ASSERT_EQ(f.begin_capture(stream), 0);
  {
    cuda::Staging st;
    st.add(d, 256 * 4, true, true, stream);
    EXPECT_EQ(st.begin(), Status::kInvalidArgument);
    EXPECT_NE(st.error().find("captured"), std::string::npos) << st.error();
    EXPECT_FALSE(st.active());
  }
  EXPECT_EQ(f.end_capture(), 0) << "the staging invalidated the capture";
  // Another stream during the capture: staged as usual, the capture intact.
  ASSERT_EQ(f.begin_capture(stream), 0);
  {
    cuda::Staging st;
    st.add(d, 256 * 4, true, true, f.stream_create());  // another stream: staged
    ASSERT_EQ(st.begin(), Status::kOk) << st.error();
    ASSERT_EQ(st.end(), Status::kOk) << st.error();
  }
  EXPECT_EQ(f.end_capture(), 0);
  // The legacy stream during another stream's capture (global mode): asking whether it captures
  // fails (CUDA_ERROR_STREAM_CAPTURE_IMPLICIT), so the staging refuses it without synchronising
  // it, which would have invalidated the capture.
  for (void* legacy : {static_cast<void*>(nullptr), reinterpret_cast<void*>(uintptr_t{1})}) {
    ASSERT_EQ(f.begin_capture(stream), 0);
    {
      cuda::Staging st;
      st.add(d, 256 * 4, true, true, legacy);
      EXPECT_EQ(st.begin(), Status::kInvalidArgument);
      EXPECT_NE(st.error().find("906"), std::string::npos) << st.error();
      EXPECT_FALSE(st.active());
    }
    EXPECT_EQ(f.end_capture(), 0) << "the staging invalidated the capture";
  }
}

TEST(FakeDriver, ACudaErrorIsReportedNotACrash) {
  Fake f = fake();
  f.init();
  auto* d = static_cast<char*>(f.malloc(64));
  cuda::Staging st;
  st.add(d, size_t{1} << 31, true, true, nullptr);  // past the end of the allocation
  EXPECT_EQ(st.begin(), Status::kSystemError);
  EXPECT_NE(st.error().find("CUDA_ERROR_INVALID_VALUE"), std::string::npos) << st.error();
  EXPECT_FALSE(st.active());
  EXPECT_EQ(st.host(d), d);
}

}  // namespace

// The real CUDA device (shim/engine/cuda_device_gpu.cu). Usage: cuda_device_gpu_test MODE.
//   unavailable  (suite unit, runs anywhere) Without a driver (this machine, CI; or with
//                DQ_TEST_CUDA_DRIVER_LIB naming a library that does not exist) the device is
//                unavailable with a reason, nothing crashes, and classifying a pointer answers
//                kUnknown/kInaccessible with a reason. With a driver and a GPU it must be
//                available.
//   steps        (suite gpu; exit 77 without a device, with the reason) The engine's codec steps on
//                the GPU against the host codec byte for byte: run_canary (statistics, layout, two
//                leaf hops and a 2-input fused hop per chunk, finish; every output and its inputs
//                compared) for several DynamiQ option sets, on the device's own stream and again
//                on a second stream (the level tables uploaded once, waited for there); then the
//                error word: a malformed input makes the hop's kernels set it with the host
//                device's encoding (kCodec, kMalformedPayload), the finish after it writes nothing,
//                and an enqueue returns without waiting for the device; the bounded wait
//                (synchronize_for) gives up at its bound on a stream held by a host function; the
//                device's calls leave a thread's CUDA context as they found it (none included);
//                its event calls and bounded waits work while another thread captures a graph in
//                global mode, and leave that capture intact.
// Exit 0 pass, 77 skip, other: the failing check.
#include <cuda_runtime.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "kernels/codec.h"
#include "shim/engine/cuda_context.h"
#include "shim/engine/cuda_device_gpu.h"
#include "shim/engine/engine.h"
#include "tests/common/check.h"

namespace {

// A codec spec the test names as text, parsed (the engine takes CodecSpec values); an invalid
// one ends the test.
dq::CodecSpec spec_of(const char* text) {
  dq::CodecSpec spec;
  std::string why;
  if (!dq::parse_codec_spec(text, &spec, &why)) {
    std::fprintf(stderr, "codec spec %s: %s\n", text, why.c_str());
    std::exit(2);
  }
  return spec;
}

using dq::Status;
using dq::engine::CudaBuffer;
using dq::engine::Device;

int unavailable_check() {
  CHECK_OR(10, dq::engine::cuda_gpu_linked(), "the CUDA device is not linked into this test");
  const char* forced = std::getenv("DQ_TEST_CUDA_DRIVER_LIB");
  std::string why;
  Device* d = dq::engine::cuda_gpu_device(-1, &why);
  if (d != nullptr) {
    CHECK_OR(11, forced == nullptr, "a missing driver (%s) still gave a device", forced);
    std::printf("a CUDA device is available here (%s): nothing to check for its absence\n",
                d->name());
    return 0;
  }
  CHECK_OR(12, !why.empty(), "unavailable without a reason");
  if (forced != nullptr)
    CHECK_OR(13, why.find(forced) != std::string::npos, "reason does not name %s: %s", forced,
             why.c_str());
  // Asking twice gives the same answer (nothing half-initialised is kept).
  std::string again;
  CHECK_OR(14, dq::engine::cuda_gpu_device(0, &again) == nullptr && !again.empty(),
           "second ask: %s", again.c_str());
  std::vector<float> host(16, 1.0f);
  std::string cwhy;
  const CudaBuffer kind = dq::engine::cuda_gpu_classify(host.data(), -1, &cwhy);
  if (forced == nullptr)
    CHECK_OR(15, kind == CudaBuffer::kUnknown && !cwhy.empty(),
             "classify without a driver: kind %d, '%s'", static_cast<int>(kind), cwhy.c_str());
  CHECK_OR(16, kind != CudaBuffer::kDevice, "a host vector classified as device memory");
  std::printf("CUDA device unavailable, as expected: %s\nclassify: kind %d (%s)\n", why.c_str(),
              static_cast<int>(kind), cwhy.c_str());
  return 0;
}

// The bounded wait the engine uses with DYNAMIQ_TIMEOUT_MS: a stream held by a 400 ms host
// function stands for a peer that does not answer; synchronize_for gives up at its 50 ms bound,
// and finds the event complete once the stream moves on. 0, or the failed check's exit code.
int bounded_wait_check(Device* d, dq::engine::StreamHandle s1, dq::engine::EventHandle done) {
  const cudaHostFn_t hold = [](void*) {
    std::this_thread::sleep_for(std::chrono::milliseconds(400));
  };
  CHECK_OR(40,
           cudaLaunchHostFunc(static_cast<cudaStream_t>(s1), hold, nullptr) == cudaSuccess &&
               d->record(done, s1) == Status::kOk,
           "a host function on the stream");
  const auto w0 = std::chrono::steady_clock::now();
  const Status timed = d->synchronize_for(done, 50);
  const double waited_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - w0).count();
  CHECK_OR(41, timed == Status::kTimeout && waited_ms >= 50 && waited_ms < 390,
           "synchronize_for(50 ms) on a held stream: %s after %.1f ms", dq::status_name(timed),
           waited_ms);
  CHECK_OR(42, d->synchronize_for(done, 10000) == Status::kOk, "synchronize_for after the hold");
  return 0;
}

// Another thread captures a graph in global mode (PyTorch's default) while the engine's thread
// makes events, waits (synchronize_for, query) and records: CUDA refuses a query made in a
// thread's default mode during such a capture, failing the wait and invalidating the capture. The
// device's calls must work and the capture must end with its graph.
int capture_elsewhere_check(Device* d, dq::engine::StreamHandle s1) {
  cudaStream_t captured = nullptr;
  CHECK_OR(50, cudaStreamCreateWithFlags(&captured, cudaStreamNonBlocking) == cudaSuccess,
           "a stream to capture");
  std::atomic<int> phase{0};  // 1: capturing, 2: the device's calls are done
  cudaError_t begin = cudaErrorUnknown, end = cudaErrorUnknown;
  cudaGraph_t graph = nullptr;
  std::thread capturer([&] {
    begin = cudaStreamBeginCapture(captured, cudaStreamCaptureModeGlobal);
    phase.store(1);
    for (int i = 0; i < 100000 && phase.load() != 2; ++i)
      std::this_thread::sleep_for(std::chrono::microseconds(100));  // at most 10 s
    end = cudaStreamEndCapture(captured, &graph);
  });
  for (int i = 0; i < 100000 && phase.load() != 1; ++i)
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  dq::engine::EventHandle e = nullptr;
  const bool made = d->create_event(&e) == Status::kOk;
  const bool recorded = made && d->record(e, s1) == Status::kOk;
  const Status waited = recorded ? d->synchronize_for(e, 5000) : Status::kInternal;
  const bool queried = recorded && d->query(e);
  if (made) d->destroy_event(e);
  phase.store(2);
  capturer.join();
  if (graph != nullptr) cudaGraphDestroy(graph);
  cudaStreamDestroy(captured);
  (void)cudaGetLastError();
  CHECK_OR(51, begin == cudaSuccess, "cudaStreamBeginCapture: %s", cudaGetErrorName(begin));
  CHECK_OR(52, made && recorded && waited == Status::kOk && queried,
           "the device's event calls during another thread's capture: made %d recorded %d, "
           "synchronize_for %s, query %d",
           made, recorded, dq::status_name(waited), queried);
  CHECK_OR(53, end == cudaSuccess && graph != nullptr,
           "the other thread's capture ended with %s (invalidated by the device's calls)",
           cudaGetErrorName(end));
  std::printf(
      "the device's waits during another thread's global-mode capture: fine, the capture "
      "intact\n");
  return 0;
}

// The device's calls leave the calling thread's CUDA context as they found it: none on a fresh
// thread (restored by device number instead, device 0's primary context would be made current
// there, and created on GPU 0 if the device is another), and the main thread's own.
int context_check(Device* d, dq::engine::StreamHandle s) {
  const dq::engine::cuda_context::Ops ops;
  auto touch = [&] {
    dq::engine::EventHandle e = nullptr;
    const bool ok = d->create_event(&e) == Status::kOk && d->record(e, s) == Status::kOk &&
                    d->synchronize(e) == Status::kOk;
    if (e != nullptr) d->destroy_event(e);
    return ok;
  };
  int rc = 0;
  std::thread fresh([&] {
    dq::engine::cuda_context::Context c = &rc;
    if (!ops.current(&c) || c != nullptr)
      rc = 40;  // a new thread has none
    else if (!touch())
      rc = 41;
    else if (!ops.current(&c) || c != nullptr)
      rc = 42;
  });
  fresh.join();
  CHECK_OR(rc, rc == 0, "a thread without a CUDA context: %s",
           rc == 40   ? "had one before any call"
           : rc == 41 ? "the device's calls failed"
                      : "has one after the device's calls");
  dq::engine::cuda_context::Context before = nullptr, after = nullptr;
  CHECK_OR(43, ops.current(&before) && touch() && ops.current(&after) && before == after,
           "the main thread's context changed across the device's calls");
  std::printf("the device's calls leave a thread's CUDA context as it was (none, or its own)\n");
  return 0;
}

int steps_check() {
  const char* specs[] = {"dynamiq:5",
                         "dynamiq:3",
                         "dynamiq:8",
                         "dynamiq:4:levels=uniform",
                         "dynamiq:5:scales=flat",
                         "dynamiq:6:corr=0",
                         "dynamiq:5:mean=0:w16=0"};
  // The host codec's canaries first (they run anywhere): every option set is a valid spec.
  for (const char* spec : specs) {
    const dq::engine::CanaryResult host =
        dq::engine::run_canary(dq::engine::host_device(), spec_of(spec), nullptr, 0x5eed);
    CHECK_OR(19, host.ran && !host.differs, "host device, %s: %s", spec,
             host.ran ? host.describe().c_str() : "not run (spec?)");
  }
  std::string why;
  Device* d = dq::engine::cuda_gpu_device(-1, &why);
  if (d == nullptr) {
    std::printf("SKIP: no CUDA device: %s\n", why.c_str());
    return 77;
  }
  CHECK_OR(20, d->needs_canary(), "the CUDA device must ask for the canary");
  dq::engine::StreamHandle s1 = nullptr, s2 = nullptr;
  CHECK_OR(21, d->create_stream(&s1) == Status::kOk && d->create_stream(&s2) == Status::kOk,
           "streams");
  int n = 0;
  for (const char* spec : specs) {
    for (dq::engine::StreamHandle s : {s1, s2}) {
      const dq::engine::CanaryResult r = dq::engine::run_canary(d, spec_of(spec), s, 0x5eed);
      CHECK_OR(23, r.ran && !r.differs, "%s, %s, stream %d: %s", d->name(), spec, s == s1 ? 1 : 2,
               r.ran ? r.describe().c_str() : "not run");
      ++n;
    }
    std::printf("%s: %s equals the host codec byte for byte (both streams)\n", spec, d->name());
  }
  // A codec without device steps fails its canary (the communicator then passes through).
  const dq::engine::CanaryResult mx = dq::engine::run_canary(d, spec_of("mxfp8"), s1, 0x5eed);
  CHECK_OR(24, mx.ran && mx.differs && mx.device_status == Status::kUnsupported,
           "mxfp8 on the CUDA device: %s", mx.describe().c_str());

  // The error word: a malformed hop input, then a finish that must write nothing.
  std::string err;
  std::unique_ptr<dq::Codec> codec = dq::make_codec("dynamiq:5", &err);
  const size_t count = 64 * 256 * 2;
  CHECK_OR(30, codec && codec->plan(count, 2, 2) == Status::kOk, "plan: %s", err.c_str());
  const size_t cap = codec->chunk_capacity(), words = codec->stats_words();
  const size_t layout_bytes = codec->layout_bytes();
  void *x = nullptr, *stats = nullptr, *layout = nullptr, *bad = nullptr, *out = nullptr,
       *finished = nullptr, *word = nullptr;
  CHECK_OR(31,
           d->alloc(count * 4, &x) == Status::kOk && d->alloc(words * 2, &stats) == Status::kOk &&
               d->alloc(layout_bytes, &layout) == Status::kOk &&
               d->alloc(cap, &bad) == Status::kOk && d->alloc(cap, &out) == Status::kOk &&
               d->alloc(count * 4, &finished) == Status::kOk &&
               d->alloc_mapped(4, &word) == Status::kOk,
           "allocations");
  auto* error = static_cast<uint32_t*>(word);
  *error = 0;
  const dq::engine::Lane lane{s1, error};
  std::vector<float> input(count);
  for (size_t i = 0; i < count; ++i) input[i] = static_cast<float>((i * 37) % 101) / 50.0f - 1.0f;
  const std::vector<uint8_t> garbage(cap, 0xa5);
  const std::vector<float> sentinel(count, 7.0f);
  dq::RoundingKey key;
  key.seed = 1;
  const dq::ConstTensor own{x, dq::DType::kF32, count};
  const dq::ByteView in[1] = {{static_cast<const uint8_t*>(bad), cap}};
  dq::engine::EventHandle done = nullptr;
  CHECK_OR(32, d->create_event(&done) == Status::kOk, "event");
  bool enqueued = d->copy(x, input.data(), count * 4, lane) == Status::kOk &&
                  d->copy(bad, garbage.data(), cap, lane) == Status::kOk &&
                  d->copy(finished, sentinel.data(), count * 4, lane) == Status::kOk &&
                  d->record(done, s1) == Status::kOk && d->synchronize(done) == Status::kOk;
  CHECK_OR(33, enqueued, "uploads");
  const std::unique_ptr<dq::engine::PreparedCodec> prepared = d->prepare(*codec);
  const auto t0 = std::chrono::steady_clock::now();
  enqueued = d->local_stats(*prepared, own, static_cast<uint16_t*>(stats), lane) == Status::kOk &&
             d->build_layout(*prepared, static_cast<const uint16_t*>(stats), 0, layout, lane) ==
                 Status::kOk &&
             d->hop(*prepared, layout, 0, own, in, 1, static_cast<uint8_t*>(out), key, lane) ==
                 Status::kOk &&
             d->finish(*prepared, layout, 0, in[0], finished, dq::DType::kF32, dq::ReduceOp::kSum,
                       2, lane) == Status::kOk;
  const double enqueue_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  CHECK_OR(34, enqueued, "the steps' enqueues failed (host-side checks?)");
  CHECK_OR(35, d->record(done, s1) == Status::kOk && d->synchronize(done) == Status::kOk, "sync");
  const uint32_t expected = dq::engine::error_word(dq::engine::ErrorSource::kCodec,
                                                   static_cast<int>(Status::kMalformedPayload));
  CHECK_OR(36, __atomic_load_n(error, __ATOMIC_ACQUIRE) == expected,
           "error word 0x%08x, expected 0x%08x (kCodec, kMalformedPayload)", *error, expected);
  std::vector<float> back(count, 0.0f);
  const dq::engine::Lane clean{s1, nullptr};
  CHECK_OR(37,
           d->copy(back.data(), finished, count * 4, clean) == Status::kOk &&
               d->record(done, s1) == Status::kOk && d->synchronize(done) == Status::kOk,
           "read back");
  CHECK_OR(38, std::memcmp(back.data(), sentinel.data(), count * 4) == 0,
           "the finish after a failed hop wrote the output");
  // Once set (seen by the host), a step enqueues nothing and succeeds, as on the host device.
  CHECK_OR(39,
           d->hop(*prepared, layout, 0, own, nullptr, 0, static_cast<uint8_t*>(out), key, lane) ==
               Status::kOk,
           "a step after the error");
  if (const int failed = bounded_wait_check(d, s1, done)) return failed;
  if (const int failed = context_check(d, s1)) return failed;
  if (const int failed = capture_elsewhere_check(d, s1)) return failed;
  d->destroy_event(done);
  for (void* p : {x, stats, layout, bad, out, finished}) d->release(p, s1);
  d->release(word, s1);
  d->destroy_stream(s1);
  d->destroy_stream(s2);
  std::printf(
      "%d canaries on %s equal the host codec; malformed input: error word 0x%08x, finish "
      "skipped; 4 steps enqueued in %.3f ms\n",
      n, d->name(), expected, enqueue_ms);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "unavailable") return unavailable_check();
  if (mode == "steps") return steps_check();
  std::fprintf(stderr, "usage: %s unavailable|steps\n", argv[0]);
  return 2;
}

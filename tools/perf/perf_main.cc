// dynamiq-perf: an nccl-tests-style benchmark and checker of ncclAllReduce, ncclReduceScatter and
// ncclReduce (-c) over the NCCL API.
// Only <nccl.h> comes from NCCL (and, through it, CUDA's type declarations); CUDA runtime
// calls are looked up with dlopen so the same binary runs with host buffers on a CPU NCCL and
// with device buffers on a GPU with the real NCCL.
#include <nccl.h>

#include <dlfcn.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "config/settings.h"
#include "tools/cli/cli.h"
#include "tools/perf/perf_check.h"
#include "tools/perf/perf_options.h"
#include "tools/run/rendezvous.h"

namespace dq::perf {
namespace {

constexpr int kExitUsage = 2;
constexpr int kExitFailed = 1;
constexpr size_t kHostSlotBytes = 128;  // per-rank "Using devices" line, gathered by max
constexpr unsigned char kSentinelByte = 0xA5;

ncclDataType_t nccl_type(DType t) {
  switch (t) {
    case DType::kInt8:
      return ncclInt8;
    case DType::kUint8:
      return ncclUint8;
    case DType::kInt32:
      return ncclInt32;
    case DType::kUint32:
      return ncclUint32;
    case DType::kInt64:
      return ncclInt64;
    case DType::kUint64:
      return ncclUint64;
    case DType::kFloat16:
      return ncclFloat16;
    case DType::kFloat32:
      return ncclFloat32;
    case DType::kFloat64:
      return ncclFloat64;
    case DType::kBfloat16:
      return ncclBfloat16;
    case DType::kFloat8e4m3:  // not offered by -d
    case DType::kFloat8e5m2:
    case DType::kCount:
      break;
  }
  return ncclFloat32;
}

ncclRedOp_t nccl_op(RedOp op) {
  switch (op) {
    case RedOp::kSum:
      return ncclSum;
    case RedOp::kProd:
      return ncclProd;
    case RedOp::kMax:
      return ncclMax;
    case RedOp::kMin:
      return ncclMin;
    case RedOp::kAvg:
      return ncclAvg;
    case RedOp::kCount:
      break;
  }
  return ncclSum;
}

int g_rank = 0;  // for messages only

Status nccl_ok(ncclResult_t result, const char* what, ncclComm_t comm) {
  if (result == ncclSuccess) return Status::kOk;
  const char* detail = ncclGetLastError(comm);
  std::fprintf(stderr, "dynamiq-perf: rank %d: %s failed: %s%s%s\n", g_rank, what,
               ncclGetErrorString(result), detail && *detail ? ": " : "", detail ? detail : "");
  return Status::kSystemError;
}

// ---- buffers: host memory, or device memory through a dlopen'ed CUDA runtime ----------------

// cudaError_t is an int-sized enum whose success value is 0; cudaMemcpyKind likewise.
struct CudaRuntime {
  int (*get_device_count)(int*) = nullptr;
  int (*set_device)(int) = nullptr;
  int (*malloc)(void**, size_t) = nullptr;
  int (*free)(void*) = nullptr;
  int (*memcpy)(void*, const void*, size_t, int) = nullptr;
  int (*memset)(void*, int, size_t) = nullptr;
  int (*stream_create)(cudaStream_t*) = nullptr;
  int (*stream_synchronize)(cudaStream_t) = nullptr;
  int (*stream_destroy)(cudaStream_t) = nullptr;
  const char* (*error_string)(int) = nullptr;
  int (*pci_bus_id)(char*, int, int) = nullptr;
};
constexpr int kCudaMemcpyHostToDevice = 1;
constexpr int kCudaMemcpyDeviceToHost = 2;

// True when a CUDA runtime loads and all entry points resolve.
bool load_cuda_runtime(CudaRuntime* rt) {
  void* lib = nullptr;
  for (const char* name : {"libcudart.so", "libcudart.so.13", "libcudart.so.12"}) {
    lib = dlopen(name, RTLD_NOW | RTLD_LOCAL);
    if (lib != nullptr) break;
  }
  if (lib == nullptr) return false;
  auto bind = [&](auto** fn, const char* symbol) {
    *fn = reinterpret_cast<std::remove_pointer_t<decltype(fn)>>(dlsym(lib, symbol));
    return *fn != nullptr;
  };
  return bind(&rt->get_device_count, "cudaGetDeviceCount") &&
         bind(&rt->set_device, "cudaSetDevice") && bind(&rt->malloc, "cudaMalloc") &&
         bind(&rt->free, "cudaFree") && bind(&rt->memcpy, "cudaMemcpy") &&
         bind(&rt->memset, "cudaMemset") && bind(&rt->stream_create, "cudaStreamCreate") &&
         bind(&rt->stream_synchronize, "cudaStreamSynchronize") &&
         bind(&rt->stream_destroy, "cudaStreamDestroy") &&
         bind(&rt->error_string, "cudaGetErrorString") &&
         bind(&rt->pci_bus_id, "cudaDeviceGetPCIBusId");
}

class Buffers {
 public:
  ~Buffers() {
    for (void* p : owned_) release(p);
    if (stream_ != nullptr) cuda_.stream_destroy(stream_);
  }

  Status init(Memory mode, int local_rank) {
    if (mode == Memory::kHost || (mode == Memory::kAuto && config::current().cpu_nccl)) {
      description_ = "host memory";
      return Status::kOk;
    }
    int devices = 0;
    const bool have_cuda = load_cuda_runtime(&cuda_) && cuda_.get_device_count(&devices) == 0;
    if (!have_cuda || devices < 1) {
      if (mode == Memory::kDevice)
        DQ_FAIL(Status::kUnsupported, "--memory device: no CUDA runtime with a device was found");
      description_ = "host memory";
      return Status::kOk;
    }
    device_ = local_rank % devices;
    DQ_CHECK(cuda_ok(cuda_.set_device(device_), "cudaSetDevice"));
    DQ_CHECK(cuda_ok(cuda_.stream_create(&stream_), "cudaStreamCreate"));
    char bus_id[32] = "?";
    cuda_.pci_bus_id(bus_id, sizeof bus_id, device_);
    description_ = std::string("device ") + std::to_string(device_) + " [" + bus_id + "]";
    on_device_ = true;
    return Status::kOk;
  }

  bool on_device() const { return on_device_; }
  const std::string& description() const { return description_; }
  cudaStream_t stream() const { return stream_; }

  Status alloc(size_t bytes, void** out) {
    bytes = std::max<size_t>(bytes, 64);
    if (on_device_) {
      DQ_CHECK(cuda_ok(cuda_.malloc(out, bytes), "cudaMalloc"));
    } else {
      *out = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
      if (*out == nullptr) DQ_FAIL(Status::kOutOfMemory, "cannot allocate %zu bytes", bytes);
    }
    owned_.push_back(*out);
    return Status::kOk;
  }

  Status upload(void* dst, const void* src, size_t bytes) {
    if (!on_device_) {
      if (dst != src && bytes) std::memcpy(dst, src, bytes);
      return Status::kOk;
    }
    return cuda_ok(cuda_.memcpy(dst, src, bytes, kCudaMemcpyHostToDevice), "cudaMemcpy H2D");
  }

  Status download(void* dst, const void* src, size_t bytes) {
    if (!on_device_) {
      if (dst != src && bytes) std::memcpy(dst, src, bytes);
      return Status::kOk;
    }
    return cuda_ok(cuda_.memcpy(dst, src, bytes, kCudaMemcpyDeviceToHost), "cudaMemcpy D2H");
  }

  Status fill(void* dst, unsigned char byte, size_t bytes) {
    if (!on_device_) {
      std::memset(dst, byte, bytes);
      return Status::kOk;
    }
    return cuda_ok(cuda_.memset(dst, byte, bytes), "cudaMemset");
  }

  // A CPU NCCL completes each call before returning; on a GPU the stream must drain.
  Status synchronize() {
    if (!on_device_) return Status::kOk;
    return cuda_ok(cuda_.stream_synchronize(stream_), "cudaStreamSynchronize");
  }

 private:
  void release(void* p) {
    if (on_device_)
      cuda_.free(p);
    else
      std::free(p);
  }

  Status cuda_ok(int err, const char* what) {
    if (err == 0) return Status::kOk;
    DQ_FAIL(Status::kSystemError, "%s failed: %s", what,
            cuda_.error_string ? cuda_.error_string(err) : "unknown CUDA error");
  }

  CudaRuntime cuda_;
  bool on_device_ = false;
  int device_ = -1;
  cudaStream_t stream_ = nullptr;
  std::string description_;
  std::vector<void*> owned_;
};

// ---- the benchmark --------------------------------------------------------------------------

struct Measured {
  double seconds = 0;     // per operation
  double wrong = 0;       // summed over ranks
  double nonfinite = 0;   // summed over ranks: non-finite results, and changed elements of a
                          // buffer that must stay untouched (ncclReduce's non-root receive buffer)
  double vnmse = 0;       // max over ranks
  bool identical = true;  // every rank's result bytes hash the same
  int compressed = -1;    // dynamiq preloaded: 1 when it compressed the checked calls, else 0
};

// dynamiq's counters when libdynamiq.so is preloaded (nullptr otherwise): which calls it
// compressed, so that those rows are judged as lossy results.
using CountersFn = int (*)(void*, unsigned long long*, unsigned long long*);
CountersFn dynamiq_counters() {
  static CountersFn fn = reinterpret_cast<CountersFn>(dlsym(RTLD_DEFAULT, "dynamiqCommCounters"));
  return fn;
}

class Bench {
 public:
  Bench(const PerfOptions& options, const rendezvous::JobEnv& job) : options_(options), job_(job) {}
  ~Bench() {
    if (comm_ != nullptr) ncclCommDestroy(comm_);
  }

  Status run(bool* all_good) {
    corrupt_this_rank_ = config::current().perf_corrupt_rank == job_.rank;
    DQ_CHECK(buffers_.init(options_.memory, job_.local_rank));
    ncclUniqueId id;
    std::memset(&id, 0, sizeof id);
    if (job_.rank == 0) DQ_CHECK(nccl_ok(ncclGetUniqueId(&id), "ncclGetUniqueId", nullptr));
    DQ_CHECK(rendezvous::share_bytes(job_, "nccl-unique-id", &id, sizeof id));
    DQ_CHECK(nccl_ok(ncclCommInitRank(&comm_, job_.world_size, id, job_.rank), "ncclCommInitRank",
                     nullptr));

    const Collective coll = options_.collective;
    if (coll == Collective::kReduce && options_.root >= job_.world_size) {
      std::fprintf(stderr, "dynamiq-perf: -r %d: the job has %d ranks (roots 0..%d, or -1)\n",
                   options_.root, job_.world_size, job_.world_size - 1);
      return Status::kInvalidArgument;
    }
    size_t max_bytes = 0;
    for (size_t s : sweep_sizes(options_)) max_bytes = std::max(max_bytes, s);
    DQ_CHECK(buffers_.alloc(max_bytes, &send_));
    DQ_CHECK(buffers_.alloc(max_bytes, &recv_));
    DQ_CHECK(buffers_.alloc(std::max<size_t>(kHostSlotBytes * job_.world_size, 256), &scratch_));
    host_input_.resize(max_bytes + 8);
    host_result_.resize(max_bytes + 8);

    DQ_CHECK(print_header());
    double bus_bw_sum = 0;
    long bw_samples = 0;
    double wrong_total = 0;
    int non_identical_rows = 0;
    // ncclReduce: one root, or every root in turn (-r -1); the others have no root (-1).
    std::vector<int> roots = {-1};
    if (coll == Collective::kReduce) {
      roots.clear();
      for (int r = 0; r < job_.world_size; ++r)
        if (options_.root == -1 || options_.root == r) roots.push_back(r);
    }
    for (DType type : options_.dtypes) {
      for (RedOp op : options_.ops) {
        for (int root : roots) {
          for (size_t size : sweep_sizes(options_)) {
            const CollCounts counts = coll_counts(coll, size, dtype_bytes(type), job_.world_size);
            Measured oop, inplace;
            DQ_CHECK(measure(type, op, counts, root, &oop, &inplace));
            print_row(type, op, counts, root, oop, inplace);
            for (const Measured* m : {&oop, &inplace}) {
              bus_bw_sum += alg_bandwidth(coll, counts, dtype_bytes(type), m->seconds) *
                            bus_factor(coll, job_.world_size);
              ++bw_samples;
              if (options_.check_iters > 0) wrong_total += m->wrong;
              if (options_.check_iters > 0 && !m->identical) ++non_identical_rows;
            }
          }
        }
      }
    }
    // Every rank's digest of every result it checked, in rank order: equal across two runs
    // exactly when every rank got the same bytes in both (determinism of a compressed path,
    // whose results differ from the exact ones by design).
    std::vector<uint64_t> digests(job_.world_size, 0);
    digests[job_.rank] = digest_;
    DQ_CHECK(combine(digests.data(), digests.size(), ncclUint64, sizeof(uint64_t), ncclSum));
    const uint64_t digest = hash_bytes(digests.data(), digests.size() * sizeof(uint64_t));
    if (job_.rank == 0) {
      std::printf("# Out of bounds values : %.0f %s\n", wrong_total,
                  wrong_total == 0 ? "OK" : "FAILED");
      std::printf("# Avg bus bandwidth    : %g \n", bw_samples ? bus_bw_sum / bw_samples : 0.0);
      if (options_.check_iters > 0 && coll == Collective::kAllReduce)
        std::printf("# Results identical on all ranks : %s\n",
                    non_identical_rows == 0 ? "yes" : "NO");
      if (options_.check_iters > 0 && coll != Collective::kAllReduce)
        std::printf("# Results identical on all ranks : n/a (%s)\n",
                    coll == Collective::kReduce ? "only the root holds the result"
                                                : "each rank holds its own block");
      if (options_.check_iters > 0)
        std::printf("# Result digest        : %016llx\n", static_cast<unsigned long long>(digest));
      std::printf("#\n");
      std::fflush(stdout);
    }
    *all_good = wrong_total == 0 && non_identical_rows == 0;
    // A barrier after rank 0 printed: a failing verdict makes every rank exit 1, and a
    // launcher that stops the job at the first failure must not cut rank 0's report short.
    double barrier = 0;
    DQ_CHECK(combine(&barrier, 1, ncclFloat64, sizeof barrier, ncclSum));
    return Status::kOk;
  }

 private:
  // One operation of the collective under test.
  Status collective(const void* send, void* recv, const CollCounts& counts, DType type, RedOp op,
                    int root) {
    switch (options_.collective) {
      case Collective::kAllReduce:
        return nccl_ok(ncclAllReduce(send, recv, counts.param, nccl_type(type), nccl_op(op), comm_,
                                     buffers_.stream()),
                       "ncclAllReduce", comm_);
      case Collective::kReduceScatter:
        return nccl_ok(ncclReduceScatter(send, recv, counts.param, nccl_type(type), nccl_op(op),
                                         comm_, buffers_.stream()),
                       "ncclReduceScatter", comm_);
      case Collective::kReduce:
        return nccl_ok(ncclReduce(send, recv, counts.param, nccl_type(type), nccl_op(op), root,
                                  comm_, buffers_.stream()),
                       "ncclReduce", comm_);
    }
    return Status::kInternal;
  }

  // The buffers of one placement. In place, as nccl-tests: the send buffer is the receive
  // buffer, and a reduce-scatter's output is this rank's block of it (recvbuff = sendbuff +
  // rank x recvcount).
  struct Placement {
    void* send;
    void* recv;
  };
  Placement placement(bool in_place, const CollCounts& counts, DType type) const {
    if (!in_place) return {send_, recv_};
    const size_t offset = options_.collective == Collective::kReduceScatter
                              ? static_cast<size_t>(job_.rank) * counts.recv * dtype_bytes(type)
                              : 0;
    return {recv_, static_cast<unsigned char*>(recv_) + offset};
  }

  // A few values combined across ranks through the scratch buffer.
  Status combine(void* values, size_t count, ncclDataType_t type, size_t elem_bytes,
                 ncclRedOp_t op) {
    DQ_CHECK(buffers_.upload(scratch_, values, count * elem_bytes));
    DQ_CHECK(nccl_ok(ncclAllReduce(scratch_, scratch_, count, type, op, comm_, buffers_.stream()),
                     "ncclAllReduce(stats)", comm_));
    DQ_CHECK(buffers_.synchronize());
    return buffers_.download(values, scratch_, count * elem_bytes);
  }

  Status time_ops(Placement at, const CollCounts& counts, DType type, RedOp op, int root,
                  double* seconds) {
    for (int w = 0; w < options_.warmup_iters; ++w)
      DQ_CHECK(collective(at.send, at.recv, counts, type, op, root));
    DQ_CHECK(buffers_.synchronize());
    const auto start = std::chrono::steady_clock::now();
    for (int it = 0; it < options_.iters; ++it) {
      if (options_.agg_iters > 1) DQ_CHECK(nccl_ok(ncclGroupStart(), "ncclGroupStart", comm_));
      for (int a = 0; a < options_.agg_iters; ++a)
        DQ_CHECK(collective(at.send, at.recv, counts, type, op, root));
      if (options_.agg_iters > 1) DQ_CHECK(nccl_ok(ncclGroupEnd(), "ncclGroupEnd", comm_));
    }
    DQ_CHECK(buffers_.synchronize());
    const std::chrono::duration<double> elapsed = std::chrono::steady_clock::now() - start;
    *seconds = elapsed.count() / (static_cast<double>(options_.iters) * options_.agg_iters);
    return Status::kOk;
  }

  // One validated operation; returns this rank's check of the result.
  Status check_once(bool in_place, const CollCounts& counts, DType type, RedOp op, int root,
                    CheckResult* out) {
    const size_t esize = dtype_bytes(type);
    const size_t send_bytes = counts.send * esize, recv_bytes = counts.recv * esize;
    const Placement at = placement(in_place, counts, type);
    DQ_CHECK(buffers_.upload(at.send, host_input_.data(), send_bytes));
    if (!in_place) DQ_CHECK(buffers_.fill(recv_, kSentinelByte, recv_bytes));
    DQ_CHECK(collective(at.send, at.recv, counts, type, op, root));
    DQ_CHECK(buffers_.synchronize());
    DQ_CHECK(buffers_.download(host_result_.data(), at.recv, recv_bytes));
    // Self-test of the checker: DYNAMIQ_PERF_CORRUPT_RANK=R flips the lowest bit of rank R's
    // first result byte, which the identity check (and, for integers, #wrong) must report.
    if (corrupt_this_rank_ && recv_bytes > 0) host_result_[0] ^= 1;
    const Collective coll = options_.collective;
    if (coll == Collective::kReduce && job_.rank != root) {
      // Not the root: its receive buffer must be left as it was (the sentinel out of place, the
      // input in place). Every changed element is wrong, in every mode.
      *out = CheckResult{};
      const unsigned char* got = host_result_.data();
      for (size_t i = 0; i < counts.recv; ++i) {
        bool same = true;
        for (size_t b = 0; b < esize; ++b)
          same =
              same && got[i * esize + b] == (in_place ? host_input_[i * esize + b] : kSentinelByte);
        if (!same) ++out->wrong, ++out->nonfinite;
      }
      out->hash = hash_bytes(got, recv_bytes);
      return Status::kOk;
    }
    const size_t offset =
        coll == Collective::kReduceScatter ? static_cast<size_t>(job_.rank) * counts.recv : 0;
    *out = check_result(type, op, job_.world_size, counts.recv, host_result_.data(), offset);
    return Status::kOk;
  }

  Status measure(DType type, RedOp op, const CollCounts& counts, int root, Measured* oop,
                 Measured* inplace) {
    const size_t send_bytes = counts.send * dtype_bytes(type);
    fill_input(type, op, job_.rank, counts.send, host_input_.data());
    DQ_CHECK(buffers_.upload(send_, host_input_.data(), send_bytes));
    DQ_CHECK(time_ops(placement(false, counts, type), counts, type, op, root, &oop->seconds));
    DQ_CHECK(buffers_.upload(recv_, host_input_.data(), send_bytes));
    DQ_CHECK(time_ops(placement(true, counts, type), counts, type, op, root, &inplace->seconds));

    double times[2] = {oop->seconds, inplace->seconds};
    ncclRedOp_t time_op = ncclSum;
    if (options_.average == TimeAverage::kMin) time_op = ncclMin;
    if (options_.average == TimeAverage::kMax) time_op = ncclMax;
    if (options_.average == TimeAverage::kRank0 && job_.rank != 0) times[0] = times[1] = 0;
    DQ_CHECK(combine(times, 2, ncclFloat64, sizeof(double), time_op));
    if (options_.average == TimeAverage::kMean) {
      times[0] /= job_.world_size;
      times[1] /= job_.world_size;
    }
    oop->seconds = times[0];
    inplace->seconds = times[1];
    if (options_.check_iters == 0) return Status::kOk;

    unsigned long long rerouted_before = 0, passed = 0, rerouted_after = 0;
    if (dynamiq_counters()) dynamiq_counters()(comm_, &rerouted_before, &passed);
    double tallies[4] = {0, 0, 0, 0};  // wrong and non-finite (or touched), oop then in-place
    double errors[2] = {0, 0};         // vNMSE, max over check iterations
    uint64_t hashes[4] = {0, ~0ull, 0, ~0ull};  // hash and its complement per placement
    for (int c = 0; c < options_.check_iters; ++c) {
      for (int place = 0; place < 2; ++place) {
        CheckResult r;
        DQ_CHECK(check_once(place == 1, counts, type, op, root, &r));
        digest_ = hash_bytes(&digest_, sizeof digest_) ^ r.hash;
        tallies[place * 2] += static_cast<double>(r.wrong);
        tallies[place * 2 + 1] += static_cast<double>(r.nonfinite);
        errors[place] = std::max(errors[place], vnmse(r.error_sq, r.exact_sq));
        const uint64_t h = c == 0 ? r.hash : hash_bytes(&r.hash, 8) ^ hashes[place * 2];
        hashes[place * 2] = h;
        hashes[place * 2 + 1] = ~h;
      }
    }
    DQ_CHECK(combine(tallies, 4, ncclFloat64, sizeof(double), ncclSum));
    DQ_CHECK(combine(errors, 2, ncclFloat64, sizeof(double), ncclMax));
    // max(h) == ~max(~h) == min(h) exactly when every rank has the same h.
    DQ_CHECK(combine(hashes, 4, ncclUint64, sizeof(uint64_t), ncclMax));
    if (dynamiq_counters()) dynamiq_counters()(comm_, &rerouted_after, &passed);
    Measured* placements[2] = {oop, inplace};
    const size_t count = counts.recv;
    for (int p = 0; p < 2; ++p) {
      Measured* m = placements[p];
      if (dynamiq_counters()) m->compressed = rerouted_after > rerouted_before ? 1 : 0;
      // Only an all-reduce leaves the same result on every rank.
      m->identical =
          options_.collective != Collective::kAllReduce || hashes[p * 2] == ~hashes[p * 2 + 1];
      m->nonfinite = tallies[p * 2 + 1];
      m->vnmse = errors[p];
      // Lossy results are judged by finiteness and agreement, not by distance from exact.
      m->wrong = options_.lossy || m->compressed == 1
                     ? m->nonfinite + (m->identical ? 0.0 : static_cast<double>(count))
                     : tallies[p * 2];
    }
    return Status::kOk;
  }

  Status print_header() {
    std::vector<unsigned char> slots(kHostSlotBytes * job_.world_size, 0);
    char host[64] = "?";
    gethostname(host, sizeof host - 1);
    std::snprintf(
        reinterpret_cast<char*>(slots.data()) + kHostSlotBytes * job_.rank, kHostSlotBytes,
        "#  Rank %2d Group  0 Pid %6d on %10s %s", job_.rank, static_cast<int>(getpid()), host,
        buffers_.on_device() ? buffers_.description().c_str() : "device -1 [host] host memory");
    DQ_CHECK(combine(slots.data(), slots.size(), ncclUint8, 1, ncclMax));
    if (job_.rank != 0) return Status::kOk;
    int version = 0;
    ncclGetVersion(&version);
    std::printf("# dynamiq-perf %s, nccl-tests %s_perf columns\n",
                nccl_tests_name(options_.collective), nccl_tests_name(options_.collective));
    std::printf(
        "# nThread 1 nGpus 1 minBytes %zu maxBytes %zu step: %llu(%s) warmup iters: %d "
        "iters: %d agg iters: %d validation: %d graph: 0\n",
        options_.min_bytes, options_.max_bytes,
        static_cast<unsigned long long>(options_.step_factor > 1 ? options_.step_factor
                                                                 : options_.step_bytes),
        options_.step_factor > 1 ? "factor" : "bytes", options_.warmup_iters, options_.iters,
        options_.agg_iters, options_.check_iters);
    std::printf("# NCCL version %d.%d.%d, %d ranks, %s, check: %s\n", version / 10000,
                version % 10000 / 100, version % 100, job_.world_size,
                buffers_.on_device() ? "device buffers" : "host buffers",
                options_.lossy ? "lossy (finite and identical on all ranks)"
                               : "exact (per-dtype tolerance)");
    if (dynamiq_counters())
      std::printf(
          "# dynamiq: libdynamiq.so is loaded; rows it compressed (dynamiq = comp) are "
          "judged lossy: #wrong counts non-finite and cross-rank differences\n");
    std::printf("#\n# Using devices\n");
    for (int r = 0; r < job_.world_size; ++r) {
      const char* line = reinterpret_cast<const char*>(slots.data()) + kHostSlotBytes * r;
      std::printf("%.*s\n", static_cast<int>(strnlen(line, kHostSlotBytes)), line);
    }
    std::printf("#\n");
    std::printf("#%75s%35s%33s\n", "out-of-place", "in-place", "vNMSE and identity");
    std::printf("#%11s%14s%10s%8s%8s%9s%8s%8s%7s%9s%8s%8s%7s%11s%7s%11s%7s%s\n", "size", "count",
                "type", "redop", "root", "time", "algbw", "busbw", "#wrong", "time", "algbw",
                "busbw", "#wrong", "oop_vNMSE", "ident", "ip_vNMSE", "ident",
                dynamiq_counters() ? "  dynamiq" : "");
    std::printf("#%11s%14s%10s%8s%8s%9s%8s%8s%7s%9s%8s%8s%7s%11s%7s%11s%7s\n", "(B)", "(elements)",
                "", "", "", "(us)", "(GB/s)", "(GB/s)", "", "(us)", "(GB/s)", "(GB/s)", "", "", "",
                "", "");
    std::fflush(stdout);
    return Status::kOk;
  }

  static std::string format_time(double us) {
    char text[32];
    if (us < 100)
      std::snprintf(text, sizeof text, "%.2f", us);
    else if (us < 10000)
      std::snprintf(text, sizeof text, "%.1f", us);
    else
      std::snprintf(text, sizeof text, "%.0f", us);
    return text;
  }

  void print_row(DType type, RedOp op, const CollCounts& counts, int root, const Measured& oop,
                 const Measured& ip) {
    if (job_.rank != 0) return;
    const size_t esize = dtype_bytes(type);
    // nccl-tests prints the larger buffer's bytes and the count passed to NCCL.
    const size_t bytes = std::max(counts.send, counts.recv) * esize;
    const Collective coll = options_.collective;
    std::string line;
    char cell[96];
    std::snprintf(cell, sizeof cell, "%12zu  %12zu  %8s  %6s  %6d", bytes, counts.param,
                  dtype_name(type), redop_name(op), root);
    line += cell;
    for (const Measured* m : {&oop, &ip}) {
      const double alg_bw = alg_bandwidth(coll, counts, esize, m->seconds);
      const std::string wrong = options_.check_iters > 0
                                    ? std::to_string(static_cast<long long>(m->wrong))
                                    : std::string("N/A");
      std::snprintf(cell, sizeof cell, "  %7s  %6.2f  %6.2f  %5s",
                    format_time(m->seconds * 1e6).c_str(), alg_bw,
                    alg_bw * bus_factor(coll, job_.world_size), wrong.c_str());
      line += cell;
    }
    for (const Measured* m : {&oop, &ip}) {
      if (options_.check_iters > 0 && coll != Collective::kAllReduce)
        std::snprintf(cell, sizeof cell, "  %9.3g  %5s", m->vnmse, "-");
      else if (options_.check_iters > 0)
        std::snprintf(cell, sizeof cell, "  %9.3g  %5s", m->vnmse, m->identical ? "yes" : "no");
      else
        std::snprintf(cell, sizeof cell, "  %9s  %5s", "N/A", "N/A");
      line += cell;
    }
    if (oop.compressed >= 0) line += oop.compressed == 1 ? "     comp" : "     pass";
    std::printf("%s\n", line.c_str());
    std::fflush(stdout);
  }

  const PerfOptions& options_;
  const rendezvous::JobEnv& job_;
  Buffers buffers_;
  ncclComm_t comm_ = nullptr;
  void* send_ = nullptr;
  void* recv_ = nullptr;
  void* scratch_ = nullptr;
  std::vector<unsigned char> host_input_;
  std::vector<unsigned char> host_result_;
  bool corrupt_this_rank_ = false;
  uint64_t digest_ = 0;  // this rank's running hash of every result it checked
};

}  // namespace
}  // namespace dq::perf

int main(int argc, char** argv) {
  using namespace dq::perf;
  setvbuf(stdout, nullptr, _IOLBF, 0);
  PerfOptions options;
  std::string error;
  if (parse_perf_options(argc, argv, &options, &error) != dq::Status::kOk) {
    std::fprintf(stderr, "dynamiq-perf: %s\n%s", error.c_str(), perf_usage());
    return kExitUsage;
  }
  if (options.show_help) {
    std::fputs(perf_usage(), stdout);
    return 0;
  }
  if (options.show_version) {
    std::printf("%s\n", dq::cli::version_line("dynamiq-perf").c_str());
    return 0;
  }
  dq::rendezvous::JobEnv job;
  if (dq::rendezvous::read_job_env(&job) != dq::Status::kOk) return kExitFailed;
  g_rank = job.rank;
  bool all_good = false;
  {
    Bench bench(options, job);
    if (bench.run(&all_good) != dq::Status::kOk) {
      std::fprintf(stderr, "dynamiq-perf: rank %d: benchmark aborted\n", job.rank);
      std::fflush(stdout);
      _exit(kExitFailed);  // peers may be gone: skip ncclCommDestroy, which could wait on them
    }
  }
  return all_good ? 0 : kExitFailed;
}

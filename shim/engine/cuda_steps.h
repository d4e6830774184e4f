// The host side of the CUDA device's codec steps, shared by its two builds: the emulated device
// (shim/engine/cuda_device.cc, the kernels under the CPU emulation, for the tests) and the real
// one (shim/engine/cuda_device_gpu.cu, nvcc, in libdynamiq.so). Both must check a step's arguments
// exactly alike and turn the kernels' flags into the same Status and error word, so that one
// engine behaves the same on either; only where the kernels run differs.
//
// What is here: the kernels' parameters for a planned codec (DynamiQ, or a baseline: bf16, the MX
// formats, uniform:B), the host codec's argument checks in its order and with its Status, each
// step's launches (checks, then the kernels of the codec's family, given the step's flags word),
// the kernels' flags as a Status (and the StepWord through which the step's last kernel folds them
// into the lane's error word itself), and the level tables built once per option set.
// Include after nothing special: kernels/cuda/cuda_compat.h picks the CUDA runtime under nvcc and
// the emulation otherwise.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "common/status.h"
#include "kernels/cuda/baselines.h"
#include "kernels/cuda/budget.h"
#include "kernels/cuda/dynamiq.h"
#include "kernels/cuda/stats.h"
#include "kernels/dynamiq_codec.h"
#include "kernels/dynamiq_layout.h"
#include "kernels/payload.h"
#include "shim/engine/device.h"

namespace dq::engine::cuda_steps {

// The kernels' flags that mean the data was malformed (the host codec's kMalformedPayload); any
// other flag is a broken invariant (kInternal).
constexpr unsigned kMalformedFlags =
    cuda::kDynamiqBadHeader | cuda::kDynamiqBadRecord | cuda::kDynamiqTooManyWorkers;
// Every flag of the baselines' kernels is malformed data (the host's kMalformedPayload), and the
// same bits: one mapping serves both families.
static_assert((cuda::kBaselineBadHeader | cuda::kBaselineBadCodes |
               cuda::kBaselineTooManyWorkers) == kMalformedFlags,
              "the baselines' flags are the malformed-data flags");
static_assert(cuda::kMaxBaselineInputs == cuda::kMaxHopInputs, "one input limit for both families");

// The Status of a step whose kernels raised `flags` (no logging; see step_status).
inline Status flags_status(unsigned flags) {
  if (flags & kMalformedFlags) return Status::kMalformedPayload;
  if (flags != 0) return Status::kInternal;
  return Status::kOk;
}

// The error word a step whose kernels raised malformed-data flags writes, and the one for any
// other flag: what the host device writes for the same Status (device.h's encoding).
inline uint32_t malformed_word() {
  return error_word(ErrorSource::kCodec, static_cast<int>(Status::kMalformedPayload));
}
inline uint32_t internal_word() {
  return error_word(ErrorSource::kCodec, static_cast<int>(Status::kInternal));
}

// The flags word of a step on a lane whose error word is `error`, armed for its first launch
// (kernels/cuda/step_fold.h): the step's last kernel folds the flags into `error` with the words
// above, as step_status() maps them, and re-arms it. Both devices hand the kernels one, so a step
// launches its kernels and nothing else on either.
inline cuda::StepWord step_word(uint32_t* error) {
  return cuda::step_word(error, kMalformedFlags, malformed_word(), internal_word());
}

// The host codec's Status for a launch's result and the error flags its kernels raised. Call it
// with the launch's result in a variable: as two arguments of one call, the flags could be read
// before the launch (unspecified order; g++ does), and every failure would read as none.
inline Status step_status(cudaError_t launch, unsigned flags, const char* kernel) {
  if (launch == cudaErrorInvalidValue)
    DQ_FAIL(Status::kInvalidArgument, "cuda device: %s: invalid launch arguments", kernel);
  if (launch != cudaSuccess)
    DQ_FAIL(Status::kSystemError, "cuda device: %s: %s", kernel, cudaGetErrorString(launch));
  if (flags & kMalformedFlags)
    DQ_FAIL(Status::kMalformedPayload, "cuda device: %s: malformed input (flags 0x%x)", kernel,
            flags);
  if (flags & cuda::kDynamiqChunkOverCapacity)
    DQ_FAIL(Status::kInternal, "cuda device: %s: a chunk exceeds its message (flags 0x%x)", kernel,
            flags);
  if (flags != 0) DQ_FAIL(Status::kInternal, "cuda device: %s: flags 0x%x", kernel, flags);
  return Status::kOk;
}

// The kernels' parameters for `codec`; false when it has no kernels (not DynamiQ).
inline bool kernel_params(const Codec& codec, DynamiqOptions* o, cuda::DynamiqDeviceParams* out) {
  DynamiqPlan plan;
  if (!dynamiq_parameters(codec, o, &plan)) return false;
  *out = cuda::dynamiq_device_params(plan.count, plan.n_chunks, plan.n_workers, plan.capacity, *o);
  return true;
}

// The workers a baseline codec was planned for (Codec keeps it protected, with no accessor): a
// pointer to the member, named through a derived class, reads it from any Codec.
struct PlannedWorkers : Codec {
  static int of(const Codec& c) { return c.*(&PlannedWorkers::n_workers_); }
};

// Which kernels serve a planned codec, and their parameters.
enum class Family { kNone, kDynamiq, kBaseline };
struct StepParams {
  Family family = Family::kNone;
  DynamiqOptions options;                 // kDynamiq: the codec's options (its level tables' key)
  cuda::DynamiqDeviceParams dynamiq{};    // kDynamiq
  cuda::BaselineDeviceParams baseline{};  // kBaseline
  const LevelTable* levels = nullptr;     // kDynamiq: the tables the kernels read (the device's)
};

// The kernels' parameters for `codec`; Family::kNone when no kernels serve it.
inline Family step_params(const Codec& codec, StepParams* out) {
  out->family = Family::kNone;
  if (kernel_params(codec, &out->options, &out->dynamiq)) {
    out->family = Family::kDynamiq;
  } else if (cuda::baseline_device_params(codec.name(), codec.count(), codec.n_chunks(),
                                          PlannedWorkers::of(codec), &out->baseline) &&
             out->baseline.capacity == codec.chunk_capacity()) {
    out->family = Family::kBaseline;
  }
  return out->family;
}

// ---- the host codec's argument checks, in its order, with its Status ---------------------------

inline Status check_chunk(int n_chunks, int chunk) {
  if (chunk < 0 || chunk >= n_chunks)
    DQ_FAIL(Status::kInvalidArgument, "cuda device: chunk %d outside 0..%d", chunk, n_chunks - 1);
  return Status::kOk;
}

// The kernels read a whole chunk message (its length is in the layout, on the device): the
// engine's payload slots are chunk_capacity() bytes. The host codec accepts a shorter view
// that still holds the chunk's body; this device does not, with the host's Status.
inline Status check_message(size_t capacity, int chunk, ByteView m, const char* what) {
  if (m.data == nullptr || m.size < capacity)
    DQ_FAIL(Status::kMalformedPayload,
            "cuda device %s: chunk %d message has %zu bytes, the plan's messages %zu", what, chunk,
            m.size, capacity);
  return Status::kOk;
}

// The hop's input count and output, as both families' host codecs check them.
inline Status check_hop_buffers(const ByteView* in, int n_in, const uint8_t* out) {
  if (n_in < 0 || n_in > cuda::kMaxHopInputs || (n_in > 0 && in == nullptr))
    DQ_FAIL(Status::kInvalidArgument, "cuda device hop: %d inputs, at most %d", n_in,
            cuda::kMaxHopInputs);
  if (out == nullptr) DQ_FAIL(Status::kInvalidArgument, "cuda device hop: no output buffer");
  return Status::kOk;
}

// Every input message's size; `ptrs` receives their data for the launch.
inline Status check_hop_inputs(size_t capacity, int chunk, const ByteView* in, int n_in,
                               const uint8_t* ptrs[cuda::kMaxHopInputs]) {
  for (int i = 0; i < n_in; ++i) {
    DQ_CHECK(check_message(capacity, chunk, in[i], "hop"));
    ptrs[i] = in[i].data;
  }
  return Status::kOk;
}

inline Status check_stats(const DynamiqPlan& p, const ConstTensor& x) {
  if (x.count != p.count)
    DQ_FAIL(Status::kInvalidArgument, "cuda device stats: tensor has %zu elements, plan has %zu",
            x.count, p.count);
  return Status::kOk;
}

// The fused hop's arguments; `ptrs` receives the input messages' data for the launch.
inline Status check_hop(const DynamiqPlan& p, const void* layout, int chunk, const ConstTensor& own,
                        const ByteView* in, int n_in, const uint8_t* out, const RoundingKey& key,
                        const uint8_t* ptrs[cuda::kMaxHopInputs]) {
  DQ_CHECK(check_chunk(p.n_chunks, chunk));
  if (layout == nullptr) DQ_FAIL(Status::kInvalidArgument, "cuda device hop: no layout");
  if (own.count != p.count || (own.data == nullptr && p.count > 0))
    DQ_FAIL(Status::kInvalidArgument, "cuda device hop: own tensor has %zu elements, plan has %zu",
            own.count, p.count);
  DQ_CHECK(check_hop_buffers(in, n_in, out));
  if (key.strata < 1 || key.stratum >= key.strata)
    DQ_FAIL(Status::kInvalidArgument, "cuda device hop: stratum %u of %u", key.stratum, key.strata);
  DQ_CHECK(check_element_base(key, p.count));
  return check_hop_inputs(p.capacity, chunk, in, n_in, ptrs);
}

inline Status check_finish(const DynamiqPlan& p, const void* layout, int chunk, ByteView in) {
  DQ_CHECK(check_chunk(p.n_chunks, chunk));
  if (layout == nullptr) DQ_FAIL(Status::kInvalidArgument, "cuda device finish: no layout");
  DQ_CHECK(check_message(p.capacity, chunk, in, "finish"));
  return Status::kOk;
}

// A baseline's hop (BlockCodec::check_hop_args, then check_inputs' sizes; the headers are the
// kernel's).
inline Status check_baseline_hop(const cuda::BaselineDeviceParams& p, const void* layout, int chunk,
                                 const ConstTensor& own, const ByteView* in, int n_in,
                                 const uint8_t* out, const RoundingKey& key,
                                 const uint8_t* ptrs[cuda::kMaxHopInputs]) {
  if (layout == nullptr) DQ_FAIL(Status::kInvalidArgument, "cuda device hop: no layout");
  DQ_CHECK(check_chunk(p.n_chunks, chunk));
  DQ_CHECK(check_hop_buffers(in, n_in, out));
  if (own.dtype != DType::kF32 && own.dtype != DType::kBF16)
    DQ_FAIL(Status::kInvalidArgument, "cuda device hop: dtype %d", static_cast<int>(own.dtype));
  if (own.count != p.count || (own.data == nullptr && p.count > 0))
    DQ_FAIL(Status::kInvalidArgument, "cuda device hop: own tensor has %zu elements, plan has %llu",
            own.count, p.count);
  DQ_CHECK(check_element_base(key, p.count));
  return check_hop_inputs(p.capacity, chunk, in, n_in, ptrs);
}

// A baseline's finish (BlockCodec::run_finish's checks; the header and codes are the kernels').
inline Status check_baseline_finish(const cuda::BaselineDeviceParams& p, const void* layout,
                                    int chunk, ByteView in, void* out, DType dtype, ReduceOp op,
                                    int n_contrib) {
  if (layout == nullptr) DQ_FAIL(Status::kInvalidArgument, "cuda device finish: no layout");
  DQ_CHECK(check_chunk(p.n_chunks, chunk));
  if (n_contrib < 1 || n_contrib > p.n_workers)
    DQ_FAIL(Status::kInvalidArgument, "cuda device finish: n_contrib %d outside 1..%d", n_contrib,
            p.n_workers);
  if ((dtype != DType::kF32 && dtype != DType::kBF16) ||
      (op != ReduceOp::kSum && op != ReduceOp::kAvg))
    DQ_FAIL(Status::kInvalidArgument, "cuda device finish: dtype %d, op %d",
            static_cast<int>(dtype), static_cast<int>(op));
  if (out == nullptr && p.count > 0)
    DQ_FAIL(Status::kInvalidArgument, "cuda device finish: no output");
  return check_message(p.capacity, chunk, in, "finish");
}

// ---- each step: the checks, then its kernels on `stream` ---------------------------------------
// `flags`: the `flags` of the step's StepWord (step_word() above), armed as the step starts (the
// kernels write nothing when it has kSkipFlag, cuda_compat.h); the step's last kernel folds the
// kernels' flags into the lane's error word and adds them to the word's `raised` (which the
// emulated device reads for the step's Status). The Status returned is the checks' and the
// launches' only. Launches per step: one per hop (two for a uniform:B hop with inputs: the hop,
// then the clear of a message with invalid codes) and one per finish step, whatever its chunks
// (validator blocks, then decoder blocks that wait for them: FinishGate, step_fold.h). A call's
// statistics are one step over every codec part (PartBatch: one launch), its layouts another (the
// one-block kernel once for every layout below the grid size, the seven grid kernels once for
// every larger one). The budget's prediction (the device's predict_budget, not a step here): seven
// a call, whatever its codec parts (cuda::kBudgetLaunches). So a DynamiQ call of B pipeline blocks
// on n ranks, one finish step a block (an all-reduce's and a reduce-scatter's), launches
// 8 + L + B (n + 1): L = 1, 7 or 8 (small layouts, grid ones, both).

inline Status launch_stats(const StepParams& k, const ConstTensor& x, uint16_t* stats,
                           const unsigned* flags, cudaStream_t stream) {
  if (k.family == Family::kBaseline) return Status::kOk;  // stats_words() is 0: nothing to do
  DQ_CHECK(check_stats(k.dynamiq.plan, x));
  const cudaError_t e = cuda::launch_supergroup_stats(
      x.data, x.dtype == DType::kBF16, x.count, k.dynamiq.plan.n_workers, stats, stream, 0, flags);
  return step_status(e, 0, "statistics");
}

inline Status launch_layout(const StepParams& k, const uint16_t* reduced, uint64_t call,
                            void* layout, unsigned* flags, cudaStream_t stream) {
  const cudaError_t e =
      k.family == Family::kBaseline
          ? cuda::launch_baseline_layout(call, layout, stream, flags)
          : cuda::launch_dynamiq_layout(k.dynamiq, reduced, call, layout, flags, stream);
  return step_status(e, 0, "layout");
}

inline Status launch_hop(const StepParams& k, const void* layout, int chunk, const ConstTensor& own,
                         const ByteView* in, int n_in, uint8_t* out, const RoundingKey& key,
                         unsigned* flags, cudaStream_t stream) {
  const uint8_t* ptrs[cuda::kMaxHopInputs];
  const bool bf16 = own.dtype == DType::kBF16;
  cudaError_t e;
  if (k.family == Family::kBaseline) {
    DQ_CHECK(check_baseline_hop(k.baseline, layout, chunk, own, in, n_in, out, key, ptrs));
    e = cuda::launch_baseline_hop(k.baseline, layout, chunk, own.data, bf16, ptrs, n_in, out, key,
                                  flags, stream);
  } else {
    DQ_CHECK(check_hop(k.dynamiq.plan, layout, chunk, own, in, n_in, out, key, ptrs));
    e = cuda::launch_dynamiq_hop(k.dynamiq, k.levels, layout, chunk, own.data, bf16, ptrs, n_in,
                                 out, key, flags, stream);
  }
  return step_status(e, 0, "hop");
}

inline Status launch_finish(const StepParams& k, const void* layout, int chunk, ByteView in,
                            void* out, DType dtype, ReduceOp op, int n_contrib, unsigned* flags,
                            cudaStream_t stream) {
  const bool bf16 = dtype == DType::kBF16, avg = op == ReduceOp::kAvg;
  // `flags` opens a StepWord (step_word()): the finish takes its tickets there.
  static_assert(offsetof(cuda::StepWord, flags) == 0, "flags opens a StepWord");
  cuda::StepWord* word = reinterpret_cast<cuda::StepWord*>(flags);
  cudaError_t e;
  if (k.family == Family::kBaseline) {
    DQ_CHECK(check_baseline_finish(k.baseline, layout, chunk, in, out, dtype, op, n_contrib));
    e = cuda::launch_baseline_finish(k.baseline, layout, chunk, in.data, out, bf16, avg, n_contrib,
                                     word, stream);
  } else {
    DQ_CHECK(check_finish(k.dynamiq.plan, layout, chunk, in));
    e = cuda::launch_dynamiq_finish(k.dynamiq, k.levels, layout, chunk, in.data, out, bf16, avg,
                                    n_contrib, word, stream);
  }
  return step_status(e, 0, "finish");
}

// ---- a call's statistics and layouts, each one step over every codec part ---------------------
// What both devices prepare once a plan (Device::prepare_parts): the batch kernels' jobs, and the
// image of the table they read, which the device copies to its memory once.
struct PartBatch {
  bool stats = false;  // the statistics run as one batch launch (else part by part)
  std::vector<cuda::StatsJob> stats_jobs;
  unsigned long long stats_tiles = 0;
  int stats_workers = 0;  // the workers every part's statistics are summed over
  bool layouts = false;   // the layouts run as one step of batch launches (else part by part)
  cuda::LayoutBatch layout_batch;
  size_t layout_table = 0;           // where the layout batch's table starts in the table, bytes
  std::vector<unsigned char> image;  // the table's bytes: the stats jobs, then (8-byte aligned)
                                     // the layout batch's table
};

// Plans `parts`' batches; `kernels(codec, &k)` gives a prepared codec's kernel parameters and
// whether kernels serve it. The statistics batch when every part that has statistics is a
// DynamiQ codec with kernels (the only codec with statistics; any other leaves it part by part)
// summed over the same workers.
template <class Kernels>
void plan_part_batch(const PreparedParts& parts, Kernels&& kernels, PartBatch* out) {
  *out = PartBatch{};
  out->stats = true;
  for (const PartSteps& part : parts.parts()) {
    if (part.stats_codec == nullptr) continue;
    StepParams k;
    if (!kernels(*part.stats_codec, &k) || k.family != Family::kDynamiq ||
        k.dynamiq.plan.count != part.count ||
        (out->stats_workers != 0 && k.dynamiq.plan.n_workers != out->stats_workers)) {
      out->stats = false;
      break;
    }
    out->stats_workers = k.dynamiq.plan.n_workers;
    out->stats_jobs.push_back(cuda::StatsJob{part.offset, part.count, part.stats, 0});
  }
  if (!out->stats) out->stats_jobs.clear();
  // The layouts batch when every part is a DynamiQ codec with kernels (a baseline's layout is
  // its header alone: part by part) and the batch plans (else each part's own launch says why).
  std::vector<cuda::LayoutJob> layout_jobs;
  for (const PartSteps& part : parts.parts()) {
    StepParams k;
    if (!kernels(*part.codec, &k) || k.family != Family::kDynamiq) {
      layout_jobs.clear();
      break;
    }
    layout_jobs.push_back(cuda::LayoutJob{k.dynamiq, part.reduced, part.layout});
  }
  out->layouts = !layout_jobs.empty() &&
                 cuda::plan_layout_batch(layout_jobs.data(), static_cast<int>(layout_jobs.size()),
                                         &out->layout_batch);
  out->stats_tiles =
      cuda::stats_batch_tiles(out->stats_jobs.data(), static_cast<int>(out->stats_jobs.size()));
  const size_t stats_bytes = out->stats_jobs.size() * sizeof(cuda::StatsJob);
  out->layout_table = (stats_bytes + 7) / 8 * 8;
  const std::vector<unsigned char>& layouts = out->layout_batch.table;
  out->image.assign(out->layout_table + (out->layouts ? layouts.size() : 0), 0);
  if (stats_bytes > 0) std::memcpy(out->image.data(), out->stats_jobs.data(), stats_bytes);
  if (out->layouts && !layouts.empty())
    std::memcpy(out->image.data() + out->layout_table, layouts.data(), layouts.size());
}

// Parts a CUDA device prepared: their batches, and the batch kernels' table in the device's
// memory (PreparedParts::device_memory, a copy of batch.image).
struct BatchedParts final : PreparedParts {
  using PreparedParts::PreparedParts;
  PartBatch batch;
};

template <class Kernels>
std::unique_ptr<BatchedParts> batched_parts(std::vector<PartSteps> parts, DType dtype,
                                            Kernels&& kernels) {
  auto prepared = std::make_unique<BatchedParts>(std::move(parts), dtype);
  plan_part_batch(*prepared, std::forward<Kernels>(kernels), &prepared->batch);
  return prepared;
}

// `parts` when a device of ours batched their statistics and one step has something to do; else
// nullptr: part by part (Device's own loop), or, when no part has statistics, nothing (`*empty`).
inline const BatchedParts* stats_batch(const PreparedParts& parts, bool* empty) {
  const auto* p = dynamic_cast<const BatchedParts*>(&parts);
  *empty = p != nullptr && p->batch.stats && p->batch.stats_jobs.empty();
  return p != nullptr && p->batch.stats && !*empty ? p : nullptr;
}
// `parts` when a device of ours batched their layouts (never an empty batch: no parts plan none,
// and Device's loop then has nothing to do); else nullptr, part by part.
inline const BatchedParts* layout_batch(const PreparedParts& parts) {
  const auto* p = dynamic_cast<const BatchedParts*>(&parts);
  return p != nullptr && p->batch.layouts ? p : nullptr;
}

// The statistics of every part of `batch` (batch.stats), their values at `input` + each part's
// offset; `table`: the device copy of batch.image.
inline Status launch_part_stats(const PartBatch& batch, const void* table, const void* input,
                                bool bf16, const unsigned* flags, cudaStream_t stream) {
  const auto* jobs = static_cast<const cuda::StatsJob*>(table);  // the table opens with them
  const cudaError_t e = cuda::launch_supergroup_stats_batch(
      jobs, static_cast<int>(batch.stats_jobs.size()), batch.stats_tiles, input, bf16,
      batch.stats_workers, stream, 0, flags);
  return step_status(e, 0, "statistics");
}

// The layouts of every part of `batch` (batch.layouts) for call number `call`.
inline Status launch_part_layouts(const PartBatch& batch, void* table, uint64_t call,
                                  unsigned* flags, cudaStream_t stream) {
  const cudaError_t e = cuda::launch_dynamiq_layouts(
      batch.layout_batch, static_cast<unsigned char*>(table) + batch.layout_table, call, flags,
      stream);
  return step_status(e, 0, "layout");
}

// The finish of chunks first .. first + n - 1, chunk c's message at in + (c - first) * stride
// (in_bytes each): Device::finish_chunks, one launch. Each chunk's arguments are checked as the
// host codec checks them (a chunk outside the codec, a message shorter than its capacity); the
// kernels' validators then check every record of every chunk before any decoder writes, so a
// chunk with an invalid record leaves every chunk of the step unwritten.
inline Status launch_finish_chunks(const StepParams& k, const void* layout, int first, int n,
                                   const uint8_t* in, size_t stride, size_t in_bytes, void* out,
                                   DType dtype, ReduceOp op, int n_contrib, unsigned* flags,
                                   cudaStream_t stream) {
  if (n < 1) DQ_FAIL(Status::kInvalidArgument, "cuda device finish: %d chunks", n);
  const bool bf16 = dtype == DType::kBF16, avg = op == ReduceOp::kAvg;
  for (int i = 0; i < n; ++i) {
    const ByteView m{in + static_cast<size_t>(i) * stride, in_bytes};
    if (k.family == Family::kBaseline)
      DQ_CHECK(check_baseline_finish(k.baseline, layout, first + i, m, out, dtype, op, n_contrib));
    else
      DQ_CHECK(check_finish(k.dynamiq.plan, layout, first + i, m));
  }
  static_assert(offsetof(cuda::StepWord, flags) == 0, "flags opens a StepWord");
  cuda::StepWord* word = reinterpret_cast<cuda::StepWord*>(flags);
  const cudaError_t e =
      k.family == Family::kBaseline
          ? cuda::launch_baseline_finishes(k.baseline, layout, first, n, in, stride, out, bf16, avg,
                                           n_contrib, word, stream)
          : cuda::launch_dynamiq_finishes(k.dynamiq, k.levels, layout, first, n, in, stride, out,
                                          bf16, avg, n_contrib, word, stream);
  return step_status(e, 0, "finish");
}

// ---- set-up: every kernel loaded before the first call ------------------------------------------
// CUDA's lazy loading would otherwise load a kernel's module at its first launch, mid-call, where
// it may wait for the device to go idle while NCCL's kernels spin on peers. NCCL loads its own up
// front; a device does the same with these.
inline cudaError_t load_kernels() {
  cudaError_t e = cuda::load_stats_kernels();
  if (e == cudaSuccess) e = cuda::load_dynamiq_layout_kernels();
  if (e == cudaSuccess) e = cuda::load_dynamiq_hop_kernels();
  if (e == cudaSuccess) e = cuda::load_baseline_kernels();
  if (e == cudaSuccess) e = cuda::load_budget_kernels();
  return e;
}

// ---- level tables: built once per option set, by the host's builder ----------------------------

// The three tables (widths 2, 4, 8) of one option set, and what a device made of them (the real
// device: their copy in device memory, and the event that says the copy is done).
struct LevelSet {
  float eps[3];
  bool nonuniform;
  LevelTable table[3];
  const LevelTable* device = nullptr;  // what the kernels read (the emulated build: `table`)
  void* ready = nullptr;               // the real build: the upload's event
};

class LevelSets {
 public:
  // The set of `o`, made on first use; `made(set)` (under the lock, once per set) prepares it for
  // the device and may fail, in which case the set is dropped and nullptr returned. The address
  // is stable for the object's life (kernels hold pointers into it).
  template <class Made>
  LevelSet* get(const DynamiqOptions& o, Made&& made) {
    std::lock_guard<std::mutex> lock(m_);
    for (LevelSet& l : sets_)
      if (std::memcmp(l.eps, o.eps, sizeof l.eps) == 0 && l.nonuniform == o.nonuniform_levels)
        return &l;
    LevelSet& l = sets_.emplace_back();
    std::memcpy(l.eps, o.eps, sizeof l.eps);
    l.nonuniform = o.nonuniform_levels;
    cuda::dynamiq_level_tables(o, l.table);
    if (!made(l)) {
      sets_.pop_back();
      return nullptr;
    }
    return &l;
  }
  template <class F>
  void for_each(F&& f) {
    std::lock_guard<std::mutex> lock(m_);
    for (LevelSet& l : sets_) f(l);
  }

 private:
  std::mutex m_;
  std::deque<LevelSet> sets_;
};

}  // namespace dq::engine::cuda_steps

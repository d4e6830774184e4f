// The engine's private state, shared by its source files (engine.cc and engine_*.cc; the class
// itself is in engine.h): the plan, the budget's buckets, the sampled check, and where the words
// of the mapped control block live. Not an interface: nothing outside the engine includes it.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/nccl_result.h"
#include "shim/engine/engine.h"
#include "shim/engine/rung_backoff.h"

namespace dq::engine {

// Buckets whose statistics and budget the engine keeps (DYNAMIQ_BITS=auto). More than plans: a
// bucket holds only its statistics (4 bytes per 256 elements), and an evicted bucket starts
// again at the fixed default.
inline constexpr size_t kMaxBuckets = 64;
// A bucket that auto sends as an MX format computes and all-reduces its DynamiQ statistics
// (0.1875 bits per coordinate) only every this many calls, to decide again: 0.023 bits on
// average over MXFP8's 8.25.
inline constexpr uint32_t kMxStatisticsEvery = 8;

inline const char* dtype_label(DType d) {
  return d == DType::kF32 ? "float32" : "bfloat16";
}

// NCCL result of an engine-side failure that is not NCCL's own: the project's one mapping.
inline ncclResult_t engine_failure(Status s) {
  return nccl_result(s);
}

// The control block: mapped uint32 words the host writes before a call's first enqueue, or reads
// after waiting for the words' own event. In order: the error word; the scratch of the blocking
// all-reduces (handshake, plan agreement: send, then receive); then one slot per call of the
// control window (DYNAMIQ_CONTROL_WINDOW, W): the words eligible call k sends in slot k % W, and
// the reduced words it receives in slot k % W, both reused by call k + W once the host has read
// call k's.
inline int error_word_index() {
  return 0;
}
inline int scratch_words() {
  return control_words();
}
inline int scratch_send_word() {
  return 1;
}
inline int scratch_recv_word() {
  return 1 + scratch_words();
}
inline int call_send_word(int slot) {
  return 1 + 2 * scratch_words() + kCallControlWords * slot;
}
inline int call_recv_word(int slot, int window) {
  return call_send_word(window) + kCallControlWords * slot;
}
inline int control_block_words(int window) {
  return call_recv_word(window, window);
}

// ---- the plan: everything fixed by (count, dtype) --------------------------------------
struct Engine::Plan {
  // One codec over a contiguous range of the caller's elements.
  struct Part {
    std::unique_ptr<Codec> codec;
    size_t in_begin = 0;      // first element in the send buffer
    size_t out_begin = 0;     // where finish() writes element 0, in the recv buffer
    size_t count = 0;         // elements
    uint64_t key_base = 0;    // RoundingKey::element_base: unique per element of the call
    size_t stats_offset = 0;  // into the statistics words
    void* layout = nullptr;   // the codec's per-call layout (device memory)
    int chunks = 1;           // chunks its codec is planned with
    // An MX fallback of a DynamiQ bucket (DYNAMIQ_BITS=auto): the DynamiQ codec whose statistics
    // the call still computes, so the bucket can decide again. Null otherwise.
    std::unique_ptr<Codec> stats_codec;
    // The codecs prepared for the device (Device::prepare), once when the plan is made; declared
    // after the codecs they refer to, so they go first.
    std::unique_ptr<PreparedCodec> prepared, stats_prepared;
    const Codec& stats_source() const { return stats_codec ? *stats_codec : *codec; }
    const PreparedCodec& stats_source_prepared() const {
      return stats_prepared ? *stats_prepared : *prepared;
    }
  };
  // A pipeline block: all-reduce and reduce, one part cut into every chunk; reduce-scatter, one
  // part per chunk, each over the block's slice of the rank block that chunk ends at, so each
  // message is budget-exact on its own block.
  // A block may also share the part of an earlier block (owner >= 0, its own parts empty): an
  // all-reduce part planned with the schedule's chunks times the sub-blocks (Engine::sub_blocks_),
  // so sub-block s runs chunks s * n_chunks .. of one codec: one set of statistics and one width
  // allocation for all of them, while their hops pipeline as blocks do.
  struct Block {
    std::vector<Part> parts;
    size_t cap = 0;            // bytes per chunk payload (equal for every part)
    uint8_t* arena = nullptr;  // slots * cap bytes (device memory)
    int owner = -1;            // the block whose part this one shares; -1: its own parts
    int chunk_offset = 0;      // the program's chunk c is the shared part's chunk_offset + c
  };
  // The part holding `chunk`, and the chunk's index within that part's codec.
  Part& part_of(Block& b, int chunk, int* local) {
    Block& o = b.owner >= 0 ? blocks[static_cast<size_t>(b.owner)] : b;
    const bool per_chunk = o.parts.size() > 1;
    *local = per_chunk ? 0 : b.chunk_offset + chunk;
    return o.parts[per_chunk ? chunk : 0];
  }
  Collective collective = Collective::kAllReduce;
  int root = 0;
  size_t count = 0;
  DType dtype = DType::kF32;
  double bits = 0;  // the budget its codecs were made with (DYNAMIQ_BITS, or auto's rung)
  CodecSpec spec;   // the codec its codecs were made of
  PlanShape shape() const { return {collective, root, count, dtype, bits, spec}; }
  // Auto sends this DynamiQ bucket as an MX format of this relative rounding error; 0: it does
  // not (the plan is of the communicator's own codec).
  double mx_error = 0;
  bool mx_fallback() const { return mx_error > 0; }
  Program program;
  std::vector<Block> blocks;
  size_t stats_words = 0;
  uint16_t* stats_local = nullptr;    // device memory
  uint16_t* stats_reduced = nullptr;  // device memory
  // The statistics words in runs the all-reduce sums alike (BF16, or byte lanes: a DynamiQ
  // part's all-zero counts from 16 to 255 workers), in order, covering [0, stats_words).
  std::vector<StatsSpan> stats_spans;
  // Every part's statistics and layout steps, prepared for the device (Device::prepare_parts):
  // a call runs each kind as one step. `stats_steps[with_stats]`: an MX fallback's statistics are
  // computed only on the calls that want them (its own codec needs none); [0] is then a list
  // without them, else both are the same object.
  std::unique_ptr<PreparedParts> part_steps, part_steps_without_stats;
  const PreparedParts* stats_steps[2] = {nullptr, nullptr};
  bool fits = true;
  size_t held_bytes = 0;                // bytes allocated for this plan (the held_bytes metric)
  std::vector<ByteView> inputs;         // scratch for hop inputs
  std::vector<EventHandle> block_wait;  // scratch: per block, the event its next step waits on
};

// ---- the budget's buckets (docs/ENGINE.md section 10) --------------------------------------
struct Engine::Bucket {
  // Identity: a call shape, the same on every rank (NCCL's contract on the call's arguments).
  Collective collective = Collective::kAllReduce;
  int root = 0;
  size_t count = 0;
  DType dtype = DType::kF32;
  struct Part {
    size_t count = 0;         // elements of this codec part
    size_t stats_offset = 0;  // into the statistics words
    int chunks = 1;           // chunks its codec is planned with
  };
  std::vector<Part> parts;  // as every plan of this shape cuts it (the budget changes no cut)
  size_t stats_words = 0;
  // The prediction of its latest call (Device::predict_budget), in one mapped block: the job
  // (the parts' geometry; with DYNAMIQ_BITS=auto every rung's plan and which candidates fit; the
  // plan the call used, written before the call's first enqueue), then the result the device
  // writes from the call's reduced statistics, read here once that call's control is absorbed.
  void* budget_block = nullptr;
  BudgetJob* job = nullptr;
  BudgetPartJob* part_jobs = nullptr;
  BudgetResult* result = nullptr;
  bool stats_pending = false;      // the latest prediction is still to be read
  uint64_t predicted_seq = 0;      // stats_pending: the control sequence number of its call
  uint64_t predicted_call = 0;     // stats_pending: that call's call_seq_
  double bits = 0;                 // budget of the latest call
  uint32_t calls_since_stats = 0;  // calls without statistics since the last with them
  // DYNAMIQ_BITS=auto: the candidate for the next call (-1: the fixed default, for a first call
  // or a missing prediction).
  int rung = -1;
  // Rungs whose plan could not be made, avoided for a while (rung_backoff.h).
  RungBackoff<kCandidates> backoff;
  uint64_t calls = 0;
};

// ---- the sampled check (DYNAMIQ_CHECK_EVERY, docs/ENGINE.md section 10) -----------------------
struct Engine::Check {
  static constexpr size_t kSuperGroups = 64;                // sampled per checked call
  static constexpr size_t kBytes = kSuperGroups * 256 * 4;  // FP32 at most
  enum class State { kNone, kEnqueued, kArmed };
  State state = State::kNone;
  uint64_t armed_seq = 0;      // kArmed: complete once this control sequence number is
  void* in = nullptr;          // device: the sampled inputs
  void* exact = nullptr;       // device: their exact all-reduce
  void* host_out = nullptr;    // mapped: the call's output at the sampled super-groups
  void* host_exact = nullptr;  // mapped: the exact all-reduce
  EventHandle gathered = nullptr, done = nullptr;
  // The call checked (state != kNone), and what is known of it.
  uint64_t call_index = 0;
  size_t groups = 0;
  DType dtype = DType::kF32;
  std::vector<size_t> first;  // first element of each sampled super-group
  bool has_call = false;      // a call was checked (the fields above describe it)
  double sampled = -1;        // sampled vNMSE, once read
  double predicted = -1;      // predicted vNMSE, once its bucket read the statistics
  bool paired = false;        // counted in the paired metrics
};

}  // namespace dq::engine

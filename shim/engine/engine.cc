#include "shim/engine/engine.h"

#include <sys/stat.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <new>

#include "common/nccl_result.h"
#include "common/splitmix.h"
#include "kernels/bf16.h"
#include "kernels/dynamiq_codec.h"
#include "kernels/host_isa.h"
#include "shim/engine/program.h"

namespace dq::engine {
namespace {

constexpr size_t kMaxPlans = 16;  // distinct (count, dtype) kept: DDP uses a few bucket sizes
// Buckets whose statistics and budget the engine keeps (DYNAMIQ_BITS=auto). More than plans: a
// bucket holds only its statistics (4 bytes per 256 elements), and an evicted bucket starts
// again at the fixed default.
constexpr size_t kMaxBuckets = 64;
// A bucket that auto sends as an MX format computes and all-reduces its DynamiQ statistics
// (0.1875 bits per coordinate) only every this many calls, to decide again: 0.023 bits on
// average over MXFP8's 8.25.
constexpr uint32_t kMxStatisticsEvery = 8;

const char* dtype_label(DType d) { return d == DType::kF32 ? "float32" : "bfloat16"; }

// NCCL result of an engine-side failure that is not NCCL's own: the project's one mapping.
ncclResult_t engine_failure(Status s) { return nccl_result(s); }

bool parse_switch(const char* text, bool* on) {
  std::string t(text);
  while (!t.empty() && (t.back() == '\n' || t.back() == '\r' || t.back() == ' ')) t.pop_back();
  size_t b = 0;
  while (b < t.size() && t[b] == ' ') ++b;
  t = t.substr(b);
  for (char& c : t) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (t.empty() || t == "1" || t == "on" || t == "true") return *on = true, true;
  if (t == "0" || t == "off" || t == "false") return *on = false, true;
  return false;
}

}  // namespace

topo::Kind choose_topology(const std::string& setting, int nranks) {
  if (setting == "ring") return topo::Kind::kRing;
  if (setting == "butterfly") return topo::Kind::kButterfly;
  const bool pow2 = nranks > 0 && (nranks & (nranks - 1)) == 0;
  return pow2 && nranks >= 4 ? topo::Kind::kButterfly : topo::Kind::kRing;
}

Status Engine::register_opt_in(bool on) {
  if (state_ != State::kPending)
    DQ_FAIL(Status::kInvalidArgument,
            "dynamiqCommRegister: the communicator already ran an all-reduce; register it before "
            "its first ncclAllReduce (on every rank) so that all ranks agree");
  opted_in_ = on;
  return Status::kOk;
}

void Engine::warn_differs(const std::string& what) {
  if (what == warned_differs_) return;
  warned_differs_ = what;
  DQ_WARN(Subsys::kEngine,
          "dynamiq: ranks of communicator (rank %d of %d) disagree on: %s. Compression is OFF for "
          "this communicator: its calls pass through to NCCL. Give every rank the same DYNAMIQ_* "
          "settings.",
          comm_.rank, comm_.nranks, what.c_str());
}

void Engine::count(PassReason reason) {
  if (metrics_) metrics_->calls[static_cast<int>(reason)].fetch_add(1, std::memory_order_relaxed);
}

bool Engine::read_switch() {
  if (settings_.control_file.empty() || comm_.rank != 0) return true;
  struct stat st;
  if (::stat(settings_.control_file.c_str(), &st) != 0) {
    switch_mtime_ns_ = -1;
    switch_on_ = true;  // a missing file means on
    return switch_on_;
  }
  const int64_t mtime = static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
  if (mtime == switch_mtime_ns_) return switch_on_;
  switch_mtime_ns_ = mtime;
  char text[64] = {0};
  if (std::FILE* f = std::fopen(settings_.control_file.c_str(), "r")) {
    const size_t n = std::fread(text, 1, sizeof text - 1, f);
    text[n] = '\0';
    std::fclose(f);
  }
  bool on = switch_on_;
  if (!parse_switch(text, &on)) {
    DQ_WARN(Subsys::kEngine,
            "dynamiq: DYNAMIQ_CONTROL_FILE %s holds '%s'; expected 1/on/true or 0/off/false. "
            "Keeping compression %s.",
            settings_.control_file.c_str(), text, switch_on_ ? "on" : "off");
    return switch_on_;
  }
  if (on != switch_on_)
    DQ_INFO(Subsys::kEngine, "dynamiq: control file switches compression %s", on ? "on" : "off");
  switch_on_ = on;
  return switch_on_;
}

// ---- the control block: mapped words the host writes before a call's first enqueue, or reads
// after waiting for the words' own event (one call late) ----------------------------------------
namespace {
int scratch_words() {
  return control_words();
}  // handshake / plan agreement: send, then recv
int call_send_word() {
  return 2 * scratch_words();
}
int call_recv_word(int parity) {
  return call_send_word() + kCallControlWords * (1 + parity);
}
int error_word_index() {
  return call_send_word() + 3 * kCallControlWords;
}
int control_block_words() {
  return error_word_index() + 1;
}
}  // namespace

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
    // An MX fallback of a DynamiQ bucket (DYNAMIQ_BITS=auto): the DynamiQ codec whose statistics
    // the call still computes, so the bucket can decide again. Null otherwise.
    std::unique_ptr<Codec> stats_codec;
    const Codec& stats_source() const { return stats_codec ? *stats_codec : *codec; }
  };
  // A pipeline block: all-reduce and reduce, one part cut into every chunk; reduce-scatter, one
  // part per chunk, each over the block's slice of the rank block that chunk ends at, so each
  // message is budget-exact on its own block.
  struct Block {
    std::vector<Part> parts;
    size_t cap = 0;            // bytes per chunk payload (equal for every part)
    uint8_t* arena = nullptr;  // slots * cap bytes (device memory)
  };
  // The part holding `chunk`, and the chunk's index within that part's codec.
  Part& part_of(Block& b, int chunk, int* local) {
    const bool per_chunk = b.parts.size() > 1;
    *local = per_chunk ? 0 : chunk;
    return b.parts[per_chunk ? chunk : 0];
  }
  Collective collective = Collective::kAllReduce;
  int root = 0;
  size_t count = 0;
  DType dtype = DType::kF32;
  double bits = 0;  // the budget its codecs were made with (DYNAMIQ_BITS, or auto's rung)
  std::string spec;  // the codec spec its codecs were made with
  // Auto sends this DynamiQ bucket as an MX format of this relative rounding error; 0: it does
  // not (the plan is of the communicator's own codec).
  double mx_error = 0;
  bool mx_fallback() const { return mx_error > 0; }
  Program program;
  std::vector<Block> blocks;
  size_t stats_words = 0;
  uint16_t* stats_local = nullptr;    // device memory
  uint16_t* stats_reduced = nullptr;  // device memory
  bool fits = true;
  size_t held_bytes = 0;  // bytes allocated for this plan (the held_bytes metric)
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
  // writes from the call's reduced statistics, read here one call late.
  void* budget_block = nullptr;
  BudgetJob* job = nullptr;
  BudgetPartJob* part_jobs = nullptr;
  BudgetResult* result = nullptr;
  bool stats_pending = false;  // the latest call's prediction is still to be read
  double bits = 0;             // budget of the latest call
  uint32_t calls_since_stats = 0;  // calls without statistics since the last with them
  // DYNAMIQ_BITS=auto: the candidate for the next call (-1: the fixed default, for a first call
  // or a missing prediction).
  int rung = -1;
  uint64_t calls = 0;
  uint64_t last_call_index = 0;  // call_seq_ of its latest compressed call
};

// ---- the sampled check (DYNAMIQ_CHECK_EVERY, docs/ENGINE.md section 10) -----------------------
struct Engine::Check {
  static constexpr size_t kSuperGroups = 64;        // sampled per checked call
  static constexpr size_t kBytes = kSuperGroups * 256 * 4;  // FP32 at most
  enum class State { kNone, kEnqueued, kArmed };
  State state = State::kNone;
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

Engine::Engine(const config::Settings& settings, bool settings_valid, CommInfo comm,
               const NcclOps& ops, Device* device, std::shared_ptr<CommMetrics> metrics,
               bool opted_in)
    : settings_(settings),
      settings_valid_(settings_valid),
      comm_(comm),
      ops_(ops),
      device_(device),
      metrics_(std::move(metrics)),
      opted_in_(opted_in),
      kind_(choose_topology(settings.topology, comm.nranks)) {
  parse_budget_target(settings_.target, &target_);  // validated with the settings
  apply_host_isa_setting(settings_.host_isa.c_str());  // before this engine makes a codec
  if (metrics_) {
    std::lock_guard<std::mutex> lock(metrics_->budget_mutex);
    metrics_->budget.auto_budget = settings_.bits_auto;
    metrics_->budget.target = settings_.bits_auto ? budget_target_name(target_) : "";
  }
  if (device_ != nullptr && setup_device() != Status::kOk) {
    DQ_WARN(Subsys::kEngine,
            "dynamiq: rank %d: cannot set up the %s device (streams, events, control words); "
            "compression is off for this communicator",
            comm_.rank, device_->name());
    teardown_device();
    device_ = nullptr;
    setup_failed_ = true;
  }
}

Engine::~Engine() {
  for (auto& b : buckets_) release_bucket(*b);
  buckets_.clear();
  while (!plans_.empty()) {
    retire(std::move(plans_.back()));
    plans_.pop_back();
  }
  teardown_device();
}

Status Engine::setup_device() {
  DQ_CHECK(device_->create_stream(&comm_stream_));
  DQ_CHECK(device_->create_stream(&compute_stream_));
  for (EventHandle* e :
       {&ev_start_, &ev_control_, &ev_stats_, &ev_reduced_, &ev_comm_done_, &ev_compute_done_})
    DQ_CHECK(device_->create_event(e));
  void* words = nullptr;
  DQ_CHECK(device_->alloc_mapped(static_cast<size_t>(control_block_words()) * 4, &words));
  control_ = static_cast<uint32_t*>(words);
  std::memset(control_, 0, static_cast<size_t>(control_block_words()) * 4);
  if (device_->budget_scratch_bytes() > 0 && settings_.codec == "dynamiq")
    DQ_CHECK(device_->alloc(device_->budget_scratch_bytes(), &budget_scratch_));
  if (settings_.check_every > 0) {
    check_ = std::make_unique<Check>();
    DQ_CHECK(device_->alloc(Check::kBytes, &check_->in));
    DQ_CHECK(device_->alloc(Check::kBytes, &check_->exact));
    DQ_CHECK(device_->alloc_mapped(Check::kBytes, &check_->host_out));
    DQ_CHECK(device_->alloc_mapped(Check::kBytes, &check_->host_exact));
    DQ_CHECK(device_->create_event(&check_->gathered));
    DQ_CHECK(device_->create_event(&check_->done));
  }
  return Status::kOk;
}

void Engine::teardown_device() {
  if (device_ == nullptr) return;
  // Streams first: destroying one waits for its work, so nothing queued still uses the rest.
  if (comm_stream_) device_->destroy_stream(comm_stream_);
  if (compute_stream_) device_->destroy_stream(compute_stream_);
  comm_stream_ = compute_stream_ = nullptr;
  for (EventHandle* e :
       {&ev_start_, &ev_control_, &ev_stats_, &ev_reduced_, &ev_comm_done_, &ev_compute_done_})
    if (*e) device_->destroy_event(*e), *e = nullptr;
  for (EventHandle e : ev_units_) device_->destroy_event(e);
  ev_units_.clear();
  if (control_) device_->release(control_, nullptr);
  control_ = nullptr;
  if (budget_scratch_) device_->release(budget_scratch_, nullptr);
  budget_scratch_ = nullptr;
  if (check_) {
    for (void* p : {check_->in, check_->exact, check_->host_out, check_->host_exact})
      if (p) device_->release(p, nullptr);
    for (EventHandle e : {check_->gathered, check_->done})
      if (e) device_->destroy_event(e);
    check_.reset();
  }
}

Status Engine::ensure_events(size_t n) {
  while (ev_units_.size() < n) {
    EventHandle e = nullptr;
    DQ_CHECK(device_->create_event(&e));
    ev_units_.push_back(e);
  }
  return Status::kOk;
}

PassReason Engine::screen(const CallArgs& call) const {
  if (comm_.nranks < 2) return PassReason::kSingleRank;
  if (device_ == nullptr) return PassReason::kNoDevice;
  if (state_ == State::kInert)
    return warned_differs_.empty() ? PassReason::kDisabled : PassReason::kSettingsDiffer;
  if (canary_ == Canary::kFailed) return PassReason::kCanaryFailed;
  const bool capturing = call.capturing || device_->capturing(call.stream);
  // Not agreed yet: the handshake only runs outside a group and outside capture.
  if (state_ == State::kPending) return capturing ? PassReason::kCapturing : PassReason::kInGroup;
  if (!settings_valid_ || !settings_.enable) return PassReason::kDisabled;
  if (!opted_in_) return PassReason::kNotOptedIn;
  size_t esize;
  if (call.dtype == ncclFloat32 && settings_.allow_f32) {
    esize = 4;
  } else if (call.dtype == ncclBfloat16 && settings_.allow_bf16) {
    esize = 2;
  } else {
    return PassReason::kDtype;
  }
  if (call.op != ncclSum && call.op != ncclAvg) return PassReason::kOp;
  const bool allowed =
      (call.collective == Collective::kAllReduce && settings_.allow_all_reduce) ||
      (call.collective == Collective::kReduceScatter && settings_.allow_reduce_scatter) ||
      (call.collective == Collective::kReduce && settings_.allow_reduce && call.root >= 0 &&
       call.root < comm_.nranks);
  if (!allowed) return PassReason::kCollective;
  if (call.count * esize < static_cast<size_t>(settings_.min_bytes) || call.count == 0)
    return PassReason::kSmall;
  if (call.in_group) return PassReason::kInGroup;
  // A captured graph would freeze the plan, the call number that keys the rounding and the A/B
  // switch, and replay them: captured calls pass through (docs/ENGINE.md section 5).
  if (capturing) return PassReason::kCapturing;
  return PassReason::kRerouted;
}

// ---- the canary ---------------------------------------------------------------------------
std::vector<float> canary_tensor(int worker) {
  // Magnitudes 2^6 apart (energies 2^12 apart, more than the width thresholds' ratios), in
  // counts the 5-bit budget of 32 super-groups in 2 chunks allocates as: one 16-bit super-group
  // (3), two 8-bit (10, 17), three 4-bit (1, 22, 28), the rest 2-bit, magnitudes 2^-20 .. 2^4;
  // super-group 5 is all zeros and the last one partial.
  std::vector<float> x(kCanaryCount);
  for (size_t i = 0; i < kCanaryCount; ++i) {
    const size_t j = i / 256;
    static const int kSmall[4] = {-20, -8, 0, 4};
    const int e = j == 3                         ? 24
                  : j == 10 || j == 17           ? 18
                  : j == 1 || j == 22 || j == 28 ? 12
                                                 : kSmall[j % 4];
    const double v = std::sin(0.731 * static_cast<double>(i) + 1.7 * worker + 0.3 * j) +
                     0.25 * (worker + 1) * std::cos(0.05 * static_cast<double>(j));
    x[i] = j == 5 ? 0.0f : static_cast<float>(std::ldexp(v, e));
  }
  return x;
}

std::string CanaryResult::describe() const {
  char line[256];
  if (device_status != Status::kOk)
    std::snprintf(line, sizeof line, "a device step failed (%s)", status_name(device_status));
  else
    std::snprintf(line, sizeof line,
                  "the device's %s differs from the host codec at byte %zu (0x%02x, expected "
                  "0x%02x)",
                  step.c_str(), byte, got, expected);
  return line;
}

CanaryResult run_canary(Device* device, const std::string& codec_spec, StreamHandle stream,
                        uint64_t seed) {
  CanaryResult r;
  std::string error;
  const std::unique_ptr<Codec> codec = make_codec(codec_spec, &error);
  // A codec that cannot be made or planned: its plans fail the same way on every rank.
  if (!codec || codec->plan(kCanaryCount, kCanaryChunks, kCanaryWorkers) != Status::kOk) return r;
  const size_t words = codec->stats_words(), cap = codec->chunk_capacity();
  const size_t layout_bytes = codec->layout_bytes(), x_bytes = kCanaryCount * 4;

  // One image holds every buffer the device reads or writes, each at a 256-byte boundary: it
  // goes to the device in one copy and comes back in one.
  struct Region {
    std::string name;
    size_t at = 0, bytes = 0;
    bool output = false;
  };
  std::vector<Region> regions;
  size_t image_bytes = 0;
  auto place = [&](std::string name, size_t bytes, bool output) {
    regions.push_back({std::move(name), image_bytes, bytes, output});
    image_bytes += (bytes + 255) / 256 * 256;
    return regions.back().at;
  };
  constexpr int W = kCanaryWorkers, C = kCanaryChunks;
  size_t x_at[W], stats_at[W], leaf_out[C][W - 1], leaf_in[C][W - 1], hop_out[C], hop_in[C];
  for (int w = 0; w < W; ++w)
    x_at[w] = place("input of worker " + std::to_string(w), x_bytes, false);
  for (int w = 0; w < W; ++w)
    stats_at[w] = place("statistics of worker " + std::to_string(w), words * 2, true);
  const size_t reduced_at = place("reduced statistics", words * 2, false);
  const size_t layout_out = place("layout", layout_bytes, true);
  const size_t layout_in = place("layout input", layout_bytes, false);
  for (int c = 0; c < C; ++c) {
    const std::string chunk = " (chunk " + std::to_string(c) + ")";
    for (int w = 0; w < W - 1; ++w) {
      leaf_out[c][w] = place("leaf payload of worker " + std::to_string(w) + chunk, cap, true);
      leaf_in[c][w] = place("leaf input" + chunk, cap, false);
    }
    hop_out[c] = place("hop payload" + chunk, cap, true);
    hop_in[c] = place("hop input" + chunk, cap, false);
  }
  const size_t finish_out = place("finished output", x_bytes, true);

  // The host codec's bytes, straight from the codec: every output, and the inputs of each device
  // step (so each step is compared on its own).
  std::vector<uint8_t> host(image_bytes, 0);
  auto at = [&](std::vector<uint8_t>& image, size_t offset) { return image.data() + offset; };
  auto tensor = [&](uint8_t* base, int w) {
    return ConstTensor{base + x_at[w], DType::kF32, kCanaryCount};
  };
  auto key = [&](int w) {
    RoundingKey k;
    k.seed = seed;
    k.rank = static_cast<uint32_t>(w);
    return k;
  };
  for (int w = 0; w < W; ++w) {
    const std::vector<float> x = canary_tensor(w);
    std::memcpy(at(host, x_at[w]), x.data(), x_bytes);
  }
  bool ok = true;
  auto host_step = [&ok](Status s) { ok = ok && s == Status::kOk; };
  if (words > 0) {
    std::vector<float> sum(words, 0.0f);
    for (int w = 0; w < W; ++w) {
      auto* stats = reinterpret_cast<uint16_t*>(at(host, stats_at[w]));
      host_step(codec->local_stats(tensor(host.data(), w), stats));
      for (size_t k = 0; k < words; ++k) sum[k] += bf16_to_f32(stats[k]);
    }
    auto* reduced = reinterpret_cast<uint16_t*>(at(host, reduced_at));
    for (size_t k = 0; k < words; ++k) reduced[k] = f32_to_bf16_sat(sum[k]);
  }
  const auto* reduced =
      words > 0 ? reinterpret_cast<const uint16_t*>(at(host, reduced_at)) : nullptr;
  host_step(codec->build_layout(reduced, 0, at(host, layout_out)));
  std::memcpy(at(host, layout_in), at(host, layout_out), layout_bytes);
  for (int c = 0; ok && c < C; ++c) {
    for (int w = 0; w < W - 1; ++w) {
      host_step(codec->fused_hop(at(host, layout_in), c, tensor(host.data(), w), nullptr, 0,
                                 at(host, leaf_out[c][w]), key(w)));
      std::memcpy(at(host, leaf_in[c][w]), at(host, leaf_out[c][w]), cap);
    }
    const ByteView in[2] = {{at(host, leaf_in[c][0]), cap}, {at(host, leaf_in[c][1]), cap}};
    host_step(codec->fused_hop(at(host, layout_in), c, tensor(host.data(), W - 1), in, 2,
                               at(host, hop_out[c]), key(W - 1)));
    std::memcpy(at(host, hop_in[c]), at(host, hop_out[c]), cap);
    host_step(codec->decode_finish(at(host, layout_in), c, ByteView{at(host, hop_in[c]), cap},
                                   at(host, finish_out), DType::kF32, ReduceOp::kSum, W));
  }
  if (!ok) {
    DQ_INFO(Subsys::kEngine, "dynamiq: canary: the host codec %s failed on the canary; not run",
            codec_spec.c_str());
    return r;
  }
  r.host_layout.assign(at(host, layout_out), at(host, layout_out) + layout_bytes);

  // The device: the same steps from the same inputs, on `stream`, waited for once.
  std::vector<uint8_t> upload = host, device_image(image_bytes, 0);
  for (const Region& g : regions)
    if (g.output) std::memset(at(upload, g.at), 0, g.bytes);
  r.ran = true;
  void* base = nullptr;
  void* word = nullptr;
  EventHandle done = nullptr;
  Status s = device->alloc(image_bytes, &base);
  if (s == Status::kOk) s = device->alloc_mapped(4, &word);
  if (s == Status::kOk) s = device->create_event(&done);
  if (s == Status::kOk) {
    auto* error_word = static_cast<uint32_t*>(word);
    *error_word = 0;
    const Lane lane{stream, error_word};
    auto* dev = static_cast<uint8_t*>(base);
    auto step = [&s](Status enqueued) {
      if (s == Status::kOk) s = enqueued;
    };
    step(device->copy(dev, upload.data(), image_bytes, lane));
    if (words > 0)
      for (int w = 0; w < W; ++w)
        step(device->local_stats(*codec, tensor(dev, w),
                                 reinterpret_cast<uint16_t*>(dev + stats_at[w]), lane));
    step(device->build_layout(
        *codec, words > 0 ? reinterpret_cast<const uint16_t*>(dev + reduced_at) : nullptr, 0,
        dev + layout_out, lane));
    for (int c = 0; c < C; ++c) {
      for (int w = 0; w < W - 1; ++w)
        step(device->hop(*codec, dev + layout_in, c, tensor(dev, w), nullptr, 0,
                         dev + leaf_out[c][w], key(w), lane));
      const ByteView in[2] = {{dev + leaf_in[c][0], cap}, {dev + leaf_in[c][1], cap}};
      step(device->hop(*codec, dev + layout_in, c, tensor(dev, W - 1), in, 2, dev + hop_out[c],
                       key(W - 1), lane));
      step(device->finish(*codec, dev + layout_in, c, ByteView{dev + hop_in[c], cap},
                          dev + finish_out, DType::kF32, ReduceOp::kSum, W, lane));
    }
    step(device->copy(device_image.data(), dev, image_bytes, lane));
    // The one blocking wait of the canary (once per communicator, at its first plan).
    step(device->record(done, stream));
    step(device->synchronize(done));
    const uint32_t failed = __atomic_load_n(error_word, __ATOMIC_ACQUIRE);
    if (s == Status::kOk && failed != 0) s = static_cast<Status>(error_code(failed));
  }
  if (done) device->destroy_event(done);
  if (word) device->release(word, stream);
  if (base) device->release(base, stream);
  if (s != Status::kOk) {
    r.differs = true;
    r.device_status = s;
    return r;
  }
  // Outputs in the order the steps ran, then the inputs (a step must not write them), then the
  // padding between buffers (nor those).
  auto compare = [&](const std::string& name, size_t offset, size_t bytes) {
    for (size_t b = 0; b < bytes; ++b)
      if (device_image[offset + b] != host[offset + b]) {
        r.differs = true;
        r.step = name;
        r.byte = b;
        r.got = device_image[offset + b];
        r.expected = host[offset + b];
        return true;
      }
    return false;
  };
  for (bool outputs : {true, false})
    for (const Region& g : regions)
      if (g.output == outputs &&
          compare(outputs ? g.name : g.name + " (an input: overwritten)", g.at, g.bytes))
        return r;
  compare("memory between its buffers", 0, image_bytes);
  return r;
}

// ---- planning ---------------------------------------------------------------------------
topo::Kind Engine::kind_for(Collective collective) const {
  const int n = comm_.nranks;
  const bool pow2 = n > 0 && (n & (n - 1)) == 0;
  if (collective == Collective::kReduceScatter && kind_ == topo::Kind::kButterfly && !pow2)
    return topo::Kind::kRing;
  return kind_;
}

std::unique_ptr<Engine::Plan> Engine::build_plan(const CallArgs& call, DType dtype, double bits,
                                                 const std::string& spec, Status* status) {
  auto plan = std::make_unique<Plan>();
  Plan& p = *plan;
  p.collective = call.collective;
  p.root = call.root;
  p.count = call.count;
  p.dtype = dtype;
  p.bits = bits;
  p.spec = spec;
  // An MX candidate of a DynamiQ communicator (auto's fallback) keeps computing the statistics.
  p.mx_error = settings_.codec == "dynamiq" ? mx_rounding_error(spec) : 0.0;
  const int n = comm_.nranks;
  if ((*status = compile_program(kind_for(call.collective), n, comm_.rank,
                                 static_cast<uint64_t>(settings_.seed), call.collective, call.root,
                                 &p.program)) != Status::kOk)
    return plan;
  const topo::Schedule& sched = p.program.schedule;
  const int n_chunks = sched.n_chunks;
  const bool scatter = call.collective == Collective::kReduceScatter;

  // Blocks of whole super-groups of each part; the last block takes the remainder (up to twice
  // the size), so no block is so small that it cannot meet the budget. DYNAMIQ_BLOCK_BYTES counts
  // the caller's bytes: a reduce-scatter block spans one slice of every rank block.
  const size_t esize = dtype_size(dtype);
  const size_t span = scatter ? call.count / n : call.count;  // elements a part is cut from
  size_t block_elems =
      static_cast<size_t>(settings_.block_bytes) / esize / (scatter ? n : 1) / 256 * 256;
  block_elems = std::max<size_t>(block_elems, 256);
  const size_t n_blocks = std::max<size_t>(1, span / block_elems);
  const uint64_t padded_span = (span + 255) / 256 * 256;  // keeps key bases multiples of 256
  std::string error;
  for (size_t b = 0; b < n_blocks; ++b) {
    Plan::Block blk;
    const size_t begin = b * block_elems;
    const size_t count = b + 1 == n_blocks ? span - begin : block_elems;
    for (int part_index = 0; part_index < (scatter ? n_chunks : 1); ++part_index) {
      Plan::Part part;
      const int owner = scatter ? sched.sink_worker[part_index] : 0;
      part.in_begin = static_cast<size_t>(owner) * span + begin;
      part.out_begin = begin;
      part.count = count;
      part.key_base = static_cast<uint64_t>(owner) * padded_span + begin;
      part.codec = make_codec(spec, &error);
      if (!part.codec) {
        *status = Status::kInternal;
        DQ_WARN(Subsys::kEngine, "dynamiq: codec %s: %s", spec.c_str(), error.c_str());
        return plan;
      }
      const int part_chunks = scatter ? 1 : n_chunks;
      if ((*status = part.codec->plan(count, part_chunks, n)) != Status::kOk) return plan;
      if (p.mx_fallback()) {
        part.stats_codec = make_codec(settings_.codec_spec, &error);
        if (!part.stats_codec) {
          *status = Status::kInternal;
          return plan;
        }
        if ((*status = part.stats_codec->plan(count, part_chunks, n)) != Status::kOk) return plan;
      }
      // Too few super-groups per chunk message (kernels/codec.h) pass through: over_budget.
      p.fits = p.fits && part.codec->fits_budget() && chunks_large_enough(count, part_chunks);
      blk.cap = part.codec->chunk_capacity();  // a function of (count, budget): equal for all
      part.stats_offset = p.stats_words;
      p.stats_words += part.stats_source().stats_words();
      blk.parts.push_back(std::move(part));
    }
    p.blocks.push_back(std::move(blk));
  }
  p.inputs.resize(p.program.max_inputs + 1);
  p.block_wait.assign(p.blocks.size(), nullptr);
  if (!p.fits) return plan;  // passes through: no buffers

  auto alloc = [&](size_t bytes, void** out) {
    if (*status != Status::kOk) return;
    *status = device_->alloc(std::max<size_t>(bytes, 1), out);
    if (*status == Status::kOk) p.held_bytes += std::max<size_t>(bytes, 1);
  };
  double arena_mb = 0;
  for (Plan::Block& b : p.blocks) {
    void* arena = nullptr;
    alloc(static_cast<size_t>(p.program.slots) * b.cap, &arena);
    b.arena = static_cast<uint8_t*>(arena);
    for (Plan::Part& part : b.parts) alloc(part.codec->layout_bytes(), &part.layout);
    arena_mb += 1e-6 * static_cast<double>(p.program.slots) * b.cap;
  }
  void* words = nullptr;
  alloc(p.stats_words * 2, &words);
  p.stats_local = static_cast<uint16_t*>(words);
  words = nullptr;
  alloc(p.stats_words * 2, &words);
  p.stats_reduced = static_cast<uint16_t*>(words);
  if (metrics_) metrics_->held_bytes.fetch_add(static_cast<int64_t>(p.held_bytes));
  if (*status == Status::kOk)
    DQ_INFO(Subsys::kEngine,
            "dynamiq: plan rank %d/%d %s count %zu, %s at %g bits %s: %s, %zu block(s), %d "
            "chunk(s) of %zu B, %d slots (%.1f MB of payload buffers), %zu statistics words",
            comm_.rank, n, collective_name(call.collective), call.count, spec.c_str(), bits,
            dtype == DType::kF32 ? "float32" : "bfloat16",
            topo::kind_name(kind_for(call.collective)), p.blocks.size(), n_chunks,
            p.blocks.front().cap, p.program.slots, arena_mb, p.stats_words);
  return plan;
}

void Engine::retire(std::unique_ptr<Plan> plan) {
  if (!plan || device_ == nullptr) return;
  // Stream-ordered: the comm stream waits for the last codec step, then frees.
  device_->wait(comm_stream_, ev_compute_done_);
  for (Plan::Block& b : plan->blocks) {
    device_->release(b.arena, comm_stream_);
    for (Plan::Part& part : b.parts) device_->release(part.layout, comm_stream_);
  }
  device_->release(plan->stats_local, comm_stream_);
  device_->release(plan->stats_reduced, comm_stream_);
  if (metrics_) metrics_->held_bytes.fetch_sub(static_cast<int64_t>(plan->held_bytes));
}

Engine::Plan* Engine::plan_for(const CallArgs& call, DType dtype, double bits,
                              const std::string& spec, Bucket* bucket,
                              ncclResult_t* nccl_failure) {
  *nccl_failure = ncclSuccess;
  const size_t count = call.count;
  for (auto it = plans_.begin(); it != plans_.end(); ++it)
    if ((*it)->count == count && (*it)->dtype == dtype && (*it)->collective == call.collective &&
        (*it)->root == call.root && (*it)->bits == bits && (*it)->spec == spec) {
      plans_.splice(plans_.begin(), plans_, it);  // most recently used first
      return plans_.front().get();
    }
  // The canary, at the communicator's first plan (its first call that would be compressed; the
  // same call on every rank): this rank's verdict joins the plan's agreement below, so no rank
  // compresses unless every rank's device matched the host codec. It waits for the device once,
  // here; later calls never run it.
  CanaryResult canary;
  if (!canary_agreed_ && device_->needs_canary()) {
    canary = run_canary(device_, settings_.codec_spec, compute_stream_,
                        static_cast<uint64_t>(settings_.seed));
    // Auto may send a bucket as an MX format: those kernels must match the host codec too.
    for (int c = kLadderRungs; settings_.bits_auto && c < kCandidates && !canary.differs; ++c) {
      CanaryResult mx = run_canary(device_, candidate_spec(c), compute_stream_,
                                   static_cast<uint64_t>(settings_.seed));
      if (mx.differs) canary = std::move(mx);
    }
  }
  // A new plan is agreed before any rank uses it: a failure on one rank (an allocation) must
  // not send that rank alone down the pass-through path while its peers compress. Word 0: this
  // rank's planning failure; word 1: its canary failed (0 on a device without one, and after the
  // first plan).
  Status status = Status::kOk;
  std::unique_ptr<Plan> plan = build_plan(call, dtype, bits, spec, &status);
  // A bucket's first plan also sets the bucket up (its mapped statistics copy may fail to
  // allocate on one rank): agreed with the plan, so no rank alone skips the copy.
  if (status == Status::kOk && bucket != nullptr && bucket->job == nullptr && plan->fits)
    status = init_bucket(*bucket, *plan);
  const uint32_t local[2] = {status == Status::kOk ? 0u : 1u, canary.differs ? 1u : 0u};
  uint32_t any[2] = {0, 0};
  *nccl_failure = blocking_max(local, any, 2);
  if (*nccl_failure == ncclSuccess && !canary_agreed_) {
    canary_agreed_ = true;
    canary_ = any[1] != 0 ? Canary::kFailed : canary.ran ? Canary::kPassed : Canary::kNotRun;
    if (canary.differs)
      DQ_WARN(Subsys::kEngine,
              "dynamiq: rank %d of %d: canary: %s on the %s device: this communicator passes "
              "every call through to NCCL (the device's kernels do not reproduce the host codec: "
              "a driver, compiler or architecture they were not checked on)",
              comm_.rank, comm_.nranks, canary.describe().c_str(), device_->name());
    else if (any[1] != 0)
      DQ_WARN(Subsys::kEngine,
              "dynamiq: rank %d of %d: canary: another rank's device does not reproduce the host "
              "codec (its warning names the first differing byte): this communicator passes "
              "every call through to NCCL",
              comm_.rank, comm_.nranks);
  }
  if (*nccl_failure != ncclSuccess || any[0] != 0 || canary_ == Canary::kFailed) {
    if (*nccl_failure == ncclSuccess && any[0] != 0)
      DQ_WARN(Subsys::kEngine,
              "dynamiq: rank %d: a plan for %zu elements could not be made on %s (this rank: "
              "%s); the call passes through on every rank and the next one retries",
              comm_.rank, count, local[0] ? "this rank" : "another rank",
              local[0] ? status_name(status) : "ok");
    retire(std::move(plan));
    if (bucket != nullptr) release_bucket(*bucket);
    return nullptr;
  }
  plans_.push_front(std::move(plan));
  if (plans_.size() > kMaxPlans) {
    retire(std::move(plans_.back()));
    plans_.pop_back();
  }
  return plans_.front().get();
}

// ---- the budget (docs/ENGINE.md section 10) ---------------------------------------------------
Engine::Bucket* Engine::bucket_for(const CallArgs& call, DType dtype) {
  for (auto it = buckets_.begin(); it != buckets_.end(); ++it) {
    const Bucket& b = **it;
    if (b.count == call.count && b.dtype == dtype && b.collective == call.collective &&
        b.root == call.root) {
      buckets_.splice(buckets_.begin(), buckets_, it);  // most recently used first
      return buckets_.front().get();
    }
  }
  // Every rank makes the same calls, so every rank creates and evicts the same buckets.
  if (buckets_.size() >= kMaxBuckets) {
    release_bucket(*buckets_.back());
    buckets_.pop_back();
  }
  auto b = std::make_unique<Bucket>();
  b->collective = call.collective;
  b->root = call.root;
  b->count = call.count;
  b->dtype = dtype;
  buckets_.push_front(std::move(b));
  return buckets_.front().get();
}

Status Engine::init_bucket(Bucket& b, const Plan& p) {
  b.parts.clear();
  b.rung = -1;
  b.stats_pending = false;
  for (const Plan::Block& blk : p.blocks)
    for (const Plan::Part& part : blk.parts) {
      Bucket::Part bp;
      bp.count = part.count;
      bp.stats_offset = part.stats_offset;
      bp.chunks = blk.parts.size() > 1 ? 1 : p.program.schedule.n_chunks;
      b.parts.push_back(bp);
    }
  b.stats_words = p.stats_words;
  const topo::Schedule& schedule = p.program.schedule;
  const HopTables* hop = nullptr;
  for (const auto& [kind, tables] : hop_tables_)
    if (kind == schedule.kind) hop = &tables;
  if (hop == nullptr) hop = &hop_tables_.emplace_back(schedule.kind, hop_profile(schedule)).second;
  // The mapped block: the job, its parts, the hop tables, the result (each a multiple of 8
  // bytes).
  const size_t parts_at = sizeof(BudgetJob);
  const size_t hop_at = parts_at + b.parts.size() * sizeof(BudgetPartJob);
  const size_t hop_entries = hop->linear.size();
  const size_t result_at = hop_at + 2 * hop_entries * sizeof(double);
  static_assert(sizeof(BudgetJob) % 8 == 0 && sizeof(BudgetPartJob) % 8 == 0, "alignment");
  DQ_CHECK(device_->alloc_mapped(result_at + sizeof(BudgetResult), &b.budget_block));
  auto* base = static_cast<unsigned char*>(b.budget_block);
  b.job = new (base) BudgetJob();
  b.part_jobs = reinterpret_cast<BudgetPartJob*>(base + parts_at);
  auto* hop_linear = reinterpret_cast<double*>(base + hop_at);
  std::copy(hop->linear.begin(), hop->linear.end(), hop_linear);
  std::copy(hop->square.begin(), hop->square.end(), hop_linear + hop_entries);
  b.result = new (base + result_at) BudgetResult();
  b.job->n_parts = static_cast<uint32_t>(b.parts.size());
  b.job->n_workers = comm_.nranks;
  b.job->auto_budget = settings_.bits_auto ? 1 : 0;
  b.job->hop = HopProfile{hop_linear, hop_linear + hop_entries};
  b.job->target = target_;
  b.job->parts = b.part_jobs;
  for (size_t i = 0; i < b.parts.size(); ++i) {
    const Bucket::Part& bp = b.parts[i];
    BudgetPartJob* job = new (&b.part_jobs[i]) BudgetPartJob();
    job->count = bp.count;
    job->stats_offset = bp.stats_offset;
    // Every rung's plan of every part, made once: auto's prediction then costs no codec.
    for (int c = 0; settings_.bits_auto && c < kCandidates; ++c) {
      bool fits = false;
      if (plan_candidate(c, bp.count, bp.chunks, comm_.nranks,
                         candidate_is_mx(c) ? nullptr : &job->rungs[c], &fits))
        job->fits[c] = fits ? 1 : 0;
    }
  }
  if (metrics_) {
    std::lock_guard<std::mutex> lock(metrics_->budget_mutex);
    std::vector<BucketMetrics>& list = metrics_->budget.buckets;
    bool listed = false;
    for (const BucketMetrics& m : list)
      listed = listed || (m.count == b.count && m.dtype == dtype_label(b.dtype) &&
                          m.collective == collective_name(b.collective) && m.root == b.root);
    if (!listed) {
      if (list.size() >= kMaxBuckets) list.erase(list.begin());
      BucketMetrics m;
      m.collective = collective_name(b.collective);
      m.dtype = dtype_label(b.dtype);
      m.count = b.count;
      m.root = b.root;
      list.push_back(m);
    }
  }
  return Status::kOk;
}

void Engine::release_bucket(Bucket& b) {
  // Stream-ordered: a prediction into it may still be queued on the comm stream.
  if (b.budget_block != nullptr && device_ != nullptr) device_->release(b.budget_block, comm_stream_);
  b.budget_block = nullptr;
  b.job = nullptr;
  b.part_jobs = nullptr;
  b.result = nullptr;
  b.stats_pending = false;
  b.rung = -1;
  b.parts.clear();
  b.calls_since_stats = 0;
}

bool Engine::stage_budget(Bucket& b, const Plan& p) {
  if (b.job == nullptr || b.stats_words != p.stats_words) return false;
  b.job->used_mx = p.mx_error;
  size_t i = 0;
  for (const Plan::Block& blk : p.blocks)
    for (const Plan::Part& part : blk.parts) {
      if (i >= b.parts.size() || part.count != b.parts[i].count) return false;
      DynamiqOptions options;
      if (!p.mx_fallback() && !dynamiq_parameters(*part.codec, &options, &b.part_jobs[i].used))
        return false;
      ++i;
    }
  if (i != b.parts.size()) return false;
  b.result->state = kBudgetPending;
  return true;
}

void Engine::read_bucket(Bucket& b) {
  b.stats_pending = false;
  // Complete: the host waited for the control event recorded after the prediction.
  const BudgetResult r = *b.result;
  if (r.state != kBudgetPredicted) {
    // A non-finite statistic (a poisoned call), or a step that did not run (a failed lane): no
    // prediction, the next call takes the fixed default.
    b.rung = -1;
    return;
  }
  const double vnmse = r.used_vnmse;
  const WidthCounts widths = r.used_widths;  // none for a call sent as MX
  if (settings_.bits_auto) {
    const BudgetPrediction& prediction = r.prediction;
    if (prediction.rung != b.rung)
      DQ_TRACE(Subsys::kEngine,
               "dynamiq: rank %d %s count %zu: %s next (predicted vNMSE %.3g, target %s %.3g)",
               comm_.rank, collective_name(b.collective), b.count,
               candidate_spec(prediction.rung).c_str(),
               prediction.vnmse[prediction.rung], budget_target_name(target_).c_str(),
               prediction.target);
    b.rung = prediction.rung;
  }
  if (check_ && check_->has_call && check_->call_index == b.last_call_index) {
    check_->predicted = vnmse;
    pair_check();  // now, or when the check is read
  }
  ++window_.predicted;
  window_.vnmse += vnmse;
  for (int w = 0; w < 4; ++w) window_.widths[w] += widths.n[w];
  if (!metrics_) return;
  std::lock_guard<std::mutex> lock(metrics_->budget_mutex);
  BudgetMetrics& m = metrics_->budget;
  for (int w = 0; w < 4; ++w) m.widths[w] += widths.n[w];
  ++m.predicted_calls;
  m.predicted_vnmse_sum += vnmse;
  m.predicted_vnmse_last = vnmse;
  for (BucketMetrics& k : m.buckets)
    if (k.count == b.count && k.dtype == dtype_label(b.dtype) &&
        k.collective == collective_name(b.collective) && k.root == b.root)
      k.predicted_vnmse = vnmse;
}

void Engine::note_budget(Bucket& b, const Plan& p) {
  b.bits = p.bits;
  ++b.calls;
  ++window_.calls;
  window_.bits += p.bits;
  if (p.mx_fallback()) ++window_.mx_calls;
  if (metrics_) {
    std::lock_guard<std::mutex> lock(metrics_->budget_mutex);
    BudgetMetrics& m = metrics_->budget;
    m.bits_sum += p.bits;
    ++m.budget_calls;
    if (p.mx_fallback()) ++m.mx_calls;
    for (BucketMetrics& k : m.buckets)
      if (k.count == b.count && k.dtype == dtype_label(b.dtype) &&
          k.collective == collective_name(b.collective) && k.root == b.root) {
        k.budget_bits = p.bits;
        k.codec = p.mx_fallback() ? p.spec : "dynamiq";
        ++k.calls;
      }
  }
  const int64_t every = settings_.summary_calls;
  if (every <= 0 || window_.calls < static_cast<uint64_t>(every)) return;
  const Window w = window_;
  window_ = Window{};
  const double sgs = static_cast<double>(w.widths[0] + w.widths[1] + w.widths[2] + w.widths[3]);
  auto share = [&](int i) { return sgs > 0 ? 100.0 * static_cast<double>(w.widths[i]) / sgs : 0.0; };
  char checked[96] = "";
  if (w.checked > 0)
    std::snprintf(checked, sizeof checked, ", sampled check vNMSE %.3g over %llu calls",
                  w.checked_sq_error / w.checked_energy, static_cast<unsigned long long>(w.checked));
  DQ_INFO(Subsys::kEngine,
          "dynamiq: rank %d/%d budget: %llu calls, %s%s mean %.2f bits, %llu sent as MX, widths "
          "2/4/8/16 bits %.1f/%.1f/%.1f/%.1f%% of super-groups, predicted vNMSE mean %.3g over "
          "%llu calls%s",
          comm_.rank, comm_.nranks, static_cast<unsigned long long>(w.calls),
          settings_.bits_auto ? "auto, target " : "fixed",
          settings_.bits_auto ? (budget_target_name(target_) + ",").c_str() : ",",
          w.bits / static_cast<double>(w.calls), static_cast<unsigned long long>(w.mx_calls),
          share(0), share(1), share(2), share(3),
          w.predicted > 0 ? w.vnmse / static_cast<double>(w.predicted) : 0.0,
          static_cast<unsigned long long>(w.predicted), checked);
}

// ---- the sampled check ----------------------------------------------------------------------

Status Engine::enqueue_check_gather(const CallArgs& call, DType dtype, uint64_t call_index) {
  Check& c = *check_;
  const size_t esize = dtype_size(dtype), bytes = 256 * esize;
  // Whole super-groups only, evenly spaced from an offset drawn per call.
  const size_t full = call.count / 256;
  c.groups = std::min(Check::kSuperGroups, full);
  const size_t stride = full / c.groups;
  const size_t offset = static_cast<size_t>(
      splitmix64(static_cast<uint64_t>(settings_.seed) ^ (call_index << 20)) % full);
  c.first.clear();
  const Lane lane{comm_stream_, control_ + error_word_index()};
  for (size_t i = 0; i < c.groups; ++i) {
    const size_t g = (offset + i * stride) % full;
    c.first.push_back(g * 256);
    DQ_CHECK(device_->copy(static_cast<uint8_t*>(c.in) + i * bytes,
                           static_cast<const uint8_t*>(call.send) + g * bytes, bytes, lane));
  }
  // The codec steps (which may write the output over an in-place input) start after the copies.
  DQ_CHECK(device_->record(c.gathered, comm_stream_));
  DQ_CHECK(device_->wait(compute_stream_, c.gathered));
  c.call_index = call_index;
  c.dtype = dtype;
  c.has_call = true;
  c.sampled = c.predicted = -1;
  c.paired = false;
  return Status::kOk;
}

Status Engine::enqueue_check_finish(const CallArgs& call, uint64_t* wire_bytes) {
  Check& c = *check_;
  const size_t esize = dtype_size(c.dtype), bytes = 256 * esize, elems = c.groups * 256;
  const Lane comm{comm_stream_, control_ + error_word_index()};
  const Lane compute{compute_stream_, control_ + error_word_index()};
  // The exact all-reduce of the sample, after the call's messages on the comm stream (the same
  // place on every rank), with the call's dtype and op.
  const NcclOps ops = ops_;
  ncclComm_t nccl = comm_.comm;
  auto stream = static_cast<cudaStream_t>(comm_stream_);
  const void* in = c.in;
  void* exact = c.exact;
  const ncclDataType_t dtype = call.dtype;
  const ncclRedOp_t op = call.op;
  DQ_CHECK(device_->nccl(
      comm, [=] { return ops.all_reduce(in, exact, elems, dtype, op, nccl, stream); }));
  DQ_CHECK(device_->copy(c.host_exact, c.exact, elems * esize, comm));
  // The output after the call's last codec step (the compute stream is in order).
  for (size_t i = 0; i < c.groups; ++i)
    DQ_CHECK(device_->copy(static_cast<uint8_t*>(c.host_out) + i * bytes,
                           static_cast<const uint8_t*>(call.recv) + c.first[i] * esize, bytes,
                           compute));
  DQ_CHECK(device_->record(c.gathered, compute_stream_));
  DQ_CHECK(device_->wait(comm_stream_, c.gathered));
  DQ_CHECK(device_->record(c.done, comm_stream_));
  c.state = Check::State::kEnqueued;
  const size_t n = static_cast<size_t>(comm_.nranks);
  *wire_bytes += 2 * elems * esize * (n - 1) / n;
  return Status::kOk;
}

void Engine::read_check() {
  Check& c = *check_;
  c.state = Check::State::kNone;
  double err = 0, energy = 0;
  bool finite = true;
  for (size_t i = 0; i < c.groups * 256 && finite; ++i) {
    double out, exact;
    if (c.dtype == DType::kF32) {
      out = static_cast<const float*>(c.host_out)[i];
      exact = static_cast<const float*>(c.host_exact)[i];
    } else {
      out = bf16_to_f32(static_cast<const uint16_t*>(c.host_out)[i]);
      exact = bf16_to_f32(static_cast<const uint16_t*>(c.host_exact)[i]);
    }
    finite = std::isfinite(out) && std::isfinite(exact);
    err += (out - exact) * (out - exact);
    energy += exact * exact;
  }
  // A non-finite value (the input held one: the output shows it, as it must) or an all-zero
  // sample gives no vNMSE.
  const bool usable = finite && energy > 0;
  if (usable) {
    c.sampled = err / energy;
    ++window_.checked;
    window_.checked_sq_error += err;
    window_.checked_energy += energy;
  }
  if (metrics_) {
    std::lock_guard<std::mutex> lock(metrics_->budget_mutex);
    BudgetMetrics& m = metrics_->budget;
    if (!usable) {
      ++m.checked_nonfinite;
    } else {
      ++m.checked_calls;
      m.checked_sq_error += err;
      m.checked_energy += energy;
      m.checked_vnmse_last = c.sampled;
    }
  }
  DQ_TRACE(Subsys::kEngine, "dynamiq: rank %d check of call %llu: sampled vNMSE %.4g over %zu "
           "super-groups", comm_.rank, static_cast<unsigned long long>(c.call_index),
           usable ? c.sampled : -1.0, c.groups);
  pair_check();
}

void Engine::pair_check() {
  Check& c = *check_;
  if (c.paired || c.sampled < 0 || c.predicted < 0) return;
  c.paired = true;
  if (metrics_) {
    std::lock_guard<std::mutex> lock(metrics_->budget_mutex);
    BudgetMetrics& m = metrics_->budget;
    ++m.paired_calls;
    m.paired_predicted_sum += c.predicted;
    m.paired_sampled_sum += c.sampled;
  }
  DQ_INFO(Subsys::kEngine,
          "dynamiq: rank %d/%d sampled check of call %llu: vNMSE %.4g over %zu super-groups, "
          "predicted %.4g (sampled/predicted %.2f)",
          comm_.rank, comm_.nranks, static_cast<unsigned long long>(c.call_index), c.sampled,
          c.groups, c.predicted, c.predicted > 0 ? c.sampled / c.predicted : 0.0);
}

// ---- agreement ----------------------------------------------------------------------------
ncclResult_t Engine::fail_async(uint32_t word) {
  if (broken_ != ncclSuccess) return broken_;
  if (error_source(word) == ErrorSource::kNccl) {
    broken_ = static_cast<ncclResult_t>(error_code(word));
    DQ_WARN(Subsys::kEngine, "dynamiq: rank %d: an enqueued NCCL call failed: %s", comm_.rank,
            ops_.error_string(broken_));
  } else {
    const Status s = static_cast<Status>(error_code(word));
    broken_ = engine_failure(s);
    DQ_WARN(Subsys::kEngine,
            "dynamiq: rank %d: a codec step failed on the device (%s); the communicator "
            "reports it as its asynchronous error",
            comm_.rank, status_name(s));
  }
  return broken_;
}

ncclResult_t Engine::async_error() {
  if (broken_ != ncclSuccess || control_ == nullptr) return broken_;
  const uint32_t word = __atomic_load_n(control_ + error_word_index(), __ATOMIC_ACQUIRE);
  return word != 0 ? fail_async(word) : ncclSuccess;
}

ncclResult_t Engine::wait_for_peers(EventHandle e, const char* what) {
  const Status s = device_->synchronize_for(e, settings_.timeout_ms);
  const bool aborted = aborted_ != nullptr && aborted_->load(std::memory_order_acquire);
  if (s == Status::kOk && !aborted) return ncclSuccess;
  // Work of this communicator may still be queued behind `e`: nothing of it is read, and every
  // later call returns the error until the application aborts the communicator (as it does when
  // NCCL reports a failed peer). kTimeout answers ncclRemoteError, as the CPU NCCL does.
  if (broken_ == ncclSuccess) {
    broken_ = aborted ? ncclInvalidUsage : engine_failure(s);
    if (aborted)
      DQ_WARN(Subsys::kEngine,
              "dynamiq: rank %d: the communicator was aborted while this call waited for %s; "
              "it enqueues nothing more and returns NCCL error %d (%s)",
              comm_.rank, what, static_cast<int>(broken_), ops_.error_string(broken_));
    else if (s == Status::kTimeout)
      DQ_WARN(Subsys::kEngine,
              "dynamiq: rank %d: %s did not complete within DYNAMIQ_TIMEOUT_MS = %lld ms (a peer "
              "stopped answering?); the communicator returns NCCL error %d (%s) until it is "
              "aborted",
              comm_.rank, what, static_cast<long long>(settings_.timeout_ms),
              static_cast<int>(broken_), ops_.error_string(broken_));
    else
      DQ_WARN(Subsys::kEngine,
              "dynamiq: rank %d: waiting for %s failed (%s); the communicator "
              "returns NCCL error %d (%s) until it is aborted",
              comm_.rank, what, status_name(s), static_cast<int>(broken_),
              ops_.error_string(broken_));
  }
  return broken_;
}

ncclResult_t Engine::blocking_max(const uint32_t* in, uint32_t* out, int n) {
  uint32_t* send = control_;
  uint32_t* recv = control_ + scratch_words();
  std::memcpy(send, in, static_cast<size_t>(n) * 4);
  const Lane lane{comm_stream_, control_ + error_word_index()};
  const NcclOps ops = ops_;
  ncclComm_t comm = comm_.comm;
  auto stream = static_cast<cudaStream_t>(comm_stream_);
  if (device_->nccl(lane,
                    [=] {
                      return ops.all_reduce(send, recv, static_cast<size_t>(n), ncclUint32, ncclMax,
                                            comm, stream);
                    }) != Status::kOk ||
      device_->record(ev_comm_done_, comm_stream_) != Status::kOk)
    return ncclSystemError;
  if (const ncclResult_t r = wait_for_peers(ev_comm_done_, "a blocking control all-reduce");
      r != ncclSuccess)
    return r;
  if (const ncclResult_t r = async_error(); r != ncclSuccess) return r;
  std::memcpy(out, recv, static_cast<size_t>(n) * 4);
  return ncclSuccess;
}

ncclResult_t Engine::handshake() {
  LocalControl local{&settings_, settings_valid_, opted_in_, comm_.rank == 0, read_switch(), false};
  std::vector<uint32_t> words(control_words()), reduced(control_words());
  pack_control(local, words.data());
  const ncclResult_t r = blocking_max(words.data(), reduced.data(), control_words());
  if (r != ncclSuccess) {
    DQ_WARN(Subsys::kEngine, "dynamiq: handshake all-reduce failed: %s", ops_.error_string(r));
    return r;
  }
  const ControlDecision d = decide_control(reduced.data());
  if (!d.agreed) {
    warn_differs(d.differs);
    state_ = State::kInert;
  } else {
    state_ = d.settings_enabled ? State::kAgreed : State::kInert;
  }
  switch_agreed_ = d.switch_on;
  DQ_INFO(Subsys::kEngine, "dynamiq: handshake rank %d/%d: %s", comm_.rank, comm_.nranks,
          state_ == State::kAgreed ? "compression on" : "pass-through");
  return ncclSuccess;
}

// A rank whose device could not be set up still answers its peers' handshake, with invalid
// settings, so that every rank passes the communicator's calls through (rather than its peers
// waiting in a handshake it never joins). Host words, through the real NCCL on the caller's
// stream, waited for as the CPU NCCL does it.
ncclResult_t Engine::handshake_without_device(cudaStream_t stream) {
  LocalControl local{&settings_, false, opted_in_, comm_.rank == 0, true, false};
  std::vector<uint32_t> words(control_words()), reduced(control_words());
  pack_control(local, words.data());
  const ncclResult_t r = ops_.all_reduce(words.data(), reduced.data(), words.size(), ncclUint32,
                                         ncclMax, comm_.comm, stream);
  if (r != ncclSuccess) return r;
  state_ = State::kInert;
  return ncclSuccess;
}

// One call late: the words of the previous eligible call (its A/B switch) and this rank's error
// word, read after waiting for the previous call's control all-reduce, before anything of this
// call is enqueued.
ncclResult_t Engine::absorb_previous_call() {
  if (control_pending_) {
    if (const ncclResult_t r =
            wait_for_peers(ev_control_, "the previous call's control all-reduce");
        r != ncclSuccess)
      return r;
    const bool on = decide_call_switch(control_ + call_recv_word(control_parity_));
    if (on != switch_agreed_)
      DQ_INFO(Subsys::kEngine, "dynamiq: rank %d: the A/B switch turns compression %s", comm_.rank,
              on ? "on" : "off");
    switch_agreed_ = on;
    control_pending_ = false;
    // That control event came after the comm stream waited for an armed check: it is complete.
    if (check_ && check_->state == Check::State::kArmed) read_check();
  }
  return async_error();
}

Status Engine::enqueue_call_control(const uint16_t* stats_local, uint16_t* stats_reduced,
                                    size_t stats_words, Bucket* predict,
                                    uint64_t* wire_bytes) {
  control_parity_ ^= 1;
  uint32_t* send = control_ + call_send_word();
  uint32_t* recv = control_ + call_recv_word(control_parity_);
  const Lane lane{comm_stream_, control_ + error_word_index()};
  const NcclOps ops = ops_;
  ncclComm_t comm = comm_.comm;
  auto stream = static_cast<cudaStream_t>(comm_stream_);
  // A check enqueued by an earlier call: this control event comes after it, so the host's wait
  // for this event (or a later one) finds the check's copies complete. No host wait here.
  const bool arm = check_ && check_->state == Check::State::kEnqueued;
  if (arm) DQ_CHECK(device_->wait(comm_stream_, check_->done));
  DQ_CHECK(device_->nccl(lane, [=] {
    ncclResult_t r = ops.group_start();
    if (r == ncclSuccess && stats_words > 0)
      r = ops.all_reduce(stats_local, stats_reduced, stats_words, ncclBfloat16, ncclSum, comm,
                         stream);
    if (r == ncclSuccess)
      r = ops.all_reduce(send, recv, kCallControlWords, ncclUint32, ncclMax, comm, stream);
    const ncclResult_t end = ops.group_end();
    return r == ncclSuccess ? end : r;
  }));
  // The budget's prediction from the reduced statistics, on the device, before the control
  // event: the host reads it once it has waited for this event or a later one (the one-call-late
  // wait). The host never reads the statistics.
  if (predict != nullptr && stats_words > 0)
    DQ_CHECK(device_->predict_budget(predict->job, stats_reduced, budget_scratch_, predict->result,
                                     lane));
  DQ_CHECK(device_->record(ev_control_, comm_stream_));
  control_pending_ = true;
  if (arm) check_->state = Check::State::kArmed;
  // As a ring all-reduce sends them: 2 (n-1)/n of the words.
  const size_t n = static_cast<size_t>(comm_.nranks);
  *wire_bytes += (2 * stats_words * 2 + kCallControlWords * 4) * (n - 1) / n;
  return Status::kOk;
}

// ---- the compressed all-reduce --------------------------------------------------------------
Status Engine::enqueue_compute(Plan& p, int block, int stage, const CallArgs& call,
                               uint64_t call_index) {
  Plan::Block& b = p.blocks[block];
  const Program::Stage& st = p.program.stages[stage];
  const Lane lane{compute_stream_, control_ + error_word_index()};
  const size_t esize = dtype_size(p.dtype);
  auto slot = [&](int s) { return b.arena + static_cast<size_t>(s) * b.cap; };
  switch (st.kind) {
    case Program::StageKind::kReduce:
    case Program::StageKind::kSink:
      for (const Program::HopJob& h : st.hops) {
        int local = 0;
        const Plan::Part& part = p.part_of(b, h.chunk, &local);
        const ConstTensor own{static_cast<const uint8_t*>(call.send) + part.in_begin * esize,
                              p.dtype, part.count};
        for (size_t i = 0; i < h.in_slots.size(); ++i)
          p.inputs[i] = ByteView{slot(h.in_slots[i]), b.cap};
        RoundingKey key = h.key;
        key.call = call_index;
        key.element_base = part.key_base;  // draws keyed by the element, never by the block
        DQ_CHECK(device_->hop(*part.codec, part.layout, local, own, p.inputs.data(),
                              static_cast<int>(h.in_slots.size()), slot(h.out_slot), key, lane));
      }
      return Status::kOk;
    case Program::StageKind::kGather:
      for (const Program::Xfer& x : st.sends)
        if (!gather_in_place(x))
          for (size_t j = 0; j < x.chunks.size(); ++j)
            DQ_CHECK(device_->copy(slot(x.first_slot + static_cast<int>(j)), slot(x.chunks[j]),
                                   b.cap, lane));
      return Status::kOk;
    case Program::StageKind::kFinish: {
      const ReduceOp op = call.op == ncclAvg ? ReduceOp::kAvg : ReduceOp::kSum;
      // finish() writes the chunk's elements at their positions in a tensor of part.count
      // elements starting at out_begin.
      for (int c : p.program.finish_chunks) {
        int local = 0;
        const Plan::Part& part = p.part_of(b, c, &local);
        void* out = static_cast<uint8_t*>(call.recv) + part.out_begin * esize;
        DQ_CHECK(device_->finish(*part.codec, part.layout, local, ByteView{slot(c), b.cap}, out,
                                 p.dtype, op, comm_.nranks, lane));
      }
      return Status::kOk;
    }
  }
  return Status::kInternal;
}

Status Engine::enqueue_comm(Plan& p, int block, int stage, uint64_t* wire_bytes) {
  Plan::Block& b = p.blocks[block];
  const Program::Stage& st = p.program.stages[stage];
  const Lane lane{comm_stream_, control_ + error_word_index()};
  auto slot = [&](int s) { return b.arena + static_cast<size_t>(s) * b.cap; };
  struct Message {
    uint8_t* buffer;
    size_t bytes;
    int peer;
    bool send;
  };
  std::vector<Message> messages;
  for (const Program::Xfer& x : st.sends) {
    messages.push_back({slot(x.first_slot), x.chunks.size() * b.cap, x.peer, true});
    *wire_bytes += x.chunks.size() * b.cap;
  }
  for (const Program::Xfer& x : st.recvs)
    messages.push_back({slot(x.first_slot), x.chunks.size() * b.cap, x.peer, false});
  const NcclOps ops = ops_;
  ncclComm_t comm = comm_.comm;
  auto stream = static_cast<cudaStream_t>(comm_stream_);
  DQ_CHECK(device_->nccl(lane, [=] {
    ncclResult_t r = ops.group_start();
    for (const Message& m : messages) {
      if (r != ncclSuccess) break;
      r = m.send ? ops.send(m.buffer, m.bytes, ncclUint8, m.peer, comm, stream)
                 : ops.recv(m.buffer, m.bytes, ncclUint8, m.peer, comm, stream);
    }
    const ncclResult_t end = ops.group_end();
    return r == ncclSuccess ? end : r;
  }));
  if (st.kind == Program::StageKind::kGather)
    for (const Program::Xfer& x : st.recvs)
      if (!gather_in_place(x))
        for (size_t j = 0; j < x.chunks.size(); ++j)
          DQ_CHECK(device_->copy(slot(x.chunks[j]), slot(x.first_slot + static_cast<int>(j)), b.cap,
                                 lane));
  return Status::kOk;
}

Status Engine::enqueue_compressed(Plan& p, const CallArgs& call, uint64_t call_index,
                                  bool with_stats, Bucket* predict, uint64_t* wire_bytes) {
  const Lane compute{compute_stream_, control_ + error_word_index()};
  const size_t esize = dtype_size(p.dtype);
  // Statistics on the compute stream, their all-reduce (with the call's control word) on the
  // comm stream, then every block's layout from the reduced statistics.
  // An MX fallback's statistics (its codec needs none) only `with_stats`.
  for (Plan::Block& b : p.blocks)
    for (Plan::Part& part : b.parts)
      if (part.stats_source().stats_words() > 0 && (with_stats || !part.stats_codec)) {
        const ConstTensor own{static_cast<const uint8_t*>(call.send) + part.in_begin * esize,
                              p.dtype, part.count};
        DQ_CHECK(device_->local_stats(part.stats_source(), own,
                                      p.stats_local + part.stats_offset, compute));
      }
  DQ_CHECK(device_->record(ev_stats_, compute_stream_));
  DQ_CHECK(device_->wait(comm_stream_, ev_stats_));
  const bool skip_stats = p.mx_fallback() && !with_stats;
  DQ_CHECK(enqueue_call_control(p.stats_local, p.stats_reduced, skip_stats ? 0 : p.stats_words,
                                skip_stats ? nullptr : predict, wire_bytes));
  DQ_CHECK(device_->record(ev_reduced_, comm_stream_));
  DQ_CHECK(device_->wait(compute_stream_, ev_reduced_));
  for (Plan::Block& b : p.blocks)
    for (Plan::Part& part : b.parts)
      DQ_CHECK(device_->build_layout(
          *part.codec, part.codec->stats_words() ? p.stats_reduced + part.stats_offset : nullptr,
          call_index, part.layout, compute));

  // Units (stage, block) in stage-major order: codec steps on the compute stream, messages on
  // the comm stream. A block's step waits for its own previous messages only, so the compute
  // stream runs ahead (the next block's hops, all leaf compressions) while messages fly.
  const int n_blocks = static_cast<int>(p.blocks.size());
  const int n_stages = static_cast<int>(p.program.stages.size());
  DQ_CHECK(ensure_events(2 * static_cast<size_t>(n_stages) * n_blocks));
  std::fill(p.block_wait.begin(), p.block_wait.end(), nullptr);
  for (int s = 0; s < n_stages; ++s)
    for (int b = 0; b < n_blocks; ++b) {
      const size_t u = static_cast<size_t>(s) * n_blocks + b;
      if (p.block_wait[b]) DQ_CHECK(device_->wait(compute_stream_, p.block_wait[b]));
      p.block_wait[b] = nullptr;
      DQ_CHECK(enqueue_compute(p, b, s, call, call_index));
      const Program::Stage& st = p.program.stages[s];
      if (st.sends.empty() && st.recvs.empty()) continue;
      DQ_CHECK(device_->record(ev_units_[2 * u], compute_stream_));
      DQ_CHECK(device_->wait(comm_stream_, ev_units_[2 * u]));
      DQ_CHECK(enqueue_comm(p, b, s, wire_bytes));
      DQ_CHECK(device_->record(ev_units_[2 * u + 1], comm_stream_));
      p.block_wait[b] = ev_units_[2 * u + 1];
    }
  return Status::kOk;
}

ncclResult_t Engine::run(const CallArgs& call, PassReason* reason) {
  const auto t0 = std::chrono::steady_clock::now();
  *reason = PassReason::kSingleRank;
  if (broken_ != ncclSuccess) return broken_;
  if (comm_.nranks >= 2 && device_ != nullptr) {
    if (const ncclResult_t r = absorb_previous_call(); r != ncclSuccess) return r;
    if (state_ == State::kPending && !call.in_group && !call.capturing &&
        !device_->capturing(call.stream))
      if (const ncclResult_t r = handshake(); r != ncclSuccess) return r;
  }
  if (comm_.nranks >= 2 && setup_failed_ && state_ == State::kPending && !call.in_group &&
      !call.capturing)
    if (const ncclResult_t r = handshake_without_device(call.stream); r != ncclSuccess) return r;
  *reason = screen(call);
  if (*reason != PassReason::kRerouted) {
    count(*reason);
    return ncclSuccess;
  }
  // From here on every rank takes the same branch: the switch was agreed one call ago, plans are
  // agreed when made.
  uint64_t wire = 0;
  pack_call_control(comm_.rank == 0, read_switch(), control_ + call_send_word());
  if (!switch_agreed_) {
    // Passes through, but still carries this call's switch word, so switching back on works.
    Status s = device_->record(ev_start_, call.stream);
    if (s == Status::kOk) s = device_->wait(comm_stream_, ev_start_);
    if (s == Status::kOk) s = enqueue_call_control(nullptr, nullptr, 0, nullptr, &wire);
    if (s == Status::kOk) s = device_->record(ev_comm_done_, comm_stream_);
    if (s == Status::kOk) s = device_->wait(call.stream, ev_comm_done_);
    if (s != Status::kOk) return engine_failure(s);
    *reason = PassReason::kSwitchOff;
    count(*reason);
    return async_error();
  }
  const DType dtype = call.dtype == ncclFloat32 ? DType::kF32 : DType::kBF16;
  // The budget: the fixed one, or auto's choice from this bucket's previous call. Its
  // statistics are complete: absorb_previous_call() waited for the latest control all-reduce,
  // which the comm stream ran after them. Nothing is enqueued between that wait and this read.
  Bucket* bucket = settings_.codec == "dynamiq" ? bucket_for(call, dtype) : nullptr;
  double bits = settings_.budget_bits;
  std::string spec = settings_.codec_spec;
  bool with_stats = true;
  if (bucket != nullptr) {
    if (bucket->stats_pending) read_bucket(*bucket);
    if (settings_.bits_auto && bucket->rung >= 0) {
      bits = candidate_bits(bucket->rung);
      // The settings' own spec at its own budget; another rung of the same codec; or MX.
      if (candidate_is_mx(bucket->rung))
        spec = candidate_spec(bucket->rung);
      else if (bits != settings_.budget_bits)
        spec = candidate_spec(bucket->rung) + (settings_.correlated ? "" : ":corr=0");
      with_stats = !candidate_is_mx(bucket->rung) ||
                   bucket->calls_since_stats + 1 >= kMxStatisticsEvery;
    }
  }
  ncclResult_t nccl_failure;
  Plan* plan = plan_for(call, dtype, bits, spec, bucket, &nccl_failure);
  if (nccl_failure != ncclSuccess) return nccl_failure;
  if (plan == nullptr || !plan->fits) {
    *reason = canary_ == Canary::kFailed ? PassReason::kCanaryFailed
              : plan == nullptr          ? PassReason::kFailure
                                         : PassReason::kOverBudget;
    count(*reason);
    return ncclSuccess;
  }
  const uint64_t call_index = call_seq_++;
  // The job of this call's prediction, in mapped memory before the call's first enqueue.
  Bucket* predict = bucket != nullptr && with_stats && stage_budget(*bucket, *plan) ? bucket : nullptr;
  Status s = device_->record(ev_start_, call.stream);
  if (s == Status::kOk) s = device_->wait(comm_stream_, ev_start_);
  if (s == Status::kOk) s = device_->wait(compute_stream_, ev_start_);
  // The sampled check: every DYNAMIQ_CHECK_EVERY-th compressed call, an all-reduce, one check
  // in flight at a time. Every input of this decision is identical on every rank.
  const bool checking = check_ && check_->state == Check::State::kNone &&
                        call.collective == Collective::kAllReduce && call.count >= 256 &&
                        (call_index + 1) % static_cast<uint64_t>(settings_.check_every) == 0;
  if (s == Status::kOk && checking) s = enqueue_check_gather(call, dtype, call_index);
  if (s == Status::kOk)
    s = enqueue_compressed(*plan, call, call_index, with_stats, predict, &wire);
  if (s == Status::kOk && checking) s = enqueue_check_finish(call, &wire);
  // The caller's stream waits for both engine streams: later work on it (or, on the host device,
  // the caller itself) sees the result. This is the call's last enqueue.
  if (s == Status::kOk) s = device_->record(ev_compute_done_, compute_stream_);
  if (s == Status::kOk) s = device_->record(ev_comm_done_, comm_stream_);
  if (s == Status::kOk) s = device_->wait(call.stream, ev_compute_done_);
  if (s == Status::kOk) s = device_->wait(call.stream, ev_comm_done_);
  if (s != Status::kOk) {
    DQ_WARN(Subsys::kEngine, "dynamiq: rank %d: enqueueing call %llu failed: %s", comm_.rank,
            static_cast<unsigned long long>(call_index), status_name(s));
    return engine_failure(s);
  }
  // A lazy read after the last enqueue: on the host device the call is complete, so a failure in
  // it is reported now; on a GPU it shows here or on a later call.
  if (const ncclResult_t r = async_error(); r != ncclSuccess) return r;
  const auto t_end = std::chrono::steady_clock::now();
  DQ_TRACE(Subsys::kEngine, "dynamiq: call %llu rank %d count %zu: %.2f ms, %llu bytes sent",
           static_cast<unsigned long long>(call_index), comm_.rank, call.count,
           std::chrono::duration<double, std::milli>(t_end - t0).count(),
           static_cast<unsigned long long>(wire));
  count(PassReason::kRerouted);
  if (bucket != nullptr) {
    bucket->stats_pending = predict != nullptr;
    bucket->calls_since_stats = with_stats ? 0 : bucket->calls_since_stats + 1;
    bucket->last_call_index = call_index;
    note_budget(*bucket, *plan);
  }
  if (metrics_) {
    metrics_->bytes_in.fetch_add(call.count * dtype_size(dtype), std::memory_order_relaxed);
    metrics_->wire_bytes.fetch_add(wire, std::memory_order_relaxed);
    metrics_->nanoseconds.fetch_add(
        static_cast<uint64_t>(
            std::chrono::duration_cast<std::chrono::nanoseconds>(t_end - t0).count()),
        std::memory_order_relaxed);
  }
  return ncclSuccess;
}

}  // namespace dq::engine

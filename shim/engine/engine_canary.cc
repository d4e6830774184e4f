// The canary (docs/ENGINE.md section 6): a device whose codec steps are not the host codec's own
// code runs a fixed tensor through them once per communicator, and its bytes must equal the host
// codec's.
#include <cmath>
#include <cstdio>
#include <cstring>

#include "kernels/bf16.h"
#include "kernels/stats_sum.h"
#include "shim/engine/engine_internal.h"

namespace dq::engine {
namespace {

constexpr int W = kCanaryWorkers, C = kCanaryChunks;

// One image holds every buffer the device reads or writes, each at a 256-byte boundary: it goes
// to the device in one copy and comes back in one. Offsets are bytes into the image.
struct CanaryImage {
  struct Region {
    std::string name;
    size_t at = 0, bytes = 0;
    bool output = false;  // written by a step (compared first); else an input it must not touch
  };
  std::vector<Region> regions;
  size_t bytes = 0;
  size_t stats_words = 0, layout_bytes = 0, cap = 0;
  size_t x_at[W], stats_at[W], reduced_at = 0, layout_out = 0, layout_in = 0;
  size_t leaf_out[C][W - 1], leaf_in[C][W - 1], hop_out[C], hop_in[C], finish_out = 0;

  size_t place(std::string name, size_t size, bool output) {
    regions.push_back({std::move(name), bytes, size, output});
    bytes += (size + 255) / 256 * 256;
    return regions.back().at;
  }
  ConstTensor input(uint8_t* base, int w) const {
    return ConstTensor{base + x_at[w], DType::kF32, kCanaryCount};
  }
};

CanaryImage lay_out_canary(const Codec& codec) {
  CanaryImage im;
  im.stats_words = codec.stats_words();
  im.cap = codec.chunk_capacity();
  im.layout_bytes = codec.layout_bytes();
  const size_t x_bytes = kCanaryCount * 4;
  for (int w = 0; w < W; ++w)
    im.x_at[w] = im.place("input of worker " + std::to_string(w), x_bytes, false);
  for (int w = 0; w < W; ++w)
    im.stats_at[w] =
        im.place("statistics of worker " + std::to_string(w), im.stats_words * 2, true);
  im.reduced_at = im.place("reduced statistics", im.stats_words * 2, false);
  im.layout_out = im.place("layout", im.layout_bytes, true);
  im.layout_in = im.place("layout input", im.layout_bytes, false);
  for (int c = 0; c < C; ++c) {
    const std::string chunk = " (chunk " + std::to_string(c) + ")";
    for (int w = 0; w < W - 1; ++w) {
      im.leaf_out[c][w] =
          im.place("leaf payload of worker " + std::to_string(w) + chunk, im.cap, true);
      im.leaf_in[c][w] = im.place("leaf input" + chunk, im.cap, false);
    }
    im.hop_out[c] = im.place("hop payload" + chunk, im.cap, true);
    im.hop_in[c] = im.place("hop input" + chunk, im.cap, false);
  }
  im.finish_out = im.place("finished output", x_bytes, true);
  return im;
}

// The rounding key of `worker`'s step. The leaves of one chunk are roundings of equal height (no
// leaf's output feeds another), stratified as the engine's trees stratify them: correlated
// rounding's permutation and stratum classes are canaried too. The hop that sums them rounds
// plainly.
RoundingKey canary_key(uint64_t seed, int worker, bool leaf) {
  RoundingKey k;
  k.seed = seed;
  k.rank = static_cast<uint32_t>(worker);
  if (leaf) {
    k.strata = static_cast<uint32_t>(W - 1);
    k.stratum = static_cast<uint32_t>(worker);
  }
  return k;
}

// The host codec's bytes, straight from the codec: every output, and the inputs of each device
// step (so each step is compared on its own). False when a host step failed.
bool run_canary_on_host(const Codec& codec, const CanaryImage& im, uint64_t seed,
                        std::vector<uint8_t>* image) {
  image->assign(im.bytes, 0);
  uint8_t* host = image->data();
  for (int w = 0; w < W; ++w) {
    const std::vector<float> x = canary_tensor(w);
    std::memcpy(host + im.x_at[w], x.data(), kCanaryCount * 4);
  }
  bool ok = true;
  auto host_step = [&ok](Status s) { ok = ok && s == Status::kOk; };
  const size_t words = im.stats_words, cap = im.cap;
  if (words > 0) {
    StatsSum sum(words, codec.stats_byte_sum_words());
    for (int w = 0; w < W; ++w) {
      auto* stats = reinterpret_cast<uint16_t*>(host + im.stats_at[w]);
      host_step(codec.local_stats(im.input(host, w), stats));
      sum.add(stats);
    }
    sum.result(reinterpret_cast<uint16_t*>(host + im.reduced_at), true);
  }
  const auto* reduced =
      words > 0 ? reinterpret_cast<const uint16_t*>(host + im.reduced_at) : nullptr;
  host_step(codec.build_layout(reduced, 0, host + im.layout_out));
  std::memcpy(host + im.layout_in, host + im.layout_out, im.layout_bytes);
  const uint8_t* layout = host + im.layout_in;
  for (int c = 0; ok && c < C; ++c) {
    for (int w = 0; w < W - 1; ++w) {
      host_step(codec.fused_hop(layout, c, im.input(host, w), nullptr, 0, host + im.leaf_out[c][w],
                                canary_key(seed, w, true)));
      std::memcpy(host + im.leaf_in[c][w], host + im.leaf_out[c][w], cap);
    }
    const ByteView in[2] = {{host + im.leaf_in[c][0], cap}, {host + im.leaf_in[c][1], cap}};
    host_step(codec.fused_hop(layout, c, im.input(host, W - 1), in, 2, host + im.hop_out[c],
                              canary_key(seed, W - 1, false)));
    std::memcpy(host + im.hop_in[c], host + im.hop_out[c], cap);
    host_step(codec.decode_finish(layout, c, ByteView{host + im.hop_in[c], cap},
                                  host + im.finish_out, DType::kF32, ReduceOp::kSum, W));
  }
  return ok;
}

// The statistics and layout steps as a plan's calls run them (Device::prepare_parts): every
// worker's statistics as the parts of one list (their inputs at their offsets in the image), so
// the device's batch kernels are what is compared; the layout of the one codec as another.
struct CanaryParts {
  std::unique_ptr<PreparedParts> stats, layout;
};

Status prepare_canary_parts(Device* device, const PreparedCodec& codec, const CanaryImage& im,
                            uint8_t* dev, CanaryParts* out) {
  const bool has_stats = im.stats_words > 0;
  std::vector<PartSteps> stats;
  for (int w = 0; w < W && has_stats; ++w) {
    PartSteps part;
    part.codec = part.stats_codec = &codec;
    part.offset = im.x_at[w] / sizeof(float);  // elements of the image, as FP32
    part.count = kCanaryCount;
    part.stats = reinterpret_cast<uint16_t*>(dev + im.stats_at[w]);
    stats.push_back(part);
  }
  PartSteps layout;
  layout.codec = &codec;
  layout.count = kCanaryCount;
  layout.reduced = has_stats ? reinterpret_cast<const uint16_t*>(dev + im.reduced_at) : nullptr;
  layout.layout = dev + im.layout_out;
  DQ_CHECK(device->prepare_parts(std::move(stats), DType::kF32, &out->stats));
  return device->prepare_parts({layout}, DType::kF32, &out->layout);
}

// The device's steps on `dev` (the image in device memory), fed the host's inputs. Every step is
// enqueued even after one failed; the first failure is returned.
Status enqueue_canary_steps(Device* device, const PreparedCodec& codec, const CanaryParts& parts,
                            const CanaryImage& im, uint8_t* dev, uint64_t seed, Lane lane) {
  Status s = Status::kOk;
  auto step = [&s](Status enqueued) {
    if (s == Status::kOk) s = enqueued;
  };
  const size_t cap = im.cap;
  static_assert(sizeof(float) == 4, "the image's inputs are FP32");
  step(device->parts_stats(*parts.stats, dev, lane));
  step(device->parts_layouts(*parts.layout, 0, lane));
  const uint8_t* layout = dev + im.layout_in;
  for (int c = 0; c < C; ++c) {
    for (int w = 0; w < W - 1; ++w)
      step(device->hop(codec, layout, c, im.input(dev, w), nullptr, 0, dev + im.leaf_out[c][w],
                       canary_key(seed, w, true), lane));
    const ByteView in[2] = {{dev + im.leaf_in[c][0], cap}, {dev + im.leaf_in[c][1], cap}};
    step(device->hop(codec, layout, c, im.input(dev, W - 1), in, 2, dev + im.hop_out[c],
                     canary_key(seed, W - 1, false), lane));
    step(device->finish(codec, layout, c, ByteView{dev + im.hop_in[c], cap}, dev + im.finish_out,
                        DType::kF32, ReduceOp::kSum, W, lane));
  }
  return s;
}

// The device: the same steps from the same inputs (`host` with its outputs zeroed), on `stream`,
// waited for once; the device's image into `device_image`. A step that fails reports into an
// error word of the canary's own. The image travels through mapped memory both ways: a copy
// between device memory and pageable memory may wait for the stream on a GPU, and a canary kernel
// that never ends would then hold this thread past the bounded wait below.
Status run_canary_on_device(Device* device, const Codec& codec, const CanaryImage& im,
                            const std::vector<uint8_t>& host, StreamHandle stream, uint64_t seed,
                            std::vector<uint8_t>* device_image) {
  std::vector<uint8_t> upload = host;
  for (const CanaryImage::Region& g : im.regions)
    if (g.output) std::memset(upload.data() + g.at, 0, g.bytes);
  device_image->assign(im.bytes, 0);
  void* base = nullptr;
  void* word = nullptr;
  void* staging = nullptr;
  EventHandle done = nullptr;
  Status s = device->alloc(im.bytes, &base);
  if (s == Status::kOk) s = device->alloc_mapped(4, &word);
  if (s == Status::kOk) s = device->alloc_mapped(im.bytes, &staging);
  if (s == Status::kOk) s = device->create_event(&done);
  if (s == Status::kOk) {
    auto* error_word = static_cast<uint32_t*>(word);
    *error_word = 0;
    const Lane lane{stream, error_word};
    auto* dev = static_cast<uint8_t*>(base);
    auto step = [&s](Status enqueued) {
      if (s == Status::kOk) s = enqueued;
    };
    std::memcpy(staging, upload.data(), im.bytes);
    step(device->copy(dev, staging, im.bytes, lane));
    // Prepared as a plan prepares its codecs.
    const std::unique_ptr<PreparedCodec> prepared = device->prepare(codec);
    CanaryParts parts;
    step(prepare_canary_parts(device, *prepared, im, dev, &parts));
    if (s == Status::kOk) step(enqueue_canary_steps(device, *prepared, parts, im, dev, seed, lane));
    step(device->copy(staging, dev, im.bytes, lane));
    // The one blocking wait of the canary (once per communicator, at its first plan).
    step(device->record(done, stream));
    step(device->synchronize(done));
    if (s == Status::kOk) std::memcpy(device_image->data(), staging, im.bytes);
    for (const auto* p : {parts.stats.get(), parts.layout.get()})
      if (p != nullptr) device->release(p->device_memory, stream);
    const uint32_t failed = __atomic_load_n(error_word, __ATOMIC_ACQUIRE);
    if (s == Status::kOk && failed != 0) s = static_cast<Status>(error_code(failed));
  }
  if (done) device->destroy_event(done);
  if (staging) device->release(staging, stream);
  if (word) device->release(word, stream);
  if (base) device->release(base, stream);
  return s;
}

// Outputs in the order the steps ran, then the inputs (a step must not write them), then the
// padding between buffers (nor those): the first differing byte into `r`.
void compare_canary(const CanaryImage& im, const std::vector<uint8_t>& host,
                    const std::vector<uint8_t>& device_image, CanaryResult* r) {
  auto compare = [&](const std::string& name, size_t offset, size_t bytes) {
    for (size_t b = 0; b < bytes; ++b)
      if (device_image[offset + b] != host[offset + b]) {
        r->differs = true;
        r->step = name;
        r->byte = b;
        r->got = device_image[offset + b];
        r->expected = host[offset + b];
        return true;
      }
    return false;
  };
  for (bool outputs : {true, false})
    for (const CanaryImage::Region& g : im.regions)
      if (g.output == outputs &&
          compare(outputs ? g.name : g.name + " (an input: overwritten)", g.at, g.bytes))
        return;
  compare("memory between its buffers", 0, im.bytes);
}

}  // namespace

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

CanaryResult run_canary(Device* device, const CodecSpec& spec, StreamHandle stream, uint64_t seed) {
  CanaryResult r;
  const std::unique_ptr<Codec> codec = make_codec(spec);
  // A codec that cannot be made or planned: its plans fail the same way on every rank.
  if (!codec || codec->plan(kCanaryCount, kCanaryChunks, kCanaryWorkers) != Status::kOk) return r;
  const CanaryImage im = lay_out_canary(*codec);
  std::vector<uint8_t> host;
  if (!run_canary_on_host(*codec, im, seed, &host)) {
    DQ_INFO(Subsys::kEngine, "dynamiq: canary: the host codec %s failed on the canary; not run",
            codec_spec_text(spec).c_str());
    return r;
  }
  r.host_layout.assign(host.begin() + static_cast<ptrdiff_t>(im.layout_out),
                       host.begin() + static_cast<ptrdiff_t>(im.layout_out + im.layout_bytes));
  r.ran = true;
  std::vector<uint8_t> device_image;
  const Status s = run_canary_on_device(device, *codec, im, host, stream, seed, &device_image);
  if (s != Status::kOk) {
    r.differs = true;
    r.device_status = s;
    return r;
  }
  compare_canary(im, host, device_image, &r);
  return r;
}

}  // namespace dq::engine

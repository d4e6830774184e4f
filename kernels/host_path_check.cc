#include "kernels/host_path_check.h"

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <vector>

#include "kernels/bf16.h"
#include "kernels/dynamiq_codec.h"

namespace dq {
namespace {

// One chunk of eight super-groups and a partial ninth: enough for DynamiQ's budget to give 8 bits
// to some (split in two chunks, every super-group would get 2 bits and the 8-bit lookups would go
// unchecked).
constexpr int kWorkers = 3;
constexpr int kChunks = 1;
constexpr size_t kCount = 2048 + 77;

// The specs the check runs, and the widths each gives on this problem (a test pins them,
// HostPathCheck.ItsProblemReachesEveryWidth): DynamiQ's mixed plan, 2, 4 and 8 bits (the register
// lookups and the one-step 8-bit one; three correlated strata); 8 bits with the generic lookup
// (eps8 = 0.4: several levels per grid cell); 7 bits, 8 and 16 (BF16) bits; uniform levels with
// flat scales, 2 and 8 bits; then each baseline family. The poisoned super-group gets 2 bits in
// every plan.
constexpr const char* kSpecs[] = {"dynamiq:5", "dynamiq:9.5:widths=fixed:eps8=0.4",
                                  "dynamiq:7", "dynamiq:5:levels=uniform:scales=flat:w16=0",
                                  "bf16",      "mxfp8",
                                  "mxfp6e2m3", "mxfp4",
                                  "uniform:5"};

// Worker w's values, super-group j: roughly Gaussian (a sum of four uniforms from a 64-bit mix)
// times 2^e, e = (7j mod 19) - 9, so that neighbouring super-groups' scales differ by up to 2^18;
// group 5 of each super-group at 1/64 of the others (hierarchical scales); super-groups 5 and 7
// offset by -2 and +3 of their scale (mean subtraction); super-group 4 all zeros; worker 1 at a
// thousandth of the others' scale; in worker 2 an infinity (a poisoned super-group).
std::vector<float> worker_values(int w) {
  std::vector<float> x(kCount);
  uint64_t state = 0x9e3779b97f4a7c15ull * static_cast<uint64_t>(w + 1);
  auto next_unit = [&state] {
    state += 0x9e3779b97f4a7c15ull;
    uint64_t z = state;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    return static_cast<float>(z >> 40) * 0x1p-24f;  // [0, 1)
  };
  for (size_t i = 0; i < kCount; ++i) {
    const size_t j = i / 256, g = (i % 256) / 16;
    const float gaussian = next_unit() + next_unit() + next_unit() + next_unit() - 2.0f;
    const float offset = j == 5 ? -2.0f : j == 7 ? 3.0f : 0.0f;
    const float group = g == 5 ? 1.0f / 64.0f : 1.0f;
    const float scale = std::ldexp(w == 1 ? 1e-3f : 1.0f, static_cast<int>((7 * j) % 19) - 9);
    x[i] = scale * (group * gaussian + offset);
  }
  for (size_t i = 1024; i < 1280; ++i) x[i] = 0.0f;
  if (w == 2) x[2 * 256 + 17] = std::numeric_limits<float>::infinity();
  return x;
}

struct Inputs {
  std::vector<float> f32[kWorkers];
  std::vector<uint16_t> bf16[kWorkers];
  Inputs() {
    for (int w = 0; w < kWorkers; ++w) {
      f32[w] = worker_values(w);
      bf16[w].resize(kCount);
      for (size_t i = 0; i < kCount; ++i) bf16[w][i] = f32_to_bf16_rne(f32[w][i]);
    }
  }
  std::vector<ConstTensor> tensors(DType dtype) const {
    std::vector<ConstTensor> t;
    for (int w = 0; w < kWorkers; ++w)
      t.push_back(dtype == DType::kF32 ? ConstTensor{f32[w].data(), dtype, kCount}
                                       : ConstTensor{bf16[w].data(), dtype, kCount});
    return t;
  }
};

void append(std::vector<uint8_t>* bytes, const void* p, size_t size) {
  bytes->insert(bytes->end(), static_cast<const uint8_t*>(p),
                static_cast<const uint8_t*>(p) + size);
}

std::string step_failed(const char* step, Status s) {
  return std::string(step) + " failed (status " + std::to_string(static_cast<int>(s)) + ")";
}

// Plans `c` for the workers' tensors in `chunks` chunks and builds its layout from their summed
// statistics (each worker's statistics words appended to *bytes). On failure returns the step's
// error text.
std::string plan_and_agree(Codec& c, const std::vector<ConstTensor>& workers, int chunks,
                           std::vector<uint8_t>* bytes) {
  const size_t count = workers.empty() ? 0 : workers[0].count;
  Status s = c.plan(count, chunks, static_cast<int>(workers.size()));
  if (s != Status::kOk) return step_failed("plan", s);
  std::vector<float> sum(c.stats_words(), 0.0f);
  std::vector<uint16_t> words(c.stats_words());
  for (const ConstTensor& t : workers) {
    if ((s = c.local_stats(t, words.data())) != Status::kOk) return step_failed("statistics", s);
    append(bytes, words.data(), 2 * words.size());
    for (size_t i = 0; i < sum.size(); ++i) sum[i] += bf16_to_f32(words[i]);
  }
  for (size_t i = 0; i < sum.size(); ++i) words[i] = f32_to_bf16_rne(sum[i]);
  if ((s = c.agree(words.empty() ? nullptr : words.data(), 7)) != Status::kOk)
    return step_failed("layout", s);
  return "";
}

}  // namespace

std::vector<uint8_t> codec_step_bytes(Codec& c, const std::vector<ConstTensor>& workers, int chunks,
                                      std::string* error) {
  std::vector<uint8_t> bytes;
  auto failed = [&](const char* step, Status s) {
    *error = step_failed(step, s);
    return std::vector<uint8_t>{};
  };
  if (workers.size() < 2) {
    *error = "fewer than two workers";
    return {};
  }
  if ((*error = plan_and_agree(c, workers, chunks, &bytes)) != "") return {};
  const uint32_t last = static_cast<uint32_t>(workers.size() - 1);
  Status s = Status::kOk;
  std::vector<std::vector<uint8_t>> payload(workers.size());
  std::vector<ByteView> leaves(last);
  std::vector<float> out(workers[0].count);
  for (int chunk = 0; chunk < chunks; ++chunk) {
    for (uint32_t w = 0; w <= last; ++w) payload[w].assign(c.chunk_capacity(), 0);
    for (uint32_t w = 0; w < last; ++w) {
      const RoundingKey key{5, 7, w, w, 3, 0};  // correlated rounding: three strata
      if ((s = c.hop(chunk, workers[w], nullptr, 0, payload[w].data(), key)) != Status::kOk)
        return failed("leaf", s);
      append(&bytes, payload[w].data(), payload[w].size());
      leaves[w] = ByteView{payload[w].data(), payload[w].size()};
    }
    if ((s = c.hop(chunk, workers[last], leaves.data(), static_cast<int>(last),
                   payload[last].data(), RoundingKey{5, 7, last, last, 3, 0})) != Status::kOk)
      return failed("fused hop", s);
    append(&bytes, payload[last].data(), payload[last].size());
    for (DType out_dtype : {DType::kF32, DType::kBF16})
      for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg}) {
        std::fill(out.begin(), out.end(), 0.0f);
        if ((s = c.finish(chunk, {payload[last].data(), payload[last].size()}, out.data(),
                          out_dtype, op, static_cast<int>(workers.size()))) != Status::kOk)
          return failed("finish", s);
        append(&bytes, out.data(), out.size() * sizeof(float));
      }
  }
  return bytes;
}

bool codec_makers_agree(const CodecMaker& reference, const CodecMaker& candidate,
                        std::string* difference) {
  const Inputs in;
  for (const char* spec : kSpecs) {
    CodecSpec parsed;
    std::string error;
    if (!parse_codec_spec(spec, &parsed, &error)) {  // fails on every CPU: a typo shows at once
      *difference = std::string(spec) + ": " + error;
      return false;
    }
    std::unique_ptr<Codec> want_codec = reference(spec);
    std::unique_ptr<Codec> got_codec = candidate(spec);
    if (want_codec == nullptr && got_codec == nullptr) continue;  // a family this build lacks
    if (want_codec == nullptr || got_codec == nullptr) {
      *difference = std::string(spec) + ": made by one maker only";
      return false;
    }
    for (DType dtype : {DType::kF32, DType::kBF16}) {
      const char* type = dtype == DType::kF32 ? "FP32" : "BF16";
      std::string want_error, got_error;
      const std::vector<uint8_t> want =
          codec_step_bytes(*want_codec, in.tensors(dtype), kChunks, &want_error);
      const std::vector<uint8_t> got =
          codec_step_bytes(*got_codec, in.tensors(dtype), kChunks, &got_error);
      if (want_error != got_error) {
        *difference = std::string(spec) + ", " + type + ": " +
                      (got_error.empty() ? "the reference's " + want_error : got_error);
        return false;
      }
      size_t first = 0;
      while (first < want.size() && first < got.size() && want[first] == got[first]) ++first;
      if (first != want.size() || want.size() != got.size()) {
        char text[160];
        std::snprintf(text, sizeof text, "%s, %s: byte %zu of %zu differs", spec, type, first,
                      want.size());
        *difference = text;
        return false;
      }
    }
  }
  return true;
}

std::vector<int> host_path_check_widths(const char* spec) {
  std::string error;
  std::unique_ptr<Codec> c = make_codec(spec, &error);
  const Inputs in;
  std::vector<uint8_t> stats;
  if (c == nullptr || !plan_and_agree(*c, in.tensors(DType::kF32), kChunks, &stats).empty())
    return {};
  const DynamiqLayoutView layout = dynamiq_layout(*c);
  if (layout.widths == nullptr) return {};
  return std::vector<int>(layout.widths, layout.widths + layout.n_supergroups);
}

bool host_path_gives_scalar_bytes(HostIsa isa, std::string* difference) {
  auto maker = [](HostIsa path) {
    return [path](const char* spec) {
      const ThreadHostIsa on_path(path);
      std::string error;
      return make_codec(spec, &error);
    };
  };
  return codec_makers_agree(maker(HostIsa::kScalar), maker(isa), difference);
}

}  // namespace dq

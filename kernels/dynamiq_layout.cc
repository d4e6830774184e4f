#include "kernels/dynamiq_layout.h"

#include <tbb/blocked_range.h>

#include <atomic>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "common/float_env.h"
#include "kernels/bf16.h"
#include "kernels/dynamiq_math.h"
#include "kernels/dynamiq_range.h"
#include "kernels/parallel.h"
#include "kernels/payload.h"

namespace dq {
namespace {

using LayoutOut = DynamiqLayoutT<uint8_t>;

uint32_t fnv1a(uint32_t h, uint32_t v) {
  for (int i = 0; i < 4; ++i) {
    h ^= (v >> (8 * i)) & 0xffu;
    h *= 16777619u;
  }
  return h;
}

// Width class (width_index(): 0..3 for 2, 4, 8, 16 bits) of super-group j for threshold offset
// theta (T816), from its width key f (the energy key scaled by the call's power of two,
// kernels/dynamiq_range.h).
int width_class(const DynamiqPlan& p, const LayoutOut& l, const float* keys, size_t j,
                float theta) {
  if (l.poisoned(j)) return 0;
  // Equal error saved per extra bit fixes the threshold ratios: 8 -> 4 bits at theta * 257/131072,
  // 4 -> 2 bits at a further 17/512 of that.
  const float t48 = theta * (257.0f / 131072.0f);
  const float t24 = t48 * (17.0f / 512.0f);
  const float f = keys[j];
  // The thresholds nest (t24 <= t48 <= theta: each is the one above times an exact factor below
  // 1, rounded), so the class is the number of thresholds f reaches (the same as testing 16, 8,
  // 4 in turn), counted without a branch on f: the super-groups a bisection still evaluates lie
  // near the thresholds, where such branches mispredict.
  return (f >= t24 ? 1 : 0) + (f >= t48 ? 1 : 0) + (p.allow_width16 && f >= theta ? 1 : 0);
}

// Every super-group's width at the smallest threshold offset (float bit pattern, monotone for
// non-negative floats) at which the records fit the budget: a bisection on [0, +inf], where
// bytes(theta) never increases with theta and bytes(+inf) = all 2-bit fits. width_class() only
// falls as theta grows, so a super-group whose widths at the bracket's two ends agree has that
// width at every theta the bisection still tries: its bytes are counted once and it is not
// evaluated again. Each step evaluates only the super-groups still open (about 6 passes over all
// of them in all, where 31 full passes took about a quarter of a leaf's compression time); the
// bytes at each step, and so the answer, are those of a full pass. At the end the bracket is one
// threshold, and each super-group's width at its upper end is its width there.
void assign_fitting_widths(const DynamiqPlan& p, const LayoutOut& l, const float* keys,
                           uint64_t budget) {
  uint32_t lo = 0, hi = 0x7f800000u;
  // Per super-group: its width class at some theta <= lo (at least its class in the bracket) and
  // at hi.
  std::vector<uint8_t> upper(p.n_sg), lower(p.n_sg);
  std::vector<uint32_t> open;  // the super-groups whose two widths differ
  uint64_t settled = 0;        // the record bytes of the others
  open.reserve(p.n_sg);
  for (size_t j = 0; j < p.n_sg; ++j) {
    upper[j] = static_cast<uint8_t>(width_class(p, l, keys, j, f32_from_bits(lo)));
    lower[j] = static_cast<uint8_t>(width_class(p, l, keys, j, f32_from_bits(hi)));
    if (upper[j] == lower[j])
      settled += p.record[upper[j]];
    else
      open.push_back(static_cast<uint32_t>(j));
  }
  std::vector<uint8_t> at_mid;
  while (lo < hi) {
    const uint32_t mid = lo + (hi - lo) / 2;
    at_mid.resize(open.size());
    // One atomic add per range (an integer sum: the same in any order); dq::parallel_for keeps
    // the fork-join order visible to ThreadSanitizer, which tbb::parallel_reduce's joins are not.
    std::atomic<uint64_t> total{settled};
    dq::parallel_for(tbb::blocked_range<size_t>(0, open.size(), 4096), [&](const auto& range) {
      uint64_t acc = 0;
      for (size_t i = range.begin(); i != range.end(); ++i) {
        const int w = width_class(p, l, keys, open[i], f32_from_bits(mid));
        at_mid[i] = static_cast<uint8_t>(w);
        acc += p.record[w];
      }
      total.fetch_add(acc, std::memory_order_relaxed);
    });
    const bool fits = total.load() <= budget;
    if (fits)
      hi = mid;
    else
      lo = mid + 1;
    // Without a branch on the outcome, which is close to random here.
    uint8_t* moved = fits ? lower.data() : upper.data();
    size_t kept = 0;
    for (size_t i = 0; i < open.size(); ++i) {
      const uint32_t j = open[i];
      moved[j] = at_mid[i];
      const bool closed = upper[j] == lower[j];
      settled += closed ? p.record[upper[j]] : 0;
      open[kept] = j;
      kept += closed ? 0 : 1;
    }
    open.resize(kept);
  }
  for (size_t j = 0; j < p.n_sg; ++j) l.width[j] = static_cast<uint8_t>(2 << lower[j]);
}

void assign_widths(const DynamiqPlan& p, const LayoutOut& l, const float* keys) {
  const uint64_t budget = dynamiq_record_budget(p);
  if (p.variable_widths) {
    assign_fitting_widths(p, l, keys, budget);
    return;
  }
  int fixed = 2;
  for (int b : {16, 8, 4}) {
    if (b == 16 && !p.allow_width16) continue;
    uint64_t need = 0;
    for (size_t j = 0; j < p.n_sg; ++j) need += p.record[width_index(l.poisoned(j) ? 2 : b)];
    if (need <= budget) {
      fixed = b;
      break;
    }
  }
  for (size_t j = 0; j < p.n_sg; ++j) l.width[j] = static_cast<uint8_t>(l.poisoned(j) ? 2 : fixed);
}

// Wire order: by width, widest first, stable (counting sort). starts[w] receives the first wire
// position of width class w (indexed by width_index()).
void sort_by_width(const DynamiqPlan& p, const LayoutOut& l, uint32_t starts[4]) {
  uint32_t n[4] = {0, 0, 0, 0};
  for (size_t j = 0; j < p.n_sg; ++j) ++n[width_index(l.width[j])];
  starts[3] = 0;                 // 16
  starts[2] = n[3];              // 8
  starts[1] = starts[2] + n[2];  // 4
  starts[0] = starts[1] + n[1];  // 2
  uint32_t next[4] = {starts[0], starts[1], starts[2], starts[3]};
  for (size_t j = 0; j < p.n_sg; ++j)
    l.order[next[width_index(l.width[j])]++] = static_cast<uint32_t>(j);
}

// Cuts the record stream in byte space: chunk c holds the records starting in
// [c * stride, (c + 1) * stride) (the last chunk also everything beyond).
void cut_chunks(const DynamiqPlan& p, const LayoutOut& l) {
  const uint64_t stride = p.stride;
  uint64_t start = 0, chunk_start = 0;
  int chunk = 0;
  l.chunk_first[0] = 0;
  for (size_t i = 0; i < p.n_sg; ++i) {
    while (chunk + 1 < p.n_chunks && start >= stride * (chunk + 1)) {
      l.chunk_content[chunk] = start - chunk_start;
      l.chunk_first[++chunk] = static_cast<uint32_t>(i);
      chunk_start = start;
    }
    l.offset[i] = static_cast<uint32_t>(start - chunk_start);
    start += p.record[width_index(l.width[l.order[i]])];
  }
  l.chunk_content[chunk] = start - chunk_start;
  while (chunk + 1 < p.n_chunks) {
    l.chunk_first[++chunk] = static_cast<uint32_t>(p.n_sg);
    l.chunk_content[chunk] = 0;
  }
  l.chunk_first[p.n_chunks] = static_cast<uint32_t>(p.n_sg);
}

// Each chunk's wire positions in super-group order, so the hot loops read the tensor front to
// back (a stream the hardware prefetcher follows) rather than width class by width class.
// Visiting j in order, the wire position of j is its class's next position; within a class the
// positions grow with j, so each class walks the chunks forward once. chunk_check serves as the
// per-chunk cursor until the digests overwrite it.
void index_chunks(const DynamiqPlan& p, const LayoutOut& l, const uint32_t starts[4]) {
  uint32_t* cursor = l.chunk_check;
  for (int c = 0; c < p.n_chunks; ++c) cursor[c] = l.chunk_first[c];
  uint32_t next[4] = {starts[0], starts[1], starts[2], starts[3]};
  int chunk_of[4] = {0, 0, 0, 0};
  for (size_t j = 0; j < p.n_sg; ++j) {
    const int w = width_index(l.width[j]);
    const uint32_t i = next[w]++;
    int& c = chunk_of[w];
    while (l.chunk_first[c + 1] <= i) ++c;
    l.by_index[cursor[c]++] = i;
  }
}

// Means, scale exponents and width keys (kernels/dynamiq_range.h). A non-finite energy (a
// non-finite input) poisons the output: the mean is then non-finite (NaN if the means summed to a
// finite value). Without mean subtraction, in a super-group some worker has all zero, or where
// the means' sum overflowed, the mean is 0.
void agree_means_and_keys(const DynamiqPlan& p, const LayoutOut& l, const uint16_t* reduced,
                          float* keys) {
  const float n = static_cast<float>(p.n_workers);
  std::vector<double> wide(p.n_sg);
  int largest = INT32_MIN;
  for (size_t j = 0; j < p.n_sg; ++j) {
    const SupergroupStatWords w = supergroup_stat_words(reduced, p.n_sg, j, p.n_workers);
    const float mu = bf16_to_f32(w.mean) / n;
    const double key = energy_key(w.energy, contributing_workers(w.all_zero, p.n_workers),
                                  static_cast<uint32_t>(j));
    wide[j] = key;
    if (key < 0.0) {
      l.mean[j] = std::isfinite(mu) ? std::numeric_limits<float>::quiet_NaN() : mu;
      continue;
    }
    if (key > 0.0) largest = std::max(largest, floor_log2(key));
    const bool subtract = p.mean_subtraction && supergroup_dense(w.all_zero) && std::isfinite(mu);
    const int8_t k = scale_exponent(key);
    l.exponent[j] = k;
    // The mean as the hops subtract it: scaled like the values (exact: a power of two).
    l.mean[j] = subtract ? (k == 0 ? mu : mu * pow2f(k)) : 0.0f;
  }
  const int shift = width_key_shift(largest);
  for (size_t j = 0; j < p.n_sg; ++j) keys[j] = width_key(wide[j], shift);
}

}  // namespace

Status build_dynamiq_layout(const DynamiqPlan& p, const uint16_t* reduced, uint64_t call,
                            void* layout) {
  // The serial arithmetic here (the means, the range keys) in the format's environment: its
  // parallel tasks set it themselves, but a caller with flush-to-zero would flush subnormal means
  // and write other layout bytes than its peers.
  const DefaultFloatEnvironment float_env;
  if (layout == nullptr) DQ_FAIL(Status::kInvalidArgument, "dynamiq layout: no buffer");
  if (p.n_chunks < 1) DQ_FAIL(Status::kInvalidArgument, "dynamiq layout: codec not planned");
  if (p.n_sg > 0 && reduced == nullptr)
    DQ_FAIL(Status::kInvalidArgument, "dynamiq agree: statistics missing");
  const DynamiqSections sections = dynamiq_sections(p.n_sg, p.n_chunks);
  std::memset(layout, 0, sections.bytes);  // the padding too: the bytes depend on the input alone
  const LayoutOut l(static_cast<uint8_t*>(layout), sections);
  l.header[0] = call;
  l.header[1] = p.count;
  l.header[2] = dynamiq_plan_shape(p.n_chunks, p.n_workers);
  std::vector<float> keys(p.n_sg);
  agree_means_and_keys(p, l, reduced, keys.data());
  assign_widths(p, l, keys.data());
  uint32_t starts[4];
  sort_by_width(p, l, starts);
  cut_chunks(p, l);
  index_chunks(p, l, starts);
  for (int c = 0; c < p.n_chunks; ++c) {
    if (l.chunk_content[c] + kChunkHeaderBytes > p.capacity)
      DQ_FAIL(Status::kInternal, "dynamiq layout: chunk %d needs %llu bytes, capacity %zu", c,
              static_cast<unsigned long long>(l.chunk_content[c] + kChunkHeaderBytes), p.capacity);
    uint32_t h = fnv1a(2166136261u, static_cast<uint32_t>(c));
    h = fnv1a(h, static_cast<uint32_t>(p.count));
    for (uint32_t i = l.chunk_first[c]; i < l.chunk_first[c + 1]; ++i) {
      const uint32_t j = l.order[i];
      h = fnv1a(h, j * 32u + l.width[j] + (l.poisoned(j) ? 1u : 0u));
      if (l.exponent[j] != 0) h = fnv1a(h, 0x100u | static_cast<uint8_t>(l.exponent[j]));
    }
    l.chunk_check[c] = h;
  }
  return Status::kOk;
}

}  // namespace dq

// Held-out-style checks of the gradient collectives: the exact NCCL call sequences docs/ENGINE.md
// section 7 reads from the frameworks' sources, issued by 4 forked ranks on the CPU NCCL with
// libdynamiq.so preloaded and default settings (DYNAMIQ_ENABLE=1 alone). Usage: framework_sequences
// CASE
//   fsdp2  PyTorch FSDP2 defaults (`fully_shard`, no mixed precision): per FSDPParamGroup, in
//          backward order, one ungrouped out-of-place ncclReduceScatter, FP32, AVG, of the
//          group's flat buffer: every parameter's gradient with dim 0 padded to a multiple of the
//          world size W, rank r's block = every parameter's r-th dim-0 chunk, concatenated
//          (foreach_reduce). Nothing else carries gradients.
//   zero2  DeepSpeed ZeRO-2 defaults (bf16, reduce_scatter=true, use_multi_rank_bucket_allreduce):
//          per step, one ungrouped in-place ncclAllReduce, SUM, BF16, of the flattened bucket
//          divided by W first, on the data-parallel group (a communicator of its own:
//          dist.new_group over all ranks); then a 1-element FP32 SUM all-reduce of the squared
//          gradient norm on the same group.
// Asserted: which calls dynamiq compressed (dynamiqCommCounters), the vNMSE of the reduced
// gradients (< 1e-2 at 5 bits, and within [0.5, 2]x of dynamiq-sim for the same call), exact
// results for the calls that pass through. Exit 0 pass, 1 fail, 77 skip (shim not preloaded).
// The gradients are real: windows of the committed gradient sample (tools/gradients/sample, 4
// workers of all-MiniLM-L6-v2 fine-tuning, the head and last encoder layer), one per parameter.
// Usage: framework_sequences fsdp2|zero2 SAMPLE_DIR
#include <dlfcn.h>

#include <algorithm>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include "common/nccl_api.h"
#include "kernels/bf16.h"
#include "kernels/codec.h"
#include "tests/common/check.h"
#include "tests/common/rank_harness.h"
#include "tests/common/text_file.h"
#include "tools/sim/gradients.h"
#include "tools/sim/simulate.h"
#include "topo/schedule.h"

namespace {

constexpr int kRanks = 4;
constexpr uint64_t kSeed = 24301;           // DYNAMIQ_SEED's default
constexpr double kVnmseBound = 1e-2;        // 5 bits: measured 4e-3 .. 6.4e-3 per group or bucket
constexpr uint64_t kBlockBytes = 16 << 20;  // DYNAMIQ_BLOCK_BYTES's default

using CountersFn = int (*)(void*, unsigned long long*, unsigned long long*);
CountersFn counters_fn() {
  return reinterpret_cast<CountersFn>(dlsym(RTLD_DEFAULT, "dynamiqCommCounters"));
}

std::string g_dir;

void write_file(const std::string& path, const void* data, size_t bytes) {
  std::ofstream(path, std::ios::binary)
      .write(static_cast<const char*>(data), static_cast<std::streamsize>(bytes));
}
std::string rank_file(int rank, const std::string& what) {
  return g_dir + "/" + what + "." + std::to_string(rank);
}

using dq::test::fail;
using dq::test::read_file;

// Forks kRanks ranks with DYNAMIQ_ENABLE=1 (and nothing else set by the test); rank r runs
// body(r, comm) on a fresh communicator, its stderr in g_dir/rank<r>.log. True when every rank
// exits 0 within the timeout.
bool run_ranks(const std::function<int(int, ncclComm_t)>& body, int timeout_s) {
  dq::test::RankOptions opt;
  opt.timeout_s = timeout_s;
  const auto exits = dq::test::run_ranks<ncclUniqueId>(
      kRanks, 1, ncclGetUniqueId, opt, [&](int r, const ncclUniqueId* id) {
        if (!std::freopen((g_dir + "/rank" + std::to_string(r) + ".log").c_str(), "w", stderr))
          return 98;
        setenv("DYNAMIQ_ENABLE", "1", 1);
        ncclComm_t comm = nullptr;
        if (ncclCommInitRank(&comm, kRanks, *id, r) != ncclSuccess) return 97;
        const int rc = body(r, comm);
        std::fflush(stderr);
        if (rc == 0) ncclCommDestroy(comm);
        return rc;
      });
  bool ok = true;
  for (int r = 0; r < kRanks; ++r)
    if (exits[r].code() != 0) {
      std::fprintf(stderr, "--- rank %d log ---\n%s", r,
                   read_file(g_dir + "/rank" + std::to_string(r) + ".log").c_str());
      ok = fail("rank %d %s", r, exits[r].describe().c_str());
    }
  return ok;
}

unsigned long long rerouted_so_far(ncclComm_t comm) {
  unsigned long long rerouted = 0, passed = 0;
  counters_fn()(comm, &rerouted, &passed);
  return rerouted;
}

// ---- the model: a small transformer (d 384, FFN 1536, 3 layers, vocabulary 8002) ------------
struct Param {
  const char* name;
  size_t dim0, rest;  // shape [dim0, rest...] flattened to dim0 x rest
  size_t numel() const { return dim0 * rest; }
};
struct Group {  // one fully_shard call: one FSDPParamGroup
  std::string name;
  std::vector<Param> params;
  uint64_t seed;
};

std::vector<Group> model_groups() {
  constexpr size_t d = 384, ffn = 1536, vocab = 8002, positions = 514;
  std::vector<Group> groups;
  // fully_shard(model) last: the root group holds what the layers do not (embeddings, final
  // norm); fully_shard(layer) for each layer; fully_shard(head) for the classifier.
  groups.push_back({"root (embeddings, final norm)",
                    {{"embed.weight", vocab, d},
                     {"pos_embed.weight", positions, d},
                     {"norm.weight", d, 1},
                     {"norm.bias", d, 1}},
                    101});
  for (int layer = 0; layer < 3; ++layer)
    groups.push_back({"layer " + std::to_string(layer),
                      {{"attn.in_proj_weight", 3 * d, d},
                       {"attn.in_proj_bias", 3 * d, 1},
                       {"attn.out_proj.weight", d, d},
                       {"attn.out_proj.bias", d, 1},
                       {"attn.rel_pos_bias", 33, 6},  // 33 buckets x 6 heads: dim 0 padded to 36
                       {"norm1.weight", d, 1},
                       {"norm1.bias", d, 1},
                       {"ffn.fc1.weight", ffn, d},
                       {"ffn.fc1.bias", ffn, 1},
                       {"ffn.fc2.weight", d, ffn},
                       {"ffn.fc2.bias", d, 1},
                       {"norm2.weight", d, 1},
                       {"norm2.bias", d, 1}},
                      static_cast<uint64_t>(201 + layer)});
  groups.push_back({"head (classifier)", {{"head.weight", 3, d}, {"head.bias", 3, 1}}, 301});
  return groups;
}

size_t group_numel(const Group& g) {
  size_t n = 0;
  for (const Param& p : g.params) n += p.numel();
  return n;
}

// Every rank's gradient of the group's parameters, unpadded and concatenated (row w = rank w):
// for each parameter, a window of the real sample starting at a pseudo-random offset (wrapping
// around), the same window for every rank (rank w's values from worker w), scaled by a factor
// 10^U(-0.5, 0.5) per parameter, as layers differ.
void group_gradients(const Group& g, const dq::sim::Matrix& sample, dq::sim::Matrix* m) {
  m->rows = kRanks;
  m->cols = group_numel(g);
  m->data.assign(m->rows * m->cols, 0.0f);
  size_t at = 0;
  uint64_t state = g.seed * 0x9E3779B97F4A7C15ull;
  for (const Param& p : g.params) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    const size_t base = static_cast<size_t>(state >> 20) % sample.cols;
    const double u = static_cast<double>(state >> 11) / 9007199254740992.0;
    const float scale = static_cast<float>(std::pow(10.0, -0.5 + u));
    for (int w = 0; w < kRanks; ++w)
      for (size_t i = 0; i < p.numel(); ++i)
        m->data[w * m->cols + at + i] = scale * sample.row(w)[(base + i) % sample.cols];
    at += p.numel();
  }
}

std::string g_sample_dir;
bool load_sample(const char* step, dq::sim::Matrix* m) {
  std::string err;
  const std::string path = g_sample_dir + "/" + step + ".npy";
  if (dq::sim::read_npy(path, kRanks, m, &err) != dq::Status::kOk || m->rows < kRanks)
    return fail("cannot read %d rows of %s: %s", kRanks, path.c_str(), err.c_str());
  return true;
}

// FSDP2's reduce-scatter input (foreach_reduce_scatter_copy_in): rank block r holds, for every
// parameter in order, its r-th dim-0 chunk of ceil(dim0 / W) rows, zero-padded.
size_t fsdp2_recvcount(const Group& g) {
  size_t r = 0;
  for (const Param& p : g.params) r += (p.dim0 + kRanks - 1) / kRanks * p.rest;
  return r;
}
std::vector<float> fsdp2_flat(const Group& g, const float* grad) {
  const size_t recv = fsdp2_recvcount(g);
  std::vector<float> flat(recv * kRanks, 0.0f);
  for (int r = 0; r < kRanks; ++r) {
    size_t out = static_cast<size_t>(r) * recv, in = 0;
    for (const Param& p : g.params) {
      const size_t rows = (p.dim0 + kRanks - 1) / kRanks;
      const size_t first = std::min(p.dim0, r * rows), last = std::min(p.dim0, (r + 1) * rows);
      std::memcpy(&flat[out], grad + in + first * p.rest, (last - first) * p.rest * 4);
      out += rows * p.rest;
      in += p.numel();
    }
  }
  return flat;
}

// ---- FSDP2 --------------------------------------------------------------------------------
bool case_fsdp2() {
  const std::vector<Group> groups = model_groups();
  // Backward order: the head's gradients are ready first, then the layers from the last, and
  // the root group's (embeddings) last.
  std::vector<int> order;
  for (int i = static_cast<int>(groups.size()) - 1; i >= 0; --i) order.push_back(i);
  dq::sim::Matrix sample;
  if (!load_sample("step00079", &sample)) return false;
  std::vector<dq::sim::Matrix> grads(groups.size());
  std::vector<std::vector<std::vector<float>>> flats(groups.size());  // [group][rank]
  for (size_t gi = 0; gi < groups.size(); ++gi) {
    group_gradients(groups[gi], sample, &grads[gi]);
    for (int w = 0; w < kRanks; ++w) flats[gi].push_back(fsdp2_flat(groups[gi], grads[gi].row(w)));
  }
  auto body = [&](int rank, ncclComm_t comm) -> int {
    int k = 0;
    for (int gi : order) {
      const size_t recv = fsdp2_recvcount(groups[gi]);
      // Fresh input and output buffers (FSDP2 allocates both per call): out of place.
      std::vector<float> in = flats[gi][rank], out(recv, -1.0f);
      const unsigned long long before = rerouted_so_far(comm);
      if (ncclReduceScatter(in.data(), out.data(), recv, ncclFloat32, ncclAvg, comm, nullptr) !=
          ncclSuccess)
        return 10 + k;
      const char flag = rerouted_so_far(comm) > before ? '1' : '0';
      write_file(rank_file(rank, "fsdp2_out" + std::to_string(k)), out.data(), recv * 4);
      write_file(rank_file(rank, "fsdp2_rerouted" + std::to_string(k)), &flag, 1);
      ++k;
    }
    return 0;
  };
  if (!run_ranks(body, 600)) return false;

  dq::topo::Schedule sched;  // auto: butterfly for 4 ranks
  if (dq::topo::make_schedule(dq::topo::Kind::kButterfly, kRanks, &sched) != dq::Status::kOk)
    return fail("schedule");
  uint64_t call = 0;  // the engine's compressed-call index on this communicator
  int k = 0;
  for (int gi : order) {
    const Group& g = groups[gi];
    const size_t recv = fsdp2_recvcount(g);
    const bool eligible = recv * kRanks * 4 >= (1u << 20);  // DYNAMIQ_MIN_BYTES's default 1 MiB
    std::vector<const float*> rows;
    for (int w = 0; w < kRanks; ++w) rows.push_back(flats[gi][w].data());
    dq::sim::SimResult sim;
    if (eligible) {
      dq::sim::SimOptions opt;
      opt.seed = kSeed;
      opt.call = call;
      opt.op = dq::ReduceOp::kAvg;
      opt.block_elems = dq::sim::reduce_scatter_block_elems(kBlockBytes, 4, kRanks);
      if (dq::sim::simulate_reduce_scatter("dynamiq:5", sched, rows, recv, opt, nullptr, &sim) !=
          dq::Status::kOk)
        return fail("simulate");
    }
    double num = 0, den = 0, worst_shard = 0;
    for (int r = 0; r < kRanks; ++r) {
      const std::string flag = read_file(rank_file(r, "fsdp2_rerouted" + std::to_string(k)));
      EXPECT(flag == (eligible ? "1" : "0"), "%s: rank %d %s the reduce-scatter", g.name.c_str(), r,
             eligible ? "did not compress" : "compressed");
      const std::string bytes = read_file(rank_file(r, "fsdp2_out" + std::to_string(k)));
      EXPECT(bytes.size() == recv * 4, "%s: rank %d wrote %zu bytes", g.name.c_str(), r,
             bytes.size());
      double bn = 0, bd = 0;
      for (size_t i = 0; i < recv; ++i) {
        double exact = 0;
        for (int w = 0; w < kRanks; ++w) exact += rows[w][r * recv + i];
        exact /= kRanks;
        float got;
        std::memcpy(&got, bytes.data() + i * 4, 4);
        EXPECT(std::isfinite(got), "%s: rank %d element %zu is not finite", g.name.c_str(), r, i);
        bn += (got - exact) * (got - exact);
        bd += exact * exact;
      }
      const double vn = bd > 0 ? bn / bd : 0;
      if (eligible) {
        const double want = sim.block_vnmse[r];
        worst_shard = std::max(worst_shard, vn);
        EXPECT(vn >= 0.5 * want && vn <= 2.0 * want,
               "%s: rank %d's shard vNMSE %.4e vs simulated %.4e", g.name.c_str(), r, vn, want);
      } else {
        // Passed through: NCCL's float average (rounding only).
        EXPECT(vn < 1e-12, "%s: rank %d passed through with vNMSE %.3e", g.name.c_str(), r, vn);
      }
      num += bn;
      den += bd;
    }
    // The bound holds for the group's reduced gradient; one rank's shard has its own budget
    // and may be harder (worst shard printed, held to the simulator above).
    if (eligible)
      EXPECT(num / den < kVnmseBound, "%s: vNMSE %.3e over the whole group", g.name.c_str(),
             num / den);
    char simulated[96] = "";
    if (eligible)
      std::snprintf(simulated, sizeof simulated,
                    " (simulated %.3e), worst shard %.3e (simulated %.3e)", sim.vnmse, worst_shard,
                    *std::max_element(sim.block_vnmse.begin(), sim.block_vnmse.end()));
    std::printf("FSDP2 %-30s reduce-scatter %9zu x %d FP32 AVG: %s, vNMSE %.3e%s\n", g.name.c_str(),
                recv, kRanks, eligible ? "compressed on every rank" : "passed through (< 1 MiB)",
                num / den, simulated);
    if (eligible) ++call;
    ++k;
  }
  std::printf(
      "FSDP2: %llu of %zu reduce-scatters compressed, every shard within [0.5, 2]x of "
      "the simulator, every group below %.0e\n",
      static_cast<unsigned long long>(call), order.size(), kVnmseBound);
  return true;
}

// ---- DeepSpeed ZeRO-2 -----------------------------------------------------------------------
// ZeRO-2's bucket of each (step, rank), at step * kRanks + rank: every gradient, flattened (the
// model is far below reduce_bucket_size = 5e8 elements, so one bucket per step, reduced at the
// end of backward), in the order the gradients become ready (backward: head first). Empty when a
// committed sample cannot be read.
std::vector<std::vector<float>> zero2_buckets(const std::vector<Group>& groups, size_t count,
                                              int steps) {
  std::vector<std::vector<float>> bucket(steps * kRanks, std::vector<float>(count));
  for (int step = 0; step < steps; ++step) {
    dq::sim::Matrix sample;  // the two committed steps: 0 and 79
    if (!load_sample(step == 0 ? "step00000" : "step00079", &sample)) return {};
    size_t at = 0;
    for (int gi = static_cast<int>(groups.size()) - 1; gi >= 0; --gi) {
      Group g = groups[gi];
      g.seed += 1000 * step;
      dq::sim::Matrix m;
      group_gradients(g, sample, &m);
      for (int w = 0; w < kRanks; ++w)
        std::memcpy(&bucket[step * kRanks + w][at], m.row(w), m.cols * 4);
      at += m.cols;
    }
  }
  return bucket;
}

constexpr int kZero2Steps = 2;

// What each rank sends: the gradient divided by the data-parallel size, in BF16.
uint16_t zero2_wire_value(const std::vector<std::vector<float>>& bucket, int step, int w,
                          size_t i) {
  return dq::f32_to_bf16_rne(bucket[step * kRanks + w][i] / kRanks);
}

// One rank of ZeRO-2: per step, the bucket all-reduce and the gradient norm all-reduce on the
// data-parallel group; its results and which of the two calls were compressed go to files.
int zero2_rank(int rank, ncclComm_t world, const std::vector<std::vector<float>>& bucket,
               size_t count) {
  // The data-parallel group: a communicator of its own over every rank.
  ncclComm_t dp = nullptr;
  if (ncclCommSplit(world, 0, rank, &dp, nullptr) != ncclSuccess || dp == nullptr) return 5;
  for (int step = 0; step < kZero2Steps; ++step) {
    std::vector<uint16_t> buf(count);
    for (size_t i = 0; i < count; ++i) buf[i] = zero2_wire_value(bucket, step, rank, i);
    unsigned long long before = rerouted_so_far(dp);
    if (ncclAllReduce(buf.data(), buf.data(), count, ncclBfloat16, ncclSum, dp, nullptr) !=
        ncclSuccess)
      return 10 + step;
    const char bucket_flag = rerouted_so_far(dp) > before ? '1' : '0';
    // Gradient norm: each rank sums the squares over the slice of the bucket it owns
    // (partition r of W), then one 1-element FP32 SUM all-reduce.
    const size_t part = (count + kRanks - 1) / kRanks;
    float norm_sq = 0;
    for (size_t i = rank * part; i < std::min(count, (rank + 1) * part); ++i) {
      const float v = dq::bf16_to_f32(buf[i]);
      norm_sq += v * v;
    }
    float total = 0;
    before = rerouted_so_far(dp);
    if (ncclAllReduce(&norm_sq, &total, 1, ncclFloat32, ncclSum, dp, nullptr) != ncclSuccess)
      return 20 + step;
    const char norm_flag = rerouted_so_far(dp) > before ? '1' : '0';
    const std::string tag = "zero2_" + std::to_string(step);
    write_file(rank_file(rank, tag + "_bucket"), buf.data(), count * 2);
    write_file(rank_file(rank, tag + "_flags"), std::string{bucket_flag, norm_flag}.data(), 2);
    write_file(rank_file(rank, tag + "_norm"), &norm_sq, 4);
    write_file(rank_file(rank, tag + "_total"), &total, 4);
  }
  ncclCommDestroy(dp);
  return 0;
}

// One step of ZeRO-2, from the ranks' files: the bucket compressed and identical on every rank,
// its vNMSE against the exact sum and the simulator, the norm passed through and exact.
bool zero2_check_step(int step, const std::vector<std::vector<float>>& bucket, size_t count,
                      const dq::topo::Schedule& sched) {
  const std::string tag = "zero2_" + std::to_string(step);
  std::vector<float> sent(static_cast<size_t>(kRanks) * count);
  std::vector<const float*> rows;
  for (int w = 0; w < kRanks; ++w) {
    for (size_t i = 0; i < count; ++i)
      sent[w * count + i] = dq::bf16_to_f32(zero2_wire_value(bucket, step, w, i));
    rows.push_back(sent.data() + w * count);
  }
  std::string err;
  auto codec = dq::make_codec("dynamiq:5", &err);
  dq::sim::SimOptions opt;
  opt.seed = kSeed;
  opt.call = static_cast<uint64_t>(step);  // the bucket is the only compressed call per step
  dq::sim::SimResult sim;
  if (dq::sim::simulate_allreduce(*codec, sched, rows, count, opt, nullptr, &sim) !=
      dq::Status::kOk)
    return fail("simulate");
  const std::string result = read_file(rank_file(0, tag + "_bucket"));
  EXPECT(result.size() == count * 2, "step %d: %zu result bytes", step, result.size());
  float partial[kRanks];
  for (int r = 0; r < kRanks; ++r) {
    const std::string flags = read_file(rank_file(r, tag + "_flags"));
    EXPECT(flags == "10", "step %d rank %d: compressed (bucket, norm) = %s, expected 10", step, r,
           flags.c_str());
    EXPECT(read_file(rank_file(r, tag + "_bucket")) == result,
           "step %d: rank %d's reduced bucket differs from rank 0's", step, r);
    const std::string p = read_file(rank_file(r, tag + "_norm"));
    std::memcpy(&partial[r], p.data(), 4);
  }
  // Against the exact sum of what the ranks sent, and against the true average gradient.
  double num = 0, den = 0, num_true = 0, den_true = 0;
  for (size_t i = 0; i < count; ++i) {
    double exact = 0, truth = 0;
    for (int w = 0; w < kRanks; ++w) {
      exact += rows[w][i];
      truth += bucket[step * kRanks + w][i];
    }
    truth /= kRanks;
    uint16_t b;
    std::memcpy(&b, result.data() + i * 2, 2);
    const double got = dq::bf16_to_f32(b);
    EXPECT(std::isfinite(got), "step %d: element %zu is not finite", step, i);
    num += (got - exact) * (got - exact);
    den += exact * exact;
    num_true += (got - truth) * (got - truth);
    den_true += truth * truth;
  }
  const double vn = num / den;
  EXPECT(vn < kVnmseBound, "step %d: bucket vNMSE %.3e", step, vn);
  // A BF16 result adds its own rounding (2^-9 relative, squared ~1e-6 of the energy).
  EXPECT(vn >= 0.5 * sim.vnmse && vn <= 2.0 * sim.vnmse + 4e-6,
         "step %d: bucket vNMSE %.4e vs simulated %.4e", step, vn, sim.vnmse);
  // The norm all-reduce passed through: NCCL's FP32 sum of the four partial sums, the same on
  // every rank.
  double exact_total = 0;
  for (float v : partial) exact_total += v;
  for (int r = 0; r < kRanks; ++r) {
    float total;
    std::memcpy(&total, read_file(rank_file(r, tag + "_total")).data(), 4);
    EXPECT(std::fabs(total - exact_total) <= 4 * 1.2e-7 * exact_total,
           "step %d rank %d: norm^2 %.9g, exact %.9g", step, r, total, exact_total);
  }
  std::printf(
      "ZeRO-2 step %d: bucket all-reduce %zu BF16 SUM in place: compressed on every "
      "rank, identical on every rank, vNMSE %.3e (simulated %.3e; %.3e against the true "
      "average gradient); norm^2 all-reduce 1 FP32 SUM: passed through, %.6g\n",
      step, count, vn, sim.vnmse, num_true / den_true, exact_total);
  return true;
}

bool case_zero2() {
  const std::vector<Group> groups = model_groups();
  size_t count = 0;
  for (const Group& g : groups) count += group_numel(g);
  const std::vector<std::vector<float>> bucket = zero2_buckets(groups, count, kZero2Steps);
  if (bucket.empty()) return false;
  auto body = [&](int rank, ncclComm_t world) { return zero2_rank(rank, world, bucket, count); };
  if (!run_ranks(body, 600)) return false;

  dq::topo::Schedule sched;
  if (dq::topo::make_schedule(dq::topo::Kind::kButterfly, kRanks, &sched) != dq::Status::kOk)
    return fail("schedule");
  for (int step = 0; step < kZero2Steps; ++step)
    if (!zero2_check_step(step, bucket, count, sched)) return false;
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: framework_sequences fsdp2|zero2 SAMPLE_DIR\n");
    return 2;
  }
  g_sample_dir = argv[2];
  if (counters_fn() == nullptr) {
    std::printf("SKIP: libdynamiq.so is not preloaded\n");
    return 77;
  }
  char tmpl[] = "/tmp/dq-framework-XXXXXX";
  if (mkdtemp(tmpl) == nullptr) return 1;
  g_dir = tmpl;
  const std::string which = argv[1];
  bool ok = false;
  if (which == "fsdp2") {
    ok = case_fsdp2();
  } else if (which == "zero2") {
    ok = case_zero2();
  } else {
    std::fprintf(stderr, "unknown case %s\n", which.c_str());
    return 2;
  }
  std::printf("%s: %s on %d ranks\n", ok ? "PASS" : "FAIL", which.c_str(), kRanks);
  if (ok) std::system(("rm -rf " + g_dir).c_str());
  return ok ? 0 : 1;
}

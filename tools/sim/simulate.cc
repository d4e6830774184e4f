#include "tools/sim/simulate.h"

#include <tbb/parallel_for.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <memory>
#include <mutex>
#include <string>

#include "kernels/bf16.h"
#include "kernels/stats_sum.h"

namespace dq::sim {
namespace {

// Workers whose contributions a tree node's payload holds (itself and its whole subtree).
void subtree_workers(const topo::ChunkTree& t, int node, std::vector<int>* out) {
  out->push_back(t.nodes[node].worker);
  for (int c : t.nodes[node].children) subtree_workers(t, c, out);
}

// The statistics all-reduce over elements [offset, offset + count) of every row: each rank's
// BF16 words summed in rank order (FP32), rounded to BF16 (byte-summed words lane by lane:
// StatsSum), then handed to codec.agree.
Status agree_on_stats(Codec& codec, const std::vector<const float*>& rows, int n, size_t offset,
                      size_t count, uint64_t call) {
  const size_t words = codec.stats_words();
  std::vector<uint16_t> reduced(words);
  if (words > 0) {
    StatsSum sum(words, codec.stats_byte_sum_words());
    std::vector<uint16_t> local(words);
    for (int w = 0; w < n; ++w) {
      const Status s =
          codec.local_stats(ConstTensor{rows[w] + offset, DType::kF32, count}, local.data());
      if (s != Status::kOk) return s;
      sum.add(local.data());
    }
    sum.result(reduced.data(), false);
  }
  return codec.agree(words ? reduced.data() : nullptr, call);
}

// The nodes of a chunk tree in the order their hops run: by send step, the sink (no send
// step) last; ties keep node order.
std::vector<int> nodes_in_hop_order(const topo::ChunkTree& tree) {
  std::vector<int> order(tree.nodes.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int>(i);
  auto step_of = [&](int i) {
    return tree.nodes[i].send_step < 0 ? 1 << 30 : tree.nodes[i].send_step;
  };
  std::stable_sort(order.begin(), order.end(),
                   [&](int a, int b) { return step_of(a) < step_of(b); });
  return order;
}

// Runs every hop of one chunk tree as the engine does: each node compresses its own slice
// (elements [offset, offset + count) of its worker's row) together with its children's
// payloads into payload[node] (codec chunk `codec_chunk`, `cap` bytes). after_hop(node) runs
// after each hop, before the children's payloads are freed; false from it stops the tree.
// False when a hop or after_hop failed; payload[tree.sink] then holds the chunk's result.
template <class AfterHop>
bool run_tree_hops(Codec& codec, int codec_chunk, const topo::ChunkTree& tree,
                   const std::vector<const float*>& rows, size_t offset, size_t count,
                   const SimOptions& opt, uint64_t element_base,
                   std::vector<std::vector<uint8_t>>* payload, AfterHop&& after_hop) {
  const size_t cap = codec.chunk_capacity();
  payload->assign(tree.nodes.size(), {});
  topo::RoundingStrata strata;
  topo::rounding_strata(tree, &strata);
  std::vector<ByteView> in;
  for (int node : nodes_in_hop_order(tree)) {
    const topo::TreeNode& tn = tree.nodes[node];
    in.clear();
    for (int child : tn.children) in.push_back(ByteView{(*payload)[child].data(), cap});
    (*payload)[node].resize(cap);
    RoundingKey key{opt.seed,
                    opt.call,
                    static_cast<uint32_t>(tn.worker),
                    static_cast<uint32_t>(strata.member[node]),
                    static_cast<uint32_t>(strata.size[node]),
                    static_cast<uint32_t>(strata.klass[node])};
    key.element_base = element_base;
    if (codec.hop(codec_chunk, ConstTensor{rows[tn.worker] + offset, DType::kF32, count}, in.data(),
                  static_cast<int>(in.size()), (*payload)[node].data(), key) != Status::kOk)
      return false;
    if (!after_hop(node)) return false;
    for (int child : tn.children) std::vector<uint8_t>().swap((*payload)[child]);
  }
  return true;
}

// num / den, the relative squared error; infinite when only the reference is zero, NaN when
// the error is.
double relative_error(double num, double den) {
  double v = den > 0 ? num / den : (num > 0 ? INFINITY : 0.0);
  if (num != num) v = NAN;
  return v;
}

// The squared error of one tree node's partial result against the exact FP64 sum of the
// workers it holds, over the elements of chunk c (per-hop errors, SimOptions::per_hop).
// False when decoding the node's payload failed; *who receives those workers.
bool hop_squared_error(Codec& codec, int c, const topo::ChunkTree& tree, int node,
                       const std::vector<uint8_t>& payload,
                       const std::vector<std::pair<size_t, size_t>>& ranges,
                       const std::vector<const float*>& rows, size_t d, std::vector<float>* partial,
                       std::vector<int>* who, double* err) {
  who->clear();
  subtree_workers(tree, node, who);
  partial->assign(d, 0.0f);
  if (codec.finish(c, ByteView{payload.data(), codec.chunk_capacity()}, partial->data(),
                   DType::kF32, ReduceOp::kSum, static_cast<int>(who->size())) != Status::kOk)
    return false;
  *err = 0;
  for (auto [b, e] : ranges)
    for (size_t k = b; k < e; ++k) {
      double exact = 0;
      for (int w : *who) exact += rows[w][k];
      double diff = (*partial)[k] - exact;
      *err += diff * diff;
    }
  return true;
}

// The all-reduce's accuracy and traffic figures into *out, from the decoded result.
void allreduce_figures(Codec& codec, const topo::Schedule& s, const std::vector<const float*>& rows,
                       size_t d, const SimOptions& opt, const std::vector<float>& decoded,
                       const std::vector<double>& hop_err, SimResult* out) {
  const int n = s.n_workers;
  // Exact FP64 reference and the error.
  double num = 0, den = 0, den_sum = 0;
  for (size_t k = 0; k < d; ++k) {
    double exact = 0;
    for (int w = 0; w < n; ++w) exact += rows[w][k];
    den_sum += exact * exact;
    if (opt.op == ReduceOp::kAvg) exact /= n;
    double diff = static_cast<double>(decoded[k]) - exact;
    num += diff * diff;
    den += exact * exact;
  }
  out->vnmse = relative_error(num, den);
  out->bits_per_coord = codec.bits_per_coord();
  const size_t cap = codec.chunk_capacity();
  double sent = 0;  // bytes over all workers and hops
  for (const auto* phase : {&s.reduce, &s.gather})
    for (const auto& step : *phase)
      for (const auto& t : step.transfers) sent += static_cast<double>(t.chunks.size()) * cap;
  // Statistics all-reduce as a ring: each worker sends 2(n-1)/n of the statistics bytes.
  sent += n > 1 ? 2.0 * (n - 1) * 2.0 * codec.stats_words() : 0.0;
  out->wire_bits_per_coord = d ? sent / n * 8.0 / static_cast<double>(d) : 0.0;
  out->budget_honest = codec.fits_budget();
  out->chunks_large_enough = chunks_large_enough(d, s.n_chunks);
  out->hop_error.clear();
  out->block_vnmse.clear();
  if (opt.per_hop && den_sum > 0)
    for (int k = 0; k < n; ++k) out->hop_error.push_back(hop_err[k] / den_sum);
}

}  // namespace

Status simulate_allreduce(Codec& codec, const topo::Schedule& s,
                          const std::vector<const float*>& rows, size_t d, const SimOptions& opt,
                          std::vector<float>* result, SimResult* out) {
  const auto t0 = std::chrono::steady_clock::now();
  const int n = s.n_workers;
  if (static_cast<int>(rows.size()) < n)
    DQ_FAIL(Status::kInvalidArgument, "simulate: %zu input rows for %d workers", rows.size(), n);
  DQ_CHECK(codec.plan(d, s.n_chunks, n));
  if (const Status st = agree_on_stats(codec, rows, n, 0, d, opt.call); st != Status::kOk)
    return st;

  const size_t cap = codec.chunk_capacity();
  std::vector<float> decoded(d, 0.0f);
  std::vector<double> hop_err(n, 0.0);  // squared error summed by subtree size - 1
  std::mutex hop_mutex;
  std::atomic<int> failed{0};
  tbb::parallel_for(0, s.n_chunks, [&](int c) {
    const topo::ChunkTree& tree = s.trees[c];
    std::vector<std::vector<uint8_t>> payload;
    std::vector<std::pair<size_t, size_t>> ranges;
    if (opt.per_hop) codec.chunk_ranges(c, &ranges);
    std::vector<double> local_err(n, 0.0);
    std::vector<float> partial;
    std::vector<int> who;
    auto measure_hop = [&](int node) {
      if (!opt.per_hop) return true;
      double err = 0;
      if (!hop_squared_error(codec, c, tree, node, payload[node], ranges, rows, d, &partial, &who,
                             &err))
        return false;
      local_err[who.size() - 1] += err;
      return true;
    };
    if (!run_tree_hops(codec, c, tree, rows, 0, d, opt, opt.element_base, &payload, measure_hop) ||
        codec.finish(c, ByteView{payload[tree.sink].data(), cap}, decoded.data(), DType::kF32,
                     opt.op, n) != Status::kOk) {
      failed.store(1);
      return;
    }
    if (opt.per_hop) {
      std::lock_guard<std::mutex> lock(hop_mutex);
      for (int k = 0; k < n; ++k) hop_err[k] += local_err[k];
    }
  });
  if (failed.load()) DQ_FAIL(Status::kInternal, "simulate: a hop or decode failed (see above)");

  allreduce_figures(codec, s, rows, d, opt, decoded, hop_err, out);
  if (result) *result = std::move(decoded);
  out->seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return Status::kOk;
}

size_t reduce_scatter_block_elems(uint64_t block_bytes, size_t element_bytes, int n_workers) {
  return pipeline_block_elems(block_bytes, element_bytes, n_workers, 1);
}

namespace {

// One codec's share of a reduce-scatter: chunk `chunk` (ending at worker `owner`) over one
// pipeline block, elements [begin, begin + count) of the owner's rank block.
struct ReduceScatterPart {
  int chunk = 0, owner = 0;
  size_t begin = 0, count = 0;
  std::unique_ptr<Codec> codec;
};

// kInvalidArgument unless the schedule ends exactly one chunk at every worker (its own rank
// block) and per-hop errors were not asked for.
Status check_reduce_scatter_schedule(const topo::Schedule& s, size_t recvcount,
                                     const SimOptions& opt) {
  const int n = s.n_workers;
  if (recvcount == 0) DQ_FAIL(Status::kInvalidArgument, "simulate: reduce-scatter of 0 elements");
  if (opt.per_hop)
    DQ_FAIL(Status::kInvalidArgument,
            "simulate: per-hop errors are measured for the all-reduce only");
  // Every worker must end exactly one chunk: its own rank block.
  std::vector<int> chunk_of(n, -1);
  for (int c = 0; c < s.n_chunks; ++c) {
    const int w = s.sink_worker[c];
    if (w < 0 || w >= n || chunk_of[w] != -1)
      DQ_FAIL(Status::kInvalidArgument,
              "simulate: the %s schedule of %d workers does not end one chunk at every worker; "
              "a reduce-scatter needs that (ring, or butterfly for a power of two)",
              topo::kind_name(s.kind), n);
    chunk_of[w] = c;
  }
  if (s.n_chunks != n)
    DQ_FAIL(Status::kInvalidArgument,
            "simulate: the %s schedule of %d workers has %d chunks; a reduce-scatter needs %d",
            topo::kind_name(s.kind), n, s.n_chunks, n);
  return Status::kOk;
}

// Parts as the engine plans them: per pipeline block, one codec per chunk over the block's
// slice of the rank block that chunk ends at.
Status plan_reduce_scatter_parts(std::string_view codec_spec, const topo::Schedule& s,
                                 size_t recvcount, const SimOptions& opt,
                                 std::vector<ReduceScatterPart>* parts) {
  const size_t block = opt.block_elems ? opt.block_elems : recvcount;
  const size_t n_blocks = std::max<size_t>(1, recvcount / block);
  std::string error;
  for (size_t b = 0; b < n_blocks; ++b)
    for (int c = 0; c < s.n_chunks; ++c) {
      ReduceScatterPart p;
      p.chunk = c;
      p.owner = s.sink_worker[c];
      p.begin = b * block;
      p.count = b + 1 == n_blocks ? recvcount - p.begin : block;
      p.codec = make_codec(codec_spec, &error);
      if (!p.codec)
        DQ_FAIL(Status::kInvalidArgument, "simulate: codec %.*s: %s",
                static_cast<int>(codec_spec.size()), codec_spec.data(), error.c_str());
      DQ_CHECK(p.codec->plan(p.count, 1, s.n_workers));
      parts->push_back(std::move(p));
    }
  return Status::kOk;
}

// The reduce-scatter's accuracy (per rank block and overall) and traffic figures into *out.
void reduce_scatter_figures(const topo::Schedule& s, const std::vector<const float*>& rows,
                            size_t recvcount, const SimOptions& opt,
                            const std::vector<ReduceScatterPart>& parts,
                            const std::vector<float>& decoded, SimResult* out) {
  const int n = s.n_workers;
  // Exact FP64 reference per rank block.
  out->block_vnmse.assign(n, 0.0);
  double num_all = 0, den_all = 0;
  for (int r = 0; r < n; ++r) {
    double num = 0, den = 0;
    for (size_t k = static_cast<size_t>(r) * recvcount; k < static_cast<size_t>(r + 1) * recvcount;
         ++k) {
      double exact = 0;
      for (int w = 0; w < n; ++w) exact += rows[w][k];
      if (opt.op == ReduceOp::kAvg) exact /= n;
      const double diff = static_cast<double>(decoded[k]) - exact;
      num += diff * diff;
      den += exact * exact;
    }
    out->block_vnmse[r] = relative_error(num, den);
    num_all += num;
    den_all += den;
  }
  out->vnmse = relative_error(num_all, den_all);

  // One compressed copy: every part's chunk message and statistics; on the wire: each non-sink
  // node of a chunk's tree sends that chunk's message once, and the statistics all-reduce (a
  // ring) sends 2(n-1)/n of the statistics bytes from every worker.
  const double coords = static_cast<double>(n) * static_cast<double>(recvcount);
  double copy_bytes = 0, sent = 0;
  out->budget_honest = true;
  out->chunks_large_enough = true;
  for (const ReduceScatterPart& p : parts) {
    const double cap = static_cast<double>(p.codec->chunk_capacity());
    const double words = static_cast<double>(p.codec->stats_words());
    copy_bytes += cap + 2.0 * words;
    int senders = 0;
    for (const topo::TreeNode& tn : s.trees[p.chunk].nodes) senders += tn.parent >= 0 ? 1 : 0;
    sent += senders * cap + (n > 1 ? 2.0 * (n - 1) * 2.0 * words : 0.0);
    out->budget_honest = out->budget_honest && p.codec->fits_budget();
    out->chunks_large_enough = out->chunks_large_enough && chunks_large_enough(p.count, 1);
  }
  out->bits_per_coord = copy_bytes * 8.0 / coords;
  out->wire_bits_per_coord = sent / n * 8.0 / coords;
  out->hop_error.clear();
}

}  // namespace

Status simulate_reduce_scatter(std::string_view codec_spec, const topo::Schedule& s,
                               const std::vector<const float*>& rows, size_t recvcount,
                               const SimOptions& opt, std::vector<float>* result, SimResult* out) {
  const auto t0 = std::chrono::steady_clock::now();
  const int n = s.n_workers;
  if (static_cast<int>(rows.size()) < n)
    DQ_FAIL(Status::kInvalidArgument, "simulate: %zu input rows for %d workers", rows.size(), n);
  if (const Status st = check_reduce_scatter_schedule(s, recvcount, opt); st != Status::kOk)
    return st;
  std::vector<ReduceScatterPart> parts;
  if (const Status st = plan_reduce_scatter_parts(codec_spec, s, recvcount, opt, &parts);
      st != Status::kOk)
    return st;

  const uint64_t padded = (static_cast<uint64_t>(recvcount) + 255) / 256 * 256;
  std::vector<float> decoded(static_cast<size_t>(n) * recvcount, 0.0f);
  std::atomic<int> failed{0};
  tbb::parallel_for(0, static_cast<int>(parts.size()), [&](int index) {
    ReduceScatterPart& p = parts[index];
    Codec& codec = *p.codec;
    const size_t offset = static_cast<size_t>(p.owner) * recvcount + p.begin;
    // The hops of chunk p.chunk's in-tree, as the engine's program runs them: codec chunk 0.
    const topo::ChunkTree& tree = s.trees[p.chunk];
    std::vector<std::vector<uint8_t>> payload;
    const uint64_t element_base = static_cast<uint64_t>(p.owner) * padded + p.begin;
    if (agree_on_stats(codec, rows, n, offset, p.count, opt.call) != Status::kOk ||
        !run_tree_hops(codec, 0, tree, rows, offset, p.count, opt, element_base, &payload,
                       [](int) { return true; }) ||
        codec.finish(0, ByteView{payload[tree.sink].data(), codec.chunk_capacity()},
                     decoded.data() + offset, DType::kF32, opt.op, n) != Status::kOk)
      failed.store(1);
  });
  if (failed.load()) DQ_FAIL(Status::kInternal, "simulate: a hop or decode failed (see above)");

  reduce_scatter_figures(s, rows, recvcount, opt, parts, decoded, out);
  if (result) *result = std::move(decoded);
  out->seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return Status::kOk;
}

}  // namespace dq::sim

#include "tools/sim/two_level.h"

#include <tbb/parallel_for.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <memory>
#include <string>

namespace dq::sim {

size_t two_level_shard_elems(size_t d, int ranks_per_node) {
  const size_t local = static_cast<size_t>(std::max(ranks_per_node, 1));
  const size_t per = (d + local - 1) / local;
  return (per + 255) / 256 * 256;
}

void node_sums(const std::vector<const float*>& rows, size_t d, int nodes, int ranks_per_node,
               std::vector<std::vector<float>>* sums) {
  sums->assign(static_cast<size_t>(nodes), {});
  tbb::parallel_for(0, nodes, [&](int g) {
    std::vector<float>& s = (*sums)[g];
    const float* first = rows[static_cast<size_t>(g) * ranks_per_node];
    s.assign(first, first + d);
    for (int l = 1; l < ranks_per_node; ++l) {
      const float* r = rows[static_cast<size_t>(g) * ranks_per_node + l];
      for (size_t k = 0; k < d; ++k) s[k] += r[k];  // one FP32 rounding per add
    }
  });
}

namespace {

// The vNMSE of `decoded` against the exact FP64 sum (or average) of the n rows.
double exact_vnmse(const std::vector<const float*>& rows, int n, size_t d, ReduceOp op,
                   const std::vector<float>& decoded) {
  double num = 0, den = 0;
  for (size_t k = 0; k < d; ++k) {
    double exact = 0;
    for (int w = 0; w < n; ++w) exact += rows[w][k];
    if (op == ReduceOp::kAvg) exact /= n;
    const double diff = static_cast<double>(decoded[k]) - exact;
    num += diff * diff;
    den += exact * exact;
  }
  double v = den > 0 ? num / den : (num > 0 ? INFINITY : 0.0);
  if (num != num) v = NAN;
  return v;
}

// One rail all-reduce: elements [at, at + count) of the node sums over `inter`, SUM, its result
// into decoded[at ...].
Status rail_allreduce(std::string_view codec_spec, const topo::Schedule& inter,
                      const std::vector<std::vector<float>>& sums, size_t at, size_t count,
                      const SimOptions& opt, std::vector<float>* decoded, SimResult* r) {
  std::string error;
  const std::unique_ptr<Codec> codec = make_codec(codec_spec, &error);
  if (!codec)
    DQ_FAIL(Status::kInvalidArgument, "simulate: codec %.*s: %s",
            static_cast<int>(codec_spec.size()), codec_spec.data(), error.c_str());
  std::vector<const float*> rail;
  for (const auto& s : sums) rail.push_back(s.data() + at);
  SimOptions o = opt;
  o.op = ReduceOp::kSum;  // AVG divides by every rank afterwards, not by the rail's nodes
  o.element_base = opt.element_base + at;
  std::vector<float> part;
  DQ_CHECK(simulate_allreduce(*codec, inter, rail, count, o, &part, r));
  std::copy(part.begin(), part.end(), decoded->begin() + at);
  return Status::kOk;
}

// The super-group order of interleaved shards: local rank l's whole super-groups l, l + L, ...
// in turn; a partial last super-group stays last (a codec's only partial one is its last).
std::vector<size_t> interleaved_order(size_t d, int local) {
  const size_t whole = d / 256;
  std::vector<size_t> order;
  for (int l = 0; l < local; ++l)
    for (size_t j = static_cast<size_t>(l); j < whole; j += static_cast<size_t>(local))
      order.push_back(j);
  if (whole * 256 < d) order.push_back(whole);
  return order;
}

// Moves super-group order[i] of `v` to position i (forward) or back (inverse).
void permute_supergroups(const std::vector<size_t>& order, bool inverse, std::vector<float>* v) {
  const size_t d = v->size();
  std::vector<float> out(d);
  for (size_t i = 0; i < order.size(); ++i) {
    const size_t from = (inverse ? i : order[i]) * 256, to = (inverse ? order[i] : i) * 256;
    const size_t len = std::min<size_t>(256, d - std::max(from, to));
    std::copy(v->begin() + from, v->begin() + from + len, out.begin() + to);
  }
  v->swap(out);
}

}  // namespace

Status simulate_two_level_allreduce(std::string_view codec_spec, const topo::Schedule& inter,
                                    int ranks_per_node, const std::vector<const float*>& rows,
                                    size_t d, const SimOptions& opt, std::vector<float>* result,
                                    SimResult* out) {
  const auto t0 = std::chrono::steady_clock::now();
  const int nodes = inter.n_workers, local = ranks_per_node;
  if (local < 1 || nodes < 1)
    DQ_FAIL(Status::kInvalidArgument, "simulate: two-level needs >= 1 node and rank per node");
  const int n = nodes * local;
  if (static_cast<int>(rows.size()) < n)
    DQ_FAIL(Status::kInvalidArgument, "simulate: %zu input rows for %d x %d ranks", rows.size(),
            nodes, local);
  if (opt.per_hop)
    DQ_FAIL(Status::kInvalidArgument, "simulate: per-hop errors are not modelled for two-level");
  std::vector<std::vector<float>> sums;
  node_sums(rows, d, nodes, local, &sums);
  const bool interleave = opt.interleaved_shards && local > 1;
  const std::vector<size_t> order =
      interleave ? interleaved_order(d, local) : std::vector<size_t>{};
  if (interleave)
    for (auto& s : sums) permute_supergroups(order, false, &s);

  std::vector<float> decoded(d, 0.0f);
  const size_t shard = two_level_shard_elems(d, local);
  double copy_bits = 0, rail_bits = 0;  // summed over the shards, bits
  out->budget_honest = true;
  out->chunks_large_enough = true;
  for (int l = 0; l < local && static_cast<size_t>(l) * shard < d; ++l) {
    const size_t begin = static_cast<size_t>(l) * shard;
    const size_t len = std::min(shard, d - begin);
    if (nodes == 1) {  // nothing crosses a node: the FP32 node sum is the result
      std::copy(sums[0].begin() + begin, sums[0].begin() + begin + len, decoded.begin() + begin);
      continue;
    }
    // The rail's pipeline blocks inside the shard, each its own codec and budget (whole
    // super-groups, the last takes the remainder, as the engine cuts a call).
    const size_t block = opt.block_elems ? opt.block_elems : len;
    const size_t n_blocks = std::max<size_t>(1, len / block);
    for (size_t b = 0; b < n_blocks; ++b) {
      const size_t at = begin + b * block;
      const size_t count = b + 1 == n_blocks ? begin + len - at : block;
      SimResult r;
      DQ_CHECK(rail_allreduce(codec_spec, inter, sums, at, count, opt, &decoded, &r));
      copy_bits += r.bits_per_coord * static_cast<double>(count);
      rail_bits += r.wire_bits_per_coord * static_cast<double>(count);
      out->budget_honest = out->budget_honest && r.budget_honest;
      out->chunks_large_enough = out->chunks_large_enough && r.chunks_large_enough;
    }
  }
  if (interleave) permute_supergroups(order, true, &decoded);
  if (opt.op == ReduceOp::kAvg)
    for (float& v : decoded) v /= static_cast<float>(n);

  out->vnmse = exact_vnmse(rows, n, d, opt.op, decoded);
  const double coords = d ? static_cast<double>(d) : 1.0;
  out->bits_per_coord = copy_bits / coords;
  // Rank (g, l) sends its rail's share of shard l; averaged over the L ranks of a node.
  out->wire_bits_per_coord = rail_bits / (static_cast<double>(local) * coords);
  out->intra_node_bits_per_coord = 2.0 * 32.0 * (local - 1) / local;
  out->hop_error.clear();
  out->block_vnmse.clear();
  if (result) *result = std::move(decoded);
  out->seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return Status::kOk;
}

}  // namespace dq::sim

#include "topo/schedule.h"

#include <algorithm>
#include <cstdint>

namespace dq::topo {
namespace {

bool valid_kind(Kind k) {
  return k == Kind::kRing || k == Kind::kButterfly;
}

int floor_pow2(int n) {
  int p = 1;
  while (p * 2 <= n) p *= 2;
  return p;
}

int log2_exact(int p) {
  int l = 0;
  while ((1 << l) < p) ++l;
  return l;
}

// Chunk c travels worker c -> c+1 -> ... and ends summed at worker c-1: each link carries one
// chunk per step in both phases, so every link is busy every step.
void build_ring(int n, Schedule* s) {
  for (int c = 0; c < n; ++c) s->sink_worker[c] = (c - 1 + n) % n;
  s->reduce.resize(n - 1);
  s->gather.resize(n - 1);
  for (int step = 0; step < n - 1; ++step) {
    std::vector<Transfer>& red = s->reduce[step].transfers;
    std::vector<Transfer>& gat = s->gather[step].transfers;
    red.reserve(n);
    gat.reserve(n);
    for (int r = 0; r < n; ++r) {
      const int next = (r + 1) % n;
      red.push_back(Transfer{r, next, {((r - step) % n + n) % n}});
      gat.push_back(Transfer{r, next, {((r + 1 - step) % n + n) % n}});
    }
  }
}

// Rabenseifner: extras fold into their even partner first, so the p participants run a pure
// power-of-two recursive halving (reduce) and doubling (gather), chunk c ending at virtual rank c.
void build_butterfly(int n, Schedule* s) {
  const int p = floor_pow2(n);
  const int extras = n - p;
  const int levels = log2_exact(p);
  // Participants: even ranks below 2*extras (virtual rank r/2), then every rank >= 2*extras.
  auto real_rank = [extras](int v) { return v < extras ? 2 * v : v + extras; };
  for (int c = 0; c < p; ++c) s->sink_worker[c] = real_rank(c);

  auto chunk_range = [](int lo, int len) {
    std::vector<int> chunks(len);
    for (int i = 0; i < len; ++i) chunks[i] = lo + i;
    return chunks;
  };

  const int fold_steps = extras > 0 ? 1 : 0;
  s->reduce.resize(fold_steps + levels);
  s->gather.resize(levels + fold_steps);
  if (extras > 0) {
    std::vector<Transfer>& fold = s->reduce[0].transfers;
    std::vector<Transfer>& unfold = s->gather[levels].transfers;
    fold.reserve(extras);
    unfold.reserve(extras);
    for (int i = 0; i < extras; ++i) {
      fold.push_back(Transfer{2 * i + 1, 2 * i, chunk_range(0, p)});
      unfold.push_back(Transfer{2 * i, 2 * i + 1, chunk_range(0, p)});
    }
  }
  for (int level = 0; level < levels; ++level) {
    // Reduce: distance halves; each virtual rank gives away the half not containing itself.
    const int d_reduce = p >> (level + 1);
    // Gather: distance doubles; each virtual rank shares the aligned block it now owns.
    const int d_gather = 1 << level;
    std::vector<Transfer>& red = s->reduce[fold_steps + level].transfers;
    std::vector<Transfer>& gat = s->gather[level].transfers;
    red.reserve(p);
    gat.reserve(p);
    for (int v = 0; v < p; ++v) {
      const int lo = v & ~(2 * d_reduce - 1);
      const int give_lo = (v & d_reduce) ? lo : lo + d_reduce;
      red.push_back(
          Transfer{real_rank(v), real_rank(v ^ d_reduce), chunk_range(give_lo, d_reduce)});
      const int own_lo = v & ~(d_gather - 1);
      gat.push_back(Transfer{real_rank(v), real_rank(v ^ d_gather), chunk_range(own_lo, d_gather)});
    }
  }
}

// Trees are derived from the steps (never built separately) so they cannot disagree with them.
void derive_trees(Schedule* s) {
  const int n = s->n_workers;
  s->trees.assign(s->n_chunks, ChunkTree{});
  for (int c = 0; c < s->n_chunks; ++c) {
    ChunkTree& tree = s->trees[c];
    tree.nodes.resize(n);
    for (int w = 0; w < n; ++w) tree.nodes[w] = TreeNode{w, -1, -1, {}};
    tree.sink = s->sink_worker[c];
  }
  for (int step = 0; step < static_cast<int>(s->reduce.size()); ++step) {
    for (const Transfer& t : s->reduce[step].transfers) {
      for (int c : t.chunks) {
        std::vector<TreeNode>& nodes = s->trees[c].nodes;
        nodes[t.src].parent = t.dst;
        nodes[t.src].send_step = step;
        nodes[t.dst].children.push_back(t.src);
      }
    }
  }
}

}  // namespace

int chunks_for(Kind kind, int n_workers) {
  if (n_workers < 1 || n_workers > kMaxWorkers) return 0;
  switch (kind) {
    case Kind::kRing:
      return n_workers;
    case Kind::kButterfly:
      return floor_pow2(n_workers);
  }
  return 0;
}

Status parse_kind(std::string_view name, Kind* out) {
  if (name == "ring") {
    *out = Kind::kRing;
  } else if (name == "butterfly") {
    *out = Kind::kButterfly;
  } else {
    DQ_FAIL(Status::kInvalidArgument, "unknown topology '%.*s' (expected ring or butterfly)",
            static_cast<int>(name.size()), name.data());
  }
  return Status::kOk;
}

const char* kind_name(Kind k) {
  switch (k) {
    case Kind::kRing:
      return "ring";
    case Kind::kButterfly:
      return "butterfly";
  }
  return "unknown";
}

Status make_schedule(Kind kind, int n_workers, Schedule* out) {
  if (out == nullptr) DQ_FAIL(Status::kInvalidArgument, "make_schedule: null output");
  if (!valid_kind(kind)) {
    DQ_FAIL(Status::kInvalidArgument, "make_schedule: invalid topology kind %d",
            static_cast<int>(kind));
  }
  if (n_workers < 1 || n_workers > kMaxWorkers) {
    DQ_FAIL(Status::kInvalidArgument, "make_schedule: n_workers %d outside 1..%d", n_workers,
            kMaxWorkers);
  }
  Schedule s;
  s.kind = kind;
  s.n_workers = n_workers;
  s.n_chunks = chunks_for(kind, n_workers);
  s.sink_worker.assign(s.n_chunks, 0);
  if (kind == Kind::kRing) {
    build_ring(n_workers, &s);
  } else {
    build_butterfly(n_workers, &s);
  }
  derive_trees(&s);
  *out = std::move(s);
  return Status::kOk;
}

namespace {

// Kind, worker and chunk counts, and one tree and one sink in range per chunk.
Status check_shape(const Schedule& s) {
  if (!valid_kind(s.kind)) {
    DQ_FAIL(Status::kInternal, "schedule: invalid kind %d", static_cast<int>(s.kind));
  }
  const int n = s.n_workers;
  if (n < 1 || n > kMaxWorkers) DQ_FAIL(Status::kInternal, "schedule: n_workers %d invalid", n);
  const int nc = s.n_chunks;
  if (nc != chunks_for(s.kind, n)) {
    DQ_FAIL(Status::kInternal, "schedule: n_chunks %d, %s of %d workers needs %d", nc,
            kind_name(s.kind), n, chunks_for(s.kind, n));
  }
  if (static_cast<int>(s.trees.size()) != nc || static_cast<int>(s.sink_worker.size()) != nc) {
    DQ_FAIL(Status::kInternal, "schedule: %zu trees and %zu sinks for %d chunks", s.trees.size(),
            s.sink_worker.size(), nc);
  }
  for (int c = 0; c < nc; ++c) {
    if (s.sink_worker[c] < 0 || s.sink_worker[c] >= n) {
      DQ_FAIL(Status::kInternal, "schedule: chunk %d sink worker %d out of range", c,
              s.sink_worker[c]);
    }
  }
  return Status::kOk;
}

// Per step, in both phases: endpoints in range and distinct, no repeated (src, dst) pair, no
// repeated chunk in one message.
class StepChecker {
 public:
  StepChecker(int n_workers, int n_chunks)
      : n_(n_workers), nc_(n_chunks), chunk_stamp_(n_chunks, -1) {}

  Status check(const Step& step, const char* phase, int index) {
    if (step.transfers.empty()) DQ_FAIL(Status::kInternal, "%s step %d is empty", phase, index);
    pair_keys_.clear();
    for (const Transfer& t : step.transfers) {
      DQ_CHECK(check_transfer(t, phase, index));
      pair_keys_.push_back(static_cast<int64_t>(t.src) * n_ + t.dst);
    }
    std::sort(pair_keys_.begin(), pair_keys_.end());
    auto dup = std::adjacent_find(pair_keys_.begin(), pair_keys_.end());
    if (dup != pair_keys_.end()) {
      DQ_FAIL(Status::kInternal, "%s step %d: pair %lld -> %lld appears twice", phase, index,
              static_cast<long long>(*dup / n_), static_cast<long long>(*dup % n_));
    }
    return Status::kOk;
  }

 private:
  Status check_transfer(const Transfer& t, const char* phase, int index) {
    if (t.src < 0 || t.src >= n_ || t.dst < 0 || t.dst >= n_ || t.src == t.dst) {
      DQ_FAIL(Status::kInternal, "%s step %d: bad transfer %d -> %d", phase, index, t.src, t.dst);
    }
    if (t.chunks.empty()) {
      DQ_FAIL(Status::kInternal, "%s step %d: transfer %d -> %d carries no chunk", phase, index,
              t.src, t.dst);
    }
    ++stamp_;  // one stamp per transfer: a chunk stamped twice repeats within it
    for (int c : t.chunks) {
      if (c < 0 || c >= nc_) {
        DQ_FAIL(Status::kInternal, "%s step %d: transfer %d -> %d names chunk %d of %d", phase,
                index, t.src, t.dst, c, nc_);
      }
      if (chunk_stamp_[c] == stamp_) {
        DQ_FAIL(Status::kInternal, "%s step %d: transfer %d -> %d repeats chunk %d", phase, index,
                t.src, t.dst, c);
      }
      chunk_stamp_[c] = stamp_;
    }
    return Status::kOk;
  }

  int n_, nc_;
  std::vector<int64_t> pair_keys_;
  std::vector<int> chunk_stamp_;
  int stamp_ = 0;
};

// What the reduce steps say, per (chunk, worker), indexed [chunk * n_workers + worker].
struct ReduceEdges {
  std::vector<int> send_step;   // the step the worker sends the chunk at; -1: never
  std::vector<int> send_dst;    // to whom; -1: never
  std::vector<int> recv_count;  // messages of the chunk the worker receives
  std::vector<int> last_recv;   // the step of the last of them; -1: none
};

// Every worker but the sink sends each chunk exactly once, after receiving all its inputs.
Status check_reduce_phase(const Schedule& s, StepChecker* steps, ReduceEdges* e) {
  const int n = s.n_workers, nc = s.n_chunks;
  const size_t cells = static_cast<size_t>(nc) * n;
  e->send_step.assign(cells, -1);
  e->send_dst.assign(cells, -1);
  e->recv_count.assign(cells, 0);
  e->last_recv.assign(cells, -1);
  for (int step = 0; step < static_cast<int>(s.reduce.size()); ++step) {
    DQ_CHECK(steps->check(s.reduce[step], "reduce", step));
    for (const Transfer& t : s.reduce[step].transfers) {
      for (int c : t.chunks) {
        const size_t from = static_cast<size_t>(c) * n + t.src;
        const size_t to = static_cast<size_t>(c) * n + t.dst;
        if (e->send_step[from] != -1) {
          DQ_FAIL(Status::kInternal,
                  "reduce: worker %d compresses chunk %d twice (steps %d and %d)", t.src, c,
                  e->send_step[from], step);
        }
        e->send_step[from] = step;
        e->send_dst[from] = t.dst;
        ++e->recv_count[to];
        e->last_recv[to] = step;
      }
    }
  }
  for (int c = 0; c < nc; ++c) {
    for (int w = 0; w < n; ++w) {
      const size_t i = static_cast<size_t>(c) * n + w;
      const bool is_sink = w == s.sink_worker[c];
      if (is_sink && e->send_step[i] != -1) {
        DQ_FAIL(Status::kInternal, "reduce: sink %d of chunk %d sends it at step %d", w, c,
                e->send_step[i]);
      }
      if (!is_sink && e->send_step[i] == -1) {
        DQ_FAIL(Status::kInternal, "reduce: worker %d never contributes chunk %d", w, c);
      }
      // A payload received at or after the send would be lost; requiring receive < send on every
      // edge also makes the send graph acyclic, hence a tree spanning all workers into the sink.
      if (!is_sink && e->last_recv[i] >= e->send_step[i]) {
        DQ_FAIL(Status::kInternal,
                "reduce: worker %d receives chunk %d at step %d, after sending it at step %d", w, c,
                e->last_recv[i], e->send_step[i]);
      }
    }
  }
  return Status::kOk;
}

// Node w of chunk c's tree restates its reduce edges: parent, send step, and its children in
// receive order.
Status check_tree_node(const Schedule& s, const ReduceEdges& e, int c, int w) {
  const int n = s.n_workers;
  const ChunkTree& tree = s.trees[c];
  const TreeNode& node = tree.nodes[w];
  const size_t i = static_cast<size_t>(c) * n + w;
  if (node.worker != w) {
    DQ_FAIL(Status::kInternal, "tree %d: node %d holds worker %d", c, w, node.worker);
  }
  if (node.parent != e.send_dst[i] || node.send_step != e.send_step[i]) {
    DQ_FAIL(Status::kInternal, "tree %d: node %d has parent %d at step %d, steps say %d at step %d",
            c, w, node.parent, node.send_step, e.send_dst[i], e.send_step[i]);
  }
  if (static_cast<int>(node.children.size()) != e.recv_count[i]) {
    DQ_FAIL(Status::kInternal, "tree %d: node %d has %zu inputs but receives %d messages", c, w,
            node.children.size(), e.recv_count[i]);
  }
  int prev_step = -1, prev_child = -1;
  for (int child : node.children) {
    if (child < 0 || child >= n || tree.nodes[child].parent != w) {
      DQ_FAIL(Status::kInternal, "tree %d: node %d lists %d, which does not send to it", c, w,
              child);
    }
    // Strictly increasing (step, node): no repeated child can stand in for a missing one.
    const int child_step = e.send_step[static_cast<size_t>(c) * n + child];
    if (child_step < prev_step || (child_step == prev_step && child <= prev_child)) {
      DQ_FAIL(Status::kInternal, "tree %d: node %d inputs out of receive order at child %d", c, w,
              child);
    }
    prev_step = child_step;
    prev_child = child;
  }
  return Status::kOk;
}

// The trees restate the reduce steps exactly, children in receive order.
Status check_trees(const Schedule& s, const ReduceEdges& e) {
  const int n = s.n_workers;
  for (int c = 0; c < s.n_chunks; ++c) {
    const ChunkTree& tree = s.trees[c];
    if (static_cast<int>(tree.nodes.size()) != n) {
      DQ_FAIL(Status::kInternal, "tree %d: %zu nodes for %d workers", c, tree.nodes.size(), n);
    }
    if (tree.sink < 0 || tree.sink >= n || tree.nodes[tree.sink].worker != s.sink_worker[c]) {
      DQ_FAIL(Status::kInternal, "tree %d: sink node %d is not worker %d", c, tree.sink,
              s.sink_worker[c]);
    }
    for (int w = 0; w < n; ++w) DQ_CHECK(check_tree_node(s, e, c, w));
  }
  return Status::kOk;
}

// Every worker receives every chunk's final payload exactly once, from a worker holding it.
Status check_gather_phase(const Schedule& s, StepChecker* steps) {
  const int n = s.n_workers;
  // have[c * n + w]: the gather step at which w got chunk c's final payload; -1 for the sink (it
  // has it before gather begins), -2 for not yet.
  std::vector<int> have(static_cast<size_t>(s.n_chunks) * n, -2);
  for (int c = 0; c < s.n_chunks; ++c) have[static_cast<size_t>(c) * n + s.sink_worker[c]] = -1;
  for (int step = 0; step < static_cast<int>(s.gather.size()); ++step) {
    DQ_CHECK(steps->check(s.gather[step], "gather", step));
    for (const Transfer& t : s.gather[step].transfers) {
      for (int c : t.chunks) {
        const int src_has = have[static_cast<size_t>(c) * n + t.src];
        if (src_has == -2 || src_has >= step) {
          DQ_FAIL(Status::kInternal,
                  "gather step %d: worker %d forwards chunk %d before holding its result", step,
                  t.src, c);
        }
        int& dst_has = have[static_cast<size_t>(c) * n + t.dst];
        if (dst_has != -2) {
          DQ_FAIL(Status::kInternal, "gather step %d: worker %d receives chunk %d's result again",
                  step, t.dst, c);
        }
        dst_has = step;
      }
    }
  }
  for (size_t i = 0; i < have.size(); ++i) {
    if (have[i] == -2) {
      DQ_FAIL(Status::kInternal, "gather: worker %d never receives chunk %d's result",
              static_cast<int>(i % n), static_cast<int>(i / n));
    }
  }
  return Status::kOk;
}

}  // namespace

Status validate_schedule(const Schedule& s) {
  DQ_CHECK(check_shape(s));
  StepChecker steps(s.n_workers, s.n_chunks);
  ReduceEdges edges;
  DQ_CHECK(check_reduce_phase(s, &steps, &edges));
  DQ_CHECK(check_trees(s, edges));
  return check_gather_phase(s, &steps);
}

void rounding_strata(const ChunkTree& tree, RoundingStrata* out) {
  const int n = static_cast<int>(tree.nodes.size());
  std::vector<int> height(n, -1);
  // Children send before their parent, so repeated relaxation converges within n passes; the
  // trees are small (n <= 1024) and this runs once per communicator.
  for (int pass = 0; pass < n + 1; ++pass) {
    bool changed = false;
    for (int i = 0; i < n; ++i) {
      int h = 0;
      bool ready = true;
      for (int c : tree.nodes[i].children) {
        if (height[c] < 0) ready = false;
        h = std::max(h, height[c] + 1);
      }
      if (ready && height[i] != h) {
        height[i] = h;
        changed = true;
      }
    }
    if (!changed) break;
  }
  out->klass = height;
  out->member.assign(n, 0);
  out->size.assign(n, 0);
  std::vector<int> count(n + 1, 0);
  for (int i = 0; i < n; ++i) out->member[i] = count[height[i]]++;  // nodes are in worker order
  for (int i = 0; i < n; ++i) out->size[i] = count[height[i]];
}

}  // namespace dq::topo

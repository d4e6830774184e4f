// Schedules are checked by running them symbolically: payloads carry the multiset of workers
// whose data they contain, exactly as the engine will fuse them, so a wrong formula anywhere in
// topo/ shows up as a missing or doubled contribution rather than a mismatched constant.
#include "topo/schedule.h"

#include <gtest/gtest.h>

#include <climits>
#include <cstdint>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace dq::topo {
namespace {

int floor_log2(int n) {
  int l = 0;
  while ((2 << l) <= n) ++l;
  return l;
}

bool is_pow2(int n) {
  return n > 0 && (n & (n - 1)) == 0;
}

// What running a schedule produced; every field is measured, none is computed from formulas.
struct SimResult {
  std::vector<std::string> errors;
  std::vector<int> sink;            // per chunk: the worker that never sent it
  std::vector<int> compress_count;  // [c * n + w]
  std::vector<int> parent;          // [c * n + w]: worker it sent chunk c to, -1 if none
  std::vector<int> send_step;       // [c * n + w]
  std::vector<std::vector<int>> received_from;  // [c * n + w]: senders in receive order
  std::vector<int> chunks_sent;                 // per worker, both phases, in chunk units
  int max_depth = 0;  // hops from the farthest leaf to the sink, over chunks
};

void note(SimResult* r, std::string msg) {
  if (r->errors.size() < 20) r->errors.push_back(std::move(msg));
}

// One simulated run: the schedule, what it produced so far, and each (chunk, worker)'s state
// through the reduce phase.
struct Sim {
  const Schedule& s;
  const int n, nc;
  const size_t cells;
  SimResult r;
  // held[c*n+w]: contributors received so far for chunk c; hops: longest path into it.
  std::vector<std::vector<uint16_t>> held;
  std::vector<int> hops;
  std::vector<char> sent;

  explicit Sim(const Schedule& sched)
      : s(sched),
        n(sched.n_workers),
        nc(sched.n_chunks),
        cells(static_cast<size_t>(nc) * n),
        held(cells),
        hops(cells, 0),
        sent(cells, 0) {
    r.sink.assign(nc, -1);
    r.compress_count.assign(cells, 0);
    r.parent.assign(cells, -1);
    r.send_step.assign(cells, -1);
    r.received_from.assign(cells, {});
    r.chunks_sent.assign(n, 0);
  }
  size_t at(int c, int w) const { return static_cast<size_t>(c) * n + w; }
};

// The reduce steps: payloads travel with the workers whose data they hold.
void run_reduce(Sim* m) {
  const Schedule& s = m->s;
  const int n = m->n, nc = m->nc;
  SimResult& r = m->r;
  auto& held = m->held;
  auto& hops = m->hops;
  auto& sent = m->sent;
  auto at = [m](int c, int w) { return m->at(c, w); };
  struct InFlight {
    int src, dst, chunk, hops;
    std::vector<uint16_t> contributors;
  };
  for (int step = 0; step < static_cast<int>(s.reduce.size()); ++step) {
    // All sends of a step are formed from the state before any of its deliveries.
    std::vector<InFlight> flight;
    for (const Transfer& t : s.reduce[step].transfers) {
      if (t.src < 0 || t.src >= n || t.dst < 0 || t.dst >= n) {
        note(&r, "reduce transfer endpoint out of range");
        continue;
      }
      r.chunks_sent[t.src] += static_cast<int>(t.chunks.size());
      for (int c : t.chunks) {
        if (c < 0 || c >= nc) {
          note(&r, "chunk out of range");
          continue;
        }
        const size_t i = at(c, t.src);
        ++r.compress_count[i];
        if (sent[i]) {
          note(&r,
               "worker " + std::to_string(t.src) + " sends chunk " + std::to_string(c) + " twice");
        }
        sent[i] = 1;
        r.parent[i] = t.dst;
        r.send_step[i] = step;
        InFlight f{t.src, t.dst, c, hops[i] + 1, std::move(held[i])};
        held[i].clear();
        f.contributors.push_back(static_cast<uint16_t>(t.src));
        flight.push_back(std::move(f));
      }
    }
    for (InFlight& f : flight) {
      const size_t j = at(f.chunk, f.dst);
      if (sent[j]) {
        note(&r, "worker " + std::to_string(f.dst) + " receives chunk " + std::to_string(f.chunk) +
                     " at step " + std::to_string(step) + " after sending it: contributions lost");
      }
      r.received_from[j].push_back(f.src);
      hops[j] = std::max(hops[j], f.hops);
      if (held[j].empty()) {
        held[j] = std::move(f.contributors);
      } else {
        held[j].insert(held[j].end(), f.contributors.begin(), f.contributors.end());
      }
    }
  }
}

// After the reduce steps: one sink per chunk, whose payload must hold every worker once.
void check_sinks(Sim* m) {
  const int n = m->n, nc = m->nc;
  SimResult& r = m->r;
  const auto& held = m->held;
  const auto& hops = m->hops;
  const auto& sent = m->sent;
  auto at = [m](int c, int w) { return m->at(c, w); };
  // The sink compresses after its last receive; its payload must hold every worker once.
  std::vector<int> count(n);
  for (int c = 0; c < nc; ++c) {
    int unsent = 0;
    for (int w = 0; w < n; ++w) {
      if (!sent[at(c, w)]) {
        ++unsent;
        r.sink[c] = w;
      }
    }
    if (unsent != 1) {
      note(&r, "chunk " + std::to_string(c) + " has " + std::to_string(unsent) + " sinks");
      continue;
    }
    const size_t i = at(c, r.sink[c]);
    ++r.compress_count[i];
    r.max_depth = std::max(r.max_depth, hops[i]);
    std::fill(count.begin(), count.end(), 0);
    for (uint16_t w : held[i]) ++count[w];
    ++count[r.sink[c]];
    for (int w = 0; w < n; ++w) {
      if (count[w] != 1) {
        note(&r, "chunk " + std::to_string(c) + " final sum holds worker " + std::to_string(w) +
                     " " + std::to_string(count[w]) + " times");
      }
    }
  }
}

// The gather steps: every worker gets every chunk's final payload once, from a holder.
void run_gather(Sim* m) {
  const Schedule& s = m->s;
  const int n = m->n, nc = m->nc;
  const size_t cells = m->cells;
  SimResult& r = m->r;
  auto at = [m](int c, int w) { return m->at(c, w); };
  // Gather: got[c*n+w] = step at which the final payload of c arrived, -1 for the sink.
  std::vector<int> got(cells, -2);
  std::vector<int> receives(cells, 0);
  for (int c = 0; c < nc; ++c) {
    if (r.sink[c] >= 0) got[at(c, r.sink[c])] = -1;
  }
  for (int step = 0; step < static_cast<int>(s.gather.size()); ++step) {
    std::vector<std::pair<size_t, int>> arrivals;
    for (const Transfer& t : s.gather[step].transfers) {
      if (t.src < 0 || t.src >= n || t.dst < 0 || t.dst >= n) {
        note(&r, "gather transfer endpoint out of range");
        continue;
      }
      r.chunks_sent[t.src] += static_cast<int>(t.chunks.size());
      for (int c : t.chunks) {
        if (c < 0 || c >= nc) {
          note(&r, "chunk out of range");
          continue;
        }
        if (got[at(c, t.src)] == -2) {
          note(&r, "gather step " + std::to_string(step) + ": worker " + std::to_string(t.src) +
                       " forwards chunk " + std::to_string(c) + " it does not hold");
        }
        arrivals.emplace_back(at(c, t.dst), step);
      }
    }
    for (auto [j, when] : arrivals) {
      if (++receives[j] > 1 || got[j] != -2) {
        note(&r, "worker " + std::to_string(j % n) + " receives chunk " + std::to_string(j / n) +
                     "'s result twice");
      }
      got[j] = when;
    }
  }
  for (size_t j = 0; j < cells; ++j) {
    if (got[j] == -2) {
      note(&r, "worker " + std::to_string(j % n) + " never gets chunk " + std::to_string(j / n));
    }
  }
}

SimResult simulate(const Schedule& s) {
  Sim m(s);
  run_reduce(&m);
  check_sinks(&m);
  run_gather(&m);
  return std::move(m.r);
}

std::string join(const std::vector<std::string>& v) {
  std::string out;
  for (const std::string& s : v) out += s + "\n";
  return out;
}

class ScheduleTest : public ::testing::TestWithParam<std::tuple<Kind, int>> {};

TEST_P(ScheduleTest, SimulatesCorrectly) {
  const auto [kind, n] = GetParam();
  Schedule s;
  ASSERT_EQ(make_schedule(kind, n, &s), Status::kOk);
  ASSERT_EQ(s.kind, kind);
  ASSERT_EQ(s.n_workers, n);
  const int p = 1 << floor_log2(n);
  const int nc = kind == Kind::kRing ? n : p;
  ASSERT_EQ(s.n_chunks, nc);
  ASSERT_EQ(chunks_for(kind, n), nc);
  ASSERT_EQ(s.trees.size(), static_cast<size_t>(nc));
  ASSERT_EQ(s.sink_worker.size(), static_cast<size_t>(nc));
  EXPECT_EQ(validate_schedule(s), Status::kOk);

  // (a), (b): contributions and gather, checked inside the simulation.
  const SimResult r = simulate(s);
  ASSERT_TRUE(r.errors.empty()) << join(r.errors);

  // (c) every worker compresses every chunk exactly once.
  for (int c = 0; c < nc; ++c) {
    ASSERT_EQ(r.sink[c], s.sink_worker[c]) << "chunk " << c;
    for (int w = 0; w < n; ++w) {
      ASSERT_EQ(r.compress_count[static_cast<size_t>(c) * n + w], 1) << "chunk " << c << " w " << w;
    }
  }

  // (d) trees restate the steps.
  int tree_depth = 0;
  for (int c = 0; c < nc; ++c) {
    const ChunkTree& tree = s.trees[c];
    ASSERT_EQ(tree.nodes.size(), static_cast<size_t>(n));
    ASSERT_GE(tree.sink, 0);
    ASSERT_LT(tree.sink, n);
    EXPECT_EQ(tree.nodes[tree.sink].worker, s.sink_worker[c]);
    EXPECT_EQ(tree.nodes[tree.sink].parent, -1);
    EXPECT_EQ(tree.nodes[tree.sink].send_step, -1);
    for (int i = 0; i < n; ++i) {
      const TreeNode& node = tree.nodes[i];
      ASSERT_EQ(node.worker, i) << "documented: node index == worker";
      const size_t k = static_cast<size_t>(c) * n + node.worker;
      if (i == tree.sink) continue;
      ASSERT_GE(node.parent, 0) << "chunk " << c << " node " << i;
      ASSERT_LT(node.parent, n);
      EXPECT_EQ(tree.nodes[node.parent].worker, r.parent[k]);
      EXPECT_EQ(node.send_step, r.send_step[k]);
    }
    for (int i = 0; i < n; ++i) {
      const TreeNode& node = tree.nodes[i];
      const std::vector<int>& got = r.received_from[static_cast<size_t>(c) * n + node.worker];
      ASSERT_EQ(node.children.size(), got.size()) << "inputs of chunk " << c << " node " << i;
      for (size_t j = 0; j < got.size(); ++j) {
        EXPECT_EQ(tree.nodes[node.children[j]].worker, got[j]);
        EXPECT_EQ(tree.nodes[node.children[j]].parent, i);
      }
    }
    // Depth from the tree's own parent pointers (memoized; a walk longer than n is a cycle).
    std::vector<int> depth(n, -1);
    depth[tree.sink] = 0;
    std::vector<int> path;
    for (int i = 0; i < n; ++i) {
      path.clear();
      int at = i;
      while (depth[at] < 0 && static_cast<int>(path.size()) <= n) {
        path.push_back(at);
        at = tree.nodes[at].parent;
        ASSERT_GE(at, 0) << "chunk " << c << ": a second root";
      }
      ASSERT_LE(static_cast<int>(path.size()), n) << "cycle in tree " << c;
      int d = depth[at];
      for (auto it = path.rbegin(); it != path.rend(); ++it) depth[*it] = ++d;
    }
    for (int d : depth) tree_depth = std::max(tree_depth, d);
  }
  EXPECT_EQ(tree_depth, r.max_depth);

  // (e) step counts, per-worker traffic in chunk units, tree depth.
  const int levels = floor_log2(n);
  const int extras = n - p;
  if (kind == Kind::kRing) {
    EXPECT_EQ(s.reduce.size(), static_cast<size_t>(n - 1));
    EXPECT_EQ(s.gather.size(), static_cast<size_t>(n - 1));
    for (int w = 0; w < n; ++w) EXPECT_EQ(r.chunks_sent[w], 2 * (n - 1)) << "worker " << w;
    EXPECT_EQ(r.max_depth, n - 1);
    for (int c = 0; c < n; ++c) EXPECT_EQ(s.sink_worker[c], (c + n - 1) % n);
  } else {
    const int fold = extras > 0 ? 1 : 0;
    EXPECT_EQ(s.reduce.size(), static_cast<size_t>(levels + fold));
    EXPECT_EQ(s.gather.size(), static_cast<size_t>(levels + fold));
    for (int w = 0; w < n; ++w) {
      const bool extra = w < 2 * extras && w % 2 == 1;
      const bool partner = w < 2 * extras && w % 2 == 0;
      const int expect = extra ? p : 2 * (p - 1) + (partner ? p : 0);
      EXPECT_EQ(r.chunks_sent[w], expect) << "worker " << w;
    }
    EXPECT_EQ(r.max_depth, levels + fold);
    if (is_pow2(n)) {
      for (int c = 0; c < nc; ++c) EXPECT_EQ(s.sink_worker[c], c);
    }
  }
  RecordProperty("max_tree_depth", r.max_depth);
}

std::vector<std::tuple<Kind, int>> all_cases() {
  std::vector<int> ns;
  for (int n = 1; n <= 130; ++n) ns.push_back(n);
  for (int n : {255, 256, 257, 1000, 1024}) ns.push_back(n);
  std::vector<std::tuple<Kind, int>> cases;
  for (Kind k : {Kind::kRing, Kind::kButterfly}) {
    for (int n : ns) cases.emplace_back(k, n);
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(AllSizes, ScheduleTest, ::testing::ValuesIn(all_cases()),
                         [](const ::testing::TestParamInfo<std::tuple<Kind, int>>& info) {
                           return std::string(kind_name(std::get<0>(info.param))) + "_" +
                                  std::to_string(std::get<1>(info.param));
                         });

// (f) out-of-range requests fail with a code instead of crashing or building garbage.
TEST(ScheduleErrors, InvalidWorkerCounts) {
  for (Kind k : {Kind::kRing, Kind::kButterfly}) {
    for (int n : {0, -1, 1025, INT_MIN, INT_MAX}) {
      Schedule s;
      EXPECT_EQ(make_schedule(k, n, &s), Status::kInvalidArgument) << kind_name(k) << " " << n;
      EXPECT_EQ(chunks_for(k, n), 0);
    }
  }
  Schedule s;
  EXPECT_EQ(make_schedule(static_cast<Kind>(7), 4, &s), Status::kInvalidArgument);
  EXPECT_EQ(make_schedule(Kind::kRing, 4, nullptr), Status::kInvalidArgument);
}

TEST(ScheduleErrors, ParseKind) {
  Kind k = Kind::kButterfly;
  ASSERT_EQ(parse_kind("ring", &k), Status::kOk);
  EXPECT_EQ(k, Kind::kRing);
  ASSERT_EQ(parse_kind("butterfly", &k), Status::kOk);
  EXPECT_EQ(k, Kind::kButterfly);
  for (const char* bad : {"", "Ring", "tree", "ring ", "butterfl"}) {
    EXPECT_EQ(parse_kind(bad, &k), Status::kInvalidArgument) << bad;
  }
  for (Kind kk : {Kind::kRing, Kind::kButterfly}) {
    Kind back;
    ASSERT_EQ(parse_kind(kind_name(kk), &back), Status::kOk);
    EXPECT_EQ(back, kk);
  }
  EXPECT_STREQ(kind_name(static_cast<Kind>(7)), "unknown");
}

// (g) validation is itself tested: each corruption must be caught, and the symbolic simulator
// (the oracle of the tests above) must catch the step-level ones too.
class CorruptionTest : public ::testing::TestWithParam<std::tuple<Kind, int>> {
 protected:
  void SetUp() override {
    const auto [kind, n] = GetParam();
    ASSERT_EQ(make_schedule(kind, n, &good_), Status::kOk);
    ASSERT_EQ(validate_schedule(good_), Status::kOk);
  }
  void expect_rejected(const Schedule& bad, bool simulator_too, const char* what) {
    EXPECT_EQ(validate_schedule(bad), Status::kInternal) << what;
    if (simulator_too) {
      EXPECT_FALSE(simulate(bad).errors.empty()) << what;
    }
  }
  Schedule good_;
};

TEST_P(CorruptionTest, DuplicateOrDropTransfer) {
  for (std::vector<Step> Schedule::*phase : {&Schedule::reduce, &Schedule::gather}) {
    for (size_t step : {size_t{0}, (good_.*phase).size() - 1}) {
      const size_t nt = (good_.*phase)[step].transfers.size();
      for (size_t t : {size_t{0}, nt / 2, nt - 1}) {
        Schedule dup = good_;
        std::vector<Transfer>& dt = (dup.*phase)[step].transfers;
        dt.push_back(dt[t]);
        expect_rejected(dup, true, "duplicated transfer");

        Schedule drop = good_;
        std::vector<Transfer>& xt = (drop.*phase)[step].transfers;
        xt.erase(xt.begin() + static_cast<std::ptrdiff_t>(t));
        expect_rejected(drop, true, "dropped transfer");

        // A copy moved to the next step is no longer the same (src,dst) pair in one step.
        if (step + 1 < (good_.*phase).size()) {
          Schedule again = good_;
          (again.*phase)[step + 1].transfers.push_back((again.*phase)[step].transfers[t]);
          expect_rejected(again, true, "transfer repeated a step later");
        }
      }
    }
  }
}

TEST_P(CorruptionTest, ReorderedStepsAndChunks) {
  if (good_.reduce.size() >= 2) {
    Schedule swapped = good_;
    std::swap(swapped.reduce.front(), swapped.reduce.back());
    expect_rejected(swapped, true, "reduce steps swapped");
  }
  if (good_.gather.size() >= 2) {
    Schedule swapped = good_;
    std::swap(swapped.gather.front(), swapped.gather.back());
    expect_rejected(swapped, true, "gather steps swapped");
  }
  {
    Schedule wrong_chunk = good_;
    int& c = wrong_chunk.reduce[0].transfers[0].chunks[0];
    c = (c + 1) % good_.n_chunks;
    expect_rejected(wrong_chunk, true, "reduce chunk renamed");
  }
  if (good_.n_workers >= 3) {
    Schedule wrong_dst = good_;
    Transfer& t = wrong_dst.gather.back().transfers.back();
    const int n = good_.n_workers;
    t.dst = (t.dst + 1) % n == t.src ? (t.dst + 2) % n : (t.dst + 1) % n;
    expect_rejected(wrong_dst, true, "gather destination changed");
  }
}

TEST_P(CorruptionTest, TreesAndSinks) {
  const int n = good_.n_workers;
  const int sink = good_.trees[0].sink;
  const int leaf = good_.reduce[0].transfers[0].src;
  const int c0 = good_.reduce[0].transfers[0].chunks[0];
  {
    Schedule bad = good_;
    TreeNode& node = bad.trees[c0].nodes[leaf];
    if (n >= 3) {
      node.parent = (node.parent + 1) % n == leaf ? (node.parent + 2) % n : (node.parent + 1) % n;
    } else {
      node.parent = -1;
    }
    expect_rejected(bad, false, "tree parent changed");
  }
  {
    Schedule bad = good_;
    ++bad.trees[c0].nodes[leaf].send_step;
    expect_rejected(bad, false, "tree send_step changed");
  }
  {
    Schedule bad = good_;
    bad.trees[0].nodes[sink].children.pop_back();
    expect_rejected(bad, false, "sink input dropped");
  }
  {
    Schedule bad = good_;
    std::vector<int>& ch = bad.trees[0].nodes[sink].children;
    // With one input, "repeat" it as the sink itself, which sends nothing to itself.
    ch.back() = ch.size() >= 2 ? ch.front() : sink;
    expect_rejected(bad, false, "sink input repeated");
  }
  {
    Schedule bad = good_;
    std::vector<int>& ch = bad.trees[0].nodes[sink].children;
    if (ch.size() >= 2) {
      std::swap(ch.front(), ch.back());
      expect_rejected(bad, false, "sink inputs out of order");
    }
  }
  {
    Schedule bad = good_;
    bad.trees[0].sink = (sink + 1) % n;
    expect_rejected(bad, false, "tree sink moved");
  }
  {
    Schedule bad = good_;
    bad.sink_worker[0] = (bad.sink_worker[0] + 1) % n;
    expect_rejected(bad, false, "sink_worker changed");
  }
  {
    Schedule bad = good_;
    bad.trees.pop_back();
    expect_rejected(bad, false, "tree missing");
  }
  {
    Schedule bad = good_;
    ++bad.n_chunks;
    expect_rejected(bad, false, "n_chunks changed");
  }
}

std::vector<std::tuple<Kind, int>> corruption_cases() {
  std::vector<std::tuple<Kind, int>> cases;
  for (Kind k : {Kind::kRing, Kind::kButterfly}) {
    for (int n : {2, 3, 4, 5, 6, 7, 8, 12, 16, 33}) cases.emplace_back(k, n);
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Small, CorruptionTest, ::testing::ValuesIn(corruption_cases()),
                         [](const ::testing::TestParamInfo<std::tuple<Kind, int>>& info) {
                           return std::string(kind_name(std::get<0>(info.param))) + "_" +
                                  std::to_string(std::get<1>(info.param));
                         });

// A single worker has nothing to send: one chunk, its own sink, no steps.
TEST(ScheduleSingle, OneWorker) {
  for (Kind k : {Kind::kRing, Kind::kButterfly}) {
    Schedule s;
    ASSERT_EQ(make_schedule(k, 1, &s), Status::kOk);
    EXPECT_EQ(s.n_chunks, 1);
    EXPECT_TRUE(s.reduce.empty());
    EXPECT_TRUE(s.gather.empty());
    ASSERT_EQ(s.trees.size(), 1u);
    EXPECT_EQ(s.trees[0].nodes.size(), 1u);
    EXPECT_EQ(s.sink_worker[0], 0);
  }
}

}  // namespace
}  // namespace dq::topo

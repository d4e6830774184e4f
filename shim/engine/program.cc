#include "shim/engine/program.h"

#include <map>

namespace dq::engine {

bool gather_in_place(const Program::Xfer& x) {
  return !x.chunks.empty() && x.first_slot == x.chunks[0];
}

const char* collective_name(Collective c) {
  switch (c) {
    case Collective::kAllReduce:
      return "allreduce";
    case Collective::kReduceScatter:
      return "reducescatter";
    case Collective::kReduce:
      return "reduce";
  }
  return "?";
}

Status compile_program(topo::Kind kind, int n, int me, uint64_t seed, Collective collective,
                       int root, Program* out) {
  Program& p = *out;
  p = Program{};
  DQ_CHECK(topo::make_schedule(kind, n, &p.schedule));
  const topo::Schedule& s = p.schedule;
  using Stage = Program::Stage;
  using StageKind = Program::StageKind;

  int slot = s.n_chunks;  // slots 0 .. n_chunks-1 hold the final payload of each chunk
  std::map<std::pair<int, int>, int> rx_slot;  // (chunk, sender) -> slot
  for (const topo::Step& step : s.reduce) {
    Stage st{StageKind::kReduce, {}, {}, {}};
    for (const topo::Transfer& t : step.transfers) {
      if (t.src == me) {
        st.sends.push_back({t.dst, t.chunks, slot});
        for (size_t j = 0; j < t.chunks.size(); ++j)
          st.hops.push_back({t.chunks[j], {}, slot + static_cast<int>(j), {}});
        slot += static_cast<int>(t.chunks.size());
      }
      if (t.dst == me) {
        st.recvs.push_back({t.src, t.chunks, slot});
        for (size_t j = 0; j < t.chunks.size(); ++j)
          rx_slot[{t.chunks[j], t.src}] = slot + static_cast<int>(j);
        slot += static_cast<int>(t.chunks.size());
      }
    }
    p.stages.push_back(std::move(st));
  }
  Stage sink{StageKind::kSink, {}, {}, {}};
  for (int c = 0; c < s.n_chunks; ++c)
    if (s.sink_worker[c] == me) sink.hops.push_back({c, {}, c, {}});
  p.stages.push_back(std::move(sink));
  if (collective == Collective::kReduceScatter) {
    std::vector<int> sunk(n, 0);
    for (int c = 0; c < s.n_chunks; ++c) ++sunk[s.sink_worker[c]];
    for (int w = 0; w < n; ++w)
      if (sunk[w] != 1)
        DQ_FAIL(Status::kInvalidArgument,
                "dynamiq: a reduce-scatter needs every rank to end one chunk; the %s schedule of "
                "%d ranks gives rank %d %d",
                topo::kind_name(kind), n, w, sunk[w]);
  }
  // What follows the sink: the all-gather (all-reduce), or one step to the root (reduce).
  std::vector<topo::Step> after;
  if (collective == Collective::kAllReduce) after = s.gather;
  if (collective == Collective::kReduce) {
    topo::Step to_root;
    for (int w = 0; w < n; ++w) {
      if (w == root) continue;
      std::vector<int> chunks;
      for (int c = 0; c < s.n_chunks; ++c)
        if (s.sink_worker[c] == w) chunks.push_back(c);
      if (!chunks.empty()) to_root.transfers.push_back(topo::Transfer{w, root, chunks});
    }
    after.push_back(std::move(to_root));
  }
  // Gather messages of consecutive chunks go straight from / into the final slots (slot c holds
  // chunk c); others are staged so that each message is one contiguous buffer.
  for (const topo::Step& step : after) {
    Stage st{StageKind::kGather, {}, {}, {}};
    for (const topo::Transfer& t : step.transfers) {
      if (t.src != me && t.dst != me) continue;
      bool consecutive = !t.chunks.empty();
      for (size_t j = 1; j < t.chunks.size(); ++j)
        consecutive = consecutive && t.chunks[j] == t.chunks[0] + static_cast<int>(j);
      int first = t.chunks.empty() ? 0 : t.chunks[0];
      if (!consecutive) {
        first = slot;
        slot += static_cast<int>(t.chunks.size());
      }
      (t.src == me ? st.sends : st.recvs).push_back({t.src == me ? t.dst : t.src, t.chunks, first});
    }
    p.stages.push_back(std::move(st));
  }
  p.stages.push_back(Stage{StageKind::kFinish, {}, {}, {}});
  p.slots = slot;
  for (int c = 0; c < s.n_chunks; ++c) {
    const bool mine = collective == Collective::kAllReduce ||
                      (collective == Collective::kReduceScatter && s.sink_worker[c] == me) ||
                      (collective == Collective::kReduce && me == root);
    if (mine) p.finish_chunks.push_back(c);
  }

  // Hop inputs and rounding keys from each chunk's in-tree (node index == worker).
  for (Stage& st : p.stages)
    for (Program::HopJob& h : st.hops) {
      const topo::ChunkTree& tree = s.trees[h.chunk];
      const topo::TreeNode& node = tree.nodes[me];
      for (int child : node.children) {
        auto it = rx_slot.find({h.chunk, tree.nodes[child].worker});
        if (it == rx_slot.end())
          DQ_FAIL(Status::kInternal, "dynamiq: schedule gives rank %d no message for chunk %d", me,
                  h.chunk);
        h.in_slots.push_back(it->second);
      }
      topo::RoundingStrata strata;
      topo::rounding_strata(tree, &strata);
      h.key = RoundingKey{};
      h.key.seed = seed;
      h.key.rank = static_cast<uint32_t>(me);
      h.key.stratum = static_cast<uint32_t>(strata.member[me]);
      h.key.strata = static_cast<uint32_t>(strata.size[me]);
      h.key.stratum_class = static_cast<uint32_t>(strata.klass[me]);
      p.max_inputs = std::max(p.max_inputs, h.in_slots.size());
    }
  return Status::kOk;
}

}  // namespace dq::engine

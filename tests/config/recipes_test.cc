// The opt-in rules of docs/RECIPES.md, read from the document itself (the lines
// `export DYNAMIQ_COMMS=RULE  # recipe: NAME`), against the communicators each framework creates
// for the layout its recipe names, as the shim records them (name, size, creation index, split
// color: docs/RECIPES.md, "What the shim sees of a communicator"). Every gradient communicator
// must be selected; every one that reduces activations or other large non-gradient data must not
// be. The rules are parsed and matched by the shim's own config::parse_opt_in / opted_in.
// Usage: recipes_test docs/RECIPES.md
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <map>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "config/optin.h"

namespace {

std::string g_recipes_path;

// What a communicator carries, and so what a recipe's rule must do with it.
enum class Carries {
  kGradients,    // the data-parallel gradient reductions: must be selected
  kOtherData,    // activations, embedding gradients, ...: must not be selected
  kSmallOrNone,  // 1-element norms, flags, barriers (below DYNAMIQ_MIN_BYTES) or no
                 // reduction at all: either way
};

struct Comm {
  std::string what;
  dq::config::CommIdentity id;
  Carries carries;
};

// The rules of the recipes file, by recipe name.
std::map<std::string, std::string> read_rules(const std::string& path) {
  std::ifstream in(path);
  std::map<std::string, std::string> rules;
  const std::regex line(R"(export DYNAMIQ_COMMS=(\S+)\s+# recipe: ([a-z0-9_-]+))");
  std::string text;
  while (std::getline(in, text)) {
    std::smatch m;
    if (std::regex_search(text, m, line)) rules[m[2]] = m[1];
  }
  return rules;
}

dq::config::CommIdentity identity(int size, int index, int color = -1) {
  dq::config::CommIdentity id;
  id.size = size;
  id.index = index;
  id.color = color;
  return id;
}

// Checks `rule` against `comms`; every failure names the communicator.
void check_rule(const std::string& recipe, const std::vector<Comm>& comms) {
  const auto rules = read_rules(g_recipes_path);
  auto it = rules.find(recipe);
  ASSERT_NE(it, rules.end()) << "no `export DYNAMIQ_COMMS=... # recipe: " << recipe << "` line in "
                             << g_recipes_path;
  dq::config::OptInRules parsed;
  std::string error;
  ASSERT_EQ(dq::config::parse_opt_in(it->second, &parsed, &error), dq::Status::kOk)
      << recipe << ": " << it->second << ": " << error;
  for (const Comm& c : comms) {
    const bool selected = dq::config::opted_in(parsed, c.id);
    if (c.carries == Carries::kGradients) {
      EXPECT_TRUE(selected) << recipe << " (" << it->second << ") leaves out " << c.what;
    } else if (c.carries == Carries::kOtherData) {
      EXPECT_FALSE(selected) << recipe << " (" << it->second << ") selects " << c.what;
    }
  }
}

// Megatron-LM's groups for one rank (parallel_state.initialize_model_parallel): one communicator
// per kind the rank belongs to, with that kind's size, in the order the kinds are created.
std::vector<Comm> megatron_groups(int tp, int pp, int cp, int dp) {
  const int world = tp * pp * cp * dp;
  const int etp = tp, ep = 1;  // dense model: expert TP = TP, no expert parallelism
  int index = 0;
  std::vector<Comm> out;
  auto add = [&](const char* what, int size, Carries carries) {
    out.push_back({what, identity(size, index++), carries});
  };
  add("the default group (world)", world, Carries::kSmallOrNone);
  add("DATA_PARALLEL_GROUP", dp, Carries::kGradients);
  add("DATA_PARALLEL_GROUP_WITH_CP (intra_dp_cp: the reduce-scatter of every bucket)", dp * cp,
      Carries::kGradients);
  add("CONTEXT_PARALLEL_GROUP", cp, cp > 1 ? Carries::kOtherData : Carries::kSmallOrNone);
  add("MODEL_PARALLEL_GROUP (TP x PP: gradient norm, overflow flag)", tp * pp,
      Carries::kSmallOrNone);
  add("TENSOR_MODEL_PARALLEL_GROUP (activation all-reduces)", tp, Carries::kOtherData);
  add("PIPELINE_MODEL_PARALLEL_GROUP", pp, Carries::kOtherData);
  add("EMBEDDING_GROUP (tied embedding gradient, first and last stage)", 2, Carries::kOtherData);
  add("TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP", tp * dp * cp, Carries::kOtherData);
  add("TENSOR_AND_CONTEXT_PARALLEL_GROUP", tp * cp, Carries::kOtherData);
  add("EXPERT_TENSOR_PARALLEL_GROUP", etp, Carries::kOtherData);
  add("EXPERT_DATA_PARALLEL_GROUP (MoE expert gradients)", world / (etp * ep * pp),
      Carries::kGradients);
  return out;
}

TEST(Recipes, DdpSelectsTheDefaultGroup) {
  // torchrun DDP, 16 ranks: the default group, created first (DDP's broadcast), carries the
  // bucket all-reduces; point-to-point communicators of 2 ranks carry no reduction.
  check_rule("ddp", {{"the default group", identity(16, 0), Carries::kGradients},
                     {"a send/recv pair", identity(2, 1), Carries::kSmallOrNone}});
}

TEST(Recipes, Fsdp2OneDimensionalMeshIsTheDefaultGroup) {
  // DeviceMesh reuses the default group for a 1-D mesh over the world.
  check_rule("fsdp2", {{"the default group = the 1-D mesh", identity(16, 0), Carries::kGradients}});
}

TEST(Recipes, HsdpSelectsShardAndReplicateGroups) {
  // (replicate 2, shard 8) on 16 ranks; each mesh dimension a new_group. Made by ncclCommSplit
  // under a device-bound default group (color = hash of the group's ranks), or by init (-1).
  for (int color : {-1, 123456789}) {
    check_rule("hsdp",
               {{"the default group", identity(16, 0), Carries::kSmallOrNone},
                {"the shard group (reduce-scatter)", identity(8, 1, color), Carries::kGradients},
                {"the replicate group (all-reduce)", identity(2, 2, color), Carries::kGradients}});
  }
}

TEST(Recipes, ZeroSelectsTheClonedWorldGroup) {
  // No mpu, 16 ranks: the default group and DeepSpeed's clone of it (dist.new_group over every
  // rank), same size, either created first.
  for (int dp_index : {0, 1}) {
    check_rule("zero", {{"the default group (broadcasts, small reductions)",
                         identity(16, 1 - dp_index), Carries::kSmallOrNone},
                        {"the ZeRO data-parallel group (_clone_world_group)",
                         identity(16, dp_index), Carries::kGradients}});
  }
}

TEST(Recipes, MegatronSizeRuleOnTheDocumentedLayout) {
  // TP=8, PP=2, CP=1, DP=4 on 64 GPUs, as the recipe names.
  check_rule("megatron", megatron_groups(8, 2, 1, 4));
}

TEST(Recipes, MegatronSizeRuleWhereTheModelParallelGroupHasTheDpSize) {
  // TP=2, PP=2, DP=4: TP x PP = 4 too; the recipe says the rule still holds because that group
  // carries only small reductions, and the check above would catch it carrying more.
  check_rule("megatron", megatron_groups(2, 2, 1, 4));
}

TEST(Recipes, TheCheckCatchesARuleThatSelectsTheTensorParallelGroup) {
  // A layout the recipe warns about (TP = DP = 4): its rule would compress activations. The
  // check must see that, or the tests above prove nothing.
  const auto comms = megatron_groups(4, 2, 1, 4);
  dq::config::OptInRules parsed;
  std::string error;
  ASSERT_EQ(dq::config::parse_opt_in(read_rules(g_recipes_path).at("megatron"), &parsed, &error),
            dq::Status::kOk);
  bool selects_tp = false;
  for (const Comm& c : comms)
    if (c.what.rfind("TENSOR_MODEL_PARALLEL_GROUP", 0) == 0) selects_tp = opted_in(parsed, c.id);
  EXPECT_TRUE(selects_tp);
}

}  // namespace

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  if (argc < 2) {
    std::fprintf(stderr, "usage: recipes_test docs/RECIPES.md\n");
    return 2;
  }
  g_recipes_path = argv[1];
  if (!std::ifstream(g_recipes_path)) {
    std::fprintf(stderr, "cannot read %s\n", g_recipes_path.c_str());
    return 1;
  }
  return RUN_ALL_TESTS();
}

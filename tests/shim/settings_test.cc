// Units of config/ (the settings table, opt-in rules) and the engine's control words.
#include <gtest/gtest.h>

#include <cctype>
#include <cstdio>
#include <map>
#include <string>

#include "common/log.h"
#include "config/optin.h"
#include "config/settings.h"
#include "kernels/budget_model.h"
#include "kernels/codec.h"
#include "shim/engine/control.h"
#include "shim/engine/engine.h"
#include "tests/common/locales.h"

namespace dq {
namespace {

using Map = std::map<std::string, std::string>;

const char* lookup(const char* key, void* ctx) {
  auto* m = static_cast<Map*>(ctx);
  auto it = m->find(key);
  return it == m->end() ? nullptr : it->second.c_str();
}

Status load(Map env, config::Settings* s, std::string* error) {
  return config::load(lookup, &env, s, error);
}

TEST(Settings, DefaultsAreValidAndOff) {
  config::Settings s;
  std::string error;
  ASSERT_EQ(load({}, &s, &error), Status::kOk) << error;
  EXPECT_FALSE(s.enable);
  EXPECT_EQ(s.codec_spec, "dynamiq:5");
  EXPECT_EQ(s.min_bytes, 1 << 20);
  EXPECT_EQ(s.block_bytes, 16 << 20);
  EXPECT_TRUE(s.allow_f32 && s.allow_bf16);
  EXPECT_EQ(s.topology, "auto");
}

TEST(Settings, ParsesEveryKind) {
  config::Settings s;
  std::string error;
  ASSERT_EQ(load({{"DYNAMIQ_ENABLE", "on"},
                  {"DYNAMIQ_BITS", "4.5"},
                  {"DYNAMIQ_MIN_BYTES", "64K"},
                  {"DYNAMIQ_DTYPES", "bf16"},
                  {"DYNAMIQ_CORRELATED", "false"},
                  {"DYNAMIQ_SEED", "0x10"},
                  {"DYNAMIQ_TOPO", "Ring"},
                  {"DYNAMIQ_CODEC", "MXFP8"}},
                 &s, &error),
            Status::kOk)
      << error;
  EXPECT_TRUE(s.enable);
  EXPECT_DOUBLE_EQ(s.budget_bits, 4.5);
  EXPECT_EQ(s.bits, "4.5");
  EXPECT_EQ(s.min_bytes, 65536);
  EXPECT_FALSE(s.allow_f32);
  EXPECT_TRUE(s.allow_bf16);
  EXPECT_FALSE(s.correlated);
  EXPECT_EQ(s.seed, 16);
  EXPECT_EQ(s.topology, "ring");
  EXPECT_EQ(s.codec_spec, "mxfp8");
  ASSERT_EQ(load({{"DYNAMIQ_CORRELATED", "0"}}, &s, &error), Status::kOk);
  EXPECT_EQ(s.codec_spec, "dynamiq:5:corr=0");
}

// The codec travels as a CodecSpec parsed once at load; its text is the settings' codec_spec,
// and every spec the engine makes (auto's candidates, with corr=0 when DYNAMIQ_CORRELATED=0)
// prints as the text it was parsed from (logs and the metrics' codec label name it).
// On a thread whose locale writes "4,5" (an application's setlocale(LC_ALL, "") on a German
// host), the settings, codec specs and budget targets still read and print C's numbers: before,
// DYNAMIQ_BITS=4.5 was refused (compression off) and the start-up check's own specs failed.
TEST(Settings, NumbersIgnoreTheThreadsLocale) {
  if (test::comma_locale() == static_cast<locale_t>(nullptr))
    GTEST_SKIP() << "localedef could not make de_DE.UTF-8 (apt-get install locales)";
  const test::InLocale comma(test::comma_locale());
  char probe[16];
  std::snprintf(probe, sizeof probe, "%.1f", 4.5);
  ASSERT_STREQ(probe, "4,5") << "the thread's locale did not take";
  config::Settings s;
  std::string error;
  ASSERT_EQ(load({{"DYNAMIQ_ENABLE", "1"}, {"DYNAMIQ_BITS", "4.5"}}, &s, &error), Status::kOk)
      << error;
  EXPECT_DOUBLE_EQ(s.budget_bits, 4.5);
  EXPECT_EQ(s.bits, "4.5");
  EXPECT_EQ(s.codec_spec, "dynamiq:4.5");
  CodecSpec spec;
  ASSERT_TRUE(parse_codec_spec("dynamiq:9.5:eps8=0.25", &spec, &error)) << error;
  EXPECT_EQ(codec_spec_text(spec), "dynamiq:9.5:eps8=0.25");
  BudgetTarget target;
  ASSERT_TRUE(parse_budget_target("vnmse:0.01", &target));
  EXPECT_EQ(budget_target_name(target), "vnmse:0.01");
  for (int c = 0; c < kCandidates; ++c)
    EXPECT_TRUE(parse_codec_spec(candidate_spec(c), &spec, &error)) << candidate_spec(c);
  std::snprintf(probe, sizeof probe, "%.1f", 4.5);
  EXPECT_STREQ(probe, "4,5") << "the thread's own locale, back";
}

// Words in any case under a locale whose tolower leaves 'I' alone (tr_TR.UTF-8): "RING" was
// "rIng" to std::tolower there, an invalid topology.
TEST(Settings, WordsIgnoreTheThreadsLocale) {
  const locale_t turkish = test::compiled_locale("tr_TR");
  if (turkish == static_cast<locale_t>(nullptr))
    GTEST_SKIP() << "localedef could not make tr_TR.UTF-8 (apt-get install locales)";
  const test::InLocale in_turkish(turkish);
  // Through a volatile: GCC assumes std::tolower's result is never upper case (as in the C
  // locale) and would fold the comparison.
  volatile int lowered = std::tolower('I');
  ASSERT_EQ(static_cast<int>(lowered), 'I') << "the thread's locale did not take";
  config::Settings s;
  std::string error;
  ASSERT_EQ(load({{"DYNAMIQ_TOPO", "RING"}, {"DYNAMIQ_BITS", "AUTO"}, {"DYNAMIQ_TARGET", "MXFP8"}},
                 &s, &error),
            Status::kOk)
      << error;
  EXPECT_EQ(s.topology, "ring");
  BudgetTarget target;
  EXPECT_TRUE(parse_budget_target("VNMSE:0.01", &target));
  // The log's level and subsystem words too: copies of the log outside the shim's C-locale
  // guard (the net plugin, the CPU NCCL) read them in the application's locale.
  LogLevel level = LogLevel::kNone;
  EXPECT_TRUE(log_parse_level("info", &level));
  EXPECT_EQ(level, LogLevel::kInfo);
  EXPECT_TRUE(log_parse_level("Version", &level));
  EXPECT_EQ(level, LogLevel::kVersion);
}

// Integers are decimal or 0x hex: a leading zero is not octal.
TEST(Settings, LeadingZerosAreDecimal) {
  config::Settings s;
  std::string error;
  ASSERT_EQ(load({{"DYNAMIQ_SEED", "0123"}, {"DYNAMIQ_CONTROL_WINDOW", "08"}}, &s, &error),
            Status::kOk)
      << error;
  EXPECT_EQ(s.seed, 123);
  EXPECT_EQ(s.control_window, 8);
  ASSERT_EQ(load({{"DYNAMIQ_SEED", "0x10"}}, &s, &error), Status::kOk) << error;
  EXPECT_EQ(s.seed, 16);
}

TEST(Settings, CodecSpecIsParsedOnceAndPrintsAsItsText) {
  config::Settings s;
  std::string error;
  for (const Map& env : {Map{}, Map{{"DYNAMIQ_CORRELATED", "0"}}, Map{{"DYNAMIQ_CODEC", "mxfp8"}},
                         Map{{"DYNAMIQ_BITS", "6.5"}}, Map{{"DYNAMIQ_CODEC", "uniform"}}}) {
    ASSERT_EQ(load(env, &s, &error), Status::kOk) << error;
    CodecSpec parsed;
    ASSERT_TRUE(parse_codec_spec(s.codec_spec, &parsed, &error)) << error;
    EXPECT_TRUE(parsed == s.parsed_codec_spec) << s.codec_spec;
    EXPECT_EQ(codec_spec_text(s.parsed_codec_spec), s.codec_spec);
  }
  for (int c = 0; c < kCandidates; ++c) {
    CodecSpec spec;
    ASSERT_TRUE(parse_codec_spec(candidate_spec(c), &spec, &error)) << error;
    EXPECT_EQ(codec_spec_text(spec), candidate_spec(c));
    if (candidate_is_mx(c)) continue;
    CodecSpec uncorrelated;
    ASSERT_TRUE(parse_codec_spec(candidate_spec(c) + ":corr=0", &uncorrelated, &error));
    spec.correlated_rounding = false;
    EXPECT_TRUE(spec == uncorrelated) << candidate_spec(c);
  }
  CodecSpec spec;
  EXPECT_FALSE(parse_codec_spec("dynamiq:5:corr=2", &spec, &error));
  EXPECT_FALSE(parse_codec_spec("uniform:4.5", &spec, &error));
  ASSERT_TRUE(parse_codec_spec("dynamiq:7:eps4=0.25:levels=uniform", &spec, &error)) << error;
  EXPECT_EQ(codec_spec_text(spec), "dynamiq:7:levels=uniform:eps4=0.25");
}

// Every invalid value: one message naming the variable, the value and what is accepted; the
// result is disabled (pass-through).
TEST(Settings, InvalidValuesAreNamedAndDisable) {
  struct Case {
    const char* key;
    const char* value;
    const char* says;
  } cases[] = {
      {"DYNAMIQ_ENABLE", "maybe", "DYNAMIQ_ENABLE=maybe is not valid; accepted: 0|1"},
      {"DYNAMIQ_BITS", "2", "DYNAMIQ_BITS=2 is not valid; accepted: 3..16"},
      {"DYNAMIQ_BITS", "5x", "DYNAMIQ_BITS=5x is not valid"},
      {"DYNAMIQ_MIN_BYTES", "-1", "DYNAMIQ_MIN_BYTES=-1 is not valid"},
      {"DYNAMIQ_MIN_BYTES", "3Q", "DYNAMIQ_MIN_BYTES=3Q is not valid"},
      {"DYNAMIQ_BLOCK_BYTES", "1K", "DYNAMIQ_BLOCK_BYTES=1K is not valid; accepted: 256K..1G"},
      {"DYNAMIQ_TIMEOUT_MS", "10", "DYNAMIQ_TIMEOUT_MS=10 is not valid"},
      {"DYNAMIQ_TOPO", "torus",
       "DYNAMIQ_TOPO=torus is not a topology; accepted: ring, butterfly, auto"},
      {"DYNAMIQ_CODEC", "zip", "DYNAMIQ_CODEC=zip is not a codec"},
      {"DYNAMIQ_DTYPES", "float32,int8", "DYNAMIQ_DTYPES=float32,int8 is not a comma list"},
      // Every term is read, the 17th and later included (they were not).
      {"DYNAMIQ_DTYPES",
       "fp32,fp32,fp32,fp32,fp32,fp32,fp32,fp32,fp32,fp32,fp32,fp32,fp32,fp32,"
       "fp32,fp32,fp32,bogus",
       "is not a comma list"},
      {"DYNAMIQ_COLLECTIVES", "allreduce,,,,,,,,,,,,,,,,,bogus", "is not"},
      {"DYNAMIQ_COMMS", "rank=3", "DYNAMIQ_COMMS=rank=3: unknown term 'rank=3'"},
      {"DYNAMIQ_COMMS", "size=x",
       "DYNAMIQ_COMMS=size=x: term 'size=x' needs a non-negative integer"},
  };
  // (A bad metrics setting turns the metrics file off, not compression: tests/config.)
  for (const Case& c : cases) {
    config::Settings s;
    std::string error;
    Map env{{c.key, c.value}};
    env.emplace("DYNAMIQ_ENABLE", "1");  // no effect when c.key is DYNAMIQ_ENABLE itself
    EXPECT_EQ(load(env, &s, &error), Status::kInvalidArgument) << c.key << "=" << c.value;
    EXPECT_NE(error.find(c.says), std::string::npos) << error;
    EXPECT_FALSE(s.enable) << c.key;
  }
}

// DYNAMIQ_BITS=auto and DYNAMIQ_TARGET (the budget): accepted spellings, their canonical text (what
// the agreement hashes), and a bad target, auto with a fixed format or a target with a fixed
// budget (which it would not steer): one message, compression off.
TEST(Settings, AutoBudgetAndTarget) {
  config::Settings s;
  std::string error;
  ASSERT_EQ(load({{"DYNAMIQ_BITS", "AUTO"}, {"DYNAMIQ_TARGET", "VNMSE:1e-3"}}, &s, &error),
            Status::kOk)
      << error;
  EXPECT_TRUE(s.bits_auto);
  EXPECT_EQ(s.bits, "auto");
  EXPECT_DOUBLE_EQ(s.budget_bits, 5.0);  // a bucket's first call
  EXPECT_EQ(s.codec_spec, "dynamiq:5");
  EXPECT_EQ(s.target, "vnmse:0.001");
  ASSERT_EQ(load({{"DYNAMIQ_BITS", "5.0"}}, &s, &error), Status::kOk);
  EXPECT_FALSE(s.bits_auto);
  EXPECT_EQ(s.bits, "5");  // 5.0 and 5 agree
  ASSERT_EQ(load({{"DYNAMIQ_BITS", "auto"}, {"DYNAMIQ_TARGET", "MxFp6"}}, &s, &error), Status::kOk);
  EXPECT_EQ(s.target, "mxfp6");
  config::Settings fixed, automatic;
  ASSERT_EQ(load({}, &fixed, &error), Status::kOk);
  ASSERT_EQ(load({{"DYNAMIQ_BITS", "auto"}}, &automatic, &error), Status::kOk);
  bool differs = false;
  for (int i = 0; i < config::Agreed::count(); ++i)
    differs = differs || config::Agreed::hash(fixed, i) != config::Agreed::hash(automatic, i);
  EXPECT_TRUE(differs) << "auto and the fixed default 5 must not agree";
  struct Case {
    Map env;
    const char* says;
  } cases[] = {
      {{{"DYNAMIQ_BITS", "auto"}, {"DYNAMIQ_TARGET", "fp8"}},
       "DYNAMIQ_TARGET=fp8 is not valid; accepted: mxfp8|mxfp6|vnmse:X (0 < X <= 10); "
       "compression is OFF"},
      {{{"DYNAMIQ_TARGET", "vnmse:0"}}, "DYNAMIQ_TARGET=vnmse:0 is not valid"},
      {{{"DYNAMIQ_TARGET", "vnmse:11"}}, "DYNAMIQ_TARGET=vnmse:11 is not valid"},
      {{{"DYNAMIQ_TARGET", "vnmse:"}}, "DYNAMIQ_TARGET=vnmse: is not valid"},
      {{{"DYNAMIQ_BITS", "automatic"}},
       "DYNAMIQ_BITS=automatic is not valid; accepted: 3..16 or auto"},
      {{{"DYNAMIQ_BITS", "auto"}, {"DYNAMIQ_CODEC", "mxfp8"}},
       "DYNAMIQ_BITS=auto is for DYNAMIQ_CODEC=dynamiq only"},
      {{{"DYNAMIQ_BITS", "5"}, {"DYNAMIQ_TARGET", "vnmse:0.01"}},
       "DYNAMIQ_TARGET=vnmse:0.01 is used only with DYNAMIQ_BITS=auto (here DYNAMIQ_BITS=5, a "
       "fixed budget); compression is OFF"},
      {{{"DYNAMIQ_TARGET", "mxfp8"}}, "DYNAMIQ_TARGET=mxfp8 is used only with DYNAMIQ_BITS=auto"},
      // One message where DYNAMIQ_BITS was refused first, not a second about the reset budget.
      {{{"DYNAMIQ_BITS", "auto"}, {"DYNAMIQ_CODEC", "mxfp8"}, {"DYNAMIQ_TARGET", "mxfp6"}},
       "DYNAMIQ_BITS=auto is for DYNAMIQ_CODEC=dynamiq only"},
      {{{"DYNAMIQ_BITS", "automatic"}, {"DYNAMIQ_TARGET", "mxfp6"}},
       "DYNAMIQ_BITS=automatic is not valid"},
  };
  for (Case& c : cases) {
    c.env.emplace("DYNAMIQ_ENABLE", "1");
    std::vector<config::Problem> problems;
    EXPECT_EQ(config::load(lookup, &c.env, &s, &error, &problems), Status::kInvalidArgument);
    EXPECT_EQ(problems.size(), 1u) << error;
    EXPECT_NE(error.find(c.says), std::string::npos) << error;
    EXPECT_FALSE(s.enable) << c.says;
  }
}

TEST(Settings, DescribeListsEveryKeyWithItsValue) {
  config::Settings s;
  std::string error;
  ASSERT_EQ(load({{"DYNAMIQ_BITS", "6"}}, &s, &error), Status::kOk);
  const std::string text = config::describe(s);
  for (const char* key : {"DYNAMIQ_ENABLE=0", "DYNAMIQ_BITS=6", "DYNAMIQ_TOPO=auto",
                          "DYNAMIQ_COMMS=all", "DYNAMIQ_CONTROL_FILE=", "DYNAMIQ_METRICS_FILE="})
    EXPECT_NE(text.find(key), std::string::npos) << key << "\n" << text;
}

TEST(Settings, AgreedHashesSeeEveryAgreedSettingAndIgnoreLocalOnes) {
  config::Settings a, b;
  std::string error;
  ASSERT_EQ(load({}, &a, &error), Status::kOk);
  const int n = config::Agreed::count();
  ASSERT_GE(n, 9);
  for (const char* key : {"DYNAMIQ_BITS", "DYNAMIQ_TOPO", "DYNAMIQ_MIN_BYTES", "DYNAMIQ_SEED",
                          "DYNAMIQ_CODEC", "DYNAMIQ_DTYPES", "DYNAMIQ_COMMS"}) {
    Map env{{key, std::string(key) == "DYNAMIQ_TOPO"     ? "ring"
                  : std::string(key) == "DYNAMIQ_CODEC"  ? "mxfp4"
                  : std::string(key) == "DYNAMIQ_DTYPES" ? "float32"
                  : std::string(key) == "DYNAMIQ_COMMS"  ? "none"
                                                         : "7"}};
    ASSERT_EQ(load(env, &b, &error), Status::kOk) << key << error;
    int differing = 0;
    std::string which;
    for (int i = 0; i < n; ++i)
      if (config::Agreed::hash(a, i) != config::Agreed::hash(b, i)) {
        ++differing;
        which = config::Agreed::key(i);
      }
    EXPECT_EQ(differing, 1) << key;
    EXPECT_EQ(which, key);
  }
  // Local settings (metrics, control file, timeout) may differ between ranks.
  ASSERT_EQ(load({{"DYNAMIQ_METRICS_FILE", "/tmp/x"},
                  {"DYNAMIQ_TIMEOUT_MS", "1000"},
                  {"DYNAMIQ_CONTROL_FILE", "/tmp/y"}},
                 &b, &error),
            Status::kOk);
  for (int i = 0; i < n; ++i) EXPECT_EQ(config::Agreed::hash(a, i), config::Agreed::hash(b, i));
}

// Spellings that select the same calls agree: the agreement hashes the lists' canonical text, so
// an alias or another order on some ranks does not switch the communicator off as a disagreement.
TEST(Settings, EquivalentListsAgree) {
  const std::pair<const char*, const char*> same[] = {
      {"bf16,FP32", "float32,bfloat16"}, {"float", "fp32,float32"}, {",bf16,", "bfloat16"}};
  for (const auto& [one, other] : same) {
    config::Settings a, b;
    std::string error;
    ASSERT_EQ(load({{"DYNAMIQ_DTYPES", one}}, &a, &error), Status::kOk) << error;
    ASSERT_EQ(load({{"DYNAMIQ_DTYPES", other}}, &b, &error), Status::kOk) << error;
    for (int i = 0; i < config::Agreed::count(); ++i)
      EXPECT_EQ(config::Agreed::hash(a, i), config::Agreed::hash(b, i))
          << one << " / " << other << ": " << config::Agreed::key(i);
  }
  config::Settings a, b;
  std::string error;
  ASSERT_EQ(load({{"DYNAMIQ_COLLECTIVES", "reduce,AllReduce"}}, &a, &error), Status::kOk);
  ASSERT_EQ(load({{"DYNAMIQ_COLLECTIVES", "allreduce,reduce,reduce"}}, &b, &error), Status::kOk);
  for (int i = 0; i < config::Agreed::count(); ++i)
    EXPECT_EQ(config::Agreed::hash(a, i), config::Agreed::hash(b, i)) << config::Agreed::key(i);
  // Different selections still differ.
  ASSERT_EQ(load({{"DYNAMIQ_DTYPES", "bf16"}}, &a, &error), Status::kOk);
  ASSERT_EQ(load({{"DYNAMIQ_DTYPES", "fp32"}}, &b, &error), Status::kOk);
  int differing = 0;
  for (int i = 0; i < config::Agreed::count(); ++i)
    differing += config::Agreed::hash(a, i) != config::Agreed::hash(b, i);
  EXPECT_EQ(differing, 1);
}

TEST(OptIn, RulesMatchNameSizeIndexColor) {
  config::OptInRules rules;
  std::string error;
  ASSERT_EQ(config::parse_opt_in("name=grad*,size=8,index=2,color=3", &rules, &error), Status::kOk);
  EXPECT_TRUE(config::opted_in(rules, {"grad.0", 4, 0, -1}));
  EXPECT_FALSE(config::opted_in(rules, {"optim", 4, 0, -1}));
  EXPECT_TRUE(config::opted_in(rules, {"", 8, 0, -1}));
  EXPECT_TRUE(config::opted_in(rules, {"", 4, 2, -1}));
  EXPECT_TRUE(config::opted_in(rules, {"", 4, 0, 3}));
  EXPECT_FALSE(config::opted_in(rules, {"", 4, 0, 4}));
  ASSERT_EQ(config::parse_opt_in("none", &rules, &error), Status::kOk);
  EXPECT_FALSE(config::opted_in(rules, {"grad", 8, 0, 3}));
  ASSERT_EQ(config::parse_opt_in("all", &rules, &error), Status::kOk);
  EXPECT_TRUE(config::opted_in(rules, {"", 2, 9, -1}));
  EXPECT_TRUE(config::glob_match("a*b?c", "axxxbyc"));
  EXPECT_FALSE(config::glob_match("a*b?c", "axxxbc"));
  EXPECT_TRUE(config::glob_match("*", ""));
  EXPECT_FALSE(config::glob_match("grad", "grad.0"));
}

// The control words, reduced with MAX across simulated ranks.
std::vector<uint32_t> reduce_max(const std::vector<engine::LocalControl>& ranks) {
  std::vector<uint32_t> out(engine::control_words(), 0), w(engine::control_words());
  for (const auto& r : ranks) {
    engine::pack_control(r, w.data());
    for (size_t i = 0; i < w.size(); ++i) out[i] = std::max(out[i], w[i]);
  }
  return out;
}

// The handshake's size is part of the wire: the same in every build, or two builds' ranks would
// all-reduce different counts before the version pair could tell them apart. 106 words: 4 fixed
// pairs, kAgreedSlots = 48 setting pairs, the switch and the failure word.
TEST(Control, HandshakeSizeIsFixed) {
  EXPECT_EQ(engine::control_words(), 106);
  EXPECT_LE(config::Agreed::count(), engine::kAgreedSlots) << "settings.def outgrew the slots";
  // A build with one agreed setting more (its pair in this build's first unused slot) and its own
  // protocol version: same size, and the difference is named, not a hang.
  config::Settings s;
  std::string error;
  ASSERT_EQ(load({{"DYNAMIQ_ENABLE", "1"}}, &s, &error), Status::kOk);
  const engine::LocalControl local{&s, true, true, true, true, false};
  std::vector<uint32_t> ours(engine::control_words()), theirs(engine::control_words());
  engine::pack_control(local, ours.data());
  engine::pack_control(local, theirs.data());
  const int unused = 2 * (4 + config::Agreed::count());
  EXPECT_EQ(ours[unused], 0u);
  EXPECT_EQ(ours[unused + 1], ~0u);
  theirs[0] = engine::kProtocolVersion + 1;
  theirs[1] = ~theirs[0];
  theirs[unused] = 0x1234u;
  theirs[unused + 1] = ~0x1234u;
  std::vector<uint32_t> reduced(ours.size());
  for (size_t i = 0; i < ours.size(); ++i) reduced[i] = std::max(ours[i], theirs[i]);
  const engine::ControlDecision d = engine::decide_control(reduced.data());
  EXPECT_FALSE(d.agreed);
  EXPECT_NE(d.differs.find("dynamiq version"), std::string::npos) << d.differs;
  EXPECT_FALSE(d.compress());
}

TEST(Control, AgreementSwitchAndFailure) {
  config::Settings s, other;
  std::string error;
  ASSERT_EQ(load({{"DYNAMIQ_ENABLE", "1"}}, &s, &error), Status::kOk);
  ASSERT_EQ(load({{"DYNAMIQ_ENABLE", "1"}, {"DYNAMIQ_BITS", "6"}}, &other, &error), Status::kOk);
  engine::LocalControl root{&s, true, true, true, true, false};
  engine::LocalControl peer{&s, true, true, false, true, false};
  auto d = engine::decide_control(reduce_max({root, peer, peer}).data());
  EXPECT_TRUE(d.agreed);
  EXPECT_TRUE(d.compress());
  // Rank 0's switch decides for everyone; other ranks' switch state is ignored.
  root.switch_on = false;
  d = engine::decide_control(reduce_max({root, peer, peer}).data());
  EXPECT_TRUE(d.agreed);
  EXPECT_FALSE(d.switch_on);
  EXPECT_FALSE(d.compress());
  root.switch_on = true;
  peer.switch_on = false;
  EXPECT_TRUE(engine::decide_control(reduce_max({root, peer}).data()).compress());
  // A local failure anywhere stops compression everywhere.
  engine::LocalControl sick = peer;
  sick.local_failure = true;
  d = engine::decide_control(reduce_max({root, peer, sick}).data());
  EXPECT_TRUE(d.any_failure);
  EXPECT_FALSE(d.compress());
  // A differing setting is detected and named, whichever rank holds it.
  engine::LocalControl odd{&other, true, true, false, true, false};
  for (auto ranks : {std::vector<engine::LocalControl>{root, odd, peer},
                     std::vector<engine::LocalControl>{root, peer, odd}}) {
    d = engine::decide_control(reduce_max(ranks).data());
    EXPECT_FALSE(d.agreed);
    EXPECT_NE(d.differs.find("DYNAMIQ_BITS"), std::string::npos) << d.differs;
    EXPECT_FALSE(d.compress());
  }
  // Opt-in on some ranks only.
  engine::LocalControl out = peer;
  out.opted_in = false;
  d = engine::decide_control(reduce_max({root, out}).data());
  EXPECT_FALSE(d.agreed);
  EXPECT_NE(d.differs.find("opt-in"), std::string::npos);
  // Everyone opted out: agreed, nothing compressed.
  engine::LocalControl root_out = root;
  root_out.opted_in = false;
  d = engine::decide_control(reduce_max({root_out, out}).data());
  EXPECT_TRUE(d.agreed);
  EXPECT_FALSE(d.enabled);
}

TEST(Topology, AutoPicksButterflyForPowersOfTwoFromFour) {
  EXPECT_EQ(engine::choose_topology("auto", 2), topo::Kind::kRing);
  EXPECT_EQ(engine::choose_topology("auto", 3), topo::Kind::kRing);
  EXPECT_EQ(engine::choose_topology("auto", 4), topo::Kind::kButterfly);
  EXPECT_EQ(engine::choose_topology("auto", 6), topo::Kind::kRing);
  EXPECT_EQ(engine::choose_topology("auto", 64), topo::Kind::kButterfly);
  EXPECT_EQ(engine::choose_topology("ring", 64), topo::Kind::kRing);
  EXPECT_EQ(engine::choose_topology("butterfly", 3), topo::Kind::kButterfly);
}

}  // namespace
}  // namespace dq

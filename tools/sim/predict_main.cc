// dynamiq-predict: the budget model (kernels/budget_model.h) against the simulator. The input
// (a .npy [workers, d] or synthetic gradients) is cut into buckets of --bucket elements; for
// each bucket, topology and worker count it prints, as JSON lines:
//   kind "fixed":   per fixed DynamiQ budget, the predicted and the measured vNMSE;
//   kind "mx":      the same for MXFP8 and MXFP6 (the targets auto compares against);
//   kind "auto":    the rung the model chooses for --target from the bucket's own statistics
//                   (the engine uses the previous call's), its bits per coordinate and measured
//                   vNMSE, against MXFP8's and fixed 5 bits' measured vNMSE;
// then one "summary" line per kind: median and 90th percentile of predicted / measured, the
// share of buckets within [0.67, 1.5], and for auto the bits and error over all buckets.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "kernels/bf16.h"
#include "kernels/budget_model.h"
#include "kernels/dynamiq_codec.h"
#include "tools/sim/auto_choice.h"
#include "tools/sim/cli_common.h"
#include "tools/sim/gradients.h"
#include "tools/sim/simulate.h"
#include "tools/sim/two_level.h"

namespace {

using dq::Status;

constexpr const char* kUsage =
    "usage: dynamiq-predict (--input FILE.npy | --synthetic) [options]\n"
    "  --input FILE.npy    float32 [rows, d], row i = worker i\n"
    "  --synthetic         synthetic gradients (--dim, --spread, --shared, --seed)\n"
    "  --dim D --spread S --shared F --seed K   as dynamiq-sim (defaults 1048576, 2, 0.5, 1)\n"
    "  --workers LIST      worker counts (default 4)\n"
    "  --topo LIST         ring,butterfly (default ring)\n"
    "  --ranks-per-node L  ranks per node (default 1); each --workers count a multiple of L\n"
    "  --hierarchy LIST    flat,node (default flat); node: the two-level all-reduce (as\n"
    "                      dynamiq-sim's), predicted per shard from the node sums' statistics\n"
    "                      over the nodes (fixed and mx rows; auto rows are flat only)\n"
    "  --columns B:E       only columns [B, E) of --input (a part of a corpus; E may be end)\n"
    "  --bucket N          elements per bucket (default 262144; the last takes the rest)\n"
    "  --budgets LIST      fixed budgets to check (default 3,4,5,6,7,8)\n"
    "  --target T          auto's target: mxfp8, mxfp6 or vnmse:X (default mxfp8)\n";

int fail(const std::string& what) {
  return dq::sim::usage_error("dynamiq-predict", what, kUsage);
}

double quantile(std::vector<double> v, double q) {
  if (v.empty()) return NAN;
  std::sort(v.begin(), v.end());
  const double at = q * static_cast<double>(v.size() - 1);
  const size_t lo = static_cast<size_t>(at);
  const size_t hi = std::min(lo + 1, v.size() - 1);
  return v[lo] + (at - static_cast<double>(lo)) * (v[hi] - v[lo]);
}

struct Measured {
  double vnmse = 0, bits = 0;
};

// The shape a bucket is reduced in: flat (sched over every rank), or two-level (sched over the
// nodes, `local` ranks per node).
struct Shape {
  const dq::topo::Schedule* sched = nullptr;
  bool two_level = false;
  int local = 1;
};

bool measure_uncached(const std::string& spec, const Shape& shape,
                      const std::vector<const float*>& rows, size_t d, Measured* out) {
  std::string err;
  auto codec = dq::make_codec(spec, &err);
  if (!codec) return false;
  dq::sim::SimOptions o;
  dq::sim::SimResult r;
  const Status st =
      shape.two_level ? dq::sim::simulate_two_level_allreduce(spec, *shape.sched, shape.local, rows,
                                                              d, o, nullptr, &r)
                      : dq::sim::simulate_allreduce(*codec, *shape.sched, rows, d, o, nullptr, &r);
  if (st != Status::kOk) return false;
  out->vnmse = r.vnmse;
  out->bits = r.bits_per_coord;
  return true;
}

// One bucket's simulations by codec spec: a codec the fixed, MX and auto rows share ("dynamiq:5",
// "mxfp8", auto's choice) is simulated once (the simulator is deterministic in its inputs).
class BucketMeasurements {
 public:
  BucketMeasurements(const Shape& shape, const std::vector<const float*>& rows, size_t d)
      : shape_(shape), rows_(rows), d_(d) {}
  bool get(const std::string& spec, Measured* out) {
    for (const auto& [s, m] : done_)
      if (s == spec) return *out = m, true;
    if (!measure_uncached(spec, shape_, rows_, d_, out)) return false;
    done_.emplace_back(spec, *out);
    return true;
  }

 private:
  Shape shape_;
  const std::vector<const float*>& rows_;
  size_t d_;
  std::vector<std::pair<std::string, Measured>> done_;
};

// The options (defaults as kUsage says) and the lists parsed from them.
struct PredictArgs {
  std::string input, workers_s = "4", topo_s = "ring", budgets_s = "3,4,5,6,7,8";
  std::string target_s = "mxfp8", columns_s, hierarchy_s = "flat";
  int ranks_per_node = 1;
  bool synthetic = false;
  size_t bucket = 262144;  // elements per bucket
  dq::sim::SyntheticSpec syn;
  size_t col_begin = 0, col_end = SIZE_MAX;  // --columns B:E
  dq::BudgetTarget target;
  std::vector<int> workers;
  std::vector<dq::topo::Kind> topos;
  std::vector<double> budgets;  // bits per coordinate
  std::vector<bool> two_level;  // per --hierarchy item: node (true) or flat
  int max_workers = 0;
};

// Returned by the steps of main when the run goes on (any other value is the exit code).
constexpr int kContinue = -1;

int parse_command_line(int argc, char** argv, PredictArgs* a) {
  for (int i = 1; i < argc; ++i) {
    const std::string o = argv[i];
    if (o == "-h" || o == "--help") return std::printf("%s", kUsage), 0;
    if (o == "--synthetic") {
      a->synthetic = true;
      continue;
    }
    if (i + 1 >= argc) return fail(o + " needs a value (or is unknown)");
    const std::string v = argv[++i];
    if (o == "--input")
      a->input = v;
    else if (o == "--workers")
      a->workers_s = v;
    else if (o == "--topo")
      a->topo_s = v;
    else if (o == "--budgets")
      a->budgets_s = v;
    else if (o == "--target")
      a->target_s = v;
    else if (o == "--columns")
      a->columns_s = v;
    else if (o == "--hierarchy")
      a->hierarchy_s = v;
    else if (o == "--ranks-per-node")
      a->ranks_per_node = std::atoi(v.c_str());
    else if (o == "--bucket")
      a->bucket = std::strtoull(v.c_str(), nullptr, 10);
    else if (o == "--dim")
      a->syn.cols = std::strtoull(v.c_str(), nullptr, 10);
    else if (o == "--spread")
      a->syn.spread = std::strtod(v.c_str(), nullptr);
    else if (o == "--shared")
      a->syn.shared = std::strtod(v.c_str(), nullptr);
    else if (o == "--seed")
      a->syn.seed = std::strtoull(v.c_str(), nullptr, 10);
    else
      return fail("unknown option " + o);
  }
  return kContinue;
}

// Checks the options and parses --columns, --target and the lists.
int check_options(PredictArgs* a) {
  if (a->input.empty() == !a->synthetic) return fail("give exactly one of --input or --synthetic");
  if (a->bucket < 256) return fail("--bucket must be at least 256");
  if (!a->columns_s.empty() &&
      (a->synthetic || !dq::sim::parse_column_range(a->columns_s, &a->col_begin, &a->col_end)))
    return fail("--columns " + a->columns_s + ": expected B:E or B:end with B < E, with --input");
  if (!dq::parse_budget_target(a->target_s, &a->target))
    return fail("--target " + a->target_s + ": expected mxfp8, mxfp6 or vnmse:X");
  for (const auto& w : dq::sim::split_list(a->workers_s))
    a->workers.push_back(std::atoi(w.c_str()));
  for (const auto& t : dq::sim::split_list(a->topo_s)) {
    dq::topo::Kind k;
    if (dq::topo::parse_kind(t, &k) != Status::kOk) return fail("unknown topology " + t);
    a->topos.push_back(k);
  }
  for (const auto& b : dq::sim::split_list(a->budgets_s))
    a->budgets.push_back(std::strtod(b.c_str(), nullptr));
  for (int w : a->workers) {
    if (w < 2 || w > 1024) return fail("--workers: each in 2..1024");
    a->max_workers = std::max(a->max_workers, w);
  }
  if (a->ranks_per_node < 1 || a->ranks_per_node > 1024)
    return fail("--ranks-per-node must be 1..1024");
  for (const auto& h : dq::sim::split_list(a->hierarchy_s)) {
    if (h != "flat" && h != "node") return fail("--hierarchy: unknown hierarchy " + h);
    a->two_level.push_back(h == "node");
  }
  if (a->two_level.empty()) return fail("empty --hierarchy list");
  for (int w : a->workers)
    if (w % a->ranks_per_node != 0 || w / a->ranks_per_node < 2)
      return fail("--workers " + std::to_string(w) +
                  ": need at least 2 nodes of --ranks-per-node " +
                  std::to_string(a->ranks_per_node));
  return kContinue;
}

int load_gradients(PredictArgs* a, dq::sim::Matrix* m) {
  std::string err;
  if (a->synthetic) {
    a->syn.rows = static_cast<size_t>(a->max_workers);
    dq::sim::make_synthetic(a->syn, m);
  } else if (dq::sim::read_npy_columns(a->input, a->max_workers, a->col_begin, a->col_end, m,
                                       &err) != Status::kOk ||
             static_cast<int>(m->rows) < a->max_workers) {
    return fail(err.empty() ? a->input + ": fewer rows than --workers" : err);
  }
  return kContinue;
}

// The figures the summary lines are made of, over every bucket, topology and worker count.
struct Totals {
  std::vector<double> ratio_fixed, ratio_mx;  // predicted / measured vNMSE
  double auto_bits = 0, auto_err = 0, mx_err = 0, five_err = 0, energy_all = 0, coords = 0;
  double mx_bits = 0;
  size_t auto_buckets = 0, auto_meets = 0;
};

// One bucket of one topology and worker count: what its rows are and how it was measured.
struct Bucket {
  dq::topo::Kind topo;
  int n = 0;
  Shape shape;
  size_t index = 0, offset = 0, count = 0;  // offset: the first column in the input file
  double energy = 0;                        // of the exact sum
};

nlohmann::ordered_json bucket_row(const Bucket& bk, const char* kind, const std::string& codec) {
  nlohmann::ordered_json j;
  j["kind"] = kind;
  j["bucket"] = bk.index;
  j["offset"] = bk.offset;
  j["count"] = bk.count;
  j["topo"] = dq::topo::kind_name(bk.topo);
  j["workers"] = bk.n;
  j["hierarchy"] = bk.shape.two_level ? "node" : "flat";
  j["ranks_per_node"] = bk.shape.local;
  j["codec"] = codec;
  return j;
}

// Measures `spec`, prints its predicted-against-measured row and keeps the ratio.
bool compare(BucketMeasurements& measured, const Bucket& bk, const char* kind,
             const std::string& spec, double pred, std::vector<double>* ratios, Measured* me) {
  if (!measured.get(spec, me)) return false;
  auto j = bucket_row(bk, kind, spec);
  j["predicted"] = pred;
  j["measured"] = me->vnmse;
  j["ratio"] = pred / me->vnmse;
  ratios->push_back(pred / me->vnmse);
  std::printf("%s\n", j.dump().c_str());
  return true;
}

// What the model predicts a bucket from: flat, one part (the bucket's statistics over every
// rank); two-level, one per shard (the node sums' statistics over the nodes, as each rail
// all-reduces them), each with its element count.
struct Parts {
  std::vector<std::unique_ptr<dq::StatsSummary>> owned;
  std::vector<const dq::StatsSummary*> view;
  std::vector<size_t> counts;
};

// Loads one part: the statistics of `rows` (d elements each, one row per worker of sched).
bool load_part(const dq::topo::Schedule& sched, const dq::HopTables& hop,
               const std::vector<const float*>& rows, size_t d, Parts* parts) {
  std::string err;
  auto base = dq::make_codec("dynamiq:5", &err);
  base->plan(d, sched.n_chunks, sched.n_workers);
  const std::vector<uint16_t> stats = dq::sim::reduced_stats(*base, rows, d);
  auto summary = std::make_unique<dq::StatsSummary>();
  if (!summary->load(stats.data(), d, sched.n_workers, hop.view())) return false;
  parts->view.push_back(summary.get());
  parts->owned.push_back(std::move(summary));
  parts->counts.push_back(d);
  return true;
}

// The bucket's parts; false when a statistic gives no summary.
bool load_parts(const Bucket& bk, const dq::HopTables& hop, const std::vector<const float*>& rows,
                Parts* parts) {
  const dq::topo::Schedule& sched = *bk.shape.sched;
  if (!bk.shape.two_level) return load_part(sched, hop, rows, bk.count, parts);
  std::vector<std::vector<float>> sums;
  dq::sim::node_sums(rows, bk.count, sched.n_workers, bk.shape.local, &sums);
  const size_t shard = dq::sim::two_level_shard_elems(bk.count, bk.shape.local);
  for (size_t begin = 0; begin < bk.count; begin += shard) {
    std::vector<const float*> rail;
    for (const auto& s : sums) rail.push_back(s.data() + begin);
    if (!load_part(sched, hop, rail, std::min(shard, bk.count - begin), parts)) return false;
  }
  return true;
}

// The "fixed" rows: every --budgets budget whose plan fits every part of the bucket.
int compare_fixed_budgets(const PredictArgs& a, const dq::topo::Schedule& sched, const Bucket& bk,
                          const Parts& parts, BucketMeasurements& measured, Totals* t) {
  std::string err;
  for (double bits : a.budgets) {
    std::vector<dq::DynamiqPlan> plans(parts.counts.size());
    std::vector<const dq::DynamiqPlan*> plan_of;
    bool fits = true;
    for (size_t i = 0; i < plans.size(); ++i) {
      bool f = false;
      if (dq::sim::auto_rung_plan(bits, parts.counts[i], sched, &plans[i], &f, &err) !=
          Status::kOk) {
        std::fprintf(stderr, "dynamiq-predict: %s\n", err.c_str());
        return 1;
      }
      fits = fits && f;
      plan_of.push_back(&plans[i]);
    }
    if (!fits) continue;
    const double pred = dq::predict_vnmse(parts.view, plan_of, nullptr);
    char spec[32];
    std::snprintf(spec, sizeof spec, "dynamiq:%g", bits);
    Measured me;
    if (!compare(measured, bk, "fixed", spec, pred, &t->ratio_fixed, &me)) return 1;
  }
  return kContinue;
}

// The "mx" rows (MXFP8 and MXFP6); *mx8 receives MXFP8's measurement.
int compare_mx(const Bucket& bk, const Parts& parts, BucketMeasurements& measured, Measured* mx8,
               Totals* t) {
  for (const char* spec : {"mxfp8", "mxfp6"}) {
    const double pred = dq::predict_mx_vnmse(parts.view, dq::mx_rounding_error(spec));
    Measured me;
    if (!compare(measured, bk, "mx", spec, pred, &t->ratio_mx, &me)) return 1;
    if (std::strcmp(spec, "mxfp8") == 0) *mx8 = me;
  }
  return kContinue;
}

// The "auto" row: the model's choice over every rung and the MX fallbacks, as the engine makes
// it, against MXFP8 and fixed 5 bits.
int compare_auto(const PredictArgs& a, const dq::topo::Schedule& sched, const Bucket& bk,
                 const dq::StatsSummary& summary, BucketMeasurements& measured, const Measured& mx8,
                 Totals* t) {
  std::string err;
  dq::BudgetPrediction pred;
  if (dq::sim::predict_auto(summary, bk.count, sched, a.target, &pred, &err) != Status::kOk)
    return kContinue;
  const std::string spec = dq::candidate_spec(pred.rung);
  Measured me, five;
  if (!measured.get(spec, &me) || !measured.get("dynamiq:5", &five)) return 1;
  // An MX bucket of the engine also all-reduces its statistics every 8th call.
  if (dq::candidate_is_mx(pred.rung)) {
    const size_t n_sg = (bk.count + 255) / 256;
    me.bits += 16.0 * static_cast<double>(dq::stats_words(n_sg, sched.n_workers)) /
               static_cast<double>(bk.count) / 8.0;
  }
  auto j = bucket_row(bk, "auto", spec);
  j["target"] = dq::budget_target_name(a.target);
  j["target_vnmse"] = pred.target;
  j["predicted"] = pred.vnmse[pred.rung];
  j["measured"] = me.vnmse;
  j["bits_per_coord"] = me.bits;
  j["mxfp8_measured"] = mx8.vnmse;
  j["mxfp8_bits_per_coord"] = mx8.bits;
  j["dynamiq5_measured"] = five.vnmse;
  j["dynamiq5_bits_per_coord"] = five.bits;
  j["energy"] = bk.energy;
  std::printf("%s\n", j.dump().c_str());
  const size_t d = bk.count;
  ++t->auto_buckets;
  t->auto_meets += me.vnmse <= mx8.vnmse;
  t->auto_bits += me.bits * d;
  t->mx_bits += mx8.bits * d;
  t->coords += d;
  t->auto_err += me.vnmse * bk.energy;
  t->mx_err += mx8.vnmse * bk.energy;
  t->five_err += five.vnmse * bk.energy;
  t->energy_all += bk.energy;
  return kContinue;
}

// Every row of one bucket; a bucket whose statistics give no summary has none.
int predict_bucket(const PredictArgs& a, const dq::topo::Schedule& sched, const dq::HopTables& hop,
                   const std::vector<const float*>& rows, Bucket bk, Totals* t) {
  const size_t d = bk.count;
  // The exact sum's energy, to turn vNMSEs into errors summed over buckets.
  double energy = 0;
  for (size_t i = 0; i < d; ++i) {
    double s = 0;
    for (const float* r : rows) s += r[i];
    energy += s * s;
  }
  bk.energy = energy;
  Parts parts;
  if (!load_parts(bk, hop, rows, &parts)) return kContinue;
  BucketMeasurements measured(bk.shape, rows, d);
  if (const int rc = compare_fixed_budgets(a, sched, bk, parts, measured, t); rc != kContinue)
    return rc;
  Measured mx8;
  if (const int rc = compare_mx(bk, parts, measured, &mx8, t); rc != kContinue) return rc;
  // Each rail of a two-level call chooses its own rung, which the simulation does not model.
  if (bk.shape.two_level) return kContinue;
  return compare_auto(a, sched, bk, *parts.view[0], measured, mx8, t);
}

void print_summaries(const PredictArgs& a, const Totals& t) {
  auto summary_row = [&](const char* kind, const std::vector<double>& r) {
    nlohmann::ordered_json j;
    j["summary"] = kind;
    j["buckets"] = r.size();
    j["ratio_median"] = quantile(r, 0.5);
    j["ratio_p10"] = quantile(r, 0.1);
    j["ratio_p90"] = quantile(r, 0.9);
    size_t within = 0;
    for (double x : r) within += x >= 0.67 && x <= 1.5;
    j["within_0.67_1.5"] = r.empty() ? 0.0 : static_cast<double>(within) / r.size();
    std::printf("%s\n", j.dump().c_str());
  };
  summary_row("fixed", t.ratio_fixed);
  summary_row("mx", t.ratio_mx);
  nlohmann::ordered_json j;
  j["summary"] = "auto";
  j["target"] = dq::budget_target_name(a.target);
  j["buckets"] = t.auto_buckets;
  j["buckets_at_most_mxfp8"] = t.auto_meets;
  j["bits_per_coord"] = t.coords > 0 ? t.auto_bits / t.coords : 0.0;
  j["mxfp8_bits_per_coord"] = t.coords > 0 ? t.mx_bits / t.coords : 0.0;
  j["vnmse"] = t.energy_all > 0 ? t.auto_err / t.energy_all : 0.0;
  j["mxfp8_vnmse"] = t.energy_all > 0 ? t.mx_err / t.energy_all : 0.0;
  j["dynamiq5_vnmse"] = t.energy_all > 0 ? t.five_err / t.energy_all : 0.0;
  std::printf("%s\n", j.dump().c_str());
}

// Every bucket of one worker count, topology and hierarchy (two-level: the schedule over the
// nodes).
int predict_shape(const PredictArgs& a, const dq::sim::Matrix& m, int n, dq::topo::Kind topo,
                  bool two_level, Totals* totals) {
  const size_t n_buckets = std::max<size_t>(1, m.cols / a.bucket);
  dq::topo::Schedule sched;
  if (dq::topo::make_schedule(topo, two_level ? n / a.ranks_per_node : n, &sched) != Status::kOk)
    return 1;
  const dq::HopTables hop = dq::hop_profile(sched);
  for (size_t b = 0; b < n_buckets; ++b) {
    Bucket bk;
    bk.topo = topo;
    bk.n = n;
    bk.shape = Shape{&sched, two_level, a.ranks_per_node};
    bk.index = b;
    const size_t begin = b * a.bucket;
    bk.offset = a.col_begin + begin;
    bk.count = b + 1 == n_buckets ? m.cols - begin : a.bucket;
    std::vector<const float*> rows;
    for (int r = 0; r < n; ++r) rows.push_back(m.row(r) + begin);
    if (const int rc = predict_bucket(a, sched, hop, rows, bk, totals); rc != kContinue) return rc;
  }
  return kContinue;
}

}  // namespace

int main(int argc, char** argv) {
  PredictArgs a;
  if (const int rc = parse_command_line(argc, argv, &a); rc != kContinue) return rc;
  if (const int rc = check_options(&a); rc != kContinue) return rc;
  dq::sim::Matrix m;
  if (const int rc = load_gradients(&a, &m); rc != kContinue) return rc;

  Totals totals;
  for (int n : a.workers)
    for (dq::topo::Kind topo : a.topos)
      for (bool two_level : a.two_level)
        if (const int rc = predict_shape(a, m, n, topo, two_level, &totals); rc != kContinue)
          return rc;
  print_summaries(a, totals);
  return 0;
}

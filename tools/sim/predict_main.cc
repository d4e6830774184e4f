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
#include <cstdio>
#include <cstdlib>
#include <cstdint>
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

namespace {

using dq::Status;

constexpr const char* kUsage =
    "usage: dynamiq-predict (--input FILE.npy | --synthetic) [options]\n"
    "  --input FILE.npy    float32 [rows, d], row i = worker i\n"
    "  --synthetic         synthetic gradients (--dim, --spread, --shared, --seed)\n"
    "  --dim D --spread S --shared F --seed K   as dynamiq-sim (defaults 1048576, 2, 0.5, 1)\n"
    "  --workers LIST      worker counts (default 4)\n"
    "  --topo LIST         ring,butterfly (default ring)\n"
    "  --columns B:E       only columns [B, E) of --input (a part of a corpus; E may be end)\n"
    "  --bucket N          elements per bucket (default 262144; the last takes the rest)\n"
    "  --budgets LIST      fixed budgets to check (default 3,4,5,6,7,8)\n"
    "  --target T          auto's target: mxfp8, mxfp6 or vnmse:X (default mxfp8)\n";

int fail(const std::string& what) { return dq::sim::usage_error("dynamiq-predict", what, kUsage); }

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

bool measure_uncached(const std::string& spec, const dq::topo::Schedule& sched,
                      const std::vector<const float*>& rows, size_t d, Measured* out) {
  std::string err;
  auto codec = dq::make_codec(spec, &err);
  if (!codec) return false;
  dq::sim::SimOptions o;
  dq::sim::SimResult r;
  if (dq::sim::simulate_allreduce(*codec, sched, rows, d, o, nullptr, &r) != Status::kOk)
    return false;
  out->vnmse = r.vnmse;
  out->bits = r.bits_per_coord;
  return true;
}

// One bucket's simulations by codec spec: a codec the fixed, MX and auto rows share ("dynamiq:5",
// "mxfp8", auto's choice) is simulated once (the simulator is deterministic in its inputs).
class BucketMeasurements {
 public:
  BucketMeasurements(const dq::topo::Schedule& sched, const std::vector<const float*>& rows,
                     size_t d)
      : sched_(sched), rows_(rows), d_(d) {}
  bool get(const std::string& spec, Measured* out) {
    for (const auto& [s, m] : done_)
      if (s == spec) return *out = m, true;
    if (!measure_uncached(spec, sched_, rows_, d_, out)) return false;
    done_.emplace_back(spec, *out);
    return true;
  }

 private:
  const dq::topo::Schedule& sched_;
  const std::vector<const float*>& rows_;
  size_t d_;
  std::vector<std::pair<std::string, Measured>> done_;
};

}  // namespace

int main(int argc, char** argv) {
  std::string input, workers_s = "4", topo_s = "ring", budgets_s = "3,4,5,6,7,8";
  std::string target_s = "mxfp8", columns_s;
  bool synthetic = false;
  size_t bucket = 262144;
  dq::sim::SyntheticSpec syn;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "-h" || a == "--help") return std::printf("%s", kUsage), 0;
    if (a == "--synthetic") {
      synthetic = true;
      continue;
    }
    if (i + 1 >= argc) return fail(a + " needs a value (or is unknown)");
    const std::string v = argv[++i];
    if (a == "--input") input = v;
    else if (a == "--workers") workers_s = v;
    else if (a == "--topo") topo_s = v;
    else if (a == "--budgets") budgets_s = v;
    else if (a == "--target") target_s = v;
    else if (a == "--columns") columns_s = v;
    else if (a == "--bucket") bucket = std::strtoull(v.c_str(), nullptr, 10);
    else if (a == "--dim") syn.cols = std::strtoull(v.c_str(), nullptr, 10);
    else if (a == "--spread") syn.spread = std::strtod(v.c_str(), nullptr);
    else if (a == "--shared") syn.shared = std::strtod(v.c_str(), nullptr);
    else if (a == "--seed") syn.seed = std::strtoull(v.c_str(), nullptr, 10);
    else return fail("unknown option " + a);
  }
  if (input.empty() == !synthetic) return fail("give exactly one of --input or --synthetic");
  if (bucket < 256) return fail("--bucket must be at least 256");
  size_t col_begin = 0, col_end = SIZE_MAX;
  if (!columns_s.empty() &&
      (synthetic || !dq::sim::parse_column_range(columns_s, &col_begin, &col_end)))
    return fail("--columns " + columns_s + ": expected B:E or B:end with B < E, with --input");
  dq::BudgetTarget target;
  if (!dq::parse_budget_target(target_s, &target))
    return fail("--target " + target_s + ": expected mxfp8, mxfp6 or vnmse:X");
  std::vector<int> workers;
  for (const auto& w : dq::sim::split_list(workers_s)) workers.push_back(std::atoi(w.c_str()));
  std::vector<dq::topo::Kind> topos;
  for (const auto& t : dq::sim::split_list(topo_s)) {
    dq::topo::Kind k;
    if (dq::topo::parse_kind(t, &k) != Status::kOk) return fail("unknown topology " + t);
    topos.push_back(k);
  }
  std::vector<double> budgets;
  for (const auto& b : dq::sim::split_list(budgets_s)) budgets.push_back(std::strtod(b.c_str(), nullptr));
  int max_workers = 0;
  for (int w : workers) {
    if (w < 2 || w > 1024) return fail("--workers: each in 2..1024");
    max_workers = std::max(max_workers, w);
  }

  dq::sim::Matrix m;
  std::string err;
  if (synthetic) {
    syn.rows = static_cast<size_t>(max_workers);
    dq::sim::make_synthetic(syn, &m);
  } else if (dq::sim::read_npy_columns(input, max_workers, col_begin, col_end, &m, &err) !=
                 Status::kOk ||
             static_cast<int>(m.rows) < max_workers) {
    return fail(err.empty() ? input + ": fewer rows than --workers" : err);
  }

  std::vector<double> ratio_fixed, ratio_mx;
  double auto_bits = 0, auto_err = 0, mx_err = 0, five_err = 0, energy_all = 0, coords = 0;
  double mx_bits = 0;
  size_t auto_buckets = 0, auto_meets = 0;
  const size_t n_buckets = std::max<size_t>(1, m.cols / bucket);
  for (int n : workers)
    for (dq::topo::Kind topo : topos) {
      dq::topo::Schedule sched;
      if (dq::topo::make_schedule(topo, n, &sched) != Status::kOk) return 1;
      const dq::HopTables hop = dq::hop_profile(sched);
      for (size_t b = 0; b < n_buckets; ++b) {
        const size_t begin = b * bucket;
        const size_t d = b + 1 == n_buckets ? m.cols - begin : bucket;
        std::vector<const float*> rows;
        for (int r = 0; r < n; ++r) rows.push_back(m.row(r) + begin);
        // The exact sum's energy, to turn vNMSEs into errors summed over buckets.
        double energy = 0;
        for (size_t i = 0; i < d; ++i) {
          double s = 0;
          for (const float* r : rows) s += r[i];
          energy += s * s;
        }
        auto base = dq::make_codec("dynamiq:5", &err);
        base->plan(d, sched.n_chunks, n);
        const std::vector<uint16_t> stats = dq::sim::reduced_stats(*base, rows, d);
        dq::StatsSummary summary;
        if (!summary.load(stats.data(), d, n, hop.view())) continue;
        const std::vector<const dq::StatsSummary*> parts{&summary};
        BucketMeasurements measured(sched, rows, d);
        auto row = [&](const char* kind, const std::string& codec) {
          nlohmann::ordered_json j;
          j["kind"] = kind;
          j["bucket"] = b;
          j["offset"] = col_begin + begin;
          j["count"] = d;
          j["topo"] = dq::topo::kind_name(topo);
          j["workers"] = n;
          j["codec"] = codec;
          return j;
        };
        // Measures `spec`, prints its predicted-against-measured row and keeps the ratio.
        auto compare = [&](const char* kind, const std::string& spec, double pred,
                           std::vector<double>* ratios, Measured* me) {
          if (!measured.get(spec, me)) return false;
          auto j = row(kind, spec);
          j["predicted"] = pred;
          j["measured"] = me->vnmse;
          j["ratio"] = pred / me->vnmse;
          ratios->push_back(pred / me->vnmse);
          std::printf("%s\n", j.dump().c_str());
          return true;
        };
        for (double bits : budgets) {
          dq::DynamiqPlan plan;
          bool fits = false;
          if (dq::sim::auto_rung_plan(bits, d, sched, &plan, &fits, &err) != Status::kOk) {
            std::fprintf(stderr, "dynamiq-predict: %s\n", err.c_str());
            return 1;
          }
          if (!fits) continue;
          const double pred = dq::predict_vnmse(parts, {&plan}, nullptr);
          char spec[32];
          std::snprintf(spec, sizeof spec, "dynamiq:%g", bits);
          Measured me;
          if (!compare("fixed", spec, pred, &ratio_fixed, &me)) return 1;
        }
        Measured mx8, five;
        for (const char* spec : {"mxfp8", "mxfp6"}) {
          const double k = dq::mx_rounding_error(spec);
          const double pred = summary.mx_error(k) / summary.energy();
          Measured me;
          if (!compare("mx", spec, pred, &ratio_mx, &me)) return 1;
          if (std::strcmp(spec, "mxfp8") == 0) mx8 = me;
        }
        // auto: the model's choice over every rung and the MX fallbacks, as the engine makes it.
        dq::BudgetPrediction pred;
        if (dq::sim::predict_auto(summary, d, sched, target, &pred, &err) != Status::kOk) continue;
        const std::string spec = dq::candidate_spec(pred.rung);
        Measured me;
        if (!measured.get(spec, &me) || !measured.get("dynamiq:5", &five))
          return 1;
        // An MX bucket of the engine also all-reduces its statistics every 8th call.
        if (dq::candidate_is_mx(pred.rung))
          me.bits += 16.0 * dq::kStatsWordsPerSupergroup / 256.0 / 8.0;
        auto j = row("auto", spec);
        j["target"] = dq::budget_target_name(target);
        j["target_vnmse"] = pred.target;
        j["predicted"] = pred.vnmse[pred.rung];
        j["measured"] = me.vnmse;
        j["bits_per_coord"] = me.bits;
        j["mxfp8_measured"] = mx8.vnmse;
        j["mxfp8_bits_per_coord"] = mx8.bits;
        j["dynamiq5_measured"] = five.vnmse;
        j["dynamiq5_bits_per_coord"] = five.bits;
        j["energy"] = energy;
        std::printf("%s\n", j.dump().c_str());
        ++auto_buckets;
        auto_meets += me.vnmse <= mx8.vnmse;
        auto_bits += me.bits * d;
        mx_bits += mx8.bits * d;
        coords += d;
        auto_err += me.vnmse * energy;
        mx_err += mx8.vnmse * energy;
        five_err += five.vnmse * energy;
        energy_all += energy;
      }
    }
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
  summary_row("fixed", ratio_fixed);
  summary_row("mx", ratio_mx);
  nlohmann::ordered_json j;
  j["summary"] = "auto";
  j["target"] = dq::budget_target_name(target);
  j["buckets"] = auto_buckets;
  j["buckets_at_most_mxfp8"] = auto_meets;
  j["bits_per_coord"] = coords > 0 ? auto_bits / coords : 0.0;
  j["mxfp8_bits_per_coord"] = coords > 0 ? mx_bits / coords : 0.0;
  j["vnmse"] = energy_all > 0 ? auto_err / energy_all : 0.0;
  j["mxfp8_vnmse"] = energy_all > 0 ? mx_err / energy_all : 0.0;
  j["dynamiq5_vnmse"] = energy_all > 0 ? five_err / energy_all : 0.0;
  std::printf("%s\n", j.dump().c_str());
  return 0;
}

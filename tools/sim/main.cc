// dynamiq-sim: the multi-hop error simulator. Prints one result per codec x topology x n.
#include <tbb/global_control.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/dynamiq_codec.h"
#include "kernels/dynamiq_layout.h"
#include "tools/cli/cli.h"
#include "tools/sim/bit_breakdown.h"
#include "tools/sim/cli_common.h"
#include "tools/sim/gradients.h"
#include "tools/sim/simulate.h"

namespace {

using dq::Status;

constexpr const char* kUsage =
    "usage: dynamiq-sim (--input FILE.npy | --synthetic) [options]\n"
    "  --input FILE.npy      float32 matrix [n_rows, d]; row i is worker i's gradient\n"
    "  --synthetic           generate gradients instead (see --dim, --spread, --shared)\n"
    "  --columns B:E         only columns [B, E) of --input, read without the rest (a part of\n"
    "                        a corpus, as dynamiq-predict's; E may be end)\n"
    "  --dim D               synthetic length (default 1048576)\n"
    "  --spread S            synthetic std-dev of log10 super-group norm (default 2; 0 = none)\n"
    "  --shared F            synthetic fraction of variance shared by workers (default 0.5)\n"
    "  --save FILE.npy       write the synthetic matrix and exit\n"
    "  --workers N[,N...]    worker counts, 1..1024 (default 4)\n"
    "  --topo LIST           ring,butterfly (default ring)\n"
    "  --codec LIST          e.g. dynamiq:5,mxfp8,mxfp6,mxfp4,bf16,uniform:5 (default dynamiq:5)\n"
    "  --op sum|avg          reduction (default sum)\n"
    "  --collective C        allreduce (default) or reducescatter: each worker's row of d values\n"
    "                        is n blocks of d/n (the last d mod n values are left out); worker r\n"
    "                        ends with block r, each chunk its own codec over its block, as the\n"
    "                        engine runs ncclReduceScatter (a non-power-of-two butterfly runs\n"
    "                        on the ring, as in the engine); reports each block's vNMSE\n"
    "  --seed S              rounding seed (default 1)\n"
    "  --calls K             average over K calls (call ids 0..K-1; default 1)\n"
    "  --per-hop             report the error of every partial sum (hop_vnmse)\n"
    "  --bits-breakdown      DynamiQ codecs, all-reduce: where one compressed copy's bits per\n"
    "                        coordinate go (values, group factors, super-group units,\n"
    "                        statistics, headers, padding, slack, and what the budget's rounding\n"
    "                        leaves unallocated; they sum to the budget), and per width 2/4/8/16\n"
    "                        the share of super-groups and of the squared error\n"
    "  --threads T           worker threads (default: all cores)\n"
    "  --format jsonl|table  output (default table)\n"
    "  --quiet               no progress on stderr\n"
    "  -h, --help            print this help\n"
    "  --version             print the version and exit\n"
    "Options take their value as --opt VALUE or --opt=VALUE. In jsonl output a number that is\n"
    "not finite (an input holding infinities or NaNs) is null, with \"vnmse_finite\": false\n"
    "(always present) or \"<key>_finite\": false beside it.\n";

int usage_error(const std::string& what) { return dq::sim::usage_error("dynamiq-sim", what, kUsage); }

bool parse_ulong(const char* s, unsigned long long lo, unsigned long long hi, unsigned long long* v) {
  char* end = nullptr;
  errno = 0;
  unsigned long long x = std::strtoull(s, &end, 10);
  if (errno || end == s || *end || x < lo || x > hi) return false;
  *v = x;
  return true;
}

bool parse_double(const char* s, double lo, double hi, double* v) {
  char* end = nullptr;
  double x = std::strtod(s, &end);
  if (end == s || *end || !(x >= lo && x <= hi)) return false;
  *v = x;
  return true;
}

// Shares of the breakdown: the parts per coordinate, and per width the super-groups, the record
// bits and the squared error (each share of its own total; 0 when the total is 0).
struct Shares {
  double parts[8];  // values, group factors, units, statistics, headers, padding, slack, unallocated
  double sg[4], bits[4], error[4];
};

Shares shares(const dq::sim::BitBreakdown& b) {
  Shares s{};
  const uint64_t parts[7] = {b.values, b.group_factors, b.units, b.statistics, b.headers, b.padding, b.slack};
  for (int i = 0; i < 7; ++i) s.parts[i] = b.per_coord(parts[i]);
  s.parts[7] = b.count ? b.unallocated / static_cast<double>(b.count) : 0.0;
  uint64_t record_bits = 0;
  for (int w = 0; w < 4; ++w) record_bits += b.record_bits_by_width[w];
  const double err = b.error_total();
  for (int w = 0; w < 4; ++w) {
    s.sg[w] = b.supergroups ? static_cast<double>(b.sg_by_width[w]) / static_cast<double>(b.supergroups) : 0.0;
    s.bits[w] = record_bits ? static_cast<double>(b.record_bits_by_width[w]) / static_cast<double>(record_bits) : 0.0;
    s.error[w] = err > 0 ? b.error_by_width[w] / err : 0.0;
  }
  return s;
}

constexpr const char* kPartNames[8] = {"values", "group_factors", "units", "statistics",
                                       "headers", "padding", "slack", "unallocated"};

nlohmann::ordered_json breakdown_json(const dq::sim::BitBreakdown& b) {
  const Shares s = shares(b);
  nlohmann::ordered_json j;
  j["budget"] = b.budget_bits;
  j["copy_bits_per_coord"] = b.per_coord(b.copy_bits());
  for (int i = 0; i < 8; ++i) j[kPartNames[i]] = s.parts[i];
  nlohmann::ordered_json widths = nlohmann::ordered_json::array();
  double energy = 0;
  for (double e : b.energy_by_width) energy += e;
  for (int w = 0; w < 4; ++w) {
    nlohmann::ordered_json x;
    x["bits"] = dq::sim::kBreakdownWidths[w];
    x["supergroups"] = b.sg_by_width[w];
    x["supergroup_share"] = s.sg[w];
    x["record_bit_share"] = s.bits[w];
    dq::cli::put_number(&x, "energy_share", energy > 0 ? b.energy_by_width[w] / energy : 0.0);
    dq::cli::put_number(&x, "error_share", s.error[w]);
    // This width's part of the vNMSE (the parts add up to the vNMSE over the calls).
    dq::cli::put_number(&x, "vnmse_part", energy > 0 ? b.error_by_width[w] / energy : 0.0);
    widths.push_back(x);
  }
  j["widths"] = widths;
  return j;
}

void print_breakdown(const dq::sim::BitBreakdown& b) {
  const Shares s = shares(b);
  std::printf("  bits/crd of one copy, budget %g:", b.budget_bits);
  double total = 0;
  for (int i = 0; i < 8; ++i) {
    std::printf(" %s %.4f", kPartNames[i], s.parts[i]);
    total += s.parts[i];
  }
  std::printf(" = %.4f%s\n", total, b.budget_honest ? "" : " (not budget honest)");
  double energy = 0;
  for (double e : b.energy_by_width) energy += e;
  std::printf("  %-6s %12s %9s %9s %9s %11s\n", "width", "super-groups", "sg share", "bit share",
              "err share", "energy shr");
  for (int w = 0; w < 4; ++w)
    std::printf("  %-6d %12zu %8.2f%% %8.2f%% %8.2f%% %10.2f%%\n", dq::sim::kBreakdownWidths[w],
                b.sg_by_width[w], 100 * s.sg[w], 100 * s.bits[w], 100 * s.error[w],
                energy > 0 ? 100 * b.energy_by_width[w] / energy : 0.0);
}

}  // namespace

int main(int argc, char** argv) {
  std::string input, save, format = "table", topo_list = "ring", codec_list = "dynamiq:5";
  std::string worker_list = "4", collective = "allreduce", columns;
  bool synthetic = false, quiet = false, breakdown = false;
  dq::sim::SyntheticSpec syn;
  dq::sim::SimOptions opt;
  unsigned long long calls = 1, threads = 0;
  CLI::App app;
  dq::cli::configure(&app, "dynamiq-sim");
  CLI::Option* o_synthetic = dq::cli::add_switch(&app, "--synthetic");
  CLI::Option* o_per_hop = dq::cli::add_switch(&app, "--per-hop");
  CLI::Option* o_quiet = dq::cli::add_switch(&app, "--quiet");
  CLI::Option* o_breakdown = dq::cli::add_switch(&app, "--bits-breakdown");
  CLI::Option* o_input = dq::cli::add_value(&app, "--input");
  CLI::Option* o_columns = dq::cli::add_value(&app, "--columns");
  CLI::Option* o_save = dq::cli::add_value(&app, "--save");
  CLI::Option* o_workers = dq::cli::add_value(&app, "--workers");
  CLI::Option* o_topo = dq::cli::add_value(&app, "--topo");
  CLI::Option* o_codec = dq::cli::add_value(&app, "--codec");
  CLI::Option* o_format = dq::cli::add_value(&app, "--format");
  CLI::Option* o_collective = dq::cli::add_value(&app, "--collective");
  CLI::Option* o_dim = dq::cli::add_value(&app, "--dim");
  CLI::Option* o_spread = dq::cli::add_value(&app, "--spread");
  CLI::Option* o_shared = dq::cli::add_value(&app, "--shared");
  CLI::Option* o_seed = dq::cli::add_value(&app, "--seed");
  CLI::Option* o_calls = dq::cli::add_value(&app, "--calls");
  CLI::Option* o_threads = dq::cli::add_value(&app, "--threads");
  CLI::Option* o_op = dq::cli::add_value(&app, "--op");
  std::string error;
  switch (dq::cli::parse(&app, argc, argv, &error)) {
    case dq::cli::Parsed::kHelp:
      std::fputs(kUsage, stdout);
      return 0;
    case dq::cli::Parsed::kVersion:
      std::printf("%s\n", dq::cli::version_line("dynamiq-sim").c_str());
      return 0;
    case dq::cli::Parsed::kError:
      return usage_error(error);
    case dq::cli::Parsed::kRun:
      break;
  }
  // Applied in command-line order: the last of a repeated option wins.
  for (const auto& [o, value] : dq::cli::in_order(app)) {
    const char* v = value.c_str();
    unsigned long long u = 0;
    double d = 0;
    if (o == o_synthetic) synthetic = true;
    else if (o == o_per_hop) opt.per_hop = true;
    else if (o == o_quiet) quiet = true;
    else if (o == o_breakdown) breakdown = true;
    else if (o == o_input) input = value;
    else if (o == o_columns) columns = value;
    else if (o == o_save) save = value;
    else if (o == o_workers) worker_list = value;
    else if (o == o_topo) topo_list = value;
    else if (o == o_codec) codec_list = value;
    else if (o == o_format) format = value;
    else if (o == o_collective) collective = value;
    else if (o == o_dim) { if (!parse_ulong(v, 1, 1ull << 31, &u)) return usage_error("--dim must be 1..2^31"); syn.cols = u; }
    else if (o == o_spread) { if (!parse_double(v, 0, 10, &d)) return usage_error("--spread must be in [0, 10]"); syn.spread = d; }
    else if (o == o_shared) { if (!parse_double(v, 0, 1, &d)) return usage_error("--shared must be in [0, 1]"); syn.shared = d; }
    else if (o == o_seed) { if (!parse_ulong(v, 0, ~0ull, &u)) return usage_error("--seed must be an unsigned integer"); opt.seed = u; syn.seed = u; }
    else if (o == o_calls) { if (!parse_ulong(v, 1, 1000, &calls)) return usage_error("--calls must be 1..1000"); }
    else if (o == o_threads) { if (!parse_ulong(v, 1, 1024, &threads)) return usage_error("--threads must be 1..1024"); }
    else if (o == o_op) {
      if (value == "sum") opt.op = dq::ReduceOp::kSum;
      else if (value == "avg") opt.op = dq::ReduceOp::kAvg;
      else return usage_error("--op must be sum or avg");
    }
  }
  if (format != "jsonl" && format != "table") return usage_error("--format must be jsonl or table");
  if (collective != "allreduce" && collective != "reducescatter")
    return usage_error("--collective must be allreduce or reducescatter");
  const bool scatter = collective == "reducescatter";
  if (scatter && opt.per_hop) return usage_error("--per-hop is for --collective allreduce only");
  if (scatter && breakdown) return usage_error("--bits-breakdown is for --collective allreduce only");
  if (input.empty() == !synthetic) return usage_error("give exactly one of --input or --synthetic");
  // --columns B:E (E a number or "end"), the same syntax as dynamiq-predict's.
  size_t col_begin = 0, col_end = SIZE_MAX;
  if (!columns.empty() && (synthetic || !dq::sim::parse_column_range(columns, &col_begin, &col_end)))
    return usage_error("--columns " + columns + ": expected B:E or B:end with B < E, with --input");

  std::vector<int> workers;
  for (const auto& w : dq::sim::split_list(worker_list)) {
    unsigned long long u = 0;
    if (!parse_ulong(w.c_str(), 1, 1024, &u)) return usage_error("--workers: '" + w + "' is not in 1..1024");
    workers.push_back(static_cast<int>(u));
  }
  std::vector<dq::topo::Kind> topos;
  for (const auto& t : dq::sim::split_list(topo_list)) {
    dq::topo::Kind k;
    if (dq::topo::parse_kind(t, &k) != Status::kOk) return usage_error("--topo: unknown topology '" + t + "' (ring, butterfly)");
    topos.push_back(k);
  }
  std::vector<std::string> codecs = dq::sim::split_list(codec_list);
  for (const auto& c : codecs) {
    std::string err;
    auto codec = dq::make_codec(c, &err);
    if (!codec) return usage_error("--codec: " + err);
    dq::DynamiqOptions dyn;
    dq::DynamiqPlan plan;
    if (breakdown && !dq::dynamiq_parameters(*codec, &dyn, &plan))
      return usage_error("--bits-breakdown: " + c + " is not a DynamiQ codec");
  }
  if (workers.empty() || topos.empty() || codecs.empty()) return usage_error("empty --workers, --topo or --codec list");
  std::unique_ptr<tbb::global_control> limit;
  if (threads) limit = std::make_unique<tbb::global_control>(tbb::global_control::max_allowed_parallelism, threads);

  int max_workers = 0;
  for (int w : workers) max_workers = std::max(max_workers, w);
  dq::sim::Matrix m;
  std::string err;
  if (synthetic) {
    syn.rows = save.empty() ? max_workers : std::max<size_t>(max_workers, syn.rows);
    double gib = static_cast<double>(syn.rows) * syn.cols * 4 / (1 << 30);
    if (gib > 16) return usage_error("synthetic data would need " + std::to_string(gib) + " GiB; lower --dim or --workers");
    dq::sim::make_synthetic(syn, &m);
    if (!save.empty()) {
      if (dq::sim::write_npy(save, m, &err) != Status::kOk) { std::fprintf(stderr, "dynamiq-sim: %s\n", err.c_str()); return 1; }
      std::fprintf(stderr, "dynamiq-sim: wrote %zux%zu to %s\n", m.rows, m.cols, save.c_str());
      return 0;
    }
  } else {
    if (dq::sim::read_npy_columns(input, max_workers, col_begin, col_end, &m, &err) != Status::kOk) {
      // A range past the file's columns is the option's fault: name it.
      if (!columns.empty() && err.find(": columns [") != std::string::npos)
        std::fprintf(stderr, "dynamiq-sim: --columns %s: %s\n", columns.c_str(), err.c_str());
      else
        std::fprintf(stderr, "dynamiq-sim: %s\n", err.c_str());
      return 2;
    }
    if (static_cast<int>(m.rows) < max_workers) {
      std::fprintf(stderr, "dynamiq-sim: %s has %zu rows but --workers asks for %d; give a file with at least %d rows or fewer workers\n",
                   input.c_str(), m.rows, max_workers, max_workers);
      return 2;
    }
  }

  if (format == "table")
    std::printf("%-34s %-9s %5s %12s %9s %9s %7s\n", "codec", "topo", "n", "vNMSE", "bits/crd", "wire/crd", "sec");
  const auto start = std::chrono::steady_clock::now();
  size_t done = 0, total = workers.size() * topos.size() * codecs.size();
  for (int n : workers)
    for (auto topo : topos) {
      // A reduce-scatter needs one chunk ending at every worker: the engine runs a butterfly of
      // a rank count that is not a power of two on the ring, and so does the simulator.
      const bool pow2 = (n & (n - 1)) == 0;
      if (scatter && topo == dq::topo::Kind::kButterfly && !pow2) {
        if (!quiet)
          std::fprintf(stderr, "dynamiq-sim: reducescatter n=%d: butterfly runs on the ring, as in the engine\n", n);
        topo = dq::topo::Kind::kRing;
      }
      dq::topo::Schedule sched;
      if (dq::topo::make_schedule(topo, n, &sched) != Status::kOk) return 1;
      std::vector<const float*> rows;
      for (int r = 0; r < n; ++r) rows.push_back(m.row(r));
      const size_t recvcount = m.cols / static_cast<size_t>(n);
      if (scatter && recvcount == 0) return usage_error("--collective reducescatter needs d >= workers");
      const size_t d = scatter ? recvcount * n : m.cols;
      for (const auto& spec : codecs) {
        auto codec = dq::make_codec(spec, &err);
        dq::sim::SimResult sum{}, r{};
        std::vector<double> hop, blocks;
        std::vector<float> decoded;
        dq::sim::BitBreakdown bits;
        for (unsigned long long call = 0; call < calls; ++call) {
          dq::sim::SimOptions o = opt;
          o.call = call;
          const Status st = scatter ? dq::sim::simulate_reduce_scatter(spec, sched, rows, recvcount, o, nullptr, &r)
                                    : dq::sim::simulate_allreduce(*codec, sched, rows, m.cols, o,
                                                                  breakdown ? &decoded : nullptr, &r);
          if (st != Status::kOk) {
            std::fprintf(stderr, "dynamiq-sim: %s %s on %s n=%d failed\n", collective.c_str(), spec.c_str(),
                         dq::topo::kind_name(topo), n);
            return 1;
          }
          if (breakdown) {
            // The plan and the widths are the same every call (the statistics do not change);
            // the error is summed over the calls.
            if ((call == 0 && !dq::sim::bit_breakdown(*codec, &bits, &err)) ||
                !dq::sim::accumulate_width_error(*codec, rows, n, decoded.data(), opt.op, &bits, &err)) {
              std::fprintf(stderr, "dynamiq-sim: %s\n", err.c_str());
              return 1;
            }
          }
          sum.vnmse += r.vnmse / calls;
          sum.seconds += r.seconds;
          hop.resize(r.hop_error.size());
          for (size_t k = 0; k < hop.size(); ++k) hop[k] += r.hop_error[k] / calls;
          blocks.resize(r.block_vnmse.size());
          for (size_t k = 0; k < blocks.size(); ++k) blocks[k] += r.block_vnmse[k] / calls;
        }
        ++done;
        if (!quiet)
          std::fprintf(stderr, "[dynamiq-sim %zu/%zu, %.1f s] %s %s n=%d\n", done, total,
                       std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(),
                       spec.c_str(), dq::topo::kind_name(topo), n);
        if (format == "jsonl") {
          // nlohmann-json, keys in this order. A non-finite number (an input holding infinities
          // or NaNs) is written as null, never as nan or inf, which are not JSON; "vnmse_finite"
          // is always there and false then, and a list or other number that is not finite gets
          // its own "<key>_finite": false.
          nlohmann::ordered_json row;
          row["collective"] = collective;
          row["codec"] = spec;
          row["topo"] = dq::topo::kind_name(topo);
          row["workers"] = n;
          row["d"] = d;
          dq::cli::put_number(&row, "vnmse", sum.vnmse, /*always_flag=*/true);
          dq::cli::put_number(&row, "bits_per_coord", r.bits_per_coord);
          dq::cli::put_number(&row, "wire_bits_per_coord", r.wire_bits_per_coord);
          row["budget_honest"] = r.budget_honest;
          row["chunks_large_enough"] = r.chunks_large_enough;
          row["calls"] = calls;
          row["seed"] = static_cast<unsigned long long>(opt.seed);
          dq::cli::put_number(&row, "seconds", sum.seconds);
          if (scatter) {
            row["recvcount"] = recvcount;
            dq::cli::put_numbers(&row, "block_vnmse", blocks);
          }
          if (opt.per_hop) dq::cli::put_numbers(&row, "hop_vnmse", hop);
          if (breakdown) row["bits_breakdown"] = breakdown_json(bits);
          std::printf("%s\n", row.dump().c_str());
        } else {
          std::printf("%-34s %-9s %5d %12.4e %9.4f %9.4f %7.2f", spec.c_str(), dq::topo::kind_name(topo), n,
                      sum.vnmse, r.bits_per_coord, r.wire_bits_per_coord, sum.seconds);
          if (scatter) {
            double lo = blocks.empty() ? 0 : blocks[0], hi = lo;
            for (double b : blocks) lo = std::min(lo, b), hi = std::max(hi, b);
            std::printf("  (reducescatter: block vNMSE %.3e..%.3e)", lo, hi);
          }
          if (!r.chunks_large_enough)
            std::printf("  (< %zu super-groups per chunk: the engine passes this through)",
                        dq::kMinSuperGroupsPerChunk);
          std::printf("\n");
          if (breakdown) print_breakdown(bits);
        }
        std::fflush(stdout);
      }
    }
  return 0;
}

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
#include "tools/sim/two_level.h"

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
    "  --ranks-per-node L    ranks per node, rank r on node r / L (default 1); each --workers\n"
    "                        count must be a multiple of L\n"
    "  --hierarchy LIST      flat,node (default flat). flat: the schedule over all ranks in\n"
    "                        rank order; node: two-level (all-reduce only), the exact FP32 sum\n"
    "                        inside each node, then per shard (1/L of the tensor) the compressed\n"
    "                        all-reduce among the nodes on --topo, then an exact all-gather\n"
    "  --rail-block-bytes B  node: each shard's compressed all-reduce cut into blocks of B bytes\n"
    "                        of FP32 (whole super-groups, the last takes the rest), one budget\n"
    "                        each (a what-if). Default: one block per shard, as the engine runs\n"
    "                        the shard of each of its DYNAMIQ_BLOCK_BYTES blocks\n"
    "  --shards S            node: contiguous (default, as NCCL's reduce-scatter) or\n"
    "                        interleaved (a what-if: shard l holds super-groups l, l+L, ...)\n"
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

int usage_error(const std::string& what) {
  return dq::sim::usage_error("dynamiq-sim", what, kUsage);
}

bool parse_ulong(const char* s, unsigned long long lo, unsigned long long hi,
                 unsigned long long* v) {
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
  double
      parts[8];  // values, group factors, units, statistics, headers, padding, slack, unallocated
  double sg[4], bits[4], error[4];
};

Shares shares(const dq::sim::BitBreakdown& b) {
  Shares s{};
  const uint64_t parts[7] = {b.values,  b.group_factors, b.units, b.statistics,
                             b.headers, b.padding,       b.slack};
  for (int i = 0; i < 7; ++i) s.parts[i] = b.per_coord(parts[i]);
  s.parts[7] = b.count ? b.unallocated / static_cast<double>(b.count) : 0.0;
  uint64_t record_bits = 0;
  for (int w = 0; w < 4; ++w) record_bits += b.record_bits_by_width[w];
  const double err = b.error_total();
  for (int w = 0; w < 4; ++w) {
    s.sg[w] = b.supergroups
                  ? static_cast<double>(b.sg_by_width[w]) / static_cast<double>(b.supergroups)
                  : 0.0;
    s.bits[w] = record_bits ? static_cast<double>(b.record_bits_by_width[w]) /
                                  static_cast<double>(record_bits)
                            : 0.0;
    s.error[w] = err > 0 ? b.error_by_width[w] / err : 0.0;
  }
  return s;
}

constexpr const char* kPartNames[8] = {"values",  "group_factors", "units", "statistics",
                                       "headers", "padding",       "slack", "unallocated"};

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

// Every option of one run (defaults as kUsage says), and the lists parsed from them.
struct SimArgs {
  std::string input, save, format = "table", topo_list = "ring", codec_list = "dynamiq:5";
  std::string worker_list = "4", collective = "allreduce", columns, hierarchy_list = "flat";
  bool synthetic = false, quiet = false, breakdown = false;
  dq::sim::SyntheticSpec syn;
  dq::sim::SimOptions opt;
  unsigned long long calls = 1, threads = 0, ranks_per_node = 1;
  bool scatter = false;                      // --collective reducescatter
  size_t col_begin = 0, col_end = SIZE_MAX;  // --columns B:E
  std::vector<int> workers;
  std::vector<dq::topo::Kind> topos;
  std::vector<std::string> codecs;
  std::vector<bool> two_level;  // per --hierarchy item: node (true) or flat
};

// Returned by the steps of main when the run goes on (any other value is the exit code).
constexpr int kContinue = -1;

// Parses the command line into *a; the options apply in command-line order, so the last of a
// repeated option wins.
int parse_command_line(int argc, char** argv, SimArgs* a) {
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
  CLI::Option* o_local = dq::cli::add_value(&app, "--ranks-per-node");
  CLI::Option* o_hierarchy = dq::cli::add_value(&app, "--hierarchy");
  CLI::Option* o_rail_block = dq::cli::add_value(&app, "--rail-block-bytes");
  CLI::Option* o_shards = dq::cli::add_value(&app, "--shards");
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
  for (const auto& [o, value] : dq::cli::in_order(app)) {
    const char* v = value.c_str();
    unsigned long long u = 0;
    double d = 0;
    if (o == o_synthetic)
      a->synthetic = true;
    else if (o == o_per_hop)
      a->opt.per_hop = true;
    else if (o == o_quiet)
      a->quiet = true;
    else if (o == o_breakdown)
      a->breakdown = true;
    else if (o == o_input)
      a->input = value;
    else if (o == o_columns)
      a->columns = value;
    else if (o == o_save)
      a->save = value;
    else if (o == o_workers)
      a->worker_list = value;
    else if (o == o_topo)
      a->topo_list = value;
    else if (o == o_codec)
      a->codec_list = value;
    else if (o == o_format)
      a->format = value;
    else if (o == o_collective)
      a->collective = value;
    else if (o == o_hierarchy)
      a->hierarchy_list = value;
    else if (o == o_shards) {
      if (value != "contiguous" && value != "interleaved")
        return usage_error("--shards must be contiguous or interleaved");
      a->opt.interleaved_shards = value == "interleaved";
    } else if (o == o_rail_block) {
      if (!parse_ulong(v, 1024, 1ull << 40, &u))
        return usage_error("--rail-block-bytes must be 1024..2^40");
      a->opt.block_elems = std::max<size_t>(256, u / 4 / 256 * 256);
    } else if (o == o_local) {
      if (!parse_ulong(v, 1, 1024, &a->ranks_per_node))
        return usage_error("--ranks-per-node must be 1..1024");
    } else if (o == o_dim) {
      if (!parse_ulong(v, 1, 1ull << 31, &u)) return usage_error("--dim must be 1..2^31");
      a->syn.cols = u;
    } else if (o == o_spread) {
      if (!parse_double(v, 0, 10, &d)) return usage_error("--spread must be in [0, 10]");
      a->syn.spread = d;
    } else if (o == o_shared) {
      if (!parse_double(v, 0, 1, &d)) return usage_error("--shared must be in [0, 1]");
      a->syn.shared = d;
    } else if (o == o_seed) {
      if (!parse_ulong(v, 0, ~0ull, &u)) return usage_error("--seed must be an unsigned integer");
      a->opt.seed = u;
      a->syn.seed = u;
    } else if (o == o_calls) {
      if (!parse_ulong(v, 1, 1000, &a->calls)) return usage_error("--calls must be 1..1000");
    } else if (o == o_threads) {
      if (!parse_ulong(v, 1, 1024, &a->threads)) return usage_error("--threads must be 1..1024");
    } else if (o == o_op) {
      if (value == "sum")
        a->opt.op = dq::ReduceOp::kSum;
      else if (value == "avg")
        a->opt.op = dq::ReduceOp::kAvg;
      else
        return usage_error("--op must be sum or avg");
    }
  }
  return kContinue;
}

// Checks the options against each other and parses --columns, --workers, --topo and --codec.
int check_options(SimArgs* a) {
  if (a->format != "jsonl" && a->format != "table")
    return usage_error("--format must be jsonl or table");
  if (a->collective != "allreduce" && a->collective != "reducescatter")
    return usage_error("--collective must be allreduce or reducescatter");
  a->scatter = a->collective == "reducescatter";
  if (a->scatter && a->opt.per_hop)
    return usage_error("--per-hop is for --collective allreduce only");
  if (a->scatter && a->breakdown)
    return usage_error("--bits-breakdown is for --collective allreduce only");
  if (a->input.empty() == !a->synthetic)
    return usage_error("give exactly one of --input or --synthetic");
  // --columns B:E (E a number or "end"), the same syntax as dynamiq-predict's.
  if (!a->columns.empty() &&
      (a->synthetic || !dq::sim::parse_column_range(a->columns, &a->col_begin, &a->col_end)))
    return usage_error("--columns " + a->columns +
                       ": expected B:E or B:end with B < E, with --input");

  for (const auto& w : dq::sim::split_list(a->worker_list)) {
    unsigned long long u = 0;
    if (!parse_ulong(w.c_str(), 1, 1024, &u))
      return usage_error("--workers: '" + w + "' is not in 1..1024");
    a->workers.push_back(static_cast<int>(u));
  }
  for (const auto& t : dq::sim::split_list(a->topo_list)) {
    dq::topo::Kind k;
    if (dq::topo::parse_kind(t, &k) != Status::kOk)
      return usage_error("--topo: unknown topology '" + t + "' (ring, butterfly)");
    a->topos.push_back(k);
  }
  for (const auto& h : dq::sim::split_list(a->hierarchy_list)) {
    if (h != "flat" && h != "node")
      return usage_error("--hierarchy: unknown hierarchy '" + h + "' (flat, node)");
    a->two_level.push_back(h == "node");
  }
  const bool any_node =
      std::find(a->two_level.begin(), a->two_level.end(), true) != a->two_level.end();
  if (a->scatter && a->opt.block_elems)
    return usage_error("--rail-block-bytes is for --hierarchy node (all-reduce) only");
  if (any_node && (a->scatter || a->opt.per_hop || a->breakdown))
    return usage_error(
        "--hierarchy node models the all-reduce only (no --collective reducescatter, "
        "--per-hop or --bits-breakdown)");
  for (int n : a->workers)
    if (n % static_cast<int>(a->ranks_per_node) != 0)
      return usage_error("--workers " + std::to_string(n) +
                         " is not a multiple of --ranks-per-node " +
                         std::to_string(a->ranks_per_node));
  a->codecs = dq::sim::split_list(a->codec_list);
  for (const auto& c : a->codecs) {
    std::string err;
    auto codec = dq::make_codec(c, &err);
    if (!codec) return usage_error("--codec: " + err);
    dq::DynamiqOptions dyn;
    dq::DynamiqPlan plan;
    if (a->breakdown && !dq::dynamiq_parameters(*codec, &dyn, &plan))
      return usage_error("--bits-breakdown: " + c + " is not a DynamiQ codec");
  }
  if (a->workers.empty() || a->topos.empty() || a->codecs.empty() || a->two_level.empty())
    return usage_error("empty --workers, --topo, --codec or --hierarchy list");
  return kContinue;
}

// The gradients: --synthetic ones (written and done with --save) or --input's rows.
int load_gradients(SimArgs* a, dq::sim::Matrix* m) {
  int max_workers = 0;
  for (int w : a->workers) max_workers = std::max(max_workers, w);
  std::string err;
  if (a->synthetic) {
    dq::sim::SyntheticSpec& syn = a->syn;
    syn.rows = a->save.empty() ? max_workers : std::max<size_t>(max_workers, syn.rows);
    double gib = static_cast<double>(syn.rows) * syn.cols * 4 / (1 << 30);
    if (gib > 16)
      return usage_error("synthetic data would need " + std::to_string(gib) +
                         " GiB; lower --dim or --workers");
    dq::sim::make_synthetic(syn, m);
    if (!a->save.empty()) {
      if (dq::sim::write_npy(a->save, *m, &err) != Status::kOk) {
        std::fprintf(stderr, "dynamiq-sim: %s\n", err.c_str());
        return 1;
      }
      std::fprintf(stderr, "dynamiq-sim: wrote %zux%zu to %s\n", m->rows, m->cols, a->save.c_str());
      return 0;
    }
  } else {
    if (dq::sim::read_npy_columns(a->input, max_workers, a->col_begin, a->col_end, m, &err) !=
        Status::kOk) {
      // A range past the file's columns is the option's fault: name it.
      if (!a->columns.empty() && err.find(": columns [") != std::string::npos)
        std::fprintf(stderr, "dynamiq-sim: --columns %s: %s\n", a->columns.c_str(), err.c_str());
      else
        std::fprintf(stderr, "dynamiq-sim: %s\n", err.c_str());
      return 2;
    }
    if (static_cast<int>(m->rows) < max_workers) {
      std::fprintf(stderr,
                   "dynamiq-sim: %s has %zu rows but --workers asks for %d; give a file with at "
                   "least %d rows or fewer workers\n",
                   a->input.c_str(), m->rows, max_workers, max_workers);
      return 2;
    }
  }
  return kContinue;
}

// One codec x topology x n case: its schedule and rows, and what its calls measured.
struct Case {
  std::string spec;
  dq::topo::Kind topo;
  int n = 0;
  bool two_level = false;            // --hierarchy node: `sched` is over the n / L nodes
  int local = 1;                     // --ranks-per-node
  size_t recvcount = 0;              // reduce-scatter: elements per rank block
  size_t d = 0;                      // elements reduced per worker
  dq::sim::SimResult sum{}, last{};  // sum: vNMSE averaged and seconds summed over the calls
  std::vector<double> hop, blocks;   // averaged over the calls
  dq::sim::BitBreakdown bits;
};

// Runs the case's --calls calls (call ids 0..calls-1) and averages their figures into *c.
int simulate_calls(const SimArgs& a, const dq::topo::Schedule& sched,
                   const std::vector<const float*>& rows, size_t cols, Case* c) {
  std::string err;
  auto codec = dq::make_codec(c->spec, &err);
  std::vector<float> decoded;
  dq::sim::SimResult& r = c->last;
  for (unsigned long long call = 0; call < a.calls; ++call) {
    dq::sim::SimOptions o = a.opt;
    o.call = call;
    const Status st =
        c->two_level ? dq::sim::simulate_two_level_allreduce(c->spec, sched, c->local, rows, cols,
                                                             o, nullptr, &r)
        : a.scatter
            ? dq::sim::simulate_reduce_scatter(c->spec, sched, rows, c->recvcount, o, nullptr, &r)
            : dq::sim::simulate_allreduce(*codec, sched, rows, cols, o,
                                          a.breakdown ? &decoded : nullptr, &r);
    if (st != Status::kOk) {
      std::fprintf(stderr, "dynamiq-sim: %s %s on %s n=%d failed\n", a.collective.c_str(),
                   c->spec.c_str(), dq::topo::kind_name(c->topo), c->n);
      return 1;
    }
    if (a.breakdown) {
      // The plan and the widths are the same every call (the statistics do not change);
      // the error is summed over the calls.
      if ((call == 0 && !dq::sim::bit_breakdown(*codec, &c->bits, &err)) ||
          !dq::sim::accumulate_width_error(*codec, rows, c->n, decoded.data(), a.opt.op, &c->bits,
                                           &err)) {
        std::fprintf(stderr, "dynamiq-sim: %s\n", err.c_str());
        return 1;
      }
    }
    c->sum.vnmse += r.vnmse / a.calls;
    c->sum.seconds += r.seconds;
    c->hop.resize(r.hop_error.size());
    for (size_t k = 0; k < c->hop.size(); ++k) c->hop[k] += r.hop_error[k] / a.calls;
    c->blocks.resize(r.block_vnmse.size());
    for (size_t k = 0; k < c->blocks.size(); ++k) c->blocks[k] += r.block_vnmse[k] / a.calls;
  }
  return kContinue;
}

void print_jsonl_row(const SimArgs& a, const Case& c) {
  const dq::sim::SimResult& r = c.last;
  // nlohmann-json, keys in this order. A non-finite number (an input holding infinities
  // or NaNs) is written as null, never as nan or inf, which are not JSON; "vnmse_finite"
  // is always there and false then, and a list or other number that is not finite gets
  // its own "<key>_finite": false.
  nlohmann::ordered_json row;
  row["collective"] = a.collective;
  row["codec"] = c.spec;
  row["topo"] = dq::topo::kind_name(c.topo);
  row["workers"] = c.n;
  row["hierarchy"] = c.two_level ? "node" : "flat";
  row["nodes"] = c.n / c.local;
  row["ranks_per_node"] = c.local;
  row["d"] = c.d;
  dq::cli::put_number(&row, "vnmse", c.sum.vnmse, /*always_flag=*/true);
  dq::cli::put_number(&row, "bits_per_coord", r.bits_per_coord);
  dq::cli::put_number(&row, "wire_bits_per_coord", r.wire_bits_per_coord);
  row["budget_honest"] = r.budget_honest;
  row["chunks_large_enough"] = r.chunks_large_enough;
  if (c.two_level)
    dq::cli::put_number(&row, "intra_node_bits_per_coord", r.intra_node_bits_per_coord);
  row["calls"] = a.calls;
  row["seed"] = static_cast<unsigned long long>(a.opt.seed);
  dq::cli::put_number(&row, "seconds", c.sum.seconds);
  if (a.scatter) {
    row["recvcount"] = c.recvcount;
    dq::cli::put_numbers(&row, "block_vnmse", c.blocks);
  }
  if (a.opt.per_hop) dq::cli::put_numbers(&row, "hop_vnmse", c.hop);
  if (a.breakdown) row["bits_breakdown"] = breakdown_json(c.bits);
  std::printf("%s\n", row.dump().c_str());
}

void print_table_row(const SimArgs& a, const Case& c) {
  const dq::sim::SimResult& r = c.last;
  std::printf("%-34s %-9s %5d %12.4e %9.4f %9.4f %7.2f", c.spec.c_str(),
              dq::topo::kind_name(c.topo), c.n, c.sum.vnmse, r.bits_per_coord,
              r.wire_bits_per_coord, c.sum.seconds);
  if (a.scatter) {
    double lo = c.blocks.empty() ? 0 : c.blocks[0], hi = lo;
    for (double b : c.blocks) lo = std::min(lo, b), hi = std::max(hi, b);
    std::printf("  (reducescatter: block vNMSE %.3e..%.3e)", lo, hi);
  }
  if (c.two_level) std::printf("  (two-level: %d nodes x %d)", c.n / c.local, c.local);
  if (!r.chunks_large_enough)
    std::printf("  (< %zu super-groups per chunk: the engine passes this through)",
                dq::kMinSuperGroupsPerChunk);
  std::printf("\n");
  if (a.breakdown) print_breakdown(c.bits);
}

// Progress on stderr: cases done of all, seconds since the first started.
struct Progress {
  std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
  size_t done = 0, total = 0;
};

// Every codec on one topology, worker count and hierarchy (two_level: the schedule runs over the
// n / --ranks-per-node nodes).
int run_topology(const SimArgs& a, const dq::sim::Matrix& m, int n, dq::topo::Kind topo,
                 bool two_level, Progress* progress) {
  // A reduce-scatter needs one chunk ending at every worker: the engine runs a butterfly of
  // a rank count that is not a power of two on the ring, and so does the simulator.
  const bool pow2 = (n & (n - 1)) == 0;
  if (a.scatter && topo == dq::topo::Kind::kButterfly && !pow2) {
    if (!a.quiet)
      std::fprintf(
          stderr, "dynamiq-sim: reducescatter n=%d: butterfly runs on the ring, as in the engine\n",
          n);
    topo = dq::topo::Kind::kRing;
  }
  const int local = static_cast<int>(a.ranks_per_node);
  dq::topo::Schedule sched;
  if (dq::topo::make_schedule(topo, two_level ? n / local : n, &sched) != Status::kOk) return 1;
  std::vector<const float*> rows;
  for (int r = 0; r < n; ++r) rows.push_back(m.row(r));
  const size_t recvcount = m.cols / static_cast<size_t>(n);
  if (a.scatter && recvcount == 0)
    return usage_error("--collective reducescatter needs d >= workers");
  for (const auto& spec : a.codecs) {
    Case c;
    c.spec = spec;
    c.topo = topo;
    c.n = n;
    c.two_level = two_level;
    c.local = local;
    c.recvcount = recvcount;
    c.d = a.scatter ? recvcount * n : m.cols;
    if (const int rc = simulate_calls(a, sched, rows, m.cols, &c); rc != kContinue) return rc;
    ++progress->done;
    if (!a.quiet)
      std::fprintf(
          stderr, "[dynamiq-sim %zu/%zu, %.1f s] %s %s n=%d%s\n", progress->done, progress->total,
          std::chrono::duration<double>(std::chrono::steady_clock::now() - progress->start).count(),
          spec.c_str(), dq::topo::kind_name(topo), n, two_level ? " two-level" : "");
    if (a.format == "jsonl")
      print_jsonl_row(a, c);
    else
      print_table_row(a, c);
    std::fflush(stdout);
  }
  return kContinue;
}

}  // namespace

int main(int argc, char** argv) {
  SimArgs a;
  if (const int rc = parse_command_line(argc, argv, &a); rc != kContinue) return rc;
  if (const int rc = check_options(&a); rc != kContinue) return rc;
  std::unique_ptr<tbb::global_control> limit;
  if (a.threads)
    limit = std::make_unique<tbb::global_control>(tbb::global_control::max_allowed_parallelism,
                                                  a.threads);
  dq::sim::Matrix m;
  if (const int rc = load_gradients(&a, &m); rc != kContinue) return rc;

  if (a.format == "table")
    std::printf("%-34s %-9s %5s %12s %9s %9s %7s\n", "codec", "topo", "n", "vNMSE", "bits/crd",
                "wire/crd", "sec");
  Progress progress;
  progress.total = a.workers.size() * a.topos.size() * a.two_level.size() * a.codecs.size();
  for (int n : a.workers)
    for (auto topo : a.topos)
      for (bool two_level : a.two_level)
        if (const int rc = run_topology(a, m, n, topo, two_level, &progress); rc != kContinue)
          return rc;
  return 0;
}

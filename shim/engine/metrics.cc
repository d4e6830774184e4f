#include "shim/engine/metrics.h"

#include <unistd.h>

#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <vector>

#include "common/c_locale.h"
#include "common/launcher_env.h"
#include "common/log.h"
#include "common/safe_file.h"
#include "config/settings.h"
#include "kernels/host_isa.h"

namespace dq::engine {
namespace {

struct Registry {
  std::mutex mutex;
  // Every communicator since the process started, destroyed ones included (their totals stay:
  // counters never go back), in registration order.
  std::vector<std::shared_ptr<CommMetrics>> comms;
  std::atomic<int64_t> next_due_ns{0};
  bool failing = false;        // the last write failed (said once a streak of failures)
  bool render_failed = false;  // a write threw: said once
  bool atexit_registered = false;
  // The process that last registered a communicator. A child forked from it without exec that
  // exits normally (os.fork() then sys.exit(), a C++ helper process; Python's multiprocessing
  // workers leave by os._exit) runs the exit handler it inherited on a copy of the registry,
  // whose mutex another thread may have held at the fork: it must neither write its stale copy
  // over the parent's file nor wait on that mutex.
  std::atomic<pid_t> owner{0};
  // The file the last write went to. The name can change while the job runs (%j falls back to
  // the pid until a communicator made from a unique id registers, when it becomes nccl-<commId>):
  // the file left behind is removed, or it would stay with stale counters under the same labels.
  std::string last_path;
};

Registry& registry() {
  static Registry* r = new Registry;  // never destroyed: written from atexit paths too
  return *r;
}

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace

ProcessLabels process_labels() {
  ProcessLabels l;
  // The launcher's job id, where one is set, so that two jobs on one node stay distinct.
  // torchrun without --rdzv-id (and without --standalone) sets TORCHELASTIC_RUN_ID to "none" in
  // every job: no job id at all.
  for (const char* key : {"DYNAMIQ_JOB_ID", "SLURM_JOB_ID", "TORCHELASTIC_RUN_ID", "PBS_JOBID",
                          "LSB_JOBID", "JOB_ID"})
    if (const char* v = std::getenv(key); v != nullptr && *v != '\0' && std::string(v) != "none") {
      l.job = v;
      break;
    }
  char host[256] = {0};
  if (gethostname(host, sizeof host - 1) == 0) l.host = host;
  l.pid = static_cast<int>(getpid());
  l.launcher_rank = launcher_rank(&l.launcher_size);
  l.version = config::build_version();
  l.revision = config::build_revision();
  l.nccl = log_nccl_version_text(log_nccl_version_code());
  fill_host_path(&l);
  return l;
}

void fill_host_path(ProcessLabels* l) {
  l->host_path = host_isa_name();
  l->host_paths_refused.clear();
  for (HostIsa isa : {HostIsa::kAvx2, HostIsa::kAvx512})
    if (host_isa_refused(isa))
      l->host_paths_refused +=
          (l->host_paths_refused.empty() ? "" : ",") + std::string(host_isa_name(isa));
}

std::string metrics_expand_path(const std::string& pattern, const std::string& job,
                                const std::string& host, int rank, int pid) {
  const std::string full =
      !pattern.empty() && pattern.back() == '/' ? pattern + "dynamiq-%j-%h-%r.prom" : pattern;
  std::string out;
  for (size_t i = 0; i < full.size(); ++i) {
    if (full[i] != '%' || i + 1 == full.size()) {
      out += full[i];
      continue;
    }
    const char k = full[++i];
    if (k == 'j') {
      // A job id is the launcher's text: keep it one path component.
      for (char c : job) out += c == '/' ? '_' : c;
    } else if (k == 'h') {
      out += host.substr(0, host.find('.'));
    } else if (k == 'r') {
      out += std::to_string(rank);
    } else if (k == 'p') {
      out += std::to_string(pid);
    } else if (k == '%') {
      out += '%';
    } else {
      out += '%';
      out += k;
    }
  }
  return out;
}

int metrics_file_rank(const ProcessLabels& labels,
                      const std::vector<std::shared_ptr<CommMetrics>>& comms) {
  const CommMetrics* largest = nullptr;
  for (const auto& c : comms)
    if (largest == nullptr || c->size > largest->size) largest = c.get();
  const int r = file_name_rank(labels.launcher_rank, labels.launcher_size,
                               largest != nullptr ? largest->rank : -1,
                               largest != nullptr ? largest->size : -1);
  return r >= 0 ? r : labels.pid;
}

std::string metrics_job_name(const ProcessLabels& labels,
                             const std::vector<std::shared_ptr<CommMetrics>>& comms) {
  if (!labels.job.empty()) return labels.job;
  for (const auto& c : comms)
    if (c->comm_id != 0) {
      char text[32];
      std::snprintf(text, sizeof text, "nccl-%016llx", static_cast<unsigned long long>(c->comm_id));
      return text;
    }
  return "pid-" + std::to_string(labels.pid);
}

namespace {

double update_time(const ProcessLabels& labels) {
  if (labels.now_s > 0) return labels.now_s;
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// The bytes an uncompressed ring all-reduce of the compressed calls' buffers sends per rank
// (2 (n-1)/n of them), over the bytes this rank sent for them; 0 before any.
double compression_ratio(const CommMetrics& c) {
  const uint64_t wire = c.wire_bytes.load();
  if (wire == 0 || c.size < 2) return 0;
  return 2.0 * (c.size - 1) / c.size * static_cast<double>(c.bytes_in.load()) /
         static_cast<double>(wire);
}

// The JSON `quantization` object of one communicator: its budget, buckets and sampled check.
// Caller holds its budget mutex.
nlohmann::json budget_json(const BudgetMetrics& b) {
  nlohmann::json buckets = nlohmann::json::array();
  for (const BucketMetrics& k : b.buckets)
    buckets.push_back({{"collective", k.collective},
                       {"dtype", k.dtype},
                       {"count", k.count},
                       {"root", k.root},
                       {"calls", k.calls},
                       {"budget_bits", k.budget_bits},
                       {"codec", k.codec},
                       {"predicted_vnmse", k.predicted_vnmse}});
  return {
      {"auto", b.auto_budget},
      {"target", b.target},
      {"mean_bits", b.budget_calls ? b.bits_sum / b.budget_calls : 0.0},
      {"mx_calls", b.mx_calls},
      {"widths", {{"2", b.widths[0]}, {"4", b.widths[1]}, {"8", b.widths[2]}, {"16", b.widths[3]}}},
      {"predicted_calls", b.predicted_calls},
      {"predicted_vnmse_mean",
       b.predicted_calls ? b.predicted_vnmse_sum / b.predicted_calls : -1.0},
      {"predicted_vnmse_last", b.predicted_vnmse_last},
      {"buckets", buckets},
      {"check",
       {{"calls", b.checked_calls},
        {"sampled_vnmse", b.checked_energy > 0 ? b.checked_sq_error / b.checked_energy : -1.0},
        {"sampled_vnmse_last", b.checked_vnmse_last},
        {"nonfinite", b.checked_nonfinite},
        {"paired_calls", b.paired_calls},
        {"paired_predicted_mean", b.paired_calls ? b.paired_predicted_sum / b.paired_calls : -1.0},
        {"paired_sampled_mean", b.paired_calls ? b.paired_sampled_sum / b.paired_calls : -1.0}}}};
}

std::string render_json(const std::vector<std::shared_ptr<CommMetrics>>& comms,
                        const ProcessLabels& labels) {
  nlohmann::json doc;
  doc["job"] = labels.job;
  doc["host"] = labels.host;
  doc["pid"] = labels.pid;
  doc["build"] = {{"version", labels.version},
                  {"git", labels.revision},
                  {"nccl", labels.nccl},
                  {"host_path", labels.host_path},
                  {"host_paths_refused", labels.host_paths_refused}};
  doc["updated_unix_s"] = update_time(labels);
  doc["communicators"] = nlohmann::json::array();
  for (const auto& c : comms) {
    nlohmann::json calls = nlohmann::json::object();
    for (int k = 0; k < kPassReasonCount; ++k)
      calls[reason_name(static_cast<PassReason>(k))] = c->calls[k].load();
    nlohmann::json budget;
    {
      std::lock_guard<std::mutex> lock(c->budget_mutex);
      budget = budget_json(c->budget);
    }
    doc["communicators"].push_back(
        {{"index", c->index},
         {"name", c->name},
         {"rank", c->rank},
         {"size", c->size},
         {"destroyed", c->destroyed.load()},
         {"bytes_in", c->bytes_in.load()},
         {"wire_bytes", c->wire_bytes.load()},
         {"seconds", c->nanoseconds.load() * 1e-9},
         {"window_wait_seconds", c->window_wait_nanoseconds.load() * 1e-9},
         {"plans_made", c->plans_made.load()},
         {"replans", c->replans.load()},
         {"held_bytes", c->held_bytes.load()},
         {"compression_ratio", compression_ratio(*c)},
         {"calls", calls},
         // After held_bytes in key order: tests/soak reads each
         // communicator up to the end of its first nested object.
         {"quantization", budget}});
  }
  // Invalid UTF-8 in a communicator name is replaced, never a throw or an invalid file.
  return doc.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
}

// Prometheus text: one label set on every sample (job_id, host, pid, comm, name, rank), plus the
// outcome on the calls counter. Not `job` or `instance`: Prometheus sets those itself when it
// scrapes the node exporter that reads this file.
std::string prometheus_quote(const std::string& v) {
  std::string o = "\"";
  for (char ch : v) {
    if (ch == '\\' || ch == '"') o += '\\';
    if (ch == '\n') {
      o += "\\n";
      continue;
    }
    o += ch;
  }
  return o + "\"";
}

std::string prometheus_labels(const ProcessLabels& labels, const CommMetrics& c) {
  auto quote = prometheus_quote;
  return "job_id=" + quote(labels.job) + ",host=" + quote(labels.host) +
         ",pid=" + quote(std::to_string(labels.pid)) + ",comm=" + quote(std::to_string(c.index)) +
         ",name=" + quote(c.name) + ",rank=" + quote(std::to_string(c.rank));
}

// The calls by outcome, the byte and time counters, and the held bytes.
void render_prometheus_traffic(const std::vector<std::shared_ptr<CommMetrics>>& comms,
                               const ProcessLabels& labels, std::string& text) {
  auto quote = prometheus_quote;
  auto label_set = [&](const CommMetrics& c) { return prometheus_labels(labels, c); };
  text +=
      "# HELP dynamiq_calls_total Collective calls seen on a communicator, by outcome "
      "(rerouted = compressed; otherwise why it passed through).\n";
  text += "# TYPE dynamiq_calls_total counter\n";
  for (const auto& c : comms)
    for (int k = 0; k < kPassReasonCount; ++k)
      text += "dynamiq_calls_total{" + label_set(*c) +
              ",outcome=" + quote(reason_name(static_cast<PassReason>(k))) + "} " +
              std::to_string(c->calls[k].load()) + "\n";
  // Each counter: its name, its help, the member it reads, and whether it counts nanoseconds
  // (written as seconds) rather than units.
  struct Counter {
    const char* name;
    const char* help;
    const std::atomic<uint64_t> CommMetrics::*value;
    bool nanoseconds;
  };
  const Counter kCounters[] = {
      {"dynamiq_rerouted_bytes_in_total", "Bytes of the caller's buffers in compressed calls.",
       &CommMetrics::bytes_in, false},
      {"dynamiq_rerouted_wire_bytes_total",
       "Bytes this rank sent for compressed calls (every message, statistics included).",
       &CommMetrics::wire_bytes, false},
      {"dynamiq_rerouted_seconds_total", "Seconds spent inside compressed calls on the host.",
       &CommMetrics::nanoseconds, true},
      {"dynamiq_window_wait_seconds_total",
       "Seconds compressed calls waited on the host for the call a control window back "
       "(DYNAMIQ_CONTROL_WINDOW): the device was that many calls behind.",
       &CommMetrics::window_wait_nanoseconds, true},
      {"dynamiq_plans_made_total",
       "Plans made for compressed call shapes (each a host wait for the device and new buffers).",
       &CommMetrics::plans_made, false},
      {"dynamiq_replans_total",
       "Plans made again for a shape the plan cache had evicted (DYNAMIQ_PLAN_CACHE too small "
       "for the shapes the job cycles through).",
       &CommMetrics::replans, false}};
  for (const Counter& k : kCounters) {
    text += std::string("# HELP ") + k.name + " " + k.help + "\n";
    text += std::string("# TYPE ") + k.name + " counter\n";
    for (const auto& c : comms) {
      const uint64_t n = ((*c).*k.value).load();
      char v[64];
      if (k.nanoseconds)
        std::snprintf(v, sizeof v, "%.9f", static_cast<double>(n) * 1e-9);
      else
        std::snprintf(v, sizeof v, "%llu", static_cast<unsigned long long>(n));
      text += std::string(k.name) + "{" + label_set(*c) + "} " + v + "\n";
    }
  }
  text +=
      "# HELP dynamiq_held_bytes Bytes of buffers the communicator's cached plans hold now (the "
      "payload arenas, layouts and statistics of up to DYNAMIQ_PLAN_CACHE call shapes).\n";
  text += "# TYPE dynamiq_held_bytes gauge\n";
  for (const auto& c : comms)
    text +=
        "dynamiq_held_bytes{" + label_set(*c) + "} " + std::to_string(c->held_bytes.load()) + "\n";
  text +=
      "# HELP dynamiq_compression_ratio Bytes an uncompressed ring all-reduce of the compressed "
      "calls' buffers sends per rank (2 (n-1)/n of them) over the bytes this rank sent for them "
      "(0: none yet).\n# TYPE dynamiq_compression_ratio gauge\n";
  for (const auto& c : comms) {
    char v[48];
    std::snprintf(v, sizeof v, "} %.6g\n", compression_ratio(*c));
    text += "dynamiq_compression_ratio{" + label_set(*c) + v;
  }
}

// The process's own samples: what it runs, and when the file was written (the textfile collector
// takes no sample timestamps; a stale file shows as an old value here).
void render_prometheus_process(const ProcessLabels& labels, std::string& text) {
  auto quote = prometheus_quote;
  const std::string process = "job_id=" + quote(labels.job) + ",host=" + quote(labels.host) +
                              ",pid=" + quote(std::to_string(labels.pid));
  text +=
      "# HELP dynamiq_build_info The dynamiq build, the NCCL it wraps and the host codec's path "
      "(always 1).\n"
      "# TYPE dynamiq_build_info gauge\n"
      "dynamiq_build_info{" +
      process + ",version=" + quote(labels.version) + ",git=" + quote(labels.revision) +
      ",nccl=" + quote(labels.nccl) + ",host_path=" + quote(labels.host_path) +
      ",host_paths_refused=" + quote(labels.host_paths_refused) + "} 1\n";
  char v[64];
  std::snprintf(v, sizeof v, "} %.3f\n", update_time(labels));
  text +=
      "# HELP dynamiq_last_update_timestamp_seconds Unix time of this file's write.\n"
      "# TYPE dynamiq_last_update_timestamp_seconds gauge\n"
      "dynamiq_last_update_timestamp_seconds{" +
      process + v;
}

// The budget's samples of every communicator, one string per family (the widths go straight
// into the text, whose family comes first).
struct BudgetLines {
  std::string predicted_calls, predicted_sum, predicted_last, sampled_last, bucket_lines, mx_calls,
      check_lines;
};

void collect_budget_lines(const std::vector<std::shared_ptr<CommMetrics>>& comms,
                          const ProcessLabels& labels, std::string& text, BudgetLines& out) {
  auto quote = prometheus_quote;
  auto label_set = [&](const CommMetrics& c) { return prometheus_labels(labels, c); };
  for (const auto& c : comms) {
    std::lock_guard<std::mutex> lock(c->budget_mutex);
    const BudgetMetrics& b = c->budget;
    static const char* kWidth[4] = {"2", "4", "8", "16"};
    for (int w = 0; w < 4; ++w)
      text += "dynamiq_width_supergroups_total{" + label_set(*c) + ",width=" + quote(kWidth[w]) +
              "} " + std::to_string(b.widths[w]) + "\n";
    char v[160];
    out.predicted_calls += "dynamiq_predicted_calls_total{" + label_set(*c) + "} " +
                           std::to_string(b.predicted_calls) + "\n";
    out.mx_calls += "dynamiq_mx_fallback_calls_total{" + label_set(*c) + "} " +
                    std::to_string(b.mx_calls) + "\n";
    const std::pair<const char*, double> checks[] = {
        {"calls", static_cast<double>(b.checked_calls)},
        {"sq_error", b.checked_sq_error},
        {"energy", b.checked_energy},
        {"paired_calls", static_cast<double>(b.paired_calls)},
        {"paired_predicted_vnmse_sum", b.paired_predicted_sum},
        {"paired_sampled_vnmse_sum", b.paired_sampled_sum}};
    for (const auto& [what, value] : checks) {
      std::snprintf(v, sizeof v, "} %.9g\n", value);
      out.check_lines += std::string("dynamiq_check_") + what + "_total{" + label_set(*c) + v;
    }
    std::snprintf(v, sizeof v, "} %.9g\n", b.predicted_vnmse_sum);
    out.predicted_sum += "dynamiq_predicted_vnmse_sum_total{" + label_set(*c) + v;
    std::snprintf(v, sizeof v, "} %.9g\n", b.predicted_vnmse_last);
    out.predicted_last += "dynamiq_predicted_vnmse{" + label_set(*c) + v;
    std::snprintf(v, sizeof v, "} %.9g\n", b.checked_vnmse_last);
    out.sampled_last += "dynamiq_sampled_vnmse{" + label_set(*c) + v;
    for (const BucketMetrics& k : b.buckets) {
      std::snprintf(v, sizeof v, "} %.9g\n", k.budget_bits);
      out.bucket_lines += "dynamiq_bucket_budget_bits{" + label_set(*c) +
                          ",collective=" + quote(k.collective) + ",dtype=" + quote(k.dtype) +
                          ",count=" + quote(std::to_string(k.count)) +
                          ",root=" + quote(std::to_string(k.root)) + ",codec=" + quote(k.codec) + v;
    }
  }
}

// The sampled check (DYNAMIQ_CHECK_EVERY): one HELP/TYPE per family, samples grouped by it.
void render_check_families(const std::string& check_lines, std::string& text) {
  static const std::pair<const char*, const char*> kCheckHelp[] = {
      {"calls", "Calls whose sampled check was read (an exact all-reduce of 64 super-groups)."},
      {"sq_error", "Summed squared error of the checked samples (against the exact sum)."},
      {"energy",
       "Summed squared exact values of the checked samples (sq_error / energy: the "
       "sampled vNMSE)."},
      {"paired_calls", "Checked calls whose predicted vNMSE is known too."},
      {"paired_predicted_vnmse_sum", "Sum of the predicted vNMSE of the paired calls."},
      {"paired_sampled_vnmse_sum", "Sum of the sampled vNMSE of the paired calls."}};
  for (const auto& [what, help] : kCheckHelp) {
    const std::string name = std::string("dynamiq_check_") + what + "_total";
    text += "# HELP " + name + " " + help + "\n# TYPE " + name + " counter\n";
    const std::string prefix = name + "{";
    for (size_t at = 0; (at = check_lines.find(prefix, at)) != std::string::npos;) {
      const size_t end = check_lines.find('\n', at);
      text += check_lines.substr(at, end + 1 - at);
      at = end + 1;
    }
  }
}

// The budget (docs/ENGINE.md section 10): widths and predicted vNMSE of the calls whose
// statistics were read, and each bucket's latest budget; then the sampled check.
void render_prometheus_budget(const std::vector<std::shared_ptr<CommMetrics>>& comms,
                              const ProcessLabels& labels, std::string& text) {
  text +=
      "# HELP dynamiq_width_supergroups_total Super-groups of compressed DynamiQ calls by width "
      "(bits), counted one call of their bucket late.\n";
  text += "# TYPE dynamiq_width_supergroups_total counter\n";
  BudgetLines l;
  collect_budget_lines(comms, labels, text, l);
  text +=
      "# HELP dynamiq_predicted_calls_total Compressed DynamiQ calls with a predicted vNMSE (from "
      "their own all-reduced statistics, read one call of their bucket late).\n";
  text += "# TYPE dynamiq_predicted_calls_total counter\n" + l.predicted_calls;
  text +=
      "# HELP dynamiq_predicted_vnmse_sum_total Sum of the predicted vNMSE of those calls (divide "
      "by dynamiq_predicted_calls_total for the mean).\n";
  text += "# TYPE dynamiq_predicted_vnmse_sum_total counter\n" + l.predicted_sum;
  text +=
      "# HELP dynamiq_predicted_vnmse Predicted vNMSE of the latest of those calls (-1: none "
      "yet).\n";
  text += "# TYPE dynamiq_predicted_vnmse gauge\n" + l.predicted_last;
  text +=
      "# HELP dynamiq_sampled_vnmse Sampled vNMSE (DYNAMIQ_CHECK_EVERY: 64 super-groups against "
      "their exact all-reduce) of the latest checked call (-1: none yet).\n";
  text += "# TYPE dynamiq_sampled_vnmse gauge\n" + l.sampled_last;
  text +=
      "# HELP dynamiq_bucket_budget_bits Budget of the latest compressed call of each bucket "
      "(call shape), bits per coordinate.\n";
  text += "# TYPE dynamiq_bucket_budget_bits gauge\n";
  text += l.bucket_lines;
  text +=
      "# HELP dynamiq_mx_fallback_calls_total Compressed DynamiQ calls that DYNAMIQ_BITS=auto sent "
      "as MXFP8 or MXFP6 (no rung with fewer bits met the target).\n";
  text += "# TYPE dynamiq_mx_fallback_calls_total counter\n" + l.mx_calls;
  render_check_families(l.check_lines, text);
}

}  // namespace

std::string metrics_render(const std::vector<std::shared_ptr<CommMetrics>>& comms,
                           const ProcessLabels& labels, bool prometheus) {
  const CNumericLocale c_numbers;  // Prometheus' and JSON's numbers: "0.5", never "0,5"
  if (!prometheus) return render_json(comms, labels);
  std::string text;
  render_prometheus_process(labels, text);
  render_prometheus_traffic(comms, labels, text);
  render_prometheus_budget(comms, labels, text);
  return text;
}

namespace {

// The labels the first write read. Never destroyed: the write at exit (an atexit handler
// registered before this first write) runs after the static objects made since are destroyed.
const ProcessLabels& first_labels() {
  static const ProcessLabels& first = *new ProcessLabels(process_labels());
  return first;
}

// The metrics file's path for the next write (caller holds the registry mutex).
std::string path_locked(const Registry& r, const ProcessLabels& labels) {
  return metrics_expand_path(config::global().metrics_file, metrics_job_name(labels, r.comms),
                             labels.host, metrics_file_rank(labels, r.comms), labels.pid);
}

// Caller holds the registry mutex. False when the write failed: said once, and tried again at
// every later write (a folder made after the job started, a full disk that was cleared).
bool write_unguarded(Registry& r) {
  const config::Settings& s = config::global();
  if (s.metrics_file.empty()) return true;
  ProcessLabels labels = first_labels();
  fill_host_path(&labels);
  const std::string path = path_locked(r, labels);
  const bool prom = path.size() >= 5 && path.compare(path.size() - 5, 5, ".prom") == 0;
  // A temporary created O_EXCL | O_NOFOLLOW, renamed over the file: never through a symbolic
  // link placed at either name (a shared /tmp), and a reader (the textfile collector reads
  // *.prom only) never sees half a file.
  std::string why;
  if (!write_file_replacing(path, metrics_render(r.comms, labels, prom), &why)) {
    if (!r.failing)
      DQ_WARN(Subsys::kShim,
              "dynamiq: cannot write the metrics file (%s); tried again at each later write, "
              "said again only after one succeeds (compression is unaffected)",
              why.c_str());
    r.failing = true;
    return false;
  }
  if (r.failing)
    DQ_WARN(Subsys::kShim, "dynamiq: the metrics file %s is written again", path.c_str());
  r.failing = false;
  if (!r.last_path.empty() && r.last_path != path) ::unlink(r.last_path.c_str());
  r.last_path = path;
  return true;
}

// A write runs inside the job's NCCL calls (a passed-through one before it is handed to NCCL, a
// communicator's destroy before NCCL's): whatever it throws (std::bad_alloc rendering the file
// with memory short) ends here, or that rank would skip the NCCL call its peers wait in. The write
// is skipped, said once; the next one tries again. False when the file was not written.
bool write_locked(Registry& r) {
  try {
    return write_unguarded(r);
  } catch (...) {
    if (!r.render_failed) {
      r.render_failed = true;
      try {  // the log line may need memory too
        DQ_WARN(Subsys::kShim,
                "dynamiq: the metrics file could not be rendered (out of memory?); this write is "
                "skipped (compression is unaffected)");
      } catch (...) {
      }
    }
    return false;
  }
}

// A child forked without exec (a data-loader worker) holds a stale copy of its parent's counters
// and, when another thread held the registry's mutex at the fork, a mutex it can never take: it
// writes nothing, and takes no lock, whatever it calls. Its parent (the owner) writes the file.
bool forked_copy(const Registry& r) {
  const pid_t owner = r.owner.load();
  return owner != 0 && owner != getpid();
}

}  // namespace

const char* reason_name(PassReason r) {
  switch (r) {
    case PassReason::kRerouted:
      return "rerouted";
    case PassReason::kDisabled:
      return "disabled";
    case PassReason::kNotOptedIn:
      return "not_opted_in";
    case PassReason::kDtype:
      return "dtype";
    case PassReason::kOp:
      return "op";
    case PassReason::kSmall:
      return "small";
    case PassReason::kSingleRank:
      return "single_rank";
    case PassReason::kInGroup:
      return "in_group";
    case PassReason::kCapturing:
      return "graph_capture";
    case PassReason::kOverBudget:
      return "over_budget";
    case PassReason::kSwitchOff:
      return "switch_off";
    case PassReason::kSettingsDiffer:
      return "settings_differ";
    case PassReason::kNoDevice:
      return "no_device";
    case PassReason::kFailure:
      return "failure";
    case PassReason::kCollective:
      return "collective";
    case PassReason::kCanaryFailed:
      return "canary_failed";
    case PassReason::kLarge:
      return "large";
    case PassReason::kCount:
      break;
  }
  return "unknown";
}

std::shared_ptr<CommMetrics> metrics_register(int index, const std::string& name, int rank,
                                              int size, uint64_t comm_id) {
  auto m = std::make_shared<CommMetrics>();
  m->comm_id = comm_id;
  m->index = index;
  m->name = name;
  m->rank = rank;
  m->size = size;
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.comms.push_back(m);
  r.owner.store(getpid());
  if (!r.atexit_registered) {
    r.atexit_registered = true;
    std::atexit([] {    // the job's final totals, by the process that holds the communicators
      metrics_flush();  // nothing in a forked copy (forked_copy)
    });
  }
  if (!config::global().metrics_file.empty()) metrics_install_signal_write();
  return m;
}

void metrics_unregister(const std::shared_ptr<CommMetrics>& m) {
  Registry& r = registry();
  if (forked_copy(r)) return;
  std::lock_guard<std::mutex> lock(r.mutex);
  m->destroyed.store(true);  // kept: its totals are part of the job's
  write_locked(r);
}

void metrics_tick() {
  Registry& r = registry();
  const int64_t now = now_ns();
  if (now < r.next_due_ns.load(std::memory_order_relaxed) || forked_copy(r)) return;
  const config::Settings& s = config::global();
  if (s.metrics_file.empty()) {
    r.next_due_ns.store(INT64_MAX);
    return;
  }
  r.next_due_ns.store(now + static_cast<int64_t>(s.metrics_interval_s * 1e9));
  // On the writer thread where there is one: this thread is inside an NCCL call.
  if (metrics_request_write()) return;
  std::lock_guard<std::mutex> lock(r.mutex);
  write_locked(r);
}

bool metrics_flush() {
  Registry& r = registry();
  if (forked_copy(r)) return true;  // nothing of this process's to write
  std::lock_guard<std::mutex> lock(r.mutex);
  return write_locked(r);
}

std::string metrics_path_now() {
  if (config::global().metrics_file.empty()) return "";
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  return path_locked(r, first_labels());
}

}  // namespace dq::engine

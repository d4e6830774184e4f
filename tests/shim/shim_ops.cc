// What an operator reads from libdynamiq.so on the CPU NCCL, ranks forked with the shim preloaded:
// the decision line of each communicator and the per-call reasons (decision), metrics files of
// two concurrent jobs (jobs), the final metrics write when a job is stopped by SIGTERM (sigterm),
// and an NCCL version outside the supported range (nccl_range, with a stub ncclGetVersion
// preloaded after the shim). Usage: shim_ops SCENARIO. Exit 0 pass, 1 fail, 77 skip.
#include <dirent.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <locale.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "common/nccl_api.h"
#include "tests/common/check.h"
#include "tests/common/locales.h"
#include "tests/common/rank_harness.h"
#include "tests/shim/shim_test_util.h"

namespace {

using namespace dq::shim_test;
using dq::test::fail;

// Forks n ranks of a communicator named `name`; rank r applies env(r) before it is created and
// runs body(rank, comm); stderr into g_dir/rank<r>.log. Returns how each rank ended.
std::vector<dq::test::RankExit> run_ranks(
    int n, const std::function<Env(int)>& env, const std::function<int(int, ncclComm_t)>& body,
    std::function<bool(int, const dq::test::RankExit&)> expected = {}) {
  dq::test::RankOptions opt;
  opt.timeout_s = 240;
  opt.expected = std::move(expected);
  return dq::test::run_ranks<ncclUniqueId>(
      n, 1, ncclGetUniqueId, opt, [&](int r, const ncclUniqueId* id) {
        const std::string log = g_dir + "/rank" + std::to_string(r) + ".log";
        if (std::freopen(log.c_str(), "w", stderr) == nullptr) return 98;
        for (const char* key : {"SLURM_JOB_ID", "TORCHELASTIC_RUN_ID", "DYNAMIQ_JOB_ID",
                                "PBS_JOBID", "LSB_JOBID", "JOB_ID"})
          unsetenv(key);
        for (auto& [k, v] : env(r)) setenv(k.c_str(), v.c_str(), 1);
        // DQ_TEST_LOCALE: the application's setlocale(LC_ALL, ...) at its start.
        if (const char* l = std::getenv("DQ_TEST_LOCALE"); l != nullptr && !setlocale(LC_ALL, l))
          return 95;
        ncclComm_t comm = nullptr;
        if (dq::shim_test::init_comm(&comm, n, *id, r, "grads") != ncclSuccess) return 97;
        // A library other than the CPU NCCL answering (a fake libnccl.so.2 found first on
        // LD_LIBRARY_PATH) shows here rather than as a puzzling decision line.
        int size = 0, rank = -1;
        if (ncclCommCount(comm, &size) != ncclSuccess || size != n ||
            ncclCommUserRank(comm, &rank) != ncclSuccess || rank != r) {
          std::fprintf(stderr, "rank %d: the communicator reports rank %d of %d, not %d of %d\n", r,
                       rank, size, r, n);
          return 96;
        }
        const int rc = body(r, comm);
        std::fflush(stderr);
        if (rc == 0) ncclCommDestroy(comm);
        return rc;
      });
}

bool all_exited_zero(const std::vector<dq::test::RankExit>& exits, const char* what) {
  for (size_t r = 0; r < exits.size(); ++r)
    if (!exits[r].exited(0)) {
      std::fprintf(stderr, "--- rank %zu log ---\n%s", r, rank_log(static_cast<int>(r)).c_str());
      return fail("%s: rank %zu %s", what, r, exits[r].describe().c_str());
    }
  return true;
}

// `calls` FP32 all-reduces of `count` values; 0 when each sum that passed through is exact (the
// compressed ones' accuracy is shim_multirank's).
int float_calls(int n, int rank, ncclComm_t comm, size_t count, int calls,
                ncclRedOp_t op = ncclSum) {
  std::vector<float> in(count), out(count);
  for (size_t i = 0; i < count; ++i) in[i] = static_cast<float>((i * 7 + rank * 13) % 97) - 48;
  for (int c = 0; c < calls; ++c) {
    const unsigned long long before = rerouted_calls(comm);
    if (ncclAllReduce(in.data(), out.data(), count, ncclFloat32, op, comm, nullptr) != ncclSuccess)
      return 20;
    if (op != ncclSum || rerouted_calls(comm) != before) continue;
    for (size_t i = 0; i < count; ++i) {
      float want = 0;
      for (int r = 0; r < n; ++r) want += static_cast<float>((i * 7 + r * 13) % 97) - 48;
      if (out[i] != want) return 21;
    }
  }
  return 0;
}

// The decision line of rank r's log (the text after "rank r/n comm 0x... "), "" if there is not
// exactly one.
std::string decision(int r) {
  const std::string log = rank_log(r);
  const std::regex line(
      "(^|\n)[^ \n]+ \\[-\\] dynamiq INFO dynamiq: communicator index 0 name 'grads' color -1 "
      "rank [0-9]+/[0-9]+ comm 0x[0-9a-f]+ commId (0x[0-9a-f]+) commHash (0x[0-9a-f]+): "
      "((compressed|pass-through): [^\n]*)");
  std::string found;
  int lines = 0;
  for (std::sregex_iterator it(log.begin(), log.end(), line), end; it != end; ++it, ++lines)
    found = (*it)[2].str() + " " + (*it)[3].str() + " " + (*it)[4].str();
  return lines == 1 ? found : "";
}

// One decision per rank, the same text (commId and hash included) on every rank, containing
// `want`.
bool same_decision(int n, const std::string& want, const char* what) {
  const std::string first = decision(0);
  for (int r = 0; r < n; ++r) {
    const std::string d = decision(r);
    EXPECT(!d.empty(), "%s: rank %d has no decision line:\n%s", what, r, rank_log(r).c_str());
    EXPECT(d == first, "%s: rank %d decided '%s', rank 0 '%s'", what, r, d.c_str(), first.c_str());
  }
  EXPECT(first.find(want) != std::string::npos, "%s: the decision '%s' does not say '%s'", what,
         first.c_str(), want.c_str());
  std::printf("%s: %s\n", what, first.c_str());
  return true;
}

// ---- decision: the three cases an operator found contradictory, and the per-call reasons -----
bool scenario_decision() {
  const int n = 2;
  auto with = [](Env more) {
    more.push_back({"DYNAMIQ_DEBUG", "INFO"});
    return [more](int) { return more; };
  };
  auto few_calls = [&](int rank, ncclComm_t comm) {
    return float_calls(n, rank, comm, 1 << 18, 2);
  };
  if (!all_exited_zero(run_ranks(n, with({{"DYNAMIQ_ENABLE", "0"}}), few_calls), "enable=0") ||
      !same_decision(n, "pass-through: disabled (DYNAMIQ_ENABLE=0)", "DYNAMIQ_ENABLE=0"))
    return false;
  if (!all_exited_zero(
          run_ranks(n, with({{"DYNAMIQ_ENABLE", "1"}, {"DYNAMIQ_COMMS", "none"}}), few_calls),
          "comms=none") ||
      !same_decision(n,
                     "pass-through: not opted in (DYNAMIQ_COMMS=none matches none of name "
                     "'grads', size 2, index 0, color -1",
                     "DYNAMIQ_COMMS=none"))
    return false;
  // DYNAMIQ_MIN_BYTES=1G: "compressed" says which calls, the first small call says why it passed
  // through, and after 16 such calls one warning.
  auto many_small = [&](int rank, ncclComm_t comm) {
    return float_calls(n, rank, comm, 1 << 18, 20) || rerouted_calls(comm) != 0;
  };
  if (!all_exited_zero(
          run_ranks(n, with({{"DYNAMIQ_ENABLE", "1"}, {"DYNAMIQ_MIN_BYTES", "1G"}}), many_small),
          "min_bytes=1G") ||
      !same_decision(n, "calls of at least 1 GiB of float32,bfloat16", "DYNAMIQ_MIN_BYTES=1G"))
    return false;
  for (int r = 0; r < n; ++r) {
    const std::string log = rank_log(r);
    EXPECT(count_occurrences(
               log,
               "passed through: 1048576 bytes, below DYNAMIQ_MIN_BYTES = 1 GiB (the first; "
               "each is counted as outcome=\"small\"") == 1,
           "rank %d: no single per-call line for the size:\n%s", r, log.c_str());
    EXPECT(count_occurrences(log, "dynamiq WARN dynamiq: communicator index 0 name 'grads'") == 1 &&
               count_occurrences(log,
                                 "is opted in, but its first 16 calls all passed through (16 below "
                                 "DYNAMIQ_MIN_BYTES = 1 GiB, 0 of a type") == 1,
           "rank %d: not one warning for 16 small calls:\n%s", r, log.c_str());
  }
  // Defaults: compressed, with the codec and topology; a small call and a MAX call each say why
  // they passed through, once; no warning (the communicator compressed a call).
  auto mixed = [&](int rank, ncclComm_t comm) {
    return float_calls(n, rank, comm, 1 << 18, 2) || float_calls(n, rank, comm, 1000, 3) ||
           float_calls(n, rank, comm, 1 << 18, 2, ncclMax) || rerouted_calls(comm) != 2;
  };
  if (!all_exited_zero(run_ranks(n, with({{"DYNAMIQ_ENABLE", "1"}}), mixed), "defaults") ||
      !same_decision(n,
                     "compressed: codec dynamiq at 5 bits per value, topology ring, blocks of 16 "
                     "MiB, calls of at least 1 MiB of float32,bfloat16 by "
                     "allreduce,reducescatter,reduce, the host up to 8 calls ahead of the device "
                     "(DYNAMIQ_COMMS term all)",
                     "defaults"))
    return false;
  for (int r = 0; r < n; ++r) {
    const std::string log = rank_log(r);
    EXPECT(
        count_occurrences(log, "passed through: 4000 bytes, below DYNAMIQ_MIN_BYTES = 1 MiB") ==
                1 &&
            count_occurrences(log, "passed through: reduction 2 is not a sum or an average") == 1 &&
            count_occurrences(log, " WARN ") == 0,
        "rank %d: per-call reasons not logged once each, or a warning:\n%s", r, log.c_str());
  }
  // A mismatch names the setting.
  auto bits = [](int r) {
    return Env{{"DYNAMIQ_ENABLE", "1"}, {"DYNAMIQ_DEBUG", "INFO"}, {"DYNAMIQ_BITS", r ? "4" : "5"}};
  };
  return all_exited_zero(run_ranks(n, bits, few_calls), "mismatch") &&
         same_decision(n, "pass-through: ranks disagree on DYNAMIQ_BITS", "DYNAMIQ_BITS differs");
}

// ---- jobs: two concurrent jobs on one node keep separate metrics files -----------------------
std::vector<std::string> files_in(const std::string& dir) {
  std::vector<std::string> names;
  if (DIR* d = opendir(dir.c_str())) {
    while (const dirent* e = readdir(d))
      if (e->d_name[0] != '.') names.push_back(e->d_name);
    closedir(d);
  }
  std::sort(names.begin(), names.end());
  return names;
}

// Runs job A (`a_calls` compressed calls per rank) here and job B (`b_calls`) in a forked child
// at the same time, both with `pattern` and their own extra environment.
bool two_jobs(const std::string& pattern, const Env& a_env, const Env& b_env, int a_calls,
              int b_calls) {
  const int n = 2;
  auto job = [&](const Env& extra, int calls) {
    Env env = extra;
    env.push_back({"DYNAMIQ_ENABLE", "1"});
    env.push_back({"DYNAMIQ_METRICS_FILE", pattern});
    return run_ranks(
        n, [env](int) { return env; },
        [&](int rank, ncclComm_t comm) { return float_calls(n, rank, comm, 1 << 18, calls); });
  };
  const std::string base = g_dir;
  const pid_t b = fork();
  if (b == 0) {
    g_dir = base + "/job_b";  // its rank logs apart from job A's
    mkdir(g_dir.c_str(), 0755);
    _exit(all_exited_zero(job(b_env, b_calls), "job B") ? 0 : 1);
  }
  const bool a_ok = all_exited_zero(job(a_env, a_calls), "job A");
  int status = 0;
  waitpid(b, &status, 0);
  EXPECT(a_ok && WIFEXITED(status) && WEXITSTATUS(status) == 0, "a job failed");
  return true;
}

bool scenario_jobs() {
  // No job id anywhere, the default name in a directory: each job is named by its NCCL commId.
  const std::string dir = g_dir + "/textfile/";
  mkdir(dir.c_str(), 0755);
  if (!two_jobs(dir, {}, {}, 3, 5)) return false;
  std::vector<std::string> names = files_in(dir);
  std::string listing;
  for (const auto& f : names) listing += f + "\n";
  EXPECT(names.size() == 4, "4 files expected (2 jobs x 2 ranks), found:\n%s", listing.c_str());
  int per_job[2] = {0, 0};
  for (const auto& f : names) {
    const std::string text = read_file(dir + f);
    EXPECT(std::regex_match(f, std::regex("dynamiq-nccl-[0-9a-f]{16}-[^-]+-[01]\\.prom")),
           "file name %s", f.c_str());
    const bool a = count_occurrences(text, "outcome=\"rerouted\"} 3\n") == 1;
    const bool b = count_occurrences(text, "outcome=\"rerouted\"} 5\n") == 1;
    EXPECT(a != b, "%s holds neither job's counts alone:\n%s", f.c_str(), text.c_str());
    ++per_job[a ? 0 : 1];
    EXPECT(
        count_occurrences(text, "job=") == 0 && count_occurrences(text, "dynamiq_build_info{") == 1,
        "%s: a job label, or no build info:\n%s", f.c_str(), text.c_str());
  }
  EXPECT(per_job[0] == 2 && per_job[1] == 2, "files per job: %d and %d", per_job[0], per_job[1]);
  // The launcher's job ids, %j in a pattern.
  const std::string pattern = g_dir + "/m.%j.%r.prom";
  if (!two_jobs(pattern, {{"SLURM_JOB_ID", "111"}}, {{"TORCHELASTIC_RUN_ID", "222"}}, 3, 5))
    return false;
  for (int r = 0; r < 2; ++r) {
    const std::string a = read_file(g_dir + "/m.111." + std::to_string(r) + ".prom");
    const std::string b = read_file(g_dir + "/m.222." + std::to_string(r) + ".prom");
    EXPECT(count_occurrences(a, "outcome=\"rerouted\"} 3\n") == 1 &&
               count_occurrences(a, "job_id=\"111\"") > 10,
           "job 111 rank %d:\n%s", r, a.c_str());
    EXPECT(count_occurrences(b, "outcome=\"rerouted\"} 5\n") == 1 &&
               count_occurrences(b, "job_id=\"222\"") > 10,
           "job 222 rank %d:\n%s", r, b.c_str());
  }
  std::printf("jobs: two concurrent jobs wrote 4 + 4 separate files with their own counts\n");
  return true;
}

// ---- sigterm: a job stopped by SIGTERM leaves its final counts ---------------------------------
// Rank 0's application installed its own SIGTERM handler before the shim's (it must still run);
// rank 1 has the default action (the process must still end by the signal).
const char* g_marker = nullptr;
void application_handler(int) {
  const int fd = open(g_marker, O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd >= 0) close(fd);
  _exit(42);
}

bool scenario_sigterm() {
  const int n = 2, calls = 7;
  const std::string marker = g_dir + "/application_handler_ran";
  g_marker = marker.c_str();
  auto body = [&](int rank, ncclComm_t comm) -> int {
    if (rank == 0) signal(SIGTERM, application_handler);
    // The first call writes the file (the interval's first tick); no later periodic write.
    if (const int rc = float_calls(n, rank, comm, 1 << 18, calls)) return rc;
    if (rerouted_calls(comm) != static_cast<unsigned long long>(calls)) return 30;
    kill(getpid(), SIGTERM);
    for (int i = 0; i < 600; ++i) usleep(10000);  // bounded: the signal ends the process
    return 31;
  };
  const std::string pattern = g_dir + "/final.%r.json";
  const auto exits = run_ranks(
      n,
      [&](int) {
        return Env{{"DYNAMIQ_ENABLE", "1"},
                   {"DYNAMIQ_METRICS_FILE", pattern},
                   {"DYNAMIQ_METRICS_INTERVAL_S", "86400"}};
      },
      body,
      [](int r, const dq::test::RankExit& e) {
        return r == 0 ? e.exited(42) : e.signaled(SIGTERM);
      });
  for (int r = 0; r < n; ++r) {
    const bool ok = r == 0 ? exits[r].exited(42) : exits[r].signaled(SIGTERM);
    EXPECT(ok, "rank %d %s:\n%s", r, exits[r].describe().c_str(), rank_log(r).c_str());
    const std::string text = read_file(g_dir + "/final." + std::to_string(r) + ".json");
    EXPECT(count_occurrences(text, "\"rerouted\":7,") == 1, "rank %d's file lacks its 7 calls:\n%s",
           r, text.c_str());
  }
  EXPECT(access(marker.c_str(), F_OK) == 0, "the application's own SIGTERM handler did not run");
  std::printf("sigterm: both ranks' files hold all %d calls; the application's handler ran\n",
              calls);
  return true;
}

// ---- nccl_range: an NCCL outside the supported versions is passed through, with one warning ----
bool scenario_nccl_range() {
  const int n = 2;
  auto body = [&](int rank, ncclComm_t comm) {
    return float_calls(n, rank, comm, 1 << 18, 2) || rerouted_calls(comm) != 0;
  };
  auto env = [](int) { return Env{{"DYNAMIQ_ENABLE", "1"}, {"DYNAMIQ_DEBUG", "INFO"}}; };
  if (!all_exited_zero(run_ranks(n, env, body), "nccl_range") ||
      !same_decision(n,
                     "pass-through: NCCL 2.99.0 is outside the versions this build supports "
                     "(2.18.0 to 2.28.99)",
                     "NCCL 2.99.0"))
    return false;
  for (int r = 0; r < n; ++r) {
    const std::string log = rank_log(r);
    EXPECT(count_occurrences(log, " WARN ") == 1 &&
               count_occurrences(
                   log, "dynamiq WARN dynamiq: NCCL 2.99.0 is outside the versions") == 1 &&
               count_occurrences(log, "wrapping NCCL 2.99.0 (ncclGetVersion 29900)") == 1 &&
               count_occurrences(log, "(git ") == 1 &&
               count_occurrences(log, "), NCCL 2.99.0, CUDA runtime") == 1,
           "rank %d: not one warning, or no version lines:\n%s", r, log.c_str());
  }
  // DYNAMIQ_UNTESTED_NCCL=1: compressed regardless (the warning stays).
  auto forced = [&](int rank, ncclComm_t comm) {
    return float_calls(n, rank, comm, 1 << 18, 2) || rerouted_calls(comm) != 2;
  };
  auto env_forced = [](int) {
    return Env{{"DYNAMIQ_ENABLE", "1"}, {"DYNAMIQ_DEBUG", "INFO"}, {"DYNAMIQ_UNTESTED_NCCL", "1"}};
  };
  return all_exited_zero(run_ranks(n, env_forced, forced), "nccl_range forced") &&
         same_decision(n, "compressed: ", "NCCL 2.99.0, DYNAMIQ_UNTESTED_NCCL=1");
}

// ---- locale: an application whose numbers use a decimal comma ----------------------------------
// A job whose script called setlocale(LC_ALL, "") on a German host (LC_NUMERIC de_DE: "4,5"). The
// C library's strtod and printf follow the thread's LC_NUMERIC, so dynamiq's settings, codec
// specs and budget targets ("4.5", "eps8=0.4", "vnmse:0.01") and its metrics text (Prometheus'
// format wants "0.5") must not. de_DE is compiled into the run's folder with localedef (LOCPATH),
// so nothing on the machine changes; skipped where localedef or the locale's source is missing
// (Debian: the `locales` package).
Outcome scenario_locale() {
  const int n = 2;
  const std::string locales = g_dir + "/locales";
  if (!dq::test::compile_locale("de_DE", locales)) {
    std::printf("SKIP: localedef could not make de_DE.UTF-8 (apt-get install locales)\n");
    return Outcome::skip;
  }
  auto env = [&](int) {
    return Env{{"LOCPATH", locales},    {"DQ_TEST_LOCALE", "de_DE.UTF-8"},
               {"DYNAMIQ_ENABLE", "1"}, {"DYNAMIQ_DEBUG", "INFO"},
               {"DYNAMIQ_BITS", "4.5"}, {"DYNAMIQ_METRICS_FILE", g_dir + "/locale.%r.prom"}};
  };
  auto body = [&](int rank, ncclComm_t comm) -> int {
    if (std::strcmp(localeconv()->decimal_point, ",") != 0) return 30;  // the locale took
    if (float_calls(n, rank, comm, 1 << 18, 2) != 0) return 31;
    if (rerouted_calls(comm) != 2) return 32;
    if (std::strcmp(localeconv()->decimal_point, ",") != 0) return 33;  // and is the caller's
    const auto flush = reinterpret_cast<int (*)()>(dlsym(RTLD_DEFAULT, "dynamiqMetricsFlush"));
    return flush != nullptr && flush() == 0 ? 0 : 34;
  };
  if (!all_exited_zero(run_ranks(n, env, body), "locale") ||
      !same_decision(n, "compressed: codec dynamiq at 4.5 bits per value", "de_DE locale"))
    return Outcome::fail;
  // Every sample of the metrics text: a name, optional labels, a C-locale number.
  const std::regex sample(
      "[a-zA-Z_:][a-zA-Z0-9_:]*(\\{.*\\})? (-?[0-9]+(\\.[0-9]+)?([eE][-+]?[0-9]+)?|NaN|[-+]Inf)");
  for (int r = 0; r < n; ++r) {
    const std::string text = read_file(g_dir + "/locale." + std::to_string(r) + ".prom");
    std::istringstream lines(text);
    std::string line;
    int samples = 0;
    while (std::getline(lines, line)) {
      if (line.empty() || line[0] == '#') continue;
      ++samples;
      if (!std::regex_match(line, sample))
        return outcome(fail("rank %d's metrics: a sample not in Prometheus' text format: %s", r,
                            line.c_str()));
    }
    if (samples < 10)
      return outcome(fail("rank %d's metrics hold %d samples:\n%s", r, samples, text.c_str()));
    // No warning: before, the start-up check's own specs ("dynamiq:9.5:...") failed to parse and
    // every vector path was refused as a faulty CPU.
    if (count_occurrences(rank_log(r), " WARN ") != 0)
      return outcome(fail("rank %d warned:\n%s", r, rank_log(r).c_str()));
  }
  std::printf(
      "locale: de_DE (decimal comma) on both ranks: 4.5 bits compressed, metrics in C "
      "numbers, the application's locale unchanged\n");
  return Outcome::pass;
}

// The scenario named `scenario`.
Outcome run_scenario(const std::string& scenario) {
  if (scenario == "decision") return outcome(scenario_decision());
  if (scenario == "jobs") return outcome(scenario_jobs());
  if (scenario == "sigterm") return outcome(scenario_sigterm());
  if (scenario == "nccl_range") return outcome(scenario_nccl_range());
  if (scenario == "locale") return scenario_locale();
  return Outcome::unknown;
}

}  // namespace

int main(int argc, char** argv) {
  return dq::shim_test::scenario_main(argc, argv, 2,
                                      "shim_ops decision|jobs|sigterm|nccl_range|locale",
                                      "/tmp/dq-shim-ops-XXXXXX", "", run_scenario);
}

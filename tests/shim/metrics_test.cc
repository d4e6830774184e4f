// The metrics an operator scrapes (metrics file, JSON and Prometheus): what the file holds and
// how it is labelled.
#include <gtest/gtest.h>
#include <pthread.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <regex>
#include <sstream>
#include <thread>

#include "kernels/host_isa.h"
#include "shim/engine/metrics.h"
#include "tests/common/locales.h"

namespace dq::engine {
namespace {

// A process's labels: the job, host and pid only.
ProcessLabels labels_of(const std::string& job, const std::string& host, int pid) {
  ProcessLabels l;
  l.job = job;
  l.host = host;
  l.pid = pid;
  return l;
}

std::shared_ptr<CommMetrics> comm(int index, const std::string& name, uint64_t rerouted) {
  auto c = std::make_shared<CommMetrics>();
  c->index = index;
  c->name = name;
  c->rank = 3;
  c->size = 8;
  c->calls[0] = rerouted;
  c->calls[static_cast<int>(PassReason::kSmall)] = 2;
  c->bytes_in = 4096 * rerouted;
  c->held_bytes = 1000 + index;
  c->window_wait_nanoseconds = 2500000000ull * (index + 1);
  c->plans_made = 40 + index;
  c->replans = 17 + index;
  return c;
}

TEST(Metrics, PrometheusHasHelpTypeAndOneLabelSetOnEverySample) {
  ProcessLabels labels{"job-42", "node7",  1234,   "0.1.0",     "abc1234",
                       "2.28.9", "scalar", "avx2", 1700000000.5};
  const std::string text = metrics_render({comm(0, "dp", 5), comm(1, "tp", 0)}, labels, true);
  int samples = 0;
  std::istringstream lines(text);
  std::string line;
  const std::string process = R"re(job_id="job-42",host="node7",pid="1234")re";
  const std::regex labelled(
      "^dynamiq_\\w+\\{" + process +
      R"re(,comm="[01]",name="(dp|tp)",rank="3"(,outcome="\w+"|,width="\d+"|,collective="\w+",dtype="\w+",count="\d+",root="\d+",codec="\w+")?\} -?[0-9.e+-]+$)re");
  // The process's own samples: what it runs, and when the file was written.
  const std::regex process_sample(
      "^(dynamiq_build_info\\{" + process +
      R"re(,version="0.1.0",git="abc1234",nccl="2.28.9",host_path="scalar",host_paths_refused="avx2"\} 1|dynamiq_last_update_timestamp_seconds\{)re" +
      process + R"re(\} 1700000000.500)$)re");
  int process_samples = 0;
  while (std::getline(lines, line)) {
    if (line.rfind("# ", 0) == 0) continue;
    if (std::regex_match(line, process_sample)) {
      ++process_samples;
      continue;
    }
    ++samples;
    EXPECT_TRUE(std::regex_match(line, labelled)) << line;
  }
  EXPECT_EQ(process_samples, 2) << text;
  // calls, six counters, two gauges (held bytes, compression ratio); the budget's 4 widths, 4
  // vNMSE samples (predicted: calls, sum, latest; the sampled latest), the MX fallback counter,
  // the sampled check's 6 counters.
  EXPECT_EQ(samples, 2 * kPassReasonCount + 2 * 6 + 2 * 2 + 2 * 4 + 2 * 4 + 2 + 2 * 6);
  EXPECT_NE(text.find("# TYPE dynamiq_held_bytes gauge"), std::string::npos);
  for (const char* gauge :
       {"dynamiq_compression_ratio", "dynamiq_predicted_vnmse", "dynamiq_sampled_vnmse",
        "dynamiq_build_info", "dynamiq_last_update_timestamp_seconds"})
    EXPECT_NE(text.find(std::string("# TYPE ") + gauge + " gauge\n"), std::string::npos) << gauge;
  for (const char* name :
       {"dynamiq_calls_total", "dynamiq_rerouted_bytes_in_total",
        "dynamiq_rerouted_wire_bytes_total", "dynamiq_rerouted_seconds_total",
        "dynamiq_window_wait_seconds_total", "dynamiq_plans_made_total", "dynamiq_replans_total"}) {
    EXPECT_NE(text.find(std::string("# HELP ") + name + " "), std::string::npos) << name;
    EXPECT_NE(text.find(std::string("# TYPE ") + name + " counter"), std::string::npos) << name;
  }
  // The textfile collector's conventions: Prometheus sets job and instance itself.
  EXPECT_EQ(text.find("job="), std::string::npos) << text;
  EXPECT_EQ(text.find("instance="), std::string::npos) << text;
  // Two jobs on one node differ in their labels.
  const std::string other =
      metrics_render({comm(0, "dp", 5)}, labels_of("job-43", "node7", 1234), true);
  EXPECT_EQ(other.find("job_id=\"job-42\""), std::string::npos);
}

// Bytes an uncompressed ring all-reduce sends per rank (2 (n-1)/n of the buffers) over the bytes
// sent: 8 ranks, 5 x 4096 bytes in, 4480 bytes sent: 1.75 x 20480 / 4480 = 8.
TEST(Metrics, CompressionRatioAgainstAnUncompressedRing) {
  auto c = comm(0, "dp", 5);
  c->wire_bytes = 4480;
  const std::string text = metrics_render({c}, labels_of("j", "h", 9), true);
  EXPECT_NE(text.find("dynamiq_compression_ratio{job_id=\"j\",host=\"h\",pid=\"9\",comm=\"0\","
                      "name=\"dp\",rank=\"3\"} 8\n"),
            std::string::npos)
      << text;
  const nlohmann::json doc =
      nlohmann::json::parse(metrics_render({c}, labels_of("j", "h", 9), false));
  EXPECT_DOUBLE_EQ(doc["communicators"][0]["compression_ratio"].get<double>(), 8.0);
}

// The metrics' numbers are C's ("0.5") whatever the locale of the thread that renders them: the
// final write at exit runs on the application's thread, and Prometheus cannot read "0,5".
TEST(Metrics, NumbersIgnoreTheThreadsLocale) {
  if (test::comma_locale() == static_cast<locale_t>(nullptr))
    GTEST_SKIP() << "localedef could not make de_DE.UTF-8 (apt-get install locales)";
  auto c = comm(0, "dp", 5);
  const ProcessLabels l = labels_of("j", "h", 9);
  // The one sample that differs between two renders: when it was written.
  const std::regex written("dynamiq_last_update_timestamp_seconds(\\{[^}]*\\})? [^\\n]*");
  auto render = [&](bool prometheus) {
    return std::regex_replace(metrics_render({c}, l, prometheus), written, "written");
  };
  const std::string c_text = render(true);
  ASSERT_TRUE(std::regex_search(c_text, std::regex("\\} [0-9]+\\.[0-9]+")))
      << "no fractional sample to compare:\n"
      << c_text;
  const test::InLocale comma(test::comma_locale());
  char probe[16];
  std::snprintf(probe, sizeof probe, "%.1f", 0.5);
  ASSERT_STREQ(probe, "0,5") << "the thread's locale did not take";
  EXPECT_EQ(render(true), c_text);
  EXPECT_TRUE(nlohmann::json::accept(metrics_render({c}, l, false)));
}

// The host codec's path in both formats: what the process runs now (a path forced after the
// first write included), and the vector paths this CPU has that failed their start-up check.
TEST(Metrics, HostPathInBothFormats) {
  ProcessLabels l = labels_of("j", "h", 9);
  fill_host_path(&l);
  EXPECT_EQ(l.host_path, host_isa_name());
  for (HostIsa isa : {HostIsa::kAvx2, HostIsa::kAvx512})
    EXPECT_EQ(l.host_paths_refused.find(host_isa_name(isa)) != std::string::npos,
              host_isa_refused(isa))
        << host_isa_name(isa);
  const HostIsa before = host_isa();
  ASSERT_TRUE(select_host_isa(HostIsa::kScalar));
  fill_host_path(&l);
  select_host_isa(before);
  EXPECT_EQ(l.host_path, "scalar");
  l.host_paths_refused = "avx2";
  const std::string text = metrics_render({comm(0, "dp", 5)}, l, true);
  EXPECT_NE(text.find(",host_path=\"scalar\",host_paths_refused=\"avx2\"} 1\n"), std::string::npos)
      << text;
  const nlohmann::json doc = nlohmann::json::parse(metrics_render({comm(0, "dp", 5)}, l, false));
  EXPECT_EQ(doc["build"]["host_path"], "scalar");
  EXPECT_EQ(doc["build"]["host_paths_refused"], "avx2");
}

TEST(Metrics, WindowWaitAndPlansInBothFormats) {
  auto c = comm(1, "dp", 5);  // 5 s of waits
  const std::string text = metrics_render({c}, labels_of("j", "h", 9), true);
  EXPECT_NE(text.find("dynamiq_window_wait_seconds_total{job_id=\"j\",host=\"h\",pid=\"9\","
                      "comm=\"1\",name=\"dp\",rank=\"3\"} 5.000000000\n"),
            std::string::npos)
      << text;
  const nlohmann::json doc =
      nlohmann::json::parse(metrics_render({c}, labels_of("j", "h", 9), false));
  EXPECT_DOUBLE_EQ(doc["communicators"][0]["window_wait_seconds"].get<double>(), 5.0);
  EXPECT_EQ(doc["communicators"][0]["plans_made"].get<uint64_t>(), 41u);
  EXPECT_EQ(doc["communicators"][0]["replans"].get<uint64_t>(), 18u);
  EXPECT_NE(text.find("dynamiq_replans_total{job_id=\"j\",host=\"h\",pid=\"9\",comm=\"1\","
                      "name=\"dp\",rank=\"3\"} 18\n"),
            std::string::npos)
      << text;
}

// File names: %j %h %r %p; a directory gets dynamiq-%j-%h-%r.prom; a job without a launcher id
// is named by the first communicator's NCCL commId, the same on every rank and new in every job.
TEST(Metrics, PathPatternsAndAJobNameThatNeverCollides) {
  EXPECT_EQ(metrics_expand_path("/m/%j.%h.%r.%p.%%.%x.prom", "55/7", "node7.example", 3, 99),
            "/m/55_7.node7.3.99.%.%x.prom");
  EXPECT_EQ(metrics_expand_path("/var/lib/node_exporter/", "111", "n", 2, 1),
            "/var/lib/node_exporter/dynamiq-111-n-2.prom");
  const ProcessLabels no_job = labels_of("", "n", 42);
  auto first = comm(0, "dp", 1);
  EXPECT_EQ(metrics_job_name(no_job, {first}), "pid-42");
  auto with_id = comm(1, "tp", 1);
  with_id->comm_id = 0xabcdef;
  EXPECT_EQ(metrics_job_name(no_job, {first, with_id}), "nccl-0000000000abcdef");
  EXPECT_EQ(metrics_job_name(labels_of("slurm-9", "n", 42), {with_id}), "slurm-9");
}

// %r is unique among the job's processes: with tensor parallelism the first communicator can be a
// data-parallel group's, whose rank (here 1) every process of a node shares; the launcher's rank,
// else the rank in the largest communicator (the world's), names the file.
TEST(Metrics, FileRankIsTheProcessRankInTheJob) {
  auto dp = comm(0, "dp", 1), world = comm(1, "world", 1), tp = comm(2, "tp", 1);
  dp->rank = 1;
  dp->size = 2;
  world->rank = 9;
  world->size = 16;
  tp->rank = 1;
  tp->size = 16;  // as large as the world: the first of that size names the file
  ProcessLabels labels = labels_of("j", "n", 42);
  EXPECT_EQ(metrics_file_rank(labels, {}), 42);  // before any communicator: the pid
  EXPECT_EQ(metrics_file_rank(labels, {dp}), 1);
  EXPECT_EQ(metrics_file_rank(labels, {dp, world, tp}), 9);
  labels.launcher_rank = 12;
  EXPECT_EQ(metrics_file_rank(labels, {dp, world, tp}), 12);
  EXPECT_EQ(metrics_file_rank(labels, {}), 12);
  labels.launcher_size = 16;  // a job of 16 launched processes: its rank
  EXPECT_EQ(metrics_file_rank(labels, {dp, world, tp}), 12);
  // A launcher's job of 2 tasks whose processes spawned workers into a 16-rank world (srun with
  // a task a node, then torch.multiprocessing.spawn): every worker of a task has the task's rank,
  // so the world's names the file.
  labels.launcher_rank = 0;
  labels.launcher_size = 2;
  EXPECT_EQ(metrics_file_rank(labels, {dp, world, tp}), 9);
  EXPECT_EQ(metrics_file_rank(labels, {}), 0);  // no communicator yet: the launcher's
  // The launcher's variables, the first that is a rank: RANK over OMPI_COMM_WORLD_RANK.
  for (const char* key : {"RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"})
    unsetenv(key);
  EXPECT_EQ(process_labels().launcher_rank, -1);
  setenv("SLURM_PROCID", "5", 1);
  setenv("SLURM_NTASKS", "8", 1);
  EXPECT_EQ(process_labels().launcher_rank, 5);
  EXPECT_EQ(process_labels().launcher_size, 8);
  setenv("RANK", "x", 1);  // not a rank: the next variable set
  EXPECT_EQ(process_labels().launcher_rank, 5);
  setenv("OMPI_COMM_WORLD_RANK", "7", 1);
  EXPECT_EQ(process_labels().launcher_rank, 7);
  setenv("RANK", "3", 1);
  EXPECT_EQ(process_labels().launcher_rank, 3);
  for (const char* key : {"RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID", "SLURM_NTASKS"})
    unsetenv(key);
  // The file's name as the writes take it: a data-parallel group registered first, then the world.
  const pid_t child = fork();
  if (child == 0) {
    setenv("DYNAMIQ_METRICS_FILE", "/tmp/dq-metrics-rank-%r.json", 1);
    auto first = metrics_register(0, "dp", 1, 2);
    auto all = metrics_register(1, "world", 9, 16);
    std::_Exit(metrics_path_now() == "/tmp/dq-metrics-rank-9.json" ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "the file is not named by rank 9";
}

TEST(Metrics, JsonIsValidWhateverTheCommunicatorIsCalled) {
  const std::string odd = std::string("q\"b\\s\x01n\n") + "\xff\xfe";  // invalid UTF-8 at the end
  const std::string text = metrics_render({comm(0, odd, 1)}, labels_of("j", "h", 9), false);
  nlohmann::json doc;
  ASSERT_NO_THROW(doc = nlohmann::json::parse(text)) << text;
  EXPECT_EQ(doc["job"], "j");
  EXPECT_EQ(doc["communicators"][0]["calls"]["rerouted"], 1);
  EXPECT_EQ(doc["communicators"][0]["bytes_in"], 4096);
  EXPECT_EQ(doc["communicators"][0]["held_bytes"], 1000);
  EXPECT_EQ(doc["communicators"][0]["name"].get<std::string>().substr(0, 7), "q\"b\\s\x01n");
}

TEST(Metrics, JobIdComesFromTheLaunchersEnvironment) {
  setenv("SLURM_JOB_ID", "777", 1);
  EXPECT_EQ(process_labels().job, "777");
  setenv("DYNAMIQ_JOB_ID", "mine", 1);
  EXPECT_EQ(process_labels().job, "mine");
  unsetenv("DYNAMIQ_JOB_ID");
  unsetenv("SLURM_JOB_ID");
  // torchrun without --rdzv-id sets "none" in every job: that names no job.
  setenv("TORCHELASTIC_RUN_ID", "none", 1);
  EXPECT_EQ(process_labels().job, "");
  setenv("TORCHELASTIC_RUN_ID", "e1f2", 1);
  EXPECT_EQ(process_labels().job, "e1f2");
  unsetenv("TORCHELASTIC_RUN_ID");
  EXPECT_EQ(process_labels().pid, static_cast<int>(getpid()));
}

// A destroyed communicator's totals stay in the file, and the file is written at exit.
TEST(Metrics, DestroyedCommunicatorsAndTheExitAreWritten) {
  // A job id longer than a string's inline buffer (16 bytes), in the file's name: the labels the
  // first write read must still be intact when the exit handler runs.
  const std::string prefix = "/tmp/dq-metrics-test-" + std::to_string(getpid());
  const std::string job = "3f2b9c1e-long-elastic-run-id-0123456789abcdef";
  const std::string path = prefix + "-" + job + ".json";
  const pid_t child = fork();
  if (child == 0) {
    setenv("DYNAMIQ_METRICS_FILE", (prefix + "-%j.json").c_str(), 1);
    setenv("DYNAMIQ_JOB_ID", job.c_str(), 1);
    setenv("DYNAMIQ_METRICS_INTERVAL_S", "86400", 1);  // no periodic write: only the two below
    auto gone = metrics_register(0, "gone", 0, 2);
    gone->calls[0] = 11;
    metrics_unregister(gone);
    auto alive = metrics_register(1, "alive", 0, 2);
    alive->calls[0] = 7;  // never unregistered: only the write at exit can carry it
    std::exit(0);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  std::ifstream f(path);
  ASSERT_TRUE(f.good()) << path;
  const nlohmann::json doc = nlohmann::json::parse(f);
  std::remove(path.c_str());
  ASSERT_EQ(doc["communicators"].size(), 2u) << doc.dump();
  EXPECT_EQ(doc["communicators"][0]["name"], "gone");
  EXPECT_EQ(doc["communicators"][0]["destroyed"], true);
  EXPECT_EQ(doc["communicators"][0]["calls"]["rerouted"], 11);
  EXPECT_EQ(doc["communicators"][1]["calls"]["rerouted"], 7);
  EXPECT_EQ(doc["job"], job) << doc.dump();
}

// Virtual memory this process maps now, in bytes (VmSize), or 0.
size_t mapped_bytes() {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line))  // bounded by the file
    if (line.rfind("VmSize:", 0) == 0) return std::stoull(line.substr(7)) * 1024;
  return 0;
}

// A write inside a call, with memory short: the render throws std::bad_alloc. The write is
// skipped and the caller goes on (the interceptor hands the call to NCCL next; an exception would
// skip it on this rank while its peers wait in it).
TEST(Metrics, AWriteWithoutMemoryIsSkippedAndThrowsNothing) {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "the sanitizers map their shadow memory beyond any address-space limit";
#else
  const pid_t child = fork();
  if (child == 0) {
    const std::string path = "/tmp/dq-metrics-oom-" + std::to_string(getpid()) + ".json";
    setenv("DYNAMIQ_METRICS_FILE", path.c_str(), 1);
    setenv("DYNAMIQ_METRICS_INTERVAL_S", "86400", 1);
    // A 64 MiB name: the rendered file needs more than the 16 MiB of address space left.
    auto m = metrics_register(0, std::string(64u << 20, 'x'), 0, 2);
    const size_t now = mapped_bytes();
    if (now == 0) _exit(2);
    const rlimit limit{now + (16u << 20), now + (16u << 20)};
    if (setrlimit(RLIMIT_AS, &limit) != 0) _exit(3);
    metrics_flush();  // threw std::bad_alloc out of here: the child ends with SIGABRT
    std::remove(path.c_str());
    _exit(0);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
      << "status " << status << " (a signal: the write threw; 2, 3: the limit was not set)";
#endif
}

// The file's name moves once the job is known (%j: the pid until a communicator made from a unique
// id registers, as a split subgroup's first call before the world's): the file written under
// the earlier name is removed, not left with stale counters under the same labels.
TEST(Metrics, AMovedFileLeavesNoStaleCopy) {
  const std::string dir = "/tmp/dq-metrics-move-" + std::to_string(getpid()) + "-";
  const pid_t child = fork();
  if (child == 0) {
    setenv("DYNAMIQ_METRICS_FILE", (dir + "%j.json").c_str(), 1);
    setenv("DYNAMIQ_METRICS_INTERVAL_S", "86400", 1);
    for (const char* key : {"DYNAMIQ_JOB_ID", "SLURM_JOB_ID", "TORCHELASTIC_RUN_ID", "PBS_JOBID",
                            "LSB_JOBID", "JOB_ID"})
      unsetenv(key);
    auto split = metrics_register(0, "split", 0, 2);  // made by a split: no unique id
    metrics_flush();
    const std::string first = dir + "pid-" + std::to_string(getpid()) + ".json";
    if (access(first.c_str(), F_OK) != 0) _exit(2);
    auto world = metrics_register(1, "world", 0, 2, 0xabcdef);
    metrics_flush();
    const bool moved = access((dir + "nccl-0000000000abcdef.json").c_str(), F_OK) == 0;
    const bool stale = access(first.c_str(), F_OK) == 0;
    std::remove((dir + "nccl-0000000000abcdef.json").c_str());
    std::remove(first.c_str());
    _exit(!moved ? 3 : stale ? 4 : 0);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
      << "status " << status << " (2: no first file, 3: not moved, 4: the first left behind)";
}

// The handler installed before ours, as SIG_DFL or SIG_IGN through a struct sigaction that kept
// SA_SIGINFO (the kernel keeps the flag): SIGTERM still ends the process, and an ignored one is
// still ignored (the handler field is then 0 or 1, never a function to call).
TEST(Metrics, SignalsChainToADefaultOrIgnoreSetWithSiginfo) {
  for (const bool ignored : {false, true}) {
    const pid_t child = fork();
    if (child == 0) {
      struct sigaction sa {};
      sa.sa_handler = ignored ? SIG_IGN : SIG_DFL;
      sa.sa_flags = SA_SIGINFO;
      sigemptyset(&sa.sa_mask);
      sigaction(SIGTERM, &sa, nullptr);
      setenv("DYNAMIQ_METRICS_FILE", "/dev/null/never", 1);
      metrics_install_signal_write();
      raise(SIGTERM);
      _exit(ignored ? 0 : 3);  // reached only when the signal did not end the process
    }
    int status = 0;
    ASSERT_EQ(waitpid(child, &status, 0), child);
    if (ignored) {
      EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "status " << status;
    } else {
      EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGTERM) << "status " << status;
    }
  }
}

// A periodic write runs on the writer thread: the call that is due (a training thread inside an
// NCCL call) does not wait for it. The write is held 3 s (a thread holds the communicator's budget
// lock, which rendering takes, as a stalled file system would hold it); the tick returns at once
// and the file appears once the hold ends. Before, the tick wrote, and waited, itself.
TEST(Metrics, APeriodicWriteDoesNotHoldTheCall) {
  const std::string path = "/tmp/dq-metrics-periodic-" + std::to_string(getpid()) + ".json";
  std::remove(path.c_str());
  const pid_t child = fork();
  if (child == 0) {
    setenv("DYNAMIQ_METRICS_FILE", path.c_str(), 1);
    setenv("DYNAMIQ_METRICS_INTERVAL_S", "86400", 1);
    auto m = metrics_register(0, "dp", 0, 2);  // installs the writer thread
    std::atomic<bool> held{false};
    std::thread holder([&] {
      std::lock_guard<std::mutex> lock(m->budget_mutex);
      held = true;
      std::this_thread::sleep_for(std::chrono::seconds(3));
    });
    while (!held) std::this_thread::yield();  // bounded: the holder takes the lock at once
    const auto t0 = std::chrono::steady_clock::now();
    metrics_tick();  // the first is due at once
    const double tick_s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    holder.join();
    bool written = false;
    for (int i = 0; i < 1000 && !written; ++i) {  // up to 10 s for the writer thread
      written = access(path.c_str(), F_OK) == 0;
      if (!written) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    std::remove(path.c_str());
    _exit(tick_s > 1.5 ? 2 : !written ? 3 : 0);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
      << "status " << status << " (2: the tick waited for the write, 3: never written)";
}

// A write that fails (the metrics folder made only after the job started) is tried again at the
// next write, and said so: before, the first failure stopped every later write for the rest of
// the job, and dynamiqMetricsFlush still returned 0.
TEST(Metrics, AFailedWriteIsTriedAgain) {
  const std::string dir = "/tmp/dq-metrics-later-" + std::to_string(getpid());
  const pid_t child = fork();
  if (child == 0) {
    setenv("DYNAMIQ_METRICS_FILE", (dir + "/m.json").c_str(), 1);
    setenv("DYNAMIQ_METRICS_INTERVAL_S", "86400", 1);
    auto c = metrics_register(0, "dp", 0, 2);
    if (metrics_flush()) _exit(2);  // no folder yet: the write must report its failure
    if (mkdir(dir.c_str(), 0700) != 0) _exit(3);
    const bool written = metrics_flush() && access((dir + "/m.json").c_str(), F_OK) == 0;
    std::remove((dir + "/m.json").c_str());
    rmdir(dir.c_str());
    _exit(written ? 0 : 4);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
      << "status " << status << " (2: a failed write reported success, 4: not written again)";
}

// The stop's final write outlives what else happens during it. The write is held 1.5 s (a thread
// holds the communicator's budget lock, which rendering takes). Then either a SIGUSR1 handler
// interrupts the SIGTERM handler's wait on the same thread (a data loader's SIGCHLD as its workers
// die of the same stop: poll(2) ends with EINTR), or a second SIGTERM arrives on another thread
// (the launcher's and the scheduler's). The application's own SIGTERM handler, chained after
// ours, must find the file written; before, the first case chained at the interruption and the
// second at once.
std::string g_final_path;
void application_sigterm(int) {
  _exit(access(g_final_path.c_str(), F_OK) == 0 ? 0 : 4);
}
void ignore_usr1(int) {}

TEST(Metrics, TheFinalWriteOutlivesAnInterruptionAndASecondSignal) {
  for (const bool second_sigterm : {false, true}) {
    g_final_path = "/tmp/dq-metrics-final-" + std::to_string(getpid()) + ".json";
    std::remove(g_final_path.c_str());
    const pid_t child = fork();
    if (child == 0) {
      setenv("DYNAMIQ_METRICS_FILE", g_final_path.c_str(), 1);
      setenv("DYNAMIQ_METRICS_INTERVAL_S", "86400", 1);
      signal(SIGUSR1, ignore_usr1);
      signal(SIGTERM, application_sigterm);  // before ours (the first register installs it)
      auto m = metrics_register(0, "dp", 0, 2);
      metrics_install_signal_write();
      std::atomic<bool> held{false};
      std::thread holder([&] {
        std::lock_guard<std::mutex> lock(m->budget_mutex);
        held = true;
        std::this_thread::sleep_for(std::chrono::milliseconds(1500));
      });
      holder.detach();  // the process ends in a signal handler: no thread is joined
      while (!held) std::this_thread::yield();  // bounded: the holder takes the lock at once
      const pthread_t main_thread = pthread_self();
      std::thread([second_sigterm, main_thread] {
        std::this_thread::sleep_for(std::chrono::milliseconds(200));
        if (second_sigterm)
          raise(SIGTERM);  // this thread's own: the main thread's handler is waiting
        else
          pthread_kill(main_thread, SIGUSR1);
      }).detach();
      raise(SIGTERM);
      _exit(5);  // not reached: the application's handler exits
    }
    int status = 0;
    ASSERT_EQ(waitpid(child, &status, 0), child);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
        << (second_sigterm ? "a second SIGTERM on another thread" : "an interrupted wait")
        << ": status " << status << " (4: chained before the final write)";
    std::remove(g_final_path.c_str());
  }
}

// A child forked without exec that exits normally (os.fork() then sys.exit()) runs the exit
// handlers it inherited, and may flush or make NCCL calls first: it must not write its stale copy
// of the counters over the parent's file (nor take the registry's mutex, which another thread
// may have held at the fork).
TEST(Metrics, AForkedChildsExitLeavesTheFileAlone) {
  const std::string path = "/tmp/dq-metrics-fork-" + std::to_string(getpid()) + ".json";
  const pid_t child = fork();
  if (child == 0) {
    setenv("DYNAMIQ_METRICS_FILE", path.c_str(), 1);
    setenv("DYNAMIQ_METRICS_INTERVAL_S", "86400", 1);
    auto c = metrics_register(0, "dp", 0, 2);
    c->calls[0] = 7;
    metrics_flush();
    const pid_t worker = fork();
    if (worker == 0) {
      c->calls[0] = 99;  // the worker's copy
      metrics_flush();   // dynamiqMetricsFlush, dynamiq.counters() in a worker
      metrics_tick();    // an NCCL call through the shim in a worker
      std::exit(0);      // runs the inherited exit handler
    }
    int status = 0;
    if (waitpid(worker, &status, 0) != worker || !WIFEXITED(status)) _exit(2);
    std::ifstream f(path);
    const nlohmann::json doc = nlohmann::json::parse(f, nullptr, false);
    if (doc.is_discarded() || doc["communicators"][0]["calls"]["rerouted"] != 7) _exit(3);
    c->calls[0] = 8;
    std::exit(0);  // this process's own exit writes its totals
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status)) << status;
  EXPECT_NE(WEXITSTATUS(status), 3) << "the worker's exit wrote its copy over the file";
  EXPECT_EQ(WEXITSTATUS(status), 0);
  std::ifstream f(path);
  const nlohmann::json doc = nlohmann::json::parse(f);
  std::remove(path.c_str());
  EXPECT_EQ(doc["communicators"][0]["calls"]["rerouted"], 8) << "the owner's write at exit";
}

// The budget (DYNAMIQ_BITS, DYNAMIQ_TARGET): per bucket its latest budget, the width histogram and
// the predicted vNMSE, in both formats.
TEST(Metrics, BudgetInJsonAndPrometheus) {
  auto c = comm(0, "dp", 3);
  {
    std::lock_guard<std::mutex> lock(c->budget_mutex);
    BudgetMetrics& b = c->budget;
    b.auto_budget = true;
    b.target = "mxfp8";
    b.widths[0] = 10, b.widths[1] = 20, b.widths[2] = 30, b.widths[3] = 1;
    b.predicted_calls = 2;
    b.predicted_vnmse_sum = 0.004;
    b.predicted_vnmse_last = 0.0015;
    b.bits_sum = 13.5;
    b.budget_calls = 2;
    b.mx_calls = 1;
    b.checked_calls = 4;
    b.checked_sq_error = 0.5;
    b.checked_energy = 100;
    b.paired_calls = 2;
    b.paired_predicted_sum = 0.012;
    b.paired_sampled_sum = 0.010;
    BucketMetrics k;
    k.collective = "allreduce";
    k.dtype = "float32";
    k.count = 1048576;
    k.calls = 2;
    k.budget_bits = 7.5;
    k.predicted_vnmse = 0.0015;
    b.buckets.push_back(k);
    k.count = 4096;
    k.budget_bits = 8.25;
    k.codec = "mxfp8";
    b.buckets.push_back(k);
  }
  nlohmann::json doc = nlohmann::json::parse(metrics_render({c}, labels_of("j", "h", 9), false));
  const nlohmann::json& b = doc["communicators"][0]["quantization"];
  EXPECT_EQ(b["auto"], true);
  EXPECT_EQ(b["target"], "mxfp8");
  EXPECT_DOUBLE_EQ(b["mean_bits"].get<double>(), 6.75);
  EXPECT_EQ(b["widths"]["8"], 30);
  EXPECT_EQ(b["predicted_calls"], 2);
  EXPECT_DOUBLE_EQ(b["predicted_vnmse_mean"].get<double>(), 0.002);
  EXPECT_DOUBLE_EQ(b["buckets"][0]["budget_bits"].get<double>(), 7.5);
  EXPECT_EQ(b["buckets"][0]["count"], 1048576);
  EXPECT_EQ(b["buckets"][0]["codec"], "dynamiq");
  EXPECT_EQ(b["buckets"][1]["codec"], "mxfp8");
  EXPECT_EQ(b["mx_calls"], 1);
  EXPECT_EQ(b["check"]["calls"], 4);
  EXPECT_DOUBLE_EQ(b["check"]["sampled_vnmse"].get<double>(), 0.005);
  EXPECT_DOUBLE_EQ(b["check"]["paired_predicted_mean"].get<double>(), 0.006);
  EXPECT_DOUBLE_EQ(b["check"]["paired_sampled_mean"].get<double>(), 0.005);
  const std::string text = metrics_render({c}, labels_of("j", "h", 9), true);
  for (const char* line :
       {"dynamiq_width_supergroups_total{job_id=\"j\",host=\"h\",pid=\"9\",comm=\"0\",name=\"dp\","
        "rank=\"3\",width=\"8\"} 30\n",
        "dynamiq_predicted_calls_total{job_id=\"j\",host=\"h\",pid=\"9\",comm=\"0\",name=\"dp\","
        "rank=\"3\"} 2\n",
        "dynamiq_predicted_vnmse{job_id=\"j\",host=\"h\",pid=\"9\",comm=\"0\",name=\"dp\",rank="
        "\"3\"} "
        "0.0015\n",
        "dynamiq_bucket_budget_bits{job_id=\"j\",host=\"h\",pid=\"9\",comm=\"0\",name=\"dp\","
        "rank=\"3\",collective=\"allreduce\",dtype=\"float32\",count=\"1048576\",root=\"0\","
        "codec=\"dynamiq\"} 7.5\n",
        "dynamiq_bucket_budget_bits{job_id=\"j\",host=\"h\",pid=\"9\",comm=\"0\",name=\"dp\","
        "rank=\"3\",collective=\"allreduce\",dtype=\"float32\",count=\"4096\",root=\"0\","
        "codec=\"mxfp8\"} 8.25\n",
        "dynamiq_mx_fallback_calls_total{job_id=\"j\",host=\"h\",pid=\"9\",comm=\"0\",name=\"dp\","
        "rank=\"3\"} 1\n",
        "# TYPE dynamiq_check_energy_total "
        "counter\ndynamiq_check_energy_total{job_id=\"j\",host=\"h\","
        "pid=\"9\",comm=\"0\",name=\"dp\",rank=\"3\"} 100\n",
        "dynamiq_check_paired_sampled_vnmse_sum_total{job_id=\"j\",host=\"h\",pid=\"9\",comm=\"0\","
        "name=\"dp\",rank=\"3\"} 0.01\n",
        "# TYPE dynamiq_predicted_vnmse gauge\n", "# TYPE dynamiq_bucket_budget_bits gauge\n"})
    EXPECT_NE(text.find(line), std::string::npos) << line << text;
}

}  // namespace
}  // namespace dq::engine

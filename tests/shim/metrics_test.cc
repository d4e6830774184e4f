// The metrics an operator scrapes (metrics file, JSON and Prometheus): what the file holds and
// how it is labelled.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>
#include <sstream>

#include "shim/engine/metrics.h"

namespace dq::engine {
namespace {

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
  return c;
}

TEST(Metrics, PrometheusHasHelpTypeAndOneLabelSetOnEverySample) {
  ProcessLabels labels{"job-42", "node7", 1234};
  const std::string text = metrics_render({comm(0, "dp", 5), comm(1, "tp", 0)}, labels, true);
  int samples = 0;
  std::istringstream lines(text);
  std::string line;
  const std::regex labelled(
      R"re(^dynamiq_\w+\{job="job-42",host="node7",pid="1234",comm="[01]",name="(dp|tp)",rank="3"(,outcome="\w+"|,width="\d+"|,collective="\w+",dtype="\w+",count="\d+",root="\d+",codec="\w+")?\} -?[0-9.e+-]+$)re");
  while (std::getline(lines, line)) {
    if (line.rfind("# ", 0) == 0) continue;
    ++samples;
    EXPECT_TRUE(std::regex_match(line, labelled)) << line;
  }
  // calls, three counters, one gauge; the budget's 4 widths, 3 predicted-vNMSE samples, the MX
  // fallback counter, the sampled check's 6 counters.
  EXPECT_EQ(samples, 2 * kPassReasonCount + 2 * 3 + 2 + 2 * 4 + 2 * 3 + 2 + 2 * 6);
  EXPECT_NE(text.find("# TYPE dynamiq_held_bytes gauge"), std::string::npos);
  for (const char* name : {"dynamiq_calls_total", "dynamiq_rerouted_bytes_in_total",
                           "dynamiq_rerouted_wire_bytes_total", "dynamiq_rerouted_seconds_total"}) {
    EXPECT_NE(text.find(std::string("# HELP ") + name + " "), std::string::npos) << name;
    EXPECT_NE(text.find(std::string("# TYPE ") + name + " counter"), std::string::npos) << name;
  }
  // Two jobs on one node differ in their labels.
  const std::string other = metrics_render({comm(0, "dp", 5)}, {"job-43", "node7", 1234}, true);
  EXPECT_EQ(other.find("job=\"job-42\""), std::string::npos);
}

TEST(Metrics, JsonIsValidWhateverTheCommunicatorIsCalled) {
  const std::string odd = std::string("q\"b\\s\x01n\n") + "\xff\xfe";  // invalid UTF-8 at the end
  const std::string text = metrics_render({comm(0, odd, 1)}, {"j", "h", 9}, false);
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
  EXPECT_EQ(process_labels().pid, static_cast<int>(getpid()));
}

// A destroyed communicator's totals stay in the file, and the file is written at exit.
TEST(Metrics, DestroyedCommunicatorsAndTheExitAreWritten) {
  const std::string path = "/tmp/dq-metrics-test-" + std::to_string(getpid()) + ".json";
  const pid_t child = fork();
  if (child == 0) {
    setenv("DYNAMIQ_METRICS_FILE", path.c_str(), 1);
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
  nlohmann::json doc = nlohmann::json::parse(metrics_render({c}, {"j", "h", 9}, false));
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
  const std::string text = metrics_render({c}, {"j", "h", 9}, true);
  for (const char* line :
       {"dynamiq_width_supergroups_total{job=\"j\",host=\"h\",pid=\"9\",comm=\"0\",name=\"dp\","
        "rank=\"3\",width=\"8\"} 30\n",
        "dynamiq_predicted_calls_total{job=\"j\",host=\"h\",pid=\"9\",comm=\"0\",name=\"dp\","
        "rank=\"3\"} 2\n",
        "dynamiq_predicted_vnmse{job=\"j\",host=\"h\",pid=\"9\",comm=\"0\",name=\"dp\",rank=\"3\"} "
        "0.0015\n",
        "dynamiq_bucket_budget_bits{job=\"j\",host=\"h\",pid=\"9\",comm=\"0\",name=\"dp\","
        "rank=\"3\",collective=\"allreduce\",dtype=\"float32\",count=\"1048576\",root=\"0\","
        "codec=\"dynamiq\"} 7.5\n",
        "dynamiq_bucket_budget_bits{job=\"j\",host=\"h\",pid=\"9\",comm=\"0\",name=\"dp\","
        "rank=\"3\",collective=\"allreduce\",dtype=\"float32\",count=\"4096\",root=\"0\","
        "codec=\"mxfp8\"} 8.25\n",
        "dynamiq_mx_fallback_calls_total{job=\"j\",host=\"h\",pid=\"9\",comm=\"0\",name=\"dp\","
        "rank=\"3\"} 1\n",
        "# TYPE dynamiq_check_energy_total "
        "counter\ndynamiq_check_energy_total{job=\"j\",host=\"h\","
        "pid=\"9\",comm=\"0\",name=\"dp\",rank=\"3\"} 100\n",
        "dynamiq_check_paired_sampled_vnmse_sum_total{job=\"j\",host=\"h\",pid=\"9\",comm=\"0\","
        "name=\"dp\",rank=\"3\"} 0.01\n",
        "# TYPE dynamiq_predicted_vnmse gauge\n", "# TYPE dynamiq_bucket_budget_bits gauge\n"})
    EXPECT_NE(text.find(line), std::string::npos) << line << text;
}

}  // namespace
}  // namespace dq::engine

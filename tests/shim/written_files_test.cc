// The files the shim writes (the metrics file and its temporaries, the debug log with its %
// patterns) in a directory where someone placed symbolic links (and a FIFO) at the names first, as
// another user could in a shared /tmp: the links' target is never written, and a file that cannot
// be written safely gives one warning and is not written again; the job goes on.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "common/log.h"
#include "common/safe_file.h"
#include "shim/engine/metrics.h"
#include "tests/common/text_file.h"

namespace dq {
namespace {

namespace fs = std::filesystem;

const char kPrecious[] = "the target's own content\n";

using test::count_occurrences;
using test::read_file;

// A fresh directory holding `target` (kPrecious), removed at the end.
class WrittenFiles : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/dq-written-files-XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    target_ = dir_ / "target";
    std::ofstream(target_) << kPrecious;
  }
  void TearDown() override { fs::remove_all(dir_); }
  // A symbolic link at `name` (in the directory) to the target.
  fs::path link(const std::string& name) {
    const fs::path p = dir_ / name;
    fs::create_symlink(target_, p);
    return p;
  }
  // Runs `child` in a forked process whose stderr goes to a file; returns that stderr.
  std::string in_child(const std::function<void()>& child) {
    const fs::path err = dir_ / "child.stderr";
    std::fflush(stderr);
    const pid_t pid = fork();
    if (pid == 0) {
      if (std::freopen(err.c_str(), "w", stderr) == nullptr) _exit(3);
      child();
      std::fflush(stderr);
      std::exit(0);  // atexit handlers too (the metrics' final write)
    }
    int status = 0;
    EXPECT_EQ(waitpid(pid, &status, 0), pid);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
    return read_file(err);
  }
  void expect_target_untouched() {
    EXPECT_EQ(read_file(target_), kPrecious);
    EXPECT_TRUE(fs::is_regular_file(fs::symlink_status(target_)));
  }
  // Names in the directory holding ".tmp" (temporaries left behind).
  int temporaries() {
    int n = 0;
    for (const auto& e : fs::directory_iterator(dir_))
      n += e.path().filename().string().find(".tmp") != std::string::npos;
    return n;
  }

  fs::path dir_, target_;
};

TEST_F(WrittenFiles, ReplacingNeverWritesThroughALinkAtTheNameOrAtTheOldTemporaryName) {
  const fs::path out = link("metrics.json");
  // The name the metrics' temporary used to have (the name plus ".tmp" and the pid): predictable.
  link("metrics.json.tmp" + std::to_string(getpid()));
  std::string why;
  ASSERT_TRUE(write_file_replacing(out, "{\"new\": 1}\n", &why)) << why;
  expect_target_untouched();
  // rename(2) replaced the link at the name with the new file.
  EXPECT_TRUE(fs::is_regular_file(fs::symlink_status(out)));
  EXPECT_EQ(read_file(out), "{\"new\": 1}\n");
  EXPECT_EQ(temporaries(), 1);  // the pre-placed link only
}

TEST_F(WrittenFiles, TemporariesAreFreshNames) {
  std::string a, b, why;
  const int fa = create_temporary_beside(dir_ / "m", &a, &why);
  const int fb = create_temporary_beside(dir_ / "m", &b, &why);
  ASSERT_GE(fa, 0) << why;
  ASSERT_GE(fb, 0) << why;
  close(fa);
  close(fb);
  EXPECT_NE(a, b);
  // A temporary is never an existing name: a link placed at a name that was handed out once
  // makes that exact name fail (O_EXCL), not open the target.
  fs::remove(a);
  fs::create_symlink(target_, a);
  EXPECT_LT(open(a.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW, 0644), 0);
  expect_target_untouched();
}

TEST_F(WrittenFiles, OutputRefusesALinkAndAFifoWithoutBlocking) {
  std::string why;
  EXPECT_EQ(open_output_nofollow(link("log"), true, true, &why), -1);
  EXPECT_NE(why.find("symbolic link"), std::string::npos) << why;
  expect_target_untouched();
  const fs::path fifo = dir_ / "fifo";
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(open_output_nofollow(fifo, false, true, &why), -1);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
  const int fd = open_output_nofollow(dir_ / "plain", true, true, &why);
  EXPECT_GE(fd, 0) << why;
  if (fd >= 0) close(fd);
}

// DYNAMIQ_DEBUG_FILE with %p: a link at the expanded name is not followed; one warning, the
// lines go to stderr.
TEST_F(WrittenFiles, DebugLogDoesNotFollowALinkAtItsName) {
  const std::string err = in_child([&] {
    link("log." + std::to_string(getpid()));
    LogConfig config;
    config.file_pattern = (dir_ / "log.%p").string();
    log_configure(config);
    DQ_WARN(Subsys::kCore, "first line");
    DQ_WARN(Subsys::kCore, "second line");
  });
  expect_target_untouched();
  EXPECT_EQ(count_occurrences(err, "symbolic link"), 1) << err;
  EXPECT_EQ(count_occurrences(err, "first line"), 1) << err;
  EXPECT_EQ(count_occurrences(err, "second line"), 1) << err;
}

// DYNAMIQ_METRICS_FILE with links at its name and at the old temporary name: the target stays,
// the file is written (in place of the link).
TEST_F(WrittenFiles, MetricsFileDoesNotWriteThroughLinks) {
  const fs::path path = dir_ / "metrics.json";
  const std::string err = in_child([&] {
    link("metrics.json");
    link("metrics.json.tmp" + std::to_string(getpid()));
    setenv("DYNAMIQ_METRICS_FILE", path.c_str(), 1);
    setenv("DYNAMIQ_METRICS_INTERVAL_S", "86400", 1);
    auto m = engine::metrics_register(0, "dp", 0, 2);
    m->calls[0] = 5;
    engine::metrics_unregister(m);
  });
  expect_target_untouched();
  ASSERT_TRUE(fs::is_regular_file(fs::symlink_status(path))) << err;
  const nlohmann::json doc = nlohmann::json::parse(read_file(path));
  EXPECT_EQ(doc["communicators"][0]["calls"]["rerouted"], 5) << doc.dump();
  EXPECT_EQ(temporaries(), 1) << err;  // the pre-placed link only
}

// A metrics file that cannot be written (its directory is missing): one warning, whatever the
// number of writes, and the process goes on.
TEST_F(WrittenFiles, MetricsFileThatCannotBeWrittenWarnsOnce) {
  const std::string err = in_child([&] {
    setenv("DYNAMIQ_METRICS_FILE", (dir_ / "missing" / "metrics.json").c_str(), 1);
    setenv("DYNAMIQ_METRICS_INTERVAL_S", "86400", 1);
    auto m = engine::metrics_register(0, "dp", 0, 2);
    for (int k = 0; k < 3; ++k) engine::metrics_flush();
    engine::metrics_unregister(m);
  });
  EXPECT_EQ(count_occurrences(err, "metrics file"), 1) << err;
  EXPECT_EQ(count_occurrences(err, "WARN"), 1) << err;
}

}  // namespace
}  // namespace dq

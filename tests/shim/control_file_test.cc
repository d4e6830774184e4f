// The A/B switch file (shim/engine/control_file.h): its text, and when rank 0 reads it again.
#include "shim/engine/control_file.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>

namespace dq::engine {
namespace {

TEST(SwitchText, OnOffAndNothingElse) {
  for (const char* text : {"", "1", "on", " ON\n", "true\r\n"}) {
    bool on = false;
    EXPECT_TRUE(parse_switch(text, &on)) << text;
    EXPECT_TRUE(on) << text;
  }
  for (const char* text : {"0", "off", "False\n", "  0  "}) {
    bool on = true;
    EXPECT_TRUE(parse_switch(text, &on)) << text;
    EXPECT_FALSE(on) << text;
  }
  bool on = true;
  EXPECT_FALSE(parse_switch("2", &on));
  EXPECT_FALSE(parse_switch("of", &on));
}

class SwitchFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char dir[] = "/tmp/dq-switch-XXXXXX";
    ASSERT_NE(mkdtemp(dir), nullptr);
    dir_ = dir;
    path_ = dir_ + "/switch";
  }
  void TearDown() override {
    std::remove(path_.c_str());
    rmdir(dir_.c_str());
  }
  // Writes `text` (truncating) and sets the file's modification time to `mtime` (s).
  void write(const char* text, time_t mtime) {
    std::FILE* f = std::fopen(path_.c_str(), "w");
    ASSERT_NE(f, nullptr);
    std::fputs(text, f);
    std::fclose(f);
    const timespec times[2] = {{mtime, 0}, {mtime, 0}};
    ASSERT_EQ(utimensat(AT_FDCWD, path_.c_str(), times, 0), 0);
  }
  std::string dir_, path_;
};

TEST_F(SwitchFileTest, FollowsTheFile) {
  SwitchFile sw(path_);
  EXPECT_TRUE(sw.read());  // missing: on
  write("0\n", 1000);
  EXPECT_FALSE(sw.read());
  write("on", 1001);
  EXPECT_TRUE(sw.read());
  write("nonsense", 1002);
  EXPECT_TRUE(sw.read());  // kept
  std::remove(path_.c_str());
  EXPECT_TRUE(sw.read());
}

// A file at the path that cannot be read (a folder here; a mode the job's user cannot read
// elsewhere) keeps the switch as it was: read as empty, it would turn compression on.
TEST_F(SwitchFileTest, AnUnreadableFileKeepsTheState) {
  SwitchFile sw(path_);
  write("0\n", 1000);
  EXPECT_FALSE(sw.read());
  ASSERT_EQ(std::remove(path_.c_str()), 0);
  ASSERT_EQ(mkdir(path_.c_str(), 0700), 0);
  EXPECT_FALSE(sw.read());
  EXPECT_FALSE(sw.read());
  ASSERT_EQ(rmdir(path_.c_str()), 0);
  EXPECT_TRUE(sw.read());  // missing: on
}

// A path that cannot be examined (a loop of symbolic links here; a folder the job cannot search,
// an NFS server's ESTALE or EIO elsewhere) says nothing of the switch: it keeps its state, where
// it used to read as missing, which means on. A missing file still means on.
TEST_F(SwitchFileTest, APathThatCannotBeExaminedKeepsTheState) {
  SwitchFile sw(path_);
  write("0\n", 1000);
  EXPECT_FALSE(sw.read());
  ASSERT_EQ(std::remove(path_.c_str()), 0);
  ASSERT_EQ(symlink(path_.c_str(), path_.c_str()), 0);  // stat: ELOOP
  EXPECT_FALSE(sw.read());
  EXPECT_FALSE(sw.read());
  ASSERT_EQ(std::remove(path_.c_str()), 0);
  EXPECT_TRUE(sw.read());  // missing: on
}

// A change that leaves the size, the modification time and the inode as they were (a chmod that
// makes an unreadable file readable again; here a rewrite of the same length with its time set
// back) changes the status time: the file is read again.
TEST_F(SwitchFileTest, AChangeSeenOnlyInTheStatusTimeIsRead) {
  SwitchFile sw(path_);
  write("0\n", 3000);
  EXPECT_FALSE(sw.read());
  std::this_thread::sleep_for(std::chrono::milliseconds(20));  // a later status time
  write("1\n", 3000);
  EXPECT_TRUE(sw.read());
}

// `echo 0 > file` truncates, then writes. Read between the two within one tick of a coarse file
// clock, the file is empty (on) and its modification time does not change with the write: the
// write must still be read.
TEST_F(SwitchFileTest, AWriteInTheTickOfItsTruncationIsRead) {
  SwitchFile sw(path_);
  write("", 2000);
  EXPECT_TRUE(sw.read());
  write("0\n", 2000);  // the same modification time
  EXPECT_FALSE(sw.read());
}

}  // namespace
}  // namespace dq::engine

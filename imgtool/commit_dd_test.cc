// RunCommit and RunDd called directly (so the unit-test runs under ASan
// cover them and qcow2::Qcow2Node::MakeEmpty): commit puts the top's data
// into the base and empties the top, -d keeps it, -b commits a deeper chain,
// qemu-img 7.2's messages; dd copies with bs, count and skip. The
// byte-for-byte comparisons with qemu-img are testing/commit_oracle_test.sh
// and testing/dd_oracle_test.sh.
#include <unistd.h>

#include <cstdio>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "gtest/gtest.h"
#include "imgtool/command.h"
#include "imgtool/testing/command_runner.h"

namespace imgtool::cli {
namespace {

using testing::CommandResult;
using testing::FileSize;
using testing::MakeSparseFile;
using testing::MakeTestDir;
using testing::ReadFile;
using testing::WriteBytes;

constexpr uint64_t kSize = 4 << 20;

CommandResult RunCmd(CommandFn fn, const std::vector<std::string>& args) {
  return testing::RunCommand(fn, args);
}

// What the guest reads from `image`, as raw bytes.
std::string GuestView(const std::string& image) {
  std::remove("view.raw");
  CommandResult r = RunCmd(RunConvert, {"-O", "raw", image, "view.raw"});
  EXPECT_TRUE(r.status.ok()) << r.stderr_text();
  return ReadFile("view.raw");
}

class CommitTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_EQ(chdir(MakeTestDir().c_str()), 0);
    // base.qcow2 <- mid.qcow2 <- top.qcow2, each with data of its own, a
    // zero cluster in the top over the base's data.
    ASSERT_TRUE(RunCmd(RunCreate, {"-q", "-f", "qcow2", "base.qcow2", "4M"})
                    .status.ok());
    Io("base.qcow2", "write -P 0x11 0 1M");
    ASSERT_TRUE(RunCmd(RunCreate, {"-q", "-f", "qcow2", "-b", "base.qcow2", "-F",
                                "qcow2", "mid.qcow2"})
                    .status.ok());
    Io("mid.qcow2", "write -P 0x22 2M 64k");
    ASSERT_TRUE(RunCmd(RunCreate, {"-q", "-f", "qcow2", "-b", "mid.qcow2", "-F",
                                "qcow2", "top.qcow2"})
                    .status.ok());
    Io("top.qcow2", "write -P 0x33 64k 64k");
    Io("top.qcow2", "write -z 512k 64k");
  }

  static void Io(const std::string& image, const std::string& command) {
    CommandResult r = RunCmd(RunIo, {"-f", "qcow2", "-c", command, image});
    ASSERT_TRUE(r.status.ok()) << r.stderr_text();
  }
};

TEST_F(CommitTest, IntoTheBackingFileThenEmptiesTheTop) {
  const std::string view = GuestView("top.qcow2");
  CommandResult r = RunCmd(RunCommit, {"top.qcow2"});
  ASSERT_TRUE(r.status.ok()) << r.stderr_text();
  EXPECT_EQ(r.out, "Image committed.\n");
  // The top is empty (header, refcount table and block, L1 table: 4
  // clusters) and reads as its backing file, which now has its data.
  EXPECT_EQ(FileSize("top.qcow2"), 4u * 65536);
  EXPECT_EQ(GuestView("top.qcow2"), view);
  EXPECT_EQ(GuestView("mid.qcow2"), view);
  CommandResult check = RunCmd(RunCheck, {"-q", "top.qcow2"});
  EXPECT_TRUE(check.status.ok()) << check.stderr_text();
  check = RunCmd(RunCheck, {"-q", "mid.qcow2"});
  EXPECT_TRUE(check.status.ok()) << check.stderr_text();
}

TEST_F(CommitTest, DropKeepsTheTop) {
  const std::string top = ReadFile("top.qcow2");
  CommandResult r = RunCmd(RunCommit, {"-q", "-d", "top.qcow2"});
  ASSERT_TRUE(r.status.ok()) << r.stderr_text();
  EXPECT_EQ(r.out, "");
  EXPECT_EQ(ReadFile("top.qcow2"), top);
}

TEST_F(CommitTest, DeeperBaseGetsEveryLayerAbove) {
  const std::string view = GuestView("top.qcow2");
  const std::string top = ReadFile("top.qcow2");
  const std::string mid = ReadFile("mid.qcow2");
  CommandResult r = RunCmd(RunCommit, {"-p", "-b", "base.qcow2", "top.qcow2"});
  ASSERT_TRUE(r.status.ok()) << r.stderr_text();
  EXPECT_EQ(r.out.substr(0, 16), "    (0.00/100%)\r");
  EXPECT_NE(r.out.find("    (100.00/100%)\r\nImage committed.\n"),
            std::string::npos)
      << r.out;
  EXPECT_EQ(GuestView("base.qcow2"), view);
  // -b implies -d; the images in between are left as they were.
  EXPECT_EQ(ReadFile("top.qcow2"), top);
  EXPECT_EQ(ReadFile("mid.qcow2"), mid);
}

TEST_F(CommitTest, Errors) {
  CommandResult r = RunCmd(RunCommit, {"base.qcow2"});
  EXPECT_EQ(r.status.message(), "Image does not have a backing file");
  r = RunCmd(RunCommit, {"-b", "nothere.qcow2", "top.qcow2"});
  EXPECT_EQ(r.status.message(),
            "Did not find 'nothere.qcow2' in the backing chain of "
            "'top.qcow2'");
  r = RunCmd(RunCommit, {"-t", "bogus", "top.qcow2"});
  EXPECT_EQ(r.status.message(), "Invalid cache option: bogus");
  r = RunCmd(RunCommit, {"a", "b"});
  EXPECT_EQ(r.status.message(), "Expecting one image file name");
}

class DdTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_EQ(chdir(MakeTestDir().c_str()), 0);
    MakeSparseFile("in.raw", kSize);
    WriteBytes("in.raw", 0, 8192, 0x44);
    WriteBytes("in.raw", 1 << 20, 4096, 0x55);
  }
};

TEST_F(DdTest, CopiesWithBlockSizeCountAndSkip) {
  CommandResult r = RunCmd(RunDd, {"if=in.raw", "of=out.raw"});
  ASSERT_TRUE(r.status.ok()) << r.stderr_text();
  EXPECT_EQ(ReadFile("out.raw"), ReadFile("in.raw"));
  // count counts from the input's start, the skipped blocks included.
  r = RunCmd(RunDd, {"bs=4k", "skip=1", "count=3", "if=in.raw", "of=a.raw"});
  ASSERT_TRUE(r.status.ok()) << r.stderr_text();
  EXPECT_EQ(ReadFile("a.raw"), ReadFile("in.raw").substr(4096, 8192));
  // A block size that is not whole sectors: block by block.
  r = RunCmd(RunDd, {"bs=1000", "skip=1", "count=3", "if=in.raw", "of=b.raw"});
  ASSERT_TRUE(r.status.ok()) << r.stderr_text();
  EXPECT_EQ(FileSize("b.raw"), 2048u);  // 2000 bytes, rounded up
  EXPECT_EQ(ReadFile("b.raw").substr(0, 2000),
            ReadFile("in.raw").substr(1000, 2000));
  r = RunCmd(RunDd, {"-O", "qcow2", "bs=64k", "count=20", "if=in.raw",
                  "of=c.qcow2"});
  ASSERT_TRUE(r.status.ok()) << r.stderr_text();
  EXPECT_EQ(GuestView("c.qcow2"), ReadFile("in.raw").substr(0, 20 << 16));
}

TEST_F(DdTest, Errors) {
  CommandResult r = RunCmd(RunDd, {"if=in.raw"});
  EXPECT_EQ(r.status.message(), "Must specify both input and output files");
  r = RunCmd(RunDd, {"bs=0", "if=in.raw", "of=x.raw"});
  EXPECT_EQ(r.status.message(),
            "Invalid bs specified. Must be between 1 and 2147483647.");
  r = RunCmd(RunDd, {"foo=1", "if=in.raw", "of=x.raw"});
  EXPECT_EQ(r.status.message(), "unrecognized operand foo");
  r = RunCmd(RunDd, {"-O", "bogus", "if=in.raw", "of=x.raw"});
  EXPECT_EQ(r.status.message(), "Unknown file format");
  // Skipping past the end: a message, an empty output, success.
  r = RunCmd(RunDd, {"skip=100000", "if=in.raw", "of=y.raw"});
  EXPECT_TRUE(r.status.ok());
  EXPECT_EQ(r.err, "imgtool: in.raw: cannot skip to specified offset\n");
  EXPECT_EQ(FileSize("y.raw"), 0u);
}

}  // namespace
}  // namespace imgtool::cli

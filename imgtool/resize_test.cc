// RunResize called directly: qemu-img 7.2's messages and the file it
// leaves (old data kept, new range reading as zeroes).
#include <unistd.h>

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "imgtool/command.h"
#include "imgtool/testing/command_runner.h"
#include "io/engine.h"
#include "posix_file/file_node.h"

namespace imgtool::cli {
namespace {

using testing::AllocatedBytes;
using testing::CommandResult;
using testing::FileSize;
using testing::MakeSparseFile;
using testing::MakeTestDir;
using testing::ReadFile;
using testing::WriteBytes;

constexpr char kProbeWarning[] =
    "WARNING: Image format was not specified for 'x.raw' and probing guessed "
    "raw.\n"
    "         Automatically detecting the format is dangerous for raw images, "
    "write operations on block 0 will be restricted.\n"
    "         Specify the 'raw' format explicitly to remove the "
    "restrictions.\n";

constexpr char kShrinkError[] =
    "imgtool: Use the --shrink option to perform a shrink operation.\n"
    "imgtool: warning: Shrinking an image will delete all data beyond the "
    "shrunken image's end. Before performing such an operation, make sure "
    "there is no important data there.\n";

class ResizeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_EQ(chdir(MakeTestDir().c_str()), 0);
    MakeSparseFile("x.raw", 1 << 20);
    WriteBytes("x.raw", 0, 4096, 0xaa);
    WriteBytes("x.raw", (1 << 20) - 4096, 4096, 0xbb);
    original_ = ReadFile("x.raw");
  }
  static CommandResult Resize(const std::vector<std::string>& args) {
    return testing::RunCommand(RunResize, args);
  }
  // The file still starts with the original 1 MiB and the rest is zero.
  void ExpectGrownFrom1M(uint64_t size) {
    const std::string now = ReadFile("x.raw");
    ASSERT_EQ(now.size(), size);
    EXPECT_TRUE(now.compare(0, original_.size(), original_) == 0);
    EXPECT_EQ(now.find_first_not_of('\0', original_.size()),
              std::string::npos);
  }
  std::string original_;
};

TEST_F(ResizeTest, GrowsKeepingData) {
  CommandResult r = Resize({"-f", "raw", "x.raw", "3M"});
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_EQ(r.out, "Image resized.\n");
  EXPECT_EQ(r.err, "");
  ExpectGrownFrom1M(3 << 20);
}

// qcow2: the header's size changes, data is kept; sizes must be whole
// sectors; metadata preallocation is a qcow2 mode; no probing warning.
TEST_F(ResizeTest, Qcow2) {
  ASSERT_TRUE(testing::RunCommand(RunCreate, {"-q", "-f", "qcow2", "q.qcow2",
                                              "1M"})
                  .status.ok());
  ASSERT_TRUE(testing::RunCommand(RunIo, {"-c", "write -q -P 7 0 64k",
                                          "q.qcow2"})
                  .status.ok());
  auto virtual_size = [] {
    const std::string head = ReadFile("q.qcow2").substr(24, 8);
    uint64_t v = 0;
    for (char c : head) v = (v << 8) | static_cast<uint8_t>(c);
    return v;
  };
  CommandResult r = Resize({"q.qcow2", "+1M"});
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_EQ(r.out, "Image resized.\n");
  EXPECT_EQ(r.err, "");
  EXPECT_EQ(virtual_size(), 2u << 20);
  r = Resize({"q.qcow2", "+1000"});
  EXPECT_EQ(r.stderr_text(),
            "imgtool: The new size must be a multiple of 512\n");
  EXPECT_EQ(Resize({"q.qcow2", "1M"}).stderr_text(), kShrinkError);
  r = Resize({"--preallocation=metadata", "q.qcow2", "4M"});
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_EQ(virtual_size(), 4u << 20);
  r = Resize({"--shrink", "q.qcow2", "64k"});
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_EQ(virtual_size(), 64u << 10);
  r = testing::RunCommand(RunIo, {"-c", "read -q -P 7 0 64k", "q.qcow2"});
  EXPECT_TRUE(r.status.ok()) << r.out;
  EXPECT_EQ(r.out, "");
}

TEST_F(ResizeTest, ProbedImageWarnsLikeQemuImg) {
  CommandResult r = Resize({"x.raw", "+1M"});
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_EQ(r.err, kProbeWarning);
  EXPECT_EQ(r.out, "Image resized.\n");
  ExpectGrownFrom1M(2 << 20);
}

TEST_F(ResizeTest, PreallocatedGrowthKeepsDataAndReadsZero) {
  for (const char* mode : {"falloc", "full"}) {
    SCOPED_TRACE(mode);
    SetUp();
    CommandResult r = Resize({"-f", "raw", "-q",
                              std::string("--preallocation=") + mode, "x.raw",
                              "+4M"});
    ASSERT_TRUE(r.status.ok()) << r.status;
    EXPECT_EQ(r.out, "");
    ExpectGrownFrom1M(5 << 20);
    EXPECT_GE(AllocatedBytes("x.raw"), 4u << 20);
  }
}

TEST_F(ResizeTest, ShrinkNeedsTheShrinkOption) {
  for (const char* size : {"512K", "-512K"}) {
    CommandResult r = Resize({"-f", "raw", "x.raw", size});
    EXPECT_EQ(r.stderr_text(), kShrinkError) << size;
    EXPECT_EQ(r.out, "");
    EXPECT_EQ(ReadFile("x.raw"), original_);
  }
  CommandResult r = Resize({"-f", "raw", "--shrink", "x.raw", "--", "-512K"});
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_EQ(ReadFile("x.raw"), original_.substr(0, 512 << 10));
}

TEST_F(ResizeTest, SizeMustStayPositive) {
  for (const char* size : {"0", "-1M", "-10M", "9E", "+9E"}) {
    CommandResult r = Resize({"-f", "raw", "--shrink", "x.raw", size});
    EXPECT_EQ(r.stderr_text(), "imgtool: New image size must be positive\n")
        << size;
  }
  EXPECT_EQ(ReadFile("x.raw"), original_);
}

TEST_F(ResizeTest, PreallocationOnlyForGrowing) {
  for (const char* size : {"1M", "512K"}) {
    CommandResult r = Resize(
        {"-f", "raw", "--shrink", "--preallocation=full", "x.raw", size});
    EXPECT_EQ(r.stderr_text(),
              "imgtool: Preallocation can only be used for growing images\n");
  }
  EXPECT_EQ(Resize({"--preallocation=foo", "x.raw", "2M"}).stderr_text(),
            "imgtool: Invalid preallocation mode 'foo'\n");
  CommandResult r =
      Resize({"-f", "raw", "--preallocation=metadata", "x.raw", "2M"});
  EXPECT_EQ(r.stderr_text(),
            "imgtool: Unsupported preallocation mode: metadata\n");
  EXPECT_EQ(ReadFile("x.raw"), original_);
}

TEST_F(ResizeTest, CurrentSizeIsRoundedUpTo512) {
  MakeSparseFile("x.raw", 1048676);
  // qemu-img's current size is 1049088, so "+0" grows the file to it...
  ASSERT_TRUE(Resize({"-f", "raw", "x.raw", "+0"}).status.ok());
  EXPECT_EQ(FileSize("x.raw"), 1049088u);
  // ...while exact byte sizes are kept.
  ASSERT_TRUE(Resize({"-f", "raw", "x.raw", "+1"}).status.ok());
  EXPECT_EQ(FileSize("x.raw"), 1049089u);
}

TEST_F(ResizeTest, ArgumentErrors) {
  const std::string tail =
      "Usage: imgtool resize [-q] [-f FMT] [--preallocation=MODE] [--shrink] "
      "FILE [+|-]SIZE\n"
      "Try 'imgtool --help' for more information\n";
  EXPECT_EQ(Resize({"x.raw"}).stderr_text(),
            "imgtool: Not enough arguments\n" + tail);
  EXPECT_EQ(Resize({"-q", "x.raw"}).stderr_text(),
            "imgtool: Expecting image file name and size\n" + tail);
  EXPECT_EQ(Resize({"x.raw", "1M", "2M"}).stderr_text(),
            "imgtool: Expecting image file name and size\n" + tail);
  EXPECT_EQ(Resize({"-U", "x.raw", "2M"}).stderr_text(),
            "imgtool: unrecognized option '-U'\n" + tail);
  EXPECT_EQ(Resize({"-f", "raw", "x.raw", "1x"}).stderr_text(),
            "imgtool: Parameter 'size' expects a non-negative number below "
            "2^64\n"
            "Optional suffix k, M, G, T, P or E means kilo-, mega-, giga-, "
            "tera-, peta-\n"
            "and exabytes, respectively.\n");
  EXPECT_EQ(Resize({"nonexist", "1M"}).stderr_text(),
            "imgtool: Could not open 'nonexist': Could not open 'nonexist': "
            "No such file or directory\n");
  EXPECT_EQ(ReadFile("x.raw"), original_);
}

TEST_F(ResizeTest, LockedImageIsLeftAlone) {
  auto engine = io::CreateEngine(io::EngineKind::kThreads, 4, nullptr);
  ASSERT_TRUE(engine.ok()) << engine.status();
  posix_file::FileOpenOptions options;
  options.set_filename("x.raw");
  auto holder = posix_file::FileNode::Open(**engine, options, nullptr);
  ASSERT_TRUE(holder.ok()) << holder.status();

  CommandResult r = Resize({"-f", "raw", "x.raw", "2M"});
  EXPECT_EQ(r.status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(r.stderr_text(),
            "imgtool: Could not open 'x.raw': Failed to get \"write\" lock\n"
            "Is another process using the image [x.raw]?\n");
  EXPECT_EQ(r.out, "");
  EXPECT_EQ(ReadFile("x.raw"), original_);
  ASSERT_TRUE(io::RunSync(**engine, (*holder)->Close()).ok());
}

}  // namespace
}  // namespace imgtool::cli

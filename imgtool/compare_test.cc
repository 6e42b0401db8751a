// RunCompare called directly: qemu-img 7.2's messages (on stdout) and exit
// codes for identical images, differing content, size mismatches with a
// zero or a data tail, strict mode, and open errors.
#include <unistd.h>

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "imgtool/command.h"
#include "imgtool/testing/command_runner.h"

namespace imgtool::cli {
namespace {

using testing::CommandResult;
using testing::MakeSparseFile;
using testing::MakeTestDir;
using testing::WriteBytes;

constexpr uint64_t kKiB = 1024;
constexpr uint64_t kMiB = 1024 * 1024;

class CompareTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_EQ(chdir(MakeTestDir().c_str()), 0);
    // a.raw: 4 MiB, data at [1M, 1M+64K) and [3M, 3M+4K).
    MakeSparseFile("a.raw", 4 * kMiB);
    WriteBytes("a.raw", 1 * kMiB, 64 * kKiB, 'a');
    WriteBytes("a.raw", 3 * kMiB, 4 * kKiB, 'b');
    // b.raw: the same content, fully allocated.
    WriteBytes("b.raw", 0, 4 * kMiB, 0);
    WriteBytes("b.raw", 1 * kMiB, 64 * kKiB, 'a');
    WriteBytes("b.raw", 3 * kMiB, 4 * kKiB, 'b');
  }

  static CommandResult Compare(const std::vector<std::string>& args) {
    return testing::RunCommand(RunCompare, args);
  }

  // The command reported on stdout and asks for `exit_code` without
  // another message.
  static void ExpectSilentExit(const CommandResult& r, int exit_code) {
    EXPECT_FALSE(r.status.ok());
    EXPECT_EQ(r.status.message(), "");
    EXPECT_EQ(ExitCodeOf(r.status), exit_code);
    EXPECT_EQ(r.err, "");
  }
};

TEST_F(CompareTest, IdenticalImages) {
  CommandResult r = Compare({"a.raw", "b.raw"});
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_EQ(r.out, "Images are identical.\n");
  EXPECT_EQ(r.err, "");
  r = Compare({"-f", "raw", "-F", "raw", "-U", "-T", "none", "b.raw", "a.raw"});
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_EQ(r.out, "Images are identical.\n");
}

TEST_F(CompareTest, MismatchIsReportedAtItsSector) {
  WriteBytes("b.raw", 1 * kMiB + 5000, 1, 'x');
  CommandResult r = Compare({"a.raw", "b.raw"});
  EXPECT_EQ(r.out, "Content mismatch at offset 1053184!\n");  // 1M + 4608
  ExpectSilentExit(r, 1);
  // Data where the other image has a hole.
  WriteBytes("a.raw", 2 * kMiB + 700, 1, 'y');
  r = Compare({"b.raw", "a.raw"});
  EXPECT_EQ(r.out, "Content mismatch at offset 1053184!\n");
  WriteBytes("b.raw", 1 * kMiB + 5000, 1, 'a');
  r = Compare({"a.raw", "b.raw"});
  EXPECT_EQ(r.out, "Content mismatch at offset 2097664!\n");  // 2M + 512
  ExpectSilentExit(r, 1);
}

TEST_F(CompareTest, SizeMismatchWithZeroTailIsIdentical) {
  MakeSparseFile("long.raw", 6 * kMiB);
  WriteBytes("long.raw", 1 * kMiB, 64 * kKiB, 'a');
  WriteBytes("long.raw", 3 * kMiB, 4 * kKiB, 'b');
  WriteBytes("long.raw", 5 * kMiB, 64 * kKiB, 0);  // zero-filled data
  CommandResult r = Compare({"a.raw", "long.raw"});
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_EQ(r.out, "Warning: Image size mismatch!\nImages are identical.\n");
  r = Compare({"long.raw", "b.raw"});
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_EQ(r.out, "Warning: Image size mismatch!\nImages are identical.\n");
}

TEST_F(CompareTest, SizeMismatchWithDataTailDiffers) {
  MakeSparseFile("long.raw", 6 * kMiB);
  WriteBytes("long.raw", 1 * kMiB, 64 * kKiB, 'a');
  WriteBytes("long.raw", 3 * kMiB, 4 * kKiB, 'b');
  WriteBytes("long.raw", 5 * kMiB + 4097, 1, 'z');
  CommandResult r = Compare({"long.raw", "a.raw"});
  EXPECT_EQ(r.out,
            "Warning: Image size mismatch!\n"
            "Content mismatch at offset 5246976!\n");  // 5M + 4096
  ExpectSilentExit(r, 1);
}

TEST_F(CompareTest, StrictMode) {
  // Same content, different allocation.
  CommandResult r = Compare({"-s", "a.raw", "b.raw"});
  EXPECT_EQ(r.out, "Strict mode: Offset 0 block status mismatch!\n");
  ExpectSilentExit(r, 1);
  // Same allocation.
  r = Compare({"-s", "a.raw", "a.raw"});
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_EQ(r.out, "Images are identical.\n");
  // Different sizes.
  MakeSparseFile("long.raw", 5 * kMiB);
  r = Compare({"-s", "a.raw", "long.raw"});
  EXPECT_EQ(r.out, "Strict mode: Image size mismatch!\n");
  ExpectSilentExit(r, 1);
}

TEST_F(CompareTest, QuietPrintsNothing) {
  CommandResult r = Compare({"-q", "a.raw", "b.raw"});
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_EQ(r.out, "");
  WriteBytes("b.raw", 0, 1, 'x');
  r = Compare({"-q", "a.raw", "b.raw"});
  EXPECT_EQ(r.out, "");
  ExpectSilentExit(r, 1);
}

TEST_F(CompareTest, Progress) {
  // Chunks: [0, 1M) (25%), [1M, 1M+64K) (26.56%: less than 2 points
  // more, not printed), [1M+64K, 3M) (75%), [3M, 3M+4K), [3M+4K, 4M).
  CommandResult r = Compare({"-p", "a.raw", "b.raw"});
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_EQ(r.out,
            "    (0.00/100%)\r    (25.00/100%)\r    (75.00/100%)\r"
            "    (100.00/100%)\rImages are identical.\n\n");
}

TEST_F(CompareTest, OpenErrorsExitWithTwo) {
  CommandResult r = Compare({"a.raw", "missing.raw"});
  EXPECT_EQ(r.status.message(),
            "Could not open 'missing.raw': Could not open 'missing.raw': No "
            "such file or directory");
  EXPECT_EQ(ExitCodeOf(r.status), 2);
  EXPECT_EQ(r.out, "");
  r = Compare({"-T", "foo", "a.raw", "b.raw"});
  EXPECT_EQ(r.status.message(), "Invalid source cache option: foo");
  EXPECT_EQ(ExitCodeOf(r.status), 2);
  r = Compare({"-f", "foo", "a.raw", "b.raw"});
  EXPECT_EQ(r.status.message(), "Could not open 'a.raw': Unknown driver 'foo'");
  EXPECT_EQ(ExitCodeOf(r.status), 2);
}

TEST_F(CompareTest, UsageErrors) {
  CommandResult r = Compare({"a.raw"});
  EXPECT_EQ(r.status.message(), "Expecting two image file names");
  EXPECT_EQ(ExitCodeOf(r.status), 1);
  r = Compare({"-x", "a.raw", "b.raw"});
  EXPECT_EQ(r.status.message(), "unrecognized option '-x'");
  EXPECT_EQ(ExitCodeOf(r.status), 1);
}

}  // namespace
}  // namespace imgtool::cli

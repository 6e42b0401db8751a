// RunRebase called directly (so the unit-test runs under ASan cover it):
// safe rebase keeps the guest view, -b "" flattens, -u only renames, and
// qemu-img 7.2's messages for the errors. The byte-for-byte comparison
// with qemu-img is testing/rebase_oracle_test.sh.
#include <unistd.h>

#include <cstdio>
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
using testing::ReadFile;
using testing::WriteBytes;

constexpr uint64_t kSize = 4 << 20;

class RebaseTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_EQ(chdir(MakeTestDir().c_str()), 0);
    // base.raw: 0x11 in the first MiB, 0x22 in the third; new.raw: the
    // same first MiB with a 64 KiB piece changed, 0x44 in the fourth.
    MakeSparseFile("base.raw", kSize);
    WriteBytes("base.raw", 0, 1 << 20, 0x11);
    WriteBytes("base.raw", 2 << 20, 1 << 20, 0x22);
    MakeSparseFile("new.raw", kSize);
    WriteBytes("new.raw", 0, 1 << 20, 0x11);
    WriteBytes("new.raw", 512 << 10, 64 << 10, 0x33);
    WriteBytes("new.raw", 3 << 20, 1 << 20, 0x44);
    ASSERT_TRUE(Run(RunCreate, {"-q", "-f", "qcow2", "-b", "base.raw", "-F",
                                "raw", "ov.qcow2"})
                    .status.ok());
    ASSERT_TRUE(Run(RunIo, {"-f", "qcow2", "-c", "write -P 0x55 0 64k",
                            "ov.qcow2"})
                    .status.ok());
  }

  static CommandResult Run(CommandFn fn, const std::vector<std::string>& args) {
    return testing::RunCommand(fn, args);
  }
  static CommandResult Rebase(const std::vector<std::string>& args) {
    return Run(RunRebase, args);
  }

  // What the guest reads: the overlay converted to raw.
  static std::string GuestView(const std::string& image) {
    std::remove("view.raw");
    CommandResult r = Run(RunConvert, {"-O", "raw", image, "view.raw"});
    EXPECT_TRUE(r.status.ok()) << r.stderr_text();
    return ReadFile("view.raw");
  }

  static std::string BackingOf(const std::string& image) {
    CommandResult r = Run(RunInfo, {"-U", image});
    EXPECT_TRUE(r.status.ok()) << r.stderr_text();
    const size_t at = r.out.find("backing file: ");
    if (at == std::string::npos) return "";
    return r.out.substr(at + 14, r.out.find('\n', at) - at - 14);
  }
};

TEST_F(RebaseTest, SafeRebaseKeepsTheGuestView) {
  const std::string before = GuestView("ov.qcow2");
  CommandResult r =
      Rebase({"-p", "-b", "new.raw", "-F", "raw", "ov.qcow2"});
  ASSERT_TRUE(r.status.ok()) << r.stderr_text();
  // Two 2 MiB steps compared, then the end: qemu-img's records.
  EXPECT_EQ(r.out,
            "    (0.00/100%)\r    (50.00/100%)\r    (100.00/100%)\r"
            "    (100.00/100%)\r\n");
  EXPECT_EQ(BackingOf("ov.qcow2"), "new.raw");
  EXPECT_EQ(GuestView("ov.qcow2"), before);
}

TEST_F(RebaseTest, FlattenCopiesTheWholeOldChain) {
  const std::string before = GuestView("ov.qcow2");
  CommandResult r = Rebase({"-b", "", "ov.qcow2"});
  ASSERT_TRUE(r.status.ok()) << r.stderr_text();
  EXPECT_EQ(r.out, "");
  EXPECT_EQ(BackingOf("ov.qcow2"), "");
  std::remove("base.raw");
  EXPECT_EQ(GuestView("ov.qcow2"), before);
}

TEST_F(RebaseTest, UnsafeOnlyChangesTheName) {
  const std::string view_on_new = [] {
    CommandResult r = Run(RunCreate, {"-q", "-f", "qcow2", "-b", "new.raw",
                                      "-F", "raw", "ref.qcow2"});
    EXPECT_TRUE(r.status.ok());
    Run(RunIo, {"-f", "qcow2", "-c", "write -P 0x55 0 64k", "ref.qcow2"});
    return GuestView("ref.qcow2");
  }();
  CommandResult r = Rebase({"-u", "-b", "gone.raw", "-F", "raw", "ov.qcow2"});
  ASSERT_TRUE(r.status.ok()) << r.stderr_text();
  EXPECT_EQ(BackingOf("ov.qcow2"), "gone.raw");
  r = Rebase({"-u", "-b", "new.raw", "-F", "raw", "ov.qcow2"});
  ASSERT_TRUE(r.status.ok()) << r.stderr_text();
  EXPECT_EQ(GuestView("ov.qcow2"), view_on_new);
  r = Rebase({"-u", "ov.qcow2"});
  ASSERT_TRUE(r.status.ok()) << r.stderr_text();
  EXPECT_EQ(BackingOf("ov.qcow2"), "");
}

TEST_F(RebaseTest, ErrorsAreQemuImgs) {
  const std::string image = ReadFile("ov.qcow2");
  EXPECT_EQ(Rebase({"ov.qcow2"}).stderr_text(),
            "imgtool: Must specify backing file (-b) or use unsafe mode (-u)\n"
            "Try 'imgtool --help' for more information\n");
  EXPECT_EQ(Rebase({"-b", "new.raw", "-F", "raw"}).stderr_text(),
            "imgtool: Expecting one image file name\n"
            "Try 'imgtool --help' for more information\n");
  EXPECT_EQ(Rebase({"-b", "nothere.raw", "-F", "raw", "ov.qcow2"})
                .stderr_text(),
            "imgtool: Could not open new backing file 'nothere.raw': Could "
            "not open 'nothere.raw': No such file or directory\n");
  EXPECT_EQ(Rebase({"-b", "new.raw", "-F", "qcow2", "ov.qcow2"}).stderr_text(),
            "imgtool: Could not open new backing file 'new.raw': Image is not "
            "in qcow2 format\n");
  EXPECT_EQ(Rebase({"-b", "new.raw", "-F", "foo", "ov.qcow2"}).stderr_text(),
            "imgtool: Invalid format name: 'foo'\n");
  EXPECT_EQ(Rebase({"-u", "-b", "new.raw", "ov.qcow2"}).stderr_text(),
            "imgtool: Could not change the backing file to 'new.raw': backing "
            "format must be specified\n");
  EXPECT_EQ(Rebase({"-u", "-b", std::string(1024, 'n'), "-F", "raw",
                    "ov.qcow2"})
                .stderr_text(),
            "imgtool: Could not change the backing file to '" +
                std::string(1024, 'n') + "': Invalid argument\n");
  EXPECT_EQ(Rebase({"-u", "-f", "raw", "base.raw"}).stderr_text(),
            "imgtool: Could not change the backing file to '(null)': "
            "Operation not supported\n");
  EXPECT_EQ(Rebase({"-t", "bogus", "-b", "new.raw", "-F", "raw", "ov.qcow2"})
                .stderr_text(),
            "imgtool: Invalid cache option: bogus\n");
  EXPECT_EQ(ReadFile("ov.qcow2"), image);
  EXPECT_EQ(BackingOf("ov.qcow2"), "base.raw");
}

}  // namespace
}  // namespace imgtool::cli

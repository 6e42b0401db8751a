// RunCreate called directly: exact output lines and error messages
// (checked against qemu-img 7.2), and the files it makes.
#include <unistd.h>

#include <filesystem>
#include <string>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "imgtool/command.h"
#include "imgtool/testing/command_runner.h"

namespace imgtool::cli {
namespace {

using testing::AllocatedBytes;
using testing::CommandResult;
using testing::FileSize;
using testing::MakeTestDir;
using testing::ReadFile;
using testing::WriteBytes;

class CreateTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_EQ(chdir(MakeTestDir().c_str()), 0); }

  static CommandResult Create(const std::vector<std::string>& args) {
    return testing::RunCommand(RunCreate, args);
  }
  static bool Exists(const std::string& path) {
    return std::filesystem::exists(path);
  }
};

TEST_F(CreateTest, PrintsQemuImgFormattingLine) {
  CommandResult r = Create({"x.raw", "1M"});
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_EQ(r.out, "Formatting 'x.raw', fmt=raw size=1048576\n");
  EXPECT_EQ(r.err, "");
  EXPECT_EQ(FileSize("x.raw"), 1048576u);
}

TEST_F(CreateTest, OptionsAppearInQemuOrder) {
  CommandResult r = Create({"-f", "raw", "-o",
                            "extent_size_hint=2M,preallocation=falloc,nocow=on",
                            "x.raw", "1000"});
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_EQ(r.out,
            "Formatting 'x.raw', fmt=raw size=1000 nocow=on "
            "preallocation=falloc extent_size_hint=2097152\n");
}

TEST_F(CreateTest, FileSizeIsRoundedUpTo512) {
  CommandResult r = Create({"x.raw", "1000"});
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_EQ(r.out, "Formatting 'x.raw', fmt=raw size=1000\n");
  EXPECT_EQ(FileSize("x.raw"), 1024u);
}

TEST_F(CreateTest, SizeFromOptionsAndAccumulatedOptions) {
  CommandResult r =
      Create({"-o", "size=1.7k", "-o", "preallocation=full", "x.raw"});
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_EQ(r.out,
            "Formatting 'x.raw', fmt=raw size=1741 preallocation=full\n");
  EXPECT_EQ(FileSize("x.raw"), 2048u);
}

TEST_F(CreateTest, LastValueOfAnOptionWins) {
  CommandResult r = Create({"-o", "size=1M", "-o", "size=2M", "x.raw"});
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_EQ(r.out, "Formatting 'x.raw', fmt=raw size=2097152\n");
  r = Create({"-o", "size=1M,preallocation=full,size=3M,preallocation=off",
              "x.raw"});
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_EQ(r.out,
            "Formatting 'x.raw', fmt=raw size=3145728 preallocation=off\n");
}

TEST_F(CreateTest, QuietPrintsNothing) {
  CommandResult r = Create({"-q", "x.raw", "64k"});
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_EQ(r.out, "");
  EXPECT_EQ(FileSize("x.raw"), 65536u);
}

TEST_F(CreateTest, FileFormatIsTheProtocolDriver) {
  CommandResult r = Create({"-f", "file", "x.raw", "1M"});
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_EQ(r.out, "Formatting 'x.raw', fmt=file size=1048576\n");
}

TEST_F(CreateTest, ExistingFileIsEmptiedAndResized) {
  WriteBytes("x.raw", 0, 8192, 0xab);
  CommandResult r = Create({"-q", "x.raw", "4k"});
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_EQ(ReadFile("x.raw"), std::string(4096, '\0'));
}

TEST_F(CreateTest, FullPreallocationAllocatesEveryByte) {
  CommandResult r = Create({"-q", "-o", "preallocation=full", "x.raw", "1M"});
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_GE(AllocatedBytes("x.raw"), 1048576u);
}

TEST_F(CreateTest, SizeGivenTwice) {
  CommandResult r = Create({"-o", "size=1M", "x.raw", "1M"});
  EXPECT_EQ(r.stderr_text(),
            "imgtool: x.raw: The image size must be specified only once\n");
  EXPECT_EQ(ExitCodeOf(r.status), 1);
  EXPECT_EQ(r.out, "");
  EXPECT_FALSE(Exists("x.raw"));
}

TEST_F(CreateTest, MissingSize) {
  CommandResult r = Create({"x.raw"});
  EXPECT_EQ(r.stderr_text(),
            "imgtool: x.raw: Image creation needs a size parameter\n");
  EXPECT_FALSE(Exists("x.raw"));
}

TEST_F(CreateTest, BadSizePrintsQemuImgsTwoLines) {
  for (const char* size : {"1kb", "1.5", "1e3", "2k ", "1KiB"}) {
    CommandResult r = Create({"x.raw", size});
    EXPECT_EQ(r.stderr_text(),
              "imgtool: Invalid image size specified. You may use k, M, G, T, "
              "P or E suffixes for\n"
              "imgtool: kilobytes, megabytes, gigabytes, terabytes, "
              "petabytes and exabytes.\n")
        << size;
    EXPECT_EQ(r.status.code(), absl::StatusCode::kInvalidArgument);
  }
  CommandResult r = Create({"x.raw", "9E"});
  EXPECT_EQ(r.stderr_text(),
            "imgtool: Invalid image size specified. Must be between 0 and "
            "9223372036854775807.\n");
  EXPECT_FALSE(Exists("x.raw"));
}

TEST_F(CreateTest, BadSizeOption) {
  CommandResult r = Create({"-o", "size=3x", "x.raw"});
  EXPECT_EQ(r.stderr_text(),
            "imgtool: x.raw: Parameter 'size' expects a non-negative number "
            "below 2^64\n"
            "Optional suffix k, M, G, T, P or E means kilo-, mega-, giga-, "
            "tera-, peta-\n"
            "and exabytes, respectively.\n");
  r = Create({"-o", "size=16E", "x.raw"});
  EXPECT_EQ(r.stderr_text(),
            "imgtool: x.raw: Value '16E' is out of range for parameter "
            "'size'\n");
  EXPECT_FALSE(Exists("x.raw"));
}

TEST_F(CreateTest, BadOptions) {
  EXPECT_EQ(Create({"-o", "foo=1", "x.raw", "1M"}).stderr_text(),
            "imgtool: x.raw: Invalid parameter 'foo'\n");
  EXPECT_EQ(Create({"-o", "foo=1,size=3x", "x.raw"}).stderr_text(),
            "imgtool: x.raw: Invalid parameter 'foo'\n");
  EXPECT_EQ(Create({"-o", "nocow=1", "x.raw", "1M"}).stderr_text(),
            "imgtool: x.raw: Parameter 'nocow' expects 'on' or 'off'\n");
  EXPECT_EQ(Create({"-o", "", "x.raw", "1M"}).stderr_text(),
            "imgtool: Invalid option list: \n");
  EXPECT_EQ(Create({"-o", ",", "x.raw", "1M"}).stderr_text(),
            "imgtool: Invalid option list: ,\n");
  EXPECT_EQ(Create({"-o", "size=1k,", "x.raw"}).stderr_text(),
            "imgtool: Invalid option list: size=1k,\n");
  EXPECT_FALSE(Exists("x.raw"));
}

TEST_F(CreateTest, BadOptionValuesFailAfterTheFormattingLine) {
  CommandResult r = Create({"-o", "preallocation=bad", "x.raw", "1M"});
  EXPECT_EQ(r.out,
            "Formatting 'x.raw', fmt=raw size=1048576 preallocation=bad\n");
  EXPECT_EQ(r.stderr_text(), "imgtool: x.raw: invalid parameter value: bad\n");
  r = Create({"-o", "preallocation=metadata", "x.raw", "1M"});
  EXPECT_EQ(r.stderr_text(),
            "imgtool: x.raw: Unsupported preallocation mode: metadata\n");
  r = Create({"-o", "preallocation=falloc,,x", "x.raw", "1M"});
  EXPECT_EQ(r.out, "Formatting 'x.raw', fmt=raw size=1048576 "
                   "preallocation=falloc,,x\n");
  EXPECT_EQ(r.stderr_text(),
            "imgtool: x.raw: invalid parameter value: falloc,x\n");
  r = Create({"-o", "extent_size_hint=5G", "x.raw", "1M"});
  EXPECT_EQ(r.out, "Formatting 'x.raw', fmt=raw size=1048576 "
                   "extent_size_hint=5368709120\n");
  EXPECT_EQ(r.stderr_text(), "imgtool: x.raw: Extent size hint is too large\n");
  EXPECT_FALSE(Exists("x.raw"));
}

TEST_F(CreateTest, Formats) {
  EXPECT_EQ(Create({"-f", "qcow3", "x.raw", "1M"}).stderr_text(),
            "imgtool: x.raw: Unknown file format 'qcow3'\n");
  CommandResult r = Create({"-f", "vmdk", "x.raw", "1M"});
  EXPECT_EQ(r.status.code(), absl::StatusCode::kUnimplemented);
  EXPECT_EQ(r.stderr_text(),
            "imgtool: x.raw: Format 'vmdk' is not supported yet\n");
  EXPECT_FALSE(Exists("x.raw"));
  // QEMU's drivers without image creation (iotests 082, 113).
  r = Create({"-f", "bochs", "x.raw", "1M"});
  EXPECT_EQ(r.status.code(), absl::StatusCode::kUnimplemented);
  EXPECT_EQ(r.stderr_text(),
            "imgtool: x.raw: Format driver 'bochs' does not support image "
            "creation\n");
  EXPECT_EQ(Create({"-f", "quorum", "-o", "help"}).stderr_text(),
            "imgtool: Format driver 'quorum' does not support image "
            "creation\n");
  EXPECT_FALSE(Exists("x.raw"));
}

TEST_F(CreateTest, Qcow2FormattingLineListsDefaultsInQemuOrder) {
  CommandResult r = Create({"-f", "qcow2", "q.qcow2", "64M"});
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_EQ(r.out,
            "Formatting 'q.qcow2', fmt=qcow2 cluster_size=65536 "
            "extended_l2=off compression_type=zlib size=67108864 "
            "lazy_refcounts=off refcount_bits=16\n");
  // qemu-img's layout: header, refcount table, refcount block, L1 table
  // (one entry of 8 bytes) ending inside the fourth cluster.
  EXPECT_EQ(FileSize("q.qcow2"), 3 * 65536u + 8);
  const std::string head = ReadFile("q.qcow2").substr(0, 4);
  EXPECT_EQ(head, "QFI\xfb");

  r = Create({"-f", "qcow2", "-o", "preallocation=metadata,cluster_size=4k",
              "-o", "compat=0.10,refcount_bits=0x10", "p.qcow2", "1000b"});
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_EQ(r.out,
            "Formatting 'p.qcow2', fmt=qcow2 cluster_size=4096 "
            "extended_l2=off preallocation=metadata compression_type=zlib "
            "size=1000 compat=0.10 lazy_refcounts=off refcount_bits=16\n");
}

TEST_F(CreateTest, Qcow2BackingFile) {
  ASSERT_TRUE(Create({"-q", "base.raw", "3M"}).status.ok());
  // The size comes from the backing file.
  CommandResult r =
      Create({"-f", "qcow2", "-b", "base.raw", "-F", "raw", "ov.qcow2"});
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_EQ(r.out,
            "Formatting 'ov.qcow2', fmt=qcow2 cluster_size=65536 "
            "extended_l2=off compression_type=zlib size=3145728 "
            "backing_file=base.raw backing_fmt=raw lazy_refcounts=off "
            "refcount_bits=16\n");
  r = Create({"-f", "qcow2", "-b", "base.raw", "x.qcow2", "1M"});
  // As qemu-img: no newline after the hint; nothing more for main to print.
  EXPECT_EQ(r.err,
            "imgtool: x.qcow2: Backing file specified without backing "
            "format\nDetected format of raw.");
  EXPECT_EQ(r.status.message(), "");
  EXPECT_EQ(ExitCodeOf(r.status), 1);
  r = Create({"-f", "qcow2", "-u", "-b", "base.raw", "x.qcow2", "1M"});
  EXPECT_EQ(r.stderr_text(),
            "imgtool: x.qcow2: Backing file specified without backing "
            "format\n");
  r = Create({"-f", "qcow2", "-b", "gone.raw", "-F", "raw", "x.qcow2"});
  EXPECT_EQ(r.stderr_text(),
            "imgtool: x.qcow2: Could not open 'gone.raw': No such file or "
            "directory\nCould not open backing image.\n");
  r = Create({"-f", "qcow2", "-u", "-b", "gone.raw", "-F", "raw", "x.qcow2"});
  EXPECT_EQ(r.stderr_text(),
            "imgtool: x.qcow2: Image creation needs a size parameter\n");
  EXPECT_FALSE(Exists("x.qcow2"));
  // -u: the backing file is not opened.
  EXPECT_TRUE(Create({"-q", "-f", "qcow2", "-u", "-b", "gone.raw", "-F", "raw",
                      "x.qcow2", "1M"})
                  .status.ok());
}

TEST_F(CreateTest, FailedQcow2CreateLeavesNoFile) {
  WriteBytes("x.qcow2", 0, 4096, 'x');
  CommandResult r =
      Create({"-f", "qcow2", "-o", "cluster_size=1000", "x.qcow2", "1M"});
  EXPECT_EQ(r.out,
            "Formatting 'x.qcow2', fmt=qcow2 cluster_size=1000 "
            "extended_l2=off compression_type=zlib size=1048576 "
            "lazy_refcounts=off refcount_bits=16\n");
  EXPECT_EQ(r.stderr_text(),
            "imgtool: x.qcow2: Cluster size must be a power of two between "
            "512 and 2048k\n");
  EXPECT_FALSE(Exists("x.qcow2"));
  r = Create({"-f", "qcow2", "-o", "compat=0.9", "x.qcow2", "1M"});
  EXPECT_EQ(r.stderr_text(),
            "imgtool: x.qcow2: Parameter 'version' does not accept value "
            "'0.9'\n");
  EXPECT_FALSE(Exists("x.qcow2"));
  // Errors in the option values themselves come before anything happens.
  WriteBytes("x.qcow2", 0, 4096, 'x');
  r = Create({"-f", "qcow2", "-o", "lazy_refcounts=maybe", "x.qcow2", "1M"});
  EXPECT_EQ(r.out, "");
  EXPECT_EQ(r.stderr_text(),
            "imgtool: x.qcow2: Parameter 'lazy_refcounts' expects 'on' or "
            "'off'\n");
  EXPECT_EQ(FileSize("x.qcow2"), 4096u);
}

TEST_F(CreateTest, Qcow2OptionHelp) {
  CommandResult r = Create({"-f", "qcow2", "-o", "help"});
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_THAT(r.out, ::testing::StartsWith(
                         "Supported qcow2 options:\n"
                         "  backing_file=<str>     - File name of a base "
                         "image\n"));
  EXPECT_THAT(r.out, ::testing::EndsWith(
                         "  size=<size>            - Virtual disk size\n\n"
                         "The protocol level may support further options.\n"
                         "Specify the target filename to include those "
                         "options.\n"));
  r = Create({"-f", "qcow2", "-o", "?", "x.qcow2"});
  EXPECT_THAT(r.out, ::testing::HasSubstr(
                         "  nocow=<bool (on/off)>  - Turn off copy-on-write "
                         "(valid only on btrfs)\n"));
  EXPECT_FALSE(Exists("x.qcow2"));
}

TEST_F(CreateTest, BackingFilesAreNotSupportedByRaw) {
  EXPECT_EQ(Create({"-b", "base.raw", "x.raw", "1M"}).stderr_text(),
            "imgtool: x.raw: Backing file not supported for file format "
            "'raw'\n");
  EXPECT_EQ(Create({"-F", "raw", "x.raw", "1M"}).stderr_text(),
            "imgtool: x.raw: Backing file format not supported for file "
            "format 'raw'\n");
  EXPECT_TRUE(Create({"-q", "-u", "x.raw", "1M"}).status.ok());
}

TEST_F(CreateTest, UsageErrors) {
  const std::string tail =
      "Usage: imgtool create [-q] [-f FMT] [-b BACKING [-F BACKING_FMT]] "
      "[-u] [-o OPTIONS] FILE [SIZE]\n"
      "Try 'imgtool --help' for more information\n";
  EXPECT_EQ(Create({}).stderr_text(),
            "imgtool: Expecting image file name\n" + tail);
  EXPECT_EQ(Create({"x.raw", "1M", "extra"}).stderr_text(),
            "imgtool: Unexpected argument: extra\n" + tail);
  EXPECT_EQ(Create({"-z", "x.raw", "1M"}).stderr_text(),
            "imgtool: unrecognized option '-z'\n" + tail);
  EXPECT_EQ(Create({"x.raw", "1M", "-o"}).stderr_text(),
            "imgtool: missing argument for option '-o'\n" + tail);
  EXPECT_FALSE(Exists("x.raw"));
}

TEST_F(CreateTest, OptionHelp) {
  const std::string file_options =
      "  extent_size_hint=<size> - Extent size hint for the image file, 0 to "
      "disable\n"
      "  nocow=<bool (on/off)>  - Turn off copy-on-write (valid only on "
      "btrfs)\n"
      "  preallocation=<str>    - Preallocation mode (allowed values: off, "
      "falloc, full)\n"
      "  size=<size>            - Virtual disk size\n";
  const std::string hint =
      "\nThe protocol level may support further options.\n"
      "Specify the target filename to include those options.\n";
  CommandResult r = Create({"-o", "help"});
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_EQ(r.out, "Supported raw options:\n"
                   "  size=<size>            - Virtual disk size\n" + hint);
  r = Create({"-o", "size=1M,?", "x.raw"});
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_EQ(r.out, "Supported options:\n" + file_options);
  r = Create({"-f", "file", "-o", "help"});
  EXPECT_EQ(r.out, "Supported file options:\n" + file_options + hint);
  EXPECT_EQ(Create({"-f", "foo", "-o", "help"}).stderr_text(),
            "imgtool: Unknown file format 'foo'\n");
  EXPECT_FALSE(Exists("x.raw"));
}

TEST_F(CreateTest, MissingDirectory) {
  CommandResult r = Create({"nodir/x.raw", "1M"});
  EXPECT_EQ(r.out, "Formatting 'nodir/x.raw', fmt=raw size=1048576\n");
  EXPECT_EQ(r.stderr_text(),
            "imgtool: nodir/x.raw: Could not create 'nodir/x.raw': No such "
            "file or directory\n");
  EXPECT_EQ(ExitCodeOf(r.status), 1);
}

TEST_F(CreateTest, HelpOption) {
  CommandResult r = Create({"--help"});
  ASSERT_TRUE(r.status.ok());
  EXPECT_THAT(r.out, ::testing::StartsWith("Usage: imgtool create"));
}

}  // namespace
}  // namespace imgtool::cli

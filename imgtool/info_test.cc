// RunInfo called directly: qemu-img 7.2's human and JSON layouts for raw
// and qcow2 images and backing chains, and its errors.
#include <sys/stat.h>
#include <unistd.h>

#include <string>

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

class InfoTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_EQ(chdir(MakeTestDir().c_str()), 0); }
  static CommandResult Info(const std::vector<std::string>& args) {
    return testing::RunCommand(RunInfo, args);
  }
  static CommandResult Create(const std::vector<std::string>& args) {
    return testing::RunCommand(RunCreate, args);
  }
};

TEST_F(InfoTest, HumanOutputOfASparseFile) {
  MakeSparseFile("x.raw", 1 << 20);
  CommandResult r = Info({"x.raw"});
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_EQ(r.out,
            "image: x.raw\n"
            "file format: raw\n"
            "virtual size: 1 MiB (1048576 bytes)\n"
            "disk size: 0 B\n");
  EXPECT_EQ(r.err, "");  // read-only opens do not warn about probing
}

TEST_F(InfoTest, JsonOutput) {
  MakeSparseFile("x.raw", 5 << 20);
  WriteBytes("x.raw", 0, 8192, 1);
  CommandResult r = Info({"-f", "raw", "--output=json", "x.raw"});
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_EQ(r.out,
            "{\n"
            "    \"virtual-size\": 5242880,\n"
            "    \"filename\": \"x.raw\",\n"
            "    \"format\": \"raw\",\n"
            "    \"actual-size\": 8192,\n"
            "    \"dirty-flag\": false\n"
            "}\n");
}

TEST_F(InfoTest, VirtualSizeIsRoundedUpTo512) {
  WriteBytes("x.raw", 0, 1000, 7);
  CommandResult r = Info({"--output", "human", "x.raw"});
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_EQ(r.out,
            "image: x.raw\n"
            "file format: raw\n"
            "virtual size: 1 KiB (1024 bytes)\n"
            "disk size: 4 KiB\n");
}

TEST_F(InfoTest, EmptyFileAndFileFormat) {
  MakeSparseFile("x.raw", 0);
  CommandResult r = Info({"-f", "file", "-U", "x.raw"});
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_EQ(r.out,
            "image: x.raw\n"
            "file format: file\n"
            "virtual size: 0 B (0 bytes)\n"
            "disk size: 0 B\n");
}

TEST_F(InfoTest, MissingFile) {
  CommandResult r = Info({"nonexist"});
  EXPECT_EQ(r.stderr_text(),
            "imgtool: Could not open 'nonexist': Could not open 'nonexist': "
            "No such file or directory\n");
  EXPECT_EQ(ExitCodeOf(r.status), 1);
  EXPECT_EQ(r.out, "");
}

TEST_F(InfoTest, Directory) {
  ASSERT_EQ(mkdir("d", 0755), 0);
  EXPECT_EQ(Info({"d"}).stderr_text(),
            "imgtool: Could not open 'd': 'file' driver requires 'd' to be a "
            "regular file\n");
}

TEST_F(InfoTest, Formats) {
  MakeSparseFile("x.raw", 4096);
  EXPECT_EQ(Info({"-f", "foo", "x.raw"}).stderr_text(),
            "imgtool: Could not open 'x.raw': Unknown driver 'foo'\n");
  CommandResult r = Info({"-f", "qcow2", "x.raw"});
  EXPECT_EQ(r.status.code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(r.stderr_text(),
            "imgtool: Could not open 'x.raw': Image is not in qcow2 format\n");
  // A probed qcow (version 1) image is refused rather than shown as raw.
  WriteBytes("q.img", 0, 1, 'Q');
  WriteBytes("q.img", 1, 1, 'F');
  WriteBytes("q.img", 2, 1, 'I');
  WriteBytes("q.img", 3, 1, 0xfb);
  WriteBytes("q.img", 7, 1, 1);
  WriteBytes("q.img", 511, 1, 0);
  EXPECT_EQ(Info({"q.img"}).stderr_text(),
            "imgtool: Could not open 'q.img': Format 'qcow' is not supported "
            "yet\n");
}

TEST_F(InfoTest, Qcow2WithBackingChain) {
  ASSERT_TRUE(Create({"-q", "base.raw", "2M"}).status.ok());
  ASSERT_TRUE(Create({"-q", "-f", "qcow2", "-o", "cluster_size=4k", "-b",
                      "base.raw", "-F", "raw", "mid.qcow2"})
                  .status.ok());
  ASSERT_EQ(mkdir("sub", 0755), 0);
  ASSERT_TRUE(Create({"-q", "-f", "qcow2", "-b", "../mid.qcow2", "-F", "qcow2",
                      "sub/top.qcow2", "4M"})
                  .status.ok());
  CommandResult r = Info({"sub/top.qcow2"});
  ASSERT_TRUE(r.status.ok()) << r.status;
  const std::string top =
      "image: sub/top.qcow2\n"
      "file format: qcow2\n"
      "virtual size: 4 MiB (4194304 bytes)\n"
      "disk size: 196 KiB\n"
      "cluster_size: 65536\n"
      "backing file: ../mid.qcow2 (actual path: sub/../mid.qcow2)\n"
      "backing file format: qcow2\n"
      "Format specific information:\n"
      "    compat: 1.1\n"
      "    compression type: zlib\n"
      "    lazy refcounts: false\n"
      "    refcount bits: 16\n"
      "    corrupt: false\n"
      "    extended l2: false\n";
  EXPECT_EQ(r.out, top);
  r = Info({"--backing-chain", "sub/top.qcow2"});
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_EQ(r.out,
            top +
                "\n"
                "image: sub/../mid.qcow2\n"
                "file format: qcow2\n"
                "virtual size: 2 MiB (2097152 bytes)\n"
                "disk size: 16 KiB\n"
                "cluster_size: 4096\n"
                "backing file: base.raw (actual path: sub/../base.raw)\n"
                "backing file format: raw\n"
                "Format specific information:\n"
                "    compat: 1.1\n"
                "    compression type: zlib\n"
                "    lazy refcounts: false\n"
                "    refcount bits: 16\n"
                "    corrupt: false\n"
                "    extended l2: false\n"
                "\n"
                "image: sub/../base.raw\n"
                "file format: raw\n"
                "virtual size: 2 MiB (2097152 bytes)\n"
                "disk size: 4 KiB\n");
  // Without --backing-chain the backing file is not opened.
  ASSERT_EQ(unlink("base.raw"), 0);
  EXPECT_TRUE(Info({"mid.qcow2"}).status.ok());
  EXPECT_EQ(Info({"--backing-chain", "mid.qcow2"}).stderr_text(),
            "imgtool: Could not open 'base.raw': Could not open 'base.raw': "
            "No such file or directory\n");
}

TEST_F(InfoTest, Qcow2Json) {
  ASSERT_TRUE(Create({"-q", "-f", "qcow2", "-o", "compat=0.10", "v2.qcow2",
                      "1M"})
                  .status.ok());
  CommandResult r = Info({"--output=json", "v2.qcow2"});
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_EQ(r.out,
            "{\n"
            "    \"virtual-size\": 1048576,\n"
            "    \"filename\": \"v2.qcow2\",\n"
            "    \"cluster-size\": 65536,\n"
            "    \"format\": \"qcow2\",\n"
            "    \"actual-size\": 200704,\n"
            "    \"format-specific\": {\n"
            "        \"type\": \"qcow2\",\n"
            "        \"data\": {\n"
            "            \"compat\": \"0.10\",\n"
            "            \"compression-type\": \"zlib\",\n"
            "            \"refcount-bits\": 16\n"
            "        }\n"
            "    },\n"
            "    \"dirty-flag\": false\n"
            "}\n");
  ASSERT_TRUE(Create({"-q", "-f", "qcow2", "-u", "-b", "v2.qcow2", "-F",
                      "qcow2", "ov.qcow2", "1M"})
                  .status.ok());
  r = Info({"--output=json", "--backing-chain", "ov.qcow2"});
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_THAT(r.out, ::testing::StartsWith(
                         "[\n"
                         "    {\n"
                         "        \"backing-filename-format\": \"qcow2\",\n"
                         "        \"virtual-size\": 1048576,\n"));
  EXPECT_THAT(r.out, ::testing::HasSubstr(
                         "        \"full-backing-filename\": \"v2.qcow2\",\n"
                         "        \"backing-filename\": \"v2.qcow2\",\n"
                         "        \"dirty-flag\": false\n"
                         "    },\n"
                         "    {\n"
                         "        \"virtual-size\": 1048576,\n"
                         "        \"filename\": \"v2.qcow2\",\n"));
  EXPECT_THAT(r.out, ::testing::EndsWith("    }\n]\n"));
}

TEST_F(InfoTest, OptionErrors) {
  MakeSparseFile("x.raw", 4096);
  EXPECT_EQ(Info({"--output=xml", "x.raw"}).stderr_text(),
            "imgtool: --output must be used with human or json as "
            "argument.\n");
  EXPECT_EQ(Info({"--image-opts", "-f", "raw", "x.raw"}).stderr_text(),
            "imgtool: --image-opts and --format are mutually exclusive\n");
  // A bare --image-opts item is a node name, which imgtool never has.
  EXPECT_EQ(Info({"--image-opts", "x.raw"}).stderr_text(),
            "imgtool: Could not open 'x.raw': Cannot find device='x.raw' nor "
            "node-name='x.raw'\n");
  const std::string tail =
      "Usage: imgtool info [-f FMT] [--output=human|json] [--backing-chain] "
      "[-U] FILE\n"
      "Try 'imgtool --help' for more information\n";
  EXPECT_EQ(Info({}).stderr_text(),
            "imgtool: Expecting one image file name\n" + tail);
  EXPECT_EQ(Info({"a", "b"}).stderr_text(),
            "imgtool: Expecting one image file name\n" + tail);
  EXPECT_EQ(Info({"--foo", "x.raw"}).stderr_text(),
            "imgtool: unrecognized option '--foo'\n" + tail);
}

}  // namespace
}  // namespace imgtool::cli

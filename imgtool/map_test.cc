// RunMap called directly on files with a known layout (raw files, qcow2
// images and backing chains): the exact lines qemu-img 7.2 prints for them
// (human and JSON).
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

constexpr char kHeader[] =
    "Offset          Length          Mapped to       File\n";

class MapTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_EQ(chdir(MakeTestDir().c_str()), 0); }
  static CommandResult Map(const std::vector<std::string>& args) {
    return testing::RunCommand(RunMap, args);
  }
  static CommandResult Run(CommandFn command,
                           const std::vector<std::string>& args) {
    return testing::RunCommand(command, args);
  }
  // 1 MiB with data at [64K, 128K) and [512K, 576K).
  static void MakeHoles() {
    MakeSparseFile("x.raw", 1 << 20);
    WriteBytes("x.raw", 64 << 10, 64 << 10, 1);
    WriteBytes("x.raw", 512 << 10, 64 << 10, 2);
  }
};

TEST_F(MapTest, HumanListsDataExtentsOnly) {
  MakeHoles();
  CommandResult r = Map({"x.raw"});
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_EQ(r.out, std::string(kHeader) +
                       "0x10000         0x10000         0x10000         x.raw\n"
                       "0x80000         0x10000         0x80000         x.raw\n");
  EXPECT_EQ(r.err, "");
}

TEST_F(MapTest, JsonListsEveryExtent) {
  MakeHoles();
  CommandResult r = Map({"-f", "raw", "--output=json", "x.raw"});
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_EQ(
      r.out,
      "[{ \"start\": 0, \"length\": 65536, \"depth\": 0, \"present\": true, "
      "\"zero\": true, \"data\": false, \"offset\": 0},\n"
      "{ \"start\": 65536, \"length\": 65536, \"depth\": 0, \"present\": "
      "true, \"zero\": false, \"data\": true, \"offset\": 65536},\n"
      "{ \"start\": 131072, \"length\": 393216, \"depth\": 0, \"present\": "
      "true, \"zero\": true, \"data\": false, \"offset\": 131072},\n"
      "{ \"start\": 524288, \"length\": 65536, \"depth\": 0, \"present\": "
      "true, \"zero\": false, \"data\": true, \"offset\": 524288},\n"
      "{ \"start\": 589824, \"length\": 458752, \"depth\": 0, \"present\": "
      "true, \"zero\": true, \"data\": false, \"offset\": 589824}]\n");
}

TEST_F(MapTest, FullyAllocatedFileIsOneExtent) {
  WriteBytes("x.raw", 0, 256 << 10, 3);
  CommandResult r = Map({"x.raw"});
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_EQ(r.out, std::string(kHeader) +
                       "0               0x40000         0               x.raw\n");
  r = Map({"--output=json", "x.raw"});
  EXPECT_EQ(r.out,
            "[{ \"start\": 0, \"length\": 262144, \"depth\": 0, \"present\": "
            "true, \"zero\": false, \"data\": true, \"offset\": 0}]\n");
}

TEST_F(MapTest, UnalignedStartOffsetAndMaxLength) {
  MakeHoles();
  CommandResult r = Map({"--output=json", "--start-offset=65636",
                         "--max-length=100000", "x.raw"});
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_EQ(
      r.out,
      "[{ \"start\": 65636, \"length\": 65436, \"depth\": 0, \"present\": "
      "true, \"zero\": false, \"data\": true, \"offset\": 65636},\n"
      "{ \"start\": 131072, \"length\": 34564, \"depth\": 0, \"present\": "
      "true, \"zero\": true, \"data\": false, \"offset\": 131072}]\n");
  r = Map({"--start-offset=100", "--max-length=64k", "x.raw"});
  EXPECT_EQ(r.out, std::string(kHeader) +
                       "0x10000         0x64            0x10000         x.raw\n");
}

TEST_F(MapTest, SizeNotAMultipleOf512) {
  WriteBytes("x.raw", 0, 1000, 4);
  CommandResult r = Map({"--output=json", "x.raw"});
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_EQ(r.out,
            "[{ \"start\": 0, \"length\": 1000, \"depth\": 0, \"present\": "
            "true, \"zero\": false, \"data\": true, \"offset\": 0},\n"
            "{ \"start\": 1000, \"length\": 24, \"depth\": 0, \"present\": "
            "true, \"zero\": true, \"data\": false, \"offset\": 1000}]\n");
  r = Map({"x.raw"});
  EXPECT_EQ(r.out, std::string(kHeader) +
                       "0               0x3e8           0               x.raw\n");
  // A hole at the end merges with the rounded tail.
  MakeSparseFile("y.raw", 1000);
  r = Map({"--output=json", "y.raw"});
  EXPECT_EQ(r.out,
            "[{ \"start\": 0, \"length\": 1024, \"depth\": 0, \"present\": "
            "true, \"zero\": true, \"data\": false, \"offset\": 0}]\n");
}

TEST_F(MapTest, NothingToMapPrintsAnEmptyEntry) {
  MakeSparseFile("x.raw", 0);
  CommandResult r = Map({"--output=json", "x.raw"});
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_EQ(r.out,
            "[{ \"start\": 0, \"length\": 0, \"depth\": 0, \"present\": false, "
            "\"zero\": false, \"data\": false}]\n");
  MakeHoles();
  r = Map({"--output=json", "--start-offset=2M", "x.raw"});
  EXPECT_EQ(r.out,
            "[{ \"start\": 2097152, \"length\": 0, \"depth\": 0, \"present\": "
            "false, \"zero\": false, \"data\": false}]\n");
  r = Map({"--max-length=0", "x.raw"});
  EXPECT_EQ(r.out, kHeader);
}

TEST_F(MapTest, Errors) {
  MakeHoles();
  EXPECT_EQ(Map({"--start-offset=foo", "x.raw"}).stderr_text(),
            "imgtool: Invalid start offset specified. You may use k, M, G, T, "
            "P or E suffixes for\n"
            "imgtool: kilobytes, megabytes, gigabytes, terabytes, petabytes "
            "and exabytes.\n");
  EXPECT_EQ(Map({"--max-length=99999999999999999999", "x.raw"}).stderr_text(),
            "imgtool: Invalid max length specified. Must be between 0 and "
            "9223372036854775807.\n");
  EXPECT_EQ(Map({"--output=xml", "x.raw"}).stderr_text(),
            "imgtool: --output must be used with human or json as "
            "argument.\n");
  CommandResult r = Map({"nonexist"});
  EXPECT_EQ(r.stderr_text(),
            "imgtool: Could not open 'nonexist': Could not open 'nonexist': "
            "No such file or directory\n");
  EXPECT_EQ(r.out, "");
  EXPECT_EQ(ExitCodeOf(r.status), 1);
  EXPECT_EQ(Map({"x.raw", "y.raw"}).status.message(),
            "Expecting one image file name");
}

// raw <- qcow2 <- qcow2, made with imgtool's create and io: depth counts
// from the top, the File column names the file holding the data, a zero
// cluster has no offset, and past the end of the shorter backing file the
// image reads zeroes "not present" at the depth of the last image covering
// it (as qemu-img 7.2 prints it on the same files).
TEST_F(MapTest, Qcow2BackingChain) {
  MakeSparseFile("base.raw", 1 << 20);
  WriteBytes("base.raw", 0, 64 << 10, 'x');
  ASSERT_TRUE(Run(RunCreate, {"-q", "-f", "qcow2", "-b", "base.raw", "-F",
                              "raw", "mid.qcow2", "2M"})
                  .status.ok());
  ASSERT_TRUE(Run(RunIo, {"-c", "write -q -P 1 128k 64k", "-c",
                          "write -q -z 256k 64k", "mid.qcow2"})
                  .status.ok());
  ASSERT_TRUE(Run(RunCreate, {"-q", "-f", "qcow2", "-b", "mid.qcow2", "-F",
                              "qcow2", "top.qcow2"})
                  .status.ok());
  CommandResult r = Map({"top.qcow2"});
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_EQ(r.out, std::string(kHeader) +
                       "0               0x10000         0               "
                       "base.raw\n"
                       "0x20000         0x10000         0x50000         "
                       "mid.qcow2\n");
  r = Map({"--output=json", "top.qcow2"});
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_EQ(r.out,
            "[{ \"start\": 0, \"length\": 65536, \"depth\": 2, \"present\": "
            "true, \"zero\": false, \"data\": true, \"offset\": 0},\n"
            "{ \"start\": 65536, \"length\": 65536, \"depth\": 2, "
            "\"present\": true, \"zero\": true, \"data\": false, "
            "\"offset\": 65536},\n"
            "{ \"start\": 131072, \"length\": 65536, \"depth\": 1, "
            "\"present\": true, \"zero\": false, \"data\": true, "
            "\"offset\": 327680},\n"
            "{ \"start\": 196608, \"length\": 65536, \"depth\": 2, "
            "\"present\": true, \"zero\": true, \"data\": false, "
            "\"offset\": 196608},\n"
            "{ \"start\": 262144, \"length\": 65536, \"depth\": 1, "
            "\"present\": true, \"zero\": true, \"data\": false},\n"
            "{ \"start\": 327680, \"length\": 720896, \"depth\": 2, "
            "\"present\": true, \"zero\": true, \"data\": false, "
            "\"offset\": 327680},\n"
            "{ \"start\": 1048576, \"length\": 1048576, \"depth\": 1, "
            "\"present\": false, \"zero\": true, \"data\": false}]\n");
}

// Compressed clusters have no host offset: human output stops with
// qemu-img's error after the header; JSON leaves the offset out.
TEST_F(MapTest, Qcow2CompressedClusters) {
  MakeSparseFile("x.raw", 1 << 20);
  WriteBytes("x.raw", 0, 64 << 10, 'x');
  ASSERT_TRUE(
      Run(RunConvert, {"-c", "-O", "qcow2", "x.raw", "c.qcow2"}).status.ok());
  CommandResult r = Map({"c.qcow2"});
  EXPECT_EQ(r.out, kHeader);
  EXPECT_EQ(r.stderr_text(),
            "imgtool: File contains external, encrypted or compressed "
            "clusters.\n");
  EXPECT_EQ(ExitCodeOf(r.status), 1);
  r = Map({"--output=json", "c.qcow2"});
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_EQ(r.out,
            "[{ \"start\": 0, \"length\": 65536, \"depth\": 0, \"present\": "
            "true, \"zero\": false, \"data\": true},\n"
            "{ \"start\": 65536, \"length\": 983040, \"depth\": 0, "
            "\"present\": false, \"zero\": true, \"data\": false}]\n");
}

}  // namespace
}  // namespace imgtool::cli

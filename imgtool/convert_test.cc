// RunConvert called directly on raw files with known layouts (and qcow2
// targets made from them): the copy is
// byte-identical, stays sparse (holes, zero-filled data extents and zeroes
// scattered through data become holes), zeroes are never written to a
// target known to be zero, and the messages, progress lines and errors are
// qemu-img 7.2's.
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "imgtool/command.h"
#include "imgtool/testing/command_runner.h"

namespace imgtool::cli {
namespace {

using testing::AllocatedBytes;
using testing::CommandResult;
using ::testing::ElementsAre;
using testing::FileSize;
using ::testing::HasSubstr;
using testing::MakeSparseFile;
using testing::MakeTestDir;
using testing::ReadFile;
using testing::WriteBytes;

using Extent = std::pair<uint64_t, uint64_t>;  // start, length

constexpr uint64_t kKiB = 1024;
constexpr uint64_t kMiB = 1024 * 1024;

// The data extents of a file (SEEK_DATA / SEEK_HOLE).
std::vector<Extent> DataExtents(const std::string& path) {
  std::vector<Extent> extents;
  const int fd = open(path.c_str(), O_RDONLY);
  if (fd < 0) return extents;
  const off_t size = lseek(fd, 0, SEEK_END);
  off_t offset = 0;
  while (offset < size) {
    const off_t data = lseek(fd, offset, SEEK_DATA);
    if (data < 0) break;
    const off_t hole = lseek(fd, data, SEEK_HOLE);
    extents.emplace_back(data, hole - data);
    offset = hole;
  }
  close(fd);
  return extents;
}

class ConvertTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_EQ(chdir(MakeTestDir().c_str()), 0); }

  static CommandResult Convert(const std::vector<std::string>& args) {
    return testing::RunCommand(RunConvert, args);
  }
  static CommandResult Compare(const std::vector<std::string>& args) {
    return testing::RunCommand(RunCompare, args);
  }
  static bool Exists(const std::string& path) {
    return std::filesystem::exists(path);
  }

  // 4 MiB: 4 KiB of data at 0, a zero-filled 1 MiB data extent at 1 MiB,
  // and at 3 MiB 512 KiB of data in which each 8 KiB holds 512 bytes of
  // data and 7.5 KiB of zeroes; holes elsewhere.
  static void MakeScattered(const std::string& path) {
    MakeSparseFile(path, 4 * kMiB);
    WriteBytes(path, 0, 4 * kKiB, 'A');
    WriteBytes(path, 1 * kMiB, 1 * kMiB, 0);
    for (int i = 0; i < 64; ++i) {
      WriteBytes(path, 3 * kMiB + i * 8 * kKiB, 512, 'B');
      WriteBytes(path, 3 * kMiB + i * 8 * kKiB + 512, 7680, 0);
    }
  }
};

TEST_F(ConvertTest, CopyIsIdenticalAndSparse) {
  MakeScattered("src.raw");
  ASSERT_GE(AllocatedBytes("src.raw"), 1536 * kKiB);
  CommandResult r = Convert({"src.raw", "dst.raw"});
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_EQ(r.out, "");
  EXPECT_EQ(r.err, "");
  EXPECT_EQ(ReadFile("dst.raw"), ReadFile("src.raw"));
  // What qemu-img convert leaves: the first 4 KiB and one 4 KiB block for
  // each 512 bytes of scattered data (runs of zeroes aligned to 4 KiB).
  std::vector<Extent> expected = {{0, 4 * kKiB}};
  for (uint64_t i = 0; i < 64; ++i) {
    expected.emplace_back(3 * kMiB + i * 8 * kKiB, 4 * kKiB);
  }
  EXPECT_EQ(DataExtents("dst.raw"), expected);
  EXPECT_LE(AllocatedBytes("dst.raw"), 65 * 4 * kKiB + 8 * kKiB);

  CommandResult c = Compare({"src.raw", "dst.raw"});
  EXPECT_TRUE(c.status.ok()) << c.status;
  EXPECT_EQ(c.out, "Images are identical.\n");
}

TEST_F(ConvertTest, HolesAndZeroExtentsAreNotWritten) {
  MakeSparseFile("src.raw", 8 * kMiB);
  WriteBytes("src.raw", 2 * kMiB, 3 * kMiB, 0);  // zero-filled data
  WriteBytes("src.raw", 6 * kMiB, 100, 'x');
  CommandResult r = Convert({"-f", "raw", "-O", "raw", "src.raw", "dst.raw"});
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_EQ(FileSize("dst.raw"), 8 * kMiB);
  EXPECT_EQ(ReadFile("dst.raw"), ReadFile("src.raw"));
  // The block written at creation, and the one with data.
  EXPECT_THAT(DataExtents("dst.raw"),
              ElementsAre(Extent{0, 4 * kKiB}, Extent{6 * kMiB, 4 * kKiB}));
}

TEST_F(ConvertTest, SparseSizeSetsTheShortestHole) {
  MakeScattered("src.raw");
  // -S 8k: the 7.5 KiB runs of zeroes are too short to become holes.
  CommandResult r = Convert({"-S", "8k", "src.raw", "dst.raw"});
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_EQ(ReadFile("dst.raw"), ReadFile("src.raw"));
  EXPECT_THAT(DataExtents("dst.raw"),
              ElementsAre(Extent{0, 4 * kKiB}, Extent{3 * kMiB, 512 * kKiB}));
  // -S 512: every zero sector in the data is skipped, 512-byte aligned
  // (the file system allocates whole 4 KiB blocks).
  r = Convert({"-S", "512", "src.raw", "dst2.raw"});
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_EQ(ReadFile("dst2.raw"), ReadFile("src.raw"));
  EXPECT_EQ(DataExtents("dst2.raw").size(), 65u);
}

TEST_F(ConvertTest, SparseSizeZeroAllocatesEverything) {
  MakeScattered("src.raw");
  CommandResult r = Convert({"-S", "0", "src.raw", "dst.raw"});
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_EQ(ReadFile("dst.raw"), ReadFile("src.raw"));
  EXPECT_THAT(DataExtents("dst.raw"), ElementsAre(Extent{0, 4 * kMiB}));
}

TEST_F(ConvertTest, ParallelAndOutOfOrderWritesGiveTheSameImage) {
  MakeScattered("src.raw");
  WriteBytes("src.raw", 4 * kMiB, 5 * kMiB, 'C');  // several 2 MiB chunks
  ASSERT_TRUE(Convert({"-m", "1", "src.raw", "a.raw"}).status.ok());
  ASSERT_TRUE(Convert({"-m", "16", "-W", "src.raw", "b.raw"}).status.ok());
  ASSERT_TRUE(Convert({"-m", "3", "src.raw", "c.raw"}).status.ok());
  const std::string content = ReadFile("src.raw");
  EXPECT_EQ(ReadFile("a.raw"), content);
  EXPECT_EQ(ReadFile("b.raw"), content);
  EXPECT_EQ(ReadFile("c.raw"), content);
  EXPECT_EQ(DataExtents("b.raw"), DataExtents("a.raw"));
  EXPECT_EQ(DataExtents("c.raw"), DataExtents("a.raw"));
}

TEST_F(ConvertTest, SourcesAreConcatenatedInWhole512ByteSectors) {
  WriteBytes("a.raw", 0, 1000, 'a');
  MakeSparseFile("b.raw", 0);
  WriteBytes("c.raw", 0, 3 * kMiB, 'c');
  CommandResult r = Convert({"a.raw", "b.raw", "c.raw", "a.raw", "dst.raw"});
  ASSERT_TRUE(r.status.ok()) << r.status;
  const std::string a = ReadFile("a.raw") + std::string(24, '\0');
  EXPECT_EQ(ReadFile("dst.raw"), a + ReadFile("c.raw") + a);
}

TEST_F(ConvertTest, ProgressLinesAreQemuImgs) {
  MakeScattered("src.raw");
  // 3080 data sectors: 8, then 2048 (66.75%), then 1024.
  CommandResult r = Convert({"-p", "src.raw", "dst.raw"});
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_EQ(r.out,
            "    (0.00/100%)\r    (66.75/100%)\r    (100.00/100%)\r"
            "    (100.00/100%)\r\n");
  EXPECT_EQ(r.err, "");
  r = Convert({"-p", "-q", "src.raw", "dst2.raw"});
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_EQ(r.out, "");
  // On failure the line is ended too.
  r = Convert({"-p", "missing.raw", "dst3.raw"});
  EXPECT_FALSE(r.status.ok());
  EXPECT_EQ(r.out, "    (0.00/100%)\r\n");
}

TEST_F(ConvertTest, ExistingTargetGetsZeroesWrittenWhereTheSourceHasNone) {
  MakeScattered("src.raw");
  WriteBytes("dst.raw", 0, 5 * kMiB, 'g');
  CommandResult r = Convert({"-n", "src.raw", "dst.raw"});
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_EQ(FileSize("dst.raw"), 5 * kMiB);
  EXPECT_EQ(ReadFile("dst.raw").substr(0, 4 * kMiB), ReadFile("src.raw"));
  EXPECT_EQ(ReadFile("dst.raw").substr(4 * kMiB), std::string(kMiB, 'g'));
  // The zeroes were written as holes (write zeroes with unmap).
  std::vector<Extent> expected = {{0, 4 * kKiB}};
  for (uint64_t i = 0; i < 64; ++i) {
    expected.emplace_back(3 * kMiB + i * 8 * kKiB, 4 * kKiB);
  }
  expected.emplace_back(4 * kMiB, kMiB);
  EXPECT_EQ(DataExtents("dst.raw"), expected);
}

TEST_F(ConvertTest, TargetIsZeroSkipsZeroRanges) {
  MakeScattered("src.raw");
  // The user says the target is zero: convert must not write zeroes, so
  // the (pretended) garbage stays where the source reads as zeroes.
  WriteBytes("dst.raw", 0, 4 * kMiB, 'g');
  CommandResult r = Convert({"-n", "--target-is-zero", "src.raw", "dst.raw"});
  ASSERT_TRUE(r.status.ok()) << r.status;
  const std::string out = ReadFile("dst.raw");
  EXPECT_EQ(out.substr(0, 4 * kKiB), std::string(4 * kKiB, 'A'));
  EXPECT_EQ(out.substr(4 * kKiB, 4 * kKiB), std::string(4 * kKiB, 'g'));
  EXPECT_EQ(out.substr(1 * kMiB, kMiB), std::string(kMiB, 'g'));
  EXPECT_EQ(out.substr(3 * kMiB, 512), std::string(512, 'B'));
  // The zeroes next to the data in its 4 KiB block are written with it.
  EXPECT_EQ(out.substr(3 * kMiB + 512, 3584), std::string(3584, '\0'));
  EXPECT_EQ(out.substr(3 * kMiB + 4 * kKiB, 4 * kKiB),
            std::string(4 * kKiB, 'g'));
}

TEST_F(ConvertTest, ConvertingAnImageOntoItselfLeavesItAlone) {
  MakeScattered("x.raw");
  const std::string before = ReadFile("x.raw");
  CommandResult r = Convert({"x.raw", "x.raw"});
  EXPECT_EQ(r.status.message(),
            "x.raw: error while converting raw: Failed to get \"write\" lock\n"
            "Is another process using the image [x.raw]?");
  r = Convert({"-n", "x.raw", "x.raw"});
  EXPECT_EQ(r.status.message(),
            "Could not open 'x.raw': Failed to get \"write\" lock\n"
            "Is another process using the image [x.raw]?");
  EXPECT_EQ(ReadFile("x.raw"), before);
}

// iotest 113: a source in a format imgtool cannot read (bochs) converted
// to a format without image creation fails on the target's format, as
// qemu-img does once it opened the source; with a target format that can
// create images the source's error stays.
TEST_F(ConvertTest, TargetWithoutImageCreationAfterAnUnreadableSource) {
  MakeSparseFile("empty.bochs", 4 * kKiB);
  CommandResult r = Convert(
      {"-f", "bochs", "-O", "bochs", "empty.bochs", "nbd://example.com"});
  EXPECT_EQ(r.status.code(), absl::StatusCode::kUnimplemented);
  EXPECT_EQ(r.status.message(),
            "Format driver 'bochs' does not support image creation");
  r = Convert({"-f", "bochs", "-O", "raw", "empty.bochs", "y.raw"});
  EXPECT_EQ(r.status.message(),
            "Could not open 'empty.bochs': Format 'bochs' is not supported yet");
  r = Convert({"-O", "quorum", "empty.bochs", "y.raw"});
  EXPECT_EQ(r.status.message(),
            "Format driver 'quorum' does not support image creation");
  EXPECT_FALSE(Exists("y.raw"));
}

TEST_F(ConvertTest, TargetSmallerThanSourcesIsRefused) {
  MakeSparseFile("src.raw", 2 * kMiB);
  MakeSparseFile("dst.raw", 1 * kMiB);
  CommandResult r = Convert({"-n", "src.raw", "dst.raw"});
  EXPECT_EQ(r.status.message(), "output file is smaller than input file");
  EXPECT_EQ(ExitCodeOf(r.status), 1);
}

TEST_F(ConvertTest, Errors) {
  MakeSparseFile("src.raw", 1 * kMiB);
  struct Case {
    std::vector<std::string> args;
    std::string message;
  };
  const Case cases[] = {
      {{"src.raw"}, "Must specify image file name"},
      {{"-S", "1000", "src.raw", "d.raw"},
       "Invalid buffer size for sparse output specified. Valid sizes are "
       "multiples of 512 up to 16777216. Select 0 to disable sparse "
       "detection (fully allocates output)."},
      {{"-S", "3x", "src.raw", "d.raw"},
       "Invalid buffer size for sparse output specified. You may use k, M, "
       "G, T, P or E suffixes for\nkilobytes, megabytes, gigabytes, "
       "terabytes, petabytes and exabytes."},
      {{"-m", "17", "src.raw", "d.raw"},
       "Invalid number of coroutines. Allowed number of coroutines is "
       "between 1 and 16"},
      {{"-T", "foo", "src.raw", "d.raw"}, "Invalid source cache option: foo"},
      {{"--target-is-zero", "src.raw", "d.raw"},
       "--target-is-zero requires use of -n flag"},
      {{"-n", "-o", "size=1M", "src.raw", "d.raw"},
       "-o has no effect when skipping image creation"},
      {{"-O", "foo", "src.raw", "d.raw"}, "Unknown file format 'foo'"},
      {{"-o", "foo=1", "src.raw", "d.raw"}, "Invalid parameter 'foo'"},
      {{"-o", "preallocation=bad", "src.raw", "d.raw"},
       "d.raw: error while converting raw: invalid parameter value: bad"},
      {{"-B", "base.raw", "src.raw", "d.raw"},
       "Backing file not supported for file format 'raw'"},
      {{"missing.raw", "d.raw"},
       "Could not open 'missing.raw': Could not open 'missing.raw': No such "
       "file or directory"},
      {{"src.raw", "nodir/d.raw"},
       "nodir/d.raw: error while converting raw: Could not create "
       "'nodir/d.raw': No such file or directory"},
      {{"-n", "src.raw", "missing.raw"},
       "Could not open 'missing.raw': Could not open 'missing.raw': No such "
       "file or directory"},
  };
  for (const Case& c : cases) {
    CommandResult r = Convert(c.args);
    EXPECT_EQ(r.status.message(), c.message) << c.args[0];
    EXPECT_EQ(ExitCodeOf(r.status), 1) << c.args[0];
    EXPECT_EQ(r.out, "") << c.args[0];
  }
  EXPECT_FALSE(Exists("d.raw"));
  // qemu-img checks the target's cache mode only after creating it.
  CommandResult r = Convert({"-t", "foo", "src.raw", "t.raw"});
  EXPECT_EQ(r.status.message(), "Invalid cache option: foo");
  EXPECT_TRUE(Exists("t.raw"));
}

// raw -> qcow2 -> raw (plain and compressed): the same bytes, and the
// qcow2 target skips the zero ranges (a new qcow2 image reads as zeroes).
TEST_F(ConvertTest, Qcow2RoundTrip) {
  MakeScattered("src.raw");
  for (const char* compress : {"", "-c"}) {
    std::vector<std::string> args = {"-O", "qcow2", "src.raw", "q.qcow2"};
    if (*compress != '\0') args.insert(args.begin(), compress);
    CommandResult r = Convert(args);
    ASSERT_TRUE(r.status.ok()) << r.status;
    EXPECT_EQ(r.out, "");
    EXPECT_EQ(ReadFile("q.qcow2").substr(0, 4), "QFI\xfb");
    CommandResult c = Compare({"-f", "raw", "-F", "qcow2", "src.raw",
                               "q.qcow2"});
    EXPECT_EQ(c.out, "Images are identical.\n") << compress;
    r = Convert({"-f", "qcow2", "q.qcow2", "back.raw"});
    ASSERT_TRUE(r.status.ok()) << r.status;
    EXPECT_EQ(ReadFile("back.raw"), ReadFile("src.raw")) << compress;
  }
  // Uncompressed: the 4 KiB at 0 and the 512 KiB of scattered data at
  // 3 MiB take nine 64 KiB clusters; with the metadata, under 1 MiB.
  ASSERT_TRUE(Convert({"-O", "qcow2", "src.raw", "p.qcow2"}).status.ok());
  EXPECT_LT(FileSize("p.qcow2"), 1 * kMiB);
}

TEST_F(ConvertTest, Qcow2TargetErrors) {
  MakeSparseFile("src.raw", 1 * kMiB);
  CommandResult r = Convert({"-O", "qcow2", "-B", "base.raw", "src.raw",
                             "d.qcow2"});
  EXPECT_EQ(r.status.message(),
            "Use of backing file requires explicit backing format");
  r = Convert({"-O", "qcow2", "-o", "cluster_size=1000", "src.raw",
               "d.qcow2"});
  EXPECT_EQ(r.status.message(),
            "d.qcow2: error while converting qcow2: Cluster size must be a "
            "power of two between 512 and 2048k");
  EXPECT_FALSE(Exists("d.qcow2"));
  r = Convert({"-c", "src.raw", "d.raw"});
  EXPECT_EQ(r.status.message(),
            "Compression not supported for this file format");
  r = Convert({"-O", "qcow2", "-c", "-o", "preallocation=full", "src.raw",
               "d.qcow2"});
  EXPECT_EQ(r.status.message(),
            "Compression and preallocation not supported at the same time");
  r = Convert({"-O", "qcow2", "-o", "help"});
  EXPECT_THAT(r.out, HasSubstr("Supported qcow2 options:\n"
                               "  backing_file=<str>     - File name of a "
                               "base image\n"));
}

TEST_F(ConvertTest, OptionHelpListsTheCreateOptions) {
  CommandResult r = Convert({"-o", "help", "src.raw", "d.raw"});
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_THAT(r.out, HasSubstr("Supported options:\n  extent_size_hint="));
  EXPECT_FALSE(Exists("d.raw"));
}

}  // namespace
}  // namespace imgtool::cli

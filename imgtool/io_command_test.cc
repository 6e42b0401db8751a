// RunIo called directly on raw files: the exact lines qemu-io 7.2 prints for
// the same commands (timing lines, which vary, are checked by shape and then
// left out of the comparisons).
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <regex>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "base/testing/small_stack.h"
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

const std::regex kTimingLine(
    R"(^[0-9.]+ (bytes|KiB|MiB|GiB), 1 ops; (00\.[0-9]{2} sec|[0-9]+:[0-9]{2}:[0-9]{2}\.[0-9]{2}) \([0-9.]+ (bytes|KiB|MiB|GiB|TiB|PiB|EiB)/sec and [0-9]+\.[0-9]{4} ops/sec\)$)");
const std::regex kMachineLine(
    R"(^[0-9]+,1,[0-9]+:[0-9]{2}:[0-9]{2}\.[0-9]{2},[0-9]+\.[0-9]{3},[0-9]+\.[0-9]{3}$)");

// The output without timing lines; fails the test if a line that looks
// like one has the wrong shape.
std::string WithoutTiming(const std::string& text) {
  std::vector<std::string> kept;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    const std::string l(line);
    if (l.find(" ops; ") != std::string::npos) {
      EXPECT_TRUE(std::regex_match(l, kTimingLine)) << l;
      continue;
    }
    if (std::count(l.begin(), l.end(), ',') == 4) {
      EXPECT_TRUE(std::regex_match(l, kMachineLine)) << l;
      continue;
    }
    kept.push_back(l);
  }
  return absl::StrJoin(kept, "\n");
}

class IoTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_EQ(chdir(MakeTestDir().c_str()), 0);
    MakeSparseFile("x.raw", 1 << 20);
  }

  // Runs `imgtool io -f raw [extra] -c C... x.raw`.
  static CommandResult Io(const std::vector<std::string>& commands,
                          const std::vector<std::string>& extra = {}) {
    std::vector<std::string> args = {"-f", "raw"};
    args.insert(args.end(), extra.begin(), extra.end());
    for (const std::string& c : commands) {
      args.push_back("-c");
      args.push_back(c);
    }
    args.push_back("x.raw");
    return testing::RunCommand(RunIo, args);
  }
};

TEST_F(IoTest, WriteAndReadPrintQemuIoReports) {
  CommandResult r = Io(
      {"write 0 4k", "write -P 0xab 4k 4k", "read 0 4k", "read -P 0xab 4k 4k"});
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_EQ(WithoutTiming(r.out),
            "wrote 4096/4096 bytes at offset 0\n"
            "wrote 4096/4096 bytes at offset 4096\n"
            "read 4096/4096 bytes at offset 0\n"
            "read 4096/4096 bytes at offset 4096\n");
  EXPECT_EQ(r.err, "");
  const std::string bytes = ReadFile("x.raw");
  ASSERT_EQ(bytes.size(), 1u << 20);
  EXPECT_EQ(bytes.substr(0, 4096), std::string(4096, '\xcd'));
  EXPECT_EQ(bytes.substr(4096, 4096), std::string(4096, '\xab'));
  EXPECT_EQ(bytes.substr(8192, 4096), std::string(4096, '\0'));
}

TEST_F(IoTest, TimingLineHasQemuIoShape) {
  CommandResult r = Io({"write 0 1536", "write 0 1", "read -C 0 4k"});
  ASSERT_TRUE(r.status.ok()) << r.status;
  std::vector<std::string> lines = absl::StrSplit(r.out, '\n');
  ASSERT_EQ(lines.size(), 6u);
  EXPECT_THAT(lines[1], ::testing::StartsWith("1.500 KiB, 1 ops; 00."));
  EXPECT_THAT(lines[3], ::testing::StartsWith("1 bytes, 1 ops; 00."));
  EXPECT_THAT(lines[4], ::testing::StartsWith("4096,1,0:00:00.0"));
  EXPECT_TRUE(std::regex_match(lines[1], kTimingLine)) << lines[1];
  EXPECT_TRUE(std::regex_match(lines[4], kMachineLine)) << lines[4];
}

TEST_F(IoTest, QuietPrintsNothing) {
  CommandResult r = Io({"write -q 0 512", "read -q 0 512", "read -q -v 0 16",
                        "discard -q 0 512"});
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_EQ(r.out, "");
}

TEST_F(IoTest, PatternMismatchIsReportedAndFailsTheRun) {
  WriteBytes("x.raw", 4096, 4096, 0x11);
  CommandResult r =
      Io({"read -P 0x11 0 4k", "read -q -P 0x11 0 8k",
          "read -P 0x11 -s 4k -l 4k 0 8k", "read -P 0x11 -s 2k -l 4k 0 8k",
          "read -P 0x11 -s 9k 0 8k"});
  EXPECT_FALSE(r.status.ok());
  EXPECT_EQ(r.status.message(), "");  // main prints nothing more
  EXPECT_EQ(ExitCodeOf(r.status), 1);
  EXPECT_EQ(WithoutTiming(r.out),
            "Pattern verification failed at offset 0, 4096 bytes\n"
            "read 4096/4096 bytes at offset 0\n"
            "Pattern verification failed at offset 0, 8192 bytes\n"
            "read 8192/8192 bytes at offset 0\n"
            "Pattern verification failed at offset 2048, 4096 bytes\n"
            "read 8192/8192 bytes at offset 0\n"
            "pattern verification range exceeds end of read data\n");
}

TEST_F(IoTest, HexDumpShowsLettersAndDigitsOnly) {
  WriteBytes("x.raw", 0, 20, 'A');
  WriteBytes("x.raw", 20, 4, '!');
  WriteBytes("x.raw", 24, 4, '7');
  CommandResult r = Io({"read -v 3 26"});
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_EQ(WithoutTiming(r.out),
            "00000003:  41 41 41 41 41 41 41 41 41 41 41 41 41 41 41 41  "
            "AAAAAAAAAAAAAAAA\n"
            "00000013:  41 21 21 21 21 37 37 37 37 00  A....7777.\n"
            "read 26/26 bytes at offset 3\n");
}

TEST_F(IoTest, ErrorsAreReportedAndLaterCommandsStillRun) {
  CommandResult r =
      Io({"write 1M 512", "read 1020k 8k", "write 0 4x", "write -P 0x1ff 0 512",
          "write 0 3G", "read 0 3G", "write 0 16E", "foo", "write 0",
          "write -x 0 1", "length"});
  EXPECT_FALSE(r.status.ok());
  EXPECT_EQ(ExitCodeOf(r.status), 1);
  EXPECT_EQ(r.out,
            "write failed: Input/output error\n"
            "read failed: Input/output error\n"
            "Parsing error: non-numeric argument, or extraneous/unrecognized "
            "suffix -- 4x\n"
            "0x1ff is not a valid pattern byte\n"
            "length cannot exceed 2147483136 without -n, given 3G\n"
            "length cannot exceed 2147483136, given 3G\n"
            "Parsing error: argument too large -- 16E\n"
            "write [-bcCfnquz] [-P pattern | -s source_file] off len -- "
            "writes a number of bytes at a specified offset\n"
            "1 MiB\n");
  EXPECT_EQ(r.err,
            "command \"foo\" not found\n"
            "bad argument count 1 to write, expected at least 2 arguments\n"
            "write: invalid option -- 'x'\n");
}

TEST_F(IoTest, SizesTakeSuffixesAndHexSuffixIsDeprecated) {
  CommandResult r =
      Io({"write -q 0 1.5k", "write 1 0x200", "write 0 0x10k", "alloc 0 1.7k"});
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_EQ(WithoutTiming(r.out),
            "wrote 512/512 bytes at offset 1\n"
            "wrote 16384/16384 bytes at offset 0\n"
            "1741/1741 bytes allocated at offset 0 bytes\n");
  EXPECT_EQ(r.err,
            "imgtool: warning: Using a multiplier suffix on hex numbers is "
            "deprecated: 0x10k\n");
}

TEST_F(IoTest, WriteZeroesAndDiscardClearData) {
  WriteBytes("x.raw", 0, 1 << 20, 0x5a);
  CommandResult r =
      Io({"write -z 0 64k", "write -z -u 64k 64k", "discard 128k 64k",
          "read -P 0 0 192k", "read -P 0x5a 192k 4k"});
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_EQ(WithoutTiming(r.out),
            "wrote 65536/65536 bytes at offset 0\n"
            "wrote 65536/65536 bytes at offset 65536\n"
            "discard 65536/65536 bytes at offset 131072\n"
            "read 196608/196608 bytes at offset 0\n"
            "read 4096/4096 bytes at offset 196608\n");
}

TEST_F(IoTest, DiscardIgnoredKeepsData) {
  WriteBytes("x.raw", 0, 4096, 0x5a);
  CommandResult r =
      Io({"discard -q 0 4k", "read -q -P 0x5a 0 4k"}, {"-d", "ignore"});
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_EQ(r.out, "");
}

TEST_F(IoTest, WriteOptionConflicts) {
  CommandResult r = Io({"write -z -P 1 0 1", "write -u 0 1", "write -n 0 1",
                        "write -c 1 512", "write -b 0 1", "write -c 0 512"});
  EXPECT_EQ(ExitCodeOf(r.status), 1);
  EXPECT_EQ(r.out,
            "Only one of -z, -P, and -s can be specified at the same time\n"
            "-u requires -z to be specified\n"
            "-n requires -z to be specified\n"
            "1 is not a sector-aligned value for 'offset'\n"
            "1 is not a sector-aligned value for 'count'\n"
            "write failed: Operation not supported\n");
}

TEST_F(IoTest, WriteFromSourceFileRepeatsIt) {
  { std::ofstream("src.bin") << "abc"; }
  CommandResult r = Io({"write -q -s src.bin 0 10", "read -v 0 10"});
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_EQ(WithoutTiming(r.out),
            "00000000:  61 62 63 61 62 63 61 62 63 61  abcabcabca\n"
            "read 10/10 bytes at offset 0\n");
}

TEST_F(IoTest, MapAndAllocOnRawFile) {
  MakeSparseFile("x.raw", 1000);
  CommandResult r = Io({"length", "map", "alloc 0", "alloc 0 2000",
                        "alloc 512 100", "alloc 1024", "alloc 4k 1"});
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_EQ(r.out,
            "1 KiB\n"
            "1 KiB (0x400) bytes     allocated at offset 0 bytes (0x0)\n"
            "512/512 bytes allocated at offset 0 bytes\n"
            "1024/1024 bytes allocated at offset 0 bytes\n"
            "100/100 bytes allocated at offset 512 bytes\n"
            "0/0 bytes allocated at offset 1 KiB\n"
            "0/0 bytes allocated at offset 4 KiB\n");
}

TEST_F(IoTest, TruncateChangesLength) {
  CommandResult r = Io({"truncate 3M", "length", "map", "truncate 1.5k",
                        "length", "truncate -m falloc 2M", "length",
                        "truncate -m foo 1M", "truncate 0", "length", "map"});
  EXPECT_EQ(ExitCodeOf(r.status), 1);
  EXPECT_EQ(r.out,
            "3 MiB\n"
            "3 MiB (0x300000) bytes     allocated at offset 0 bytes (0x0)\n"
            "1.500 KiB\n"
            "2 MiB\n"
            "0 bytes\n");
  EXPECT_EQ(r.err, "imgtool: Invalid preallocation mode 'foo'\n");
  EXPECT_EQ(testing::FileSize("x.raw"), 0u);
}

TEST_F(IoTest, InfoForRaw) {
  CommandResult r = Io({"info"});
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_EQ(r.out,
            "format name: raw\n"
            "cluster size: 0 bytes\n"
            "vm state offset: 0 bytes\n");
}

TEST_F(IoTest, AioCompletesByAioFlush) {
  CommandResult r =
      Io({"aio_write -P 0x11 0 4k", "aio_flush", "aio_read -P 0x11 0 2k 2k",
          "aio_flush", "aio_read -P 0x22 0 4k", "aio_flush", "aio_write 1M 512",
          "aio_flush", "aio_read -q 0 1", "aio_read -i 0 1"});
  // aio requests succeed once submitted, whatever their outcome.
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_EQ(WithoutTiming(r.out),
            "wrote 4096/4096 bytes at offset 0\n"
            "read 4096/4096 bytes at offset 0\n"
            "Pattern verification failed at offset 0, 4096 bytes\n"
            "read 4096/4096 bytes at offset 0\n"
            "aio_write failed: Input/output error\n"
            "injecting invalid read request\n");
  EXPECT_EQ(ReadFile("x.raw").substr(0, 4096), std::string(4096, '\x11'));
}

TEST_F(IoTest, AioInFlightCompletesAtClose) {
  CommandResult r = Io({"aio_write -P 0x33 8k 4k"});
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_EQ(WithoutTiming(r.out), "wrote 4096/4096 bytes at offset 8192\n");
  EXPECT_EQ(ReadFile("x.raw").substr(8192, 4096), std::string(4096, '\x33'));
}

TEST_F(IoTest, ManyAioWritesInFlight) {
  std::vector<std::string> commands;
  for (int i = 0; i < 32; ++i) {
    commands.push_back("aio_write -q -P " + std::to_string(i) + " " +
                       std::to_string(i * 4096) + " 4k");
  }
  commands.push_back("aio_flush");
  for (int i = 0; i < 32; ++i) {
    commands.push_back("read -q -P " + std::to_string(i) + " " +
                       std::to_string(i * 4096) + " 4k");
  }
  CommandResult r = Io(commands);
  ASSERT_TRUE(r.status.ok()) << r.status << r.out;
  EXPECT_EQ(r.out, "");
}

// `imgtool io -f qcow2` with thousands of aio_write commands queued before
// aio_flush: the writes queue for the qcow2 driver's metadata lock and for
// each other's cluster allocations, and each one that goes on wakes the
// next. Those wakeups used to nest in each other's stack frames, one chain
// per queued write: on a 256 KiB stack this crashed (SIGSEGV), as did ASan
// builds of imgtool on the 8 MiB main stack.
TEST_F(IoTest, ThousandsOfAioWritesOnASmallStack) {
  ASSERT_EQ(std::system("qemu-img create -q -f qcow2 deep.qcow2 64M"), 0);
  constexpr int kWrites = 5000;
  std::vector<std::string> args = {"-f", "qcow2"};
  for (int i = 0; i < kWrites; ++i) {
    args.insert(args.end(), {"-c", "aio_write -q -P " + std::to_string(i % 251) +
                                       " " + std::to_string(i * 4096 + 512) +
                                       " 4k"});
  }
  args.insert(args.end(), {"-c", "aio_flush"});
  for (int i = 0; i < kWrites; i += 499) {
    args.insert(args.end(), {"-c", "read -q -P " + std::to_string(i % 251) +
                                       " " + std::to_string(i * 4096 + 512) +
                                       " 4k"});
  }
  args.push_back("deep.qcow2");
  CommandResult r;
  ::imgtool::testing::RunWithStack(256 << 10,
                                   [&] { r = testing::RunCommand(RunIo, args); });
  ASSERT_TRUE(r.status.ok()) << r.status << r.out;
  EXPECT_EQ(r.out, "");
  EXPECT_EQ(std::system("qemu-img check -q deep.qcow2"), 0);
}

TEST_F(IoTest, VectoredCommands) {
  CommandResult r = Io({"writev -P 5 0 1k 1k", "readv -P 5 0 1k 1k",
                        "readv 0 3G", "readv 0 1G 1G 1G"});
  EXPECT_EQ(ExitCodeOf(r.status), 1);
  EXPECT_EQ(WithoutTiming(r.out),
            "wrote 2048/2048 bytes at offset 0\n"
            "read 2048/2048 bytes at offset 0\n"
            "Argument '3G' exceeds maximum size 2147483136\n"
            "The total number of bytes exceed the maximum size "
            "2147483136\n");
}

TEST_F(IoTest, ReadOnlyRefusesWrites) {
  CommandResult r = Io({"write 0 1", "write -z 0 1", "discard 0 1",
                        "truncate 0", "aio_write 0 1", "read -q 0 1", "flush"},
                       {"-r"});
  EXPECT_EQ(ExitCodeOf(r.status), 1);
  EXPECT_EQ(r.out, "");
  std::string refused;
  for (int i = 0; i < 5; ++i) refused += "imgtool: Block node is read-only\n";
  EXPECT_EQ(r.err, refused);
  EXPECT_EQ(testing::FileSize("x.raw"), 1u << 20);
}

TEST_F(IoTest, QuitStopsTheCommandList) {
  CommandResult r = Io({"write -q 0 1", "quit", "write -q 1 1"});
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_EQ(ReadFile("x.raw").substr(0, 2), std::string("\xcd\0", 2));
}

TEST_F(IoTest, OpenErrors) {
  CommandResult r =
      testing::RunCommand(RunIo, {"-f", "raw", "-c", "length", "none.raw"});
  EXPECT_EQ(r.status.message(),
            "can't open device none.raw: Could not open 'none.raw': No such "
            "file or directory");
  r = testing::RunCommand(RunIo, {"-f", "raw", "-t", "foo", "x.raw"});
  EXPECT_EQ(r.status.message(), "Invalid cache option: foo");
  r = testing::RunCommand(RunIo, {"-f", "raw", "-U", "-c", "length", "x.raw"});
  EXPECT_EQ(r.status.message(),
            "can't open device x.raw: force-share=on can only be used with "
            "read-only images");
}

TEST_F(IoTest, WithoutFileCommandsNeedingOneFail) {
  CommandResult r =
      testing::RunCommand(RunIo, {"-c", "length", "-c", "sleep 1"});
  EXPECT_EQ(ExitCodeOf(r.status), 1);
  EXPECT_EQ(r.err, "no file open, try 'help open'\n");
}

}  // namespace
}  // namespace imgtool::cli

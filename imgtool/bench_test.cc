#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "imgtool/command.h"

namespace imgtool::cli {
namespace {

using ::testing::HasSubstr;
using ::testing::MatchesRegex;

std::string TempPath(const std::string& name) {
  const char* dir = std::getenv("TEST_TMPDIR");
  return std::string(dir != nullptr ? dir : "/tmp") + "/" + name;
}

// A raw image of `size` zero bytes.
std::string MakeImage(const std::string& name, uint64_t size) {
  const std::string path = TempPath(name);
  std::filesystem::remove(path);
  { std::ofstream(path, std::ios::binary); }
  std::filesystem::resize_file(path, size);
  return path;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

struct Result {
  absl::Status status;
  std::string out;
  std::string err;
};

Result Bench(std::vector<std::string> args) {
  std::ostringstream out, err;
  absl::Status st = RunBench(args, Streams{out, err});
  return {st, out.str(), err.str()};
}

// Indices of the 4 KiB pages of `path` that start with `byte`.
std::vector<int> PagesWith(const std::string& path, uint8_t byte) {
  const std::string data = ReadFile(path);
  std::vector<int> pages;
  for (size_t i = 0; i < data.size(); i += 4096) {
    if (static_cast<uint8_t>(data[i]) == byte) pages.push_back(i / 4096);
  }
  return pages;
}

TEST(BenchTest, PrintsQemuImgLinesForReads) {
  const std::string img = MakeImage("read.raw", 1 << 20);
  Result r = Bench({"-f", "raw", "-c", "16", "-d", "4", img});
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_THAT(r.out,
              MatchesRegex("Sending 16 read requests, 4096 bytes each, 4 in "
                           "parallel \\(starting at offset 0, step size "
                           "4096\\)\nRun completed in [0-9]+\\.[0-9]{3} "
                           "seconds\\.\n"));
  EXPECT_EQ(r.err, "");
}

TEST(BenchTest, DefaultsAndStepEqualsSize) {
  const std::string img = MakeImage("defaults.raw", 1 << 20);
  Result r = Bench({"-f", "raw", "-c", "0", "-s", "8k", img});
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_THAT(r.out, HasSubstr("Sending 0 read requests, 8192 bytes each, 64 "
                               "in parallel (starting at offset 0, step size "
                               "8192)\n"));
}

TEST(BenchTest, PrintsFlushLineAndWritesWithFlushes) {
  const std::string img = MakeImage("flush.raw", 64 << 10);
  for (bool drain : {true, false}) {
    SCOPED_TRACE(drain ? "drain" : "no-drain");
    std::filesystem::resize_file(img, 0);
    std::filesystem::resize_file(img, 64 << 10);
    std::vector<std::string> args = {"-f", "raw", "-w", "-c", "16", "-d",
                                     "4", "--pattern=0x5a", "--flush-interval=4"};
    if (!drain) args.push_back("--no-drain");
    args.push_back(img);
    Result r = Bench(args);
    ASSERT_TRUE(r.status.ok()) << r.status;
    EXPECT_THAT(r.out,
                MatchesRegex("Sending 16 write requests, 4096 bytes each, 4 in "
                             "parallel \\(starting at offset 0, step size "
                             "4096\\)\nSending flush every 4 requests\nRun "
                             "completed in [0-9]+\\.[0-9]{3} seconds\\.\n"));
    EXPECT_EQ(ReadFile(img), std::string(64 << 10, '\x5a'));
  }
}

TEST(BenchTest, WritesWrapAroundAtImageEndLikeQemuImg) {
  // 64 KiB image, start 4 KiB, step 12 KiB: 4k 16k 28k 40k 52k, then
  // (64k) % 64k = 0 and 12k. qemu-img 7.2 writes pages 0 1 3 4 7 10 13.
  const std::string img = MakeImage("wrap.raw", 64 << 10);
  Result r = Bench({"-f", "raw", "-w", "-c", "7", "-d", "2", "-s", "4k", "-S",
                    "12k", "-o", "4k", "--pattern=0xaa", img});
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_THAT(PagesWith(img, 0xaa),
              ::testing::ElementsAre(0, 1, 3, 4, 7, 10, 13));
  EXPECT_THAT(PagesWith(img, 0x00).size(), 16 - 7);
}

TEST(BenchTest, RandomOffsetsAreSplitMix64SlotsForTheSeed) {
  // Slots SplitMix64(seed) % 16 of a 16-page image, one draw per request
  // (computed independently in Python from the published algorithm):
  // seed 1: 1 7 14 11 9 0; seed 7: 7 12 2 11 10 1. The image is 100 bytes
  // longer than 16 pages: the tail is no slot, so nothing lands there.
  struct Case {
    std::vector<std::string> flag;
    std::vector<int> pages;
  };
  for (const Case& c : {Case{{"--random"}, {0, 1, 7, 9, 11, 14}},
                        Case{{"--random=1"}, {0, 1, 7, 9, 11, 14}},
                        Case{{"--random=7"}, {1, 2, 7, 10, 11, 12}}}) {
    SCOPED_TRACE(c.flag[0]);
    const std::string img = MakeImage("random.raw", (64 << 10) + 100);
    std::vector<std::string> args = {"-f", "raw", "-w", "-c", "6", "-d", "2",
                                     "--pattern=0xaa"};
    args.insert(args.end(), c.flag.begin(), c.flag.end());
    args.push_back(img);
    Result r = Bench(args);
    ASSERT_TRUE(r.status.ok()) << r.status;
    EXPECT_THAT(r.out, MatchesRegex("Sending 6 write requests, 4096 bytes "
                                    "each, 2 in parallel \\(random offsets, "
                                    "seed [17]\\)\nRun completed in "
                                    "[0-9]+\\.[0-9]{3} seconds\\.\n"));
    EXPECT_THAT(PagesWith(img, 0xaa), ::testing::ElementsAreArray(c.pages));
    EXPECT_EQ(ReadFile(img).substr(16 * 4096), std::string(100, '\0'));
  }
}

TEST(BenchTest, RandomOffsetsRefuseStepOffsetAndTooSmallImages) {
  const std::string img = MakeImage("random-bad.raw", 64 << 10);
  for (const std::vector<std::string>& extra :
       {std::vector<std::string>{"-S", "8k"},
        std::vector<std::string>{"-o", "0"}}) {
    std::vector<std::string> args = {"-f", "raw", "--random"};
    args.insert(args.end(), extra.begin(), extra.end());
    args.push_back(img);
    Result r = Bench(args);
    EXPECT_EQ(r.status.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(r.status.message(), "--random can't be combined with -S or -o");
  }
  Result seed = Bench({"-f", "raw", "--random=x", img});
  EXPECT_EQ(seed.status.message(), "Invalid random seed specified");
  Result zero = Bench({"-f", "raw", "--random", "-s", "0", img});
  EXPECT_EQ(zero.status.message(), "--random needs a buffer size above 0");
  // Smaller than one request: the same I/O error as a sequential run.
  const std::string tiny = MakeImage("random-tiny.raw", 512);
  Result small = Bench({"-f", "raw", "--random", "-c", "1", tiny});
  EXPECT_THAT(small.status.message(), HasSubstr("Failed request: "));
}

TEST(BenchTest, RandomOffsetsInJson) {
  const std::string img = MakeImage("random-json.raw", 1 << 20);
  Result r = Bench({"-f", "raw", "-c", "8", "--random=42", "--output=json",
                    img});
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_THAT(r.out, HasSubstr("\"random\": true,"));
  EXPECT_THAT(r.out, HasSubstr("\"random_seed\": 42"));
}

TEST(BenchTest, InterleavedWritesWithODirectFillEveryOtherPage) {
  const std::string img = MakeImage("interleave.raw", 256 << 10);
  Result r = Bench({"-f", "raw", "-w", "-t", "none", "-i", "threads", "-c",
                    "32", "-S", "8k", "-o", "4k", "--pattern=0xaa", img});
  if (!r.status.ok() &&
      r.status.message().find("Invalid argument") != std::string::npos) {
    GTEST_SKIP() << "no O_DIRECT on this filesystem: " << r.status;
  }
  ASSERT_TRUE(r.status.ok()) << r.status;
  std::vector<int> expected;
  for (int i = 1; i < 64; i += 2) expected.push_back(i);
  EXPECT_EQ(PagesWith(img, 0xaa), expected);
}

TEST(BenchTest, ReadsDoNotModifyTheImage) {
  const std::string img = MakeImage("ro.raw", 64 << 10);
  Result r = Bench({"-f", "raw", "-c", "100", "--pattern=0xaa", img});
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_TRUE(PagesWith(img, 0xaa).empty());
}

TEST(BenchTest, RequestPastTheEndFailsLikeQemuImg) {
  const std::string img = MakeImage("short.raw", 1 << 20);
  Result r = Bench({"-f", "raw", "-c", "3", "-o", "2M", img});
  EXPECT_EQ(r.status.code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(r.status.message(), "Failed request: Input/output error");
  EXPECT_EQ(r.out,
            "Sending 3 read requests, 4096 bytes each, 64 in parallel "
            "(starting at offset 2097152, step size 4096)\n");

  // The last 4 KiB request overlaps the end of a 10000-byte image.
  const std::string odd = MakeImage("odd.raw", 10000);
  r = Bench({"-f", "raw", "-w", "-c", "3", "-d", "1", odd});
  EXPECT_EQ(r.status.message(), "Failed request: Input/output error");
}

TEST(BenchTest, EmptyImageIsAnErrorNotACrash) {
  const std::string img = MakeImage("empty.raw", 0);
  Result r = Bench({"-f", "raw", "-c", "2", img});
  EXPECT_EQ(r.status.message(), "Failed request: Input/output error");
}

TEST(BenchTest, JsonOutputHasRatesAndPercentiles) {
  const std::string img = MakeImage("json.raw", 1 << 20);
  Result r = Bench({"-f", "raw", "-c", "200", "-d", "8", "--output=json", img});
  ASSERT_TRUE(r.status.ok()) << r.status;
  for (const char* key :
       {"\"parameters\": {", "\"mode\": \"read\"", "\"count\": 200",
        "\"depth\": 8", "\"request_size\": 4096", "\"image_size\": 1048576",
        "\"cache\": \"writeback\"", "\"elapsed_seconds\": ", "\"iops\": ",
        "\"bytes_per_second\": ", "\"latency\": {", "\"p50_us\": ",
        "\"p90_us\": ", "\"p99_us\": ", "\"p99_9_us\": "}) {
    EXPECT_THAT(r.out, HasSubstr(key));
  }
  EXPECT_THAT(r.out, ::testing::Not(HasSubstr("Sending")));
  EXPECT_EQ(r.out.front(), '{');
  EXPECT_EQ(r.out.substr(r.out.size() - 2), "}\n");
}

// The engine each way of asking picks, as --output=json's "aio" shows it:
// -n / -i, and the aio option of the image's file node, which overrides
// them (QEMU's file-posix: aio= wins over the -n/-i flags); without either,
// native for a file opened with O_DIRECT, io_uring otherwise.
TEST(BenchTest, EngineComesFromAioOptionOrFlags) {
  const std::string img = MakeImage("engine.raw", 1 << 20);
  const std::string opts = "driver=raw,file.driver=file,file.filename=" + img;
  struct EngineCase {
    std::vector<std::string> args;
    std::string aio;
  };
  const std::vector<EngineCase> cases = {
      {{"-f", "raw", img}, "io_uring"},
      {{"-f", "raw", "-t", "none", img}, "native"},
      {{"-f", "raw", "-t", "directsync", img}, "native"},
      {{"-f", "raw", "-t", "writethrough", img}, "io_uring"},
      {{"-f", "raw", "-t", "none", "-i", "io_uring", img}, "io_uring"},
      {{"-f", "raw", "-t", "none", "-i", "threads", img}, "threads"},
      {{"--image-opts", opts + ",file.cache.direct=on"}, "native"},
      {{"--image-opts", opts + ",cache.direct=on"}, "native"},
      {{"--image-opts", "-t", "none", opts + ",file.cache.direct=off"},
       "io_uring"},
      {{"--image-opts", "-t", "none", opts + ",file.aio=io_uring"},
       "io_uring"},
      // Not a file: O_DIRECT does not apply.
      {{"--image-opts", "-t", "none", "driver=null-co,size=1M"}, "io_uring"},
      {{"-f", "raw", "-n", "-t", "none", img}, "native"},
      {{"-f", "raw", "-i", "native", "-t", "none", img}, "native"},
      {{"-f", "raw", "-i", "threads", img}, "threads"},
      {{"-f", "raw", "-i", "io_uring", img}, "io_uring"},
      {{"--image-opts", "-t", "none", opts + ",file.aio=native"}, "native"},
      {{"--image-opts", opts + ",file.aio=threads"}, "threads"},
      {{"--image-opts", "-i", "threads", opts + ",file.aio=io_uring"},
       "io_uring"},
      // aio=threads wins over -n, so writeback is fine.
      {{"--image-opts", "-n", opts + ",file.aio=threads"}, "threads"},
      {{"-t", "none",
        "json:{\"driver\": \"raw\", \"file\": {\"driver\": \"file\", "
        "\"filename\": \"" + img + "\", \"aio\": \"native\"}}"},
       "native"},
  };
  for (const EngineCase& c : cases) {
    std::vector<std::string> args = {"-c", "8", "-w", "--output=json"};
    args.insert(args.end(), c.args.begin(), c.args.end());
    Result r = Bench(args);
    ASSERT_TRUE(r.status.ok()) << c.args.back() << ": " << r.status;
    EXPECT_THAT(r.out, HasSubstr("\"aio\": \"" + c.aio + "\""))
        << c.args.back();
  }
}

struct ErrorCase {
  std::vector<std::string> args;
  std::string message;
};

TEST(BenchTest, OptionErrorsMatchQemuImg) {
  const std::string img = MakeImage("errors.raw", 1 << 20);
  const std::string kSuffixes =
      " specified. You may use k, M, G, T, P or E suffixes for\nkilobytes, "
      "megabytes, gigabytes, terabytes, petabytes and exabytes.";
  const std::vector<ErrorCase> cases = {
      {{"-c", "x"}, "Invalid request count specified"},
      {{"-c", "-1"}, "Invalid request count specified"},
      {{"-c", "2147483648"}, "Invalid request count specified"},
      {{"-d", "x"}, "Invalid queue depth specified"},
      {{"-d", "0"}, "Invalid queue depth specified"},
      {{"-s", "x"}, "Invalid buffer size" + kSuffixes},
      {{"-s", "-1"}, "Invalid buffer size" + kSuffixes},
      {{"-s", "3G"},
       "Invalid buffer size specified. Must be between 0 and 2147483647."},
      {{"-o", "x"}, "Invalid offset" + kSuffixes},
      {{"-o", "9223372036854775808"},
       "Invalid offset specified. Must be between 0 and 9223372036854775807."},
      {{"-S", "x"}, "Invalid step_size" + kSuffixes},
      {{"-S", "3G"},
       "Invalid step_size specified. Must be between 0 and 2147483647."},
      {{"--pattern=256"}, "Invalid pattern byte specified"},
      {{"--pattern=x"}, "Invalid pattern byte specified"},
      {{"-i", "foo"}, "Invalid aio option: foo"},
      {{"-t", "foo"}, "Invalid cache mode"},
      {{"--flush-interval=x"}, "Invalid flush interval specified"},
      {{"--flush-interval=8"},
       "--flush-interval is only available in write tests"},
      {{"-w", "--flush-interval=8"},
       "Flush interval can't be smaller than depth"},
      {{"--output=xml"},
       "--output must be used with human or json as argument."},
      {{"-x"}, "unrecognized option '-x'"},
  };
  for (const ErrorCase& c : cases) {
    std::vector<std::string> args = c.args;
    args.push_back(img);
    Result r = Bench(args);
    EXPECT_EQ(r.status.code(), absl::StatusCode::kInvalidArgument)
        << c.args[0];
    EXPECT_EQ(r.status.message(), c.message) << c.args[0];
    EXPECT_EQ(r.out, "") << c.args[0];
  }
  EXPECT_EQ(Bench({}).status.message(), "Expecting one image file name");
  EXPECT_EQ(Bench({img, img}).status.message(),
            "Expecting one image file name");
}

// qemu-img 7.2: native AIO needs O_DIRECT, checked once the file is open.
TEST(BenchTest, NativeAioNeedsCacheNone) {
  const std::string img = MakeImage("native.raw", 1 << 20);
  const std::string error =
      "Could not open '" + img +
      "': aio=native was specified, but it requires cache.direct=on, which "
      "was not specified.";
  for (const std::vector<std::string>& args :
       std::vector<std::vector<std::string>>{{"-n"},
                                             {"-i", "native"},
                                             {"-n", "-t", "writeback"},
                                             {"-i", "native", "-t", "unsafe"},
                                             {"-n", "-w"}}) {
    std::vector<std::string> all = {"-f", "raw", "-c", "4"};
    all.insert(all.end(), args.begin(), args.end());
    all.push_back(img);
    Result r = Bench(all);
    EXPECT_EQ(r.status.code(), absl::StatusCode::kInvalidArgument) << args[1];
    EXPECT_EQ(r.status.message(), error);
    EXPECT_EQ(r.out, "");
  }
  // A missing file is reported first, as by qemu-img.
  Result missing = Bench({"-n", TempPath("missing.raw")});
  EXPECT_EQ(missing.status.message(),
            "Could not open '" + TempPath("missing.raw") + "': Could not open '" +
                TempPath("missing.raw") + "': No such file or directory");
  for (const char* cache : {"none", "directsync"}) {
    Result r = Bench({"-f", "raw", "-c", "4", "-n", "-t", cache, img});
    EXPECT_TRUE(r.status.ok()) << cache << ": " << r.status;
    r = Bench({"-f", "raw", "-c", "4", "-i", "native", "-t", cache, img});
    EXPECT_TRUE(r.status.ok()) << cache << ": " << r.status;
  }
  EXPECT_TRUE(Bench({"-f", "raw", "-c", "4", "-i", "io_uring", img}).status.ok());
}

TEST(BenchTest, HelpLooksLikeTheOtherCommands) {
  Result r = Bench({"--help"});
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_THAT(r.out, ::testing::StartsWith("Usage: imgtool bench [-c COUNT] "));
  EXPECT_THAT(r.out, HasSubstr("\n  -t CACHE              none, writeback"));
  EXPECT_THAT(r.out, HasSubstr("\n  --random[=SEED]       imgtool extension: "));
  EXPECT_EQ(Bench({"-h"}).out, r.out);
  EXPECT_EQ(r.err, "");
}

// 65536 requests of 2047 MiB in flight need more than the 128 TiB of a
// process's address space: an error, not an abort.
TEST(BenchTest, HugeBufferIsAnErrorNotAnAbort) {
  const std::string img = MakeImage("huge.raw", 1 << 20);
  Result r = Bench({"-f", "raw", "-d", "65536", "-s", "2047M", img});
  EXPECT_EQ(r.status.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(r.status.message(),
            "Failed to allocate 140668768878592 bytes of memory: Cannot "
            "allocate memory");
  EXPECT_EQ(r.out,
            "Sending 75000 read requests, 2146435072 bytes each, 65536 in "
            "parallel (starting at offset 0, step size 2146435072)\n");
}

TEST(BenchTest, AcceptsStrtoulNumbersLikeQemuImg) {
  const std::string img = MakeImage("numbers.raw", 1 << 20);
  Result r = Bench({"-f", "raw", "-c", "0x10", "-d", "010", img});
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_THAT(r.out, HasSubstr("Sending 16 read requests, 4096 bytes each, 8 "
                               "in parallel"));
}

}  // namespace
}  // namespace imgtool::cli

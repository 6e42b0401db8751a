#include "imgtool/command.h"

#include <getopt.h>

#include <sstream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace imgtool::cli {
namespace {

using ::testing::ElementsAre;

TEST(ExitCodeTest, OkIsZeroErrorIsOneByDefault) {
  EXPECT_EQ(ExitCodeOf(absl::OkStatus()), 0);
  EXPECT_EQ(ExitCodeOf(absl::InternalError("x")), 1);
}

TEST(ExitCodeTest, WithExitCodeIsKeptThroughCopies) {
  absl::Status st = WithExitCode(absl::DataLossError("corrupt"), 2);
  absl::Status copy = st;
  EXPECT_EQ(ExitCodeOf(copy), 2);
  EXPECT_EQ(ExitCodeOf(WithExitCode(absl::UnimplementedError("no"), 63)), 63);
  EXPECT_EQ(copy.message(), "corrupt");
}

TEST(FormatErrorTest, OneLine) {
  EXPECT_EQ(FormatError(absl::NotFoundError("x.raw: gone")),
            "imgtool: x.raw: gone\n");
}

TEST(FormatErrorTest, ContinuationLinesUnprefixedByDefault) {
  EXPECT_EQ(FormatError(absl::FailedPreconditionError(
                "Could not open 'a': Failed to get \"write\" lock\n"
                "Is another process using the image [a]?")),
            "imgtool: Could not open 'a': Failed to get \"write\" lock\n"
            "Is another process using the image [a]?\n");
}

TEST(FormatErrorTest, PrefixEachLine) {
  EXPECT_EQ(FormatError(PrefixEachLine(absl::InvalidArgumentError(
                "first line\nsecond line"))),
            "imgtool: first line\nimgtool: second line\n");
}

// A qcow2 corruption event goes on its own line first, as qemu-img prints
// it, and the error says "Input/output error" in its place.
TEST(FormatErrorTest, CorruptionEventOnItsOwnLine) {
  const std::string event =
      "qcow2: Image is corrupt: Invalid cluster entry found  (L2 offset: "
      "0x80000, L2 index: 0); further non-fatal corruption events will be "
      "suppressed";
  EXPECT_EQ(FormatError(absl::DataLossError(
                "Could not read file metadata: " + event)),
            event + "\nimgtool: Could not read file metadata: Input/output "
                    "error\n");
  const std::string marking =
      "qcow2: Marking image as corrupt: L2 table offset 0x40200 unaligned "
      "(L1 index: 0); further corruption events will be suppressed";
  EXPECT_EQ(FormatError(WithExitCode(
                absl::DataLossError("Failed request: " + marking), 1)),
            marking + "\nimgtool: Failed request: Input/output error\n");
  // Only kDataLoss statuses carry events.
  EXPECT_EQ(FormatError(absl::InternalError("x: " + event)),
            "imgtool: x: " + event + "\n");
  // A message that does not quote its cause keeps it as a payload.
  absl::Status st = WithExitCode(
      WithCorruptionEvent(absl::DataLossError("Sector allocation test failed "
                                              "for a.qcow2"),
                          absl::DataLossError(event)),
      3);
  EXPECT_EQ(ExitCodeOf(st), 3);
  EXPECT_EQ(FormatError(st),
            event + "\nimgtool: Sector allocation test failed for a.qcow2\n");
  EXPECT_EQ(FormatError(WithCorruptionEvent(absl::DataLossError("y"),
                                            absl::DataLossError("other"))),
            "imgtool: y\n");
}

TEST(FormatErrorTest, UsageErrorAddsUsageAndHint) {
  absl::Status st = UsageError("Expecting image file name",
                               "Usage: imgtool create FILE [SIZE]");
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ExitCodeOf(st), 1);
  EXPECT_EQ(FormatError(st),
            "imgtool: Expecting image file name\n"
            "Usage: imgtool create FILE [SIZE]\n"
            "Try 'imgtool --help' for more information\n");
}

TEST(PrintWarningsTest, PrefixesEveryLine) {
  std::ostringstream err;
  PrintWarnings("Failed to set extent size hint: Invalid argument\nsecond\n",
                err);
  PrintWarnings("", err);
  EXPECT_EQ(err.str(),
            "imgtool: warning: Failed to set extent size hint: Invalid "
            "argument\nimgtool: warning: second\n");
}

const struct option kLong[] = {
    {"output", required_argument, nullptr, 256},
    {"shrink", no_argument, nullptr, 257},
    {nullptr, 0, nullptr, 0},
};

struct Seen {
  std::vector<std::string> options;
  std::function<absl::Status(int, const std::string&)> Recorder() {
    return [this](int c, const std::string& arg) {
      options.push_back(c < 256 ? std::string(1, static_cast<char>(c)) + arg
                                : std::to_string(c) + "=" + arg);
      return absl::OkStatus();
    };
  }
};

TEST(ParseOptionsTest, OptionsAndOperandsMayBeMixed) {
  Seen seen;
  auto operands = ParseOptions({"a.raw", "-q", "-f", "raw", "--output=json",
                                "b", "--shrink", "--output", "human"},
                               "f:q", kLong, "usage", seen.Recorder());
  ASSERT_TRUE(operands.ok()) << operands.status();
  EXPECT_THAT(*operands, ElementsAre("a.raw", "b"));
  EXPECT_THAT(seen.options,
              ElementsAre("q", "fraw", "256=json", "257=", "256=human"));
}

TEST(ParseOptionsTest, DoubleDashEndsOptions) {
  Seen seen;
  auto operands = ParseOptions({"-q", "--", "-x.raw", "-512K"}, "q", kLong,
                               "usage", seen.Recorder());
  ASSERT_TRUE(operands.ok()) << operands.status();
  EXPECT_THAT(*operands, ElementsAre("-x.raw", "-512K"));
}

TEST(ParseOptionsTest, UnknownOptionIsAUsageError) {
  Seen seen;
  auto operands =
      ParseOptions({"-z", "a"}, "q", kLong, "Usage: u", seen.Recorder());
  EXPECT_EQ(FormatError(operands.status()),
            "imgtool: unrecognized option '-z'\nUsage: u\n"
            "Try 'imgtool --help' for more information\n");
  operands = ParseOptions({"--foo"}, "q", kLong, "u", seen.Recorder());
  EXPECT_EQ(operands.status().message(), "unrecognized option '--foo'");
}

TEST(ParseOptionsTest, MissingArgument) {
  Seen seen;
  auto operands = ParseOptions({"a", "-f"}, "f:", kLong, "u", seen.Recorder());
  EXPECT_EQ(operands.status().message(), "missing argument for option '-f'");
  operands = ParseOptions({"--output"}, "f:", kLong, "u", seen.Recorder());
  EXPECT_EQ(operands.status().message(),
            "missing argument for option '--output'");
}

TEST(ParseOptionsTest, CallbackErrorStopsTheParse) {
  int calls = 0;
  auto operands = ParseOptions(
      {"-q", "-q", "-q"}, "q", kLong, "u",
      [&](int, const std::string&) {
        ++calls;
        return calls == 2 ? absl::InvalidArgumentError("stop")
                          : absl::OkStatus();
      });
  EXPECT_EQ(operands.status().message(), "stop");
  EXPECT_EQ(calls, 2);
}

TEST(ParseOptionsTest, CanBeCalledAgain) {
  for (int i = 0; i < 3; ++i) {
    Seen seen;
    auto operands =
        ParseOptions({"-q", "x"}, "q", kLong, "u", seen.Recorder());
    ASSERT_TRUE(operands.ok());
    EXPECT_THAT(*operands, ElementsAre("x"));
    EXPECT_THAT(seen.options, ElementsAre("q"));
  }
}

TEST(ParseOutputFormatTest, HumanOrJson) {
  EXPECT_EQ(*ParseOutputFormat("json"), true);
  EXPECT_EQ(*ParseOutputFormat("human"), false);
  EXPECT_EQ(ParseOutputFormat("xml").status().message(),
            "--output must be used with human or json as argument.");
}

}  // namespace
}  // namespace imgtool::cli

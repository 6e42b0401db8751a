#include "base/size.h"

#include <cstdint>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace imgtool {
namespace {

using ::testing::HasSubstr;

constexpr char kInvalid[] =
    "Invalid image size specified. You may use k, M, G, T, P or E suffixes "
    "for\nkilobytes, megabytes, gigabytes, terabytes, petabytes and "
    "exabytes.";
constexpr char kRange[] =
    "Invalid image size specified. Must be between 0 and "
    "9223372036854775807.";

// Every value below was checked with `qemu-img create -f raw x.raw SIZE`
// (qemu-img 7.2), which prints the parsed size.
TEST(ParseSizeTest, AcceptsWhatQemuImgAccepts) {
  const struct {
    const char* text;
    uint64_t bytes;
  } kCases[] = {
      {"512", 512},
      {"4k", 4096},
      {"4K", 4096},
      {"1M", 1048576},
      {"1m", 1048576},
      {"1.5G", 1610612736},
      {"0x10000", 65536},
      {"0X10", 16},
      {"0x10k", 16384},
      {"0xAk", 10240},
      {"1000b", 1000},
      {"1b", 1},
      {"1B", 1},
      {"1.7k", 1741},
      {"1.5k", 1536},
      {"0.5k", 512},
      {"0.0007k", 1},
      {"1.k", 1024},
      {"1.", 1},
      {"1.b", 1},
      {"1.0b", 1},
      {" 4k", 4096},
      {"  4k", 4096},
      {"\t4k", 4096},
      {"+4k", 4096},
      {"00012", 12},
      {"08", 8},
      {"1e", 1152921504606846976ull},
      {"1.5e", 1729382256910270464ull},
      {"7E", 8070450532247928832ull},
      {"7.99999999999999999E", 8070450532247928832ull},
      {"9223372036854775807", 9223372036854775807ull},
      {"0x7fffffffffffffff", 9223372036854775807ull},
      {"0", 0},
  };
  for (const auto& c : kCases) {
    absl::StatusOr<uint64_t> size = ParseSize(c.text);
    ASSERT_TRUE(size.ok()) << "'" << c.text << "': " << size.status();
    EXPECT_EQ(*size, c.bytes) << "'" << c.text << "'";
  }
}

TEST(ParseSizeTest, RejectsMalformedSizes) {
  for (const char* text :
       {"1kb", "1KiB", "1e3", "1.5", "0.5", "1.5b", "1.99999999b", "-1", " -1",
        "1-", "2k ", "4k\n", "4 k", "", " ", "0x", "0x1.5k", "0x1p3", "0x-1",
        ".5k", "inf", "nan", "k", "1.5.k", "1.5e3k", "16Ex",
        "99999999999999999999k"}) {
    absl::StatusOr<uint64_t> size = ParseSize(text);
    ASSERT_FALSE(size.ok()) << "'" << text << "' gave " << *size;
    EXPECT_EQ(size.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(size.status().message(), kInvalid) << "'" << text << "'";
  }
}

TEST(ParseSizeTest, RejectsEmbeddedNul) {
  EXPECT_EQ(ParseSize(std::string("4k\0", 3)).status().message(), kInvalid);
}

TEST(ParseSizeTest, RejectsSizesAboveInt64Max) {
  for (const char* text :
       {"9223372036854775808", "8E", "16E", "0xffffffffffffffff",
        "18446744073709551616", "99999999999999999999", "0x1ffffffffffffffff",
        "15.99E"}) {
    absl::StatusOr<uint64_t> size = ParseSize(text);
    ASSERT_FALSE(size.ok()) << "'" << text << "' gave " << *size;
    EXPECT_EQ(size.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(size.status().message(), kRange) << "'" << text << "'";
  }
}

// Checked with `qemu-img create -f raw -o size=TEXT x.raw`.
TEST(ParseSizeOptionTest, AcceptsUpTo2To64Minus1) {
  EXPECT_EQ(*ParseSizeOption("size", " 4k"), 4096u);
  EXPECT_EQ(*ParseSizeOption("size", "8E"), 9223372036854775808ull);
  EXPECT_EQ(*ParseSizeOption("size", "15.99E"), 18435214858663483136ull);
  EXPECT_EQ(*ParseSizeOption("size", "18446744073709551615"),
            18446744073709551615ull);
  EXPECT_EQ(*ParseSizeOption("size", "0x10k"), 16384u);
}

TEST(ParseSizeOptionTest, MalformedValueNamesTheParameter) {
  const std::string expected =
      "Parameter 'cluster_size' expects a non-negative number below 2^64\n"
      "Optional suffix k, M, G, T, P or E means kilo-, mega-, giga-, tera-, "
      "peta-\nand exabytes, respectively.";
  for (const char* text : {"3x", "1.5", "-1", "", "16Ex",
                           "99999999999999999999k"}) {
    absl::StatusOr<uint64_t> size = ParseSizeOption("cluster_size", text);
    ASSERT_FALSE(size.ok()) << "'" << text << "'";
    EXPECT_EQ(size.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(size.status().message(), expected) << "'" << text << "'";
  }
}

TEST(ParseSizeOptionTest, ValueAbove2To64IsOutOfRange) {
  absl::StatusOr<uint64_t> size = ParseSizeOption("size", "16E");
  ASSERT_FALSE(size.ok());
  EXPECT_EQ(size.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(size.status().message(),
            "Value '16E' is out of range for parameter 'size'");
  EXPECT_THAT(ParseSizeOption("size", "18446744073709551616").status().message(),
              HasSubstr("is out of range"));
}

// Checked with `qemu-img info` ("virtual size: ...") on raw files made with
// `truncate -s` and qcow2 files for the large ones.
TEST(FormatHumanSizeTest, MatchesQemuImgInfo) {
  EXPECT_EQ(FormatHumanSize(0), "0 B");
  EXPECT_EQ(FormatHumanSize(512), "512 B");
  EXPECT_EQ(FormatHumanSize(999), "999 B");
  EXPECT_EQ(FormatHumanSize(1024), "1 KiB");
  EXPECT_EQ(FormatHumanSize(1536), "1.5 KiB");
  EXPECT_EQ(FormatHumanSize(10240), "10 KiB");
  EXPECT_EQ(FormatHumanSize(100352), "98 KiB");
  EXPECT_EQ(FormatHumanSize(1000448), "977 KiB");
  EXPECT_EQ(FormatHumanSize(1023488), "1e+03 KiB");
  EXPECT_EQ(FormatHumanSize(1024000), "0.977 MiB");
  EXPECT_EQ(FormatHumanSize(1047552), "0.999 MiB");
  EXPECT_EQ(FormatHumanSize(1048064), "1 MiB");
  EXPECT_EQ(FormatHumanSize(1048576), "1 MiB");
  EXPECT_EQ(FormatHumanSize(67108864), "64 MiB");
  EXPECT_EQ(FormatHumanSize(5003753472ull), "4.66 GiB");
  EXPECT_EQ(FormatHumanSize(123456789504ull), "115 GiB");
  EXPECT_EQ(FormatHumanSize(1099511627776000ull), "0.977 PiB");
  EXPECT_EQ(FormatHumanSize(1125899906842624ull), "1 PiB");
  EXPECT_EQ(FormatHumanSize(1152921504606846976ull), "1 EiB");
  EXPECT_EQ(FormatHumanSize(UINT64_MAX), "16 EiB");
}

}  // namespace
}  // namespace imgtool

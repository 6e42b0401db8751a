#include "base/json_printer.h"

#include <string>

#include "base/json_printer_test.pb.h"
#include "gtest/gtest.h"

namespace imgtool {
namespace {

using testdata::CheckResult;
using testdata::Empty;
using testdata::ImageInfo;
using testdata::Kinds;

ImageInfo Qcow2Info(const std::string& filename) {
  ImageInfo info;
  info.set_virtual_size(67108864);
  info.set_filename(filename);
  info.set_cluster_size(65536);
  info.set_format("qcow2");
  info.set_actual_size(200704);
  info.mutable_format_specific()->set_type("qcow2");
  auto* data = info.mutable_format_specific()->mutable_data();
  data->set_compat("1.1");
  data->set_compression_type("zlib");
  data->set_lazy_refcounts(false);
  data->set_refcount_bits(16);
  data->set_corrupt(false);
  data->set_extended_l2(false);
  info.set_dirty_flag(false);
  return info;
}

// Expected texts below are byte for byte what qemu-img 7.2 printed for
// `qemu-img info --output=json` / `check --output=json` on real images.
TEST(PrintJsonTest, RawInfoLikeQemuImg) {
  ImageInfo info;
  info.set_virtual_size(1048576);
  info.set_filename("r.raw");
  info.set_format("raw");
  info.set_actual_size(4096);
  EXPECT_EQ(PrintJson(info),
            "{\n"
            "    \"virtual-size\": 1048576,\n"
            "    \"filename\": \"r.raw\",\n"
            "    \"format\": \"raw\",\n"
            "    \"actual-size\": 4096,\n"
            "    \"dirty-flag\": false\n"
            "}");
}

TEST(PrintJsonTest, ZeroValuesWithoutPresenceArePrinted) {
  ImageInfo info;
  info.set_filename("e.raw");
  info.set_format("raw");
  EXPECT_EQ(PrintJson(info),
            "{\n"
            "    \"virtual-size\": 0,\n"
            "    \"filename\": \"e.raw\",\n"
            "    \"format\": \"raw\",\n"
            "    \"actual-size\": 0,\n"
            "    \"dirty-flag\": false\n"
            "}");
}

constexpr char kOverlayInfo[] =
    "{\n"
    "    \"backing-filename-format\": \"qcow2\",\n"
    "    \"virtual-size\": 67108864,\n"
    "    \"filename\": \"o\\\"v\\\\.qcow2\",\n"
    "    \"cluster-size\": 65536,\n"
    "    \"format\": \"qcow2\",\n"
    "    \"actual-size\": 200704,\n"
    "    \"format-specific\": {\n"
    "        \"type\": \"qcow2\",\n"
    "        \"data\": {\n"
    "            \"compat\": \"1.1\",\n"
    "            \"compression-type\": \"zlib\",\n"
    "            \"lazy-refcounts\": false,\n"
    "            \"refcount-bits\": 16,\n"
    "            \"corrupt\": false,\n"
    "            \"extended-l2\": false\n"
    "        }\n"
    "    },\n"
    "    \"full-backing-filename\": \"q.qcow2\",\n"
    "    \"backing-filename\": \"q.qcow2\",\n"
    "    \"dirty-flag\": false\n"
    "}";

TEST(PrintJsonTest, Qcow2InfoWithNestedObjectsAndEscapes) {
  ImageInfo info = Qcow2Info("o\"v\\.qcow2");
  info.set_backing_filename_format("qcow2");
  info.set_full_backing_filename("q.qcow2");
  info.set_backing_filename("q.qcow2");
  EXPECT_EQ(PrintJson(info), kOverlayInfo);
}

TEST(PrintJsonTest, IndentForMessagesInAnArray) {
  // `qemu-img info --output=json --backing-chain`: the caller prints the
  // array and each element with indent 1.
  ImageInfo top = Qcow2Info("o\"v\\.qcow2");
  top.set_backing_filename_format("qcow2");
  top.set_full_backing_filename("q.qcow2");
  top.set_backing_filename("q.qcow2");
  ImageInfo base = Qcow2Info("q.qcow2");
  const std::string chain = "[\n    " + PrintJson(top, 1) + ",\n    " +
                            PrintJson(base, 1) + "\n]";
  EXPECT_EQ(chain,
            "[\n"
            "    {\n"
            "        \"backing-filename-format\": \"qcow2\",\n"
            "        \"virtual-size\": 67108864,\n"
            "        \"filename\": \"o\\\"v\\\\.qcow2\",\n"
            "        \"cluster-size\": 65536,\n"
            "        \"format\": \"qcow2\",\n"
            "        \"actual-size\": 200704,\n"
            "        \"format-specific\": {\n"
            "            \"type\": \"qcow2\",\n"
            "            \"data\": {\n"
            "                \"compat\": \"1.1\",\n"
            "                \"compression-type\": \"zlib\",\n"
            "                \"lazy-refcounts\": false,\n"
            "                \"refcount-bits\": 16,\n"
            "                \"corrupt\": false,\n"
            "                \"extended-l2\": false\n"
            "            }\n"
            "        },\n"
            "        \"full-backing-filename\": \"q.qcow2\",\n"
            "        \"backing-filename\": \"q.qcow2\",\n"
            "        \"dirty-flag\": false\n"
            "    },\n"
            "    {\n"
            "        \"virtual-size\": 67108864,\n"
            "        \"filename\": \"q.qcow2\",\n"
            "        \"cluster-size\": 65536,\n"
            "        \"format\": \"qcow2\",\n"
            "        \"actual-size\": 200704,\n"
            "        \"format-specific\": {\n"
            "            \"type\": \"qcow2\",\n"
            "            \"data\": {\n"
            "                \"compat\": \"1.1\",\n"
            "                \"compression-type\": \"zlib\",\n"
            "                \"lazy-refcounts\": false,\n"
            "                \"refcount-bits\": 16,\n"
            "                \"corrupt\": false,\n"
            "                \"extended-l2\": false\n"
            "            }\n"
            "        },\n"
            "        \"dirty-flag\": false\n"
            "    }\n"
            "]");
}

TEST(PrintJsonTest, CheckResultLikeQemuImg) {
  CheckResult check;
  check.set_image_end_offset(262144);
  check.set_total_clusters(1024);
  check.set_check_errors(0);
  check.set_filename("q.qcow2");
  check.set_format("qcow2");
  EXPECT_EQ(PrintJson(check),
            "{\n"
            "    \"image-end-offset\": 262144,\n"
            "    \"total-clusters\": 1024,\n"
            "    \"check-errors\": 0,\n"
            "    \"filename\": \"q.qcow2\",\n"
            "    \"format\": \"qcow2\"\n"
            "}");
  // A qcow2 image with two leaked clusters.
  check.set_image_end_offset(393216);
  check.set_total_clusters(16);
  check.set_leaks(2);
  check.set_filename("l.q");
  EXPECT_EQ(PrintJson(check),
            "{\n"
            "    \"image-end-offset\": 393216,\n"
            "    \"total-clusters\": 16,\n"
            "    \"check-errors\": 0,\n"
            "    \"leaks\": 2,\n"
            "    \"filename\": \"l.q\",\n"
            "    \"format\": \"qcow2\"\n"
            "}");
}

TEST(PrintJsonTest, EmptyMessage) {
  EXPECT_EQ(PrintJson(Empty()), "{\n}");
  EXPECT_EQ(PrintJson(Empty(), 2), "{\n        }");
}

TEST(PrintJsonTest, StringEscapesLikeQemu) {
  // qemu-img info --output=json on a file named with these bytes printed
  // "a\tb\u0001c\u007Fd\u00E9\uD83D\uDE00\uFFFDe\nf\\\b\f\r\"q".
  Kinds kinds;
  kinds.set_raw("a\tb\x01" "c\x7f" "d\xC3\xA9\xF0\x9F\x98\x80\xFF" "e\nf\\\b\f\r\"q/");
  const std::string json = PrintJson(kinds);
  EXPECT_NE(json.find("\"raw\": \"a\\tb\\u0001c\\u007Fd\\u00E9\\uD83D\\uDE00"
                      "\\uFFFDe\\nf\\\\\\b\\f\\r\\\"q/\""),
            std::string::npos)
      << json;
}

TEST(PrintJsonTest, InvalidUtf8BecomesReplacementCharacters) {
  Kinds kinds;
  // Overlong '/', a lone continuation byte, a truncated sequence followed by
  // ASCII, an encoded surrogate, modified UTF-8 NUL.
  kinds.set_raw("\xC0\xAF|\x80|\xE2\x82x|\xED\xA0\x80|\xC0\x80");
  const std::string json = PrintJson(kinds);
  EXPECT_NE(json.find("\"raw\": \"\\uFFFD|\\uFFFD|\\uFFFDx|\\uFFFD|\\u0000\""),
            std::string::npos)
      << json;
}

TEST(PrintJsonTest, EveryFieldKind) {
  Kinds kinds;
  kinds.set_u64(18446744073709551615ull);
  kinds.set_i64(-9223372036854775807ll - 1);
  kinds.set_u32(4294967295u);
  kinds.set_i32(-1);
  kinds.set_flag(true);
  kinds.set_text("t");
  kinds.set_ratio(0.5);
  kinds.set_color(Kinds::RED);
  kinds.set_maybe(0);  // Optional and set to zero: printed.
  kinds.mutable_empty();
  Kinds* child = kinds.add_children();
  child->set_text("c1");
  child->add_numbers(7);
  kinds.add_children();
  kinds.add_numbers(1);
  kinds.add_numbers(2);
  kinds.add_names("x");
  (*kinds.mutable_counts())["b"] = 2;
  (*kinds.mutable_counts())["a"] = 1;
  kinds.set_choice_number(0);
  kinds.set_small(1.5f);
  kinds.set_s64(-5);
  kinds.set_f64(6);
  EXPECT_EQ(PrintJson(kinds),
            "{\n"
            "    \"u64\": 18446744073709551615,\n"
            "    \"i64\": -9223372036854775808,\n"
            "    \"u32\": 4294967295,\n"
            "    \"i32\": -1,\n"
            "    \"flag\": true,\n"
            "    \"text\": \"t\",\n"
            "    \"ratio\": 0.5,\n"
            "    \"color\": \"RED\",\n"
            "    \"maybe\": 0,\n"
            "    \"empty\": {\n"
            "    },\n"
            "    \"children\": [\n"
            "        {\n"
            "            \"u64\": 0,\n"
            "            \"i64\": 0,\n"
            "            \"u32\": 0,\n"
            "            \"i32\": 0,\n"
            "            \"flag\": false,\n"
            "            \"text\": \"c1\",\n"
            "            \"ratio\": 0,\n"
            "            \"color\": \"COLOR_UNSPECIFIED\",\n"
            "            \"numbers\": [\n"
            "                7\n"
            "            ],\n"
            "            \"raw\": \"\",\n"
            "            \"small\": 0,\n"
            "            \"s64\": 0,\n"
            "            \"f64\": 0\n"
            "        },\n"
            "        {\n"
            "            \"u64\": 0,\n"
            "            \"i64\": 0,\n"
            "            \"u32\": 0,\n"
            "            \"i32\": 0,\n"
            "            \"flag\": false,\n"
            "            \"text\": \"\",\n"
            "            \"ratio\": 0,\n"
            "            \"color\": \"COLOR_UNSPECIFIED\",\n"
            "            \"raw\": \"\",\n"
            "            \"small\": 0,\n"
            "            \"s64\": 0,\n"
            "            \"f64\": 0\n"
            "        }\n"
            "    ],\n"
            "    \"numbers\": [\n"
            "        1,\n"
            "        2\n"
            "    ],\n"
            "    \"names\": [\n"
            "        \"x\"\n"
            "    ],\n"
            "    \"counts\": {\n"
            "        \"a\": 1,\n"
            "        \"b\": 2\n"
            "    },\n"
            "    \"raw\": \"\",\n"
            "    \"choiceNumber\": 0,\n"
            "    \"small\": 1.5,\n"
            "    \"s64\": -5,\n"
            "    \"f64\": 6\n"
            "}");
}

}  // namespace
}  // namespace imgtool

namespace imgtool {
namespace {

TEST(PrintJsonTest, DoublesUseShortestRoundTripText) {
  Kinds kinds;
  kinds.set_ratio(68.864);
  EXPECT_NE(PrintJson(kinds).find("\"ratio\": 68.864,\n"), std::string::npos)
      << PrintJson(kinds);
  kinds.set_ratio(1e21);
  EXPECT_NE(PrintJson(kinds).find("\"ratio\": 1e+21,\n"), std::string::npos)
      << PrintJson(kinds);
}

}  // namespace
}  // namespace imgtool

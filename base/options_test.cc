#include "base/options.h"

#include <set>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace imgtool {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;
using ::testing::Pair;

// Prints a tree compactly so that tests can compare whole trees:
// {driver=qcow2 file:{driver=file filename=x}}.
std::string Dump(const NodeOptions& node) {
  std::string out = "{";
  bool first = true;
  for (const auto& [key, value] : node.values) {
    out += (first ? "" : " ") + key + "=" + value;
    first = false;
  }
  for (const auto& [key, child] : node.children) {
    out += (first ? "" : " ") + key + ":" + Dump(child);
    first = false;
  }
  return out + "}";
}

std::string ErrorOf(absl::string_view text, absl::string_view implied = "") {
  absl::StatusOr<OptionList> list = ParseOptionString(text, implied);
  if (list.ok()) return "ok";
  EXPECT_EQ(list.status().code(), absl::StatusCode::kInvalidArgument);
  return std::string(list.status().message());
}

TEST(ParseOptionStringTest, SplitsKeyValuePairsInOrder) {
  absl::StatusOr<OptionList> list =
      ParseOptionString("size=1M,cluster_size=64k,file.filename=x");
  ASSERT_TRUE(list.ok()) << list.status();
  EXPECT_THAT(*list, ElementsAre(Pair("size", "1M"), Pair("cluster_size", "64k"),
                                 Pair("file.filename", "x")));
}

TEST(ParseOptionStringTest, EmptyStringGivesNoOptions) {
  EXPECT_THAT(*ParseOptionString(""), IsEmpty());
}

TEST(ParseOptionStringTest, DoubleCommaIsOneComma) {
  EXPECT_THAT(*ParseOptionString("file.filename=a,,b.qcow2,driver=raw"),
              ElementsAre(Pair("file.filename", "a,b.qcow2"),
                          Pair("driver", "raw")));
  // Two trailing commas are one escaped comma (qemu-img -o accepts this).
  EXPECT_THAT(*ParseOptionString("a=1,,"), ElementsAre(Pair("a", "1,")));
  EXPECT_THAT(*ParseOptionString("a=1,,,b=2"),
              ElementsAre(Pair("a", "1,"), Pair("b", "2")));
  EXPECT_THAT(*ParseOptionString("a=,b=x=y"),
              ElementsAre(Pair("a", ""), Pair("b", "x=y")));
}

TEST(ParseOptionStringTest, ImpliedKeyTakesALeadingBareItem) {
  EXPECT_THAT(*ParseOptionString("node0,driver=raw", "file"),
              ElementsAre(Pair("file", "node0"), Pair("driver", "raw")));
  EXPECT_THAT(*ParseOptionString("a,,b.raw", "file"),
              ElementsAre(Pair("file", "a,b.raw")));
  EXPECT_THAT(*ParseOptionString("a,,b=c", "file"),
              ElementsAre(Pair("file", "a,b=c")));
  EXPECT_EQ(ErrorOf("driver=raw,node0", "file"), "Invalid parameter 'node0'");
  EXPECT_EQ(ErrorOf("node0"), "Invalid parameter 'node0'");
}

TEST(ParseOptionStringTest, HelpItems) {
  EXPECT_THAT(*ParseOptionString("help"), ElementsAre(Pair("help", "")));
  EXPECT_THAT(*ParseOptionString("?"), ElementsAre(Pair("help", "")));
  EXPECT_THAT(*ParseOptionString("size=1M,help"),
              ElementsAre(Pair("size", "1M"), Pair("help", "")));
  EXPECT_THAT(*ParseOptionString("help", "file"), ElementsAre(Pair("help", "")));
  // "help" as a value is just a value.
  EXPECT_THAT(*ParseOptionString("driver=help"),
              ElementsAre(Pair("driver", "help")));
}

// Texts as qemu-img 7.2 prints them for `create -o ...`.
TEST(ParseOptionStringTest, Errors) {
  EXPECT_EQ(ErrorOf("=x"), "Invalid parameter ''");
  EXPECT_EQ(ErrorOf("size=1M,=3"), "Invalid parameter ''");
  EXPECT_EQ(ErrorOf("foo"), "Invalid parameter 'foo'");
  EXPECT_EQ(ErrorOf("size=1M,foo,b=1"), "Invalid parameter 'foo'");
  EXPECT_EQ(ErrorOf("size=1M,"), "Invalid option list: size=1M,");
  EXPECT_EQ(ErrorOf(",size=1M"), "Invalid option list: ,size=1M");
  EXPECT_EQ(ErrorOf("a=1,,,"), "Invalid option list: a=1,,,");
  EXPECT_EQ(ErrorOf(","), "Invalid option list: ,");
  EXPECT_EQ(ErrorOf("size=1M,size=2M"), "Duplicate option 'size'");
  EXPECT_EQ(ErrorOf("help,?"), "Duplicate option 'help'");
}

TEST(BuildNodeOptionsTest, DottedKeysMakeChildren) {
  absl::StatusOr<OptionList> list = ParseOptionString(
      "driver=qcow2,file.driver=file,file.filename=x,"
      "backing.file.file.filename=b,backing.driver=raw");
  ASSERT_TRUE(list.ok()) << list.status();
  absl::StatusOr<NodeOptions> tree = BuildNodeOptions(*list);
  ASSERT_TRUE(tree.ok()) << tree.status();
  EXPECT_EQ(Dump(*tree),
            "{driver=qcow2 backing:{driver=raw file:{file:{filename=b}}} "
            "file:{driver=file filename=x}}");
  EXPECT_EQ(tree->children.at("file").values.at("filename"), "x");
}

TEST(BuildNodeOptionsTest, EmptyListIsEmptyTree) {
  EXPECT_EQ(Dump(*BuildNodeOptions({})), "{}");
}

TEST(BuildNodeOptionsTest, ValueAndChildClash) {
  absl::StatusOr<NodeOptions> tree =
      BuildNodeOptions({{"file", "x"}, {"file.driver", "y"}});
  ASSERT_FALSE(tree.ok());
  EXPECT_EQ(tree.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(tree.status().message(),
            "Option 'file' cannot be both a value and a group of options "
            "('file.driver')");
  tree = BuildNodeOptions({{"file.driver", "y"}, {"file", "x"}});
  ASSERT_FALSE(tree.ok());
  EXPECT_EQ(tree.status().message(),
            "Option 'file' cannot be both a value and a group of options");
}

TEST(BuildNodeOptionsTest, RejectsEmptyComponentsAndDuplicates) {
  for (const char* key : {"file..filename", ".filename", "file.", "."}) {
    absl::StatusOr<NodeOptions> tree = BuildNodeOptions({{key, "x"}});
    ASSERT_FALSE(tree.ok()) << key;
    EXPECT_EQ(tree.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(tree.status().message(),
              std::string("Invalid option name '") + key + "'");
  }
  absl::StatusOr<NodeOptions> tree =
      BuildNodeOptions({{"a.b", "1"}, {"a.b", "2"}});
  ASSERT_FALSE(tree.ok());
  EXPECT_EQ(tree.status().message(), "Duplicate option 'a.b'");
}

absl::StatusOr<std::string> JsonTree(absl::string_view text) {
  absl::StatusOr<NodeOptions> tree = ParseJsonFilename(text);
  if (!tree.ok()) return tree.status();
  return Dump(*tree);
}

std::string JsonError(absl::string_view text) {
  absl::StatusOr<NodeOptions> tree = ParseJsonFilename(text);
  if (tree.ok()) return "ok: " + Dump(*tree);
  EXPECT_EQ(tree.status().code(), absl::StatusCode::kInvalidArgument);
  return std::string(tree.status().message());
}

TEST(ParseJsonFilenameTest, NestedObjectsAreChildren) {
  EXPECT_EQ(*JsonTree(R"(json:{"driver":"qcow2","file":{"driver":"file",)"
                      R"("filename":"/p/img.qcow2"}})"),
            "{driver=qcow2 file:{driver=file filename=/p/img.qcow2}}");
  // Without the prefix, with white space.
  EXPECT_EQ(*JsonTree(" { \"driver\" : \"raw\" }\n"), "{driver=raw}");
}

TEST(ParseJsonFilenameTest, ScalarsBecomeStrings) {
  EXPECT_EQ(*JsonTree(R"(json:{"a":true,"b":false,"c":65536,"d":-3,)"
                      R"("e":1.0,"f":1e3,"g":0.5,"h":18446744073709551615,)"
                      R"("i":2.5e-1})"),
            "{a=true b=false c=65536 d=-3 e=1 f=1000 g=0.5 "
            "h=18446744073709551615 i=0.25}");
}

TEST(ParseJsonFilenameTest, NumbersAndBooleansAreMarkedBare) {
  absl::StatusOr<NodeOptions> n = ParseJsonFilename(
      R"(json:{"a":true,"b":"x","c":65536,"file":{"d":"1","e":1.5}})");
  ASSERT_TRUE(n.ok()) << n.status();
  EXPECT_EQ(n->bare, (std::set<std::string>{"a", "c"}));
  EXPECT_EQ(n->children.at("file").bare, (std::set<std::string>{"e"}));
  absl::StatusOr<OptionList> list = ParseOptionString("a=1,b=on");
  ASSERT_TRUE(list.ok());
  EXPECT_TRUE(BuildNodeOptions(*list)->bare.empty());
}

TEST(ParseJsonFilenameTest, StringEscapesAndSingleQuotes) {
  EXPECT_EQ(*JsonTree(R"(json:{"a":"x\"y\\z\/\n\t","b":"\u00e9\ud83d\ude00",)"
                      R"('c':'it\'s'})"),
            "{a=x\"y\\z/\n\t b=\xC3\xA9\xF0\x9F\x98\x80 c=it's}");
}

TEST(ParseJsonFilenameTest, DottedKeysAndArraysFlatten) {
  EXPECT_EQ(*JsonTree(R"(json:{"file.filename":"r.raw","driver":"raw"})"),
            "{driver=raw file:{filename=r.raw}}");
  EXPECT_EQ(*JsonTree(R"(json:{"x":[1,{"a":2},"s"]})"),
            "{x:{0=1 2=s 1:{a=2}}}");
  EXPECT_EQ(*JsonTree(R"(json:{"file":{},"l":[]})"), "{file:{} l:{}}");
}

TEST(ParseJsonFilenameTest, Errors) {
  EXPECT_EQ(JsonError(R"(json:{"driver":"raw")"),
            "Could not parse the JSON options: JSON parse error, premature EOI");
  EXPECT_EQ(JsonError("json:"),
            "Could not parse the JSON options: Expecting a JSON value");
  EXPECT_EQ(JsonError("json:[1]"), "Invalid JSON object given");
  EXPECT_EQ(JsonError("json:null"), "Invalid JSON object given");
  EXPECT_EQ(JsonError("json:[null,{\"a\":null}]"),
            "Invalid JSON object given");
  EXPECT_EQ(JsonError("json:\"x\""), "Invalid JSON object given");
  EXPECT_EQ(JsonError(R"(json:{"driver":"raw","driver":"raw"})"),
            "Could not parse the JSON options: JSON parse error, duplicate key");
  EXPECT_EQ(JsonError(R"(json:{"a":1} x)"),
            "Could not parse the JSON options: Expecting at most one JSON value");
  EXPECT_EQ(JsonError(R"(json:{"a":null})"),
            "Could not parse the JSON options: null is not a valid value for 'a'");
  EXPECT_EQ(JsonError(R"(json:{"backing":{"x":null}})"),
            "Could not parse the JSON options: null is not a valid value for "
            "'backing.x'");
  {
    // "backing": null (no backing file) at any level is kept, as a value
    // no JSON string or option list gives.
    absl::StatusOr<NodeOptions> tree = ParseJsonFilename(
        R"(json:{"backing":null,"file":{"backing":null,"filename":"x"}})");
    ASSERT_TRUE(tree.ok()) << tree.status();
    EXPECT_EQ(tree->values.at("backing"), kJsonNullBacking);
    EXPECT_EQ(tree->children.at("file").values.at("backing"),
              kJsonNullBacking);
    EXPECT_EQ(tree->children.at("file").values.at("filename"), "x");
  }
  EXPECT_EQ(JsonError(R"(json:{"a":01})"),
            "Could not parse the JSON options: JSON parse error, invalid number "
            "at offset 7");
  EXPECT_EQ(JsonError(R"(json:{"a":1,})"),
            "Could not parse the JSON options: JSON parse error, key is not a "
            "string in object at offset 7");
  EXPECT_EQ(JsonError(R"(json:{"a" 1})"),
            "Could not parse the JSON options: JSON parse error, missing : in "
            "object pair at offset 5");
  EXPECT_EQ(JsonError(R"(json:{"file":"x","file.driver":"y"})"),
            "Option 'file' cannot be both a value and a group of options "
            "('file.driver')");
  EXPECT_EQ(JsonError(R"(json:{"file":{"filename":"x"},"file.filename":"y"})"),
            "Duplicate option 'file.filename'");
  EXPECT_EQ(JsonError(R"(json:{"a":"\ud800"})"),
            "Could not parse the JSON options: JSON parse error, invalid "
            "surrogate pair at offset 12");
}

}  // namespace
}  // namespace imgtool

namespace imgtool {
namespace {

TEST(ParseBoolOptionTest, TakesQemusSpellings) {
  for (const char* on : {"on", "yes", "true", "y"}) {
    EXPECT_TRUE(*ParseBoolOption("x", on)) << on;
  }
  for (const char* off : {"off", "no", "false", "n"}) {
    EXPECT_FALSE(*ParseBoolOption("x", off)) << off;
  }
  EXPECT_EQ(ParseBoolOption("lazy_refcounts", "maybe").status().message(),
            "Parameter 'lazy_refcounts' expects 'on' or 'off'");
  EXPECT_FALSE(ParseBoolOption("x", "ON").ok());
}

}  // namespace
}  // namespace imgtool

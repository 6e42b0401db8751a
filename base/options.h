// Option strings as qemu-img takes them in `-o` and `--image-opts`:
// "key=value,key2=value2", where ",," inside a value stands for one comma and
// dotted keys address child nodes ("file.filename=x" sets `filename` of the
// child named `file`). A bare first item without '=' is kept under the key
// given as `implied_key` (qemu-img: "file" for --image-opts, none for -o).
#ifndef IMGTOOL_BASE_OPTIONS_H_
#define IMGTOOL_BASE_OPTIONS_H_

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace imgtool {

// Flat list in the order given; keys keep their dots.
using OptionList = std::vector<std::pair<std::string, std::string>>;

// Splits `text` into key/value pairs. Errors (kInvalidArgument): empty key
// ("Invalid option string: <text>"), a key given twice ("Duplicate option
// '<key>'"), an item without '=' other than a leading implied one
// ("Invalid parameter '<item>'"). "help" and "?" items are returned as
// key "help" with an empty value.
absl::StatusOr<OptionList> ParseOptionString(absl::string_view text,
                                             absl::string_view implied_key = "");

// Options of one node and its children, from dotted keys:
// "driver=qcow2,file.driver=file,file.filename=x" gives
// {values: {driver: qcow2}, children: {file: {values: {driver: file,
// filename: x}}}}.
struct NodeOptions {
  std::map<std::string, std::string> values;
  std::map<std::string, NodeOptions> children;
};

// Builds the tree from a flat list. kInvalidArgument if a key is both a
// value and a child ("file=x,file.driver=y").
absl::StatusOr<NodeOptions> BuildNodeOptions(const OptionList& options);

// Parses a `json:{...}` filename (QEMU's JSON pseudo-protocol) into the same
// tree: nested objects are children, scalars become strings ("true",
// "65536"). kInvalidArgument with the JSON parse error otherwise.
absl::StatusOr<NodeOptions> ParseJsonFilename(absl::string_view text);

}  // namespace imgtool

#endif  // IMGTOOL_BASE_OPTIONS_H_

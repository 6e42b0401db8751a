// Option strings as qemu-img takes them in `-o` and `--image-opts`:
// "key=value,key2=value2", where ",," inside a value stands for one comma and
// dotted keys address child nodes ("file.filename=x" sets `filename` of the
// child named `file`). A bare first item without '=' is kept under the key
// given as `implied_key` (qemu-img: "file" for --image-opts, none for -o).
#ifndef IMGTOOL_BASE_OPTIONS_H_
#define IMGTOOL_BASE_OPTIONS_H_

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace imgtool {

// Flat list in the order given; keys keep their dots.
using OptionList = std::vector<std::pair<std::string, std::string>>;

// Splits `text` into key/value pairs; "" gives an empty list. Errors
// (kInvalidArgument, texts as qemu-img 7.2's where it has them): an empty
// item, i.e. a leading ',' or an odd number of trailing ones ("Invalid
// option list: <text>"); an empty key ("Invalid parameter ''"); a key given
// twice ("Duplicate option '<key>'"; QEMU would keep the last); an item
// without '=' other than a leading implied one ("Invalid parameter
// '<item>'"; QEMU's deprecated "flag" = "flag=on" form is not supported).
// "help" and "?" items, even the first, are returned as key "help" with an
// empty value.
absl::StatusOr<OptionList> ParseOptionString(absl::string_view text,
                                             absl::string_view implied_key = "");

// QEMU's boolean option values: on/yes/true/y and off/no/false/n.
// kInvalidArgument "Parameter '<name>' expects 'on' or 'off'" otherwise.
absl::StatusOr<bool> ParseBoolOption(absl::string_view name,
                                     absl::string_view value);

// QEMU's number option values (QemuOpts: qemu_strtou64, base 0: decimal,
// 0x hex, 0 octal; leading blanks; "-N" wraps around as strtoull does).
// kInvalidArgument "Parameter '<name>' expects a number" otherwise.
absl::StatusOr<uint64_t> ParseNumberOption(absl::string_view name,
                                           const std::string& value);

// Options of one node and its children, from dotted keys:
// "driver=qcow2,file.driver=file,file.filename=x" gives
// {values: {driver: qcow2}, children: {file: {values: {driver: file,
// filename: x}}}}.
struct NodeOptions {
  std::map<std::string, std::string> values;
  std::map<std::string, NodeOptions> children;
  // Keys of `values` whose json: value was a number or a boolean, not a
  // string: QEMU prints them bare in the json:{...} names of nodes
  // ("size": 1048576, but "size": "1M" for a string or an option string).
  std::set<std::string> bare;
};

// Builds the tree from a flat list. kInvalidArgument if a key is both a
// value and a child ("file=x,file.driver=y"), has an empty component
// ("file..x", ".x", "x."), or is given twice.
absl::StatusOr<NodeOptions> BuildNodeOptions(const OptionList& options);

// The value ParseJsonFilename gives `"backing": null` (QEMU: no backing
// file), a string no JSON text or option list yields as a value.
inline constexpr absl::string_view kJsonNullBacking{"\0null", 5};

// Parses a `json:{...}` filename (QEMU's JSON pseudo-protocol; the "json:"
// prefix is optional here) into the same tree: nested objects are children,
// dotted keys are split as in BuildNodeOptions ({"file.filename": "x"} is
// the same as {"file": {"filename": "x"}}), arrays flatten to children keyed
// by index ("x": [1] gives x.0 = 1), an empty object or array gives an empty
// child, and scalars become strings ("true", "65536"; integer literals are
// kept as written, other numbers print as integers when integral, else with
// %.17g; numbers and booleans are listed in NodeOptions::bare).
// Single-quoted strings are accepted, as QEMU does. Errors
// (kInvalidArgument): "Invalid JSON object given" if the value is not an
// object; "Could not parse the JSON options: <reason>" for bad JSON, a
// duplicate key ("JSON parse error, duplicate key") or a null other than
// a "backing" key's (that one becomes kJsonNullBacking); the
// BuildNodeOptions errors for clashing keys.
absl::StatusOr<NodeOptions> ParseJsonFilename(absl::string_view text);

}  // namespace imgtool

#endif  // IMGTOOL_BASE_OPTIONS_H_

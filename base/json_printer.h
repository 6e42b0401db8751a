// Prints protobuf messages as JSON in qemu-img's layout: 4-space indent,
// ": " separators, 64-bit integers as bare numbers (MessageToJsonString would
// quote them), booleans as true/false, fields in declaration order, field
// names from the proto's json_name (set them with [json_name = "virtual-size"]
// to get qemu-img's dashed keys), unset optional fields and empty repeated
// fields left out (but for a field whose proto name ends in "_always",
// printed as an empty list, as QEMU prints mandatory lists), nested messages
// indented. An empty message is "{\n}".
#ifndef IMGTOOL_BASE_JSON_PRINTER_H_
#define IMGTOOL_BASE_JSON_PRINTER_H_

#include <string>

#include "google/protobuf/message.h"

namespace imgtool {

// Returns the JSON text of `message`, without a trailing newline, indented by
// `indent` levels of 4 spaces (for messages nested in arrays).
std::string PrintJson(const google::protobuf::Message& message, int indent = 0);

// Appends `s` to `out` as a JSON string the way QEMU quotes strings: the
// short escapes for " \\ \b \f \n \r \t, \uXXXX (upper-case hex) for other
// control characters and everything outside printable ASCII, surrogate
// pairs beyond the BMP, U+FFFD for invalid UTF-8.
void AppendJsonString(const std::string& s, std::string* out);

}  // namespace imgtool

#endif  // IMGTOOL_BASE_JSON_PRINTER_H_

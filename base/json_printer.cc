#include "base/json_printer.h"

#include "absl/strings/match.h"

#include <charconv>

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "google/protobuf/descriptor.h"

namespace imgtool {
namespace {

using ::google::protobuf::FieldDescriptor;
using ::google::protobuf::Message;
using ::google::protobuf::Reflection;

// Decodes one code point the way QEMU's mod_utf8_codepoint does (modified
// UTF-8: "\xC0\x80" is U+0000; overlong forms, surrogates, noncharacters
// and values past U+10FFFF are invalid). Returns -1 for invalid input and
// advances *pos past what was consumed (at least one byte).
int DecodeCodePoint(const std::string& s, size_t* pos) {
  static constexpr int kMinCodePoint[] = {0x80, 0x800, 0x10000, 0x200000,
                                          0x4000000};
  unsigned byte = static_cast<unsigned char>(s[(*pos)++]);
  if (byte < 0x80) return static_cast<int>(byte);
  if (byte >= 0xFE || (byte & 0x40) == 0) return -1;
  int len = 0;
  unsigned mask = 0x80;
  for (; byte & mask; mask >>= 1) ++len;
  int cp = static_cast<int>(byte & (mask - 1));
  for (int i = 1; i < len; ++i) {
    if (*pos >= s.size() ||
        (static_cast<unsigned char>(s[*pos]) & 0xC0) != 0x80) {
      return -1;  // Missing continuation byte: left for the next round.
    }
    cp = (cp << 6) | (static_cast<unsigned char>(s[(*pos)++]) & 0x3F);
  }
  if (cp > 0x10FFFF) return -1;
  if ((cp >= 0xFDD0 && cp <= 0xFDEF) || (cp & 0xFFFE) == 0xFFFE) return -1;
  if (cp >= 0xD800 && cp <= 0xDFFF) return -1;
  if (len == 2 && cp == 0) return 0;
  if (cp < kMinCodePoint[len - 2]) return -1;
  return cp;
}

class Printer {
 public:
  explicit Printer(std::string* out) : out_(*out) {}

  // Prints `message` as an object whose closing brace is at `level`.
  void PrintMessage(const Message& message, int level) {
    const auto* descriptor = message.GetDescriptor();
    const Reflection* reflection = message.GetReflection();
    out_ += '{';
    bool first = true;
    for (int i = 0; i < descriptor->field_count(); ++i) {
      const FieldDescriptor* field = descriptor->field(i);
      if (field->is_repeated()) {
        if (reflection->FieldSize(message, field) == 0 &&
            !absl::EndsWith(field->name(), "_always")) {
          continue;
        }
      } else if (field->has_presence() &&
                 !reflection->HasField(message, field)) {
        continue;
      }
      StartMember(&first, level + 1);
      AppendJsonString(field->json_name(), &out_);
      out_ += ": ";
      if (field->is_map()) {
        PrintMap(message, field, level + 1);
      } else if (field->is_repeated()) {
        PrintList(message, field, level + 1);
      } else {
        PrintValue(message, field, -1, level + 1);
      }
    }
    Newline(level);
    out_ += '}';
  }

 private:
  void Newline(int level) {
    out_ += '\n';
    out_.append(4 * level, ' ');
  }

  void StartMember(bool* first, int level) {
    if (!*first) out_ += ',';
    *first = false;
    Newline(level);
  }

  void PrintList(const Message& message, const FieldDescriptor* field,
                 int level) {
    const int size = message.GetReflection()->FieldSize(message, field);
    out_ += '[';
    bool first = true;
    for (int i = 0; i < size; ++i) {
      StartMember(&first, level + 1);
      PrintValue(message, field, i, level + 1);
    }
    Newline(level);
    out_ += ']';
  }

  // Map entries become members of an object, sorted by key.
  void PrintMap(const Message& message, const FieldDescriptor* field,
                int level) {
    const Reflection* reflection = message.GetReflection();
    const int size = reflection->FieldSize(message, field);
    std::vector<std::pair<std::string, const Message*>> entries;
    for (int i = 0; i < size; ++i) {
      const Message& entry =
          reflection->GetRepeatedMessage(message, field, i);
      const FieldDescriptor* key_field = entry.GetDescriptor()->map_key();
      std::string key;
      if (key_field->cpp_type() == FieldDescriptor::CPPTYPE_STRING) {
        key = entry.GetReflection()->GetString(entry, key_field);
      } else {
        key = ScalarText(entry, key_field, -1);
      }
      entries.emplace_back(std::move(key), &entry);
    }
    std::sort(entries.begin(), entries.end(),
              [](const auto& a, const auto& b) { return a.first < b.first; });
    out_ += '{';
    bool first = true;
    for (const auto& [key, entry] : entries) {
      StartMember(&first, level + 1);
      AppendJsonString(key, &out_);
      out_ += ": ";
      PrintValue(*entry, entry->GetDescriptor()->map_value(), -1, level + 1);
    }
    Newline(level);
    out_ += '}';
  }

  // The shortest decimal text that reads back as exactly `value`
  // (68.864, not 68.864000000000004).
  template <typename T>
  static std::string ShortestText(T value) {
    char buf[64];
    auto [end, ec] = std::to_chars(buf, buf + sizeof(buf), value);
    return std::string(buf, end);
  }

  // Text of a non-message, non-string value; `index` < 0 for a singular
  // field.
  static std::string ScalarText(const Message& message,
                                const FieldDescriptor* field, int index) {
    const Reflection* r = message.GetReflection();
    const bool rep = index >= 0;
    switch (field->cpp_type()) {
      case FieldDescriptor::CPPTYPE_INT32:
        return absl::StrCat(rep ? r->GetRepeatedInt32(message, field, index)
                                : r->GetInt32(message, field));
      case FieldDescriptor::CPPTYPE_INT64:
        return absl::StrCat(rep ? r->GetRepeatedInt64(message, field, index)
                                : r->GetInt64(message, field));
      case FieldDescriptor::CPPTYPE_UINT32:
        return absl::StrCat(rep ? r->GetRepeatedUInt32(message, field, index)
                                : r->GetUInt32(message, field));
      case FieldDescriptor::CPPTYPE_UINT64:
        return absl::StrCat(rep ? r->GetRepeatedUInt64(message, field, index)
                                : r->GetUInt64(message, field));
      case FieldDescriptor::CPPTYPE_DOUBLE:
        return ShortestText(rep ? r->GetRepeatedDouble(message, field, index)
                                : r->GetDouble(message, field));
      case FieldDescriptor::CPPTYPE_FLOAT:
        return ShortestText(rep ? r->GetRepeatedFloat(message, field, index)
                                : r->GetFloat(message, field));
      case FieldDescriptor::CPPTYPE_BOOL:
        return (rep ? r->GetRepeatedBool(message, field, index)
                    : r->GetBool(message, field))
                   ? "true"
                   : "false";
      case FieldDescriptor::CPPTYPE_ENUM: {
        const auto* value = rep ? r->GetRepeatedEnum(message, field, index)
                                : r->GetEnum(message, field);
        std::string quoted;
        AppendJsonString(value->name(), &quoted);
        return quoted;
      }
      case FieldDescriptor::CPPTYPE_STRING:
      case FieldDescriptor::CPPTYPE_MESSAGE:
        break;
    }
    return "";
  }

  void PrintValue(const Message& message, const FieldDescriptor* field,
                  int index, int level) {
    const Reflection* r = message.GetReflection();
    switch (field->cpp_type()) {
      case FieldDescriptor::CPPTYPE_MESSAGE:
        PrintMessage(index >= 0 ? r->GetRepeatedMessage(message, field, index)
                                : r->GetMessage(message, field),
                     level);
        return;
      case FieldDescriptor::CPPTYPE_STRING: {
        std::string scratch;
        const std::string& value =
            index >= 0
                ? r->GetRepeatedStringReference(message, field, index, &scratch)
                : r->GetStringReference(message, field, &scratch);
        AppendJsonString(value, &out_);
        return;
      }
      default:
        out_ += ScalarText(message, field, index);
    }
  }

  std::string& out_;
};

}  // namespace

// QEMU's JSON string quoting: the short escapes for " \ \b \f \n \r \t,
// \uXXXX (upper-case hex) for other control characters and everything
// outside printable ASCII, surrogate pairs beyond the BMP, U+FFFD for
// invalid UTF-8.
void AppendJsonString(const std::string& s, std::string* out) {
  out->push_back('"');
  size_t pos = 0;
  while (pos < s.size()) {
    int cp = DecodeCodePoint(s, &pos);
    switch (cp) {
      case '"': *out += "\\\""; break;
      case '\\': *out += "\\\\"; break;
      case '\b': *out += "\\b"; break;
      case '\f': *out += "\\f"; break;
      case '\n': *out += "\\n"; break;
      case '\r': *out += "\\r"; break;
      case '\t': *out += "\\t"; break;
      default:
        if (cp < 0) cp = 0xFFFD;
        if (cp > 0xFFFF) {
          absl::StrAppendFormat(out, "\\u%04X\\u%04X",
                                0xD800 + ((cp - 0x10000) >> 10),
                                0xDC00 + ((cp - 0x10000) & 0x3FF));
        } else if (cp < 0x20 || cp >= 0x7F) {
          absl::StrAppendFormat(out, "\\u%04X", cp);
        } else {
          out->push_back(static_cast<char>(cp));
        }
    }
  }
  out->push_back('"');
}

std::string PrintJson(const google::protobuf::Message& message, int indent) {
  std::string out;
  Printer(&out).PrintMessage(message, indent);
  return out;
}

}  // namespace imgtool

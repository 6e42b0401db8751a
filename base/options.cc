#include "base/options.h"

#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "base/status_macros.h"

namespace imgtool {
namespace {

// Reads a value up to the next single ',' (",," stands for one comma), from
// `text[*pos]`. Leaves *pos on the ',' or at the end.
std::string ReadValue(absl::string_view text, size_t* pos) {
  std::string value;
  size_t i = *pos;
  while (i < text.size()) {
    if (text[i] == ',') {
      if (i + 1 < text.size() && text[i + 1] == ',') {
        value.push_back(',');
        i += 2;
        continue;
      }
      break;
    }
    value.push_back(text[i]);
    ++i;
  }
  *pos = i;
  return value;
}

absl::Status DuplicateError(absl::string_view key) {
  return absl::InvalidArgumentError(
      absl::StrCat("Duplicate option '", key, "'"));
}

// Adds `value` under the dotted `key` to `root`.
absl::Status AddOption(NodeOptions* root, absl::string_view key,
                       const std::string& value, bool bare = false) {
  std::vector<absl::string_view> parts = absl::StrSplit(key, '.');
  for (absl::string_view part : parts) {
    if (part.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("Invalid option name '", key, "'"));
    }
  }
  NodeOptions* node = root;
  std::string prefix;
  for (size_t i = 0; i + 1 < parts.size(); ++i) {
    const std::string part(parts[i]);
    absl::StrAppend(&prefix, prefix.empty() ? "" : ".", part);
    if (node->values.count(part) != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "Option '", prefix, "' cannot be both a value and a group of "
          "options ('", key, "')"));
    }
    node = &node->children[part];
  }
  const std::string last(parts.back());
  if (node->children.count(last) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Option '", key, "' cannot be both a value and a group of options"));
  }
  if (!node->values.emplace(last, value).second) return DuplicateError(key);
  if (bare) node->bare.insert(last);
  return absl::OkStatus();
}

// --- JSON (QEMU's dialect: also single-quoted strings) ---------------------

class JsonParser {
 public:
  explicit JsonParser(absl::string_view text) : text_(text) {}

  // Parses the one object of the text into `root`.
  absl::Status ParseDocument(NodeOptions* root) {
    SkipSpace();
    if (pos_ >= text_.size()) return ParseError("Expecting a JSON value");
    if (text_[pos_] != '{') {
      // Any other value: check it is one, then refuse it.
      NodeOptions scratch;
      any_null_ = true;  // nulls are values too here, as in QEMU
      RETURN_IF_ERROR(ParseValue(&scratch, "", 0));
      return absl::InvalidArgumentError("Invalid JSON object given");
    }
    RETURN_IF_ERROR(ParseValue(root, "", 0));
    SkipSpace();
    if (pos_ != text_.size()) {
      return ParseError("Expecting at most one JSON value");
    }
    return absl::OkStatus();
  }

 private:
  static constexpr int kMaxDepth = 64;

  absl::Status ParseError(absl::string_view what) const {
    return absl::InvalidArgumentError(
        absl::StrCat("Could not parse the JSON options: ", what));
  }
  absl::Status SyntaxError(absl::string_view what) const {
    return ParseError(
        absl::StrCat("JSON parse error, ", what, " at offset ", pos_));
  }

  void SkipSpace() {
    while (pos_ < text_.size() &&
           (text_[pos_] == ' ' || text_[pos_] == '\t' || text_[pos_] == '\n' ||
            text_[pos_] == '\r')) {
      ++pos_;
    }
  }

  bool Consume(absl::string_view word) {
    if (text_.substr(pos_, word.size()) != word) return false;
    pos_ += word.size();
    return true;
  }

  // Parses a value found at dotted `key` (empty for the document itself) and
  // stores scalars in `root`.
  absl::Status ParseValue(NodeOptions* root, const std::string& key,
                          int depth) {
    if (depth > kMaxDepth) return SyntaxError("too deeply nested");
    SkipSpace();
    if (pos_ >= text_.size()) return ParseError("JSON parse error, premature EOI");
    const char c = text_[pos_];
    if (c == '{') return ParseObject(root, key, depth);
    if (c == '[') return ParseArray(root, key, depth);
    std::string scalar;
    bool bare = true;  // a number or a boolean
    if (c == '"' || c == '\'') {
      bare = false;
      RETURN_IF_ERROR(ParseString(&scalar));
    } else if (Consume("true")) {
      scalar = "true";
    } else if (Consume("false")) {
      scalar = "false";
    } else if (Consume("null")) {
      if (any_null_) return absl::OkStatus();
      const size_t dot = key.rfind('.');
      if ((dot == std::string::npos ? key : key.substr(dot + 1)) ==
          "backing") {
        return AddOption(root, key, std::string(kJsonNullBacking));
      }
      return ParseError(absl::StrCat("null is not a valid value for '", key,
                                     "'"));
    } else if (c == '-' || (c >= '0' && c <= '9')) {
      RETURN_IF_ERROR(ParseNumber(&scalar));
    } else {
      return SyntaxError(absl::StrFormat("invalid character '%c'", c));
    }
    if (key.empty()) return absl::OkStatus();  // A bare scalar document.
    return AddOption(root, key, scalar, bare);
  }

  absl::Status ParseObject(NodeOptions* root, const std::string& key,
                           int depth) {
    ++pos_;  // '{'
    std::vector<std::string> seen;
    SkipSpace();
    if (pos_ < text_.size() && text_[pos_] == '}') {
      ++pos_;
      // An empty object still names a child node.
      if (!key.empty()) RETURN_IF_ERROR(AddEmptyChild(root, key));
      return absl::OkStatus();
    }
    while (true) {
      SkipSpace();
      if (pos_ >= text_.size()) {
        return ParseError("JSON parse error, premature EOI");
      }
      if (text_[pos_] != '"' && text_[pos_] != '\'') {
        return SyntaxError("key is not a string in object");
      }
      std::string name;
      RETURN_IF_ERROR(ParseString(&name));
      for (const std::string& s : seen) {
        if (s == name) return ParseError("JSON parse error, duplicate key");
      }
      seen.push_back(name);
      SkipSpace();
      if (pos_ >= text_.size()) {
        return ParseError("JSON parse error, premature EOI");
      }
      if (text_[pos_] != ':') return SyntaxError("missing : in object pair");
      ++pos_;
      const std::string child_key =
          key.empty() ? name : absl::StrCat(key, ".", name);
      RETURN_IF_ERROR(ParseValue(root, child_key, depth + 1));
      SkipSpace();
      if (pos_ >= text_.size()) {
        return ParseError("JSON parse error, premature EOI");
      }
      if (text_[pos_] == ',') {
        ++pos_;
        continue;
      }
      if (text_[pos_] == '}') {
        ++pos_;
        return absl::OkStatus();
      }
      return SyntaxError("expected separator in dict");
    }
  }

  // Arrays flatten like QEMU's: element i of "x" is "x.i".
  absl::Status ParseArray(NodeOptions* root, const std::string& key,
                          int depth) {
    ++pos_;  // '['
    SkipSpace();
    if (pos_ < text_.size() && text_[pos_] == ']') {
      ++pos_;
      if (!key.empty()) RETURN_IF_ERROR(AddEmptyChild(root, key));
      return absl::OkStatus();
    }
    for (int index = 0;; ++index) {
      RETURN_IF_ERROR(ParseValue(
          root, key.empty() ? "" : absl::StrCat(key, ".", index), depth + 1));
      SkipSpace();
      if (pos_ >= text_.size()) {
        return ParseError("JSON parse error, premature EOI");
      }
      if (text_[pos_] == ',') {
        ++pos_;
        continue;
      }
      if (text_[pos_] == ']') {
        ++pos_;
        return absl::OkStatus();
      }
      return SyntaxError("expected separator in list");
    }
  }

  absl::Status AddEmptyChild(NodeOptions* root, const std::string& key) {
    NodeOptions* node = root;
    std::string prefix;
    for (absl::string_view part : absl::StrSplit(key, '.')) {
      const std::string name(part);
      if (name.empty()) {
        return absl::InvalidArgumentError(
            absl::StrCat("Invalid option name '", key, "'"));
      }
      absl::StrAppend(&prefix, prefix.empty() ? "" : ".", name);
      if (node->values.count(name) != 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            "Option '", prefix,
            "' cannot be both a value and a group of options"));
      }
      node = &node->children[name];
    }
    return absl::OkStatus();
  }

  static void AppendUtf8(uint32_t cp, std::string* out) {
    if (cp < 0x80) {
      out->push_back(static_cast<char>(cp));
    } else if (cp < 0x800) {
      out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
      out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    } else if (cp < 0x10000) {
      out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
      out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
      out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    } else {
      out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
      out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
      out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
      out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    }
  }

  bool ReadHex4(uint32_t* value) {
    if (pos_ + 4 > text_.size()) return false;
    uint32_t v = 0;
    for (int i = 0; i < 4; ++i) {
      const char h = text_[pos_ + i];
      v <<= 4;
      if (h >= '0' && h <= '9') {
        v |= h - '0';
      } else if (h >= 'a' && h <= 'f') {
        v |= h - 'a' + 10;
      } else if (h >= 'A' && h <= 'F') {
        v |= h - 'A' + 10;
      } else {
        return false;
      }
    }
    pos_ += 4;
    *value = v;
    return true;
  }

  absl::Status ParseString(std::string* out) {
    const char quote = text_[pos_++];
    while (true) {
      if (pos_ >= text_.size()) {
        return ParseError("JSON parse error, premature EOI");
      }
      const char c = text_[pos_++];
      if (c == quote) return absl::OkStatus();
      if (static_cast<unsigned char>(c) < 0x20) {
        return SyntaxError("control character in string");
      }
      if (c != '\\') {
        out->push_back(c);
        continue;
      }
      if (pos_ >= text_.size()) {
        return ParseError("JSON parse error, premature EOI");
      }
      const char e = text_[pos_++];
      switch (e) {
        case '"': case '\'': case '\\': case '/': out->push_back(e); break;
        case 'b': out->push_back('\b'); break;
        case 'f': out->push_back('\f'); break;
        case 'n': out->push_back('\n'); break;
        case 'r': out->push_back('\r'); break;
        case 't': out->push_back('\t'); break;
        case 'u': {
          uint32_t cp = 0;
          if (!ReadHex4(&cp)) return SyntaxError("invalid \\u escape");
          if (cp >= 0xD800 && cp <= 0xDBFF) {
            uint32_t low = 0;
            if (!Consume("\\u") || !ReadHex4(&low) || low < 0xDC00 ||
                low > 0xDFFF) {
              return SyntaxError("invalid surrogate pair");
            }
            cp = 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00);
          } else if (cp >= 0xDC00 && cp <= 0xDFFF) {
            return SyntaxError("invalid surrogate pair");
          } else if (cp == 0) {
            return SyntaxError("\\u0000 in string");
          }
          AppendUtf8(cp, out);
          break;
        }
        default:
          return SyntaxError("invalid escape sequence in string");
      }
    }
  }

  // JSON number syntax. Integers keep their text; other numbers print as an
  // integer when integral, else with 17 significant digits.
  absl::Status ParseNumber(std::string* out) {
    const size_t start = pos_;
    auto digits = [&] {
      const size_t from = pos_;
      while (pos_ < text_.size() && text_[pos_] >= '0' && text_[pos_] <= '9') {
        ++pos_;
      }
      return pos_ - from;
    };
    if (text_[pos_] == '-') ++pos_;
    const size_t int_start = pos_;
    if (digits() == 0) return SyntaxError("invalid number");
    if (pos_ - int_start > 1 && text_[int_start] == '0') {
      return SyntaxError("invalid number");
    }
    bool integer = true;
    if (pos_ < text_.size() && text_[pos_] == '.') {
      ++pos_;
      integer = false;
      if (digits() == 0) return SyntaxError("invalid number");
    }
    if (pos_ < text_.size() && (text_[pos_] == 'e' || text_[pos_] == 'E')) {
      ++pos_;
      integer = false;
      if (pos_ < text_.size() && (text_[pos_] == '+' || text_[pos_] == '-')) {
        ++pos_;
      }
      if (digits() == 0) return SyntaxError("invalid number");
    }
    const std::string literal(text_.substr(start, pos_ - start));
    if (integer) {
      *out = literal;
      return absl::OkStatus();
    }
    const double value = std::strtod(literal.c_str(), nullptr);
    if (!std::isfinite(value)) return SyntaxError("number out of range");
    if (value == std::trunc(value) && std::fabs(value) < 0x1p63) {
      *out = absl::StrCat(static_cast<int64_t>(value));
    } else {
      *out = absl::StrFormat("%.17g", value);
    }
    return absl::OkStatus();
  }

  absl::string_view text_;
  size_t pos_ = 0;
  // Inside a document that is not an object (refused after the parse).
  bool any_null_ = false;
};

}  // namespace

absl::StatusOr<OptionList> ParseOptionString(absl::string_view text,
                                             absl::string_view implied_key) {
  OptionList options;
  size_t pos = 0;
  bool first = true;
  while (pos < text.size()) {
    if (text[pos] == ',') {
      // An empty item: leading comma, or an odd run of trailing ones.
      return absl::InvalidArgumentError(
          absl::StrCat("Invalid option list: ", text));
    }
    const size_t name_end = text.find_first_of("=,", pos);
    std::string key;
    std::string value;
    if (name_end == absl::string_view::npos || text[name_end] != '=') {
      const absl::string_view name = text.substr(
          pos, name_end == absl::string_view::npos ? absl::string_view::npos
                                                   : name_end - pos);
      if (name == "help" || name == "?") {
        key = "help";
        pos += name.size();
      } else if (first && !implied_key.empty()) {
        key = std::string(implied_key);
        value = ReadValue(text, &pos);
      } else {
        return absl::InvalidArgumentError(
            absl::StrCat("Invalid parameter '", name, "'"));
      }
    } else {
      key = std::string(text.substr(pos, name_end - pos));
      if (key.empty()) {
        return absl::InvalidArgumentError("Invalid parameter ''");
      }
      pos = name_end + 1;
      value = ReadValue(text, &pos);
    }
    for (const auto& [existing, unused] : options) {
      if (existing == key) return DuplicateError(key);
    }
    options.emplace_back(std::move(key), std::move(value));
    first = false;
    if (pos < text.size()) {
      ++pos;  // ','
      if (pos == text.size()) {
        return absl::InvalidArgumentError(
            absl::StrCat("Invalid option list: ", text));
      }
    }
  }
  return options;
}

absl::StatusOr<NodeOptions> BuildNodeOptions(const OptionList& options) {
  NodeOptions root;
  for (const auto& [key, value] : options) {
    RETURN_IF_ERROR(AddOption(&root, key, value));
  }
  return root;
}

absl::StatusOr<NodeOptions> ParseJsonFilename(absl::string_view text) {
  absl::ConsumePrefix(&text, "json:");
  NodeOptions root;
  JsonParser parser(text);
  RETURN_IF_ERROR(parser.ParseDocument(&root));
  return root;
}

absl::StatusOr<bool> ParseBoolOption(absl::string_view name,
                                     absl::string_view value) {
  if (value == "on" || value == "yes" || value == "true" || value == "y") {
    return true;
  }
  if (value == "off" || value == "no" || value == "false" || value == "n") {
    return false;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("Parameter '", name, "' expects 'on' or 'off'"));
}

absl::StatusOr<uint64_t> ParseNumberOption(absl::string_view name,
                                           const std::string& value) {
  errno = 0;
  char* end = nullptr;
  const unsigned long long n = std::strtoull(value.c_str(), &end, 0);
  if (value.empty() || end == value.c_str() || *end != '\0' || errno != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("Parameter '", name, "' expects a number"));
  }
  return static_cast<uint64_t>(n);
}

}  // namespace imgtool

#include "base/size.h"

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace imgtool {
namespace {

enum class SizeError { kNone, kInvalid, kRange };

// Multiplier of a size suffix (powers of 1024), or 0 if `c` is none.
uint64_t SuffixMultiplier(char c) {
  switch (c) {
    case 'b': case 'B': return 1;
    case 'k': case 'K': return 1ull << 10;
    case 'm': case 'M': return 1ull << 20;
    case 'g': case 'G': return 1ull << 30;
    case 't': case 'T': return 1ull << 40;
    case 'p': case 'P': return 1ull << 50;
    case 'e': case 'E': return 1ull << 60;
    default: return 0;
  }
}

// strtoull with qemu_strtou64's error rules: no digits -> kInvalid,
// overflow -> kRange. `*end` is set in every case.
SizeError ParseU64(const char* text, int base, const char** end,
                   uint64_t* value) {
  char* ep = nullptr;
  errno = 0;
  *value = std::strtoull(text, &ep, base);
  *end = ep;
  if (ep == text) return SizeError::kInvalid;
  if (errno == ERANGE) return SizeError::kRange;
  return SizeError::kNone;
}

// The grammar of qemu-img 7.2 sizes (qemu_strtosz with unit 1024 and
// default suffix 'B'), with the whole string to be consumed. The result may
// be anything up to 2^64-1; callers apply their own limit.
SizeError ParseSizeText(absl::string_view input, uint64_t* result) {
  const std::string copy(input);  // strtoull needs NUL termination.
  if (copy.size() != std::strlen(copy.c_str())) return SizeError::kInvalid;
  const char* text = copy.c_str();
  const char* end = text;
  uint64_t value = 0;
  uint64_t fraction = 0;  // 0.64 fixed point.

  SizeError err = ParseU64(text, 10, &end, &value);
  if (err == SizeError::kNone &&
      std::memchr(text, '-', end - text) != nullptr) {
    return SizeError::kInvalid;  // strtoull wraps negative numbers.
  }
  if (err == SizeError::kNone && value == 0 && (*end == 'x' || *end == 'X')) {
    // Looks like hex: reparse, and allow no fraction. qemu-img 7.2 still
    // accepts a suffix after hex (with a deprecation warning).
    err = ParseU64(text, 16, &end, &value);
    if (err == SizeError::kNone && *end == '.') return SizeError::kInvalid;
  } else if (err == SizeError::kNone && *end == '.') {
    // A fraction: digits only ("1.k" works without them); an exponent makes
    // the whole size invalid, as it does for qemu-img.
    const char* f = end + 1;
    const char* digits_end = f;
    while (*digits_end >= '0' && *digits_end <= '9') ++digits_end;
    const char* after = digits_end;
    if (*after == 'e' || *after == 'E') {
      const char* p = after + 1;
      if (*p == '+' || *p == '-') ++p;
      if (*p >= '0' && *p <= '9') return SizeError::kInvalid;
    }
    if (digits_end > f) {
      double fraction_value =
          std::strtod(std::string(end, digits_end).c_str(), nullptr);
      double scaled = fraction_value * 0x1p64;
      // A fraction that rounds to 1.0 ("7.99999999999999999E") converts to
      // 0 on x86-64 in qemu-img; do the same.
      fraction = scaled >= 0x1p64 ? 0 : static_cast<uint64_t>(scaled);
    }
    end = digits_end;
  }
  if (err == SizeError::kInvalid) return err;
  if (err == SizeError::kRange) {
    return *end == '\0' ? SizeError::kRange : SizeError::kInvalid;
  }

  uint64_t multiplier = SuffixMultiplier(*end);
  if (multiplier != 0) {
    ++end;
  } else {
    multiplier = 1;
  }
  if (multiplier == 1) {
    // A fraction needs a scaling suffix.
    if (fraction != 0) return SizeError::kInvalid;
  } else {
    // Exact 64.64 x 64 multiplication, rounding 0.5 up.
    unsigned __int128 total =
        static_cast<unsigned __int128>(value) * multiplier;
    unsigned __int128 frac =
        static_cast<unsigned __int128>(fraction) * multiplier;
    total += frac >> 64;
    total += (static_cast<uint64_t>(frac) >> 63);
    if (total >> 64) {
      return *end == '\0' ? SizeError::kRange : SizeError::kInvalid;
    }
    value = static_cast<uint64_t>(total);
  }
  if (*end != '\0') return SizeError::kInvalid;
  *result = value;
  return SizeError::kNone;
}

constexpr char kInvalidSize[] =
    "Invalid image size specified. You may use k, M, G, T, P or E suffixes "
    "for\nkilobytes, megabytes, gigabytes, terabytes, petabytes and "
    "exabytes.";
constexpr char kSizeRange[] =
    "Invalid image size specified. Must be between 0 and "
    "9223372036854775807.";

}  // namespace

absl::StatusOr<uint64_t> ParseSize(absl::string_view text) {
  uint64_t value = 0;
  switch (ParseSizeText(text, &value)) {
    case SizeError::kNone:
      if (value > static_cast<uint64_t>(INT64_MAX)) {
        return absl::InvalidArgumentError(kSizeRange);
      }
      return value;
    case SizeError::kRange:
      return absl::InvalidArgumentError(kSizeRange);
    case SizeError::kInvalid:
      break;
  }
  return absl::InvalidArgumentError(kInvalidSize);
}

absl::StatusOr<uint64_t> ParseSizeOption(absl::string_view name,
                                         absl::string_view text) {
  uint64_t value = 0;
  switch (ParseSizeText(text, &value)) {
    case SizeError::kNone:
      return value;
    case SizeError::kRange:
      return absl::InvalidArgumentError(absl::StrCat(
          "Value '", text, "' is out of range for parameter '", name, "'"));
    case SizeError::kInvalid:
      break;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "Parameter '", name,
      "' expects a non-negative number below 2^64\n"
      "Optional suffix k, M, G, T, P or E means kilo-, mega-, giga-, tera-, "
      "peta-\nand exabytes, respectively."));
}

std::string FormatHumanSize(uint64_t bytes) {
  static constexpr const char* kUnits[] = {"",   "Ki", "Mi", "Gi",
                                           "Ti", "Pi", "Ei"};
  // Pick the unit as if the value were scaled by 1024/1000, so that the
  // switch happens when the printed number would reach 1000.
  int exponent = 0;
  std::frexp(static_cast<double>(bytes) / (1000.0 / 1024.0), &exponent);
  int unit = (exponent - 1) / 10;
  if (unit < 0) unit = 0;
  if (unit > 6) unit = 6;
  const double divisor = static_cast<double>(1ull << (unit * 10));
  return absl::StrFormat("%0.3g %sB", static_cast<double>(bytes) / divisor,
                         kUnits[unit]);
}

}  // namespace imgtool

// Sizes as qemu-img reads and prints them (see
// ../shared/reference/qemu-img-cli.md, "Sizes" and "Human sizes").
#ifndef IMGTOOL_BASE_SIZE_H_
#define IMGTOOL_BASE_SIZE_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace imgtool {

// Parses a size the way qemu-img parses create/resize/bench sizes: decimal
// or 0x hex, an optional fraction only together with a suffix, one optional
// case-insensitive suffix b k M G T P E (powers of 1024; `b` = bytes),
// leading white space and '+' allowed, nothing after the suffix; hex may
// take a suffix ("0x10k": deprecated in qemu-img, still accepted by 7.2).
// Fractions round to the nearest byte ("1.7k" -> 1741). Examples: "512",
// "4k", "1M", "1.5G", "0x10000", "1000b", "1.k" (1024), "1.0b" (1).
// Rejects "1kb", "1KiB", "1e3", "1.5", "1.5b", "-1", "2k ", "0x1.5k", "".
// Errors (kInvalidArgument): the value is above INT64_MAX -> "Invalid image
// size specified. Must be between 0 and 9223372036854775807."; anything else
// malformed -> "Invalid image size specified. You may use k, M, G, T, P or E
// suffixes for\nkilobytes, megabytes, gigabytes, terabytes, petabytes and
// exabytes." (the two qemu-img lines joined with a newline).
absl::StatusOr<uint64_t> ParseSize(absl::string_view text);

// Parses an -o option value of type size (`-o size=3x`): same grammar; the
// limit is 2^64-1 and the error is "Parameter '<name>' expects a
// non-negative number below 2^64\nOptional suffix k, M, G, T, P or E means
// kilo-, mega-, giga-, tera-, peta-\nand exabytes, respectively.", except
// for a well-formed value above the limit ("16E"): "Value '<text>' is out of
// range for parameter '<name>'" (both kInvalidArgument, as qemu-img 7.2).
absl::StatusOr<uint64_t> ParseSizeOption(absl::string_view name,
                                         absl::string_view text);

// Formats bytes like qemu-img's human sizes: 3 significant digits, binary
// units B KiB MiB GiB TiB PiB EiB, switching unit when the value would reach
// 1000: 0 -> "0 B", 100352 -> "98 KiB", 1000448 -> "977 KiB",
// 1024000 -> "0.977 MiB", 1536 -> "1.5 KiB", 5003753472 -> "4.66 GiB".
std::string FormatHumanSize(uint64_t bytes);

}  // namespace imgtool

#endif  // IMGTOOL_BASE_SIZE_H_

// qemu-io 7.2's output texts (io_output.h).
#include "imgtool/io_output.h"

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "base/errno_status.h"

namespace imgtool::cli::qemu_io {

std::string HumanBytes(double value) {
  static constexpr struct {
    double size;
    const char* unit;
  } kUnits[] = {
      {1152921504606846976.0, "EiB"},
      {1125899906842624.0, "PiB"},
      {1099511627776.0, "TiB"},
      {1073741824.0, "GiB"},
      {1048576.0, "MiB"},
      {1024.0, "KiB"},
  };
  for (const auto& u : kUnits) {
    if (value >= u.size) {
      std::string number = absl::StrFormat("%.3f", value / u.size);
      if (absl::EndsWith(number, ".000")) number.resize(number.size() - 4);
      return absl::StrCat(number, " ", u.unit);
    }
  }
  std::string number = absl::StrFormat("%f", value);
  if (absl::EndsWith(number, ".000000")) number.resize(number.size() - 7);
  return absl::StrCat(number, " bytes");
}

std::string ElapsedText(double seconds, bool machine) {
  const uint64_t centis = static_cast<uint64_t>(seconds * 100);
  const uint64_t secs = centis / 100;
  const unsigned cs = static_cast<unsigned>(centis % 100);
  if (!machine && secs == 0) return absl::StrFormat("00.%02u sec", cs);
  return absl::StrFormat("%u:%02u:%02u.%02u", secs / 3600, (secs / 60) % 60,
                         secs % 60, cs);
}

double Seconds(Clock::duration d) {
  double s = std::chrono::duration<double>(d).count();
  return s > 1e-9 ? s : 1e-9;
}

std::string Report(absl::string_view op, double seconds, uint64_t offset,
                   uint64_t count, uint64_t total, int ops, bool machine) {
  if (machine) {
    return absl::StrFormat("%d,%d,%s,%.3f,%.3f\n", total, ops,
                           ElapsedText(seconds, true), total / seconds,
                           ops / seconds);
  }
  return absl::StrFormat(
      "%s %d/%d bytes at offset %d\n%s, %d ops; %s (%s/sec and %.4f "
      "ops/sec)\n",
      op, total, count, offset, HumanBytes(static_cast<double>(total)), ops,
      ElapsedText(seconds, false), HumanBytes(total / seconds), ops / seconds);
}

std::string HexDump(absl::Span<const uint8_t> data, uint64_t offset) {
  std::string text;
  for (size_t i = 0; i < data.size(); i += 16) {
    const size_t n = std::min<size_t>(16, data.size() - i);
    absl::StrAppendFormat(&text, "%08x:  ", offset + i);
    for (size_t j = 0; j < n; ++j) {
      absl::StrAppendFormat(&text, "%02x ", data[i + j]);
    }
    text += ' ';
    for (size_t j = 0; j < n; ++j) {
      const unsigned char c = data[i + j];
      text += (c < 128 && std::isalnum(c)) ? static_cast<char>(c) : '.';
    }
    text += '\n';
  }
  return text;
}

int ErrnoOf(const absl::Status& status) {
  if (const int e = StatusErrno(status); e != 0) return e;
  switch (status.code()) {
    case absl::StatusCode::kUnimplemented:
      return ENOTSUP;
    case absl::StatusCode::kInvalidArgument:
      return EINVAL;
    case absl::StatusCode::kFailedPrecondition:
      return EPERM;
    case absl::StatusCode::kPermissionDenied:
      return EACCES;
    case absl::StatusCode::kNotFound:
      return ENOENT;
    case absl::StatusCode::kResourceExhausted:
      return ENOSPC;
    case absl::StatusCode::kUnavailable:
      return EAGAIN;
    default:
      return EIO;
  }
}

std::string ErrorText(const absl::Status& status) {
  return std::strerror(ErrnoOf(status));
}

std::string WithoutFilename(const absl::Status& status,
                            const std::string& filename) {
  absl::string_view message = status.message();
  absl::ConsumePrefix(&message, absl::StrCat(filename, ": "));
  return std::string(message);
}

bool AllBytesAre(absl::Span<const uint8_t> data, uint8_t byte) {
  return std::all_of(data.begin(), data.end(),
                     [byte](uint8_t b) { return b == byte; });
}

}  // namespace imgtool::cli::qemu_io

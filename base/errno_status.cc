#include "base/errno_status.h"

#include <cstring>
#include <string>

#include "absl/strings/cord.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace imgtool {
namespace {
constexpr char kErrnoPayload[] = "imgtool/errno";
}  // namespace

absl::Status ErrnoStatus(absl::string_view path, absl::string_view operation,
                         int error_number) {
  std::string message;
  if (!path.empty()) absl::StrAppend(&message, path, ": ");
  absl::StrAppend(&message, operation, ": ", std::strerror(error_number));
  absl::Status status(absl::ErrnoToStatusCode(error_number), message);
  status.SetPayload(kErrnoPayload, absl::Cord(absl::StrCat(error_number)));
  return status;
}

int StatusErrno(const absl::Status& status) {
  auto payload = status.GetPayload(kErrnoPayload);
  int value = 0;
  if (!payload.has_value() || !absl::SimpleAtoi(std::string(*payload), &value)) {
    return 0;
  }
  return value;
}

absl::Status WithMessage(const absl::Status& status, absl::string_view message) {
  absl::Status out(status.code(), message);
  status.ForEachPayload([&](absl::string_view url, const absl::Cord& payload) {
    out.SetPayload(url, payload);
  });
  return out;
}

}  // namespace imgtool

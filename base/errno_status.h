// Turns a failed syscall into an absl::Status that names the file and the
// operation and keeps the errno, e.g. "img.raw: fallocate: No space left on
// device". The code follows the errno (ENOENT -> kNotFound, EACCES/EPERM ->
// kPermissionDenied, ENOSPC -> kResourceExhausted, EINVAL -> kInvalidArgument,
// EAGAIN/EWOULDBLOCK -> kUnavailable, EOPNOTSUPP -> kUnimplemented, else kInternal
// or what absl::ErrnoToStatusCode gives).
#ifndef IMGTOOL_BASE_ERRNO_STATUS_H_
#define IMGTOOL_BASE_ERRNO_STATUS_H_

#include "absl/strings/string_view.h"

#include "absl/status/status.h"

namespace imgtool {

// `path` names the file (empty: left out), `operation` the syscall or step,
// `error_number` is a positive errno value.
absl::Status ErrnoStatus(absl::string_view path, absl::string_view operation,
                         int error_number);

// The errno kept in a status made by ErrnoStatus, or 0 if it has none.
int StatusErrno(const absl::Status& status);

// `status` (not ok) with its message replaced by `message`: the code and
// every payload (the errno of ErrnoStatus among them) stay.
absl::Status WithMessage(const absl::Status& status, absl::string_view message);

}  // namespace imgtool

#endif  // IMGTOOL_BASE_ERRNO_STATUS_H_

#include "posix_file/file_lock.h"

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_format.h"
#include "base/errno_status.h"

namespace imgtool::posix_file::internal {
namespace {

// Shared (read) lock on one byte; -errno on failure.
int LockByte(int fd, int byte) {
  struct flock fl = {};
  fl.l_type = F_RDLCK;
  fl.l_whence = SEEK_SET;
  fl.l_start = byte;
  fl.l_len = 1;
  return fcntl(fd, F_OFD_SETLK, &fl) == 0 ? 0 : -errno;
}

void UnlockByte(int fd, int byte) {
  struct flock fl = {};
  fl.l_type = F_UNLCK;
  fl.l_whence = SEEK_SET;
  fl.l_start = byte;
  fl.l_len = 1;
  (void)fcntl(fd, F_OFD_SETLK, &fl);
}

// 1 if another open file description holds a lock on `byte` that conflicts
// with an exclusive lock, 0 if free, -errno on failure.
int ByteIsLocked(int fd, int byte) {
  struct flock fl = {};
  fl.l_type = F_WRLCK;
  fl.l_whence = SEEK_SET;
  fl.l_start = byte;
  fl.l_len = 1;
  if (fcntl(fd, F_OFD_GETLK, &fl) != 0) return -errno;
  return fl.l_type == F_UNLCK ? 0 : 1;
}

bool IsUnsupported(int err) { return err == EINVAL; }

absl::Status ConflictError(const std::string& path, bool shared, int bit) {
  return absl::FailedPreconditionError(absl::StrFormat(
      "Failed to get %s\"%s\" lock\nIs another process using the image [%s]?",
      shared ? "shared " : "", PermName(bit), path));
}

std::atomic<bool> warned_unsupported{false};

}  // namespace

const char* PermName(int bit) {
  switch (bit) {
    case 0:
      return "consistent read";
    case 1:
      return "write";
    case 2:
      return "write unchanged";
    case 3:
      return "resize";
  }
  return "unknown";
}

absl::StatusOr<LockingMode> ParseLockingMode(const std::string& value) {
  if (value.empty() || value == "auto") return LockingMode::kAuto;
  if (value == "on") return LockingMode::kOn;
  if (value == "off") return LockingMode::kOff;
  return absl::InvalidArgumentError(absl::StrFormat(
      "Parameter 'locking' does not accept value '%s'", value));
}

absl::StatusOr<bool> LockImage(int fd, const std::string& path,
                               LockPerms perms, LockingMode mode,
                               std::ostream* warnings) {
  if (mode == LockingMode::kOff) return false;
  // Apply: shared locks on 100+bit for held perms, 200+bit for unshared.
  for (int base : {kLockPermBase, kLockSharedBase}) {
    uint8_t bits = base == kLockPermBase ? perms.held : perms.unshared;
    for (int bit = 0; bit < kNumPerms; ++bit) {
      if ((bits & (1 << bit)) == 0) continue;
      int r = LockByte(fd, base + bit);
      if (r == 0) continue;
      if (IsUnsupported(-r)) {
        if (mode == LockingMode::kOn) {
          return absl::FailedPreconditionError(absl::StrFormat(
              "%s: locking=on but OFD locks are not supported: %s", path,
              std::strerror(-r)));
        }
        if (warnings != nullptr && !warned_unsupported.exchange(true)) {
          *warnings << "OFD locks are not supported (" << std::strerror(-r)
                    << "), continuing without image locking\n";
        }
        return false;
      }
      if (r == -EAGAIN || r == -EACCES) {
        return absl::FailedPreconditionError(absl::StrFormat(
            "Failed to lock byte %d\nIs another process using the image "
            "[%s]?",
            base + bit, path));
      }
      return ErrnoStatus(path, absl::StrFormat("Failed to lock byte %d",
                                               base + bit),
                         -r);
    }
  }
  // Test: nobody may deny what we hold, nobody may hold what we deny.
  for (int bit = 0; bit < kNumPerms; ++bit) {
    if ((perms.held & (1 << bit)) == 0) continue;
    int r = ByteIsLocked(fd, kLockSharedBase + bit);
    if (r < 0) {
      return ErrnoStatus(path, absl::StrFormat("Failed to check byte %d",
                                               kLockSharedBase + bit),
                         -r);
    }
    if (r > 0) return ConflictError(path, /*shared=*/false, bit);
  }
  for (int bit = 0; bit < kNumPerms; ++bit) {
    if ((perms.unshared & (1 << bit)) == 0) continue;
    int r = ByteIsLocked(fd, kLockPermBase + bit);
    if (r < 0) {
      return ErrnoStatus(path, absl::StrFormat("Failed to check byte %d",
                                               kLockPermBase + bit),
                         -r);
    }
    if (r > 0) return ConflictError(path, /*shared=*/true, bit);
  }
  return true;
}

void UnlockImage(int fd, LockPerms perms) {
  for (int bit = 0; bit < kNumPerms; ++bit) {
    if ((perms.held & (1 << bit)) != 0) UnlockByte(fd, kLockPermBase + bit);
    if ((perms.unshared & (1 << bit)) != 0) {
      UnlockByte(fd, kLockSharedBase + bit);
    }
  }
}

int UnlockAndClose(int fd) {
  constexpr uint8_t kAll = (1 << kNumPerms) - 1;
  UnlockImage(fd, LockPerms{kAll, kAll});
  return close(fd);
}

}  // namespace imgtool::posix_file::internal

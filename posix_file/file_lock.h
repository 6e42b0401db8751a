// Image locking with OFD byte-range locks (file-posix.md §7). Internal to
// posix_file.
//
// For each permission a node holds it takes a shared lock on byte
// 100 + bit; for each permission it does not share with other processes, on
// byte 200 + bit. A conflict is another open file description holding the
// opposite byte. Locks belong to the open file description: closing the fd
// releases them once no reference to the description is left, and two
// opens of one file in the same process conflict.
#ifndef IMGTOOL_POSIX_FILE_FILE_LOCK_H_
#define IMGTOOL_POSIX_FILE_FILE_LOCK_H_

#include <cstdint>
#include <ostream>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace imgtool::posix_file::internal {

// Permission bits (QEMU 7.2 numbering).
enum Perm : uint8_t {
  kPermConsistentRead = 1 << 0,
  kPermWrite = 1 << 1,
  kPermWriteUnchanged = 1 << 2,
  kPermResize = 1 << 3,
};
inline constexpr int kNumPerms = 4;
inline constexpr int kLockPermBase = 100;    // held permissions
inline constexpr int kLockSharedBase = 200;  // permissions not shared

struct LockPerms {
  uint8_t held = 0;      // Perm bits this opener uses
  uint8_t unshared = 0;  // Perm bits no other opener may use
};

// The sets of file-posix.md §7.
inline constexpr LockPerms kCreatePerms = {kPermWrite | kPermResize,
                                           kPermResize};
inline constexpr LockPerms kReadWritePerms = {
    kPermConsistentRead | kPermWrite | kPermResize, kPermWrite | kPermResize};
inline constexpr LockPerms kReadOnlyPerms = {kPermConsistentRead,
                                             kPermWrite | kPermResize};
inline constexpr LockPerms kForceSharePerms = {kPermConsistentRead, 0};
// QEMU's raw format over `file` shares everything (qemu-io -f raw holds
// 100 and 101 only; resize is taken on the first truncate).
inline constexpr LockPerms kShareAllReadWritePerms = {
    kPermConsistentRead | kPermWrite, 0};

enum class LockingMode { kAuto, kOn, kOff };

// Parses the `locking` option: "" and "auto", "on", "off". kInvalidArgument
// otherwise.
absl::StatusOr<LockingMode> ParseLockingMode(const std::string& value);

// Takes the locks of `perms` on `fd` and tests for conflicts (F_OFD_GETLK).
// Returns true if locks are held, false if locking is off or (auto) OFD locks
// are unsupported (EINVAL; a one-line warning goes to `warnings` once per
// process). Errors: kFailedPrecondition `Failed to get "write" lock\nIs
// another process using the image [<path>]?` (or `Failed to get shared
// "write" lock`, etc.) on a conflict; kFailedPrecondition if mode is kOn and
// OFD locks are unsupported. On error some bytes may stay locked: the caller
// closes `fd`.
absl::StatusOr<bool> LockImage(int fd, const std::string& path,
                               LockPerms perms, LockingMode mode,
                               std::ostream* warnings);

// Drops the locks of `perms` on `fd` (both byte sets). Unlock failures are
// ignored (QEMU only warns about them).
void UnlockImage(int fd, LockPerms perms);

// Drops every image lock byte on `fd` (100-103 and 200-203), then closes it;
// returns close(2)'s result (0, or -1 with errno set). close(2) alone drops
// OFD locks only when the open file description's last reference goes, and
// io_uring may still hold one for a moment after the completion it posted:
// a reopen of the file right after a close then met the old description's
// locks ("Failed to get "write" lock": qcow2 convert, whose create opens and
// closes the target just before the copy opens it again, failed so once in
// CI and 1 in 4,500 runs here). F_UNLCK on the description drops them at
// once, whoever holds it.
int UnlockAndClose(int fd);

// Name of a single permission bit as QEMU prints it ("consistent read",
// "write", "write unchanged", "resize").
const char* PermName(int bit);

}  // namespace imgtool::posix_file::internal

#endif  // IMGTOOL_POSIX_FILE_FILE_LOCK_H_

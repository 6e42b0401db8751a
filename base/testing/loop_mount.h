// Test fixture: real filesystems on loop devices, for tests that must see
// real XFS/ext4 behaviour (extent size hints, fallocate, FIEMAP). Needs root
// and `tags = ["local"]` on the cc_test (the sandbox forbids mounts).
#ifndef IMGTOOL_BASE_TESTING_LOOP_MOUNT_H_
#define IMGTOOL_BASE_TESTING_LOOP_MOUNT_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace imgtool::testing {

enum class FsKind {
  kXfs,            // mkfs.xfs
  kExt4,           // mkfs.ext4 (extents, fallocate works)
  kExt4NoExtents,  // mkfs.ext4 -O ^extents: no fallocate (EOPNOTSUPP)
};

// A filesystem of `size_bytes` made in a backing file under $TEST_TMPDIR (or
// /tmp) and mounted with `mount -o loop` on a fresh directory. Unmounted and
// deleted by the destructor.
class LoopMount {
 public:
  // kFailedPrecondition with a clear reason when not root or a tool is
  // missing: tests then GTEST_SKIP() with that message.
  static absl::StatusOr<std::unique_ptr<LoopMount>> Create(
      FsKind kind, uint64_t size_bytes = 512ull << 20);
  ~LoopMount();

  // Mount point, without a trailing slash.
  const std::string& path() const { return mount_point_; }

 private:
  LoopMount(std::string backing, std::string mount_point)
      : backing_(std::move(backing)), mount_point_(std::move(mount_point)) {}
  std::string backing_;
  std::string mount_point_;
};

}  // namespace imgtool::testing

#endif  // IMGTOOL_BASE_TESTING_LOOP_MOUNT_H_

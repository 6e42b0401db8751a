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
// deleted by the destructor (umount, lazily if busy; the loop device goes
// away with it). Not thread-safe; one owner.
class LoopMount {
 public:
  // kFailedPrecondition with a clear reason when not root or a tool is
  // missing: tests then GTEST_SKIP() with that message. kInternal with the
  // tool's output when mkfs or mount fails.
  static absl::StatusOr<std::unique_ptr<LoopMount>> Create(
      FsKind kind, uint64_t size_bytes = 512ull << 20);

  // The same on a loop device with `sector_size`-byte logical sectors
  // (`losetup --sector-size`; 512, 1024, 2048 or 4096), e.g. to test O_DIRECT
  // alignment on 4096-byte sectors. `size_bytes` is rounded up to a multiple
  // of `sector_size`. Needs losetup as well.
  static absl::StatusOr<std::unique_ptr<LoopMount>> CreateWithSectorSize(
      FsKind kind, uint64_t size_bytes, uint32_t sector_size);

  ~LoopMount();
  LoopMount(const LoopMount&) = delete;
  LoopMount& operator=(const LoopMount&) = delete;

  // Mount point, without a trailing slash.
  const std::string& path() const { return mount_point_; }
  // The backing file of the loop device.
  const std::string& backing_file() const { return backing_; }
  // "/dev/loopN" for CreateWithSectorSize, empty for Create (mount chose it).
  const std::string& loop_device() const { return loop_device_; }

 private:
  LoopMount() = default;
  static absl::StatusOr<std::unique_ptr<LoopMount>> Make(
      FsKind kind, uint64_t size_bytes, uint32_t sector_size);

  std::string backing_;
  std::string mount_point_;
  std::string loop_device_;
  bool mounted_ = false;
};

}  // namespace imgtool::testing

#endif  // IMGTOOL_BASE_TESTING_LOOP_MOUNT_H_

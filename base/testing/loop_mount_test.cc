#include "base/testing/loop_mount.h"

#include <fcntl.h>
#include <linux/fs.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>

#include "gtest/gtest.h"

namespace imgtool::testing {
namespace {

constexpr long kXfsMagic = 0x58465342;
constexpr long kExt4Magic = 0xEF53;

bool Exists(const std::string& path) {
  struct stat st;
  return lstat(path.c_str(), &st) == 0;
}

bool IsMounted(const std::string& path) {
  std::ifstream mounts("/proc/self/mounts");
  std::string line;
  while (std::getline(mounts, line)) {
    std::istringstream fields(line);
    std::string device, mount_point;
    fields >> device >> mount_point;
    if (mount_point == path) return true;
  }
  return false;
}

std::unique_ptr<LoopMount> MakeOrSkip(FsKind kind, uint64_t size,
                                      uint32_t sector_size = 0) {
  absl::StatusOr<std::unique_ptr<LoopMount>> m =
      sector_size == 0 ? LoopMount::Create(kind, size)
                       : LoopMount::CreateWithSectorSize(kind, size, sector_size);
  if (!m.ok()) {
    EXPECT_EQ(m.status().code(), absl::StatusCode::kFailedPrecondition)
        << m.status();
    return nullptr;
  }
  return *std::move(m);
}

#define MAKE_OR_SKIP(var, ...)                          \
  std::unique_ptr<LoopMount> var = MakeOrSkip(__VA_ARGS__); \
  if (var == nullptr) GTEST_SKIP() << "no loop mounts here"

// Writes 1 MiB through a new file, returns fallocate's errno (0 = worked).
int WriteFileAndFallocate(const std::string& dir) {
  const std::string path = dir + "/file";
  const int fd = open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC, 0644);
  EXPECT_GE(fd, 0) << strerror(errno);
  std::string data(1 << 20, 'x');
  EXPECT_EQ(write(fd, data.data(), data.size()),
            static_cast<ssize_t>(data.size()));
  EXPECT_EQ(fsync(fd), 0);
  const int result = fallocate(fd, 0, 1 << 20, 1 << 20) == 0 ? 0 : errno;
  close(fd);
  struct stat st;
  EXPECT_EQ(stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_size, result == 0 ? 2 << 20 : 1 << 20);
  return result;
}

long FsType(const std::string& path) {
  struct statfs fs;
  EXPECT_EQ(statfs(path.c_str(), &fs), 0) << strerror(errno);
  return static_cast<long>(fs.f_type);
}

TEST(LoopMountTest, XfsIsMountedAndCleanedUp) {
  std::string mount_point, backing;
  {
    MAKE_OR_SKIP(m, FsKind::kXfs, 512ull << 20);
    mount_point = m->path();
    backing = m->backing_file();
    EXPECT_TRUE(m->loop_device().empty());
    EXPECT_NE(mount_point.back(), '/');
    EXPECT_TRUE(IsMounted(mount_point));
    EXPECT_EQ(FsType(mount_point), kXfsMagic);
    EXPECT_EQ(WriteFileAndFallocate(mount_point), 0);
    const char* tmp = std::getenv("TEST_TMPDIR");
    const std::string dir = tmp != nullptr && *tmp ? tmp : "/tmp";
    EXPECT_EQ(backing.rfind(dir + "/", 0), 0u) << backing;
    struct stat st;
    ASSERT_EQ(stat(backing.c_str(), &st), 0);
    EXPECT_EQ(st.st_size, 512ll << 20);
  }
  EXPECT_FALSE(IsMounted(mount_point));
  EXPECT_FALSE(Exists(mount_point));
  EXPECT_FALSE(Exists(backing));
}

TEST(LoopMountTest, Ext4HasWorkingFallocate) {
  std::string mount_point, backing;
  {
    MAKE_OR_SKIP(m, FsKind::kExt4, 64 << 20);
    mount_point = m->path();
    backing = m->backing_file();
    EXPECT_EQ(FsType(mount_point), kExt4Magic);
    EXPECT_EQ(WriteFileAndFallocate(mount_point), 0);
  }
  EXPECT_FALSE(IsMounted(mount_point));
  EXPECT_FALSE(Exists(mount_point));
  EXPECT_FALSE(Exists(backing));
}

TEST(LoopMountTest, Ext4WithoutExtentsRefusesFallocate) {
  MAKE_OR_SKIP(m, FsKind::kExt4NoExtents, 64 << 20);
  EXPECT_EQ(FsType(m->path()), kExt4Magic);
  EXPECT_EQ(WriteFileAndFallocate(m->path()), EOPNOTSUPP);
}

TEST(LoopMountTest, BusyMountIsDetachedLazily) {
  std::string mount_point, backing;
  int fd = -1;
  {
    MAKE_OR_SKIP(m, FsKind::kExt4, 64 << 20);
    mount_point = m->path();
    backing = m->backing_file();
    fd = open((mount_point + "/held").c_str(), O_RDWR | O_CREAT, 0644);
    ASSERT_GE(fd, 0) << strerror(errno);
  }
  EXPECT_FALSE(IsMounted(mount_point));
  EXPECT_FALSE(Exists(mount_point));
  EXPECT_FALSE(Exists(backing));
  EXPECT_EQ(write(fd, "x", 1), 1);  // Still usable until closed.
  close(fd);
}

TEST(LoopMountTest, SectorSize4096LoopDevice) {
  std::string mount_point, backing, device;
  {
    MAKE_OR_SKIP(m, FsKind::kXfs, (512ull << 20) + 1, 4096);
    mount_point = m->path();
    backing = m->backing_file();
    device = m->loop_device();
    ASSERT_EQ(device.rfind("/dev/loop", 0), 0u) << device;
    EXPECT_TRUE(IsMounted(mount_point));
    EXPECT_EQ(FsType(mount_point), kXfsMagic);
    struct stat st;
    ASSERT_EQ(stat(backing.c_str(), &st), 0);
    EXPECT_EQ(st.st_size, (512ll << 20) + 4096);  // Rounded up.

    const int dev_fd = open(device.c_str(), O_RDONLY);
    ASSERT_GE(dev_fd, 0) << strerror(errno);
    int logical = 0;
    ASSERT_EQ(ioctl(dev_fd, BLKSSZGET, &logical), 0);
    EXPECT_EQ(logical, 4096);
    close(dev_fd);

    // O_DIRECT needs 4096-byte alignment now.
    const std::string path = mount_point + "/direct";
    const int fd = open(path.c_str(), O_RDWR | O_CREAT | O_DIRECT, 0644);
    ASSERT_GE(fd, 0) << strerror(errno);
    void* buf = nullptr;
    ASSERT_EQ(posix_memalign(&buf, 4096, 4096), 0);
    std::memset(buf, 'd', 4096);
    EXPECT_EQ(pwrite(fd, buf, 512, 0), -1);
    EXPECT_EQ(errno, EINVAL);
    EXPECT_EQ(pwrite(fd, buf, 4096, 0), 4096) << strerror(errno);
    free(buf);
    close(fd);
  }
  EXPECT_FALSE(IsMounted(mount_point));
  EXPECT_FALSE(Exists(mount_point));
  EXPECT_FALSE(Exists(backing));
  // The loop device no longer has a backing file.
  const std::string sys = "/sys/block/" + device.substr(5) + "/loop/backing_file";
  EXPECT_FALSE(Exists(sys)) << sys;
}

TEST(LoopMountTest, RejectsOddSectorSize) {
  absl::StatusOr<std::unique_ptr<LoopMount>> m =
      LoopMount::CreateWithSectorSize(FsKind::kXfs, 512 << 20, 3000);
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace imgtool::testing

#include "posix_file/file_io.h"

#include <fcntl.h>
#include <linux/falloc.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "io/aio_engine.h"
#include "io/engine.h"
#include "io/uring_engine.h"
#include "posix_file/testing/op_recorder.h"

namespace imgtool::posix_file::internal {
namespace {

class FileIoTest : public ::testing::Test {
 protected:
  void SetUp() override {
    for (std::string base :
         {std::string("/var/tmp"),
          std::string(getenv("TEST_TMPDIR") ? getenv("TEST_TMPDIR") : "/tmp")}) {
      std::string tmpl = base + "/file_io_test.XXXXXX";
      int fd = mkstemp(tmpl.data());
      if (fd >= 0) {
        close(fd);
        path_ = tmpl;
        break;
      }
    }
    ASSERT_FALSE(path_.empty());
  }
  void TearDown() override { unlink(path_.c_str()); }

  std::string path_;
  std::unique_ptr<io::Engine> engine_ = NewInlineEngine();
};

TEST_F(FileIoTest, ProbedAlignmentWithoutStatxMatchesStatx) {
  int fd = open(path_.c_str(), O_RDWR);
  std::vector<uint8_t> data(65536, 1);
  ASSERT_EQ(pwrite(fd, data.data(), data.size(), 1 << 20), 65536);
  ASSERT_EQ(fsync(fd), 0);
  close(fd);
  fd = open(path_.c_str(), O_RDONLY | O_DIRECT);
  ASSERT_GE(fd, 0);
  auto by_statx = ProbeDioAlignment(fd, path_, false);
  auto by_reads = ProbeDioAlignment(fd, path_, false, /*use_statx=*/false);
  close(fd);
  ASSERT_TRUE(by_statx.ok()) << by_statx.status();
  ASSERT_TRUE(by_reads.ok()) << by_reads.status();
  // The probe found the data at 1 MiB (the hole before it proves nothing).
  EXPECT_EQ(by_reads->request, by_statx->request);
  EXPECT_GE(by_reads->memory, by_statx->memory);
}

TEST_F(FileIoTest, ProbeWithoutDataAssumesAPage) {
  ASSERT_EQ(truncate(path_.c_str(), 1 << 20), 0);
  int fd = open(path_.c_str(), O_RDONLY | O_DIRECT);
  ASSERT_GE(fd, 0);
  auto alignment = ProbeDioAlignment(fd, path_, false, /*use_statx=*/false);
  close(fd);
  ASSERT_TRUE(alignment.ok()) << alignment.status();
  const uint64_t page = std::max<long>(4096, sysconf(_SC_PAGESIZE));
  EXPECT_EQ(alignment->request, page);
  EXPECT_EQ(alignment->memory, page);
}

TEST_F(FileIoTest, UnsupportedFallocateIsRememberedPerKind) {
  int fd = open(path_.c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  FileIo file(*engine_, FileIo::Config{.fd = fd, .path = path_, .size = 0});
  // PUNCH_HOLE without KEEP_SIZE is refused with EOPNOTSUPP by the kernel.
  EXPECT_EQ(io::RunSync(*engine_, file.Fallocate(FALLOC_FL_PUNCH_HOLE, 0, 4096)),
            -EOPNOTSUPP);
  // From now on hole punching is off for this file, without a syscall ...
  EXPECT_EQ(io::RunSync(*engine_, file.Discard(0, 4096)).code(),
            absl::StatusCode::kUnimplemented);
  // ... but plain allocation still works.
  EXPECT_EQ(io::RunSync(*engine_, file.Fallocate(0, 0, 8192)), 0);
  EXPECT_TRUE(io::RunSync(*engine_, file.WriteZeroes(0, 4096, false)).ok());
  close(fd);
}

TEST_F(FileIoTest, TruncateRestoresTheOldLengthOnFailure) {
  int fd = open(path_.c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(ftruncate(fd, 8192), 0);
  FileIo file(*engine_, FileIo::Config{.fd = fd, .path = path_, .size = 8192});
  // Far beyond any filesystem's limit.
  absl::Status st = io::RunSync(
      *engine_, file.Truncate(uint64_t{1} << 62, io::PreallocMode::kFalloc, true));
  EXPECT_FALSE(st.ok());
  EXPECT_EQ(file.size(), 8192u);
  EXPECT_EQ(lseek(fd, 0, SEEK_END), 8192);
  st = io::RunSync(*engine_,
                   file.Truncate(uint64_t{1} << 62, io::PreallocMode::kFull, true));
  EXPECT_FALSE(st.ok());
  EXPECT_EQ(lseek(fd, 0, SEEK_END), 8192);
  close(fd);
}

// O_DIRECT reads and writes longer than the device takes unsplit are
// marked may_block (worker threads instead of io_uring's inline attempt);
// buffered ones, and all when the limit is unknown, are not.
TEST_F(FileIoTest, RequestsTheDeviceSplitsAreMarkedMayBlock) {
  using S = testing::OpRecorder::Seen;
  constexpr uint64_t kMiB = 1 << 20;
  {
    const std::vector<uint8_t> data(4 * kMiB, 7);
    int fd = open(path_.c_str(), O_WRONLY);
    ASSERT_EQ(pwrite(fd, data.data(), data.size(), 0), static_cast<ssize_t>(data.size()));
    close(fd);
  }
  int fd = open(path_.c_str(), O_RDWR | O_DIRECT);
  if (fd < 0) GTEST_SKIP() << path_ << ": no O_DIRECT here";
  auto alignment = ProbeDioAlignment(fd, path_, false);
  ASSERT_TRUE(alignment.ok()) << alignment.status();
  AlignedBuffer buf(3 * kMiB, 4096);
  for (const auto& [direct, max_request] :
       {std::pair{true, kMiB}, std::pair{true, uint64_t{0}},
        std::pair{false, kMiB}}) {
    SCOPED_TRACE(::testing::PrintToString(std::tuple{direct, max_request}));
    testing::OpRecorder reads(*engine_, io::OpKind::kRead);
    testing::OpRecorder writes(reads, io::OpKind::kWrite);
    FileIo file(writes, FileIo::Config{.fd = fd,
                                       .path = path_,
                                       .direct = direct,
                                       .alignment = *alignment,
                                       .size = 4 * kMiB,
                                       .max_request = max_request});
    auto read = [&](uint64_t offset, uint64_t length) {
      return io::RunSync(writes, file.Read(offset, io::IoVec(buf.data(), length)));
    };
    auto write = [&](uint64_t offset, uint64_t length) {
      return io::RunSync(writes,
                         file.Write(offset, io::ConstIoVec(buf.data(), length)));
    };
    ASSERT_TRUE(read(0, kMiB).ok());
    ASSERT_TRUE(read(kMiB, kMiB + 4096).ok());
    ASSERT_TRUE(read(0, 3 * kMiB).ok());
    ASSERT_TRUE(write(0, kMiB).ok());
    ASSERT_TRUE(write(kMiB, 2 * kMiB).ok());
    const bool split = direct && max_request != 0;
    EXPECT_EQ(reads.Take(), (std::vector<S>{{0, kMiB, false},
                                            {kMiB, kMiB + 4096, split},
                                            {0, 3 * kMiB, split}}));
    EXPECT_EQ(writes.Take(), (std::vector<S>{{0, kMiB, false},
                                             {kMiB, 2 * kMiB, split}}));
  }
  close(fd);
}

// Adjacent reads in flight together reach the kernel as one merged read
// (io/coalesce.h; native and io_uring engines). Crossing the end of the
// file it comes back short: the read the count ends in gets its part, the
// one past it -EAGAIN, and FileIo retries both remainders (merged again,
// then the last alone). Every read gets the file's bytes and zeroes past
// its end.
TEST_F(FileIoTest, MergedReadsAcrossTheEndOfTheFileAreRetried) {
  constexpr uint64_t kPiece = 16 * 1024;
  constexpr uint64_t kLength = kPiece + 5000;
  std::vector<uint8_t> content(kLength);
  for (uint64_t i = 0; i < kLength; ++i) content[i] = (i * 13 + 1) & 0xff;
  int fd = open(path_.c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(pwrite(fd, content.data(), kLength, 0),
            static_cast<ssize_t>(kLength));
  std::vector<uint8_t> want(content);
  want.resize(3 * kPiece, 0);
  for (const bool uring : {false, true}) {
    SCOPED_TRACE(uring ? "io_uring" : "native");
    absl::StatusOr<std::unique_ptr<io::Engine>> engine =
        uring ? io::UringEngine::Create(16) : io::AioEngine::Create(16);
    ASSERT_TRUE(engine.ok()) << engine.status();
    FileIo file(**engine,
                FileIo::Config{.fd = fd, .path = path_, .size = kLength});
    std::vector<uint8_t> bufs[3];
    absl::Status results[3];
    int finished = 0;
    for (int i = 0; i < 3; ++i) {
      bufs[i].assign(kPiece, 0xee);
      io::Spawn(file.Read(i * kPiece, io::IoVec(bufs[i].data(), kPiece)),
                [&results, &finished, i](absl::Status st) {
                  results[i] = std::move(st);
                  ++finished;
                });
    }
    while (finished < 3) ASSERT_TRUE((*engine)->Poll(/*wait=*/true).ok());
    // [0, 48K) merged; [kLength, 32K) and [32K, 48K) merged; [32K, 48K).
    EXPECT_EQ(uring ? static_cast<io::UringEngine&>(**engine).requests_submitted()
                    : static_cast<io::AioEngine&>(**engine).requests_submitted(),
              3u);
    for (int i = 0; i < 3; ++i) {
      EXPECT_TRUE(results[i].ok()) << results[i];
      EXPECT_TRUE(std::equal(bufs[i].begin(), bufs[i].end(),
                             want.begin() + i * kPiece))
          << "read " << i;
    }
  }
  close(fd);
}

}  // namespace
}  // namespace imgtool::posix_file::internal

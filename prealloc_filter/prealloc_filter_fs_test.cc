// qcow2 -> preallocate -> file on real XFS and ext4 loop mounts (and ext4
// without extents, where fallocate cannot allocate), checked with
// qemu-img 7.2: the same writes with and without the filter give images
// that `qemu-img check` calls clean and `qemu-img compare` identical; the
// file is cut back to the data end on close; sequentially written images
// have fewer extents with the filter; a writer killed with SIGKILL leaves a
// valid image whose stale tail the next open/close trims.
// Needs root (tags = ["local"]); skips otherwise.
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <sys/xattr.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/testing/loop_mount.h"
#include "gtest/gtest.h"
#include "io/task.h"
#include "prealloc_filter/prealloc_filter.h"
#include "prealloc_filter/testing/chain.h"
#include "qcow2/testing/harness.h"

namespace imgtool::prealloc_filter::testing {
namespace {

using ::imgtool::qcow2::testing::CommandResult;
using ::imgtool::qcow2::testing::Env;
using ::imgtool::qcow2::testing::QemuCheck;
using ::imgtool::qcow2::testing::RunCommand;
using ::imgtool::qcow2::testing::RunQemuCheck;
using ::imgtool::testing::FsKind;
using ::imgtool::testing::LoopMount;

constexpr uint64_t kMiB = 1 << 20;

const char* FsName(FsKind kind) {
  switch (kind) {
    case FsKind::kXfs:
      return "xfs";
    case FsKind::kExt4:
      return "ext4";
    case FsKind::kExt4NoExtents:
      return "ext4_noextents";
  }
  return "?";
}

std::string WriterPath() {
  const char* srcdir = std::getenv("TEST_SRCDIR");
  const char* ws = std::getenv("TEST_WORKSPACE");
  if (srcdir == nullptr || ws == nullptr) {
    return "prealloc_filter/testing/crash_writer";
  }
  return absl::StrCat(srcdir, "/", ws, "/prealloc_filter/testing/crash_writer");
}

void QemuImgCreate(const std::string& path, uint64_t size) {
  CommandResult r =
      RunCommand(absl::StrCat("qemu-img create -q -f qcow2 ", path, " ", size));
  ASSERT_EQ(r.exit_code, 0) << r.err;
}

// qemu-img check: exit 0, nothing wrong.
void ExpectClean(const std::string& path) {
  QemuCheck q = RunQemuCheck(path);
  EXPECT_EQ(q.exit_code, 0) << path << "\n" << q.err << q.output;
  EXPECT_EQ(q.corruptions, 0u);
  EXPECT_EQ(q.leaks, 0u);
}

void ExpectIdentical(const std::string& a, const std::string& b) {
  CommandResult r = RunCommand(
      absl::StrCat("qemu-img compare -f qcow2 -F qcow2 ", a, " ", b));
  EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_EQ(r.out, "Images are identical.\n");
}

class PreallocFsTest : public ::testing::TestWithParam<FsKind> {
 protected:
  void SetUp() override {
    if (geteuid() != 0) GTEST_SKIP() << "needs root for loop mounts";
    absl::StatusOr<std::unique_ptr<LoopMount>> m =
        LoopMount::Create(GetParam(), 2048 * kMiB);
    if (!m.ok()) GTEST_SKIP() << m.status();
    mount_ = *std::move(m);
  }

  std::string Path(const std::string& name) {
    return mount_->path() + "/" + name;
  }

  // Writes `count` x `length` bytes sequentially from `start` into `path`
  // (qcow2, 64 in flight) with or without the filter. Returns the filter's
  // data end just before close (0 without the filter).
  uint64_t WriteImage(const std::string& path, const std::string& cache,
                      bool with_filter, uint64_t start, uint64_t length,
                      int count) {
    absl::StatusOr<Chain> chain = OpenChain(env_, path, cache, with_filter);
    EXPECT_TRUE(chain.ok()) << chain.status();
    if (!chain.ok()) return 0;
    absl::Status st =
        WriteSequential(env_, *chain->qcow2, start, length, count, 64, 7);
    EXPECT_TRUE(st.ok()) << st;
    uint64_t data_end = 0;
    if (chain->filter != nullptr) {
      data_end = chain->filter->size();
      EXPECT_GE(FileLength(path), data_end);
    }
    st = env_.Run(chain->qcow2->Close());
    EXPECT_TRUE(st.ok()) << st;
    return data_end;
  }

  // The same writes with and without the filter: clean, identical, file
  // cut back to the data end, as long as without the filter.
  void CompareWithAndWithout(const std::string& cache, uint64_t start,
                             uint64_t length, int count) {
    const std::string with = Path("with.qcow2");
    const std::string without = Path("without.qcow2");
    QemuImgCreate(with, 4096 * kMiB);
    QemuImgCreate(without, 4096 * kMiB);
    const uint64_t data_end =
        WriteImage(with, cache, true, start, length, count);
    WriteImage(without, cache, false, start, length, count);
    std::printf(
        "%s cache=%s %d x %llu at %llu: file %llu bytes (data end "
        "%llu), without the filter %llu\n",
        FsName(GetParam()), cache.c_str(), count,
        static_cast<unsigned long long>(length),
        static_cast<unsigned long long>(start),
        static_cast<unsigned long long>(FileLength(with)),
        static_cast<unsigned long long>(data_end),
        static_cast<unsigned long long>(FileLength(without)));
    EXPECT_EQ(FileLength(with), data_end);
    EXPECT_EQ(FileLength(with), FileLength(without));
    ExpectClean(with);
    ExpectClean(without);
    ExpectIdentical(with, without);
    unlink(with.c_str());
    unlink(without.c_str());
  }

  Env env_;
  std::unique_ptr<LoopMount> mount_;
};

// The first write of a fresh image, as qemu-io with the filter does it
// (preallocate-filter.md §4 [V]: fallocate up to 135266304, ftruncate to
// 393216 on close).
TEST_P(PreallocFsTest, FirstWriteLikeQemuIo) {
  const std::string ours = Path("ours.qcow2");
  const std::string theirs = Path("theirs.qcow2");
  QemuImgCreate(ours, 1024 * kMiB);
  QemuImgCreate(theirs, 1024 * kMiB);
  CommandResult r = RunCommand(
      absl::StrCat("qemu-io --image-opts driver=qcow2,file.driver=preallocate,"
                   "file.file.driver=file,file.file.filename=",
                   theirs, " -c 'write -P 0xcd 0 4k'"));
  ASSERT_EQ(r.exit_code, 0) << r.err;

  absl::StatusOr<Chain> chain = OpenChain(env_, ours, "writeback", true);
  ASSERT_TRUE(chain.ok()) << chain.status();
  std::vector<uint8_t> data(4096, 0xcd);
  ASSERT_TRUE(env_.Run(chain->qcow2->Write(0, data)).ok());
  const bool allocates = GetParam() != FsKind::kExt4NoExtents;
  EXPECT_EQ(FileLength(ours), allocates ? 135266304u : 393216u);
  EXPECT_EQ(chain->filter->size(), 393216u);
  ASSERT_TRUE(env_.Run(chain->qcow2->Close()).ok());
  EXPECT_EQ(FileLength(ours), 393216u);
  EXPECT_EQ(FileLength(theirs), 393216u);
  ExpectClean(ours);
  ExpectIdentical(ours, theirs);
}

TEST_P(PreallocFsTest, AlignedSequentialWritesMatchTheUnfilteredImage) {
  CompareWithAndWithout("none", 0, 16 * 1024, 2048);
}

TEST_P(PreallocFsTest, UnalignedSequentialWritesMatchTheUnfilteredImage) {
  CompareWithAndWithout("none", 1024, 64 * 1024, 512);
  CompareWithAndWithout("writeback", 1024, 64 * 1024, 512);
}

// Random, non-overlapping writes and discards (64 in flight) with small
// preallocations, so that many of them race with writes in flight past the
// file end and qcow2 reuses freed clusters below the data end: the image
// still reads exactly like the one written without the filter, and the file
// ends at the filter's data end. (Which freed cluster a write reuses
// depends on which requests are still in flight, so the two files need not
// be laid out alike.)
TEST_P(PreallocFsTest, RandomWritesAndDiscardsWithSmallPreallocations) {
  const std::string with = Path("with.qcow2");
  const std::string without = Path("without.qcow2");
  QemuImgCreate(with, 256 * kMiB);
  QemuImgCreate(without, 256 * kMiB);
  PreallocFilterOptions options;
  options.set_prealloc_size(256 * 1024);
  options.set_prealloc_align(64 * 1024);
  for (bool filter : {true, false}) {
    absl::StatusOr<Chain> chain =
        OpenChain(env_, filter ? with : without, "none", filter, options);
    ASSERT_TRUE(chain.ok()) << chain.status();
    io::BlockNode& node = *chain->qcow2;
    // 4096 slots of 64 KiB; each pass writes a permutation of 1024 of them
    // (sizes 4..60 KiB at 1 KiB offsets), then discards every 7th.
    constexpr uint64_t kSlot = 65536;
    std::mt19937_64 rng(42);
    for (int pass = 0; pass < 3; ++pass) {
      std::vector<uint64_t> slots(4096);
      std::iota(slots.begin(), slots.end(), 0);
      std::shuffle(slots.begin(), slots.end(), rng);
      slots.resize(1024);
      std::vector<std::vector<uint8_t>> data(slots.size());
      int running = 0, failed = 0;
      size_t next = 0;
      std::function<void()> issue = [&] {
        while (running < 64 && next < slots.size()) {
          const size_t i = next++;
          const uint64_t offset = slots[i] * kSlot + (slots[i] % 4) * 1024;
          ++running;
          auto done = [&, i](absl::Status st) {
            if (!st.ok()) ++failed;
            data[i] = {};
            --running;
            issue();
          };
          if (pass > 0 && i % 7 == 0) {
            io::Spawn(node.Discard(slots[i] * kSlot, kSlot), done);
          } else {
            data[i] = qcow2::testing::Pattern(4096 * (1 + slots[i] % 15),
                                              pass * 10000 + slots[i]);
            io::Spawn(node.Write(offset, data[i]), done);
          }
        }
      };
      issue();
      while (running > 0) ASSERT_TRUE(env_.engine().Poll(true).ok());
      ASSERT_EQ(failed, 0);
    }
    if (filter) {
      EXPECT_EQ(chain->filter->size(), chain->filter->data_end());
    }
    ASSERT_TRUE(env_.Run(chain->qcow2->Close()).ok());
    if (filter) {
      ASSERT_TRUE(chain->filter->data_end().has_value());
      EXPECT_EQ(FileLength(with), *chain->filter->data_end());
    }
  }
  ExpectClean(with);
  ExpectClean(without);
  ExpectIdentical(with, without);
}

// Two images written in turns (256 KiB each) share the filesystem's free
// space: without the filter their allocations interleave.
TEST_P(PreallocFsTest, SequentiallyWrittenImageHasFewerExtents) {
  if (GetParam() == FsKind::kExt4NoExtents) GTEST_SKIP() << "no fallocate";
  uint64_t extents[2] = {0, 0};
  for (bool with_filter : {false, true}) {
    const std::string a = Path("a.qcow2");
    const std::string b = Path("b.qcow2");
    QemuImgCreate(a, 4096 * kMiB);
    QemuImgCreate(b, 4096 * kMiB);
    absl::StatusOr<Chain> ca = OpenChain(env_, a, "none", with_filter);
    absl::StatusOr<Chain> cb = OpenChain(env_, b, "none", with_filter);
    ASSERT_TRUE(ca.ok() && cb.ok());
    constexpr uint64_t kLength = 16 * 1024;
    constexpr int kBatch = 16;
    for (int i = 0; i < 128; ++i) {  // 32 MiB each
      const uint64_t start = i * kBatch * kLength;
      ASSERT_TRUE(WriteSequential(env_, *ca->qcow2, start, kLength, kBatch, 16,
                                  i * kBatch)
                      .ok());
      ASSERT_TRUE(WriteSequential(env_, *cb->qcow2, start, kLength, kBatch, 16,
                                  i * kBatch)
                      .ok());
    }
    ASSERT_TRUE(env_.Run(ca->qcow2->Close()).ok());
    ASSERT_TRUE(env_.Run(cb->qcow2->Close()).ok());
    absl::StatusOr<uint64_t> n = ExtentCount(env_, a);
    ASSERT_TRUE(n.ok()) << n.status();
    extents[with_filter] = *n;
    ExpectClean(a);
    ExpectIdentical(a, b);
    unlink(a.c_str());
    unlink(b.c_str());
  }
  std::printf(
      "%s: extents of a 32 MiB sequentially written qcow2: %llu "
      "without the filter, %llu with\n",
      FsName(GetParam()), static_cast<unsigned long long>(extents[0]),
      static_cast<unsigned long long>(extents[1]));
  RecordProperty("extents_without_filter", static_cast<int>(extents[0]));
  RecordProperty("extents_with_filter", static_cast<int>(extents[1]));
  EXPECT_LT(extents[1], extents[0]);
}

// Where fallocate cannot allocate, the filter does nothing: the file is
// never longer than the data.
TEST_P(PreallocFsTest, WithoutFallocateTheFileNeverGrowsAhead) {
  if (GetParam() != FsKind::kExt4NoExtents) GTEST_SKIP() << "has fallocate";
  const std::string path = Path("plain.qcow2");
  QemuImgCreate(path, 4096 * kMiB);
  absl::StatusOr<Chain> chain = OpenChain(env_, path, "writeback", true);
  ASSERT_TRUE(chain.ok()) << chain.status();
  for (int i = 0; i < 8; ++i) {
    ASSERT_TRUE(WriteSequential(env_, *chain->qcow2, 1024 + i * 64 * 65536,
                                65536, 64, 64, i * 64)
                    .ok());
    EXPECT_EQ(FileLength(path), chain->filter->size());
  }
  ASSERT_TRUE(env_.Run(chain->qcow2->Close()).ok());
  ExpectClean(path);
}

// SIGKILL while writing: the image stays valid (qemu-img check: no
// corruption; leaks are allowed), the file keeps the preallocated tail,
// and the next open/close through the filter trims it without changing
// what the image reads.
TEST_P(PreallocFsTest, KilledWriterLeavesAValidImageTrimmedOnNextOpen) {
  if (GetParam() == FsKind::kExt4NoExtents) GTEST_SKIP() << "no fallocate";
  const int kill_ms[] = {10, 150, 400};
  for (int iteration = 0; iteration < 3; ++iteration) {
    SCOPED_TRACE(absl::StrCat("kill after ", kill_ms[iteration], " ms"));
    const std::string image = Path("crash.qcow2");
    const std::string before = Path("crash.before.qcow2");
    QemuImgCreate(image, 4096 * kMiB);
    const std::string writer = WriterPath();
    const std::string seed = absl::StrCat(iteration);
    const std::string size =
        absl::StrCat(iteration == 2 ? 16 * kMiB : 128 * kMiB);
    char* argv[] = {const_cast<char*>(writer.c_str()),
                    const_cast<char*>(image.c_str()),
                    const_cast<char*>(seed.c_str()),
                    const_cast<char*>(iteration == 1 ? "writeback" : "none"),
                    const_cast<char*>(size.c_str()),
                    nullptr};
    pid_t pid = 0;
    ASSERT_EQ(
        posix_spawn(&pid, writer.c_str(), nullptr, nullptr, argv, environ), 0);
    // Kill a while after the first preallocation (startup time varies a
    // lot on a loaded machine).
    for (int i = 0; i < 2000 && FileLength(image) < kMiB; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(kill_ms[iteration]));
    kill(pid, SIGKILL);
    int status = 0;
    ASSERT_EQ(waitpid(pid, &status, 0), pid);
    ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL)
        << "crash_writer ended before the kill (status " << status << ")";

    QemuCheck q = RunQemuCheck(image);  // retries while still locked
    EXPECT_TRUE(q.exit_code == 0 || q.exit_code == 3) << q.err << q.output;
    EXPECT_EQ(q.corruptions, 0u) << q.err;
    EXPECT_EQ(q.check_errors, 0u) << q.err;
    const uint64_t killed_length = FileLength(image);
    const uint64_t data_end = LastDataEnd(image);
    // "<data end> <file end> <data end before> <file end before>": a file
    // end above the length means the kill came before the last
    // preallocation's fallocate grew the file.
    char marker[128] = {};
    const ssize_t marker_length = getxattr(
        image.c_str(), "user.imgtool.preallocate", marker, sizeof(marker) - 1);
    std::printf(
        "%s kill after %d ms: file %llu bytes, data ends at %llu, "
        "image end offset %llu, %llu leaks, marker '%s'\n",
        FsName(GetParam()), kill_ms[iteration],
        static_cast<unsigned long long>(killed_length),
        static_cast<unsigned long long>(data_end),
        static_cast<unsigned long long>(q.image_end_offset),
        static_cast<unsigned long long>(q.leaks),
        marker_length > 0 ? marker : "");
    EXPECT_EQ(killed_length % kMiB, 0u);
    EXPECT_GT(killed_length, data_end);  // the preallocated tail is there
    // (Reading the tail fills the page cache with zeroes, which SEEK_DATA
    // then reports as data: the filter must not be fooled by that.)
    CommandResult cp =
        RunCommand(absl::StrCat("cp --sparse=always ", image, " ", before));
    ASSERT_EQ(cp.exit_code, 0) << cp.err;

    absl::StatusOr<Chain> chain = OpenChain(env_, image, "none", true);
    ASSERT_TRUE(chain.ok()) << chain.status();
    const uint64_t recovered = chain->filter->size();
    ASSERT_TRUE(env_.Run(chain->qcow2->Close()).ok());
    const uint64_t trimmed = FileLength(image);
    EXPECT_EQ(trimmed, recovered);
    EXPECT_LT(trimmed, killed_length);
    EXPECT_GE(trimmed, data_end);
    // Up to the data end the filter saw at the last flush: the writes in
    // flight then (64 x 64 KiB) may not have reached the file.
    EXPECT_LE(trimmed, data_end + 68 * 65536);
    QemuCheck after = RunQemuCheck(image);
    EXPECT_EQ(after.corruptions, 0u) << after.err;
    EXPECT_EQ(after.check_errors, 0u) << after.err;
    ExpectIdentical(before, image);
    unlink(image.c_str());
    unlink(before.c_str());
  }
}

INSTANTIATE_TEST_SUITE_P(Filesystems, PreallocFsTest,
                         ::testing::Values(FsKind::kXfs, FsKind::kExt4,
                                           FsKind::kExt4NoExtents),
                         [](const ::testing::TestParamInfo<FsKind>& info) {
                           return std::string(FsName(info.param));
                         });

}  // namespace
}  // namespace imgtool::prealloc_filter::testing

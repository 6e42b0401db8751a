// The preallocate filter over a real posix_file::FileNode on a temporary
// file (the test's filesystem: ext4 or XFS, fallocate ZERO_RANGE works).
// Figures of preallocate-filter.md §4 [V] (qemu-io 7.2 under strace).
#include "prealloc_filter/prealloc_filter.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/xattr.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "io/block_node.h"
#include "io/engine.h"
#include "io/sync.h"
#include "io/task.h"
#include "posix_file/file_node.h"
#include "posix_file/file_options.pb.h"

namespace imgtool::prealloc_filter {
namespace {

using ::testing::HasSubstr;

constexpr uint64_t kMiB = 1 << 20;

std::string TempPath(const std::string& name) {
  const char* dir = std::getenv("TEST_TMPDIR");
  return absl::StrCat(dir != nullptr ? dir : "/tmp", "/", name);
}

uint64_t FileLength(const std::string& path) {
  struct stat st;
  if (stat(path.c_str(), &st) != 0) return ~uint64_t{0};
  return static_cast<uint64_t>(st.st_size);
}

std::vector<uint8_t> Pattern(uint64_t length, uint64_t seed) {
  std::vector<uint8_t> v(length);
  for (uint64_t i = 0; i < length; ++i) {
    v[i] = static_cast<uint8_t>(((i * 7 + seed * 13 + i / 251) | 1) & 0xff);
  }
  return v;
}

bool HasMarker(const std::string& path) {
  char buf[64];
  return getxattr(path.c_str(), "user.imgtool.preallocate", buf, sizeof(buf)) >
         0;
}

// The crash marker's text ("" if none).
std::string MarkerText(const std::string& path) {
  char buf[128];
  const ssize_t n =
      getxattr(path.c_str(), "user.imgtool.preallocate", buf, sizeof(buf));
  return n > 0 ? std::string(buf, static_cast<size_t>(n)) : std::string();
}

// Copies the 4 KiB blocks that are not all zeroes in the first
// `data_length` bytes of `from` into a new file `to` of the same length
// (the rest holes) with the same crash marker.
void CopyFileWithMarker(const std::string& from, const std::string& to,
                        uint64_t data_length) {
  const int in = open(from.c_str(), O_RDONLY);
  ASSERT_GE(in, 0);
  const int out = open(to.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  ASSERT_GE(out, 0);
  std::vector<uint8_t> buf(data_length);
  ASSERT_EQ(pread(in, buf.data(), buf.size(), 0),
            static_cast<ssize_t>(buf.size()));
  for (uint64_t off = 0; off < data_length; off += 4096) {
    const uint8_t* block = buf.data() + off;
    if (std::all_of(block, block + 4096, [](uint8_t b) { return b == 0; })) {
      continue;
    }
    ASSERT_EQ(pwrite(out, block, 4096, static_cast<off_t>(off)), 4096);
  }
  ASSERT_EQ(ftruncate(out, static_cast<off_t>(FileLength(from))), 0);
  const std::string marker = MarkerText(from);
  ASSERT_EQ(fsetxattr(out, "user.imgtool.preallocate", marker.data(),
                      marker.size(), 0),
            0);
  close(in);
  close(out);
}

class PreallocFilterTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto engine = io::CreateEngine(io::EngineKind::kAuto, 64, nullptr);
    ASSERT_TRUE(engine.ok()) << engine.status();
    engine_ = *std::move(engine);
    path_ = TempPath(absl::StrCat(
        ::testing::UnitTest::GetInstance()->current_test_info()->name(),
        ".img"));
    unlink(path_.c_str());
  }
  void TearDown() override { unlink(path_.c_str()); }

  template <typename T>
  T Run(io::Task<T> task) {
    return io::RunSync(*engine_, std::move(task));
  }

  // A file of `length` bytes of pattern data.
  void MakeFile(uint64_t length) {
    auto file = OpenFile(false);
    ASSERT_NE(file, nullptr);
    if (length > 0) {
      std::vector<uint8_t> data = Pattern(length, 1);
      ASSERT_TRUE(Run(file->Write(0, data)).ok());
    }
    ASSERT_TRUE(Run(file->Close()).ok());
  }

  std::unique_ptr<posix_file::FileNode> OpenFile(bool read_only,
                                                 bool share_all = false) {
    posix_file::FileOpenOptions o;
    o.set_filename(path_);
    o.set_read_only(read_only);
    o.set_share_all_with_others(share_all);
    if (!read_only && FileLength(path_) == ~uint64_t{0}) {
      posix_file::FileCreateOptions c;
      c.set_extent_size_hint(0);
      absl::Status st = posix_file::CreateFile(path_, c, nullptr);
      EXPECT_TRUE(st.ok()) << st;
    }
    auto f = posix_file::FileNode::Open(*engine_, o, nullptr);
    EXPECT_TRUE(f.ok()) << f.status();
    return f.ok() ? *std::move(f) : nullptr;
  }

  std::unique_ptr<PreallocFilterNode> Open(bool read_only = false,
                                           PreallocFilterOptions options = {},
                                           bool share_all = false) {
    auto file = OpenFile(read_only, share_all);
    if (file == nullptr) return nullptr;
    auto node = Run(OpenPreallocFilter(std::move(file), options));
    EXPECT_TRUE(node.ok()) << node.status();
    return node.ok() ? *std::move(node) : nullptr;
  }

  absl::Status Write(io::BlockNode& node, uint64_t offset, uint64_t length,
                     uint64_t seed = 2) {
    std::vector<uint8_t> data = Pattern(length, seed);
    return Run(node.Write(offset, data));
  }

  std::vector<uint8_t> Read(io::BlockNode& node, uint64_t offset,
                            uint64_t length) {
    std::vector<uint8_t> buf(length, 0xee);
    absl::Status st = Run(node.Read(offset, io::IoVec(buf)));
    EXPECT_TRUE(st.ok()) << st;
    return buf;
  }

  std::unique_ptr<io::Engine> engine_;
  std::string path_;
};

TEST(ValidateOptionsTest, UsesQemuTexts) {
  EXPECT_TRUE(ValidateOptions({}, 1).ok());
  EXPECT_TRUE(ValidateOptions({}, 4096).ok());
  PreallocFilterOptions o;
  o.set_prealloc_align(1000);
  EXPECT_EQ(
      ValidateOptions(o, 1),
      absl::InvalidArgumentError("prealloc-align parameter of preallocate "
                                 "filter is not aligned to 512"));
  o.set_prealloc_align(512);
  EXPECT_TRUE(ValidateOptions(o, 512).ok());
  EXPECT_EQ(ValidateOptions(o, 4096),
            absl::InvalidArgumentError(
                "prealloc-align parameter of preallocate filter is not "
                "aligned to underlying node request alignment (4096)"));
  o.set_prealloc_align(0);  // QEMU accepts 0: the request alignment is used
  EXPECT_TRUE(ValidateOptions(o, 4096).ok());
  o.clear_prealloc_align();
  o.set_prealloc_size(0);
  EXPECT_TRUE(ValidateOptions(o, 1).ok());
}

TEST_F(PreallocFilterTest, FirstWritePastTheEndPreallocatesAheadAsQemu) {
  // §4 [V]: a 196624-byte file, a write ending at 327680: fallocate from
  // 197120 (the length rounded up to 512) to align_up(327680 + 128 MiB,
  // 1 MiB) = 135266304.
  MakeFile(196624);
  auto node = Open();
  ASSERT_NE(node, nullptr);
  ASSERT_TRUE(node->active());
  EXPECT_EQ(node->size(), 197120u);
  ASSERT_TRUE(Write(*node, 262144, 65536).ok());
  EXPECT_EQ(node->size(), 327680u);
  EXPECT_EQ(node->data_end(), 327680u);
  EXPECT_EQ(node->zero_start(), 327680u);
  EXPECT_EQ(node->file_end(), 135266304u);
  EXPECT_EQ(FileLength(path_), 135266304u);
  EXPECT_EQ(node->file().size(), 135266304u);
  // Writes inside the preallocated tail do not preallocate again.
  ASSERT_TRUE(Write(*node, kMiB, 65536).ok());
  EXPECT_EQ(FileLength(path_), 135266304u);
  EXPECT_EQ(node->size(), kMiB + 65536);
  // Tail hidden: block status stops at the data end.
  EXPECT_EQ(Run(node->GetBlockStatus(kMiB + 65536, 4096)).status().code(),
            absl::StatusCode::kOutOfRange);
  EXPECT_EQ(Read(*node, 262144, 65536), Pattern(65536, 2));
  EXPECT_EQ(Read(*node, 0, 4096), Pattern(4096, 1));
  // Close truncates to the data end.
  ASSERT_TRUE(Run(node->Close()).ok());
  EXPECT_EQ(FileLength(path_), kMiB + 65536);
  EXPECT_FALSE(HasMarker(path_));
}

TEST_F(PreallocFilterTest, PreallocSizeAndAlignOptions) {
  MakeFile(0);
  PreallocFilterOptions o;
  o.set_prealloc_size(0);
  o.set_prealloc_align(64 * 1024);
  auto node = Open(false, o);
  ASSERT_NE(node, nullptr);
  ASSERT_TRUE(Write(*node, 0, 1000).ok());
  EXPECT_EQ(FileLength(path_), 65536u);  // only the alignment padding
  ASSERT_TRUE(Write(*node, 65536, 1).ok());
  EXPECT_EQ(FileLength(path_), 131072u);
  EXPECT_EQ(node->size(), 65537u);
  ASSERT_TRUE(Run(node->Close()).ok());
  EXPECT_EQ(FileLength(path_), 65537u);
}

TEST_F(PreallocFilterTest, WritesInsideTheDataDoNotPreallocate) {
  MakeFile(2 * kMiB);
  auto node = Open();
  ASSERT_NE(node, nullptr);
  ASSERT_TRUE(Write(*node, kMiB, 4096).ok());
  ASSERT_TRUE(Write(*node, 2 * kMiB - 4096, 4096).ok());
  EXPECT_EQ(FileLength(path_), 2 * kMiB);
  EXPECT_EQ(node->file_end(), 2 * kMiB);
  ASSERT_TRUE(Run(node->Close()).ok());
  EXPECT_EQ(FileLength(path_), 2 * kMiB);
}

TEST_F(PreallocFilterTest, MergeableZeroWriteInTheZeroTailIsDropped) {
  MakeFile(0);
  auto node = Open();
  ASSERT_NE(node, nullptr);
  ASSERT_TRUE(Write(*node, 0, 4096).ok());
  EXPECT_EQ(node->zero_start(), 4096u);
  // Zero write past the data end inside [zero_start, file_end): dropped,
  // but it moves the data end and not zero_start.
  ASSERT_TRUE(Run(node->WriteZeroes(65536, 65536, {.no_fallback = true})).ok());
  EXPECT_EQ(node->data_end(), 131072u);
  EXPECT_EQ(node->zero_start(), 4096u);
  EXPECT_EQ(Read(*node, 4096, 131072 - 4096),
            std::vector<uint8_t>(131072 - 4096, 0));
  // With may_unmap it is not mergeable: forwarded, zero_start moves.
  ASSERT_TRUE(Run(node->WriteZeroes(196608, 65536, {.may_unmap = true})).ok());
  EXPECT_EQ(node->data_end(), 262144u);
  EXPECT_EQ(node->zero_start(), 262144u);
  ASSERT_TRUE(Run(node->Close()).ok());
  EXPECT_EQ(FileLength(path_), 262144u);
}

TEST_F(PreallocFilterTest, ZeroWriteOverDataBelowTheDataEndIsNotDropped) {
  // QEMU 7.2 would drop the last zero write (its offset is past zero_start,
  // which a write inside the data end does not move) and keep the data.
  MakeFile(0);
  auto node = Open();
  ASSERT_NE(node, nullptr);
  ASSERT_TRUE(Write(*node, 0, 4096).ok());
  ASSERT_TRUE(Run(node->WriteZeroes(8192, 8192, {})).ok());
  ASSERT_TRUE(Write(*node, 10240, 2048).ok());
  EXPECT_EQ(node->zero_start(), 4096u);  // the data is remembered instead
  ASSERT_TRUE(Run(node->WriteZeroes(8192, 12288, {})).ok());
  EXPECT_EQ(node->data_end(), 20480u);
  EXPECT_EQ(Read(*node, 8192, 12288), std::vector<uint8_t>(12288, 0));
  ASSERT_TRUE(Run(node->Close()).ok());
  EXPECT_EQ(FileLength(path_), 20480u);
}

TEST_F(PreallocFilterTest, FallocTruncateInsideTheTailOnlyMovesTheDataEnd) {
  MakeFile(0);
  auto node = Open();
  ASSERT_NE(node, nullptr);
  ASSERT_TRUE(Write(*node, 0, 4096).ok());
  const uint64_t file_end = FileLength(path_);
  ASSERT_EQ(file_end, 129 * kMiB);
  ASSERT_TRUE(Run(node->Truncate(8 * kMiB, io::PreallocMode::kFalloc)).ok());
  EXPECT_EQ(node->size(), 8 * kMiB);
  EXPECT_EQ(FileLength(path_), file_end);
  // Past the tail it falls through to the file.
  ASSERT_TRUE(Run(node->Truncate(130 * kMiB, io::PreallocMode::kFalloc)).ok());
  EXPECT_EQ(FileLength(path_), 130 * kMiB);
  EXPECT_EQ(node->size(), 130 * kMiB);
  EXPECT_EQ(node->file_end(), 130 * kMiB);
  ASSERT_TRUE(Run(node->Close()).ok());
  EXPECT_EQ(FileLength(path_), 130 * kMiB);
}

TEST_F(PreallocFilterTest, OffTruncateDropsThePreallocationFirst) {
  MakeFile(0);
  auto node = Open();
  ASSERT_NE(node, nullptr);
  ASSERT_TRUE(Write(*node, 0, 4096).ok());
  ASSERT_TRUE(Run(node->Truncate(3 * kMiB, io::PreallocMode::kOff)).ok());
  EXPECT_EQ(FileLength(path_), 3 * kMiB);
  EXPECT_EQ(node->size(), 3 * kMiB);
  struct stat st;
  ASSERT_EQ(stat(path_.c_str(), &st), 0);
  EXPECT_LT(static_cast<uint64_t>(st.st_blocks) * 512, kMiB);  // sparse
  // Shrinking is forwarded.
  ASSERT_TRUE(Run(node->Truncate(kMiB, io::PreallocMode::kOff)).ok());
  EXPECT_EQ(FileLength(path_), kMiB);
  ASSERT_TRUE(Run(node->Close()).ok());
  EXPECT_EQ(FileLength(path_), kMiB);
}

TEST_F(PreallocFilterTest, FlushPassesThrough) {
  MakeFile(0);
  auto node = Open();
  ASSERT_NE(node, nullptr);
  ASSERT_TRUE(Write(*node, 0, 4096).ok());
  ASSERT_TRUE(Run(node->Flush()).ok());
  EXPECT_EQ(FileLength(path_), 129 * kMiB);  // flush keeps the tail
  ASSERT_TRUE(Run(node->Close()).ok());
}

TEST_F(PreallocFilterTest, ReadOnlyIsAPurePassThrough) {
  MakeFile(1000);
  auto node = Open(/*read_only=*/true);
  ASSERT_NE(node, nullptr);
  EXPECT_FALSE(node->active());
  EXPECT_EQ(node->size(), 1000u);
  EXPECT_EQ(Read(*node, 0, 1000), Pattern(1000, 1));
  EXPECT_EQ(Run(node->Write(0, Pattern(10, 1))).code(),
            absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(Run(node->Close()).ok());
  EXPECT_EQ(FileLength(path_), 1000u);
}

TEST_F(PreallocFilterTest, SharedFileIsAPurePassThrough) {
  MakeFile(0);
  auto node = Open(false, {}, /*share_all=*/true);
  ASSERT_NE(node, nullptr);
  EXPECT_FALSE(node->active());
  ASSERT_TRUE(Write(*node, 0, 5000).ok());
  EXPECT_EQ(FileLength(path_), 5000u);
  EXPECT_EQ(node->size(), 5000u);
  ASSERT_TRUE(Run(node->Close()).ok());
  EXPECT_EQ(FileLength(path_), 5000u);
}

TEST_F(PreallocFilterTest, SecondWriterGetsALockError) {
  MakeFile(0);
  auto node = Open();
  ASSERT_NE(node, nullptr);
  posix_file::FileOpenOptions o;
  o.set_filename(path_);
  auto second = posix_file::FileNode::Open(*engine_, o, nullptr);
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(second.status().message()),
              HasSubstr("Failed to get \"write\" lock"));
  o.set_read_only(true);
  second = posix_file::FileNode::Open(*engine_, o, nullptr);
  ASSERT_FALSE(second.ok());
  EXPECT_THAT(std::string(second.status().message()),
              HasSubstr("Failed to get shared \"write\" lock"));
  ASSERT_TRUE(Run(node->Close()).ok());
}

TEST_F(PreallocFilterTest, ConcurrentExtendingWritesAllLand) {
  // Small preallocations so that many of them race with in-flight writes:
  // 256 writes of 20 KiB (unaligned ends), 64 in flight, some far ahead.
  MakeFile(0);
  PreallocFilterOptions o;
  o.set_prealloc_size(256 * 1024);
  o.set_prealloc_align(64 * 1024);
  auto node = Open(false, o);
  ASSERT_NE(node, nullptr);
  constexpr int kWrites = 256;
  constexpr uint64_t kLen = 20 * 1024;
  std::vector<std::vector<uint8_t>> data;
  std::vector<uint64_t> offsets;
  for (int i = 0; i < kWrites; ++i) {
    data.push_back(Pattern(kLen, 100 + i));
    // Mostly sequential; every 16th write lands 8 MiB further.
    offsets.push_back(i * kLen + (i % 16 == 15 ? 8 * kMiB : 0));
  }
  int running = 0, next = 0, failed = 0;
  std::function<void()> start = [&] {
    while (running < 64 && next < kWrites) {
      const int i = next++;
      ++running;
      io::Spawn(node->Write(offsets[i], data[i]), [&](absl::Status st) {
        if (!st.ok()) ++failed;
        --running;
        start();
      });
    }
  };
  start();
  while (running > 0) ASSERT_TRUE(engine_->Poll(true).ok());
  EXPECT_EQ(failed, 0);
  uint64_t end = 0;
  for (int i = 0; i < kWrites; ++i) end = std::max(end, offsets[i] + kLen);
  EXPECT_EQ(node->size(), end);
  for (int i = 0; i < kWrites; ++i) {
    EXPECT_EQ(Read(*node, offsets[i], kLen), data[i]) << "write " << i;
  }
  ASSERT_TRUE(Run(node->Close()).ok());
  EXPECT_EQ(FileLength(path_), end);
  // And through a fresh open, without the filter.
  auto file = OpenFile(true);
  ASSERT_NE(file, nullptr);
  for (int i = 0; i < kWrites; ++i) {
    EXPECT_EQ(Read(*file, offsets[i], kLen), data[i]) << "write " << i;
  }
  ASSERT_TRUE(Run(file->Close()).ok());
}

// Forwards to a FileNode; writes wait at a gate until it opens. Not a
// FileNode itself: the filter uses plain no-fallback write zeroes on it.
class GatedNode : public io::BlockNode {
 public:
  explicit GatedNode(std::unique_ptr<io::BlockNode> inner)
      : io::BlockNode(inner->filename(), inner->read_only()),
        inner_(std::move(inner)) {}
  uint64_t size() const override { return inner_->size(); }
  io::Task<absl::Status> Close() override { return inner_->Close(); }
  io::Event gate;
  int zero_writes = 0;
  bool fail_zeroes = false;  // write zeroes fail with ENOSPC

 protected:
  io::Task<absl::Status> DoRead(uint64_t offset, io::IoVec buf) override {
    return inner_->Read(offset, buf);
  }
  io::Task<absl::Status> DoWrite(uint64_t offset,
                                 io::ConstIoVec data) override {
    co_await gate.Wait();
    co_return co_await inner_->Write(offset, data);
  }
  io::Task<absl::Status> DoWriteZeroes(uint64_t offset, uint64_t length,
                                       io::WriteZeroesFlags flags) override {
    ++zero_writes;
    if (fail_zeroes) {
      co_return absl::ResourceExhaustedError("No space left on device");
    }
    co_return co_await inner_->WriteZeroes(offset, length, flags);
  }
  io::Task<absl::Status> DoFlush() override { return inner_->Flush(); }
  io::Task<absl::Status> DoTruncate(uint64_t size,
                                    io::PreallocMode mode) override {
    return inner_->Truncate(size, mode);
  }
  io::Task<absl::StatusOr<io::BlockStatus>> DoGetBlockStatus(
      uint64_t offset, uint64_t max_length) override {
    return inner_->GetBlockStatus(offset, max_length);
  }

 private:
  std::unique_ptr<io::BlockNode> inner_;
};

TEST_F(PreallocFilterTest, PreallocationNeverWaitsForWritesInFlight) {
  // §8 NO_WAIT: a write past the file end is in flight (held at the gate;
  // its own preallocation failed). The next extending write must neither
  // wait for it nor zero under it: its preallocation is skipped, and it
  // completes on its own.
  MakeFile(0);
  auto gated = std::make_unique<GatedNode>(OpenFile(false));
  GatedNode* gate = gated.get();
  auto node = Run(OpenPreallocFilter(std::move(gated), {}));
  ASSERT_TRUE(node.ok()) << node.status();
  gate->gate.Set();
  ASSERT_TRUE(Write(**node, 0, 4096).ok());  // preallocates [0, 129 MiB)
  EXPECT_EQ(gate->zero_writes, 1);
  ASSERT_EQ(FileLength(path_), 129 * kMiB);

  gate->gate = io::Event();  // closed again
  gate->fail_zeroes = true;  // as on a filesystem that is full
  const std::vector<uint8_t> far = Pattern(65536, 5);
  bool far_done = false;
  io::Spawn((*node)->Write(200 * kMiB, far), [&](absl::Status st) {
    EXPECT_TRUE(st.ok()) << st;
    far_done = true;
  });
  ASSERT_FALSE(far_done);           // held at the gate, past the file end
  EXPECT_EQ(gate->zero_writes, 2);  // its preallocation, failed
  EXPECT_EQ((*node)->file_end(), std::nullopt);
  gate->fail_zeroes = false;

  // Would preallocate from 129 MiB, over the held write: skipped instead.
  bool near_done = false;
  io::Spawn((*node)->WriteZeroes(300 * kMiB, 4096, {}), [&](absl::Status st) {
    EXPECT_TRUE(st.ok()) << st;
    near_done = true;
  });
  while (!near_done) ASSERT_TRUE(engine_->Poll(true).ok());
  EXPECT_FALSE(far_done);
  EXPECT_EQ(gate->zero_writes, 3);  // the forwarded zero write only
  EXPECT_EQ(FileLength(path_), 300 * kMiB + 4096);
  EXPECT_EQ((*node)->file_end(), std::nullopt);  // re-read next time
  gate->gate.Set();
  while (!far_done) ASSERT_TRUE(engine_->Poll(true).ok());
  EXPECT_EQ((*node)->size(), 300 * kMiB + 4096);
  // The next extending write preallocates again, from the real end.
  ASSERT_TRUE(Write(**node, 300 * kMiB + 4096, 4096).ok());
  EXPECT_EQ(gate->zero_writes, 4);
  EXPECT_EQ(FileLength(path_), 429 * kMiB);
  EXPECT_EQ(Read(**node, 200 * kMiB, 65536), far);
  EXPECT_EQ(Read(**node, 0, 4096), Pattern(4096, 2));
  ASSERT_TRUE(Run((*node)->Close()).ok());
  EXPECT_EQ(FileLength(path_), 300 * kMiB + 8192);
}

TEST_F(PreallocFilterTest, OnlyZeroWritesOverRememberedDataAreForwarded) {
  // qcow2's pattern with many writes in flight: clusters are zeroed (merged
  // zero writes past the data end) and written, not always in order.
  MakeFile(0);
  auto gated = std::make_unique<GatedNode>(OpenFile(false));
  GatedNode* gate = gated.get();
  gate->gate.Set();
  auto node = Run(OpenPreallocFilter(std::move(gated), {}));
  ASSERT_TRUE(node.ok()) << node.status();
  ASSERT_TRUE(Write(**node, 0, 65536).ok());  // preallocates
  ASSERT_EQ(gate->zero_writes, 1);
  ASSERT_TRUE(Run((*node)->WriteZeroes(65536, 65536, {})).ok());   // A
  ASSERT_TRUE(Run((*node)->WriteZeroes(131072, 65536, {})).ok());  // B
  EXPECT_EQ(gate->zero_writes, 1);                       // both dropped
  ASSERT_TRUE(Write(**node, 131072 + 1024, 4096).ok());  // B's data first
  ASSERT_TRUE(Write(**node, 65536 + 1024, 4096).ok());   // then A's
  // C, past both: dropped.
  ASSERT_TRUE(Run((*node)->WriteZeroes(196608, 65536, {})).ok());
  EXPECT_EQ(gate->zero_writes, 1);
  // Inside the data end, next to B's data (QEMU would forward it): dropped.
  ASSERT_TRUE(Run((*node)->WriteZeroes(131072 + 8192, 8192, {})).ok());
  EXPECT_EQ(gate->zero_writes, 1);
  // Over B's data, inside the data end: forwarded.
  ASSERT_TRUE(Run((*node)->WriteZeroes(131072, 8192, {})).ok());
  EXPECT_EQ(gate->zero_writes, 2);
  // Past the data end but over B's data: forwarded, reads back as zeroes.
  ASSERT_TRUE(Run((*node)->WriteZeroes(131072, 196608, {})).ok());
  EXPECT_EQ(gate->zero_writes, 3);
  EXPECT_EQ(Read(**node, 131072, 196608), std::vector<uint8_t>(196608, 0));
  EXPECT_EQ(Read(**node, 65536 + 1024, 4096), Pattern(4096, 2));
  EXPECT_EQ((*node)->zero_start(), 65536u);
  ASSERT_TRUE(Run((*node)->Close()).ok());
  EXPECT_EQ(FileLength(path_), 327680u);
}

TEST_F(PreallocFilterTest, WritesPastARunningPreallocationWaitForIt) {
  // The preallocation extends the file: a write that reaches past its start
  // must not run concurrently with it (it could be zeroed, or lost on XFS).
  MakeFile(0);
  auto node = Open();
  ASSERT_NE(node, nullptr);
  const std::vector<uint8_t> a = Pattern(65536, 11), b = Pattern(65536, 12);
  int done = 0;
  io::Spawn(node->Write(0, a), [&](absl::Status st) {
    EXPECT_TRUE(st.ok());
    ++done;
  });
  io::Spawn(node->Write(65536, b), [&](absl::Status st) {
    EXPECT_TRUE(st.ok());
    ++done;
  });
  while (done < 2) ASSERT_TRUE(engine_->Poll(true).ok());
  EXPECT_EQ(Read(*node, 0, 65536), a);
  EXPECT_EQ(Read(*node, 65536, 65536), b);
  // One preallocation (the second write's was skipped: one was running).
  EXPECT_EQ(FileLength(path_), 129 * kMiB);
  ASSERT_TRUE(Run(node->Close()).ok());
  EXPECT_EQ(FileLength(path_), 131072u);
}

TEST_F(PreallocFilterTest, ReopenAfterAnUncleanCloseTrimsTheStaleTail) {
  MakeFile(0);
  auto node = Open();
  ASSERT_NE(node, nullptr);
  ASSERT_TRUE(Write(*node, 0, 65536).ok());
  ASSERT_TRUE(Write(*node, kMiB, 4096).ok());
  ASSERT_EQ(FileLength(path_), 129 * kMiB);
  if (!HasMarker(path_)) GTEST_SKIP() << "no user xattrs on this filesystem";
  // The process "dies": the file is closed without the filter's Close().
  ASSERT_TRUE(Run(node->file().Close()).ok());
  node.reset();
  ASSERT_EQ(FileLength(path_), 129 * kMiB);

  node = Open();
  ASSERT_NE(node, nullptr);
  EXPECT_EQ(node->size(), kMiB + 4096);
  EXPECT_EQ(Read(*node, 0, 65536), Pattern(65536, 2));
  ASSERT_TRUE(Run(node->Close()).ok());
  EXPECT_EQ(FileLength(path_), kMiB + 4096);
  EXPECT_FALSE(HasMarker(path_));
  // A clean file is taken at its length.
  node = Open();
  ASSERT_NE(node, nullptr);
  EXPECT_EQ(node->size(), kMiB + 4096);
  ASSERT_TRUE(Run(node->Close()).ok());
}

// A zero write inside the preallocated tail is dropped (no written
// extent); after a flush the crash marker still covers it, so a recovery
// keeps it (qcow2's padding of its last cluster stays inside the file).
TEST_F(PreallocFilterTest, RecoveryKeepsZeroWritesFlushedBeforeTheCrash) {
  MakeFile(0);
  auto node = Open();
  ASSERT_NE(node, nullptr);
  ASSERT_TRUE(Write(*node, 0, 4096).ok());
  ASSERT_TRUE(Write(*node, 65536, 4096).ok());
  ASSERT_TRUE(
      Run(node->WriteZeroes(69632, 61440, {.no_fallback = true})).ok());
  ASSERT_EQ(FileLength(path_), 129 * kMiB);
  if (!HasMarker(path_)) GTEST_SKIP() << "no user xattrs on this filesystem";
  ASSERT_TRUE(Run(node->Flush()).ok());
  ASSERT_TRUE(Run(node->file().Close()).ok());
  node.reset();

  node = Open();
  ASSERT_NE(node, nullptr);
  EXPECT_EQ(node->size(), 131072u);
  ASSERT_TRUE(Run(node->Close()).ok());
  EXPECT_EQ(FileLength(path_), 131072u);
}

// The writer is killed while a preallocation's fallocate is still queued
// (io_uring hands it to the kernel only at the next Poll; under load the
// window is long): the file still has its old length, with the previous
// preallocation's tail, while the marker already names the new end. The
// next open trims that tail (before, the marker's end did not match the
// length, so the tail stayed).
TEST_F(PreallocFilterTest, ReopenAfterAKillBeforeThePreallocationGrewTheFile) {
  if (std::string(engine_->name()) != "io_uring") {
    GTEST_SKIP() << "needs io_uring, which queues the fallocate until Poll";
  }
  MakeFile(0);
  auto node = Open();
  ASSERT_NE(node, nullptr);
  ASSERT_TRUE(Write(*node, 0, 65536).ok());
  ASSERT_TRUE(Write(*node, kMiB, 4096).ok());
  // Dropped (inside the zero tail), then flushed: the marker covers it.
  ASSERT_TRUE(
      Run(node->WriteZeroes(kMiB + 4096, 61440, {.no_fallback = true})).ok());
  ASSERT_TRUE(Run(node->Flush()).ok());
  // Dropped too, not flushed: no metadata on disk can point at it yet.
  ASSERT_TRUE(
      Run(node->WriteZeroes(kMiB + 65536, 65536, {.no_fallback = true})).ok());
  ASSERT_EQ(FileLength(path_), 129 * kMiB);
  if (!HasMarker(path_)) GTEST_SKIP() << "no user xattrs on this filesystem";
  // A write across the file end: its preallocation sets the marker and
  // queues the fallocate, and the write waits for it.
  std::vector<uint8_t> data = Pattern(8192, 3);
  bool done = false;
  absl::Status st;
  io::Spawn(node->Write(129 * kMiB - 4096, data), [&](absl::Status s) {
    st = s;
    done = true;
  });
  ASSERT_FALSE(done);
  ASSERT_EQ(FileLength(path_), 129 * kMiB);
  EXPECT_EQ(MarkerText(path_),
            absl::StrCat(129 * kMiB + 4096, " ", 258 * kMiB, " ", kMiB + 65536,
                         " ", 129 * kMiB));
  // The process dies here: a copy of the file as it is now (its data is in
  // the first 2 MiB; the rest stays a hole).
  const std::string crashed = path_ + ".crashed";
  CopyFileWithMarker(path_, crashed, 2 * kMiB);
  while (!done) ASSERT_TRUE(engine_->Poll(true).ok());
  ASSERT_TRUE(st.ok()) << st;
  ASSERT_TRUE(Run(node->Close()).ok());
  EXPECT_EQ(FileLength(path_), 129 * kMiB + 4096);
  unlink(path_.c_str());

  path_ = crashed;
  node = Open();
  ASSERT_NE(node, nullptr);
  // The written data and the flushed zero write stay; the tail goes.
  EXPECT_EQ(node->size(), kMiB + 65536);
  EXPECT_EQ(Read(*node, kMiB, 4096), Pattern(4096, 2));
  ASSERT_TRUE(Run(node->Close()).ok());
  EXPECT_EQ(FileLength(crashed), kMiB + 65536);
  EXPECT_FALSE(HasMarker(crashed));
}

TEST_F(PreallocFilterTest, MarkerOfAFileChangedSinceIsIgnored) {
  MakeFile(0);
  auto node = Open();
  ASSERT_NE(node, nullptr);
  ASSERT_TRUE(Write(*node, 0, 4096).ok());
  if (!HasMarker(path_)) GTEST_SKIP() << "no user xattrs on this filesystem";
  ASSERT_TRUE(Run(node->file().Close()).ok());
  node.reset();
  ASSERT_EQ(truncate(path_.c_str(), 200 * kMiB), 0);  // someone else grew it
  node = Open();
  ASSERT_NE(node, nullptr);
  EXPECT_EQ(node->size(), 200 * kMiB);
  ASSERT_TRUE(Run(node->Close()).ok());
  EXPECT_EQ(FileLength(path_), 200 * kMiB);
}

}  // namespace
}  // namespace imgtool::prealloc_filter

// posix_file on real filesystems mounted on loop devices (XFS, ext4, ext4
// without extents, 4096-byte sectors). Needs root; tags = ["local"].
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "base/testing/loop_mount.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "io/block_node.h"
#include "io/engine.h"
#include "io/thread_pool_engine.h"
#include "posix_file/file_node.h"
#include "posix_file/file_options.pb.h"
#include "posix_file/testing/op_recorder.h"

namespace imgtool::posix_file {
namespace {

using ::imgtool::testing::FsKind;
using ::imgtool::testing::LoopMount;

// Skips the test when the fixture says the machine cannot mount.
#define MOUNT_OR_SKIP(var, expr)                                      \
  auto var##_or = (expr);                                             \
  if (!var##_or.ok()) {                                               \
    if (absl::IsFailedPrecondition(var##_or.status())) {              \
      GTEST_SKIP() << var##_or.status();                              \
    }                                                                 \
    FAIL() << var##_or.status();                                      \
  }                                                                   \
  std::unique_ptr<LoopMount> var = std::move(*var##_or)

std::string RunCommand(const std::string& command) {
  std::string out;
  FILE* p = popen(command.c_str(), "r");
  if (p == nullptr) return out;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) out.append(buf, n);
  pclose(p);
  return out;
}

uint64_t Allocated(const std::string& path) {
  struct stat st;
  if (stat(path.c_str(), &st) != 0) return ~uint64_t{0};
  return st.st_blocks * 512;
}

std::vector<uint8_t> Pattern(uint64_t length, uint64_t seed) {
  std::vector<uint8_t> v(length);
  for (uint64_t i = 0; i < length; ++i) v[i] = static_cast<uint8_t>((i * 11 + seed * 29) | 1);
  return v;
}

std::vector<uint8_t> ReadWithPread(const std::string& path, uint64_t offset,
                                   uint64_t length) {
  std::vector<uint8_t> v(length);
  int fd = open(path.c_str(), O_RDONLY);
  ssize_t n = pread(fd, v.data(), length, offset);
  close(fd);
  v.resize(n < 0 ? 0 : n);
  return v;
}

// The helper binary sits next to this test in bazel-bin.
std::string HelperPath() {
  char buf[4096];
  ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n <= 0) return "posix_file/create_helper";
  std::string self(buf, n);
  return self.substr(0, self.rfind('/')) + "/create_helper";
}

class FileNodeFsTest : public ::testing::Test {
 protected:
  absl::Status Create(const std::string& path, uint64_t size,
                      const std::string& prealloc = "",
                      std::optional<uint64_t> hint = std::nullopt,
                      std::ostream* warnings = nullptr) {
    FileCreateOptions options;
    options.set_size(size);
    options.set_preallocation(prealloc);
    if (hint.has_value()) options.set_extent_size_hint(*hint);
    return CreateFile(path, options, warnings);
  }

  std::unique_ptr<FileNode> Open(const std::string& path,
                                 const std::string& cache = "",
                                 bool read_only = false) {
    FileOpenOptions options;
    options.set_filename(path);
    options.set_cache(cache);
    options.set_read_only(read_only);
    // Devices open with QEMU's host_device driver; `file` refuses them.
    if (absl::StartsWith(path, "/dev/")) options.set_driver("host_device");
    absl::StatusOr<std::unique_ptr<FileNode>> node =
        FileNode::Open(engine_, options, nullptr);
    EXPECT_TRUE(node.ok()) << node.status();
    return node.ok() ? std::move(*node) : nullptr;
  }

  template <typename T>
  T Run(io::Task<T> task) {
    return io::RunSync(engine_, std::move(task));
  }

  std::vector<uint8_t> NodeRead(FileNode& node, uint64_t offset,
                                uint64_t length) {
    std::vector<uint8_t> v(length, 0xee);
    absl::Status st = Run(node.Read(offset, io::IoVec(v.data(), v.size())));
    EXPECT_TRUE(st.ok()) << st;
    return v;
  }

  std::string MapJson(FileNode& node) {
    std::vector<std::string> lines;
    uint64_t start = 0, length = 0;
    bool data = false, zero = false;
    auto emit = [&] {
      lines.push_back(absl::StrFormat(
          "{ \"start\": %u, \"length\": %u, \"depth\": 0, \"present\": true, "
          "\"zero\": %s, \"data\": %s, \"offset\": %u}",
          start, length, zero ? "true" : "false", data ? "true" : "false",
          start));
    };
    for (uint64_t off = 0; off < node.size();) {
      absl::StatusOr<io::BlockStatus> st =
          Run(node.GetBlockStatus(off, node.size() - off));
      if (!st.ok()) return std::string(st.status().message());
      if (length > 0 && st->data == data && st->zero == zero) {
        length += st->length;
      } else {
        if (length > 0) emit();
        start = off;
        length = st->length;
        data = st->data;
        zero = st->zero;
      }
      off += st->length;
    }
    if (length > 0) emit();
    return absl::StrCat("[", absl::StrJoin(lines, ",\n"), "]\n");
  }

  io::ThreadPoolEngine engine_{4};
};

TEST_F(FileNodeFsTest, XfsExtentSizeHints) {
  MOUNT_OR_SKIP(mnt, LoopMount::Create(FsKind::kXfs));
  const std::string dflt = mnt->path() + "/default.raw";
  std::ostringstream warnings;
  ASSERT_TRUE(Create(dflt, 64 << 20, "", std::nullopt, &warnings).ok());
  {
    auto node = Open(dflt, "", true);
    ASSERT_NE(node, nullptr);
    EXPECT_EQ(node->ExtentSizeHint(), std::optional<uint64_t>(1048576));
  }
  EXPECT_EQ(RunCommand("xfs_io -c extsize " + dflt),
            "[1048576] " + dflt + "\n");
  // The 4 KiB first-block write allocates one hint-sized extent, exactly
  // as with qemu-img, and both map the same.
  const std::string theirs = mnt->path() + "/qemu.raw";
  RunCommand("qemu-img create -q -f raw " + theirs + " 64M");
  EXPECT_EQ(Allocated(dflt), 1u << 20);
  EXPECT_EQ(Allocated(dflt), Allocated(theirs));
  {
    auto node = Open(dflt, "", true);
    ASSERT_NE(node, nullptr);
    EXPECT_EQ(MapJson(*node),
              RunCommand("qemu-img map -f raw --output=json " + theirs));
  }

  const std::string none = mnt->path() + "/none.raw";
  ASSERT_TRUE(Create(none, 1 << 20, "", 0, &warnings).ok());
  EXPECT_EQ(Open(none, "", true)->ExtentSizeHint(), std::nullopt);
  EXPECT_EQ(RunCommand("xfs_io -c extsize " + none), "[0] " + none + "\n");

  const std::string four = mnt->path() + "/four.raw";
  ASSERT_TRUE(Create(four, 1 << 20, "", 4 << 20, &warnings).ok());
  EXPECT_EQ(Open(four, "", true)->ExtentSizeHint(),
            std::optional<uint64_t>(4194304));
  EXPECT_EQ(RunCommand("xfs_io -c extsize " + four),
            "[4194304] " + four + "\n");
  EXPECT_EQ(warnings.str(), "");

  // Not a multiple of the block size: a warning, the image is still made.
  const std::string odd = mnt->path() + "/odd.raw";
  ASSERT_TRUE(Create(odd, 1 << 20, "", 3000, &warnings).ok());
  EXPECT_EQ(warnings.str(), "Failed to set extent size hint: Invalid argument\n");
  EXPECT_EQ(Open(odd, "", true)->ExtentSizeHint(), std::nullopt);
}

TEST_F(FileNodeFsTest, XfsRecreateOverWrittenFileSetsTheHint) {
  MOUNT_OR_SKIP(mnt, LoopMount::Create(FsKind::kXfs));
  const std::string path = mnt->path() + "/old.raw";
  RunCommand("xfs_io -f -c 'pwrite 0 8m' -c fsync " + path + " >/dev/null");
  std::ostringstream warnings;
  ASSERT_TRUE(Create(path, 16 << 20, "", 2 << 20, &warnings).ok());
  EXPECT_EQ(warnings.str(), "");
  EXPECT_EQ(RunCommand("xfs_io -c extsize " + path),
            "[2097152] " + path + "\n");
  auto node = Open(path, "", true);
  ASSERT_NE(node, nullptr);
  EXPECT_EQ(node->ExtentSizeHint(), std::optional<uint64_t>(2 << 20));
  // qemu-img does the same: the written first block and the unwritten rest
  // of one hint-sized allocation.
  const std::string theirs = mnt->path() + "/qemu.raw";
  RunCommand("xfs_io -f -c 'pwrite 0 8m' -c fsync " + theirs + " >/dev/null");
  RunCommand("qemu-img create -q -f raw -o extent_size_hint=2M " + theirs +
             " 16M");
  auto extents = node->ExtentCount();
  ASSERT_TRUE(extents.ok()) << extents.status();
  auto their_extents = Open(theirs, "", true)->ExtentCount();
  ASSERT_TRUE(their_extents.ok());
  EXPECT_EQ(*extents, *their_extents);
  EXPECT_EQ(Allocated(path), 2u << 20);
  EXPECT_EQ(Allocated(path), Allocated(theirs));
}

TEST_F(FileNodeFsTest, Ext4TakesAHintSilently) {
  MOUNT_OR_SKIP(mnt, LoopMount::Create(FsKind::kExt4));
  const std::string path = mnt->path() + "/hint.raw";
  std::ostringstream warnings;
  ASSERT_TRUE(Create(path, 1 << 20, "", 2 << 20, &warnings).ok());
  EXPECT_EQ(warnings.str(), "");
  auto node = Open(path, "", true);
  ASSERT_NE(node, nullptr);
  EXPECT_EQ(node->ExtentSizeHint(), std::nullopt);
}

TEST_F(FileNodeFsTest, Ext4WithoutExtentsFallocWritesEachBlockOnceNoReads) {
  MOUNT_OR_SKIP(mnt, LoopMount::Create(FsKind::kExt4NoExtents));
  if (RunCommand("command -v strace").empty()) GTEST_SKIP() << "no strace";
  const std::string path = mnt->path() + "/falloc.raw";
  const uint64_t size = 8 << 20;
  const std::string trace = mnt->path() + "/trace.txt";
  // LeakSanitizer cannot run under ptrace (--config=asan): the helper
  // keeps ASan's other checks and skips only the leak check at exit.
  const std::string out = RunCommand(absl::StrCat(
      "ASAN_OPTIONS=${ASAN_OPTIONS:-}:detect_leaks=0 strace -f -y -o ", trace,
      " -e trace=read,pread64,preadv,preadv2,readv,write,pwrite64,pwritev,"
      "pwritev2,writev,fallocate,fcntl,ftruncate ",
      HelperPath(), " ", path, " ", size, " falloc 2>&1; echo rc=$?"));
  ASSERT_EQ(out, "rc=0\n");
  struct statfs fs;
  ASSERT_EQ(statfs(mnt->path().c_str(), &fs), 0);
  const uint64_t blocks = size / fs.f_bsize;

  std::ifstream in(trace);
  std::string line;
  int reads = 0, writes = 0, fallocates = 0;
  std::vector<std::string> locked_bytes, truncates;
  const std::string tag = "falloc.raw>";
  while (std::getline(in, line)) {
    if (!absl::StrContains(line, tag)) continue;
    // "<pid> <syscall>(<fd></path>>, ..."
    std::vector<std::string> words =
        absl::StrSplit(line, ' ', absl::SkipEmpty());
    std::string call;
    for (const std::string& w : words) {
      if (w.find('(') != std::string::npos) {
        call = w.substr(0, w.find('('));
        break;
      }
    }
    if (absl::StartsWith(call, "read") || absl::StartsWith(call, "pread")) {
      ++reads;
    } else if (absl::StartsWith(call, "write") ||
               absl::StartsWith(call, "pwrite")) {
      ++writes;
    } else if (call == "fallocate") {
      ++fallocates;
      EXPECT_THAT(line, ::testing::HasSubstr("EOPNOTSUPP"));
      // Nothing was truncated to the final size before it.
      EXPECT_EQ(truncates, std::vector<std::string>{"0)"});
    } else if (call == "ftruncate") {
      truncates.push_back(words[words.size() - 3]);
    } else if (call == "fcntl" && absl::StrContains(line, "F_OFD_SETLK")) {
      size_t at = line.find("l_start=");
      locked_bytes.push_back(
          line.substr(at + 8, line.find(',', at) - at - 8));
    }
  }
  // qemu-img create's locks: write + resize held, resize not shared.
  EXPECT_EQ(locked_bytes, (std::vector<std::string>{"101", "103", "203"}));
  EXPECT_EQ(reads, 0);
  EXPECT_EQ(fallocates, 1);
  EXPECT_GT(writes, 0);
  EXPECT_LE(static_cast<uint64_t>(writes), blocks);
  EXPECT_GE(Allocated(path), size);
  EXPECT_EQ(ReadWithPread(path, 0, size), std::vector<uint8_t>(size, 0));

  // Growing through a node uses the same code and the same fallback.
  auto node = Open(path);
  ASSERT_NE(node, nullptr);
  ASSERT_TRUE(Run(node->Truncate(12 << 20, io::PreallocMode::kFalloc)).ok());
  EXPECT_GE(Allocated(path), 12u << 20);
  // Without extents ext4 has no ZERO_RANGE and no allocating fallocate,
  // but punches holes: write zeroes and discard work through PUNCH_HOLE.
  const auto data = Pattern(65536, 1);
  ASSERT_TRUE(Run(node->Write(0, io::ConstIoVec(data.data(), data.size()))).ok());
  ASSERT_TRUE(Run(node->WriteZeroes(1000, 5000, {.no_fallback = true})).ok());
  ASSERT_TRUE(Run(node->Discard(32768, 16384)).ok());
  std::vector<uint8_t> expected = data;
  std::fill(expected.begin() + 1000, expected.begin() + 6000, 0);
  std::fill(expected.begin() + 32768, expected.begin() + 49152, 0);
  EXPECT_EQ(NodeRead(*node, 0, 65536), expected);
  auto st = Run(node->GetBlockStatus(32768, 1 << 20));
  ASSERT_TRUE(st.ok());
  EXPECT_FALSE(st->data);
  EXPECT_EQ(st->length, 16384u);
  // Zeroes that must be allocated (the preallocate filter's) cannot be:
  // kUnimplemented, and the file does not grow.
  EXPECT_EQ(Run(node->WriteZeroesAllocated(12 << 20, 1 << 20)).code(),
            absl::StatusCode::kUnimplemented);
  EXPECT_EQ(node->size(), 12u << 20);
  struct stat fst;
  ASSERT_EQ(stat(path.c_str(), &fst), 0);
  EXPECT_EQ(static_cast<uint64_t>(fst.st_size), 12u << 20);
  EXPECT_TRUE(Run(node->Close()).ok());
}

// A full filesystem and a too-large offset give clean errors that name the
// file (GCC 12 once destroyed the Status of a failed write twice here).
TEST_F(FileNodeFsTest, FullFilesystemFailsCleanly) {
  MOUNT_OR_SKIP(mnt, LoopMount::Create(FsKind::kExt4, 40 << 20));
  const std::string path = mnt->path() + "/full.raw";
  absl::Status st = Create(path, 100 << 20, "full");
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(st.message(), path + ": Could not write zeros for preallocation: "
                                 "No space left on device");
  EXPECT_EQ(access(path.c_str(), F_OK), -1);
  st = Create(path, 100 << 20, "falloc");
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(st.message(), path + ": Could not preallocate new data: No "
                                 "space left on device");
  EXPECT_EQ(access(path.c_str(), F_OK), -1);

  ASSERT_TRUE(Create(path, 100 << 20).ok());
  const std::vector<uint8_t> data(48 << 20, 0xab);
  for (const char* cache : {"writeback", "none"}) {
    SCOPED_TRACE(cache);
    auto node = Open(path, cache);
    ASSERT_NE(node, nullptr);
    st = Run(node->Write(0, io::ConstIoVec(data.data(), data.size())));
    EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted);
    EXPECT_EQ(st.message(), path + ": pwritev: No space left on device");
    // Beyond ext4's largest file (16 TiB with 4 KiB blocks).
    st = Run(node->Write(uint64_t{20} << 40,
                         io::ConstIoVec(data.data(), 4096)));
    EXPECT_EQ(st.code(), absl::StatusCode::kOutOfRange);
    EXPECT_EQ(st.message(), path + ": pwritev: File too large");
    EXPECT_EQ(node->size(), 100u << 20);
    // Only the data that fitted was written.
    (void)Run(node->Close());
  }
  // Preallocated growth of a node fails the same way and keeps the length.
  auto node = Open(path);
  ASSERT_NE(node, nullptr);
  st = Run(node->Truncate(200 << 20, io::PreallocMode::kFull));
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(st.message(), path + ": Could not write zeros for preallocation: "
                                 "No space left on device");
  EXPECT_EQ(node->size(), 100u << 20);
  struct stat stat_buf;
  ASSERT_EQ(stat(path.c_str(), &stat_buf), 0);
  EXPECT_EQ(stat_buf.st_size, 100 << 20);
  (void)Run(node->Close());
}

// QEMU asks XFS with XFS_IOC_DIOINFO: 512 on 512-byte sectors, whatever
// statx says (4096 on newer kernels), so 1 KiB-aligned writes go straight
// to the file without a read-modify-write.
TEST_F(FileNodeFsTest, XfsDirectIoAlignmentIsDioInfos) {
  MOUNT_OR_SKIP(mnt, LoopMount::Create(FsKind::kXfs));
  const std::string path = mnt->path() + "/direct.raw";
  ASSERT_TRUE(Create(path, 1 << 20).ok());
  auto node = Open(path, "none");
  ASSERT_NE(node, nullptr);
  EXPECT_EQ(node->request_alignment(), 512u);
  const auto a = Pattern(1024, 5);
  ASSERT_TRUE(Run(node->Write(1024, io::ConstIoVec(a.data(), a.size()))).ok());
  EXPECT_EQ(NodeRead(*node, 1024, 1024), a);
  EXPECT_TRUE(Run(node->Close()).ok());
}

TEST_F(FileNodeFsTest, DirectIoOnA4096ByteSectorFilesystem) {
  MOUNT_OR_SKIP(mnt, LoopMount::CreateWithSectorSize(FsKind::kXfs, 512 << 20,
                                                     4096));
  const std::string path = mnt->path() + "/direct.raw";
  ASSERT_TRUE(Create(path, 1 << 20).ok());
  auto node = Open(path, "none");
  ASSERT_NE(node, nullptr);
  EXPECT_EQ(node->request_alignment(), 4096u);
  const auto a = Pattern(512, 1);
  const auto b = Pattern(512, 2);
  ASSERT_TRUE(Run(node->Write(512, io::ConstIoVec(a.data(), 512))).ok());
  ASSERT_TRUE(Run(node->Write(4096 + 1536, io::ConstIoVec(b.data(), 512))).ok());
  EXPECT_EQ(NodeRead(*node, 512, 512), a);
  EXPECT_EQ(NodeRead(*node, 4096 + 1536, 512), b);
  EXPECT_EQ(NodeRead(*node, 0, 512), std::vector<uint8_t>(512, 0));
  ASSERT_TRUE(Run(node->Close()).ok());
  EXPECT_EQ(ReadWithPread(path, 512, 512), a);
  EXPECT_EQ(ReadWithPread(path, 4096 + 1536, 512), b);
}

// Growing ahead under O_DIRECT with 4 KiB alignment: the padding of an
// unaligned write at the end lands inside the grown length and is cut off
// at close, so the file ends where the data does.
TEST_F(FileNodeFsTest, GrowingAheadCutsDirectIoPaddingAtClose) {
  MOUNT_OR_SKIP(mnt, LoopMount::CreateWithSectorSize(FsKind::kXfs, 512 << 20,
                                                     4096));
  const std::string path = mnt->path() + "/ahead.qcow2";
  ASSERT_TRUE(Create(path, 0).ok());
  auto node = Open(path, "none");
  ASSERT_NE(node, nullptr);
  ASSERT_EQ(node->request_alignment(), 4096u);
  node->GrowLengthAhead(uint64_t{16} << 20);
  const auto a = Pattern(6000, 3);
  ASSERT_TRUE(Run(node->Write(100, io::ConstIoVec(a.data(), a.size()))).ok());
  EXPECT_EQ(node->size(), 6100u);
  struct stat st;
  ASSERT_EQ(stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_size, 17 << 20);
  const auto b = Pattern(3000, 4);
  ASSERT_TRUE(Run(node->Write(6100, io::ConstIoVec(b.data(), b.size()))).ok());
  EXPECT_EQ(NodeRead(*node, 100, a.size()), a);
  ASSERT_TRUE(Run(node->Close()).ok());
  ASSERT_EQ(stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_size, 9100);
  std::vector<uint8_t> expected(100, 0);
  expected.insert(expected.end(), a.begin(), a.end());
  expected.insert(expected.end(), b.begin(), b.end());
  EXPECT_EQ(ReadWithPread(path, 0, 20000), expected);
}

// Writes `path` with O_DIRECT until the filesystem has no block left: 1 MiB,
// 4 KiB, then 512-byte requests, each size until it fails (no speculative
// preallocation to give back later). Returns the bytes written.
uint64_t FillFilesystem(const std::string& path) {
  const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_DIRECT, 0644);
  if (fd < 0) return 0;
  void* buf = nullptr;
  if (posix_memalign(&buf, 4096, 1 << 20) != 0) return 0;
  std::memset(buf, 0x11, 1 << 20);
  uint64_t done = 0;
  for (size_t chunk : {size_t{1} << 20, size_t{4096}, size_t{512}}) {
    for (;;) {
      const ssize_t r = pwrite(fd, buf, chunk, static_cast<off_t>(done));
      if (r != static_cast<ssize_t>(chunk)) break;
      done += chunk;
    }
    done = static_cast<uint64_t>(lseek(fd, 0, SEEK_END)) / 512 * 512;
  }
  fsync(fd);
  close(fd);
  std::free(buf);
  return done;
}

// A write that fails for want of space leaves a grown-ahead file, once
// closed, as long as the data written before it: no hole after the data
// (the file was grown 64 MiB past it), no length up to the failed write's
// end, whether the write went through the page cache or O_DIRECT.
TEST_F(FileNodeFsTest, GrowingAheadOnAFullFilesystemLeavesTheDataLength) {
  for (FsKind kind : {FsKind::kExt4, FsKind::kXfs}) {
    SCOPED_TRACE(kind == FsKind::kXfs ? "xfs" : "ext4");
    MOUNT_OR_SKIP(mnt, LoopMount::Create(kind, kind == FsKind::kXfs
                                                   ? uint64_t{300} << 20
                                                   : uint64_t{40} << 20));
    for (const char* cache : {"writeback", "none"}) {
      SCOPED_TRACE(cache);
      const std::string path = mnt->path() + "/ahead.qcow2";
      const std::string filler = mnt->path() + "/filler";
      ASSERT_TRUE(Create(path, 0).ok());
      auto node = Open(path, cache);
      ASSERT_NE(node, nullptr);
      node->GrowLengthAhead(uint64_t{64} << 20);
      const auto head = Pattern(8192, 5);
      ASSERT_TRUE(
          Run(node->Write(0, io::ConstIoVec(head.data(), head.size()))).ok());
      struct stat st;
      ASSERT_EQ(stat(path.c_str(), &st), 0);
      EXPECT_EQ(st.st_size, 65 << 20);
      ASSERT_GT(FillFilesystem(filler), 0u);
      const std::vector<uint8_t> data(4 << 20, 0xab);
      absl::Status w =
          Run(node->Write(2 << 20, io::ConstIoVec(data.data(), data.size())));
      EXPECT_EQ(w.code(), absl::StatusCode::kResourceExhausted);
      EXPECT_EQ(w.message(), path + ": pwritev: No space left on device");
      EXPECT_EQ(node->size(), 8192u);
      EXPECT_EQ(NodeRead(*node, 0, head.size()), head);
      ASSERT_TRUE(Run(node->Close()).ok());
      ASSERT_EQ(stat(path.c_str(), &st), 0);
      EXPECT_EQ(st.st_size, 8192);
      EXPECT_EQ(ReadWithPread(path, 0, 1 << 20), head);
      ASSERT_EQ(unlink(path.c_str()), 0);
      ASSERT_EQ(unlink(filler.c_str()), 0);
      sync();
    }
  }
}

// A loop device with 4096-byte sectors, attached (not mounted) for the test.
class LoopDevice {
 public:
  static std::unique_ptr<LoopDevice> Attach(uint64_t size,
                                            int sector_size = 4096) {
    const char* tmp = getenv("TEST_TMPDIR");
    std::string backing = absl::StrCat(tmp ? tmp : "/tmp", "/loop4k.XXXXXX");
    int fd = mkstemp(backing.data());
    if (fd < 0) return nullptr;
    bool ok = ftruncate(fd, size) == 0;
    close(fd);
    std::string dev(absl::StripTrailingAsciiWhitespace(RunCommand(
        absl::StrCat("losetup --find --show --sector-size ", sector_size,
                     " ", backing, " 2>/dev/null"))));
    if (!ok || !absl::StartsWith(dev, "/dev/loop")) {
      unlink(backing.c_str());
      return nullptr;
    }
    return std::unique_ptr<LoopDevice>(new LoopDevice(backing, dev));
  }
  ~LoopDevice() {
    RunCommand("losetup -d " + device_);
    unlink(backing_.c_str());
  }
  const std::string& device() const { return device_; }
  const std::string& backing() const { return backing_; }

 private:
  LoopDevice(std::string backing, std::string device)
      : backing_(std::move(backing)), device_(std::move(device)) {}
  std::string backing_;
  std::string device_;
};

TEST_F(FileNodeFsTest, DirectIoOnA4096ByteSectorLoopDevice) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root";
  auto loop = LoopDevice::Attach(16 << 20);
  if (loop == nullptr) GTEST_SKIP() << "losetup --sector-size 4096 failed";
  auto node = Open(loop->device(), "none");
  ASSERT_NE(node, nullptr);
  EXPECT_EQ(node->request_alignment(), 4096u);
  EXPECT_EQ(node->size(), 16u << 20);
  const auto a = Pattern(512, 3);
  const auto b = Pattern(1000, 4);
  ASSERT_TRUE(Run(node->Write(512, io::ConstIoVec(a.data(), a.size()))).ok());
  ASSERT_TRUE(Run(node->Write(70000, io::ConstIoVec(b.data(), b.size()))).ok());
  EXPECT_EQ(NodeRead(*node, 512, 512), a);
  EXPECT_EQ(NodeRead(*node, 70000, 1000), b);
  EXPECT_EQ(NodeRead(*node, 1024, 512), std::vector<uint8_t>(512, 0));
  // Unaligned zeroes fall back to (bounced) zero writes.
  ASSERT_TRUE(Run(node->WriteZeroes(700, 100, {})).ok());
  std::vector<uint8_t> expected = a;
  std::fill(expected.begin() + 188, expected.begin() + 288, 0);
  EXPECT_EQ(NodeRead(*node, 512, 512), expected);
  // Aligned zeroes use fallocate on the device.
  ASSERT_TRUE(Run(node->WriteZeroes(65536, 8192, {})).ok());
  EXPECT_EQ(NodeRead(*node, 70000, 1000), std::vector<uint8_t>(1000, 0));
  // Devices cannot be resized.
  EXPECT_TRUE(Run(node->Truncate(16 << 20, io::PreallocMode::kOff)).ok());
  EXPECT_FALSE(Run(node->Truncate(32 << 20, io::PreallocMode::kOff)).ok());
  ASSERT_TRUE(Run(node->Flush()).ok());
  ASSERT_TRUE(Run(node->Close()).ok());
}

// XFS files may be up to 2^63 - 1 bytes long; QEMU (and so we) accept
// nodes up to 2^63 - 2^30 bytes, rounded up to 512.
TEST_F(FileNodeFsTest, HugeXfsFilesOpenUpToQemusLimit) {
  MOUNT_OR_SKIP(mnt, LoopMount::Create(FsKind::kXfs, 300 << 20));
  const uint64_t limit = (uint64_t{1} << 63) - (uint64_t{1} << 30);
  for (uint64_t length : {limit, limit - 511, limit + 1, limit + 512,
                          (uint64_t{1} << 63) - 1}) {
    SCOPED_TRACE(length);
    const std::string path = mnt->path() + "/huge.raw";
    int fd = open(path.c_str(), O_WRONLY | O_CREAT, 0644);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(ftruncate(fd, static_cast<off_t>(length)), 0) << strerror(errno);
    close(fd);
    for (bool read_only : {true, false}) {
      FileOpenOptions options;
      options.set_filename(path);
      options.set_read_only(read_only);
      absl::StatusOr<std::unique_ptr<FileNode>> node =
          FileNode::Open(engine_, options, nullptr);
      if (length <= limit) {
        ASSERT_TRUE(node.ok()) << node.status();
        EXPECT_EQ((*node)->size(), length);
        EXPECT_TRUE(Run((*node)->Close()).ok());
      } else {
        EXPECT_EQ(node.status().code(), absl::StatusCode::kOutOfRange);
        EXPECT_EQ(node.status().message(),
                  "Could not refresh total sector count: File too large");
      }
    }
  }
}

// The device's request limit (sysfs queue/max_sectors_kb) is what decides
// which O_DIRECT reads are marked may_block: here a loop device lowered to
// 256 KiB, opened with cache=none.
TEST_F(FileNodeFsTest, DirectIoRequestsTheDeviceSplitsAreMarkedMayBlock) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root";
  auto loop = LoopDevice::Attach(4 << 20, 512);
  if (loop == nullptr) GTEST_SKIP() << "losetup failed";
  const std::string limit = absl::StrCat(
      "/sys/block/", loop->device().substr(loop->device().rfind('/') + 1),
      "/queue/max_sectors_kb");
  // The limit outlives the loop device's detach: put the old one back.
  const std::string old_limit = RunCommand("cat " + limit);
  auto set_limit = [&limit](const std::string& kib) {
    std::ofstream out(limit);
    out << kib;
  };
  set_limit("256");
  absl::Cleanup restore = [&] { set_limit(old_limit); };
  ASSERT_EQ(RunCommand("cat " + limit), "256\n");
  testing::OpRecorder reads(engine_, io::OpKind::kRead);
  FileOpenOptions options;
  options.set_filename(loop->device());
  options.set_driver("host_device");
  options.set_cache("none");
  absl::StatusOr<std::unique_ptr<FileNode>> node =
      FileNode::Open(reads, options, nullptr);
  ASSERT_TRUE(node.ok()) << node.status();
  std::vector<uint8_t> buf(1 << 20);
  for (uint64_t length : {256 << 10, (256 << 10) + 512, 1 << 20}) {
    absl::Status st = io::RunSync(
        reads, (*node)->Read(0, io::IoVec(buf.data(), length)));
    ASSERT_TRUE(st.ok()) << st;
  }
  ASSERT_TRUE(io::RunSync(reads, (*node)->Close()).ok());
  using S = testing::OpRecorder::Seen;
  EXPECT_EQ(reads.Take(), (std::vector<S>{{0, 256 << 10, false},
                                          {0, (256 << 10) + 512, true},
                                          {0, 1 << 20, true}}));
}

// Create and resize on block and character devices, as qemu-img 7.2 does
// them: the length never changes, create may ask for less (and zeroes the
// first sector), resize only for the same length.
TEST_F(FileNodeFsTest, DevicesKeepTheirLength) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root";
  auto loop = LoopDevice::Attach(8 << 20, 512);
  if (loop == nullptr) GTEST_SKIP() << "losetup failed";
  const std::string dev = loop->device();
  auto fill = [&] {
    const std::vector<uint8_t> data(8192, 0xab);
    int fd = open(dev.c_str(), O_WRONLY);
    ASSERT_EQ(pwrite(fd, data.data(), data.size(), 0), 8192);
    close(fd);
  };
  std::vector<uint8_t> expected(8192, 0xab);
  std::fill(expected.begin(), expected.begin() + 512, 0);
  for (uint64_t size : {uint64_t{8} << 20, uint64_t{4} << 20, uint64_t{0}}) {
    SCOPED_TRACE(size);
    fill();
    absl::Status created = Create(dev, size);
    ASSERT_TRUE(created.ok()) << created;
    EXPECT_EQ(ReadWithPread(dev, 0, 8192), expected);
  }
  fill();
  absl::Status st = Create(dev, 16 << 20);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(st.message(), dev + ": Cannot grow device files");
  EXPECT_EQ(ReadWithPread(dev, 0, 8192), std::vector<uint8_t>(8192, 0xab));
  for (const char* mode : {"falloc", "full"}) {
    st = Create(dev, 8 << 20, mode);
    EXPECT_EQ(st.code(), absl::StatusCode::kUnimplemented);
    EXPECT_EQ(st.message(),
              absl::StrCat(dev, ": Unsupported preallocation mode '", mode,
                           "'"));
  }
  EXPECT_EQ(ReadWithPread(dev, 0, 8192), std::vector<uint8_t>(8192, 0xab));
  struct stat backing;
  ASSERT_EQ(stat(loop->backing().c_str(), &backing), 0);
  EXPECT_EQ(backing.st_size, 8 << 20);

  auto node = Open(dev);
  ASSERT_NE(node, nullptr);
  EXPECT_TRUE(Run(node->Truncate(8 << 20, io::PreallocMode::kOff)).ok());
  for (uint64_t size : {uint64_t{16} << 20, uint64_t{4} << 20}) {
    st = Run(node->Truncate(size, io::PreallocMode::kOff));
    EXPECT_EQ(st.code(), absl::StatusCode::kUnimplemented);
    EXPECT_EQ(st.message(), dev + ": Cannot resize device files");
  }
  st = Run(node->Truncate(16 << 20, io::PreallocMode::kFalloc));
  EXPECT_EQ(st.message(), dev + ": Preallocation mode 'falloc' unsupported "
                                "for this non-regular file");
  EXPECT_EQ(node->size(), 8u << 20);
  ASSERT_TRUE(Run(node->Close()).ok());

  // /dev/null is a character device of length 0.
  EXPECT_TRUE(Create("/dev/null", 0).ok());
  st = Create("/dev/null", 1 << 20);
  EXPECT_EQ(st.message(), "/dev/null: Cannot grow device files");
}

}  // namespace
}  // namespace imgtool::posix_file

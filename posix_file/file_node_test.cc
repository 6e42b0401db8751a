#include "posix_file/file_node.h"

#include <dirent.h>
#include <fcntl.h>
#include <linux/fs.h>
#include <sys/ioctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/xattr.h>
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "io/block_node.h"
#include "io/engine.h"
#include "io/thread_pool_engine.h"
#include "posix_file/file_options.pb.h"
#include "posix_file/testing/op_recorder.h"

namespace imgtool::posix_file {
namespace {

using ::testing::HasSubstr;

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

std::vector<uint8_t> Pattern(uint64_t length, uint64_t seed) {
  std::vector<uint8_t> v(length);
  for (uint64_t i = 0; i < length; ++i) v[i] = static_cast<uint8_t>((i * 7 + seed * 13 + i / 251) | 1);
  return v;
}

uint64_t FileLength(const std::string& path) {
  struct stat st;
  if (stat(path.c_str(), &st) != 0) return ~uint64_t{0};
  return st.st_size;
}

uint64_t FileAllocated(const std::string& path) {
  struct stat st;
  if (stat(path.c_str(), &st) != 0) return ~uint64_t{0};
  return st.st_blocks * 512;
}

std::vector<uint8_t> ReadWithPread(const std::string& path, uint64_t offset,
                                   uint64_t length) {
  std::vector<uint8_t> v(length, 0xee);
  int fd = open(path.c_str(), O_RDONLY);
  ssize_t n = pread(fd, v.data(), length, offset);
  close(fd);
  v.resize(n < 0 ? 0 : n);
  return v;
}

void WriteWithPwrite(const std::string& path, uint64_t offset,
                     const std::vector<uint8_t>& data) {
  int fd = open(path.c_str(), O_WRONLY | O_CREAT, 0644);
  ASSERT_EQ(pwrite(fd, data.data(), data.size(), offset),
            static_cast<ssize_t>(data.size()));
  close(fd);
}

// Byte offsets of the OFD locks held on `path` (from /proc/locks).
std::multiset<uint64_t> LockedBytes(const std::string& path) {
  struct stat st;
  std::multiset<uint64_t> bytes;
  if (stat(path.c_str(), &st) != 0) return bytes;
  std::ifstream in("/proc/locks");
  std::string line;
  // "1: OFDLCK ADVISORY  READ -1 fd:01:1234 100 100"
  const std::string suffix = absl::StrFormat(":%u", st.st_ino);
  while (std::getline(in, line)) {
    std::vector<std::string> f = absl::StrSplit(line, ' ', absl::SkipEmpty());
    if (f.size() < 8 || f[1] != "OFDLCK") continue;
    const std::string& id = f[5];
    if (id.size() < suffix.size() ||
        id.compare(id.size() - suffix.size(), suffix.size(), suffix) != 0) {
      continue;
    }
    // Adjacent bytes of one owner show as one range ("100 101").
    const uint64_t first = std::stoull(f[6]);
    const uint64_t last = f[7] == "EOF" ? first : std::stoull(f[7]);
    for (uint64_t b = first; b <= last; ++b) bytes.insert(b);
  }
  return bytes;
}

class FileNodeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // /var/tmp (a disk filesystem); the sandbox may make it read-only, then
    // $TEST_TMPDIR, which Bazel keeps on disk as well.
    for (std::string base : {std::string("/var/tmp"),
                             std::string(getenv("TEST_TMPDIR") ? getenv("TEST_TMPDIR") : "/tmp")}) {
      std::string tmpl = base + "/posix_file_test.XXXXXX";
      if (mkdtemp(tmpl.data()) != nullptr) {
        dir_ = tmpl;
        break;
      }
    }
    ASSERT_FALSE(dir_.empty());
  }
  void TearDown() override {
    RunCommand(absl::StrCat("chattr -R -i ", dir_, " 2>/dev/null; rm -rf ", dir_));
  }

  std::string Path(const std::string& name) const {
    return absl::StrCat(dir_, "/", name);
  }

  absl::Status Create(const std::string& path, uint64_t size,
                      const std::string& prealloc = "",
                      std::ostream* warnings = nullptr) {
    FileCreateOptions options;
    options.set_size(size);
    options.set_preallocation(prealloc);
    return CreateFile(path, options, warnings);
  }

  absl::StatusOr<std::unique_ptr<FileNode>> Open(
      const std::string& path, const std::string& cache = "",
      bool read_only = false, bool force_share = false,
      const std::string& locking = "") {
    FileOpenOptions options;
    options.set_filename(path);
    options.set_cache(cache);
    options.set_read_only(read_only);
    options.set_force_share(force_share);
    options.set_locking(locking);
    return FileNode::Open(engine_, options, &warnings_);
  }

    // An open with QEMU's `driver` (host_device, host_cdrom).
  absl::StatusOr<std::unique_ptr<FileNode>> OpenAs(const std::string& driver,
                                                   const std::string& path,
                                                   bool read_only) {
    FileOpenOptions options;
    options.set_filename(path);
    options.set_driver(driver);
    options.set_read_only(read_only);
    options.set_locking("off");
    return FileNode::Open(engine_, options, &warnings_);
  }

  // An open with share_all_with_others (QEMU's raw format).
  absl::StatusOr<std::unique_ptr<FileNode>> OpenSharingAll(
      const std::string& path, bool read_only = false) {
    FileOpenOptions options;
    options.set_filename(path);
    options.set_read_only(read_only);
    options.set_share_all_with_others(true);
    return FileNode::Open(engine_, options, &warnings_);
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

  absl::Status NodeWrite(FileNode& node, uint64_t offset,
                         const std::vector<uint8_t>& data) {
    return Run(node.Write(offset, io::ConstIoVec(data.data(), data.size())));
  }

  // The node's block status in `qemu-img map --output=json` layout.
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
      EXPECT_TRUE(st.ok()) << st.status();
      if (!st.ok()) break;
      EXPECT_TRUE(st->offset_valid);
      EXPECT_EQ(st->host_offset, off);
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

  std::string dir_;
  io::ThreadPoolEngine engine_{4};
  std::ostringstream warnings_;
};

TEST_F(FileNodeTest, CreateRoundsSizeUpTo512) {
  const std::string path = Path("a.raw");
  ASSERT_TRUE(Create(path, 1000).ok());
  EXPECT_EQ(FileLength(path), 1024u);
  auto node = Open(path);
  ASSERT_TRUE(node.ok()) << node.status();
  EXPECT_EQ((*node)->size(), 1024u);
  EXPECT_EQ(NodeRead(**node, 0, 1024), std::vector<uint8_t>(1024, 0));
  EXPECT_TRUE(Run((*node)->Close()).ok());
}

TEST_F(FileNodeTest, FreshFileHasOnlyTheFirstBlockLikeQemuImg) {
  const std::string path = Path("fresh.raw");
  std::ostringstream warnings;
  ASSERT_TRUE(Create(path, 1 << 20, "", &warnings).ok());
  EXPECT_EQ(warnings.str(), "");  // the default hint never warns
  EXPECT_EQ(FileLength(path), 1u << 20);
  auto node = Open(path, "", /*read_only=*/true);
  ASSERT_TRUE(node.ok()) << node.status();
  const std::string ours = MapJson(**node);
  EXPECT_EQ(ours,
            "[{ \"start\": 0, \"length\": 4096, \"depth\": 0, \"present\": "
            "true, \"zero\": false, \"data\": true, \"offset\": 0},\n"
            "{ \"start\": 4096, \"length\": 1044480, \"depth\": 0, "
            "\"present\": true, \"zero\": true, \"data\": false, \"offset\": "
            "4096}]\n");
  ASSERT_TRUE(Run((*node)->Close()).ok());
  EXPECT_EQ(ours, RunCommand(absl::StrCat(
                      "qemu-img map -f raw --output=json ", path)));
}

TEST_F(FileNodeTest, SmallFileGetsA512ByteFirstBlock) {
  const std::string path = Path("small.raw");
  ASSERT_TRUE(Create(path, 2048).ok());
  EXPECT_EQ(FileLength(path), 2048u);
  EXPECT_GT(FileAllocated(path), 0u);
  EXPECT_EQ(ReadWithPread(path, 0, 4096), std::vector<uint8_t>(2048, 0));
}

TEST_F(FileNodeTest, FallocAllocatesEveryBlock) {
  const std::string path = Path("falloc.raw");
  ASSERT_TRUE(Create(path, 4 << 20, "falloc").ok());
  EXPECT_EQ(FileLength(path), 4u << 20);
  EXPECT_GE(FileAllocated(path), 4u << 20);
  EXPECT_EQ(ReadWithPread(path, 0, 4 << 20), std::vector<uint8_t>(4 << 20, 0));
}

TEST_F(FileNodeTest, FullWritesZeroesEverywhere) {
  const std::string path = Path("full.raw");
  ASSERT_TRUE(Create(path, (3 << 20) + 512, "full").ok());
  EXPECT_EQ(FileLength(path), (3u << 20) + 512);
  EXPECT_GE(FileAllocated(path), 3u << 20);
  auto node = Open(path, "", true);
  ASSERT_TRUE(node.ok()) << node.status();
  auto st = Run((*node)->GetBlockStatus(0, (*node)->size()));
  ASSERT_TRUE(st.ok());
  EXPECT_TRUE(st->data);
  EXPECT_FALSE(st->zero);
  EXPECT_EQ(st->length, (3u << 20) + 512);
  EXPECT_EQ(NodeRead(**node, 0, (3 << 20) + 512),
            std::vector<uint8_t>((3 << 20) + 512, 0));
}

TEST_F(FileNodeTest, RecreateDiscardsOldContent) {
  const std::string path = Path("old.raw");
  WriteWithPwrite(path, 0, std::vector<uint8_t>(2 << 20, 0xab));
  ASSERT_TRUE(Create(path, 1 << 20).ok());
  EXPECT_EQ(FileLength(path), 1u << 20);
  EXPECT_LE(FileAllocated(path), 64u << 10);
  EXPECT_EQ(ReadWithPread(path, 0, 1 << 20), std::vector<uint8_t>(1 << 20, 0));
}

TEST_F(FileNodeTest, FailedCreateRemovesNewFileAndEmptiesOldOne) {
  const std::string path = Path("huge.raw");
  // Beyond ext4's maximum file size: ftruncate fails with EFBIG.
  absl::Status st = Create(path, uint64_t{1} << 62);
  EXPECT_FALSE(st.ok());
  EXPECT_THAT(std::string(st.message()), HasSubstr(path));
  EXPECT_EQ(access(path.c_str(), F_OK), -1);

  WriteWithPwrite(path, 0, std::vector<uint8_t>(8192, 0xab));
  EXPECT_FALSE(Create(path, uint64_t{1} << 62).ok());
  EXPECT_EQ(FileLength(path), 0u);
}

TEST_F(FileNodeTest, CreateInReadOnlyDirectoryFails) {
  std::string sub = Path("ro");
  ASSERT_EQ(mkdir(sub.c_str(), 0555), 0);
  if (geteuid() == 0) {
    // Root ignores mode bits; the immutable flag stops it, and where that
    // is not allowed (the sandbox), sysfs refuses new files.
    int fd = open(sub.c_str(), O_RDONLY | O_DIRECTORY);
    int flags = 0;
    bool immutable = fd >= 0 && ioctl(fd, FS_IOC_GETFLAGS, &flags) == 0 &&
                     (flags |= FS_IMMUTABLE_FL,
                      ioctl(fd, FS_IOC_SETFLAGS, &flags) == 0);
    if (fd >= 0) close(fd);
    if (!immutable) sub = "/sys";
  }
  const std::string path = sub + "/posix_file_test_x.raw";
  absl::Status st = Create(path, 1 << 20);
  EXPECT_FALSE(st.ok());
  EXPECT_THAT(std::string(st.message()),
              ::testing::StartsWith(path + ": Could not create: "));
  EXPECT_EQ(access(path.c_str(), F_OK), -1);
}

TEST_F(FileNodeTest, CreateRejectsBadOptions) {
  const std::string path = Path("bad.raw");
  FileCreateOptions options;
  options.set_size(1 << 20);
  options.set_extent_size_hint(5ull << 30);
  absl::Status st = CreateFile(path, options, nullptr);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(st.message(), path + ": Extent size hint is too large");
  EXPECT_EQ(access(path.c_str(), F_OK), -1);

  st = Create(path, 1 << 20, "metadata");
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(st.message(), path + ": Unsupported preallocation mode: metadata");
  st = Create(path, 1 << 20, "xx");
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(access(path.c_str(), F_OK), -1);
}

TEST_F(FileNodeTest, OpenRejectsBadOptions) {
  const std::string path = Path("a.raw");
  ASSERT_TRUE(Create(path, 4096).ok());
  EXPECT_EQ(Open(path, "bogus").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Open(path, "", false, false, "maybe").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Open(path, "", /*read_only=*/false, /*force_share=*/true).status(),
            absl::InvalidArgumentError(
                "force-share=on can only be used with read-only images"));
  // Directories: qemu-io and qemu-img's words for each mode.
  const std::string dir = Path("adir");
  ASSERT_EQ(mkdir(dir.c_str(), 0755), 0);
  auto ro_dir = Open(dir, "", /*read_only=*/true);
  EXPECT_EQ(ro_dir.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ro_dir.status().message(),
            "'file' driver requires '" + dir + "' to be a regular file");
  auto rw_dir = Open(dir);
  EXPECT_EQ(rw_dir.status().message(), dir + ": Could not open: Is a directory");
  // Character devices are for host_device, as in QEMU 7.2.
  for (bool read_only : {true, false}) {
    auto null_dev = Open("/dev/null", "", read_only, false, "off");
    EXPECT_EQ(null_dev.status(),
              absl::InvalidArgumentError(
                  "'file' driver requires '/dev/null' to be a regular file"));
  }
  auto missing = Open(Path("missing.raw"));
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(missing.status().message()),
              HasSubstr(Path("missing.raw")));
}

// host_device and host_cdrom: character and block devices only, checked
// after open(2) as QEMU does (a directory opened read-write fails there).
TEST_F(FileNodeTest, DeviceDriversTakeDevicesOnly) {
  const std::string dir = Path("ddir");
  ASSERT_EQ(mkdir(dir.c_str(), 0755), 0);
  const std::string file = Path("d.raw");
  ASSERT_TRUE(Create(file, 4096).ok());
  for (const std::string driver : {"host_device", "host_cdrom"}) {
    const std::string not_device = "' to be either a character or block device";
    EXPECT_EQ(OpenAs(driver, dir, true).status(),
              absl::InvalidArgumentError("'" + driver + "' driver requires '" +
                                         dir + not_device));
    EXPECT_EQ(OpenAs(driver, dir, false).status().message(),
              dir + ": Could not open: Is a directory");
    EXPECT_EQ(OpenAs(driver, file, false).status(),
              absl::InvalidArgumentError("'" + driver + "' driver requires '" +
                                         file + not_device));
    // /dev/null: length 0, opens either way.
    for (bool read_only : {true, false}) {
      auto node = OpenAs(driver, "/dev/null", read_only);
      ASSERT_TRUE(node.ok()) << node.status();
      EXPECT_EQ((*node)->size(), 0u);
      EXPECT_TRUE(io::RunSync(engine_, (*node)->Close()).ok());
    }
  }
  EXPECT_EQ(OpenAs("nbd", file, true).status(),
            absl::InvalidArgumentError("Unknown driver 'nbd'"));
}

TEST_F(FileNodeTest, WritesReadBackAndGrowTheNode) {
  const std::string path = Path("rw.raw");
  ASSERT_TRUE(Create(path, 1 << 20).ok());
  auto node = Open(path);
  ASSERT_TRUE(node.ok()) << node.status();
  FileNode& n = **node;
  const auto data = Pattern(100000, 1);
  ASSERT_TRUE(NodeWrite(n, 12345, data).ok());
  EXPECT_EQ(NodeRead(n, 12345, data.size()), data);
  // Past the end: the node grows to the end of the write.
  ASSERT_TRUE(NodeWrite(n, (1 << 20) + 10, data).ok());
  EXPECT_EQ(n.size(), (1u << 20) + 10 + data.size());
  EXPECT_EQ(NodeRead(n, (1 << 20) + 10, data.size()), data);
  EXPECT_EQ(NodeRead(n, 1 << 20, 10), std::vector<uint8_t>(10, 0));
  ASSERT_TRUE(Run(n.Flush()).ok());
  ASSERT_TRUE(Run(n.Close()).ok());
  EXPECT_EQ(FileLength(path), (1u << 20) + 10 + data.size());
  EXPECT_EQ(ReadWithPread(path, 12345, data.size()), data);
}

// Writes that may allocate are marked may_block: those ending past the
// length the node knows (also two in flight at once) and those into a hole
// the node made (a gap left by a write past the end, a truncate that grew
// the file, a discard) until written; other writes are not.
TEST_F(FileNodeTest, MarksWritesThatMayAllocateMayBlock) {
  using W = testing::OpRecorder::Seen;
  const std::string path = Path("may_block.raw");
  ASSERT_TRUE(Create(path, 64 << 10).ok());
  testing::OpRecorder recorder(engine_, io::OpKind::kWrite);
  FileOpenOptions options;
  options.set_filename(path);
  auto opened = FileNode::Open(recorder, options, &warnings_);
  ASSERT_TRUE(opened.ok()) << opened.status();
  FileNode& n = **opened;
  auto run = [&](io::Task<absl::Status> task) {
    return io::RunSync(recorder, std::move(task));
  };
  auto write = [&](uint64_t offset, uint64_t length) {
    const std::vector<uint8_t> data = Pattern(length, offset);
    return run(n.Write(offset, io::ConstIoVec(data.data(), length)));
  };
  ASSERT_TRUE(write(0, 4096).ok());
  ASSERT_TRUE(write(60 << 10, 4096).ok());  // ends at the end exactly
  ASSERT_TRUE(write(62 << 10, 4096).ok());  // ends 2 KiB past it
  ASSERT_TRUE(write(64 << 10, 2048).ok());  // inside the new length
  ASSERT_TRUE(write(1 << 20, 4096).ok());   // leaves a gap from 66 KiB
  ASSERT_TRUE(write(512 << 10, 4096).ok());  // into the gap
  ASSERT_TRUE(write(512 << 10, 4096).ok());  // now written
  ASSERT_TRUE(write(508 << 10, 8192).ok());  // half gap, half written
  EXPECT_EQ(recorder.Take(), (std::vector<W>{{0, 4096, false},
                                             {60 << 10, 4096, false},
                                             {62 << 10, 4096, true},
                                             {64 << 10, 2048, false},
                                             {1 << 20, 4096, true},
                                             {512 << 10, 4096, true},
                                             {512 << 10, 4096, false},
                                             {508 << 10, 8192, true}}));
  EXPECT_EQ(n.size(), (1u << 20) + 4096);

  // Both issued before either finishes: each may be the one that extends.
  const std::vector<uint8_t> a = Pattern(4096, 1), b = Pattern(4096, 2);
  int finished = 0;
  for (const auto* d : {&a, &b}) {
    const uint64_t offset = (d == &a ? 2u : 3u) << 20;
    io::Spawn(n.Write(offset, io::ConstIoVec(d->data(), 4096)),
              [&finished](absl::Status st) {
                EXPECT_TRUE(st.ok()) << st;
                ++finished;
              });
  }
  while (finished < 2) ASSERT_TRUE(engine_.Poll(/*wait=*/true).ok());
  ASSERT_TRUE(write((2 << 20) + 4096, 4096).ok());  // gap before 3 MiB
  ASSERT_TRUE(write(1 << 20, 4096).ok());            // written before
  EXPECT_EQ(recorder.Take(), (std::vector<W>{{2 << 20, 4096, true},
                                             {3 << 20, 4096, true},
                                             {(2 << 20) + 4096, 4096, true},
                                             {1 << 20, 4096, false}}));

  ASSERT_TRUE(run(n.Truncate(8192, io::PreallocMode::kOff)).ok());
  ASSERT_TRUE(write(8192, 4096).ok());
  ASSERT_TRUE(write(0, 8192).ok());
  ASSERT_TRUE(run(n.Truncate(64 << 10, io::PreallocMode::kOff)).ok());
  ASSERT_TRUE(write(16 << 10, 4096).ok());  // in what ftruncate added
  ASSERT_TRUE(write(16 << 10, 4096).ok());
  ASSERT_TRUE(write(8192, 4096).ok());      // below it
  ASSERT_TRUE(run(n.Discard(0, 8192)).ok());
  ASSERT_TRUE(write(4096, 4096).ok());      // discarded
  EXPECT_EQ(recorder.Take(),
            (std::vector<W>{{8192, 4096, true},
                            {0, 8192, false},
                            {16 << 10, 4096, true},
                            {16 << 10, 4096, false},
                            {8192, 4096, false},
                            {4096, 4096, true}}));
  ASSERT_TRUE(run(n.Close()).ok());
}

TEST_F(FileNodeTest, ReadsPastEndOfFileAreZero) {
  const std::string path = Path("eof.raw");
  WriteWithPwrite(path, 0, std::vector<uint8_t>(1000, 0x5a));
  for (const char* cache : {"writeback", "none"}) {
    auto node = Open(path, cache, true);
    ASSERT_TRUE(node.ok()) << node.status();
    std::vector<uint8_t> expected(1000 - 900, 0x5a);
    expected.resize(5000, 0);
    EXPECT_EQ(NodeRead(**node, 900, 5000), expected) << cache;
    EXPECT_EQ(NodeRead(**node, 8192, 4096), std::vector<uint8_t>(4096, 0))
        << cache;
  }
}

TEST_F(FileNodeTest, WriteZeroesAndDiscardReadAsZero) {
  const std::string path = Path("zero.raw");
  ASSERT_TRUE(Create(path, 1 << 20).ok());
  auto node = Open(path);
  ASSERT_TRUE(node.ok()) << node.status();
  FileNode& n = **node;
  const auto data = Pattern(1 << 20, 2);
  ASSERT_TRUE(NodeWrite(n, 0, data).ok());

  ASSERT_TRUE(Run(n.WriteZeroes(1000, 7000, {})).ok());
  ASSERT_TRUE(Run(n.WriteZeroes(65536, 65536, {.may_unmap = true})).ok());
  ASSERT_TRUE(Run(n.Discard(262144, 131072)).ok());
  std::vector<uint8_t> expected = data;
  std::fill(expected.begin() + 1000, expected.begin() + 8000, 0);
  std::fill(expected.begin() + 65536, expected.begin() + 131072, 0);
  std::fill(expected.begin() + 262144, expected.begin() + 393216, 0);
  EXPECT_EQ(NodeRead(n, 0, 1 << 20), expected);

  // The discarded and unmapped ranges are holes now.
  auto st = Run(n.GetBlockStatus(262144, 1 << 20));
  ASSERT_TRUE(st.ok());
  EXPECT_FALSE(st->data);
  EXPECT_TRUE(st->zero);
  EXPECT_EQ(st->length, 131072u);
  st = Run(n.GetBlockStatus(65536, 1 << 20));
  ASSERT_TRUE(st.ok());
  EXPECT_FALSE(st->data);
  EXPECT_EQ(st->length, 65536u);

  // Zeroes past the end grow the node.
  ASSERT_TRUE(Run(n.WriteZeroes(1 << 20, 8192, {})).ok());
  EXPECT_EQ(n.size(), (1u << 20) + 8192);
  ASSERT_TRUE(Run(n.Close()).ok());
  EXPECT_EQ(FileLength(path), (1u << 20) + 8192);
}

TEST_F(FileNodeTest, DirectIoBouncesUnalignedRequests) {
  const std::string path = Path("direct.raw");
  ASSERT_TRUE(Create(path, 1 << 20).ok());
  auto node = Open(path, "none");
  ASSERT_TRUE(node.ok()) << node.status();
  FileNode& n = **node;
  const uint64_t align = n.request_alignment();
  EXPECT_GE(align, 512u);
  EXPECT_EQ(align & (align - 1), 0u);

  // Unaligned offset, length and buffer address.
  const auto data = Pattern(10000, 3);
  std::vector<uint8_t> storage(data.size() + 1);
  std::memcpy(storage.data() + 1, data.data(), data.size());
  ASSERT_TRUE(Run(n.Write(777, io::ConstIoVec(storage.data() + 1,
                                                   data.size())))
                  .ok());
  // Aligned offset and length, misaligned buffer.
  const auto data2 = Pattern(8192, 4);
  std::memcpy(storage.data() + 1, data2.data(), data2.size());
  ASSERT_TRUE(Run(n.Write(65536, io::ConstIoVec(storage.data() + 1,
                                                     data2.size())))
                  .ok());
  // A large unaligned write crossing several bounce pieces.
  const auto data3 = Pattern(3 << 20, 5);
  ASSERT_TRUE(NodeWrite(n, 131072 + 3, data3).ok());
  EXPECT_EQ(n.size(), 131072u + 3 + (3 << 20));

  std::vector<uint8_t> back(data.size() + 1);
  ASSERT_TRUE(
      Run(n.Read(777, io::IoVec(back.data() + 1, data.size()))).ok());
  EXPECT_TRUE(std::equal(data.begin(), data.end(), back.begin() + 1));
  EXPECT_EQ(NodeRead(n, 65536, data2.size()), data2);
  EXPECT_EQ(NodeRead(n, 131072 + 3, data3.size()), data3);
  // Neighbouring bytes kept their zeroes.
  EXPECT_EQ(NodeRead(n, 0, 777), std::vector<uint8_t>(777, 0));
  EXPECT_EQ(NodeRead(n, 777 + data.size(), 100), std::vector<uint8_t>(100, 0));
  ASSERT_TRUE(Run(n.Close()).ok());
  EXPECT_EQ(FileLength(path), 131072u + 3 + (3 << 20));
  EXPECT_EQ(ReadWithPread(path, 777, data.size()), data);
  EXPECT_EQ(ReadWithPread(path, 131072 + 3, data3.size()), data3);
}

TEST_F(FileNodeTest, DirectIoKeepsUnalignedFileLength) {
  const std::string path = Path("odd.raw");
  WriteWithPwrite(path, 0, std::vector<uint8_t>(1000, 0x11));
  auto node = Open(path, "directsync");
  ASSERT_TRUE(node.ok()) << node.status();
  const auto data = Pattern(50, 6);
  ASSERT_TRUE(NodeWrite(**node, 990, data).ok());
  EXPECT_EQ((*node)->size(), 1040u);
  ASSERT_TRUE(Run((*node)->Close()).ok());
  EXPECT_EQ(FileLength(path), 1040u);
  std::vector<uint8_t> expected(990, 0x11);
  expected.insert(expected.end(), data.begin(), data.end());
  EXPECT_EQ(ReadWithPread(path, 0, 2000), expected);
}

TEST_F(FileNodeTest, ConcurrentUnalignedDirectWritesDoNotLoseData) {
  const std::string path = Path("concurrent.raw");
  ASSERT_TRUE(Create(path, 1 << 20).ok());
  auto node = Open(path, "none");
  ASSERT_TRUE(node.ok()) << node.status();
  FileNode& n = **node;
  // 64 writes of 100 bytes, all inside the first few blocks, in flight at
  // once: read-modify-write of shared blocks must not undo each other.
  constexpr int kWrites = 64;
  std::vector<std::vector<uint8_t>> data;
  for (int i = 0; i < kWrites; ++i) data.push_back(Pattern(100, 10 + i));
  int finished = 0;
  std::vector<absl::Status> results(kWrites);
  for (int i = 0; i < kWrites; ++i) {
    io::Spawn(n.Write(i * 100, io::ConstIoVec(data[i].data(), 100)),
              [&, i](absl::Status st) {
                results[i] = st;
                ++finished;
              });
  }
  while (finished < kWrites) ASSERT_TRUE(engine_.Poll(true).ok());
  for (const auto& st : results) EXPECT_TRUE(st.ok()) << st;
  std::vector<uint8_t> expected;
  for (const auto& d : data) expected.insert(expected.end(), d.begin(), d.end());
  EXPECT_EQ(NodeRead(n, 0, expected.size()), expected);
}

TEST_F(FileNodeTest, GrowingAheadKeepsTheLengthPastTheDataUntilClose) {
  constexpr uint64_t kMiB = uint64_t{1} << 20;
  const std::string path = Path("ahead.qcow2");
  ASSERT_TRUE(Create(path, 0).ok());
  auto node = Open(path);
  ASSERT_TRUE(node.ok()) << node.status();
  FileNode& n = **node;
  n.GrowLengthAhead(8 * kMiB);

  // A write past the end grows the file to 8 MiB past its end, rounded up
  // to 1 MiB; size() stays the end of the data.
  auto marked = [&] {
    char value[8];
    return getxattr(path.c_str(), kGrownAheadMarker, value, sizeof(value)) >= 0;
  };
  EXPECT_FALSE(marked());
  const auto a = Pattern(5000, 1);
  ASSERT_TRUE(NodeWrite(n, 3000, a).ok());
  EXPECT_EQ(n.size(), 8000u);
  EXPECT_EQ(FileLength(path), 9 * kMiB);
  EXPECT_EQ(FileAllocated(path), 8192u);  // the rest is a hole
  // Marked, so that a crash's hole tail is known to be ours.
  EXPECT_TRUE(marked());
  // Inside the grown length: no ftruncate, size() follows the data.
  const auto b = Pattern(4096, 2);
  ASSERT_TRUE(NodeWrite(n, 5 * kMiB, b).ok());
  EXPECT_EQ(n.size(), 5 * kMiB + 4096);
  EXPECT_EQ(FileLength(path), 9 * kMiB);
  // Past it again: grows from the new end.
  ASSERT_TRUE(NodeWrite(n, 9 * kMiB + 10, b).ok());
  EXPECT_EQ(n.size(), 9 * kMiB + 10 + 4096);
  EXPECT_EQ(FileLength(path), 18 * kMiB);
  // Block status ends at the data, as without growing ahead.
  absl::StatusOr<io::BlockStatus> st =
      Run(n.GetBlockStatus(6 * kMiB, n.size() - 6 * kMiB));
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_FALSE(st->data);
  EXPECT_EQ(st->length, 3 * kMiB);
  EXPECT_EQ(NodeRead(n, 3000, a.size()), a);
  EXPECT_EQ(NodeRead(n, 9 * kMiB + 10, b.size()), b);

  ASSERT_TRUE(Run(n.Close()).ok());
  EXPECT_EQ(FileLength(path), 9 * kMiB + 10 + 4096);
  EXPECT_EQ(ReadWithPread(path, 5 * kMiB, b.size()), b);
  EXPECT_FALSE(marked());
}

TEST_F(FileNodeTest, AdoptedHoleTailIsCutAtCloseNeverBelowData) {
  constexpr uint64_t kMiB = uint64_t{1} << 20;
  const std::string path = Path("killed.qcow2");
  ASSERT_TRUE(Create(path, 0).ok());
  // What a writer killed while growing ahead leaves: data, then a hole,
  // and the marker.
  auto killed = [&] {
    WriteWithPwrite(path, 0, Pattern(8192, 1));
    WriteWithPwrite(path, kMiB, Pattern(4096, 2));
    ASSERT_EQ(truncate(path.c_str(), 9 * kMiB), 0);
    ASSERT_EQ(setxattr(path.c_str(), kGrownAheadMarker, "1", 1, 0), 0);
  };
  auto marked = [&] {
    char value[8];
    return getxattr(path.c_str(), kGrownAheadMarker, value, sizeof(value)) >= 0;
  };
  killed();

  // Not growing ahead: nothing.
  auto node = Open(path);
  ASSERT_TRUE(node.ok()) << node.status();
  (*node)->AdoptHoleTail(8192);
  EXPECT_EQ((*node)->size(), 9 * kMiB);
  ASSERT_TRUE(Run((*node)->Close()).ok());
  EXPECT_EQ(FileLength(path), 9 * kMiB);
  EXPECT_TRUE(marked());

  // Without the marker the tail is another program's (QEMU keeps the
  // discarded last clusters of a qcow2 image as holes): it stays.
  ASSERT_EQ(removexattr(path.c_str(), kGrownAheadMarker), 0);
  node = Open(path);
  ASSERT_TRUE(node.ok()) << node.status();
  (*node)->GrowLengthAhead(64 * kMiB);
  (*node)->AdoptHoleTail(8192);
  EXPECT_EQ((*node)->size(), 9 * kMiB);
  ASSERT_TRUE(Run((*node)->Close()).ok());
  EXPECT_EQ(FileLength(path), 9 * kMiB);
  EXPECT_FALSE(marked());
  killed();

  // Data past `used_end` stays: cut after it. A preallocating truncate to
  // less than the 9 MiB QEMU sees fails as QEMU's does.
  node = Open(path);
  ASSERT_TRUE(node.ok()) << node.status();
  (*node)->GrowLengthAhead(64 * kMiB);
  (*node)->AdoptHoleTail(8192);
  EXPECT_EQ((*node)->size(), kMiB + 4096);
  EXPECT_EQ(FileLength(path), 9 * kMiB);
  absl::Status st =
      Run((*node)->Truncate(2 * kMiB, io::PreallocMode::kFalloc));
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(st.message(),
            path + ": Cannot use preallocation for shrinking files");
  ASSERT_TRUE(Run((*node)->Close()).ok());
  EXPECT_EQ(FileLength(path), kMiB + 4096);
  EXPECT_EQ(ReadWithPread(path, kMiB, 4096), Pattern(4096, 2));
  EXPECT_FALSE(marked());  // cut back: the next open takes nothing

  // `used_end` past the data: cut there. Preallocating past the old length
  // works and is exact.
  killed();
  node = Open(path);
  ASSERT_TRUE(node.ok()) << node.status();
  (*node)->GrowLengthAhead(64 * kMiB);
  (*node)->AdoptHoleTail(2 * kMiB);
  EXPECT_EQ((*node)->size(), 2 * kMiB);
  ASSERT_TRUE(
      Run((*node)->Truncate(12 * kMiB, io::PreallocMode::kFalloc)).ok());
  EXPECT_EQ(FileLength(path), 12 * kMiB);
  ASSERT_TRUE(Run((*node)->Close()).ok());
  EXPECT_EQ(FileLength(path), 12 * kMiB);

  // `used_end` at the end of the file: nothing to take.
  killed();
  node = Open(path);
  ASSERT_TRUE(node.ok()) << node.status();
  (*node)->GrowLengthAhead(64 * kMiB);
  (*node)->AdoptHoleTail(9 * kMiB);
  EXPECT_EQ((*node)->size(), 9 * kMiB);
  ASSERT_TRUE(Run((*node)->Close()).ok());
  EXPECT_EQ(FileLength(path), 9 * kMiB);
}

TEST_F(FileNodeTest, TruncateAfterGrowingAheadIsExact) {
  constexpr uint64_t kMiB = uint64_t{1} << 20;
  const std::string path = Path("ahead-truncate.qcow2");
  ASSERT_TRUE(Create(path, 0).ok());
  auto node = Open(path);
  ASSERT_TRUE(node.ok()) << node.status();
  FileNode& n = **node;
  n.GrowLengthAhead(4 * kMiB);
  ASSERT_TRUE(NodeWrite(n, 0, Pattern(4096, 3)).ok());
  EXPECT_EQ(FileLength(path), 5 * kMiB);

  // Each mode starts from the end of the data and ends exactly at the new
  // length, also full preallocation, whose zero writes go past the end.
  ASSERT_TRUE(Run(n.Truncate(2 * kMiB + 512, io::PreallocMode::kFull)).ok());
  EXPECT_EQ(n.size(), 2 * kMiB + 512);
  EXPECT_EQ(FileLength(path), 2 * kMiB + 512);
  EXPECT_GE(FileAllocated(path), 2 * kMiB + 512);
  ASSERT_TRUE(NodeWrite(n, 3 * kMiB, Pattern(512, 4)).ok());
  EXPECT_EQ(FileLength(path), 8 * kMiB);
  ASSERT_TRUE(Run(n.Truncate(3 * kMiB + 1024, io::PreallocMode::kFalloc)).ok());
  EXPECT_EQ(FileLength(path), 3 * kMiB + 1024);
  ASSERT_TRUE(NodeWrite(n, 3 * kMiB + 1024, Pattern(512, 5)).ok());
  ASSERT_TRUE(Run(n.Truncate(4096, io::PreallocMode::kOff)).ok());
  EXPECT_EQ(n.size(), 4096u);
  EXPECT_EQ(FileLength(path), 4096u);
  ASSERT_TRUE(Run(n.Close()).ok());
  EXPECT_EQ(FileLength(path), 4096u);
  EXPECT_EQ(ReadWithPread(path, 0, 8192), Pattern(4096, 3));
}

// A Truncate that starts while a write into the grown-ahead length is in
// flight must not cut that write's data off when it cuts the file back.
TEST_F(FileNodeTest, TruncateDuringAWriteAfterTheDataKeepsTheWrite) {
  constexpr uint64_t kMiB = uint64_t{1} << 20;
  const std::string path = Path("ahead-race.qcow2");
  ASSERT_TRUE(Create(path, 0).ok());
  auto node = Open(path);
  ASSERT_TRUE(node.ok()) << node.status();
  FileNode& n = **node;
  n.GrowLengthAhead(8 * kMiB);
  ASSERT_TRUE(NodeWrite(n, 0, Pattern(4096, 1)).ok());
  ASSERT_EQ(FileLength(path), 9 * kMiB);
  const auto data = Pattern(kMiB, 2);
  int finished = 0;
  absl::Status wrote, truncated;
  io::Spawn(n.Write(kMiB, io::ConstIoVec(data.data(), data.size())),
            [&](absl::Status st) {
              wrote = st;
              ++finished;
            });
  // The pool thread writes now; the node hears of it only at the next Poll.
  usleep(100 * 1000);
  io::Spawn(n.Truncate(4 * kMiB, io::PreallocMode::kOff),
            [&](absl::Status st) {
              truncated = st;
              ++finished;
            });
  while (finished < 2) ASSERT_TRUE(engine_.Poll(true).ok());
  ASSERT_TRUE(wrote.ok()) << wrote;
  ASSERT_TRUE(truncated.ok()) << truncated;
  EXPECT_EQ(NodeRead(n, kMiB, data.size()), data);
  ASSERT_TRUE(Run(n.Close()).ok());
  EXPECT_EQ(FileLength(path), 4 * kMiB);
  EXPECT_EQ(ReadWithPread(path, kMiB, data.size()), data);
}

// A node dropped without Close (e.g. a qcow2 open failing after it wrote)
// leaves no grown length behind either.
TEST_F(FileNodeTest, GrowingAheadIsCutBackWithoutClose) {
  const std::string path = Path("dropped.qcow2");
  ASSERT_TRUE(Create(path, 0).ok());
  {
    auto node = Open(path);
    ASSERT_TRUE(node.ok()) << node.status();
    (*node)->GrowLengthAhead(uint64_t{8} << 20);
    ASSERT_TRUE(NodeWrite(**node, 0, Pattern(5000, 9)).ok());
    EXPECT_EQ(FileLength(path), 9u << 20);
  }
  EXPECT_EQ(FileLength(path), 5000u);
  EXPECT_EQ(ReadWithPread(path, 0, 8192), Pattern(5000, 9));
}

TEST_F(FileNodeTest, GrowingAheadNeedsAnOwnedWritableFile) {
  const std::string path = Path("shared.raw");
  ASSERT_TRUE(Create(path, 0).ok());
  // Others may write and resize: the length is not this node's to grow.
  auto shared = OpenSharingAll(path);
  ASSERT_TRUE(shared.ok()) << shared.status();
  (*shared)->GrowLengthAhead(uint64_t{8} << 20);
  ASSERT_TRUE(NodeWrite(**shared, 0, Pattern(4096, 6)).ok());
  EXPECT_EQ(FileLength(path), 4096u);
  ASSERT_TRUE(Run((*shared)->Close()).ok());
  // Read-only: nothing to grow, and closing must not cut anything.
  WriteWithPwrite(path, 10000, Pattern(100, 7));
  auto ro = Open(path, "", /*read_only=*/true);
  ASSERT_TRUE(ro.ok()) << ro.status();
  (*ro)->GrowLengthAhead(uint64_t{8} << 20);
  ASSERT_TRUE(Run((*ro)->Close()).ok());
  EXPECT_EQ(FileLength(path), 10100u);
}

TEST_F(FileNodeTest, GrowingAheadStaysWithinTheFileSizeLimit) {
  // ftruncate past RLIMIT_FSIZE (`ulimit -f`) raises SIGXFSZ, which kills
  // the process: growing ahead must stop at the limit where the writes
  // themselves fit under it (qemu-io writes them). In a forked child, as
  // the limit and the signal are process-wide; with an engine of its own,
  // as the fixture's threads are not forked.
  constexpr uint64_t kMiB = uint64_t{1} << 20;
  const std::string path = Path("limited.qcow2");
  ASSERT_TRUE(Create(path, 0).ok());
  // The child's exit code says which step failed.
  auto child = [&]() -> int {
    const struct rlimit limit = {8 * kMiB, RLIM_INFINITY};
    if (setrlimit(RLIMIT_FSIZE, &limit) != 0) return 2;
    io::ThreadPoolEngine engine(1);
    FileOpenOptions options;
    options.set_filename(path);
    auto node = FileNode::Open(engine, options, &warnings_);
    if (!node.ok()) return 3;
    FileNode& n = **node;
    n.GrowLengthAhead(64 * kMiB);
    auto write = [&](uint64_t offset, const std::vector<uint8_t>& data) {
      return io::RunSync(
          engine, n.Write(offset, io::ConstIoVec(data.data(), data.size())));
    };
    std::vector<uint64_t> got;
    // Grown to the limit (not to 65 MiB), then a write inside it.
    if (!write(0, Pattern(4096, 1)).ok()) return 4;
    got.push_back(FileLength(path));
    if (!write(7 * kMiB, Pattern(kMiB, 2)).ok()) return 5;
    got.push_back(FileLength(path));
    got.push_back(n.size());
    if (!io::RunSync(engine, n.Close()).ok()) return 6;
    got.push_back(FileLength(path));
    const std::vector<uint64_t> want = {8 * kMiB, 8 * kMiB, 8 * kMiB, 8 * kMiB};
    if (got != want) {
      std::fprintf(stderr, "lengths %s\n", absl::StrJoin(got, " ").c_str());
      return 7;
    }
    return 0;
  };
  EXPECT_EXIT(std::_Exit(child()), ::testing::ExitedWithCode(0), "");
  EXPECT_EQ(FileLength(path), 8 * kMiB);
  EXPECT_EQ(ReadWithPread(path, 7 * kMiB, kMiB), Pattern(kMiB, 2));
}

TEST_F(FileNodeTest, FailedWritesLeaveTheLengthOfAFileNotGrownAhead) {
  // A failed write past the data is not in flight: at close a grown-ahead
  // file is cut back to what its writes reached, as long as the same file
  // without growing ahead (and as QEMU leaves it): 2 MiB, where a 2 MiB
  // write at 1 MiB stopped at a 2 MiB file size limit (a short write, then
  // EFBIG), and a write at 4 MiB failed at once. Forked: the limit and
  // SIGXFSZ (ignored, so that the writes fail with EFBIG) are process-wide.
  constexpr uint64_t kMiB = uint64_t{1} << 20;
  const std::string grown = Path("failed-grown.qcow2");
  const std::string plain = Path("failed-plain.qcow2");
  ASSERT_TRUE(Create(grown, 0).ok());
  ASSERT_TRUE(Create(plain, 0).ok());
  auto child = [&]() -> int {
    io::ThreadPoolEngine engine(1);
    std::vector<uint64_t> got;
    for (const std::string& path : {grown, plain}) {
      const struct rlimit unlimited = {RLIM_INFINITY, RLIM_INFINITY};
      if (setrlimit(RLIMIT_FSIZE, &unlimited) != 0) return 2;
      FileOpenOptions options;
      options.set_filename(path);
      auto node = FileNode::Open(engine, options, &warnings_);
      if (!node.ok()) return 3;
      FileNode& n = **node;
      if (path == grown) n.GrowLengthAhead(8 * kMiB);
      auto write = [&](uint64_t offset, const std::vector<uint8_t>& data) {
        return io::RunSync(
            engine, n.Write(offset, io::ConstIoVec(data.data(), data.size())));
      };
      if (!write(0, Pattern(4096, 1)).ok()) return 4;
      if (signal(SIGXFSZ, SIG_IGN) == SIG_ERR) return 5;
      const struct rlimit limit = {2 * kMiB, RLIM_INFINITY};
      if (setrlimit(RLIMIT_FSIZE, &limit) != 0) return 6;
      if (write(kMiB, Pattern(2 * kMiB, 2)).ok()) return 7;
      if (write(4 * kMiB, Pattern(4096, 3)).ok()) return 8;
      got.push_back(n.size());
      if (!io::RunSync(engine, n.Close()).ok()) return 9;
      got.push_back(FileLength(path));
    }
    const std::vector<uint64_t> want = {4096, 2 * kMiB, 4096, 2 * kMiB};
    if (got != want) {
      std::fprintf(stderr, "sizes and lengths %s\n",
                   absl::StrJoin(got, " ").c_str());
      return 10;
    }
    return 0;
  };
  EXPECT_EXIT(std::_Exit(child()), ::testing::ExitedWithCode(0), "");
  EXPECT_EQ(FileLength(grown), 2 * kMiB);
  std::vector<uint8_t> reached = Pattern(2 * kMiB, 2);
  reached.resize(kMiB);
  EXPECT_EQ(ReadWithPread(grown, kMiB, kMiB), reached);
}

TEST_F(FileNodeTest, OfdLocksMatchQemu) {
  const std::string path = Path("locks.raw");
  ASSERT_TRUE(Create(path, 1 << 20).ok());
  EXPECT_TRUE(LockedBytes(path).empty());
  {
    auto rw = Open(path);
    ASSERT_TRUE(rw.ok()) << rw.status();
    EXPECT_EQ(LockedBytes(path),
              (std::multiset<uint64_t>{100, 101, 103, 201, 203}));

    auto rw2 = Open(path);
    EXPECT_EQ(rw2.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_EQ(rw2.status().message(),
              "Failed to get \"write\" lock\nIs another process using the "
              "image [" + path + "]?");
    auto ro = Open(path, "", /*read_only=*/true);
    EXPECT_EQ(ro.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_EQ(ro.status().message(),
              "Failed to get shared \"write\" lock\nIs another process using "
              "the image [" + path + "]?");
    auto shared = Open(path, "", true, /*force_share=*/true);
    ASSERT_TRUE(shared.ok()) << shared.status();
    auto unlocked = Open(path, "", false, false, "off");
    ASSERT_TRUE(unlocked.ok()) << unlocked.status();
    EXPECT_EQ(LockedBytes(path),
              (std::multiset<uint64_t>{100, 100, 101, 103, 201, 203}));
    // A create over an image in use fails and leaves it alone.
    absl::Status st = Create(path, 4096);
    EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_EQ(FileLength(path), 1u << 20);
    ASSERT_TRUE(Run((*rw)->Close()).ok());
    EXPECT_EQ(LockedBytes(path), (std::multiset<uint64_t>{100}));
  }
  {
    auto ro = Open(path, "", true);
    ASSERT_TRUE(ro.ok()) << ro.status();
    EXPECT_EQ(LockedBytes(path), (std::multiset<uint64_t>{100, 201, 203}));
    auto ro2 = Open(path, "", true);
    ASSERT_TRUE(ro2.ok()) << ro2.status();
    auto rw = Open(path);
    EXPECT_EQ(rw.status().message(),
              "Failed to get \"write\" lock\nIs another process using the "
              "image [" + path + "]?");
  }
  EXPECT_TRUE(LockedBytes(path).empty());
  // The locks conflict with qemu-io's, too.
  auto rw = Open(path);
  ASSERT_TRUE(rw.ok());
  EXPECT_THAT(RunCommand(absl::StrCat("qemu-io -f raw -c 'read 0 512' ", path,
                                      " 2>&1")),
              HasSubstr("Failed to get \"write\" lock"));
}

// The fd in this process that is open on `path` (-1 if none or several).
int FdOpenOn(const std::string& path) {
  int found = -1;
  DIR* dir = opendir("/proc/self/fd");
  if (dir == nullptr) return -1;
  const int dir_fd = dirfd(dir);
  while (struct dirent* e = readdir(dir)) {
    const int fd = atoi(e->d_name);
    if (e->d_name[0] == '.' || fd == dir_fd) continue;
    char target[4096];
    ssize_t n = readlinkat(dir_fd, e->d_name, target, sizeof(target) - 1);
    if (n <= 0) continue;
    target[n] = '\0';
    if (path == target) found = found == -1 ? fd : -2;
  }
  closedir(dir);
  return found < 0 ? -1 : found;
}

// Close drops the locks even while something else still holds a reference
// to the node's open file description, as an io_uring worker does for a
// moment after it posted its last completion: the reopen right after (a
// qcow2 convert's create, then its copy) failed with "Failed to get
// \"write\" lock" once in CI and 1 in 4,500 runs here. dup(2) holds the
// reference here.
TEST_F(FileNodeTest, CloseDropsTheLocksWhileTheFileIsStillReferenced) {
  const std::string path = Path("held.raw");
  ASSERT_TRUE(Create(path, 1 << 20).ok());
  auto rw = Open(path);
  ASSERT_TRUE(rw.ok()) << rw.status();
  const int fd = FdOpenOn(path);
  ASSERT_GE(fd, 0);
  const int reference = dup(fd);
  ASSERT_GE(reference, 0);
  ASSERT_TRUE(Run((*rw)->Close()).ok());
  EXPECT_TRUE(LockedBytes(path).empty());
  auto again = Open(path);
  EXPECT_TRUE(again.ok()) << again.status();
  if (again.ok()) {
    EXPECT_TRUE(Run((*again)->Close()).ok());
  }
  close(reference);
  // The same for a node dropped without Close.
  auto dropped = Open(path);
  ASSERT_TRUE(dropped.ok()) << dropped.status();
  const int reference2 = dup(FdOpenOn(path));
  ASSERT_GE(reference2, 0);
  dropped->reset();
  auto third = Open(path);
  EXPECT_TRUE(third.ok()) << third.status();
  close(reference2);
}

// A create that cannot take the locks never removes the file: another
// process opened it (here: a node in this process, which has its own open
// file description) and owns it now.
TEST_F(FileNodeTest, LostCreateRaceLeavesTheFileAlone) {
  const std::string old_path = Path("old.raw");
  ASSERT_TRUE(Create(old_path, 1 << 20).ok());
  auto holder = Open(old_path);
  ASSERT_TRUE(holder.ok()) << holder.status();
  absl::Status st = Create(old_path, 4096);
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(FileLength(old_path), 1u << 20);
  ASSERT_TRUE(Run((*holder)->Close()).ok());

  // The file did not exist: CreateFile made it, but the other process
  // opened it and took the locks before CreateFile could.
  const std::string new_path = Path("new.raw");
  std::unique_ptr<FileNode> winner;
  internal::SetBeforeCreateLockHookForTesting([&](const std::string& path) {
    auto node = Open(path);
    ASSERT_TRUE(node.ok()) << node.status();
    const std::vector<uint8_t> data(512, 0x5a);
    ASSERT_TRUE(NodeWrite(**node, 0, data).ok());
    winner = std::move(*node);
  });
  st = Create(new_path, 1 << 20);
  internal::SetBeforeCreateLockHookForTesting(nullptr);
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(st.message(),
            "Failed to get \"write\" lock\nIs another process using the "
            "image [" + new_path + "]?");
  ASSERT_NE(winner, nullptr);
  EXPECT_EQ(access(new_path.c_str(), F_OK), 0);
  EXPECT_EQ(ReadWithPread(new_path, 0, 512), std::vector<uint8_t>(512, 0x5a));
  ASSERT_TRUE(Run(winner->Close()).ok());

  // Once the locks are held, a failing create still removes its new file.
  const std::string huge = Path("huge.raw");
  EXPECT_FALSE(Create(huge, uint64_t{1} << 62).ok());
  EXPECT_EQ(access(huge.c_str(), F_OK), -1);
}

// share_all_with_others gives the locks of qemu-io -f raw: 100 and 101
// read-write (103 once it truncates), 100 read-only, nothing denied.
TEST_F(FileNodeTest, SharingAllLocksLikeQemuRaw) {
  const std::string path = Path("raw.raw");
  ASSERT_TRUE(Create(path, 1 << 20).ok());
  {
    auto rw = OpenSharingAll(path);
    ASSERT_TRUE(rw.ok()) << rw.status();
    EXPECT_EQ(LockedBytes(path), (std::multiset<uint64_t>{100, 101}));
    // Other writers and resizers are welcome, qemu's and ours.
    EXPECT_EQ(RunCommand(absl::StrCat("qemu-io -f raw -c 'write -P 0x33 0 512' ",
                                      path, " 2>&1 | head -1")),
              "wrote 512/512 bytes at offset 0\n");
    EXPECT_EQ(RunCommand(absl::StrCat("qemu-img resize -f raw ", path,
                                      " 2M 2>&1")),
              "Image resized.\n");
    auto rw2 = OpenSharingAll(path);
    ASSERT_TRUE(rw2.ok()) << rw2.status();
    auto ro = OpenSharingAll(path, /*read_only=*/true);
    ASSERT_TRUE(ro.ok()) << ro.status();
    EXPECT_EQ(LockedBytes(path),
              (std::multiset<uint64_t>{100, 100, 100, 101, 101}));
    // A format driver's open denies write, so it cannot join.
    auto strict = Open(path);
    EXPECT_EQ(strict.status().message(),
              "Failed to get shared \"write\" lock\nIs another process using "
              "the image [" + path + "]?");
    auto strict_ro = Open(path, "", /*read_only=*/true);
    EXPECT_EQ(strict_ro.status().message(), strict.status().message());
    ASSERT_TRUE(Run((*rw2)->Close()).ok());
    ASSERT_TRUE(Run((*ro)->Close()).ok());

    ASSERT_TRUE(Run((*rw)->Truncate(3 << 20, io::PreallocMode::kOff)).ok());
    EXPECT_EQ(LockedBytes(path), (std::multiset<uint64_t>{100, 101, 103}));
    EXPECT_EQ(FileLength(path), 3u << 20);
    ASSERT_TRUE(Run((*rw)->Close()).ok());
  }
  EXPECT_TRUE(LockedBytes(path).empty());
  // Read-only: consistent read only, like qemu-io -r -f raw.
  {
    auto ro = OpenSharingAll(path, /*read_only=*/true);
    ASSERT_TRUE(ro.ok()) << ro.status();
    EXPECT_EQ(LockedBytes(path), (std::multiset<uint64_t>{100}));
    auto rw = Open(path);
    ASSERT_TRUE(rw.ok()) << rw.status();
    ASSERT_TRUE(Run((*rw)->Close()).ok());
  }
  // A writer that denies write keeps a sharing node out; one that denies
  // only resize lets it open but not truncate.
  {
    auto strict = Open(path);
    ASSERT_TRUE(strict.ok());
    auto rw = OpenSharingAll(path);
    EXPECT_EQ(rw.status().message(),
              "Failed to get \"write\" lock\nIs another process using the "
              "image [" + path + "]?");
  }
  {
    int fd = open(path.c_str(), O_RDONLY);
    ASSERT_GE(fd, 0);
    struct flock fl = {};
    fl.l_type = F_RDLCK;
    fl.l_whence = SEEK_SET;
    fl.l_start = 203;  // resize not shared, as qemu-img create does
    fl.l_len = 1;
    ASSERT_EQ(fcntl(fd, F_OFD_SETLK, &fl), 0);
    auto rw = OpenSharingAll(path);
    ASSERT_TRUE(rw.ok()) << rw.status();
    absl::Status st = Run((*rw)->Truncate(4 << 20, io::PreallocMode::kOff));
    EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_EQ(st.message(),
              "Failed to get \"resize\" lock\nIs another process using the "
              "image [" + path + "]?");
    EXPECT_EQ(FileLength(path), 3u << 20);
    EXPECT_EQ(LockedBytes(path), (std::multiset<uint64_t>{100, 101, 203}));
    close(fd);
    ASSERT_TRUE(Run((*rw)->Truncate(4 << 20, io::PreallocMode::kOff)).ok());
    ASSERT_TRUE(Run((*rw)->Close()).ok());
  }
}

TEST_F(FileNodeTest, TruncateGrowsWithPreallocationAndShrinks) {
  const std::string path = Path("trunc.raw");
  ASSERT_TRUE(Create(path, 1 << 20).ok());
  auto node = Open(path);
  ASSERT_TRUE(node.ok()) << node.status();
  FileNode& n = **node;
  ASSERT_TRUE(Run(n.Truncate(3 << 20, io::PreallocMode::kFull)).ok());
  EXPECT_EQ(n.size(), 3u << 20);
  EXPECT_GE(FileAllocated(path), 2u << 20);
  ASSERT_TRUE(Run(n.Truncate(5 << 20, io::PreallocMode::kFalloc)).ok());
  EXPECT_EQ(n.size(), 5u << 20);
  EXPECT_GE(FileAllocated(path), 4u << 20);
  ASSERT_TRUE(Run(n.Truncate((6 << 20) + 100, io::PreallocMode::kOff)).ok());
  EXPECT_EQ(FileLength(path), (6u << 20) + 100);
  EXPECT_EQ(Run(n.Truncate(1 << 20, io::PreallocMode::kFull)).code(),
            absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(Run(n.Truncate(4096, io::PreallocMode::kOff)).ok());
  EXPECT_EQ(n.size(), 4096u);
  EXPECT_EQ(FileLength(path), 4096u);
  EXPECT_EQ(NodeRead(n, 0, 8192), std::vector<uint8_t>(8192, 0));
}

TEST_F(FileNodeTest, BlockStatusWalksManyExtents) {
  const std::string path = Path("extents.raw");
  constexpr int kExtents = 2000;
  {
    int fd = open(path.c_str(), O_RDWR | O_CREAT, 0644);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(ftruncate(fd, kExtents * 8192), 0);
    std::vector<uint8_t> block(4096, 0x77);
    for (int i = 0; i < kExtents; ++i) {
      ASSERT_EQ(pwrite(fd, block.data(), 4096, i * 8192 + 4096), 4096);
    }
    close(fd);
  }
  auto node = Open(path, "", true);
  ASSERT_TRUE(node.ok()) << node.status();
  FileNode& n = **node;
  uint64_t off = 0;
  int transitions = 0;
  while (off < n.size()) {
    auto st = Run(n.GetBlockStatus(off, n.size() - off));
    ASSERT_TRUE(st.ok());
    const bool expect_data = (off / 4096) % 2 == 1;
    ASSERT_EQ(st->data, expect_data) << off;
    ASSERT_EQ(st->zero, !expect_data) << off;
    ASSERT_EQ(st->length, 4096u) << off;
    off += st->length;
    ++transitions;
  }
  EXPECT_EQ(transitions, 2 * kExtents);
  auto extents = n.ExtentCount();
  ASSERT_TRUE(extents.ok()) << extents.status();
  EXPECT_EQ(*extents, static_cast<uint64_t>(kExtents));
  EXPECT_EQ(n.ExtentSizeHint(), std::nullopt);  // ext4 keeps no hint
  // Data blocks plus a few ext4 extent tree blocks.
  EXPECT_GE(*n.AllocatedSize(), kExtents * 4096u);
  EXPECT_LE(*n.AllocatedSize(), kExtents * 4096u + (64u << 10));
}

TEST_F(FileNodeTest, BlockStatusInSmallStepsUsesTheCachedExtent) {
  const std::string path = Path("big.raw");
  WriteWithPwrite(path, 0, std::vector<uint8_t>(4 << 20, 1));
  auto node = Open(path, "", true);
  ASSERT_TRUE(node.ok()) << node.status();
  FileNode& n = **node;
  for (uint64_t off = 0; off < n.size(); off += 4096) {
    auto st = Run(n.GetBlockStatus(off, 4096));
    ASSERT_TRUE(st.ok());
    ASSERT_TRUE(st->data);
    ASSERT_EQ(st->length, 4096u);
  }
  // The answer may reach up to the next transition.
  auto st = Run(n.GetBlockStatus(12345, 1 << 30));
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->length, (4u << 20) - 12345);
}

// Block status remembers where a hole ends (SEEK_DATA's answer, data) and
// asks only SEEK_HOLE there next; a discard of that data forgets it.
TEST_F(FileNodeTest, BlockStatusAfterAHoleSeesItsDataDiscarded) {
  const std::string path = Path("hole_then_data.raw");
  ASSERT_TRUE(Create(path, 1 << 20).ok());
  WriteWithPwrite(path, 512 << 10, std::vector<uint8_t>(64 << 10, 1));
  auto node = Open(path, "", false);
  ASSERT_TRUE(node.ok()) << node.status();
  FileNode& n = **node;
  // (Create wrote the first 4 KiB.)
  auto hole = Run(n.GetBlockStatus(64 << 10, n.size()));
  ASSERT_TRUE(hole.ok());
  EXPECT_TRUE(hole->zero);
  EXPECT_EQ(hole->length, 448u << 10);
  auto data = Run(n.GetBlockStatus(512 << 10, n.size()));
  ASSERT_TRUE(data.ok());
  EXPECT_TRUE(data->data);
  EXPECT_EQ(data->length, 64u << 10);
  // Again from the hole, then the data discarded: a hole now.
  ASSERT_TRUE(Run(n.GetBlockStatus(128 << 10, n.size())).ok());
  ASSERT_TRUE(Run(n.Discard(512 << 10, 64 << 10)).ok());
  auto after = Run(n.GetBlockStatus(512 << 10, n.size()));
  ASSERT_TRUE(after.ok());
  EXPECT_FALSE(after->data);
  EXPECT_TRUE(after->zero);
  ASSERT_TRUE(Run(n.Close()).ok());
}

TEST_F(FileNodeTest, FlushAndCacheModes) {
  const std::string path = Path("flush.raw");
  ASSERT_TRUE(Create(path, 1 << 20).ok());
  for (const char* cache :
       {"", "writeback", "writethrough", "none", "directsync", "unsafe"}) {
    auto node = Open(path, cache);
    ASSERT_TRUE(node.ok()) << cache << ": " << node.status();
    const auto data = Pattern(4096, 7);
    ASSERT_TRUE(NodeWrite(**node, 4096, data).ok()) << cache;
    EXPECT_TRUE(Run((*node)->Flush()).ok()) << cache;
    EXPECT_EQ(NodeRead(**node, 4096, 4096), data) << cache;
    EXPECT_TRUE(Run((*node)->Close()).ok()) << cache;
  }
  auto ro = Open(path, "", true);
  ASSERT_TRUE(ro.ok());
  EXPECT_EQ(Run((*ro)->Write(0, io::ConstIoVec())).code(),
            absl::StatusCode::kFailedPrecondition);
}

// Counts the fdatasync/fsync requests passed on to `inner`, and fails the
// next `fail_next` of them with EIO (the kernel's answer is replaced).
class SyncCounter : public io::Engine {
 public:
  explicit SyncCounter(io::Engine& inner) : inner_(inner) {}
  void Submit(io::Op* op) override {
    if (op->kind == io::OpKind::kFdatasync || op->kind == io::OpKind::kFsync) {
      ++syncs;
      if (fail_next > 0) {
        --fail_next;
        auto done = std::move(op->done);
        op->done = [done = std::move(done)](io::Op& o) mutable {
          o.result = -EIO;
          done(o);
        };
      }
    }
    inner_.Submit(op);
  }
  absl::Status Poll(bool wait) override { return inner_.Poll(wait); }
  uint64_t in_flight() const override { return inner_.in_flight(); }
  const char* name() const override { return inner_.name(); }

  int syncs = 0;
  int fail_next = 0;

 private:
  io::Engine& inner_;
};

// As QEMU's bdrv_co_flush (write_gen == flushed_gen): a flush with nothing
// ended since the last good one issues no fdatasync; a failed one leaves
// the changes to the next; a failed discard or truncate is no change; and
// a write still in flight when a flush starts is not covered by it.
TEST_F(FileNodeTest, FlushSyncsOnlyAfterChanges) {
  const std::string path = Path("gen.raw");
  ASSERT_TRUE(Create(path, 1 << 20).ok());
  for (const char* cache : {"writeback", "none"}) {
    SCOPED_TRACE(cache);
    SyncCounter counter(engine_);
    FileOpenOptions options;
    options.set_filename(path);
    options.set_cache(cache);
    auto opened = FileNode::Open(counter, options, &warnings_);
    ASSERT_TRUE(opened.ok()) << opened.status();
    FileNode& n = **opened;
    auto run = [&](auto task) { return io::RunSync(counter, std::move(task)); };
    const std::vector<uint8_t> data = Pattern(4096, 3);
    const io::ConstIoVec buf(data.data(), data.size());

    ASSERT_TRUE(run(n.Flush()).ok());
    EXPECT_EQ(counter.syncs, 0);  // nothing written since the open
    ASSERT_TRUE(run(n.Write(0, buf)).ok());
    ASSERT_TRUE(run(n.Flush()).ok());
    EXPECT_EQ(counter.syncs, 1);
    ASSERT_TRUE(run(n.Flush()).ok());
    EXPECT_EQ(counter.syncs, 1);
    for (auto change : {0, 1, 2}) {
      if (change == 0) {
        ASSERT_TRUE(run(n.Discard(8192, 4096)).ok());
      }
      if (change == 1) {
        ASSERT_TRUE(run(n.WriteZeroes(8192, 4096, {})).ok());
      }
      if (change == 2) {
        ASSERT_TRUE(run(n.Truncate(2 << 20, io::PreallocMode::kOff)).ok());
      }
      const int before = counter.syncs;
      ASSERT_TRUE(run(n.Flush()).ok());
      EXPECT_EQ(counter.syncs, before + 1) << change;
    }
    // A refused truncate (preallocation while shrinking) changed nothing.
    EXPECT_FALSE(run(n.Truncate(4096, io::PreallocMode::kFalloc)).ok());
    ASSERT_TRUE(run(n.Flush()).ok());
    EXPECT_EQ(counter.syncs, 4);

    // A write in flight while a flush starts (after one that ended, so the
    // flush syncs): the next flush syncs again.
    ASSERT_TRUE(run(n.Write(0, buf)).ok());
    bool written = false;
    io::Spawn(n.Write(4096, buf), [&](absl::Status st) {
      EXPECT_TRUE(st.ok()) << st;
      written = true;
    });
    ASSERT_TRUE(run(n.Flush()).ok());
    while (!written) ASSERT_TRUE(counter.Poll(/*wait=*/true).ok());
    EXPECT_EQ(counter.syncs, 5);
    ASSERT_TRUE(run(n.Flush()).ok());
    EXPECT_EQ(counter.syncs, 6);

    if (std::string(cache) == "none") {
      // A failed flush (O_DIRECT: not sticky) leaves the write to the next.
      ASSERT_TRUE(run(n.Write(0, buf)).ok());
      counter.fail_next = 1;
      absl::Status failed = run(n.Flush());
      EXPECT_THAT(failed.message(), HasSubstr("fdatasync")) << failed;
      EXPECT_EQ(counter.syncs, 7);
      ASSERT_TRUE(run(n.Flush()).ok());
      EXPECT_EQ(counter.syncs, 8);
      ASSERT_TRUE(run(n.Flush()).ok());
      EXPECT_EQ(counter.syncs, 8);
    } else {
      // Without O_DIRECT a failed fdatasync sticks: every later flush
      // fails, without asking the kernel again.
      ASSERT_TRUE(run(n.Write(0, buf)).ok());
      counter.fail_next = 1;
      EXPECT_FALSE(run(n.Flush()).ok());
      EXPECT_EQ(counter.syncs, 7);
      EXPECT_FALSE(run(n.Flush()).ok());
      EXPECT_EQ(counter.syncs, 7);
    }
    // Close flushes only what is unflushed (the sticky error again).
    absl::Status closed = run(n.Close());
    EXPECT_EQ(closed.ok(), std::string(cache) == "none") << closed;
  }
}

}  // namespace
}  // namespace imgtool::posix_file

// Metadata table I/O: table buffers are aligned, so an image opened with
// O_DIRECT (-t none) reads and writes L2 tables and refcount blocks straight
// from them (no bounce buffer in the file layer), and allocating writes
// leave dirty L2 tables in the cache until a flush (no L2 write per write).
#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "io/aligned_buffer.h"
#include "io/block_node.h"
#include "io/task.h"
#include "posix_file/file_node.h"
#include "posix_file/file_options.pb.h"
#include "qcow2/bytes.h"
#include "qcow2/qcow2_node.h"
#include "qcow2/table_cache.h"
#include "qcow2/test_util.h"

namespace imgtool::qcow2 {
namespace {

using testing::Env;
using testing::Pattern;
using testing::Shell;
using testing::TempPath;

bool Aligned(const void* p, uint64_t alignment) {
  return reinterpret_cast<uintptr_t>(p) % alignment == 0;
}

TEST(TableCacheTest, TableBuffersAreAlignedForDirectIo) {
  Env env;
  for (uint64_t table_size :
       {uint64_t{512}, uint64_t{4096}, uint64_t{65536}, uint64_t{2} << 20}) {
    SCOPED_TRACE(absl::StrCat("table size ", table_size));
    const uint64_t want = std::min<uint64_t>(table_size, 4096);
    std::vector<std::pair<uint64_t, bool>> reads, writes;  // size, aligned
    TableCache cache(
        table_size, 2,
        [&](uint64_t, io::IoVec buf) -> io::Task<absl::Status> {
          reads.push_back({buf.size(), Aligned(buf.data(), want)});
          co_return absl::OkStatus();
        },
        [&](uint64_t, io::ConstIoVec data) -> io::Task<absl::Status> {
          writes.push_back({data.size(), Aligned(data.data(), want)});
          co_return absl::OkStatus();
        });
    EXPECT_EQ(cache.alignment(), want);
    absl::Status st = env.Run([&]() -> io::Task<absl::Status> {
      for (uint64_t i = 0; i < 4; ++i) {
        absl::StatusOr<TableCache::Ref> a = co_await cache.Get(i * table_size);
        EXPECT_TRUE(a.ok());
        EXPECT_TRUE(Aligned(a->data().data(), want));
        a->data()[0] = 1;
        cache.MarkDirty(*a);
        absl::StatusOr<TableCache::Ref> b =
            co_await cache.GetEmpty((i + 100) * table_size);
        EXPECT_TRUE(b.ok());
        EXPECT_TRUE(Aligned(b->data().data(), want));
        EXPECT_EQ(b->data()[table_size - 1], 0);
      }
      co_return co_await cache.WriteDirty();
    }());
    EXPECT_TRUE(st.ok()) << st;
    // 4 misses; 8 dirty tables through a cache of 2: evictions and flush.
    ASSERT_EQ(reads.size(), 4u);
    ASSERT_EQ(writes.size(), 8u);
    for (auto [size, aligned] : reads) {
      EXPECT_EQ(size, table_size);
      EXPECT_TRUE(aligned);
    }
    for (auto [size, aligned] : writes) {
      EXPECT_EQ(size, table_size);
      EXPECT_TRUE(aligned);
    }
  }
}

struct Access {
  bool write;
  uint64_t offset;
  uint64_t length;
  bool aligned;  // buffer start at a multiple of 4096
};

// Records every read and write that reaches the file.
class RecordingNode final : public testing::ForwardingNode {
 public:
  RecordingNode(std::unique_ptr<io::BlockNode> target, std::vector<Access>* log)
      : ForwardingNode(std::move(target)), log_(log) {}

 protected:
  io::Task<absl::Status> DoRead(uint64_t offset, io::IoVec buf) override {
    log_->push_back({false, offset, buf.size(), Aligned(buf.data(), 4096)});
    return ForwardingNode::DoRead(offset, buf);
  }
  io::Task<absl::Status> DoWrite(uint64_t offset,
                                 io::ConstIoVec data) override {
    log_->push_back({true, offset, data.size(), Aligned(data.data(), 4096)});
    return ForwardingNode::DoWrite(offset, data);
  }

 private:
  std::vector<Access>* log_;
};

// The image file opened with cache=none (O_DIRECT) where the filesystem
// allows it, else with the default cache (the buffers checked are the same).
std::unique_ptr<io::BlockNode> OpenRecorded(Env& env, const std::string& path,
                                            std::vector<Access>* log) {
  posix_file::FileOpenOptions options;
  options.set_filename(path);
  options.set_cache("none");
  absl::StatusOr<std::unique_ptr<posix_file::FileNode>> node =
      posix_file::FileNode::Open(env.engine(), options, nullptr);
  if (!node.ok()) {
    options.set_cache("");
    node = posix_file::FileNode::Open(env.engine(), options, nullptr);
  }
  if (!node.ok()) return nullptr;
  return std::make_unique<RecordingNode>(*std::move(node), log);
}

void CheckTableIo(bool extended_l2) {
  Env env;
  const std::string path =
      TempPath(extended_l2 ? "table_io_ext.qcow2" : "table_io.qcow2");
  constexpr uint64_t kCluster = 65536;
  constexpr uint64_t kSize = 64 << 20;
  ASSERT_EQ(Shell(absl::StrCat(
                      "qemu-img create -q -f qcow2 -o cluster_size=", kCluster,
                      ",extended_l2=", extended_l2 ? "on" : "off", " ", path,
                      " ", kSize))
                .exit_code,
            0);
  std::vector<Access> log;
  constexpr int kWrites = 64;
  {
    std::unique_ptr<io::BlockNode> file = OpenRecorded(env, path, &log);
    ASSERT_NE(file, nullptr);
    auto node =
        env.Run(Qcow2Node::Open(std::move(file), Qcow2OpenOptions(), nullptr));
    ASSERT_TRUE(node.ok()) << node.status();
    // 4 KiB into 64 different clusters, each allocating.
    io::AlignedBuffer data(4096);
    const std::vector<uint8_t> p = Pattern(4096, 1);
    std::copy(p.begin(), p.end(), data.data());
    for (int i = 0; i < kWrites; ++i) {
      ASSERT_TRUE(
          env.Run((*node)->Write(i * (kSize / kWrites) + 8192, data.span()))
              .ok());
    }
    ASSERT_TRUE(env.Run((*node)->Flush()).ok());
    ASSERT_TRUE(env.Run((*node)->Close()).ok());
  }
  const std::vector<uint8_t> image = testing::ReadFile(path);
  const uint64_t l1 = LoadBE64(image.data() + 40);
  const uint64_t l2 = LoadBE64(image.data() + l1) & 0x00fffffffffffe00ull;
  const uint64_t rt = LoadBE64(image.data() + 48);
  const uint64_t rb = LoadBE64(image.data() + rt);
  ASSERT_NE(l2, 0u);
  ASSERT_NE(rb, 0u);

  int l2_writes = 0, rb_writes = 0, data_writes = 0;
  for (const Access& a : log) {
    if (!a.write) continue;
    if (a.offset == l2 || a.offset == rb) {
      EXPECT_EQ(a.length, kCluster);
      EXPECT_TRUE(a.aligned) << "table write at " << a.offset;
      ++(a.offset == l2 ? l2_writes : rb_writes);
    } else if (a.length == 4096 && a.offset % kCluster == 8192) {
      ++data_writes;
    }
  }
  EXPECT_EQ(data_writes, kWrites);
  // The new L2 table once when it is made (before the L1 entry points to
  // it), then once at the flush: none per allocating write.
  EXPECT_EQ(l2_writes, 2);
  // The refcount block before the new L2 table is used and at the flush.
  EXPECT_EQ(rb_writes, 2);

  // Reading back loads the L2 table and the refcount block (aligned).
  log.clear();
  {
    std::unique_ptr<io::BlockNode> file = OpenRecorded(env, path, &log);
    ASSERT_NE(file, nullptr);
    auto node =
        env.Run(Qcow2Node::Open(std::move(file), Qcow2OpenOptions(), nullptr));
    ASSERT_TRUE(node.ok()) << node.status();
    io::AlignedBuffer back(4096);
    ASSERT_TRUE(env.Run((*node)->Read(8192, back.span())).ok());
    EXPECT_EQ(std::vector<uint8_t>(back.data(), back.data() + 4096),
              Pattern(4096, 1));
    ASSERT_TRUE(env.Run((*node)->Close()).ok());
  }
  int l2_reads = 0;
  for (const Access& a : log) {
    if (!a.write && a.offset == l2) {
      EXPECT_EQ(a.length, kCluster);
      EXPECT_TRUE(a.aligned);
      ++l2_reads;
    }
  }
  EXPECT_EQ(l2_reads, 1);
  EXPECT_EQ(Shell("qemu-img check -q " + path).exit_code, 0);
}

TEST(TableIoTest, TablesGoToTheFileFromAlignedBuffers) { CheckTableIo(false); }

TEST(TableIoTest, ExtendedL2TablesGoToTheFileFromAlignedBuffers) {
  CheckTableIo(true);
}

}  // namespace
}  // namespace imgtool::qcow2

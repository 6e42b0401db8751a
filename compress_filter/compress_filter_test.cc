#include "compress_filter/compress_filter.h"

#include <cerrno>
#include <cstdint>
#include <memory>
#include <set>
#include <utility>
#include <vector>

#include "base/errno_status.h"
#include "gtest/gtest.h"
#include "io/block_node.h"
#include "io/task.h"
#include "io/testing/memory_node.h"

namespace imgtool::compress_filter {
namespace {

using io::testing::MemoryNode;
using io::testing::RunInline;

constexpr uint64_t kCluster = 4096;

// Stands in for qcow2's compressed write: records each call and writes the
// data to the child as it is; clusters in `allocated` refuse it as qcow2
// does (kFailedPrecondition).
struct FakeCompressor {
  MemoryNode* child = nullptr;
  std::set<uint64_t> allocated;  // cluster indexes
  std::vector<std::pair<uint64_t, uint64_t>> calls;  // (offset, bytes)
};

io::Task<absl::Status> FakeWrite(FakeCompressor* f, uint64_t offset,
                                 io::ConstIoVec data) {
  f->calls.emplace_back(offset, data.size());
  for (uint64_t o = offset; o < offset + data.size(); o += kCluster) {
    if (f->allocated.count(o / kCluster) != 0) {
      co_return absl::FailedPreconditionError("cluster allocated");
    }
    const uint64_t n = std::min<uint64_t>(kCluster, offset + data.size() - o);
    absl::Status st = co_await f->child->Write(o, data.subspan(o - offset, n));
    if (!st.ok()) co_return st;
    f->allocated.insert(o / kCluster);
  }
  co_return absl::OkStatus();
}

struct Fixture {
  FakeCompressor fake;
  std::unique_ptr<CompressNode> node;
  MemoryNode* child = nullptr;
};

// A filter over `size` bytes of `fill`.
std::unique_ptr<Fixture> Make(uint64_t size, uint8_t fill) {
  auto f = std::make_unique<Fixture>();
  auto child = std::make_unique<MemoryNode>(
      "child", std::vector<uint8_t>(size, fill), false, size);
  f->child = child.get();
  f->fake.child = child.get();
  FakeCompressor* fake = &f->fake;
  f->node = std::make_unique<CompressNode>(
      std::move(child),
      CompressSettings{.cluster_size = kCluster,
                       .write_compressed = [fake](uint64_t o,
                                                  io::ConstIoVec d) {
                         return FakeWrite(fake, o, d);
                       }});
  return f;
}

using Calls = std::vector<std::pair<uint64_t, uint64_t>>;

TEST(CompressFilterTest, AlignedWriteIsOneCompressedWrite) {
  auto f = Make(4 * kCluster, 0);
  std::vector<uint8_t> data(2 * kCluster, 0xbb);
  ASSERT_TRUE(RunInline(f->node->Write(kCluster, data))->ok());
  EXPECT_EQ(f->fake.calls, (Calls{{kCluster, 2 * kCluster}}));
  EXPECT_EQ(f->child->bytes()[kCluster], 0xbb);
  EXPECT_EQ(f->child->bytes()[3 * kCluster - 1], 0xbb);
  EXPECT_EQ(f->child->bytes()[3 * kCluster], 0);
}

TEST(CompressFilterTest, UnalignedWriteIsPaddedWithTheChildsBytes) {
  auto f = Make(4 * kCluster, 0x11);
  std::vector<uint8_t> data(kCluster, 0xbb);
  ASSERT_TRUE(RunInline(f->node->Write(kCluster / 4, data))->ok());
  EXPECT_EQ(f->fake.calls, (Calls{{0, 2 * kCluster}}));
  const auto& b = f->child->bytes();
  EXPECT_EQ(b[kCluster / 4 - 1], 0x11);
  EXPECT_EQ(b[kCluster / 4], 0xbb);
  EXPECT_EQ(b[kCluster / 4 + kCluster - 1], 0xbb);
  EXPECT_EQ(b[kCluster / 4 + kCluster], 0x11);
  EXPECT_EQ(b[2 * kCluster - 1], 0x11);
}

TEST(CompressFilterTest, WriteInsideOneClusterWritesThatCluster) {
  auto f = Make(4 * kCluster, 0x11);
  std::vector<uint8_t> data(100, 0xbb);
  ASSERT_TRUE(RunInline(f->node->Write(2 * kCluster + 10, data))->ok());
  EXPECT_EQ(f->fake.calls, (Calls{{2 * kCluster, kCluster}}));
  EXPECT_EQ(f->child->bytes()[2 * kCluster + 9], 0x11);
  EXPECT_EQ(f->child->bytes()[2 * kCluster + 10], 0xbb);
  EXPECT_EQ(f->child->bytes()[2 * kCluster + 110], 0x11);
}

TEST(CompressFilterTest, AllocatedClusterIsEio) {
  auto f = Make(4 * kCluster, 0);
  f->fake.allocated.insert(1);
  std::vector<uint8_t> data(2 * kCluster, 0xbb);
  absl::Status st = *RunInline(f->node->Write(0, data));
  EXPECT_EQ(StatusErrno(st), EIO) << st;
  // The cluster before it was written.
  EXPECT_EQ(f->child->bytes()[0], 0xbb);
  EXPECT_EQ(f->child->bytes()[kCluster], 0);
}

TEST(CompressFilterTest, ZeroWriteCompressesPartialClustersOnly) {
  auto f = Make(4 * kCluster, 0x11);
  ASSERT_TRUE(RunInline(f->node->WriteZeroes(kCluster / 2, 2 * kCluster,
                                             io::WriteZeroesFlags{}))
                  ->ok());
  EXPECT_EQ(f->fake.calls, (Calls{{0, kCluster}, {2 * kCluster, kCluster}}));
  const auto& b = f->child->bytes();
  EXPECT_EQ(b[kCluster / 2 - 1], 0x11);
  for (uint64_t i = kCluster / 2; i < 5 * kCluster / 2; ++i) {
    ASSERT_EQ(b[i], 0) << i;
  }
  EXPECT_EQ(b[5 * kCluster / 2], 0x11);
}

TEST(CompressFilterTest, AlignedZeroWritePassesThrough) {
  auto f = Make(4 * kCluster, 0x11);
  ASSERT_TRUE(RunInline(f->node->WriteZeroes(kCluster, kCluster,
                                             io::WriteZeroesFlags{}))
                  ->ok());
  EXPECT_TRUE(f->fake.calls.empty());
  EXPECT_EQ(f->child->bytes()[kCluster], 0);
  EXPECT_EQ(f->child->bytes()[2 * kCluster], 0x11);
}

TEST(CompressFilterTest, ZeroWriteInsideOneClusterIsOneCompressedWrite) {
  auto f = Make(4 * kCluster, 0x11);
  ASSERT_TRUE(
      RunInline(f->node->WriteZeroes(0, 512, io::WriteZeroesFlags{}))->ok());
  EXPECT_EQ(f->fake.calls, (Calls{{0, kCluster}}));
  EXPECT_EQ(f->child->bytes()[511], 0);
  EXPECT_EQ(f->child->bytes()[512], 0x11);
}

TEST(CompressFilterTest, WriteIsCutAtTheChildsEnd) {
  auto f = Make(kCluster + kCluster / 2, 0);
  std::vector<uint8_t> data(kCluster / 4, 0xbb);
  ASSERT_TRUE(RunInline(f->node->Write(kCluster, data))->ok());
  EXPECT_EQ(f->fake.calls, (Calls{{kCluster, kCluster / 2}}));
}

TEST(CompressFilterTest, ReadsAndFlushesPassThrough) {
  auto f = Make(2 * kCluster, 0x5a);
  std::vector<uint8_t> buf(10);
  ASSERT_TRUE(RunInline(f->node->Read(7, io::IoVec(buf)))->ok());
  EXPECT_EQ(buf, std::vector<uint8_t>(10, 0x5a));
  ASSERT_TRUE(RunInline(f->node->Flush())->ok());
  EXPECT_EQ(f->child->flushes(), 1);
  EXPECT_EQ(f->node->size(), 2 * kCluster);
  EXPECT_EQ(f->node->primary_child(), f->child);
  EXPECT_TRUE(f->fake.calls.empty());
}

}  // namespace
}  // namespace imgtool::compress_filter

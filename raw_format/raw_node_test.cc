#include "raw_format/raw_node.h"

#include <cstdint>
#include <memory>
#include <numeric>
#include <vector>

#include "gtest/gtest.h"
#include "io/block_node.h"
#include "io/task.h"
#include "io/testing/memory_node.h"

namespace imgtool::raw_format {
namespace {

using io::testing::MemoryNode;
using io::testing::RunInline;

std::vector<uint8_t> Counting(size_t n) {
  std::vector<uint8_t> v(n);
  std::iota(v.begin(), v.end(), 0);
  return v;
}

std::unique_ptr<MemoryNode> File(size_t n) {
  return std::make_unique<MemoryNode>("t.raw", Counting(n), false, 1 << 20);
}

absl::StatusOr<std::unique_ptr<RawNode>> Open(std::unique_ptr<MemoryNode> f,
                                              std::optional<uint64_t> offset,
                                              std::optional<uint64_t> size) {
  RawOptions options;
  if (offset.has_value()) options.set_offset(*offset);
  if (size.has_value()) options.set_size(*size);
  return RawNode::Open(std::move(f), options);
}

TEST(RawNodeTest, OffsetShiftsEveryRequest) {
  auto file = File(4096);
  MemoryNode* f = file.get();
  auto node = *Open(std::move(file), 512, std::nullopt);
  EXPECT_EQ(node->size(), 3584u);
  std::vector<uint8_t> buf(4);
  ASSERT_TRUE(RunInline(node->Read(0, io::IoVec(buf)))->ok());
  EXPECT_EQ(buf, (std::vector<uint8_t>{0, 1, 2, 3}));  // byte 512 of 0..255
  std::vector<uint8_t> data(2, 0xaa);
  ASSERT_TRUE(RunInline(node->Write(10, io::ConstIoVec(data)))->ok());
  EXPECT_EQ(f->bytes()[522], 0xaa);
  EXPECT_EQ(f->bytes()[521], 521 % 256);
  ASSERT_TRUE(RunInline(node->WriteZeroes(100, 4, {}))->ok());
  EXPECT_EQ(f->bytes()[612], 0);
}

TEST(RawNodeTest, FixedSizeRefusesRequestsPastItWithEnospc) {
  auto node = *Open(File(4096), 10, 2048);
  EXPECT_EQ(node->size(), 2048u);
  std::vector<uint8_t> buf(2);
  absl::Status st = *RunInline(node->Read(2047, io::IoVec(buf)));
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted) << st;
  EXPECT_TRUE(RunInline(node->Read(2046, io::IoVec(buf)))->ok());
  EXPECT_EQ(buf, (std::vector<uint8_t>{(2056) % 256, 2057 % 256}));
}

TEST(RawNodeTest, OpenChecksAsQemu) {
  EXPECT_EQ(Open(File(4096), 4097, std::nullopt).status().message(),
            "Offset (4097) cannot be greater than size of the containing "
            "file (4096)");
  EXPECT_EQ(Open(File(4096), 512, 3585).status().message(),
            "The sum of offset (512) and size (3585) has to be smaller or "
            "equal to the  actual size of the containing file (4096)");
  EXPECT_EQ(Open(File(4096), std::nullopt, 1000).status().message(),
            "Specified size is not multiple of 512");
  EXPECT_TRUE(Open(File(4096), 4096, std::nullopt).ok());
  EXPECT_EQ((*Open(File(4096), 4096, std::nullopt))->size(), 0u);
}

TEST(RawNodeTest, ResizeMovesTheFileEndUnlessTheSizeIsFixed) {
  auto file = File(4096);
  MemoryNode* f = file.get();
  auto node = *Open(std::move(file), 512, std::nullopt);
  ASSERT_TRUE(RunInline(node->Truncate(8192, io::PreallocMode::kOff))->ok());
  EXPECT_EQ(f->size(), 8704u);
  EXPECT_EQ(node->size(), 8192u);
  auto fixed = *Open(File(4096), 512, 1024);
  absl::Status st = *RunInline(fixed->Truncate(8192, io::PreallocMode::kOff));
  EXPECT_EQ(st.code(), absl::StatusCode::kUnimplemented);
  EXPECT_EQ(st.message(), "Cannot resize fixed-size raw disks");
}

TEST(RawNodeTest, BlockStatusIsTheFilesAtTheShiftedOffset) {
  auto file = File(4096);
  MemoryNode* f = file.get();
  auto node = *Open(std::move(file), 512, 1024);
  absl::StatusOr<io::BlockStatus> st =
      *RunInline(node->GetBlockStatus(0, 1 << 20));
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_EQ(st->length, 1024u);
  EXPECT_TRUE(st->data);
  EXPECT_EQ(st->host_offset, 512u);
  EXPECT_EQ(st->file, f);
}

}  // namespace
}  // namespace imgtool::raw_format

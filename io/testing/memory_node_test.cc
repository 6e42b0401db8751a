#include "io/testing/memory_node.h"

#include <cstdint>
#include <vector>

#include "gtest/gtest.h"

namespace imgtool::io::testing {
namespace {

TEST(MemoryNodeTest, ReadsZeroesPastTheEnd) {
  MemoryNode node("m", {1, 2, 3}, /*read_only=*/true, 3);
  std::vector<uint8_t> buf(5, 0xff);
  ASSERT_TRUE(RunInline(node.Read(1, IoVec(buf.data(), buf.size())))->ok());
  EXPECT_EQ(buf, (std::vector<uint8_t>{2, 3, 0, 0, 0}));
}

TEST(MemoryNodeTest, GrowsUpToItsBoundAndNoFurther) {
  MemoryNode node("m", {}, /*read_only=*/false, 8);
  const std::vector<uint8_t> data = {7, 7};
  ASSERT_TRUE(RunInline(node.Write(6, ConstIoVec(data.data(), 2)))->ok());
  EXPECT_EQ(node.bytes(), (std::vector<uint8_t>{0, 0, 0, 0, 0, 0, 7, 7}));
  absl::Status past = *RunInline(node.Write(7, ConstIoVec(data.data(), 2)));
  EXPECT_EQ(past.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(past.message(), "m: No space left on device");
  EXPECT_EQ(RunInline(node.Truncate(9, PreallocMode::kOff))->code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(node.size(), 8u);
  ASSERT_TRUE(RunInline(node.Truncate(2, PreallocMode::kOff))->ok());
  EXPECT_EQ(node.size(), 2u);
}

TEST(MemoryNodeTest, WriteZeroesAndDiscardZeroTheRange) {
  MemoryNode node("m", {1, 2, 3, 4}, /*read_only=*/false, 6);
  ASSERT_TRUE(RunInline(node.WriteZeroes(1, 1, {}))->ok());
  ASSERT_TRUE(RunInline(node.Discard(3, 10))->ok());
  EXPECT_EQ(node.bytes(), (std::vector<uint8_t>{1, 0, 3, 0}));
  ASSERT_TRUE(RunInline(node.WriteZeroes(4, 2, {}))->ok());
  EXPECT_EQ(node.size(), 6u);
}

TEST(MemoryNodeTest, BlockStatusIsDataAtTheSameOffset) {
  MemoryNode node("m", std::vector<uint8_t>(100), /*read_only=*/true, 100);
  absl::StatusOr<BlockStatus> status = *RunInline(node.GetBlockStatus(10, 1000));
  ASSERT_TRUE(status.ok());
  EXPECT_EQ(status->length, 90u);
  EXPECT_TRUE(status->data);
  EXPECT_TRUE(status->offset_valid);
  EXPECT_EQ(status->host_offset, 10u);
  EXPECT_EQ(status->file, &node);
}

}  // namespace
}  // namespace imgtool::io::testing

#include "io/aligned_buffer.h"

#include <cstdint>
#include <utility>

#include "absl/status/status.h"
#include "gtest/gtest.h"

namespace imgtool::io {
namespace {

TEST(AlignedBufferCreateTest, IsAlignedAndZeroed) {
  absl::StatusOr<AlignedBuffer> buf = AlignedBuffer::Create(10000, 65536);
  ASSERT_TRUE(buf.ok()) << buf.status();
  EXPECT_EQ(buf->size(), 10000u);
  EXPECT_EQ(buf->alignment(), 65536u);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(buf->data()) % 65536, 0u);
  for (uint8_t b : buf->span()) ASSERT_EQ(b, 0);
  AlignedBuffer moved = *std::move(buf);
  EXPECT_EQ(moved.size(), 10000u);

  absl::StatusOr<AlignedBuffer> empty = AlignedBuffer::Create(0);
  ASSERT_TRUE(empty.ok());
  EXPECT_TRUE(empty->empty());
  EXPECT_EQ(empty->data(), nullptr);
}

TEST(AlignedBufferCreateTest, UninitializedIsAlignedAndWritable) {
  AlignedBuffer buf = AlignedBuffer::Uninitialized(3 << 20, 8192);
  EXPECT_EQ(buf.size(), 3u << 20);
  EXPECT_EQ(buf.alignment(), 8192u);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(buf.data()) % 8192, 0u);
  buf.data()[0] = 1;
  buf.data()[buf.size() - 1] = 2;
  EXPECT_EQ(buf.data()[buf.size() - 1], 2);
  EXPECT_TRUE(AlignedBuffer::Uninitialized(0).empty());
}

TEST(AlignedBufferCreateTest, FailsInsteadOfAborting) {
  absl::StatusOr<AlignedBuffer> bad = AlignedBuffer::Create(4096, 3000);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(bad.status().message(),
            "Buffer alignment 3000 is not a power of two");

  // More than any process's address space.
  absl::StatusOr<AlignedBuffer> huge = AlignedBuffer::Create(uint64_t{1} << 62);
  EXPECT_EQ(huge.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(huge.status().message(),
            "Failed to allocate 4611686018427387904 bytes of memory: Cannot "
            "allocate memory");
}

}  // namespace
}  // namespace imgtool::io

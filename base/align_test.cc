#include "base/align.h"

#include <cstdint>

#include "gtest/gtest.h"

namespace imgtool {
namespace {

static_assert(AlignUp(1, 512) == 512);
static_assert(AlignDown(1023, 512) == 512);

TEST(AlignTest, IsPowerOfTwo) {
  EXPECT_FALSE(IsPowerOfTwo(0));
  EXPECT_TRUE(IsPowerOfTwo(1));
  EXPECT_TRUE(IsPowerOfTwo(4096));
  EXPECT_FALSE(IsPowerOfTwo(4095));
  EXPECT_FALSE(IsPowerOfTwo(3 << 20));
  EXPECT_TRUE(IsPowerOfTwo(1ull << 63));
  EXPECT_FALSE(IsPowerOfTwo(UINT64_MAX));
}

TEST(AlignTest, PowerOfTwoAlignment) {
  EXPECT_EQ(AlignDown(0, 4096), 0u);
  EXPECT_EQ(AlignDown(4095, 4096), 0u);
  EXPECT_EQ(AlignDown(4096, 4096), 4096u);
  EXPECT_EQ(AlignDown(12345, 512), 12288u);
  EXPECT_EQ(AlignUp(0, 4096), 0u);
  EXPECT_EQ(AlignUp(1, 4096), 4096u);
  EXPECT_EQ(AlignUp(4096, 4096), 4096u);
  EXPECT_EQ(AlignUp(4097, 4096), 8192u);
  EXPECT_EQ(AlignUp(1000, 512), 1024u);
  EXPECT_EQ(AlignUp(5, 1), 5u);
  EXPECT_EQ(AlignDown(UINT64_MAX, 1ull << 63), 1ull << 63);
  EXPECT_TRUE(IsAligned(0, 512));
  EXPECT_TRUE(IsAligned(65536, 65536));
  EXPECT_FALSE(IsAligned(65536 + 512, 65536));
  EXPECT_TRUE(IsAligned(7, 1));
}

TEST(AlignTest, AlignUpWrapsNearTheTop) {
  // Documented: callers check ranges before aligning values this large.
  EXPECT_EQ(AlignUp(UINT64_MAX, 4096), 0u);
}

TEST(AlignTest, AnyAlignment) {
  EXPECT_EQ(RoundDownTo(0, 3), 0u);
  EXPECT_EQ(RoundDownTo(10, 3), 9u);
  EXPECT_EQ(RoundUpTo(10, 3), 12u);
  EXPECT_EQ(RoundUpTo(9, 3), 9u);
  EXPECT_EQ(RoundUpTo(1, 3 << 20), 3u << 20);
  EXPECT_EQ(RoundDownTo(5000, 1000), 5000u);
  EXPECT_EQ(RoundUpTo(5001, 1000), 6000u);
  // Powers of two give the same as the bit-mask versions.
  EXPECT_EQ(RoundUpTo(4097, 4096), AlignUp(4097, 4096));
  EXPECT_EQ(RoundDownTo(4097, 4096), AlignDown(4097, 4096));
}

}  // namespace
}  // namespace imgtool

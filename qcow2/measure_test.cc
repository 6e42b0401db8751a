#include "qcow2/measure.h"

#include <cstdint>

#include "gtest/gtest.h"

namespace imgtool::qcow2 {
namespace {

constexpr uint64_t kGiB = uint64_t{1} << 30;
constexpr uint64_t kMiB = uint64_t{1} << 20;

// 1 GiB at 64 KiB: header 64k, L2 tables 128k, L1 one cluster (64k),
// refcount table + one block 128k; `qemu-img measure -O qcow2 --size 1G`
// prints 393216 / 1074135040.
TEST(MeasureTest, DefaultGeometryOneGiB) {
  const Measurement m = MeasureQcow2(kGiB, 0, MeasureGeometry{});
  EXPECT_EQ(m.required, 393216u);
  EXPECT_EQ(m.fully_allocated, 1074135040u);
}

// extended_l2=on,cluster_size=128k: 655360 / 1074397184 (qemu-img 7.2).
TEST(MeasureTest, ExtendedL2OneGiB) {
  const Measurement m =
      MeasureQcow2(kGiB, 0, MeasureGeometry{131072, 4, true});
  EXPECT_EQ(m.required, 655360u);
  EXPECT_EQ(m.fully_allocated, 1074397184u);
}

// Data clusters count in full into the required size.
TEST(MeasureTest, DataAddsToRequired) {
  const Measurement m = MeasureQcow2(kGiB, 3 * 65536, MeasureGeometry{});
  EXPECT_EQ(m.required, 393216u + 3 * 65536);
  EXPECT_EQ(m.fully_allocated, 1074135040u);
}

// 512-byte clusters, 1-bit refcounts, 1 MiB: header 512, L2 2048 entries
// (16384 bytes), L1 32 entries rounded to 64 (512 bytes); 2082 clusters fit
// one block (4096 refcounts) and one table cluster: 1024.
TEST(MeasureTest, SmallClustersOneBitRefcounts) {
  const MeasureGeometry g{512, 0, false};
  EXPECT_EQ(RefcountMetadataBytes(2082, g), 1024u);
  EXPECT_EQ(FullyAllocatedSize(kMiB, g), kMiB + 18432);
}

// 64-bit refcounts at 512 bytes: 64 refcounts a block, so the blocks count
// themselves: 2082 -> 33 blocks -> 34 blocks (2117 clusters), one table
// cluster: 35 clusters.
TEST(MeasureTest, WideRefcountsCountTheirOwnBlocks) {
  const MeasureGeometry g{512, 6, false};
  EXPECT_EQ(RefcountMetadataBytes(2082, g), 35u * 512);
  EXPECT_EQ(FullyAllocatedSize(kMiB, g), kMiB + 17408 + 35 * 512);
}

// The virtual size is rounded up to a whole cluster; size 0 has no L2 and
// no L1 table, only the header and the refcounts (qemu-img: 196608).
TEST(MeasureTest, RoundsVirtualSizeUpToClusters) {
  EXPECT_EQ(FullyAllocatedSize(1, MeasureGeometry{}),
            FullyAllocatedSize(65536, MeasureGeometry{}));
  // 0: header + refcount block + refcount table = 3 clusters.
  EXPECT_EQ(FullyAllocatedSize(0, MeasureGeometry{}), 3u * 65536);
}

// 32 MiB of L1 entries: 4 Mi L2 tables of 8192 entries at 64 KiB clusters
// cover 2^22 * 2^29 = 2 PiB.
TEST(MeasureTest, L1Limit) {
  const MeasureGeometry g;
  EXPECT_TRUE(FitsL1Limit(uint64_t{1} << 51, g));
  EXPECT_FALSE(FitsL1Limit((uint64_t{1} << 51) + 1, g));
  EXPECT_FALSE(FitsL1Limit(uint64_t{INT64_MAX}, MeasureGeometry{2 << 20, 4, false}));
}

}  // namespace
}  // namespace imgtool::qcow2

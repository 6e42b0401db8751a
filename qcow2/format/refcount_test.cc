#include "qcow2/format/refcount.h"

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "qcow2/format/test_util.h"

namespace imgtool::qcow2::format {
namespace {

using testing::QemuImgCreate;
using testing::ReadFileBytes;

TEST(RefcountTest, Widths) {
  EXPECT_EQ(RefcountBits(0), 1u);
  EXPECT_EQ(RefcountBits(4), 16u);
  EXPECT_EQ(RefcountBits(6), 64u);
  EXPECT_EQ(MaxRefcount(0), 1u);
  EXPECT_EQ(MaxRefcount(2), 15u);
  EXPECT_EQ(MaxRefcount(4), 0xffffu);
  EXPECT_EQ(MaxRefcount(5), 0xffffffffu);
  EXPECT_EQ(MaxRefcount(6), ~uint64_t{0});
  EXPECT_EQ(RefcountEntriesPerBlock(16, 4), 32768u);
  EXPECT_EQ(RefcountEntriesPerBlock(16, 0), 524288u);
  EXPECT_EQ(RefcountEntriesPerBlock(9, 6), 64u);
  EXPECT_EQ(RefcountEntriesPerBlock(21, 4), 1048576u);
  // 64 KiB clusters, 16-bit refcounts: one block covers 2 GiB.
  EXPECT_EQ(BytesPerRefcountBlock(16, 4), uint64_t{2} << 30);
  const uint64_t off = (uint64_t{5} << 31) + 7 * 65536 + 99;
  EXPECT_EQ(RefcountTableIndex(off, 16, 4), 5u);
  EXPECT_EQ(RefcountBlockIndex(off, 16, 4), 7u);
}

TEST(RefcountTest, PacksSubByteWidthsLsbFirst) {
  // Refcount 1 for entries 0-3, as in a fresh image's first block.
  const uint8_t expected_first_bytes[7][4] = {
      {0x0f, 0, 0, 0},          // 1 bit
      {0x55, 0, 0, 0},          // 2 bits
      {0x11, 0x11, 0, 0},       // 4 bits
      {1, 1, 1, 1},             // 8 bits
      {0, 1, 0, 1},             // 16 bits
      {0, 0, 0, 1},             // 32 bits
      {0, 0, 0, 0},             // 64 bits (byte 7 is 1)
  };
  for (uint32_t order = 0; order <= 6; ++order) {
    std::vector<uint8_t> block(512, 0);
    for (uint64_t i = 0; i < 4; ++i) SetRefcount(absl::MakeSpan(block), i, order, 1);
    for (int b = 0; b < 4; ++b) {
      EXPECT_EQ(block[b], expected_first_bytes[order][b]) << order << " " << b;
    }
    if (order == 6) {
      EXPECT_EQ(block[7], 1);
    }
    for (uint64_t i = 0; i < 4; ++i) EXPECT_EQ(GetRefcount(block, i, order), 1u);
    EXPECT_EQ(GetRefcount(block, 4, order), 0u);
  }
}

TEST(RefcountTest, SetLeavesNeighboursAlone) {
  for (uint32_t order = 0; order <= 6; ++order) {
    SCOPED_TRACE(order);
    const uint64_t max = MaxRefcount(order);
    std::vector<uint8_t> block(4096, 0);
    const uint64_t n = RefcountEntriesPerBlock(12, order);
    for (uint64_t i = 0; i < n; ++i) {
      SetRefcount(absl::MakeSpan(block), i, order, (i * 0x9e3779b97f4a7c15) & max);
    }
    SetRefcount(absl::MakeSpan(block), 5, order, max);
    SetRefcount(absl::MakeSpan(block), 6, order, 0);
    for (uint64_t i = 0; i < n; ++i) {
      uint64_t want = (i * 0x9e3779b97f4a7c15) & max;
      if (i == 5) want = max;
      if (i == 6) want = 0;
      ASSERT_EQ(GetRefcount(block, i, order), want) << i;
    }
  }
  // 16-bit entries are big-endian.
  std::vector<uint8_t> block(8, 0);
  SetRefcount(absl::MakeSpan(block), 1, 4, 0x1234);
  EXPECT_EQ(block[2], 0x12);
  EXPECT_EQ(block[3], 0x34);
}

TEST(RefcountTest, TableEntries) {
  std::vector<uint8_t> table(16, 0);
  StoreRefcountTableEntry(absl::MakeSpan(table), 1, 0x20000);
  EXPECT_EQ(table[13], 0x02);
  EXPECT_EQ(LoadRefcountTableEntry(table, 1), 0x20000u);
  EXPECT_EQ(*DecodeRefcountTableEntry(0x20000, 16), 0x20000u);
  EXPECT_EQ(*DecodeRefcountTableEntry(0, 16), 0u);
  absl::Status st = DecodeRefcountTableEntry(0x20001, 16).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(st.message(), "Refcount table entry 0x20001 has reserved bits set");
  st = DecodeRefcountTableEntry(0x20200, 16).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(st.message(), "Refblock offset 0x20200 unaligned");
  EXPECT_TRUE(DecodeRefcountTableEntry(0x20200, 9).ok());
}

// A fresh 1 MiB image with 64 KiB clusters uses clusters 0-3 (header,
// refcount table, refcount block, L1 table); check every refcount width.
TEST(RefcountTest, ReadsBlocksWrittenByQemu) {
  for (uint32_t order = 0; order <= 6; ++order) {
    SCOPED_TRACE(order);
    absl::StatusOr<std::string> path = QemuImgCreate(
        "rc.qcow2", absl::StrCat("refcount_bits=", 1u << order), "1M");
    ASSERT_TRUE(path.ok()) << path.status();
    absl::StatusOr<std::vector<uint8_t>> bytes = ReadFileBytes(*path);
    ASSERT_TRUE(bytes.ok());
    const auto file = absl::MakeConstSpan(*bytes);
    absl::StatusOr<uint64_t> block_offset =
        DecodeRefcountTableEntry(LoadRefcountTableEntry(file.subspan(0x10000), 0), 16);
    ASSERT_TRUE(block_offset.ok());
    EXPECT_EQ(*block_offset, 0x20000u);
    EXPECT_EQ(LoadRefcountTableEntry(file.subspan(0x10000), 1), 0u);
    const auto block = file.subspan(*block_offset, 65536);
    for (uint64_t i = 0; i < 4; ++i) EXPECT_EQ(GetRefcount(block, i, order), 1u) << i;
    for (uint64_t i = 4; i < RefcountEntriesPerBlock(16, order); ++i) {
      ASSERT_EQ(GetRefcount(block, i, order), 0u) << i;
    }
  }
}

}  // namespace
}  // namespace imgtool::qcow2::format

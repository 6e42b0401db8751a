#include "qcow2/format/bitmap.h"

#include <cstdint>
#include <vector>

#include "gtest/gtest.h"

namespace imgtool::qcow2::format {
namespace {

constexpr uint32_t kBits = 16;  // 64 KiB clusters
constexpr uint64_t kSize = uint64_t{10} << 20;

BitmapDirEntry Entry(const std::string& name, uint64_t table = 0x30000) {
  BitmapDirEntry e;
  e.table_offset = table;
  e.table_size = 1;
  e.flags = kBitmapFlagAuto;
  e.granularity_bits = 16;
  e.name = name;
  return e;
}

TEST(BitmapTest, SizesFollowQemu) {
  // 10 MiB at 64 KiB: 160 bits, 3 words.
  EXPECT_EQ(BitmapDataBytes(kSize, 16), 24u);
  EXPECT_EQ(BitmapTableSize(kSize, 16, kBits), 1u);
  // 1 TiB at 512 B: 2^31 bits = 256 MiB = 4096 clusters of 64 KiB.
  EXPECT_EQ(BitmapTableSize(uint64_t{1} << 40, 9, kBits), 4096u);
  EXPECT_EQ(BitmapDataBytes(1, 9), 8u);
  EXPECT_EQ(BitmapDirEntrySize(2), 32u);
  EXPECT_EQ(BitmapDirEntrySize(8), 32u);
  EXPECT_EQ(BitmapDirEntrySize(9), 40u);
}

TEST(BitmapTest, DirectoryRoundTrips) {
  std::vector<BitmapDirEntry> in = {Entry("b0"), Entry("a-longer-name", 0x40000)};
  in[1].flags = kBitmapFlagInUse;
  std::vector<uint8_t> bytes = EncodeBitmapDirectory(in);
  ASSERT_EQ(bytes.size(), 32u + 40u);
  EXPECT_EQ(bytes[16], 1);   // type
  EXPECT_EQ(bytes[17], 16);  // granularity bits
  auto out = DecodeBitmapDirectory(bytes, 2, kBits, kSize);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(*out, in);
}

TEST(BitmapTest, DirectoryErrorsAreQemus) {
  std::vector<uint8_t> bytes = EncodeBitmapDirectory({Entry("b0")});
  EXPECT_EQ(DecodeBitmapDirectory(bytes, 2, kBits, kSize).status().message(),
            "Less bitmaps found than specified in header extension");
  EXPECT_EQ(DecodeBitmapDirectory({}, 1, kBits, kSize).status().message(),
            "Requested bitmap directory size is zero");
  std::vector<uint8_t> two = EncodeBitmapDirectory({Entry("b0"), Entry("b1")});
  EXPECT_EQ(DecodeBitmapDirectory(two, 1, kBits, kSize).status().message(),
            "More bitmaps found than specified in header extension");
  std::vector<uint8_t> cut(bytes.begin(), bytes.end() - 8);
  EXPECT_EQ(DecodeBitmapDirectory(cut, 1, kBits, kSize).status().message(),
            "Broken bitmap directory");
  std::vector<uint8_t> extra = bytes;
  extra[23] = 8;
  extra.resize(40, 0);
  EXPECT_EQ(DecodeBitmapDirectory(extra, 1, kBits, kSize).status().message(),
            "Bitmap extra data is not supported");
  BitmapDirEntry unaligned = Entry("b0", 0x30200);
  EXPECT_EQ(DecodeBitmapDirectory(EncodeBitmapDirectory({unaligned}), 1, kBits,
                                  kSize)
                .status()
                .message(),
            "Bitmap 'b0' doesn't satisfy the constraints");
  BitmapDirEntry huge_name = Entry(std::string(2000, 'x'));
  std::vector<uint8_t> hb = EncodeBitmapDirectory({huge_name});
  EXPECT_FALSE(DecodeBitmapDirectory(hb, 1, kBits, kSize).ok());
  // A table too small for the image is fine only while in use.
  BitmapDirEntry small = Entry("b0");
  small.granularity_bits = 9;  // 10 MiB at 512 B needs 2560 bytes: 1 cluster
  EXPECT_TRUE(BitmapDirEntryValid(small, 9, kSize) == false);
  small.flags |= kBitmapFlagInUse;
  EXPECT_TRUE(BitmapDirEntryValid(small, 9, kSize));
}

TEST(BitmapTest, TableEntries) {
  EXPECT_TRUE(BitmapTableEntryValid(0, 65536));
  EXPECT_TRUE(BitmapTableEntryValid(1, 65536));  // all ones
  EXPECT_TRUE(BitmapTableEntryValid(0x50000, 65536));
  EXPECT_FALSE(BitmapTableEntryValid(0x50001, 65536));
  EXPECT_FALSE(BitmapTableEntryValid(0x50200, 65536));
  EXPECT_FALSE(BitmapTableEntryValid(2, 65536));
  EXPECT_FALSE(BitmapTableEntryValid(uint64_t{1} << 60, 65536));
}

}  // namespace
}  // namespace imgtool::qcow2::format

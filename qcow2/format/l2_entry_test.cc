#include "qcow2/format/l2_entry.h"

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "gtest/gtest.h"
#include "qcow2/format/test_util.h"

namespace imgtool::qcow2::format {
namespace {

using testing::QemuImgCreate;
using testing::ReadFileBytes;
using testing::RunShell;

uint64_t Be64(const std::vector<uint8_t>& b, uint64_t off) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v = (v << 8) | b[off + i];
  return v;
}

// ---- Geometry ---------------------------------------------------------------

TEST(L2GeometryTest, EntriesPerClusterAndL1Size) {
  EXPECT_EQ(L2EntrySize(false), 8u);
  EXPECT_EQ(L2EntrySize(true), 16u);
  EXPECT_EQ(L2EntriesPerCluster(16, false), 8192u);
  EXPECT_EQ(L2EntriesPerCluster(16, true), 4096u);
  EXPECT_EQ(L2EntriesPerCluster(9, false), 64u);
  EXPECT_EQ(L2EntriesPerCluster(21, true), 131072u);
  EXPECT_EQ(BytesPerL1Entry(16, false), uint64_t{512} << 20);
  EXPECT_EQ(L1EntriesForSize(0, 16, false), 0u);
  EXPECT_EQ(L1EntriesForSize(1, 16, false), 1u);
  EXPECT_EQ(L1EntriesForSize(uint64_t{1} << 30, 16, false), 2u);
  EXPECT_EQ(L1EntriesForSize((uint64_t{1} << 30) + 1, 16, false), 3u);
  EXPECT_EQ(L1EntriesForSize(uint64_t{1} << 30, 17, true), 1u);
  EXPECT_EQ(L1EntriesForSize(uint64_t{1} << 30, 16, true), 4u);
  EXPECT_EQ(L1EntriesForSize(uint64_t{1} << 40, 12, false), 524288u);
  // No overflow at the top of the range.
  EXPECT_EQ(L1EntriesForSize(~uint64_t{0}, 21, false), uint64_t{1} << 25);
  EXPECT_EQ(L1EntriesForSize(~uint64_t{0}, 9, false), uint64_t{1} << 49);
}

TEST(L2GeometryTest, GuestOffsetIndexes) {
  // 64 KiB clusters: one L2 table maps 512 MiB.
  const uint64_t off = (uint64_t{3} << 29) + 5 * 65536 + 123;
  EXPECT_EQ(L1Index(off, 16, false), 3u);
  EXPECT_EQ(L2Index(off, 16, false), 5u);
  // 128 KiB clusters with 4 KiB subclusters.
  EXPECT_EQ(SubclusterSize(17), 4096u);
  EXPECT_EQ(SubclusterIndex(0x21000, 17), 1u);
  EXPECT_EQ(SubclusterIndex(0x3ffff, 17), 31u);
  EXPECT_EQ(L2Index(0x21000, 17, true), 1u);
}

// ---- L1 entries -------------------------------------------------------------

TEST(L1EntryTest, DecodeEncode) {
  absl::StatusOr<L1Entry> e = DecodeL1Entry(0x8000000000040000, 16);
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_EQ(e->l2_offset, 0x40000u);
  EXPECT_TRUE(e->copied);
  EXPECT_EQ(EncodeL1Entry(*e), 0x8000000000040000u);
  EXPECT_EQ(EncodeL1Entry(L1Entry{0x50000, false}), 0x50000u);

  absl::StatusOr<L1Entry> zero = DecodeL1Entry(0, 16);
  ASSERT_TRUE(zero.ok());
  EXPECT_EQ(*zero, L1Entry());
}

TEST(L1EntryTest, ReservedBitsAndMisalignmentAreDataLoss) {
  for (uint64_t raw : {uint64_t{0x8000000000040001}, uint64_t{0x0100000000040000},
                       uint64_t{0x4000000000040000}}) {
    absl::Status st = DecodeL1Entry(raw, 16).status();
    EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss) << std::hex << raw;
  }
  EXPECT_EQ(DecodeL1Entry(0x8000000000040001, 16).status().message(),
            "L1 entry 0x8000000000040001 has reserved bits set");
  absl::Status st = DecodeL1Entry(0x41200, 16).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(st.message(), "L2 table offset 0x41200 unaligned (L1 entry 0x41200)");
  EXPECT_TRUE(DecodeL1Entry(0x41200, 9).ok());
}

TEST(L1EntryTest, TableLoadStore) {
  std::vector<uint8_t> table(32, 0);
  StoreL1Entry(absl::MakeSpan(table), 2, 0x8000000000040000);
  EXPECT_EQ(table[16], 0x80);
  EXPECT_EQ(table[21], 0x04);
  EXPECT_EQ(LoadL1Entry(table, 2), 0x8000000000040000u);
  EXPECT_EQ(LoadL1Entry(table, 1), 0u);
}

// ---- Standard L2 entries ----------------------------------------------------

const L2Format kStandard64k{16, false, false};

ClusterType TypeOf(uint64_t word, const L2Format& f = kStandard64k) {
  absl::StatusOr<ClusterType> t = GetClusterType(L2Entry{word, 0}, f);
  EXPECT_TRUE(t.ok()) << std::hex << word << ": " << t.status();
  return t.ok() ? *t : ClusterType::kUnallocated;
}

TEST(L2EntryTest, StandardClusterTypes) {
  EXPECT_EQ(TypeOf(0), ClusterType::kUnallocated);
  EXPECT_EQ(TypeOf(0x1), ClusterType::kZeroPlain);
  EXPECT_EQ(TypeOf(0x8000000000070001), ClusterType::kZeroAlloc);
  EXPECT_EQ(TypeOf(0x70001), ClusterType::kZeroAlloc);
  EXPECT_EQ(TypeOf(0x8000000000050000), ClusterType::kNormal);
  EXPECT_EQ(TypeOf(0x50000), ClusterType::kNormal);  // shared (no COPIED)
  EXPECT_EQ(TypeOf(0x4000000000060000), ClusterType::kCompressed);
  // Offset 0 + COPIED: unallocated, except with an external data file.
  EXPECT_EQ(TypeOf(kCopiedFlag), ClusterType::kUnallocated);
  EXPECT_EQ(TypeOf(kCopiedFlag, L2Format{16, false, true}), ClusterType::kNormal);
  // Extended L2: bit 0 is ignored.
  EXPECT_EQ(TypeOf(0x1, L2Format{16, true, false}), ClusterType::kUnallocated);
  EXPECT_EQ(TypeOf(0x8000000000070001, L2Format{16, true, false}),
            ClusterType::kNormal);
}

TEST(L2EntryTest, ReservedBitsAndMisalignmentAreDataLoss) {
  auto status = [](uint64_t word, const L2Format& f = kStandard64k) {
    return GetClusterType(L2Entry{word, 0}, f).status();
  };
  absl::Status st = status(0x8000000000050002);
  EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(st.message(), "L2 entry 0x8000000000050002 has reserved bits set");
  EXPECT_EQ(status(0x0100000000050000).code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(status(0x2000000000000000).code(), absl::StatusCode::kDataLoss);
  st = status(0x8000000000050200);
  EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(st.message(), "Cluster allocation offset 0x50200 unaligned");
  EXPECT_EQ(status(0x50201).code(), absl::StatusCode::kDataLoss);  // zero alloc
  EXPECT_TRUE(status(0x50200, L2Format{9, false, false}).ok());
  // Compressed: COPIED, external data file, nonzero bitmap.
  EXPECT_EQ(status(0xC000000000060000).code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(status(0x4000000000060000, L2Format{16, false, true}).code(),
            absl::StatusCode::kDataLoss);
  EXPECT_EQ(GetClusterType(L2Entry{0x4000000000060000, 1}, L2Format{16, true, false})
                .status()
                .code(),
            absl::StatusCode::kDataLoss);
  // 512-byte clusters: offset bits 56-60 of a compressed entry are reserved.
  EXPECT_EQ(status(0x4100000000000200, L2Format{9, false, false}).code(),
            absl::StatusCode::kDataLoss);
  EXPECT_TRUE(status(0x4000000000000200, L2Format{9, false, false}).ok());
}

TEST(L2EntryTest, MakeStandardWord) {
  EXPECT_EQ(MakeStandardL2Word(0x50000, true, false), 0x8000000000050000u);
  EXPECT_EQ(MakeStandardL2Word(0x70000, true, true), 0x8000000000070001u);
  EXPECT_EQ(MakeStandardL2Word(0, false, true), 0x1u);
  const L2Entry e{0x8000000000050000, 0};
  EXPECT_TRUE(e.copied());
  EXPECT_FALSE(e.compressed());
  EXPECT_EQ(e.host_offset(), 0x50000u);
}

TEST(L2EntryTest, TableLoadStore) {
  std::vector<uint8_t> table(64, 0);
  StoreL2Entry(absl::MakeSpan(table), 1, true,
               L2Entry{0x80000000000a0000, 0x0000000100000002});
  EXPECT_EQ(Be64(table, 16), 0x80000000000a0000u);
  EXPECT_EQ(Be64(table, 24), 0x0000000100000002u);
  EXPECT_EQ(LoadL2Entry(table, 1, true),
            (L2Entry{0x80000000000a0000, 0x0000000100000002}));
  // Standard entries are 8 bytes and have no bitmap.
  EXPECT_EQ(LoadL2Entry(table, 3, false), (L2Entry{0x0000000100000002, 0}));
  StoreL2Entry(absl::MakeSpan(table), 0, false, L2Entry{0x1, 0xffff});
  EXPECT_EQ(Be64(table, 0), 1u);
  EXPECT_EQ(Be64(table, 8), 0u);
}

// ---- Compressed descriptors -------------------------------------------------

TEST(CompressedTest, Decode) {
  // 128 KiB clusters: compressed at 0xa0000, no additional sector.
  EXPECT_EQ(CompressedSectorShift(17), 53u);
  CompressedDescriptor d = DecodeCompressedDescriptor(0x40000000000A0000, 17);
  EXPECT_EQ(d.host_offset, 0xa0000u);
  EXPECT_EQ(d.additional_sectors, 0u);
  EXPECT_EQ(d.size(), 512u);
  // 64 KiB clusters (x = 54): offset 0x6004f, 2 more sectors.
  d = DecodeCompressedDescriptor(0x400000000006004f | (uint64_t{2} << 54), 16);
  EXPECT_EQ(d.host_offset, 0x6004fu);
  EXPECT_EQ(d.additional_sectors, 2u);
  EXPECT_EQ(d.size(), 3 * 512u - 0x4f);
  // 2 MiB clusters (x = 49): 13-bit count.
  d = DecodeCompressedDescriptor(kCompressedFlag | (uint64_t{0x1fff} << 49) | 0x1234,
                                 21);
  EXPECT_EQ(d.host_offset, 0x1234u);
  EXPECT_EQ(d.additional_sectors, 0x1fffu);
}

TEST(CompressedTest, MakeWordRoundTrips) {
  for (uint32_t bits : {9u, 12u, 16u, 21u}) {
    const uint64_t cs = uint64_t{1} << bits;
    for (uint64_t offset : {uint64_t{0x6004f}, uint64_t{0x200}, uint64_t{0x10001ff}}) {
      for (uint64_t len : {uint64_t{1}, uint64_t{100}, cs / 2, cs}) {
        absl::StatusOr<uint64_t> w = MakeCompressedL2Word(offset, len, bits);
        ASSERT_TRUE(w.ok()) << bits << " " << offset << " " << len << ": "
                            << w.status();
        const CompressedDescriptor d = DecodeCompressedDescriptor(*w, bits);
        EXPECT_EQ(d.host_offset, offset);
        EXPECT_GE(d.size(), len);
        EXPECT_LT(d.size(), len + 512);
        EXPECT_EQ(GetClusterType(L2Entry{*w, 0}, L2Format{bits, false, false})
                      .value_or(ClusterType::kUnallocated),
                  ClusterType::kCompressed);
      }
    }
  }
  EXPECT_EQ(*MakeCompressedL2Word(0xa0000, 300, 17), 0x40000000000A0000u);
  EXPECT_EQ(MakeCompressedL2Word(uint64_t{1} << 49, 10, 21).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MakeCompressedL2Word(0x200, 0, 16).status().code(),
            absl::StatusCode::kInvalidArgument);
  // 512-byte clusters hold at most one additional sector.
  EXPECT_EQ(MakeCompressedL2Word(0x300, 1024, 9).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// ---- Subclusters ------------------------------------------------------------

const L2Format kExtended128k{17, true, false};

TEST(SubclusterTest, TypesPerSubcluster) {
  using S = SubclusterType;
  const L2Entry mixed{0x8000000000120000, 0x0000000100000002};
  EXPECT_EQ(GetSubclusterType(mixed, 0, kExtended128k), S::kZeroAlloc);
  EXPECT_EQ(GetSubclusterType(mixed, 1, kExtended128k), S::kNormal);
  EXPECT_EQ(GetSubclusterType(mixed, 2, kExtended128k), S::kUnallocatedAlloc);
  const L2Entry zero{0, 0xffffffff00000000};
  EXPECT_EQ(GetSubclusterType(zero, 7, kExtended128k), S::kZeroPlain);
  EXPECT_EQ(GetSubclusterType(L2Entry{}, 7, kExtended128k), S::kUnallocatedPlain);
  EXPECT_EQ(GetSubclusterType(L2Entry{0x40000000000e0000, 0}, 3, kExtended128k),
            S::kCompressed);
  // Invalid: alloc + zero for one subcluster (anywhere), or alloc bits
  // without a host cluster.
  EXPECT_EQ(GetSubclusterType(L2Entry{0x80000000000a0000, 0x0000000400000004}, 0,
                              kExtended128k),
            S::kInvalid);
  EXPECT_EQ(GetSubclusterType(L2Entry{0, 0x1}, 5, kExtended128k), S::kInvalid);
  // Standard entries: the cluster's type for every index.
  EXPECT_EQ(GetSubclusterType(L2Entry{0x1, 0}, 9, kStandard64k), S::kZeroPlain);
  EXPECT_EQ(GetSubclusterType(L2Entry{0x70001, 0}, 9, kStandard64k), S::kZeroAlloc);
  EXPECT_EQ(GetSubclusterType(L2Entry{0x70000, 0}, 9, kStandard64k), S::kNormal);
  EXPECT_EQ(GetSubclusterType(L2Entry{}, 9, kStandard64k), S::kUnallocatedPlain);
}

TEST(SubclusterTest, RunsOfSameType) {
  const L2Entry e{0x80000000000c0000, 0x00000008fffffff7};
  EXPECT_EQ(CountSubclustersOfSameType(e, 0, kExtended128k), 3u);
  EXPECT_EQ(CountSubclustersOfSameType(e, 1, kExtended128k), 2u);
  EXPECT_EQ(CountSubclustersOfSameType(e, 3, kExtended128k), 1u);
  EXPECT_EQ(CountSubclustersOfSameType(e, 4, kExtended128k), 28u);
  EXPECT_EQ(CountSubclustersOfSameType(e, 31, kExtended128k), 1u);
  EXPECT_EQ(CountSubclustersOfSameType(L2Entry{}, 5, kExtended128k), 27u);
  EXPECT_EQ(CountSubclustersOfSameType(L2Entry{0x70000, 0}, 0, kStandard64k), 32u);
}

TEST(SubclusterTest, BitmapHelpers) {
  EXPECT_EQ(SubclusterAllocBit(3), 0x8u);
  EXPECT_EQ(SubclusterZeroBit(3), 0x0000000800000000u);
  EXPECT_EQ(SubclusterAllocRange(0, 32), 0xffffffffu);
  EXPECT_EQ(SubclusterAllocRange(5, 2), 0x60u);
  EXPECT_EQ(SubclusterAllocRange(31, 1), 0x80000000u);
  EXPECT_EQ(SubclusterAllocRange(4, 0), 0u);
  EXPECT_EQ(SubclusterZeroRange(0, 32), 0xffffffff00000000u);
}

TEST(SubclusterTest, CheckBitmapUsesQemuCheckWording) {
  EXPECT_TRUE(CheckSubclusterBitmap(L2Entry{0x80000000000a0000, 0x0000000100000002},
                                    kExtended128k)
                  .ok());
  absl::Status st = CheckSubclusterBitmap(
      L2Entry{0x80000000000a0000, 0x0000000400000004}, kExtended128k);
  EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(st.message(),
            "Allocated cluster has corrupted subcluster allocation bitmap "
            "(entry 0x80000000000a0000, bitmap 0x400000004)");
  st = CheckSubclusterBitmap(L2Entry{0, 0x10}, kExtended128k);
  EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(st.message(),
            "Unallocated cluster has non-zero subcluster allocation map "
            "(entry 0x0, bitmap 0x10)");
  EXPECT_TRUE(CheckSubclusterBitmap(L2Entry{0, 0x10}, kStandard64k).ok());
}

// ---- Entries written by qemu-io ---------------------------------------------

struct L2View {
  std::vector<uint8_t> bytes;
  uint64_t l2_offset = 0;
};

// Makes an image with qemu-img, runs qemu-io commands on it and returns the
// file plus the offset of the first L2 table.
L2View MakeWithQemuIo(const std::string& name, const std::string& options,
                      const std::string& size, const std::string& commands) {
  absl::StatusOr<std::string> path = QemuImgCreate(name, options, size);
  EXPECT_TRUE(path.ok()) << path.status();
  if (!path.ok()) return {};
  absl::StatusOr<std::string> out =
      RunShell("qemu-io -f qcow2 " + commands + " '" + *path + "'");
  EXPECT_TRUE(out.ok()) << out.status();
  absl::StatusOr<std::vector<uint8_t>> bytes = ReadFileBytes(*path);
  EXPECT_TRUE(bytes.ok());
  L2View v;
  v.bytes = *bytes;
  const uint32_t cluster_bits = v.bytes[23];
  const uint64_t l1_offset = Be64(v.bytes, 40);
  absl::StatusOr<L1Entry> l1 =
      DecodeL1Entry(LoadL1Entry(absl::MakeConstSpan(v.bytes).subspan(l1_offset), 0),
                    cluster_bits);
  EXPECT_TRUE(l1.ok()) << l1.status();
  EXPECT_TRUE(l1->copied);
  v.l2_offset = l1->l2_offset;
  return v;
}

TEST(L2EntryTest, ClassifiesEntriesWrittenByQemu) {
  const L2View v = MakeWithQemuIo(
      "std.qcow2", "", "1M",
      "-c 'write -P 0xaa 0 64k' -c 'write -z 64k 64k' "
      "-c 'write -c -P 0xbb 128k 64k' -c 'write -P 0xcc 192k 64k' "
      "-c 'write -z 192k 64k' -c 'write -c -P 0xdd 320k 64k'");
  EXPECT_EQ(v.l2_offset, 0x40000u);
  const auto table = absl::MakeConstSpan(v.bytes).subspan(v.l2_offset, 65536);
  auto entry = [&](uint64_t i) { return LoadL2Entry(table, i, false); };
  auto type = [&](uint64_t i) {
    return GetClusterType(entry(i), kStandard64k).value_or(ClusterType::kUnallocated);
  };
  EXPECT_EQ(entry(0).word, 0x8000000000050000u);
  EXPECT_EQ(type(0), ClusterType::kNormal);
  EXPECT_EQ(entry(1).word, 0x1u);
  EXPECT_EQ(type(1), ClusterType::kZeroPlain);
  EXPECT_EQ(entry(2).word, 0x4000000000060000u);
  EXPECT_EQ(type(2), ClusterType::kCompressed);
  EXPECT_EQ(entry(3).word, 0x8000000000070001u);
  EXPECT_EQ(type(3), ClusterType::kZeroAlloc);
  EXPECT_EQ(type(4), ClusterType::kUnallocated);
  EXPECT_EQ(entry(5).word, 0x400000000006004fu);
  EXPECT_EQ(type(5), ClusterType::kCompressed);
  // Two compressed clusters share host sector 0x60000.
  const CompressedDescriptor c2 = DecodeCompressedDescriptor(entry(2).word, 16);
  const CompressedDescriptor c5 = DecodeCompressedDescriptor(entry(5).word, 16);
  EXPECT_EQ(c2.host_offset, 0x60000u);
  EXPECT_EQ(c5.host_offset, 0x6004fu);
  EXPECT_LE(c5.host_offset + c5.size(), v.bytes.size());
}

TEST(SubclusterTest, ClassifiesEntriesWrittenByQemu) {
  const L2View v = MakeWithQemuIo(
      "ext.qcow2", "extended_l2=on,cluster_size=128k", "4M",
      "-c 'write -P 0xaa 0x21000 4k' -c 'write -P 0xaa 0x40000 128k' "
      "-c 'write -z 0x43000 4k' -c 'write -z 0x60000 128k' "
      "-c 'write -c -P 0xbb 0x80000 128k' -c 'write -P 0xcc 0xa0000 128k' "
      "-c 'write -z 0xa0000 128k' -c 'write -P 1 0xc0000 8k' "
      "-c 'write -z 0xc0000 4k'");
  EXPECT_EQ(v.l2_offset, 0x80000u);
  const auto table = absl::MakeConstSpan(v.bytes).subspan(v.l2_offset, 131072);
  auto entry = [&](uint64_t i) { return LoadL2Entry(table, i, true); };
  using S = SubclusterType;
  auto sc = [&](uint64_t i, uint32_t s) {
    return GetSubclusterType(entry(i), s, kExtended128k);
  };
  for (uint64_t i = 0; i < 8; ++i) {
    EXPECT_TRUE(GetClusterType(entry(i), kExtended128k).ok()) << i;
    EXPECT_TRUE(CheckSubclusterBitmap(entry(i), kExtended128k).ok()) << i;
  }
  EXPECT_EQ(entry(0), L2Entry());
  EXPECT_EQ(sc(0, 0), S::kUnallocatedPlain);
  // One 4 KiB write reserves the whole host cluster.
  EXPECT_EQ(entry(1), (L2Entry{0x80000000000a0000, 0x2}));
  EXPECT_EQ(sc(1, 0), S::kUnallocatedAlloc);
  EXPECT_EQ(sc(1, 1), S::kNormal);
  // write -z of one subcluster in an allocated cluster.
  EXPECT_EQ(entry(2), (L2Entry{0x80000000000c0000, 0x00000008fffffff7}));
  EXPECT_EQ(sc(2, 3), S::kZeroAlloc);
  EXPECT_EQ(sc(2, 4), S::kNormal);
  EXPECT_EQ(entry(3), (L2Entry{0, 0xffffffff00000000}));
  EXPECT_EQ(sc(3, 31), S::kZeroPlain);
  EXPECT_EQ(entry(4), (L2Entry{0x40000000000e0000, 0}));
  EXPECT_EQ(sc(4, 0), S::kCompressed);
  EXPECT_EQ(entry(5), (L2Entry{0x8000000000100000, 0xffffffff00000000}));
  EXPECT_EQ(sc(5, 0), S::kZeroAlloc);
  EXPECT_EQ(entry(6), (L2Entry{0x8000000000120000, 0x0000000100000002}));
  EXPECT_EQ(CountSubclustersOfSameType(entry(6), 2, kExtended128k), 30u);
}

}  // namespace
}  // namespace imgtool::qcow2::format

#include "qcow2/format/snapshot.h"

#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "qcow2/format/test_util.h"

namespace imgtool::qcow2::format {
namespace {

using testing::QemuImgCreate;
using testing::ReadFileBytes;
using testing::RunShell;

uint64_t Be(const std::vector<uint8_t>& b, size_t at, int n) {
  uint64_t v = 0;
  for (int i = 0; i < n; ++i) v = (v << 8) | b[at + i];
  return v;
}

// Decodes `nb` entries of `table` as the loaders do (entries padded to 8;
// bytes past the end of `table` read as zeroes); `*end`: the end of the
// last name.
std::vector<SnapshotEntry> Decode(const std::vector<uint8_t>& table,
                                  uint32_t nb, uint64_t default_disk_size,
                                  uint64_t* end = nullptr) {
  auto bytes = [&](uint64_t pos, uint64_t n) {
    std::vector<uint8_t> out(n, 0);
    for (uint64_t i = 0; i < n && pos + i < table.size(); ++i) {
      out[i] = table[pos + i];
    }
    return out;
  };
  std::vector<SnapshotEntry> out;
  uint64_t pos = 0;
  for (uint32_t i = 0; i < nb; ++i) {
    pos = (pos + 7) & ~uint64_t{7};
    const std::vector<uint8_t> header = bytes(pos, kSnapshotHeaderBytes);
    const SnapshotEntryLayout l = DecodeSnapshotEntryLayout(header);
    pos += kSnapshotHeaderBytes;
    const std::vector<uint8_t> extra =
        bytes(pos, std::min(l.extra_data_size, kMaxSnapshotExtraData));
    pos += l.extra_data_size;
    const std::vector<uint8_t> strings =
        bytes(pos, uint64_t{l.id_size} + l.name_size);
    pos += strings.size();
    out.push_back(DecodeSnapshotEntry(header, extra, strings, default_disk_size));
  }
  if (end != nullptr) *end = pos;
  return out;
}

SnapshotEntry Entry(const std::string& id, const std::string& name) {
  SnapshotEntry e;
  e.l1_offset = 0x50000;
  e.l1_size = 2;
  e.date_sec = 1700000000;
  e.date_nsec = 123456789;
  e.vm_clock_nsec = 0x0102030405060708;
  e.vm_state_size = 4096;
  e.extra_data_size = kSnapshotExtraKnownBytes;
  e.disk_size = 64 << 20;
  e.icount = 77;
  e.id = id;
  e.name = name;
  return e;
}

void ExpectSame(const SnapshotEntry& a, const SnapshotEntry& b) {
  EXPECT_EQ(a.l1_offset, b.l1_offset);
  EXPECT_EQ(a.l1_size, b.l1_size);
  EXPECT_EQ(a.date_sec, b.date_sec);
  EXPECT_EQ(a.date_nsec, b.date_nsec);
  EXPECT_EQ(a.vm_clock_nsec, b.vm_clock_nsec);
  EXPECT_EQ(a.vm_state_size, b.vm_state_size);
  EXPECT_EQ(a.extra_data_size, b.extra_data_size);
  EXPECT_EQ(a.disk_size, b.disk_size);
  EXPECT_EQ(a.icount, b.icount);
  EXPECT_EQ(a.unknown_extra, b.unknown_extra);
  EXPECT_EQ(a.id, b.id);
  EXPECT_EQ(a.name, b.name);
}

// The table qemu-img 7.2 writes decodes to what it lists and encodes back
// to the same bytes.
TEST(SnapshotTest, QemuImgTableRoundTrips) {
  absl::StatusOr<std::string> path = QemuImgCreate("sn.qcow2", "", "3M");
  ASSERT_TRUE(path.ok()) << path.status();
  ASSERT_TRUE(RunShell(absl::StrCat("qemu-img snapshot -c first ", *path,
                                    " && qemu-img snapshot -c s2-longer-name ",
                                    *path, " && qemu-img snapshot -c x ", *path))
                  .ok());
  absl::StatusOr<std::vector<uint8_t>> file = ReadFileBytes(*path);
  ASSERT_TRUE(file.ok()) << file.status();
  const uint32_t nb = static_cast<uint32_t>(Be(*file, 60, 4));
  const uint64_t offset = Be(*file, 64, 8);
  ASSERT_EQ(nb, 3u);
  std::vector<uint8_t> stored(file->begin() + offset, file->end());
  uint64_t end = 0;
  std::vector<SnapshotEntry> entries = Decode(stored, nb, 0, &end);
  ASSERT_EQ(entries.size(), 3u);
  EXPECT_EQ(entries[0].id, "1");
  EXPECT_EQ(entries[0].name, "first");
  EXPECT_EQ(entries[1].id, "2");
  EXPECT_EQ(entries[1].name, "s2-longer-name");
  EXPECT_EQ(entries[2].id, "3");
  EXPECT_EQ(entries[2].name, "x");
  for (const SnapshotEntry& e : entries) {
    EXPECT_EQ(e.extra_data_size, kSnapshotExtraKnownBytes);
    EXPECT_EQ(e.disk_size, uint64_t{3} << 20);
    EXPECT_EQ(e.vm_state_size, 0u);
    EXPECT_EQ(e.icount, 0u);  // qemu-img stores 0 (no replay)
    EXPECT_EQ(e.l1_size, 1u);
    EXPECT_EQ(e.l1_offset % 65536, 0u);
    EXPECT_TRUE(e.unknown_extra.empty());
  }
  // 40 + 24 + 1 + 5 = 70, padded to 72; + 40 + 24 + 1 + 14 = 151, padded
  // to 152; + 40 + 24 + 1 + 1 = 218.
  EXPECT_EQ(end, 218u);
  EXPECT_EQ(SnapshotTableBytes(entries), 218u);
  stored.resize(end);
  EXPECT_EQ(EncodeSnapshotTable(entries), stored);
}

TEST(SnapshotTest, EncodesFieldsAtSpecOffsets) {
  SnapshotEntry e = Entry("7", "ab");
  const std::vector<uint8_t> b = EncodeSnapshotTable({e});
  ASSERT_EQ(b.size(), 40u + 24 + 3);
  EXPECT_EQ(Be(b, 0, 8), 0x50000u);
  EXPECT_EQ(Be(b, 8, 4), 2u);
  EXPECT_EQ(Be(b, 12, 2), 1u);
  EXPECT_EQ(Be(b, 14, 2), 2u);
  EXPECT_EQ(Be(b, 16, 4), 1700000000u);
  EXPECT_EQ(Be(b, 20, 4), 123456789u);
  EXPECT_EQ(Be(b, 24, 8), 0x0102030405060708u);
  EXPECT_EQ(Be(b, 32, 4), 4096u);
  EXPECT_EQ(Be(b, 36, 4), 24u);
  EXPECT_EQ(Be(b, 40, 8), 4096u);
  EXPECT_EQ(Be(b, 48, 8), uint64_t{64} << 20);
  EXPECT_EQ(Be(b, 56, 8), 77u);
  EXPECT_EQ(std::string(b.begin() + 64, b.end()), "7ab");
}

TEST(SnapshotTest, PadsEntriesToEightWithZeroes) {
  std::vector<SnapshotEntry> in = {Entry("1", "a"), Entry("22", "bbb"),
                                   Entry("3", "")};
  const std::vector<uint8_t> b = EncodeSnapshotTable(in);
  // 66 -> 72, 72 + 69 = 141 -> 144, 144 + 65 = 209.
  ASSERT_EQ(b.size(), 209u);
  for (size_t i = 66; i < 72; ++i) EXPECT_EQ(b[i], 0) << i;
  for (size_t i = 141; i < 144; ++i) EXPECT_EQ(b[i], 0) << i;
  std::vector<SnapshotEntry> out = Decode(b, 3, 0);
  ASSERT_EQ(out.size(), 3u);
  for (int i = 0; i < 3; ++i) ExpectSame(in[i], out[i]);
}

TEST(SnapshotTest, ShortExtraDataTakesQemuDefaults) {
  // A version 2 style entry: no extra data.
  std::vector<uint8_t> b = EncodeSnapshotTable({Entry("1", "n")});
  b[36] = b[37] = b[38] = b[39] = 0;  // extra_data_size 0
  b.erase(b.begin() + 40, b.begin() + 64);
  SnapshotEntry e = Decode(b, 1, 1 << 20)[0];
  EXPECT_EQ(e.extra_data_size, 0u);
  EXPECT_EQ(e.vm_state_size, 4096u);  // the 32-bit field
  EXPECT_EQ(e.disk_size, uint64_t{1} << 20);
  EXPECT_EQ(e.icount, ~uint64_t{0});
  EXPECT_EQ(e.id, "1");
  EXPECT_EQ(e.name, "n");
  // Written back with the 24 known bytes, as qcow2_write_snapshots.
  const std::vector<uint8_t> again = EncodeSnapshotTable({e});
  EXPECT_EQ(Be(again, 36, 4), 24u);
  EXPECT_EQ(Be(again, 48, 8), uint64_t{1} << 20);
  EXPECT_EQ(Be(again, 56, 8), ~uint64_t{0});

  // 8 bytes: vm_state_size_large only.
  std::vector<uint8_t> b8 = EncodeSnapshotTable({Entry("1", "n")});
  b8[39] = 8;
  b8.erase(b8.begin() + 48, b8.begin() + 64);
  e = Decode(b8, 1, 5 << 20)[0];
  EXPECT_EQ(e.extra_data_size, 8u);
  EXPECT_EQ(e.vm_state_size, 4096u);
  EXPECT_EQ(e.disk_size, uint64_t{5} << 20);
  EXPECT_EQ(e.icount, ~uint64_t{0});
  EXPECT_EQ(e.name, "n");

  // 16 bytes: and disk_size, no icount.
  std::vector<uint8_t> b16 = EncodeSnapshotTable({Entry("1", "n")});
  b16[39] = 16;
  b16.erase(b16.begin() + 56, b16.begin() + 64);
  e = Decode(b16, 1, 5 << 20)[0];
  EXPECT_EQ(e.extra_data_size, 16u);
  EXPECT_EQ(e.disk_size, uint64_t{64} << 20);
  EXPECT_EQ(e.icount, ~uint64_t{0});
}

TEST(SnapshotTest, UnknownExtraDataKeptAndCut) {
  SnapshotEntry e = Entry("1", "n");
  e.extra_data_size = 40;
  e.unknown_extra.assign(16, 0xab);
  std::vector<uint8_t> b = EncodeSnapshotTable({e});
  ASSERT_EQ(b.size(), 40u + 40 + 2);
  ExpectSame(Decode(b, 1, 0)[0], e);
  EXPECT_EQ(EncodeSnapshotTable(Decode(b, 1, 0)), b);

  // More than 1024 bytes: what check -r all keeps are the first 1024.
  SnapshotEntry big = Entry("9", "big");
  big.extra_data_size = 2000;
  big.unknown_extra.resize(2000 - 24);
  for (size_t i = 0; i < big.unknown_extra.size(); ++i) {
    big.unknown_extra[i] = static_cast<uint8_t>(i);
  }
  b = EncodeSnapshotTable({big});
  const SnapshotEntryLayout l = DecodeSnapshotEntryLayout(b);
  EXPECT_EQ(l.extra_data_size, 2000u);
  const std::vector<uint8_t> header(b.begin(), b.begin() + 40);
  const std::vector<uint8_t> kept(b.begin() + 40, b.begin() + 40 + 1024);
  const std::vector<uint8_t> strings(b.begin() + 40 + 2000, b.end());
  SnapshotEntry cut = DecodeSnapshotEntry(header, kept, strings, 0);
  EXPECT_EQ(cut.extra_data_size, 1024u);
  ASSERT_EQ(cut.unknown_extra.size(), 1000u);
  EXPECT_EQ(cut.unknown_extra[999], static_cast<uint8_t>(999));
  EXPECT_EQ(cut.id, "9");
  EXPECT_EQ(cut.name, "big");
  EXPECT_EQ(SnapshotEntryBytes(cut), 40u + 1024 + 4);
}

TEST(SnapshotTest, LongIdsAndNamesAndLargeVmState) {
  SnapshotEntry e = Entry(std::string(65535, 'i'), std::string(65535, 'n'));
  e.vm_state_size = uint64_t{5} << 32;
  const std::vector<uint8_t> b = EncodeSnapshotTable({e});
  ASSERT_EQ(b.size(), 40u + 24 + 2 * 65535);
  EXPECT_EQ(Be(b, 12, 2), 65535u);
  EXPECT_EQ(Be(b, 14, 2), 65535u);
  EXPECT_EQ(Be(b, 32, 4), 0u);  // does not fit in 32 bits
  EXPECT_EQ(Be(b, 40, 8), uint64_t{5} << 32);
  ExpectSame(Decode(b, 1, 0)[0], e);
}

TEST(SnapshotTest, ZeroBytesDecodeAsEmptyEntries) {
  // A table past the end of the file reads as zeroes.
  uint64_t end = 0;
  std::vector<SnapshotEntry> out = Decode({}, 3, 7 << 20, &end);
  ASSERT_EQ(out.size(), 3u);
  for (const SnapshotEntry& e : out) {
    EXPECT_EQ(e.l1_offset, 0u);
    EXPECT_EQ(e.l1_size, 0u);
    EXPECT_EQ(e.extra_data_size, 0u);
    EXPECT_EQ(e.disk_size, uint64_t{7} << 20);
    EXPECT_EQ(e.icount, ~uint64_t{0});
    EXPECT_TRUE(e.id.empty());
    EXPECT_TRUE(e.name.empty());
  }
  EXPECT_EQ(end, 40u * 3);
  EXPECT_EQ(SnapshotTableBytes(out), 64u * 2 + 64);
  EXPECT_TRUE(EncodeSnapshotTable({}).empty());
}

}  // namespace
}  // namespace imgtool::qcow2::format

#include "qcow2/format/layout.h"

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "qcow2/format/header.h"
#include "qcow2/format/test_util.h"

namespace imgtool::qcow2::format {
namespace {

using testing::ReadFileBytes;
using testing::RunShell;
using testing::TempPath;
using ::testing::HasSubstr;

constexpr uint64_t kKiB = 1024;
constexpr uint64_t kMiB = 1024 * kKiB;
constexpr uint64_t kTiB = kMiB * kMiB;

// The `-o` string qemu-img needs for `o` (size goes on the command line).
std::string QemuOptions(const NewImageOptions& o) {
  std::vector<std::string> opts;
  opts.push_back(absl::StrCat("cluster_size=", o.cluster_size));
  opts.push_back(absl::StrCat("refcount_bits=", o.refcount_bits));
  opts.push_back(o.version == 2 ? "compat=0.10" : "compat=1.1");
  if (o.extended_l2) opts.push_back("extended_l2=on");
  if (o.lazy_refcounts) opts.push_back("lazy_refcounts=on");
  if (o.compression_type == kCompressionZstd) opts.push_back("compression_type=zstd");
  if (o.backing_file) opts.push_back("backing_file=" + *o.backing_file);
  if (o.backing_format) opts.push_back("backing_fmt=" + *o.backing_format);
  if (o.data_file) opts.push_back("data_file=" + *o.data_file);
  if (o.data_file_raw) opts.push_back("data_file_raw=on");
  return absl::StrJoin(opts, ",");
}

// Runs qemu-img create; returns the file bytes, or the error output.
absl::StatusOr<std::vector<uint8_t>> QemuCreate(const NewImageOptions& o) {
  const std::string path = TempPath("layout.qcow2");
  absl::StatusOr<std::string> out =
      RunShell(absl::StrCat("rm -f '", path, "' && cd '", TempPath(""),
                            "' && qemu-img create -q -f qcow2 -o '",
                            QemuOptions(o), "' '", path, "' ", o.size));
  if (!out.ok()) return out.status();
  return ReadFileBytes(path);
}

// The file NewImageContents() describes.
std::vector<uint8_t> Assemble(const NewImageOptions& o, const NewImageLayout& l) {
  std::vector<uint8_t> file(l.file_size, 0);
  for (const FileExtent& e : NewImageContents(o, l)) {
    EXPECT_LE(e.offset + e.bytes.size(), file.size());
    std::copy(e.bytes.begin(), e.bytes.end(), file.begin() + e.offset);
  }
  return file;
}

std::string Describe(const NewImageOptions& o) {
  return absl::StrCat(QemuOptions(o), " size=", o.size);
}

// qemu-img's file and ours are byte-identical.
void ExpectIdenticalToQemu(const NewImageOptions& o) {
  SCOPED_TRACE(Describe(o));
  absl::StatusOr<NewImageLayout> l = ComputeNewImageLayout(o);
  ASSERT_TRUE(l.ok()) << l.status();
  absl::StatusOr<std::vector<uint8_t>> qemu = QemuCreate(o);
  ASSERT_TRUE(qemu.ok()) << qemu.status();
  const std::vector<uint8_t> ours = Assemble(o, *l);
  ASSERT_EQ(ours.size(), qemu->size());
  EXPECT_TRUE(ours == *qemu) << "contents differ";
  // And the header decodes to what we say.
  absl::StatusOr<Header> h = DecodeHeader(*qemu, qemu->size());
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(h->l1_size, l->l1_size);
  EXPECT_EQ(h->l1_table_offset, l->l1_table_offset);
  EXPECT_EQ(h->size, l->virtual_size);
}

NewImageOptions Opts(uint64_t cluster_size, uint64_t size) {
  NewImageOptions o;
  o.cluster_size = cluster_size;
  o.size = size;
  return o;
}

TEST(LayoutTest, DefaultImageLayout) {
  absl::StatusOr<NewImageLayout> l = ComputeNewImageLayout(Opts(64 * kKiB, 1 << 30));
  ASSERT_TRUE(l.ok()) << l.status();
  NewImageLayout want;
  want.cluster_bits = 16;
  want.refcount_order = 4;
  want.virtual_size = 1 << 30;
  want.refcount_table_offset = 0x10000;
  want.refcount_table_clusters = 1;
  want.refcount_block_offsets = {0x20000};
  want.l1_table_offset = 0x30000;
  want.l1_size = 2;
  want.allocated_clusters = 4;
  want.file_size = 0x30010;
  want.metadata = {{0x10000, {0, 0, 0, 0, 0, 2}},  // trailing zeros trimmed
                   {0x20000, {0, 1, 0, 1, 0, 1, 0, 1}}};
  EXPECT_EQ(l->refcount_block_offsets, want.refcount_block_offsets);
  ASSERT_EQ(l->metadata.size(), 2u);
  EXPECT_EQ(l->metadata[0].offset, 0x10000u);
  EXPECT_EQ(l->metadata[0].bytes, want.metadata[0].bytes);
  EXPECT_EQ(l->metadata[1].offset, 0x20000u);
  EXPECT_EQ(l->metadata[1].bytes, want.metadata[1].bytes);
  EXPECT_EQ(*l, want);
}

TEST(LayoutTest, EmptyImageHasNoL1Table) {
  absl::StatusOr<NewImageLayout> l = ComputeNewImageLayout(Opts(2 * kMiB, 0));
  ASSERT_TRUE(l.ok());
  EXPECT_EQ(l->l1_size, 0u);
  EXPECT_EQ(l->l1_table_offset, 0u);
  EXPECT_EQ(l->allocated_clusters, 3u);
  EXPECT_EQ(l->file_size, 6 * kMiB);
}

TEST(LayoutTest, SizeIsRoundedUpToSectors) {
  absl::StatusOr<NewImageLayout> l = ComputeNewImageLayout(Opts(64 * kKiB, 1000));
  ASSERT_TRUE(l.ok());
  EXPECT_EQ(l->virtual_size, 1024u);
  ExpectIdenticalToQemu(Opts(64 * kKiB, 1000));
}

TEST(LayoutTest, MatrixIsByteIdenticalToQemuImg) {
  for (uint64_t cs : {uint64_t{512}, 4 * kKiB, 64 * kKiB, 2 * kMiB}) {
    for (uint64_t size : {uint64_t{0}, kMiB, 64 * kMiB, kTiB, 16 * kTiB}) {
      for (bool extended : {false, true}) {
        if (extended && cs < 16 * kKiB) continue;
        NewImageOptions o = Opts(cs, size);
        o.extended_l2 = extended;
        absl::StatusOr<NewImageLayout> l = ComputeNewImageLayout(o);
        if (!l.ok()) {
          // qemu-img refuses exactly these sizes, with the same message.
          SCOPED_TRACE(Describe(o));
          EXPECT_EQ(l.status().code(), absl::StatusCode::kInvalidArgument);
          absl::StatusOr<std::vector<uint8_t>> qemu = QemuCreate(o);
          ASSERT_FALSE(qemu.ok());
          EXPECT_THAT(std::string(qemu.status().message()),
                      HasSubstr(std::string(l.status().message())));
          continue;
        }
        ExpectIdenticalToQemu(o);
      }
    }
  }
}

TEST(LayoutTest, TooLargeSizesMatchQemuImg) {
  // 512-byte clusters: 32 MiB of L1 maps exactly 128 GiB.
  EXPECT_TRUE(ComputeNewImageLayout(Opts(512, 128 * 1024 * kMiB)).ok());
  const absl::Status st = ComputeNewImageLayout(Opts(512, 128 * 1024 * kMiB + 512)).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(st.message(),
            "The image size is too large for file format 'qcow2' (try using a "
            "larger cluster size)");
  EXPECT_FALSE(ComputeNewImageLayout(Opts(2 * kMiB, uint64_t{1} << 62)).ok());
  EXPECT_EQ(ComputeNewImageLayout(Opts(2 * kMiB, ~uint64_t{0})).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(LayoutTest, OptionsAreByteIdenticalToQemuImg) {
  ASSERT_TRUE(RunShell("qemu-img create -q -f raw '" + TempPath("base.raw") +
                       "' 1M")
                  .ok());
  for (uint32_t bits : {1u, 2u, 4u, 8u, 16u, 32u, 64u}) {
    NewImageOptions o = Opts(64 * kKiB, 64 * kMiB);
    o.refcount_bits = bits;
    ExpectIdenticalToQemu(o);
  }
  for (uint64_t cs : {uint64_t{512}, 64 * kKiB}) {
    NewImageOptions v2 = Opts(cs, kMiB);
    v2.version = 2;
    ExpectIdenticalToQemu(v2);
    v2.backing_file = "base.raw";
    v2.backing_format = "raw";
    ExpectIdenticalToQemu(v2);
  }
  NewImageOptions lazy = Opts(64 * kKiB, kMiB);
  lazy.lazy_refcounts = true;
  ExpectIdenticalToQemu(lazy);
  NewImageOptions zstd = Opts(64 * kKiB, kMiB);
  zstd.compression_type = kCompressionZstd;
  ExpectIdenticalToQemu(zstd);
  for (uint64_t cs : {4 * kKiB, 64 * kKiB}) {
    NewImageOptions backing = Opts(cs, kMiB);
    backing.backing_file = "base.raw";
    backing.backing_format = "raw";
    ExpectIdenticalToQemu(backing);
  }
  NewImageOptions data = Opts(64 * kKiB, kMiB);
  data.data_file = TempPath("data.raw");
  ExpectIdenticalToQemu(data);
  for (uint64_t cs : {16 * kKiB, 128 * kKiB, 512 * kKiB}) {
    NewImageOptions el2 = Opts(cs, 1 << 30);
    el2.extended_l2 = true;
    ExpectIdenticalToQemu(el2);
  }
  // Largest 4k-cluster image whose L1 table (clusters 3..2047) still fits
  // the first refcount block (2048 clusters), and the next size up.
  ExpectIdenticalToQemu(Opts(4 * kKiB, 2045 * 1024 * kMiB));
  ExpectIdenticalToQemu(Opts(4 * kKiB, 2045 * 1024 * kMiB + 512));
}

TEST(LayoutTest, InvalidOptionsUseQemuImgMessages) {
  struct Case {
    NewImageOptions options;
    const char* message;
  };
  std::vector<Case> cases;
  auto add = [&](auto edit, const char* message) {
    NewImageOptions o = Opts(64 * kKiB, kMiB);
    edit(o);
    cases.push_back({o, message});
  };
  add([](NewImageOptions& o) { o.cluster_size = 4 * kMiB; },
      "Cluster size must be a power of two between 512 and 2048k");
  add([](NewImageOptions& o) { o.cluster_size = 1000; },
      "Cluster size must be a power of two between 512 and 2048k");
  add([](NewImageOptions& o) { o.refcount_bits = 3; },
      "Refcount width must be a power of two and may not exceed 64 bits");
  add([](NewImageOptions& o) { o.version = 2; o.refcount_bits = 8; },
      "Different refcount widths than 16 bits require compatibility level 1.1 "
      "or above (use version=v3 or greater)");
  add([](NewImageOptions& o) { o.cluster_size = 8 * kKiB; o.extended_l2 = true; },
      "Extended L2 entries are only supported with cluster sizes of at least "
      "16384 bytes");
  add([](NewImageOptions& o) { o.version = 2; o.extended_l2 = true; },
      "Extended L2 entries are only supported with compatibility level 1.1 and "
      "above (use version=v3 or greater)");
  add([](NewImageOptions& o) { o.version = 2; o.lazy_refcounts = true; },
      "Lazy refcounts only supported with compatibility level 1.1 and above "
      "(use version=v3 or greater)");
  add([](NewImageOptions& o) { o.version = 2; o.compression_type = kCompressionZstd; },
      "Non-zlib compression type is only supported with compatibility level "
      "1.1 and above (use version=v3 or greater)");
  add([](NewImageOptions& o) { o.backing_format = "raw"; },
      "Backing format cannot be used without backing file");
  add([](NewImageOptions& o) { o.version = 2; o.data_file = "d.raw"; },
      "External data files are only supported with compatibility level 1.1 and "
      "above (use version=v3 or greater)");
  add([](NewImageOptions& o) { o.data_file_raw = true; },
      "data-file-raw requires data-file");
  add([](NewImageOptions& o) {
        o.data_file = "d.raw";
        o.data_file_raw = true;
        o.backing_file = "base.raw";
        o.backing_format = "raw";
      },
      "Backing file and data-file-raw cannot be used at the same time");
  for (const Case& c : cases) {
    SCOPED_TRACE(Describe(c.options));
    const absl::Status st = ComputeNewImageLayout(c.options).status();
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(st.message(), c.message);
    absl::StatusOr<std::vector<uint8_t>> qemu = QemuCreate(c.options);
    ASSERT_FALSE(qemu.ok());
    EXPECT_THAT(std::string(qemu.status().message()), HasSubstr(c.message));
  }
}

TEST(LayoutTest, ExtraRefcountBlocksAndTableGrowthMatchQemuImg) {
  struct Case {
    uint64_t cluster_size;
    uint32_t refcount_bits;
    uint64_t size;
  };
  const Case cases[] = {
      {512, 16, 4ull << 30},    // blocks after the L1 table, table has room
      {512, 1, 1ull << 30},     // 1-bit refcounts: one block covers 2 MiB
      {512, 64, 1ull << 30},    // 64-bit: blocks describe each other
      {512, 16, 64ull << 30},   // refcount table grows to 4 clusters
      {512, 64, 32ull << 30},   // grows to 7 clusters
      {512, 16, 128ull << 30},  // the largest 512-byte-cluster image
      {4096, 16, 4 * kTiB},
      {4096, 64, 8 * kTiB},
      {16384, 16, 64 * kTiB},
  };
  for (const Case& c : cases) {
    NewImageOptions o = Opts(c.cluster_size, c.size);
    o.refcount_bits = c.refcount_bits;
    ExpectIdenticalToQemu(o);
  }
}

TEST(LayoutTest, RefcountTableGrowthLayout) {
  // 512-byte clusters, 64 GiB: the L1 table (32768 clusters) starts at
  // cluster 3; block 1 follows it, block 128 (which covers block 1) comes
  // next, blocks 2-127 after that; the table grows to 4 clusters placed after
  // block 129, and the old one at 0x200 is left behind.
  absl::StatusOr<NewImageLayout> l = ComputeNewImageLayout(Opts(512, 64ull << 30));
  ASSERT_TRUE(l.ok()) << l.status();
  EXPECT_EQ(l->l1_table_offset, 0x600u);
  EXPECT_EQ(l->l1_size, 2097152u);
  EXPECT_EQ(l->refcount_table_offset, 0x1020200u);
  EXPECT_EQ(l->refcount_table_clusters, 4u);
  ASSERT_EQ(l->refcount_block_offsets.size(), 130u);
  EXPECT_EQ(l->refcount_block_offsets[0], 0x400u);
  EXPECT_EQ(l->refcount_block_offsets[1], 0x1000600u);
  EXPECT_EQ(l->refcount_block_offsets[2], 0x1000a00u);
  EXPECT_EQ(l->refcount_block_offsets[127], 0x1010400u);
  EXPECT_EQ(l->refcount_block_offsets[128], 0x1000800u);
  EXPECT_EQ(l->refcount_block_offsets[129], 0x1020000u);
  EXPECT_EQ(l->file_size, 0x1020a00u);
  // Header, block 0, L1 table, blocks 1-129 and the new table; the old
  // table's cluster and the gap before the block boundary at 0x1020000 (where
  // the new table area starts) are free.
  EXPECT_EQ(l->allocated_clusters, 1u + 1u + 32768u + 129u + 4u);
}

TEST(LayoutTest, DataFileRawIsUnimplemented) {
  NewImageOptions raw = Opts(64 * kKiB, kMiB);
  raw.data_file = "d.raw";
  raw.data_file_raw = true;
  EXPECT_EQ(ComputeNewImageLayout(raw).status().code(),
            absl::StatusCode::kUnimplemented);
}

}  // namespace
}  // namespace imgtool::qcow2::format

// Qcow2Node on real files, with qemu-img and qemu-io as the oracle: data
// written through the driver must pass `qemu-img check` and compare equal
// with a raw reference, images written by QEMU must read back right.
#include "qcow2/qcow2_node.h"

#include <algorithm>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/testing/small_stack.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "io/chain_status.h"
#include "qcow2/bytes.h"
#include "qcow2/create.h"
#include "qcow2/test_util.h"

namespace imgtool::qcow2 {
namespace {

using ::testing::HasSubstr;
using testing::Env;
using testing::Pattern;
using testing::ReadFile;
using testing::RunMixedBatches;
using testing::Shell;
using testing::ShellResult;
using testing::TempPath;
using testing::WriteFile;

constexpr uint64_t kMiB = 1 << 20;

class Qcow2NodeTest : public ::testing::Test {
 protected:
  std::string Create(const std::string& name, uint64_t size,
                     Qcow2CreateOptions options = Qcow2CreateOptions()) {
    const std::string path = TempPath(name);
    options.set_size(size);
    auto file = env_.CreateEmpty(path);
    EXPECT_TRUE(file.ok()) << file.status();
    absl::Status st = env_.Run(CreateQcow2(**file, options));
    EXPECT_TRUE(st.ok()) << st;
    EXPECT_TRUE(env_.Run((*file)->Close()).ok());
    return path;
  }

  std::unique_ptr<Qcow2Node> Open(const std::string& path, bool read_only = false,
                                  Qcow2OpenOptions options = Qcow2OpenOptions()) {
    auto node = env_.OpenQcow2(path, read_only, options);
    EXPECT_TRUE(node.ok()) << node.status();
    return node.ok() ? *std::move(node) : nullptr;
  }

  void Close(std::unique_ptr<Qcow2Node>& node) {
    absl::Status st = env_.Run(node->Close());
    EXPECT_TRUE(st.ok()) << st;
    node.reset();
  }

  void Write(Qcow2Node& node, uint64_t offset, const std::vector<uint8_t>& data) {
    absl::Status st = env_.Run(node.Write(offset, io::ConstIoVec(data)));
    ASSERT_TRUE(st.ok()) << st;
  }

  // Reads and partly rewrites the compressed clusters of an image that
  // `qemu-img convert -c -o CREATE_OPTIONS` made.
  void ReadsAndRewritesCompressed(const std::string& create_options);
  // Compressed writes through the driver make the same file as `qemu-img
  // convert -c -o compression_type=COMPRESSION_TYPE`.
  void CompressedWritesMatchConvert(const std::string& compression_type);

  std::vector<uint8_t> Read(io::BlockNode& node, uint64_t offset, uint64_t length) {
    std::vector<uint8_t> buf(length, 0xee);
    absl::Status st = env_.Run(node.Read(offset, io::IoVec(buf)));
    EXPECT_TRUE(st.ok()) << st;
    return buf;
  }

  // `qemu-img check` must find nothing at all.
  void ExpectClean(const std::string& path) {
    ShellResult r = Shell("qemu-img check " + path);
    EXPECT_EQ(r.exit_code, 0) << r.output;
    EXPECT_THAT(r.output, HasSubstr("No errors were found on the image."));
  }

  // `qemu-img compare` of the image with the raw bytes `expected`.
  void ExpectContents(const std::string& path, const std::vector<uint8_t>& expected) {
    const std::string raw = path + ".expected.raw";
    WriteFile(raw, expected);
    ShellResult r = Shell("qemu-img compare -f qcow2 -F raw " + path + " " + raw);
    EXPECT_EQ(r.exit_code, 0) << r.output;
  }

  // The image as QEMU reads it.
  std::vector<uint8_t> QemuRead(const std::string& path) {
    const std::string raw = path + ".qemu.raw";
    ShellResult r = Shell("qemu-img convert -O raw " + path + " " + raw);
    EXPECT_EQ(r.exit_code, 0) << r.output;
    return ReadFile(raw);
  }

  Env env_;
};

// Random writes (unaligned offsets and lengths, some spanning clusters)
// through the driver, mirrored into a reference buffer.
void RandomWrites(Qcow2NodeTest* t, Qcow2Node& node, std::vector<uint8_t>& ref,
                  int count, uint64_t max_length, uint64_t seed,
                  const std::function<void(uint64_t, const std::vector<uint8_t>&)>& write) {
  std::mt19937_64 rng(seed);
  for (int i = 0; i < count; ++i) {
    const uint64_t length = 1 + rng() % max_length;
    const uint64_t offset = rng() % (ref.size() - length);
    std::vector<uint8_t> data = Pattern(length, seed * 1000 + i);
    write(offset, data);
    std::copy(data.begin(), data.end(), ref.begin() + offset);
  }
}

TEST_F(Qcow2NodeTest, RandomWritesPassCheckAndCompare) {
  struct Variant {
    const char* name;
    uint64_t cluster_size;
    const char* compat;
    uint32_t refcount_bits;
  };
  for (const Variant& v : {Variant{"w64k", 65536, "1.1", 16},
                           Variant{"w512", 512, "1.1", 16},
                           Variant{"w4k_v2", 4096, "0.10", 16},
                           Variant{"w4k_rc1", 4096, "1.1", 1},
                           Variant{"w16k_rc64", 16384, "1.1", 64},
                           Variant{"w2m", 2 << 20, "1.1", 8}}) {
    SCOPED_TRACE(v.name);
    Qcow2CreateOptions o;
    o.set_cluster_size(v.cluster_size);
    o.set_compat(v.compat);
    o.set_refcount_bits(v.refcount_bits);
    const uint64_t size = 16 * kMiB;
    const std::string path = Create(v.name, size, o);
    std::vector<uint8_t> ref(size, 0);
    auto node = Open(path);
    ASSERT_NE(node, nullptr);
    RandomWrites(this, *node, ref, 300,
                 std::min<uint64_t>(3 * v.cluster_size + 1000, 1 << 20), 7,
                 [&](uint64_t off, const std::vector<uint8_t>& d) { Write(*node, off, d); });
    EXPECT_EQ(Read(*node, 0, size), ref);
    Close(node);
    ExpectClean(path);
    ExpectContents(path, ref);
    // And again after reopening (metadata came from the file).
    node = Open(path, /*read_only=*/true);
    EXPECT_EQ(Read(*node, 0, size), ref);
    Close(node);
  }
}

TEST_F(Qcow2NodeTest, FirstWriteLaysOutLikeQemu) {
  const std::string path = Create("layout", 1 << 30);
  auto node = Open(path);
  Write(*node, 0, Pattern(4096, 1));
  Close(node);
  // qcow2-format.md §11: L2 table at 0x40000, data at 0x50000.
  ShellResult r = Shell("qemu-img map --output=json " + path);
  EXPECT_THAT(r.output, HasSubstr("\"start\": 0, \"length\": 65536, \"depth\": 0, "
                                  "\"present\": true, \"zero\": false, \"data\": true, "
                                  "\"offset\": 327680}"));
  const std::vector<uint8_t> file = ReadFile(path);
  ASSERT_GE(file.size(), 0x40008u);
  EXPECT_EQ(file[0x30000], 0x80);  // L1[0] = COPIED | 0x40000
  EXPECT_EQ(file[0x30005], 0x04);
  EXPECT_EQ(file.size(), 0x60000u);
}

TEST_F(Qcow2NodeTest, ReadsWhatQemuIoWrote) {
  const std::string path = TempPath("qemuio.qcow2");
  ASSERT_EQ(Shell("qemu-img create -q -f qcow2 " + path + " 8M").exit_code, 0);
  ShellResult r = Shell("qemu-io -f qcow2 -c 'write -P 0x5a 100k 300k' "
                        "-c 'write -z 1M 64k' -c 'write -P 0x11 2M 1M' "
                        "-c 'write -z -u 2M 128k' -c 'discard 2304k 64k' "
                        "-c 'write -P 0x77 7M 100' " + path);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::vector<uint8_t> expected = QemuRead(path);
  ASSERT_EQ(expected.size(), 8 * kMiB);
  auto node = Open(path, /*read_only=*/true);
  EXPECT_EQ(Read(*node, 0, 8 * kMiB), expected);
  // Unaligned reads across cluster and type boundaries.
  EXPECT_EQ(Read(*node, 1000, 500000),
            std::vector<uint8_t>(expected.begin() + 1000, expected.begin() + 501000));
  // Past the end: zeroes.
  EXPECT_EQ(Read(*node, 8 * kMiB - 10, 20)[15], 0);
  Close(node);
}

void Qcow2NodeTest::ReadsAndRewritesCompressed(const std::string& create_options) {
  SCOPED_TRACE(create_options);
  const std::string raw = TempPath("comp.raw");
  std::vector<uint8_t> data(4 * kMiB, 0);
  for (uint64_t i = 0; i < data.size(); i += 4096) {
    std::vector<uint8_t> p = Pattern(1024, i);  // compressible: mostly zero
    std::copy(p.begin(), p.end(), data.begin() + i);
  }
  WriteFile(raw, data);
  const std::string path = TempPath("comp.qcow2");
  ShellResult r = Shell("qemu-img convert -c -O qcow2 -o " + create_options + " -f raw " +
                        raw + " " + path);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  ASSERT_THAT(Shell("qemu-img check " + path).output, HasSubstr("compressed clusters"));
  auto node = Open(path);
  EXPECT_EQ(Read(*node, 0, data.size()), data);
  EXPECT_EQ(Read(*node, 70000, 3000),
            std::vector<uint8_t>(data.begin() + 70000, data.begin() + 73000));
  // Partial writes into compressed clusters copy the rest out of them.
  std::vector<uint8_t> ref = data;
  RandomWrites(this, *node, ref, 40, 5000, 3,
               [&](uint64_t off, const std::vector<uint8_t>& d) { Write(*node, off, d); });
  absl::Status st = env_.Run(node->WriteZeroes(kMiB, 65536, {}));
  ASSERT_TRUE(st.ok()) << st;
  std::fill(ref.begin() + kMiB, ref.begin() + kMiB + 65536, 0);
  EXPECT_EQ(Read(*node, 0, ref.size()), ref);
  Close(node);
  ExpectClean(path);
  ExpectContents(path, ref);
}

TEST_F(Qcow2NodeTest, ReadsAndRewritesCompressedClusters) {
  ReadsAndRewritesCompressed("compression_type=zlib");
}

TEST_F(Qcow2NodeTest, ReadsAndRewritesZstdCompressedClusters) {
  ReadsAndRewritesCompressed("compression_type=zstd");
  ReadsAndRewritesCompressed("compression_type=zstd,cluster_size=4k");
  ReadsAndRewritesCompressed("compression_type=zstd,extended_l2=on");
}

void Qcow2NodeTest::CompressedWritesMatchConvert(const std::string& compression_type) {
  SCOPED_TRACE(compression_type);
  // Mostly compressible clusters, one incompressible, one all-zero, and a
  // short last cluster.
  const uint64_t size = 2 * kMiB + 10240;
  std::vector<uint8_t> data(size, 0);
  for (uint64_t c = 0; c < size; c += 65536) {
    std::vector<uint8_t> p = Pattern(c == 3 * 65536 ? 65536 : 3000, c);
    std::copy_n(p.begin(), std::min<uint64_t>(p.size(), size - c), data.begin() + c);
  }
  std::fill(data.begin() + 5 * 65536, data.begin() + 6 * 65536, 0);
  const std::string raw = TempPath("cw.raw");
  WriteFile(raw, data);
  const std::string theirs = TempPath("cw.qemu.qcow2");
  ASSERT_EQ(Shell("qemu-img convert -c -O qcow2 -o compression_type=" +
                  compression_type + " -f raw " + raw + " " + theirs).exit_code, 0);
  Qcow2CreateOptions options;
  options.set_compression_type(compression_type);
  const std::string ours = Create("cw.ours.qcow2", size, options);
  auto node = Open(ours);
  for (uint64_t c = 0; c < size; c += 65536) {
    if (c == 5 * 65536) continue;  // convert skips zero clusters
    const uint64_t n = std::min<uint64_t>(65536, size - c);
    absl::Status st = env_.Run(node->WriteCompressed(
        c, io::ConstIoVec(data.data() + c, n)));
    ASSERT_TRUE(st.ok()) << st;
  }
  ASSERT_TRUE(env_.Run(node->WriteCompressed(size, io::ConstIoVec())).ok());
  absl::Status again = env_.Run(node->WriteCompressed(0, io::ConstIoVec(data.data(), 65536)));
  EXPECT_TRUE(absl::IsFailedPrecondition(again)) << again;
  EXPECT_EQ(Read(*node, 0, size), data);
  Close(node);
  ExpectClean(ours);
  ExpectContents(ours, data);
  EXPECT_EQ(testing::FirstDifference(ours, theirs), -1);
}

TEST_F(Qcow2NodeTest, CompressedWritesMatchQemuImgConvert) {
  CompressedWritesMatchConvert("zlib");
}

TEST_F(Qcow2NodeTest, ZstdCompressedWritesMatchQemuImgConvert) {
  CompressedWritesMatchConvert("zstd");
}

TEST_F(Qcow2NodeTest, BackingChainRawQcow2Qcow2) {
  const uint64_t size = 4 * kMiB;
  const std::string base = TempPath("chain_base.raw");
  std::vector<uint8_t> base_data = Pattern(3 * kMiB, 99);  // shorter than the top
  WriteFile(base, base_data);
  const std::string mid = TempPath("chain_mid.qcow2");
  const std::string top = TempPath("chain_top.qcow2");
  ASSERT_EQ(Shell("cd " + TempPath("") + " && qemu-img create -q -f qcow2 -b chain_base.raw -F raw "
                  "chain_mid.qcow2 4M && qemu-io -f qcow2 -c 'write -P 0x33 512k 100k' "
                  "-c 'write -z 1500k 64k' chain_mid.qcow2").exit_code, 0);
  Qcow2CreateOptions o;
  o.set_backing_file("chain_mid.qcow2");
  o.set_backing_fmt("qcow2");
  o.set_cluster_size(4096);
  Create("chain_top.qcow2", size, o);
  std::vector<uint8_t> ref = QemuRead(top);
  ASSERT_EQ(ref.size(), size);
  auto node = Open(top);
  ASSERT_NE(node->backing(), nullptr);
  EXPECT_EQ(node->full_backing_filename(), TempPath("chain_mid.qcow2"));
  ASSERT_NE(node->backing()->backing(), nullptr);
  EXPECT_EQ(Read(*node, 0, size), ref);
  // Partial-cluster writes copy the rest from the chain; past the base's
  // end the chain reads as zeroes.
  RandomWrites(this, *node, ref, 100, 10000, 5,
               [&](uint64_t off, const std::vector<uint8_t>& d) { Write(*node, off, d); });
  EXPECT_EQ(Read(*node, 0, size), ref);
  // Block status through the chain.
  auto status = env_.Run(io::GetChainStatus(*node, 512 * 1024 + 4096 * 30, 4096));
  ASSERT_TRUE(status.ok());
  Close(node);
  ExpectClean(top);
  ExpectContents(top, ref);
}

TEST_F(Qcow2NodeTest, ConcurrentWritesToSameAndDifferentClusters) {
  const uint64_t size = 64 * kMiB;
  const std::string path = Create("concurrent.qcow2", size);
  auto node = Open(path);
  std::vector<uint8_t> ref(size, 0);
  std::vector<std::vector<uint8_t>> buffers;
  std::vector<uint64_t> offsets;
  // 32 disjoint 4 KiB pieces of two 64 KiB clusters (allocating races), and
  // 32 writes to different clusters of different L2 tables.
  for (int i = 0; i < 32; ++i) offsets.push_back(1 * kMiB + (i % 2) * 65536 + (i / 2) * 4096);
  for (int i = 0; i < 32; ++i) offsets.push_back((i + 3) * kMiB + 12345 + i);
  for (size_t i = 0; i < offsets.size(); ++i) {
    buffers.push_back(Pattern(i < 32 ? 4096 : 70000, 500 + i));
    std::copy(buffers[i].begin(), buffers[i].end(), ref.begin() + offsets[i]);
  }
  int done = 0;
  std::vector<absl::Status> results(offsets.size());
  for (size_t i = 0; i < offsets.size(); ++i) {
    io::Spawn(node->Write(offsets[i], io::ConstIoVec(buffers[i])),
              [&, i](absl::Status st) {
                results[i] = st;
                ++done;
              });
  }
  while (done < static_cast<int>(offsets.size())) {
    ASSERT_TRUE(env_.engine().Poll(true).ok());
  }
  for (const absl::Status& st : results) EXPECT_TRUE(st.ok()) << st;
  EXPECT_EQ(Read(*node, 0, size), ref);
  Close(node);
  ExpectClean(path);
  ExpectContents(path, ref);
}

// Batches of 64 concurrent writes, zero writes, discards and reads on
// disjoint byte ranges that share clusters, over a backing file, with
// caches small enough to evict all the time.
TEST_F(Qcow2NodeTest, ConcurrentMixedWorkloadWithSmallCaches) {
  for (uint64_t cs : {4096, 65536}) {
    SCOPED_TRACE(cs);
    const uint64_t size = 8 * kMiB;
    const std::string base = TempPath(absl::StrCat("mixed_base", cs, ".raw"));
    std::vector<uint8_t> ref = Pattern(size - 100000, 1234);
    WriteFile(base, ref);
    ref.resize(size, 0);
    Qcow2CreateOptions o;
    o.set_cluster_size(cs);
    o.set_backing_file(base);
    o.set_backing_fmt("raw");
    o.set_refcount_bits(cs == 4096 ? 4 : 16);
    const std::string path = Create(absl::StrCat("mixed", cs, ".qcow2"), size, o);
    Qcow2OpenOptions small;
    small.set_l2_cache_size(1);
    small.set_refcount_cache_size(1);
    auto node = Open(path, false, small);
    std::mt19937_64 rng(cs);
    RunMixedBatches(env_, *node, ref, rng, /*batches=*/30, /*slot=*/3000,
                    /*discard_unit=*/0);
    if (HasFatalFailure()) return;
    // Discards of whole clusters (they read as zeroes with a backing file).
    for (int i = 0; i < 20; ++i) {
      const uint64_t first = rng() % (size / cs - 4);
      ASSERT_TRUE(env_.Run(node->Discard(first * cs, 3 * cs)).ok());
      std::fill(ref.begin() + first * cs, ref.begin() + (first + 3) * cs, 0);
    }
    EXPECT_EQ(Read(*node, 0, size), ref);
    Close(node);
    ExpectClean(path);
    ExpectContents(path, ref);
  }
}

// A discard on a version 2 image with a backing file does nothing: without
// the zero flag the discarded clusters would show the backing file's data
// again (QEMU 7.2's qcow2_co_pdiscard returns -ENOTSUP, which the block
// layer reports as success). Before, the cluster read 0x77 from the backing
// file where qemu-io keeps the data written.
TEST_F(Qcow2NodeTest, DiscardOnVersion2ImageWithBackingFileIsIgnored) {
  const std::string base = TempPath("v2_discard_base.qcow2");
  const std::string path = TempPath("v2_discard.qcow2");
  const std::string oracle = TempPath("v2_discard_qemu.qcow2");
  const std::string create =
      "qemu-img create -q -f qcow2 -o compat=0.10,cluster_size=65536 "
      "-F qcow2 -b " + base + " ";
  ASSERT_EQ(Shell("qemu-img create -q -f qcow2 " + base +
                  " 1M && qemu-io -f qcow2 -c 'write -P 0x77 0 1M' " + base +
                  " >/dev/null && " + create + path + " && " + create +
                  oracle + " && qemu-io -d unmap -f qcow2 -c "
                  "'write -P 1 0 128k' -c 'discard 0 64k' " + oracle +
                  " >/dev/null")
                .exit_code,
            0);
  std::unique_ptr<Qcow2Node> node = Open(path);
  ASSERT_NE(node, nullptr);
  Write(*node, 0, std::vector<uint8_t>(128 * 1024, 1));
  absl::Status st = env_.Run(node->Discard(0, 64 * 1024));
  EXPECT_TRUE(st.ok()) << st;
  EXPECT_EQ(Read(*node, 0, 64 * 1024), std::vector<uint8_t>(64 * 1024, 1));
  Close(node);
  EXPECT_EQ(Shell("qemu-img check -q " + path).exit_code, 0);
  const ShellResult cmp = Shell("qemu-img compare " + path + " " + oracle);
  EXPECT_EQ(cmp.exit_code, 0) << cmp.output;
}

TEST_F(Qcow2NodeTest, ZeroesDiscardAndResize) {
  const uint64_t size = 8 * kMiB;
  const std::string path = Create("zeroes.qcow2", size);
  auto node = Open(path);
  std::vector<uint8_t> ref(size, 0);
  RandomWrites(this, *node, ref, 100, 200000, 11,
               [&](uint64_t off, const std::vector<uint8_t>& d) { Write(*node, off, d); });
  std::mt19937_64 rng(12);
  for (int i = 0; i < 60; ++i) {
    const uint64_t length = 1 + rng() % 300000;
    const uint64_t offset = rng() % (size - length);
    absl::Status st;
    switch (i % 3) {
      case 0:
        st = env_.Run(node->WriteZeroes(offset, length, {}));
        std::fill(ref.begin() + offset, ref.begin() + offset + length, 0);
        break;
      case 1: {
        io::WriteZeroesFlags f;
        f.may_unmap = true;
        st = env_.Run(node->WriteZeroes(offset, length, f));
        std::fill(ref.begin() + offset, ref.begin() + offset + length, 0);
        break;
      }
      case 2: {
        st = env_.Run(node->Discard(offset, length));
        // Whole clusters read as zeroes afterwards; partial ones are kept.
        const uint64_t a = (offset + 65535) / 65536 * 65536;
        const uint64_t b = (offset + length) / 65536 * 65536;
        if (a < b) std::fill(ref.begin() + a, ref.begin() + b, 0);
        break;
      }
    }
    ASSERT_TRUE(st.ok()) << st;
    if (i % 10 == 0) {
      ASSERT_TRUE(env_.Run(node->Flush()).ok());
    }
  }
  EXPECT_EQ(Read(*node, 0, size), ref);
  // Grow (L1 table grows), write past the old end, then shrink.
  ASSERT_TRUE(env_.Run(node->Truncate(600 * kMiB, io::PreallocMode::kOff)).ok());
  ref.resize(600 * kMiB, 0);
  Write(*node, 590 * kMiB + 17, Pattern(100000, 77));
  {
    std::vector<uint8_t> p = Pattern(100000, 77);
    std::copy(p.begin(), p.end(), ref.begin() + 590 * kMiB + 17);
  }
  EXPECT_EQ(node->header().l1_size, 2u);
  ASSERT_TRUE(env_.Run(node->Truncate(6 * kMiB, io::PreallocMode::kOff)).ok());
  ref.resize(6 * kMiB);
  EXPECT_EQ(node->size(), 6 * kMiB);
  absl::Status odd = env_.Run(node->Truncate(6 * kMiB + 1, io::PreallocMode::kOff));
  EXPECT_EQ(odd.message(), "The new size must be a multiple of 512");
  EXPECT_EQ(Read(*node, 0, ref.size()), ref);
  Close(node);
  ExpectClean(path);
  ExpectContents(path, ref);
  ShellResult info = Shell("qemu-img info " + path);
  EXPECT_THAT(info.output, HasSubstr("virtual size: 6 MiB (6291456 bytes)"));
}

TEST_F(Qcow2NodeTest, GrowWithPreallocation) {
  for (io::PreallocMode mode : {io::PreallocMode::kMetadata, io::PreallocMode::kFalloc,
                                io::PreallocMode::kFull}) {
    const std::string name = absl::StrCat("grow_", io::PreallocModeName(mode));
    const std::string path = Create(name, 2 * kMiB);
    auto node = Open(path);
    std::vector<uint8_t> ref(2 * kMiB, 0);
    RandomWrites(this, *node, ref, 10, 100000, 2,
                 [&](uint64_t off, const std::vector<uint8_t>& d) { Write(*node, off, d); });
    ASSERT_TRUE(env_.Run(node->Truncate(10 * kMiB, mode)).ok());
    ref.resize(10 * kMiB, 0);
    Write(*node, 9 * kMiB + 5, Pattern(1000, 3));
    {
      std::vector<uint8_t> p = Pattern(1000, 3);
      std::copy(p.begin(), p.end(), ref.begin() + 9 * kMiB + 5);
    }
    EXPECT_EQ(Read(*node, 0, ref.size()), ref);
    Close(node);
    ExpectClean(path);
    ExpectContents(path, ref);
  }
}

TEST_F(Qcow2NodeTest, BlockStatusMatchesQemuMap) {
  const std::string path = TempPath("status.qcow2");
  ASSERT_EQ(Shell("qemu-img create -q -f qcow2 -o cluster_size=4k " + path +
                  " 4M && qemu-io -f qcow2 -c 'write 0 12k' -c 'write -z 64k 8k' "
                  "-c 'write 1M 4k' -c 'write 1028k 4k' " + path).exit_code, 0);
  auto node = Open(path, true);
  struct Extent { uint64_t start, length; bool data, zero; };
  std::vector<Extent> ours;
  for (uint64_t off = 0; off < node->size();) {
    auto st = env_.Run(node->GetBlockStatus(off, node->size() - off));
    ASSERT_TRUE(st.ok()) << st.status();
    if (!ours.empty() && ours.back().data == st->data && ours.back().zero == st->zero) {
      ours.back().length += st->length;
    } else {
      ours.push_back({off, st->length, st->data, st->zero});
    }
    off += st->length;
  }
  Close(node);
  std::string text;
  for (const Extent& e : ours) {
    if (!e.data) continue;
    text += absl::StrFormat("%u+%u;", e.start, e.length);
  }
  EXPECT_EQ(text, "0+12288;1048576+8192;");
  std::vector<uint8_t> zero_found;
  bool zero_at_64k = false;
  for (const Extent& e : ours) {
    if (e.zero && e.start <= 65536 && 65536 < e.start + e.length) zero_at_64k = true;
  }
  EXPECT_TRUE(zero_at_64k);
  ShellResult map = Shell("qemu-img map --output=json " + path);
  EXPECT_THAT(map.output, HasSubstr("{ \"start\": 0, \"length\": 12288, \"depth\": 0, "
                                    "\"present\": true, \"zero\": false, \"data\": true"));
  EXPECT_THAT(map.output, HasSubstr("{ \"start\": 1048576, \"length\": 8192, \"depth\": 0, "
                                    "\"present\": true, \"zero\": false, \"data\": true"));
}

TEST_F(Qcow2NodeTest, MetadataPreallocatedClustersReportZero) {
  Qcow2CreateOptions o;
  o.set_preallocation("metadata");
  const std::string path = Create("prealloc_status.qcow2", 4 * kMiB, o);
  auto node = Open(path, true);
  auto st = env_.Run(node->GetBlockStatus(0, 4 * kMiB));
  ASSERT_TRUE(st.ok());
  EXPECT_TRUE(st->data);
  EXPECT_TRUE(st->zero);
  EXPECT_TRUE(st->offset_valid);
  EXPECT_EQ(st->host_offset, 0x50000u);
  Close(node);
}

TEST_F(Qcow2NodeTest, CorruptBitRefusesReadWriteButAllowsReads) {
  const std::string path = Create("corrupt.qcow2", 1 * kMiB);
  {
    auto node = Open(path);
    Write(*node, 0, Pattern(1000, 1));
    Close(node);
  }
  std::vector<uint8_t> bytes = ReadFile(path);
  bytes[79] |= 2;  // incompatible features: corrupt
  WriteFile(path, bytes);
  auto file = env_.OpenFile(path, false);
  ASSERT_TRUE(file.ok());
  auto rw = env_.Run(Qcow2Node::Open(*std::move(file), Qcow2OpenOptions(), nullptr));
  ASSERT_FALSE(rw.ok());
  EXPECT_EQ(rw.status().message(),
            "qcow2: Image is corrupt; cannot be opened read/write");
  auto ro = Open(path, /*read_only=*/true);
  ASSERT_NE(ro, nullptr);
  EXPECT_TRUE(ro->corrupt());
  EXPECT_EQ(Read(*ro, 0, 1000), Pattern(1000, 1));
  Close(ro);
}

TEST_F(Qcow2NodeTest, WriteOnMetadataMarksImageCorrupt) {
  const std::string path = Create("overlap.qcow2", 1 * kMiB);
  {
    auto node = Open(path);
    Write(*node, 0, Pattern(65536, 1));
    Close(node);
  }
  // Point the first data cluster at the refcount table (0x10000).
  std::vector<uint8_t> bytes = ReadFile(path);
  ASSERT_EQ(bytes[0x40000 + 5], 0x05);
  bytes[0x40000 + 5] = 0x01;
  WriteFile(path, bytes);
  auto node = Open(path);
  absl::Status st = env_.Run(node->Write(100, io::ConstIoVec(Pattern(10, 2))));
  EXPECT_TRUE(absl::IsDataLoss(st)) << st;
  EXPECT_EQ(st.message(),
            "qcow2: Marking image as corrupt: Preventing invalid write on "
            "metadata (overlaps with refcount table); further corruption "
            "events will be suppressed");
  EXPECT_TRUE(node->corrupt());
  // Everything fails from now on.
  std::vector<uint8_t> buf(10);
  EXPECT_TRUE(absl::IsDataLoss(env_.Run(node->Read(0, io::IoVec(buf)))));
  Close(node);
  EXPECT_THAT(Shell("qemu-img info " + path).output, HasSubstr("corrupt: true"));
  // The refcount table was not touched.
  EXPECT_EQ(ReadFile(path)[0x10000 + 5], 0x02);
}

// A discard, zero write or shrink that would free a host cluster which an
// L2 entry shares with metadata (the entry points at the L1 table, an L2
// table, the refcount table or a block, or, compressed, into the header)
// runs QEMU's overlap check first, as writes do: the image is marked
// corrupt, the request fails, and nothing else in the file changes. Before,
// the metadata cluster was freed and punched (QEMU 7.2 does that too for a
// whole-cluster discard), so on an extended-L2 image whose entry pointed at
// the L1 table every guest byte then read as zeroes.
TEST_F(Qcow2NodeTest, FreeingMetadataThroughAnL2EntryMarksImageCorrupt) {
  enum class Target { kHeader, kL1, kL2, kRefcountTable, kRefcountBlock };
  enum class Op { kDiscard, kDiscardSubcluster, kZero, kZeroUnmap, kShrink };
  struct Layout {
    const char* name;
    uint64_t cluster_size;
    bool extended;
  };
  const Layout layouts[] = {{"standard", 64 * 1024, false},
                            {"extended", 64 * 1024, true},
                            {"extended 2M", 2 * kMiB, true}};
  const std::pair<Target, const char*> targets[] = {
      {Target::kHeader, "qcow2_header"},
      {Target::kL1, "active L1 table"},
      {Target::kL2, "active L2 table"},
      {Target::kRefcountTable, "refcount table"},
      {Target::kRefcountBlock, "refcount block"}};
  const std::pair<Op, const char*> ops[] = {
      {Op::kDiscard, "discard"},
      {Op::kDiscardSubcluster, "subcluster discard"},
      {Op::kZero, "write -z"},
      {Op::kZeroUnmap, "write -z -u"},
      {Op::kShrink, "shrink"}};
  int n = 0;
  for (const Layout& layout : layouts) {
    const uint64_t cs = layout.cluster_size;
    Qcow2CreateOptions o;
    o.set_cluster_size(cs);
    o.set_extended_l2(layout.extended);
    const std::string base = Create(absl::StrCat("meta_free", n++, ".qcow2"),
                                    4 * cs, o);
    {
      auto node = Open(base);
      Write(*node, 0, Pattern(cs, 1));
      Close(node);
    }
    const std::vector<uint8_t> clean = ReadFile(base);
    const uint64_t l1 = LoadBE64(clean.data() + 40) & format::kL1OffsetMask;
    const uint64_t l2 = LoadBE64(clean.data() + l1) & format::kL1OffsetMask;
    const uint64_t reftable = LoadBE64(clean.data() + 48);
    const uint64_t refblock = LoadBE64(clean.data() + reftable);
    const uint64_t entry_size = layout.extended ? 16 : 8;
    for (const auto& [target, target_name] : targets) {
      if (target == Target::kHeader && layout.extended) continue;
      for (const auto& [op, op_name] : ops) {
        if (op == Op::kDiscardSubcluster && !layout.extended) continue;
        SCOPED_TRACE(absl::StrCat(layout.name, ", entry at ", target_name,
                                  ", ", op_name));
        // The L2 entry of guest cluster 1.
        std::vector<uint8_t> bytes = clean;
        uint64_t word = 0;
        switch (target) {
          case Target::kHeader:
            word = *format::MakeCompressedL2Word(
                0x200, 512, static_cast<uint32_t>(__builtin_ctzll(cs)));
            break;
          case Target::kL1: word = format::kCopiedFlag | l1; break;
          case Target::kL2: word = format::kCopiedFlag | l2; break;
          case Target::kRefcountTable: word = format::kCopiedFlag | reftable; break;
          case Target::kRefcountBlock: word = format::kCopiedFlag | refblock; break;
        }
        StoreBE64(bytes.data() + l2 + entry_size, word);
        // Extended: subcluster 0 holds data.
        if (layout.extended) StoreBE64(bytes.data() + l2 + entry_size + 8, 1);
        const std::string path = TempPath(absl::StrCat("meta_free", n++, ".qcow2"));
        WriteFile(path, bytes);
        auto node = Open(path);
        ASSERT_NE(node, nullptr);
        absl::Status st;
        switch (op) {
          case Op::kDiscard: st = env_.Run(node->Discard(cs, cs)); break;
          case Op::kDiscardSubcluster:
            st = env_.Run(node->Discard(cs, cs / 32));
            break;
          case Op::kZero:
            st = env_.Run(node->WriteZeroes(cs, cs, io::WriteZeroesFlags{}));
            break;
          case Op::kZeroUnmap:
            st = env_.Run(node->WriteZeroes(
                cs, cs, io::WriteZeroesFlags{.may_unmap = true}));
            break;
          case Op::kShrink:
            st = env_.Run(node->Truncate(cs, io::PreallocMode::kOff));
            break;
        }
        if (!st.ok() || node->corrupt()) {
          absl::Status closed = env_.Run(node->Close());
          (void)closed;
        } else {
          Close(node);
        }
        node.reset();
        // A zero write without unmapping keeps the host cluster of a
        // standard or extended entry: nothing is freed.
        const bool frees = !(op == Op::kZero && target != Target::kHeader);
        std::vector<uint8_t> after = ReadFile(path);
        if (!frees) {
          EXPECT_TRUE(st.ok()) << st;
          EXPECT_TRUE(std::equal(after.begin() + l1, after.begin() + l1 + 8,
                                 bytes.begin() + l1));
          const std::vector<uint8_t> guest = QemuRead(path);
          EXPECT_TRUE(std::equal(guest.begin(), guest.begin() + cs,
                                 Pattern(cs, 1).begin()));
          continue;
        }
        EXPECT_TRUE(absl::IsDataLoss(st)) << st;
        EXPECT_EQ(st.message(),
                  absl::StrCat("qcow2: Marking image as corrupt: Preventing "
                               "invalid write on metadata (overlaps with ",
                               target_name,
                               "); further corruption events will be "
                               "suppressed"));
        bytes[79] |= 2;  // the corrupt bit, and nothing else
        EXPECT_TRUE(after == bytes);
        EXPECT_THAT(Shell("qemu-img info " + path).output,
                    HasSubstr("corrupt: true"));
      }
    }
  }
}

TEST_F(Qcow2NodeTest, MisalignedL2EntryIsCorruption) {
  const std::string path = Create("misaligned.qcow2", 1 * kMiB);
  {
    auto node = Open(path);
    Write(*node, 0, Pattern(65536, 1));
    Close(node);
  }
  std::vector<uint8_t> bytes = ReadFile(path);
  bytes[0x40000 + 6] = 0x02;  // 0x50200
  WriteFile(path, bytes);
  auto ro = Open(path, /*read_only=*/true);
  std::vector<uint8_t> buf(10);
  absl::Status st = env_.Run(ro->Read(0, io::IoVec(buf)));
  EXPECT_EQ(st.message(),
            "qcow2: Image is corrupt: Cluster allocation offset 0x50200 unaligned "
            "(L2 offset: 0x40000, L2 index: 0); further non-fatal corruption "
            "events will be suppressed");
  Close(ro);
  auto rw = Open(path);
  st = env_.Run(rw->Read(0, io::IoVec(buf)));
  EXPECT_THAT(std::string(st.message()), HasSubstr("qcow2: Marking image as corrupt: Cluster "
                                      "allocation offset 0x50200 unaligned"));
  Close(rw);
  EXPECT_THAT(Shell("qemu-img info " + path).output, HasSubstr("corrupt: true"));
}

TEST_F(Qcow2NodeTest, AllocationLandingOnMetadataMarksImageCorrupt) {
  const std::string path = Create("landing.qcow2", 1 * kMiB);
  std::vector<uint8_t> bytes = ReadFile(path);
  ASSERT_EQ(bytes[0x20000 + 7], 1);  // refcount of cluster 3, the L1 table
  bytes[0x20000 + 7] = 0;
  WriteFile(path, bytes);
  auto node = Open(path);
  absl::Status st = env_.Run(node->Write(0, io::ConstIoVec(Pattern(512, 1))));
  EXPECT_EQ(st.message(),
            "qcow2: Marking image as corrupt: Preventing invalid write on "
            "metadata (overlaps with active L1 table); further corruption "
            "events will be suppressed");
  Close(node);
  bytes = ReadFile(path);
  EXPECT_EQ(bytes[79], 2);  // corrupt bit, nothing else
  EXPECT_EQ(std::vector<uint8_t>(bytes.begin() + 0x30000, bytes.begin() + 0x30008),
            std::vector<uint8_t>(8, 0));  // the L1 table is intact
}

TEST_F(Qcow2NodeTest, L2EntryPastEndOfFileIsCorruption) {
  const std::string path = Create("pasteof.qcow2", 1 * kMiB);
  {
    auto node = Open(path);
    Write(*node, 0, Pattern(65536, 1));
    Close(node);
  }
  std::vector<uint8_t> bytes = ReadFile(path);
  bytes[0x40000 + 4] = 0x10;  // 0x10050000
  WriteFile(path, bytes);
  auto node = Open(path);
  std::vector<uint8_t> buf(10);
  absl::Status st = env_.Run(node->Read(0, io::IoVec(buf)));
  EXPECT_TRUE(absl::IsDataLoss(st));
  EXPECT_THAT(std::string(st.message()),
              HasSubstr("qcow2: Marking image as corrupt: Data cluster offset "
                        "0x10050000 beyond the end of the image file (L2 "
                        "offset: 0x40000, L2 index: 0)"));
  Close(node);
}

TEST_F(Qcow2NodeTest, OpenErrors) {
  const std::string path = Create("bits.qcow2", 1 * kMiB);
  std::vector<uint8_t> good = ReadFile(path);
  std::vector<uint8_t> bytes = good;
  bytes[77] = 0x20;  // unknown incompatible bit 45 (and no name for it)
  WriteFile(path, bytes);
  auto file = env_.OpenFile(path, true);
  auto node = env_.Run(Qcow2Node::Open(*std::move(file), Qcow2OpenOptions(), nullptr));
  ASSERT_FALSE(node.ok());
  EXPECT_THAT(node.status().message(), HasSubstr("Unsupported qcow2 feature(s)"));
  bytes = good;
  bytes[0] = 'X';
  WriteFile(path, bytes);
  file = env_.OpenFile(path, true);
  node = env_.Run(Qcow2Node::Open(*std::move(file), Qcow2OpenOptions(), nullptr));
  EXPECT_EQ(node.status().message(), "Image is not in qcow2 format");
  for (uint64_t length : {0, 10, 200}) {
    WriteFile(path, std::vector<uint8_t>(length, 0));
    file = env_.OpenFile(path, true);
    node = env_.Run(Qcow2Node::Open(*std::move(file), Qcow2OpenOptions(), nullptr));
    EXPECT_EQ(node.status().message(), "Image is not in qcow2 format") << length;
  }
  // A missing backing file.
  const std::string top = TempPath("nobacking.qcow2");
  ASSERT_EQ(Shell("qemu-img create -q -f qcow2 -u -b missing.raw -F raw " + top + " 1M").exit_code, 0);
  auto missing = env_.OpenQcow2(top, true);
  ASSERT_FALSE(missing.ok());
  EXPECT_THAT(missing.status().message(), HasSubstr("Could not open backing file: "));
}

TEST_F(Qcow2NodeTest, LazyRefcountsSetDirtyBitWhileOpen) {
  Qcow2CreateOptions o;
  o.set_lazy_refcounts(true);
  const std::string path = Create("lazy.qcow2", 4 * kMiB, o);
  auto node = Open(path);
  EXPECT_FALSE(node->dirty());
  Write(*node, 4096, Pattern(100000, 9));
  EXPECT_TRUE(node->dirty());
  EXPECT_EQ(ReadFile(path)[79] & 1, 1);
  Close(node);
  EXPECT_EQ(ReadFile(path)[79] & 1, 0);
  ExpectClean(path);
}

TEST_F(Qcow2NodeTest, DirtyImageIsRepairedOnReadWriteOpen) {
  Qcow2CreateOptions o;
  o.set_lazy_refcounts(true);
  const std::string path = Create("dirty.qcow2", 4 * kMiB, o);
  {
    auto node = Open(path);
    Write(*node, 0, Pattern(200000, 4));
    Close(node);
  }
  // As after a crash: dirty, and refcounts of the data clusters lost.
  std::vector<uint8_t> bytes = ReadFile(path);
  bytes[79] |= 1;
  ASSERT_EQ(bytes[0x20000 + 11], 1);  // refcount of cluster 5 (first data)
  bytes[0x20000 + 11] = 0;
  WriteFile(path, bytes);
  EXPECT_NE(Shell("qemu-img check " + path).exit_code, 0);
  auto ro = Open(path, true);  // read-only: no repair, reads work
  EXPECT_TRUE(ro->dirty());
  EXPECT_EQ(Read(*ro, 0, 200000), Pattern(200000, 4));
  Close(ro);
  auto rw = Open(path);
  ASSERT_NE(rw, nullptr);
  EXPECT_FALSE(rw->dirty());
  Write(*rw, 300000, Pattern(70000, 5));
  Close(rw);
  ExpectClean(path);
}

// QEMU's qcow2_do_open clears the autoclear bits it does not know on every
// writable open, before any write (qemu-io -c 'read 0 512' does); the
// bitmaps bit (0), whose bitmaps imgtool does not maintain, goes with the
// first write.
TEST_F(Qcow2NodeTest, UnknownAutoclearBitsAreClearedByAReadWriteOpen) {
  const std::string path = Create("autoclear.qcow2", 1 * kMiB);
  std::vector<uint8_t> bytes = ReadFile(path);
  bytes[88] = 0x80;  // autoclear bit 63
  bytes[95] = 0x81;  // autoclear bits 7 and 0
  WriteFile(path, bytes);
  const std::string qemu = path + ".qemu";
  WriteFile(qemu, bytes);
  ASSERT_EQ(Shell("qemu-io -f qcow2 -c 'read 0 512' " + qemu).exit_code, 0);
  auto ro = Open(path, true);
  Close(ro);
  EXPECT_EQ(ReadFile(path), bytes);
  auto rw = Open(path);
  const std::vector<uint8_t> after_open = ReadFile(path);
  EXPECT_EQ(after_open[88], 0);
  EXPECT_EQ(after_open[95], 0x01);
  const std::vector<uint8_t> qemu_bytes = ReadFile(qemu);
  EXPECT_EQ(std::vector<uint8_t>(after_open.begin(), after_open.begin() + 65536),
            std::vector<uint8_t>(qemu_bytes.begin(), qemu_bytes.begin() + 65536));
  Write(*rw, 0, Pattern(10, 1));
  Close(rw);
  EXPECT_EQ(ReadFile(path)[95], 0);
  ExpectClean(path);
}

TEST_F(Qcow2NodeTest, WritesKeepInternalSnapshotsIntact) {
  const std::string path = TempPath("snap.qcow2");
  ASSERT_EQ(Shell("qemu-img create -q -f qcow2 " + path + " 4M && qemu-io -f qcow2 "
                  "-c 'write -P 0x41 0 1M' " + path + " && qemu-img snapshot -c s1 " +
                  path).exit_code, 0);
  std::vector<uint8_t> before = QemuRead(path);
  auto node = Open(path);
  std::vector<uint8_t> ref = before;
  RandomWrites(this, *node, ref, 50, 100000, 21,
               [&](uint64_t off, const std::vector<uint8_t>& d) { Write(*node, off, d); });
  EXPECT_EQ(Read(*node, 0, ref.size()), ref);
  Close(node);
  ExpectClean(path);
  ExpectContents(path, ref);
  ShellResult r = Shell("qemu-img convert -l s1 -O raw " + path + " " + path + ".s1.raw");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(ReadFile(path + ".s1.raw"), before);
}

// Thousands of writes queued at once (imgtool io with thousands of
// aio_write commands, bench -d with a deep queue): they wait for the
// metadata lock and for each other's cluster allocations, and each one that
// goes on wakes the next. Those wakeups used to nest inside each other, one
// stack frame chain per queued write: on a 256 KiB stack 5000 writes
// crashed (SIGSEGV), as did ASan builds on the 8 MiB main stack.
TEST(Qcow2DeepQueueTest, ThousandsOfQueuedWritesRunOnASmallStack) {
  const std::string path = TempPath("deep_queue.qcow2");
  ASSERT_EQ(Shell("qemu-img create -q -f qcow2 " + path + " 64M").exit_code,
            0);
  constexpr int kWrites = 5000;
  constexpr uint64_t kLength = 4096;
  std::vector<uint8_t> ref(64 * kMiB, 0);
  const std::vector<uint8_t> data = Pattern(kWrites * kLength, 77);
  std::copy(data.begin(), data.end(), ref.begin() + 12345);
  ::imgtool::testing::RunWithStack(256 << 10, [&] {
    Env env;
    absl::StatusOr<std::unique_ptr<Qcow2Node>> node =
        env.OpenQcow2(path, /*read_only=*/false);
    ASSERT_TRUE(node.ok()) << node.status();
    int done = 0;
    for (int i = 0; i < kWrites; ++i) {
      io::Spawn((*node)->Write(12345 + i * kLength,
                               io::ConstIoVec(data.data() + i * kLength,
                                              kLength)),
                [&, i](absl::Status st) {
                  EXPECT_TRUE(st.ok()) << i << ": " << st;
                  ++done;
                });
    }
    while (done < kWrites) ASSERT_TRUE(env.engine().Poll(true).ok());
    EXPECT_TRUE(env.Run((*node)->Close()).ok());
  });
  EXPECT_EQ(Shell("qemu-img check -q " + path).exit_code, 0);
  const std::string raw = path + ".expected.raw";
  WriteFile(raw, ref);
  EXPECT_EQ(
      Shell("qemu-img compare -q -f qcow2 -F raw " + path + " " + raw).exit_code,
      0);
}

}  // namespace
}  // namespace imgtool::qcow2

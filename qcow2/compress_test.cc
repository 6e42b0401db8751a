// Cluster compression: zstd decoding follows QEMU 7.2's
// qcow2_zstd_decompress (streaming until the cluster is full, sector padding
// after the frame ignored, short or long frames refused) and encoding its
// qcow2_zstd_compress (one default-parameter frame, -ENOMEM rule).
#include "qcow2/compress.h"

#include <zstd.h>

#include <cstdint>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "qcow2/format/header.h"

namespace imgtool::qcow2 {
namespace {

constexpr size_t kCluster = 65536;

std::vector<uint8_t> Compressible(size_t n, uint8_t seed) {
  std::vector<uint8_t> v(n, 0);
  for (size_t i = 0; i < n; i += 4096) {
    for (size_t j = 0; j < 300 && i + j < n; ++j) v[i + j] = static_cast<uint8_t>(seed + j);
  }
  return v;
}

std::vector<uint8_t> Random(size_t n) {
  std::mt19937 gen(42);
  std::vector<uint8_t> v(n);
  for (auto& b : v) b = static_cast<uint8_t>(gen());
  return v;
}

// A zstd frame of `data` made by the one-shot API at `level`.
std::vector<uint8_t> Frame(const std::vector<uint8_t>& data, int level = 3) {
  std::vector<uint8_t> out(ZSTD_compressBound(data.size()));
  const size_t n = ZSTD_compress(out.data(), out.size(), data.data(), data.size(), level);
  EXPECT_FALSE(ZSTD_isError(n));
  out.resize(n);
  return out;
}

// As qcow2 stores it: rounded up to 512-byte sectors with junk after it.
std::vector<uint8_t> Padded(std::vector<uint8_t> v, uint8_t fill = 0xa5) {
  v.resize((v.size() + 511) / 512 * 512 + 512, fill);
  return v;
}

TEST(ZstdClusterTest, RoundTripsWithSectorPadding) {
  const std::vector<uint8_t> data = Compressible(kCluster, 1);
  std::vector<uint8_t> out(kCluster - 1);
  absl::StatusOr<uint64_t> n = ZstdCompressCluster(data, absl::MakeSpan(out));
  ASSERT_TRUE(n.ok()) << n.status();
  out.resize(*n);
  EXPECT_LT(*n, 1000u);
  // Same bytes as the one-shot API at the default level 3 (one frame with
  // the content size in its header, no checksum).
  EXPECT_EQ(out, Frame(data));
  for (uint8_t fill : {0x00, 0xa5, 0xff}) {
    std::vector<uint8_t> back(kCluster, 0xee);
    absl::Status st = ZstdDecompressCluster(Padded(out, fill), absl::MakeSpan(back));
    EXPECT_TRUE(st.ok()) << st;
    EXPECT_EQ(back, data);
  }
}

TEST(ZstdClusterTest, ReadsAClusterMadeOfSeveralFrames) {
  const std::vector<uint8_t> data = Compressible(kCluster, 7);
  const std::vector<uint8_t> head(data.begin(), data.begin() + 20000);
  const std::vector<uint8_t> tail(data.begin() + 20000, data.end());
  std::vector<uint8_t> src = Frame(head, 1);
  const std::vector<uint8_t> second = Frame(tail, 19);
  src.insert(src.end(), second.begin(), second.end());
  std::vector<uint8_t> back(kCluster);
  absl::Status st = ZstdDecompressCluster(Padded(src), absl::MakeSpan(back));
  EXPECT_TRUE(st.ok()) << st;
  EXPECT_EQ(back, data);
}

TEST(ZstdClusterTest, RefusesFramesThatDoNotFillTheClusterExactly) {
  std::vector<uint8_t> back(kCluster);
  // Too short: the padding after the frame is no frame (zeroes, or junk).
  for (uint8_t fill : {0x00, 0xa5}) {
    absl::Status st = ZstdDecompressCluster(Padded(Frame(Compressible(kCluster - 512, 2)), fill),
                                            absl::MakeSpan(back));
    EXPECT_TRUE(absl::IsDataLoss(st)) << st;
  }
  // Too short with nothing after it: no progress.
  absl::Status st = ZstdDecompressCluster(Frame(Compressible(1000, 2)), absl::MakeSpan(back));
  EXPECT_TRUE(absl::IsDataLoss(st)) << st;
  // Too long: the frame goes on past the cluster.
  st = ZstdDecompressCluster(Padded(Frame(Compressible(2 * kCluster, 2))), absl::MakeSpan(back));
  EXPECT_TRUE(absl::IsDataLoss(st)) << st;
  // Cut short, damaged, or no zstd data at all.
  std::vector<uint8_t> frame = Frame(Random(kCluster / 2));
  frame.resize(frame.size() / 2);
  st = ZstdDecompressCluster(frame, absl::MakeSpan(back));
  EXPECT_TRUE(absl::IsDataLoss(st)) << st;
  frame = Frame(Compressible(kCluster, 3));
  for (size_t i = 10; i < frame.size(); ++i) frame[i] ^= 0x5a;
  st = ZstdDecompressCluster(Padded(frame), absl::MakeSpan(back));
  EXPECT_TRUE(absl::IsDataLoss(st)) << st;
  st = ZstdDecompressCluster(std::vector<uint8_t>(4096, 0), absl::MakeSpan(back));
  EXPECT_TRUE(absl::IsDataLoss(st)) << st;
}

TEST(ZstdClusterTest, IncompressibleClusterDoesNotFit) {
  // QEMU gives the compressor cluster_size - 1 bytes and writes the cluster
  // uncompressed on -ENOMEM.
  const std::vector<uint8_t> data = Random(kCluster);
  std::vector<uint8_t> out(kCluster - 1);
  absl::StatusOr<uint64_t> n = ZstdCompressCluster(data, absl::MakeSpan(out));
  EXPECT_TRUE(absl::IsResourceExhausted(n.status())) << n.status();
  // Room for the frame: stored raw inside it, slightly bigger than the data.
  std::vector<uint8_t> big(2 * kCluster);
  n = ZstdCompressCluster(data, absl::MakeSpan(big));
  ASSERT_TRUE(n.ok()) << n.status();
  EXPECT_GT(*n, kCluster);
}

TEST(CompressClusterTest, DispatchesOnCompressionType) {
  const std::vector<uint8_t> data = Compressible(kCluster, 9);
  for (uint8_t type : {format::kCompressionZlib, format::kCompressionZstd}) {
    std::vector<uint8_t> out(kCluster - 1);
    absl::StatusOr<uint64_t> n = CompressCluster(type, data, absl::MakeSpan(out));
    ASSERT_TRUE(n.ok()) << n.status();
    out.resize(*n);
    std::vector<uint8_t> back(kCluster);
    absl::Status st = DecompressCluster(type, Padded(out), absl::MakeSpan(back));
    EXPECT_TRUE(st.ok()) << st;
    EXPECT_EQ(back, data);
    // The other type's decoder refuses it.
    st = DecompressCluster(type ^ 1, Padded(out), absl::MakeSpan(back));
    EXPECT_TRUE(absl::IsDataLoss(st)) << st;
  }
  std::vector<uint8_t> back(kCluster);
  EXPECT_TRUE(absl::IsInvalidArgument(DecompressCluster(2, data, absl::MakeSpan(back))));
  EXPECT_TRUE(absl::IsInvalidArgument(CompressCluster(2, data, absl::MakeSpan(back)).status()));
}

}  // namespace
}  // namespace imgtool::qcow2

#include "qcow2/compress.h"

#include <zlib.h>
#include <zstd.h>

#include <cstring>

#include "absl/strings/str_format.h"
#include "qcow2/format/header.h"

namespace imgtool::qcow2 {
namespace {

constexpr int kWindowBits = -12;  // raw deflate, 4 KiB window

}  // namespace

absl::Status InflateCluster(absl::Span<const uint8_t> src,
                            absl::Span<uint8_t> dst) {
  z_stream strm;
  std::memset(&strm, 0, sizeof(strm));
  if (inflateInit2(&strm, kWindowBits) != Z_OK) {
    return absl::InternalError("qcow2: inflateInit2 failed");
  }
  strm.next_in = const_cast<uint8_t*>(src.data());
  strm.avail_in = static_cast<uInt>(src.size());
  strm.next_out = dst.data();
  strm.avail_out = static_cast<uInt>(dst.size());
  const int ret = inflate(&strm, Z_FINISH);
  const bool full = strm.avail_out == 0;
  inflateEnd(&strm);
  // Z_BUF_ERROR is fine: the input may be cut inside the stream's padding.
  if ((ret == Z_STREAM_END || ret == Z_BUF_ERROR) && full) {
    return absl::OkStatus();
  }
  return absl::DataLossError("qcow2: compressed cluster does not decompress");
}

absl::StatusOr<uint64_t> DeflateCluster(absl::Span<const uint8_t> src,
                                        absl::Span<uint8_t> dst) {
  z_stream strm;
  std::memset(&strm, 0, sizeof(strm));
  if (deflateInit2(&strm, Z_DEFAULT_COMPRESSION, Z_DEFLATED, kWindowBits, 9,
                   Z_DEFAULT_STRATEGY) != Z_OK) {
    return absl::InternalError("qcow2: deflateInit2 failed");
  }
  strm.next_in = const_cast<uint8_t*>(src.data());
  strm.avail_in = static_cast<uInt>(src.size());
  strm.next_out = dst.data();
  strm.avail_out = static_cast<uInt>(dst.size());
  const int ret = deflate(&strm, Z_FINISH);
  const uint64_t out = dst.size() - strm.avail_out;
  deflateEnd(&strm);
  if (ret != Z_STREAM_END) {
    return absl::ResourceExhaustedError("qcow2: cluster does not compress");
  }
  return out;
}

absl::Status ZstdDecompressCluster(absl::Span<const uint8_t> src,
                                   absl::Span<uint8_t> dst) {
  ZSTD_DCtx* dctx = ZSTD_createDCtx();
  if (dctx == nullptr) {
    return absl::InternalError("qcow2: ZSTD_createDCtx failed");
  }
  ZSTD_inBuffer in = {src.data(), src.size(), 0};
  ZSTD_outBuffer out = {dst.data(), dst.size(), 0};
  // ZSTD_decompressStream returns 0 once a frame is decoded and flushed; a
  // cluster may hold several frames, and bytes after the last one (sector
  // padding) are never reached when the frames fill the cluster.
  size_t hint = 0;
  bool ok = true;
  while (ok && out.pos < out.size) {
    const size_t in_before = in.pos;
    const size_t out_before = out.pos;
    hint = ZSTD_decompressStream(dctx, &out, &in);
    ok = !ZSTD_isError(hint) && (in.pos > in_before || out.pos > out_before);
  }
  ZSTD_freeDCtx(dctx);
  // hint > 0: the frame goes on past the cluster's end.
  if (!ok || hint != 0) {
    return absl::DataLossError("qcow2: compressed cluster does not decompress");
  }
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> ZstdCompressCluster(absl::Span<const uint8_t> src,
                                             absl::Span<uint8_t> dst) {
  ZSTD_CCtx* cctx = ZSTD_createCCtx();
  if (cctx == nullptr) {
    return absl::InternalError("qcow2: ZSTD_createCCtx failed");
  }
  ZSTD_inBuffer in = {src.data(), src.size(), 0};
  ZSTD_outBuffer out = {dst.data(), dst.size(), 0};
  // One call with ZSTD_e_end, as QEMU makes it. QEMU's rule for a nonzero
  // result: more left to flush than dst has room for (which includes every
  // zstd error code, a huge size_t) is -ENOMEM, i.e. the cluster is written
  // uncompressed; a smaller remainder is -EIO.
  const size_t left = ZSTD_compressStream2(cctx, &out, &in, ZSTD_e_end);
  ZSTD_freeCCtx(cctx);
  if (left > out.size - out.pos) {
    return absl::ResourceExhaustedError("qcow2: cluster does not compress");
  }
  if (left != 0) {
    return absl::InternalError(
        "qcow2: zstd compression did not finish the frame");
  }
  return out.pos;
}

absl::Status DecompressCluster(uint8_t compression_type,
                               absl::Span<const uint8_t> src,
                               absl::Span<uint8_t> dst) {
  switch (compression_type) {
    case format::kCompressionZlib:
      return InflateCluster(src, dst);
    case format::kCompressionZstd:
      return ZstdDecompressCluster(src, dst);
  }
  return absl::InvalidArgumentError(
      absl::StrFormat("qcow2: unknown compression type %u", compression_type));
}

absl::StatusOr<uint64_t> CompressCluster(uint8_t compression_type,
                                         absl::Span<const uint8_t> src,
                                         absl::Span<uint8_t> dst) {
  switch (compression_type) {
    case format::kCompressionZlib:
      return DeflateCluster(src, dst);
    case format::kCompressionZstd:
      return ZstdCompressCluster(src, dst);
  }
  return absl::InvalidArgumentError(
      absl::StrFormat("qcow2: unknown compression type %u", compression_type));
}

}  // namespace imgtool::qcow2

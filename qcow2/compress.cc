#include "qcow2/compress.h"

#include <zlib.h>

#include <cstring>

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

}  // namespace imgtool::qcow2

// Compression of qcow2 clusters, as QEMU 7.2 writes and reads them (qcow2
// spec, "Compressed Clusters Descriptor" and header field compression_type;
// QEMU's block/qcow2-threads.c):
// - compression_type 0, zlib: raw deflate, 4 KiB window, default level.
// - compression_type 1, zstd: one zstd frame made by a default-parameter
//   context (level 3, no checksum) in a single ZSTD_compressStream2 call with
//   ZSTD_e_end.
// The descriptor stores the compressed length rounded up to 512-byte
// sectors, so readers get trailing bytes after the stream and decompress
// until the cluster is full.
// Thread model: pure functions, safe from any thread.
#ifndef IMGTOOL_QCOW2_COMPRESS_H_
#define IMGTOOL_QCOW2_COMPRESS_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace imgtool::qcow2 {

// Decompresses `src` with the image's compression_type (format::kCompression*)
// until `dst` (one cluster, bytes) is full; `src` may run past the end of the
// compressed data. kDataLoss if the data does not decompress to exactly
// dst.size() bytes (QEMU's qcow2_co_decompress fails with EIO),
// kInvalidArgument for an unknown compression_type.
absl::Status DecompressCluster(uint8_t compression_type,
                               absl::Span<const uint8_t> src,
                               absl::Span<uint8_t> dst);

// Compresses `src` (one cluster) with the image's compression_type into `dst`;
// returns the compressed length in bytes. kResourceExhausted if it does not
// fit in dst.size() bytes (QEMU's -ENOMEM: it then writes the cluster
// uncompressed; QEMU passes dst.size() = cluster size - 1), kInternal if the
// library fails otherwise, kInvalidArgument for an unknown compression_type.
absl::StatusOr<uint64_t> CompressCluster(uint8_t compression_type,
                                         absl::Span<const uint8_t> src,
                                         absl::Span<uint8_t> dst);

// zlib (compression_type 0): inflates `src` until `dst` is full.
// kDataLoss if the data is not a valid stream or ends before `dst` is full.
absl::Status InflateCluster(absl::Span<const uint8_t> src,
                            absl::Span<uint8_t> dst);

// zlib: deflates `src` into `dst`; returns the compressed length, or
// kResourceExhausted if it does not fit in dst.size() bytes.
absl::StatusOr<uint64_t> DeflateCluster(absl::Span<const uint8_t> src,
                                        absl::Span<uint8_t> dst);

// zstd (compression_type 1): decodes frames from `src` until `dst` is full,
// as QEMU's qcow2_zstd_decompress: kDataLoss on a zstd error, when a call
// makes no progress (the frames end before `dst` is full and the trailing
// bytes are no frame), or when the last frame holds more than dst.size()
// bytes.
absl::Status ZstdDecompressCluster(absl::Span<const uint8_t> src,
                                   absl::Span<uint8_t> dst);

// zstd: compresses `src` into one frame in `dst`, as QEMU's
// qcow2_zstd_compress; returns the compressed length, kResourceExhausted if
// the frame does not fit in dst.size() bytes, kInternal on other errors.
absl::StatusOr<uint64_t> ZstdCompressCluster(absl::Span<const uint8_t> src,
                                             absl::Span<uint8_t> dst);

}  // namespace imgtool::qcow2

#endif  // IMGTOOL_QCOW2_COMPRESS_H_

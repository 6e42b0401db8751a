// zlib (raw deflate, 4 KiB window) compression of qcow2 clusters, as QEMU
// writes and reads them (qcow2 spec, "Compressed Clusters Descriptor";
// compression_type 0).
// Thread model: pure functions, safe from any thread.
#ifndef IMGTOOL_QCOW2_COMPRESS_H_
#define IMGTOOL_QCOW2_COMPRESS_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace imgtool::qcow2 {

// Inflates `src` until `dst` is full. `src` may run past the end of the
// compressed stream (qcow2 stores its length in 512-byte sectors).
// kDataLoss if the data is not a valid stream or ends before `dst` is full.
absl::Status InflateCluster(absl::Span<const uint8_t> src,
                            absl::Span<uint8_t> dst);

// Deflates `src` into `dst`; returns the compressed length, or
// kResourceExhausted if it does not fit in dst.size() bytes (QEMU then
// writes the cluster uncompressed).
absl::StatusOr<uint64_t> DeflateCluster(absl::Span<const uint8_t> src,
                                        absl::Span<uint8_t> dst);

}  // namespace imgtool::qcow2

#endif  // IMGTOOL_QCOW2_COMPRESS_H_

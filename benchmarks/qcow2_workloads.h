// qcow2 images for the benchmarks (suites `subcluster`, `prealloc_filter`).
// Thread model: everything runs on the calling thread.
#ifndef IMGTOOL_BENCHMARKS_QCOW2_WORKLOADS_H_
#define IMGTOOL_BENCHMARKS_QCOW2_WORKLOADS_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"

namespace imgtool::benchmarks {

// Writes a fresh qcow2 image at `path` (replacing any file there) of virtual
// `size` bytes with `cluster_size`-byte clusters (512..2 MiB, a power of 2;
// extended L2 needs >= 16 KiB), over the raw `backing_raw` file unless it is
// empty: what `qemu-img create -f qcow2 [-b B -F raw] -o
// cluster_size=C,extended_l2=E` writes. Errors from qcow2::CreateQcow2 and
// posix_file (kInvalidArgument for bad options).
absl::Status CreateQcow2Image(const std::string& path, uint64_t size,
                              uint64_t cluster_size, bool extended_l2,
                              const std::string& backing_raw);

}  // namespace imgtool::benchmarks

#endif  // IMGTOOL_BENCHMARKS_QCOW2_WORKLOADS_H_

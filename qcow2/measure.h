// Sizing arithmetic of `qemu-img measure -O qcow2` (QEMU 7.2's
// qcow2_measure, qcow2_calc_prealloc_size and qcow2_refcount_metadata_size):
// how large a qcow2 file with the given geometry gets when every cluster of
// its virtual disk is allocated, and how much of that a copy of some data
// needs. Also what `create` would need to preallocate. No I/O.
// Thread model: pure functions, safe from any thread.
#ifndef IMGTOOL_QCOW2_MEASURE_H_
#define IMGTOOL_QCOW2_MEASURE_H_

#include <cstdint>

namespace imgtool::qcow2 {

// The geometry of the qcow2 image being measured.
struct MeasureGeometry {
  uint64_t cluster_size = 65536;  // bytes, power of two, 512..2 MiB
  uint32_t refcount_order = 4;    // refcount_bits = 1 << refcount_order
  bool extended_l2 = false;       // 16-byte L2 entries
};

// Bytes of refcount blocks plus refcount table clusters that count
// `clusters` clusters and themselves (QEMU's qcow2_refcount_metadata_size,
// without the generous growth margin).
uint64_t RefcountMetadataBytes(uint64_t clusters, const MeasureGeometry& g);

// Bytes of a qcow2 file whose whole virtual disk of `virtual_size` bytes
// (rounded up to a cluster) is allocated: the header cluster, every L2
// table, the L1 table rounded up to whole clusters, the refcount metadata,
// and the data clusters (QEMU's qcow2_calc_prealloc_size).
uint64_t FullyAllocatedSize(uint64_t virtual_size, const MeasureGeometry& g);

// Whether an image of `virtual_size` bytes fits QEMU's L1 table limit
// (32 MiB of entries) with this geometry. measure's message when not:
// "The image size is too large (try using a larger cluster size)".
bool FitsL1Limit(uint64_t virtual_size, const MeasureGeometry& g);

struct Measurement {
  uint64_t required = 0;         // bytes
  uint64_t fully_allocated = 0;  // bytes
};

// measure's two numbers for an image of `virtual_size` bytes (rounded up
// to a cluster) that receives `data_bytes` bytes of data clusters (a
// multiple of the cluster size, at most the rounded virtual size): the
// fully allocated size, and the required size, which is that minus the data
// clusters left out (all metadata is still counted, as QEMU does).
Measurement MeasureQcow2(uint64_t virtual_size, uint64_t data_bytes,
                         const MeasureGeometry& g);

}  // namespace imgtool::qcow2

#endif  // IMGTOOL_QCOW2_MEASURE_H_

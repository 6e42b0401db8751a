// qcow2 cluster mapping entries (qcow2 spec, "Cluster mapping" and
// "Extended L2 Entries"): L1 entries, standard 64-bit L2 entries, compressed
// cluster descriptors, and 128-bit extended L2 entries with their subcluster
// allocation bitmap. Byte layouts and classification only, no I/O.
//
// Entries are handled as raw host-order words (`Load*`/`Store*` convert the
// big-endian table bytes); Get*Type() classify them the way QEMU 7.2 does
// (block/qcow2.h, qcow2_get_cluster_type / qcow2_get_subcluster_type).
// Error messages do not name the file; the caller prefixes the path.
// Thread model: pure functions, safe from any thread.
#ifndef IMGTOOL_QCOW2_FORMAT_L2_ENTRY_H_
#define IMGTOOL_QCOW2_FORMAT_L2_ENTRY_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace imgtool::qcow2::format {

// Bit 63 of L1 and standard L2 entries: refcount is exactly 1 (may write in
// place). Only exact in the active L1 table and the L2 tables it reaches.
inline constexpr uint64_t kCopiedFlag = uint64_t{1} << 63;
// Bit 62 of L2 entries: the cluster is compressed.
inline constexpr uint64_t kCompressedFlag = uint64_t{1} << 62;
// Bit 0 of a standard L2 entry: reads as zeros (version 3, standard L2 only;
// ignored with extended L2 entries).
inline constexpr uint64_t kZeroFlag = uint64_t{1} << 0;

// L1 entry: bits 9-55 are the L2 table offset, bits 0-8 and 56-62 reserved.
inline constexpr uint64_t kL1OffsetMask = 0x00fffffffffffe00;
inline constexpr uint64_t kL1ReservedMask = 0x7f000000000001ff;

// Standard L2 entry: bits 9-55 are the host cluster offset, bits 1-8 and
// 56-61 reserved.
inline constexpr uint64_t kL2OffsetMask = 0x00fffffffffffe00;
inline constexpr uint64_t kL2StandardReservedMask = 0x3f000000000001fe;

// Extended L2 entries: 32 subclusters per cluster; bitmap bit i = subcluster
// i allocated, bit 32 + i = subcluster i reads as zeros.
inline constexpr uint32_t kSubclustersPerCluster = 32;
inline constexpr uint64_t kSubclusterAllocMask = 0x00000000ffffffff;
inline constexpr uint64_t kSubclusterZeroMask = 0xffffffff00000000;
// Smallest subcluster QEMU opens (cluster_size >= 16 KiB with extended L2).
inline constexpr uint64_t kMinSubclusterSize = 512;

// Compressed data is counted in 512-byte sectors.
inline constexpr uint64_t kCompressedSectorSize = 512;

// ---- Geometry -------------------------------------------------------------

// Bytes per L2 entry: 8, or 16 with extended L2 entries.
inline uint64_t L2EntrySize(bool extended_l2) { return extended_l2 ? 16 : 8; }

// L2 entries in one L2 table (one cluster): cluster_size / 8, or / 16.
inline uint64_t L2EntriesPerCluster(uint32_t cluster_bits, bool extended_l2) {
  return (uint64_t{1} << cluster_bits) / L2EntrySize(extended_l2);
}

// Bytes of guest data mapped by one L1 entry (one full L2 table).
inline uint64_t BytesPerL1Entry(uint32_t cluster_bits, bool extended_l2) {
  return L2EntriesPerCluster(cluster_bits, extended_l2) << cluster_bits;
}

// Number of L1 entries needed to map `size` bytes of guest data:
// ceil(size / BytesPerL1Entry()). Exact for every uint64_t size.
uint64_t L1EntriesForSize(uint64_t size, uint32_t cluster_bits,
                          bool extended_l2);

// Subcluster size in bytes with extended L2 entries (cluster_size / 32).
inline uint64_t SubclusterSize(uint32_t cluster_bits) {
  return (uint64_t{1} << cluster_bits) / kSubclustersPerCluster;
}

// Where guest byte `guest_offset` is mapped (qcow2 spec, "Cluster mapping").
inline uint64_t L1Index(uint64_t guest_offset, uint32_t cluster_bits,
                        bool extended_l2) {
  return (guest_offset >> cluster_bits) /
         L2EntriesPerCluster(cluster_bits, extended_l2);
}
inline uint64_t L2Index(uint64_t guest_offset, uint32_t cluster_bits,
                        bool extended_l2) {
  return (guest_offset >> cluster_bits) %
         L2EntriesPerCluster(cluster_bits, extended_l2);
}
inline uint32_t SubclusterIndex(uint64_t guest_offset, uint32_t cluster_bits) {
  return static_cast<uint32_t>((guest_offset & ((uint64_t{1} << cluster_bits) - 1)) /
                               SubclusterSize(cluster_bits));
}

// ---- L1 entries -----------------------------------------------------------

struct L1Entry {
  uint64_t l2_offset = 0;  // cluster aligned; 0 = no L2 table (unallocated)
  bool copied = false;     // refcount of the L2 table is exactly 1
  bool operator==(const L1Entry&) const = default;
};

// Raw big-endian word `index` of an L1 table. `table` must hold at least
// (index + 1) * 8 bytes.
uint64_t LoadL1Entry(absl::Span<const uint8_t> table, uint64_t index);
void StoreL1Entry(absl::Span<uint8_t> table, uint64_t index, uint64_t raw);

// Decodes a raw L1 entry. kDataLoss if reserved bits are set ("L1 entry
// 0x... has reserved bits set") or the L2 offset is not cluster aligned.
absl::StatusOr<L1Entry> DecodeL1Entry(uint64_t raw, uint32_t cluster_bits);
// `entry.l2_offset` must be cluster aligned and below 2^56.
uint64_t EncodeL1Entry(const L1Entry& entry);

// ---- L2 entries -----------------------------------------------------------

// One L2 entry as two host-order words. `word` is the standard 64-bit entry
// (the whole entry without extended L2); `bitmap` is the subcluster bitmap of
// an extended entry and 0 otherwise.
struct L2Entry {
  uint64_t word = 0;
  uint64_t bitmap = 0;

  bool copied() const { return (word & kCopiedFlag) != 0; }
  bool compressed() const { return (word & kCompressedFlag) != 0; }
  // Standard clusters only: the host cluster offset (bits 9-55).
  uint64_t host_offset() const { return word & kL2OffsetMask; }
  bool operator==(const L2Entry&) const = default;
};

// What an image's L2 entries look like.
struct L2Format {
  uint32_t cluster_bits = 16;
  bool extended_l2 = false;
  // Incompatible bit 2: host offset == guest offset, and offset 0 with COPIED
  // set means "allocated at host offset 0".
  bool external_data_file = false;
};

// Entry `index` of an L2 table (8 or 16 bytes per entry). `table` must hold
// at least (index + 1) * L2EntrySize() bytes.
L2Entry LoadL2Entry(absl::Span<const uint8_t> table, uint64_t index,
                    bool extended_l2);
void StoreL2Entry(absl::Span<uint8_t> table, uint64_t index, bool extended_l2,
                  const L2Entry& entry);

// Cluster types (QEMU's QCow2ClusterType). kZeroPlain/kZeroAlloc only occur
// with standard L2 entries (zero flag); extended entries say it per
// subcluster.
enum class ClusterType {
  kUnallocated,  // offset 0: backing file, or zeros without one
  kZeroPlain,    // zero flag, offset 0
  kZeroAlloc,    // zero flag, preallocated host cluster
  kNormal,       // data at host_offset()
  kCompressed,   // compressed descriptor in bits 0-61
};

// Classifies an L2 entry and checks it. kDataLoss if: reserved bits are set
// ("L2 entry 0x... has reserved bits set"); the host offset of a normal or
// preallocated zero cluster is not cluster aligned ("Cluster allocation
// offset 0x... unaligned"); a compressed entry has COPIED set, a nonzero
// subcluster bitmap, offset bits above 55, or appears in an image with an
// external data file. The subcluster bitmap of standard clusters is checked
// by CheckSubclusterBitmap().
absl::StatusOr<ClusterType> GetClusterType(const L2Entry& entry,
                                           const L2Format& format);

// Builds the word of a standard (non-compressed) L2 entry. `host_offset`
// must be cluster aligned and below 2^56 (0 for an unallocated or plain-zero
// entry). `zero` sets the zero flag (standard L2 entries only).
uint64_t MakeStandardL2Word(uint64_t host_offset, bool copied, bool zero);

// ---- Compressed clusters --------------------------------------------------

// Compressed cluster descriptor (qcow2 spec, "Compressed Clusters
// Descriptor"): x = 62 - (cluster_bits - 8); bits 0..x-1 = host byte offset,
// bits x..61 = additional 512-byte sectors.
struct CompressedDescriptor {
  uint64_t host_offset = 0;      // byte offset, not aligned
  uint64_t additional_sectors = 0;
  // Bytes to read starting at host_offset:
  // (additional_sectors + 1) * 512 - (host_offset % 512). The compressed
  // stream may end before that; decompression stops after one cluster.
  uint64_t size() const {
    return (additional_sectors + 1) * kCompressedSectorSize -
           (host_offset % kCompressedSectorSize);
  }
  bool operator==(const CompressedDescriptor&) const = default;
};

// Bit x above: where the sector count starts.
inline uint32_t CompressedSectorShift(uint32_t cluster_bits) {
  return 62 - (cluster_bits - 8);
}

// Decodes bits 0-61 of a compressed L2 word (flags are ignored).
CompressedDescriptor DecodeCompressedDescriptor(uint64_t word,
                                                uint32_t cluster_bits);

// Builds the L2 word (with kCompressedFlag) for `compressed_bytes` > 0 bytes
// of compressed data at `host_offset`. kInvalidArgument if the offset does
// not fit in the offset field (or reaches 2^56) or the data spans more
// sectors than the count field holds.
absl::StatusOr<uint64_t> MakeCompressedL2Word(uint64_t host_offset,
                                              uint64_t compressed_bytes,
                                              uint32_t cluster_bits);

// ---- Subclusters (extended L2 entries) ------------------------------------

// Per-subcluster state (QEMU's QCow2SubclusterType). See subclusters.md.
enum class SubclusterType {
  kNormal,            // allocated: host_offset() + index * subcluster size
  kZeroPlain,         // reads as zeros, no host cluster
  kZeroAlloc,         // reads as zeros, host cluster reserved
  kUnallocatedPlain,  // backing file / zeros, no host cluster
  kUnallocatedAlloc,  // backing file / zeros, host cluster reserved
  kCompressed,        // whole cluster compressed
  kInvalid,           // bitmap contradicts the entry (see below)
};

inline uint64_t SubclusterAllocBit(uint32_t index) { return uint64_t{1} << index; }
inline uint64_t SubclusterZeroBit(uint32_t index) {
  return uint64_t{1} << (32 + index);
}
// Alloc bits of subclusters [first, first + count), count in 1..32 - first.
uint64_t SubclusterAllocRange(uint32_t first, uint32_t count);
// Zero bits of subclusters [first, first + count).
inline uint64_t SubclusterZeroRange(uint32_t first, uint32_t count) {
  return SubclusterAllocRange(first, count) << 32;
}

// The state of subcluster `index` (0..31). Without extended L2 entries every
// subcluster has the cluster's state (kUnallocated -> kUnallocatedPlain) and
// `index` is ignored. kInvalid for the whole entry when a normal cluster has
// a subcluster with both its alloc and zero bit set, or an unallocated one
// has any alloc bit. Reserved bits are not checked here (GetClusterType()).
SubclusterType GetSubclusterType(const L2Entry& entry, uint32_t index,
                                 const L2Format& format);

// Number of subclusters from `first` (0..31) on that share its type, up to
// the end of the cluster (1..32 - first). For kInvalid, compressed and
// standard entries: the rest of the cluster.
uint32_t CountSubclustersOfSameType(const L2Entry& entry, uint32_t first,
                                    const L2Format& format);

// kDataLoss with QEMU's `qemu-img check` wording when the bitmap of an
// extended entry contradicts its word: "Allocated cluster has corrupted
// subcluster allocation bitmap", "Unallocated cluster has non-zero subcluster
// allocation map". OK for standard entries and compressed entries (whose
// bitmap GetClusterType() checks).
absl::Status CheckSubclusterBitmap(const L2Entry& entry, const L2Format& format);

}  // namespace imgtool::qcow2::format

#endif  // IMGTOOL_QCOW2_FORMAT_L2_ENTRY_H_

// qcow2 refcounts (qcow2 spec, "Host cluster management"): refcount table
// entries and the packed refcount values of a refcount block. Byte layouts
// only, no I/O.
//
// A refcount block is one cluster of cluster_size * 8 / refcount_bits
// entries, refcount_bits = 1 << refcount_order (1..64). Widths of 8 bits and
// more are big-endian integers; 1, 2 and 4-bit entries are packed into bytes
// starting at the least significant bit (entry 0 = bit 0 of byte 0).
// Thread model: pure functions, safe from any thread.
#ifndef IMGTOOL_QCOW2_FORMAT_REFCOUNT_H_
#define IMGTOOL_QCOW2_FORMAT_REFCOUNT_H_

#include <cstdint>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace imgtool::qcow2::format {

// Refcount table entry: bits 9-63 are the refcount block offset (cluster
// aligned, 0 = block not allocated: all its refcounts are 0), bits 0-8
// reserved.
inline constexpr uint64_t kRefcountTableOffsetMask = 0xfffffffffffffe00;
inline constexpr uint64_t kRefcountTableReservedMask = 0x1ff;

// Width of one refcount in bits (1 << refcount_order, order 0..6).
inline uint32_t RefcountBits(uint32_t refcount_order) {
  return uint32_t{1} << refcount_order;
}

// Largest refcount a block can store: 2^refcount_bits - 1.
inline uint64_t MaxRefcount(uint32_t refcount_order) {
  const uint32_t bits = RefcountBits(refcount_order);
  return bits >= 64 ? ~uint64_t{0} : (uint64_t{1} << bits) - 1;
}

// Refcount entries in one refcount block: cluster_size * 8 / refcount_bits.
inline uint64_t RefcountEntriesPerBlock(uint32_t cluster_bits,
                                        uint32_t refcount_order) {
  return (uint64_t{1} << cluster_bits) * 8 >> refcount_order;
}

// Bytes of host file covered by one refcount block.
inline uint64_t BytesPerRefcountBlock(uint32_t cluster_bits,
                                      uint32_t refcount_order) {
  return RefcountEntriesPerBlock(cluster_bits, refcount_order) << cluster_bits;
}

// Where the refcount of the host cluster containing `host_offset` lives:
// refcount table index and entry index within that refcount block.
inline uint64_t RefcountTableIndex(uint64_t host_offset, uint32_t cluster_bits,
                                   uint32_t refcount_order) {
  return (host_offset >> cluster_bits) /
         RefcountEntriesPerBlock(cluster_bits, refcount_order);
}
inline uint64_t RefcountBlockIndex(uint64_t host_offset, uint32_t cluster_bits,
                                   uint32_t refcount_order) {
  return (host_offset >> cluster_bits) %
         RefcountEntriesPerBlock(cluster_bits, refcount_order);
}

// Refcount `index` of a refcount block. `block` must hold the entry
// (normally one whole cluster); index < RefcountEntriesPerBlock().
uint64_t GetRefcount(absl::Span<const uint8_t> block, uint64_t index,
                     uint32_t refcount_order);

// Stores `value` as refcount `index`, leaving the neighbouring sub-byte
// entries alone. Preconditions: value <= MaxRefcount(refcount_order) (higher
// bits are dropped), index inside `block`.
void SetRefcount(absl::Span<uint8_t> block, uint64_t index,
                 uint32_t refcount_order, uint64_t value);

// Raw big-endian word `index` of a refcount table. `table` must hold at
// least (index + 1) * 8 bytes.
uint64_t LoadRefcountTableEntry(absl::Span<const uint8_t> table, uint64_t index);
void StoreRefcountTableEntry(absl::Span<uint8_t> table, uint64_t index,
                             uint64_t raw);

// The refcount block offset of a raw refcount table entry (0 = not
// allocated). kDataLoss if reserved bits are set or the offset is not
// cluster aligned ("Refblock offset 0x... unaligned").
absl::StatusOr<uint64_t> DecodeRefcountTableEntry(uint64_t raw,
                                                  uint32_t cluster_bits);

}  // namespace imgtool::qcow2::format

#endif  // IMGTOOL_QCOW2_FORMAT_REFCOUNT_H_

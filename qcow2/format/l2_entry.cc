#include "qcow2/format/l2_entry.h"

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_format.h"
#include "qcow2/format/endian.h"

namespace imgtool::qcow2::format {
namespace {

using internal::LoadBE64;
using internal::StoreBE64;

// Host offsets of clusters, L2 tables and compressed data stay below 2^56
// (qcow2 spec, "Cluster mapping").
constexpr uint64_t kMaxHostOffset = uint64_t{1} << 56;

uint64_t ClusterMask(uint32_t cluster_bits) {
  return (uint64_t{1} << cluster_bits) - 1;
}

// Mask of the host byte offset field of a compressed descriptor, limited to
// bits 0-55.
uint64_t CompressedOffsetMask(uint32_t cluster_bits) {
  const uint32_t shift = CompressedSectorShift(cluster_bits);
  return ((uint64_t{1} << shift) - 1) & (kMaxHostOffset - 1);
}

uint64_t CompressedSectorCountMask(uint32_t cluster_bits) {
  return (uint64_t{1} << (cluster_bits - 8)) - 1;
}

// Cluster type from the word alone, no checks (qcow2_get_cluster_type).
ClusterType RawClusterType(uint64_t word, const L2Format& format) {
  if (word & kCompressedFlag) return ClusterType::kCompressed;
  if ((word & kZeroFlag) && !format.extended_l2) {
    return (word & kL2OffsetMask) ? ClusterType::kZeroAlloc
                                  : ClusterType::kZeroPlain;
  }
  if ((word & kL2OffsetMask) == 0) {
    if (format.external_data_file && (word & kCopiedFlag)) {
      return ClusterType::kNormal;
    }
    return ClusterType::kUnallocated;
  }
  return ClusterType::kNormal;
}

}  // namespace

uint64_t L1EntriesForSize(uint64_t size, uint32_t cluster_bits,
                          bool extended_l2) {
  const uint64_t per_entry = BytesPerL1Entry(cluster_bits, extended_l2);
  return size / per_entry + (size % per_entry != 0 ? 1 : 0);
}

uint64_t LoadL1Entry(absl::Span<const uint8_t> table, uint64_t index) {
  return LoadBE64(table.data() + index * 8);
}

void StoreL1Entry(absl::Span<uint8_t> table, uint64_t index, uint64_t raw) {
  StoreBE64(table.data() + index * 8, raw);
}

absl::StatusOr<L1Entry> DecodeL1Entry(uint64_t raw, uint32_t cluster_bits) {
  if (raw & kL1ReservedMask) {
    return absl::DataLossError(
        absl::StrFormat("L1 entry 0x%x has reserved bits set", raw));
  }
  L1Entry entry;
  entry.l2_offset = raw & kL1OffsetMask;
  entry.copied = (raw & kCopiedFlag) != 0;
  if (entry.l2_offset & ClusterMask(cluster_bits)) {
    return absl::DataLossError(absl::StrFormat(
        "L2 table offset 0x%x unaligned (L1 entry 0x%x)", entry.l2_offset, raw));
  }
  return entry;
}

uint64_t EncodeL1Entry(const L1Entry& entry) {
  return (entry.l2_offset & kL1OffsetMask) | (entry.copied ? kCopiedFlag : 0);
}

L2Entry LoadL2Entry(absl::Span<const uint8_t> table, uint64_t index,
                    bool extended_l2) {
  const uint8_t* p = table.data() + index * L2EntrySize(extended_l2);
  L2Entry entry;
  entry.word = LoadBE64(p);
  if (extended_l2) entry.bitmap = LoadBE64(p + 8);
  return entry;
}

void StoreL2Entry(absl::Span<uint8_t> table, uint64_t index, bool extended_l2,
                  const L2Entry& entry) {
  uint8_t* p = table.data() + index * L2EntrySize(extended_l2);
  StoreBE64(p, entry.word);
  if (extended_l2) StoreBE64(p + 8, entry.bitmap);
}

absl::StatusOr<ClusterType> GetClusterType(const L2Entry& entry,
                                           const L2Format& format) {
  const uint64_t word = entry.word;
  const ClusterType type = RawClusterType(word, format);
  if (type == ClusterType::kCompressed) {
    if (format.external_data_file) {
      return absl::DataLossError(absl::StrFormat(
          "Compressed cluster entry 0x%x in an image with an external data file",
          word));
    }
    if (word & kCopiedFlag) {
      return absl::DataLossError(absl::StrFormat(
          "Compressed cluster entry 0x%x has the COPIED flag set", word));
    }
    const uint32_t shift = CompressedSectorShift(format.cluster_bits);
    const uint64_t offset_field = word & ((uint64_t{1} << shift) - 1);
    if (offset_field >= kMaxHostOffset) {
      return absl::DataLossError(absl::StrFormat(
          "Compressed cluster entry 0x%x has reserved bits set", word));
    }
    if (format.extended_l2 && entry.bitmap != 0) {
      return absl::DataLossError(absl::StrFormat(
          "Compressed cluster entry 0x%x has a non-zero subcluster bitmap "
          "0x%x",
          word, entry.bitmap));
    }
    return type;
  }
  if (word & kL2StandardReservedMask) {
    return absl::DataLossError(
        absl::StrFormat("L2 entry 0x%x has reserved bits set", word));
  }
  if ((type == ClusterType::kNormal || type == ClusterType::kZeroAlloc) &&
      (word & kL2OffsetMask & ClusterMask(format.cluster_bits))) {
    return absl::DataLossError(
        absl::StrFormat("Cluster allocation offset 0x%x unaligned",
                        word & kL2OffsetMask));
  }
  return type;
}

uint64_t MakeStandardL2Word(uint64_t host_offset, bool copied, bool zero) {
  return (host_offset & kL2OffsetMask) | (copied ? kCopiedFlag : 0) |
         (zero ? kZeroFlag : 0);
}

CompressedDescriptor DecodeCompressedDescriptor(uint64_t word,
                                                uint32_t cluster_bits) {
  const uint32_t shift = CompressedSectorShift(cluster_bits);
  CompressedDescriptor d;
  d.host_offset = word & ((uint64_t{1} << shift) - 1);
  d.additional_sectors = (word >> shift) & CompressedSectorCountMask(cluster_bits);
  return d;
}

absl::StatusOr<uint64_t> MakeCompressedL2Word(uint64_t host_offset,
                                              uint64_t compressed_bytes,
                                              uint32_t cluster_bits) {
  if (compressed_bytes == 0) {
    return absl::InvalidArgumentError("compressed cluster of 0 bytes");
  }
  if (host_offset & ~CompressedOffsetMask(cluster_bits)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "compressed cluster offset 0x%x does not fit in an L2 entry with "
        "2^%u byte clusters",
        host_offset, cluster_bits));
  }
  const uint64_t first_sector = host_offset / kCompressedSectorSize;
  const uint64_t last_sector =
      (host_offset + compressed_bytes - 1) / kCompressedSectorSize;
  const uint64_t additional = last_sector - first_sector;
  if (additional > CompressedSectorCountMask(cluster_bits)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "compressed cluster of %u bytes at 0x%x spans too many sectors",
        compressed_bytes, host_offset));
  }
  return kCompressedFlag | host_offset |
         (additional << CompressedSectorShift(cluster_bits));
}

uint64_t SubclusterAllocRange(uint32_t first, uint32_t count) {
  if (count == 0) return 0;
  const uint64_t ones =
      count >= 32 ? kSubclusterAllocMask : (uint64_t{1} << count) - 1;
  return (ones << first) & kSubclusterAllocMask;
}

SubclusterType GetSubclusterType(const L2Entry& entry, uint32_t index,
                                 const L2Format& format) {
  const ClusterType type = RawClusterType(entry.word, format);
  if (!format.extended_l2) {
    switch (type) {
      case ClusterType::kUnallocated:
        return SubclusterType::kUnallocatedPlain;
      case ClusterType::kZeroPlain:
        return SubclusterType::kZeroPlain;
      case ClusterType::kZeroAlloc:
        return SubclusterType::kZeroAlloc;
      case ClusterType::kNormal:
        return SubclusterType::kNormal;
      case ClusterType::kCompressed:
        return SubclusterType::kCompressed;
    }
    return SubclusterType::kInvalid;
  }
  const uint64_t bitmap = entry.bitmap;
  switch (type) {
    case ClusterType::kCompressed:
      return SubclusterType::kCompressed;
    case ClusterType::kNormal:
      if ((bitmap >> 32) & bitmap) return SubclusterType::kInvalid;
      if (bitmap & SubclusterZeroBit(index)) return SubclusterType::kZeroAlloc;
      if (bitmap & SubclusterAllocBit(index)) return SubclusterType::kNormal;
      return SubclusterType::kUnallocatedAlloc;
    case ClusterType::kUnallocated:
      if (bitmap & kSubclusterAllocMask) return SubclusterType::kInvalid;
      if (bitmap & SubclusterZeroBit(index)) return SubclusterType::kZeroPlain;
      return SubclusterType::kUnallocatedPlain;
    case ClusterType::kZeroPlain:
    case ClusterType::kZeroAlloc:
      break;  // not produced with extended L2 entries
  }
  return SubclusterType::kInvalid;
}

uint32_t CountSubclustersOfSameType(const L2Entry& entry, uint32_t first,
                                    const L2Format& format) {
  const SubclusterType type = GetSubclusterType(entry, first, format);
  uint32_t end = first + 1;
  if (format.extended_l2 && type != SubclusterType::kInvalid &&
      type != SubclusterType::kCompressed) {
    while (end < kSubclustersPerCluster &&
           GetSubclusterType(entry, end, format) == type) {
      ++end;
    }
  } else {
    end = kSubclustersPerCluster;
  }
  return end - first;
}

absl::Status CheckSubclusterBitmap(const L2Entry& entry,
                                   const L2Format& format) {
  if (!format.extended_l2) return absl::OkStatus();
  switch (RawClusterType(entry.word, format)) {
    case ClusterType::kNormal:
      if ((entry.bitmap >> 32) & entry.bitmap) {
        return absl::DataLossError(absl::StrFormat(
            "Allocated cluster has corrupted subcluster allocation bitmap "
            "(entry 0x%x, bitmap 0x%x)",
            entry.word, entry.bitmap));
      }
      break;
    case ClusterType::kUnallocated:
      if (entry.bitmap & kSubclusterAllocMask) {
        return absl::DataLossError(absl::StrFormat(
            "Unallocated cluster has non-zero subcluster allocation map "
            "(entry 0x%x, bitmap 0x%x)",
            entry.word, entry.bitmap));
      }
      break;
    default:
      break;
  }
  return absl::OkStatus();
}

}  // namespace imgtool::qcow2::format

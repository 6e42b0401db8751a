#include "qcow2/format/refcount.h"

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_format.h"
#include "qcow2/format/endian.h"

namespace imgtool::qcow2::format {

using internal::LoadBE16;
using internal::LoadBE32;
using internal::LoadBE64;
using internal::StoreBE16;
using internal::StoreBE32;
using internal::StoreBE64;

uint64_t GetRefcount(absl::Span<const uint8_t> block, uint64_t index,
                     uint32_t refcount_order) {
  const uint8_t* p = block.data();
  switch (refcount_order) {
    case 0:
    case 1:
    case 2: {
      const uint32_t bits = RefcountBits(refcount_order);
      const uint32_t per_byte = 8 / bits;
      const uint32_t shift = static_cast<uint32_t>(index % per_byte) * bits;
      return (p[index / per_byte] >> shift) & ((1u << bits) - 1);
    }
    case 3:
      return p[index];
    case 4:
      return LoadBE16(p + index * 2);
    case 5:
      return LoadBE32(p + index * 4);
    default:
      return LoadBE64(p + index * 8);
  }
}

void SetRefcount(absl::Span<uint8_t> block, uint64_t index,
                 uint32_t refcount_order, uint64_t value) {
  uint8_t* p = block.data();
  switch (refcount_order) {
    case 0:
    case 1:
    case 2: {
      const uint32_t bits = RefcountBits(refcount_order);
      const uint32_t per_byte = 8 / bits;
      const uint32_t shift = static_cast<uint32_t>(index % per_byte) * bits;
      const uint32_t mask = ((1u << bits) - 1) << shift;
      uint8_t& byte = p[index / per_byte];
      byte = static_cast<uint8_t>((byte & ~mask) |
                                  ((static_cast<uint32_t>(value) << shift) & mask));
      return;
    }
    case 3:
      p[index] = static_cast<uint8_t>(value);
      return;
    case 4:
      StoreBE16(p + index * 2, static_cast<uint16_t>(value));
      return;
    case 5:
      StoreBE32(p + index * 4, static_cast<uint32_t>(value));
      return;
    default:
      StoreBE64(p + index * 8, value);
      return;
  }
}

uint64_t LoadRefcountTableEntry(absl::Span<const uint8_t> table,
                                uint64_t index) {
  return LoadBE64(table.data() + index * 8);
}

void StoreRefcountTableEntry(absl::Span<uint8_t> table, uint64_t index,
                             uint64_t raw) {
  StoreBE64(table.data() + index * 8, raw);
}

absl::StatusOr<uint64_t> DecodeRefcountTableEntry(uint64_t raw,
                                                  uint32_t cluster_bits) {
  if (raw & kRefcountTableReservedMask) {
    return absl::DataLossError(absl::StrFormat(
        "Refcount table entry 0x%x has reserved bits set", raw));
  }
  const uint64_t offset = raw & kRefcountTableOffsetMask;
  if (offset & ((uint64_t{1} << cluster_bits) - 1)) {
    return absl::DataLossError(
        absl::StrFormat("Refblock offset 0x%x unaligned", offset));
  }
  return offset;
}

}  // namespace imgtool::qcow2::format

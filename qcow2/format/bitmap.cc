#include "qcow2/format/bitmap.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "qcow2/format/endian.h"
#include "qcow2/format/header.h"

namespace imgtool::qcow2::format {
namespace {
using internal::LoadBE16;
using internal::LoadBE32;
using internal::LoadBE64;
using internal::StoreBE16;
using internal::StoreBE32;
using internal::StoreBE64;
}  // namespace

uint64_t BitmapDataBytes(uint64_t image_size, uint32_t granularity_bits) {
  const uint64_t g = uint64_t{1} << granularity_bits;
  const uint64_t bits = image_size / g + (image_size % g != 0 ? 1 : 0);
  return (bits + 63) / 64 * 8;
}

uint64_t BitmapTableSize(uint64_t image_size, uint32_t granularity_bits,
                         uint32_t cluster_bits) {
  const uint64_t bytes = BitmapDataBytes(image_size, granularity_bits);
  const uint64_t cs = uint64_t{1} << cluster_bits;
  return (bytes + cs - 1) / cs;
}

bool BitmapDirEntryValid(const BitmapDirEntry& e, uint32_t cluster_bits,
                         uint64_t image_size) {
  const uint64_t cs = uint64_t{1} << cluster_bits;
  if (e.table_size == 0 || e.table_offset == 0 || e.table_offset % cs != 0 ||
      e.table_size > kBitmapMaxTableSize ||
      e.granularity_bits > kBitmapMaxGranularityBits ||
      e.granularity_bits < kBitmapMinGranularityBits ||
      (e.flags & kBitmapReservedFlags) != 0 ||
      e.name.size() > kBitmapMaxNameSize ||
      e.type != kBitmapTypeDirtyTracking) {
    return false;
  }
  const uint64_t phys = uint64_t{e.table_size} * cs;
  if (phys > kBitmapMaxPhysSize) return false;
  // phys <= 2^29, so phys * 8 << 31 fits in 64 bits.
  if (!e.in_use() && image_size > ((phys * 8) << e.granularity_bits)) {
    return false;
  }
  return true;
}

bool BitmapTableEntryValid(uint64_t entry, uint64_t cluster_size) {
  if (entry & kBitmapTableReservedMask) return false;
  const uint64_t offset = entry & kBitmapTableOffsetMask;
  if (offset != 0 &&
      ((entry & kBitmapTableAllOnes) != 0 || offset % cluster_size != 0)) {
    return false;
  }
  return true;
}

absl::StatusOr<std::vector<BitmapDirEntry>> DecodeBitmapDirectory(
    absl::Span<const uint8_t> bytes, uint32_t nb_bitmaps,
    uint32_t cluster_bits, uint64_t image_size) {
  if (bytes.empty()) {
    return absl::DataLossError("Requested bitmap directory size is zero");
  }
  if (bytes.size() > kMaxBitmapDirectorySize) {
    return absl::DataLossError("Requested bitmap directory size is too big");
  }
  std::vector<BitmapDirEntry> entries;
  const auto broken = [] {
    return absl::DataLossError("Broken bitmap directory");
  };
  uint64_t pos = 0;
  while (pos < bytes.size()) {
    if (bytes.size() - pos < kBitmapDirEntryHeaderSize) return broken();
    if (entries.size() + 1 > nb_bitmaps) {
      return absl::DataLossError(
          "More bitmaps found than specified in header extension");
    }
    const uint8_t* p = bytes.data() + pos;
    BitmapDirEntry e;
    e.table_offset = LoadBE64(p);
    e.table_size = LoadBE32(p + 8);
    e.flags = LoadBE32(p + 12);
    e.type = p[16];
    e.granularity_bits = p[17];
    const uint64_t name_size = LoadBE16(p + 18);
    const uint64_t extra_size = LoadBE32(p + 20);
    const uint64_t size =
        (kBitmapDirEntryHeaderSize + extra_size + name_size + 7) & ~uint64_t{7};
    if (size > bytes.size() - pos) return broken();
    if (extra_size != 0) {
      return absl::DataLossError("Bitmap extra data is not supported");
    }
    e.name.assign(reinterpret_cast<const char*>(p + kBitmapDirEntryHeaderSize),
                  name_size);
    if (!BitmapDirEntryValid(e, cluster_bits, image_size)) {
      // QEMU prints the name with %.*s: up to its first NUL.
      return absl::DataLossError(
          absl::StrCat("Bitmap '", e.name.substr(0, e.name.find('\0')),
                       "' doesn't satisfy the constraints"));
    }
    entries.push_back(std::move(e));
    pos += size;
  }
  if (entries.size() != nb_bitmaps) {
    return absl::DataLossError(
        "Less bitmaps found than specified in header extension");
  }
  return entries;
}

std::vector<uint8_t> EncodeBitmapDirectory(
    const std::vector<BitmapDirEntry>& entries) {
  uint64_t total = 0;
  for (const BitmapDirEntry& e : entries) total += BitmapDirEntrySize(e.name.size());
  std::vector<uint8_t> out(total, 0);
  uint64_t pos = 0;
  for (const BitmapDirEntry& e : entries) {
    uint8_t* p = out.data() + pos;
    StoreBE64(p, e.table_offset);
    StoreBE32(p + 8, e.table_size);
    StoreBE32(p + 12, e.flags);
    p[16] = e.type;
    p[17] = e.granularity_bits;
    StoreBE16(p + 18, static_cast<uint16_t>(e.name.size()));
    StoreBE32(p + 20, 0);
    std::copy(e.name.begin(), e.name.end(), p + kBitmapDirEntryHeaderSize);
    pos += BitmapDirEntrySize(e.name.size());
  }
  return out;
}

}  // namespace imgtool::qcow2::format

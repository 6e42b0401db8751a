// qcow2 persistent dirty bitmaps (qcow2 spec, "Bitmaps"; extension
// 0x23852875 is in header.h): the bitmap directory, bitmap table entries and
// the size arithmetic, with QEMU 7.2's constraints (block/qcow2-bitmap.c).
// No I/O. Sizes and offsets are bytes unless the name says otherwise.
//
// A bitmap of granularity 2^g bytes has one bit per 2^g guest bytes
// (ceil(image_size / 2^g) bits). Its data is stored in clusters, each
// holding cluster_size * 8 bits, bit i of a cluster in byte i / 8, bit
// i % 8 (least significant first; QEMU serializes little-endian longs). The
// bitmap table has one 64-bit entry per data cluster: the cluster's offset
// (bits 9..55), or 0 for a cluster of zeroes (bit 0 set: of ones).
// Thread model: plain values and pure functions, safe from any thread.
#ifndef IMGTOOL_QCOW2_FORMAT_BITMAP_H_
#define IMGTOOL_QCOW2_FORMAT_BITMAP_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace imgtool::qcow2::format {

// Directory entry flags.
inline constexpr uint32_t kBitmapFlagInUse = 1u << 0;
inline constexpr uint32_t kBitmapFlagAuto = 1u << 1;
inline constexpr uint32_t kBitmapReservedFlags = 0xfffffffcu;
// The only bitmap type: dirty tracking.
inline constexpr uint8_t kBitmapTypeDirtyTracking = 1;

// QEMU 7.2's limits (BME_* in block/qcow2-bitmap.c).
inline constexpr uint64_t kBitmapMaxTableSize = 0x8000000;  // entries
inline constexpr uint64_t kBitmapMaxPhysSize = 0x20000000;  // data bytes
inline constexpr uint32_t kBitmapMinGranularityBits = 9;
inline constexpr uint32_t kBitmapMaxGranularityBits = 31;
inline constexpr uint32_t kBitmapMaxNameSize = 1023;
// Fixed part of a directory entry (before extra data and name).
inline constexpr uint64_t kBitmapDirEntryHeaderSize = 24;

// Bitmap table entries.
inline constexpr uint64_t kBitmapTableReservedMask = 0xff000000000001feULL;
inline constexpr uint64_t kBitmapTableOffsetMask = 0x00fffffffffffe00ULL;
inline constexpr uint64_t kBitmapTableAllOnes = 1;

// One bitmap directory entry as stored (extra data must be empty: QEMU 7.2
// refuses images with any).
struct BitmapDirEntry {
  uint64_t table_offset = 0;  // cluster aligned
  uint32_t table_size = 0;    // entries
  uint32_t flags = 0;
  uint8_t type = kBitmapTypeDirtyTracking;
  uint8_t granularity_bits = 16;
  std::string name;  // 1..1023 bytes
  bool operator==(const BitmapDirEntry&) const = default;

  bool in_use() const { return (flags & kBitmapFlagInUse) != 0; }
  bool enabled() const { return (flags & kBitmapFlagAuto) != 0; }
};

// Bytes of one entry with a name of `name_size` bytes, padded to 8.
inline uint64_t BitmapDirEntrySize(uint64_t name_size) {
  return (kBitmapDirEntryHeaderSize + name_size + 7) & ~uint64_t{7};
}

// Bytes of bitmap data (whole 64-bit words, as QEMU serializes them) for
// an image of `image_size` bytes at granularity 2^granularity_bits.
uint64_t BitmapDataBytes(uint64_t image_size, uint32_t granularity_bits);
// Bitmap table entries (data clusters) QEMU 7.2 writes for such a bitmap.
uint64_t BitmapTableSize(uint64_t image_size, uint32_t granularity_bits,
                         uint32_t cluster_bits);

// QEMU's check_dir_entry: kDataLoss-free predicate, true if `e` satisfies
// the constraints (table size 1..kBitmapMaxTableSize and offset nonzero and
// cluster aligned, granularity 9..31 bits, no reserved flags, name at most
// 1023 bytes, type 1, table_size clusters at most kBitmapMaxPhysSize, and
// for a bitmap not in use a table large enough for `image_size`).
bool BitmapDirEntryValid(const BitmapDirEntry& e, uint32_t cluster_bits,
                         uint64_t image_size);

// Whether a bitmap table entry is valid (QEMU's check_table_entry): no
// reserved bits, and with an offset: cluster aligned and bit 0 clear.
bool BitmapTableEntryValid(uint64_t entry, uint64_t cluster_size);

// Decodes the bitmap directory (`bytes`: bitmap_directory_size bytes read
// at bitmap_directory_offset) of an image with `nb_bitmaps` bitmaps, as
// QEMU 7.2's bitmap_list_load does. kDataLoss with QEMU's words: "Requested
// bitmap directory size is zero", "Requested bitmap directory size is too
// big", "More bitmaps found than specified in header extension", "Less
// bitmaps found than specified in header extension", "Bitmap extra data is
// not supported", "Bitmap 'NAME' doesn't satisfy the constraints", "Broken
// bitmap directory" (an entry cut by the end of the directory, or bytes
// left after the last one).
absl::StatusOr<std::vector<BitmapDirEntry>> DecodeBitmapDirectory(
    absl::Span<const uint8_t> bytes, uint32_t nb_bitmaps,
    uint32_t cluster_bits, uint64_t image_size);

// Encodes `entries` as a directory (QEMU's bitmap_list_store layout; zero
// padding, no extra data).
std::vector<uint8_t> EncodeBitmapDirectory(
    const std::vector<BitmapDirEntry>& entries);

}  // namespace imgtool::qcow2::format

#endif  // IMGTOOL_QCOW2_FORMAT_BITMAP_H_

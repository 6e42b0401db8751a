// qcow2 image header and header extensions (qcow2 spec, "Header" and
// "Header extensions"): the bytes of cluster 0, decoded into a plain struct
// and encoded back exactly as QEMU 7.2 writes them. No I/O: callers read the
// first cluster and pass its bytes in, and write EncodeHeader()'s bytes out.
//
// Error messages do not name the file; the caller prefixes the path
// ("<file>: <message>"). Where QEMU has a message for the same condition the
// text is QEMU's, so `imgtool` errors read like `qemu-img`'s.
// Thread model: plain values and pure functions, safe from any thread.
#ifndef IMGTOOL_QCOW2_FORMAT_HEADER_H_
#define IMGTOOL_QCOW2_FORMAT_HEADER_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace imgtool::qcow2::format {

// "QFI\xfb".
inline constexpr uint32_t kMagic = 0x514649fb;

// Header sizes in bytes. A version 2 header is exactly 72 bytes; version 3
// needs at least 104 and QEMU writes 112 (through compression_type + padding).
inline constexpr uint32_t kV2HeaderLength = 72;
inline constexpr uint32_t kV3MinHeaderLength = 104;
inline constexpr uint32_t kV3HeaderLength = 112;

// Cluster sizes QEMU can open: 512 B .. 2 MiB.
inline constexpr uint32_t kMinClusterBits = 9;
inline constexpr uint32_t kMaxClusterBits = 21;
inline constexpr uint64_t kMaxClusterSize = uint64_t{1} << kMaxClusterBits;

// refcount_bits = 1 << refcount_order, at most 64.
inline constexpr uint32_t kMaxRefcountOrder = 6;
inline constexpr uint32_t kV2RefcountOrder = 4;

// QEMU implementation limits (block/qcow2.h).
inline constexpr uint64_t kMaxL1TableBytes = uint64_t{32} << 20;
inline constexpr uint64_t kMaxRefcountTableBytes = uint64_t{8} << 20;
inline constexpr uint32_t kMaxSnapshots = 65536;
inline constexpr uint32_t kMaxBackingFileNameLength = 1023;
// The backing format name must be shorter than 16 bytes.
inline constexpr uint32_t kMaxBackingFormatLength = 15;
inline constexpr uint32_t kMaxBitmaps = 65535;
inline constexpr uint64_t kMaxBitmapDirectorySize = 1024 * uint64_t{kMaxBitmaps};
// Size of one snapshot table entry without extra data, ID and name (qcow2
// spec, "Snapshots"); used to bound the snapshot table.
inline constexpr uint64_t kSnapshotEntryMinSize = 40;

// Incompatible feature bits (header offset 72). An image with a bit outside
// kIncompatibleFeaturesKnown must not be opened.
inline constexpr uint64_t kIncompatibleDirty = uint64_t{1} << 0;
inline constexpr uint64_t kIncompatibleCorrupt = uint64_t{1} << 1;
inline constexpr uint64_t kIncompatibleDataFile = uint64_t{1} << 2;
inline constexpr uint64_t kIncompatibleCompressionType = uint64_t{1} << 3;
inline constexpr uint64_t kIncompatibleExtendedL2 = uint64_t{1} << 4;
inline constexpr uint64_t kIncompatibleFeaturesKnown = 0x1f;

// Compatible feature bits (offset 80); unknown ones are ignored.
inline constexpr uint64_t kCompatibleLazyRefcounts = uint64_t{1} << 0;
inline constexpr uint64_t kCompatibleFeaturesKnown = 0x1;

// Autoclear feature bits (offset 88); a writer clears the unknown ones
// (header.autoclear_features &= kAutoclearFeaturesKnown) before writing.
inline constexpr uint64_t kAutoclearBitmaps = uint64_t{1} << 0;
inline constexpr uint64_t kAutoclearDataFileRaw = uint64_t{1} << 1;
inline constexpr uint64_t kAutoclearFeaturesKnown = 0x3;

// crypt_method values.
inline constexpr uint32_t kCryptNone = 0;
inline constexpr uint32_t kCryptAes = 1;
inline constexpr uint32_t kCryptLuks = 2;

// compression_type values.
inline constexpr uint8_t kCompressionZlib = 0;
inline constexpr uint8_t kCompressionZstd = 1;

// Header extension types.
inline constexpr uint32_t kExtensionEnd = 0x00000000;
inline constexpr uint32_t kExtensionBackingFormat = 0xe2792aca;
inline constexpr uint32_t kExtensionFeatureTable = 0x6803f857;
inline constexpr uint32_t kExtensionBitmaps = 0x23852875;
inline constexpr uint32_t kExtensionCrypto = 0x0537be77;
inline constexpr uint32_t kExtensionDataFile = 0x44415441;

// One entry of the feature name table extension (48 bytes on disk).
enum class FeatureType : uint8_t {
  kIncompatible = 0,
  kCompatible = 1,
  kAutoclear = 2,
};
struct FeatureName {
  FeatureType type = FeatureType::kIncompatible;
  uint8_t bit = 0;     // 0..63 within the selected feature field
  std::string name;    // at most 46 bytes, NUL padding stripped
  bool operator==(const FeatureName&) const = default;
};
inline constexpr uint32_t kFeatureNameEntrySize = 48;
inline constexpr uint32_t kFeatureNameMaxLength = 46;

// The table QEMU 7.2 writes into every version 3 image with clusters larger
// than 4 KiB (8 entries, 384 bytes): dirty bit, corrupt bit, external data
// file, compression type, extended L2 entries, lazy refcounts, bitmaps, raw
// external data.
const std::vector<FeatureName>& QemuFeatureTable();

// Bitmaps extension (24 bytes on disk; the reserved word must be zero).
struct BitmapsExtension {
  uint32_t nb_bitmaps = 0;
  uint64_t bitmap_directory_size = 0;    // bytes
  uint64_t bitmap_directory_offset = 0;  // cluster aligned
  bool operator==(const BitmapsExtension&) const = default;
};

// Full disk encryption header pointer (16 bytes on disk), LUKS only.
struct CryptoHeaderExtension {
  uint64_t offset = 0;  // cluster aligned
  uint64_t length = 0;  // bytes
  bool operator==(const CryptoHeaderExtension&) const = default;
};

// An extension this code does not know, kept to be rewritten verbatim.
struct UnknownExtension {
  uint32_t type = 0;
  std::vector<uint8_t> data;  // `length` bytes, without the padding
  bool operator==(const UnknownExtension&) const = default;
};

// Everything cluster 0 holds. Field names and units follow the spec; sizes
// and offsets are bytes unless the name says otherwise.
struct Header {
  uint32_t version = 3;
  uint64_t backing_file_offset = 0;  // 0 = no backing file
  uint32_t backing_file_size = 0;    // bytes of the name
  uint32_t cluster_bits = 16;
  uint64_t size = 0;                 // virtual disk size
  uint32_t crypt_method = kCryptNone;
  uint32_t l1_size = 0;              // entries
  uint64_t l1_table_offset = 0;
  uint64_t refcount_table_offset = 0;
  uint32_t refcount_table_clusters = 0;
  uint32_t nb_snapshots = 0;
  uint64_t snapshots_offset = 0;
  // Version 3 fields (version 2 reads them as 0, refcount_order 4, length 72).
  uint64_t incompatible_features = 0;
  uint64_t compatible_features = 0;
  uint64_t autoclear_features = 0;
  uint32_t refcount_order = 4;
  uint32_t header_length = kV3HeaderLength;  // as read; see EncodeHeader
  uint8_t compression_type = kCompressionZlib;  // 0 when header_length <= 104
  // Bytes [112, header_length) of a header longer than QEMU's: fields from a
  // newer spec, preserved on rewrite.
  std::vector<uint8_t> unknown_header_fields;

  // Header extensions. Each known one appears at most once; a later
  // duplicate replaces an earlier one.
  std::optional<std::string> backing_format;         // 0xe2792aca
  std::optional<std::string> data_file;              // 0x44415441
  std::optional<CryptoHeaderExtension> crypto_header;  // 0x0537be77
  std::vector<FeatureName> feature_names;            // 0x6803f857, as read
  std::optional<BitmapsExtension> bitmaps;           // 0x23852875
  // Set by DecodeHeader when a bitmaps extension was present but the
  // autoclear bitmaps bit was clear: the bitmaps are inconsistent and the
  // extension was dropped (QEMU warns "a program lacking bitmap support
  // modified this file ..." and drops it on the next header write).
  bool dropped_inconsistent_bitmaps = false;
  std::vector<UnknownExtension> unknown_extensions;  // in file order

  // The backing file name stored at backing_file_offset (cluster 0).
  std::optional<std::string> backing_file;

  uint64_t cluster_size() const { return uint64_t{1} << cluster_bits; }
  uint32_t refcount_bits() const { return uint32_t{1} << refcount_order; }
  bool extended_l2() const {
    return (incompatible_features & kIncompatibleExtendedL2) != 0;
  }
  bool has_data_file() const {
    return (incompatible_features & kIncompatibleDataFile) != 0;
  }
  bool data_file_raw() const {
    return (autoclear_features & kAutoclearDataFileRaw) != 0;
  }
  bool dirty() const { return (incompatible_features & kIncompatibleDirty) != 0; }
  bool corrupt() const {
    return (incompatible_features & kIncompatibleCorrupt) != 0;
  }
  bool lazy_refcounts() const {
    return (compatible_features & kCompatibleLazyRefcounts) != 0;
  }

  bool operator==(const Header&) const = default;
};

// Decodes and validates cluster 0 (qcow2 spec "Header", "Header extensions").
//
// `first_cluster_bytes` holds the start of the image file: at least the
// first cluster, or the whole file when it is shorter (bytes past the span
// read as zero, as reads past EOF do). Passing kMaxClusterSize bytes (or the
// whole file) always works. `file_size` is the image file's size in bytes;
// the L1 table, refcount table and encryption header must lie inside it.
// The bitmap directory and the snapshot table need not: QEMU reads the part
// past the end as zeroes (qcow2/bitmap_load.h, qcow2_read_snapshots), which
// then fail their checks or not.
//
// Errors:
//  * kInvalidArgument: `first_cluster_bytes` is shorter than the header or
//    than min(cluster size, file_size).
//  * kUnimplemented: valid per spec but beyond what QEMU (and imgtool)
//    supports: version not 2 or 3 ("Unsupported qcow2 version 4"), cluster
//    size above 2 MiB, unknown incompatible feature bits ("Unsupported qcow2
//    feature(s): Unknown incompatible feature: 800000", or the names from the
//    image's feature table), encryption method above 2, unknown compression
//    type, tables larger than QEMU's limits.
//  * kDataLoss: anything corrupt: bad magic, cluster_bits < 9, header_length,
//    misaligned or out-of-file tables, L1 table too small for `size`,
//    malformed extensions, feature bits that contradict each other.
// The dirty and corrupt bits are not errors here; the driver decides.
absl::StatusOr<Header> DecodeHeader(absl::Span<const uint8_t> first_cluster_bytes,
                                    uint64_t file_size);

// Encodes `header` as QEMU 7.2's qcow2_update_header() does: the header,
// then the extensions (backing format, data file name, crypto header, the
// feature name table of QemuFeatureTable() for version 3 with clusters larger
// than 4 KiB, bitmaps, unknown extensions in *reverse* order — QEMU's list
// of them is built by prepending, so each rewrite reverses them), the 8-byte
// end marker, and the backing file name right after it.
//
// Computed, not copied from `header`: header_length (72 for version 2,
// 112 + unknown_header_fields.size() for version 3), backing_file_offset and
// backing_file_size (0 without a backing file). The feature_names that were
// read are not written back (QEMU regenerates its own table).
//
// Returns the bytes from offset 0 to the end of the backing file name (or of
// the end marker); QEMU writes the whole of cluster 0, zero-filled after
// them. The caller must check that the result fits in one cluster (QEMU:
// ENOSPC) before writing.
std::vector<uint8_t> EncodeHeader(const Header& header);

}  // namespace imgtool::qcow2::format

#endif  // IMGTOOL_QCOW2_FORMAT_HEADER_H_

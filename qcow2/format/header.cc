#include "qcow2/format/header.h"

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "qcow2/format/endian.h"
#include "qcow2/format/l2_entry.h"

namespace imgtool::qcow2::format {
namespace {

using internal::LoadBE32;
using internal::LoadBE64;
using internal::StoreBE32;
using internal::StoreBE64;

// Header field offsets (qcow2 spec, "Header").
constexpr size_t kOffMagic = 0;
constexpr size_t kOffVersion = 4;
constexpr size_t kOffBackingFileOffset = 8;
constexpr size_t kOffBackingFileSize = 16;
constexpr size_t kOffClusterBits = 20;
constexpr size_t kOffSize = 24;
constexpr size_t kOffCryptMethod = 32;
constexpr size_t kOffL1Size = 36;
constexpr size_t kOffL1TableOffset = 40;
constexpr size_t kOffRefcountTableOffset = 48;
constexpr size_t kOffRefcountTableClusters = 56;
constexpr size_t kOffNbSnapshots = 60;
constexpr size_t kOffSnapshotsOffset = 64;
constexpr size_t kOffIncompatibleFeatures = 72;
constexpr size_t kOffCompatibleFeatures = 80;
constexpr size_t kOffAutoclearFeatures = 88;
constexpr size_t kOffRefcountOrder = 96;
constexpr size_t kOffHeaderLength = 100;
constexpr size_t kOffCompressionType = 104;

constexpr uint32_t kBitmapsExtensionSize = 24;
constexpr uint32_t kCryptoExtensionSize = 16;
// Extended L2 needs subclusters of at least 512 bytes: clusters of 16 KiB.
constexpr uint32_t kMinExtendedL2ClusterBits = 14;

uint64_t RoundUp8(uint64_t n) { return (n + 7) & ~uint64_t{7}; }

// QEMU's validate_table_offset(): the table's byte size must not overflow
// int64 and it must start on a cluster boundary.
bool ValidTableOffset(uint64_t offset, uint64_t entries, uint64_t entry_size,
                      uint64_t cluster_size) {
  constexpr uint64_t kInt64Max = uint64_t{INT64_MAX};
  if (entries > kInt64Max / entry_size) return false;
  const uint64_t size = entries * entry_size;
  if (kInt64Max - size < offset) return false;
  return (offset & (cluster_size - 1)) == 0;
}

// [offset, offset + size) lies inside a file of `file_size` bytes. Callers
// have already excluded overflow (ValidTableOffset).
bool InsideFile(uint64_t offset, uint64_t size, uint64_t file_size) {
  return offset <= file_size && size <= file_size - offset;
}

absl::Status BeyondEof(absl::string_view what, uint64_t offset, uint64_t size,
                       uint64_t file_size) {
  return absl::DataLossError(absl::StrFormat(
      "%s at 0x%x (%u bytes) extends beyond the end of the file (%u bytes)",
      what, offset, size, file_size));
}

std::vector<FeatureName> ParseFeatureTable(absl::Span<const uint8_t> data) {
  std::vector<FeatureName> names;
  for (size_t pos = 0; pos < data.size(); pos += kFeatureNameEntrySize) {
    // QEMU reads the extension into a zeroed buffer: an entry that the end
    // of the extension cuts counts with the missing bytes as zeroes.
    uint8_t entry[kFeatureNameEntrySize] = {};
    std::memcpy(entry, data.data() + pos,
                std::min<size_t>(kFeatureNameEntrySize, data.size() - pos));
    const uint8_t* e = entry;
    const char* name = reinterpret_cast<const char*>(e + 2);
    const size_t len = strnlen(name, kFeatureNameMaxLength);
    // QEMU stops at the first entry without a name.
    if (len == 0) break;
    FeatureName f;
    f.type = static_cast<FeatureType>(e[0]);
    f.bit = e[1];
    f.name.assign(name, len);
    names.push_back(std::move(f));
  }
  return names;
}

// "Unsupported qcow2 feature(s): a, b, Unknown incompatible feature: 800000"
// as QEMU's report_unsupported_feature() words it.
absl::Status UnsupportedFeatures(const std::vector<FeatureName>& table,
                                 uint64_t mask) {
  std::vector<std::string> parts;
  for (const FeatureName& f : table) {
    if (f.type != FeatureType::kIncompatible || f.bit >= 64) continue;
    const uint64_t bit = uint64_t{1} << f.bit;
    if (mask & bit) {
      parts.push_back(f.name);
      mask &= ~bit;
    }
  }
  if (mask) {
    parts.push_back(absl::StrFormat("Unknown incompatible feature: %x", mask));
  }
  return absl::UnimplementedError(absl::StrCat(
      "Unsupported qcow2 feature(s): ", absl::StrJoin(parts, ", ")));
}

// Walks the header extensions in cluster[start, end) like QEMU's
// qcow2_read_extensions(). With `names_only`, only the feature table is
// collected and nothing is validated (used to word the unknown-feature
// error).
absl::Status ReadExtensions(absl::Span<const uint8_t> cluster, uint64_t start,
                            uint64_t end, uint64_t file_size, bool names_only,
                            Header& h) {
  const uint64_t cluster_size = h.cluster_size();
  uint64_t offset = start;
  while (offset < end) {
    if (end - offset < 8) {
      return absl::DataLossError("Header extension too large");
    }
    const uint32_t type = LoadBE32(cluster.data() + offset);
    const uint32_t len = LoadBE32(cluster.data() + offset + 4);
    offset += 8;
    if (len > end - offset) {
      return absl::DataLossError("Header extension too large");
    }
    const absl::Span<const uint8_t> data = cluster.subspan(offset, len);
    const std::string text(data.begin(), data.end());
    if (type == kExtensionEnd) return absl::OkStatus();
    if (names_only) {
      if (type == kExtensionFeatureTable) h.feature_names = ParseFeatureTable(data);
      offset += RoundUp8(len);
      continue;
    }
    switch (type) {
      case kExtensionBackingFormat:
        if (len > kMaxBackingFormatLength) {
          return absl::UnimplementedError(absl::StrFormat(
              "ERROR: ext_backing_format: len=%u too large (>=%u)", len,
              kMaxBackingFormatLength + 1));
        }
        h.backing_format = text;
        break;
      case kExtensionFeatureTable:
        h.feature_names = ParseFeatureTable(data);
        break;
      case kExtensionCrypto: {
        if (h.crypt_method != kCryptLuks) {
          return absl::DataLossError(
              "CRYPTO header extension only expected with LUKS encryption "
              "method");
        }
        if (len != kCryptoExtensionSize) {
          return absl::DataLossError(absl::StrFormat(
              "CRYPTO header extension size %u, but expected size %u", len,
              kCryptoExtensionSize));
        }
        CryptoHeaderExtension c;
        c.offset = LoadBE64(data.data());
        c.length = LoadBE64(data.data() + 8);
        if (c.offset % cluster_size != 0) {
          return absl::DataLossError(absl::StrFormat(
              "Encryption header offset '%u' is not a multiple of cluster "
              "size '%u'",
              c.offset, cluster_size));
        }
        if (!InsideFile(c.offset, c.length, file_size)) {
          return BeyondEof("Encryption header", c.offset, c.length, file_size);
        }
        h.crypto_header = c;
        break;
      }
      case kExtensionBitmaps: {
        if (len != kBitmapsExtensionSize) {
          return absl::DataLossError("bitmaps_ext: Invalid extension length");
        }
        if (!(h.autoclear_features & kAutoclearBitmaps)) {
          // Inconsistent: QEMU warns and drops the extension on rewrite.
          h.bitmaps.reset();
          h.dropped_inconsistent_bitmaps = true;
          break;
        }
        if (LoadBE32(data.data() + 4) != 0) {
          return absl::DataLossError("bitmaps_ext: Reserved field is not zero");
        }
        BitmapsExtension b;
        b.nb_bitmaps = LoadBE32(data.data());
        b.bitmap_directory_size = LoadBE64(data.data() + 8);
        b.bitmap_directory_offset = LoadBE64(data.data() + 16);
        if (b.nb_bitmaps > kMaxBitmaps) {
          return absl::UnimplementedError(absl::StrFormat(
              "bitmaps_ext: Image has %u bitmaps, exceeding the QEMU "
              "supported maximum of %u",
              b.nb_bitmaps, kMaxBitmaps));
        }
        if (b.nb_bitmaps == 0) {
          return absl::DataLossError(
              "found bitmaps extension with zero bitmaps");
        }
        if (b.bitmap_directory_offset & (cluster_size - 1)) {
          return absl::DataLossError(
              "bitmaps_ext: invalid bitmap directory offset");
        }
        if (b.bitmap_directory_size > kMaxBitmapDirectorySize) {
          return absl::UnimplementedError(absl::StrFormat(
              "bitmaps_ext: bitmap directory size (%u) exceeds the maximum "
              "supported size (%u)",
              b.bitmap_directory_size, kMaxBitmapDirectorySize));
        }
        h.bitmaps = b;
        break;
      }
      case kExtensionDataFile:
        h.data_file = text;
        break;
      default:
        h.unknown_extensions.push_back(
            UnknownExtension{type, std::vector<uint8_t>(data.begin(), data.end())});
        break;
    }
    offset += RoundUp8(len);
  }
  return absl::OkStatus();
}

void AppendExtension(std::vector<uint8_t>& out, uint32_t type,
                     absl::Span<const uint8_t> data) {
  const size_t pos = out.size();
  out.resize(pos + 8 + RoundUp8(data.size()), 0);
  StoreBE32(out.data() + pos, type);
  StoreBE32(out.data() + pos + 4, static_cast<uint32_t>(data.size()));
  std::copy(data.begin(), data.end(), out.begin() + pos + 8);
}

void AppendExtension(std::vector<uint8_t>& out, uint32_t type,
                     const std::string& data) {
  AppendExtension(out, type,
                  absl::Span<const uint8_t>(
                      reinterpret_cast<const uint8_t*>(data.data()), data.size()));
}

}  // namespace

const std::vector<FeatureName>& QemuFeatureTable() {
  static const std::vector<FeatureName>* const table =
      new std::vector<FeatureName>{
          {FeatureType::kIncompatible, 0, "dirty bit"},
          {FeatureType::kIncompatible, 1, "corrupt bit"},
          {FeatureType::kIncompatible, 2, "external data file"},
          {FeatureType::kIncompatible, 3, "compression type"},
          {FeatureType::kIncompatible, 4, "extended L2 entries"},
          {FeatureType::kCompatible, 0, "lazy refcounts"},
          {FeatureType::kAutoclear, 0, "bitmaps"},
          {FeatureType::kAutoclear, 1, "raw external data"},
      };
  return *table;
}

absl::StatusOr<Header> DecodeHeader(absl::Span<const uint8_t> first_cluster_bytes,
                                    uint64_t file_size) {
  // Bytes past the span read as zeros (past EOF), but only if the span holds
  // everything the file has there.
  const uint64_t span_size = first_cluster_bytes.size();
  auto need = [&](uint64_t bytes) -> absl::Status {
    if (span_size < std::min(bytes, file_size)) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "qcow2 header decoding needs the first %u bytes of the image, got %u",
          std::min(bytes, file_size), span_size));
    }
    return absl::OkStatus();
  };
  if (absl::Status st = need(kV3HeaderLength); !st.ok()) return st;

  uint8_t raw[kV3HeaderLength] = {};
  std::memcpy(raw, first_cluster_bytes.data(),
              std::min<uint64_t>(span_size, kV3HeaderLength));

  Header h;
  if (LoadBE32(raw + kOffMagic) != kMagic) {
    return absl::DataLossError("Image is not in qcow2 format");
  }
  h.version = LoadBE32(raw + kOffVersion);
  if (h.version < 2 || h.version > 3) {
    return absl::UnimplementedError(
        absl::StrFormat("Unsupported qcow2 version %u", h.version));
  }
  h.backing_file_offset = LoadBE64(raw + kOffBackingFileOffset);
  h.backing_file_size = LoadBE32(raw + kOffBackingFileSize);
  h.cluster_bits = LoadBE32(raw + kOffClusterBits);
  h.size = LoadBE64(raw + kOffSize);
  h.crypt_method = LoadBE32(raw + kOffCryptMethod);
  h.l1_size = LoadBE32(raw + kOffL1Size);
  h.l1_table_offset = LoadBE64(raw + kOffL1TableOffset);
  h.refcount_table_offset = LoadBE64(raw + kOffRefcountTableOffset);
  h.refcount_table_clusters = LoadBE32(raw + kOffRefcountTableClusters);
  h.nb_snapshots = LoadBE32(raw + kOffNbSnapshots);
  h.snapshots_offset = LoadBE64(raw + kOffSnapshotsOffset);

  if (h.cluster_bits < kMinClusterBits) {
    return absl::DataLossError(
        absl::StrFormat("Unsupported cluster size: 2^%u", h.cluster_bits));
  }
  if (h.cluster_bits > kMaxClusterBits) {
    return absl::UnimplementedError(
        absl::StrFormat("Unsupported cluster size: 2^%u", h.cluster_bits));
  }
  const uint64_t cluster_size = h.cluster_size();

  if (h.version == 2) {
    h.incompatible_features = 0;
    h.compatible_features = 0;
    h.autoclear_features = 0;
    h.refcount_order = kV2RefcountOrder;
    h.header_length = kV2HeaderLength;
  } else {
    h.incompatible_features = LoadBE64(raw + kOffIncompatibleFeatures);
    h.compatible_features = LoadBE64(raw + kOffCompatibleFeatures);
    h.autoclear_features = LoadBE64(raw + kOffAutoclearFeatures);
    h.refcount_order = LoadBE32(raw + kOffRefcountOrder);
    h.header_length = LoadBE32(raw + kOffHeaderLength);
    if (h.header_length < kV3MinHeaderLength) {
      return absl::DataLossError("qcow2 header too short");
    }
  }
  if (h.header_length > cluster_size) {
    return absl::DataLossError("qcow2 header exceeds cluster size");
  }

  // From here on, work on a zero-padded copy of cluster 0.
  if (absl::Status st = need(cluster_size); !st.ok()) return st;
  std::vector<uint8_t> cluster(cluster_size, 0);
  std::memcpy(cluster.data(), first_cluster_bytes.data(),
              std::min<uint64_t>(span_size, cluster_size));

  if (h.header_length > kOffCompressionType) {
    h.compression_type = cluster[kOffCompressionType];
  }
  if (h.header_length > kV3HeaderLength) {
    h.unknown_header_fields.assign(cluster.begin() + kV3HeaderLength,
                                   cluster.begin() + h.header_length);
  }

  if (h.backing_file_offset > cluster_size) {
    return absl::DataLossError("Invalid backing file offset");
  }
  const uint64_t ext_end =
      h.backing_file_offset != 0 ? h.backing_file_offset : cluster_size;

  if (const uint64_t unknown =
          h.incompatible_features & ~kIncompatibleFeaturesKnown) {
    Header names = h;
    // Best effort: a broken extension area just means no names.
    ReadExtensions(cluster, h.header_length, ext_end, file_size,
                   /*names_only=*/true, names)
        .IgnoreError();
    return UnsupportedFeatures(names.feature_names, unknown);
  }

  if (h.refcount_order > kMaxRefcountOrder) {
    return absl::DataLossError(
        "Reference count entry width too large; may not exceed 64 bits");
  }
  if (h.crypt_method > kCryptLuks) {
    return absl::UnimplementedError(
        absl::StrFormat("Unsupported encryption method %u", h.crypt_method));
  }
  if (h.compression_type != kCompressionZlib &&
      h.compression_type != kCompressionZstd) {
    return absl::UnimplementedError(absl::StrFormat(
        "qcow2: unknown compression type: %u", h.compression_type));
  }
  const bool compression_bit =
      (h.incompatible_features & kIncompatibleCompressionType) != 0;
  if (h.compression_type == kCompressionZlib && compression_bit) {
    return absl::DataLossError(
        "qcow2: Compression type incompatible feature bit must not be set");
  }
  if (h.compression_type != kCompressionZlib && !compression_bit) {
    return absl::DataLossError(
        "qcow2: Compression type incompatible feature bit must be set");
  }
  if (h.extended_l2() && h.cluster_bits < kMinExtendedL2ClusterBits) {
    return absl::DataLossError(absl::StrFormat(
        "Unsupported subcluster size: %u", SubclusterSize(h.cluster_bits)));
  }

  // Refcount table.
  if (h.refcount_table_clusters == 0) {
    return absl::DataLossError(
        "Image does not contain a reference count table");
  }
  if (h.refcount_table_clusters > (kMaxRefcountTableBytes >> h.cluster_bits)) {
    return absl::UnimplementedError("Reference count table too large");
  }
  const uint64_t reftable_bytes =
      uint64_t{h.refcount_table_clusters} << h.cluster_bits;
  if (!ValidTableOffset(h.refcount_table_offset, reftable_bytes / 8, 8,
                        cluster_size)) {
    return absl::DataLossError("Reference count table offset invalid");
  }
  if (!InsideFile(h.refcount_table_offset, reftable_bytes, file_size)) {
    return BeyondEof("Reference count table", h.refcount_table_offset,
                     reftable_bytes, file_size);
  }

  // Snapshot table.
  if (h.nb_snapshots > kMaxSnapshots) {
    return absl::UnimplementedError("Snapshot table too large");
  }
  if (!ValidTableOffset(h.snapshots_offset, h.nb_snapshots,
                        kSnapshotEntryMinSize, cluster_size)) {
    return absl::DataLossError("Snapshot table offset invalid");
  }
  // No end-of-file check: QEMU 7.2 reads the snapshot table entry by entry
  // and what lies past the end of the file reads as zeroes
  // (qcow2_read_snapshots), so such a table opens.

  // Active L1 table.
  if (h.l1_size > kMaxL1TableBytes / 8) {
    return absl::UnimplementedError("Active L1 table too large");
  }
  const uint64_t l1_needed =
      L1EntriesForSize(h.size, h.cluster_bits, h.extended_l2());
  if (l1_needed > uint64_t{INT_MAX}) {
    return absl::UnimplementedError("Image is too big");
  }
  if (h.l1_size < l1_needed) {
    return absl::DataLossError("L1 table is too small");
  }
  if (!ValidTableOffset(h.l1_table_offset, h.l1_size, 8, cluster_size)) {
    return absl::DataLossError("Active L1 table offset invalid");
  }
  if (h.l1_size > 0 &&
      !InsideFile(h.l1_table_offset, uint64_t{h.l1_size} * 8, file_size)) {
    return BeyondEof("Active L1 table", h.l1_table_offset,
                     uint64_t{h.l1_size} * 8, file_size);
  }

  if (absl::Status st = ReadExtensions(cluster, h.header_length, ext_end,
                                       file_size, /*names_only=*/false, h);
      !st.ok()) {
    return st;
  }
  if (h.crypt_method == kCryptLuks && !h.crypto_header.has_value()) {
    return absl::DataLossError(absl::StrFormat(
        "Missing CRYPTO header for crypt method %u", h.crypt_method));
  }

  if (h.backing_file_offset != 0) {
    const uint64_t max_len = std::min<uint64_t>(
        kMaxBackingFileNameLength, cluster_size - h.backing_file_offset);
    if (h.backing_file_size > max_len) {
      return absl::DataLossError("Backing file name too long");
    }
    h.backing_file.emplace(
        reinterpret_cast<const char*>(cluster.data() + h.backing_file_offset),
        h.backing_file_size);
  }

  if (h.data_file_raw() && !h.has_data_file()) {
    return absl::DataLossError("data-file-raw requires a data file");
  }
  return h;
}

std::vector<uint8_t> EncodeHeader(const Header& h) {
  const bool v3 = h.version >= 3;
  const uint32_t header_length =
      v3 ? kV3HeaderLength + static_cast<uint32_t>(h.unknown_header_fields.size())
         : kV2HeaderLength;
  std::vector<uint8_t> out(header_length, 0);
  uint8_t* p = out.data();
  StoreBE32(p + kOffMagic, kMagic);
  StoreBE32(p + kOffVersion, h.version);
  // Backing file offset/size are filled in at the end.
  StoreBE32(p + kOffClusterBits, h.cluster_bits);
  StoreBE64(p + kOffSize, h.size);
  StoreBE32(p + kOffCryptMethod, h.crypt_method);
  StoreBE32(p + kOffL1Size, h.l1_size);
  StoreBE64(p + kOffL1TableOffset, h.l1_table_offset);
  StoreBE64(p + kOffRefcountTableOffset, h.refcount_table_offset);
  StoreBE32(p + kOffRefcountTableClusters, h.refcount_table_clusters);
  StoreBE32(p + kOffNbSnapshots, h.nb_snapshots);
  StoreBE64(p + kOffSnapshotsOffset, h.snapshots_offset);
  if (v3) {
    StoreBE64(p + kOffIncompatibleFeatures, h.incompatible_features);
    StoreBE64(p + kOffCompatibleFeatures, h.compatible_features);
    StoreBE64(p + kOffAutoclearFeatures, h.autoclear_features);
    StoreBE32(p + kOffRefcountOrder, h.refcount_order);
    StoreBE32(p + kOffHeaderLength, header_length);
    p[kOffCompressionType] = h.compression_type;
    std::copy(h.unknown_header_fields.begin(), h.unknown_header_fields.end(),
              out.begin() + kV3HeaderLength);
  }

  if (h.backing_format.has_value()) {
    AppendExtension(out, kExtensionBackingFormat, *h.backing_format);
  }
  if (h.has_data_file() && h.data_file.has_value()) {
    AppendExtension(out, kExtensionDataFile, *h.data_file);
  }
  if (h.crypto_header.has_value() && h.crypto_header->offset != 0) {
    uint8_t data[kCryptoExtensionSize];
    StoreBE64(data, h.crypto_header->offset);
    StoreBE64(data + 8, h.crypto_header->length);
    AppendExtension(out, kExtensionCrypto, absl::MakeConstSpan(data));
  }
  if (v3 && h.cluster_size() > 4096) {
    const std::vector<FeatureName>& table = QemuFeatureTable();
    std::vector<uint8_t> data(table.size() * kFeatureNameEntrySize, 0);
    for (size_t i = 0; i < table.size(); ++i) {
      uint8_t* e = data.data() + i * kFeatureNameEntrySize;
      e[0] = static_cast<uint8_t>(table[i].type);
      e[1] = table[i].bit;
      std::memcpy(e + 2, table[i].name.data(), table[i].name.size());
    }
    AppendExtension(out, kExtensionFeatureTable, data);
  }
  if (h.bitmaps.has_value() && h.bitmaps->nb_bitmaps > 0) {
    uint8_t data[kBitmapsExtensionSize] = {};
    StoreBE32(data, h.bitmaps->nb_bitmaps);
    StoreBE64(data + 8, h.bitmaps->bitmap_directory_size);
    StoreBE64(data + 16, h.bitmaps->bitmap_directory_offset);
    AppendExtension(out, kExtensionBitmaps, absl::MakeConstSpan(data));
  }
  for (auto it = h.unknown_extensions.rbegin();
       it != h.unknown_extensions.rend(); ++it) {
    AppendExtension(out, it->type, it->data);
  }
  AppendExtension(out, kExtensionEnd, absl::Span<const uint8_t>());

  if (h.backing_file.has_value()) {
    const uint64_t offset = out.size();
    out.insert(out.end(), h.backing_file->begin(), h.backing_file->end());
    StoreBE64(out.data() + kOffBackingFileOffset, offset);
    StoreBE32(out.data() + kOffBackingFileSize,
              static_cast<uint32_t>(h.backing_file->size()));
  }
  return out;
}

}  // namespace imgtool::qcow2::format

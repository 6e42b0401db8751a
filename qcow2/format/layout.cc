#include "qcow2/format/layout.h"

#include <cstdint>
#include <vector>

#include "absl/numeric/bits.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_format.h"
#include "qcow2/format/header.h"
#include "qcow2/format/l2_entry.h"
#include "qcow2/format/refcount.h"

namespace imgtool::qcow2::format {
namespace {

constexpr uint64_t kSectorSize = 512;
constexpr uint64_t kMinExtendedL2ClusterSize = 16384;
constexpr char kNeedsV3[] =
    " only supported with compatibility level 1.1 and above (use version=v3 "
    "or greater)";

absl::Status Invalid(const std::string& message) {
  return absl::InvalidArgumentError(message);
}

}  // namespace

absl::StatusOr<NewImageLayout> ComputeNewImageLayout(
    const NewImageOptions& o) {
  const uint64_t cs = o.cluster_size;
  if (!absl::has_single_bit(cs) || cs < (uint64_t{1} << kMinClusterBits) ||
      cs > kMaxClusterSize) {
    return Invalid("Cluster size must be a power of two between 512 and 2048k");
  }
  if (o.version != 2 && o.version != 3) {
    return Invalid(absl::StrFormat("Invalid compat version %u", o.version));
  }
  if (!absl::has_single_bit(o.refcount_bits) || o.refcount_bits > 64) {
    return Invalid(
        "Refcount width must be a power of two and may not exceed 64 bits");
  }
  if (o.version < 3 && o.refcount_bits != 16) {
    return Invalid(
        "Different refcount widths than 16 bits require compatibility level "
        "1.1 or above (use version=v3 or greater)");
  }
  if (o.version < 3 && o.extended_l2) {
    return Invalid(std::string("Extended L2 entries are") + kNeedsV3);
  }
  if (o.extended_l2 && cs < kMinExtendedL2ClusterSize) {
    return Invalid(
        "Extended L2 entries are only supported with cluster sizes of at "
        "least 16384 bytes");
  }
  if (o.version < 3 && o.lazy_refcounts) {
    return Invalid(std::string("Lazy refcounts") + kNeedsV3);
  }
  if (o.compression_type != kCompressionZlib &&
      o.compression_type != kCompressionZstd) {
    return Invalid(
        absl::StrFormat("Unknown compression type %u", o.compression_type));
  }
  if (o.version < 3 && o.compression_type != kCompressionZlib) {
    return Invalid(std::string("Non-zlib compression type is") + kNeedsV3);
  }
  if (o.backing_format.has_value() && !o.backing_file.has_value()) {
    return Invalid("Backing format cannot be used without backing file");
  }
  if (o.version < 3 && o.data_file.has_value()) {
    return Invalid(std::string("External data files are") + kNeedsV3);
  }
  if (o.data_file_raw && !o.data_file.has_value()) {
    return Invalid("data-file-raw requires data-file");
  }
  if (o.data_file_raw && o.backing_file.has_value()) {
    return Invalid("Backing file and data-file-raw cannot be used at the same time");
  }
  if (o.size > uint64_t{INT64_MAX}) {
    return Invalid(absl::StrFormat(
        "Invalid image size specified. Must be between 0 and %d.", INT64_MAX));
  }

  NewImageLayout l;
  l.cluster_bits = static_cast<uint32_t>(absl::countr_zero(cs));
  l.refcount_order = static_cast<uint32_t>(absl::countr_zero(o.refcount_bits));
  l.virtual_size = (o.size + kSectorSize - 1) / kSectorSize * kSectorSize;
  const uint64_t l1_entries =
      L1EntriesForSize(l.virtual_size, l.cluster_bits, o.extended_l2);
  if (l1_entries > kMaxL1TableBytes / 8) {
    return Invalid(
        "The image size is too large for file format 'qcow2' (try using a "
        "larger cluster size)");
  }
  if (o.data_file_raw) {
    return absl::UnimplementedError(
        "data-file-raw images are created with metadata preallocation, "
        "which is not supported yet");
  }
  l.l1_size = static_cast<uint32_t>(l1_entries);
  l.refcount_table_offset = cs;
  l.refcount_table_clusters = 1;
  l.refcount_block_offset = 2 * cs;
  const uint64_t l1_bytes = uint64_t{l.l1_size} * 8;
  const uint64_t l1_clusters = (l1_bytes + cs - 1) / cs;
  l.l1_table_offset = l.l1_size > 0 ? 3 * cs : 0;
  l.used_clusters = 3 + l1_clusters;
  l.file_size = l.l1_size > 0 ? l.l1_table_offset + l1_bytes : 3 * cs;
  if (l.used_clusters > RefcountEntriesPerBlock(l.cluster_bits, l.refcount_order)) {
    return absl::UnimplementedError(absl::StrFormat(
        "an L1 table of %u entries does not fit in the clusters covered by "
        "the first refcount block (%u clusters of %u bytes with %u-bit "
        "refcounts); QEMU's layout for that is not supported yet",
        l.l1_size, RefcountEntriesPerBlock(l.cluster_bits, l.refcount_order),
        cs, o.refcount_bits));
  }
  return l;
}

Header NewImageHeader(const NewImageOptions& o, const NewImageLayout& l) {
  Header h;
  h.version = o.version;
  h.cluster_bits = l.cluster_bits;
  h.size = l.virtual_size;
  h.l1_size = l.l1_size;
  h.l1_table_offset = l.l1_table_offset;
  h.refcount_table_offset = l.refcount_table_offset;
  h.refcount_table_clusters = l.refcount_table_clusters;
  h.refcount_order = l.refcount_order;
  h.header_length = o.version >= 3 ? kV3HeaderLength : kV2HeaderLength;
  if (o.extended_l2) h.incompatible_features |= kIncompatibleExtendedL2;
  if (o.data_file.has_value()) h.incompatible_features |= kIncompatibleDataFile;
  if (o.data_file_raw) h.autoclear_features |= kAutoclearDataFileRaw;
  if (o.lazy_refcounts) h.compatible_features |= kCompatibleLazyRefcounts;
  if (o.compression_type != kCompressionZlib) {
    h.incompatible_features |= kIncompatibleCompressionType;
    h.compression_type = o.compression_type;
  }
  if (o.version >= 3 && h.cluster_size() > 4096) {
    h.feature_names = QemuFeatureTable();
  }
  h.backing_format = o.backing_format;
  h.data_file = o.data_file;
  h.backing_file = o.backing_file;
  if (o.backing_file.has_value()) {
    // Where EncodeHeader() puts the name: right after the end marker.
    Header probe = h;
    probe.backing_file.reset();
    h.backing_file_offset = EncodeHeader(probe).size();
    h.backing_file_size = static_cast<uint32_t>(o.backing_file->size());
  }
  return h;
}

std::vector<FileExtent> NewImageContents(const NewImageOptions& o,
                                         const NewImageLayout& l) {
  const uint64_t cs = uint64_t{1} << l.cluster_bits;
  std::vector<FileExtent> out;

  FileExtent header{0, EncodeHeader(NewImageHeader(o, l))};
  header.bytes.resize(cs, 0);
  out.push_back(std::move(header));

  FileExtent reftable{l.refcount_table_offset, std::vector<uint8_t>(cs, 0)};
  StoreRefcountTableEntry(absl::MakeSpan(reftable.bytes), 0,
                          l.refcount_block_offset);
  out.push_back(std::move(reftable));

  FileExtent block{l.refcount_block_offset, std::vector<uint8_t>(cs, 0)};
  for (uint64_t i = 0; i < l.used_clusters; ++i) {
    SetRefcount(absl::MakeSpan(block.bytes), i, l.refcount_order, 1);
  }
  out.push_back(std::move(block));
  return out;
}

}  // namespace imgtool::qcow2::format

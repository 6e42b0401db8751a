// Fuzz target: qcow2 byte-layout decoding (qcow2/format), no I/O. The input
// is decoded as cluster 0 of an image (header and extensions) with the
// input's own length as the file size and with a 1 TiB file, and every
// decoded header is encoded again and decoded back (same geometry). The
// input, after its first byte, is also taken as an L1 table, an L2 table
// (standard and extended entries, cluster size from the first byte), a
// refcount table and a refcount block of every refcount width. Invariants
// checked (abort on violation): decoded L1 entries encode back to the raw
// word, subcluster runs stay inside their cluster, refcounts fit their width
// and SetRefcount/GetRefcount round-trip without touching neighbours.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "qcow2/format/header.h"
#include "qcow2/format/l2_entry.h"
#include "qcow2/format/refcount.h"

namespace imgtool::qcow2::format {
namespace {

void Require(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "format_fuzzer: %s\n", what);
    std::abort();
  }
}

void FuzzHeader(absl::Span<const uint8_t> bytes, uint64_t file_size) {
  absl::StatusOr<Header> header = DecodeHeader(bytes, file_size);
  if (!header.ok()) return;
  std::vector<uint8_t> encoded = EncodeHeader(*header);
  if (encoded.size() > header->cluster_size()) return;  // QEMU: ENOSPC
  // Re-decoded with the rest of cluster 0 zeroed, as QEMU writes it.
  encoded.resize(header->cluster_size(), 0);
  absl::StatusOr<Header> again = DecodeHeader(encoded, file_size);
  if (!again.ok()) return;  // e.g. an extension that only fit unpadded
  Require(again->version == header->version &&
              again->cluster_bits == header->cluster_bits &&
              again->size == header->size &&
              again->l1_size == header->l1_size &&
              again->l1_table_offset == header->l1_table_offset &&
              again->refcount_table_offset == header->refcount_table_offset &&
              again->refcount_order == header->refcount_order &&
              again->incompatible_features == header->incompatible_features &&
              again->backing_file == header->backing_file &&
              again->backing_format == header->backing_format,
          "EncodeHeader/DecodeHeader changed the geometry");
}

void FuzzL1(absl::Span<const uint8_t> table, uint32_t cluster_bits) {
  for (uint64_t i = 0; (i + 1) * 8 <= table.size(); ++i) {
    const uint64_t raw = LoadL1Entry(table, i);
    absl::StatusOr<L1Entry> entry = DecodeL1Entry(raw, cluster_bits);
    if (!entry.ok()) continue;
    Require(EncodeL1Entry(*entry) == raw, "L1 entry does not round-trip");
  }
}

void FuzzL2(absl::Span<const uint8_t> table, const L2Format& format) {
  const uint64_t entry_size = L2EntrySize(format.extended_l2);
  for (uint64_t i = 0; (i + 1) * entry_size <= table.size(); ++i) {
    const L2Entry entry = LoadL2Entry(table, i, format.extended_l2);
    absl::StatusOr<ClusterType> type = GetClusterType(entry, format);
    if (type.ok() && entry.compressed()) {
      (void)DecodeCompressedDescriptor(entry.word, format.cluster_bits);
    }
    (void)CheckSubclusterBitmap(entry, format);
    for (uint32_t sc = 0; sc < kSubclustersPerCluster; ++sc) {
      (void)GetSubclusterType(entry, sc, format);
      const uint32_t run = CountSubclustersOfSameType(entry, sc, format);
      Require(run >= 1 && run <= kSubclustersPerCluster - sc,
              "subcluster run outside its cluster");
    }
  }
}

void FuzzRefcounts(absl::Span<const uint8_t> bytes, uint32_t cluster_bits) {
  for (uint64_t i = 0; (i + 1) * 8 <= bytes.size(); ++i) {
    (void)DecodeRefcountTableEntry(LoadRefcountTableEntry(bytes, i),
                                   cluster_bits);
  }
  for (uint32_t order = 0; order <= kMaxRefcountOrder; ++order) {
    const uint64_t entries = bytes.size() * 8 >> order;
    std::vector<uint8_t> block(bytes.begin(), bytes.end());
    for (uint64_t i = 0; i < entries; ++i) {
      const uint64_t value = GetRefcount(bytes, i, order);
      Require(value <= MaxRefcount(order), "refcount wider than its order");
      // Store the complement in a copy: only entry i may change.
      SetRefcount(absl::MakeSpan(block), i, order, ~value & MaxRefcount(order));
      Require(GetRefcount(block, i, order) == (~value & MaxRefcount(order)),
              "SetRefcount/GetRefcount do not round-trip");
      if (i > 0) {
        Require(GetRefcount(block, i - 1, order) ==
                    (~GetRefcount(bytes, i - 1, order) & MaxRefcount(order)),
                "SetRefcount changed the entry before");
      }
      if (i + 1 < entries) {
        Require(GetRefcount(block, i + 1, order) == GetRefcount(bytes, i + 1, order),
                "SetRefcount changed the entry after");
      }
    }
  }
}

}  // namespace
}  // namespace imgtool::qcow2::format

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace imgtool::qcow2::format;
  if (size > kMaxClusterSize + 1) return 0;
  const absl::Span<const uint8_t> bytes(data, size);
  FuzzHeader(bytes, size);
  FuzzHeader(bytes, uint64_t{1} << 40);
  if (size == 0) return 0;
  const uint32_t cluster_bits = kMinClusterBits + data[0] % 13;  // 9..21
  // The first KiB as the tables: what varies is the entries, not their
  // number, and every extended entry costs 32 subcluster lookups.
  const absl::Span<const uint8_t> table = bytes.subspan(1, 1024);
  FuzzL1(table, cluster_bits);
  L2Format format;
  format.cluster_bits = cluster_bits;
  format.external_data_file = (data[0] & 0x40) != 0;
  format.extended_l2 = false;
  FuzzL2(table, format);
  format.extended_l2 = true;
  FuzzL2(table, format);
  // Each refcount width reads all of it; 256 bytes are 2048 1-bit entries.
  FuzzRefcounts(table.subspan(0, 256), cluster_bits);
  return 0;
}

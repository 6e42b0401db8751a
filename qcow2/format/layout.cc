#include "qcow2/format/layout.h"

#include <algorithm>
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/numeric/bits.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_format.h"
#include "absl/types/span.h"
#include "qcow2/format/endian.h"
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

uint64_t DivRoundUp(uint64_t a, uint64_t b) { return a / b + (a % b != 0); }

// An in-memory replay of QEMU 7.2's cluster allocator while it creates an
// image: refcount table, refcount blocks, the "first free cluster" hint, and
// every write it makes to the file. Only what creation exercises is modelled:
// every refcount goes 0 -> 1 (or back to 0 when an allocation is undone).
//
// The allocator's shape, which the replay must keep to land on the same
// offsets:
//  * Allocation scans for n consecutive clusters with refcount 0, starting
//    at the hint and restarting after any used cluster; the hint ends up
//    just past the result.
//  * Refcounts are then set cluster by cluster. Reaching a cluster whose
//    refcount block does not exist yet allocates that block (one cluster,
//    found by the same scan). A block that covers itself gets its own
//    refcount; otherwise its refcount is set first, which may recurse. The
//    new block is hooked into the refcount table and the whole allocation is
//    undone and retried ("EAGAIN"), with the hint moved back to its start.
//  * If the refcount table is full, a new, larger table plus any blocks it
//    needs are placed at the first block boundary past both the triggering
//    cluster and the new block; blocks that cover the new area count it, and
//    the old table is freed (its bytes stay in the file).
class CreationAllocator {
 public:
  CreationAllocator(uint32_t cluster_bits, uint32_t refcount_order)
      : refcount_order_(refcount_order),
        cluster_size_(uint64_t{1} << cluster_bits),
        per_block_(RefcountEntriesPerBlock(cluster_bits, refcount_order)) {
    // The file qcow2_co_create writes before reopening it: a header cluster,
    // a one-cluster refcount table whose entry 0 points at cluster 2, and an
    // empty refcount block there.
    table_.assign(cluster_size_ / 8, 0);
    table_[0] = 2 * cluster_size_;
    table_offset_ = cluster_size_;
    blocks_[2 * cluster_size_].assign(cluster_size_, 0);
    WriteZeros(0, cluster_size_);  // cluster 0 is rewritten by the header
    WriteTable(table_offset_, table_);
    WriteZeros(2 * cluster_size_, cluster_size_);
  }

  // qcow2_alloc_clusters(): allocates `bytes` (rounded up to clusters) and
  // returns the offset.
  absl::StatusOr<uint64_t> AllocateClusters(uint64_t bytes) {
    const uint64_t count = DivRoundUp(bytes, cluster_size_);
    while (true) {
      const uint64_t first = FindFree(count);
      const Step step = Update(first, count, /*decrease=*/false);
      if (!error_.ok()) return error_;
      if (step == Step::kDone) return first * cluster_size_;
    }
  }

  // A plain write of zeros (the L1 table).
  void WriteZeros(uint64_t offset, uint64_t size) {
    end_ = std::max(end_, offset + size);
    for (uint64_t pos = offset; pos < offset + size;) {
      const uint64_t cluster = pos / cluster_size_;
      const uint64_t in = pos % cluster_size_;
      const uint64_t n = std::min(cluster_size_ - in, offset + size - pos);
      auto it = disk_.find(cluster);
      if (it != disk_.end()) {
        if (n == cluster_size_) {
          disk_.erase(it);
        } else {
          std::fill_n(it->second.begin() + in, n, 0);
        }
      }
      pos += n;
    }
  }

  // Fills in the refcount part of `layout` and its metadata bytes; call once
  // after the last allocation (QEMU flushes its refcount block cache last).
  void Finish(NewImageLayout& layout) {
    for (const auto& [offset, block] : blocks_) Write(offset, block);
    layout.refcount_table_offset = table_offset_;
    layout.refcount_table_clusters =
        static_cast<uint32_t>(table_.size() * 8 / cluster_size_);
    layout.refcount_block_offsets.assign(table_.begin(),
                                         table_.begin() + max_table_index_ + 1);
    layout.allocated_clusters = 0;
    for (const auto& [offset, block] : blocks_) {
      for (uint64_t i = 0; i < per_block_; ++i) {
        if (GetRefcount(block, i, refcount_order_) != 0) ++layout.allocated_clusters;
      }
    }
    layout.file_size = end_;
    layout.metadata.clear();
    for (const auto& [cluster, bytes] : disk_) {
      if (cluster == 0) continue;  // the header, see NewImageContents()
      size_t len = bytes.size();
      while (len > 0 && bytes[len - 1] == 0) --len;
      if (len == 0) continue;
      const uint64_t offset = cluster * cluster_size_;
      if (!layout.metadata.empty()) {
        FileExtent& last = layout.metadata.back();
        if (last.offset + last.bytes.size() == offset) {
          last.bytes.insert(last.bytes.end(), bytes.begin(), bytes.begin() + len);
          continue;
        }
      }
      layout.metadata.push_back(
          FileExtent{offset, std::vector<uint8_t>(bytes.begin(), bytes.begin() + len)});
    }
  }

 private:
  enum class Step { kDone, kRetry };

  uint64_t Refcount(uint64_t cluster) {
    const uint64_t index = cluster / per_block_;
    if (index >= table_.size() || table_[index] == 0) return 0;
    return GetRefcount(Block(table_[index]), cluster % per_block_,
                       refcount_order_);
  }

  std::vector<uint8_t>& Block(uint64_t offset) {
    if (offset != cached_block_offset_) {
      cached_block_ = &blocks_[offset];
      cached_block_offset_ = offset;
    }
    return *cached_block_;
  }

  // alloc_clusters_noref(): the first run of `count` free clusters at or
  // after the hint.
  uint64_t FindFree(uint64_t count) {
    uint64_t found = 0;
    while (found < count) {
      const uint64_t cluster = free_hint_++;
      found = Refcount(cluster) == 0 ? found + 1 : 0;
    }
    return free_hint_ - count;
  }

  // update_refcount() by +1 (or -1 with `decrease`) for clusters
  // [first, first + count).
  Step Update(uint64_t first, uint64_t count, bool decrease) {
    uint64_t cluster = first;
    uint64_t loaded_index = ~uint64_t{0};
    std::vector<uint8_t>* block = nullptr;
    for (; cluster < first + count; ++cluster) {
      const uint64_t index = cluster / per_block_;
      if (index != loaded_index) {
        if (EnsureBlock(cluster, &block) == Step::kRetry || !error_.ok()) {
          if (free_hint_ > first) free_hint_ = first;
          // Undo what was done so far; the caller starts over.
          if (cluster > first) Update(first, cluster - first, !decrease);
          return Step::kRetry;
        }
        loaded_index = index;
      }
      const uint64_t i = cluster % per_block_;
      const uint64_t old = GetRefcount(*block, i, refcount_order_);
      if (decrease ? old == 0 : old == MaxRefcount(refcount_order_)) {
        error_ = absl::InternalError(absl::StrFormat(
            "refcount of cluster %u out of range while replaying creation",
            cluster));
        return Step::kRetry;
      }
      const uint64_t now = decrease ? old - 1 : old + 1;
      if (now == 0 && cluster < free_hint_) free_hint_ = cluster;
      SetRefcount(absl::MakeSpan(*block), i, refcount_order_, now);
    }
    return Step::kDone;
  }

  // alloc_refcount_block(): makes sure the block covering `cluster` exists.
  // kDone with *block set if it did; kRetry after creating it.
  Step EnsureBlock(uint64_t cluster, std::vector<uint8_t>** block) {
    const uint64_t index = cluster / per_block_;
    if (index < table_.size() && table_[index] != 0) {
      *block = &Block(table_[index]);
      return Step::kDone;
    }
    const uint64_t new_block = FindFree(1) * cluster_size_;
    if (new_block / cluster_size_ / per_block_ == index) {
      // The block covers itself.
      std::vector<uint8_t>& b = blocks_[new_block];
      b.assign(cluster_size_, 0);
      SetRefcount(absl::MakeSpan(b), new_block / cluster_size_ % per_block_,
                  refcount_order_, 1);
    } else {
      if (Update(new_block / cluster_size_, 1, false) == Step::kRetry) {
        return Step::kRetry;
      }
      blocks_[new_block].assign(cluster_size_, 0);
    }
    cached_block_offset_ = ~uint64_t{0};
    if (index < table_.size()) {
      table_[index] = new_block;
      max_table_index_ = std::max(max_table_index_, index);
      uint8_t entry[8];
      internal::StoreBE64(entry, new_block);
      Write(table_offset_ + index * 8, entry);
      return Step::kRetry;
    }
    const uint64_t blocks_used = DivRoundUp(
        std::max(cluster + 1, new_block / cluster_size_ + 1), per_block_);
    GrowTable(blocks_used * per_block_ * cluster_size_, index, new_block);
    return Step::kRetry;
  }

  // qcow2_refcount_metadata_size(): refcount blocks needed so that
  // `clusters` plus the blocks and the table themselves are all covered;
  // `generous` leaves room for the table to grow by half.
  uint64_t RefcountBlocksNeeded(uint64_t clusters, bool generous) const {
    const uint64_t blocks_per_table_cluster = cluster_size_ / 8;
    uint64_t table = 0, blocks = 0, total = 0, last = 0;
    do {
      last = total;
      blocks = DivRoundUp(clusters + table + blocks, per_block_);
      table = DivRoundUp(blocks, blocks_per_table_cluster);
      total = clusters + blocks + table;
      if (total == last && generous) {
        clusters += DivRoundUp(table, 2);
        total = 0;
        generous = false;
      }
    } while (total != last);
    return blocks;
  }

  // qcow2_refcount_area() for a table that must grow: new blocks and then a
  // new table (1.5x the blocks needed) from `start` (block aligned) on.
  void GrowTable(uint64_t start, uint64_t new_index, uint64_t new_block) {
    const uint64_t total_blocks = RefcountBlocksNeeded(start / cluster_size_, true);
    const uint64_t area_index = start / cluster_size_ / per_block_;
    const uint64_t entries_per_cluster = cluster_size_ / 8;
    uint64_t table_size = total_blocks + DivRoundUp(total_blocks, 2);
    table_size = DivRoundUp(table_size, entries_per_cluster) * entries_per_cluster;
    if (table_size * 8 > kMaxRefcountTableBytes || new_index >= table_size) {
      error_ = absl::InternalError("refcount table too large while replaying creation");
      return;
    }
    std::vector<uint64_t> table(table_size, 0);
    std::copy_n(table_.begin(), std::min(table_size, max_table_index_ + 1),
                table.begin());
    table[new_index] = new_block;
    uint64_t missing = 0;
    for (uint64_t i = area_index; i < total_blocks; ++i) missing += table[i] == 0;
    const uint64_t table_offset = start + missing * cluster_size_;
    const uint64_t end = table_offset + table_size * 8;
    uint64_t next_block = start;
    for (uint64_t i = area_index; i < total_blocks; ++i) {
      if (table[i] == 0) {
        table[i] = next_block;
        blocks_[next_block].assign(cluster_size_, 0);
        next_block += cluster_size_;
      }
      std::vector<uint8_t>& block = blocks_[table[i]];
      const uint64_t first_covered = i * per_block_ * cluster_size_;
      if (first_covered >= end) continue;
      const uint64_t from =
          first_covered < start ? (start - first_covered) / cluster_size_ : 0;
      const uint64_t to =
          std::min((end - first_covered) / cluster_size_, per_block_);
      for (uint64_t j = from; j < to; ++j) {
        SetRefcount(absl::MakeSpan(block), j, refcount_order_, 1);
      }
    }
    cached_block_offset_ = ~uint64_t{0};
    WriteTable(table_offset, table);
    const uint64_t old_offset = table_offset_;
    const uint64_t old_clusters = table_.size() * 8 / cluster_size_;
    table_ = std::move(table);
    table_offset_ = table_offset;
    max_table_index_ = 0;
    for (uint64_t i = table_.size(); i-- > 0;) {
      if (table_[i] != 0) {
        max_table_index_ = i;
        break;
      }
    }
    Update(old_offset / cluster_size_, old_clusters, /*decrease=*/true);
  }

  void WriteTable(uint64_t offset, const std::vector<uint64_t>& table) {
    std::vector<uint8_t> bytes(table.size() * 8);
    for (size_t i = 0; i < table.size(); ++i) {
      internal::StoreBE64(bytes.data() + i * 8, table[i]);
    }
    Write(offset, bytes);
  }

  void Write(uint64_t offset, absl::Span<const uint8_t> bytes) {
    end_ = std::max(end_, offset + bytes.size());
    for (uint64_t pos = 0; pos < bytes.size();) {
      const uint64_t cluster = (offset + pos) / cluster_size_;
      const uint64_t in = (offset + pos) % cluster_size_;
      const uint64_t n = std::min<uint64_t>(cluster_size_ - in, bytes.size() - pos);
      std::vector<uint8_t>& c = disk_[cluster];
      if (c.empty()) c.assign(cluster_size_, 0);
      std::copy_n(bytes.begin() + pos, n, c.begin() + in);
      pos += n;
    }
  }

  const uint32_t refcount_order_;
  const uint64_t cluster_size_;
  const uint64_t per_block_;
  std::vector<uint64_t> table_;
  uint64_t table_offset_ = 0;
  uint64_t max_table_index_ = 0;
  std::map<uint64_t, std::vector<uint8_t>> blocks_;  // by file offset
  std::vector<uint8_t>* cached_block_ = nullptr;
  uint64_t cached_block_offset_ = ~uint64_t{0};
  uint64_t free_hint_ = 0;  // cluster index where the next scan starts
  // What the file holds, by cluster index, for clusters written with data.
  std::map<uint64_t, std::vector<uint8_t>> disk_;
  uint64_t end_ = 0;
  absl::Status error_;
};

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
  CreationAllocator allocator(l.cluster_bits, l.refcount_order);
  absl::StatusOr<uint64_t> header_clusters = allocator.AllocateClusters(3 * cs);
  if (!header_clusters.ok()) return header_clusters.status();
  if (l.l1_size > 0) {
    // The resize to the virtual size: a new L1 table of exactly l1_size
    // entries, written as zeros.
    const uint64_t l1_bytes = uint64_t{l.l1_size} * 8;
    absl::StatusOr<uint64_t> l1 = allocator.AllocateClusters(l1_bytes);
    if (!l1.ok()) return l1.status();
    l.l1_table_offset = *l1;
    allocator.WriteZeros(l.l1_table_offset, l1_bytes);
  }
  allocator.Finish(l);
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
  std::vector<FileExtent> out;
  out.push_back(FileExtent{0, EncodeHeader(NewImageHeader(o, l))});
  out.insert(out.end(), l.metadata.begin(), l.metadata.end());
  return out;
}

}  // namespace imgtool::qcow2::format

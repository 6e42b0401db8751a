#include "qcow2/refcounts.h"

#include <algorithm>
#include <cerrno>
#include <utility>
#include <vector>

#include "absl/strings/str_format.h"
#include "base/errno_status.h"
#include "base/status_macros.h"
#include "io/aligned_buffer.h"
#include "qcow2/bytes.h"
#include "qcow2/format/header.h"
#include "qcow2/format/refcount.h"

namespace imgtool::qcow2 {
namespace {

constexpr char kRetryMessage[] = "qcow2: refcount metadata allocated, retry";

uint64_t DivRoundUp(uint64_t a, uint64_t b) { return a / b + (a % b != 0); }

// qcow2_refcount_metadata_size(): refcount blocks needed so that `clusters`
// plus the refcount blocks and table themselves are covered; `generous`
// leaves room for the table to grow by half.
uint64_t RefcountBlocksNeeded(uint64_t clusters, uint64_t cluster_size,
                              uint64_t per_block, bool generous) {
  const uint64_t blocks_per_table_cluster = cluster_size / 8;
  uint64_t table = 0, blocks = 0, total = 0, last = 0;
  do {
    last = total;
    blocks = DivRoundUp(clusters + table + blocks, per_block);
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

}  // namespace

// Carries EAGAIN: where it escapes (an update that is no allocation, as the
// snapshot refcount increase of qcow2_update_snapshot_refcount), callers
// print QEMU's "-11 (Resource temporarily unavailable)".
absl::Status Refcounts::Retry() {
  return WithMessage(ErrnoStatus("", kRetryMessage, EAGAIN), kRetryMessage);
}

bool Refcounts::IsRetry(const absl::Status& st) {
  return StatusErrno(st) == EAGAIN && st.message() == kRetryMessage;
}

Refcounts::Refcounts(MetadataIo& io, uint32_t cluster_bits,
                     uint32_t refcount_order, uint64_t table_offset,
                     uint32_t table_clusters, std::vector<uint64_t> table,
                     size_t cache_tables)
    : io_(io),
      cluster_bits_(cluster_bits),
      refcount_order_(refcount_order),
      block_bits_(cluster_bits + 3 - refcount_order),
      table_offset_(table_offset),
      cache_(
          uint64_t{1} << cluster_bits, cache_tables,
          [this](uint64_t offset, io::IoVec buf) {
            return io_.ReadMetadata(offset, buf);
          },
          [this](uint64_t offset, io::ConstIoVec data) {
            return WriteMetadataAfter(io_,
                                      io::BlkdebugEvent::kRefblockUpdatePart,
                                      offset, data, kOverlapRefcountBlock);
          }) {
  table.resize((uint64_t{table_clusters} << cluster_bits) / 8, 0);
  for (uint64_t& e : table) e &= format::kRefcountTableOffsetMask;
  SetTable(std::move(table), table_offset);
}

io::Task<absl::StatusOr<std::vector<uint64_t>>> Refcounts::ShrinkTable() {
  const uint64_t per_block = uint64_t{1} << block_bits_;
  std::vector<uint64_t> kept = table_;
  for (uint64_t i = 0; i < table_.size(); ++i) {
    if (table_[i] == 0) continue;
    CO_ASSIGN_OR_RETURN(TableCache::Ref block, co_await LoadBlock(i));
    // A block that describes itself counts its own cluster: that one
    // refcount does not keep it.
    const uint64_t own = table_[i] >> cluster_bits_;
    const bool self = (own >> block_bits_) == i;
    bool unused = true;
    for (uint64_t j = 0; j < per_block && unused; ++j) {
      if (self && j == (own & (per_block - 1))) continue;
      unused = format::GetRefcount(block.data(), j, refcount_order_) == 0;
    }
    if (unused) kept[i] = 0;
  }
  CO_RETURN_IF_ERROR(co_await WriteTable(kept, table_offset_));
  std::vector<uint64_t> dropped;
  for (uint64_t i = 0; i < table_.size(); ++i) {
    if (table_[i] != 0 && kept[i] == 0) dropped.push_back(table_[i]);
  }
  // The dropped blocks' own clusters: the block covering each one is kept
  // (it counts that cluster) unless it is the dropped block itself.
  absl::Status result;
  for (const uint64_t offset : dropped) {
    const uint64_t index = offset >> cluster_bits_;
    const uint64_t covering = index >> block_bits_;
    const uint64_t in_block = index & (per_block - 1);
    absl::StatusOr<TableCache::Ref> block = co_await LoadBlock(covering);
    if (!block.ok()) {
      result = block.status();
      break;
    }
    if (!*block) {
      result = co_await io_.SignalCorruption(absl::StrFormat(
          "Refblock at %#x is not covered by the refcount table", offset));
      break;
    }
    const uint64_t refcount =
        format::GetRefcount(block->data(), in_block, refcount_order_);
    if (refcount != 1) {
      result = co_await io_.SignalCorruption(absl::StrFormat(
          "Invalid refcount: refblock offset %#x, reftable index %u, block "
          "offset %#x, refcount %#x",
          block->offset(), covering, offset, refcount));
      break;
    }
    if (block->offset() != offset) {
      format::SetRefcount(block->data(), in_block, refcount_order_, 0);
      cache_.MarkDirty(*block);
    }
    block->reset();
    if (index < free_cluster_index_) free_cluster_index_ = index;
  }
  for (const uint64_t offset : dropped) cache_.Discard(offset);
  SetTable(std::move(kept), table_offset_);
  if (!result.ok()) co_return result;
  co_return dropped;
}

io::Task<absl::Status> Refcounts::WriteTable(const std::vector<uint64_t>& table,
                                             uint64_t offset) {
  io::AlignedBuffer bytes(table.size() * 8);
  for (uint64_t i = 0; i < table.size(); ++i) {
    StoreBE64(bytes.data() + i * 8, table[i]);
  }
  CO_RETURN_IF_ERROR(
      co_await io_.WriteMetadata(offset, bytes.span(), kOverlapRefcountTable));
  co_return co_await io_.SyncFile();
}

void Refcounts::SetTable(std::vector<uint64_t> table, uint64_t offset) {
  table_ = std::move(table);
  table_offset_ = offset;
  blocks_.clear();
  max_table_index_ = 0;
  for (uint64_t i = 0; i < table_.size(); ++i) {
    if (table_[i] != 0) {
      blocks_.insert(table_[i]);
      max_table_index_ = i;
    }
  }
}

bool Refcounts::PeekRefcount(uint64_t cluster_index, uint64_t* refcount) {
  const uint64_t table_index = cluster_index >> block_bits_;
  if (table_index >= table_.size() || table_[table_index] == 0) {
    *refcount = 0;
    return true;
  }
  TableCache::Table* t = cache_.Peek(table_[table_index]);
  if (t == nullptr) return false;
  *refcount = format::GetRefcount(
      t->data.span(), cluster_index & ((uint64_t{1} << block_bits_) - 1),
      refcount_order_);
  return true;
}

bool Refcounts::TryAdjustCached(uint64_t cluster_index, bool decrease,
                                uint64_t* refcount) {
  if (io_.FileHandlesDebugEvents()) return false;
  const uint64_t table_index = cluster_index >> block_bits_;
  if (table_index >= table_.size() || table_[table_index] == 0) return false;
  TableCache::Table* t = cache_.PeekUse(table_[table_index]);
  if (t == nullptr) return false;
  const uint64_t index = cluster_index & ((uint64_t{1} << block_bits_) - 1);
  const uint64_t rc = format::GetRefcount(t->data.span(), index, refcount_order_);
  if (decrease ? rc < 2 : (rc == 0 || rc >= format::MaxRefcount(refcount_order_))) {
    return false;
  }
  *refcount = decrease ? rc - 1 : rc + 1;
  format::SetRefcount(t->data.span(), index, refcount_order_, *refcount);
  cache_.MarkDirty(t);
  return true;
}

io::Task<absl::StatusOr<TableCache::Ref>> Refcounts::LoadBlock(
    uint64_t table_index) {
  if (table_index >= table_.size() || table_[table_index] == 0) {
    co_return TableCache::Ref();
  }
  const uint64_t block = table_[table_index];
  if ((block & (cluster_size() - 1)) != 0) {
    co_return co_await io_.SignalCorruption(absl::StrFormat(
        "Refblock offset %#x unaligned (reftable index: %#x)", block,
        table_index));
  }
  if (block >= io_.FileSize()) {
    co_return co_await io_.SignalCorruption(absl::StrFormat(
        "Refblock offset %#x beyond the end of the image file (reftable "
        "index: %#x)",
        block, table_index));
  }
  co_return co_await cache_.Get(block);
}

io::Task<absl::StatusOr<uint64_t>> Refcounts::Get(uint64_t cluster_index) {
  uint64_t refcount;
  if (PeekRefcount(cluster_index, &refcount)) co_return refcount;
  CO_ASSIGN_OR_RETURN(TableCache::Ref block,
                      co_await LoadBlock(cluster_index >> block_bits_));
  if (!block) co_return uint64_t{0};
  co_return format::GetRefcount(
      block.data(), cluster_index & ((uint64_t{1} << block_bits_) - 1),
      refcount_order_);
}

io::Task<absl::StatusOr<uint64_t>> Refcounts::FindFree(uint64_t count) {
  uint64_t found = 0;
  while (found < count) {
    const uint64_t cluster = free_cluster_index_++;
    uint64_t refcount;
    if (!PeekRefcount(cluster, &refcount)) {
      CO_ASSIGN_OR_RETURN(refcount, co_await Get(cluster));
    }
    found = refcount == 0 ? found + 1 : 0;
  }
  // Host offsets must fit in the 56-bit offset fields.
  if ((free_cluster_index_ << cluster_bits_) > (uint64_t{1} << 56)) {
    co_return absl::ResourceExhaustedError(
        "qcow2: image file would grow beyond the largest host offset");
  }
  co_return (free_cluster_index_ - count) << cluster_bits_;
}

io::Task<absl::StatusOr<uint64_t>> Refcounts::Allocate(uint64_t bytes) {
  co_await io_.FileDebugEvent(io::BlkdebugEvent::kClusterAlloc);
  CO_RETURN_IF_ERROR(co_await io_.BeforeAllocate());
  while (true) {
    CO_ASSIGN_OR_RETURN(uint64_t offset,
                        co_await FindFree(DivRoundUp(bytes, cluster_size())));
    absl::Status st = co_await Update(offset, bytes, 1, false);
    if (st.ok()) co_return offset;
    if (!IsRetry(st)) co_return st;
  }
}

io::Task<absl::StatusOr<uint64_t>> Refcounts::AllocateBytes(uint64_t size) {
  co_await io_.FileDebugEvent(io::BlkdebugEvent::kClusterAllocBytes);
  CO_RETURN_IF_ERROR(co_await io_.BeforeAllocate());
  const uint64_t cs = cluster_size();
  uint64_t offset = free_byte_offset_;
  if (offset != 0) {
    CO_ASSIGN_OR_RETURN(uint64_t refcount, co_await Get(offset >> cluster_bits_));
    if (refcount == format::MaxRefcount(refcount_order_)) offset = 0;
  }
  uint64_t free_in_cluster = cs - (offset & (cs - 1));
  while (true) {
    if (offset == 0 || free_in_cluster < size) {
      CO_ASSIGN_OR_RETURN(const uint64_t cluster, co_await FindFree(1));
      if (cluster == 0) {
        co_return co_await io_.SignalCorruption(
            "Preventing invalid allocation of compressed cluster at offset 0");
      }
      if (offset == 0 || ((offset + cs - 1) & ~(cs - 1)) != cluster) {
        offset = cluster;
        free_in_cluster = cs;
      } else {
        free_in_cluster += cs;
      }
    }
    absl::Status st = co_await UpdateRefcounts(offset, size, 1, false,
                                               /*packing=*/true);
    if (st.ok()) break;
    offset = 0;
    if (!IsRetry(st)) co_return st;
  }
  free_byte_offset_ = (offset + size) & (cs - 1) ? offset + size : 0;
  co_return offset;
}

io::Task<absl::StatusOr<uint64_t>> Refcounts::AllocateAt(uint64_t offset,
                                                        uint64_t nb_clusters) {
  if (nb_clusters == 0) co_return uint64_t{0};
  CO_RETURN_IF_ERROR(co_await io_.BeforeAllocate());
  while (true) {
    const uint64_t first = offset >> cluster_bits_;
    uint64_t i = 0;
    for (; i < nb_clusters; ++i) {
      CO_ASSIGN_OR_RETURN(uint64_t refcount, co_await Get(first + i));
      if (refcount != 0) break;
    }
    absl::Status st = co_await Update(offset, i << cluster_bits_, 1, false);
    if (st.ok()) co_return i;
    if (!IsRetry(st)) co_return st;
  }
}

io::Task<absl::Status> Refcounts::FlushBlocks() {
  CO_RETURN_IF_ERROR(co_await cache_.WriteDirty());
  co_return co_await io_.SyncFile();
}

io::Task<absl::StatusOr<TableCache::Ref>> Refcounts::EnsureBlock(
    uint64_t cluster_index) {
  // QEMU's alloc_refcount_block raises refblock_alloc on every call, and
  // load_refcount_block refblock_load on every load (cached or not).
  co_await io_.FileDebugEvent(io::BlkdebugEvent::kRefblockAlloc);
  const uint64_t table_index = cluster_index >> block_bits_;
  if (table_index < table_.size() && table_[table_index] != 0) {
    co_await io_.FileDebugEvent(io::BlkdebugEvent::kRefblockLoad);
    co_return co_await LoadBlock(table_index);
  }
  // Allocate the block itself: it must describe itself or be described by
  // a block that exists, and the caller's search starts over afterwards.
  CO_ASSIGN_OR_RETURN(const uint64_t new_block, co_await FindFree(1));
  if (new_block == 0) {
    co_return co_await io_.SignalCorruption(
        "Preventing invalid allocation of refcount block at offset 0");
  }
  const uint64_t new_index = new_block >> cluster_bits_;
  TableCache::Ref block;
  if ((new_index >> block_bits_) == table_index) {
    CO_ASSIGN_OR_RETURN(block, co_await cache_.GetEmpty(new_block));
    format::SetRefcount(block.data(),
                        new_index & ((uint64_t{1} << block_bits_) - 1),
                        refcount_order_, 1);
  } else {
    CO_RETURN_IF_ERROR(co_await Update(new_block, cluster_size(), 1, false));
    CO_RETURN_IF_ERROR(co_await FlushBlocks());
    CO_ASSIGN_OR_RETURN(block, co_await cache_.GetEmpty(new_block));
  }
  // The new block goes to disk before anything points to it.
  co_await io_.FileDebugEvent(io::BlkdebugEvent::kRefblockAllocWrite);
  CO_RETURN_IF_ERROR(co_await FlushBlocks());

  if (table_index < table_.size()) {
    uint8_t entry[8];
    StoreBE64(entry, new_block);
    co_await io_.FileDebugEvent(io::BlkdebugEvent::kRefblockAllocHookup);
    CO_RETURN_IF_ERROR(co_await io_.WriteMetadata(
        table_offset_ + table_index * 8, entry, kOverlapRefcountTable));
    CO_RETURN_IF_ERROR(co_await io_.SyncFile());
    table_[table_index] = new_block;
    blocks_.insert(new_block);
    max_table_index_ = std::max(max_table_index_, table_index);
    co_return Retry();
  }
  block.reset();
  co_await io_.FileDebugEvent(io::BlkdebugEvent::kReftableGrow);

  // The table is full: lay out a bigger one (and blocks covering it) past
  // everything the blocks so far cover.
  const uint64_t per_block = uint64_t{1} << block_bits_;
  const uint64_t blocks_used = DivRoundUp(
      std::max(cluster_index + 1, new_index + 1), per_block);
  const uint64_t meta_offset = (blocks_used * per_block) << cluster_bits_;
  CO_ASSIGN_OR_RETURN(uint64_t end, co_await RefcountArea(meta_offset, 0, false,
                                                          table_index, new_block));
  (void)end;
  // QEMU loads the new block here (refblock_load) before its -EAGAIN; the
  // block is cached, so only the event remains.
  co_await io_.FileDebugEvent(io::BlkdebugEvent::kRefblockLoad);
  co_return Retry();
}

io::Task<absl::Status> Refcounts::UpdateRefcounts(uint64_t offset,
                                                  uint64_t length,
                                                  uint64_t addend,
                                                  bool decrease, bool packing) {
  if (length == 0) co_return absl::OkStatus();
  const uint64_t mask = cluster_size() - 1;
  const uint64_t start = offset & ~mask;
  const uint64_t last = (offset + length - 1) & ~mask;
  const uint64_t max = format::MaxRefcount(refcount_order_);
  TableCache::Ref block;
  uint64_t loaded_index = ~uint64_t{0};
  absl::Status result;
  uint64_t cluster_offset = start;
  for (; cluster_offset <= last; cluster_offset += cluster_size()) {
    const uint64_t cluster_index = cluster_offset >> cluster_bits_;
    const uint64_t table_index = cluster_index >> block_bits_;
    if (table_index != loaded_index || !block) {
      block.reset();
      absl::StatusOr<TableCache::Ref> b = co_await EnsureBlock(cluster_index);
      if (!b.ok()) {
        if (IsRetry(b.status()) &&
            free_cluster_index_ > (start >> cluster_bits_)) {
          free_cluster_index_ = start >> cluster_bits_;
        }
        result = b.status();
        break;
      }
      block = *std::move(b);
      loaded_index = table_index;
    }
    const uint64_t index = cluster_index & ((uint64_t{1} << block_bits_) - 1);
    uint64_t refcount = format::GetRefcount(block.data(), index, refcount_order_);
    if (decrease ? refcount < addend : (max - refcount < addend)) {
      result = co_await io_.SignalCorruption(absl::StrFormat(
          "Refcount of cluster %#x would %s (refcount %u)", cluster_offset,
          decrease ? "drop below zero" : "exceed its maximum", refcount));
      break;
    }
    if (!decrease && refcount == 0 && !packing && free_byte_offset_ != 0 &&
        (free_byte_offset_ & ~mask) == cluster_offset) {
      // The cluster compressed data was packed into was freed and is now
      // handed out again: packing must not go on in it.
      free_byte_offset_ = 0;
    }
    refcount = decrease ? refcount - addend : refcount + addend;
    if (refcount == 0 && cluster_index < free_cluster_index_) {
      free_cluster_index_ = cluster_index;
    }
    format::SetRefcount(block.data(), index, refcount_order_, refcount);
    cache_.MarkDirty(block);
    if (refcount == 0) {
      if (block.offset() == cluster_offset) {
        block.reset();
        loaded_index = ~uint64_t{0};
      }
      cache_.Discard(cluster_offset);
      io_.ClusterFreed(cluster_offset);
    }
  }
  block.reset();
  if (!result.ok() && cluster_offset > start) {
    // Undo what was done; may fail, the error above is what counts.
    absl::Status undo =
        co_await Update(start, cluster_offset - start, addend, !decrease);
    (void)undo;
  }
  co_return result;
}

io::Task<absl::StatusOr<uint64_t>> Refcounts::RefcountArea(
    uint64_t start_offset, uint64_t additional_clusters, bool exact_size,
    uint64_t new_refblock_index, uint64_t new_refblock_offset) {
  const uint64_t cs = cluster_size();
  const uint64_t per_block = uint64_t{1} << block_bits_;
  const uint64_t total_blocks = RefcountBlocksNeeded(
      (start_offset >> cluster_bits_) + additional_clusters, cs, per_block,
      !exact_size);
  const uint64_t area_index = (start_offset >> cluster_bits_) / per_block;
  uint64_t table_size =
      exact_size ? total_blocks : total_blocks + DivRoundUp(total_blocks, 2);
  const uint64_t entries_per_cluster = cs / 8;
  table_size = DivRoundUp(table_size, entries_per_cluster) * entries_per_cluster;
  if (table_size * 8 > format::kMaxRefcountTableBytes) {
    co_return absl::ResourceExhaustedError(
        "qcow2: refcount table would exceed its maximum size");
  }
  const uint64_t table_clusters = table_size * 8 / cs;
  std::vector<uint64_t> new_table(table_size, 0);
  std::copy_n(table_.begin(),
              std::min<uint64_t>(table_size, std::min<uint64_t>(
                                                 table_.size(), max_table_index_ + 1)),
              new_table.begin());
  if (new_refblock_offset != 0) new_table[new_refblock_index] = new_refblock_offset;

  uint64_t additional_blocks = 0;
  for (uint64_t i = area_index; i < total_blocks; ++i) {
    if (new_table[i] == 0) ++additional_blocks;
  }
  const uint64_t new_table_offset = start_offset + additional_blocks * cs;
  const uint64_t end_offset = new_table_offset + table_clusters * cs;

  uint64_t block_offset = start_offset;
  for (uint64_t i = area_index; i < total_blocks; ++i) {
    TableCache::Ref block;
    if (new_table[i] != 0) {
      CO_ASSIGN_OR_RETURN(block, co_await cache_.Get(new_table[i]));
    } else {
      CO_ASSIGN_OR_RETURN(block, co_await cache_.GetEmpty(block_offset));
      new_table[i] = block_offset;
      block_offset += cs;
    }
    const uint64_t first_covered = (i * per_block) << cluster_bits_;
    if (first_covered < end_offset) {
      uint64_t j = first_covered < start_offset
                       ? (start_offset - first_covered) >> cluster_bits_
                       : 0;
      const uint64_t end_index =
          std::min((end_offset - first_covered) >> cluster_bits_, per_block);
      for (; j < end_index; ++j) {
        if (format::GetRefcount(block.data(), j, refcount_order_) != 0) {
          co_return co_await io_.SignalCorruption(absl::StrFormat(
              "Refcount structures would be placed on cluster %#x, which is "
              "in use",
              first_covered + (j << cluster_bits_)));
        }
        format::SetRefcount(block.data(), j, refcount_order_, 1);
      }
      cache_.MarkDirty(block);
    }
  }
  co_await io_.FileDebugEvent(io::BlkdebugEvent::kRefblockAllocWriteBlocks);
  CO_RETURN_IF_ERROR(co_await FlushBlocks());

  co_await io_.FileDebugEvent(io::BlkdebugEvent::kRefblockAllocWriteTable);
  CO_RETURN_IF_ERROR(co_await WriteTable(new_table, new_table_offset));
  co_await io_.FileDebugEvent(io::BlkdebugEvent::kRefblockAllocSwitchTable);
  CO_RETURN_IF_ERROR(co_await io_.SetRefcountTable(
      new_table_offset, static_cast<uint32_t>(table_clusters)));

  const uint64_t old_offset = table_offset_;
  const uint64_t old_bytes = table_.size() * 8;
  SetTable(std::move(new_table), new_table_offset);
  CO_RETURN_IF_ERROR(co_await Free(old_offset, old_bytes));
  co_return end_offset;
}

io::Task<absl::StatusOr<int64_t>> Refcounts::LastUsedCluster(
    uint64_t file_size) {
  for (int64_t i = static_cast<int64_t>(DivRoundUp(file_size, cluster_size())) - 1;
       i >= 0; --i) {
    CO_ASSIGN_OR_RETURN(uint64_t refcount, co_await Get(static_cast<uint64_t>(i)));
    if (refcount > 0) co_return i;
  }
  co_return int64_t{-1};
}

io::Task<absl::StatusOr<uint64_t>> Refcounts::UsedEnd() {
  const uint64_t entries = uint64_t{1} << block_bits_;
  for (uint64_t t = table_.size(); t-- > 0;) {
    const uint64_t block_offset = table_[t];
    if (block_offset == 0) continue;
    // Checked here, not by LoadBlock: a broken entry is no reason to mark
    // the image corrupt when only the caller's question needs it.
    if ((block_offset & (cluster_size() - 1)) != 0 ||
        block_offset >= io_.FileSize()) {
      co_return absl::DataLossError(absl::StrFormat(
          "refcount block offset %#x is invalid (reftable index: %#x)",
          block_offset, t));
    }
    CO_ASSIGN_OR_RETURN(TableCache::Ref block, co_await LoadBlock(t));
    for (uint64_t i = entries; i-- > 0;) {
      if (format::GetRefcount(block.data(), i, refcount_order_) != 0) {
        co_return ((t << block_bits_) + i + 1) << cluster_bits_;
      }
    }
  }
  co_return uint64_t{0};
}

}  // namespace imgtool::qcow2

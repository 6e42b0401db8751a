// Qcow2Node: resizing (qcow2_co_truncate): L1 growth, metadata and data
// preallocation the way QEMU 7.2 lays them out, and shrinking.
#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "absl/numeric/bits.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "base/errno_status.h"
#include "base/status_macros.h"
#include "io/aligned_buffer.h"
#include "qcow2/bytes.h"
#include "qcow2/qcow2_node.h"

namespace imgtool::qcow2 {
namespace {

using format::ClusterType;
using format::L2Entry;

constexpr uint64_t kL1SizeOffset = 36;
constexpr uint64_t kSizeOffset = 24;
constexpr uint64_t kInvalidOffset = ~uint64_t{0};
constexpr uint64_t kIntMax = 0x7fffffff;

// QEMU's error_prepend(errp, "Failed to resize underlying file: ") on the
// file's truncate error: "<image>: Failed to resize underlying file:
// <cause>", the file's own name taken off the cause; payloads (errno) kept.
absl::Status UnderlyingFileError(const absl::Status& st,
                                 const std::string& image,
                                 const std::string& file) {
  absl::string_view cause = st.message();
  absl::ConsumePrefix(&cause, absl::StrCat(file, ": "));
  return WithMessage(
      st, absl::StrCat(image, ": Failed to resize underlying file: ", cause));
}

}  // namespace

io::Task<absl::Status> Qcow2Node::GrowL1(uint64_t min_size, bool exact) {
  if (min_size <= l1_.size()) co_return absl::OkStatus();
  uint64_t new_size = min_size;
  if (!exact) {
    new_size = std::max<uint64_t>(l1_.size(), 1);
    while (min_size > new_size) new_size = (new_size * 3 + 1) / 2;
  }
  if (new_size * 8 > format::kMaxL1TableBytes) {
    // QEMU's qcow2_grow_l1_table() fails with EFBIG, which its truncate
    // reports as "Failed to grow the L1 table".
    co_return ErrnoStatus("", "Failed to grow the L1 table", EFBIG);
  }
  const uint64_t bytes = new_size * 8;
  // QEMU 7.2's qcow2_grow_l1_table: l1_grow_alloc_table, the allocation,
  // the refcounts written, l1_grow_write_table, the table written,
  // l1_grow_activate_table, the header's L1 fields written; on a failure
  // after the allocation the new table's clusters are freed again.
  co_await file_->DebugEvent(io::BlkdebugEvent::kL1GrowAllocTable);
  CO_ASSIGN_OR_RETURN(const uint64_t table, co_await refcounts_->Allocate(bytes));
  absl::Status st = co_await [&]() -> io::Task<absl::Status> {
    CO_RETURN_IF_ERROR(co_await refcounts_->WriteDirty());
    CO_RETURN_IF_ERROR(co_await SyncFile());
    io::AlignedBuffer data(bytes);
    for (uint64_t i = 0; i < l1_.size(); ++i) {
      StoreBE64(data.data() + i * 8, l1_[i]);
    }
    co_await file_->DebugEvent(io::BlkdebugEvent::kL1GrowWriteTable);
    CO_RETURN_IF_ERROR(co_await WriteMetadata(table, data.span(), 0));
    CO_RETURN_IF_ERROR(co_await SyncFile());
    uint8_t field[12];
    StoreBE32(field, static_cast<uint32_t>(new_size));
    StoreBE64(field + 4, table);
    co_await file_->DebugEvent(io::BlkdebugEvent::kL1GrowActivateTable);
    co_return co_await WriteHeaderField(kL1SizeOffset,
                                        io::ConstIoVec(field, 12));
  }();
  if (!st.ok()) {
    if (broken_.ok()) {
      absl::Status undo = co_await refcounts_->Free(table, bytes);
      (void)undo;  // QEMU only reports it; the error above counts
    }
    co_return st;
  }
  const uint64_t old_table = header_.l1_table_offset;
  const uint64_t old_bytes = l1_.size() * 8;
  header_.l1_table_offset = table;
  header_.l1_size = static_cast<uint32_t>(new_size);
  l1_.resize(new_size, 0);
  // As QEMU, a failure to free the old table only leaks its clusters.
  absl::Status freed = co_await refcounts_->Free(old_table, old_bytes);
  (void)freed;
  co_return absl::OkStatus();
}

std::pair<uint64_t, uint64_t> Qcow2Node::CowBounds(const format::L2Entry& old,
                                                   uint64_t at) const {
  // QEMU's calculate_l2_meta() for a cluster allocated anew.
  if (!l2_format_.extended_l2 || old.compressed()) return {0, cluster_size_};
  const uint32_t sc_bits = subcluster_bits();
  const uint32_t sc = static_cast<uint32_t>(at >> sc_bits);
  if (old.host_offset() == 0) {
    // Zero or unallocated subclusters: only the touched one.
    return {uint64_t{sc} << sc_bits, uint64_t{sc + 1} << sc_bits};
  }
  // The old cluster's allocated subclusters move to the new one.
  const uint32_t alloc =
      static_cast<uint32_t>(old.bitmap & format::kSubclusterAllocMask);
  const uint32_t first = alloc == 0 ? sc : std::min<uint32_t>(sc, absl::countr_zero(alloc));
  const uint32_t end =
      alloc == 0 ? sc + 1 : std::max<uint32_t>(sc + 1, 32 - absl::countl_zero(alloc));
  return {uint64_t{first} << sc_bits, uint64_t{end} << sc_bits};
}

io::Task<absl::Status> Qcow2Node::PreallocateMetadata(uint64_t from,
                                                      uint64_t to) {
  // QEMU's preallocate_co(): allocation calls of at most INT_MAX bytes, each
  // gathering host-contiguous clusters across L2 tables.
  const uint64_t mask = cluster_size_ - 1;
  const uint64_t chunk = kIntMax & ~mask;
  uint64_t offset = from;
  uint64_t bytes = to - from;
  uint64_t last_host = kInvalidOffset;
  uint64_t last_bytes = 0;
  while (bytes > 0) {
    const uint64_t cur = std::min(bytes, chunk);
    uint64_t pos = offset;
    uint64_t remaining = cur;
    uint64_t call_host = kInvalidOffset;
    uint64_t next_host = kInvalidOffset;
    while (remaining > 0) {
      const uint64_t index = l2_index(pos);
      CO_ASSIGN_OR_RETURN(TableCache::Ref l2, co_await GetL2ForWrite(l1_index(pos)));
      const uint64_t in_cluster = pos & mask;
      const uint64_t max_n = std::min((in_cluster + remaining + mask) >> cluster_bits_,
                                      l2_entries_ - index);
      const L2Entry e0 = GetEntry(l2, index);
      CO_ASSIGN_OR_RETURN(ClusterType t0, co_await Classify(e0, l2.offset(), index));
      const bool keep = KindOf(t0, e0) != WriteKind::kAllocate;
      uint64_t n = 1;
      uint64_t host;
      if (keep) {
        host = e0.host_offset();
        if (next_host != kInvalidOffset && host != next_host) break;
        for (; n < max_n; ++n) {
          const L2Entry e = GetEntry(l2, index + n);
          CO_ASSIGN_OR_RETURN(ClusterType t, co_await Classify(e, l2.offset(), index + n));
          if (KindOf(t, e) == WriteKind::kAllocate ||
              e.host_offset() != host + (n << cluster_bits_)) {
            break;
          }
        }
      } else {
        std::vector<L2Entry> olds{e0};
        for (; n < max_n; ++n) {
          const L2Entry e = GetEntry(l2, index + n);
          CO_ASSIGN_OR_RETURN(ClusterType t, co_await Classify(e, l2.offset(), index + n));
          if (KindOf(t, e) != WriteKind::kAllocate) break;
          olds.push_back(e);
        }
        if (next_host == kInvalidOffset) {
          CO_ASSIGN_OR_RETURN(host, co_await refcounts_->Allocate(n << cluster_bits_));
        } else {
          CO_ASSIGN_OR_RETURN(const uint64_t got,
                              co_await refcounts_->AllocateAt(next_host, n));
          if (got == 0) break;
          n = got;
          host = next_host;
        }
        CO_RETURN_IF_ERROR(co_await CheckOverlapOrFail(host, n << cluster_bits_, 0));
        const uint64_t file_end = FileSize();
        if (!l2_format_.extended_l2 && host < file_end) {
          // Host clusters inside the file may hold stale bytes (data after
          // the last cluster in use, freed clusters); the new standard
          // entries would show them, so they are zeroed first (QEMU 7.2
          // shows them). Extended entries keep their bitmap: no data.
          CO_RETURN_IF_ERROR(co_await file_->WriteZeroes(
              host, std::min(file_end, host + (n << cluster_bits_)) - host,
              {}));
        }
        for (uint64_t i = 0; i < n; ++i) {
          L2Entry e;
          e.word = format::MakeStandardL2Word(host + (i << cluster_bits_),
                                              /*copied=*/true, /*zero=*/false);
          // QEMU (QCowL2Meta.prealloc) keeps the subcluster bitmap as it
          // was: zero subclusters stay zero, unallocated ones read on from
          // the backing file. A compressed cluster was copied whole: all
          // data (QEMU 7.2 leaves the bitmap 0, as PreallocateData notes).
          e.bitmap = olds[i].compressed() ? format::kSubclusterAllocMask
                                          : olds[i].bitmap;
          CO_RETURN_IF_ERROR(co_await CheckFreeOrFail(olds[i]));
          SetEntry(l2, index + i, e);
          FreeEntryLater(olds[i], /*discard=*/false);
        }
        // Like QEMU (perform_cow), the parts of the first and last cluster
        // outside the range get their old contents written: with extended
        // L2 entries only up to the touched subcluster's boundaries
        // (CowBounds).
        const uint64_t piece_end =
            pos + std::min(remaining, (n << cluster_bits_) - in_cluster);
        const uint64_t tail_in = piece_end & mask;
        l2.reset();
        const uint64_t head_from =
            in_cluster != 0 ? CowBounds(olds.front(), in_cluster).first : 0;
        if (head_from < in_cluster) {
          std::vector<uint8_t> head(in_cluster - head_from);
          CO_RETURN_IF_ERROR(co_await CowRead(
              olds.front(), (pos & ~mask) + head_from, io::IoVec(head)));
          co_await file_->DebugEvent(io::BlkdebugEvent::kCowWrite);
          CO_RETURN_IF_ERROR(co_await file_->Write(host + head_from, head));
        }
        const uint64_t tail_to =
            tail_in != 0 ? CowBounds(olds[n - 1], tail_in - 1).second : 0;
        if (tail_to > tail_in) {
          std::vector<uint8_t> tail(tail_to - tail_in);
          CO_RETURN_IF_ERROR(co_await CowRead(olds[n - 1], piece_end,
                                              io::IoVec(tail)));
          co_await file_->DebugEvent(io::BlkdebugEvent::kCowWrite);
          CO_RETURN_IF_ERROR(co_await file_->Write(
              host + ((n - 1) << cluster_bits_) + tail_in, tail));
        }
      }
      const uint64_t consumed = std::min(remaining, (n << cluster_bits_) - in_cluster);
      if (call_host == kInvalidOffset) call_host = host + in_cluster;
      next_host = host + (n << cluster_bits_);
      pos += consumed;
      remaining -= consumed;
    }
    const uint64_t done = cur - remaining;
    if (done == 0) {
      co_return absl::InternalError(absl::StrFormat(
          "%s: metadata preallocation made no progress at %u", filename(), offset));
    }
    last_host = call_host;
    last_bytes = done;
    offset += done;
    bytes -= done;
  }
  // The file must cover every allocated cluster.
  if (last_host != kInvalidOffset && last_host + last_bytes > FileSize()) {
    CO_RETURN_IF_ERROR(
        co_await file_->Truncate(last_host + last_bytes, io::PreallocMode::kOff));
  }
  co_return absl::OkStatus();
}

io::Task<absl::Status> Qcow2Node::PreallocateData(uint64_t from, uint64_t to,
                                                  io::PreallocMode mode,
                                                  bool mark_allocated) {
  const uint64_t mask = cluster_size_ - 1;
  // Like QEMU 7.2, a partly used first cluster is allocated anew too, its
  // part before `from` copied from what it showed before.
  uint64_t guest = from & ~mask;
  const uint64_t end = (to + mask) & ~mask;
  if (guest >= end) co_return absl::OkStatus();
  uint64_t old_file_size = FileSize();
  CO_ASSIGN_OR_RETURN(const int64_t last, co_await refcounts_->LastUsedCluster(old_file_size));
  old_file_size = last >= 0 ? (static_cast<uint64_t>(last) + 1) << cluster_bits_
                            : (old_file_size + mask) & ~mask;
  uint64_t data_clusters = (end - guest) >> cluster_bits_;
  // Enough refcount coverage for the data and the L2 tables it needs (one
  // more for an unaligned head or tail).
  const uint64_t l2_tables = (data_clusters + l2_entries_ - 1) / l2_entries_ + 1;
  CO_ASSIGN_OR_RETURN(const uint64_t start,
                      co_await refcounts_->RefcountArea(old_file_size,
                                                        data_clusters + l2_tables,
                                                        /*exact_size=*/true, 0, 0));
  CO_ASSIGN_OR_RETURN(const uint64_t got,
                      co_await refcounts_->AllocateAt(start, data_clusters));
  if (got != data_clusters) {
    co_return absl::InternalError(absl::StrFormat(
        "%s: preallocated area at %#x is not free", filename(), start));
  }
  const uint64_t new_file_size = start + (data_clusters << cluster_bits_);
  const uint64_t old_end = FileSize();
  // As QEMU, the file is always truncated to the new end with the mode: a
  // file longer than that (data after the last cluster in use, or a hole a
  // killed writer left) fails "Cannot use preallocation for shrinking
  // files".
  absl::Status truncated;
  if (new_file_size < old_end) {
    // file-posix's refusal; io::BlockNode::Truncate would word it the way
    // qemu-img resize refuses to shrink an image.
    truncated = absl::InvalidArgumentError(absl::StrCat(
        file_->filename(), ": Cannot use preallocation for shrinking files"));
  } else {
    truncated = co_await file_->Truncate(new_file_size, mode);
  }
  if (!truncated.ok()) {
    absl::Status undo =
        co_await refcounts_->Free(start, data_clusters << cluster_bits_);
    (void)undo;
    co_return UnderlyingFileError(truncated, filename(), file_->filename());
  }
  if (start < old_end && (!l2_format_.extended_l2 || mark_allocated)) {
    // Unused space before the old end of the file may hold stale bytes; the
    // new clusters must read as zeroes (QEMU 7.2 shows the stale bytes).
    // Extended entries that keep their bitmap show no host data.
    CO_RETURN_IF_ERROR(co_await file_->WriteZeroes(
        start, std::min(new_file_size, old_end) - start, {}));
  }
  uint64_t host = start;
  while (data_clusters > 0) {
    const uint64_t index = l2_index(guest);
    const uint64_t n = std::min(data_clusters, l2_entries_ - index);
    CO_ASSIGN_OR_RETURN(TableCache::Ref l2, co_await GetL2ForWrite(l1_index(guest)));
    if ((from & mask) != 0 && guest == (from & ~mask)) {
      // The old part of the first cluster goes to its new host cluster
      // before the L2 entry points there.
      const L2Entry old = GetEntry(l2, index);
      CO_ASSIGN_OR_RETURN(ClusterType type,
                          co_await Classify(old, l2.offset(), index));
      (void)type;
      std::vector<uint8_t> head(from & mask);
      CO_RETURN_IF_ERROR(
          co_await ReadOldContents(old, guest, io::IoVec(head)));
      CO_RETURN_IF_ERROR(co_await file_->Write(host, head));
      ++write_gen_;
    }
    for (uint64_t i = 0; i < n; ++i) {
      const L2Entry old = GetEntry(l2, index + i);
      L2Entry e;
      e.word = format::MakeStandardL2Word(host + (i << cluster_bits_),
                                          /*copied=*/true, /*zero=*/false);
      if (l2_format_.extended_l2) {
        // Zeroed space hides the backing file: every subcluster holds data
        // (QEMU's subclusters_need_allocation); otherwise the subclusters
        // keep their state, so the backing file stays visible. A compressed
        // first cluster becomes all data (its old part was copied above;
        // QEMU 7.2 leaves the bitmap 0 there and loses that part).
        e.bitmap = mark_allocated || old.compressed()
                       ? format::kSubclusterAllocMask
                       : old.bitmap;
      }
      CO_RETURN_IF_ERROR(co_await CheckFreeOrFail(old));
      SetEntry(l2, index + i, e);
      FreeEntryLater(old, /*discard=*/false);
    }
    guest += n << cluster_bits_;
    host += n << cluster_bits_;
    data_clusters -= n;
  }
  co_return absl::OkStatus();
}

io::Task<absl::Status> Qcow2Node::Shrink(uint64_t new_size) {
  const uint64_t mask = cluster_size_ - 1;
  const uint64_t start = (new_size + mask) & ~mask;
  const uint64_t end = (size() + mask) & ~mask;
  // Drop every cluster past the new end (they fall through to nothing).
  // Like QEMU's qcow2_cluster_discard, this allocates the L2 tables of the
  // range that have none (those wholly past the end are freed below).
  for (uint64_t pos = start; pos < end;) {
    const uint64_t li = l1_index(pos);
    const uint64_t table_end = ((li + 1) * l2_entries_) << cluster_bits_;
    const uint64_t stop = std::min(end, table_end);
    if (li < l1_.size()) {
      CO_RETURN_IF_ERROR(co_await DiscardClusters(
          pos >> cluster_bits_, (stop - pos) >> cluster_bits_, /*full_discard=*/true));
    }
    pos = stop;
  }
  // L2 tables wholly past the end (QEMU 7.2's qcow2_shrink_l1_table, run
  // whenever the new size needs fewer L1 entries; the L1 size stays):
  // l1_shrink_write_table, their L1 entries zeroed on disk and flushed,
  // then l1_shrink_free_l2_clusters and the tables freed, last first.
  const uint64_t new_l1 =
      format::L1EntriesForSize(new_size, cluster_bits_, l2_format_.extended_l2);
  if (new_l1 < l1_.size()) {
    std::vector<uint64_t> freed;  // last entry first
    for (uint64_t i = l1_.size(); i-- > new_l1;) {
      const uint64_t l2 = l1_[i] & format::kL1OffsetMask;
      if (l2 != 0) freed.push_back(l2);
    }
    for (uint64_t l2 : freed) {
      // An L1 entry that points at other metadata must not free it.
      CO_RETURN_IF_ERROR(co_await CheckOverlapOrFail(l2, cluster_size_,
                                                     kOverlapActiveL2));
    }
    if (!freed.empty()) CO_RETURN_IF_ERROR(co_await FlushAll());
    const uint64_t zero_at = header_.l1_table_offset + new_l1 * 8;
    const uint64_t zero_bytes = (l1_.size() - new_l1) * 8;
    CO_RETURN_IF_ERROR(
        co_await CheckOverlapOrFail(zero_at, zero_bytes, kOverlapActiveL1));
    co_await file_->DebugEvent(io::BlkdebugEvent::kL1ShrinkWriteTable);
    absl::Status st =
        co_await file_->WriteZeroes(zero_at, zero_bytes, io::WriteZeroesFlags{});
    if (st.ok()) st = co_await SyncFile();
    // Even after a failure the entries are dropped in memory (the table on
    // disk may be partly zeroed): the tables are leaked, never reused while
    // an entry on disk still points at them.
    for (uint64_t i = new_l1; i < l1_.size(); ++i) l1_[i] = 0;
    for (uint64_t l2 : freed) l2_offsets_.erase(l2);
    if (!st.ok()) {
      const int e = StatusErrno(st);
      co_return WithMessage(
          st, absl::StrCat("Failed to reduce the number of L2 tables: ",
                           e != 0 ? std::string(std::strerror(e))
                                  : std::string(st.message())));
    }
    co_await file_->DebugEvent(io::BlkdebugEvent::kL1ShrinkFreeL2Clusters);
    for (uint64_t l2 : freed) {
      CO_RETURN_IF_ERROR(co_await refcounts_->Free(l2, cluster_size_));
      // QEMU discards each one in the file (QCOW2_DISCARD_ALWAYS).
      absl::Status d = co_await file_->Discard(l2, cluster_size_);
      (void)d;  // advisory
    }
  }
  CO_RETURN_IF_ERROR(co_await FlushAll());
  // Refcount blocks that count nothing any more leave the table and are
  // freed; QEMU discards their clusters in the file whatever the discard
  // setting (qcow2_discard_refcount_block).
  CO_ASSIGN_OR_RETURN(const std::vector<uint64_t> dropped,
                      co_await refcounts_->ShrinkTable());
  for (const uint64_t block : dropped) {
    absl::Status st = co_await file_->Discard(block, cluster_size_);
    (void)st;  // advisory
  }
  // Cut the file after the last cluster in use.
  const uint64_t file_size = FileSize();
  CO_ASSIGN_OR_RETURN(const int64_t last, co_await refcounts_->LastUsedCluster(file_size));
  const uint64_t keep = (static_cast<uint64_t>(last + 1)) << cluster_bits_;
  if (last >= 0 && keep < file_size) {
    absl::Status st = co_await file_->Truncate(keep, io::PreallocMode::kOff);
    (void)st;  // QEMU only warns
  }
  co_return absl::OkStatus();
}

io::Task<absl::Status> Qcow2Node::DoTruncate(uint64_t new_size,
                                             io::PreallocMode prealloc) {
  if (new_size % 512 != 0) {
    co_return absl::InvalidArgumentError("The new size must be a multiple of 512");
  }
  CO_RETURN_IF_ERROR(CheckBitmapsResizable());
  while (true) {
    auto lock = co_await io::ScopedLock::Take(meta_lock_);
    CO_RETURN_IF_ERROR(CheckUsable());
    if (header_.nb_snapshots != 0 && header_.version < 3) {
      co_return absl::UnimplementedError(
          "Can't resize a v2 image which has snapshots");
    }
    const uint64_t old_size = size();
    if (new_size < old_size) {
      // Allocating writes past the new end finish first.
      const uint64_t first = (new_size + cluster_size_ - 1) >> cluster_bits_;
      const uint64_t end = (old_size + cluster_size_ - 1) >> cluster_bits_;
      if (end > first) {
        if (std::shared_ptr<Inflight> other = FindInflight(first, end - first)) {
          lock.Release();
          co_await other->done.Wait();
          continue;
        }
      }
    }
    // Growing over a longer backing file must not make its data visible
    // (QEMU's block layer adds BDRV_REQ_ZERO_WRITE): the new area is zeroed,
    // which needs the zero flag of version 3.
    bool zero_new =
        new_size > old_size && backing_ != nullptr && backing_->size() > old_size;
    if (zero_new && header_.version < 3) {
      co_return absl::UnimplementedError(
          "Failed to zero out new clusters: Operation not supported");
    }
    CO_RETURN_IF_ERROR(co_await PrepareFirstWrite());
    if (new_size < old_size) {
      CO_RETURN_IF_ERROR(co_await Shrink(new_size));
    } else {
      CO_RETURN_IF_ERROR(co_await GrowL1(
          format::L1EntriesForSize(new_size, cluster_bits_,
                                   l2_format_.extended_l2),
          /*exact=*/true));
      switch (prealloc) {
        case io::PreallocMode::kOff:
          break;
        case io::PreallocMode::kMetadata:
          CO_RETURN_IF_ERROR(co_await PreallocateMetadata(old_size, new_size));
          break;
        case io::PreallocMode::kFalloc:
        case io::PreallocMode::kFull:
          // The grown file reads as zeroes, so the new clusters need no
          // zeroing (QEMU: the protocol truncate honours
          // BDRV_REQ_ZERO_WRITE on regular files).
          CO_RETURN_IF_ERROR(co_await PreallocateData(
              old_size, new_size, prealloc, /*mark_allocated=*/zero_new));
          zero_new = false;
          break;
      }
      if (prealloc != io::PreallocMode::kOff) {
        CO_RETURN_IF_ERROR(co_await FlushAll());
      }
    }
    // Whole new clusters become zero clusters (preallocated ones stay
    // allocated); no request can be in flight past the old end. With
    // extended L2 entries QEMU starts at the next subcluster: the rest of
    // the old last cluster becomes zero subclusters.
    const uint64_t sc_mask = (uint64_t{1} << subcluster_bits()) - 1;
    const uint64_t sc_zero_start = (old_size + sc_mask) & ~sc_mask;
    const uint64_t zero_start = (old_size + cluster_size_ - 1) & ~(cluster_size_ - 1);
    if (zero_new && l2_format_.extended_l2 && new_size > sc_zero_start &&
        sc_zero_start < zero_start) {
      CO_ASSIGN_OR_RETURN(TableCache::Ref l2, co_await GetL2ForWrite(l1_index(sc_zero_start)));
      const uint64_t index = l2_index(sc_zero_start);
      const L2Entry old = GetEntry(l2, index);
      CO_ASSIGN_OR_RETURN(const ClusterType type, co_await Classify(old, l2.offset(), index));
      if (type == ClusterType::kCompressed) {
        co_return absl::UnimplementedError(
            "Failed to zero out new clusters: Operation not supported");
      }
      // Up to the new end if that is in this cluster too (rounded up).
      const uint64_t in_cluster = sc_zero_start & (cluster_size_ - 1);
      const uint64_t end = std::min(new_size, zero_start) - (sc_zero_start - in_cluster);
      const uint32_t a = static_cast<uint32_t>(in_cluster >> subcluster_bits());
      const uint32_t b = static_cast<uint32_t>((end + sc_mask) >> subcluster_bits());
      L2Entry e = old;
      e.bitmap = (old.bitmap & ~format::SubclusterAllocRange(a, b - a)) |
                 format::SubclusterZeroRange(a, b - a);
      if (!(e == old)) SetEntry(l2, index, e);
    }
    if (zero_new && new_size > zero_start) {
      uint64_t first = zero_start >> cluster_bits_;
      uint64_t count = (new_size - zero_start + cluster_size_ - 1) >> cluster_bits_;
      while (count > 0) {
        const uint64_t n = std::min(count, l2_entries_ - first % l2_entries_);
        CO_RETURN_IF_ERROR(co_await ZeroClusters(first, n, /*may_unmap=*/false));
        first += n;
        count -= n;
      }
    }
    uint8_t field[8];
    StoreBE64(field, new_size);
    CO_RETURN_IF_ERROR(
        co_await WriteHeaderField(kSizeOffset, io::ConstIoVec(field, 8)));
    header_.size = new_size;
    ResizeBitmaps(new_size);
    const uint64_t explicit_end = l2_format_.extended_l2 ? sc_zero_start : zero_start;
    if (zero_new && explicit_end > old_size) {
      // The rest of the old last (sub)cluster: explicit zeroes (copy-on-write
      // of that cluster), as QEMU writes them.
      lock.Release();
      std::vector<uint8_t> zeroes(std::min(explicit_end, new_size) - old_size, 0);
      co_return co_await WriteGuest(old_size, zeroes);  // no bitmap bits
    }
    co_return absl::OkStatus();
  }
}

}  // namespace imgtool::qcow2

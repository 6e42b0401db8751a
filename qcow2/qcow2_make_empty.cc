// Qcow2Node::MakeEmpty: QEMU 7.2's qcow2_make_empty, with which qemu-img
// commit empties the image it committed.
#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/errno_status.h"
#include "base/status_macros.h"
#include "qcow2/bytes.h"
#include "qcow2/format/refcount.h"
#include "qcow2/qcow2_node.h"

namespace imgtool::qcow2 {
namespace {

// Header field offsets (qcow2 spec, "Header").
constexpr uint64_t kL1TableOffsetOffset = 40;

}  // namespace

io::Task<absl::Status> Qcow2Node::MakeEmpty() {
  if (read_only()) {
    co_return absl::FailedPreconditionError(
        absl::StrCat(filename(), ": cannot empty a read-only image"));
  }
  const uint64_t cs = cluster_size_;
  const uint64_t l1_clusters = (uint64_t{header_.l1_size} * 8 + cs - 1) / cs;
  const uint64_t per_block =
      format::RefcountEntriesPerBlock(cluster_bits_, header_.refcount_order);
  const bool whole = header_.version >= 3 && header_.nb_snapshots == 0 &&
                     !header_.bitmaps.has_value() &&
                     3 + l1_clusters <= per_block;
  if (!whole) {
    // Every cluster dropped, one L2 table at a time (QEMU's fallback:
    // qcow2_cluster_discard with full_discard over the whole image).
    const uint64_t clusters = (size() + cs - 1) / cs;
    CO_RETURN_IF_ERROR(co_await ForEachL2Range(
        0, clusters, [this](uint64_t first, uint64_t n) {
          return DiscardClusters(first, n, /*full_discard=*/true);
        }));
    auto lock = co_await io::ScopedLock::Take(meta_lock_);
    co_return co_await FlushAll();
  }

  auto lock = co_await io::ScopedLock::Take(meta_lock_);
  CO_RETURN_IF_ERROR(CheckUsable());
  // QEMU 7.2's make_completely_empty, step by step with its debug events,
  // so that a failure at any step leaves the file QEMU leaves.
  // 1. Both caches written back and emptied (qcow2_cache_empty).
  CO_RETURN_IF_ERROR(co_await FlushAll());
  pending_frees_.clear();
  l2_offsets_.clear();
  metadata_preallocation_.reset();
  l2_cache_ = NewL2Cache();
  // 2. The refcounts go wrong from here on: the dirty bit first, durable,
  // so that a failure or crash leaves an image the next read-write open
  // repairs (qcow2_mark_dirty: a synced write of the field, then a flush).
  if (!header_.dirty()) {
    header_.incompatible_features |= format::kIncompatibleDirty;
    if (absl::Status st = co_await WriteIncompatibleFeatures(); !st.ok()) {
      header_.incompatible_features &= ~format::kIncompatibleDirty;
      co_return st;
    }
    CO_RETURN_IF_ERROR(co_await SyncFile());
  }
  // A failure from here on leaves the refcounts in memory unlike those on
  // disk: the node is unusable (QEMU ejects its driver, bs->drv = NULL, so
  // that nothing is written any more and every request fails with
  // ENOMEDIUM); the dirty bit on disk makes the next open repair the image.
  auto eject = [this](absl::Status st) {
    broken_ = ErrnoStatus(filename(), "make empty", ENOMEDIUM);
    return st;
  };
  // 3. The L1 table zeroed.
  co_await file_->DebugEvent(io::BlkdebugEvent::kL1Update);
  if (absl::Status st = co_await file_->WriteZeroes(
          header_.l1_table_offset, l1_clusters * cs, io::WriteZeroesFlags{});
      !st.ok()) {
    co_return eject(st);
  }
  std::fill(l1_.begin(), l1_.end(), 0);
  // 4. Clusters 1 to 2 + l1_clusters zeroed: room for the refcount table
  // (cluster 1), its one refcount block (2) and the L1 table (3..).
  co_await file_->DebugEvent(io::BlkdebugEvent::kEmptyImagePrepare);
  if (absl::Status st = co_await file_->WriteZeroes(
          cs, (2 + l1_clusters) * cs, io::WriteZeroesFlags{});
      !st.ok()) {
    co_return eject(st);
  }
  // 5. The header points at them: l1_table_offset, refcount_table_offset
  // and refcount_table_clusters in one synced write.
  co_await file_->DebugEvent(io::BlkdebugEvent::kL1Update);
  co_await file_->DebugEvent(io::BlkdebugEvent::kReftableUpdate);
  uint8_t fields[20];
  StoreBE64(fields, 3 * cs);   // l1_table_offset
  StoreBE64(fields + 8, cs);   // refcount_table_offset
  StoreBE32(fields + 16, 1);   // refcount_table_clusters
  if (absl::Status st = co_await file_->Write(kL1TableOffsetOffset,
                                              io::ConstIoVec(fields, 20));
      !st.ok()) {
    co_return eject(st);
  }
  if (absl::Status st = co_await SyncFile(); !st.ok()) co_return eject(st);
  header_.l1_table_offset = 3 * cs;
  header_.refcount_table_offset = cs;
  header_.refcount_table_clusters = 1;
  // 6. The refcount block entered in the table (synced).
  co_await file_->DebugEvent(io::BlkdebugEvent::kRefblockAlloc);
  uint8_t entry[8];
  StoreBE64(entry, 2 * cs);
  if (absl::Status st = co_await file_->Write(cs, io::ConstIoVec(entry, 8));
      !st.ok()) {
    co_return eject(st);
  }
  if (absl::Status st = co_await SyncFile(); !st.ok()) co_return eject(st);
  std::vector<uint64_t> table(cs / 8, 0);
  table[0] = 2 * cs;
  refcounts_ = std::make_unique<Refcounts>(
      static_cast<MetadataIo&>(*this), cluster_bits_, header_.refcount_order,
      cs, 1, std::move(table), config_.refcount_cache_tables);
  // 7. The header, the table, the block and the L1 table allocated by the
  // allocator (refcounts 1 in the cached block), which must find them at 0.
  absl::StatusOr<uint64_t> first =
      co_await refcounts_->Allocate(3 * cs + uint64_t{header_.l1_size} * 8);
  if (!first.ok()) co_return eject(first.status());
  if (*first != 0) {
    co_return eject(absl::InternalError(absl::StrCat(
        filename(), ": First cluster in emptied image is in use")));
  }
  // 8. qcow2_mark_clean: the dirty bit cleared in memory, the caches
  // written (the refcount block) and flushed, the header cluster rewritten.
  // A failure here leaves the image dirty on disk and the node usable.
  header_.incompatible_features &= ~format::kIncompatibleDirty;
  dirty_set_by_us_ = false;
  CO_RETURN_IF_ERROR(co_await FlushAll());
  CO_RETURN_IF_ERROR(co_await WriteHeader());
  // 9. The file cut after the L1 table.
  co_return co_await file_->Truncate((3 + l1_clusters) * cs,
                                     io::PreallocMode::kOff);
}

}  // namespace imgtool::qcow2

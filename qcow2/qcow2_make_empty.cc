// Qcow2Node::MakeEmpty: QEMU 7.2's qcow2_make_empty, with which qemu-img
// commit empties the image it committed.
#include <algorithm>
#include <climits>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "io/aligned_buffer.h"
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
  CO_RETURN_IF_ERROR(co_await FlushAll());
  // The refcounts go wrong from here on: the dirty bit first, durable, so
  // that a crash leaves an image the next read-write open repairs (QEMU's
  // make_completely_empty; the guest then reads the backing file, which
  // has the data).
  header_.incompatible_features |= format::kIncompatibleDirty;
  CO_RETURN_IF_ERROR(co_await WriteIncompatibleFeatures());
  CO_RETURN_IF_ERROR(co_await file_->WriteZeroes(
      header_.l1_table_offset, l1_clusters * cs, io::WriteZeroesFlags{}));
  CO_RETURN_IF_ERROR(co_await file_->WriteZeroes(
      cs, (2 + l1_clusters) * cs, io::WriteZeroesFlags{}));
  // Refcount table in cluster 1, its one refcount block in cluster 2, the
  // L1 table from cluster 3.
  uint8_t fields[20];
  StoreBE64(fields, 3 * cs);   // l1_table_offset
  StoreBE64(fields + 8, cs);   // refcount_table_offset
  StoreBE32(fields + 16, 1);   // refcount_table_clusters
  CO_RETURN_IF_ERROR(co_await file_->Write(kL1TableOffsetOffset,
                                           io::ConstIoVec(fields, 20)));
  CO_RETURN_IF_ERROR(co_await SyncFile());
  uint8_t entry[8];
  StoreBE64(entry, 2 * cs);
  CO_RETURN_IF_ERROR(co_await file_->Write(cs, io::ConstIoVec(entry, 8)));
  CO_RETURN_IF_ERROR(co_await SyncFile());
  io::AlignedBuffer block(cs);
  std::fill_n(block.data(), cs, 0);
  for (uint64_t i = 0; i < 3 + l1_clusters; ++i) {
    format::SetRefcount(block.span(), i, header_.refcount_order, 1);
  }
  CO_RETURN_IF_ERROR(co_await file_->Write(2 * cs, block.span()));
  CO_RETURN_IF_ERROR(co_await SyncFile());

  header_.l1_table_offset = 3 * cs;
  header_.refcount_table_offset = cs;
  header_.refcount_table_clusters = 1;
  header_.incompatible_features &= ~format::kIncompatibleDirty;
  dirty_set_by_us_ = false;
  // QEMU's qcow2_mark_clean rewrites the whole header cluster.
  CO_RETURN_IF_ERROR(co_await WriteHeader());
  CO_RETURN_IF_ERROR(
      co_await file_->Truncate((3 + l1_clusters) * cs, io::PreallocMode::kOff));

  // The tables in memory follow the file again.
  pending_frees_.clear();
  l2_offsets_.clear();
  l2_cache_ = std::make_unique<TableCache>(
      cluster_size_, config_.l2_cache_tables,
      [this](uint64_t offset, io::IoVec buf) { return ReadMetadata(offset, buf); },
      [this](uint64_t offset, io::ConstIoVec data) {
        return WriteL2Table(offset, data);
      });
  co_return co_await LoadTables();
}

}  // namespace imgtool::qcow2

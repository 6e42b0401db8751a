// Refcounts of an open qcow2 image (qcow2 spec, "Host cluster management"):
// the refcount table (in memory, written through), a cache of refcount
// blocks, and the host cluster allocator.
//
// The allocator follows QEMU 7.2's (block/qcow2-refcount.c) so that images
// grow the way qemu-img grows them: free clusters are searched from a
// "first free" hint; a missing refcount block is placed at the first free
// cluster (describing itself when it can); a full refcount table is
// replaced by a bigger one laid out behind the last covered block; every
// allocation that had to create refcount metadata starts over.
//
// Ordering for crash safety: a new refcount block is written and synced
// before the refcount table points to it, the new table before the header
// does. Raised refcounts stay in the cache until WriteDirty(); the owner
// writes (and syncs) them before any metadata that uses the clusters.
// Errors: kDataLoss after a corruption event (the owner's message),
// I/O errors of the file.
// Thread model: engine thread, under the owner's metadata lock.
#ifndef IMGTOOL_QCOW2_REFCOUNTS_H_
#define IMGTOOL_QCOW2_REFCOUNTS_H_

#include <cstdint>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "io/task.h"
#include "qcow2/metadata_io.h"
#include "qcow2/table_cache.h"

namespace imgtool::qcow2 {

class Refcounts {
 public:
  // `table`: the refcount table entries as read (raw big-endian decoded
  // words, table_clusters * cluster_size / 8 of them). `cache_tables`:
  // refcount blocks to cache.
  Refcounts(MetadataIo& io, uint32_t cluster_bits, uint32_t refcount_order,
            uint64_t table_offset, uint32_t table_clusters,
            std::vector<uint64_t> table, size_t cache_tables);

  // Refcount of host cluster `cluster_index` (0 past the table).
  io::Task<absl::StatusOr<uint64_t>> Get(uint64_t cluster_index);

  // Each of the three allocators below first awaits
  // MetadataIo::BeforeAllocate (its error is returned as is).
  //
  // Allocates clusters for `bytes` (rounded up) at the first free run and
  // returns its offset (qcow2_alloc_clusters).
  io::Task<absl::StatusOr<uint64_t>> Allocate(uint64_t bytes);

  // Allocates up to `nb_clusters` clusters from `offset` on, stopping at the
  // first used one; returns how many (qcow2_alloc_clusters_at).
  io::Task<absl::StatusOr<uint64_t>> AllocateAt(uint64_t offset,
                                                uint64_t nb_clusters);

  // Allocates `size` bytes (1..cluster_size) for compressed data, packed
  // after the previous compressed allocation when it fits (each host
  // cluster's refcount counts the allocations touching it;
  // qcow2_alloc_bytes). As in QEMU, packing goes on in a cluster whose
  // compressed data was all freed meanwhile (so that files stay
  // byte-identical to qemu-img's), unless that cluster was handed out
  // again in between: then a fresh cluster is taken (QEMU would write the
  // compressed data into the other user's cluster).
  io::Task<absl::StatusOr<uint64_t>> AllocateBytes(uint64_t size);

  // Adds (or with `decrease` subtracts) `addend` to the refcount of every
  // cluster touched by [offset, offset + length). kDataLoss on overflow or
  // underflow.
  io::Task<absl::Status> Update(uint64_t offset, uint64_t length,
                                uint64_t addend, bool decrease) {
    return UpdateRefcounts(offset, length, addend, decrease,
                           /*packing=*/false);
  }

  // Update(cluster_index << cluster_bits, cluster_size, 1, decrease) done
  // synchronously when that is the same as Update and needs no I/O: the
  // covering refcount block is cached, the file raises no debug events
  // (Update raises refblock_alloc / refblock_load per call), and the
  // refcount stays within 1..max (an increase from 0 or to past the
  // maximum, a decrease to 0 or below, are left to Update: its packing
  // hint, free hint, corruption event and ClusterFreed). Returns true and
  // the new refcount in *refcount if it did it; false, nothing changed,
  // otherwise. For per-cluster loops (snapshot refcount updates) where a
  // coroutine call per cluster costs more than the change.
  bool TryAdjustCached(uint64_t cluster_index, bool decrease,
                       uint64_t* refcount);

  // Refcount if its block is cached (or there is none: 0); false if a
  // read is needed. No I/O, no events.
  bool PeekRefcount(uint64_t cluster_index, uint64_t* refcount);

  // Decrements the refcounts of [offset, offset + length) now.
  // Raises cluster_free on the file first.
  io::Task<absl::Status> Free(uint64_t offset, uint64_t length) {
    co_await io_.FileDebugEvent(io::BlkdebugEvent::kClusterFree);
    co_return co_await Update(offset, length, 1, true);
  }

  // Lays out refcount blocks and a new refcount table at `start_offset`
  // (cluster aligned) so that everything up to there plus
  // `additional_clusters` is covered, switches to the new table and frees
  // the old one. Returns the end of the new structures (qcow2_refcount_area).
  io::Task<absl::StatusOr<uint64_t>> RefcountArea(uint64_t start_offset,
                                                  uint64_t additional_clusters,
                                                  bool exact_size,
                                                  uint64_t new_refblock_index,
                                                  uint64_t new_refblock_offset);

  // Drops from the refcount table every refcount block that counts no
  // cluster but itself, writing the whole table (synced) first, then frees
  // each dropped block's own cluster: a block counted by another (kept)
  // block gets refcount 0 there (qcow2_shrink_reftable,
  // qcow2_discard_refcount_block). Returns the offsets of the dropped
  // blocks, in table order, for the caller to discard in the file as QEMU
  // does. kDataLoss (image marked corrupt) if a dropped block's refcount is
  // not 1; errors reading the blocks or writing the table.
  io::Task<absl::StatusOr<std::vector<uint64_t>>> ShrinkTable();

  // Index of the last cluster below `file_size` with a nonzero refcount, or
  // -1 if there is none (qcow2_get_last_cluster).
  io::Task<absl::StatusOr<int64_t>> LastUsedCluster(uint64_t file_size);

  // End in bytes of the last host cluster with a nonzero refcount anywhere
  // in the refcount table, 0 if there is none: with consistent refcounts,
  // the end of everything the image uses (qemu-img check's "Image end
  // offset"). Reads refcount blocks from the top of the table down to the
  // first nonzero refcount. kDataLoss, and nothing marked corrupt, if a
  // table entry it meets is not cluster aligned or points at or past
  // FileSize(); read errors of the file.
  io::Task<absl::StatusOr<uint64_t>> UsedEnd();

  // Writes every dirty refcount block (no sync).
  io::Task<absl::Status> WriteDirty() { return cache_.WriteDirty(); }
  bool dirty() const { return cache_.HasDirty(); }

  // The refcount block of refcount table entry `table_index`, read if
  // needed, or an empty Ref if the entry is 0. kDataLoss (image marked
  // corrupt) if the entry is unaligned or points past the end of the file.
  io::Task<absl::StatusOr<TableCache::Ref>> Block(uint64_t table_index) {
    return LoadBlock(table_index);
  }

  // Takes over `old`'s allocation hints (the first-free cluster index and
  // where compressed data is packed next): for a Refcounts that replaces
  // `old` on the same image, so that allocations continue as QEMU's, whose
  // hints live in the image state and survive a refcount width change.
  void TakeHintsFrom(const Refcounts& old) {
    free_cluster_index_ = old.free_cluster_index_;
    free_byte_offset_ = old.free_byte_offset_;
  }

  uint32_t refcount_order() const { return refcount_order_; }
  // Refcount entries in one refcount block.
  uint64_t entries_per_block() const { return uint64_t{1} << block_bits_; }
  uint64_t table_offset() const { return table_offset_; }
  uint64_t table_bytes() const { return table_.size() * 8; }
  uint32_t table_clusters() const {
    return static_cast<uint32_t>((table_.size() * 8) >> cluster_bits_);
  }
  // Is the cluster at `offset` a refcount block in the table?
  bool IsRefcountBlock(uint64_t cluster_offset) const {
    return blocks_.contains(cluster_offset);
  }
  // Decoded refcount block offsets (0 = none), one per table entry.
  const std::vector<uint64_t>& table() const { return table_; }

 private:
  // Update's body. `packing`: the call is AllocateBytes's own, adding a
  // compressed allocation to the cluster it packs into; any other increase
  // of a freed cluster's refcount ends packing in it.
  io::Task<absl::Status> UpdateRefcounts(uint64_t offset, uint64_t length,
                                         uint64_t addend, bool decrease,
                                         bool packing);
  // Sentinel for QEMU's -EAGAIN: refcount metadata was allocated, the
  // caller must search for free clusters again.
  static absl::Status Retry();
  static bool IsRetry(const absl::Status& st);

  uint64_t cluster_size() const { return uint64_t{1} << cluster_bits_; }
  // The block covering `cluster_index`, read if needed, or an empty Ref
  // if there is none. kDataLoss if the table entry is broken.
  io::Task<absl::StatusOr<TableCache::Ref>> LoadBlock(uint64_t table_index);
  // alloc_clusters_noref: the first run of `count` free clusters from the
  // hint on; moves the hint past it.
  io::Task<absl::StatusOr<uint64_t>> FindFree(uint64_t count);
  // alloc_refcount_block: the block covering `cluster_index`, creating it
  // (and returning Retry()) if missing.
  io::Task<absl::StatusOr<TableCache::Ref>> EnsureBlock(uint64_t cluster_index);
  io::Task<absl::Status> FlushBlocks();
  void SetTable(std::vector<uint64_t> table, uint64_t offset);
  // Writes refcount table `table` (big-endian entries) at file offset
  // `offset` and syncs the file. Errors: the write or the sync.
  io::Task<absl::Status> WriteTable(const std::vector<uint64_t>& table,
                                    uint64_t offset);

  MetadataIo& io_;
  const uint32_t cluster_bits_;
  const uint32_t refcount_order_;
  const uint32_t block_bits_;  // log2(refcount entries per block)
  uint64_t table_offset_;
  std::vector<uint64_t> table_;
  uint64_t max_table_index_ = 0;
  absl::flat_hash_set<uint64_t> blocks_;
  uint64_t free_cluster_index_ = 0;
  uint64_t free_byte_offset_ = 0;  // where the next compressed data may go
  TableCache cache_;
};

}  // namespace imgtool::qcow2

#endif  // IMGTOOL_QCOW2_REFCOUNTS_H_

// An LRU cache of cluster-sized qcow2 metadata tables (L2 tables, refcount
// blocks) keyed by their host offset in the image file. Tables are loaded on
// a miss and written back when dirty, either on WriteDirty() or when an
// eviction needs the slot. The owner supplies the read and write functions,
// and with them the write ordering (an L2 table is written only after the
// refcounts it relies on) and the metadata overlap check.
//
// Table buffers are io::AlignedBuffers (aligned to min(4096, table size)
// bytes), so an image opened with O_DIRECT reads and writes tables straight
// from them, without the file layer's bounce buffer.
//
// A Ref pins its table: pinned tables are never evicted, so a Ref stays valid
// across co_awaits. When every table is pinned the cache grows past its
// capacity rather than failing.
// Thread model: used from the engine's thread, under the owner's metadata
// lock (no two coroutines use one cache at the same time).
#ifndef IMGTOOL_QCOW2_TABLE_CACHE_H_
#define IMGTOOL_QCOW2_TABLE_CACHE_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "io/aligned_buffer.h"
#include "io/block_node.h"
#include "io/task.h"

namespace imgtool::qcow2 {

class TableCache {
 public:
  struct Table {
    uint64_t offset = 0;
    io::AlignedBuffer data;  // table_size() bytes, aligned to alignment()
    bool dirty = false;
    bool discarded = false;  // freed while pinned: dropped on unpin
    uint64_t last_use = 0;
    int pins = 0;
  };

  // A pinned table. Default-constructed Refs are empty.
  class Ref {
   public:
    Ref() = default;
    Ref(TableCache* cache, Table* table);
    Ref(Ref&& other) noexcept;
    Ref& operator=(Ref&& other) noexcept;
    Ref(const Ref&) = delete;
    Ref& operator=(const Ref&) = delete;
    ~Ref() { reset(); }

    void reset();
    explicit operator bool() const { return table_ != nullptr; }
    uint64_t offset() const { return table_->offset; }
    absl::Span<uint8_t> data() { return table_->data.span(); }
    absl::Span<const uint8_t> data() const { return table_->data.span(); }

   private:
    friend class TableCache;
    TableCache* cache_ = nullptr;
    Table* table_ = nullptr;
  };

  // Reads table_size bytes at `offset` into `buf`.
  using ReadFn = std::function<io::Task<absl::Status>(uint64_t offset, io::IoVec buf)>;
  // Writes a dirty table back (with whatever has to happen before).
  using WriteFn = std::function<io::Task<absl::Status>(uint64_t offset, io::ConstIoVec data)>;

  // `table_size`: bytes per table (the cluster size). `capacity`: tables
  // kept (at least 1).
  TableCache(uint64_t table_size, size_t capacity, ReadFn read, WriteFn write);
  TableCache(const TableCache&) = delete;
  TableCache& operator=(const TableCache&) = delete;

  // The table at `offset`, read on a miss. Errors: those of the read or of
  // writing back an evicted dirty table.
  io::Task<absl::StatusOr<Ref>> Get(uint64_t offset);

  // A zero-filled table for a newly allocated cluster at `offset`, marked
  // dirty, replacing any cached copy. Errors: those of an eviction.
  io::Task<absl::StatusOr<Ref>> GetEmpty(uint64_t offset);

  // Caches a zero-filled, clean table at `offset` (already written as
  // zeroes on disk): a cached copy is replaced; else one is added if there
  // is room without an eviction. No I/O, no suspension.
  void PutZeroed(uint64_t offset);

  // The cached table at `offset` if any, without I/O (not pinned beyond the
  // caller's use; do not hold across co_await).
  Table* Peek(uint64_t offset);
  // Peek that also counts as a use for the LRU order (as Get does), for
  // callers that change the table without a Ref: same rules as Peek.
  Table* PeekUse(uint64_t offset) {
    Table* t = Peek(offset);
    if (t != nullptr) t->last_use = ++clock_;
    return t;
  }
  void MarkDirty(Table* table) { table->dirty = true; }

  void MarkDirty(Ref& ref) { ref.table_->dirty = true; }

  // Drops the table at `offset` without writing it (its cluster was freed).
  void Discard(uint64_t offset);

  // Writes every dirty table, in offset order. Stops at the first error.
  io::Task<absl::Status> WriteDirty();

  // Writes the table at `offset` now if it is cached and dirty.
  io::Task<absl::Status> WriteOne(uint64_t offset);

  bool HasDirty() const;
  size_t cached() const { return tables_.size(); }
  uint64_t table_size() const { return table_size_; }
  // Start alignment of every table buffer in bytes: min(4096, the largest
  // power of two dividing table_size()).
  size_t alignment() const { return alignment_; }

 private:
  void Unpin(Table* table);
  // Removes `it` from the map; freed now or, if pinned, on its last unpin.
  void Drop(absl::flat_hash_map<uint64_t, std::unique_ptr<Table>>::iterator it);
  // Frees a slot for a new table if the cache is full.
  io::Task<absl::Status> MakeRoom();
  // The table at `offset` filled with zeroes (the cached one, or a new one
  // added without an eviction), marked `dirty` or clean, just used.
  Table* Zeroed(uint64_t offset, bool dirty);

  const uint64_t table_size_;
  const size_t alignment_;
  const size_t capacity_;
  ReadFn read_;
  WriteFn write_;
  uint64_t clock_ = 0;
  absl::flat_hash_map<uint64_t, std::unique_ptr<Table>> tables_;
  // Tables dropped while pinned, freed when their last Ref goes.
  absl::flat_hash_map<Table*, std::unique_ptr<Table>> graveyard_;
};

}  // namespace imgtool::qcow2

#endif  // IMGTOOL_QCOW2_TABLE_CACHE_H_

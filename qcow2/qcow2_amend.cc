// Qcow2Node::Amend: `qemu-img amend` for qcow2 (QEMU 7.2's
// qcow2_amend_options, qcow2_upgrade, qcow2_downgrade,
// qcow2_expand_zero_clusters, qcow2_change_refcount_order and
// qcow2_write_snapshots).
#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/numeric/bits.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/errno_status.h"
#include "base/status_macros.h"
#include "io/aligned_buffer.h"
#include "qcow2/bytes.h"
#include "qcow2/format/l2_entry.h"
#include "qcow2/format/refcount.h"
#include "qcow2/free_clusters.h"
#include "qcow2/qcow2_node.h"

namespace imgtool::qcow2 {

using format::ClusterType;
using format::L2Entry;

namespace {

constexpr uint64_t kNbSnapshotsOffset = 60;  // header: nb_snapshots, then
                                             // snapshots_offset

uint64_t RoundUp(uint64_t n, uint64_t to) { return (n + to - 1) / to * to; }

// qcow2_amend_helper_cb: the progress of the amend's operations (upgrade,
// refcount width change, downgrade) as one line, each operation's work
// size projected onto those still to come.
class AmendProgress {
 public:
  AmendProgress(std::function<void(int64_t, int64_t)> out, int64_t operations)
      : out_(std::move(out)), operations_(operations) {}

  // The callback of operation `op` (any distinct number per operation).
  std::function<void(int64_t, int64_t)> For(int op) {
    if (!out_) return nullptr;
    return [this, op](int64_t offset, int64_t work) { Report(op, offset, work); };
  }

 private:
  void Report(int op, int64_t offset, int64_t work) {
    if (op != last_op_) {
      if (last_op_ != 0) {
        offset_completed_ += last_work_;
        ++completed_;
      }
      last_op_ = op;
    }
    last_work_ = work;
    const int64_t current = offset_completed_ + work;
    const int64_t projected =
        current * (operations_ - completed_ - 1) / (completed_ + 1);
    out_(offset_completed_ + offset, current + projected);
  }

  std::function<void(int64_t, int64_t)> out_;
  const int64_t operations_;
  int last_op_ = 0;
  int64_t offset_completed_ = 0;
  int64_t last_work_ = 0;
  int64_t completed_ = 0;
};

}  // namespace

io::Task<absl::Status> Qcow2Node::MarkClean() {
  if (!header_.dirty()) co_return absl::OkStatus();
  CO_RETURN_IF_ERROR(co_await FlushAll());
  header_.incompatible_features &= ~format::kIncompatibleDirty;
  dirty_set_by_us_ = false;
  co_return co_await WriteHeader();
}

io::Task<absl::StatusOr<bool>> Qcow2Node::ExpandZeroClustersInL2(
    absl::Span<uint8_t> l2, uint64_t l2_offset, uint64_t l2_refcount) {
  bool changed = false;
  for (uint64_t j = 0; j < l2_entries_; ++j) {
    const L2Entry old = format::LoadL2Entry(l2, j, /*extended_l2=*/false);
    CO_ASSIGN_OR_RETURN(const ClusterType type,
                        co_await Classify(old, l2_offset, j));
    if (type != ClusterType::kZeroPlain && type != ClusterType::kZeroAlloc) {
      continue;
    }
    uint64_t host = old.host_offset();
    if (type == ClusterType::kZeroPlain) {
      if (!has_backing_file()) {
        // Unallocated reads as zeroes without a backing file.
        format::StoreL2Entry(l2, j, /*extended_l2=*/false, L2Entry{});
        changed = true;
        continue;
      }
      CO_ASSIGN_OR_RETURN(host, co_await refcounts_->Allocate(cluster_size_));
      if (l2_refcount > 1) {
        // Every L1 table sharing this L2 table refers to the new cluster.
        absl::Status raised = co_await refcounts_->Update(
            host, cluster_size_, l2_refcount - 1, /*decrease=*/false);
        if (!raised.ok()) {
          (void)co_await refcounts_->Free(host, cluster_size_);
          co_return raised;
        }
      }
    }
    absl::Status zeroed = co_await CheckOverlapOrFail(host, cluster_size_, 0);
    if (zeroed.ok()) {
      zeroed = co_await file_->WriteZeroes(host, cluster_size_,
                                           io::WriteZeroesFlags{});
    }
    if (!zeroed.ok()) {
      if (type == ClusterType::kZeroPlain) {
        (void)co_await refcounts_->Free(host, cluster_size_);
      }
      co_return zeroed;
    }
    ++write_gen_;
    L2Entry e;
    e.word = host | (l2_refcount == 1 ? format::kCopiedFlag : 0);
    format::StoreL2Entry(l2, j, /*extended_l2=*/false, e);
    changed = true;
  }
  co_return changed;
}

io::Task<absl::Status> Qcow2Node::ExpandZeroClusters(
    const std::vector<SnapshotRecord>& snapshots,
    const std::function<void(int64_t, int64_t)>& progress) {
  int64_t total = static_cast<int64_t>(l1_.size());
  for (const SnapshotRecord& sn : snapshots) total += sn.l1_size;
  int64_t visited = 0;
  for (uint64_t i = 0; i < l1_.size(); ++i) {
    if ((l1_[i] & format::kL1OffsetMask) != 0) {
      CO_ASSIGN_OR_RETURN(TableCache::Ref l2, co_await LoadL2(i));
      CO_ASSIGN_OR_RETURN(const uint64_t l2_refcount,
                          co_await refcounts_->Get(l2.offset() >> cluster_bits_));
      CO_ASSIGN_OR_RETURN(
          const bool changed,
          co_await ExpandZeroClustersInL2(l2.data(), l2.offset(), l2_refcount));
      if (changed) l2_cache_->MarkDirty(l2);
    }
    ++visited;
    if (progress) progress(visited, total);
  }
  if (snapshots.empty()) co_return absl::OkStatus();

  // Snapshot L1 tables may point to the active L2 tables just changed:
  // they are read from the file, so the cache goes there first.
  CO_RETURN_IF_ERROR(co_await FlushAll());
  io::AlignedBuffer l2(cluster_size_);
  for (const SnapshotRecord& sn : snapshots) {
    // qcow2_expand_zero_clusters checks each snapshot's L1 table as it
    // comes to it, reports it and fails the downgrade.
    if (absl::Status v = ValidateSnapshotL1(sn); !v.ok()) {
      diagnostics_.push_back({true, std::string(v.message())});
      const int e = StatusErrno(v);
      co_return WithMessage(
          v, absl::StrCat("Failed to turn zero into data clusters: ",
                          std::strerror(e != 0 ? e : EINVAL)));
    }
    io::AlignedBuffer l1(uint64_t{sn.l1_size} * 8);
    if (sn.l1_size > 0) {
      CO_RETURN_IF_ERROR(co_await file_->Read(sn.l1_offset, l1.span()));
    }
    for (uint32_t i = 0; i < sn.l1_size; ++i) {
      const uint64_t l2_offset =
          LoadBE64(l1.data() + uint64_t{i} * 8) & format::kL1OffsetMask;
      if (l2_offset != 0) {
        if ((l2_offset & (cluster_size_ - 1)) != 0) {
          co_return co_await SignalCorruption(absl::StrFormat(
              "L2 table offset %#x unaligned (L1 index: %#x)", l2_offset, i));
        }
        CO_ASSIGN_OR_RETURN(const uint64_t l2_refcount,
                            co_await refcounts_->Get(l2_offset >> cluster_bits_));
        CO_RETURN_IF_ERROR(co_await file_->Read(l2_offset, l2.span()));
        CO_ASSIGN_OR_RETURN(
            const bool changed,
            co_await ExpandZeroClustersInL2(l2.span(), l2_offset, l2_refcount));
        if (changed) {
          CO_RETURN_IF_ERROR(
              co_await WriteMetadata(l2_offset, l2.span(), kOverlapActiveL2));
          l2_cache_->Discard(l2_offset);
        }
      }
      ++visited;
      if (progress) progress(visited, total);
    }
  }
  co_return absl::OkStatus();
}

io::Task<absl::StatusOr<std::vector<Qcow2Node::SnapshotRecord>>>
Qcow2Node::ReadSnapshotRecords(uint64_t* table_bytes) {
  // LoadSnapshotTable read them at open and after each rewrite.
  *table_bytes = snapshots_bytes_;
  co_return snapshot_records_;
}

io::Task<absl::Status> Qcow2Node::RewriteSnapshotTable(
    const std::vector<SnapshotRecord>& records, uint64_t old_table_bytes,
    std::optional<uint64_t> incompatible_features) {
  const std::vector<uint8_t> table = format::EncodeSnapshotTable(records);
  const uint64_t bytes = table.size();
  if (bytes > format::kMaxSnapshotTableBytes) {
    co_return absl::ResourceExhaustedError("Snapshot table too large");
  }
  CO_ASSIGN_OR_RETURN(const uint64_t table_offset,
                      co_await refcounts_->Allocate(bytes));
  // No flush between the allocation and the table's writes (QEMU's
  // qcow2_write_snapshots has one): nothing refers to the new clusters
  // until the header does, and the flush below makes their refcounts and
  // contents durable before that.
  if (CheckOverlap(table_offset, bytes, 0) != 0) {
    // The new table would overwrite metadata (say an old table whose last
    // entry runs past the end of the file, where the new one is put), and
    // the check below marks the image corrupt. The file as QEMU 7.2 leaves
    // it: qcow2_write_snapshots flushes (the refcounts, L2 tables, and the
    // new table's allocation reach the disk) before its overlap check,
    // whose qcow2_mark_corrupt rewrites the header from memory, where
    // qcow2_snapshot_create / _delete have already changed nb_snapshots
    // (the table offset is still the old one) and where no dirty bit is
    // set (QEMU sets none for snapshots; ours, set by the caller, goes).
    // One write: count, old offset and features with the corrupt bit.
    CO_RETURN_IF_ERROR(co_await FlushAll());
    if (incompatible_features.has_value()) {
      header_.incompatible_features &= ~format::kIncompatibleDirty;
    }
    header_.nb_snapshots = static_cast<uint32_t>(records.size());
    uint8_t field[20];
    StoreBE32(field, header_.nb_snapshots);
    StoreBE64(field + 4, header_.snapshots_offset);
    size_t field_bytes = 12;
    if (header_.version >= 3) {
      StoreBE64(field + 12,
                header_.incompatible_features | format::kIncompatibleCorrupt);
      field_bytes = 20;
    }
    absl::Status st = co_await file_->Write(
        kNbSnapshotsOffset, io::ConstIoVec(field, field_bytes));
    (void)st;  // the corruption below is the error
    absl::Status corrupt = co_await CheckOverlapOrFail(table_offset, bytes, 0);
    // qcow2_write_snapshots' failure path frees the new table's clusters
    // with QCOW2_DISCARD_ALWAYS: the refcounts are not written any more
    // (the image is corrupt), but the clusters are punched.
    const uint64_t mask = cluster_size_ - 1;
    (void)co_await file_->Discard(table_offset, (bytes + mask) & ~mask);
    co_return corrupt.ok() ? absl::DataLossError("qcow2: overlap") : corrupt;
  }
  CO_RETURN_IF_ERROR(co_await CheckOverlapOrFail(table_offset, bytes, 0));
  // One write, padding between entries zeroed (QEMU's g_malloc0 buffer).
  if (bytes > 0) CO_RETURN_IF_ERROR(co_await file_->Write(table_offset, table));
  // The new table and its refcounts are durable before the header points
  // to them.
  CO_RETURN_IF_ERROR(co_await FlushAll());
  // nb_snapshots and snapshots_offset (bytes 60-71), and with
  // `incompatible_features` the version 3 field right after them (72-79):
  // one write within the first sector, so the switch to the new table and
  // the change of the dirty bit reach the disk together or not at all.
  uint8_t field[20];
  StoreBE32(field, static_cast<uint32_t>(records.size()));
  StoreBE64(field + 4, table_offset);
  size_t field_bytes = 12;
  if (incompatible_features.has_value()) {
    StoreBE64(field + 12, *incompatible_features);
    field_bytes = 20;
  }
  CO_RETURN_IF_ERROR(co_await WriteHeaderField(
      kNbSnapshotsOffset, io::ConstIoVec(field, field_bytes)));
  if (incompatible_features.has_value()) {
    header_.incompatible_features = *incompatible_features;
  }
  const uint64_t old_offset = header_.snapshots_offset;
  header_.nb_snapshots = static_cast<uint32_t>(records.size());
  header_.snapshots_offset = table_offset;
  CO_RETURN_IF_ERROR(co_await LoadSnapshotTable());
  if (old_table_bytes > 0) {
    // A failed free only leaks the old table (QEMU's qcow2_free_clusters
    // prints it and goes on).
    if (absl::Status freed = co_await FreeClustersAsQemu(
            *refcounts_, cluster_bits_, header_.refcount_order, old_offset,
            old_table_bytes);
        !freed.ok()) {
      diagnostics_.push_back(
          {false, absl::StrCat("qcow2_free_clusters failed: ",
                               std::strerror(FreeErrno(freed)))});
      co_return absl::OkStatus();
    }
    // QEMU passes the snapshot table's free down as a discard: the
    // clusters that became free read as zeroes afterwards.
    const uint64_t mask = cluster_size_ - 1;
    uint64_t start = 0, end = 0;
    for (uint64_t c = old_offset & ~mask; c < old_offset + old_table_bytes;
         c += cluster_size_) {
      CO_ASSIGN_OR_RETURN(const uint64_t rc,
                          co_await refcounts_->Get(c >> cluster_bits_));
      if (rc != 0) continue;
      if (end != c) {
        if (end > start) (void)co_await file_->Discard(start, end - start);
        start = c;
      }
      end = c + cluster_size_;
    }
    if (end > start) (void)co_await file_->Discard(start, end - start);
  }
  co_return absl::OkStatus();
}

struct Qcow2Node::RefcountWalk {
  uint32_t refcount_order = 0;
  uint64_t entries_per_block = 0;
  std::vector<uint64_t> table;  // new refcount block offsets (0 = none)
  uint64_t table_index = 0;     // the new block being filled
  io::AlignedBuffer block;      // its contents (write walk)
  bool allocated = false;       // the walk allocated a block
};

io::Task<absl::Status> Qcow2Node::FinishNewRefblock(RefcountWalk& w,
                                                    bool write, bool empty) {
  const uint64_t index = w.table_index;
  if (write) {
    if (index < w.table.size() && w.table[index] != 0) {
      co_return co_await WriteMetadata(w.table[index], w.block.span(), 0);
    }
    if (!empty) {
      co_return absl::InternalError(
          "qcow2: refcount block without an allocation");
    }
    co_return absl::OkStatus();
  }
  if (empty) co_return absl::OkStatus();
  if (index >= w.table.size()) {
    const uint64_t size = RoundUp(index + 1, cluster_size_ / 8);
    if (size * 8 > format::kMaxRefcountTableBytes) {
      co_return absl::UnimplementedError(
          "This operation would make the refcount table grow beyond the "
          "maximum size supported by QEMU, aborting");
    }
    w.table.resize(size, 0);
  }
  if (w.table[index] == 0) {
    CO_ASSIGN_OR_RETURN(w.table[index],
                        co_await refcounts_->Allocate(cluster_size_));
    w.allocated = true;
  }
  co_return absl::OkStatus();
}

io::Task<absl::Status> Qcow2Node::WalkRefcounts(
    RefcountWalk& w, bool write, int64_t walk_index, int64_t walks,
    const std::function<void(int64_t, int64_t)>& progress) {
  const uint32_t old_order = refcounts_->refcount_order();
  const uint64_t old_entries = refcounts_->entries_per_block();
  const uint32_t new_bits = uint32_t{1} << w.refcount_order;
  auto bytes_of = [&w](uint64_t entries) {
    return (entries << w.refcount_order) / 8;
  };
  uint64_t new_index = 0;
  bool empty = true;
  // The old table may grow while blocks are allocated: its size is read
  // anew at every entry, as QEMU does.
  for (uint64_t i = 0; i < refcounts_->table().size(); ++i) {
    const int64_t table_size = static_cast<int64_t>(refcounts_->table().size());
    if (progress) {
      progress(walk_index * table_size + static_cast<int64_t>(i),
               walks * table_size);
    }
    TableCache::Ref block;
    if (refcounts_->table()[i] != 0) {
      CO_ASSIGN_OR_RETURN(block, co_await refcounts_->Block(i));
    }
    uint64_t j = 0;
    while (j < old_entries) {
      if (new_index >= w.entries_per_block) {
        CO_RETURN_IF_ERROR(co_await FinishNewRefblock(w, write, empty));
        ++w.table_index;
        new_index = 0;
        empty = true;
      }
      if (!block) {
        // No block: all refcounts 0. Entry counts are multiples of 64 here
        // (blocks are at least 512 bytes), so whole bytes.
        const uint64_t n =
            std::min(old_entries - j, w.entries_per_block - new_index);
        if (write) {
          std::memset(w.block.data() + bytes_of(new_index), 0, bytes_of(n));
        }
        new_index += n;
        j += n;
        continue;
      }
      const uint64_t refcount = format::GetRefcount(block.data(), j, old_order);
      if (new_bits < 64 && (refcount >> new_bits) != 0) {
        const uint64_t offset = ((i * old_entries) + j) << cluster_bits_;
        co_return absl::InvalidArgumentError(absl::StrFormat(
            "Cannot decrease refcount entry width to %d bits: Cluster at "
            "offset %#x has a refcount of %d",
            new_bits, offset, refcount));
      }
      if (write) {
        format::SetRefcount(w.block.span(), new_index, w.refcount_order,
                            refcount);
      }
      ++new_index;
      empty = empty && refcount == 0;
      ++j;
    }
  }
  if (new_index > 0) {
    if (write) {
      std::memset(w.block.data() + bytes_of(new_index), 0,
                  bytes_of(w.entries_per_block - new_index));
    }
    CO_RETURN_IF_ERROR(co_await FinishNewRefblock(w, write, empty));
    ++w.table_index;
  }
  if (progress) {
    const int64_t table_size = static_cast<int64_t>(refcounts_->table().size());
    progress((walk_index + 1) * table_size, walks * table_size);
  }
  co_return absl::OkStatus();
}

io::Task<absl::Status> Qcow2Node::ChangeRefcountOrder(
    uint32_t refcount_order,
    const std::function<void(int64_t, int64_t)>& progress) {
  RefcountWalk w;
  w.refcount_order = refcount_order;
  w.entries_per_block = format::RefcountEntriesPerBlock(cluster_bits_,
                                                        refcount_order);
  w.block = io::AlignedBuffer(cluster_size_);
  int64_t walk_index = 0;
  uint64_t table_offset = 0;
  uint64_t allocated_table_entries = 0;
  absl::Status st;
  // Allocate the new blocks and table in the old refcounts, walking again
  // until a walk allocates nothing (the allocations change refcounts).
  do {
    w.allocated = false;
    w.table_index = 0;
    const int64_t walks = std::max<int64_t>(walk_index + 2, 3);
    st = co_await WalkRefcounts(w, /*write=*/false, walk_index++, walks,
                                progress);
    if (!st.ok()) break;
    if (w.allocated) {
      if (table_offset != 0) {
        (void)co_await refcounts_->Free(table_offset,
                                        allocated_table_entries * 8);
      }
      absl::StatusOr<uint64_t> offset =
          co_await refcounts_->Allocate(w.table.size() * 8);
      if (!offset.ok()) {
        table_offset = 0;
        st = offset.status();
        break;
      }
      table_offset = *offset;
      allocated_table_entries = w.table.size();
    }
  } while (w.allocated);

  if (st.ok()) {
    w.table_index = 0;
    st = co_await WalkRefcounts(w, /*write=*/true, walk_index, walk_index + 1,
                                progress);
  }
  if (st.ok()) {
    io::AlignedBuffer table(w.table.size() * 8);
    for (uint64_t i = 0; i < w.table.size(); ++i) {
      StoreBE64(table.data() + i * 8, w.table[i]);
    }
    st = co_await WriteMetadata(table_offset, table.span(), 0);
  }
  if (st.ok()) st = co_await refcounts_->WriteDirty();
  if (st.ok()) st = co_await SyncFile();
  const format::Header old_header = header_;
  if (st.ok()) {
    // The switch: one header write names the new width and table.
    header_.refcount_order = refcount_order;
    header_.refcount_table_offset = table_offset;
    header_.refcount_table_clusters =
        static_cast<uint32_t>((w.table.size() * 8) >> cluster_bits_);
    st = co_await WriteHeader();
    if (!st.ok()) header_ = old_header;
  }
  // What is freed: on success the old blocks and table (counted in the new
  // refcounts), else the new ones (in the old refcounts).
  std::vector<uint64_t> blocks;
  uint64_t free_table_offset = 0;
  uint64_t free_table_bytes = 0;
  if (st.ok()) {
    blocks = refcounts_->table();
    free_table_offset = refcounts_->table_offset();
    free_table_bytes = refcounts_->table_bytes();
    auto fresh = std::make_unique<Refcounts>(
        static_cast<MetadataIo&>(*this), cluster_bits_, refcount_order,
        table_offset, header_.refcount_table_clusters, std::move(w.table),
        config_.refcount_cache_tables);
    fresh->TakeHintsFrom(*refcounts_);
    refcounts_ = std::move(fresh);
  } else {
    blocks = std::move(w.table);
    free_table_offset = table_offset;
    free_table_bytes = blocks.size() * 8;
  }
  for (const uint64_t block : blocks) {
    if (block != 0) (void)co_await refcounts_->Free(block, cluster_size_);
  }
  if (free_table_offset != 0) {
    (void)co_await refcounts_->Free(free_table_offset, free_table_bytes);
  }
  co_return st;
}

io::Task<absl::Status> Qcow2Node::Amend(AmendOptions o) {
  if (read_only()) {
    co_return absl::FailedPreconditionError(
        absl::StrFormat("%s: image is read-only", filename()));
  }
  std::optional<AmendProgress> progress;
  {
    auto lock = co_await io::ScopedLock::Take(meta_lock_);
    CO_RETURN_IF_ERROR(CheckUsable());
    const uint32_t old_version = header_.version;
    const uint32_t new_version = o.version.value_or(old_version);

    const bool refcount_change = o.refcount_bits.has_value() &&
                                 *o.refcount_bits != header_.refcount_bits();
    progress.emplace(o.progress, int64_t{new_version != old_version} +
                                     int64_t{refcount_change});

    // Upgrade first: later steps may need version 3.
    if (new_version > old_version) {
      const auto upgrade_progress = progress->For(1);
      if (upgrade_progress) upgrade_progress(0, 2);
      if (snapshot_extra_too_short_) {
        // Version 3 needs every snapshot's 64-bit VM state size and disk
        // size: the table is written anew with them.
        uint64_t table_bytes = 0;
        CO_ASSIGN_OR_RETURN(std::vector<SnapshotRecord> records,
                            co_await ReadSnapshotRecords(&table_bytes));
        CO_RETURN_IF_ERROR(co_await RewriteSnapshotTable(records, table_bytes));
      }
      if (upgrade_progress) upgrade_progress(1, 2);
      header_.version = 3;
      header_.refcount_order = format::kV2RefcountOrder;
      if (absl::Status st = co_await WriteHeader(); !st.ok()) {
        header_.version = old_version;
        co_return st;
      }
      if (upgrade_progress) upgrade_progress(2, 2);
    }

    if (refcount_change) {
      if (new_version < 3 && *o.refcount_bits != 16) {
        co_return absl::InvalidArgumentError(
            "Refcount widths other than 16 bits require compatibility level "
            "1.1 or above (use compat=1.1 or greater)");
      }
      CO_RETURN_IF_ERROR(co_await ChangeRefcountOrder(
          static_cast<uint32_t>(absl::countr_zero(*o.refcount_bits)),
          progress->For(2)));
    }

    // No external data file: its raw bit never stays.
    header_.autoclear_features &= ~format::kAutoclearDataFileRaw;
    CO_RETURN_IF_ERROR(co_await WriteHeader());

    if (o.backing_file.has_value() || o.backing_format.has_value()) {
      if (o.backing_file != header_.backing_file ||
          o.backing_format != header_.backing_format) {
        co_return absl::InvalidArgumentError(
            "Cannot amend the backing file\n"
            "You can use 'imgtool rebase' instead.");
      }
    }

    if (o.lazy_refcounts.has_value() &&
        *o.lazy_refcounts != config_.lazy_refcounts) {
      if (*o.lazy_refcounts) {
        if (new_version < 3) {
          co_return absl::InvalidArgumentError(
              "Lazy refcounts only supported with compatibility level 1.1 "
              "and above (use compat=1.1 or greater)");
        }
        header_.compatible_features |= format::kCompatibleLazyRefcounts;
        if (absl::Status st = co_await WriteHeader(); !st.ok()) {
          header_.compatible_features &= ~format::kCompatibleLazyRefcounts;
          co_return st;
        }
        config_.lazy_refcounts = true;
      } else {
        CO_RETURN_IF_ERROR(co_await MarkClean());
        header_.compatible_features &= ~format::kCompatibleLazyRefcounts;
        if (absl::Status st = co_await WriteHeader(); !st.ok()) {
          header_.compatible_features |= format::kCompatibleLazyRefcounts;
          co_return st;
        }
        config_.lazy_refcounts = false;
      }
    }
  }

  if (o.size != 0) {
    CO_RETURN_IF_ERROR(co_await Truncate(o.size, io::PreallocMode::kOff));
  }

  // Downgrade last, once nothing needs version 3 any more.
  if (o.version.has_value() && *o.version < header_.version) {
    auto lock = co_await io::ScopedLock::Take(meta_lock_);
    CO_RETURN_IF_ERROR(CheckUsable());
    if (header_.refcount_order != format::kV2RefcountOrder) {
      co_return absl::FailedPreconditionError(
          "compat=0.10 requires refcount_bits=16");
    }
    // Snapshots another size than the image, or with a VM state too
    // large for version 2's field, would lose that to version 2 readers.
    std::vector<SnapshotRecord> snapshots;
    if (header_.nb_snapshots > 0) {
      uint64_t table_bytes = 0;
      CO_ASSIGN_OR_RETURN(snapshots, co_await ReadSnapshotRecords(&table_bytes));
      for (const SnapshotRecord& sn : snapshots) {
        if (sn.vm_state_size > 0xffffffffu || sn.disk_size != header_.size) {
          co_return absl::FailedPreconditionError(
              "Internal snapshots prevent downgrade of image");
        }
      }
    }
    CO_RETURN_IF_ERROR(co_await MarkClean());
    const uint64_t incompatible =
        header_.incompatible_features & ~format::kIncompatibleCompressionType;
    if (incompatible != 0) {
      co_return absl::FailedPreconditionError(absl::StrFormat(
          "Cannot downgrade an image with incompatible features %#x set",
          incompatible));
    }
    header_.compatible_features = 0;
    config_.lazy_refcounts = false;
    header_.autoclear_features = 0;
    CO_RETURN_IF_ERROR(co_await ExpandZeroClusters(snapshots, progress->For(3)));
    if (header_.incompatible_features & format::kIncompatibleCompressionType) {
      // Version 2 has zlib only: fine while no cluster is compressed.
      for (uint64_t i = 0; i < l1_.size(); ++i) {
        if ((l1_[i] & format::kL1OffsetMask) == 0) continue;
        CO_ASSIGN_OR_RETURN(TableCache::Ref l2, co_await LoadL2(i));
        for (uint64_t j = 0; j < l2_entries_; ++j) {
          CO_ASSIGN_OR_RETURN(const ClusterType type,
                              co_await Classify(GetEntry(l2, j), l2.offset(), j));
          if (type == ClusterType::kCompressed) {
            co_return absl::FailedPreconditionError(
                "Cannot downgrade an image with zstd compression type and "
                "existing compressed clusters");
          }
        }
      }
      header_.incompatible_features &= ~format::kIncompatibleCompressionType;
      header_.compression_type = format::kCompressionZlib;
    }
    // The expanded L2 tables are durable before a version 2 header makes
    // their zero flags invalid.
    CO_RETURN_IF_ERROR(co_await FlushAll());
    const uint32_t current = header_.version;
    header_.version = 2;
    if (absl::Status st = co_await WriteHeader(); !st.ok()) {
      header_.version = current;
      co_return st;
    }
  }
  co_return absl::OkStatus();
}

}  // namespace imgtool::qcow2

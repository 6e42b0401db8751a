// Qcow2Node's internal snapshots (qcow2 spec, "Snapshots"): create, goto
// (apply), delete and the read-only view `convert -l` uses, in the steps of
// QEMU 7.2's block/qcow2-snapshot.c and qcow2_update_snapshot_refcount, so
// that the resulting files are qemu-img's.
#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <utility>
#include <vector>

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

using format::L2Entry;

namespace {

constexpr uint32_t kMaxSnapshots = 65536;        // QCOW_MAX_SNAPSHOTS
constexpr uint64_t kMaxL1Bytes = uint64_t{32} << 20;  // QCOW_MAX_L1_SIZE

// A status with QEMU's errno, for callers that print "-27 (File too large)".
absl::Status Errno(int e, absl::string_view message) {
  return WithMessage(ErrnoStatus("", message, e), message);
}

// The errno a driver error stands for in QEMU (EIO unless it carries one).
int ErrnoOf(const absl::Status& st) {
  const int e = StatusErrno(st);
  if (e != 0) return e;
  switch (st.code()) {
    case absl::StatusCode::kResourceExhausted: return EFBIG;
    case absl::StatusCode::kInvalidArgument: return EINVAL;
    case absl::StatusCode::kNotFound: return ENOENT;
    default: return EIO;
  }
}

}  // namespace

io::Task<absl::StatusOr<std::vector<Qcow2Node::SnapshotRecord>>>
Qcow2Node::Snapshots() {
  // As bdrv_snapshot_list hands them out: C strings (up to the first NUL)
  // in QEMUSnapshotInfo's id_str[128] and name[256], so ids are cut to 127
  // bytes and names to 255.
  std::vector<SnapshotRecord> records = snapshot_records_;
  auto cut = [](std::string& s, size_t max) {
    s.resize(std::min({s.size(), s.find('\0'), max}));
  };
  for (SnapshotRecord& r : records) {
    cut(r.id, 127);
    cut(r.name, 255);
  }
  co_return records;
}

int Qcow2Node::FindSnapshot(const std::vector<SnapshotRecord>& snapshots,
                            const std::string& key, bool by_id) {
  for (size_t i = 0; i < snapshots.size(); ++i) {
    if ((by_id ? snapshots[i].id : snapshots[i].name) == key) {
      return static_cast<int>(i);
    }
  }
  return -1;
}

absl::Status Qcow2Node::ValidateSnapshotL1(const SnapshotRecord& sn) const {
  if (uint64_t{sn.l1_size} > kMaxL1Bytes / 8) {
    return Errno(EFBIG, "Snapshot L1 table too large");
  }
  const uint64_t bytes = uint64_t{sn.l1_size} * 8;
  if (uint64_t{INT64_MAX} - bytes < sn.l1_offset ||
      (sn.l1_offset & (cluster_size_ - 1)) != 0) {
    return Errno(EINVAL, "Snapshot L1 table offset invalid");
  }
  return absl::OkStatus();
}

io::Task<absl::StatusOr<bool>> Qcow2Node::BeginSnapshotUpdate() {
  CO_RETURN_IF_ERROR(CheckUsable());
  if (header_.version < 3 || header_.dirty()) co_return false;
  // Everything cached so far reaches the disk with the image still clean.
  CO_RETURN_IF_ERROR(co_await FlushAll());
  header_.incompatible_features |= format::kIncompatibleDirty;
  CO_RETURN_IF_ERROR(co_await WriteIncompatibleFeatures());
  co_return true;
}

io::Task<absl::Status> Qcow2Node::EndSnapshotUpdate(bool set_dirty) {
  CO_RETURN_IF_ERROR(co_await FlushAll());
  // Create clears the bit in its header write already.
  if (!set_dirty || !header_.dirty()) co_return absl::OkStatus();
  header_.incompatible_features &= ~format::kIncompatibleDirty;
  co_return co_await WriteIncompatibleFeatures();
}

io::Task<absl::Status> Qcow2Node::UpdateSnapshotRefcount(
    std::vector<uint64_t>& l1, bool active, uint64_t l1_offset, int addend,
    bool sync) {
  const bool decrease = addend < 0;
  const uint64_t max_refcount = format::MaxRefcount(header_.refcount_order);
  std::vector<uint64_t> freed;  // clusters whose refcount dropped to 0
  bool l1_modified = false;
  // Adds the addend to the refcounts of the clusters of [offset, +length);
  // an increase past the maximum is QEMU's EINVAL (no corruption event).
  auto update = [&](uint64_t offset, uint64_t length) -> io::Task<absl::Status> {
    const uint64_t first = offset & ~(cluster_size_ - 1);
    if (!decrease) {
      for (uint64_t c = first; c < offset + length; c += cluster_size_) {
        CO_ASSIGN_OR_RETURN(const uint64_t rc,
                            co_await refcounts_->Get(c >> cluster_bits_));
        if (rc >= max_refcount) {
          co_return Errno(EINVAL, "Invalid argument");
        }
      }
    }
    CO_RETURN_IF_ERROR(co_await refcounts_->Update(offset, length, 1, decrease));
    if (decrease) {
      for (uint64_t c = first; c < offset + length; c += cluster_size_) {
        CO_ASSIGN_OR_RETURN(const uint64_t rc,
                            co_await refcounts_->Get(c >> cluster_bits_));
        if (rc == 0) freed.push_back(c);
      }
    }
    co_return absl::OkStatus();
  };
  absl::Status st = co_await [&]() -> io::Task<absl::Status> {
    for (uint64_t i = 0; i < l1.size(); ++i) {
      const uint64_t old_l1 = l1[i];
      const uint64_t l2_offset = old_l1 & format::kL1OffsetMask;
      if (l2_offset == 0) continue;
      if ((l2_offset & (cluster_size_ - 1)) != 0) {
        co_return co_await SignalCorruption(absl::StrFormat(
            "L2 table offset %#x unaligned (L1 index: %#x)", l2_offset, i));
      }
      {
        CO_ASSIGN_OR_RETURN(TableCache::Ref l2, co_await l2_cache_->Get(l2_offset));
        for (uint64_t j = 0; j < l2_entries_; ++j) {
          const L2Entry old = GetEntry(l2, j);
          L2Entry e = old;
          e.word &= ~format::kCopiedFlag;
          uint64_t refcount = 0;
          const auto [host, length] = HostBytesOf(e);
          if (e.compressed()) {
            if (addend != 0) CO_RETURN_IF_ERROR(co_await update(host, length));
            refcount = 2;  // compressed clusters are never written in place
          } else if (length != 0) {
            if ((host & (cluster_size_ - 1)) != 0) {
              co_return co_await SignalCorruption(absl::StrFormat(
                  "Cluster allocation offset %#x unaligned (L2 offset: %#x, "
                  "L2 index: %#x)",
                  host, l2_offset, j));
            }
            // Most clusters: the block is cached and the refcount stays
            // within 1..max, done without a coroutine call (the same change
            // as update + Get; the rest, e.g. an overflow or a drop to 0,
            // goes the general way).
            const uint64_t index = host >> cluster_bits_;
            const bool done =
                length == cluster_size_ &&
                (addend == 0
                     ? refcounts_->PeekRefcount(index, &refcount)
                     : refcounts_->TryAdjustCached(index, decrease, &refcount));
            if (!done) {
              if (addend != 0) CO_RETURN_IF_ERROR(co_await update(host, length));
              CO_ASSIGN_OR_RETURN(refcount, co_await refcounts_->Get(index));
            }
          }
          if (refcount == 1) e.word |= format::kCopiedFlag;
          if (!(e == old)) SetEntry(l2, j, e);
        }
      }
      if (addend != 0) CO_RETURN_IF_ERROR(co_await update(l2_offset, cluster_size_));
      CO_ASSIGN_OR_RETURN(const uint64_t refcount,
                          co_await refcounts_->Get(l2_offset >> cluster_bits_));
      const uint64_t new_l1 = l2_offset | (refcount == 1 ? format::kCopiedFlag : 0);
      if (new_l1 != old_l1) {
        l1[i] = new_l1;
        l1_modified = true;
      }
    }
    // The L2 tables and refcounts (QEMU's bdrv_flush).
    if (!sync) co_return absl::OkStatus();
    co_return co_await FlushAll();
  }();
  // Freed clusters are punched (pass-discard-snapshot), adjacent ones in
  // one request, as QEMU's qcow2_process_discards.
  std::sort(freed.begin(), freed.end());
  for (size_t k = 0; k < freed.size();) {
    const uint64_t start = freed[k];
    uint64_t end = start + cluster_size_;
    for (++k; k < freed.size() && freed[k] <= end; ++k) {
      end = std::max(end, freed[k] + cluster_size_);
    }
    absl::StatusOr<uint64_t> rc = co_await refcounts_->Get(start >> cluster_bits_);
    if (rc.ok() && *rc == 0) (void)co_await file_->Discard(start, end - start);
  }
  CO_RETURN_IF_ERROR(st);
  if (addend >= 0 && l1_modified && !l1.empty()) {
    io::AlignedBuffer bytes(l1.size() * 8);
    for (uint64_t i = 0; i < l1.size(); ++i) {
      StoreBE64(bytes.data() + i * 8, l1[i]);
    }
    const uint64_t at = active ? header_.l1_table_offset : l1_offset;
    CO_RETURN_IF_ERROR(co_await WriteMetadata(
        at, bytes.span(), active ? kOverlapActiveL1 : kOverlapInactiveL1));
    if (sync) CO_RETURN_IF_ERROR(co_await SyncFile());
  }
  co_return absl::OkStatus();
}

io::Task<absl::Status> Qcow2Node::CreateSnapshot(const std::string& name,
                                                 uint32_t date_sec,
                                                 uint32_t date_nsec) {
  if (read_only()) {
    co_return absl::FailedPreconditionError(
        absl::StrCat(filename(), ": the image is read-only"));
  }
  auto lock = co_await io::ScopedLock::Take(meta_lock_);
  CO_RETURN_IF_ERROR(CheckUsable());
  if (header_.nb_snapshots >= kMaxSnapshots) {
    co_return Errno(EFBIG, "File too large");
  }
  uint64_t table_bytes = 0;
  CO_ASSIGN_OR_RETURN(std::vector<SnapshotRecord> records,
                      co_await ReadSnapshotRecords(&table_bytes));
  // find_new_snapshot_id: one more than the largest numeric id.
  uint64_t id_max = 0;
  for (const SnapshotRecord& r : records) {
    const uint64_t id = std::strtoul(r.id.c_str(), nullptr, 10);
    id_max = std::max(id_max, id);
  }
  SnapshotRecord sn;
  sn.id = absl::StrCat(id_max + 1);
  sn.name = name;
  sn.disk_size = header_.size / 512 * 512;
  sn.date_sec = date_sec;
  sn.date_nsec = date_nsec;
  sn.icount = 0;
  sn.extra_data_size = format::kSnapshotExtraKnownBytes;
  sn.l1_size = static_cast<uint32_t>(l1_.size());

  // The order (3 fdatasyncs with no old table, 4 with one; QEMU 7.2 makes
  // 6, without a dirty bit):
  //  1. the dirty bit set, synced: the refcounts and COPIED flags may
  //     disagree from here on (version 3; version 2 has no bit);
  //  2. the L1 copy, the refcount increments, the L2 tables' and the active
  //     L1's COPIED flags and the new snapshot table, unsynced in any
  //     order, then one flush (RewriteSnapshotTable's FlushAll): nothing
  //     refers to the copy or the table yet, and the refcounts only grow
  //     (leaks), so any subset of these on disk is the old image, dirty;
  //  3. the header's snapshot count and table offset with the dirty bit
  //     cleared, one 20-byte write, synced: the new image, clean;
  //  4. the old table freed (a leak until its refcount block is flushed).
  // snapshot_crash_test crashes at every change and with the changes of
  // each flush epoch reordered.
  CO_ASSIGN_OR_RETURN(const bool set_dirty, co_await BeginSnapshotUpdate());
  absl::Status st = co_await [&]() -> io::Task<absl::Status> {
    const uint64_t l1_bytes = l1_.size() * 8;
    CO_ASSIGN_OR_RETURN(sn.l1_offset, co_await refcounts_->Allocate(l1_bytes));
    if (l1_bytes > 0) {
      // The copy keeps the active table's flags, as QEMU's does.
      io::AlignedBuffer bytes(l1_bytes);
      for (uint64_t i = 0; i < l1_.size(); ++i) {
        StoreBE64(bytes.data() + i * 8, l1_[i]);
      }
      // No flush first (as QEMU's qcow2_snapshot_create): until the header
      // names the new table nothing refers to these clusters.
      CO_RETURN_IF_ERROR(co_await WriteMetadata(sn.l1_offset, bytes.span(), 0));
    }
    CO_RETURN_IF_ERROR(co_await UpdateSnapshotRefcount(
        l1_, /*active=*/true, 0, 1, /*sync=*/false));
    records.push_back(sn);
    std::optional<uint64_t> features;
    if (set_dirty) {
      features = header_.incompatible_features & ~format::kIncompatibleDirty;
    }
    co_return co_await RewriteSnapshotTable(records, table_bytes, features);
  }();
  if (!st.ok()) {
    // As QEMU, what was done stays (a leaked L1 copy); the image is left
    // clean if it can be.
    if (broken_.ok()) (void)co_await EndSnapshotUpdate(set_dirty);
    co_return Errno(ErrnoOf(st), st.message());
  }
  co_return co_await EndSnapshotUpdate(set_dirty);
}

io::Task<absl::Status> Qcow2Node::GotoSnapshot(const std::string& id_or_name,
                                               std::string* report) {
  if (read_only()) {
    co_return absl::FailedPreconditionError(
        absl::StrCat(filename(), ": the image is read-only"));
  }
  SnapshotRecord sn;
  {
    auto lock = co_await io::ScopedLock::Take(meta_lock_);
    CO_RETURN_IF_ERROR(CheckUsable());
    uint64_t table_bytes = 0;
    CO_ASSIGN_OR_RETURN(std::vector<SnapshotRecord> records,
                        co_await ReadSnapshotRecords(&table_bytes));
    int index = FindSnapshot(records, id_or_name, /*by_id=*/true);
    if (index < 0) index = FindSnapshot(records, id_or_name, /*by_id=*/false);
    if (index < 0) co_return Errno(ENOENT, "No such file or directory");
    sn = records[index];
    if (absl::Status v = ValidateSnapshotL1(sn); !v.ok()) {
      *report = std::string(v.message());
      co_return v;
    }
  }
  if (sn.disk_size != header_.size / 512 * 512) {
    absl::Status resized = co_await Truncate(sn.disk_size, io::PreallocMode::kOff);
    if (!resized.ok()) {
      *report = std::string(resized.message());
      co_return resized;
    }
  }
  auto lock = co_await io::ScopedLock::Take(meta_lock_);
  CO_ASSIGN_OR_RETURN(const bool set_dirty, co_await BeginSnapshotUpdate());
  CO_RETURN_IF_ERROR(co_await GrowL1(sn.l1_size, /*exact=*/true));
  std::vector<uint64_t> sn_l1(sn.l1_size, 0);
  if (sn.l1_size > 0) {
    io::AlignedBuffer bytes(uint64_t{sn.l1_size} * 8);
    CO_RETURN_IF_ERROR(co_await file_->Read(sn.l1_offset, bytes.span()));
    for (uint64_t i = 0; i < sn_l1.size(); ++i) {
      sn_l1[i] = LoadBE64(bytes.data() + i * 8);
    }
  }
  // The new active table: the snapshot's entries as read, zero padded.
  std::vector<uint64_t> new_active = sn_l1;
  new_active.resize(l1_.size(), 0);
  CO_RETURN_IF_ERROR(co_await UpdateSnapshotRefcount(sn_l1, /*active=*/false,
                                                     sn.l1_offset, 1));
  {
    io::AlignedBuffer bytes(l1_.size() * 8);
    for (uint64_t i = 0; i < new_active.size(); ++i) {
      StoreBE64(bytes.data() + i * 8, new_active[i]);
    }
    if (!new_active.empty()) {
      CO_RETURN_IF_ERROR(co_await WriteMetadata(
          header_.l1_table_offset, bytes.span(), kOverlapActiveL1));
      CO_RETURN_IF_ERROR(co_await SyncFile());
    }
  }
  // The old active state's references go; the in-memory table is still the
  // old one here, as in QEMU.
  absl::Status dropped =
      co_await UpdateSnapshotRefcount(l1_, /*active=*/true, 0, -1);
  l1_ = std::move(new_active);
  l2_offsets_.clear();
  for (uint64_t e : l1_) {
    if ((e & format::kL1OffsetMask) != 0) l2_offsets_.insert(e & format::kL1OffsetMask);
  }
  CO_RETURN_IF_ERROR(dropped);
  CO_RETURN_IF_ERROR(co_await UpdateSnapshotRefcount(l1_, /*active=*/true, 0, 0));
  co_return co_await EndSnapshotUpdate(set_dirty);
}

io::Task<absl::Status> Qcow2Node::DeleteSnapshot(size_t index) {
  if (read_only()) {
    co_return absl::FailedPreconditionError(
        absl::StrCat(filename(), ": the image is read-only"));
  }
  auto lock = co_await io::ScopedLock::Take(meta_lock_);
  CO_RETURN_IF_ERROR(CheckUsable());
  uint64_t table_bytes = 0;
  CO_ASSIGN_OR_RETURN(std::vector<SnapshotRecord> records,
                      co_await ReadSnapshotRecords(&table_bytes));
  if (index >= records.size()) {
    co_return Errno(ENOENT, "Can't find the snapshot");
  }
  const SnapshotRecord sn = records[index];
  CO_RETURN_IF_ERROR(ValidateSnapshotL1(sn));
  // The order (4 fdatasyncs, 3 when no table is left; QEMU 7.2 makes 6,
  // without a dirty bit):
  //  1. the new snapshot table, synced (no sync when it is empty);
  //  2. the header's snapshot count and table offset with the dirty bit set
  //     (version 3, not set before), one 20-byte write, synced: the
  //     snapshot is gone, its clusters leaked, the image still consistent;
  //  3. the old table and the snapshot's L1 copy freed, the refcount
  //     decrements, the COPIED flags set where a refcount dropped to 1 (L2
  //     tables and the active L1), freed clusters punched, unsynced in any
  //     order (refcounts and COPIED flags may disagree: dirty; nothing
  //     refers to a freed cluster), then one flush;
  //  4. the dirty bit cleared, synced.
  // snapshot_crash_test crashes at every change and with the changes of
  // each flush epoch reordered.
  CO_RETURN_IF_ERROR(co_await FlushAll());
  const bool set_dirty = header_.version >= 3 && !header_.dirty();
  std::optional<uint64_t> features;
  if (set_dirty) {
    features = header_.incompatible_features | format::kIncompatibleDirty;
  }
  records.erase(records.begin() + index);
  auto failed = [](absl::string_view what, const absl::Status& st) {
    const int e = ErrnoOf(st);
    return Errno(e, absl::StrCat(what, ": ", std::strerror(e)));
  };
  if (absl::Status st =
          co_await RewriteSnapshotTable(records, table_bytes, features);
      !st.ok()) {
    co_return failed("Failed to remove snapshot from snapshot list", st);
  }
  // From here on a failure only leaks clusters.
  std::vector<uint64_t> l1(sn.l1_size, 0);
  absl::Status st;
  if (sn.l1_size > 0) {
    io::AlignedBuffer bytes(uint64_t{sn.l1_size} * 8);
    st = co_await file_->Read(sn.l1_offset, bytes.span());
    for (uint64_t i = 0; st.ok() && i < l1.size(); ++i) {
      l1[i] = LoadBE64(bytes.data() + i * 8);
    }
  }
  if (st.ok()) {
    st = co_await UpdateSnapshotRefcount(l1, /*active=*/false, sn.l1_offset,
                                         -1, /*sync=*/false);
  }
  if (!st.ok()) co_return failed("Failed to free the cluster and L1 table", st);
  if (sn.l1_size > 0) {
    const uint64_t bytes = uint64_t{sn.l1_size} * 8;
    // QEMU ignores this free's result (qcow2_free_clusters prints it).
    const absl::Status freed = co_await FreeClustersAsQemu(
        *refcounts_, cluster_bits_, header_.refcount_order, sn.l1_offset,
        bytes);
    if (!freed.ok()) {
      diagnostics_.push_back(
          {false, absl::StrCat("qcow2_free_clusters failed: ",
                               std::strerror(FreeErrno(freed)))});
    }
    for (uint64_t c = sn.l1_offset; freed.ok() && c < sn.l1_offset + bytes;
         c += cluster_size_) {
      CO_ASSIGN_OR_RETURN(const uint64_t rc,
                          co_await refcounts_->Get(c >> cluster_bits_));
      if (rc == 0) (void)co_await file_->Discard(c, cluster_size_);
    }
  }
  st = co_await UpdateSnapshotRefcount(l1_, /*active=*/true, 0, 0,
                                       /*sync=*/false);
  if (!st.ok()) co_return failed("Failed to update snapshot status in disk", st);
  co_return co_await EndSnapshotUpdate(set_dirty);
}

io::Task<absl::Status> Qcow2Node::LoadSnapshotReadOnly(
    std::optional<std::string> id, std::optional<std::string> name) {
  if (!read_only()) {
    co_return absl::FailedPreconditionError("Device is not readonly");
  }
  auto lock = co_await io::ScopedLock::Take(meta_lock_);
  CO_RETURN_IF_ERROR(CheckUsable());
  uint64_t table_bytes = 0;
  CO_ASSIGN_OR_RETURN(std::vector<SnapshotRecord> records,
                      co_await ReadSnapshotRecords(&table_bytes));
  int index = -1;
  for (size_t i = 0; i < records.size() && index < 0; ++i) {
    if ((!id.has_value() || records[i].id == *id) &&
        (!name.has_value() || records[i].name == *name)) {
      index = static_cast<int>(i);
    }
  }
  if (!id.has_value() && !name.has_value()) {
    co_return Errno(EINVAL, "snapshot_id and name are both NULL");
  }
  if (index < 0) {
    co_return Errno(ENOENT, "Can't find snapshot");
  }
  const SnapshotRecord& sn = records[index];
  CO_RETURN_IF_ERROR(ValidateSnapshotL1(sn));
  std::vector<uint64_t> l1(sn.l1_size, 0);
  if (sn.l1_size > 0) {
    io::AlignedBuffer bytes(uint64_t{sn.l1_size} * 8);
    absl::Status st = co_await file_->Read(sn.l1_offset, bytes.span());
    if (!st.ok()) {
      co_return WithMessage(st, "Failed to read l1 table for snapshot");
    }
    for (uint64_t i = 0; i < l1.size(); ++i) l1[i] = LoadBE64(bytes.data() + i * 8);
  }
  l1_ = std::move(l1);
  l2_offsets_.clear();
  for (uint64_t e : l1_) {
    if ((e & format::kL1OffsetMask) != 0) l2_offsets_.insert(e & format::kL1OffsetMask);
  }
  co_return absl::OkStatus();
}

}  // namespace imgtool::qcow2

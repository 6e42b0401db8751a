// Qcow2Node: cluster mapping, reads, writes, write zeroes, discard and block
// status.
#include <algorithm>
#include <cstring>
#include <memory>
#include <utility>
#include <vector>

#include "absl/numeric/bits.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/status_macros.h"
#include "io/aligned_buffer.h"
#include "io/chain_status.h"
#include "qcow2/compress.h"
#include "qcow2/qcow2_node.h"

namespace imgtool::qcow2 {
namespace {

using format::ClusterType;
using format::L2Entry;


// Copy-on-write reads of a head and a tail separated by at most this many
// bytes are merged into one read (QEMU 7.2's limit in handle_copied /
// do_perform_cow, subclusters.md §2).
constexpr uint64_t kCowMergeGap = uint64_t{16} << 10;

// Zeroes for explicit zero writes (at most one 2 MiB cluster at a time),
// aligned so that O_DIRECT files take them without a bounce buffer.
io::ConstIoVec Zeroes(uint64_t length) {
  static const io::AlignedBuffer* zeroes =
      new io::AlignedBuffer(format::kMaxClusterSize);
  return io::ConstIoVec(zeroes->data(),
                        std::min<uint64_t>(length, zeroes->size()));
}

bool IsAllocated(ClusterType t) {
  return t == ClusterType::kNormal || t == ClusterType::kZeroAlloc ||
         t == ClusterType::kCompressed;
}

// Runs a write's data I/O `task` with `lock` released, keeping the order in
// which the writes took the lock: the task starts first and runs until it
// first suspends (its request is queued to the engine), only then is the
// lock released. Releasing first resumes the next waiter for the lock
// inline, which queued its request before ours, so 64 concurrent writes
// reached the file in reverse order per batch; ext4 and XFS hand sub-block
// O_DIRECT writes (a 1 KiB offset) to io_uring's workers, which run them in
// that order, as unwritten-extent conversions and holes out of sequence
// (QEMU's Linux AIO submits them in the order they were allocated).
// StartThen(task, started) runs `started()` at that point instead.
template <typename F>
io::Task<absl::Status> StartThen(io::Task<absl::Status> task, F started) {
  struct Result {
    absl::Status status;
    io::Event done;
  };
  auto result = std::make_shared<Result>();
  io::Spawn(std::move(task), [result](absl::Status st) {
    result->status = std::move(st);
    result->done.Set();
  });
  started();
  co_await result->done.Wait();
  co_return std::move(result->status);
}

io::Task<absl::Status> StartThenUnlock(io::ScopedLock& lock,
                                       io::Task<absl::Status> task) {
  co_return co_await StartThen(std::move(task), [&lock] { lock.Release(); });
}

}  // namespace

// ---- L1/L2 access -----------------------------------------------------------

format::L2Entry Qcow2Node::GetEntry(const TableCache::Ref& l2,
                                    uint64_t index) const {
  return format::LoadL2Entry(l2.data(), index, l2_format_.extended_l2);
}

void Qcow2Node::SetEntry(TableCache::Ref& l2, uint64_t index,
                         const format::L2Entry& e) {
  format::StoreL2Entry(l2.data(), index, l2_format_.extended_l2, e);
  l2_cache_->MarkDirty(l2);
}

io::Task<absl::StatusOr<TableCache::Ref>> Qcow2Node::LoadL2(uint64_t index) {
  const uint64_t l2 = l1_[index] & format::kL1OffsetMask;
  if ((l2 & (cluster_size_ - 1)) != 0) {
    co_return co_await SignalCorruption(absl::StrFormat(
        "L2 table offset %#x unaligned (L1 index: %#x)", l2, index));
  }
  if (l2 >= FileSize()) {
    co_return co_await SignalCorruption(absl::StrFormat(
        "L2 table offset %#x beyond the end of the image file (L1 index: %#x)",
        l2, index));
  }
  co_return co_await l2_cache_->Get(l2);
}

io::Task<absl::StatusOr<TableCache::Ref>> Qcow2Node::GetL2ForWrite(
    uint64_t index) {
  if (index >= l1_.size()) {
    co_return absl::InternalError(absl::StrFormat(
        "%s: L1 index %u beyond the L1 table", filename(), index));
  }
  const uint64_t raw = l1_[index];
  const uint64_t old = raw & format::kL1OffsetMask;
  if (old != 0 && (raw & format::kCopiedFlag) != 0) {
    co_return co_await LoadL2(index);
  }
  // A new table, or a private copy of a shared one (refcount > 1), in
  // QEMU 7.2's order (l2_allocate, then get_cluster_table frees the old
  // table): allocate, write the refcounts, fill the table (l2_alloc_cow_read
  // before reading the old one), l2_alloc_write, write the table, then the
  // L1 entry. On failure after the allocation the L1 entry is restored and
  // the new cluster freed, as l2_allocate's fail path does.
  CO_ASSIGN_OR_RETURN(const uint64_t table, co_await refcounts_->Allocate(cluster_size_));
  if (table == 0) {
    co_return co_await SignalCorruption(
        "Preventing invalid allocation of L2 table at offset 0");
  }
  TableCache::Ref ref;
  absl::Status st = co_await [&]() -> io::Task<absl::Status> {
    // Its refcount goes to disk before anything uses the cluster.
    CO_RETURN_IF_ERROR(co_await refcounts_->WriteDirty());
    CO_RETURN_IF_ERROR(co_await SyncFile());
    CO_ASSIGN_OR_RETURN(ref, co_await l2_cache_->GetEmpty(table));
    if (old != 0) {
      co_await file_->DebugEvent(io::BlkdebugEvent::kL2AllocCowRead);
      CO_ASSIGN_OR_RETURN(TableCache::Ref old_table, co_await LoadL2(index));
      std::memcpy(ref.data().data(), old_table.data().data(), cluster_size_);
    }
    co_await file_->DebugEvent(io::BlkdebugEvent::kL2AllocWrite);
    // QEMU's l2_allocate flushes the whole L2 cache here, not just the new
    // table: the tables earlier requests linked reach the disk with it (a
    // later failure, e.g. at reftable_grow, leaves them mapped, not leaked).
    CO_RETURN_IF_ERROR(co_await l2_cache_->WriteDirty());
    CO_RETURN_IF_ERROR(co_await SyncFile());
    l1_[index] = table | format::kCopiedFlag;
    co_return co_await WriteL1Entry(index);
  }();
  if (!st.ok()) {
    l1_[index] = raw;
    ref.reset();
    co_await GiveBackL2Table(table);
    co_return st;
  }
  l2_offsets_.insert(table);
  if (old != 0) {
    l2_offsets_.erase(old);
    // The L1 entry no longer points to it on disk; as QEMU, a failure to
    // free it only leaks the cluster.
    absl::Status freed = co_await refcounts_->Free(old, cluster_size_);
    (void)freed;
  }
  co_return ref;
}

io::Task<void> Qcow2Node::GiveBackL2Table(uint64_t table) {
  if (broken_.ok()) {
    // Freed with QCOW2_DISCARD_ALWAYS: the cluster is discarded in the
    // file once its refcount is 0.
    absl::Status undo = co_await refcounts_->Free(table, cluster_size_);
    absl::StatusOr<uint64_t> rc = co_await refcounts_->Get(table >> cluster_bits_);
    if (undo.ok() && rc.ok() && *rc == 0) {
      absl::Status d = co_await file_->Discard(table, cluster_size_);
      (void)d;
    }
  } else {
    // A write marked the image corrupt (say the L1 write overlaps the
    // snapshot table): QEMU's free still drops the refcount in its cache
    // (never written any more) and discards the cluster when that was its
    // only reference; ours stays as it is, the cluster is punched.
    absl::StatusOr<uint64_t> rc = co_await refcounts_->Get(table >> cluster_bits_);
    if (rc.ok() && *rc == 1) {
      absl::Status d = co_await file_->Discard(table, cluster_size_);
      (void)d;
    }
  }
}

bool Qcow2Node::ShouldAllocateL2Grouped(uint64_t index) const {
  if (index >= l1_.size() || (l1_[index] & format::kL1OffsetMask) != 0) {
    return false;
  }
  return guest_writes_ > 1 || pending_l2_.contains(index);
}

io::Task<absl::Status> Qcow2Node::AllocateL2Grouped(uint64_t index,
                                                    io::ScopedLock lock) {
  if (auto it = pending_l2_.find(index); it != pending_l2_.end()) {
    std::shared_ptr<PendingL2> other = it->second;
    lock.Release();
    co_await other->done.Wait();
    co_return absl::OkStatus();
  }
  CO_ASSIGN_OR_RETURN(const uint64_t table,
                      co_await refcounts_->Allocate(cluster_size_));
  if (table == 0) {
    co_return co_await SignalCorruption(
        "Preventing invalid allocation of L2 table at offset 0");
  }
  auto mine = std::make_shared<PendingL2>();
  mine->index = index;
  mine->table = table;
  pending_l2_[index] = mine;
  lock.Release();
  // The cluster is this write's alone: its (empty) contents are written
  // without the lock; SyncNewTables writes its refcount.
  co_await file_->DebugEvent(io::BlkdebugEvent::kL2AllocWrite);
  const io::AlignedBuffer zeroes(cluster_size_);
  absl::Status st = co_await WriteMetadata(table, zeroes.span(), kOverlapActiveL2);
  if (st.ok()) st = co_await SyncNewTables();
  mine->synced = st.ok();
  auto relock = co_await io::ScopedLock::Take(meta_lock_);
  if (mine->finished) co_return mine->status;  // linked with the others
  if (st.ok()) st = CheckUsable();
  if (st.ok()) co_return co_await LinkSyncedL2Tables(mine);
  co_return co_await DropPendingL2(mine, std::move(st));
}

io::Task<absl::Status> Qcow2Node::DropPendingL2(std::shared_ptr<PendingL2> p,
                                                absl::Status st) {
  pending_l2_.erase(p->index);
  co_await GiveBackL2Table(p->table);
  p->finished = true;
  p->status = st;
  p->done.Set();
  co_return st;
}

io::Task<absl::Status> Qcow2Node::LinkSyncedL2Tables(
    const std::shared_ptr<PendingL2>& mine) {
  // Every synced table, and whether its L1 entry is still free; one given a
  // table meanwhile by GetL2ForWrite (or cut off by a shrunk L1 table) is
  // given back.
  std::vector<std::shared_ptr<PendingL2>> group;
  std::vector<bool> linking;
  for (const auto& [index, p] : pending_l2_) {
    if (!p->synced) continue;
    const bool free =
        index < l1_.size() && (l1_[index] & format::kL1OffsetMask) == 0;
    if (free) l1_[index] = p->table | format::kCopiedFlag;
    group.push_back(p);
    linking.push_back(free);
  }
  absl::Status st;
  // The sectors in ascending order, each once (pending_l2_ is by index).
  constexpr uint64_t kPerSector = 512 / 8;
  uint64_t last_sector = UINT64_MAX;
  for (size_t i = 0; i < group.size() && st.ok(); ++i) {
    if (!linking[i] || group[i]->index / kPerSector == last_sector) continue;
    last_sector = group[i]->index / kPerSector;
    st = co_await WriteL1Sector(group[i]->index);
  }
  if (st.ok() && last_sector != UINT64_MAX) st = co_await SyncFile();
  for (size_t i = 0; i < group.size(); ++i) {
    PendingL2& p = *group[i];
    pending_l2_.erase(p.index);
    if (linking[i]) p.status = st;
    if (linking[i] && st.ok()) {
      l2_offsets_.insert(p.table);
      l2_cache_->PutZeroed(p.table);
      continue;
    }
    if (linking[i]) l1_[p.index] = 0;
    co_await GiveBackL2Table(p.table);
  }
  absl::Status result = mine->status;
  // Woken once all is settled: each looks at its L1 entry again.
  for (const std::shared_ptr<PendingL2>& p : group) {
    p->finished = true;
    p->done.Set();
  }
  co_return result;
}

namespace {

// The cluster type by the entry's bits alone (QEMU's qcow2_get_cluster_type).
// With extended L2 entries the zero flag is ignored: a cluster is normal
// (host cluster reserved) or unallocated, its subclusters say the rest.
ClusterType RawType(const L2Entry& e, bool extended) {
  if (e.compressed()) return ClusterType::kCompressed;
  const bool zero = !extended && (e.word & format::kZeroFlag) != 0;
  if (zero) {
    return e.host_offset() != 0 ? ClusterType::kZeroAlloc
                                : ClusterType::kZeroPlain;
  }
  return e.host_offset() != 0 ? ClusterType::kNormal : ClusterType::kUnallocated;
}

}  // namespace

io::Task<absl::Status> Qcow2Node::SignalInvalidBitmap(uint64_t l2_offset,
                                                      uint64_t index,
                                                      bool for_write) {
  co_return co_await SignalCorruption(absl::StrFormat(
      "Invalid cluster entry found %s(L2 offset: %#x, L2 index: %#x)",
      for_write ? "" : " ", l2_offset, index));
}

io::Task<absl::StatusOr<format::ClusterType>> Qcow2Node::Classify(
    const format::L2Entry& e, uint64_t l2_offset, uint64_t index,
    bool for_write) {
  const ClusterType type = RawType(e, l2_format_.extended_l2);
  if (l2_format_.extended_l2 && type != ClusterType::kCompressed &&
      !format::CheckSubclusterBitmap(e, l2_format_).ok()) {
    co_return co_await SignalInvalidBitmap(l2_offset, index, for_write);
  }
  if (type == ClusterType::kCompressed) {
    const format::CompressedDescriptor d =
        format::DecodeCompressedDescriptor(e.word, cluster_bits_);
    if (d.host_offset >= FileSize()) {
      co_return co_await SignalCorruption(absl::StrFormat(
          "Compressed cluster offset %#x beyond the end of the image file "
          "(L2 offset: %#x, L2 index: %#x)",
          d.host_offset, l2_offset, index));
    }
    co_return type;
  }
  if ((type == ClusterType::kZeroPlain || type == ClusterType::kZeroAlloc) &&
      header_.version < 3) {
    co_return co_await SignalCorruption(absl::StrFormat(
        "Zero cluster entry found in pre-v3 image (L2 offset: %#x, L2 index: "
        "%#x)",
        l2_offset, index));
  }
  const uint64_t host = e.host_offset();
  if (host != 0 && (host & (cluster_size_ - 1)) != 0) {
    co_return co_await SignalCorruption(absl::StrFormat(
        "Cluster allocation offset %#x unaligned (L2 offset: %#x, L2 index: "
        "%#x)",
        host, l2_offset, index));
  }
  // A reserved host cluster of an extended entry may lie past the end of
  // the file until one of its subclusters is written.
  if (type == ClusterType::kNormal && host >= FileSize() &&
      (!l2_format_.extended_l2 ||
       (e.bitmap & format::kSubclusterAllocMask) != 0)) {
    co_return co_await SignalCorruption(absl::StrFormat(
        "Data cluster offset %#x beyond the end of the image file (L2 offset: "
        "%#x, L2 index: %#x)",
        host, l2_offset, index));
  }
  co_return type;
}

io::Task<absl::StatusOr<Qcow2Node::Mapping>> Qcow2Node::GetMapping(
    uint64_t offset, uint64_t max_length) {
  const uint64_t mask = cluster_size_ - 1;
  const uint64_t in_cluster = offset & mask;
  const uint64_t li = l1_index(offset);
  const uint64_t table_end = ((li + 1) * l2_entries_) << cluster_bits_;
  const uint64_t available = std::min(max_length, table_end - offset);
  Mapping m;
  if (li >= l1_.size() || (l1_[li] & format::kL1OffsetMask) == 0) {
    m.length = available;
    co_return m;
  }
  CO_ASSIGN_OR_RETURN(TableCache::Ref l2, co_await LoadL2(li));
  const uint64_t first = l2_index(offset);
  const L2Entry e0 = GetEntry(l2, first);
  CO_ASSIGN_OR_RETURN(m.type, co_await Classify(e0, l2.offset(), first));
  if (m.type == ClusterType::kCompressed) {
    m.l2_word = e0.word;
    m.length = std::min(available, cluster_size_ - in_cluster);
    co_return m;
  }
  if (l2_format_.extended_l2) {
    // Runs of subclusters of one type, continued into the next clusters
    // while they start with the same type (and contiguous host offsets).
    const uint32_t sc_bits = subcluster_bits();
    const uint32_t sc = static_cast<uint32_t>(in_cluster >> sc_bits);
    const format::SubclusterType st =
        format::GetSubclusterType(e0, sc, l2_format_);
    const bool has_host = st == format::SubclusterType::kNormal ||
                          st == format::SubclusterType::kZeroAlloc ||
                          st == format::SubclusterType::kUnallocatedAlloc;
    switch (st) {
      case format::SubclusterType::kNormal:
        m.type = ClusterType::kNormal;
        break;
      case format::SubclusterType::kZeroPlain:
        m.type = ClusterType::kZeroPlain;
        break;
      case format::SubclusterType::kZeroAlloc:
        m.type = ClusterType::kZeroAlloc;
        break;
      default:
        m.type = ClusterType::kUnallocated;
        break;
    }
    uint32_t run_end = sc + format::CountSubclustersOfSameType(e0, sc, l2_format_);
    uint64_t run = (uint64_t{run_end} << sc_bits) - in_cluster;
    const uint64_t max_clusters =
        (in_cluster + available + mask) >> cluster_bits_;
    const uint64_t file_size = FileSize();
    for (uint64_t n = 1; run_end == format::kSubclustersPerCluster &&
                         n < max_clusters && run < available;
         ++n) {
      const L2Entry e = GetEntry(l2, first + n);
      // Each entry the run reaches is checked before its type is compared,
      // as QEMU's count_contiguous_subclusters does.
      if (!e.compressed() &&
          !format::CheckSubclusterBitmap(e, l2_format_).ok()) {
        co_return co_await SignalInvalidBitmap(l2.offset(), first + n,
                                               /*for_write=*/false);
      }
      if (e.compressed()) break;
      if (format::GetSubclusterType(e, 0, l2_format_) != st) break;
      if (has_host) {
        const uint64_t expected = e0.host_offset() + (n << cluster_bits_);
        if (e.host_offset() != expected) break;
        if (st == format::SubclusterType::kNormal && expected >= file_size) {
          break;
        }
      }
      run_end = format::CountSubclustersOfSameType(e, 0, l2_format_);
      run += uint64_t{run_end} << sc_bits;
    }
    m.length = std::min(available, run);
    if (has_host) m.host_offset = e0.host_offset() + in_cluster;
    co_return m;
  }
  const uint64_t max_clusters = (in_cluster + available + mask) >> cluster_bits_;
  const uint64_t file_size = FileSize();
  uint64_t n = 1;
  for (; n < max_clusters; ++n) {
    const L2Entry e = GetEntry(l2, first + n);
    if (RawType(e, l2_format_.extended_l2) != m.type) break;
    // Host offsets must continue (preallocated zero clusters report theirs).
    if (m.type == ClusterType::kNormal || m.type == ClusterType::kZeroAlloc) {
      const uint64_t expected = e0.host_offset() + (n << cluster_bits_);
      if (e.host_offset() != expected) break;
      if (m.type == ClusterType::kNormal && expected >= file_size) break;
    }
  }
  m.length = std::min(available, (n << cluster_bits_) - in_cluster);
  if (m.type == ClusterType::kNormal || m.type == ClusterType::kZeroAlloc) {
    m.host_offset = e0.host_offset() + in_cluster;
  }
  co_return m;
}

Qcow2Node::WriteKind Qcow2Node::KindOf(format::ClusterType type,
                                       const format::L2Entry& e) {
  if (type == ClusterType::kNormal && e.copied()) return WriteKind::kInPlace;
  if (type == ClusterType::kZeroAlloc && e.copied()) return WriteKind::kReuse;
  return WriteKind::kAllocate;
}

// ---- Bookkeeping -------------------------------------------------------------

std::shared_ptr<Qcow2Node::Inflight> Qcow2Node::FindInflight(
    uint64_t first, uint64_t count) const {
  if (inflight_.empty() || count == 0) return nullptr;
  auto it = inflight_.upper_bound(first + count - 1);
  if (it == inflight_.begin()) return nullptr;
  --it;
  if (it->second->first + it->second->count > first) return it->second;
  return nullptr;
}

std::shared_ptr<Qcow2Node::Inflight> Qcow2Node::AddInflight(uint64_t first,
                                                            uint64_t count,
                                                            uint64_t host) {
  auto inflight = std::make_shared<Inflight>();
  inflight->first = first;
  inflight->count = count;
  inflight->host = host;
  inflight_[first] = inflight;
  return inflight;
}

uint64_t Qcow2Node::BeginDataOp() {
  const uint64_t seq = next_seq_++;
  ops_in_flight_.insert(seq);
  return seq;
}

void Qcow2Node::EndDataOp(uint64_t seq) {
  auto it = ops_in_flight_.find(seq);
  if (it != ops_in_flight_.end()) ops_in_flight_.erase(it);
}

std::pair<uint64_t, uint64_t> Qcow2Node::HostBytesOf(
    const format::L2Entry& e) const {
  const ClusterType type = RawType(e, l2_format_.extended_l2);
  if (type == ClusterType::kNormal || type == ClusterType::kZeroAlloc) {
    return {e.host_offset(), cluster_size_};
  }
  if (type == ClusterType::kCompressed) {
    const format::CompressedDescriptor d =
        format::DecodeCompressedDescriptor(e.word, cluster_bits_);
    return {d.host_offset, d.size()};
  }
  return {0, 0};
}

void Qcow2Node::FreeEntryLater(const format::L2Entry& e, bool discard) {
  const auto [offset, length] = HostBytesOf(e);
  if (length == 0) return;
  PendingFree f;
  f.seq = next_seq_;
  f.discard = discard;
  f.offset = offset;
  f.length = length;
  pending_frees_.push_back(f);
}

io::Task<absl::Status> Qcow2Node::CheckFreeOrFail(const format::L2Entry& e) {
  const auto [offset, length] = HostBytesOf(e);
  if (length == 0) co_return absl::OkStatus();
  // Not the inactive L2 tables: a cluster shared with a snapshot is only
  // unreferenced here (its refcount stays above 0), and reading every
  // snapshot L1 table per freed entry would be imgtool's cost alone.
  co_return co_await CheckOverlapOrFail(offset, length, kOverlapInactiveL2);
}

// ---- Reads --------------------------------------------------------------------

io::Task<absl::Status> Qcow2Node::WriteData(uint64_t host,
                                            io::ConstIoVec data) {
  co_await file_->DebugEvent(io::BlkdebugEvent::kWriteAio);
  co_return co_await file_->Write(host, data);
}

io::Task<absl::Status> Qcow2Node::WriteMergedCow(uint64_t host,
                                                  io::ConstIoVec data) {
  co_await file_->DebugEvent(io::BlkdebugEvent::kWriteAio);
  co_await file_->DebugEvent(io::BlkdebugEvent::kCowWrite);
  co_return co_await file_->Write(host, data);
}

io::Task<absl::Status> Qcow2Node::CowRead(const format::L2Entry& old,
                                          uint64_t offset, io::IoVec buf) {
  if (buf.empty()) co_return absl::OkStatus();
  co_await file_->DebugEvent(io::BlkdebugEvent::kCowRead);
  co_return co_await ReadOldContents(old, offset, buf);
}

io::Task<absl::Status> Qcow2Node::ReadBacking(uint64_t offset, io::IoVec buf) {
  uint64_t n = 0;
  // Raised whenever there is a backing file, even past its end, as
  // qcow2_co_preadv_task does.
  if (backing_ != nullptr) {
    co_await file_->DebugEvent(io::BlkdebugEvent::kReadBackingAio);
  }
  if (backing_ != nullptr && offset < backing_->size()) {
    n = std::min<uint64_t>(buf.size(), backing_->size() - offset);
    CO_RETURN_IF_ERROR(co_await backing_->Read(offset, buf.first(n)));
  }
  std::fill(buf.begin() + n, buf.end(), 0);
  co_return absl::OkStatus();
}

io::Task<absl::Status> Qcow2Node::ReadCompressed(uint64_t l2_word,
                                                 uint64_t offset_in_cluster,
                                                 io::IoVec buf) {
  const format::CompressedDescriptor d =
      format::DecodeCompressedDescriptor(l2_word, cluster_bits_);
  std::vector<uint8_t> src(d.size());
  co_await file_->DebugEvent(io::BlkdebugEvent::kReadCompressed);
  CO_RETURN_IF_ERROR(co_await file_->Read(d.host_offset, io::IoVec(src)));
  std::vector<uint8_t> cluster(cluster_size_);
  absl::Status st = DecompressCluster(header_.compression_type, src,
                                      absl::MakeSpan(cluster));
  if (!st.ok()) {
    co_return absl::DataLossError(absl::StrFormat(
        "%s: compressed cluster at host offset %#x does not decompress",
        filename(), d.host_offset));
  }
  std::memcpy(buf.data(), cluster.data() + offset_in_cluster, buf.size());
  co_return absl::OkStatus();
}

io::Task<absl::Status> Qcow2Node::DoRead(uint64_t offset, io::IoVec buf) {
  if (offset >= size()) {
    std::fill(buf.begin(), buf.end(), 0);
    co_return absl::OkStatus();
  }
  if (buf.size() > size() - offset) {
    std::fill(buf.begin() + (size() - offset), buf.end(), 0);
    buf = buf.first(size() - offset);
  }
  co_return co_await ReadGuest(offset, buf);
}

io::Task<absl::Status> Qcow2Node::ReadGuest(uint64_t offset, io::IoVec buf) {
  while (!buf.empty()) {
    auto lock = co_await io::ScopedLock::Take(meta_lock_);
    CO_RETURN_IF_ERROR(CheckUsable());
    CO_ASSIGN_OR_RETURN(Mapping m, co_await GetMapping(offset, buf.size()));
    const uint64_t seq = BeginDataOp();
    lock.Release();
    io::IoVec part = buf.first(m.length);
    absl::Status st;
    switch (m.type) {
      case ClusterType::kUnallocated:
        st = co_await ReadBacking(offset, part);
        break;
      case ClusterType::kZeroPlain:
      case ClusterType::kZeroAlloc:
        std::fill(part.begin(), part.end(), 0);
        break;
      case ClusterType::kNormal:
        co_await file_->DebugEvent(io::BlkdebugEvent::kReadAio);
        st = co_await file_->Read(m.host_offset, part);
        break;
      case ClusterType::kCompressed:
        st = co_await ReadCompressed(m.l2_word, offset & (cluster_size_ - 1),
                                     part);
        break;
    }
    EndDataOp(seq);
    CO_RETURN_IF_ERROR(st);
    offset += m.length;
    buf.remove_prefix(m.length);
  }
  co_return absl::OkStatus();
}

// ---- Writes -------------------------------------------------------------------

io::Task<absl::Status> Qcow2Node::ReadOldContents(const format::L2Entry& old,
                                                  uint64_t offset,
                                                  io::IoVec buf) {
  const uint64_t in_cluster = offset & (cluster_size_ - 1);
  if (l2_format_.extended_l2 && !old.compressed()) {
    // Subcluster by subcluster (runs of one type).
    uint64_t pos = in_cluster;
    while (!buf.empty()) {
      const uint32_t sc = static_cast<uint32_t>(pos >> subcluster_bits());
      const uint32_t count = format::CountSubclustersOfSameType(old, sc, l2_format_);
      const uint64_t n = std::min<uint64_t>(
          buf.size(), (uint64_t{sc + count} << subcluster_bits()) - pos);
      io::IoVec piece = buf.first(n);
      switch (format::GetSubclusterType(old, sc, l2_format_)) {
        case format::SubclusterType::kNormal:
          co_await file_->DebugEvent(io::BlkdebugEvent::kReadAio);
          CO_RETURN_IF_ERROR(co_await file_->Read(old.host_offset() + pos, piece));
          break;
        case format::SubclusterType::kZeroPlain:
        case format::SubclusterType::kZeroAlloc:
          std::fill(piece.begin(), piece.end(), 0);
          break;
        case format::SubclusterType::kUnallocatedPlain:
        case format::SubclusterType::kUnallocatedAlloc:
          CO_RETURN_IF_ERROR(
              co_await ReadBacking(offset + (pos - in_cluster), piece));
          break;
        default:
          co_return absl::DataLossError(absl::StrFormat(
              "%s: invalid subcluster bitmap at guest offset %#x", filename(),
              offset));
      }
      pos += n;
      buf.remove_prefix(n);
    }
    co_return absl::OkStatus();
  }
  switch (RawType(old, l2_format_.extended_l2)) {
    case ClusterType::kUnallocated:
      co_return co_await ReadBacking(offset, buf);
    case ClusterType::kZeroPlain:
    case ClusterType::kZeroAlloc:
      std::fill(buf.begin(), buf.end(), 0);
      co_return absl::OkStatus();
    case ClusterType::kNormal:
      co_await file_->DebugEvent(io::BlkdebugEvent::kReadAio);
      co_return co_await file_->Read(old.host_offset() + in_cluster, buf);
    case ClusterType::kCompressed:
      co_return co_await ReadCompressed(old.word, in_cluster, buf);
  }
  co_return absl::OkStatus();
}

bool Qcow2Node::OldContentsAreZero(const format::L2Entry& old, uint64_t offset,
                                   uint64_t length) const {
  if (length == 0) return true;
  switch (RawType(old, l2_format_.extended_l2)) {
    case ClusterType::kZeroPlain:
    case ClusterType::kZeroAlloc:
      return true;
    case ClusterType::kUnallocated:
      return backing_ == nullptr || offset >= backing_->size();
    default:
      return false;
  }
}

io::Task<bool> Qcow2Node::BackingReadsZero(uint64_t offset, uint64_t length) {
  if (backing_ == nullptr) co_return true;
  const uint64_t end = std::min(offset + length, backing_->size());
  while (offset < end) {
    absl::StatusOr<io::ChainStatus> st =
        co_await io::GetChainStatus(*backing_, offset, end - offset);
    if (!st.ok()) co_return false;
    if (st->present && !st->status.zero) co_return false;
    offset += st->status.length;
  }
  co_return true;
}

io::Task<bool> Qcow2Node::CowRegionReadsZero(const format::L2Entry& old,
                                             uint64_t offset,
                                             uint64_t length) {
  if (length == 0) co_return true;
  if (offset > size() || length > size() - offset) co_return false;
  bool unallocated;
  if (!l2_format_.extended_l2 || old.compressed()) {
    const ClusterType t = RawType(old, l2_format_.extended_l2);
    if (t == ClusterType::kZeroPlain || t == ClusterType::kZeroAlloc) {
      co_return true;
    }
    if (t != ClusterType::kUnallocated) co_return false;
    unallocated = true;
  } else {
    // One run of one kind: block status answers for the first run only.
    const uint64_t in_cluster = offset & (cluster_size_ - 1);
    const uint32_t a = static_cast<uint32_t>(in_cluster >> subcluster_bits());
    const uint32_t b = static_cast<uint32_t>(
        (in_cluster + length + (uint64_t{1} << subcluster_bits()) - 1) >>
        subcluster_bits());
    bool zero = true;
    unallocated = true;
    for (uint32_t sc = a; sc < b; ++sc) {
      switch (format::GetSubclusterType(old, sc, l2_format_)) {
        case format::SubclusterType::kZeroPlain:
        case format::SubclusterType::kZeroAlloc:
          unallocated = false;
          break;
        case format::SubclusterType::kUnallocatedPlain:
        case format::SubclusterType::kUnallocatedAlloc:
          zero = false;
          break;
        default:
          co_return false;
      }
    }
    if (zero) co_return true;
    if (!unallocated) co_return false;
  }
  // Unallocated here: the backing chain answers, layer by layer, as QEMU's
  // bdrv_co_common_block_status_above with want_zero false, and only its
  // first run counts (pnum == bytes): past a layer's end zeroes; a layer
  // reaching only partly over the range ends the run; a qcow2 layer's zero
  // clusters read as zeroes, its data (compressed too) does not, its
  // unallocated range is the next layer's to answer, or zeroes at the
  // bottom of the chain. Another format answers as data where it has the
  // range at all (raw: a hole too, as file-posix without want_zero).
  io::BlockNode* node = backing_.get();
  while (node != nullptr) {
    const uint64_t node_size = node->size();
    if (offset >= node_size) co_return true;
    if (length > node_size - offset) co_return false;
    auto* q = dynamic_cast<Qcow2Node*>(node);
    if (q == nullptr) {
      absl::StatusOr<io::ChainStatus> st =
          co_await io::GetChainStatus(*node, offset, length);
      co_return st.ok() && !st->present && st->status.length >= length;
    }
    absl::StatusOr<io::BlockStatus> st =
        co_await q->GetAllocationStatus(offset, length);
    if (!st.ok() || st->length < length || st->data) co_return false;
    if (st->zero) co_return true;
    node = q->backing();
  }
  co_return true;
}

Qcow2Node::CowBuffer::CowBuffer(Qcow2Node* node, uint64_t size)
    : node_(node) {
  // The most recently returned buffer that fits (sizes repeat: one
  // cluster, or one subcluster with extended L2 entries).
  std::vector<io::AlignedBuffer>& pool = node_->cow_pool_;
  for (size_t i = pool.size(); i-- > 0;) {
    if (pool[i].size() >= size && pool[i].size() <= 2 * size) {
      buf_ = std::move(pool[i]);
      pool.erase(pool.begin() + i);
      node_->cow_pool_bytes_ -= buf_.size();
      return;
    }
  }
  // Every byte is read or copied into before the buffer is written out, as
  // with a reused one.
  buf_ = io::AlignedBuffer::Uninitialized(size);
}

Qcow2Node::CowBuffer::~CowBuffer() {
  if (buf_.size() == 0 ||
      node_->cow_pool_bytes_ + buf_.size() > kMaxPooledCowBytes) {
    return;
  }
  node_->cow_pool_bytes_ += buf_.size();
  node_->cow_pool_.push_back(std::move(buf_));
}

io::Task<absl::StatusOr<bool>> Qcow2Node::ZeroThenWrite(uint64_t zero_at,
                                                        uint64_t zero_bytes,
                                                        uint64_t data_at,
                                                        io::ConstIoVec data,
                                                        Inflight* inflight) {
  io::WriteZeroesFlags flags;
  flags.no_fallback = true;
  co_await file_->DebugEvent(io::BlkdebugEvent::kClusterAllocSpace);
  absl::Status st = co_await file_->WriteZeroes(zero_at, zero_bytes, flags);
  if (absl::IsUnimplemented(st)) co_return false;
  CO_RETURN_IF_ERROR(st);
  if (inflight == nullptr) {
    CO_RETURN_IF_ERROR(co_await WriteData(data_at, data));
    co_return true;
  }
  // Writers waiting to go beside this one queue their requests after its
  // own: a sequential stream reaches the file in order.
  inflight->ready = true;
  CO_RETURN_IF_ERROR(co_await StartThen(WriteData(data_at, data),
                                        [inflight] { inflight->settled.Set(); }));
  co_return true;
}

bool Qcow2Node::DataApart(const Inflight& other, uint64_t offset,
                          uint64_t end) {
  return other.host != 0 &&
         (end <= other.data_begin || offset >= other.data_end);
}

bool Qcow2Node::CanWriteBeside(const Inflight& other, uint64_t offset,
                               uint64_t end) {
  return other.ready && DataApart(other, offset, end);
}

io::Task<void> Qcow2Node::WaitForInflight(std::shared_ptr<Inflight> other,
                                          uint64_t offset, uint64_t end) {
  if (DataApart(*other, offset, end)) {
    co_await other->settled.Wait();
  } else {
    co_await other->done.Wait();
  }
}

io::Task<bool> Qcow2Node::WaitBeside(
    const std::vector<std::shared_ptr<Inflight>>& beside) {
  bool linked = true;
  for (const std::shared_ptr<Inflight>& other : beside) {
    co_await other->done.Wait();
    linked = linked && other->linked;
  }
  co_return linked;
}

io::Task<absl::Status> Qcow2Node::WriteAllocated(
    uint64_t offset, io::ConstIoVec data, uint64_t first_cluster,
    uint64_t count, uint64_t host, const std::vector<format::L2Entry>& olds,
    Inflight& inflight) {
  uint64_t start = first_cluster << cluster_bits_;
  uint64_t bytes = count << cluster_bits_;
  const uint64_t data_end = offset + data.size();
  // A cluster written in place at either end of a reusing run (see
  // WriteStep) keeps its other bytes: nothing to copy there, as QEMU's
  // calculate_l2_meta leaves out the COW region of a normal cluster it
  // keeps.
  auto in_place = [](const L2Entry& e) {
    return RawType(e, /*extended_l2=*/false) == ClusterType::kNormal &&
           e.copied();
  };
  if (!l2_format_.extended_l2 && in_place(olds.front())) {
    host += offset - start;
    bytes -= offset - start;
    start = offset;
  }
  if (!l2_format_.extended_l2 && in_place(olds.back())) {
    bytes = data_end - start;
  }
  const uint64_t head = offset - start;
  const uint64_t tail = start + bytes - data_end;
  inflight.data_begin = offset;
  inflight.data_end = data_end;
  if (head == 0 && tail == 0) {
    co_return co_await WriteData(host, data);
  }
  // Not `co_await a && co_await b`: GCC 12 mishandles the temporaries of a
  // co_await in a conditionally evaluated operand.
  bool zero_cow = co_await CowRegionReadsZero(olds.front(), start, head);
  if (zero_cow) {
    zero_cow = co_await CowRegionReadsZero(olds.back(), data_end, tail);
  }
  if (zero_cow) {
    // Nothing to copy: zero the new clusters, then write the data.
    CO_ASSIGN_OR_RETURN(const bool written,
                        co_await ZeroThenWrite(host, bytes, host + head, data,
                                               &inflight));
    if (written) co_return absl::OkStatus();
  }
  // Copy-on-write: the untouched parts from what the clusters showed before,
  // head, data and tail written as one request. Head and tail are read in
  // one request (the data's range read too, then overwritten) when they
  // have the same source and the data between them is at most
  // kCowMergeGap (QEMU's do_perform_cow_read of one merged region).
  CowBuffer buf(this, bytes);
  bool one_source = count == 1;
  if (!one_source && head != 0 && tail != 0) {
    one_source = std::all_of(olds.begin(), olds.end(), [&](const L2Entry& e) {
      return RawType(e, l2_format_.extended_l2) == ClusterType::kUnallocated;
    });
  }
  if (head != 0 && tail != 0 && one_source &&
      data.size() <= kCowMergeGap) {
    CO_RETURN_IF_ERROR(co_await CowRead(
        olds.front(), start, io::IoVec(buf.data(), bytes)));
  } else {
    CO_RETURN_IF_ERROR(co_await CowRead(
        olds.front(), start, io::IoVec(buf.data(), head)));
    CO_RETURN_IF_ERROR(co_await CowRead(
        olds.back(), data_end,
        io::IoVec(buf.data() + head + data.size(), tail)));
  }
  std::memcpy(buf.data() + head, data.data(), data.size());
  co_return co_await WriteMergedCow(host, io::ConstIoVec(buf.data(), bytes));
}

io::Task<absl::Status> Qcow2Node::LinkL2(
    uint64_t first_cluster, uint64_t count, uint64_t host,
    const std::vector<format::L2Entry>& olds, bool free_old) {
  const uint64_t li = first_cluster / l2_entries_;
  const uint64_t first = first_cluster % l2_entries_;
  CO_ASSIGN_OR_RETURN(TableCache::Ref l2, co_await GetL2ForWrite(li));
  for (uint64_t i = 0; i < count; ++i) {
    L2Entry e;
    e.word = format::MakeStandardL2Word(host + (i << cluster_bits_),
                                        /*copied=*/true, /*zero=*/false);
    if (free_old) CO_RETURN_IF_ERROR(co_await CheckFreeOrFail(olds[i]));
    SetEntry(l2, first + i, e);
    if (free_old) FreeEntryLater(olds[i], /*discard=*/false);
  }
  co_return absl::OkStatus();
}

io::Task<absl::StatusOr<uint64_t>> Qcow2Node::WriteStep(uint64_t offset,
                                                        io::ConstIoVec data,
                                                        uint64_t* host_hint) {
  auto lock = co_await io::ScopedLock::Take(meta_lock_);
  // The hint counts for this step only; every way out sets it anew.
  const uint64_t hint = *host_hint;
  *host_hint = 0;
  CO_RETURN_IF_ERROR(CheckUsable());
  CO_RETURN_IF_ERROR(co_await PrepareFirstWrite());
  if (ShouldAllocateL2Grouped(l1_index(offset))) {
    CO_RETURN_IF_ERROR(
        co_await AllocateL2Grouped(l1_index(offset), std::move(lock)));
    co_return uint64_t{0};
  }
  const uint64_t cluster = offset >> cluster_bits_;
  const uint64_t end = offset + data.size();
  // Allocations in flight this write writes beside (CanWriteBeside), in
  // guest order.
  std::vector<std::shared_ptr<Inflight>> beside;
  if (std::shared_ptr<Inflight> other = FindInflight(cluster, 1)) {
    if (!CanWriteBeside(*other, offset, end)) {
      lock.Release();
      co_await WaitForInflight(std::move(other), offset, end);
      co_return uint64_t{0};
    }
    beside.push_back(std::move(other));
  }
  const uint64_t li = l1_index(offset);
  const uint64_t first = l2_index(offset);
  CO_ASSIGN_OR_RETURN(TableCache::Ref l2, co_await GetL2ForWrite(li));
  const uint64_t end_cluster =
      (end + cluster_size_ - 1) >> cluster_bits_;
  const uint64_t max_n =
      std::min(end_cluster - cluster, l2_entries_ - first);
  // Host offset of guest cluster `c` in the allocation in flight `other`.
  auto host_in = [&](const Inflight& other, uint64_t c) {
    return other.host + ((c - other.first) << cluster_bits_);
  };
  std::vector<L2Entry> olds;
  olds.push_back(GetEntry(l2, first));
  CO_ASSIGN_OR_RETURN(ClusterType type,
                      co_await Classify(olds[0], l2.offset(), first));
  WriteKind kind =
      beside.empty() ? KindOf(type, olds[0]) : WriteKind::kInPlace;
  // A run may mix clusters written in place with preallocated zero clusters
  // it reuses (QEMU's handle_copied keeps every COPIED cluster at
  // contiguous host offsets, normal or zero): one data write over them all,
  // then their L2 entries rewritten (iotest 066).
  auto keeps_host = [](WriteKind k) {
    return k == WriteKind::kInPlace || k == WriteKind::kReuse;
  };
  bool mixed = false;
  const uint64_t base_host = beside.empty() ? olds[0].host_offset()
                                            : host_in(*beside[0], cluster);
  uint64_t n = 1;
  for (; n < max_n; ++n) {
    const L2Entry e = GetEntry(l2, first + n);
    if (std::shared_ptr<Inflight> other = FindInflight(cluster + n, 1)) {
      if (kind != WriteKind::kInPlace || !CanWriteBeside(*other, offset, end) ||
          host_in(*other, cluster + n) != base_host + (n << cluster_bits_)) {
        break;
      }
      if (beside.empty() || beside.back() != other) {
        beside.push_back(std::move(other));
      }
      olds.push_back(e);
      continue;
    }
    CO_ASSIGN_OR_RETURN(ClusterType t,
                        co_await Classify(e, l2.offset(), first + n));
    const WriteKind k = KindOf(t, e);
    if (k != kind) {
      if (!beside.empty() || !keeps_host(k) || !keeps_host(kind)) break;
      mixed = true;
    }
    if (kind != WriteKind::kAllocate &&
        e.host_offset() != base_host + (n << cluster_bits_)) {
      break;
    }
    olds.push_back(e);
  }
  if (mixed) kind = WriteKind::kReuse;
  // The host offset after the step's last cluster when the step ends at a
  // cluster end (and the request may go on there), else 0.
  auto hint_after = [&](uint64_t host_start, uint64_t count) -> uint64_t {
    return offset + data.size() > ((cluster + count) << cluster_bits_)
               ? host_start + (count << cluster_bits_)
               : 0;
  };

  if (kind == WriteKind::kInPlace) {
    const uint64_t bytes =
        std::min(end, (cluster + n) << cluster_bits_) - offset;
    io::ConstIoVec part = data.first(bytes);
    const uint64_t host = base_host + (offset & (cluster_size_ - 1));
    // The write goes on into clusters another write is allocating right
    // after the last one in place, and cannot write beside it (it is still
    // writing their other contents, or its data meets ours): wait for that
    // allocation and write once over both. Writing the part in place now
    // would only split the request, as the rest has to wait for that
    // allocation anyway. With 64 writes of 64 KiB at 1 KiB offsets started
    // together over a file that must copy or write zeroes, the odd ones
    // find their first cluster allocated by the even one before and their
    // second being allocated by the even one after: one host write each
    // instead of 63 KiB + 1 KiB (two sub-block direct writes, which XFS and
    // ext4 serialise against all direct I/O in flight), as qemu-img.
    if (n < max_n) {
      std::shared_ptr<Inflight> next = FindInflight(cluster + n, 1);
      if (next != nullptr && next->first == cluster + n &&
          next->host == base_host + (n << cluster_bits_)) {
        lock.Release();
        co_await WaitForInflight(std::move(next), offset, end);
        co_return uint64_t{0};
      }
    }
    // The write goes on past the clusters written in place into clusters
    // that need allocating and read as zeroes: allocate them right after the
    // last one in place if that host range is free and write once over both
    // (QEMU's handle_copied followed by handle_alloc at the expected host
    // offset). A write at a 1 KiB offset whose first cluster an earlier
    // write just allocated so stays one host write instead of 63 KiB + 1 KiB.
    std::vector<L2Entry> news;
    for (uint64_t i = n; i < max_n; ++i) {
      if (FindInflight(cluster + i, 1) != nullptr) break;
      const L2Entry e = GetEntry(l2, first + i);
      CO_ASSIGN_OR_RETURN(ClusterType t,
                          co_await Classify(e, l2.offset(), first + i));
      if (KindOf(t, e) != WriteKind::kAllocate ||
          !OldContentsAreZero(e, (cluster + i) << cluster_bits_,
                              cluster_size_)) {
        break;
      }
      news.push_back(e);
    }
    if (!news.empty()) {
      const uint64_t new_host = base_host + (n << cluster_bits_);
      CO_ASSIGN_OR_RETURN(const uint64_t got,
                          co_await refcounts_->AllocateAt(new_host,
                                                          news.size()));
      if (got > 0) {
        news.resize(got);
        CO_ASSIGN_OR_RETURN(
            const uint64_t written,
            co_await WriteInPlaceThenNew(std::move(lock), std::move(l2),
                                         offset, data, cluster, n, host,
                                         new_host, news, std::move(beside)));
        if (written != 0) *host_hint = hint_after(base_host, n + got);
        co_return written;
      }
    }
    CO_RETURN_IF_ERROR(co_await CheckOverlapOrFail(host, bytes, 0));
    for (const std::shared_ptr<Inflight>& other : beside) {
      ++other->writers_beside;
    }
    const uint64_t seq = BeginDataOp();
    l2.reset();
    absl::Status st =
        co_await StartThenUnlock(lock, WriteData(host, part));
    EndDataOp(seq);
    CO_RETURN_IF_ERROR(st);
    if (!co_await WaitBeside(beside)) co_return uint64_t{0};
    ++write_gen_;
    *host_hint = hint_after(base_host, n);
    co_return bytes;
  }

  uint64_t host = 0;
  if (kind == WriteKind::kReuse) {
    host = olds[0].host_offset();
  } else {
    if (hint != 0) {
      // Right after the previous step's clusters, as many as are free there
      // (QEMU: qcow2_alloc_clusters_at); a search from the first free
      // cluster only when none is.
      CO_ASSIGN_OR_RETURN(const uint64_t got,
                          co_await refcounts_->AllocateAt(hint, n));
      if (got > 0) {
        host = hint;
        n = got;
        olds.resize(n);
      }
    }
    if (host == 0) {
      CO_ASSIGN_OR_RETURN(host,
                          co_await refcounts_->Allocate(n << cluster_bits_));
    }
  }
  const uint64_t bytes =
      std::min(end, (cluster + n) << cluster_bits_) - offset;
  io::ConstIoVec part = data.first(bytes);
  CO_RETURN_IF_ERROR(co_await CheckOverlapOrFail(host, n << cluster_bits_, 0));
  auto inflight = AddInflight(cluster, n, host);
  const uint64_t seq = BeginDataOp();
  l2.reset();
  absl::Status st = co_await StartThenUnlock(
      lock, WriteAllocated(offset, part, cluster, n, host, olds, *inflight));
  EndDataOp(seq);
  CO_RETURN_IF_ERROR(co_await FinishAllocatingWrite(
      std::move(st), inflight, host, olds,
      /*allocated=*/kind == WriteKind::kAllocate));
  *host_hint = hint_after(host, n);
  co_return bytes;
}

io::Task<absl::Status> Qcow2Node::FinishAllocatingWrite(
    absl::Status st, std::shared_ptr<Inflight> inflight, uint64_t host,
    const std::vector<format::L2Entry>& olds, bool allocated) {
  auto relock = co_await io::ScopedLock::Take(meta_lock_);
  if (st.ok()) {
    ++write_gen_;
    st = CheckUsable();
  }
  if (st.ok()) {
    st = co_await LinkL2(inflight->first, inflight->count, host, olds,
                         /*free_old=*/allocated);
  }
  inflight->linked = st.ok();
  if (!st.ok() && allocated && broken_.ok()) {
    // Never referenced: give the clusters back, now or, if other writes
    // wrote beside this one and may still be writing, once they are done.
    if (inflight->writers_beside > 0) {
      pending_frees_.push_back(PendingFree{
          .offset = host,
          .length = inflight->count << cluster_bits_,
          .seq = next_seq_});
    } else {
      absl::Status undo =
          co_await refcounts_->Free(host, inflight->count << cluster_bits_);
      (void)undo;
    }
  }
  inflight_.erase(inflight->first);
  relock.Release();
  inflight->settled.Set();
  inflight->done.Set();
  co_return st;
}

io::Task<absl::StatusOr<uint64_t>> Qcow2Node::WriteInPlaceThenNew(
    io::ScopedLock lock, TableCache::Ref l2, uint64_t offset,
    io::ConstIoVec data, uint64_t cluster, uint64_t n, uint64_t host,
    uint64_t new_host, std::vector<format::L2Entry> news,
    std::vector<std::shared_ptr<Inflight>> beside) {
  const uint64_t count = news.size();
  const uint64_t new_cluster = cluster + n;
  const uint64_t new_bytes = count << cluster_bits_;
  const uint64_t bytes =
      std::min(offset + data.size(), (new_cluster + count) << cluster_bits_) -
      offset;
  absl::Status st = co_await CheckOverlapOrFail(host, bytes, 0);
  if (st.ok()) st = co_await CheckOverlapOrFail(new_host, new_bytes, 0);
  if (!st.ok()) {
    absl::Status undo = co_await refcounts_->Free(new_host, new_bytes);
    (void)undo;
    co_return st;
  }
  auto inflight = AddInflight(new_cluster, count, new_host);
  inflight->data_begin = new_cluster << cluster_bits_;
  inflight->data_end = offset + bytes;
  for (const std::shared_ptr<Inflight>& other : beside) ++other->writers_beside;
  const uint64_t seq = BeginDataOp();
  l2.reset();
  // The new clusters read as zeroes where the data leaves them: zero them
  // (explicitly when the file cannot do it efficiently), then the data.
  const uint64_t tail = (new_cluster + count) * cluster_size_ -
                        (offset + bytes);
  // The clusters taken here read as zeroes by their entries alone, so the
  // tail is zeroed with the rest (QEMU's is_zero_cow, CowRegionReadsZero)
  // unless it reaches past the end of the image. Then its zeroes are
  // written as data, and as QEMU's merge_cow cannot take a request that
  // starts before the new clusters, the data goes first and the tail after
  // it (perform_cow).
  const bool zero_cow = offset + bytes + tail <= size();
  // Without efficient write zeroes only the tail needs explicit zeroes.
  auto write = [&]() -> io::Task<absl::Status> {
    if (!zero_cow) {
      CO_RETURN_IF_ERROR(co_await WriteData(host, data.first(bytes)));
      // perform_cow reads the tail region (unallocated: zeroes) before
      // writing it, raising cow_read then cow_write on the file.
      co_await file_->DebugEvent(io::BlkdebugEvent::kCowRead);
      co_await file_->DebugEvent(io::BlkdebugEvent::kCowWrite);
      co_return co_await file_->Write(new_host + new_bytes - tail,
                                      Zeroes(tail));
    }
    CO_ASSIGN_OR_RETURN(const bool written,
                        co_await ZeroThenWrite(new_host, new_bytes, host,
                                               data.first(bytes),
                                               inflight.get()));
    if (written) co_return absl::OkStatus();
    if (tail != 0) {
      CO_RETURN_IF_ERROR(
          co_await file_->Write(new_host + new_bytes - tail, Zeroes(tail)));
    }
    co_return co_await WriteData(host, data.first(bytes));
  };
  st = co_await StartThenUnlock(lock, write());
  EndDataOp(seq);
  const bool beside_linked = co_await WaitBeside(beside);
  CO_RETURN_IF_ERROR(co_await FinishAllocatingWrite(
      std::move(st), inflight, new_host, news, /*allocated=*/true));
  if (!beside_linked) co_return uint64_t{0};
  co_return bytes;
}

io::Task<absl::Status> Qcow2Node::DoWrite(uint64_t offset, io::ConstIoVec data) {
  if (offset > size() || data.size() > size() - offset) {
    co_return absl::OutOfRangeError(absl::StrFormat(
        "%s: write of %u bytes at offset %u is beyond the end of the image "
        "(%u bytes)",
        filename(), data.size(), offset, size()));
  }
  MarkDirty(offset, data.size());  // bitmaps (qcow2_bitmap.cc)
  co_return co_await WriteGuest(offset, data);
}

io::Task<absl::Status> Qcow2Node::WriteGuest(uint64_t offset,
                                             io::ConstIoVec data) {
  // What this request frees (the old host clusters of the clusters it
  // copies) stays allocated until it is done, as in QEMU, which links the
  // allocated pieces of one request in parallel tasks, after the later
  // pieces took their clusters: those never reuse them.
  const uint64_t request_seq = BeginDataOp();
  ++guest_writes_;
  absl::Status st;
  uint64_t host_hint = 0;
  while (!data.empty()) {
    absl::StatusOr<uint64_t> n;
    if (l2_format_.extended_l2) {
      n = co_await WriteStepExtended(offset, data, &host_hint);
    } else {
      n = co_await WriteStep(offset, data, &host_hint);
    }
    if (!n.ok()) {
      st = n.status();
      break;
    }
    offset += *n;
    data.remove_prefix(*n);
  }
  --guest_writes_;
  EndDataOp(request_seq);
  co_return st;
}

io::Task<absl::StatusOr<uint64_t>> Qcow2Node::WriteStepExtended(
    uint64_t offset, io::ConstIoVec data, uint64_t* host_hint) {
  auto lock = co_await io::ScopedLock::Take(meta_lock_);
  CO_RETURN_IF_ERROR(CheckUsable());
  CO_RETURN_IF_ERROR(co_await PrepareFirstWrite());
  if (ShouldAllocateL2Grouped(l1_index(offset))) {
    CO_RETURN_IF_ERROR(
        co_await AllocateL2Grouped(l1_index(offset), std::move(lock)));
    co_return uint64_t{0};
  }
  const uint64_t cluster = offset >> cluster_bits_;
  // Allocations and bitmap updates of one cluster are serialised.
  if (std::shared_ptr<Inflight> other = FindInflight(cluster, 1)) {
    lock.Release();
    co_await other->done.Wait();
    co_return uint64_t{0};
  }
  const uint64_t li = l1_index(offset);
  const uint64_t index = l2_index(offset);
  CO_ASSIGN_OR_RETURN(TableCache::Ref l2, co_await GetL2ForWrite(li));
  const L2Entry old = GetEntry(l2, index);
  CO_ASSIGN_OR_RETURN(
      const ClusterType type,
      co_await Classify(old, l2.offset(), index, /*for_write=*/true));
  const uint64_t start = cluster << cluster_bits_;
  const uint64_t in_cluster = offset - start;
  const uint32_t sc_bits = subcluster_bits();
  const uint64_t sc_mask = (uint64_t{1} << sc_bits) - 1;
  const uint32_t s0 = static_cast<uint32_t>(in_cluster >> sc_bits);
  const bool in_place = type == ClusterType::kNormal && old.copied();
  // The clusters the write reaches, at most to the end of the L2 table.
  const uint64_t max_n =
      std::min((in_cluster + data.size() + cluster_size_ - 1) >> cluster_bits_,
               l2_entries_ - index);
  // The following clusters the write reaches that the same request
  // writes, the middle ones whole. In place, QEMU's handle_copied: those
  // that are normal (any subcluster bitmap), COPIED and at contiguous host
  // offsets (iotest 066's shapes). Else QEMU's handle_alloc: those that need
  // a new host cluster too (unallocated, compressed or shared), which get
  // one host range with this one.
  uint64_t n = 1;
  std::vector<L2Entry> olds{old};
  for (; n < max_n; ++n) {
    if (FindInflight(cluster + n, 1) != nullptr) break;
    const L2Entry e = GetEntry(l2, index + n);
    CO_ASSIGN_OR_RETURN(
        const ClusterType t,
        co_await Classify(e, l2.offset(), index + n, /*for_write=*/true));
    const bool keeps_host = t == ClusterType::kNormal && e.copied();
    const bool same_run =
        in_place ? keeps_host && e.host_offset() ==
                                     old.host_offset() + (n << cluster_bits_)
                 : !keeps_host;
    if (!same_run) break;
    olds.push_back(e);
  }
  // Cut again below when fewer clusters can be allocated together.
  uint64_t bytes =
      std::min<uint64_t>(data.size(), (n << cluster_bits_) - in_cluster);
  io::ConstIoVec part = data.first(bytes);
  // The subclusters of cluster `i` of the run that [from, to) (offsets from
  // `start`) touches.
  auto subclusters_in = [&](uint64_t i, uint64_t from, uint64_t to) {
    const uint64_t base = i << cluster_bits_;
    const uint64_t a = std::max(from, base) - base;
    const uint64_t b = std::min(to, base + cluster_size_) - base;
    const uint32_t first_sc = static_cast<uint32_t>(a >> sc_bits);
    const uint32_t end_sc = static_cast<uint32_t>((b + sc_mask) >> sc_bits);
    return format::SubclusterAllocRange(first_sc, end_sc - first_sc);
  };
  bool all_hold_data = in_place;
  for (uint64_t i = 0; all_hold_data && i < n; ++i) {
    const uint64_t touched = subclusters_in(i, in_cluster, in_cluster + bytes);
    all_hold_data = (olds[i].bitmap & touched) == touched;
  }

  if (all_hold_data) {
    // Every touched subcluster holds data: no COW, no L2 update.
    const uint64_t host = old.host_offset() + in_cluster;
    CO_RETURN_IF_ERROR(co_await CheckOverlapOrFail(host, bytes, 0));
    const uint64_t seq = BeginDataOp();
    l2.reset();
    absl::Status st =
        co_await StartThenUnlock(lock, WriteData(host, part));
    EndDataOp(seq);
    CO_RETURN_IF_ERROR(st);
    ++write_gen_;
    *host_hint = in_cluster + bytes == n << cluster_bits_
                     ? old.host_offset() + (n << cluster_bits_)
                     : 0;
    co_return bytes;
  }

  // The range written: the data padded to the boundaries of the touched
  // subclusters that do not hold data yet (in place), or of the touched
  // subclusters plus what a new cluster must carry over.
  // Offsets from `start`; a new allocation may span `n` clusters (the
  // following ones unallocated, the middle ones written whole).
  uint64_t cow_start = in_cluster;
  uint64_t cow_end = in_cluster + bytes;
  uint64_t host = 0;
  if (in_place) {
    host = old.host_offset();
    if ((old.bitmap & format::SubclusterAllocBit(s0)) == 0) {
      cow_start = uint64_t{s0} << sc_bits;
    }
    const uint64_t last_base = (n - 1) << cluster_bits_;
    const uint32_t last_sc =
        static_cast<uint32_t>((in_cluster + bytes - 1 - last_base) >> sc_bits);
    if ((olds.back().bitmap & format::SubclusterAllocBit(last_sc)) == 0) {
      cow_end = last_base + (uint64_t{last_sc + 1} << sc_bits);
    }
  } else {
    if (*host_hint != 0) {
      // The write goes on from the host cluster before: right after it if
      // that is free (QEMU's handle_alloc at the expected host offset).
      CO_ASSIGN_OR_RETURN(const uint64_t got,
                          co_await refcounts_->AllocateAt(*host_hint, n));
      if (got > 0) {
        host = *host_hint;
        n = got;
        olds.resize(n);
      }
    }
    if (host == 0) {
      CO_ASSIGN_OR_RETURN(host,
                          co_await refcounts_->Allocate(n << cluster_bits_));
    }
    bytes = std::min<uint64_t>(data.size(), (n << cluster_bits_) - in_cluster);
    part = data.first(bytes);
    // The copy-on-write bounds (calculate_l2_meta): from the first
    // cluster's old contents before the data, from the last one's after it.
    if (type == ClusterType::kCompressed) {
      cow_start = 0;
    } else if (old.host_offset() != 0) {
      // A shared cluster: its allocated subclusters move to the copy.
      const uint32_t alloc =
          static_cast<uint32_t>(old.bitmap & format::kSubclusterAllocMask);
      cow_start = uint64_t{std::min<uint32_t>(s0, absl::countr_zero(alloc))}
                  << sc_bits;
    } else {
      cow_start = uint64_t{s0} << sc_bits;
    }
    const L2Entry& last = olds.back();
    const uint64_t data_end = in_cluster + bytes;
    const uint64_t run_end = n << cluster_bits_;
    if (last.compressed()) {
      cow_end = run_end;
    } else if (last.host_offset() != 0) {
      const uint32_t alloc =
          static_cast<uint32_t>(last.bitmap & format::kSubclusterAllocMask);
      const uint32_t last_sc = static_cast<uint32_t>(
          ((data_end - 1) & (cluster_size_ - 1)) >> sc_bits);
      cow_end = run_end - (uint64_t{std::min<uint32_t>(
                               format::kSubclustersPerCluster - 1 - last_sc,
                               absl::countl_zero(alloc))}
                           << sc_bits);
    } else {
      cow_end = std::min((data_end + sc_mask) & ~sc_mask, run_end);
    }
  }
  const L2Entry last = olds.back();
  *host_hint = 0;
  CO_RETURN_IF_ERROR(co_await CheckOverlapOrFail(
      in_place ? host + cow_start : host,
      in_place ? cow_end - cow_start : n << cluster_bits_, 0));
  auto inflight = AddInflight(cluster, n, /*host=*/0);
  const uint64_t seq = BeginDataOp();
  l2.reset();
  lock.Release();

  absl::Status st;
  const uint64_t head = in_cluster - cow_start;
  const uint64_t tail = cow_end - (in_cluster + bytes);
  bool done = false;
  bool zero_cow = type != ClusterType::kCompressed && !last.compressed();
  if (zero_cow) {
    zero_cow = co_await CowRegionReadsZero(old, start + cow_start, head);
  }
  if (zero_cow) {
    zero_cow = co_await CowRegionReadsZero(last, offset + bytes, tail);
  }
  if (head == 0 && tail == 0) {
    st = co_await WriteData(host + in_cluster, part);
    done = true;
  } else if (zero_cow) {
    // Nothing to copy: zero the padded range, then write the data
    // (subcluster granular).
    absl::StatusOr<bool> written = co_await ZeroThenWrite(
        host + cow_start, cow_end - cow_start, host + in_cluster, part);
    st = written.status();
    done = written.value_or(false);
  }
  if (st.ok() && !done) {
    // Copy-on-write of the untouched parts of the touched subclusters:
    // backing data, zeroes (also without a backing file), or old data. One
    // read for head and tail when at most kCowMergeGap lies between them,
    // one write for head, data and tail.
    CowBuffer buf(this, cow_end - cow_start);
    if (head != 0 && tail != 0 && bytes <= kCowMergeGap && n == 1) {
      st = co_await CowRead(old, start + cow_start,
                            io::IoVec(buf.data(), cow_end - cow_start));
    } else {
      st = co_await CowRead(old, start + cow_start,
                            io::IoVec(buf.data(), head));
      if (st.ok()) {
        st = co_await CowRead(
            last, offset + bytes, io::IoVec(buf.data() + head + bytes, tail));
      }
    }
    if (st.ok()) {
      std::memcpy(buf.data() + head, part.data(), bytes);
      st = co_await WriteMergedCow(
          host + cow_start, io::ConstIoVec(buf.data(), cow_end - cow_start));
    }
  }
  EndDataOp(seq);
  auto relock = co_await io::ScopedLock::Take(meta_lock_);
  if (st.ok()) {
    ++write_gen_;
    st = CheckUsable();
  }
  if (st.ok()) {
    // The data is written; now the bitmap may say so (the L2 table is
    // written back only after the data is synced).
    absl::StatusOr<TableCache::Ref> again = co_await GetL2ForWrite(li);
    if (again.ok()) {
      for (uint64_t i = 0; i < n; ++i) {
        // This cluster's share of [cow_start, cow_end), in subclusters.
        const uint64_t base = i << cluster_bits_;
        const uint64_t written = subclusters_in(i, cow_start, cow_end);
        const L2Entry& prev = olds[i];
        L2Entry e;
        e.word = format::MakeStandardL2Word(host + base, /*copied=*/true,
                                            /*zero=*/false);
        if (in_place) {
          const L2Entry cur = GetEntry(*again, index + i);
          e.bitmap = (cur.bitmap | written) & ~(written << 32);
        } else if (prev.compressed()) {
          e.bitmap = written;  // the whole cluster
        } else {
          e.bitmap = ((prev.bitmap & format::kSubclusterZeroMask) &
                      ~(written << 32)) |
                     written;
        }
        SetEntry(*again, index + i, e);
        if (!in_place) FreeEntryLater(prev, /*discard=*/false);
      }
    } else {
      st = again.status();
    }
  }
  if (!st.ok() && !in_place && broken_.ok()) {
    // Never referenced: give the clusters back now.
    absl::Status undo = co_await refcounts_->Free(host, n << cluster_bits_);
    (void)undo;
  }
  inflight_.erase(cluster);
  relock.Release();
  inflight->done.Set();
  CO_RETURN_IF_ERROR(st);
  if (!in_place && in_cluster + bytes == n << cluster_bits_) {
    *host_hint = host + (n << cluster_bits_);
  } else if (in_place && in_cluster + bytes == n << cluster_bits_) {
    *host_hint = host + (n << cluster_bits_);
  }
  co_return bytes;
}

io::Task<absl::Status> Qcow2Node::WriteCompressed(uint64_t offset,
                                                  io::ConstIoVec data) {
  if (read_only()) {
    co_return absl::FailedPreconditionError(
        absl::StrFormat("%s: image is read-only", filename()));
  }
  if (data.empty()) {
    auto lock = co_await io::ScopedLock::Take(meta_lock_);
    CO_RETURN_IF_ERROR(CheckUsable());
    const uint64_t end = (FileSize() + 511) / 512 * 512;
    if (end == FileSize()) co_return absl::OkStatus();
    co_return co_await file_->Truncate(end, io::PreallocMode::kOff);
  }
  // QEMU's qcow2_co_pwritev_compressed_part: EINVAL unless cluster
  // aligned, and whole clusters or up to the image end.
  const uint64_t mask = cluster_size_ - 1;
  if ((offset & mask) != 0 || offset >= size() ||
      data.size() > size() - offset ||
      ((data.size() & mask) != 0 && offset + data.size() != size())) {
    co_return absl::InvalidArgumentError(absl::StrFormat(
        "%s: compressed writes take whole clusters from a cluster boundary "
        "(%u bytes at offset %u)",
        filename(), data.size(), offset));
  }
  MarkDirty(offset, data.size());  // bitmaps (qcow2_bitmap.cc)
  while (!data.empty()) {
    const uint64_t n = std::min<uint64_t>(data.size(), cluster_size_);
    CO_RETURN_IF_ERROR(co_await WriteCompressedCluster(offset, data.first(n)));
    offset += n;
    data.remove_prefix(n);
  }
  co_return absl::OkStatus();
}

io::Task<absl::Status> Qcow2Node::WriteCompressedCluster(uint64_t offset,
                                                         io::ConstIoVec data) {
  std::vector<uint8_t> cluster(cluster_size_, 0);
  std::memcpy(cluster.data(), data.data(), data.size());
  std::vector<uint8_t> out(cluster_size_ - 1);
  absl::StatusOr<uint64_t> compressed =
      CompressCluster(header_.compression_type, cluster, absl::MakeSpan(out));
  if (!compressed.ok()) {
    if (absl::IsResourceExhausted(compressed.status())) {
      co_return co_await DoWrite(offset, data);  // does not compress
    }
    co_return compressed.status();
  }
  const uint64_t cluster_index = offset >> cluster_bits_;
  while (true) {
    auto lock = co_await io::ScopedLock::Take(meta_lock_);
    CO_RETURN_IF_ERROR(CheckUsable());
    CO_RETURN_IF_ERROR(co_await PrepareFirstWrite());
    if (std::shared_ptr<Inflight> other = FindInflight(cluster_index, 1)) {
      lock.Release();
      co_await other->done.Wait();
      continue;
    }
    CO_ASSIGN_OR_RETURN(TableCache::Ref l2, co_await GetL2ForWrite(l1_index(offset)));
    const uint64_t index = l2_index(offset);
    const L2Entry old = GetEntry(l2, index);
    if (old.compressed() || old.host_offset() != 0) {
      co_return absl::FailedPreconditionError(absl::StrFormat(
          "%s: compressed write to the allocated cluster at offset %u",
          filename(), offset));
    }
    CO_ASSIGN_OR_RETURN(const uint64_t host,
                        co_await refcounts_->AllocateBytes(*compressed));
    CO_RETURN_IF_ERROR(co_await CheckOverlapOrFail(host, *compressed, 0));
    CO_ASSIGN_OR_RETURN(const uint64_t word,
                        format::MakeCompressedL2Word(host, *compressed, cluster_bits_));
    auto inflight = AddInflight(cluster_index, 1, /*host=*/0);
    const uint64_t seq = BeginDataOp();
    l2.reset();
    lock.Release();
    co_await file_->DebugEvent(io::BlkdebugEvent::kWriteCompressed);
    absl::Status st =
        co_await file_->Write(host, io::ConstIoVec(out.data(), *compressed));
    EndDataOp(seq);
    auto relock = co_await io::ScopedLock::Take(meta_lock_);
    if (st.ok()) {
      ++write_gen_;
      st = CheckUsable();
    }
    if (st.ok()) {
      absl::StatusOr<TableCache::Ref> again =
          co_await GetL2ForWrite(l1_index(offset));
      if (again.ok()) {
        co_await file_->DebugEvent(io::BlkdebugEvent::kL2UpdateCompressed);
        L2Entry e;
        e.word = word;
        SetEntry(*again, index, e);
      } else {
        st = again.status();
      }
    }
    if (!st.ok() && broken_.ok()) {
      absl::Status undo = co_await refcounts_->Free(host, *compressed);
      (void)undo;
    }
    inflight_.erase(cluster_index);
    relock.Release();
    inflight->done.Set();
    co_return st;
  }
}

// ---- Write zeroes and discard --------------------------------------------------

io::Task<absl::Status> Qcow2Node::ForEachL2Range(
    uint64_t first, uint64_t count,
    std::function<io::Task<absl::Status>(uint64_t, uint64_t)> fn) {
  while (count > 0) {
    const uint64_t n = std::min(count, l2_entries_ - first % l2_entries_);
    auto lock = co_await io::ScopedLock::Take(meta_lock_);
    CO_RETURN_IF_ERROR(CheckUsable());
    CO_RETURN_IF_ERROR(co_await PrepareFirstWrite());
    if (std::shared_ptr<Inflight> other = FindInflight(first, n)) {
      lock.Release();
      co_await other->done.Wait();
      continue;
    }
    CO_RETURN_IF_ERROR(co_await fn(first, n));
    first += n;
    count -= n;
  }
  co_return absl::OkStatus();
}

io::Task<absl::Status> Qcow2Node::ZeroClusters(uint64_t first, uint64_t count,
                                               bool may_unmap) {
  if (header_.version < 3) {
    // No zero flag: without a backing file, unallocated reads as zeroes.
    co_return co_await DiscardClusters(first, count, /*full_discard=*/false);
  }
  CO_ASSIGN_OR_RETURN(TableCache::Ref l2,
                      co_await GetL2ForWrite(first / l2_entries_));
  const uint64_t index = first % l2_entries_;
  for (uint64_t i = 0; i < count; ++i) {
    const L2Entry old = GetEntry(l2, index + i);
    CO_ASSIGN_OR_RETURN(ClusterType type,
                        co_await Classify(old, l2.offset(), index + i));
    const bool unmap = type == ClusterType::kCompressed ||
                       (may_unmap && (type == ClusterType::kNormal ||
                                      type == ClusterType::kZeroAlloc));
    L2Entry e = unmap ? L2Entry{} : old;
    if (l2_format_.extended_l2) {
      e.bitmap = format::kSubclusterZeroMask;  // every subcluster reads zero
    } else {
      e.word |= format::kZeroFlag;
    }
    if (e == old) continue;
    if (unmap) CO_RETURN_IF_ERROR(co_await CheckFreeOrFail(old));
    SetEntry(l2, index + i, e);
    if (unmap) FreeEntryLater(old, /*discard=*/true);
  }
  co_return absl::OkStatus();
}

io::Task<absl::Status> Qcow2Node::DiscardClusters(uint64_t first,
                                                  uint64_t count,
                                                  bool full_discard) {
  const uint64_t li = first / l2_entries_;
  if (li >= l1_.size()) co_return absl::OkStatus();
  CO_ASSIGN_OR_RETURN(TableCache::Ref l2, co_await GetL2ForWrite(li));
  const uint64_t index = first % l2_entries_;
  for (uint64_t i = 0; i < count; ++i) {
    const L2Entry old = GetEntry(l2, index + i);
    CO_ASSIGN_OR_RETURN(ClusterType type,
                        co_await Classify(old, l2.offset(), index + i));
    L2Entry e = old;
    if (full_discard) {
      e = L2Entry{};
    } else if (has_backing_file() || IsAllocated(type)) {
      e = L2Entry{};
      if (l2_format_.extended_l2) {
        e.bitmap = format::kSubclusterZeroMask;
      } else if (header_.version >= 3) {
        e.word = format::kZeroFlag;
      }
    }
    if (e == old) continue;
    CO_RETURN_IF_ERROR(co_await CheckFreeOrFail(old));
    SetEntry(l2, index + i, e);
    FreeEntryLater(old, /*discard=*/true);
  }
  co_return absl::OkStatus();
}

io::Task<absl::Status> Qcow2Node::ChangeSubclusters(uint64_t offset,
                                                    uint64_t end, bool discard,
                                                    bool* fallback,
                                                    bool if_no_data) {
  const uint64_t cluster = offset >> cluster_bits_;
  const uint64_t in_cluster = offset & (cluster_size_ - 1);
  const uint32_t sc_bits = subcluster_bits();
  const uint32_t a = static_cast<uint32_t>(in_cluster >> sc_bits);
  const uint32_t b = static_cast<uint32_t>(std::min<uint64_t>(
      format::kSubclustersPerCluster,
      (in_cluster + (end - offset) + (uint64_t{1} << sc_bits) - 1) >> sc_bits));
  if (a >= b) co_return absl::OkStatus();
  const uint64_t range = format::SubclusterAllocRange(a, b - a);
  co_return co_await ForEachL2Range(
      cluster, 1, [&](uint64_t, uint64_t) -> io::Task<absl::Status> {
        const uint64_t li = l1_index(offset);
        if (discard && !has_backing_file() &&
            (li >= l1_.size() || (l1_[li] & format::kL1OffsetMask) == 0)) {
          co_return absl::OkStatus();  // reads as zeroes already
        }
        CO_ASSIGN_OR_RETURN(TableCache::Ref l2, co_await GetL2ForWrite(li));
        const uint64_t index = l2_index(offset);
        const L2Entry old = GetEntry(l2, index);
        CO_ASSIGN_OR_RETURN(const ClusterType type,
                            co_await Classify(old, l2.offset(), index));
        if (type == ClusterType::kCompressed) {
          // Never subdivided: zeroes are written as data, discards dropped.
          if (!discard) *fallback = true;
          co_return absl::OkStatus();
        }
        if (discard && !has_backing_file() && old.host_offset() == 0) {
          co_return absl::OkStatus();  // reads as zeroes already
        }
        if (if_no_data && (old.bitmap & range) != 0) {
          *fallback = true;  // written meanwhile
          co_return absl::OkStatus();
        }
        L2Entry e = old;
        e.bitmap =
            (old.bitmap & ~range) | format::SubclusterZeroRange(a, b - a);
        const bool free_host = discard && old.host_offset() != 0 &&
                               (e.bitmap & format::kSubclusterAllocMask) == 0;
        if (free_host) e.word = 0;  // no data left: the host cluster goes
        if (e == old) co_return absl::OkStatus();
        if (free_host) CO_RETURN_IF_ERROR(co_await CheckFreeOrFail(old));
        SetEntry(l2, index, e);
        if (free_host) FreeEntryLater(old, /*discard=*/true);
        co_return absl::OkStatus();
      });
}

io::Task<bool> Qcow2Node::ReadsZero(uint64_t offset, uint64_t length) {
  const uint64_t end = std::min(offset + length, size());
  while (offset < end) {
    absl::StatusOr<Mapping> m;
    {
      auto lock = co_await io::ScopedLock::Take(meta_lock_);
      m = co_await GetMapping(offset, end - offset);
    }
    if (!m.ok()) co_return false;
    const uint64_t n = std::min(m->length, end - offset);
    if (m->type == ClusterType::kUnallocated) {
      const bool zero = co_await BackingReadsZero(offset, n);
      if (!zero) co_return false;
    } else if (m->type != ClusterType::kZeroPlain &&
               m->type != ClusterType::kZeroAlloc) {
      co_return false;
    }
    offset += n;
  }
  co_return true;
}

io::Task<absl::Status> Qcow2Node::ZeroizeExtended(uint64_t offset,
                                                  uint64_t length,
                                                  bool may_unmap,
                                                  bool if_no_data,
                                                  bool* fallback) {
  const uint64_t cluster_mask = cluster_size_ - 1;
  uint64_t end = offset + length;
  const uint64_t head =
      std::min(end, (offset + cluster_mask) & ~cluster_mask) - offset;
  offset += head;
  const uint64_t tail =
      end >= size() ? 0 : end - std::max(offset, end & ~cluster_mask);
  end -= tail;
  if (head != 0) {
    CO_RETURN_IF_ERROR(co_await ChangeSubclusters(
        offset - head, offset, /*discard=*/false, fallback, if_no_data));
    if (*fallback) co_return absl::OkStatus();
  }
  if (offset < end) {
    CO_RETURN_IF_ERROR(co_await ForEachL2Range(
        offset >> cluster_bits_, (end - offset + cluster_mask) >> cluster_bits_,
        [&](uint64_t first, uint64_t count) -> io::Task<absl::Status> {
          if (if_no_data) {
            // One subcluster, the first of its cluster: it must still hold
            // no data (QEMU checks under the same lock).
            CO_ASSIGN_OR_RETURN(TableCache::Ref l2,
                                co_await GetL2ForWrite(first / l2_entries_));
            const L2Entry e = GetEntry(l2, first % l2_entries_);
            if (e.compressed() ||
                (e.bitmap & format::SubclusterAllocBit(0)) != 0) {
              *fallback = true;
              co_return absl::OkStatus();
            }
          }
          co_return co_await ZeroClusters(first, count, may_unmap);
        }));
    if (*fallback) co_return absl::OkStatus();
  }
  if (tail != 0) {
    CO_RETURN_IF_ERROR(co_await ChangeSubclusters(
        end, end + tail, /*discard=*/false, fallback, if_no_data));
  }
  co_return absl::OkStatus();
}

io::Task<absl::Status> Qcow2Node::WriteZeroesExtended(uint64_t offset,
                                                      uint64_t length,
                                                      bool may_unmap) {
  const uint64_t sc_size = uint64_t{1} << subcluster_bits();
  const uint64_t sc_mask = sc_size - 1;
  // QEMU hands its driver at most INT_MAX bytes (rounded down to the
  // alignment) per zero request, and writes at most 16 MiB of explicit
  // zeroes per fallback step (MAX_BOUNCE_BUFFER).
  const uint64_t max_request = (uint64_t{INT32_MAX} / sc_size) * sc_size;
  constexpr uint64_t kMaxFallback = uint64_t{16} << 20;
  while (length > 0) {
    // bdrv_co_do_pwrite_zeroes: the unaligned head alone, then the
    // subcluster-aligned bulk, then the unaligned tail alone.
    uint64_t num = length;
    const uint64_t head = offset & sc_mask;
    const uint64_t tail = (offset + length) & sc_mask;
    if (head != 0) {
      num = std::min(length, sc_size - head);
    } else if (tail != 0 && num > sc_size) {
      num -= tail;
    }
    num = std::min(num, max_request);
    bool fallback = false;
    // qcow2_co_pwrite_zeroes: a request that does not cover its
    // subclusters whole zeroes the one subcluster it lies in when the rest
    // of that reads zeroes and holds no data.
    const uint64_t req_head = head;
    uint64_t req_tail = ((offset + num + sc_mask) & ~sc_mask) - (offset + num);
    if (offset + num == size()) req_tail = 0;
    if (req_head != 0 || req_tail != 0) {
      bool zero = co_await ReadsZero(offset - req_head, req_head);
      if (zero) zero = co_await ReadsZero(offset + num, req_tail);
      if (zero) {
        CO_RETURN_IF_ERROR(co_await ZeroizeExtended(
            offset - req_head, sc_size, may_unmap, /*if_no_data=*/true,
            &fallback));
      } else {
        fallback = true;
      }
    } else {
      CO_RETURN_IF_ERROR(co_await ZeroizeExtended(
          offset, num, may_unmap, /*if_no_data=*/false, &fallback));
    }
    if (fallback) {
      // Not supported (a compressed cluster, or data around the request):
      // zeroes written as data, as QEMU's generic fallback does.
      num = std::min(num, kMaxFallback);
      io::AlignedBuffer zeroes(num);
      CO_RETURN_IF_ERROR(
          co_await DoWrite(offset, io::ConstIoVec(zeroes.data(), num)));
    }
    offset += num;
    length -= num;
  }
  co_return absl::OkStatus();
}

io::Task<absl::Status> Qcow2Node::WriteZeroesPartial(uint64_t offset,
                                                     uint64_t length,
                                                     bool may_unmap) {
  const uint64_t start = offset & ~(cluster_size_ - 1);
  const uint64_t end = std::min(start + cluster_size_, size());
  const uint64_t cluster = start >> cluster_bits_;
  // The rest of the cluster must already read as zeroes (QEMU's is_zero():
  // a zero cluster does, an unallocated one where the backing file reads
  // zeroes), and the cluster must hold no data, for a zero cluster to do.
  ClusterType type;
  {
    auto lock = co_await io::ScopedLock::Take(meta_lock_);
    CO_RETURN_IF_ERROR(CheckUsable());
    CO_ASSIGN_OR_RETURN(Mapping m, co_await GetMapping(start, cluster_size_));
    type = m.type;
  }
  bool zero_ok = type == ClusterType::kZeroPlain || type == ClusterType::kZeroAlloc;
  if (type == ClusterType::kUnallocated) {
    // Not `co_await a && co_await b`: GCC 12 mishandles the temporaries of
    // a co_await in a conditionally evaluated operand.
    zero_ok = co_await BackingReadsZero(start, offset - start);
    if (zero_ok) {
      zero_ok = co_await BackingReadsZero(offset + length, end - (offset + length));
    }
  }
  if (zero_ok) {
    bool fallback = false;
    CO_RETURN_IF_ERROR(co_await ForEachL2Range(
        cluster, 1, [&](uint64_t first, uint64_t) -> io::Task<absl::Status> {
          CO_ASSIGN_OR_RETURN(Mapping m, co_await GetMapping(start, cluster_size_));
          if (m.type == ClusterType::kUnallocated) {
            if (header_.version < 3) co_return absl::OkStatus();  // reads zero
          } else if (m.type != ClusterType::kZeroPlain &&
                     m.type != ClusterType::kZeroAlloc) {
            fallback = true;
            co_return absl::OkStatus();
          }
          co_return co_await ZeroClusters(first, 1, may_unmap);
        }));
    if (!fallback) co_return absl::OkStatus();
  }
  co_return co_await DoWrite(offset, Zeroes(length));
}

io::Task<absl::Status> Qcow2Node::DoWriteZeroes(uint64_t offset,
                                                uint64_t length,
                                                io::WriteZeroesFlags flags) {
  if (offset > size() || length > size() - offset) {
    co_return absl::OutOfRangeError(absl::StrFormat(
        "%s: zero write of %u bytes at offset %u is beyond the end of the "
        "image (%u bytes)",
        filename(), length, offset, size()));
  }
  MarkDirty(offset, length);  // bitmaps (qcow2_bitmap.cc)
  if (header_.version < 3 && has_backing_file()) {
    co_return absl::UnimplementedError("write zeroes");
  }
  if (l2_format_.extended_l2) {
    co_return co_await WriteZeroesExtended(offset, length, flags.may_unmap);
  }
  co_return co_await ForEachClusterPiece(
      offset, length,
      [this, flags](uint64_t f, uint64_t n) {
        return ZeroClusters(f, n, flags.may_unmap);
      },
      [this, flags](uint64_t pos, uint64_t end) {
        return WriteZeroesPartial(pos, end - pos, flags.may_unmap);
      });
}

io::Task<absl::Status> Qcow2Node::DoDiscard(uint64_t offset, uint64_t length) {
  if (offset > size() || length > size() - offset) {
    co_return absl::OutOfRangeError(absl::StrFormat(
        "%s: discard of %u bytes at offset %u is beyond the end of the image "
        "(%u bytes)",
        filename(), length, offset, size()));
  }
  MarkDirty(offset, length);  // bitmaps (qcow2_bitmap.cc)
  // Version 2 has no zero flag: discarded clusters would show the backing
  // file's data again. QEMU 7.2's qcow2_co_pdiscard refuses (-ENOTSUP, which
  // bdrv_co_pdiscard reports as success): the data stays.
  if (header_.version < 3 && has_backing_file()) co_return absl::OkStatus();
  co_return co_await ForEachClusterPiece(
      offset, length,
      [this](uint64_t f, uint64_t n) {
        return DiscardClusters(f, n, /*full_discard=*/false);
      },
      [this](uint64_t pos, uint64_t end) -> io::Task<absl::Status> {
        // Partial clusters are dropped; with extended L2 entries whole
        // subclusters in them read as zeroes afterwards (QEMU drops partial
        // subclusters).
        if (!l2_format_.extended_l2) co_return absl::OkStatus();
        const uint64_t sc_mask = (uint64_t{1} << subcluster_bits()) - 1;
        const uint64_t a = (pos + sc_mask) & ~sc_mask;
        const uint64_t b = end == size() ? end : end & ~sc_mask;
        if (a >= b) co_return absl::OkStatus();
        bool fallback = false;
        co_return co_await ChangeSubclusters(a, b, /*discard=*/true, &fallback);
      });
}

io::Task<absl::Status> Qcow2Node::ForEachClusterPiece(
    uint64_t offset, uint64_t length,
    std::function<io::Task<absl::Status>(uint64_t, uint64_t)> whole,
    std::function<io::Task<absl::Status>(uint64_t, uint64_t)> partial) {
  const uint64_t mask = cluster_size_ - 1;
  const uint64_t end = offset + length;
  uint64_t pos = offset;
  while (pos < end) {
    const uint64_t cluster_end = (pos & ~mask) + cluster_size_;
    const uint64_t seg_end = std::min(end, cluster_end);
    if ((pos & mask) != 0 || (seg_end != cluster_end && seg_end != size())) {
      CO_RETURN_IF_ERROR(co_await partial(pos, seg_end));
      pos = seg_end;
      continue;
    }
    // A run of whole clusters (the last one may end at the image end).
    const uint64_t run_end =
        end == size() ? (end + mask) & ~mask : end & ~mask;
    CO_RETURN_IF_ERROR(co_await ForEachL2Range(
        pos >> cluster_bits_, (run_end - pos) >> cluster_bits_, whole));
    pos = std::min(run_end, end);
  }
  co_return absl::OkStatus();
}

// ---- Block status ----------------------------------------------------------------

io::Task<bool> Qcow2Node::DetectMetadataPreallocation() {
  // QEMU's qcow2_detect_metadata_preallocation(): many more clusters in use
  // than the file has allocated means preallocated, unwritten clusters.
  absl::StatusOr<uint64_t> allocated = file_->AllocatedSize();
  if (!allocated.ok()) co_return false;
  const uint64_t real_clusters = *allocated >> cluster_bits_;
  const uint64_t threshold =
      std::max(real_clusters * 10 / 9, real_clusters + 2);
  const uint64_t end_cluster =
      (FileSize() + cluster_size_ - 1) >> cluster_bits_;
  uint64_t count = 0;
  for (uint64_t i = 0; i < end_cluster && count < threshold; ++i) {
    absl::StatusOr<uint64_t> rc = co_await refcounts_->Get(i);
    if (!rc.ok()) co_return false;
    count += *rc != 0;
  }
  co_return count >= threshold;
}

io::Task<absl::StatusOr<io::BlockStatus>> Qcow2Node::DoGetBlockStatus(
    uint64_t offset, uint64_t max_length) {
  co_return co_await LayerStatus(offset, max_length, /*want_zero=*/true);
}

io::Task<absl::StatusOr<io::BlockStatus>> Qcow2Node::GetAllocationStatus(
    uint64_t offset, uint64_t max_length) {
  if (offset >= size()) {
    co_return absl::OutOfRangeError(absl::StrCat(
        filename(), ": block status at ", offset, " is past the end"));
  }
  co_return co_await LayerStatus(offset, std::min(max_length, size() - offset),
                                 /*want_zero=*/false);
}

io::Task<absl::StatusOr<io::BlockStatus>> Qcow2Node::LayerStatus(
    uint64_t offset, uint64_t max_length, bool want_zero) {
  auto lock = co_await io::ScopedLock::Take(meta_lock_);
  CO_RETURN_IF_ERROR(CheckUsable());
  CO_ASSIGN_OR_RETURN(Mapping m, co_await GetMapping(offset, max_length));
  if (!metadata_preallocation_.has_value()) {
    metadata_preallocation_ = co_await DetectMetadataPreallocation();
  }
  lock.Release();
  io::BlockStatus s;
  s.length = m.length;
  switch (m.type) {
    case ClusterType::kUnallocated:
      if (m.host_offset != 0) {
        // Extended L2: reserved host cluster, subcluster not written.
        s.offset_valid = true;
        s.host_offset = m.host_offset;
        s.file = file_.get();
      }
      break;
    case ClusterType::kZeroPlain:
      s.zero = true;
      break;
    case ClusterType::kZeroAlloc:
      s.zero = true;
      s.offset_valid = true;
      s.host_offset = m.host_offset;
      s.file = file_.get();
      break;
    case ClusterType::kCompressed:
      s.data = true;
      break;
    case ClusterType::kNormal:
      s.data = true;
      s.offset_valid = true;
      s.host_offset = m.host_offset;
      s.file = file_.get();
      if (want_zero && *metadata_preallocation_) {
        // Preallocated clusters the file has no data for read as zeroes.
        if (m.host_offset >= file_->size()) {
          s.zero = true;
        } else {
          absl::StatusOr<io::BlockStatus> fs =
              co_await file_->GetBlockStatus(m.host_offset, m.length);
          if (fs.ok()) {
            s.length = std::min(s.length, fs->length);
            s.zero = fs->zero;
          }
        }
      }
      break;
  }
  co_return s;
}

}  // namespace imgtool::qcow2

#include "qcow2/check.h"

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/types/span.h"
#include "base/errno_status.h"
#include "base/status_macros.h"
#include "qcow2/bitmap_load.h"
#include "qcow2/format/endian.h"
#include "qcow2/format/header.h"
#include "qcow2/format/l2_entry.h"
#include "qcow2/format/refcount.h"
#include "qcow2/format/snapshot.h"
#include "qcow2/snapshot_load.h"

namespace imgtool::qcow2 {
namespace {

using format::kCompressedFlag;
using format::kCopiedFlag;
using format::kZeroFlag;
using format::internal::LoadBE16;
using format::internal::LoadBE32;
using format::internal::LoadBE64;
using format::internal::StoreBE32;
using format::internal::StoreBE64;

// QEMU's limits and constants used by the check (block/qcow2.h).
constexpr uint64_t kInt64Max = uint64_t{INT64_MAX};
constexpr uint64_t kMaxBitmapTableEntries = 0x8000000;
constexpr uint64_t kBitmapTableOffsetMask = 0x00fffffffffffe00;
constexpr uint64_t kBitmapTableReservedMask = 0xff000000000001fe;
constexpr uint64_t kBitmapTableAllOnes = 1;
constexpr uint64_t kBitmapDirEntryHeaderSize = 24;
constexpr uint64_t kReadChunk = uint64_t{1} << 20;  // L1 / bitmap tables

// Header field offsets written by the checker.
constexpr uint64_t kOffNbSnapshots = 60;
constexpr uint64_t kOffSnapshotsOffset = 64;
constexpr uint64_t kOffRefcountTableOffset = 48;
constexpr uint64_t kOffIncompatibleFeatures = 72;

// How far `check -r all` grows the file to take in a refcount block that
// lies past its end (QEMU truncates the file to the block's end). Beyond
// this the growth is refused as QEMU's truncate fails on ext4 (EFBIG), and
// the refcount structure is rebuilt instead, so memory stays bounded by
// the file size.
constexpr uint64_t kMaxGrowSlack = uint64_t{1} << 30;

// Program-prefixed lines (QEMU's error_report) in `messages`.
constexpr char kReportPrefix[] = "imgtool: ";

// Metadata kinds of QEMU's overlap check, in its bit order.
enum Overlap : uint32_t {
  kOlMainHeader = 1u << 0,
  kOlActiveL1 = 1u << 1,
  kOlActiveL2 = 1u << 2,
  kOlRefcountTable = 1u << 3,
  kOlRefcountBlock = 1u << 4,
  kOlSnapshotTable = 1u << 5,
  kOlInactiveL1 = 1u << 6,
  kOlInactiveL2 = 1u << 7,
  kOlBitmapDirectory = 1u << 8,
};
// QEMU's default overlap-check template, "cached": everything but
// inactive L2 tables.
constexpr uint32_t kOlCached = 0x1ff & ~kOlInactiveL2;
constexpr const char* kOverlapNames[] = {
    "qcow2_header",      "active L1 table",   "active L2 table",
    "refcount table",    "refcount block",    "snapshot table",
    "inactive L1 table", "inactive L2 table", "bitmap directory",
};

// A failed step with QEMU's -errno: the status message is strerror(errno),
// which qemu-img prints after "Check failed: ".
absl::Status ErrnoError(int error_number) {
  const std::string text = std::strerror(error_number);
  switch (error_number) {
    case EINVAL:
      return absl::InvalidArgumentError(text);
    case EFBIG:
      return absl::OutOfRangeError(text);
    case ENOMEM:
      return absl::ResourceExhaustedError(text);
    default:
      return absl::DataLossError(text);
  }
}

// strerror of a status's errno, as QEMU prints -ret: ErrnoError's statuses
// carry it as their message, others default to EIO.
std::string ErrnoText(const absl::Status& st) {
  const int e = StatusErrno(st);
  if (e != 0) return std::strerror(e);
  if (st.code() != absl::StatusCode::kDataLoss || st.message().empty()) {
    return std::string(st.message().empty() ? std::strerror(EIO) : st.message());
  }
  return std::string(st.message());
}

uint64_t DivRoundUp(uint64_t a, uint64_t b) { return a / b + (a % b != 0); }

void Add(CheckResult& out, const CheckResult& src, bool allocation_info) {
  out.corruptions += src.corruptions;
  out.leaks += src.leaks;
  out.check_errors += src.check_errors;
  out.corruptions_fixed += src.corruptions_fixed;
  out.leaks_fixed += src.leaks_fixed;
  if (allocation_info) {
    out.image_end_offset = src.image_end_offset;
    out.total_clusters = src.total_clusters;
    out.allocated_clusters = src.allocated_clusters;
    out.fragmented_clusters = src.fragmented_clusters;
    out.compressed_clusters = src.compressed_clusters;
  }
}

// The refcounts the references imply, one packed entry of refcount_bits
// per host cluster, laid out like consecutive refcount blocks (so block i
// of a rebuilt structure is bytes [i * cluster_size, (i + 1) *
// cluster_size)). QEMU's "in-memory refcount table".
class RefcountArray {
 public:
  RefcountArray(uint32_t cluster_bits, uint32_t refcount_order)
      : cluster_bits_(cluster_bits), refcount_order_(refcount_order) {}

  uint64_t size() const { return clusters_; }
  uint64_t Get(uint64_t index) const {
    if (index >= clusters_) return 0;
    return format::GetRefcount(bytes_, index, refcount_order_);
  }
  void Set(uint64_t index, uint64_t value) {
    format::SetRefcount(absl::MakeSpan(bytes_), index, refcount_order_, value);
  }
  // Grows (never shrinks) to cover `clusters` clusters; new entries are 0.
  // The byte size stays a whole number of clusters.
  void Resize(uint64_t clusters) {
    if (clusters <= clusters_) return;
    const uint64_t bits = clusters << refcount_order_;
    const uint64_t bytes =
        DivRoundUp(DivRoundUp(bits, 8), cluster_size()) * cluster_size();
    if (bytes > bytes_.size()) bytes_.resize(bytes, 0);
    clusters_ = clusters;
  }
  void Clear() { std::fill(bytes_.begin(), bytes_.end(), 0); }
  // Refcount block `index` as it would be written (one cluster).
  absl::Span<const uint8_t> Block(uint64_t index) const {
    return absl::MakeConstSpan(bytes_).subspan(index * cluster_size(),
                                               cluster_size());
  }

 private:
  uint64_t cluster_size() const { return uint64_t{1} << cluster_bits_; }
  uint32_t cluster_bits_;
  uint32_t refcount_order_;
  uint64_t clusters_ = 0;
  std::vector<uint8_t> bytes_;
};

enum class ClusterType {
  kUnallocated,
  kZeroPlain,
  kZeroAlloc,
  kNormal,
  kCompressed
};

// A snapshot table entry as QEMU 7.2's qcow2_do_read_snapshots keeps it
// (with -r all: extra data cut to 1024 bytes), enough to write it back.
using Snapshot = format::SnapshotEntry;

struct Bitmap {
  uint64_t table_offset = 0;
  uint32_t table_size = 0;  // entries
};

class Checker {
 public:
  Checker(io::BlockNode& file, std::ostream& out) : file_(file), out_(out) {}

  // Reads the header, the active L1 table and the refcount table, and with
  // `load_bitmaps` the persistent bitmaps as the qcow2 driver's open does
  // (qemu-img check opens the image first; bitmaps QEMU cannot load fail
  // it). Errors are qemu-img's open errors (message without "Could not
  // open").
  io::Task<absl::Status> Open(bool load_bitmaps = false);

  // One check (qcow2_co_check_locked). Errors: the check stopped.
  io::Task<absl::StatusOr<CheckResult>> Check(RepairMode mode);

  bool has_bitmaps() const { return header_.bitmaps.has_value(); }

  // Writes back what is cached and clears the dirty bit of an image opened
  // for writing, as closing a qcow2 node does.
  io::Task<absl::Status> Close();

 private:
  uint64_t cluster_size() const { return uint64_t{1} << cluster_bits_; }
  bool writable() const { return !file_.read_only(); }
  uint64_t OffsetIntoCluster(uint64_t offset) const {
    return offset & (cluster_size() - 1);
  }
  uint64_t StartOfCluster(uint64_t offset) const {
    return offset & ~(cluster_size() - 1);
  }
  uint64_t ReftableEntry(uint64_t index) const {
    return index < reftable_.size() ? reftable_[index] : 0;
  }
  ClusterType GetClusterType(uint64_t word) const;

  // Reads `length` bytes at `offset` of the file (zeros past its end).
  io::Task<absl::Status> ReadAt(uint64_t offset, absl::Span<uint8_t> buf) {
    co_return co_await file_.Read(offset, buf);
  }
  io::Task<absl::StatusOr<std::vector<uint64_t>>> ReadTable(uint64_t offset,
                                                            uint64_t entries);
  // On a writable image: clears the autoclear feature bits this code does
  // not know (outside format::kAutoclearFeaturesKnown), rewriting the header.
  io::Task<absl::Status> ClearUnknownAutoclearBits();

  // QEMU's qcow2_signal_corruption: prints the event once; a fatal one on a
  // writable image sets the corrupt bit on disk.
  io::Task<absl::Status> SignalCorruption(bool fatal, std::string message);
  // QEMU's qcow2_pre_write_overlap_check: kDataLoss ("Input/output
  // error") when [offset, offset + size) touches metadata not in `ignore`.
  io::Task<absl::Status> OverlapCheck(uint32_t ignore, uint64_t offset,
                                      uint64_t size);
  uint32_t MetadataOverlap(uint32_t ignore, uint64_t offset,
                           uint64_t size) const;
  io::Task<absl::Status> WriteHeaderFeatures();

  // Stored refcounts (qcow2_get_refcount / update_refcount), through a
  // one-block write-back cache.
  io::Task<absl::StatusOr<uint64_t>> GetStoredRefcount(uint64_t cluster);
  io::Task<absl::Status> SetStoredRefcount(uint64_t cluster, uint64_t value);
  io::Task<absl::Status> LoadRefblock(uint64_t offset);
  io::Task<absl::Status> WriteBackRefblock();
  // Writes back the cache, flushes, then discards freed clusters.
  io::Task<absl::Status> CommitRefcounts();
  // For a free of a cluster past what any refcount table can cover, as
  // QEMU's alloc_refcount_block: the first free cluster (in existing
  // refcount blocks) gets refcount 1 and is written as an empty refcount
  // block, then the table cannot grow: EFBIG (ENOSPC if none is free).
  io::Task<absl::Status> LeakRefblockForFree();
  // Discards the clusters whose refcount repairs set to 0 (unreferenced).
  io::Task<void> DiscardFreed();

  // qcow2_check_read_snapshot_table: reads the snapshot table; with -r all
  // drops overhanging snapshots (header count rewritten at once), cuts
  // extra data to 1024 bytes and counts incomplete version 3 entries, all
  // as corruptions for FixSnapshotTable.
  io::Task<absl::Status> ReadSnapshotTable(CheckResult& res, RepairMode mode);
  // qcow2_check_fix_snapshot_table: with -r all and corruptions left in
  // `res`, writes the snapshot table anew (qcow2_write_snapshots: first
  // free clusters, then the header, then the old table freed).
  io::Task<absl::Status> FixSnapshotTable(CheckResult& res, RepairMode mode);
  io::Task<absl::Status> WriteSnapshotTable();
  io::Task<absl::Status> CheckRefcounts(CheckResult& res, RepairMode mode);
  io::Task<absl::Status> CalculateRefcounts(CheckResult& res, RepairMode mode,
                                            bool& rebuild, RefcountArray& refs);
  void IncRefcounts(CheckResult& res, RefcountArray& refs, uint64_t offset,
                    uint64_t size);
  // A table of `size` bytes at `offset` that the end of the file cuts, by
  // less than one cluster (further is IncRefcounts' error): its missing
  // entries would read as zero and a partly present one as garbage, which
  // QEMU 7.2 reports as neither. A corruption; -r all zeroes the partly
  // present entry (of `entry_size` bytes) and grows the file to the end of
  // the table. Never fails: a failed repair is reported and left counted
  // as a corruption, as growing the file for a refcount block is.
  io::Task<absl::Status> CheckCutTable(CheckResult& res, RepairMode mode,
                                       absl::string_view what, uint64_t offset,
                                       uint64_t size, uint64_t entry_size);
  io::Task<absl::Status> CheckRefcountsL1(CheckResult& res, RefcountArray& refs,
                                          uint64_t l1_offset, uint64_t l1_size,
                                          bool frag_info, RepairMode mode,
                                          bool active);
  io::Task<absl::Status> CheckRefcountsL2(CheckResult& res, RefcountArray& refs,
                                          uint64_t l2_offset, bool frag_info,
                                          RepairMode mode, bool active);
  io::Task<absl::Status> FixL2EntryByZero(CheckResult& res, uint64_t l2_offset,
                                          std::vector<uint8_t>& table,
                                          uint64_t index, bool active,
                                          bool& metadata_overlap);
  io::Task<absl::Status> CheckBitmapsRefcounts(CheckResult& res,
                                               RefcountArray& refs);
  io::Task<absl::Status> CheckRefblocks(CheckResult& res, RepairMode mode,
                                        bool& rebuild, RefcountArray& refs);
  io::Task<uint64_t> CompareRefcounts(CheckResult& res, RepairMode mode,
                                      bool& rebuild, RefcountArray& refs);
  io::Task<absl::Status> RebuildRefcountStructure(CheckResult& res,
                                                  RefcountArray& refs);
  io::Task<absl::StatusOr<bool>> WriteRefblocks(
      RefcountArray& refs, uint64_t first_cluster, uint64_t end_cluster,
      std::vector<uint64_t>& reftable);
  uint64_t AllocClusters(uint64_t count, RefcountArray& refs,
                         uint64_t& first_free_cluster);
  io::Task<absl::Status> CheckOflagCopied(CheckResult& res, RepairMode mode);

  io::BlockNode& file_;
  std::ostream& out_;

  format::Header header_;
  uint32_t cluster_bits_ = 16;
  uint32_t refcount_order_ = 4;
  uint32_t refblock_bits_ = 15;  // log2 of refcounts per refcount block
  uint64_t l2_entries_ = 0;      // entries per L2 table
  uint64_t l2_entry_size_ = 8;
  bool extended_l2_ = false;
  bool data_file_ = false;
  uint64_t incompatible_features_ = 0;

  // Active L1 table: the header's size, the entries inside the file (the
  // rest read as zero).
  uint64_t l1_offset_ = 0;
  uint64_t l1_size_ = 0;
  std::vector<uint64_t> l1_table_;

  // Refcount table: size in entries, the entries inside the file.
  uint64_t reftable_offset_ = 0;
  uint64_t reftable_size_ = 0;
  std::vector<uint64_t> reftable_;

  // Snapshot table as the header points to it (read by each check).
  uint32_t raw_nb_snapshots_ = 0;
  uint64_t raw_snapshots_offset_ = 0;
  uint64_t snapshots_offset_ = 0;
  uint64_t snapshots_size_ = 0;  // bytes
  std::vector<Snapshot> snapshots_;

  bool signaled_corruption_ = false;
  // The image was marked corrupt (QEMU's fatal qcow2_signal_corruption
  // takes the driver away: nothing is written after it, not even the
  // refcounts still cached).
  bool marked_corrupt_ = false;
  // CheckCutTable found a table that the end of the file cuts.
  bool cut_table_ = false;

  // One cached refcount block.
  struct RefblockCache {
    bool valid = false;
    bool dirty = false;
    uint64_t offset = 0;
    std::vector<uint8_t> data;
  } refblock_;
  bool refcounts_written_ = false;
  std::vector<uint64_t> freed_clusters_;  // to discard after commit
};

ClusterType Checker::GetClusterType(uint64_t word) const {
  if (word & kCompressedFlag) return ClusterType::kCompressed;
  if ((word & kZeroFlag) && !extended_l2_) {
    return (word & format::kL2OffsetMask) ? ClusterType::kZeroAlloc
                                          : ClusterType::kZeroPlain;
  }
  if (!(word & format::kL2OffsetMask)) {
    // Offset 0 is a valid data offset in an external data file, where
    // every cluster has refcount 1 and so COPIED set.
    if (data_file_ && (word & kCopiedFlag)) return ClusterType::kNormal;
    return ClusterType::kUnallocated;
  }
  return ClusterType::kNormal;
}

io::Task<absl::StatusOr<std::vector<uint64_t>>> Checker::ReadTable(
    uint64_t offset, uint64_t entries) {
  // Only the part inside the file can hold non-zero entries.
  const uint64_t file_size = file_.size();
  uint64_t in_file = 0;
  if (offset < file_size) {
    in_file = std::min(entries, (file_size - offset) / 8);
  }
  std::vector<uint64_t> table(in_file);
  std::vector<uint8_t> buf;
  for (uint64_t i = 0; i < in_file;) {
    const uint64_t n = std::min(in_file - i, kReadChunk / 8);
    buf.resize(n * 8);
    CO_RETURN_IF_ERROR(co_await ReadAt(offset + i * 8, absl::MakeSpan(buf)));
    for (uint64_t j = 0; j < n; ++j) {
      table[i + j] = format::LoadL1Entry(buf, j);  // a big-endian u64
    }
    i += n;
  }
  co_return table;
}

io::Task<absl::Status> Checker::Open(bool load_bitmaps) {
  std::vector<uint8_t> head(512);
  CO_RETURN_IF_ERROR(co_await ReadAt(0, absl::MakeSpan(head)));
  // cluster_bits (offset 20) decides how much DecodeHeader needs.
  const uint32_t bits = LoadBE32(head.data() + 20);
  if (bits >= format::kMinClusterBits && bits <= format::kMaxClusterBits) {
    head.resize(uint64_t{1} << bits);
    CO_RETURN_IF_ERROR(co_await ReadAt(0, absl::MakeSpan(head)));
  }
  // QEMU opens an image for checking without reading the snapshot table
  // (the check reads and reports it), and reads tables past the end of the
  // file as zeros (the check reports them): decode without those limits.
  std::vector<uint8_t> patched = head;
  raw_nb_snapshots_ = LoadBE32(head.data() + kOffNbSnapshots);
  raw_snapshots_offset_ = LoadBE64(head.data() + kOffSnapshotsOffset);
  std::fill(patched.begin() + kOffNbSnapshots,
            patched.begin() + kOffSnapshotsOffset + 8, 0);
  CO_ASSIGN_OR_RETURN(header_, format::DecodeHeader(patched, kInt64Max));

  cluster_bits_ = header_.cluster_bits;
  refcount_order_ = header_.refcount_order;
  refblock_bits_ = cluster_bits_ + 3 - refcount_order_;
  extended_l2_ = header_.extended_l2();
  data_file_ = header_.has_data_file();
  l2_entry_size_ = format::L2EntrySize(extended_l2_);
  l2_entries_ = format::L2EntriesPerCluster(cluster_bits_, extended_l2_);
  incompatible_features_ = header_.incompatible_features;

  l1_offset_ = header_.l1_table_offset;
  l1_size_ = header_.l1_size;
  CO_ASSIGN_OR_RETURN(l1_table_, co_await ReadTable(l1_offset_, l1_size_));

  reftable_offset_ = header_.refcount_table_offset;
  reftable_size_ =
      (uint64_t{header_.refcount_table_clusters} << cluster_bits_) / 8;
  CO_ASSIGN_OR_RETURN(reftable_,
                      co_await ReadTable(reftable_offset_, reftable_size_));
  if (load_bitmaps && header_.bitmaps.has_value()) {
    // Before anything is written, as in qcow2_do_open.
    CO_RETURN_IF_ERROR((co_await LoadPersistentBitmaps(
                            file_, *header_.bitmaps, cluster_bits_,
                            header_.size))
                           .status());
  }
  co_return co_await ClearUnknownAutoclearBits();
}

io::Task<absl::Status> Checker::ClearUnknownAutoclearBits() {
  // QEMU's qcow2_do_open clears them on every writable open, so `qemu-img
  // check -r` does before checking: the features they stand for are no
  // longer maintained. The header is rewritten as qcow2_update_header does.
  if (!writable() || header_.version < 3 ||
      (header_.autoclear_features & ~format::kAutoclearFeaturesKnown) == 0) {
    co_return absl::OkStatus();
  }
  format::Header h = header_;
  h.autoclear_features &= format::kAutoclearFeaturesKnown;
  h.nb_snapshots = raw_nb_snapshots_;
  h.snapshots_offset = raw_snapshots_offset_;
  std::vector<uint8_t> bytes = format::EncodeHeader(h);
  if (bytes.size() > cluster_size()) {
    co_return ErrnoError(ENOSPC);  // as qcow2_update_header
  }
  bytes.resize(cluster_size(), 0);
  CO_RETURN_IF_ERROR(co_await file_.Write(0, bytes));
  CO_RETURN_IF_ERROR(co_await file_.Flush());
  header_.autoclear_features = h.autoclear_features;
  co_return absl::OkStatus();
}

// ---- Corruption signalling and the overlap check -------------------------

io::Task<absl::Status> Checker::SignalCorruption(bool fatal,
                                                 std::string message) {
  fatal = fatal && writable();
  if (signaled_corruption_ &&
      (!fatal || (incompatible_features_ & format::kIncompatibleCorrupt))) {
    co_return absl::OkStatus();
  }
  signaled_corruption_ = true;
  if (!fatal) {
    out_ << "qcow2: Image is corrupt: " << message
         << "; further non-fatal corruption events will be suppressed\n";
    co_return absl::OkStatus();
  }
  out_ << "qcow2: Marking image as corrupt: " << message
       << "; further corruption events will be suppressed\n";
  incompatible_features_ |= format::kIncompatibleCorrupt;
  absl::Status st = co_await WriteHeaderFeatures();
  marked_corrupt_ = true;
  co_return st;
}

io::Task<absl::Status> Checker::WriteHeaderFeatures() {
  // Version 2 headers have no feature bits.
  if (header_.version < 3) co_return absl::OkStatus();
  uint8_t buf[8];
  for (int i = 0; i < 8; ++i) {
    buf[i] = static_cast<uint8_t>(incompatible_features_ >> (56 - 8 * i));
  }
  CO_RETURN_IF_ERROR(co_await file_.Write(kOffIncompatibleFeatures,
                                          io::ConstIoVec(buf, sizeof(buf))));
  co_return co_await file_.Flush();
}

uint32_t Checker::MetadataOverlap(uint32_t ignore, uint64_t offset,
                                  uint64_t size) const {
  const uint32_t chk = kOlCached & ~ignore;
  if (size == 0) return 0;
  if ((chk & kOlMainHeader) && offset < cluster_size()) return kOlMainHeader;
  size = DivRoundUp(OffsetIntoCluster(offset) + size, cluster_size()) *
         cluster_size();
  offset = StartOfCluster(offset);
  auto overlaps = [&](uint64_t o, uint64_t s) {
    return s != 0 && o < offset + size && offset < o + s;
  };
  if ((chk & kOlActiveL1) && l1_size_ && overlaps(l1_offset_, l1_size_ * 8)) {
    return kOlActiveL1;
  }
  if ((chk & kOlRefcountTable) && reftable_size_ &&
      overlaps(reftable_offset_, reftable_size_ * 8)) {
    return kOlRefcountTable;
  }
  if ((chk & kOlSnapshotTable) && snapshots_size_ &&
      overlaps(snapshots_offset_, snapshots_size_)) {
    return kOlSnapshotTable;
  }
  if (chk & kOlInactiveL1) {
    for (const Snapshot& sn : snapshots_) {
      if (sn.l1_size &&
          overlaps(sn.l1_offset, uint64_t{sn.l1_size} * 8)) {
        return kOlInactiveL1;
      }
    }
  }
  if (chk & kOlActiveL2) {
    for (uint64_t e : l1_table_) {
      const uint64_t l2 = e & format::kL1OffsetMask;
      if (l2 && overlaps(l2, cluster_size())) return kOlActiveL2;
    }
  }
  if (chk & kOlRefcountBlock) {
    for (uint64_t e : reftable_) {
      const uint64_t block = e & format::kRefcountTableOffsetMask;
      if (block && overlaps(block, cluster_size())) return kOlRefcountBlock;
    }
  }
  if ((chk & kOlBitmapDirectory) && header_.bitmaps.has_value() &&
      overlaps(header_.bitmaps->bitmap_directory_offset,
               header_.bitmaps->bitmap_directory_size)) {
    return kOlBitmapDirectory;
  }
  return 0;
}

io::Task<absl::Status> Checker::OverlapCheck(uint32_t ignore, uint64_t offset,
                                             uint64_t size) {
  const uint32_t hit = MetadataOverlap(ignore, offset, size);
  if (hit == 0) co_return absl::OkStatus();
  (co_await SignalCorruption(
       /*fatal=*/true,
       absl::StrFormat(
           "Preventing invalid write on metadata (overlaps with %s)",
           kOverlapNames[__builtin_ctz(hit)])))
      .IgnoreError();  // the write is refused either way
  co_return ErrnoError(EIO);
}

// ---- Stored refcounts -----------------------------------------------------

io::Task<absl::Status> Checker::WriteBackRefblock() {
  if (!refblock_.valid || !refblock_.dirty) co_return absl::OkStatus();
  CO_RETURN_IF_ERROR(co_await OverlapCheck(kOlRefcountBlock, refblock_.offset,
                                           cluster_size()));
  CO_RETURN_IF_ERROR(co_await file_.Write(refblock_.offset, refblock_.data));
  refblock_.dirty = false;
  refcounts_written_ = true;
  co_return absl::OkStatus();
}

io::Task<absl::Status> Checker::LoadRefblock(uint64_t offset) {
  if (refblock_.valid && refblock_.offset == offset) co_return absl::OkStatus();
  CO_RETURN_IF_ERROR(co_await WriteBackRefblock());
  refblock_.valid = false;
  refblock_.data.resize(cluster_size());
  CO_RETURN_IF_ERROR(co_await ReadAt(offset, absl::MakeSpan(refblock_.data)));
  refblock_.valid = true;
  refblock_.offset = offset;
  co_return absl::OkStatus();
}

io::Task<absl::StatusOr<uint64_t>> Checker::GetStoredRefcount(
    uint64_t cluster) {
  const uint64_t table_index = cluster >> refblock_bits_;
  if (table_index >= reftable_size_) co_return uint64_t{0};
  const uint64_t block_offset =
      ReftableEntry(table_index) & format::kRefcountTableOffsetMask;
  if (block_offset == 0) co_return uint64_t{0};
  if (OffsetIntoCluster(block_offset) != 0) {
    (co_await SignalCorruption(
         /*fatal=*/true,
         absl::StrFormat("Refblock offset %#x unaligned (reftable index: %#x)",
                         block_offset, table_index)))
        .IgnoreError();  // the refcount is unreadable either way
    co_return ErrnoError(EIO);
  }
  CO_RETURN_IF_ERROR(co_await LoadRefblock(block_offset));
  co_return format::GetRefcount(refblock_.data,
                                cluster & ((uint64_t{1} << refblock_bits_) - 1),
                                refcount_order_);
}

io::Task<absl::Status> Checker::SetStoredRefcount(uint64_t cluster,
                                                  uint64_t value) {
  const uint64_t table_index = cluster >> refblock_bits_;
  const uint64_t block_offset =
      table_index < reftable_size_
          ? ReftableEntry(table_index) & format::kRefcountTableOffsetMask
          : 0;
  // Only called for clusters with a non-zero stored refcount, so the block
  // exists and is aligned.
  if (block_offset == 0 || OffsetIntoCluster(block_offset) != 0) {
    co_return ErrnoError(EIO);
  }
  CO_RETURN_IF_ERROR(co_await LoadRefblock(block_offset));
  format::SetRefcount(absl::MakeSpan(refblock_.data),
                      cluster & ((uint64_t{1} << refblock_bits_) - 1),
                      refcount_order_, value);
  refblock_.dirty = true;
  if (value == 0) freed_clusters_.push_back(cluster);
  co_return absl::OkStatus();
}

io::Task<absl::Status> Checker::CommitRefcounts() {
  CO_RETURN_IF_ERROR(co_await WriteBackRefblock());
  if (refcounts_written_) {
    CO_RETURN_IF_ERROR(co_await file_.Flush());
    refcounts_written_ = false;
  }
  // The freed clusters are unreferenced and their refcount 0 is on disk:
  // give their space back (QEMU discards freed clusters). Advisory.
  co_await DiscardFreed();
  co_return absl::OkStatus();
}

io::Task<void> Checker::DiscardFreed() {
  std::vector<uint64_t> freed = std::move(freed_clusters_);
  freed_clusters_.clear();
  std::sort(freed.begin(), freed.end());
  for (size_t i = 0; i < freed.size();) {
    size_t j = i + 1;
    while (j < freed.size() && freed[j] == freed[j - 1] + 1) ++j;
    const uint64_t start = freed[i] << cluster_bits_;
    const uint64_t end =
        std::min<uint64_t>((freed[j - 1] + 1) << cluster_bits_, file_.size());
    if (end > start) {
      (co_await file_.Discard(start, end - start)).IgnoreError();
    }
    i = j;
  }
}

// ---- The check ------------------------------------------------------------

io::Task<absl::StatusOr<CheckResult>> Checker::Check(RepairMode mode) {
  CheckResult result;
  CheckResult snapshot_res;
  CheckResult refcount_res;

  absl::Status st = co_await ReadSnapshotTable(snapshot_res, mode);
  if (!st.ok()) co_return st;

  st = co_await CheckRefcounts(refcount_res, mode);
  Add(result, refcount_res, /*allocation_info=*/true);
  if (!st.ok()) co_return st;
  st = co_await FixSnapshotTable(snapshot_res, mode);
  Add(result, snapshot_res, /*allocation_info=*/false);
  if (!st.ok()) co_return st;

  if (mode != RepairMode::kNone && result.check_errors == 0 &&
      result.corruptions == 0) {
    // qcow2_mark_clean + qcow2_mark_consistent.
    CO_RETURN_IF_ERROR(co_await CommitRefcounts());
    const uint64_t bits =
        format::kIncompatibleDirty | format::kIncompatibleCorrupt;
    if (incompatible_features_ & bits) {
      incompatible_features_ &= ~bits;
      CO_RETURN_IF_ERROR(co_await WriteHeaderFeatures());
    }
  }
  co_return result;
}

io::Task<absl::Status> Checker::Close() {
  if (!writable()) co_return absl::OkStatus();
  if (marked_corrupt_) {
    // QEMU's update_refcount discards a cluster as its cached refcount
    // drops to 0 (QCOW2_DISCARD_ALWAYS), written or not.
    co_await DiscardFreed();
    co_return absl::OkStatus();
  }
  CO_RETURN_IF_ERROR(co_await CommitRefcounts());
  if (incompatible_features_ & format::kIncompatibleDirty) {
    incompatible_features_ &= ~format::kIncompatibleDirty;
    CO_RETURN_IF_ERROR(co_await WriteHeaderFeatures());
  }
  co_return absl::OkStatus();
}

io::Task<absl::Status> Checker::ReadSnapshotTable(CheckResult& res,
                                                 RepairMode mode) {
  snapshots_.clear();
  snapshots_offset_ = 0;
  snapshots_size_ = 0;
  const bool fix = mode == RepairMode::kAll;  // BDRV_FIX_ERRORS
  uint64_t nb = raw_nb_snapshots_;
  const uint64_t offset = raw_snapshots_offset_;
  if (nb == 0) co_return absl::OkStatus();
  uint64_t nb_reduced = 0;
  if (nb > format::kMaxSnapshots && fix) {
    out_ << "Discarding " << nb - format::kMaxSnapshots
         << " overhanging snapshots\n";
    nb_reduced += nb - format::kMaxSnapshots;
    nb = format::kMaxSnapshots;
  }

  // qcow2_validate_table(..., "snapshot table").
  std::string invalid;
  int error_number = 0;
  if (nb > format::kMaxSnapshots) {
    invalid = "snapshot table too large";
    error_number = EFBIG;
  } else if (kInt64Max - nb * format::kSnapshotHeaderBytes < offset ||
             OffsetIntoCluster(offset) != 0) {
    invalid = "snapshot table offset invalid";
    error_number = EINVAL;
  }
  if (!invalid.empty()) {
    ++res.check_errors;
    out_ << kReportPrefix << "ERROR " << invalid << "\n";
    if (nb > format::kMaxSnapshots) {
      out_ << "You can force-remove all " << nb - format::kMaxSnapshots
           << " overhanging snapshots with qemu-img check -r all\n";
    }
    co_return ErrnoError(error_number);
  }

  // qcow2_do_read_snapshots (past the end of the file: zeroes), its
  // "Discarding ..." lines on out_ as they come.
  absl::StatusOr<LoadedSnapshots> table = co_await LoadSnapshotTable(
      file_, offset, static_cast<uint32_t>(nb), header_.size / 512 * 512,
      fix ? &out_ : nullptr);
  if (!table.ok()) {
    // qcow2_check_read_snapshot_table: any error of qcow2_read_snapshots
    // (too big, or a read failing: "Failed to read snapshot table: ...").
    const int e = StatusErrno(table.status());
    if (e == 0) co_return table.status();
    ++res.check_errors;
    out_ << kReportPrefix << "ERROR failed to read the snapshot table: "
         << table.status().message() << "\n";
    co_return ErrnoError(e);
  }
  nb -= table->dropped;
  nb_reduced += table->dropped;
  snapshots_ = std::move(table->entries);
  snapshots_offset_ = offset;
  snapshots_size_ = table->bytes;
  res.corruptions += nb_reduced + table->extra_cut;

  if (nb_reduced != 0) {
    // The header first: the refcount check relies on it (this leaks the
    // dropped entries' clusters, which the refcount check then repairs).
    uint8_t count[4];
    StoreBE32(count, static_cast<uint32_t>(nb));
    absl::Status st = co_await file_.Write(kOffNbSnapshots,
                                           io::ConstIoVec(count, sizeof(count)));
    if (st.ok()) st = co_await file_.Flush();
    if (!st.ok()) {
      ++res.check_errors;
      out_ << "ERROR failed to update the snapshot count in the image "
              "header: "
           << ErrnoText(st) << "\n";
      co_return st;
    }
    raw_nb_snapshots_ = static_cast<uint32_t>(nb);
    res.corruptions_fixed += nb_reduced;
    res.corruptions -= nb_reduced;
  }

  if (header_.version >= 3) {
    for (size_t i = 0; i < snapshots_.size(); ++i) {
      // vm_state_size_large + disk_size.
      if (snapshots_[i].extra_data_size < format::kSnapshotExtraV3MinBytes) {
        ++res.corruptions;
        out_ << (fix ? "Repairing" : "ERROR") << " snapshot table entry " << i
             << " is incomplete\n";
      }
    }
  }
  co_return absl::OkStatus();
}

io::Task<absl::Status> Checker::FixSnapshotTable(CheckResult& res,
                                                 RepairMode mode) {
  if (res.corruptions == 0 || mode != RepairMode::kAll) {
    co_return absl::OkStatus();
  }
  if (absl::Status st = co_await WriteSnapshotTable(); !st.ok()) {
    ++res.check_errors;
    out_ << "ERROR failed to update snapshot table: " << ErrnoText(st)
         << "\n";
    co_return st;
  }
  res.corruptions_fixed += res.corruptions;
  res.corruptions = 0;
  co_return absl::OkStatus();
}

io::Task<absl::Status> Checker::LeakRefblockForFree() {
  const uint64_t covered = reftable_size_ << refblock_bits_;
  for (uint64_t c = 1; c < covered; ++c) {
    if ((ReftableEntry(c >> refblock_bits_) &
         format::kRefcountTableOffsetMask) == 0) {
      c = (((c >> refblock_bits_) + 1) << refblock_bits_) - 1;
      continue;
    }
    CO_ASSIGN_OR_RETURN(const uint64_t rc, co_await GetStoredRefcount(c));
    if (rc != 0) continue;
    CO_RETURN_IF_ERROR(co_await SetStoredRefcount(c, 1));
    CO_RETURN_IF_ERROR(co_await CommitRefcounts());
    const uint64_t offset = c << cluster_bits_;
    CO_RETURN_IF_ERROR(
        co_await OverlapCheck(kOlRefcountBlock, offset, cluster_size()));
    std::vector<uint8_t> zeroes(cluster_size(), 0);
    CO_RETURN_IF_ERROR(co_await file_.Write(offset, zeroes));
    CO_RETURN_IF_ERROR(co_await file_.Flush());
    co_return ErrnoError(EFBIG);
  }
  co_return ErrnoError(ENOSPC);
}

io::Task<absl::Status> Checker::WriteSnapshotTable() {
  // Every entry as version 3 wants it: at least the 24 known bytes of
  // extra data (qcow2_write_snapshots).
  const std::vector<uint8_t> table = format::EncodeSnapshotTable(snapshots_);
  if (table.size() > format::kMaxSnapshotTableBytes) co_return ErrnoError(EFBIG);

  // qcow2_alloc_clusters: the first run of free clusters (stored refcount
  // 0) from the start of the image, inside existing refcount blocks.
  uint64_t new_offset = 0;
  if (!table.empty()) {
    const uint64_t n = DivRoundUp(table.size(), cluster_size());
    const uint64_t covered = reftable_size_ << refblock_bits_;
    uint64_t run_start = 0, run = 0;
    for (uint64_t c = 0; c < covered && run < n; ++c) {
      if ((ReftableEntry(c >> refblock_bits_) &
           format::kRefcountTableOffsetMask) == 0) {
        run = 0;
        run_start = ((c >> refblock_bits_) + 1) << refblock_bits_;
        c = run_start - 1;
        continue;
      }
      CO_ASSIGN_OR_RETURN(const uint64_t rc, co_await GetStoredRefcount(c));
      if (rc != 0) {
        run = 0;
        run_start = c + 1;
        continue;
      }
      ++run;
    }
    if (run < n) co_return ErrnoError(ENOSPC);
    new_offset = run_start << cluster_bits_;
    for (uint64_t c = run_start; c < run_start + n; ++c) {
      CO_RETURN_IF_ERROR(co_await SetStoredRefcount(c, 1));
    }
    CO_RETURN_IF_ERROR(co_await CommitRefcounts());
    CO_RETURN_IF_ERROR(co_await OverlapCheck(0, new_offset, table.size()));
    CO_RETURN_IF_ERROR(co_await file_.Write(new_offset, table));
    CO_RETURN_IF_ERROR(co_await file_.Flush());
  }
  uint8_t field[12];
  const uint64_t nb = snapshots_.size();
  StoreBE32(field, static_cast<uint32_t>(nb));
  StoreBE64(field + 4, new_offset);
  CO_RETURN_IF_ERROR(co_await file_.Write(kOffNbSnapshots,
                                          io::ConstIoVec(field, sizeof(field))));
  CO_RETURN_IF_ERROR(co_await file_.Flush());
  const uint64_t old_offset = snapshots_offset_;
  const uint64_t old_size = snapshots_size_;
  raw_nb_snapshots_ = static_cast<uint32_t>(nb);
  raw_snapshots_offset_ = new_offset;
  snapshots_offset_ = new_offset;
  snapshots_size_ = table.size();
  // qcow2_free_clusters of the old table: all or nothing (update_refcount
  // rolls back), and a failure only leaks, with QEMU's line.
  if (old_size > 0) {
    const uint64_t first = old_offset >> cluster_bits_;
    const uint64_t end = DivRoundUp(old_offset + old_size, cluster_size());
    std::vector<uint64_t> counts;
    absl::Status freed;
    for (uint64_t c = first; c < end && freed.ok(); ++c) {
      if ((c >> refblock_bits_) >= format::kMaxRefcountTableBytes / 8) {
        // No refcount block can cover it: alloc_refcount_block takes the
        // first free cluster for one (refcount 1, zeroed, written), then
        // qcow2_refcount_area refuses a table past QCOW_MAX_REFTABLE_SIZE
        // with EFBIG; the new block stays allocated (a leak). (A table
        // that could grow so far is not done here: EINVAL below.)
        freed = co_await LeakRefblockForFree();
        break;
      }
      absl::StatusOr<uint64_t> rc = co_await GetStoredRefcount(c);
      if (!rc.ok()) {
        freed = rc.status();
      } else if (*rc == 0) {
        freed = ErrnoError(EINVAL);  // a refcount going below 0
      } else {
        counts.push_back(*rc);
      }
    }
    for (uint64_t c = first; c < end && freed.ok(); ++c) {
      freed = co_await SetStoredRefcount(c, counts[c - first] - 1);
    }
    if (freed.ok()) freed = co_await CommitRefcounts();
    if (!freed.ok()) {
      out_ << "qcow2_free_clusters failed: " << ErrnoText(freed) << "\n";
    }
  }
  co_return absl::OkStatus();
}

void Checker::IncRefcounts(CheckResult& res, RefcountArray& refs,
                           uint64_t offset, uint64_t size) {
  if (size == 0) return;
  const uint64_t file_len = file_.size();
  // The last cluster may be only partly in the file, so a region may end
  // less than one cluster past the end of the file.
  const __int128 excess =
      static_cast<__int128>(offset) + size - static_cast<__int128>(file_len);
  if (excess >= static_cast<__int128>(cluster_size())) {
    out_ << absl::StrFormat(
        "ERROR: counting reference for region exceeding the end of the file "
        "by one cluster or more: offset 0x%x size 0x%x\n",
        offset, size);
    ++res.corruptions;
    return;
  }
  const uint64_t max = format::MaxRefcount(refcount_order_);
  const uint64_t last = StartOfCluster(offset + size - 1);
  for (uint64_t c = StartOfCluster(offset); c <= last; c += cluster_size()) {
    const uint64_t k = c >> cluster_bits_;
    if (k >= refs.size()) refs.Resize(k + 1);
    const uint64_t refcount = refs.Get(k);
    if (refcount == max) {
      out_ << absl::StrFormat("ERROR: overflow cluster offset=0x%x\n", c);
      out_ << "Use qemu-img amend to increase the refcount entry width or "
              "qemu-img convert to create a clean copy if the image cannot be "
              "opened for writing\n";
      ++res.corruptions;
      continue;
    }
    refs.Set(k, refcount + 1);
  }
}

io::Task<absl::Status> Checker::CheckCutTable(CheckResult& res,
                                              RepairMode mode,
                                              absl::string_view what,
                                              uint64_t offset, uint64_t size,
                                              uint64_t entry_size) {
  const uint64_t file_size = file_.size();
  if (size == 0 || offset > kInt64Max - size || offset + size <= file_size ||
      offset + size - file_size >= cluster_size()) {
    co_return absl::OkStatus();
  }
  const bool fix = mode == RepairMode::kAll && writable();
  out_ << absl::StrFormat(
      "%s %s at 0x%x (%u bytes) extends beyond the end of the file (%u "
      "bytes)\n",
      fix ? "Repairing" : "ERROR", what, offset, size, file_size);
  ++res.corruptions;
  cut_table_ = true;
  if (!fix) co_return absl::OkStatus();

  // The entries wholly in the file stay; the one the end cuts is zeroed,
  // then the file grows (reading as zeros) to the end of the table.
  absl::Status st;
  if (offset < file_size) {
    const uint64_t whole = (file_size - offset) / entry_size * entry_size;
    const std::vector<uint8_t> zeros(file_size - offset - whole, 0);
    if (!zeros.empty()) {
      st = co_await file_.Write(offset + whole, zeros);
    }
  }
  if (st.ok()) {
    st = co_await file_.Truncate(offset + size, io::PreallocMode::kOff);
  }
  if (st.ok()) st = co_await file_.Flush();
  if (!st.ok()) {
    out_ << "ERROR could not resize image: " << st.message() << "\n";
    co_return absl::OkStatus();
  }
  --res.corruptions;
  ++res.corruptions_fixed;
  co_return absl::OkStatus();
}

io::Task<absl::Status> Checker::CheckRefcounts(CheckResult& res,
                                               RepairMode mode) {
  const uint64_t size = file_.size();
  const uint64_t nb_clusters = DivRoundUp(size, cluster_size());
  if (nb_clusters > uint64_t{INT_MAX}) {
    ++res.check_errors;
    co_return ErrnoError(EFBIG);
  }
  res.total_clusters = DivRoundUp(header_.size / 512 * 512, cluster_size());

  RefcountArray refs(cluster_bits_, refcount_order_);
  refs.Resize(nb_clusters);
  bool rebuild = false;
  CO_RETURN_IF_ERROR(co_await CalculateRefcounts(res, mode, rebuild, refs));
  // The entries a cut table lost referenced clusters past the end of the
  // file that the refcount blocks still count: compare those too, up to the
  // end of the refcount block holding the file's last cluster, so that they
  // are leaks (and -r all frees them) instead of staying allocated for ever.
  if (cut_table_) {
    const uint64_t per_block = uint64_t{1} << refblock_bits_;
    refs.Resize(DivRoundUp(nb_clusters, per_block) * per_block);
  }

  // With a repair that needs no rebuild the comparison is made again with
  // repairs, and this first one's counts are dropped.
  const CheckResult pre_compare_res = res;
  uint64_t highest_cluster =
      co_await CompareRefcounts(res, RepairMode::kNone, rebuild, refs);

  if (rebuild && mode == RepairMode::kAll) {
    const CheckResult old_res = res;
    out_ << "Rebuilding refcount structure\n";
    CO_RETURN_IF_ERROR(co_await RebuildRefcountStructure(res, refs));
    res.corruptions = 0;
    res.leaks = 0;

    // The references changed with the new structure: count them again.
    rebuild = false;
    refs.Clear();
    CO_RETURN_IF_ERROR(
        co_await CalculateRefcounts(res, RepairMode::kNone, rebuild, refs));

    // The old structure is now leaked: free it. Only leaks the new
    // structure brought count.
    const CheckResult saved_res = res;
    res = CheckResult{};
    highest_cluster =
        co_await CompareRefcounts(res, RepairMode::kLeaks, rebuild, refs);
    if (rebuild) out_ << "ERROR rebuilt refcount structure is still broken\n";
    const uint64_t fresh_leaks = res.leaks;
    res = saved_res;

    if (res.corruptions < old_res.corruptions) {
      res.corruptions_fixed += old_res.corruptions - res.corruptions;
    }
    if (res.leaks < old_res.leaks) {
      res.leaks_fixed += old_res.leaks - res.leaks;
    }
    res.leaks += fresh_leaks;
  } else if (mode != RepairMode::kNone) {
    if (rebuild) {
      out_ << "ERROR need to rebuild refcount structures\n";
      ++res.check_errors;
      co_return ErrnoError(EIO);
    }
    if (res.leaks || res.corruptions) {
      res = pre_compare_res;
      highest_cluster = co_await CompareRefcounts(res, mode, rebuild, refs);
    }
  }

  // COPIED flags rely on the refcounts: CheckOflagCopied commits them
  // before its first repair write that passes the overlap check (QEMU's
  // stay cached until then, and are lost when that check marks the image
  // corrupt).
  CO_RETURN_IF_ERROR(co_await CheckOflagCopied(res, mode));
  if (mode != RepairMode::kNone) {
    CO_RETURN_IF_ERROR(co_await CommitRefcounts());
  }

  res.image_end_offset = (highest_cluster + 1) * cluster_size();
  co_return absl::OkStatus();
}

io::Task<absl::Status> Checker::CalculateRefcounts(CheckResult& res,
                                                   RepairMode mode,
                                                   bool& rebuild,
                                                   RefcountArray& refs) {
  // Header.
  IncRefcounts(res, refs, 0, cluster_size());

  // Active L1 table.
  CO_RETURN_IF_ERROR(co_await CheckRefcountsL1(res, refs, l1_offset_, l1_size_,
                                               /*frag_info=*/true, mode,
                                               /*active=*/true));

  // Snapshots.
  if (data_file_ && !snapshots_.empty()) {
    out_ << "ERROR " << snapshots_.size()
         << " snapshots in image with data file\n";
    ++res.corruptions;
  }
  for (const Snapshot& sn : snapshots_) {
    if (OffsetIntoCluster(sn.l1_offset) != 0) {
      out_ << absl::StrFormat(
          "ERROR snapshot %s (%s) l1_offset=%#x: L1 table is not cluster "
          "aligned; snapshot table entry corrupted\n",
          sn.id, sn.name, sn.l1_offset);
      ++res.corruptions;
      continue;
    }
    if (sn.l1_size > format::kMaxL1TableBytes / 8) {
      out_ << absl::StrFormat(
          "ERROR snapshot %s (%s) l1_size=%#x: L1 table is too large; "
          "snapshot table entry corrupted\n",
          sn.id, sn.name, sn.l1_size);
      ++res.corruptions;
      continue;
    }
    CO_RETURN_IF_ERROR(co_await CheckRefcountsL1(
        res, refs, sn.l1_offset, sn.l1_size, /*frag_info=*/false, mode,
        /*active=*/false));
  }
  IncRefcounts(res, refs, snapshots_offset_, snapshots_size_);

  // Refcount table.
  CO_RETURN_IF_ERROR(co_await CheckCutTable(res, mode, "refcount table",
                                            reftable_offset_,
                                            reftable_size_ * 8, 8));
  IncRefcounts(res, refs, reftable_offset_, reftable_size_ * 8);

  // Encryption header.
  if (header_.crypto_header.has_value() && header_.crypto_header->length) {
    IncRefcounts(res, refs, header_.crypto_header->offset,
                 header_.crypto_header->length);
  }

  CO_RETURN_IF_ERROR(co_await CheckBitmapsRefcounts(res, refs));

  co_return co_await CheckRefblocks(res, mode, rebuild, refs);
}

io::Task<absl::Status> Checker::CheckRefcountsL1(
    CheckResult& res, RefcountArray& refs, uint64_t l1_offset, uint64_t l1_size,
    bool frag_info, RepairMode mode, bool active) {
  if (l1_size == 0) co_return absl::OkStatus();
  CO_RETURN_IF_ERROR(co_await CheckCutTable(
      res, mode, active ? "active L1 table" : "inactive L1 table", l1_offset,
      l1_size * 8, 8));
  IncRefcounts(res, refs, l1_offset, l1_size * 8);

  absl::StatusOr<std::vector<uint64_t>> l1 =
      co_await ReadTable(l1_offset, l1_size);
  if (!l1.ok()) {
    out_ << "ERROR: I/O error in check_refcounts_l1\n";
    ++res.check_errors;
    co_return l1.status();
  }
  for (uint64_t entry : *l1) {
    if (entry == 0) continue;
    if (entry & format::kL1ReservedMask) {
      out_ << absl::StrFormat(
          "ERROR found L1 entry with reserved bits set: %x\n", entry);
      ++res.corruptions;
    }
    const uint64_t l2_offset = entry & format::kL1OffsetMask;
    IncRefcounts(res, refs, l2_offset, cluster_size());
    if (OffsetIntoCluster(l2_offset) != 0) {
      out_ << absl::StrFormat(
          "ERROR l2_offset=%x: Table is not cluster aligned; L1 entry "
          "corrupted\n",
          l2_offset);
      ++res.corruptions;
    }
    CO_RETURN_IF_ERROR(co_await CheckRefcountsL2(res, refs, l2_offset,
                                                 frag_info, mode, active));
  }
  co_return absl::OkStatus();
}

io::Task<absl::Status> Checker::CheckRefcountsL2(CheckResult& res,
                                                 RefcountArray& refs,
                                                 uint64_t l2_offset,
                                                 bool frag_info,
                                                 RepairMode mode, bool active) {
  if (OffsetIntoCluster(l2_offset) == 0) {
    CO_RETURN_IF_ERROR(co_await CheckCutTable(
        res, mode, active ? "active L2 table" : "inactive L2 table", l2_offset,
        cluster_size(), l2_entry_size_));
  }
  std::vector<uint8_t> table(cluster_size());
  if (absl::Status st = co_await ReadAt(l2_offset, absl::MakeSpan(table));
      !st.ok()) {
    out_ << "ERROR: I/O error in check_refcounts_l2\n";
    ++res.check_errors;
    co_return st;
  }
  const uint32_t csize_shift = format::CompressedSectorShift(cluster_bits_);
  const uint64_t coffset_mask = (uint64_t{1} << csize_shift) - 1;
  uint64_t next_contiguous_offset = 0;

  for (uint64_t i = 0; i < l2_entries_; ++i) {
    const format::L2Entry e = format::LoadL2Entry(table, i, extended_l2_);
    uint64_t word = e.word;
    const uint64_t bitmap = e.bitmap;
    const ClusterType type = GetClusterType(word);

    if (type != ClusterType::kCompressed &&
        (word & format::kL2StandardReservedMask)) {
      out_ << absl::StrFormat(
          "ERROR found l2 entry with reserved bits set: %x\n", word);
      ++res.corruptions;
    }

    switch (type) {
      case ClusterType::kCompressed: {
        if (word & kCopiedFlag) {
          out_ << absl::StrFormat(
              "ERROR: coffset=0x%x: copied flag must never be set for "
              "compressed clusters\n",
              word & coffset_mask);
          word &= ~kCopiedFlag;
          ++res.corruptions;
        }
        if (data_file_) {
          out_ << absl::StrFormat(
              "ERROR compressed cluster %d with data file, entry=0x%x\n",
              static_cast<int>(i), word);
          ++res.corruptions;
          break;
        }
        if (bitmap) {
          out_ << absl::StrFormat(
              "ERROR compressed cluster %d with non-zero subcluster "
              "allocation bitmap, entry=0x%x\n",
              static_cast<int>(i), word);
          ++res.corruptions;
          break;
        }
        const format::CompressedDescriptor d =
            format::DecodeCompressedDescriptor(word, cluster_bits_);
        IncRefcounts(res, refs, d.host_offset, d.size());
        if (frag_info) {
          // Compressed clusters count as fragmented: they need sectors
          // re-read even when adjacent.
          ++res.allocated_clusters;
          ++res.compressed_clusters;
          ++res.fragmented_clusters;
        }
        break;
      }
      case ClusterType::kZeroAlloc:
      case ClusterType::kNormal: {
        const uint64_t offset = word & format::kL2OffsetMask;
        if ((bitmap >> 32) & bitmap) {
          ++res.corruptions;
          out_ << absl::StrFormat(
              "ERROR offset=%x: Allocated cluster has corrupted subcluster "
              "allocation bitmap\n",
              offset);
        }
        if (OffsetIntoCluster(offset) != 0) {
          ++res.corruptions;
          const bool contains_data =
              extended_l2_ ? (bitmap & format::kSubclusterAllocMask) != 0
                           : (word & kZeroFlag) == 0;
          if (!contains_data) {
            out_ << absl::StrFormat(
                "%s offset=%x: Preallocated cluster is not properly aligned; "
                "L2 entry corrupted.\n",
                mode == RepairMode::kAll ? "Repairing" : "ERROR", offset);
            if (mode == RepairMode::kAll) {
              bool metadata_overlap = false;
              absl::Status st = co_await FixL2EntryByZero(
                  res, l2_offset, table, i, active, metadata_overlap);
              // Something is badly wrong: stop checking this table.
              if (metadata_overlap) co_return st;
              // Repaired: the cluster is not in use any more.
              if (st.ok()) continue;
            }
          } else {
            out_ << absl::StrFormat(
                "ERROR offset=%x: Data cluster is not properly aligned; L2 "
                "entry corrupted.\n",
                offset);
          }
        }
        if (frag_info) {
          ++res.allocated_clusters;
          if (next_contiguous_offset && offset != next_contiguous_offset) {
            ++res.fragmented_clusters;
          }
          next_contiguous_offset = offset + cluster_size();
        }
        if (!data_file_) IncRefcounts(res, refs, offset, cluster_size());
        break;
      }
      case ClusterType::kZeroPlain:
        break;
      case ClusterType::kUnallocated:
        if (bitmap & format::kSubclusterAllocMask) {
          ++res.corruptions;
          out_ << "ERROR: Unallocated cluster has non-zero subcluster "
                  "allocation map\n";
        }
        break;
    }
  }
  co_return absl::OkStatus();
}

io::Task<absl::Status> Checker::FixL2EntryByZero(CheckResult& res,
                                                 uint64_t l2_offset,
                                                 std::vector<uint8_t>& table,
                                                 uint64_t index, bool active,
                                                 bool& metadata_overlap) {
  format::L2Entry e = format::LoadL2Entry(table, index, extended_l2_);
  if (extended_l2_) {
    // Allocated subclusters become zero ones.
    e.bitmap |= e.bitmap << 32;
    e.bitmap &= format::kSubclusterZeroMask;
    e.word = 0;
  } else {
    e.word = kZeroFlag;
  }
  format::StoreL2Entry(absl::MakeSpan(table), index, extended_l2_, e);
  const uint64_t entry_offset = l2_offset + index * l2_entry_size_;

  absl::Status st = co_await OverlapCheck(active ? kOlActiveL2 : kOlInactiveL2,
                                          entry_offset, l2_entry_size_);
  metadata_overlap = !st.ok();
  if (!st.ok()) {
    out_ << "ERROR: Overlap check failed\n";
    ++res.check_errors;
    co_return st;
  }
  st = co_await file_.Write(
      entry_offset, absl::MakeConstSpan(table).subspan(index * l2_entry_size_,
                                                       l2_entry_size_));
  if (st.ok()) st = co_await file_.Flush();
  if (!st.ok()) {
    out_ << "ERROR: Failed to overwrite L2 table entry: " << st.message()
         << "\n";
    ++res.check_errors;
    co_return st;
  }
  --res.corruptions;
  ++res.corruptions_fixed;
  co_return absl::OkStatus();
}

io::Task<absl::Status> Checker::CheckBitmapsRefcounts(CheckResult& res,
                                                      RefcountArray& refs) {
  if (!header_.bitmaps.has_value() || header_.bitmaps->nb_bitmaps == 0) {
    co_return absl::OkStatus();
  }
  const format::BitmapsExtension& ext = *header_.bitmaps;
  IncRefcounts(res, refs, ext.bitmap_directory_offset,
               ext.bitmap_directory_size);

  // The directory (at most format::kMaxBitmapDirectorySize bytes, checked
  // when the header was decoded).
  std::vector<Bitmap> bitmaps;
  // A directory reaching past the end of the file reads zeros there, which
  // are no valid entries: do not allocate for it.
  const uint64_t file_size = file_.size();
  bool valid =
      ext.bitmap_directory_size <= format::kMaxBitmapDirectorySize &&
      ext.bitmap_directory_offset <= file_size &&
      ext.bitmap_directory_size <= file_size - ext.bitmap_directory_offset;
  if (valid) {
    std::vector<uint8_t> dir(ext.bitmap_directory_size);
    CO_RETURN_IF_ERROR(
        co_await ReadAt(ext.bitmap_directory_offset, absl::MakeSpan(dir)));
    uint64_t pos = 0;
    while (valid && pos < dir.size()) {
      if (dir.size() - pos < kBitmapDirEntryHeaderSize) {
        valid = false;
        break;
      }
      const uint8_t* p = dir.data() + pos;
      Bitmap bm;
      bm.table_offset = LoadBE64(p);
      bm.table_size = LoadBE32(p + 8);
      const uint64_t name_size = LoadBE16(p + 18);
      const uint64_t extra_size = LoadBE32(p + 20);
      const uint64_t entry_size =
          (kBitmapDirEntryHeaderSize + extra_size + name_size + 7) &
          ~uint64_t{7};
      if (entry_size > dir.size() - pos ||
          bm.table_size > kMaxBitmapTableEntries ||
          OffsetIntoCluster(bm.table_offset) != 0 || name_size == 0) {
        valid = false;
        break;
      }
      bitmaps.push_back(bm);
      pos += entry_size;
    }
    if (valid && bitmaps.size() != ext.nb_bitmaps) valid = false;
  }
  if (!valid) {
    ++res.corruptions;
    co_return ErrnoError(EINVAL);
  }

  for (const Bitmap& bm : bitmaps) {
    IncRefcounts(res, refs, bm.table_offset, uint64_t{bm.table_size} * 8);
    absl::StatusOr<std::vector<uint64_t>> table =
        co_await ReadTable(bm.table_offset, bm.table_size);
    if (!table.ok()) {
      ++res.corruptions;
      co_return table.status();
    }
    for (uint64_t entry : *table) {
      const uint64_t offset = entry & kBitmapTableOffsetMask;
      if ((entry & kBitmapTableReservedMask) ||
          (offset != 0 &&
           ((entry & kBitmapTableAllOnes) || OffsetIntoCluster(offset) != 0))) {
        ++res.corruptions;
        continue;
      }
      if (offset == 0) continue;
      IncRefcounts(res, refs, offset, cluster_size());
    }
  }
  co_return absl::OkStatus();
}

io::Task<absl::Status> Checker::CheckRefblocks(CheckResult& res,
                                               RepairMode mode, bool& rebuild,
                                               RefcountArray& refs) {
  // Entries past reftable_ (outside the file) are zero: nothing to check.
  for (uint64_t i = 0; i < reftable_.size(); ++i) {
    const uint64_t entry = reftable_[i];
    const uint64_t offset = entry & format::kRefcountTableOffsetMask;
    const uint64_t cluster = offset >> cluster_bits_;

    if (entry & format::kRefcountTableReservedMask) {
      out_ << "ERROR refcount table entry " << i << " has reserved bits set\n";
      ++res.corruptions;
      rebuild = true;
      continue;
    }
    if (OffsetIntoCluster(offset) != 0) {
      out_ << "ERROR refcount block " << i
           << " is not cluster aligned; refcount table entry corrupted\n";
      ++res.corruptions;
      rebuild = true;
      continue;
    }
    if (cluster >= refs.size()) {
      ++res.corruptions;
      out_ << (mode == RepairMode::kAll ? "Repairing" : "ERROR")
           << " refcount block " << i << " is outside image\n";
      if (mode != RepairMode::kAll) continue;

      // Grow the file to take the block in (QEMU's repair), within bounds.
      int error_number = 0;
      const uint64_t old_size = file_.size();
      if (offset > kInt64Max - cluster_size()) {
        error_number = EINVAL;
      } else if (offset + cluster_size() >
                 old_size + std::max(old_size, kMaxGrowSlack)) {
        out_ << kReportPrefix
             << "Could not resize file: " << std::strerror(EFBIG) << "\n";
        error_number = EFBIG;
      } else {
        absl::Status st = co_await file_.Truncate(offset + cluster_size(),
                                                  io::PreallocMode::kOff);
        if (!st.ok()) {
          out_ << kReportPrefix << st.message() << "\n";
          error_number = EIO;
        } else {
          refs.Resize(DivRoundUp(file_.size(), cluster_size()));
          if (cluster >= refs.size()) error_number = EINVAL;
        }
      }
      if (error_number == 0) {
        --res.corruptions;
        ++res.corruptions_fixed;
        IncRefcounts(res, refs, offset, cluster_size());
        // Just allocated and zeroed: its refcount is exactly 1.
        continue;
      }
      rebuild = true;
      out_ << "ERROR could not resize image: " << std::strerror(error_number)
           << "\n";
      continue;
    }
    if (offset != 0) {
      IncRefcounts(res, refs, offset, cluster_size());
      if (refs.Get(cluster) != 1) {
        out_ << "ERROR refcount block " << i
             << " refcount=" << refs.Get(cluster) << "\n";
        ++res.corruptions;
        rebuild = true;
      }
    }
  }
  co_return absl::OkStatus();
}

io::Task<uint64_t> Checker::CompareRefcounts(CheckResult& res, RepairMode mode,
                                             bool& rebuild,
                                             RefcountArray& refs) {
  uint64_t highest_cluster = 0;
  for (uint64_t i = 0; i < refs.size(); ++i) {
    absl::StatusOr<uint64_t> stored = co_await GetStoredRefcount(i);
    if (!stored.ok()) {
      out_ << "Can't get refcount for cluster " << i << ": "
           << stored.status().message() << "\n";
      ++res.check_errors;
      continue;
    }
    const uint64_t refcount1 = *stored;
    const uint64_t refcount2 = refs.Get(i);
    if (refcount1 > 0 || refcount2 > 0) highest_cluster = i;
    if (refcount1 == refcount2) continue;

    uint64_t* num_fixed = nullptr;
    if (refcount1 == 0) {
      rebuild = true;
    } else if (refcount1 > refcount2 && mode != RepairMode::kNone) {
      num_fixed = &res.leaks_fixed;
    } else if (refcount1 < refcount2 && mode == RepairMode::kAll) {
      num_fixed = &res.corruptions_fixed;
    }
    out_ << (num_fixed != nullptr    ? "Repairing"
             : refcount1 < refcount2 ? "ERROR"
                                     : "Leaked")
         << " cluster " << i << " refcount=" << refcount1
         << " reference=" << refcount2 << "\n";
    if (num_fixed != nullptr) {
      if ((co_await SetStoredRefcount(i, refcount2)).ok()) {
        ++*num_fixed;
        continue;
      }
    }
    if (refcount1 < refcount2) {
      ++res.corruptions;
    } else {
      ++res.leaks;
    }
  }
  co_return highest_cluster;
}

uint64_t Checker::AllocClusters(uint64_t count, RefcountArray& refs,
                                uint64_t& first_free_cluster) {
  uint64_t cluster = first_free_cluster;
  bool first_gap = true;
  uint64_t contiguous = 0;
  for (; cluster < refs.size() && contiguous < count; ++cluster) {
    if (refs.Get(cluster) == 0) {
      ++contiguous;
      if (first_gap) {
        first_free_cluster = cluster;
        first_gap = false;
      }
    } else {
      contiguous = 0;
    }
  }
  // Not enough free clusters: take the missing ones at the end.
  if (contiguous < count) refs.Resize(cluster + count - contiguous);
  cluster -= contiguous;
  for (uint64_t i = 0; i < count; ++i) refs.Set(cluster + i, 1);
  return cluster << cluster_bits_;
}

// Writes a refcount block for every block of [first_cluster, end_cluster)
// with an in-use cluster, allocating the blocks in free clusters (which
// extends `end_cluster` when a block lands past it). Returns whether
// `reftable` had to grow.
io::Task<absl::StatusOr<bool>> Checker::WriteRefblocks(
    RefcountArray& refs, uint64_t first_cluster, uint64_t end_cluster,
    std::vector<uint64_t>& reftable) {
  const uint64_t per_block = uint64_t{1} << refblock_bits_;
  uint64_t first_free_cluster = 0;
  bool reftable_grown = false;
  for (uint64_t cluster = first_cluster; cluster < end_cluster; ++cluster) {
    if (refs.Get(cluster) == 0) continue;
    const uint64_t block_index = cluster >> refblock_bits_;
    const uint64_t block_start = block_index << refblock_bits_;
    uint64_t block_offset;
    if (block_index < reftable.size() && reftable[block_index] != 0) {
      // Allocated by an earlier round.
      block_offset = reftable[block_index];
    } else {
      // Not in a block already written.
      first_free_cluster = std::max(first_free_cluster, block_start);
      block_offset = AllocClusters(1, refs, first_free_cluster);
      const uint64_t block_cluster = block_offset >> cluster_bits_;
      if (block_cluster >= end_cluster) end_cluster = block_cluster + 1;
      if (reftable.size() <= block_index) {
        const uint64_t entries =
            DivRoundUp((block_index + 1) * 8, cluster_size()) * cluster_size() /
            8;
        reftable.resize(entries, 0);
        reftable_grown = true;
      }
      reftable[block_index] = block_offset;
    }
    CO_RETURN_IF_ERROR(co_await OverlapCheck(0, block_offset, cluster_size()));
    CO_RETURN_IF_ERROR(
        co_await file_.Write(block_offset, refs.Block(block_index)));
    // The block is written: skip the rest of it.
    cluster = block_start + per_block - 1;
  }
  co_return reftable_grown;
}

io::Task<absl::Status> Checker::RebuildRefcountStructure(CheckResult& res,
                                                         RefcountArray& refs) {
  // Drop the cached block of the old structure (writing it back first).
  CO_RETURN_IF_ERROR(co_await WriteBackRefblock());
  refblock_.valid = false;

  auto fail = [&](absl::string_view what, const absl::Status& st) {
    ++res.check_errors;
    out_ << kReportPrefix << what << ": " << st.message() << "\n";
    return st;
  };

  // Write a block for every block range holding an in-use cluster, then
  // find room for the table; the table's own clusters may need more
  // blocks (or a bigger table), so repeat until the table stops growing.
  // Old structures are left alone: the next comparison frees them.
  std::vector<uint64_t> reftable;
  absl::StatusOr<bool> grown =
      co_await WriteRefblocks(refs, 0, refs.size(), reftable);
  if (!grown.ok()) co_return fail("ERROR writing refblock", grown.status());

  uint64_t reftable_offset = 0;
  uint64_t reftable_clusters = 0;
  do {
    uint64_t first_free_cluster = 0;
    reftable_clusters = DivRoundUp(reftable.size() * 8, cluster_size());
    reftable_offset =
        AllocClusters(reftable_clusters, refs, first_free_cluster);
    const uint64_t start = reftable_offset >> cluster_bits_;
    grown = co_await WriteRefblocks(refs, start, start + reftable_clusters,
                                    reftable);
    if (!grown.ok()) co_return fail("ERROR writing refblock", grown.status());
  } while (*grown);

  std::vector<uint8_t> bytes(reftable.size() * 8);
  for (size_t i = 0; i < reftable.size(); ++i) {
    format::StoreRefcountTableEntry(absl::MakeSpan(bytes), i, reftable[i]);
  }
  absl::Status st = co_await OverlapCheck(0, reftable_offset, bytes.size());
  if (st.ok()) st = co_await file_.Write(reftable_offset, bytes);
  // Everything the new header will point to is durable before it does.
  if (st.ok()) st = co_await file_.Flush();
  if (!st.ok()) co_return fail("ERROR writing reftable", st);

  // Switch the header to the new table: one 12-byte write (offset u64,
  // clusters u32) inside the first sector.
  uint8_t h[12];
  for (int i = 0; i < 8; ++i) {
    h[i] = static_cast<uint8_t>(reftable_offset >> (56 - 8 * i));
  }
  for (int i = 0; i < 4; ++i) {
    h[8 + i] = static_cast<uint8_t>(reftable_clusters >> (24 - 8 * i));
  }
  st = co_await file_.Write(kOffRefcountTableOffset,
                            io::ConstIoVec(h, sizeof(h)));
  if (st.ok()) st = co_await file_.Flush();
  if (!st.ok()) co_return fail("ERROR setting reftable", st);

  reftable_ = std::move(reftable);
  reftable_offset_ = reftable_offset;
  reftable_size_ = reftable_.size();
  co_return absl::OkStatus();
}

io::Task<absl::Status> Checker::CheckOflagCopied(CheckResult& res,
                                                 RepairMode mode) {
  bool repair = false;
  if (mode == RepairMode::kAll) {
    repair = true;
  } else if (mode == RepairMode::kLeaks) {
    // Safe only if the refcounts are right now.
    repair = !res.check_errors && !res.corruptions && !res.leaks;
  }
  std::vector<uint8_t> table(cluster_size());
  for (uint64_t i = 0; i < l1_table_.size(); ++i) {
    const uint64_t l1_entry = l1_table_[i];
    const uint64_t l2_offset = l1_entry & format::kL1OffsetMask;
    if (l2_offset == 0) continue;

    absl::StatusOr<uint64_t> refcount =
        co_await GetStoredRefcount(l2_offset >> cluster_bits_);
    if (!refcount.ok()) continue;  // silently, as QEMU
    if ((*refcount == 1) != ((l1_entry & kCopiedFlag) != 0)) {
      ++res.corruptions;
      out_ << absl::StrFormat(
          "%s OFLAG_COPIED L2 cluster: l1_index=%d l1_entry=%x refcount=%u\n",
          repair ? "Repairing" : "ERROR", static_cast<int>(i), l1_entry,
          *refcount);
      if (repair) {
        l1_table_[i] = *refcount == 1 ? (l1_entry | kCopiedFlag)
                                      : (l1_entry & ~kCopiedFlag);
        uint8_t buf[8];
        format::StoreL1Entry(absl::MakeSpan(buf, 8), 0, l1_table_[i]);
        const uint64_t at = l1_offset_ + i * 8;
        absl::Status st = co_await OverlapCheck(kOlActiveL1, at, 8);
        if (st.ok()) st = co_await CommitRefcounts();
        if (st.ok()) st = co_await file_.Write(at, io::ConstIoVec(buf, 8));
        if (st.ok()) st = co_await file_.Flush();
        if (!st.ok()) {
          ++res.check_errors;
          co_return st;
        }
        --res.corruptions;
        ++res.corruptions_fixed;
      }
    }

    if (absl::Status st = co_await ReadAt(l2_offset, absl::MakeSpan(table));
        !st.ok()) {
      out_ << "ERROR: Could not read L2 table: " << st.message() << "\n";
      ++res.check_errors;
      co_return st;
    }
    uint64_t l2_dirty = 0;
    for (uint64_t j = 0; j < l2_entries_; ++j) {
      format::L2Entry e = format::LoadL2Entry(table, j, extended_l2_);
      const ClusterType type = GetClusterType(e.word);
      if (type != ClusterType::kNormal && type != ClusterType::kZeroAlloc) {
        continue;
      }
      uint64_t data_refcount = 1;
      if (!data_file_) {
        absl::StatusOr<uint64_t> r = co_await GetStoredRefcount(
            (e.word & format::kL2OffsetMask) >> cluster_bits_);
        if (!r.ok()) continue;
        data_refcount = *r;
      }
      if ((data_refcount == 1) != e.copied()) {
        ++res.corruptions;
        out_ << absl::StrFormat(
            "%s OFLAG_COPIED data cluster: l2_entry=%x refcount=%u\n",
            repair ? "Repairing" : "ERROR", e.word, data_refcount);
        if (repair) {
          e.word = data_refcount == 1 ? (e.word | kCopiedFlag)
                                      : (e.word & ~kCopiedFlag);
          format::StoreL2Entry(absl::MakeSpan(table), j, extended_l2_, e);
          ++l2_dirty;
        }
      }
    }
    if (l2_dirty > 0) {
      absl::Status st =
          co_await OverlapCheck(kOlActiveL2, l2_offset, cluster_size());
      if (!st.ok()) {
        out_ << "ERROR: Could not write L2 table; metadata overlap check "
                "failed: "
             << st.message() << "\n";
        ++res.check_errors;
        co_return st;
      }
      st = co_await CommitRefcounts();
      if (st.ok()) st = co_await file_.Write(l2_offset, table);
      if (!st.ok()) {
        out_ << "ERROR: Could not write L2 table: " << st.message() << "\n";
        ++res.check_errors;
        co_return st;
      }
      res.corruptions -= l2_dirty;
      res.corruptions_fixed += l2_dirty;
    }
  }
  co_return absl::OkStatus();
}

absl::Status CheckFailed(const absl::Status& st) {
  return WithMessage(st, absl::StrCat("Check failed: ", st.message()));
}

}  // namespace

io::Task<absl::StatusOr<CheckResult>> CheckQcow2(io::BlockNode& file,
                                                 RepairMode mode,
                                                 std::ostream& messages) {
  Checker checker(file, messages);
  if (absl::Status st = co_await checker.Open(/*load_bitmaps=*/true);
      !st.ok()) {
    co_return absl::Status(
        st.code(),
        absl::StrCat("Could not open '", file.filename(), "': ", st.message()));
  }
  absl::StatusOr<CheckResult> result = co_await checker.Check(mode);
  if (result.ok() && mode != RepairMode::kNone &&
      (result->corruptions_fixed || result->leaks_fixed)) {
    // "Double checking the fixed image now..."
    const CheckResult first = *result;
    result = co_await checker.Check(RepairMode::kNone);
    if (result.ok()) {
      result->corruptions_fixed = first.corruptions_fixed;
      result->leaks_fixed = first.leaks_fixed;
    }
  }
  absl::Status closed = co_await checker.Close();
  if (!result.ok()) co_return CheckFailed(result.status());
  if (!closed.ok()) co_return CheckFailed(closed);
  result->has_bitmaps = checker.has_bitmaps();
  co_return result;
}

io::Task<absl::Status> RebuildRefcounts(io::BlockNode& file,
                                        std::ostream* messages) {
  std::ostringstream discarded;
  std::ostream& out = messages != nullptr ? *messages : discarded;
  Checker checker(file, out);
  absl::Status st = co_await checker.Open();
  absl::StatusOr<CheckResult> result = absl::InternalError("not run");
  if (st.ok()) {
    result = co_await checker.Check(RepairMode::kAll);
    absl::Status closed = co_await checker.Close();
    if (result.ok() && !closed.ok()) result = closed;
  }
  if (!st.ok() || !result.ok()) {
    const absl::Status& cause = st.ok() ? result.status() : st;
    co_return absl::DataLossError(absl::StrCat(
        file.filename(), ": Could not repair dirty image: ", cause.message()));
  }
  if (result->check_errors != 0) {
    co_return absl::DataLossError(absl::StrCat(
        file.filename(), ": Could not repair dirty image: ",
        result->check_errors, " internal errors during the check"));
  }
  co_return absl::OkStatus();
}

}  // namespace imgtool::qcow2

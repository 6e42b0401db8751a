// Qcow2Node: open, close, header updates, metadata I/O and flushing.
// Reads and writes are in qcow2_io.cc, resizing in qcow2_resize.cc.
#include "qcow2/qcow2_node.h"

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "base/errno_status.h"
#include "base/status_macros.h"
#include "io/aligned_buffer.h"
#include "qcow2/check.h"
#include "qcow2/snapshot_load.h"
#include "qcow2/bytes.h"
#include "qcow2/format/refcount.h"

namespace imgtool::qcow2 {
namespace {


// Default L2 cache: enough tables to cover the whole virtual disk, at most
// 32 MiB (QEMU >= 3.1 on Linux, DEFAULT_L2_CACHE_MAX_SIZE; 32 MiB of
// standard L2 tables cover 256 GiB at 64 KiB clusters).
constexpr uint64_t kMaxDefaultL2CacheSize = uint64_t{32} << 20;
constexpr uint64_t kDefaultRefcountCacheSize = uint64_t{256} << 10;
constexpr uint64_t kIncompatibleFeaturesOffset = 72;
constexpr uint64_t kRefcountTableOffsetOffset = 48;

// QEMU's bdrv_make_absolute_filename for backing file names: an absolute
// name or one with a protocol prefix ("json:", "nbd:", ...) as it is, a
// relative one after the directory of `file` (io::BlockNode::Dirname, whose
// error it returns).
absl::StatusOr<std::string> ResolveBackingName(const io::BlockNode& file,
                                               const std::string& backing) {
  if (backing.empty() || backing[0] == '/') return backing;
  const size_t colon = backing.find(':');
  const size_t slash = backing.find('/');
  if (colon != std::string::npos &&
      (slash == std::string::npos || colon < slash)) {
    return backing;
  }
  absl::StatusOr<std::string> dir = file.Dirname();
  if (!dir.ok()) return dir.status();
  return *dir + backing;
}

}  // namespace

Qcow2Node::Qcow2Node(std::unique_ptr<io::BlockNode> file, format::Header header,
                     Config config)
    : io::BlockNode(file->filename(), file->read_only()),
      file_(std::move(file)),
      header_(std::move(header)),
      config_(config),
      cluster_bits_(header_.cluster_bits),
      cluster_size_(uint64_t{1} << header_.cluster_bits),
      l2_entries_(format::L2EntriesPerCluster(header_.cluster_bits,
                                              header_.extended_l2())) {
  l2_format_.cluster_bits = cluster_bits_;
  l2_format_.extended_l2 = header_.extended_l2();
  l2_format_.external_data_file = header_.has_data_file();
  l2_cache_ = NewL2Cache();
}

Qcow2Node::~Qcow2Node() = default;

std::unique_ptr<TableCache> Qcow2Node::NewL2Cache() {
  return std::make_unique<TableCache>(
      cluster_size_, config_.l2_cache_tables,
      [this](uint64_t offset, io::IoVec buf) {
        return ReadMetadataAfter(*this, io::BlkdebugEvent::kL2Load, offset,
                                 buf);
      },
      [this](uint64_t offset, io::ConstIoVec data) {
        return WriteL2Table(offset, data);
      });
}

uint64_t Qcow2Node::size() const { return header_.size; }

absl::StatusOr<uint64_t> Qcow2Node::AllocatedSize() const {
  return file_->AllocatedSize();
}

io::Task<absl::StatusOr<uint64_t>> Qcow2Node::RefcountedEnd() {
  auto lock = co_await io::ScopedLock::Take(meta_lock_);
  CO_RETURN_IF_ERROR(CheckUsable());
  co_return co_await refcounts_->UsedEnd();
}

std::string Qcow2Node::backing_filename() const {
  return header_.backing_file.value_or("");
}

std::string Qcow2Node::backing_format() const {
  return header_.backing_format.value_or("");
}

absl::StatusOr<uint32_t> Qcow2Node::OverlapChecks(
    const Qcow2OpenOptions& options) {
  const std::string& given = options.overlap_check();
  const std::string& tmpl = options.overlap_check_template();
  if (!given.empty() && !tmpl.empty() && given != tmpl) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "Conflicting values for qcow2 options 'overlap-check' ('%s') and "
        "'overlap-check.template' ('%s')",
        given, tmpl));
  }
  const std::string& name =
      !given.empty() ? given : (!tmpl.empty() ? tmpl : std::string("cached"));
  uint32_t bits = 0;
  if (name == "none") {
    bits = 0;
  } else if (name == "constant") {
    bits = kOverlapConstant;
  } else if (name == "cached") {
    bits = kOverlapCached;
  } else if (name == "all") {
    bits = kOverlapAll;
  } else {
    return absl::InvalidArgumentError(absl::StrFormat(
        "Unsupported value '%s' for qcow2 option 'overlap-check'. Allowed "
        "are any of the following: none, constant, cached, all",
        name));
  }
  auto set = [&bits](bool has, bool on, uint32_t bit) {
    if (has) bits = on ? (bits | bit) : (bits & ~bit);
  };
  set(options.has_overlap_check_main_header(),
      options.overlap_check_main_header(), kOverlapHeader);
  set(options.has_overlap_check_active_l1(), options.overlap_check_active_l1(),
      kOverlapActiveL1);
  set(options.has_overlap_check_active_l2(), options.overlap_check_active_l2(),
      kOverlapActiveL2);
  set(options.has_overlap_check_refcount_table(),
      options.overlap_check_refcount_table(), kOverlapRefcountTable);
  set(options.has_overlap_check_refcount_block(),
      options.overlap_check_refcount_block(), kOverlapRefcountBlock);
  set(options.has_overlap_check_snapshot_table(),
      options.overlap_check_snapshot_table(), kOverlapSnapshotTable);
  set(options.has_overlap_check_inactive_l1(),
      options.overlap_check_inactive_l1(), kOverlapInactiveL1);
  set(options.has_overlap_check_inactive_l2(),
      options.overlap_check_inactive_l2(), kOverlapInactiveL2);
  set(options.has_overlap_check_bitmap_directory(),
      options.overlap_check_bitmap_directory(), kOverlapBitmapDirectory);
  return bits;
}

absl::Status Qcow2Node::CacheSizes(const format::Header& header,
                                   const Qcow2OpenOptions& options,
                                   Config* config) {
  // QEMU 7.2's read_cache_sizes and qcow2_update_options_prepare.
  const uint64_t cs = header.cluster_size();
  const uint64_t l2_entry_bytes = header.extended_l2() ? 16 : 8;
  const uint64_t virtual_size = header.size / 512 * 512;
  const uint64_t max_l2_cache =
      ((virtual_size + cs - 1) / cs * l2_entry_bytes + cs - 1) / cs * cs;
  const uint64_t min_refcount_cache = 4 * cs;
  const uint64_t l2_setting = options.has_l2_cache_size()
                                  ? options.l2_cache_size()
                                  : kMaxDefaultL2CacheSize;
  uint64_t l2_bytes = std::min(max_l2_cache, l2_setting);
  std::optional<uint64_t> rc_bytes;
  if (options.has_refcount_cache_size()) {
    rc_bytes = options.refcount_cache_size();
  }
  if (options.has_cache_size()) {
    const uint64_t combined = options.cache_size();
    if (options.has_l2_cache_size() && options.has_refcount_cache_size()) {
      return absl::InvalidArgumentError(
          "cache-size, l2-cache-size and refcount-cache-size may not be set "
          "at the same time");
    }
    if (options.has_l2_cache_size() && l2_setting > combined) {
      return absl::InvalidArgumentError(
          "l2-cache-size may not exceed cache-size");
    }
    if (rc_bytes.value_or(0) > combined) {
      return absl::InvalidArgumentError(
          "refcount-cache-size may not exceed cache-size");
    }
    if (options.has_l2_cache_size()) {
      rc_bytes = combined - l2_bytes;
    } else if (options.has_refcount_cache_size()) {
      l2_bytes = combined - *rc_bytes;
    } else if (combined >= max_l2_cache + min_refcount_cache) {
      // As much as covers the disk for L2 tables, the rest for refcounts.
      l2_bytes = max_l2_cache;
      rc_bytes = combined - l2_bytes;
    } else {
      rc_bytes = std::min(combined, min_refcount_cache);
      l2_bytes = combined - *rc_bytes;
    }
  }
  uint64_t entry_bytes = options.has_l2_cache_entry_size()
                             ? options.l2_cache_entry_size()
                             : cs;
  // A cache smaller than the disk's L2 tables defaults to 4 KiB entries.
  if (l2_bytes < max_l2_cache && !options.has_l2_cache_entry_size()) {
    entry_bytes = std::min<uint64_t>(cs, 4096);
  }
  if (entry_bytes < (uint64_t{1} << format::kMinClusterBits) ||
      entry_bytes > cs || (entry_bytes & (entry_bytes - 1)) != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "L2 cache entry size must be a power of two between %d and the "
        "cluster size (%d)",
        1 << format::kMinClusterBits, cs));
  }
  if (l2_bytes / entry_bytes > INT_MAX) {
    return absl::InvalidArgumentError("L2 cache size too big");
  }
  // Without refcount-cache-size or cache-size: imgtool's default.
  const uint64_t rc = rc_bytes.value_or(
      std::max(kDefaultRefcountCacheSize, min_refcount_cache));
  if (rc / cs > INT_MAX) {
    return absl::InvalidArgumentError("Refcount cache size too big");
  }
  if (options.has_cache_clean_interval() &&
      static_cast<uint64_t>(options.cache_clean_interval()) > UINT_MAX) {
    return absl::InvalidArgumentError("Cache clean interval too big");
  }
  // Whole tables: at least two L2 tables and four refcount blocks (QEMU's
  // MIN_L2_CACHE_SIZE, MIN_REFCOUNT_CACHE_SIZE).
  config->l2_cache_tables = std::max<uint64_t>(2, l2_bytes / cs);
  config->refcount_cache_tables = std::max<uint64_t>(4, rc / cs);
  return absl::OkStatus();
}

io::Task<absl::StatusOr<std::unique_ptr<Qcow2Node>>> Qcow2Node::Open(
    std::unique_ptr<io::BlockNode> file, Qcow2OpenOptions options,
    BackingOpener open_backing, RefcountRepairer repair_refcounts) {
  format::Header header;
  for (int attempt = 0;; ++attempt) {
    const uint64_t file_size = file->size();
    // At least a whole v3 header: a short file reads as zeroes past its
    // end, so it fails on the magic like in QEMU.
    std::vector<uint8_t> head(std::max<uint64_t>(
        std::min<uint64_t>(file_size, 4096), format::kV3HeaderLength));
    CO_RETURN_IF_ERROR(co_await file->Read(0, io::IoVec(head)));
    if (head.size() >= 24 && LoadBE32(head.data()) == format::kMagic) {
      const uint32_t bits = LoadBE32(head.data() + 20);
      if (bits >= format::kMinClusterBits && bits <= format::kMaxClusterBits &&
          (uint64_t{1} << bits) > head.size() && file_size > head.size()) {
        head.resize(std::min<uint64_t>(file_size, uint64_t{1} << bits));
        CO_RETURN_IF_ERROR(co_await file->Read(0, io::IoVec(head)));
      }
    }
    CO_ASSIGN_OR_RETURN(header, format::DecodeHeader(head, file_size));
    if (header.has_data_file()) {
      co_return absl::UnimplementedError(
          "qcow2 images with an external data file are not supported yet");
    }
    if (header.crypt_method != format::kCryptNone) {
      co_return absl::UnimplementedError(
          "encrypted qcow2 images are not supported");
    }
    if (file->read_only()) break;
    if (header.corrupt()) {
      co_return absl::DataLossError(
          "qcow2: Image is corrupt; cannot be opened read/write");
    }
    if (!header.dirty()) break;
    if (attempt > 0) {
      co_return absl::FailedPreconditionError(
          "qcow2: the image is still dirty after repairing its refcounts");
    }
    if (repair_refcounts != nullptr) {
      CO_RETURN_IF_ERROR(co_await repair_refcounts(*file));
    } else {
      CO_RETURN_IF_ERROR(co_await RebuildRefcounts(*file));
    }
  }

  Config config;
  CO_RETURN_IF_ERROR(CacheSizes(header, options, &config));
  config.lazy_refcounts = options.has_lazy_refcounts()
                              ? options.lazy_refcounts()
                              : header.lazy_refcounts();
  if (config.lazy_refcounts && header.version < 3) {
    co_return absl::InvalidArgumentError(
        "Lazy refcounts require a qcow2 image with at least qemu 1.1 "
        "compatibility level");
  }
  CO_ASSIGN_OR_RETURN(config.overlap_check, OverlapChecks(options));

  std::unique_ptr<Qcow2Node> node(
      new Qcow2Node(std::move(file), std::move(header), config));
  CO_RETURN_IF_ERROR(co_await node->LoadTables());
  CO_RETURN_IF_ERROR(co_await node->LoadBitmaps());
  // As QEMU's qcow2_load_dirty_bitmaps: a read-write open marks the
  // bitmaps in use at once (Close stores them again).
  CO_RETURN_IF_ERROR(co_await node->MarkBitmapsInUse());
  if (!node->read_only() &&
      (node->header_.autoclear_features & ~format::kAutoclearFeaturesKnown)) {
    // As QEMU's qcow2_do_open: a writable open clears the autoclear bits it
    // does not know at once (the known ones go with the first write, see
    // PrepareFirstWrite).
    node->header_.autoclear_features &= format::kAutoclearFeaturesKnown;
    CO_RETURN_IF_ERROR(co_await node->WriteHeader());
  }

  if (node->header_.backing_file.has_value()) {
    absl::StatusOr<std::string> full =
        ResolveBackingName(*node->file_, *node->header_.backing_file);
    node->full_backing_filename_ = full.ok() ? *full : std::string();
    if (open_backing != nullptr && !full.ok()) {
      // QEMU's bdrv_open_backing_file fails with bdrv_dirname's error
      // itself, without "Could not open backing file: ".
      absl::Status closed = co_await node->file_->Close();
      (void)closed;
      co_return full.status();
    }
    if (open_backing != nullptr) {
      absl::StatusOr<std::unique_ptr<io::BlockNode>> backing =
          co_await open_backing(node->full_backing_filename_,
                                node->header_.backing_format.value_or(""));
      if (!backing.ok()) {
        absl::Status cause = backing.status();
        absl::Status closed = co_await node->file_->Close();
        (void)closed;
        co_return absl::Status(
            cause.code(),
            absl::StrCat("Could not open backing file: ", cause.message()));
      }
      node->backing_ = *std::move(backing);
    }
  }
  co_return node;
}

io::Task<absl::Status> Qcow2Node::LoadTables() {
  // L1 table (DecodeHeader checked its position and size).
  l1_.assign(header_.l1_size, 0);
  if (header_.l1_size > 0) {
    io::AlignedBuffer bytes(uint64_t{header_.l1_size} * 8);
    CO_RETURN_IF_ERROR(
        co_await file_->Read(header_.l1_table_offset, bytes.span()));
    for (uint64_t i = 0; i < l1_.size(); ++i) {
      l1_[i] = LoadBE64(bytes.data() + i * 8);
      const uint64_t l2 = l1_[i] & format::kL1OffsetMask;
      if (l2 != 0) l2_offsets_.insert(l2);
    }
  }
  // Refcount table.
  const uint64_t rt_bytes = uint64_t{header_.refcount_table_clusters}
                            << cluster_bits_;
  io::AlignedBuffer bytes(rt_bytes);
  // QEMU's qcow2_refcount_init raises reftable_load before the read; its
  // error is qcow2_do_open's.
  co_await file_->DebugEvent(io::BlkdebugEvent::kReftableLoad);
  if (absl::Status st =
          co_await file_->Read(header_.refcount_table_offset, bytes.span());
      !st.ok()) {
    const int e = StatusErrno(st);
    co_return WithMessage(
        st, absl::StrCat("Could not initialize refcount handling: ",
                         e != 0 ? std::string(std::strerror(e))
                                : std::string(st.message())));
  }
  std::vector<uint64_t> table(rt_bytes / 8);
  for (uint64_t i = 0; i < table.size(); ++i) {
    table[i] = LoadBE64(bytes.data() + i * 8);
  }
  refcounts_ = std::make_unique<Refcounts>(
      static_cast<MetadataIo&>(*this), cluster_bits_, header_.refcount_order,
      header_.refcount_table_offset, header_.refcount_table_clusters,
      std::move(table), config_.refcount_cache_tables);
  co_return co_await LoadSnapshotTable();
}

io::Task<absl::Status> Qcow2Node::LoadSnapshotTable() {
  snapshot_records_.clear();
  snapshot_l1s_.clear();
  snapshots_bytes_ = 0;
  snapshot_extra_too_short_ = false;
  // QEMU 7.2's qcow2_read_snapshots (snapshot_load.h). The snapshot L1
  // tables are checked only when a snapshot is used (ValidateSnapshotL1).
  CO_ASSIGN_OR_RETURN(
      LoadedSnapshots table,
      co_await qcow2::LoadSnapshotTable(*file_, header_.snapshots_offset,
                                        header_.nb_snapshots,
                                        header_.size / 512 * 512, nullptr));
  for (const SnapshotRecord& r : table.entries) {
    if (r.extra_data_size < format::kSnapshotExtraV3MinBytes) {
      snapshot_extra_too_short_ = true;
    }
    snapshot_l1s_.push_back({r.l1_offset, uint64_t{r.l1_size} * 8});
  }
  snapshots_bytes_ = table.bytes;
  snapshot_records_ = std::move(table.entries);
  co_return absl::OkStatus();
}

// ---- Metadata I/O -----------------------------------------------------------

io::Task<absl::Status> Qcow2Node::ReadMetadata(uint64_t offset, io::IoVec buf) {
  co_return co_await file_->Read(offset, buf);
}

uint32_t Qcow2Node::CheckOverlap(uint64_t offset, uint64_t size,
                                 uint32_t ignore) const {
  if (size == 0) return 0;
  const uint32_t chk = config_.overlap_check & ~ignore;
  if (chk == 0) return 0;
  if ((chk & kOverlapHeader) && offset < cluster_size_) return kOverlapHeader;
  const uint64_t mask = cluster_size_ - 1;
  const uint64_t start = offset & ~mask;
  const uint64_t end = (offset + size + mask) & ~mask;
  auto overlaps = [&](uint64_t o, uint64_t n) {
    return n != 0 && o < end && start < o + n;
  };
  if ((chk & kOverlapActiveL1) &&
      overlaps(header_.l1_table_offset, uint64_t{header_.l1_size} * 8)) {
    return kOverlapActiveL1;
  }
  if ((chk & kOverlapRefcountTable) &&
      overlaps(refcounts_->table_offset(), refcounts_->table_bytes())) {
    return kOverlapRefcountTable;
  }
  if ((chk & kOverlapSnapshotTable) &&
      overlaps(header_.snapshots_offset, snapshots_bytes_)) {
    return kOverlapSnapshotTable;
  }
  if (chk & kOverlapInactiveL1) {
    for (const SnapshotL1& s : snapshot_l1s_) {
      if (overlaps(s.offset, s.bytes)) return kOverlapInactiveL1;
    }
  }
  const uint64_t clusters = (end - start) >> cluster_bits_;
  if (chk & kOverlapActiveL2) {
    if (clusters < l2_offsets_.size()) {
      for (uint64_t c = start; c < end; c += cluster_size_) {
        if (l2_offsets_.contains(c)) return kOverlapActiveL2;
      }
    } else {
      for (uint64_t o : l2_offsets_) {
        if (overlaps(o, cluster_size_)) return kOverlapActiveL2;
      }
    }
  }
  if (chk & kOverlapRefcountBlock) {
    const std::vector<uint64_t>& table = refcounts_->table();
    if (clusters < table.size()) {
      for (uint64_t c = start; c < end; c += cluster_size_) {
        if (refcounts_->IsRefcountBlock(c)) return kOverlapRefcountBlock;
      }
    } else {
      for (uint64_t o : table) {
        if (o != 0 && overlaps(o, cluster_size_)) return kOverlapRefcountBlock;
      }
    }
  }
  // (QEMU checks inactive L2 tables here: InactiveL2Overlap.)
  if ((chk & kOverlapBitmapDirectory) &&
      (header_.autoclear_features & format::kAutoclearBitmaps) &&
      header_.bitmaps.has_value() &&
      overlaps(header_.bitmaps->bitmap_directory_offset,
               header_.bitmaps->bitmap_directory_size)) {
    return kOverlapBitmapDirectory;
  }
  return 0;
}

io::Task<absl::StatusOr<bool>> Qcow2Node::InactiveL2Overlap(uint64_t offset,
                                                            uint64_t size) {
  const uint64_t mask = cluster_size_ - 1;
  const uint64_t start = offset & ~mask;
  const uint64_t end = (offset + size + mask) & ~mask;
  constexpr uint64_t kMaxL1Bytes = uint64_t{32} << 20;  // QCOW_MAX_L1_SIZE
  for (const SnapshotL1& s : snapshot_l1s_) {
    // qcow2_validate_table(..., QCOW_MAX_L1_SIZE, "", NULL).
    if (s.bytes > kMaxL1Bytes) {
      co_return WithMessage(ErrnoStatus("", "inactive L2 check", EFBIG),
                            "Snapshot L1 table too large");
    }
    if (uint64_t{INT64_MAX} - s.bytes < s.offset || (s.offset & mask) != 0) {
      co_return WithMessage(ErrnoStatus("", "inactive L2 check", EINVAL),
                            "Snapshot L1 table offset invalid");
    }
    if (s.bytes == 0) continue;
    io::AlignedBuffer l1(s.bytes);
    CO_RETURN_IF_ERROR(co_await file_->Read(s.offset, l1.span()));
    for (uint64_t i = 0; i < s.bytes; i += 8) {
      const uint64_t l2 = LoadBE64(l1.data() + i) & format::kL1OffsetMask;
      if (l2 != 0 && l2 < end && start < l2 + cluster_size_) co_return true;
    }
  }
  co_return false;
}

io::Task<absl::Status> Qcow2Node::CheckOverlapOrFail(uint64_t offset,
                                                     uint64_t size,
                                                     uint32_t ignore) {
  uint32_t kind = CheckOverlap(offset, size, ignore);
  if ((kind == 0 || kind == kOverlapBitmapDirectory) && size != 0 &&
      (config_.overlap_check & ~ignore & kOverlapInactiveL2) &&
      !snapshot_l1s_.empty()) {
    CO_ASSIGN_OR_RETURN(const bool inactive,
                        co_await InactiveL2Overlap(offset, size));
    if (inactive) kind = kOverlapInactiveL2;
  }
  if (kind == 0) co_return absl::OkStatus();
  const char* name = "metadata";
  switch (kind) {
    case kOverlapHeader: name = "qcow2_header"; break;
    case kOverlapActiveL1: name = "active L1 table"; break;
    case kOverlapActiveL2: name = "active L2 table"; break;
    case kOverlapRefcountTable: name = "refcount table"; break;
    case kOverlapRefcountBlock: name = "refcount block"; break;
    case kOverlapSnapshotTable: name = "snapshot table"; break;
    case kOverlapInactiveL1: name = "inactive L1 table"; break;
    case kOverlapInactiveL2: name = "inactive L2 table"; break;
    case kOverlapBitmapDirectory: name = "bitmap directory"; break;
  }
  co_return co_await SignalCorruption(absl::StrCat(
      "Preventing invalid write on metadata (overlaps with ", name, ")"));
}

io::Task<absl::Status> Qcow2Node::WriteMetadata(uint64_t offset,
                                                io::ConstIoVec data,
                                                uint32_t ignore) {
  CO_RETURN_IF_ERROR(CheckUsable());
  CO_RETURN_IF_ERROR(co_await CheckOverlapOrFail(offset, data.size(), ignore));
  co_return co_await file_->Write(offset, data);
}

io::Task<absl::Status> Qcow2Node::SyncFile() {
  const uint64_t gen = write_gen_;
  CO_RETURN_IF_ERROR(co_await file_->Flush());
  synced_gen_ = gen;
  co_return absl::OkStatus();
}

io::Task<absl::Status> Qcow2Node::SyncNewTables() {
  std::shared_ptr<SyncRound> round;
  if (sync_running_ == nullptr) {
    round = std::make_shared<SyncRound>();
  } else if (sync_next_ != nullptr) {
    // Queued after the flush in flight (which may have started before our
    // writes) by an earlier caller: it runs it for us too.
    round = sync_next_;
    co_await round->done.Wait();
    co_return round->status;
  } else {
    round = std::make_shared<SyncRound>();
    sync_next_ = round;
    std::shared_ptr<SyncRound> running = sync_running_;
    co_await running->done.Wait();
    if (sync_next_ == round) sync_next_ = nullptr;
  }
  // Another caller may have started one since the last ended: flushes in
  // parallel are still each after their callers' writes.
  sync_running_ = round;
  // Every caller of this round allocated its table before it joined: one
  // write of the dirty refcount blocks covers them all.
  {
    auto lock = co_await io::ScopedLock::Take(meta_lock_);
    round->status = co_await refcounts_->WriteDirty();
  }
  if (round->status.ok()) round->status = co_await SyncFile();
  if (sync_running_ == round) sync_running_ = nullptr;
  round->done.Set();
  co_return round->status;
}

io::Task<absl::Status> Qcow2Node::SignalCorruption(std::string message) {
  if (read_only()) {
    co_return absl::DataLossError(
        absl::StrCat("qcow2: Image is corrupt: ", message,
                     "; further non-fatal corruption events will be "
                     "suppressed"));
  }
  if (!broken_.ok()) co_return broken_;
  broken_ = absl::DataLossError(
      absl::StrCat("qcow2: Marking image as corrupt: ", message,
                   "; further corruption events will be suppressed"));
  header_.incompatible_features |= format::kIncompatibleCorrupt;
  if (header_.version >= 3) {
    // Only the feature field; nothing else is written any more.
    uint8_t field[8];
    StoreBE64(field, header_.incompatible_features);
    absl::Status st = co_await file_->Write(kIncompatibleFeaturesOffset,
                                            io::ConstIoVec(field, 8));
    if (st.ok()) st = co_await file_->Flush();
    (void)st;
  }
  co_return broken_;
}

io::Task<absl::Status> Qcow2Node::SetRefcountTable(uint64_t offset,
                                                   uint32_t clusters) {
  uint8_t field[12];
  StoreBE64(field, offset);
  StoreBE32(field + 8, clusters);
  CO_RETURN_IF_ERROR(co_await WriteHeaderField(kRefcountTableOffsetOffset,
                                               io::ConstIoVec(field, 12)));
  header_.refcount_table_offset = offset;
  header_.refcount_table_clusters = clusters;
  co_return absl::OkStatus();
}

void Qcow2Node::ClusterFreed(uint64_t offset) {
  if (l2_cache_ != nullptr) l2_cache_->Discard(offset);
}

io::Task<absl::Status> Qcow2Node::WriteHeaderField(uint64_t offset,
                                                   io::ConstIoVec bytes) {
  CO_RETURN_IF_ERROR(CheckUsable());
  CO_RETURN_IF_ERROR(co_await file_->Write(offset, bytes));
  co_return co_await SyncFile();
}

io::Task<absl::Status> Qcow2Node::WriteIncompatibleFeatures() {
  uint8_t field[8];
  StoreBE64(field, header_.incompatible_features);
  co_return co_await WriteHeaderField(kIncompatibleFeaturesOffset,
                                      io::ConstIoVec(field, 8));
}

io::Task<absl::Status> Qcow2Node::WriteHeader() {
  CO_RETURN_IF_ERROR(CheckUsable());
  std::vector<uint8_t> bytes = format::EncodeHeader(header_);
  if (bytes.size() > cluster_size_) {
    co_return absl::ResourceExhaustedError(absl::StrFormat(
        "%s: qcow2 header does not fit in the first cluster", filename()));
  }
  header_.header_length = header_.version >= 3 ? LoadBE32(bytes.data() + 100)
                                               : format::kV2HeaderLength;
  header_.backing_file_offset = LoadBE64(bytes.data() + 8);
  header_.backing_file_size = LoadBE32(bytes.data() + 16);
  bytes.resize(cluster_size_, 0);
  CO_RETURN_IF_ERROR(co_await file_->Write(0, bytes));
  co_return co_await SyncFile();
}

io::Task<absl::Status> Qcow2Node::ChangeBackingFile(
    std::optional<std::string> backing_file,
    std::optional<std::string> backing_format) {
  if (read_only()) {
    co_return absl::FailedPreconditionError(
        absl::StrCat(filename(), ": the image is read-only"));
  }
  // QEMU's qcow2_change_backing_file checks, in its order.
  if (backing_file.has_value() && header_.data_file_raw()) {
    co_return absl::InvalidArgumentError(absl::StrCat(
        filename(), ": an image with a raw external data file cannot have a "
                    "backing file"));
  }
  if (backing_file.has_value() &&
      backing_file->size() > format::kMaxBackingFileNameLength) {
    co_return absl::InvalidArgumentError(
        absl::StrCat(filename(), ": backing file name too long"));
  }
  auto lock = co_await io::ScopedLock::Take(meta_lock_);
  CO_RETURN_IF_ERROR(CheckUsable());
  format::Header next = header_;
  next.backing_file = std::move(backing_file);
  next.backing_format = std::move(backing_format);
  if (format::EncodeHeader(next).size() > cluster_size_) {
    co_return absl::ResourceExhaustedError(absl::StrCat(
        filename(), ": No space left in the file header"));
  }
  // The data and metadata the new backing file relies on (safe rebase
  // copies what differs first) are durable before the header names it.
  CO_RETURN_IF_ERROR(co_await FlushAll());
  next.incompatible_features = header_.incompatible_features;
  std::swap(header_, next);
  absl::Status st = co_await WriteHeader();
  if (!st.ok()) {
    std::swap(header_, next);  // the old header is what the image holds
    co_return st;
  }
  full_backing_filename_.clear();
  if (header_.backing_file.has_value()) {
    absl::StatusOr<std::string> full =
        ResolveBackingName(*file_, *header_.backing_file);
    if (full.ok()) full_backing_filename_ = *full;
  }
  co_return absl::OkStatus();
}

io::Task<absl::Status> Qcow2Node::WriteL1Entry(uint64_t index) {
  CO_RETURN_IF_ERROR(co_await WriteL1Sector(index));
  co_return co_await SyncFile();
}

io::Task<absl::Status> Qcow2Node::WriteL1Sector(uint64_t index) {
  // One 512-byte sector of the table, as QEMU writes it.
  constexpr uint64_t kPerSector = 512 / 8;
  const uint64_t first = index & ~(kPerSector - 1);
  const uint64_t n = std::min<uint64_t>(kPerSector, l1_.size() - first);
  std::vector<uint8_t> bytes(n * 8);
  for (uint64_t i = 0; i < n; ++i) StoreBE64(bytes.data() + i * 8, l1_[first + i]);
  co_await file_->DebugEvent(io::BlkdebugEvent::kL1Update);
  co_return co_await WriteMetadata(header_.l1_table_offset + first * 8, bytes,
                                   kOverlapActiveL1);
}

io::Task<absl::Status> Qcow2Node::PrepareFirstWrite() {
  if (first_write_done_) co_return absl::OkStatus();
  // Features this driver does not maintain (raw external data and anything
  // newer) become invalid with the first write; the bitmaps bit stays while
  // there are bitmaps (in use until Close stores them). Without them it is
  // dropped: QEMU 7.2 would take the absent directory for metadata at
  // offset 0 and mark the image corrupt on its next write.
  const uint64_t kept = header_.bitmaps.has_value()
                            ? header_.autoclear_features & format::kAutoclearBitmaps
                            : 0;
  if (header_.autoclear_features != kept) {
    header_.autoclear_features = kept;
    CO_RETURN_IF_ERROR(co_await WriteHeader());
  }
  CO_RETURN_IF_ERROR(co_await MarkBitmapsInUse());
  if (config_.lazy_refcounts && !header_.dirty()) {
    header_.incompatible_features |= format::kIncompatibleDirty;
    CO_RETURN_IF_ERROR(co_await WriteIncompatibleFeatures());
    dirty_set_by_us_ = true;
  }
  first_write_done_ = true;
  co_return absl::OkStatus();
}

// ---- Flushing -----------------------------------------------------------------

io::Task<absl::Status> Qcow2Node::PrepareL2Write() {
  // While the dirty bit is set (lazy refcounts) the refcounts on disk need
  // not be accurate, so L2 tables do not wait for them (QEMU sets the cache
  // dependency only when qcow2_need_accurate_refcounts).
  if (refcounts_->dirty() && !header_.dirty()) {
    CO_RETURN_IF_ERROR(co_await refcounts_->WriteDirty());
    co_return co_await SyncFile();
  }
  if (write_gen_ != synced_gen_) co_return co_await SyncFile();
  co_return absl::OkStatus();
}

io::Task<absl::Status> Qcow2Node::WriteL2Table(uint64_t offset,
                                               io::ConstIoVec data) {
  CO_RETURN_IF_ERROR(co_await PrepareL2Write());
  co_await file_->DebugEvent(io::BlkdebugEvent::kL2Update);
  co_return co_await WriteMetadata(offset, data, kOverlapActiveL2);
}

uint64_t Qcow2Node::OldestDataOp() const {
  return ops_in_flight_.empty() ? next_seq_ : *ops_in_flight_.begin();
}

io::Task<absl::Status> Qcow2Node::ReclaimFreedClusters() {
  const uint64_t oldest = OldestDataOp();
  if (std::none_of(pending_frees_.begin(), pending_frees_.end(),
                   [oldest](const PendingFree& f) { return f.seq <= oldest; })) {
    co_return absl::OkStatus();
  }
  // The L2 entries that dropped the clusters reach the disk first: a crash
  // then leaks them at worst, and no entry on disk points to a cluster
  // that holds another guest cluster's data.
  CO_RETURN_IF_ERROR(co_await l2_cache_->WriteDirty());
  CO_RETURN_IF_ERROR(co_await SyncFile());
  co_return co_await ApplyPendingFrees();
}

io::Task<absl::Status> Qcow2Node::ApplyPendingFrees() {
  if (pending_frees_.empty()) co_return absl::OkStatus();
  const uint64_t oldest = OldestDataOp();
  std::vector<PendingFree> keep;
  std::vector<PendingFree> apply;
  for (const PendingFree& f : pending_frees_) {
    (f.seq <= oldest ? apply : keep).push_back(f);
  }
  pending_frees_ = std::move(keep);
  absl::Status result;
  // Host ranges to discard, adjacent clusters merged into one request as
  // QEMU merges its queued discards (update_refcount_discard): with
  // clusters smaller than the file system's blocks, cluster-sized punches
  // would zero the blocks but free none.
  std::vector<std::pair<uint64_t, uint64_t>> discards;
  for (const PendingFree& f : apply) {
    absl::Status st = co_await refcounts_->Free(f.offset, f.length);
    if (!st.ok()) {
      if (result.ok()) result = st;
      continue;
    }
    if (f.discard) {
      // Only whole clusters whose refcount is now 0.
      const uint64_t mask = cluster_size_ - 1;
      for (uint64_t c = f.offset & ~mask; c < f.offset + f.length;
           c += cluster_size_) {
        absl::StatusOr<uint64_t> rc = co_await refcounts_->Get(c >> cluster_bits_);
        if (rc.ok() && *rc == 0) discards.emplace_back(c, cluster_size_);
      }
    }
  }
  std::sort(discards.begin(), discards.end());
  for (size_t i = 0; i < discards.size();) {
    const uint64_t start = discards[i].first;
    uint64_t end = start + discards[i].second;
    for (++i; i < discards.size() && discards[i].first <= end; ++i) {
      end = std::max(end, discards[i].first + discards[i].second);
    }
    absl::Status d = co_await file_->Discard(start, end - start);
    (void)d;  // advisory
  }
  co_return result;
}

io::Task<absl::Status> Qcow2Node::FlushAll() {
  CO_RETURN_IF_ERROR(CheckUsable());
  CO_RETURN_IF_ERROR(co_await l2_cache_->WriteDirty());
  CO_RETURN_IF_ERROR(co_await refcounts_->WriteDirty());
  CO_RETURN_IF_ERROR(co_await SyncFile());
  if (!pending_frees_.empty()) {
    CO_RETURN_IF_ERROR(co_await ApplyPendingFrees());
    CO_RETURN_IF_ERROR(co_await refcounts_->WriteDirty());
    CO_RETURN_IF_ERROR(co_await SyncFile());
  }
  co_return absl::OkStatus();
}

io::Task<absl::Status> Qcow2Node::DoFlush() {
  if (read_only()) co_return absl::OkStatus();
  auto lock = co_await io::ScopedLock::Take(meta_lock_);
  if (header_.dirty()) {
    // As QEMU's qcow2_write_caches: with the dirty bit set only the L2
    // tables are written; the refcounts reach the file when the image is
    // marked clean (Close), so a crash leaves what `check -r` repairs.
    CO_RETURN_IF_ERROR(CheckUsable());
    CO_RETURN_IF_ERROR(co_await l2_cache_->WriteDirty());
    co_return co_await SyncFile();
  }
  co_return co_await FlushAll();
}

io::Task<absl::Status> Qcow2Node::FlushCachesForClose() {
  // The L2 table cache: its dirty tables, then a flush of the file.
  absl::Status l2 = co_await l2_cache_->WriteDirty();
  if (l2.ok()) l2 = co_await SyncFile();
  absl::Status refs;
  if (l2.ok() && !pending_frees_.empty()) refs = co_await ApplyPendingFrees();
  // The refcount block cache: dirty blocks wait for dirty L2 tables (QEMU's
  // cache dependency), then a flush of the file.
  if (refs.ok() && refcounts_->dirty() && l2_cache_->HasDirty()) {
    refs = co_await l2_cache_->WriteDirty();
    if (refs.ok()) refs = co_await SyncFile();
  }
  if (refs.ok()) refs = co_await refcounts_->WriteDirty();
  if (refs.ok()) refs = co_await SyncFile();
  if (l2.ok() && refs.ok()) co_return absl::OkStatus();
  auto text = [](const absl::Status& st) {
    const int e = StatusErrno(st);
    return e != 0 ? std::string(std::strerror(e)) : std::string(st.message());
  };
  std::vector<std::string> lines;
  if (!l2.ok()) {
    lines.push_back(absl::StrCat("Failed to flush the L2 table cache: ", text(l2)));
  }
  if (!refs.ok()) {
    lines.push_back(
        absl::StrCat("Failed to flush the refcount block cache: ", text(refs)));
  }
  co_return WithMessage(l2.ok() ? refs : l2, absl::StrJoin(lines, "\n"));
}

io::Task<absl::Status> Qcow2Node::Close() {
  if (closed_) co_return absl::OkStatus();
  closed_ = true;
  absl::Status result;
  if (!read_only() && broken_.ok()) {
    auto lock = co_await io::ScopedLock::Take(meta_lock_);
    result = co_await StoreBitmaps();
    if (result.ok()) result = co_await FlushCachesForClose();
    if (result.ok() && dirty_set_by_us_) {
      header_.incompatible_features &= ~format::kIncompatibleDirty;
      result = co_await WriteIncompatibleFeatures();
      dirty_set_by_us_ = false;
    }
  }
  if (backing_ != nullptr) {
    absl::Status st = co_await backing_->Close();
    if (result.ok()) result = st;
  }
  absl::Status st = co_await file_->Close();
  if (result.ok()) result = st;
  co_return result;
}

}  // namespace imgtool::qcow2

// Qcow2Node: persistent dirty bitmaps (qcow2 spec "Bitmaps"; behaviour of
// QEMU 7.2's block/qcow2-bitmap.c, block/dirty-bitmap.c and the QMP
// block-dirty-bitmap-* commands qemu-img bitmap runs). See qcow2_node.h.
#include <algorithm>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/status_macros.h"
#include "io/aligned_buffer.h"
#include "qcow2/bitmap_load.h"
#include "qcow2/bytes.h"
#include "qcow2/qcow2_node.h"

namespace imgtool::qcow2 {
namespace {

uint64_t BitCount(uint64_t size, uint32_t granularity_bits) {
  const uint64_t g = uint64_t{1} << granularity_bits;
  return size / g + (size % g != 0 ? 1 : 0);
}

// Sets bits [first, end) of `words`.
void SetBits(std::vector<uint64_t>& words, uint64_t first, uint64_t end) {
  while (first < end) {
    const uint64_t w = first / 64;
    const uint64_t lo = first % 64;
    const uint64_t n = std::min<uint64_t>(64 - lo, end - first);
    const uint64_t mask = n == 64 ? ~uint64_t{0} : ((uint64_t{1} << n) - 1) << lo;
    words[w] |= mask;
    first += n;
  }
}

bool TestBit(const std::vector<uint64_t>& words, uint64_t i) {
  return (words[i / 64] >> (i % 64)) & 1;
}

// Clears the bits of the last word past `nbits`.
void TrimBits(std::vector<uint64_t>& words, uint64_t nbits) {
  words.resize((nbits + 63) / 64, 0);
  if (nbits % 64 != 0) words.back() &= (uint64_t{1} << (nbits % 64)) - 1;
}

absl::Status Inconsistent(const std::string& name) {
  return absl::FailedPreconditionError(absl::StrCat(
      "Bitmap '", name,
      "' is inconsistent and cannot be used\nTry block-dirty-bitmap-remove "
      "to delete this bitmap from disk"));
}

absl::Status NotFound(const std::string& name) {
  return absl::NotFoundError(
      absl::StrCat("Dirty bitmap '", name, "' not found"));
}

}  // namespace

Qcow2Node::LiveBitmap* Qcow2Node::FindBitmap(const std::string& name) {
  for (LiveBitmap& bm : bitmaps_) {
    if (bm.entry.name == name) return &bm;
  }
  return nullptr;
}

const Qcow2Node::LiveBitmap* Qcow2Node::FindBitmap(
    const std::string& name) const {
  for (const LiveBitmap& bm : bitmaps_) {
    if (bm.entry.name == name) return &bm;
  }
  return nullptr;
}

io::Task<absl::Status> Qcow2Node::LoadBitmaps() {
  bitmaps_.clear();
  if (!header_.bitmaps.has_value() || header_.bitmaps->nb_bitmaps == 0) {
    co_return absl::OkStatus();
  }
  CO_ASSIGN_OR_RETURN(std::vector<LoadedBitmap> loaded,
                      co_await LoadPersistentBitmaps(*file_, *header_.bitmaps,
                                                     cluster_bits_, size()));
  for (LoadedBitmap& l : loaded) {
    LiveBitmap bm;
    bm.on_disk = true;
    bm.enabled = l.entry.enabled();
    bm.inconsistent = l.entry.in_use();
    bm.entry = std::move(l.entry);
    bm.table = std::move(l.table);
    bm.bits = std::move(l.bits);
    bitmaps_.push_back(std::move(bm));
  }
  co_return absl::OkStatus();
}

io::Task<absl::Status> Qcow2Node::MarkBitmapsInUse() {
  if (bitmaps_in_use_ || read_only()) co_return absl::OkStatus();
  bool any = false;
  std::vector<format::BitmapDirEntry> entries;
  for (const LiveBitmap& bm : bitmaps_) {
    if (!bm.on_disk) continue;
    entries.push_back(bm.entry);
    if (!bm.inconsistent) {
      entries.back().flags |= format::kBitmapFlagInUse;
      any = true;
    }
  }
  if (any) {
    // Same names, same size: the directory is rewritten in place; only
    // flags change, so a torn write leaves each entry valid.
    std::vector<uint8_t> bytes = format::EncodeBitmapDirectory(entries);
    CO_RETURN_IF_ERROR(CheckUsable());
    CO_RETURN_IF_ERROR(co_await file_->Write(
        header_.bitmaps->bitmap_directory_offset, io::ConstIoVec(bytes)));
    CO_RETURN_IF_ERROR(co_await SyncFile());
    size_t k = 0;
    for (LiveBitmap& bm : bitmaps_) {
      if (bm.on_disk) bm.entry.flags = entries[k++].flags;
    }
    bitmaps_changed_ = true;
  }
  bitmaps_in_use_ = true;
  co_return absl::OkStatus();
}

void Qcow2Node::MarkDirty(uint64_t offset, uint64_t length) {
  if (length == 0) return;
  for (LiveBitmap& bm : bitmaps_) {
    if (!bm.enabled || bm.inconsistent) continue;
    const uint32_t g = bm.entry.granularity_bits;
    const uint64_t nbits = bm.bits.size() * 64;
    const uint64_t first = offset >> g;
    const uint64_t end = std::min(((offset + length - 1) >> g) + 1, nbits);
    if (first < end) SetBits(bm.bits, first, end);
    // Stored at Close even if the request changes nothing on disk (an
    // unaligned discard), as QEMU sets the bits of every request.
    bitmaps_changed_ = true;
  }
}

absl::Status Qcow2Node::CheckBitmapsResizable() const {
  for (const LiveBitmap& bm : bitmaps_) {
    if (bm.inconsistent) return Inconsistent(bm.entry.name);
  }
  return absl::OkStatus();
}

void Qcow2Node::ResizeBitmaps(uint64_t new_size) {
  for (LiveBitmap& bm : bitmaps_) {
    if (bm.inconsistent) continue;
    TrimBits(bm.bits, BitCount(new_size, bm.entry.granularity_bits));
  }
  if (!bitmaps_.empty()) bitmaps_changed_ = true;
}

io::Task<absl::Status> Qcow2Node::ReplaceBitmapDirectory(
    const std::vector<format::BitmapDirEntry>& entries) {
  const std::optional<format::BitmapsExtension> old = header_.bitmaps;
  const uint64_t old_autoclear = header_.autoclear_features;
  uint64_t new_offset = 0;
  uint64_t new_size = 0;
  if (!entries.empty()) {
    if (entries.size() > format::kMaxBitmaps) {
      co_return absl::InvalidArgumentError("Too many persistent bitmaps");
    }
    std::vector<uint8_t> bytes = format::EncodeBitmapDirectory(entries);
    if (bytes.size() > format::kMaxBitmapDirectorySize) {
      co_return absl::InvalidArgumentError("Bitmap directory is too large");
    }
    CO_ASSIGN_OR_RETURN(new_offset, co_await refcounts_->Allocate(bytes.size()));
    new_size = bytes.size();
    CO_RETURN_IF_ERROR(co_await WriteMetadata(new_offset, io::ConstIoVec(bytes), 0));
    // The refcounts of everything the directory reaches are durable before
    // the header points at it.
    CO_RETURN_IF_ERROR(co_await FlushAll());
    header_.bitmaps = format::BitmapsExtension{
        static_cast<uint32_t>(entries.size()), new_size, new_offset};
    header_.autoclear_features |= format::kAutoclearBitmaps;
  } else {
    header_.bitmaps.reset();
    header_.autoclear_features &= ~format::kAutoclearBitmaps;
  }
  absl::Status st = co_await WriteHeader();
  if (!st.ok()) {
    header_.bitmaps = old;
    header_.autoclear_features = old_autoclear;
    co_return st;
  }
  if (old.has_value() && old->bitmap_directory_size > 0) {
    CO_RETURN_IF_ERROR((co_await FreeClustersOrReport(
                            old->bitmap_directory_offset,
                            old->bitmap_directory_size))
                           .status());
  }
  co_return absl::OkStatus();
}

io::Task<absl::StatusOr<bool>> Qcow2Node::FreeClustersOrReport(
    uint64_t offset, uint64_t length) {
  if (length == 0) co_return true;
  // QEMU's update_refcount fails with EINVAL before changing anything when
  // a refcount would drop below zero (it undoes a partial change).
  const uint64_t first = offset >> cluster_bits_;
  const uint64_t last = (offset + length - 1) >> cluster_bits_;
  for (uint64_t c = first; c <= last; ++c) {
    CO_ASSIGN_OR_RETURN(uint64_t refcount, co_await refcounts_->Get(c));
    if (refcount == 0) {
      *messages_ << "qcow2_free_clusters failed: Invalid argument\n";
      co_return false;
    }
  }
  CO_RETURN_IF_ERROR(co_await refcounts_->Free(offset, length));
  co_return true;
}

io::Task<absl::Status> Qcow2Node::FreeBitmapClusters(const LiveBitmap& bm) {
  if (bm.entry.table_size == 0 || bm.entry.table_offset == 0) {
    co_return absl::OkStatus();
  }
  std::vector<uint64_t> table = bm.table;
  if (bm.inconsistent) {
    // Not read at open; bytes past the end of the file read as zeroes.
    std::vector<uint8_t> raw(uint64_t{bm.entry.table_size} * 8);
    CO_RETURN_IF_ERROR(co_await ReadZeroPadded(*file_, bm.entry.table_offset,
                                               absl::MakeSpan(raw)));
    table.resize(bm.entry.table_size);
    for (uint64_t i = 0; i < table.size(); ++i) {
      table[i] = LoadBE64(raw.data() + i * 8);
      if (!format::BitmapTableEntryValid(table[i], cluster_size_)) {
        co_return absl::DataLossError(absl::StrCat(
            "Could not read bitmap_table table from image for bitmap '",
            bm.entry.name, "': Invalid argument"));
      }
    }
  }
  for (uint64_t entry : table) {
    const uint64_t offset = entry & format::kBitmapTableOffsetMask;
    if (offset == 0) continue;
    CO_ASSIGN_OR_RETURN(bool freed,
                        co_await FreeClustersOrReport(offset, cluster_size_));
    if (freed) {
      absl::Status d = co_await file_->Discard(offset, cluster_size_);
      (void)d;  // advisory, as QEMU's QCOW2_DISCARD_ALWAYS
    }
  }
  CO_RETURN_IF_ERROR((co_await FreeClustersOrReport(
                          bm.entry.table_offset,
                          uint64_t{bm.entry.table_size} * 8))
                         .status());
  co_return absl::OkStatus();
}

io::Task<absl::Status> Qcow2Node::StoreBitmaps() {
  if (!bitmaps_changed_) co_return absl::OkStatus();
  CO_RETURN_IF_ERROR(CheckUsable());
  // Bits set by requests that changed nothing on disk: the old directory
  // is marked in use first, as QEMU's open has it.
  CO_RETURN_IF_ERROR(co_await MarkBitmapsInUse());
  std::vector<format::BitmapDirEntry> entries;
  std::vector<LiveBitmap> drop;  // old tables to free once replaced
  std::vector<LiveBitmap> next;
  io::AlignedBuffer buf(cluster_size_);
  const uint64_t words_per_cluster = cluster_size_ / 8;
  for (const LiveBitmap& bm : bitmaps_) {
    if (bm.inconsistent) {
      entries.push_back(bm.entry);
      next.push_back(bm);
      continue;
    }
    const uint32_t g = bm.entry.granularity_bits;
    const uint64_t tb_size = format::BitmapTableSize(size(), g, cluster_bits_);
    if (tb_size > format::kBitmapMaxTableSize ||
        tb_size * cluster_size_ > format::kBitmapMaxPhysSize) {
      co_return absl::InvalidArgumentError(
          absl::StrCat("Bitmap '", bm.entry.name, "' is too big"));
    }
    std::vector<uint64_t> tb(tb_size, 0);
    for (uint64_t i = 0; i < tb_size; ++i) {
      const uint64_t first_word = i * words_per_cluster;
      if (first_word >= bm.bits.size()) break;
      const uint64_t n = std::min(words_per_cluster, bm.bits.size() - first_word);
      const auto begin = bm.bits.begin() + first_word;
      if (std::all_of(begin, begin + n, [](uint64_t w) { return w == 0; })) {
        continue;
      }
      std::memset(buf.data(), 0, cluster_size_);
      for (uint64_t w = 0; w < n; ++w) {
        uint64_t v = bm.bits[first_word + w];
        for (int b = 0; b < 8; ++b, v >>= 8) {
          buf.data()[w * 8 + b] = static_cast<uint8_t>(v);
        }
      }
      CO_ASSIGN_OR_RETURN(uint64_t off, co_await refcounts_->Allocate(cluster_size_));
      CO_RETURN_IF_ERROR(co_await WriteMetadata(off, buf.span(), 0));
      tb[i] = off;
    }
    CO_ASSIGN_OR_RETURN(uint64_t tb_offset,
                        co_await refcounts_->Allocate(tb_size * 8));
    std::vector<uint8_t> raw(tb_size * 8);
    for (uint64_t i = 0; i < tb_size; ++i) StoreBE64(raw.data() + i * 8, tb[i]);
    CO_RETURN_IF_ERROR(co_await WriteMetadata(tb_offset, io::ConstIoVec(raw), 0));
    if (bm.on_disk) drop.push_back(bm);
    LiveBitmap stored = bm;
    stored.entry.table_offset = tb_offset;
    stored.entry.table_size = static_cast<uint32_t>(tb_size);
    stored.entry.flags = bm.enabled ? format::kBitmapFlagAuto : 0;
    stored.table = std::move(tb);
    stored.on_disk = true;
    entries.push_back(stored.entry);
    next.push_back(std::move(stored));
  }
  CO_RETURN_IF_ERROR(co_await ReplaceBitmapDirectory(entries));
  bitmaps_ = std::move(next);
  bitmaps_changed_ = false;
  bitmaps_in_use_ = false;
  for (const LiveBitmap& bm : drop) {
    CO_RETURN_IF_ERROR(co_await FreeBitmapClusters(bm));
  }
  co_return absl::OkStatus();
}

std::vector<Qcow2Node::BitmapInfo> Qcow2Node::Bitmaps() const {
  std::vector<BitmapInfo> out;
  for (const LiveBitmap& bm : bitmaps_) {
    if (!bm.on_disk) continue;
    BitmapInfo info;
    info.name = bm.entry.name;
    info.granularity = uint32_t{1} << bm.entry.granularity_bits;
    info.in_use = bm.entry.in_use();
    info.enabled = bm.entry.enabled();
    info.inconsistent = bm.inconsistent;
    out.push_back(std::move(info));
  }
  return out;
}

absl::StatusOr<std::vector<std::pair<uint64_t, uint64_t>>>
Qcow2Node::BitmapExtents(const std::string& name, uint64_t from,
                         uint64_t to) const {
  const LiveBitmap* bm = FindBitmap(name);
  if (bm == nullptr) return NotFound(name);
  if (bm->inconsistent) return Inconsistent(name);
  std::vector<std::pair<uint64_t, uint64_t>> out;
  const uint32_t g = bm->entry.granularity_bits;
  const uint64_t nbits = BitCount(std::min(to, size()), g);
  uint64_t i = from >> g;
  while (i < nbits) {
    if (bm->bits[i / 64] == 0 && i % 64 == 0) {
      i += 64;
      continue;
    }
    if (!TestBit(bm->bits, i)) {
      ++i;
      continue;
    }
    uint64_t j = i + 1;
    while (j < nbits && TestBit(bm->bits, j)) ++j;
    out.emplace_back(i << g, std::min(j << g, size()));
    i = j;
  }
  return out;
}

io::Task<absl::Status> Qcow2Node::PrepareBitmapChanges() {
  if (read_only()) {
    co_return absl::FailedPreconditionError(
        absl::StrFormat("%s: image is read-only", filename()));
  }
  auto lock = co_await io::ScopedLock::Take(meta_lock_);
  co_return co_await MarkBitmapsInUse();
}

io::Task<absl::Status> Qcow2Node::AddBitmap(const std::string& name,
                                            uint32_t granularity,
                                            bool disabled) {
  if (name.empty()) {
    co_return absl::InvalidArgumentError("Bitmap name cannot be empty");
  }
  if (granularity != 0 &&
      (granularity < 512 || (granularity & (granularity - 1)) != 0)) {
    co_return absl::InvalidArgumentError(
        "Granularity must be power of 2 and at least 512");
  }
  if (granularity == 0) {
    granularity = static_cast<uint32_t>(
        std::clamp<uint64_t>(cluster_size_, 4096, 65536));
  }
  if (read_only()) {
    co_return absl::FailedPreconditionError(
        absl::StrFormat("%s: image is read-only", filename()));
  }
  uint32_t g = 0;
  while ((uint32_t{1} << g) < granularity) ++g;
  // qcow2_co_can_store_new_dirty_bitmap.
  std::string why;
  uint64_t dir_size = header_.bitmaps.has_value()
                          ? header_.bitmaps->bitmap_directory_size
                          : 0;
  uint32_t nb = header_.bitmaps.has_value() ? header_.bitmaps->nb_bitmaps : 0;
  const uint64_t bytes = format::BitmapDataBytes(size(), g);
  if (header_.version < 3) {
    why = "Cannot store dirty bitmaps in qcow2 v2 files";
  } else if (g > format::kBitmapMaxGranularityBits) {
    why = "Granularity exceeds maximum (2147483648 bytes)";
  } else if (bytes > format::kBitmapMaxPhysSize ||
             bytes > format::kBitmapMaxTableSize * cluster_size_) {
    why = "Too much space will be occupied by the bitmap. Use larger "
          "granularity";
  } else if (name.size() > format::kBitmapMaxNameSize) {
    why = "Name length exceeds maximum (1023 characters)";
  } else if (nb >= format::kMaxBitmaps) {
    why = "Maximum number of persistent bitmaps is already reached";
  } else if (dir_size + format::BitmapDirEntrySize(name.size()) >
             format::kMaxBitmapDirectorySize) {
    why = "Not enough space in the bitmap directory";
  }
  if (!why.empty()) {
    co_return absl::InvalidArgumentError(absl::StrCat(
        "Can't make bitmap '", name, "' persistent in '", filename(), "': ", why));
  }
  if (FindBitmap(name) != nullptr) {
    co_return absl::AlreadyExistsError(
        absl::StrCat("Bitmap already exists: ", name));
  }
  auto lock = co_await io::ScopedLock::Take(meta_lock_);
  CO_RETURN_IF_ERROR(co_await MarkBitmapsInUse());
  LiveBitmap bm;
  bm.entry.name = name;
  bm.entry.granularity_bits = static_cast<uint8_t>(g);
  bm.enabled = !disabled;
  bm.bits.assign((BitCount(size(), g) + 63) / 64, 0);
  bitmaps_.push_back(std::move(bm));
  bitmaps_changed_ = true;
  co_return absl::OkStatus();
}

io::Task<absl::Status> Qcow2Node::RemoveBitmap(const std::string& name) {
  LiveBitmap* bm = FindBitmap(name);
  if (bm == nullptr) co_return NotFound(name);
  if (read_only()) {
    co_return absl::FailedPreconditionError(
        absl::StrFormat("%s: image is read-only", filename()));
  }
  auto lock = co_await io::ScopedLock::Take(meta_lock_);
  CO_RETURN_IF_ERROR(co_await MarkBitmapsInUse());
  bm = FindBitmap(name);
  LiveBitmap removed = *bm;
  bitmaps_.erase(bitmaps_.begin() + (bm - bitmaps_.data()));
  if (removed.on_disk) {
    std::vector<format::BitmapDirEntry> entries;
    for (const LiveBitmap& b : bitmaps_) {
      if (b.on_disk) entries.push_back(b.entry);
    }
    CO_RETURN_IF_ERROR(co_await ReplaceBitmapDirectory(entries));
    CO_RETURN_IF_ERROR(co_await FreeBitmapClusters(removed));
  }
  co_return absl::OkStatus();
}

io::Task<absl::Status> Qcow2Node::ClearBitmap(const std::string& name) {
  LiveBitmap* bm = FindBitmap(name);
  if (bm == nullptr) co_return NotFound(name);
  if (bm->inconsistent) co_return Inconsistent(name);
  if (read_only()) {
    co_return absl::FailedPreconditionError(absl::StrCat(
        "Bitmap '", name, "' is readonly and cannot be modified"));
  }
  auto lock = co_await io::ScopedLock::Take(meta_lock_);
  CO_RETURN_IF_ERROR(co_await MarkBitmapsInUse());
  bm = FindBitmap(name);
  std::fill(bm->bits.begin(), bm->bits.end(), 0);
  bitmaps_changed_ = true;
  co_return absl::OkStatus();
}

io::Task<absl::Status> Qcow2Node::EnableBitmap(const std::string& name,
                                               bool enable) {
  LiveBitmap* bm = FindBitmap(name);
  if (bm == nullptr) co_return NotFound(name);
  if (bm->inconsistent) co_return Inconsistent(name);
  if (read_only()) {
    co_return absl::FailedPreconditionError(
        absl::StrFormat("%s: image is read-only", filename()));
  }
  auto lock = co_await io::ScopedLock::Take(meta_lock_);
  CO_RETURN_IF_ERROR(co_await MarkBitmapsInUse());
  bm = FindBitmap(name);
  bm->enabled = enable;
  bitmaps_changed_ = true;
  co_return absl::OkStatus();
}

io::Task<absl::Status> Qcow2Node::MergeBitmap(const std::string& target,
                                              const Qcow2Node& src_node,
                                              const std::string& src) {
  LiveBitmap* dst = FindBitmap(target);
  if (dst == nullptr) co_return NotFound(target);
  if (dst->inconsistent) co_return Inconsistent(target);
  if (read_only()) {
    co_return absl::FailedPreconditionError(absl::StrCat(
        "Bitmap '", target, "' is readonly and cannot be modified"));
  }
  const LiveBitmap* from = src_node.FindBitmap(src);
  if (from == nullptr) co_return NotFound(src);
  if (from->inconsistent) co_return Inconsistent(src);
  if (src_node.size() != size()) {
    co_return absl::InvalidArgumentError(
        "Bitmaps are incompatible and can't be merged");
  }
  // Copy first: `src_node` may be this node and `from` may be `dst`.
  const std::vector<uint64_t> bits = from->bits;
  const uint32_t gs = from->entry.granularity_bits;
  auto lock = co_await io::ScopedLock::Take(meta_lock_);
  CO_RETURN_IF_ERROR(co_await MarkBitmapsInUse());
  dst = FindBitmap(target);
  const uint32_t gd = dst->entry.granularity_bits;
  const uint64_t nbits = BitCount(size(), gs);
  if (gs == gd) {
    for (size_t w = 0; w < bits.size() && w < dst->bits.size(); ++w) {
      dst->bits[w] |= bits[w];
    }
  } else {
    for (uint64_t i = 0; i < nbits; ++i) {
      if (bits[i / 64] == 0 && i % 64 == 0) {
        i += 63;
        continue;
      }
      if (!TestBit(bits, i)) continue;
      const uint64_t begin = i << gs;
      const uint64_t end = std::min((i + 1) << gs, size());
      const uint64_t first = begin >> gd;
      const uint64_t last = std::min(((end - 1) >> gd) + 1, dst->bits.size() * 64);
      if (first < last) SetBits(dst->bits, first, last);
    }
  }
  bitmaps_changed_ = true;
  co_return absl::OkStatus();
}

}  // namespace imgtool::qcow2

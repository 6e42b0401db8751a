#include "prealloc_filter/prealloc_filter.h"

#include <linux/fiemap.h>
#include <linux/fs.h>
#include <sys/ioctl.h>
#include <sys/xattr.h>

#include <algorithm>
#include <cerrno>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "base/align.h"
#include "base/errno_status.h"
#include "base/status_macros.h"
#include "posix_file/file_node.h"

namespace imgtool::prealloc_filter {
namespace {

constexpr char kMarkerName[] = "user.imgtool.preallocate";
// Offsets and lengths stay below 2^63 (io::BlockNode's limit).
constexpr uint64_t kMaxEnd = uint64_t{1} << 63;

// The crash marker's numbers on `fd` (two or four, see the header), if it
// has a valid one.
std::optional<std::vector<uint64_t>> ReadMarker(int fd) {
  char buf[128];
  const ssize_t n = fgetxattr(fd, kMarkerName, buf, sizeof(buf) - 1);
  if (n <= 0) return std::nullopt;
  std::vector<absl::string_view> parts =
      absl::StrSplit(absl::string_view(buf, static_cast<size_t>(n)), ' ');
  if (parts.size() != 2 && parts.size() != 4) return std::nullopt;
  std::vector<uint64_t> v(parts.size());
  for (size_t i = 0; i < parts.size(); ++i) {
    if (!absl::SimpleAtoi(parts[i], &v[i])) return std::nullopt;
  }
  return v;
}

// The end of the last extent of `fd` past `from` that holds written data,
// according to FIEMAP after a sync (FIEMAP_FLAG_SYNC: dirty pages are
// written and their unwritten extents converted first); fallocate'd, never
// written extents (FIEMAP_EXTENT_UNWRITTEN) and holes do not count. Not
// SEEK_DATA: it reports unwritten extents as data once anyone has read them
// into the page cache. 0 if there is none.
absl::StatusOr<uint64_t> LastWrittenEnd(int fd, const std::string& path,
                                        uint64_t from, uint64_t file_size) {
  constexpr uint32_t kBatch = 256;
  std::vector<uint8_t> buf(sizeof(struct fiemap) +
                           kBatch * sizeof(struct fiemap_extent));
  auto* fm = reinterpret_cast<struct fiemap*>(buf.data());
  uint64_t end = 0;
  uint64_t pos = from;
  while (pos < file_size) {
    std::fill(buf.begin(), buf.end(), 0);
    fm->fm_start = pos;
    fm->fm_length = file_size - pos;
    fm->fm_flags = FIEMAP_FLAG_SYNC;
    fm->fm_extent_count = kBatch;
    if (ioctl(fd, FS_IOC_FIEMAP, fm) != 0) {
      return ErrnoStatus(path, "FIEMAP", errno);
    }
    if (fm->fm_mapped_extents == 0) break;
    bool last = false;
    for (uint32_t i = 0; i < fm->fm_mapped_extents; ++i) {
      const struct fiemap_extent& e = fm->fm_extents[i];
      if ((e.fe_flags & FIEMAP_EXTENT_UNWRITTEN) == 0) {
        end = std::max<uint64_t>(end, e.fe_logical + e.fe_length);
      }
      pos = std::max<uint64_t>(pos, e.fe_logical + e.fe_length);
      if ((e.fe_flags & FIEMAP_EXTENT_LAST) != 0) last = true;
    }
    if (last) break;
  }
  return std::min(end, file_size);
}

// prealloc-align as given, else its default.
uint64_t PreallocAlign(const PreallocFilterOptions& options) {
  return options.has_prealloc_align() ? options.prealloc_align()
                                      : kDefaultPreallocAlign;
}

}  // namespace

absl::Status ValidateOptions(const PreallocFilterOptions& options,
                             uint64_t child_request_alignment) {
  const uint64_t align = PreallocAlign(options);
  if (align % 512 != 0) {
    return absl::InvalidArgumentError(
        "prealloc-align parameter of preallocate filter is not aligned to 512");
  }
  if (child_request_alignment == 0 || align % child_request_alignment != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "prealloc-align parameter of preallocate filter is not aligned to "
        "underlying node request alignment (%u)",
        child_request_alignment));
  }
  return absl::OkStatus();
}

io::Task<absl::StatusOr<std::unique_ptr<PreallocFilterNode>>>
OpenPreallocFilter(std::unique_ptr<io::BlockNode> file,
                   const PreallocFilterOptions& options) {
  auto* file_node = dynamic_cast<posix_file::FileNode*>(file.get());
  const uint64_t request_alignment =
      file_node != nullptr
          ? std::max<uint64_t>(file_node->request_alignment(), 1)
          : 1;
  absl::Status valid = ValidateOptions(options, request_alignment);
  if (!valid.ok()) {
    (void)co_await file->Close();
    co_return valid;
  }
  const uint64_t align = std::max(PreallocAlign(options), request_alignment);
  const uint64_t size = options.has_prealloc_size() ? options.prealloc_size()
                                                    : kDefaultPreallocSize;
  // §3: the state is valid only while the filter owns write and resize.
  const bool active =
      !file->read_only() &&
      (file_node == nullptr || !file_node->shares_write_or_resize());
  std::unique_ptr<PreallocFilterNode> node(new PreallocFilterNode(
      std::move(file), active, request_alignment, align, size));
  if (!active) co_return node;
  node->InitState();
  if (file_node == nullptr) co_return node;
  node->file_node_ = file_node;
  node->fd_ = file_node->fd();

  // Crash recovery: the last user was killed with a preallocation out.
  // A file whose length is not one the marker allows was changed since (by
  // an opener without the filter): the marker says nothing about it then.
  std::optional<std::vector<uint64_t>> numbers = ReadMarker(node->fd_);
  if (!numbers.has_value()) co_return node;
  const std::vector<uint64_t>& v = *numbers;
  PreallocFilterNode::Marker& marker = node->marker_.emplace();
  marker.data_end = v[0];
  marker.file_end = v[1];
  if (v.size() == 4) marker.before.emplace(v[2], v[3]);
  const uint64_t file_size = node->file().size();
  uint64_t floor;
  if (file_size == marker.file_end && marker.data_end <= file_size) {
    floor = marker.data_end;
  } else if (marker.before.has_value() && marker.before->second <= file_size &&
             file_size < marker.file_end) {
    // Killed before the last preallocation grew the file (io_uring had not
    // run its fallocate yet): nothing past its start was issued.
    floor = std::min(marker.before->first, file_size);
  } else {
    co_return node;
  }
  absl::StatusOr<uint64_t> written =
      LastWrittenEnd(node->fd_, node->file().filename(), floor, file_size);
  if (!written.ok()) {
    (void)co_await node->file().Close();
    co_return written.status();
  }
  const uint64_t data_end = std::max(floor, *written);
  node->data_end_ = data_end;
  node->flushed_data_end_ = data_end;
  node->SetZeroStart(data_end);
  node->file_end_ = file_size;
  co_return node;
}

PreallocFilterNode::PreallocFilterNode(std::unique_ptr<io::BlockNode> file,
                                       bool active, uint64_t request_alignment,
                                       uint64_t align, uint64_t prealloc_size)
    : io::FilterNode(std::move(file)),
      active_(active),
      request_alignment_(request_alignment),
      align_(align),
      prealloc_size_(prealloc_size) {}

PreallocFilterNode::~PreallocFilterNode() = default;

uint64_t PreallocFilterNode::size() const {
  if (active_ && data_end_.has_value()) return *data_end_;
  return active_ ? FileLength() : file().size();
}

uint64_t PreallocFilterNode::FileLength() const {
  return RoundUpTo(file().size(), 512);
}

uint64_t PreallocFilterNode::KnownFileEnd() {
  if (!file_end_.has_value()) file_end_ = FileLength();
  return *file_end_;
}

void PreallocFilterNode::InvalidateFileEnd() {
  file_end_.reset();
  ++file_end_epoch_;
}

void PreallocFilterNode::InitState() {
  if (!data_end_.has_value()) {
    data_end_ = FileLength();
    flushed_data_end_ = *data_end_;
    SetZeroStart(*data_end_);
    if (!file_end_.has_value()) file_end_ = *data_end_;
  }
}

void PreallocFilterNode::SetMarker(const Marker& marker) {
  if (fd_ < 0 || marker_ == marker) return;
  std::string text = absl::StrCat(marker.data_end, " ", marker.file_end);
  if (marker.before.has_value()) {
    absl::StrAppend(&text, " ", marker.before->first, " ",
                    marker.before->second);
  }
  if (fsetxattr(fd_, kMarkerName, text.data(), text.size(), 0) == 0) {
    marker_ = marker;
  }
}

void PreallocFilterNode::RemoveMarker() {
  if (fd_ < 0 || !marker_.has_value()) return;
  if (fremovexattr(fd_, kMarkerName) == 0 || errno == ENODATA) {
    marker_.reset();
  }
}

void PreallocFilterNode::SetZeroStart(uint64_t zero_start) {
  zero_start_ = zero_start;
  data_in_zero_tail_.clear();
}

void PreallocFilterNode::AddData(uint64_t start, uint64_t end) {
  // Merge with the ranges it touches.
  auto it = data_in_zero_tail_.upper_bound(start);
  if (it != data_in_zero_tail_.begin() && std::prev(it)->second >= start) --it;
  while (it != data_in_zero_tail_.end() && it->first <= end) {
    start = std::min(start, it->first);
    end = std::max(end, it->second);
    it = data_in_zero_tail_.erase(it);
  }
  data_in_zero_tail_.emplace(start, end);
  if (data_in_zero_tail_.size() > kMaxDataRanges) {
    // Too scattered to track: the zero tail starts after all of it.
    SetZeroStart(std::prev(data_in_zero_tail_.end())->second);
  }
}

bool PreallocFilterNode::OverlapsData(uint64_t start, uint64_t end) const {
  auto it = data_in_zero_tail_.lower_bound(end);
  return it != data_in_zero_tail_.begin() && std::prev(it)->second > start;
}

io::Task<void> PreallocFilterNode::WaitForPrealloc() {
  while (prealloc_ != nullptr) co_await prealloc_->done.Wait();
}

io::Task<absl::Status> PreallocFilterNode::RunRequest(
    uint64_t offset, uint64_t length, io::Task<absl::Status> request) {
  // Aligned out like the file will issue it (O_DIRECT padding).
  const uint64_t start = RoundDownTo(offset, request_alignment_);
  const uint64_t end = RoundUpTo(offset + length, request_alignment_);
  auto it = inflight_.insert(inflight_.end(), Inflight{start, end});
  // A running preallocation extends the file: whatever reaches past its
  // start waits (QEMU: serialising up to the end of the file).
  while (prealloc_ != nullptr && end > prealloc_->start) {
    co_await prealloc_->done.Wait();
  }
  absl::Status st = co_await std::move(request);
  inflight_.erase(it);
  co_return st;
}

io::Task<bool> PreallocFilterNode::HandleWrite(uint64_t offset, uint64_t length,
                                               bool merge_zero) {
  if (!active_) co_return false;
  // A request that reaches past a running preallocation waits for it in
  // RunRequest anyway: wait before deciding, so that it sees the new file
  // end (a zero write inside it is then dropped) instead of finding the
  // preallocation busy, skipping its own and forwarding a zero write.
  while (prealloc_ != nullptr &&
         RoundUpTo(offset + length, request_alignment_) > prealloc_->start) {
    co_await prealloc_->done.Wait();
  }
  InitState();
  const uint64_t end = offset + length;
  if (end <= *data_end_) {
    // Not in QEMU: data written inside the zero tail is remembered, so that
    // a later zero write over it is not dropped...
    if (!merge_zero) {
      if (end > *zero_start_) AddData(std::max(offset, *zero_start_), end);
      co_return false;
    }
    // ...and a zero write inside the zero tail is dropped even if it does
    // not extend the data end (QEMU forwards it: with many writes in
    // flight, qcow2's zero writes of new clusters often come after a later
    // cluster's).
    co_return end <= KnownFileEnd() && offset >= *zero_start_ &&
        !OverlapsData(offset, end);
  }
  data_end_ = end;
  if (!merge_zero) SetZeroStart(end);
  if (end <= KnownFileEnd()) {
    co_return merge_zero&& offset >= *zero_start_ && !OverlapsData(offset, end);
  }

  // The write reaches past the file end: preallocate ahead of it.
  const uint64_t start =
      RoundUpTo(merge_zero ? std::min(offset, *file_end_) : *file_end_,
                request_alignment_);
  const uint64_t base = std::max(start, end);
  if (prealloc_size_ > kMaxEnd - base) co_return false;
  const uint64_t prealloc_end = RoundUpTo(base + prealloc_size_, align_);
  if (prealloc_end > kMaxEnd || prealloc_end <= start) co_return false;
  merge_zero = merge_zero && start <= offset;

  // NO_WAIT (§8): never wait for other requests, never zero under them.
  bool busy = prealloc_ != nullptr;
  for (const Inflight& r : inflight_) {
    if (r.end > start) busy = true;
  }
  if (busy) {
    InvalidateFileEnd();
    co_return false;
  }

  // Before the fallocate: a kill while it is outstanding leaves the file
  // at its old length with the tail the last preallocation left, which is
  // cut down to the data end at the last flush (nothing past `start` is
  // issued until this one is done).
  SetMarker({.data_end = *data_end_,
             .file_end = prealloc_end,
             .before = std::make_pair(flushed_data_end_, file().size())});
  prealloc_ = std::make_unique<Prealloc>();
  prealloc_->start = start;
  prealloc_->end = prealloc_end;
  const uint64_t epoch = file_end_epoch_;
  // Write zeroes with NO_FALLBACK: allocated by fallocate, never zero
  // buffers (§4.5, §7).
  absl::Status st;
  if (file_node_ != nullptr) {
    st = co_await file_node_->WriteZeroesAllocated(start, prealloc_end - start);
  } else {
    io::WriteZeroesFlags flags;
    flags.no_fallback = true;
    st = co_await file().WriteZeroes(start, prealloc_end - start, flags);
  }
  std::unique_ptr<Prealloc> done = std::move(prealloc_);
  if (st.ok() && epoch == file_end_epoch_) {
    file_end_ = prealloc_end;
  } else {
    if (!st.ok() && marker_.has_value() && marker_->before.has_value()) {
      // The file may stay short of prealloc_end while the write that
      // needed the preallocation goes ahead: its data end counts then.
      Marker m = *marker_;
      m.before->first = std::max(m.before->first, *data_end_);
      SetMarker(m);
    }
    // Failed (unsupported, no space, ...): retried on the next extending
    // write; or others went past it meanwhile: re-read the length.
    InvalidateFileEnd();
  }
  done->done.Set();
  co_return st.ok() && merge_zero;
}

io::Task<absl::Status> PreallocFilterNode::DoWrite(uint64_t offset,
                                                   io::ConstIoVec data) {
  if (!active_) co_return co_await file().Write(offset, data);
  (void)co_await HandleWrite(offset, data.size(), /*merge_zero=*/false);
  co_return co_await RunRequest(offset, data.size(),
                                file().Write(offset, data));
}

io::Task<absl::Status> PreallocFilterNode::DoWriteZeroes(
    uint64_t offset, uint64_t length, io::WriteZeroesFlags flags) {
  if (!active_) co_return co_await file().WriteZeroes(offset, length, flags);
  const bool merged = co_await HandleWrite(offset, length, !flags.may_unmap);
  if (merged) co_return absl::OkStatus();
  co_return co_await RunRequest(offset, length,
                                file().WriteZeroes(offset, length, flags));
}

io::Task<absl::Status> PreallocFilterNode::DoDiscard(uint64_t offset,
                                                     uint64_t length) {
  if (!active_) co_return co_await file().Discard(offset, length);
  co_return co_await RunRequest(offset, length, file().Discard(offset, length));
}

io::Task<absl::Status> PreallocFilterNode::DoFlush() {
  // The crash marker learns the data end at each flush: zero writes
  // dropped inside the preallocated tail (a new cluster's padding) leave no
  // written extent, so without this a recovery after SIGKILL would cut the
  // file inside the last cluster a flushed L2 table points to.
  // A running preallocation is waited for first: while it runs, the data
  // end counts the writes waiting for it, which the marker's data end
  // before it must not.
  if (active_) {
    if (marker_.has_value()) co_await WaitForPrealloc();
    if (data_end_.has_value()) flushed_data_end_ = *data_end_;
    if (marker_.has_value() && data_end_.has_value()) {
      Marker m = *marker_;
      m.data_end = std::max(m.data_end, *data_end_);
      if (m.before.has_value()) {
        m.before->first = std::max(m.before->first, *data_end_);
      }
      SetMarker(m);
    }
  }
  co_return co_await file().Flush();
}

io::Task<absl::Status> PreallocFilterNode::DoTruncate(
    uint64_t size, io::PreallocMode prealloc) {
  if (!active_) co_return co_await file().Truncate(size, prealloc);
  co_await WaitForPrealloc();
  InitState();
  if (size > *data_end_) {
    const uint64_t file_end = KnownFileEnd();
    if (prealloc == io::PreallocMode::kFalloc) {
      // Already allocated by the filter: it becomes the user's.
      if (size <= file_end) {
        data_end_ = size;
        flushed_data_end_ = size;
        if (marker_.has_value()) {
          SetMarker({.data_end = size, .file_end = file_end});
        }
        co_return absl::OkStatus();
      }
    } else if (file_end > *data_end_) {
      // Drop the filter's preallocation first, so that `off` stays sparse
      // and `full` really writes.
      absl::Status st =
          co_await file().Truncate(*data_end_, io::PreallocMode::kOff);
      if (!st.ok()) {
        InvalidateFileEnd();
        co_return st;
      }
      file_end_ = *data_end_;
    }
    data_end_ = size;
  }
  absl::Status st = co_await file().Truncate(size, prealloc);
  if (!st.ok()) {
    data_end_.reset();
    zero_start_.reset();
    data_in_zero_tail_.clear();
    InvalidateFileEnd();
    co_return st;
  }
  data_end_ = size;
  flushed_data_end_ = size;
  SetZeroStart(size);
  file_end_ = size;
  if (marker_.has_value()) SetMarker({.data_end = size, .file_end = size});
  co_return absl::OkStatus();
}

io::Task<absl::StatusOr<io::BlockStatus>> PreallocFilterNode::DoGetBlockStatus(
    uint64_t offset, uint64_t max_length) {
  if (offset >= file().size()) {
    // Data end raised by a write still in flight: nothing there yet.
    io::BlockStatus status;
    status.length = max_length;
    status.zero = true;
    co_return status;
  }
  co_return co_await file().GetBlockStatus(offset, max_length);
}

io::Task<absl::Status> PreallocFilterNode::Close() {
  if (active_) {
    co_await WaitForPrealloc();
    if (data_end_.has_value()) {
      bool trimmed = true;
      if (*data_end_ < KnownFileEnd()) {
        // Errors are ignored, as QEMU: the image is still valid.
        absl::Status st =
            co_await file().Truncate(*data_end_, io::PreallocMode::kOff);
        trimmed = st.ok();
        if (trimmed) file_end_ = *data_end_;
      }
      if (trimmed) RemoveMarker();
    }
  }
  co_return co_await file().Close();
}

}  // namespace imgtool::prealloc_filter

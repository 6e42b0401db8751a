#include "raw_format/raw_node.h"

#include <cerrno>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/errno_status.h"
#include "base/status_macros.h"

namespace imgtool::raw_format {

absl::StatusOr<std::unique_ptr<RawNode>> RawNode::Open(
    std::unique_ptr<io::BlockNode> file, const RawOptions& options) {
  const uint64_t file_size = file->size();
  const uint64_t offset = options.offset();
  if (offset > file_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Offset (", offset,
        ") cannot be greater than size of the containing file (", file_size,
        ")"));
  }
  std::optional<uint64_t> size;
  if (options.has_size()) {
    size = options.size();
    if (file_size - offset < *size) {
      return absl::InvalidArgumentError(absl::StrCat(
          "The sum of offset (", offset, ") and size (", *size,
          ") has to be smaller or equal to the  actual size of the "
          "containing file (",
          file_size, ")"));
    }
    if (*size % 512 != 0) {
      return absl::InvalidArgumentError(
          "Specified size is not multiple of 512");
    }
  }
  return std::unique_ptr<RawNode>(new RawNode(std::move(file), offset, size));
}

RawNode::RawNode(std::unique_ptr<io::BlockNode> file, uint64_t offset,
                 std::optional<uint64_t> fixed_size)
    : io::BlockNode(file->filename(), file->read_only()),
      file_(std::move(file)),
      offset_(offset),
      fixed_size_(fixed_size) {}

uint64_t RawNode::size() const {
  if (fixed_size_.has_value()) return *fixed_size_;
  const uint64_t file_size = file_->size();
  return file_size > offset_ ? file_size - offset_ : 0;
}

absl::Status RawNode::CheckRange(uint64_t offset, uint64_t length) const {
  if (fixed_size_.has_value() &&
      (offset > *fixed_size_ || length > *fixed_size_ - offset)) {
    return ErrnoStatus(filename(), "request past the raw image's size",
                       ENOSPC);
  }
  return absl::OkStatus();
}

io::Task<absl::Status> RawNode::DoRead(uint64_t offset, io::IoVec buf) {
  CO_RETURN_IF_ERROR(CheckRange(offset, buf.size()));
  co_await file_->DebugEvent(io::BlkdebugEvent::kReadAio);
  co_return co_await file_->Read(offset_ + offset, buf);
}

io::Task<absl::Status> RawNode::DoWrite(uint64_t offset, io::ConstIoVec data) {
  CO_RETURN_IF_ERROR(CheckRange(offset, data.size()));
  co_await file_->DebugEvent(io::BlkdebugEvent::kWriteAio);
  co_return co_await file_->Write(offset_ + offset, data);
}

io::Task<absl::Status> RawNode::DoWriteZeroes(uint64_t offset, uint64_t length,
                                              io::WriteZeroesFlags flags) {
  CO_RETURN_IF_ERROR(CheckRange(offset, length));
  co_return co_await file_->WriteZeroes(offset_ + offset, length, flags);
}

io::Task<absl::Status> RawNode::DoDiscard(uint64_t offset, uint64_t length) {
  CO_RETURN_IF_ERROR(CheckRange(offset, length));
  co_return co_await file_->Discard(offset_ + offset, length);
}

io::Task<absl::Status> RawNode::DoFlush() { co_return co_await file_->Flush(); }

io::Task<absl::Status> RawNode::DoTruncate(uint64_t size,
                                           io::PreallocMode prealloc) {
  if (fixed_size_.has_value()) {
    co_return absl::UnimplementedError("Cannot resize fixed-size raw disks");
  }
  if (size > (uint64_t{1} << 63) - 1 - offset_) {
    co_return absl::InvalidArgumentError(
        "Disk size too large for the chosen offset");
  }
  co_return co_await file_->Truncate(offset_ + size, prealloc);
}

io::Task<absl::StatusOr<io::BlockStatus>> RawNode::DoGetBlockStatus(
    uint64_t offset, uint64_t max_length) {
  const uint64_t in_file = offset_ + offset;
  if (in_file >= file_->size()) {
    // The file became shorter than the image: zeroes, as reads give.
    io::BlockStatus status;
    status.length = max_length;
    status.zero = true;
    status.offset_valid = true;
    status.host_offset = in_file;
    status.file = file_.get();
    co_return status;
  }
  co_return co_await file_->GetBlockStatus(in_file, max_length);
}

io::Task<absl::Status> RawNode::Close() { co_return co_await file_->Close(); }

}  // namespace imgtool::raw_format

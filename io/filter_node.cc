#include "io/filter_node.h"

#include <utility>

namespace imgtool::io {

FilterNode::FilterNode(std::unique_ptr<BlockNode> file)
    : BlockNode(file->filename(), file->read_only()), file_(std::move(file)) {}

Task<absl::Status> FilterNode::Close() { co_return co_await file_->Close(); }

Task<absl::Status> FilterNode::DoRead(uint64_t offset, IoVec buf) {
  co_return co_await file_->Read(offset, buf);
}

Task<absl::Status> FilterNode::DoWrite(uint64_t offset, ConstIoVec data) {
  co_return co_await file_->Write(offset, data);
}

Task<absl::Status> FilterNode::DoWriteZeroes(uint64_t offset, uint64_t length,
                                             WriteZeroesFlags flags) {
  co_return co_await file_->WriteZeroes(offset, length, flags);
}

Task<absl::Status> FilterNode::DoDiscard(uint64_t offset, uint64_t length) {
  co_return co_await file_->Discard(offset, length);
}

Task<absl::Status> FilterNode::DoFlush() { co_return co_await file_->Flush(); }

Task<absl::Status> FilterNode::DoTruncate(uint64_t size,
                                          PreallocMode prealloc) {
  co_return co_await file_->Truncate(size, prealloc);
}

Task<absl::StatusOr<BlockStatus>> FilterNode::DoGetBlockStatus(
    uint64_t offset, uint64_t max_length) {
  co_return co_await file_->GetBlockStatus(offset, max_length);
}

}  // namespace imgtool::io

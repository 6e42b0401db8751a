#include "io/testing/memory_node.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace imgtool::io::testing {

MemoryNode::MemoryNode(std::string name, std::vector<uint8_t> bytes,
                       bool read_only, uint64_t max_size)
    : BlockNode(std::move(name), read_only),
      bytes_(std::move(bytes)),
      max_size_(max_size) {}

Task<absl::Status> MemoryNode::Close() { co_return absl::OkStatus(); }

absl::Status MemoryNode::GrowTo(uint64_t end) {
  if (end > max_size_) {
    return absl::ResourceExhaustedError(
        absl::StrCat(filename(), ": No space left on device"));
  }
  if (end > bytes_.size()) bytes_.resize(end, 0);
  return absl::OkStatus();
}

Task<absl::Status> MemoryNode::DoRead(uint64_t offset, IoVec buf) {
  const uint64_t have =
      offset < bytes_.size() ? std::min<uint64_t>(buf.size(), bytes_.size() - offset) : 0;
  if (have > 0) std::memcpy(buf.data(), bytes_.data() + offset, have);
  std::memset(buf.data() + have, 0, buf.size() - have);
  co_return absl::OkStatus();
}

Task<absl::Status> MemoryNode::DoWrite(uint64_t offset, ConstIoVec data) {
  if (data.empty()) co_return absl::OkStatus();
  // BlockNode::Write has checked that offset + size does not overflow.
  absl::Status grown = GrowTo(offset + data.size());
  if (!grown.ok()) co_return grown;
  std::memcpy(bytes_.data() + offset, data.data(), data.size());
  co_return absl::OkStatus();
}

Task<absl::Status> MemoryNode::DoWriteZeroes(uint64_t offset, uint64_t length,
                                             WriteZeroesFlags flags) {
  if (length == 0) co_return absl::OkStatus();
  absl::Status grown = GrowTo(offset + length);
  if (!grown.ok()) co_return grown;
  std::memset(bytes_.data() + offset, 0, length);
  co_return absl::OkStatus();
}

Task<absl::Status> MemoryNode::DoDiscard(uint64_t offset, uint64_t length) {
  // Like a file that punches holes: the range inside the buffer reads zeroes.
  if (offset < bytes_.size()) {
    const uint64_t n = std::min<uint64_t>(length, bytes_.size() - offset);
    std::memset(bytes_.data() + offset, 0, n);
  }
  co_return absl::OkStatus();
}

Task<absl::Status> MemoryNode::DoFlush() {
  ++flushes_;
  co_return absl::OkStatus();
}

Task<absl::Status> MemoryNode::DoTruncate(uint64_t size, PreallocMode prealloc) {
  if (size > bytes_.size()) {
    absl::Status grown = GrowTo(size);
    if (!grown.ok()) co_return grown;
  } else {
    bytes_.resize(size);
  }
  co_return absl::OkStatus();
}

Task<absl::StatusOr<BlockStatus>> MemoryNode::DoGetBlockStatus(
    uint64_t offset, uint64_t max_length) {
  BlockStatus status;
  status.length = std::min<uint64_t>(max_length, bytes_.size() - offset);
  status.data = true;
  status.offset_valid = true;
  status.host_offset = offset;
  status.file = this;
  co_return status;
}

}  // namespace imgtool::io::testing

#include "io/block_node.h"

#include <algorithm>
#include <vector>

#include "absl/strings/str_format.h"
#include "base/status_macros.h"

namespace imgtool::io {
namespace {

constexpr uint64_t kMaxZeroBuffer = 1 << 20;

bool Overflows(uint64_t offset, uint64_t length) {
  return offset + length < offset || offset + length > (uint64_t{1} << 63);
}

}  // namespace

absl::StatusOr<PreallocMode> ParsePreallocMode(const std::string& name) {
  if (name == "off") return PreallocMode::kOff;
  if (name == "metadata") return PreallocMode::kMetadata;
  if (name == "falloc") return PreallocMode::kFalloc;
  if (name == "full") return PreallocMode::kFull;
  return absl::InvalidArgumentError(
      absl::StrFormat("Invalid preallocation mode '%s'", name));
}

const char* PreallocModeName(PreallocMode mode) {
  switch (mode) {
    case PreallocMode::kOff:
      return "off";
    case PreallocMode::kMetadata:
      return "metadata";
    case PreallocMode::kFalloc:
      return "falloc";
    case PreallocMode::kFull:
      return "full";
  }
  return "off";
}

Task<absl::Status> BlockNode::Read(uint64_t offset, IoVec buf) {
  if (Overflows(offset, buf.size())) {
    co_return absl::OutOfRangeError(absl::StrFormat(
        "%s: read of %u bytes at offset %u is out of range", filename_,
        buf.size(), offset));
  }
  if (buf.empty()) co_return absl::OkStatus();
  co_return co_await DoRead(offset, buf);
}

Task<absl::Status> BlockNode::Write(uint64_t offset, ConstIoVec data) {
  if (read_only_) {
    co_return absl::FailedPreconditionError(
        absl::StrFormat("%s: image is read-only", filename_));
  }
  if (Overflows(offset, data.size())) {
    co_return absl::OutOfRangeError(absl::StrFormat(
        "%s: write of %u bytes at offset %u is out of range", filename_,
        data.size(), offset));
  }
  if (data.empty()) co_return absl::OkStatus();
  co_return co_await DoWrite(offset, data);
}

Task<absl::Status> BlockNode::WriteZeroes(uint64_t offset, uint64_t length,
                                          WriteZeroesFlags flags) {
  if (read_only_) {
    co_return absl::FailedPreconditionError(
        absl::StrFormat("%s: image is read-only", filename_));
  }
  if (Overflows(offset, length)) {
    co_return absl::OutOfRangeError(absl::StrFormat(
        "%s: zero write of %u bytes at offset %u is out of range", filename_,
        length, offset));
  }
  if (length == 0) co_return absl::OkStatus();
  absl::Status st = co_await DoWriteZeroes(offset, length, flags);
  if (!absl::IsUnimplemented(st) || flags.no_fallback) co_return st;
  std::vector<uint8_t> zeroes(std::min(length, kMaxZeroBuffer), 0);
  while (length > 0) {
    uint64_t n = std::min<uint64_t>(length, zeroes.size());
    CO_RETURN_IF_ERROR(co_await DoWrite(offset, ConstIoVec(zeroes.data(), n)));
    offset += n;
    length -= n;
  }
  co_return absl::OkStatus();
}

Task<absl::Status> BlockNode::Discard(uint64_t offset, uint64_t length) {
  if (read_only_) {
    co_return absl::FailedPreconditionError(
        absl::StrFormat("%s: image is read-only", filename_));
  }
  if (Overflows(offset, length)) {
    co_return absl::OutOfRangeError(absl::StrFormat(
        "%s: discard of %u bytes at offset %u is out of range", filename_,
        length, offset));
  }
  if (length == 0) co_return absl::OkStatus();
  co_return co_await DoDiscard(offset, length);
}

Task<absl::Status> BlockNode::Flush() { co_return co_await DoFlush(); }

Task<absl::Status> BlockNode::Truncate(uint64_t size, PreallocMode prealloc) {
  if (read_only_) {
    co_return absl::FailedPreconditionError(
        absl::StrFormat("%s: image is read-only", filename_));
  }
  if (size > (uint64_t{1} << 63) - 1) {
    co_return absl::OutOfRangeError(
        absl::StrFormat("%s: size %u is too large", filename_, size));
  }
  if (size < this->size() && prealloc != PreallocMode::kOff) {
    co_return absl::InvalidArgumentError(
        "Preallocation can only be used for growing images");
  }
  co_return co_await DoTruncate(size, prealloc);
}

Task<absl::StatusOr<BlockStatus>> BlockNode::GetBlockStatus(
    uint64_t offset, uint64_t max_length) {
  if (offset >= size() || max_length == 0) {
    co_return absl::OutOfRangeError(absl::StrFormat(
        "%s: block status at offset %u is out of range", filename_, offset));
  }
  max_length = std::min(max_length, size() - offset);
  CO_ASSIGN_OR_RETURN(BlockStatus status,
                      co_await DoGetBlockStatus(offset, max_length));
  status.length = std::clamp<uint64_t>(status.length, 1, max_length);
  co_return status;
}

Task<absl::Status> BlockNode::DoWriteZeroes(uint64_t, uint64_t,
                                            WriteZeroesFlags) {
  co_return absl::UnimplementedError("write zeroes");
}

Task<absl::Status> BlockNode::DoDiscard(uint64_t, uint64_t) {
  co_return absl::UnimplementedError("discard");
}

Task<absl::Status> BlockNode::DoTruncate(uint64_t, PreallocMode) {
  co_return absl::UnimplementedError(
      absl::StrFormat("%s: this node cannot be resized", filename_));
}

}  // namespace imgtool::io

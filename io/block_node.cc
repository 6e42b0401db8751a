#include "io/block_node.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <vector>

#include "absl/strings/str_format.h"
#include "base/errno_status.h"
#include "base/status_macros.h"

namespace imgtool::io {
namespace {

constexpr uint64_t kMaxZeroBuffer = 1 << 20;

bool Overflows(uint64_t offset, uint64_t length) {
  return offset + length < offset || offset + length > (uint64_t{1} << 63);
}

// QEMU 7.2's BlkdebugEvent names, in the enum's order.
constexpr absl::string_view kBlkdebugEventNames[kBlkdebugEventCount] = {
    "l1_update",
    "l1_grow_alloc_table",
    "l1_grow_write_table",
    "l1_grow_activate_table",
    "l2_load",
    "l2_update",
    "l2_update_compressed",
    "l2_alloc_cow_read",
    "l2_alloc_write",
    "read_aio",
    "read_backing_aio",
    "read_compressed",
    "write_aio",
    "write_compressed",
    "vmstate_load",
    "vmstate_save",
    "cow_read",
    "cow_write",
    "reftable_load",
    "reftable_grow",
    "reftable_update",
    "refblock_load",
    "refblock_update",
    "refblock_update_part",
    "refblock_alloc",
    "refblock_alloc_hookup",
    "refblock_alloc_write",
    "refblock_alloc_write_blocks",
    "refblock_alloc_write_table",
    "refblock_alloc_switch_table",
    "cluster_alloc",
    "cluster_alloc_bytes",
    "cluster_free",
    "flush_to_os",
    "flush_to_disk",
    "pwritev_rmw_head",
    "pwritev_rmw_after_head",
    "pwritev_rmw_tail",
    "pwritev_rmw_after_tail",
    "pwritev",
    "pwritev_zero",
    "pwritev_done",
    "empty_image_prepare",
    "l1_shrink_write_table",
    "l1_shrink_free_l2_clusters",
    "cor_write",
    "cluster_alloc_space",
    "none",
};

// A status whose message is strerror(error_number) alone, with the errno.
absl::Status DebugError(int error_number) {
  return WithMessage(ErrnoStatus("", "debug", error_number),
                     std::strerror(error_number));
}

}  // namespace

absl::string_view BlkdebugEventName(BlkdebugEvent event) {
  const int i = static_cast<int>(event);
  if (i < 0 || i >= kBlkdebugEventCount) return "";
  return kBlkdebugEventNames[i];
}

std::optional<BlkdebugEvent> ParseBlkdebugEvent(absl::string_view name) {
  for (int i = 0; i < kBlkdebugEventCount; ++i) {
    if (kBlkdebugEventNames[i] == name) return static_cast<BlkdebugEvent>(i);
  }
  return std::nullopt;
}

BlockNode* BlockNode::FindDebugNode() {
  BlockNode* node = this;
  while (node != nullptr && !node->HandlesDebugEvents()) {
    node = node->primary_child();
  }
  return node;
}

absl::Status BlockNode::DebugBreakpoint(absl::string_view event,
                                        absl::string_view tag) {
  BlockNode* node = FindDebugNode();
  if (node == nullptr) return DebugError(ENOTSUP);
  std::optional<BlkdebugEvent> parsed = ParseBlkdebugEvent(event);
  if (!parsed.has_value()) return DebugError(ENOENT);
  return node->DoDebugBreakpoint(*parsed, tag);
}

absl::Status BlockNode::DebugRemoveBreakpoint(absl::string_view tag) {
  BlockNode* node = FindDebugNode();
  if (node == nullptr) return DebugError(ENOTSUP);
  return node->DoDebugRemoveBreakpoint(tag);
}

absl::Status BlockNode::DebugResume(absl::string_view tag) {
  BlockNode* node = FindDebugNode();
  if (node == nullptr) return DebugError(ENOTSUP);
  return node->DoDebugResume(tag);
}

bool BlockNode::DebugIsSuspended(absl::string_view tag) {
  BlockNode* node = FindDebugNode();
  return node != nullptr && node->DoDebugIsSuspended(tag);
}

Task<void> BlockNode::DoDebugEvent(BlkdebugEvent) { co_return; }

absl::Status BlockNode::DoDebugBreakpoint(BlkdebugEvent, absl::string_view) {
  return DebugError(ENOTSUP);
}

absl::Status BlockNode::DoDebugRemoveBreakpoint(absl::string_view) {
  return DebugError(ENOTSUP);
}

absl::Status BlockNode::DoDebugResume(absl::string_view) {
  return DebugError(ENOTSUP);
}

bool BlockNode::DoDebugIsSuspended(absl::string_view) { return false; }

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

namespace {

// Counts a write-type request as finished when it leaves scope, whatever
// its outcome (block/io.c's bdrv_co_write_req_finish bumps write_gen).
class GenerationBump {
 public:
  explicit GenerationBump(uint64_t* generation) : generation_(generation) {}
  GenerationBump(const GenerationBump&) = delete;
  GenerationBump& operator=(const GenerationBump&) = delete;
  ~GenerationBump() { ++*generation_; }

 private:
  uint64_t* generation_;
};

}  // namespace

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
  const GenerationBump bump(&write_generation_);
  if (RaisesWriteEvents()) co_return co_await DoWrite(offset, data);
  // block/io.c's bdrv_aligned_pwritev raises these on the node written.
  co_await DebugEvent(BlkdebugEvent::kPwritev);
  absl::Status st = co_await DoWrite(offset, data);
  co_await DebugEvent(BlkdebugEvent::kPwritevDone);
  co_return st;
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
  co_await DebugEvent(BlkdebugEvent::kPwritevZero);
  const GenerationBump bump(&write_generation_);
  absl::Status st = co_await DoWriteZeroes(offset, length, flags);
  if (!absl::IsUnimplemented(st) || flags.no_fallback) {
    co_await DebugEvent(BlkdebugEvent::kPwritevDone);
    co_return st;
  }
  std::vector<uint8_t> zeroes(std::min(length, kMaxZeroBuffer), 0);
  while (length > 0) {
    uint64_t n = std::min<uint64_t>(length, zeroes.size());
    CO_RETURN_IF_ERROR(co_await DoWrite(offset, ConstIoVec(zeroes.data(), n)));
    offset += n;
    length -= n;
  }
  co_await DebugEvent(BlkdebugEvent::kPwritevDone);
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
  const GenerationBump bump(&write_generation_);
  co_return co_await DoDiscard(offset, length);
}

Task<absl::Status> BlockNode::Flush() {
  const uint64_t generation = write_generation_;
  // bdrv_co_flush raises these on the node's primary child, flush_to_disk
  // only if the node was written since its last successful flush.
  if (BlockNode* child = primary_child(); child != nullptr) {
    co_await child->DebugEvent(BlkdebugEvent::kFlushToOs);
    if (generation != flushed_generation_) {
      co_await child->DebugEvent(BlkdebugEvent::kFlushToDisk);
    }
  }
  absl::Status st = co_await DoFlush();
  if (st.ok()) flushed_generation_ = std::max(flushed_generation_, generation);
  co_return st;
}

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
  const GenerationBump bump(&write_generation_);
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

absl::StatusOr<std::string> BlockNode::Dirname() const {
  if (const BlockNode* child = primary_child(); child != nullptr) {
    return child->Dirname();
  }
  const size_t slash = filename_.rfind('/');
  return slash == std::string::npos ? std::string()
                                    : filename_.substr(0, slash + 1);
}

Task<absl::Status> BlockNode::DoDiscard(uint64_t, uint64_t) {
  co_return absl::UnimplementedError("discard");
}

Task<absl::Status> BlockNode::DoTruncate(uint64_t, PreallocMode) {
  co_return absl::UnimplementedError(
      absl::StrFormat("%s: this node cannot be resized", filename_));
}

}  // namespace imgtool::io

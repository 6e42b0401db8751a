#include "cor_filter/cor_filter.h"

#include <algorithm>
#include <cstring>
#include <utility>
#include <vector>

#include "base/status_macros.h"
#include "base/zero.h"

namespace imgtool::cor_filter {
namespace {

// Whether [offset, offset + n) is allocated in any layer from `top` down to
// `base` (inclusive) of a backing chain, n in 1..max_length (QEMU's
// bdrv_is_allocated_above with include_base). A layer shorter than the
// range's start ends the walk there.
io::Task<absl::StatusOr<std::pair<bool, uint64_t>>> IsAllocatedAbove(
    io::BlockNode* top, io::BlockNode* base, uint64_t offset,
    uint64_t max_length) {
  uint64_t n = max_length;
  for (io::BlockNode* layer = top; layer != nullptr;
       layer = BackingChainNext(*layer)) {
    CO_ASSIGN_OR_RETURN(auto allocated,
                        co_await IsAllocated(*layer, offset, n));
    if (allocated.first) co_return allocated;
    // Past a layer's end nothing below shows through it; otherwise the
    // next layers are asked only for the unallocated run.
    if (allocated.second > 0 && allocated.second < n) n = allocated.second;
    if (layer == base || allocated.second == 0) break;
  }
  co_return std::make_pair(false, n);
}

}  // namespace

io::Task<absl::StatusOr<std::pair<bool, uint64_t>>> IsAllocated(
    io::BlockNode& node, uint64_t offset, uint64_t max_length) {
  if (offset >= node.size() || max_length == 0) {
    co_return std::make_pair(false, uint64_t{0});
  }
  const uint64_t length = std::min(max_length, node.size() - offset);
  CO_ASSIGN_OR_RETURN(io::BlockStatus st,
                      co_await node.GetBlockStatus(offset, length));
  co_return std::make_pair(st.data || st.zero,
                           std::clamp<uint64_t>(st.length, 1, length));
}

io::BlockNode* BackingChainNext(io::BlockNode& node) {
  for (io::BlockNode* n = &node; n != nullptr; n = n->primary_child()) {
    if (n->backing() != nullptr) return n->backing();
  }
  return nullptr;
}

CorNode::CorNode(std::unique_ptr<io::BlockNode> file, CorSettings settings)
    : io::FilterNode(std::move(file)), settings_(settings) {}

io::TrackedRequests::Request CorNode::Span(uint64_t offset, uint64_t bytes,
                                           bool serialising) const {
  io::TrackedRequests::Request r{.start = offset, .end = offset + bytes};
  const uint64_t cluster = settings_.cluster_size;
  if (serialising && cluster != 0) {
    r.start = offset / cluster * cluster;
    r.end = (r.end + cluster - 1) / cluster * cluster;
  }
  r.serialising = serialising;
  return r;
}

io::Task<absl::Status> CorNode::DoRead(uint64_t offset, io::IoVec buf) {
  io::TrackedRequests::Request r = Span(offset, buf.size(), true);
  tracked_.Begin(r);
  co_await tracked_.WaitForConflicts(r);
  absl::Status st = co_await ReadCopying(offset, buf);
  tracked_.End(r);
  co_return st;
}

io::Task<absl::Status> CorNode::ReadCopying(uint64_t offset, io::IoVec buf) {
  if (settings_.bottom == nullptr) co_return co_await CopyOnRead(offset, buf);
  uint64_t done = 0;
  while (done < buf.size()) {
    const uint64_t pos = offset + done;
    const uint64_t left = buf.size() - done;
    bool copy = false;
    uint64_t n = left;
    absl::StatusOr<std::pair<bool, uint64_t>> top =
        co_await IsAllocated(file(), pos, std::min(left, kMaxRequestBytes));
    // An error asking is taken as "not allocated": the copy then fails
    // with a better error, or works (QEMU).
    if (top.ok()) n = top->second;
    if (!top.ok() || !top->first) {
      if (n == 0) break;  // past the child's end: zeroes (io::BlockNode)
      absl::StatusOr<std::pair<bool, uint64_t>> above =
          co_await IsAllocatedAbove(BackingChainNext(file()),
                                    settings_.bottom, pos, n);
      if (above.ok()) {
        n = above->second;
        copy = above->first;
      } else {
        copy = true;
      }
      if (n == 0) break;
    }
    io::IoVec part = buf.subspan(done, n);
    if (copy) {
      CO_RETURN_IF_ERROR(co_await CopyOnRead(pos, part));
    } else {
      CO_RETURN_IF_ERROR(co_await file().Read(pos, part));
    }
    done += n;
  }
  co_return absl::OkStatus();
}

io::Task<absl::Status> CorNode::CopyOnRead(uint64_t offset, io::IoVec buf) {
  const uint64_t bytes = buf.size();
  if (bytes == 0) co_return absl::OkStatus();
  {
    absl::StatusOr<std::pair<bool, uint64_t>> allocated =
        co_await IsAllocated(file(), offset, bytes);
    if (allocated.ok() && allocated->first && allocated->second == bytes) {
      co_return co_await file().Read(offset, buf);
    }
  }
  // Whole clusters around the request.
  const uint64_t cluster = settings_.cluster_size;
  uint64_t pos = offset;
  uint64_t end = offset + bytes;
  if (cluster != 0) {
    pos = offset / cluster * cluster;
    end = (end + cluster - 1) / cluster * cluster;
  }
  std::vector<uint8_t> bounce;
  while (pos < end) {
    absl::StatusOr<std::pair<bool, uint64_t>> state = co_await IsAllocated(
        file(), pos, std::min(end - pos, kMaxRequestBytes));
    bool allocated = false;
    uint64_t n = std::min(end - pos, kMaxRequestBytes);
    if (state.ok()) {
      allocated = state->first;
      n = state->second;
      if (!allocated && n == 0) break;  // the child ends inside the cluster
    }
    // The part of [pos, pos + n) the caller asked for.
    if (!allocated) {
      n = std::min(n, kMaxBounceBytes);
      bounce.resize(n);
      io::IoVec piece(bounce.data(), n);
      CO_RETURN_IF_ERROR(co_await file().Read(pos, piece));
      co_await file().DebugEvent(io::BlkdebugEvent::kCorWrite);
      if (IsZero(bounce.data(), n)) {
        CO_RETURN_IF_ERROR(co_await file().WriteZeroes(pos, n, {}));
      } else {
        CO_RETURN_IF_ERROR(
            co_await file().Write(pos, io::ConstIoVec(bounce.data(), n)));
      }
    }
    const uint64_t from = std::max(pos, offset);
    const uint64_t to = std::min(pos + n, offset + bytes);
    if (from < to) {
      io::IoVec out = buf.subspan(from - offset, to - from);
      if (allocated) {
        CO_RETURN_IF_ERROR(co_await file().Read(from, out));
      } else {
        std::memcpy(out.data(), bounce.data() + (from - pos), to - from);
      }
    }
    pos += n;
  }
  co_return absl::OkStatus();
}

io::Task<absl::Status> CorNode::DoWrite(uint64_t offset, io::ConstIoVec data) {
  io::TrackedRequests::Request r = Span(offset, data.size(), false);
  tracked_.Begin(r);
  co_await tracked_.WaitForConflicts(r);
  absl::Status st = co_await file().Write(offset, data);
  tracked_.End(r);
  co_return st;
}

io::Task<absl::Status> CorNode::DoWriteZeroes(uint64_t offset, uint64_t length,
                                              io::WriteZeroesFlags flags) {
  io::TrackedRequests::Request r = Span(offset, length, false);
  tracked_.Begin(r);
  co_await tracked_.WaitForConflicts(r);
  absl::Status st = co_await file().WriteZeroes(offset, length, flags);
  tracked_.End(r);
  co_return st;
}

io::Task<absl::Status> CorNode::DoDiscard(uint64_t offset, uint64_t length) {
  io::TrackedRequests::Request r = Span(offset, length, false);
  tracked_.Begin(r);
  co_await tracked_.WaitForConflicts(r);
  absl::Status st = co_await file().Discard(offset, length);
  tracked_.End(r);
  co_return st;
}

}  // namespace imgtool::cor_filter

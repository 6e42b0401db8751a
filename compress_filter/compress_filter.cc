#include "compress_filter/compress_filter.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>
#include <vector>

#include "base/errno_status.h"
#include "base/status_macros.h"

namespace imgtool::compress_filter {

CompressNode::CompressNode(std::unique_ptr<io::BlockNode> file,
                           CompressSettings settings)
    : io::FilterNode(std::move(file)), settings_(std::move(settings)) {}

io::Task<absl::Status> CompressNode::WriteAligned(uint64_t offset,
                                                  io::ConstIoVec data) {
  const uint64_t end = file().size();
  if (offset >= end) co_return absl::OkStatus();
  if (data.size() > end - offset) data = data.first(end - offset);
  absl::Status st = co_await settings_.write_compressed(offset, data);
  if (absl::IsFailedPrecondition(st)) {
    // A cluster allocated already: QEMU's qcow2 fails with EIO.
    co_return ErrnoStatus(filename(), st.message(), EIO);
  }
  co_return st;
}

io::Task<absl::Status> CompressNode::WriteEmpty(uint64_t offset) {
  if (read_only() || offset % settings_.cluster_size != 0 || offset > size()) {
    co_return absl::OkStatus();
  }
  auto lock = co_await io::ScopedLock::Take(write_lock_);
  co_return co_await settings_.write_compressed(offset, io::ConstIoVec());
}

io::Task<absl::Status> CompressNode::DoWrite(uint64_t offset,
                                             io::ConstIoVec data) {
  if (data.empty()) co_return absl::OkStatus();
  auto lock = co_await io::ScopedLock::Take(write_lock_);
  const uint64_t c = settings_.cluster_size;
  const uint64_t end = offset + data.size();
  const uint64_t start = offset - offset % c;
  const uint64_t padded_end = (end + c - 1) / c * c;
  if (start == offset && padded_end == end) {
    co_return co_await WriteAligned(offset, data);
  }
  // Read-modify-write of the partial head and tail clusters.
  std::vector<uint8_t> buf(padded_end - start);
  if (start != offset) {
    CO_RETURN_IF_ERROR(
        co_await file().Read(start, io::IoVec(buf.data(), c)));
  }
  if (padded_end != end && (start == offset || padded_end - start > c)) {
    CO_RETURN_IF_ERROR(co_await file().Read(
        padded_end - c, io::IoVec(buf.data() + buf.size() - c, c)));
  }
  std::memcpy(buf.data() + (offset - start), data.data(), data.size());
  co_return co_await WriteAligned(start, io::ConstIoVec(buf));
}

io::Task<absl::Status> CompressNode::ZeroPartOfCluster(uint64_t cluster_start,
                                                       uint64_t from,
                                                       uint64_t to) {
  const uint64_t c = settings_.cluster_size;
  std::vector<uint8_t> buf(c);
  CO_RETURN_IF_ERROR(co_await file().Read(cluster_start, io::IoVec(buf)));
  std::memset(buf.data() + from, 0, to - from);
  co_return co_await WriteAligned(cluster_start, io::ConstIoVec(buf));
}

io::Task<absl::Status> CompressNode::DoWriteZeroes(uint64_t offset,
                                                   uint64_t length,
                                                   io::WriteZeroesFlags flags) {
  auto lock = co_await io::ScopedLock::Take(write_lock_);
  const uint64_t c = settings_.cluster_size;
  if (const uint64_t head = offset % c; head != 0) {
    const uint64_t n = std::min(length, c - head);
    CO_RETURN_IF_ERROR(co_await ZeroPartOfCluster(offset - head, head,
                                                  head + n));
    offset += n;
    length -= n;
  }
  if (const uint64_t middle = length - length % c; middle != 0) {
    CO_RETURN_IF_ERROR(co_await file().WriteZeroes(offset, middle, flags));
    offset += middle;
    length -= middle;
  }
  if (length != 0) {
    CO_RETURN_IF_ERROR(co_await ZeroPartOfCluster(offset, 0, length));
  }
  co_return absl::OkStatus();
}

}  // namespace imgtool::compress_filter

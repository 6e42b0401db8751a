#include "qcow2/create.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <utility>
#include <vector>

#include "absl/numeric/bits.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "qcow2/qcow2_node.h"

namespace imgtool::qcow2 {
namespace {

constexpr uint64_t kWriteChunk = uint64_t{1} << 20;

// A node that forwards to one it does not own, so that a Qcow2Node can run
// on the caller's file without closing it. With `forward_flushes` the
// node's flushes reach the file: QEMU's create opens the qcow2 node with
// BDRV_O_NO_FLUSH, but over a file node of its own that syncs whenever
// qcow2 flushes it, e.g. the metadata before a preallocation of the data
// area, which so lands on the disk first. Without, it syncs only on Close
// (for metadata preallocation, where qemu-img's thousands of syncs change
// nothing but the time taken).
class BorrowedNode final : public io::BlockNode {
 public:
  BorrowedNode(io::BlockNode& target, bool forward_flushes)
      : io::BlockNode(target.filename(), target.read_only()),
        target_(target),
        forward_flushes_(forward_flushes) {}

  uint64_t size() const override { return target_.size(); }
  absl::StatusOr<uint64_t> AllocatedSize() const override {
    return target_.AllocatedSize();
  }
  io::Task<absl::Status> Close() override { return target_.Flush(); }
  io::BlockNode* primary_child() const override { return &target_; }

 protected:
  io::Task<absl::Status> DoRead(uint64_t offset, io::IoVec buf) override {
    return target_.Read(offset, buf);
  }
  io::Task<absl::Status> DoWrite(uint64_t offset, io::ConstIoVec data) override {
    return target_.Write(offset, data);
  }
  io::Task<absl::Status> DoWriteZeroes(uint64_t offset, uint64_t length,
                                       io::WriteZeroesFlags flags) override {
    return target_.WriteZeroes(offset, length, flags);
  }
  io::Task<absl::Status> DoDiscard(uint64_t offset, uint64_t length) override {
    return target_.Discard(offset, length);
  }
  io::Task<absl::Status> DoFlush() override {
    if (forward_flushes_) co_return co_await target_.Flush();
    co_return absl::OkStatus();
  }
  io::Task<absl::Status> DoTruncate(uint64_t size,
                                    io::PreallocMode prealloc) override {
    return target_.Truncate(size, prealloc);
  }
  io::Task<absl::StatusOr<io::BlockStatus>> DoGetBlockStatus(
      uint64_t offset, uint64_t max_length) override {
    return target_.GetBlockStatus(offset, max_length);
  }

 private:
  io::BlockNode& target_;
  const bool forward_flushes_;
};

absl::Status NotAccepted(const std::string& parameter, const std::string& value) {
  return absl::InvalidArgumentError(absl::StrCat(
      "Parameter '", parameter, "' does not accept value '", value, "'"));
}

// Writes [0, layout.file_size) of a new image: the extents, zeroes between.
io::Task<absl::Status> WriteContents(io::BlockNode& file,
                                     const format::NewImageOptions& options,
                                     const format::NewImageLayout& layout) {
  const std::vector<format::FileExtent> extents =
      format::NewImageContents(options, layout);
  std::vector<uint8_t> buf;
  for (uint64_t pos = 0; pos < layout.file_size;) {
    const uint64_t n = std::min(kWriteChunk, layout.file_size - pos);
    buf.assign(n, 0);
    for (const format::FileExtent& e : extents) {
      const uint64_t from = std::max(pos, e.offset);
      const uint64_t to = std::min(pos + n, e.offset + e.bytes.size());
      if (from < to) {
        std::memcpy(buf.data() + (from - pos), e.bytes.data() + (from - e.offset),
                    to - from);
      }
    }
    CO_RETURN_IF_ERROR(co_await file.Write(pos, io::ConstIoVec(buf)));
    pos += n;
  }
  co_return absl::OkStatus();
}

}  // namespace

absl::StatusOr<CheckedCreateOptions> CheckCreateOptions(
    const Qcow2CreateOptions& options) {
  CheckedCreateOptions out;
  format::NewImageOptions& o = out.image;
  const std::string& compat = options.compat();
  if (compat.empty() || compat == "1.1" || compat == "v3") {
    o.version = 3;
  } else if (compat == "0.10" || compat == "v2") {
    o.version = 2;
  } else {
    return NotAccepted("version", compat);
  }
  const std::string& prealloc = options.preallocation();
  if (prealloc.empty() || prealloc == "off") {
    out.preallocation = io::PreallocMode::kOff;
  } else if (prealloc == "metadata") {
    out.preallocation = io::PreallocMode::kMetadata;
  } else if (prealloc == "falloc") {
    out.preallocation = io::PreallocMode::kFalloc;
  } else if (prealloc == "full") {
    out.preallocation = io::PreallocMode::kFull;
  } else {
    return NotAccepted("preallocation", prealloc);
  }
  o.size = options.size();
  o.cluster_size = options.has_cluster_size() ? options.cluster_size() : 65536;
  o.refcount_bits = options.has_refcount_bits() ? options.refcount_bits() : 16;
  o.extended_l2 = options.extended_l2();
  o.lazy_refcounts = options.lazy_refcounts();
  const std::string& compression = options.compression_type();
  if (compression.empty() || compression == "zlib") {
    o.compression_type = format::kCompressionZlib;
  } else if (compression == "zstd") {
    o.compression_type = format::kCompressionZstd;
  } else {
    return NotAccepted("compression-type", compression);
  }
  if (!options.backing_file().empty()) o.backing_file = options.backing_file();
  if (!options.backing_fmt().empty()) o.backing_format = options.backing_fmt();

  // QEMU's order: version vs extended L2, cluster size, backing file vs
  // preallocation, then the rest (ComputeNewImageLayout).
  if (o.version < 3 && o.extended_l2) {
    return absl::InvalidArgumentError(
        "Extended L2 entries are only supported with compatibility level 1.1 "
        "and above (use version=v3 or greater)");
  }
  if (!absl::has_single_bit(o.cluster_size) || o.cluster_size < 512 ||
      o.cluster_size > format::kMaxClusterSize) {
    return absl::InvalidArgumentError(
        "Cluster size must be a power of two between 512 and 2048k");
  }
  if (o.extended_l2 && o.cluster_size < 16384) {
    return absl::InvalidArgumentError(
        "Extended L2 entries are only supported with cluster sizes of at "
        "least 16384 bytes");
  }
  if (o.backing_file.has_value() &&
      out.preallocation != io::PreallocMode::kOff && !o.extended_l2) {
    return absl::InvalidArgumentError(
        "Backing file and preallocation can only be used at the same time if "
        "extended_l2 is on");
  }
  RETURN_IF_ERROR(format::ComputeNewImageLayout(o).status());
  return out;
}

io::Task<absl::Status> CreateQcow2(io::BlockNode& file,
                                   Qcow2CreateOptions options) {
  CO_ASSIGN_OR_RETURN(CheckedCreateOptions checked, CheckCreateOptions(options));
  if (checked.preallocation == io::PreallocMode::kOff) {
    CO_ASSIGN_OR_RETURN(format::NewImageLayout layout,
                        format::ComputeNewImageLayout(checked.image));
    co_return co_await WriteContents(file, checked.image, layout);
  }
  // QEMU creates an empty image, then resizes it with preallocation.
  format::NewImageOptions empty = checked.image;
  empty.size = 0;
  CO_ASSIGN_OR_RETURN(format::NewImageLayout layout,
                      format::ComputeNewImageLayout(empty));
  CO_RETURN_IF_ERROR(co_await WriteContents(file, empty, layout));
  const uint64_t size = (checked.image.size + 511) / 512 * 512;
  const bool preallocates_data =
      checked.preallocation != io::PreallocMode::kMetadata;
  CO_ASSIGN_OR_RETURN(
      std::unique_ptr<Qcow2Node> node,
      co_await Qcow2Node::Open(
          std::make_unique<BorrowedNode>(file, preallocates_data),
          Qcow2OpenOptions(), /*open_backing=*/nullptr));
  absl::Status st = co_await node->Truncate(size, checked.preallocation);
  absl::Status closed = co_await node->Close();
  CO_RETURN_IF_ERROR(st);
  co_return closed;
}

}  // namespace imgtool::qcow2

// The `raw` format driver with `offset` and/or `size` (QEMU 7.2's
// block/raw-format.c; facts from there and from qemu-img/qemu-io 7.2 runs):
// the image is the bytes [offset, offset + size) of its file. Without
// `size` the image runs to the end of the file (its length follows the
// file's). Without either option raw adds nothing but those events, and
// the registry uses the file node itself unless the file handles debug
// events (blkdebug).
//
// Requests are passed to the file at offset + `offset`; reads raise the
// debug event read_aio and writes write_aio on the file first (QEMU's
// raw_co_preadv/raw_co_pwritev, after the range check). With `size`, a
// request past the image's end fails with ENOSPC (QEMU's raw_adjust_offset;
// callers that check the length first, as qemu-io does, never get there).
// Block status is the file's at the shifted offset (host offsets are the
// file's). Resize: refused with `size` (kUnimplemented "Cannot resize
// fixed-size raw disks"), else the file is resized to offset + the new
// size.
//
// Units: bytes. Thread model: like every node, used from its engine's
// thread only.
#ifndef IMGTOOL_RAW_FORMAT_RAW_NODE_H_
#define IMGTOOL_RAW_FORMAT_RAW_NODE_H_

#include <cstdint>
#include <memory>
#include <optional>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "io/block_node.h"
#include "io/task.h"
#include "raw_format/raw_options.pb.h"

namespace imgtool::raw_format {

class RawNode final : public io::BlockNode {
 public:
  // The window `options` gives of `file` (ownership passes to the node,
  // also on error; the file is not closed on error). Checks, against the
  // file's length L (kInvalidArgument, QEMU's texts):
  //   "Offset (O) cannot be greater than size of the containing file (L)"
  //   "The sum of offset (O) and size (S) has to be smaller or equal to
  //    the  actual size of the containing file (L)"   (two spaces: QEMU's)
  //   "Specified size is not multiple of 512"
  static absl::StatusOr<std::unique_ptr<RawNode>> Open(
      std::unique_ptr<io::BlockNode> file, const RawOptions& options);

  // `size`, or the file's length after `offset` (0 if the file became
  // shorter than `offset`).
  uint64_t size() const override;
  // The file's.
  absl::StatusOr<uint64_t> AllocatedSize() const override {
    return file_->AllocatedSize();
  }
  io::BlockNode* primary_child() const override { return file_.get(); }
  // Closes the file.
  io::Task<absl::Status> Close() override;

  io::BlockNode& file() const { return *file_; }
  uint64_t offset() const { return offset_; }
  // The `size` option, if given.
  std::optional<uint64_t> fixed_size() const { return fixed_size_; }

 protected:
  io::Task<absl::Status> DoRead(uint64_t offset, io::IoVec buf) override;
  io::Task<absl::Status> DoWrite(uint64_t offset,
                                 io::ConstIoVec data) override;
  io::Task<absl::Status> DoWriteZeroes(uint64_t offset, uint64_t length,
                                       io::WriteZeroesFlags flags) override;
  io::Task<absl::Status> DoDiscard(uint64_t offset, uint64_t length) override;
  io::Task<absl::Status> DoFlush() override;
  io::Task<absl::Status> DoTruncate(uint64_t size,
                                    io::PreallocMode prealloc) override;
  io::Task<absl::StatusOr<io::BlockStatus>> DoGetBlockStatus(
      uint64_t offset, uint64_t max_length) override;

 private:
  RawNode(std::unique_ptr<io::BlockNode> file, uint64_t offset,
          std::optional<uint64_t> fixed_size);

  // ENOSPC unless [offset, offset + length) is inside a fixed size.
  absl::Status CheckRange(uint64_t offset, uint64_t length) const;

  std::unique_ptr<io::BlockNode> file_;
  const uint64_t offset_;
  const std::optional<uint64_t> fixed_size_;
};

}  // namespace imgtool::raw_format

#endif  // IMGTOOL_RAW_FORMAT_RAW_NODE_H_

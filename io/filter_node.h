// FilterNode: the base of a filter driver, a node with one child that it
// passes requests to (QEMU's drivers with is_filter, bdrv_filter_bs:
// copy-on-read, compress, preallocate). Every operation a subclass does not
// override goes to the child unchanged: the node's length and allocated
// size are the child's, Close closes the child, and each Do* calls the
// child's public operation with the same arguments (so the child does its
// own checks and raises its own debug events). The child is both
// primary_child() (breakpoints go down to it) and filtered_child() (backing
// chains and map look through the filter).
//
// Units: bytes. Ownership: the node owns its child. Thread model: like every
// node, used from its engine's thread only.
#ifndef IMGTOOL_IO_FILTER_NODE_H_
#define IMGTOOL_IO_FILTER_NODE_H_

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "io/block_node.h"
#include "io/task.h"

namespace imgtool::io {

class FilterNode : public BlockNode {
 public:
  uint64_t size() const override { return file_->size(); }
  absl::StatusOr<uint64_t> AllocatedSize() const override {
    return file_->AllocatedSize();
  }
  BlockNode* primary_child() const override { return file_.get(); }
  BlockNode* filtered_child() const override { return file_.get(); }
  // Closes the child; its error, if any.
  Task<absl::Status> Close() override;

  // The child; valid as long as this node.
  BlockNode& file() const { return *file_; }

 protected:
  // Takes `file` (non-null); the node has its file name and read-only flag.
  explicit FilterNode(std::unique_ptr<BlockNode> file);

  Task<absl::Status> DoRead(uint64_t offset, IoVec buf) override;
  Task<absl::Status> DoWrite(uint64_t offset, ConstIoVec data) override;
  Task<absl::Status> DoWriteZeroes(uint64_t offset, uint64_t length,
                                   WriteZeroesFlags flags) override;
  Task<absl::Status> DoDiscard(uint64_t offset, uint64_t length) override;
  Task<absl::Status> DoFlush() override;
  Task<absl::Status> DoTruncate(uint64_t size, PreallocMode prealloc) override;
  Task<absl::StatusOr<BlockStatus>> DoGetBlockStatus(
      uint64_t offset, uint64_t max_length) override;

 private:
  std::unique_ptr<BlockNode> file_;
};

}  // namespace imgtool::io

#endif  // IMGTOOL_IO_FILTER_NODE_H_

// The `quorum` driver (QEMU 7.2's block/quorum.c; facts from there and from
// qemu-io/qemu-img 7.2 runs): a format-like node over N >= 1 children of
// equal length that mirrors writes to all of them and answers reads by a
// vote on their contents.
//
// Reads (read-pattern=quorum, the default): every child is read (in order,
// one after the other). If fewer than vote-threshold children succeeded,
// the read fails with the errno most children failed with (VoteOnErrors).
// Otherwise the successful reads are grouped by content; the largest group
// wins (ties: the group whose first child comes last, as QEMU's vote list
// does); with fewer than vote-threshold members the read fails with EIO.
// The winner's bytes are returned; with rewrite-corrupted they are then
// written over the children of the other groups (errors ignored; children
// whose read failed are not rewritten). blkverify (two children,
// threshold 2): two successful reads that differ print "quorum: offset=O
// bytes=B contents mismatch at offset M" on stderr and end the process
// with exit status 1, as QEMU does.
// read-pattern=fifo: the children are read in order until one succeeds;
// the last error if none does.
//
// Writes and zero writes go to every child; they succeed when at least
// vote-threshold children succeeded, else fail with the errno most children
// failed with. Flush the same. Discard does nothing and succeeds (QEMU 7.2's
// quorum has no discard). Resize is kUnimplemented "Image format driver
// does not support resize" (QEMU's text).
//
// Length: that of the children, which must be equal counted in whole
// 512-byte sectors (QEMU's quorum_getlength), else Open fails with EIO
// "Could not refresh total sector count: Input/output error".
// Block status (QEMU's quorum_co_block_status): each child's status through
// its backing chain; "zero" for the shortest length all children report as
// zero, else "data" for the longest length a child reports as data; never
// an offset. Allocated size: the sum of the children's.
// Dirname: none (kInvalidArgument "Cannot generate a base directory for
// quorum nodes"): a relative backing file name of an image on a quorum
// node cannot be resolved.
//
// Units: bytes. Thread model: like every node, used from its engine's
// thread only.
#ifndef IMGTOOL_QUORUM_BLOCK_QUORUM_NODE_H_
#define IMGTOOL_QUORUM_BLOCK_QUORUM_NODE_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "io/block_node.h"
#include "io/task.h"
#include "quorum_block/quorum_options.pb.h"

namespace imgtool::quorum_block {

enum class ReadPattern { kQuorum, kFifo };

// QuorumOptions checked against the number of children.
struct QuorumSettings {
  int threshold = 0;
  bool blkverify = false;
  bool rewrite_corrupted = false;
  ReadPattern read_pattern = ReadPattern::kQuorum;
};

// QEMU 7.2's quorum_open checks, in its order, all kInvalidArgument with
// QEMU's texts: num_children < 1 "Number of provided children must be 1
// or more"; threshold < 1 "Parameter 'vote-threshold' expects a value >=
// 1"; threshold > num_children "threshold may not exceed children count";
// a read-pattern other than quorum/fifo "Please set read-pattern as fifo
// or quorum"; with read-pattern quorum: blkverify without exactly two
// children and threshold 2 "blkverify=on can only be set if there are
// exactly two files and vote-threshold is 2", blkverify with
// rewrite-corrupted "rewrite-corrupted=on cannot be used with
// blkverify=on". With fifo, blkverify and rewrite-corrupted are ignored
// (off).
absl::StatusOr<QuorumSettings> CheckQuorumOptions(const QuorumOptions& options,
                                                  int num_children);

// One child's answer to a read, for the vote.
struct ChildRead {
  absl::Status status;
  absl::Span<const uint8_t> data;  // valid if status.ok()
};

struct VoteResult {
  absl::Status status;      // OK, or why the read fails
  int winner = -1;          // child whose data the read returns (if OK)
  std::vector<int> losers;  // children read OK with other data
  // blkverify: the first byte (relative to the request) where the two
  // children differ, or -1.
  int64_t mismatch = -1;
};

// The failure of a request where fewer than the threshold of children
// succeeded (QEMU's quorum_vote_error): the failed children grouped by
// errno (StatusErrno); the largest group wins, ties to the group whose
// first child comes last; its first child's status is returned. OK if no
// child failed.
absl::Status VoteOnErrors(absl::Span<const absl::Status> statuses);

// The vote of a quorum-mode read (see the file comment). `filename` names
// the node in the EIO status of a lost vote.
VoteResult Vote(absl::Span<const ChildRead> reads,
                const QuorumSettings& settings, const std::string& filename);

class QuorumNode final : public io::BlockNode {
 public:
  // Takes the children (at least one, of lengths equal in whole 512-byte
  // sectors, else EIO as in the file comment); on error they stay in
  // `children`, for the caller to close. `name` is the node's name in
  // errors (its json:{...} name).
  static absl::StatusOr<std::unique_ptr<QuorumNode>> Open(
      std::vector<std::unique_ptr<io::BlockNode>>&& children,
      const QuorumSettings& settings, std::string name, bool read_only);

  uint64_t size() const override { return size_; }
  absl::StatusOr<uint64_t> AllocatedSize() const override;
  absl::StatusOr<std::string> Dirname() const override;
  io::Task<absl::Status> Close() override;

  const QuorumSettings& settings() const { return settings_; }
  const std::vector<std::unique_ptr<io::BlockNode>>& children() const {
    return children_;
  }

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
  QuorumNode(std::vector<std::unique_ptr<io::BlockNode>> children,
             const QuorumSettings& settings, std::string name, uint64_t size,
             bool read_only);

  io::Task<absl::Status> ReadQuorum(uint64_t offset, io::IoVec buf);
  io::Task<absl::Status> ReadFifo(uint64_t offset, io::IoVec buf);
  // OK if at least threshold of `statuses` are OK, else VoteOnErrors.
  absl::Status Tally(absl::Span<const absl::Status> statuses) const;

  std::vector<std::unique_ptr<io::BlockNode>> children_;
  const QuorumSettings settings_;
  const uint64_t size_;
};

}  // namespace imgtool::quorum_block

#endif  // IMGTOOL_QUORUM_BLOCK_QUORUM_NODE_H_

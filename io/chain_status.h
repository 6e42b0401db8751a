// Block status through a backing chain, as `map`, `convert` and `compare`
// need it: the first node of the chain (top = depth 0) that has the range
// allocated (data or zero) answers; ranges allocated nowhere read as zeroes
// and report depth = chain length with present = false (qemu-img map's
// "depth" and "present").
#ifndef IMGTOOL_IO_CHAIN_STATUS_H_
#define IMGTOOL_IO_CHAIN_STATUS_H_

#include <cstdint>

#include "absl/status/statusor.h"
#include "io/block_node.h"
#include "io/task.h"

namespace imgtool::io {

struct ChainStatus {
  BlockStatus status;   // from the node at `depth` (length clamped)
  int depth = 0;        // 0 = top node
  bool present = true;  // false: allocated in no node of the chain
};

// The backing node of `node`, looking through filters (QEMU's
// bdrv_cow_bs(bdrv_skip_filters(node)): blkdebug over qcow2 gives the qcow2
// node's backing node), or null. Not owned.
BlockNode* BackingBelow(BlockNode* node);

// Walks top, its backing node, ... for the range at `offset` (< top.size()),
// where the backing node of a filter (BlockNode::filtered_child) is that of
// the node it filters (blkdebug over qcow2: the qcow2 node's backing file),
// at most `max_length` bytes. A backing node shorter than the top reads as
// zeroes beyond its end, answered by the node above it (not present). Errors: those of GetBlockStatus.
Task<absl::StatusOr<ChainStatus>> GetChainStatus(BlockNode& top,
                                                 uint64_t offset,
                                                 uint64_t max_length);

}  // namespace imgtool::io

#endif  // IMGTOOL_IO_CHAIN_STATUS_H_

#include "io/chain_status.h"

#include <algorithm>

#include "base/status_macros.h"

namespace imgtool::io {

BlockNode* BackingBelow(BlockNode* node) {
  while (node->backing() == nullptr && node->filtered_child() != nullptr) {
    node = node->filtered_child();
  }
  return node->backing();
}

Task<absl::StatusOr<ChainStatus>> GetChainStatus(BlockNode& top,
                                                 uint64_t offset,
                                                 uint64_t max_length) {
  ChainStatus result;
  uint64_t length = std::min(max_length, top.size() - offset);
  BlockNode* node = &top;
  int depth = 0;
  while (true) {
    CO_ASSIGN_OR_RETURN(BlockStatus st,
                        co_await node->GetBlockStatus(offset, length));
    length = std::min(length, st.length);
    BlockNode* backing = BackingBelow(node);
    const bool allocated = st.data || st.zero;
    if (allocated || backing == nullptr || offset >= backing->size()) {
      // A protocol node (no backing) always answers; a format node answers
      // where it has the range allocated, and also past the end of a
      // shorter backing node, where the range reads as zeroes from this
      // layer (QEMU: depth of this node, not present, zero).
      st.length = length;
      result.status = st;
      result.depth = depth;
      result.present = allocated;
      if (!allocated) result.status.zero = true;  // reads as zeroes
      co_return result;
    }
    length = std::min(length, backing->size() - offset);
    node = backing;
    ++depth;
  }
}

}  // namespace imgtool::io

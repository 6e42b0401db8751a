#include "io/chain_status.h"

#include <algorithm>

#include "base/status_macros.h"

namespace imgtool::io {

Task<absl::StatusOr<ChainStatus>> GetChainStatus(BlockNode& top,
                                                 uint64_t offset,
                                                 uint64_t max_length) {
  ChainStatus result;
  uint64_t length = std::min(max_length, top.size() - offset);
  BlockNode* node = &top;
  int depth = 0;
  while (node != nullptr) {
    if (offset >= node->size()) {
      // Past the end of a shorter backing node: zeroes, not allocated.
      break;
    }
    CO_ASSIGN_OR_RETURN(BlockStatus st,
                        co_await node->GetBlockStatus(offset, length));
    length = std::min(length, st.length);
    if (st.data || st.zero || node->backing() == nullptr) {
      // A protocol node (no backing) always answers; a format node answers
      // where it has the range allocated.
      st.length = length;
      result.status = st;
      result.depth = depth;
      result.present = st.data || st.zero;
      if (!result.present) result.status.zero = true;  // reads as zeroes
      co_return result;
    }
    node = node->backing();
    ++depth;
  }
  result.status.length = length;
  result.status.zero = true;
  result.depth = depth;
  result.present = false;
  co_return result;
}

}  // namespace imgtool::io

#include "io/coalesce.h"

#include <cerrno>
#include <algorithm>
#include <climits>
#include <cstdint>

namespace imgtool::io {
namespace {

uint64_t Length(const Op& op) {
  uint64_t n = 0;
  for (int i = 0; i < op.iovcnt; ++i) n += op.iov[i].iov_len;
  return n;
}

}  // namespace

bool ContinuesRun(const Op& last, const Op& next) {
  return next.kind == last.kind && next.fd == last.fd &&
         (last.kind == OpKind::kRead || last.kind == OpKind::kWrite) &&
         next.offset == last.offset + Length(last);
}

void TakeRun(std::deque<Op*>& queue, uint64_t max_bytes, MergedRequest& run) {
  run.ops.clear();
  run.iov.clear();
  Op* first = queue.front();
  queue.pop_front();
  run.ops.push_back(first);
  run.bytes = Length(*first);
  max_bytes = std::min(max_bytes, kMaxMergedBytes);
  if (first->merge_limit != 0) max_bytes = std::min(max_bytes, first->merge_limit);
  int iovcnt = first->iovcnt;
  while (!queue.empty()) {
    const Op& next = *queue.front();
    if (!ContinuesRun(*run.ops.back(), next) ||
        iovcnt + next.iovcnt > IOV_MAX) {
      break;
    }
    const uint64_t n = Length(next);
    if (next.merge_limit != 0) max_bytes = std::min(max_bytes, next.merge_limit);
    if (run.bytes + n > max_bytes) break;
    if (run.iov.empty()) {
      run.iov.assign(first->iov, first->iov + first->iovcnt);
    }
    run.iov.insert(run.iov.end(), next.iov, next.iov + next.iovcnt);
    iovcnt += next.iovcnt;
    run.bytes += n;
    run.ops.push_back(queue.front());
    queue.pop_front();
  }
}

void SplitResult(const MergedRequest& run, int64_t result) {
  if (run.ops.size() == 1 || result < 0) {
    for (Op* op : run.ops) op->result = result;
    return;
  }
  // The first op always gets its share, even 0 bytes (end of file at the
  // run's start): each round of retries then settles at least one op, so
  // ops retried together (and merged again) cannot loop forever.
  uint64_t left = static_cast<uint64_t>(result);
  bool first = true;
  for (Op* op : run.ops) {
    if (left == 0 && !first) {
      op->result = -EAGAIN;
    } else {
      const uint64_t n = std::min(Length(*op), left);
      op->result = static_cast<int64_t>(n);
      left -= n;
    }
    first = false;
  }
}

}  // namespace imgtool::io

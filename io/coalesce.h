// Merging of adjacent reads or writes queued together into one request.
//
// A sequential stream at queue depth (a guest writing a file, qcow2
// allocating cluster after cluster) reaches an engine as many requests for
// consecutive byte ranges of one file, queued in the same Poll(). Handed to
// the kernel one by one, each costs the file system and the device a
// request of its own: on XFS and ext4 an O_DIRECT write into unwritten
// (preallocated) extents converts them at completion in a transaction per
// request, and a write that is not aligned to the file system block is run
// alone under the inode's exclusive lock. Merged, the run costs one of each.
// The Linux block layer does the same for bios (plug merging); this is the
// same idea one level up, before the file system.
//
// Only requests that are in flight together are merged, so no ordering the
// caller could rely on is lost: requests in flight at the same time have no
// order among themselves.
#ifndef IMGTOOL_IO_COALESCE_H_
#define IMGTOOL_IO_COALESCE_H_

#include <sys/uio.h>

#include <cstdint>
#include <deque>
#include <vector>

#include "io/engine.h"

namespace imgtool::io {

// Requests merged into one (a single request is a run of one).
struct MergedRequest {
  std::vector<Op*> ops;  // in byte order; not owned
  // The ops' buffers in order; empty for a run of one (its own iov is used).
  std::vector<struct iovec> iov;
  uint64_t bytes = 0;  // total length of the run

  const struct iovec* iovec_data() const {
    return ops.size() == 1 ? ops[0]->iov : iov.data();
  }
  int iovec_count() const {
    return ops.size() == 1 ? ops[0]->iovcnt : static_cast<int>(iov.size());
  }
};

// Most bytes one merged request carries (a run stops before it would pass
// this; a single request longer than it is never split).
inline constexpr uint64_t kMaxMergedBytes = 1 << 20;

// Whether `next` continues `last`: both reads or both writes of the same
// fd, `next` starting at the byte where `last` ends (TakeRun's test; its
// length limits aside).
bool ContinuesRun(const Op& last, const Op& next);

// Moves into `run` (cleared first) the read or write at the front of
// `queue` and every following one that continues it: the same kind and fd,
// starting at the byte where the previous one ends, with at most IOV_MAX
// buffers and kMaxMergedBytes bytes in total (`max_bytes` or an op's
// Op::merge_limit when smaller).
// `queue` must start with a kRead or kWrite Op.
void TakeRun(std::deque<Op*>& queue, uint64_t max_bytes, MergedRequest& run);

// Sets each op's `result` from the merged request's `result` (bytes or
// -errno): an error goes to every op; a byte count is handed out in order.
// An op after the first that got no byte of a short count gets -EAGAIN,
// which its caller retries (a short count stays a short count for the op
// it ends in, as for a request that was not merged; the first op gets its
// share even when that is 0, so each retry round settles at least one op).
void SplitResult(const MergedRequest& run, int64_t result);

}  // namespace imgtool::io

#endif  // IMGTOOL_IO_COALESCE_H_

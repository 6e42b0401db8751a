// The `copy-on-read` filter driver (QEMU 7.2's block/copy-on-read.c and the
// copy-on-read path of block/io.c, bdrv_co_do_copy_on_readv, for the
// semantics): sits over an image (its `file` child, normally a qcow2 node
// with a backing chain, possibly behind filters such as blkdebug) and makes
// every read whose data comes from the child's backing chain write that
// data into the child, so that the next read finds it in the top image.
// `qemu-io -C` / `open -C` open an image with this filter on top
// (imgtool/image.h, ImageSpec::copy_on_read).
//
// Reads. A read fully allocated in the child's own layer (data or zero,
// as QEMU's bdrv_is_allocated) is passed through. Otherwise the request is
// widened to whole clusters of the child (`cluster_size`; the request's own
// bounds if 0) and walked in runs of one allocation state: an allocated run
// is read from the child as it is (only the requested part); an
// unallocated run is read from the child whole, in pieces of at most
// kMaxBounceBytes (16 MiB), the debug event cor_write is raised on the
// child, and the piece is written back into the child: as a zero write
// (without unmap) if it reads as zeroes, else as data; then the requested
// part is copied out. A run that reaches past the child's end stops the
// walk (QEMU: a partial final cluster). Any error fails the read.
// With `bottom` (a node of the child's backing chain, not a filter), only
// data from the layers from the child's backing node down to `bottom`
// (inclusive) is copied: runs allocated in none of them (only below
// bottom, or nowhere) are plain reads, and the walk ends early where the
// layers above bottom end (QEMU's cor_co_preadv_part).
//
// Writes, zero writes, discards, flushes, truncates and block status pass
// through to the child (QEMU: a filter). The child must be writable:
// opening over a read-only child is QEMU's "Block node is read-only"
// (block/registry.cc checks it before opening).
//
// Concurrent requests are tracked as QEMU's (io::TrackedRequests): a read
// is serialising over its range widened to whole clusters, so it waits for
// every overlapping request in flight and they wait for it; writes, zero
// writes and discards wait only for such reads. A write that arrives while
// a read copies its cluster therefore lands after the copy and is never
// overwritten by the older data from the backing chain, and two reads of
// one cluster copy it once. (QEMU makes only the reads it copies for
// serialising; imgtool makes every read through the filter so, which can
// only delay requests, never change their results.)
//
// Difference from QEMU 7.2: the write-back goes through the child's public
// Write/WriteZeroes, so the child also raises pwritev/pwritev_zero and
// pwritev_done (QEMU's bdrv_driver_pwritev does not).
//
// Units: bytes. Thread model: like every node, used from its engine's
// thread only.
#ifndef IMGTOOL_COR_FILTER_COR_FILTER_H_
#define IMGTOOL_COR_FILTER_COR_FILTER_H_

#include <cstdint>
#include <memory>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "io/block_node.h"
#include "io/filter_node.h"
#include "io/sync.h"
#include "io/task.h"

namespace imgtool::cor_filter {

// The largest piece copied at once (QEMU's MAX_BOUNCE_BUFFER).
inline constexpr uint64_t kMaxBounceBytes = uint64_t{16} << 20;
// The longest run asked for at once (QEMU's BDRV_REQUEST_MAX_BYTES).
inline constexpr uint64_t kMaxRequestBytes = 2147483136;

// What the filter needs besides its child.
struct CorSettings {
  // The child's cluster size in bytes (QEMU's bdrv_get_info through
  // filters: a qcow2 node's cluster size); 0: unknown (no widening).
  uint64_t cluster_size = 0;
  // The `bottom` node, a node of the child's backing chain (not owned;
  // it outlives the filter as the child owns it); null: none.
  io::BlockNode* bottom = nullptr;
};

// Flush, truncate, block status, length and close: io::FilterNode's (the
// child's).
class CorNode final : public io::FilterNode {
 public:
  // The filter over `file` (ownership passes to the node). The caller
  // checked that `file` is writable and that `settings.bottom` is a
  // non-filter node below it.
  CorNode(std::unique_ptr<io::BlockNode> file, CorSettings settings);

 protected:
  io::Task<absl::Status> DoRead(uint64_t offset, io::IoVec buf) override;
  io::Task<absl::Status> DoWrite(uint64_t offset,
                                 io::ConstIoVec data) override;
  io::Task<absl::Status> DoWriteZeroes(uint64_t offset, uint64_t length,
                                       io::WriteZeroesFlags flags) override;
  io::Task<absl::Status> DoDiscard(uint64_t offset, uint64_t length) override;

 private:
  // A tracked request over [offset, offset + bytes), widened to whole
  // clusters if serialising.
  io::TrackedRequests::Request Span(uint64_t offset, uint64_t bytes,
                                    bool serialising) const;
  // DoRead once tracked: the copying walk described above.
  io::Task<absl::Status> ReadCopying(uint64_t offset, io::IoVec buf);
  // Reads [offset, offset + buf.size()) of the child, copying what its own
  // layer lacks into it (QEMU's read with BDRV_REQ_COPY_ON_READ).
  io::Task<absl::Status> CopyOnRead(uint64_t offset, io::IoVec buf);

  const CorSettings settings_;
  io::TrackedRequests tracked_;  // requests in flight through the filter
};

// Whether [offset, offset + n) of `node`'s own layer is allocated (data or
// zero; QEMU's bdrv_is_allocated), with n in 1..max_length; (false, 0) at
// or past the node's end. Through filters, the layer of the node below.
io::Task<absl::StatusOr<std::pair<bool, uint64_t>>> IsAllocated(
    io::BlockNode& node, uint64_t offset, uint64_t max_length);

// The first node of the backing chain below `node` (its backing node, or
// that of the first node with one going down through filters' and raw's
// primary_child()), or null (QEMU's bdrv_backing_chain_next).
io::BlockNode* BackingChainNext(io::BlockNode& node);

}  // namespace imgtool::cor_filter

#endif  // IMGTOOL_COR_FILTER_COR_FILTER_H_

// The `compress` filter driver (QEMU 7.2's block/filter-compress.c and the
// request padding of block/io.c, for the semantics): sits over a format
// node that can write compressed clusters (its `file` child; only qcow2
// here) and turns every data write into a compressed write, as qemu-io's
// `write -c` does. Reads, zero writes, discards, flushes, truncates and
// block status pass through to the child (QEMU: a filter).
//
// Alignment. QEMU gives the filter a request alignment of the child's
// cluster size (`cluster_size`), so the block layer pads unaligned
// requests to whole clusters before they reach the driver; this node does
// the same padding itself:
// - A data write not aligned at either end reads the partial head and tail
//   clusters from the child (once if they are the same cluster), lays the
//   data over them and writes the widened range compressed (one request).
// - A zero write not aligned at either end writes its partial head and
//   tail clusters as compressed data (the cluster read from the child with
//   the range zeroed), and passes its aligned middle to the child as a
//   zero write with the caller's flags, in that order (head, middle, tail).
// Compression can't overwrite anything: a compressed write to a cluster the
// child has allocated already fails with EIO (QEMU's), which qemu-io prints
// as "write failed: Input/output error"; the clusters before it are
// written. A write past the end of the child is cut at its end.
//
// Opening (block/registry.cc): the child must be a qcow2 node ("Compression
// is not supported for underlying format: raw", QEMU's ENOTSUP), and a
// read-write filter needs the child's size to be a multiple of its cluster
// size ("Cannot get 'write' permission without 'resize': Image size is not
// a multiple of request alignment", block.c's permission check).
//
// Differences from QEMU 7.2: a multi-cluster compressed write compresses
// and allocates its clusters one after another in guest order (QEMU runs
// up to QCOW2_MAX_WORKERS of them at once, so its host layout of such a
// write may differ; the guest data is the same); concurrent overlapping
// writes are serialised by a lock over the whole filter rather than per
// cluster.
//
// Units: bytes. Thread model: like every node, used from its engine's
// thread only.
#ifndef IMGTOOL_COMPRESS_FILTER_COMPRESS_FILTER_H_
#define IMGTOOL_COMPRESS_FILTER_COMPRESS_FILTER_H_

#include <cstdint>
#include <functional>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "io/block_node.h"
#include "io/filter_node.h"
#include "io/sync.h"
#include "io/task.h"

namespace imgtool::compress_filter {

// Writes `data` compressed at `offset` of the child: `offset` cluster
// aligned, `data` whole clusters or ending at the child's end
// (qcow2::Qcow2Node::WriteCompressed). kFailedPrecondition if a cluster is
// allocated already; other errors are the child's.
using CompressedWrite =
    std::function<io::Task<absl::Status>(uint64_t offset, io::ConstIoVec data)>;

// What the filter needs besides its child.
struct CompressSettings {
  // The child's cluster size in bytes (> 0): the filter's request
  // alignment.
  uint64_t cluster_size = 0;
  // The child's compressed write; must stay valid as long as the child.
  CompressedWrite write_compressed;
};

// Reads, discards, flushes, truncates, block status, length and close:
// io::FilterNode's (the child's).
class CompressNode final : public io::FilterNode {
 public:
  // The filter over `file` (ownership passes to the node). The caller
  // checked that `file` can write compressed clusters
  // (settings.write_compressed) and that settings.cluster_size > 0.
  CompressNode(std::unique_ptr<io::BlockNode> file, CompressSettings settings);

  uint64_t cluster_size() const { return settings_.cluster_size; }

  // A zero-length write at `offset` (BlockNode::Write drops those before
  // DoWrite). QEMU's block layer passes one on when `offset` is a multiple
  // of the request alignment, the cluster size, and drops it otherwise;
  // qcow2's compressed write then pads its file to a multiple of 512 bytes
  // (as at the end of `convert -c`). Errors: the child's truncate.
  io::Task<absl::Status> WriteEmpty(uint64_t offset);

 protected:
  io::Task<absl::Status> DoWrite(uint64_t offset,
                                 io::ConstIoVec data) override;
  io::Task<absl::Status> DoWriteZeroes(uint64_t offset, uint64_t length,
                                       io::WriteZeroesFlags flags) override;

 private:
  // Writes [offset, offset + data.size()) (cluster aligned at the start;
  // cut at the child's end) compressed; a cluster allocated already is EIO.
  io::Task<absl::Status> WriteAligned(uint64_t offset, io::ConstIoVec data);
  // Writes one cluster at `cluster_start` compressed: the child's bytes
  // there with [from, to) (offsets inside the cluster) zeroed.
  io::Task<absl::Status> ZeroPartOfCluster(uint64_t cluster_start,
                                           uint64_t from, uint64_t to);

  const CompressSettings settings_;
  io::Mutex write_lock_;  // one padded write or zero write at a time
};

}  // namespace imgtool::compress_filter

#endif  // IMGTOOL_COMPRESS_FILTER_COMPRESS_FILTER_H_

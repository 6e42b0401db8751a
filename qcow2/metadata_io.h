// What the qcow2 metadata code (refcounts, allocation) needs from the node
// that owns it: checked metadata writes, file syncs, header updates and the
// corruption signal. Implemented by Qcow2Node.
// Thread model: engine thread, under the node's metadata lock.
#ifndef IMGTOOL_QCOW2_METADATA_IO_H_
#define IMGTOOL_QCOW2_METADATA_IO_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "io/block_node.h"
#include "io/task.h"

namespace imgtool::qcow2 {

// Kinds of metadata for the pre-write overlap check (QEMU 7.2's
// QCow2MetadataOverlap bits, block/qcow2.h). Which kinds a node checks is
// its `overlap-check` option (Qcow2Node::OverlapChecks).
enum Overlap : uint32_t {
  kOverlapHeader = 1u << 0,
  kOverlapActiveL1 = 1u << 1,
  kOverlapActiveL2 = 1u << 2,
  kOverlapRefcountTable = 1u << 3,
  kOverlapRefcountBlock = 1u << 4,
  kOverlapSnapshotTable = 1u << 5,
  kOverlapInactiveL1 = 1u << 6,
  kOverlapInactiveL2 = 1u << 7,
  kOverlapBitmapDirectory = 1u << 8,
};
// QEMU's templates: QCOW2_OL_CONSTANT (no table walks), QCOW2_OL_CACHED
// (the default: what is in memory) and QCOW2_OL_ALL (inactive L2 tables
// too, which reads every snapshot's L1 table on every check).
inline constexpr uint32_t kOverlapConstant =
    kOverlapHeader | kOverlapActiveL1 | kOverlapRefcountTable |
    kOverlapSnapshotTable | kOverlapBitmapDirectory;
inline constexpr uint32_t kOverlapCached = kOverlapConstant |
                                           kOverlapActiveL2 |
                                           kOverlapRefcountBlock |
                                           kOverlapInactiveL1;
inline constexpr uint32_t kOverlapAll = kOverlapCached | kOverlapInactiveL2;

class MetadataIo {
 public:
  virtual ~MetadataIo() = default;

  // Writes `data` at `offset` of the image file after checking that the
  // range overlaps no metadata except the kinds in `ignore` (an overlap
  // marks the image corrupt and fails with kDataLoss).
  virtual io::Task<absl::Status> WriteMetadata(uint64_t offset,
                                               io::ConstIoVec data,
                                               uint32_t ignore) = 0;
  // Reads metadata bytes from the image file.
  virtual io::Task<absl::Status> ReadMetadata(uint64_t offset,
                                              io::IoVec buf) = 0;
  // Makes everything written so far durable (fdatasync).
  virtual io::Task<absl::Status> SyncFile() = 0;
  // Marks the image corrupt ("qcow2: Marking image as corrupt: <message>")
  // and returns the kDataLoss error every later request fails with.
  virtual io::Task<absl::Status> SignalCorruption(std::string message) = 0;
  // Points the header at a new refcount table (written and synced).
  virtual io::Task<absl::Status> SetRefcountTable(uint64_t offset,
                                                  uint32_t clusters) = 0;
  // The refcount of the cluster at `offset` dropped to 0: forget cached
  // copies of it.
  virtual void ClusterFreed(uint64_t offset) = 0;
  // Called first by every cluster allocation (Refcounts::Allocate,
  // AllocateAt, AllocateBytes): the owner may apply frees it deferred, so
  // that the allocation finds those clusters free again, as QEMU's
  // allocator does (a free lowers its free_cluster_index at once). An error
  // fails the allocation.
  virtual io::Task<absl::Status> BeforeAllocate() = 0;
  // Current length of the image file in bytes.
  virtual uint64_t FileSize() const = 0;
  // Raises a debug event on the image file (QEMU's BLKDBG_EVENT(bs->file,
  // event)); co_await it. Default: nothing handles it.
  virtual io::DebugEventAwaitable FileDebugEvent(io::BlkdebugEvent event) {
    (void)event;
    return io::DebugEventAwaitable();
  }
  // Whether FileDebugEvent can do anything (the file is blkdebug): when it
  // cannot, a caller may skip the events of a step it does synchronously.
  virtual bool FileHandlesDebugEvents() const { return false; }
};

// ReadMetadata / WriteMetadata after raising `event` on the file (the
// table caches' loads and write-backs, as QEMU's qcow2_cache_do_get and
// qcow2_cache_entry_flush: l2_load on an L2 table read, l2_update and
// refblock_update_part on a write-back).
inline io::Task<absl::Status> ReadMetadataAfter(MetadataIo& io,
                                                io::BlkdebugEvent event,
                                                uint64_t offset,
                                                io::IoVec buf) {
  co_await io.FileDebugEvent(event);
  co_return co_await io.ReadMetadata(offset, buf);
}
inline io::Task<absl::Status> WriteMetadataAfter(MetadataIo& io,
                                                 io::BlkdebugEvent event,
                                                 uint64_t offset,
                                                 io::ConstIoVec data,
                                                 uint32_t ignore) {
  co_await io.FileDebugEvent(event);
  co_return co_await io.WriteMetadata(offset, data, ignore);
}

}  // namespace imgtool::qcow2

#endif  // IMGTOOL_QCOW2_METADATA_IO_H_

// QEMU 7.2's qcow2_free_clusters as its callers see it, for the frees
// whose failure QEMU only prints (the old snapshot table, a deleted
// snapshot's L1 table): private to the qcow2 driver.
#ifndef IMGTOOL_QCOW2_FREE_CLUSTERS_H_
#define IMGTOOL_QCOW2_FREE_CLUSTERS_H_

#include <cerrno>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "base/errno_status.h"
#include "base/status_macros.h"
#include "io/task.h"
#include "qcow2/format/refcount.h"
#include "qcow2/refcounts.h"

namespace imgtool::qcow2 {

// The errno qcow2_free_clusters fails with for a failed Refcounts::Free:
// the status's own, EFBIG for a refcount table that would exceed its
// maximum size (qcow2_refcount_area's -EFBIG), else EIO.
inline int FreeErrno(const absl::Status& st) {
  if (const int e = StatusErrno(st); e != 0) return e;
  if (st.code() == absl::StatusCode::kResourceExhausted) return EFBIG;
  if (st.code() == absl::StatusCode::kInvalidArgument) return EINVAL;
  return EIO;
}

// Decrements the refcounts of the clusters of [offset, offset + length)
// as qcow2_free_clusters: when a cluster whose refcount block exists has
// refcount 0, update_refcount fails with EINVAL and undoes the clusters
// before it, so nothing changes and the image is not marked corrupt
// (returned as an ErrnoStatus with EINVAL). A range that reaches a
// cluster without a refcount block first goes through Refcounts::Update,
// which allocates the block as QEMU's alloc_refcount_block does (EFBIG
// through FreeErrno when the table cannot grow so far). Other errors are
// the file's.
inline io::Task<absl::Status> FreeClustersAsQemu(Refcounts& refcounts,
                                                 uint32_t cluster_bits,
                                                 uint32_t refcount_order,
                                                 uint64_t offset,
                                                 uint64_t length) {
  if (length == 0) co_return absl::OkStatus();
  // qcow2_free_clusters raises cluster_free before update_refcount reads
  // anything, so an error blkdebug injects on that event fails the reads
  // below (iotest 217: "qcow2_free_clusters failed: Input/output error").
  // Free of no bytes raises the event alone.
  CO_RETURN_IF_ERROR(co_await refcounts.Free(offset, 0));
  const uint64_t mask = (uint64_t{1} << cluster_bits) - 1;
  const std::vector<uint64_t>& table = refcounts.table();
  for (uint64_t c = offset & ~mask; c <= ((offset + length - 1) & ~mask);
       c += mask + 1) {
    const uint64_t index =
        format::RefcountTableIndex(c, cluster_bits, refcount_order);
    if (index >= table.size() ||
        (table[index] & format::kRefcountTableOffsetMask) == 0) {
      break;  // the allocation comes first
    }
    CO_ASSIGN_OR_RETURN(const uint64_t refcount,
                        co_await refcounts.Get(c >> cluster_bits));
    if (refcount == 0) {
      co_return ErrnoStatus("", "qcow2_free_clusters", EINVAL);
    }
  }
  co_return co_await refcounts.Update(offset, length, 1, /*decrease=*/true);
}

}  // namespace imgtool::qcow2

#endif  // IMGTOOL_QCOW2_FREE_CLUSTERS_H_

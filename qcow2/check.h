// qcow2 consistency check and repair, as `qemu-img check [-r leaks|all]`
// does it (QEMU 7.2, block/qcow2-refcount.c: qcow2_check_refcounts, and
// qcow2_co_check_locked in block/qcow2.c).
//
// The checker works on the image FILE (the protocol node under a qcow2 node)
// and keeps its own state; it does not need, and must not run beside, an
// open qcow2 node on the same file. It computes the reference count every
// host cluster should have (header, refcount table and blocks, active and
// snapshot L1 tables, L2 tables, data clusters, the byte ranges of compressed
// clusters, snapshot table, bitmap directory and tables, encryption header),
// compares it with the stored refcount, checks the COPIED flags of the active
// tables, and prints one line per problem to `messages` in QEMU's words:
//
//   Leaked cluster 5 refcount=1 reference=0
//   ERROR cluster 5 refcount=1 reference=2
//   ERROR found l2 entry with reserved bits set: 8000000000050002
//   ERROR l2_offset=40200: Table is not cluster aligned; L1 entry corrupted
//   ERROR: counting reference for region exceeding the end of the file by
//     one cluster or more: offset 0x100000000 size 0x10000   (one line)
//   ERROR OFLAG_COPIED data cluster: l2_entry=8000000000050000 refcount=2
//   Repairing cluster 5 refcount=1 reference=2
//
// Memory is bounded by the size of the image file: the computed refcounts
// are one packed array of refcount_bits per host cluster of the file (like a
// refcount block), and a table entry pointing past the end of the file is
// reported, never used to size anything. Besides that array the checker
// holds at most one L2 table, one refcount block, the refcount table (at
// most 8 MiB, QEMU's limit) and the part of the active L1 table inside the
// file.
//
// Repair (RepairMode::kLeaks / kAll) follows QEMU: leaked clusters get the
// refcount that the references say; kAll also raises too-low refcounts,
// fixes COPIED flags, zeroes misaligned preallocated zero clusters, and
// rebuilds the refcount table and blocks when a stored refcount of an
// in-use cluster is 0 or a refcount block is unusable. Write order is
// crash-safe: refcount changes are written and flushed before COPIED flags
// that rely on them, and a rebuilt refcount structure is written to free
// clusters and flushed before the header switches to it in one 12-byte
// write; clusters are freed (and their bytes discarded) only after the
// refcounts saying so are on disk. After a repair that fixed something the
// image is checked again (QEMU's "Double checking the fixed image now...").
//
// Thread model: a coroutine on the file node's engine thread.
#ifndef IMGTOOL_QCOW2_CHECK_H_
#define IMGTOOL_QCOW2_CHECK_H_

#include <cstdint>
#include <ostream>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "io/block_node.h"
#include "io/task.h"

namespace imgtool::qcow2 {

// qemu-img check -r: none, "leaks", "all".
enum class RepairMode { kNone, kLeaks, kAll };

// What `qemu-img check` reports (QEMU's BdrvCheckResult). Counts are of
// problems, clusters are host clusters for the refcount counts and guest
// clusters for the *_clusters statistics of the active L1 table.
struct CheckResult {
  uint64_t corruptions = 0;        // errors left in the image
  uint64_t leaks = 0;              // clusters with refcount > references
  uint64_t check_errors = 0;       // internal errors: the check is incomplete
  uint64_t corruptions_fixed = 0;  // by the repair pass
  uint64_t leaks_fixed = 0;        // by the repair pass
  // Bytes: end of the highest cluster that is in use or has a refcount.
  uint64_t image_end_offset = 0;
  uint64_t total_clusters = 0;      // guest clusters of the virtual size
  uint64_t allocated_clusters = 0;  // guest clusters with host data
  uint64_t fragmented_clusters = 0;
  uint64_t compressed_clusters = 0;
  // The image has persistent bitmaps (a bitmaps extension QEMU loads): a
  // read-write open of the qcow2 driver stores them again at close, which
  // `qemu-img check -r` does after checking (imgtool/check.cc).
  bool has_bitmaps = false;
};

// Checks (and with `mode` != kNone repairs) the qcow2 image in `file`, which
// must be writable for a repair. Problem lines go to `messages` (qemu-img's
// stderr). With a repair that fixed anything the image is checked a second
// time without repairing; the result then has that second check's counts
// plus the first one's *_fixed counts, as qemu-img reports it.
//
// Errors: the check could not be done or completed (qemu-img exit code 1),
// with the whole message to print:
//  * "Could not open '<file>': <cause>" when the header is not a valid qcow2
//    header (format::DecodeHeader's message);
//  * "Check failed: <cause>" when the check had to stop, e.g. "Check failed:
//    Input/output error" when `-r leaks` finds a refcount structure that
//    needs rebuilding, or an I/O error of `file`.
// Check errors that do not stop the check are counted in check_errors.
io::Task<absl::StatusOr<CheckResult>> CheckQcow2(io::BlockNode& file,
                                                 RepairMode mode,
                                                 std::ostream& messages);

// For a qcow2 driver opening an image whose dirty bit is set (lazy
// refcounts): repairs the refcounts like `check -r all` and clears the dirty
// bit (QEMU: qcow2_do_open's "Repair image if dirty"). Run it on the file
// before the driver reads any metadata. Problem lines go to `messages` if
// not null (QEMU prints them on stderr). kDataLoss "Could not repair dirty
// image" (with the cause) if the check fails or has check errors.
io::Task<absl::Status> RebuildRefcounts(io::BlockNode& file,
                                        std::ostream* messages = nullptr);

}  // namespace imgtool::qcow2

#endif  // IMGTOOL_QCOW2_CHECK_H_

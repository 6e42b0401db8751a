// Reading a qcow2 snapshot table from its file as QEMU 7.2's
// qcow2_do_read_snapshots does (block/qcow2-snapshot.c), entry by entry
// through format/snapshot.h. Shared by the qcow2 driver's open
// (Qcow2Node) and `check` (which reads it with repair). Bytes past the end
// of the file read as zeroes, as QEMU's bdrv_pread of a short file gives
// them: a table past the end is a table of empty entries.
// Thread model: a coroutine on the file node's engine thread.
#ifndef IMGTOOL_QCOW2_SNAPSHOT_LOAD_H_
#define IMGTOOL_QCOW2_SNAPSHOT_LOAD_H_

#include <cstdint>
#include <ostream>
#include <vector>

#include "absl/status/statusor.h"
#include "io/block_node.h"
#include "io/task.h"
#include "qcow2/format/snapshot.h"

namespace imgtool::qcow2 {

struct LoadedSnapshots {
  std::vector<format::SnapshotEntry> entries;  // in table order
  // QEMU's snapshots_size: from the table's offset to the end of the last
  // entry's name (the extra data as stored, even when cut).
  uint64_t bytes = 0;
  // Repair only: entries whose extra data was cut to
  // format::kMaxSnapshotExtraData, and entries dropped from the end of the
  // table for making it too big (each a corruption to `check`).
  uint64_t extra_cut = 0;
  uint64_t dropped = 0;
};

// Reads `nb` entries of the table at `offset` (the caller checked both, as
// qcow2_validate_table) of `file`. `default_disk_size`: the disk size of an
// entry whose extra data lacks it (QEMU: the image's size in whole 512-byte
// sectors). `repair` null: an entry with more than 1024 bytes of extra data,
// or a table longer than format::kMaxSnapshotTableBytes, fails with EFBIG
// (StatusErrno) and QEMU's two-line message ("Too much extra metadata in
// snapshot table entry N" / "Snapshot table is too big", then the
// "You can force-remove ... with qemu-img check -r all" hint). `repair`
// given (`check -r all`): the extra data is cut and the overhanging entries
// dropped instead, with QEMU's "Discarding ..." lines written to *repair as
// they happen. A read of `file` failing, or reaching past QEMU's
// BDRV_MAX_LENGTH (2^63 - 2^30: EIO, as bdrv_check_request), fails with its
// errno (StatusErrno) and "Failed to read snapshot table: <strerror>".
// `file` is not owned.
io::Task<absl::StatusOr<LoadedSnapshots>> LoadSnapshotTable(
    io::BlockNode& file, uint64_t offset, uint32_t nb,
    uint64_t default_disk_size, std::ostream* repair);

}  // namespace imgtool::qcow2

#endif  // IMGTOOL_QCOW2_SNAPSHOT_LOAD_H_

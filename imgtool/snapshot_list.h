// The internal snapshot table as qemu-img 7.2 shows it: `info` (human and
// JSON, through info.proto's SnapshotInfo) and `snapshot -l` print the same
// rows (QEMU's bdrv_snapshot_dump under one header line), built from the
// qcow2 driver's records (qcow2::Qcow2Node::Snapshots, which reads and
// checks the table; qcow2 spec, "Snapshots").
#ifndef IMGTOOL_SNAPSHOT_LIST_H_
#define IMGTOOL_SNAPSHOT_LIST_H_

#include <string>

#include "google/protobuf/repeated_ptr_field.h"
#include "imgtool/info.pb.h"
#include "qcow2/qcow2_node.h"

namespace imgtool::cli {

// One table entry as qemu-img's query-image data: the VM clock split into
// seconds and nanoseconds, `icount` left out where the entry stores none
// (-1 or no extra data for it), the VM state size in bytes (the 64-bit
// extra-data field when present).
SnapshotInfo SnapshotInfoOf(const qcow2::Qcow2Node::SnapshotRecord& record);

// "Snapshot list:", the header line and one line per snapshot: id, name,
// VM state size (human), date in the local time zone, VM clock
// (HH:MM:SS.mmm) and icount (empty when absent), with QEMU's column widths.
std::string FormatSnapshotList(
    const google::protobuf::RepeatedPtrField<SnapshotInfo>& snapshots);

}  // namespace imgtool::cli

#endif  // IMGTOOL_SNAPSHOT_LIST_H_
